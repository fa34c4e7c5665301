//! The daemon in process against a real server: no leaked task — after 100 attempts
//! the daemon's runtime holds as many tasks as before them; a stuck spawn holds up no other
//! harness; and processes are reached only through the daemon's `Launcher`.

#[path = "support/inproc.rs"]
mod inproc;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use relay_core::relay::{ExitStatus, Input, RunOutcome, Signal};
use relay_worker::runner::{
    AgentSpec, CheckSpec, Control, Launched, Launcher, RunnerError, StartError, StartKind,
};

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

/// A spawn that cannot finish (its run log is a FIFO nobody reads yet, so opening it blocks)
/// holds up no other harness: the fork and exec run off the daemon's actor. Stopping the daemon
/// meanwhile signals the run; the signal waits for the process and reaches it once it exists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_spawn_holds_up_no_other_harness_and_gets_its_signals_once_started() {
    let system = inproc::System::start();
    let agent = r#"case "$HARNESS_RELAY_FILE" in */w0/*) exec sleep 30;; esac"#;
    let config = system
        .config(2, &["sh", "-c", agent], "schedule = \"@daily\"")
        .await;
    let journal =
        relay_worker::journal::Journal::open(system.path().join("state")).expect("journal");
    let run_id = journal.next_run_id("w0").expect("run id");
    let fifo = journal.run_log("w0", run_id);
    std::fs::create_dir_all(fifo.parent().expect("jobs dir")).expect("jobs dir");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .expect("mkfifo runs");
    assert!(made.success());
    let (daemon, handle) = system.daemon(&config).await;
    let running = tokio::spawn(daemon.run());
    system.add(2).await;

    // Fired once the source's session is verified (a firing before that is skipped, and would
    // take the run id the FIFO is named for).
    until("the session verified", async || {
        system.sessions_verified(2).await
    })
    .await;
    // w0 claims and writes its context file; the next command is its spawn, which blocks.
    handle.trigger("w0");
    let context = journal.run_paths("w0", run_id).context_file;
    until("w0's context file", async || context.exists()).await;
    handle.trigger("w1");
    until("w1's todo done while w0's spawn is stuck", async || {
        system.done().await == 1
    })
    .await;

    handle.stop();
    // Let w0's process start now: it must get the stop's signal and end.
    let reader = tokio::task::spawn_blocking(move || std::fs::File::open(fifo).expect("fifo"));
    let _reader = reader.await.expect("the fifo opens");
    tokio::time::timeout(Duration::from_secs(60), running)
        .await
        .expect("the daemon stops")
        .expect("the daemon stops cleanly");
    let record = journal
        .record("w0", run_id)
        .expect("journal")
        .expect("w0's run record");
    assert_ne!(
        record.outcome,
        relay_core::relay::RunOutcome::Running,
        "{record:?}"
    );
    assert_eq!(system.done().await, 1, "w0's todo was not completed");
}

/// A launcher that starts no process: each agent it is asked for is a wait that ends with exit
/// code 0 when the test fires the oneshot it hands over, and a control that records signals.
struct Modelled {
    started: tokio::sync::mpsc::UnboundedSender<(AgentSpec, tokio::sync::oneshot::Sender<()>)>,
    signals: Arc<Mutex<Vec<Signal>>>,
}

struct Recorded(Arc<Mutex<Vec<Signal>>>);

impl Control for Recorded {
    fn signal(&self, signal: Signal) -> Result<(), RunnerError> {
        self.0.lock().expect("signals").push(signal);
        Ok(())
    }
}

impl Launcher for Modelled {
    fn agent(&self, spec: AgentSpec) -> Result<Launched, StartError> {
        let (exit, exited) = tokio::sync::oneshot::channel();
        let run_id = spec.run_id;
        let _ = self.started.send((spec, exit));
        Ok(Launched {
            control: Arc::new(Recorded(self.signals.clone())),
            wait: Box::pin(async move {
                let exit = match exited.await {
                    Ok(()) => ExitStatus::Code(0),
                    Err(_) => ExitStatus::Signal(9),
                };
                Input::ProcessExited {
                    run_id,
                    exit,
                    summary_file: None,
                }
            }),
        })
    }

    fn check(&self, spec: CheckSpec) -> Result<Launched, StartError> {
        Err(StartError {
            run_id: spec.run_id,
            kind: StartKind::Check,
            message: "this test configures no check".into(),
        })
    }
}

/// The daemon starts and ends agents only through its `Launcher`: with one that starts no
/// process (and an agent program that does not exist), a claimed todo stays open until the
/// modelled agent exits, then is done and its run closed as a success.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_runs_agents_only_through_its_launcher() {
    let system = inproc::System::start();
    let config = system
        .config(1, &["/nonexistent/agent"], "schedule = \"@every 1s\"")
        .await;
    let (started, mut starts) = tokio::sync::mpsc::unbounded_channel();
    let signals = Arc::new(Mutex::new(Vec::new()));
    let launcher = Modelled {
        started,
        signals: signals.clone(),
    };
    let (daemon, handle) = system.daemon_with(&config, Arc::new(launcher)).await;
    let running = tokio::spawn(daemon.run());
    system.add(1).await;

    let (spec, exit) = tokio::time::timeout(Duration::from_secs(120), starts.recv())
        .await
        .expect("the agent is launched")
        .expect("the launcher is kept");
    assert_eq!(spec.argv, ["/nonexistent/agent"]);
    assert_eq!(system.done().await, 0, "done before the agent exited");
    exit.send(()).expect("the wait is awaited");
    until("the todo done", async || system.done().await == 1).await;

    let journal =
        relay_worker::journal::Journal::open(system.path().join("state")).expect("journal");
    until("the run closed", async || {
        journal
            .record("w0", spec.run_id)
            .expect("journal")
            .is_some_and(|r| r.outcome != RunOutcome::Running)
    })
    .await;
    let record = journal.record("w0", spec.run_id).expect("journal");
    assert_eq!(
        record.map(|r| r.outcome),
        Some(RunOutcome::Success),
        "the modelled agent's exit 0 closes the run as a success"
    );
    assert!(
        signals.lock().expect("signals").is_empty(),
        "an agent that exits on its own is not signalled"
    );
    handle.stop();
    running.await.expect("the daemon stops");
}
