//! The real `relay` binary against hostile data (issue 13): worker- and client-written text
//! reaches the operator's terminal escaped (`--json` stays exact), the SQLite file is private,
//! and `relay serve` speaks TLS from PEM files.

use std::process::Command;

fn relay() -> Command {
    Command::new(env!("CARGO_BIN_EXE_relay"))
}

fn temp_dir(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("relay-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn run_db(db: &str, args: &[&str]) -> (i32, String, String) {
    let out = relay()
        .args(args)
        .env("RELAY_DB", db)
        .output()
        .expect("run relay");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8(out.stdout).expect("utf-8 stdout"),
        String::from_utf8(out.stderr).expect("utf-8 stderr"),
    )
}

/// No raw terminal control or bidi override in text meant for a terminal.
fn assert_inert(what: &str, text: &str) {
    for c in ['\u{1b}', '\u{202e}', '\u{2028}', '\u{7}'] {
        assert!(!text.contains(c), "{what} carries {c:?} raw: {text:?}");
    }
}

#[test]
fn operator_text_output_escapes_controls_and_bidi_and_json_stays_exact() {
    let dir = temp_dir("hostile-text");
    let db = format!("sqlite:{}", dir.join("relay.db").display());
    let (code, _, err) = run_db(&db, &["endpoint", "create", "ci", "--verbs", "claim_next"]);
    assert_eq!(code, 0, "{err}");
    // Titles refuse C0 controls already; the bidi override and the line separator got through.
    let title = "fix the \u{202e}build\u{2028}now";
    let (code, id, err) = run_db(
        &db,
        &[
            "todo",
            "add",
            "--endpoint",
            "ci",
            "--queue",
            "ci",
            "--title",
            title,
            "--payload",
            "{\"note\": \"\u{202e}evil\u{2028}\"}",
        ],
    );
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
