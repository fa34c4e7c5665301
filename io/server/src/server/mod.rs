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
//! # Background work
//!
//! [`Server::run_background`] runs two loops, and on Postgres the doorbell's notice listener
//! ([`Server::follow_notices`]); tests call the loops' bodies directly ([`Server::reap_once`],
//! [`Server::requeue_once`], [`Server::doorbell_once`]).
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
mod http;
mod metrics;
mod rpc;
mod session;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use base64::Engine as _;
use rand::SeedableRng as _;
use relay_core::Error;
use relay_core::Millis;
use relay_core::ledger::{Op, TodoState, TokenHash};
use relay_core::wire::LeaseToken;
use tokio::sync::{mpsc, watch};

use crate::clock::SharedClock;
use crate::store::Store;

pub(crate) use conn::accept_loop;
pub use conn::{Peer, tls_acceptor};
pub(crate) use http::host_check;
pub use http::{HostPolicy, host_allowed, origin_allowed};
pub use relay_core::doorbell::{Gate, Offer};

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

/// One MCP session as this server knows it: bound to the endpoint that initialized it. The
/// session itself lives in the store (any server answers it, a restart keeps it); this is the
/// server's cache of it, plus the doorbell stream, which stays on the server holding the
/// connection.
struct Session {
    endpoint: String,
    /// What the endpoint may claim, for the doorbell.
    grant: relay_core::grant::Grant,
    last_seen: Millis,
    /// When the store last confirmed the session: a request within [`SESSION_RECHECK`] of it
    /// is answered from this cache.
    checked_at: Millis,
    /// The session's last use as recorded in the store, as far as this server knows (on its own
    /// clock): a request writes a new one when this is due
    /// (`relay_core::limits::session_touch_due`).
    recorded: Millis,
    stream: Option<mpsc::Sender<String>>,
}

impl Session {
    fn stream_open(&self) -> bool {
        self.stream.as_ref().is_some_and(|s| !s.is_closed())
    }
    fn wants(&self, endpoint: &str, queue: &str) -> bool {
        self.endpoint == endpoint
            && self.grant.may_claim()
            && self.stream_open()
            && self.grant.covers(queue)
    }
}

/// A modern doorbell stream (`subscriptions/listen`): which of the endpoint's queues it hears.
/// It lives as long as its connection; nothing of it is in the store.
struct Listening {
    endpoint: String,
    queues: BTreeSet<String>,
    /// The listen request's id, which tags every message of the stream.
    subscription: serde_json::Value,
    tx: mpsc::Sender<String>,
}

impl Listening {
    fn wants(&self, endpoint: &str, queue: &str) -> bool {
        self.endpoint == endpoint && !self.tx.is_closed() && self.queues.contains(queue)
    }
}

struct State {
    sessions: BTreeMap<String, Session>,
    /// Keyed `listen:<n>` (the gate's key too; no session id has a colon).
    listens: BTreeMap<String, Listening>,
    next_listen: u64,
    gate: Gate,
    /// Where the out-of-process scan resumes in the store's change sequence (`None` before the
    /// first scan).
    scan_watermark: Option<u64>,
    /// Todos this server rang itself since the last scan began, which that scan need not ring
    /// again (bounded: past [`RUNG_SINCE_SCAN_MAX`] it is cleared, costing at most extra rings).
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

/// Why a doorbell stream did not open.
enum StreamRefused {
    NoSession,
    AlreadyOpen,
    Full(String),
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

    // -----------------------------------------------------------------------------------------
    // Sessions.
    // -----------------------------------------------------------------------------------------

    /// Opens a session in the store (admitted against the caps over every server's live
    /// sessions) and caches it here.
    async fn open_session(
        &self,
        endpoint: &crate::store::Endpoint,
        protocol: &str,
    ) -> Result<String, Error> {
        let id = self.random_hex::<16>()?;
        let now = self.now();
        let new = crate::store::McpSessionNew {
            id_hash: TokenHash::of(&id),
            endpoint: endpoint.name.clone(),
            protocol: protocol.to_string(),
            idle: relay_core::limits::session_kept(self.idle()),
            caps: self.caps(),
        };
        let ended = self.inner.store.mcp_session_open(now, new).await?;
        let mut st = lock(&self.inner.state);
        if !ended.is_empty() {
            tracing::info!(
                endpoint = %endpoint.name,
                ended = ended.len(),
                "at the endpoint's session cap: ended its least recently used session without a \
                 doorbell stream to make room"
            );
            let gone: Vec<String> = st
                .sessions
                .keys()
                .filter(|id| ended.contains(&TokenHash::of(id)))
                .cloned()
                .collect();
            for id in gone {
                Self::drop_session(&mut st, &id);
            }
        }
        st.sessions.insert(
            id.clone(),
            Session {
                endpoint: endpoint.name.clone(),
                grant: endpoint.grant(),
                last_seen: now,
                checked_at: now,
                recorded: now,
                stream: None,
            },
        );
        self.inner.metrics.sessions.set(st.sessions.len() as i64);
        Ok(id)
    }

    fn idle(&self) -> Millis {
        millis(self.inner.config.session_idle_timeout)
    }

    fn session_expired(&self, s: &Session, now: Millis) -> bool {
        !s.stream_open()
            && now
                >= s.last_seen
                    .saturating_add(millis(self.inner.config.session_idle_timeout))
    }

    /// Looks a session up for `endpoint` and marks it used. `false`: unknown, expired or bound to
    /// another endpoint (all answered 404). A session this server confirmed in the store within
    /// [`SESSION_RECHECK`] is answered from its cache; otherwise the store decides by a read, so
    /// a session made on another server answers here, and one ended or expired there is refused
    /// here at most `SESSION_RECHECK` later. The use is written to the store only when due
    /// (`relay_core::limits::session_touch_every`), and a failed write is logged, not answered:
    /// a read-only request succeeds while the store cannot write.
    async fn touch_session(
        &self,
        id: &str,
        endpoint: &crate::store::Endpoint,
    ) -> Result<bool, Error> {
        let now = self.now();
        let (cached, stream_open, mut recorded) = {
            let st = lock(&self.inner.state);
            match st.sessions.get(id) {
                Some(s) if s.endpoint != endpoint.name => return Ok(false),
                // Idle here may still be in use on another server: the store decides.
                Some(s) => (
                    !self.session_expired(s, now)
                        && now < s.checked_at.saturating_add(SESSION_RECHECK),
                    s.stream_open(),
                    s.recorded,
                ),
                None => (false, false, 0),
            }
        };
        // An open stream keeps its session alive whatever its age.
        let kept = (!stream_open).then(|| relay_core::limits::session_kept(self.idle()));
        let hash = TokenHash::of(id);
        let mut live = true;
        if !cached {
            let checked = self
                .inner
                .store
                .mcp_session_check(now, hash, &endpoint.name, kept);
            match checked.await? {
                Some(age) => recorded = recorded.max(now.saturating_sub(age)),
                None => live = false,
            }
        }
        if live && relay_core::limits::session_touch_due(now.saturating_sub(recorded), self.idle())
        {
            let touched = self
                .inner
                .store
                .mcp_session_touch(now, hash, &endpoint.name, kept);
            match touched.await {
                Ok(true) => recorded = now,
                // Ended or swept since the check.
                Ok(false) => live = false,
                Err(e) => tracing::warn!(
                    endpoint = %endpoint.name,
                    error = %e,
                    "could not record a session's use in the store; the request is answered and \
                     the record is tried again on the session's next request"
                ),
            }
        }
        let mut st = lock(&self.inner.state);
        if !live {
            if st
                .sessions
                .get(id)
                .is_some_and(|s| s.endpoint == endpoint.name)
            {
                Self::drop_session(&mut st, id);
            }
            self.inner.metrics.sessions.set(st.sessions.len() as i64);
            return Ok(false);
        }
        let s = st
            .sessions
            .entry(id.to_string())
            .or_insert_with(|| Session {
                endpoint: endpoint.name.clone(),
                grant: endpoint.grant(),
                last_seen: now,
                checked_at: now,
                recorded,
                stream: None,
            });
        s.last_seen = now;
        s.recorded = s.recorded.max(recorded);
        if !cached {
            s.checked_at = now;
        }
        self.inner.metrics.sessions.set(st.sessions.len() as i64);
        Ok(true)
    }

    fn drop_session(st: &mut State, id: &str) {
        st.sessions.remove(id);
        st.gate.forget(id);
    }

    /// Ends a session (DELETE), in the store and here. `false` when there was none for this
    /// endpoint. A stream another server holds for it ends at that server's next keep-alive
    /// (see [`STREAM_TOUCH`]).
    async fn end_session(&self, id: &str, endpoint: &str) -> Result<bool, Error> {
        let ended = self
            .inner
            .store
            .mcp_session_end(TokenHash::of(id), endpoint)
            .await?;
        let mut st = lock(&self.inner.state);
        let here = st.sessions.get(id).is_some_and(|s| s.endpoint == endpoint);
        if here {
            Self::drop_session(&mut st, id);
        }
        self.inner.metrics.sessions.set(st.sessions.len() as i64);
        Ok(ended || here)
    }

    fn caps(&self) -> relay_core::limits::Caps {
        let c = &self.inner.config;
        relay_core::limits::Caps {
            sessions_total: c.max_sessions,
            sessions_per_endpoint: c.max_sessions_per_endpoint,
            streams: c.max_streams,
        }
    }

    /// Opens the session's doorbell stream.
    fn open_stream(&self, id: &str) -> Result<mpsc::Receiver<String>, StreamRefused> {
        let mut st = lock(&self.inner.state);
        let open = Self::streams_open(&st);
        let Some(s) = st.sessions.get_mut(id) else {
            return Err(StreamRefused::NoSession);
        };
        if s.stream_open() {
            return Err(StreamRefused::AlreadyOpen);
        }
        relay_core::limits::admit_stream(&self.caps(), open).map_err(StreamRefused::Full)?;
        // A ring is a nudge: if a client is this far behind, dropping one loses nothing.
        let (tx, rx) = mpsc::channel(16);
        s.stream = Some(tx);
        Ok(rx)
    }

    /// Notes in the store that the session's doorbell stream is open here, so that it is never
    /// ended to make room for another session (see `relay_core::limits::admit_session`).
    async fn note_stream(&self, id: &str, endpoint: &str) -> Result<(), Error> {
        let now = self.now();
        let live = self
            .inner
            .store
            .mcp_session_touch(now, TokenHash::of(id), endpoint, None)
            .await?;
        if let Some(s) = lock(&self.inner.state).sessions.get_mut(id) {
            (s.checked_at, s.recorded) = (now, now);
        }
        if !live {
            tracing::info!(endpoint = %endpoint, "a doorbell stream opened for a session ended meanwhile");
        }
        Ok(())
    }

    /// Notes in the store that the session's stream ended, once its client went (called when
    /// the stream's response is dropped). A failure only leaves the note to lapse.
    pub(crate) fn note_stream_end(&self, id: &str, endpoint: &str) {
        let (server, id_hash, endpoint) = (self.clone(), TokenHash::of(id), endpoint.to_string());
        tokio::spawn(async move {
            if let Err(e) = server
                .inner
                .store
                .mcp_session_stream_end(id_hash, &endpoint)
                .await
            {
                tracing::warn!(endpoint = %endpoint, error = %e, "could not note the end of a doorbell stream; the note lapses on its own");
            }
        });
    }

    /// Doorbell streams open on this server: legacy GET streams and modern listens.
    fn streams_open(st: &State) -> usize {
        st.sessions.values().filter(|s| s.stream_open()).count()
            + st.listens.values().filter(|l| !l.tx.is_closed()).count()
    }

    /// Opens a modern listen stream for `endpoint`, its acknowledgement already queued. `Err`:
    /// the stream cap is reached (the message for the client).
    fn open_listen(
        &self,
        endpoint: &str,
        listen: relay_core::mcp::listen::Listen,
        subscription: serde_json::Value,
    ) -> Result<(mpsc::Receiver<String>, mpsc::Sender<String>), String> {
        let mut st = lock(&self.inner.state);
        relay_core::limits::admit_stream(&self.caps(), Self::streams_open(&st))?;
        let (tx, rx) = mpsc::channel(16);
        let ack = relay_core::mcp::listen::acknowledged(&subscription, &listen);
        // A new channel has room: the acknowledgement is the stream's first message.
        let _ = tx.try_send(ack.to_string());
        let key = format!("listen:{}", st.next_listen);
        st.next_listen += 1;
        st.listens.insert(
            key,
            Listening {
                endpoint: endpoint.to_string(),
                queues: listen.queues,
                subscription,
                tx: tx.clone(),
            },
        );
        Ok((rx, tx))
    }

    // -----------------------------------------------------------------------------------------
    // The doorbell.
    // -----------------------------------------------------------------------------------------

    fn ring_message(queues: &BTreeSet<String>) -> String {
        serde_json::json!({
            "jsonrpc": "2.0",
            "method": TODO_READY,
            "params": {"queues": queues},
        })
        .to_string()
    }

    /// Tells every interested session that `todo` (of `endpoint`, in `queue`) is claimable, as
    /// far as the gate lets it, and notes it for the next scan to skip.
    fn ring(&self, endpoint: &str, queue: &str, todo: &str, offer: Offer) {
        self.ring_noted(endpoint, queue, todo, offer, true);
    }

    /// `ring`; `note: false` for the scan's own rings. Noting them would make the next scan skip
    /// the todo even when it became pending again outside this server in between.
    fn ring_noted(&self, endpoint: &str, queue: &str, todo: &str, offer: Offer, note: bool) {
        let now = self.now();
        let mut st = lock(&self.inner.state);
        let State {
            sessions,
            listens,
            gate,
            scan_watermark,
            rung_since_scan,
            ..
        } = &mut *st;
        if note && scan_watermark.is_some() {
            if rung_since_scan.len() >= RUNG_SINCE_SCAN_MAX {
                rung_since_scan.clear();
            }
            rung_since_scan.insert(todo.to_string());
        }
        for (id, s) in sessions.iter() {
            if !s.wants(endpoint, queue) {
                continue;
            }
            if gate.offer(id, todo, queue, offer, now) {
                self.send_ring(s, &BTreeSet::from([queue.to_string()]));
            }
        }
        for (key, l) in listens.iter() {
            if l.wants(endpoint, queue) && gate.offer(key, todo, queue, offer, now) {
                self.send_update(l, &BTreeSet::from([queue.to_string()]));
            }
        }
    }

    /// A modern ring: one resource update per queue.
    fn send_update(&self, l: &Listening, queues: &BTreeSet<String>) {
        for q in queues {
            let frame = relay_core::mcp::listen::updated(&l.subscription, q);
            if l.tx.try_send(frame.to_string()).is_ok() {
                self.inner.metrics.doorbell_rings.inc();
            }
        }
    }

    fn send_ring(&self, s: &Session, queues: &BTreeSet<String>) {
        if let Some(tx) = &s.stream
            && tx.try_send(Self::ring_message(queues)).is_ok()
        {
            self.inner.metrics.doorbell_rings.inc();
        }
    }

    /// Tells the Board's live streams which todos an applied operation changed.
    pub(crate) fn notice(&self, answer: &Result<relay_core::ledger::Answer, Error>) {
        use relay_core::ledger::Answer;
        let ids: Vec<&str> = match answer {
            Ok(Answer::Todo(t)) => vec![&t.id],
            Ok(Answer::Claimed(c) | Answer::Next(Some(c))) => vec![&c.todo.id],
            Ok(Answer::Todos(ts)) => ts.iter().map(|t| t.id.as_str()).collect(),
            _ => Vec::new(),
        };
        for id in ids {
            // No Board listening is no error.
            let _ = self.inner.board_notices.send(id.to_string());
        }
    }

    /// Tells the Board's live streams that something else they may show changed (a bulk
    /// action's progress, under its id).
    pub(crate) fn board_notice(&self, id: &str) {
        let _ = self.inner.board_notices.send(id.to_string());
    }

    /// A live stream of the ids of todos this server changes.
    pub(crate) fn board_notices(&self) -> tokio::sync::broadcast::Receiver<String> {
        self.inner.board_notices.subscribe()
    }

    pub(crate) fn ring_todo(&self, t: &relay_core::ledger::Todo, offer: Offer) {
        let _ = self.inner.board_notices.send(t.id.clone());
        if *self.inner.notices_live.borrow() {
            // The NOTIFY of this change rings it (see `follow_notices`).
            return;
        }
        if relay_core::doorbell::worth_a_ring(t) {
            self.ring(&t.endpoint, &t.queue, &t.id, offer);
        }
    }

    // -----------------------------------------------------------------------------------------
    // Background work.
    // -----------------------------------------------------------------------------------------

    /// The reaper's sweep at `now`: closes every lapsed lease as `reaped` and rings the doorbell
    /// for the todos it made claimable again. Returns the changed todos.
    pub async fn reap_once(&self, now: Millis) -> Result<Vec<relay_core::ledger::Todo>, Error> {
        let reaped = self.inner.store.apply(Op::Reap { now }).await?.todos()?;
        for t in &reaped {
            let disposition = if t.state == TodoState::Pending {
                relay_core::ledger::Disposition::Requeued
            } else {
                relay_core::ledger::Disposition::DeadLettered
            };
            self.inner
                .metrics
                .closed(relay_core::ledger::Outcome::Reaped, disposition);
            if let Some(r) = t.dead_letter_reason {
                self.inner.metrics.dead_letter(r.as_str());
            }
            tracing::info!(todo = %t.id, endpoint = %t.endpoint, state = %t.state, "reaped a lapsed lease");
            self.ring_todo(t, Offer::Requeued);
        }
        Ok(reaped)
    }

    /// The due-retry sweep at `now`: moves failed todos whose retry is due back to pending, and
    /// rings for each (cleared from the gate first, so the ring is never swallowed).
    pub async fn requeue_once(&self, now: Millis) -> Result<Vec<relay_core::ledger::Todo>, Error> {
        let requeued = self.inner.store.apply(Op::RequeueDue { now });
        let requeued = requeued.await?.todos()?;
        for t in &requeued {
            // The sweep also dead-letters todos past their deadline: no ring for those.
            if let Some(r) = t.dead_letter_reason {
                tracing::info!(todo = %t.id, endpoint = %t.endpoint, reason = %r, "dead-lettered");
                self.inner.metrics.dead_letter(r.as_str());
                continue;
            }
            tracing::info!(todo = %t.id, endpoint = %t.endpoint, "re-queued a due retry");
            self.ring_todo(t, Offer::Requeued);
        }
        Ok(requeued)
    }

    /// The doorbell's own sweep at `now`: forgets idle sessions and those of revoked endpoints
    /// (ending their streams), rings owed rings whose window
    /// has passed, and rings for todos that became pending outside this server (`relay todo add`
    /// and `relay todo retry` write the store directly, as does another server on the same
    /// database). The scan follows the store's change sequence ([`Store::pending_since`]): it
    /// reads only todos changed since the last scan, never a payload, and misses none whatever
    /// the backlog.
    pub async fn doorbell_once(&self, now: Millis) -> Result<(), Error> {
        // Sessions of revoked endpoints end here (their requests are refused 401 already, but
        // an open doorbell stream would otherwise keep the session alive).
        let live: BTreeSet<String> = self
            .inner
            .store
            .endpoint_list()
            .await?
            .into_iter()
            .filter(|e| e.revoked_at.is_none())
            .map(|e| e.name)
            .collect();
        // The streams this server holds keep their sessions alive in the store; a session ended
        // or swept meanwhile (by another server) ends its stream here.
        let streams: Vec<(String, String)> = lock(&self.inner.state)
            .sessions
            .iter()
            .filter(|(_, s)| s.stream_open() && now >= s.checked_at.saturating_add(STREAM_TOUCH))
            .map(|(id, s)| (id.clone(), s.endpoint.clone()))
            .collect();
        for (id, endpoint) in streams {
            let live = self
                .inner
                .store
                .mcp_session_touch(now, TokenHash::of(&id), &endpoint, None)
                .await?;
            let mut st = lock(&self.inner.state);
            if !live {
                Self::drop_session(&mut st, &id);
            } else if let Some(s) = st.sessions.get_mut(&id) {
                (s.checked_at, s.recorded) = (now, now);
            }
        }
        let kept = relay_core::limits::session_kept(self.idle());
        self.inner.store.mcp_session_sweep(now, kept).await?;
        {
            let mut st = lock(&self.inner.state);
            let expired: Vec<String> = st
                .sessions
                .iter()
                .filter(|(_, s)| self.session_expired(s, now) || !live.contains(&s.endpoint))
                .map(|(id, _)| id.clone())
                .collect();
            for id in expired {
                Self::drop_session(&mut st, &id);
            }
            self.inner.metrics.sessions.set(st.sessions.len() as i64);
            let ended: Vec<String> = st
                .listens
                .iter()
                .filter(|(_, l)| l.tx.is_closed() || !live.contains(&l.endpoint))
                .map(|(key, _)| key.clone())
                .collect();
            for key in ended {
                st.listens.remove(&key);
                st.gate.forget(&key);
            }
            for (id, queues) in st.gate.flush(now) {
                if let Some(s) = st.sessions.get(&id) {
                    self.send_ring(s, &queues);
                } else if let Some(l) = st.listens.get(&id) {
                    self.send_update(l, &queues);
                }
            }
        }
        // Todos that became pending since the last scan, by the store's change sequence: only
        // their ids, queues and endpoints, a page at a time, whatever else is pending.
        let (mut after, skip) = {
            let mut st = lock(&self.inner.state);
            (st.scan_watermark, std::mem::take(&mut st.rung_since_scan))
        };
        for _ in 0..PENDING_SCAN_PAGES {
            let page = self
                .inner
                .store
                .pending_since(after, PENDING_SCAN_PAGE)
                .await?;
            let first = after.is_none();
            let full = page.changes.len() >= PENDING_SCAN_PAGE;
            lock(&self.inner.state).scan_watermark = Some(page.watermark);
            after = Some(page.watermark);
            // An open Board page hears of every change the scan reads, also one this server
            // rang for already: an extra reload is harmless, a missed change is not.
            for c in &page.changes {
                let _ = self.inner.board_notices.send(c.id.clone());
            }
            for c in page.changes.iter().filter(|c| !skip.contains(&c.id)) {
                let offer = Offer::of_pending(c.attempts_total);
                self.ring_noted(&c.endpoint, &c.queue, &c.id, offer, false);
            }
            if first || !full {
                break;
            }
        }
        Ok(())
    }

    /// Whether the doorbell's NOTIFY listener is up, as a watch (tests wait on it).
    pub fn notices_live(&self) -> watch::Receiver<bool> {
        self.inner.notices_live.subscribe()
    }

    /// On Postgres: follows the doorbell's NOTIFY channel on a dedicated connection
    /// ([`PgStore::listen_ready`](crate::store::PgStore::listen_ready)) and rings this server's
    /// sessions through the gate for every todo that becomes claimable in the store, whoever
    /// wrote it (another server, the CLI, this one). A lost connection is reconnected after
    /// [`NOTICE_RECONNECT`]; meanwhile this server rings its own writes in-process and the
    /// doorbell scan (every requeue interval) rings what the others wrote. Returns at once on
    /// SQLite (one process: in-process rings and the scan).
    pub async fn follow_notices(&self) {
        #[cfg(feature = "postgres")]
        if let crate::store::Store::Postgres(pg) = &self.inner.store {
            self.follow_pg_notices(pg).await;
        }
    }

    /// The loop of [`Server::follow_notices`]; it never returns.
    #[cfg(feature = "postgres")]
    async fn follow_pg_notices(&self, pg: &crate::store::PgStore) {
        loop {
            match pg.listen_ready().await {
                Ok(mut listener) => {
                    tracing::info!("doorbell: listening for notices across servers");
                    self.inner.notices_live.send_replace(true);
                    while let Some(r) = listener.recv().await {
                        self.ring(
                            &r.endpoint,
                            &r.queue,
                            &r.id,
                            Offer::of_pending(r.attempts_total),
                        );
                    }
                    self.inner.notices_live.send_replace(false);
                    tracing::warn!(
                        "doorbell: the notice connection was lost; scanning every requeue                          interval until it is back"
                    );
                }
                Err(e) => {
                    tracing::warn!(error = %e, "doorbell: cannot listen for notices; retrying");
                }
            }
            tokio::time::sleep(NOTICE_RECONNECT).await;
        }
    }

    /// Runs the reaper and the requeue/doorbell loops on the configured intervals, and the
    /// doorbell's notice listener ([`Server::follow_notices`]), until `shutdown` resolves. A
    /// failed sweep is logged and retried on the next tick. (The application's
    /// [`Server::run_background`] adds the Board's resumed bulk actions.)
    pub(crate) async fn run_loops(&self, shutdown: impl std::future::Future<Output = ()> + Send) {
        let notices = {
            let s = self.clone();
            tokio::spawn(async move { s.follow_notices().await })
        };
        self.run_sweeps(shutdown).await;
        notices.abort();
        self.inner.notices_live.send_replace(false);
    }

    async fn run_sweeps(&self, shutdown: impl std::future::Future<Output = ()> + Send) {
        use tokio::time::{MissedTickBehavior, interval};
        let mut reap = interval(self.inner.config.reap_interval);
        reap.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut requeue = interval(self.inner.config.requeue_interval);
        requeue.set_missed_tick_behavior(MissedTickBehavior::Delay);
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                _ = reap.tick() => {
                    if let Err(e) = self.reap_once(self.now()).await {
                        tracing::warn!(error = %e, "reaper sweep failed; retrying next tick");
                    }
                }
                _ = requeue.tick() => {
                    let now = self.now();
                    if let Err(e) = self.requeue_once(now).await {
                        tracing::warn!(error = %e, "requeue sweep failed; retrying next tick");
                    }
                    if let Err(e) = self.doorbell_once(now).await {
                        tracing::warn!(error = %e, "doorbell sweep failed; retrying next tick");
                    }
                }
            }
        }
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

/// How many changed pending todos one page of [`Server::doorbell_once`]'s scan reads.
pub const PENDING_SCAN_PAGE: usize = 1_000;
/// Pages per sweep at most; a longer run of new todos continues on the next tick.
pub const PENDING_SCAN_PAGES: usize = 50;
/// How long a session the store confirmed is answered from a server's cache: a session ended
/// (DELETE) or expired on another server keeps answering here for at most this long. 2 s keeps
/// the store at one session write per session per 2 s, however fast its requests come.
pub const SESSION_RECHECK: Millis = 2_000;
/// How often a server holding a session's doorbell stream records its use in the store (so that
/// no server's idle sweep forgets it), and finds out that it was ended elsewhere: the stream of a
/// session ended on another server ends within this and one sweep interval. Far below the idle
/// timeout (30 min).
pub const STREAM_TOUCH: Millis = 60_000;
/// How long the doorbell's notice listener waits before reconnecting a lost connection.
pub const NOTICE_RECONNECT: Duration = Duration::from_secs(1);
/// See `State::rung_since_scan`.
const RUNG_SINCE_SCAN_MAX: usize = 100_000;

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
