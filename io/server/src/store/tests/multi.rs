//! Postgres with several servers: every lease follows the database's clock, never a caller's.

use relay_core::Millis;
use relay_core::ledger::{Actor, ClaimOpts, Outcome};
use relay_core::testing::Queue;
use relay_core::time::SECOND;

use super::{PgSchema, T0, all_attempts, cfg, multi_thread, new_todo, opts};
use crate::store::{PgClock, PgStore, Store};

/// The database's clock, read apart from any operation.
async fn db_clock(store: &Store) -> Millis {
    let Store::Postgres(p) = store else {
        unreachable!("a Postgres store")
    };
    let ms: i64 = p
        .client("test")
        .await
        .expect("a connection")
        .query_one(
            "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint",
            &[],
        )
        .await
        .expect("the clock")
        .get(0);
    Millis::try_from(ms).expect("after the epoch")
}

/// Two servers on one database whose own clocks disagree by 30 s (the `now` each passes) grant
/// leases of identical length on the database's clock, and neither can take a lease over, or
/// reap it, before it lapses by that clock. On the callers' clocks (the old behaviour) the
/// server 31 s ahead takes the fresh lease over at once.
#[test]
fn leases_follow_the_database_clock_whatever_each_server_says() {
    let Some(schema) = PgSchema::new("leases_follow_the_database_clock") else {
        return;
    };
    multi_thread().block_on(async {
        let open = || async {
            let p = PgStore::open_in_schema(&schema.url, &schema.name, cfg())
                .await
                .expect("open");
            assert_eq!(
                p.clock(),
                PgClock::Database,
                "the default is the database's"
            );
            Store::Postgres(p)
        };
        let (mut a, mut b) = (open().await, open().await);
        // A's clock is far behind the database's, B's another 30 s ahead of A's.
        let (a_now, b_now) = (T0, T0 + 30 * SECOND);
        let e1 = Actor::endpoint("e1");
        let q = Some(vec!["q".to_string()]);
        for id in ["by_a", "by_b"] {
            a.add_todo(a_now, "e1", new_todo(id, "q")).await.unwrap();
        }
        let before = db_clock(&a).await;
        let by_a = a.claim(a_now, &e1, "by_a", &opts(30, None)).await.unwrap();
        let by_b = b.claim(b_now, &e1, "by_b", &opts(30, None)).await.unwrap();
        let after = db_clock(&a).await;
        for c in [&by_a, &by_b] {
            let (claimed, expires) = (c.todo.claimed_at.unwrap(), c.todo.lease_expires_at.unwrap());
            assert!(
                (before..=after).contains(&claimed),
                "{}: claimed at {claimed}, not by the database's clock [{before}, {after}]",
                c.todo.id
            );
            assert_eq!(expires - claimed, 30 * SECOND, "{}", c.todo.id);
        }
        // B's clock says A's lease lapsed a second ago; the database's says it runs for 30 s.
        let late = b_now + 31 * SECOND;
        let taken = b.claim_next(late, &e1, q.as_deref(), &opts(30, None)).await;
        assert!(taken.unwrap().is_none(), "a lease taken over early");
        assert!(
            b.reap(late + 3600 * SECOND).await.unwrap().is_empty(),
            "reaped early"
        );
        let (_, attempts) = all_attempts(&a, "by_a").await;
        assert!(attempts[0].is_open(), "{attempts:?}");

        // A short lease lapses by the database's clock, whatever A's (far behind) says: taken
        // over then, and never before its expiry.
        a.add_todo(a_now, "e1", new_todo("short", "short"))
            .await
            .unwrap();
        let short = ClaimOpts {
            ttl: 300,
            ..opts(30, None)
        };
        let first = a.claim(a_now, &e1, "short", &short).await.unwrap();
        let expires = first.todo.lease_expires_at.unwrap();
        let only_short = Some(vec!["short".to_string()]);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let taken = loop {
            // A is behind the database by years: by its own clock the lease never lapses.
            if let Some(c) = a
                .claim_next(a_now, &e1, only_short.as_deref(), &short)
                .await
                .unwrap()
            {
                break c;
            }
            assert!(std::time::Instant::now() < deadline, "never taken over");
            // Real time must pass for the database's clock to move; this waits for it, no
            // synchronisation rides on it.
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        };
        assert!(taken.takeover);
        assert!(
            taken.todo.claimed_at.unwrap() >= expires,
            "taken over before expiry"
        );
        let (_, attempts) = all_attempts(&a, "short").await;
        assert_eq!(attempts[0].outcome, Some(Outcome::LeaseExpired));
        assert!(attempts[0].ended_at.unwrap() >= expires);
    });
}

/// Under `PgClock::Caller` (the tests that drive time by hand) the caller's `now` decides.
#[test]
fn the_caller_clock_keeps_the_callers_now() {
    let Some(schema) = PgSchema::new("the_caller_clock_keeps_the_callers_now") else {
        return;
    };
    multi_thread().block_on(async {
        let mut s = schema.open(cfg()).await;
        let t = s.add_todo(T0, "e1", new_todo("t", "q")).await.unwrap();
        assert_eq!(t.created_at, T0);
    });
}

/// One server at a time runs each sweep: while another transaction holds the reaper's lock
/// (another server mid-sweep), a reap skips; once the holder commits, or its connection dies
/// (a server killed mid-sweep), the next reap runs.
#[test]
fn a_sweep_another_server_is_running_is_skipped_until_its_holder_ends_or_dies() {
    let Some(schema) = PgSchema::new("a_sweep_another_server_is_running_is_skipped") else {
        return;
    };
    multi_thread().block_on(async {
        let mut s = schema.open(cfg()).await;
        let e1 = Actor::endpoint("e1");
        for id in ["a", "b"] {
            s.add_todo(T0, "e1", new_todo(id, "q")).await.unwrap();
            s.claim(T0, &e1, id, &opts(30, None)).await.unwrap();
        }
        let lapsed = T0 + 60 * SECOND;
        let holder = || async {
            let mut pg: tokio_postgres::Config = schema.url.parse().expect("a URL");
            pg.options(format!("-c search_path={}", schema.name));
            let (c, conn) = pg.connect(tokio_postgres::NoTls).await.expect("connect");
            let conn = tokio::spawn(conn);
            c.batch_execute("BEGIN").await.unwrap();
            let got: bool = c
                .query_one(super::super::postgres::tx::TRY_SWEEP_LOCK, &[&"reap"])
                .await
                .unwrap()
                .get(0);
            assert!(got, "the holder takes the free lock");
            (c, conn)
        };
        // Held and committed.
        let (c, conn) = holder().await;
        assert!(
            s.reap(lapsed).await.unwrap().is_empty(),
            "ran beside the holder"
        );
        c.batch_execute("COMMIT").await.unwrap();
        drop((c, conn));
        // Held, and the holder dies: its connection goes, the lock with it.
        let (c, conn) = holder().await;
        assert!(s.reap(lapsed).await.unwrap().is_empty());
        conn.abort();
        drop(c);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let reaped = loop {
            // The server notices the closed connection on its own schedule: poll, bounded.
            let r = s.reap(lapsed).await.unwrap();
            if !r.is_empty() {
                break r;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the dead holder's lock stayed"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        };
        assert_eq!(reaped.len(), 2);
    });
}

/// MCP sessions in the store, the same on both stores: bound to their endpoint, kept alive by
/// use (or, without an idle bound, by an open stream), swept when idle, ended once, and
/// admitted against caps counted over every live session.
#[test]
fn mcp_sessions_are_bound_kept_swept_ended_and_capped_alike_on_both_stores() {
    use crate::store::McpSessionNew;
    use relay_core::ledger::TokenHash;
    use relay_core::limits::Caps;
    const IDLE: Millis = 30 * 60 * SECOND;
    super::on_both_stores("mcp_sessions_alike", cfg(), |store| async move {
        let caps = Caps {
            sessions_total: 3,
            sessions_per_endpoint: 2,
            streams: 1,
        };
        let new = |id: &str, endpoint: &str| McpSessionNew {
            id_hash: TokenHash::of(id),
            endpoint: endpoint.into(),
            protocol: "2025-06-18".into(),
            idle: IDLE,
            caps,
        };
        let h = TokenHash::of;
        let touch = |id: &'static str, ep: &'static str, now, idle| {
            let store = store.clone();
            async move { store.mcp_session_touch(now, h(id), ep, idle).await.unwrap() }
        };
        assert_eq!(
            store.mcp_session_open(T0, new("s1", "e1")).await,
            Ok(vec![])
        );
        assert_eq!(
            store.mcp_session_open(T0, new("s2", "e1")).await,
            Ok(vec![])
        );
        // At the endpoint's cap, a new session ends the least recently used one that holds no
        // stream: s1 holds one, so s2 goes, although s1 was opened first.
        assert!(touch("s1", "e1", T0, None).await, "a stream holds s1");
        assert_eq!(
            store.mcp_session_open(T0 + 1, new("s3", "e1")).await,
            Ok(vec![h("s2")])
        );
        assert!(
            !touch("s2", "e1", T0 + 1, Some(IDLE)).await,
            "ended for room"
        );
        // With every session of the endpoint holding a stream, the cap refuses.
        assert!(touch("s3", "e1", T0 + 1, None).await);
        let over = store
            .mcp_session_open(T0 + 1, new("s3b", "e1"))
            .await
            .unwrap_err();
        assert!(
            over.message.contains("too many sessions for this endpoint"),
            "{over:?}"
        );
        // The total cap ends nobody's session.
        store.mcp_session_open(T0, new("s4", "e2")).await.unwrap();
        let full = store
            .mcp_session_open(T0, new("s5", "e2"))
            .await
            .unwrap_err();
        assert!(full.message.contains("maximum of 3 sessions"), "{full:?}");

        assert!(
            touch("s1", "e1", T0 + IDLE - 1, Some(IDLE)).await,
            "used: kept"
        );
        assert!(
            !touch("s1", "e2", T0, Some(IDLE)).await,
            "another endpoint's"
        );
        assert!(!touch("nope", "e1", T0, Some(IDLE)).await, "unknown");
        // s3 is idle past the bound, unless a stream holds it (no bound).
        assert!(!touch("s3", "e1", T0 + IDLE + 1, Some(IDLE)).await, "idle");
        assert!(
            touch("s3", "e1", T0 + IDLE + 1, None).await,
            "a stream keeps it"
        );
        // The sweep forgets s4 (unused since T0), not s1 or s3 (used at T0 + IDLE - 1 / + 1).
        assert_eq!(store.mcp_session_sweep(T0 + IDLE, IDLE).await.unwrap(), 1);
        assert!(!touch("s4", "e2", T0 + IDLE, None).await, "swept");
        // Ended once; its place under the cap is free again.
        assert!(store.mcp_session_end(h("s3"), "e1").await.unwrap());
        assert!(!store.mcp_session_end(h("s3"), "e1").await.unwrap());
        store
            .mcp_session_open(T0 + IDLE, new("s6", "e1"))
            .await
            .unwrap();
        // A revoked endpoint's sessions go with it.
        store
            .endpoint_create(
                T0,
                crate::store::NewEndpoint {
                    name: "e1".into(),
                    token_hash: h("bearer"),
                    verbs: vec!["claim_next".into()],
                    queues: None,
                },
            )
            .await
            .unwrap();
        store.endpoint_revoke(T0 + IDLE, "e1").await.unwrap();
        assert!(!touch("s1", "e1", T0 + IDLE, None).await, "revoked");
        assert!(!touch("s6", "e1", T0 + IDLE, None).await, "revoked");
    });
}
