//! Carrying out a relay machine's commands: files, processes, lease calls, receipts.

use relay_core::wire::UsageArg;

use super::*;

impl Daemon {
    pub(super) fn execute(&mut self, harness: &str, cmd: Command) {
        let run_id = cmd.run_id();
        match cmd {
            Command::SendClaimNext { .. }
            | Command::SendHeartbeat { .. }
            | Command::SendReport { .. } => self.lease_call(harness, cmd),
            Command::WriteContextFile {
                run_id,
                path,
                bytes,
            } => {
                // Written before the next command runs: the check before the spawn and the
                // agent both read it.
                if let Err(e) = runner::write_context_file_now(&path, &bytes) {
                    let error = format!("the context file was not written: {e}");
                    self.slot(harness).unwritable.insert(run_id, error);
                }
            }
            Command::Spawn { .. } => self.spawn(harness, cmd),
            Command::Signal { run_id, signal } => {
                #[cfg(madsim)]
                if canary::on() {
                    return;
                }
                let slot = self.slot(harness);
                if let Some(pending) = slot.spawning.get_mut(&run_id) {
                    pending.push(signal);
                } else if let Some(group) = slot.agents.get(&run_id)
                    && let Err(e) = group.signal(signal)
                {
                    tracing::warn!(harness, run_id, error = %e, "signal not delivered");
                }
            }
            Command::RunCheck { .. } => {
                let log = self.run_log(harness, run_id);
                let Some(spec) = CheckSpec::from_command(cmd, self.daemon_env.clone(), log) else {
                    return;
                };
                match self.launcher.check(spec) {
                    Ok(check) => {
                        self.slot(harness)
                            .checks
                            .insert(run_id, check.control.clone());
                        let tx = self.tx.clone();
                        let h = harness.to_string();
                        let task = check.deliver(move |input| {
                            let _ = tx.send(Msg::ToHarness { harness: h, input });
                        });
                        self.track(harness, run_id, task.abort_handle());
                    }
                    Err(e) => self.post(harness, e.into()),
                }
            }
            Command::KillCheck { run_id } => {
                if let Some(group) = self.slot(harness).checks.get(&run_id)
                    && let Err(e) = group.kill()
                {
                    tracing::warn!(harness, run_id, error = %e, "check not killed");
                }
            }
            Command::UploadReceipt {
                request,
                ref source,
                run_log_lines,
                ..
            } => {
                let Some(client) = self.cairns.get(source).cloned() else {
                    let error = format!("{source} is not declared");
                    self.post(harness, Input::ReceiptFailed { request, error });
                    return;
                };
                let log = self.run_log(harness, run_id);
                let tx = self.tx.clone();
                let h = harness.to_string();
                let task = tokio::spawn(async move {
                    let tail = runner::run_log_tail(&log, run_log_lines)
                        .await
                        .unwrap_or_default();
                    if let Some(input) = client.execute(&cmd, &tail).await {
                        let _ = tx.send(Msg::ToHarness { harness: h, input });
                    }
                });
                self.track(harness, run_id, task.abort_handle());
            }
            Command::WriteRunRecord { record } => {
                let last = self.last_run_ids.entry(harness.to_string()).or_default();
                *last = (*last).max(record.run_id);
                let closed = record.outcome != RunOutcome::Running;
                if closed {
                    self.metrics.run_closed(&record);
                }
                let keep = self
                    .fleet
                    .get(harness)
                    .expect("commands come from a member")
                    .harness()
                    .keep_runs as usize;
                let _ = self.records.send(RecordJob::Write(record, keep));
                if closed {
                    let slot = self.slot(harness);
                    slot.agents.remove(&run_id);
                    slot.spawning.remove(&run_id);
                    slot.checks.remove(&run_id);
                    slot.unwritable.remove(&run_id);
                    slot.usage.remove(&run_id);
                    for task in slot.tasks.remove(&run_id).unwrap_or_default() {
                        task.abort();
                    }
                }
            }
            Command::Emit { event } => {
                let now = self.clock.wall();
                let line = self.events.push(&event, now);
                tracing::info!(target: "relay::event", harness, event = %line, "relay event");
            }
            Command::WarnRunLog { run_id, text } => {
                let log = self.run_log(harness, run_id);
                let h = harness.to_string();
                // Not tracked with the run's tasks: a refused claim warns and then closes its
                // run at once, and closing aborts those tasks. The append ends on its own.
                tokio::spawn(async move {
                    if let Err(e) = runner::warn_run_log(&log, &text).await {
                        tracing::warn!(harness = %h, run_id, error = %e, "warning not written to the run log");
                    }
                });
            }
        }
    }

    /// What the run's agent has spent so far, for a heartbeat or report: its usage file, read
    /// now (bounded, never blocking on what the agent put there) and parsed by core; the first
    /// reading that cannot be used is said once in the run log. `None` before the spawn.
    fn usage(&mut self, harness: &str, run_id: u64) -> Option<UsageArg> {
        let (path, file) = self.slot(harness).usage.get_mut(&run_id)?;
        let (usage, warning) = file.read(runner::read_usage_file(path));
        if let Some(text) = warning {
            tracing::warn!(harness, run_id, "{text}");
            self.execute(harness, Command::WarnRunLog { run_id, text });
        }
        usage
    }

    /// A lease call on a task of its own; its session news, then its answer, come back.
    /// Heartbeats and reports carry the run's usage (see `usage`).
    pub(super) fn lease_call(&mut self, harness: &str, cmd: Command) {
        let run_id = cmd.run_id();
        let usage = match cmd {
            Command::SendHeartbeat { .. } | Command::SendReport { .. } => {
                self.usage(harness, run_id)
            }
            _ => None,
        };
        // The client the attempt claimed with, even when a reload has replaced it since.
        let slot = self.slot(harness);
        let (source, client, generation) =
            (slot.source.clone(), slot.client.clone(), slot.generation);
        if matches!(cmd, Command::SendReport { .. }) {
            KillAt::here(self.kill_at, KillAt::Report);
        }
        let tx = self.tx.clone();
        let h = harness.to_string();
        let task = tokio::spawn(async move {
            let Ok(outcome) = client.execute_with_usage(&cmd, usage.as_ref()).await else {
                return;
            };
            // The client has logged any error, with its source and operation.
            let expired = matches!(outcome.session.last(), Some(SessionNews::Expired));
            for news in outcome.session {
                let _ = tx.send(Msg::Session {
                    source: source.clone(),
                    generation,
                    news,
                });
            }
            if expired {
                let _ = tx.send(Msg::Reinitialize {
                    source: source.clone(),
                    generation,
                });
            }
            let _ = tx.send(Msg::ToHarness {
                harness: h,
                input: outcome.input,
            });
        });
        self.track(harness, run_id, task.abort_handle());
    }

    /// Starts the agent on a blocking thread, not the actor; the process comes back as
    /// `Msg::Spawned` (see `spawned`), which hands its wait to a task that posts the exit. A fork
    /// and exec that cannot finish (a hung filesystem under the run log or the workdir) must not
    /// freeze every other harness, their lease-loss kills included.
    ///
    /// Write-ahead: the process starts only once the run's record naming its todo and attempt
    /// (written by the machine before the spawn) is on disk, so that a daemon killed at any
    /// later step restarts into a record that says which todo it was working on. A record that
    /// cannot be written fails the spawn, like a context file that cannot.
    pub(super) fn spawn(&mut self, harness: &str, cmd: Command) {
        let run_id = cmd.run_id();
        if let Some(error) = self.slot(harness).unwritable.remove(&run_id) {
            self.post(harness, Input::SpawnFailed { run_id, error });
            return;
        }
        let log = self.run_log(harness, run_id);
        let Some(spec) = AgentSpec::from_command(cmd, self.daemon_env.clone(), log) else {
            return;
        };
        let slot = self.slot(harness);
        slot.spawning.insert(run_id, Vec::new());
        let usage_file = PathBuf::from(&spec.usage_file);
        slot.usage
            .insert(run_id, (usage_file, UsageFile::default()));
        let tx = self.tx.clone();
        let h = harness.to_string();
        // Not tracked with the run's tasks: aborting it could not stop a fork under way, and
        // its answer is what tells a closed run's late process to die.
        let launcher = self.launcher.clone();
        let (done, synced) = oneshot::channel();
        let run = (harness.to_string(), run_id);
        let _ = self.records.send(RecordJob::Flush { run, done });
        let kill_at = self.kill_at;
        tokio::spawn(async move {
            let synced = synced
                .await
                .unwrap_or_else(|_| Err("the run record writer stopped".into()));
            if let Err(e) = synced {
                let error =
                    format!("the run record was not written, so the agent was not started: {e}");
                let input = Input::SpawnFailed { run_id, error };
                let _ = tx.send(Msg::ToHarness { harness: h, input });
                return;
            }
            KillAt::here(kill_at, KillAt::Spawn);
            let _ = tokio::task::spawn_blocking(move || {
                let agent = Box::new(launcher.agent(spec));
                let _ = tx.send(Msg::Spawned {
                    harness: h,
                    run_id,
                    agent,
                });
            })
            .await;
        });
    }

    /// The end of `spawn`, back on the actor.
    pub(super) fn spawned(
        &mut self,
        harness: &str,
        run_id: u64,
        agent: Result<Launched, runner::StartError>,
    ) {
        let pending = self
            .slots
            .get_mut(harness)
            .and_then(|slot| slot.spawning.remove(&run_id));
        let (agent, signals) = match (agent, pending) {
            // The run closed while the process started: dropping the agent kills its group.
            (_, None) => return,
            (Err(e), Some(_)) => return self.post(harness, e.into()),
            (Ok(agent), Some(signals)) => (agent, signals),
        };
        for signal in signals {
            if let Err(e) = agent.control.signal(signal) {
                tracing::warn!(harness, run_id, error = %e, "signal not delivered");
            }
        }
        KillAt::here(self.kill_at, KillAt::Spawned);
        self.slot(harness)
            .agents
            .insert(run_id, agent.control.clone());
        // Queued before the wait starts, so the machine hears of the spawn before the exit of a
        // process that ends at once.
        self.post(harness, Input::ProcessSpawned { run_id });
        let tx = self.tx.clone();
        let h = harness.to_string();
        let task = agent.deliver(move |input| {
            let _ = tx.send(Msg::ToHarness { harness: h, input });
        });
        self.track(harness, run_id, task.abort_handle());
    }

    pub(super) fn track(&mut self, harness: &str, run_id: u64, task: AbortHandle) {
        let slot = self.slots.get_mut(harness).expect("slot exists");
        let tasks = slot.tasks.entry(run_id).or_default();
        tasks.retain(|t| !t.is_finished());
        tasks.push(task);
    }
}
