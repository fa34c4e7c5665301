//! The queue server: MCP Streamable HTTP at `/mcp/<endpoint>`, plus `/metrics` and `/healthz`.
//!
//! # What it is
//!
//! A narrow JSON-RPC layer of our own on axum (docs/mcp.md, "Why our own JSON-RPC layer", says why
//! not rmcp). Every rule about todos is a call into the [`Store`] (which calls
//! `relay_core::ledger::transition`); every tool's arguments, schemas, answers and error codes
//! come from `relay_core::wire`. This module adds only what the transport needs: endpoint
//! authentication, sessions, the doorbell, background sweeps, metrics and the HTTP hygiene
//! (body limit, Host/Origin checks; and in `conn`, the accept loop's timeouts, connection cap,
//! TLS and bounded shutdown). It knows nothing of the Board: the `app` module puts the two
//! routers together and serves them ([`Server::router`], [`Server::serve`]). The caps and the log throttle are decided by
//! `relay_core::limits`; this shell only counts and reads the clock.
//!
//! # Time and randomness
//!
//! Every `now` comes from the injected [`WallClock`](relay_core::time::WallClock), so tests drive lease
//! expiry, retries, session expiry and the doorbell window with a `ManualClock`. Session ids, todo
//! ids and fence tokens come from the operating system's RNG, or, when `Server::new` is given a
//! seed (tests, simulation), from a seeded `StdRng`, so a run can be replayed.
//!
//! # Where
//!
//! `sessions` holds the MCP sessions (and their legacy doorbell streams), `doorbell` the rings,
//! the listen streams and the NOTIFY listener, `sweeps` the background sweeps and their loops;
//! `http`, `rpc` and `session` answer requests, `conn` accepts connections, `metrics` counts.
//!
//! # Several servers
//!
//! On Postgres several servers may share one database: every lease is computed from the
//! database's clock (the store reads it), sessions live in the store (this server caches what it
//! confirmed, for at most [`SESSION_RECHECK`]), the doorbell crosses servers by NOTIFY, and one
//! server at a time runs each sweep (the store's try-lock). Doorbell streams and the gate stay
//! per server.
//! The intervals are in [`ServerConfig`], with the reasoning for their defaults.
//!
//! # Never logged
//!
//! Bearer tokens, lease tokens and the `Authorization` header never reach a log line, an error
//! message or a metric label; only endpoint names, tool names, todo ids and error codes do.
//! A name taken from the URL path is logged through `relay_core::limits::escape_text`.

mod conn;
mod doorbell;
mod http;
mod metrics;
mod rpc;
mod session;
mod sessions;
mod sweeps;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use base64::Engine as _;
use rand::SeedableRng as _;
use relay_core::Error;
use relay_core::Millis;
use relay_core::ledger::TokenHash;
use relay_core::wire::LeaseToken;
use tokio::sync::watch;

use crate::clock::SharedClock;
use crate::store::Store;

pub(crate) use conn::accept_loop;
pub use conn::{Peer, tls_acceptor};
use doorbell::Listening;
pub use doorbell::NOTICE_RECONNECT;
pub(crate) use http::host_check;
pub use http::{HostPolicy, host_allowed, origin_allowed};
pub use relay_core::doorbell::{Gate, Offer};
use sessions::McpSession;
pub use sessions::{SESSION_RECHECK, STREAM_TOUCH};
pub use sweeps::{PENDING_SCAN_PAGE, PENDING_SCAN_PAGES};

/// The legacy MCP protocol revisions this server speaks in sessions, newest first (the modern
/// ones are `relay_core::mcp::era::MODERN_VERSIONS`).
pub const PROTOCOL_VERSIONS: [&str; 3] = relay_core::mcp::era::LEGACY_VERSIONS;

/// The legacy doorbell's JSON-RPC method.
pub const TODO_READY: &str = relay_core::mcp::LEGACY_DOORBELL;

/// How the server runs. [`ServerConfig::for_listen`] gives the defaults for an address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerConfig {
    /// Where `relay serve` listens (only `serve` uses it; `router()` is socket-free).
    pub listen: SocketAddr,
    /// The largest request body accepted; bigger ones are answered 413 and change nothing.
    /// Default 1 MiB: the largest legitimate call is an `add_todo` with a 64 KiB payload and a
    /// 64 KiB work order, or a report with a result object, all far below it.
    pub body_limit: usize,
    /// Host names (without port) a request's `Host` may carry; empty: any. For a loopback
    /// listen address the default is the loopback names only, which is what defeats DNS
    /// rebinding (a page on evil.example resolving to 127.0.0.1 still sends `Host: evil.example`).
    pub allowed_hosts: Vec<String>,
    /// Origins (`scheme://host[:port]`) a request's `Origin`, when present, may carry, besides
    /// any origin whose host is in `allowed_hosts`. A present Origin matching neither is 403.
    pub allowed_origins: Vec<String>,
    /// How often the reaper closes lapsed leases. Default 15 s. A lapsed lease is already refused
    /// at its expiry instant on every call, and `claim_next` already takes a lapsed todo over
    /// (`claimable` counts a claimed todo with a lapsed lease), so the reaper decides nothing
    /// about safety: it only records the attempt as `reaped`, frees the todo for `list_todos`
    /// readers and rings the doorbell. A quarter of a minute keeps "time of death" in the ledger
    /// within 15 s of the truth at one cheap indexed query per sweep.
    pub reap_interval: Duration,
    /// How often due retries are moved back to `pending` (and the doorbell's owed rings and the
    /// out-of-process scan run). Default 5 s. `claim_next` already takes a failed todo whose retry
    /// is due, so this too only updates what readers see and rings the doorbell; 5 s is small
    /// next to the shortest backoff (30 s), so a waiting client hears of a due retry promptly.
    pub requeue_interval: Duration,
    /// A session unused for this long (and without an open doorbell stream) is forgotten; its
    /// next request gets 404 and the client initializes again. Default 30 min.
    pub session_idle_timeout: Duration,
    /// The doorbell gate's window: at most one ring per session per window. Default 1 min.
    pub doorbell_window: Duration,
    /// A request's line and headers must be in within this long of the server starting to wait
    /// for them (the connection opening, or the previous response). Default 10 s: a slow-loris
    /// header holds a connection no longer than this.
    pub header_read_timeout: Duration,
    /// A connection with no request in flight that sends nothing for this long is closed (a
    /// silent connection, an idle keep-alive). Default 5 s, the common keep-alive default; an
    /// open doorbell stream is a request in flight and is never idle.
    pub idle_timeout: Duration,
    /// A request body must be in whole within this long of its handler starting to read it;
    /// otherwise 408 and nothing changes. Default 30 s: a 1 MiB body at a slow 64 KiB/s.
    pub body_timeout: Duration,
    /// An MCP request whose answer waits on the store this long is answered 503 with a
    /// JSON-RPC internal error saying the outcome is unknown (a Board page, a 503 page saying
    /// the same), instead of hanging: the database
    /// unreachable without a reset (a partition, a stalled proxy), or stalled. Default 8 s,
    /// under the daemon's 10 s client timeout, so a worker hears an answer, not silence. What
    /// was asked may still take effect once the database answers; a fenced write then still
    /// meets its lease, checked on the database's clock at commit.
    pub answer_timeout: Duration,
    /// The poll interval a task's client is asked to keep (`pollIntervalMs`), and how often a
    /// `subscriptions/listen` stream looks at the tasks it watches. Default 5 s: agent work
    /// takes minutes, and a poll is one indexed read.
    pub task_poll_interval: Duration,
    /// Open connections at most; one more is answered 503 at once and closed (logged at most
    /// once per 10 s). Default 512: half the common fd limit of 1 024, leaving room for the
    /// store and the logs.
    pub max_connections: usize,
    /// Live sessions at most, in total and per endpoint; `initialize` beyond is answered 503.
    /// Defaults 1 024 and 64: a daemon holds one session, a session costs a few hundred bytes.
    pub max_sessions: usize,
    pub max_sessions_per_endpoint: usize,
    /// Open doorbell streams at most (each is an open connection). Default 256.
    pub max_streams: usize,
    /// After a shutdown signal, in-flight requests have this long to finish; then their
    /// connections are dropped and `serve` returns. Default 10 s.
    pub shutdown_grace: Duration,
    /// Serve the Board under `/board/` (`relay serve --no-board` turns it off). Default on.
    pub board: bool,
    /// Mark the Board's cookie `Secure` (set when serving TLS). Default off.
    pub secure_cookies: bool,
}

impl ServerConfig {
    /// The defaults for a listen address: loopback addresses accept only loopback Host names.
    pub fn for_listen(listen: SocketAddr) -> ServerConfig {
        let allowed_hosts = if listen.ip().is_loopback() {
            http::LOOPBACK_HOSTS.iter().map(|h| h.to_string()).collect()
        } else {
            Vec::new()
        };
        ServerConfig {
            listen,
            body_limit: 1024 * 1024,
            allowed_hosts,
            allowed_origins: Vec::new(),
            reap_interval: Duration::from_secs(15),
            requeue_interval: Duration::from_secs(5),
            session_idle_timeout: Duration::from_secs(30 * 60),
            doorbell_window: Duration::from_millis(relay_core::doorbell::WINDOW),
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(5),
            body_timeout: Duration::from_secs(30),
            answer_timeout: Duration::from_secs(8),
            task_poll_interval: Duration::from_millis(relay_core::task::POLL_INTERVAL_DEFAULT_MS),
            max_connections: 512,
            max_sessions: 1024,
            max_sessions_per_endpoint: 64,
            max_streams: 256,
            shutdown_grace: Duration::from_secs(10),
            board: true,
            secure_cookies: false,
        }
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig::for_listen(SocketAddr::from(([127, 0, 0, 1], 7070)))
    }
}

struct State {
    sessions: BTreeMap<String, McpSession>,
    /// Keyed `listen:<n>` (the gate's key too; no session id has a colon).
    listens: BTreeMap<String, Listening>,
    next_listen: u64,
    gate: Gate,
    /// Where the out-of-process scan resumes in the store's change sequence (`None` before the
    /// first scan).
    scan_watermark: Option<u64>,
    /// Todos this server rang itself since the last scan began, which that scan need not ring
    /// again (bounded: past `doorbell::RUNG_SINCE_SCAN_MAX` it is cleared, costing at most extra
    /// rings).
    rung_since_scan: BTreeSet<String>,
}

enum Random {
    Os,
    Seeded(Box<rand::rngs::StdRng>),
}

struct Inner {
    store: Store,
    clock: SharedClock,
    config: ServerConfig,
    random: Mutex<Random>,
    state: Mutex<State>,
    metrics: metrics::Metrics,
    /// Set once shutdown begins: ends every doorbell stream so connections can drain.
    shutdown: watch::Sender<bool>,
    /// Requests being handled right now (observable by tests and the graceful-shutdown path).
    in_flight: watch::Sender<usize>,
    /// One "refused: 401" log line per window (10 s), however many arrive.
    unauthorized_log: Mutex<relay_core::limits::LogThrottle>,
    /// The ids of todos this server changed, for the Board's live stream. A lagging reader
    /// misses some and reloads anyway (see `board::events`).
    board_notices: tokio::sync::broadcast::Sender<String>,
    /// Whether the doorbell's NOTIFY listener is up (Postgres): while it is, every todo that
    /// becomes claimable rings through it, from this server's writes as from any other's, so the
    /// in-process ring is skipped (one ring per change, not two).
    notices_live: watch::Sender<bool>,
    /// The one-time Board login link `relay up` prints, if one was issued (only its hash).
    login_link: Mutex<Option<relay_core::board::LoginLink>>,
}

/// The queue server. Cheap to clone; clones share everything.
#[derive(Clone)]
pub struct Server {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock leaves plain data behind; keep serving.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn millis(d: Duration) -> Millis {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Server {
    /// A server over `store`, reading time from `clock`. `rng_seed`: `None` in production (ids
    /// and fence tokens from the OS RNG); `Some` in tests and simulation (a seeded `StdRng`).
    pub fn new(
        store: Store,
        clock: SharedClock,
        config: ServerConfig,
        rng_seed: Option<u64>,
    ) -> Server {
        let random = match rng_seed {
            None => Random::Os,
            Some(seed) => Random::Seeded(Box::new(rand::rngs::StdRng::seed_from_u64(seed))),
        };
        let window = millis(config.doorbell_window);
        Server {
            inner: Arc::new(Inner {
                store,
                clock,
                config,
                random: Mutex::new(random),
                state: Mutex::new(State {
                    sessions: BTreeMap::new(),
                    listens: BTreeMap::new(),
                    next_listen: 0,
                    gate: Gate::new(window),
                    scan_watermark: None,
                    rung_since_scan: BTreeSet::new(),
                }),
                metrics: metrics::Metrics::new(),
                shutdown: watch::channel(false).0,
                in_flight: watch::channel(0).0,
                unauthorized_log: Mutex::new(relay_core::limits::LogThrottle::new(10_000)),
                board_notices: tokio::sync::broadcast::channel(256).0,
                notices_live: watch::channel(false).0,
                login_link: Mutex::new(None),
            }),
        }
    }

    /// What a request the store did not answer within `answer_timeout` is told (counted in
    /// `relay_store_timeouts_total`): MCP's 503 and the Board's both start with it.
    pub(crate) fn no_answer(&self) -> String {
        self.inner.metrics.store_timeout();
        format!(
            "The database did not answer within {} s, so this request has no answer: it may or \
             may not take effect.",
            self.inner.config.answer_timeout.as_secs_f64()
        )
    }

    pub fn config(&self) -> &ServerConfig {
        &self.inner.config
    }

    pub fn store(&self) -> &Store {
        &self.inner.store
    }

    pub(crate) fn now(&self) -> Millis {
        self.inner.clock.now()
    }

    /// The number of requests being handled, as a watch (tests wait on it instead of sleeping).
    pub fn in_flight(&self) -> watch::Receiver<usize> {
        self.inner.in_flight.subscribe()
    }

    /// The number of live sessions.
    pub fn session_count(&self) -> usize {
        lock(&self.inner.state).sessions.len()
    }

    /// Fills `buf` with random bytes: the OS RNG, or the seeded generator.
    pub(crate) fn fill_random(&self, buf: &mut [u8]) -> Result<(), Error> {
        use rand::TryRng as _;
        match &mut *lock(&self.inner.random) {
            Random::Os => rand::rngs::SysRng.try_fill_bytes(buf).map_err(|e| {
                Error::internal(format!(
                    "the operating system's random number generator failed ({e}); nothing was \
                     changed, try again"
                ))
            }),
            Random::Seeded(rng) => {
                rand::Rng::fill_bytes(rng.as_mut(), buf);
                Ok(())
            }
        }
    }

    /// An internal error as a client may see it: one generic sentence and an error id. The
    /// details (which can quote store text, a SQLSTATE or row values) go only to the log, under
    /// that id, so an operator can find them from what the client reports.
    pub(crate) fn internal_message(&self, context: &str, e: &Error) -> String {
        let error_id = format!(
            "err_{}",
            self.random_hex::<6>()
                .unwrap_or_else(|_| "000000000000".into())
        );
        tracing::error!(error_id = %error_id, context, error = %e, "internal error");
        format!(
            "internal error (error id {error_id}); nothing was changed; try again, and if it \
             persists give the operator this error id (the server log has the details)"
        )
    }

    fn random_hex<const N: usize>(&self) -> Result<String, Error> {
        let mut b = [0u8; N];
        self.fill_random(&mut b)?;
        Ok(b.iter().map(|x| format!("{x:02x}")).collect())
    }

    /// A fence token: 16 random bytes, base64url without padding.
    fn new_lease_token(&self) -> Result<LeaseToken, Error> {
        let mut b = [0u8; 16];
        self.fill_random(&mut b)?;
        Ok(LeaseToken::new(
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b),
        ))
    }

    /// Issues the one-time Board login link for `operator` (replacing any earlier one) and
    /// returns its secret, to be shown once. Only a server listening on loopback issues one: the
    /// link is for the person at this machine (`relay up`), never for a network.
    pub fn issue_login_link(&self, operator: &str) -> Result<String, Error> {
        if !self.inner.config.listen.ip().is_loopback() {
            return Err(Error::invalid(format!(
                "a one-time login link is only for a server on loopback, not {}; log in with an \
                 operator token (`relay operator create NAME`)",
                self.inner.config.listen
            )));
        }
        let mut raw = [0u8; 32];
        self.fill_random(&mut raw)?;
        let secret = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(raw);
        let link = relay_core::board::LoginLink::new(self.now(), TokenHash::of(&secret), operator);
        *lock(&self.inner.login_link) = Some(link);
        Ok(secret)
    }

    /// Redeems the one-time login link (see [`relay_core::board::LoginLink::redeem`]).
    pub(crate) fn redeem_login_link(&self, secret: &str, loopback: bool) -> Result<String, Error> {
        let now = self.now();
        match lock(&self.inner.login_link).as_mut() {
            Some(link) => link.redeem(now, &TokenHash::of(secret), loopback),
            None => Err(Error::forbidden(
                "this server issued no login link; log in with an operator token \
                 (`relay operator create NAME`)",
            )),
        }
    }

    /// Whether shutdown has begun, as a watch: the Board's live stream ends on it, as the
    /// doorbell streams do, so that a browser left open never holds up a graceful stop.
    pub(crate) fn shutting_down(&self) -> watch::Receiver<bool> {
        self.inner.shutdown.subscribe()
    }

    /// Begins shutdown: every doorbell stream ends, so that graceful shutdown can drain.
    pub fn begin_shutdown(&self) {
        self.inner.shutdown.send_replace(true);
    }

    /// The MCP server's own routes (`/mcp/<endpoint>`, `/metrics`, `/healthz`), without the
    /// Board's and without the in-flight count ([`Server::router`] composes them).
    pub(crate) fn mcp_routes(&self) -> axum::Router {
        http::routes(self.clone())
    }

    /// `app` with every request it handles counted in [`Server::in_flight`].
    pub(crate) fn counting_in_flight(&self, app: axum::Router) -> axum::Router {
        app.layer(axum::middleware::from_fn_with_state(
            self.clone(),
            http::count_in_flight,
        ))
    }
}

/// A new todo id: `td_` and 10 random bytes from the OS RNG in hex (for `relay todo add`; the
/// server draws its own from its possibly seeded source).
pub fn new_todo_id() -> Result<String, Error> {
    use rand::TryRng as _;
    let mut b = [0u8; 10];
    rand::rngs::SysRng.try_fill_bytes(&mut b).map_err(|e| {
        Error::internal(format!(
            "the operating system's random number generator failed ({e}); try again"
        ))
    })?;
    Ok(format!(
        "td_{}",
        b.iter().map(|x| format!("{x:02x}")).collect::<String>()
    ))
}

/// A new endpoint bearer token: 32 random bytes from the OS RNG, base64url without padding.
/// Show it once; store only `TokenHash::of(token)`.
pub fn new_bearer_token() -> Result<String, Error> {
    use rand::TryRng as _;
    let mut b = [0u8; 32];
    rand::rngs::SysRng.try_fill_bytes(&mut b).map_err(|e| {
        Error::internal(format!(
            "the operating system's random number generator failed ({e}); try again"
        ))
    })?;
    Ok(base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b))
}
