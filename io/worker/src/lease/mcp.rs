//! The narrow MCP Streamable HTTP client under the lease client and the doorbell listener:
//! JSON-RPC over POST in either era, answers as JSON or as an SSE-framed stream. The era is
//! chosen per source by [`SourceLink::open`]: `mcp_era`, or a `server/discover` probe judged by
//! `relay_core::mcp::client` (modern: every request stamped by `relay_core::mcp::era::stamp`,
//! no session; legacy: the `initialize` handshake and the `Mcp-Session-Id` session). Nothing
//! else of MCP (no sampling, no roots, no answering server requests) is spoken.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use relay_core::config::Secret;
use relay_core::mcp::client::{self as era_rules, DiscoverAnswer, EraChoice, ProbeFailure};
use relay_core::mcp::era::{self, Probe};
use relay_core::relay::Redactor;
use serde_json::{Value, json};

use futures_util::StreamExt;

use super::sse::SseParser;
use super::transport::{
    HttpRequest, MAX_RESPONSE_BYTES, StreamResponse, Transport, TransportError,
};

/// The protocol revision asked for; the server's answer decides the one used.
pub const PROTOCOL_VERSION: &str = "2025-06-18";
/// The default bound on every request.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// Server messages quoted in errors are cut to this many bytes.
const QUOTE_MAX: usize = 300;

/// Where a source is reached: its name (for errors), URL, resolved headers and transport.
#[derive(Clone)]
pub(crate) struct SourceLink {
    /// `queue.ci`, `channel.bell`: what every error names.
    pub source: String,
    pub url: String,
    headers: Vec<(String, Secret)>,
    pub transport: Arc<dyn Transport>,
    pub timeout: Duration,
    /// `mcp_era`: probe, or force an era.
    pub era: EraChoice,
    next_id: Arc<AtomicU64>,
}

impl std::fmt::Debug for SourceLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.headers.iter().map(|(n, _)| n.as_str()).collect();
        f.debug_struct("SourceLink")
            .field("source", &self.source)
            .field("url", &self.url)
            .field("headers", &names)
            .field("timeout", &self.timeout)
            .field("era", &self.era)
            .finish_non_exhaustive()
    }
}

/// How a source is spoken to: a legacy session (the id the server gave, if any, and the
/// protocol revision agreed), or the modern era (no session; `modern`, `id` none).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ClientSession {
    pub id: Option<String>,
    pub protocol_version: String,
    pub modern: bool,
}

impl ClientSession {
    /// The modern era: every request stamped, nothing kept.
    pub fn modern() -> ClientSession {
        ClientSession {
            id: None,
            protocol_version: era::MODERN.to_string(),
            modern: true,
        }
    }

    /// `modern` or `legacy`, for doctor and logs.
    pub fn era_name(&self) -> &'static str {
        if self.modern { "modern" } else { "legacy" }
    }

    /// `MCP 2026-07-28 (modern era, no session)`, for doctor.
    pub fn describe(&self) -> String {
        if self.modern {
            format!("MCP {} (modern era, no session)", self.protocol_version)
        } else {
            format!(
                "MCP {} (legacy era, initialize and a session)",
                self.protocol_version
            )
        }
    }
}

/// Why a JSON-RPC exchange gave no result. Texts quote the server only after redaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum RpcError {
    Transport(TransportError),
    /// HTTP 401 or 403: the credential is wrong or missing.
    Unauthorized(u16),
    /// HTTP 404 on a request that carried a session id: the server forgot the session and did
    /// not run the call.
    SessionGone,
    /// A modern request refused before it ran in a way that says the server may no longer speak
    /// the modern era (`relay_core::mcp::client::modern_refused`): re-probe.
    EraGone {
        status: u16,
        code: Option<i64>,
    },
    /// Any other non-2xx status.
    Status(u16),
    /// Not JSON, not JSON-RPC, or not the answer to our request.
    Malformed(String),
    /// A JSON-RPC error object.
    Rpc {
        code: i64,
        message: String,
    },
}

impl RpcError {
    pub fn describe(&self) -> String {
        match self {
            RpcError::Transport(e) => e.to_string(),
            RpcError::Unauthorized(s) => format!("the server answered HTTP {s}"),
            RpcError::SessionGone => "the server no longer knows the session (HTTP 404)".into(),
            RpcError::EraGone { status, code } => format!(
                "the server refused a {} request (HTTP {status}{}): it may no longer speak that \
                 era",
                era::MODERN,
                code.map(|c| format!(", JSON-RPC error {c}"))
                    .unwrap_or_default()
            ),
            RpcError::Status(s) => format!("the server answered HTTP {s}"),
            RpcError::Malformed(m) => format!("the answer is not valid JSON-RPC ({m})"),
            RpcError::Rpc { code, message } => {
                format!("the server answered JSON-RPC error {code}: {message}")
            }
        }
    }
}

impl SourceLink {
    pub fn new(
        source: impl Into<String>,
        url: impl Into<String>,
        headers: impl IntoIterator<Item = (String, Secret)>,
        transport: Arc<dyn Transport>,
    ) -> SourceLink {
        SourceLink {
            source: source.into(),
            url: url.into(),
            headers: headers.into_iter().collect(),
            transport,
            timeout: DEFAULT_TIMEOUT,
            era: EraChoice::Auto,
            next_id: Arc::new(AtomicU64::new(1)),
        }
    }

    /// The resolved header values, and the credential part of a `Scheme credential` value on
    /// its own (a server may quote just the token): never shown, masked out of quoted text.
    pub fn secret_values(&self) -> impl Iterator<Item = &str> {
        self.headers.iter().flat_map(|(_, v)| {
            let value = v.expose();
            let credential = value
                .split_once(' ')
                .map(|(_, rest)| rest.trim())
                .filter(|rest| !rest.is_empty());
            std::iter::once(value).chain(credential)
        })
    }

    /// A redactor for text quoted from the server: the header values plus `extra` (a lease
    /// token), and the generic credential shapes.
    pub fn redactor<'a>(&'a self, extra: impl IntoIterator<Item = &'a str>) -> Redactor {
        Redactor::new(self.secret_values().chain(extra))
    }

    /// The request with the source's headers, the protocol headers and the session's.
    pub fn request(
        &self,
        session: Option<&ClientSession>,
        accept: &str,
        body: Vec<u8>,
    ) -> HttpRequest {
        let mut headers: Vec<(String, String)> = self
            .headers
            .iter()
            .map(|(n, v)| (n.clone(), v.expose().to_string()))
            .collect();
        headers.push(("accept".into(), accept.into()));
        if !body.is_empty() {
            headers.push(("content-type".into(), "application/json".into()));
        }
        if let Some(s) = session.filter(|s| !s.modern) {
            if let Some(id) = &s.id {
                headers.push(("mcp-session-id".into(), id.clone()));
            }
            headers.push(("mcp-protocol-version".into(), s.protocol_version.clone()));
        }
        HttpRequest {
            url: self.url.clone(),
            headers,
            body,
            timeout: self.timeout,
        }
    }

    fn check_status(&self, session: Option<&ClientSession>, status: u16) -> Result<(), RpcError> {
        match status {
            200..=299 => Ok(()),
            401 | 403 => Err(RpcError::Unauthorized(status)),
            s if session.is_some_and(|s| s.modern) && era_rules::modern_refused(s, None) => {
                Err(RpcError::EraGone {
                    status: s,
                    code: None,
                })
            }
            404 if session.is_some_and(|s| s.id.is_some()) => Err(RpcError::SessionGone),
            s => Err(RpcError::Status(s)),
        }
    }

    /// One JSON-RPC request: its `result` and the answer's headers. The whole exchange is
    /// bounded by the timeout; an answer framed as an SSE stream is read only until the event
    /// that carries it.
    pub async fn rpc(
        &self,
        session: Option<&ClientSession>,
        method: &str,
        params: Value,
    ) -> Result<(Value, Vec<(String, String)>), RpcError> {
        let id = self.next_id();
        let req = self.call_request(session, id, method, params);
        let exchange = async {
            let resp = self
                .transport
                .post_stream(req)
                .await
                .map_err(RpcError::Transport)?;
            self.check_status(session, resp.status)?;
            let answer = read_answer(resp, id).await?;
            Ok::<_, RpcError>(answer)
        };
        let (answer, headers) = tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| RpcError::Transport(TransportError::Timeout(self.timeout)))??;
        if let Some(err) = answer.get("error") {
            let code = err.get("code").and_then(Value::as_i64).unwrap_or(0);
            let message = err
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or_default();
            if session.is_some_and(|s| s.modern) && era_rules::modern_refused(200, Some(code)) {
                return Err(RpcError::EraGone {
                    status: 200,
                    code: Some(code),
                });
            }
            return Err(RpcError::Rpc {
                code,
                message: self.quote(message, []),
            });
        }
        match answer.get("result") {
            Some(result) => Ok((result.clone(), headers)),
            None => Err(RpcError::Malformed(
                "neither result nor error in the answer".into(),
            )),
        }
    }

    /// A fresh JSON-RPC id.
    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// The POST of request `id`: in the modern era its params stamped with the envelope and its
    /// headers mirroring it; in the legacy era with the session's headers.
    pub fn call_request(
        &self,
        session: Option<&ClientSession>,
        id: u64,
        method: &str,
        params: Value,
    ) -> HttpRequest {
        let (params, protocol) = match session {
            Some(s) if s.modern => era::stamp(method, params, &client_info()),
            _ => (params, Vec::new()),
        };
        let body = json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
        let mut req = self.request(
            session,
            "application/json, text/event-stream",
            body.to_string().into_bytes(),
        );
        req.headers
            .extend(protocol.into_iter().map(|(n, v)| (n.to_string(), v)));
        req
    }

    /// The era this source speaks: `mcp_era` when it forces one, else the verdict of a
    /// `server/discover` probe; then the modern era as it is, or a new legacy session. 401/403,
    /// 5xx and transport failures are errors: they say nothing about the era.
    pub async fn open(&self) -> Result<ClientSession, RpcError> {
        let probe = match self.era.forced() {
            Some(p) => p,
            None => self.probe().await?,
        };
        match probe {
            Probe::Modern => Ok(ClientSession::modern()),
            Probe::Legacy => self.open_session().await,
        }
    }

    /// `server/discover` in the modern era, judged by core.
    async fn probe(&self) -> Result<Probe, RpcError> {
        let modern = ClientSession::modern();
        let answered = self.rpc(Some(&modern), "server/discover", json!({})).await;
        let answer = match &answered {
            Ok((result, _)) => DiscoverAnswer::Result(result),
            Err(RpcError::Transport(e)) => return Err(RpcError::Transport(e.clone())),
            Err(RpcError::EraGone { code: Some(c), .. } | RpcError::Rpc { code: c, .. }) => {
                DiscoverAnswer::Error(*c)
            }
            Err(RpcError::EraGone { status, code: None }) => DiscoverAnswer::Status(*status),
            Err(RpcError::Unauthorized(s) | RpcError::Status(s)) => DiscoverAnswer::Status(*s),
            Err(RpcError::Malformed(_)) => DiscoverAnswer::NotJsonRpc,
            Err(RpcError::SessionGone) => DiscoverAnswer::Status(404),
        };
        let verdict = era_rules::judge_discover(answer).map_err(|f| match f {
            ProbeFailure::Unauthorized(s) => RpcError::Unauthorized(s),
            ProbeFailure::ServerError(s) => RpcError::Status(s),
        });
        if let Ok(p) = verdict {
            tracing::debug!(source = %self.source, modern = (p == Probe::Modern), "server/discover probed");
        }
        verdict
    }

    /// One JSON-RPC notification (no answer expected beyond a 2xx).
    pub async fn notify(
        &self,
        session: Option<&ClientSession>,
        method: &str,
    ) -> Result<(), RpcError> {
        let body = json!({"jsonrpc": "2.0", "method": method});
        let req = self.request(
            session,
            "application/json, text/event-stream",
            body.to_string().into_bytes(),
        );
        let resp = self
            .transport
            .post(req)
            .await
            .map_err(RpcError::Transport)?;
        self.check_status(session, resp.status)
    }

    /// `initialize` (advertising no capabilities at all, so no `claude/channel`) and then
    /// `notifications/initialized`: a new legacy session.
    async fn open_session(&self) -> Result<ClientSession, RpcError> {
        let params = json!({
            "protocolVersion": PROTOCOL_VERSION,
            "capabilities": {},
            "clientInfo": client_info(),
        });
        let (result, headers) = self.rpc(None, "initialize", params).await?;
        let session = ClientSession {
            id: headers
                .iter()
                .find(|(n, _)| n.eq_ignore_ascii_case("mcp-session-id"))
                .map(|(_, v)| v.clone()),
            protocol_version: result
                .get("protocolVersion")
                .and_then(Value::as_str)
                .unwrap_or(PROTOCOL_VERSION)
                .to_string(),
            modern: false,
        };
        self.notify(Some(&session), "notifications/initialized")
            .await?;
        Ok(session)
    }

    /// Server text, redacted and cut, for an error message.
    pub fn quote<'a>(&'a self, text: &str, extra: impl IntoIterator<Item = &'a str>) -> String {
        let text = self.redactor(extra).redact(text);
        let cut = relay_core::bounds::cut_at_char_boundary(&text, QUOTE_MAX);
        if cut.len() < text.len() {
            format!("{cut}…")
        } else {
            cut.to_string()
        }
    }
}

/// Who the daemon says it is, in either era.
fn client_info() -> Value {
    json!({"name": "relay", "version": env!("CARGO_PKG_VERSION")})
}

/// The JSON-RPC answer with id `id` in a 2xx response, and the response's headers: the JSON
/// body, or the SSE event that carries it when the server answered as a stream (whatever the
/// stream carries before it, notifications or pings, is passed over).
async fn read_answer(
    resp: StreamResponse,
    id: u64,
) -> Result<(Value, Vec<(String, String)>), RpcError> {
    let is_stream = resp
        .header("content-type")
        .is_some_and(|c| c.trim_start().starts_with("text/event-stream"));
    let StreamResponse {
        headers, mut body, ..
    } = resp;
    if is_stream {
        let mut parser = SseParser::new();
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(RpcError::Transport)?;
            let answer = parser
                .push(&chunk)
                .into_iter()
                .filter(|e| e.event.as_deref().is_none_or(|t| t == "message"))
                .filter_map(|e| serde_json::from_str::<Value>(&e.data).ok())
                .find(|v| v.get("id").and_then(Value::as_u64) == Some(id));
            if let Some(answer) = answer {
                return Ok((answer, headers));
            }
        }
        return Err(RpcError::Malformed(
            "the event stream ended without the answer".into(),
        ));
    }
    let mut bytes = Vec::new();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(RpcError::Transport)?;
        if bytes.len() + chunk.len() > MAX_RESPONSE_BYTES {
            return Err(RpcError::Transport(TransportError::TooLarge(
                MAX_RESPONSE_BYTES,
            )));
        }
        bytes.extend_from_slice(&chunk);
    }
    let answer = serde_json::from_slice(&bytes)
        .map_err(|e| RpcError::Malformed(format!("not JSON: {e}")))?;
    Ok((answer, headers))
}
