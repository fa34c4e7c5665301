//! Reports that come after their attempt closed: a repeat of one already applied (its answer was
//! lost) answers what the first did; a late one is only noted on the attempt it belonged to.

use serde_json::Value;

use super::{Actor, AttemptWrite, Change, LedgerConfig, unlease};
use crate::bounds;
use crate::error::Error;
use crate::ledger::types::{
    Attempt, Disposition, LATE_REPORTS_KEPT, LATE_SUMMARY_MAX_BYTES, LateReport, Outcome, Todo,
    TodoState, TokenHash,
};
use crate::time::Millis;

/// Who sent a report, under which lease token, and what it said: what ties a repeated or late
/// report to the closed attempt it belongs to.
#[derive(Clone, Copy, Debug)]
pub struct Reporter<'a> {
    pub actor: &'a Actor,
    /// The SHA-256 of the lease token the report presented, if any.
    pub token_hash: Option<TokenHash>,
    pub outcome: Outcome,
}

impl<'a> Reporter<'a> {
    pub fn new(actor: &'a Actor, token_hash: Option<TokenHash>, outcome: Outcome) -> Self {
        Reporter {
            actor,
            token_hash,
            outcome,
        }
    }

    /// Whether any of `todo`'s attempts can be this reporter's: only a fenced report by an
    /// endpoint that sees the todo can. A report without a fence cannot be told from anyone
    /// else's; an operator holds no lease; a stranger's report matches nothing.
    pub fn may_own(&self, todo: &Todo) -> bool {
        matches!(self.actor, Actor::Endpoint { .. })
            && self.token_hash.is_some()
            && self.actor.sees(todo)
    }

    /// The closed attempt among `attempts` this reporter's lease opened: claimed by this same
    /// endpoint under this same token (`None` unless [`Reporter::may_own`]).
    fn attempt<'b>(
        &self,
        todo: &Todo,
        attempts: impl IntoIterator<Item = &'b Attempt>,
    ) -> Option<&'b Attempt> {
        let Actor::Endpoint { endpoint, .. } = self.actor else {
            return None;
        };
        if !self.may_own(todo) {
            return None;
        }
        attempts.into_iter().find(|a| {
            !a.is_open()
                && a.lease_token_hash == self.token_hash
                && a.claimer_endpoint.as_ref() == Some(endpoint)
        })
    }
}

/// The answer to a report its transition refused with `refused`: when the refusal is a
/// `conflict` and the report repeats one the caller already made (its answer was lost), the
/// answer is what the first report answered, and nothing changes; otherwise the refusal stands.
/// A repeat is recognised when one of the todo's recent closed attempts (`recent`; the newest
/// [`PRIOR_ATTEMPTS`] are enough: a holder stops repeating at its lease deadline) was opened by
/// `by`'s lease and closed with its outcome. `result` is the repeated report's result.
///
/// [`PRIOR_ATTEMPTS`]: crate::ledger::PRIOR_ATTEMPTS
pub fn replay<'a>(
    cfg: &LedgerConfig,
    refused: Error,
    todo: &Todo,
    recent: impl IntoIterator<Item = &'a Attempt>,
    by: Reporter<'_>,
    result: Option<&Value>,
) -> Result<Todo, Error> {
    if refused.code != crate::ErrorCode::Conflict {
        return Err(refused);
    }
    match by.attempt(todo, recent) {
        Some(a) if a.outcome == Some(by.outcome) => Ok(as_reported(cfg, todo, a, result)),
        _ => Err(refused),
    }
}

/// The todo as the report that closed `a` left it, rebuilt from the attempt: the todo may have
/// moved on since (an operator's retry or cancel, a requeue, another claim), and the repeat must
/// answer what the first report did (a dead letter stays one). The worker's transitions
/// ([`super`]) are the rules this mirrors: the lease is dropped at the close, a fail's retry is
/// `backoff` after it.
fn as_reported(cfg: &LedgerConfig, todo: &Todo, a: &Attempt, result: Option<&Value>) -> Todo {
    let ended = a.ended_at.unwrap_or(a.claimed_at);
    let mut t = todo.clone();
    let state = match (a.outcome, a.disposition) {
        (_, Some(Disposition::DeadLettered)) => TodoState::Failed,
        (Some(Outcome::Completed), _) => TodoState::Done,
        (Some(Outcome::Released), _) => TodoState::Pending,
        (Some(Outcome::NeedsInput), _) => TodoState::InputRequired,
        _ => TodoState::Failed,
    };
    unlease(&mut t, state, ended);
    t.attempts_total = a.seq;
    t.claimed_at = Some(a.claimed_at);
    t.attempt = a.attempt;
    t.next_retry_at = None;
    match a.outcome {
        Some(Outcome::Released | Outcome::NeedsInput) => t.attempt = a.attempt.saturating_sub(1),
        _ => t.result = result.cloned(),
    }
    match a.disposition {
        Some(Disposition::RetryScheduled) => {
            t.next_retry_at = Some(ended + cfg.backoff.delay(&t.id, a.seq, a.attempt));
        }
        Some(Disposition::AwaitingInput) => {
            t.asking.answer_due_at = t.asking.answer_within.map(|w| ended.saturating_add(w));
        }
        _ => {}
    }
    t.dead_letter_reason = a.dead_letter_reason;
    t
}

/// Records a report refused as stale on the closed attempt it belongs to: one of `retained` (the
/// todo's closed attempts) that `by`'s lease opened. `None` when there is none (an unfenced
/// report, an operator's, a stranger's): nothing is recorded. The todo row is left exactly as it
/// is; only the attempt's late reports change.
pub fn note_late<'a>(
    now: Millis,
    todo: &Todo,
    retained: impl IntoIterator<Item = &'a Attempt>,
    by: Reporter<'_>,
    summary: Option<&str>,
) -> Option<Change> {
    let closed = by.attempt(todo, retained)?;
    let mut a = closed.clone();
    a.late_reports_total = a.late_reports_total.saturating_add(1);
    if a.late_reports.len() < LATE_REPORTS_KEPT {
        a.late_reports.push(LateReport {
            at: now,
            outcome: by.outcome,
            summary: summary
                .map(|s| bounds::cut_at_char_boundary(s, LATE_SUMMARY_MAX_BYTES).to_string()),
        });
    }
    let mut change = Change::new(todo.clone());
    change.writes.push(AttemptWrite::Amend(a));
    Some(change)
}
