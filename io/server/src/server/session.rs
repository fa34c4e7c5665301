//! Sessions over headers and the JSON-RPC error reply: what both the routes ([`super::http`])
//! and the JSON-RPC handler ([`super::rpc`]) use. It imports neither, so neither imports the
//! other back.

// The refusal *is* the response to send; boxing it would only add an allocation per refusal.
#![allow(clippy::result_large_err)]

use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::Server;
use crate::store::Endpoint;

pub(crate) const SESSION_HEADER: &str = "mcp-session-id";
pub(crate) const VERSION_HEADER: &str = "mcp-protocol-version";

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

pub(crate) fn header_str(headers: &HeaderMap, name: impl header::AsHeaderName) -> Option<&str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// What a request's session headers say, checked. `Err` is the response to send.
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
             it answers on every later request",
        ));
    };
    if let Some(v) = header_str(headers, VERSION_HEADER)
        && !super::PROTOCOL_VERSIONS.contains(&v)
    {
        return Err(rpc_error(
            StatusCode::BAD_REQUEST,
            id.clone(),
            -32600,
            &format!(
                "unsupported MCP-Protocol-Version {v:?}; this server speaks {}",
                super::PROTOCOL_VERSIONS.join(", ")
            ),
        ));
    }
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
            -32001,
            "session not found or expired; send `initialize` again for a new session",
        ));
    }
    Ok(session.to_string())
}
