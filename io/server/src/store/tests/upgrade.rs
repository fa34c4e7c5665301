//! Postgres' migration 0010 (the reaper's mark, `finished_at`, fewer index entries) takes a
//! database made by 0009 forward with its data: todos in every state, open and closed attempts.

use relay_core::ledger::{Actor, LedgerConfig, TodoState, check_todo};
use relay_core::testing::Queue;
use relay_core::time::{HOUR, SECOND};

use super::{PgSchema, T0, all_attempts, current_thread, new_todo, opts};
use crate::store::{PgClock, PgStore, Store};

/// Rows as 0009 stores them, written as a server of that version did: a pending todo with an
/// idempotency key, two claimed ones with open attempts (one lease live at T0 + 10 s, one
/// lapsed), a failed one with its retry scheduled, a dead letter, a done and a canceled one.
const AT_0009: &str = "
INSERT INTO todos (id, endpoint, queue, title, state, owner, attempt, max_attempts,
    lease_expires_at, claimed_at, next_retry_at, created_at, updated_at, attempts_total,
    attempts_pruned, dead_letter_reason, idempotency_key)
VALUES
 ('p1', 'e1', 'q', 'pending', 'pending', NULL, 0, 5, NULL, NULL, NULL,
  1790000000000, 1790000000000, 0, 0, NULL, 'k1'),
 ('c1', 'e1', 'q', 'live lease', 'claimed', 'e1', 1, 5, 1790000030000, 1790000000000, NULL,
  1790000000001, 1790000000000, 1, 0, NULL, NULL),
 ('c2', 'e1', 'q', 'lapsed lease', 'claimed', 'e1', 1, 5, 1790000005000, 1790000000000, NULL,
  1790000000002, 1790000000000, 1, 0, NULL, NULL),
 ('f1', 'e1', 'q', 'retry due later', 'failed', NULL, 1, 5, NULL, 1790000000000,
  1790000020000, 1790000000003, 1790000000000, 1, 0, NULL, NULL),
 ('x1', 'e1', 'q', 'dead letter', 'failed', NULL, 1, 1, NULL, 1790000000000, NULL,
  1790000000004, 1790000000000, 1, 0, 'attempts_exhausted', NULL),
 ('d1', 'e1', 'q', 'done', 'done', NULL, 1, 5, NULL, 1790000000000, NULL,
  1790000000005, 1790000000000, 1, 0, NULL, NULL),
 ('k1', 'e1', 'q', 'canceled', 'canceled', NULL, 0, 5, NULL, NULL, NULL,
  1790000000006, 1790000000000, 0, 0, NULL, NULL);
INSERT INTO todo_attempts (todo_id, seq, attempt, claimer_kind, claimer_endpoint, owner,
    claimed_at, lease_expires_at, ended_at, outcome, disposition, dead_letter_reason)
VALUES
 ('c1', 1, 1, 'endpoint', 'e1', 'e1', 1790000000000, 1790000030000, NULL, NULL, NULL, NULL),
 ('c2', 1, 1, 'endpoint', 'e1', 'e1', 1790000000000, 1790000005000, NULL, NULL, NULL, NULL),
 ('f1', 1, 1, 'endpoint', 'e1', 'e1', 1790000000000, 1790000030000, 1790000000000, 'failed',
  'retry_scheduled', NULL),
 ('x1', 1, 1, 'endpoint', 'e1', 'e1', 1790000000000, 1790000030000, 1790000000000, 'failed',
  'dead_lettered', 'attempts_exhausted'),
 ('d1', 1, 1, 'endpoint', 'e1', 'e1', 1790000000000, 1790000030000, 1790000000000,
  'completed', 'done', NULL);
";

#[test]
fn migration_0010_takes_every_state_forward() {
    let Some(schema) = PgSchema::new("migration_0010_takes_every_state_forward") else {
        return;
    };
    current_thread().block_on(async {
        let p = PgStore::open_at(&schema.url, Some(&schema.name), LedgerConfig::default(), 9)
            .await
            .unwrap()
            .with_clock(PgClock::Caller);
        let client = p.client("test").await.unwrap();
        client.batch_execute(AT_0009).await.unwrap();
        p.migrate_to(crate::store::postgres::migrations::latest_migration())
            .await
            .unwrap();
        let mut store = Store::Postgres(p);
        let ids = ["p1", "c1", "c2", "f1", "x1", "d1", "k1"];
        for id in ids {
            let (todo, attempts) = all_attempts(&store, id).await;
            check_todo(&todo, &attempts).unwrap_or_else(|e| panic!("{id}: {e}"));
        }
        // Every mark the migration derived is what the statements would have written.
        let marks = client
            .query(
                "SELECT id, lease_due_at, finished_at FROM todos ORDER BY id",
                &[],
            )
            .await
            .unwrap();
        let marks: Vec<(String, Option<i64>, Option<i64>)> = marks
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect();
        let t = |ms: i64| Some(1_790_000_000_000 + ms);
        assert_eq!(
            marks,
            vec![
                ("c1".into(), t(30_000), None),
                ("c2".into(), t(5_000), None),
                ("d1".into(), None, t(0)),
                ("f1".into(), None, t(0)),
                ("k1".into(), None, t(0)),
                ("p1".into(), None, None),
                ("x1".into(), None, t(0)),
            ]
        );

        let e1 = Actor::endpoint("e1");
        // The idempotency key still makes one todo.
        let mut again = new_todo("p1-again", "q");
        again.idempotency_key = Some("k1".into());
        assert_eq!(store.add_todo(T0, "e1", again).await.unwrap().id, "p1");
        // The live lease is renewed past its old mark; the reaper takes only the lapsed one,
        // then the renewed one once it lapses too.
        store
            .heartbeat(T0 + 10 * SECOND, &e1, "c1", 30 * SECOND, None)
            .await
            .unwrap();
        let reaped = store.reap(T0 + 35 * SECOND).await.unwrap();
        assert_eq!(
            reaped.iter().map(|t| t.id.as_str()).collect::<Vec<_>>(),
            ["c2"]
        );
        // The sweep moved the renewed lease's mark up to it: later sweeps skip it until then.
        let mark: Option<i64> = client
            .query_one("SELECT lease_due_at FROM todos WHERE id = 'c1'", &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(mark, t(40_000));
        let reaped = store.reap(T0 + 41 * SECOND).await.unwrap();
        assert_eq!(
            reaped.iter().map(|t| t.id.as_str()).collect::<Vec<_>>(),
            ["c1"]
        );
        // The retry comes due; retention purges what was finished before the upgrade.
        let requeued = store.requeue_due(T0 + HOUR).await.unwrap();
        assert_eq!(
            requeued.iter().map(|t| t.id.as_str()).collect::<Vec<_>>(),
            ["f1"]
        );
        let mut purged = store.purge_finished(T0 + 3 * HOUR, 2 * HOUR).await.unwrap();
        purged.sort();
        assert_eq!(purged, ["d1", "k1", "x1"]);
        let claimed = store
            .claim(T0 + HOUR, &e1, "p1", &opts(30, None))
            .await
            .unwrap();
        assert_eq!(claimed.todo.state, TodoState::Claimed);
    });
}

/// Migration 0012 (waiting for a human, spend) takes a database made by 0011 forward with its
/// data, on both stores: SQLite rebuilds both tables (its CHECK lists cannot be altered), so
/// this also shows the rebuild keeps every row, the one-open-attempt index and the cascade from
/// a todo to its attempts.
#[test]
fn migration_0012_takes_every_state_forward_on_both_stores() {
    let rt = current_thread();
    rt.block_on(async {
        let s = crate::store::SqliteStore::open_at(None, LedgerConfig::default(), 11)
            .await
            .unwrap();
        s.with_conn(|c| {
            c.execute_batch(AT_0009)
                .map_err(|e| relay_core::Error::internal(e.to_string()))
        })
        .await
        .unwrap();
        s.migrate_to(crate::store::sqlite::migrations::latest_migration())
            .await
            .unwrap();
        asks_after_the_upgrade(Store::Sqlite(s)).await;
    });
    let Some(schema) = PgSchema::new("migration_0012_takes_every_state_forward") else {
        return;
    };
    rt.block_on(async {
        let p = PgStore::open_at(&schema.url, Some(&schema.name), LedgerConfig::default(), 11)
            .await
            .unwrap()
            .with_clock(PgClock::Caller);
        let client = p.client("test").await.unwrap();
        client.batch_execute(AT_0009).await.unwrap();
        // As a server of 0011 writes them (see `pg_derived`).
        client
            .batch_execute(
                "UPDATE todos SET lease_due_at = lease_expires_at,
                     finished_at = CASE WHEN state IN ('done', 'canceled', 'failed')
                                        THEN updated_at END",
            )
            .await
            .unwrap();
        p.migrate_to(crate::store::postgres::migrations::latest_migration())
            .await
            .unwrap();
        asks_after_the_upgrade(Store::Postgres(p)).await;
    });
}

async fn asks_after_the_upgrade(mut store: Store) {
    use relay_core::ledger::{Answer, Op, Outcome, Report, TokenHash};
    for id in ["p1", "c1", "c2", "f1", "x1", "d1", "k1"] {
        let (todo, attempts) = all_attempts(&store, id).await;
        check_todo(&todo, &attempts).unwrap_or_else(|e| panic!("{id}: {e}"));
        assert_eq!(
            todo.asking.max_requests, 3,
            "{id}: the default question budget"
        );
        assert!(todo.spent.is_zero() && todo.budget.is_none(), "{id}");
    }
    assert_eq!(all_attempts(&store, "c1").await.1.len(), 1);
    // The cascade from a todo to its attempts survived the rebuild.
    store.delete_todo(&Actor::cli(), "d1").await.unwrap();
    let e1 = Actor::endpoint("e1");
    // A todo from before the upgrade asks, is answered, and its next claim sees both.
    store
        .claim(T0 + HOUR, &e1, "p1", &opts(30, Some("t1")))
        .await
        .unwrap();
    let ask = Op::RequestInput {
        now: T0 + HOUR + SECOND,
        actor: e1.clone(),
        id: "p1".into(),
        question: "which one?".into(),
        report: Report {
            token_hash: Some(TokenHash::of("t1")),
            ..Report::default()
        },
    };
    let t = store.apply(ask).await.and_then(Answer::todo).unwrap();
    assert_eq!(t.state, TodoState::InputRequired);
    let answer = Op::AnswerTodo {
        now: T0 + HOUR + 2 * SECOND,
        actor: Actor::cli(),
        id: "p1".into(),
        answer: "the first".into(),
        key: None,
        seq: None,
    };
    store.apply(answer).await.unwrap();
    let c = store
        .claim(T0 + HOUR + 3 * SECOND, &e1, "p1", &opts(30, None))
        .await
        .unwrap();
    let prior = &c.prior_attempts[0];
    assert_eq!(prior.outcome, Some(Outcome::NeedsInput));
    let q = prior.question.as_ref().unwrap();
    assert_eq!(
        (q.text.as_str(), q.answer.as_deref()),
        ("which one?", Some("the first"))
    );
}
