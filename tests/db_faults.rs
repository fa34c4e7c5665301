//! The database failing under real servers and real daemons: two `relay serve` processes on one
//! Postgres cluster of the test's own — server A connected directly, server B through an in-test
//! TCP proxy the test can cut — and one real `relay daemon` per server (four harnesses each, a
//! trivial agent and check, `@every 1s` and a doorbell trigger), while a producer adds todos over
//! MCP through both servers. Three faults in turn, each healed and followed by normal running:
//!
//! 1. Postgres restarted crash-like (`pg_ctl restart -m immediate`) under load;
//! 2. server B cut off from Postgres (every open connection reset, new ones refused) while its
//!    daemon holds a claim, until that claim's lease has lapsed by the database's clock;
//! 3. server A stopped (SIGSTOP, like a long GC or VM pause) while its daemon holds a claim,
//!    until that lease has lapsed, then continued (SIGCONT).
//!
//! In faults 2 and 3 a fenced holder of the test's own (a 5 s lease on queue `held`, which the
//! daemons leave alone) also sits behind the failing server, so a report under a lapsed token
//! is sure to be tried: the partitioned holder's `complete` once B is back, the paused one's sent
//! to A while it is stopped and read when it continues. Each must be refused `conflict`.
//!
//! Then the queue drains and the history checker of `common::history` (shared with
//! tests/multi_server.rs) runs over the acknowledged adds, the daemons' acknowledged reports
//! (their run records, matched to attempts by claimant) and the database's rows: no acknowledged
//! add lost, no todo completed twice, no two attempts of a todo open at once, no fenced write
//! accepted at or after its lease's expiry (a paused or partitioned holder's included). Besides:
//! every acknowledged todo ends `done`; each server recovers without a restart (the same process
//! answers `GET /healthz` 200 and a `tools/call`); and every call made during an outage is
//! answered (an error is fine) within the clients' 15 s timeout — only calls to the stopped
//! server itself may go unanswered.
//!
//! Leases are 1 minute, the shortest a daemon's config allows (`lease_ttl`, 1m to 1h), so the
//! cut and the pause each last a little over a minute. Bounded: about two and a half minutes;
//! every loop is bounded in count and time, and every wait polls a condition. The cluster is made with
//! initdb and pg_ctl (as the `postgres` user when the test runs as root), on a free loopback
//! port, and stopped and removed at the end, a panic included; the shared cluster of
//! `RELAY_TEST_POSTGRES` is never touched. Runs when `RELAY_TEST_POSTGRES` is set (to anything)
//! or `RELAY_REQUIRE_POSTGRES=1`, else skips; with `RELAY_REQUIRE_POSTGRES=1` missing PostgreSQL
//! server binaries fail it.
//!
//! `a_blackholed_database_is_answered_too` runs the same with a cut that holds new connections
//! unanswered instead of refusing them (the two run side by side, each on its own cluster).

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::history::{self, Event};
use common::{
    Daemon, Proc, harness_table_on, listening_on, relay, run_db, server_table, temp_dir, wait_for,
};
use serde_json::{Value, json};

/// The verbs of both endpoints: what a daemon drains with, and the producer's `add_todo`.
const VERBS: &str = "claim_next,claim,heartbeat,complete,fail,release,get_todo,list_todos,add_todo";
/// The daemons' lease: the shortest their config allows.
const LEASE_TTL: &str = "1m";
/// How long a client waits for any answer: a call still unanswered then is a hang.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);
/// Todos the producer adds at most, one every `ADD_EVERY`.
const TODOS: usize = 600;
const ADD_EVERY: Duration = Duration::from_millis(400);
/// Completions that make "some normal running" after a heal.
const NORMAL_RUN: i64 = 8;
/// The bound on one wait: a lease to lapse (a minute and a little), a server to answer again.
const LAPSE_BOUND: Duration = Duration::from_secs(100);
const WAIT_BOUND: Duration = Duration::from_secs(60);
/// `held_by`'s bound on a claim's age that takes every claim.
const ANY: i64 = i64::MAX / 4;
/// The database's clock, in ms since the epoch, read as the store reads it.
const DB_NOW: &str = "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint";

fn required() -> bool {
    std::env::var("RELAY_REQUIRE_POSTGRES").as_deref() == Ok("1")
}

/// Whether to run: `RELAY_TEST_POSTGRES` set (its cluster is not used) or Postgres required.
fn wanted() -> bool {
    let set = std::env::var("RELAY_TEST_POSTGRES").is_ok_and(|u| !u.is_empty());
    if !set && !required() {
        eprintln!(
            "SKIPPED: set RELAY_TEST_POSTGRES=… (or RELAY_REQUIRE_POSTGRES=1) to run the \
             database-fault test; it makes a throwaway cluster of its own"
        );
    }
    set || required()
}

/// A missing tool: a failure when Postgres is required, else a skip (`None`).
fn missing<T>(what: &str) -> Option<T> {
    assert!(
        !required(),
        "RELAY_REQUIRE_POSTGRES=1 but {what}: apt-get install postgresql"
    );
    eprintln!("SKIPPED: {what} (apt-get install postgresql)");
    None
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port()
}

/// A throwaway Postgres cluster in a temp dir on a free loopback port, made and driven with
/// initdb and pg_ctl as `.ci/postgres.sh` does; stopped (immediately) and removed on drop.
struct Cluster {
    bin: PathBuf,
    dir: tempfile::TempDir,
    port: u16,
    /// Root runs the tools as the `postgres` user: initdb refuses root.
    as_postgres: bool,
}

impl Cluster {
    /// `None` (after saying why) when the server binaries or the `postgres` user are missing.
    fn start() -> Option<Cluster> {
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path().join("bin"))
            .filter(|b| b.join("initdb").exists() && b.join("pg_ctl").exists())
            .max_by_key(|b| {
                let v = b.parent().and_then(|v| v.file_name());
                v.and_then(|v| v.to_str()?.parse::<u32>().ok())
            });
        let Some(bin) = bin else {
            return missing("the PostgreSQL server binaries are not in /usr/lib/postgresql");
        };
        use std::os::unix::fs::MetadataExt as _;
        let as_postgres = std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0);
        let dir = temp_dir("db-faults-pg");
        if as_postgres {
            let chown = Command::new("chown")
                .arg("postgres")
                .arg(dir.path())
                .status();
            if !chown.is_ok_and(|s| s.success()) {
                return missing("there is no postgres user to run initdb as");
            }
        }
        let c = Cluster {
            bin,
            dir,
            port: free_port(),
            as_postgres,
        };
        let d = c.dir.path().display();
        let out = c.sh(&format!(
            "'{}/initdb' -D '{d}/data' -U postgres -A trust -E UTF8 --no-locale",
            c.bin.display()
        ));
        assert!(out.status.success(), "initdb: {}", text(&out));
        c.pg_ctl("start");
        Some(c)
    }

    /// Runs `cmd` with sh, as the `postgres` user when root.
    fn sh(&self, cmd: &str) -> Output {
        let mut c = if self.as_postgres {
            let mut c = Command::new("su");
            c.args(["postgres", "-s", "/bin/sh", "-c", cmd]);
            c
        } else {
            let mut c = Command::new("sh");
            c.args(["-c", cmd]);
            c
        };
        c.stdin(Stdio::null())
            .output()
            .expect("run a Postgres tool")
    }

    /// `pg_ctl ACTION`, waiting (60 s at most) for it to finish.
    fn pg_ctl(&self, action: &str) {
        let d = self.dir.path().display();
        let out = self.sh(&format!(
            "'{}/pg_ctl' -D '{d}/data' -l '{d}/server.log' -w -t 60 -o \"-p {} -k '{d}' \
             -c listen_addresses=127.0.0.1 -c max_connections=100 -c fsync=off\" {action}",
            self.bin.display(),
            self.port
        ));
        let log = std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default();
        assert!(
            out.status.success(),
            "pg_ctl {action}: {}\n{log}",
            text(&out)
        );
    }

    fn url(&self, port: u16) -> String {
        format!("postgres://postgres@127.0.0.1:{port}/postgres")
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let d = self.dir.path().display();
        let _ = self.sh(&format!(
            "'{}/pg_ctl' -D '{d}/data' -m immediate -w -t 30 stop",
            self.bin.display()
        ));
    }
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// How the proxy treats new connections while cut (open ones are reset either way).
#[derive(Clone, Copy, Debug)]
enum Cut {
    /// Accepted and reset at once: as a database host whose port is closed.
    Refuse,
    /// Accepted and never answered until the heal resets them: as a partition.
    Blackhole,
}

#[derive(Default)]
struct ProxyState {
    cut: Option<Cut>,
    /// The copying tasks of the connections open through the proxy.
    open: Vec<tokio::task::AbortHandle>,
    /// New connections held unanswered while blackholed.
    held: Vec<tokio::net::TcpStream>,
}

/// A TCP proxy to Postgres that the test can cut and heal.
#[derive(Clone)]
struct Proxy {
    port: u16,
    state: Arc<Mutex<ProxyState>>,
}

impl Proxy {
    async fn start(upstream: SocketAddr) -> Proxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy");
        let port = listener.local_addr().expect("an address").port();
        let state = Arc::new(Mutex::new(ProxyState::default()));
        let st = state.clone();
        tokio::spawn(async move {
            loop {
                // The loop ends with the runtime (or on a failed accept: no spinning).
                let Ok((inbound, _)) = listener.accept().await else {
                    break;
                };
                let _ = inbound.set_zero_linger();
                // Checked and registered under the lock the cut takes: no connection slips past.
                let mut s = st.lock().unwrap();
                s.open.retain(|h| !h.is_finished());
                match s.cut {
                    Some(Cut::Refuse) => {
                        drop(inbound);
                        continue;
                    }
                    Some(Cut::Blackhole) => {
                        s.held.push(inbound);
                        continue;
                    }
                    None => {}
                }
                let task = tokio::spawn(async move {
                    let Ok(out) = tokio::net::TcpStream::connect(upstream).await else {
                        return;
                    };
                    let _ = out.set_zero_linger();
                    let (mut inbound, mut out) = (inbound, out);
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut out).await;
                });
                s.open.push(task.abort_handle());
            }
        });
        Proxy { port, state }
    }

    /// Resets every open connection and treats new ones as `how` says, until healed.
    fn cut(&self, how: Cut) -> usize {
        let mut s = self.state.lock().unwrap();
        s.cut = Some(how);
        let open: Vec<_> = s.open.drain(..).filter(|h| !h.is_finished()).collect();
        for h in &open {
            h.abort();
        }
        open.len()
    }

    /// Lets new connections through again (the held ones are reset).
    fn heal(&self) {
        let mut s = self.state.lock().unwrap();
        s.cut = None;
        s.held.clear();
    }
}

/// A `relay serve` child on a free port, its log appended to `log`: the child and its base URL.
fn start_server(db: &str, log: &Path) -> (Proc, String) {
    let err = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .expect("server log");
    let mut child = relay()
        .args(["serve", "--listen", "127.0.0.1:0", "--shutdown-grace", "1s"])
        .env("RELAY_DB", db)
        .env("RELAY_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::from(err))
        .spawn()
        .expect("start relay serve");
    let base = listening_on(&mut child).unwrap_or_else(|first| panic!("first line: {first:?}"));
    (Proc(child), base)
}

/// What a call got back.
enum Answer {
    /// The tool's structured content.
    Ok(Value),
    /// A clear refusal: a tool error's code, a JSON-RPC error or an HTTP status.
    Error(String),
    /// 404: the session is gone (answered, too).
    SessionLost,
    /// Nothing within `REQUEST_TIMEOUT`: a hang.
    Timeout,
    /// The connection failed without an answer.
    Dropped(String),
}

struct Mcp {
    http: reqwest::Client,
    url: String,
    token: String,
    session: Option<String>,
    next_id: u64,
}

fn http_client(timeout: Duration) -> reqwest::Client {
    // reqwest is built without a TLS provider; plain http still wants one installed.
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
        // A new connection per request: no race with the server closing an idle one.
        .pool_max_idle_per_host(0)
        .timeout(timeout)
        .build()
        .expect("a client")
}

impl Mcp {
    fn new(url: &str, token: &str) -> Mcp {
        Mcp::waiting(url, token, REQUEST_TIMEOUT)
    }

    /// A client that waits up to `timeout` for an answer.
    fn waiting(url: &str, token: &str, timeout: Duration) -> Mcp {
        Mcp {
            http: http_client(timeout),
            url: url.to_string(),
            token: token.to_string(),
            session: None,
            next_id: 1,
        }
    }

    async fn post(&mut self, body: Value) -> Result<(u16, Option<String>, Value), Answer> {
        let r = common::mcp_post(&self.http, &self.url, &self.token, self.session.as_deref());
        let failed = |e: reqwest::Error| {
            if e.is_timeout() {
                Answer::Timeout
            } else {
                // The error names the URL, never a header: no token in it.
                Answer::Dropped(e.to_string())
            }
        };
        let resp = r.body(body.to_string()).send().await.map_err(failed)?;
        let status = resp.status().as_u16();
        let session = resp
            .headers()
            .get("mcp-session-id")
            .and_then(|s| s.to_str().ok())
            .map(str::to_string);
        let text = resp.text().await.map_err(failed)?;
        Ok((
            status,
            session,
            serde_json::from_str(&text).unwrap_or(Value::Null),
        ))
    }

    /// A tools/call, with a session initialized first when there is none.
    async fn call(&mut self, tool: &str, args: Value) -> Answer {
        if self.session.is_none() {
            let body = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
                "protocolVersion": "2025-06-18", "capabilities": {},
                "clientInfo": {"name": "db-faults", "version": "0"}}});
            match self.post(body).await {
                Ok((200, Some(s), _)) => self.session = Some(s),
                Ok((status, _, _)) => return Answer::Error(format!("initialize: http {status}")),
                Err(a) => return a,
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        let body = json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
                          "params": {"name": tool, "arguments": args}});
        match self.post(body).await {
            Err(a) => a,
            Ok((404, _, _)) => {
                self.session = None;
                Answer::SessionLost
            }
            Ok((200, _, v)) if v["result"]["isError"] == json!(true) => Answer::Error(
                v["result"]["structuredContent"]["error"]["code"]
                    .as_str()
                    .unwrap_or("tool error")
                    .to_string(),
            ),
            Ok((200, _, v)) if v["result"]["structuredContent"].is_object() => {
                Answer::Ok(v["result"]["structuredContent"].clone())
            }
            Ok((200, _, v)) if v["error"].is_object() => {
                Answer::Error(format!("json-rpc {}", v["error"]["code"]))
            }
            Ok((status, _, _)) => Answer::Error(format!("http {status}")),
        }
    }
}

/// The phases of the run, for counting what the clients saw in each.
const PHASES: [&str; 5] = ["normal", "restart", "cut", "pause", "drain"];
const NORMAL: usize = 0;
const RESTART: usize = 1;
const CUT: usize = 2;
const PAUSE: usize = 3;
const DRAIN: usize = 4;

/// What the clients saw.
#[derive(Default)]
struct Tally {
    events: Vec<Event>,
    /// Acknowledged adds: the todo ids.
    added: Vec<String>,
    /// Clear error answers (calls and `/healthz` other than 200), per phase.
    errors: [usize; PHASES.len()],
    /// Calls answered ok, per phase.
    answered: [usize; PHASES.len()],
    /// The clear error answers by kind (a tool error's code, `http 503`, …).
    kinds: BTreeMap<String, usize>,
    /// Calls to the stopped server left unanswered (it cannot answer: not a violation).
    frozen: usize,
    /// Calls (and health checks) that got no answer: each one a violation.
    hangs: Vec<String>,
}

/// The state the test shares with its clients.
struct Shared {
    phase: AtomicUsize,
    /// Bumped when server A is stopped and when it is continued: odd while it is stopped.
    a_stops: AtomicUsize,
    stop_adding: AtomicBool,
    stop: AtomicBool,
    started: Instant,
    tally: Mutex<Tally>,
}

impl Shared {
    fn a_stopped(&self) -> bool {
        self.a_stops.load(Ordering::SeqCst) % 2 == 1
    }

    /// Records what a call to server `server` got; `stops_before` is `a_stops` at its start.
    fn record(&self, server: usize, what: &str, answer: &Answer, stops_before: usize) {
        let phase = self.phase.load(Ordering::SeqCst);
        let touched_a_stop = server == 0 && stops_before != self.a_stops.load(Ordering::SeqCst);
        let mut t = self.tally.lock().unwrap();
        match answer {
            Answer::Ok(_) => t.answered[phase] += 1,
            Answer::Error(kind) => {
                t.errors[phase] += 1;
                *t.kinds.entry(kind.clone()).or_default() += 1;
            }
            Answer::SessionLost => {
                t.errors[phase] += 1;
                *t.kinds.entry("session lost".into()).or_default() += 1;
            }
            Answer::Timeout | Answer::Dropped(_) if touched_a_stop || self.a_stopped() => {
                t.frozen += 1;
            }
            Answer::Timeout => t.hangs.push(format!(
                "{what} on server {}: no answer within {} s (at {} s, phase {})",
                SERVER_NAMES[server],
                REQUEST_TIMEOUT.as_secs(),
                self.started.elapsed().as_secs(),
                PHASES[phase]
            )),
            Answer::Dropped(e) => t.hangs.push(format!(
                "{what} on server {}: the connection failed without an answer ({e}) at {} s, \
                 phase {}",
                SERVER_NAMES[server],
                self.started.elapsed().as_secs(),
                PHASES[phase]
            )),
        }
    }
}

const SERVER_NAMES: [&str; 2] = ["A", "B"];

/// One way in for the producer: a server and an endpoint of it.
struct Target {
    server: usize,
    client: Mcp,
}

/// Adds todos round-robin over `targets` (skipping server A while it is stopped), one attempt
/// per todo, recording each acknowledged add.
async fn producer(mut targets: Vec<Target>, shared: Arc<Shared>) {
    let mut turn = 0usize;
    for i in 0..TODOS {
        if shared.stop_adding.load(Ordering::SeqCst) {
            break;
        }
        let mut pick = None;
        for _ in 0..targets.len() {
            let n = turn % targets.len();
            turn += 1;
            if !(targets[n].server == 0 && shared.a_stopped()) {
                pick = Some(n);
                break;
            }
        }
        let Some(n) = pick else {
            break;
        };
        let target = &mut targets[n];
        let stops = shared.a_stops.load(Ordering::SeqCst);
        let args = json!({"queue": "work", "title": format!("todo {i}"),
                          "idempotency_key": format!("k{i}"), "max_attempts": 20});
        let answer = target.client.call("add_todo", args).await;
        shared.record(target.server, "add_todo", &answer, stops);
        if let Answer::Ok(t) = answer {
            let id = t["id"].as_str().expect("an id").to_string();
            let mut tally = shared.tally.lock().unwrap();
            tally.added.push(id.clone());
            tally.events.push(Event::Added { id });
        }
        tokio::time::sleep(ADD_EVERY).await;
    }
}

/// Asks each server's `/healthz` every second (server A not while it is stopped), recording
/// each answer: a 503 during an outage is a clear answer, no answer is a hang.
async fn prober(bases: [String; 2], shared: Arc<Shared>) {
    let http = http_client(REQUEST_TIMEOUT);
    let bound = Instant::now() + Duration::from_secs(600);
    while !shared.stop.load(Ordering::SeqCst) && Instant::now() < bound {
        for (server, base) in bases.iter().enumerate() {
            if server == 0 && shared.a_stopped() {
                continue;
            }
            let stops = shared.a_stops.load(Ordering::SeqCst);
            let answer = match http.get(format!("{base}/healthz")).send().await {
                Ok(r) if r.status().as_u16() == 200 => Answer::Ok(Value::Null),
                Ok(r) => Answer::Error(format!("healthz {}", r.status().as_u16())),
                Err(e) if e.is_timeout() => Answer::Timeout,
                Err(e) => Answer::Dropped(e.to_string()),
            };
            shared.record(server, "GET /healthz", &answer, stops);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// A fenced holder of the test's own, through one server: a todo on queue `held` (which the
/// daemons do not drain), added and claimed with a lease of `HOLD_S` seconds, so that the test
/// knows its lease token and can send a report after its lease lapsed.
struct Held {
    id: String,
    seq: u32,
    fence: String,
}

/// The holder's lease, in seconds.
const HOLD_S: u64 = 5;

/// Bounded retries of a call the server must answer ok (it is up and healthy).
async fn must(c: &mut Mcp, tool: &str, args: Value) -> Value {
    let mut last = String::new();
    for _ in 0..10 {
        match c.call(tool, args.clone()).await {
            Answer::Ok(v) => return v,
            Answer::Error(e) => last = e,
            Answer::SessionLost => last = "session lost".into(),
            Answer::Timeout => last = "no answer".into(),
            Answer::Dropped(e) => last = e,
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("{tool} was not answered ok: {last}");
}

/// Claims todo `id` with a fence (a takeover once an earlier lease lapsed): the attempt's seq
/// and token; the granted lease is recorded.
async fn claim(c: &mut Mcp, id: &str, ttl: u64, tally: &Mutex<Tally>) -> (u32, String) {
    let v = must(
        c,
        "claim",
        json!({"id": id, "require_fence": true, "claimant": "db-faults-holder",
               "lease_ttl_seconds": ttl}),
    )
    .await;
    let seq = u32::try_from(v["attempt_seq"].as_u64().expect("a seq")).expect("a seq");
    let until = v["todo"]["lease_expires_at"]
        .as_str()
        .and_then(relay_core::time::parse_rfc3339)
        .expect("a lease");
    tally.lock().unwrap().events.push(Event::Leased {
        id: id.to_string(),
        seq,
        until,
    });
    let fence = v["lease_token"]
        .as_str()
        .expect("a lease token")
        .to_string();
    (seq, fence)
}

/// Adds a todo on `held` and claims it for `HOLD_S` seconds.
async fn hold(c: &mut Mcp, tally: &Mutex<Tally>) -> Held {
    let t = must(
        c,
        "add_todo",
        json!({"queue": "held", "title": "held by the test", "max_attempts": 5}),
    )
    .await;
    let id = t["id"].as_str().expect("an id").to_string();
    {
        let mut tally = tally.lock().unwrap();
        tally.added.push(id.clone());
        tally.events.push(Event::Added { id: id.clone() });
    }
    let (seq, fence) = claim(c, &id, HOLD_S, tally).await;
    Held { id, seq, fence }
}

/// The holder's report under its token: `complete`.
fn stale_complete(held: &Held) -> Value {
    json!({"id": held.id, "lease_token": held.fence, "summary": "done late"})
}

/// Judges the answer to the holder's report sent after its lease lapsed: it must be refused
/// `conflict`; `where_` says where the holder was.
fn judge_stale(answer: &Answer, held: &Held, where_: &str, bad: &mut Vec<String>) -> bool {
    match answer {
        Answer::Error(code) if code == "conflict" => true,
        Answer::Ok(_) => {
            bad.push(format!(
                "{}#{}: the {where_} holder's complete was accepted after its lease lapsed",
                held.id, held.seq
            ));
            false
        }
        Answer::Error(code) => {
            bad.push(format!(
                "{}#{}: the {where_} holder's late complete was answered {code}, not conflict",
                held.id, held.seq
            ));
            false
        }
        _ => {
            bad.push(format!(
                "{}#{}: the {where_} holder's late complete got no answer within {} s",
                held.id,
                held.seq,
                REQUEST_TIMEOUT.as_secs()
            ));
            false
        }
    }
}

/// Takes the held todo over after its lease lapsed and completes it (the todo must end done).
async fn finish(c: &mut Mcp, held: &Held, tally: &Mutex<Tally>) {
    let (seq, fence) = claim(c, &held.id, 60, tally).await;
    must(
        c,
        "complete",
        json!({"id": held.id, "lease_token": fence, "summary": "done"}),
    )
    .await;
    tally.lock().unwrap().events.push(Event::Reported {
        id: held.id.clone(),
        seq,
        outcome: "completed",
    });
}

/// A connection straight to the cluster (never through the proxy), made again after a restart.
struct Admin {
    url: String,
    client: Option<tokio_postgres::Client>,
}

impl Admin {
    async fn connect(&mut self) -> Option<&tokio_postgres::Client> {
        if self.client.as_ref().is_none_or(|c| c.is_closed()) {
            let (c, conn) = tokio_postgres::connect(&self.url, tokio_postgres::NoTls)
                .await
                .ok()?;
            tokio::spawn(conn);
            self.client = Some(c);
        }
        self.client.as_ref()
    }

    /// The first column of the first row of `sql` as an i64 (`None` while the database does
    /// not answer).
    fn i64(&mut self, rt: &tokio::runtime::Runtime, sql: &str) -> Option<i64> {
        rt.block_on(async {
            let c = self.connect().await?;
            match c.query_one(sql, &[]).await {
                Ok(r) => r.get::<_, Option<i64>>(0).or(Some(0)),
                Err(_) => {
                    self.client = None;
                    None
                }
            }
        })
    }

    /// Todos done so far.
    fn done(&mut self, rt: &tokio::runtime::Runtime) -> Option<i64> {
        self.i64(rt, "SELECT count(*) FROM todos WHERE state = 'done'")
    }

    /// The latest lease expiry among the open attempts daemon `d` holds (`sa`, `sb`, or `s_`
    /// for either), once it holds one claimed in the last `fresh_ms`.
    fn held_by(&mut self, rt: &tokio::runtime::Runtime, d: &str, fresh_ms: i64) -> Option<i64> {
        let sql = format!(
            "SELECT max(lease_expires_at) FROM todo_attempts WHERE ended_at IS NULL \
             AND claimant LIKE '%/{d}-__/run-%' AND claimed_at > ({DB_NOW}) - {fresh_ms}"
        );
        self.i64(rt, &sql).filter(|v| *v > 0)
    }
}

/// Sends `kill SIGNAL pid`.
fn signal(signal: &str, pid: u32) {
    let sent = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status();
    assert!(sent.is_ok_and(|s| s.success()), "kill {signal} {pid}");
}

/// A process's state letter from /proc (`T` when stopped).
fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // pid (comm) STATE …: comm may hold spaces and parentheses; the state follows the last ')'.
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// Polls `f` until it returns `Some`, at most `bound`; `None` then.
fn poll<T>(bound: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if start.elapsed() >= bound {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits for `NORMAL_RUN` more todos done than now: the queue runs normally.
fn normal_running(admin: &mut Admin, rt: &tokio::runtime::Runtime, after: &str) {
    let from = wait_for("the database to answer", WAIT_BOUND, || admin.done(rt));
    wait_for(
        &format!("{NORMAL_RUN} todos to complete after {after}"),
        WAIT_BOUND,
        || admin.done(rt).filter(|d| *d >= from + NORMAL_RUN),
    );
}

/// Waits for both servers to answer `/healthz` 200.
fn healthy(rt: &tokio::runtime::Runtime, bases: &[String; 2], what: &str) {
    let http = http_client(REQUEST_TIMEOUT);
    for (i, base) in bases.iter().enumerate() {
        wait_for(
            &format!(
                "server {} to answer /healthz 200 after {what}",
                SERVER_NAMES[i]
            ),
            WAIT_BOUND,
            || {
                // The answer is dropped inside the runtime, as reqwest needs.
                let status = rt.block_on(async {
                    let r = http.get(format!("{base}/healthz")).send().await;
                    r.map(|r| r.status().as_u16()).ok()
                });
                (status == Some(200)).then_some(())
            },
        );
    }
}

/// The daemon's config: for each endpoint (`a`, `b`) a queue source and a doorbell channel on
/// `base`, and two harnesses leased on it, named `{d}-{endpoint}{n}` (their claimant ends
/// `/{d}-…/run-N`, which tells the daemons apart in the database).
fn daemon_config(dir: &Path, d: &str, base: &str, tokens: &[(&str, &str)]) -> PathBuf {
    std::fs::create_dir_all(dir).expect("the daemon's dir");
    std::fs::write(
        dir.join("agent.sh"),
        "#!/bin/sh\n# Works a moment, says how it went, succeeds.\nsleep 1\n\
         printf '{\"summary\":\"done\"}' > \"$HARNESS_ATTEMPT_SUMMARY_FILE\"\nexit 0\n",
    )
    .expect("agent.sh");
    std::fs::write(
        dir.join("check.sh"),
        "#!/bin/sh\n[ \"${HARNESS_AGENT_EXIT:-1}\" = 0 ]\n",
    )
    .expect("check.sh");
    std::fs::write(dir.join("agent.env"), "DB_FAULTS=1\n").expect("agent.env");
    let mut text = String::new();
    for (ep, token) in tokens {
        let env = format!("{ep}.env");
        std::fs::write(dir.join(&env), format!("TOKEN={token}\n")).expect("token env");
        let url = format!("{base}/mcp/{ep}");
        text += &server_table(&format!("queue.{ep}"), &url, &env, "TOKEN");
        text += &format!("queue = \"work\"\nlease_ttl = \"{LEASE_TTL}\"\n");
        text += &server_table(&format!("channel.{ep}"), &url, &env, "TOKEN");
        for n in 1..=2 {
            text += &harness_table_on(
                &format!("{d}-{ep}{n}"),
                &format!("queue.{ep}"),
                &format!(
                    "schedule = \"@every 1s\"\ntriggers = [\"channel.{ep}\"]\nkeep_runs = 10000"
                ),
            );
        }
    }
    let path = dir.join("harness.toml");
    std::fs::write(&path, text).expect("config");
    path
}

/// The daemon's acknowledged reports (run records answered `completed` or `failed`) as events,
/// each matched to its attempt by claimant; a report with no such attempt is a violation.
fn reports(
    daemon: &Daemon,
    d: &str,
    claimants: &BTreeMap<(String, u64), (String, u32)>,
    bad: &mut Vec<String>,
    outcomes: &mut BTreeMap<String, usize>,
) -> Vec<Event> {
    let mut events = Vec::new();
    for ep in ["a", "b"] {
        for n in 1..=2 {
            let harness = format!("{d}-{ep}{n}");
            let records = daemon.cli_array(&["runs", &harness, "--json", "--limit", "10000"]);
            for r in records {
                let outcome = match r["relay_outcome"].as_str() {
                    Some(o) => o.to_string(),
                    // A firing that claimed nothing: why (`overlap`, `claim_failed`, …).
                    None => r["skipped_reason"]
                        .as_str()
                        .or(r["outcome"].as_str())
                        .unwrap_or("?")
                        .to_string(),
                };
                *outcomes.entry(outcome.clone()).or_default() += 1;
                let outcome = match outcome.as_str() {
                    "completed" => "completed",
                    "failed" => "failed",
                    _ => continue,
                };
                let run = r["run_id"].as_u64().expect("a run id");
                match claimants.get(&(harness.clone(), run)) {
                    Some((id, seq)) if r["todo_id"] == id.as_str() => {
                        events.push(Event::Reported {
                            id: id.clone(),
                            seq: *seq,
                            outcome,
                        });
                    }
                    found => bad.push(format!(
                        "{harness} run {run}: acknowledged {outcome} of {}, but the database's \
                         attempt of that claimant is {found:?}",
                        r["todo_id"]
                    )),
                }
            }
        }
    }
    events
}

#[test]
fn servers_and_daemons_survive_a_restart_a_cut_and_a_pause_of_their_database() {
    scenario(Cut::Refuse);
}

/// The cut as a partition that accepts connections and never answers them: nothing fails
/// fast, so only the server's `--answer-timeout` (8 s) turns B's calls into answers (503, outcome
/// unknown) instead of hangs. Before that bound, B left every `tools/call` unanswered until the
/// heal.
#[test]
fn a_blackholed_database_is_answered_too() {
    scenario(Cut::Blackhole);
}

/// The whole run, the cut treating new connections as `how` says.
fn scenario(how: Cut) {
    if !wanted() {
        return;
    }
    let Some(cluster) = Cluster::start() else {
        return;
    };
    let started = Instant::now();
    let tmp = temp_dir("db-faults");
    let dir = tmp.path();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // The main thread drops reqwest's answers and clients too: in the runtime's context.
    let _context = rt.enter();
    let direct = cluster.url(cluster.port);
    let upstream: SocketAddr = format!("127.0.0.1:{}", cluster.port).parse().unwrap();
    let proxy = rt.block_on(Proxy::start(upstream));
    let via_proxy = cluster.url(proxy.port);

    // The schema first (server A migrates), then B through the proxy; one endpoint per server.
    let (a, a_base) = start_server(&direct, &dir.join("server-a.log"));
    let (b, b_base) = start_server(&via_proxy, &dir.join("server-b.log"));
    let mut servers = [a, b];
    let bases = [a_base, b_base];
    let pids = servers.each_ref().map(|p| p.0.id());
    let mut tokens = Vec::new();
    for ep in ["a", "b"] {
        let (code, token, err) = run_db(&direct, &["endpoint", "create", ep, "--verbs", VERBS]);
        assert_eq!(code, 0, "endpoint create {ep}: {err}");
        tokens.push(token.trim().to_string());
    }
    let pairs = [("a", tokens[0].as_str()), ("b", tokens[1].as_str())];
    let mut daemons: Vec<Daemon> = [("sa", &bases[0]), ("sb", &bases[1])]
        .iter()
        .map(|(d, base)| {
            let ddir = dir.join(format!("daemon-{d}"));
            let config = daemon_config(&ddir, d, base, &pairs);
            Daemon::start(&ddir, &config)
        })
        .collect();

    let shared = Arc::new(Shared {
        phase: AtomicUsize::new(NORMAL),
        a_stops: AtomicUsize::new(0),
        stop_adding: AtomicBool::new(false),
        stop: AtomicBool::new(false),
        started,
        tally: Mutex::new(Tally::default()),
    });
    // The producer's ways in: both endpoints through both servers.
    let targets = [(0, 0), (1, 1), (0, 1), (1, 0)]
        .into_iter()
        .map(|(server, ep)| Target {
            server,
            client: Mcp::new(
                &format!("{}/mcp/{}", bases[server], ["a", "b"][ep]),
                &tokens[ep],
            ),
        })
        .collect();
    let producer = rt.spawn(producer(targets, shared.clone()));
    let prober = rt.spawn(prober(bases.clone(), shared.clone()));
    let mut admin = Admin {
        url: direct.clone(),
        client: None,
    };
    let phase = |p: usize| shared.phase.store(p, Ordering::SeqCst);
    let mut bad = Vec::new();
    // The holder's late reports refused `conflict` (one per fault it sits through).
    let mut stale_refused = 0;

    // Normal running: both daemons complete work.
    for d in ["sa", "sb"] {
        wait_for(
            &format!("daemon {d} to complete a todo"),
            WAIT_BOUND,
            || {
                let sql = format!(
                    "SELECT count(*) FROM todo_attempts WHERE outcome = 'completed' \
                     AND claimant LIKE '%/{d}-__/run-%'"
                );
                admin.i64(&rt, &sql).filter(|n| *n > 0)
            },
        );
    }
    normal_running(&mut admin, &rt, "the start");

    // Fault 1: Postgres restarted crash-like, with work in flight.
    wait_for("a claim in flight", WAIT_BOUND, || {
        admin.held_by(&rt, "s_", 1_000)
    });
    phase(RESTART);
    cluster.pg_ctl("-m immediate restart");
    healthy(&rt, &bases, "the restart");
    phase(NORMAL);
    normal_running(&mut admin, &rt, "the restart");

    // Fault 2: server B cut off from Postgres while its daemon holds a claim, until every lease
    // B's daemon held has lapsed by the database's clock; then healed.
    let lapse = wait_for("daemon sb to hold a claim", WAIT_BOUND, || {
        admin.held_by(&rt, "sb", 500)
    });
    // The test's own holder through B too: its token lets the test report after the lapse.
    let mut holder_b = Mcp::new(&format!("{}/mcp/a", bases[1]), &tokens[0]);
    let held_b = rt.block_on(hold(&mut holder_b, &shared.tally));
    phase(CUT);
    let cut_at = Instant::now();
    let reset = proxy.cut(how);
    // Cut off, B can only refuse the holder's report, and must say so in time.
    let stops = shared.a_stops.load(Ordering::SeqCst);
    let answer = rt.block_on(holder_b.call("complete", stale_complete(&held_b)));
    shared.record(1, "the partitioned holder's complete", &answer, stops);
    if let Answer::Ok(_) = answer {
        bad.push(format!(
            "{}#{}: completed through server B while B was cut off from its database",
            held_b.id, held_b.seq
        ));
    }
    // Leases B's daemon got in the instant before the cut count too.
    let lapse = admin.held_by(&rt, "sb", ANY).unwrap_or(lapse).max(lapse);
    wait_for("server B's daemon's leases to lapse", LAPSE_BOUND, || {
        admin.i64(&rt, DB_NOW).filter(|now| *now > lapse + 1_000)
    });
    proxy.heal();
    let cut_for = cut_at.elapsed();
    healthy(&rt, &bases, "the cut");
    // The partitioned holder reports again once B is back: its lease lapsed meanwhile.
    let answer = rt.block_on(holder_b.call("complete", stale_complete(&held_b)));
    stale_refused += usize::from(judge_stale(&answer, &held_b, "partitioned", &mut bad));
    rt.block_on(finish(&mut holder_b, &held_b, &shared.tally));
    phase(NORMAL);
    normal_running(&mut admin, &rt, "the cut");

    // Fault 3: server A stopped while its daemon holds a claim, until every lease A's daemon
    // held has lapsed; then continued.
    let lapse = wait_for("daemon sa to hold a claim", WAIT_BOUND, || {
        admin.held_by(&rt, "sa", 500)
    });
    // The test's own holder through A, whose report waits for A as long as A is stopped.
    let patient = LAPSE_BOUND + REQUEST_TIMEOUT * 2;
    let mut holder_a = Mcp::waiting(&format!("{}/mcp/b", bases[0]), &tokens[1], patient);
    let held_a = rt.block_on(hold(&mut holder_a, &shared.tally));
    phase(PAUSE);
    let a_pid = servers[0].0.id();
    let paused_at = Instant::now();
    signal("-STOP", a_pid);
    shared.a_stops.fetch_add(1, Ordering::SeqCst);
    wait_for("server A to stop", WAIT_BOUND, || {
        (process_state(a_pid) == Some('T')).then_some(())
    });
    // Sent to the stopped server: the kernel takes it, A reads it when it continues.
    let args = stale_complete(&held_a);
    let report = rt.spawn(async move { holder_a.call("complete", args).await });
    // Read once A is stopped: nothing it holds can change until it continues.
    let lapse = admin.held_by(&rt, "sa", ANY).unwrap_or(lapse).max(lapse);
    wait_for("server A's daemon's leases to lapse", LAPSE_BOUND, || {
        admin.i64(&rt, DB_NOW).filter(|now| *now > lapse + 1_000)
    });
    signal("-CONT", a_pid);
    shared.a_stops.fetch_add(1, Ordering::SeqCst);
    let paused_for = paused_at.elapsed();
    // A continued: the report it held is answered within the clients' timeout, refused.
    let answer = rt
        .block_on(tokio::time::timeout(REQUEST_TIMEOUT, report))
        .map(|joined| joined.expect("the holder's report ran"))
        .unwrap_or(Answer::Timeout);
    stale_refused += usize::from(judge_stale(&answer, &held_a, "paused", &mut bad));
    healthy(&rt, &bases, "the pause");
    let mut holder_a = Mcp::new(&format!("{}/mcp/b", bases[0]), &tokens[1]);
    rt.block_on(finish(&mut holder_a, &held_a, &shared.tally));
    phase(NORMAL);
    normal_running(&mut admin, &rt, "the pause");

    // The drain: no more adds; every todo done or failed (bounded).
    phase(DRAIN);
    shared.stop_adding.store(true, Ordering::SeqCst);
    rt.block_on(async {
        tokio::time::timeout(REQUEST_TIMEOUT * 2, producer)
            .await
            .expect("the producer ends within the bound")
            .expect("the producer ran to its end");
    });
    // Not drained in time: the checker names every todo left over.
    let drained = poll(WAIT_BOUND * 2, || {
        admin
            .i64(
                &rt,
                "SELECT count(*) FROM todos WHERE state NOT IN ('done', 'failed')",
            )
            .filter(|left| *left == 0)
    })
    .is_some();

    // Each server recovered by itself: the same process answers a tools/call and /healthz.
    for (i, p) in servers.iter_mut().enumerate() {
        let name = SERVER_NAMES[i];
        if p.0.try_wait().expect("a status").is_some() || p.0.id() != pids[i] {
            bad.push(format!("server {name} is not the process started"));
        }
        let mut c = Mcp::new(&format!("{}/mcp/a", bases[i]), &tokens[0]);
        match rt.block_on(c.call("list_todos", json!({"queue": "work"}))) {
            Answer::Ok(_) => {}
            _ => bad.push(format!(
                "server {name} answers no list_todos after the faults"
            )),
        }
    }
    healthy(&rt, &bases, "the drain");
    shared.stop.store(true, Ordering::SeqCst);
    rt.block_on(async {
        tokio::time::timeout(REQUEST_TIMEOUT * 2, prober)
            .await
            .expect("the prober ends within the bound")
            .expect("the prober ran to its end");
    });
    for (d, daemon) in ["sa", "sb"].iter().zip(daemons.iter_mut()) {
        let p = daemon.proc.as_mut().expect("the daemon runs");
        if p.0.try_wait().expect("a status").is_some() {
            bad.push(format!("daemon {d} ended during the faults"));
        }
        daemon.stop();
    }

    // The history: acknowledged adds, the daemons' acknowledged reports and the rows.
    let (todos, attempts) = rt.block_on(async {
        let c = admin.connect().await.expect("the database answers");
        history::read_ledger(c, "public").await
    });
    let (claimants, late) = rt.block_on(async {
        let c = admin.connect().await.expect("the database answers");
        let rows = c
            .query(
                "SELECT todo_id, seq, claimant FROM todo_attempts WHERE claimant IS NOT NULL",
                &[],
            )
            .await
            .expect("read the claimants");
        let mut by_run = BTreeMap::new();
        for r in rows {
            let (id, seq, claimant): (String, i32, String) = (r.get(0), r.get(1), r.get(2));
            // harness/<host>/<harness>/run-<n>
            let mut parts = claimant.rsplitn(3, '/');
            let run = parts
                .next()
                .and_then(|r| r.strip_prefix("run-")?.parse().ok());
            if let (Some(run), Some(harness)) = (run, parts.next()) {
                by_run.insert(
                    (harness.to_string(), run),
                    (id, u32::try_from(seq).expect("a seq")),
                );
            }
        }
        let late: i64 = c
            .query_one(
                "SELECT coalesce(sum(late_reports_total), 0)::bigint FROM todo_attempts",
                &[],
            )
            .await
            .expect("count the late reports")
            .get(0);
        (by_run, late)
    });
    let mut outcomes = BTreeMap::new();
    let mut tally = shared.tally.lock().unwrap();
    for (d, daemon) in ["sa", "sb"].iter().zip(daemons.iter()) {
        let events = reports(daemon, d, &claimants, &mut bad, &mut outcomes);
        tally.events.extend(events);
    }
    bad.extend(history::check(&tally.events, &todos, &attempts));
    for id in &tally.added {
        if todos.get(id).is_some_and(|s| s != "done") {
            bad.push(format!("{id}: acknowledged, ended {}", todos[id]));
        }
    }
    bad.extend(tally.hangs.iter().cloned());

    let died = attempts
        .values()
        .filter(|a| matches!(a.outcome.as_deref(), Some("lease_expired" | "reaped")))
        .count();
    let reported = tally
        .events
        .iter()
        .filter(|e| matches!(e, Event::Reported { .. }))
        .count();
    let outage_errors = tally.errors[RESTART] + tally.errors[CUT] + tally.errors[PAUSE];
    eprintln!(
        "db-faults: {} s, 3 faults injected (postgres restarted -m immediate; server B cut from \
         postgres for {} s ({how:?}), {reset} connections reset; server A stopped for {} s), {} \
         operations checked ({} acknowledged adds, {reported} acknowledged reports, {} \
         attempts: {died} died, {late} late reports recorded; the test's holder's late \
         completes refused {stale_refused} of 2), {outage_errors} errors answered \
         during outages (restart {}, cut {}, pause {}; by kind {:?}), {} calls to the stopped server \
         unanswered, {} hangs, drained: {drained}, daemon outcomes {outcomes:?}, {} violations",
        started.elapsed().as_secs(),
        cut_for.as_secs(),
        paused_for.as_secs(),
        tally.events.len() + attempts.len(),
        tally.added.len(),
        attempts.len(),
        tally.errors[RESTART],
        tally.errors[CUT],
        tally.errors[PAUSE],
        tally.kinds,
        tally.frozen,
        tally.hangs.len(),
        bad.len()
    );
    if !bad.is_empty() {
        // Keep the logs (servers', daemons', agents') for whoever reads the failure.
        let kept = tmp.keep();
        panic!(
            "{} violations (logs kept in {}):\n{}",
            bad.len(),
            kept.display(),
            bad.join("\n")
        );
    }
    assert!(
        tally.added.len() >= 100,
        "only {} adds acknowledged",
        tally.added.len()
    );
    assert!(died > 0, "no attempt died: the faults did not bite");
    assert!(tally.errors[CUT] > 0, "no call was refused during the cut");
    drop(servers);
    drop(cluster);
}
