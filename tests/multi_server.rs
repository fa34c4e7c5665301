//! Several servers on one Postgres under faults (issue 16): three `relay serve` processes on one
//! database behind a small in-test TCP balancer (round-robin per connection, no stickiness),
//! workers doing fenced claim → heartbeat → complete/fail through it, and a nemesis that
//! kill -9s and restarts servers with their clocks offset by ±30 s (libfaketime), while the
//! balancer drops one answer in ten after the server sent it (the operation committed, its
//! client never hears: a claim whose answer is lost leaves a lease nobody holds). Then a checker
//! over the recorded history and the database's rows:
//!
//! - no acknowledged add lost;
//! - no todo completed twice;
//! - no write accepted under a stale token (every completed or failed attempt ended strictly
//!   before its lease expired, by the database's clock, and every acknowledged report is the one
//!   that closed its attempt);
//! - at most one open attempt per todo (attempts of a todo never overlap);
//! - every attempt closed exactly once (all closed at the end, each as its acknowledged report
//!   said);
//! - every lease at least as long as granted, by the database's clock (no takeover, reap or next
//!   attempt before the expiry any claim or heartbeat answered);
//! - in the key-limited queue (`max_claimed_per_key 1`, set before the workers start; one todo
//!   in [`KEYED_EVERY`] goes there with one of [`KEYS`] keys), no two attempts of one key open
//!   at once: their `[claimed_at, ended_at)` overlap by at most [`KEY_TOLERANCE_MS`] (see there).
//!
//! Bounded: about a minute; every loop is bounded in count and time. Skips without
//! `RELAY_TEST_POSTGRES` unless `RELAY_REQUIRE_POSTGRES=1`.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::history::{self, Attempts, Event, Keys, Row, Todos, check, key_overlaps};
use common::{Proc, libfaketime, listening_on, relay, run_db, temp_dir};
use relay_core::time::parse_rfc3339;
use serde_json::{Value, json};

const SERVERS: usize = 3;
const WORKERS: usize = 4;
/// Seconds of lease a claim asks for: short, so that lost answers and stalls lapse in the run.
const LEASE_S: u64 = 2;
/// The faulty phase; then every server stays up and the workers drain.
const FAULTY: Duration = Duration::from_secs(30);
const DRAIN: Duration = Duration::from_secs(30);
/// kill -9s at most in the faulty phase.
const KILLS: usize = 8;
/// Todos the producer adds at most (about 10 a second during the faulty phase).
const TODOS: usize = 300;
/// The clock offsets a (re)started server gets, in seconds, in turn.
const OFFSETS: [i64; 3] = [30, -30, 0];
/// The producer's queues: most todos go to `work`, one in [`KEYED_EVERY`] to [`KEYED`], which
/// has `max_claimed_per_key 1`, with one of [`KEYS`] concurrency keys in turn. Few enough that
/// the keyed todos drain one per key at a time within [`DRAIN`].
const WORK: &str = "work";
const KEYED: &str = "keyed";
const KEYED_EVERY: usize = 4;
const KEYS: usize = 3;
/// How many milliseconds two attempts of one key may seem to overlap by the database's clock.
/// An operation stamps its time when it starts (`clock_timestamp()` read before its locks), so
/// a claim that read its clock, then waited for the flow lock (held to its commit by another
/// claim) while a completion of the key's claimed todo stamped its own time and committed, sees
/// the key free and is stamped before that completion: an apparent overlap as long as the
/// claim's wait, a few milliseconds here, with no two attempts claimed at once in fact. Five
/// runs saw one, of 3 ms (the machine also ran a benchmark; otherwise the closest claims came 0
/// to 3 ms after the key's previous attempt ended); a loaded machine lengthens the wait. A real
/// double claim overlaps by what is
/// left of the first holder's work (40 to 440 ms before it reports, seconds for a stall), so
/// most would exceed this; every overlap is printed, whatever its size.
const KEY_TOLERANCE_MS: i64 = 50;

fn pg_url() -> Option<String> {
    match std::env::var("RELAY_TEST_POSTGRES") {
        Ok(url) if !url.is_empty() => Some(url),
        _ => {
            assert!(
                std::env::var("RELAY_REQUIRE_POSTGRES").as_deref() != Ok("1"),
                "RELAY_REQUIRE_POSTGRES=1 but RELAY_TEST_POSTGRES is unset"
            );
            eprintln!("SKIPPED: set RELAY_TEST_POSTGRES=postgres://… to run the multi-server test");
            None
        }
    }
}

/// A `relay serve` child on a free port, its wall clock `offset` seconds off (when libfaketime
/// is there), its log appended to `log`.
fn start_server(db: &str, offset: i64, faketime: Option<&Path>, log: &Path) -> (Proc, SocketAddr) {
    let err = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .expect("server log");
    let mut cmd = relay();
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--shutdown-grace", "1s"])
        .env("RELAY_DB", db)
        .env("RELAY_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::from(err));
    if let Some(lib) = faketime {
        cmd.env("LD_PRELOAD", lib)
            .env("FAKETIME", format!("{offset:+}"))
            .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
    }
    let mut child: Child = cmd.spawn().expect("start relay serve");
    let base = listening_on(&mut child).unwrap_or_else(|first| panic!("first line: {first:?}"));
    let addr = base
        .trim_start_matches("http://")
        .parse()
        .expect("an address");
    (Proc(child), addr)
}

/// The servers behind the balancer; `None` while one is down.
type Backends = Arc<Mutex<Vec<Option<SocketAddr>>>>;

/// Connections open through the balancer to each backend (one request each: the clients keep
/// no idle connections), so the nemesis can kill a server with requests in flight.
type InFlight = Arc<[AtomicUsize; SERVERS]>;

/// While the faults run, every this many connections lose their answer after the server sent
/// it: the operation committed and its client never hears so (a claim whose answer is lost
/// leaves a lease nobody holds).
const ANSWER_LOST_EVERY: usize = 10;

/// The balancer's fault switch and what it did.
#[derive(Default)]
struct Losses {
    /// Whether answers are being lost now.
    on: AtomicBool,
    /// Answers the server sent that the balancer dropped.
    dropped: AtomicUsize,
}

/// Round-robin per connection over the live backends; a backend that refuses is skipped. While
/// `losses.on`, every [`ANSWER_LOST_EVERY`]th connection's answer is dropped once the server
/// has started sending it (so after the server committed what it answers).
async fn balance(
    listener: tokio::net::TcpListener,
    backends: Backends,
    in_flight: InFlight,
    losses: Arc<Losses>,
) {
    let next = Arc::new(AtomicUsize::new(0));
    for n in 0usize.. {
        let Ok((mut inbound, _)) = listener.accept().await else {
            continue;
        };
        let (backends, next, in_flight) = (backends.clone(), next.clone(), in_flight.clone());
        let lose = losses.on.load(Ordering::Relaxed) && n % ANSWER_LOST_EVERY == 0;
        let losses = losses.clone();
        tokio::spawn(async move {
            for _ in 0..SERVERS {
                let i = next.fetch_add(1, Ordering::Relaxed) % SERVERS;
                let Some(addr) = backends.lock().unwrap()[i] else {
                    continue;
                };
                if let Ok(mut out) = tokio::net::TcpStream::connect(addr).await {
                    in_flight[i].fetch_add(1, Ordering::SeqCst);
                    if lose {
                        if lose_answer(inbound, out).await {
                            losses.dropped.fetch_add(1, Ordering::Relaxed);
                        }
                    } else {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut out).await;
                    }
                    in_flight[i].fetch_sub(1, Ordering::SeqCst);
                    return;
                }
            }
        });
    }
}

/// Passes the request on and drops the answer: waits (at most 10 s) for the server's first
/// byte back, then closes both connections. `true` when the server did answer.
async fn lose_answer(inbound: tokio::net::TcpStream, out: tokio::net::TcpStream) -> bool {
    use tokio::io::AsyncReadExt;
    let (mut from_client, _to_client) = inbound.into_split();
    let (mut from_server, mut to_server) = out.into_split();
    let request = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut from_client, &mut to_server).await;
    });
    let mut first = [0u8; 1];
    let answered = tokio::time::timeout(Duration::from_secs(10), from_server.read(&mut first))
        .await
        .is_ok_and(|r| r.is_ok_and(|n| n > 0));
    request.abort();
    answered
}

/// What a client saw: an answer (the tool's structured content, or a tool error's code), or
/// nothing (the connection died: the outcome is unknown).
enum Seen {
    Ok(Value),
    Refused(String),
    NotFound,
    Lost,
}

struct Client {
    http: reqwest::Client,
    url: String,
    token: String,
    session: Option<String>,
    next_id: u64,
}

impl Client {
    fn new(url: &str, token: &str) -> Client {
        // reqwest is built without a TLS provider; plain http still wants one installed.
        let _ = rustls::crypto::ring::default_provider().install_default();
        Client {
            // A new connection per request: the balancer spreads every request.
            http: reqwest::Client::builder()
                .pool_max_idle_per_host(0)
                .timeout(Duration::from_secs(5))
                .build()
                .expect("a client"),
            url: url.to_string(),
            token: token.to_string(),
            session: None,
            next_id: 1,
        }
    }

    async fn post(&mut self, body: Value) -> Option<(u16, reqwest::header::HeaderMap, Value)> {
        let r = common::mcp_post(&self.http, &self.url, &self.token, self.session.as_deref());
        let resp = r.body(body.to_string()).send().await.ok()?;
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let text = resp.text().await.ok()?;
        Some((
            status,
            headers,
            serde_json::from_str(&text).unwrap_or(Value::Null),
        ))
    }

    /// Initializes a session, through whichever server answers; retried (bounded).
    async fn init(&mut self) {
        for _ in 0..50 {
            self.session = None;
            let body = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
                "protocolVersion": "2025-06-18", "capabilities": {},
                "clientInfo": {"name": "multi", "version": "0"}}});
            if let Some((200, headers, _)) = self.post(body).await
                && let Some(s) = headers.get("mcp-session-id")
            {
                self.session = Some(s.to_str().unwrap().to_string());
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("no server initialized a session");
    }

    async fn call(&mut self, tool: &str, args: Value) -> Seen {
        let id = self.next_id;
        self.next_id += 1;
        let body = json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
                          "params": {"name": tool, "arguments": args}});
        match self.post(body).await {
            None => Seen::Lost,
            Some((404, _, _)) => Seen::NotFound,
            Some((200, _, v)) if v["result"]["isError"] == json!(true) => Seen::Refused(
                v["result"]["structuredContent"]["error"]["code"]
                    .as_str()
                    .unwrap_or("?")
                    .to_string(),
            ),
            Some((200, _, v)) if v["result"]["structuredContent"].is_object() => {
                Seen::Ok(v["result"]["structuredContent"].clone())
            }
            // A 5xx from a server going down, or an internal error: unknown, like a lost answer.
            Some(_) => Seen::Lost,
        }
    }
}

#[derive(Default)]
struct Tally {
    events: Vec<Event>,
    lost_answers: usize,
    stale_refused: usize,
    sessions_lost: usize,
}

/// A tiny deterministic generator per worker (no shared RNG, replayable by worker index).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn lease_until(todo: &Value) -> u64 {
    parse_rfc3339(todo["lease_expires_at"].as_str().expect("a lease")).expect("a time")
}

/// Sends a report until it is answered (a lost answer is retried under the same fence: a
/// fenced report is idempotent), bounded.
async fn report(c: &mut Client, tool: &str, args: Value, tally: &Mutex<Tally>) -> Seen {
    for _ in 0..10 {
        match c.call(tool, args.clone()).await {
            Seen::Lost => {
                tally.lock().unwrap().lost_answers += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Seen::NotFound => {
                tally.lock().unwrap().sessions_lost += 1;
                c.init().await;
            }
            seen => return seen,
        }
    }
    Seen::Lost
}

async fn worker(
    n: usize,
    url: String,
    token: String,
    stop: Arc<AtomicBool>,
    tally: Arc<Mutex<Tally>>,
) {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (n as u64 + 1));
    let mut c = Client::new(&url, &token);
    c.init().await;
    let claimant = format!("w{n}");
    let started = Instant::now();
    while !stop.load(Ordering::Relaxed) && started.elapsed() < FAULTY + DRAIN {
        let claim = c
            .call(
                "claim_next",
                json!({"require_fence": true, "claimant": claimant,
                       "lease_ttl_seconds": LEASE_S}),
            )
            .await;
        let got = match claim {
            Seen::Ok(v) if v["empty"] == json!(true) => None,
            Seen::Ok(v) => Some(v),
            Seen::NotFound => {
                tally.lock().unwrap().sessions_lost += 1;
                c.init().await;
                continue;
            }
            Seen::Lost => {
                // The claim may have opened an attempt nobody will report: it lapses and is
                // taken over or reaped.
                tally.lock().unwrap().lost_answers += 1;
                None
            }
            Seen::Refused(_) => None,
        };
        let Some(v) = got else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let id = v["todo"]["id"].as_str().unwrap().to_string();
        let seq = u32::try_from(v["attempt_seq"].as_u64().unwrap()).unwrap();
        let fence = v["lease_token"].as_str().unwrap().to_string();
        tally.lock().unwrap().events.push(Event::Leased {
            id: id.clone(),
            seq,
            until: lease_until(&v["todo"]),
        });
        // Work a little, heartbeat, work a little more.
        tokio::time::sleep(Duration::from_millis(20 + rng.below(200))).await;
        match c
            .call(
                "heartbeat",
                json!({"id": id, "lease_token": fence, "lease_ttl_seconds": LEASE_S}),
            )
            .await
        {
            Seen::Ok(t) => tally.lock().unwrap().events.push(Event::Leased {
                id: id.clone(),
                seq,
                until: lease_until(&t),
            }),
            Seen::Lost => tally.lock().unwrap().lost_answers += 1,
            _ => {}
        }
        // One in ten stalls past its lease: its report must be refused.
        let stalls = rng.below(10) == 0;
        let pause = if stalls {
            LEASE_S * 1000 + 500
        } else {
            20 + rng.below(200)
        };
        tokio::time::sleep(Duration::from_millis(pause)).await;
        let (tool, outcome, args) = if rng.below(5) == 0 {
            let args = json!({"id": id, "lease_token": fence, "retryable": false,
                              "summary": "failed on purpose"});
            ("fail", "failed", args)
        } else {
            let args = json!({"id": id, "lease_token": fence, "summary": "done"});
            ("complete", "completed", args)
        };
        match report(&mut c, tool, args, &tally).await {
            Seen::Ok(_) => tally
                .lock()
                .unwrap()
                .events
                .push(Event::Reported { id, seq, outcome }),
            Seen::Refused(code) if code == "conflict" => {
                tally.lock().unwrap().stale_refused += 1;
            }
            _ => {}
        }
    }
}

async fn producer(url: String, token: String, stop: Arc<AtomicBool>, tally: Arc<Mutex<Tally>>) {
    let mut c = Client::new(&url, &token);
    c.init().await;
    for i in 0..TODOS {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let mut args = json!({"queue": WORK, "title": format!("todo {i}"),
                              "idempotency_key": format!("k{i}"), "max_attempts": 20});
        if i % KEYED_EVERY == 0 {
            args["queue"] = json!(KEYED);
            args["concurrency_key"] = json!(format!("c{}", i / KEYED_EVERY % KEYS));
        }
        // A lost answer is retried under the same idempotency key: one todo whatever happens.
        for _ in 0..10 {
            match c.call("add_todo", args.clone()).await {
                Seen::Ok(t) => {
                    let id = t["id"].as_str().unwrap().to_string();
                    tally.lock().unwrap().events.push(Event::Added { id });
                    break;
                }
                Seen::NotFound => {
                    tally.lock().unwrap().sessions_lost += 1;
                    c.init().await;
                }
                Seen::Lost => {
                    tally.lock().unwrap().lost_answers += 1;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Seen::Refused(code) => panic!("add_todo refused: {code}"),
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[test]
fn three_servers_under_kill_and_clock_offsets_keep_the_ledger_whole() {
    let Some(url) = pg_url() else {
        return;
    };
    // Without libfaketime (and RELAY_REQUIRE_FAKETIME unset) the servers run on true clocks.
    let faketime = libfaketime();
    let tmp = temp_dir("multi-server");
    let dir = tmp.path();
    let log = dir.join("servers.log");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    let schema = format!("ms_{}", std::process::id());
    let admin = rt.block_on(async {
        let (c, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .expect("connect to RELAY_TEST_POSTGRES");
        tokio::spawn(conn);
        c.batch_execute(&format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}"
        ))
        .await
        .unwrap();
        c
    });
    let sep = if url.contains('?') { '&' } else { '?' };
    let db = format!("{url}{sep}options=-c%20search_path%3D{schema}");
    let (code, token, err) = run_db(
        &db,
        &[
            "endpoint",
            "create",
            "w",
            "--verbs",
            "claim_next,heartbeat,complete,fail,add_todo,list_todos",
        ],
    );
    assert_eq!(code, 0, "{err}");
    let token = token.trim().to_string();
    let (code, _, err) = run_db(&db, &["queue", "set", KEYED, "--max-claimed-per-key", "1"]);
    assert_eq!(code, 0, "{err}");

    let started = Instant::now();
    let mut servers: Vec<Option<Proc>> = Vec::new();
    let backends: Backends = Arc::new(Mutex::new(vec![None; SERVERS]));
    let in_flight: InFlight = Arc::new(std::array::from_fn(|_| AtomicUsize::new(0)));
    for (i, offset) in OFFSETS.iter().enumerate() {
        let (p, addr) = start_server(&db, *offset, faketime.as_deref(), &log);
        servers.push(Some(p));
        backends.lock().unwrap()[i] = Some(addr);
    }
    let tally = Arc::new(Mutex::new(Tally::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let no_more_adds = Arc::new(AtomicBool::new(false));
    let losses = Arc::new(Losses::default());
    losses.on.store(true, Ordering::Relaxed);
    let (balancer_url, handles) = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/mcp/w", listener.local_addr().unwrap());
        tokio::spawn(balance(
            listener,
            backends.clone(),
            in_flight.clone(),
            losses.clone(),
        ));
        let mut handles = Vec::new();
        for n in 0..WORKERS {
            handles.push(tokio::spawn(worker(
                n,
                url.clone(),
                token.clone(),
                stop.clone(),
                tally.clone(),
            )));
        }
        handles.push(tokio::spawn(producer(
            url.clone(),
            token.clone(),
            no_more_adds.clone(),
            tally.clone(),
        )));
        (url, handles)
    });

    // The nemesis: every ~3 s one server is killed -9 and restarted a moment later with the
    // next clock offset. Bounded in count and time.
    let mut kills = 0;
    let mut turn = 0usize;
    while started.elapsed() < FAULTY && kills < KILLS {
        std::thread::sleep(Duration::from_millis(2_500));
        let victim = kills % SERVERS;
        // Killed while the balancer still sends it work, preferably with a request in flight
        // (waited for at most a second): in-flight requests lose their answers, committed or
        // not; new connections are refused and go to the next server.
        let aim = Instant::now() + Duration::from_secs(1);
        while in_flight[victim].load(Ordering::SeqCst) == 0 && Instant::now() < aim {
            std::thread::sleep(Duration::from_micros(200));
        }
        if let Some(mut p) = servers[victim].take() {
            let _ = p.0.kill();
            let _ = p.0.wait();
        }
        backends.lock().unwrap()[victim] = None;
        kills += 1;
        std::thread::sleep(Duration::from_millis(500));
        turn += 1;
        let offset = OFFSETS[turn % OFFSETS.len()];
        let (p, addr) = start_server(&db, offset, faketime.as_deref(), &log);
        servers[victim] = Some(p);
        backends.lock().unwrap()[victim] = Some(addr);
    }
    no_more_adds.store(true, Ordering::Relaxed);
    losses.on.store(false, Ordering::Relaxed);

    // The drain: every server up, until no todo is pending or claimed (bounded).
    let drained = rt.block_on(async {
        let deadline = Instant::now() + DRAIN;
        loop {
            let left: i64 = admin
                .query_one(
                    &format!(
                        "SELECT count(*) FROM {schema}.todos \
                         WHERE state NOT IN ('done', 'failed')"
                    ),
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            if left == 0 || Instant::now() >= deadline {
                break left == 0;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    stop.store(true, Ordering::Relaxed);
    rt.block_on(async {
        for h in handles {
            tokio::time::timeout(Duration::from_secs(10), h)
                .await
                .expect("a client ends within the bound")
                .expect("a client ran to its end");
        }
    });
    drop(servers);

    let (todos, attempts) = rt.block_on(history::read_ledger(&admin, &schema));
    let keys = rt.block_on(history::read_keys(&admin, &schema, KEYED));
    let t = tally.lock().unwrap();
    let mut violations = check(&t.events, &todos, &attempts);
    let overlaps = key_overlaps(&keys, &attempts);
    let keyed_attempts = attempts
        .keys()
        .filter(|(id, _)| keys.contains_key(id))
        .count();
    for o in &overlaps {
        eprintln!("key overlap of {} ms: {}", o.ms, o.line);
    }
    violations.extend(
        overlaps
            .iter()
            .filter(|o| o.ms > KEY_TOLERANCE_MS)
            .map(|o| format!("{} ms over: {}", o.ms, o.line)),
    );
    let outcomes: BTreeSet<&str> = attempts
        .values()
        .filter_map(|a| a.outcome.as_deref())
        .collect();
    let died = attempts
        .values()
        .filter(|a| matches!(a.outcome.as_deref(), Some("lease_expired" | "reaped")))
        .count();
    eprintln!(
        "multi-server: {} s, {kills} kills -9, {} todos, {} attempts ({died} died; outcomes \
         {outcomes:?}), {} keyed todos with {keyed_attempts} attempts ({} overlaps of a key, \
         at most {} ms), {} acknowledged events, {} lost answers ({} dropped after the server \
         answered), {} stale reports refused, {} sessions lost, drained: {drained}, {} \
         violations; balancer {balancer_url}",
        started.elapsed().as_secs(),
        todos.len(),
        attempts.len(),
        keys.len(),
        overlaps.len(),
        overlaps.iter().map(|o| o.ms).max().unwrap_or(0),
        t.events.len(),
        t.lost_answers,
        losses.dropped.load(Ordering::Relaxed),
        t.stale_refused,
        t.sessions_lost,
        violations.len()
    );
    rt.block_on(async {
        let _ = admin
            .batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
            .await;
    });
    assert!(
        violations.is_empty(),
        "{} violations (servers' log: {}):\n{}",
        violations.len(),
        log.display(),
        violations.join("\n")
    );
    assert!(kills >= 3, "the nemesis killed only {kills} servers");
    assert!(todos.len() >= 100, "only {} todos were added", todos.len());
    assert!(
        keys.len() >= 20,
        "only {} keyed todos were added",
        keys.len()
    );
    assert!(died > 0, "no attempt died: the faults did not bite");
    assert!(t.stale_refused > 0, "no stale report was tried");
    assert!(t.lost_answers > 0, "no kill caught a request in flight");
    assert_eq!(
        t.sessions_lost, 0,
        "a session did not answer on another server"
    );
}

/// The checker sees each kind of violation (a check that cannot fail proves nothing).
#[test]
fn the_history_checker_catches_every_violation() {
    let row = |claimed_at, lease_expires_at, ended_at: Option<i64>, outcome: Option<&str>| Row {
        claimed_at,
        lease_expires_at,
        ended_at,
        outcome: outcome.map(str::to_string),
        closed_by: None,
    };
    let todos = |state: &str| BTreeMap::from([("t".to_string(), state.to_string())]);
    let key = |seq| ("t".to_string(), seq);
    let whole = BTreeMap::from([
        (key(1), row(0, 2_000, Some(2_000), Some("lease_expired"))),
        (key(2), row(2_000, 4_000, Some(3_000), Some("completed"))),
    ]);
    let events = vec![
        Event::Added { id: "t".into() },
        Event::Leased {
            id: "t".into(),
            seq: 1,
            until: 2_000,
        },
        Event::Reported {
            id: "t".into(),
            seq: 2,
            outcome: "completed",
        },
    ];
    assert!(check(&events, &todos("done"), &whole).is_empty());
    let cases: Vec<(&str, Vec<Event>, Todos, Attempts)> = vec![
        (
            "lost",
            vec![Event::Added { id: "u".into() }],
            todos("done"),
            BTreeMap::new(),
        ),
        (
            "completed 2 times",
            vec![],
            todos("done"),
            BTreeMap::from([
                (key(1), row(0, 2_000, Some(1_000), Some("completed"))),
                (key(2), row(1_000, 3_000, Some(2_000), Some("completed"))),
            ]),
        ),
        (
            "stale token",
            vec![],
            todos("done"),
            BTreeMap::from([(key(1), row(0, 2_000, Some(2_000), Some("completed")))]),
        ),
        (
            "before its lease expired",
            vec![],
            todos("done"),
            BTreeMap::from([
                (key(1), row(0, 2_000, Some(1_999), Some("reaped"))),
                (key(2), row(2_000, 4_000, Some(3_000), Some("completed"))),
            ]),
        ),
        (
            "open at once",
            vec![],
            todos("done"),
            BTreeMap::from([
                (key(1), row(0, 2_000, Some(2_500), Some("lease_expired"))),
                (key(2), row(2_100, 4_000, Some(3_000), Some("completed"))),
            ]),
        ),
        (
            "never closed",
            vec![],
            todos("claimed"),
            BTreeMap::from([(key(1), row(0, 2_000, None, None))]),
        ),
        (
            "but the attempt closed as",
            vec![Event::Reported {
                id: "t".into(),
                seq: 1,
                outcome: "completed",
            }],
            todos("failed"),
            BTreeMap::from([(key(1), row(0, 2_000, Some(1_000), Some("failed")))]),
        ),
        (
            "inside #1's granted lease",
            vec![Event::Leased {
                id: "t".into(),
                seq: 1,
                until: 3_000,
            }],
            todos("done"),
            BTreeMap::from([
                (key(1), row(0, 2_000, Some(2_000), Some("lease_expired"))),
                (key(2), row(2_000, 4_000, Some(3_000), Some("completed"))),
            ]),
        ),
    ];
    for (what, events, todos, attempts) in cases {
        let bad = check(&events, &todos, &attempts);
        assert!(bad.iter().any(|b| b.contains(what)), "{what}: {bad:?}");
    }
}

/// The key check sees two attempts of one key open at once, and only that (a check that cannot
/// fail proves nothing).
#[test]
fn the_key_check_catches_an_overlap() {
    let row = |claimed_at, ended_at: Option<i64>| Row {
        claimed_at,
        lease_expires_at: claimed_at + 2_000,
        ended_at,
        outcome: ended_at.map(|_| "completed".to_string()),
        closed_by: None,
    };
    let keys: Keys = [("a", "c0"), ("b", "c0"), ("c", "c0"), ("x", "c1")]
        .iter()
        .map(|(id, k)| (id.to_string(), k.to_string()))
        .collect();
    let at = |id: &str, seq| (id.to_string(), seq);
    // One after the other (claimed at the instant the previous ended), a takeover within one
    // todo, another key and an unkeyed todo at the same time: no overlap.
    let fine: Attempts = BTreeMap::from([
        (at("a", 1), row(0, Some(1_000))),
        (at("a", 2), row(1_000, Some(1_500))),
        (at("b", 1), row(1_500, Some(3_000))),
        (at("c", 1), row(3_000, None)),
        (at("x", 1), row(500, Some(2_000))),
        (at("y", 1), row(500, Some(2_000))),
    ]);
    assert!(key_overlaps(&keys, &fine).is_empty());
    // A claim 1 ms before the previous attempt of its key ended.
    let early: Attempts = BTreeMap::from([
        (at("a", 1), row(0, Some(1_000))),
        (at("b", 1), row(999, Some(2_000))),
    ]);
    let bad = key_overlaps(&keys, &early);
    assert_eq!(bad.len(), 1, "{bad:?}");
    assert_eq!(bad[0].ms, 1);
    assert!(
        bad[0].line.contains("b#1") && bad[0].line.contains("a#1"),
        "{bad:?}"
    );
    // An attempt never closed holds its key to the end; an overlap behind a long one is found
    // though a shorter one ended between.
    let open: Attempts = BTreeMap::from([
        (at("a", 1), row(0, None)),
        (at("b", 1), row(5_000, Some(6_000))),
    ]);
    assert_eq!(key_overlaps(&keys, &open)[0].ms, 1_000);
    let behind: Attempts = BTreeMap::from([
        (at("a", 1), row(0, Some(10_000))),
        (at("b", 1), row(100, Some(200))),
        (at("c", 1), row(300, Some(400))),
    ]);
    assert_eq!(key_overlaps(&keys, &behind).len(), 2);
}
