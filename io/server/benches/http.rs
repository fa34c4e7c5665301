//! The queue server's HTTP benchmark: fenced claim_next → heartbeat → complete over real HTTP.
//!
//! ```sh
//! cargo bench -p relay-server --bench http                        # SQLite, a temp file
//! cargo bench -p relay-server --bench http -- --db postgres://…   # Postgres (a schema of its own)
//! cargo bench -p relay-server --bench http -- --clients 16 --seconds 3 --todos 30000
//! ```
//!
//! In one process and one run: the real server ([`relay_server::server::Server::serve`], background
//! loops included) on 127.0.0.1:0 over the chosen store, and `--clients` concurrent MCP clients
//! (default 16), each with its own HTTP connection pool and session (`initialize`, then
//! `notifications/initialized`), each looping `claim_next {require_fence: true}` → `heartbeat
//! {lease_token}` → `complete {lease_token}` until the time is up. Reported: cycles/s and the
//! p50/p99 latency of each call and of the whole cycle, at 1 client and at `--clients`, each as a
//! ratio to the floor (single-row UPDATE transactions per second at as many connections), and
//! each also as one `RESULT bench=http …` line.
//!
//! The baseline, measured in the same run on the same database: the same cycle with the same
//! concurrency calling the [`Store`] directly (no HTTP, no JSON-RPC, no session or auth), on its
//! own endpoint's todos. The ratio HTTP/direct is what the transport costs.
//!
//! Every answer is checked (a tool error or an empty claim before the time is up aborts the run),
//! and at the end every claimed todo must be `done`: the figures are for correct work only.
//! Clients and server share the machine (and the tokio runtime's worker threads), as they would
//! with local agents.

#![allow(clippy::print_stdout, reason = "a benchmark reports on stdout")]

#[path = "../tests/support/db.rs"]
mod db;
#[path = "support/measure.rs"]
mod measure;
#[path = "../tests/support/pg_schema.rs"]
mod pg_schema;

use std::sync::Arc;
use std::time::{Duration, Instant};

use relay_core::ledger::{
    Actor, Answer, ClaimOpts, LedgerConfig, NewTodo, Op, Report, TodoFilter, TodoState, TokenHash,
};
use relay_core::time::SECOND;
use relay_core::time::WallClock;
use relay_server::clock::SystemClock;
use relay_server::server::{Server, ServerConfig};
use relay_server::store::{NewEndpoint, Store};
use serde_json::{Value, json};

use db::Db;
use measure::{Figures, Tally, collect};

const QUEUE: &str = "q";
const HTTP_ENDPOINT: &str = "bench-http";
const DIRECT_ENDPOINT: &str = "bench-direct";
const TTL: u64 = 300 * SECOND;

struct Args {
    clients: usize,
    seconds: u64,
    todos: usize,
}

fn args() -> Args {
    let mut out = Args {
        clients: 16,
        seconds: 3,
        todos: 50_000,
    };
    let mut it = std::env::args().skip(1);
    let num = |v: Option<String>, what: &str| -> u64 {
        v.and_then(|s| s.parse().ok()).unwrap_or_else(|| {
            eprintln!("{what}: give a positive number");
            std::process::exit(2)
        })
    };
    while let Some(a) = it.next() {
        match a.as_str() {
            "--clients" => out.clients = num(it.next(), "--clients") as usize,
            "--seconds" => out.seconds = num(it.next(), "--seconds"),
            "--todos" => out.todos = num(it.next(), "--todos") as usize,
            _ => {} // --db (see main), and cargo passes --bench
        }
    }
    out
}

fn main() {
    let args = args();
    let db = Db::for_bench(std::env::args().skip(1), "bench.db", "bench_http");
    // Two workers: this machine's cores, shared by the server and the clients.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    rt.block_on(run(&db, &args));
    if let Db::Postgres { url, schema } = &db {
        rt.block_on(pg_schema::drop_now(url, schema))
            .expect("drop the bench schema");
    }
}

async fn run(db: &Db, args: &Args) {
    let cfg = LedgerConfig::default();
    let store = db.open(cfg).await;
    let name = match db {
        Db::Sqlite { path, .. } => format!("sqlite, temp file ({})", Db::sqlite_url(path)),
        Db::Postgres { schema, .. } => format!("postgres, schema {schema}"),
    };
    println!(
        "relay HTTP benchmark: {name}; {} clients, {} s per figure, {} todos preloaded per figure",
        args.clients, args.seconds, args.todos
    );

    let clock = SystemClock;
    let token = relay_server::server::new_bearer_token().expect("a token");
    for (endpoint, hash) in [
        (HTTP_ENDPOINT, TokenHash::of(&token)),
        (DIRECT_ENDPOINT, TokenHash::of("unused")),
    ] {
        store
            .endpoint_create(
                clock.now(),
                NewEndpoint {
                    name: endpoint.into(),
                    token_hash: hash,
                    verbs: ["claim_next", "heartbeat", "complete"]
                        .map(String::from)
                        .to_vec(),
                    queues: None,
                },
            )
            .await
            .expect("create the endpoint");
    }
    let started = Instant::now();
    preload(&store, HTTP_ENDPOINT, args.todos).await;
    preload(&store, DIRECT_ENDPOINT, args.todos).await;
    println!(
        "preloaded {} todos in {:.1} s",
        2 * args.todos,
        started.elapsed().as_secs_f64()
    );

    // The server, as `relay serve` runs it.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind 127.0.0.1:0");
    let addr = listener.local_addr().expect("the bound address");
    let server = Server::new(
        store.clone(),
        Arc::new(SystemClock),
        ServerConfig::for_listen(addr),
        None,
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn({
        let server = server.clone();
        async move {
            server
                .serve(listener, async move {
                    let _ = stopped.await;
                })
                .await
        }
    });
    let url = format!("http://{addr}/mcp/{HTTP_ENDPOINT}");
    let run_for = Duration::from_secs(args.seconds);

    let floors = [
        measure::floor(db, 1, run_for).await,
        measure::floor(db, args.clients, run_for).await,
    ];
    let mut http = Vec::new();
    let mut direct = Vec::new();
    for callers in [1, args.clients] {
        http.push(over_http(&url, &token, callers, run_for).await);
        direct.push(self::direct(&store, callers, run_for).await);
    }

    let _ = stop.send(());
    serving
        .await
        .expect("the server task")
        .expect("the server stops cleanly");

    for (endpoint, f) in [(HTTP_ENDPOINT, &http), (DIRECT_ENDPOINT, &direct)] {
        check_done(&store, endpoint, f.iter().map(|f| f.tally.cycles).sum()).await;
    }

    println!(
        "floor: single-row UPDATE transactions {:.0} tx/s at 1 connection, {:.0} tx/s at {}",
        floors[0], floors[1], args.clients
    );
    let store_name = db.name();
    for ((h, d), floor) in http.iter_mut().zip(direct.iter_mut()).zip(floors) {
        let ratio = h.rate / d.rate;
        measure::report("http", store_name, "http", h, floor);
        measure::report("http", store_name, "direct", d, floor);
        println!(
            "{} callers: HTTP / direct = {ratio:.2} (over HTTP the cycle runs at {:.0} % of the direct rate)",
            h.callers,
            100.0 * ratio
        );
        println!(
            "RESULT bench=http store={store_name} path=http_over_direct callers={} ratio={ratio:.3}",
            h.callers
        );
    }
}

/// Adds `n` todos for `endpoint`, 16 writers at a time.
async fn preload(store: &Store, endpoint: &str, n: usize) {
    let writers = 16;
    let mut tasks = Vec::new();
    for w in 0..writers {
        let store = store.clone();
        let endpoint = endpoint.to_string();
        tasks.push(tokio::spawn(async move {
            for i in (w..n).step_by(writers) {
                store
                    .apply(Op::AddTodo {
                        now: SystemClock.now(),
                        endpoint: endpoint.clone(),
                        new: NewTodo {
                            id: format!("td_{endpoint}_{i:06}"),
                            queue: QUEUE.into(),
                            title: format!("bench {i}"),
                            kind: None,
                            source: None,
                            payload: None,
                            work_order: None,
                            max_attempts: None,
                            assignee: None,
                            ..NewTodo::default()
                        },
                    })
                    .await
                    .expect("add a todo");
            }
        }));
    }
    for t in tasks {
        t.await.expect("a preload task");
    }
}

/// Every todo a client completed is `done`, and as many as the clients counted.
async fn check_done(store: &Store, endpoint: &str, cycles: u64) {
    let list = |state| Op::ListTodos {
        actor: Actor::endpoint(endpoint),
        filter: TodoFilter {
            queues: None,
            state: Some(state),
            after: None,
            limit: usize::MAX,
        },
    };
    let done = store.apply(list(TodoState::Done)).await;
    let done = done.and_then(Answer::todos).expect("list done todos");
    let claimed = store.apply(list(TodoState::Claimed)).await;
    let claimed = claimed.and_then(Answer::todos).expect("list claimed todos");
    assert_eq!(
        done.len() as u64,
        cycles,
        "{endpoint}: done todos differ from completed cycles"
    );
    assert!(
        claimed.is_empty(),
        "{endpoint}: {} todos left claimed",
        claimed.len()
    );
}

// ---------------------------------------------------------------------------------------------
// Over HTTP.
// ---------------------------------------------------------------------------------------------

struct Mcp {
    http: reqwest::Client,
    url: String,
    token: String,
    session: String,
    next_id: u64,
}

impl Mcp {
    async fn connect(url: &str, token: &str) -> Mcp {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(1)
            .build()
            .expect("an HTTP client");
        let mut c = Mcp {
            http,
            url: url.to_string(),
            token: token.to_string(),
            session: String::new(),
            next_id: 1,
        };
        let r = c
            .post(
                &json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
                    "protocolVersion": "2025-06-18",
                    "capabilities": {},
                    "clientInfo": {"name": "relay-bench", "version": "0"},
                }}),
            )
            .await;
        assert!(r.status().is_success(), "initialize: HTTP {}", r.status());
        c.session = r
            .headers()
            .get("mcp-session-id")
            .and_then(|v| v.to_str().ok())
            .expect("initialize answers a session id")
            .to_string();
        let _ = r.bytes().await;
        let r = c
            .post(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"}))
            .await;
        assert_eq!(r.status().as_u16(), 202, "notifications/initialized");
        c
    }

    async fn post(&self, body: &Value) -> reqwest::Response {
        let mut req = self
            .http
            .post(&self.url)
            .bearer_auth(&self.token)
            .header("accept", "application/json, text/event-stream")
            .header("content-type", "application/json")
            .body(body.to_string());
        if !self.session.is_empty() {
            req = req
                .header("mcp-session-id", &self.session)
                .header("mcp-protocol-version", "2025-06-18");
        }
        req.send().await.expect("the server answers")
    }

    /// A tools/call; answers the tool's structuredContent, panicking on any error.
    async fn call(&mut self, tool: &str, arguments: Value) -> Value {
        self.next_id += 1;
        let r = self
            .post(
                &json!({"jsonrpc": "2.0", "id": self.next_id, "method": "tools/call",
                "params": {"name": tool, "arguments": arguments}}),
            )
            .await;
        let status = r.status();
        let body: Value = r.json().await.expect("a JSON answer");
        assert!(status.is_success(), "{tool}: HTTP {status}: {body}");
        let result = &body["result"];
        assert!(
            result["isError"] != json!(true) && body.get("error").is_none(),
            "{tool}: {body}"
        );
        result["structuredContent"].clone()
    }
}

async fn over_http(url: &str, token: &str, clients: usize, run_for: Duration) -> Figures {
    let mut mcps = Vec::new();
    for _ in 0..clients {
        mcps.push(Mcp::connect(url, token).await);
    }
    let start = Instant::now();
    let deadline = start + run_for;
    let mut tasks = Vec::new();
    for mut mcp in mcps {
        tasks.push(tokio::spawn(async move {
            let mut t = Tally::default();
            while Instant::now() < deadline {
                let c0 = Instant::now();
                let got = mcp
                    .call("claim_next", json!({"queue": QUEUE, "require_fence": true}))
                    .await;
                t.claim.push(c0.elapsed());
                assert_eq!(
                    got["empty"],
                    json!(false),
                    "the queue ran dry: preload more"
                );
                let id = got["todo"]["id"].as_str().expect("a todo id").to_string();
                let lease = got["lease_token"].clone();
                assert!(lease.is_string(), "a fenced claim answers a lease token");
                let h0 = Instant::now();
                mcp.call("heartbeat", json!({"id": id, "lease_token": lease}))
                    .await;
                t.heartbeat.push(h0.elapsed());
                let k0 = Instant::now();
                let done = mcp
                    .call(
                        "complete",
                        json!({"id": id, "lease_token": lease, "result": {"ok": true}}),
                    )
                    .await;
                t.complete.push(k0.elapsed());
                assert_eq!(done["state"], json!("done"));
                t.cycle.push(c0.elapsed());
                t.cycles += 1;
            }
            t
        }));
    }
    collect(clients, tasks, start).await
}

// ---------------------------------------------------------------------------------------------
// The baseline: the same cycle on the store directly.
// ---------------------------------------------------------------------------------------------

async fn direct(store: &Store, clients: usize, run_for: Duration) -> Figures {
    let start = Instant::now();
    let deadline = start + run_for;
    let mut tasks = Vec::new();
    for c in 0..clients {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            let actor = Actor::Endpoint {
                endpoint: DIRECT_ENDPOINT.into(),
                session: Some(format!("direct-{c}")),
            };
            let queues = vec![QUEUE.to_string()];
            let mut t = Tally::default();
            let mut n = 0u64;
            while Instant::now() < deadline {
                n += 1;
                let token = TokenHash::of(&format!("tok-{c}-{n}"));
                let c0 = Instant::now();
                let opts = ClaimOpts {
                    ttl: TTL,
                    claimant: None,
                    token_hash: Some(token),
                };
                let claim = Op::ClaimNext {
                    now: SystemClock.now(),
                    actor: actor.clone(),
                    queues: Some(queues.clone()),
                    opts,
                };
                let got = store
                    .apply(claim)
                    .await
                    .and_then(Answer::next)
                    .expect("claim_next")
                    .expect("a todo to claim (the queue ran dry: preload more)");
                t.claim.push(c0.elapsed());
                let id = got.todo.id;
                let h0 = Instant::now();
                let hb = Op::Heartbeat {
                    now: SystemClock.now(),
                    actor: actor.clone(),
                    id: id.clone(),
                    ttl: TTL,
                    token_hash: Some(token),
                    usage: None,
                };
                store.apply(hb).await.expect("heartbeat");
                t.heartbeat.push(h0.elapsed());
                let k0 = Instant::now();
                let report = Report {
                    result: Some(json!({"ok": true})),
                    token_hash: Some(token),
                    ..Report::default()
                };
                let (now, actor) = (SystemClock.now(), actor.clone());
                let done = store.apply(Op::Complete {
                    now,
                    actor,
                    id,
                    report,
                });
                let done = done.await.and_then(Answer::todo).expect("complete");
                t.complete.push(k0.elapsed());
                assert_eq!(done.state, TodoState::Done);
                t.cycle.push(c0.elapsed());
                t.cycles += 1;
            }
            t
        }));
    }
    collect(clients, tasks, start).await
}
