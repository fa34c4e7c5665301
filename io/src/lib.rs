//! relay-io: the tokio shell around relay-core.
//!
//! It moves bytes and time: the SQLite and Postgres stores, the MCP Streamable HTTP server, the
//! lease client, the daemon's processes and files. It never decides a lifecycle rule: every rule
//! is a call into `relay_core`, so the simulator and the fuzz targets exercise the same logic.
//!
//! [`store`] is the queue store (SQLite and Postgres); [`server`] is the MCP queue server.

pub use relay_core as core;

pub mod clock;
pub mod server;
pub mod store;
