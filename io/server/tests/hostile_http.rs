//! The queue server under hostile clients (issue 13, items 3, 4, 6, 7): half-sent and silent
//! connections, slow bodies, connection floods, session and stream floods, shutdown with a
//! stuck request. Raw TCP on 127.0.0.1 so each test says exactly what bytes the client sends.
//!
//! Timeouts are configured short (hundreds of milliseconds) so the tests are quick; every wait
//! is for an observable event (a close, an answer, `serve` returning) under a 10 s failure
//! bound, never a sleep.

#[path = "support/harness.rs"]
mod harness;

use std::sync::Arc;
use std::time::Duration;

use harness::{BOUND, Harness};
use relay_core::ledger::LedgerConfig;
use relay_server::server::ServerConfig;
use relay_server::store::Store;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

/// Long enough never to fire during a test that is about another limit.
const LONG: Duration = Duration::from_secs(600);

/// The full `serve` (accept loop, timeouts, caps) on a loopback port, SQLite in memory.
async fn start(tweak: impl FnOnce(&mut ServerConfig)) -> Harness {
    let store = Store::open("sqlite::memory:", LedgerConfig::default())
        .await
        .unwrap();
    let config = |c: &mut ServerConfig| {
        c.header_read_timeout = LONG;
        c.idle_timeout = LONG;
        c.body_timeout = LONG;
        c.shutdown_grace = LONG;
        tweak(c);
    };
    Harness::start_on(store, 3, config, true).await
}

/// The verbs every endpoint of these tests is granted.
const VERBS: &[&str] = &["claim_next", "list_todos"];

impl Harness {
    async fn connect(&self) -> TcpStream {
        TcpStream::connect(self.addr).await.unwrap()
    }

    /// One whole request on a fresh connection (`Connection: close`); the whole answer.
    async fn send(&self, raw: &str) -> String {
        let mut s = self.connect().await;
        s.write_all(raw.as_bytes()).await.unwrap();
        read_to_close(&mut s).await
    }

    /// `initialize` for `endpoint`: the answer, status line first.
    async fn initialize(&self, endpoint: &str, token: &str) -> String {
        let body = r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"hostile","version":"0"}}}"#;
        self.send(&format!(
            "POST /mcp/{endpoint} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n\
             Content-Type: application/json\r\nAccept: application/json, text/event-stream\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        ))
        .await
    }
}

/// Reads until the peer closes (bounded): what a client sees of a connection's end.
async fn read_to_close(s: &mut TcpStream) -> String {
    let mut out = Vec::new();
    let read = tokio::time::timeout(BOUND, async {
        let mut buf = [0u8; 4096];
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    assert!(
        read.is_ok(),
        "the server kept the connection open past the bound; got so far: {:?}",
        String::from_utf8_lossy(&out)
    );
    String::from_utf8_lossy(&out).into_owned()
}

/// Reads one response head (up to the blank line), bounded.
async fn read_head(s: &mut TcpStream) -> String {
    let mut out = Vec::new();
    tokio::time::timeout(BOUND, async {
        let mut b = [0u8; 1];
        while !out.ends_with(b"\r\n\r\n") {
            match s.read(&mut b).await {
                Ok(0) | Err(_) => break,
                Ok(_) => out.push(b[0]),
            }
        }
    })
    .await
    .expect("a response head within the bound");
    String::from_utf8_lossy(&out).into_owned()
}

fn session_of(answer: &str) -> String {
    answer
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("mcp-session-id: ")
                .map(|v| v.trim().to_string())
        })
        .unwrap_or_else(|| panic!("no session id in {answer:?}"))
}

#[tokio::test]
async fn shutdown_drops_a_half_sent_request_after_the_grace() {
    let mut r = start(|c| c.shutdown_grace = Duration::from_millis(200)).await;
    let mut stuck = r.connect().await;
    stuck
        .write_all(b"POST /mcp/x HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n")
        .await
        .unwrap();
    // A whole request on another connection proves the server has accepted (it accepts in order).
    let ok = r
        .send("GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        .await;
    assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
    r.stop_and_wait().await.unwrap();
    // The stuck client sees its connection end.
    read_to_close(&mut stuck).await;
}

#[tokio::test]
async fn a_half_sent_header_is_closed_after_the_header_read_timeout() {
    let r = start(|c| c.header_read_timeout = Duration::from_millis(300)).await;
    let mut s = r.connect().await;
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        .await
        .unwrap();
    let seen = read_to_close(&mut s).await;
    assert!(!seen.contains("200"), "{seen}");
}

#[tokio::test]
async fn a_silent_connection_and_an_idle_keep_alive_are_closed() {
    let r = start(|c| c.idle_timeout = Duration::from_millis(300)).await;
    let mut silent = r.connect().await;
    assert_eq!(read_to_close(&mut silent).await, "");
    let mut kept = r.connect().await;
    kept.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .await
        .unwrap();
    let seen = read_to_close(&mut kept).await;
    assert!(seen.starts_with("HTTP/1.1 200"), "{seen}");
}

#[tokio::test]
async fn a_body_that_does_not_arrive_is_answered_408() {
    let r = start(|c| c.body_timeout = Duration::from_millis(300)).await;
    let token = r.endpoint("ep", VERBS, None).await;
    let mut s = r.connect().await;
    s.write_all(
        format!(
            "POST /mcp/ep HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n\
             Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"jsonrpc\""
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let head = read_head(&mut s).await;
    assert!(head.starts_with("HTTP/1.1 408"), "{head}");
}

#[tokio::test]
async fn connections_over_the_cap_are_refused_at_once() {
    let r = start(|c| c.max_connections = 2).await;
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(r.connect().await);
    }
    // Until both held connections are accepted, a third may still get in: wait (bounded)
    // until one is refused.
    let deadline = tokio::time::Instant::now() + BOUND;
    let refused = loop {
        let seen = r
            .send("GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            .await;
        if seen.starts_with("HTTP/1.1 503") {
            break seen;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never refused: {seen}"
        );
    };
    assert!(refused.contains("too many open connections"), "{refused}");
    // Closing one frees its slot.
    drop(held.pop());
    let deadline = tokio::time::Instant::now() + BOUND;
    loop {
        let seen = r
            .send("GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            .await;
        if seen.starts_with("HTTP/1.1 200") {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "slot never freed");
    }
}

#[tokio::test]
async fn sessions_are_capped_per_endpoint_and_in_total() {
    let r = start(|c| {
        c.max_sessions_per_endpoint = 2;
        c.max_sessions = 3;
    })
    .await;
    let a = r.endpoint("a", VERBS, None).await;
    let b = r.endpoint("b", VERBS, None).await;
    let mut sessions = Vec::new();
    for _ in 0..2 {
        let ok = r.initialize("a", &a).await;
        assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
        sessions.push(session_of(&ok));
        r.clock.advance(1_000);
    }
    // At the endpoint's cap, a client that never ended its sessions is not locked out: the
    // least recently used one (without a doorbell stream) makes room, and is gone at once.
    let third = r.initialize("a", &a).await;
    assert!(third.starts_with("HTTP/1.1 200"), "{third}");
    let list = |session: &str| {
        format!(
            "POST /mcp/a HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {a}\r\n\
             Content-Type: application/json\r\nMcp-Session-Id: {session}\r\n\
             Content-Length: 46\r\nConnection: close\r\n\r\n\
             {{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"tools/list\"}}"
        )
    };
    let gone = r.send(&list(&sessions[0])).await;
    assert!(gone.starts_with("HTTP/1.1 404"), "{gone}");
    let kept = r.send(&list(&sessions[1])).await;
    assert!(kept.starts_with("HTTP/1.1 200"), "{kept}");
    // The total cap ends nobody's session.
    assert!(r.initialize("b", &b).await.starts_with("HTTP/1.1 200"));
    let full = r.initialize("b", &b).await;
    assert!(full.starts_with("HTTP/1.1 503"), "{full}");
    assert!(full.contains("maximum of 3 sessions"), "{full}");
}

/// A session that holds a doorbell stream is never ended to make room: at the cap with every
/// session streaming, initialize is refused, and the streaming session still answers.
#[tokio::test]
async fn a_session_with_a_stream_is_not_ended_for_room() {
    let r = start(|c| c.max_sessions_per_endpoint = 1).await;
    let token = r.endpoint("ep", VERBS, None).await;
    let first = session_of(&r.initialize("ep", &token).await);
    let mut stream = r.connect().await;
    let get = format!(
        "GET /mcp/ep HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n\
         Accept: text/event-stream\r\nMcp-Session-Id: {first}\r\n\r\n"
    );
    stream.write_all(get.as_bytes()).await.unwrap();
    let head = read_head(&mut stream).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    r.clock.advance(1_000);
    let over = r.initialize("ep", &token).await;
    assert!(over.starts_with("HTTP/1.1 503"), "{over}");
    assert!(over.contains("doorbell stream"), "{over}");
    drop(stream);
}

#[tokio::test]
async fn doorbell_streams_are_capped() {
    let r = start(|c| c.max_streams = 1).await;
    let token = r.endpoint("ep", VERBS, None).await;
    let open = |session: String| {
        format!(
            "GET /mcp/ep HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n\
             Accept: text/event-stream\r\nMcp-Session-Id: {session}\r\n\r\n"
        )
    };
    let first = session_of(&r.initialize("ep", &token).await);
    let second = session_of(&r.initialize("ep", &token).await);
    let mut s1 = r.connect().await;
    s1.write_all(open(first).as_bytes()).await.unwrap();
    let head = read_head(&mut s1).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let mut s2 = r.connect().await;
    s2.write_all(open(second).as_bytes()).await.unwrap();
    let head = read_head(&mut s2).await;
    assert!(head.starts_with("HTTP/1.1 503"), "{head}");
}

/// A log sink for one test: the subscriber is the thread's default, and `#[tokio::test]` runs
/// the server's tasks on that one thread.
#[derive(Clone, Default)]
struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

#[tokio::test]
async fn path_text_never_reaches_the_log_raw_and_401s_are_throttled() {
    let sink = Captured::default();
    let writer = sink.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let r = start(|_| {}).await;
    let forged = "x%0A2026-01-01T00:00:00Z%20INFO%20forged%1B[2J%E2%80%AE";
    for _ in 0..20 {
        let seen = r
            .send(&format!(
                "POST /mcp/{forged} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer nope\r\n\
                 Content-Length: 2\r\nConnection: close\r\n\r\n{{}}"
            ))
            .await;
        assert!(seen.starts_with("HTTP/1.1 401"), "{seen}");
    }
    // A foreign Host is logged too: the same escaping.
    let seen = r
        .send(&format!(
            "GET /mcp/{forged} HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n"
        ))
        .await;
    assert!(seen.starts_with("HTTP/1.1 403"), "{seen}");
    let log = sink.text();
    assert!(!log.contains('\u{1b}'), "raw ESC in the log: {log:?}");
    assert!(
        !log.contains('\u{202e}'),
        "raw bidi override in the log: {log:?}"
    );
    assert!(
        !log.lines()
            .any(|l| l.contains("forged") && !l.contains("refused")),
        "a forged line: {log:?}"
    );
    let refusals = log
        .lines()
        .filter(|l| l.contains("unknown endpoint, revoked, or wrong token"))
        .count();
    assert_eq!(refusals, 1, "20 refusals in one window log one line: {log}");
    assert!(log.contains("Host header not allowed"), "{log}");
}

#[tokio::test]
async fn metrics_and_healthz_refuse_a_foreign_host() {
    let r = start(|_| {}).await;
    for path in ["/metrics", "/healthz"] {
        let seen = r
            .send(&format!(
                "GET {path} HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n"
            ))
            .await;
        assert!(seen.starts_with("HTTP/1.1 403"), "{path}: {seen}");
        let seen = r
            .send(&format!(
                "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
            ))
            .await;
        assert!(seen.starts_with("HTTP/1.1 200"), "{path}: {seen}");
    }
}

/// The full `serve` on a SQLite file in `dir`.
async fn start_on_file(dir: &std::path::Path) -> Harness {
    let url = format!("sqlite:{}", dir.join("relay.db").display());
    let store = Store::open(&url, LedgerConfig::default()).await.unwrap();
    Harness::start_on(store, 3, |_| {}, true).await
}

#[tokio::test]
async fn healthz_is_503_while_the_sqlite_file_is_write_locked() {
    let dir = tempfile::tempdir().unwrap();
    let r = start_on_file(dir.path()).await;
    let get = "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
    assert!(r.send(get).await.starts_with("HTTP/1.1 200"));
    // Another process's writer, as far as SQLite can tell.
    let locker = rusqlite::Connection::open(dir.path().join("relay.db")).unwrap();
    locker.execute_batch("BEGIN IMMEDIATE").unwrap();
    let seen = r.send(get).await;
    assert!(seen.starts_with("HTTP/1.1 503"), "{seen}");
    locker.execute_batch("ROLLBACK").unwrap();
    assert!(r.send(get).await.starts_with("HTTP/1.1 200"));
}

#[tokio::test]
async fn the_sqlite_file_and_its_wal_and_shm_are_private() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::tempdir().unwrap();
    let r = start_on_file(dir.path()).await;
    r.endpoint("ep", VERBS, None).await;
    for name in ["relay.db", "relay.db-wal", "relay.db-shm"] {
        let mode = std::fs::metadata(dir.path().join(name))
            .unwrap_or_else(|e| panic!("{name}: {e}"))
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "{name} is {:o}", mode & 0o777);
    }
}
