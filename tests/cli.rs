//! End-to-end checks of the `relay` binary's command line contract.

use std::process::Command;

mod common;
use common::{relay, run_db, serve, temp_dir, todo_add};

#[test]
fn unknown_command_is_one_clear_line_on_stderr_and_nonzero() {
    let out = relay().arg("frobnicate").output().expect("run relay");
    assert!(!out.status.success());
    assert!(out.stdout.is_empty());
    let err = String::from_utf8(out.stderr).expect("utf-8 stderr");
    assert_eq!(err.lines().count(), 1, "one line: {err:?}");
    assert!(
        err.contains("frobnicate") && err.contains("relay --help"),
        "{err}"
    );
}

#[test]
fn help_lists_the_contract_commands() {
    let out = relay().arg("--help").output().expect("run relay");
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).expect("utf-8 stdout");
    for cmd in [
        "serve",
        "endpoint",
        "todo",
        "daemon",
        "up",
        "sim",
        "check-config",
        "operator",
        "queue",
    ] {
        assert!(text.contains(cmd), "help lacks {cmd}: {text}");
    }
}

fn run(args: &[&str]) -> (i32, String, String) {
    let out = relay().args(args).output().expect("run relay");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8(out.stdout).expect("utf-8 stdout"),
        String::from_utf8(out.stderr).expect("utf-8 stderr"),
    )
}

#[test]
fn sim_replays_a_seed_and_prints_its_options_and_counts() {
    let (code, out, err) = run(&["sim", "--seed", "7", "--check-determinism"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("seed 7\n"), "{out}");
    assert!(
        out.contains("faults: ") && out.contains("counts: "),
        "{out}"
    );
    assert!(out.contains("same on a second run"), "{out}");
    let (_, again, _) = run(&["sim", "--seed", "7"]);
    let trace = |s: &str| s.lines().find(|l| l.starts_with("ok: ")).map(str::to_owned);
    assert_eq!(
        trace(&out).map(|l| l.replace(" (same on a second run)", "")),
        trace(&again)
    );
}

#[test]
fn a_caught_mutation_exits_one_with_a_repro_that_replays_it() {
    let (code, out, _) = run(&["sim", "--seeds", "50", "--mutation", "reaper-closes-twice"]);
    assert_eq!(code, 1, "{out}");
    let violation = out
        .lines()
        .find(|l| l.starts_with("VIOLATION (correctness)"))
        .expect(&out);
    let repro = out
        .lines()
        .find_map(|l| l.strip_prefix("repro: relay "))
        .expect(&out);
    let args: Vec<&str> = repro.split(' ').collect();
    let (code, replay, _) = run(&args);
    assert_eq!(code, 1);
    assert!(replay.lines().any(|l| l == violation), "{replay}");
}

/// A sweep runs seeds on several threads and reports exactly what one thread reports: the same
/// totals, and under a mutation the same (lowest) failing seed with the same repro.
#[test]
fn a_sweep_on_several_threads_reports_what_one_thread_reports() {
    // The rate is the one figure that differs.
    let rateless = |s: &str| -> String {
        s.lines()
            .map(|l| match l.find(" simulated, ") {
                Some(i) if l.contains(" seeds ok: ") => l[..i].to_string(),
                _ => l.to_string(),
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    for extra in [&[][..], &["--mutation", "reaper-closes-twice"][..]] {
        let mut outs = Vec::new();
        for threads in ["1", "3"] {
            let mut args = vec!["sim", "--seeds", "40", "--threads", threads];
            args.extend_from_slice(extra);
            let (code, out, err) = run(&args);
            assert_eq!(code, if extra.is_empty() { 0 } else { 1 }, "{out}{err}");
            outs.push(rateless(&out));
        }
        assert_eq!(outs[0], outs[1]);
        assert!(outs[0].contains("counts: "), "{}", outs[0]);
    }
}

#[test]
fn a_sweep_can_force_the_relays_todos_and_faulted_phase_of_every_seed() {
    let (code, out, err) = run(&[
        "sim",
        "--seed",
        "3",
        "--relays",
        "8",
        "--todos",
        "40",
        "--duration",
        "24h",
        "--all-faults",
    ]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("relays=8 todos=40 "), "{out}");
    assert!(out.contains("safety=1d"), "{out}");
    assert!(
        out.contains("partitions=true outages=true crashes=true pauses=true"),
        "{out}"
    );
    let (code, _, err) = run(&["sim", "--seed", "3", "--relays", "0"]);
    assert_eq!(code, 2);
    assert!(err.contains("--relays"), "{err}");
    let (code, _, err) = run(&["sim", "--seed", "3", "--duration", "soon"]);
    assert_eq!(code, 2);
    assert!(err.contains("--duration") && err.contains("1h30m"), "{err}");
}

#[test]
fn check_config_accepts_a_good_file_and_names_the_key_of_a_bad_one() {
    let dir = std::env::temp_dir().join(format!("relay-cli-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("harness.d")).unwrap();
    let main = dir.join("harness.toml");
    std::fs::write(
        &main,
        "[queue.ci]\nurl = \"http://127.0.0.1:7070/mcp/ci\"\nlease_ttl = \"5m\"\n\n\
         [harness.fixer]\ncommand = [\"./fix.sh\"]\nschedule = \"@every 5m\"\nlease = \"queue.ci\"\n",
    )
    .unwrap();
    let (code, out, err) = run(&["check-config", main.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("ok (1 harnesses, 1 queue sources"), "{out}");
    std::fs::write(
        dir.join("harness.d/10-bad.toml"),
        "[queue.slow]\nurl = \"http://127.0.0.1:7070/mcp/ci\"\nlease_ttl = \"5m\"\nheartbeat_interval = \"4m\"\n",
    )
    .unwrap();
    let (code, _, err) = run(&["check-config", main.to_str().unwrap()]);
    assert_ne!(code, 0);
    assert!(
        err.contains("heartbeat_interval") && err.contains("queue.slow"),
        "{err}"
    );
    let (code, _, err) = run(&["check-config", main.to_str().unwrap(), "--project"]);
    assert_ne!(code, 0);
    assert!(err.contains("queue.ci"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_saved_plan_replays_the_same_violation_and_a_shrunk_one_the_same_invariant() {
    let path = std::env::temp_dir().join(format!("relay-plan-{}.json", std::process::id()));
    let p = path.to_str().unwrap();
    let m = ["--mutation", "server-skips-fence"];
    let (code, out, _) = run(&["sim", "--seeds", "50", m[0], m[1], "--save-plan", p]);
    assert_eq!(code, 1, "{out}");
    let violation = out
        .lines()
        .find(|l| l.starts_with("VIOLATION"))
        .expect(&out)
        .to_owned();
    assert!(
        out.contains(&format!("replay: relay sim --plan {p}")),
        "{out}"
    );
    let (code, replay, _) = run(&["sim", "--plan", p]);
    assert_eq!(code, 1, "{replay}");
    assert!(replay.lines().any(|l| l == violation), "{replay}");

    let (code, out, _) = run(&[
        "sim",
        "--seeds",
        "50",
        m[0],
        m[1],
        "--shrink",
        "--save-plan",
        p,
    ]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("shrunk plan: "), "{out}");
    let (code, replay, _) = run(&["sim", "--plan", p]);
    assert_eq!(code, 1, "{replay}");
    assert!(
        replay.contains("VIOLATION (correctness) of stale_fence"),
        "{replay}"
    );

    std::fs::write(&path, "{\"x\": 1}").unwrap();
    let (code, _, err) = run(&["sim", "--plan", p]);
    assert_eq!(code, 2);
    assert!(
        err.contains("not a saved run") && err.lines().count() == 1,
        "{err}"
    );
    std::fs::remove_file(&path).unwrap();
}

// ---------------------------------------------------------------------------------------------
// The queue server and the operator commands.
// ---------------------------------------------------------------------------------------------

fn one_line_error(code: i32, err: &str, needle: &str) {
    assert_ne!(code, 0);
    assert_eq!(err.lines().count(), 1, "one line: {err:?}");
    assert!(err.contains(needle), "{needle:?} in {err}");
}

#[test]
fn operator_and_queue_commands_round_trip_on_sqlite() {
    let tmp = temp_dir("operators");
    let dir = tmp.path();
    let db = format!("sqlite:{}", dir.join("relay.db").display());
    let (code, token, err) = run_db(&db, &["operator", "create", "alice"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(token.lines().count(), 1);
    assert!(token.trim().len() >= 43, "{token}");
    let (code, _, err) = run_db(&db, &["operator", "create", "alice"]);
    one_line_error(code, &err, "exists");
    let (code, _, err) = run_db(&db, &["operator", "create", "no spaces"]);
    one_line_error(code, &err, "operator name");
    let (code, out, _) = run_db(&db, &["operator", "list", "--json"]);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["operators"][0]["name"], "alice");
    assert!(v["operators"][0]["revoked_at"].is_null());
    // The token is shown once and never listed.
    assert!(!out.contains(token.trim()));
    let (code, _, err) = run_db(&db, &["operator", "revoke", "alice"]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = run_db(&db, &["operator", "revoke", "alice"]);
    one_line_error(code, &err, "already revoked");
    let (_, out, _) = run_db(&db, &["operator", "list"]);
    assert!(out.contains("revoked"), "{out}");

    let (code, out, err) = run_db(&db, &["queue", "pause", "ci"]);
    assert_eq!((code, out.trim()), (0, "paused ci"), "{err}");
    let (_, out, _) = run_db(&db, &["queue", "paused", "--json"]);
    assert_eq!(out.trim(), r#"{"paused":["ci"]}"#);
    let (code, _, err) = run_db(&db, &["queue", "pause", "bad queue"]);
    one_line_error(code, &err, "queue");
    let (code, out, _) = run_db(&db, &["queue", "resume", "ci"]);
    assert_eq!((code, out.trim()), (0, "resumed ci"));
    let (_, out, _) = run_db(&db, &["queue", "paused", "--json"]);
    assert_eq!(out.trim(), r#"{"paused":[]}"#);

    // Flow limits: set, shown, lifted; a bad value is one line naming the flag and changes
    // nothing.
    let set = [
        "queue",
        "set",
        "ci",
        "--max-claimed",
        "3",
        "--max-claimed-per-key",
        "1",
    ];
    let (code, out, err) = run_db(&db, &set);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim(), "ci: max_claimed 3, max_claimed_per_key 1");
    let (_, shown, _) = run_db(&db, &["queue", "show", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&shown).unwrap();
    let line = &v["queues"][0];
    assert_eq!(line["queue"], "ci", "{v}");
    assert_eq!(line["max_claimed"], 3, "{v}");
    assert_eq!(line["max_claimed_per_key"], 1, "{v}");
    assert!(line["claims_per_minute"].is_null(), "{v}");
    assert_eq!(
        (&line["claimed"], &line["held_back"]),
        (&0.into(), &0.into())
    );
    let bad: [(&[&str], &str); 5] = [
        (&["queue", "set", "ci", "--max-claimed", "0"], "max_claimed"),
        (
            &["queue", "set", "ci", "--claims-per-minute", "-1"],
            "--claims-per-minute",
        ),
        (
            &["queue", "set", "ci", "--max-claimed-per-key", "lots"],
            "--max-claimed-per-key",
        ),
        (&["queue", "set", "ci"], "name a limit"),
        (
            &["queue", "set", "bad queue", "--max-claimed", "1"],
            "queue",
        ),
    ];
    for (args, needle) in bad {
        let (code, _, err) = run_db(&db, args);
        one_line_error(code, &err, needle);
    }
    let (_, again, _) = run_db(&db, &["queue", "show", "--json"]);
    assert_eq!(again, shown, "a refused change changed nothing");
    let (code, out, _) = run_db(&db, &["queue", "set", "ci", "--max-claimed", "none"]);
    assert_eq!((code, out.trim()), (0, "ci: max_claimed_per_key 1"));
    let (_, out, _) = run_db(&db, &["queue", "show"]);
    assert!(
        out.lines().nth(1).is_some_and(|l| l.starts_with("ci ")),
        "{out}"
    );
    let (code, out, _) = run_db(
        &db,
        &["queue", "set", "ci", "--max-claimed-per-key", "none"],
    );
    assert_eq!((code, out.trim()), (0, "ci: no limits"));
    let (_, out, _) = run_db(&db, &["queue", "show"]);
    assert_eq!(out.trim(), "no queue has limits or is paused");
}

#[test]
fn endpoint_and_todo_commands_round_trip_on_sqlite() {
    let tmp = temp_dir("operator");
    let dir = tmp.path();
    let db = format!("sqlite:{}", dir.join("relay.db").display());

    // create: the token, one line, shown once; `--db` and RELAY_DB both name the store.
    let (code, token, err) = run(&[
        "--db",
        &db,
        "endpoint",
        "create",
        "ci",
        "--verbs",
        "claim_next,complete,list_todos",
        "--queues",
        "ci,ops",
    ]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(token.lines().count(), 1);
    assert!(token.trim().len() >= 43, "{token}");
    let (code, _, err) = run_db(&db, &["endpoint", "create", "ci", "--verbs", "claim"]);
    one_line_error(code, &err, "exists");
    let (code, _, err) = run_db(&db, &["endpoint", "create", "x", "--verbs", "claim,fly"]);
    one_line_error(code, &err, "\"fly\"");

    let (code, out, _) = run_db(&db, &["endpoint", "list", "--json"]);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["endpoints"][0]["name"], "ci");
    assert_eq!(
        v["endpoints"][0]["queues"],
        serde_json::json!(["ci", "ops"])
    );
    assert!(
        !out.contains(token.trim()),
        "the token is never shown again"
    );

    // todo add / list / show / cancel / retry.
    let (code, id, err) = todo_add(
        &db,
        "ci",
        "ci",
        "fix the build",
        &["--payload", r#"{"pr": 7}"#, "--max-attempts", "3"],
    );
    assert_eq!(code, 0, "{err}");
    let id = id.trim().to_string();
    assert!(id.starts_with("td_"), "{id}");
    let (code, _, err) = todo_add(&db, "ci", "elsewhere", "x", &[]);
    one_line_error(code, &err, "not granted");
    let (code, _, err) = todo_add(&db, "ci", "ci", "x", &["--payload", "{"]);
    one_line_error(code, &err, "--payload");
    let (code, _, err) = todo_add(&db, "nobody", "ci", "x", &[]);
    one_line_error(code, &err, "relay endpoint list");

    // Order and schedule: a negative priority is a value, not a flag; bad ones are one line
    // naming the flag, and add nothing.
    let (code, low, err) = todo_add(&db, "ci", "ops", "low", &["--priority", "-7"]);
    assert_eq!(code, 0, "{err}");
    let keyed = ["--delay-seconds", "600", "--concurrency-key", "repo-a"];
    let (code, later, err) = todo_add(&db, "ci", "ops", "later", &keyed);
    assert_eq!(code, 0, "{err}");
    let long_key = "k".repeat(129);
    for (flags, needle) in [
        (
            &["--concurrency-key", long_key.as_str()][..],
            "concurrency_key",
        ),
        (&["--priority", "101"][..], "priority"),
        (&["--run-at", "tomorrow"][..], "--run-at"),
        (
            &["--run-at", "2026-12-24T09:00:00Z", "--delay-seconds", "5"][..],
            "not both",
        ),
        (&["--delay-seconds", "40000000"][..], "delay_seconds"),
    ] {
        let (code, _, err) = todo_add(&db, "ci", "ops", "bad", flags);
        one_line_error(code, &err, needle);
    }
    let (_, out, _) = run_db(&db, &["todo", "list", "--json", "--queue", "ops"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let ops = v["todos"].as_array().unwrap();
    assert_eq!(ops.len(), 2, "{out}");
    let of = |id: &str| ops.iter().find(|t| t["id"] == id.trim()).unwrap().clone();
    assert_eq!(of(&low)["priority"], -7);
    assert_eq!(of(&low)["run_at"], serde_json::Value::Null);
    assert!(of(&later)["run_at"].as_str().is_some(), "{out}");
    assert_eq!(of(&later)["concurrency_key"], "repo-a", "{out}");

    let (code, out, _) = run_db(&db, &["todo", "list", "--json", "--endpoint", "ci"]);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["todos"][0]["id"], id.as_str());
    assert_eq!(v["todos"][0]["payload"]["pr"], 7);
    let (_, out, _) = run_db(&db, &["todo", "list", "--state", "done", "--json"]);
    assert_eq!(out.trim(), r#"{"todos":[]}"#);
    let (code, _, err) = run_db(&db, &["todo", "list", "--state", "lost"]);
    one_line_error(code, &err, "--state");
    let (code, out, _) = run_db(&db, &["todo", "list"]);
    assert_eq!(code, 0);
    assert!(out.contains(&id) && out.contains("fix the build"), "{out}");

    let (code, out, _) = run_db(&db, &["todo", "cancel", &id]);
    assert_eq!(code, 0);
    assert_eq!(out.trim(), format!("{id}: canceled"));
    let (code, _, err) = run_db(&db, &["todo", "cancel", &id]);
    assert_ne!(code, 0);
    assert_eq!(err.lines().count(), 1, "{err}");
    let (code, out, _) = run_db(&db, &["todo", "retry", &id]);
    assert_eq!(code, 0);
    assert_eq!(out.trim(), format!("{id}: pending"));

    let (code, out, _) = run_db(&db, &["todo", "show", &id, "--json"]);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["todo"]["state"], "pending");
    assert_eq!(v["todo"]["endpoint"], "ci");
    assert_eq!(v["attempts"], serde_json::json!([]));
    let (code, out, _) = run_db(&db, &["todo", "show", &id]);
    assert_eq!(code, 0);
    assert!(out.contains("attempts (newest first)"), "{out}");
    let (code, _, err) = run_db(&db, &["todo", "show", "td_missing"]);
    one_line_error(code, &err, "relay todo list");

    // revoke, then again.
    let (code, out, _) = run_db(&db, &["endpoint", "revoke", "ci"]);
    assert_eq!(code, 0);
    assert!(out.contains("revoked ci"), "{out}");
    let (code, _, err) = run_db(&db, &["endpoint", "revoke", "ci"]);
    one_line_error(code, &err, "already revoked");
    let (_, out, _) = run_db(&db, &["endpoint", "list"]);
    assert!(out.contains("revoked"), "{out}");

    // A database URL the store does not know.
    let (code, _, err) = run(&["--db", "mysql://x", "todo", "list"]);
    one_line_error(code, &err, "sqlite:PATH");
}

/// One HTTP/1.1 exchange over a fresh connection: (status, headers, body).
fn http(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, head.to_ascii_lowercase(), body.to_string())
}

#[test]
fn serve_prints_its_address_serves_mcp_and_stops_gracefully_on_sigterm() {
    let tmp = temp_dir("serve");
    let dir = tmp.path();
    let db = format!("sqlite:{}", dir.join("relay.db").display());
    let (_, token, _) = run_db(
        &db,
        &["endpoint", "create", "ci", "--verbs", "claim_next,complete"],
    );
    let token = token.trim().to_string();
    let (_, id, _) = todo_add(&db, "ci", "ci", "t", &[]);
    let id = id.trim().to_string();

    let (child, base) = serve("127.0.0.1:0", &db, &[], std::process::Stdio::piped());
    let addr = base
        .strip_prefix("http://")
        .unwrap_or_else(|| panic!("listening on {base:?}"))
        .to_string();
    assert!(!addr.ends_with(":0"), "{addr}");

    let (status, _, body) = http(&addr, "GET", "/healthz", &[], "");
    assert_eq!((status, body.as_str()), (200, "ok\n"));
    let auth = format!("Bearer {token}");
    let (status, head, _) = http(
        &addr,
        "POST",
        "/mcp/ci",
        &[
            ("Authorization", &auth),
            ("Content-Type", "application/json"),
        ],
        r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18"}}"#,
    );
    assert_eq!(status, 200);
    let session = head
        .lines()
        .find_map(|l| l.strip_prefix("mcp-session-id: "))
        .unwrap()
        .trim()
        .to_string();
    let (status, _, body) = http(
        &addr,
        "POST",
        "/mcp/ci",
        &[("Authorization", &auth), ("Mcp-Session-Id", &session)],
        r#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"claim_next","arguments":{}}}"#,
    );
    assert_eq!(status, 200);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["result"]["structuredContent"]["todo"]["id"], id.as_str());
    let (status, _, _) = http(
        &addr,
        "POST",
        "/mcp/ci",
        &[("Authorization", "Bearer wrong")],
        r#"{"jsonrpc":"2.0","id":3,"method":"ping"}"#,
    );
    assert_eq!(status, 401);

    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let out = rx
        .recv_timeout(std::time::Duration::from_secs(20))
        .expect("relay serve stops on SIGTERM")
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let logs = String::from_utf8(out.stderr).unwrap();
    assert!(logs.contains("stopped"), "{logs}");
    assert!(!logs.contains(&token), "no token in logs");
}

#[test]
fn serve_refuses_an_address_it_cannot_bind_in_one_line() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (code, out, err) = run(&["--db", "sqlite::memory:", "serve", "--listen", &addr]);
    assert!(out.is_empty());
    one_line_error(code, &err, "--listen");
}

#[test]
fn a_reader_that_went_away_ends_the_output_quietly() {
    // `relay sim … | head`: stdout's reader is gone before the first line is written.
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = relay()
        .args(["sim", "--seed", "0"])
        .stdout(writer)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// The README stays a page a newcomer reads (≤ 350 lines) and links every page of docs/; every
/// relative link in it and in docs/ names a file that exists; no page points at documents the
/// repository does not hold (the spec's requirement numbers or its file names).
#[test]
fn the_readme_is_short_links_every_docs_page_and_no_link_dangles() {
    let root = common::repo();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    assert!(
        readme.lines().count() <= 350,
        "README.md has {} lines; move detail into docs/",
        readme.lines().count()
    );
    let mut pages = vec![("README.md".to_string(), readme.clone())];
    for entry in std::fs::read_dir(root.join("docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            assert!(
                readme.contains(&format!("](docs/{name})")),
                "README.md does not link docs/{name}"
            );
            pages.push((
                format!("docs/{name}"),
                std::fs::read_to_string(&path).unwrap(),
            ));
        }
    }
    for (name, text) in &pages {
        let base = root.join(name).parent().unwrap().to_path_buf();
        for link in text.split("](").skip(1) {
            let target = link.split(')').next().unwrap();
            let file = target.split('#').next().unwrap();
            if file.is_empty() || file.contains("://") {
                continue;
            }
            assert!(
                base.join(file).exists(),
                "{name}: the link {target} dangles"
            );
        }
        for outside in [
            "REQ-",
            "relay-design",
            "relay-spec",
            "attempt-history",
            "Switchboard",
        ] {
            assert!(
                !text.contains(outside),
                "{name} refers to {outside:?}, which this repository does not hold; say it \
                 in docs/contract.md in our own words"
            );
        }
    }
}
