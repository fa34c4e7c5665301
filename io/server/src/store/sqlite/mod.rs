//! The SQLite store (rusqlite, bundled SQLite): WAL, a busy timeout, foreign keys on, STRICT
//! tables, numbered migrations.
//!
//! SQLite calls block, so no operation runs on the async runtime: one writer thread owns the
//! write connection and commits the operations waiting for it as a group, each in a savepoint
//! of one `BEGIN IMMEDIATE` transaction, which takes SQLite's single write lock up front (the
//! read of a todo and the write of its change cannot interleave with another writer, and a
//! database another process holds is waited for, busy_timeout, never answered with a stale
//! read); a few reader threads run read-only operations on WAL snapshots (see
//! `threads`). An in-memory database has one connection, used inline by each caller.
//!
//! Durability: `synchronous = NORMAL` in WAL mode, as before group commit. An operation is
//! answered only after the COMMIT of its batch returned: an acknowledged operation survives a
//! crash of the process (kill -9 included; the crash test holds the store to it); a power loss
//! or OS crash may lose the last acknowledged batches (NORMAL does not sync the WAL on each
//! commit), never corrupt the file or keep part of a batch.

pub(crate) mod migrations;
#[cfg(test)]
mod tests;
pub(crate) mod threads;
mod tx;

use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock};

use relay_core::Error;
#[cfg(test)]
use relay_core::ledger::Attempt;
use relay_core::ledger::LedgerConfig;
use rusqlite::{Connection, TransactionBehavior, params};

#[cfg(test)]
use crate::store::ops;
use crate::store::ops::TxKind;
use crate::store::rows;
use crate::store::types::{PendingChange, PendingPage};
use crate::store::{PENDING_SCAN, Refusal, WriteRefused};
#[cfg(test)]
pub(crate) use migrations::MIGRATIONS;
pub(crate) use migrations::latest_migration;
use migrations::migrate;
use threads::{Threads, To, Tuning};
pub(crate) use tx::SqliteTx;
use tx::sql_err;

/// The SQLite backend of [`Store`](super::Store).
#[derive(Clone)]
pub struct SqliteStore {
    threads: Arc<Threads>,
    cfg: LedgerConfig,
    path: Option<PathBuf>,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.path {
            Some(p) => write!(f, "SqliteStore({})", p.display()),
            None => f.write_str("SqliteStore(:memory:)"),
        }
    }
}

fn open_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::internal(format!("opening the SQLite store {what}: {e}"))
}

/// How long a statement waits on another writer's lock before answering busy.
const BUSY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Creates a missing database file readable by its owner only: it holds endpoint token hashes
/// and every payload. SQLite gives its -wal and -shm files the database file's mode.
fn create_private(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt as _;
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
    {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e),
    }
}

fn connect(path: Option<&Path>) -> Result<Connection, Error> {
    let what = path.map_or_else(|| ":memory:".to_string(), |p| p.display().to_string());
    if let Some(p) = path {
        create_private(p).map_err(|e| open_err(&what, e))?;
    }
    let conn = match path {
        Some(p) => Connection::open(p),
        None => Connection::open_in_memory(),
    }
    .map_err(|e| open_err(&what, e))?;
    conn.busy_timeout(BUSY_TIMEOUT)
        .map_err(|e| open_err(&what, e))?;
    // No memory-mapped I/O: pages of a mapped file count in the server's RSS, and SQLite's
    // reads through the window (with the kernel's fault-around) mapped all 256 MiB of it for an
    // idle server with 10 000 pending todos of 60 KiB (295 MB RSS; 35 MB without). Reads go
    // through the page cache instead, bounded by `cache_size` (16 MiB per connection).
    conn.execute_batch(
        "PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL; PRAGMA foreign_keys = ON;
         PRAGMA cache_size = -16384; PRAGMA mmap_size = 0;",
    )
    .map_err(|e| open_err(&what, e))?;
    conn.set_prepared_statement_cache_capacity(64);
    Ok(conn)
}

static PENDING_SINCE: LazyLock<String> = LazyLock::new(|| rows::pending_since('?'));

impl SqliteStore {
    /// An in-memory database (gone when the store is dropped).
    pub async fn open_memory(cfg: LedgerConfig) -> Result<SqliteStore, Error> {
        Self::open_at(None, cfg, latest_migration()).await
    }

    /// A database file, created when missing.
    pub async fn open_file(
        path: impl Into<PathBuf>,
        cfg: LedgerConfig,
    ) -> Result<SqliteStore, Error> {
        Self::open_at(Some(path.into()), cfg, latest_migration()).await
    }

    /// A database file with the thread sizes given (the benchmarks vary them).
    pub async fn open_file_tuned(
        path: impl Into<PathBuf>,
        cfg: LedgerConfig,
        tuning: Tuning,
    ) -> Result<SqliteStore, Error> {
        Self::open_tuned(Some(path.into()), cfg, latest_migration(), tuning).await
    }

    /// Opens and migrates up to `target` (tests open older schemas to exercise a migration).
    pub(crate) async fn open_at(
        path: Option<PathBuf>,
        cfg: LedgerConfig,
        target: u32,
    ) -> Result<SqliteStore, Error> {
        Self::open_tuned(path, cfg, target, Tuning::default()).await
    }

    async fn open_tuned(
        path: Option<PathBuf>,
        cfg: LedgerConfig,
        target: u32,
        tuning: Tuning,
    ) -> Result<SqliteStore, Error> {
        let p = path.clone();
        let open = move || -> Result<Threads, Error> {
            let mut writer = connect(p.as_deref())?;
            migrate(&mut writer, target)?;
            // A madsim build may start no thread (and a thread's answer would arrive at no
            // deterministic point): its file database runs inline, as one in memory does.
            if p.is_none() || cfg!(madsim) {
                return Ok(Threads::inline(writer));
            }
            let mut readers = Vec::new();
            for _ in 0..tuning.readers {
                readers.push(connect(p.as_deref())?);
            }
            Threads::start(writer, readers, connect(p.as_deref())?, tuning)
        };
        // Opening is one hop to the blocking pool; the operations after it go to the threads.
        #[cfg(not(madsim))]
        let threads = tokio::task::spawn_blocking(open)
            .await
            .map_err(|e| open_err("(worker)", e))??;
        #[cfg(madsim)]
        let threads = open()?;
        Ok(SqliteStore {
            threads: Arc::new(threads),
            cfg,
            path,
        })
    }

    pub fn config(&self) -> &LedgerConfig {
        &self.cfg
    }

    /// The database file, `None` in memory.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Applies further migrations up to `target` (tests of a migration).
    #[cfg(test)]
    pub(crate) async fn migrate_to(&self, target: u32) -> Result<(), Error> {
        self.with_conn(move |c| migrate(c, target)).await
    }

    /// Runs `f` on the writer's connection between batches (tests use it for raw SQL).
    #[cfg(test)]
    pub(crate) async fn with_conn<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Connection) -> Result<R, Error> + Send + 'static,
    ) -> Result<R, Error> {
        self.threads.alone(To::Writer, "raw SQL", f).await
    }

    /// Runs one operation in one transaction: a write in the writer's next batch (its writes
    /// kept on `Ok`, rolled back alone on `Err`, answered after the batch's COMMIT), a read on a
    /// reader's snapshot.
    pub(crate) async fn run<R: Send + 'static>(
        &self,
        kind: TxKind,
        op: &'static str,
        subject: String,
        f: impl FnOnce(&mut SqliteTx<'_>) -> Result<R, Error> + Send + 'static,
    ) -> Result<R, Error> {
        let to = match kind {
            TxKind::Write => To::Writer,
            TxKind::Read => To::Reader,
        };
        let what = format!("{op} {subject}");
        self.threads
            .tx(to, what, move |c| f(&mut SqliteTx { c }))
            .await
    }

    /// See [`Store::probe_write`](super::Store::probe_write): `BEGIN IMMEDIATE`, the heartbeat
    /// (at `at`), `COMMIT`. A database write-locked by another process answers `Err` after
    /// `timeout`, not after the usual busy timeout. On a reader's connection, so the probe waits
    /// for this process's own writer only as long as one batch holds the lock.
    pub(crate) async fn probe_write(
        &self,
        at: i64,
        timeout: std::time::Duration,
    ) -> Result<(), Refusal> {
        let probed = self.threads.alone(To::Reader, "healthz", move |conn| {
            let err = |e: rusqlite::Error| sql_err("healthz", "(write probe)", e);
            conn.busy_timeout(timeout).map_err(err)?;
            let wrote = conn
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .and_then(|tx| {
                    tx.execute(super::HEARTBEAT, params![at])?;
                    tx.commit()
                });
            conn.busy_timeout(BUSY_TIMEOUT).map_err(err)?;
            Ok(wrote.map_err(|e| {
                let reason = match e.sqlite_error_code() {
                    Some(rusqlite::ErrorCode::DiskFull) => WriteRefused::FULL,
                    Some(
                        rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked,
                    ) => WriteRefused::LOCKED,
                    _ => WriteRefused::FAILED,
                };
                (reason, err(e))
            }))
        });
        probed
            .await
            .unwrap_or_else(|e| Err((WriteRefused::FAILED, e)))
    }

    /// See [`Store::pending_since`](super::Store::pending_since). One read snapshot: with a
    /// single writer, every change up to the counter it reads is in it.
    pub(crate) async fn pending_since(
        &self,
        after: Option<u64>,
        limit: usize,
    ) -> Result<PendingPage, Error> {
        self.run(TxKind::Read, PENDING_SCAN, String::new(), move |tx| {
            let horizon: i64 =
                tx.c.query_row("SELECT n FROM todo_change_counter WHERE id = 1", [], |r| {
                    r.get(0)
                })
                .map_err(|e| sql_err(PENDING_SCAN, "", e))?;
            let horizon = u64::try_from(horizon).unwrap_or(0);
            let Some(after) = after else {
                return Ok(PendingPage {
                    changes: Vec::new(),
                    watermark: horizon,
                });
            };
            let mut st =
                tx.c.prepare_cached(&PENDING_SINCE)
                    .map_err(|e| sql_err(PENDING_SCAN, "", e))?;
            let changes = st
                .query_map(
                    params![
                        i64::try_from(after).unwrap_or(i64::MAX),
                        i64::try_from(horizon).unwrap_or(i64::MAX),
                        i64::try_from(limit).unwrap_or(i64::MAX)
                    ],
                    |r| {
                        Ok(PendingChange {
                            id: r.get(0)?,
                            endpoint: r.get(1)?,
                            queue: r.get(2)?,
                            attempts_total: r.get(3)?,
                            change_seq: r.get::<_, i64>(4)?.try_into().unwrap_or(0),
                        })
                    },
                )
                .and_then(Iterator::collect::<Result<Vec<_>, _>>)
                .map_err(|e| sql_err(PENDING_SCAN, "", e))?;
            Ok(rows::pending_page(changes, limit, horizon))
        })
        .await
    }

    #[cfg(test)]
    pub(crate) async fn plant_attempt(&self, a: Attempt) -> Result<(), Error> {
        let subject = a.todo_id.clone();
        self.run(TxKind::Write, "plant", subject, move |tx| {
            relay_core::ledger::rows::ready(ops::plant_attempt(tx, &a))
        })
        .await
    }
}
