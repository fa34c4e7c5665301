//! The MCP methods of both eras over one endpoint: the legacy handshake and its session
//! (`initialize`, `ping`), `server/discover` and `subscriptions/listen` (modern), and in both
//! `tools/list`, `tools/call` and the resources (`relay_core::resources` for todos,
//! `relay_core::mcp::listen` for queues). Which era a request speaks, its envelope's and
//! headers' checks, and its answer's frame are `relay_core::mcp`'s; this module dispatches.

// The refusal *is* the response to send; boxing it would only add an allocation per refusal.
#![allow(clippy::result_large_err)]

use std::time::Instant;

use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use relay_core::grant::Grant;
use relay_core::ledger::Op;
use relay_core::mcp::{self, Era, Fault, Message, Method, era, listen};
use relay_core::resources;
use relay_core::serve::{
    self, Caller, Draw, Drive, Served, Serving, Step, TaskServed, TaskServing,
};
use relay_core::task::{self, TaskCall};
use relay_core::wire::{self, LeaseToken, Tool};
use relay_core::{Error, ErrorCode};
use serde_json::{Value, json};

use super::session::{StreamEnd, check_session, event_stream, fault_response, protocol_headers};
use super::{PROTOCOL_VERSIONS, Server};
use crate::store::Endpoint;

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

impl From<Fault> for Reply {
    fn from(f: Fault) -> Reply {
        Reply::Json {
            status: StatusCode::from_u16(f.status).unwrap_or(StatusCode::BAD_REQUEST),
            body: f.body(),
            session: None,
        }
    }
}

/// Handles one message for an authenticated endpoint.
pub(crate) async fn handle(
    server: &Server,
    endpoint: &Endpoint,
    headers: &HeaderMap,
    message: Message,
) -> Reply {
    let h = protocol_headers(headers);
    let (id, method, params) = match message {
        Message::Request { id, method, params } => (id, method, params),
        Message::Notification { params } => {
            return accepted(server, endpoint, headers, params.as_ref()).await;
        }
        Message::Response => return accepted(server, endpoint, headers, None).await,
    };
    let era = match era::classify(&h, &method, params.as_ref(), &id) {
        Ok(era) => era,
        Err(f) => {
            tracing::info!(endpoint = %endpoint.name, code = f.code, "request refused by the era rules");
            return f.into();
        }
    };
    let method = match Method::of(&method, &era, &id) {
        Ok(m) => m,
        Err(f) => return f.into(),
    };
    if method == Method::Initialize {
        return initialize(server, endpoint, id, params.as_ref()).await;
    }
    let session = match &era {
        Era::Legacy { .. } => match check_session(server, endpoint, headers, &id).await {
            Ok(s) => Some(s),
            Err(r) => return Reply::Raw(r),
        },
        Era::Modern(_) => None,
    };
    if method == Method::Listen {
        return open_listen(server, endpoint, &era, id, params.as_ref());
    }
    match answer(server, endpoint, &era, session, method, &id, params).await {
        Ok(result) => Reply::Json {
            status: StatusCode::OK,
            body: mcp::response(id, mcp::framed(&era, method, result)),
            session: None,
        },
        Err(f) => f.into(),
    }
}

/// A message that wants no answer (a notification, a client's response): 202. A modern one
/// (e.g. a listen's `notifications/cancelled`) belongs to no session; a legacy one
/// (`notifications/initialized`) still to its session, which must be live.
async fn accepted(
    server: &Server,
    endpoint: &Endpoint,
    headers: &HeaderMap,
    params: Option<&Value>,
) -> Reply {
    if era::notification_is_modern(&protocol_headers(headers), params) {
        return Reply::Accepted;
    }
    match check_session(server, endpoint, headers, &Value::Null).await {
        Ok(_) => Reply::Accepted,
        Err(r) => Reply::Raw(r),
    }
}

/// A method's result (`Err`: its refusal), before the era's frame.
async fn answer(
    server: &Server,
    endpoint: &Endpoint,
    era: &Era,
    session: Option<String>,
    method: Method,
    id: &Value,
    params: Option<Value>,
) -> Result<Value, Fault> {
    let grant = endpoint.grant();
    match method {
        Method::Ping => Ok(json!({})),
        Method::Discover => Ok(mcp::discover(&grant, era)),
        Method::ToolsList => Ok(wire::tools_list(&grant.tools())),
        Method::ToolsCall => {
            let params = params.unwrap_or_else(|| json!({}));
            let (tool, arguments) = serve::tool_of(&params)
                .map_err(|m| mcp::refusal(era, id.clone(), mcp::INVALID_PARAMS, m))?;
            let tasks = match era {
                Era::Modern(env) if env.declares_extension(task::EXTENSION) => {
                    Some(server.task_poll_ms())
                }
                _ => None,
            };
            let caller = Caller {
                endpoint: endpoint.name.clone(),
                session,
                grant,
                tasks,
            };
            let answer = server.call(caller, tool, arguments).await;
            let code = match &answer {
                Ok(_) => "ok",
                Err(e) => e.code.as_str(),
            };
            server.inner.metrics.tool_call(tool.as_str(), code);
            // Successful calls at debug: under load one line per call costs more than it tells.
            if answer.is_ok() {
                tracing::debug!(endpoint = %endpoint.name, tool = tool.as_str(), era = era.name(), "tools/call ok");
            } else {
                tracing::info!(endpoint = %endpoint.name, tool = tool.as_str(), era = era.name(), result = code, "tools/call refused");
            }
            match answer {
                Ok(served) => Ok(served.result()),
                Err(e) if e.code == ErrorCode::Internal => {
                    let context =
                        format!("endpoint {} tools/call {}", endpoint.name, tool.as_str());
                    Err(internal(server, era, id, &context, &e))
                }
                Err(e) => Ok(serve::refusal(&e)),
            }
        }
        Method::ResourcesList => {
            let listed = list_resources(server, endpoint, &grant, params.as_ref()).await;
            resource_answer(server, endpoint, era, id, method, None, listed)
        }
        Method::ResourcesRead => {
            let uri = params
                .as_ref()
                .and_then(|p| p.get("uri"))
                .and_then(Value::as_str)
                .map(str::to_string);
            let read = match uri.as_deref().and_then(listen::queue_of) {
                Some(queue) => read_queue(server, endpoint, &grant, queue).await,
                None => match resources::read(&grant, params.as_ref()) {
                    Ok((todo, args)) => {
                        let caller = Caller {
                            endpoint: endpoint.name.clone(),
                            session,
                            grant,
                            tasks: None,
                        };
                        let served = server.call(caller, Tool::GetTodo, Some(&args)).await;
                        resources::read_result(&todo, served)
                    }
                    Err(e) => Err(e),
                },
            };
            resource_answer(server, endpoint, era, id, method, uri.as_deref(), read)
        }
        Method::ResourcesTemplatesList => {
            let mut templates = Vec::new();
            if resources::offered(&grant) {
                templates.push(json!({
                    "uriTemplate": format!("{}{{id}}", resources::URI_PREFIX),
                    "name": "todo",
                    "description": "A todo and its attempt timeline (the get_todo answer)",
                    "mimeType": resources::MIME_JSON,
                }));
            }
            if listen::offered(&grant) {
                templates.push(listen::template());
            }
            if templates.is_empty() {
                return Err(mcp::refusal(
                    era,
                    id.clone(),
                    mcp::METHOD_NOT_FOUND,
                    "resources/templates/list: this endpoint is offered no resources (they come \
                     with the list_todos, claim_next and claim verbs)",
                ));
            }
            Ok(json!({"resourceTemplates": templates}))
        }
        Method::TasksGet | Method::TasksUpdate | Method::TasksCancel => {
            task_answer(server, endpoint, era, method, id, params).await
        }
        Method::Initialize | Method::Listen => Err(mcp::refusal(
            era,
            id.clone(),
            mcp::INTERNAL_ERROR,
            "internal error: this method is answered elsewhere",
        )),
    }
}

/// A task method's answer: the request must declare the extension; the call is core's
/// [`TaskServing`] over the store.
async fn task_answer(
    server: &Server,
    endpoint: &Endpoint,
    era: &Era,
    method: Method,
    id: &Value,
    params: Option<Value>,
) -> Result<Value, Fault> {
    let Some(which) = method.task() else {
        return Err(mcp::refusal(
            era,
            id.clone(),
            mcp::METHOD_NOT_FOUND,
            "not a task method",
        ));
    };
    mcp::tasks_declared(era, id, which.as_str())?;
    let call = TaskCall::decode(which, params.as_ref())
        .map_err(|e| mcp::refusal(era, id.clone(), mcp::INVALID_PARAMS, e.message))?;
    let caller = Caller {
        endpoint: endpoint.name.clone(),
        session: None,
        grant: endpoint.grant(),
        tasks: Some(server.task_poll_ms()),
    };
    let answer = server.task_call(caller, call).await;
    let code = match &answer {
        Ok(_) => "ok",
        Err(e) => e.code.as_str(),
    };
    server.inner.metrics.tool_call(which.as_str(), code);
    match answer {
        Ok(served) => Ok(served.result),
        Err(e) => {
            tracing::info!(endpoint = %endpoint.name, method = which.as_str(), result = code, "task method refused");
            Err(mcp::task_refusal(era, id.clone(), &e).unwrap_or_else(|| {
                let context = format!("endpoint {} {}", endpoint.name, which.as_str());
                internal(server, era, id, &context, &e)
            }))
        }
    }
}

fn internal(server: &Server, era: &Era, id: &Value, context: &str, e: &Error) -> Fault {
    mcp::refusal(
        era,
        id.clone(),
        mcp::INTERNAL_ERROR,
        server.internal_message(context, e),
    )
}

/// `resources/list`: the endpoint's queues first (on the first page), then its todos, a page at
/// a time, when it is granted `list_todos`.
async fn list_resources(
    server: &Server,
    endpoint: &Endpoint,
    grant: &Grant,
    params: Option<&Value>,
) -> Result<Value, Error> {
    let first_page = params
        .and_then(|p| p.get("cursor"))
        .is_none_or(Value::is_null);
    let mut out = if resources::offered(grant) {
        let op = resources::list(&endpoint.name, grant, params)?;
        resources::listed(server.store().apply(op).await)?
    } else if listen::offered(grant) {
        if !first_page {
            return Err(Error::invalid(
                "resources/list: cursor: this endpoint's list has one page; list again without \
                 a cursor",
            ));
        }
        json!({"resources": []})
    } else {
        // The todo resources' refusal names the verb to grant.
        return resources::list(&endpoint.name, grant, params).map(|_| Value::Null);
    };
    if first_page && listen::offered(grant) {
        let queues: Vec<String> = match grant.queues() {
            Some(qs) => qs.to_vec(),
            None => {
                let counts = server.store().queue_counts(&endpoint.name, None).await?;
                let mut qs: Vec<String> = counts.into_iter().map(|(q, _, _)| q).collect();
                qs.dedup();
                qs
            }
        };
        if let Some(list) = out["resources"].as_array_mut() {
            let todos = std::mem::take(list);
            list.extend(queues.iter().map(|q| listen::listed(q)));
            list.extend(todos);
        }
    }
    Ok(out)
}

/// `resources/read` of `relay://queues/<queue>`: the queue's counts for this endpoint. A queue
/// the endpoint may not claim from reads as not found, like a foreign todo.
async fn read_queue(
    server: &Server,
    endpoint: &Endpoint,
    grant: &Grant,
    queue: &str,
) -> Result<Value, Error> {
    listen::readable(grant, queue)?;
    let counts = server
        .store()
        .queue_counts(&endpoint.name, Some(queue))
        .await?;
    let by_state: Vec<(String, u64)> = counts.into_iter().map(|(_, s, n)| (s, n)).collect();
    Ok(listen::read_result(queue, &by_state))
}

/// A resource method's answer, or its refusal in the era (`relay_core::mcp::resource_refusal`).
fn resource_answer(
    server: &Server,
    endpoint: &Endpoint,
    era: &Era,
    id: &Value,
    method: Method,
    uri: Option<&str>,
    answer: Result<Value, Error>,
) -> Result<Value, Fault> {
    let e = match answer {
        Ok(result) => return Ok(result),
        Err(e) => e,
    };
    let method = method.as_str();
    tracing::info!(endpoint = %endpoint.name, method, result = e.code.as_str(), "resource refused");
    Err(
        mcp::resource_refusal(era, id.clone(), uri, &e).unwrap_or_else(|| {
            internal(
                server,
                era,
                id,
                &format!("endpoint {} {method}", endpoint.name),
                &e,
            )
        }),
    )
}

/// `subscriptions/listen`: an event stream that starts with the acknowledgement and rings the
/// subscribed queues through the doorbell's gate, until the client goes or the server stops
/// (then the listen's answer closes it).
fn open_listen(
    server: &Server,
    endpoint: &Endpoint,
    era: &Era,
    id: Value,
    params: Option<&Value>,
) -> Reply {
    if listen::asks_tasks(params)
        && let Err(f) = mcp::tasks_declared(era, &id, "subscriptions/listen with taskIds")
    {
        return f.into();
    }
    let listen = match listen::decode(&endpoint.grant(), params) {
        Ok(l) => l,
        Err(e) => {
            tracing::info!(endpoint = %endpoint.name, result = e.code.as_str(), "listen refused");
            return mcp::refusal(era, id, mcp::INVALID_PARAMS, e.message).into();
        }
    };
    let farewell = listen::closed(&id).to_string();
    let tasks = listen.tasks.clone();
    match server.open_listen(&endpoint.name, listen, id.clone()) {
        Ok((rx, tx)) => {
            tracing::info!(endpoint = %endpoint.name, tasks = tasks.len(), "listen stream opened");
            if !tasks.is_empty() {
                let caller = Caller {
                    endpoint: endpoint.name.clone(),
                    session: None,
                    grant: endpoint.grant(),
                    tasks: Some(server.task_poll_ms()),
                };
                tokio::spawn(watch_tasks(server.clone(), caller, tasks, id.clone(), tx));
            }
            Reply::Raw(event_stream(server, rx, Some(farewell), StreamEnd::Listen))
        }
        Err(message) => {
            tracing::warn!(endpoint = %endpoint.name, "refused a listen stream: at the stream cap");
            Reply::Raw(fault_response(&Fault::new(
                503,
                id,
                mcp::INTERNAL_ERROR,
                message,
            )))
        }
    }
}

/// A listen stream's task watcher: every poll interval, each watched task as `tasks/get` answers
/// it, read from the store (so a change made through any server is heard); what is news and what
/// is watched on is `listen::Watched`'s. Ends when the stream does or nothing is left to watch.
async fn watch_tasks(
    server: Server,
    caller: Caller,
    tasks: Vec<relay_core::ledger::TaskId>,
    subscription: Value,
    tx: tokio::sync::mpsc::Sender<String>,
) {
    let mut watched: Vec<listen::Watched> = tasks.into_iter().map(listen::Watched::new).collect();
    let mut tick = tokio::time::interval(server.inner.config.task_poll_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !watched.is_empty() {
        tokio::select! {
            () = tx.closed() => return,
            _ = tick.tick() => {}
        }
        let mut keep = Vec::with_capacity(watched.len());
        for mut w in watched {
            let call = TaskCall::Get(task::Presented::Shaped(w.id.clone()));
            let answer = server.task_call(caller.clone(), call).await;
            let look = w.look(answer.map(|s| s.result).map_err(|e| e.code));
            if let Some(task) = look.news {
                let note = listen::task_status(&subscription, &task).to_string();
                if tx.send(note).await.is_err() {
                    return;
                }
            }
            if look.keep {
                keep.push(w);
            }
        }
        watched = keep;
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
        return mcp::Fault::new(
            200,
            id,
            mcp::INVALID_PARAMS,
            "initialize needs params.protocolVersion (e.g. \"2025-06-18\")",
        )
        .into();
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
            return Fault::new(503, id, -32000, e.message).into();
        }
        Err(e) => {
            let context = format!("endpoint {} initialize", endpoint.name);
            let legacy = Era::Legacy { session: None };
            return internal(server, &legacy, &id, &context, &e).into();
        }
    };
    tracing::info!(endpoint = %endpoint.name, protocol = version, "session initialized");
    let result = json!({
        "protocolVersion": version,
        "capabilities": mcp::capabilities(&endpoint.grant(), &Era::Legacy { session: None }),
        "serverInfo": mcp::server_info(),
        "instructions": "A work queue with fenced leases. claim_next takes work; heartbeat keeps \
            the lease; complete or fail ends the attempt. Open a GET stream on this URL with \
            the session id to hear notifications/todo_ready when work arrives.",
    });
    Reply::Json {
        status: StatusCode::OK,
        body: mcp::response(id, result),
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
    fn task_secret(&mut self) -> Result<String, Error> {
        self.0.random_hex::<20>()
    }
}

impl Server {
    /// Drives a call being served (a tool's or a task method's) over the store to its end.
    async fn drive<D: Drive>(
        &self,
        serving: &mut D,
        mut step: Step<D::Out>,
        draw: &mut ServerDraw<'_>,
    ) -> Result<D::Out, Error> {
        let m = &self.inner.metrics;
        loop {
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
                    step = serving.answered(answer, draw);
                }
                Step::Done(done) => return done,
            }
        }
    }

    /// Serves one task method: core's [`TaskServing`] over the store, with the metrics and the
    /// doorbell around it.
    async fn task_call(&self, caller: Caller, call: TaskCall) -> Result<TaskServed, Error> {
        let mut draw = ServerDraw(self);
        let (mut serving, step) = TaskServing::start(call, caller, self.now());
        let served = self.drive(&mut serving, step, &mut draw).await?;
        if let Some((outcome, disposition)) = served.closed {
            self.inner.metrics.closed(outcome, disposition);
        }
        if let Some((t, offer)) = &served.ring {
            self.ring_todo(t, *offer);
        }
        Ok(served)
    }

    /// The poll interval a task's client is asked to keep, in ms.
    pub(crate) fn task_poll_ms(&self) -> relay_core::Millis {
        self.inner.config.task_poll_interval.as_millis() as relay_core::Millis
    }

    /// Serves one tool call for `caller`: core's serving function over the store, with the
    /// metrics and the doorbell around it.
    async fn call(
        &self,
        caller: Caller,
        tool: Tool,
        arguments: Option<&Value>,
    ) -> Result<Served, Error> {
        let m = &self.inner.metrics;
        let mut draw = ServerDraw(self);
        let (mut serving, step) = Serving::start(tool, arguments, caller, self.now(), &mut draw);
        let served = self.drive(&mut serving, step, &mut draw).await?;
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
        match served.refused {
            Some(e) => Err(e),
            None => Ok(served),
        }
    }
}
