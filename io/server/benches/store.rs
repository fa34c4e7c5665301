//! The store benchmark: what attempt history costs on the hot path.
//!
//! ```sh
//! cargo bench -p relay-server --bench store                       # SQLite, a temp file
//! cargo bench -p relay-server --bench store -- --db postgres://…  # Postgres (a schema of its own)
//! ```
//!
//! On one database, in one run:
//! (a) claim_next → heartbeat → complete cycles per second through the store (attempt history);
//! (b) the same cycle as three plain UPDATE statements on the todos table only (the baseline
//!     before attempt history);
//! (c) single-row UPDATE transactions per second (the floor);
//! then the ratios a/b (the attempt history's cost) and a/c. On Postgres also 16 concurrent
//! claimers through the store, with a count of double claims (must be 0).
//!
//! Every store operation and every baseline statement makes the same hop off the async runtime
//! (SQLite: `spawn_blocking`; Postgres: a pooled connection), so the ratios compare storage work,
//! not the shell. The baseline's claim casts its endpoint parameter as the store does (SQLite
//! would otherwise re-prepare it on every use). Each figure runs for about two seconds.

#![allow(clippy::print_stdout, reason = "a benchmark reports on stdout")]

#[path = "../tests/support/db.rs"]
mod db;
#[path = "../tests/support/pg_schema.rs"]
mod pg_schema;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use relay_core::ledger::{Actor, Answer, ClaimOpts, LedgerConfig, Op, Report, TokenHash};
use relay_core::time::SECOND;
use relay_server::store::Store;
use serde_json::json;

use db::Db;

const T0: u64 = 1_790_000_000_000;
const RUN: Duration = Duration::from_secs(2);
const TTL: u64 = 300 * SECOND;

fn main() {
    let mut args = std::env::args().skip(1);
    let mut url = None;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--db" => url = args.next(),
            s if s.starts_with("--db=") => url = Some(s["--db=".len()..].to_string()),
            _ => {} // cargo passes --bench
        }
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let db = match url.as_deref() {
        None => Db::sqlite_temp("bench.db"),
        Some(u) if u.starts_with("sqlite:") && u != "sqlite::memory:" => {
            let dir = tempfile::tempdir().expect("a temp dir");
            Db::Sqlite {
                _dir: dir,
                path: u["sqlite:".len()..].into(),
            }
        }
        Some(u) if u.starts_with("postgres://") || u.starts_with("postgresql://") => Db::Postgres {
            url: u.to_string(),
            schema: format!("bench_{}", std::process::id()),
        },
        Some(_) => {
            eprintln!("--db: use sqlite:PATH (a file) or postgres://…");
            std::process::exit(2);
        }
    };
    rt.block_on(run(&db));
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

async fn run(db: &Db) {
    let cfg = LedgerConfig::default();
    let store = db.open(cfg).await;
    let raw = Raw::connect(db).await;
    let (name, preload) = match db {
        Db::Sqlite { path, .. } => (
            format!(
                "sqlite, temp file {} (WAL, synchronous=NORMAL)",
                path.display()
            ),
            50_000,
        ),
        Db::Postgres { .. } => ("postgres".to_string(), 20_000),
    };
    println!("relay store benchmark: {name}");
    raw.preload("bench-a", preload).await;
    raw.preload("bench-b", preload).await;
    raw.preload("bench-c", 1).await;
    raw.preload("bench-d", preload).await;

    // (a) through the store
    let actor = Actor::endpoint("bench-a");
    let queues = vec!["q".to_string()];
    let mut now = T0 + 10 * SECOND;
    let start = Instant::now();
    let mut a_n = 0u64;
    let mut per_op = [Duration::ZERO; 3];
    while start.elapsed() < RUN && a_n < preload {
        let t = Instant::now();
        now += 1;
        let token = TokenHash::of(&format!("tok-{a_n}"));
        let opts = ClaimOpts {
            ttl: TTL,
            claimant: Some("bench".into()),
            token_hash: Some(token),
        };
        let (actor, queues) = (actor.clone(), Some(queues.clone()));
        let claim = Op::ClaimNext {
            now,
            actor: actor.clone(),
            queues,
            opts,
        };
        let c = store
            .apply(claim)
            .await
            .and_then(Answer::next)
            .expect("claim_next")
            .expect("a todo to claim");
        per_op[0] += t.elapsed();
        let t = Instant::now();
        let heartbeat = heartbeat(now, &actor, &c.todo.id, token);
        store.apply(heartbeat).await.expect("heartbeat");
        per_op[1] += t.elapsed();
        let t = Instant::now();
        let report = Report {
            result: Some(json!({"ok": true})),
            summary: Some("done".into()),
            token_hash: Some(token),
            ..Report::default()
        };
        let complete = complete(now, &actor, &c.todo.id, report);
        store.apply(complete).await.expect("complete");
        per_op[2] += t.elapsed();
        a_n += 1;
    }
    let a = rate(a_n, start.elapsed());

    // (b) three plain statements on todos
    let start = Instant::now();
    let mut b_n = 0u64;
    while start.elapsed() < RUN && b_n < preload {
        now += 1;
        raw.plain_cycle(now).await;
        b_n += 1;
    }
    let b = rate(b_n, start.elapsed());

    // (c) the floor
    let start = Instant::now();
    let mut c_n = 0u64;
    while start.elapsed() < RUN {
        now += 1;
        raw.touch(now).await;
        c_n += 1;
    }
    let c = rate(c_n, start.elapsed());

    println!(
        "(a) claim_next -> heartbeat -> complete via the store (attempt history on): {a:>9.0} cycles/s  ({a_n} cycles)"
    );
    println!(
        "(b) the same cycle as 3 plain UPDATEs on todos (attempt history off):      {b:>9.0} cycles/s  ({b_n} cycles)"
    );
    println!(
        "(c) single-row UPDATE transactions (the floor):                             {c:>9.0} tx/s      ({c_n} tx)"
    );
    let us = |d: Duration| d.as_secs_f64() * 1e6 / a_n.max(1) as f64;
    println!(
        "    (a) per operation: claim_next {:.0} us, heartbeat {:.0} us, complete {:.0} us",
        us(per_op[0]),
        us(per_op[1]),
        us(per_op[2])
    );
    println!(
        "a/b = {:.2} (attempt history costs {:.0} % of the plain cycle's throughput), a/c = {:.2}",
        a / b,
        (1.0 - a / b) * 100.0,
        a / c
    );

    if matches!(db, Db::Postgres { .. }) {
        let (rate, cycles, doubles) = concurrent(&store, now, preload).await;
        println!(
            "(d) 16 concurrent claimers via the store: {rate:.0} cycles/s ({cycles} cycles), double claims: {doubles}"
        );
        assert_eq!(doubles, 0, "a todo was held by two claimers at once");
    }
}

async fn concurrent(store: &Store, now: u64, preload: u64) -> (f64, u64, u64) {
    let held: Arc<Mutex<BTreeMap<String, usize>>> = Arc::default();
    let counts: Arc<Mutex<(u64, u64)>> = Arc::default();
    let start = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..16 {
        let (store, held, counts) = (store.clone(), held.clone(), counts.clone());
        tasks.push(tokio::spawn(async move {
            let actor = Actor::endpoint("bench-d");
            let queues = vec!["q".to_string()];
            let mut i = 0u64;
            while start.elapsed() < RUN && counts.lock().unwrap().0 < preload {
                i += 1;
                let token = TokenHash::of(&format!("tok-{w}-{i}"));
                let opts = ClaimOpts {
                    ttl: TTL,
                    claimant: None,
                    token_hash: Some(token),
                };
                let claim = Op::ClaimNext {
                    now,
                    actor: actor.clone(),
                    queues: Some(queues.clone()),
                    opts,
                };
                let Some(c) = store
                    .apply(claim)
                    .await
                    .and_then(Answer::next)
                    .expect("claim_next")
                else {
                    break;
                };
                let id = c.todo.id;
                if held.lock().unwrap().insert(id.clone(), w).is_some() {
                    counts.lock().unwrap().1 += 1;
                }
                let hb = heartbeat(now, &actor, &id, token);
                store.apply(hb).await.expect("heartbeat");
                held.lock().unwrap().remove(&id);
                let report = Report {
                    token_hash: Some(token),
                    ..Report::default()
                };
                let done = complete(now, &actor, &id, report);
                store.apply(done).await.expect("complete");
                counts.lock().unwrap().0 += 1;
            }
        }));
    }
    for t in tasks {
        t.await.expect("a claimer");
    }
    let (n, doubles) = *counts.lock().unwrap();
    (rate(n, start.elapsed()), n, doubles)
}

/// Plain SQL on the same database, for the baseline figures.
enum Raw {
    Sqlite(Arc<Mutex<rusqlite::Connection>>),
    Postgres {
        c: tokio_postgres::Client,
        /// claim, heartbeat, complete, touch: prepared once, as a server would.
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
const PG_TOUCH: &str = "UPDATE todos SET updated_at = $1 WHERE id = $2";

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
                for sql in [PG_CLAIM, PG_HEARTBEAT, PG_COMPLETE, PG_TOUCH] {
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

    /// One single-row UPDATE in its own transaction.
    async fn touch(&self, now: u64) {
        let now = now as i64;
        match self {
            Raw::Sqlite(c) => {
                let c = c.clone();
                tokio::task::spawn_blocking(move || {
                    c.lock()
                        .unwrap()
                        .prepare_cached("UPDATE todos SET updated_at = ?1 WHERE id = ?2")
                        .expect("prepare")
                        .execute(rusqlite::params![now, "bench-c-00000001"])
                        .expect("touch")
                })
                .await
                .expect("worker");
            }
            Raw::Postgres { c, st } => {
                c.execute(&st[3], &[&now, &"bench-c-00000001"])
                    .await
                    .expect("touch");
            }
        }
    }
}
