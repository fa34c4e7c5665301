//! The scale benchmark: the store's hot path and its reaper with a large backlog (issue 30).
//!
//! ```sh
//! cargo bench -p relay-server --bench scale                       # SQLite, a temp file
//! cargo bench -p relay-server --bench scale -- --db postgres://…  # Postgres (a schema of its own)
//! cargo bench -p relay-server --bench scale -- --db sqlite:PATH     # SQLite, that file
//! cargo bench -p relay-server --bench scale -- --only-held-keys     # figure 1 at 10 000, 1b
//! ```
//!
//! The rows are preloaded with bulk SQL (see [`preload`], the one place that writes them), not
//! through the store, so that a million of them take seconds; the store is opened first, so its
//! migrations made the tables. Operations read the caller's clock, fixed synthetic times from
//! `T0`, so a lease is live or lapsed by construction. The figures, one after the other on one
//! database (the todo tables emptied between them):
//! - `claim_next` latency at depth: p50/p99 of [`CLAIMS`] claims, one caller, through
//!   `Store::apply(Op::ClaimNext)` on queue `q` holding 10 000 pending todos, then 1 000 000;
//!   in both cases [`ELSEWHERE`] more pending todos in another queue of the same endpoint
//!   (created interleaved with `q`'s oldest) and in another endpoint. The target: p99 at
//!   1 000 000 at most twice p99 at 10 000 (the `p99_ratio` field);
//! - `claim_next` held back by keys (figure 1b): queue `q` with `max_claimed_per_key 1` holds
//!   [`HOT`] pending todos of one key, `hot`, at the head of the claim order, and one `hot`
//!   todo claimed, so that every claim passes over them; behind them [`KEYED`] pending todos
//!   each with a key of its own; p50/p99 of [`CLAIMS`] claims, each of which takes a keyed
//!   todo (completed before the next claim, not measured). The target: p99 at most twice
//!   figure 1's p99 at 10 000 (the `p99_ratio` field), so the claim does not walk the held
//!   key's todos. `--only-held-keys` runs figure 1 at 10 000 and this one only;
//! - heartbeat latency with [`HELD`] open leases: p50/p99 of [`HEARTBEATS`] fenced heartbeats
//!   (`Op::Heartbeat` with the lease token's hash) from [`CALLERS`] concurrent callers over
//!   random held todos. The target: p99 at most 10 ms;
//! - the reaper's sweep: [`LAPSED`] claimed todos whose leases lapsed, beside the [`HELD`] live
//!   ones, then one `Op::Reap` (what the server's reaper applies) timed, and a count of the
//!   lapsed todos still claimed afterwards (must be 0);
//! - the size of [`DONE`] done todos, each with one closed attempt and a 100-byte summary:
//!   Postgres' `pg_total_relation_size` of `todos` and `todo_attempts` (indexes and TOAST
//!   included) after `VACUUM ANALYZE`, SQLite's file (`page_count × page_size` after a
//!   checkpoint) and its two tables with their indexes (`dbstat`); and bytes per todo.
//!
//! Each figure is also one `RESULT bench=scale store=… figure=… key=value …` line.

#![allow(clippy::print_stdout, reason = "a benchmark reports on stdout")]

#[path = "../tests/support/db.rs"]
mod db;
#[path = "support/measure.rs"]
mod measure;
#[path = "../tests/support/pg_schema.rs"]
mod pg_schema;

use std::time::Instant;

use rand::{RngExt as _, SeedableRng as _};
use relay_core::ledger::{
    Actor, Answer, ClaimOpts, LedgerConfig, LimitsChange, Op, Report, Todo, TokenHash,
};
use relay_core::time::SECOND;
use relay_server::store::Store;

use db::Db;
use measure::Lat;
use preload::Key;

const T0: u64 = 1_790_000_000_000;
const TTL: u64 = 300 * SECOND;
/// Claims measured at each depth.
const CLAIMS: usize = 2_000;
/// Pending todos beside the measured queue: half in another queue of its endpoint, half in
/// another endpoint.
const ELSEWHERE: u64 = 100_000;
/// Figure 1b: pending todos of the held key, ahead of the claimable ones.
const HOT: u64 = 1_000_000;
/// Figure 1b: pending todos each with a key of its own, behind the held key's.
const KEYED: u64 = 20_000;
const HELD: u64 = 100_000;
const CALLERS: usize = 16;
const HEARTBEATS: usize = 8_000;
const LAPSED: u64 = 10_000;
const DONE: u64 = 1_000_000;
/// A completed attempt's summary, as a worker writes one: 100 bytes.
const SUMMARY: &str = "processed the batch: 42 records read, 40 written, 2 skipped as duplicates; \
                       see the artifact logfile.";
const _: () = assert!(SUMMARY.len() == 100, "a 100-byte summary");

fn main() {
    let db = Db::for_bench(std::env::args().skip(1), "scale.db", "bench_scale");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let only_held_keys = std::env::args().any(|a| a == "--only-held-keys");
    rt.block_on(run(&db, only_held_keys));
    if let Db::Postgres { url, schema } = &db {
        rt.block_on(pg_schema::drop_now(url, schema))
            .expect("drop the bench schema");
    }
}

async fn run(db: &Db, only_held_keys: bool) {
    let start = Instant::now();
    let store = db.open_manual(LedgerConfig::default()).await;
    let raw = preload::Raw::connect(db).await;
    let name = db.name();
    println!("relay scale benchmark: {name} (the caller's clock)");
    let shallow = claim_at_depth(&store, &raw, name, 10_000).await;
    if only_held_keys {
        held_keys(&store, &raw, name, shallow).await;
        println!("total {:.1} s", start.elapsed().as_secs_f64());
        return;
    }
    let deep = claim_at_depth(&store, &raw, name, 1_000_000).await;
    let ratio = deep / shallow;
    println!(
        "claim_next p99 at 1 000 000 / at 10 000: {ratio:.2} (target at most 2){}",
        off(ratio <= 2.0)
    );
    println!(
        "RESULT bench=scale store={name} figure=claim_next_depth p99_10k_ms={shallow:.3} \
         p99_1m_ms={deep:.3} p99_ratio={ratio:.3} target_max=2 met={}",
        ratio <= 2.0
    );
    held_keys(&store, &raw, name, shallow).await;
    heartbeats(&store, &raw, name).await;
    reap(&store, &raw, name).await;
    size(&raw, name).await;
    println!("total {:.1} s", start.elapsed().as_secs_f64());
}

/// " (OFF TARGET)" unless `met`.
fn off(met: bool) -> &'static str {
    if met { "" } else { " (OFF TARGET)" }
}

/// Runs `f`, saying how long it took; for the preloads.
async fn timed<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    let t = Instant::now();
    let out = f.await;
    println!("    ({what}: {:.1} s)", t.elapsed().as_secs_f64());
    out
}

/// Figure 1 at one depth; returns its p99 in milliseconds.
async fn claim_at_depth(store: &Store, raw: &preload::Raw, name: &str, depth: u64) -> f64 {
    timed(
        &format!("clear and preload {depth} + {ELSEWHERE} pending"),
        async {
            raw.clear().await;
            raw.pending("scale", "q", 1..=depth, Key::None).await;
            preload_elsewhere(raw).await;
            raw.analyze().await;
        },
    )
    .await;
    let mut lat = Lat::default();
    for i in 0..CLAIMS {
        measured_claim(store, i, &mut lat).await;
    }
    let (p50, p99) = (lat.q(0.50), lat.q(0.99));
    println!(
        "claim_next, {depth} pending in the queue (+{ELSEWHERE} elsewhere), {CLAIMS} claims: \
         p50 {p50:.3} ms  p99 {p99:.3} ms"
    );
    println!(
        "RESULT bench=scale store={name} figure=claim_next depth={depth} elsewhere={ELSEWHERE} \
         claims={CLAIMS} p50_ms={p50:.3} p99_ms={p99:.3}"
    );
    p99
}

/// The pending todos around the measured queue (see [`ELSEWHERE`]).
async fn preload_elsewhere(raw: &preload::Raw) {
    raw.pending("scale", "other", 1..=ELSEWHERE / 2, Key::None)
        .await;
    raw.pending("elsewhere", "q", 1..=ELSEWHERE / 2, Key::None)
        .await;
}

/// One `claim_next` on queue `q` by endpoint `scale` at `T0` + 10 s, lease token `claim-{i}`;
/// the todo it claimed (there must be one).
async fn claim_next(store: &Store, i: usize) -> Todo {
    let claim = Op::ClaimNext {
        now: T0 + 10 * SECOND,
        actor: Actor::endpoint("scale"),
        queues: Some(vec!["q".to_string()]),
        opts: ClaimOpts {
            ttl: TTL,
            claimant: Some("scale".into()),
            token_hash: Some(token(i)),
        },
    };
    let next = store
        .apply(claim)
        .await
        .and_then(Answer::next)
        .expect("claim_next");
    next.expect("a pending todo to claim").todo
}

/// [`claim_next`] `i`, its latency added to `lat`; it must take a todo of queue `q`.
async fn measured_claim(store: &Store, i: usize, lat: &mut Lat) -> Todo {
    let t = Instant::now();
    let c = claim_next(store, i).await;
    lat.push(t.elapsed());
    assert_eq!(c.queue, "q", "claim_next took another queue's todo");
    c
}

/// The lease token's hash of [`claim_next`] `i`.
fn token(i: usize) -> TokenHash {
    TokenHash::of(&format!("claim-{i}"))
}

/// Sets queue `q`'s `max_claimed_per_key` (`None`: lifts it; `q` has no other limit).
async fn per_key_limit(store: &Store, n: Option<u32>) {
    let set = Op::SetQueueLimits {
        now: T0 + 10 * SECOND,
        actor: Actor::cli(),
        queue: "q".into(),
        change: LimitsChange {
            max_claimed_per_key: Some(n),
            ..LimitsChange::default()
        },
    };
    store.apply(set).await.expect("set queue q's limits");
}

/// Figure 1b: claims that a held key holds back. Queue `q` with `max_claimed_per_key 1` holds
/// [`HOT`] pending todos with key `hot` at the head of the claim order, one more `hot` todo
/// claimed (so `hot` is held), then [`KEYED`] newer pending todos each with a key of its own,
/// and [`ELSEWHERE`] as in figure 1. Each measured claim passes over every pending `hot` todo
/// and takes a keyed one, which is then completed (not measured), so that every claim is held
/// back by the one key `hot` alone: the figure is the walk past a held key's todos. Keys of
/// their own, the per-entity case (a customer, a repository); a few keys would do as well, as
/// each is free again before the next claim. Left claimed, the keys would be held one more a
/// claim, which on SQLite fails at about 1 000 held keys (the claim's `OR` of held keys passes
/// SQLite's expression depth limit of 1 000). The target: p99 at most twice figure 1's p99 at
/// 10 000 (`floor`, the `p99_ratio` field), that is, the claim does not walk the held key's
/// todos.
async fn held_keys(store: &Store, raw: &preload::Raw, name: &str, floor: f64) {
    timed(
        &format!("clear and preload {HOT} + 1 hot, {KEYED} keyed + {ELSEWHERE} pending"),
        async {
            raw.clear().await;
            raw.pending("scale", "q", 1..=HOT + 1, Key::One("hot"))
                .await;
            raw.pending("scale", "q", HOT + 2..=HOT + 1 + KEYED, Key::Each("k"))
                .await;
            preload_elsewhere(raw).await;
            raw.analyze().await;
        },
    )
    .await;
    per_key_limit(store, Some(1)).await;
    let first = claim_next(store, CLAIMS).await;
    assert_eq!(
        first.concurrency_key.as_deref(),
        Some("hot"),
        "the head is hot"
    );
    let mut lat = Lat::default();
    for i in 0..CLAIMS {
        let c = measured_claim(store, i, &mut lat).await;
        assert_ne!(
            c.concurrency_key.as_deref(),
            Some("hot"),
            "a held key was claimed"
        );
        let done = Op::Complete {
            now: T0 + 10 * SECOND,
            actor: Actor::endpoint("scale"),
            id: c.id,
            report: Report {
                token_hash: Some(token(i)),
                ..Report::default()
            },
        };
        store.apply(done).await.expect("complete a keyed todo");
    }
    per_key_limit(store, None).await;
    let (p50, p99) = (lat.q(0.50), lat.q(0.99));
    let ratio = p99 / floor;
    println!(
        "claim_next held back by a key: {HOT} pending with a held key ahead of {KEYED} with \
         keys of their own (+{ELSEWHERE} elsewhere), {CLAIMS} claims: p50 {p50:.3} ms  \
         p99 {p99:.3} ms; p99 / p99 at 10 000: {ratio:.2} (target at most 2){}",
        off(ratio <= 2.0)
    );
    println!(
        "RESULT bench=scale store={name} figure=held_keys held={HOT} keyed={KEYED} \
         elsewhere={ELSEWHERE} claims={CLAIMS} p50_ms={p50:.3} p99_ms={p99:.3} \
         p99_10k_ms={floor:.3} p99_ratio={ratio:.3} target_max=2 met={}",
        ratio <= 2.0
    );
}

/// Figure 2: fenced heartbeats over [`HELD`] open leases, each lease valid until an hour after
/// `T0`.
async fn heartbeats(store: &Store, raw: &preload::Raw, name: &str) {
    timed(&format!("clear and preload {HELD} held"), async {
        raw.clear().await;
        raw.held("hold", HELD, T0 + 3600 * SECOND).await;
        raw.analyze().await;
    })
    .await;
    let mut tasks = Vec::new();
    for w in 0..CALLERS {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            let actor = Actor::endpoint("hold");
            let mut rng = rand::rngs::StdRng::seed_from_u64(w as u64);
            let mut lat = Lat::default();
            for _ in 0..HEARTBEATS / CALLERS {
                let i = rng.random_range(1..=HELD);
                let hb = Op::Heartbeat {
                    usage: None,
                    now: T0 + 100 * SECOND,
                    actor: actor.clone(),
                    id: preload::id("hold", "q", i),
                    ttl: TTL,
                    token_hash: Some(TokenHash::of(&preload::token("hold", i))),
                };
                let t = Instant::now();
                store.apply(hb).await.expect("heartbeat");
                lat.push(t.elapsed());
            }
            lat
        }));
    }
    let mut lat = Lat::default();
    for t in tasks {
        lat.extend(t.await.expect("a heartbeat caller"));
    }
    let (p50, p99) = (lat.q(0.50), lat.q(0.99));
    println!(
        "heartbeat, {HELD} open leases, {CALLERS} callers, {HEARTBEATS} heartbeats: \
         p50 {p50:.3} ms  p99 {p99:.3} ms (target p99 at most 10 ms){}",
        off(p99 <= 10.0)
    );
    println!(
        "RESULT bench=scale store={name} figure=heartbeat open_leases={HELD} callers={CALLERS} \
         heartbeats={HEARTBEATS} p50_ms={p50:.3} p99_ms={p99:.3} target_p99_ms=10 met={}",
        p99 <= 10.0
    );
}

/// Figure 3: [`LAPSED`] leases that lapsed a minute after `T0` beside figure 2's live ones,
/// one reaper sweep at `T0` + 200 s.
async fn reap(store: &Store, raw: &preload::Raw, name: &str) {
    timed(&format!("clear and preload {LAPSED} lapsed"), async {
        raw.held("lapse", LAPSED, T0 + 60 * SECOND).await;
        raw.analyze().await;
    })
    .await;
    let t = Instant::now();
    let reaped = store
        .apply(Op::Reap {
            now: T0 + 200 * SECOND,
        })
        .await
        .and_then(Answer::todos)
        .expect("reap");
    let ms = t.elapsed().as_secs_f64() * 1000.0;
    let (lapsed, live) = (raw.claimed("lapse").await, raw.claimed("hold").await);
    println!(
        "reaper sweep, {LAPSED} lapsed beside {HELD} live leases: {ms:.0} ms, {} reaped; \
         still claimed: {lapsed} lapsed, {live} live",
        reaped.len()
    );
    println!(
        "RESULT bench=scale store={name} figure=reap lapsed={LAPSED} live={HELD} reaped={} \
         still_claimed={lapsed} live_claimed={live} sweep_ms={ms:.0}",
        reaped.len()
    );
    assert_eq!(lapsed, 0, "the sweep left lapsed leases claimed");
    assert_eq!(
        reaped.len() as u64,
        LAPSED,
        "the sweep reaped another count"
    );
    assert_eq!(live, HELD, "the sweep took live leases");
}

/// Figure 4: the bytes of [`DONE`] done todos and their attempts.
async fn size(raw: &preload::Raw, name: &str) {
    let s = timed(&format!("clear and preload {DONE} done"), async {
        raw.clear().await;
        raw.done("done", DONE).await;
        raw.analyze().await;
        raw.size().await
    })
    .await;
    let per = s.total as f64 / DONE as f64;
    println!(
        "size, {DONE} done todos with one closed attempt each: {:.1} MiB ({per:.0} bytes a todo); \
         todos {:.1} MiB, attempts {:.1} MiB (indexes included)",
        mib(s.total),
        mib(s.todos),
        mib(s.attempts)
    );
    println!(
        "RESULT bench=scale store={name} figure=size done={DONE} bytes={} bytes_per_todo={per:.0} \
         todos_bytes={} attempts_bytes={}",
        s.total, s.todos, s.attempts
    );
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

/// EVERY RAW SQL STATEMENT OF THE BENCH: the rows it preloads, one function a row shape with
/// one statement a dialect, and the reads of counts and sizes. The store's schema (the
/// migrations in `src/store/sqlite/migrations.rs` and `src/store/postgres/migrations.rs`)
/// changes: adapt it here.
///
/// Rows as the store would have written them: a claimed todo's open attempt matches it
/// (`owner`, `attempt`, `lease_expires_at`, `seq = attempts_total`), and its lease token's
/// hash is the SHA-256 of [`token`]. On Postgres the columns the store derives on each write
/// (`rows::pg_derived`) are set the same way: a held todo's `lease_due_at` is its lease, a
/// done todo's `finished_at` its `updated_at`. On Postgres the session runs with
/// `session_replication_role = replica`, so the preload fires no trigger: no NOTIFY for a
/// million pending rows, `change_seq` 0 (as on rows from before migration 0004), the
/// foreign key unchecked (the rows satisfy it by construction), and the key heads written
/// once after the preload (`Raw::analyze`) instead of by the triggers.
mod preload {
    use std::ops::RangeInclusive;
    use std::sync::Mutex;
    use std::time::Duration;

    use relay_core::ledger::TokenHash;

    use super::{Db, SUMMARY, T0};
    use relay_core::time::SECOND;

    /// A preloaded todo's id: `{endpoint}-{queue}-{i:08}` (`i` from 1).
    pub fn id(ep: &str, queue: &str, i: u64) -> String {
        format!("{ep}-{queue}-{i:08}")
    }

    /// The lease token of held todo `i` of endpoint `ep`.
    pub fn token(ep: &str, i: u64) -> String {
        format!("tok-{ep}-{i}")
    }

    /// Bytes of the todos and attempts tables (indexes included) and of the whole database.
    pub struct Size {
        pub total: u64,
        pub todos: u64,
        pub attempts: u64,
    }

    /// The `concurrency_key` of preloaded pending todos: none, one for all, or a prefix
    /// followed by each todo's `i` (`{prefix}{i:08}`, a key of its own).
    #[derive(Clone, Copy)]
    pub enum Key<'a> {
        None,
        One(&'a str),
        Each(&'a str),
    }

    pub enum Raw {
        Sqlite(Mutex<rusqlite::Connection>),
        Postgres(tokio_postgres::Client),
    }

    fn big(n: u64) -> i64 {
        i64::try_from(n).expect("a count within i64")
    }

    impl Raw {
        pub async fn connect(db: &Db) -> Raw {
            match db {
                Db::Sqlite { path, .. } => {
                    let c = rusqlite::Connection::open(path).expect("open");
                    c.busy_timeout(Duration::from_secs(30))
                        .expect("busy_timeout");
                    c.execute_batch("PRAGMA foreign_keys = ON;")
                        .expect("pragmas");
                    Raw::Sqlite(Mutex::new(c))
                }
                Db::Postgres { url, schema } => {
                    let mut cfg: tokio_postgres::Config = url.parse().expect("a postgres URL");
                    cfg.options(format!(
                        "-c search_path={schema} -c session_replication_role=replica"
                    ));
                    let (c, conn) = cfg.connect(tokio_postgres::NoTls).await.expect("connect");
                    tokio::spawn(conn);
                    Raw::Postgres(c)
                }
            }
        }

        /// Runs `f` on the SQLite connection, off the runtime's async workers.
        fn lite<T>(
            c: &Mutex<rusqlite::Connection>,
            f: impl FnOnce(&rusqlite::Connection) -> T,
        ) -> T {
            tokio::task::block_in_place(|| f(&c.lock().expect("the SQLite connection")))
        }

        /// [`Raw::lite`] in one transaction: the preloads of rows and their attempts.
        fn lite_tx(c: &Mutex<rusqlite::Connection>, f: impl FnOnce(&rusqlite::Connection)) {
            Self::lite(c, |c| {
                c.execute_batch("BEGIN").expect("begin");
                f(c);
                c.execute_batch("COMMIT").expect("commit");
            })
        }

        /// Empties the todo tables.
        pub async fn clear(&self) {
            match self {
                Raw::Sqlite(c) => Self::lite(c, |c| {
                    c.execute_batch("DELETE FROM todo_attempts; DELETE FROM todos; DELETE FROM key_heads; VACUUM;")
                        .expect("clear");
                }),
                Raw::Postgres(c) => c
                    .batch_execute("TRUNCATE todo_attempts, todos, key_heads")
                    .await
                    .expect("clear"),
            }
        }

        /// The pending todos `is` of endpoint `ep` in `queue`, todo `i` created at `T0 + i` ms,
        /// with the concurrency key `key` says.
        pub async fn pending(&self, ep: &str, queue: &str, is: RangeInclusive<u64>, key: Key<'_>) {
            let (first, last) = (big(*is.start()), big(*is.end()));
            // The key as SQL sees it: a text (none: NULL) and whether `i` follows it.
            let (key, each) = match key {
                Key::None => (None, false),
                Key::One(k) => (Some(k), false),
                Key::Each(k) => (Some(k), true),
            };
            match self {
                Raw::Sqlite(c) => Self::lite(c, |c| {
                    c.execute(
                        "WITH RECURSIVE s(i) AS (SELECT ?1 UNION ALL SELECT i + 1 FROM s WHERE i < ?2)
                         INSERT INTO todos (id, endpoint, queue, title, state, attempt, max_attempts,
                                            created_at, updated_at, concurrency_key)
                         SELECT ?3 || '-' || ?4 || '-' || printf('%08d', i), ?3, ?4, 'scale',
                                'pending', 0, 5, ?5 + i, ?5 + i,
                                CASE WHEN ?7 THEN ?6 || printf('%08d', i) ELSE ?6 END FROM s",
                        rusqlite::params![first, last, ep, queue, big(T0), key, each],
                    )
                    .expect("preload pending");
                }),
                Raw::Postgres(c) => {
                    c.execute(
                        "INSERT INTO todos (id, endpoint, queue, title, state, attempt,
                                            max_attempts, created_at, updated_at, concurrency_key)
                         SELECT ep || '-' || queue || '-' || lpad(i::text, 8, '0'), ep, queue,
                                'scale', 'pending', 0, 5, t0 + i, t0 + i,
                                CASE WHEN per THEN k || lpad(i::text, 8, '0') ELSE k END
                         FROM (SELECT $1::bigint AS lo, $2::bigint AS hi, $3::text AS ep,
                                      $4::text AS queue, $5::bigint AS t0, $6::text AS k,
                                      $7::boolean AS per) AS p,
                              generate_series(lo, hi) AS i",
                        &[&first, &last, &ep, &queue, &big(T0), &key, &each],
                    )
                    .await
                    .expect("preload pending");
                }
            }
        }

        /// `n` todos of endpoint `ep` (queue `q`) claimed by `ep` at `T0` with a lease until
        /// `lease`, each with its open attempt (seq 1) fenced by [`token`]'s hash.
        pub async fn held(&self, ep: &str, n: u64, lease: u64) {
            match self {
                Raw::Sqlite(c) => Self::lite_tx(c, |c| {
                    c.execute(
                        "WITH RECURSIVE s(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM s WHERE i < ?1)
                         INSERT INTO todos (id, endpoint, queue, title, state, owner, attempt,
                                            max_attempts, lease_expires_at, claimed_at,
                                            created_at, updated_at, attempts_total)
                         SELECT ?2 || '-q-' || printf('%08d', i), ?2, 'q', 'scale', 'claimed', ?2,
                                1, 5, ?3, ?4, ?4 - 1000000 + i, ?4, 1 FROM s",
                        rusqlite::params![big(n), ep, big(lease), big(T0)],
                    )
                    .expect("preload held todos");
                    // SQLite has no SHA-256: the hashes come from here, one row at a time.
                    let mut st = c
                        .prepare(
                            "INSERT INTO todo_attempts (todo_id, seq, attempt, claimer_kind,
                                 claimer_endpoint, owner, claimant, claimed_at, lease_expires_at,
                                 lease_token_hash)
                             VALUES (?1, 1, 1, 'endpoint', ?2, ?2, 'scale', ?3, ?4, ?5)",
                        )
                        .expect("prepare");
                    for i in 1..=n {
                        let hash = TokenHash::of(&token(ep, i)).0;
                        st.execute(rusqlite::params![
                            id(ep, "q", i),
                            ep,
                            big(T0),
                            big(lease),
                            &hash[..]
                        ])
                        .expect("preload an open attempt");
                    }
                }),
                Raw::Postgres(c) => {
                    c.execute(
                        "WITH s AS (
                             SELECT i, ep || '-q-' || lpad(i::text, 8, '0') AS id, ep, lease, t0
                             FROM (SELECT $1::bigint AS n, $2::text AS ep, $3::bigint AS lease,
                                          $4::bigint AS t0) AS p,
                                  generate_series(1, n) AS i),
                         t AS (
                             INSERT INTO todos (id, endpoint, queue, title, state, owner, attempt,
                                                max_attempts, lease_expires_at, claimed_at,
                                                created_at, updated_at, attempts_total,
                                                lease_due_at)
                             SELECT id, ep, 'q', 'scale', 'claimed', ep, 1, 5, lease, t0,
                                    t0 - 1000000 + i, t0, 1, lease FROM s)
                         INSERT INTO todo_attempts (todo_id, seq, attempt, claimer_kind,
                             claimer_endpoint, owner, claimant, claimed_at, lease_expires_at,
                             lease_token_hash)
                         SELECT id, 1, 1, 'endpoint', ep, ep, 'scale', t0, lease,
                                sha256(convert_to('tok-' || ep || '-' || i::text, 'UTF8'))
                         FROM s",
                        &[&big(n), &ep, &big(lease), &big(T0)],
                    )
                    .await
                    .expect("preload held todos and their open attempts");
                }
            }
        }

        /// `n` todos of endpoint `ep` (queue `q`) done: each claimed once at `T0`, heartbeat
        /// once, completed a minute later with a small result and [`SUMMARY`], its attempt
        /// closed `completed`/`done` with a lease token's hash.
        pub async fn done(&self, ep: &str, n: u64) {
            let (claimed, ended) = (big(T0), big(T0 + 60 * SECOND));
            match self {
                Raw::Sqlite(c) => Self::lite_tx(c, |c| {
                    c.execute(
                        "WITH RECURSIVE s(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM s WHERE i < ?1)
                         INSERT INTO todos (id, endpoint, queue, title, payload, state, attempt,
                                            max_attempts, claimed_at, result, created_at,
                                            updated_at, attempts_total)
                         SELECT ?2 || '-q-' || printf('%08d', i), ?2, 'q',
                                'resize image ' || i, '{\"image\":' || i || '}', 'done', 1, 5, ?3,
                                '{\"ok\":true}', ?3 - 1000000 + i, ?4, 1 FROM s",
                        rusqlite::params![big(n), ep, claimed, ended],
                    )
                    .expect("preload done todos");
                    c.execute(
                        "WITH RECURSIVE s(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM s WHERE i < ?1)
                         INSERT INTO todo_attempts (todo_id, seq, attempt, claimer_kind,
                             claimer_endpoint, owner, claimant, claimed_at, last_heartbeat_at,
                             lease_expires_at, ended_at, outcome, disposition, summary,
                             lease_token_hash)
                         SELECT ?2 || '-q-' || printf('%08d', i), 1, 1, 'endpoint', ?2, ?2,
                                'scale', ?3, ?3 + 30000, ?3 + 330000, ?4, 'completed', 'done', ?5,
                                randomblob(32) FROM s",
                        rusqlite::params![big(n), ep, claimed, ended, SUMMARY],
                    )
                    .expect("preload closed attempts");
                }),
                Raw::Postgres(c) => {
                    c.execute(
                        "WITH s AS (
                             SELECT i, ep || '-q-' || lpad(i::text, 8, '0') AS id, ep, claimed,
                                    ended, summary
                             FROM (SELECT $1::bigint AS n, $2::text AS ep, $3::bigint AS claimed,
                                          $4::bigint AS ended, $5::text AS summary) AS p,
                                  generate_series(1, n) AS i),
                         t AS (
                             INSERT INTO todos (id, endpoint, queue, title, payload, state,
                                                attempt, max_attempts, claimed_at, result,
                                                created_at, updated_at, attempts_total,
                                                finished_at)
                             SELECT id, ep, 'q', 'resize image ' || i, '{\"image\":' || i || '}',
                                    'done', 1, 5, claimed, '{\"ok\":true}',
                                    claimed - 1000000 + i, ended, 1, ended FROM s)
                         INSERT INTO todo_attempts (todo_id, seq, attempt, claimer_kind,
                             claimer_endpoint, owner, claimant, claimed_at, last_heartbeat_at,
                             lease_expires_at, ended_at, outcome, disposition, summary,
                             lease_token_hash)
                         SELECT id, 1, 1, 'endpoint', ep, ep, 'scale', claimed, claimed + 30000,
                                claimed + 330000, ended, 'completed', 'done', summary,
                                sha256(convert_to('tok-' || ep || '-' || i::text, 'UTF8'))
                         FROM s",
                        &[&big(n), &ep, &claimed, &ended, &SUMMARY],
                    )
                    .await
                    .expect("preload done todos and their closed attempts");
                }
            }
        }

        /// Fresh planner statistics after a preload; on SQLite also the preload's WAL moved into
        /// the database, so that the store's first commit does not checkpoint it.
        pub async fn analyze(&self) {
            match self {
                Raw::Sqlite(c) => Self::lite(c, |c| {
                    c.execute_batch("ANALYZE; PRAGMA wal_checkpoint(TRUNCATE);")
                        .expect("analyze")
                }),
                // The key heads the triggers would have kept (migration 16), then statistics.
                Raw::Postgres(c) => c
                    .batch_execute(
                        "TRUNCATE key_heads;
                         INSERT INTO key_heads
                         SELECT DISTINCT ON (endpoint, queue, concurrency_key)
                                endpoint, queue, concurrency_key, priority, created_at, id
                           FROM todos
                          WHERE state IN ('pending', 'claimed', 'failed')
                            AND concurrency_key IS NOT NULL
                          ORDER BY endpoint, queue, concurrency_key, priority DESC, created_at, id;
                         ANALYZE todos, todo_attempts, key_heads",
                    )
                    .await
                    .expect("analyze"),
            }
        }

        /// How many of `ep`'s todos are claimed.
        pub async fn claimed(&self, ep: &str) -> u64 {
            let n: i64 = match self {
                Raw::Sqlite(c) => Self::lite(c, |c| {
                    c.query_row(
                        "SELECT count(*) FROM todos WHERE endpoint = ?1 AND state = 'claimed'",
                        [ep],
                        |r| r.get(0),
                    )
                    .expect("count claimed")
                }),
                Raw::Postgres(c) => c
                    .query_one(
                        "SELECT count(*) FROM todos WHERE endpoint = $1 AND state = 'claimed'",
                        &[&ep],
                    )
                    .await
                    .expect("count claimed")
                    .get(0),
            };
            u64::try_from(n).expect("a count")
        }

        /// The bytes on disk, after a vacuum (Postgres) or a checkpoint (SQLite).
        pub async fn size(&self) -> Size {
            let n = |v: i64| u64::try_from(v).expect("a size");
            match self {
                Raw::Sqlite(c) => Self::lite(c, |c| {
                    c.execute_batch("PRAGMA wal_checkpoint(TRUNCATE)")
                        .expect("checkpoint");
                    let total: i64 = c
                        .query_row(
                            "SELECT page_count * page_size FROM pragma_page_count(), pragma_page_size()",
                            [],
                            |r| r.get(0),
                        )
                        .expect("page_count");
                    let table = |t: &str| -> i64 {
                        c.query_row(
                            "SELECT coalesce(sum(d.pgsize), 0) FROM dbstat d
                             JOIN sqlite_schema m ON m.name = d.name WHERE m.tbl_name = ?1",
                            [t],
                            |r| r.get(0),
                        )
                        .expect("dbstat")
                    };
                    Size {
                        total: n(total),
                        todos: n(table("todos")),
                        attempts: n(table("todo_attempts")),
                    }
                }),
                Raw::Postgres(c) => {
                    c.batch_execute("VACUUM ANALYZE todos, todo_attempts")
                        .await
                        .expect("vacuum");
                    let r = c
                        .query_one(
                            "SELECT pg_total_relation_size('todos'),
                                    pg_total_relation_size('todo_attempts')",
                            &[],
                        )
                        .await
                        .expect("pg_total_relation_size");
                    let (todos, attempts) = (n(r.get(0)), n(r.get(1)));
                    Size {
                        total: todos + attempts,
                        todos,
                        attempts,
                    }
                }
            }
        }
    }
}
