//! relay-server: the queue side of relay's tokio shell.
//!
//! It moves bytes and time: [`store`] is the queue store (SQLite and Postgres); [`server`] is the
//! MCP Streamable HTTP queue server; [`board`] is the Board, the operators' web pages over it;
//! [`app`] composes the two into one router and serves it. It never decides a lifecycle rule:
//! every rule is a call into `relay_core`, so the simulator and the fuzz targets exercise the
//! same logic.

pub use relay_core as core;

pub mod app;
pub mod board;
pub mod clock;
pub mod server;
pub mod store;
