//! The daemon's own costs, on loopback against a real server (SQLite):
//!
//! 1. claim → spawn latency: from the server's claim instant (the attempt's `claimed_at`) to
//!    the first instruction of the agent (it writes its clock), p50 / p99 over 200 attempts of
//!    ten harnesses; against a baseline measured in the same run: starting the same program
//!    from tokio directly (spawn → first instruction).
//! 2. Memory: the process's resident set before and after a daemon with 100 leased harnesses
//!    has started and verified its lease source, idle.
//!
//! `cargo bench -p relay-io --bench daemon`

#[path = "../tests/support/inproc.rs"]
mod inproc;

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

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let system = inproc::System::start();

    // 1. claim → spawn.
    let base = baseline(200, system.path()).await;
    let config = system.config(10, &["sh", "-c", AGENT], "").await;
    let (daemon, handle) = system.daemon(&config).await;
    let running = tokio::spawn(daemon.run());
    system.add(200).await;
    let start = tokio::time::Instant::now();
    while system.done().await < 200 {
        assert!(
            start.elapsed() < Duration::from_secs(300),
            "attempts did not finish"
        );
        for n in 0..10 {
            handle.trigger(&format!("w{n}"));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    handle.stop();
    running.await.expect("daemon stops");
    let mut lat = Vec::new();
    for n in 0..10 {
        let dir = system.path().join(format!("state/jobs/w{n}"));
        for e in std::fs::read_dir(&dir).expect("jobs dir").flatten() {
            let p = e.path();
            let Some(name) = p.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            let Some(context) = name.strip_suffix(".start") else {
                continue;
            };
            let ctx: serde_json::Value =
                serde_json::from_slice(&std::fs::read(dir.join(context)).expect("context"))
                    .expect("json");
            let claimed = ctx["attempt"]["claimed_at"]
                .as_str()
                .and_then(relay_core::time::parse_rfc3339)
                .expect("claimed_at") as f64;
            let started: f64 = std::fs::read_to_string(&p)
                .expect("start")
                .trim()
                .parse::<f64>()
                .expect("ns")
                / 1e6;
            lat.push(started - claimed);
        }
    }
    lat.sort_by(f64::total_cmp);
    println!(
        "claim → spawn over {} attempts: p50 {:.2} ms, p99 {:.2} ms (claimed_at has ms resolution)",
        lat.len(),
        pct(&lat, 0.5),
        pct(&lat, 0.99)
    );
    println!(
        "baseline, tokio spawn → first instruction: p50 {:.2} ms, p99 {:.2} ms",
        pct(&base, 0.5),
        pct(&base, 0.99)
    );
    println!(
        "ratio p50 {:.1}x, p99 {:.1}x",
        pct(&lat, 0.5) / pct(&base, 0.5),
        pct(&lat, 0.99) / pct(&base, 0.99)
    );

    // 2. Memory of 100 idle leased harnesses.
    let idle = inproc::System::start();
    let config = idle.config(100, &["true"], "schedule = \"@daily\"").await;
    let before = rss_kib();
    let (daemon, handle) = idle.daemon(&config).await;
    let running = tokio::spawn(daemon.run());
    let state = idle.path().join("state");
    let start = tokio::time::Instant::now();
    loop {
        let answer = relay_io::daemon::control::request(
            &state,
            &relay_io::daemon::control::Request::Describe { harness: None },
            Duration::from_secs(10),
        )
        .await
        .expect("describe");
        let supported = answer["harnesses"].as_array().is_some_and(|h| {
            h.len() == 100 && h.iter().all(|h| h["source"]["session"] == "supported")
        });
        if supported {
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
