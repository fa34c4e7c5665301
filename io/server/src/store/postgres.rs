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

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock};

use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod, Transaction};
use relay_core::Error;
use relay_core::Millis;
use relay_core::ledger::{
    self, Actor, Answer, Attempt, AttemptWrite, LedgerConfig, Newest, Op, Rows, Sweep, Todo,
    TodoFilter,
};
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};

use super::Endpoint;
#[cfg(test)]
use super::ops;
use super::ops::{Tx, TxKind};
use super::pg_batch::{self, Tuning, Writers};
use super::rows::{self, ENDPOINT_COLS, Val, ms};
use super::{PendingChange, PendingPage};

pub use super::pg_batch::Tuning as PgTuning;

/// The database's clock as ms since the epoch, read by one statement inside the caller's
/// transaction (`clock_timestamp()`, the time of the read, not of `BEGIN`). Sent with
/// `query_typed`: no statement to prepare, one message, so it pipelines with its neighbours.
pub(crate) async fn db_now(c: &impl tokio_postgres::GenericClient) -> Result<Millis, Error> {
    let op = "reading the database's clock";
    let row = c
        .query_typed_one(
            "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint",
            &[],
        )
        .await
        .map_err(|e| pg_err(op, "", &e))?;
    let ms: i64 = row.try_get(0).map_err(|e| pg_err(op, "", &e))?;
    Millis::try_from(ms).map_err(|_| Error::internal(format!("{op}: {ms} is before the epoch")))
}

/// The numbered migrations (the same numbers and meaning as SQLite's, in Postgres dialect).
pub(crate) const MIGRATIONS: &[(i32, &str, &str)] = &[
    (1, "todos", MIGRATION_0001),
    (2, "todo_attempts", MIGRATION_0002),
    (3, "endpoints", MIGRATION_0003),
    (4, "todo_change_seq", MIGRATION_0004),
    (5, "failure_classes", MIGRATION_0005),
    (6, "board", MIGRATION_0006),
    (7, "mcp_sessions", MIGRATION_0007),
    (8, "session_streams", MIGRATION_0008),
    (9, "board_bulk", MIGRATION_0009),
];

/// The todos table before attempt history. Ids sort bytewise (`COLLATE "C"`) like Rust strings,
/// so FIFO ties and sweep order match the ledger whatever the database's locale.
const MIGRATION_0001: &str = r#"
CREATE TABLE todos (
    id               text COLLATE "C" NOT NULL PRIMARY KEY,
    endpoint         text    NOT NULL,
    queue            text    NOT NULL,
    title            text    NOT NULL,
    kind             text,
    source           text,
    payload          text,
    work_order       text,
    assignee         text,
    state            text    NOT NULL
        CHECK (state IN ('pending', 'claimed', 'failed', 'done', 'canceled')),
    owner            text,
    attempt          integer NOT NULL DEFAULT 0 CHECK (attempt >= 0),
    max_attempts     integer NOT NULL CHECK (max_attempts >= 1),
    lease_expires_at bigint,
    claimed_at       bigint,
    next_retry_at    bigint,
    result           text,
    created_at       bigint  NOT NULL,
    updated_at       bigint  NOT NULL,
    CHECK ((state = 'claimed') = (owner IS NOT NULL AND lease_expires_at IS NOT NULL))
);
-- claim_next: the live todos of an endpoint in FIFO order.
CREATE INDEX todos_fifo ON todos (endpoint, created_at, id)
    WHERE state IN ('pending', 'claimed', 'failed');
-- the reaper and the retry sweep
CREATE INDEX todos_lease ON todos (lease_expires_at) WHERE state = 'claimed';
CREATE INDEX todos_retry ON todos (next_retry_at) WHERE state = 'failed';
-- retention: finished todos by age
CREATE INDEX todos_finished ON todos (updated_at) WHERE state IN ('done', 'canceled', 'failed');
"#;

/// Attempt history, as in SQLite's 0002 (see there for the backfill's counters), with the
/// one-open-attempt rule as a deferred exclusion constraint.
const MIGRATION_0002: &str = r#"
CREATE TABLE todo_attempts (
    todo_id           text COLLATE "C" NOT NULL REFERENCES todos (id) ON DELETE CASCADE,
    seq               integer NOT NULL CHECK (seq >= 1),
    attempt           integer NOT NULL CHECK (attempt >= 0),
    claimer_kind      text    NOT NULL CHECK (claimer_kind IN ('endpoint', 'owner')),
    claimer_endpoint  text,
    claimer_session   text,
    owner             text    NOT NULL,
    claimant          text    CHECK (octet_length(claimant) <= 128),
    claimed_at        bigint  NOT NULL,
    last_heartbeat_at bigint,
    lease_expires_at  bigint  NOT NULL,
    ended_at          bigint,
    outcome           text    CHECK (outcome IN ('completed', 'failed', 'released',
                                     'lease_expired', 'reaped', 'canceled', 'revoked')),
    disposition       text    CHECK (disposition IN ('done', 'retry_scheduled', 'requeued',
                                     'dead_lettered', 'canceled')),
    summary           text    CHECK (octet_length(summary) <= 2048),
    summary_truncated boolean NOT NULL DEFAULT false,
    artifact          text    CHECK (octet_length(artifact) <= 512),
    lease_token_hash  bytea   CHECK (octet_length(lease_token_hash) = 32),
    PRIMARY KEY (todo_id, seq),
    CHECK ((ended_at IS NULL) = (outcome IS NULL)),
    CHECK ((ended_at IS NULL) = (disposition IS NULL))
);
-- At most one open attempt per todo, checked at COMMIT: the transaction's final rows count, not
-- the order in which it wrote them.
ALTER TABLE todo_attempts ADD CONSTRAINT todo_attempts_one_open
    EXCLUDE USING btree (todo_id WITH =) WHERE (ended_at IS NULL)
    DEFERRABLE INITIALLY DEFERRED;

ALTER TABLE todos ADD COLUMN attempts_total  integer NOT NULL DEFAULT 0 CHECK (attempts_total >= 0);
ALTER TABLE todos ADD COLUMN attempts_pruned integer NOT NULL DEFAULT 0 CHECK (attempts_pruned >= 0);

UPDATE todos SET attempts_total = attempt, attempts_pruned = attempt WHERE state <> 'claimed';
UPDATE todos SET attempts_total = greatest(attempt, 1), attempts_pruned = greatest(attempt, 1) - 1
    WHERE state = 'claimed';
INSERT INTO todo_attempts (todo_id, seq, attempt, claimer_kind, claimer_endpoint, owner,
                           claimant, claimed_at, lease_expires_at)
SELECT id, attempts_total, attempt,
       CASE WHEN owner = 'operator' THEN 'owner' ELSE 'endpoint' END,
       CASE WHEN owner = 'operator' THEN NULL ELSE owner END,
       owner, 'migrated', coalesce(claimed_at, lease_expires_at, updated_at), lease_expires_at
FROM todos WHERE state = 'claimed';
"#;

const MIGRATION_0003: &str = r#"
CREATE TABLE endpoints (
    name       text COLLATE "C" NOT NULL PRIMARY KEY,
    token_hash bytea  NOT NULL CHECK (octet_length(token_hash) = 32),
    verbs      text   NOT NULL,
    queues     text,
    created_at bigint NOT NULL,
    revoked_at bigint
);
"#;

/// The change sequence the out-of-process doorbell scan follows (as SQLite's 0004): a trigger
/// numbers every insert and update of a todo row from a sequence, and a partial index serves
/// the scan. Sequence numbers are taken before commit, so numbers may commit out of order; see
/// [`PgStore::pending_since`] for how the scan never steps over one still in flight.
const MIGRATION_0004: &str = r#"
ALTER TABLE todos ADD COLUMN change_seq bigint NOT NULL DEFAULT 0;
CREATE SEQUENCE todo_change_seq;
CREATE INDEX todos_change ON todos (change_seq) WHERE state = 'pending';
CREATE FUNCTION todos_change_seq() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.change_seq := nextval('todo_change_seq');
    RETURN NEW;
END
$$;
CREATE TRIGGER todos_change BEFORE INSERT OR UPDATE ON todos
    FOR EACH ROW EXECUTE FUNCTION todos_change_seq();
"#;

/// Recovery by failure class, as SQLite's 0005 (see there).
const MIGRATION_0005: &str = r#"
ALTER TABLE todos ADD COLUMN dead_letter_reason text CHECK (dead_letter_reason IN
    ('attempts_exhausted', 'non_retryable', 'deadline', 'repeated_failure', 'revoked'));
ALTER TABLE todos ADD COLUMN idempotency_key text
    CHECK (octet_length(idempotency_key) BETWEEN 1 AND 200);
ALTER TABLE todos ADD COLUMN deadline_at bigint;
ALTER TABLE todos ADD COLUMN max_same_failures integer NOT NULL DEFAULT 0
    CHECK (max_same_failures BETWEEN 0 AND 10);
CREATE UNIQUE INDEX todos_idempotency ON todos (endpoint, idempotency_key);
CREATE INDEX todos_deadline ON todos (deadline_at)
    WHERE deadline_at IS NOT NULL AND state IN ('pending', 'failed');
ALTER TABLE todo_attempts ADD COLUMN failure_signature text
    CHECK (octet_length(failure_signature) <= 128);
ALTER TABLE todo_attempts ADD COLUMN dead_letter_reason text CHECK (dead_letter_reason IN
    ('attempts_exhausted', 'non_retryable', 'deadline', 'repeated_failure', 'revoked'));
ALTER TABLE todo_attempts ADD COLUMN late_reports text;
ALTER TABLE todo_attempts ADD COLUMN late_reports_total integer NOT NULL DEFAULT 0
    CHECK (late_reports_total >= 0);
UPDATE todo_attempts SET dead_letter_reason =
    CASE outcome WHEN 'revoked' THEN 'revoked' ELSE 'attempts_exhausted' END
    WHERE disposition = 'dead_lettered';
UPDATE todos SET dead_letter_reason = coalesce(
    (SELECT a.dead_letter_reason FROM todo_attempts a
      WHERE a.todo_id = todos.id AND a.seq = todos.attempts_total), 'attempts_exhausted')
    WHERE state = 'failed' AND next_retry_at IS NULL;
"#;

/// The Board (as SQLite's 0006): operators, their sessions, the closing operator of an
/// attempt, the paused queues.
const MIGRATION_0006: &str = r#"
CREATE TABLE operators (
    name       text COLLATE "C" NOT NULL PRIMARY KEY,
    token_hash bytea  NOT NULL UNIQUE CHECK (octet_length(token_hash) = 32),
    created_at bigint NOT NULL,
    revoked_at bigint
);
CREATE TABLE board_sessions (
    id_hash    bytea  NOT NULL PRIMARY KEY CHECK (octet_length(id_hash) = 32),
    operator   text COLLATE "C" NOT NULL REFERENCES operators (name) ON DELETE CASCADE,
    created_at bigint NOT NULL,
    expires_at bigint NOT NULL
);
CREATE INDEX board_sessions_operator ON board_sessions (operator);
-- Which operator closed an attempt (NULL: no operator did).
ALTER TABLE todo_attempts ADD COLUMN closed_by text CHECK (octet_length(closed_by) <= 64);
CREATE TABLE paused_queues (
    queue     text COLLATE "C" NOT NULL PRIMARY KEY,
    paused_at bigint NOT NULL
);
"#;

/// As SQLite's 0009: which sessions hold a doorbell stream, so that the per-endpoint cap can
/// make room by ending the least recently used session that holds none.
const MIGRATION_0008: &str = "
ALTER TABLE mcp_sessions ADD COLUMN stream_until bigint;
";

/// MCP sessions in the store (as SQLite's 0007), and the doorbell across servers: a todo that
/// becomes pending (added, released, reaped, re-queued, retried: from any server or the CLI)
/// sends a NOTIFY on [`READY_CHANNEL`] from its own transaction, delivered on commit to every
/// server listening. The payload names the schema, so stores in different schemas of one
/// database ring only their own. Only a change *into* `pending` notifies (the doorbell scan's
/// rule: see `rows::pending_since`), so updates of a pending todo cost nothing.
const MIGRATION_0007: &str = r#"
CREATE TABLE mcp_sessions (
    id_hash      bytea  NOT NULL PRIMARY KEY CHECK (octet_length(id_hash) = 32),
    endpoint     text COLLATE "C" NOT NULL,
    protocol     text   NOT NULL CHECK (octet_length(protocol) <= 32),
    created_at   bigint NOT NULL,
    last_used_at bigint NOT NULL
);
CREATE INDEX mcp_sessions_endpoint ON mcp_sessions (endpoint);
CREATE INDEX mcp_sessions_idle ON mcp_sessions (last_used_at);
CREATE FUNCTION todos_ready_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('relay_todo_ready', json_build_object(
        'schema', current_schema(), 'id', NEW.id, 'endpoint', NEW.endpoint,
        'queue', NEW.queue, 'attempts_total', NEW.attempts_total)::text);
    RETURN NULL;
END
$$;
CREATE TRIGGER todos_ready_insert AFTER INSERT ON todos
    FOR EACH ROW WHEN (NEW.state = 'pending') EXECUTE FUNCTION todos_ready_notify();
CREATE TRIGGER todos_ready_update AFTER UPDATE ON todos
    FOR EACH ROW WHEN (NEW.state = 'pending' AND OLD.state <> 'pending')
    EXECUTE FUNCTION todos_ready_notify();
"#;

/// The channel of the doorbell's NOTIFY (see migration 0007).
pub const READY_CHANNEL: &str = "relay_todo_ready";

/// The Board's bulk actions (as SQLite's 0010).
const MIGRATION_0009: &str = r#"
CREATE TABLE board_bulk (
    id           text COLLATE "C" NOT NULL PRIMARY KEY,
    operator     text   NOT NULL,
    queue        text   NOT NULL,
    action       text   NOT NULL CHECK (action = 'retry' OR action = 'cancel'),
    filter       text   NOT NULL,
    created_at   bigint NOT NULL,
    confirmed_at bigint,
    finished_at  bigint
);
CREATE INDEX board_bulk_open ON board_bulk (created_at) WHERE finished_at IS NULL;
CREATE TABLE board_bulk_items (
    bulk_id         text COLLATE "C" NOT NULL REFERENCES board_bulk (id) ON DELETE CASCADE,
    todo_id         text COLLATE "C" NOT NULL,
    listed_state    text    NOT NULL,
    listed_attempts integer NOT NULL,
    result          text    CHECK (result = 'applied' OR result = 'skipped'),
    note            text,
    done_at         bigint,
    PRIMARY KEY (bulk_id, todo_id)
);
"#;

/// Notices a listener buffers; past it they are dropped (the doorbell scan covers them).
const READY_BUFFER: usize = 4096;

/// "A todo became claimable": what the doorbell's NOTIFY carries (no title or payload).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ready {
    pub id: String,
    pub endpoint: String,
    pub queue: String,
    /// 0 for a fresh todo; more for one that ran before.
    pub attempts_total: u32,
}

impl Ready {
    /// A payload of migration 0007's trigger, when it is of `schema` (before the schema is
    /// known, none is).
    fn parse(payload: &str, schema: Option<&str>) -> Option<Ready> {
        let v: serde_json::Value = serde_json::from_str(payload).ok()?;
        if v["schema"].as_str()? != schema? {
            return None;
        }
        Some(Ready {
            id: v["id"].as_str()?.to_string(),
            endpoint: v["endpoint"].as_str()?.to_string(),
            queue: v["queue"].as_str()?.to_string(),
            attempts_total: u32::try_from(v["attempts_total"].as_u64()?).ok()?,
        })
    }
}

/// The doorbell's LISTEN connection (see [`PgStore::listen_ready`]); dropping it closes it.
pub struct ReadyListener {
    _client: tokio_postgres::Client,
    rx: tokio::sync::mpsc::Receiver<Ready>,
    task: tokio::task::JoinHandle<()>,
}

impl ReadyListener {
    /// The next notice; `None` once the connection is lost.
    pub async fn recv(&mut self) -> Option<Ready> {
        self.rx.recv().await
    }
}

impl Drop for ReadyListener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The newest migration's number.
pub(crate) fn latest_migration() -> i32 {
    MIGRATIONS.last().map_or(0, |m| m.0)
}

/// Connections the pool keeps at most.
const POOL_SIZE: usize = 16;

/// Which clock an operation's rules read on Postgres.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PgClock {
    /// The database's `clock_timestamp()`, read in the operation's own transaction: every
    /// server on one database computes every lease from one clock, whatever its own says.
    /// What [`PgStore::open`] and [`PgStore::open_in_schema`] use.
    Database,
    /// The `now` the caller passed: for tests that drive time with a manual clock, and for the
    /// model tests that hold the store to the in-memory ledger bit for bit.
    Caller,
}

/// The Postgres backend of [`Store`](super::Store).
#[derive(Clone)]
pub struct PgStore {
    pool: Pool,
    cfg: LedgerConfig,
    schema: Option<String>,
    /// For the doorbell's dedicated LISTEN connection (outside the pool). Holds the URL's
    /// password: never printed (see `Debug`).
    pg: std::sync::Arc<tokio_postgres::Config>,
    /// Whether an operation's `now` is the database's clock (read in its transaction:
    /// [`PgClock::Database`], the default) rather than the caller's. Shared by every handle
    /// and the writers.
    db_clock: Arc<AtomicBool>,
    /// The batch writers (`None` in the writers' own handles).
    writers: Option<Arc<Writers>>,
}

impl std::fmt::Debug for PgStore {
    // The pool's config holds the URL's password; show only the schema.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PgStore(schema {})",
            self.schema.as_deref().unwrap_or("(default)")
        )
    }
}

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
        store.writers = Some(Arc::new(Writers::start(&store.without_writers(), tuning)));
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
        let mut pg: tokio_postgres::Config = url.parse().map_err(|e| {
            Error::invalid(format!(
                "--db: not a valid postgres:// URL ({e}); use {}",
                super::DB_URL_FORMS
            ))
        })?;
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
        let mut store = PgStore {
            pool,
            cfg,
            schema: schema.map(str::to_string),
            pg: std::sync::Arc::new(pg),
            db_clock: Arc::new(AtomicBool::new(true)),
            writers: None,
        };
        let mut client = store.pool.get().await.map_err(open_err)?;
        if let Some(s) = schema {
            // Checked by valid_schema above; quoted as an identifier.
            client
                .batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS \"{s}\""))
                .await
                .map_err(open_err)?;
        }
        migrate(&mut client, target).await?;
        store.writers = Some(Arc::new(Writers::start(
            &store.without_writers(),
            Tuning::default(),
        )));
        Ok(store)
    }

    fn without_writers(&self) -> PgStore {
        PgStore {
            writers: None,
            ..self.clone()
        }
    }

    /// Makes every operation of this store (all its handles) take `now` from the database's
    /// clock, read inside its transaction, instead of the caller's: servers sharing one
    /// database then compute every lease from one clock.
    pub fn set_db_clock(&self, on: bool) {
        self.db_clock.store(on, Ordering::Relaxed);
    }

    pub(crate) fn db_clock(&self) -> bool {
        self.db_clock.load(Ordering::Relaxed)
    }

    /// Applies one ledger operation: the hot write operations in a writer's batch (see
    /// `pg_batch`), every other one in a transaction of its own.
    pub(crate) async fn apply(&self, op: Op) -> Result<Answer, Error> {
        match &self.writers {
            Some(w) if pg_batch::batched(&op) => w.apply(op).await,
            _ => self.apply_alone(op).await,
        }
    }

    /// Applies one operation in a transaction of its own.
    pub(crate) async fn apply_alone(&self, mut op: Op) -> Result<Answer, Error> {
        let (kind, name, subject) = (TxKind::of(&op), op.name(), op.subject());
        let mut client = self.client(name).await?;
        let mut tx = self.begin(&mut client, kind, name).await?;
        let result = async {
            if let Some(now) = op.now_mut() {
                *now = PgStore::db_now(&tx, *now).await?;
            }
            ledger::run(&mut tx, &self.cfg, op).await
        }
        .await;
        self.finish(tx, name, &subject, result).await
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
        self.writers
            .as_ref()
            .expect("the store's writers")
            .apply(op)
    }

    #[cfg(test)]
    pub(crate) fn hold_writer(&self, release: tokio::sync::oneshot::Receiver<()>) {
        if let Some(w) = &self.writers {
            w.hold(release);
        }
    }

    pub fn config(&self) -> &LedgerConfig {
        &self.cfg
    }

    /// The same store reading `clock` (see [`PgClock`]; production keeps `Database`). Every
    /// handle of the store, and its writers, switch together ([`PgStore::set_db_clock`]).
    pub fn with_clock(self, clock: PgClock) -> PgStore {
        self.set_db_clock(clock == PgClock::Database);
        self
    }

    pub fn clock(&self) -> PgClock {
        if self.db_clock() {
            PgClock::Database
        } else {
            PgClock::Caller
        }
    }

    /// The database's clock in milliseconds since the epoch, read inside `tx` (so that the time
    /// and the rows an operation reads come from one transaction), or the caller's `now` under
    /// [`PgClock::Caller`]. `clock_timestamp()`, not `now()`: the latter is the transaction's
    /// start, the same for every operation of a batch. It is read before the row locks, so a
    /// lock waited for makes it early by the wait: a takeover or a reap only ever comes later
    /// for it, and a lease granted is at most that much shorter by the database's clock.
    pub(crate) async fn db_now(tx: &PgTx<'_>, caller: Millis) -> Result<Millis, Error> {
        match tx.clock {
            PgClock::Caller => Ok(caller),
            PgClock::Database => db_now(&*tx.t).await,
        }
    }

    /// Applies further migrations up to `target` (tests of a migration).
    #[cfg(test)]
    pub(crate) async fn migrate_to(&self, target: i32) -> Result<(), Error> {
        let mut client = self.client("migrate").await?;
        migrate(&mut client, target).await
    }

    /// A pooled connection (tests use it for raw SQL).
    pub(crate) async fn client(&self, op: &str) -> Result<Object, Error> {
        self.pool.get().await.map_err(|e| {
            Error::internal(format!(
                "{op}: no Postgres connection ({e}); check that the server answers"
            ))
        })
    }

    pub(crate) async fn begin<'c>(
        &self,
        client: &'c mut Object,
        kind: TxKind,
        op: &str,
    ) -> Result<PgTx<'c>, Error> {
        let b = client.build_transaction();
        let b = match kind {
            TxKind::Write => b,
            TxKind::Read => b
                .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
                .read_only(true),
        };
        let t = b.start().await.map_err(|e| pg_err(op, "", &e))?;
        if kind == TxKind::Write {
            // Before any row lock: the doorbell scan waits for every writer holding this to end
            // (see `pending_since`), and a writer that took it first can never wait on the scan.
            t.execute(CHANGE_LOCK_SHARED, &[])
                .await
                .map_err(|e| pg_err(op, "", &e))?;
        }
        Ok(PgTx {
            t,
            kind,
            clock: self.clock(),
        })
    }

    /// Commits on `Ok` (a deferred constraint fires here), rolls back on `Err`.
    pub(crate) async fn finish<R>(
        &self,
        tx: PgTx<'_>,
        op: &str,
        subject: &str,
        result: Result<R, Error>,
    ) -> Result<R, Error> {
        match result {
            Ok(v) => {
                tx.t.commit().await.map_err(|e| pg_err(op, subject, &e))?;
                Ok(v)
            }
            Err(e) => {
                // Dropping the transaction rolls it back; say so explicitly to return the
                // connection clean at once.
                let _ = tx.t.rollback().await;
                Err(e)
            }
        }
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
        let op = "pending scan";
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
        let op = "doorbell listen";
        // Named, so that an operator can tell it from the pool's connections.
        let mut pg = (*self.pg).clone();
        pg.application_name("relay doorbell");
        let (client, mut conn) = pg
            .connect(tokio_postgres::NoTls)
            .await
            .map_err(|e| pg_err(op, "", &e))?;
        let (tx, rx) = tokio::sync::mpsc::channel(READY_BUFFER);
        let schema = std::sync::Arc::new(std::sync::OnceLock::<String>::new());
        let mine = schema.clone();
        let task = tokio::spawn(async move {
            use futures_util::StreamExt as _;
            let mut messages = futures_util::stream::poll_fn(move |cx| conn.poll_message(cx));
            while let Some(Ok(m)) = messages.next().await {
                let tokio_postgres::AsyncMessage::Notification(n) = m else {
                    continue;
                };
                if n.channel() != READY_CHANNEL {
                    continue;
                }
                let Some(ready) = Ready::parse(n.payload(), mine.get().map(String::as_str)) else {
                    continue;
                };
                // A full buffer drops the notice: the doorbell scan rings for it instead.
                let _ = tx.try_send(ready);
            }
        });
        let current: String = client
            .query_one("SELECT current_schema()", &[])
            .await
            .map_err(|e| pg_err(op, "", &e))?
            .get(0);
        let _ = schema.set(current);
        client
            .batch_execute(&format!("LISTEN {READY_CHANNEL}"))
            .await
            .map_err(|e| pg_err(op, "", &e))?;
        Ok(ReadyListener {
            _client: client,
            rx,
            task,
        })
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
        Rows::next_claimable(&mut tx, 0, actor, None, &[])
            .await
            .expect("the claim's read");
        let row =
            tx.t.query_one("SELECT current_setting($1)", &[&setting])
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

async fn migrate(client: &mut Object, target: i32) -> Result<(), Error> {
    let err =
        |e: tokio_postgres::Error| Error::internal(format!("migrating the Postgres store: {e}"));
    let tx = client.transaction().await.map_err(err)?;
    tx.batch_execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations (
             version    integer NOT NULL PRIMARY KEY,
             name       text    NOT NULL,
             applied_at bigint  NOT NULL
         );
         LOCK TABLE schema_migrations IN EXCLUSIVE MODE;",
    )
    .await
    .map_err(err)?;
    let current: i32 = tx
        .query_one(
            "SELECT coalesce(max(version), 0) FROM schema_migrations",
            &[],
        )
        .await
        .map_err(err)?
        .get(0);
    let applied_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
    for (version, name, sql) in MIGRATIONS {
        if *version <= current || *version > target {
            continue;
        }
        tx.batch_execute(sql).await.map_err(|e| {
            Error::internal(format!(
                "migrating the Postgres store: migration {version:04} ({name}) failed: {e}"
            ))
        })?;
        tx.execute(
            "INSERT INTO schema_migrations (version, name, applied_at) VALUES ($1, $2, $3)",
            &[version, name, &applied_at],
        )
        .await
        .map_err(err)?;
    }
    tx.commit().await.map_err(err)
}

/// A database failure as an internal error naming the operation and its todo. For key
/// violations the server's detail (which names the key, e.g. the todo id) is included; other
/// details can quote whole rows and are left out.
pub(crate) fn pg_err(op: &str, subject: &str, e: &tokio_postgres::Error) -> Error {
    let Some(db) = e.as_db_error() else {
        return Error::internal(format!("{op} {subject}: the Postgres store failed: {e}"));
    };
    let code = db.code();
    if *code == SqlState::EXCLUSION_VIOLATION || *code == SqlState::UNIQUE_VIOLATION {
        let what = if db.constraint() == Some("todo_attempts_one_open") {
            "a second open attempt was refused at commit (a todo has at most one open attempt)"
        } else {
            "a key is taken"
        };
        return Error::internal(format!(
            "{op} {subject}: {what}: {} ({})",
            db.message(),
            db.detail().unwrap_or("")
        ));
    }
    Error::internal(format!(
        "{op} {subject}: the Postgres store failed: {} [{}{}]",
        db.message(),
        code.code(),
        db.constraint()
            .map(|c| format!(", constraint {c}"))
            .unwrap_or_default()
    ))
}

pub(crate) struct PgTx<'c> {
    t: Transaction<'c>,
    kind: TxKind,
    clock: PgClock,
}

impl rows::Row for tokio_postgres::Row {
    fn text(&self, i: usize) -> Result<Option<String>, String> {
        self.try_get(i).map_err(|e| e.to_string())
    }
    fn int(&self, i: usize) -> Result<Option<i64>, String> {
        if *self.columns()[i].type_() == Type::INT4 {
            self.try_get::<_, Option<i32>>(i)
                .map(|v| v.map(i64::from))
                .map_err(|e| e.to_string())
        } else {
            self.try_get(i).map_err(|e| e.to_string())
        }
    }
    fn boolean(&self, i: usize) -> Result<bool, String> {
        self.try_get(i).map_err(|e| e.to_string())
    }
    fn bytes(&self, i: usize) -> Result<Option<Vec<u8>>, String> {
        self.try_get(i).map_err(|e| e.to_string())
    }
}

/// A counter as the `integer` the tables store.
fn n32(op: &str, v: u32) -> Result<i32, Error> {
    i32::try_from(v).map_err(|_| Error::invalid(format!("{op}: count {v} is out of range")))
}

/// The todo of a query's only row, or `None`.
fn one_todo(rs: &[tokio_postgres::Row]) -> Result<Option<Todo>, Error> {
    rs.first().map(|r| rows::todo(r, 0)).transpose()
}

pub(crate) static SQL: LazyLock<rows::Shared> = LazyLock::new(|| rows::Shared::new('$'));
static PENDING_SINCE: LazyLock<String> = LazyLock::new(|| rows::pending_since('$'));

/// The advisory lock key of this store's change sequence: its object id, so that stores in
/// different schemas of one database (tests, tenants) do not wait on each other.
const CHANGE_LOCK_KEY: &str = "'todo_change_seq'::regclass::oid::bigint";
pub(crate) const CHANGE_LOCK_SHARED: &str =
    "SELECT pg_advisory_xact_lock_shared('todo_change_seq'::regclass::oid::bigint)";

/// Sent in a transaction that claims, before its first `claim_next` read. Without statistics
/// on `todos` (a new table, or an endpoint whose backlog grew since the last ANALYZE) the
/// planner takes a claim to match a row or two, and reads every claimable row of the endpoint
/// through a bitmap scan to sort them, where walking `todos_fifo` in its order stops at the
/// first rows it can lock: 24 ms against 0.05 ms a claim with 50 000 todos waiting (see
/// `claims_walk_the_fifo_index_without_statistics`). With no explicit sort to weigh, it walks
/// the index, which already gives the order when the claim names its endpoint. Only in those
/// transactions: a sweep's plan (its partial index, then a sort by id) is right as it is. The
/// claim statements only ever run under it, so a plan Postgres caches for them is this one.
pub(crate) const CLAIM_PLAN: &str = "SET LOCAL enable_sort = off";
/// `claim_next`'s lock clause: a row another transaction holds is skipped, not waited for.
pub(crate) const CLAIM_LOCK: &str = " FOR UPDATE SKIP LOCKED";
static LOAD_FOR_UPDATE: LazyLock<String> =
    LazyLock::new(|| format!("{} WHERE t.id = $1 FOR UPDATE", SQL.todo_select));
static ENDPOINT_GET: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {ENDPOINT_COLS} FROM endpoints WHERE name = $1"));
static LOAD: LazyLock<String> = LazyLock::new(|| format!("{} WHERE t.id = $1", SQL.todo_select));

impl PgTx<'_> {
    async fn prepare(
        &self,
        op: &str,
        subject: &str,
        sql: &str,
    ) -> Result<tokio_postgres::Statement, Error> {
        self.t
            .prepare_cached(sql)
            .await
            .map_err(|e| pg_err(op, subject, &e))
    }

    /// Sends the statement when first polled, so joined calls are pipelined in poll order.
    async fn run_query(
        &self,
        op: &str,
        subject: &str,
        st: &tokio_postgres::Statement,
        args: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<tokio_postgres::Row>, Error> {
        self.t
            .query(st, args)
            .await
            .map_err(|e| pg_err(op, subject, &e))
    }

    /// The open attempt from its query's rows; two open attempts are an internal error.
    fn one_open(
        &self,
        op: &str,
        id: &str,
        rs: &[tokio_postgres::Row],
    ) -> Result<Option<Attempt>, Error> {
        match rs {
            [] => Ok(None),
            [row] => rows::attempt(row, 0),
            _ => Err(rows::two_open_attempts(op, id)),
        }
    }

    async fn query(
        &self,
        op: &str,
        subject: &str,
        sql: &str,
        args: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<tokio_postgres::Row>, Error> {
        let st = self
            .t
            .prepare_cached(sql)
            .await
            .map_err(|e| pg_err(op, subject, &e))?;
        self.t
            .query(&st, args)
            .await
            .map_err(|e| pg_err(op, subject, &e))
    }

    async fn execute(
        &self,
        op: &str,
        subject: &str,
        sql: &str,
        args: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, Error> {
        let st = self
            .t
            .prepare_cached(sql)
            .await
            .map_err(|e| pg_err(op, subject, &e))?;
        self.t
            .execute(&st, args)
            .await
            .map_err(|e| pg_err(op, subject, &e))
    }
}

/// Values as Postgres binds them: counts as the `integer` the tables store.
pub(crate) fn pg_vals(
    op: &str,
    vals: Vec<Val>,
) -> Result<Vec<Box<dyn ToSql + Sync + Send>>, Error> {
    vals.into_iter()
        .map(|v| -> Result<Box<dyn ToSql + Sync + Send>, Error> {
            Ok(match v {
                Val::Text(t) => Box::new(t),
                Val::Count(n) => Box::new(n32(op, n)?),
                Val::Big(n) => Box::new(n),
                Val::Bool(b) => Box::new(b),
                Val::Bytes(b) => Box::new(b),
                Val::Texts(t) => Box::new(t),
            })
        })
        .collect()
}

impl PgTx<'_> {
    /// Runs one statement with the values bound in order; the rows it changed.
    async fn exec(&self, op: &str, subject: &str, sql: &str, vals: Vec<Val>) -> Result<u64, Error> {
        let vals = pg_vals(op, vals)?;
        let args: Vec<&(dyn ToSql + Sync)> = vals.iter().map(|v| &**v as _).collect();
        self.execute(op, subject, sql, &args).await
    }

    /// Runs one query with the values bound in order.
    async fn query_vals(
        &self,
        op: &str,
        subject: &str,
        sql: &str,
        vals: Vec<Val>,
    ) -> Result<Vec<tokio_postgres::Row>, Error> {
        let vals = pg_vals(op, vals)?;
        let args: Vec<&(dyn ToSql + Sync)> = vals.iter().map(|v| &**v as _).collect();
        self.query(op, subject, sql, &args).await
    }

    async fn update_todo(&self, op: &str, t: &Todo) -> Result<(), Error> {
        let vals = rows::todo_update(op, t)?;
        if self.exec(op, &t.id, &SQL.update_todo, vals).await? != 1 {
            return Err(Error::internal(format!(
                "{op} {}: the todo row vanished inside its transaction",
                t.id
            )));
        }
        Ok(())
    }

    async fn insert_attempt_row(&self, op: &str, a: &Attempt) -> Result<(), Error> {
        let vals = rows::attempt_row(op, a)?;
        self.exec(op, &a.todo_id, &SQL.insert_attempt, vals)
            .await
            .map(drop)
    }
}

/// One server at a time runs each background sweep: a transaction-scoped advisory lock, tried
/// and skipped when held, released at commit or rollback, and when its holder's connection dies
/// (a server killed mid-sweep holds nothing). Keyed by the schema and the sweep's name.
pub(crate) const TRY_SWEEP_LOCK: &str =
    "SELECT pg_try_advisory_xact_lock(hashtextextended(current_schema() || '/sweep/' || $1, 0))";

impl Rows for PgTx<'_> {
    async fn load(&mut self, op: &str, id: &str) -> Result<Option<(Todo, Option<Attempt>)>, Error> {
        // Two statements, pipelined (one round trip), never one join: under READ COMMITTED a
        // `FOR UPDATE` that waited for another transaction returns the row's newest version but
        // a joined row from its older snapshot. The attempt is read by the statement after the
        // lock is granted, so it sees everything the previous holder committed.
        let todo_sql = match self.kind {
            TxKind::Write => &*LOAD_FOR_UPDATE,
            TxKind::Read => &*LOAD,
        };
        let (todo_st, open_st) = (
            self.prepare(op, id, todo_sql).await?,
            self.prepare(op, id, &SQL.open_attempt).await?,
        );
        let (todo, open) = futures_util::future::try_join(
            self.run_query(op, id, &todo_st, &[&id]),
            self.run_query(op, id, &open_st, &[&id]),
        )
        .await?;
        match one_todo(&todo)? {
            None => Ok(None),
            Some(t) => Ok(Some((t, self.one_open(op, id, &open)?))),
        }
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
        let (sql, args) = SQL.next_claimable(op, now, actor, queues, paused, CLAIM_LOCK)?;
        self.t
            .batch_execute(CLAIM_PLAN)
            .await
            .map_err(|e| pg_err(op, &subject, &e))?;
        let rs = self.query_vals(op, &subject, &sql, args).await?;
        let Some(todo) = one_todo(&rs)? else {
            return Ok(None);
        };
        // Read after the lock (see `load`).
        let open = self
            .query(op, &todo.id, &SQL.open_attempt, &[&todo.id])
            .await?;
        let open = self.one_open(op, &todo.id, &open)?;
        Ok(Some((todo, open)))
    }

    async fn by_key(&mut self, endpoint: &str, key: &str) -> Result<Option<Todo>, Error> {
        let op = "add_todo";
        let vals = vec![
            Val::Text(Some(endpoint.into())),
            Val::Text(Some(key.into())),
        ];
        let rs = self
            .query_vals(op, "(idempotency key)", &SQL.by_key, vals)
            .await?;
        one_todo(&rs)
    }

    async fn insert_todo(&mut self, t: &Todo) -> Result<bool, Error> {
        let op = "add_todo";
        let vals = rows::todo_row(op, t)?;
        Ok(self.exec(op, &t.id, &SQL.insert_todo, vals).await? == 1)
    }

    async fn write(
        &mut self,
        op: &str,
        todo: &Todo,
        writes: &[AttemptWrite],
    ) -> Result<Vec<u64>, Error> {
        // Pipelined: every statement goes out before the first answer comes back, one round
        // trip for the whole change. Their order does not matter: the one-open-attempt
        // constraint is checked at commit.
        let this = &*self;
        let todo_row = async { this.update_todo(op, todo).await.map(|()| 0) };
        let attempts = writes.iter().map(|w| async move {
            match w {
                AttemptWrite::Open(a) => this.insert_attempt_row(op, a).await.map(|()| 1),
                AttemptWrite::Update(a) => {
                    let vals = rows::attempt_update(op, a)?;
                    this.exec(op, &a.todo_id, &SQL.update_open_attempt, vals)
                        .await
                }
                AttemptWrite::PruneThrough(n) => {
                    let vals = vec![Val::Text(Some(todo.id.clone())), Val::Count(*n)];
                    this.exec(op, &todo.id, &SQL.prune, vals).await.map(|_| 0)
                }
                AttemptWrite::Late(a) => {
                    this.exec(op, &a.todo_id, &SQL.update_late, rows::late_update(a))
                        .await
                }
            }
        });
        let (_, rows) =
            futures_util::future::try_join(todo_row, futures_util::future::try_join_all(attempts))
                .await?;
        Ok(rows)
    }

    async fn attempts(&mut self, op: &str, id: &str, which: Newest) -> Result<Vec<Attempt>, Error> {
        let (sql, vals) = SQL.attempts_query(id, which);
        let rs = self.query_vals(op, id, sql, vals).await?;
        let mut out = Vec::with_capacity(rs.len());
        for row in &rs {
            out.extend(rows::attempt(row, 0)?);
        }
        Ok(out)
    }

    async fn candidates(&mut self, sweep: Sweep<'_>) -> Result<Vec<String>, Error> {
        let op = "sweep";
        // Rows a claimer holds are skipped by the reaper and the requeue (it is closing them);
        // a revocation and a purge wait for them, so that they miss none.
        let lock = match sweep {
            Sweep::Reap { .. } | Sweep::RequeueDue { .. } => " FOR UPDATE SKIP LOCKED",
            Sweep::Revoke { .. } | Sweep::Purge { .. } => " FOR UPDATE",
        };
        let background = match sweep {
            Sweep::Reap { .. } => Some("reap"),
            Sweep::RequeueDue { .. } => Some("requeue"),
            Sweep::Revoke { .. } | Sweep::Purge { .. } => None,
        };
        if let Some(name) = background
            && !super::ops::Tx::try_sweep_lock(self, op, name).await?
        {
            // Another server is running this sweep right now; it closes what this one would.
            return Ok(Vec::new());
        }
        let (sql, arg) = SQL.sweep(op, sweep)?;
        let sql = format!("{sql} ORDER BY id{lock}");
        let rs = self.query_vals(op, "", &sql, vec![arg]).await?;
        Ok(rs.iter().map(|r| r.get::<_, String>(0)).collect())
    }

    async fn list(&mut self, actor: &Actor, filter: &TodoFilter) -> Result<Vec<Todo>, Error> {
        let (sql, args) = SQL.list(actor, filter);
        let rs = self.query_vals("list_todos", "", &sql, args).await?;
        rs.iter().map(|r| rows::todo(r, 0)).collect()
    }

    async fn delete(&mut self, op: &str, id: &str) -> Result<(), Error> {
        self.execute(op, id, "DELETE FROM todos WHERE id = $1", &[&id])
            .await?;
        Ok(())
    }

    async fn paused_queues(&mut self) -> Result<Vec<String>, Error> {
        super::ops::paused_queues(self).await
    }

    async fn set_paused(&mut self, now: Millis, queue: &str, paused: bool) -> Result<(), Error> {
        super::ops::set_paused(self, now, queue, paused).await
    }
}

impl Tx for PgTx<'_> {
    async fn clock(&mut self, caller: Millis) -> Result<Millis, Error> {
        PgStore::db_now(self, caller).await
    }

    async fn try_sweep_lock(&mut self, op: &str, name: &str) -> Result<bool, Error> {
        let rs = self.query(op, name, TRY_SWEEP_LOCK, &[&name]).await?;
        rs.first()
            .and_then(|r| r.try_get::<_, bool>(0).ok())
            .ok_or_else(|| Error::internal(format!("{op} {name}: the sweep lock read no row")))
    }

    async fn lock_sessions(&mut self, op: &str) -> Result<(), Error> {
        self.execute(
            op,
            "(sessions)",
            "SELECT pg_advisory_xact_lock('mcp_sessions'::regclass::oid::bigint)",
            &[],
        )
        .await
        .map(drop)
    }

    #[cfg(test)]
    async fn insert_attempt(&mut self, op: &str, a: &Attempt) -> Result<(), Error> {
        self.insert_attempt_row(op, a).await
    }

    async fn exec_sql(
        &mut self,
        op: &str,
        subject: &str,
        sql: &str,
        vals: Vec<Val>,
    ) -> Result<u64, Error> {
        self.exec(op, subject, sql, vals).await
    }

    async fn query_sql<T>(
        &mut self,
        op: &str,
        subject: &str,
        sql: &str,
        vals: Vec<Val>,
        f: fn(&dyn rows::Row) -> Result<T, Error>,
    ) -> Result<Vec<T>, Error> {
        let rs = self.query_vals(op, subject, sql, vals).await?;
        rs.iter().map(|r| f(r)).collect()
    }

    async fn insert_endpoint(&mut self, e: &Endpoint) -> Result<bool, Error> {
        let op = "endpoint create";
        let vals = rows::endpoint_row(op, e)?;
        Ok(self.exec(op, &e.name, &SQL.insert_endpoint, vals).await? == 1)
    }

    async fn endpoint(&mut self, name: &str, lock: bool) -> Result<Option<Endpoint>, Error> {
        let op = "endpoint get";
        let sql = format!(
            "SELECT {ENDPOINT_COLS} FROM endpoints WHERE name = $1{}",
            if lock { " FOR UPDATE" } else { "" }
        );
        let rs = self.query(op, name, &sql, &[&name]).await?;
        rs.first().map(rows::endpoint).transpose()
    }

    async fn count_by_state(&mut self) -> Result<Vec<(String, u64)>, Error> {
        let op = "count todos";
        let rs = self
            .query(
                op,
                "",
                "SELECT state, COUNT(*) FROM todos GROUP BY state ORDER BY state",
                &[],
            )
            .await?;
        rs.iter()
            .map(|r| {
                let state: String = r
                    .try_get(0)
                    .map_err(|e| Error::internal(format!("{op}: {e}")))?;
                let n: i64 = r
                    .try_get(1)
                    .map_err(|e| Error::internal(format!("{op}: {e}")))?;
                Ok((state, u64::try_from(n).unwrap_or(0)))
            })
            .collect()
    }

    async fn endpoints(&mut self) -> Result<Vec<Endpoint>, Error> {
        let rs = self
            .query(
                "endpoint list",
                "",
                &format!("SELECT {ENDPOINT_COLS} FROM endpoints ORDER BY name"),
                &[],
            )
            .await?;
        rs.iter().map(rows::endpoint).collect()
    }

    async fn set_revoked(&mut self, name: &str, at: Millis) -> Result<(), Error> {
        let op = "endpoint revoke";
        self.execute(
            op,
            name,
            "UPDATE endpoints SET revoked_at = $2 WHERE name = $1",
            &[&name, &ms(op, at)?],
        )
        .await?;
        Ok(())
    }
}
