//! The operator's transitions: a manual retry, a cancel, a revoke of an endpoint, and the checks
//! on pausing a queue and changing its limits.

use super::{Actor, AttemptWrite, Change, Leaves, close, consistent, dead_letter, scoped, unlease};
use crate::error::Error;
use crate::ledger::types::{Attempt, Budget, DeadLetterReason, Outcome, Todo, TodoState};
use crate::ledger::{Limits, LimitsChange, finished, valid_queue_name};
use crate::time::Millis;

/// The operator's manual retry: back to pending with a fresh attempt and question budget, and
/// without a deadline (the operator's decision replaces the time budget) or a spend budget it
/// has reached.
///
/// A todo canceled (or revoked) while claimed is retried only once that attempt's lease has
/// lapsed: its holder learns of the cancel at its next heartbeat and may run until then, and a
/// retry that let another claimer in sooner would have two workers on one todo. `newest` is the
/// todo's newest attempt.
pub fn retry(
    now: Millis,
    todo: &Todo,
    newest: Option<&Attempt>,
    actor: &Actor,
) -> Result<Change, Error> {
    let op = "retry";
    scoped(op, todo, actor)?;
    if todo.task_id.is_some() && finished(todo) {
        return Err(Error::conflict(format!(
            "{op} {}: the todo is an MCP task that has ended ({}), and a task's end is final: its \
             client may already have taken the result; add the work again as a new todo",
            todo.id, todo.state
        )));
    }
    if let Some(a) = newest
        && matches!(a.outcome, Some(Outcome::Canceled | Outcome::Revoked))
        && now < a.lease_expires_at
    {
        return Err(Error::conflict(format!(
            "{op} {}: attempt {} was {} while its holder may still be running; retry at or \
             after {} (when its lease lapses)",
            todo.id,
            a.seq,
            a.outcome.map_or("closed", Outcome::as_str),
            crate::time::rfc3339(a.lease_expires_at)
        )));
    }
    match todo.state {
        TodoState::Failed | TodoState::Done | TodoState::Canceled => {}
        TodoState::Pending | TodoState::Claimed | TodoState::InputRequired => {
            return Err(Error::conflict(format!(
                "{op} {}: todo is {}; only failed, done or canceled todos can be retried{}",
                todo.id,
                todo.state,
                match todo.state {
                    TodoState::Claimed => " (cancel it first to stop the current attempt)",
                    TodoState::InputRequired => " (answer its question, or cancel it)",
                    _ => "",
                }
            )));
        }
    }
    let mut change = Change::new(todo.clone());
    let t = &mut change.todo;
    t.state = TodoState::Pending;
    t.attempt = 0;
    t.next_retry_at = None;
    t.result = None;
    t.updated_at = now;
    t.dead_letter_reason = None;
    t.deadline_at = None;
    t.asking.requests = 0;
    // Retrying a todo whose spend reached its budget is the operator's decision to spend more:
    // the budget is lifted, as the deadline is. A budget not yet reached stays.
    if t.over_budget() {
        t.budget = Budget::default();
    }
    Ok(change)
}

/// Who may pause or resume a queue, and which names: only the operator (an endpoint is
/// `forbidden`), and only a valid queue name (a queue need hold no todo to be paused, so that an
/// operator can stop one before its work arrives).
pub fn pause(actor: &Actor, queue: &str, paused: bool) -> Result<(), Error> {
    let op = if paused { "pause" } else { "resume" };
    operator_on_queue(op, actor, queue)
}

/// Checks a change of a queue's limits: the operator's (`relay queue set`), on a queue name, and
/// the limits it leaves in their bounds. Answers them.
pub fn set_limits(
    actor: &Actor,
    queue: &str,
    before: Limits,
    change: &LimitsChange,
) -> Result<Limits, Error> {
    let op = "set";
    operator_on_queue(op, actor, queue)?;
    let after = change.apply(before);
    after
        .check()
        .map_err(|e| Error::invalid(format!("queue set {queue}: {e}")))?;
    Ok(after)
}

/// Only an operator changes a queue (`relay queue <op>` or the Board), and only a valid name.
fn operator_on_queue(op: &str, actor: &Actor, queue: &str) -> Result<(), Error> {
    if let Actor::Endpoint { endpoint, .. } = actor {
        return Err(Error::forbidden(format!(
            "{op} {queue}: endpoint {endpoint} may not {op} queues; only an operator may \
             (`relay queue {op}` or the Board)"
        )));
    }
    if !valid_queue_name(queue) {
        return Err(Error::invalid(format!(
            "{op}: queue {queue:?} is not a queue name (a letter or digit, then up to 63 \
             letters, digits, '_', '-' or '.')"
        )));
    }
    Ok(())
}

/// Cancels the todo; an open attempt is closed `canceled`/`canceled`. A done or canceled todo
/// is a `conflict`, and so is an MCP task's dead letter (a task's end is final).
pub fn cancel(
    now: Millis,
    todo: &Todo,
    open: Option<&Attempt>,
    actor: &Actor,
) -> Result<Change, Error> {
    let op = "cancel";
    scoped(op, todo, actor)?;
    let open = consistent(op, todo, open)?;
    if matches!(todo.state, TodoState::Done | TodoState::Canceled) {
        return Err(Error::conflict(format!(
            "{op} {}: todo is already {}; nothing to cancel",
            todo.id, todo.state
        )));
    }
    // A dead letter is a task's end (`completed`, as an error), as final as done: canceling it
    // would change the status its client may already have taken, as a retry would.
    if todo.task_id.is_some() && todo.dead_letter() {
        return Err(Error::conflict(format!(
            "{op} {}: the todo is an MCP task that has ended (a dead letter), and a task's end is \
             final: its client may already have taken the result",
            todo.id
        )));
    }
    let mut change = Change::new(todo.clone());
    unlease(&mut change.todo, TodoState::Canceled, now);
    change.todo.next_retry_at = None;
    if let Some(open) = open {
        let mut a = close(op, open, now, Outcome::Canceled, Leaves::Canceled)?;
        a.closed_by = actor.closed_by();
        change.writes.push(AttemptWrite::Update(a));
    }
    Ok(change)
}

/// Revoking the owning endpoint: a claimed todo's attempt is closed `revoked` and the todo is
/// dead-lettered. `None` for a todo that is not claimed (it is left as it is).
pub fn revoke(now: Millis, todo: &Todo, open: Option<&Attempt>) -> Result<Option<Change>, Error> {
    let op = "revoke";
    let Some(open) = consistent(op, todo, open)? else {
        return Ok(None);
    };
    let mut change = Change::new(todo.clone());
    dead_letter(&mut change.todo, DeadLetterReason::Revoked, now);
    change.writes.push(AttemptWrite::Update(close(
        op,
        open,
        now,
        Outcome::Revoked,
        Leaves::DeadLettered(DeadLetterReason::Revoked),
    )?));
    Ok(Some(change))
}
