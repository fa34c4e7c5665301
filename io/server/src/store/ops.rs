//! The store's own operations over a backend's transaction: the endpoints table and the
//! counts. The ledger's operations are `relay_core::ledger::run` over the same transaction, which
//! each backend offers as [`Rows`]; nothing here decides a lifecycle rule.

use relay_core::Error;
use relay_core::Millis;
#[cfg(test)]
use relay_core::ledger::Attempt;
use relay_core::ledger::{LedgerConfig, Op, Rows, Todo, run};

use super::{Endpoint, NewEndpoint};

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
    /// Inserts an attempt as it is (tests plant broken rows with it).
    #[cfg(test)]
    async fn insert_attempt(&mut self, op: &str, a: &Attempt) -> Result<(), Error>;
    /// How many todos are in each state (states with none are absent).
    async fn count_by_state(&mut self) -> Result<Vec<(String, u64)>, Error>;

    async fn insert_endpoint(&mut self, e: &Endpoint) -> Result<bool, Error>;
    async fn endpoint(&mut self, name: &str, lock: bool) -> Result<Option<Endpoint>, Error>;
    async fn endpoints(&mut self) -> Result<Vec<Endpoint>, Error>;
    async fn set_revoked(&mut self, name: &str, at: Millis) -> Result<(), Error>;
}

pub(crate) async fn count_by_state<T: Tx>(tx: &mut T) -> Result<Vec<(String, u64)>, Error> {
    tx.count_by_state().await
}

pub(crate) async fn endpoint_create<T: Tx>(
    tx: &mut T,
    now: Millis,
    new: NewEndpoint,
) -> Result<Endpoint, Error> {
    if new.name.is_empty() {
        return Err(Error::invalid(
            "endpoint create: the name must not be empty",
        ));
    }
    let e = Endpoint {
        name: new.name,
        token_hash: new.token_hash,
        verbs: new.verbs,
        queues: new.queues,
        created_at: now,
        revoked_at: None,
    };
    if tx.insert_endpoint(&e).await? {
        Ok(e)
    } else {
        Err(Error::conflict(format!(
            "endpoint create {}: an endpoint with this name exists; choose another name",
            e.name
        )))
    }
}

pub(crate) async fn endpoint_list<T: Tx>(tx: &mut T) -> Result<Vec<Endpoint>, Error> {
    tx.endpoints().await
}

pub(crate) async fn endpoint_get<T: Tx>(tx: &mut T, name: &str) -> Result<Option<Endpoint>, Error> {
    tx.endpoint(name, false).await
}

pub(crate) async fn endpoint_revoke<T: Tx>(
    tx: &mut T,
    cfg: &LedgerConfig,
    now: Millis,
    name: &str,
) -> Result<(Endpoint, Vec<Todo>), Error> {
    let op = "endpoint revoke";
    let Some(mut e) = tx.endpoint(name, true).await? else {
        return Err(Error::not_found(format!(
            "{op} {name}: no such endpoint; `relay endpoint list` shows them"
        )));
    };
    if let Some(at) = e.revoked_at {
        return Err(Error::conflict(format!(
            "{op} {name}: already revoked (at {}); nothing to do",
            relay_core::time::rfc3339(at)
        )));
    }
    tx.set_revoked(name, now).await?;
    e.revoked_at = Some(now);
    let revoke = Op::RevokeEndpoint {
        now,
        endpoint: name.to_string(),
    };
    let todos = run(tx, cfg, revoke).await?.todos()?;
    Ok((e, todos))
}

/// Inserts an attempt as it is, without any transition: only for tests that plant a broken row
/// to prove the database refuses it.
#[cfg(test)]
pub(crate) async fn plant_attempt<T: Tx>(tx: &mut T, a: &Attempt) -> Result<(), Error> {
    tx.insert_attempt("plant", a).await
}
