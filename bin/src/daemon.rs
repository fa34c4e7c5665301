//! `relay daemon` and the commands that talk to it: `trigger`, `describe`, `runs`, `doctor`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use relay_io::clock::SystemClock;
use relay_io::daemon::control::{self, Request};
use relay_io::daemon::{Daemon, DaemonOptions};
use relay_io::journal::Journal;
use serde_json::Value;

/// Where the daemon keeps its state, shared by every daemon command.
#[derive(clap::Args, Clone, Debug)]
pub struct StateArgs {
    /// The daemon's harness.toml (its harness.d/ drop-ins are read too).
    #[arg(long, env = "RELAY_CONFIG")]
    pub config: Option<PathBuf>,
    /// The state directory: run records, run logs, context files, the control socket.
    /// Default: $XDG_STATE_HOME/relay, else ~/.local/state/relay.
    #[arg(long, env = "RELAY_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
}

impl StateArgs {
    pub fn state_dir(&self) -> PathBuf {
        if let Some(dir) = &self.state_dir {
            return dir.clone();
        }
        if let Some(xdg) = std::env::var_os("XDG_STATE_HOME") {
            return PathBuf::from(xdg).join("relay");
        }
        match std::env::var_os("HOME") {
            Some(home) => PathBuf::from(home).join(".local/state/relay"),
            None => PathBuf::from(".relay-state"),
        }
    }
}

#[derive(clap::Args)]
pub struct DaemonArgs {
    #[command(flatten)]
    state: StateArgs,
    /// Serve Prometheus metrics at http://ADDR/metrics.
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<std::net::SocketAddr>,
}

#[derive(clap::Args)]
pub struct HarnessArgs {
    /// The harness's name, as in [harness.<name>].
    harness: String,
    #[command(flatten)]
    state: StateArgs,
}

#[derive(clap::Args)]
pub struct DescribeArgs {
    /// The harness's name; every leased harness when omitted.
    harness: Option<String>,
    #[command(flatten)]
    state: StateArgs,
    /// One JSON document on stdout.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct RunsArgs {
    /// The harness's name.
    harness: String,
    #[command(flatten)]
    state: StateArgs,
    /// How many runs, newest first.
    #[arg(long, default_value_t = 20)]
    limit: usize,
    /// One JSON document on stdout.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct DoctorArgs {
    #[command(flatten)]
    state: StateArgs,
    /// One JSON document on stdout.
    #[arg(long)]
    json: bool,
}

fn fail(message: impl std::fmt::Display) -> ExitCode {
    eprintln!("relay: {message}");
    ExitCode::from(1)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("the tokio runtime starts")
}

pub fn daemon(args: DaemonArgs) -> ExitCode {
    let Some(config) = args.state.config.clone() else {
        return fail(
            "`relay daemon` needs --config FILE (or RELAY_CONFIG): the harness.toml to run",
        );
    };
    crate::logs::init("info", false);
    let rt = runtime();
    rt.block_on(async move {
        let transport = match relay_io::lease::ReqwestTransport::new() {
            Ok(t) => Arc::new(t),
            Err(e) => return fail(format!("the HTTP client did not start: {e}")),
        };
        let opts = DaemonOptions {
            config,
            state_dir: args.state.state_dir(),
            host: host_name(),
            clock: Arc::new(SystemClock),
            transport,
            daemon_env: std::env::vars().collect(),
            seed: rand::random(),
        };
        let (daemon, handle) = match Daemon::start(opts).await {
            Ok(d) => d,
            Err(e) => return fail(e),
        };
        if let Some(addr) = args.metrics_listen
            && let Err(e) = relay_io::daemon::serve_metrics(addr, daemon.metrics()).await
        {
            return fail(format!("cannot serve metrics on {addr}: {e}"));
        }
        let stopper = handle.clone();
        tokio::spawn(async move {
            relay_io::shutdown_signal().await;
            tracing::info!("stopping: attempts in flight are released or failed first");
            stopper.stop();
        });
        daemon.run().await;
        ExitCode::SUCCESS
    })
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

fn ask(state: &StateArgs, request: Request) -> Result<Value, String> {
    let dir = state.state_dir();
    runtime().block_on(control::request(&dir, &request, Duration::from_secs(60)))
}

#[allow(clippy::print_stdout)]
pub fn trigger(args: HarnessArgs) -> ExitCode {
    match ask(
        &args.state,
        Request::Trigger {
            harness: args.harness.clone(),
        },
    ) {
        Ok(_) => {
            println!("fired {}", args.harness);
            ExitCode::SUCCESS
        }
        Err(e) => fail(e),
    }
}

#[allow(clippy::print_stdout)]
pub fn describe(args: DescribeArgs) -> ExitCode {
    let answer = match ask(
        &args.state,
        Request::Describe {
            harness: args.harness.clone(),
        },
    ) {
        Ok(a) => a,
        Err(e) => return fail(e),
    };
    let harnesses = answer
        .get("harnesses")
        .cloned()
        .unwrap_or(Value::Array(Vec::new()));
    if args.json {
        println!("{harnesses}");
        return ExitCode::SUCCESS;
    }
    for h in harnesses.as_array().into_iter().flatten() {
        let s = |v: &Value| match v {
            Value::String(s) => s.clone(),
            Value::Null => "-".into(),
            other => other.to_string(),
        };
        let relay = &h["relay"];
        let source = &h["source"];
        println!("harness {}", s(&relay["harness"]));
        println!(
            "  lease source   {} ({})",
            s(&source["name"]),
            s(&source["url"])
        );
        println!("  header names   {}", s(&source["header_names"]));
        println!("  session        {}", s(&source["session"]));
        println!("  next schedule  {}", s(&h["schedule"]));
        match relay.get("attempt").filter(|a| !a.is_null()) {
            Some(a) => println!(
                "  in flight      run {} {} todo {} attempt {}/{} lease deadline {}",
                s(&a["run_id"]),
                s(&a["phase"]),
                s(&a["todo_id"]),
                s(&a["attempt"]),
                s(&a["max_attempts"]),
                s(&a["lease_deadline"])
            ),
            None => println!("  in flight      -"),
        }
    }
    ExitCode::SUCCESS
}

#[allow(clippy::print_stdout)]
pub fn doctor(args: DoctorArgs) -> ExitCode {
    let answer = match ask(&args.state, Request::Doctor) {
        Ok(a) => a,
        Err(e) => return fail(e),
    };
    let rows = answer
        .get("rows")
        .cloned()
        .unwrap_or(Value::Array(Vec::new()));
    let failing = rows
        .as_array()
        .into_iter()
        .flatten()
        .any(|r| r["level"] == "fail");
    if args.json {
        println!("{rows}");
    } else {
        for r in rows.as_array().into_iter().flatten() {
            println!(
                "{:<6} {:<24} {}",
                r["level"].as_str().unwrap_or("?"),
                r["subject"].as_str().unwrap_or("?"),
                r["message"].as_str().unwrap_or("")
            );
        }
    }
    if failing {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

#[allow(clippy::print_stdout)]
pub fn runs(args: RunsArgs) -> ExitCode {
    let dir = args.state.state_dir();
    let journal = match Journal::open(Path::new(&dir)) {
        Ok(j) => j,
        Err(e) => return fail(e),
    };
    let records = match journal.records(&args.harness, args.limit) {
        Ok(r) => r,
        Err(e) => return fail(e),
    };
    if args.json {
        println!("{}", serde_json::to_string(&records).unwrap_or_default());
        return ExitCode::SUCCESS;
    }
    println!(
        "{:>6}  {:<12} {:<26} {:<14} {:<24} {:>7}  trigger",
        "run", "outcome", "started", "relay", "todo", "attempt"
    );
    for r in records {
        let outcome = serde_json::to_value(r.outcome).unwrap_or_default();
        let relay_outcome = r.relay_outcome.map(|o| o.as_str()).unwrap_or("-");
        let reason = r
            .skipped_reason
            .and_then(|s| serde_json::to_value(s).ok())
            .and_then(|v| v.as_str().map(str::to_string));
        let relay_col = reason.unwrap_or_else(|| relay_outcome.to_string());
        println!(
            "{:>6}  {:<12} {:<26} {:<14} {:<24} {:>7}  {}",
            r.run_id,
            outcome.as_str().unwrap_or("?"),
            r.started_at,
            relay_col,
            r.todo_id.as_deref().unwrap_or("-"),
            r.attempt
                .map(|a| a.to_string())
                .unwrap_or_else(|| "-".into()),
            r.trigger
        );
    }
    ExitCode::SUCCESS
}
