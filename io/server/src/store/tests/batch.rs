//! Postgres' batches (`pg_batch`): operations queued while a writer is held run as one
//! transaction, and each answers as it would alone: a refused one rolls back alone, one whose
//! statement or commit the database refuses sends the batch back to one transaction each.

use relay_core::ErrorCode;
use relay_core::ledger::{Actor, Answer, LedgerConfig, Op, Report, TodoState, TokenHash};
use relay_core::time::SECOND;
use serde_json::json;

use super::{PgSchema, T0, all_attempts, multi_thread, new_todo, opts};
use crate::store::Store;

fn complete(id: &str, token: &str, result: serde_json::Value) -> Op {
    Op::Complete {
        now: T0 + 2 * SECOND,
        actor: Actor::endpoint("e1"),
        id: id.into(),
        report: Report {
            result: Some(result),
            token_hash: Some(TokenHash::of(token)),
            ..Report::default()
        },
    }
}

fn heartbeat(id: &str, token: &str) -> Op {
    Op::Heartbeat {
        usage: None,
        now: T0 + SECOND,
        actor: Actor::endpoint("e1"),
        id: id.into(),
        ttl: 60 * SECOND,
        token_hash: Some(TokenHash::of(token)),
    }
}

/// `n` todos td_0.. added and claimed, td_i with token tok-i.
async fn claimed(store: &mut Store, n: usize) {
    use relay_core::testing::Queue;
    for i in 0..n {
        let id = format!("td_{i}");
        store.add_todo(T0, "e1", new_todo(&id, "q")).await.unwrap();
        let tok = format!("tok-{i}");
        store
            .claim(T0, &Actor::endpoint("e1"), &id, &opts(60, Some(&tok)))
            .await
            .unwrap();
    }
}

/// Runs `ops` as one batch: queued while the writer is held, then released.
async fn one_batch(store: &Store, ops: Vec<Op>) -> Vec<Result<Answer, relay_core::Error>> {
    let Store::Postgres(p) = store else {
        unreachable!()
    };
    let (release, held) = tokio::sync::oneshot::channel();
    // Both writers held, so that every operation queued meanwhile waits for the same one.
    let (release2, held2) = tokio::sync::oneshot::channel();
    p.hold_writer(held);
    p.hold_writer(held2);
    let answers: Vec<_> = ops.into_iter().map(|op| p.queue_now(op)).collect();
    let _ = release2.send(());
    let _ = release.send(());
    futures_util::future::join_all(answers).await
}

/// A batch of seven: two heartbeats and completes of one todo in a row (each sees the one
/// before), a heartbeat with a wrong token (refused alone), a claim_next, an add (sent at once,
/// in its savepoint), a duplicate add (refused after its insert found the id taken) and an
/// unknown todo. The answers are those of one transaction each, and the refused ones changed
/// nothing.
#[test]
fn a_batch_answers_each_operation_as_alone() {
    let Some(schema) = PgSchema::new("a_batch_answers_each_operation_as_alone") else {
        return;
    };
    multi_thread().block_on(async {
        let mut store = schema.open(LedgerConfig::default()).await;
        claimed(&mut store, 2).await;
        let add = |id: &str| Op::AddTodo {
            now: T0 + SECOND,
            endpoint: "e1".into(),
            new: new_todo(id, "q"),
        };
        let next = Op::ClaimNext {
            now: T0 + 3 * SECOND,
            actor: Actor::endpoint("e1"),
            queues: Some(vec!["q".into()]),
            opts: opts(60, Some("tok-next")),
        };
        let ops = vec![
            heartbeat("td_0", "tok-0"),
            heartbeat("td_1", "wrong"),
            complete("td_0", "tok-0", json!({"ok": 0})),
            add("td_new"),
            next,
            add("td_0"),
            heartbeat("td_nope", "tok-0"),
        ];
        let a = one_batch(&store, ops).await;
        let todo = |r: &Result<Answer, relay_core::Error>| r.clone().and_then(Answer::todo);
        assert_eq!(todo(&a[0]).unwrap().state, TodoState::Claimed);
        assert_eq!(
            a[1].clone().unwrap_err().code,
            ErrorCode::Conflict,
            "{:?}",
            a[1]
        );
        assert_eq!(todo(&a[2]).unwrap().state, TodoState::Done);
        assert_eq!(todo(&a[3]).unwrap().id, "td_new");
        // td_0 and td_1 are taken; the add before it made td_new, the first claimable.
        let claimed = a[4].clone().and_then(Answer::next).unwrap().unwrap();
        assert_eq!(claimed.todo.id, "td_new");
        assert_eq!(
            a[5].clone().unwrap_err().code,
            ErrorCode::Conflict,
            "{:?}",
            a[5]
        );
        assert_eq!(
            a[6].clone().unwrap_err().code,
            ErrorCode::NotFound,
            "{:?}",
            a[6]
        );

        let (t0, at0) = all_attempts(&store, "td_0").await;
        assert_eq!(t0.state, TodoState::Done);
        assert_eq!(t0.result, Some(json!({"ok": 0})));
        assert_eq!(at0[0].last_heartbeat_at, Some(T0 + SECOND));
        // The refused heartbeat changed nothing.
        let (t1, at1) = all_attempts(&store, "td_1").await;
        assert_eq!(t1.lease_expires_at, Some(T0 + 60 * SECOND));
        assert_eq!(at1[0].last_heartbeat_at, None);
        let (tn, atn) = all_attempts(&store, "td_new").await;
        assert_eq!(tn.state, TodoState::Claimed);
        assert_eq!(atn.len(), 1);
    });
}

/// Triggers on the test's own schema: an immediate one refusing a completion whose result is
/// `"boom"` (a statement fails inside the batch), a deferred one refusing `"late"` at COMMIT,
/// and one that makes the close of an attempt summarised `skip` touch no row (the database
/// disagrees with the rows the batch read, which it must notice before COMMIT).
const POISON: &str = r#"
CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'refused by the test'; END $$;
CREATE TRIGGER boom BEFORE UPDATE ON todos FOR EACH ROW
    WHEN (NEW.result = '"boom"') EXECUTE FUNCTION refuse();
CREATE CONSTRAINT TRIGGER late AFTER UPDATE ON todos DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW WHEN (NEW.result = '"late"') EXECUTE FUNCTION refuse();
CREATE FUNCTION skip() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN NULL; END $$;
CREATE TRIGGER skip BEFORE UPDATE ON todo_attempts FOR EACH ROW
    WHEN (NEW.summary = 'skip') EXECUTE FUNCTION skip();
"#;

/// When the database refuses a statement of the batch, or its COMMIT, the batch is rolled
/// back and every operation runs again alone: the refused one answers its own error and the
/// others keep their writes.
#[test]
fn a_refused_statement_or_commit_fails_its_operation_alone() {
    let Some(schema) = PgSchema::new("a_refused_statement_or_commit_fails_its_operation_alone")
    else {
        return;
    };
    multi_thread().block_on(async {
        let mut store = schema.open(LedgerConfig::default()).await;
        super::raw_batch(&store, POISON).await;
        claimed(&mut store, 6).await;
        for (base, poison) in [(0, "boom"), (2, "late"), (4, "skip")] {
            let (ok, bad) = (format!("td_{base}"), format!("td_{}", base + 1));
            let mut refused = complete(&bad, &format!("tok-{}", base + 1), json!(poison));
            if let Op::Complete { report, .. } = &mut refused {
                report.summary = Some(poison.into());
            }
            let ops = vec![
                complete(&ok, &format!("tok-{base}"), json!({"ok": 1})),
                refused,
            ];
            let a = one_batch(&store, ops).await;
            assert_eq!(
                a[0].clone().and_then(Answer::todo).unwrap().state,
                TodoState::Done
            );
            let err = a[1].clone().unwrap_err();
            assert_eq!(err.code, ErrorCode::Internal, "{poison}: {err}");
            let why = if poison == "skip" {
                "closes exactly once"
            } else {
                "refused by the test"
            };
            assert!(err.message.contains(why), "{poison}: {err}");
            let (t, _) = all_attempts(&store, &ok).await;
            assert_eq!(t.state, TodoState::Done, "{poison}");
            let (t, attempts) = all_attempts(&store, &bad).await;
            assert_eq!(t.state, TodoState::Claimed, "{poison}");
            assert!(attempts[0].is_open(), "{poison}");
        }
    });
}

/// The database's clock: with it on, a batch's operations run at the database's `now`, not
/// the caller's (a caller's clock a day behind changes nothing).
#[test]
fn a_batch_runs_at_the_database_clock() {
    let Some(schema) = PgSchema::new("a_batch_runs_at_the_database_clock") else {
        return;
    };
    multi_thread().block_on(async {
        use relay_core::testing::Queue;
        let mut store = schema.open(LedgerConfig::default()).await;
        let Store::Postgres(p) = &store else {
            unreachable!()
        };
        p.set_db_clock(true);
        let before = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        // T0 is in 2026; the database's clock is now.
        let t = store
            .add_todo(T0, "e1", new_todo("td_c", "q"))
            .await
            .unwrap();
        let after = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        // Generous: the database and this process share the machine's clock.
        assert!(
            t.created_at + 1000 >= before && t.created_at <= after + 1000,
            "{} not in {before}..{after}",
            t.created_at
        );
    });
}

/// The claim's planner setting (`CLAIM_PLAN`). On a todos table without statistics, with a
/// backlog of 100 000 for the claim's endpoint, Postgres by default plans the claim as a bitmap
/// scan of every claimable row and a sort of them all; under the setting it walks `todos_fifo`
/// in order and stops at the rows it takes. Every batch that claims begins with the setting, and
/// a claim outside a batch sends it before its read.
#[test]
fn claims_walk_the_fifo_index_without_statistics() {
    use crate::store::postgres::batch::stmt::begin_sql;
    use crate::store::postgres::encode::pg_vals;
    use crate::store::postgres::tx::{CLAIM_LOCK, CLAIM_PLAN, SQL};

    let Some(schema) = PgSchema::new("claims_walk_the_fifo_index_without_statistics") else {
        return;
    };
    multi_thread().block_on(async {
        let store = schema.open(LedgerConfig::default()).await;
        super::raw_batch(
            &store,
            "ALTER TABLE todos SET (autovacuum_enabled = false);
             INSERT INTO todos (id, endpoint, queue, title, state, attempt, max_attempts,
                                created_at, updated_at)
             SELECT 'td_' || lpad(i::text, 6, '0'), 'e1', 'q', 't', 'pending', 0, 5, i, i
             FROM generate_series(1, 100000) i",
        )
        .await;
        let Store::Postgres(p) = &store else {
            unreachable!()
        };
        let queues = ["q".to_string()];
        let (sql, vals) = SQL
            .next_claimable_n(
                &crate::store::rows::ClaimQuery::new(
                    T0,
                    &Actor::endpoint("e1"),
                    Some(&queues),
                    &Default::default(),
                ),
                1,
                CLAIM_LOCK,
            )
            .unwrap();
        let mut c = p.client("test").await.unwrap();
        let mut plan = async |setting: Option<&str>| {
            let tx = c.transaction().await.unwrap();
            if let Some(s) = setting {
                tx.batch_execute(s).await.unwrap();
            }
            let vals = pg_vals("claim_next", vals.clone()).unwrap();
            let args: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> =
                vals.iter().map(|v| &**v as _).collect();
            let rows = tx
                .query(&format!("EXPLAIN (COSTS OFF) {sql}"), &args)
                .await
                .unwrap();
            tx.rollback().await.unwrap();
            rows.iter()
                .map(|r| r.get::<_, String>(0))
                .collect::<Vec<_>>()
                .join("\n")
        };
        let default = plan(None).await;
        assert!(
            default.contains("Sort") && !default.contains("Index Scan using todos_fifo"),
            "without statistics the default plan should sort the whole backlog; if it no \
             longer does, CLAIM_PLAN may not be needed:\n{default}"
        );
        let claim = plan(Some(CLAIM_PLAN)).await;
        assert!(
            claim.contains("Index Scan using todos_fifo") && !claim.contains("Sort"),
            "{claim}"
        );
        assert!(begin_sql(true).ends_with(CLAIM_PLAN), "{}", begin_sql(true));
        let alone = p
            .setting_after_claim("enable_sort", &Actor::endpoint("e1"))
            .await;
        assert_eq!(
            alone, "off",
            "a claim outside a batch runs under CLAIM_PLAN too"
        );
        assert!(
            !begin_sql(false).contains(CLAIM_PLAN),
            "{}",
            begin_sql(false)
        );
    });
}

/// A batch reads a todo's open attempt through the one-open-attempt index even while the
/// attempts table's statistics say it is empty (a new store, a burst before autovacuum analyzes
/// it), where the bench found every batch scanning the whole table: a writer's connection rules
/// sequential scans out and keeps each statement's generic plan. The pool's connections keep the
/// defaults.
#[test]
fn writers_read_open_attempts_by_index_without_statistics() {
    use crate::store::postgres::batch::stmt::OPEN_MANY;

    let Some(schema) = PgSchema::new("writers_read_open_attempts_by_index_without_statistics")
    else {
        return;
    };
    multi_thread().block_on(async {
        let store = schema.open(LedgerConfig::default()).await;
        super::raw_batch(
            &store,
            "ALTER TABLE todo_attempts SET (autovacuum_enabled = false);
             ANALYZE todo_attempts;
             INSERT INTO todos (id, endpoint, queue, title, state, owner, attempt, max_attempts,
                                lease_expires_at, created_at, updated_at, attempts_total)
             SELECT 'td_' || lpad(i::text, 6, '0'), 'e1', 'q', 't', 'claimed', 'e1', 1, 5,
                    10, i, i, 1
             FROM generate_series(1, 20000) i;
             INSERT INTO todo_attempts (todo_id, seq, attempt, claimer_kind, claimer_endpoint,
                                        owner, claimed_at, lease_expires_at)
             SELECT 'td_' || lpad(i::text, 6, '0'), 1, 1, 'endpoint', 'e1', 'e1', i, 10
             FROM generate_series(1, 20000) i",
        )
        .await;
        let Store::Postgres(p) = &store else {
            unreachable!()
        };
        let setting = async |c: &tokio_postgres::Client, name: &str| -> String {
            c.query_one(&format!("SHOW {name}"), &[])
                .await
                .unwrap()
                .get(0)
        };
        let writer = p.writer_connection().await.unwrap();
        assert_eq!(setting(&writer, "enable_seqscan").await, "off");
        assert_eq!(
            setting(&writer, "plan_cache_mode").await,
            "force_generic_plan"
        );
        let ids = vec!["td_000007".to_string(), "td_012345".to_string()];
        let rows = writer
            .query(&format!("EXPLAIN (COSTS OFF) {}", *OPEN_MANY), &[&ids])
            .await
            .unwrap();
        let plan: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
        let plan = plan.join("\n");
        assert!(
            plan.contains("Index Scan using todo_attempts_one_open") && !plan.contains("Seq Scan"),
            "{plan}"
        );
        let pooled = p.client("test").await.unwrap();
        assert_eq!(setting(&pooled, "enable_seqscan").await, "on");
    });
}
