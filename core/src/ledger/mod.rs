//! The queue ledger: todos, their attempts and fenced leases, as a pure in-memory model.
//!
//! This is the reference for the queue side. The operations are the values of [`Op`], each
//! answered by an [`Answer`]; the lifecycle rules are the pure functions of [`transition`]; and
//! [`run`] applies an `Op` over a backend's [`Rows`] (read, transition, write, answer). [`Ledger`]
//! keeps todos and attempts in ordered maps and offers them as rows, and the SQLite and Postgres
//! stores offer theirs inside a transaction, so every backend runs the very same code. Model-based tests hold the stores to the ledger, the simulator runs the ledger
//! as the queue server, and the fuzz targets call [`Ledger::check`] after every operation.
//!
//! Every operation takes `now` (milliseconds since the epoch). Nothing here draws randomness:
//! todo ids and fence-token hashes come in as values, and the backoff jitter is seeded.

mod attention;
mod backoff;
mod check;
pub mod flow;
mod memory;
mod op;
pub mod rows;
pub mod transition;
mod types;

use serde_json::Value;

pub use attention::{ATTENTION_MAX_BYTES, attention};
pub use backoff::Backoff;
pub use check::{LeaseBreach, check_todo, lease_breach};
pub use flow::{Holds, Limits, LimitsChange, Load, QueueFlow};
pub use memory::Ledger;
pub use op::{Answer, Op};
pub use rows::{Newest, Rows, Sweep, run};
pub use transition::{
    ANSWER_MAX_BYTES, Actor, AttemptWrite, CLI_OPERATOR, Change, ClaimOpts, LedgerConfig,
    OPERATOR_OWNER, Report, answered_by, claim_order, claimable,
};
pub use types::{
    Asking, Attempt, Budget, ClaimerKind, DeadLetterReason, Disposition, LATE_REPORTS_KEPT,
    LATE_SUMMARY_MAX_BYTES, LateReport, Outcome, Question, TASK_SECRET_HEX, TaskId, Todo,
    TodoState, TokenHash, Usage, cost_usd, dead_letter_of, usd,
};

use crate::error::Error;
use crate::time::Millis;

/// The longest lease a claim or heartbeat may ask for, in seconds (a day).
pub const LEASE_TTL_MAX_SECS: u64 = 86_400;
/// The lease a claim gets when it asks for none, in seconds.
pub const LEASE_TTL_DEFAULT_SECS: u64 = 300;
/// How many closed attempts a claim answer carries.
pub const PRIOR_ATTEMPTS: usize = 5;
/// `max_attempts` when a todo is added without one, and its bounds.
pub const MAX_ATTEMPTS_DEFAULT: u32 = 5;
pub const MAX_ATTEMPTS_MAX: u32 = 100;
/// Bounds of what a todo may carry.
pub const TITLE_MAX_BYTES: usize = 1024;
pub const LABEL_MAX_BYTES: usize = 128;
pub const JSON_MAX_BYTES: usize = 64 * 1024;
/// An `idempotency_key` is 1 to this many bytes.
pub const IDEMPOTENCY_KEY_MAX_BYTES: usize = 200;
/// A `failure_signature` is at most this many bytes.
pub const SIGNATURE_MAX_BYTES: usize = 128;
/// The longest `deadline_seconds` an add may ask for (30 days).
pub const DEADLINE_MAX_SECS: u64 = 30 * 86_400;
/// A todo's `priority`: from this to [`PRIORITY_MAX`], default 0; `claim_next` takes a higher
/// priority first and keeps FIFO within one.
pub const PRIORITY_MIN: i32 = -100;
pub const PRIORITY_MAX: i32 = 100;
/// The farthest ahead a todo may be scheduled (`run_at`, `delay_seconds`): a year, in seconds.
pub const RUN_AT_MAX_AHEAD_SECS: u64 = 365 * 86_400;
/// `max_same_failures` when a todo is added without one, and its largest value (0 turns the
/// rule off).
pub const MAX_SAME_FAILURES_DEFAULT: u32 = 2;
pub const MAX_SAME_FAILURES_MAX: u32 = 10;
/// `max_input_requests` when a todo is added without one, and its largest value (0: any
/// question dead-letters the todo).
pub const MAX_INPUT_REQUESTS_DEFAULT: u32 = 3;
pub const MAX_INPUT_REQUESTS_MAX: u32 = 100;
/// The longest `answer_within_seconds` an add may ask for (30 days).
pub const ANSWER_WITHIN_MAX_SECS: u64 = 30 * 86_400;
/// The largest figure a usage or budget may carry (tokens, millionths of a dollar): 2^53, the
/// largest whole number every JSON reader keeps exactly.
pub const USAGE_MAX: u64 = 1 << 53;

/// A todo to add. The id is chosen by the caller (the server draws a random one).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NewTodo {
    pub id: String,
    pub queue: String,
    pub title: String,
    pub kind: Option<String>,
    pub source: Option<String>,
    pub payload: Option<Value>,
    pub work_order: Option<Value>,
    pub max_attempts: Option<u32>,
    pub assignee: Option<String>,
    /// A second add with the same key by the same endpoint answers the first one's todo.
    pub idempotency_key: Option<String>,
    /// The time budget, from the add on: no attempt starts once it has passed.
    pub deadline_seconds: Option<u64>,
    /// See [`Todo::max_same_failures`]; default [`MAX_SAME_FAILURES_DEFAULT`].
    pub max_same_failures: Option<u32>,
    /// Questions its attempts may ask; default [`MAX_INPUT_REQUESTS_DEFAULT`].
    pub max_input_requests: Option<u32>,
    /// How long an answer may take; no limit when absent.
    pub answer_within_seconds: Option<u64>,
    /// The spend limit (none by default).
    pub budget: Budget,
    /// The task id when the todo is made as an MCP task.
    pub task_id: Option<TaskId>,
    /// See [`Todo::priority`]; default 0.
    pub priority: Option<i32>,
    /// Not claimable before this instant (at most a year ahead; an instant past is now).
    pub run_at: Option<Millis>,
    /// Not claimable for this many seconds from the add (instead of `run_at`).
    pub delay_seconds: Option<u64>,
    /// See [`Todo::concurrency_key`].
    pub concurrency_key: Option<String>,
}

/// The answer to a successful claim.
#[derive(Clone, Debug, PartialEq)]
pub struct Claimed {
    pub todo: Todo,
    pub attempt_seq: u32,
    pub attempts_total: u32,
    /// The newest closed attempts (at most [`PRIOR_ATTEMPTS`]), newest first.
    pub prior_attempts: Vec<Attempt>,
    /// The claim took over a lapsed lease (and closed its attempt as `lease_expired`).
    pub takeover: bool,
}

/// A todo with its attempt timeline, as `get_todo` and `relay todo show` present it.
#[derive(Clone, Debug, PartialEq)]
pub struct TodoView {
    pub todo: Todo,
    /// Newest first, the open attempt included, at most the requested limit.
    pub attempts: Vec<Attempt>,
    pub attempts_total: u32,
    pub attempts_pruned: u32,
}

/// What `list_todos` filters on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TodoFilter {
    /// Only todos in these queues (`None`: any queue).
    pub queues: Option<Vec<String>>,
    pub state: Option<TodoState>,
    /// Keyset paging: only todos strictly after this `(created_at, id)` in list order (the last
    /// key of the previous page). `None`: from the first.
    pub after: Option<(Millis, String)>,
    pub limit: usize,
}

impl TodoFilter {
    /// Whether a todo lies past the filter's keyset position (list order is `(created_at, id)`).
    pub fn is_after(&self, t: &Todo) -> bool {
        self.after
            .as_ref()
            .is_none_or(|(at, id)| (t.created_at, t.id.as_str()) > (*at, id.as_str()))
    }
}

/// Validates a new todo and builds its row. One rule for every path that adds todos.
pub fn new_todo(now: Millis, endpoint: &str, new: NewTodo) -> Result<Todo, Error> {
    let bad = |what: String| Error::invalid(format!("add_todo: {what}"));
    if !valid_todo_id(&new.id) {
        return Err(bad("id must be 1 to 64 letters, digits, '_' or '-'".into()));
    }
    if !valid_queue_name(&new.queue) {
        return Err(bad(format!(
            "queue {:?} must start with a letter or digit and hold at most 64 letters, digits, \
             '_', '-' or '.'",
            new.queue
        )));
    }
    if new.title.trim().is_empty() || new.title.len() > TITLE_MAX_BYTES {
        return Err(bad(format!(
            "title must be non-empty and at most {TITLE_MAX_BYTES} bytes"
        )));
    }
    if new.title.chars().any(char::is_control) {
        return Err(bad(
            "title must not contain control characters (newlines, tabs); put detail in payload"
                .into(),
        ));
    }
    for (name, v) in [
        ("kind", &new.kind),
        ("source", &new.source),
        ("assignee", &new.assignee),
    ] {
        if let Some(v) = v
            && (v.is_empty() || v.len() > LABEL_MAX_BYTES || v.chars().any(char::is_control))
        {
            return Err(bad(format!(
                "{name} must be 1 to {LABEL_MAX_BYTES} bytes without control characters"
            )));
        }
    }
    for (name, v) in [("payload", &new.payload), ("work_order", &new.work_order)] {
        if let Some(v) = v {
            check_json_size(name, v).map_err(bad)?;
        }
    }
    let max_attempts = new.max_attempts.unwrap_or(MAX_ATTEMPTS_DEFAULT);
    if !(1..=MAX_ATTEMPTS_MAX).contains(&max_attempts) {
        return Err(bad(format!(
            "max_attempts must be between 1 and {MAX_ATTEMPTS_MAX}; got {max_attempts}"
        )));
    }
    if let Some(k) = &new.idempotency_key {
        check_idempotency_key(k)?;
    }
    let deadline_at = match new.deadline_seconds {
        None => None,
        Some(d) if (1..=DEADLINE_MAX_SECS).contains(&d) => Some(now.saturating_add(d * 1000)),
        Some(d) => {
            return Err(bad(format!(
                "deadline_seconds must be between 1 and {DEADLINE_MAX_SECS} (30 days); got {d}"
            )));
        }
    };
    let max_same_failures = new.max_same_failures.unwrap_or(MAX_SAME_FAILURES_DEFAULT);
    if max_same_failures > MAX_SAME_FAILURES_MAX {
        return Err(bad(format!(
            "max_same_failures must be between 0 (off) and {MAX_SAME_FAILURES_MAX}; got \
             {max_same_failures}"
        )));
    }
    let max_input_requests = new.max_input_requests.unwrap_or(MAX_INPUT_REQUESTS_DEFAULT);
    if max_input_requests > MAX_INPUT_REQUESTS_MAX {
        return Err(bad(format!(
            "max_input_requests must be between 0 (never ask) and {MAX_INPUT_REQUESTS_MAX}; got \
             {max_input_requests}"
        )));
    }
    let answer_within = match new.answer_within_seconds {
        None => None,
        Some(s) if (1..=ANSWER_WITHIN_MAX_SECS).contains(&s) => Some(s * 1000),
        Some(s) => {
            return Err(bad(format!(
                "answer_within_seconds must be between 1 and {ANSWER_WITHIN_MAX_SECS} (30 days); \
                 got {s}"
            )));
        }
    };
    check_budget(&new.budget).map_err(bad)?;
    let priority = new.priority.unwrap_or(0);
    if !(PRIORITY_MIN..=PRIORITY_MAX).contains(&priority) {
        return Err(bad(format!(
            "priority must be between {PRIORITY_MIN} and {PRIORITY_MAX} (higher is claimed \
             first); got {priority}"
        )));
    }
    let horizon = now.saturating_add(RUN_AT_MAX_AHEAD_SECS * 1000);
    let run_at = match (new.run_at, new.delay_seconds) {
        (Some(_), Some(_)) => {
            return Err(bad("give run_at or delay_seconds, not both".to_string()));
        }
        (Some(t), None) if t > horizon => {
            return Err(bad(format!(
                "run_at must be at most a year ahead ({RUN_AT_MAX_AHEAD_SECS} seconds); got {} \
                 seconds ahead",
                (t - now) / 1000
            )));
        }
        (Some(t), None) => Some(t),
        (None, Some(d)) if d > RUN_AT_MAX_AHEAD_SECS => {
            return Err(bad(format!(
                "delay_seconds must be between 0 and {RUN_AT_MAX_AHEAD_SECS} (a year); got {d}"
            )));
        }
        (None, Some(d)) => Some(now.saturating_add(d * 1000)),
        (None, None) => None,
    };
    if let Some(k) = &new.concurrency_key {
        flow::check_key(k).map_err(bad)?;
    }
    if new.task_id.as_ref().is_some_and(|t| t.todo_id() != new.id) {
        return Err(Error::internal(format!(
            "add_todo {}: the task id drawn names another todo",
            new.id
        )));
    }
    Ok(Todo {
        id: new.id,
        endpoint: endpoint.to_string(),
        queue: new.queue,
        title: new.title,
        kind: new.kind,
        source: new.source,
        payload: new.payload,
        work_order: new.work_order,
        assignee: new.assignee,
        state: TodoState::Pending,
        owner: None,
        attempt: 0,
        max_attempts,
        attempts_total: 0,
        attempts_pruned: 0,
        lease_expires_at: None,
        claimed_at: None,
        next_retry_at: None,
        result: None,
        created_at: now,
        updated_at: now,
        dead_letter_reason: None,
        idempotency_key: new.idempotency_key,
        deadline_at,
        max_same_failures,
        asking: Asking {
            max_requests: max_input_requests,
            requests: 0,
            answer_within,
            answer_due_at: None,
        },
        budget: new.budget,
        spent: Usage::default(),
        task_id: new.task_id,
        priority,
        run_at,
        concurrency_key: new.concurrency_key,
    })
}

/// Why a budget is not acceptable: a limit of zero (a limit is above zero; leave it out for
/// none) or past [`USAGE_MAX`].
pub fn check_budget(b: &Budget) -> Result<(), String> {
    for (name, v) in [
        ("budget.cost_usd", b.cost_micros),
        ("budget.tokens", b.tokens),
    ] {
        if v.is_some_and(|v| v == 0 || v > USAGE_MAX) {
            return Err(format!(
                "{name} must be above zero (and at most 2^53); leave it out for no limit"
            ));
        }
    }
    Ok(())
}

/// Validates an `idempotency_key`: 1 to [`IDEMPOTENCY_KEY_MAX_BYTES`] bytes without control
/// characters. Checked before the key is looked up, so a bad one never reaches a store.
pub fn check_idempotency_key(k: &str) -> Result<(), Error> {
    if k.is_empty() || k.len() > IDEMPOTENCY_KEY_MAX_BYTES || k.chars().any(char::is_control) {
        return Err(Error::invalid(format!(
            "add_todo: idempotency_key must be 1 to {IDEMPOTENCY_KEY_MAX_BYTES} bytes without \
             control characters; got {} bytes",
            k.len()
        )));
    }
    Ok(())
}

/// Why a JSON argument (payload, work order, result) is too large to store, naming it: its
/// compact text may be at most [`JSON_MAX_BYTES`].
pub fn check_json_size(name: &str, v: &serde_json::Value) -> Result<(), String> {
    let len = v.to_string().len();
    if len > JSON_MAX_BYTES {
        return Err(format!(
            "{name} is {len} bytes of JSON; at most {JSON_MAX_BYTES} bytes are accepted \
             (store large data elsewhere and pass a reference)"
        ));
    }
    Ok(())
}

/// Todo ids: 1 to 64 ASCII letters, digits, `_` or `-`. Every stored id is one, so a string
/// that is not (a NUL, a control, any non-ASCII character) names no todo: an operation given one
/// answers `not_found` without asking a store, on every store alike.
pub fn valid_todo_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// A queue filter as a store may see it: entries that are not queue names (a NUL, a control,
/// anything [`valid_queue_name`] refuses) match no stored todo and are dropped, so such a
/// filter answers empty on every store alike instead of reaching SQL.
pub fn storable_queue_filter(queues: &[String]) -> Vec<String> {
    queues
        .iter()
        .filter(|q| valid_queue_name(q))
        .cloned()
        .collect()
}

/// Queue names: a letter or digit, then up to 63 letters, digits, `_`, `-` or `.`.
pub fn valid_queue_name(q: &str) -> bool {
    let b = q.as_bytes();
    !b.is_empty()
        && b.len() <= 64
        && b[0].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'-' | b'.'))
}

/// Done, canceled, or a dead letter: nothing will happen to it unless an operator acts.
pub fn finished(t: &Todo) -> bool {
    matches!(t.state, TodoState::Done | TodoState::Canceled) || t.dead_letter()
}

/// Retention: finished and untouched for `retention` at `now`, so `purge_finished` deletes it.
pub fn purgeable(t: &Todo, now: Millis, retention: Millis) -> bool {
    finished(t) && t.updated_at.saturating_add(retention) <= now
}

#[cfg(test)]
mod tests;
