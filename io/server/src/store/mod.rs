//! The queue store: the ledger's operations on SQLite or Postgres, plus the endpoints table.
//!
//! # How an operation runs
//!
//! Every lifecycle rule lives in [`relay_core::ledger::transition`]. A store never decides one:
//! each operation is one database transaction that
//!
//! 1. reads the todo row and its open attempt, locked (Postgres `SELECT … FOR UPDATE`; SQLite
//!    `BEGIN IMMEDIATE`, which takes the database's single write lock up front),
//! 2. calls the `transition::*` function on them,
//! 3. writes the returned [`Change`](relay_core::ledger::Change): the todo row is updated,
//!    `Open` inserts an attempt, `Update` rewrites the attempt only while it is still open (no
//!    row is an internal error: an attempt closes exactly once), `PruneThrough` deletes closed
//!    attempts at or below the floor.
//!
//! On both backends most write operations share a transaction with others waiting at the same
//! time (SQLite's writer thread, `sqlite::threads`; Postgres' batch writers, `postgres::batch`),
//! each answering exactly what it would answer as a transaction of its own.
//!
//! That sequence is written once, in [`relay_core::ledger::run`], which applies a
//! [`ledger::Op`](relay_core::ledger::Op) over the rows a backend offers
//! ([`relay_core::ledger::Rows`]); [`Store::apply`] runs it inside one transaction, and each
//! backend's transaction implements the rows with its own SQL. The row values and the
//! statements both dialects share are in `rows`. SQL mirrors only what must run in the
//! database: which todo `claim_next` takes (the `claimable` rule, commented where it appears),
//! the sweeps' candidate filters, the schema's constraints. The model-based tests hold both
//! stores to the in-memory ledger.
//!
//! # Values
//!
//! Times are stored as `BIGINT` milliseconds since the epoch, exactly the [`Millis`] the ledger
//! uses, so a store answers bit-for-bit what the ledger answers. On SQLite `now` comes from the
//! caller; on Postgres, shared by several servers, from the database's clock, read in the
//! operation's own transaction (`PgTx::db_now`; [`PgClock`] says which), so that every
//! server computes every lease from one clock. JSON values (payload, work order, result) are stored as
//! their compact text. Every value reaches SQL as a bound parameter, never as SQL text. Only the
//! SHA-256 of a bearer token or lease token is stored, and neither appears in an error or in
//! `Debug` output.
//!
//! # URLs
//!
//! [`Store::open`] takes the contract's `--db` forms: `sqlite:PATH`, `sqlite::memory:` and
//! `postgres://…` (or `postgresql://…`). Migrations are numbered and recorded in
//! `schema_migrations`; opening a store applies the missing ones and nothing else.

mod ops;
// The Postgres store, behind the `postgres` feature (on by default): a build for a simulated
// runtime, which cannot host tokio-postgres, leaves it out and keeps SQLite.
#[cfg(feature = "postgres")]
pub mod postgres;
mod rows;
pub mod sqlite;
// Most store tests run on both backends (`on_both_stores`), so they go with Postgres.
#[cfg(all(test, feature = "postgres"))]
mod tests;
mod types;

use relay_core::Error;
use relay_core::Millis;
use relay_core::ledger::{self, Answer, LedgerConfig, Op, Todo, TokenHash};

#[cfg(feature = "postgres")]
pub use postgres::{PgClock, PgStore, PgTuning};
pub use sqlite::SqliteStore;
pub use sqlite::threads::Tuning as SqliteTuning;
pub use types::{
    BoardOverview, BoardSession, Bulk, BulkItem, BulkResult, DB_URL_FORMS, Endpoint, McpSessionNew,
    NewEndpoint, Operator, PendingChange, PendingPage,
};

/// What opening a `postgres://` URL answers in a build without the `postgres` feature.
#[cfg(not(feature = "postgres"))]
pub const NO_POSTGRES: &str = "this build of relay has no Postgres support; use sqlite:PATH";

/// A queue store: SQLite (embedded) or Postgres. Cheap to clone; clones share connections.
#[derive(Clone, Debug)]
pub enum Store {
    Sqlite(SqliteStore),
    #[cfg(feature = "postgres")]
    Postgres(PgStore),
}

/// What a parsed `--db` URL names.
#[derive(Clone, PartialEq, Eq)]
pub enum DbUrl {
    SqliteMemory,
    SqliteFile(String),
    Postgres(String),
}

// Hand-written: a Postgres URL may carry a password.
impl std::fmt::Debug for DbUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DbUrl::SqliteMemory => f.write_str("SqliteMemory"),
            DbUrl::SqliteFile(p) => f.debug_tuple("SqliteFile").field(p).finish(),
            DbUrl::Postgres(_) => f.write_str("Postgres(<url redacted>)"),
        }
    }
}

impl DbUrl {
    /// Parses the contract's forms. The error never repeats the URL (it may hold a password).
    pub fn parse(url: &str) -> Result<DbUrl, Error> {
        if url == "sqlite::memory:" {
            return Ok(DbUrl::SqliteMemory);
        }
        if let Some(path) = url.strip_prefix("sqlite:") {
            if path.is_empty() {
                return Err(Error::invalid(format!(
                    "--db sqlite: needs a file path; use {DB_URL_FORMS}"
                )));
            }
            return Ok(DbUrl::SqliteFile(path.to_string()));
        }
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            #[cfg(not(feature = "postgres"))]
            return Err(Error::invalid(NO_POSTGRES));
            #[cfg(feature = "postgres")]
            return Ok(DbUrl::Postgres(url.to_string()));
        }
        let scheme = url.split(':').next().unwrap_or("");
        Err(Error::invalid(format!(
            "--db: unsupported database URL (scheme {scheme:?}); use {DB_URL_FORMS}"
        )))
    }
}

/// The operation a doorbell's scan (`pending_since`) names in its errors.
pub(crate) const PENDING_SCAN: &str = "pending scan";

/// `/healthz`'s write probe ([`Store::probe_write`]), in both backends' dialect: rewrites the
/// time of the one row of `store_heartbeat`.
pub(crate) const HEARTBEAT: &str = "INSERT INTO store_heartbeat (id, beat_at) VALUES (1, $1)
     ON CONFLICT (id) DO UPDATE SET beat_at = excluded.beat_at";

/// Why the store took no write (see [`Store::probe_write`]): which store, the reason in words a
/// client may see (no store text, no value), and the error itself for the log.
#[derive(Debug)]
pub struct WriteRefused {
    /// `sqlite` or `postgres`.
    pub store: &'static str,
    pub reason: &'static str,
    pub error: Error,
}

/// A backend's write probe refused: one of [`WriteRefused`]'s reasons and the error
/// ([`Store::probe_write`] adds which store).
pub(crate) type Refusal = (&'static str, Error);

impl WriteRefused {
    /// The disk (or the database's quota) is full.
    pub const FULL: &str = "the disk is full: writes fail until space is freed on the \
                            database's filesystem";
    /// No write within the probe's timeout.
    pub const LOCKED: &str = "no write finished within the probe's timeout: another process \
                              holds the write lock, or the database is overloaded";
    /// The database could not be reached.
    pub const UNREACHABLE: &str = "the database could not be reached";
    /// Anything else.
    pub const FAILED: &str = "a write failed (the server log has the details)";
}

/// Runs one operation in one transaction on whichever backend this is. `$kind` is a `TxKind`;
/// the body is `ledger::run` or an `ops` call on `$tx`. The SQLite arm runs on the store's writer
/// or a reader thread (its futures never wait: see `ledger::rows::ready`), the Postgres arm
/// awaits a pooled connection.
macro_rules! run {
    ($store:expr, $kind:expr, $op:expr, $subject:expr, |$tx:ident| $body:expr) => {
        match $store {
            Store::Sqlite(s) => {
                s.run($kind, $op, $subject, move |$tx| {
                    relay_core::ledger::rows::ready($body)
                })
                .await
            }
            #[cfg(feature = "postgres")]
            Store::Postgres(p) => {
                let mut client = p.client($op).await?;
                let mut pg_tx = p.begin(&mut client, $kind, $op).await?;
                let result = {
                    let $tx = &mut pg_tx;
                    $body.await
                };
                p.finish(pg_tx, $op, &$subject, result).await
            }
        }
    };
}

/// `$body` on whichever backend this is, with `$s` bound to it: the methods each backend
/// answers its own way (a transaction of the store's own is `run!`).
macro_rules! each {
    ($store:expr, |$s:ident| $body:expr) => {
        match $store {
            Store::Sqlite($s) => $body,
            #[cfg(feature = "postgres")]
            Store::Postgres($s) => $body,
        }
    };
}

impl Store {
    /// Opens (and migrates) the store a `--db` URL names.
    pub async fn open(url: &str, cfg: LedgerConfig) -> Result<Store, Error> {
        match DbUrl::parse(url)? {
            DbUrl::SqliteMemory => Ok(Store::Sqlite(SqliteStore::open_memory(cfg).await?)),
            DbUrl::SqliteFile(path) => Ok(Store::Sqlite(SqliteStore::open_file(path, cfg).await?)),
            #[cfg(feature = "postgres")]
            DbUrl::Postgres(url) => Ok(Store::Postgres(PgStore::open(&url, cfg).await?)),
            #[cfg(not(feature = "postgres"))]
            DbUrl::Postgres(_) => Err(Error::invalid(NO_POSTGRES)),
        }
    }

    /// The settings the transitions run with.
    pub fn config(&self) -> &LedgerConfig {
        each!(self, |s| s.config())
    }

    fn cfg(&self) -> LedgerConfig {
        self.config().clone()
    }

    /// Applies one ledger operation in one transaction (see `relay_core::ledger::run`).
    /// On Postgres the operation's `now` is replaced by the database's clock, read inside the
    /// same transaction (see `PgTx::db_now`), and the hot writes share a writer's batch
    /// (`postgres::batch`); SQLite keeps the caller's clock.
    pub async fn apply(&self, mut op: Op) -> Result<Answer, Error> {
        #[cfg(feature = "postgres")]
        if let Store::Postgres(p) = self {
            return p.apply(op).await;
        }
        let (cfg, kind, name, subject) =
            (self.cfg(), ops::TxKind::of(&op), op.name(), op.subject());
        run!(self, kind, name, subject, |tx| async {
            if let Some(now) = op.now_mut() {
                *now = ops::Tx::clock(tx, *now).await?;
            }
            ledger::run(tx, &cfg, op).await
        })
    }

    /// How many todos are in each state, by state name (states with none are absent).
    pub async fn count_by_state(&self) -> Result<Vec<(String, u64)>, Error> {
        run!(
            self,
            ops::TxKind::Read,
            "count todos",
            String::from("(all)"),
            |tx| ops::count_by_state(tx)
        )
    }

    /// What each queue's kept todos have spent (queues that spent nothing are absent).
    pub async fn spend_by_queue(&self) -> Result<Vec<(String, relay_core::ledger::Usage)>, Error> {
        run!(
            self,
            ops::TxKind::Read,
            "spend by queue",
            String::from("(all)"),
            |tx| ops::spend_by_queue(tx)
        )
    }

    /// Every queue with limits or paused, with what its limits hold back, at `now` (`relay queue
    /// show`, the Board, `/metrics`).
    pub async fn queue_lines(
        &self,
        now: Millis,
    ) -> Result<Vec<relay_core::ledger::flow::QueueLine>, Error> {
        let cfg = self.cfg();
        run!(
            self,
            ops::TxKind::Read,
            "queue show",
            String::from("(queues)"),
            |tx| ops::queue_lines(tx, &cfg, now)
        )
    }

    /// An endpoint's todos counted by queue and state: `queue`'s, or every queue's.
    pub async fn queue_counts(
        &self,
        endpoint: &str,
        queue: Option<&str>,
    ) -> Result<Vec<(String, String, u64)>, Error> {
        let (endpoint, queue) = (endpoint.to_string(), queue.map(str::to_string));
        run!(
            self,
            ops::TxKind::Read,
            "queue counts",
            endpoint.clone(),
            |tx| ops::queue_counts(tx, &endpoint, queue.as_deref())
        )
    }

    /// The Board's overview at `now`, in one read transaction (see [`BoardOverview`]).
    pub async fn board_overview(&self, now: Millis) -> Result<BoardOverview, Error> {
        run!(
            self,
            ops::TxKind::Read,
            "board overview",
            String::from("(all)"),
            |tx| ops::board_overview(tx, now)
        )
    }

    /// The doorbell's out-of-process scan: todos pending now whose last change is numbered
    /// above `after`, at most `limit`, oldest change first, and the next watermark. `None`
    /// (the first scan) answers only the current watermark. Reads an index range of new changes
    /// and a few short columns, never a payload: the cost is O(new rows), whatever the backlog.
    pub async fn pending_since(
        &self,
        after: Option<u64>,
        limit: usize,
    ) -> Result<PendingPage, Error> {
        // A page must hold a row, or a full page could not move the watermark.
        let limit = limit.max(1);
        each!(self, |s| s.pending_since(after, limit).await)
    }

    /// Vends an endpoint. `conflict` when the name is taken.
    pub async fn endpoint_create(&self, now: Millis, new: NewEndpoint) -> Result<Endpoint, Error> {
        let subject = new.name.clone();
        run!(self, ops::TxKind::Write, "endpoint create", subject, |tx| {
            ops::endpoint_create(tx, now, new)
        })
    }

    /// Every endpoint, by name.
    pub async fn endpoint_list(&self) -> Result<Vec<Endpoint>, Error> {
        run!(
            self,
            ops::TxKind::Read,
            "endpoint list",
            String::from("(all)"),
            |tx| ops::endpoint_list(tx)
        )
    }

    /// Records an operator. `conflict` when the name is taken, `invalid` for a bad name.
    pub async fn operator_create(
        &self,
        now: Millis,
        name: &str,
        token_hash: TokenHash,
    ) -> Result<Operator, Error> {
        let name = name.to_string();
        run!(
            self,
            ops::TxKind::Write,
            "operator create",
            name.clone(),
            |tx| ops::operator_create(tx, now, &name, token_hash)
        )
    }

    /// Every operator, by name.
    pub async fn operator_list(&self) -> Result<Vec<Operator>, Error> {
        run!(
            self,
            ops::TxKind::Read,
            "operator list",
            String::from("(all)"),
            |tx| ops::operators(tx)
        )
    }

    /// Revokes an operator and ends its Board sessions, in one transaction. `not_found` for an
    /// unknown name, `conflict` when it is already revoked.
    pub async fn operator_revoke(&self, now: Millis, name: &str) -> Result<Operator, Error> {
        let name = name.to_string();
        run!(
            self,
            ops::TxKind::Write,
            "operator revoke",
            name.clone(),
            |tx| ops::operator_revoke(tx, now, &name)
        )
    }

    /// The active operator a presented token's hash belongs to.
    pub async fn operator_by_token(&self, presented: TokenHash) -> Result<Option<Operator>, Error> {
        run!(
            self,
            ops::TxKind::Read,
            "board login",
            String::from("(board)"),
            |tx| ops::operator_by_token(tx, &presented)
        )
    }

    /// Opens a Board session for `operator`, stored by the SHA-256 of its secret.
    pub async fn session_create(
        &self,
        now: Millis,
        id_hash: TokenHash,
        operator: &str,
    ) -> Result<BoardSession, Error> {
        let operator = operator.to_string();
        run!(
            self,
            ops::TxKind::Write,
            "board login",
            operator.clone(),
            |tx| ops::session_create(tx, now, &id_hash, &operator)
        )
    }

    /// The live session whose secret hashes to `id_hash` (expired or revoked: `None`).
    pub async fn session_get(
        &self,
        now: Millis,
        id_hash: TokenHash,
    ) -> Result<Option<BoardSession>, Error> {
        run!(
            self,
            ops::TxKind::Read,
            "board session",
            String::from("(board)"),
            |tx| ops::session_get(tx, now, &id_hash)
        )
    }

    /// Records a Board bulk action (not yet confirmed) with the todos it lists.
    pub async fn bulk_create(&self, now: Millis, bulk: Bulk) -> Result<(), Error> {
        let subject = bulk.id.clone();
        run!(self, ops::TxKind::Write, "board bulk", subject, |tx| {
            ops::bulk_create(tx, now, &bulk)
        })
    }

    /// A bulk action with its listed todos and their results.
    pub async fn bulk_get(&self, id: &str) -> Result<Option<Bulk>, Error> {
        let id = id.to_string();
        run!(self, ops::TxKind::Read, "board bulk", id.clone(), |tx| {
            ops::bulk_get(tx, &id)
        })
    }

    /// Confirms `operator`'s bulk action (`forbidden` for another operator's).
    pub async fn bulk_confirm(&self, now: Millis, id: &str, operator: &str) -> Result<(), Error> {
        let (id, operator) = (id.to_string(), operator.to_string());
        run!(
            self,
            ops::TxKind::Write,
            "board bulk confirm",
            id.clone(),
            |tx| ops::bulk_confirm(tx, now, &id, &operator)
        )
    }

    /// The confirmed, unfinished bulk actions (what a starting server resumes).
    pub async fn bulk_open(&self) -> Result<Vec<String>, Error> {
        run!(
            self,
            ops::TxKind::Read,
            "board bulk resume",
            String::from("(all)"),
            |tx| ops::bulk_open(tx)
        )
    }

    /// Records one listed todo's result; `false` when it had one already.
    pub async fn bulk_record(&self, now: Millis, id: &str, r: BulkResult) -> Result<bool, Error> {
        let (id, subject) = (id.to_string(), r.todo_id.clone());
        run!(self, ops::TxKind::Write, "board bulk", subject, |tx| {
            ops::bulk_record(tx, now, &id, &r)
        })
    }

    /// Marks a bulk action finished.
    pub async fn bulk_finish(&self, now: Millis, id: &str) -> Result<(), Error> {
        let id = id.to_string();
        run!(self, ops::TxKind::Write, "board bulk", id.clone(), |tx| {
            ops::bulk_finish(tx, now, &id)
        })
    }

    /// Ends a Board session (logout); an unknown one is already ended.
    pub async fn session_delete(&self, id_hash: TokenHash) -> Result<(), Error> {
        run!(
            self,
            ops::TxKind::Write,
            "board logout",
            String::from("(board)"),
            |tx| ops::session_delete(tx, &id_hash)
        )
    }

    /// Records a new MCP session, admitted against `new.caps` over the live sessions in the
    /// store (every server's); answers the endpoint's sessions it ended to make room (their id
    /// hashes). `conflict` with the client's message when a cap is reached.
    pub async fn mcp_session_open(
        &self,
        now: Millis,
        new: McpSessionNew,
    ) -> Result<Vec<TokenHash>, Error> {
        let subject = new.endpoint.clone();
        run!(self, ops::TxKind::Write, "initialize", subject, |tx| {
            ops::mcp_session_open(tx, now, &new)
        })
    }

    /// How long ago a session of `endpoint` was recorded used; `None` when it is gone (see
    /// `ops::mcp_session_check`). A read: it needs no write to succeed.
    pub async fn mcp_session_check(
        &self,
        now: Millis,
        id_hash: TokenHash,
        endpoint: &str,
        idle: Option<Millis>,
    ) -> Result<Option<Millis>, Error> {
        let endpoint = endpoint.to_string();
        run!(self, ops::TxKind::Read, "session", endpoint.clone(), |tx| {
            ops::mcp_session_check(tx, now, &id_hash, &endpoint, idle)
        })
    }

    /// Marks a session of `endpoint` used; `false` when it is gone (see `ops::mcp_session_touch`:
    /// `idle: None` keeps a session with an open stream alive whatever its age and notes the
    /// stream).
    pub async fn mcp_session_touch(
        &self,
        now: Millis,
        id_hash: TokenHash,
        endpoint: &str,
        idle: Option<Millis>,
    ) -> Result<bool, Error> {
        let endpoint = endpoint.to_string();
        run!(
            self,
            ops::TxKind::Write,
            "session",
            endpoint.clone(),
            |tx| ops::mcp_session_touch(tx, now, &id_hash, &endpoint, idle)
        )
    }

    /// Ends a session of `endpoint`; `false` when there was none.
    /// Notes that a session's doorbell stream ended (see `ops::mcp_session_stream_end`).
    pub async fn mcp_session_stream_end(
        &self,
        id_hash: TokenHash,
        endpoint: &str,
    ) -> Result<(), Error> {
        let endpoint = endpoint.to_string();
        run!(
            self,
            ops::TxKind::Write,
            "stream end",
            endpoint.clone(),
            |tx| ops::mcp_session_stream_end(tx, &id_hash, &endpoint)
        )
    }

    pub async fn mcp_session_end(&self, id_hash: TokenHash, endpoint: &str) -> Result<bool, Error> {
        let endpoint = endpoint.to_string();
        run!(
            self,
            ops::TxKind::Write,
            "session end",
            endpoint.clone(),
            |tx| ops::mcp_session_end(tx, &id_hash, &endpoint)
        )
    }

    /// Forgets the sessions unused for `idle`; how many went.
    pub async fn mcp_session_sweep(&self, now: Millis, idle: Millis) -> Result<u64, Error> {
        run!(
            self,
            ops::TxKind::Write,
            "session sweep",
            String::from("(sessions)"),
            |tx| ops::mcp_session_sweep(tx, now, idle)
        )
    }

    /// Whether the store takes a write now (for `/healthz`): commits [`HEARTBEAT`] (one row, its
    /// time rewritten, so the table never grows; it holds nothing else) within `timeout`. A
    /// transaction that merely starts proves nothing: SQLite starts one on a full disk. `Err`
    /// says why not: the disk is full, the store is write-locked past `timeout` or unreachable,
    /// or the write failed otherwise. The same probe on both backends.
    pub async fn probe_write(
        &self,
        now: Millis,
        timeout: std::time::Duration,
    ) -> Result<(), WriteRefused> {
        // The heartbeat's time as its column holds it.
        let at = i64::try_from(now).unwrap_or(i64::MAX);
        let (store, probed) = match self {
            Store::Sqlite(s) => ("sqlite", s.probe_write(at, timeout).await),
            #[cfg(feature = "postgres")]
            Store::Postgres(p) => ("postgres", p.probe_write(at, timeout).await),
        };
        probed.map_err(|(reason, error)| WriteRefused {
            store,
            reason,
            error,
        })
    }

    /// One endpoint by name (revoked ones included: the caller checks `revoked_at`).
    pub async fn endpoint_get(&self, name: &str) -> Result<Option<Endpoint>, Error> {
        #[cfg(feature = "postgres")]
        if let Store::Postgres(p) = self {
            return p.endpoint_get(name).await;
        }
        let name = name.to_string();
        let subject = name.clone();
        run!(self, ops::TxKind::Read, "endpoint get", subject, |tx| {
            ops::endpoint_get(tx, &name)
        })
    }

    /// Revokes an endpoint in one transaction: marks the row and runs [`Store::revoke_endpoint`].
    /// `not_found` for an unknown name, `conflict` when it is already revoked.
    pub async fn endpoint_revoke(
        &self,
        now: Millis,
        name: &str,
    ) -> Result<(Endpoint, Vec<Todo>), Error> {
        let (cfg, name) = (self.cfg(), name.to_string());
        let subject = name.clone();
        run!(self, ops::TxKind::Write, "endpoint revoke", subject, |tx| {
            ops::endpoint_revoke(tx, &cfg, now, &name)
        })
    }
}
