//! A reload: the config read again off the actor, then applied as `relay_core::fleet` plans it.

use super::*;

impl Daemon {
    /// Starts loading the config again, off the actor.
    pub(super) fn reload(&mut self, reply: Option<oneshot::Sender<Value>>) {
        if self.fleet.stopping() {
            if let Some(reply) = reply {
                let _ = reply.send(control::error("the daemon is stopping".into()));
            }
            return;
        }
        let (file, jobs, host) = (
            self.config_path.clone(),
            PathBuf::from(self.journal.jobs_dir()),
            self.host.clone(),
        );
        let tx = self.tx.clone();
        tokio::spawn(async move {
            let prepared = tokio::task::spawn_blocking(move || load::prepare(&file, &jobs, &host))
                .await
                .unwrap_or_else(|e| Err(format!("the config loader failed: {e}")));
            let _ = tx.send(Msg::Reloaded {
                prepared: Box::new(prepared),
                reply,
            });
        });
    }

    /// Applies a loaded config (see the module doc) and answers what changed.
    pub(super) fn apply_reload(&mut self, prepared: load::Prepared) -> Value {
        if self.fleet.stopping() {
            return control::error("the daemon is stopping".into());
        }
        let diff = relay_core::config::diff(&self.resolved, &prepared.resolved);
        let leased: Vec<String> = prepared.settings.keys().cloned().collect();
        let plan = self.fleet.plan_reload(&leased, &diff);
        let new = prepared.resolved;
        // Sources first, so that harnesses bind to what the new config names.
        for source in &plan.close {
            if let Some(s) = self.sources.remove(source) {
                s.initializing.iter().for_each(AbortHandle::abort);
            }
        }
        for source in &plan.open {
            self.add_source(&new, source.trim_start_matches("queue."));
        }
        for h in &plan.expire {
            self.input(h, Input::SessionExpired);
        }
        for source in &diff.queues.changed {
            if let (Some(s), Some(q)) = (
                self.sources.get_mut(source),
                new.config.queues.get(source.trim_start_matches("queue.")),
            ) {
                s.header_names = q.address.headers.keys().cloned().collect();
            }
        }
        self.set_cairns(&new);
        self.resolved = new;

        let mut aborted = Vec::new();
        for name in &plan.stop {
            let relay = self.fleet.get(name).expect("a member").relay();
            let run = relay.describe(self.clock.reading()).attempt;
            if let Some(a) = run.filter(|_| relay.stop_would_abort()) {
                aborted.push(json!({"harness": name, "run_id": a.run_id}));
            }
            self.input(
                name,
                Input::StopRequested {
                    reason: StopReason::HarnessRemoved,
                },
            );
        }
        let mut reconfigured = Vec::new();
        let wall = self.clock.wall();
        for name in &plan.remove {
            self.fleet.reload(name, None, wall);
            self.settle(name);
        }
        for name in &plan.keep {
            let settings = prepared.settings[name].clone();
            let harness = self.resolved.config.harnesses.get(name).cloned();
            let applies = self.fleet.reload(name, Some((settings, harness)), wall);
            if let Some(applies) = applies.filter(|a| *a != Reconfigured::Unchanged) {
                let mut entry = serde_json::to_value(applies).unwrap_or_default();
                entry["harness"] = json!(name);
                reconfigured.push(entry);
            }
            self.settle(name);
        }
        let mut added = Vec::new();
        for name in plan.add {
            let settings = prepared.settings[&name].clone();
            match self.add_slot(&name, settings) {
                Ok(()) => added.push(name),
                Err(e) => {
                    tracing::error!(harness = %name, error = %e, "the added harness did not start")
                }
            }
        }
        let unverified = |s: &str| self.sources.get(s).is_some_and(|s| s.caps.is_none());
        for source in self.fleet.to_initialize(unverified) {
            self.initialize(&source);
        }
        self.reconcile_doorbells(&diff);
        tracing::info!(
            config = %self.config_path.display(),
            added = ?diff.harnesses.added,
            removed = ?diff.harnesses.removed,
            changed = ?diff.harnesses.changed,
            sources = ?diff.queues,
            new_sessions = ?diff.new_sessions,
            "config reloaded"
        );
        json!({
            "ok": true,
            "config": self.config_path.display().to_string(),
            "dropins": prepared.dropins,
            "diff": diff,
            "started": added,
            "aborted": aborted,
            "reconfigured": reconfigured,
        })
    }
}
