//! The daemon's harnesses as one value: each leased harness's relay machine with what the daemon
//! decides around it, without a process, a socket or a clock.
//!
//! A [`Fleet`] holds, per harness, its [`Relay`], its config table, its schedule's next firing
//! ([`Timetable`]), the `catch_up` slot it owes and whether a reload removed it. It answers what
//! the daemon asks between messages: when to wake next ([`Fleet::next_wake`]), which timers and
//! schedules are due ([`Fleet::due`]), the input a firing gives ([`Fleet::firing`]), which lease
//! sources harnesses are bound to ([`Fleet::bound_sources`], [`Fleet::harnesses_on`]), which
//! harnesses a doorbell rings ([`Fleet::rung`]), which doorbell listeners run and what each hears
//! ([`Fleet::doorbells`], [`doorbell_changes`], [`channel_subscriptions`]), what a reload does
//! ([`plan_reload`]: which sources close and open, which harnesses stop, leave, stay or start;
//! [`Fleet::reload`] for one harness) and what happens between attempts ([`Fleet::settle`],
//! [`rebind`]).
//!
//! Time arrives as a [`Now`]: machine timers run on its monotonic reading, schedule firings on
//! its wall reading (as cron does). The daemon (`relay-worker::daemon`) is the shell: it reads
//! the clock, runs the machines' commands and moves the bytes; the simulator fires its harness
//! schedules through the same [`Timetable`], and reloads its hosts' configs through the same
//! [`plan_reload`].

use std::collections::{BTreeMap, BTreeSet};

use crate::config::{Config, ConfigDiff, Harness, Schedule};
use crate::mcp::client::Subscriptions;
use crate::relay::{HarnessSettings, Input, Reconfigured, Relay};
use crate::time::{Millis, Now, Wall};

/// The trigger name of a `catch_up` firing.
pub const CATCH_UP: &str = "catch_up";

/// When a harness's schedule fires next, on the wall clock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Timetable {
    schedule: Option<Schedule>,
    next: Option<Wall>,
}

impl Timetable {
    /// The schedule's first firing strictly after wall time `wall`; never without a schedule.
    pub fn new(schedule: Option<Schedule>, wall: Wall) -> Timetable {
        let next = schedule.as_ref().map(|s| s.next_after(wall));
        Timetable { schedule, next }
    }

    /// A schedule whose first firing is `first` (the simulator spreads its hosts' first
    /// firings over one interval).
    pub fn starting_at(schedule: Schedule, first: Wall) -> Timetable {
        Timetable {
            schedule: Some(schedule),
            next: Some(first),
        }
    }

    /// The next firing, wall time.
    pub fn next(&self) -> Option<Wall> {
        self.next
    }

    /// Whether the schedule fires at wall time `wall`. When it does, the next firing is the
    /// first slot strictly after `wall`: slots missed meanwhile (a suspend, a wall clock stepped
    /// forward) fire once, not one by one.
    pub fn due(&mut self, wall: Wall) -> bool {
        if self.next.is_none_or(|at| at > wall) {
            return false;
        }
        self.next = self.schedule.as_ref().map(|s| s.next_after(wall));
        true
    }

    /// A reload's schedule: an unchanged one keeps its next firing, another one starts after
    /// wall time `wall`.
    pub fn reschedule(&mut self, schedule: Option<Schedule>, wall: Wall) {
        if schedule != self.schedule {
            *self = Timetable::new(schedule, wall);
        }
    }
}

/// One harness of the fleet.
#[derive(Debug)]
pub struct Member {
    relay: Relay,
    harness: Harness,
    timetable: Timetable,
    /// A reload removed the harness: it fires nothing more and goes once its attempt closes.
    removed: bool,
    /// The missed schedule slot `catch_up` fires for, once the source's session is checked.
    catch_up: Option<Wall>,
}

impl Member {
    pub fn relay(&self) -> &Relay {
        &self.relay
    }

    pub fn harness(&self) -> &Harness {
        &self.harness
    }

    pub fn removed(&self) -> bool {
        self.removed
    }

    /// The schedule's next firing, wall time.
    pub fn next_fire(&self) -> Option<Wall> {
        self.timetable.next()
    }
}

/// What is due at a reading of the clocks, harness by harness in name order: a harness's timer
/// before its schedule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Due {
    /// The machine's timer is due: feed it `Input::TimerFired`.
    Timer(String),
    /// The schedule fires the harness: feed it [`Fleet::firing`] with the trigger `schedule`.
    Schedule(String),
}

/// What [`Fleet::settle`] found, between attempts or not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Settled {
    /// An attempt is in flight (or the harness is unknown): nothing changes now.
    Busy,
    /// A removed harness closed its attempt: it has left the fleet.
    Gone,
    /// Between attempts: the machine runs on this lease source (`queue.<name>`) from now on.
    Idle { lease: String },
}

/// What a reload does, decided from the config's diff and the fleet before it ([`plan_reload`]).
/// The shell carries it out in this order: sources, then harnesses.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReloadPlan {
    /// Lease sources (`queue.<name>`) whose client goes: the new config has no such table.
    pub close: Vec<String>,
    /// Lease sources that get a new client and session: added, or kept with a changed url,
    /// headers or credentials.
    pub open: Vec<String>,
    /// Harnesses that run on a source whose session changed: they hear `SessionExpired`, then
    /// the new session's capabilities.
    pub expire: Vec<String>,
    /// Harnesses whose attempt stops as `StopReason::HarnessRemoved`: the harness is gone (or
    /// leases nothing now), or the source its settings name is.
    pub stop: Vec<String>,
    /// Harnesses that leave the fleet once their attempt closes.
    pub remove: Vec<String>,
    /// Harnesses that stay and take the new config's settings: at once when idle, after the
    /// attempt in flight otherwise (the machine keeps it on the settings it started with).
    pub keep: Vec<String>,
    /// Harnesses the fleet did not have: they start.
    pub add: Vec<String>,
}

/// What a reload does. `members` is the fleet before it, each harness with the lease source its
/// settings name; `leased` the harnesses the new config gives settings (a leased harness that is
/// enabled); `diff` what changed between the configs. A harness is stopped when it is removed,
/// leases nothing now, or its source is removed; it leaves the fleet when the new config has no
/// settings for it, and keeps its slot (with new settings) otherwise.
pub fn plan_reload(
    members: &[(String, String)],
    leased: &[String],
    diff: &ConfigDiff,
) -> ReloadPlan {
    let mut plan = ReloadPlan {
        close: diff.queues.removed.clone(),
        open: diff.queues.added.clone(),
        ..ReloadPlan::default()
    };
    for source in &diff.new_sessions {
        if !plan.open.contains(source) {
            plan.open.push(source.clone());
        }
        let on = members.iter().filter(|(_, lease)| lease == source);
        plan.expire.extend(on.map(|(name, _)| name.clone()));
    }
    for (name, lease) in members {
        let kept = leased.contains(name);
        if !kept || diff.aborts(name, lease) {
            plan.stop.push(name.clone());
        }
        if kept {
            plan.keep.push(name.clone());
        } else {
            plan.remove.push(name.clone());
        }
    }
    let known = |n: &String| members.iter().any(|(name, _)| name == n);
    plan.add = leased.iter().filter(|n| !known(n)).cloned().collect();
    plan
}

/// How a harness between attempts follows the source its settings name ([`rebind`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rebind {
    /// It runs on that source's client already.
    Stay,
    /// Same source, a new client (a reload changed its session): bind to it.
    Client,
    /// Another source: bind to it, and tell the machine what that source answered, if it has.
    Moved,
}

/// Between attempts: a harness bound to `bound` (a source and its client's generation) whose
/// settings name `want` (the same).
pub fn rebind(bound: (&str, u64), want: (&str, u64)) -> Rebind {
    if bound.0 != want.0 {
        Rebind::Moved
    } else if bound.1 != want.1 {
        Rebind::Client
    } else {
        Rebind::Stay
    }
}

/// Which doorbell listeners change: those `listening` now that are no longer `wanted`, whose
/// subscriptions differ, or whose channel (`channel.<name>`) the reload's `diff` changed stop;
/// every wanted one not left listening starts, with its subscriptions.
pub fn doorbell_changes(
    listening: &BTreeMap<String, Subscriptions>,
    wanted: BTreeMap<String, Subscriptions>,
    diff: &ConfigDiff,
) -> (Vec<String>, Vec<(String, Subscriptions)>) {
    let changed = |name: &str| {
        let reference = format!("channel.{name}");
        diff.channels.changed.contains(&reference)
    };
    let stop: Vec<String> = listening
        .iter()
        .filter(|(n, subs)| wanted.get(*n) != Some(*subs) || changed(n))
        .map(|(n, _)| n.clone())
        .collect();
    let start = wanted
        .into_iter()
        .filter(|(n, _)| !listening.contains_key(n) || stop.contains(n))
        .collect();
    (stop, start)
}

/// The daemon's harnesses, by name.
#[derive(Debug, Default)]
pub struct Fleet {
    members: BTreeMap<String, Member>,
    stopping: bool,
}

impl Fleet {
    /// Adds a harness at wall time `wall`: its machine starts at run id `first_run_id`, with a
    /// jitter stream of its own drawn from the daemon's `seed`.
    pub fn add(
        &mut self,
        harness: Harness,
        settings: HarnessSettings,
        seed: u64,
        first_run_id: u64,
        wall: Wall,
    ) {
        let seed = seed ^ crate::mix::fnv1a(harness.name.as_bytes());
        let member = Member {
            relay: Relay::new(settings, seed, first_run_id),
            timetable: Timetable::new(harness.schedule.clone(), wall),
            harness,
            removed: false,
            catch_up: None,
        };
        self.members.insert(member.harness.name.clone(), member);
    }

    pub fn get(&self, name: &str) -> Option<&Member> {
        self.members.get(name)
    }

    pub fn relay_mut(&mut self, name: &str) -> Option<&mut Relay> {
        self.members.get_mut(name).map(|m| &mut m.relay)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.members.contains_key(name)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&String, &Member)> {
        self.members.iter()
    }

    pub fn names(&self) -> Vec<String> {
        self.members.keys().cloned().collect()
    }

    /// Whether `name` runs and may fire: known and not removed by a reload.
    pub fn running(&self, name: &str) -> bool {
        self.members.get(name).is_some_and(|m| !m.removed)
    }

    /// The daemon is stopping: nothing fires any more.
    pub fn stop(&mut self) {
        self.stopping = true;
    }

    pub fn stopping(&self) -> bool {
        self.stopping
    }

    /// Stopping, and no attempt is in flight: the daemon may exit.
    pub fn stopped(&self) -> bool {
        self.stopping && self.members.values().all(|m| !m.relay.in_flight())
    }

    /// Whether `name` may owe a `catch_up` (the daemon reads its newest run to find out).
    pub fn catches_up(&self, name: &str) -> bool {
        self.members.get(name).is_some_and(|m| m.harness.catch_up)
    }

    /// At daemon start: the schedule slot passed since `last_run_started` (the harness's newest
    /// run) that `catch_up` fires once its source's session is checked (a firing before that
    /// would only be skipped as unsupported).
    pub fn owe_catch_up(
        &mut self,
        name: &str,
        last_run_started: Option<Wall>,
        wall: Wall,
    ) -> Option<Wall> {
        let m = self.members.get_mut(name)?;
        m.catch_up = m.harness.catch_up_slot(last_run_started, wall);
        m.catch_up
    }

    /// The harness's source answered its capabilities: whether the `catch_up` it owes fires now
    /// (once).
    pub fn take_catch_up(&mut self, name: &str) -> bool {
        let stopping = self.stopping;
        self.members
            .get_mut(name)
            .filter(|m| !stopping && !m.removed)
            .is_some_and(|m| m.catch_up.take().is_some())
    }

    /// The input a firing by `trigger` at wall time `wall` gives a running harness: operating
    /// hours are read on the wall clock.
    pub fn firing(&self, name: &str, trigger: &str, wall: Wall) -> Option<Input> {
        let m = self.members.get(name).filter(|m| !m.removed)?;
        Some(Input::Firing {
            trigger: trigger.to_string(),
            within_hours: m.harness.within_hours(wall),
        })
    }

    /// The sources a harness is bound to, or will be after its attempt, sorted.
    pub fn bound_sources(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .members
            .values()
            .filter(|m| !m.removed)
            .map(|m| m.relay.settings().lease.clone())
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// The harnesses whose machines run on `source` (their settings name it).
    pub fn harnesses_on(&self, source: &str) -> Vec<String> {
        self.members
            .iter()
            .filter(|(_, m)| m.relay.settings().lease == source)
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// The running harnesses that the channel `channel` (without `channel.`) triggers.
    pub fn rung(&self, channel: &str) -> Vec<String> {
        self.members
            .iter()
            .filter(|(_, m)| !m.removed && m.harness.triggers.iter().any(|t| t == channel))
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// Each harness with the lease source its settings name (a reload's `members`).
    pub fn leases(&self) -> Vec<(String, String)> {
        let lease = |m: &Member| m.relay.settings().lease.clone();
        self.members
            .iter()
            .map(|(n, m)| (n.clone(), lease(m)))
            .collect()
    }

    /// [`plan_reload`] for this fleet.
    pub fn plan_reload(&self, leased: &[String], diff: &ConfigDiff) -> ReloadPlan {
        plan_reload(&self.leases(), leased, diff)
    }

    /// The bound sources whose session is not known yet (`unverified` says which): the shell
    /// initializes them, at start and after a reload.
    pub fn to_initialize(&self, unverified: impl Fn(&str) -> bool) -> Vec<String> {
        let mut out = self.bound_sources();
        out.retain(|s| unverified(s));
        out
    }

    /// The doorbell channels the fleet listens on, with the queues each subscribes to: every
    /// enabled channel of `config` that triggers a running harness.
    pub fn doorbells(&self, config: &Config) -> BTreeMap<String, Subscriptions> {
        config
            .channels
            .values()
            .filter(|ch| ch.enabled && !self.rung(&ch.name).is_empty())
            .map(|ch| (ch.name.clone(), channel_subscriptions(config, &ch.name)))
            .collect()
    }

    /// How long, in milliseconds from `now`, until the earliest machine timer (monotonic) or
    /// schedule firing (wall); `None` when nothing is set.
    pub fn next_wake(&self, now: Now) -> Option<Millis> {
        let timers = self.members.values().filter_map(|m| {
            let (at, _) = m.relay.poll_timeout()?;
            Some(at.since(now.mono))
        });
        let fires = self
            .members
            .values()
            .filter(|m| !self.stopping && !m.removed)
            .filter_map(|m| Some(m.timetable.next()?.since(now.wall)));
        timers.chain(fires).min()
    }

    /// What is due at `now`; each schedule that fires moves on to its next slot.
    pub fn due(&mut self, now: Now) -> Vec<Due> {
        let mut due = Vec::new();
        for (name, m) in &mut self.members {
            if m.relay.poll_timeout().is_some_and(|(at, _)| at <= now.mono) {
                due.push(Due::Timer(name.clone()));
            }
            if !self.stopping && !m.removed && m.timetable.due(now.wall) {
                due.push(Due::Schedule(name.clone()));
            }
        }
        due
    }

    /// A reload's news for one harness: `None` removes it (it goes once its attempt closes);
    /// otherwise its new settings (which wait for an attempt in flight) and table (a changed
    /// schedule starts again from wall time `wall`). What the machine did with the settings.
    pub fn reload(
        &mut self,
        name: &str,
        new: Option<(HarnessSettings, Option<Harness>)>,
        wall: Wall,
    ) -> Option<Reconfigured> {
        let m = self.members.get_mut(name)?;
        let Some((settings, harness)) = new else {
            m.removed = true;
            return None;
        };
        m.removed = false;
        let applies = m.relay.reconfigure(settings);
        if let Some(h) = harness {
            m.timetable.reschedule(h.schedule.clone(), wall);
            m.harness = h;
        }
        Some(applies)
    }

    /// Between attempts: a removed harness leaves the fleet; any other runs on the source its
    /// settings name.
    pub fn settle(&mut self, name: &str) -> Settled {
        let Some(m) = self.members.get(name) else {
            return Settled::Busy;
        };
        if m.relay.in_flight() {
            return Settled::Busy;
        }
        if m.removed {
            self.members.remove(name);
            return Settled::Gone;
        }
        Settled::Idle {
            lease: m.relay.settings().lease.clone(),
        }
    }
}

/// What `[channel.<name>]` should hear in the modern era: the queues its harnesses claim from.
/// A harness triggered by the channel leases from a `[queue.<source>]` whose `queue` key names
/// one queue; if every triggered harness does, the listener subscribes to those names (a ring
/// for another queue would fire a harness that cannot claim it). A triggered harness that
/// claims from every granted queue (no `queue` key), or that leases nothing, needs every ring:
/// then [`Subscriptions::Granted`]. Channels name no queues of their own, so that one key
/// decides both where a harness claims and what wakes it.
pub fn channel_subscriptions(config: &Config, channel: &str) -> Subscriptions {
    let mut queues = BTreeSet::new();
    let triggered = config
        .harnesses
        .values()
        .filter(|h| h.enabled && h.triggers.iter().any(|t| t == channel));
    for h in triggered {
        let named = h
            .relay
            .as_ref()
            .and_then(|r| config.queues.get(&r.lease))
            .and_then(|q| q.queue.clone());
        match named {
            Some(q) => {
                queues.insert(q);
            }
            None => return Subscriptions::Granted,
        }
    }
    if queues.is_empty() {
        return Subscriptions::Granted;
    }
    Subscriptions::Queues(queues)
}

#[cfg(test)]
mod tests;
