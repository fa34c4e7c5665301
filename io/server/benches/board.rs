//! The Board overview's read: `Store::board_overview` (grouped SQL sums and short lists) against
//! what the overview did before, loading every todo with `ListTodos` and counting in Rust.
//!
//! ```sh
//! cargo bench -p relay-server --bench board                       # SQLite, a temp file
//! cargo bench -p relay-server --bench board -- --db postgres://…  # Postgres (a schema of its own)
//! ```
//!
//! Fills the store with `TODOS` todos over three hours of the injected clock (each claimed once
//! and completed, every seventh failed into a retry, every thirteenth left claimed), then times
//! each read `READS` times. One `RESULT bench=board store=… path=… todos=… p50_ms=… p99_ms=…`
//! line per path.

#![allow(clippy::print_stdout, reason = "a benchmark reports on stdout")]

#[path = "../tests/support/db.rs"]
mod db;
#[path = "../tests/support/pg_schema.rs"]
mod pg_schema;

use std::time::{Duration, Instant};

use relay_core::ledger::{Actor, ClaimOpts, LedgerConfig, NewTodo, Op, Report, TodoFilter};
use relay_core::time::SECOND;
use relay_server::store::Store;

use db::Db;

const T0: u64 = 1_790_000_000_000;
const TODOS: u64 = 20_000;
const READS: usize = 30;

fn main() {
    let db = Db::for_bench(std::env::args().skip(1), "board.db", "bench_board");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    rt.block_on(run(&db));
    if let Db::Postgres { url, schema } = &db {
        rt.block_on(pg_schema::drop_now(url, schema))
            .expect("drop the bench schema");
    }
}

async fn fill(store: &Store) -> u64 {
    let actor = Actor::endpoint("bench");
    let step = 3 * 3600 * SECOND / TODOS;
    let mut now = T0;
    for i in 0..TODOS {
        let new = NewTodo {
            id: format!("td_{i:06}"),
            queue: format!("q{}", i % 4),
            title: format!("todo {i}"),
            payload: Some(serde_json::json!({"n": i, "pad": "x".repeat(200)})),
            ..NewTodo::default()
        };
        let add = Op::AddTodo {
            now,
            endpoint: "bench".into(),
            new,
        };
        store.apply(add).await.expect("add");
        let claim = Op::ClaimNext {
            now,
            actor: actor.clone(),
            queues: None,
            opts: ClaimOpts {
                ttl: 3600 * SECOND,
                claimant: None,
                token_hash: None,
            },
        };
        let c = store
            .apply(claim)
            .await
            .expect("claim")
            .next()
            .expect("next");
        let id = c.expect("a claimable todo").todo.id;
        now += step;
        let report = Report::default();
        let (actor, id) = (actor.clone(), id.clone());
        let op = match i % 13 {
            0 => continue,
            _ if i % 7 == 0 => Op::Fail {
                now,
                actor,
                id,
                report,
            },
            _ => Op::Complete {
                now,
                actor,
                id,
                report,
            },
        };
        store.apply(op).await.expect("report");
    }
    now
}

fn quantile(v: &mut [Duration], q: f64) -> f64 {
    v.sort();
    let i = ((v.len() as f64 - 1.0) * q).round() as usize;
    v[i].as_secs_f64() * 1000.0
}

async fn run(db: &Db) {
    let store = db.open(LedgerConfig::default()).await;
    let started = Instant::now();
    let now = fill(&store).await;
    println!(
        "filled {TODOS} todos on {} in {:.1} s",
        db.name(),
        started.elapsed().as_secs_f64()
    );
    let mut aggregate = Vec::new();
    let mut scan = Vec::new();
    for _ in 0..READS {
        let t = Instant::now();
        let o = store.board_overview(now).await.expect("overview");
        std::hint::black_box(&o);
        aggregate.push(t.elapsed());
        let t = Instant::now();
        let all = store
            .apply(Op::ListTodos {
                actor: Actor::cli(),
                filter: TodoFilter {
                    limit: 100_000,
                    ..TodoFilter::default()
                },
            })
            .await
            .expect("list");
        std::hint::black_box(&all);
        scan.push(t.elapsed());
    }
    for (path, v) in [("overview_sql", &mut aggregate), ("list_all", &mut scan)] {
        println!(
            "RESULT bench=board store={} path={path} todos={TODOS} p50_ms={:.2} p99_ms={:.2}",
            db.name(),
            quantile(v, 0.5),
            quantile(v, 0.99)
        );
    }
}
