//! The store benchmark: what attempt history costs on the hot path.
//!
//! ```sh
//! cargo bench -p relay-server --bench store                       # SQLite, a temp file
//! cargo bench -p relay-server --bench store -- --db postgres://…  # Postgres (a schema of its own)
//! cargo bench -p relay-server --bench store -- --db postgres://… --writers 2 --batch-max 64 \
//!     --handles 2 --db-clock   # Postgres knobs: writer tasks, batch bound, store handles, clock
//! cargo bench -p relay-server --bench store -- --only-callers 16  # one figure, for a profiler
//! ```
//!
//! `--handles N` (Postgres) spreads the callers over N store handles of one database, each with
//! its own pool and writers, as N server processes would; the double-claim count covers them all.
//!
//! On one database, in one run, each figure for about two seconds:
//! - the floor: single-row UPDATE transactions per second at 1 and at 16 connections;
//! - claim_next → heartbeat → complete cycles per second through the store (attempt history)
//!   at 1 and at 16 concurrent callers, with each call's p50/p99 and the ratio to the floor at
//!   as many connections; 16 callers also count double claims (must be 0);
//! - the same cycle as three plain UPDATE statements on the todos table only, one caller (the
//!   baseline before attempt history), and the ratio of the store's one-caller figure to it.
//!
//! Each figure is also one `RESULT bench=store store=… path=… callers=… cycles_per_s=…
//! floor_tx_per_s=…` line. The baseline's claim casts its endpoint parameter as the store does
//! (SQLite would otherwise re-prepare it on every use).

#![allow(clippy::print_stdout, reason = "a benchmark reports on stdout")]

#[path = "../tests/support/db.rs"]
mod db;
#[path = "support/measure.rs"]
mod measure;
#[path = "../tests/support/pg_schema.rs"]
mod pg_schema;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use relay_core::ledger::{Actor, Answer, ClaimOpts, LedgerConfig, Op, Report, TokenHash};
use relay_core::time::SECOND;
use relay_server::store::{PgStore, PgTuning, Store};
use serde_json::json;

use db::Db;

const T0: u64 = 1_790_000_000_000;
const RUN: Duration = Duration::from_secs(2);
const TTL: u64 = 300 * SECOND;

fn main() {
    let mut args = std::env::args().skip(1);
    let mut knobs = Knobs::default();
    let num = |v: Option<String>, what: &str| -> usize {
        v.and_then(|s| s.parse().ok()).unwrap_or_else(|| {
            eprintln!("{what}: give a positive number");
            std::process::exit(2)
        })
    };
    while let Some(a) = args.next() {
        match a.as_str() {
            "--writers" => knobs.tuning.writers = num(args.next(), "--writers"),
            "--batch-max" => knobs.tuning.batch_max = num(args.next(), "--batch-max"),
            "--handles" => knobs.handles = num(args.next(), "--handles").max(1),
            "--db-clock" => knobs.db_clock = true,
            "--only-callers" => knobs.only = Some(num(args.next(), "--only-callers").max(1)),
            _ => {} // --db (below), and cargo passes --bench
        }
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let db = Db::for_bench(std::env::args().skip(1), "bench.db", "bench");
    rt.block_on(run(&db, &knobs));
    if let Db::Postgres { url, schema } = &db {
        rt.block_on(pg_schema::drop_now(url, schema))
            .expect("drop the bench schema");
    }
}

/// A fenced heartbeat by `actor`.
fn heartbeat(now: u64, actor: &Actor, id: &str, token: TokenHash) -> Op {
    Op::Heartbeat {
        now,
        actor: actor.clone(),
        id: id.into(),
        ttl: TTL,
        token_hash: Some(token),
        usage: None,
    }
}

fn complete(now: u64, actor: &Actor, id: &str, report: Report) -> Op {
    let (actor, id) = (actor.clone(), id.to_string());
    Op::Complete {
        now,
        actor,
        id,
        report,
    }
}

fn rate(n: u64, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64()
}

/// Postgres' knobs (see the module doc).
struct Knobs {
    tuning: PgTuning,
    handles: usize,
    db_clock: bool,
    /// Only the cycles of this many callers, for a profiler: no floors, no other figure.
    only: Option<usize>,
}

impl Default for Knobs {
    fn default() -> Knobs {
        Knobs {
            tuning: PgTuning::default(),
            handles: 1,
            db_clock: false,
            only: None,
        }
    }
}

/// The store handles the callers use: one on SQLite, `--handles` on Postgres.
async fn open(db: &Db, knobs: &Knobs) -> Vec<Store> {
    let Db::Postgres { url, schema } = db else {
        return vec![db.open(LedgerConfig::default()).await];
    };
    let mut stores = Vec::new();
    for _ in 0..knobs.handles {
        let p = PgStore::open_tuned(url, Some(schema), LedgerConfig::default(), knobs.tuning)
            .await
            .expect("open the store");
        p.set_db_clock(knobs.db_clock);
        stores.push(Store::Postgres(p));
    }
    stores
}

async fn run(db: &Db, knobs: &Knobs) {
    let stores = open(db, knobs).await;
    let raw = Raw::connect(db).await;
    let (name, preload) = match db {
        Db::Sqlite { path, .. } => (
            format!(
                "sqlite, temp file {} (WAL, synchronous=NORMAL)",
                path.display()
            ),
            60_000,
        ),
        Db::Postgres { .. } => (
            format!(
                "postgres ({} writers, batches of at most {}, {} store handles, {} clock)",
                knobs.tuning.writers,
                knobs.tuning.batch_max,
                knobs.handles,
                if knobs.db_clock {
                    "the database's"
                } else {
                    "the caller's"
                }
            ),
            30_000,
        ),
    };
    println!("relay store benchmark: {name}");
    if let Some(callers) = knobs.only {
        raw.preload("bench-d", preload).await;
        let (f, doubles) = cycles(&stores, "bench-d", callers, T0 + 11 * SECOND, preload).await;
        assert_eq!(doubles, 0, "a todo was held by two claimers at once");
        println!(
            "{callers} callers: {:.0} cycles/s (--only-callers: no floor)",
            f.rate
        );
        return;
    }
    let floors = [
        measure::floor(db, 1, RUN).await,
        measure::floor(db, 16, RUN).await,
    ];
    println!(
        "floor: single-row UPDATE transactions {:.0} tx/s at 1 connection, {:.0} tx/s at 16",
        floors[0], floors[1]
    );
    for conns in [1, 16] {
        if let Some(raw) = measure::sqlite_raw_floor(db, conns, RUN) {
            println!("    without the runtime (plain threads, {conns} connections): {raw:.0} tx/s");
            println!(
                "RESULT bench=store store=sqlite path=floor_raw connections={conns} tx_per_s={raw:.0}"
            );
        }
    }
    raw.preload("bench-b", preload).await;
    let mut now = T0 + 10 * SECOND;
    let mut figures = Vec::new();
    for (callers, endpoint) in [(1, "bench-a"), (16, "bench-d")] {
        raw.preload(endpoint, preload).await;
        now += SECOND;
        let (f, doubles) = cycles(&stores, endpoint, callers, now, preload).await;
        assert_eq!(doubles, 0, "a todo was held by two claimers at once");
        println!("{callers} callers: double claims {doubles}");
        figures.push(f);
    }

    // The plain cycle, one caller.
    let start = Instant::now();
    let mut b_n = 0u64;
    while start.elapsed() < RUN && b_n < preload {
        now += 1;
        raw.plain_cycle(now).await;
        b_n += 1;
    }
    let b = rate(b_n, start.elapsed());

    let store_name = db.name();
    for (f, floor) in figures.iter_mut().zip(floors) {
        measure::report("store", store_name, "direct", f, floor);
    }
    let a = figures[0].rate;
    println!(
        "plain cycle (3 UPDATEs on todos, attempt history off), 1 caller: {b:.0} cycles/s ({b_n} cycles); store/plain = {:.2}",
        a / b
    );
    println!(
        "RESULT bench=store store={store_name} path=plain callers=1 cycles_per_s={b:.0} floor_tx_per_s={:.0} ratio={:.3}",
        floors[0],
        b / floors[0]
    );
}

/// `callers` concurrent claimers through the store on `endpoint`'s todos for [`RUN`]; the
/// figures, and how many times a todo was claimed while another caller held it.
async fn cycles(
    stores: &[Store],
    endpoint: &'static str,
    callers: usize,
    now: u64,
    preload: u64,
) -> (measure::Figures, u64) {
    let held: Arc<Mutex<BTreeMap<String, usize>>> = Arc::default();
    let counts: Arc<Mutex<(u64, u64)>> = Arc::default();
    let start = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..callers {
        let store = stores[w % stores.len()].clone();
        let (held, counts) = (held.clone(), counts.clone());
        tasks.push(tokio::spawn(async move {
            let actor = Actor::endpoint(endpoint);
            let queues = vec!["q".to_string()];
            let mut t = measure::Tally::default();
            let mut i = 0u64;
            while start.elapsed() < RUN && counts.lock().unwrap().0 < preload {
                i += 1;
                let token = TokenHash::of(&format!("tok-{w}-{i}"));
                let opts = ClaimOpts {
                    claimant: Some("bench".into()),
                    ..ClaimOpts::fenced(TTL, token)
                };
                let claim = Op::ClaimNext {
                    now,
                    actor: actor.clone(),
                    queues: Some(queues.clone()),
                    opts,
                };
                let c0 = Instant::now();
                let Some(c) = store
                    .apply(claim)
                    .await
                    .and_then(Answer::next)
                    .expect("claim_next")
                else {
                    break;
                };
                t.claim.push(c0.elapsed());
                let id = c.todo.id;
                if held.lock().unwrap().insert(id.clone(), w).is_some() {
                    counts.lock().unwrap().1 += 1;
                }
                let h0 = Instant::now();
                let hb = heartbeat(now, &actor, &id, token);
                store.apply(hb).await.expect("heartbeat");
                t.heartbeat.push(h0.elapsed());
                held.lock().unwrap().remove(&id);
                let report = Report {
                    result: Some(json!({"ok": true})),
                    summary: Some("done".into()),
                    token_hash: Some(token),
                    ..Report::default()
                };
                let k0 = Instant::now();
                let done = complete(now, &actor, &id, report);
                store.apply(done).await.expect("complete");
                t.complete.push(k0.elapsed());
                t.cycle.push(c0.elapsed());
                t.cycles += 1;
                counts.lock().unwrap().0 += 1;
            }
            t
        }));
    }
    let f = measure::collect(callers, tasks, start).await;
    let doubles = counts.lock().unwrap().1;
    (f, doubles)
}

/// Plain SQL on the same database, for the baseline figures.
enum Raw {
    Sqlite(Arc<Mutex<rusqlite::Connection>>),
    Postgres {
        c: tokio_postgres::Client,
        /// claim, heartbeat, complete: prepared once, as a server would.
        st: Vec<tokio_postgres::Statement>,
    },
}

const PG_CLAIM: &str = "UPDATE todos SET state = 'claimed', owner = $1, lease_expires_at = $2,
        attempt = attempt + 1, claimed_at = $3, updated_at = $3
    WHERE id = (SELECT id FROM todos WHERE endpoint = $1 AND queue = 'q'
        AND state IN ('pending', 'claimed', 'failed') AND state = 'pending'
        ORDER BY created_at, id LIMIT 1 FOR UPDATE SKIP LOCKED)
    RETURNING id";
const PG_HEARTBEAT: &str = "UPDATE todos SET lease_expires_at = $1, updated_at = $2
    WHERE id = $3 AND state = 'claimed' AND owner = $4";
const PG_COMPLETE: &str = "UPDATE todos SET state = 'done', owner = NULL, lease_expires_at = NULL,
        result = $1, updated_at = $2
    WHERE id = $3 AND state = 'claimed' AND owner = $4";

impl Raw {
    async fn connect(db: &Db) -> Raw {
        match db {
            Db::Sqlite { path, .. } => {
                let c = rusqlite::Connection::open(path).expect("open");
                c.busy_timeout(Duration::from_secs(10))
                    .expect("busy_timeout");
                c.execute_batch("PRAGMA synchronous = NORMAL; PRAGMA foreign_keys = ON;")
                    .expect("pragmas");
                Raw::Sqlite(Arc::new(Mutex::new(c)))
            }
            Db::Postgres { url, schema } => {
                let mut cfg: tokio_postgres::Config = url.parse().expect("a postgres URL");
                cfg.options(format!("-c search_path={schema}"));
                let (c, conn) = cfg.connect(tokio_postgres::NoTls).await.expect("connect");
                tokio::spawn(conn);
                let mut st = Vec::new();
                for sql in [PG_CLAIM, PG_HEARTBEAT, PG_COMPLETE] {
                    st.push(c.prepare(sql).await.expect("prepare"));
                }
                Raw::Postgres { c, st }
            }
        }
    }

    /// `n` pending todos of endpoint `ep` in queue `q`, created in id order.
    async fn preload(&self, ep: &'static str, n: u64) {
        match self {
            Raw::Sqlite(c) => {
                let c = c.clone();
                tokio::task::spawn_blocking(move || {
                    let c = c.lock().unwrap();
                    c.execute(
                        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1)
                         INSERT INTO todos (id, endpoint, queue, title, state, attempt, max_attempts,
                                            created_at, updated_at)
                         SELECT ?2 || '-' || printf('%08d', i), ?2, 'q', 'bench', 'pending', 0, 5,
                                ?3 + i, ?3 + i FROM n",
                        rusqlite::params![n as i64, ep, T0 as i64],
                    )
                    .expect("preload");
                })
                .await
                .expect("preload");
            }
            Raw::Postgres { c, .. } => {
                c.execute(
                    "INSERT INTO todos (id, endpoint, queue, title, state, attempt, max_attempts,
                                        created_at, updated_at)
                     SELECT $2 || '-' || lpad(i::text, 8, '0'), $2, 'q', 'bench', 'pending', 0, 5,
                            $3 + i, $3 + i FROM generate_series(1, $1::bigint) AS i",
                    &[&(n as i64), &ep, &(T0 as i64)],
                )
                .await
                .expect("preload");
                c.batch_execute("ANALYZE todos").await.expect("analyze");
            }
        }
    }

    /// claim_next, heartbeat, complete as the three statements of the design's "before".
    async fn plain_cycle(&self, now: u64) {
        let now = now as i64;
        let lease = now + TTL as i64;
        match self {
            Raw::Sqlite(c) => {
                let id: String = {
                    let c = c.clone();
                    tokio::task::spawn_blocking(move || {
                        c.lock()
                            .unwrap()
                            .prepare_cached(
                                "UPDATE todos SET state = 'claimed', owner = ?1,
                                     lease_expires_at = ?2, attempt = attempt + 1,
                                     claimed_at = ?3, updated_at = ?3
                                 WHERE id = (SELECT id FROM todos WHERE endpoint = CAST(?4 AS TEXT)
                                     AND queue = 'q' AND state IN ('pending', 'claimed', 'failed')
                                     AND state = 'pending' ORDER BY created_at, id LIMIT 1)
                                 RETURNING id",
                            )
                            .expect("prepare")
                            .query_row(rusqlite::params!["bench-b", lease, now, "bench-b"], |r| {
                                r.get(0)
                            })
                            .expect("plain claim")
                    })
                    .await
                    .expect("worker")
                };
                let (c1, id1) = (c.clone(), id.clone());
                tokio::task::spawn_blocking(move || {
                    c1.lock()
                        .unwrap()
                        .prepare_cached(
                            "UPDATE todos SET lease_expires_at = ?1, updated_at = ?2
                             WHERE id = ?3 AND state = 'claimed' AND owner = ?4",
                        )
                        .expect("prepare")
                        .execute(rusqlite::params![lease, now, id1, "bench-b"])
                        .expect("plain heartbeat")
                })
                .await
                .expect("worker");
                let c2 = c.clone();
                tokio::task::spawn_blocking(move || {
                    c2.lock()
                        .unwrap()
                        .prepare_cached(
                            "UPDATE todos SET state = 'done', owner = NULL,
                                 lease_expires_at = NULL, result = ?1, updated_at = ?2
                             WHERE id = ?3 AND state = 'claimed' AND owner = ?4",
                        )
                        .expect("prepare")
                        .execute(rusqlite::params![r#"{"ok":true}"#, now, id, "bench-b"])
                        .expect("plain complete")
                })
                .await
                .expect("worker");
            }
            Raw::Postgres { c, st } => {
                let id: String = c
                    .query_one(&st[0], &[&"bench-b", &lease, &now])
                    .await
                    .expect("plain claim")
                    .get(0);
                c.execute(&st[1], &[&lease, &now, &id, &"bench-b"])
                    .await
                    .expect("plain heartbeat");
                c.execute(&st[2], &[&r#"{"ok":true}"#, &now, &id, &"bench-b"])
                    .await
                    .expect("plain complete");
            }
        }
    }
}
