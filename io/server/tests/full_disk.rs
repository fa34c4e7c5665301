//! The queue server on a full disk (issue 36, storage faults): SQLite on a real, small tmpfs that
//! the test fills. Writes fail with a clear error, reads over MCP still answer (checking a
//! session needs no write), `/healthz` is 503 naming the store and the reason, nothing
//! acknowledged is lost, and once space returns writes work and `/healthz` is 200 again.
//!
//! Mounting needs root: without it the test is skipped, saying so, unless
//! `RELAY_REQUIRE_TMPFS=1` (CI), where it fails instead. Time is a `ManualClock`; every wait is
//! bounded by `BOUND` as a failure bound, never a sleep.

#[path = "support/harness.rs"]
mod harness;

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use harness::{ALL_VERBS, BOUND, Harness, Mcp};
use relay_core::ledger::LedgerConfig;
use relay_server::server::SESSION_RECHECK;
use relay_server::store::Store;
use serde_json::{Value, json};

/// A tmpfs of `size` mounted on a fresh temporary directory, unmounted when dropped.
struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    /// `None` (after saying why) when it cannot be mounted and `RELAY_REQUIRE_TMPFS` is not `1`.
    fn mount(size: &str) -> Option<Tmpfs> {
        let dir = tempfile::tempdir().unwrap();
        let out = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "tmpfs",
            ])
            .arg(dir.path())
            .output();
        let why = match out {
            Ok(o) if o.status.success() => return Some(Tmpfs { dir }),
            Ok(o) => String::from_utf8_lossy(&o.stderr).trim().to_string(),
            Err(e) => format!("mount: {e}"),
        };
        assert!(
            std::env::var("RELAY_REQUIRE_TMPFS").as_deref() != Ok("1"),
            "RELAY_REQUIRE_TMPFS=1 but a tmpfs could not be mounted ({why}); run as root"
        );
        eprintln!("SKIPPED: a tmpfs could not be mounted ({why}); run as root to test a full disk");
        None
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let plain = Command::new("umount").arg(self.dir.path()).status();
        if !plain.is_ok_and(|s| s.success()) {
            // Files still open (a store thread not yet gone): detach it now, freed when closed.
            let _ = Command::new("umount")
                .arg("-l")
                .arg(self.dir.path())
                .status();
        }
    }
}

/// Fills the filesystem of `dir` with one file of zeros until it takes no more; the file.
fn fill(dir: &Path) -> PathBuf {
    let path = dir.join("filler");
    let mut f = std::fs::File::create(&path).unwrap();
    let chunk = vec![0u8; 64 * 1024];
    loop {
        match f.write(&chunk) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(28) => break, // ENOSPC
            Err(e) => panic!("filling {}: {e}", path.display()),
        }
    }
    path
}

/// A request under the failure bound: a hang fails the test.
async fn rpc(c: &mut Mcp, method: &str, params: Value) -> (u16, Value) {
    tokio::time::timeout(BOUND, c.rpc(method, params))
        .await
        .unwrap_or_else(|_| panic!("{method} did not answer within {BOUND:?}"))
}

/// `/healthz`: status and body.
async fn healthz(h: &Harness) -> (u16, String) {
    let r = tokio::time::timeout(BOUND, h.http.get(format!("{}/healthz", h.base)).send())
        .await
        .expect("healthz answered within the bound")
        .unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

/// The session's cached check lapses and its recorded use falls due for a write: the next
/// request goes to the store and tries to record its use.
fn make_the_session_check_go_to_the_store(h: &Harness) {
    let idle = relay_core::Millis::try_from(
        relay_server::server::ServerConfig::for_listen(h.addr)
            .session_idle_timeout
            .as_millis(),
    )
    .unwrap();
    h.clock
        .advance(relay_core::limits::session_touch_every(idle) + SESSION_RECHECK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_fails_writes_clearly_keeps_reads_and_recovers() {
    let Some(fs) = Tmpfs::mount("8m") else {
        return;
    };
    let url = format!("sqlite:{}", fs.path().join("relay.db").display());
    let store = Store::open(&url, LedgerConfig::default()).await.unwrap();
    let h = Harness::start_on(store, 5, |_| {}, false).await;
    let token = h.endpoint("ci", ALL_VERBS, None).await;
    let mut c = h.mcp("ci", &token);
    c.init().await;

    // Acknowledged: three todos added, two of them claimed.
    let mut acked = Vec::new();
    for title in ["a", "b", "c"] {
        let added = c
            .ok("add_todo", json!({"queue": "q", "title": title}))
            .await;
        acked.push(added["id"].as_str().unwrap().to_string());
    }
    for id in &acked[..2] {
        c.ok("claim", json!({"id": id})).await;
    }
    assert_eq!(healthz(&h).await, (200, "ok\n".to_string()));

    let filler = fill(fs.path());

    // A write: a clear error at once (an error id for the operator, no store text).
    let (status, v) = rpc(
        &mut c,
        "tools/call",
        json!({"name": "add_todo", "arguments": {"queue": "q", "title": "d"}}),
    )
    .await;
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        status == 200 && message.contains("internal error (error id err_"),
        "{status} {v}"
    );
    assert!(!message.contains("disk is full"), "no store text: {v}");

    // Reads: each with the session's check due in the store and its use due for a write.
    make_the_session_check_go_to_the_store(&h);
    let (status, v) = rpc(&mut c, "tools/list", json!({})).await;
    assert_eq!(status, 200, "tools/list: {v}");
    assert!(v["result"]["tools"].is_array(), "tools/list: {v}");
    for id in &acked {
        make_the_session_check_go_to_the_store(&h);
        let (status, v) = rpc(
            &mut c,
            "tools/call",
            json!({"name": "get_todo", "arguments": {"id": id}}),
        )
        .await;
        assert_eq!(status, 200, "get_todo: {v}");
        assert_eq!(v["result"]["isError"], false, "get_todo {id}: {v}");
        make_the_session_check_go_to_the_store(&h);
        let uri = format!("relay://todos/{id}");
        let (status, v) = rpc(&mut c, "resources/read", json!({"uri": uri})).await;
        assert_eq!(status, 200, "resources/read: {v}");
        assert!(v["result"]["contents"].is_array(), "resources/read: {v}");
    }
    make_the_session_check_go_to_the_store(&h);
    let (status, v) = rpc(
        &mut c,
        "tools/call",
        json!({"name": "list_todos", "arguments": {"queue": "q"}}),
    )
    .await;
    assert_eq!(status, 200, "list_todos: {v}");
    let listed = &v["result"]["structuredContent"]["todos"];
    assert_eq!(
        ids(listed),
        sorted(&acked),
        "every acknowledged todo, nothing else: {v}"
    );
    let claimed = listed
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["state"] == "claimed")
        .count();
    assert_eq!(claimed, 2, "both claims kept: {v}");

    // Health: 503, naming the store and the reason.
    let (status, body) = healthz(&h).await;
    assert_eq!(status, 503, "{body}");
    let body: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
    assert_eq!(body["status"], "unavailable", "{body}");
    assert_eq!(body["store"], "sqlite", "{body}");
    let reason = body["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("sqlite store cannot write") && reason.contains("disk is full"),
        "{body}"
    );

    // Space returns: writes work again, health is back, nothing was lost.
    std::fs::remove_file(&filler).unwrap();
    assert_eq!(healthz(&h).await, (200, "ok\n".to_string()));
    let added = c.ok("add_todo", json!({"queue": "q", "title": "e"})).await;
    acked.push(added["id"].as_str().unwrap().to_string());
    c.ok("claim", json!({"id": acked[2]})).await;
    let listed = c.ok("list_todos", json!({"queue": "q"})).await;
    assert_eq!(ids(&listed["todos"]), sorted(&acked), "{listed}");
    drop(h);
}

/// The ids of a `list_todos` answer's todos, sorted.
fn ids(todos: &Value) -> Vec<String> {
    let mut ids: Vec<String> = todos
        .as_array()
        .unwrap_or_else(|| panic!("a list of todos: {todos}"))
        .iter()
        .map(|t| t["id"].as_str().unwrap().to_string())
        .collect();
    ids.sort();
    ids
}

fn sorted(ids: &[String]) -> Vec<String> {
    let mut ids = ids.to_vec();
    ids.sort();
    ids
}
