//! The relay daemon: one actor that owns a [`Relay`] machine per leased harness and executes
//! their commands.
//!
//! # Shape (REQ-23)
//!
//! The actor is a single task. It never awaits the network, a process or an upload: every lease
//! call, process wait, success check and receipt upload runs in a task of its own and posts its
//! result back as a [`Msg`] (run records go to one writer task, in order; only the few-KiB
//! context file is written in place, unsynced, because the check or agent that reads it starts
//! next). Timers come from [`Relay::poll_timeout`] and the harness schedules;
//! the actor sleeps until the earliest. Tasks that belong to a run are tracked by run id and
//! aborted when the run's final record is written, so nothing an attempt started outlives it.
//!
//! # Files
//!
//! `<state>/jobs/<harness>/<run_id>.log` (run log), `.relay.json` (context file, 0600) and
//! `.summary` beside it; run records under `<state>/runs/` ([`crate::journal`]); the control
//! socket `<state>/control.sock` ([`control`]). No lease token and no header value is written
//! anywhere: tokens live inside the lease commands only, for the life of the call.

pub mod control;
pub mod load;
mod metrics;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use relay_core::Millis;
use relay_core::config::{FileKind, Harness};
use relay_core::relay::{
    self, Capabilities, Command, Input, Relay, RunOutcome, RunRecord, StopReason,
};
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::AbortHandle;

use crate::clock::SharedClock;
use crate::journal::{DaemonLock, Journal};
use crate::lease::{DoorbellListener, LeaseClient, ReceiptClient, SessionNews, Transport};
use crate::runner::{self, AgentSpec, CheckSpec, ProcessGroup};

pub use metrics::{DaemonMetrics, serve_metrics};

/// What `relay daemon` needs besides the config file.
pub struct DaemonOptions {
    pub config: PathBuf,
    pub state_dir: PathBuf,
    /// The host name in claimant labels.
    pub host: String,
    pub clock: SharedClock,
    pub transport: Arc<dyn Transport>,
    /// The environment processes start from (the daemon's own, normally).
    pub daemon_env: Vec<(String, String)>,
    /// Seeds the relays' retry jitter.
    pub seed: u64,
}

/// A message to the actor.
#[derive(Debug)]
pub enum Msg {
    /// An input for one harness's machine (answers, process and check events).
    ToHarness { harness: String, input: Input },
    /// The lease client's session changed for a source (`queue.<name>`).
    Session { source: String, news: SessionNews },
    /// The source's session expired and the lease client could not open a new one: start
    /// initializing it (nothing else would, since no claim is made while it is unverified).
    Reinitialize { source: String },
    /// A trigger fired a harness.
    Fire { harness: String, trigger: String },
    /// A request from the control socket.
    Control {
        request: control::Request,
        reply: oneshot::Sender<Value>,
    },
    /// Stop: abort attempts in flight (release or fail them), then return.
    Stop,
}

/// A cheap handle to a running daemon.
#[derive(Clone, Debug)]
pub struct DaemonHandle {
    tx: mpsc::UnboundedSender<Msg>,
}

impl DaemonHandle {
    /// Fires a harness as `relay trigger` does.
    pub fn trigger(&self, harness: &str) {
        let _ = self.tx.send(Msg::Fire {
            harness: harness.to_string(),
            trigger: "manual".into(),
        });
    }
    /// Asks the daemon to stop; [`Daemon::run`] returns once attempts in flight are closed.
    pub fn stop(&self) {
        let _ = self.tx.send(Msg::Stop);
    }
    pub(crate) fn send(&self, msg: Msg) -> bool {
        self.tx.send(msg).is_ok()
    }
}

struct Slot {
    relay: Relay,
    harness: Harness,
    source: String,
    next_fire: Option<Millis>,
    /// Process groups of running agents and checks, by run.
    agents: BTreeMap<u64, ProcessGroup>,
    checks: BTreeMap<u64, ProcessGroup>,
    /// Runs whose context file could not be written: their spawn fails with this error.
    unwritable: BTreeMap<u64, String>,
    /// Tasks started for a run (lease calls, uploads, waits), aborted when it closes.
    tasks: BTreeMap<u64, Vec<AbortHandle>>,
}

struct SourceSlot {
    client: Arc<LeaseClient>,
    /// The task (re-)initializing the session, while one runs.
    initializing: Option<AbortHandle>,
    caps: Option<Capabilities>,
    harnesses: Vec<String>,
    url: String,
    header_names: Vec<String>,
}

/// The daemon. Build with [`Daemon::start`], then [`Daemon::run`].
pub struct Daemon {
    clock: SharedClock,
    tx: mpsc::UnboundedSender<Msg>,
    rx: mpsc::UnboundedReceiver<Msg>,
    journal: Journal,
    /// Held for the daemon's life: one daemon per state dir.
    _lock: DaemonLock,
    /// Run records (and the `keep_runs` to prune to after a closing one) for the writer task.
    records: mpsc::UnboundedSender<(RunRecord, usize)>,
    writer: tokio::task::JoinHandle<()>,
    daemon_env: Vec<(String, String)>,
    config: relay_core::config::Config,
    slots: BTreeMap<String, Slot>,
    sources: BTreeMap<String, SourceSlot>,
    cairns: BTreeMap<String, Arc<ReceiptClient>>,
    /// Background tasks that are not a run's: session set-up, doorbells, the control socket.
    background: Vec<AbortHandle>,
    /// Tells the doorbell listeners to stop.
    doorbells_stop: watch::Sender<bool>,
    metrics: Arc<DaemonMetrics>,
    stopping: bool,
}

impl Daemon {
    /// Loads the config, locks and reconciles the state dir (REQ-15), builds a machine per
    /// leased harness and starts the lease sessions, doorbells and the control socket.
    pub async fn start(opts: DaemonOptions) -> Result<(Daemon, DaemonHandle), String> {
        let loaded = load::load(&opts.config, FileKind::Global)?;
        let state_dir = std::path::absolute(&opts.state_dir).unwrap_or(opts.state_dir.clone());
        // Creates the state dir (mode 0700) when missing: it holds the control socket, the
        // run logs and the context files.
        let journal = Journal::open(&state_dir)
            .map_err(|e| format!("{e} (the state dir: choose a writable --state-dir)"))?;
        let lock = journal.lock().map_err(|e| e.to_string())?;
        let now = opts.clock.now();
        let reconciled = journal.reconcile(now).map_err(|e| e.to_string())?;
        for r in &reconciled {
            tracing::warn!(harness = %r.harness, run_id = r.run_id, "run left running by an earlier daemon recorded interrupted; its lease is left to lapse");
        }
        let facts = load::host_facts(
            &loaded.config_dir,
            Path::new(journal.jobs_dir()),
            &opts.host,
        );
        let resolved = &loaded.resolved;
        let config = resolved.config.clone();
        let (tx, rx) = mpsc::unbounded_channel();
        let metrics = Arc::new(DaemonMetrics::default());

        let mut sources = BTreeMap::new();
        for (name, q) in &config.queues {
            let Some(client) = LeaseClient::from_config(resolved, name, opts.transport.clone())
            else {
                continue;
            };
            sources.insert(
                format!("queue.{name}"),
                SourceSlot {
                    client: Arc::new(client),
                    initializing: None,
                    caps: None,
                    harnesses: Vec::new(),
                    url: q.endpoint.url.as_str().to_string(),
                    header_names: q.endpoint.headers.keys().cloned().collect(),
                },
            );
        }
        let mut cairns = BTreeMap::new();
        for name in config.cairns.keys() {
            if let Some(client) = ReceiptClient::from_config(resolved, name, opts.transport.clone())
            {
                cairns.insert(format!("cairn.{name}"), Arc::new(client));
            }
        }

        let mut slots = BTreeMap::new();
        for h in config.harnesses.values() {
            let Some(r) = &h.relay else {
                tracing::warn!(harness = %h.name, "harness has no lease: relay runs leased harnesses only; it is not started");
                continue;
            };
            let prompt = load::prompt(h.prompt_file.as_deref(), &facts)?;
            let Some(settings) = relay::harness_settings(resolved, &h.name, &facts, prompt) else {
                continue;
            };
            let first = journal.next_run_id(&h.name).map_err(|e| e.to_string())?;
            let seed = opts.seed ^ fnv(&h.name);
            let source = format!("queue.{}", r.lease);
            if let Some(s) = sources.get_mut(&source) {
                s.harnesses.push(h.name.clone());
            }
            let next_fire = h.schedule.as_ref().map(|s| s.next_after(now));
            metrics.harness(&h.name);
            slots.insert(
                h.name.clone(),
                Slot {
                    relay: Relay::new(settings, seed, first),
                    harness: h.clone(),
                    source,
                    next_fire,
                    agents: BTreeMap::new(),
                    checks: BTreeMap::new(),
                    unwritable: BTreeMap::new(),
                    tasks: BTreeMap::new(),
                },
            );
        }

        let (doorbells_stop, _) = watch::channel(false);
        let (records, writer) = record_writer(journal.clone());
        let mut daemon = Daemon {
            clock: opts.clock,
            tx: tx.clone(),
            rx,
            journal,
            _lock: lock,
            records,
            writer,
            daemon_env: opts.daemon_env,
            config,
            slots,
            sources,
            cairns,
            background: Vec::new(),
            doorbells_stop,
            metrics,
            stopping: false,
        };
        daemon.start_sessions();
        daemon.start_doorbells(resolved, opts.transport.clone());
        let control = control::serve(&state_dir, DaemonHandle { tx: tx.clone() })
            .map_err(|e| e.to_string())?;
        daemon.background.push(control);
        Ok((daemon, DaemonHandle { tx }))
    }

    pub fn metrics(&self) -> Arc<DaemonMetrics> {
        self.metrics.clone()
    }

    /// One task per lease source: initialize (and re-try with capped backoff until the server
    /// answers), then tell every bound harness what the server supports.
    fn start_sessions(&mut self) {
        let bound: Vec<String> = self
            .sources
            .iter()
            .filter(|(_, s)| !s.harnesses.is_empty())
            .map(|(n, _)| n.clone())
            .collect();
        for source in bound {
            self.initialize(&source);
        }
    }

    /// Initializes the source's session on a task, retrying with capped backoff until the
    /// server answers; at most one such task per source at a time. At start, and on
    /// [`Msg::Reinitialize`].
    fn initialize(&mut self, source: &str) {
        let Some(s) = self.sources.get_mut(source) else {
            return;
        };
        if s.initializing.as_ref().is_some_and(|t| !t.is_finished()) {
            return;
        }
        let client = s.client.clone();
        let tx = self.tx.clone();
        let name = source.to_string();
        let task = tokio::spawn(async move {
            let mut delay = Duration::from_millis(500);
            loop {
                match client.initialize().await {
                    Ok(caps) => {
                        let _ = tx.send(Msg::Session {
                            source: name,
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

    /// One doorbell listener per channel that triggers a started harness.
    fn start_doorbells(
        &mut self,
        resolved: &relay_core::config::ResolvedConfig,
        transport: Arc<dyn Transport>,
    ) {
        for (name, ch) in &self.config.channels.clone() {
            let rung: Vec<String> = self
                .slots
                .values()
                .filter(|s| s.harness.triggers.iter().any(|t| t == name))
                .map(|s| s.harness.name.clone())
                .collect();
            if rung.is_empty() || !ch.enabled {
                continue;
            }
            let Some(listener) = DoorbellListener::from_config(resolved, name, transport.clone())
            else {
                continue;
            };
            let (ring_tx, mut ring_rx) = mpsc::channel(16);
            let listener = listener.spawn(ring_tx, self.doorbells_stop.subscribe());
            self.background.push(listener.abort_handle());
            let tx = self.tx.clone();
            let trigger = format!("channel.{name}");
            let task = tokio::spawn(async move {
                while ring_rx.recv().await.is_some() {
                    for h in &rung {
                        let _ = tx.send(Msg::Fire {
                            harness: h.clone(),
                            trigger: trigger.clone(),
                        });
                    }
                }
            });
            self.background.push(task.abort_handle());
        }
    }

    /// Runs until stopped and every attempt in flight is closed.
    pub async fn run(mut self) {
        loop {
            if self.stopping && self.slots.values().all(|s| !s.relay.in_flight()) {
                break;
            }
            let now = self.clock.now();
            let wait = self
                .next_deadline()
                .map(|d| Duration::from_millis(d.saturating_sub(now)));
            let msg = match wait {
                Some(wait) => tokio::select! {
                    msg = self.rx.recv() => msg,
                    () = tokio::time::sleep(wait) => { self.on_time(); continue; }
                },
                None => self.rx.recv().await,
            };
            match msg {
                Some(msg) => self.handle(msg),
                None => break,
            }
        }
        for slot in self.slots.values_mut() {
            for (_, tasks) in std::mem::take(&mut slot.tasks) {
                tasks.iter().for_each(AbortHandle::abort);
            }
        }
        let _ = self.doorbells_stop.send(true);
        self.background.iter().for_each(AbortHandle::abort);
        for s in self.sources.values() {
            s.initializing.iter().for_each(AbortHandle::abort);
        }
        control::remove(self.journal.state_dir());
        // Every record is on disk before `run` returns.
        drop(self.records);
        let _ = self.writer.await;
    }

    fn next_deadline(&self) -> Option<Millis> {
        self.slots
            .values()
            .flat_map(|s| {
                let fire = if self.stopping { None } else { s.next_fire };
                [s.relay.poll_timeout().map(|(at, _)| at), fire]
            })
            .flatten()
            .min()
    }

    fn on_time(&mut self) {
        let now = self.clock.now();
        let names: Vec<String> = self.slots.keys().cloned().collect();
        for name in names {
            let slot = self.slots.get_mut(&name).expect("slot exists");
            if slot.relay.poll_timeout().is_some_and(|(at, _)| at <= now) {
                slot.relay.handle_timeout(now);
                self.drain(&name);
            }
            let slot = self.slots.get_mut(&name).expect("slot exists");
            if !self.stopping
                && let Some(at) = slot.next_fire
                && at <= now
            {
                slot.next_fire = slot.harness.schedule.as_ref().map(|s| s.next_after(now));
                self.fire(&name, "schedule");
            }
        }
    }

    fn handle(&mut self, msg: Msg) {
        match msg {
            Msg::ToHarness { harness, input } => {
                if matches!(input, Input::HeartbeatFailed { .. }) {
                    self.metrics.heartbeat_failure(&harness);
                }
                self.input(&harness, input);
            }
            Msg::Session { source, news } => self.session(&source, news),
            Msg::Reinitialize { source } => self.initialize(&source),
            Msg::Fire { harness, trigger } => {
                if !self.stopping {
                    self.fire(&harness, &trigger);
                }
            }
            Msg::Control { request, reply } => self.control(request, reply),

            Msg::Stop => {
                self.stopping = true;
                let names: Vec<String> = self.slots.keys().cloned().collect();
                for name in names {
                    self.input(
                        &name,
                        Input::StopRequested {
                            reason: StopReason::Shutdown,
                        },
                    );
                }
            }
        }
    }

    fn session(&mut self, source: &str, news: SessionNews) {
        let Some(s) = self.sources.get_mut(source) else {
            return;
        };
        let input = match news {
            // The client has logged the one ERROR of an unsupported initialize (REQ-19).
            SessionNews::Known(caps) => {
                s.caps = Some(caps.clone());
                Input::CapabilitiesKnown(caps)
            }
            SessionNews::Expired => {
                s.caps = None;
                Input::SessionExpired
            }
        };
        for h in s.harnesses.clone() {
            self.input(&h, input.clone());
        }
    }

    fn fire(&mut self, harness: &str, trigger: &str) {
        let now = self.clock.now();
        let Some(slot) = self.slots.get(harness) else {
            tracing::warn!(harness, "fired a harness that is not running; ignored");
            return;
        };
        let within_hours = slot
            .harness
            .operating_hours
            .as_ref()
            .is_none_or(|h| h.contains(now));
        self.input(
            harness,
            Input::Firing {
                trigger: trigger.to_string(),
                within_hours,
            },
        );
    }

    fn input(&mut self, harness: &str, input: Input) {
        let now = self.clock.now();
        let Some(slot) = self.slots.get_mut(harness) else {
            return;
        };
        if let Err(e) = slot.relay.handle_input(now, input) {
            // A contract error is a bug in this shell; the machine ignored the input.
            tracing::error!(harness, error = %e, "relay machine refused an input");
        }
        self.drain(harness);
    }

    fn drain(&mut self, harness: &str) {
        loop {
            let Some(slot) = self.slots.get_mut(harness) else {
                return;
            };
            let Some(cmd) = slot.relay.poll_command() else {
                return;
            };
            self.execute(harness, cmd);
        }
    }

    fn post(&self, harness: &str, input: Input) {
        let _ = self.tx.send(Msg::ToHarness {
            harness: harness.to_string(),
            input,
        });
    }

    fn run_log(&self, harness: &str, run_id: u64) -> PathBuf {
        self.journal.run_log(harness, run_id)
    }

    fn slot(&mut self, harness: &str) -> &mut Slot {
        self.slots
            .get_mut(harness)
            .expect("commands come from a slot's machine")
    }

    fn execute(&mut self, harness: &str, cmd: Command) {
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
                if let Some(group) = self.slot(harness).agents.get(&run_id)
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
                match runner::run_check(spec) {
                    Ok(check) => {
                        self.slot(harness).checks.insert(run_id, check.group());
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
                let closed = record.outcome != RunOutcome::Running;
                if closed {
                    self.metrics.run_closed(&record);
                }
                let keep = self.slot(harness).harness.keep_runs as usize;
                let _ = self.records.send((record, keep));
                if closed {
                    let slot = self.slot(harness);
                    slot.agents.remove(&run_id);
                    slot.checks.remove(&run_id);
                    slot.unwritable.remove(&run_id);
                    for task in slot.tasks.remove(&run_id).unwrap_or_default() {
                        task.abort();
                    }
                }
            }
            Command::Emit { event } => {
                let fields = serde_json::to_string(&event).unwrap_or_default();
                tracing::info!(target: "relay::event", harness, event = %fields, "relay event");
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

    /// A lease call on a task of its own; its session news, then its answer, come back.
    fn lease_call(&mut self, harness: &str, cmd: Command) {
        let run_id = cmd.run_id();
        let source = self.slot(harness).source.clone();
        let Some(s) = self.sources.get(&source) else {
            return;
        };
        let client = s.client.clone();
        let tx = self.tx.clone();
        let h = harness.to_string();
        let task = tokio::spawn(async move {
            let Ok(outcome) = client.execute(&cmd).await else {
                return;
            };
            // The client has logged any error, with its source and operation.
            let expired = matches!(outcome.session.last(), Some(SessionNews::Expired));
            for news in outcome.session {
                let _ = tx.send(Msg::Session {
                    source: source.clone(),
                    news,
                });
            }
            if expired {
                let _ = tx.send(Msg::Reinitialize {
                    source: source.clone(),
                });
            }
            let _ = tx.send(Msg::ToHarness {
                harness: h,
                input: outcome.input,
            });
        });
        self.track(harness, run_id, task.abort_handle());
    }

    /// Starts the agent (a fork and exec; nothing here waits for it) and hands its wait to a
    /// task that posts the exit.
    fn spawn(&mut self, harness: &str, cmd: Command) {
        let run_id = cmd.run_id();
        if let Some(error) = self.slot(harness).unwritable.remove(&run_id) {
            self.post(harness, Input::SpawnFailed { run_id, error });
            return;
        }
        let log = self.run_log(harness, run_id);
        let Some(spec) = AgentSpec::from_command(cmd, self.daemon_env.clone(), log) else {
            return;
        };
        match runner::spawn_agent(spec) {
            Ok(agent) => {
                self.slot(harness).agents.insert(run_id, agent.group());
                // Queued before the wait starts, so the machine hears of the spawn before the
                // exit of a process that ends at once.
                self.post(harness, Input::ProcessSpawned { run_id });
                let tx = self.tx.clone();
                let h = harness.to_string();
                let task = agent.deliver(move |input| {
                    let _ = tx.send(Msg::ToHarness { harness: h, input });
                });
                self.track(harness, run_id, task.abort_handle());
            }
            Err(e) => self.post(harness, e.into()),
        }
    }

    fn track(&mut self, harness: &str, run_id: u64, task: AbortHandle) {
        let slot = self.slots.get_mut(harness).expect("slot exists");
        let tasks = slot.tasks.entry(run_id).or_default();
        tasks.retain(|t| !t.is_finished());
        tasks.push(task);
    }

    fn control(&mut self, request: control::Request, reply: oneshot::Sender<Value>) {
        match request {
            control::Request::Trigger { harness } => {
                if !self.slots.contains_key(&harness) {
                    let _ = reply.send(control::error(format!(
                        "no leased harness named {harness:?} runs in this daemon; see `relay describe` for the names"
                    )));
                    return;
                }
                self.fire(&harness, "manual");
                let _ = reply.send(json!({"ok": true, "harness": harness}));
            }
            control::Request::Describe { harness } => {
                let names: Vec<&String> = match &harness {
                    Some(h) => self.slots.keys().filter(|k| *k == h).collect(),
                    None => self.slots.keys().collect(),
                };
                if let Some(h) = &harness
                    && names.is_empty()
                {
                    let _ = reply.send(control::error(format!(
                        "no leased harness named {h:?} runs in this daemon"
                    )));
                    return;
                }
                let harnesses: Vec<Value> = names
                    .into_iter()
                    .map(|name| {
                        let slot = &self.slots[name];
                        let source = &self.sources[&slot.source];
                        json!({
                            "relay": slot.relay.describe(),
                            "source": {
                                "name": slot.source,
                                "url": source.url,
                                "header_names": source.header_names,
                                "session": match &source.caps {
                                    None => "unverified",
                                    Some(c) if c.supported() => "supported",
                                    Some(_) => "unsupported",
                                },
                            },
                            "schedule": slot.next_fire.map(relay_core::time::rfc3339),
                            "triggers": slot.harness.triggers,
                        })
                    })
                    .collect();
                let _ = reply.send(json!({"ok": true, "harnesses": harnesses}));
            }
            control::Request::Doctor => {
                let mut rows: Vec<relay::doctor::Row> = relay::doctor::binding_rows(&self.config);
                let clients: Vec<(String, Arc<LeaseClient>)> = self
                    .sources
                    .iter()
                    .filter(|(_, s)| !s.harnesses.is_empty())
                    .map(|(n, s)| (n.clone(), s.client.clone()))
                    .collect();
                tokio::spawn(async move {
                    for (name, client) in clients {
                        let rows_for = match client.tools_list().await {
                            Ok(list) => relay::doctor::source_rows(
                                &name,
                                Ok(&relay::check_capabilities(&list.tools)),
                            ),
                            Err(e) => relay::doctor::source_rows(&name, Err(&e.to_string())),
                        };
                        rows.extend(rows_for);
                    }
                    let _ = reply.send(json!({"ok": true, "rows": rows}));
                });
            }
        }
    }
}

/// The one task that writes run records, in the order the machines wrote them (a run's
/// records replace one another), each synced to disk, off the actor; after a run's closing
/// record it prunes the harness to its `keep_runs`.
fn record_writer(
    journal: Journal,
) -> (
    mpsc::UnboundedSender<(RunRecord, usize)>,
    tokio::task::JoinHandle<()>,
) {
    let (tx, mut rx) = mpsc::unbounded_channel::<(RunRecord, usize)>();
    let task = tokio::spawn(async move {
        while let Some((record, keep)) = rx.recv().await {
            let journal = journal.clone();
            let done = tokio::task::spawn_blocking(move || {
                if let Err(e) = journal.write_record(&record) {
                    tracing::error!(harness = %record.harness, run_id = record.run_id, error = %e, "run record not written");
                }
                if record.outcome != RunOutcome::Running
                    && let Err(e) = journal.prune(&record.harness, keep)
                {
                    tracing::warn!(harness = %record.harness, error = %e, "old runs not pruned");
                }
            })
            .await;
            if done.is_err() {
                tracing::error!("the run record writer failed");
            }
        }
    });
    (tx, task)
}

/// A stable 64-bit hash of a name, to give each harness its own jitter stream from one seed.
fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}
