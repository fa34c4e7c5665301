//! MCP's envelope around the tools, in both protocol eras, pure: the JSON-RPC message, which era
//! a request speaks and whether its headers agree with its body ([`era`]), the answers' frames
//! per era, and the modern doorbell on `subscriptions/listen` ([`listen`]).
//!
//! The two eras:
//! - **legacy** (2025-03-26 … 2025-11-25): `initialize` makes a session (`Mcp-Session-Id`), every
//!   later request names it; the doorbell is a GET stream per session.
//! - **modern** (2026-07-28, stateless): no handshake and no session; every request carries its
//!   protocol version and client capabilities in `params._meta`, mirrored in the
//!   `MCP-Protocol-Version`, `Mcp-Method` and `Mcp-Name` headers; `server/discover` tells what
//!   the server speaks; the doorbell is a resource update on `subscriptions/listen`.
//!
//! Tools, their arguments, answers and error codes are the same in both ([`crate::serve`]); only
//! the frame differs. The server (io) moves bytes: it hands [`parse`] the body and
//! [`era::classify`] the headers, dispatches on the [`Method`], and frames the answer with
//! [`framed`]. The daemon's client builds its modern requests with [`era::stamp`]. The fuzz target
//! `mcp_decode` runs both decoders on arbitrary input.

pub mod client;
pub mod era;
pub mod listen;

use serde_json::{Map, Value, json};

pub use era::{Era, Headers};

/// JSON-RPC's and MCP's error codes.
pub const PARSE_ERROR: i64 = -32700;
pub const INVALID_REQUEST: i64 = -32600;
pub const METHOD_NOT_FOUND: i64 = -32601;
pub const INVALID_PARAMS: i64 = -32602;
pub const INTERNAL_ERROR: i64 = -32603;
/// relay's own: a request the server refused for its credentials or session (legacy era).
pub const UNAUTHORIZED: i64 = -32001;
/// Legacy era: a resource that does not exist (modern: [`INVALID_PARAMS`] with `data.uri`).
pub const RESOURCE_NOT_FOUND: i64 = -32002;
/// A resource method the endpoint is not granted.
pub const FORBIDDEN: i64 = -32003;
/// Modern era: a protocol header disagrees with the body, or is missing.
pub const HEADER_MISMATCH: i64 = -32020;
/// Modern era: the request lacks a client capability the method needs.
pub const MISSING_CAPABILITY: i64 = -32021;
/// Modern era: the protocol version is not one this server speaks.
pub const UNSUPPORTED_VERSION: i64 = -32022;

/// A refusal before (or instead of) a method's answer: the HTTP status and the JSON-RPC error.
/// Messages say what was wrong and what to send instead; they never quote a header's value
/// beyond the protocol's own (version, method, name).
#[derive(Clone, Debug, PartialEq)]
pub struct Fault {
    pub status: u16,
    pub id: Value,
    pub code: i64,
    pub message: String,
    pub data: Option<Value>,
}

impl Fault {
    pub fn new(status: u16, id: Value, code: i64, message: impl Into<String>) -> Fault {
        Fault {
            status,
            id,
            code,
            message: message.into(),
            data: None,
        }
    }

    pub fn with_data(mut self, data: Value) -> Fault {
        self.data = Some(data);
        self
    }

    /// The JSON-RPC error response.
    pub fn body(&self) -> Value {
        let mut error = json!({"code": self.code, "message": self.message});
        if let Some(d) = &self.data {
            error["data"] = d.clone();
        }
        json!({"jsonrpc": "2.0", "id": self.id, "error": error})
    }
}

/// One JSON-RPC message, shape-checked.
#[derive(Clone, Debug, PartialEq)]
pub enum Message {
    Request {
        id: Value,
        method: String,
        params: Option<Value>,
    },
    Notification {
        params: Option<Value>,
    },
    /// An answer to a request the server never sends; accepted and dropped.
    Response,
}

/// Parses a body into one JSON-RPC message. Invalid UTF-8 or JSON is a parse error; a batch or
/// anything that is not a JSON-RPC 2.0 object is an invalid request (both HTTP 400).
pub fn parse(bytes: &[u8]) -> Result<Message, Fault> {
    let parse_error = |what: &str| {
        Fault::new(
            400,
            Value::Null,
            PARSE_ERROR,
            format!("parse error: {what}; send one JSON-RPC 2.0 request as a UTF-8 JSON object"),
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
        Fault::new(400, id, INVALID_REQUEST, format!("invalid request: {what}"))
    };
    let Value::Object(mut obj) = value else {
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
    let id = obj.remove("id");
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
    let params = obj.remove("params");
    match (obj.remove("method"), id) {
        (Some(Value::String(method)), id) => {
            if params.as_ref().is_some_and(|p| !p.is_object()) {
                return Err(invalid(echo, "`params` must be an object"));
            }
            Ok(match id {
                Some(id) => Message::Request { id, method, params },
                None => Message::Notification { params },
            })
        }
        (Some(_), _) => Err(invalid(echo, "`method` must be a string")),
        (None, Some(_)) if obj.contains_key("result") || obj.contains_key("error") => {
            Ok(Message::Response)
        }
        (None, _) => Err(invalid(echo, "a request needs `method`")),
    }
}

crate::names! {
    /// The methods this server answers, with the era each belongs to.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
    pub enum Method {
        Initialize => "initialize",
        Ping => "ping",
        Discover => "server/discover",
        ToolsList => "tools/list",
        ToolsCall => "tools/call",
        ResourcesList => "resources/list",
        ResourcesRead => "resources/read",
        ResourcesTemplatesList => "resources/templates/list",
        Listen => "subscriptions/listen",
        /// The Tasks extension's methods (`tasks/list` and `tasks/result` were removed from it, and
        /// are method-not-found).
        TasksGet => "tasks/get",
        TasksUpdate => "tasks/update",
        TasksCancel => "tasks/cancel",
    }
}

impl Method {
    /// Whether the era has this method: the handshake and `ping` are legacy only (2026-07-28
    /// removed them); `server/discover` and `subscriptions/listen` modern only.
    pub fn in_era(self, modern: bool) -> bool {
        match self {
            Method::Initialize | Method::Ping => !modern,
            Method::Discover | Method::Listen => modern,
            Method::TasksGet | Method::TasksUpdate | Method::TasksCancel => modern,
            _ => true,
        }
    }

    /// The task method this is, if it is one.
    pub fn task(self) -> Option<crate::task::TaskMethod> {
        use crate::task::TaskMethod;
        match self {
            Method::TasksGet => Some(TaskMethod::Get),
            Method::TasksUpdate => Some(TaskMethod::Update),
            Method::TasksCancel => Some(TaskMethod::Cancel),
            _ => None,
        }
    }

    /// The method of a request in `era`; an unknown one, or one of the other era, is
    /// method-not-found (HTTP 404 in the modern era, whose clients tell a server that lacks a
    /// method from one that lacks the endpoint by the JSON-RPC body).
    pub fn of(name: &str, era: &Era, id: &Value) -> Result<Method, Fault> {
        let modern = era.is_modern();
        if let Some(m) = Method::parse(name).filter(|m| m.in_era(modern)) {
            return Ok(m);
        }
        let offered: Vec<&str> = Method::ALL
            .iter()
            .filter(|m| m.in_era(modern))
            .map(|m| m.as_str())
            .collect();
        let which = if modern {
            "in the 2026-07-28 era"
        } else {
            "in a session (initialize first for the legacy era, or send 2026-07-28 `_meta`)"
        };
        Err(Fault::new(
            if modern { 404 } else { 200 },
            id.clone(),
            METHOD_NOT_FOUND,
            format!(
                "method not found: {name:?}; this server answers {} {which}",
                offered.join(", ")
            ),
        ))
    }

    /// How long a modern client may reuse the answer, and for whom (`CacheableResult`). Every
    /// answer depends on the endpoint's bearer, so none is `public`; tools and templates change
    /// only when the endpoint is re-vended, todo data at any moment.
    fn cache(self) -> Option<(u64, &'static str)> {
        match self {
            Method::Discover | Method::ToolsList | Method::ResourcesTemplatesList => {
                Some((CACHE_TTL_MS, "private"))
            }
            Method::ResourcesList | Method::ResourcesRead => Some((0, "private")),
            _ => None,
        }
    }
}

/// How long a modern client may cache `server/discover`, `tools/list` and the templates.
pub const CACHE_TTL_MS: u64 = 60_000;

/// The server's name and version, as both eras announce it.
pub fn server_info() -> Value {
    json!({"name": "relay", "version": env!("CARGO_PKG_VERSION")})
}

/// The capabilities an endpoint with `grant` is offered in `era`: tools always (they never
/// change while the endpoint lives); resources when it may list todos or claim (queue
/// resources), subscribable in the modern era through `subscriptions/listen`; the legacy
/// doorbell method as an experimental capability.
pub fn capabilities(grant: &crate::grant::Grant, era: &Era) -> Value {
    let mut caps = json!({"tools": {"listChanged": false}});
    if !era.is_modern() {
        caps["experimental"] = json!({"relay/doorbell": {"method": LEGACY_DOORBELL}});
    } else if grant.allows(crate::wire::Tool::AddTodo) {
        // Tasks are made by add_todo: an endpoint that may add is offered them.
        caps["extensions"] = json!({crate::task::EXTENSION: {}});
    }
    let listens = listen::offered(grant);
    if crate::resources::offered(grant) || listens {
        caps["resources"] = json!({"subscribe": era.is_modern() && listens, "listChanged": false});
    }
    caps
}

/// The legacy era's doorbell notification (on a session's GET stream).
pub const LEGACY_DOORBELL: &str = "notifications/todo_ready";

/// `server/discover`'s answer for an endpoint with `grant` (framed by [`framed`]).
pub fn discover(grant: &crate::grant::Grant, era: &Era) -> Value {
    json!({
        "supportedVersions": era::MODERN_VERSIONS,
        "capabilities": capabilities(grant, era),
        "instructions": "A work queue with fenced leases. claim_next takes work; heartbeat keeps \
            the lease; complete or fail ends the attempt. Subscribe to relay://queues/<queue> on \
            subscriptions/listen to hear when work may be waiting.",
    })
}

/// A method's result framed for its era: modern results say `resultType`, carry the server's
/// info in `_meta`, and the cacheable ones `ttlMs` and `cacheScope`; legacy results go as they
/// are.
pub fn framed(era: &Era, method: Method, mut result: Value) -> Value {
    if !era.is_modern() {
        return result;
    }
    if let Value::Object(obj) = &mut result {
        obj.entry("resultType").or_insert_with(|| json!("complete"));
        if let Some((ttl, scope)) = method.cache() {
            obj.insert("ttlMs".into(), json!(ttl));
            obj.insert("cacheScope".into(), json!(scope));
        }
        let meta = obj
            .entry("_meta")
            .or_insert_with(|| Value::Object(Map::new()));
        if let Value::Object(meta) = meta {
            meta.insert(era::META_SERVER_INFO.into(), server_info());
        }
    }
    result
}

/// The answer of a successful request: `{"jsonrpc", "id", "result"}`.
pub fn response(id: Value, result: Value) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "result": result})
}

/// A method's refusal with `code` in `era`: HTTP 200 with the JSON-RPC error (the request was
/// understood; the method said no), except where the era gives the code a status of its own.
pub fn refusal(era: &Era, id: Value, code: i64, message: impl Into<String>) -> Fault {
    let status = match code {
        METHOD_NOT_FOUND if era.is_modern() => 404,
        HEADER_MISMATCH | MISSING_CAPABILITY | UNSUPPORTED_VERSION => 400,
        _ => 200,
    };
    Fault::new(status, id, code, message)
}

/// Whether a task method (or a task subscription) may be answered in `era`: the request must
/// declare the Tasks extension, or it is refused `-32021` naming the capability to declare.
pub fn tasks_declared(era: &Era, id: &Value, what: &str) -> Result<(), Fault> {
    let declared = match era {
        Era::Modern(env) => env.declares_extension(crate::task::EXTENSION),
        Era::Legacy { .. } => false,
    };
    if declared {
        return Ok(());
    }
    let ext = crate::task::EXTENSION;
    Err(refusal(
        era,
        id.clone(),
        MISSING_CAPABILITY,
        format!(
            "missing required client capability: {what} needs the Tasks extension; declare \
             {ext:?} under extensions in params._meta[{:?}]",
            era::META_CAPABILITIES
        ),
    )
    .with_data(json!({"requiredCapabilities": {"extensions": {ext: {}}}})))
}

/// A task method's refusal of `e` in `era` (`None` for an internal error): an unknown, foreign
/// or malformed task and bad params are invalid params (`-32602`), as the extension says.
pub fn task_refusal(era: &Era, id: Value, e: &crate::Error) -> Option<Fault> {
    use crate::ErrorCode;
    match e.code {
        ErrorCode::Internal => None,
        ErrorCode::Invalid | ErrorCode::NotFound | ErrorCode::Conflict | ErrorCode::Forbidden => {
            Some(refusal(era, id, INVALID_PARAMS, e.message.clone()))
        }
    }
}

/// A resource that does not exist, or that the endpoint may not see (the same answer): legacy
/// `-32002`, modern `-32602` with `data.uri` (2026-07-28 retired -32002).
pub fn resource_not_found(era: &Era, id: Value, uri: Option<&str>, message: &str) -> Fault {
    if era.is_modern() {
        refusal(era, id, INVALID_PARAMS, message).with_data(json!({"uri": uri}))
    } else {
        refusal(era, id, RESOURCE_NOT_FOUND, message)
    }
}

/// A resource method's refusal of `e` in `era` (`None` for an internal error, which the server
/// answers with an error id): bad params are invalid params naming the field, with `data.uri`
/// in the modern era when a URI was given (a URI relay does not serve names no resource); an
/// unknown or foreign resource is the era's not-found; a method the grant lacks, `-32003`.
pub fn resource_refusal(
    era: &Era,
    id: Value,
    uri: Option<&str>,
    e: &crate::Error,
) -> Option<Fault> {
    use crate::ErrorCode;
    Some(match e.code {
        ErrorCode::Invalid => {
            let f = refusal(era, id, INVALID_PARAMS, e.message.clone());
            match uri {
                Some(u) if era.is_modern() => f.with_data(json!({"uri": u})),
                _ => f,
            }
        }
        ErrorCode::NotFound => resource_not_found(era, id, uri, &e.message),
        ErrorCode::Forbidden => refusal(era, id, FORBIDDEN, e.message.clone()),
        ErrorCode::Conflict | ErrorCode::Internal => return None,
    })
}

#[cfg(test)]
mod tests;
