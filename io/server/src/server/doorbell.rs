//! The doorbell: rings for the sessions' streams and the modern listen streams of an endpoint
//! when a todo of a queue they hear becomes claimable, as far as the gate
//! (`relay_core::doorbell`) lets them; the Board's live notices; and on Postgres the NOTIFY
//! listener that carries rings across servers.

use std::collections::BTreeSet;
use std::time::Duration;

use relay_core::Error;
use tokio::sync::{mpsc, watch};

use super::sessions::McpSession;
use super::{Offer, Server, State, TODO_READY, lock};

/// A modern doorbell stream (`subscriptions/listen`): which of the endpoint's queues it hears.
/// It lives as long as its connection; nothing of it is in the store.
pub(super) struct Listening {
    pub(super) endpoint: String,
    pub(super) queues: BTreeSet<String>,
    /// The listen request's id, which tags every message of the stream.
    pub(super) subscription: serde_json::Value,
    pub(super) tx: mpsc::Sender<String>,
}

impl Listening {
    pub(super) fn wants(&self, endpoint: &str, queue: &str) -> bool {
        self.endpoint == endpoint && !self.tx.is_closed() && self.queues.contains(queue)
    }
}

impl Server {
    /// Opens a modern listen stream for `endpoint`, its acknowledgement already queued. `Err`:
    /// the stream cap is reached (the message for the client).
    pub(super) fn open_listen(
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

    pub(super) fn ring_message(queues: &BTreeSet<String>) -> String {
        serde_json::json!({
            "jsonrpc": "2.0",
            "method": TODO_READY,
            "params": {"queues": queues},
        })
        .to_string()
    }

    /// Tells every interested session that `todo` (of `endpoint`, in `queue`) is claimable, as
    /// far as the gate lets it, and notes it for the next scan to skip.
    pub(super) fn ring(&self, endpoint: &str, queue: &str, todo: &str, offer: Offer) {
        self.ring_noted(endpoint, queue, todo, offer, true);
    }

    /// `ring`; `note: false` for the scan's own rings. Noting them would make the next scan skip
    /// the todo even when it became pending again outside this server in between.
    pub(super) fn ring_noted(
        &self,
        endpoint: &str,
        queue: &str,
        todo: &str,
        offer: Offer,
        note: bool,
    ) {
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
    pub(super) fn send_update(&self, l: &Listening, queues: &BTreeSet<String>) {
        for q in queues {
            let frame = relay_core::mcp::listen::updated(&l.subscription, q);
            if l.tx.try_send(frame.to_string()).is_ok() {
                self.inner.metrics.doorbell_rings.inc();
            }
        }
    }

    pub(super) fn send_ring(&self, s: &McpSession, queues: &BTreeSet<String>) {
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
    pub(super) async fn follow_pg_notices(&self, pg: &crate::store::PgStore) {
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
}

/// How long the doorbell's notice listener waits before reconnecting a lost connection.
pub const NOTICE_RECONNECT: Duration = Duration::from_secs(1);
/// See `State::rung_since_scan`.
pub(super) const RUNG_SINCE_SCAN_MAX: usize = 100_000;
