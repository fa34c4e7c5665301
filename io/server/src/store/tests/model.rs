//! Model-based tests: one random program on the ledger and on a store, side by side. Every
//! operation must answer the same observation, and at the end every todo must read back the same
//! (the whole row and every attempt, as the operator sees them) and satisfy `check_todo`.

use proptest::collection::vec;
use proptest::prelude::any;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use relay_core::ledger::{Actor, Ledger, TodoFilter, check_todo};
use relay_core::testing::{Queue, decode_ops, observe};

use super::{Blocking, PgSchema, cfg, current_thread, sqlite_memory};

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

#[test]
fn sqlite_answers_like_the_ledger() {
    let rt = current_thread();
    runner(256)
        .run(&vec(any::<u8>(), 0..600), |bytes| {
            let store = rt.block_on(sqlite_memory(cfg()));
            let mut q = Blocking { rt: &rt, store };
            same_as_ledger(&mut q, &bytes).map_err(TestCaseError::fail)
        })
        .unwrap();
}

#[test]
fn postgres_answers_like_the_ledger() {
    let Some(schema) = PgSchema::new("postgres_answers_like_the_ledger") else {
        return;
    };
    let rt = current_thread();
    let store = rt.block_on(schema.open(cfg()));
    runner(64)
        .run(&vec(any::<u8>(), 0..600), |bytes| {
            rt.block_on(super::raw_batch(
                &store,
                "TRUNCATE todos, endpoints CASCADE",
            ));
            let mut q = Blocking {
                rt: &rt,
                store: store.clone(),
            };
            same_as_ledger(&mut q, &bytes).map_err(TestCaseError::fail)
        })
        .unwrap();
}
