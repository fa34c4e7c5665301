//! The shell-sim sweep: the real queue server (on a SQLite file) and several real daemons in one
//! madsim world, under network faults, crashes and clock steps, seed by seed.
//!
//! `relay sim` proves the pure core; this proves the shells around it — the server's
//! connections, sessions, sweeps and doorbell, the daemon's actor, lease client, journal and
//! retries — by running their production code on madsim's deterministic runtime (time, task
//! order, randomness and the network all come from the seed). Only the processes are modelled:
//! a [`SimLauncher`] stands in for fork and exec behind the daemon's `Launcher` trait.
//!
//! One seed: a server node, [`DAEMONS`] daemon nodes with [`HARNESSES`] leased harnesses each,
//! and an operator (the main task, on the store file) that adds todos, cancels some and retries
//! dead letters. For [`FAULT_WINDOW`] the fault plan partitions links, clogs nodes, changes
//! latency, kills and restarts the server and the daemons (their files survive) and steps the
//! wall clocks; then everything heals and the world runs until every todo is finished (or the
//! liveness bound passes). The checks, after the run, are in [`check`].
//!
//! Every seed's trace (what each process did and when, and the ledger at the end) hashes to one
//! number; `--determinism` runs seeds twice and compares. `--canary` turns on a planted defect
//! in the daemon (it stops delivering signals to agents, so a lease it lost goes on being
//! worked) and expects the checks to catch it.

// The sweep's report on stdout is its output.
#![allow(clippy::print_stdout)]

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use madsim::net::NetSim;
use madsim::rand::{Rng, thread_rng};
use madsim::runtime::{Handle, NodeHandle, Runtime};
use relay_core::Millis;
use relay_core::ledger::{
    Actor, Answer, Attempt, LedgerConfig, NewTodo, Op, Outcome, Todo, TodoFilter, TodoState,
    TokenHash, check_todo, finished,
};
use relay_core::relay::{ExitStatus, Input, Signal};
use relay_core::time::{Clock, SECOND, WallClock};
use relay_core::wire::Tool;
use relay_server::server::{Server, ServerConfig};
use relay_server::store::{NewEndpoint, Store};
use relay_worker::daemon::{Daemon, DaemonOptions};
use relay_worker::lease::HyperTransport;
use relay_worker::runner::{
    AgentSpec, CheckSpec, Control, Launched, Launcher, RunnerError, StartError,
};
use sha2::Digest as _;

const DAEMONS: usize = 3;
const HARNESSES: usize = 2;
const TODOS: usize = 10;
const PORT: u16 = 7000;
const ENDPOINT: &str = "sweep";
const QUEUE: &str = "work";
/// Faults are injected for this long (simulated), then everything heals.
const FAULT_WINDOW: Duration = Duration::from_secs(15 * 60);
/// After the heal, every todo must be finished within this long (simulated): liveness.
const SETTLE: Duration = Duration::from_secs(40 * 60);
/// How long after its lease ran out the daemon may take to begin stopping its agent (the
/// contract: SIGTERM within a second), plus the network's worst latency.
const STOP_SLACK: Millis = 1_000 + 100;
/// SIGKILL follows SIGTERM after the kill grace (the default, 10 s): the latest a process that
/// ignores SIGTERM may end.
const KILL_SLACK: Millis = STOP_SLACK + relay_core::relay::DEFAULT_KILL_GRACE;

fn server_ip() -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1))
}

fn daemon_ip(i: usize) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 0, 1, u8::try_from(i + 1).unwrap_or(255)))
}

/// Milliseconds of the simulated wall clock (madsim's, inside the world).
fn true_ms() -> Millis {
    let d = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    u64::try_from(d.as_millis()).unwrap_or(0)
}

/// A node's clocks: the simulated wall clock plus a step the fault plan moves; the monotonic
/// one (boot time, madsim's instant) never steps.
#[derive(Clone, Default)]
struct SteppedClock {
    offset: Arc<AtomicI64>,
}

impl SteppedClock {
    fn wall(&self) -> Millis {
        true_ms().saturating_add_signed(self.offset.load(Ordering::Relaxed))
    }
}

impl WallClock for SteppedClock {
    fn now(&self) -> Millis {
        self.wall()
    }
}

impl Clock for SteppedClock {
    fn mono(&self) -> Millis {
        relay_worker::clock::SystemClock.mono()
    }
}

/// What one simulated process did.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct ProcRecord {
    node: String,
    kind: &'static str,
    todo: String,
    seq: u32,
    start: Millis,
    /// The first signal the daemon sent it.
    signaled: Option<Millis>,
    end: Option<Millis>,
    exit: Option<String>,
}

/// Everything a seed's world records for the checks and the trace.
#[derive(Default)]
struct Journal {
    procs: Vec<ProcRecord>,
    /// Every offset a server clock has had (so the checks can map its stamps to true time).
    server_offsets: BTreeSet<i64>,
    faults: Vec<String>,
    /// Found while the world ran (the auditor's).
    violations: Vec<String>,
}

type Shared = Arc<Mutex<Journal>>;

fn lock(j: &Shared) -> std::sync::MutexGuard<'_, Journal> {
    j.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The processes of one daemon node, modelled: an agent works for a while and exits 0 or 1,
/// or hangs until killed; some ignore SIGTERM. A check answers from the agent's exit, now and
/// then "not yet" (75) first. Every draw comes from madsim's seeded generator.
struct SimLauncher {
    node: String,
    journal: Shared,
}

fn env_var(spec_env: &relay_core::relay::ProcessEnv, name: &str) -> String {
    spec_env
        .relay
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.clone())
        .unwrap_or_default()
}

/// A simulated process's handle: signals reach its wait loop, and the first is noted.
struct SimControl {
    tx: tokio::sync::mpsc::UnboundedSender<Signal>,
    journal: Shared,
    index: usize,
}

impl Control for SimControl {
    fn signal(&self, signal: Signal) -> Result<(), RunnerError> {
        let now = true_ms();
        if let Some(p) = lock(&self.journal).procs.get_mut(self.index) {
            p.signaled.get_or_insert(now);
        }
        let _ = self.tx.send(signal);
        Ok(())
    }
}

/// Notes the process's end when its wait ends or is dropped (the daemon aborted it, or its
/// node was killed: a crashed machine takes its children with it).
struct EndGuard {
    journal: Shared,
    index: usize,
}

impl Drop for EndGuard {
    fn drop(&mut self) {
        let now = true_ms();
        let mut j = lock(&self.journal);
        if let Some(p) = j.procs.get_mut(self.index)
            && p.end.is_none()
        {
            p.end = Some(now);
            p.exit = Some("dropped".into());
        }
    }
}

impl SimLauncher {
    fn start(
        &self,
        kind: &'static str,
        env: &relay_core::relay::ProcessEnv,
        work: Duration,
        ignores_term: bool,
        exit: ExitStatus,
        finish: impl FnOnce(ExitStatus) -> Input + Send + 'static,
    ) -> Launched {
        let index = {
            let mut j = lock(&self.journal);
            j.procs.push(ProcRecord {
                node: self.node.clone(),
                kind,
                todo: env_var(env, "HARNESS_TODO_ID"),
                seq: env_var(env, "HARNESS_ATTEMPT_SEQ").parse().unwrap_or(0),
                start: true_ms(),
                signaled: None,
                end: None,
                exit: None,
            });
            j.procs.len() - 1
        };
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let guard = EndGuard {
            journal: self.journal.clone(),
            index,
        };
        let wait = Box::pin(async move {
            let guard = guard;
            let mut deadline = tokio::time::Instant::now() + work;
            let mut exit = exit;
            loop {
                tokio::select! {
                    () = tokio::time::sleep_until(deadline) => break,
                    s = rx.recv() => match s {
                        Some(Signal::Kill) | None => { exit = ExitStatus::Signal(9); break; }
                        Some(_) if ignores_term => {}
                        Some(_) => {
                            // A graceful stop: gone within half a second.
                            exit = ExitStatus::Signal(15);
                            deadline = deadline.min(tokio::time::Instant::now() + Duration::from_millis(500));
                        }
                    },
                }
            }
            {
                let mut j = lock(&guard.journal);
                if let Some(p) = j.procs.get_mut(guard.index) {
                    p.end = Some(true_ms());
                    p.exit = Some(format!("{exit:?}"));
                }
            }
            finish(exit)
        });
        Launched {
            control: Arc::new(SimControl {
                tx,
                journal: self.journal.clone(),
                index,
            }),
            wait,
        }
    }
}

impl Launcher for SimLauncher {
    fn agent(&self, spec: AgentSpec) -> Result<Launched, StartError> {
        let mut rng = thread_rng();
        let roll: u32 = rng.gen_range(0..100);
        let work = Duration::from_millis(rng.gen_range(2_000..150_000));
        let ignores_term = rng.gen_range(0..100) < 25;
        let (exit, work) = match roll {
            0..60 => (ExitStatus::Code(0), work),
            60..88 => (ExitStatus::Code(1), work),
            // Hangs: only its timeout or a lost lease ends it.
            _ => (ExitStatus::Code(0), Duration::from_secs(24 * 3600)),
        };
        let run_id = spec.run_id;
        Ok(
            self.start("agent", &spec.env, work, ignores_term, exit, move |exit| {
                Input::ProcessExited {
                    run_id,
                    exit,
                    summary_file: Some(br#"{"summary":"simulated work"}"#.to_vec()),
                }
            }),
        )
    }

    fn check(&self, spec: CheckSpec) -> Result<Launched, StartError> {
        let mut rng = thread_rng();
        let agent_ok = env_var(&spec.env, "HARNESS_AGENT_EXIT") == "0";
        let exit = match rng.gen_range(0..100) {
            0..20 => ExitStatus::Code(75),
            _ if agent_ok => ExitStatus::Code(0),
            _ => ExitStatus::Code(1),
        };
        let work = Duration::from_millis(rng.gen_range(50..3_000));
        let run_id = spec.run_id;
        Ok(
            self.start("check", &spec.env, work, false, exit, move |exit| {
                Input::CheckExited {
                    run_id,
                    exit,
                    output_tail: Vec::new(),
                }
            }),
        )
    }
}

/// The sweep's options.
#[derive(Clone, Debug)]
struct Opts {
    first: u64,
    seeds: u64,
    jobs: usize,
    determinism: bool,
    canary: bool,
    verbose: bool,
    /// Run the one seed `first` in this process and print its result for the coordinator.
    child: bool,
}

fn parse_args() -> Result<Opts, String> {
    let mut o = Opts {
        first: 1,
        seeds: 20,
        jobs: std::thread::available_parallelism().map_or(1, usize::from),
        determinism: false,
        canary: false,
        verbose: false,
        child: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut num = |name: &str| -> Result<u64, String> {
            args.next()
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| format!("{name} needs a number"))
        };
        match a.as_str() {
            "--seeds" => o.seeds = num("--seeds")?,
            "--first" => o.first = num("--first")?,
            "--seed" => {
                o.first = num("--seed")?;
                o.seeds = 1;
            }
            "--jobs" => o.jobs = usize::try_from(num("--jobs")?.max(1)).unwrap_or(1),
            "--determinism" => o.determinism = true,
            "--canary" => o.canary = true,
            "--verbose" => o.verbose = true,
            "--child" => o.child = true,
            other => {
                return Err(format!(
                    "unknown argument {other:?}; use --seeds N, --first N, --seed N, --jobs N, \
                     --determinism, --canary, --verbose"
                ));
            }
        }
    }
    Ok(o)
}

/// What one seed's run found.
#[derive(Debug, Default)]
struct SeedResult {
    trace: u64,
    violations: Vec<String>,
    sim_ms: Millis,
    procs: usize,
    attempts: usize,
    faults: usize,
}

/// The coordinator's side: runs each seed in a child process of its own (see [`run_child`]),
/// `--jobs` at a time, and reports in seed order.
pub fn main() -> ExitCode {
    let opts = match parse_args() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("relay-shell-sim: {e}");
            return ExitCode::from(2);
        }
    };
    if opts.child {
        return run_child(opts.first, opts.canary);
    }
    let started = std::time::Instant::now();
    let runs: Vec<u64> = (opts.first..opts.first + opts.seeds)
        .flat_map(|s| std::iter::repeat_n(s, if opts.determinism { 2 } else { 1 }))
        .collect();
    let results = run_children(&runs, &opts);
    let (mut sim_ms, mut failed, mut caught) = (0u64, Vec::new(), Vec::new());
    for (k, seed) in runs.iter().enumerate() {
        let out = &results[k];
        sim_ms += out.sim_ms;
        let second = opts.determinism && k % 2 == 1;
        if second {
            let first = &results[k - 1];
            if first.trace != out.trace {
                failed.push(*seed);
                eprintln!(
                    "seed {seed}: NOT DETERMINISTIC: trace {:016x} then {:016x}\n  repro: {}",
                    first.trace,
                    out.trace,
                    repro(*seed, &opts)
                );
            }
            continue;
        }
        if opts.verbose {
            println!(
                "seed {seed}: trace {:016x}, {} s simulated, {} processes, {} attempts, {} faults, {} violations",
                out.trace,
                out.sim_ms / 1_000,
                out.procs,
                out.attempts,
                out.faults,
                out.violations.len()
            );
        }
        if out.violations.is_empty() {
            continue;
        }
        if opts.canary {
            caught.push(*seed);
            continue;
        }
        failed.push(*seed);
        eprintln!("seed {seed}: {} violation(s):", out.violations.len());
        for v in out.violations.iter().take(10) {
            eprintln!("  {v}");
        }
        eprintln!("  repro: {}", repro(*seed, &opts));
    }
    let wall = started.elapsed().as_secs_f64().max(1e-9);
    println!(
        "shell-sim: {} seeds from {} ({} runs, {} at a time) in {wall:.1} s: {:.0} simulated s per wall s, {:.1} seeds/min",
        opts.seeds,
        opts.first,
        runs.len(),
        opts.jobs,
        sim_ms as f64 / 1_000.0 / wall,
        runs.len() as f64 * 60.0 / wall
    );
    if opts.canary {
        println!(
            "canary (the daemon drops its agents' signals): caught by {} of {} seeds; first at seed {:?}",
            caught.len(),
            opts.seeds,
            caught.first()
        );
        return if caught.is_empty() || !failed.is_empty() {
            eprintln!(
                "the canary was NOT caught: the checks miss a daemon that works past its lease"
            );
            ExitCode::FAILURE
        } else {
            ExitCode::SUCCESS
        };
    }
    if failed.is_empty() {
        println!("shell-sim: no violation");
        ExitCode::SUCCESS
    } else {
        eprintln!("shell-sim: {} seed(s) failed: {failed:?}", failed.len());
        ExitCode::FAILURE
    }
}

fn repro(seed: u64, opts: &Opts) -> String {
    format!(
        "RUSTFLAGS=\"--cfg madsim\" CARGO_TARGET_DIR=target/madsim cargo run -p relay-shell-sim -- --seed {seed} --verbose{}",
        if opts.canary { " --canary" } else { "" }
    )
}

/// Runs `runs` (seeds), each as `relay-shell-sim --child --seed N`, `opts.jobs` at once.
///
/// A process per seed, because tokio keeps process-wide counters (the seed of each thread's
/// `select!` fairness generator) that a second world in the same process would continue from:
/// it would run differently from the same seed run alone, and a failing seed of a sweep would
/// not replay from its `repro:` line.
fn run_children(runs: &[u64], opts: &Opts) -> Vec<SeedResult> {
    let exe = std::env::current_exe().expect("the sweep's own executable");
    let mut results: Vec<Option<SeedResult>> = (0..runs.len()).map(|_| None).collect();
    let mut running: Vec<(usize, std::process::Child)> = Vec::new();
    let mut next = 0;
    while next < runs.len() || !running.is_empty() {
        while next < runs.len() && running.len() < opts.jobs {
            let mut cmd = std::process::Command::new(&exe);
            cmd.args(["--child", "--seed", &runs[next].to_string()]);
            if opts.canary {
                cmd.arg("--canary");
            }
            cmd.stdout(std::process::Stdio::piped());
            let child = cmd.spawn().expect("the sweep starts a child");
            running.push((next, child));
            next += 1;
        }
        // The oldest first: children finish in about the same time.
        let (k, child) = running.remove(0);
        let seed = runs[k];
        let out = child.wait_with_output();
        results[k] = Some(match out {
            Ok(o) => parse_child(
                seed,
                &String::from_utf8_lossy(&o.stdout),
                o.status.success(),
            ),
            Err(e) => SeedResult {
                violations: vec![format!("seed {seed}: the child did not run: {e}")],
                ..SeedResult::default()
            },
        });
    }
    results.into_iter().map(Option::unwrap_or_default).collect()
}

/// Reads a child's `SEED` and `VIOLATION` lines.
fn parse_child(seed: u64, stdout: &str, ok: bool) -> SeedResult {
    let mut r = SeedResult::default();
    let mut seen = false;
    for line in stdout.lines() {
        if let Some(v) = line.strip_prefix("VIOLATION ") {
            r.violations.push(v.to_string());
        } else if let Some(rest) = line.strip_prefix("SEED ") {
            let f: Vec<u64> = rest
                .split_whitespace()
                .map(|x| u64::from_str_radix(x, 16).unwrap_or(0))
                .collect();
            if let [_, trace, sim_ms, procs, attempts, faults] = f[..] {
                seen = true;
                r.trace = trace;
                r.sim_ms = sim_ms;
                r.procs = usize::try_from(procs).unwrap_or(0);
                r.attempts = usize::try_from(attempts).unwrap_or(0);
                r.faults = usize::try_from(faults).unwrap_or(0);
            }
        }
    }
    if !seen || !ok {
        r.violations.push(format!(
            "seed {seed}: the world did not finish (a panic: its message is above)"
        ));
    }
    r
}

/// The child's side: one seed's world, its result on stdout for [`parse_child`].
fn run_child(seed: u64, canary: bool) -> ExitCode {
    logs::init();
    // On a thread of its own: std seeds a thread's hash maps the first time one is built on
    // it, and this thread has built some already (the log filter's). A fresh thread draws its
    // keys inside the world, from madsim's seeded generator, so hash map order is the seed's.
    // Made before the world starts: a name drawn inside it would come from the seed's generator,
    // so two runs of one seed at once would collide, and drawing again would shift the world.
    // On tmpfs where there is one: the store's fsyncs cost nothing there, and a world is thrown
    // away after its run anyway.
    let shm = Path::new("/dev/shm");
    let base = if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    let dir = tempfile::Builder::new()
        .prefix("relay-shell-sim-")
        .tempdir_in(base)
        .expect("a temporary folder");
    let world_thread = std::thread::spawn(move || {
        let mut rt = Runtime::with_seed_and_config(seed, madsim::Config::default());
        rt.set_time_limit(FAULT_WINDOW + SETTLE + Duration::from_secs(600));
        rt.block_on(world(seed, canary, dir))
    });
    let Ok(r) = world_thread.join() else {
        // The panic's message is on stderr; the coordinator sees no SEED line.
        return ExitCode::FAILURE;
    };
    let mut out = format!(
        "SEED {seed:x} {:x} {:x} {:x} {:x} {:x}\n",
        r.trace, r.sim_ms, r.procs, r.attempts, r.faults
    );
    for v in &r.violations {
        out.push_str(&format!("VIOLATION {}\n", v.replace('\n', " ")));
    }
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    let _ = stdout.write_all(out.as_bytes());
    let _ = stdout.flush();
    ExitCode::SUCCESS
}

/// The state a seed's world shares with its nodes.
struct World {
    dir: tempfile::TempDir,
    db: String,
    journal: Shared,
    server_clock: SteppedClock,
    daemon_clocks: Vec<SteppedClock>,
    token: String,
}

fn ledger_config() -> LedgerConfig {
    let mut ledger = LedgerConfig::default();
    ledger.backoff.base = 5 * SECOND;
    ledger.backoff.cap = 60 * SECOND;
    ledger
}

fn harness_config(url: &str) -> String {
    let mut text = format!(
        "[queue.work]\nurl = \"{url}\"\nenv_file = \"sweep.env\"\n\
         headers = {{ Authorization = \"Bearer ${{RELAY_TOKEN}}\" }}\nqueue = \"{QUEUE}\"\n\
         lease_ttl = \"1m\"\nheartbeat_interval = \"20s\"\n"
    );
    for h in 0..HARNESSES {
        text.push_str(&format!(
            "\n[harness.h{h}]\ncommand = [\"agent\"]\nschedule = \"@every 5s\"\n\
             lease = \"queue.work\"\nsuccess_check = [\"check\"]\n\
             success_check_interval = \"2s\"\nsuccess_check_timeout = \"30s\"\n\
             timeout = \"4m\"\nkeep_runs = 1000\n"
        ));
    }
    text
}

async fn world(seed: u64, canary: bool, dir: tempfile::TempDir) -> SeedResult {
    relay_worker::daemon::canary::set(canary);
    let handle = Handle::current();
    let world = Arc::new(setup(dir).await);
    lock(&world.journal).server_offsets.insert(0);
    let server = start_server(&handle, &world, seed);
    let daemons: Vec<NodeHandle> = (0..DAEMONS)
        .map(|i| start_daemon(&handle, &world, i, seed))
        .collect();
    let operator_store = Store::open(&world.db, ledger_config())
        .await
        .expect("the operator opens the store");
    let start = true_ms();

    // The operator and the fault plan run side by side for the fault window.
    let added = Arc::new(Mutex::new(Vec::new()));
    let op = tokio::spawn(operator(
        operator_store.clone(),
        world.clone(),
        added.clone(),
    ));
    let auditor = tokio::spawn(audit(operator_store.clone(), world.journal.clone()));
    faults(&handle, &world, server.id(), &daemons).await;
    let _ = op.await;
    heal(server.id(), &daemons);

    // Liveness: every todo finishes once the faults are healed.
    let ids: Vec<String> = added.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let settle_until = tokio::time::Instant::now() + SETTLE;
    let mut live = false;
    while tokio::time::Instant::now() < settle_until {
        tokio::time::sleep(Duration::from_secs(10)).await;
        if let Ok(todos) = list(&operator_store).await
            && todos.iter().filter(|t| ids.contains(&t.id)).all(finished)
        {
            live = true;
            break;
        }
    }
    auditor.abort();
    // Stop the daemons and the server before reading: no write lands during the checks. A
    // process still running ends here, with its daemon.
    let stopped = true_ms();
    for d in &daemons {
        handle.kill(d.id());
    }
    handle.kill(server.id());
    let sim_ms = true_ms().saturating_sub(start);
    let mut violations = Vec::new();
    if !live {
        violations.push(format!(
            "liveness: not every todo finished within {} min of the heal",
            SETTLE.as_secs() / 60
        ));
    }
    violations.append(&mut lock(&world.journal).violations);
    let (trace, attempts) = check(&operator_store, &world, &ids, stopped, &mut violations).await;
    let j = lock(&world.journal);
    SeedResult {
        trace,
        violations,
        sim_ms,
        procs: j.procs.len(),
        attempts,
        faults: j.faults.len(),
    }
}

async fn setup(dir: tempfile::TempDir) -> World {
    let db = format!("sqlite:{}", dir.path().join("relay.db").display());
    let store = Store::open(&db, ledger_config())
        .await
        .expect("the store opens");
    // The world's RNG, not `relay_server::server::new_bearer_token` (the OS's): a twin run
    // must vend the same token, or the traces differ.
    let mut bytes = [0u8; 24];
    thread_rng().fill(&mut bytes);
    let token: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    store
        .endpoint_create(
            true_ms(),
            NewEndpoint {
                name: ENDPOINT.into(),
                token_hash: TokenHash::of(&token),
                verbs: Tool::ALL.iter().map(|t| t.as_str().to_string()).collect(),
                queues: Some(vec![QUEUE.to_string()]),
            },
        )
        .await
        .expect("the endpoint is vended");
    // The daemons reach the server through a loopback sidecar on their own node (see
    // `sidecar`): a harness.toml may name plain http only on loopback.
    let url = format!("http://127.0.0.1:{PORT}/mcp/{ENDPOINT}");
    for i in 0..DAEMONS {
        let d = dir.path().join(format!("daemon-{i}"));
        std::fs::create_dir_all(&d).expect("the daemon's folder");
        std::fs::write(d.join("harness.toml"), harness_config(&url)).expect("config");
        std::fs::write(d.join("sweep.env"), format!("RELAY_TOKEN={token}\n")).expect("env");
    }
    World {
        dir,
        db,
        journal: Shared::default(),
        server_clock: SteppedClock::default(),
        daemon_clocks: (0..DAEMONS).map(|_| SteppedClock::default()).collect(),
        token,
    }
}

fn start_server(handle: &Handle, world: &Arc<World>, seed: u64) -> NodeHandle {
    let w = world.clone();
    let starts = Arc::new(AtomicU64::new(0));
    handle
        .create_node()
        .name("server")
        .ip(server_ip())
        .init(move || {
            let (w, starts) = (w.clone(), starts.clone());
            async move {
                let n = starts.fetch_add(1, Ordering::Relaxed);
                let store = Store::open(&w.db, ledger_config())
                    .await
                    .expect("the server opens its store");
                let mut config = ServerConfig::for_listen((server_ip(), PORT).into());
                config.reap_interval = Duration::from_secs(5);
                config.requeue_interval = Duration::from_secs(5);
                // A fresh seed per start: a restarted server must not mint the tokens and
                // session ids of its earlier life again.
                let server = Server::new(
                    store,
                    Arc::new(w.server_clock.clone()),
                    config,
                    Some(seed.wrapping_mul(1_000).wrapping_add(n)),
                );
                let listener = tokio::net::TcpListener::bind(("0.0.0.0", PORT))
                    .await
                    .expect("the server binds");
                let _ = server.serve(listener, std::future::pending()).await;
            }
        })
        .build()
}

fn start_daemon(handle: &Handle, world: &Arc<World>, i: usize, seed: u64) -> NodeHandle {
    let w = world.clone();
    let starts = Arc::new(AtomicU64::new(0));
    handle
        .create_node()
        .name(format!("daemon-{i}"))
        .ip(daemon_ip(i))
        .init(move || {
            let (w, starts) = (w.clone(), starts.clone());
            async move {
                let n = starts.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(sidecar());
                let dir = w.dir.path().join(format!("daemon-{i}"));
                let opts = DaemonOptions {
                    config: dir.join("harness.toml"),
                    state_dir: dir.join("state"),
                    host: format!("daemon-{i}"),
                    clock: Arc::new(w.daemon_clocks[i].clone()),
                    transport: Arc::new(HyperTransport::new()),
                    daemon_env: vec![("PATH".into(), "/usr/bin:/bin".into())],
                    seed: seed ^ (i as u64) << 32 ^ n << 48,
                    launcher: Arc::new(SimLauncher {
                        node: format!("daemon-{i}"),
                        journal: w.journal.clone(),
                    }),
                };
                match Daemon::start(opts).await {
                    Ok((daemon, _handle)) => daemon.run().await,
                    Err(e) => panic!("daemon-{i} did not start: {e}"),
                }
            }
        })
        .build()
}

/// A daemon node's loopback tunnel to the server (as an SSH tunnel or a local proxy would be):
/// each connection to 127.0.0.1:PORT on the node is copied to the server's address across the
/// simulated network, so partitions and clogs between the two nodes cut it.
async fn sidecar() {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", PORT))
        .await
        .expect("the sidecar binds");
    while let Ok((mut local, _)) = listener.accept().await {
        tokio::spawn(async move {
            if let Ok(mut remote) = tokio::net::TcpStream::connect((server_ip(), PORT)).await {
                let _ = tokio::io::copy_bidirectional(&mut local, &mut remote).await;
            }
        });
    }
}

async fn list(store: &Store) -> Result<Vec<Todo>, relay_core::Error> {
    let a = store
        .apply(Op::ListTodos {
            actor: Actor::operator("sweep"),
            filter: TodoFilter {
                limit: 10_000,
                ..TodoFilter::default()
            },
        })
        .await?;
    match a {
        Answer::Todos(t) => Ok(t),
        other => Err(relay_core::Error::internal(format!(
            "list answered {other:?}"
        ))),
    }
}

/// Adds [`TODOS`] todos over the fault window, cancels one now and then and retries dead
/// letters, straight on the store file (the server finds them with its pending scan).
async fn operator(store: Store, world: Arc<World>, added: Arc<Mutex<Vec<String>>>) {
    let mut n = 0;
    let end = tokio::time::Instant::now() + FAULT_WINDOW;
    while tokio::time::Instant::now() < end {
        let pause = Duration::from_millis(thread_rng().gen_range(5_000..90_000));
        tokio::time::sleep(pause).await;
        let now = world.server_clock.wall();
        let roll: u32 = thread_rng().gen_range(0..100);
        if n < TODOS && roll < 60 {
            n += 1;
            let max_attempts = thread_rng().gen_range(1..5);
            add(&store, now, n, max_attempts, &added).await;
            continue;
        }
        let Ok(todos) = list(&store).await else {
            continue;
        };
        if todos.is_empty() {
            continue;
        }
        let t = &todos[thread_rng().gen_range(0..todos.len())];
        let op = if roll < 75 {
            Op::Cancel {
                now,
                actor: Actor::operator("sweep"),
                id: t.id.clone(),
            }
        } else if t.dead_letter() {
            Op::Retry {
                now,
                actor: Actor::operator("sweep"),
                id: t.id.clone(),
            }
        } else {
            continue;
        };
        // Refusals (canceling a finished todo) are part of the game.
        let _ = store.apply(op).await;
    }
    // Whatever was not added yet is added now, so every seed works all of them.
    while n < TODOS {
        n += 1;
        add(&store, world.server_clock.wall(), n, 3, &added).await;
    }
}

/// Adds todo number `n`, noting its id once the store acknowledged it.
async fn add(store: &Store, now: Millis, n: usize, max_attempts: u32, added: &Mutex<Vec<String>>) {
    let id = format!("td_sweep{n:02}");
    let op = Op::AddTodo {
        now,
        endpoint: ENDPOINT.into(),
        new: NewTodo {
            id: id.clone(),
            queue: QUEUE.into(),
            title: format!("simulated todo {n}"),
            max_attempts: Some(max_attempts),
            ..NewTodo::default()
        },
    };
    if store.apply(op).await.is_ok() {
        added.lock().unwrap_or_else(|e| e.into_inner()).push(id);
    }
}

/// Reads every attempt every 20 s (simulated) while the world runs: a closed attempt must
/// never change again (closed exactly once; a late event is kept beside it, powerless).
async fn audit(store: Store, journal: Shared) {
    let mut closed: BTreeMap<(String, u32), String> = BTreeMap::new();
    loop {
        tokio::time::sleep(Duration::from_secs(20)).await;
        let Ok(todos) = list(&store).await else {
            continue;
        };
        for t in todos {
            let Ok(Answer::View(view)) = store
                .apply(Op::GetTodo {
                    actor: Actor::operator("sweep"),
                    id: t.id.clone(),
                    attempts_limit: 10_000,
                })
                .await
            else {
                continue;
            };
            for a in view.attempts.iter().filter(|a| !a.is_open()) {
                let now = format!(
                    "{:?} at {:?} by {:?}, summary {:?}",
                    a.outcome, a.ended_at, a.closed_by, a.summary
                );
                let key = (t.id.clone(), a.seq);
                match closed.get(&key) {
                    Some(was) if *was != now => lock(&journal).violations.push(format!(
                        "{} #{}: a closed attempt changed: {was} became {now}",
                        t.id, a.seq
                    )),
                    Some(_) => {}
                    None => {
                        closed.insert(key, now);
                    }
                }
            }
        }
    }
}

/// The fault plan: one fault at a time, each healed before the next, for the fault window.
async fn faults(
    handle: &Handle,
    world: &World,
    server: madsim::task::NodeId,
    daemons: &[NodeHandle],
) {
    let net = NetSim::current();
    let end = tokio::time::Instant::now() + FAULT_WINDOW;
    while tokio::time::Instant::now() < end {
        let mut rng = thread_rng();
        let gap = Duration::from_millis(rng.gen_range(1_000..60_000));
        let hold = Duration::from_millis(rng.gen_range(500..150_000));
        let d = rng.gen_range(0..daemons.len());
        let daemon = daemons[d].id();
        let kind = rng.gen_range(0..7);
        drop(rng);
        tokio::time::sleep(gap).await;
        let what = match kind {
            0 => {
                net.clog_link(daemon, server);
                net.clog_link(server, daemon);
                tokio::time::sleep(hold).await;
                net.unclog_link(daemon, server);
                net.unclog_link(server, daemon);
                format!("partition daemon-{d} from the server for {hold:?}")
            }
            1 => {
                net.clog_node(server);
                tokio::time::sleep(hold).await;
                net.unclog_node(server);
                format!("clog the server for {hold:?}")
            }
            2 => {
                net.update_config(|c| {
                    c.send_latency = Duration::from_millis(20)..Duration::from_millis(50);
                });
                tokio::time::sleep(hold).await;
                net.update_config(|c| {
                    c.send_latency = Duration::from_millis(1)..Duration::from_millis(10);
                });
                format!("slow network for {hold:?}")
            }
            3 => {
                handle.kill(server);
                tokio::time::sleep(hold.min(Duration::from_secs(20))).await;
                handle.restart(server);
                format!(
                    "kill the server, restart after {:?}",
                    hold.min(Duration::from_secs(20))
                )
            }
            4 => {
                handle.kill(daemon);
                tokio::time::sleep(hold).await;
                handle.restart(daemon);
                format!("kill daemon-{d}, restart after {hold:?}")
            }
            5 => {
                let step = thread_rng().gen_range(-30_000i64..30_000);
                world.server_clock.offset.store(step, Ordering::Relaxed);
                lock(&world.journal).server_offsets.insert(step);
                format!("step the server's wall clock to {step:+} ms")
            }
            _ => {
                let step = thread_rng().gen_range(-3_600_000i64..3_600_000);
                world.daemon_clocks[d].offset.store(step, Ordering::Relaxed);
                format!("step daemon-{d}'s wall clock to {step:+} ms")
            }
        };
        lock(&world.journal).faults.push(what);
    }
}

/// Ends every fault: links and nodes unclogged, latency back to normal, every node running.
/// (A killed node is restarted by the plan itself before the next fault; restarting a running
/// one is not needed.) Clocks keep their steps: they are not faults to heal.
fn heal(server: madsim::task::NodeId, daemons: &[NodeHandle]) {
    let net = NetSim::current();
    net.unclog_node(server);
    for d in daemons {
        net.unclog_node(d.id());
        net.unclog_link(d.id(), server);
        net.unclog_link(server, d.id());
    }
    net.update_config(|c| {
        c.send_latency = Duration::from_millis(1)..Duration::from_millis(10);
    });
}

/// The checks after a run, and the trace hash. See the module doc.
/// The checks after the run; `stopped` is when the daemons were killed (in true time), where a
/// process still running ended.
async fn check(
    store: &Store,
    world: &World,
    ids: &[String],
    stopped: Millis,
    violations: &mut Vec<String>,
) -> (u64, usize) {
    let mut hasher = sha2::Sha256::new();
    let todos = match list(store).await {
        Ok(t) => t,
        Err(e) => {
            violations.push(format!("the ledger could not be listed: {e}"));
            return (0, 0);
        }
    };
    let by_id: BTreeMap<&str, &Todo> = todos.iter().map(|t| (t.id.as_str(), t)).collect();
    // No todo lost.
    for id in ids {
        if !by_id.contains_key(id.as_str()) {
            violations.push(format!(
                "{id}: added, acknowledged, and gone from the ledger"
            ));
        }
    }
    let min_offset = *lock(&world.journal).server_offsets.first().unwrap_or(&0);
    let mut expiry_true: BTreeMap<(String, u32), Millis> = BTreeMap::new();
    let mut hashes: Vec<TokenHash> = Vec::new();
    let mut attempts_seen = 0;
    for t in &todos {
        let view = match store
            .apply(Op::GetTodo {
                actor: Actor::operator("sweep"),
                id: t.id.clone(),
                attempts_limit: 10_000,
            })
            .await
        {
            Ok(Answer::View(v)) => v,
            other => {
                violations.push(format!("{}: get_todo answered {other:?}", t.id));
                continue;
            }
        };
        let mut attempts: Vec<Attempt> = view.attempts;
        attempts.reverse();
        attempts_seen += attempts.len();
        if let Err(e) = check_todo(&view.todo, &attempts) {
            violations.push(format!("{}: ledger invariant: {e}", t.id));
        }
        hasher.update(format!("{}:{}:{}", t.id, t.state, t.attempts_total).as_bytes());
        for a in &attempts {
            hasher.update(
                format!(
                    "{}:{}:{:?}:{}:{:?}:{}",
                    a.seq, a.attempt, a.outcome, a.claimed_at, a.ended_at, a.lease_expires_at
                )
                .as_bytes(),
            );
            if let Some(h) = &a.lease_token_hash {
                hashes.push(*h);
            }
            // The latest the lease can have run out, in true time: the server's stamp less
            // the smallest offset its clock ever had (lenient about clock steps).
            let latest = a.lease_expires_at.saturating_add_signed(-min_offset);
            expiry_true.insert((t.id.clone(), a.seq), latest);
            let (Some(outcome), Some(ended)) = (a.outcome, a.ended_at) else {
                if view.todo.state != TodoState::Claimed {
                    violations.push(format!("{} #{}: open on a todo not claimed", t.id, a.seq));
                }
                continue;
            };
            match outcome {
                // Died exactly when the lease lapsed: never before it.
                Outcome::LeaseExpired | Outcome::Reaped if ended < a.lease_expires_at => {
                    violations.push(format!(
                        "{} #{}: closed {outcome:?} at {ended}, before its lease ran out at {}",
                        t.id, a.seq, a.lease_expires_at
                    ));
                }
                // A worker's report is accepted only while its lease is live.
                Outcome::Completed | Outcome::Failed | Outcome::Released
                    if a.closed_by.is_none() && ended > a.lease_expires_at =>
                {
                    violations.push(format!(
                        "{} #{}: a stale write: {outcome:?} accepted at {ended}, after the lease ran out at {}",
                        t.id, a.seq, a.lease_expires_at
                    ));
                }
                _ => {}
            }
        }
    }
    // No process ran past its lease (plus the second the daemon has to stop it).
    let procs = lock(&world.journal).procs.clone();
    let dump = std::env::var_os("RELAY_SHELL_SIM_DUMP").is_some();
    for p in &procs {
        if dump {
            eprintln!("trace: {p:?}");
        }
        hasher.update(format!("{p:?}").as_bytes());
        let Some(limit) = expiry_true.get(&(p.todo.clone(), p.seq)) else {
            if p.todo.starts_with("td_sweep") {
                violations.push(format!(
                    "{} #{}: a {} ran on {} for an attempt the ledger does not have",
                    p.todo, p.seq, p.kind, p.node
                ));
            }
            continue;
        };
        // A process its daemon still ran when the world stopped (its todo canceled a moment
        // before, say, and the daemon not yet told) ended with the daemon: it ran past its
        // lease only if the lease had run out by then.
        let end = p.end.unwrap_or(stopped);
        let stop_by = limit.saturating_add(STOP_SLACK);
        if end > stop_by && p.signaled.is_none_or(|at| at > stop_by) {
            violations.push(format!(
                "{} #{}: the {} on {} ran {} ms past its lease and was not signaled within 1 s of it",
                p.todo,
                p.seq,
                p.kind,
                p.node,
                end.saturating_sub(*limit)
            ));
        } else if end > limit.saturating_add(KILL_SLACK) {
            violations.push(format!(
                "{} #{}: the {} on {} ran {} ms past its lease, beyond the kill grace",
                p.todo,
                p.seq,
                p.kind,
                p.node,
                end.saturating_sub(*limit)
            ));
        }
    }
    // No token in any file or log line.
    let mut texts: Vec<(String, Vec<u8>)> = Vec::new();
    collect_files(world.dir.path(), &mut texts);
    texts.push(("the logs".into(), logs::take()));
    for (name, bytes) in &texts {
        if find(bytes, world.token.as_bytes()) {
            violations.push(format!("the endpoint's bearer token appears in {name}"));
        }
        for word in bytes.split(|b| !(b.is_ascii_alphanumeric() || *b == b'-' || *b == b'_')) {
            if word.len() == 22
                && let Ok(w) = std::str::from_utf8(word)
                && hashes.contains(&TokenHash::of(w))
            {
                violations.push(format!("a lease token appears in {name}"));
            }
        }
    }
    let digest = hasher.finalize();
    let trace = u64::from_le_bytes(digest[..8].try_into().unwrap_or([0; 8]));
    (trace, attempts_seen)
}

fn find(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// Every file under `dir` but the database (whose token hashes are the point) and the env
/// files the operator wrote the bearer into.
fn collect_files(dir: &Path, out: &mut Vec<(String, Vec<u8>)>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    paths.sort();
    for p in paths {
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if p.is_dir() {
            collect_files(&p, out);
        } else if !name.starts_with("relay.db")
            && name != "sweep.env"
            && let Ok(bytes) = std::fs::read(&p)
        {
            out.push((p.display().to_string(), bytes));
        }
    }
}

/// The worlds' logs, caught in memory (all of the relay crates' lines, at info) so the token
/// check can read them; a world takes its own after its run.
mod logs {
    use std::io::Write;
    use std::sync::{Mutex, OnceLock};

    static BUF: OnceLock<Mutex<Vec<u8>>> = OnceLock::new();

    fn buf() -> &'static Mutex<Vec<u8>> {
        BUF.get_or_init(|| Mutex::new(Vec::new()))
    }

    struct Sink;

    impl Write for Sink {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            buf()
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    pub fn init() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new("info"))
            .with_ansi(false)
            .with_writer(|| Sink)
            .try_init();
    }

    pub fn take() -> Vec<u8> {
        std::mem::take(&mut *buf().lock().unwrap_or_else(|e| e.into_inner()))
    }
}
