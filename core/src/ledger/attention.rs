//! The attention item of a dead letter: a short text, composed only from stored fields, that
//! tells an operator what was tried, how each attempt ended, and why no further automatic
//! attempt will be made.

use std::fmt::Write as _;

use super::TodoView;
use super::types::{Attempt, DeadLetterReason, Outcome};
use crate::bounds::cut_at_char_boundary;
use crate::time::rfc3339;

/// The longest attention text, in bytes.
pub const ATTENTION_MAX_BYTES: usize = 1024;
/// How many attempts the text lists (newest first); the rest are counted.
const LISTED: usize = 5;
/// How much of an attempt's summary (its first line) the text quotes.
const QUOTED: usize = 80;

/// The attention text of a dead letter, `None` for any other todo. Bounded by
/// [`ATTENTION_MAX_BYTES`], cut at a character boundary.
pub fn attention(view: &TodoView) -> Option<String> {
    let t = &view.todo;
    let reason = t.dead_letter_reason?;
    let why = match reason {
        DeadLetterReason::AttemptsExhausted => {
            format!("all {} attempts of its budget were used", t.max_attempts)
        }
        DeadLetterReason::NonRetryable => {
            "the last failure was reported as not retryable (retryable: false); retrying \
             would repeat it or compound its side effects"
                .to_string()
        }
        DeadLetterReason::Deadline => format!(
            "its deadline{} passed before another attempt could start",
            t.deadline_at
                .map(|d| format!(" ({})", rfc3339(d)))
                .unwrap_or_default()
        ),
        DeadLetterReason::RepeatedFailure => format!(
            "the newest {} failed attempts reported the same failure signature: the same \
             failure again, without new evidence",
            t.max_same_failures
        ),
        DeadLetterReason::Revoked => {
            "its endpoint was revoked while an attempt held it".to_string()
        }
        DeadLetterReason::InputRequestsExhausted => format!(
            "an attempt asked for input after the {} question{} its budget allows",
            t.asking.max_requests,
            if t.asking.max_requests == 1 { "" } else { "s" }
        ),
        DeadLetterReason::NoAnswer => format!(
            "its question was not answered within {} s",
            t.asking.answer_within.unwrap_or(0) / 1000
        ),
        DeadLetterReason::BudgetExhausted => format!(
            "its attempts spent {} against a budget of {}",
            t.spent.describe(),
            t.budget.describe()
        ),
    };
    let mut s = format!(
        "Dead letter ({reason}): {why}. Tried {} attempt{}",
        view.attempts_total,
        if view.attempts_total == 1 { "" } else { "s" }
    );
    for (i, a) in view.attempts.iter().take(LISTED).enumerate() {
        s.push_str(if i == 0 { ": " } else { "; " });
        ended(&mut s, a);
    }
    let unlisted = view.attempts_total as usize - view.attempts.len().min(LISTED);
    if unlisted > 0 {
        let _ = write!(s, "; {unlisted} earlier not shown");
    }
    if !t.spent.is_zero() && reason != DeadLetterReason::BudgetExhausted {
        let _ = write!(s, ". Spent {}", t.spent.describe());
    }
    s.push_str(if t.task_id.is_some() {
        // A task's end is final (`transition::retry`): its client adds the work again.
        ". The task has ended; to try again, add the work as a new task."
    } else {
        ". An operator's retry starts a fresh budget."
    });
    Some(cut_at_char_boundary(&s, ATTENTION_MAX_BYTES).to_string())
}

/// `#3 failed [sig abc] "first line of the summary"`, or how else it ended.
fn ended(s: &mut String, a: &Attempt) {
    let how = match a.outcome {
        None => "still open",
        Some(Outcome::LeaseExpired) => "died (lease lapsed, taken over)",
        Some(Outcome::Reaped) => "died (lease lapsed, reaped)",
        Some(o) => o.as_str(),
    };
    let _ = write!(s, "#{} {how}", a.seq);
    if let Some(sig) = &a.failure_signature {
        let _ = write!(s, " [signature {}]", cut_at_char_boundary(sig, 16));
    }
    if let Some(line) = a.summary.as_deref().and_then(|x| x.lines().next()) {
        let _ = write!(s, " \"{}\"", cut_at_char_boundary(line.trim(), QUOTED));
    }
    if let Some(q) = &a.question {
        let line = q.text.lines().next().unwrap_or_default();
        let _ = write!(
            s,
            " asked \"{}\"",
            cut_at_char_boundary(line.trim(), QUOTED)
        );
        if q.answer.is_none() {
            s.push_str(" (unanswered)");
        }
    }
    if a.late_reports_total > 0 {
        let _ = write!(s, " (then {} late report(s))", a.late_reports_total);
    }
}
