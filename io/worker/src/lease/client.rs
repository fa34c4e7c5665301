//! [`LeaseClient`]: one MCP link per lease source (a `server/discover` probe, then the modern
//! era without a session or, on a legacy-only server, an `initialize`d session), used for
//! `tools/list` and `tools/call` only, with the capability check (do the tool schemas declare
//! what relay needs?) on every (re-)open. A legacy session the server forgot, or a modern request
//! refused in a way that says the server stopped speaking that era, re-opens: a fresh probe, so
//! a server upgraded or downgraded under a running daemon keeps working.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use relay_core::config::{ResolvedConfig, Secret, SourceKind, SourceRef};
use relay_core::error::ErrorCode;
pub use relay_core::relay::TOOL_ERROR;
use relay_core::relay::{
    AnswerError, Capabilities, Command, Input, LeaseError, ResultError, call_params_with,
    check_capabilities, failed_input, result_input,
};
use relay_core::wire::UsageArg;
use serde_json::{Value, json};

use super::mcp::{ClientSession, RpcError, SourceLink};
use super::transport::Transport;

/// `tools/list` pages followed at most; a server that keeps answering a cursor is broken.
const MAX_TOOLS_PAGES: usize = 64;

/// The [`LeaseError::Other`] code of a call refused locally because the source's server lacks
/// the attempt-history arguments (fence, summary and artifact, release): nothing was sent.
pub const UNSUPPORTED: &str = "lease_source_unsupported";
/// The [`LeaseError::Other`] code of an HTTP 401 or 403: the credential is wrong.
pub const UNAUTHORIZED: &str = "unauthorized";
/// The [`LeaseError::Other`] code of a JSON-RPC error object (an unknown method, bad params).
pub const RPC_ERROR: &str = "rpc_error";

/// What happened to the source's session while a call ran. The daemon hands each one, as
/// [`SessionNews::input`], to every harness bound to the source, before the call's own answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SessionNews {
    /// The server expired the session (`Input::SessionExpired`).
    Expired,
    /// A session was (re-)initialized and its tools/list checked (`Input::CapabilitiesKnown`).
    Known(Capabilities),
}

impl SessionNews {
    pub fn input(&self) -> Input {
        match self {
            SessionNews::Expired => Input::SessionExpired,
            SessionNews::Known(caps) => Input::CapabilitiesKnown(caps.clone()),
        }
    }
}

/// A lease-source error wrapped with the source and the operation. `kind` is what the
/// attempt logic branches on; the text says what was wrong and what to do, and never holds a
/// header value or a lease token (server text is redacted before it is quoted).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{source_name}: {operation} failed: {detail}; {hint}")]
pub struct LeaseCallError {
    /// `queue.ci`.
    pub source_name: String,
    /// `claim_next`, `heartbeat for todo td_1`, `initialize` …
    pub operation: String,
    pub kind: LeaseError,
    pub detail: String,
    pub hint: String,
}

impl LeaseCallError {
    /// The same failure, met while (re-)initializing for `operation`: the error names the
    /// call the daemon asked for, and says which step failed.
    fn during(mut self, operation: &str) -> LeaseCallError {
        self.detail = format!("{}: {}", self.operation, self.detail);
        self.operation = operation.to_string();
        self
    }
}

/// The answer to one lease command: the input for the machine, the session news to broadcast
/// first, and the wrapped error behind a `*Failed` input, for the log.
#[derive(Clone, Debug, PartialEq)]
pub struct LeaseOutcome {
    pub input: Input,
    pub session: Vec<SessionNews>,
    pub error: Option<LeaseCallError>,
}

impl LeaseOutcome {
    /// Every input in the order the machine must see them: session news, then the answer.
    pub fn inputs(&self) -> Vec<Input> {
        self.session
            .iter()
            .map(SessionNews::input)
            .chain(std::iter::once(self.input.clone()))
            .collect()
    }
}

/// A `tools/list` answer for doctor, with the session news met on the way.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolsList {
    /// `{"tools": [...]}`, every page merged.
    pub tools: Value,
    pub session: Vec<SessionNews>,
}

/// `execute` was handed a command that is not a lease call (a contract error of the caller).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}: the lease client executes only SendClaimNext, SendHeartbeat and SendReport")]
pub struct NotALeaseCall(pub String);

#[derive(Default)]
struct State {
    session: Option<ClientSession>,
    /// Bumped on every new session, so that concurrent callers that all saw the old one
    /// expire re-initialize once, not once each.
    generation: u64,
    capabilities: Option<Capabilities>,
}

/// The lease client of one `[queue.<name>]` source. Cheap to share (`Arc`); calls may run
/// concurrently (several harnesses may bind one source). It never opens the GET notification
/// stream and never advertises the `claude/channel` capability, so the server never treats its
/// session as a doorbell target.
///
/// Error mapping (the input's [`LeaseError`]):
/// - a tool result with `isError` → `Code(conflict | not_found | forbidden | invalid |
///   internal)`, an unknown code → `Other(code)`, no code → `Other("tool_error")`;
/// - connection refused, timeout, HTTP 5xx, an answer that is not JSON-RPC, a session that
///   expired again right after re-initializing → `Transport`;
/// - a claim answer without a field the daemon needs (`todo.id`, `todo.attempt`,
///   `todo.max_attempts`, `attempt_seq`, a usable `lease_token`) → `Malformed`, naming it (code
///   `malformed_answer`); no other field is read, and nothing else is required of an answer;
/// - HTTP 401/403 → `Other("unauthorized")`: the credential is wrong, retrying cannot help;
/// - other HTTP statuses → `Other("http_<status>")`; a JSON-RPC error object →
///   `Other("rpc_error")`;
/// - a source whose server lacks the attempt-history arguments (fence, summary and artifact,
///   release) → `Other("lease_source_unsupported")` without sending the call.
pub struct LeaseClient {
    ep: SourceLink,
    state: Mutex<State>,
    /// Serialises (re-)initialization.
    init: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for LeaseClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseClient")
            .field("endpoint", &self.ep)
            .finish_non_exhaustive()
    }
}

/// The wrapped error for an [`RpcError`].
fn rpc_failure(ep: &SourceLink, operation: &str, e: &RpcError) -> LeaseCallError {
    let (kind, hint) = match e {
        RpcError::Transport(_) => (
            LeaseError::Transport,
            "check that the queue server is running and reachable at the source's url".to_string(),
        ),
        RpcError::Malformed(_) => (
            LeaseError::Transport,
            "check that the source's url points at a relay queue server's /mcp/<endpoint>"
                .to_string(),
        ),
        RpcError::SessionGone => (
            LeaseError::Transport,
            "the server expired a session it had just opened; see the server's log".to_string(),
        ),
        RpcError::EraGone { .. } => (
            LeaseError::Transport,
            "the server refuses 2026-07-28 requests right after a probe or mcp_era chose that \
             era; see the server's log, or set mcp_era = \"legacy\" on the source"
                .to_string(),
        ),
        RpcError::Status(s) if *s >= 500 => (
            LeaseError::Transport,
            "the queue server failed; see its log".to_string(),
        ),
        RpcError::Status(s) => (
            LeaseError::Other(format!("http_{s}")),
            "check the source's url: it must be the server's /mcp/<endpoint> URL".to_string(),
        ),
        RpcError::Unauthorized(_) => (
            LeaseError::Other(UNAUTHORIZED.into()),
            "check the source's Authorization header and the token in its env_file".to_string(),
        ),
        RpcError::Rpc { .. } => (
            LeaseError::Other(RPC_ERROR.into()),
            "run `relay doctor` to compare the server's tools with what relay needs".to_string(),
        ),
    };
    LeaseCallError {
        source_name: ep.source.clone(),
        operation: operation.to_string(),
        kind,
        detail: e.describe(),
        hint,
    }
}

fn unsupported(ep: &SourceLink, operation: &str, caps: &Capabilities) -> LeaseCallError {
    LeaseCallError {
        source_name: ep.source.clone(),
        operation: operation.to_string(),
        kind: LeaseError::Other(UNSUPPORTED.into()),
        detail: format!(
            "the server's tools lack {} (not sent)",
            caps.missing.join(", ")
        ),
        hint: "relay needs a queue server with attempt history and fenced leases \
               (docs/daemon.md, \"Against any queue server\"); upgrade the server and run `relay doctor`"
            .to_string(),
    }
}

fn code_hint(kind: &LeaseError) -> &'static str {
    match kind {
        LeaseError::Code(ErrorCode::Conflict) => "this attempt no longer holds the lease",
        LeaseError::Code(ErrorCode::NotFound) => {
            "the todo is unknown to this endpoint (or was deleted)"
        }
        LeaseError::Code(ErrorCode::Forbidden) => {
            "grant the verb and the queue to the source's endpoint (`relay endpoint create … \
             --verbs …`)"
        }
        LeaseError::Code(ErrorCode::Invalid) => {
            "the server refused the arguments; run `relay doctor` to check its schemas"
        }
        LeaseError::Code(ErrorCode::Internal) => "the queue server hit a bug; see its log",
        _ => "see the queue server's log",
    }
}

/// What `tools/call` answered (its result object, unread), or why the call got none.
type CallResult = Result<Value, LeaseCallError>;

impl LeaseClient {
    /// `source` names the source in errors (`queue.ci`); `headers` are its resolved headers.
    pub fn new(
        source: impl Into<String>,
        url: impl Into<String>,
        headers: impl IntoIterator<Item = (String, Secret)>,
        transport: Arc<dyn Transport>,
    ) -> LeaseClient {
        LeaseClient {
            ep: SourceLink::new(source, url, headers, transport),
            state: Mutex::new(State::default()),
            init: tokio::sync::Mutex::new(()),
        }
    }

    /// The client of `[queue.<name>]` in a resolved config; `None` when there is no such table.
    pub fn from_config(
        config: &ResolvedConfig,
        name: &str,
        transport: Arc<dyn Transport>,
    ) -> Option<LeaseClient> {
        let source = config.config.queues.get(name)?;
        let r = SourceRef {
            kind: SourceKind::Queue,
            name: name.to_string(),
        };
        let headers = config.headers(&r).cloned().unwrap_or_default();
        Some(
            LeaseClient::new(
                r.to_string(),
                source.address.url.as_str(),
                headers,
                transport,
            )
            .with_era(source.address.mcp_era),
        )
    }

    /// Bounds every request (default 10 s).
    pub fn with_timeout(mut self, timeout: Duration) -> LeaseClient {
        self.ep.timeout = timeout;
        self
    }

    /// The source's name, as errors show it.
    pub fn source_name(&self) -> &str {
        &self.ep.source
    }

    /// Forces an era (`mcp_era`); `Auto` probes.
    pub fn with_era(mut self, era: relay_core::mcp::client::EraChoice) -> LeaseClient {
        self.ep.era = era;
        self
    }

    /// The era the source speaks, as doctor shows it (`MCP 2026-07-28 (modern era, no
    /// session)`); `None` before the first open.
    pub fn era(&self) -> Option<String> {
        self.lock().session.as_ref().map(ClientSession::describe)
    }

    /// The verdict of the last capability check, if a session has been checked.
    pub fn capabilities(&self) -> Option<Capabilities> {
        self.lock().capabilities.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A new link: the era (`mcp_era`, or the `server/discover` probe), in the legacy era
    /// `initialize` and `notifications/initialized`, then `tools/list` (every page) and the
    /// capability check, the same in both eras. Replaces any current session. The daemon hands the answer to
    /// every harness bound to the source as `Input::CapabilitiesKnown`.
    pub async fn initialize(&self) -> Result<Capabilities, LeaseCallError> {
        let _init = self.init.lock().await;
        self.lock().session = None;
        self.open_checked().await.map(|(caps, _)| caps)
    }

    /// Opens (probe, then the modern era or `initialize`) and checks a link and installs it;
    /// the caller holds `init`.
    async fn open_checked(&self) -> Result<(Capabilities, Value), LeaseCallError> {
        let session = self
            .ep
            .open()
            .await
            .map_err(|e| rpc_failure(&self.ep, "initialize", &e))?;
        tracing::info!(source = %self.ep.source, era = session.era_name(), "lease source opened");
        let tools = self
            .list_tools(&session)
            .await
            .map_err(|e| rpc_failure(&self.ep, "tools/list", &e))?;
        let caps = check_capabilities(&tools);
        if !caps.supported() {
            tracing::error!(
                source = %self.ep.source,
                missing = %caps.missing.join(", "),
                "the lease source's server lacks the arguments relay needs (attempt history \
                 and fenced leases); its harnesses are skipped until the server is upgraded"
            );
        }
        let mut state = self.lock();
        state.session = Some(session);
        state.generation += 1;
        state.capabilities = Some(caps.clone());
        Ok((caps, tools))
    }

    /// Every page of `tools/list`, merged into one `{"tools": [...]}`.
    async fn list_tools(&self, session: &ClientSession) -> Result<Value, RpcError> {
        let mut tools = Vec::new();
        let mut cursor: Option<String> = None;
        for _ in 0..MAX_TOOLS_PAGES {
            let params = match &cursor {
                Some(c) => json!({"cursor": c}),
                None => json!({}),
            };
            let (page, _) = self.ep.rpc(Some(session), "tools/list", params).await?;
            let Some(list) = page.get("tools").and_then(Value::as_array) else {
                return Err(RpcError::Malformed(
                    "tools/list answered no tools array".into(),
                ));
            };
            tools.extend(list.iter().cloned());
            match page.get("nextCursor").and_then(Value::as_str) {
                Some(next) if Some(next) != cursor.as_deref() => cursor = Some(next.to_string()),
                Some(_) => {
                    return Err(RpcError::Malformed(
                        "tools/list answered the same cursor twice".into(),
                    ));
                }
                None => return Ok(json!({ "tools": tools })),
            }
        }
        Err(RpcError::Malformed(format!(
            "tools/list did not end within {MAX_TOOLS_PAGES} pages"
        )))
    }

    /// The server's whole tool list, as `{"tools": [...]}`, for `relay doctor`, which
    /// names missing verbs and arguments from it. Opens a session when there is none, and
    /// re-initializes once when the server expired it (the news comes back with the list).
    pub async fn tools_list(&self) -> Result<ToolsList, LeaseCallError> {
        let failed = |e: RpcError| rpc_failure(&self.ep, "tools/list", &e);
        let mut session = Vec::new();
        let seen = match self.current() {
            Some((current, generation)) => match self.list_tools(&current).await {
                Err(RpcError::SessionGone | RpcError::EraGone { .. }) => Some(generation),
                r => {
                    let tools = r.map_err(failed)?;
                    return Ok(ToolsList { tools, session });
                }
            },
            None => None,
        };
        let tools = match self.renew(seen, &mut session).await? {
            (_, _, Some(tools)) => tools,
            (current, _, None) => self.list_tools(&current).await.map_err(failed)?,
        };
        Ok(ToolsList { tools, session })
    }

    fn current(&self) -> Option<(ClientSession, u64)> {
        let state = self.lock();
        Some((state.session.clone()?, state.generation))
    }

    /// Makes sure there is a session newer than `seen` (the generation the caller found
    /// expired; `None`: there was none). Whoever gets here first re-initializes and reports the
    /// news; later callers use its session.
    async fn renew(
        &self,
        seen: Option<u64>,
        news: &mut Vec<SessionNews>,
    ) -> Result<(ClientSession, u64, Option<Value>), LeaseCallError> {
        let _init = self.init.lock().await;
        {
            let mut state = self.lock();
            if let Some(session) = &state.session
                && seen != Some(state.generation)
            {
                return Ok((session.clone(), state.generation, None));
            }
            if seen.is_some() && state.session.is_some() {
                state.session = None;
                news.push(SessionNews::Expired);
            }
        }
        let (caps, tools) = self.open_checked().await?;
        news.push(SessionNews::Known(caps));
        let (session, generation) = self.current().ok_or_else(|| LeaseCallError {
            source_name: self.ep.source.clone(),
            operation: "initialize".into(),
            kind: LeaseError::Transport,
            detail: "the session was dropped while it was being opened".into(),
            hint: "retry".into(),
        })?;
        Ok((session, generation, Some(tools)))
    }

    fn supported_or(&self, operation: &str) -> Result<(), LeaseCallError> {
        match self.capabilities() {
            Some(caps) if !caps.supported() => Err(unsupported(&self.ep, operation, &caps)),
            _ => Ok(()),
        }
    }

    /// One `tools/call` for a lease command, with the session handling: a session is opened
    /// first when there is none; an HTTP 404 on the session (the server forgot it and did not
    /// run the call) re-initializes and retries the call once, unless the re-check finds the
    /// source unsupported. The params are built (core's [`call_params_with`], with `usage`)
    /// against the capabilities of the session that carries the call.
    async fn call(
        &self,
        operation: &str,
        command: &Command,
        usage: Option<&UsageArg>,
        news: &mut Vec<SessionNews>,
    ) -> CallResult {
        let (session, generation) = match self.current() {
            Some((s, g)) => (s, g),
            None => {
                let (s, g, _) = self
                    .renew(None, news)
                    .await
                    .map_err(|e| e.during(operation))?;
                (s, g)
            }
        };
        match self.call_on(&session, operation, command, usage).await? {
            Err(RpcError::SessionGone | RpcError::EraGone { .. }) => {}
            r => return self.tool_result(operation, r),
        }
        let (session, _, _) = self
            .renew(Some(generation), news)
            .await
            .map_err(|e| e.during(operation))?;
        match self.call_on(&session, operation, command, usage).await? {
            Err(e @ (RpcError::SessionGone | RpcError::EraGone { .. })) => {
                // Refused again at once: let the next call start over.
                let mut state = self.lock();
                if state.session.as_ref() == Some(&session) {
                    state.session = None;
                    news.push(SessionNews::Expired);
                }
                drop(state);
                Err(rpc_failure(&self.ep, operation, &e))
            }
            r => self.tool_result(operation, r),
        }
    }

    /// The lease command's `tools/call` on `session`, unless the source is unsupported.
    async fn call_on(
        &self,
        session: &ClientSession,
        operation: &str,
        command: &Command,
        usage: Option<&UsageArg>,
    ) -> Result<Result<(Value, Vec<(String, String)>), RpcError>, LeaseCallError> {
        self.supported_or(operation)?;
        let params = self.call_params(command, usage);
        Ok(self.ep.rpc(Some(session), "tools/call", params).await)
    }

    /// `tools/call`'s params for a lease command under the current capabilities.
    fn call_params(&self, command: &Command, usage: Option<&UsageArg>) -> Value {
        let caps = self.capabilities().unwrap_or_default();
        call_params_with(command, &caps, usage).unwrap_or(Value::Null)
    }

    /// The `tools/call` result, or the call's transport or JSON-RPC failure.
    fn tool_result(
        &self,
        operation: &str,
        r: Result<(Value, Vec<(String, String)>), RpcError>,
    ) -> CallResult {
        r.map(|(result, _)| result)
            .map_err(|e| rpc_failure(&self.ep, operation, &e))
    }

    /// The wrapped error for a `tools/call` result that is not a successful answer; the
    /// server's text is quoted redacted (`token` among what it hides).
    fn result_failure(
        &self,
        operation: &str,
        e: &ResultError,
        token: Option<&str>,
    ) -> LeaseCallError {
        let quote = |text: &str| self.ep.quote(text, token);
        let kind = e.kind(quote);
        let (detail, hint) = match e {
            ResultError::Malformed(a) => return self.malformed(operation, *a),
            ResultError::NotAnObject => (
                "the tools/call result is not a JSON object".to_string(),
                "check that the source's url points at an MCP queue server",
            ),
            ResultError::Tool { message, .. } => (
                format!(
                    "{}: {}",
                    kind.code(),
                    quote(message.as_deref().unwrap_or("no message"))
                ),
                code_hint(&kind),
            ),
        };
        LeaseCallError {
            source_name: self.ep.source.clone(),
            operation: operation.to_string(),
            kind,
            detail,
            hint: hint.to_string(),
        }
    }

    /// Carries out a `SendClaimNext`, `SendHeartbeat` or `SendReport` and answers the input the
    /// machine expects for it, with the session news to hand out first. The result is read by
    /// core's contract decoder ([`result_input`]): only the contract's fields, and an answer
    /// without one the daemon needs is a failure naming it (`malformed_answer`).
    pub async fn execute(&self, command: &Command) -> Result<LeaseOutcome, NotALeaseCall> {
        self.execute_with_usage(command, None).await
    }

    /// [`LeaseClient::execute`] with the attempt's usage so far, sent on a heartbeat or report
    /// where the server's schema for that verb declares `usage`.
    pub async fn execute_with_usage(
        &self,
        command: &Command,
        usage: Option<&UsageArg>,
    ) -> Result<LeaseOutcome, NotALeaseCall> {
        let (operation, token) = match command {
            Command::SendClaimNext { .. } => ("claim_next".to_string(), None),
            Command::SendHeartbeat {
                todo_id,
                lease_token,
                ..
            } => (
                format!("heartbeat for todo {todo_id}"),
                Some(lease_token.expose()),
            ),
            Command::SendReport {
                verb,
                todo_id,
                lease_token,
                ..
            } => (
                format!("{} for todo {todo_id}", verb.as_str()),
                Some(lease_token.expose()),
            ),
            other => {
                // The variant's name only: other commands carry payloads and summaries.
                let debug = format!("{other:?}");
                let name = debug.split([' ', '{', '(']).next().unwrap_or_default();
                return Err(NotALeaseCall(name.to_string()));
            }
        };
        let mut news = Vec::new();
        let answered = self.call(&operation, command, usage, &mut news).await;
        let (input, error) = match answered.map(|result| result_input(command, &result)) {
            Ok(Some(Ok(input))) => (Some(input), None),
            Ok(Some(Err(e))) => {
                let e = self.result_failure(&operation, &e, token);
                (failed_input(command, e.kind.clone()), Some(e))
            }
            Err(e) => (failed_input(command, e.kind.clone()), Some(e)),
            Ok(None) => (None, None),
        };
        let Some(input) = input else {
            return Err(NotALeaseCall(operation));
        };
        if let Some(e) = &error {
            tracing::warn!(source = %self.ep.source, operation = %e.operation, code = e.kind.code(), "{e}");
        }
        Ok(LeaseOutcome {
            input,
            session: news,
            error,
        })
    }

    /// An accepted call whose answer lacks a field the daemon needs.
    fn malformed(&self, operation: &str, e: AnswerError) -> LeaseCallError {
        LeaseCallError {
            source_name: self.ep.source.clone(),
            operation: operation.to_string(),
            kind: LeaseError::Malformed(Box::new(e)),
            detail: format!("{e} (nothing was spawned; the lease will lapse)"),
            hint: "the queue server does not answer what the relay contract requires (relay \
                   reads the claim's todo.id, todo.attempt, todo.max_attempts, attempt_seq and \
                   lease_token); check the server's version against the contract"
                .to_string(),
        }
    }
}
