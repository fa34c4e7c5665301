//! relay-sim: the deterministic discrete-event simulator.
//!
//! It drives the real relay-core machines — the [`Ledger`](relay_core::ledger::Ledger) as the
//! queue server, with its reaper and retry requeue on their own timers, and one
//! [`Relay`](relay_core::relay::Relay) per simulated host — over a simulated network and clock.
//! A seed draws the options (how many relays and todos, lease lengths, which fault kinds are on
//! at all) and a [`Plan`] (when todos arrive, when partitions, outages, crashes, pauses and clock
//! jumps strike). Messages are lost, duplicated and delayed by a network stream of the seed.
//!
//! A run has two phases, as in the best simulators: a safety phase with faults on, then
//! everything heals and every todo must end done, dead-lettered or canceled within a bound.
//! After every event every invariant is checked (see [`world`]); the first violation ends the
//! run, saying whether it broke correctness or liveness, at which step, and how to replay it.
//!
//! It never uses async, threads, wall-clock time or unseeded randomness: the same seed gives
//! the same run, event for event, and the same trace hash.

pub mod options;
pub mod plan;
pub mod rng;
pub mod world;

pub use options::{Mutation, Options, Shape};
pub use plan::{Fault, Plan, Work};
pub use world::{Kind, RunResult, Violation};

/// Runs one seed with its drawn options and plan.
pub fn run_seed(seed: u64, mutation: Option<Mutation>) -> (Options, Plan, RunResult) {
    let options = Options::draw(seed, mutation);
    let plan = Plan::draw(&options);
    let result = run_plan(&options, &plan);
    (options, plan, result)
}

/// Runs an explicit plan (for replaying and shrinking a saved failure).
pub fn run_plan(options: &Options, plan: &Plan) -> RunResult {
    world::World::new(options.clone(), plan).run()
}

/// [`run_plan`], printing every event and command to stderr.
pub fn run_plan_traced(options: &Options, plan: &Plan) -> RunResult {
    let mut w = world::World::new(options.clone(), plan);
    w.trace = true;
    w.run()
}

/// A run written down: its options and its explicit plan, as `relay sim --save-plan` writes
/// and `relay sim --plan` replays (JSON; edit it by hand to try a variation).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SavedRun {
    pub options: Options,
    pub plan: Plan,
}

/// Removes fault events from a failing plan, one at a time, while the same invariant still
/// breaks; returns the smallest plan found.
pub fn shrink(options: &Options, plan: &Plan, invariant: &str) -> Plan {
    let mut best = plan.clone();
    let mut i = 0;
    while i < best.faults.len() {
        let mut candidate = best.clone();
        candidate.faults.remove(i);
        let r = run_plan(options, &candidate);
        if r.violation
            .as_ref()
            .is_some_and(|v| v.invariant == invariant)
        {
            best = candidate;
        } else {
            i += 1;
        }
    }
    best
}

/// A whole run decoded from bytes, for the `sim_scenario` fuzz target: the first eight bytes
/// are the seed, and every further four bytes add a fault to the drawn plan (when, which kind,
/// where, how long). Runs are kept short (at most 30 minutes of faults, 6 todos) so that a
/// fuzzer gets through many of them.
pub fn scenario_from_bytes(data: &[u8]) -> (Options, Plan) {
    use relay_core::time::{MINUTE, SECOND};
    let mut seed = [0u8; 8];
    for (i, b) in data.iter().take(8).enumerate() {
        seed[i] = *b;
    }
    let mut options = Options::draw(u64::from_le_bytes(seed), None);
    options.safety = options.safety.min(30 * MINUTE);
    options.todos = options.todos.min(6);
    let mut plan = Plan::draw(&options);
    plan.work.retain(|(at, _)| *at < options.safety);
    plan.faults.retain(|(at, _)| *at < options.safety);
    for chunk in data.get(8..).unwrap_or_default().chunks_exact(4) {
        let at = u64::from(chunk[0]) * options.safety / 256;
        let relay = usize::from(chunk[2]) % options.relays;
        let len = (u64::from(chunk[3]) + 1) * 5 * SECOND;
        let fault = match chunk[1] % 6 {
            0 => Fault::Partition { relay, len },
            1 => Fault::Outage { len },
            2 => Fault::Crash { relay, down: len },
            3 => Fault::Pause { relay, len },
            4 => Fault::WallStep {
                relay,
                by: len as i64,
            },
            _ => Fault::WallStep {
                relay,
                by: -(len as i64),
            },
        };
        plan.faults.push((at, fault));
    }
    plan.faults.sort_by_key(|(at, _)| *at);
    (options, plan)
}

/// The `sim_scenario` fuzz body: the decoded run holds every invariant.
pub fn fuzz_scenario(data: &[u8]) -> Result<(), String> {
    let (options, plan) = scenario_from_bytes(data);
    match run_plan(&options, &plan).violation {
        None => Ok(()),
        Some(v) => Err(format!("{v:?}\n{options}\n{plan:?}")),
    }
}

#[cfg(test)]
mod tests;
