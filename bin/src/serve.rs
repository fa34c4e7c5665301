//! `relay serve [--listen ADDR]`: the queue server on the store named by `--db`.
//!
//! The first line on stdout, once the socket is bound, is `listening on http://HOST:PORT` (so a
//! script can start it with port 0 and read the port). Logs go to stderr (`RELAY_LOG` sets the
//! filter, default `info`; `--log-json` for JSON lines). Ctrl-C or SIGTERM stop it gracefully:
//! no new connections, in-flight requests finish, background sweeps stop.

// The ready line is the command's contract.
#![allow(clippy::print_stdout)]

use std::io::Write as _;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;

use relay_core::Error;
use relay_core::ledger::LedgerConfig;
use relay_io::clock::SystemClock;
use relay_io::server::{Server, ServerConfig};
use relay_io::store::Store;

use crate::operator::{DEFAULT_DB, DbOpt, fail, runtime};

#[derive(clap::Args)]
pub struct Args {
    /// The address to listen on (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:7070")]
    listen: SocketAddr,
    /// Accept this Host name (repeatable). A loopback listen address accepts only loopback
    /// names unless more are added here (DNS-rebinding protection); any other address accepts
    /// every host unless this restricts it.
    #[arg(long = "allow-host")]
    allow_hosts: Vec<String>,
    /// Also accept requests whose Origin is this (repeatable), e.g. https://app.example.
    #[arg(long = "allow-origin")]
    allow_origins: Vec<String>,
    /// The largest request body in bytes.
    #[arg(long, default_value_t = 1024 * 1024)]
    body_limit: usize,
    /// Log JSON lines instead of text.
    #[arg(long)]
    log_json: bool,
}

pub fn run(db: &DbOpt, args: Args) -> ExitCode {
    crate::logs::init("info", args.log_json);
    let rt = match runtime() {
        Ok(rt) => rt,
        Err(e) => return fail(&e),
    };
    match rt.block_on(serve(db, args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(&e),
    }
}

async fn serve(db: &DbOpt, args: Args) -> Result<(), Error> {
    let store = Store::open(&db.db, LedgerConfig::default())
        .await
        .map_err(|e| {
            Error::new(
                e.code,
                format!(
                    "{} (store from --db / RELAY_DB; default {DEFAULT_DB})",
                    e.message
                ),
            )
        })?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| {
            Error::invalid(format!(
                "cannot listen on {}: {e}; choose another --listen address (port 0 picks a free \
                 one)",
                args.listen
            ))
        })?;
    let bound = listener
        .local_addr()
        .map_err(|e| Error::internal(format!("cannot read the bound address: {e}")))?;
    let mut config = ServerConfig::for_listen(bound);
    config.allowed_hosts.extend(args.allow_hosts);
    config.allowed_origins = args.allow_origins;
    config.body_limit = args.body_limit;
    let server = Server::new(store, Arc::new(SystemClock), config, None);
    println!("listening on http://{bound}");
    let _ = std::io::stdout().flush();
    tracing::info!(%bound, db_kind = db_kind(&db.db), "serving MCP at /mcp/<endpoint>");
    server
        .serve(listener, relay_io::shutdown_signal())
        .await
        .map_err(|e| Error::internal(format!("the server stopped on an I/O error: {e}")))
}

/// The kind of store, for the log (a Postgres URL may carry a password: never log it).
fn db_kind(url: &str) -> &'static str {
    if url.starts_with("postgres") {
        "postgres"
    } else {
        "sqlite"
    }
}
