//! A host's clocks: wall and monotonic, each with its own offset and drift.

use std::collections::{BTreeMap, BTreeSet};
use std::marker::PhantomData;

use relay_core::relay::{Relay, RequestId, RunRecord};
use relay_core::time::{Millis, Mono, Now, Wall};

use crate::options::Mutation;

use relay_core::relay::invariants::Monitor;

use super::*;

/// What a host clock reads: [`Mono`] or [`Wall`] instants, which it makes from and reads as
/// milliseconds (the only place the simulator does).
pub(super) trait Reading: Copy {
    fn from_ms(ms: Millis) -> Self;
    fn ms(self) -> Millis;
}

impl Reading for Mono {
    fn from_ms(ms: Millis) -> Mono {
        Mono::from_ms(ms)
    }
    fn ms(self) -> Millis {
        Mono::ms(self)
    }
}

impl Reading for Wall {
    fn from_ms(ms: Millis) -> Wall {
        Wall::from_ms(ms)
    }
    fn ms(self) -> Millis {
        Wall::ms(self)
    }
}

/// One clock of a host, reading instants of type `R`: it reads `global + offset`, running fast
/// or slow by `drift_ppm`.
#[derive(Clone, Copy, Debug)]
pub(super) struct HostClock<R> {
    pub(super) offset: i64,
    pub(super) drift_ppm: i64,
    reads: PhantomData<R>,
}

impl<R: Reading> HostClock<R> {
    pub(super) fn new(offset: i64, drift_ppm: i64) -> HostClock<R> {
        HostClock {
            offset,
            drift_ppm,
            reads: PhantomData,
        }
    }

    pub(super) fn read(&self, global: Millis) -> R {
        let g = global as i128;
        let drift = (g - T0 as i128) * self.drift_ppm as i128 / 1_000_000;
        R::from_ms((g + self.offset as i128 + drift).max(0) as Millis)
    }

    /// Sets the clock so that it reads `local` at `global`.
    pub(super) fn set(&mut self, global: Millis, local: R) {
        let g = global as i128;
        let drift = (g - T0 as i128) * self.drift_ppm as i128 / 1_000_000;
        self.offset = (local.ms() as i128 - g - drift) as i64;
    }

    /// The global instant at which this clock reads `local` (the inverse of `read`).
    pub(super) fn when(&self, local: R) -> Millis {
        let l = local.ms() as i128 - self.offset as i128;
        let g = (l * 1_000_000 + T0 as i128 * self.drift_ppm as i128)
            / (1_000_000 + self.drift_ppm as i128);
        g.max(0) as Millis
    }
}

pub(super) struct Host {
    pub(super) relay: Option<Relay>,
    /// Bumped at every restart; events of an old lifetime are dropped.
    pub(super) life: u32,
    /// The monotonic clock: it drifts, it runs on through a pause (it counts suspended time),
    /// it never steps; a reboot starts it again from a small number.
    pub(super) mono: HostClock<Mono>,
    /// The wall clock: it drifts on its own and steps either way ([`Fault::WallStep`]).
    pub(super) wall: HostClock<Wall>,
    pub(super) timer_gen: u64,
    pub(super) proc: Option<Proc>,
    pub(super) check: Option<(u64, u64)>,
    pub(super) proc_gen: u64,
    /// Survives crashes: the run journal and the run-id counter.
    pub(super) journal: BTreeMap<u64, RunRecord>,
    pub(super) next_run_id: u64,
    pub(super) runs: BTreeMap<u64, Run>,
    pub(super) pending: BTreeMap<RequestId, Pending>,
    pub(super) partitioned: bool,
    pub(super) paused: bool,
    pub(super) deferred: Vec<Ev>,
    /// The machine's invariants, over every life of the host (run ids go on across restarts).
    pub(super) monitor: Monitor,
    /// The harness's operating hours (`None`: always within).
    pub(super) hours: Option<relay_core::config::OperatingHours>,
    /// Runs whose heartbeat the server refused (conflict or not_found), as delivered.
    pub(super) refused: BTreeSet<u64>,
    /// What the host's config file says now (a reload changes it; a restart reads it).
    pub(super) config: HostConfig,
    /// Names the live chain of the schedule's ticks: a reload that moves the next firing starts
    /// a new chain, and the old one's ticks are dropped.
    pub(super) tick_gen: u64,
    /// A reload's settings wait for the attempt in flight.
    pub(super) reload_waiting: bool,
}

/// The settings of a host's config file that a reload changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct HostConfig {
    pub(super) heartbeat_interval: Millis,
    /// The harness's schedule: `@every fire_every`.
    pub(super) fire_every: Millis,
}

impl Host {
    /// The clock the driver hands the machine as monotonic: the wall clock under the canary
    /// that puts deadlines on wall time (its readings passed off as monotonic ones).
    pub(super) fn machine_clock(&self, mutation: Option<Mutation>) -> HostClock<Mono> {
        if mutation == Some(Mutation::DeadlinesOnWallClock) {
            HostClock::new(self.wall.offset, self.wall.drift_ppm)
        } else {
            self.mono
        }
    }

    /// What the machine is told the time is, at `global`.
    pub(super) fn now(&self, global: Millis, mutation: Option<Mutation>) -> Now {
        Now {
            mono: self.machine_clock(mutation).read(global),
            wall: self.wall.read(global),
        }
    }
}
