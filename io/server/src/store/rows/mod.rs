//! The columns of todos, attempts and endpoints, and their decoding, shared by both backends:
//! the column lists and the values bound to them (`cols`), the statements both dialects share
//! (`sql`), and the decoding of a result row (`decode`).

mod cols;
mod decode;
mod heads;
mod sql;
#[cfg(test)]
mod tests;

pub(crate) use cols::*;
pub(crate) use decode::{Row, attempt, endpoint, todo};
pub(crate) use heads::{ClaimReads, Place, claimable, place};
pub(crate) use relay_core::ledger::rows::ClaimQuery;
#[cfg(feature = "postgres")]
pub(crate) use sql::pg_derived_set;
pub(crate) use sql::{Shared, pending_page, pending_since};
