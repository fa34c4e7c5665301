//! The attempt machine itself. See the module doc of [`super`] for the contract.

use std::collections::{BTreeMap, VecDeque};

use serde::Serialize;
use serde_json::{Value, json};

use super::record::{RelayOutcome, RunOutcome, RunRecord};
use super::redact::Redactor;
use super::summary::{AgentRun, AgentSummary};
use super::types::{
    ClaimedTodo, Command, ExitStatus, HarnessSettings, LeaseToken, ReportVerb, RequestId,
    StopReason, TimerReason,
};
use crate::time::{Millis, Mono, Now, SECOND, Wall, rfc3339};

mod inputs;
mod steps;

/// A receipt upload may hold the report back this long, no longer (the receipt's upload bound).
pub const RECEIPT_TIMEOUT: Millis = 30 * SECOND;
/// The first retry of a heartbeat or report after a transport failure waits about this long;
/// each further failure doubles it, up to the heartbeat interval.
pub const RETRY_BASE: Millis = SECOND;

/// Unanswered heartbeats remembered per attempt (a driver times its requests out long before).
const MAX_OUTSTANDING_HEARTBEATS: usize = 64;

/// The exit code by which a check says "not conclusive yet".
const CHECK_NOT_YET: i32 = 75;

/// A caller broke the machine's contract: the input names something the machine never asked
/// for. Stale answers (for requests the machine did issue) are not errors.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ContractError {
    #[error(
        "request {0:?} was never issued by this relay: answer only the requests its commands name"
    )]
    UnknownRequest(RequestId),
    #[error(
        "{input} for run {run_id}, which has no process in that state: report a process only after the Spawn command that started it"
    )]
    NoProcess { run_id: u64, input: &'static str },
    #[error(
        "{input} for run {run_id}, which has no running check: report a check only after the RunCheck command that started it"
    )]
    NoCheck { run_id: u64, input: &'static str },
}

/// Whether the lease source may be claimed on (its tool schemas declare what relay needs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SourceState {
    /// No capability check on the current session yet (before the first, or after the
    /// session expired): claiming waits for one.
    Unverified,
    Supported,
    Unsupported,
}

/// What `harness describe` shows of a relay. Holds no token and no secret.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Describe {
    pub harness: String,
    pub lease: String,
    pub source: SourceState,
    pub release_advertised: bool,
    /// The source lists `request_input`: an agent's question is asked, not failed.
    pub input_advertised: bool,
    pub held_firing: bool,
    pub attempt: Option<AttemptView>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct AttemptView {
    pub run_id: u64,
    pub phase: &'static str,
    pub todo_id: Option<String>,
    pub attempt: Option<u32>,
    pub max_attempts: Option<u32>,
    pub lease_deadline: Option<String>,
}

/// A small seeded generator for retry jitter: core draws no randomness of its own.
#[derive(Clone, Debug)]
struct Jitter(crate::mix::SplitMix64);

impl Jitter {
    /// A delay after `failures` consecutive failures: doubling from [`RETRY_BASE`], never more
    /// than `cap`, drawn from its upper half so that retries of many relays spread out.
    fn backoff(&mut self, failures: u32, cap: Millis) -> Millis {
        let full = RETRY_BASE
            .saturating_mul(1 << failures.saturating_sub(1).min(20))
            .min(cap)
            .max(1);
        let half = full / 2;
        half + self.0.next_u64() % (full - half + 1)
    }
}

#[derive(Debug)]
enum Phase {
    Claiming {
        request: RequestId,
    },
    CheckingBefore,
    /// Spawn requested; the process starts, runs, is stopped.
    Running,
    Checking,
    Receipt {
        request: RequestId,
        until: Mono,
    },
    /// `request` is `None` while a retry waits for `retry_at`.
    Reporting {
        request: Option<RequestId>,
        retry_at: Option<Mono>,
        failures: u32,
    },
    /// The end is decided; the attempt closes once its children have exited.
    Ending,
}

impl Phase {
    fn name(&self) -> &'static str {
        match self {
            Phase::Claiming { .. } => "claiming",
            Phase::CheckingBefore => "checking_before",
            Phase::Running => "running",
            Phase::Checking => "checking",
            Phase::Receipt { .. } => "receipt",
            Phase::Reporting { .. } => "reporting",
            Phase::Ending => "ending",
        }
    }
}

#[derive(Debug)]
struct Lease {
    claim: ClaimedTodo,
    /// When the claim was answered (wall), for the context file (the claim answer carries no
    /// time).
    claimed_at: Wall,
    token: LeaseToken,
    deadline: Mono,
    next_heartbeat: Mono,
    heartbeat_failures: u32,
    /// Heartbeats awaiting an answer, with the time each was sent.
    outstanding: BTreeMap<RequestId, Mono>,
    lost: bool,
    /// A heartbeat was refused while the report was out: the report's own answer decides
    /// whether the lease was lost or the report closed the attempt, and no more heartbeats go.
    disputed: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ProcState {
    None,
    Requested,
    Running { since: Mono },
    Exited,
}

#[derive(Debug)]
struct Process {
    state: ProcState,
    term_at: Option<Mono>,
    kill_sent: bool,
    timed_out: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CheckState {
    Running,
    Waiting { until: Mono },
    Done,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KillCause {
    Timeout,
    /// Lease loss or abort: the check's answer no longer matters.
    Abandon,
}

#[derive(Debug)]
struct Check {
    before: bool,
    first_start: Mono,
    runs: u32,
    state: CheckState,
    last_exit: Option<ExitStatus>,
    last_end: Mono,
    /// The last lines of the last run's output, folded and redacted on arrival.
    output: String,
    killed: Option<KillCause>,
}

#[derive(Debug)]
struct AgentResult {
    run: AgentRun,
    summary: AgentSummary,
}

/// The report an attempt is sending, and the run outcome to record once it is accepted.
#[derive(Debug, Clone)]
struct PendingReport {
    verb: ReportVerb,
    summary: String,
    artifact: Option<String>,
    result: Value,
    outcome: RunOutcome,
    /// A fail's class and signature (`None` for the other verbs and for aborts).
    retryable: Option<bool>,
    failure_signature: Option<String>,
    /// A `request_input`'s question.
    question: Option<String>,
}

/// The run in flight: one firing, from its claim through the process, the check and the
/// report to its final record (its attempt, when the claim succeeds, is the ledger's row).
#[derive(Debug)]
struct Run {
    run_id: u64,
    record: RunRecord,
    claim_sent_at: Mono,
    phase: Phase,
    lease: Option<Lease>,
    stop: Option<StopReason>,
    process: Process,
    check: Option<Check>,
    agent: Option<AgentResult>,
    report: Option<PendingReport>,
    /// Decided ending, recorded when the children have exited.
    end: Option<(RunOutcome, RelayOutcome)>,
    redactor: Redactor,
}

impl Run {
    fn children_alive(&self) -> bool {
        matches!(
            self.process.state,
            ProcState::Requested | ProcState::Running { .. }
        ) || self
            .check
            .as_ref()
            .is_some_and(|c| c.state == CheckState::Running)
    }

    fn live_lease(&self) -> Option<&Lease> {
        self.lease
            .as_ref()
            .filter(|l| !l.lost && self.end.is_none())
    }
}

/// The relay machine of one leased harness. See the [module doc](super).
#[derive(Debug)]
pub struct Relay {
    settings: HarnessSettings,
    jitter: Jitter,
    next_run_id: u64,
    next_request: u64,
    source: SourceState,
    release_advertised: bool,
    /// The source's server lets this endpoint ask a person ([`super::Capabilities::asks`]).
    input_advertised: bool,
    run: Option<Run>,
    /// The one firing `on_overlap = "queue"` holds, by trigger.
    held: Option<String>,
    /// A reload's settings, waiting for the attempt in flight to close.
    pending: Option<HarnessSettings>,
    commands: VecDeque<Command>,
    /// The wall reading of the input being handled. It stamps the text of run records and
    /// nothing else: every `now: Mono` inside the machine is the monotonic reading.
    wall: Wall,
}

/// What [`Relay::reconfigure`] did with a reload's settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "applies", rename_all = "snake_case")]
pub enum Reconfigured {
    /// The settings are the ones the relay runs on (any waiting ones were dropped).
    Unchanged,
    /// No attempt was in flight: the next firing runs on them.
    Now,
    /// They wait for this run, which goes on under the settings it started with.
    AfterRun { run_id: u64 },
}

impl Relay {
    pub fn new(settings: HarnessSettings, seed: u64, first_run_id: u64) -> Relay {
        Relay {
            settings,
            jitter: Jitter(crate::mix::SplitMix64::new(seed)),
            next_run_id: first_run_id,
            next_request: 1,
            source: SourceState::Unverified,
            release_advertised: false,
            input_advertised: false,
            run: None,
            held: None,
            pending: None,
            commands: VecDeque::new(),
            wall: Wall::default(),
        }
    }

    pub fn settings(&self) -> &HarnessSettings {
        &self.settings
    }

    /// A reload's settings for this harness: an attempt in flight goes on under the
    /// settings it started with, and the new ones apply once it has closed (before a held
    /// firing starts). Settings equal to the current ones drop any that were waiting. A new
    /// lease source makes the source unverified again: its capabilities are another server's.
    pub fn reconfigure(&mut self, settings: HarnessSettings) -> Reconfigured {
        if settings == self.settings {
            self.pending = None;
            return Reconfigured::Unchanged;
        }
        match &self.run {
            Some(a) => {
                self.pending = Some(settings);
                Reconfigured::AfterRun { run_id: a.run_id }
            }
            None => {
                self.apply_settings(settings);
                Reconfigured::Now
            }
        }
    }

    fn apply_settings(&mut self, settings: HarnessSettings) {
        if settings.lease != self.settings.lease {
            self.source = SourceState::Unverified;
            self.release_advertised = false;
            self.input_advertised = false;
        }
        self.settings = settings;
    }

    /// Whether a stop request would end the attempt in flight now: there is one, it is not
    /// already stopping or ending, and its verdict is not yet known (a known verdict is
    /// reported as decided).
    pub fn stop_would_abort(&self) -> bool {
        self.run.as_ref().is_some_and(|a| {
            let verdict_known = matches!(
                a.phase,
                Phase::Receipt { .. } | Phase::Reporting { .. } | Phase::Ending
            );
            a.stop.is_none() && a.end.is_none() && !verdict_known
        })
    }

    // Outputs
    // ---------------------------------------------------------------------------------------

    /// The next command, in order. Drain until `None` after every input.
    pub fn poll_command(&mut self) -> Option<Command> {
        self.commands.pop_front()
    }

    /// The earliest deadline and why. When several fall on one instant the lease deadline
    /// comes first.
    pub fn poll_timeout(&self) -> Option<(Mono, TimerReason)> {
        let a = self.run.as_ref()?;
        let mut timers: Vec<(Mono, TimerReason)> = Vec::new();
        if let Some(lease) = a.live_lease() {
            timers.push((lease.deadline, TimerReason::LeaseDeadline));
            if !lease.disputed {
                timers.push((lease.next_heartbeat, TimerReason::Heartbeat));
            }
        }
        if let ProcState::Running { since } = a.process.state {
            match a.process.term_at {
                None if !a.process.timed_out => {
                    if let Some(timeout) = self.settings.timeout {
                        timers.push((since + timeout, TimerReason::AgentTimeout));
                    }
                }
                Some(term_at) if !a.process.kill_sent => {
                    let at = term_at + self.settings.kill_grace;
                    timers.push((at, TimerReason::KillGrace));
                }
                _ => {}
            }
        }
        if let (Some(check), Some(cs)) = (&a.check, &self.settings.success_check)
            && check.killed.is_none()
            && a.end.is_none()
        {
            let total = check.first_start + cs.timeout;
            match check.state {
                CheckState::Running => timers.push((total, TimerReason::CheckTimeout)),
                CheckState::Waiting { until } => {
                    timers.push((total, TimerReason::CheckTimeout));
                    timers.push((until, TimerReason::CheckRerun));
                }
                CheckState::Done => {}
            }
        }
        match a.phase {
            Phase::Receipt { until, .. } => timers.push((until, TimerReason::ReceiptTimeout)),
            Phase::Reporting {
                retry_at: Some(at), ..
            } => timers.push((at, TimerReason::ReportRetry)),
            _ => {}
        }
        timers.into_iter().min()
    }

    /// What `harness describe` shows; the lease deadline as the wall time `now` expects it at.
    pub fn describe(&self, now: Now) -> Describe {
        Describe {
            harness: self.settings.harness.clone(),
            lease: self.settings.lease.clone(),
            source: self.source,
            release_advertised: self.release_advertised,
            input_advertised: self.input_advertised,
            held_firing: self.held.is_some(),
            attempt: self.run.as_ref().map(|a| AttemptView {
                run_id: a.run_id,
                phase: a.phase.name(),
                todo_id: a.lease.as_ref().map(|l| l.claim.todo_id.clone()),
                attempt: a.lease.as_ref().map(|l| l.claim.attempt),
                max_attempts: a.lease.as_ref().map(|l| l.claim.max_attempts),
                lease_deadline: a
                    .live_lease()
                    .map(|l| rfc3339(now.wall_at(l.deadline).ms())),
            }),
        }
    }

    /// Whether an attempt is in flight (from the claim's send to its final record).
    pub fn in_flight(&self) -> bool {
        self.run.is_some()
    }

    /// The local lease deadline of the attempt in flight, while its lease is live.
    pub fn lease_deadline(&self) -> Option<Mono> {
        self.run
            .as_ref()
            .and_then(Run::live_lease)
            .map(|l| l.deadline)
    }
}

/// Takes the next request id from the machine's counter.
fn next_request(counter: &mut u64) -> RequestId {
    let id = RequestId(*counter);
    *counter += 1;
    id
}

/// The attempt, when it is waiting for the answer to `request`'s claim.
fn claiming(attempt: &mut Option<Run>, request: RequestId) -> Option<&mut Run> {
    attempt
        .as_mut()
        .filter(|a| matches!(a.phase, Phase::Claiming { request: r } if r == request))
}

/// The report's result object. Summary and artifact are not in it: they travel only as the
/// report's own arguments.
fn result_json(
    s: &HarnessSettings,
    run_id: u64,
    attempt: u32,
    agent: Option<AgentRun>,
    check: Option<(Option<i32>, u32)>,
    reason: &'static str,
) -> Value {
    json!({"harness": {
        "host": s.host,
        "harness": s.harness,
        "run_id": run_id,
        "attempt": attempt,
        "agent_exit": agent.map(|g| g.exit),
        "agent_outcome": agent.map(|g| g.outcome.as_str()),
        "duration_s": agent.map_or(0, |g| g.duration / SECOND),
        "check_exit": check.and_then(|(exit, _)| exit),
        "check_runs": check.map_or(0, |(_, runs)| runs),
        "reason": reason,
    }})
}
