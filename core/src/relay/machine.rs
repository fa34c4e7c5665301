//! The attempt machine itself. See the module doc of [`super`] for the contract.

use std::collections::{BTreeMap, VecDeque};

use serde::Serialize;
use serde_json::{Value, json};

use super::capabilities::Capabilities;
use super::context::{claimant, context_file_bytes, relay_env, run_files};
use super::record::{Event, RelayOutcome, RunOutcome, RunRecord, SkippedReason};
use super::redact::Redactor;
use super::summary::{
    ALREADY_SATISFIED, AgentRun, AgentSummary, CHECK_TAIL_LINES, CheckRunSummary,
    RECEIPT_LOG_LINES, RECEIPT_TAGS, abort_summary, choose_artifact, compose_summary, first_line,
    last_lines, parse_summary_file, receipt_markdown,
};
use super::types::{
    ClaimedTodo, Command, ExitStatus, HarnessSettings, Input, LeaseError, LeaseToken, OnOverlap,
    ProcessEnv, ReportVerb, RequestId, Signal, StopReason, TimerReason,
};
use crate::time::{Millis, Now, SECOND, rfc3339};

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
        until: Millis,
    },
    /// `request` is `None` while a retry waits for `retry_at`.
    Reporting {
        request: Option<RequestId>,
        retry_at: Option<Millis>,
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
    /// When the claim was answered, for the context file (the claim answer carries no time).
    claimed_at: String,
    token: LeaseToken,
    deadline: Millis,
    next_heartbeat: Millis,
    heartbeat_failures: u32,
    /// Heartbeats awaiting an answer, with the time each was sent.
    outstanding: BTreeMap<RequestId, Millis>,
    lost: bool,
    /// A heartbeat was refused while the report was out: the report's own answer decides
    /// whether the lease was lost or the report closed the attempt, and no more heartbeats go.
    disputed: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ProcState {
    None,
    Requested,
    Running { since: Millis },
    Exited,
}

#[derive(Debug)]
struct Process {
    state: ProcState,
    term_at: Option<Millis>,
    kill_sent: bool,
    timed_out: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CheckState {
    Running,
    Waiting { until: Millis },
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
    first_start: Millis,
    runs: u32,
    state: CheckState,
    last_exit: Option<ExitStatus>,
    last_end: Millis,
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
}

#[derive(Debug)]
struct Attempt {
    run_id: u64,
    record: RunRecord,
    claim_sent_at: Millis,
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

impl Attempt {
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
    attempt: Option<Attempt>,
    /// The one firing `on_overlap = "queue"` holds, by trigger.
    held: Option<String>,
    /// A reload's settings, waiting for the attempt in flight to close.
    pending: Option<HarnessSettings>,
    commands: VecDeque<Command>,
    /// The wall reading of the input being handled. It stamps the text of run records and
    /// nothing else: every `now: Millis` inside the machine is the monotonic reading.
    wall: Millis,
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
            attempt: None,
            held: None,
            pending: None,
            commands: VecDeque::new(),
            wall: 0,
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
        match &self.attempt {
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
        }
        self.settings = settings;
    }

    /// Whether a stop request would end the attempt in flight now: there is one, it is not
    /// already stopping or ending, and its verdict is not yet known (a known verdict is
    /// reported as decided).
    pub fn stop_would_abort(&self) -> bool {
        self.attempt.as_ref().is_some_and(|a| {
            let verdict_known = matches!(
                a.phase,
                Phase::Receipt { .. } | Phase::Reporting { .. } | Phase::Ending
            );
            a.stop.is_none() && a.end.is_none() && !verdict_known
        })
    }

    // ---------------------------------------------------------------------------------------
    // Inputs
    // ---------------------------------------------------------------------------------------

    /// Feeds one input at `now`. Deadlines already due at `now` are handled first, so a late
    /// driver never lets an expired lease act. Drain [`Relay::poll_command`] afterwards.
    /// `now.mono` must never decrease from one call to the next; `now.wall` may jump anywhere.
    pub fn handle_input(&mut self, now: Now, input: Input) -> Result<(), ContractError> {
        self.wall = now.wall;
        let now = now.mono;
        self.handle_due_timers(now);
        match input {
            Input::Firing {
                trigger,
                within_hours,
            } => self.handle_firing(now, trigger, within_hours),
            Input::ClaimAnswered { request, claim } => {
                return self.handle_claim_answer(now, request, claim);
            }
            Input::ClaimEmpty { request } => return self.handle_claim_refused(now, request, None),
            Input::ClaimFailed { request, error } => {
                return self.handle_claim_refused(now, request, Some(error));
            }
            Input::HeartbeatOk { request } => {
                return self.handle_heartbeat_answer(now, request, None);
            }
            Input::HeartbeatFailed { request, error } => {
                return self.handle_heartbeat_answer(now, request, Some(error));
            }
            Input::ProcessSpawned { run_id } => return self.handle_spawned(now, run_id),
            Input::SpawnFailed { run_id, error } => {
                return self.handle_process_end(now, run_id, Err(error));
            }
            Input::ProcessExited {
                run_id,
                exit,
                summary_file,
            } => return self.handle_process_end(now, run_id, Ok((exit, summary_file))),
            Input::CheckExited {
                run_id,
                exit,
                output_tail,
            } => return self.handle_check_end(now, run_id, Ok((exit, output_tail))),
            Input::CheckFailedToStart { run_id, error } => {
                return self.handle_check_end(now, run_id, Err(error));
            }
            Input::ReportAnswered {
                request,
                dead_letter,
                next_retry_at: _,
            } => return self.handle_report_answer(now, request, Ok(dead_letter)),
            Input::ReportFailed { request, error } => {
                return self.handle_report_answer(now, request, Err(error));
            }
            Input::ReceiptUploaded { request, handle } => {
                return self.handle_receipt_answer(request, Ok(handle));
            }
            Input::ReceiptFailed { request, error } => {
                return self.handle_receipt_answer(request, Err(error));
            }
            Input::TimerFired => {}
            Input::StopRequested { reason } => self.handle_stop(now, reason),
            Input::CapabilitiesKnown(caps) => self.handle_capabilities(caps),
            Input::SessionExpired => self.source = SourceState::Unverified,
        }
        Ok(())
    }

    /// Handles every deadline due at `now` (what [`Input::TimerFired`] does).
    pub fn handle_timeout(&mut self, now: Now) {
        self.wall = now.wall;
        self.handle_due_timers(now.mono);
    }

    fn handle_due_timers(&mut self, now: Millis) {
        // A driver that wakes late (a paused host, a clock that jumped) may find several timers
        // due at once. The lease deadline goes first whatever its place among them: nothing due
        // earlier (a heartbeat, a report retry) may go out once the lease is already gone.
        if let Some(deadline) = self.lease_deadline()
            && deadline <= now
        {
            self.handle_timer(now, TimerReason::LeaseDeadline);
        }
        // Every timer handler disarms or moves its timer; the bound only guards that promise.
        for _ in 0..1024 {
            match self.poll_timeout() {
                Some((at, reason)) if at <= now => self.handle_timer(now, reason),
                _ => return,
            }
        }
        debug_assert!(false, "timers did not settle at {now}");
    }

    fn handle_firing(&mut self, now: Millis, trigger: String, within_hours: bool) {
        if !self.settings.enabled {
            return self.skip(&trigger, SkippedReason::Disabled);
        }
        if self.attempt.is_some() {
            // Overlap is decided before hours (as for an unleased run), except that a firing
            // outside its hours is never held: it could not have started now either.
            return match self.settings.on_overlap {
                OnOverlap::Skip => self.skip(&trigger, SkippedReason::Overlap),
                OnOverlap::Queue if !within_hours => {
                    self.skip(&trigger, SkippedReason::OutsideHours)
                }
                // One held firing is enough to run once more; further ones add nothing.
                OnOverlap::Queue if self.held.is_some() => {
                    self.skip(&trigger, SkippedReason::Overlap)
                }
                OnOverlap::Queue => self.held = Some(trigger),
            };
        }
        if !within_hours {
            return self.skip(&trigger, SkippedReason::OutsideHours);
        }
        self.start(now, &trigger);
    }

    /// The lease-side admission steps, then the claim. A held firing comes here when it starts.
    fn start(&mut self, now: Millis, trigger: &str) {
        if !self.settings.enabled {
            return self.skip(trigger, SkippedReason::Disabled);
        }
        if !self.settings.lease_enabled {
            return self.skip(trigger, SkippedReason::LeaseDisabled);
        }
        if self.source != SourceState::Supported {
            return self.skip(trigger, SkippedReason::LeaseSourceUnsupported);
        }
        let run_id = self.alloc_run_id();
        let request = next_request(&mut self.next_request);
        let s = &self.settings;
        let record = RunRecord::new(&s.harness, &s.lease, run_id, trigger, self.wall);
        // The running record goes first, so a crash after the claim leaves something to
        // reconcile as interrupted.
        self.commands.push_back(Command::WriteRunRecord {
            record: record.clone(),
        });
        self.commands.push_back(Command::Emit {
            event: Event::RunStarted {
                harness: s.harness.clone(),
                run_id,
                trigger: trigger.to_string(),
            },
        });
        self.commands.push_back(Command::SendClaimNext {
            request,
            run_id,
            queue: s.queue.clone(),
            lease_ttl_seconds: s.lease_ttl_seconds(),
            require_fence: true,
            claimant: claimant(&s.host, &s.harness, run_id),
        });
        self.attempt = Some(Attempt {
            run_id,
            record,
            claim_sent_at: now,
            phase: Phase::Claiming { request },
            lease: None,
            stop: None,
            process: Process {
                state: ProcState::None,
                term_at: None,
                kill_sent: false,
                timed_out: false,
            },
            check: None,
            agent: None,
            report: None,
            end: None,
            redactor: Redactor::default(),
        });
    }

    fn handle_claim_answer(
        &mut self,
        now: Millis,
        request: RequestId,
        claim: ClaimedTodo,
    ) -> Result<(), ContractError> {
        let Some(a) = claiming(&mut self.attempt, request) else {
            return self.stale(request);
        };
        let Some(token) = claim.lease_token.clone() else {
            // The server ignored require_fence. An unfenced attempt is exactly what relay
            // refuses: spawn nothing, send nothing, let the lease lapse.
            let run_id = a.run_id;
            a.record.outcome = RunOutcome::Skipped;
            a.record.skipped_reason = Some(SkippedReason::ClaimFailed);
            a.record.claim_error = Some("no_fence".into());
            self.warn(run_id, format!(
                "claim_next answered todo {} without a lease token although require_fence was set; \
                 refusing the unfenced claim (the lease will lapse). Upgrade the server to one with attempt history",
                claim.todo_id
            ));
            self.close(now);
            return Ok(());
        };
        let s = &self.settings;
        a.record.todo_id = Some(claim.todo_id.clone());
        a.record.attempt = Some(claim.attempt);
        a.redactor = Redactor::new(s.secret_values().chain([token.expose()]));
        // The claim request's send time, not the answer's: see `handle_heartbeat_answer`.
        a.lease = Some(Lease {
            deadline: a.claim_sent_at.saturating_add(s.lease_ttl),
            next_heartbeat: a.claim_sent_at.saturating_add(s.heartbeat_interval.max(1)),
            heartbeat_failures: 0,
            outstanding: BTreeMap::new(),
            lost: false,
            disputed: false,
            token,
            claim,
            claimed_at: rfc3339(self.wall),
        });
        let event = Event::RelayClaimed {
            harness: s.harness.clone(),
            run_id: a.run_id,
            todo_id: a.record.todo_id.clone().unwrap_or_default(),
            attempt: a.record.attempt.unwrap_or_default(),
        };
        let record = a.record.clone();
        let lapsed = a.claim_sent_at.saturating_add(s.lease_ttl) <= now;
        let stopping = a.stop.is_some();
        self.commands.push_back(Command::Emit { event });
        self.commands.push_back(Command::WriteRunRecord { record });
        if lapsed {
            self.lose_lease(now);
        } else if stopping {
            self.try_abort_report();
        } else if self
            .settings
            .success_check
            .as_ref()
            .is_some_and(|c| c.before)
        {
            // The check is told HARNESS_RELAY_FILE like the agent: the file must exist first.
            self.write_context_file();
            self.start_check(now, true);
        } else {
            self.spawn();
        }
        Ok(())
    }

    fn handle_claim_refused(
        &mut self,
        now: Millis,
        request: RequestId,
        error: Option<LeaseError>,
    ) -> Result<(), ContractError> {
        let Some(a) = claiming(&mut self.attempt, request) else {
            return self.stale(request);
        };
        a.record.outcome = RunOutcome::Skipped;
        match error {
            None => {
                a.record.skipped_reason = Some(SkippedReason::NoWork);
                a.record.relay_outcome = Some(RelayOutcome::NoWork);
            }
            Some(error) => {
                a.record.skipped_reason = Some(SkippedReason::ClaimFailed);
                a.record.claim_error = Some(error.code().to_string());
                if let LeaseError::Malformed(e) = &error {
                    let run_id = a.run_id;
                    self.warn(
                        run_id,
                        format!(
                            "{e}; refusing the claim: nothing is spawned and the lease will lapse. \
                         The queue server does not answer what the relay contract requires"
                        ),
                    );
                }
            }
        }
        self.close(now);
        Ok(())
    }

    fn handle_heartbeat_answer(
        &mut self,
        now: Millis,
        request: RequestId,
        error: Option<LeaseError>,
    ) -> Result<(), ContractError> {
        let (ttl, interval) = (self.settings.lease_ttl, self.settings.heartbeat_interval);
        let run_id = self.attempt.as_ref().map_or(0, |a| a.run_id);
        let reporting = self
            .attempt
            .as_ref()
            .is_some_and(|a| matches!(a.phase, Phase::Reporting { .. }));
        let Some(lease) = self.attempt.as_mut().and_then(|a| a.lease.as_mut()) else {
            return self.stale(request);
        };
        let Some(sent) = lease.outstanding.remove(&request) else {
            return self.stale(request);
        };
        match error {
            None => {
                // The server's expiry is its receive time + ttl, which is no earlier than our
                // send time + ttl. Measuring from the send time (not the answer) keeps the local
                // deadline at or before the server's, so the local stop can only come early.
                lease.deadline = lease.deadline.max(sent.saturating_add(ttl));
                lease.heartbeat_failures = 0;
            }
            // Found by the simulator: a heartbeat that crosses our own report on the wire finds
            // the todo no longer claimed and is refused, though the report closed the attempt.
            // While reporting, the report's answer decides (a repeat under the same token is
            // answered as the first was): send it again now if it is waiting for a retry.
            Some(error) if error.is_lease_loss() && reporting => {
                lease.disputed = true;
                lease.outstanding.clear();
                let waiting = self
                    .attempt
                    .as_ref()
                    .is_some_and(|a| matches!(a.phase, Phase::Reporting { request: None, .. }));
                if waiting {
                    self.send_report();
                }
            }
            // Straight to lease loss: a conflict never enters the transport retry path.
            Some(error) if error.is_lease_loss() => self.lose_lease(now),
            Some(LeaseError::Transport) => {
                lease.heartbeat_failures += 1;
                let delay = self.jitter.backoff(lease.heartbeat_failures, interval);
                lease.next_heartbeat = lease.next_heartbeat.min(now.saturating_add(delay));
            }
            Some(error) => {
                // forbidden, invalid or unknown: a quick retry would not help; the regular
                // heartbeat goes on and the deadline decides.
                let text = format!(
                    "heartbeat on {} failed with {}; continuing at the regular interval",
                    self.settings.lease,
                    error.code()
                );
                self.warn(run_id, text);
            }
        }
        Ok(())
    }

    fn handle_spawned(&mut self, now: Millis, run_id: u64) -> Result<(), ContractError> {
        let a = self.process_of(run_id, "ProcessSpawned", |s| s == ProcState::Requested)?;
        a.process.state = ProcState::Running { since: now };
        if a.end.is_some() || a.stop.is_some() {
            self.stop_process(now);
        }
        Ok(())
    }

    fn handle_process_end(
        &mut self,
        now: Millis,
        run_id: u64,
        end: Result<(ExitStatus, Option<Vec<u8>>), String>,
    ) -> Result<(), ContractError> {
        let (name, want): (&'static str, fn(ProcState) -> bool) = match end {
            Ok(_) => ("ProcessExited", |s| matches!(s, ProcState::Running { .. })),
            Err(_) => ("SpawnFailed", |s| s == ProcState::Requested),
        };
        let spawn_failed = end.is_err();
        let a = self.process_of(run_id, name, want)?;
        let since = match a.process.state {
            ProcState::Running { since } => since,
            _ => now,
        };
        a.process.state = ProcState::Exited;
        let timed_out = a.process.timed_out;
        let (run, summary, warning) = match end {
            Ok((exit, summary_file)) => {
                a.record.exit_code = match exit {
                    ExitStatus::Code(c) => Some(c),
                    ExitStatus::Signal(_) => None,
                };
                let outcome = match exit {
                    _ if timed_out => "timed_out",
                    ExitStatus::Code(0) => "success",
                    _ => "failed",
                };
                let run = AgentRun {
                    outcome,
                    exit: exit.code(),
                    duration: now.saturating_sub(since),
                };
                // Redacted on arrival, so that not even this machine's Debug shows a secret.
                let mut summary = summary_file
                    .as_deref()
                    .map(parse_summary_file)
                    .unwrap_or_default();
                summary.summary = summary.summary.map(|text| a.redactor.redact(&text));
                (run, summary, None)
            }
            Err(error) => {
                let run = AgentRun {
                    outcome: "failed",
                    exit: -1,
                    duration: 0,
                };
                let text = format!(
                    "the agent could not be started: {}",
                    a.redactor.redact(&error)
                );
                (run, AgentSummary::default(), Some(text))
            }
        };
        a.agent = Some(AgentResult { run, summary });
        if let Some(text) = warning {
            self.warn(run_id, text);
        }
        self.after_children_change(now, |relay, now| {
            if relay.settings.success_check.is_some() {
                // The check runs whatever the agent did: it, not the exit code, is the verdict.
                return relay.start_check(now, false);
            }
            let reason = match run.outcome {
                "success" => "agent_succeeded",
                "timed_out" => "agent_timed_out",
                _ if spawn_failed => "spawn_failed",
                _ => "agent_failed",
            };
            relay.verdict(now, run.outcome == "success", reason);
        });
        Ok(())
    }

    fn handle_check_end(
        &mut self,
        now: Millis,
        run_id: u64,
        end: Result<(ExitStatus, Vec<u8>), String>,
    ) -> Result<(), ContractError> {
        let name = if end.is_ok() {
            "CheckExited"
        } else {
            "CheckFailedToStart"
        };
        let no_check = ContractError::NoCheck {
            run_id,
            input: name,
        };
        let Some(a) = self.attempt.as_mut().filter(|a| a.run_id == run_id) else {
            return Err(no_check);
        };
        let Some(check) = a.check.as_mut().filter(|c| c.state == CheckState::Running) else {
            return Err(no_check);
        };
        check.state = CheckState::Done;
        check.last_end = now;
        let (before, killed) = (check.before, check.killed.take());
        let exit = match end {
            Ok((exit, tail)) => {
                check.last_exit = Some(exit);
                check.output = a.redactor.redact(&last_lines(&tail, CHECK_TAIL_LINES));
                a.record.check_exit = Some(exit.code());
                Some(exit)
            }
            Err(error) => {
                let text = format!(
                    "the success check could not be started: {}",
                    a.redactor.redact(&error)
                );
                self.warn(run_id, text);
                None
            }
        };
        if killed == Some(KillCause::Abandon) {
            self.after_children_change(now, |_, _| {});
            return Ok(());
        }
        let timed_out = killed == Some(KillCause::Timeout);
        match (before, exit) {
            (true, Some(ExitStatus::Code(0))) if !timed_out => self.already_satisfied(now),
            // Any other answer before the spawn means: do the work.
            (true, _) => self.spawn(),
            (false, _) if timed_out => self.verdict(now, false, "check_timed_out"),
            (false, None) => self.verdict(now, false, "check_not_started"),
            (false, Some(ExitStatus::Code(0))) => self.verdict(now, true, "check_passed"),
            (false, Some(ExitStatus::Code(CHECK_NOT_YET))) => self.check_not_yet(now),
            (false, Some(_)) => self.verdict(now, false, "check_failed"),
        }
        Ok(())
    }

    fn handle_report_answer(
        &mut self,
        now: Millis,
        request: RequestId,
        answer: Result<bool, LeaseError>,
    ) -> Result<(), ContractError> {
        let interval = self.settings.heartbeat_interval;
        let Some(a) = self.attempt.as_mut().filter(
            |a| matches!(a.phase, Phase::Reporting { request: Some(r), .. } if r == request),
        ) else {
            return self.stale(request);
        };
        let Some(report) = a.report.clone() else {
            return self.stale(request);
        };
        match answer {
            Ok(dead_letter) => {
                // A dead letter is read from the answer alone, never inferred from state or counts.
                let relay_outcome = match report.verb {
                    ReportVerb::Complete => RelayOutcome::Completed,
                    ReportVerb::Fail if dead_letter => RelayOutcome::DeadLettered,
                    ReportVerb::Fail => RelayOutcome::Failed,
                    ReportVerb::Release => RelayOutcome::Released,
                };
                a.record.artifact = report.artifact.clone();
                let event = Event::RelayReported {
                    harness: self.settings.harness.clone(),
                    run_id: a.run_id,
                    todo_id: a.record.todo_id.clone().unwrap_or_default(),
                    relay_outcome,
                    dead_letter: relay_outcome == RelayOutcome::DeadLettered,
                };
                a.end = Some((report.outcome, relay_outcome));
                a.phase = Phase::Ending;
                self.commands.push_back(Command::Emit { event });
                self.try_close(now);
            }
            Err(error) if error.is_lease_loss() => self.lose_lease(now),
            Err(LeaseError::Transport) => {
                let Phase::Reporting { failures, .. } = a.phase else {
                    return Ok(());
                };
                let delay = self.jitter.backoff(failures + 1, interval);
                a.phase = Phase::Reporting {
                    request: None,
                    retry_at: Some(now.saturating_add(delay)),
                    failures: failures + 1,
                };
            }
            Err(error) => {
                // forbidden, invalid or unknown will not change on a retry: the report is lost
                // now rather than at the deadline, and the lease is left to lapse.
                let run_id = a.run_id;
                a.end = Some((report.outcome, RelayOutcome::ReportLost));
                a.phase = Phase::Ending;
                let text = format!(
                    "{} on {} was refused with {}; the report is lost and the lease will lapse",
                    report.verb.as_str(),
                    self.settings.lease,
                    error.code()
                );
                self.warn(run_id, text);
                self.try_close(now);
            }
        }
        Ok(())
    }

    fn handle_receipt_answer(
        &mut self,
        request: RequestId,
        answer: Result<String, String>,
    ) -> Result<(), ContractError> {
        let Some(a) = self
            .attempt
            .as_mut()
            .filter(|a| matches!(a.phase, Phase::Receipt { request: r, .. } if r == request))
        else {
            return self.stale(request);
        };
        let run_id = a.run_id;
        let source = self.settings.attempt_receipt.clone().unwrap_or_default();
        let warnings = match answer {
            Ok(handle) => {
                let (artifact, warnings) = choose_artifact(None, Some(&handle), &a.redactor);
                if let Some(report) = a.report.as_mut() {
                    report.artifact = artifact;
                }
                warnings
            }
            Err(error) => vec![format!(
                "the attempt receipt upload to {source} failed: {}; reporting without it",
                a.redactor.redact(&error)
            )],
        };
        for text in warnings {
            self.warn(run_id, text);
        }
        self.send_report();
        Ok(())
    }

    fn handle_stop(&mut self, now: Millis, reason: StopReason) {
        // A stopping harness does not start its held firing later.
        self.held = None;
        // Once the verdict is known (receipt, report) it is reported as it is: releasing would
        // throw away a verdict on the work.
        if !self.stop_would_abort() {
            return;
        }
        let Some(a) = self.attempt.as_mut() else {
            return;
        };
        a.stop = Some(reason);
        if matches!(a.phase, Phase::Claiming { .. }) {
            return; // the claim's answer decides: a lease is released at once
        }
        self.stop_process(now);
        self.abandon_check();
        self.try_abort_report();
    }

    fn handle_capabilities(&mut self, caps: Capabilities) {
        self.source = if caps.supported() {
            SourceState::Supported
        } else {
            SourceState::Unsupported
        };
        self.release_advertised = caps.release_advertised;
    }

    fn handle_timer(&mut self, now: Millis, reason: TimerReason) {
        let interval = self.settings.heartbeat_interval.max(1);
        let Some(a) = self.attempt.as_mut() else {
            return;
        };
        let run_id = a.run_id;
        match reason {
            TimerReason::LeaseDeadline => self.lose_lease(now),
            TimerReason::Heartbeat => {
                let Some(lease) = a.lease.as_mut() else {
                    return;
                };
                let request = next_request(&mut self.next_request);
                // Every unanswered heartbeat stays awaited (a late conflict still means loss);
                // the bound only keeps a driver that never answers from growing the map.
                if lease.outstanding.len() >= MAX_OUTSTANDING_HEARTBEATS {
                    lease.outstanding.pop_first();
                }
                lease.outstanding.insert(request, now);
                lease.next_heartbeat = now.saturating_add(interval);
                self.commands.push_back(Command::SendHeartbeat {
                    request,
                    run_id,
                    todo_id: lease.claim.todo_id.clone(),
                    lease_ttl_seconds: self.settings.lease_ttl_seconds(),
                    lease_token: lease.token.clone(),
                });
            }
            TimerReason::AgentTimeout => {
                a.process.timed_out = true;
                self.stop_process(now);
            }
            TimerReason::KillGrace => {
                a.process.kill_sent = true;
                self.commands.push_back(Command::Signal {
                    run_id,
                    signal: Signal::Kill,
                });
            }
            TimerReason::CheckTimeout => {
                let Some(check) = a.check.as_mut() else {
                    return;
                };
                match check.state {
                    CheckState::Running => {
                        check.killed = Some(KillCause::Timeout);
                        self.commands.push_back(Command::KillCheck { run_id });
                    }
                    CheckState::Waiting { .. } => {
                        check.state = CheckState::Done;
                        self.verdict(now, false, "check_inconclusive");
                    }
                    CheckState::Done => {}
                }
            }
            TimerReason::CheckRerun => self.run_check(),
            TimerReason::ReceiptTimeout => {
                let source = self.settings.attempt_receipt.clone().unwrap_or_default();
                self.warn(run_id, format!(
                    "the attempt receipt upload to {source} took longer than {}s; reporting without it",
                    RECEIPT_TIMEOUT / SECOND
                ));
                self.send_report();
            }
            TimerReason::ReportRetry => self.send_report(),
        }
    }

    // ---------------------------------------------------------------------------------------
    // Commands: the steps an input leads to
    // ---------------------------------------------------------------------------------------

    fn alloc_run_id(&mut self) -> u64 {
        let id = self.next_run_id;
        self.next_run_id += 1;
        id
    }

    /// A firing refused before any call to the lease source: one record, nothing else.
    fn skip(&mut self, trigger: &str, reason: SkippedReason) {
        let run_id = self.alloc_run_id();
        let s = &self.settings;
        let mut record = RunRecord::new(&s.harness, &s.lease, run_id, trigger, self.wall);
        record.outcome = RunOutcome::Skipped;
        record.skipped_reason = Some(reason);
        record.ended_at = Some(rfc3339(self.wall));
        let event = Event::closing(&record);
        self.commands.push_back(Command::Emit { event });
        self.commands.push_back(Command::WriteRunRecord { record });
    }

    fn warn(&mut self, run_id: u64, text: String) {
        self.commands
            .push_back(Command::WarnRunLog { run_id, text });
    }

    /// An answer to a request that is no longer awaited is ignored; one that was never asked
    /// for is the caller's mistake.
    fn stale(&self, request: RequestId) -> Result<(), ContractError> {
        if request.0 >= self.next_request {
            return Err(ContractError::UnknownRequest(request));
        }
        Ok(())
    }

    fn process_of(
        &mut self,
        run_id: u64,
        input: &'static str,
        want: fn(ProcState) -> bool,
    ) -> Result<&mut Attempt, ContractError> {
        self.attempt
            .as_mut()
            .filter(|a| a.run_id == run_id && want(a.process.state))
            .ok_or(ContractError::NoProcess { run_id, input })
    }

    fn relay_process_env(&self, agent: Option<AgentRun>) -> Option<ProcessEnv> {
        let a = self.attempt.as_ref()?;
        let lease = a.lease.as_ref()?;
        let files = run_files(&self.settings.jobs_dir, &self.settings.harness, a.run_id);
        let mut relay = relay_env(&lease.claim, &files);
        if let Some(agent) = agent {
            relay.push(("HARNESS_AGENT_EXIT".into(), agent.exit.to_string()));
            relay.push(("HARNESS_AGENT_OUTCOME".into(), agent.outcome.to_string()));
        }
        Some(ProcessEnv {
            env_file: self.settings.env_file.clone(),
            relay,
        })
    }

    /// The context file, then the process.
    fn spawn(&mut self) {
        let Some(env) = self.relay_process_env(None) else {
            return;
        };
        // After a check-before, the file is already there (written before that check).
        if self
            .attempt
            .as_ref()
            .is_some_and(|a| !matches!(a.phase, Phase::CheckingBefore))
        {
            self.write_context_file();
        }
        let s = &self.settings;
        let Some(a) = self.attempt.as_mut() else {
            return;
        };
        if a.lease.is_none() {
            return;
        }
        let files = run_files(&s.jobs_dir, &s.harness, a.run_id);
        a.phase = Phase::Running;
        a.process.state = ProcState::Requested;
        self.commands.push_back(Command::Spawn {
            run_id: a.run_id,
            argv: s.argv.clone(),
            stdin: s.prompt.clone(),
            workdir: s.workdir.clone(),
            env,
            context_file: files.context_file,
            summary_file: files.summary_file,
        });
    }

    fn write_context_file(&mut self) {
        let s = &self.settings;
        let Some(a) = self.attempt.as_ref() else {
            return;
        };
        let Some(lease) = a.lease.as_ref() else {
            return;
        };
        let files = run_files(&s.jobs_dir, &s.harness, a.run_id);
        let bytes = context_file_bytes(
            &lease.claim,
            &lease.claimed_at,
            s.lease_ttl_seconds(),
            &files.summary_file,
        );
        self.commands.push_back(Command::WriteContextFile {
            run_id: a.run_id,
            path: files.context_file,
            bytes,
        });
    }

    /// The stop of any run: SIGTERM now, SIGKILL after the grace (the `KillGrace` timer).
    fn stop_process(&mut self, now: Millis) {
        let Some(a) = self.attempt.as_mut() else {
            return;
        };
        if matches!(a.process.state, ProcState::Running { .. }) && a.process.term_at.is_none() {
            a.process.term_at = Some(now);
            self.commands.push_back(Command::Signal {
                run_id: a.run_id,
                signal: Signal::Term,
            });
        }
    }

    /// Skips a check that has not started and kills one that has.
    fn abandon_check(&mut self) {
        let Some(a) = self.attempt.as_mut() else {
            return;
        };
        let Some(check) = a.check.as_mut() else {
            return;
        };
        match check.state {
            CheckState::Running if check.killed.is_none() => {
                check.killed = Some(KillCause::Abandon);
                self.commands
                    .push_back(Command::KillCheck { run_id: a.run_id });
            }
            CheckState::Running => check.killed = Some(KillCause::Abandon),
            CheckState::Waiting { .. } => check.state = CheckState::Done,
            CheckState::Done => {}
        }
    }

    fn start_check(&mut self, now: Millis, before: bool) {
        let Some(a) = self.attempt.as_mut() else {
            return;
        };
        a.phase = if before {
            Phase::CheckingBefore
        } else {
            Phase::Checking
        };
        a.check = Some(Check {
            before,
            first_start: now,
            runs: 0,
            state: CheckState::Done,
            last_exit: None,
            last_end: now,
            output: String::new(),
            killed: None,
        });
        self.run_check();
    }

    fn run_check(&mut self) {
        let agent = self
            .attempt
            .as_ref()
            .and_then(|a| a.agent.as_ref())
            .map(|g| g.run);
        let Some(env) = self.relay_process_env(agent) else {
            return;
        };
        let Some(check_settings) = self.settings.success_check.as_ref() else {
            return;
        };
        let Some(a) = self.attempt.as_mut() else {
            return;
        };
        let Some(check) = a.check.as_mut() else {
            return;
        };
        check.runs += 1;
        check.state = CheckState::Running;
        self.commands.push_back(Command::RunCheck {
            run_id: a.run_id,
            argv: check_settings.argv.clone(),
            workdir: self.settings.workdir.clone(),
            env,
        });
    }

    /// Exit 75: run again after the interval, unless that would start past the check's total
    /// time, in which case the check is inconclusive now (no later run could start anyway).
    fn check_not_yet(&mut self, now: Millis) {
        let Some(cs) = self.settings.success_check.as_ref() else {
            return;
        };
        let (interval, timeout) = (cs.interval, cs.timeout);
        let Some(check) = self.attempt.as_mut().and_then(|a| a.check.as_mut()) else {
            return;
        };
        let rerun_at = now.saturating_add(interval);
        if rerun_at < check.first_start.saturating_add(timeout) {
            check.state = CheckState::Waiting { until: rerun_at };
        } else {
            self.verdict(now, false, "check_inconclusive");
        }
    }

    /// Runs `next` unless the attempt is ending (lease lost) or stopping (aborted), in which
    /// case the right ending step runs instead once the children are gone.
    fn after_children_change(&mut self, now: Millis, next: impl FnOnce(&mut Relay, Millis)) {
        let Some(a) = self.attempt.as_ref() else {
            return;
        };
        if a.end.is_some() {
            self.try_close(now);
        } else if a.stop.is_some() {
            self.try_abort_report();
        } else {
            next(self, now);
        }
    }

    /// The verdict after the agent (and the check): compose the summary, then the receipt
    /// or the report.
    fn verdict(&mut self, now: Millis, success: bool, reason: &str) {
        let s = &self.settings;
        let Some(a) = self.attempt.as_mut() else {
            return;
        };
        let Some(lease) = a.lease.as_ref() else {
            return;
        };
        let agent = a.agent.as_ref();
        let agent_run = agent.map_or(
            AgentRun {
                outcome: "failed",
                exit: -1,
                duration: 0,
            },
            |g| g.run,
        );
        let check = a.check.as_ref().filter(|c| !c.before);
        let check_summary = check.map(|c| CheckRunSummary {
            exit: c.last_exit.map_or(-1, ExitStatus::code),
            duration: c.last_end.saturating_sub(c.first_start),
        });
        let first = first_line(
            lease.claim.attempt,
            lease.claim.max_attempts,
            agent_run,
            check_summary,
        );
        let summary = compose_summary(
            &first,
            agent.and_then(|g| g.summary.summary.as_deref()),
            check.map(|c| c.output.as_str()),
            &a.redactor,
        );
        let agent_candidate = agent.and_then(|g| g.summary.artifact.as_deref());
        let (artifact, warnings) = choose_artifact(agent_candidate, None, &a.redactor);
        let result = result_json(
            s,
            a.run_id,
            lease.claim.attempt,
            agent.map(|g| g.run),
            check.map(|c| (c.last_exit.map(ExitStatus::code), c.runs)),
            reason,
        );
        let outcome = match (success, agent_run.outcome) {
            (true, _) => RunOutcome::Success,
            (false, "timed_out") => RunOutcome::TimedOut,
            (false, _) => RunOutcome::Failed,
        };
        let verb = if success {
            ReportVerb::Complete
        } else {
            ReportVerb::Fail
        };
        a.report = Some(PendingReport {
            verb,
            summary,
            artifact,
            result,
            outcome,
        });
        let run_id = a.run_id;
        for text in warnings {
            self.warn(run_id, text);
        }
        self.receipt_or_report(now);
    }

    /// `success_check_before` passed: the world is already as the todo wants it.
    fn already_satisfied(&mut self, now: Millis) {
        let s = &self.settings;
        let Some(a) = self.attempt.as_mut() else {
            return;
        };
        let Some(lease) = a.lease.as_ref() else {
            return;
        };
        let runs = a.check.as_ref().map_or(1, |c| c.runs);
        let result = result_json(
            s,
            a.run_id,
            lease.claim.attempt,
            None,
            Some((Some(0), runs)),
            "check_passed_before_spawn",
        );
        a.report = Some(PendingReport {
            verb: ReportVerb::Complete,
            summary: ALREADY_SATISFIED.to_string(),
            artifact: None,
            result,
            outcome: RunOutcome::Success,
        });
        self.receipt_or_report(now);
    }

    /// A receipt when one is configured and the agent named no artifact.
    fn receipt_or_report(&mut self, now: Millis) {
        let s = &self.settings;
        let Some(a) = self.attempt.as_mut() else {
            return;
        };
        let Some(report) = a.report.as_ref() else {
            return;
        };
        let source = match (&s.attempt_receipt, &report.artifact) {
            (Some(source), None) => source.clone(),
            _ => return self.send_report(),
        };
        let request = next_request(&mut self.next_request);
        self.commands.push_back(Command::UploadReceipt {
            request,
            run_id: a.run_id,
            source,
            markdown: receipt_markdown(&s.harness, a.run_id, &report.summary),
            run_log_lines: RECEIPT_LOG_LINES,
            redactor: Redactor::new(s.secret_values()),
            tags: RECEIPT_TAGS.iter().map(|t| t.to_string()).collect(),
            timeout: RECEIPT_TIMEOUT,
        });
        let until = now.saturating_add(RECEIPT_TIMEOUT);
        a.phase = Phase::Receipt { request, until };
    }

    /// An abort: the process and check are gone; release (or fail) the lease with the reason.
    fn try_abort_report(&mut self) {
        let s = &self.settings;
        let Some(a) = self.attempt.as_mut() else {
            return;
        };
        let (Some(reason), Some(lease)) = (a.stop, a.lease.as_ref()) else {
            return;
        };
        if a.children_alive() || a.report.is_some() || a.end.is_some() {
            return;
        }
        let summary = abort_summary(
            lease.claim.attempt,
            lease.claim.max_attempts,
            reason.words(),
        );
        let (verb, result) = if self.release_advertised {
            (ReportVerb::Release, Value::Null)
        } else {
            let agent = a.agent.as_ref().map(|g| g.run);
            let result = result_json(s, a.run_id, lease.claim.attempt, agent, None, reason.code());
            (ReportVerb::Fail, result)
        };
        a.report = Some(PendingReport {
            verb,
            summary: a.redactor.redact(&summary),
            artifact: None,
            result,
            outcome: RunOutcome::Cancelled,
        });
        self.send_report();
    }

    fn send_report(&mut self) {
        let Some(a) = self.attempt.as_mut() else {
            return;
        };
        let (Some(report), Some(lease)) = (a.report.as_ref(), a.live_lease()) else {
            return;
        };
        let request = next_request(&mut self.next_request);
        let failures = match a.phase {
            Phase::Reporting { failures, .. } => failures,
            _ => 0,
        };
        self.commands.push_back(Command::SendReport {
            request,
            run_id: a.run_id,
            verb: report.verb,
            todo_id: lease.claim.todo_id.clone(),
            lease_token: lease.token.clone(),
            summary: report.summary.clone(),
            artifact: report.artifact.clone(),
            result: report.result.clone(),
        });
        a.phase = Phase::Reporting {
            request: Some(request),
            retry_at: None,
            failures,
        };
    }

    /// Lease loss (and a report lost): from here on nothing more goes to the lease source.
    fn lose_lease(&mut self, now: Millis) {
        let Some(a) = self.attempt.as_mut() else {
            return;
        };
        let Some(lease) = a.lease.as_mut() else {
            return;
        };
        if lease.lost || a.end.is_some() {
            return;
        }
        lease.lost = true;
        lease.outstanding.clear();
        let reporting = matches!(a.phase, Phase::Reporting { .. });
        let deadline_passed = lease.deadline <= now;
        let report_outcome = a.report.as_ref().map(|r| r.outcome);
        a.end = Some(match report_outcome {
            // A report still unaccepted at the deadline is lost; a refusal is a lost lease.
            Some(outcome) if reporting && deadline_passed => (outcome, RelayOutcome::ReportLost),
            _ => (RunOutcome::Cancelled, RelayOutcome::LeaseLost),
        });
        a.phase = Phase::Ending;
        if a.end.is_some_and(|(_, r)| r == RelayOutcome::LeaseLost) {
            let event = Event::RelayLeaseLost {
                harness: self.settings.harness.clone(),
                run_id: a.run_id,
                todo_id: lease.claim.todo_id.clone(),
            };
            self.commands.push_back(Command::Emit { event });
        }
        self.stop_process(now);
        self.abandon_check();
        self.try_close(now);
    }

    fn try_close(&mut self, now: Millis) {
        if self.attempt.as_ref().is_some_and(|a| !a.children_alive()) {
            self.close(now);
        }
    }

    /// Writes the final record, forgets the attempt (and its token), starts a held firing.
    fn close(&mut self, now: Millis) {
        let Some(mut a) = self.attempt.take() else {
            return;
        };
        if let Some((outcome, relay_outcome)) = a.end {
            a.record.outcome = outcome;
            a.record.relay_outcome = Some(relay_outcome);
        }
        a.record.ended_at = Some(rfc3339(self.wall));
        let event = Event::closing(&a.record);
        self.commands.push_back(Command::Emit { event });
        self.commands
            .push_back(Command::WriteRunRecord { record: a.record });
        // A reload's settings wait for the attempt that ran under the old ones.
        if let Some(settings) = self.pending.take() {
            self.apply_settings(settings);
        }
        if let Some(trigger) = self.held.take() {
            self.start(now, &trigger);
        }
    }

    // ---------------------------------------------------------------------------------------
    // Outputs
    // ---------------------------------------------------------------------------------------

    /// The next command, in order. Drain until `None` after every input.
    pub fn poll_command(&mut self) -> Option<Command> {
        self.commands.pop_front()
    }

    /// The earliest deadline and why. When several fall on one instant the lease deadline
    /// comes first.
    pub fn poll_timeout(&self) -> Option<(Millis, TimerReason)> {
        let a = self.attempt.as_ref()?;
        let mut timers: Vec<(Millis, TimerReason)> = Vec::new();
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
                        timers.push((since.saturating_add(timeout), TimerReason::AgentTimeout));
                    }
                }
                Some(term_at) if !a.process.kill_sent => {
                    let at = term_at.saturating_add(self.settings.kill_grace);
                    timers.push((at, TimerReason::KillGrace));
                }
                _ => {}
            }
        }
        if let (Some(check), Some(cs)) = (&a.check, &self.settings.success_check)
            && check.killed.is_none()
            && a.end.is_none()
        {
            let total = check.first_start.saturating_add(cs.timeout);
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
            held_firing: self.held.is_some(),
            attempt: self.attempt.as_ref().map(|a| AttemptView {
                run_id: a.run_id,
                phase: a.phase.name(),
                todo_id: a.lease.as_ref().map(|l| l.claim.todo_id.clone()),
                attempt: a.lease.as_ref().map(|l| l.claim.attempt),
                max_attempts: a.lease.as_ref().map(|l| l.claim.max_attempts),
                lease_deadline: a.live_lease().map(|l| rfc3339(now.wall_at(l.deadline))),
            }),
        }
    }

    /// Whether an attempt is in flight (from the claim's send to its final record).
    pub fn in_flight(&self) -> bool {
        self.attempt.is_some()
    }

    /// The local lease deadline of the attempt in flight, while its lease is live.
    pub fn lease_deadline(&self) -> Option<Millis> {
        self.attempt
            .as_ref()
            .and_then(Attempt::live_lease)
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
fn claiming(attempt: &mut Option<Attempt>, request: RequestId) -> Option<&mut Attempt> {
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
    reason: &str,
) -> Value {
    json!({"harness": {
        "host": s.host,
        "harness": s.harness,
        "run_id": run_id,
        "attempt": attempt,
        "agent_exit": agent.map(|g| g.exit),
        "agent_outcome": agent.map(|g| g.outcome),
        "duration_s": agent.map_or(0, |g| g.duration / SECOND),
        "check_exit": check.and_then(|(exit, _)| exit),
        "check_runs": check.map_or(0, |(_, runs)| runs),
        "reason": reason,
    }})
}
