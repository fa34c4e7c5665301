//! Every lifecycle rule of a todo, as pure functions over one todo's state.
//!
//! Each transition takes the todo row and its open attempt (if any) as they are now, and returns
//! the new row plus the attempt writes that go with it ([`Change`]). The in-memory
//! [`Ledger`](super::Ledger) applies a change to its maps; a SQL store applies the same change
//! inside one transaction (read the row, call the transition, write the result). So the rules
//! live here once, and the stores only decide which row a `claim_next` looks at.
//!
//! This file holds the worker's transitions (a claim, a heartbeat, the three reports) and the
//! closing rules they share; the others are beside it, by who drives them, and re-exported
//! here: a question asked and answered (`asking`), the reaper and the retry sweep (`sweep`),
//! reports that come after their attempt closed (`stale`), and the operator's (`operator`).
//!
//! Choices this module makes where the design leaves room (each as Temporal/SQS users expect):
//! - A lease is valid strictly before `lease_expires_at`. From that instant on, the holder's
//!   heartbeat and reports are refused with `conflict`: a lapsed lease is suspect, and the
//!   attempt will be recorded as having died (by a takeover or the reaper), never revived.
//! - `release` gives the todo back unworked: the attempt row is closed `released`/`requeued`,
//!   and the todo's `attempt` counter is decremented, so a release (e.g. a worker shutting down)
//!   does not burn one of `max_attempts`. `attempts_total` still counts it (seq is history).
//! - A manual retry is allowed from `failed`, `done` and `canceled`; it resets `attempt` to 0
//!   and clears `result` and `next_retry_at`, and never touches `attempts_total`.
//! - Cancel is allowed from `pending`, `claimed` and `failed`.
//! - A fenced report is idempotent: repeated under the same lease token after it was applied
//!   (its answer was lost on the way back), it answers what the first report answered (the
//!   todo as that report left it, even if it has moved on since) and changes nothing
//!   ([`replay`]). Without a fence a repeat cannot be told from a stranger's report, so
//!   it answers `conflict`.

use serde_json::Value;

use super::backoff::Backoff;
use super::types::{
    Attempt, ClaimerKind, DeadLetterReason, Disposition, Outcome, Todo, TodoState, TokenHash, Usage,
};
use crate::bounds;
use crate::error::Error;
use crate::time::Millis;

mod asking;
mod operator;
mod stale;
mod sweep;

pub use asking::{ANSWER_MAX_BYTES, answer, answered_by, request_input};
pub use operator::{cancel, pause, retry, revoke, set_limits};
pub use stale::{Reporter, note_late, replay};
pub use sweep::{reap, requeue_due};

/// Settings of the queue side that change what a transition does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LedgerConfig {
    /// Closed attempts kept per todo (the newest ones, the open one included). Default 100.
    pub attempts_cap: u32,
    /// Derive a missing summary from the compact JSON of `result`. Default off: results were
    /// never shown to later claimers, so turning this on is the operator's explicit choice.
    pub summary_from_result: bool,
    pub backoff: Backoff,
}

impl Default for LedgerConfig {
    fn default() -> Self {
        LedgerConfig {
            attempts_cap: 100,
            summary_from_result: false,
            backoff: Backoff::default(),
        }
    }
}

/// Who is asking. Endpoints are scoped to their own todos and must hold the lease (and present
/// the fence) to touch a claimed todo; the owning operator sees every todo and skips both.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Actor {
    Endpoint {
        endpoint: String,
        /// The MCP session id, recorded on the attempts it opens.
        session: Option<String>,
    },
    /// The owning human, by name: an operator of the Board, or `cli` at the command line. The
    /// name is recorded on the attempts it closes (`closed_by`).
    Operator { name: String },
}

/// The owner identity an operator's claims are recorded under.
pub const OPERATOR_OWNER: &str = "operator";
/// The name the command line's operator actions are recorded under.
pub const CLI_OPERATOR: &str = "cli";

impl Actor {
    pub fn endpoint(name: impl Into<String>) -> Actor {
        Actor::Endpoint {
            endpoint: name.into(),
            session: None,
        }
    }

    /// The operator `name` (of the Board).
    pub fn operator(name: impl Into<String>) -> Actor {
        Actor::Operator { name: name.into() }
    }

    /// The operator at the command line (`relay todo …`, `relay queue …`), named
    /// [`CLI_OPERATOR`].
    pub fn cli() -> Actor {
        Actor::operator(CLI_OPERATOR)
    }

    /// Who an attempt this actor closes is recorded as closed by: the operator's name; `None`
    /// for an endpoint (its report is the attempt's own end).
    pub fn closed_by(&self) -> Option<String> {
        match self {
            Actor::Endpoint { .. } => None,
            Actor::Operator { name } => Some(name.clone()),
        }
    }

    /// The identity that holds a lease this actor takes.
    pub fn owner(&self) -> &str {
        match self {
            Actor::Endpoint { endpoint, .. } => endpoint,
            Actor::Operator { .. } => OPERATOR_OWNER,
        }
    }

    /// Whether the todo is in this actor's scope. Outside it, a todo does not exist.
    pub fn sees(&self, todo: &Todo) -> bool {
        match self {
            Actor::Endpoint { endpoint, .. } => &todo.endpoint == endpoint,
            Actor::Operator { .. } => true,
        }
    }
}

/// What a claim asks for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClaimOpts {
    pub ttl: Millis,
    pub claimant: Option<String>,
    /// The SHA-256 of the fence token the server made, when the claim asked for a fence.
    pub token_hash: Option<TokenHash>,
}

impl ClaimOpts {
    /// A claim for `ttl` fenced by the token whose hash is `token_hash`, naming no claimant.
    pub fn fenced(ttl: Millis, token_hash: TokenHash) -> ClaimOpts {
        ClaimOpts {
            ttl,
            claimant: None,
            token_hash: Some(token_hash),
        }
    }
}

/// What a report (complete, fail) carries.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Report {
    pub result: Option<Value>,
    pub summary: Option<String>,
    pub artifact: Option<String>,
    /// The SHA-256 of the lease token the caller presented, if any.
    pub token_hash: Option<TokenHash>,
    /// A fail's failure class: `Some(false)` dead-letters at once, whatever attempts remain.
    /// Absent means retryable. A complete ignores it.
    pub retryable: Option<bool>,
    /// A fail's signature of its failure (at most [`super::SIGNATURE_MAX_BYTES`]): the same
    /// signature on the newest `max_same_failures` failed attempts dead-letters the todo.
    pub failure_signature: Option<String>,
    /// What the attempt has spent so far, by its holder's count (see `spend`).
    pub usage: Option<Usage>,
}

impl Report {
    /// Whether a failure may be retried automatically (the default).
    pub fn retryable(&self) -> bool {
        self.retryable.unwrap_or(true)
    }
}

/// One write to the attempt rows of a todo.
#[derive(Clone, Debug, PartialEq)]
pub enum AttemptWrite {
    /// Insert a new open attempt.
    Open(Attempt),
    /// Rewrite the open attempt with this seq (a heartbeat, or its close). A store must update
    /// only a row that is still open, and treat "no row" as an internal error: that is how an
    /// attempt is closed exactly once.
    Update(Attempt),
    /// Delete closed attempts whose seq is at most this (the per-todo cap).
    PruneThrough(u32),
    /// Rewrite what may still change on the closed attempt with this seq (its late reports, the
    /// answer to its question), and nothing else of it. Like `Update`, it must touch exactly one
    /// row: a closed one.
    Amend(Attempt),
}

/// The result of a transition: the todo's new row and the attempt writes, applied together.
#[derive(Clone, Debug, PartialEq)]
pub struct Change {
    pub todo: Todo,
    pub writes: Vec<AttemptWrite>,
}

impl Change {
    fn new(todo: Todo) -> Change {
        Change {
            todo,
            writes: Vec::new(),
        }
    }
}

/// The error for an id that is unknown or outside the caller's scope (they look the same).
pub fn not_found(op: &str, id: &str) -> Error {
    Error::not_found(format!(
        "{op} {id}: no such todo for this endpoint; check the id (get_todo or list_todos)"
    ))
}

fn scoped(op: &str, todo: &Todo, actor: &Actor) -> Result<(), Error> {
    if actor.sees(todo) {
        Ok(())
    } else {
        Err(not_found(op, &todo.id))
    }
}

/// Checks that the open attempt agrees with the todo's state before a transition relies on it.
fn consistent<'a>(
    op: &str,
    todo: &Todo,
    open: Option<&'a Attempt>,
) -> Result<Option<&'a Attempt>, Error> {
    match (todo.state == TodoState::Claimed, open) {
        (true, Some(a)) if a.is_open() && a.seq == todo.attempts_total => Ok(Some(a)),
        (false, None) => Ok(None),
        (true, _) => Err(Error::internal(format!(
            "{op} {}: todo is claimed but its open attempt is missing or not the newest",
            todo.id
        ))),
        (false, Some(a)) => Err(Error::internal(format!(
            "{op} {}: todo is {} but attempt {} is still open",
            todo.id, todo.state, a.seq
        ))),
    }
}

/// Whether `claim_next` may take this todo: in scope and queue, assignee allows the actor, and
/// pending, or claimed with a lapsed lease (a takeover), or failed with its retry due, in both
/// latter cases only while attempts remain; never once the deadline has passed. This is the rule
/// the stores' SQL mirrors.
pub fn claimable(now: Millis, todo: &Todo, actor: &Actor, queues: Option<&[String]>) -> bool {
    actor.sees(todo)
        && !todo.past_deadline(now)
        && !todo.over_budget()
        && queues.is_none_or(|qs| qs.iter().any(|q| q == &todo.queue))
        && todo.assignee.as_deref().is_none_or(|a| a == actor.owner())
        && match todo.state {
            TodoState::Pending => todo.waits_until(now).is_none(),
            TodoState::Claimed => !todo.lease_valid_at(now) && todo.attempt < todo.max_attempts,
            TodoState::Failed => {
                todo.next_retry_at.is_some_and(|t| t <= now) && todo.attempt < todo.max_attempts
            }
            TodoState::Done | TodoState::Canceled | TodoState::InputRequired => false,
        }
}

/// The order `claim_next` takes claimable todos in, smallest first: a higher priority first,
/// then FIFO by `(created_at, id)`. The stores' `ORDER BY` and their FIFO index mirror it.
pub fn claim_order(todo: &Todo) -> (std::cmp::Reverse<i32>, Millis, &str) {
    (
        std::cmp::Reverse(todo.priority),
        todo.created_at,
        todo.id.as_str(),
    )
}

/// Validates a lease TTL in milliseconds: more than zero, at most a day.
pub fn check_ttl(op: &str, ttl: Millis) -> Result<(), Error> {
    if ttl == 0 || ttl > super::LEASE_TTL_MAX_SECS * 1000 {
        return Err(Error::invalid(format!(
            "{op}: lease_ttl_seconds must be between 1 and {}; got {} ms",
            super::LEASE_TTL_MAX_SECS,
            ttl
        )));
    }
    Ok(())
}

/// Claims the todo: closes a lapsed holder's attempt as `lease_expired`/`requeued` first, then
/// opens attempt `attempts_total + 1`, and prunes the oldest closed attempts past the cap.
pub fn claim(
    cfg: &LedgerConfig,
    now: Millis,
    todo: &Todo,
    open: Option<&Attempt>,
    actor: &Actor,
    opts: &ClaimOpts,
) -> Result<Change, Error> {
    let op = "claim";
    check_ttl(op, opts.ttl)?;
    scoped(op, todo, actor)?;
    let open = consistent(op, todo, open)?;
    if !claimable(now, todo, actor, None) {
        return Err(Error::conflict(format!(
            "{op} {}: todo is {} and cannot be claimed now{}",
            todo.id,
            todo.state,
            if todo.past_deadline(now) {
                " (its deadline has passed)".to_string()
            } else if todo.state == TodoState::Claimed {
                " (its lease is held)".to_string()
            } else if let Some(t) = todo.waits_until(now) {
                format!(" (it waits until its run_at, {})", crate::time::rfc3339(t))
            } else {
                String::new()
            }
        )));
    }
    let mut change = Change::new(todo.clone());
    if let Some(dead) = open {
        change.writes.push(AttemptWrite::Update(close(
            op,
            dead,
            now,
            Outcome::LeaseExpired,
            Leaves::Requeued,
        )?));
    }
    let t = &mut change.todo;
    t.state = TodoState::Claimed;
    t.owner = Some(actor.owner().to_string());
    t.lease_expires_at = Some(now + opts.ttl);
    t.attempt += 1;
    t.attempts_total += 1;
    t.claimed_at = Some(now);
    t.next_retry_at = None;
    t.updated_at = now;
    let (claimer_kind, claimer_endpoint, claimer_session, token_hash) = match actor {
        Actor::Endpoint { endpoint, session } => (
            ClaimerKind::Endpoint,
            Some(endpoint.clone()),
            session.clone(),
            opts.token_hash,
        ),
        // An operator's claim is never fenced: the owning human can always act.
        Actor::Operator { .. } => (ClaimerKind::Owner, None, None, None),
    };
    change.writes.push(AttemptWrite::Open(Attempt {
        todo_id: t.id.clone(),
        seq: t.attempts_total,
        attempt: t.attempt,
        claimer_kind,
        claimer_endpoint,
        claimer_session,
        owner: actor.owner().to_string(),
        claimant: opts.claimant.as_deref().and_then(bounds::bound_claimant),
        claimed_at: now,
        last_heartbeat_at: None,
        lease_expires_at: now + opts.ttl,
        ended_at: None,
        outcome: None,
        disposition: None,
        summary: None,
        summary_truncated: false,
        artifact: None,
        failure_signature: None,
        dead_letter_reason: None,
        late_reports: Vec::new(),
        late_reports_total: 0,
        lease_token_hash: token_hash,
        closed_by: None,
        question: None,
        usage: Usage::default(),
    }));
    // The cap keeps the newest `attempts_cap` attempts, the open one included. Everything at or
    // below the new floor is closed (only the newest attempt can be open), so the pruned count
    // is the floor itself.
    let cap = cfg.attempts_cap.max(1);
    if t.attempts_total > cap && t.attempts_total - cap > t.attempts_pruned {
        t.attempts_pruned = t.attempts_total - cap;
        change
            .writes
            .push(AttemptWrite::PruneThrough(t.attempts_pruned));
    }
    Ok(change)
}

/// The one check every holder-only operation makes. A wrong owner, a wrong or missing fence
/// token, and a lapsed lease all answer the same `conflict`, so the fence is no oracle.
fn held<'a>(
    op: &str,
    now: Millis,
    todo: &Todo,
    open: Option<&'a Attempt>,
    actor: &Actor,
    token_hash: Option<TokenHash>,
) -> Result<&'a Attempt, Error> {
    scoped(op, todo, actor)?;
    let open = consistent(op, todo, open)?;
    let Some(open) = open else {
        return Err(Error::conflict(format!(
            "{op} {}: todo is {}, not claimed; nothing to {op}",
            todo.id, todo.state
        )));
    };
    let holds = match actor {
        Actor::Operator { .. } => true,
        Actor::Endpoint { .. } => {
            todo.owner.as_deref() == Some(actor.owner())
                && todo.lease_valid_at(now)
                && open.lease_token_hash == token_hash
        }
    };
    if holds {
        Ok(open)
    } else {
        Err(Error::conflict(format!(
            "{op} {}: this caller does not hold the todo's lease (it lapsed, was taken over, or \
             the lease token does not match); claim again to work on it",
            todo.id
        )))
    }
}

/// How a close leaves the todo: its disposition, and for a dead letter why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Leaves {
    Done,
    RetryScheduled,
    Requeued,
    Canceled,
    AwaitingInput,
    DeadLettered(DeadLetterReason),
}

impl Leaves {
    fn disposition(self) -> Disposition {
        match self {
            Leaves::Done => Disposition::Done,
            Leaves::RetryScheduled => Disposition::RetryScheduled,
            Leaves::Requeued => Disposition::Requeued,
            Leaves::Canceled => Disposition::Canceled,
            Leaves::AwaitingInput => Disposition::AwaitingInput,
            Leaves::DeadLettered(_) => Disposition::DeadLettered,
        }
    }

    fn reason(self) -> Option<DeadLetterReason> {
        match self {
            Leaves::DeadLettered(r) => Some(r),
            _ => None,
        }
    }
}

fn close(
    op: &str,
    open: &Attempt,
    now: Millis,
    outcome: Outcome,
    leaves: Leaves,
) -> Result<Attempt, Error> {
    if !open.is_open() {
        return Err(Error::internal(format!(
            "{op} {}: attempt {} is already closed ({}); an attempt closes exactly once",
            open.todo_id,
            open.seq,
            open.outcome.map_or("?", Outcome::as_str)
        )));
    }
    let mut a = open.clone();
    // Never before the claim: a wall clock that stepped back since (the server's, or the
    // database's) must not order the ledger's own events backwards.
    a.ended_at = Some(now.max(open.claimed_at));
    a.outcome = Some(outcome);
    a.disposition = Some(leaves.disposition());
    a.dead_letter_reason = leaves.reason();
    Ok(a)
}

/// Makes a todo row leaving `claimed` (or a sweep's failed or pending one) a dead letter.
fn dead_letter(t: &mut Todo, reason: DeadLetterReason, now: Millis) {
    unlease(t, TodoState::Failed, now);
    t.next_retry_at = None;
    t.dead_letter_reason = Some(reason);
}

/// Drops the lease from a todo row that is leaving `claimed` (or `input_required`).
fn unlease(t: &mut Todo, state: TodoState, now: Millis) {
    t.state = state;
    t.owner = None;
    t.lease_expires_at = None;
    t.updated_at = now;
    t.dead_letter_reason = None;
    t.asking.answer_due_at = None;
}

/// Records what the holder says its attempt has spent: each figure only ever grows (a lower
/// one, e.g. a report that crossed a later heartbeat, changes nothing), and the todo's `spent`
/// grows by as much.
fn spend(t: &mut Todo, a: &mut Attempt, usage: Option<Usage>) {
    if let Some(u) = usage {
        let grown = a.usage.max(u);
        t.spent = t.spent.plus(grown.since(a.usage));
        a.usage = grown;
    }
}

/// Extends the lease to `now + ttl` and records the heartbeat (and its usage) on the open
/// attempt. A heartbeat whose usage brings the todo's spend to its budget stops the attempt
/// instead, as an operator's cancel would (`canceled`), and dead-letters the todo
/// (`budget_exhausted`); the server answers the holder as it answers a cancel.
pub fn heartbeat(
    now: Millis,
    todo: &Todo,
    open: Option<&Attempt>,
    actor: &Actor,
    (ttl, token_hash): (Millis, Option<TokenHash>),
    usage: Option<Usage>,
) -> Result<Change, Error> {
    let op = "heartbeat";
    check_ttl(op, ttl)?;
    let open = held(op, now, todo, open, actor, token_hash)?;
    let mut change = Change::new(todo.clone());
    let mut a = open.clone();
    spend(&mut change.todo, &mut a, usage);
    if change.todo.over_budget() {
        let leaves = Leaves::DeadLettered(DeadLetterReason::BudgetExhausted);
        dead_letter(&mut change.todo, DeadLetterReason::BudgetExhausted, now);
        let closed = close(op, &a, now, Outcome::Canceled, leaves)?;
        change.writes.push(AttemptWrite::Update(closed));
        return Ok(change);
    }
    change.todo.lease_expires_at = Some(now + ttl);
    change.todo.updated_at = now;
    a.last_heartbeat_at = Some(now);
    a.lease_expires_at = now + ttl;
    change.writes.push(AttemptWrite::Update(a));
    Ok(change)
}

/// The summary and artifact a report stores, bounded; `invalid` for a malformed artifact.
fn report_text(
    cfg: &LedgerConfig,
    op: &str,
    todo_id: &str,
    report: &Report,
) -> Result<(Option<String>, bool, Option<String>), Error> {
    let (summary, result, artifact) = (
        report.summary.as_deref(),
        report.result.as_ref(),
        report.artifact.as_deref(),
    );
    if let Some(r) = result {
        super::check_json_size("result", r)
            .map_err(|why| Error::invalid(format!("{op} {todo_id}: {why}")))?;
    }
    if let Some(a) = artifact {
        bounds::validate_artifact(op, todo_id, a)?;
    }
    let derived;
    let summary = match (summary, result) {
        (Some(s), _) => Some(s),
        (None, Some(r)) if cfg.summary_from_result => {
            derived = r.to_string();
            Some(derived.as_str())
        }
        _ => None,
    };
    let (summary, truncated) = match summary.map(bounds::bound_summary) {
        Some((s, t)) => (Some(s), t),
        None => (None, false),
    };
    Ok((summary, truncated, artifact.map(str::to_string)))
}

/// Closes the attempt as a report of `actor` does: with its text, and by whom when an operator.
fn close_reported(
    op: &str,
    (open, actor): (&Attempt, &Actor),
    now: Millis,
    outcome: Outcome,
    leaves: Leaves,
    text: (Option<String>, bool, Option<String>),
) -> Result<Attempt, Error> {
    let mut a = close(op, open, now, outcome, leaves)?;
    (a.summary, a.summary_truncated, a.artifact) = text;
    a.closed_by = actor.closed_by();
    Ok(a)
}

/// Completes the todo and closes the attempt `completed`/`done`.
pub fn complete(
    cfg: &LedgerConfig,
    now: Millis,
    todo: &Todo,
    open: Option<&Attempt>,
    actor: &Actor,
    report: &Report,
) -> Result<Change, Error> {
    let op = "complete";
    let text = report_text(cfg, op, &todo.id, report)?;
    let mut open = held(op, now, todo, open, actor, report.token_hash)?.clone();
    let mut change = Change::new(todo.clone());
    // The work is done: spend recorded at the end does not undo it.
    spend(&mut change.todo, &mut open, report.usage);
    unlease(&mut change.todo, TodoState::Done, now);
    change.todo.result = report.result.clone();
    change.writes.push(AttemptWrite::Update(close_reported(
        op,
        (&open, actor),
        now,
        Outcome::Completed,
        Leaves::Done,
        text,
    )?));
    Ok(change)
}

/// Fails the attempt: schedules a retry after the backoff, or dead-letters the todo when no
/// automatic attempt is due. In order, the reason is: the report is not retryable; the spend
/// reached the budget; the newest
/// `max_same_failures` failed attempts (this one and `recent`, the todo's newest closed attempts
/// newest first) report the same signature; no attempts remain; the retry would fall at or after
/// the deadline. The answer's `next_retry_at` and `dead_letter` are on the new row.
#[allow(clippy::too_many_arguments)]
pub fn fail(
    cfg: &LedgerConfig,
    now: Millis,
    todo: &Todo,
    open: Option<&Attempt>,
    actor: &Actor,
    report: &Report,
    recent: &[Attempt],
) -> Result<Change, Error> {
    let op = "fail";
    let text = report_text(cfg, op, &todo.id, report)?;
    let signature = check_signature(op, &todo.id, report.failure_signature.as_deref())?;
    let mut open = held(op, now, todo, open, actor, report.token_hash)?.clone();
    let mut change = Change::new(todo.clone());
    let t = &mut change.todo;
    spend(t, &mut open, report.usage);
    t.result = report.result.clone();
    let retry_at = now + cfg.backoff.delay(&t.id, t.attempts_total, t.attempt);
    let reason = if !report.retryable() {
        Some(DeadLetterReason::NonRetryable)
    } else if t.over_budget() {
        Some(DeadLetterReason::BudgetExhausted)
    } else if repeated(t.max_same_failures, &open, signature, recent) {
        Some(DeadLetterReason::RepeatedFailure)
    } else if t.attempt >= t.max_attempts {
        Some(DeadLetterReason::AttemptsExhausted)
    } else if t.deadline_at.is_some_and(|d| d <= retry_at) {
        Some(DeadLetterReason::Deadline)
    } else {
        None
    };
    let leaves = match reason {
        Some(r) => {
            dead_letter(t, r, now);
            Leaves::DeadLettered(r)
        }
        None => {
            unlease(t, TodoState::Failed, now);
            t.next_retry_at = Some(retry_at);
            Leaves::RetryScheduled
        }
    };
    let mut closed = close_reported(op, (&open, actor), now, Outcome::Failed, leaves, text)?;
    closed.failure_signature = signature.map(str::to_string);
    change.writes.push(AttemptWrite::Update(closed));
    Ok(change)
}

/// A failure signature as a fail may carry it: at most [`super::SIGNATURE_MAX_BYTES`] bytes
/// without control characters, or `invalid`. An empty one is no signature.
fn check_signature<'a>(op: &str, id: &str, sig: Option<&'a str>) -> Result<Option<&'a str>, Error> {
    match sig {
        Some(s) if s.len() > super::SIGNATURE_MAX_BYTES || s.chars().any(char::is_control) => {
            Err(Error::invalid(format!(
                "{op} {id}: failure_signature must be at most {} bytes without control \
                 characters (send a hash of what identifies the failure); got {} bytes",
                super::SIGNATURE_MAX_BYTES,
                s.len()
            )))
        }
        Some("") | None => Ok(None),
        Some(s) => Ok(Some(s)),
    }
}

/// The same failure again without new evidence: `n` (> 0) failed attempts in a row, this open
/// one and the newest of `recent`, all report `signature`. The run is broken by any other
/// close in between (a release, a lapsed lease) and by a manual retry (seen as an attempt
/// counter that does not fall going back in time), either of which is new evidence.
fn repeated(n: u32, open: &Attempt, signature: Option<&str>, recent: &[Attempt]) -> bool {
    let Some(sig) = signature else {
        return false;
    };
    if n == 0 {
        return false;
    }
    let mut newer = open.attempt;
    let mut run = 1;
    for a in recent.iter().take(n as usize - 1) {
        if a.outcome != Some(Outcome::Failed)
            || a.failure_signature.as_deref() != Some(sig)
            || a.attempt >= newer
        {
            break;
        }
        newer = a.attempt;
        run += 1;
    }
    run >= n
}

/// Gives the todo back unworked: pending again, the attempt refunded (see the module doc); a
/// dead letter when it could never be claimed again (`budget_exhausted`, `deadline`).
pub fn release(
    now: Millis,
    todo: &Todo,
    open: Option<&Attempt>,
    actor: &Actor,
    summary: Option<&str>,
    (token_hash, usage): (Option<TokenHash>, Option<Usage>),
) -> Result<Change, Error> {
    let op = "release";
    let mut open = held(op, now, todo, open, actor, token_hash)?.clone();
    let mut change = Change::new(todo.clone());
    spend(&mut change.todo, &mut open, usage);
    change.todo.attempt = change.todo.attempt.saturating_sub(1);
    let leaves = match unclaimable(now, &change.todo) {
        Some(r) => {
            dead_letter(&mut change.todo, r, now);
            Leaves::DeadLettered(r)
        }
        None => {
            unlease(&mut change.todo, TodoState::Pending, now);
            Leaves::Requeued
        }
    };
    let (summary, truncated) = match summary.map(bounds::bound_summary) {
        Some((s, t)) => (Some(s), t),
        None => (None, false),
    };
    change.writes.push(AttemptWrite::Update(close_reported(
        op,
        (&open, actor),
        now,
        Outcome::Released,
        leaves,
        (summary, truncated, None),
    )?));
    Ok(change)
}

/// Why a todo leaving its attempt unworked (released, or asking a question) could never be
/// claimed again: its spend reached the budget, or its deadline passed.
fn unclaimable(now: Millis, t: &Todo) -> Option<DeadLetterReason> {
    if t.over_budget() {
        Some(DeadLetterReason::BudgetExhausted)
    } else if t.past_deadline(now) {
        Some(DeadLetterReason::Deadline)
    } else {
        None
    }
}
