//! The explicit schedule of a run: which todos are added when, what operators do, and which
//! faults strike when. Drawn from the seed, but a plain value: a failing run's plan can be
//! printed, edited, and shrunk by removing fault events while the same violation recurs.

use serde::{Deserialize, Serialize};

use relay_core::ledger::flow::Limits;
use relay_core::time::{MINUTE, Millis, SECOND};

use crate::options::{Flow, Options};
use crate::rng::Rng;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fault {
    /// One relay's host cannot reach the server (both directions) for `len`.
    Partition { relay: usize, len: Millis },
    /// The server answers nothing for `len`.
    Outage { len: Millis },
    /// The relay's host dies (its processes with it) and comes back after `down`.
    Crash { relay: usize, down: Millis },
    /// The relay's host freezes for `len` (a VM pause): nothing on it runs, and both its
    /// clocks jump forward by `len` when it wakes.
    Pause { relay: usize, len: Millis },
    /// The relay's wall clock steps by `by` ms, back or forward (an NTP correction, a VM
    /// restore, `date -s`); its monotonic clock does not move.
    WallStep { relay: usize, by: i64 },
    /// The relay host's config is reloaded (SIGHUP) with a new heartbeat interval and schedule
    /// (`@every fire_every`): the fleet's reload plan applies, and an attempt in flight keeps
    /// the settings it started with until it settles.
    Reload {
        relay: usize,
        heartbeat_interval: Millis,
        fire_every: Millis,
    },
}

impl Fault {
    pub fn kind(&self) -> &'static str {
        match self {
            Fault::Partition { .. } => "partition",
            Fault::Outage { .. } => "outage",
            Fault::Crash { .. } => "crash",
            Fault::Pause { .. } => "pause",
            Fault::WallStep { .. } => "wall_step",
            Fault::Reload { .. } => "reload",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Work {
    /// Add todo number `n`.
    Add(usize),
    /// An operator cancels todo number `n` (if it is not finished).
    Cancel(usize),
    /// An operator retries todo number `n` (if it failed or was canceled).
    Retry(usize),
    /// A task client adds task number `n` (an MCP task), then polls it until it ends.
    Task(usize),
    /// An operator cancels task number `n`'s todo (refused once the task has ended).
    CancelTask(usize),
    /// An operator retries task number `n`'s todo (refused once the task has ended).
    RetryTask(usize),
    /// An operator sets a queue's limits, all three at once (no limit set lifts them all).
    Limits { queue: String, limits: Limits },
}

/// Everything scheduled, as offsets from the start of the run.
#[derive(Clone, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Plan {
    pub work: Vec<(Millis, Work)>,
    pub faults: Vec<(Millis, Fault)>,
}

impl Plan {
    pub fn draw(o: &Options) -> Plan {
        let mut w = Rng::stream(o.seed, "workload");
        let mut p = Rng::stream(o.seed, "plan");
        let mut plan = Plan::default();
        // Todos arrive over the first half of the safety phase, some all at once.
        for n in 0..o.todos {
            let at = if w.chance(300) {
                0
            } else {
                w.below(o.safety / 2)
            };
            plan.work.push((at, Work::Add(n)));
        }
        if o.faults.operators {
            for _ in 0..w.range(1, 4) {
                let at = w.below(o.safety);
                let n = w.below(o.todos as u64) as usize;
                let op = if w.chance(500) {
                    Work::Cancel(n)
                } else {
                    Work::Retry(n)
                };
                plan.work.push((at, op));
            }
        }
        let f = &o.faults;
        let relay = |p: &mut Rng| p.below(o.relays as u64) as usize;
        let count = |p: &mut Rng| p.range(1, 1 + o.safety / (30 * MINUTE));
        // When a fault of one relay starts, then which relay: drawn in this order after the
        // fault's own size, so that a seed keeps drawing the plan it always drew.
        let at_relay = |p: &mut Rng| (p.below(o.safety), relay(p));
        if f.partitions {
            for _ in 0..count(&mut p) {
                let len = p.range(5 * SECOND, 3 * o.lease_ttl);
                let (at, relay) = at_relay(&mut p);
                plan.faults.push((at, Fault::Partition { relay, len }));
            }
        }
        if f.outages {
            for _ in 0..count(&mut p) {
                let len = p.range(2 * SECOND, 2 * o.lease_ttl);
                plan.faults.push((p.below(o.safety), Fault::Outage { len }));
            }
        }
        if f.crashes {
            for _ in 0..count(&mut p) {
                let down = p.range(SECOND, 2 * o.lease_ttl);
                let (at, relay) = at_relay(&mut p);
                plan.faults.push((at, Fault::Crash { relay, down }));
            }
        }
        if f.pauses {
            for _ in 0..count(&mut p) {
                // Longer than the lease: the worker wakes up stale.
                let len = p.range(o.lease_ttl + SECOND, 3 * o.lease_ttl);
                let (at, relay) = at_relay(&mut p);
                plan.faults.push((at, Fault::Pause { relay, len }));
            }
        }
        if f.wall_steps {
            for _ in 0..count(&mut p) {
                // Up to twice the lease either way: back far enough that a deadline on the wall
                // clock would keep an agent running long after another took its todo over.
                let by = p.range(SECOND, 2 * o.lease_ttl) as i64;
                let by = if p.chance(600) { -by } else { by };
                let (at, relay) = at_relay(&mut p);
                plan.faults.push((at, Fault::WallStep { relay, by }));
            }
        }
        // Reloads, from a stream of their own: a heartbeat interval of a fifth to a third of the
        // lease, a schedule as the options draw one.
        let mut c = Rng::stream(o.seed, "reload-plan");
        if f.reloads {
            for _ in 0..c.range(1, 1 + o.safety / (30 * MINUTE)) {
                let heartbeat_interval = o.lease_ttl / c.range(3, 5);
                let fire_every = c.range(20, 300) * SECOND;
                let at = c.below(o.safety);
                let relay = c.below(o.relays as u64) as usize;
                let reload = Fault::Reload {
                    relay,
                    heartbeat_interval,
                    fire_every,
                };
                plan.faults.push((at, reload));
            }
        }
        // Tasks arrive like todos, from a stream of their own (the plans drawn before tasks
        // existed are unchanged but for them).
        let mut t = Rng::stream(o.seed, "task-plan");
        for n in 0..o.tasks.count {
            let at = if t.chance(200) {
                0
            } else {
                t.below(o.safety / 2)
            };
            plan.work.push((at, Work::Task(n)));
            // Where operators act, now and then on a task, some while after it arrived.
            if o.faults.operators && t.chance(500) {
                let when = at + t.below(o.safety - at);
                let op = if t.chance(500) {
                    Work::CancelTask(n)
                } else {
                    Work::RetryTask(n)
                };
                plan.work.push((when, op));
            }
        }
        // Operators change queues' limits, from a stream of their own, during the faulted phase.
        let mut l = Rng::stream(o.seed, "flow-plan");
        if o.flow.changes && !o.flow.queues.is_empty() {
            for _ in 0..l.range(1, 3) {
                let at = l.below(o.safety);
                let q = l.below(o.flow.queues.len() as u64) as usize;
                let queue = o.flow.queues[q].0.clone();
                let limits = Flow::draw_limits(&mut l);
                plan.work.push((at, Work::Limits { queue, limits }));
            }
        }
        plan.work.sort_by_key(|(at, _)| *at);
        plan.faults.sort_by_key(|(at, _)| *at);
        plan
    }
}
