//! The lease sources and their sessions, the receipt clients (cairns), the doorbell listeners,
//! and binding a harness's slot to its source.

use super::*;

impl Daemon {
    /// A client for `[queue.<name>]`, not yet initialized.
    pub(super) fn add_source(&mut self, resolved: &ResolvedConfig, name: &str) {
        let Some(q) = resolved.config.queues.get(name) else {
            return;
        };
        let Some(client) = LeaseClient::from_config(resolved, name, self.transport.clone()) else {
            return;
        };
        let key = format!("queue.{name}");
        if let Some(old) = self.sources.get(&key) {
            old.initializing.iter().for_each(AbortHandle::abort);
        }
        let generation = self.next_generation;
        self.next_generation += 1;
        self.sources.insert(
            key,
            SourceSlot {
                client: Arc::new(client),
                generation,
                initializing: None,
                caps: None,
                url: q.address.url.as_str().to_string(),
                header_names: q.address.headers.keys().cloned().collect(),
            },
        );
    }

    pub(super) fn set_cairns(&mut self, resolved: &ResolvedConfig) {
        // Receipt clients hold no session: an upload in flight keeps the one it started with.
        self.cairns = resolved
            .config
            .cairns
            .keys()
            .filter_map(|name| {
                let client = ReceiptClient::from_config(resolved, name, self.transport.clone())?;
                Some((format!("cairn.{name}"), Arc::new(client)))
            })
            .collect();
    }

    pub(super) fn add_slot(&mut self, name: &str, settings: HarnessSettings) -> Result<(), String> {
        let Some(harness) = self.resolved.config.harnesses.get(name).cloned() else {
            return Ok(());
        };
        let Some(s) = self.sources.get(&settings.lease) else {
            return Ok(());
        };
        let (source, client, generation) = (settings.lease.clone(), s.client.clone(), s.generation);
        let caps = s.caps.clone();
        let recorded = self.journal.next_run_id(name).map_err(|e| e.to_string())?;
        let first = recorded.max(self.last_run_ids.get(name).map_or(0, |id| id + 1));
        self.metrics.harness(name);
        let wall = self.clock.wall();
        self.fleet.add(harness, settings, self.seed, first, wall);
        self.slots.insert(
            name.to_string(),
            Slot {
                source,
                client,
                generation,
                agents: BTreeMap::new(),
                spawning: BTreeMap::new(),
                checks: BTreeMap::new(),
                unwritable: BTreeMap::new(),
                usage: BTreeMap::new(),
                tasks: BTreeMap::new(),
            },
        );
        if let Some(caps) = caps {
            self.input(name, Input::CapabilitiesKnown(caps));
        }
        Ok(())
    }

    /// The trigger `catch_up`, at start: a schedule slot passed since the harness's newest run
    /// is fired once, when its source's session has been checked (a firing before that would
    /// only be skipped as unsupported).
    pub(super) fn owe_catch_up(&mut self, name: &str, now: relay_core::time::Wall) {
        if !self.fleet.catches_up(name) {
            return;
        }
        let last = match self.journal.records(name, 1) {
            Ok(records) => records
                .first()
                .and_then(|r| relay_core::time::read_wall_text(&r.started_at)),
            Err(e) => {
                tracing::warn!(harness = name, error = %e, "catch_up: the last run could not be read; nothing is caught up");
                return;
            }
        };
        if let Some(missed) = self.fleet.owe_catch_up(name, last, now) {
            tracing::info!(harness = name, missed = %relay_core::time::rfc3339(missed.ms()), "a schedule slot was missed while the daemon was down; catch_up fires once");
        }
    }

    /// Initializes the source's session on a task, retrying with capped backoff until the
    /// server answers; at most one such task per source at a time. At start, on
    /// [`Msg::Reinitialize`], and for a new or changed source on reload.
    pub(super) fn initialize(&mut self, source: &str) {
        let Some(s) = self.sources.get_mut(source) else {
            return;
        };
        if s.initializing.as_ref().is_some_and(|t| !t.is_finished()) {
            return;
        }
        let client = s.client.clone();
        let generation = s.generation;
        let tx = self.tx.clone();
        let name = source.to_string();
        let task = tokio::spawn(async move {
            let mut delay = Duration::from_millis(500);
            loop {
                match client.initialize().await {
                    Ok(caps) => {
                        let _ = tx.send(Msg::Session {
                            source: name,
                            generation,
                            news: SessionNews::Known(caps),
                        });
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(source = %name, error = %e, "lease session could not initialize; retrying");
                        tokio::time::sleep(delay).await;
                        delay = (delay * 2).min(Duration::from_secs(30));
                    }
                }
            }
        });
        s.initializing = Some(task.abort_handle());
    }

    /// One doorbell listener per enabled channel that triggers a harness of the daemon: stops
    /// those no longer wanted or changed by the reload, starts the missing ones.
    pub(super) fn reconcile_doorbells(&mut self, diff: &ConfigDiff) {
        let wanted = self.fleet.doorbells(&self.resolved.config);
        let listening = self
            .doorbells
            .iter()
            .map(|(n, (_, subs))| (n.clone(), subs.clone()))
            .collect();
        let (stop, start) = doorbell_changes(&listening, wanted, diff);
        for name in stop {
            if let Some((tasks, _)) = self.doorbells.remove(&name) {
                tasks.iter().for_each(AbortHandle::abort);
            }
        }
        for (name, subscriptions) in start {
            let Some(listener) =
                DoorbellListener::from_config(&self.resolved, &name, self.transport.clone())
            else {
                continue;
            };
            let (ring_tx, mut ring_rx) = mpsc::channel(16);
            let listener = listener.spawn(ring_tx, self.doorbells_stop.subscribe());
            let tx = self.tx.clone();
            let channel = name.clone();
            let forward = tokio::spawn(async move {
                while ring_rx.recv().await.is_some() {
                    let _ = tx.send(Msg::Ring {
                        channel: channel.clone(),
                    });
                }
            });
            self.doorbells.insert(
                name,
                (
                    [listener.abort_handle(), forward.abort_handle()],
                    subscriptions,
                ),
            );
        }
    }

    pub(super) fn session(&mut self, source: &str, generation: u64, news: SessionNews) {
        let Some(s) = self.sources.get_mut(source) else {
            return;
        };
        if s.generation != generation {
            return; // a client a reload replaced
        }
        let input = match news {
            // The client has logged the one ERROR of an unsupported initialize.
            SessionNews::Known(caps) => {
                s.caps = Some(caps.clone());
                Input::CapabilitiesKnown(caps)
            }
            SessionNews::Expired => {
                s.caps = None;
                Input::SessionExpired
            }
        };
        let known = matches!(input, Input::CapabilitiesKnown(_));
        for h in self.fleet.harnesses_on(source) {
            self.input(&h, input.clone());
            if known && self.fleet.take_catch_up(&h) {
                self.fire(&h, CATCH_UP);
            }
        }
    }

    /// Between attempts: a removed harness's slot goes, and a harness whose settings name
    /// another source, or whose source got a new client, is bound to it.
    pub(super) fn settle(&mut self, harness: &str) {
        let want = match self.fleet.settle(harness) {
            Settled::Busy => return,
            Settled::Gone => {
                self.slots.remove(harness);
                tracing::info!(harness, "harness removed by a reload has stopped");
                return;
            }
            Settled::Idle { lease } => lease,
        };
        let (Some(slot), Some(s)) = (self.slots.get_mut(harness), self.sources.get(&want)) else {
            return;
        };
        let rebind = rebind((&slot.source, slot.generation), (&want, s.generation));
        if rebind == Rebind::Stay {
            return;
        }
        slot.source = want;
        slot.client = s.client.clone();
        slot.generation = s.generation;
        // A machine moved to another source is unverified: tell it what that source answered.
        if rebind == Rebind::Moved
            && let Some(caps) = s.caps.clone()
        {
            self.input(harness, Input::CapabilitiesKnown(caps));
        }
    }
}
