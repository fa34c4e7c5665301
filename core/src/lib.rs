//! relay-core: the pure heart of relay.
//!
//! Everything that decides something lives here, once: the queue ledger (todos, attempts, fenced
//! leases, retries, dead letters, retention), the MCP wire types and their JSON schemas, and (as it
//! lands) the relay attempt machine and the harness config model.
//!
//! What this crate never does: read a clock, draw randomness, read the environment, touch a file
//! or a socket, spawn a thread or a process. Time arrives as a `u64` of milliseconds since the
//! Unix epoch on every call ([`Millis`]); randomness arrives as values (fence token hashes, ids)
//! or as a seed. Maps are `BTreeMap`s so that iteration is deterministic. `core/clippy.toml`
//! enforces the rule, and `io`, `sim` and `fuzz` are the drivers.

pub mod board;
pub mod bounds;
pub mod config;
pub mod doorbell;
pub mod error;
pub mod fleet;
pub mod grant;
pub mod ledger;
pub mod limits;
pub mod mcp;
pub mod mix;
mod names;
pub mod relay;
pub mod resources;
pub mod serve;
pub mod task;
pub mod time;
pub mod wire;

#[cfg(any(test, feature = "testing"))]
pub mod testing;

pub use error::{Error, ErrorCode};
pub use time::Millis;
