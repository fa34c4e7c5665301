//! What a backend's transaction offers the store's own operations, and the helpers they share
//! to bind and read its columns.

use relay_core::Error;
use relay_core::Millis;
#[cfg(test)]
use relay_core::ledger::Attempt;
use relay_core::ledger::{Op, Rows, TokenHash};

use crate::store::rows::{Row, Val};
use crate::store::types::Endpoint;

/// Whether a transaction writes (SQLite `BEGIN IMMEDIATE`) or only reads (a consistent snapshot).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TxKind {
    Write,
    Read,
}

impl TxKind {
    pub(crate) fn of(op: &Op) -> TxKind {
        if op.writes() {
            TxKind::Write
        } else {
            TxKind::Read
        }
    }
}

/// One backend transaction: the ledger's rows, and the store's own tables.
pub(crate) trait Tx: Rows {
    /// The time this transaction's rules read, given the caller's: SQLite keeps the caller's
    /// (one process, one clock); Postgres reads the database's (see `PgTx::db_now`), so that
    /// several servers on one database compute every lease from one clock.
    async fn clock(&mut self, caller: Millis) -> Result<Millis, Error>;
    /// Serialises session admissions until the transaction ends, so that the caps hold across
    /// servers (SQLite's single writer already does; Postgres takes a transaction lock).
    async fn lock_sessions(&mut self, op: &str) -> Result<(), Error>;
    /// Serialises the claims in limited queues until the transaction ends, so that two servers
    /// never count the same free place (see `ledger::flow`): Postgres takes a transaction lock;
    /// SQLite's single writer already does.
    async fn lock_flow(&mut self) -> Result<(), Error>;
    /// Whether this transaction may run background sweep `name`: `false` while another server
    /// runs it (Postgres' try-lock, see `postgres::tx::TRY_SWEEP_LOCK`); always `true` on SQLite.
    async fn try_sweep_lock(&mut self, op: &str, name: &str) -> Result<bool, Error>;
    /// Inserts an attempt as it is (tests plant broken rows with it).
    #[cfg(test)]
    async fn insert_attempt(&mut self, op: &str, a: &Attempt) -> Result<(), Error>;
    /// How many todos are in each state (states with none are absent).
    async fn count_by_state(&mut self) -> Result<Vec<(String, u64)>, Error>;

    async fn insert_endpoint(&mut self, e: &Endpoint) -> Result<bool, Error>;
    async fn endpoint(&mut self, name: &str, lock: bool) -> Result<Option<Endpoint>, Error>;
    async fn endpoints(&mut self) -> Result<Vec<Endpoint>, Error>;
    async fn set_revoked(&mut self, name: &str, at: Millis) -> Result<(), Error>;

    /// One statement over the store's own tables; the rows it changed.
    async fn exec_sql(&mut self, sql: Sql<'_>, vals: Vec<Val>) -> Result<u64, Error>;
    /// One query over the store's own tables, each row decoded by `f`.
    async fn query_sql<T>(
        &mut self,
        sql: Sql<'_>,
        vals: Vec<Val>,
        f: Decode<T>,
    ) -> Result<Vec<T>, Error>;
}

/// Reads one row of a query's answer as a `T`.
pub(crate) type Decode<T> = fn(&dyn Row) -> Result<T, Error>;

/// A statement: the operation and subject that errors name, and its text. Over the store's own
/// tables (`Tx::exec_sql`, `Tx::query_sql`) the text is written once with `$N` placeholders
/// (see `rows::numbered`); a claim's reads (`rows::ClaimReads`) come in the backend's dialect.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sql<'a> {
    pub op: &'a str,
    pub subject: &'a str,
    pub text: &'a str,
}

impl<'a> Sql<'a> {
    pub(crate) fn new(op: &'a str, subject: &'a str, text: &'a str) -> Sql<'a> {
        Sql { op, subject, text }
    }
}

pub(super) fn text(s: &str) -> Val {
    Val::Text(Some(s.to_string()))
}

pub(super) fn hash(h: &TokenHash) -> Val {
    Val::Bytes(Some(h.0.to_vec()))
}

pub(super) fn column<T>(r: Result<Option<T>, String>, what: &str) -> Result<Option<T>, Error> {
    r.map_err(|e| Error::internal(format!("reading {what} from the store: {e}")))
}

pub(super) fn required<T>(r: Result<Option<T>, String>, what: &str) -> Result<T, Error> {
    column(r, what)?.ok_or_else(|| Error::internal(format!("reading {what}: a NULL column")))
}

pub(super) fn millis(r: Result<Option<i64>, String>, what: &str) -> Result<Option<Millis>, Error> {
    column(r, what)?
        .map(|v| Millis::try_from(v).map_err(|e| Error::internal(format!("reading {what}: {e}"))))
        .transpose()
}

/// Column `i` of `r` as a SHA-256 (a token's or a session id's).
pub(super) fn token_hash(r: &dyn Row, i: usize, what: &str) -> Result<TokenHash, Error> {
    let bytes = required(r.bytes(i), what)?;
    <[u8; 32]>::try_from(bytes.as_slice())
        .map(TokenHash)
        .map_err(|_| Error::internal(format!("reading {what}: a hash is not 32 bytes")))
}

pub(super) fn unsigned(r: Result<Option<i64>, String>, what: &str) -> Result<u64, Error> {
    let n = required(r, what)?;
    u64::try_from(n).map_err(|e| Error::internal(format!("reading {what}: {e}")))
}
