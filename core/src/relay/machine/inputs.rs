//! The machine's inputs: one handler per kind of input, and the deadlines.

use std::collections::BTreeMap;

use crate::relay::capabilities::Capabilities;
use crate::relay::context::claimant;
use crate::relay::record::{Event, RelayOutcome, RunOutcome, RunRecord, SkippedReason};
use crate::relay::redact::Redactor;
use crate::relay::summary::{
    AgentOutcome, AgentRun, AgentSummary, CHECK_TAIL_LINES, VerdictReason, choose_artifact,
    last_lines, parse_summary_file, question,
};
use crate::relay::types::{
    ClaimedTodo, Command, ExitStatus, Input, LeaseError, OnOverlap, ReportVerb, RequestId, Signal,
    StopReason, TimerReason,
};
use crate::time::{Mono, Now, SECOND};

use super::*;

impl Relay {
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

    pub(super) fn handle_due_timers(&mut self, now: Mono) {
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
        debug_assert!(false, "timers did not settle at {now:?}");
    }

    pub(super) fn handle_firing(&mut self, now: Mono, trigger: String, within_hours: bool) {
        if !self.settings.enabled {
            return self.skip(&trigger, SkippedReason::Disabled);
        }
        if self.run.is_some() {
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
    pub(super) fn start(&mut self, now: Mono, trigger: &str) {
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
        self.run = Some(Run {
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

    pub(super) fn handle_claim_answer(
        &mut self,
        now: Mono,
        request: RequestId,
        claim: ClaimedTodo,
    ) -> Result<(), ContractError> {
        let Some(a) = claiming(&mut self.run, request) else {
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
            deadline: a.claim_sent_at + s.lease_ttl,
            next_heartbeat: a.claim_sent_at + s.heartbeat_interval.max(1),
            heartbeat_failures: 0,
            outstanding: BTreeMap::new(),
            lost: false,
            disputed: false,
            token,
            claim,
            claimed_at: self.wall,
        });
        let event = Event::RelayClaimed {
            harness: s.harness.clone(),
            run_id: a.run_id,
            todo_id: a.record.todo_id.clone().unwrap_or_default(),
            attempt: a.record.attempt.unwrap_or_default(),
        };
        let record = a.record.clone();
        let lapsed = a.claim_sent_at + s.lease_ttl <= now;
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

    pub(super) fn handle_claim_refused(
        &mut self,
        now: Mono,
        request: RequestId,
        error: Option<LeaseError>,
    ) -> Result<(), ContractError> {
        let Some(a) = claiming(&mut self.run, request) else {
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

    pub(super) fn handle_heartbeat_answer(
        &mut self,
        now: Mono,
        request: RequestId,
        error: Option<LeaseError>,
    ) -> Result<(), ContractError> {
        let (ttl, interval) = (self.settings.lease_ttl, self.settings.heartbeat_interval);
        let run_id = self.run.as_ref().map_or(0, |a| a.run_id);
        let reporting = self
            .run
            .as_ref()
            .is_some_and(|a| matches!(a.phase, Phase::Reporting { .. }));
        let Some(lease) = self.run.as_mut().and_then(|a| a.lease.as_mut()) else {
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
                lease.deadline = lease.deadline.max(sent + ttl);
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
                    .run
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
                lease.next_heartbeat = lease.next_heartbeat.min(now + delay);
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

    pub(super) fn handle_spawned(&mut self, now: Mono, run_id: u64) -> Result<(), ContractError> {
        let a = self.process_of(run_id, "ProcessSpawned", |s| s == ProcState::Requested)?;
        a.process.state = ProcState::Running { since: now };
        if a.end.is_some() || a.stop.is_some() {
            self.stop_process(now);
        }
        Ok(())
    }

    pub(super) fn handle_process_end(
        &mut self,
        now: Mono,
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
                    _ if timed_out => AgentOutcome::TimedOut,
                    ExitStatus::Code(0) => AgentOutcome::Success,
                    _ => AgentOutcome::Failed,
                };
                let run = AgentRun {
                    outcome,
                    exit: exit.code(),
                    duration: now.since(since),
                };
                // Redacted on arrival, so that not even this machine's Debug shows a secret.
                let mut summary = summary_file
                    .as_deref()
                    .map(parse_summary_file)
                    .unwrap_or_default();
                summary.summary = summary.summary.map(|text| a.redactor.redact(&text));
                summary.needs_input = summary.needs_input.and_then(|q| question(&q, &a.redactor));
                (run, summary, None)
            }
            Err(error) => {
                let run = AgentRun {
                    outcome: AgentOutcome::Failed,
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
        let asked = summary.needs_input.is_some();
        a.agent = Some(AgentResult { run, summary });
        if let Some(text) = warning {
            self.warn(run_id, text);
        }
        self.after_children_change(now, |relay, now| {
            if asked {
                // The agent did not finish: it waits for a person, so there is nothing for the
                // check to judge yet.
                return relay.ask(now);
            }
            if relay.settings.success_check.is_some() {
                // The check runs whatever the agent did: it, not the exit code, is the verdict.
                return relay.start_check(now, false);
            }
            let reason = match run.outcome {
                AgentOutcome::Success => VerdictReason::AgentSucceeded,
                AgentOutcome::TimedOut => VerdictReason::AgentTimedOut,
                AgentOutcome::Failed if spawn_failed => VerdictReason::SpawnFailed,
                AgentOutcome::Failed => VerdictReason::AgentFailed,
            };
            relay.verdict(now, reason);
        });
        Ok(())
    }

    pub(super) fn handle_check_end(
        &mut self,
        now: Mono,
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
        let Some(a) = self.run.as_mut().filter(|a| a.run_id == run_id) else {
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
            (false, _) if timed_out => self.verdict(now, VerdictReason::CheckTimedOut),
            (false, None) => self.verdict(now, VerdictReason::CheckNotStarted),
            (false, Some(ExitStatus::Code(0))) => self.verdict(now, VerdictReason::CheckPassed),
            (false, Some(ExitStatus::Code(CHECK_NOT_YET))) => self.check_not_yet(now),
            (false, Some(_)) => self.verdict(now, VerdictReason::CheckFailed),
        }
        Ok(())
    }

    pub(super) fn handle_report_answer(
        &mut self,
        now: Mono,
        request: RequestId,
        answer: Result<bool, LeaseError>,
    ) -> Result<(), ContractError> {
        let interval = self.settings.heartbeat_interval;
        let Some(a) = self.run.as_mut().filter(
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
                    ReportVerb::Fail | ReportVerb::RequestInput if dead_letter => {
                        RelayOutcome::DeadLettered
                    }
                    ReportVerb::Fail => RelayOutcome::Failed,
                    ReportVerb::Release => RelayOutcome::Released,
                    ReportVerb::RequestInput => RelayOutcome::InputRequested,
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
                    retry_at: Some(now + delay),
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

    pub(super) fn handle_receipt_answer(
        &mut self,
        request: RequestId,
        answer: Result<String, String>,
    ) -> Result<(), ContractError> {
        let Some(a) = self
            .run
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

    pub(super) fn handle_stop(&mut self, now: Mono, reason: StopReason) {
        // A stopping harness does not start its held firing later.
        self.held = None;
        // Once the verdict is known (receipt, report) it is reported as it is: releasing would
        // throw away a verdict on the work.
        if !self.stop_would_abort() {
            return;
        }
        let Some(a) = self.run.as_mut() else {
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

    pub(super) fn handle_capabilities(&mut self, caps: Capabilities) {
        self.source = if caps.supported() {
            SourceState::Supported
        } else {
            SourceState::Unsupported
        };
        self.release_advertised = caps.release_advertised;
        self.input_advertised = caps.asks();
    }

    pub(super) fn handle_timer(&mut self, now: Mono, reason: TimerReason) {
        let interval = self.settings.heartbeat_interval.max(1);
        let Some(a) = self.run.as_mut() else {
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
                lease.next_heartbeat = now + interval;
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
                        self.verdict(now, VerdictReason::CheckInconclusive);
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
}
