//! relay-io: the tokio shell around relay-core.
//!
//! It moves bytes and time: the SQLite and Postgres stores, the MCP Streamable HTTP server, the
//! lease client, the daemon's processes and files. It never decides a lifecycle rule: every rule
//! is a call into `relay_core`, so the simulator and the fuzz targets exercise the same logic.
//!
//! [`store`] is the queue store (SQLite and Postgres); [`server`] is the MCP queue server.

pub use relay_core as core;

pub mod clock;
pub mod daemon;
pub mod journal;
pub mod lease;
pub mod runner;
pub mod server;
pub mod store;

/// Resolves on Ctrl-C or SIGTERM: the graceful-stop signal of `relay serve` and `relay daemon`.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}
