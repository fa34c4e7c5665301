//! The values the store answers and takes, shared by both backends and the store's own
//! operations: endpoints, operators, Board sessions and bulk actions, MCP sessions, the Board's
//! overview and the doorbell scan's pages.

use relay_core::Millis;
use relay_core::ledger::{Todo, TokenHash};

/// The accepted `--db` forms, for error messages.
pub const DB_URL_FORMS: &str = "sqlite:PATH, sqlite::memory: or postgres://USER@HOST:PORT/DB";

/// A new endpoint: its name, the SHA-256 of its bearer token, the verbs and queues it may use.
#[derive(Clone, PartialEq, Eq)]
pub struct NewEndpoint {
    pub name: String,
    pub token_hash: TokenHash,
    pub verbs: Vec<String>,
    /// `None`: every queue.
    pub queues: Option<Vec<String>>,
}

impl NewEndpoint {
    /// An endpoint granted every tool on one queue, for `token` (the quick start's, a test's).
    pub fn every_tool_on(name: &str, token: &str, queue: &str) -> NewEndpoint {
        NewEndpoint {
            name: name.to_string(),
            token_hash: TokenHash::of(token),
            verbs: relay_core::wire::Tool::ALL
                .iter()
                .map(|t| t.as_str().to_string())
                .collect(),
            queues: Some(vec![queue.to_string()]),
        }
    }
}

/// A row of the endpoints table.
#[derive(Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub name: String,
    /// The SHA-256 of the bearer token; the token itself is never stored.
    pub token_hash: TokenHash,
    pub verbs: Vec<String>,
    /// `None`: every queue.
    pub queues: Option<Vec<String>>,
    pub created_at: Millis,
    pub revoked_at: Option<Millis>,
}

impl Endpoint {
    /// Whether a presented token's hash is this endpoint's, compared in constant time.
    pub fn token_matches(&self, presented: &TokenHash) -> bool {
        self.token_hash
            .0
            .iter()
            .zip(presented.0.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }

    /// What the endpoint may call, and on which queues.
    pub fn grant(&self) -> relay_core::grant::Grant {
        relay_core::grant::Grant::new(&self.verbs, self.queues.clone())
    }
}

// Hand-written so that no hash of a credential reaches a log.
impl std::fmt::Debug for NewEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NewEndpoint")
            .field("name", &self.name)
            .field("token_hash", &"<redacted>")
            .field("verbs", &self.verbs)
            .field("queues", &self.queues)
            .finish()
    }
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("name", &self.name)
            .field("token_hash", &"<redacted>")
            .field("verbs", &self.verbs)
            .field("queues", &self.queues)
            .field("created_at", &self.created_at)
            .field("revoked_at", &self.revoked_at)
            .finish()
    }
}

/// A row of the operators table: who may open the Board.
#[derive(Clone, PartialEq, Eq)]
pub struct Operator {
    pub name: String,
    /// The SHA-256 of the operator token; the token itself is never stored.
    pub token_hash: TokenHash,
    pub created_at: Millis,
    pub revoked_at: Option<Millis>,
}

// Hand-written so that no hash of a credential reaches a log.
impl std::fmt::Debug for Operator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Operator")
            .field("name", &self.name)
            .field("token_hash", &"<redacted>")
            .field("created_at", &self.created_at)
            .field("revoked_at", &self.revoked_at)
            .finish()
    }
}

/// A live Board session (its secret lives only in the operator's cookie).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BoardSession {
    pub operator: String,
    pub expires_at: Millis,
}

/// A Board bulk action: a retry or cancel of every todo of `queue` that `filter` (its words)
/// matched when the operator asked, each listed as it stood then.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bulk {
    pub id: String,
    pub operator: String,
    pub queue: String,
    pub action: relay_core::board::BulkAction,
    pub filter: String,
    pub created_at: Millis,
    /// Set when the operator confirmed it; only a confirmed action is applied.
    pub confirmed_at: Option<Millis>,
    pub finished_at: Option<Millis>,
    /// In todo id order.
    pub items: Vec<BulkItem>,
}

/// One todo a bulk action listed, and what became of it (`applied`: `None` while left to do).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BulkItem {
    pub todo_id: String,
    pub listed: relay_core::board::Listed,
    pub applied: Option<bool>,
    pub note: Option<String>,
}

/// What became of one todo a bulk action listed, as
/// [`Store::bulk_record`](super::Store::bulk_record) records it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BulkResult {
    pub todo_id: String,
    /// Whether the action was applied to it (`false`: skipped).
    pub applied: bool,
    /// Why it was skipped, or how it was applied.
    pub note: Option<String>,
}

/// A new MCP session, as [`Store::mcp_session_open`](super::Store::mcp_session_open) records it.
#[derive(Clone)]
pub struct McpSessionNew {
    /// The SHA-256 of the session id; the id itself is never stored.
    pub id_hash: TokenHash,
    pub endpoint: String,
    /// The protocol revision `initialize` negotiated.
    pub protocol: String,
    /// A session unused this long is gone (it counts for nothing against the caps).
    pub idle: Millis,
    pub caps: relay_core::limits::Caps,
}

// Hand-written so that no hash of a session id reaches a log.
impl std::fmt::Debug for McpSessionNew {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpSessionNew")
            .field("id_hash", &"<redacted>")
            .field("endpoint", &self.endpoint)
            .field("protocol", &self.protocol)
            .field("idle", &self.idle)
            .finish_non_exhaustive()
    }
}

/// What the Board's overview reads, counted by the database (`relay_core::board` folds it).
#[derive(Clone, Debug, PartialEq)]
pub struct BoardOverview {
    /// Todos by queue and state.
    pub groups: Vec<relay_core::board::StateCount>,
    /// Attempts closed since the chart's first minute: (ended_at / MINUTE, outcome, count).
    pub closed: Vec<(u64, String, u64)>,
    /// The newest dead letters.
    pub dead_letters: Vec<Todo>,
    /// Claimed todos, the soonest lease expiry first.
    pub lapsing: Vec<Todo>,
    /// Todos with more than one attempt that died (among the attempts kept), with how many,
    /// the most first.
    pub died_again: Vec<(Todo, u64)>,
}

/// What the out-of-process doorbell scan reads of a todo that is pending: what a ring needs
/// (no title, payload or work order), and the change number it was read at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PendingChange {
    pub id: String,
    pub endpoint: String,
    pub queue: String,
    /// 0 for a fresh todo; more for one that was tried before (a retry).
    pub attempts_total: u32,
    pub change_seq: u64,
}

/// One page of [`Store::pending_since`](super::Store::pending_since).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PendingPage {
    /// Todos pending now whose last change is numbered above the watermark given, oldest
    /// change first.
    pub changes: Vec<PendingChange>,
    /// Where the next call starts: every change at or below it has been seen (committed
    /// changes only; a change still in flight is numbered above it).
    pub watermark: u64,
}
