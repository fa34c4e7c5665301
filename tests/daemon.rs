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
        let mut child = Command::new(relay_bin())
            .args(["serve", "--listen", listen, "--db", &db])
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .expect("start relay serve");
        let mut first = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut first)
            .expect("read the listening line");
        let url = first
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {first:?}"))
            .to_string();
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

    fn endpoint(&self, name: &str) -> String {
        self.cli(&[
            "endpoint",
            "create",
            name,
            "--verbs",
            "claim_next,claim,heartbeat,complete,fail,release,get_todo,list_todos,add_todo",
        ])
        .trim()
        .to_string()
    }

    fn add(&self, endpoint: &str, title: &str, max_attempts: u32) -> String {
        self.cli(&[
            "todo",
            "add",
            "--endpoint",
            endpoint,
            "--queue",
            "work",
            "--title",
            title,
            "--max-attempts",
            &max_attempts.to_string(),
        ])
        .trim()
        .to_string()
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
  *hang*)
    trap 'date +%s%N > "$OUT/term.$HARNESS_TODO_ID"; exit 143' TERM
    echo $$ > "$OUT/started.$HARNESS_TODO_ID"
    while :; do sleep 0.1; done ;;
  *fail*)
    printf '{"summary":"it failed on purpose"}' > "$HARNESS_ATTEMPT_SUMMARY_FILE"; exit 1 ;;
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

impl Setup {
    fn new() -> Setup {
        let dir = tempfile::tempdir().expect("tempdir");
        let server = Server::start(dir.path());
        let endpoint = "work".to_string();
        let token = server.endpoint(&endpoint);
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
        let mut text = format!(
            r#"
[queue.q]
url = "{base}/mcp/{ep}"
env_file = "token.env"
headers = {{ Authorization = "Bearer ${{TOKEN}}" }}
queue = "work"
lease_ttl = "1m"
heartbeat_interval = "20s"

[channel.bell]
url = "{base}/mcp/{ep}"
env_file = "token.env"
headers = {{ Authorization = "Bearer ${{TOKEN}}" }}
"#,
            ep = self.endpoint
        );
        for n in 1..=workers {
            text.push_str(&format!(
                r#"
[harness.w{n}]
command = ["sh", "agent.sh"]
env_file = "agent.env"
lease = "queue.q"
success_check = ["sh", "check.sh"]
success_check_interval = "1s"
kill_grace = "2s"
{trigger}
{extra}
"#
            ));
        }
        let path = self.path().join("harness.toml");
        std::fs::write(&path, text).expect("config");
        path
    }

    fn ran(&self, id: &str) -> bool {
        self.out.join(format!("ran.{id}")).exists()
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
    wait_for("the todo to complete", Duration::from_secs(60), || {
        (s.server.state(&id) == "done").then_some(())
    });
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
    let config = s.config(None, 1, "", r#"schedule = "@every 1s""#);
    let id = s.server.add(&s.endpoint, "wait for it", 3);
    let mut d = Daemon::start(s.path(), &config);
    wait_for("the todo to complete", Duration::from_secs(60), || {
        (s.server.state(&id) == "done").then_some(())
    });
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
    let config = s.config(
        None,
        1,
        "success_check_before = true",
        r#"schedule = "@every 1s""#,
    );
    let id = s.server.add(&s.endpoint, "already green", 3);
    let mut d = Daemon::start(s.path(), &config);
    wait_for("the todo to complete", Duration::from_secs(60), || {
        (s.server.state(&id) == "done").then_some(())
    });
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
    let config = s.config(None, 1, "", r#"schedule = "@every 1s""#);
    let id = s.server.add(&s.endpoint, "fail always", 1);
    let mut d = Daemon::start(s.path(), &config);
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
    wait_for("the agent to start", Duration::from_secs(60), || {
        line_in(&s.out.join(format!("started.{id}")))
    });
    s.server.cli(&["todo", "cancel", &id]);
    wait_for("the agent to be stopped", Duration::from_secs(30), || {
        line_in(&s.out.join(format!("term.{id}")))
    });
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
    let config = s.config(None, 1, "", r#"schedule = "@every 1s""#);
    let id = s.server.add(&s.endpoint, "hang then fine", 3);
    let mut d = Daemon::start(s.path(), &config);
    wait_for("the agent to start", Duration::from_secs(60), || {
        line_in(&s.out.join(format!("started.{id}")))
    });
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

#[test]
fn a_partition_longer_than_the_lease_stops_the_process_within_a_second_of_the_deadline() {
    let mut s = Setup::new();
    // Every second's firing is recorded (skipped: the server is gone); keep them all.
    let config = s.config(None, 1, "keep_runs = 1000", r#"schedule = "@every 1s""#);
    let id = s.server.add(&s.endpoint, "hang on", 3);
    let mut d = Daemon::start(s.path(), &config);
    wait_for("the agent to start", Duration::from_secs(60), || {
        line_in(&s.out.join(format!("started.{id}")))
    });
    // The server goes away: every heartbeat from now on fails, so the lease deadline the daemon
    // shows now is the one it acts on.
    s.server.stop();
    let (ok, out) = d.cli(&["describe", "w1", "--json"]);
    assert!(ok, "{out}");
    let described: Value = serde_json::from_str(&out).expect("json");
    let deadline = described[0]["relay"]["attempt"]["lease_deadline"]
        .as_str()
        .and_then(relay_core::time::parse_rfc3339)
        .unwrap_or_else(|| panic!("no lease deadline in {described}"));
    let term = wait_for("the agent to be stopped", Duration::from_secs(120), || {
        line_in(&s.out.join(format!("term.{id}")))
    });
    let term_ms: u64 = term.trim().parse::<u64>().expect("nanoseconds") / 1_000_000;
    assert!(
        term_ms + 50 >= deadline && term_ms <= deadline + 1000,
        "SIGTERM at {term_ms}, lease deadline {deadline}: not within a second"
    );
    let run = d.closed_run("w1", &id);
    assert_eq!(run["relay_outcome"], "lease_lost", "{run}");
    d.stop();
}

#[test]
fn doctor_names_what_a_read_only_endpoint_lacks_and_describe_shows_no_secret() {
    let s = Setup::new();
    let token = s
        .server
        .cli(&["endpoint", "create", "ro", "--verbs", "list_todos"]);
    let token = token.trim();
    std::fs::write(s.path().join("ro.env"), format!("TOKEN={token}\n")).expect("env");
    let config = s.path().join("ro.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[queue.ro]
url = "{}/mcp/ro"
env_file = "ro.env"
headers = {{ Authorization = "Bearer ${{TOKEN}}" }}

[harness.reader]
command = ["sh", "agent.sh"]
env_file = "agent.env"
schedule = "@daily"
lease = "queue.ro"
"#,
            s.server.url
        ),
    )
    .expect("config");
    let mut d = Daemon::start(s.path(), &config);
    // The session is checked once the daemon is up; describe shows it unsupported.
    let described = wait_for("the capability check", Duration::from_secs(30), || {
        let (ok, out) = d.cli(&["describe", "reader", "--json"]);
        (ok && out.contains("\"unsupported\"")).then_some(out)
    });
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
    text.push_str(&format!(
        r#"
[cairn.main]
url = "{}"
env_file = "cairn.env"
headers = {{ Authorization = "Bearer ${{CAIRN_TOKEN}}" }}
"#,
        cairn.url
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
    wait_for("the todo to complete", Duration::from_secs(60), || {
        (s.server.state(&id) == "done").then_some(())
    });
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
    let config = s.config(None, 1, "keep_runs = 1000", r#"schedule = "@every 1s""#);
    let first = s.server.add(&s.endpoint, "before", 3);
    let mut d = Daemon::start(s.path(), &config);
    wait_for("the first todo", Duration::from_secs(60), || {
        (s.server.state(&first) == "done").then_some(())
    });
    // Same address, same store; the sessions were in the old process's memory.
    let listen = s.server.url.trim_start_matches("http://").to_string();
    s.server.stop();
    s.server = Server::start_on(s.path(), &listen);
    let second = s.server.add(&s.endpoint, "after", 3);
    wait_for("the second todo", Duration::from_secs(60), || {
        (s.server.state(&second) == "done").then_some(())
    });
    d.stop();
    assert_eq!(s.server.attempts(&second).len(), 1);
}
