//! The store's own operations over a backend's transaction: the endpoints table, the queues'
//! own tables and the counts. The ledger's operations are `relay_core::ledger::run` over the same transaction, which
//! each backend offers as [`Rows`]; nothing here decides a lifecycle rule.
//!
//! [`Rows`]: relay_core::ledger::Rows

mod board;
mod endpoints;
mod queues;
mod tx;

pub(crate) use board::*;
pub(crate) use endpoints::*;
pub(crate) use queues::queue_rows;
pub(crate) use queues::*;
pub(crate) use tx::{Decode, Sql, Tx, TxKind};
