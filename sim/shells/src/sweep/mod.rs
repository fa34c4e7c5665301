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
//! liveness bound passes). The checks, after the run, are in [`checks`].
//!
//! Every seed's trace (what each process did and when, and the ledger at the end) hashes to one
//! number; `--determinism` runs seeds twice and compares. `--canary` turns on a planted defect
//! in the daemon (it stops delivering signals to agents, so a lease it lost goes on being
//! worked) and expects the checks to catch it.

// The sweep's report on stdout is its output.
#![allow(clippy::print_stdout)]

use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use madsim::runtime::Runtime;
use relay_core::Millis;

use run::run;

mod checks;
mod clock;
mod faults;
mod launcher;
mod logs;
mod run;
mod world;

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
        rt.block_on(run(seed, canary, dir))
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
