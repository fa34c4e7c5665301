//! The MCP sessions this server holds: opening one (admitted against the caps), confirming it
//! in the store with a short cache and recording its use, ending it, and its legacy doorbell
//! stream. (`session` reads a session off a request's headers; this module keeps them.)

use relay_core::Error;
use relay_core::Millis;
use relay_core::ledger::TokenHash;
use tokio::sync::mpsc;

use super::{Server, State, lock, millis};

/// One MCP session as this server knows it: bound to the endpoint that initialized it. The
/// session itself lives in the store (any server answers it, a restart keeps it); this is the
/// server's cache of it, plus the doorbell stream, which stays on the server holding the
/// connection.
pub(super) struct McpSession {
    pub(super) endpoint: String,
    /// What the endpoint may claim, for the doorbell.
    pub(super) grant: relay_core::grant::Grant,
    pub(super) last_seen: Millis,
    /// When the store last confirmed the session: a request within [`SESSION_RECHECK`] of it
    /// is answered from this cache.
    pub(super) checked_at: Millis,
    /// The session's last use as recorded in the store, as far as this server knows (on its own
    /// clock): a request writes a new one when this is due
    /// (`relay_core::limits::session_touch_due`).
    pub(super) recorded: Millis,
    pub(super) stream: Option<mpsc::Sender<String>>,
}

impl McpSession {
    pub(super) fn stream_open(&self) -> bool {
        self.stream.as_ref().is_some_and(|s| !s.is_closed())
    }
    pub(super) fn wants(&self, endpoint: &str, queue: &str) -> bool {
        self.endpoint == endpoint
            && self.grant.may_claim()
            && self.stream_open()
            && self.grant.covers(queue)
    }
}

/// Why a doorbell stream did not open.
pub(super) enum StreamRefused {
    NoSession,
    AlreadyOpen,
    Full(String),
}

impl Server {
    /// Opens a session in the store (admitted against the caps over every server's live
    /// sessions) and caches it here.
    pub(super) async fn open_session(
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
            McpSession {
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

    pub(super) fn idle(&self) -> Millis {
        millis(self.inner.config.session_idle_timeout)
    }

    pub(super) fn session_expired(&self, s: &McpSession, now: Millis) -> bool {
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
    pub(super) async fn touch_session(
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
            .or_insert_with(|| McpSession {
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

    pub(super) fn drop_session(st: &mut State, id: &str) {
        st.sessions.remove(id);
        st.gate.forget(id);
    }

    /// Ends a session (DELETE), in the store and here. `false` when there was none for this
    /// endpoint. A stream another server holds for it ends at that server's next keep-alive
    /// (see [`STREAM_TOUCH`]).
    pub(super) async fn end_session(&self, id: &str, endpoint: &str) -> Result<bool, Error> {
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

    pub(super) fn caps(&self) -> relay_core::limits::Caps {
        let c = &self.inner.config;
        relay_core::limits::Caps {
            sessions_total: c.max_sessions,
            sessions_per_endpoint: c.max_sessions_per_endpoint,
            streams: c.max_streams,
        }
    }

    /// Opens the session's doorbell stream.
    pub(super) fn open_stream(&self, id: &str) -> Result<mpsc::Receiver<String>, StreamRefused> {
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
    pub(super) async fn note_stream(&self, id: &str, endpoint: &str) -> Result<(), Error> {
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
    pub(super) fn streams_open(st: &State) -> usize {
        st.sessions.values().filter(|s| s.stream_open()).count()
            + st.listens.values().filter(|l| !l.tx.is_closed()).count()
    }
}

/// How long a session the store confirmed is answered from a server's cache: a session ended
/// (DELETE) or expired on another server keeps answering here for at most this long. 2 s keeps
/// the store at one session write per session per 2 s, however fast its requests come.
pub const SESSION_RECHECK: Millis = 2_000;
/// How often a server holding a session's doorbell stream records its use in the store (so that
/// no server's idle sweep forgets it), and finds out that it was ended elsewhere: the stream of a
/// session ended on another server ends within this and one sweep interval. Far below the idle
/// timeout (30 min).
pub const STREAM_TOUCH: Millis = 60_000;
