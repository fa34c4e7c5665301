//! The columns of todos, attempts and endpoints, and their decoding, shared by both backends.

use relay_core::Error;
use relay_core::Millis;
use relay_core::ledger::{
    Actor, Attempt, ClaimerKind, DeadLetterReason, Disposition, LateReport, Newest, Outcome, Sweep,
    Todo, TodoFilter, TodoState, TokenHash,
};
use serde_json::Value;
use std::sync::LazyLock;

use super::Endpoint;

/// The todo columns, in the order [`todo`] decodes them.
pub(crate) const TODO_COLS: [&str; 25] = [
    "id",
    "endpoint",
    "queue",
    "title",
    "kind",
    "source",
    "payload",
    "work_order",
    "assignee",
    "state",
    "owner",
    "attempt",
    "max_attempts",
    "attempts_total",
    "attempts_pruned",
    "lease_expires_at",
    "claimed_at",
    "next_retry_at",
    "result",
    "created_at",
    "updated_at",
    "dead_letter_reason",
    "idempotency_key",
    "deadline_at",
    "max_same_failures",
];

/// The attempt columns, in the order [`attempt`] decodes them.
pub(crate) const ATTEMPT_COLS: [&str; 23] = [
    "todo_id",
    "seq",
    "attempt",
    "claimer_kind",
    "claimer_endpoint",
    "claimer_session",
    "owner",
    "claimant",
    "claimed_at",
    "last_heartbeat_at",
    "lease_expires_at",
    "ended_at",
    "outcome",
    "disposition",
    "summary",
    "summary_truncated",
    "artifact",
    "closed_by",
    "failure_signature",
    "dead_letter_reason",
    "lease_token_hash",
    "late_reports",
    "late_reports_total",
];

pub(crate) const ENDPOINT_COLS: &str = "name, token_hash, verbs, queues, created_at, revoked_at";

/// `alias.col, alias.col, …` for a select list.
pub(crate) fn select_list(alias: &str, cols: &[&str]) -> String {
    cols.iter()
        .map(|c| format!("{alias}.{c}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The statements both backends share, written once; `mark` is the dialect's parameter sign
/// (`?` for SQLite's `?1`, `$` for Postgres's `$1`).
pub(crate) struct Shared {
    mark: char,
    /// `SELECT <todo columns> FROM todos t`, to which each query adds its WHERE.
    pub todo_select: String,
    /// The todo's open attempt.
    pub open_attempt: String,
    pub insert_todo: String,
    pub insert_attempt: String,
    /// Attempts newest first, all or closed only. Two fixed statements, not a boolean
    /// parameter: a planner cannot see through one, and SQLite re-prepares such a query on
    /// every use.
    pub attempts: String,
    pub closed_attempts: String,
    /// The columns of [`todo_update`].
    pub update_todo: String,
    /// The columns of [`attempt_update`], while the attempt is open.
    pub update_open_attempt: String,
    /// Closed attempts of a todo at or below a seq.
    pub prune: String,
    /// The late reports of a closed attempt, and nothing else of it.
    pub update_late: String,
    /// The endpoint's todo with an idempotency key.
    pub by_key: String,
    pub insert_endpoint: String,
}

/// The doorbell scan's query: pending rows numbered in (`after`, `horizon`], only the columns a
/// ring needs, through the partial index `todos_change`.
pub(crate) fn pending_since(mark: char) -> String {
    format!(
        "SELECT id, endpoint, queue, attempts_total, change_seq FROM todos \
         WHERE state = 'pending' AND change_seq > {mark}1 AND change_seq <= {mark}2 \
         ORDER BY change_seq LIMIT {mark}3"
    )
}

/// The page of a scan that read `changes` (at most `limit`) below `horizon`: a full page resumes
/// after its last row, a short one has seen everything up to the horizon.
pub(crate) fn pending_page(
    changes: Vec<super::PendingChange>,
    limit: usize,
    horizon: u64,
) -> super::PendingPage {
    let watermark = match changes.last() {
        Some(last) if changes.len() >= limit => last.change_seq,
        _ => horizon,
    };
    super::PendingPage { changes, watermark }
}

/// `?1, ?2, …` or `$1, $2, …`.
pub(crate) fn placeholders(mark: char, n: usize) -> String {
    (1..=n)
        .map(|i| format!("{mark}{i}"))
        .collect::<Vec<_>>()
        .join(", ")
}

impl Shared {
    pub(crate) fn new(mark: char) -> Shared {
        let attempts = |filter: &str| {
            format!(
                "SELECT {} FROM todo_attempts a WHERE a.todo_id = {mark}1{filter} \
                 ORDER BY a.seq DESC LIMIT {mark}2",
                select_list("a", &ATTEMPT_COLS)
            )
        };
        Shared {
            mark,
            todo_select: format!("SELECT {} FROM todos t", select_list("t", &TODO_COLS)),
            open_attempt: format!(
                "SELECT {} FROM todo_attempts a WHERE a.todo_id = {mark}1 AND a.ended_at IS NULL",
                select_list("a", &ATTEMPT_COLS)
            ),
            // No conflict target: the id and the endpoint's idempotency key are both unique.
            insert_todo: format!(
                "INSERT INTO todos ({}) VALUES ({}) ON CONFLICT DO NOTHING",
                TODO_COLS.join(", "),
                placeholders(mark, TODO_COLS.len())
            ),
            insert_attempt: format!(
                "INSERT INTO todo_attempts ({}) VALUES ({})",
                ATTEMPT_COLS.join(", "),
                placeholders(mark, ATTEMPT_COLS.len())
            ),
            attempts: attempts(""),
            closed_attempts: attempts(" AND a.ended_at IS NOT NULL"),
            update_todo: format!(
                "UPDATE todos SET {} WHERE id = {mark}1",
                set_list(
                    mark,
                    &todo_updated().map(|i| TODO_COLS[i]).collect::<Vec<_>>(),
                    2
                )
            ),
            update_open_attempt: format!(
                "UPDATE todo_attempts SET {} \
                 WHERE todo_id = {mark}1 AND seq = {mark}2 AND ended_at IS NULL",
                set_list(mark, &ATTEMPT_COLS[ATTEMPT_REWRITTEN], 3)
            ),
            prune: format!(
                "DELETE FROM todo_attempts WHERE todo_id = {mark}1 AND seq <= {mark}2 \
                 AND ended_at IS NOT NULL"
            ),
            update_late: format!(
                "UPDATE todo_attempts SET late_reports = {mark}3, late_reports_total = {mark}4 \
                 WHERE todo_id = {mark}1 AND seq = {mark}2 AND ended_at IS NOT NULL"
            ),
            by_key: format!(
                "SELECT {} FROM todos t WHERE t.endpoint = {mark}1 AND t.idempotency_key = {mark}2",
                select_list("t", &TODO_COLS)
            ),
            insert_endpoint: format!(
                "INSERT INTO endpoints ({ENDPOINT_COLS}) VALUES ({}) ON CONFLICT (name) DO NOTHING",
                placeholders(mark, 6)
            ),
        }
    }
}

/// A value bound to a statement parameter, as both backends bind it; each maps these to its own
/// types (Postgres stores counts as `integer`, times as `bigint`).
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Val {
    Text(Option<String>),
    /// A count or seq (an `integer` column).
    Count(u32),
    /// A time in ms, or another `bigint`.
    Big(Option<i64>),
    Bool(bool),
    Bytes(Option<Vec<u8>>),
    /// A text array (Postgres only: SQLite binds a list one placeholder per entry).
    Texts(Vec<String>),
}

fn text(v: &Option<String>) -> Val {
    Val::Text(v.clone())
}

fn label(v: Option<&str>) -> Val {
    Val::Text(v.map(str::to_string))
}

fn time(op: &str, v: Millis) -> Result<Val, Error> {
    Ok(Val::Big(Some(ms(op, v)?)))
}

fn opt_time(op: &str, v: Option<Millis>) -> Result<Val, Error> {
    Ok(Val::Big(opt_ms(op, v)?))
}

/// A todo row's values in [`TODO_COLS`] order, for [`Shared::insert_todo`].
pub(crate) fn todo_row(op: &str, t: &Todo) -> Result<Vec<Val>, Error> {
    (0..TODO_COLS.len()).map(|i| todo_val(op, t, i)).collect()
}

/// The value of column `i` of [`TODO_COLS`]: one at a time, so that an update serialises only
/// the columns it rewrites (not the payload and work order, which no transition changes).
fn todo_val(op: &str, t: &Todo, i: usize) -> Result<Val, Error> {
    Ok(match TODO_COLS[i] {
        "id" => label(Some(&t.id)),
        "endpoint" => label(Some(&t.endpoint)),
        "queue" => label(Some(&t.queue)),
        "title" => label(Some(&t.title)),
        "kind" => text(&t.kind),
        "source" => text(&t.source),
        "payload" => Val::Text(json_text(&t.payload)),
        "work_order" => Val::Text(json_text(&t.work_order)),
        "assignee" => text(&t.assignee),
        "state" => label(Some(t.state.as_str())),
        "owner" => text(&t.owner),
        "attempt" => Val::Count(t.attempt),
        "max_attempts" => Val::Count(t.max_attempts),
        "attempts_total" => Val::Count(t.attempts_total),
        "attempts_pruned" => Val::Count(t.attempts_pruned),
        "lease_expires_at" => opt_time(op, t.lease_expires_at)?,
        "claimed_at" => opt_time(op, t.claimed_at)?,
        "next_retry_at" => opt_time(op, t.next_retry_at)?,
        "result" => Val::Text(json_text(&t.result)),
        "created_at" => time(op, t.created_at)?,
        "updated_at" => time(op, t.updated_at)?,
        "dead_letter_reason" => label(t.dead_letter_reason.map(DeadLetterReason::as_str)),
        "idempotency_key" => text(&t.idempotency_key),
        "deadline_at" => opt_time(op, t.deadline_at)?,
        "max_same_failures" => Val::Count(t.max_same_failures),
        other => unreachable!("todo column {other} has no value"),
    })
}

/// The error of a todo with more than one open attempt (the stores' schema refuses one, so it
/// is a broken store, not a caller's mistake).
pub(crate) fn two_open_attempts(op: &str, id: &str) -> Error {
    Error::internal(format!(
        "{op} {id}: the todo has more than one open attempt"
    ))
}

/// An attempt row's values in [`ATTEMPT_COLS`] order, for [`Shared::insert_attempt`].
pub(crate) fn attempt_row(op: &str, a: &Attempt) -> Result<Vec<Val>, Error> {
    Ok(vec![
        label(Some(&a.todo_id)),
        Val::Count(a.seq),
        Val::Count(a.attempt),
        label(Some(a.claimer_kind.as_str())),
        text(&a.claimer_endpoint),
        text(&a.claimer_session),
        label(Some(&a.owner)),
        text(&a.claimant),
        time(op, a.claimed_at)?,
        opt_time(op, a.last_heartbeat_at)?,
        time(op, a.lease_expires_at)?,
        opt_time(op, a.ended_at)?,
        label(a.outcome.map(Outcome::as_str)),
        label(a.disposition.map(Disposition::as_str)),
        text(&a.summary),
        Val::Bool(a.summary_truncated),
        text(&a.artifact),
        text(&a.closed_by),
        text(&a.failure_signature),
        label(a.dead_letter_reason.map(DeadLetterReason::as_str)),
        Val::Bytes(a.lease_token_hash.map(|h| h.0.to_vec())),
        Val::Text(late_text(&a.late_reports)),
        Val::Count(a.late_reports_total),
    ])
}

/// Late reports as the JSON text the attempts table stores; `NULL` for none.
fn late_text(late: &[LateReport]) -> Option<String> {
    (!late.is_empty()).then(|| serde_json::to_string(late).unwrap_or_default())
}

/// The values of [`Shared::update_late`].
pub(crate) fn late_update(a: &Attempt) -> Vec<Val> {
    vec![
        label(Some(&a.todo_id)),
        Val::Count(a.seq),
        Val::Text(late_text(&a.late_reports)),
        Val::Count(a.late_reports_total),
    ]
}

/// The todo columns no transition changes (the store refuses a change to them, see
/// `ledger::run`); an update rewrites every other column, keyed by `id`.
const TODO_FIXED: &str = "id endpoint queue title kind source payload work_order assignee \
                          max_attempts created_at idempotency_key max_same_failures";

/// The positions in [`TODO_COLS`] of the columns an update rewrites.
fn todo_updated() -> impl Iterator<Item = usize> {
    static UPDATED: LazyLock<Vec<usize>> = LazyLock::new(|| {
        (0..TODO_COLS.len())
            .filter(|&i| !TODO_FIXED.split_whitespace().any(|f| f == TODO_COLS[i]))
            .collect()
    });
    UPDATED.iter().copied()
}

/// The attempt columns a heartbeat or a close rewrites (`last_heartbeat_at` to
/// `dead_letter_reason` of [`ATTEMPT_COLS`]), after its two key columns (`todo_id`, `seq`).
const ATTEMPT_REWRITTEN: std::ops::Range<usize> = 9..20;

/// `col = ?n, …` for `cols`, numbered from `from`.
fn set_list(mark: char, cols: &[&str], from: usize) -> String {
    cols.iter()
        .zip(from..)
        .map(|(c, i)| format!("{c} = {mark}{i}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The columns of [`todo_update`]'s values, in order: only the Postgres batch writer names them.
#[cfg(feature = "postgres")]
pub(crate) fn todo_update_cols() -> Vec<&'static str> {
    std::iter::once(0)
        .chain(todo_updated())
        .map(|i| TODO_COLS[i])
        .collect()
}

/// The columns of [`attempt_update`]'s values, in order (for the Postgres batch writer).
#[cfg(feature = "postgres")]
pub(crate) fn attempt_update_cols() -> Vec<&'static str> {
    [ATTEMPT_COLS[0], ATTEMPT_COLS[1]]
        .into_iter()
        .chain(ATTEMPT_COLS[ATTEMPT_REWRITTEN].iter().copied())
        .collect()
}

/// The values of [`Shared::update_todo`]: the id, then the rewritten columns.
pub(crate) fn todo_update(op: &str, t: &Todo) -> Result<Vec<Val>, Error> {
    std::iter::once(0)
        .chain(todo_updated())
        .map(|i| todo_val(op, t, i))
        .collect()
}

/// The values of [`Shared::update_open_attempt`].
pub(crate) fn attempt_update(op: &str, a: &Attempt) -> Result<Vec<Val>, Error> {
    let mut row = attempt_row(op, a)?;
    row.truncate(ATTEMPT_REWRITTEN.end);
    row.drain(2..ATTEMPT_REWRITTEN.start);
    Ok(row)
}

/// An endpoint row's values in [`ENDPOINT_COLS`] order, for [`Shared::insert_endpoint`].
pub(crate) fn endpoint_row(op: &str, e: &Endpoint) -> Result<Vec<Val>, Error> {
    Ok(vec![
        label(Some(&e.name)),
        Val::Bytes(Some(e.token_hash.0.to_vec())),
        Val::Text(Some(list_text(&e.verbs))),
        Val::Text(e.queues.as_deref().map(list_text)),
        time(op, e.created_at)?,
        opt_time(op, e.revoked_at)?,
    ])
}

impl Shared {
    /// `claim_next`'s query and parameters, then `lock` (the dialect's lock clause).
    pub(crate) fn next_claimable(
        &self,
        op: &str,
        now: Millis,
        actor: &Actor,
        queues: Option<&[String]>,
        paused: &[String],
        lock: &str,
    ) -> Result<(String, Vec<Val>), Error> {
        self.next_claimable_n(op, now, actor, queues, paused, 1, lock)
    }

    /// The first `limit` rows [`Shared::next_claimable`] would take one by one (Postgres' batch
    /// reads them at once). `now` is the first value bound.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn next_claimable_n(
        &self,
        op: &str,
        now: Millis,
        actor: &Actor,
        queues: Option<&[String]>,
        paused: &[String],
        limit: usize,
        lock: &str,
    ) -> Result<(String, Vec<Val>), Error> {
        let mut q = Query::new(self.mark);
        let now = q.bind(time(op, now)?);
        let owner = q.bind_text(actor.owner());
        let scope = match actor {
            Actor::Endpoint { endpoint, .. } => format!("t.endpoint = {}", q.bind_text(endpoint)),
            Actor::Operator { .. } => q.always().into(),
        };
        let queues = match queues {
            None => q.always().into(),
            Some(qs) => q.queue_in(qs),
        };
        // mirrors ledger::run's claim_next: a paused queue is skipped.
        let queues = if paused.is_empty() {
            queues
        } else {
            format!("{queues} AND NOT ({})", q.queue_in(paused))
        };
        // mirrors transition::claimable: scope, queue filter, assignee, deadline, then pending, or
        // claimed with a lapsed lease and attempts left, or failed with the retry due and
        // attempts left.
        let sql = format!(
            "{} WHERE {scope} AND {queues} AND (t.assignee IS NULL OR t.assignee = {owner})
               AND (t.deadline_at IS NULL OR t.deadline_at > {now})
               AND {live} -- lets the partial FIFO index serve
               AND (t.state = 'pending'
                    OR (t.state = 'claimed' AND (t.lease_expires_at IS NULL OR t.lease_expires_at <= {now})
                        AND t.attempt < t.max_attempts)
                    OR (t.state = 'failed' AND t.next_retry_at <= {now} AND t.attempt < t.max_attempts))
             ORDER BY t.created_at, t.id LIMIT {limit}{lock}",
            self.todo_select,
            live = q.one_of("t.state", LIVE)
        );
        Ok((sql, q.vals))
    }

    /// A todo's attempts newest first, as `which` says.
    pub(crate) fn attempts_query(&self, id: &str, which: Newest) -> (&str, Vec<Val>) {
        let sql = if which.closed_only {
            &self.closed_attempts
        } else {
            &self.attempts
        };
        let limit = Val::Big(Some(i64::try_from(which.limit).unwrap_or(i64::MAX)));
        (sql, vec![label(Some(id)), limit])
    }

    /// `list_todos`' query and parameters.
    pub(crate) fn list(&self, actor: &Actor, filter: &TodoFilter) -> (String, Vec<Val>) {
        let mut q = Query::new(self.mark);
        let mut clauses = Vec::new();
        if let Actor::Endpoint { endpoint, .. } = actor {
            clauses.push(format!("t.endpoint = {}", q.bind(label(Some(endpoint)))));
        }
        if let Some(s) = filter.state {
            clauses.push(format!("t.state = {}", q.bind(label(Some(s.as_str())))));
        }
        if let Some(qs) = &filter.queues {
            clauses.push(q.queue_in(qs));
        }
        if let Some((at, id)) = &filter.after {
            // A row value, so that the (created_at, id) order's index can seek to it.
            let at = q.bind(Val::Big(Some(i64::try_from(*at).unwrap_or(i64::MAX))));
            let id = q.bind(label(Some(id)));
            clauses.push(format!("(t.created_at, t.id) > ({at}, {id})"));
        }
        let which = if clauses.is_empty() {
            q.always().to_string()
        } else {
            clauses.join(" AND ")
        };
        let limit = q.bind(Val::Big(Some(
            i64::try_from(filter.limit).unwrap_or(i64::MAX),
        )));
        let sql = format!(
            "{} WHERE {which} ORDER BY t.created_at, t.id LIMIT {limit}",
            self.todo_select
        );
        (sql, q.vals)
    }

    /// A sweep's candidate query (its ids in no order: Postgres adds `ORDER BY id` and its lock
    /// clause, SQLite sorts them after, so that its planner picks the sweep's partial index
    /// rather than walking the primary key over every todo) and its one parameter.
    pub(crate) fn sweep(&self, op: &str, sweep: Sweep<'_>) -> Result<(String, Val), Error> {
        let m = self.mark;
        let q = Query::new(m);
        Ok(match sweep {
            // mirrors transition::reap
            Sweep::Reap { now } => (
                format!(
                    "SELECT id FROM todos WHERE state = 'claimed'
                       AND (lease_expires_at IS NULL OR lease_expires_at <= {m}1)"
                ),
                time(op, now)?,
            ),
            // mirrors transition::requeue_due. On SQLite as a UNION ALL (an id in both halves
            // comes twice; the store drops the repeat), so that each half searches its partial
            // index (the retry and the deadline one; the second half names the deadline index's
            // predicate) instead of the OR scanning the table. A plain UNION merges the halves
            // in id order, which walks the primary key again.
            Sweep::RequeueDue { now } if q.sqlite() => (
                format!(
                    "SELECT id FROM todos WHERE state = 'failed' AND next_retry_at <= {m}1
                       AND attempt < max_attempts
                     UNION ALL
                     SELECT id FROM todos WHERE deadline_at <= {m}1 AND deadline_at IS NOT NULL
                       AND state IN ('pending', 'failed')
                       AND (state = 'pending' OR (state = 'failed' AND next_retry_at IS NOT NULL))"
                ),
                time(op, now)?,
            ),
            Sweep::RequeueDue { now } => (
                format!(
                    "SELECT id FROM todos WHERE (state = 'failed' AND next_retry_at <= {m}1
                       AND attempt < max_attempts)
                       OR (deadline_at <= {m}1 AND (state = 'pending'
                           OR (state = 'failed' AND next_retry_at IS NOT NULL)))"
                ),
                time(op, now)?,
            ),
            // mirrors transition::revoke
            Sweep::Revoke { endpoint, .. } => (
                format!("SELECT id FROM todos WHERE endpoint = {m}1 AND state = 'claimed'"),
                label(Some(endpoint)),
            ),
            // mirrors ledger::purgeable
            Sweep::Purge { cutoff } => (
                format!(
                    "SELECT id FROM todos WHERE updated_at <= {m}1
                       AND {finished}
                       AND (state IN ('done', 'canceled')
                            OR (state = 'failed' AND next_retry_at IS NULL))",
                    finished = q.one_of("state", FINISHED)
                ),
                time(op, cutoff)?,
            ),
        })
    }
}

/// The states of the FIFO index (`todos_fifo`): the todos a claim may take.
const LIVE: &[&str] = &["pending", "claimed", "failed"];
/// The states of the retention index (`todos_finished`).
const FINISHED: &[&str] = &["done", "canceled", "failed"];

/// A statement's parameters as its clauses bind them, in the dialect of `mark`.
struct Query {
    mark: char,
    vals: Vec<Val>,
}

impl Query {
    fn new(mark: char) -> Query {
        Query {
            mark,
            vals: Vec::new(),
        }
    }

    fn sqlite(&self) -> bool {
        self.mark == '?'
    }

    /// Binds `v`; its placeholder.
    fn bind(&mut self, v: Val) -> String {
        self.vals.push(v);
        format!("{}{}", self.mark, self.vals.len())
    }

    /// A text value compared with a column of the todos table. On SQLite it is cast. SQLite
    /// (3.5x) marked the plan of the claim's bare `t.assignee = ?` (and of the load's join on
    /// `t.id = ?`) as depending on the value bound, and rusqlite's statement cache clears a
    /// statement's bindings when it takes it back, which expires such a statement: SQLite
    /// re-prepared it on every use, at more cost than running it. The cast keeps the index
    /// usable without that; `cached_statements_are_not_reprepared` checks it.
    fn bind_text(&mut self, v: &str) -> String {
        let mark = self.bind(label(Some(v)));
        if self.sqlite() {
            format!("CAST({mark} AS TEXT)")
        } else {
            mark
        }
    }

    /// `col` is one of the constant `states`, written as the partial index on them writes its
    /// predicate, so that the planner matches the two term for term. On SQLite that is a chain
    /// of `OR`s (see the SQLite migration 8): SQLite evaluates an `IN` list of more than two
    /// constants through a temporary b-tree it builds on every run of the statement.
    fn one_of(&self, col: &str, states: &[&str]) -> String {
        let each: Vec<String> = states.iter().map(|s| format!("'{s}'")).collect();
        if self.sqlite() {
            let eq: Vec<String> = each.iter().map(|s| format!("{col} = {s}")).collect();
            format!("({})", eq.join(" OR "))
        } else {
            format!("{col} IN ({})", each.join(", "))
        }
    }

    /// A clause that holds for every row.
    fn always(&self) -> &'static str {
        if self.sqlite() { "1" } else { "true" }
    }

    /// `t.queue` is one of `qs` (none: no row).
    fn queue_in(&mut self, qs: &[String]) -> String {
        if !self.sqlite() {
            return format!("t.queue = ANY({})", self.bind(Val::Texts(qs.to_vec())));
        }
        if qs.is_empty() {
            return "0".into();
        }
        let marks: Vec<String> = qs.iter().map(|q| self.bind(label(Some(q)))).collect();
        format!("t.queue IN ({})", marks.join(", "))
    }
}

/// What the decoders need from a result row; each backend maps its own types.
pub(crate) trait Row {
    fn text(&self, i: usize) -> Result<Option<String>, String>;
    fn int(&self, i: usize) -> Result<Option<i64>, String>;
    fn boolean(&self, i: usize) -> Result<bool, String>;
    fn bytes(&self, i: usize) -> Result<Option<Vec<u8>>, String>;
}

fn bad(what: &str, e: impl std::fmt::Display) -> Error {
    Error::internal(format!("reading {what} from the store: {e}"))
}

struct Reader<'r, R: Row + ?Sized> {
    row: &'r R,
    at: usize,
    what: &'static str,
}

impl<R: Row + ?Sized> Reader<'_, R> {
    fn next(&mut self) -> usize {
        self.at += 1;
        self.at - 1
    }
    fn opt_text(&mut self) -> Result<Option<String>, Error> {
        let i = self.next();
        self.row.text(i).map_err(|e| bad(self.what, e))
    }
    fn text(&mut self) -> Result<String, Error> {
        let at = self.at;
        self.opt_text()?
            .ok_or_else(|| bad(self.what, format!("column {at} is NULL")))
    }
    fn opt_int(&mut self) -> Result<Option<i64>, Error> {
        let i = self.next();
        self.row.int(i).map_err(|e| bad(self.what, e))
    }
    fn opt_millis(&mut self) -> Result<Option<Millis>, Error> {
        self.opt_int()?
            .map(|v| Millis::try_from(v).map_err(|e| bad(self.what, e)))
            .transpose()
    }
    fn millis(&mut self) -> Result<Millis, Error> {
        let at = self.at;
        self.opt_millis()?
            .ok_or_else(|| bad(self.what, format!("column {at} is NULL")))
    }
    fn count(&mut self) -> Result<u32, Error> {
        let at = self.at;
        let v = self
            .opt_int()?
            .ok_or_else(|| bad(self.what, format!("column {at} is NULL")))?;
        u32::try_from(v).map_err(|e| bad(self.what, e))
    }
    fn json(&mut self) -> Result<Option<Value>, Error> {
        self.opt_text()?
            .map(|s| serde_json::from_str(&s).map_err(|e| bad(self.what, e)))
            .transpose()
    }
    fn boolean(&mut self) -> Result<bool, Error> {
        let i = self.next();
        self.row.boolean(i).map_err(|e| bad(self.what, e))
    }
    fn hash(&mut self) -> Result<Option<TokenHash>, Error> {
        let i = self.next();
        match self.row.bytes(i).map_err(|e| bad(self.what, e))? {
            None => Ok(None),
            Some(b) => <[u8; 32]>::try_from(b.as_slice())
                .map(|h| Some(TokenHash(h)))
                .map_err(|_| bad(self.what, "a token hash is not 32 bytes")),
        }
    }
    fn parsed<T>(&mut self, parse: fn(&str) -> Option<T>) -> Result<Option<T>, Error> {
        match self.opt_text()? {
            None => Ok(None),
            Some(s) => parse(&s)
                .map(Some)
                .ok_or_else(|| bad(self.what, format!("unknown value {s:?}"))),
        }
    }
}

/// Decodes a todo from the 25 columns starting at `at`.
pub(crate) fn todo<R: Row + ?Sized>(row: &R, at: usize) -> Result<Todo, Error> {
    let mut r = Reader {
        row,
        at,
        what: "a todo",
    };
    Ok(Todo {
        id: r.text()?,
        endpoint: r.text()?,
        queue: r.text()?,
        title: r.text()?,
        kind: r.opt_text()?,
        source: r.opt_text()?,
        payload: r.json()?,
        work_order: r.json()?,
        assignee: r.opt_text()?,
        state: r
            .parsed(TodoState::parse)?
            .ok_or_else(|| bad("a todo", "state is NULL"))?,
        owner: r.opt_text()?,
        attempt: r.count()?,
        max_attempts: r.count()?,
        attempts_total: r.count()?,
        attempts_pruned: r.count()?,
        lease_expires_at: r.opt_millis()?,
        claimed_at: r.opt_millis()?,
        next_retry_at: r.opt_millis()?,
        result: r.json()?,
        created_at: r.millis()?,
        updated_at: r.millis()?,
        dead_letter_reason: r.parsed(DeadLetterReason::parse)?,
        idempotency_key: r.opt_text()?,
        deadline_at: r.opt_millis()?,
        max_same_failures: r.count()?,
    })
}

/// Decodes an attempt from the 23 columns starting at `at`; `None` when they are all NULL (an
/// outer join that found no attempt).
pub(crate) fn attempt<R: Row>(row: &R, at: usize) -> Result<Option<Attempt>, Error> {
    let mut r = Reader {
        row,
        at,
        what: "an attempt",
    };
    let Some(todo_id) = r.opt_text()? else {
        return Ok(None);
    };
    Ok(Some(Attempt {
        todo_id,
        seq: r.count()?,
        attempt: r.count()?,
        claimer_kind: r
            .parsed(ClaimerKind::parse)?
            .ok_or_else(|| bad("an attempt", "claimer_kind is NULL"))?,
        claimer_endpoint: r.opt_text()?,
        claimer_session: r.opt_text()?,
        owner: r.text()?,
        claimant: r.opt_text()?,
        claimed_at: r.millis()?,
        last_heartbeat_at: r.opt_millis()?,
        lease_expires_at: r.millis()?,
        ended_at: r.opt_millis()?,
        outcome: r.parsed(Outcome::parse)?,
        disposition: r.parsed(Disposition::parse)?,
        summary: r.opt_text()?,
        summary_truncated: r.boolean()?,
        artifact: r.opt_text()?,
        closed_by: r.opt_text()?,
        failure_signature: r.opt_text()?,
        dead_letter_reason: r.parsed(DeadLetterReason::parse)?,
        lease_token_hash: r.hash()?,
        late_reports: r
            .opt_text()?
            .map(|s| serde_json::from_str(&s).map_err(|e| bad("an attempt", e)))
            .transpose()?
            .unwrap_or_default(),
        late_reports_total: r.count()?,
    }))
}

/// Decodes an endpoint from the columns of [`ENDPOINT_COLS`]; verbs and queues are JSON arrays.
pub(crate) fn endpoint<R: Row>(row: &R) -> Result<Endpoint, Error> {
    let mut r = Reader {
        row,
        at: 0,
        what: "an endpoint",
    };
    let name = r.text()?;
    let token_hash = r
        .hash()?
        .ok_or_else(|| bad("an endpoint", "token_hash is NULL"))?;
    let list = |v: Option<Value>| -> Result<Option<Vec<String>>, Error> {
        v.map(|v| serde_json::from_value(v).map_err(|e| bad("an endpoint", e)))
            .transpose()
    };
    let verbs = list(r.json()?)?.unwrap_or_default();
    let queues = list(r.json()?)?;
    Ok(Endpoint {
        name,
        token_hash,
        verbs,
        queues,
        created_at: r.millis()?,
        revoked_at: r.opt_millis()?,
    })
}

/// A statement written with Postgres' `$N` placeholders in a dialect's own mark (SQLite takes
/// `?N`), so that the store's own tables have one SQL text for both.
pub(crate) fn numbered(mark: char, sql: &str) -> String {
    if mark == '$' {
        sql.to_string()
    } else {
        sql.replace('$', &mark.to_string())
    }
}

/// A time as the `BIGINT` the tables store.
pub(crate) fn ms(op: &str, v: Millis) -> Result<i64, Error> {
    i64::try_from(v).map_err(|_| {
        Error::invalid(format!(
            "{op}: time {v} ms is beyond what the store can hold"
        ))
    })
}

pub(crate) fn opt_ms(op: &str, v: Option<Millis>) -> Result<Option<i64>, Error> {
    v.map(|v| ms(op, v)).transpose()
}

/// A JSON value as the text the tables store.
pub(crate) fn json_text(v: &Option<Value>) -> Option<String> {
    v.as_ref().map(Value::to_string)
}

/// A string list as JSON text.
pub(crate) fn list_text(v: &[String]) -> String {
    Value::from(v.to_vec()).to_string()
}

#[cfg(test)]
mod tests {
    use super::Shared;

    /// The update statements, derived from the column lists, rewrite exactly the columns a
    /// transition may change.
    #[test]
    fn update_statements_rewrite_what_transitions_change() {
        let sql = Shared::new('$');
        assert_eq!(
            sql.update_todo,
            "UPDATE todos SET state = $2, owner = $3, attempt = $4, attempts_total = $5, \
             attempts_pruned = $6, lease_expires_at = $7, claimed_at = $8, next_retry_at = $9, \
             result = $10, updated_at = $11, dead_letter_reason = $12, deadline_at = $13 \
             WHERE id = $1"
        );
        assert_eq!(
            sql.update_open_attempt,
            "UPDATE todo_attempts SET last_heartbeat_at = $3, lease_expires_at = $4, \
             ended_at = $5, outcome = $6, disposition = $7, summary = $8, \
             summary_truncated = $9, artifact = $10, closed_by = $11, failure_signature = $12, \
             dead_letter_reason = $13 \
             WHERE todo_id = $1 AND seq = $2 AND ended_at IS NULL"
        );
    }
}
