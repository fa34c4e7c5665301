//! What the store and HTTP benchmarks share: latency quantiles, the per-call tally of a
//! claim → heartbeat → complete cycle, the floor (single-row UPDATE transactions per second at
//! 1 and at N connections, each connection in its own transaction on its own row), and the
//! machine-readable `RESULT` line each figure is also printed as.
#![allow(dead_code)] // each bench takes a part

use std::time::{Duration, Instant};

use super::db::Db;

/// The allocator the `relay` binary ships with (see the workspace's Cargo.toml), so that the
/// benches measure what runs.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Latencies of one kind of call, in microseconds.
#[derive(Default)]
pub struct Lat(Vec<u64>);

impl Lat {
    pub fn push(&mut self, d: Duration) {
        self.0
            .push(u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
    }
    pub fn extend(&mut self, other: Lat) {
        self.0.extend(other.0);
    }
    /// The q-quantile (nearest rank), in milliseconds.
    pub fn q(&mut self, q: f64) -> f64 {
        if self.0.is_empty() {
            return f64::NAN;
        }
        self.0.sort_unstable();
        let rank = ((q * self.0.len() as f64).ceil() as usize).clamp(1, self.0.len());
        self.0[rank - 1] as f64 / 1000.0
    }
}

/// What one caller measured of its cycles.
#[derive(Default)]
pub struct Tally {
    pub cycles: u64,
    pub claim: Lat,
    pub heartbeat: Lat,
    pub complete: Lat,
    pub cycle: Lat,
}

impl Tally {
    pub fn merge(&mut self, o: Tally) {
        self.cycles += o.cycles;
        self.claim.extend(o.claim);
        self.heartbeat.extend(o.heartbeat);
        self.complete.extend(o.complete);
        self.cycle.extend(o.cycle);
    }
}

/// One figure: `callers` concurrent callers ran `tally.cycles` cycles at `rate` per second.
pub struct Figures {
    pub callers: usize,
    pub rate: f64,
    pub tally: Tally,
}

pub async fn collect(
    callers: usize,
    tasks: Vec<tokio::task::JoinHandle<Tally>>,
    start: Instant,
) -> Figures {
    let mut tally = Tally::default();
    for t in tasks {
        tally.merge(t.await.expect("a caller task"));
    }
    let elapsed = start.elapsed();
    Figures {
        callers,
        rate: tally.cycles as f64 / elapsed.as_secs_f64(),
        tally,
    }
}

/// The prose lines of a figure and its `RESULT` line (`floor` is the floor measured at the
/// same number of connections as the figure has callers).
pub fn report(bench: &str, store: &str, path: &str, f: &mut Figures, floor: f64) {
    println!(
        "{path:<7} {:>2} callers: {:>8.0} cycles/s ({} cycles); floor {floor:.0} tx/s at {} connections; ratio {:.3}",
        f.callers,
        f.rate,
        f.tally.cycles,
        f.callers,
        f.rate / floor
    );
    let mut quant = String::new();
    for (call, lat) in [
        ("claim", &mut f.tally.claim),
        ("heartbeat", &mut f.tally.heartbeat),
        ("complete", &mut f.tally.complete),
        ("cycle", &mut f.tally.cycle),
    ] {
        let (p50, p99) = (lat.q(0.50), lat.q(0.99));
        println!("    {call:<10} p50 {p50:>7.3} ms   p99 {p99:>7.3} ms");
        quant.push_str(&format!(" {call}_p50_ms={p50:.3} {call}_p99_ms={p99:.3}"));
    }
    println!(
        "RESULT bench={bench} store={store} path={path} callers={} cycles_per_s={:.0} floor_tx_per_s={floor:.0} ratio={:.3}{quant}",
        f.callers,
        f.rate,
        f.rate / floor
    );
}

/// The floor: single-row UPDATE transactions per second with `conns` connections at once, each
/// on a row of its own (so only the database's commit path is shared), for `run_for`, each
/// transaction issued from the async runtime as a server issues its own: SQLite through
/// `spawn_blocking` (the hop the store made per operation before its writer thread, and the
/// floor the throughput issue's targets were set against), Postgres as tokio-postgres clients.
pub async fn floor(db: &Db, conns: usize, run_for: Duration) -> f64 {
    match db {
        Db::Sqlite { path, .. } => sqlite_floor(path, conns, run_for).await,
        Db::Postgres { url, schema } => pg_floor(url, schema, conns, run_for).await,
    }
}

/// SQLite's floor without the runtime: the same transactions from plain threads, one per
/// connection (the database alone; printed beside the floor, never used as a ratio's base).
pub fn sqlite_raw_floor(db: &Db, conns: usize, run_for: Duration) -> Option<f64> {
    let Db::Sqlite { path, .. } = db else {
        return None;
    };
    sqlite_setup(path, conns);
    let start = Instant::now();
    let threads: Vec<_> = (0..conns)
        .map(|i| {
            let c = sqlite_open(path);
            std::thread::spawn(move || {
                let mut n = 0u64;
                let mut st = c.prepare(FLOOR_UPDATE).expect("prepare");
                while start.elapsed() < run_for {
                    st.execute([i as i64]).expect("a floor update");
                    n += 1;
                }
                n
            })
        })
        .collect();
    let n: u64 = threads
        .into_iter()
        .map(|t| t.join().expect("a floor thread"))
        .sum();
    Some(n as f64 / start.elapsed().as_secs_f64())
}

const FLOOR_TABLE: &str =
    "CREATE TABLE IF NOT EXISTS bench_floor (id BIGINT PRIMARY KEY, n BIGINT NOT NULL)";

const FLOOR_UPDATE: &str = "UPDATE bench_floor SET n = n + 1 WHERE id = ?1";

fn sqlite_open(path: &std::path::Path) -> rusqlite::Connection {
    let c = rusqlite::Connection::open(path).expect("open");
    c.busy_timeout(Duration::from_secs(10))
        .expect("busy_timeout");
    c.execute_batch("PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL;")
        .expect("pragmas");
    c
}

fn sqlite_setup(path: &std::path::Path, conns: usize) {
    let first = sqlite_open(path);
    first.execute_batch(FLOOR_TABLE).expect("the floor table");
    for i in 0..conns {
        first
            .execute(
                "INSERT OR IGNORE INTO bench_floor (id, n) VALUES (?1, 0)",
                [i as i64],
            )
            .expect("a floor row");
    }
}

async fn sqlite_floor(path: &std::path::Path, conns: usize, run_for: Duration) -> f64 {
    sqlite_setup(path, conns);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..conns {
        let c = std::sync::Arc::new(std::sync::Mutex::new(sqlite_open(path)));
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while start.elapsed() < run_for {
                let c = c.clone();
                tokio::task::spawn_blocking(move || {
                    c.lock()
                        .unwrap()
                        .prepare_cached(FLOOR_UPDATE)
                        .expect("prepare")
                        .execute([i as i64])
                        .expect("a floor update")
                })
                .await
                .expect("the blocking pool");
                n += 1;
            }
            n
        }));
    }
    let mut n = 0;
    for t in tasks {
        n += t.await.expect("a floor task");
    }
    n as f64 / start.elapsed().as_secs_f64()
}

async fn pg_floor(url: &str, schema: &str, conns: usize, run_for: Duration) -> f64 {
    let mut cfg: tokio_postgres::Config = url.parse().expect("a postgres URL");
    cfg.options(format!("-c search_path={schema}"));
    let mut clients = Vec::new();
    for _ in 0..conns {
        let (c, conn) = cfg.connect(tokio_postgres::NoTls).await.expect("connect");
        tokio::spawn(conn);
        clients.push(c);
    }
    clients[0]
        .batch_execute(FLOOR_TABLE)
        .await
        .expect("the floor table");
    for i in 0..conns {
        clients[0]
            .execute(
                "INSERT INTO bench_floor (id, n) VALUES ($1, 0) ON CONFLICT DO NOTHING",
                &[&(i as i64)],
            )
            .await
            .expect("a floor row");
    }
    let start = Instant::now();
    let mut tasks = Vec::new();
    for (i, c) in clients.into_iter().enumerate() {
        tasks.push(tokio::spawn(async move {
            let st = c
                .prepare("UPDATE bench_floor SET n = n + 1 WHERE id = $1")
                .await
                .expect("prepare");
            let mut n = 0u64;
            while start.elapsed() < run_for {
                c.execute(&st, &[&(i as i64)])
                    .await
                    .expect("a floor update");
                n += 1;
            }
            n
        }));
    }
    let mut n = 0;
    for t in tasks {
        n += t.await.expect("a floor task");
    }
    n as f64 / start.elapsed().as_secs_f64()
}
