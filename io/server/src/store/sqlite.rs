//! The SQLite store (rusqlite, bundled SQLite): WAL, a busy timeout, foreign keys on, STRICT
//! tables, numbered migrations.
//!
//! SQLite calls block, so no operation runs on the async runtime: one writer thread owns the
//! write connection and commits the operations waiting for it as a group, each in a savepoint
//! of one `BEGIN IMMEDIATE` transaction, which takes SQLite's single write lock up front (the
//! read of a todo and the write of its change cannot interleave with another writer, and a
//! database another process holds is waited for, busy_timeout, never answered with a stale
//! read); a few reader threads run read-only operations on WAL snapshots (see
//! `sqlite_threads`). An in-memory database has one connection, used inline by each caller.
//!
//! Durability: `synchronous = NORMAL` in WAL mode, as before group commit. An operation is
//! answered only after the COMMIT of its batch returned: an acknowledged operation survives a
//! crash of the process (kill -9 included; the crash test holds the store to it); a power loss
//! or OS crash may lose the last acknowledged batches (NORMAL does not sync the WAL on each
//! commit), never corrupt the file or keep part of a batch.

use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock};

use relay_core::Error;
use relay_core::Millis;
use relay_core::ledger::{
    Actor, Attempt, AttemptWrite, LedgerConfig, Newest, Rows, Sweep, Todo, TodoFilter,
};
use rusqlite::{Connection, OptionalExtension, TransactionBehavior, params};

use super::Endpoint;
#[cfg(test)]
use super::ops;
use super::ops::{Tx, TxKind};
use super::rows::{self, ENDPOINT_COLS, Val, ms};
use super::sqlite_threads::{Threads, To, Tuning};
use super::{PendingChange, PendingPage};

/// The numbered migrations, applied in order, each recorded in `schema_migrations`.
pub(crate) const MIGRATIONS: &[(u32, &str, &str)] = &[
    (1, "todos", MIGRATION_0001),
    (2, "todo_attempts", MIGRATION_0002),
    (3, "endpoints", MIGRATION_0003),
    (4, "todo_change_seq", MIGRATION_0004),
    (5, "failure_classes", MIGRATION_0005),
    (6, "board", MIGRATION_0006),
    (7, "mcp_sessions", MIGRATION_0007),
    (8, "write_path", MIGRATION_0008),
    (9, "session_streams", MIGRATION_0009),
    (10, "board_bulk", MIGRATION_0010),
];

/// The todos table as it was before attempt history (the design's "before").
const MIGRATION_0001: &str = "
CREATE TABLE todos (
    id               TEXT    NOT NULL PRIMARY KEY,
    endpoint         TEXT    NOT NULL,
    queue            TEXT    NOT NULL,
    title            TEXT    NOT NULL,
    kind             TEXT,
    source           TEXT,
    payload          TEXT,
    work_order       TEXT,
    assignee         TEXT,
    state            TEXT    NOT NULL
        CHECK (state IN ('pending', 'claimed', 'failed', 'done', 'canceled')),
    owner            TEXT,
    attempt          INTEGER NOT NULL DEFAULT 0 CHECK (attempt >= 0),
    max_attempts     INTEGER NOT NULL CHECK (max_attempts >= 1),
    lease_expires_at INTEGER,
    claimed_at       INTEGER,
    next_retry_at    INTEGER,
    result           TEXT,
    created_at       INTEGER NOT NULL,
    updated_at       INTEGER NOT NULL,
    CHECK ((state = 'claimed') = (owner IS NOT NULL AND lease_expires_at IS NOT NULL))
) STRICT;
-- claim_next: the live todos of an endpoint in FIFO order.
CREATE INDEX todos_fifo ON todos (endpoint, created_at, id)
    WHERE state IN ('pending', 'claimed', 'failed');
-- the reaper and the retry sweep
CREATE INDEX todos_lease ON todos (lease_expires_at) WHERE state = 'claimed';
CREATE INDEX todos_retry ON todos (next_retry_at) WHERE state = 'failed';
-- retention: finished todos by age
CREATE INDEX todos_finished ON todos (updated_at) WHERE state IN ('done', 'canceled', 'failed');
";

/// Attempt history: the attempts table, the todo counters, and one open attempt for every lease
/// in flight. `attempts_total` starts at `attempt` so that a later claim's seq continues the
/// count; the attempts before the migration have no row and count as pruned.
const MIGRATION_0002: &str = "
CREATE TABLE todo_attempts (
    todo_id           TEXT    NOT NULL REFERENCES todos (id) ON DELETE CASCADE,
    seq               INTEGER NOT NULL CHECK (seq >= 1),
    attempt           INTEGER NOT NULL CHECK (attempt >= 0),
    claimer_kind      TEXT    NOT NULL CHECK (claimer_kind IN ('endpoint', 'owner')),
    claimer_endpoint  TEXT,
    claimer_session   TEXT,
    owner             TEXT    NOT NULL,
    claimant          TEXT    CHECK (length(CAST(claimant AS BLOB)) <= 128),
    claimed_at        INTEGER NOT NULL,
    last_heartbeat_at INTEGER,
    lease_expires_at  INTEGER NOT NULL,
    ended_at          INTEGER,
    outcome           TEXT    CHECK (outcome IN ('completed', 'failed', 'released',
                                     'lease_expired', 'reaped', 'canceled', 'revoked')),
    disposition       TEXT    CHECK (disposition IN ('done', 'retry_scheduled', 'requeued',
                                     'dead_lettered', 'canceled')),
    summary           TEXT    CHECK (length(CAST(summary AS BLOB)) <= 2048),
    summary_truncated INTEGER NOT NULL DEFAULT 0 CHECK (summary_truncated IN (0, 1)),
    artifact          TEXT    CHECK (length(CAST(artifact AS BLOB)) <= 512),
    lease_token_hash  BLOB    CHECK (length(lease_token_hash) = 32),
    PRIMARY KEY (todo_id, seq),
    CHECK ((ended_at IS NULL) = (outcome IS NULL)),
    CHECK ((ended_at IS NULL) = (disposition IS NULL))
) STRICT, WITHOUT ROWID;
-- At most one open attempt per todo. SQLite checks it per row; the store closes the dead
-- attempt before it opens the next one, so a takeover never trips it.
CREATE UNIQUE INDEX todo_attempts_one_open ON todo_attempts (todo_id) WHERE ended_at IS NULL;

ALTER TABLE todos ADD COLUMN attempts_total  INTEGER NOT NULL DEFAULT 0 CHECK (attempts_total >= 0);
ALTER TABLE todos ADD COLUMN attempts_pruned INTEGER NOT NULL DEFAULT 0 CHECK (attempts_pruned >= 0);

UPDATE todos SET attempts_total = attempt, attempts_pruned = attempt WHERE state <> 'claimed';
UPDATE todos SET attempts_total = max(attempt, 1), attempts_pruned = max(attempt, 1) - 1
    WHERE state = 'claimed';
INSERT INTO todo_attempts (todo_id, seq, attempt, claimer_kind, claimer_endpoint, owner,
                           claimant, claimed_at, lease_expires_at)
SELECT id, attempts_total, attempt,
       CASE WHEN owner = 'operator' THEN 'owner' ELSE 'endpoint' END,
       CASE WHEN owner = 'operator' THEN NULL ELSE owner END,
       owner, 'migrated', coalesce(claimed_at, lease_expires_at, updated_at), lease_expires_at
FROM todos WHERE state = 'claimed';
";

const MIGRATION_0003: &str = "
CREATE TABLE endpoints (
    name       TEXT    NOT NULL PRIMARY KEY,
    token_hash BLOB    NOT NULL CHECK (length(token_hash) = 32),
    verbs      TEXT    NOT NULL,
    queues     TEXT,
    created_at INTEGER NOT NULL,
    revoked_at INTEGER
) STRICT;
";

/// The change sequence the out-of-process doorbell scan follows: every insert or update of a
/// todo row takes the next number of a per-store counter (triggers, so that no write path can
/// forget it), and the scan reads only pending rows numbered above its watermark, through a
/// partial index: O(new rows) per tick whatever the backlog. SQLite has one writer at a time, so
/// numbers commit in order and a reader's snapshot holds every row up to the counter it reads.
/// Rows from before this migration keep 0 (the first scan starts at the counter anyway).
const MIGRATION_0004: &str = "
ALTER TABLE todos ADD COLUMN change_seq INTEGER NOT NULL DEFAULT 0;
CREATE TABLE todo_change_counter (
    id INTEGER NOT NULL PRIMARY KEY CHECK (id = 1),
    n  INTEGER NOT NULL CHECK (n >= 0)
) STRICT;
INSERT INTO todo_change_counter (id, n) VALUES (1, 0);
CREATE INDEX todos_change ON todos (change_seq) WHERE state = 'pending';
CREATE TRIGGER todos_change_insert AFTER INSERT ON todos BEGIN
    UPDATE todo_change_counter SET n = n + 1 WHERE id = 1;
    UPDATE todos SET change_seq = (SELECT n FROM todo_change_counter WHERE id = 1)
        WHERE id = NEW.id;
END;
-- Every column but change_seq itself, so the trigger's own update does not fire it again.
CREATE TRIGGER todos_change_update AFTER UPDATE OF id, endpoint, queue, title, kind, source,
    payload, work_order, assignee, state, owner, attempt, max_attempts, lease_expires_at,
    claimed_at, next_retry_at, result, created_at, updated_at, attempts_total, attempts_pruned
    ON todos BEGIN
    UPDATE todo_change_counter SET n = n + 1 WHERE id = 1;
    UPDATE todos SET change_seq = (SELECT n FROM todo_change_counter WHERE id = 1)
        WHERE id = NEW.id;
END;
";

/// Recovery by failure class: why a dead letter is one (on the todo, and on the attempt whose
/// close made it), the per-endpoint idempotency key (unique, so that concurrent adds with one
/// key make one todo), the deadline, the repeated-failure budget, a failed attempt's signature
/// and the late reports kept on closed attempts. Dead letters from before say
/// `attempts_exhausted`, or `revoked` when their newest attempt was revoked; todos from before
/// keep `max_same_failures = 0` (the rule off), as they were added without it.
const MIGRATION_0005: &str = "
ALTER TABLE todos ADD COLUMN dead_letter_reason TEXT CHECK (dead_letter_reason IN
    ('attempts_exhausted', 'non_retryable', 'deadline', 'repeated_failure', 'revoked'));
ALTER TABLE todos ADD COLUMN idempotency_key TEXT
    CHECK (length(CAST(idempotency_key AS BLOB)) BETWEEN 1 AND 200);
ALTER TABLE todos ADD COLUMN deadline_at INTEGER;
ALTER TABLE todos ADD COLUMN max_same_failures INTEGER NOT NULL DEFAULT 0
    CHECK (max_same_failures BETWEEN 0 AND 10);
CREATE UNIQUE INDEX todos_idempotency ON todos (endpoint, idempotency_key);
-- the retry sweep's deadline half
CREATE INDEX todos_deadline ON todos (deadline_at)
    WHERE deadline_at IS NOT NULL AND state IN ('pending', 'failed');
ALTER TABLE todo_attempts ADD COLUMN failure_signature TEXT
    CHECK (length(CAST(failure_signature AS BLOB)) <= 128);
ALTER TABLE todo_attempts ADD COLUMN dead_letter_reason TEXT CHECK (dead_letter_reason IN
    ('attempts_exhausted', 'non_retryable', 'deadline', 'repeated_failure', 'revoked'));
ALTER TABLE todo_attempts ADD COLUMN late_reports TEXT;
ALTER TABLE todo_attempts ADD COLUMN late_reports_total INTEGER NOT NULL DEFAULT 0
    CHECK (late_reports_total >= 0);
UPDATE todo_attempts SET dead_letter_reason =
    CASE outcome WHEN 'revoked' THEN 'revoked' ELSE 'attempts_exhausted' END
    WHERE disposition = 'dead_lettered';
UPDATE todos SET dead_letter_reason = coalesce(
    (SELECT a.dead_letter_reason FROM todo_attempts a
      WHERE a.todo_id = todos.id AND a.seq = todos.attempts_total), 'attempts_exhausted')
    WHERE state = 'failed' AND next_retry_at IS NULL;
";

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

/// Applies the migrations above the database's version, up to `target`, in one transaction.
fn migrate(conn: &mut Connection, target: u32) -> Result<(), Error> {
    let err = |e: rusqlite::Error| Error::internal(format!("migrating the SQLite store: {e}"));
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(err)?;
    tx.execute_batch(
        "CREATE TABLE IF NOT EXISTS schema_migrations (
             version    INTEGER NOT NULL PRIMARY KEY,
             name       TEXT    NOT NULL,
             applied_at INTEGER NOT NULL
         ) STRICT;",
    )
    .map_err(err)?;
    let current: i64 = tx
        .query_row(
            "SELECT coalesce(max(version), 0) FROM schema_migrations",
            [],
            |r| r.get(0),
        )
        .map_err(err)?;
    let applied_at = wall_clock_ms();
    for (version, name, sql) in MIGRATIONS {
        if i64::from(*version) <= current || *version > target {
            continue;
        }
        tx.execute_batch(sql).map_err(|e| {
            Error::internal(format!(
                "migrating the SQLite store: migration {version:04} ({name}) failed: {e}"
            ))
        })?;
        tx.execute(
            "INSERT INTO schema_migrations (version, name, applied_at) VALUES (?1, ?2, ?3)",
            params![version, name, applied_at],
        )
        .map_err(err)?;
    }
    tx.commit().map_err(err)
}

/// When a migration was applied: the shell's clock, recorded for operators only.
fn wall_clock_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// The newest migration's number.
pub(crate) fn latest_migration() -> u32 {
    MIGRATIONS.last().map_or(0, |m| m.0)
}

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
            Ok(Threads::start(writer, readers, tuning))
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

    /// Whether a write transaction can start within `timeout` (`BEGIN IMMEDIATE`, rolled back):
    /// a database write-locked by another process answers `Err` after `timeout`, not after the
    /// usual busy timeout. On a reader's connection, so the probe waits for this process's own
    /// writer only as long as one batch holds the lock.
    pub(crate) async fn probe_write(&self, timeout: std::time::Duration) -> Result<(), Error> {
        self.threads
            .alone(To::Reader, "healthz", move |conn| {
                let err = |e: rusqlite::Error| sql_err("healthz", "(write probe)", e);
                conn.busy_timeout(timeout).map_err(err)?;
                let began = conn
                    .transaction_with_behavior(TransactionBehavior::Immediate)
                    .map(drop);
                conn.busy_timeout(BUSY_TIMEOUT).map_err(err)?;
                began.map_err(err)
            })
            .await
    }

    /// See [`Store::pending_since`](super::Store::pending_since). One read snapshot: with a
    /// single writer, every change up to the counter it reads is in it.
    pub(crate) async fn pending_since(
        &self,
        after: Option<u64>,
        limit: usize,
    ) -> Result<PendingPage, Error> {
        let op = "pending scan";
        self.run(TxKind::Read, op, String::new(), move |tx| {
            let horizon: i64 =
                tx.c.query_row("SELECT n FROM todo_change_counter WHERE id = 1", [], |r| {
                    r.get(0)
                })
                .map_err(|e| sql_err(op, "", e))?;
            let horizon = u64::try_from(horizon).unwrap_or(0);
            let Some(after) = after else {
                return Ok(PendingPage {
                    changes: Vec::new(),
                    watermark: horizon,
                });
            };
            let mut st =
                tx.c.prepare_cached(&PENDING_SINCE)
                    .map_err(|e| sql_err(op, "", e))?;
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
                .map_err(|e| sql_err(op, "", e))?;
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

/// An SQL failure as the internal error it is, naming the operation and its todo.
fn sql_err(op: &str, subject: &str, e: rusqlite::Error) -> Error {
    let what = match &e {
        rusqlite::Error::SqliteFailure(f, _)
            if f.extended_code == rusqlite::ffi::SQLITE_CONSTRAINT_UNIQUE
                && e.to_string().contains("todo_attempts.todo_id") =>
        {
            "a second open attempt was refused (a todo has at most one open attempt)"
        }
        rusqlite::Error::SqliteFailure(f, _) if f.code == rusqlite::ErrorCode::DatabaseBusy => {
            "the database stayed locked past the busy timeout; retry"
        }
        _ => "the SQLite store failed",
    };
    Error::internal(format!("{op} {subject}: {what}: {e}"))
}

/// One operation's view of the transaction its thread opened (a savepoint of the writer's
/// batch, or a reader's snapshot).
pub(crate) struct SqliteTx<'a> {
    c: &'a Connection,
}

impl rows::Row for rusqlite::Row<'_> {
    fn text(&self, i: usize) -> Result<Option<String>, String> {
        self.get(i).map_err(|e| e.to_string())
    }
    fn int(&self, i: usize) -> Result<Option<i64>, String> {
        self.get(i).map_err(|e| e.to_string())
    }
    fn boolean(&self, i: usize) -> Result<bool, String> {
        self.get(i).map_err(|e| e.to_string())
    }
    fn bytes(&self, i: usize) -> Result<Option<Vec<u8>>, String> {
        self.get(i).map_err(|e| e.to_string())
    }
}

static SQL: LazyLock<rows::Shared> = LazyLock::new(|| rows::Shared::new('?'));

/// The Board: operators (only the SHA-256 of a token), their sessions (only the SHA-256 of the
/// cookie's secret; a revoke deletes them), the operator who closed an attempt, and the paused
/// queues.
const MIGRATION_0006: &str = "
CREATE TABLE operators (
    name       TEXT    NOT NULL PRIMARY KEY,
    token_hash BLOB    NOT NULL UNIQUE CHECK (length(token_hash) = 32),
    created_at INTEGER NOT NULL,
    revoked_at INTEGER
) STRICT;
CREATE TABLE board_sessions (
    id_hash    BLOB    NOT NULL PRIMARY KEY CHECK (length(id_hash) = 32),
    operator   TEXT    NOT NULL REFERENCES operators (name) ON DELETE CASCADE,
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL
) STRICT;
CREATE INDEX board_sessions_operator ON board_sessions (operator);
-- Which operator closed an attempt (NULL: no operator did).
ALTER TABLE todo_attempts ADD COLUMN closed_by TEXT CHECK (length(CAST(closed_by AS BLOB)) <= 64);
CREATE TABLE paused_queues (
    queue     TEXT    NOT NULL PRIMARY KEY,
    paused_at INTEGER NOT NULL
) STRICT;
";

/// MCP sessions in the store, so that any server on the database answers any session and a
/// restart keeps them: only the SHA-256 of a session id, its endpoint, the protocol revision it
/// negotiated and its last use (for the idle sweep). (Postgres' 0007 also adds the doorbell's
/// NOTIFY trigger; SQLite's doorbell stays in-process.)
const MIGRATION_0007: &str = "
CREATE TABLE mcp_sessions (
    id_hash      BLOB    NOT NULL PRIMARY KEY CHECK (length(id_hash) = 32),
    endpoint     TEXT    NOT NULL,
    protocol     TEXT    NOT NULL CHECK (length(protocol) <= 32),
    created_at   INTEGER NOT NULL,
    last_used_at INTEGER NOT NULL
) STRICT;
CREATE INDEX mcp_sessions_endpoint ON mcp_sessions (endpoint);
CREATE INDEX mcp_sessions_idle ON mcp_sessions (last_used_at);
";

/// Which sessions hold a doorbell stream (until when, by the holding server's last keep-alive),
/// so that a session at the per-endpoint cap can make room by ending the least recently used
/// session that holds none.
const MIGRATION_0009: &str = "
ALTER TABLE mcp_sessions ADD COLUMN stream_until INTEGER;
";

/// The write path's hidden work, cut.
///
/// The partial indexes on a list of states name them as `OR`s instead of `IN`. SQLite evaluates
/// `state IN (a, b, c)` (a constant list of more than two) through a temporary b-tree that it
/// builds and frees on every run of a statement, and every update of a todo's state evaluates
/// the predicate of each of these indexes for the old row and the new one: four temporary
/// b-trees an update, each a fresh page cache to allocate and free, were a third of the
/// writer's time under 16 callers. An `OR` of equalities compares in place. The queries the
/// indexes serve write the predicates in the same form (`rows::Query::one_of`), so that the
/// planner matches them term for term. The CHECK constraints keep their lists: changing one
/// means rebuilding the table.
///
/// The change sequence numbers only rows that are pending after the write: the doorbell scan
/// reads pending rows alone, and a todo that becomes pending takes a new number then. Every other
/// write (a claim, a heartbeat, a close) no longer runs the triggers' two extra updates.
const MIGRATION_0008: &str = "
DROP INDEX todos_fifo;
CREATE INDEX todos_fifo ON todos (endpoint, created_at, id)
    WHERE (state = 'pending' OR state = 'claimed' OR state = 'failed');
DROP INDEX todos_finished;
CREATE INDEX todos_finished ON todos (updated_at)
    WHERE (state = 'done' OR state = 'canceled' OR state = 'failed');
DROP TRIGGER todos_change_insert;
DROP TRIGGER todos_change_update;
CREATE TRIGGER todos_change_insert AFTER INSERT ON todos WHEN NEW.state = 'pending' BEGIN
    UPDATE todo_change_counter SET n = n + 1 WHERE id = 1;
    UPDATE todos SET change_seq = (SELECT n FROM todo_change_counter WHERE id = 1)
        WHERE id = NEW.id;
END;
CREATE TRIGGER todos_change_update AFTER UPDATE OF id, endpoint, queue, title, kind, source,
    payload, work_order, assignee, state, owner, attempt, max_attempts, lease_expires_at,
    claimed_at, next_retry_at, result, created_at, updated_at, attempts_total, attempts_pruned,
    dead_letter_reason, idempotency_key, deadline_at, max_same_failures
    ON todos WHEN NEW.state = 'pending' BEGIN
    UPDATE todo_change_counter SET n = n + 1 WHERE id = 1;
    UPDATE todos SET change_seq = (SELECT n FROM todo_change_counter WHERE id = 1)
        WHERE id = NEW.id;
END;
";

/// The Board's bulk actions: what an operator asked for (a retry or cancel of every todo a
/// queue's filter matched), each todo listed as it stood then, and what became of it. Items
/// without a result are what is left to do: a server that stops midway resumes from them.
const MIGRATION_0010: &str = "
CREATE TABLE board_bulk (
    id           TEXT    NOT NULL PRIMARY KEY,
    operator     TEXT    NOT NULL,
    queue        TEXT    NOT NULL,
    action       TEXT    NOT NULL CHECK (action = 'retry' OR action = 'cancel'),
    filter       TEXT    NOT NULL,
    created_at   INTEGER NOT NULL,
    confirmed_at INTEGER,
    finished_at  INTEGER
) STRICT;
CREATE INDEX board_bulk_open ON board_bulk (created_at) WHERE finished_at IS NULL;
CREATE TABLE board_bulk_items (
    bulk_id         TEXT    NOT NULL REFERENCES board_bulk (id) ON DELETE CASCADE,
    todo_id         TEXT    NOT NULL,
    listed_state    TEXT    NOT NULL,
    listed_attempts INTEGER NOT NULL,
    result          TEXT    CHECK (result = 'applied' OR result = 'skipped'),
    note            TEXT,
    done_at         INTEGER,
    PRIMARY KEY (bulk_id, todo_id)
) STRICT;
";

static ENDPOINT_GET: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {ENDPOINT_COLS} FROM endpoints WHERE name = ?1"));
static PENDING_SINCE: LazyLock<String> = LazyLock::new(|| rows::pending_since('?'));
// A todo and its open attempt in one statement: the todo's columns, then the attempt's (NULL
// without one; two rows with two). One writer, so no row changes between the two reads that a
// join could mix up (unlike Postgres' `FOR UPDATE`, see `PgTx::load`). The id is cast for the
// reason `rows::Query::bind_text` gives: a bare `a.todo_id = t.id AND t.id = ?1` made SQLite
// re-prepare the cached join on every use.
static LOAD: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {}, {} FROM todos t LEFT JOIN todo_attempts a \
         ON a.todo_id = t.id AND a.ended_at IS NULL WHERE t.id = CAST(?1 AS TEXT)",
        rows::select_list("t", &rows::TODO_COLS),
        rows::select_list("a", &rows::ATTEMPT_COLS)
    )
});

/// The todo of a query's first row, or `None`.
fn first_todo(op: &str, subject: &str, mut rs: rusqlite::Rows<'_>) -> Result<Option<Todo>, Error> {
    match rs.next().map_err(|e| sql_err(op, subject, e))? {
        Some(row) => rows::todo(row, 0).map(Some),
        None => Ok(None),
    }
}

impl SqliteTx<'_> {
    /// The open attempt of a todo; two open attempts are an internal error.
    fn open_attempt(&self, op: &str, id: &str) -> Result<Option<Attempt>, Error> {
        let mut st = self
            .c
            .prepare_cached(&SQL.open_attempt)
            .map_err(|e| sql_err(op, id, e))?;
        let mut rs = st.query(params![id]).map_err(|e| sql_err(op, id, e))?;
        let Some(row) = rs.next().map_err(|e| sql_err(op, id, e))? else {
            return Ok(None);
        };
        let open = rows::attempt(row, 0)?;
        if rs.next().map_err(|e| sql_err(op, id, e))?.is_some() {
            return Err(rows::two_open_attempts(op, id));
        }
        Ok(open)
    }
}

impl rusqlite::ToSql for Val {
    fn to_sql(&self) -> rusqlite::Result<rusqlite::types::ToSqlOutput<'_>> {
        use rusqlite::types::{ToSqlOutput, Value as Sql, ValueRef};
        Ok(match self {
            Val::Text(Some(s)) => ToSqlOutput::Borrowed(ValueRef::Text(s.as_bytes())),
            Val::Bytes(Some(b)) => ToSqlOutput::Borrowed(ValueRef::Blob(b)),
            Val::Text(None) | Val::Big(None) | Val::Bytes(None) => ToSqlOutput::Owned(Sql::Null),
            Val::Count(n) => ToSqlOutput::Owned(Sql::Integer(i64::from(*n))),
            Val::Big(Some(n)) => ToSqlOutput::Owned(Sql::Integer(*n)),
            Val::Bool(b) => ToSqlOutput::Owned(Sql::Integer(i64::from(*b))),
            Val::Texts(_) => {
                return Err(rusqlite::Error::ToSqlConversionFailure(
                    "SQLite binds a list one placeholder per entry".into(),
                ));
            }
        })
    }
}

impl SqliteTx<'_> {
    /// Runs one statement with the values bound in order; the rows it changed.
    fn exec(&self, op: &str, subject: &str, sql: &str, vals: &[Val]) -> Result<u64, Error> {
        let mut st = self
            .c
            .prepare_cached(sql)
            .map_err(|e| sql_err(op, subject, e))?;
        let n = st
            .execute(rusqlite::params_from_iter(vals))
            .map_err(|e| sql_err(op, subject, e))?;
        Ok(n as u64)
    }

    /// Runs one query with the values bound in order, each row through `f`.
    fn rows<T>(
        &self,
        op: &str,
        subject: &str,
        sql: &str,
        vals: &[Val],
        mut f: impl FnMut(&rusqlite::Row<'_>) -> Result<T, Error>,
    ) -> Result<Vec<T>, Error> {
        let mut st = self
            .c
            .prepare_cached(sql)
            .map_err(|e| sql_err(op, subject, e))?;
        let mut rs = st
            .query(rusqlite::params_from_iter(vals))
            .map_err(|e| sql_err(op, subject, e))?;
        let mut out = Vec::new();
        while let Some(row) = rs.next().map_err(|e| sql_err(op, subject, e))? {
            out.push(f(row)?);
        }
        Ok(out)
    }

    fn update_todo(&self, op: &str, t: &Todo) -> Result<(), Error> {
        if self.exec(op, &t.id, &SQL.update_todo, &rows::todo_update(op, t)?)? != 1 {
            return Err(Error::internal(format!(
                "{op} {}: the todo row vanished inside its transaction",
                t.id
            )));
        }
        Ok(())
    }

    fn insert_attempt_row(&self, op: &str, a: &Attempt) -> Result<(), Error> {
        let vals = rows::attempt_row(op, a)?;
        self.exec(op, &a.todo_id, &SQL.insert_attempt, &vals)
            .map(drop)
    }
}

impl Rows for SqliteTx<'_> {
    async fn load(&mut self, op: &str, id: &str) -> Result<Option<(Todo, Option<Attempt>)>, Error> {
        let mut st = self
            .c
            .prepare_cached(&LOAD)
            .map_err(|e| sql_err(op, id, e))?;
        let mut rs = st.query(params![id]).map_err(|e| sql_err(op, id, e))?;
        let Some(row) = rs.next().map_err(|e| sql_err(op, id, e))? else {
            return Ok(None);
        };
        let todo = rows::todo(row, 0)?;
        let open = rows::attempt(row, rows::TODO_COLS.len())?;
        if rs.next().map_err(|e| sql_err(op, id, e))?.is_some() {
            return Err(rows::two_open_attempts(op, id));
        }
        Ok(Some((todo, open)))
    }

    async fn next_claimable(
        &mut self,
        now: Millis,
        actor: &Actor,
        queues: Option<&[String]>,
        paused: &[String],
    ) -> Result<Option<(Todo, Option<Attempt>)>, Error> {
        let op = "claim_next";
        let subject = format!("(next for {})", actor.owner());
        let (sql, args) = SQL.next_claimable(op, now, actor, queues, paused, "")?;
        let mut st = self
            .c
            .prepare_cached(&sql)
            .map_err(|e| sql_err(op, &subject, e))?;
        let rs = st
            .query(rusqlite::params_from_iter(&args))
            .map_err(|e| sql_err(op, &subject, e))?;
        let Some(todo) = first_todo(op, &subject, rs)? else {
            return Ok(None);
        };
        drop(st);
        let open = self.open_attempt(op, &todo.id)?;
        Ok(Some((todo, open)))
    }

    async fn by_key(&mut self, endpoint: &str, key: &str) -> Result<Option<Todo>, Error> {
        let op = "add_todo";
        let vals = [
            Val::Text(Some(endpoint.into())),
            Val::Text(Some(key.into())),
        ];
        let found = self.rows(op, "(idempotency key)", &SQL.by_key, &vals, |r| {
            rows::todo(r, 0)
        })?;
        Ok(found.into_iter().next())
    }

    async fn insert_todo(&mut self, t: &Todo) -> Result<bool, Error> {
        let op = "add_todo";
        let vals = rows::todo_row(op, t)?;
        Ok(self.exec(op, &t.id, &SQL.insert_todo, &vals)? == 1)
    }

    async fn write(
        &mut self,
        op: &str,
        todo: &Todo,
        writes: &[AttemptWrite],
    ) -> Result<Vec<u64>, Error> {
        // In order: SQLite checks the one-open-attempt index row by row, and a takeover's
        // change closes the dead attempt before it opens the next.
        self.update_todo(op, todo)?;
        let mut rows = Vec::with_capacity(writes.len());
        for w in writes {
            rows.push(match w {
                AttemptWrite::Open(a) => self.insert_attempt_row(op, a).map(|()| 1)?,
                AttemptWrite::Update(a) => {
                    let vals = rows::attempt_update(op, a)?;
                    self.exec(op, &a.todo_id, &SQL.update_open_attempt, &vals)?
                }
                AttemptWrite::PruneThrough(n) => {
                    let vals = [Val::Text(Some(todo.id.clone())), Val::Count(*n)];
                    self.exec(op, &todo.id, &SQL.prune, &vals).map(|_| 0)?
                }
                AttemptWrite::Late(a) => {
                    self.exec(op, &a.todo_id, &SQL.update_late, &rows::late_update(a))?
                }
            });
        }
        Ok(rows)
    }

    async fn attempts(&mut self, op: &str, id: &str, which: Newest) -> Result<Vec<Attempt>, Error> {
        let (sql, vals) = SQL.attempts_query(id, which);
        let rows = self.rows(op, id, sql, &vals, |r| rows::attempt(r, 0))?;
        Ok(rows.into_iter().flatten().collect())
    }

    async fn candidates(&mut self, sweep: Sweep<'_>) -> Result<Vec<String>, Error> {
        let op = "sweep";
        let (sql, arg) = SQL.sweep(op, sweep)?;
        let mut ids: Vec<String> = self.rows(op, "", &sql, &[arg], |r| {
            r.get(0).map_err(|e| sql_err(op, "", e))
        })?;
        // In id order, as the trait promises (ids sort bytewise in SQLite as in Rust), each
        // once (the requeue's two halves may both find one).
        ids.sort_unstable();
        ids.dedup();
        Ok(ids)
    }

    async fn list(&mut self, actor: &Actor, filter: &TodoFilter) -> Result<Vec<Todo>, Error> {
        let (sql, args) = SQL.list(actor, filter);
        self.rows("list_todos", "", &sql, &args, |r| rows::todo(r, 0))
    }

    async fn delete(&mut self, op: &str, id: &str) -> Result<(), Error> {
        let mut st = self
            .c
            .prepare_cached("DELETE FROM todos WHERE id = ?1")
            .map_err(|e| sql_err(op, id, e))?;
        st.execute(params![id]).map_err(|e| sql_err(op, id, e))?;
        Ok(())
    }

    async fn paused_queues(&mut self) -> Result<Vec<String>, Error> {
        super::ops::paused_queues(self).await
    }

    async fn set_paused(&mut self, now: Millis, queue: &str, paused: bool) -> Result<(), Error> {
        super::ops::set_paused(self, now, queue, paused).await
    }
}

impl Tx for SqliteTx<'_> {
    async fn clock(&mut self, caller: Millis) -> Result<Millis, Error> {
        Ok(caller)
    }

    async fn try_sweep_lock(&mut self, _op: &str, _name: &str) -> Result<bool, Error> {
        // One writer (and `BEGIN IMMEDIATE` between processes): sweeps never overlap.
        Ok(true)
    }

    async fn lock_sessions(&mut self, _op: &str) -> Result<(), Error> {
        // One writer: every write transaction is alone already.
        Ok(())
    }

    #[cfg(test)]
    async fn insert_attempt(&mut self, op: &str, a: &Attempt) -> Result<(), Error> {
        self.insert_attempt_row(op, a)
    }

    async fn exec_sql(
        &mut self,
        op: &str,
        subject: &str,
        sql: &str,
        vals: Vec<Val>,
    ) -> Result<u64, Error> {
        self.exec(op, subject, &rows::numbered('?', sql), &vals)
    }

    async fn query_sql<T>(
        &mut self,
        op: &str,
        subject: &str,
        sql: &str,
        vals: Vec<Val>,
        f: fn(&dyn rows::Row) -> Result<T, Error>,
    ) -> Result<Vec<T>, Error> {
        self.rows(op, subject, &rows::numbered('?', sql), &vals, |r| f(r))
    }

    async fn insert_endpoint(&mut self, e: &Endpoint) -> Result<bool, Error> {
        let op = "endpoint create";
        let vals = rows::endpoint_row(op, e)?;
        Ok(self.exec(op, &e.name, &SQL.insert_endpoint, &vals)? == 1)
    }

    async fn endpoint(&mut self, name: &str, _lock: bool) -> Result<Option<Endpoint>, Error> {
        // Every MCP request authenticates through here: a cached statement, not one prepared
        // per call.
        let op = "endpoint get";
        let mut st = self
            .c
            .prepare_cached(&ENDPOINT_GET)
            .map_err(|e| sql_err(op, name, e))?;
        st.query_row(params![name], |r| Ok(rows::endpoint(r)))
            .optional()
            .map_err(|e| sql_err(op, name, e))?
            .transpose()
    }

    async fn count_by_state(&mut self) -> Result<Vec<(String, u64)>, Error> {
        let op = "count todos";
        let sql = "SELECT state, COUNT(*) FROM todos GROUP BY state ORDER BY state";
        self.rows(op, "", sql, &[], |r| {
            let state: String = r.get(0).map_err(|e| sql_err(op, "", e))?;
            let n: i64 = r.get(1).map_err(|e| sql_err(op, "", e))?;
            Ok((state, u64::try_from(n).unwrap_or(0)))
        })
    }

    async fn endpoints(&mut self) -> Result<Vec<Endpoint>, Error> {
        let sql = format!("SELECT {ENDPOINT_COLS} FROM endpoints ORDER BY name");
        self.rows("endpoint list", "", &sql, &[], |r| rows::endpoint(r))
    }

    async fn set_revoked(&mut self, name: &str, at: Millis) -> Result<(), Error> {
        let op = "endpoint revoke";
        self.c
            .execute(
                "UPDATE endpoints SET revoked_at = ?2 WHERE name = ?1",
                params![name, ms(op, at)?],
            )
            .map_err(|e| sql_err(op, name, e))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_core::ledger::{Actor, Answer, ClaimOpts, NewTodo, Op, Report, TokenHash};

    /// A store on a database file of its own (with a writer thread and readers, as a server's).
    async fn file_store() -> (tempfile::TempDir, SqliteStore) {
        let dir = tempfile::tempdir().unwrap();
        let s = SqliteStore::open_file(dir.path().join("p.db"), LedgerConfig::default())
            .await
            .unwrap();
        (dir, s)
    }

    /// The plan of `sql` (EXPLAIN QUERY PLAN's details, one string), and how many temporary
    /// b-trees a run of it opens (EXPLAIN's `OpenEphemeral`).
    fn plan(c: &Connection, sql: &str) -> (String, usize) {
        let nulls = |st: &rusqlite::Statement<'_>| {
            let n = st.parameter_count();
            rusqlite::params_from_iter(std::iter::repeat_n(rusqlite::types::Null, n))
        };
        let mut st = c.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).unwrap();
        let details: Vec<String> = st
            .query_map(nulls(&st), |r| r.get::<_, String>(3))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        let mut st = c.prepare(&format!("EXPLAIN {sql}")).unwrap();
        let ops: Vec<String> = st
            .query_map(nulls(&st), |r| r.get::<_, String>(1))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        let ephemeral = ops.iter().filter(|o| *o == "OpenEphemeral").count();
        (details.join("; "), ephemeral)
    }

    /// The claim still goes through the FIFO index now that it names its states as `OR`s
    /// (migration 8), and an update of a todo builds a temporary
    /// b-tree only for its CHECK constraints' lists (two), none for an index predicate.
    #[tokio::test(flavor = "multi_thread")]
    async fn partial_index_predicates_build_no_temporary_btree() {
        let (_dir, s) = file_store().await;
        let actor = Actor::endpoint("ep");
        let (claim, _) = SQL
            .next_claimable("claim_next", 1, &actor, Some(&["q".into()]), &[], "")
            .unwrap();
        let update = SQL.update_todo.clone();
        let (claim, update) = s
            .with_conn(move |c| Ok((plan(c, &claim), plan(c, &update))))
            .await
            .unwrap();
        assert!(
            claim.0.contains("USING INDEX todos_fifo"),
            "claim: {}",
            claim.0
        );
        assert_eq!(
            claim.1, 0,
            "the claim builds a temporary b-tree: {}",
            claim.0
        );
        assert_eq!(update.1, 2, "the update of a todo: temporary b-trees");
    }

    /// Each sweep searches its partial index: with `ORDER BY id` SQLite walked the primary key
    /// over every todo instead, on the writer, every reaper and requeue tick.
    #[tokio::test(flavor = "multi_thread")]
    async fn sweeps_search_their_partial_indexes() {
        use relay_core::ledger::Sweep;
        let (_dir, s) = file_store().await;
        let sweeps = [
            (Sweep::Reap { now: 1 }, &["todos_lease"][..]),
            (
                Sweep::RequeueDue { now: 1 },
                &["todos_retry", "todos_deadline"][..],
            ),
            (Sweep::Purge { cutoff: 1 }, &["todos_finished"][..]),
            (
                Sweep::Revoke {
                    now: 1,
                    endpoint: "ep",
                },
                &["(endpoint=?)"][..],
            ),
        ];
        for (sweep, wanted) in sweeps {
            let name = format!("{sweep:?}");
            let (sql, _) = SQL.sweep("sweep", sweep).unwrap();
            let (plan, _) = s.with_conn(move |c| Ok(plan(c, &sql))).await.unwrap();
            for w in wanted {
                assert!(plan.contains(w), "{name}: {plan}");
            }
            assert!(!plan.contains("sqlite_autoindex_todos"), "{name}: {plan}");
        }
    }

    /// The statements of the claim → heartbeat → complete cycle run from the writer's statement
    /// cache without SQLite re-preparing them: a re-prepare costs more than the statement (the
    /// claim's `t.assignee = ?` made SQLite re-prepare it on every use, a quarter of the
    /// writer's time under 16 callers).
    #[tokio::test(flavor = "multi_thread")]
    async fn cached_statements_are_not_reprepared() {
        let (_dir, s) = file_store().await;
        let store = super::super::Store::Sqlite(s.clone());
        let actor = Actor::endpoint("ep");
        let t0 = 1_790_000_000_000;
        for i in 0..12u64 {
            let new = NewTodo {
                id: format!("t{i:04}"),
                queue: "q".into(),
                title: "x".into(),
                ..NewTodo::default()
            };
            let add = Op::AddTodo {
                now: t0 + i,
                endpoint: "ep".into(),
                new,
            };
            store.apply(add).await.unwrap();
        }
        for i in 0..10u64 {
            let now = t0 + 100_000 + i;
            let token_hash = Some(TokenHash::of(&format!("tok{i}")));
            let opts = ClaimOpts {
                ttl: 300_000,
                claimant: Some("b".into()),
                token_hash,
            };
            let queues = Some(vec!["q".into()]);
            let (actor, ttl) = (actor.clone(), 300_000);
            let claim = Op::ClaimNext {
                now,
                actor: actor.clone(),
                queues,
                opts,
            };
            let c = store.apply(claim).await.and_then(Answer::next).unwrap();
            let id = c.unwrap().todo.id;
            let hb = Op::Heartbeat {
                now,
                actor: actor.clone(),
                id: id.clone(),
                ttl,
                token_hash,
            };
            store.apply(hb).await.unwrap();
            let report = Report {
                token_hash,
                summary: Some("d".into()),
                ..Report::default()
            };
            let done = Op::Complete {
                now,
                actor,
                id,
                report,
            };
            store.apply(done).await.unwrap();
        }
        let (claim, _) = SQL
            .next_claimable("claim_next", t0, &actor, Some(&["q".into()]), &[], "")
            .unwrap();
        let hot = [
            ("claim_next", claim),
            ("load", LOAD.clone()),
            ("open_attempt", SQL.open_attempt.clone()),
            ("insert_attempt", SQL.insert_attempt.clone()),
            ("update_todo", SQL.update_todo.clone()),
            ("update_open_attempt", SQL.update_open_attempt.clone()),
        ];
        let counts = s
            .with_conn(move |c| {
                let mut out = Vec::new();
                for (name, sql) in hot {
                    let st = c.prepare_cached(&sql).unwrap();
                    let runs = st.get_status(rusqlite::StatementStatus::Run);
                    out.push((
                        name,
                        runs,
                        st.get_status(rusqlite::StatementStatus::RePrepare),
                    ));
                }
                Ok(out)
            })
            .await
            .unwrap();
        for (name, runs, reprepared) in counts {
            assert!(
                runs >= 10,
                "{name} ran {runs} times; the test lost its cycle"
            );
            assert_eq!(
                reprepared, 0,
                "{name}: SQLite re-prepared the cached statement"
            );
        }
    }
}
