//! The relay hosts: feeding a machine its inputs and carrying out its commands, with the modelled
//! agent process and success check.

use relay_core::relay::{Command, ExitStatus, Input, Relay, RunOutcome, RunRecord, Signal};
use relay_core::time::SECOND;

use crate::options::Mutation;

use super::*;

impl World {
    pub(super) fn feed(&mut self, r: usize, input: Input) {
        let h = &mut self.hosts[r];
        let now = h.now(self.now, self.o.mutation);
        let Some(m) = h.relay.as_mut() else {
            return;
        };
        // The monitor judges the lease on the host's true monotonic clock, whatever clock a
        // mutation hands the machine.
        h.monitor.input(h.mono.read(self.now), &input);
        if let Err(e) = m.handle_input(now, input) {
            self.violate(Kind::Correctness, "contract", format!("relay {r}: {e:?}"));
        }
        self.drain(r);
    }

    /// Drains the machine's commands, then re-arms its timer.
    pub(super) fn drain(&mut self, r: usize) {
        while let Some(cmd) = self.hosts[r].relay.as_mut().and_then(Relay::poll_command) {
            self.hash = mix(self.hash, cmd.run_id() ^ (r as u64) << 40);
            if self.trace {
                eprintln!("          relay {r} -> {cmd:?}");
            }
            self.execute(r, cmd);
        }
        self.check_reloaded(r);
        self.rearm(r);
    }

    pub(super) fn rearm(&mut self, r: usize) {
        let h = &mut self.hosts[r];
        h.timer_gen += 1;
        let generation = h.timer_gen;
        if let Some((local, _)) = h.relay.as_ref().and_then(Relay::poll_timeout) {
            // The machine's timers are on the clock its driver hands it as monotonic.
            let clock = h.machine_clock(self.o.mutation);
            let at = clock.when(local).max(self.now);
            // Rounding in the clock inverse must never wake the machine early.
            let at = if clock.read(at) < local { at + 1 } else { at };
            self.schedule(
                at,
                Ev::Timer {
                    relay: r,
                    generation,
                },
            );
        }
    }

    /// A local event for relay `r`'s life `life`, `after` from now.
    fn local_after(&mut self, r: usize, life: u32, after: Millis, input: LocalInput) {
        self.schedule(
            self.now + after,
            Ev::Local {
                relay: r,
                life,
                input,
            },
        );
    }

    pub(super) fn execute(&mut self, r: usize, cmd: Command) {
        if let Err(b) = self.hosts[r].monitor.command(&cmd) {
            self.violate(
                Kind::Correctness,
                b.invariant,
                format!("relay {r}: {}", b.detail),
            );
        }
        let life = self.hosts[r].life;
        match cmd {
            Command::SendClaimNext {
                request, run_id, ..
            } => self.send(r, request, run_id, cmd),
            Command::SendHeartbeat {
                request, run_id, ..
            } => self.send(r, request, run_id, cmd),
            Command::SendReport {
                request, run_id, ..
            } => {
                if self.o.mutation == Some(Mutation::ReportAfterDeadline) {
                    // The canary: the driver holds the report until the lease is surely gone.
                    let late = self.now + self.o.lease_ttl + SECOND;
                    self.schedule(
                        late,
                        Ev::LateSend {
                            relay: r,
                            life,
                            req: request,
                            run_id,
                            command: cmd,
                        },
                    );
                    return;
                }
                self.send(r, request, run_id, cmd);
            }
            Command::Spawn { run_id, .. } => {
                self.count("spawn");
                let Some(run) = self.hosts[r].runs.get(&run_id) else {
                    self.violate(
                        Kind::Correctness,
                        "spawn_claimed",
                        format!("relay {r} spawned run {run_id} without a claim"),
                    );
                    return;
                };
                let todo = run.todo.clone();
                self.hosts[r].proc_gen += 1;
                let generation = self.hosts[r].proc_gen;
                let stubborn = self.work.chance(80);
                self.hosts[r].proc = Some(Proc {
                    run_id,
                    todo: todo.clone(),
                    signalled: false,
                    stubborn,
                    generation,
                });
                self.local_after(r, life, 5, LocalInput::Spawned(run_id));
                let spend = self.draw_spend();
                if let Some(run) = self.hosts[r].runs.get_mut(&run_id) {
                    run.spend = Some(spend);
                }
                // An agent that asks a person leaves the todo as it was.
                let asks = self.agent_asks(&todo);
                let took = self.work.range(SECOND, self.o.agent_max);
                let code = if self.work.chance(650) {
                    if asks.is_none() {
                        self.truth.fixed.insert(todo);
                    }
                    0
                } else if took.is_multiple_of(8) {
                    // Derived from a draw already made, so the seeds' streams stay as they were.
                    3
                } else {
                    1
                };
                let summary = self.agent_summary();
                let summary = asks.or(summary);
                let exited = LocalInput::Exited {
                    run_id,
                    proc_gen: generation,
                    exit: ExitStatus::Code(code),
                    summary,
                };
                self.local_after(r, life, took, exited);
            }
            Command::Signal { run_id, signal } => {
                let h = &mut self.hosts[r];
                let Some(p) = h.proc.as_mut().filter(|p| p.run_id == run_id) else {
                    return;
                };
                p.signalled = true;
                let (generation, stubborn) = (p.generation, p.stubborn);
                let after = match signal {
                    Signal::Term if stubborn => return,
                    Signal::Term => self.work.range(10, 2 * SECOND),
                    Signal::Kill => 10,
                };
                let sig = if signal == Signal::Kill { 9 } else { 15 };
                let exited = LocalInput::Exited {
                    run_id,
                    proc_gen: generation,
                    exit: ExitStatus::Signal(sig),
                    summary: None,
                };
                self.local_after(r, life, after, exited);
            }
            Command::RunCheck { run_id, .. } => {
                let todo = self.hosts[r].runs.get(&run_id).map(|x| x.todo.clone());
                self.hosts[r].proc_gen += 1;
                let generation = self.hosts[r].proc_gen;
                self.hosts[r].check = Some((run_id, generation));
                let code = if self.work.chance(200) {
                    75
                } else if todo.is_some_and(|t| self.truth.fixed.contains(&t)) {
                    0
                } else {
                    1
                };
                let took = self.work.range(100, 20 * SECOND);
                self.local_after(
                    r,
                    life,
                    took,
                    LocalInput::CheckExited {
                        run_id,
                        check_gen: generation,
                        exit: ExitStatus::Code(code),
                    },
                );
            }
            Command::KillCheck { run_id } => {
                // The check dies of SIGKILL shortly; its own exit, if still pending, is dropped.
                if self.hosts[r].check.is_some_and(|(run, _)| run == run_id) {
                    self.hosts[r].proc_gen += 1;
                    let generation = self.hosts[r].proc_gen;
                    self.hosts[r].check = Some((run_id, generation));
                    self.local_after(
                        r,
                        life,
                        10,
                        LocalInput::CheckExited {
                            run_id,
                            check_gen: generation,
                            exit: ExitStatus::Signal(9),
                        },
                    );
                }
            }
            Command::UploadReceipt { request, .. } => {
                let ok = self.work.chance(800);
                let took = self.work.range(100, 40 * SECOND);
                self.local_after(r, life, took, LocalInput::Receipt { req: request, ok });
            }
            Command::WriteRunRecord { record } => self.on_record(r, record),
            Command::WriteContextFile { .. }
            | Command::Emit { .. }
            | Command::WarnRunLog { .. } => {}
        }
    }

    /// What the agent leaves in its summary file: nothing, prose, the JSON form, or a secret
    /// that the relay must redact.
    pub(super) fn agent_summary(&mut self) -> Option<Vec<u8>> {
        match self.work.below(4) {
            0 => None,
            1 => Some(b"bumped the fixture; one flaky test remains".to_vec()),
            2 => Some(br#"{"summary": "patched it", "artifact": "mcp://cairn/Ab12Cd34"}"#.to_vec()),
            _ => Some(b"used ghp_0123456789abcdefghijABCDEFGHIJ012345 to push".to_vec()),
        }
    }

    pub(super) fn on_local(&mut self, r: usize, input: LocalInput) {
        let input = match input {
            LocalInput::Spawned(run_id) => Input::ProcessSpawned { run_id },
            LocalInput::Exited {
                run_id,
                proc_gen,
                exit,
                summary,
            } => {
                match &self.hosts[r].proc {
                    Some(p) if p.run_id == run_id && p.generation == proc_gen => {}
                    _ => return, // already exited (a second signal's exit, or a crash)
                }
                self.hosts[r].proc = None;
                let now = self.now;
                if let Some(spend) = self.hosts[r]
                    .runs
                    .get_mut(&run_id)
                    .and_then(|run| run.spend.as_mut())
                {
                    spend.stop(now);
                }
                Input::ProcessExited {
                    run_id,
                    exit,
                    summary_file: summary,
                }
            }
            LocalInput::CheckExited {
                run_id,
                check_gen,
                exit,
            } => {
                if self.hosts[r].check != Some((run_id, check_gen)) {
                    return; // killed
                }
                self.hosts[r].check = None;
                if exit == ExitStatus::Code(75) {
                    self.count("check_exit_75");
                }
                Input::CheckExited {
                    run_id,
                    exit,
                    output_tail: b"3 passed, 1 failed\n".to_vec(),
                }
            }
            LocalInput::Receipt { req, ok } => {
                if ok {
                    Input::ReceiptUploaded {
                        request: req,
                        handle: format!("mcp://cairn/r{}", req.0),
                    }
                } else {
                    Input::ReceiptFailed {
                        request: req,
                        error: "timed out".into(),
                    }
                }
            }
        };
        self.feed(r, input);
    }

    pub(super) fn on_record(&mut self, r: usize, record: RunRecord) {
        self.hosts[r].next_run_id = self.hosts[r].next_run_id.max(record.run_id + 1);
        let ended = record.outcome != RunOutcome::Running;
        if ended && let Some(outcome) = record.relay_outcome {
            self.check_relay_outcome(r, &record, outcome);
        }
        if ended {
            self.hosts[r].runs.remove(&record.run_id);
        }
        self.hosts[r].journal.insert(record.run_id, record);
    }
}
