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
