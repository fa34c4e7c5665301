//! The relay daemon: one actor that owns a [`Relay`] machine per leased harness and executes
//! their commands.
//!
//! # Shape
//!
//! The actor is a single task. It never awaits the network, a process or an upload: every lease
//! call, process wait, success check and receipt upload runs in a task of its own and posts its
//! result back as a [`Msg`] (run records go to one writer task, in order; only the few-KiB
//! context file is written in place, unsynced, because the check or agent that reads it starts
//! next). The machines and the rules around them (schedules, `catch_up`, source binding, what a
//! reload stops, the next wake-up) are a [`Fleet`]; the actor sleeps until its next wake-up. Tasks that belong to a run are tracked by run id and
//! aborted when the run's final record is written, so nothing an attempt started outlives it.
//!
//! # Reload
//!
//! SIGHUP and `relay reload` read the config again through [`load::prepare`], the loader of a
//! start, on a blocking task; a config that does not load changes nothing. What changed is
//! `relay_core::config::diff`'s answer, and the daemon applies it: added harnesses start; a
//! harness that is removed (or loses its `lease`), or whose attempt runs on a removed lease
//! source, is stopped with `StopReason::HarnessRemoved` and its slot goes once the attempt has
//! closed; every other harness gets its new settings through `Relay::reconfigure`, which keeps an
//! attempt in flight on the settings it started with. A lease source whose url, headers or
//! credentials changed gets a new client and session; its harnesses hear `SessionExpired`, then
//! the new capabilities. An attempt keeps the client it claimed with until it closes (so a
//! release still reaches the server that holds its lease); a harness is re-bound to its source's
//! current client between attempts.
//!
//! # Files
//!
//! `<state>/jobs/<harness>/<run_id>.log` (run log), `.relay.json` (context file, 0600),
//! `.summary` and `.usage.json` (the agent's usage file, created empty with mode 0600, read before
//! each heartbeat and report) beside it; run records under `<state>/runs/` ([`crate::journal`]); the control
//! socket `<state>/control.sock` ([`control`]). No lease token and no header value is written
//! anywhere: tokens live inside the lease commands only, for the life of the call.

mod commands;
pub mod control;
pub mod doctor;
pub mod events;
pub mod load;
mod metrics;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use relay_core::Millis;
use relay_core::config::{ConfigDiff, ResolvedConfig};
use relay_core::fleet::{CATCH_UP, Due, Fleet, Settled};
use relay_core::relay::{
    self, Capabilities, Command, HarnessSettings, Input, Reconfigured, RunOutcome, RunRecord,
    StopReason, UsageFile,
};
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::AbortHandle;

use crate::clock::SharedClock;
use crate::journal::{DaemonLock, Journal};
use relay_core::mcp::client::{Subscriptions, channel_subscriptions};

use crate::lease::{DoorbellListener, LeaseClient, ReceiptClient, SessionNews, Transport};
use crate::runner::{self, AgentSpec, CheckSpec, Control, Launched, Launcher};

pub use metrics::{DaemonMetrics, serve_metrics};

/// The longest the actor sleeps while a timer is set. Tokio's timers run on `CLOCK_MONOTONIC`,
/// which stops while the machine is suspended, whereas the machines' deadlines run on boot time,
/// which does not: waking at least this often means a lease that lapsed during a suspend stops
/// its agent within this long of the resume.
const MAX_SLEEP: Duration = Duration::from_secs(1);

/// The shell-sim sweep's planted defect, in a madsim build only: while it is on, the daemon
/// drops every signal the machine sends an agent (so an agent whose lease was lost goes on
/// working). The sweep's `--canary` run turns it on and must see its checks catch it.
#[cfg(madsim)]
pub mod canary {
    use std::sync::atomic::{AtomicBool, Ordering};

    static ON: AtomicBool = AtomicBool::new(false);

    pub fn set(on: bool) {
        ON.store(on, Ordering::Relaxed);
    }

    pub(crate) fn on() -> bool {
        ON.load(Ordering::Relaxed)
    }
}

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
    /// Starts the agents and checks: `runner::Processes` (real children), or a model of them.
    pub launcher: Arc<dyn Launcher>,
}

/// A message to the actor.
#[derive(Debug)]
pub enum Msg {
    /// An input for one harness's machine (answers, process and check events).
    ToHarness { harness: String, input: Input },
    /// The session of a source's client (`queue.<name>`) changed. `generation` names the
    /// client: news of a client a reload replaced is ignored.
    Session {
        source: String,
        generation: u64,
        news: SessionNews,
    },
    /// The source's session expired and the lease client could not open a new one: start
    /// initializing it (nothing else would, since no claim is made while it is unverified).
    Reinitialize { source: String, generation: u64 },
    /// A trigger fired a harness.
    Fire { harness: String, trigger: String },
    /// A channel's doorbell rang: fire the harnesses it triggers now.
    Ring { channel: String },
    /// A request from the control socket.
    Control {
        request: control::Request,
        reply: oneshot::Sender<Value>,
    },
    /// `relay events`: the recent events, and a subscription with `follow`.
    Events {
        follow: bool,
        reply: oneshot::Sender<events::Feed>,
    },
    /// SIGHUP, or `relay reload` (which awaits the answer).
    Reload {
        reply: Option<oneshot::Sender<Value>>,
    },
    /// The reload's config, loaded off the actor.
    Reloaded {
        prepared: Box<Result<load::Prepared, String>>,
        reply: Option<oneshot::Sender<Value>>,
    },
    /// Stop: abort attempts in flight (release or fail them), then return.
    Stop,
    /// An agent's process started (or did not), off the actor: see `Daemon::spawn`.
    Spawned {
        harness: String,
        run_id: u64,
        agent: Box<Result<Launched, runner::StartError>>,
    },
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
    /// Re-reads the config, as SIGHUP does; the outcome is logged.
    pub fn reload(&self) {
        let _ = self.tx.send(Msg::Reload { reply: None });
    }
    /// Asks the daemon to stop; [`Daemon::run`] returns once attempts in flight are closed.
    pub fn stop(&self) {
        let _ = self.tx.send(Msg::Stop);
    }
    pub(crate) fn send(&self, msg: Msg) -> bool {
        self.tx.send(msg).is_ok()
    }
}

/// The IO side of a harness of the fleet (its rules are `relay_core::fleet`'s).
struct Slot {
    /// The source (`queue.<name>`) and client the machine's attempts run on. Re-bound to the
    /// source its settings name only while no attempt is in flight.
    source: String,
    client: Arc<LeaseClient>,
    generation: u64,
    /// Running agents and checks (their process groups, for real ones), by run.
    agents: BTreeMap<u64, Arc<dyn Control>>,
    /// Runs whose agent is being started off the actor, with the signals the machine sent it
    /// meanwhile (delivered once the process exists). A run that closes first leaves this map,
    /// and its process, when it comes, is killed at once.
    spawning: BTreeMap<u64, Vec<relay_core::relay::Signal>>,
    checks: BTreeMap<u64, Arc<dyn Control>>,
    /// Runs whose context file could not be written: their spawn fails with this error.
    unwritable: BTreeMap<u64, String>,
    /// The usage file of each run whose agent was spawned, and its reading so far; read before
    /// each of the run's heartbeats and reports.
    usage: BTreeMap<u64, (PathBuf, UsageFile)>,
    /// Tasks started for a run (lease calls, uploads, waits), aborted when it closes.
    tasks: BTreeMap<u64, Vec<AbortHandle>>,
}

struct SourceSlot {
    client: Arc<LeaseClient>,
    /// Names this client; a new one (a reload that changed the session) gets a new number.
    generation: u64,
    /// The task (re-)initializing the session, while one runs.
    initializing: Option<AbortHandle>,
    caps: Option<Capabilities>,
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
    /// Run records (and the `keep_runs` to prune to after a closing one), and flushes, for the
    /// writer task.
    records: mpsc::UnboundedSender<RecordJob>,
    /// A test's kill -9 at a named step (`RELAY_TEST_KILL_AT`); `None` in production.
    kill_at: Option<KillAt>,
    writer: tokio::task::JoinHandle<()>,
    daemon_env: Vec<(String, String)>,
    config_path: PathBuf,
    host: String,
    seed: u64,
    transport: Arc<dyn Transport>,
    launcher: Arc<dyn Launcher>,
    /// The config running now (its `Debug` shows no secret).
    resolved: ResolvedConfig,
    /// The machines and the rules around them; `slots` holds the IO of the same harnesses.
    fleet: Fleet,
    slots: BTreeMap<String, Slot>,
    /// The highest run id each harness has written a record for in this daemon: a harness a
    /// reload removes and adds back continues after it, even while its records are still on
    /// their way to disk.
    last_run_ids: BTreeMap<String, u64>,
    sources: BTreeMap<String, SourceSlot>,
    next_generation: u64,
    cairns: BTreeMap<String, Arc<ReceiptClient>>,
    /// The doorbell listener (and its forwarding task) of each channel that triggers a harness.
    /// Per channel: the listener and its forwarder, and the queues a modern listen subscribes
    /// to (a reload that changes them restarts the listener).
    doorbells: BTreeMap<String, ([AbortHandle; 2], Subscriptions)>,
    /// Background tasks that are not a run's: session set-up, the control socket.
    background: Vec<AbortHandle>,
    /// Tells the doorbell listeners to stop.
    doorbells_stop: watch::Sender<bool>,
    events: events::EventLog,
    metrics: Arc<DaemonMetrics>,
}

impl Daemon {
    /// Loads the config, locks and reconciles the state dir (runs a crash left open), builds a
    /// machine per leased harness and starts the lease sessions, doorbells and the control
    /// socket.
    pub async fn start(opts: DaemonOptions) -> Result<(Daemon, DaemonHandle), String> {
        let state_dir = std::path::absolute(&opts.state_dir).unwrap_or(opts.state_dir.clone());
        // A config that does not load leaves no trace: it is read before the state dir is made.
        let prepared = load::prepare(&opts.config, &state_dir.join("jobs"), &opts.host)?;
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
        let (tx, rx) = mpsc::unbounded_channel();
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
            kill_at: KillAt::from_env(),
            daemon_env: opts.daemon_env,
            config_path: opts.config,
            host: opts.host,
            seed: opts.seed,
            transport: opts.transport,
            launcher: opts.launcher,
            resolved: prepared.resolved.clone(),
            fleet: Fleet::default(),
            slots: BTreeMap::new(),
            last_run_ids: BTreeMap::new(),
            sources: BTreeMap::new(),
            next_generation: 1,
            cairns: BTreeMap::new(),
            doorbells: BTreeMap::new(),
            background: Vec::new(),
            doorbells_stop,
            events: events::EventLog::default(),
            metrics: Arc::new(DaemonMetrics::default()),
        };
        for name in prepared.resolved.config.queues.keys() {
            daemon.add_source(&prepared.resolved, name);
        }
        daemon.set_cairns(&prepared.resolved);
        for (name, settings) in prepared.settings {
            daemon.add_slot(&name, settings)?;
            daemon.owe_catch_up(&name, now);
        }
        let bound: Vec<String> = daemon.fleet.bound_sources();
        for source in bound {
            daemon.initialize(&source);
        }
        daemon.reconcile_doorbells(&ConfigDiff::default());
        let control = control::serve(&state_dir, DaemonHandle { tx: tx.clone() })
            .map_err(|e| e.to_string())?;
        daemon.background.push(control);
        Ok((daemon, DaemonHandle { tx }))
    }

    pub fn metrics(&self) -> Arc<DaemonMetrics> {
        self.metrics.clone()
    }

    /// A client for `[queue.<name>]`, not yet initialized.
    fn add_source(&mut self, resolved: &ResolvedConfig, name: &str) {
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

    fn set_cairns(&mut self, resolved: &ResolvedConfig) {
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

    fn add_slot(&mut self, name: &str, settings: HarnessSettings) -> Result<(), String> {
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
        let wall = self.clock.now();
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
    fn owe_catch_up(&mut self, name: &str, now: Millis) {
        if !self.fleet.catches_up(name) {
            return;
        }
        let last = match self.journal.records(name, 1) {
            Ok(records) => records
                .first()
                .and_then(|r| relay_core::time::parse_rfc3339(&r.started_at)),
            Err(e) => {
                tracing::warn!(harness = name, error = %e, "catch_up: the last run could not be read; nothing is caught up");
                return;
            }
        };
        if let Some(missed) = self.fleet.owe_catch_up(name, last, now) {
            tracing::info!(harness = name, missed = %relay_core::time::rfc3339(missed), "a schedule slot was missed while the daemon was down; catch_up fires once");
        }
    }

    /// Initializes the source's session on a task, retrying with capped backoff until the
    /// server answers; at most one such task per source at a time. At start, on
    /// [`Msg::Reinitialize`], and for a new or changed source on reload.
    fn initialize(&mut self, source: &str) {
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
    fn reconcile_doorbells(&mut self, diff: &ConfigDiff) {
        let wanted: Vec<String> = self
            .resolved
            .config
            .channels
            .values()
            .filter(|ch| ch.enabled)
            .filter(|ch| !self.fleet.rung(&ch.name).is_empty())
            .map(|ch| ch.name.clone())
            .collect();
        let config = &self.resolved.config;
        let changed = |name: &str, subscriptions: &Subscriptions| {
            diff.channels
                .changed
                .iter()
                .any(|c| c == &format!("channel.{name}"))
                || *subscriptions != channel_subscriptions(config, name)
        };
        let stale: Vec<String> = self
            .doorbells
            .iter()
            .filter(|(n, (_, subs))| !wanted.contains(n) || changed(n, subs))
            .map(|(n, _)| n.clone())
            .collect();
        for name in stale {
            if let Some((tasks, _)) = self.doorbells.remove(&name) {
                tasks.iter().for_each(AbortHandle::abort);
            }
        }
        for name in wanted {
            if self.doorbells.contains_key(&name) {
                continue;
            }
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
            let subscriptions = channel_subscriptions(&self.resolved.config, &name);
            self.doorbells.insert(
                name,
                (
                    [listener.abort_handle(), forward.abort_handle()],
                    subscriptions,
                ),
            );
        }
    }

    /// Runs until stopped and every attempt in flight is closed.
    pub async fn run(mut self) {
        loop {
            if self.fleet.stopped() {
                break;
            }
            let wait = self.next_wait();
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
        for (tasks, _) in self.doorbells.values() {
            tasks.iter().for_each(AbortHandle::abort);
        }
        self.background.iter().for_each(AbortHandle::abort);
        for s in self.sources.values() {
            s.initializing.iter().for_each(AbortHandle::abort);
        }
        control::remove(self.journal.state_dir());
        // Every record is on disk before `run` returns.
        drop(self.records);
        let _ = self.writer.await;
    }

    /// How long the actor may sleep: until the earliest machine timer (on the monotonic
    /// clock) or schedule firing (on the wall clock, as cron is), and never more than
    /// [`MAX_SLEEP`] while a timer is set.
    fn next_wait(&self) -> Option<Duration> {
        let wait = self.fleet.next_wake(self.clock.reading())?;
        Some(Duration::from_millis(wait).min(MAX_SLEEP))
    }

    fn on_time(&mut self) {
        for due in self.fleet.due(self.clock.reading()) {
            match due {
                Due::Timer(name) => self.input(&name, Input::TimerFired),
                Due::Schedule(name) => self.fire(&name, "schedule"),
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
            Msg::Session {
                source,
                generation,
                news,
            } => self.session(&source, generation, news),
            Msg::Spawned {
                harness,
                run_id,
                agent,
            } => self.spawned(&harness, run_id, *agent),
            Msg::Reinitialize { source, generation } => {
                if self
                    .sources
                    .get(&source)
                    .is_some_and(|s| s.generation == generation)
                {
                    self.initialize(&source);
                }
            }
            Msg::Fire { harness, trigger } => {
                if !self.fleet.stopping() {
                    self.fire(&harness, &trigger);
                }
            }
            Msg::Ring { channel } => {
                if self.fleet.stopping() {
                    return;
                }
                for h in self.fleet.rung(&channel) {
                    self.fire(&h, &format!("channel.{channel}"));
                }
            }
            Msg::Control { request, reply } => self.control(request, reply),
            Msg::Events { follow, reply } => {
                let _ = reply.send(self.events.feed(follow));
            }
            Msg::Reload { reply } => self.reload(reply),
            Msg::Reloaded { prepared, reply } => match *prepared {
                Ok(prepared) => {
                    let answer = self.apply_reload(prepared);
                    if let Some(reply) = reply {
                        let _ = reply.send(answer);
                    }
                }
                Err(e) => {
                    tracing::error!(config = %self.config_path.display(), error = %e, "reload refused: the config did not load, nothing changed");
                    if let Some(reply) = reply {
                        let _ = reply.send(control::error(format!(
                            "the config did not load, nothing changed:\n{e}"
                        )));
                    }
                }
            },
            Msg::Stop => {
                self.fleet.stop();
                for name in self.fleet.names() {
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

    fn session(&mut self, source: &str, generation: u64, news: SessionNews) {
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

    /// Starts loading the config again, off the actor.
    fn reload(&mut self, reply: Option<oneshot::Sender<Value>>) {
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
    fn apply_reload(&mut self, prepared: load::Prepared) -> Value {
        if self.fleet.stopping() {
            return control::error("the daemon is stopping".into());
        }
        let diff = relay_core::config::diff(&self.resolved, &prepared.resolved);
        let new = prepared.resolved;
        // Sources first, so that harnesses bind to what the new config names.
        for source in &diff.queues.removed {
            if let Some(s) = self.sources.remove(source) {
                s.initializing.iter().for_each(AbortHandle::abort);
            }
        }
        for source in diff.queues.added.iter().chain(&diff.new_sessions) {
            let name = source.trim_start_matches("queue.");
            self.add_source(&new, name);
            if diff.new_sessions.contains(source) {
                for h in self.fleet.harnesses_on(source) {
                    self.input(&h, Input::SessionExpired);
                }
            }
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
        let mut reconfigured = Vec::new();
        for name in &self.fleet.names() {
            let settings = prepared.settings.get(name).cloned();
            if self.fleet.reload_stops(name, settings.is_some(), &diff) {
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
            let harness = self.resolved.config.harnesses.get(name).cloned();
            let wall = self.clock.now();
            let applies = self
                .fleet
                .reload(name, settings.map(|s| (s, harness)), wall);
            if let Some(applies) = applies.filter(|a| *a != Reconfigured::Unchanged) {
                let mut entry = serde_json::to_value(applies).unwrap_or_default();
                entry["harness"] = json!(name);
                reconfigured.push(entry);
            }
            self.settle(name);
        }
        let mut added = Vec::new();
        for (name, settings) in prepared.settings {
            if self.fleet.contains(&name) {
                continue;
            }
            match self.add_slot(&name, settings) {
                Ok(()) => added.push(name),
                Err(e) => {
                    tracing::error!(harness = %name, error = %e, "the added harness did not start")
                }
            }
        }
        for source in self.fleet.bound_sources() {
            if self.sources.get(&source).is_some_and(|s| s.caps.is_none()) {
                self.initialize(&source);
            }
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

    fn fire(&mut self, harness: &str, trigger: &str) {
        let Some(firing) = self.fleet.firing(harness, trigger, self.clock.now()) else {
            tracing::warn!(harness, "fired a harness that is not running; ignored");
            return;
        };
        self.input(harness, firing);
    }

    fn input(&mut self, harness: &str, input: Input) {
        let now = self.clock.reading();
        let Some(relay) = self.fleet.relay_mut(harness) else {
            return;
        };
        if let Err(e) = relay.handle_input(now, input) {
            // A contract error is a bug in this shell; the machine ignored the input.
            tracing::error!(harness, error = %e, "relay machine refused an input");
        }
        self.drain(harness);
    }

    fn drain(&mut self, harness: &str) {
        loop {
            let Some(relay) = self.fleet.relay_mut(harness) else {
                return;
            };
            let Some(cmd) = relay.poll_command() else {
                break;
            };
            self.execute(harness, cmd);
        }
        self.settle(harness);
    }

    /// Between attempts: a removed harness's slot goes, and a harness whose settings name
    /// another source, or whose source got a new client, is bound to it.
    fn settle(&mut self, harness: &str) {
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
        if slot.source == want && slot.generation == s.generation {
            return;
        }
        let moved = slot.source != want;
        slot.source = want;
        slot.client = s.client.clone();
        slot.generation = s.generation;
        // A machine moved to another source is unverified: tell it what that source answered.
        if moved && let Some(caps) = s.caps.clone() {
            self.input(harness, Input::CapabilitiesKnown(caps));
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

    fn control(&mut self, request: control::Request, reply: oneshot::Sender<Value>) {
        let unknown = |h: &str| {
            control::error(format!(
                "no leased harness named {h:?} runs in this daemon; see `relay describe` for the names"
            ))
        };
        match request {
            control::Request::Trigger { harness } => {
                if !self.fleet.running(&harness) {
                    let _ = reply.send(unknown(&harness));
                    return;
                }
                self.fire(&harness, "manual");
                let _ = reply.send(json!({"ok": true, "harness": harness}));
            }
            control::Request::Stop { harness } => {
                let Some(member) = self.fleet.get(&harness) else {
                    let _ = reply.send(unknown(&harness));
                    return;
                };
                let Some(attempt) = member.relay().describe(self.clock.reading()).attempt else {
                    let _ = reply.send(json!({"ok": true, "harness": harness, "stopped": false}));
                    return;
                };
                let stops = member.relay().stop_would_abort();
                let answer = json!({
                    "ok": true,
                    "harness": harness,
                    "stopped": stops,
                    "run_id": attempt.run_id,
                    "todo_id": attempt.todo_id,
                    "phase": attempt.phase,
                });
                if stops {
                    tracing::info!(harness = %harness, run_id = attempt.run_id, "operator stop");
                    self.input(
                        &harness,
                        Input::StopRequested {
                            reason: StopReason::OperatorStop,
                        },
                    );
                }
                let _ = reply.send(answer);
            }
            control::Request::Reload => self.reload(Some(reply)),
            control::Request::Describe { harness } => {
                let names: Vec<&String> = match &harness {
                    Some(h) => self.slots.keys().filter(|k| *k == h).collect(),
                    None => self.slots.keys().collect(),
                };
                if let Some(h) = &harness
                    && names.is_empty()
                {
                    let _ = reply.send(unknown(h));
                    return;
                }
                let harnesses: Vec<Value> = names
                    .into_iter()
                    .map(|name| {
                        let (slot, member) =
                            (&self.slots[name], &self.fleet.get(name).expect("a member"));
                        let source = self
                            .sources
                            .get(&slot.source)
                            .filter(|s| s.generation == slot.generation);
                        let session = match source.map(|s| &s.caps) {
                            // The attempt in flight holds a client a reload replaced or removed.
                            None => "replaced",
                            Some(None) => "unverified",
                            Some(Some(c)) if c.supported() => "supported",
                            Some(Some(_)) => "unsupported",
                        };
                        json!({
                            "relay": member.relay().describe(self.clock.reading()),
                            "source": {
                                "name": slot.source,
                                "url": source.map(|s| s.url.clone()),
                                "header_names": source.map(|s| s.header_names.clone()),
                                "session": session,
                            },
                            "removed": member.removed(),
                            "schedule": member.next_fire().map(relay_core::time::rfc3339),
                            "triggers": member.harness().triggers,
                        })
                    })
                    .collect();
                let _ = reply.send(json!({"ok": true, "harnesses": harnesses}));
            }
            control::Request::Doctor => {
                let config = self.resolved.config.clone();
                let clients: Vec<(String, Arc<LeaseClient>)> =
                    relay::doctor::bound_sources(&config)
                        .into_iter()
                        .filter_map(|n| Some((n.clone(), self.sources.get(&n)?.client.clone())))
                        .collect();
                tokio::spawn(async move {
                    let rows = doctor::rows(&config, clients).await;
                    let _ = reply.send(json!({"ok": true, "rows": rows}));
                });
            }
            // The socket task asks with `Msg::Events`; a request that gets here is answered.
            control::Request::Events { .. } => {
                let _ = reply.send(control::error("events are streamed, not answered".into()));
            }
        }
    }
}

/// How many queued run records [`record_writer`] takes at once, at most.
const RECORD_BATCH: usize = 64;

/// What the record writer is asked to do.
pub(super) enum RecordJob {
    /// Write this record (and after a closing one prune the harness to this many runs).
    Write(RunRecord, usize),
    /// Answer once every record sent before it is on disk: `Err` when the newest of them for
    /// this run (harness, run id) could not be written. The spawn waits for it.
    Flush {
        run: (String, u64),
        done: oneshot::Sender<Result<(), String>>,
    },
}

/// The one task that writes run records, in the order the machines wrote them (a run's
/// records replace one another), each synced to disk, off the actor; after a run's closing
/// record it prunes the harness to its `keep_runs`. It takes every job waiting (up to
/// [`RECORD_BATCH`]) in one trip to the blocking pool, and of a run's records among them
/// writes only the newest: the older ones were already replaced in memory, and writing them
/// would only replace them on disk a file and an fsync later. Under a burst of short attempts,
/// a firing's and a claim's records are often both superseded by the closing one. The flushes
/// among the jobs are answered after the batch is written: what a spawn waits for.
fn record_writer(
    journal: Journal,
) -> (
    mpsc::UnboundedSender<RecordJob>,
    tokio::task::JoinHandle<()>,
) {
    let (tx, mut rx) = mpsc::unbounded_channel::<RecordJob>();
    let task = tokio::spawn(async move {
        let mut waiting = Vec::new();
        while rx.recv_many(&mut waiting, RECORD_BATCH).await > 0 {
            let mut writes = Vec::new();
            let mut flushes = Vec::new();
            for job in waiting.drain(..) {
                match job {
                    RecordJob::Write(record, keep) => writes.push((record, keep)),
                    RecordJob::Flush { run, done } => flushes.push((run, done)),
                }
            }
            let batch = newest_per_run(writes);
            let journal = journal.clone();
            let failed = tokio::task::spawn_blocking(move || {
                let mut failed = std::collections::HashMap::new();
                for (record, keep) in batch {
                    if let Err(e) = journal.write_record(&record) {
                        tracing::error!(harness = %record.harness, run_id = record.run_id, error = %e, "run record not written");
                        failed.insert((record.harness.clone(), record.run_id), e.to_string());
                    }
                    if record.outcome != RunOutcome::Running
                        && let Err(e) = journal.prune(&record.harness, keep)
                    {
                        tracing::warn!(harness = %record.harness, error = %e, "old runs not pruned");
                    }
                }
                failed
            })
            .await;
            let failed = failed.unwrap_or_else(|_| {
                tracing::error!("the run record writer failed");
                std::collections::HashMap::new()
            });
            for (run, done) in flushes {
                let _ = done.send(match failed.get(&run) {
                    Some(e) => Err(e.clone()),
                    None => Ok(()),
                });
            }
        }
    });
    (tx, task)
}

/// A step at which a test kills the daemon with SIGKILL, as an operator's `kill -9` or a
/// power cut would, but exactly there: `RELAY_TEST_KILL_AT` names it. Not a setting: a fault
/// injection point for the tests that prove the run record survives each step
/// (tests/daemon.rs); the daemon logs a warning at start when it is set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum KillAt {
    /// The claim's record is on disk, the context file written; the process not yet started.
    Spawn,
    /// The process started; the machine has not heard of it yet.
    Spawned,
    /// The attempt is judged; its report not yet sent.
    Report,
}

relay_core::names!(KillAt { Spawn => "spawn", Spawned => "spawned", Report => "report" });

impl KillAt {
    const VAR: &str = "RELAY_TEST_KILL_AT";

    fn from_env() -> Option<KillAt> {
        let v = std::env::var(Self::VAR).ok()?;
        let at = KillAt::parse(&v);
        match at {
            Some(at) => tracing::warn!(
                step = at.as_str(),
                "{} is set: this daemon kills itself at that step (a test's fault injection)",
                Self::VAR
            ),
            None => tracing::warn!(
                "{} names no step (spawn, spawned or report); ignored",
                Self::VAR
            ),
        }
        at
    }

    /// Kills the daemon with SIGKILL when `self` is `at`.
    pub(super) fn here(this: Option<KillAt>, at: KillAt) {
        if this == Some(at) {
            let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
        }
    }
}

/// Of `records` (oldest first), the newest of each run, in the order of those newest ones.
fn newest_per_run<T>(records: Vec<(RunRecord, T)>) -> Vec<(RunRecord, T)> {
    let mut seen = std::collections::HashSet::new();
    let mut newest: Vec<_> = records
        .into_iter()
        .rev()
        .filter(|(r, _)| seen.insert((r.harness.clone(), r.run_id)))
        .collect();
    newest.reverse();
    newest
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::journal::tests::record;

    fn runs(records: &[(RunRecord, usize)]) -> Vec<(&str, u64, RunOutcome)> {
        records
            .iter()
            .map(|(r, _)| (r.harness.as_str(), r.run_id, r.outcome))
            .collect()
    }

    #[test]
    fn only_the_newest_record_of_each_run_is_written() {
        let waiting = vec![
            (record("a", 1, RunOutcome::Running), 1),
            (record("b", 1, RunOutcome::Running), 2),
            (record("a", 1, RunOutcome::Running), 3),
            (record("a", 2, RunOutcome::Running), 4),
            (record("a", 1, RunOutcome::Success), 5),
        ];
        let batch = newest_per_run(waiting);
        assert_eq!(
            runs(&batch),
            [
                ("b", 1, RunOutcome::Running),
                ("a", 2, RunOutcome::Running),
                ("a", 1, RunOutcome::Success),
            ]
        );
        assert_eq!(batch.iter().map(|(_, k)| *k).collect::<Vec<_>>(), [2, 4, 5]);
    }

    /// Records queued before the writer runs: each run ends on disk as its newest record, and the
    /// closing one prunes.
    #[tokio::test(flavor = "current_thread")]
    async fn the_record_writer_leaves_each_run_at_its_newest_record() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::open(dir.path()).unwrap();
        let (tx, task) = record_writer(journal.clone());
        for (run_id, outcome) in [
            (1, RunOutcome::Success),
            (2, RunOutcome::Running),
            (3, RunOutcome::Running),
            (2, RunOutcome::Running),
            (3, RunOutcome::Failed),
        ] {
            tx.send(RecordJob::Write(record("a", run_id, outcome), 2))
                .unwrap();
        }
        drop(tx);
        task.await.unwrap();
        let on_disk = |run_id| journal.record("a", run_id).unwrap().map(|r| r.outcome);
        // keep_runs 2 after run 3 closed: run 1, the oldest, is pruned.
        assert_eq!(on_disk(1), None);
        assert_eq!(on_disk(2), Some(RunOutcome::Running));
        assert_eq!(on_disk(3), Some(RunOutcome::Failed));
    }

    /// What the spawn waits for: a flush answers once the records sent before it are on disk,
    /// and says so when its run's record could not be written (here: a directory stands where
    /// the record's file goes, which stops root too).
    #[tokio::test]
    async fn a_flush_answers_after_the_records_before_it_and_names_a_record_not_written() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::open(dir.path()).unwrap();
        let blocked = dir.path().join("runs").join("a").join("4.json");
        std::fs::create_dir_all(blocked.join("in-the-way")).unwrap();
        let (tx, task) = record_writer(journal.clone());
        let flush = |run_id| {
            let (done, answer) = oneshot::channel();
            let run = ("a".to_string(), run_id);
            tx.send(RecordJob::Flush { run, done }).unwrap();
            answer
        };
        tx.send(RecordJob::Write(record("a", 2, RunOutcome::Running), 9))
            .unwrap();
        let two = flush(2);
        tx.send(RecordJob::Write(record("a", 4, RunOutcome::Running), 9))
            .unwrap();
        let four = flush(4);
        assert_eq!(two.await.unwrap(), Ok(()));
        // Answered, so on disk: read back at once.
        let on_disk = journal.record("a", 2).unwrap().map(|r| r.outcome);
        assert_eq!(on_disk, Some(RunOutcome::Running));
        let refused = four.await.unwrap().unwrap_err();
        assert!(refused.contains("4.json"), "{refused}");
        drop(tx);
        task.await.unwrap();
    }
}
