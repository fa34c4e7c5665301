//! What a run looks like, drawn from its seed and printed at its start.
//!
//! "Swarm" testing: each seed switches whole fault kinds off, so that some runs are dominated by
//! one kind of trouble and the combinations vary from seed to seed.

use std::fmt;

use serde::{Deserialize, Serialize};

use relay_core::time::{HOUR, MINUTE, Millis, SECOND};

use crate::rng::Rng;

/// A deliberate bug, to prove that the invariants catch it (the simulator's canaries).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mutation {
    /// The relay driver treats a heartbeat `conflict`/`not_found` as success.
    IgnoreHeartbeatConflict,
    /// The server accepts heartbeats and reports without comparing the fence.
    ServerSkipsFence,
    /// The relay driver holds every report back until its lease deadline has passed.
    ReportAfterDeadline,
    /// The reaper closes each reaped attempt a second time.
    ReaperClosesTwice,
    /// The relay driver hands the machine its wall clock as the monotonic one: every deadline
    /// moves with a wall-clock step.
    DeadlinesOnWallClock,
}

relay_core::names!(Mutation {
    IgnoreHeartbeatConflict => "ignore-heartbeat-conflict",
    ServerSkipsFence => "server-skips-fence",
    ReportAfterDeadline => "report-after-deadline",
    ReaperClosesTwice => "reaper-closes-twice",
    DeadlinesOnWallClock => "deadlines-on-wall-clock",
});

/// Fault kinds; each is on or off for a whole run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Faults {
    /// Per mille of requests lost before they reach the server.
    pub request_loss: u32,
    /// Per mille of answers lost after the server applied the request.
    pub response_loss: u32,
    /// Per mille of requests delivered twice.
    pub duplicate: u32,
    /// Extra one-way delay, up to this many ms (0: a fixed 1–20 ms).
    pub delay_max: Millis,
    pub partitions: bool,
    pub outages: bool,
    pub crashes: bool,
    /// Host pauses longer than the lease: a stale worker waking up.
    pub pauses: bool,
    /// Relay clocks (monotonic and wall, each its own rate) that run fast or slow within the
    /// bound below.
    pub clock_drift: bool,
    /// Relay wall clocks that step back and forward.
    pub wall_steps: bool,
    /// Operators cancelling and retrying todos.
    pub operators: bool,
}

impl Faults {
    /// Every kind on; a rate the seed left at 0 takes a middling value.
    fn all_on(self) -> Faults {
        let or = |drawn: u32, dflt| if drawn == 0 { dflt } else { drawn };
        Faults {
            request_loss: or(self.request_loss, 50),
            response_loss: or(self.response_loss, 50),
            duplicate: or(self.duplicate, 30),
            delay_max: if self.delay_max == 0 {
                1_000
            } else {
                self.delay_max
            },
            partitions: true,
            outages: true,
            crashes: true,
            pauses: true,
            clock_drift: true,
            wall_steps: true,
            operators: true,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Options {
    pub seed: u64,
    pub relays: usize,
    pub todos: usize,
    pub max_attempts: u32,
    pub lease_ttl: Millis,
    pub heartbeat_interval: Millis,
    pub fire_every: Millis,
    pub reaper_every: Millis,
    pub requeue_every: Millis,
    /// Agent run times are drawn up to this.
    pub agent_max: Millis,
    pub agent_timeout: Option<Millis>,
    pub check: bool,
    pub check_before: bool,
    pub receipts: bool,
    pub release_granted: bool,
    /// How long faults are injected before everything heals.
    pub safety: Millis,
    /// How long after healing every todo must be finished.
    pub liveness_bound: Millis,
    pub faults: Faults,
    pub mutation: Option<Mutation>,
    /// Each relay's operating hours, as config writes them (empty: none). Firings outside them
    /// are skipped or held as the daemon's are.
    pub hours: Vec<Vec<String>>,
}

/// Relay clocks drift at most this much (parts per million). The lease argument holds within
/// `lease_ttl × MAX_DRIFT_PPM / 1e6`; the two-holder check allows exactly that.
/// What a sweep may force on every seed's drawn options (`relay sim --relays --todos
/// --duration`); `None` keeps the drawn value.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Shape {
    pub relays: Option<usize>,
    pub todos: Option<usize>,
    /// The faulted (safety) phase's length; the healed phase follows it.
    pub safety: Option<Millis>,
    /// Every fault kind on, whatever the seed drew.
    pub all_faults: bool,
}

pub const MAX_DRIFT_PPM: i64 = 2_000;

impl Options {
    pub fn draw(seed: u64, mutation: Option<Mutation>) -> Options {
        let mut r = Rng::stream(seed, "options");
        let lease_ttl = r.range(1, 5) * MINUTE;
        let heartbeat_interval = lease_ttl / r.range(3, 5);
        let on = |r: &mut Rng, per_mille| r.chance(per_mille);
        let faults = Faults {
            request_loss: if on(&mut r, 600) {
                r.range(5, 150) as u32
            } else {
                0
            },
            response_loss: if on(&mut r, 600) {
                r.range(5, 150) as u32
            } else {
                0
            },
            duplicate: if on(&mut r, 400) {
                r.range(5, 100) as u32
            } else {
                0
            },
            delay_max: if on(&mut r, 500) {
                r.range(50, 3_000)
            } else {
                0
            },
            partitions: on(&mut r, 500),
            outages: on(&mut r, 400),
            crashes: on(&mut r, 400),
            pauses: on(&mut r, 350),
            clock_drift: on(&mut r, 500),
            wall_steps: on(&mut r, 400),
            operators: on(&mut r, 400),
        };
        let check = on(&mut r, 600);
        Options {
            seed,
            relays: r.range(1, 5) as usize,
            todos: r.range(3, 30) as usize,
            max_attempts: r.range(1, 5) as u32,
            lease_ttl,
            heartbeat_interval,
            fire_every: r.range(20, 300) * SECOND,
            reaper_every: r.range(5, 60) * SECOND,
            requeue_every: r.range(5, 60) * SECOND,
            agent_max: r.range(1, 30) * MINUTE,
            agent_timeout: on(&mut r, 300).then(|| r.range(2, 20) * MINUTE),
            check,
            check_before: check && on(&mut r, 400),
            receipts: on(&mut r, 300),
            release_granted: on(&mut r, 700),
            safety: r.range(1, 4) * HOUR,
            liveness_bound: 0,
            faults,
            mutation,
            hours: Vec::new(),
        }
        .with_hours(seed)
    }

    /// [`Options::draw`], then the parts of the shape that `shape` forces (the hours are drawn
    /// again for the forced number of relays).
    pub fn draw_shaped(seed: u64, mutation: Option<Mutation>, shape: Shape) -> Options {
        let mut o = Options::draw(seed, mutation);
        if shape == Shape::default() {
            return o;
        }
        if let Some(n) = shape.relays {
            o.relays = n.max(1);
        }
        if let Some(n) = shape.todos {
            o.todos = n;
        }
        if let Some(d) = shape.safety {
            o.safety = d.max(MINUTE);
        }
        if shape.all_faults {
            o.faults = o.faults.all_on();
        }
        o.with_hours(seed)
    }

    /// Draws each relay's operating hours from their own stream (the other options stay as the
    /// seed drew them before hours existed): for some relays, the first `on` minutes of every
    /// hour at a drawn UTC offset, so that firings fall outside the hours often while no relay
    /// waits long enough to starve the liveness phase. Then sets the liveness bound from them.
    fn with_hours(mut self, seed: u64) -> Options {
        let mut r = Rng::stream(seed, "hours");
        let mut minutes_open = Vec::new();
        self.hours = (0..self.relays)
            .map(|_| {
                if !r.chance(400) {
                    minutes_open.push(60);
                    return Vec::new();
                }
                let on = r.range(10, 50);
                minutes_open.push(on);
                let offset = r.range(0, 14 * 4) * 15;
                let zone = format!("+{:02}:{:02}", offset / 60, offset % 60);
                (0..24)
                    .map(|h| format!("{h:02}:00-{h:02}:{on:02} {zone}"))
                    .collect()
            })
            .collect();
        self.liveness_bound = self.liveness_bound_for(&minutes_open);
        self
    }

    /// How long after healing every todo must have ended: a day, or longer when the relays
    /// cannot get through the work in a day even in the worst case (every attempt of every todo
    /// running to its timeout, each relay working only the minutes an hour it is open). Seed
    /// 1355 drew one relay open 27 minutes an hour for 27 todos of up to 5 attempts of 8 minutes:
    /// about 76 hours of work, which a fixed day reported as a liveness failure.
    fn liveness_bound_for(&self, minutes_open: &[u64]) -> Millis {
        let attempt =
            self.agent_timeout.unwrap_or(self.agent_max) + self.fire_every + self.lease_ttl;
        let work = attempt * self.todos as u64 * u64::from(self.max_attempts);
        let open_minutes_an_hour: u64 = minutes_open.iter().sum();
        (work * 60 / open_minutes_an_hour.max(1)).max(24 * HOUR)
    }
}

impl fmt::Display for Options {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = |ms: Millis| relay_core::config::format_duration(ms);
        let fl = &self.faults;
        write!(
            f,
            "relays={} todos={} max_attempts={} lease_ttl={} heartbeat={} fire_every={} \
             agent_max={} timeout={} check={} check_before={} receipts={} release={} safety={} \
             liveness={}",
            self.relays,
            self.todos,
            self.max_attempts,
            s(self.lease_ttl),
            s(self.heartbeat_interval),
            s(self.fire_every),
            s(self.agent_max),
            self.agent_timeout.map_or("none".into(), s),
            self.check,
            self.check_before,
            self.receipts,
            self.release_granted,
            s(self.safety),
            s(self.liveness_bound),
        )?;
        write!(
            f,
            "\nfaults: request_loss={}‰ response_loss={}‰ duplicate={}‰ delay_max={}ms \
             partitions={} outages={} crashes={} pauses={} clock_drift={} wall_steps={} \
             operators={}",
            fl.request_loss,
            fl.response_loss,
            fl.duplicate,
            fl.delay_max,
            fl.partitions,
            fl.outages,
            fl.crashes,
            fl.pauses,
            fl.clock_drift,
            fl.wall_steps,
            fl.operators
        )?;
        for (r, hours) in self.hours.iter().enumerate() {
            if let Some(first) = hours.first() {
                write!(f, "\nhours of relay {r}: {first}, … (every hour)")?;
            }
        }
        if let Some(m) = self.mutation {
            write!(f, "\nmutation: {}", m.as_str())?;
        }
        Ok(())
    }
}
