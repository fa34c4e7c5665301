//! The rows of the ledger: todos and their attempts, and the values that describe them.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::time::Millis;

crate::names! {
    /// Where a todo is in its life.
    #[derive(
        Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema,
    )]
    #[serde(rename_all = "snake_case")]
    pub enum TodoState {
        /// Waiting to be claimed.
        Pending => "pending",
        /// Held under a lease by one attempt.
        Claimed => "claimed",
        /// The last attempt failed: a retry is scheduled (`next_retry_at`) or it is a dead letter.
        Failed => "failed",
        /// Completed. Terminal until an operator retries it.
        Done => "done",
        /// Canceled by an operator. Terminal until an operator retries it.
        Canceled => "canceled",
        /// The last attempt asked a question (`request_input`): no lease, not claimable, waiting
        /// for an answer, which makes it pending again.
        InputRequired => "input_required",
    }
}

crate::names! {
    /// How an attempt ended.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
    #[serde(rename_all = "snake_case")]
    pub enum Outcome {
        Completed => "completed",
        Failed => "failed",
        Released => "released",
        /// The lease lapsed and another claimer took the todo over.
        LeaseExpired => "lease_expired",
        /// The lease lapsed and the reaper closed it.
        Reaped => "reaped",
        Canceled => "canceled",
        Revoked => "revoked",
        /// The attempt asked a question and stopped (`request_input`).
        NeedsInput => "needs_input",
    }
}

crate::names! {
    /// What the end of an attempt did to its todo.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
    #[serde(rename_all = "snake_case")]
    pub enum Disposition {
        Done => "done",
        RetryScheduled => "retry_scheduled",
        Requeued => "requeued",
        DeadLettered => "dead_lettered",
        Canceled => "canceled",
        /// The todo waits for an answer to the attempt's question.
        AwaitingInput => "awaiting_input",
    }
}

crate::names! {
    /// Who opened an attempt: an endpoint (over MCP) or the owning operator (the CLI).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
    #[serde(rename_all = "snake_case")]
    pub enum ClaimerKind {
        Endpoint => "endpoint",
        Owner => "owner",
    }
}

crate::names! {
    /// Why a todo is a dead letter: which budget ran out, or who stopped it. Every dead letter has
    /// exactly one; a todo that is not a dead letter has none.
    #[derive(
        Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema,
    )]
    #[serde(rename_all = "snake_case")]
    pub enum DeadLetterReason {
        /// `max_attempts` attempts were counted.
        AttemptsExhausted => "attempts_exhausted",
        /// The last report said the failure is not worth retrying (`retryable: false`).
        NonRetryable => "non_retryable",
        /// The todo's `deadline_seconds` passed.
        Deadline => "deadline",
        /// The newest `max_same_failures` failed attempts reported the same `failure_signature`.
        RepeatedFailure => "repeated_failure",
        /// The owning endpoint was revoked while the todo was claimed.
        Revoked => "revoked",
        /// An attempt asked a question when `max_input_requests` had already been asked.
        InputRequestsExhausted => "input_requests_exhausted",
        /// The question was not answered within `answer_within_seconds`.
        NoAnswer => "no_answer",
        /// What the attempts spent reached the todo's `budget`.
        BudgetExhausted => "budget_exhausted",
    }
}

/// What an attempt spent (its own, reported by its holder), or what a todo's attempts spent in
/// all. Cost is kept in millionths of a US dollar, so that sums are exact; the wire speaks
/// `cost_usd` as a number and rounds to that resolution.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Usage {
    pub cost_micros: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
}

impl Usage {
    /// Input and output tokens together: what a `tokens` budget counts.
    pub fn tokens(&self) -> u64 {
        self.input_tokens.saturating_add(self.output_tokens)
    }

    /// Each figure the larger of the two: a later report never lowers an earlier one.
    pub fn max(self, other: Usage) -> Usage {
        Usage {
            cost_micros: self.cost_micros.max(other.cost_micros),
            input_tokens: self.input_tokens.max(other.input_tokens),
            output_tokens: self.output_tokens.max(other.output_tokens),
        }
    }

    /// The sum, figure by figure (saturating).
    pub fn plus(self, other: Usage) -> Usage {
        Usage {
            cost_micros: self.cost_micros.saturating_add(other.cost_micros),
            input_tokens: self.input_tokens.saturating_add(other.input_tokens),
            output_tokens: self.output_tokens.saturating_add(other.output_tokens),
        }
    }

    /// How much `self` grew past `before`, figure by figure (none where it did not).
    pub fn since(self, before: Usage) -> Usage {
        Usage {
            cost_micros: self.cost_micros.saturating_sub(before.cost_micros),
            input_tokens: self.input_tokens.saturating_sub(before.input_tokens),
            output_tokens: self.output_tokens.saturating_sub(before.output_tokens),
        }
    }

    /// Every figure is zero.
    pub fn is_zero(&self) -> bool {
        *self == Usage::default()
    }

    /// `$0.42, 1200 tokens (1000 in, 200 out)`, for people.
    pub fn describe(&self) -> String {
        format!(
            "{}, {} tokens ({} in, {} out)",
            usd(self.cost_micros),
            self.tokens(),
            self.input_tokens,
            self.output_tokens
        )
    }
}

/// Millionths of a dollar as dollars, for the wire.
pub fn cost_usd(micros: u64) -> f64 {
    micros as f64 / 1e6
}

/// `$1.5`, `$0.000001`: dollars without trailing zeros, for people.
pub fn usd(micros: u64) -> String {
    let cents = format!("{}.{:06}", micros / 1_000_000, micros % 1_000_000);
    format!("${}", cents.trim_end_matches('0').trim_end_matches('.'))
}

/// A todo's spend limit: a cost, a token count (input and output together), or both; `None`
/// is no limit. A limit, when set, is above zero.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Budget {
    pub cost_micros: Option<u64>,
    pub tokens: Option<u64>,
}

impl Budget {
    /// `spent` has reached a limit.
    pub fn exhausted_by(&self, spent: &Usage) -> bool {
        self.cost_micros.is_some_and(|c| spent.cost_micros >= c)
            || self.tokens.is_some_and(|t| spent.tokens() >= t)
    }

    pub fn is_none(&self) -> bool {
        self.cost_micros.is_none() && self.tokens.is_none()
    }

    /// `$5 or 100000 tokens`, `no limit`, for people.
    pub fn describe(&self) -> String {
        match (self.cost_micros, self.tokens) {
            (Some(c), Some(t)) => format!("{} or {t} tokens", usd(c)),
            (Some(c), None) => usd(c),
            (None, Some(t)) => format!("{t} tokens"),
            (None, None) => "no limit".into(),
        }
    }
}

/// How a todo may ask for a human: how many questions its attempts may ask, how long an answer
/// may take, and while it waits, until when.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Asking {
    /// Questions allowed; the next one past it dead-letters (`input_requests_exhausted`).
    pub max_requests: u32,
    /// Questions asked since the add (or the last manual retry).
    pub requests: u32,
    /// How long an answer may take, from the question; `None`: no limit.
    pub answer_within: Option<Millis>,
    /// Set exactly while the todo is `input_required` with `answer_within`: past it the todo
    /// dead-letters (`no_answer`).
    pub answer_due_at: Option<Millis>,
}

/// The question an attempt ended with, and its answer once given. The answer is kept on the
/// attempt that asked; it is written once.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Question {
    /// Cut to [`crate::bounds::SUMMARY_MAX_BYTES`] like a summary.
    pub text: String,
    pub answer: Option<String>,
    pub answered_at: Option<Millis>,
    /// Who answered: `endpoint:<name>` (by `answer_todo`, or as a task's client by
    /// `tasks/update`), or `operator:<name>` (`operator:cli` from the command line).
    pub answered_by: Option<String>,
    /// The answering call's idempotency key: a repeat with it answers as the first did.
    pub answer_key: Option<String>,
}

impl Outcome {
    /// An attempt died when its lease lapsed; every other outcome was reported or decided.
    pub fn died(self) -> bool {
        matches!(self, Outcome::LeaseExpired | Outcome::Reaped)
    }
}

/// The SHA-256 of a lease token. The token itself never reaches the ledger or a store.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TokenHash(pub [u8; 32]);

impl TokenHash {
    /// The hash of a token as the caller presented it.
    pub fn of(token: &str) -> TokenHash {
        use sha2::Digest;
        TokenHash(sha2::Sha256::digest(token.as_bytes()).into())
    }
}

impl std::fmt::Debug for TokenHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TokenHash({:02x}{:02x}…)", self.0[0], self.0[1])
    }
}

/// An MCP task's id (the Tasks extension): `<todo id>.<secret>`, the secret 160 bits from the
/// server's RNG. It is a handle, not a credential: every task method must also come from the
/// endpoint that made the todo. The store keeps it (the owner's `get_todo` answers it); its
/// `Debug` shows only the todo id, and no log line, page or error carries it.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TaskId(String);

impl std::fmt::Debug for TaskId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TaskId({}.<redacted>)", self.todo_id())
    }
}

/// Hex digits in a task id's secret (160 bits).
pub const TASK_SECRET_HEX: usize = 40;

impl TaskId {
    /// The task id of todo `todo_id` with `secret` (lower-case hex, [`TASK_SECRET_HEX`] digits).
    pub fn new(todo_id: &str, secret: &str) -> TaskId {
        TaskId(format!("{todo_id}.{secret}"))
    }

    /// A presented id, if it has a task id's shape (the todo id, a dot, the secret).
    pub fn parse(presented: &str) -> Option<TaskId> {
        let (todo, secret) = presented.rsplit_once('.')?;
        let shaped = !todo.is_empty()
            && todo.len() <= 128
            && !todo.chars().any(char::is_control)
            && secret.len() == TASK_SECRET_HEX
            && secret
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        shaped.then(|| TaskId(presented.to_string()))
    }

    /// The todo the task is.
    pub fn todo_id(&self) -> &str {
        self.0.rsplit_once('.').map_or("", |(t, _)| t)
    }

    /// The id's text, for the wire and the store only.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Whether `other` is this id, in time that does not depend on where they differ.
    pub fn same(&self, other: &TaskId) -> bool {
        let (a, b) = (self.0.as_bytes(), other.0.as_bytes());
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
    }
}

/// One todo: the unit of work, preserved across every attempt at it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Todo {
    pub id: String,
    /// The endpoint that owns the todo; every endpoint operation is scoped to it.
    pub endpoint: String,
    pub queue: String,
    pub title: String,
    pub kind: Option<String>,
    pub source: Option<String>,
    pub payload: Option<Value>,
    pub work_order: Option<Value>,
    /// When set, only a claimer whose owner identity equals it may claim.
    pub assignee: Option<String>,
    pub state: TodoState,
    /// The identity holding the lease while claimed (the endpoint name, or `operator`).
    pub owner: Option<String>,
    /// Attempts counted toward `max_attempts` since the last manual retry.
    pub attempt: u32,
    pub max_attempts: u32,
    /// Attempts ever opened; never reset. The newest attempt's seq.
    pub attempts_total: u32,
    /// Closed attempts deleted by the per-todo cap; the oldest kept seq is `attempts_pruned + 1`.
    pub attempts_pruned: u32,
    pub lease_expires_at: Option<Millis>,
    pub claimed_at: Option<Millis>,
    pub next_retry_at: Option<Millis>,
    /// The last report's result object; cleared by a manual retry.
    pub result: Option<Value>,
    pub created_at: Millis,
    pub updated_at: Millis,
    /// Set exactly while the todo is a dead letter.
    pub dead_letter_reason: Option<DeadLetterReason>,
    /// The caller's key for the add that made the todo: unique per endpoint while the todo
    /// lives, so a repeated add answers this todo instead of making another.
    pub idempotency_key: Option<String>,
    /// No attempt starts at or after this instant; the todo becomes a dead letter instead. A
    /// manual retry lifts it (the operator's decision replaces the budget).
    pub deadline_at: Option<Millis>,
    /// Dead-letter when this many newest failed attempts report the same signature (0: never).
    pub max_same_failures: u32,
    /// Questions to a human: how many, how long an answer may take.
    pub asking: Asking,
    /// The spend limit; a heartbeat or report that reaches it stops the attempt.
    pub budget: Budget,
    /// What every attempt spent, summed (pruned attempts included).
    pub spent: Usage,
    /// Set when the todo was made as an MCP task (the Tasks extension); never changes.
    #[serde(default)]
    pub task_id: Option<TaskId>,
    /// `claim_next` takes a higher priority first (FIFO within one); fixed at the add.
    #[serde(default)]
    pub priority: i32,
    /// Todos with one key in one queue share its `max_claimed_per_key`; fixed at the add.
    #[serde(default)]
    pub concurrency_key: Option<String>,
    /// A pending todo is not claimable before this instant. Set at the add; the retry sweep
    /// clears it once it has come (and so rings the doorbell for the todo).
    #[serde(default)]
    pub run_at: Option<Millis>,
}

/// The dead-letter rule on a todo's state and whether a retry is scheduled, for callers that
/// only count rows (the Board's overview): failed with no retry scheduled.
pub fn dead_letter_of(state: TodoState, retry_scheduled: bool) -> bool {
    state == TodoState::Failed && !retry_scheduled
}

impl Todo {
    /// Failed with no retry scheduled (`dead_letter_reason` says why). Derived, so it cannot
    /// disagree with the state.
    pub fn dead_letter(&self) -> bool {
        dead_letter_of(self.state, self.next_retry_at.is_some())
    }

    /// The lease is held and has not lapsed at `now`. A lease is valid strictly before its
    /// expiry instant and lapsed from it on.
    pub fn lease_valid_at(&self, now: Millis) -> bool {
        self.state == TodoState::Claimed && self.lease_expires_at.is_some_and(|t| now < t)
    }

    /// While pending and delayed at `now`: the instant it waits for (see
    /// [`claimable`](super::claimable)).
    pub fn waits_until(&self, now: Millis) -> Option<Millis> {
        self.run_at
            .filter(|&t| self.state == TodoState::Pending && t > now)
    }

    /// The deadline has passed at `now`: no attempt may start.
    pub fn past_deadline(&self, now: Millis) -> bool {
        self.deadline_at.is_some_and(|d| d <= now)
    }

    /// What the attempts spent has reached the budget: no attempt may start.
    pub fn over_budget(&self) -> bool {
        self.budget.exhausted_by(&self.spent)
    }
}

/// A report that arrived for an attempt already closed (its lease lapsed or was taken over):
/// refused, and kept on that attempt as evidence that the old holder did finish.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LateReport {
    pub at: Millis,
    /// What the late report claimed: `completed`, `failed` or `released`.
    pub outcome: Outcome,
    /// Its summary, cut to [`LATE_SUMMARY_MAX_BYTES`].
    pub summary: Option<String>,
}

/// Late reports kept per attempt (further ones are only counted).
pub const LATE_REPORTS_KEPT: usize = 3;
/// A late report's summary is cut to this many bytes.
pub const LATE_SUMMARY_MAX_BYTES: usize = 256;

/// One claim of a todo: opened by the claim, closed exactly once by whatever ended the lease.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Attempt {
    pub todo_id: String,
    /// The todo's `attempts_total` right after this claim: 1, 2, 3 … never reused.
    pub seq: u32,
    /// The todo's `attempt` right after this claim (resets with a manual retry).
    pub attempt: u32,
    pub claimer_kind: ClaimerKind,
    pub claimer_endpoint: Option<String>,
    /// The MCP session the claim came over, when it came over MCP.
    pub claimer_session: Option<String>,
    pub owner: String,
    pub claimant: Option<String>,
    pub claimed_at: Millis,
    pub last_heartbeat_at: Option<Millis>,
    pub lease_expires_at: Millis,
    pub ended_at: Option<Millis>,
    pub outcome: Option<Outcome>,
    pub disposition: Option<Disposition>,
    pub summary: Option<String>,
    pub summary_truncated: bool,
    pub artifact: Option<String>,
    /// The signature a failed report gave its failure (at most 128 bytes).
    pub failure_signature: Option<String>,
    /// Why the close made the todo a dead letter (set exactly when `disposition` is
    /// `dead_lettered`).
    pub dead_letter_reason: Option<DeadLetterReason>,
    /// Reports refused as late, the first [`LATE_REPORTS_KEPT`] of them.
    pub late_reports: Vec<LateReport>,
    /// Every late report, kept or not.
    pub late_reports_total: u32,
    #[serde(skip)]
    pub lease_token_hash: Option<TokenHash>,
    /// The operator who closed it (a Board operator's name, or `cli`); `None` when the
    /// endpoint's own report, a takeover, the reaper or a revocation closed it.
    #[serde(default)]
    pub closed_by: Option<String>,
    /// The question the attempt ended with (`needs_input`), and its answer once given.
    #[serde(default)]
    pub question: Option<Question>,
    /// What the attempt spent, as its holder last reported it.
    #[serde(default)]
    pub usage: Usage,
}

impl Attempt {
    pub fn is_open(&self) -> bool {
        self.ended_at.is_none()
    }
    /// True exactly when the lease lapsed (`lease_expired` or `reaped`).
    pub fn died(&self) -> bool {
        self.outcome.is_some_and(Outcome::died)
    }
}
