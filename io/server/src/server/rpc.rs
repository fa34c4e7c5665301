//! JSON-RPC 2.0 and the MCP methods: `initialize`, `ping`, `tools/list`, `tools/call`, and the
//! notifications and responses a client may send (accepted, 202).

// The refusal *is* the response to send; boxing it would only add an allocation per refusal.
#![allow(clippy::result_large_err)]

use std::collections::BTreeSet;
use std::time::Instant;

use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use relay_core::ledger::{
    Actor, Answer, ClaimOpts, Claimed, Disposition, NewTodo, Op, Outcome, Report, TodoFilter,
};
use relay_core::wire::{
    self, ClaimOut, GetTodoOut, LeaseToken, ListTodosOut, TodoOut, Tool, ToolCall, lease_ttl_ms,
};
use relay_core::{Error, ErrorCode};
use serde_json::{Value, json};

use super::doorbell::Offer;
use super::session::{check_session, rpc_error};
use super::{PROTOCOL_VERSIONS, Server};
use crate::store::Endpoint;

pub(crate) const PARSE_ERROR: i64 = -32700;
pub(crate) const INVALID_REQUEST: i64 = -32600;
pub(crate) const METHOD_NOT_FOUND: i64 = -32601;
pub(crate) const INVALID_PARAMS: i64 = -32602;
pub(crate) const INTERNAL_ERROR: i64 = -32603;

/// What to answer.
pub(crate) enum Reply {
    /// 202, no body: a notification or a response was received.
    Accepted,
    Json {
        status: StatusCode,
        body: Value,
        /// A new session id for the `Mcp-Session-Id` header (on `initialize`).
        session: Option<String>,
    },
    Raw(Response),
}

/// One JSON-RPC message, shape-checked.
pub(crate) enum Message {
    Request {
        id: Value,
        method: String,
        params: Option<Value>,
    },
    Notification,
    Response,
}

/// Parses a body into one JSON-RPC message. Invalid UTF-8 or JSON is a parse error; a batch or
/// anything that is not a JSON-RPC 2.0 object is an invalid request.
pub(crate) fn parse(bytes: &[u8]) -> Result<Message, Response> {
    let parse_error = |what: &str| {
        rpc_error(
            StatusCode::BAD_REQUEST,
            Value::Null,
            PARSE_ERROR,
            &format!("parse error: {what}; send one JSON-RPC 2.0 request as a UTF-8 JSON object"),
        )
    };
    let Ok(text) = std::str::from_utf8(bytes) else {
        return Err(parse_error("the body is not valid UTF-8"));
    };
    let value: Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(e) => return Err(parse_error(&format!("the body is not JSON ({e})"))),
    };
    let invalid = |id: Value, what: &str| {
        rpc_error(
            StatusCode::BAD_REQUEST,
            id,
            INVALID_REQUEST,
            &format!("invalid request: {what}"),
        )
    };
    let Value::Object(obj) = value else {
        if value.is_array() {
            return Err(invalid(
                Value::Null,
                "JSON-RPC batches are not supported (MCP 2025-06-18 removed them); send one \
                 message per request",
            ));
        }
        return Err(invalid(
            Value::Null,
            "the body must be a JSON-RPC 2.0 object",
        ));
    };
    let id = obj.get("id").cloned();
    let id_ok = id
        .as_ref()
        .is_none_or(|i| i.is_string() || i.is_i64() || i.is_u64());
    let echo = id.clone().filter(|_| id_ok).unwrap_or(Value::Null);
    if obj.get("jsonrpc") != Some(&json!("2.0")) {
        return Err(invalid(echo, "`jsonrpc` must be \"2.0\""));
    }
    if !id_ok {
        return Err(invalid(Value::Null, "`id` must be a string or an integer"));
    }
    match (obj.get("method"), id) {
        (Some(Value::String(method)), Some(id)) => {
            let params = obj.get("params").cloned();
            if params.as_ref().is_some_and(|p| !p.is_object()) {
                return Err(invalid(id, "`params` must be an object"));
            }
            Ok(Message::Request {
                id,
                method: method.clone(),
                params,
            })
        }
        (Some(Value::String(_)), None) => Ok(Message::Notification),
        (Some(_), _) => Err(invalid(echo, "`method` must be a string")),
        (None, Some(_)) if obj.contains_key("result") || obj.contains_key("error") => {
            Ok(Message::Response)
        }
        (None, _) => Err(invalid(echo, "a request needs `method`")),
    }
}

fn ok(id: Value, result: Value) -> Reply {
    Reply::Json {
        status: StatusCode::OK,
        body: json!({"jsonrpc": "2.0", "id": id, "result": result}),
        session: None,
    }
}

fn err(id: Value, code: i64, message: &str) -> Reply {
    Reply::Json {
        status: StatusCode::OK,
        body: json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}}),
        session: None,
    }
}

/// Handles one message for an authenticated endpoint.
pub(crate) async fn handle(
    server: &Server,
    endpoint: &Endpoint,
    headers: &HeaderMap,
    message: Message,
) -> Reply {
    let (id, method, params) = match message {
        Message::Request { id, method, params } => (id, method, params),
        Message::Notification | Message::Response => {
            // Notifications (`notifications/initialized`, cancellations) need no answer, but
            // still belong to a session.
            return match check_session(server, &endpoint.name, headers, &Value::Null) {
                Ok(_) => Reply::Accepted,
                Err(r) => Reply::Raw(r),
            };
        }
    };
    if method == "initialize" {
        return initialize(server, endpoint, id, params.as_ref());
    }
    let session = match check_session(server, &endpoint.name, headers, &id) {
        Ok(s) => s,
        Err(r) => return Reply::Raw(r),
    };
    let granted: BTreeSet<Tool> = endpoint
        .verbs
        .iter()
        .filter_map(|v| Tool::parse(v))
        .collect();
    let tools = wire::tools_for(&granted);
    match method.as_str() {
        "ping" => ok(id, json!({})),
        "tools/list" => ok(id, wire::tools_list(&tools)),
        "tools/call" => {
            let params = params.unwrap_or_else(|| json!({}));
            let Some(name) = params.get("name").and_then(Value::as_str) else {
                return err(
                    id,
                    INVALID_PARAMS,
                    "tools/call needs params.name (a tool from tools/list)",
                );
            };
            let Some(tool) = Tool::parse(name) else {
                return err(
                    id,
                    INVALID_PARAMS,
                    &format!("unknown tool {name:?}; tools/list names the tools of this endpoint"),
                );
            };
            let answer = if tools.contains(&tool) {
                match tool.decode(params.get("arguments")) {
                    Ok(call) => server.call(endpoint, &session, call).await,
                    Err(e) => Err(e),
                }
            } else {
                Err(Error::forbidden(format!(
                    "{name}: this endpoint is not granted this verb; vend an endpoint with it \
                     (`relay endpoint create NAME --verbs {name},…`)"
                )))
            };
            let code = match &answer {
                Ok(_) => "ok",
                Err(e) => e.code.as_str(),
            };
            server.inner.metrics.tool_call(tool.as_str(), code);
            // Successful calls at debug: under load one line per call costs more than it tells.
            if answer.is_ok() {
                tracing::debug!(endpoint = %endpoint.name, tool = tool.as_str(), "tools/call ok");
            } else {
                tracing::info!(endpoint = %endpoint.name, tool = tool.as_str(), result = code, "tools/call refused");
            }
            match answer {
                Ok(v) => ok(id, wire::call_result(&v, false)),
                Err(e) if e.code == ErrorCode::Internal => {
                    let context =
                        format!("endpoint {} tools/call {}", endpoint.name, tool.as_str());
                    err(id, INTERNAL_ERROR, &server.internal_message(&context, &e))
                }
                Err(e) => {
                    let out = serde_json::to_value(wire::ErrorOut::from(&e)).unwrap_or_default();
                    ok(id, wire::call_result(&out, true))
                }
            }
        }
        other => err(
            id,
            METHOD_NOT_FOUND,
            &format!(
                "method not found: {other:?}; this server answers initialize, ping, tools/list \
                 and tools/call"
            ),
        ),
    }
}

fn initialize(server: &Server, endpoint: &Endpoint, id: Value, params: Option<&Value>) -> Reply {
    let Some(requested) = params
        .and_then(|p| p.get("protocolVersion"))
        .and_then(Value::as_str)
    else {
        return err(
            id,
            INVALID_PARAMS,
            "initialize needs params.protocolVersion (e.g. \"2025-06-18\")",
        );
    };
    let version = PROTOCOL_VERSIONS
        .iter()
        .find(|v| **v == requested)
        .copied()
        .unwrap_or(PROTOCOL_VERSIONS[0]);
    let session = match server.open_session(endpoint) {
        Ok(s) => s,
        Err(e) if e.code == relay_core::ErrorCode::Conflict => {
            tracing::warn!(endpoint = %endpoint.name, "refused a session: at the session cap");
            return Reply::Json {
                status: StatusCode::SERVICE_UNAVAILABLE,
                body: json!({"jsonrpc": "2.0", "id": id, "error": {"code": -32000, "message": e.message}}),
                session: None,
            };
        }
        Err(e) => {
            let context = format!("endpoint {} initialize", endpoint.name);
            return err(id, INTERNAL_ERROR, &server.internal_message(&context, &e));
        }
    };
    tracing::info!(endpoint = %endpoint.name, protocol = version, "session initialized");
    let result = json!({
        "protocolVersion": version,
        "capabilities": {
            "tools": {"listChanged": false},
            "experimental": {"relay/doorbell": {"method": super::TODO_READY}},
        },
        "serverInfo": {"name": "relay", "version": env!("CARGO_PKG_VERSION")},
        "instructions": "A work queue with fenced leases. claim_next takes work; heartbeat keeps \
            the lease; complete or fail ends the attempt. Open a GET stream on this URL with \
            the session id to hear notifications/todo_ready when work arrives.",
    });
    Reply::Json {
        status: StatusCode::OK,
        body: json!({"jsonrpc": "2.0", "id": id, "result": result}),
        session: Some(session),
    }
}

fn to_value<T: serde::Serialize>(v: &T) -> Result<Value, Error> {
    serde_json::to_value(v).map_err(|e| Error::internal(format!("encoding the answer: {e}")))
}

fn queue_granted(endpoint: &Endpoint, queue: &str) -> bool {
    endpoint
        .queues
        .as_ref()
        .is_none_or(|qs| qs.iter().any(|q| q == queue))
}

fn queue_forbidden(tool: &str, queue: &str) -> Error {
    Error::forbidden(format!(
        "{tool}: queue {queue:?} is not granted to this endpoint; use a granted queue or vend an \
         endpoint with it (`--queues`)"
    ))
}

fn report_of(
    result: Option<serde_json::Map<String, Value>>,
    summary: Option<String>,
    artifact: Option<String>,
    token: Option<&LeaseToken>,
) -> Report {
    Report {
        result: result.map(Value::Object),
        summary,
        artifact,
        token_hash: token.map(|t| t.hash()),
    }
}

impl Server {
    /// The options of a claim (`claim_next` or `claim`), with a fresh fence token when asked.
    fn claim_opts(
        &self,
        require_fence: Option<bool>,
        lease_ttl_seconds: Option<u64>,
        claimant: Option<String>,
    ) -> Result<(ClaimOpts, Option<LeaseToken>), Error> {
        let token = require_fence
            .unwrap_or(false)
            .then(|| self.new_lease_token())
            .transpose()?;
        let opts = ClaimOpts {
            ttl: lease_ttl_ms(lease_ttl_seconds),
            claimant,
            token_hash: token.as_ref().map(LeaseToken::hash),
        };
        Ok((opts, token))
    }

    /// A claim's answer; a takeover closed the lapsed attempt, which the metrics count.
    fn claimed(&self, c: &Claimed, token: Option<LeaseToken>) -> Result<Value, Error> {
        if c.takeover {
            self.inner
                .metrics
                .closed(Outcome::LeaseExpired, Disposition::Requeued);
        }
        to_value(&ClaimOut::claimed(c, token))
    }

    /// Runs one decoded tool call for `endpoint` over `session`.
    async fn call(
        &self,
        endpoint: &Endpoint,
        session: &str,
        call: ToolCall,
    ) -> Result<Value, Error> {
        let actor = Actor::Endpoint {
            endpoint: endpoint.name.clone(),
            session: Some(session.to_string()),
        };
        let store = &self.inner.store;
        let m = &self.inner.metrics;
        match call {
            ToolCall::ClaimNext(a) => {
                let queues = match &a.queue {
                    Some(q) if !queue_granted(endpoint, q) => {
                        return Err(queue_forbidden("claim_next", q));
                    }
                    Some(q) => Some(vec![q.clone()]),
                    None => endpoint.queues.clone(),
                };
                let (opts, token) =
                    self.claim_opts(a.require_fence, a.lease_ttl_seconds, a.claimant)?;
                let started = Instant::now();
                let op = Op::ClaimNext {
                    now: self.now(),
                    actor,
                    queues,
                    opts,
                };
                let claimed = store.apply(op).await;
                m.claim_latency.observe(started.elapsed().as_secs_f64());
                match claimed?.next()? {
                    None => to_value(&ClaimOut::empty()),
                    Some(c) => self.claimed(&c, token),
                }
            }
            ToolCall::Claim(a) => {
                if endpoint.queues.is_some() {
                    let (actor, id) = (actor.clone(), a.id.clone());
                    let get = Op::GetTodo {
                        actor,
                        id,
                        attempts_limit: 1,
                    };
                    let view = store.apply(get).await.and_then(Answer::view);
                    let view = view.map_err(|e| {
                        if e.code == ErrorCode::NotFound {
                            relay_core::ledger::transition::not_found("claim", &a.id)
                        } else {
                            e
                        }
                    })?;
                    if !queue_granted(endpoint, &view.todo.queue) {
                        return Err(queue_forbidden("claim", &view.todo.queue));
                    }
                }
                let (opts, token) =
                    self.claim_opts(a.require_fence, a.lease_ttl_seconds, a.claimant)?;
                let started = Instant::now();
                let (now, id) = (self.now(), a.id);
                let claimed = store.apply(Op::Claim {
                    now,
                    actor,
                    id,
                    opts,
                });
                let claimed = claimed.await;
                m.claim_latency.observe(started.elapsed().as_secs_f64());
                self.claimed(&claimed?.claimed()?, token)
            }
            ToolCall::Heartbeat(a) => {
                let op = Op::Heartbeat {
                    now: self.now(),
                    actor,
                    id: a.id,
                    ttl: lease_ttl_ms(a.lease_ttl_seconds),
                    token_hash: a.lease_token.as_ref().map(|t| t.hash()),
                };
                let t = store.apply(op).await?.todo()?;
                m.heartbeats.inc();
                to_value(&TodoOut::from(&t))
            }
            ToolCall::Complete(a) => {
                let report = report_of(a.result, a.summary, a.artifact, a.lease_token.as_ref());
                let (now, id) = (self.now(), a.id);
                let op = Op::Complete {
                    now,
                    actor,
                    id,
                    report,
                };
                let t = store.apply(op).await?.todo()?;
                m.closed(Outcome::Completed, Disposition::Done);
                to_value(&TodoOut::from(&t))
            }
            ToolCall::Fail(a) => {
                let report = report_of(a.result, a.summary, a.artifact, a.lease_token.as_ref());
                let (now, id) = (self.now(), a.id);
                let op = Op::Fail {
                    now,
                    actor,
                    id,
                    report,
                };
                let t = store.apply(op).await?.todo()?;
                let disposition = if t.dead_letter() {
                    Disposition::DeadLettered
                } else {
                    Disposition::RetryScheduled
                };
                m.closed(Outcome::Failed, disposition);
                to_value(&TodoOut::from(&t))
            }
            ToolCall::Release(a) => {
                let op = Op::Release {
                    now: self.now(),
                    actor,
                    id: a.id,
                    summary: a.summary,
                    token_hash: a.lease_token.as_ref().map(|t| t.hash()),
                };
                let t = store.apply(op).await?.todo()?;
                m.closed(Outcome::Released, Disposition::Requeued);
                self.ring_todo(&t, Offer::Requeued);
                to_value(&TodoOut::from(&t))
            }
            ToolCall::GetTodo(a) => {
                let limit = a.attempts_limit.unwrap_or(wire::ATTEMPTS_LIMIT_DEFAULT) as usize;
                let id = a.id.clone();
                let op = Op::GetTodo {
                    actor,
                    id,
                    attempts_limit: limit,
                };
                let view = store.apply(op).await?.view()?;
                if !queue_granted(endpoint, &view.todo.queue) {
                    // What the endpoint cannot enumerate does not exist for it.
                    return Err(relay_core::ledger::transition::not_found("get_todo", &a.id));
                }
                to_value(&GetTodoOut::from(&view))
            }
            ToolCall::ListTodos(a) => {
                let queues = match &a.queue {
                    Some(q) if !queue_granted(endpoint, q) => {
                        return Err(queue_forbidden("list_todos", q));
                    }
                    Some(q) => Some(vec![q.clone()]),
                    None => endpoint.queues.clone(),
                };
                let filter = TodoFilter {
                    queues,
                    state: a.state,
                    limit: a.limit.unwrap_or(wire::LIST_LIMIT_DEFAULT) as usize,
                };
                let todos = store.apply(Op::ListTodos { actor, filter });
                let todos = todos.await?.todos()?;
                to_value(&ListTodosOut {
                    todos: todos.iter().map(TodoOut::from).collect(),
                })
            }
            ToolCall::AddTodo(a) => {
                if !queue_granted(endpoint, &a.queue) {
                    return Err(queue_forbidden("add_todo", &a.queue));
                }
                let id = format!("td_{}", self.random_hex::<10>()?);
                let op = Op::AddTodo {
                    now: self.now(),
                    endpoint: endpoint.name.clone(),
                    new: NewTodo {
                        id,
                        queue: a.queue,
                        title: a.title,
                        kind: a.kind,
                        source: a.source,
                        payload: a.payload,
                        work_order: a.work_order,
                        max_attempts: a.max_attempts,
                        assignee: a.assignee,
                    },
                };
                let t = store.apply(op).await?.todo()?;
                self.ring_todo(&t, Offer::Fresh);
                to_value(&TodoOut::from(&t))
            }
        }
    }
}
