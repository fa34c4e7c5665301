//! The daemon's events for `relay events`: the machines' [`Event`]s as JSON lines, a
//! bounded ring of the recent ones and a broadcast to followers.
//!
//! The actor only ever pushes: a follower's channel is a bounded broadcast, so a follower that
//! reads too slowly falls behind (its receiver lags) instead of holding the actor up, and the
//! control socket then disconnects it with a line saying how many events it missed.

use std::collections::VecDeque;
use std::sync::Arc;

use relay_core::relay::Event;
use relay_core::time::Wall;
use serde::Serialize;
use tokio::sync::broadcast;

/// Recent events kept for plain `relay events`.
pub const RING: usize = 1000;
/// Events a follower may fall behind by before it is disconnected.
pub const FOLLOW_BUFFER: usize = 1024;

/// What `relay events` gets: the recent event lines, oldest first, and for `--follow` a
/// receiver subscribed at the same instant (so nothing is missed or repeated between the two).
pub type Feed = (Vec<Arc<str>>, Option<broadcast::Receiver<Arc<str>>>);

/// One line: the event's own fields (`event` first), then `at`.
#[derive(Serialize)]
struct Line<'a> {
    #[serde(flatten)]
    event: &'a Event,
    at: String,
}

pub struct EventLog {
    ring: VecDeque<Arc<str>>,
    followers: broadcast::Sender<Arc<str>>,
}

impl Default for EventLog {
    fn default() -> EventLog {
        EventLog {
            ring: VecDeque::with_capacity(RING),
            followers: broadcast::channel(FOLLOW_BUFFER).0,
        }
    }
}

impl EventLog {
    /// Records an event with the wall time it happened at (`at`, RFC 3339); returns its line.
    pub fn push(&mut self, event: &Event, now: Wall) -> Arc<str> {
        let line = Line {
            event,
            at: relay_core::time::rfc3339(now.ms()),
        };
        let line: Arc<str> = serde_json::to_string(&line).unwrap_or_default().into();
        if self.ring.len() == RING {
            self.ring.pop_front();
        }
        self.ring.push_back(line.clone());
        // No follower is not an error.
        let _ = self.followers.send(line.clone());
        line
    }

    pub fn feed(&self, follow: bool) -> Feed {
        let recent = self.ring.iter().cloned().collect();
        (recent, follow.then(|| self.followers.subscribe()))
    }
}
