//! The daemon in process against a real server: no leaked task — after 100 attempts
//! the daemon's runtime holds as many tasks as before them.

#[path = "support/inproc.rs"]
mod inproc;

use std::time::Duration;

/// Polls `f` until it holds; the bound only turns a hang into a failure.
async fn until(what: &str, mut f: impl AsyncFnMut() -> bool) {
    let start = tokio::time::Instant::now();
    while !f().await {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_100_attempts_the_task_count_returns_to_its_baseline() {
    let system = inproc::System::start();
    let config = system
        .config(10, &["true"], "schedule = \"@every 1s\"")
        .await;
    let (daemon, handle) = system.daemon(&config).await;
    let running = tokio::spawn(daemon.run());
    let metrics = tokio::runtime::Handle::current().metrics();

    // A warm-up round fills the HTTP connection pool (bounded by the ten workers), so the
    // baseline counts the tasks a steady daemon holds, not its first connections.
    system.add(20).await;
    until("the warm-up todos", async || system.done().await == 20).await;
    until("no attempt in flight", async || idle(&system).await).await;
    let baseline = metrics.num_alive_tasks();

    system.add(100).await;
    until("100 more todos done", async || system.done().await == 120).await;
    until("no attempt in flight", async || idle(&system).await).await;
    until("the task count back at its baseline", async || {
        metrics.num_alive_tasks() <= baseline
    })
    .await;

    handle.stop();
    running.await.expect("the daemon stops");
}

/// No run record of the daemon is still `running`.
async fn idle(system: &inproc::System) -> bool {
    let journal =
        relay_worker::journal::Journal::open(system.path().join("state")).expect("journal");
    (0..10).all(|n| {
        journal
            .records(&format!("w{n}"), 5)
            .expect("records")
            .iter()
            .all(|r| r.outcome != relay_core::relay::RunOutcome::Running)
    })
}
