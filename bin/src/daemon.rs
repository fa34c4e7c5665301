//! `relay daemon` and the commands that talk to it: `trigger`, `describe`, `runs`, `doctor`,
//! `reload`, `stop`, `events`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use crate::operator::JsonOpt;
use relay_worker::clock::SystemClock;
use relay_worker::daemon::control::{self, Request, RequestError};
use relay_worker::daemon::{Daemon, DaemonOptions};
use relay_worker::journal::Journal;
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
    #[command(flatten)]
    out: JsonOpt,
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
    #[command(flatten)]
    out: JsonOpt,
}

#[derive(clap::Args)]
pub struct DoctorArgs {
    #[command(flatten)]
    state: StateArgs,
    #[command(flatten)]
    out: JsonOpt,
}

#[derive(clap::Args)]
pub struct ReloadArgs {
    #[command(flatten)]
    state: StateArgs,
    #[command(flatten)]
    out: JsonOpt,
}

#[derive(clap::Args)]
pub struct EventsArgs {
    #[command(flatten)]
    state: StateArgs,
    /// Keep printing events as they happen, until the daemon stops.
    #[arg(long, short = 'f')]
    follow: bool,
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
        let transport = match relay_worker::lease::ReqwestTransport::new() {
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
            launcher: Arc::new(relay_worker::runner::Processes),
            seed: rand::random(),
        };
        let (daemon, handle) = match Daemon::start(opts).await {
            Ok(d) => d,
            Err(e) => return fail(e),
        };
        if let Some(addr) = args.metrics_listen
            && let Err(e) = relay_worker::daemon::serve_metrics(addr, daemon.metrics()).await
        {
            return fail(format!("cannot serve metrics on {addr}: {e}"));
        }
        // SIGHUP re-reads the config; the outcome is logged (`relay reload` also prints it).
        let reloader = handle.clone();
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
            Ok(mut hup) => {
                tokio::spawn(async move {
                    while hup.recv().await.is_some() {
                        tracing::info!("SIGHUP: reloading the config");
                        reloader.reload();
                    }
                });
            }
            Err(e) => tracing::warn!(error = %e, "SIGHUP cannot be caught: use `relay reload`"),
        }
        let stopper = handle.clone();
        let stop = crate::shutdown_signal();
        tokio::spawn(async move {
            stop.await;
            crate::notify::stopping();
            tracing::info!("stopping: attempts in flight are released or failed first");
            stopper.stop();
        });
        // Ready: the config is loaded, the control socket and any metrics listener are bound.
        crate::notify::ready();
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
    ask_daemon(state, request).map_err(|e| e.to_string())
}

fn ask_daemon(state: &StateArgs, request: Request) -> Result<Value, RequestError> {
    let dir = state.state_dir();
    runtime().block_on(control::request(&dir, &request, Duration::from_secs(60)))
}

pub fn trigger(args: HarnessArgs) -> ExitCode {
    match ask(
        &args.state,
        Request::Trigger {
            harness: args.harness.clone(),
        },
    ) {
        Ok(_) => {
            out!("fired {}", args.harness);
            ExitCode::SUCCESS
        }
        Err(e) => fail(e),
    }
}

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
    if args.out.json {
        out!("{harnesses}");
        return ExitCode::SUCCESS;
    }
    for h in harnesses.as_array().into_iter().flatten() {
        // Ids and names may come from a queue server: escaped for the terminal.
        let s = |v: &Value| {
            let text = match v {
                Value::String(s) => s.clone(),
                Value::Null => "-".into(),
                other => other.to_string(),
            };
            relay_core::limits::escape_text(&text).into_owned()
        };
        let relay = &h["relay"];
        let source = &h["source"];
        out!("harness {}", s(&relay["harness"]));
        out!(
            "  lease source   {} ({})",
            s(&source["name"]),
            s(&source["url"])
        );
        out!("  header names   {}", s(&source["header_names"]));
        out!("  session        {}", s(&source["session"]));
        out!("  next schedule  {}", s(&h["schedule"]));
        match relay.get("attempt").filter(|a| !a.is_null()) {
            Some(a) => out!(
                "  in flight      run {} {} todo {} attempt {}/{} lease deadline {}",
                s(&a["run_id"]),
                s(&a["phase"]),
                s(&a["todo_id"]),
                s(&a["attempt"]),
                s(&a["max_attempts"]),
                s(&a["lease_deadline"])
            ),
            None => out!("  in flight      -"),
        }
    }
    ExitCode::SUCCESS
}

/// With a daemon running for the state dir, its rows; without one, the rows of `--config`'s
/// sources, asked directly (an operator runs doctor precisely when the daemon does not work).
#[allow(clippy::print_stderr)]
pub fn doctor(args: DoctorArgs) -> ExitCode {
    let rows = match ask_daemon(&args.state, Request::Doctor) {
        Ok(answer) => answer
            .get("rows")
            .cloned()
            .unwrap_or(Value::Array(Vec::new())),
        Err(RequestError::NoDaemon(why)) => {
            let Some(config) = args.state.config.clone() else {
                return fail(format!(
                    "{why}; or pass --config FILE to check its lease sources without a daemon"
                ));
            };
            eprintln!(
                "relay: no daemon runs for {}; checking the lease sources of {} directly",
                args.state.state_dir().display(),
                config.display()
            );
            let transport = match relay_worker::lease::ReqwestTransport::new() {
                Ok(t) => Arc::new(t),
                Err(e) => return fail(format!("the HTTP client did not start: {e}")),
            };
            match runtime().block_on(relay_worker::daemon::doctor::standalone(&config, transport)) {
                Ok(rows) => serde_json::to_value(rows).unwrap_or_default(),
                Err(e) => return fail(e),
            }
        }
        Err(e) => return fail(e),
    };
    let failing = rows
        .as_array()
        .into_iter()
        .flatten()
        .any(|r| r["level"] == "fail");
    if args.out.json {
        out!("{rows}");
    } else {
        for r in rows.as_array().into_iter().flatten() {
            out!(
                "{:<6} {:<24} {}",
                r["level"].as_str().unwrap_or("?"),
                relay_core::limits::escape_text(r["subject"].as_str().unwrap_or("?")),
                relay_core::limits::escape_text(r["message"].as_str().unwrap_or(""))
            );
        }
    }
    if failing {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

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
    if args.out.json {
        out!("{}", serde_json::to_string(&records).unwrap_or_default());
        return ExitCode::SUCCESS;
    }
    out!(
        "{:>6}  {:<12} {:<26} {:<14} {:<24} {:>7}  trigger",
        "run",
        "outcome",
        "started",
        "relay",
        "todo",
        "attempt"
    );
    for r in records {
        let outcome = serde_json::to_value(r.outcome).unwrap_or_default();
        let relay_outcome = r.relay_outcome.map(|o| o.as_str()).unwrap_or("-");
        let reason = r
            .skipped_reason
            .and_then(|s| serde_json::to_value(s).ok())
            .and_then(|v| v.as_str().map(str::to_string));
        let relay_col = reason.unwrap_or_else(|| relay_outcome.to_string());
        out!(
            "{:>6}  {:<12} {:<26} {:<14} {:<24} {:>7}  {}",
            r.run_id,
            outcome.as_str().unwrap_or("?"),
            r.started_at,
            relay_col,
            relay_core::limits::escape_text(r.todo_id.as_deref().unwrap_or("-")),
            r.attempt
                .map(|a| a.to_string())
                .unwrap_or_else(|| "-".into()),
            r.trigger
        );
    }
    ExitCode::SUCCESS
}

/// `relay reload`: the daemon re-reads its config and says what changed.
pub fn reload(args: ReloadArgs) -> ExitCode {
    let answer = match ask(&args.state, Request::Reload) {
        Ok(a) => a,
        Err(e) => return fail(e),
    };
    if args.out.json {
        out!("{answer}");
        return ExitCode::SUCCESS;
    }
    for line in reload_lines(&answer) {
        out!("{line}");
    }
    ExitCode::SUCCESS
}

fn names(v: &Value) -> Vec<String> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|n| n.as_str().map(str::to_string))
        .collect()
}

/// The reload answer as lines a person reads: one per change.
fn reload_lines(answer: &Value) -> Vec<String> {
    let diff = &answer["diff"];
    let mut out = vec![format!(
        "reloaded {} ({} drop-in{})",
        answer["config"].as_str().unwrap_or("?"),
        answer["dropins"],
        if answer["dropins"] == 1 { "" } else { "s" }
    )];
    let aborted: Vec<(String, String)> = answer["aborted"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|a| {
            (
                a["harness"].as_str().unwrap_or("?").to_string(),
                a["run_id"].to_string(),
            )
        })
        .collect();
    let aborted_run = |h: &str| {
        aborted
            .iter()
            .find(|(n, _)| n == h)
            .map(|(_, r)| format!(": its run {r} is stopped and released"))
            .unwrap_or_default()
    };
    for h in names(&diff["harnesses"]["added"]) {
        out.push(format!("harness {h} added"));
    }
    for h in names(&diff["harnesses"]["removed"]) {
        out.push(format!("harness {h} removed{}", aborted_run(&h)));
    }
    for h in names(&diff["harnesses"]["changed"]) {
        out.push(format!("harness {h} changed{}", aborted_run(&h)));
    }
    for r in answer["reconfigured"].as_array().into_iter().flatten() {
        let h = r["harness"].as_str().unwrap_or("?");
        match r["applies"].as_str() {
            Some("after_run") => out.push(format!(
                "harness {h}: new settings apply after run {} (it runs on under the ones it started with)",
                r["run_id"]
            )),
            _ => out.push(format!("harness {h}: new settings apply from the next firing")),
        }
    }
    for (kind, label) in [
        ("queues", "lease source"),
        ("cairns", "cairn"),
        ("channels", "channel"),
    ] {
        for (what, verb) in [
            ("added", "added"),
            ("removed", "removed"),
            ("changed", "changed"),
        ] {
            for n in names(&diff[kind][what]) {
                let session = names(&diff["new_sessions"]).contains(&n);
                let note = if session { " (a new session)" } else { "" };
                out.push(format!("{label} {n} {verb}{note}"));
            }
        }
    }
    if out.len() == 1 {
        out.push("nothing changed".into());
    }
    out
}

/// `relay stop HARNESS`: an operator stop of the attempt in flight. Exit status 0 whether or
/// not one was in flight (the harness runs nothing afterwards either way); the line says which.
pub fn stop(args: HarnessArgs) -> ExitCode {
    let answer = match ask(
        &args.state,
        Request::Stop {
            harness: args.harness.clone(),
        },
    ) {
        Ok(a) => a,
        Err(e) => return fail(e),
    };
    let h = &args.harness;
    let todo = answer["todo_id"]
        .as_str()
        .map(|t| format!(", todo {t}"))
        .unwrap_or_default();
    if answer["stopped"] == true {
        out!(
            "stopping {h}: run {}{todo} is stopped and its lease released; later firings run as scheduled",
            answer["run_id"]
        );
    } else if answer["run_id"].is_null() {
        out!("nothing to stop: {h} has no attempt in flight");
    } else {
        out!(
            "nothing to stop: {h}'s run {}{todo} is already ending ({})",
            answer["run_id"],
            answer["phase"].as_str().unwrap_or("?")
        );
    }
    ExitCode::SUCCESS
}

/// `relay events [--follow]`: the daemon's events, one JSON object per line.
pub fn events(args: EventsArgs) -> ExitCode {
    let dir = args.state.state_dir();
    let printed = runtime().block_on(control::events(&dir, args.follow, |event| out!("{event}")));
    match printed {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(e),
    }
}
