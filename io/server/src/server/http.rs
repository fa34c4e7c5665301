//! The HTTP side: routes, authentication, the Host/Origin checks, the body limit, sessions over
//! headers, the doorbell's GET stream, `/metrics` and `/healthz`.

// The refusal *is* the response to send; boxing it would only add an allocation per refusal.
#![allow(clippy::result_large_err)]

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{FromRequestParts, Path, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use relay_core::ledger::TokenHash;
use relay_core::limits::escape_text;
use serde_json::Value;

use super::Server;
use super::rpc::{self, Reply};
use super::session::{
    StreamEnd, check_session, event_stream, fault_response, header_str, json_response,
    protocol_headers, rpc_error,
};
use crate::store::Endpoint;
use relay_core::mcp::era::SESSION_HEADER;

pub(crate) const LOOPBACK_HOSTS: [&str; 3] = ["localhost", "127.0.0.1", "::1"];

/// The Host/Origin policy as a value (the config's two lists).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostPolicy {
    pub allowed_hosts: Vec<String>,
    pub allowed_origins: Vec<String>,
}

/// The host name of a `Host` header value or an origin's authority, without port or brackets.
fn host_name(authority: &str) -> String {
    let a = authority.trim();
    let name = if let Some(rest) = a.strip_prefix('[') {
        rest.split(']').next().unwrap_or("")
    } else {
        a.rsplit_once(':').map_or(a, |(h, _)| h)
    };
    name.to_ascii_lowercase()
}

/// Whether a `Host` header is allowed (empty list: any).
pub fn host_allowed(policy: &HostPolicy, host: Option<&str>) -> bool {
    if policy.allowed_hosts.is_empty() {
        return true;
    }
    let Some(host) = host else {
        return false;
    };
    let name = host_name(host);
    policy
        .allowed_hosts
        .iter()
        .any(|h| h.eq_ignore_ascii_case(&name))
}

/// Whether an `Origin` header is allowed: absent is fine (not a browser); present, it must be
/// listed, or its host must be an allowed host. `null` is never allowed.
pub fn origin_allowed(policy: &HostPolicy, origin: Option<&str>) -> bool {
    let Some(origin) = origin else {
        return true;
    };
    if policy.allowed_origins.iter().any(|o| {
        o.trim_end_matches('/')
            .eq_ignore_ascii_case(origin.trim_end_matches('/'))
    }) {
        return true;
    }
    let Some((_, rest)) = origin.split_once("://") else {
        return false;
    };
    let authority = rest.split('/').next().unwrap_or("");
    let name = host_name(authority);
    !policy.allowed_hosts.is_empty()
        && policy
            .allowed_hosts
            .iter()
            .any(|h| h.eq_ignore_ascii_case(&name))
}

/// The MCP server's own routes; [`Server::router`] adds the Board's and counts requests.
pub(crate) fn routes(server: Server) -> Router {
    Router::new()
        .route(
            "/mcp/{endpoint}",
            get(mcp_get).post(mcp_post).delete(mcp_delete),
        )
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .with_state(server)
}

pub(crate) async fn count_in_flight(
    State(server): State<Server>,
    req: Request,
    next: Next,
) -> Response {
    server.inner.in_flight.send_modify(|n| *n += 1);
    let response = next.run(req).await;
    server
        .inner
        .in_flight
        .send_modify(|n| *n = n.saturating_sub(1));
    response
}

/// How long `/healthz` waits for its write probe.
const HEALTHZ_WRITE_TIMEOUT: Duration = Duration::from_secs(1);

/// 200 `ok` when the store takes a write now ([`crate::store::Store::probe_write`]); else 503
/// with a JSON body naming the store and why (`reason`), the details in the log under the
/// body's error id. A store that answers reads but takes no write (a full disk, a write lock
/// held elsewhere) would fail every claim.
async fn healthz(State(server): State<Server>, headers: HeaderMap) -> Response {
    if let Err(r) = host_check(&server, "/healthz", &headers) {
        return r;
    }
    let probe = server
        .inner
        .store
        .probe_write(server.now(), HEALTHZ_WRITE_TIMEOUT);
    match probe.await {
        Ok(()) => (StatusCode::OK, "ok\n").into_response(),
        Err(refused) => {
            let context = format!("healthz: the {} store took no write", refused.store);
            let detail = server.internal_message(&context, &refused.error);
            let body = serde_json::json!({
                "status": "unavailable",
                "store": refused.store,
                "reason": format!("the {} store cannot write: {}", refused.store, refused.reason),
                "detail": detail,
            });
            (
                StatusCode::SERVICE_UNAVAILABLE,
                [(header::CONTENT_TYPE, "application/json")],
                format!("{body}\n"),
            )
                .into_response()
        }
    }
}

async fn metrics(State(server): State<Server>, headers: HeaderMap) -> Response {
    use relay_core::ledger::TodoState;
    if let Err(r) = host_check(&server, "/metrics", &headers) {
        return r;
    }
    let store = &server.inner.store;
    let read = async {
        let counts = store.count_by_state().await?;
        let spend = store.spend_by_queue().await?;
        let flow = store.queue_lines(server.now()).await?;
        Ok::<_, relay_core::Error>((counts, spend, flow))
    };
    let (counts, spend, flow) = match read.await {
        Ok(r) => r,
        Err(e) => {
            let msg = server.internal_message("metrics: reading the store failed", &e);
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("store unavailable: {msg}\n"),
            )
                .into_response();
        }
    };
    for state in TodoState::ALL {
        let n = counts
            .iter()
            .find(|(s, _)| s == state.as_str())
            .map_or(0, |(_, n)| *n);
        server.inner.metrics.set_todos(state.as_str(), n);
    }
    for (queue, usage) in &spend {
        server.inner.metrics.set_spent(queue, usage);
    }
    server.inner.metrics.set_flow(&flow);
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        server.inner.metrics.encode(),
    )
        .into_response()
}

fn unauthorized(what: &str) -> Response {
    let mut r = rpc_error(
        StatusCode::UNAUTHORIZED,
        Value::Null,
        -32001,
        &format!(
            "unauthorized: {what}; send `Authorization: Bearer <token>` with the token printed by \
             `relay endpoint create`"
        ),
    );
    r.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Bearer realm=\"relay\""),
    );
    r
}

/// The Host/Origin checks (DNS-rebinding protection) of every route. `name` is for the log.
pub(crate) fn host_check(server: &Server, name: &str, headers: &HeaderMap) -> Result<(), Response> {
    let policy = HostPolicy {
        allowed_hosts: server.inner.config.allowed_hosts.clone(),
        allowed_origins: server.inner.config.allowed_origins.clone(),
    };
    if !host_allowed(&policy, header_str(headers, header::HOST)) {
        tracing::warn!(endpoint = %escape_text(name), "refused: Host header not allowed");
        return Err(rpc_error(
            StatusCode::FORBIDDEN,
            Value::Null,
            -32600,
            "forbidden: the Host header names a host this server does not serve (DNS rebinding \
             protection); connect by a loopback name or add the host to the allowed hosts",
        ));
    }
    if !origin_allowed(&policy, header_str(headers, header::ORIGIN)) {
        tracing::warn!(endpoint = %escape_text(name), "refused: Origin header not allowed");
        return Err(rpc_error(
            StatusCode::FORBIDDEN,
            Value::Null,
            -32600,
            "forbidden: the Origin header is not allowed; browsers may call this server only \
             from an allowed origin",
        ));
    }
    Ok(())
}

/// Host/Origin checks, then the bearer token. Every `/mcp` request goes through here first.
async fn admit(server: &Server, name: &str, headers: &HeaderMap) -> Result<Endpoint, Response> {
    host_check(server, name, headers)?;
    let presented = header_str(headers, header::AUTHORIZATION).and_then(|v| {
        let (scheme, token) = v.split_once(' ')?;
        scheme
            .eq_ignore_ascii_case("bearer")
            .then(|| token.trim().to_string())
    });
    let Some(token) = presented.filter(|t| !t.is_empty()) else {
        return Err(unauthorized("no bearer token"));
    };
    let hash = TokenHash::of(&token);
    let endpoint = match server.inner.store.endpoint_get(name).await {
        Ok(e) => e,
        Err(e) => {
            tracing::error!(endpoint = %escape_text(name), error = %e, "store error while authenticating");
            return Err(rpc_error(
                StatusCode::SERVICE_UNAVAILABLE,
                Value::Null,
                -32603,
                "the store is unavailable; try again shortly",
            ));
        }
    };
    match endpoint {
        Some(e) if e.revoked_at.is_none() && e.token_matches(&hash) => Ok(e),
        _ => {
            // One answer for an unknown endpoint, a revoked one and a wrong token; one log line
            // per window however many arrive (a flood of 401s must not flood the log).
            let allowed = super::lock(&server.inner.unauthorized_log).allow(server.now());
            if let Some(suppressed) = allowed {
                tracing::info!(
                    endpoint = %escape_text(name),
                    suppressed,
                    "refused: unknown endpoint, revoked, or wrong token"
                );
            }
            Err(unauthorized(
                "the endpoint is unknown or revoked, or the token is wrong",
            ))
        }
    }
}

/// A request to `/mcp/{name}` that passed [`admit`]: the endpoint's name and the headers. GET
/// and DELETE take it; a POST admits itself, since it reads its body before refusing.
struct Admitted {
    name: String,
    endpoint: Endpoint,
    headers: HeaderMap,
}

impl FromRequestParts<Server> for Admitted {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, server: &Server) -> Result<Self, Response> {
        let Path(name) = Path::<String>::from_request_parts(parts, server)
            .await
            .map_err(IntoResponse::into_response)?;
        let endpoint = admit(server, &name, &parts.headers).await?;
        Ok(Admitted {
            name,
            endpoint,
            headers: parts.headers.clone(),
        })
    }
}

async fn mcp_post(
    State(server): State<Server>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let limit = server.inner.config.body_limit;
    let deadline = server.inner.config.answer_timeout;
    let admitted = match tokio::time::timeout(deadline, admit(&server, &name, &headers)).await {
        Ok(admitted) => admitted,
        Err(_) => Err(no_answer(&server, &name, "admit", Value::Null)),
    };
    let endpoint = match admitted {
        Ok(e) => e,
        Err(r) => {
            // Read the body (within its limit and timeout) before refusing: a connection closed
            // with request bytes still unread is reset, and the reset can destroy the refusal
            // on its way to the client.
            let _ = tokio::time::timeout(
                server.inner.config.body_timeout,
                axum::body::to_bytes(body, limit),
            )
            .await;
            return r;
        }
    };
    let too_big = || {
        tracing::info!(endpoint = %escape_text(&name), limit, "refused: request body over the limit");
        rpc_error(
            StatusCode::PAYLOAD_TOO_LARGE,
            Value::Null,
            -32600,
            &format!(
                "request body larger than {limit} bytes; nothing was changed. Send a smaller \
                 request (store large inputs elsewhere and pass a reference)"
            ),
        )
    };
    let declared = header_str(&headers, header::CONTENT_LENGTH).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return too_big();
    }
    let read = tokio::time::timeout(
        server.inner.config.body_timeout,
        axum::body::to_bytes(body, limit),
    )
    .await;
    let Ok(read) = read else {
        tracing::info!(endpoint = %escape_text(&name), "refused: request body not in within the body timeout");
        return rpc_error(
            StatusCode::REQUEST_TIMEOUT,
            Value::Null,
            -32600,
            "the request body did not arrive in time; nothing was changed. Send it again, whole",
        );
    };
    let bytes = match read {
        Ok(b) => b,
        Err(e) => {
            let over = std::error::Error::source(&e)
                .is_some_and(|s| s.is::<http_body_util::LengthLimitError>())
                || e.to_string().contains("length limit");
            if over {
                return too_big();
            }
            return rpc_error(
                StatusCode::BAD_REQUEST,
                Value::Null,
                -32700,
                "the request body could not be read; send it again",
            );
        }
    };
    let message = match relay_core::mcp::parse(&bytes) {
        Ok(m) => m,
        Err(f) => return fault_response(&f),
    };
    let id = match &message {
        relay_core::mcp::Message::Request { id, .. } => id.clone(),
        _ => Value::Null,
    };
    let handled =
        tokio::time::timeout(deadline, rpc::handle(&server, &endpoint, &headers, message)).await;
    let Ok(reply) = handled else {
        return no_answer(&server, &name, "request", id);
    };
    match reply {
        Reply::Accepted => StatusCode::ACCEPTED.into_response(),
        Reply::Json {
            status,
            body,
            session,
        } => {
            let mut r = json_response(status, &body);
            if let Some(s) = session
                && let Ok(v) = HeaderValue::from_str(&s)
            {
                r.headers_mut().insert(SESSION_HEADER, v);
            }
            r
        }
        Reply::Raw(r) => r,
    }
}

/// The answer to an MCP request the store did not answer within `answer_timeout`: 503 with
/// a JSON-RPC internal error. Whatever was asked may or may not take effect, as when an answer
/// is lost, and the message says how to find out.
fn no_answer(server: &Server, name: &str, what: &str, id: Value) -> Response {
    let timeout = server.inner.config.answer_timeout;
    tracing::warn!(endpoint = %escape_text(name), what, timeout_ms = timeout.as_millis() as u64, "the store did not answer within the answer timeout");
    let mut r = rpc_error(
        StatusCode::SERVICE_UNAVAILABLE,
        id,
        relay_core::mcp::INTERNAL_ERROR,
        &format!(
            "{} Read before repeating a write (get_todo), or repeat it under its idempotency \
             key; a fenced write whose lease lapses meanwhile is refused",
            server.no_answer()
        ),
    );
    r.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    r
}

/// GET and DELETE belong to legacy sessions; the 2026-07-28 era has neither (405), and hears
/// the doorbell on `subscriptions/listen` instead.
fn modern_refusal(headers: &HeaderMap) -> Option<Response> {
    let modern = relay_core::mcp::era::bodiless_is_modern(&protocol_headers(headers));
    modern.then(|| {
        let mut r = rpc_error(
            StatusCode::METHOD_NOT_ALLOWED,
            Value::Null,
            -32600,
            "the 2026-07-28 era has no GET stream and no sessions to DELETE; POST              subscriptions/listen to hear the doorbell",
        );
        r.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("POST"));
        r
    })
}

async fn mcp_get(State(server): State<Server>, admitted: Admitted) -> Response {
    let Admitted {
        name,
        endpoint,
        headers,
    } = admitted;
    if let Some(r) = modern_refusal(&headers) {
        return r;
    }
    let accepts_sse = header_str(&headers, header::ACCEPT)
        .is_some_and(|a| a.contains("text/event-stream") || a.contains("*/*"));
    if !accepts_sse {
        return rpc_error(
            StatusCode::NOT_ACCEPTABLE,
            Value::Null,
            -32600,
            "GET opens the session's doorbell stream; send `Accept: text/event-stream`",
        );
    }
    let session = match check_session(&server, &endpoint, &headers, &Value::Null).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let rx = match server.open_stream(&session) {
        Ok(rx) => rx,
        Err(super::sessions::StreamRefused::Full(message)) => {
            return rpc_error(
                StatusCode::SERVICE_UNAVAILABLE,
                Value::Null,
                -32000,
                &message,
            );
        }
        Err(super::sessions::StreamRefused::AlreadyOpen) => {
            return rpc_error(
                StatusCode::CONFLICT,
                Value::Null,
                -32600,
                "this session already has an open stream; use that one (one stream per session)",
            );
        }
        Err(super::sessions::StreamRefused::NoSession) => {
            return rpc_error(
                StatusCode::NOT_FOUND,
                Value::Null,
                -32001,
                "session not found or expired; send `initialize` again for a new session",
            );
        }
    };
    // The store learns that the session holds a stream (it is never ended to make room); a
    // store error leaves the stream open, at worst unprotected until the next keep-alive.
    if let Err(e) = server.note_stream(&session, &endpoint.name).await {
        tracing::warn!(endpoint = %escape_text(&name), error = %e, "could not note the doorbell stream in the store");
    }
    tracing::info!(endpoint = %escape_text(&name), "doorbell stream opened");
    let end = StreamEnd::Session {
        server: server.clone(),
        id: session,
        endpoint: endpoint.name.clone(),
    };
    event_stream(&server, rx, None, end)
}

async fn mcp_delete(State(server): State<Server>, admitted: Admitted) -> Response {
    let Admitted { name, headers, .. } = admitted;
    if let Some(r) = modern_refusal(&headers) {
        return r;
    }
    let Some(session) = header_str(&headers, SESSION_HEADER) else {
        return rpc_error(
            StatusCode::BAD_REQUEST,
            Value::Null,
            -32600,
            "missing Mcp-Session-Id header: name the session to end",
        );
    };
    let ended = match server.end_session(session, &name).await {
        Ok(ended) => ended,
        Err(e) => {
            let context = format!("endpoint {} session end", escape_text(&name));
            return rpc_error(
                StatusCode::SERVICE_UNAVAILABLE,
                Value::Null,
                -32603,
                &server.internal_message(&context, &e),
            );
        }
    };
    if ended {
        tracing::info!(endpoint = %escape_text(&name), "session ended by the client");
        StatusCode::NO_CONTENT.into_response()
    } else {
        rpc_error(
            StatusCode::NOT_FOUND,
            Value::Null,
            -32001,
            "session not found or expired; nothing to end",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loopback() -> HostPolicy {
        HostPolicy {
            allowed_hosts: LOOPBACK_HOSTS.iter().map(|s| s.to_string()).collect(),
            allowed_origins: vec!["https://app.example".into()],
        }
    }

    #[test]
    fn hosts_are_matched_by_name_without_port() {
        let p = loopback();
        assert!(host_allowed(&p, Some("127.0.0.1:7070")));
        assert!(host_allowed(&p, Some("LOCALHOST")));
        assert!(host_allowed(&p, Some("[::1]:80")));
        assert!(!host_allowed(&p, Some("evil.example:7070")));
        assert!(!host_allowed(&p, None));
        let open = HostPolicy {
            allowed_hosts: vec![],
            allowed_origins: vec![],
        };
        assert!(host_allowed(&open, Some("anything")));
    }

    #[test]
    fn origins_must_be_listed_or_on_an_allowed_host() {
        let p = loopback();
        assert!(origin_allowed(&p, None));
        assert!(origin_allowed(&p, Some("http://localhost:5173")));
        assert!(origin_allowed(&p, Some("https://app.example")));
        assert!(!origin_allowed(&p, Some("https://evil.example")));
        assert!(!origin_allowed(&p, Some("null")));
    }
}
