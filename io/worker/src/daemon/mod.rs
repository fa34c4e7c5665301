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
//! reload does, the doorbell listeners, the next wake-up) are a [`Fleet`]; the actor sleeps until
//! its next wake-up. Tasks that belong to a run are tracked by run id and
//! aborted when the run's final record is written, so nothing an attempt started outlives it.
//!
//! # Reload
//!
//! SIGHUP and `relay reload` read the config again through [`load::prepare`], the loader of a
//! start, on a blocking task; a config that does not load changes nothing. What changed is
//! `relay_core::config::diff`'s answer; what it does is `relay_core::fleet::plan_reload`'s, and
//! the daemon carries the plan out (in `reload.rs`): added harnesses start; a
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
mod kill;
pub mod load;
mod metrics;
mod records;
mod reload;
mod requests;
mod sources;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use relay_core::config::{ConfigDiff, ResolvedConfig};
use relay_core::fleet::{CATCH_UP, Due, Fleet, Rebind, Settled, doorbell_changes, rebind};
use relay_core::relay::{
    self, Capabilities, Command, HarnessSettings, Input, Reconfigured, RunOutcome, RunRecord,
    StopReason, UsageFile,
};
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::AbortHandle;

use crate::clock::SharedClock;
use crate::journal::{DaemonLock, Journal};
use relay_core::mcp::client::Subscriptions;

use crate::lease::{DoorbellListener, LeaseClient, ReceiptClient, SessionNews, Transport};
use crate::runner::{self, AgentSpec, CheckSpec, Control, Launched, Launcher};

pub use metrics::{DaemonMetrics, serve_metrics};

use kill::KillAt;
use records::{RecordJob, record_writer};

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
        let now = opts.clock.wall();
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

    fn fire(&mut self, harness: &str, trigger: &str) {
        let Some(firing) = self.fleet.firing(harness, trigger, self.clock.wall()) else {
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
}
