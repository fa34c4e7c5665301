//! The contract test: the real `relay daemon` against a queue server that is not ours,
//! tests/standin/server.py, written on the official MCP Python SDK's server. The stand-in
//! answers exactly the relay-design contract table's fields ("The Switchboard contract relay
//! uses"), declares strict schemas, hands out known lease tokens (`standin-lease-<todo>-<seq>`)
//! and logs every request and answer as JSON lines, which is what these tests read.
//!
//! The stand-in needs the SDK (`pip install -r tests/python/requirements.txt`, which
//! `.ci/mcp.sh` runs). Without it these tests say so and pass, unless
//! `RELAY_REQUIRE_MCP_CLIENTS=1` (CI sets it), which makes a missing SDK a failure.
//!
//! Waiting: as in tests/daemon.rs, every wait polls something observable with a generous bound.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};

mod common;
use common::*;

const BOUND: Duration = Duration::from_secs(60);
/// The bearer token the stand-in wants (a test value, not a secret of anyone's).
const BEARER: &str = "standin-bearer-0123456789";

fn sdk_present() -> bool {
    Command::new("python3")
        .args(["-c", "import mcp, jsonschema, uvicorn"])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// The stand-in, when the SDK is installed (see the module doc).
fn standin_available() -> bool {
    available(
        "the Python MCP SDK (for the stand-in queue server)",
        sdk_present(),
        "pip install -r tests/python/requirements.txt",
    )
}

/// The stand-in queue server, its files in their own folder (not the daemon's).
struct Standin {
    _proc: Proc,
    url: String,
    log: PathBuf,
}

impl Standin {
    /// `flags`: `--old`, `--omit FIELD`, `--legacy-only` (see tests/standin/server.py).
    fn start(dir: &Path, todos: Value, flags: &[&str]) -> Standin {
        let dir = dir.join("standin");
        std::fs::create_dir_all(&dir).expect("standin dir");
        let todos_file = dir.join("todos.json");
        std::fs::write(&todos_file, todos.to_string()).expect("todos");
        let log = dir.join("calls.jsonl");
        let stderr = std::fs::File::create(dir.join("stderr.log")).expect("stderr");
        let mut cmd = Command::new("python3");
        cmd.arg(repo().join("tests/standin/server.py"))
            .arg("--todos")
            .arg(&todos_file)
            .arg("--log")
            .arg(&log)
            .args(["--token", BEARER])
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .stdout(Stdio::piped())
            .args(flags)
            .stderr(stderr);
        let mut child = cmd.spawn().expect("start the stand-in");
        // Ends at the ready line, or at EOF when the stand-in dies (its stderr says why).
        let url = listening_on(&mut child).unwrap_or_else(|first| {
            let err = std::fs::read_to_string(dir.join("stderr.log")).unwrap_or_default();
            panic!("the stand-in did not start: {first:?}\n{err}")
        });
        assert!(url.starts_with("http://127.0.0.1:"), "{url}");
        Standin {
            _proc: Proc(child),
            url,
            log,
        }
    }

    /// Every log entry so far.
    fn entries(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// The arguments of every `tools/call` of `tool`, in order.
    fn calls(&self, tool: &str) -> Vec<Value> {
        self.entries()
            .into_iter()
            .filter(|e| e["kind"] == "request" && e["method"] == "tools/call" && e["tool"] == tool)
            .map(|e| e["arguments"].clone())
            .collect()
    }

    fn methods(&self) -> Vec<String> {
        self.entries()
            .iter()
            .filter_map(|e| e["method"].as_str().map(str::to_string))
            .collect()
    }

    /// Every tool answer's code that is not `ok`, with its tool.
    fn refusals(&self) -> Vec<(String, String)> {
        self.entries()
            .iter()
            .filter(|e| e["kind"] == "answer" && e["code"] != "ok")
            .map(|e| (e["tool"].to_string(), e["code"].to_string()))
            .collect()
    }
}

const AGENT: &str = r#"#!/bin/sh
# Contract-test agent: records what it was given, then does what the todo's title says.
set -u
mkdir -p "$OUT"
echo ran >> "$OUT/ran.$HARNESS_TODO_ID"
cp "$HARNESS_RELAY_FILE" "$OUT/context.$HARNESS_TODO_ID.$HARNESS_ATTEMPT"
title=$(sed -n 's/.*"title": *"\([^"]*\)".*/\1/p' "$HARNESS_RELAY_FILE" | head -n 1)
case "$title" in
  *beat*)
    # Stay until the stand-in has seen two heartbeats (bounded: 60 s).
    n=0
    while [ "$(grep -c '"tools/call", "tool": "heartbeat"' "$CALLS")" -lt 2 ] \
      && [ "$n" -lt 600 ]; do
      sleep 0.1; n=$((n + 1))
    done ;;
  *hang*)
    trap 'echo term > "$OUT/term.$HARNESS_TODO_ID"; exit 143' TERM
    while :; do sleep 0.1; done ;;
  *fail*)
    printf '{"summary":"it failed on purpose","artifact":"mcp://cairn/Fa11Ed"}' \
      > "$HARNESS_ATTEMPT_SUMMARY_FILE"
    exit 1 ;;
esac
printf '{"summary":"all good","artifact":"mcp://cairn/Ab12Cd34"}' > "$HARNESS_ATTEMPT_SUMMARY_FILE"
exit 0
"#;

const CHECK: &str = r#"#!/bin/sh
# Contract-test check: 'wait' titles answer 75 once (CI still running), then decide.
set -u
title=$(sed -n 's/.*"title": *"\([^"]*\)".*/\1/p' "$HARNESS_RELAY_FILE" | head -n 1)
echo "check ran" >> "$OUT/check.$HARNESS_TODO_ID"
case "$title" in
  *wait*) [ "$(wc -l < "$OUT/check.$HARNESS_TODO_ID")" -le 1 ] && exit 75 ;;
esac
[ "${HARNESS_AGENT_EXIT:-1}" = 0 ]
"#;

/// A stand-in with `todos`, and a daemon with one leased harness `w1` on it.
struct Setup {
    dir: tempfile::TempDir,
    standin: Standin,
    daemon: Daemon,
    out: PathBuf,
}

impl Setup {
    fn start(todos: Value, flags: &[&str]) -> Setup {
        let dir = tempfile::tempdir().expect("tempdir");
        let standin = Standin::start(dir.path(), todos, flags);
        let out = dir.path().join("out");
        let p = |name: &str| dir.path().join(name);
        std::fs::write(p("agent.sh"), AGENT).expect("agent");
        std::fs::write(p("check.sh"), CHECK).expect("check");
        std::fs::write(p("token.env"), format!("TOKEN={BEARER}\n")).expect("env");
        let env = format!("OUT={}\nCALLS={}\n", out.display(), standin.log.display());
        std::fs::write(p("agent.env"), env).expect("env");
        let config = queue_table(&format!("{}/mcp", standin.url), "1s")
            + &harness_table("w1", r#"schedule = "@every 1s""#);
        std::fs::write(p("harness.toml"), config).expect("config");
        let daemon = Daemon::start(dir.path(), &p("harness.toml"));
        Setup {
            dir,
            standin,
            daemon,
            out,
        }
    }

    /// The newest closed run of `todo` whose relay outcome is `outcome`.
    fn run_ending(&self, todo: &str, outcome: &str) -> Value {
        wait_for(&format!("a run of {todo} ending {outcome}"), BOUND, || {
            self.daemon
                .runs("w1")
                .into_iter()
                .find(|r| r["todo_id"] == todo && r["relay_outcome"] == outcome)
        })
    }

    fn context(&self, todo: &str, attempt: u32) -> Value {
        let path = self.out.join(format!("context.{todo}.{attempt}"));
        let text = std::fs::read_to_string(&path).expect("the agent's copy of the context file");
        serde_json::from_str(&text).expect("json")
    }

    fn daemon_log(&self) -> String {
        std::fs::read_to_string(&self.daemon.log).unwrap_or_default()
    }

    /// No byte of a stand-in lease token in anything the daemon wrote or handed out.
    fn assert_no_token_outside_the_wire(&self) {
        for f in files(self.dir.path()) {
            if f.starts_with(self.dir.path().join("standin")) {
                continue;
            }
            let text = String::from_utf8_lossy(&std::fs::read(&f).unwrap_or_default()).to_string();
            assert!(
                !text.contains("standin-lease-"),
                "a lease token in {}",
                f.display()
            );
        }
    }
}

fn token(todo: &str, seq: u32) -> String {
    format!("standin-lease-{todo}-{seq}")
}

#[test]
fn a_fenced_claim_heartbeats_with_the_token_and_completes_with_summary_and_artifact() {
    if !standin_available() {
        return;
    }
    let s = Setup::start(
        json!([{"id": "td_ok", "title": "beat and fix it", "max_attempts": 3,
                "kind": "check_suite", "payload": {"sha": "abc123"}}]),
        &[],
    );
    let run = s.run_ending("td_ok", "completed");
    assert_eq!(run["outcome"], "success");
    assert_eq!(run["attempt"], 1);

    // The Python SDK 2.3 server is dual-era: the probe finds the modern era, and no session is
    // made.
    let methods = s.standin.methods();
    assert_eq!(
        methods.first().map(String::as_str),
        Some("server/discover"),
        "{methods:?}"
    );
    assert!(!methods.iter().any(|m| m == "initialize"), "{methods:?}");

    // claim_next: the fence asked for and the harness's claimant label, nothing else.
    let claim = &s.standin.calls("claim_next")[0];
    let claimant = claim["claimant"].as_str().unwrap_or_default();
    assert!(claimant.starts_with("harness/"), "{claim}");
    let run_id = run["run_id"].as_u64().expect("run id");
    assert!(claimant.ends_with(&format!("/w1/run-{run_id}")), "{claim}");
    assert_eq!(
        claim,
        &json!({"queue": "work", "lease_ttl_seconds": 60, "require_fence": true,
                "claimant": claimant})
    );
    // Heartbeats carry the token the claim handed out.
    let heartbeats = s.standin.calls("heartbeat");
    assert!(heartbeats.len() >= 2, "{heartbeats:?}");
    for h in &heartbeats {
        assert_eq!(
            h,
            &json!({"id": "td_ok", "lease_ttl_seconds": 60, "lease_token": token("td_ok", 1)})
        );
    }
    // One complete, with the summary, the agent's artifact and the token.
    let completes = s.standin.calls("complete");
    assert_eq!(completes.len(), 1, "{completes:?}");
    let c = &completes[0];
    assert_eq!(c["id"], "td_ok");
    assert_eq!(c["lease_token"], token("td_ok", 1).as_str());
    assert_eq!(c["artifact"], "mcp://cairn/Ab12Cd34");
    let summary = c["summary"].as_str().unwrap_or_default();
    assert!(
        summary.starts_with("attempt 1/3 · agent success (exit 0)"),
        "{summary}"
    );
    assert!(summary.contains("all good"), "{summary}");
    assert!(c["result"].is_object(), "{c}");
    assert!(s.standin.calls("fail").is_empty() && s.standin.calls("release").is_empty());
    // The strict schemas never refused anything the daemon sent.
    assert_eq!(s.standin.refusals(), []);
    // The context file holds the contract's todo fields as the stand-in sent them.
    let context = s.context("td_ok", 1);
    assert_eq!(context["todo"]["id"], "td_ok");
    assert_eq!(context["todo"]["title"], "beat and fix it");
    assert_eq!(context["todo"]["kind"], "check_suite");
    assert_eq!(context["todo"]["payload"], json!({"sha": "abc123"}));
    assert_eq!(context["todo"]["queue"], "work");
    assert!(context["todo"]["created_at"].is_string(), "{context}");
    assert_eq!(context["attempt"]["seq"], 1);
    assert_eq!(context["attempt"]["number"], 1);
    assert_eq!(context["attempt"]["max"], 3);
    assert!(context["attempt"]["claimed_at"].is_string(), "{context}");
    assert_eq!(context["prior_attempts"], json!([]));
    s.assert_no_token_outside_the_wire();
}

#[test]
fn a_heartbeat_answered_conflict_stops_the_agent_and_reports_nothing() {
    if !standin_available() {
        return;
    }
    let s = Setup::start(
        json!([{"id": "td_lost", "title": "hang on", "conflict_on_heartbeat": 1}]),
        &[],
    );
    let run = s.run_ending("td_lost", "lease_lost");
    assert_eq!(run["attempt"], 1);
    let term = s.out.join("term.td_lost");
    wait_for("the agent's TERM", BOUND, || line_in(&term));
    assert_eq!(
        s.standin.calls("heartbeat")[0]["lease_token"],
        token("td_lost", 1).as_str()
    );
    for verb in ["complete", "fail", "release"] {
        assert_eq!(s.standin.calls(verb), Vec::<Value>::new(), "{verb} sent");
    }
}

#[test]
fn a_fail_answered_dead_letter_is_recorded_dead_lettered() {
    if !standin_available() {
        return;
    }
    let s = Setup::start(
        json!([{"id": "td_dead", "title": "fail always", "max_attempts": 2}]),
        &[],
    );
    let last = s.run_ending("td_dead", "dead_lettered");
    assert_eq!(last["attempt"], 2);
    let first = s.run_ending("td_dead", "failed");
    assert_eq!(first["attempt"], 1);
    let fails = s.standin.calls("fail");
    assert_eq!(fails.len(), 2, "{fails:?}");
    for (n, f) in fails.iter().enumerate() {
        assert_eq!(f["lease_token"], token("td_dead", n as u32 + 1).as_str());
        assert_eq!(f["artifact"], "mcp://cairn/Fa11Ed");
    }
    // The second attempt saw the first in the server's words (its `attempt` is `number`).
    let prior = &s.context("td_dead", 2)["prior_attempts"];
    assert_eq!(prior.as_array().map(Vec::len), Some(1), "{prior}");
    assert_eq!(prior[0]["number"], 1);
    assert_eq!(prior[0]["seq"], 1);
    assert_eq!(prior[0]["outcome"], "failed");
    assert_eq!(prior[0]["artifact"], "mcp://cairn/Fa11Ed");
    let summary = prior[0]["summary"].as_str().unwrap_or_default();
    assert!(summary.contains("it failed on purpose"), "{summary}");
    assert_eq!(s.standin.refusals(), []);
}

#[test]
fn a_check_that_exits_75_is_run_again_and_the_todo_completes() {
    if !standin_available() {
        return;
    }
    let s = Setup::start(json!([{"id": "td_wait", "title": "wait for ci"}]), &[]);
    let run = s.run_ending("td_wait", "completed");
    assert_eq!(run["check_exit"], 0);
    let checks = std::fs::read_to_string(s.out.join("check.td_wait")).expect("check runs");
    assert_eq!(checks.lines().count(), 2, "75 once, then 0");
    assert_eq!(s.standin.calls("complete").len(), 1);
    assert_eq!(s.standin.refusals(), []);
}

#[test]
fn a_server_without_the_attempt_history_arguments_is_refused_and_never_claimed_on() {
    if !standin_available() {
        return;
    }
    let s = Setup::start(json!([{"id": "td_old", "title": "fix it"}]), &["--old"]);
    // The capability check has run (its ERROR names what is missing) ...
    let log = wait_for("the unsupported-source error", BOUND, || {
        let log = s.daemon_log();
        log.contains("lacks the arguments relay needs")
            .then_some(log)
    });
    assert!(log.contains("claim_next.require_fence"), "{log}");
    assert!(log.contains("heartbeat.lease_token"), "{log}");
    // ... and firings after it are skipped as unsupported.
    let skipped = |s: &Setup| {
        s.daemon
            .runs("w1")
            .into_iter()
            .filter(|r| r["skipped_reason"] == "lease_source_unsupported")
            .count()
    };
    let seen = skipped(&s);
    wait_for("two more skipped firings", BOUND, || {
        (skipped(&s) >= seen + 2).then_some(())
    });
    let runs = s.daemon.runs("w1");
    assert!(
        runs.iter().all(|r| r["outcome"] == "skipped"
            && r["skipped_reason"] == "lease_source_unsupported"),
        "{runs:?}"
    );
    assert!(s.standin.methods().contains(&"tools/list".to_string()));
    assert_eq!(
        s.standin.calls("claim_next"),
        Vec::<Value>::new(),
        "no claim_next may reach a server without the fence"
    );
    assert!(!s.standin.methods().contains(&"tools/call".to_string()));
    assert!(!s.out.join("ran.td_old").exists());
}

#[test]
fn a_claim_answer_without_a_needed_field_is_claim_failed_and_the_log_names_it() {
    if !standin_available() {
        return;
    }
    let s = Setup::start(
        json!([{"id": "td_odd", "title": "fix it"}]),
        &["--omit", "todo.attempt"],
    );
    let run = wait_for("the claim_failed run", BOUND, || {
        s.daemon
            .runs("w1")
            .into_iter()
            .find(|r| r["skipped_reason"] == "claim_failed")
    });
    assert_eq!(run["outcome"], "skipped");
    assert_eq!(run["claim_error"], "malformed_answer");
    let log = wait_for("the daemon's log line", BOUND, || {
        let log = s.daemon_log();
        log.contains("the claim_next answer has no todo.attempt")
            .then_some(log)
    });
    assert!(!log.contains("standin-lease-"), "the log holds a token");
    // The run's own log says it too.
    let run_log = s
        .daemon
        .state
        .join(format!("jobs/w1/{}.log", run["run_id"]));
    let text = wait_for("the run log's warning", BOUND, || line_in(&run_log));
    assert!(text.contains("todo.attempt"), "{text}");
    // Nothing spawned, nothing sent for the claim: its lease lapses on the server.
    assert!(!s.out.join("ran.td_odd").exists());
    for verb in ["heartbeat", "complete", "fail", "release"] {
        assert_eq!(s.standin.calls(verb), Vec::<Value>::new(), "{verb} sent");
    }
}

/// A legacy-only server (the stand-in refusing 2026-07-28 requests with the pre-2.x SDK's 400
/// "Missing session ID"): the daemon's probe falls back to `initialize`, and the attempt runs
/// in a session as before.
#[test]
fn a_legacy_only_server_is_probed_then_initialized_and_the_claim_completes() {
    if !standin_available() {
        return;
    }
    let s = Setup::start(
        json!([{"id": "td_old_era", "title": "beat and fix it", "max_attempts": 3}]),
        &["--legacy-only"],
    );
    let run = s.run_ending("td_old_era", "completed");
    assert_eq!(run["outcome"], "success");
    let methods = s.standin.methods();
    assert_eq!(
        methods[..2],
        ["server/discover", "initialize"],
        "probe, then the fallback: {methods:?}"
    );
    assert_eq!(
        methods.iter().filter(|m| *m == "server/discover").count(),
        1
    );
    assert!(s.standin.calls("heartbeat").len() >= 2);
    assert_eq!(s.standin.calls("complete").len(), 1);
}
