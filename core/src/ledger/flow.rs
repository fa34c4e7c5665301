//! Flow control: which claims a queue's limits allow. Pure: the counts come in (a backend reads
//! them inside the claim's transaction, see [`Rows::flow_load`](super::Rows::flow_load)), the
//! holds go out, and `claim_next` passes over what they hold.
//!
//! A queue may limit the todos claimed at once (`max_claimed`), those claimed at once per
//! `concurrency_key` (`max_claimed_per_key`), and the claims within a rolling minute
//! (`claims_per_minute`). A todo counts as claimed from its claim until its attempt closes or the
//! reaper takes its lapsed lease back: a lapsed lease still holds its place, so the holder that
//! may still be running is never joined by a second one. The window counts the claims made while
//! the queue had a rate limit.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{Todo, TodoState};
use crate::Millis;

/// The longest `concurrency_key`, in bytes.
pub const KEY_MAX_BYTES: usize = 128;
/// The largest value of a limit.
pub const LIMIT_MAX: u32 = 1_000_000;
/// The rolling window of `claims_per_minute`.
pub const WINDOW: Millis = 60_000;

/// A queue's limits; `None` is no limit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Claimed todos at once in the queue.
    pub max_claimed: Option<u32>,
    /// Claimed todos at once with one `concurrency_key` (todos without a key are not limited).
    pub max_claimed_per_key: Option<u32>,
    /// Claims within the last minute.
    pub claims_per_minute: Option<u32>,
}

impl Limits {
    /// No limit at all (a queue with none keeps no row).
    pub fn is_empty(&self) -> bool {
        *self == Limits::default()
    }

    /// Each limit by its name.
    pub fn each(&self) -> [(&'static str, Option<u32>); 3] {
        [
            ("max_claimed", self.max_claimed),
            ("max_claimed_per_key", self.max_claimed_per_key),
            ("claims_per_minute", self.claims_per_minute),
        ]
    }

    /// Each limit set is 1 to [`LIMIT_MAX`] (a queue that should take no claims is paused).
    pub fn check(&self) -> Result<(), String> {
        for (name, v) in self.each() {
            if let Some(n) = v
                && !(1..=LIMIT_MAX).contains(&n)
            {
                return Err(format!(
                    "{name} must be between 1 and {LIMIT_MAX} (pause the queue to stop its \
                     claims); got {n}"
                ));
            }
        }
        Ok(())
    }

    /// One line: `max_claimed 3, max_claimed_per_key 1` (`no limits` when none is set).
    pub fn describe(&self) -> String {
        let set: Vec<String> = self
            .each()
            .iter()
            .filter_map(|(name, v)| v.map(|n| format!("{name} {n}")))
            .collect();
        if set.is_empty() {
            "no limits".into()
        } else {
            set.join(", ")
        }
    }
}

/// A change of a queue's limits: a field `None` leaves that limit as it is, `Some(None)` lifts
/// it, `Some(Some(n))` sets it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LimitsChange {
    pub max_claimed: Option<Option<u32>>,
    pub max_claimed_per_key: Option<Option<u32>>,
    pub claims_per_minute: Option<Option<u32>>,
}

impl LimitsChange {
    /// `before` with this change applied.
    pub fn apply(&self, before: Limits) -> Limits {
        Limits {
            max_claimed: self.max_claimed.unwrap_or(before.max_claimed),
            max_claimed_per_key: self
                .max_claimed_per_key
                .unwrap_or(before.max_claimed_per_key),
            claims_per_minute: self.claims_per_minute.unwrap_or(before.claims_per_minute),
        }
    }
}

/// What the limited queues hold now: claimed todos by queue and key (`None`: no key), and by
/// queue the claims within the window.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Load {
    pub claimed: BTreeMap<(String, Option<String>), u32>,
    pub recent: BTreeMap<String, u32>,
}

impl Load {
    /// Claimed todos in `queue`.
    pub fn claimed_in(&self, queue: &str) -> u32 {
        self.claimed
            .iter()
            .filter(|((q, _), _)| q == queue)
            .map(|(_, n)| n)
            .sum()
    }

    /// Claimed todos in `queue` with `key`.
    pub fn claimed_with(&self, queue: &str, key: &str) -> u32 {
        let k = (queue.to_string(), Some(key.to_string()));
        self.claimed.get(&k).copied().unwrap_or(0)
    }

    /// Claims in `queue` within the window.
    pub fn recent_in(&self, queue: &str) -> u32 {
        self.recent.get(queue).copied().unwrap_or(0)
    }
}

/// Why a claim would break a queue's limit (or the queue is paused).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Held {
    /// `max_claimed` todos of the queue are claimed.
    Full(u32),
    /// `max_claimed_per_key` todos with the key are claimed.
    KeyFull(String, u32),
    /// `claims_per_minute` claims were made within the last minute.
    Rate(u32),
}

impl std::fmt::Display for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Held::Full(n) => write!(f, "its queue has max_claimed {n} todos claimed"),
            Held::KeyFull(k, n) => write!(
                f,
                "its queue has max_claimed_per_key {n} todos with concurrency_key {k:?} claimed"
            ),
            Held::Rate(n) => write!(
                f,
                "its queue made claims_per_minute {n} claims within the last minute"
            ),
        }
    }
}

/// Which todos `claim_next` passes over: those of the `queues` (paused, full, or at their rate)
/// and those with a key in `keys` (queue, key), each list sorted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Holds {
    pub queues: Vec<String>,
    pub keys: Vec<(String, String)>,
}

impl Holds {
    /// Whether `claim_next` passes over `t`.
    pub fn holds(&self, t: &Todo) -> bool {
        self.holds_in(&t.queue, t.concurrency_key.as_deref())
    }

    /// Whether `claim_next` passes over the todos of `queue` with `key`.
    pub fn holds_in(&self, queue: &str, key: Option<&str>) -> bool {
        self.queues.iter().any(|q| q == queue)
            || key.is_some_and(|k| self.keys.iter().any(|(q, key)| q == queue && key == k))
    }
}

/// Why `queue` under `l` takes no claim now, whatever the todo: `max_claimed` claimed (less
/// `own`, the claimed todo a takeover would take again) or the window's claims at their rate.
fn queue_held(l: &Limits, load: &Load, queue: &str, own: u32) -> Option<Held> {
    if let Some(m) = l.max_claimed
        && load.claimed_in(queue).saturating_sub(own) >= m
    {
        return Some(Held::Full(m));
    }
    l.claims_per_minute
        .filter(|&m| load.recent_in(queue) >= m)
        .map(Held::Rate)
}

/// The keys of `queue` at its `max_claimed_per_key` under `load`, sorted.
fn keys_held(l: &Limits, load: &Load, queue: &str) -> Vec<String> {
    let Some(m) = l.max_claimed_per_key else {
        return Vec::new();
    };
    load.claimed
        .iter()
        .filter_map(|((q, key), n)| match key {
            Some(k) if q == queue && *n >= m => Some(k.clone()),
            _ => None,
        })
        .collect()
}

/// The holds of `limits` (each queue's, sorted by queue) under `load`, with the `paused` queues
/// held whole.
pub fn holds(limits: &[(String, Limits)], load: &Load, paused: &[String]) -> Holds {
    let mut h = Holds {
        queues: paused.to_vec(),
        keys: Vec::new(),
    };
    for (q, l) in limits {
        if queue_held(l, load, q, 0).is_some() {
            h.queues.push(q.clone());
        }
        h.keys
            .extend(keys_held(l, load, q).into_iter().map(|k| (q.clone(), k)));
    }
    h.queues.sort_unstable();
    h.queues.dedup();
    h.keys.sort_unstable();
    h
}

/// Whether claiming `t` (by id) would break one of its queue's `limits` under `load`; a todo
/// that is claimed already (a takeover of its lapsed lease) does not count against itself.
pub fn held(limits: &Limits, load: &Load, t: &Todo) -> Option<Held> {
    let own = u32::from(t.state == TodoState::Claimed);
    if let Some(h @ Held::Full(_)) = queue_held(limits, load, &t.queue, own) {
        return Some(h);
    }
    if let (Some(m), Some(k)) = (limits.max_claimed_per_key, &t.concurrency_key)
        && load.claimed_with(&t.queue, k).saturating_sub(own) >= m
    {
        return Some(Held::KeyFull(k.clone(), m));
    }
    limits
        .claims_per_minute
        .filter(|&m| load.recent_in(&t.queue) >= m)
        .map(Held::Rate)
}

/// Every queue's limits (sorted by queue), what they hold, and the paused queues.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QueueFlow {
    pub limits: Vec<(String, Limits)>,
    pub load: Load,
    pub paused: Vec<String>,
}

/// One queue's flow as an operator reads it (`relay queue show`, the Board, `/metrics`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QueueLine {
    pub queue: String,
    pub limits: Limits,
    pub paused: bool,
    /// Claimed todos now (counted for the queues with limits only).
    pub claimed: u32,
    /// Claims within the window (counted while the queue has a rate limit).
    pub recent: u32,
    /// Why the queue takes no claim now (full or at its rate), if so.
    pub held: Option<Held>,
    /// The keys at their `max_claimed_per_key`, sorted.
    pub held_keys: Vec<String>,
    /// Waiting todos that would be claimable but for the limits.
    pub held_back: u64,
}

impl QueueLine {
    /// Why the queue holds todos back now, one reason each (none when nothing is held): the
    /// queue full or at its rate, the keys at their limit.
    pub fn reasons(&self) -> Vec<String> {
        let mut why: Vec<String> = self.held.iter().map(ToString::to_string).collect();
        if !self.held_keys.is_empty() {
            let keys: Vec<String> = self.held_keys.iter().map(|k| format!("{k:?}")).collect();
            why.push(format!("keys at max_claimed_per_key: {}", keys.join(", ")));
        }
        why
    }
}

/// The lines of `flow` (a queue with limits or paused, by name). `waiting` counts the limited
/// queues' pending todos that are due, by queue and key; those the limits hold back are the
/// line's `held_back` (a paused queue's are not counted: the pause says why they wait).
pub fn lines(flow: &QueueFlow, waiting: &[(String, Option<String>, u64)]) -> Vec<QueueLine> {
    let limits_only = holds(&flow.limits, &flow.load, &[]);
    let mut held_back: BTreeMap<&str, u64> = BTreeMap::new();
    for (q, key, n) in waiting {
        if limits_only.holds_in(q, key.as_deref()) {
            *held_back.entry(q).or_default() += n;
        }
    }
    let mut out: BTreeMap<&str, QueueLine> = BTreeMap::new();
    for q in &flow.paused {
        out.entry(q).or_default().paused = true;
    }
    for (q, l) in &flow.limits {
        let line = out.entry(q).or_default();
        line.limits = *l;
        line.claimed = flow.load.claimed_in(q);
        line.recent = flow.load.recent_in(q);
        line.held = queue_held(l, &flow.load, q, 0);
        line.held_keys = keys_held(l, &flow.load, q);
        line.held_back = held_back.get(q.as_str()).copied().unwrap_or(0);
    }
    out.into_iter()
        .map(|(q, line)| QueueLine {
            queue: q.to_string(),
            ..line
        })
        .collect()
}

/// Why `t` waits though pending and due: the limit of its queue (in `flow`) that holds it back
/// now. `None` for a todo in any other state, or one that waits for its `run_at`.
pub fn why_held(flow: &QueueFlow, now: Millis, t: &Todo) -> Option<Held> {
    if t.state != TodoState::Pending || t.waits_until(now).is_some() {
        return None;
    }
    let (_, l) = flow.limits.iter().find(|(q, _)| q == &t.queue)?;
    held(l, &flow.load, t)
}

/// Why `concurrency_key` is not one: 1 to [`KEY_MAX_BYTES`] bytes without control characters.
pub fn check_key(key: &str) -> Result<(), String> {
    if key.is_empty() || key.len() > KEY_MAX_BYTES || key.chars().any(char::is_control) {
        return Err(format!(
            "concurrency_key must be 1 to {KEY_MAX_BYTES} bytes without control characters; got \
             {} bytes",
            key.len()
        ));
    }
    Ok(())
}
