//! A question an attempt asks a person, and the answer that makes its todo pending again.

use super::{
    Actor, AttemptWrite, Change, Leaves, LedgerConfig, Report, close_reported, dead_letter, held,
    report_text, scoped, spend, unclaimable, unlease,
};
use crate::bounds;
use crate::error::Error;
use crate::ledger::types::{Attempt, DeadLetterReason, Outcome, Question, Todo, TodoState};
use crate::ledger::{IDEMPOTENCY_KEY_MAX_BYTES, check_idempotency_key};
use crate::time::Millis;

/// The longest answer, in bytes: a longer one is refused. (A question is cut like a summary.)
pub const ANSWER_MAX_BYTES: usize = 8 * 1024;

/// The attempt asks a human and stops: it closes `needs_input`/`awaiting_input` with its
/// question (cut and cleaned like a summary), and the todo waits in `input_required`, without a
/// lease, until an answer makes it pending again (or `answer_within` passes: `no_answer`).
/// Asking does not count against `max_attempts` (like a release); the questions have their own
/// budget, `max_input_requests`: a question past it dead-letters the todo
/// (`input_requests_exhausted`), as do a spend at the budget and a passed deadline.
#[allow(clippy::too_many_arguments)]
pub fn request_input(
    cfg: &LedgerConfig,
    now: Millis,
    todo: &Todo,
    open: Option<&Attempt>,
    actor: &Actor,
    question: &str,
    report: &Report,
) -> Result<Change, Error> {
    let op = "request_input";
    if question.trim().is_empty() {
        return Err(Error::invalid(format!(
            "{op} {}: question must not be empty; say what the human should answer",
            todo.id
        )));
    }
    let text = report_text(cfg, op, &todo.id, report)?;
    let mut open = held(op, now, todo, open, actor, report.token_hash)?.clone();
    let mut change = Change::new(todo.clone());
    let t = &mut change.todo;
    spend(t, &mut open, report.usage);
    t.attempt = t.attempt.saturating_sub(1);
    let reason = if t.asking.requests >= t.asking.max_requests {
        Some(DeadLetterReason::InputRequestsExhausted)
    } else {
        unclaimable(now, t)
    };
    let leaves = match reason {
        Some(r) => {
            dead_letter(t, r, now);
            Leaves::DeadLettered(r)
        }
        None => {
            unlease(t, TodoState::InputRequired, now);
            t.next_retry_at = None;
            t.asking.requests += 1;
            t.asking.answer_due_at = t.asking.answer_within.map(|w| now.saturating_add(w));
            Leaves::AwaitingInput
        }
    };
    let mut closed = close_reported(op, (&open, actor), now, Outcome::NeedsInput, leaves, text)?;
    closed.question = Some(Question {
        text: bounds::bound_summary(question).0,
        answer: None,
        answered_at: None,
        answered_by: None,
        answer_key: None,
    });
    change.writes.push(AttemptWrite::Update(closed));
    Ok(change)
}

/// Who answered, as an attempt records it: `endpoint:<name>` or `operator:<name>`.
pub fn answered_by(actor: &Actor) -> String {
    match actor {
        Actor::Endpoint { endpoint, .. } => format!("endpoint:{endpoint}"),
        Actor::Operator { name } => format!("operator:{name}"),
    }
}

/// Answers the question a waiting todo's newest attempt asked: the answer is kept on that
/// attempt (with when and by whom) and the todo is pending again. An answer to a todo that is
/// not waiting is a `conflict` and changes nothing, except the repeat of an answer already
/// given with the same `key` by the same caller (its answer was lost on the way back): that
/// answers `Ok(None)`, nothing to write. An answer to the question of attempt `seq` (a task's
/// input request names it) is a `conflict` too once the todo waits on another attempt's
/// question: that one was answered meanwhile, and this answer is not for the new one. `recent`
/// is the todo's newest closed attempts, newest first.
pub fn answer(
    now: Millis,
    todo: &Todo,
    recent: &[Attempt],
    actor: &Actor,
    text: &str,
    key: Option<&str>,
    seq: Option<u32>,
) -> Result<Option<Change>, Error> {
    let op = "answer_todo";
    scoped(op, todo, actor)?;
    if text.trim().is_empty() || text.len() > ANSWER_MAX_BYTES {
        return Err(Error::invalid(format!(
            "{op} {}: answer must be 1 to {ANSWER_MAX_BYTES} bytes of text; got {} bytes \
             (link to anything longer)",
            todo.id,
            text.len()
        )));
    }
    if let Some(k) = key {
        check_idempotency_key(k).map_err(|_| {
            Error::invalid(format!(
                "{op} {}: idempotency_key must be 1 to {} bytes without control characters",
                todo.id, IDEMPOTENCY_KEY_MAX_BYTES
            ))
        })?;
    }
    let by = answered_by(actor);
    if todo.state != TodoState::InputRequired {
        let repeat = key.is_some()
            && recent.iter().any(|a| {
                a.question.as_ref().is_some_and(|q| {
                    q.answer_key.as_deref() == key && q.answered_by.as_deref() == Some(&by)
                })
            });
        if repeat {
            return Ok(None);
        }
        return Err(Error::conflict(format!(
            "{op} {}: todo is {}, not waiting for an answer; nothing to answer",
            todo.id, todo.state
        )));
    }
    if let Some(seq) = seq
        && seq != todo.attempts_total
    {
        return Err(Error::conflict(format!(
            "{op} {}: the question of attempt {seq} was answered meanwhile, and attempt {} asked \
             another; nothing to answer",
            todo.id, todo.attempts_total
        )));
    }
    let asked = recent
        .first()
        .filter(|a| a.seq == todo.attempts_total && a.outcome == Some(Outcome::NeedsInput))
        .filter(|a| a.question.as_ref().is_some_and(|q| q.answer.is_none()));
    let Some(asked) = asked else {
        return Err(Error::internal(format!(
            "{op} {}: todo is input_required but its newest attempt holds no open question",
            todo.id
        )));
    };
    let mut a = asked.clone();
    let at = now.max(a.ended_at.unwrap_or(a.claimed_at));
    if let Some(q) = a.question.as_mut() {
        q.answer = Some(text.chars().filter(|c| bounds::prose_char(*c)).collect());
        q.answered_at = Some(at);
        q.answered_by = Some(by);
        q.answer_key = key.map(str::to_string);
    }
    let mut change = Change::new(todo.clone());
    let t = &mut change.todo;
    t.state = TodoState::Pending;
    t.asking.answer_due_at = None;
    t.updated_at = now;
    change.writes.push(AttemptWrite::Amend(a));
    Ok(Some(change))
}
