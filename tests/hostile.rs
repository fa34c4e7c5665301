//! The real `relay` binary against hostile data (issue 13): worker- and client-written text
//! reaches the operator's terminal escaped (`--json` stays exact), the SQLite file is private,
//! and `relay serve` speaks TLS from PEM files.

use std::process::Command;

mod common;
use common::{relay, run_db, temp_dir, todo_add};

/// No raw terminal control or bidi override in text meant for a terminal.
fn assert_inert(what: &str, text: &str) {
    for c in ['\u{1b}', '\u{202e}', '\u{2028}', '\u{7}'] {
        assert!(!text.contains(c), "{what} carries {c:?} raw: {text:?}");
    }
}

#[test]
fn operator_text_output_escapes_controls_and_bidi_and_json_stays_exact() {
    let tmp = temp_dir("hostile-text");
    let dir = tmp.path();
    let db = format!("sqlite:{}", dir.join("relay.db").display());
    let (code, _, err) = run_db(&db, &["endpoint", "create", "ci", "--verbs", "claim_next"]);
    assert_eq!(code, 0, "{err}");
    // Titles refuse C0 controls already; the bidi override and the line separator got through.
    let title = "fix the \u{202e}build\u{2028}now";
    let payload = "{\"note\": \"\u{202e}evil\u{2028}\"}";
    let (code, id, err) = todo_add(&db, "ci", "ci", title, &["--payload", payload]);
    assert_eq!(code, 0, "{err}");
    let id = id.trim().to_string();
    let (code, list, err) = run_db(&db, &["todo", "list"]);
    assert_eq!(code, 0, "{err}");
    assert_inert("todo list", &list);
    assert!(list.contains("\\u{202e}build"), "{list}");
    let (code, show, err) = run_db(&db, &["todo", "show", &id]);
    assert_eq!(code, 0, "{err}");
    assert_inert("todo show", &show);
    assert!(show.contains("\\u{2028}"), "{show}");
    let (code, json, err) = run_db(&db, &["todo", "show", &id, "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["todo"]["title"], title, "--json is exact");
    let (code, json, _) = run_db(&db, &["todo", "list", "--json"]);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["todos"][0]["title"], title, "--json is exact");
}

/// Starts `relay serve` with `args` on a free loopback port; the child and its ready line's
/// address (`scheme://host:port`).
fn serve(db: &str, args: &[&str]) -> (std::process::Child, String) {
    common::serve("127.0.0.1:0", db, args, std::process::Stdio::null())
}

/// Waits (bounded) for the child to exit; its exit code.
fn wait_exit(child: &mut std::process::Child) -> i32 {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status.code().unwrap_or(-1);
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("relay serve did not exit within 10 s");
        }
        // Polling the exit with a short pause between looks (the wait is for an event).
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

#[test]
fn serve_exits_zero_after_the_grace_with_a_half_sent_request() {
    use std::io::Write as _;
    let tmp = temp_dir("hostile-grace");
    let dir = tmp.path();
    let db = format!("sqlite:{}", dir.join("relay.db").display());
    let (mut child, base) = serve(&db, &["--shutdown-grace", "200ms"]);
    let addr = base.strip_prefix("http://").unwrap();
    let mut stuck = std::net::TcpStream::connect(addr).unwrap();
    stuck
        .write_all(b"POST /mcp/x HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{")
        .unwrap();
    // A whole request on another connection: the server has accepted the first by then.
    let mut ok = std::net::TcpStream::connect(addr).unwrap();
    ok.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut answer = String::new();
    std::io::Read::read_to_string(&mut ok, &mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    assert_eq!(wait_exit(&mut child), 0);
    drop(stuck);
}

#[test]
fn serve_speaks_tls_from_pem_files() {
    let tmp = temp_dir("hostile-tls");
    let dir = tmp.path();
    let db = format!("sqlite:{}", dir.join("relay.db").display());
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let cert_pem = cert.cert.pem();
    std::fs::write(dir.join("cert.pem"), &cert_pem).unwrap();
    std::fs::write(dir.join("key.pem"), cert.signing_key.serialize_pem()).unwrap();
    let (mut child, base) = serve(
        &db,
        &[
            "--tls-cert",
            dir.join("cert.pem").to_str().unwrap(),
            "--tls-key",
            dir.join("key.pem").to_str().unwrap(),
        ],
    );
    let port = base
        .strip_prefix("https://127.0.0.1:")
        .unwrap_or_else(|| panic!("an https ready line: {base}"));
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = reqwest::Client::builder()
        .tls_certs_only([reqwest::Certificate::from_pem(cert_pem.as_bytes()).unwrap()])
        .build()
        .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let body = rt.block_on(async {
        client
            .get(format!("https://localhost:{port}/healthz"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    });
    assert_eq!(body, "ok\n");
    // Plain http on the TLS port gets no answer that a client could take for one.
    let plain = rt.block_on(async {
        reqwest::Client::new()
            .get(format!("http://localhost:{port}/healthz"))
            .send()
            .await
    });
    assert!(plain.is_err() || !plain.unwrap().status().is_success());
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn serve_refuses_bad_limits_and_tls_files_in_one_line_naming_the_flag() {
    let tmp = temp_dir("hostile-flags");
    let dir = tmp.path();
    let db = format!("sqlite:{}", dir.join("relay.db").display());
    let missing = dir.join("missing.pem");
    let missing = missing.to_str().unwrap();
    for (args, needle) in [
        (vec!["--idle-timeout", "0s"], "--idle-timeout"),
        (vec!["--max-connections", "0"], "--max-connections"),
        (vec!["--body-timeout", "soon"], "--body-timeout"),
        (vec!["--tls-cert", missing], "required arguments"),
        (
            vec!["--tls-cert", missing, "--tls-key", missing],
            "--tls-cert",
        ),
    ] {
        let out = relay()
            .args(["serve", "--listen", "127.0.0.1:0"])
            .args(&args)
            .env("RELAY_DB", &db)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_ne!(out.status.code(), Some(0), "{args:?}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(out.stdout.is_empty(), "{args:?} never listened");
    }
}
