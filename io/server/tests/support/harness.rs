//! What the queue server's HTTP tests share (`server.rs`, `hostile_http.rs`,
//! `hostile_store.rs`): a server on a loopback port over a given store, endpoints vended in that
//! store, an MCP session client and the SSE reader. Each test file uses a part of it.
#![allow(dead_code)]

#[path = "pg_schema.rs"]
pub mod pg_schema;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use relay_core::Millis;
use relay_core::ledger::{LedgerConfig, TokenHash};
use relay_core::time::ManualClock;
use relay_server::server::{Server, ServerConfig};
use relay_server::store::{NewEndpoint, Store};
use serde_json::{Value, json};

/// SQLite in memory; or, with `RELAY_SERVER_TEST_DB=postgres`, a fresh schema on the server
/// `RELAY_TEST_POSTGRES` names (the store tests' convention; `.ci/postgres.sh` starts one).
pub async fn open_store() -> (Store, Option<(String, String)>) {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    if std::env::var("RELAY_SERVER_TEST_DB").as_deref() == Ok("postgres") {
        let url = std::env::var("RELAY_TEST_POSTGRES")
            .expect("RELAY_SERVER_TEST_DB=postgres needs RELAY_TEST_POSTGRES=postgres://…");
        let name = format!(
            "srv_{}_{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        let store =
            relay_server::store::PgStore::open_in_schema(&url, &name, LedgerConfig::default())
                .await
                .unwrap()
                // These tests drive leases, retries and sessions with a manual clock.
                .with_clock(relay_server::store::PgClock::Caller);
        return (Store::Postgres(store), Some((url, name)));
    }
    let store = Store::open("sqlite::memory:", LedgerConfig::default())
        .await
        .unwrap();
    (store, None)
}

/// A server over `open_store`'s store, dropped with the harness; `full_serve` as in
/// [`Harness::start_on`].
pub async fn start_with(tweak: impl FnOnce(&mut ServerConfig), full_serve: bool) -> Harness {
    let (store, pg_schema) = open_store().await;
    let mut h = Harness::start_on(store, 7, tweak, full_serve).await;
    h.pg_schema = pg_schema;
    h
}

pub const T0: Millis = 1_790_000_000_000;

/// A form body (`application/x-www-form-urlencoded`), every byte but the unreserved ones
/// percent-encoded.
pub fn form(pairs: &[(&str, &str)]) -> String {
    let enc = |v: &str| -> String {
        v.bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' => {
                    (b as char).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect()
    };
    let fields: Vec<String> = pairs
        .iter()
        .map(|(k, v)| format!("{k}={}", enc(v)))
        .collect();
    fields.join("&")
}

/// Every verb an endpoint can be vended.
pub const ALL_VERBS: &[&str] = &[
    "claim_next",
    "claim",
    "heartbeat",
    "complete",
    "fail",
    "release",
    "list_todos",
    "add_todo",
];
/// A failure bound on every wait, never a sleep.
pub const BOUND: Duration = Duration::from_secs(10);

/// reqwest is built with `rustls-no-provider`: plain http needs no TLS, but building a client
/// still wants a process-wide provider, so install ring's (a second install is a no-op).
pub fn client() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::new()
}

pub struct Harness {
    pub addr: SocketAddr,
    pub base: String,
    pub server: Server,
    pub clock: ManualClock,
    pub store: Store,
    pub http: reqwest::Client,
    pub stop: Option<tokio::sync::oneshot::Sender<()>>,
    pub served: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
    /// The Postgres schema (url, name) this test ran in, dropped with the harness.
    pub pg_schema: Option<(String, String)>,
}

impl Drop for Harness {
    fn drop(&mut self) {
        let Some((url, name)) = self.pg_schema.take() else {
            return;
        };
        pg_schema::drop_schema(url, name);
    }
}

impl Harness {
    /// A server over `store` on the clock `T0`, seeded with `seed`. `full_serve` runs the whole
    /// `serve` (accept loop, timeouts, caps, background loops); otherwise only the router, and
    /// the test drives the sweeps by hand.
    pub async fn start_on(
        store: Store,
        seed: u64,
        tweak: impl FnOnce(&mut ServerConfig),
        full_serve: bool,
    ) -> Harness {
        Harness::start_on_clock(store, seed, ManualClock::new(T0), tweak, full_serve).await
    }

    /// [`Harness::start_on`] on `clock` (several servers may share one).
    pub async fn start_on_clock(
        store: Store,
        seed: u64,
        clock: ManualClock,
        tweak: impl FnOnce(&mut ServerConfig),
        full_serve: bool,
    ) -> Harness {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut config = ServerConfig::for_listen(addr);
        tweak(&mut config);
        let server = Server::new(store.clone(), Arc::new(clock.clone()), config, Some(seed));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let shutdown = async move {
            let _ = stopped.await;
        };
        let served = if full_serve {
            let s = server.clone();
            tokio::spawn(async move { s.serve(listener, shutdown).await })
        } else {
            let router = server.router();
            tokio::spawn(async move {
                axum::serve(listener, router)
                    .with_graceful_shutdown(shutdown)
                    .await
            })
        };
        Harness {
            addr,
            base: format!("http://{addr}"),
            server,
            clock,
            store,
            http: client(),
            stop: Some(stop),
            served: Some(served),
            pg_schema: None,
        }
    }

    pub fn now(&self) -> Millis {
        use relay_core::time::WallClock;
        self.clock.now()
    }

    /// Vends an endpoint in the store; answers its bearer token.
    pub async fn endpoint(&self, name: &str, verbs: &[&str], queues: Option<&[&str]>) -> String {
        let token = relay_server::server::new_bearer_token().unwrap();
        self.store
            .endpoint_create(
                T0,
                NewEndpoint {
                    name: name.into(),
                    token_hash: TokenHash::of(&token),
                    verbs: verbs.iter().map(|v| v.to_string()).collect(),
                    queues: queues.map(|qs| qs.iter().map(|q| q.to_string()).collect()),
                },
            )
            .await
            .unwrap();
        token
    }

    /// A client of endpoint `name`, with no session yet.
    pub fn mcp(&self, name: &str, token: &str) -> Mcp {
        Mcp {
            http: self.http.clone(),
            url: format!("{}/mcp/{name}", self.base),
            token: token.to_string(),
            session: None,
            next_id: 1,
            modern: false,
            tasks: false,
        }
    }

    /// A client of endpoint `name` in the 2026-07-28 era: no session, every request stamped.
    pub fn mcp_modern(&self, name: &str, token: &str) -> Mcp {
        Mcp {
            modern: true,
            ..self.mcp(name, token)
        }
    }

    /// A modern client that declares the Tasks extension on every request.
    pub fn mcp_tasks(&self, name: &str, token: &str) -> Mcp {
        Mcp {
            tasks: true,
            ..self.mcp_modern(name, token)
        }
    }

    /// Signals shutdown and waits (bounded) for `serve` to return.
    pub async fn stop_and_wait(&mut self) -> std::io::Result<()> {
        let _ = self.stop.take().unwrap().send(());
        tokio::time::timeout(BOUND, self.served.take().unwrap())
            .await
            .expect("serve returned within the bound after shutdown")
            .unwrap()
    }
}

pub struct Mcp {
    pub http: reqwest::Client,
    pub url: String,
    pub token: String,
    pub session: Option<String>,
    pub next_id: u64,
    /// Speaks the 2026-07-28 era: `_meta` and the protocol headers on every request.
    pub modern: bool,
    /// Declares the Tasks extension in every modern request's client capabilities.
    pub tasks: bool,
}

impl Mcp {
    pub fn request(&self, method: reqwest::Method) -> reqwest::RequestBuilder {
        let mut r = self
            .http
            .request(method, &self.url)
            .bearer_auth(&self.token)
            .header("accept", "application/json, text/event-stream");
        if let Some(s) = &self.session {
            r = r.header("mcp-session-id", s);
        }
        r
    }

    pub async fn post_raw(&self, body: impl Into<reqwest::Body>) -> reqwest::Response {
        self.request(reqwest::Method::POST)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap()
    }

    /// A request (stamped for the era when modern), whatever its status.
    pub async fn send(&mut self, method: &str, params: Value) -> reqwest::Response {
        let id = self.next_id;
        self.next_id += 1;
        let (params, headers) = if self.modern {
            let info = json!({"name": "test", "version": "0"});
            let (mut params, headers) = relay_core::mcp::era::stamp(method, params, &info);
            if self.tasks {
                params["_meta"][relay_core::mcp::era::META_CAPABILITIES] =
                    json!({"extensions": {relay_core::task::EXTENSION: {}}});
            }
            (params, headers)
        } else {
            (params, Vec::new())
        };
        let body = json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
        let mut r = self
            .request(reqwest::Method::POST)
            .header("content-type", "application/json");
        for (k, v) in headers {
            r = r.header(k, v);
        }
        r.body(body.to_string()).send().await.unwrap()
    }

    pub async fn rpc(&mut self, method: &str, params: Value) -> (u16, Value) {
        let r = self.send(method, params).await;
        let status = r.status().as_u16();
        let text = r.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    pub async fn init(&mut self) -> Value {
        let body = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "test", "version": "0"}}});
        let r = self.post_raw(body.to_string()).await;
        assert_eq!(r.status(), 200);
        self.session = Some(r.headers()["mcp-session-id"].to_str().unwrap().to_string());
        let v: Value = r.json().await.unwrap();
        let n = self
            .post_raw(json!({"jsonrpc": "2.0", "method": "notifications/initialized"}).to_string())
            .await;
        assert_eq!(n.status(), 202);
        v
    }

    /// A tools/call: the result object (with `isError`).
    pub async fn call(&mut self, tool: &str, args: Value) -> Value {
        let (status, v) = self
            .rpc("tools/call", json!({"name": tool, "arguments": args}))
            .await;
        assert_eq!(status, 200, "{v}");
        let result = v["result"].clone();
        assert!(result.is_object(), "{v}");
        // The same JSON as text content and as structuredContent.
        let text: Value =
            serde_json::from_str(result["content"][0]["text"].as_str().unwrap()).unwrap();
        assert_eq!(text, result["structuredContent"]);
        result
    }

    pub async fn ok(&mut self, tool: &str, args: Value) -> Value {
        let r = self.call(tool, args).await;
        assert_eq!(r["isError"], false, "{tool}: {r}");
        r["structuredContent"].clone()
    }

    /// Calls and expects a tool error with `code`; answers its message.
    pub async fn fails(&mut self, tool: &str, args: Value, code: &str) -> String {
        let r = self.call(tool, args).await;
        assert_eq!(r["isError"], true, "{tool}: {r}");
        assert_eq!(r["structuredContent"]["error"]["code"], code, "{r}");
        r["structuredContent"]["error"]["message"]
            .as_str()
            .unwrap()
            .to_string()
    }

    /// The session's doorbell stream, asserted open.
    pub async fn stream(&self) -> reqwest::Response {
        let stream = self.get_stream().await;
        assert_eq!(stream.status(), 200);
        stream
    }

    /// A GET for the session's doorbell stream, whatever its status.
    pub async fn get_stream(&self) -> reqwest::Response {
        self.request(reqwest::Method::GET)
            .header("accept", "text/event-stream")
            .send()
            .await
            .unwrap()
    }
}

/// The next `data:` message of an SSE response, or `None` when none comes within `within`.
pub async fn next_event(
    resp: &mut reqwest::Response,
    buf: &mut String,
    within: Duration,
) -> Option<Value> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let data: String = event
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(str::trim_start)
                .collect();
            if data.is_empty() {
                continue; // a keep-alive comment
            }
            return Some(serde_json::from_str(&data).unwrap());
        }
        let chunk = tokio::time::timeout_at(deadline, resp.chunk()).await.ok()?;
        let chunk = chunk.unwrap().expect("the stream is open");
        buf.push_str(std::str::from_utf8(&chunk).unwrap());
    }
}
