//! The time-driven transitions: the reaper's (a lapsed lease) and the retry sweep's (a retry or
//! a delayed todo come due, a deadline or an answer's wait passed).

use super::{AttemptWrite, Change, Leaves, close, consistent, dead_letter, unlease};
use crate::error::Error;
use crate::ledger::types::{Attempt, DeadLetterReason, Outcome, Todo, TodoState};
use crate::time::Millis;

/// The reaper's transition for one todo: a lapsed lease is closed `reaped`, and the todo goes
/// back to pending, or to a dead letter when it has no attempts left or its deadline has passed.
/// `None` when the lease is
/// still valid (or the todo is not claimed): the reaper lost the race and does nothing.
pub fn reap(now: Millis, todo: &Todo, open: Option<&Attempt>) -> Result<Option<Change>, Error> {
    let op = "reap";
    let Some(open) = consistent(op, todo, open)? else {
        return Ok(None);
    };
    if todo.lease_valid_at(now) {
        return Ok(None);
    }
    let mut change = Change::new(todo.clone());
    let reason = if todo.attempt >= todo.max_attempts {
        Some(DeadLetterReason::AttemptsExhausted)
    } else if todo.past_deadline(now) {
        Some(DeadLetterReason::Deadline)
    } else {
        None
    };
    let leaves = match reason {
        Some(r) => {
            dead_letter(&mut change.todo, r, now);
            Leaves::DeadLettered(r)
        }
        None => {
            unlease(&mut change.todo, TodoState::Pending, now);
            change.todo.next_retry_at = None;
            Leaves::Requeued
        }
    };
    change.writes.push(AttemptWrite::Update(close(
        op,
        open,
        now,
        Outcome::Reaped,
        leaves,
    )?));
    Ok(Some(change))
}

/// The retry sweep for one todo: a todo past its deadline that could still be claimed (pending,
/// waiting for an answer, or failed with a retry scheduled) becomes a dead letter (`deadline`),
/// as does one whose question went unanswered past `answer_due_at` (`no_answer`); otherwise a
/// failed todo whose retry is due goes back to pending. Ends no lease, writes no attempt.
pub fn requeue_due(now: Millis, todo: &Todo) -> Option<Change> {
    let waiting = matches!(todo.state, TodoState::Pending | TodoState::InputRequired)
        || (todo.state == TodoState::Failed && todo.next_retry_at.is_some());
    let unanswered = todo.state == TodoState::InputRequired
        && todo.asking.answer_due_at.is_some_and(|d| d <= now);
    let reason = if waiting && todo.past_deadline(now) {
        Some(DeadLetterReason::Deadline)
    } else if unanswered {
        Some(DeadLetterReason::NoAnswer)
    } else {
        None
    };
    if let Some(r) = reason {
        let mut change = Change::new(todo.clone());
        dead_letter(&mut change.todo, r, now);
        return Some(change);
    }
    let due = todo.state == TodoState::Failed
        && todo.next_retry_at.is_some_and(|t| t <= now)
        && todo.attempt < todo.max_attempts;
    // A delayed todo whose `run_at` has come is claimable already (see [`claimable`]); the
    // sweep clears the instant so that the change rings the doorbell for it, as a due retry's
    // does. Clearing it also keeps the stores' index of waiting delayed todos small.
    let came = todo.state == TodoState::Pending && todo.run_at.is_some_and(|t| t <= now);
    (due || came).then(|| {
        let mut change = Change::new(todo.clone());
        change.todo.state = TodoState::Pending;
        change.todo.next_retry_at = None;
        change.todo.run_at = None;
        change.todo.updated_at = now;
        change
    })
}
