//! The Postgres store below its writers: the pool, the ledger's settings, the schema and the
//! clock switch, and one operation in a transaction of its own. The writers' tasks and
//! [`PgStore`](super::PgStore) both hold one.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod};
use relay_core::Error;
use relay_core::ledger::{self, Answer, LedgerConfig, Op};

use super::migrations::migrate;
use super::tx::{PgClock, PgTx};
use crate::store::ops::TxKind;
use crate::store::types::DB_URL_FORMS;

/// Connections the pool keeps at most.
const POOL_SIZE: usize = 16;

fn open_err(e: impl std::fmt::Display) -> Error {
    Error::internal(format!(
        "opening the Postgres store: {e}; check the postgres:// URL and that the server answers"
    ))
}

/// A schema name a test or tenant may choose: lowercase letters, digits and `_`, 1 to 63 bytes,
/// not starting with a digit. (Identifiers cannot be bound as parameters, so they are checked.)
fn valid_schema(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && !s.as_bytes()[0].is_ascii_digit()
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

/// The store's connections and settings, shared by every handle of a
/// [`PgStore`](super::PgStore) and by its writers' tasks (which apply operations through it, and
/// so never hold the store that owns them).
#[derive(Clone)]
pub(crate) struct Db {
    pool: Pool,
    cfg: LedgerConfig,
    pub(super) schema: Option<String>,
    /// For the doorbell's dedicated LISTEN connection (outside the pool). Holds the URL's
    /// password: never printed (see `PgStore`'s `Debug`).
    pub(super) pg: std::sync::Arc<tokio_postgres::Config>,
    /// Whether an operation's `now` is the database's clock (read in its transaction:
    /// [`PgClock::Database`], the default) rather than the caller's. Shared by every handle
    /// and the writers.
    db_clock: Arc<AtomicBool>,
}

/// How long a connection attempt, unacknowledged data on a connection, and an idle connection
/// before its first keepalive probe may take, unless the URL says otherwise: a database host
/// that vanished (powered off, partitioned away) fails the connections to it within about this
/// long instead of the kernel's defaults (no connect bound, 2 h of idleness, ~15 min of
/// retransmissions), so that a server recovers by itself once the database is back. A request
/// never waits this long: `--answer-timeout` answers it first.
const CONNECTION_BOUND: std::time::Duration = std::time::Duration::from_secs(15);

/// Applies [`CONNECTION_BOUND`] where the URL left the driver's defaults.
fn bound_the_connections(pg: &mut tokio_postgres::Config) {
    if pg.get_connect_timeout().is_none() {
        pg.connect_timeout(CONNECTION_BOUND);
    }
    if pg.get_tcp_user_timeout().is_none() {
        pg.tcp_user_timeout(CONNECTION_BOUND);
    }
    if pg.get_keepalives_idle() == std::time::Duration::from_secs(2 * 60 * 60) {
        pg.keepalives_idle(CONNECTION_BOUND);
    }
}

impl Db {
    /// Connects with `search_path` set to `schema` when given (created when missing), and
    /// migrates up to `target`.
    pub(super) async fn open(
        url: &str,
        schema: Option<&str>,
        cfg: LedgerConfig,
        target: i32,
    ) -> Result<Db, Error> {
        let mut pg: tokio_postgres::Config = url.parse().map_err(|e| {
            Error::invalid(format!(
                "--db: not a valid postgres:// URL ({e}); use {DB_URL_FORMS}"
            ))
        })?;
        bound_the_connections(&mut pg);
        if let Some(s) = schema {
            if !valid_schema(s) {
                return Err(Error::invalid(format!(
                    "schema {s:?}: use 1 to 63 lowercase letters, digits or '_'"
                )));
            }
            pg.options(format!("-c search_path={s}"));
        }
        let mgr = Manager::from_config(
            pg.clone(),
            tokio_postgres::NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(mgr)
            .max_size(POOL_SIZE)
            .build()
            .map_err(open_err)?;
        let db = Db {
            pool,
            cfg,
            schema: schema.map(str::to_string),
            pg: std::sync::Arc::new(pg),
            db_clock: Arc::new(AtomicBool::new(true)),
        };
        let mut client = db.pool.get().await.map_err(open_err)?;
        if let Some(s) = schema {
            // Checked by valid_schema above; quoted as an identifier.
            client
                .batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS \"{s}\""))
                .await
                .map_err(open_err)?;
        }
        migrate(&mut client, target).await?;
        Ok(db)
    }

    /// See [`PgStore::set_db_clock`](super::PgStore::set_db_clock).
    pub(super) fn set_db_clock(&self, on: bool) {
        self.db_clock.store(on, Ordering::Relaxed);
    }

    pub(crate) fn db_clock(&self) -> bool {
        self.db_clock.load(Ordering::Relaxed)
    }

    pub(crate) fn config(&self) -> &LedgerConfig {
        &self.cfg
    }

    pub(super) fn clock(&self) -> PgClock {
        if self.db_clock() {
            PgClock::Database
        } else {
            PgClock::Caller
        }
    }

    /// Applies one operation in a transaction of its own.
    pub(crate) async fn apply_alone(&self, mut op: Op) -> Result<Answer, Error> {
        if let Op::Reap { now } = op {
            self.move_reap_marks(now).await?;
        }
        let (kind, name, subject) = (TxKind::of(&op), op.name(), op.subject());
        let mut client = self.client(name).await?;
        let mut tx = self.begin(&mut client, kind, name).await?;
        let result = async {
            if let Some(now) = op.now_mut() {
                *now = tx.db_now(*now).await?;
            }
            ledger::run(&mut tx, &self.cfg, op).await
        }
        .await;
        tx.finish(name, &subject, result).await
    }

    /// [`PgTx::move_reap_marks`] in a transaction of its own, at `now` (the caller's clock's, or
    /// the database's as the store reads it).
    async fn move_reap_marks(&self, now: relay_core::Millis) -> Result<(), Error> {
        let name = "reap";
        let mut client = self.client(name).await?;
        let tx = self.begin(&mut client, TxKind::Write, name).await?;
        let result = async {
            let now = tx.db_now(now).await?;
            tx.move_reap_marks(now).await.map(drop)
        }
        .await;
        tx.finish(name, "(the reaper's marks)", result).await
    }

    /// A pooled connection (tests use it for raw SQL).
    pub(crate) async fn client(&self, op: &str) -> Result<Object, Error> {
        self.pool.get().await.map_err(|e| {
            Error::internal(format!(
                "{op}: no Postgres connection ({e}); check that the server answers"
            ))
        })
    }

    /// A transaction on `client`, reading this store's clock (see [`PgTx::begin`]).
    pub(super) async fn begin<'c>(
        &self,
        client: &'c mut Object,
        kind: TxKind,
        op: &str,
    ) -> Result<PgTx<'c>, Error> {
        PgTx::begin(client, kind, op, self.clock()).await
    }
}
