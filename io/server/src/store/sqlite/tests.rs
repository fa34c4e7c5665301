//! The SQLite store's query plans and statement cache.

use super::tx::{LOAD, SQL};
use super::*;
use relay_core::ledger::{Actor, Answer, ClaimOpts, NewTodo, Op, Report, TokenHash};

/// A store on a database file of its own (with a writer thread and readers, as a server's).
async fn file_store() -> (tempfile::TempDir, SqliteStore) {
    let dir = tempfile::tempdir().unwrap();
    let s = SqliteStore::open_file(dir.path().join("p.db"), LedgerConfig::default())
        .await
        .unwrap();
    (dir, s)
}

/// The plan of `sql` (EXPLAIN QUERY PLAN's details, one string), and how many temporary
/// b-trees a run of it opens (EXPLAIN's `OpenEphemeral`).
fn plan(c: &Connection, sql: &str) -> (String, usize) {
    let nulls = |st: &rusqlite::Statement<'_>| {
        let n = st.parameter_count();
        rusqlite::params_from_iter(std::iter::repeat_n(rusqlite::types::Null, n))
    };
    let mut st = c.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).unwrap();
    let details: Vec<String> = st
        .query_map(nulls(&st), |r| r.get::<_, String>(3))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let mut st = c.prepare(&format!("EXPLAIN {sql}")).unwrap();
    let ops: Vec<String> = st
        .query_map(nulls(&st), |r| r.get::<_, String>(1))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let ephemeral = ops.iter().filter(|o| *o == "OpenEphemeral").count();
    (details.join("; "), ephemeral)
}

/// The claim still goes through the FIFO index now that it names its states as `OR`s
/// (migration 8), and an update of a todo builds a temporary
/// b-tree only for its CHECK constraints' lists (two), none for an index predicate.
#[tokio::test(flavor = "multi_thread")]
async fn partial_index_predicates_build_no_temporary_btree() {
    let (_dir, s) = file_store().await;
    let actor = Actor::endpoint("ep");
    let (claim, _) = SQL
        .next_claimable_n(
            &crate::store::rows::ClaimQuery {
                op: "claim_next",
                now: 1,
                actor: &actor,
                queues: Some(&["q".into()]),
                holds: &relay_core::ledger::Holds::default(),
            },
            1,
            "",
        )
        .unwrap();
    let update = SQL.update_todo.clone();
    let (claim, update) = s
        .with_conn(move |c| Ok((plan(c, &claim), plan(c, &update))))
        .await
        .unwrap();
    assert!(
        claim.0.contains("USING INDEX todos_fifo"),
        "claim: {}",
        claim.0
    );
    assert_eq!(
        claim.1, 0,
        "the claim builds a temporary b-tree: {}",
        claim.0
    );
    assert_eq!(update.1, 2, "the update of a todo: temporary b-trees");
}

/// Each sweep searches its partial index: with `ORDER BY id` SQLite walked the primary key
/// over every todo instead, on the writer, every reaper and requeue tick.
#[tokio::test(flavor = "multi_thread")]
async fn sweeps_search_their_partial_indexes() {
    use relay_core::ledger::Sweep;
    let (_dir, s) = file_store().await;
    let sweeps = [
        (Sweep::Reap { now: 1 }, &["todos_lease"][..]),
        (
            Sweep::RequeueDue { now: 1 },
            &["todos_retry", "todos_deadline"][..],
        ),
        (Sweep::Purge { cutoff: 1 }, &["todos_finished"][..]),
        (
            Sweep::Revoke {
                now: 1,
                endpoint: "ep",
            },
            &["(endpoint=?)"][..],
        ),
    ];
    for (sweep, wanted) in sweeps {
        let name = format!("{sweep:?}");
        let (sql, _) = SQL.sweep("sweep", sweep).unwrap();
        let (plan, _) = s.with_conn(move |c| Ok(plan(c, &sql))).await.unwrap();
        for w in wanted {
            assert!(plan.contains(w), "{name}: {plan}");
        }
        assert!(!plan.contains("sqlite_autoindex_todos"), "{name}: {plan}");
    }
}

/// The statements of the claim → heartbeat → complete cycle run from the writer's statement
/// cache without SQLite re-preparing them: a re-prepare costs more than the statement (the
/// claim's `t.assignee = ?` made SQLite re-prepare it on every use, a quarter of the
/// writer's time under 16 callers).
#[tokio::test(flavor = "multi_thread")]
async fn cached_statements_are_not_reprepared() {
    let (_dir, s) = file_store().await;
    let store = super::super::Store::Sqlite(s.clone());
    let actor = Actor::endpoint("ep");
    let t0 = 1_790_000_000_000;
    for i in 0..12u64 {
        let new = NewTodo {
            id: format!("t{i:04}"),
            queue: "q".into(),
            title: "x".into(),
            ..NewTodo::default()
        };
        let add = Op::AddTodo {
            now: t0 + i,
            endpoint: "ep".into(),
            new,
        };
        store.apply(add).await.unwrap();
    }
    for i in 0..10u64 {
        let now = t0 + 100_000 + i;
        let token_hash = Some(TokenHash::of(&format!("tok{i}")));
        let opts = ClaimOpts {
            ttl: 300_000,
            claimant: Some("b".into()),
            token_hash,
        };
        let queues = Some(vec!["q".into()]);
        let (actor, ttl) = (actor.clone(), 300_000);
        let claim = Op::ClaimNext {
            now,
            actor: actor.clone(),
            queues,
            opts,
        };
        let c = store.apply(claim).await.and_then(Answer::next).unwrap();
        let id = c.unwrap().todo.id;
        let hb = Op::Heartbeat {
            usage: None,
            now,
            actor: actor.clone(),
            id: id.clone(),
            ttl,
            token_hash,
        };
        store.apply(hb).await.unwrap();
        let report = Report {
            token_hash,
            summary: Some("d".into()),
            ..Report::default()
        };
        let done = Op::Complete {
            now,
            actor,
            id,
            report,
        };
        store.apply(done).await.unwrap();
    }
    let (claim, _) = SQL
        .next_claimable_n(
            &crate::store::rows::ClaimQuery {
                op: "claim_next",
                now: t0,
                actor: &actor,
                queues: Some(&["q".into()]),
                holds: &relay_core::ledger::Holds::default(),
            },
            1,
            "",
        )
        .unwrap();
    let hot = [
        ("claim_next", claim),
        ("load", LOAD.clone()),
        ("open_attempt", SQL.open_attempt.clone()),
        ("insert_attempt", SQL.insert_attempt.clone()),
        ("update_todo", SQL.update_todo.clone()),
        ("update_open_attempt", SQL.update_open_attempt.clone()),
    ];
    let counts = s
        .with_conn(move |c| {
            let mut out = Vec::new();
            for (name, sql) in hot {
                let st = c.prepare_cached(&sql).unwrap();
                let runs = st.get_status(rusqlite::StatementStatus::Run);
                out.push((
                    name,
                    runs,
                    st.get_status(rusqlite::StatementStatus::RePrepare),
                ));
            }
            Ok(out)
        })
        .await
        .unwrap();
    for (name, runs, reprepared) in counts {
        assert!(
            runs >= 10,
            "{name} ran {runs} times; the test lost its cycle"
        );
        assert_eq!(
            reprepared, 0,
            "{name}: SQLite re-prepared the cached statement"
        );
    }
}

/// The writer never checkpoints (a checkpoint inside a commit holds up every operation queued
/// behind it); the checkpointer does, beside it, and brings the whole WAL into the database.
#[tokio::test(flavor = "multi_thread")]
async fn the_checkpointer_not_the_writer_checkpoints_the_wal() {
    let (_dir, s) = file_store().await;
    let store = super::super::Store::Sqlite(s.clone());
    let auto: i64 = s
        .with_conn(|c| {
            c.query_row("PRAGMA wal_autocheckpoint", [], |r| r.get(0))
                .map_err(|e| Error::internal(e.to_string()))
        })
        .await
        .unwrap();
    assert_eq!(auto, 0, "the writer checkpoints automatically");
    for i in 0..50 {
        let new = NewTodo {
            id: format!("t{i}"),
            queue: "q".into(),
            title: "x".repeat(1000),
            ..NewTodo::default()
        };
        let add = Op::AddTodo {
            now: 1_790_000_000_000,
            endpoint: "e".into(),
            new,
        };
        store.apply(add).await.unwrap();
    }
    let (frames, checkpointed) = s
        .threads
        .checkpoint()
        .await
        .unwrap()
        .expect("a checkpointer");
    assert!(frames > 0, "the adds wrote no WAL");
    assert_eq!(
        checkpointed, frames,
        "part of the WAL stayed out of the database"
    );
}

/// However many keys the limits hold, the claim binds them as one value: 40 000 (more bound
/// values than SQLite takes) still answer, with the held key passed over and another taken.
#[tokio::test(flavor = "multi_thread")]
async fn many_held_keys_bind_as_one_value() {
    use relay_core::ledger::{Holds, Rows};
    let (_dir, s) = file_store().await;
    let store = super::super::Store::Sqlite(s.clone());
    let t0 = 1_790_000_000_000;
    for (i, key) in ["k7", "free"].iter().enumerate() {
        let new = NewTodo {
            id: format!("t{i}"),
            queue: "q".into(),
            title: "x".into(),
            concurrency_key: Some(key.to_string()),
            ..NewTodo::default()
        };
        let add = Op::AddTodo {
            now: t0 + i as u64,
            endpoint: "ep".into(),
            new,
        };
        store.apply(add).await.unwrap();
    }
    let keys: Vec<(String, String)> = (0..40_000)
        .map(|i| ("q".to_string(), format!("k{i}")))
        .collect();
    let next = |keys: Vec<(String, String)>| {
        s.run(TxKind::Read, "claim_next", "q".into(), move |tx| {
            let holds = Holds {
                queues: Vec::new(),
                keys,
            };
            let actor = Actor::endpoint("ep");
            let claim = relay_core::ledger::rows::ClaimQuery::new(t0 + 10, &actor, None, &holds);
            relay_core::ledger::rows::ready(tx.next_claimable(&claim)).map(|n| n.map(|(t, _)| t.id))
        })
    };
    assert_eq!(next(Vec::new()).await.unwrap().as_deref(), Some("t0"));
    assert_eq!(next(keys).await.unwrap().as_deref(), Some("t1"));
}
