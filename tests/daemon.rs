//! End to end: the real `relay` binary as queue server and as daemon, real agent and check
//! processes (shell scripts), real HTTP on loopback. One test per relay-spec scenario that needs
//! real processes.
//!
//! Waiting: tests wait for something observable (a file, a todo state, a run record) by polling
//! it with a generous bound; the bound only turns a hang into a failure, it never decides an
//! outcome.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;

mod common;
use common::*;

struct Server {
    proc: Option<Proc>,
    url: String,
    db: String,
}

impl Server {
    fn start(dir: &Path) -> Server {
        Server::start_on(dir, "127.0.0.1:0")
    }

    fn start_on(dir: &Path, listen: &str) -> Server {
        let db = format!("sqlite:{}", dir.join("relay.db").display());
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("server.log"))
            .expect("server log");
        let (child, url) = serve(listen, &db, &[], log.into());
        Server {
            proc: Some(Proc(child)),
            url,
            db,
        }
    }

    /// Kills the server (the store file stays).
    fn stop(&mut self) {
        self.proc.take();
    }

    fn cli(&self, args: &[&str]) -> String {
        let out = Command::new(relay_bin())
            .args(args)
            .env("RELAY_DB", &self.db)
            .output()
            .expect("run relay");
        assert!(
            out.status.success(),
            "relay {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).expect("utf-8")
    }

    fn endpoint(&self, name: &str, verbs: &str) -> String {
        self.cli(&["endpoint", "create", name, "--verbs", verbs])
            .trim()
            .to_string()
    }

    fn add(&self, endpoint: &str, title: &str, max_attempts: u32) -> String {
        let n = max_attempts.to_string();
        let (code, id, err) = todo_add(&self.db, endpoint, "work", title, &["--max-attempts", &n]);
        assert_eq!(code, 0, "relay todo add failed: {err}");
        id.trim().to_string()
    }

    /// `relay todo show ID --json`.
    fn show(&self, id: &str) -> Value {
        serde_json::from_str(&self.cli(&["todo", "show", id, "--json"])).expect("json")
    }

    fn state(&self, id: &str) -> String {
        self.show(id)["todo"]["state"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    fn attempts(&self, id: &str) -> Vec<Value> {
        self.show(id)["attempts"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }
}

/// A TCP relay between the daemon and the server that keeps a copy of every byte the server
/// sent, so a test can learn the lease tokens the daemon was given.
struct Tap {
    port: u16,
    seen: Arc<Mutex<Vec<u8>>>,
}

impl Tap {
    fn start(upstream: &str) -> Tap {
        let upstream = upstream
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_string();
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind tap");
        let port = listener.local_addr().expect("addr").port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink = seen.clone();
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let Ok(server) = TcpStream::connect(&upstream) else {
                    continue;
                };
                let (c2, s2) = (
                    client.try_clone().expect("clone"),
                    server.try_clone().expect("clone"),
                );
                std::thread::spawn(move || pipe(c2, s2, None));
                let sink = sink.clone();
                std::thread::spawn(move || pipe(server, client, Some(sink)));
            }
        });
        Tap { port, seen }
    }

    fn tokens(&self) -> Vec<String> {
        let seen = String::from_utf8_lossy(&self.seen.lock().expect("lock")).to_string();
        let mut out = Vec::new();
        for piece in seen.split("lease_token").skip(1) {
            // `\":\"TOKEN\"` inside text content, or `":"TOKEN"` in structured content.
            let rest = piece.trim_start_matches(['\\', '"', ':', ' ']);
            let token: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
                .collect();
            if token.len() >= 16 && !out.contains(&token) {
                out.push(token);
            }
        }
        out
    }
}

fn pipe(mut from: TcpStream, mut to: TcpStream, copy: Option<Arc<Mutex<Vec<u8>>>>) {
    let mut buf = [0u8; 8192];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Some(c) = &copy {
            c.lock().expect("lock").extend_from_slice(&buf[..n]);
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Write);
}

const AGENT: &str = r#"#!/bin/sh
# Test agent: records that it ran and what it was given, then does what the todo's title says.
set -u
mkdir -p "$OUT"
echo ran >> "$OUT/ran.$HARNESS_TODO_ID"
env > "$OUT/env.$HARNESS_TODO_ID.$HARNESS_ATTEMPT"
cp "$HARNESS_RELAY_FILE" "$OUT/context.$HARNESS_TODO_ID.$HARNESS_ATTEMPT"
title=$(sed -n 's/.*"title": *"\([^"]*\)".*/\1/p' "$HARNESS_RELAY_FILE" | head -n 1)
case "$title" in
  *ask\ a\ human*)
    # Asks until its context file holds an answer, then works with it.
    cp "$HARNESS_RELAY_FILE" "$OUT/context.$HARNESS_TODO_ID.seq$HARNESS_ATTEMPT_SEQ"
    if grep -q '"answer"' "$HARNESS_RELAY_FILE"; then
      printf '{"summary":"fixed on the branch named"}' > "$HARNESS_ATTEMPT_SUMMARY_FILE"; exit 0
    fi
    printf '{"needs_input":"which branch?","summary":"two branches match"}' \
      > "$HARNESS_ATTEMPT_SUMMARY_FILE"
    exit 0 ;;
  *overspend*)
    # Reports a spend over its budget, then works on until it is stopped.
    trap 'date +%s%N > "$OUT/term.$HARNESS_TODO_ID"; exit 143' TERM
    printf '{"cost_usd": 2, "input_tokens": 10}' > "$HARNESS_USAGE_FILE"
    echo $$ > "$OUT/started.$HARNESS_TODO_ID"
    while :; do sleep 0.1; done ;;
  *hang*)
    trap 'date +%s%N > "$OUT/term.$HARNESS_TODO_ID"; exit 143' TERM
    echo $$ > "$OUT/started.$HARNESS_TODO_ID"
    while :; do sleep 0.1; done ;;
  *fail*)
    printf '{"summary":"it failed on purpose"}' > "$HARNESS_ATTEMPT_SUMMARY_FILE"; exit 1 ;;
  *denied*)
    echo "$HARNESS_IDEMPOTENCY_KEY" > "$OUT/key.$HARNESS_TODO_ID"
    printf '{"summary":"the token lacks repo scope"}' > "$HARNESS_ATTEMPT_SUMMARY_FILE"; exit 3 ;;
  *gate*)
    # Runs until the test opens the gate, then succeeds.
    echo $$ > "$OUT/started.$HARNESS_TODO_ID"
    while [ ! -e "$OUT/open.$HARNESS_TODO_ID" ]; do sleep 0.1; done ;;
esac
printf '{"summary":"all good"}' > "$HARNESS_ATTEMPT_SUMMARY_FILE"
exit 0
"#;

const CHECK: &str = r#"#!/bin/sh
# Test check: 'wait' titles answer 75 twice; 'green' titles are green before the agent runs.
set -u
title=$(sed -n 's/.*"title": *"\([^"]*\)".*/\1/p' "$HARNESS_RELAY_FILE" | head -n 1)
echo "check ran" >> "$OUT/check.$HARNESS_TODO_ID"
case "$title" in
  *green*) exit 0 ;;
  *slow\ check*)
    # After the agent: runs until the test opens the gate, then judges as below.
    if [ -n "${HARNESS_AGENT_EXIT:-}" ]; then
      echo $$ > "$OUT/checking.$HARNESS_TODO_ID"
      while [ ! -e "$OUT/open.$HARNESS_TODO_ID" ]; do sleep 0.1; done
    fi ;;
  *wait*)
    n=$(wc -l < "$OUT/check.$HARNESS_TODO_ID")
    [ "$n" -le 2 ] && exit 75 ;;
esac
[ "${HARNESS_AGENT_EXIT:-1}" = 0 ]
"#;

struct Setup {
    dir: tempfile::TempDir,
    server: Server,
    endpoint: String,
    out: PathBuf,
}

/// The verbs the daemon's endpoint is granted: the drain verbs, without `request_input`.
const VERBS: &str = "claim_next,claim,heartbeat,complete,fail,release,get_todo,list_todos,add_todo";

impl Setup {
    fn new() -> Setup {
        Setup::granted(VERBS)
    }

    /// A setup whose endpoint is granted `verbs`.
    fn granted(verbs: &str) -> Setup {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = Server::start(dir.path());
        let endpoint = "work".to_string();
        let token = server.endpoint(&endpoint, verbs);
        std::fs::write(dir.path().join("agent.sh"), AGENT).expect("agent");
        std::fs::write(dir.path().join("check.sh"), CHECK).expect("check");
        std::fs::write(dir.path().join("token.env"), format!("TOKEN={token}\n")).expect("env");
        let out = dir.path().join("out");
        std::fs::write(
            dir.path().join("agent.env"),
            format!("OUT={}\n", out.display()),
        )
        .expect("env");
        Setup {
            dir,
            server,
            endpoint,
            out,
        }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// A config with `workers` leased harnesses on the server (or on `url` when given).
    fn config(&self, url: Option<&str>, workers: usize, extra: &str, trigger: &str) -> PathBuf {
        let base = url.unwrap_or(&self.server.url).trim_end_matches('/');
        let url = format!("{base}/mcp/{}", self.endpoint);
        let mut text = queue_table(&url, "20s");
        text.push_str(&server_table("channel.bell", &url, "token.env", "TOKEN"));
        for n in 1..=workers {
            text.push_str(&harness_table(
                &format!("w{n}"),
                &format!("{trigger}\n{extra}"),
            ));
        }
        let path = self.path().join("harness.toml");
        std::fs::write(&path, text).expect("config");
        path
    }

    /// Waits for the 'hang' agent of todo `id` to have started.
    fn wait_started(&self, id: &str) {
        wait_for("the agent to start", Duration::from_secs(60), || {
            line_in(&self.out.join(format!("started.{id}")))
        });
    }

    /// One harness firing every second (with `extra` settings), a todo `title` with
    /// `max_attempts` for it, and the daemon started on them (the config is `harness.toml`):
    /// the todo's id and the daemon.
    fn daemon_every_second(&self, extra: &str, title: &str, max_attempts: u32) -> (String, Daemon) {
        let config = self.config(None, 1, extra, r#"schedule = "@every 1s""#);
        let id = self.server.add(&self.endpoint, title, max_attempts);
        (id, Daemon::start(self.path(), &config))
    }

    /// As `daemon_every_second` with every run kept, once the todo's agent has started.
    fn agent_started_every_second(&self, title: &str) -> (String, Daemon) {
        let (id, d) = self.daemon_every_second("keep_runs = 1000", title, 3);
        self.wait_started(&id);
        (id, d)
    }

    /// Waits (within a minute) for todo `id` to be done.
    fn wait_done(&self, what: &str, id: &str) {
        wait_for(what, Duration::from_secs(60), || {
            (self.server.state(id) == "done").then_some(())
        });
    }

    /// Waits for the agent of todo `id` to get its SIGTERM: the line it wrote then.
    fn wait_stopped(&self, id: &str, bound: Duration) -> String {
        wait_for("the agent to be stopped", bound, || {
            line_in(&self.out.join(format!("term.{id}")))
        })
    }

    fn ran(&self, id: &str) -> bool {
        self.out.join(format!("ran.{id}")).exists()
    }

    /// A config whose one harness, `reader`, binds a read-only endpoint (`list_todos` only),
    /// with that endpoint's bearer token.
    fn read_only_config(&self) -> (PathBuf, String) {
        let token = self
            .server
            .cli(&["endpoint", "create", "ro", "--verbs", "list_todos"]);
        let token = token.trim().to_string();
        std::fs::write(self.path().join("ro.env"), format!("TOKEN={token}\n")).expect("env");
        let config = self.path().join("ro.toml");
        std::fs::write(
            &config,
            server_table(
                "queue.ro",
                &format!("{}/mcp/ro", self.server.url),
                "ro.env",
                "TOKEN",
            ) + r#"
[harness.reader]
command = ["sh", "agent.sh"]
env_file = "agent.env"
schedule = "@daily"
lease = "queue.ro"
"#,
        )
        .expect("config");
        (config, token)
    }

    /// The 'hang' agent of todo `id` got its SIGTERM within a second of `deadline` (ms), by the
    /// time the agent itself read.
    fn stopped_within_a_second_of(&self, id: &str, deadline: u64) {
        let term = self.wait_stopped(id, Duration::from_secs(120));
        let term_ms: u64 = term.trim().parse::<u64>().expect("nanoseconds") / 1_000_000;
        assert!(
            term_ms + 50 >= deadline && term_ms <= deadline + 1000,
            "SIGTERM at {term_ms}, lease deadline {deadline}: not within a second"
        );
    }
}

#[test]
fn a_success_completes_and_the_token_stays_out_of_every_file_log_env_and_record() {
    let s = Setup::new();
    let tap = Tap::start(&s.server.url);
    let tapped = format!("http://127.0.0.1:{}", tap.port);
    let config = s.config(Some(&tapped), 1, "", r#"schedule = "@every 1s""#);
    let id = s.server.add(&s.endpoint, "fix it", 3);
    let mut d = Daemon::start(s.path(), &config);
    s.wait_done("the todo to complete", &id);
    d.stop();
    let tokens = tap.tokens();
    assert!(!tokens.is_empty(), "the tap saw no lease token");
    // The state dir holds payloads and the control socket: the daemon's user only.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&d.state)
        .expect("state dir")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o700, "state dir mode {mode:o}");
    let closed = d.closed_run("w1", &id);
    assert_eq!(closed["relay_outcome"], "completed");
    assert_eq!(closed["lease"], "queue.q");
    assert_eq!(closed["attempt"], 1);
    // The context file the agent saw names the todo and its attempt.
    let context = std::fs::read_to_string(s.out.join(format!("context.{id}.1"))).expect("context");
    let context: Value = serde_json::from_str(&context).expect("json");
    assert_eq!(context["todo"]["id"], id.as_str());
    assert_eq!(context["attempt"]["number"], 1);
    // No byte of any token anywhere: state dir (records, logs), the agent's env dump and context
    // copy, the daemon's own log, the server's log.
    for f in files(s.path()) {
        let bytes = std::fs::read(&f).unwrap_or_default();
        let text = String::from_utf8_lossy(&bytes);
        for t in &tokens {
            assert!(!text.contains(t.as_str()), "token found in {}", f.display());
        }
    }
    let attempts = s.server.attempts(&id);
    assert_eq!(attempts.len(), 1);
    assert!(
        attempts[0]["summary"]
            .as_str()
            .unwrap_or_default()
            .contains("all good"),
        "{attempts:?}"
    );
}

#[test]
fn a_check_that_exits_75_is_run_again_until_it_decides() {
    let s = Setup::new();
    let (id, mut d) = s.daemon_every_second("", "wait for it", 3);
    s.wait_done("the todo to complete", &id);
    d.stop();
    let checks = std::fs::read_to_string(s.out.join(format!("check.{id}"))).expect("check log");
    assert_eq!(
        checks.lines().count(),
        3,
        "two 'not yet' answers, then green"
    );
    assert_eq!(s.server.attempts(&id).len(), 1, "one attempt, not three");
}

#[test]
fn an_already_green_check_completes_without_spawning() {
    let s = Setup::new();
    let (id, mut d) = s.daemon_every_second("success_check_before = true", "already green", 3);
    s.wait_done("the todo to complete", &id);
    d.stop();
    assert!(
        !s.ran(&id),
        "the agent must not run when the check is green"
    );
    let run = d.closed_run("w1", &id);
    assert_eq!(run["relay_outcome"], "completed");
    assert!(run.get("exit_code").is_none_or(Value::is_null), "{run}");
}

#[test]
fn a_failure_is_reported_with_its_summary_and_retried_by_the_server() {
    let s = Setup::new();
    let (id, mut d) = s.daemon_every_second("", "fail always", 1);
    wait_for("the dead letter", Duration::from_secs(60), || {
        let t = s.server.show(&id);
        (t["todo"]["state"] == "failed" && t["todo"]["dead_letter"] == true).then_some(())
    });
    let run = d.closed_run("w1", &id);
    d.stop();
    assert_eq!(run["relay_outcome"], "dead_lettered");
    assert_eq!(run["check_exit"], 1);
    let attempts = s.server.attempts(&id);
    assert_eq!(attempts[0]["outcome"], "failed");
    assert!(
        attempts[0]["summary"]
            .as_str()
            .unwrap_or_default()
            .contains("it failed on purpose"),
        "{attempts:?}"
    );
}

#[test]
fn an_agent_exiting_with_a_listed_code_dead_letters_its_todo_on_attempt_1_of_5() {
    let s = Setup::new();
    let extra = "non_retryable_exit_codes = [3]";
    let (id, mut d) = s.daemon_every_second(extra, "denied by policy", 5);
    wait_for("the dead letter", Duration::from_secs(60), || {
        let t = s.server.show(&id);
        (t["todo"]["dead_letter"] == true).then_some(())
    });
    let run = d.closed_run("w1", &id);
    d.stop();
    assert_eq!(run["relay_outcome"], "dead_lettered");
    let t = s.server.show(&id);
    assert_eq!(t["todo"]["dead_letter_reason"], "non_retryable");
    assert_eq!(
        (
            t["todo"]["attempt"].as_u64(),
            t["todo"]["max_attempts"].as_u64()
        ),
        (Some(1), Some(5))
    );
    let attempts = s.server.attempts(&id);
    assert_eq!(attempts.len(), 1, "{attempts:?}");
    assert_eq!(attempts[0]["dead_letter_reason"], "non_retryable");
    assert_eq!(
        attempts[0]["failure_signature"].as_str().map(str::len),
        Some(32)
    );
    assert!(
        t["attention"]
            .as_str()
            .unwrap_or_default()
            .contains("not retryable"),
        "{t}"
    );
    // The agent saw its attempt's key for side effects.
    let key = std::fs::read_to_string(s.out.join(format!("key.{id}"))).expect("the key file");
    assert_eq!(key.trim(), format!("{id}:1"));
}

#[test]
fn a_canceled_todo_loses_its_lease_and_the_process_is_stopped() {
    let s = Setup::new();
    // Heartbeats every second on a 1 m lease; the cancel is noticed at the next heartbeat.
    let config = s
        .config(None, 1, "", r#"schedule = "@every 1s""#)
        .to_path_buf();
    let text = std::fs::read_to_string(&config).expect("config").replace(
        r#"heartbeat_interval = "20s""#,
        r#"heartbeat_interval = "1s""#,
    );
    std::fs::write(&config, text).expect("config");
    let id = s.server.add(&s.endpoint, "hang forever", 3);
    let mut d = Daemon::start(s.path(), &config);
    s.wait_started(&id);
    s.server.cli(&["todo", "cancel", &id]);
    s.wait_stopped(&id, Duration::from_secs(30));
    let run = d.closed_run("w1", &id);
    d.stop();
    assert_eq!(run["relay_outcome"], "lease_lost", "{run}");
    assert!(s.server.state(&id) == "canceled");
}

#[test]
fn three_workers_two_todos_one_doorbell() {
    let s = Setup::new();
    let config = s.config(None, 3, "", r#"triggers = ["channel.bell"]"#);
    let mut d = Daemon::start(s.path(), &config);
    // The doorbell listener is up once describe answers with a verified session.
    wait_for(
        "the daemon to verify its lease source",
        Duration::from_secs(30),
        || {
            let (ok, out) = d.cli(&["describe", "--json"]);
            (ok && out.contains("\"supported\"")).then_some(())
        },
    );
    let a = s.server.add(&s.endpoint, "first", 3);
    let b = s.server.add(&s.endpoint, "second", 3);
    wait_for("both todos done", Duration::from_secs(60), || {
        (s.server.state(&a) == "done" && s.server.state(&b) == "done").then_some(())
    });
    d.stop();
    let mut claimed = Vec::new();
    for w in ["w1", "w2", "w3"] {
        for r in d.runs(w) {
            if let Some(t) = r["todo_id"].as_str() {
                claimed.push(t.to_string());
            }
        }
    }
    claimed.sort();
    assert_eq!(claimed, {
        let mut v = vec![a.clone(), b.clone()];
        v.sort();
        v
    });
    assert_eq!(s.server.attempts(&a).len(), 1);
    assert_eq!(s.server.attempts(&b).len(), 1);
}

#[test]
fn a_daemon_killed_mid_attempt_records_interrupted_and_the_todo_is_claimed_afresh() {
    let s = Setup::new();
    let (id, mut d) = s.daemon_every_second("", "hang then fine", 3);
    s.wait_started(&id);
    d.kill9();
    // The orphaned agent is nobody's now; end it so that only the lease decides what happens.
    let pid = line_in(&s.out.join(format!("started.{id}"))).expect("pid");
    let _ = Command::new("kill").args(["-KILL", pid.trim()]).status();
    std::fs::remove_file(s.out.join(format!("started.{id}"))).expect("reset");
    d.spawn();
    let runs = wait_for("the interrupted record", Duration::from_secs(30), || {
        let runs = d.runs("w1");
        runs.iter()
            .any(|r| r["outcome"] == "interrupted")
            .then_some(runs)
    });
    let interrupted = runs
        .iter()
        .find(|r| r["outcome"] == "interrupted")
        .expect("run");
    assert_eq!(interrupted["todo_id"], id.as_str());
    assert!(interrupted.get("relay_outcome").is_none_or(Value::is_null));
    // No report was made for it: the server closes the first attempt as died once the lease
    // lapses (1 m), and the restarted daemon claims afresh.
    let attempts = wait_for("a second attempt", Duration::from_secs(150), || {
        let a = s.server.attempts(&id);
        (a.len() >= 2).then_some(a)
    });
    let first = attempts.iter().find(|a| a["seq"] == 1).expect("seq 1");
    assert_eq!(first["died"], true, "{first}");
    // The second attempt hangs like the first; the daemon's stop releases it.
    wait_for("the second agent to start", Duration::from_secs(60), || {
        line_in(&s.out.join(format!("started.{id}")))
    });
    d.stop();
    let last = s.server.attempts(&id);
    assert_eq!(last[0]["outcome"], "released", "{last:?}");
}

/// Kills the process whose pid a test agent or check wrote to `file` (an orphan once its
/// daemon is killed), so that only the lease decides what happens next.
fn kill_orphan(file: &Path) {
    let pid = line_in(file).expect("pid");
    let _ = Command::new("kill").args(["-KILL", pid.trim()]).status();
}

#[test]
fn a_daemon_killed_at_each_step_restarts_into_a_record_naming_its_todo_and_sends_nothing() {
    use std::os::unix::process::ExitStatusExt;
    let s = Setup::new();
    let config = s.config(None, 1, "keep_runs = 1000", r#"schedule = "@every 1s""#);
    // One todo per step, each claimed by a daemon killed at that step: by itself (SIGKILL at
    // a named point, RELAY_TEST_KILL_AT) or by the test once the agent or the check runs. The
    // earlier todos stay leased (1 m), so each daemon's claim takes the step's own todo.
    let steps = [
        ("spawn", "fine"),
        ("spawned", "fine"),
        ("agent", "gate"),
        ("check", "slow check"),
        ("report", "fine"),
    ];
    let mut ids = Vec::new();
    for (step, title) in steps {
        let id = s.server.add(&s.endpoint, &format!("{title} ({step})"), 3);
        let mut d = match step {
            "agent" | "check" => Daemon::start(s.path(), &config),
            _ => Daemon::start_env(s.path(), &config, &[], &[("RELAY_TEST_KILL_AT", step)]),
        };
        match step {
            "agent" => {
                s.wait_started(&id);
                d.kill9();
                kill_orphan(&s.out.join(format!("started.{id}")));
            }
            "check" => {
                let checking = s.out.join(format!("checking.{id}"));
                wait_for("the check to run", Duration::from_secs(60), || {
                    line_in(&checking)
                });
                d.kill9();
                kill_orphan(&checking);
            }
            _ => {
                let status = d.wait_exit();
                assert_eq!(status.signal(), Some(9), "{step}: {status:?}");
            }
        }
        ids.push((step, id));
    }
    // The gates open for the attempts that come next.
    for (_, id) in &ids {
        std::fs::write(s.out.join(format!("open.{id}")), "").expect("open");
    }
    // Restarted: each run left running is recorded interrupted, naming its todo and attempt.
    let mut d = Daemon::start(s.path(), &config);
    let runs = wait_for("the restart's reconciling", Duration::from_secs(30), || {
        let runs = d.runs("w1");
        (!runs.iter().any(|r| r["outcome"] == "running")).then_some(runs)
    });
    for (step, id) in &ids {
        let run = runs
            .iter()
            .find(|r| r["todo_id"] == id.as_str())
            .unwrap_or_else(|| panic!("{step}: no record names {id}: {runs:?}"));
        assert_eq!(run["outcome"], "interrupted", "{step}: {run}");
        assert_eq!(run["attempt"], 1, "{step}: {run}");
        assert!(
            run.get("relay_outcome").is_none_or(Value::is_null),
            "{step}: {run}"
        );
    }
    // Nothing was sent for them: each first attempt dies when its lease lapses, and the
    // restarted daemon claims the todo afresh and finishes it.
    for (step, id) in &ids {
        wait_for(step, Duration::from_secs(180), || {
            (s.server.state(id) == "done").then_some(())
        });
        let attempts = s.server.attempts(id);
        let first = attempts.iter().find(|a| a["seq"] == 1).expect("seq 1");
        assert_eq!(first["died"], true, "{step}: {first}");
    }
    d.stop();
}

#[test]
fn a_partition_longer_than_the_lease_stops_the_process_within_a_second_of_the_deadline() {
    let mut s = Setup::new();
    // Every second's firing is recorded (skipped: the server is gone); keep them all.
    let (id, mut d) = s.agent_started_every_second("hang on");
    // The server goes away: every heartbeat from now on fails, so the lease deadline the daemon
    // shows now is the one it acts on.
    s.server.stop();
    let deadline = d.lease_deadline("w1");
    s.stopped_within_a_second_of(&id, deadline);
    let run = d.closed_run("w1", &id);
    assert_eq!(run["relay_outcome"], "lease_lost", "{run}");
    d.stop();
}

/// The daemon's wall clock steps back an hour (libfaketime, preloaded into the daemon alone,
/// with `FAKETIME_DONT_FAKE_MONOTONIC=1` so that its monotonic and boot-time clocks stay true)
/// while its server is unreachable: the agent is still stopped within a second of the true
/// lease deadline. With deadlines on the wall clock it would run on for another hour.
#[test]
fn a_wall_clock_stepped_back_mid_attempt_stops_the_agent_at_the_true_deadline() {
    let Some(lib) = libfaketime() else {
        return;
    };
    let mut s = Setup::new();
    let config = s.config(None, 1, "", r#"triggers = ["channel.bell"]"#);
    // The agent and the check run without the preload: their `date` is the true time.
    let env = std::fs::read_to_string(s.path().join("agent.env")).expect("env");
    std::fs::write(s.path().join("agent.env"), format!("{env}LD_PRELOAD=\n")).expect("env");
    let offset = s.path().join("faketime");
    std::fs::write(&offset, "+0\n").expect("faketime file");
    let id = s.server.add(&s.endpoint, "hang on", 3);
    let mut d = Daemon::start_env(
        s.path(),
        &config,
        &[],
        &[
            ("LD_PRELOAD", lib.to_str().expect("path")),
            ("FAKETIME_TIMESTAMP_FILE", offset.to_str().expect("path")),
            ("FAKETIME_NO_CACHE", "1"),
            ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
        ],
    );
    s.wait_started(&id);
    s.server.stop();
    let deadline = d.lease_deadline("w1");
    std::fs::write(&offset, "-3600\n").expect("step the wall clock");
    let stepped = d.lease_deadline("w1");
    s.stopped_within_a_second_of(&id, deadline);
    // The step did reach the daemon: it showed the same deadline an hour earlier in wall time.
    assert!(
        // ±1 s: describe reads its two clocks one after the other, each cut to whole ms.
        stepped + 3_600_000 + 1_000 >= deadline && stepped + 3_600_000 <= deadline + 1_000,
        "the daemon's wall clock did not step back: deadline {deadline}, then shown as {stepped}"
    );
    let run = d.closed_run("w1", &id);
    assert_eq!(run["relay_outcome"], "lease_lost", "{run}");
    d.stop();
}

#[test]
fn doctor_names_what_a_read_only_endpoint_lacks_and_describe_shows_no_secret() {
    let s = Setup::new();
    let (config, token) = s.read_only_config();
    let token = token.as_str();
    let mut d = Daemon::start(s.path(), &config);
    // The session is checked once the daemon is up; describe shows it unsupported.
    let described = d.unsupported("reader");
    assert!(described.contains("Authorization"), "{described}");
    assert!(
        !described.contains(token),
        "describe leaked the bearer token"
    );
    let (ok, doctor) = d.cli(&["doctor"]);
    assert!(!ok, "a fail row makes doctor exit non-zero: {doctor}");
    assert!(
        doctor.contains("claim_next, heartbeat, complete, fail"),
        "{doctor}"
    );
    assert!(!doctor.contains(token));
    // A firing of the unsupported source claims nothing and is recorded skipped.
    let (ok, out) = d.cli(&["trigger", "reader"]);
    assert!(ok, "{out}");
    let run = wait_for("the skipped run", Duration::from_secs(30), || {
        d.runs("reader").into_iter().next()
    });
    assert_eq!(run["outcome"], "skipped");
    assert_eq!(run["skipped_reason"], "lease_source_unsupported");
    assert_eq!(run["trigger"], "manual");
    d.stop();
    let log = std::fs::read_to_string(&d.log).expect("daemon log");
    assert!(
        !log.contains(token),
        "the daemon log holds the bearer token"
    );
}

/// A minimal Cairn: answers every `POST /artifacts` with a fresh handle and keeps the bodies.
struct FakeCairn {
    url: String,
    /// Each request's head and body.
    bodies: Arc<Mutex<Vec<(String, String)>>>,
}

impl FakeCairn {
    fn start() -> FakeCairn {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind cairn");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let sink = bodies.clone();
        std::thread::spawn(move || {
            for mut conn in listener.incoming().flatten() {
                let mut reader = BufReader::new(conn.try_clone().expect("clone"));
                let mut head = String::new();
                let mut length = 0usize;
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                        break;
                    }
                    if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                        length = v.trim().parse().unwrap_or(0);
                    }
                    head.push_str(&line);
                }
                let mut body = vec![0u8; length];
                let _ = reader.read_exact(&mut body);
                let n = {
                    let mut b = sink.lock().expect("lock");
                    b.push((head, String::from_utf8_lossy(&body).into_owned()));
                    b.len()
                };
                let answer = format!("{{\"handle\":\"mcp://cairn/receipt-{n}\"}}");
                let _ = write!(
                    conn,
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{answer}",
                    answer.len()
                );
            }
        });
        FakeCairn { url, bodies }
    }
}

#[test]
fn a_failed_attempt_uploads_a_receipt_and_the_fail_carries_its_handle() {
    let s = Setup::new();
    let cairn = FakeCairn::start();
    std::fs::write(
        s.path().join("cairn.env"),
        "CAIRN_TOKEN=cairn-secret-value\n",
    )
    .expect("env");
    let config = s.config(
        None,
        1,
        r#"attempt_receipt = "cairn.main""#,
        r#"schedule = "@every 1s""#,
    );
    let mut text = std::fs::read_to_string(&config).expect("config");
    text.push_str(&server_table(
        "cairn.main",
        &cairn.url,
        "cairn.env",
        "CAIRN_TOKEN",
    ));
    std::fs::write(&config, text).expect("config");
    let id = s.server.add(&s.endpoint, "fail once", 1);
    let mut d = Daemon::start(s.path(), &config);
    wait_for("the dead letter", Duration::from_secs(60), || {
        (s.server.show(&id)["todo"]["dead_letter"] == true).then_some(())
    });
    d.stop();
    let attempts = s.server.attempts(&id);
    assert_eq!(
        attempts[0]["artifact"], "mcp://cairn/receipt-1",
        "{attempts:?}"
    );
    let bodies = cairn.bodies.lock().expect("lock").clone();
    assert_eq!(bodies.len(), 1, "one receipt");
    let (head, body) = &bodies[0];
    assert!(head.starts_with("POST /artifacts"), "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("authorization: bearer cairn-secret-value")
    );
    // The receipt holds the summary and the run log's tail (the agent's output), tagged.
    assert!(body.contains("it failed on purpose"), "{body}");
    assert!(body.contains("receipt") && body.contains("relay"), "{body}");
    assert!(
        !body.contains("cairn-secret-value"),
        "the receipt carries the credential"
    );
}

#[test]
fn the_daemon_exports_attempts_by_outcome_as_prometheus_metrics() {
    let s = Setup::new();
    let config = s.config(None, 1, "", r#"schedule = "@every 1s""#);
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let addr = format!("127.0.0.1:{port}");
    let id = s.server.add(&s.endpoint, "count me", 3);
    let mut d = Daemon::start_with(s.path(), &config, &["--metrics-listen", &addr]);
    s.wait_done("the todo to complete", &id);
    let text = wait_for("the counter", Duration::from_secs(30), || {
        let mut conn = TcpStream::connect(&addr).ok()?;
        write!(
            conn,
            "GET /metrics HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n"
        )
        .ok()?;
        let mut text = String::new();
        conn.read_to_string(&mut text).ok()?;
        text.contains(r#"harness_relay_attempts_total{harness="w1",outcome="completed"} 1"#)
            .then_some(text)
    });
    assert!(
        text.contains(r#"harness_relay_heartbeat_failures_total{harness="w1"} 0"#),
        "{text}"
    );
    d.stop();
}

#[test]
fn a_restarted_server_forgets_the_session_and_the_daemon_initializes_again() {
    let mut s = Setup::new();
    let (first, mut d) = s.daemon_every_second("keep_runs = 1000", "before", 3);
    s.wait_done("the first todo", &first);
    // Same address, same store; the sessions were in the old process's memory.
    let listen = s.server.url.trim_start_matches("http://").to_string();
    s.server.stop();
    s.server = Server::start_on(s.path(), &listen);
    let second = s.server.add(&s.endpoint, "after", 3);
    s.wait_done("the second todo", &second);
    d.stop();
    assert_eq!(s.server.attempts(&second).len(), 1);
}

// ---- reload, stop, events, catch_up, doctor without a daemon ---------------------------------

impl Daemon {
    /// Waits for the harness's lease source to be checked and found unsupported; `describe`'s
    /// answer then.
    fn unsupported(&self, harness: &str) -> String {
        wait_for("the capability check", Duration::from_secs(30), || {
            let (ok, out) = self.cli(&["describe", harness, "--json"]);
            (ok && out.contains("\"unsupported\"")).then_some(out)
        })
    }

    fn pid(&self) -> String {
        self.proc
            .as_ref()
            .expect("daemon running")
            .0
            .id()
            .to_string()
    }

    /// `relay describe --json`, once the daemon answers.
    fn described(&self) -> Vec<Value> {
        self.cli_array(&["describe", "--json"])
    }

    fn harness_names(&self) -> Vec<String> {
        self.described()
            .iter()
            .filter_map(|h| h["relay"]["harness"].as_str().map(str::to_string))
            .collect()
    }

    /// Waits until every harness's lease source session is verified.
    fn wait_verified(&self) {
        wait_for("a verified lease session", Duration::from_secs(30), || {
            // Until the daemon is up, the control socket does not answer.
            let (ok, out) = self.cli(&["describe", "--json"]);
            let all: Vec<Value> = ok.then(|| serde_json::from_str(&out).ok()).flatten()?;
            (!all.is_empty() && all.iter().all(|h| h["source"]["session"] == "supported"))
                .then_some(())
        });
    }
}

#[test]
fn reload_a_broken_dropin_changes_nothing_and_a_fixed_one_starts_its_harness() {
    let s = Setup::new();
    let config = s.config(None, 1, "", r#"schedule = "@daily""#);
    let mut d = Daemon::start(s.path(), &config);
    d.wait_verified();
    let dropins = s.path().join("harness.d");
    std::fs::create_dir_all(&dropins).expect("harness.d");
    let dropin = dropins.join("extra.toml");
    std::fs::write(
        &dropin,
        harness_table("w9", "schedule = \"@daily\"\ntimeout = \"soon\""),
    )
    .expect("drop-in");
    // `relay reload` answers the error: the file, the table and the key.
    let (ok, out) = d.cli(&["reload"]);
    assert!(!ok, "a broken drop-in is refused: {out}");
    for part in [
        dropin.display().to_string(),
        "[harness.w9]".into(),
        "timeout".into(),
    ] {
        assert!(out.contains(&part), "{part} not in {out}");
    }
    assert!(out.contains("nothing changed"), "{out}");
    // SIGHUP: the same refusal, in the log; the daemon runs on with what it had.
    let _ = Command::new("kill").args(["-HUP", &d.pid()]).status();
    wait_for(
        "the refused reload in the log",
        Duration::from_secs(30),
        || {
            let log = std::fs::read_to_string(&d.log).unwrap_or_default();
            (log.matches("reload refused").count() >= 2).then_some(())
        },
    );
    assert_eq!(d.harness_names(), ["w1"]);

    // Fixed, and reloaded by SIGHUP: the added harness starts and claims.
    std::fs::write(&dropin, harness_table("w9", "schedule = \"@daily\"")).expect("drop-in");
    let _ = Command::new("kill").args(["-HUP", &d.pid()]).status();
    wait_for("w9 to start", Duration::from_secs(30), || {
        (d.harness_names() == ["w1", "w9"]).then_some(())
    });
    d.wait_verified();
    let id = s.server.add(&s.endpoint, "fix it", 3);
    let (ok, out) = d.cli(&["trigger", "w9"]);
    assert!(ok, "{out}");
    let run = d.closed_run("w9", &id);
    assert_eq!(run["relay_outcome"], "completed", "{run}");
    // A reload that changes nothing says so.
    let (ok, out) = d.cli(&["reload"]);
    assert!(ok && out.contains("nothing changed"), "{out}");
    d.stop();
}

#[test]
fn reload_removing_a_harness_releases_its_attempt_naming_the_reason() {
    let s = Setup::new();
    let (id, mut d) = s.agent_started_every_second("hang around");
    // The same sources, no harness.
    s.config(None, 0, "", "");
    let (ok, out) = d.cli(&["reload"]);
    assert!(ok, "{out}");
    assert!(out.contains("harness w1 removed: its run"), "{out}");
    s.wait_stopped(&id, Duration::from_secs(30));
    let run = d.closed_run("w1", &id);
    assert_eq!(run["relay_outcome"], "released", "{run}");
    assert_eq!(run["outcome"], "cancelled", "{run}");
    assert!(
        run.get("check_exit").is_none_or(Value::is_null),
        "no check ran: {run}"
    );
    let attempts = s.server.attempts(&id);
    assert_eq!(attempts[0]["outcome"], "released", "{attempts:?}");
    let summary = attempts[0]["summary"].as_str().unwrap_or_default();
    assert!(summary.contains("harness removed"), "{summary}");
    assert_eq!(s.server.state(&id), "pending");
    // Its slot is gone once the attempt closed.
    wait_for("w1 to be gone", Duration::from_secs(30), || {
        d.harness_names().is_empty().then_some(())
    });
    let (ok, out) = d.cli(&["trigger", "w1"]);
    assert!(!ok && out.contains("no leased harness named"), "{out}");
    d.stop();
}

#[test]
fn reload_changing_a_harness_lets_its_attempt_run_on_under_the_old_config() {
    let s = Setup::new();
    std::fs::write(
        s.path().join("agent2.sh"),
        "echo v2 > \"$OUT/v2.$HARNESS_TODO_ID\"\nexec sh agent.sh\n",
    )
    .expect("agent2");
    let (first, mut d) = s.daemon_every_second("keep_runs = 1000", "gate one", 3);
    let config = s.path().join("harness.toml");
    wait_for("the first agent to start", Duration::from_secs(60), || {
        line_in(&s.out.join(format!("started.{first}")))
    });
    let text = std::fs::read_to_string(&config).expect("config").replace(
        r#"command = ["sh", "agent.sh"]"#,
        r#"command = ["sh", "agent2.sh"]"#,
    );
    std::fs::write(&config, text).expect("config");
    let (ok, out) = d.cli(&["reload"]);
    assert!(ok, "{out}");
    assert!(out.contains("harness w1 changed"), "{out}");
    assert!(out.contains("new settings apply after run"), "{out}");
    // The attempt in flight runs on: not stopped, and it finishes as it started.
    std::fs::write(s.out.join(format!("open.{first}")), "").expect("open the gate");
    let run = d.closed_run("w1", &first);
    assert_eq!(run["relay_outcome"], "completed", "{run}");
    assert!(
        !s.out.join(format!("term.{first}")).exists(),
        "the agent was stopped"
    );
    assert!(
        !s.out.join(format!("v2.{first}")).exists(),
        "the new command ran it"
    );
    assert_eq!(s.server.attempts(&first).len(), 1);
    // The next attempt runs the new command.
    let second = s.server.add(&s.endpoint, "plain", 3);
    let run = d.closed_run("w1", &second);
    assert_eq!(run["relay_outcome"], "completed", "{run}");
    assert!(
        s.out.join(format!("v2.{second}")).exists(),
        "the new command did not run"
    );
    d.stop();
}

#[test]
fn stop_ends_the_attempt_as_an_operator_stop_and_the_schedule_claims_again() {
    let s = Setup::new();
    let (id, mut d) = s.agent_started_every_second("hang in there");
    std::fs::remove_file(s.out.join(format!("started.{id}"))).expect("reset");
    let (ok, out) = d.cli(&["stop", "w1"]);
    assert!(ok, "{out}");
    assert!(
        out.contains("stopping w1: run") && out.contains(&id),
        "{out}"
    );
    s.wait_stopped(&id, Duration::from_secs(30));
    let run = d.closed_run("w1", &id);
    assert_eq!(run["relay_outcome"], "released", "{run}");
    let attempts = s.server.attempts(&id);
    let summary = attempts[0]["summary"].as_str().unwrap_or_default();
    assert!(summary.contains("operator stop"), "{summary}");
    // A later firing of the schedule claims the todo again: attempt 2 runs.
    wait_for(
        "the second attempt to start",
        Duration::from_secs(60),
        || line_in(&s.out.join(format!("started.{id}"))),
    );
    assert_eq!(s.server.attempts(&id).len(), 2);
    // A harness with nothing in flight: stop says so, with exit status 0.
    let dropins = s.path().join("harness.d");
    std::fs::create_dir_all(&dropins).expect("harness.d");
    std::fs::write(
        dropins.join("idle.toml"),
        harness_table("idle", "schedule = \"@daily\""),
    )
    .expect("drop-in");
    let (ok, out) = d.cli(&["reload"]);
    assert!(ok && out.contains("harness idle added"), "{out}");
    let (ok, out) = d.cli(&["stop", "idle"]);
    assert!(
        ok && out.contains("nothing to stop: idle has no attempt in flight"),
        "{out}"
    );
    let (ok, out) = d.cli(&["stop", "nope"]);
    assert!(!ok && out.contains("no leased harness named"), "{out}");
    d.stop();
}

/// The JSON lines a `relay events --follow` child has printed so far.
struct Follower {
    proc: Proc,
    lines: Arc<Mutex<Vec<Value>>>,
}

impl Follower {
    fn start(d: &Daemon) -> Follower {
        let mut child = Command::new(relay_bin())
            .args(["events", "--follow", "--state-dir"])
            .arg(&d.state)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("relay events --follow");
        let out = child.stdout.take().expect("stdout");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                let v: Value = serde_json::from_str(&line).expect("an event line is JSON");
                sink.lock().expect("lock").push(v);
            }
        });
        Follower {
            proc: Proc(child),
            lines,
        }
    }

    fn lines(&self) -> Vec<Value> {
        self.lines.lock().expect("lock").clone()
    }
}

#[test]
fn events_follow_a_run_from_start_to_finish_and_carry_no_secret() {
    let s = Setup::new();
    let tap = Tap::start(&s.server.url);
    let tapped = format!("http://127.0.0.1:{}", tap.port);
    let config = s.config(
        Some(&tapped),
        1,
        "keep_runs = 1000",
        r#"schedule = "@every 1s""#,
    );
    let mut d = Daemon::start(s.path(), &config);
    d.wait_verified();
    let follower = Follower::start(&d);
    // Before any todo: runs that find no work are skipped, with their reason.
    wait_for("a no_work run_skipped", Duration::from_secs(30), || {
        follower
            .lines()
            .iter()
            .any(|e| e["event"] == "run_skipped" && e["reason"] == "no_work")
            .then_some(())
    });
    let id = s
        .server
        .cli(&[
            "todo",
            "add",
            "--endpoint",
            &s.endpoint,
            "--queue",
            "work",
            "--title",
            "fix it",
            "--payload",
            r#"{"secret_payload":"payload-marker-5309"}"#,
        ])
        .trim()
        .to_string();
    let run = d.closed_run("w1", &id);
    let run_id = run["run_id"].clone();
    let of_run = |lines: &[Value]| -> Vec<Value> {
        lines
            .iter()
            .filter(|e| e["run_id"] == run_id)
            .cloned()
            .collect()
    };
    let events = wait_for("run_finished of the run", Duration::from_secs(30), || {
        let mine = of_run(&follower.lines());
        mine.iter()
            .any(|e| e["event"] == "run_finished")
            .then_some(mine)
    });
    let names: Vec<&str> = events.iter().filter_map(|e| e["event"].as_str()).collect();
    assert_eq!(
        names,
        [
            "run_started",
            "relay_claimed",
            "relay_reported",
            "run_finished"
        ],
        "{events:?}"
    );
    assert_eq!(events[1]["todo_id"], id.as_str());
    assert_eq!(events[1]["attempt"], 1);
    assert_eq!(events[2]["relay_outcome"], "completed");
    assert_eq!(events[2]["dead_letter"], false);
    assert_eq!(events[3]["outcome"], "success");
    for e in &events {
        assert_eq!(e["harness"], "w1", "{e}");
        assert!(e["at"].is_string(), "{e}");
    }
    // Plain `relay events` prints the recent ones from the ring, the same lines.
    let (ok, out) = d.cli(&["events"]);
    assert!(ok, "{out}");
    assert!(
        out.lines().all(|l| l.starts_with("{\"event\":")),
        "each line starts with its event: {out}"
    );
    let recent: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).expect("json line"))
        .collect();
    assert_eq!(of_run(&recent), events);
    // No token, header value, summary or payload byte in any event.
    let tokens = tap.tokens();
    assert!(!tokens.is_empty());
    let bearer = std::fs::read_to_string(s.path().join("token.env")).expect("env");
    let bearer = bearer.trim().trim_start_matches("TOKEN=");
    for secret in
        tokens
            .iter()
            .map(String::as_str)
            .chain([bearer, "all good", "payload-marker-5309"])
    {
        assert!(!out.contains(secret), "{secret} in relay events");
        let followed = serde_json::to_string(&follower.lines()).unwrap_or_default();
        assert!(
            !followed.contains(secret),
            "{secret} in relay events --follow"
        );
    }
    d.stop();
    // The follower's stream ends with the daemon.
    let mut proc = follower.proc;
    let status = wait_for("the follower to end", Duration::from_secs(30), || {
        proc.0.try_wait().ok().flatten()
    });
    assert!(status.success(), "{status:?}");
}

#[test]
fn catch_up_fires_once_for_a_slot_missed_while_the_daemon_was_down() {
    let s = Setup::new();
    // Refused without a schedule: never accepted and ignored.
    let bad = s.path().join("bad.toml");
    std::fs::write(&bad, "[harness.x]\ncommand = [\"true\"]\ncatch_up = true\n").expect("bad");
    let out = Command::new(relay_bin())
        .args(["check-config"])
        .arg(&bad)
        .output()
        .expect("check-config");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("catch_up") && err.contains("schedule"),
        "{err}"
    );

    let config = s.config(
        None,
        1,
        "keep_runs = 1000\ncatch_up = true",
        r#"schedule = "@every 1h""#,
    );
    let mut d = Daemon::start(s.path(), &config);
    d.wait_verified();
    let (ok, out) = d.cli(&["trigger", "w1"]);
    assert!(ok, "{out}");
    let last = wait_for("the manual run", Duration::from_secs(30), || {
        d.runs("w1").into_iter().find(|r| r["outcome"] != "running")
    });
    d.stop();
    assert!(
        !d.runs("w1").iter().any(|r| r["trigger"] == "catch_up"),
        "nothing was missed yet"
    );
    // The daemon was down for two hours: the record of its last run says so.
    let record = d
        .state
        .join("runs/w1")
        .join(format!("{}.json", last["run_id"]));
    let mut value: Value =
        serde_json::from_str(&std::fs::read_to_string(&record).expect("record")).expect("json");
    let started =
        relay_core::time::parse_rfc3339(value["started_at"].as_str().expect("started_at"))
            .expect("rfc3339");
    value["started_at"] = Value::String(relay_core::time::rfc3339(started - 2 * 3_600_000));
    std::fs::write(&record, serde_json::to_vec_pretty(&value).expect("json")).expect("record");

    let id = s.server.add(&s.endpoint, "owed work", 3);
    d.spawn();
    let run = d.closed_run("w1", &id);
    assert_eq!(run["trigger"], "catch_up", "{run}");
    assert_eq!(run["relay_outcome"], "completed", "{run}");
    d.stop();
    // Restarted right away, nothing is owed: a manual firing is the only new run.
    d.spawn();
    d.wait_verified();
    let (ok, out) = d.cli(&["trigger", "w1"]);
    assert!(ok, "{out}");
    wait_for("the second manual run", Duration::from_secs(30), || {
        (d.runs("w1")
            .iter()
            .filter(|r| r["trigger"] == "manual" && r["outcome"] != "running")
            .count()
            == 2)
            .then_some(())
    });
    d.stop();
    let catch_ups = d
        .runs("w1")
        .iter()
        .filter(|r| r["trigger"] == "catch_up")
        .count();
    assert_eq!(catch_ups, 1);
}

#[test]
fn doctor_without_a_daemon_initializes_each_source_itself_and_prints_the_same_rows() {
    let s = Setup::new();
    let (ro, token) = s.read_only_config();
    let token = token.as_str();
    let doctor = |config: &Path, state: &Path| {
        let out = Command::new(relay_bin())
            .args(["doctor", "--config"])
            .arg(config)
            .arg("--state-dir")
            .arg(state)
            .output()
            .expect("relay doctor");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let state = s.path().join("state");
    // No daemon: a fail row for the read-only endpoint, exit 1.
    let (code, alone, note) = doctor(&ro, &state);
    assert_eq!(code, Some(1), "{alone}{note}");
    assert!(
        alone.contains("claim_next, heartbeat, complete, fail"),
        "{alone}"
    );
    assert!(note.contains("no daemon runs"), "{note}");
    assert!(!alone.contains(token) && !note.contains(token));
    // The daemon's doctor prints the same rows.
    let mut d = Daemon::start(s.path(), &ro);
    d.unsupported("reader");
    let (code, with_daemon, _) = doctor(&ro, &state);
    assert_eq!(code, Some(1));
    assert_eq!(with_daemon, alone);
    d.stop();
    // An endpoint with every drain verb is ok, exit 0, with a notice that, not granted
    // request_input, an agent's question is reported as a fail; a server that does not answer is
    // a fail row.
    let config = s.config(None, 1, "", r#"schedule = "@daily""#);
    let (code, out, _) = doctor(&config, &state);
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("ok") && l.contains("queue.q")),
        "{out}"
    );
    let notice = out.lines().find(|l| l.starts_with("notice"));
    assert!(
        notice.is_some_and(|l| l.contains("needs_input_unsupported")),
        "{out}"
    );
    let closed = TcpListener::bind("127.0.0.1:0").expect("bind");
    let gone = format!("http://{}", closed.local_addr().expect("addr"));
    drop(closed);
    let config = s.config(Some(&gone), 1, "", r#"schedule = "@daily""#);
    let (code, out, _) = doctor(&config, &state);
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("tools/list failed"), "{out}");
    // Without a daemon and without --config, doctor says what to pass.
    let out = Command::new(relay_bin())
        .args(["doctor", "--state-dir"])
        .arg(&state)
        .env_remove("RELAY_CONFIG")
        .output()
        .expect("relay doctor");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--config"), "{err}");
}

#[test]
fn reload_moving_a_lease_source_opens_a_new_session_there() {
    let s = Setup::new();
    let config = s.config(None, 1, "", r#"schedule = "@every 1s""#);
    let mut d = Daemon::start(s.path(), &config);
    d.wait_verified();
    // The same server behind a relay that keeps what it sends: a new url, so a new session.
    let tap = Tap::start(&s.server.url);
    let tapped = format!("http://127.0.0.1:{}", tap.port);
    s.config(Some(&tapped), 1, "", r#"schedule = "@every 1s""#);
    let (ok, out) = d.cli(&["reload"]);
    assert!(ok, "{out}");
    assert!(
        out.contains("lease source queue.q changed (a new session)"),
        "{out}"
    );
    let id = s.server.add(&s.endpoint, "fix it", 3);
    let run = d.closed_run("w1", &id);
    assert_eq!(run["relay_outcome"], "completed", "{run}");
    assert!(
        !tap.tokens().is_empty(),
        "the claim did not go through the new url"
    );
    let described = d.described();
    assert_eq!(described[0]["source"]["url"], format!("{tapped}/mcp/work"));
    assert_eq!(described[0]["source"]["session"], "supported");
    d.stop();
}

// ---- both MCP eras ---------------------------------------------------------------------------

/// `relay daemon` against our server with `mcp_era = era`: a 'gate' todo is claimed, its lease
/// is heartbeated (the lease deadline moves on while the agent runs), and it completes once the
/// gate opens; `relay doctor` names the era the source speaks.
fn claims_heartbeats_and_completes(era: &str, speaks: &str) {
    let s = Setup::new();
    let url = format!("{}/mcp/{}", s.server.url.trim_end_matches('/'), s.endpoint);
    let mut text = queue_table(&url, "1s")
        .replace("[queue.q]\n", &format!("[queue.q]\nmcp_era = \"{era}\"\n"));
    text.push_str(&harness_table("w1", r#"schedule = "@every 1s""#));
    let config = s.path().join("harness.toml");
    std::fs::write(&config, text).expect("config");
    let id = s.server.add(&s.endpoint, "gate", 3);
    let mut d = Daemon::start(s.path(), &config);
    s.wait_started(&id);
    let deadline = |s: &Setup| s.server.show(&id)["todo"]["lease_expires_at"].clone();
    let first = deadline(&s);
    assert!(first.is_string(), "a claimed todo has a lease: {first}");
    wait_for(
        "a heartbeat to extend the lease",
        Duration::from_secs(30),
        || (deadline(&s) != first).then_some(()),
    );
    let (ok, doctor) = d.cli(&["doctor"]);
    assert!(ok, "{doctor}");
    assert!(doctor.contains(speaks), "{era}: {doctor}");
    std::fs::write(s.out.join(format!("open.{id}")), "").expect("open the gate");
    s.wait_done("the todo to complete", &id);
    d.stop();
    let closed = d.closed_run("w1", &id);
    assert_eq!(closed["relay_outcome"], "completed");
    assert_eq!(s.server.attempts(&id).len(), 1);
}

#[test]
fn the_daemon_claims_heartbeats_and_completes_through_our_server_in_the_modern_era() {
    // `auto`: the probe finds the modern era on our server.
    claims_heartbeats_and_completes("auto", "speaks MCP 2026-07-28 (modern era, no session)");
}

#[test]
fn the_daemon_claims_heartbeats_and_completes_through_our_server_in_the_legacy_era() {
    claims_heartbeats_and_completes("legacy", "(legacy era, initialize and a session)");
}

/// The context file an 'ask a human' agent saw at attempt `seq`.
fn context_at(s: &Setup, id: &str, seq: u32) -> Value {
    let path = s.out.join(format!("context.{id}.seq{seq}"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("json")
}

#[test]
fn an_agent_that_asks_waits_for_the_answer_and_its_next_attempt_reads_both() {
    let s = Setup::granted(&format!("{VERBS},request_input"));
    let (id, mut d) = s.daemon_every_second("keep_runs = 1000", "ask a human", 3);
    wait_for("the question", Duration::from_secs(60), || {
        (s.server.state(&id) == "input_required").then_some(())
    });
    let asked = d.closed_run("w1", &id);
    assert_eq!(asked["relay_outcome"], "input_requested", "{asked}");
    let attempts = s.server.attempts(&id);
    assert_eq!(attempts.len(), 1, "{attempts:?}");
    assert_eq!(attempts[0]["outcome"], "needs_input");
    assert_eq!(attempts[0]["question"], "which branch?");
    let summary = attempts[0]["summary"].as_str().unwrap_or_default();
    assert!(summary.contains("two branches match"), "{summary}");
    assert!(
        !s.out.join(format!("check.{id}")).exists(),
        "an agent that asked is not judged by the check"
    );
    // No budget on the todo: no budget variable.
    let env = std::fs::read_to_string(s.out.join(format!("env.{id}.1"))).expect("env");
    assert!(!env.contains("HARNESS_BUDGET_REMAINING"), "{env}");

    s.server.cli(&["todo", "answer", &id, "--text", "main"]);
    s.wait_done("the answered todo to complete", &id);
    d.stop();
    let context = context_at(&s, &id, 2);
    let prior = &context["prior_attempts"][0];
    assert_eq!(prior["question"], "which branch?", "{context}");
    assert_eq!(prior["answer"], "main", "{context}");
    let untrusted = context["untrusted"].as_array().cloned().unwrap_or_default();
    for path in ["prior_attempts[].question", "prior_attempts[].answer"] {
        assert!(untrusted.contains(&Value::from(path)), "{untrusted:?}");
    }
    let checks = std::fs::read_to_string(s.out.join(format!("check.{id}"))).expect("checks");
    assert_eq!(
        checks.lines().count(),
        1,
        "only the second attempt was checked"
    );
}

#[test]
fn a_question_on_an_endpoint_that_cannot_ask_is_a_fail_that_keeps_it() {
    let s = Setup::new();
    let (id, mut d) = s.daemon_every_second("", "ask a human", 1);
    wait_for("the dead letter", Duration::from_secs(60), || {
        (s.server.show(&id)["todo"]["dead_letter"] == true).then_some(())
    });
    let run = d.closed_run("w1", &id);
    d.stop();
    assert_eq!(run["relay_outcome"], "dead_lettered", "{run}");
    let t = s.server.show(&id);
    assert_eq!(
        t["todo"]["result"]["harness"]["reason"], "needs_input_unsupported",
        "{t}"
    );
    let attempts = s.server.attempts(&id);
    assert_eq!(attempts[0]["outcome"], "failed");
    let summary = attempts[0]["summary"].as_str().unwrap_or_default();
    assert!(summary.contains("needs input: which branch?"), "{summary}");
}

#[test]
fn an_agent_whose_usage_crosses_the_budget_is_stopped_at_the_next_heartbeat() {
    let s = Setup::new();
    // Heartbeats every second on a 1 m lease: the stop comes from a heartbeat, long before the
    // lease could lapse.
    let config = s.config(None, 1, "", r#"schedule = "@every 1s""#);
    let text = std::fs::read_to_string(&config).expect("config").replace(
        r#"heartbeat_interval = "20s""#,
        r#"heartbeat_interval = "1s""#,
    );
    std::fs::write(&config, text).expect("config");
    let extra = ["--max-attempts", "3", "--budget-usd", "1"];
    let (code, id, err) = todo_add(&s.server.db, &s.endpoint, "work", "overspend", &extra);
    assert_eq!(code, 0, "relay todo add failed: {err}");
    let id = id.trim().to_string();
    let mut d = Daemon::start(s.path(), &config);
    s.wait_started(&id);
    s.wait_stopped(&id, Duration::from_secs(30));
    let run = d.closed_run("w1", &id);
    d.stop();
    assert_eq!(run["relay_outcome"], "lease_lost", "{run}");
    let t = s.server.show(&id);
    assert_eq!(t["todo"]["dead_letter"], true, "{t}");
    assert_eq!(t["todo"]["dead_letter_reason"], "budget_exhausted", "{t}");
    assert_eq!(t["todo"]["spent"]["cost_usd"], 2.0, "{t}");
    let attempts = s.server.attempts(&id);
    assert_eq!(attempts.len(), 1, "never claimed again: {attempts:?}");
    assert_eq!(attempts[0]["usage"]["cost_usd"], 2.0, "{attempts:?}");
    assert_eq!(attempts[0]["usage"]["input_tokens"], 10, "{attempts:?}");
    // The agent was told its budget and where to write its usage.
    let env = std::fs::read_to_string(s.out.join(format!("env.{id}.1"))).expect("env");
    assert!(
        env.lines()
            .any(|l| l == r#"HARNESS_BUDGET_REMAINING={"cost_usd":1.0}"#),
        "{env}"
    );
    let usage_file = env
        .lines()
        .find_map(|l| l.strip_prefix("HARNESS_USAGE_FILE="))
        .unwrap_or_else(|| panic!("no HARNESS_USAGE_FILE in {env}"));
    assert!(
        usage_file.starts_with(&d.state.display().to_string()),
        "{usage_file}"
    );
}
