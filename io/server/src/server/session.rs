//! Sessions over headers, the JSON-RPC error reply and the event-stream response: what both the
//! routes (`http`) and the JSON-RPC handler (`rpc`) use. It imports neither,
//! so neither imports the other back.

// The refusal *is* the response to send; boxing it would only add an allocation per refusal.
#![allow(clippy::result_large_err)]

use std::convert::Infallible;
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use relay_core::mcp::era::{Headers, METHOD_HEADER, NAME_HEADER, SESSION_HEADER, VERSION_HEADER};
use relay_core::mcp::{Fault, UNAUTHORIZED};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::Server;
use crate::store::Endpoint;

pub(crate) fn json_response(status: StatusCode, body: &Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// A JSON-RPC error outside a tool result, with an HTTP status.
pub(crate) fn rpc_error(status: StatusCode, id: Value, code: i64, message: &str) -> Response {
    json_response(
        status,
        &json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}}),
    )
}

/// A refusal decided by core, as the response to send.
pub(crate) fn fault_response(f: &Fault) -> Response {
    let status = StatusCode::from_u16(f.status).unwrap_or(StatusCode::BAD_REQUEST);
    json_response(status, &f.body())
}

pub(crate) fn header_str(headers: &HeaderMap, name: impl header::AsHeaderName) -> Option<&str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// A header as the era rules read it: present but not visible ASCII is still present (so it is
/// refused as a mismatch, not taken for missing).
fn protocol_header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get(name)
        .map(|v| v.to_str().unwrap_or("(not visible ASCII)"))
}

/// The protocol headers of a request, for `relay_core::mcp::era::classify`.
pub(crate) fn protocol_headers(headers: &HeaderMap) -> Headers<'_> {
    Headers {
        session: protocol_header(headers, SESSION_HEADER),
        protocol_version: protocol_header(headers, VERSION_HEADER),
        method: protocol_header(headers, METHOD_HEADER),
        name: protocol_header(headers, NAME_HEADER),
    }
}

/// Checks a legacy request's session. `Err` is the response to send.
pub(crate) async fn check_session(
    server: &Server,
    endpoint: &Endpoint,
    headers: &HeaderMap,
    id: &Value,
) -> Result<String, Response> {
    let Some(session) = header_str(headers, SESSION_HEADER) else {
        return Err(rpc_error(
            StatusCode::BAD_REQUEST,
            id.clone(),
            -32600,
            "missing Mcp-Session-Id header; send `initialize` first and repeat the session id \
             it answers on every later request, or speak the 2026-07-28 era (no session: \
             `server/discover`, and the protocol version and client capabilities in each \
             request's params._meta)",
        ));
    };
    let live = match server.touch_session(session, endpoint).await {
        Ok(live) => live,
        Err(e) => {
            let context = format!("endpoint {} session check", endpoint.name);
            return Err(rpc_error(
                StatusCode::SERVICE_UNAVAILABLE,
                id.clone(),
                -32603,
                &server.internal_message(&context, &e),
            ));
        }
    };
    if !live {
        return Err(rpc_error(
            StatusCode::NOT_FOUND,
            id.clone(),
            UNAUTHORIZED,
            "session not found or expired; send `initialize` again for a new session",
        ));
    }
    Ok(session.to_string())
}

/// What a stream does when its response is dropped (the client went, or the stream ended).
pub(crate) enum StreamEnd {
    /// A modern listen: nothing (the doorbell sweep forgets a closed listener).
    Listen,
    /// A legacy session's GET stream: the store forgets that the session holds a stream.
    Session {
        server: Server,
        id: String,
        endpoint: String,
    },
}

impl Drop for StreamEnd {
    fn drop(&mut self) {
        if let StreamEnd::Session {
            server,
            id,
            endpoint,
        } = self
        {
            server.note_stream_end(id, endpoint);
        }
    }
}

/// A doorbell stream as a server-sent event stream: each message `rx` yields, a keep-alive
/// comment every 15 s, and at shutdown `farewell` (a modern listen's closing answer) before the
/// stream ends; `end` runs when the response is dropped.
pub(crate) fn event_stream(
    server: &Server,
    rx: mpsc::Receiver<String>,
    farewell: Option<String>,
    end: StreamEnd,
) -> Response {
    let shutdown = server.inner.shutdown.subscribe();
    let stream = futures_util::stream::unfold(
        (rx, shutdown, farewell, false, end),
        |(mut rx, mut shutdown, farewell, ended, end)| async move {
            if ended {
                return None;
            }
            let msg = tokio::select! {
                m = rx.recv() => m,
                _ = shutdown.wait_for(|v| *v) => None,
            };
            match msg {
                Some(m) => Some((
                    Ok::<Event, Infallible>(Event::default().data(m)),
                    (rx, shutdown, farewell, false, end),
                )),
                // The farewell is the last message; the stream ends after it.
                None => farewell.map(|f| {
                    (
                        Ok(Event::default().data(f)),
                        (rx, shutdown, None, true, end),
                    )
                }),
            }
        },
    );
    let mut r = Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response();
    // Proxies must not buffer a stream of rings.
    r.headers_mut()
        .insert("x-accel-buffering", header::HeaderValue::from_static("no"));
    r
}
