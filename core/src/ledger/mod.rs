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
pub mod flow;
mod op;
pub mod rows;
pub mod transition;
mod types;

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

pub use attention::{ATTENTION_MAX_BYTES, attention};
pub use backoff::Backoff;
pub use flow::{Holds, Limits, LimitsChange, Load, QueueFlow};
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

#[derive(Clone, Debug, PartialEq)]
struct Entry {
    todo: Todo,
    attempts: BTreeMap<u32, Attempt>,
}

impl Entry {
    fn open(&self) -> Option<&Attempt> {
        self.attempts.values().next_back().filter(|a| a.is_open())
    }
}

/// The in-memory ledger. See the module doc.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Ledger {
    cfg: LedgerConfig,
    todos: BTreeMap<String, Entry>,
    /// FIFO order for `claim_next`: (created_at, id).
    order: BTreeSet<(Millis, String)>,
    /// Paused queues, and since when.
    paused: BTreeMap<String, Millis>,
    /// Queues with limits.
    limits: BTreeMap<String, Limits>,
    /// By queue with a rate limit, its claims within the window.
    claims: BTreeMap<String, Vec<Millis>>,
}

impl Ledger {
    pub fn new(cfg: LedgerConfig) -> Ledger {
        Ledger {
            cfg,
            ..Ledger::default()
        }
    }

    pub fn config(&self) -> &LedgerConfig {
        &self.cfg
    }

    /// Applies one operation (see [`run`]). The in-memory ledger has no transaction to roll
    /// back, but it needs none: every check precedes the writes, and a write that would break
    /// the attempt rows is refused with nothing applied (see [`Ledger::apply_change`]).
    pub fn apply(&mut self, op: Op) -> Result<Answer, Error> {
        let cfg = self.cfg.clone();
        rows::ready(run(&mut Mem(self), &cfg, op))
    }

    /// Applies a transition's change, as a store applies one inside its transaction.
    /// All-or-nothing: the writes are checked first, so a change that would break the attempt
    /// rows (a second open attempt, closing a closed one) is refused as an internal error with
    /// nothing applied. The simulator's canaries call it directly to plant such bugs.
    pub fn apply_change(&mut self, change: Change) -> Result<Todo, Error> {
        self.write_rows(&change.todo, &change.writes)?;
        Ok(change.todo)
    }

    /// [`Ledger::apply_change`] on borrowed rows, as [`Rows::write`] hands them over: each row is
    /// copied once, into the map.
    fn write_rows(&mut self, todo: &Todo, writes: &[AttemptWrite]) -> Result<(), Error> {
        let id = &todo.id;
        let entry = self
            .todos
            .get(id)
            .ok_or_else(|| Error::internal(format!("apply {id}: the todo vanished")))?;
        for w in writes {
            match w {
                AttemptWrite::Open(a) if entry.attempts.contains_key(&a.seq) => {
                    return Err(Error::internal(format!(
                        "apply {id}: attempt {} already exists",
                        a.seq
                    )));
                }
                AttemptWrite::Update(a)
                    if !entry.attempts.get(&a.seq).is_some_and(Attempt::is_open) =>
                {
                    return Err(Error::internal(format!(
                        "apply {id}: attempt {} is not open; an attempt closes exactly once",
                        a.seq
                    )));
                }
                AttemptWrite::Amend(a)
                    if entry.attempts.get(&a.seq).is_none_or(Attempt::is_open) =>
                {
                    return Err(Error::internal(format!(
                        "apply {id}: attempt {} is not closed; only a closed attempt is amended",
                        a.seq
                    )));
                }
                _ => {}
            }
        }
        let entry = self.todos.get_mut(id).expect("checked above");
        for w in writes {
            match w {
                AttemptWrite::Open(a) | AttemptWrite::Update(a) => {
                    entry.attempts.insert(a.seq, a.clone());
                }
                // Only the late reports and the answer: the rest of a closed attempt is
                // immutable.
                AttemptWrite::Amend(a) => {
                    if let Some(kept) = entry.attempts.get_mut(&a.seq) {
                        kept.late_reports.clone_from(&a.late_reports);
                        kept.late_reports_total = a.late_reports_total;
                        if let (Some(k), Some(q)) = (kept.question.as_mut(), a.question.as_ref()) {
                            k.answer.clone_from(&q.answer);
                            k.answered_at = q.answered_at;
                            k.answered_by.clone_from(&q.answered_by);
                            k.answer_key.clone_from(&q.answer_key);
                        }
                    }
                }
                AttemptWrite::PruneThrough(n) => {
                    entry.attempts.retain(|seq, a| seq > n || a.is_open());
                }
            }
        }
        entry.todo.clone_from(todo);
        Ok(())
    }

    /// One todo by id, unscoped (for checkers and tests).
    pub fn todo(&self, id: &str) -> Option<&Todo> {
        self.todos.get(id).map(|e| &e.todo)
    }

    /// Every todo, in FIFO order (for checkers and tests).
    pub fn todos(&self) -> impl Iterator<Item = &Todo> {
        self.order.iter().map(|(_, id)| &self.todos[id].todo)
    }

    /// Every attempt of a todo, oldest first (for checkers and tests).
    pub fn attempts(&self, id: &str) -> impl Iterator<Item = &Attempt> + Clone {
        self.todos
            .get(id)
            .into_iter()
            .flat_map(|e| e.attempts.values())
    }

    /// Checks every invariant of the ledger; the first broken one is described in the error.
    pub fn check(&self) -> Result<(), String> {
        if self.order.len() != self.todos.len() {
            return Err("the FIFO index and the todo map disagree".into());
        }
        for (id, entry) in &self.todos {
            if !self.order.contains(&(entry.todo.created_at, id.clone())) {
                return Err(format!("todo {id} is missing from the FIFO index"));
            }
            check_todo(&entry.todo, entry.attempts.values())
                .map_err(|e| format!("todo {id}: {e}"))?;
        }
        Ok(())
    }
}

/// The ledger as the rows of one transaction (see [`run`]).
struct Mem<'a>(&'a mut Ledger);

impl Mem<'_> {
    fn loaded(&self, id: &str) -> Option<(Todo, Option<Attempt>)> {
        self.0
            .todos
            .get(id)
            .map(|e| (e.todo.clone(), e.open().cloned()))
    }
}

impl Rows for Mem<'_> {
    async fn load(
        &mut self,
        _op: &str,
        id: &str,
    ) -> Result<Option<(Todo, Option<Attempt>)>, Error> {
        Ok(self.loaded(id))
    }

    async fn next_claimable(
        &mut self,
        now: Millis,
        actor: &Actor,
        queues: Option<&[String]>,
        holds: &Holds,
    ) -> Result<Option<(Todo, Option<Attempt>)>, Error> {
        let next = self
            .0
            .todos()
            .filter(|t| claimable(now, t, actor, queues) && !holds.holds(t))
            .min_by(|a, b| claim_order(a).cmp(&claim_order(b)))
            .map(|t| t.id.clone());
        Ok(next.and_then(|id| self.loaded(&id)))
    }

    async fn by_key(&mut self, endpoint: &str, key: &str) -> Result<Option<Todo>, Error> {
        Ok(self
            .0
            .todos
            .values()
            .map(|e| &e.todo)
            .find(|t| t.endpoint == endpoint && t.idempotency_key.as_deref() == Some(key))
            .cloned())
    }

    async fn insert_todo(&mut self, t: &Todo) -> Result<bool, Error> {
        let l = &mut *self.0;
        let key_taken = |l: &Ledger| {
            t.idempotency_key.as_deref().is_some_and(|k| {
                l.todos.values().any(|e| {
                    e.todo.endpoint == t.endpoint && e.todo.idempotency_key.as_deref() == Some(k)
                })
            })
        };
        // As the stores' unique indexes refuse either: the id, or the endpoint's key.
        if l.todos.contains_key(&t.id) || key_taken(l) {
            return Ok(false);
        }
        l.order.insert((t.created_at, t.id.clone()));
        l.todos.insert(
            t.id.clone(),
            Entry {
                todo: t.clone(),
                attempts: BTreeMap::new(),
            },
        );
        Ok(true)
    }

    async fn write(
        &mut self,
        _op: &str,
        todo: &Todo,
        writes: &[AttemptWrite],
    ) -> Result<Vec<u64>, Error> {
        // write_rows refuses a write that touches no open row, so each touched one.
        self.0.write_rows(todo, writes)?;
        Ok(vec![1; writes.len()])
    }

    async fn attempts(
        &mut self,
        _op: &str,
        id: &str,
        which: Newest,
    ) -> Result<Vec<Attempt>, Error> {
        let all = self.0.todos.get(id).map(|e| &e.attempts);
        Ok(all
            .into_iter()
            .flat_map(|a| a.values().rev())
            .filter(|a| !which.closed_only || !a.is_open())
            .take(which.limit)
            .cloned()
            .collect())
    }

    async fn candidates(&mut self, sweep: Sweep<'_>) -> Result<Vec<String>, Error> {
        // Not SQL's narrower filters: a todo in one of the sweep's states is a candidate when
        // the sweep's own transition (`Sweep::change`) acts on it, or refuses it (the error then
        // surfaces when `run` transits it). So the transitions decide every time and owner
        // test, the model tests hold SQL's filters to them, and a sweep loads (clones) only the
        // todos it changes.
        let state = |t: &Todo| match sweep {
            Sweep::Reap { .. } | Sweep::Revoke { .. } => t.state == TodoState::Claimed,
            // Failed todos whose retry is due, pending, failed or waiting ones past a deadline,
            // waiting ones past their answer's due time.
            Sweep::RequeueDue { .. } => matches!(
                t.state,
                TodoState::Failed | TodoState::Pending | TodoState::InputRequired
            ),
            Sweep::Purge { .. } => !matches!(
                t.state,
                TodoState::Pending | TodoState::Claimed | TodoState::InputRequired
            ),
        };
        let acts = |e: &Entry| match sweep {
            Sweep::Purge { .. } => true,
            _ => !matches!(sweep.change(&e.todo, e.open()), Ok(None)),
        };
        Ok(self
            .0
            .todos
            .iter()
            .filter(|(_, e)| state(&e.todo) && acts(e))
            .map(|(id, _)| id.clone())
            .collect())
    }

    async fn list(&mut self, actor: &Actor, filter: &TodoFilter) -> Result<Vec<Todo>, Error> {
        Ok(self
            .0
            .todos()
            .filter(|t| actor.sees(t))
            .filter(|t| {
                filter
                    .queues
                    .as_ref()
                    .is_none_or(|qs| qs.iter().any(|q| q == &t.queue))
            })
            .filter(|t| filter.state.is_none_or(|s| s == t.state))
            .filter(|t| filter.is_after(t))
            .take(filter.limit)
            .cloned()
            .collect())
    }

    async fn delete(&mut self, _op: &str, id: &str) -> Result<(), Error> {
        let l = &mut *self.0;
        if let Some(e) = l.todos.remove(id) {
            l.order.remove(&(e.todo.created_at, e.todo.id));
        }
        Ok(())
    }

    async fn paused_queues(&mut self) -> Result<Vec<String>, Error> {
        Ok(self.0.paused.keys().cloned().collect())
    }

    async fn set_paused(&mut self, now: Millis, queue: &str, paused: bool) -> Result<(), Error> {
        if paused {
            self.0.paused.entry(queue.to_string()).or_insert(now);
        } else {
            self.0.paused.remove(queue);
        }
        Ok(())
    }

    async fn queue_limits(&mut self) -> Result<Vec<(String, Limits)>, Error> {
        Ok(self.0.limits.iter().map(|(q, l)| (q.clone(), *l)).collect())
    }

    async fn set_queue_limits(&mut self, _: Millis, queue: &str, l: Limits) -> Result<(), Error> {
        if l.is_empty() {
            self.0.limits.remove(queue);
            self.0.claims.remove(queue);
        } else {
            self.0.limits.insert(queue.to_string(), l);
        }
        Ok(())
    }

    async fn flow_load(&mut self, now: Millis, _lock: bool) -> Result<Load, Error> {
        let mut load = Load::default();
        for t in self.0.todos() {
            if t.state == TodoState::Claimed && self.0.limits.contains_key(&t.queue) {
                let k = (t.queue.clone(), t.concurrency_key.clone());
                *load.claimed.entry(k).or_default() += 1;
            }
        }
        for (q, at) in &self.0.claims {
            let n = at
                .iter()
                .filter(|&&t| t > now.saturating_sub(flow::WINDOW))
                .count();
            if n > 0 {
                load.recent
                    .insert(q.clone(), u32::try_from(n).unwrap_or(u32::MAX));
            }
        }
        Ok(load)
    }

    async fn note_claim(&mut self, now: Millis, queue: &str) -> Result<(), Error> {
        let at = self.0.claims.entry(queue.to_string()).or_default();
        at.retain(|&t| t > now.saturating_sub(flow::WINDOW));
        at.push(now);
        Ok(())
    }
}

/// Done, canceled, or a dead letter: nothing will happen to it unless an operator acts.
pub fn finished(t: &Todo) -> bool {
    matches!(t.state, TodoState::Done | TodoState::Canceled) || t.dead_letter()
}

/// Retention: finished and untouched for `retention` at `now`, so `purge_finished` deletes it.
pub fn purgeable(t: &Todo, now: Millis, retention: Millis) -> bool {
    finished(t) && t.updated_at.saturating_add(retention) <= now
}

/// The invariants of waiting for a human and of spend: a todo waits only while its newest
/// attempt holds an unanswered question; an answer goes only on a question, whole (with when
/// and by whom), after the attempt closed; no more questions than allowed; `spent` covers every
/// kept attempt's usage; a todo that could be claimed (pending, claimed) is under its budget.
fn check_asking<'a>(
    t: &Todo,
    attempts: impl Iterator<Item = &'a Attempt> + Clone,
) -> Result<(), String> {
    let waiting = t.state == TodoState::InputRequired;
    let newest = attempts.clone().last();
    let open_question = newest.is_some_and(|a| {
        a.disposition == Some(Disposition::AwaitingInput)
            && a.question.as_ref().is_some_and(|q| q.answer.is_none())
    });
    // The converse does not hold: a waiting todo canceled, dead-lettered by a sweep, or
    // retried from there, leaves its question unanswered.
    if waiting && !open_question {
        return Err("input_required, but the newest attempt holds no unanswered question".into());
    }
    if t.asking.answer_due_at.is_some() && !waiting {
        return Err(format!("state {} with answer_due_at set", t.state));
    }
    if t.asking.requests > t.asking.max_requests || t.asking.max_requests > MAX_INPUT_REQUESTS_MAX {
        return Err(format!(
            "{} questions asked of {} allowed",
            t.asking.requests, t.asking.max_requests
        ));
    }
    if matches!(t.state, TodoState::Pending | TodoState::Claimed) && t.over_budget() {
        return Err(format!(
            "state {} with spend {:?} at its budget {:?}; it could be claimed again",
            t.state, t.spent, t.budget
        ));
    }
    let mut kept = Usage::default();
    for a in attempts {
        kept = kept.plus(a.usage);
        let needs_input = a.outcome == Some(Outcome::NeedsInput);
        if needs_input != a.question.is_some() {
            return Err(format!(
                "attempt {}: outcome {:?} with question {}",
                a.seq,
                a.outcome,
                if a.question.is_some() { "set" } else { "unset" }
            ));
        }
        if let Some(q) = &a.question {
            let whole = q.answer.is_some() == q.answered_at.is_some()
                && q.answer.is_some() == q.answered_by.is_some()
                && (q.answer.is_some() || q.answer_key.is_none());
            if !whole
                || q.text.len() > crate::bounds::SUMMARY_MAX_BYTES
                || q.answer
                    .as_ref()
                    .is_some_and(|x| x.len() > ANSWER_MAX_BYTES)
                || q.answered_at
                    .is_some_and(|at| a.ended_at.is_none_or(|e| at < e))
                || (q.answer.is_some() && a.disposition != Some(Disposition::AwaitingInput))
            {
                return Err(format!(
                    "attempt {}: question or answer out of bounds, partial, or on an attempt \
                     that was not awaiting it",
                    a.seq
                ));
            }
        }
    }
    if kept.max(t.spent) != t.spent {
        return Err(format!(
            "spent {:?} is less than its attempts' usage {kept:?}",
            t.spent
        ));
    }
    Ok(())
}

/// The invariants of one todo and its attempts (oldest first). Shared by [`Ledger::check`] and
/// the stores' tests, which read rows back from SQL and hold them to the same rules.
pub fn check_todo<'a, I>(t: &Todo, attempts: I) -> Result<(), String>
where
    I: IntoIterator<Item = &'a Attempt>,
    I::IntoIter: Clone,
{
    let attempts = attempts.into_iter();
    let open: Vec<&Attempt> = attempts.clone().filter(|a| a.is_open()).collect();
    if open.len() > 1 {
        return Err(format!(
            "{} open attempts; at most one may be open",
            open.len()
        ));
    }
    let claimed = t.state == TodoState::Claimed;
    if claimed != (open.len() == 1) {
        return Err(format!(
            "state {} with {} open attempts; a todo is claimed exactly when one is open",
            t.state,
            open.len()
        ));
    }
    if !(PRIORITY_MIN..=PRIORITY_MAX).contains(&t.priority) {
        return Err(format!("priority {} is out of range", t.priority));
    }
    if claimed != (t.owner.is_some() && t.lease_expires_at.is_some()) {
        return Err(format!(
            "state {} but owner {:?} and lease {:?}",
            t.state, t.owner, t.lease_expires_at
        ));
    }
    if let Some(o) = open.first() {
        if o.seq != t.attempts_total {
            return Err(format!(
                "the open attempt is {} but attempts_total is {}",
                o.seq, t.attempts_total
            ));
        }
        if Some(o.lease_expires_at) != t.lease_expires_at || Some(&o.owner) != t.owner.as_ref() {
            return Err("the open attempt's lease or owner differs from the todo's".into());
        }
    }
    if !attempts
        .clone()
        .map(|a| a.seq)
        .eq(t.attempts_pruned + 1..=t.attempts_total)
    {
        let seqs: Vec<u32> = attempts.clone().map(|a| a.seq).collect();
        return Err(format!(
            "attempt seqs {seqs:?} are not {}..={} (pruned {}, total {})",
            t.attempts_pruned + 1,
            t.attempts_total,
            t.attempts_pruned,
            t.attempts_total
        ));
    }
    if t.attempt > t.attempts_total || t.attempt > t.max_attempts {
        return Err(format!(
            "attempt {} exceeds attempts_total {} or max_attempts {}",
            t.attempt, t.attempts_total, t.max_attempts
        ));
    }
    match t.state {
        TodoState::Pending if t.attempt >= t.max_attempts => {
            return Err(format!(
                "pending with attempt {} of {}: nothing could claim it",
                t.attempt, t.max_attempts
            ));
        }
        TodoState::Failed if t.next_retry_at.is_some() && t.attempt >= t.max_attempts => {
            return Err("a retry is scheduled but no attempts remain".into());
        }
        s if s != TodoState::Failed && t.next_retry_at.is_some() => {
            return Err(format!("state {s} with next_retry_at set"));
        }
        _ => {}
    }
    if t.dead_letter() != t.dead_letter_reason.is_some() {
        return Err(format!(
            "dead_letter {} but dead_letter_reason {:?}; every dead letter says why, and only one",
            t.dead_letter(),
            t.dead_letter_reason
        ));
    }
    if t.max_same_failures > MAX_SAME_FAILURES_MAX
        || t.idempotency_key
            .as_ref()
            .is_some_and(|k| check_idempotency_key(k).is_err())
    {
        return Err("max_same_failures or idempotency_key out of bounds".into());
    }
    check_asking(t, attempts.clone())?;
    for a in attempts.clone() {
        if (a.disposition == Some(Disposition::DeadLettered)) != a.dead_letter_reason.is_some() {
            return Err(format!(
                "attempt {}: disposition {:?} with dead_letter_reason {:?}",
                a.seq, a.disposition, a.dead_letter_reason
            ));
        }
        if a.late_reports.len() > LATE_REPORTS_KEPT
            || (a.late_reports.len() as u64) > u64::from(a.late_reports_total)
            || (a.is_open() && a.late_reports_total > 0)
            || a.late_reports.iter().any(|l| {
                l.summary
                    .as_ref()
                    .is_some_and(|s| s.len() > LATE_SUMMARY_MAX_BYTES)
            })
            || a.failure_signature
                .as_ref()
                .is_some_and(|s| s.len() > SIGNATURE_MAX_BYTES)
        {
            return Err(format!(
                "attempt {}: late reports or failure signature out of bounds",
                a.seq
            ));
        }
        let ended = a.ended_at.is_some();
        if ended != a.outcome.is_some() || ended != a.disposition.is_some() {
            return Err(format!(
                "attempt {}: ended_at, outcome and disposition must be set together",
                a.seq
            ));
        }
        if a.closed_by.is_some() && ended != a.closed_by.is_some() {
            return Err(format!(
                "attempt {}: closed_by is set on an open attempt",
                a.seq
            ));
        }
        if a.ended_at.is_some_and(|e| e < a.claimed_at) {
            return Err(format!("attempt {} ended before it was claimed", a.seq));
        }
        if a.todo_id != t.id {
            return Err(format!("attempt {} belongs to {}", a.seq, a.todo_id));
        }
        if a.summary
            .as_ref()
            .is_some_and(|s| s.len() > crate::bounds::SUMMARY_MAX_BYTES)
            || a.claimant
                .as_ref()
                .is_some_and(|c| c.len() > crate::bounds::CLAIMANT_MAX_BYTES)
            || a.artifact
                .as_ref()
                .is_some_and(|x| crate::bounds::check_artifact(x).is_err())
        {
            return Err(format!(
                "attempt {}: summary, claimant or artifact out of bounds",
                a.seq
            ));
        }
    }
    if t.state == TodoState::Done
        && attempts
            .last()
            .is_some_and(|a| a.outcome != Some(Outcome::Completed))
    {
        return Err("done, but the newest attempt did not complete".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests;
