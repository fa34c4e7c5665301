//! Several servers on one database (issue 16): MCP sessions live in the store, so a session made
//! on one server answers on another, counts against caps shared by all, and survives a restart.
//! On SQLite (two store handles on one file, as two processes would be) and, when
//! `RELAY_TEST_POSTGRES` names a server, on Postgres.
//!
//! Time is a `ManualClock` per server; waits carry a timeout only as a failure bound.

#[path = "support/harness.rs"]
mod harness;

#[path = "support/db.rs"]
mod db;

/// The fault tests' history checker (its per-key check, unit-tested in tests/multi_server.rs).
#[path = "../../../tests/common/history.rs"]
#[allow(dead_code)]
mod history;

use db::Db;
use harness::{Harness, T0};
use relay_core::ledger::LedgerConfig;
use relay_server::server::SESSION_RECHECK;
use serde_json::json;

const VERBS: &[&str] = &[
    "claim_next",
    "heartbeat",
    "complete",
    "list_todos",
    "add_todo",
];

/// A server over its own handle on `db`; the first one owns the Postgres schema (dropped with it).
async fn server(
    db: &Db,
    seed: u64,
    tweak: impl FnOnce(&mut relay_server::server::ServerConfig),
) -> Harness {
    let store = db.open_manual(LedgerConfig::default()).await;
    let mut h = Harness::start_on(store, seed, tweak, false).await;
    if let (Db::Postgres { url, schema }, 1) = (db, seed) {
        h.pg_schema = Some((url.clone(), schema.clone()));
    }
    h
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_made_on_one_server_answers_on_another_and_survives_a_restart() {
    for db in Db::all("mu") {
        let name = db.name();
        let caps = |c: &mut relay_server::server::ServerConfig| c.max_sessions_per_endpoint = 3;
        let a = server(&db, 1, caps).await;
        let b = server(&db, 2, caps).await;
        let token = a.endpoint("ci", VERBS, None).await;
        let mut on_a = a.mcp("ci", &token);
        on_a.init().await;
        // The same session, sent to the other server.
        let mut on_b = b.mcp("ci", &token);
        on_b.session = on_a.session.clone();
        assert_eq!(on_b.rpc("ping", json!({})).await.0, 200, "{name}");
        let added = on_b
            .ok("add_todo", json!({"queue": "q", "title": "t"}))
            .await;
        assert_eq!(added["state"], "pending", "{name}");
        // B holds A's session's stream (`stream` asserts 200); kept open, so that the session is
        // never ended to make room below.
        let _on_b_stream = on_b.stream().await;
        // Bound to its endpoint on every server.
        let other = a.endpoint("other", VERBS, None).await;
        let mut foreign = b.mcp("other", &other);
        foreign.session = on_a.session.clone();
        assert_eq!(foreign.rpc("ping", json!({})).await.0, 404, "{name}");

        // The caps count every server's sessions: 3 per endpoint, one on A, two more anywhere.
        // Each holds a doorbell stream (on either server), so none is ended to make room.
        let mut second = b.mcp("ci", &token);
        second.init().await;
        let _second_stream = second.stream().await;
        let mut third = a.mcp("ci", &token);
        third.init().await;
        let _third_stream = third.stream().await;
        let over = a.mcp("ci", &token).post_raw(init_body()).await;
        assert_eq!(over.status(), 503, "{name}: the cap spans the servers");
        let over = b.mcp("ci", &token).post_raw(init_body()).await;
        assert_eq!(over.status(), 503, "{name}");

        // Ended on B: A's cached check answers for at most SESSION_RECHECK, then A refuses it.
        let mut ending = b.mcp("ci", &token);
        ending.session = third.session.clone();
        let r = ending
            .request(reqwest::Method::DELETE)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 204, "{name}");
        a.clock.advance(SESSION_RECHECK);
        assert_eq!(
            third.rpc("ping", json!({})).await.0,
            404,
            "{name}: ended on B"
        );
        // ... and freed its place under the cap.
        third.init().await;

        // A restart: both servers go, a new one over a new store handle answers the session.
        let session = second.session.clone();
        drop(b);
        let c = server(&db, 3, caps).await;
        let mut on_c = c.mcp("ci", &token);
        on_c.session = session;
        assert_eq!(
            on_c.rpc("ping", json!({})).await.0,
            200,
            "{name}: survives a restart"
        );
        let listed = on_c.ok("list_todos", json!({"queue": "q"})).await;
        assert_eq!(
            listed["todos"].as_array().map(Vec::len),
            Some(1),
            "{name}: {listed}"
        );
        drop(c);
        drop(a);
        let _ = T0;
    }
}

fn init_body() -> String {
    json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "test", "version": "0"}}})
    .to_string()
}

/// A todo added through server A, or by the CLI (a store handle of its own), rings a stream held
/// on server B at once, through Postgres' NOTIFY. B's doorbell scan is put an hour apart, so
/// only the notice can ring it inside the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_todo_added_through_one_server_rings_a_stream_held_on_another() {
    let Some(db) = Db::all("mu").pop() else {
        return;
    };
    if !matches!(db, Db::Postgres { .. }) {
        return;
    }
    let a = server(&db, 1, |_| {}).await;
    let store = db.open_manual(LedgerConfig::default()).await;
    let mut b = Harness::start_on(
        store,
        2,
        |c| c.requeue_interval = std::time::Duration::from_secs(3600),
        true,
    )
    .await;
    let mut live = b.server.notices_live();
    tokio::time::timeout(harness::BOUND, live.wait_for(|v| *v))
        .await
        .expect("B listens within the bound")
        .unwrap();
    let token = a.endpoint("ci", VERBS, None).await;
    let mut on_b = b.mcp("ci", &token);
    on_b.init().await;
    let mut stream = on_b.stream().await;
    let mut buf = String::new();
    let mut on_a = a.mcp("ci", &token);
    on_a.init().await;

    let cli = db.open_manual(LedgerConfig::default()).await;
    let mut latencies = Vec::new();
    for (i, queue) in ["q1", "q2"].into_iter().enumerate() {
        if i == 1 {
            // The gate allows one ring a minute: B's clock moves past the window first.
            b.clock.advance(relay_core::doorbell::WINDOW);
        }
        let started = std::time::Instant::now();
        if i == 0 {
            on_a.ok("add_todo", json!({"queue": queue, "title": "t"}))
                .await;
        } else {
            // As `relay todo add` does: straight into the store, no server involved.
            cli.apply(relay_core::ledger::Op::AddTodo {
                now: T0,
                endpoint: "ci".into(),
                new: relay_core::ledger::NewTodo {
                    id: "td_cli".into(),
                    queue: queue.into(),
                    title: "from the CLI".into(),
                    ..Default::default()
                },
            })
            .await
            .unwrap();
        }
        let ring = harness::next_event(&mut stream, &mut buf, harness::BOUND)
            .await
            .expect("B's stream rings within the bound");
        latencies.push(started.elapsed());
        assert_eq!(ring["method"], "notifications/todo_ready");
        assert_eq!(ring["params"]["queues"], json!([queue]));
    }
    // For the closing note: the time from the add's call to B's frame (the add's own round
    // trip included).
    eprintln!("cross-server ring latency: {latencies:?}");

    // The notice connection is lost: B notices, reconnects, and rings across servers again.
    let Db::Postgres { url, .. } = &db else {
        unreachable!()
    };
    let (admin, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    admin
        .batch_execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE application_name = 'relay doorbell'",
        )
        .await
        .unwrap();
    tokio::time::timeout(harness::BOUND, live.wait_for(|v| !*v))
        .await
        .expect("B sees its notice connection go")
        .unwrap();
    tokio::time::timeout(harness::BOUND, live.wait_for(|v| *v))
        .await
        .expect("B listens again within the bound")
        .unwrap();
    b.clock.advance(relay_core::doorbell::WINDOW);
    on_a.ok("add_todo", json!({"queue": "q3", "title": "after"}))
        .await;
    let ring = harness::next_event(&mut stream, &mut buf, harness::BOUND)
        .await
        .expect("B's stream rings after the reconnect");
    assert_eq!(ring["params"]["queues"], json!(["q3"]));
    b.stop_and_wait().await.unwrap();
}

/// Two servers on one database with one clock (as servers on one Postgres read one clock); the
/// first owns the Postgres schema.
async fn two_servers(db: &Db) -> (Harness, Harness) {
    let clock = relay_core::time::ManualClock::new(T0);
    let mut hs = Vec::new();
    for seed in [1, 2] {
        let store = db.open_manual(LedgerConfig::default()).await;
        let h = Harness::start_on_clock(store, seed, clock.clone(), |_| {}, false).await;
        hs.push(h);
    }
    let b = hs.pop().unwrap();
    let mut a = hs.pop().unwrap();
    if let Db::Postgres { url, schema } = db {
        a.pg_schema = Some((url.clone(), schema.clone()));
    }
    (a, b)
}

/// Sets `queue`'s limits as `relay queue set` does.
async fn set_limits(h: &Harness, queue: &str, change: relay_core::ledger::LimitsChange) {
    let op = relay_core::ledger::Op::SetQueueLimits {
        now: h.now(),
        actor: relay_core::ledger::Actor::cli(),
        queue: queue.into(),
        change,
    };
    h.store.apply(op).await.unwrap();
}

/// Sets one limit of `queue`.
fn limit(name: &str, n: u32) -> relay_core::ledger::LimitsChange {
    let mut c = relay_core::ledger::LimitsChange::default();
    match name {
        "max_claimed" => c.max_claimed = Some(Some(n)),
        "max_claimed_per_key" => c.max_claimed_per_key = Some(Some(n)),
        _ => c.claims_per_minute = Some(Some(n)),
    }
    c
}

/// The keys and every attempt of the todos of `queue`, as the attempt ledger keeps them, in the
/// shapes the fault tests' history checker reads.
async fn attempts(h: &Harness, queue: &str) -> (history::Keys, history::Attempts) {
    use relay_core::ledger::{Actor, Op, TodoFilter};
    let filter = TodoFilter {
        queues: Some(vec![queue.to_string()]),
        limit: 1_000,
        ..TodoFilter::default()
    };
    let listed = h
        .store
        .apply(Op::ListTodos {
            actor: Actor::cli(),
            filter,
        })
        .await
        .unwrap()
        .todos()
        .unwrap();
    let (mut keys, mut attempts) = (history::Keys::new(), history::Attempts::new());
    let ms = |t: u64| i64::try_from(t).unwrap();
    for t in listed {
        if let Some(k) = &t.concurrency_key {
            keys.insert(t.id.clone(), k.clone());
        }
        let op = Op::GetTodo {
            actor: Actor::cli(),
            id: t.id.clone(),
            attempts_limit: 100,
        };
        let view = h.store.apply(op).await.unwrap().view().unwrap();
        for a in view.attempts {
            let row = history::Row {
                claimed_at: ms(a.claimed_at),
                lease_expires_at: ms(a.lease_expires_at),
                ended_at: a.ended_at.map(ms),
                outcome: a.outcome.map(|o| o.as_str().to_string()),
                closed_by: a.closed_by.clone(),
            };
            attempts.insert((t.id.clone(), a.seq), row);
        }
    }
    (keys, attempts)
}

/// `complete`'s arguments for a `claim_next` answer.
fn done(claim: &serde_json::Value) -> serde_json::Value {
    let mut args = json!({"id": claim["todo"]["id"]});
    if let Some(t) = claim.get("lease_token") {
        args["lease_token"] = t.clone();
    }
    args
}

/// Flow control across two servers on one database, in both MCP eras (CONTRACT "Flow control"):
/// with `max_claimed_per_key 1`, 8 workers (two legacy and two modern clients on each server)
/// drain 60 todos over 4 keys and no two todos of one key are ever claimed at once (judged from
/// the attempt ledger), while the other keys flow; `max_claimed` and `claims_per_minute` hold
/// whichever server is asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flow_limits_hold_across_two_servers() {
    for db in Db::all("fl") {
        let name = db.name();
        let (a, b) = two_servers(&db).await;
        let token = a.endpoint("ci", VERBS, None).await;
        let clients = |i: usize| {
            let h = if i.is_multiple_of(2) { &a } else { &b };
            if i % 4 < 2 {
                h.mcp("ci", &token)
            } else {
                h.mcp_modern("ci", &token)
            }
        };
        let mut workers = Vec::new();
        for i in 0..8 {
            let mut c = clients(i);
            if !c.modern {
                c.init().await;
            }
            workers.push(c);
        }

        // One of each key at a time, the four keys at once, whichever server claims.
        set_limits(&a, "keys", limit("max_claimed_per_key", 1)).await;
        for i in 0..60 {
            let key = format!("k{}", i % 4);
            let added = workers[i % 8]
                .ok(
                    "add_todo",
                    json!({"queue": "keys", "title": format!("t{i}"), "concurrency_key": key}),
                )
                .await;
            assert_eq!(added["concurrency_key"], key.as_str(), "{name}: {added}");
        }
        let (mut first, mut claims) = (Vec::new(), Vec::new());
        for w in workers.iter_mut().take(4) {
            let next = w.ok("claim_next", json!({"queue": "keys"})).await;
            first.push(next["todo"]["concurrency_key"].to_string());
            claims.push(next);
        }
        first.sort();
        assert_eq!(
            first,
            ["\"k0\"", "\"k1\"", "\"k2\"", "\"k3\""],
            "{name}: the other keys flow"
        );
        let held = workers[4].ok("claim_next", json!({"queue": "keys"})).await;
        assert!(
            held["todo"].is_null(),
            "{name}: every key is at its limit: {held}"
        );
        let lines = b.store.queue_lines(b.now()).await.unwrap();
        let line = lines.iter().find(|l| l.queue == "keys").unwrap();
        assert_eq!((line.claimed, line.held_back), (4, 56), "{name}: {line:?}");
        // The four finish, then 8 workers drain the rest.
        a.clock.advance(1);
        for (w, claim) in workers.iter_mut().zip(&claims) {
            w.ok("complete", done(claim)).await;
        }
        let (done_tx, done_rx) = tokio::sync::watch::channel(0usize);
        let done_tx = std::sync::Arc::new(done_tx);
        // The clock moves only while no request is in flight (requests hold `epoch` shared, a
        // step holds it alone): a request reads its time and commits within one instant, so the
        // ledger's timestamps follow the order the claims and completions committed in.
        let epoch = std::sync::Arc::new(tokio::sync::RwLock::new(()));
        let mut tasks = tokio::task::JoinSet::new();
        for mut w in workers.drain(..) {
            let (clock, done_tx, mut done_rx) = (a.clock.clone(), done_tx.clone(), done_rx.clone());
            let epoch = epoch.clone();
            tasks.spawn(async move {
                let mut mine = 0;
                loop {
                    done_rx.borrow_and_update();
                    if *done_rx.borrow() == 56 {
                        return (w, mine);
                    }
                    let next = {
                        let _in_flight = epoch.read().await;
                        w.ok("claim_next", json!({"queue": "keys"})).await
                    };
                    if next["todo"].is_null() {
                        // Held back (or all claimed): wait for a todo to end.
                        let _ = done_rx.changed().await;
                        continue;
                    }
                    // Works for a while: the clock moves between its claim and its completion.
                    {
                        let _step = epoch.write().await;
                        clock.advance(1);
                    }
                    let _in_flight = epoch.read().await;
                    w.ok("complete", done(&next)).await;
                    mine += 1;
                    done_tx.send_modify(|n| *n += 1);
                }
            });
        }
        let drained = tokio::time::timeout(std::time::Duration::from_secs(120), async {
            let mut total = 0;
            while let Some(r) = tasks.join_next().await {
                let (w, mine) = r.unwrap();
                workers.push(w);
                total += mine;
            }
            total
        })
        .await
        .expect("the drain ends (a failure bound, not a timing)");
        assert_eq!(drained, 56, "{name}");
        let (keys, history) = attempts(&a, "keys").await;
        assert_eq!(history.len(), 60, "{name}: one attempt each");
        let overlaps = history::key_overlaps(&keys, &history);
        assert!(
            overlaps.is_empty(),
            "{name}: one key claimed twice at once: {overlaps:?}"
        );

        // max_claimed 2: the third claim waits for one to end, on either server.
        set_limits(&b, "cap", limit("max_claimed", 2)).await;
        for i in 0..3 {
            workers[0]
                .ok(
                    "add_todo",
                    json!({"queue": "cap", "title": format!("c{i}")}),
                )
                .await;
            a.clock.advance(1);
        }
        let one = workers[0].ok("claim_next", json!({"queue": "cap"})).await;
        workers[1].ok("claim_next", json!({"queue": "cap"})).await;
        let none = workers[2].ok("claim_next", json!({"queue": "cap"})).await;
        assert!(none["todo"].is_null(), "{name}: max_claimed 2: {none}");
        workers[0].ok("complete", done(&one)).await;
        let third = workers[3].ok("claim_next", json!({"queue": "cap"})).await;
        assert_eq!(third["todo"]["title"], "c2", "{name}: {third}");

        // claims_per_minute 2: a third claim within the minute waits for the window to move.
        set_limits(&a, "rate", limit("claims_per_minute", 2)).await;
        for i in 0..3 {
            workers[0]
                .ok(
                    "add_todo",
                    json!({"queue": "rate", "title": format!("r{i}")}),
                )
                .await;
            a.clock.advance(1);
        }
        workers[0].ok("claim_next", json!({"queue": "rate"})).await;
        workers[1].ok("claim_next", json!({"queue": "rate"})).await;
        a.clock.advance(59_000);
        let none = workers[2].ok("claim_next", json!({"queue": "rate"})).await;
        assert!(
            none["todo"].is_null(),
            "{name}: claims_per_minute 2: {none}"
        );
        a.clock.advance(1_000);
        let third = workers[3].ok("claim_next", json!({"queue": "rate"})).await;
        assert_eq!(third["todo"]["title"], "r2", "{name}: {third}");
    }
}
