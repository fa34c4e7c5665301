//! The doorbell gate: decides, per MCP session, whether a todo becoming claimable rings
//! `notifications/todo_ready` now, later, or not at all. Pure: every input carries `now`.
//!
//! The rules:
//! - At most one ring per session per window (a minute by default). A client that hears a ring
//!   drains its queues until `claim_next` answers empty, so one ring covers everything that was
//!   claimable when it rang.
//! - A todo that becomes claimable inside the window after a ring is *owed*, not dropped: the
//!   owed rings go out (once, together) when the window has passed ([`Gate::flush`]). Nothing is
//!   swallowed, only delayed by at most one window.
//! - A todo that comes back (a due retry re-queued, a reaped or released lease, an operator
//!   retry) is cleared from the gate and rings at once, even inside the window: the client may
//!   have claimed it, failed it and gone idle within the same minute, and its earlier ring was
//!   spent on the previous attempt. Without the clearing, that todo's new chance would wait on
//!   a ring that already happened.
//! - The same todo offered twice inside a window (e.g. two sweeps seeing it) rings once.

use std::collections::{BTreeMap, BTreeSet};

use relay_core::Millis;

/// Why a todo is offered to the gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Offer {
    /// First time claimable (a new todo).
    Fresh,
    /// Claimable again (re-queued, released, reaped, retried): cleared from the gate first.
    Requeued,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Entry {
    last_ring: Option<Millis>,
    /// Todos the last ring covered (within its window).
    rung: BTreeSet<String>,
    /// Todos waiting for the window to pass, with their queues.
    owed: BTreeMap<String, String>,
}

/// The gate for every session. See the module doc for the rules.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gate {
    window: Millis,
    sessions: BTreeMap<String, Entry>,
}

impl Gate {
    pub fn new(window: Millis) -> Gate {
        Gate {
            window,
            sessions: BTreeMap::new(),
        }
    }

    /// Offers a todo (in `queue`) to a session's gate. `true`: ring now.
    pub fn offer(
        &mut self,
        session: &str,
        todo: &str,
        queue: &str,
        offer: Offer,
        now: Millis,
    ) -> bool {
        let window = self.window;
        let e = self.sessions.entry(session.to_string()).or_default();
        let open = e.last_ring.is_some_and(|t| now < t.saturating_add(window));
        if offer == Offer::Requeued {
            e.rung.remove(todo);
            e.owed.remove(todo);
        }
        if !open {
            e.last_ring = Some(now);
            e.rung = BTreeSet::from([todo.to_string()]);
            e.owed.clear();
            return true;
        }
        if e.rung.contains(todo) || e.owed.contains_key(todo) {
            return false;
        }
        match offer {
            Offer::Requeued => {
                e.rung.insert(todo.to_string());
                true
            }
            Offer::Fresh => {
                e.owed.insert(todo.to_string(), queue.to_string());
                false
            }
        }
    }

    /// The sessions whose owed rings are due at `now`, each with the queues they cover. Each
    /// returned session counts as rung at `now`.
    pub fn flush(&mut self, now: Millis) -> Vec<(String, BTreeSet<String>)> {
        let window = self.window;
        let mut due = Vec::new();
        for (session, e) in &mut self.sessions {
            let open = e.last_ring.is_some_and(|t| now < t.saturating_add(window));
            if open || e.owed.is_empty() {
                continue;
            }
            let owed = std::mem::take(&mut e.owed);
            e.last_ring = Some(now);
            e.rung = owed.keys().cloned().collect();
            due.push((session.clone(), owed.into_values().collect()));
        }
        due
    }

    /// The earliest time an owed ring becomes due, if any is owed.
    pub fn next_due(&self) -> Option<Millis> {
        self.sessions
            .values()
            .filter(|e| !e.owed.is_empty())
            .filter_map(|e| e.last_ring.map(|t| t.saturating_add(self.window)))
            .min()
    }

    /// Forgets a session (it ended).
    pub fn forget(&mut self, session: &str) {
        self.sessions.remove(session);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Millis = 60_000;

    #[test]
    fn first_offer_rings_and_the_window_holds_the_next_until_flush() {
        let mut g = Gate::new(MIN);
        assert!(g.offer("s", "a", "q", Offer::Fresh, 0));
        assert!(!g.offer("s", "b", "q2", Offer::Fresh, 10));
        assert_eq!(g.next_due(), Some(MIN));
        assert!(g.flush(MIN - 1).is_empty());
        let due = g.flush(MIN);
        assert_eq!(
            due,
            vec![("s".to_string(), BTreeSet::from(["q2".to_string()]))]
        );
        assert!(g.flush(MIN).is_empty(), "an owed ring goes out once");
        assert_eq!(g.next_due(), None);
    }

    #[test]
    fn the_same_todo_inside_the_window_rings_once() {
        let mut g = Gate::new(MIN);
        assert!(g.offer("s", "a", "q", Offer::Fresh, 0));
        assert!(!g.offer("s", "a", "q", Offer::Fresh, 5));
        assert!(g.flush(MIN).is_empty());
    }

    #[test]
    fn a_requeued_todo_is_cleared_and_rings_inside_the_window() {
        let mut g = Gate::new(MIN);
        assert!(g.offer("s", "a", "q", Offer::Fresh, 0));
        // Claimed, failed, its retry re-queued 20 s later: the ring is not swallowed.
        assert!(g.offer("s", "a", "q", Offer::Requeued, 20_000));
        // A repeat of the same requeue inside the window does not ring again.
        assert!(!g.offer("s", "a", "q", Offer::Fresh, 21_000));
        // But a second requeue of it does.
        assert!(g.offer("s", "a", "q", Offer::Requeued, 22_000));
    }

    #[test]
    fn a_requeue_of_an_owed_todo_rings_at_once() {
        let mut g = Gate::new(MIN);
        assert!(g.offer("s", "a", "q", Offer::Fresh, 0));
        assert!(!g.offer("s", "b", "q", Offer::Fresh, 1));
        assert!(g.offer("s", "b", "q", Offer::Requeued, 2));
        assert!(g.flush(MIN).is_empty(), "b rang already; nothing owed");
    }

    #[test]
    fn sessions_are_gated_independently_and_forgotten() {
        let mut g = Gate::new(MIN);
        assert!(g.offer("s1", "a", "q", Offer::Fresh, 0));
        assert!(g.offer("s2", "a", "q", Offer::Fresh, 0));
        assert!(!g.offer("s1", "b", "q", Offer::Fresh, 1));
        g.forget("s1");
        assert!(g.flush(MIN).is_empty());
        assert!(
            g.offer("s1", "c", "q", Offer::Fresh, 2),
            "a new session rings"
        );
    }

    #[test]
    fn after_the_window_a_fresh_todo_rings_again() {
        let mut g = Gate::new(MIN);
        assert!(g.offer("s", "a", "q", Offer::Fresh, 0));
        assert!(g.offer("s", "a", "q", Offer::Fresh, MIN));
    }
}
