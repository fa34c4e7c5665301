//! relay-server: the queue side of relay's tokio shell.
//!
//! It moves bytes and time: [`store`] is the queue store (SQLite and Postgres); [`server`] is the
//! MCP Streamable HTTP queue server. It never decides a lifecycle rule: every rule is a call
//! into `relay_core`, so the simulator and the fuzz targets exercise the same logic.

pub use relay_core as core;

pub mod board;
pub mod clock;
pub mod server;
pub mod store;
