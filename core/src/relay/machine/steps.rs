//! The steps an input leads to: claiming, spawning, checking, reporting, ending.

use serde_json::Value;

use crate::relay::context::{context_file_bytes, relay_env, run_files};
use crate::relay::record::{Event, RelayOutcome, RunOutcome, RunRecord, SkippedReason};
use crate::relay::redact::Redactor;
use crate::relay::summary::{
    ALREADY_SATISFIED, AgentOutcome, AgentRun, CheckRunSummary, RECEIPT_LOG_LINES, RECEIPT_TAGS,
    VerdictReason, abort_summary, choose_artifact, compose_summary, first_line, receipt_markdown,
};
use crate::relay::types::{Command, ExitStatus, ProcessEnv, ReportVerb, RequestId, Signal};
use crate::time::{Mono, rfc3339};

use super::*;

impl Relay {
    pub(super) fn alloc_run_id(&mut self) -> u64 {
        let id = self.next_run_id;
        self.next_run_id += 1;
        id
    }

    /// A firing refused before any call to the lease source: one record, nothing else.
    pub(super) fn skip(&mut self, trigger: &str, reason: SkippedReason) {
        let run_id = self.alloc_run_id();
        let s = &self.settings;
        let mut record = RunRecord::new(&s.harness, &s.lease, run_id, trigger, self.wall);
        record.outcome = RunOutcome::Skipped;
        record.skipped_reason = Some(reason);
        record.ended_at = Some(rfc3339(self.wall.ms()));
        let event = Event::closing(&record);
        self.commands.push_back(Command::Emit { event });
        self.commands.push_back(Command::WriteRunRecord { record });
    }

    pub(super) fn warn(&mut self, run_id: u64, text: String) {
        self.commands
            .push_back(Command::WarnRunLog { run_id, text });
    }

    /// An answer to a request that is no longer awaited is ignored; one that was never asked
    /// for is the caller's mistake.
    pub(super) fn stale(&self, request: RequestId) -> Result<(), ContractError> {
        if request.0 >= self.next_request {
            return Err(ContractError::UnknownRequest(request));
        }
        Ok(())
    }

    pub(super) fn process_of(
        &mut self,
        run_id: u64,
        input: &'static str,
        want: fn(ProcState) -> bool,
    ) -> Result<&mut Run, ContractError> {
        self.run
            .as_mut()
            .filter(|a| a.run_id == run_id && want(a.process.state))
            .ok_or(ContractError::NoProcess { run_id, input })
    }

    pub(super) fn relay_process_env(&self, agent: Option<AgentRun>) -> Option<ProcessEnv> {
        let a = self.run.as_ref()?;
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
    pub(super) fn spawn(&mut self) {
        let Some(env) = self.relay_process_env(None) else {
            return;
        };
        // After a check-before, the file is already there (written before that check).
        if self
            .run
            .as_ref()
            .is_some_and(|a| !matches!(a.phase, Phase::CheckingBefore))
        {
            self.write_context_file();
        }
        let s = &self.settings;
        let Some(a) = self.run.as_mut() else {
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
            usage_file: files.usage_file,
        });
    }

    pub(super) fn write_context_file(&mut self) {
        let s = &self.settings;
        let Some(a) = self.run.as_ref() else {
            return;
        };
        let Some(lease) = a.lease.as_ref() else {
            return;
        };
        let files = run_files(&s.jobs_dir, &s.harness, a.run_id);
        let bytes = context_file_bytes(
            &lease.claim,
            lease.claimed_at,
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
    pub(super) fn stop_process(&mut self, now: Mono) {
        let Some(a) = self.run.as_mut() else {
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
    pub(super) fn abandon_check(&mut self) {
        let Some(a) = self.run.as_mut() else {
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

    pub(super) fn start_check(&mut self, now: Mono, before: bool) {
        let Some(a) = self.run.as_mut() else {
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

    pub(super) fn run_check(&mut self) {
        let agent = self
            .run
            .as_ref()
            .and_then(|a| a.agent.as_ref())
            .map(|g| g.run);
        let Some(env) = self.relay_process_env(agent) else {
            return;
        };
        let Some(check_settings) = self.settings.success_check.as_ref() else {
            return;
        };
        let Some(a) = self.run.as_mut() else {
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
    pub(super) fn check_not_yet(&mut self, now: Mono) {
        let Some(cs) = self.settings.success_check.as_ref() else {
            return;
        };
        let (interval, timeout) = (cs.interval, cs.timeout);
        let Some(check) = self.run.as_mut().and_then(|a| a.check.as_mut()) else {
            return;
        };
        let rerun_at = now + interval;
        if rerun_at < check.first_start + timeout {
            check.state = CheckState::Waiting { until: rerun_at };
        } else {
            self.verdict(now, VerdictReason::CheckInconclusive);
        }
    }

    /// Runs `next` unless the attempt is ending (lease lost) or stopping (aborted), in which
    /// case the right ending step runs instead once the children are gone.
    pub(super) fn after_children_change(&mut self, now: Mono, next: impl FnOnce(&mut Relay, Mono)) {
        let Some(a) = self.run.as_ref() else {
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
    pub(super) fn verdict(&mut self, now: Mono, reason: VerdictReason) {
        let success = reason.passed();
        let s = &self.settings;
        let Some(a) = self.run.as_mut() else {
            return;
        };
        let Some(lease) = a.lease.as_ref() else {
            return;
        };
        let agent = a.agent.as_ref();
        let agent_run = agent.map_or(
            AgentRun {
                outcome: AgentOutcome::Failed,
                exit: -1,
                duration: 0,
            },
            |g| g.run,
        );
        let check = a.check.as_ref().filter(|c| !c.before);
        let check_summary = check.map(|c| CheckRunSummary {
            exit: c.last_exit.map_or(-1, ExitStatus::code),
            duration: c.last_end.since(c.first_start),
        });
        let first = first_line(
            lease.claim.attempt,
            lease.claim.max_attempts,
            agent_run,
            check_summary,
        );
        // A question the server could not take is kept where the operator reads: first in the
        // agent's part, so that a long summary is cut before it is.
        let asked = agent
            .and_then(|g| g.summary.needs_input.as_deref())
            .map(|q| format!("needs input: {q}"));
        let agent_text: Vec<&str> = [
            asked.as_deref(),
            agent.and_then(|g| g.summary.summary.as_deref()),
        ]
        .into_iter()
        .flatten()
        .collect();
        let agent_text = (!agent_text.is_empty()).then(|| agent_text.join("\n"));
        let summary = compose_summary(
            &first,
            agent_text.as_deref(),
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
            reason.as_str(),
        );
        let outcome = match (success, agent_run.outcome) {
            (true, _) => RunOutcome::Success,
            (false, AgentOutcome::TimedOut) => RunOutcome::TimedOut,
            (false, _) => RunOutcome::Failed,
        };
        let verb = if success {
            ReportVerb::Complete
        } else {
            ReportVerb::Fail
        };
        let agent_exit = agent.map(|g| g.run.exit);
        let check_exit = check.and_then(|c| c.last_exit.map(ExitStatus::code));
        let listed = |e: Option<i32>| e.is_some_and(|e| s.non_retryable_exit_codes.contains(&e));
        let (retryable, failure_signature) = if success {
            (None, None)
        } else {
            let said_no = agent.and_then(|g| g.summary.retryable) == Some(false);
            let retryable = !(said_no || listed(agent_exit) || listed(check_exit));
            let signature = super::super::summary::failure_signature(
                reason,
                agent_exit,
                check_exit,
                check.map(|c| c.output.as_str()),
            );
            (Some(retryable), Some(signature))
        };
        a.report = Some(PendingReport {
            verb,
            summary,
            artifact,
            result,
            outcome,
            retryable,
            failure_signature,
            question: None,
        });
        let run_id = a.run_id;
        for text in warnings {
            self.warn(run_id, text);
        }
        self.receipt_or_report(now);
    }

    /// The agent asked a question (its summary file's `needs_input`): `request_input` with the
    /// question and the summary and artifact of the same file, where the source lets this
    /// endpoint ask; elsewhere a retryable fail with reason `needs_input_unsupported` whose
    /// summary carries the question (an endpoint granted `request_input` may take the todo
    /// next; the same question failing again and again dead-letters it by its signature).
    pub(super) fn ask(&mut self, now: Mono) {
        if !self.input_advertised {
            return self.verdict(now, VerdictReason::NeedsInputUnsupported);
        }
        let Some(a) = self.run.as_mut() else {
            return;
        };
        let (Some(lease), Some(agent)) = (a.lease.as_ref(), a.agent.as_ref()) else {
            return;
        };
        let first = first_line(
            lease.claim.attempt,
            lease.claim.max_attempts,
            agent.run,
            None,
        );
        let summary = compose_summary(&first, agent.summary.summary.as_deref(), None, &a.redactor);
        let (artifact, warnings) =
            choose_artifact(agent.summary.artifact.as_deref(), None, &a.redactor);
        // The run is recorded as the agent's process ended; the relay outcome says it asked.
        let outcome = match agent.run.outcome {
            AgentOutcome::Success => RunOutcome::Success,
            AgentOutcome::TimedOut => RunOutcome::TimedOut,
            AgentOutcome::Failed => RunOutcome::Failed,
        };
        a.report = Some(PendingReport {
            verb: ReportVerb::RequestInput,
            summary,
            artifact,
            result: Value::Null,
            outcome,
            retryable: None,
            failure_signature: None,
            question: agent.summary.needs_input.clone(),
        });
        let run_id = a.run_id;
        for text in warnings {
            self.warn(run_id, text);
        }
        self.receipt_or_report(now);
    }

    /// `success_check_before` passed: the world is already as the todo wants it.
    pub(super) fn already_satisfied(&mut self, now: Mono) {
        let s = &self.settings;
        let Some(a) = self.run.as_mut() else {
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
            VerdictReason::CheckPassedBeforeSpawn.as_str(),
        );
        a.report = Some(PendingReport {
            verb: ReportVerb::Complete,
            summary: ALREADY_SATISFIED.to_string(),
            artifact: None,
            result,
            outcome: RunOutcome::Success,
            retryable: None,
            failure_signature: None,
            question: None,
        });
        self.receipt_or_report(now);
    }

    /// A receipt when one is configured and the agent named no artifact.
    pub(super) fn receipt_or_report(&mut self, now: Mono) {
        let s = &self.settings;
        let Some(a) = self.run.as_mut() else {
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
        let until = now + RECEIPT_TIMEOUT;
        a.phase = Phase::Receipt { request, until };
    }

    /// An abort: the process and check are gone; release (or fail) the lease with the reason.
    pub(super) fn try_abort_report(&mut self) {
        let s = &self.settings;
        let Some(a) = self.run.as_mut() else {
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
            let result = result_json(
                s,
                a.run_id,
                lease.claim.attempt,
                agent,
                None,
                reason.as_str(),
            );
            (ReportVerb::Fail, result)
        };
        a.report = Some(PendingReport {
            verb,
            summary: a.redactor.redact(&summary),
            artifact: None,
            result,
            outcome: RunOutcome::Cancelled,
            retryable: None,
            failure_signature: None,
            question: None,
        });
        self.send_report();
    }

    pub(super) fn send_report(&mut self) {
        let Some(a) = self.run.as_mut() else {
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
            retryable: report.retryable,
            failure_signature: report.failure_signature.clone(),
            question: report.question.clone(),
        });
        a.phase = Phase::Reporting {
            request: Some(request),
            retry_at: None,
            failures,
        };
    }

    /// Lease loss (and a report lost): from here on nothing more goes to the lease source.
    pub(super) fn lose_lease(&mut self, now: Mono) {
        let Some(a) = self.run.as_mut() else {
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

    pub(super) fn try_close(&mut self, now: Mono) {
        if self.run.as_ref().is_some_and(|a| !a.children_alive()) {
            self.close(now);
        }
    }

    /// Writes the final record, forgets the attempt (and its token), starts a held firing.
    pub(super) fn close(&mut self, now: Mono) {
        let Some(mut a) = self.run.take() else {
            return;
        };
        if let Some((outcome, relay_outcome)) = a.end {
            a.record.outcome = outcome;
            a.record.relay_outcome = Some(relay_outcome);
        }
        a.record.ended_at = Some(rfc3339(self.wall.ms()));
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
}
