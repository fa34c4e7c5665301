//! The daemon's own costs, on loopback against a real server (SQLite):
//!
//! 1. claim → spawn latency: from the daemon's machine taking the claim answer (the context
//!    file's `attempt.claimed_at`, stamped then; the contract's claim answer carries no time)
//!    to the first instruction of the agent (it writes its clock), p50 / p99, for one harness
//!    fired by hand (nothing else going on) and for twenty harnesses whose schedule fires them
//!    in the same instant (the claims queue at the store); against a baseline measured in the
//!    same run: starting the same program from tokio directly (spawn → first instruction).
//! 2. Memory: the process's resident set before and after a daemon with 100 leased harnesses
//!    has started and verified its lease source, idle.
//!
//!    Also store claim → spawn: from the attempt's `claimed_at` in the store (the server's claim),
//!    so the answer's way back and its wait in the daemon's queue before the machine takes it
//!    count too; and firing → spawn: from the run record's `started_at` (the firing, before
//!    admission and the claim request), so the claim's wait at the store counts as well.
//!
//! Each figure is also one `RESULT bench=daemon … path=claim_spawn|store_claim_spawn|fire_spawn
//! harnesses=N p50_ms=… p99_ms=…` line.
//!
//! `cargo bench -p relay-worker --bench daemon`

// A benchmark reports on stdout.
#![allow(clippy::print_stdout)]

#[path = "../tests/support/inproc.rs"]
mod inproc;

/// The allocator the `relay` binary ships with (see the workspace's Cargo.toml).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

const AGENT: &str = "date +%s%N > \"$HARNESS_RELAY_FILE.start\"";

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos()
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

async fn baseline(n: usize, dir: &std::path::Path) -> Vec<f64> {
    let mut out = Vec::new();
    for i in 0..n {
        let file = dir.join(format!("baseline.{i}"));
        let start = now_ns();
        let status = tokio::process::Command::new("sh")
            .arg("-c")
            .arg(AGENT)
            .env("HARNESS_RELAY_FILE", &file)
            .status()
            .await
            .expect("sh runs");
        assert!(status.success());
        let started: u128 = std::fs::read_to_string(format!("{}.start", file.display()))
            .expect("start time")
            .trim()
            .parse()
            .expect("ns");
        out.push((started.saturating_sub(start)) as f64 / 1e6);
    }
    out.sort_by(f64::total_cmp);
    out
}

/// Per attempt the daemon ran, in ms: claim answer → first instruction of the agent, and firing
/// (the run record's `started_at`, before admission and the claim request) → first instruction,
/// which also holds the claim's wait at the store. Also the firing's split, medians over the
/// attempts: firing → the server's claim time (the attempt's `claimed_at` in the store: request
/// out, HTTP in, the server's checks), → the claim answer's arrival (the store's queue and
/// commit, the answer back), → spawn.
async fn latencies(
    store: &relay_server::store::Store,
    state: &std::path::Path,
    harnesses: usize,
) -> Latencies {
    let time = |v: &serde_json::Value| {
        v.as_str()
            .and_then(relay_core::time::parse_rfc3339)
            .expect("an RFC 3339 time") as f64
    };
    let mut l = Latencies::default();
    for n in 0..harnesses {
        let dir = state.join(format!("jobs/w{n}"));
        for e in std::fs::read_dir(&dir).expect("jobs dir").flatten() {
            let p = e.path();
            let Some(context) = p
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".start"))
            else {
                continue;
            };
            let json = |path: std::path::PathBuf| -> serde_json::Value {
                serde_json::from_slice(&std::fs::read(path).expect("readable")).expect("json")
            };
            let ctx = json(dir.join(context));
            let claimed = time(&ctx["attempt"]["claimed_at"]);
            let run_id = context.strip_suffix(".relay.json").expect("a context file");
            let fired = time(&json(state.join(format!("runs/w{n}/{run_id}.json")))["started_at"]);
            let view = store
                .apply(relay_core::ledger::Op::GetTodo {
                    actor: relay_core::ledger::Actor::cli(),
                    id: ctx["todo"]["id"].as_str().expect("todo id").to_string(),
                    attempts_limit: 100,
                })
                .await
                .and_then(relay_core::ledger::Answer::view)
                .expect("the todo");
            let seq = ctx["attempt"]["seq"].as_u64().expect("seq");
            let at_server = view
                .attempts
                .iter()
                .find(|a| u64::from(a.seq) == seq)
                .expect("the attempt")
                .claimed_at as f64;
            let started = std::fs::read_to_string(&p)
                .expect("start")
                .trim()
                .parse::<f64>()
                .expect("ns")
                / 1e6;
            l.claim.push(started - claimed);
            l.store.push(started - at_server);
            l.fire.push(started - fired);
            l.to_server.push(at_server - fired);
            l.to_answer.push(claimed - at_server);
        }
    }
    for v in [
        &mut l.claim,
        &mut l.store,
        &mut l.fire,
        &mut l.to_server,
        &mut l.to_answer,
    ] {
        v.sort_by(f64::total_cmp);
    }
    l
}

#[derive(Default)]
struct Latencies {
    claim: Vec<f64>,
    store: Vec<f64>,
    fire: Vec<f64>,
    to_server: Vec<f64>,
    to_answer: Vec<f64>,
}

/// Runs `todos` attempts of `harnesses` harnesses and returns their latencies (see `latencies`).
/// `fire`: `None` lets the schedule (every second, all at once) fire them; `Some(())` fires one
/// harness by hand each time the previous attempt is done (no contention anywhere).
async fn scenario(harnesses: usize, todos: usize, by_hand: bool) -> Latencies {
    let system = inproc::System::start();
    let schedule = if by_hand { "@daily" } else { "@every 1s" };
    let config = system
        .config(
            harnesses,
            &["sh", "-c", AGENT],
            &format!("schedule = \"{schedule}\""),
        )
        .await;
    let (daemon, handle) = system.daemon(&config).await;
    let running = tokio::spawn(daemon.run());
    system.add(todos).await;
    let start = tokio::time::Instant::now();
    // A firing that lands while the previous run is still closing is skipped (overlap); fire
    // again when nothing happened for a while.
    let mut fired = (0, tokio::time::Instant::now());
    loop {
        let done = system.done().await;
        if done == todos {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(180),
            "attempts did not finish ({done} of {todos})"
        );
        if by_hand && (fired.0 == done || fired.1.elapsed() > Duration::from_millis(50)) {
            handle.trigger("w0");
            fired = (done + 1, tokio::time::Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(if by_hand { 2 } else { 100 })).await;
    }
    handle.stop();
    running.await.expect("daemon stops");
    latencies(&system.store, &system.path().join("state"), harnesses).await
}

fn report(what: &str, harnesses: usize, l: &Latencies, base: &[f64]) {
    for (path, from, lat) in [
        ("claim_spawn", "claim", &l.claim),
        ("store_claim_spawn", "store claim", &l.store),
        ("fire_spawn", "firing", &l.fire),
    ] {
        println!(
            "{from} → spawn, {what}: {} attempts, p50 {:.2} ms, p99 {:.2} ms; ratio to the bare spawn p50 {:.1}x, p99 {:.1}x",
            lat.len(),
            pct(lat, 0.5),
            pct(lat, 0.99),
            pct(lat, 0.5) / pct(base, 0.5),
            pct(lat, 0.99) / pct(base, 0.99)
        );
        println!(
            "RESULT bench=daemon store=sqlite path={path} harnesses={harnesses} p50_ms={:.2} p99_ms={:.2} base_p50_ms={:.2} base_p99_ms={:.2}",
            pct(lat, 0.5),
            pct(lat, 0.99),
            pct(base, 0.5),
            pct(base, 0.99)
        );
    }
    println!(
        "  firing → spawn, split (medians): to the server's claim {:.2} ms, then to the answer at the daemon {:.2} ms, then to the agent {:.2} ms",
        pct(&l.to_server, 0.5),
        pct(&l.to_answer, 0.5),
        pct(&l.claim, 0.5)
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // 1. claim → spawn. claimed_at has ms resolution.
    let dir = tempfile::tempdir().expect("tempdir");
    let base = baseline(200, dir.path()).await;
    println!(
        "baseline, tokio spawn → first instruction: p50 {:.2} ms, p99 {:.2} ms",
        pct(&base, 0.5),
        pct(&base, 0.99)
    );
    report(
        "one harness fired by hand after each attempt",
        1,
        &scenario(1, 100, true).await,
        &base,
    );
    report(
        "twenty harnesses whose schedule fires them in the same instant",
        20,
        &scenario(20, 200, false).await,
        &base,
    );

    // 2. Memory of 100 idle leased harnesses.
    let idle = inproc::System::start();
    let config = idle.config(100, &["true"], "schedule = \"@daily\"").await;
    let before = rss_kib();
    let (daemon, handle) = idle.daemon(&config).await;
    let running = tokio::spawn(daemon.run());
    let start = tokio::time::Instant::now();
    loop {
        if idle.sessions_verified(100).await {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "sessions never verified"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let after = rss_kib();
    println!(
        "memory: 100 idle leased harnesses add {:.1} MiB RSS ({:.1} KiB each); process baseline {:.1} MiB",
        after.saturating_sub(before) as f64 / 1024.0,
        after.saturating_sub(before) as f64 / 100.0,
        before as f64 / 1024.0
    );
    handle.stop();
    running.await.expect("daemon stops");
}
