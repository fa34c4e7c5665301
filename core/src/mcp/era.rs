//! Which era a request speaks, and the modern era's envelope rules: the per-request `_meta`, the
//! `MCP-Protocol-Version` / `Mcp-Method` / `Mcp-Name` headers that mirror it, the supported
//! versions. The server calls [`classify`]; the client builds its requests with [`stamp`], so
//! both sides read one rule.
//!
//! Checked in the specification's order: the envelope's presence and shape (-32602), then the
//! headers against the body (-32020), then the version (-32022). A request that mixes the eras
//! (a legacy session id beside a modern envelope) is refused rather than guessed at: the
//! specification lets a server ignore the session header, but a client sending both is confused
//! about which protocol it speaks, and a clear error is cheaper to debug than a silent choice.

use base64::Engine as _;
use serde_json::{Map, Value, json};

use super::{Fault, HEADER_MISMATCH, INVALID_PARAMS, INVALID_REQUEST, UNSUPPORTED_VERSION};

/// The modern revision this server and client speak.
pub const MODERN: &str = "2026-07-28";
/// Modern revisions, newest first (`server/discover`'s `supportedVersions`).
pub const MODERN_VERSIONS: [&str; 1] = [MODERN];
/// Legacy revisions, newest first. `initialize` echoes a requested one it supports and
/// otherwise answers the newest.
pub const LEGACY_VERSIONS: [&str; 3] = ["2025-11-25", "2025-06-18", "2025-03-26"];

/// The reserved `_meta` keys.
pub const META_VERSION: &str = "io.modelcontextprotocol/protocolVersion";
pub const META_CAPABILITIES: &str = "io.modelcontextprotocol/clientCapabilities";
pub const META_CLIENT_INFO: &str = "io.modelcontextprotocol/clientInfo";
pub const META_SERVER_INFO: &str = "io.modelcontextprotocol/serverInfo";
pub const META_SUBSCRIPTION: &str = "io.modelcontextprotocol/subscriptionId";

/// The headers, lower-case as HTTP libraries hand them over.
pub const SESSION_HEADER: &str = "mcp-session-id";
pub const VERSION_HEADER: &str = "mcp-protocol-version";
pub const METHOD_HEADER: &str = "mcp-method";
pub const NAME_HEADER: &str = "mcp-name";

/// What the transport saw besides the body. A header present but not visible ASCII is passed
/// as `Some` of what could be read (the caller maps it), so that it is checked, not dropped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Headers<'a> {
    pub session: Option<&'a str>,
    pub protocol_version: Option<&'a str>,
    pub method: Option<&'a str>,
    pub name: Option<&'a str>,
}

impl<'a> Headers<'a> {
    /// The headers as a list of (lower-case name, value) pairs carries them, e.g. what
    /// [`stamp`] answers: how a transport that keeps headers as pairs hands them to
    /// [`classify`].
    pub fn of_pairs(pairs: &'a [(&str, String)]) -> Headers<'a> {
        let get = |n: &str| pairs.iter().find(|(k, _)| *k == n).map(|(_, v)| v.as_str());
        Headers {
            session: get(SESSION_HEADER),
            protocol_version: get(VERSION_HEADER),
            method: get(METHOD_HEADER),
            name: get(NAME_HEADER),
        }
    }
}

/// A modern request's declared context: its version, its client's capabilities and, when sent,
/// its client's name and version. Nothing of it outlives the request.
#[derive(Clone, Debug, PartialEq)]
pub struct Envelope {
    pub version: String,
    pub capabilities: Map<String, Value>,
    pub client_info: Option<Value>,
}

impl Envelope {
    /// Whether the client declared the extension `id` (e.g. `io.modelcontextprotocol/tasks`).
    pub fn declares_extension(&self, id: &str) -> bool {
        self.capabilities
            .get("extensions")
            .and_then(Value::as_object)
            .is_some_and(|e| e.contains_key(id))
    }
}

/// The era of one request.
#[derive(Clone, Debug, PartialEq)]
pub enum Era {
    /// Legacy: the handshake (`initialize`, no session yet) or a request naming its session.
    Legacy {
        session: Option<String>,
    },
    Modern(Envelope),
}

impl Era {
    pub fn is_modern(&self) -> bool {
        matches!(self, Era::Modern(_))
    }

    /// `legacy` or `modern`, for logs and `relay doctor`.
    pub fn name(&self) -> &'static str {
        if self.is_modern() { "modern" } else { "legacy" }
    }
}

fn is_modern_version(v: &str) -> bool {
    !LEGACY_VERSIONS.contains(&v) && v != "2024-11-05"
}

/// The era of a request with `method` and `params` (`id` is echoed in a refusal). Modern when
/// `params._meta` names a protocol version (the body decides; the headers are checked against
/// it), or when the version header names a modern revision (then a missing envelope is the
/// client's error); otherwise legacy, where a request other than `initialize` must name a
/// session (the server checks that it is live).
pub fn classify(
    h: &Headers,
    method: &str,
    params: Option<&Value>,
    id: &Value,
) -> Result<Era, Fault> {
    let meta = params.and_then(|p| p.get("_meta"));
    let declared = meta.and_then(|m| m.get(META_VERSION));
    let header_modern = h.protocol_version.is_some_and(is_modern_version);
    if declared.is_none() {
        if header_modern {
            return Err(envelope_fault(
                id,
                &format!(
                    "the MCP-Protocol-Version header says {:?} but params._meta has no {META_VERSION:?}; \
                     a 2026-07-28 request carries its version and client capabilities in params._meta",
                    h.protocol_version.unwrap_or_default()
                ),
            ));
        }
        return legacy(h, method, id);
    }
    let meta = match meta {
        Some(Value::Object(m)) => m,
        _ => return Err(envelope_fault(id, "params._meta must be an object")),
    };
    let Some(Value::String(version)) = declared else {
        return Err(envelope_fault(
            id,
            &format!("params._meta[{META_VERSION:?}] must be a string such as \"{MODERN}\""),
        ));
    };
    let capabilities = match meta.get(META_CAPABILITIES) {
        Some(Value::Object(c)) => c.clone(),
        Some(_) => {
            return Err(envelope_fault(
                id,
                &format!("params._meta[{META_CAPABILITIES:?}] must be an object ({{}} for none)"),
            ));
        }
        None => {
            return Err(envelope_fault(
                id,
                &format!(
                    "params._meta lacks {META_CAPABILITIES:?}; every 2026-07-28 request declares \
                     its client capabilities ({{}} for none)"
                ),
            ));
        }
    };
    let client_info = match meta.get(META_CLIENT_INFO) {
        None => None,
        Some(v @ Value::Object(_)) => Some(v.clone()),
        Some(_) => {
            return Err(envelope_fault(
                id,
                &format!(
                    "params._meta[{META_CLIENT_INFO:?}] must be an object with name and version"
                ),
            ));
        }
    };
    check_headers(h, method, params, version, id)?;
    if h.session.is_some() {
        return Err(Fault::new(
            400,
            id.clone(),
            INVALID_REQUEST,
            "this request carries a 2026-07-28 envelope and a legacy Mcp-Session-Id header; the \
             2026-07-28 era has no sessions: drop the Mcp-Session-Id header (or drop the _meta \
             envelope and keep to the session's era)",
        ));
    }
    if !MODERN_VERSIONS.contains(&version.as_str()) {
        return Err(unsupported(id, version));
    }
    Ok(Era::Modern(Envelope {
        version: version.clone(),
        capabilities,
        client_info,
    }))
}

/// Whether a message without an answer (a notification, or a client's response) belongs to the
/// modern era: no session, and a modern version in the header or the envelope. A modern one is
/// accepted as it is; a legacy one still belongs to its session.
pub fn notification_is_modern(h: &Headers, params: Option<&Value>) -> bool {
    let declared = params
        .and_then(|p| p.get("_meta"))
        .is_some_and(|m| m.get(META_VERSION).is_some());
    h.session.is_none() && (declared || h.protocol_version.is_some_and(is_modern_version))
}

/// Whether a bodiless request (GET, DELETE) speaks the modern era, which has neither: no
/// session, and a modern version header.
pub fn bodiless_is_modern(h: &Headers) -> bool {
    h.session.is_none() && h.protocol_version.is_some_and(is_modern_version)
}

fn legacy(h: &Headers, method: &str, id: &Value) -> Result<Era, Fault> {
    if let Some(v) = h.protocol_version
        && !LEGACY_VERSIONS.contains(&v)
        && method != "initialize"
    {
        return Err(Fault::new(
            400,
            id.clone(),
            INVALID_REQUEST,
            format!(
                "unsupported MCP-Protocol-Version {v:?}; this server speaks {} in sessions and {} \
                 without",
                LEGACY_VERSIONS.join(", "),
                MODERN_VERSIONS.join(", ")
            ),
        ));
    }
    Ok(Era::Legacy {
        session: h.session.map(str::to_string),
    })
}

fn envelope_fault(id: &Value, what: &str) -> Fault {
    Fault::new(
        400,
        id.clone(),
        INVALID_PARAMS,
        format!("invalid params: {what}"),
    )
}

fn unsupported(id: &Value, requested: &str) -> Fault {
    Fault::new(
        400,
        id.clone(),
        UNSUPPORTED_VERSION,
        format!(
            "unsupported protocol version {requested:?}; this server speaks {} without a session \
             (and {} through initialize)",
            MODERN_VERSIONS.join(", "),
            LEGACY_VERSIONS.join(", ")
        ),
    )
    .with_data(json!({"supported": MODERN_VERSIONS, "requested": requested}))
}

/// The body value `Mcp-Name` mirrors for `method`, if the method has one.
fn named<'a>(method: &str, params: Option<&'a Value>) -> Option<(&'static str, Option<&'a str>)> {
    let field = match method {
        "tools/call" | "prompts/get" => "name",
        "resources/read" => "uri",
        // The Tasks extension's routed methods; its removed ones (`tasks/list`,
        // `tasks/result`) carry no name and are answered method-not-found.
        "tasks/get" | "tasks/update" | "tasks/cancel" => "taskId",
        _ => return None,
    };
    Some((
        field,
        params.and_then(|p| p.get(field)).and_then(Value::as_str),
    ))
}

fn mismatch(id: &Value, what: String) -> Fault {
    Fault::new(
        400,
        id.clone(),
        HEADER_MISMATCH,
        format!("header mismatch: {what}"),
    )
}

fn check_headers(
    h: &Headers,
    method: &str,
    params: Option<&Value>,
    version: &str,
    id: &Value,
) -> Result<(), Fault> {
    match h.protocol_version {
        None => {
            return Err(mismatch(
                id,
                format!(
                    "the MCP-Protocol-Version header is missing; send {version:?}, as in params._meta"
                ),
            ));
        }
        Some(v) if v.trim() != version => {
            return Err(mismatch(
                id,
                format!(
                    "the MCP-Protocol-Version header says {v:?} but params._meta says {version:?}"
                ),
            ));
        }
        Some(_) => {}
    }
    match h.method {
        None => {
            return Err(mismatch(
                id,
                format!("the Mcp-Method header is missing; send {method:?}"),
            ));
        }
        Some(m) if m.trim() != method => {
            return Err(mismatch(
                id,
                format!("the Mcp-Method header says {m:?} but the body's method is {method:?}"),
            ));
        }
        Some(_) => {}
    }
    if let Some((field, body)) = named(method, params) {
        let Some(raw) = h.name else {
            return Err(mismatch(
                id,
                format!("the Mcp-Name header is missing; {method} sends params.{field} in it"),
            ));
        };
        let Some(header) = decode_header_value(raw.trim()) else {
            return Err(mismatch(
                id,
                "the Mcp-Name header's =?base64?…?= value is not valid base64 of UTF-8".into(),
            ));
        };
        if Some(header.as_str()) != body {
            return Err(mismatch(
                id,
                format!(
                    "the Mcp-Name header does not match params.{field}; send the same value in both"
                ),
            ));
        }
    }
    Ok(())
}

const B64_OPEN: &str = "=?base64?";
const B64_CLOSE: &str = "?=";

/// A header value as sent: plain visible ASCII as it is, anything else as `=?base64?…?=`.
pub fn encode_header_value(v: &str) -> String {
    let plain = !v.is_empty()
        && v.bytes().all(|b| (0x20..0x7f).contains(&b))
        && v.trim() == v
        && !v.starts_with(B64_OPEN);
    if plain {
        v.to_string()
    } else {
        let b64 = base64::engine::general_purpose::STANDARD.encode(v.as_bytes());
        format!("{B64_OPEN}{b64}{B64_CLOSE}")
    }
}

/// The inverse of [`encode_header_value`]; `None` for a sentinel around bad base64 or non-UTF-8.
pub fn decode_header_value(v: &str) -> Option<String> {
    match v
        .strip_prefix(B64_OPEN)
        .and_then(|r| r.strip_suffix(B64_CLOSE))
    {
        None => Some(v.to_string()),
        Some(b64) => {
            let bytes = base64::engine::general_purpose::STANDARD.decode(b64).ok()?;
            String::from_utf8(bytes).ok()
        }
    }
}

/// The client side: a modern request for `method` with `params` (an object or null), stamped
/// with the envelope (this client declares no capabilities), and the headers that mirror it.
pub fn stamp(
    method: &str,
    params: Value,
    client_info: &Value,
) -> (Value, Vec<(&'static str, String)>) {
    let mut params = match params {
        Value::Object(p) => p,
        _ => Map::new(),
    };
    let meta = params
        .entry("_meta")
        .or_insert_with(|| Value::Object(Map::new()));
    if let Value::Object(meta) = meta {
        meta.insert(META_VERSION.into(), json!(MODERN));
        meta.insert(META_CAPABILITIES.into(), json!({}));
        meta.insert(META_CLIENT_INFO.into(), client_info.clone());
    }
    let params = Value::Object(params);
    let mut headers = vec![
        (VERSION_HEADER, MODERN.to_string()),
        (METHOD_HEADER, method.to_string()),
    ];
    if let Some((_, Some(name))) = named(method, Some(&params)) {
        headers.push((NAME_HEADER, encode_header_value(name)));
    }
    (params, headers)
}

/// What a client learns from its `server/discover` probe.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probe {
    /// The server speaks [`MODERN`]: use it, without a session.
    Modern,
    /// It does not (an error, a 4xx, or no shared version): `initialize` instead.
    Legacy,
}

/// The probe's verdict from the discover result (`Ok`) or a JSON-RPC error code (`Err`). A
/// result whose `supportedVersions` include [`MODERN`] is modern; anything else falls back. The
/// caller decides transport failures, credentials (401/403) and 5xx itself: those say nothing
/// about the era.
pub fn probe(answer: Result<&Value, i64>) -> Probe {
    match answer {
        Ok(result) => {
            let shared = result
                .get("supportedVersions")
                .and_then(Value::as_array)
                .is_some_and(|vs| vs.iter().any(|v| v.as_str() == Some(MODERN)));
            if shared { Probe::Modern } else { Probe::Legacy }
        }
        Err(_) => Probe::Legacy,
    }
}
