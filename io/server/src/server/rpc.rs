//! JSON-RPC 2.0 and the MCP methods: `initialize`, `ping`, `tools/list`, `tools/call`, the todo
//! resources (`resources/list`, `resources/read`: `relay_core::resources`), and the
//! notifications and responses a client may send (accepted, 202).

// The refusal *is* the response to send; boxing it would only add an allocation per refusal.
#![allow(clippy::result_large_err)]

use std::time::Instant;

use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use relay_core::grant::Grant;
use relay_core::ledger::Op;
use relay_core::resources;
use relay_core::serve::{self, Caller, Draw, Served, Serving, Step};
use relay_core::wire::{self, LeaseToken, Tool};
use relay_core::{Error, ErrorCode};
use serde_json::{Value, json};

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
            return match check_session(server, endpoint, headers, &Value::Null).await {
                Ok(_) => Reply::Accepted,
                Err(r) => Reply::Raw(r),
            };
        }
    };
    if method == "initialize" {
        return initialize(server, endpoint, id, params.as_ref()).await;
    }
    let session = match check_session(server, endpoint, headers, &id).await {
        Ok(s) => s,
        Err(r) => return Reply::Raw(r),
    };
    let grant = endpoint.grant();
    let tools = grant.tools();
    match method.as_str() {
        "ping" => ok(id, json!({})),
        "tools/list" => ok(id, wire::tools_list(&tools)),
        "tools/call" => {
            let params = params.unwrap_or_else(|| json!({}));
            let (tool, arguments) = match serve::tool_of(&params) {
                Ok(t) => t,
                Err(message) => return err(id, INVALID_PARAMS, &message),
            };
            let answer = server
                .call(endpoint, grant, &session, tool, arguments)
                .await;
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
                Ok(served) => ok(id, served.result()),
                Err(e) if e.code == ErrorCode::Internal => {
                    let context =
                        format!("endpoint {} tools/call {}", endpoint.name, tool.as_str());
                    err(id, INTERNAL_ERROR, &server.internal_message(&context, &e))
                }
                Err(e) => ok(id, serve::refusal(&e)),
            }
        }
        "resources/list" => {
            let page = match resources::list(&endpoint.name, &grant, params.as_ref()) {
                Ok(op) => resources::listed(server.store().apply(op).await),
                Err(e) => Err(e),
            };
            resource_reply(server, endpoint, id, &method, page)
        }
        "resources/read" => {
            let read = match resources::read(&grant, params.as_ref()) {
                Ok((todo, args)) => {
                    let served = server
                        .call(endpoint, grant, &session, Tool::GetTodo, Some(&args))
                        .await;
                    resources::read_result(&todo, served)
                }
                Err(e) => Err(e),
            };
            resource_reply(server, endpoint, id, &method, read)
        }
        "resources/templates/list" if resources::offered(&grant) => ok(
            id,
            json!({"resourceTemplates": [{
                "uriTemplate": format!("{}{{id}}", resources::URI_PREFIX),
                "name": "todo",
                "description": "A todo and its attempt timeline (the get_todo answer)",
                "mimeType": resources::MIME_JSON,
            }]}),
        ),
        other => err(
            id,
            METHOD_NOT_FOUND,
            &format!(
                "method not found: {other:?}; this server answers initialize, ping, tools/list, \
                 tools/call, resources/list and resources/read"
            ),
        ),
    }
}

/// MCP's code for a resource that does not exist.
pub(crate) const RESOURCE_NOT_FOUND: i64 = -32002;
/// A resource method the endpoint is not granted.
pub(crate) const FORBIDDEN: i64 = -32003;

/// A resource method's answer: bad params are `invalid params`, naming the field; an unknown or
/// foreign todo is the same not-found.
fn resource_reply(
    server: &Server,
    endpoint: &Endpoint,
    id: Value,
    method: &str,
    answer: Result<Value, Error>,
) -> Reply {
    let e = match answer {
        Ok(result) => return ok(id, result),
        Err(e) => e,
    };
    tracing::info!(endpoint = %endpoint.name, method, result = e.code.as_str(), "resource refused");
    match e.code {
        ErrorCode::Invalid => err(id, INVALID_PARAMS, &e.message),
        ErrorCode::NotFound => err(id, RESOURCE_NOT_FOUND, &e.message),
        ErrorCode::Forbidden => err(id, FORBIDDEN, &e.message),
        _ => {
            let context = format!("endpoint {} {method}", endpoint.name);
            err(id, INTERNAL_ERROR, &server.internal_message(&context, &e))
        }
    }
}

async fn initialize(
    server: &Server,
    endpoint: &Endpoint,
    id: Value,
    params: Option<&Value>,
) -> Reply {
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
    let session = match server.open_session(endpoint, version).await {
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
    let mut result = json!({
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
    if resources::offered(&endpoint.grant()) {
        result["capabilities"]["resources"] = json!({"subscribe": false, "listChanged": false});
    }
    Reply::Json {
        status: StatusCode::OK,
        body: json!({"jsonrpc": "2.0", "id": id, "result": result}),
        session: Some(session),
    }
}

/// What the server draws for a call: todo ids and fence tokens from its RNG.
struct ServerDraw<'a>(&'a Server);

impl Draw for ServerDraw<'_> {
    fn todo_id(&mut self) -> Result<String, Error> {
        Ok(format!("td_{}", self.0.random_hex::<10>()?))
    }
    fn lease_token(&mut self) -> Result<LeaseToken, Error> {
        self.0.new_lease_token()
    }
}

impl Server {
    /// Serves one tool call for `endpoint` over `session`: core's serving function over the
    /// store, with the metrics and the doorbell around it.
    async fn call(
        &self,
        endpoint: &Endpoint,
        grant: Grant,
        session: &str,
        tool: Tool,
        arguments: Option<&Value>,
    ) -> Result<Served, Error> {
        let caller = Caller {
            endpoint: endpoint.name.clone(),
            session: Some(session.to_string()),
            grant,
        };
        let m = &self.inner.metrics;
        let mut draw = ServerDraw(self);
        let (mut serving, mut step) =
            Serving::start(tool, arguments, caller, self.now(), &mut draw);
        let served = loop {
            match step {
                Step::Apply(op) => {
                    let claim = matches!(op, Op::Claim { .. } | Op::ClaimNext { .. });
                    let started = Instant::now();
                    let writes = op.writes();
                    let answer = self.inner.store.apply(op).await;
                    if writes {
                        self.notice(&answer);
                    }
                    if claim {
                        m.claim_latency.observe(started.elapsed().as_secs_f64());
                    }
                    step = serving.answered(answer, &mut draw);
                }
                Step::Done(done) => break done?,
            }
        };
        if let Some((outcome, disposition)) = served.closed {
            m.closed(outcome, disposition);
            if disposition == relay_core::ledger::Disposition::DeadLettered
                && let Some(reason) = served.answer["dead_letter_reason"].as_str()
            {
                m.dead_letter(reason);
            }
        }
        if tool == Tool::Heartbeat {
            m.heartbeats.inc();
        }
        if let Some((t, offer)) = &served.ring {
            self.ring_todo(t, *offer);
        }
        Ok(served)
    }
}
