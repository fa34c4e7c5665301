//! The doorbell's out-of-process scan (`Store::pending_since`): what it reads and that it
//! misses nothing.

use std::collections::BTreeSet;

use relay_core::ledger::{Actor, NewTodo, Op};
use relay_core::testing::Queue;
use serde_json::json;

use super::{PgSchema, T0, cfg, new_todo, opts};
use crate::store::Store;

/// A payload near the 64 KiB bound.
fn big_payload() -> serde_json::Value {
    json!({"blob": "x".repeat(60 * 1024)})
}

async fn scan_reads_only_what_a_ring_needs(mut store: Store) {
    let first = store.pending_since(None, 100).await.unwrap();
    assert!(
        first.changes.is_empty(),
        "the first scan only sets the watermark"
    );
    for i in 0..30 {
        let mut n: NewTodo = new_todo(&format!("td_{i:02}"), "q");
        n.payload = Some(big_payload());
        n.work_order = Some(big_payload());
        store.add_todo(T0 + i, "e1", n).await.unwrap();
    }
    // One claimed (no longer pending): not reported.
    store
        .claim(T0 + 100, &Actor::endpoint("e1"), "td_00", &opts(30, None))
        .await
        .unwrap();
    // Pages of 7: every pending todo exactly once, the claimed one never.
    let mut after = first.watermark;
    let mut seen = Vec::new();
    for _ in 0..10 {
        let page = store.pending_since(Some(after), 7).await.unwrap();
        assert!(page.changes.len() <= 7);
        // What a page holds is ids, endpoints and queues: a few bytes per todo, whatever the
        // payloads (each of these carries 120 KiB).
        let bytes: usize = page
            .changes
            .iter()
            .map(|c| c.id.len() + c.endpoint.len() + c.queue.len())
            .sum();
        assert!(bytes <= 7 * 16, "a page of the scan holds {bytes} bytes");
        assert!(page.watermark >= after);
        let done = page.changes.is_empty();
        seen.extend(page.changes.into_iter().map(|c| {
            assert_eq!((c.endpoint.as_str(), c.queue.as_str()), ("e1", "q"));
            c.id
        }));
        after = page.watermark;
        if done {
            break;
        }
    }
    let want: Vec<String> = (1..30).map(|i| format!("td_{i:02}")).collect();
    assert_eq!(seen, want, "each pending todo once, in change order");
    // A retry re-queued later is reported again, as tried before.
    store
        .release(T0 + 200, &Actor::endpoint("e1"), "td_00", None, None)
        .await
        .unwrap();
    let page = store.pending_since(Some(after), 100).await.unwrap();
    assert_eq!(page.changes.len(), 1);
    assert_eq!(page.changes[0].id, "td_00");
    assert_eq!(page.changes[0].attempts_total, 1);
    let again = store
        .pending_since(Some(page.watermark), 100)
        .await
        .unwrap();
    assert!(again.changes.is_empty(), "nothing twice");
}

test_on_both_stores!(
    the_scan_reads_only_ids_queues_and_endpoints_a_page_at_a_time,
    cfg(),
    scan_reads_only_what_a_ring_needs
);

/// Postgres numbers changes before commit, so they commit out of order: a scan must not step
/// over a number whose transaction is still running, or that todo would never ring.
#[test]
fn postgres_scan_never_steps_over_a_change_in_flight() {
    let Some(schema) = PgSchema::new("postgres_scan_never_steps_over_a_change_in_flight") else {
        return;
    };
    super::multi_thread().block_on(async {
        let mut store = schema.open(cfg()).await;
        let Store::Postgres(pg) = store.clone() else {
            unreachable!()
        };
        let start = store.pending_since(None, 100).await.unwrap().watermark;
        // A writer takes its number and holds its transaction open …
        let mut slow = pg.client("test").await.unwrap();
        let mut tx = pg
            .begin(&mut slow, crate::store::ops::TxKind::Write, "test")
            .await
            .unwrap();
        let add = Op::AddTodo {
            now: T0,
            endpoint: "e1".into(),
            new: new_todo("td_slow", "q"),
        };
        relay_core::ledger::run(&mut tx, &cfg(), add).await.unwrap();
        // … while a later writer commits a higher number.
        store
            .add_todo(T0, "e1", new_todo("td_fast", "q"))
            .await
            .unwrap();
        // The scan waits for the slow writer; commit it a moment later, from another task.
        let scan = {
            let store = store.clone();
            tokio::spawn(async move { store.pending_since(Some(start), 100).await })
        };
        // Until the scan is seen waiting on the change lock (or has ended), bounded.
        let probe = pg.client("test").await.unwrap();
        for _ in 0..200 {
            let waiting: i64 = probe
                .query_one(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            if waiting > 0 || scan.is_finished() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        pg.finish(tx, "test", "td_slow", Ok(())).await.unwrap();
        let page = tokio::time::timeout(std::time::Duration::from_secs(10), scan)
            .await
            .expect("the scan ends once the writer has")
            .unwrap()
            .unwrap();
        let ids: BTreeSet<String> = page.changes.into_iter().map(|c| c.id).collect();
        assert!(ids.contains("td_fast"));
        if !ids.contains("td_slow") {
            // Only allowed when the scan ran before the slow writer took its number, which
            // it did not: it is in the page, or still above the watermark.
            let next = store
                .pending_since(Some(page.watermark), 100)
                .await
                .unwrap();
            assert!(
                next.changes.iter().any(|c| c.id == "td_slow"),
                "the slow writer's todo was stepped over"
            );
        }
    });
}
