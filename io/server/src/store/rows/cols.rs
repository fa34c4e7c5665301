//! The column lists of todos, attempts and endpoints, written once, and the values a row binds
//! to them.

use relay_core::Error;
use relay_core::Millis;
use relay_core::ledger::{Attempt, DeadLetterReason, Disposition, LateReport, Outcome, Todo};
use serde_json::Value;
use std::sync::LazyLock;

use crate::store::types::Endpoint;

/// The todo columns, in the order [`todo`] decodes them.
///
/// [`todo`]: super::todo
pub(crate) const TODO_COLS: [&str; 38] = [
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
    "max_input_requests",
    "input_requests",
    "answer_within_ms",
    "answer_due_at",
    "budget_cost_micros",
    "budget_tokens",
    "spent_cost_micros",
    "spent_input_tokens",
    "spent_output_tokens",
    "task_id",
    "priority",
    "run_at",
    "concurrency_key",
];

/// The attempt columns, in the order [`attempt`] decodes them.
///
/// [`attempt`]: super::attempt
pub(crate) const ATTEMPT_COLS: [&str; 31] = [
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
    "question",
    "usage_cost_micros",
    "usage_input_tokens",
    "usage_output_tokens",
    "lease_token_hash",
    "late_reports",
    "late_reports_total",
    "answer",
    "answered_at",
    "answered_by",
    "answer_key",
];

pub(crate) const ENDPOINT_COLS: &str = "name, token_hash, verbs, queues, created_at, revoked_at";

/// `alias.col, alias.col, …` for a select list.
pub(crate) fn select_list(alias: &str, cols: &[&str]) -> String {
    cols.iter()
        .map(|c| format!("{alias}.{c}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `?1, ?2, …` or `$1, $2, …`.
pub(crate) fn placeholders(mark: char, n: usize) -> String {
    (1..=n)
        .map(|i| format!("{mark}{i}"))
        .collect::<Vec<_>>()
        .join(", ")
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

pub(super) fn label(v: Option<&str>) -> Val {
    Val::Text(v.map(str::to_string))
}

pub(crate) fn time(op: &str, v: Millis) -> Result<Val, Error> {
    Ok(Val::Big(Some(ms(op, v)?)))
}

fn opt_time(op: &str, v: Option<Millis>) -> Result<Val, Error> {
    Ok(Val::Big(opt_ms(op, v)?))
}

/// A todo row's values in [`TODO_COLS`] order, for [`Shared::insert_todo`].
///
/// [`Shared::insert_todo`]: super::Shared::insert_todo
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
        "max_input_requests" => Val::Count(t.asking.max_requests),
        "input_requests" => Val::Count(t.asking.requests),
        "answer_within_ms" => opt_time(op, t.asking.answer_within)?,
        "answer_due_at" => opt_time(op, t.asking.answer_due_at)?,
        "budget_cost_micros" => figure(op, t.budget.cost_micros)?,
        "budget_tokens" => figure(op, t.budget.tokens)?,
        "spent_cost_micros" => figure(op, Some(t.spent.cost_micros))?,
        "spent_input_tokens" => figure(op, Some(t.spent.input_tokens))?,
        "spent_output_tokens" => figure(op, Some(t.spent.output_tokens))?,
        "task_id" => text(&t.task_id.as_ref().map(|t| t.expose().to_string())),
        "priority" => Val::Big(Some(i64::from(t.priority))),
        "run_at" => opt_time(op, t.run_at)?,
        "concurrency_key" => text(&t.concurrency_key),
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
///
/// [`Shared::insert_attempt`]: super::Shared::insert_attempt
pub(crate) fn attempt_row(op: &str, a: &Attempt) -> Result<Vec<Val>, Error> {
    let q = a.question.as_ref();
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
        label(q.map(|q| q.text.as_str())),
        figure(op, Some(a.usage.cost_micros))?,
        figure(op, Some(a.usage.input_tokens))?,
        figure(op, Some(a.usage.output_tokens))?,
        Val::Bytes(a.lease_token_hash.map(|h| h.0.to_vec())),
        Val::Text(late_text(&a.late_reports)),
        Val::Count(a.late_reports_total),
        label(q.and_then(|q| q.answer.as_deref())),
        opt_time(op, q.and_then(|q| q.answered_at))?,
        label(q.and_then(|q| q.answered_by.as_deref())),
        label(q.and_then(|q| q.answer_key.as_deref())),
    ])
}

/// A usage or budget figure as the `bigint` the tables store.
fn figure(op: &str, v: Option<u64>) -> Result<Val, Error> {
    v.map(|n| {
        i64::try_from(n)
            .map_err(|_| Error::invalid(format!("{op}: {n} is beyond what the store can hold")))
    })
    .transpose()
    .map(Val::Big)
}

/// Late reports as the JSON text the attempts table stores; `NULL` for none.
fn late_text(late: &[LateReport]) -> Option<String> {
    (!late.is_empty()).then(|| serde_json::to_string(late).unwrap_or_default())
}

/// The columns of a closed attempt that may still change (see `AttemptWrite::Amend`), after
/// the attempt's key (`todo_id`, `seq`): its late reports and the answer to its question.
pub(super) const ATTEMPT_AMENDED: std::ops::Range<usize> = 25..31;

/// The values of [`Shared::update_amend`].
///
/// [`Shared::update_amend`]: super::Shared::update_amend
pub(crate) fn amend_update(op: &str, a: &Attempt) -> Result<Vec<Val>, Error> {
    let mut row = attempt_row(op, a)?;
    row.truncate(ATTEMPT_AMENDED.end);
    row.drain(2..ATTEMPT_AMENDED.start);
    Ok(row)
}

/// The todo columns no transition changes (the store refuses a change to them, see
/// `ledger::run`); an update rewrites every other column, keyed by `id`.
const TODO_FIXED: &str = "id endpoint queue title kind source payload work_order assignee \
                          max_attempts created_at idempotency_key max_same_failures \
                          max_input_requests answer_within_ms task_id priority \
                          concurrency_key";

/// The positions in [`TODO_COLS`] of the columns an update rewrites.
pub(super) fn todo_updated() -> impl Iterator<Item = usize> {
    static UPDATED: LazyLock<Vec<usize>> = LazyLock::new(|| {
        (0..TODO_COLS.len())
            .filter(|&i| !TODO_FIXED.split_whitespace().any(|f| f == TODO_COLS[i]))
            .collect()
    });
    UPDATED.iter().copied()
}

/// The attempt columns a heartbeat or a close rewrites (`last_heartbeat_at` to
/// `usage_output_tokens` of [`ATTEMPT_COLS`]), after its two key columns (`todo_id`, `seq`).
pub(super) const ATTEMPT_REWRITTEN: std::ops::Range<usize> = 9..24;

/// `col = ?n, …` for `cols`, numbered from `from`.
pub(super) fn set_list(mark: char, cols: &[&str], from: usize) -> String {
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
///
/// [`Shared::update_open_attempt`]: super::Shared::update_open_attempt
pub(crate) fn attempt_update(op: &str, a: &Attempt) -> Result<Vec<Val>, Error> {
    let mut row = attempt_row(op, a)?;
    row.truncate(ATTEMPT_REWRITTEN.end);
    row.drain(2..ATTEMPT_REWRITTEN.start);
    Ok(row)
}

/// An endpoint row's values in [`ENDPOINT_COLS`] order, for [`Shared::insert_endpoint`].
///
/// [`Shared::insert_endpoint`]: super::Shared::insert_endpoint
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
