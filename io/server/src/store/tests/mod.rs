//! The store tests: model-based (each store against the in-memory ledger), concurrency, and the
//! storage specifics (retention, migrations, reopening, parameterisation, endpoints).
//!
//! Postgres tests run when `RELAY_TEST_POSTGRES` names a server (each test in a schema of its
//! own, dropped at the end); without it they say they were skipped, unless
//! `RELAY_REQUIRE_POSTGRES=1`, where they fail instead.

/// A test of its own that runs `$body` on both stores ([`on_both_stores`]) with `$cfg`,
/// named `$name`.
macro_rules! test_on_both_stores {
    ($name:ident, $cfg:expr, $body:expr) => {
        #[test]
        fn $name() {
            $crate::store::tests::on_both_stores(stringify!($name), $cfg, $body);
        }
    };
}

mod batch;
mod board;
mod concurrency;
mod misc;
mod model;
mod multi;
mod scan;
mod text;
mod upgrade;

use std::sync::atomic::{AtomicU32, Ordering};

use std::future::Future;
use std::pin::Pin;

use relay_core::ledger::{
    Actor, Answer, Attempt, ClaimOpts, LedgerConfig, NewTodo, Op, Report, Todo, TokenHash,
};
use relay_core::testing::Queue;
use relay_core::time::SECOND;
use relay_core::{Error, Millis};
use tokio::runtime::Runtime;

use super::{PgClock, PgStore, Store};

pub(super) const T0: Millis = 1_790_000_000_000;

/// The model tests' settings: a small attempt cap, so random programs prune.
pub(super) fn cfg() -> LedgerConfig {
    LedgerConfig {
        attempts_cap: 4,
        ..LedgerConfig::default()
    }
}

pub(super) fn current_thread() -> Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

pub(super) fn multi_thread() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// The Postgres server to test against, or `None` (after saying so) when none is configured.
pub(super) fn postgres_url(test: &str) -> Option<String> {
    match std::env::var("RELAY_TEST_POSTGRES") {
        Ok(url) if !url.is_empty() => Some(url),
        _ => {
            assert!(
                std::env::var("RELAY_REQUIRE_POSTGRES").as_deref() != Ok("1"),
                "{test}: RELAY_REQUIRE_POSTGRES=1 but RELAY_TEST_POSTGRES is unset; source \
                 .ci/postgres.sh and call start_postgres, or point RELAY_TEST_POSTGRES at a server"
            );
            eprintln!("{test}: skipped (set RELAY_TEST_POSTGRES=postgres://… to run it)");
            None
        }
    }
}

/// A schema of one test's own; dropped (with everything in it) when this is dropped, also when
/// the test panics.
pub(super) struct PgSchema {
    pub url: String,
    pub name: String,
}

impl PgSchema {
    pub fn new(test: &str) -> Option<PgSchema> {
        static N: AtomicU32 = AtomicU32::new(0);
        let url = postgres_url(test)?;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let name = format!(
            "t_{}_{}_{nanos}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        Some(PgSchema { url, name })
    }

    pub async fn open(&self, cfg: LedgerConfig) -> Store {
        Store::Postgres(
            PgStore::open_in_schema(&self.url, &self.name, cfg)
                .await
                .expect("open the Postgres store")
                .with_clock(PgClock::Caller),
        )
    }
}

impl Drop for PgSchema {
    fn drop(&mut self) {
        let (url, name) = (self.url.clone(), self.name.clone());
        // A runtime of its own on a thread of its own: this may run inside another runtime.
        let _ = std::thread::spawn(move || {
            current_thread().block_on(async move {
                if let Ok((client, conn)) =
                    tokio_postgres::connect(&url, tokio_postgres::NoTls).await
                {
                    tokio::spawn(conn);
                    let _ = client
                        .batch_execute(&format!("DROP SCHEMA IF EXISTS \"{name}\" CASCADE"))
                        .await;
                }
            });
        })
        .join();
    }
}

pub(super) async fn sqlite_memory(cfg: LedgerConfig) -> Store {
    Store::open("sqlite::memory:", cfg)
        .await
        .expect("open sqlite::memory:")
}

/// Runs `body` on SQLite (a temp file, so that several connections contend) and, when a server
/// is configured, on Postgres.
pub(super) fn on_both_stores<F, Fut>(test: &str, cfg: LedgerConfig, body: F)
where
    F: Fn(Store) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let rt = multi_thread();
    let dir = tempfile::tempdir().expect("a temp dir");
    let url = format!("sqlite:{}", dir.path().join("relay.db").display());
    rt.block_on(async {
        let store = Store::open(&url, cfg.clone()).await.expect("open sqlite");
        body(store).await;
    });
    if let Some(schema) = PgSchema::new(test) {
        rt.block_on(async {
            let store = schema.open(cfg).await;
            body(store).await;
        });
    }
}

/// Raw SQL for tests: how many attempt rows a todo has.
pub(super) async fn attempt_rows(store: &Store, id: &str) -> i64 {
    match store {
        Store::Sqlite(s) => {
            let id = id.to_string();
            s.with_conn(move |c| {
                c.query_row(
                    "SELECT count(*) FROM todo_attempts WHERE todo_id = ?1",
                    [id],
                    |r| r.get(0),
                )
                .map_err(|e| Error::internal(e.to_string()))
            })
            .await
            .expect("count attempts")
        }
        Store::Postgres(p) => {
            let c = p.client("test").await.expect("a connection");
            c.query_one(
                "SELECT count(*) FROM todo_attempts WHERE todo_id = $1",
                &[&id],
            )
            .await
            .expect("count attempts")
            .get(0)
        }
    }
}

/// Raw SQL for tests: the one number a constant query answers.
pub(super) async fn raw_count(store: &Store, sql: &'static str) -> i64 {
    match store {
        Store::Sqlite(s) => s
            .with_conn(move |c| {
                c.query_row(sql, [], |r| r.get(0))
                    .map_err(|e| Error::internal(e.to_string()))
            })
            .await
            .expect("raw count"),
        Store::Postgres(p) => p
            .client("test")
            .await
            .expect("a connection")
            .query_one(sql, &[])
            .await
            .expect("raw count")
            .get(0),
    }
}

/// Raw SQL for tests: runs statements as they are (no values: constants only).
pub(super) async fn raw_batch(store: &Store, sql: &'static str) {
    match store {
        Store::Sqlite(s) => s
            .with_conn(move |c| {
                c.execute_batch(sql)
                    .map_err(|e| Error::internal(e.to_string()))
            })
            .await
            .expect("raw SQL"),
        Store::Postgres(p) => p
            .client("test")
            .await
            .expect("a connection")
            .batch_execute(sql)
            .await
            .expect("raw SQL"),
    }
}

/// Every attempt of a todo, oldest first, as the operator sees them.
pub(super) async fn all_attempts(store: &Store, id: &str) -> (Todo, Vec<Attempt>) {
    let get = Op::GetTodo {
        actor: Actor::cli(),
        id: id.into(),
        attempts_limit: usize::MAX,
    };
    let v = store
        .apply(get)
        .await
        .and_then(Answer::view)
        .expect("get_todo");
    let mut a = v.attempts;
    a.reverse();
    (v.todo, a)
}

pub(super) fn new_todo(id: &str, queue: &str) -> NewTodo {
    NewTodo {
        id: id.into(),
        queue: queue.into(),
        title: format!("todo {id}"),
        ..NewTodo::default()
    }
}

pub(super) fn opts(ttl_secs: u64, token: Option<&str>) -> ClaimOpts {
    ClaimOpts {
        ttl: ttl_secs * SECOND,
        claimant: Some("test".into()),
        token_hash: token.map(TokenHash::of),
    }
}

/// A store driven synchronously, so one random program can run on the ledger and on it.
pub(super) struct Blocking<'r> {
    pub rt: &'r Runtime,
    pub store: Store,
}

impl Queue for Blocking<'_> {
    type Out<T: 'static> = Result<T, Error>;

    fn call<T: 'static>(&mut self, op: Op, shape: fn(Answer) -> Result<T, Error>) -> Self::Out<T> {
        self.rt.block_on(self.store.apply(op)).and_then(shape)
    }
}

/// The async tests call the store by name too.
impl Queue for Store {
    type Out<T: 'static> = Pin<Box<dyn Future<Output = Result<T, Error>> + Send>>;

    fn call<T: 'static>(&mut self, op: Op, shape: fn(Answer) -> Result<T, Error>) -> Self::Out<T> {
        let store = self.clone();
        Box::pin(async move { store.apply(op).await.and_then(shape) })
    }
}

/// The store's futures can move between threads (the server runs on a multi-thread runtime).
#[test]
fn store_futures_are_send() {
    fn send<T: Send>(_: &T) {}
    let rt = current_thread();
    let store = rt.block_on(sqlite_memory(cfg()));
    let actor = Actor::endpoint("e1");
    let o = opts(30, None);
    send(&store.apply(Op::ClaimNext {
        now: T0,
        actor: actor.clone(),
        queues: None,
        opts: o,
    }));
    send(&store.apply(Op::Complete {
        now: T0,
        actor: actor.clone(),
        id: "x".into(),
        report: Report::default(),
    }));
    send(&store.endpoint_revoke(T0, "e1"));
    send(&store.apply(Op::GetTodo {
        actor,
        id: "x".into(),
        attempts_limit: 5,
    }));
}
