//! The background sweeps: the reaper, the due-retry requeue and the doorbell's own sweep
//! (sessions, owed rings, the out-of-process scan), and the loops that run them.
//!
//! [`Server::run_background`] runs two loops, and on Postgres the doorbell's notice listener
//! ([`Server::follow_notices`]); tests call the loops' bodies directly ([`Server::reap_once`],
//! [`Server::requeue_once`], [`Server::doorbell_once`]).

use std::collections::BTreeSet;

use relay_core::Error;
use relay_core::Millis;
use relay_core::ledger::{Op, TodoState, TokenHash};

use super::{Offer, STREAM_TOUCH, Server, lock};

impl Server {
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
    /// database). The scan follows the store's change sequence
    /// ([`Store::pending_since`](crate::store::Store::pending_since)): it reads only todos
    /// changed since the last scan, never a payload, and misses none whatever
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

    pub(super) async fn run_sweeps(&self, shutdown: impl std::future::Future<Output = ()> + Send) {
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
}

/// How many changed pending todos one page of [`Server::doorbell_once`]'s scan reads.
pub const PENDING_SCAN_PAGE: usize = 1_000;
/// Pages per sweep at most; a longer run of new todos continues on the next tick.
pub const PENDING_SCAN_PAGES: usize = 50;
