//! Concurrency on both stores: many claimers on one queue, the reaper racing a takeover, and a
//! planted second open attempt. `now` is a value; nothing here sleeps or reads a clock.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use relay_core::ErrorCode;
use relay_core::ledger::{
    Actor, Attempt, LedgerConfig, Outcome, Report, TodoState, TokenHash, check_todo,
};
use relay_core::testing::Queue;
use relay_core::time::SECOND;

use super::{PgSchema, T0, all_attempts, multi_thread, new_todo, opts};
use crate::store::Store;

const CLAIMERS: usize = 16;
const TODOS: usize = 48;

/// 16 claimers on one queue: a todo is never held by two at once, every claim's fence token is
/// the holder's own, and the attempt rows afterwards satisfy `check_todo`.
async fn sixteen_claimers(store: Store) {
    claimers_on(vec![store]).await;
}

/// [`sixteen_claimers`] with claimer `c` on `stores[c % n]`: handles of one database that share
/// nothing in the process (on Postgres each has its own pool and batch writers, as two servers
/// would).
async fn claimers_on(stores: Vec<Store>) {
    let mut store = stores[0].clone();
    for i in 0..TODOS {
        store
            .add_todo(T0 + i as u64, "e1", new_todo(&format!("td_{i:02}"), "q"))
            .await
            .unwrap();
    }
    // todo id -> the claimer holding it
    let held: Arc<Mutex<BTreeMap<String, usize>>> = Arc::default();
    let doubles: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut tasks = Vec::new();
    for c in 0..CLAIMERS {
        let mut store = stores[c % stores.len()].clone();
        let (held, doubles) = (held.clone(), doubles.clone());
        tasks.push(tokio::spawn(async move {
            let actor = Actor::endpoint("e1");
            let queues = vec!["q".to_string()];
            let now = T0 + 1000 * SECOND;
            let mut round = 0usize;
            loop {
                round += 1;
                let token = format!("tok-{c}-{round}");
                let Some(claimed) = store
                    .claim_next(now, &actor, Some(&queues), &opts(600, Some(&token)))
                    .await
                    .unwrap()
                else {
                    return;
                };
                let id = claimed.todo.id.clone();
                if let Some(other) = held.lock().unwrap().insert(id.clone(), c) {
                    doubles
                        .lock()
                        .unwrap()
                        .push(format!("{id}: {other} and {c}"));
                }
                let hash = Some(TokenHash::of(&token));
                store
                    .heartbeat(now, &actor, &id, 600 * SECOND, hash)
                    .await
                    .unwrap();
                // Give it up before the store does, so that a later claim of it is no double.
                held.lock().unwrap().remove(&id);
                if (c + round).is_multiple_of(3) {
                    store
                        .release(now, &actor, &id, Some("back"), hash)
                        .await
                        .unwrap();
                } else {
                    let report = Report {
                        token_hash: hash,
                        ..Report::default()
                    };
                    store.complete(now, &actor, &id, &report).await.unwrap();
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(*doubles.lock().unwrap(), Vec::<String>::new());
    for i in 0..TODOS {
        let (todo, attempts) = all_attempts(&store, &format!("td_{i:02}")).await;
        assert_eq!(todo.state, TodoState::Done, "{todo:?}");
        check_todo(&todo, &attempts).unwrap();
        assert!(attempts.iter().all(|a| !a.is_open()));
    }
}

test_on_both_stores!(
    sixteen_claimers_never_share_a_todo,
    LedgerConfig::default(),
    sixteen_claimers
);

/// Two handles of one Postgres database (as two server processes) never hand one todo to two
/// claimers: their batches skip each other's locked rows.
#[test]
fn two_postgres_handles_never_share_a_todo() {
    let Some(schema) = PgSchema::new("two_postgres_handles_never_share_a_todo") else {
        return;
    };
    multi_thread().block_on(async {
        let a = schema.open(LedgerConfig::default()).await;
        let b = schema.open(LedgerConfig::default()).await;
        claimers_on(vec![a, b]).await;
    });
}

/// The reaper and a taker race for one lapsed lease, many times: the dead attempt is closed
/// exactly once, by whichever got the row first, and the other sees nothing to do.
async fn reaper_races_takeover(mut store: Store) {
    let rounds = 60;
    let holder = Actor::endpoint("e1");
    for r in 0..rounds {
        let id = format!("race_{r:02}");
        store
            .add_todo(T0, "e1", new_todo(&id, "race"))
            .await
            .unwrap();
        store
            .claim(T0, &holder, &id, &opts(30, None))
            .await
            .unwrap();
        // The lease lapsed at T0 + 30 s.
        let now = T0 + 60 * SECOND;
        let (mut s1, mut s2) = (store.clone(), store.clone());
        let reaper = tokio::spawn(async move { s1.reap(now).await.unwrap() });
        let taker = tokio::spawn(async move {
            s2.claim_next(
                now,
                &Actor::endpoint("e1"),
                Some(&["race".to_string()]),
                &opts(30, None),
            )
            .await
            .unwrap()
        });
        let reaped = reaper.await.unwrap();
        // Postgres' taker skips a row the reaper holds and may find nothing (SKIP LOCKED).
        let taken = taker.await.unwrap();
        let (todo, attempts) = all_attempts(&store, &id).await;
        check_todo(&todo, &attempts).unwrap();
        let by_reaper = reaped.iter().any(|t| t.id == id);
        let takeover = taken.as_ref().is_some_and(|c| c.takeover);
        // Exactly one of them closed attempt 1, and its outcome says which.
        assert_ne!(by_reaper, takeover, "round {r}: {attempts:?}");
        let expected = if by_reaper {
            Outcome::Reaped
        } else {
            Outcome::LeaseExpired
        };
        assert_eq!(attempts[0].outcome, Some(expected), "round {r}");
        assert_eq!(attempts.len(), 1 + usize::from(taken.is_some()));
        // Settle the round so the next one races alone.
        match taken {
            Some(c) => {
                assert_eq!(c.todo.id, id);
                assert!(attempts[1].is_open());
                store
                    .complete(now, &holder, &id, &Report::default())
                    .await
                    .unwrap();
            }
            None => {
                store.cancel(now, &Actor::cli(), &id).await.unwrap();
            }
        }
    }
}

test_on_both_stores!(
    the_reaper_racing_a_takeover_closes_the_dead_attempt_once,
    LedgerConfig::default(),
    reaper_races_takeover
);

/// A second open attempt is refused by the database (SQLite: the partial unique index at the
/// insert; Postgres: the deferred exclusion constraint at commit), as an internal error naming
/// the todo, and nothing of it is kept.
async fn planted_second_open_attempt(mut store: Store) {
    let id = "td_planted";
    store.add_todo(T0, "e1", new_todo(id, "q")).await.unwrap();
    store
        .claim(T0, &Actor::endpoint("e1"), id, &opts(30, None))
        .await
        .unwrap();
    // Beside the claim's attempt: the same lease, numbered after it.
    let (_, first) = all_attempts(&store, id).await;
    let second = Attempt {
        seq: 2,
        attempt: 2,
        ..first[0].clone()
    };
    let err = match &store {
        Store::Sqlite(s) => s.plant_attempt(second).await,
        Store::Postgres(p) => p.plant_attempt(second).await,
    }
    .unwrap_err();
    assert_eq!(err.code, ErrorCode::Internal, "{err}");
    assert!(err.message.contains(id), "{err}");
    assert!(err.message.contains("one open attempt"), "{err}");
    if matches!(store, Store::Postgres(_)) {
        assert!(err.message.contains("at commit"), "{err}");
    }
    let (todo, attempts) = all_attempts(&store, id).await;
    assert_eq!(attempts.len(), 1);
    check_todo(&todo, &attempts).unwrap();
}

test_on_both_stores!(
    a_planted_second_open_attempt_is_refused_naming_the_todo,
    LedgerConfig::default(),
    planted_second_open_attempt
);

/// Postgres checks the one-open-attempt rule at COMMIT, so a transaction may pass through two
/// open rows as long as it ends with one: the deferred constraint is what allows a takeover's
/// writes in any order.
#[test]
fn postgres_checks_one_open_attempt_at_commit() {
    let Some(schema) = PgSchema::new("postgres_checks_one_open_attempt_at_commit") else {
        return;
    };
    multi_thread().block_on(async {
        let mut store = schema.open(LedgerConfig::default()).await;
        let Store::Postgres(p) = store.clone() else {
            unreachable!()
        };
        store
            .add_todo(T0, "e1", new_todo("td_1", "q"))
            .await
            .unwrap();
        store
            .claim(T0, &Actor::endpoint("e1"), "td_1", &opts(30, None))
            .await
            .unwrap();
        let mut client = p.client("test").await.unwrap();
        let tx = client.transaction().await.unwrap();
        // A second open attempt first, then the first one closed: fine at commit.
        tx.batch_execute(
            "INSERT INTO todo_attempts (todo_id, seq, attempt, claimer_kind, owner, claimed_at,
                                        lease_expires_at)
             SELECT todo_id, 2, 2, claimer_kind, owner, claimed_at, lease_expires_at
             FROM todo_attempts WHERE todo_id = 'td_1' AND seq = 1;
             UPDATE todo_attempts SET ended_at = claimed_at, outcome = 'lease_expired',
                 disposition = 'requeued' WHERE todo_id = 'td_1' AND seq = 1;",
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
    });
}

/// Sixteen adds with one idempotency key at once, for many keys: the unique index lets one
/// through, every other answers that same todo (`Existing`), and exactly one todo per key is
/// stored. Without the index (or the second lookup after a refused insert) the losers would
/// either make a second todo or answer a conflict.
async fn concurrent_keyed_adds(store: Store) {
    use relay_core::ledger::{Answer, NewTodo, Op, TodoFilter};
    let keys = 12;
    for k in 0..keys {
        let mut tasks = Vec::new();
        for c in 0..CLAIMERS {
            let mut store = store.clone();
            tasks.push(tokio::spawn(async move {
                let new = NewTodo {
                    idempotency_key: Some(format!("webhook-{k}")),
                    ..new_todo(&format!("td_{k:02}_{c:02}"), "q")
                };
                let add = Op::AddTodo {
                    now: T0 + k,
                    endpoint: "e1".into(),
                    new,
                };
                store.apply_op(add).await.unwrap()
            }));
        }
        let mut created = Vec::new();
        let mut existing = Vec::new();
        for t in tasks {
            match t.await.unwrap() {
                Answer::Todo(t) => created.push(t.id),
                Answer::Existing(t) => existing.push(t.id),
                other => panic!("key {k}: {other:?}"),
            }
        }
        assert_eq!(created.len(), 1, "key {k}: created {created:?}");
        assert_eq!(existing.len(), CLAIMERS - 1, "key {k}");
        assert!(
            existing.iter().all(|id| id == &created[0]),
            "key {k}: {existing:?}"
        );
    }
    let all = TodoFilter {
        limit: 10_000,
        ..TodoFilter::default()
    };
    let mut store = store;
    let todos = store.list_todos(&Actor::cli(), &all).await.unwrap();
    assert_eq!(todos.len() as u64, keys, "one todo per key");
}

test_on_both_stores!(
    concurrent_adds_with_one_idempotency_key_make_one_todo,
    LedgerConfig::default(),
    concurrent_keyed_adds
);

/// The key heads (`rows::heads`) under writers that change one key at once: 16 claimers on two
/// handles of one database complete, fail and cancel the todos of three keys while adding
/// more, some ahead of the head. Once they stop, every key with live todos has its first live
/// todo as head and no other key has one (Postgres' raise looks again after a wait, so that a
/// raise from an older view does not leave a head behind).
async fn heads_under_writers(stores: Vec<Store>) {
    const KEYS: usize = 3;
    let mut store = stores[0].clone();
    for i in 0..TODOS {
        let mut t = new_todo(&format!("hk_{i:02}"), "q");
        t.concurrency_key = Some(format!("key-{}", i % KEYS));
        store.add_todo(T0 + i as u64, "e1", t).await.unwrap();
    }
    let mut tasks = Vec::new();
    for c in 0..CLAIMERS {
        let mut store = stores[c % stores.len()].clone();
        tasks.push(tokio::spawn(async move {
            let actor = Actor::endpoint("e1");
            let now = T0 + 1000 * SECOND;
            for round in 0..6usize {
                if (c + round).is_multiple_of(4) {
                    let mut t = new_todo(&format!("hk_{c:02}_{round}"), "q");
                    t.concurrency_key = Some(format!("key-{}", (c + round) % KEYS));
                    t.priority = Some(i32::try_from(round).unwrap_or(0));
                    store.add_todo(now, "e1", t).await.unwrap();
                }
                let token = format!("tok-{c}-{round}");
                let Some(claimed) = store
                    .claim_next(now, &actor, None, &opts(600, Some(&token)))
                    .await
                    .unwrap()
                else {
                    return;
                };
                let (id, hash) = (claimed.todo.id, Some(TokenHash::of(&token)));
                let report = Report {
                    token_hash: hash,
                    retryable: Some(false),
                    ..Report::default()
                };
                match (c + round) % 3 {
                    0 => drop(store.complete(now, &actor, &id, &report).await.unwrap()),
                    1 => drop(store.fail(now, &actor, &id, &report).await.unwrap()),
                    _ => drop(store.cancel(now, &Actor::cli(), &id).await.unwrap()),
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let wrong = super::raw_count(
        &store,
        "SELECT count(*) FROM key_heads h FULL JOIN (
             SELECT endpoint, queue, concurrency_key, min(id) AS id FROM todos t
              WHERE concurrency_key IS NOT NULL
                AND state IN ('pending', 'claimed', 'failed')
                AND NOT EXISTS (SELECT 1 FROM todos u
                     WHERE u.endpoint = t.endpoint AND u.queue = t.queue
                       AND u.concurrency_key = t.concurrency_key
                       AND u.state IN ('pending', 'claimed', 'failed')
                       AND (u.priority > t.priority OR (u.priority = t.priority
                            AND (u.created_at < t.created_at
                                 OR (u.created_at = t.created_at AND u.id < t.id)))))
              GROUP BY endpoint, queue, concurrency_key) f
           ON f.endpoint = h.endpoint AND f.queue = h.queue
          AND f.concurrency_key = h.concurrency_key
         WHERE f.id IS NULL OR h.id IS NULL OR f.id <> h.id",
    )
    .await;
    assert_eq!(wrong, 0, "keys whose head is not their first live todo");
    let heads = super::raw_count(&store, "SELECT count(*) FROM key_heads").await;
    assert!(
        heads > 0,
        "no key has live todos left: the test proves nothing"
    );
}

test_on_both_stores!(
    key_heads_stay_first_under_writers,
    LedgerConfig::default(),
    |s| heads_under_writers(vec![s])
);

#[test]
fn key_heads_stay_first_under_two_postgres_handles() {
    let Some(schema) = PgSchema::new("key_heads_stay_first_under_two_postgres_handles") else {
        return;
    };
    multi_thread().block_on(async {
        let a = schema.open(LedgerConfig::default()).await;
        let b = schema.open(LedgerConfig::default()).await;
        heads_under_writers(vec![a, b]).await;
    });
}
