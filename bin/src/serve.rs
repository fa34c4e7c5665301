//! `relay serve [--listen ADDR]`: the queue server on the store named by `--db`.
//!
//! The first line on stdout, once the socket is bound, is `listening on http://HOST:PORT`
//! (`https://` with `--tls-cert`/`--tls-key`), so a script can start it with port 0 and read
//! the port. Timeouts and caps are flags (docs/operations.md, "Connections, timeouts and TLS"). Logs go to stderr (`RELAY_LOG` sets the
//! filter, default `info`; `--log-json` for JSON lines). Ctrl-C or SIGTERM stop it gracefully:
//! no new connections, in-flight requests finish within `--shutdown-grace`, background sweeps
//! stop, exit 0.

// The ready line is the command's contract.

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use relay_core::Error;
use relay_server::clock::SystemClock;
use relay_server::server::{Server, ServerConfig};

use crate::operator::{DbOpt, fail, open, runtime};

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
    /// A request's line and headers must arrive within this long (slow-loris bound).
    #[arg(long, default_value = "10s", value_parser = positive_duration)]
    header_read_timeout: Duration,
    /// Close a connection with no request in flight that sends nothing for this long.
    #[arg(long, default_value = "5s", value_parser = positive_duration)]
    idle_timeout: Duration,
    /// A request body must arrive whole within this long, else 408.
    #[arg(long, default_value = "30s", value_parser = positive_duration)]
    body_timeout: Duration,
    /// An MCP request whose answer waits on the database this long is answered 503
    /// (outcome unknown) instead of hanging.
    #[arg(long, default_value = "8s", value_parser = positive_duration)]
    answer_timeout: Duration,
    /// How often an MCP task's client is asked to poll (pollIntervalMs), and how often a
    /// listen stream looks at the tasks it watches.
    #[arg(long, default_value = "5s", value_parser = positive_duration)]
    task_poll_interval: Duration,
    /// Open connections at most; more are answered 503 at once.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..))]
    max_connections: u32,
    /// Live MCP sessions at most, across all endpoints.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
    max_sessions: u32,
    /// Live MCP sessions at most per endpoint.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    max_sessions_per_endpoint: u32,
    /// Open doorbell streams at most.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    max_streams: u32,
    /// After SIGTERM/Ctrl-C, in-flight requests get this long; then connections are dropped.
    #[arg(long, default_value = "10s", value_parser = duration_arg)]
    shutdown_grace: Duration,
    /// Serve HTTPS with this PEM certificate chain (needs --tls-key).
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Do not serve the Board (the operator's web pages under /board/).
    #[arg(long)]
    no_board: bool,
}

/// A duration as the config writes them ("10s", "500ms").
fn duration_arg(s: &str) -> Result<Duration, String> {
    relay_core::config::parse_duration(s)
        .map(Duration::from_millis)
        .map_err(|e| e.to_string())
}

fn positive_duration(s: &str) -> Result<Duration, String> {
    let d = duration_arg(s)?;
    if d.is_zero() {
        return Err("must be more than 0 (e.g. \"10s\")".into());
    }
    Ok(d)
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
    // Bad TLS files are refused before anything is opened or bound.
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(relay_server::server::tls_acceptor(cert, key)?),
        _ => None,
    };
    let store = open(db).await?;
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
    config.header_read_timeout = args.header_read_timeout;
    config.idle_timeout = args.idle_timeout;
    config.body_timeout = args.body_timeout;
    config.answer_timeout = args.answer_timeout;
    config.task_poll_interval = args.task_poll_interval;
    config.max_connections = args.max_connections as usize;
    config.max_sessions = args.max_sessions as usize;
    config.max_sessions_per_endpoint = args.max_sessions_per_endpoint as usize;
    config.max_streams = args.max_streams as usize;
    config.shutdown_grace = args.shutdown_grace;
    config.board = !args.no_board;
    config.secure_cookies = tls.is_some();
    let scheme = if tls.is_some() { "https" } else { "http" };
    let server = Server::new(store, Arc::new(SystemClock), config, None);
    // Not `out!`: a server whose stdout reader went away keeps serving (the line is only news).
    let _ = writeln!(std::io::stdout(), "listening on {scheme}://{bound}");
    let _ = std::io::stdout().flush();
    tracing::info!(%bound, db_kind = db_kind(&db.db), "serving MCP at /mcp/<endpoint>");
    let signal = crate::shutdown_signal();
    crate::notify::ready();
    let stop = async {
        signal.await;
        crate::notify::stopping();
    };
    server
        .serve_with_tls(listener, tls, stop)
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
