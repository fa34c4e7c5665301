//! `relay up`: the local dev stack. One process runs the queue server (with the Board) on an
//! embedded SQLite file, vends an endpoint, adds sample todos and runs the daemon with three
//! leased workers whose agents and success checks are small shell scripts. It prints the Board's
//! URL with a one-time login link (for an operator made for this run) and the MCP endpoint's URL,
//! shows the samples' progress, and runs until Ctrl-C or SIGTERM: then the daemon releases what
//! it holds, the server drains, and it exits 0. `--until-drained` is the scripted tour: it stops
//! once the sample queue is drained and prints every attempt.
//!
//! The samples show, each on its own todo: a success; a failure retried to success; a check that
//! answers "not yet" (exit 75) before it goes green; a lease taken over after its worker was
//! killed (a worker that claimed with a 3 s lease and vanished); and a dead letter. The server
//! uses a 2 s retry backoff instead of the default 30 s so the whole tour takes seconds; the
//! daemon's settings are the ones a real config would carry.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use relay_core::ledger::{
    Actor, Answer, ClaimOpts, LedgerConfig, NewTodo, Op, TodoFilter, TodoState, TokenHash,
};
use relay_core::time::SECOND;
use relay_core::time::WallClock;
use relay_server::server::{Server, ServerConfig, new_bearer_token};
use relay_server::store::{NewEndpoint, Store};
use relay_worker::clock::SystemClock;
use relay_worker::daemon::{Daemon, DaemonOptions};
use serde_json::json;

#[derive(clap::Args)]
pub struct Args {
    /// Keep the run's files here: the SQLite store, harness.toml, the scripts, run logs and run
    /// records (default: a temporary folder, removed at exit). It must not hold an earlier run.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// The scripted tour: stop once the sample queue is drained, print every attempt, exit 0.
    #[arg(long)]
    until_drained: bool,
}

const ENDPOINT: &str = "quickstart";
const QUEUE: &str = "samples";

struct Sample {
    title: &'static str,
    behaviour: &'static str,
    max_attempts: u32,
}

const SAMPLES: [Sample; 5] = [
    Sample {
        title: "Fix the flaky login test",
        behaviour: "succeed",
        max_attempts: 3,
    },
    Sample {
        title: "Bump the parser dependency",
        behaviour: "fail-once",
        max_attempts: 3,
    },
    Sample {
        title: "Wait for CI to go green",
        behaviour: "wait",
        max_attempts: 3,
    },
    Sample {
        title: "Resume an abandoned migration",
        behaviour: "takeover",
        max_attempts: 3,
    },
    Sample {
        title: "Port the legacy billing module",
        behaviour: "always-fail",
        max_attempts: 2,
    },
];

const AGENT: &str = r#"#!/bin/sh
# A sample agent. It reads its todo from the context file relay wrote for this attempt,
# pretends to work, and leaves a summary for the next attempt (or the operator) to read.
set -u
behaviour=$(sed -n 's/.*"behaviour": *"\([a-z-]*\)".*/\1/p' "$HARNESS_RELAY_FILE" | head -n 1)
echo "agent: todo $HARNESS_TODO_ID, attempt $HARNESS_ATTEMPT of $HARNESS_MAX_ATTEMPTS ($behaviour)"
sleep 1
case "$behaviour" in
  fail-once)
    if [ "$HARNESS_ATTEMPT" -lt 2 ]; then
      printf '{"summary":"tests still red: 3 failures in parser_test.go"}' > "$HARNESS_ATTEMPT_SUMMARY_FILE"
      exit 1
    fi
    printf '{"summary":"bumped the parser; the earlier failures were a renamed API, fixed"}' > "$HARNESS_ATTEMPT_SUMMARY_FILE"
    ;;
  always-fail)
    printf '{"summary":"cannot build: the billing module needs a toolchain this host lacks"}' > "$HARNESS_ATTEMPT_SUMMARY_FILE"
    exit 1
    ;;
  *)
    printf '{"summary":"done (%s)"}' "$behaviour" > "$HARNESS_ATTEMPT_SUMMARY_FILE"
    ;;
esac
exit 0
"#;

const CHECK: &str = r#"#!/bin/sh
# The operator's success check: it, not the agent, decides the verdict. Exit 0 = success,
# 75 = not conclusive yet (relay runs it again), anything else = failure.
set -u
behaviour=$(sed -n 's/.*"behaviour": *"\([a-z-]*\)".*/\1/p' "$HARNESS_RELAY_FILE" | head -n 1)
if [ "$behaviour" = wait ]; then
  mkdir -p checks
  n=$(cat "checks/$HARNESS_TODO_ID" 2>/dev/null || echo 0)
  n=$((n + 1))
  echo "$n" > "checks/$HARNESS_TODO_ID"
  if [ "$n" -lt 3 ]; then
    echo "check: CI is still running (look $n)"
    exit 75
  fi
fi
echo "check: agent exited ${HARNESS_AGENT_EXIT:-?}"
[ "${HARNESS_AGENT_EXIT:-1}" = 0 ]
"#;

fn config(url: &str) -> String {
    let mut text = format!(
        r#"# Written by `relay up`. Three leased workers share one lease source.
[queue.samples]
url = "{url}"
env_file = "quickstart.env"
headers = {{ Authorization = "Bearer ${{RELAY_TOKEN}}" }}
queue = "{QUEUE}"
lease_ttl = "1m"
heartbeat_interval = "20s"
"#
    );
    for n in 1..=3 {
        text.push_str(&format!(
            r#"
[harness.worker-{n}]
command = ["sh", "agent.sh"]
schedule = "@every 1s"
lease = "queue.samples"
success_check = ["sh", "check.sh"]
success_check_interval = "1s"
success_check_timeout = "30s"
timeout = "2m"
keep_runs = 100
"#
        ));
    }
    text
}

fn write(path: &Path, text: &str, mode: u32) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| format!("cannot set the mode of {}: {e}", path.display()))
}

fn fail(message: impl std::fmt::Display) -> ExitCode {
    eprintln!("relay up: {message}");
    ExitCode::from(1)
}

/// The operator `relay up` makes for its Board login link. Its token is drawn and dropped: the
/// link is the way in (or `relay operator create` for another).
const OPERATOR: &str = "relay-up";

pub fn run(args: Args) -> ExitCode {
    // Only warnings, so that the progress view stays readable.
    crate::logs::init("warn", false);
    // Without --dir the files live as long as the run: the TempDir removes them when dropped.
    let (dir, temp) = match args.dir {
        Some(d) => {
            if d.join("relay.db").exists() {
                return fail(format!(
                    "--dir {} already holds a run (relay.db); give a new folder, or remove it",
                    d.display()
                ));
            }
            if let Err(e) = std::fs::create_dir_all(&d) {
                return fail(format!("cannot create --dir {}: {e}", d.display()));
            }
            (d, None)
        }
        None => match tempfile::Builder::new().prefix("relay-up-").tempdir() {
            Ok(t) => (t.path().to_path_buf(), Some(t)),
            Err(e) => return fail(format!("cannot make a temporary folder: {e}")),
        },
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("the tokio runtime starts");
    let kept = temp.is_none();
    match rt.block_on(up(&dir, args.until_drained, kept)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(e),
    }
}

/// The running stack: the server, the daemon, and how to stop them.
struct Stack {
    store: Store,
    server: Server,
    url: String,
    db: String,
    ids: Vec<String>,
    daemon: relay_worker::daemon::DaemonHandle,
    running: tokio::task::JoinHandle<()>,
    server_stop: tokio::sync::oneshot::Sender<()>,
    serving: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Stack {
    /// Stops in order: the daemon first (it releases what it holds, which needs the server),
    /// then the server (no new connections, open streams end, requests drain).
    async fn stop(self) {
        self.daemon.stop();
        let _ = self.running.await;
        let _ = self.server_stop.send(());
        let _ = self.serving.await;
    }
}

async fn up(dir: &Path, until_drained: bool, kept: bool) -> Result<(), String> {
    let dir = std::path::absolute(dir).map_err(|e| e.to_string())?;
    let stack = start(&dir).await?;
    if until_drained {
        progress(&stack.store, &stack.ids).await?;
        let (store, ids) = (stack.store.clone(), stack.ids.clone());
        stack.stop().await;
        table(&store, &ids).await?;
        out!();
        if kept {
            out!("files: {}", dir.display());
            out!(
                "  relay runs worker-1 --state-dir {}    run records",
                dir.join("state").display()
            );
            out!(
                "  {}/state/jobs/<worker>/<run>.log    run logs",
                dir.display()
            );
        } else {
            out!("files: removed (pass --dir DIR to keep the store, run logs and run records)");
        }
        return Ok(());
    }
    dev(stack, &dir).await
}

/// Starts the server (with the Board) on loopback, the endpoint, the samples and the daemon.
async fn start(dir: &Path) -> Result<Stack, String> {
    let clock = Arc::new(SystemClock);
    let mut ledger = LedgerConfig::default();
    ledger.backoff.base = 2 * SECOND;
    ledger.backoff.cap = 10 * SECOND;
    let db = format!("sqlite:{}", dir.join("relay.db").display());
    let store = Store::open(&db, ledger)
        .await
        .map_err(|e| format!("cannot open {db}: {e}"))?;

    // The server, on a loopback port of its own choosing.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| format!("cannot listen on loopback: {e}"))?;
    let bound = listener.local_addr().map_err(|e| e.to_string())?;
    let url = format!("http://{bound}");
    let mut server_config = ServerConfig::for_listen(bound);
    // Ctrl-C must end the stack within seconds; a dev stack has no long requests to wait for.
    server_config.shutdown_grace = Duration::from_secs(2);
    let server = Server::new(store.clone(), clock.clone(), server_config, None);
    let (server_stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = {
        let server = server.clone();
        tokio::spawn(async move {
            server
                .serve(listener, async move {
                    let _ = stopped.await;
                })
                .await
        })
    };
    let token = new_bearer_token().map_err(|e| e.to_string())?;
    store
        .endpoint_create(
            clock.now(),
            NewEndpoint::every_tool_on(ENDPOINT, &token, QUEUE),
        )
        .await
        .map_err(|e| format!("cannot vend the sample endpoint: {e}"))?;
    let endpoint_url = format!("{url}/mcp/{ENDPOINT}");

    // The samples. The takeover sample is claimed first by a worker that is then "killed": it
    // holds a 3 s lease and never heartbeats or reports.
    let mut ids = Vec::new();
    for (n, s) in SAMPLES.iter().enumerate() {
        let todo = store
            .apply(Op::AddTodo {
                now: clock.now(),
                endpoint: ENDPOINT.into(),
                new: NewTodo {
                    id: format!("td_sample{}", n + 1),
                    queue: QUEUE.into(),
                    title: s.title.into(),
                    kind: Some("sample".into()),
                    source: Some("relay up".into()),
                    payload: Some(json!({"behaviour": s.behaviour})),
                    work_order: None,
                    max_attempts: Some(s.max_attempts),
                    assignee: None,
                    ..NewTodo::default()
                },
            })
            .await
            .and_then(Answer::todo)
            .map_err(|e| format!("cannot add a sample todo: {e}"))?;
        if s.behaviour == "takeover" {
            let opts = ClaimOpts {
                ttl: 3 * SECOND,
                claimant: Some("sample/killed-worker".into()),
                token_hash: Some(TokenHash::of("never-presented")),
            };
            let claim = Op::Claim {
                now: clock.now(),
                actor: Actor::endpoint(ENDPOINT),
                id: todo.id.clone(),
                opts,
            };
            store
                .apply(claim)
                .await
                .map_err(|e| format!("cannot stage the killed worker: {e}"))?;
        }
        ids.push(todo.id);
    }

    // The daemon's files.
    write(&dir.join("agent.sh"), AGENT, 0o755)?;
    write(&dir.join("check.sh"), CHECK, 0o755)?;
    write(
        &dir.join("quickstart.env"),
        &format!("RELAY_TOKEN={token}\n"),
        0o600,
    )?;
    let config_path = dir.join("harness.toml");
    write(&config_path, &config(&endpoint_url), 0o644)?;
    let transport = relay_worker::lease::ReqwestTransport::new()
        .map_err(|e| format!("the HTTP client did not start: {e}"))?;
    let opts = DaemonOptions {
        config: config_path,
        state_dir: dir.join("state"),
        host: "quickstart".into(),
        clock: clock.clone(),
        transport: Arc::new(transport),
        daemon_env: std::env::vars().collect(),
        launcher: Arc::new(relay_worker::runner::Processes),
        seed: rand::random(),
    };
    let (daemon, handle) = Daemon::start(opts).await?;
    let running = tokio::spawn(daemon.run());
    Ok(Stack {
        store,
        server,
        url,
        db,
        ids,
        daemon: handle,
        running,
        server_stop,
        serving,
    })
}

/// The dev stack: the Board's one-time link, the MCP endpoint, then the queue's progress as one
/// line per change, until Ctrl-C or SIGTERM.
async fn dev(stack: Stack, dir: &Path) -> Result<(), String> {
    let now = SystemClock.now();
    // A fresh operator for this run; its token is never shown (the link is the way in).
    let unused = new_bearer_token().map_err(|e| e.to_string())?;
    stack
        .store
        .operator_create(now, OPERATOR, TokenHash::of(&unused))
        .await
        .map_err(|e| format!("cannot create the operator {OPERATOR}: {e}"))?;
    let secret = stack
        .server
        .issue_login_link(OPERATOR)
        .map_err(|e| e.to_string())?;
    let (url, db) = (&stack.url, &stack.db);
    let env = dir.join("quickstart.env");
    out!("relay up: the dev stack is running (Ctrl-C to stop)");
    out!();
    // The one line that shows a secret, on purpose: the way into the Board for this run.
    out!("Board: {url}/board/login/link?secret={secret}");
    out!(
        "  logs in as operator {OPERATOR} once, within 10 minutes, from this machine; then \
         {url}/board/"
    );
    out!("MCP endpoint: {url}/mcp/{ENDPOINT}");
    out!(
        "  Streamable HTTP; endpoint {ENDPOINT}, queue {QUEUE}, every tool granted; its bearer \
         token is RELAY_TOKEN in {}",
        env.display()
    );
    out!("  point a client at it, e.g.:");
    out!(
        "    claude mcp add --transport http relay {url}/mcp/{ENDPOINT} --header \
         \"Authorization: Bearer $(sed -n 's/^RELAY_TOKEN=//p' {})\"",
        env.display()
    );
    out!("Store: {db}");
    out!(
        "  add work: relay --db {db} todo add --endpoint {ENDPOINT} --queue {QUEUE} --title \
         \"Try it\" --payload '{{\"behaviour\": \"succeed\"}}'"
    );
    out!();

    let stop = crate::shutdown_signal();
    tokio::pin!(stop);
    let mut last = String::new();
    loop {
        let line = counts(&stack.store).await?.line();
        if line != last {
            out!("{line}");
            last = line;
        }
        tokio::select! {
            () = &mut stop => break,
            // A view for a person: polled, a change shows within a fifth of a second.
            () = tokio::time::sleep(Duration::from_millis(200)) => {}
        }
    }
    out!("stopping: releasing what the workers hold, draining the server");
    stack.stop().await;
    out!("stopped");
    Ok(())
}

/// The sample queue at a glance.
struct Counts {
    total: usize,
    done: usize,
    dead: usize,
    canceled: usize,
    claimed: usize,
    waiting: usize,
}

impl Counts {
    fn finished(&self) -> usize {
        self.done + self.dead + self.canceled
    }

    fn line(&self) -> String {
        format!(
            "queue {QUEUE}: {}/{} finished ({} done, {} dead-lettered, {} canceled); {} leased, \
             {} waiting to retry",
            self.finished(),
            self.total,
            self.done,
            self.dead,
            self.canceled,
            self.claimed,
            self.waiting
        )
    }
}

async fn counts(store: &Store) -> Result<Counts, String> {
    let todos = store
        .apply(Op::ListTodos {
            actor: Actor::cli(),
            filter: TodoFilter {
                queues: Some(vec![QUEUE.into()]),
                state: None,
                after: None,
                limit: 10_000,
            },
        })
        .await
        .and_then(Answer::todos)
        .map_err(|e| e.to_string())?;
    let mut c = Counts {
        total: todos.len(),
        done: 0,
        dead: 0,
        canceled: 0,
        claimed: 0,
        waiting: 0,
    };
    for t in &todos {
        match t.state {
            TodoState::Done => c.done += 1,
            TodoState::Canceled => c.canceled += 1,
            TodoState::Claimed => c.claimed += 1,
            TodoState::Failed if t.dead_letter() => c.dead += 1,
            TodoState::Failed | TodoState::InputRequired => c.waiting += 1,
            TodoState::Pending => {}
        }
    }
    Ok(c)
}

/// A live view until every sample is done or dead-lettered (bounded at three minutes).
async fn progress(store: &Store, ids: &[String]) -> Result<(), String> {
    let bar = indicatif::ProgressBar::new(ids.len() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(180);
    loop {
        let c = counts(store).await?;
        bar.set_position(c.finished() as u64);
        bar.set_message(format!(
            "{} leased, {} waiting to retry",
            c.claimed, c.waiting
        ));
        bar.tick();
        if c.finished() == ids.len() {
            bar.finish_with_message("sample queue drained");
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            bar.abandon();
            return Err("the samples did not finish within three minutes; see the run logs".into());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Every attempt of every sample, oldest first: its outcome, whether it died, what the ledger
/// did with the todo (disposition, and the dead letter's reason), how often the success check
/// ran (each run past the first followed a "not yet"), and the summary's first line.
async fn table(store: &Store, ids: &[String]) -> Result<(), String> {
    out!();
    out!(
        "{:<30} {:>3}  {:<13} {:<5}  {:<15} {:<18} {:<13}  summary",
        "todo",
        "seq",
        "outcome",
        "died",
        "disposition",
        "dead letter",
        "checks"
    );
    for id in ids {
        let get = Op::GetTodo {
            actor: Actor::cli(),
            id: id.clone(),
            attempts_limit: 100,
        };
        let view = store
            .apply(get)
            .await
            .and_then(Answer::view)
            .map_err(|e| e.to_string())?;
        let mut attempts = view.attempts.clone();
        attempts.sort_by_key(|a| a.seq);
        let newest = attempts.last().map(|a| a.seq);
        for a in attempts {
            let outcome = a
                .outcome
                .map(|o| o.as_str().to_string())
                .unwrap_or_else(|| "open".into());
            let disposition = a.disposition.map_or("-", |d| d.as_str());
            let reason = a.dead_letter_reason.map_or("-", |r| r.as_str());
            // The todo keeps only its newest report's result, so only the newest attempt's
            // check runs are known here.
            let checks = if Some(a.seq) == newest {
                check_runs(view.todo.result.as_ref())
            } else {
                "-".into()
            };
            let summary = a
                .summary
                .as_deref()
                .and_then(|s| s.lines().next())
                .unwrap_or("-");
            out!(
                "{:<30} {:>3}  {:<13} {:<5}  {:<15} {:<18} {:<13}  {}",
                cut(&view.todo.title, 30),
                a.seq,
                outcome,
                a.died(),
                disposition,
                reason,
                checks,
                cut(summary, 70)
            );
        }
    }
    Ok(())
}

/// "3 (2 not yet)": the success check's runs from a report's result (`harness.check_runs`); a
/// check runs again only after it answered "not yet" (exit 75).
fn check_runs(result: Option<&serde_json::Value>) -> String {
    match result
        .and_then(|r| r.pointer("/harness/check_runs"))
        .and_then(serde_json::Value::as_u64)
    {
        Some(0) | None => "-".into(),
        Some(1) => "1".into(),
        Some(n) => format!("{n} ({} not yet)", n - 1),
    }
}

fn cut(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        return s.to_string();
    }
    let mut out: String = s.chars().take(n - 1).collect();
    out.push('…');
    out
}
