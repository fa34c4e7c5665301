//! Model-based tests: one random program on the ledger and on a store, side by side. Every
//! operation must answer the same observation, and at the end every todo must read back the same
//! (the whole row and every attempt, as the operator sees them) and satisfy `check_todo`.

use proptest::collection::vec;
use proptest::prelude::any;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use relay_core::ledger::{Actor, Ledger, TodoFilter, check_todo};
use relay_core::testing::{Queue, decode_ops, observe};
use tokio::runtime::Runtime;

use super::{Blocking, PgSchema, Store, cfg, current_thread, sqlite_memory};

/// Runs one program on a fresh ledger and on `store` (which must be empty).
fn same_as_ledger(store: &mut Blocking<'_>, bytes: &[u8]) -> Result<(), String> {
    let mut ledger = Ledger::new(cfg());
    for (step, op) in decode_ops(bytes).into_iter().enumerate() {
        let want = observe(ledger.apply(op.clone()));
        let got = observe(store.apply_op(op.clone()));
        if want != got {
            return Err(format!(
                "step {step}: {op:?}\n  ledger: {want:?}\n  store:  {got:?}"
            ));
        }
    }
    let all = TodoFilter {
        limit: usize::MAX,
        ..TodoFilter::default()
    };
    let want_ids: Vec<String> = ledger.todos().map(|t| t.id.clone()).collect();
    let got_ids: Vec<String> = store
        .list_todos(&Actor::cli(), &all)
        .map_err(|e| format!("final list: {e}"))?
        .into_iter()
        .map(|t| t.id)
        .collect();
    if want_ids != got_ids {
        return Err(format!(
            "final todos: ledger {want_ids:?}, store {got_ids:?}"
        ));
    }
    for id in &want_ids {
        let want = ledger
            .get_todo(&Actor::cli(), id, usize::MAX)
            .map_err(|e| format!("ledger get {id}: {e}"))?;
        let got = store
            .get_todo(&Actor::cli(), id, usize::MAX)
            .map_err(|e| format!("store get {id}: {e}"))?;
        if want != got {
            return Err(format!(
                "final view of {id}:\n  ledger: {want:?}\n  store:  {got:?}"
            ));
        }
        let mut oldest_first = got.attempts.clone();
        oldest_first.reverse();
        check_todo(&got.todo, &oldest_first).map_err(|e| format!("store rows of {id}: {e}"))?;
    }
    Ok(())
}

fn runner(cases: u32) -> TestRunner {
    TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    })
}

/// Runs `check` on `cases` programs, each on a fresh in-memory SQLite store.
fn on_sqlite(cases: u32, check: fn(&mut Blocking<'_>, &[u8]) -> Result<(), String>) {
    let rt = current_thread();
    runner(cases)
        .run(&vec(any::<u8>(), 0..600), |bytes| {
            let store = rt.block_on(sqlite_memory(cfg()));
            let mut q = Blocking { rt: &rt, store };
            check(&mut q, &bytes).map_err(TestCaseError::fail)
        })
        .unwrap();
}

/// The Postgres store with every table the model writes emptied.
fn emptied<'a>(rt: &'a Runtime, store: &Store) -> Blocking<'a> {
    rt.block_on(super::raw_batch(
        store,
        "TRUNCATE todos, endpoints, paused_queues, queue_limits, queue_claims, key_heads CASCADE",
    ));
    Blocking {
        rt,
        store: store.clone(),
    }
}

/// Runs `check` on `cases` programs on Postgres, in a schema named for the test, emptied before
/// each program (skips without a server).
fn on_postgres(name: &str, cases: u32, check: fn(&mut Blocking<'_>, &[u8]) -> Result<(), String>) {
    let Some(schema) = PgSchema::new(name) else {
        return;
    };
    let rt = current_thread();
    let store = rt.block_on(schema.open(cfg()));
    runner(cases)
        .run(&vec(any::<u8>(), 0..600), |bytes| {
            check(&mut emptied(&rt, &store), &bytes).map_err(TestCaseError::fail)
        })
        .unwrap();
}

#[test]
fn sqlite_answers_like_the_ledger() {
    on_sqlite(256, same_as_ledger);
}

#[test]
fn postgres_answers_like_the_ledger() {
    on_postgres("postgres_answers_like_the_ledger", 64, same_as_ledger);
}

/// The overview as the ledger's rows say it should be: what the store's aggregates must answer.
fn overview_of(ledger: &Ledger, now: relay_core::Millis) -> crate::store::BoardOverview {
    use relay_core::board::{
        OVERVIEW_DEAD_LETTERS, OVERVIEW_LIST, StateCount, chart_since, died_outcomes,
    };
    use relay_core::ledger::TodoState;
    use relay_core::time::MINUTE;
    use std::collections::BTreeMap;
    let mut groups: BTreeMap<(String, &str), StateCount> = BTreeMap::new();
    let mut closed: BTreeMap<(u64, String), u64> = BTreeMap::new();
    let mut died_again = Vec::new();
    let died = died_outcomes();
    for t in ledger.todos() {
        let g = groups
            .entry((t.queue.clone(), t.state.as_str()))
            .or_insert_with(|| StateCount {
                queue: t.queue.clone(),
                state: t.state,
                todos: 0,
                retry_scheduled: 0,
                oldest_created_at: None,
                oldest_updated_at: None,
            });
        g.todos += 1;
        g.retry_scheduled += u64::from(t.next_retry_at.is_some());
        g.oldest_created_at = Some(
            g.oldest_created_at
                .map_or(t.created_at, |o| o.min(t.created_at)),
        );
        g.oldest_updated_at = Some(
            g.oldest_updated_at
                .map_or(t.updated_at, |o| o.min(t.updated_at)),
        );
        let mut deaths = 0;
        for a in ledger.attempts(&t.id) {
            let outcome = a.outcome.map(|o| o.as_str());
            if let (Some(end), Some(o)) = (a.ended_at, outcome)
                && end >= chart_since(now)
            {
                *closed.entry((end / MINUTE, o.to_string())).or_default() += 1;
            }
            deaths += u64::from(outcome.is_some_and(|o| died.contains(&o)));
        }
        if deaths > 1 {
            died_again.push((t.clone(), deaths));
        }
    }
    died_again.sort_by(|(a, n), (b, m)| m.cmp(n).then(a.id.cmp(&b.id)));
    died_again.truncate(OVERVIEW_LIST);
    let mut dead_letters: Vec<_> = ledger
        .todos()
        .filter(|t| t.dead_letter())
        .cloned()
        .collect();
    dead_letters.sort_by(|a, b| b.updated_at.cmp(&a.updated_at).then(a.id.cmp(&b.id)));
    dead_letters.truncate(OVERVIEW_DEAD_LETTERS);
    let mut lapsing: Vec<_> = ledger
        .todos()
        .filter(|t| t.state == TodoState::Claimed && t.lease_expires_at.is_some())
        .cloned()
        .collect();
    lapsing.sort_by(|a, b| (a.lease_expires_at, &a.id).cmp(&(b.lease_expires_at, &b.id)));
    lapsing.truncate(OVERVIEW_LIST);
    crate::store::BoardOverview {
        groups: groups.into_values().collect(),
        closed: closed.into_iter().map(|((m, o), n)| (m, o, n)).collect(),
        dead_letters,
        lapsing,
        died_again,
    }
}

fn overview_like_the_ledger(store: &mut Blocking<'_>, bytes: &[u8]) -> Result<(), String> {
    let mut ledger = Ledger::new(cfg());
    let mut now = relay_core::testing::PROGRAM_START;
    for op in decode_ops(bytes) {
        let _ = ledger.apply(op.clone());
        let _ = store.apply_op(op);
    }
    for t in ledger.todos() {
        now = now.max(t.updated_at);
    }
    let want = overview_of(&ledger, now);
    let got = store
        .rt
        .block_on(store.store.board_overview(now))
        .map_err(|e| format!("overview: {e}"))?;
    if want != got {
        return Err(format!("overview:\n  ledger: {want:?}\n  store:  {got:?}"));
    }
    Ok(())
}

#[test]
fn sqlite_counts_the_overview_like_the_ledger() {
    on_sqlite(64, overview_like_the_ledger);
}

#[test]
fn postgres_counts_the_overview_like_the_ledger() {
    on_postgres(
        "postgres_counts_the_overview_like_the_ledger",
        24,
        overview_like_the_ledger,
    );
}

/// Claims past held keys (`rows::heads`), side by side with the ledger: more keys than a claim
/// probes heads, one or two claims a key, priorities, delays, lapsed leases taken over,
/// retries, cancels and completions, and every answer as the ledger's. Ops are drawn from a
/// seeded generator that follows the ledger's answers, so that the claims it reports and
/// completes are real ones.
fn held_keys_like_the_ledger(store: &mut Blocking<'_>, seed: u64) -> Result<(), String> {
    use rand::rngs::StdRng;
    use rand::{RngExt as _, SeedableRng as _};
    use relay_core::ledger::{Answer, ClaimOpts, LimitsChange, NewTodo, Op, Report, TokenHash};
    use relay_core::testing::PROGRAM_START;
    use relay_core::time::SECOND;

    let mut rng = StdRng::seed_from_u64(seed);
    let mut ledger = Ledger::new(cfg());
    let ep = || Actor::endpoint("ep");
    let mut now = PROGRAM_START;
    let mut open: Vec<(String, TokenHash)> = Vec::new();
    let mut todos: Vec<String> = Vec::new();
    let mut claims = (0u32, 0u32);
    for step in 0..700u32 {
        let op = match rng.random_range(0..20u32) {
            0..=6 => {
                let id = format!("t{step:04}");
                todos.push(id.clone());
                let key = rng.random_range(0..90u32);
                // A third are delayed and come first: heads a claim probes and passes over,
                // more than it probes, so that it must walk instead.
                let delayed = rng.random_bool(0.35);
                Op::AddTodo {
                    now,
                    endpoint: "ep".into(),
                    new: NewTodo {
                        id,
                        queue: if rng.random_bool(0.3) { "r" } else { "q" }.into(),
                        title: "x".into(),
                        max_attempts: Some(3),
                        priority: match delayed {
                            true => Some(5),
                            false => [None, Some(1), Some(-5)][rng.random_range(0..3usize)],
                        },
                        delay_seconds: delayed.then_some(120),
                        concurrency_key: (key < 80).then(|| format!("k{key}")),
                        ..NewTodo::default()
                    },
                }
            }
            7..=12 => {
                let hash = TokenHash([u8::try_from(step % 251).unwrap_or(0); 32]);
                Op::ClaimNext {
                    now,
                    actor: ep(),
                    queues: rng.random_bool(0.3).then(|| vec!["q".to_string()]),
                    opts: ClaimOpts {
                        ttl: 60 * SECOND,
                        claimant: None,
                        token_hash: Some(hash),
                    },
                }
            }
            13..=15 if !open.is_empty() => {
                let (id, hash) = open.swap_remove(rng.random_range(0..open.len()));
                let report = Report {
                    token_hash: Some(hash),
                    retryable: Some(true),
                    ..Report::default()
                };
                if rng.random_bool(0.7) {
                    Op::Complete {
                        now,
                        actor: ep(),
                        id,
                        report,
                    }
                } else {
                    Op::Fail {
                        now,
                        actor: ep(),
                        id,
                        report,
                    }
                }
            }
            16 if !todos.is_empty() => Op::Cancel {
                now,
                actor: Actor::cli(),
                id: todos[rng.random_range(0..todos.len())].clone(),
            },
            17 => Op::SetQueueLimits {
                now,
                actor: Actor::cli(),
                queue: "q".into(),
                change: LimitsChange {
                    max_claimed_per_key: Some(Some(rng.random_range(1..=2))),
                    ..LimitsChange::default()
                },
            },
            _ => {
                now += rng.random_range(1..40) * SECOND;
                continue;
            }
        };
        let want = ledger.apply(op.clone());
        let got = store.apply_op(op.clone());
        if let Ok(Answer::Next(Some(c))) = &want {
            if let Op::ClaimNext { opts, .. } = &op {
                open.retain(|(id, _)| *id != c.todo.id);
                open.push((
                    c.todo.id.clone(),
                    opts.token_hash.unwrap_or(TokenHash([0; 32])),
                ));
            }
            claims.0 += 1;
            claims.1 += u32::from(c.todo.concurrency_key.is_some());
        }
        let (want, got) = (observe(want), observe(got));
        if want != got {
            return Err(format!(
                "seed {seed} step {step}: {op:?}\n  ledger: {want:?}\n  store:  {got:?}"
            ));
        }
    }
    if claims.1 < 20 {
        return Err(format!(
            "seed {seed}: only {} keyed claims of {}",
            claims.1, claims.0
        ));
    }
    Ok(())
}

#[test]
fn sqlite_claims_past_held_keys_like_the_ledger() {
    let rt = current_thread();
    for seed in 0..12 {
        let store = rt.block_on(sqlite_memory(cfg()));
        let mut q = Blocking { rt: &rt, store };
        held_keys_like_the_ledger(&mut q, seed).unwrap();
    }
}

#[test]
fn postgres_claims_past_held_keys_like_the_ledger() {
    let Some(schema) = PgSchema::new("postgres_claims_past_held_keys_like_the_ledger") else {
        return;
    };
    let rt = current_thread();
    let store = rt.block_on(schema.open(cfg()));
    for seed in 0..6 {
        held_keys_like_the_ledger(&mut emptied(&rt, &store), seed).unwrap();
    }
}
