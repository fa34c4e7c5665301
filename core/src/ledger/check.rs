//! The invariants of one todo and its attempts, as [`Ledger::check`](super::Ledger::check) and
//! the stores' tests hold them.

use super::{
    ANSWER_MAX_BYTES, Attempt, Disposition, LATE_REPORTS_KEPT, LATE_SUMMARY_MAX_BYTES,
    MAX_INPUT_REQUESTS_MAX, MAX_SAME_FAILURES_MAX, Outcome, PRIORITY_MAX, PRIORITY_MIN,
    SIGNATURE_MAX_BYTES, Todo, TodoState, Usage, check_idempotency_key,
};
use crate::Millis;

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

crate::names! {
    /// How a closed attempt's end broke its lease (see [`lease_breach`]).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum LeaseBreach {
        /// It died (`lease_expired`, `reaped`) while its lease still ran.
        DiedEarly => "died_early",
        /// Its holder's report closed it once the lease had run out: a stale token's write.
        StaleWrite => "stale_write",
    }
}

/// The lease rule of one close, on the server's clock (the one every stamp comes from). A lease
/// is valid strictly before `lease_expires_at`: an attempt dies at that instant or later, never
/// before, and its holder's report (completed, failed, released) closes it only before. An
/// operator's close (`by_operator`: the attempt's `closed_by` is set) is not the holder's and may
/// come at any time. A close is stamped no earlier than its claim, so after a clock stepped back
/// a report accepted in time can read as ending at `claimed_at`, at or past a lease a heartbeat
/// set on the stepped clock: a close at its claim's instant is never called stale. [`check_todo`]
/// holds every closed attempt to this, and the fault tests' history checker holds the rows it
/// reads back from the database.
pub fn lease_breach(
    outcome: Outcome,
    (claimed_at, ended): (Millis, Millis),
    lease_expires_at: Millis,
    by_operator: bool,
) -> Option<LeaseBreach> {
    let lapsed = ended >= lease_expires_at;
    let holders = matches!(
        outcome,
        Outcome::Completed | Outcome::Failed | Outcome::Released
    );
    if outcome.died() && !lapsed {
        Some(LeaseBreach::DiedEarly)
    } else if holders && lapsed && ended > claimed_at && !by_operator {
        Some(LeaseBreach::StaleWrite)
    } else {
        None
    }
}

/// The invariants of one todo and its attempts (oldest first). Shared by [`Ledger::check`] and
/// the stores' tests, which read rows back from SQL and hold them to the same rules.
///
/// [`Ledger::check`]: super::Ledger::check
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
        if let (Some(outcome), Some(ended)) = (a.outcome, a.ended_at)
            && let Some(breach) = lease_breach(
                outcome,
                (a.claimed_at, ended),
                a.lease_expires_at,
                a.closed_by.is_some(),
            )
        {
            return Err(format!(
                "attempt {}: {breach}: closed {outcome} at {ended} with the lease until {}",
                a.seq, a.lease_expires_at
            ));
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
