//! Retention, migrations, reopening a file, parameterisation, endpoints and URLs.

use relay_core::ErrorCode;
use relay_core::ledger::{
    Actor, LedgerConfig, NewTodo, Outcome, Report, TodoFilter, TodoState, TokenHash, check_todo,
};
use relay_core::testing::Queue;
use relay_core::time::{HOUR, SECOND};
use serde_json::json;

use super::{PgSchema, T0, all_attempts, attempt_rows, cfg, current_thread, new_todo, opts};
use crate::store::{DB_URL_FORMS, DbUrl, NewEndpoint, PgStore, SqliteStore, Store};

// ---- retention ------------------------------------------------------------------------------

async fn retention(mut store: Store) {
    let e1 = Actor::endpoint("e1");
    // The cap (4) keeps the newest attempts and counts what it pruned.
    store
        .add_todo(T0, "e1", new_todo("capped", "q"))
        .await
        .unwrap();
    for i in 0..6u64 {
        let now = T0 + i * SECOND;
        store
            .claim(now, &e1, "capped", &opts(30, None))
            .await
            .unwrap();
        store
            .release(now, &e1, "capped", Some("again"), None)
            .await
            .unwrap();
    }
    let (todo, attempts) = all_attempts(&store, "capped").await;
    assert_eq!((todo.attempts_total, todo.attempts_pruned), (6, 2));
    assert_eq!(
        attempts.iter().map(|a| a.seq).collect::<Vec<_>>(),
        vec![3, 4, 5, 6]
    );
    assert_eq!(attempt_rows(&store, "capped").await, 4);
    check_todo(&todo, &attempts).unwrap();

    // delete_todo takes the attempts with it (ON DELETE CASCADE).
    store.delete_todo(&Actor::cli(), "capped").await.unwrap();
    assert_eq!(attempt_rows(&store, "capped").await, 0);
    let gone = store.get_todo(&Actor::cli(), "capped", 10).await;
    assert_eq!(gone.unwrap_err().code, ErrorCode::NotFound);

    // purge_finished: only finished todos untouched for the retention, with their attempts.
    store
        .add_todo(T0, "e1", new_todo("done", "q"))
        .await
        .unwrap();
    store
        .add_todo(T0, "e1", new_todo("live", "q"))
        .await
        .unwrap();
    store.claim(T0, &e1, "done", &opts(30, None)).await.unwrap();
    store
        .complete(T0, &e1, "done", &Report::default())
        .await
        .unwrap();
    assert_eq!(
        store.purge_finished(T0 + HOUR, 2 * HOUR).await.unwrap(),
        Vec::<String>::new()
    );
    assert_eq!(
        store.purge_finished(T0 + 3 * HOUR, 2 * HOUR).await.unwrap(),
        vec!["done".to_string()]
    );
    assert_eq!(attempt_rows(&store, "done").await, 0);
    let left = store
        .list_todos(
            &Actor::cli(),
            &TodoFilter {
                limit: 10,
                ..TodoFilter::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(
        left.iter().map(|t| t.id.as_str()).collect::<Vec<_>>(),
        ["live"]
    );
}

test_on_both_stores!(retention_cascades_caps_and_purges, cfg(), retention);

// ---- parameterisation -----------------------------------------------------------------------

const SHAPED: &str = "x'); DROP TABLE todos; --";

async fn injection_shaped_values(mut store: Store) {
    let e1 = Actor::endpoint("e1");
    let new = NewTodo {
        id: "td_inject".into(),
        queue: "q".into(),
        title: format!("Robert{SHAPED}"),
        kind: Some("\" OR 1=1 --".into()),
        source: Some("'; DELETE FROM todo_attempts; --".into()),
        payload: Some(json!({"sql": SHAPED})),
        assignee: None,
        ..NewTodo::default()
    };
    let added = store.add_todo(T0, "e1", new.clone()).await.unwrap();
    let claim = relay_core::ledger::ClaimOpts {
        ttl: 30 * SECOND,
        claimant: Some(format!("claimant{SHAPED}")),
        token_hash: None,
    };
    store.claim(T0, &e1, "td_inject", &claim).await.unwrap();
    let report = Report {
        summary: Some(format!("summary {SHAPED}")),
        result: Some(json!({"why": SHAPED})),
        ..Report::default()
    };
    store.fail(T0, &e1, "td_inject", &report).await.unwrap();
    let view = store.get_todo(&e1, "td_inject", 10).await.unwrap();
    assert_eq!(view.todo.title, added.title);
    assert_eq!(view.todo.kind, new.kind);
    assert_eq!(view.todo.source, new.source);
    assert_eq!(view.todo.payload, new.payload);
    assert_eq!(view.todo.result, report.result);
    let a = &view.attempts[0];
    assert_eq!(a.summary, report.summary);
    assert_eq!(a.claimant, claim.claimant);

    // An injection-shaped id or queue is refused by core's validation, or simply not found.
    let bad = store
        .add_todo(T0, "e1", new_todo(SHAPED, "q"))
        .await
        .unwrap_err();
    assert_eq!(bad.code, ErrorCode::Invalid);
    let bad = store
        .add_todo(T0, "e1", new_todo("td_2", SHAPED))
        .await
        .unwrap_err();
    assert_eq!(bad.code, ErrorCode::Invalid);
    let missing = store.get_todo(&e1, "td_inject' OR '1'='1", 10).await;
    assert_eq!(missing.unwrap_err().code, ErrorCode::NotFound);
    let none = store
        .claim_next(
            T0 + HOUR,
            &Actor::endpoint(format!("e1{SHAPED}")),
            Some(&["q' OR '1'='1".to_string()]),
            &opts(30, None),
        )
        .await
        .unwrap();
    assert!(none.is_none());
    let listed = store
        .list_todos(
            &Actor::cli(),
            &TodoFilter {
                queues: Some(vec![SHAPED.into()]),
                limit: 10,
                ..TodoFilter::default()
            },
        )
        .await
        .unwrap();
    assert!(listed.is_empty());
    // An endpoint name is stored as it is.
    let name = format!("ep{SHAPED}");
    store
        .endpoint_create(
            T0,
            NewEndpoint {
                name: name.clone(),
                token_hash: TokenHash::of("t"),
                verbs: vec![SHAPED.into()],
                queues: None,
            },
        )
        .await
        .unwrap();
    let e = store.endpoint_get(&name).await.unwrap().unwrap();
    assert_eq!(
        (e.name.as_str(), e.verbs[0].as_str()),
        (name.as_str(), SHAPED)
    );
    // And the tables are all still there.
    assert_eq!(attempt_rows(&store, "td_inject").await, 1);
}

test_on_both_stores!(
    injection_shaped_values_are_stored_verbatim,
    LedgerConfig::default(),
    injection_shaped_values
);

// ---- endpoints ------------------------------------------------------------------------------

async fn endpoints(mut store: Store) {
    let hash = TokenHash::of("s3cret-bearer-token");
    let new = |name: &str| NewEndpoint {
        name: name.into(),
        token_hash: hash,
        verbs: vec!["claim_next".into(), "complete".into()],
        queues: Some(vec!["q".into()]),
    };
    let e = store.endpoint_create(T0, new("worker")).await.unwrap();
    store.endpoint_create(T0, new("adder")).await.unwrap();
    let dup = store.endpoint_create(T0, new("worker")).await.unwrap_err();
    assert_eq!(dup.code, ErrorCode::Conflict);
    let names: Vec<String> = store
        .endpoint_list()
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(names, ["adder", "worker"]);
    let got = store.endpoint_get("worker").await.unwrap().unwrap();
    assert_eq!(got, e);
    assert!(got.token_matches(&TokenHash::of("s3cret-bearer-token")));
    assert!(!got.token_matches(&TokenHash::of("guess")));
    assert!(store.endpoint_get("nobody").await.unwrap().is_none());
    let shown = format!("{got:?}");
    let hex: String = hash.0.iter().map(|b| format!("{b:02x}")).collect();
    assert!(
        !shown.contains(&hex[..8]) && shown.contains("redacted"),
        "{shown}"
    );

    // Revoking closes the endpoint's open attempts as revoked and dead-letters its todos.
    let w = Actor::endpoint("worker");
    for id in ["a", "b"] {
        store
            .add_todo(T0, "worker", new_todo(id, "q"))
            .await
            .unwrap();
    }
    store.claim(T0, &w, "a", &opts(30, None)).await.unwrap();
    let (e, todos) = store.endpoint_revoke(T0 + SECOND, "worker").await.unwrap();
    assert_eq!(e.revoked_at, Some(T0 + SECOND));
    assert_eq!(
        todos.iter().map(|t| t.id.as_str()).collect::<Vec<_>>(),
        ["a"]
    );
    let (a, attempts) = all_attempts(&store, "a").await;
    assert!(a.state == TodoState::Failed && a.dead_letter());
    assert_eq!(attempts[0].outcome, Some(Outcome::Revoked));
    let (b, _) = all_attempts(&store, "b").await;
    assert_eq!(b.state, TodoState::Pending);
    let again = store.endpoint_revoke(T0, "worker").await.unwrap_err();
    assert_eq!(again.code, ErrorCode::Conflict);
    let unknown = store.endpoint_revoke(T0, "nobody").await.unwrap_err();
    assert_eq!(unknown.code, ErrorCode::NotFound);
    assert_eq!(
        store
            .endpoint_get("worker")
            .await
            .unwrap()
            .unwrap()
            .revoked_at,
        Some(T0 + SECOND)
    );
}

test_on_both_stores!(
    endpoints_are_created_listed_and_revoked,
    LedgerConfig::default(),
    endpoints
);

// ---- URLs -----------------------------------------------------------------------------------

#[test]
fn db_urls_parse_and_bad_ones_name_the_accepted_forms() {
    assert_eq!(
        DbUrl::parse("sqlite::memory:").unwrap(),
        DbUrl::SqliteMemory
    );
    assert_eq!(
        DbUrl::parse("sqlite:/tmp/x.db").unwrap(),
        DbUrl::SqliteFile("/tmp/x.db".into())
    );
    let pg = DbUrl::parse("postgres://u:hunter2@h/db").unwrap();
    assert!(matches!(pg, DbUrl::Postgres(_)));
    assert!(!format!("{pg:?}").contains("hunter2"));
    for bad in ["mysql://root:hunter2@db/x", "sqlite:", "", "/var/x.db"] {
        let e = DbUrl::parse(bad).unwrap_err();
        assert_eq!(e.code, ErrorCode::Invalid);
        assert!(e.message.contains(DB_URL_FORMS), "{e}");
        assert!(!e.message.contains("hunter2"), "{e}");
    }
    let rt = current_thread();
    let e = rt
        .block_on(Store::open(
            "postgres://u:hunter2@[bad",
            LedgerConfig::default(),
        ))
        .unwrap_err();
    assert!(!e.message.contains("hunter2"), "{e}");
}

// ---- files and migrations -------------------------------------------------------------------

fn migrations_of(path: &std::path::Path) -> Vec<(i64, String, i64)> {
    let c = rusqlite::Connection::open(path).unwrap();
    let mut st = c
        .prepare("SELECT version, name, applied_at FROM schema_migrations ORDER BY version")
        .unwrap();
    st.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

#[test]
fn a_reopened_sqlite_file_keeps_everything_and_skips_migrations() {
    let rt = current_thread();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("relay.db");
    let url = format!("sqlite:{}", path.display());
    let e1 = Actor::endpoint("e1");
    let before = rt.block_on(async {
        let mut store = Store::open(&url, LedgerConfig::default()).await.unwrap();
        store
            .add_todo(T0, "e1", new_todo("td_1", "q"))
            .await
            .unwrap();
        store
            .add_todo(T0, "e1", new_todo("td_2", "q"))
            .await
            .unwrap();
        store
            .claim(T0, &e1, "td_1", &opts(30, Some("tok")))
            .await
            .unwrap();
        store
            .endpoint_create(
                T0,
                NewEndpoint {
                    name: "e1".into(),
                    token_hash: TokenHash::of("t"),
                    verbs: vec!["claim".into()],
                    queues: None,
                },
            )
            .await
            .unwrap();
        store.get_todo(&Actor::cli(), "td_1", 10).await.unwrap()
    });
    let applied = migrations_of(&path);
    assert_eq!(
        applied.iter().map(|m| m.0).collect::<Vec<_>>(),
        crate::store::sqlite::MIGRATIONS
            .iter()
            .map(|m| i64::from(m.0))
            .collect::<Vec<_>>()
    );
    rt.block_on(async {
        let mut store = Store::open(&url, LedgerConfig::default()).await.unwrap();
        let after = store.get_todo(&Actor::cli(), "td_1", 10).await.unwrap();
        assert_eq!(after, before);
        assert!(store.endpoint_get("e1").await.unwrap().is_some());
        // The lease survived the restart: its holder completes with its token.
        let report = Report {
            token_hash: Some(TokenHash::of("tok")),
            ..Report::default()
        };
        store
            .complete(T0 + SECOND, &e1, "td_1", &report)
            .await
            .unwrap();
    });
    assert_eq!(migrations_of(&path), applied, "no migration ran again");
}

/// Todos as migration 0001 left them (no attempt rows): two claimed, a failed and a pending one.
const PRE_HISTORY_TODOS: &str =
    "INSERT INTO todos (id, endpoint, queue, title, state, owner, attempt,
     max_attempts, lease_expires_at, claimed_at, created_at, updated_at)
     VALUES ('m1', 'e1', 'q', 'one', 'claimed', 'e1', 1, 5, 1790000030000,
     1790000000000, 1790000000000, 1790000000000),
     ('m2', 'e1', 'q', 'two', 'claimed', 'operator', 3, 5, 1790000030000,
     NULL, 1790000000000, 1790000000000),
     ('m3', 'e1', 'q', 'three', 'failed', NULL, 2, 5, NULL, NULL,
     1790000000000, 1790000000000),
     ('m4', 'e1', 'q', 'four', 'pending', NULL, 0, 5, NULL, NULL,
     1790000000000, 1790000000000);";

/// Claimed todos from before attempt history (0001) get one open `migrated` attempt each when
/// 0002 runs, and the todos then go on through the ordinary transitions.
async fn backfill(mut store: Store) {
    match &store {
        Store::Sqlite(s) => {
            s.with_conn(|c| {
                c.execute_batch(PRE_HISTORY_TODOS)
                    .map_err(|e| relay_core::Error::internal(e.to_string()))
            })
            .await
            .unwrap();
            s.migrate_to(crate::store::sqlite::latest_migration())
                .await
                .unwrap();
        }
        Store::Postgres(p) => {
            p.client("test")
                .await
                .unwrap()
                .batch_execute(PRE_HISTORY_TODOS)
                .await
                .unwrap();
            p.migrate_to(crate::store::postgres::migrations::latest_migration())
                .await
                .unwrap();
        }
    }
    for id in ["m1", "m2", "m3", "m4"] {
        let (todo, attempts) = all_attempts(&store, id).await;
        check_todo(&todo, &attempts).unwrap_or_else(|e| panic!("{id}: {e}"));
        let open: Vec<_> = attempts.iter().filter(|a| a.is_open()).collect();
        if todo.state == TodoState::Claimed {
            assert_eq!(open.len(), 1, "{id}");
            assert_eq!(open[0].claimant.as_deref(), Some("migrated"));
            assert_eq!(Some(open[0].lease_expires_at), todo.lease_expires_at);
        } else {
            assert!(attempts.is_empty(), "{id}");
        }
    }
    let (m2, a2) = all_attempts(&store, "m2").await;
    assert_eq!(
        (m2.attempts_total, m2.attempts_pruned, a2[0].seq),
        (3, 2, 3)
    );
    assert_eq!(a2[0].claimer_kind, relay_core::ledger::ClaimerKind::Owner);
    // The migrated lease goes on: its holder heartbeats, then it lapses and is taken over.
    let e1 = Actor::endpoint("e1");
    store
        .heartbeat(T0 + SECOND, &e1, "m1", 30 * SECOND, None)
        .await
        .unwrap();
    let taken = store
        .claim(T0 + HOUR, &e1, "m1", &opts(30, None))
        .await
        .unwrap();
    assert!(taken.takeover);
    assert_eq!(taken.prior_attempts[0].outcome, Some(Outcome::LeaseExpired));
    assert_eq!(taken.attempt_seq, 2);
}

#[test]
fn the_attempts_migration_backfills_leases_in_flight() {
    let rt = current_thread();
    rt.block_on(async {
        let s = SqliteStore::open_at(None, LedgerConfig::default(), 1)
            .await
            .unwrap();
        backfill(Store::Sqlite(s)).await;
    });
    if let Some(schema) = PgSchema::new("the_attempts_migration_backfills_leases_in_flight") {
        rt.block_on(async {
            let p = PgStore::open_at(&schema.url, Some(&schema.name), LedgerConfig::default(), 1)
                .await
                .unwrap()
                .with_clock(crate::store::PgClock::Caller);
            backfill(Store::Postgres(p)).await;
        });
    }
}

// ---- counting (the server's /metrics) -------------------------------------------------------

async fn counts(mut store: Store) {
    assert_eq!(store.count_by_state().await.unwrap(), vec![]);
    let e1 = Actor::endpoint("e1");
    for id in ["a", "b", "c"] {
        store.add_todo(T0, "e1", new_todo(id, "q")).await.unwrap();
    }
    store.claim(T0, &e1, "a", &opts(30, None)).await.unwrap();
    store.cancel(T0, &Actor::cli(), "b").await.unwrap();
    assert_eq!(
        store.count_by_state().await.unwrap(),
        vec![
            ("canceled".to_string(), 1),
            ("claimed".to_string(), 1),
            ("pending".to_string(), 1)
        ]
    );
}

test_on_both_stores!(todos_are_counted_by_state, LedgerConfig::default(), counts);

/// A file store maps no part of its database into memory: mapped pages count in the server's
/// RSS, and reads through a 256 MiB window mapped all of it for an idle server with a large
/// backlog. Reads go through SQLite's bounded page cache instead.
#[test]
fn a_sqlite_file_store_uses_no_memory_mapped_io() {
    let rt = current_thread();
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("relay.db").display());
    rt.block_on(async {
        let Store::Sqlite(s) = Store::open(&url, LedgerConfig::default()).await.unwrap() else {
            panic!("a sqlite: URL opens the SQLite store");
        };
        // Every connection of the pool is opened by the same `connect`.
        let mmap: i64 = s
            .with_conn(|c| {
                c.query_row("PRAGMA mmap_size", [], |r| r.get(0))
                    .map_err(|e| relay_core::Error::internal(e.to_string()))
            })
            .await
            .unwrap();
        assert_eq!(mmap, 0, "memory-mapped I/O is on");
    });
}
