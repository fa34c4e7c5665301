//! The Postgres store (tokio-postgres behind a deadpool pool), READ COMMITTED with row locks.
//!
//! A write operation locks the todo row (`SELECT … FOR UPDATE`) before it calls the transition,
//! so two operations on one todo run one after the other, and the second sees the first's
//! result. `claim_next` and the reaper skip rows another transaction holds (`SKIP LOCKED`): a
//! claimer never waits on another claimer's row, and whichever of the reaper or a taker locks a
//! lapsed lease first closes its attempt while the other no longer finds it lapsed.
//!
//! At most one open attempt per todo is a deferred exclusion constraint, checked at COMMIT; a
//! violation is answered as an internal error naming the todo. Read-only operations run in a
//! REPEATABLE READ, READ ONLY transaction so that a todo and its attempts come from one snapshot.
//! Connections are plain TCP (`NoTls`); `sslmode=require` URLs are refused by the driver.

pub(crate) mod batch;
mod db;
pub(crate) mod encode;
mod listen;
pub(crate) mod migrations;
pub(crate) mod tx;

use std::sync::{Arc, LazyLock};

use deadpool_postgres::Object;
use relay_core::Error;
#[cfg(test)]
use relay_core::ledger::{Actor, Attempt, Rows};
use relay_core::ledger::{Answer, LedgerConfig, Op};

pub use batch::Tuning as PgTuning;
pub use listen::{READY_CHANNEL, Ready, ReadyListener};
pub use tx::PgClock;

#[cfg(test)]
use crate::store::ops;
use crate::store::ops::TxKind;
use crate::store::rows::{self, ENDPOINT_COLS};
use crate::store::types::{Endpoint, PendingChange, PendingPage};
use crate::store::{PENDING_SCAN, Refusal, WriteRefused};
use batch::{Tuning, Writers};
use db::Db;
use encode::pg_err;
use migrations::latest_migration;
#[cfg(test)]
use migrations::migrate;
use tokio_postgres::error::SqlState;
use tx::{CHANGE_LOCK_KEY, PgTx};

/// The Postgres backend of [`Store`](super::Store): its connections and settings (`db::Db`),
/// with the batch writers on top of them.
#[derive(Clone)]
pub struct PgStore {
    db: Db,
    /// The batch writers.
    writers: Arc<Writers>,
}

impl std::fmt::Debug for PgStore {
    // The pool's config holds the URL's password; show only the schema.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PgStore(schema {})",
            self.db.schema.as_deref().unwrap_or("(default)")
        )
    }
}

static PENDING_SINCE: LazyLock<String> = LazyLock::new(|| rows::pending_since('$'));
static ENDPOINT_GET: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {ENDPOINT_COLS} FROM endpoints WHERE name = $1"));

impl PgStore {
    /// Connects and migrates, in the URL's default schema.
    pub async fn open(url: &str, cfg: LedgerConfig) -> Result<PgStore, Error> {
        Self::open_at(url, None, cfg, latest_migration()).await
    }

    /// Like [`PgStore::open_in_schema`] (`schema: None`: the URL's default), with the writers
    /// sized by `tuning`.
    pub async fn open_tuned(
        url: &str,
        schema: Option<&str>,
        cfg: LedgerConfig,
        tuning: PgTuning,
    ) -> Result<PgStore, Error> {
        let mut store = Self::open_at(url, schema, cfg, latest_migration()).await?;
        store.writers = Arc::new(Writers::start(&store.db, tuning));
        Ok(store)
    }

    /// Connects with `search_path` set to `schema` (created when missing) and migrates there.
    /// Tests use one schema each, so they run in parallel on one database.
    pub async fn open_in_schema(
        url: &str,
        schema: &str,
        cfg: LedgerConfig,
    ) -> Result<PgStore, Error> {
        Self::open_at(url, Some(schema), cfg, latest_migration()).await
    }

    pub(crate) async fn open_at(
        url: &str,
        schema: Option<&str>,
        cfg: LedgerConfig,
        target: i32,
    ) -> Result<PgStore, Error> {
        let db = Db::open(url, schema, cfg, target).await?;
        let writers = Arc::new(Writers::start(&db, Tuning::default()));
        Ok(PgStore { db, writers })
    }

    /// Makes every operation of this store (all its handles) take `now` from the database's
    /// clock, read inside its transaction, instead of the caller's: servers sharing one
    /// database then compute every lease from one clock.
    pub fn set_db_clock(&self, on: bool) {
        self.db.set_db_clock(on);
    }

    /// Applies one ledger operation: the hot write operations in a writer's batch (see
    /// `postgres::batch`), every other one in a transaction of its own.
    pub(crate) async fn apply(&self, op: Op) -> Result<Answer, Error> {
        if batch::batched(&op) {
            self.writers.apply(op).await
        } else {
            self.db.apply_alone(op).await
        }
    }

    /// One endpoint by name, as one statement outside any transaction: a statement reads one
    /// snapshot of its own, and every authenticated request asks this (BEGIN and COMMIT around
    /// it were two of its three round trips).
    pub(crate) async fn endpoint_get(&self, name: &str) -> Result<Option<Endpoint>, Error> {
        let op = "endpoint get";
        let client = self.client(op).await?;
        let st = client
            .prepare_cached(&ENDPOINT_GET)
            .await
            .map_err(|e| pg_err(op, name, &e))?;
        let rs = client
            .query(&st, &[&name])
            .await
            .map_err(|e| pg_err(op, name, &e))?;
        rs.first().map(rows::endpoint).transpose()
    }

    /// Tests: holds one writer until `release` is sent, so that what is queued meanwhile runs
    /// as one batch.
    #[cfg(test)]
    pub(crate) fn queue_now(
        &self,
        op: Op,
    ) -> impl std::future::Future<Output = Result<Answer, Error>> + use<> {
        self.writers.apply(op)
    }

    /// Tests: a connection as a writer sets it up.
    #[cfg(test)]
    pub(crate) async fn writer_connection(
        &self,
    ) -> Result<deadpool_postgres::ClientWrapper, Error> {
        batch::writer_connection(&self.db).await
    }

    #[cfg(test)]
    pub(crate) fn hold_writer(&self, release: tokio::sync::oneshot::Receiver<()>) {
        self.writers.hold(release);
    }

    pub fn config(&self) -> &LedgerConfig {
        self.db.config()
    }

    /// The same store reading `clock` (see [`PgClock`]; production keeps `Database`). Every
    /// handle of the store, and its writers, switch together ([`PgStore::set_db_clock`]).
    pub fn with_clock(self, clock: PgClock) -> PgStore {
        self.set_db_clock(clock == PgClock::Database);
        self
    }

    pub fn clock(&self) -> PgClock {
        self.db.clock()
    }

    /// Applies further migrations up to `target` (tests of a migration).
    #[cfg(test)]
    pub(crate) async fn migrate_to(&self, target: i32) -> Result<(), Error> {
        let mut client = self.client("migrate").await?;
        migrate(&mut client, target).await
    }

    /// See [`Store::probe_write`](super::Store::probe_write): the heartbeat (at `at`) in a
    /// transaction of its own, within `timeout` (a pooled connection included).
    pub(crate) async fn probe_write(
        &self,
        at: i64,
        timeout: std::time::Duration,
    ) -> Result<(), Refusal> {
        let probe = async {
            let client = self
                .client("healthz")
                .await
                .map_err(|e| (WriteRefused::UNREACHABLE, e))?;
            client.execute(super::HEARTBEAT, &[&at]).await.map_err(|e| {
                let reason = match e.code() {
                    Some(c) if *c == SqlState::DISK_FULL => WriteRefused::FULL,
                    Some(_) => WriteRefused::FAILED,
                    None => WriteRefused::UNREACHABLE,
                };
                (reason, pg_err("healthz", "(write probe)", &e))
            })
        };
        match tokio::time::timeout(timeout, probe).await {
            Ok(r) => r.map(drop),
            Err(_) => Err((
                WriteRefused::LOCKED,
                Error::internal(format!(
                    "healthz: no write within {} ms",
                    timeout.as_millis()
                )),
            )),
        }
    }

    /// A pooled connection (tests use it for raw SQL).
    pub(crate) async fn client(&self, op: &str) -> Result<Object, Error> {
        self.db.client(op).await
    }

    /// A transaction of its own on `client` (see [`PgTx::begin`]), reading this store's clock.
    pub(crate) async fn begin<'c>(
        &self,
        client: &'c mut Object,
        kind: TxKind,
        op: &str,
    ) -> Result<PgTx<'c>, Error> {
        self.db.begin(client, kind, op).await
    }

    /// Commits on `Ok` (a deferred constraint fires here), rolls back on `Err`.
    pub(crate) async fn finish<R>(
        &self,
        tx: PgTx<'_>,
        op: &str,
        subject: &str,
        result: Result<R, Error>,
    ) -> Result<R, Error> {
        tx.finish(op, subject, result).await
    }

    /// See [`Store::pending_since`](super::Store::pending_since). Sequence numbers are taken
    /// inside a transaction and commit in any order, so a plain "above the last number seen"
    /// would step over a number still in flight and never ring for it. Every write transaction
    /// holds this store's change lock shared from its start; the scan takes it exclusive for
    /// an instant, which waits out every writer already running, and reads the sequence there:
    /// every number at or below it is committed or rolled back. (New writers wait behind the
    /// scan for that instant: the length of the longest write transaction then running, and
    /// `lock_timeout` bounds it; a scan that times out is retried on the next tick.)
    pub(crate) async fn pending_since(
        &self,
        after: Option<u64>,
        limit: usize,
    ) -> Result<PendingPage, Error> {
        let op = PENDING_SCAN;
        let mut client = self.client(op).await?;
        let tx = client.transaction().await.map_err(|e| pg_err(op, "", &e))?;
        tx.batch_execute(&format!(
            "SET LOCAL lock_timeout = '2s'; SELECT pg_advisory_xact_lock({CHANGE_LOCK_KEY})"
        ))
        .await
        .map_err(|e| pg_err(op, "", &e))?;
        let horizon: i64 = tx
            .query_one(
                "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM todo_change_seq",
                &[],
            )
            .await
            .map_err(|e| pg_err(op, "", &e))?
            .get(0);
        tx.commit().await.map_err(|e| pg_err(op, "", &e))?;
        let horizon = u64::try_from(horizon).unwrap_or(0);
        let Some(after) = after else {
            return Ok(PendingPage {
                changes: Vec::new(),
                watermark: horizon,
            });
        };
        let args = [
            i64::try_from(after).unwrap_or(i64::MAX),
            i64::try_from(horizon).unwrap_or(i64::MAX),
            i64::try_from(limit).unwrap_or(i64::MAX),
        ];
        let st = client
            .prepare_cached(&PENDING_SINCE)
            .await
            .map_err(|e| pg_err(op, "", &e))?;
        let rs = client
            .query(&st, &[&args[0], &args[1], &args[2]])
            .await
            .map_err(|e| pg_err(op, "", &e))?;
        let mut changes = Vec::with_capacity(rs.len());
        for r in &rs {
            let total: i32 = r.try_get(3).map_err(|e| pg_err(op, "", &e))?;
            let seq: i64 = r.try_get(4).map_err(|e| pg_err(op, "", &e))?;
            changes.push(PendingChange {
                id: r.try_get(0).map_err(|e| pg_err(op, "", &e))?,
                endpoint: r.try_get(1).map_err(|e| pg_err(op, "", &e))?,
                queue: r.try_get(2).map_err(|e| pg_err(op, "", &e))?,
                attempts_total: u32::try_from(total).unwrap_or(0),
                change_seq: u64::try_from(seq).unwrap_or(0),
            });
        }
        Ok(rows::pending_page(changes, limit, horizon))
    }

    /// Opens the doorbell's dedicated connection and LISTENs on [`READY_CHANNEL`]: every todo
    /// of this store's schema that becomes pending, from whichever server or CLI process, is
    /// delivered once its transaction commits. The listener ends (`recv` answers `None`) when
    /// the connection is lost; the caller reconnects, and the doorbell scan covers the gap.
    pub async fn listen_ready(&self) -> Result<ReadyListener, Error> {
        listen::listen_ready(&self.db.pg).await
    }

    /// A planner setting's value inside an operation's own transaction, after the claim of
    /// `claim_next` ran there alone (outside a batch).
    #[cfg(test)]
    pub(crate) async fn setting_after_claim(&self, setting: &str, actor: &Actor) -> String {
        let mut client = self.client("test").await.expect("a connection");
        let mut tx = self
            .begin(&mut client, TxKind::Write, "test")
            .await
            .expect("a transaction");
        let holds = relay_core::ledger::Holds::default();
        let claim = relay_core::ledger::rows::ClaimQuery::new(0, actor, None, &holds);
        Rows::next_claimable(&mut tx, &claim)
            .await
            .expect("the claim's read");
        let row = tx
            .raw()
            .query_one("SELECT current_setting($1)", &[&setting])
            .await
            .expect("the setting");
        row.get(0)
    }

    #[cfg(test)]
    pub(crate) async fn plant_attempt(&self, a: Attempt) -> Result<(), Error> {
        let mut client = self.client("plant").await?;
        let mut tx = self.begin(&mut client, TxKind::Write, "plant").await?;
        let r = ops::plant_attempt(&mut tx, &a).await;
        self.finish(tx, "plant", &a.todo_id, r).await
    }
}
