//! The simulated world: one queue server (the ledger, its reaper and retry requeue), N relay
//! hosts (a relay machine each, with a modelled agent process and success check), a network
//! between them, a clock per host, and the plan's faults. Events are ordered by (time, seq) and
//! the clock jumps from one to the next; every invariant is checked after every event.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};

use relay_core::ErrorCode;
use relay_core::ledger::{
    Actor, Attempt, ClaimOpts, Ledger, LedgerConfig, NewTodo, Outcome, Report, Todo, TodoState,
    TokenHash, transition,
};
use relay_core::relay::{
    Capabilities, ClaimAnswer, ClaimedTodo, Command, ExitStatus, HarnessSettings, Input,
    LeaseError, LeaseToken, OnOverlap, Relay, RelayOutcome, ReportVerb, RequestId, RunOutcome,
    RunRecord, Signal, SuccessCheck, decode_claim, reconcile_interrupted,
};
use relay_core::time::{HOUR, MINUTE, Millis, Now, SECOND};
use relay_core::wire::ClaimOut;
use serde_json::{Value, json};

use crate::options::{MAX_DRIFT_PPM, Mutation, Options};
use crate::plan::{Fault, Plan, Work};
use crate::rng::Rng;

/// Where simulated time starts (an ordinary instant in 2026).
pub const T0: Millis = 1_790_000_000_000;
/// How long the lease client waits for an answer before it calls the request failed.
pub const REQUEST_TIMEOUT: Millis = 10 * SECOND;
const ENDPOINT: &str = "sim";
const QUEUE: &str = "work";

/// Correctness (a safety property broke) or liveness (work did not finish once healed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Correctness,
    Liveness,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    pub kind: Kind,
    pub invariant: &'static str,
    pub detail: String,
    pub step: u64,
    pub at: Millis,
}

/// What a finished run tells.
#[derive(Clone, Debug)]
pub struct RunResult {
    pub violation: Option<Violation>,
    pub events: u64,
    pub sim_time: Millis,
    pub trace_hash: u64,
    /// Fault kinds injected and key transitions seen, by name.
    pub counts: BTreeMap<&'static str, u64>,
}

#[derive(Clone, Debug)]
enum Call {
    ClaimNext {
        ttl: Millis,
        fence: bool,
        claimant: String,
    },
    Heartbeat {
        todo: String,
        ttl: Millis,
        token: String,
    },
    Report {
        verb: ReportVerb,
        todo: String,
        token: String,
        summary: String,
        artifact: Option<String>,
        result: Value,
    },
}

#[derive(Clone, Debug)]
enum Answer {
    Claimed(Box<ClaimedTodo>),
    Empty,
    HeartbeatOk,
    Reported { dead_letter: bool },
}

#[derive(Clone, Debug)]
enum Ev {
    Work(Work),
    Fault(Fault),
    PartitionEnd(usize),
    OutageEnd,
    Restart(usize),
    Resume(usize),
    Heal,
    Reap,
    Requeue,
    /// The schedule's clock (not a host event: it keeps ticking while a host is down).
    Tick(usize),
    /// A firing on the host: the schedule's or the doorbell's.
    Fire(usize),
    Timer {
        relay: usize,
        generation: u64,
    },
    ServerRecv {
        relay: usize,
        life: u32,
        req: RequestId,
        call: Call,
    },
    ClientRecv {
        relay: usize,
        life: u32,
        req: RequestId,
        answer: Result<Answer, ErrorCode>,
    },
    ClientTimeout {
        relay: usize,
        life: u32,
        req: RequestId,
    },
    /// A lease call the driver held back (the report-after-deadline canary).
    LateSend {
        relay: usize,
        life: u32,
        req: RequestId,
        run_id: u64,
        call: Call,
    },
    /// An input for the relay of this lifetime (process and check events, receipts).
    Local {
        relay: usize,
        life: u32,
        input: LocalInput,
    },
}

#[derive(Clone, Debug)]
enum LocalInput {
    Spawned(u64),
    Exited {
        run_id: u64,
        proc_gen: u64,
        exit: ExitStatus,
        summary: Option<Vec<u8>>,
    },
    CheckExited {
        run_id: u64,
        check_gen: u64,
        exit: ExitStatus,
    },
    Receipt {
        req: RequestId,
        ok: bool,
    },
}

#[derive(Clone, Debug)]
struct Proc {
    run_id: u64,
    todo: String,
    signalled: bool,
    /// Ignores SIGTERM until SIGKILL.
    stubborn: bool,
    generation: u64,
}

#[derive(Clone, Debug, Default)]
struct Run {
    todo: String,
    seq: u32,
    report_answered: bool,
}

#[derive(Clone, Debug)]
struct Pending {
    run_id: u64,
    is_report: bool,
    is_heartbeat: bool,
}

/// One clock of a host: it reads `global + offset`, running fast or slow by `drift_ppm`.
#[derive(Clone, Copy, Debug)]
struct HostClock {
    offset: i64,
    drift_ppm: i64,
}

impl HostClock {
    fn read(&self, global: Millis) -> Millis {
        let g = global as i128;
        let drift = (g - T0 as i128) * self.drift_ppm as i128 / 1_000_000;
        (g + self.offset as i128 + drift).max(0) as Millis
    }

    /// Sets the clock so that it reads `local` at `global`.
    fn set(&mut self, global: Millis, local: Millis) {
        let g = global as i128;
        let drift = (g - T0 as i128) * self.drift_ppm as i128 / 1_000_000;
        self.offset = (local as i128 - g - drift) as i64;
    }

    /// The global instant at which this clock reads `local` (the inverse of `read`).
    fn when(&self, local: Millis) -> Millis {
        let l = local as i128 - self.offset as i128;
        let g = (l * 1_000_000 + T0 as i128 * self.drift_ppm as i128)
            / (1_000_000 + self.drift_ppm as i128);
        g.max(0) as Millis
    }
}

struct Host {
    relay: Option<Relay>,
    /// Bumped at every restart; events of an old lifetime are dropped.
    life: u32,
    /// The monotonic clock: it drifts, it runs on through a pause (it counts suspended time),
    /// it never steps; a reboot starts it again from a small number.
    mono: HostClock,
    /// The wall clock: it drifts on its own and steps either way ([`Fault::WallStep`]).
    wall: HostClock,
    timer_gen: u64,
    proc: Option<Proc>,
    check: Option<(u64, u64)>,
    proc_gen: u64,
    /// Survives crashes: the run journal and the run-id counter.
    journal: BTreeMap<u64, RunRecord>,
    next_run_id: u64,
    runs: BTreeMap<u64, Run>,
    pending: BTreeMap<RequestId, Pending>,
    partitioned: bool,
    paused: bool,
    deferred: Vec<Ev>,
    /// The newest lease tokens this host held, to search its outputs for.
    tokens: Vec<String>,
    /// A doorbell firing is already on its way (rings within its delay coalesce).
    ring_at: Option<Millis>,
    /// Runs whose heartbeat the server refused (conflict or not_found), as delivered.
    refused: BTreeSet<u64>,
    /// The machine held a live lease when it began handling the current input (a heartbeat
    /// due before an answer that ends the attempt may go out in the same step).
    was_live: bool,
    /// Runs that ended (lease lost, or final record) in the commands drained so far this step.
    ended_now: BTreeSet<u64>,
}

impl Host {
    /// The clock the driver hands the machine as monotonic: the wall clock under the canary
    /// that puts deadlines on wall time.
    fn machine_clock(&self, mutation: Option<Mutation>) -> HostClock {
        if mutation == Some(Mutation::DeadlinesOnWallClock) {
            self.wall
        } else {
            self.mono
        }
    }

    /// What the machine is told the time is, at `global`.
    fn now(&self, global: Millis, mutation: Option<Mutation>) -> Now {
        Now {
            mono: self.machine_clock(mutation).read(global),
            wall: self.wall.read(global),
        }
    }
}

/// The agent's world: has the todo's fix landed (the check's truth)?
#[derive(Default)]
struct Truth {
    fixed: BTreeSet<String>,
}

pub struct World {
    o: Options,
    now: Millis,
    seq: u64,
    step: u64,
    queue: BinaryHeap<Reverse<(Millis, u64, usize)>>,
    events: Vec<Option<Ev>>,
    free: Vec<usize>,
    ledger: Ledger,
    hosts: Vec<Host>,
    outage: bool,
    healed: bool,
    net: Rng,
    work: Rng,
    tokens: Rng,
    truth: Truth,
    added: BTreeSet<String>,
    closed: BTreeMap<(String, u32), Attempt>,
    counts: BTreeMap<&'static str, u64>,
    hash: u64,
    violation: Option<Violation>,
    heal_at: Millis,
    /// Print every event and command to stderr (`relay sim --trace`).
    pub trace: bool,
    /// The todos the server changed since their invariants were last checked.
    touched: BTreeSet<String>,
    /// Server events since the last full check of the ledger.
    since_full_check: u32,
}

fn mix(h: u64, v: u64) -> u64 {
    (h ^ v).wrapping_mul(0x0100_0000_01b3).rotate_left(17) ^ (v >> 7)
}

fn todo_id(n: usize) -> String {
    format!("td_{n}")
}

impl World {
    pub fn new(o: Options, plan: &Plan) -> World {
        let mut setup = Rng::stream(o.seed, "hosts");
        let drift = |setup: &mut Rng| {
            if o.faults.clock_drift {
                setup.range(0, 2 * MAX_DRIFT_PPM as u64) as i64 - MAX_DRIFT_PPM
            } else {
                0
            }
        };
        let hosts = (0..o.relays)
            .map(|_| Host {
                relay: None,
                life: 0,
                // Up for a while already: the monotonic clock reads an uptime, nothing like a
                // wall time, so that a reading used as the other shows at once.
                mono: HostClock {
                    offset: setup.range(MINUTE, 30 * 24 * HOUR) as i64 - T0 as i64,
                    drift_ppm: drift(&mut setup),
                },
                wall: HostClock {
                    offset: 0,
                    drift_ppm: drift(&mut setup),
                },
                timer_gen: 0,
                proc: None,
                check: None,
                proc_gen: 0,
                journal: BTreeMap::new(),
                next_run_id: 1,
                runs: BTreeMap::new(),
                pending: BTreeMap::new(),
                partitioned: false,
                paused: false,
                deferred: Vec::new(),
                tokens: Vec::new(),
                ring_at: None,
                refused: BTreeSet::new(),
                was_live: false,
                ended_now: BTreeSet::new(),
            })
            .collect();
        let mut w = World {
            ledger: Ledger::new(LedgerConfig {
                attempts_cap: 100,
                ..LedgerConfig::default()
            }),
            now: T0,
            seq: 0,
            step: 0,
            queue: BinaryHeap::new(),
            events: Vec::new(),
            free: Vec::new(),
            hosts,
            outage: false,
            healed: false,
            net: Rng::stream(o.seed, "net"),
            work: Rng::stream(o.seed, "agents"),
            tokens: Rng::stream(o.seed, "tokens"),
            truth: Truth::default(),
            added: BTreeSet::new(),
            closed: BTreeMap::new(),
            counts: BTreeMap::new(),
            hash: 0xcbf2_9ce4_8422_2325,
            violation: None,
            heal_at: T0 + o.safety,
            trace: false,
            touched: BTreeSet::new(),
            since_full_check: 0,
            o,
        };
        for (at, work) in &plan.work {
            w.schedule(T0 + at, Ev::Work(work.clone()));
        }
        for (at, fault) in &plan.faults {
            w.schedule(T0 + at, Ev::Fault(fault.clone()));
        }
        w.schedule(w.heal_at, Ev::Heal);
        w.schedule(T0 + w.o.reaper_every, Ev::Reap);
        w.schedule(T0 + w.o.requeue_every, Ev::Requeue);
        for r in 0..w.o.relays {
            w.start_relay(r);
            let first = T0 + w.work.below(w.o.fire_every);
            w.schedule(first, Ev::Tick(r));
        }
        w
    }

    fn schedule(&mut self, at: Millis, ev: Ev) {
        let slot = match self.free.pop() {
            Some(i) => {
                self.events[i] = Some(ev);
                i
            }
            None => {
                self.events.push(Some(ev));
                self.events.len() - 1
            }
        };
        self.seq += 1;
        self.queue.push(Reverse((at.max(self.now), self.seq, slot)));
    }

    fn count(&mut self, what: &'static str) {
        *self.counts.entry(what).or_default() += 1;
    }

    fn violate(&mut self, kind: Kind, invariant: &'static str, detail: String) {
        if self.violation.is_none() {
            self.violation = Some(Violation {
                kind,
                invariant,
                detail,
                step: self.step,
                at: self.now,
            });
        }
    }

    fn settings(&self, r: usize) -> HarnessSettings {
        let o = &self.o;
        HarnessSettings {
            harness: format!("worker-{r}"),
            host: format!("host-{r}"),
            lease: "queue.sim".into(),
            queue: Some(QUEUE.into()),
            lease_ttl: o.lease_ttl,
            heartbeat_interval: o.heartbeat_interval,
            argv: vec!["agent".into(), "--fix".into()],
            prompt: Some(b"fix the todo in HARNESS_RELAY_FILE".to_vec()),
            workdir: "/work".into(),
            timeout: o.agent_timeout,
            kill_grace: 10 * SECOND,
            on_overlap: OnOverlap::Skip,
            enabled: true,
            lease_enabled: true,
            success_check: o.check.then(|| SuccessCheck {
                argv: vec!["check".into()],
                timeout: 5 * MINUTE,
                interval: 30 * SECOND,
                before: o.check_before,
            }),
            attempt_receipt: o.receipts.then(|| "cairn.sim".into()),
            jobs_dir: "/state/jobs".into(),
            secrets: vec!["sim-header-secret".into()],
            env_file: vec![("API_KEY".into(), "sim-env-secret".into())],
        }
    }

    fn start_relay(&mut self, r: usize) {
        let settings = self.settings(r);
        let seed = self.o.seed ^ (r as u64) << 32 ^ u64::from(self.hosts[r].life);
        let first = self.hosts[r].next_run_id;
        let mut relay = Relay::new(settings, seed, first);
        let now = self.hosts[r].now(self.now, self.o.mutation);
        let caps = Capabilities::full(self.o.release_granted);
        if let Err(e) = relay.handle_input(now, Input::CapabilitiesKnown(caps)) {
            self.violate(Kind::Correctness, "contract", format!("relay {r}: {e:?}"));
        }
        self.hosts[r].relay = Some(relay);
        self.drain(r);
    }

    /// Runs until the work is finished after healing, a violation, or the liveness bound.
    pub fn run(mut self) -> RunResult {
        let bound = self.heal_at + self.o.liveness_bound;
        while let Some(Reverse((at, _, slot))) = self.queue.pop() {
            let ev = self.events[slot].take().expect("scheduled event");
            self.free.push(slot);
            self.now = at;
            self.step += 1;
            self.hash = mix(mix(self.hash, at), self.step);
            if self.trace {
                eprintln!("{:>9} #{} {:?}", at - T0, self.step, ev);
            }
            self.handle(ev);
            self.check_invariants();
            if self.violation.is_some() {
                break;
            }
            if self.healed && self.finished() {
                break;
            }
            if self.now > bound {
                let open: Vec<String> = self
                    .ledger
                    .todos()
                    .filter(|t| !relay_core::ledger::finished(t))
                    .map(|t| format!("{} {}", t.id, t.state))
                    .collect();
                self.violate(
                    Kind::Liveness,
                    "finishes",
                    format!(
                        "{} after healing, unfinished: {}",
                        relay_core::config::format_duration(self.o.liveness_bound),
                        open.join(", ")
                    ),
                );
                break;
            }
        }
        RunResult {
            violation: self.violation,
            events: self.step,
            sim_time: self.now - T0,
            trace_hash: self.hash,
            counts: self.counts,
        }
    }

    fn finished(&self) -> bool {
        self.added.len() == self.o.todos
            && self.ledger.todos().all(relay_core::ledger::finished)
            && self
                .hosts
                .iter()
                .all(|h| h.relay.as_ref().is_none_or(|r| !r.in_flight()))
    }

    fn handle(&mut self, ev: Ev) {
        // A paused host runs nothing: its events wait for it to resume.
        if let Some(r) = self.host_of(&ev)
            && self.hosts[r].paused
        {
            self.hosts[r].deferred.push(ev);
            return;
        }
        match ev {
            Ev::Work(w) => self.on_work(w),
            Ev::Fault(f) => self.on_fault(f),
            Ev::PartitionEnd(r) => self.hosts[r].partitioned = false,
            Ev::OutageEnd => self.outage = false,
            Ev::Restart(r) => {
                self.count("restart");
                self.start_relay(r);
            }
            Ev::Resume(r) => self.on_resume(r),
            Ev::Heal => {
                self.healed = true;
                self.outage = false;
                for h in &mut self.hosts {
                    h.partitioned = false;
                }
            }
            Ev::Reap => {
                self.reap();
                self.schedule(self.now + self.o.reaper_every, Ev::Reap);
            }
            Ev::Requeue => {
                match self.ledger.requeue_due(self.now) {
                    Ok(moved) if !moved.is_empty() => {
                        self.touched.extend(moved.into_iter().map(|t| t.id));
                        self.ring();
                    }
                    Ok(_) => {}
                    Err(e) => self.violate(Kind::Correctness, "server", e.to_string()),
                }
                self.schedule(self.now + self.o.requeue_every, Ev::Requeue);
            }
            Ev::Tick(r) => {
                self.schedule(self.now, Ev::Fire(r));
                self.schedule(self.now + self.o.fire_every, Ev::Tick(r));
            }
            Ev::Fire(r) => {
                if self.hosts[r].ring_at.is_some_and(|t| t <= self.now) {
                    self.hosts[r].ring_at = None;
                }
                self.feed(
                    r,
                    Input::Firing {
                        trigger: "schedule".into(),
                        within_hours: true,
                    },
                );
            }
            Ev::Timer { relay, generation } => {
                if self.hosts[relay].timer_gen == generation && self.hosts[relay].relay.is_some() {
                    let now = self.begin_step(relay);
                    if let Some(m) = self.hosts[relay].relay.as_mut() {
                        m.handle_timeout(now);
                    }
                    self.drain(relay);
                }
            }
            Ev::ServerRecv {
                relay,
                life,
                req,
                call,
            } => self.on_server_recv(relay, life, req, call),
            Ev::ClientRecv {
                relay,
                life,
                req,
                answer,
            } => self.on_client_recv(relay, life, req, answer),
            Ev::ClientTimeout { relay, life, req } => {
                if self.hosts[relay].life == life
                    && let Some(p) = self.hosts[relay].pending.remove(&req)
                {
                    self.answer(relay, req, &p, Err(LeaseError::Transport));
                }
            }
            Ev::LateSend {
                relay,
                life,
                req,
                run_id,
                call,
            } => {
                if self.hosts[relay].life == life {
                    self.check_lease_live(relay, run_id, true, "report");
                    self.send(relay, req, run_id, call);
                }
            }
            Ev::Local { relay, life, input } => {
                if self.hosts[relay].life == life && self.hosts[relay].relay.is_some() {
                    self.on_local(relay, input);
                }
            }
        }
    }

    /// The host an event happens on, if it happens on one (server events do not).
    fn host_of(&self, ev: &Ev) -> Option<usize> {
        match ev {
            Ev::Fire(r)
            | Ev::Timer { relay: r, .. }
            | Ev::ClientRecv { relay: r, .. }
            | Ev::ClientTimeout { relay: r, .. }
            | Ev::LateSend { relay: r, .. }
            | Ev::Local { relay: r, .. }
            | Ev::Restart(r) => Some(*r),
            _ => None,
        }
    }

    fn on_work(&mut self, w: Work) {
        let op = Actor::Operator;
        match w {
            Work::Add(n) => {
                let id = todo_id(n);
                let new = NewTodo {
                    id: id.clone(),
                    queue: QUEUE.into(),
                    title: format!("fix thing {n}"),
                    payload: Some(json!({"n": n})),
                    max_attempts: Some(self.o.max_attempts),
                    ..NewTodo::default()
                };
                match self.ledger.add_todo(self.now, ENDPOINT, new) {
                    Ok(_) => {
                        self.touched.insert(id.clone());
                        self.added.insert(id);
                        self.ring();
                    }
                    Err(e) => self.violate(Kind::Correctness, "server", e.to_string()),
                }
            }
            Work::Cancel(n) if !self.healed => {
                self.touched.insert(todo_id(n));
                if self.ledger.cancel(self.now, &op, &todo_id(n)).is_ok() {
                    self.count("operator_cancel");
                }
            }
            Work::Retry(n) if !self.healed => {
                self.touched.insert(todo_id(n));
                if self.ledger.retry(self.now, &op, &todo_id(n)).is_ok() {
                    self.count("operator_retry");
                    self.ring();
                }
            }
            Work::Cancel(_) | Work::Retry(_) => {}
        }
    }

    /// The doorbell: every relay is fired shortly after work becomes claimable.
    fn ring(&mut self) {
        for r in 0..self.hosts.len() {
            if self.hosts[r].ring_at.is_some_and(|t| t >= self.now) {
                continue;
            }
            let at = self.now + self.net.range(1, 500);
            self.hosts[r].ring_at = Some(at);
            self.schedule(at, Ev::Fire(r));
        }
    }

    fn on_fault(&mut self, f: Fault) {
        if self.healed {
            return;
        }
        self.count(f.kind());
        match f {
            Fault::Partition { relay, len } => {
                self.hosts[relay].partitioned = true;
                self.schedule(self.now + len, Ev::PartitionEnd(relay));
            }
            Fault::Outage { len } => {
                self.outage = true;
                self.schedule(self.now + len, Ev::OutageEnd);
            }
            Fault::Crash { relay, down } => {
                if self.hosts[relay].relay.is_none() {
                    return;
                }
                // Half the crashes take the host down with them: its monotonic clock starts
                // again from a small uptime when it boots.
                let reboot = self
                    .net
                    .chance(500)
                    .then(|| self.net.range(MINUTE, 10 * MINUTE));
                let h = &mut self.hosts[relay];
                // The host dies with its processes; its volatile state is gone, the journal
                // stays, and a run left `running` is reconciled as interrupted on restart.
                h.relay = None;
                h.proc = None;
                h.check = None;
                h.pending.clear();
                h.refused.clear();
                h.paused = false;
                h.deferred.clear();
                h.life += 1;
                h.timer_gen += 1;
                let wall = h.wall.read(self.now + down);
                for rec in h.journal.values_mut() {
                    *rec = reconcile_interrupted(rec.clone(), wall);
                }
                if let Some(uptime) = reboot {
                    h.mono.set(self.now + down, uptime);
                }
                self.schedule(self.now + down, Ev::Restart(relay));
            }
            Fault::Pause { relay, len } => {
                if self.hosts[relay].relay.is_some() && !self.hosts[relay].paused {
                    self.hosts[relay].paused = true;
                    self.schedule(self.now + len, Ev::Resume(relay));
                }
            }
            Fault::WallStep { relay, by } => {
                if by < 0 {
                    self.count("wall_step_back");
                }
                self.hosts[relay].wall.offset += by;
                self.wake(relay);
            }
        }
    }

    fn on_resume(&mut self, r: usize) {
        self.hosts[r].paused = false;
        // Whatever happened during the pause is delivered now, in an order of the seed's
        // choosing; the machine must act on its overdue deadline before any of it.
        let mut deferred = std::mem::take(&mut self.hosts[r].deferred);
        for i in (1..deferred.len()).rev() {
            let j = self.net.below(i as u64 + 1) as usize;
            deferred.swap(i, j);
        }
        self.wake(r);
        for ev in deferred {
            self.schedule(self.now, ev);
        }
    }

    /// The host's clock moved past deadlines (it woke from a pause, or jumped): its overdue
    /// timers fire at once, as a real timer wheel fires them on its next turn.
    fn wake(&mut self, r: usize) {
        let now = self.begin_step(r);
        if let Some(m) = self.hosts[r].relay.as_mut() {
            m.handle_timeout(now);
        }
        self.drain(r);
    }

    fn reap(&mut self) {
        let before: Vec<(Todo, Option<Attempt>)> = self
            .ledger
            .todos()
            .filter(|t| t.state == TodoState::Claimed)
            .map(|t| {
                let open = self.ledger.attempts(&t.id).last().filter(|a| a.is_open());
                (t.clone(), open.cloned())
            })
            .collect();
        match self.ledger.reap(self.now) {
            Ok(reaped) => {
                for t in &reaped {
                    self.touched.insert(t.id.clone());
                    self.count("reaped");
                    if self.o.mutation == Some(Mutation::ReaperClosesTwice)
                        && let Some((old, open)) = before.iter().find(|(b, _)| b.id == t.id)
                        && let Ok(Some(change)) = transition::reap(self.now, old, open.as_ref())
                        && let Err(e) = self.ledger.apply(change)
                    {
                        self.violate(Kind::Correctness, "closed_once", e.to_string());
                    }
                }
                if !reaped.is_empty() {
                    self.ring();
                }
            }
            Err(e) => self.violate(Kind::Correctness, "server", e.to_string()),
        }
    }

    // -----------------------------------------------------------------------------------------
    // The relay side: feeding the machine and carrying out its commands.
    // -----------------------------------------------------------------------------------------

    /// Notes whether the machine holds a live lease before it handles the next input.
    fn begin_step(&mut self, r: usize) -> Now {
        let h = &mut self.hosts[r];
        let now = h.now(self.now, self.o.mutation);
        h.was_live = h
            .relay
            .as_ref()
            .and_then(Relay::lease_deadline)
            .is_some_and(|d| now.mono < d);
        h.ended_now.clear();
        now
    }

    fn feed(&mut self, r: usize, input: Input) {
        let now = self.begin_step(r);
        let Some(m) = self.hosts[r].relay.as_mut() else {
            return;
        };
        if let Err(e) = m.handle_input(now, input) {
            self.violate(Kind::Correctness, "contract", format!("relay {r}: {e:?}"));
        }
        self.drain(r);
    }

    /// Drains the machine's commands, then re-arms its timer.
    fn drain(&mut self, r: usize) {
        while let Some(cmd) = self.hosts[r].relay.as_mut().and_then(Relay::poll_command) {
            self.hash = mix(self.hash, cmd.run_id() ^ (r as u64) << 40);
            if self.trace {
                eprintln!("          relay {r} -> {cmd:?}");
            }
            self.execute(r, cmd);
        }
        self.rearm(r);
    }

    fn rearm(&mut self, r: usize) {
        let h = &mut self.hosts[r];
        h.timer_gen += 1;
        let generation = h.timer_gen;
        if let Some((local, _)) = h.relay.as_ref().and_then(Relay::poll_timeout) {
            // The machine's timers are on the clock its driver hands it as monotonic.
            let clock = h.machine_clock(self.o.mutation);
            let at = clock.when(local).max(self.now);
            // Rounding in the clock inverse must never wake the machine early.
            let at = if clock.read(at) < local { at + 1 } else { at };
            self.schedule(
                at,
                Ev::Timer {
                    relay: r,
                    generation,
                },
            );
        }
    }

    fn execute(&mut self, r: usize, cmd: Command) {
        if !cmd.is_lease_call() {
            self.check_no_token(r, &cmd);
        }
        match &cmd {
            Command::Emit {
                event: relay_core::relay::Event::RelayLeaseLost { run_id, .. },
            } => {
                self.hosts[r].ended_now.insert(*run_id);
            }
            Command::WriteRunRecord { record } if record.outcome != RunOutcome::Running => {
                self.hosts[r].ended_now.insert(record.run_id);
            }
            _ => {}
        }
        let life = self.hosts[r].life;
        match cmd {
            Command::SendClaimNext {
                request,
                run_id,
                lease_ttl_seconds,
                require_fence,
                claimant,
                ..
            } => {
                let call = Call::ClaimNext {
                    ttl: lease_ttl_seconds * SECOND,
                    fence: require_fence,
                    claimant,
                };
                self.send(r, request, run_id, call);
            }
            Command::SendHeartbeat {
                request,
                run_id,
                todo_id,
                lease_ttl_seconds,
                lease_token,
            } => {
                self.check_lease_live(r, run_id, false, "heartbeat");
                let call = Call::Heartbeat {
                    todo: todo_id,
                    ttl: lease_ttl_seconds * SECOND,
                    token: lease_token.expose().to_string(),
                };
                self.send(r, request, run_id, call);
            }
            Command::SendReport {
                request,
                run_id,
                verb,
                todo_id,
                lease_token,
                summary,
                artifact,
                result,
            } => {
                let call = Call::Report {
                    verb,
                    todo: todo_id,
                    token: lease_token.expose().to_string(),
                    summary,
                    artifact,
                    result,
                };
                if self.o.mutation == Some(Mutation::ReportAfterDeadline) {
                    // The canary: the driver holds the report until the lease is surely gone.
                    let late = self.now + self.o.lease_ttl + SECOND;
                    self.schedule(
                        late,
                        Ev::LateSend {
                            relay: r,
                            life,
                            req: request,
                            run_id,
                            call,
                        },
                    );
                    return;
                }
                self.check_lease_live(r, run_id, false, "report");
                self.send(r, request, run_id, call);
            }
            Command::Spawn { run_id, .. } => {
                self.count("spawn");
                let Some(run) = self.hosts[r].runs.get(&run_id) else {
                    self.violate(
                        Kind::Correctness,
                        "spawn_claimed",
                        format!("relay {r} spawned run {run_id} without a claim"),
                    );
                    return;
                };
                let todo = run.todo.clone();
                self.hosts[r].proc_gen += 1;
                let generation = self.hosts[r].proc_gen;
                let stubborn = self.work.chance(80);
                self.hosts[r].proc = Some(Proc {
                    run_id,
                    todo: todo.clone(),
                    signalled: false,
                    stubborn,
                    generation,
                });
                self.schedule(
                    self.now + 5,
                    Ev::Local {
                        relay: r,
                        life,
                        input: LocalInput::Spawned(run_id),
                    },
                );
                let took = self.work.range(SECOND, self.o.agent_max);
                let code = if self.work.chance(650) {
                    self.truth.fixed.insert(todo);
                    0
                } else {
                    1
                };
                let summary = self.agent_summary();
                self.schedule(
                    self.now + took,
                    Ev::Local {
                        relay: r,
                        life,
                        input: LocalInput::Exited {
                            run_id,
                            proc_gen: generation,
                            exit: ExitStatus::Code(code),
                            summary,
                        },
                    },
                );
            }
            Command::Signal { run_id, signal } => {
                let h = &mut self.hosts[r];
                let Some(p) = h.proc.as_mut().filter(|p| p.run_id == run_id) else {
                    return;
                };
                p.signalled = true;
                let (generation, stubborn) = (p.generation, p.stubborn);
                let after = match signal {
                    Signal::Term if stubborn => return,
                    Signal::Term => self.work.range(10, 2 * SECOND),
                    Signal::Kill => 10,
                };
                let sig = if signal == Signal::Kill { 9 } else { 15 };
                self.schedule(
                    self.now + after,
                    Ev::Local {
                        relay: r,
                        life,
                        input: LocalInput::Exited {
                            run_id,
                            proc_gen: generation,
                            exit: ExitStatus::Signal(sig),
                            summary: None,
                        },
                    },
                );
            }
            Command::RunCheck { run_id, .. } => {
                let todo = self.hosts[r].runs.get(&run_id).map(|x| x.todo.clone());
                self.hosts[r].proc_gen += 1;
                let generation = self.hosts[r].proc_gen;
                self.hosts[r].check = Some((run_id, generation));
                let code = if self.work.chance(200) {
                    75
                } else if todo.is_some_and(|t| self.truth.fixed.contains(&t)) {
                    0
                } else {
                    1
                };
                let took = self.work.range(100, 20 * SECOND);
                self.schedule(
                    self.now + took,
                    Ev::Local {
                        relay: r,
                        life,
                        input: LocalInput::CheckExited {
                            run_id,
                            check_gen: generation,
                            exit: ExitStatus::Code(code),
                        },
                    },
                );
            }
            Command::KillCheck { run_id } => {
                // The check dies of SIGKILL shortly; its own exit, if still pending, is dropped.
                if self.hosts[r].check.is_some_and(|(run, _)| run == run_id) {
                    self.hosts[r].proc_gen += 1;
                    let generation = self.hosts[r].proc_gen;
                    self.hosts[r].check = Some((run_id, generation));
                    self.schedule(
                        self.now + 10,
                        Ev::Local {
                            relay: r,
                            life,
                            input: LocalInput::CheckExited {
                                run_id,
                                check_gen: generation,
                                exit: ExitStatus::Signal(9),
                            },
                        },
                    );
                }
            }
            Command::UploadReceipt { request, .. } => {
                let ok = self.work.chance(800);
                let took = self.work.range(100, 40 * SECOND);
                self.schedule(
                    self.now + took,
                    Ev::Local {
                        relay: r,
                        life,
                        input: LocalInput::Receipt { req: request, ok },
                    },
                );
            }
            Command::WriteRunRecord { record } => self.on_record(r, record),
            Command::WriteContextFile { .. }
            | Command::Emit { .. }
            | Command::WarnRunLog { .. } => {}
        }
    }

    /// What the agent leaves in its summary file: nothing, prose, the JSON form, or a secret
    /// that the relay must redact.
    fn agent_summary(&mut self) -> Option<Vec<u8>> {
        match self.work.below(4) {
            0 => None,
            1 => Some(b"bumped the fixture; one flaky test remains".to_vec()),
            2 => Some(br#"{"summary": "patched it", "artifact": "mcp://cairn/Ab12Cd34"}"#.to_vec()),
            _ => Some(b"used ghp_0123456789abcdefghijABCDEFGHIJ012345 to push".to_vec()),
        }
    }

    fn on_local(&mut self, r: usize, input: LocalInput) {
        let input = match input {
            LocalInput::Spawned(run_id) => Input::ProcessSpawned { run_id },
            LocalInput::Exited {
                run_id,
                proc_gen,
                exit,
                summary,
            } => {
                match &self.hosts[r].proc {
                    Some(p) if p.run_id == run_id && p.generation == proc_gen => {}
                    _ => return, // already exited (a second signal's exit, or a crash)
                }
                self.hosts[r].proc = None;
                Input::ProcessExited {
                    run_id,
                    exit,
                    summary_file: summary,
                }
            }
            LocalInput::CheckExited {
                run_id,
                check_gen,
                exit,
            } => {
                if self.hosts[r].check != Some((run_id, check_gen)) {
                    return; // killed
                }
                self.hosts[r].check = None;
                if exit == ExitStatus::Code(75) {
                    self.count("check_exit_75");
                }
                Input::CheckExited {
                    run_id,
                    exit,
                    output_tail: b"3 passed, 1 failed\n".to_vec(),
                }
            }
            LocalInput::Receipt { req, ok } => {
                if ok {
                    Input::ReceiptUploaded {
                        request: req,
                        handle: format!("mcp://cairn/r{}", req.0),
                    }
                } else {
                    Input::ReceiptFailed {
                        request: req,
                        error: "timed out".into(),
                    }
                }
            }
        };
        self.feed(r, input);
    }

    fn on_record(&mut self, r: usize, record: RunRecord) {
        self.hosts[r].next_run_id = self.hosts[r].next_run_id.max(record.run_id + 1);
        let ended = record.outcome != RunOutcome::Running;
        if ended && let Some(outcome) = record.relay_outcome {
            self.check_relay_outcome(r, &record, outcome);
        }
        if ended {
            self.hosts[r].runs.remove(&record.run_id);
        }
        self.hosts[r].journal.insert(record.run_id, record);
    }

    fn send(&mut self, r: usize, req: RequestId, run_id: u64, call: Call) {
        let life = self.hosts[r].life;
        let (is_report, is_heartbeat) = (
            matches!(call, Call::Report { .. }),
            matches!(call, Call::Heartbeat { .. }),
        );
        self.hosts[r].pending.insert(
            req,
            Pending {
                run_id,
                is_report,
                is_heartbeat,
            },
        );
        self.schedule(
            self.now + REQUEST_TIMEOUT,
            Ev::ClientTimeout {
                relay: r,
                life,
                req,
            },
        );
        if self.hosts[r].partitioned
            || (!self.healed && self.net.chance(self.o.faults.request_loss))
        {
            self.count("request_lost");
            return;
        }
        let copies = if !self.healed && self.net.chance(self.o.faults.duplicate) {
            self.count("duplicate");
            2
        } else {
            1
        };
        for copy in 0..copies {
            // A duplicate may also straggle in long after the original (a retransmission
            // stuck in a proxy): by then the lease it speaks for may belong to someone else.
            let straggle = if copy > 0 && self.net.chance(500) {
                self.net.range(SECOND, 2 * self.o.lease_ttl)
            } else {
                0
            };
            let at = self.now + self.delay() + straggle;
            self.schedule(
                at,
                Ev::ServerRecv {
                    relay: r,
                    life,
                    req,
                    call: call.clone(),
                },
            );
        }
    }

    fn delay(&mut self) -> Millis {
        let max = if self.healed {
            0
        } else {
            self.o.faults.delay_max
        };
        self.net.range(1, 20) + if max > 0 { self.net.below(max) } else { 0 }
    }

    fn on_client_recv(
        &mut self,
        r: usize,
        life: u32,
        req: RequestId,
        answer: Result<Answer, ErrorCode>,
    ) {
        if self.hosts[r].life != life {
            return;
        }
        // An answer after the client gave up on the request is dropped, as a real client does.
        let Some(p) = self.hosts[r].pending.remove(&req) else {
            return;
        };
        self.answer(r, req, &p, answer.map_err(LeaseError::Code));
    }

    fn answer(
        &mut self,
        r: usize,
        req: RequestId,
        p: &Pending,
        result: Result<Answer, LeaseError>,
    ) {
        let input = match result {
            Ok(Answer::Claimed(c)) => {
                let c = *c;
                self.hosts[r].runs.insert(
                    p.run_id,
                    Run {
                        todo: c.todo_id.clone(),
                        seq: c.attempt_seq as u32,
                        report_answered: false,
                    },
                );
                if let Some(t) = &c.lease_token {
                    // The relay holds one token at a time; the newest few cover any that could
                    // still be in its hands (a late answer, a run still closing).
                    let tokens = &mut self.hosts[r].tokens;
                    tokens.push(t.expose().to_string());
                    if tokens.len() > 4 {
                        tokens.remove(0);
                    }
                }
                Input::ClaimAnswered {
                    request: req,
                    claim: c,
                }
            }
            Ok(Answer::Empty) => Input::ClaimEmpty { request: req },
            Ok(Answer::HeartbeatOk) => Input::HeartbeatOk { request: req },
            Ok(Answer::Reported { dead_letter }) => {
                if let Some(run) = self.hosts[r].runs.get_mut(&p.run_id) {
                    run.report_answered = true;
                }
                Input::ReportAnswered {
                    request: req,
                    dead_letter,
                    next_retry_at: None,
                }
            }
            Err(e) if p.is_heartbeat => {
                if e.is_lease_loss() {
                    self.hosts[r].refused.insert(p.run_id);
                }
                if self.o.mutation == Some(Mutation::IgnoreHeartbeatConflict) && e.is_lease_loss() {
                    Input::HeartbeatOk { request: req }
                } else {
                    Input::HeartbeatFailed {
                        request: req,
                        error: e,
                    }
                }
            }
            Err(e) if p.is_report => Input::ReportFailed {
                request: req,
                error: e,
            },
            Err(e) => Input::ClaimFailed {
                request: req,
                error: e,
            },
        };
        self.feed(r, input);
    }

    // -----------------------------------------------------------------------------------------
    // The server side.
    // -----------------------------------------------------------------------------------------

    fn on_server_recv(&mut self, r: usize, life: u32, req: RequestId, call: Call) {
        if self.outage {
            self.count("request_lost");
            return;
        }
        let answer = self.serve(call);
        if self.hosts[r].partitioned
            || (!self.healed && self.net.chance(self.o.faults.response_loss))
        {
            self.count("response_lost");
            return;
        }
        let at = self.now + self.delay();
        self.schedule(
            at,
            Ev::ClientRecv {
                relay: r,
                life,
                req,
                answer,
            },
        );
    }

    fn serve(&mut self, call: Call) -> Result<Answer, ErrorCode> {
        let endpoint = Actor::Endpoint {
            endpoint: ENDPOINT.into(),
            session: None,
        };
        let now = self.now;
        match call {
            Call::ClaimNext {
                ttl,
                fence,
                claimant,
            } => {
                let token = fence.then(|| format!("tok-{}", self.tokens.hex16()));
                let opts = ClaimOpts {
                    ttl,
                    claimant: Some(claimant),
                    token_hash: token.as_deref().map(TokenHash::of),
                };
                let queues = [QUEUE.to_string()];
                match self.ledger.claim_next(now, &endpoint, Some(&queues), &opts) {
                    Ok(None) => Ok(Answer::Empty),
                    Ok(Some(c)) => {
                        self.touched.insert(c.todo.id.clone());
                        if c.takeover {
                            self.count("takeover");
                        }
                        let out = ClaimOut::claimed(&c, token.map(LeaseToken::new));
                        // The daemon's own decoder reads the answer as JSON, as off the wire.
                        let answer = serde_json::to_value(&out).unwrap_or_default();
                        match decode_claim(&answer) {
                            Ok(ClaimAnswer::Claimed(ct)) => Ok(Answer::Claimed(Box::new(ct))),
                            Ok(ClaimAnswer::Empty) | Err(_) => {
                                self.violate(
                                    Kind::Correctness,
                                    "wire",
                                    "a claim answer did not decode".into(),
                                );
                                Err(ErrorCode::Internal)
                            }
                        }
                    }
                    Err(e) => self.server_error(e),
                }
            }
            Call::Heartbeat { todo, ttl, token } => {
                self.touched.insert(todo.clone());
                let hash = TokenHash::of(&token);
                let stale = self.stale(&todo, hash);
                let fence = self.fence(&todo, hash);
                match self.ledger.heartbeat(now, &endpoint, &todo, ttl, fence) {
                    Ok(_) => {
                        if stale {
                            self.violate(
                                Kind::Correctness,
                                "stale_fence",
                                format!("a heartbeat for {todo} under a stale lease was accepted"),
                            );
                        }
                        Ok(Answer::HeartbeatOk)
                    }
                    Err(e) => self.server_error(e),
                }
            }
            Call::Report {
                verb,
                todo,
                token,
                summary,
                artifact,
                result,
            } => {
                self.touched.insert(todo.clone());
                let hash = TokenHash::of(&token);
                let stale = self.stale(&todo, hash);
                let before = self.ledger.attempts(&todo).cloned().collect::<Vec<_>>();
                let actor = endpoint;
                let fence = self.fence(&todo, hash);
                let report = Report {
                    result: result.as_object().map(|_| result.clone()),
                    summary: Some(summary.clone()),
                    artifact,
                    token_hash: fence,
                };
                let r = match verb {
                    ReportVerb::Complete => self.ledger.complete(now, &actor, &todo, &report),
                    ReportVerb::Fail => self.ledger.fail(now, &actor, &todo, &report),
                    ReportVerb::Release => {
                        self.ledger
                            .release(now, &actor, &todo, Some(&summary), fence)
                    }
                };
                match r {
                    Ok(t) => {
                        let changed =
                            self.ledger.attempts(&todo).cloned().collect::<Vec<_>>() != before;
                        if stale && changed {
                            self.violate(
                                Kind::Correctness,
                                "stale_fence",
                                format!("a {verb:?} for {todo} under a stale lease was accepted"),
                            );
                        }
                        if t.dead_letter() && changed {
                            self.count("dead_letter");
                        }
                        Ok(Answer::Reported {
                            dead_letter: t.dead_letter(),
                        })
                    }
                    Err(e) => self.server_error(e),
                }
            }
        }
    }

    /// The token hash the server compares. The canary that skips the fence compares the open
    /// attempt's own hash, whatever the caller presented.
    fn fence(&self, todo: &str, presented: TokenHash) -> Option<TokenHash> {
        if self.o.mutation == Some(Mutation::ServerSkipsFence) {
            self.ledger
                .attempts(todo)
                .last()
                .filter(|a| a.is_open())
                .map_or(Some(presented), |a| a.lease_token_hash)
        } else {
            Some(presented)
        }
    }

    /// Whether a write under `hash` would be stale: the todo has no open attempt under that
    /// token whose lease is still valid.
    fn stale(&self, todo: &str, hash: TokenHash) -> bool {
        let open = self.ledger.attempts(todo).last().filter(|a| a.is_open());
        !open.is_some_and(|a| a.lease_token_hash == Some(hash) && self.now < a.lease_expires_at)
    }

    fn server_error(&mut self, e: relay_core::Error) -> Result<Answer, ErrorCode> {
        if e.code == ErrorCode::Internal {
            self.violate(Kind::Correctness, "server", e.to_string());
        }
        Err(e.code)
    }

    // -----------------------------------------------------------------------------------------
    // Invariants.
    // -----------------------------------------------------------------------------------------

    /// No lease call is put on the wire unless the relay holds a live lease: live now, or live
    /// when it began the step that sent the call and not ended earlier in that step. A call
    /// sent outside any step (`strict`, the late-send canary) must be live now.
    fn check_lease_live(&mut self, r: usize, run_id: u64, strict: bool, what: &str) {
        let h = &self.hosts[r];
        let local = h.machine_clock(self.o.mutation).read(self.now);
        let live_now = h
            .relay
            .as_ref()
            .and_then(Relay::lease_deadline)
            .is_some_and(|d| local < d);
        let live_in_step = !strict && h.was_live && !h.ended_now.contains(&run_id);
        if !(live_now || live_in_step) {
            self.violate(
                Kind::Correctness,
                "nothing_after_lease_loss",
                format!("relay {r} sent a {what} for run {run_id} without a live lease"),
            );
        }
    }

    /// The lease token appears in nothing but lease calls.
    fn check_no_token(&mut self, r: usize, cmd: &Command) {
        if self.hosts[r].tokens.is_empty() {
            return;
        }
        let shown = match cmd {
            Command::WriteContextFile { bytes, .. } => String::from_utf8_lossy(bytes).into_owned(),
            Command::Spawn { env, argv, .. } => format!("{argv:?}{:?}", env.merged([])),
            Command::RunCheck { env, argv, .. } => format!("{argv:?}{:?}", env.merged([])),
            Command::WriteRunRecord { record } => serde_json::to_string(record).unwrap_or_default(),
            Command::UploadReceipt { markdown, .. } => markdown.clone(),
            other => format!("{other:?}"),
        };
        if self.hosts[r]
            .tokens
            .iter()
            .any(|t| shown.contains(t.as_str()))
        {
            self.violate(
                Kind::Correctness,
                "token_stays_out",
                format!("relay {r}: a lease token appeared in {}", cmd_name(cmd)),
            );
        }
    }

    fn check_relay_outcome(&mut self, r: usize, record: &RunRecord, outcome: RelayOutcome) {
        let Some(run) = self.hosts[r].runs.get(&record.run_id).cloned() else {
            return;
        };
        let attempt = self
            .ledger
            .attempts(&run.todo)
            .find(|a| a.seq == run.seq)
            .cloned();
        let Some(a) = attempt else {
            return; // pruned or deleted: nothing left to compare
        };
        let got = (a.outcome, a.disposition);
        use relay_core::ledger::Disposition as D;
        let agrees = match outcome {
            RelayOutcome::Completed => got.0 == Some(Outcome::Completed),
            RelayOutcome::Failed => {
                got == (Some(Outcome::Failed), Some(D::RetryScheduled))
                    // A known gap, found by the fuzzer: a fail that dead-lettered, whose answer
                    // was lost, is answered on its repeat with the todo as it is now; when an
                    // operator canceled or retried the dead letter in between, that answer says
                    // no dead letter and the relay records `failed`.
                    || got == (Some(Outcome::Failed), Some(D::DeadLettered))
                        && self.ledger.todo(&run.todo).is_some_and(|t| !t.dead_letter())
            }
            RelayOutcome::DeadLettered => got == (Some(Outcome::Failed), Some(D::DeadLettered)),
            RelayOutcome::Released => got.0 == Some(Outcome::Released),
            // The relay lost the lease: no report of its own closed the attempt.
            RelayOutcome::LeaseLost => !matches!(
                got.0,
                Some(Outcome::Completed | Outcome::Failed | Outcome::Released)
            ),
            // No answer to any report reached it; the server may still have applied one whose
            // answer was lost (then the attempt shows that report's outcome).
            RelayOutcome::ReportLost => !run.report_answered,
            RelayOutcome::NoWork => true,
        };
        match outcome {
            RelayOutcome::LeaseLost => self.count("lease_lost"),
            RelayOutcome::ReportLost => self.count("report_lost"),
            RelayOutcome::DeadLettered => self.count("relay_dead_lettered"),
            _ => {}
        }
        if !agrees {
            self.violate(
                Kind::Correctness,
                "outcomes_agree",
                format!(
                    "relay {r} run {} recorded {} for {} seq {} but the ledger says {:?}/{:?}",
                    record.run_id,
                    outcome.as_str(),
                    run.todo,
                    run.seq,
                    got.0,
                    got.1
                ),
            );
        }
    }

    fn check_invariants(&mut self) {
        if self.violation.is_some() {
            return;
        }
        if !self.touched.is_empty() {
            let touched = std::mem::take(&mut self.touched);
            self.since_full_check += 1;
            // Every touched todo is checked at once; the whole ledger (its index, the count of
            // todos) now and then and whenever work arrives.
            let full = self.since_full_check >= 256 || touched.len() > 4;
            if full {
                self.since_full_check = 0;
            }
            self.check_todos(&touched, full);
        }
        self.check_processes();
    }

    /// The server's invariants, over one todo or all: the ledger's own, nothing lost, history
    /// immutable, died exactly when the lease lapsed, dead letters only at the cap.
    fn check_todos(&mut self, touched: &BTreeSet<String>, full: bool) {
        if full {
            if let Err(e) = self.ledger.check() {
                self.violate(Kind::Correctness, "ledger_check", e);
                return;
            }
            // No todo lost or duplicated: ids are unique in the ledger, and none is ever deleted.
            let held = self.ledger.todos().count();
            if held != self.added.len() {
                self.violate(
                    Kind::Correctness,
                    "no_todo_lost",
                    format!("{} todos added, the ledger holds {held}", self.added.len()),
                );
                return;
            }
        }
        let mut problems = Vec::new();
        for t in touched.iter().filter_map(|id| self.ledger.todo(id)) {
            if let Err(e) = relay_core::ledger::check_todo(t, self.ledger.attempts(&t.id)) {
                problems.push(("ledger_check", format!("todo {}: {e}", t.id)));
            }
            if t.dead_letter() && t.attempt < t.max_attempts {
                problems.push((
                    "dead_letter_at_cap",
                    format!(
                        "{} dead-lettered at attempt {}/{}",
                        t.id, t.attempt, t.max_attempts
                    ),
                ));
            }
            for a in self.ledger.attempts(&t.id).filter(|a| !a.is_open()) {
                let ended = a.ended_at.unwrap_or(0);
                let lapsed = ended >= a.lease_expires_at;
                let reported = matches!(
                    a.outcome,
                    Some(Outcome::Completed | Outcome::Failed | Outcome::Released)
                );
                if a.died() && !lapsed || reported && lapsed {
                    problems.push((
                        "died_iff_lapsed",
                        format!(
                            "{} seq {} closed {:?} at {} with the lease until {}",
                            t.id, a.seq, a.outcome, ended, a.lease_expires_at
                        ),
                    ));
                }
                let key = (t.id.clone(), a.seq);
                match self.closed.get(&key) {
                    Some(seen) if seen != a => problems.push((
                        "closed_once",
                        format!("{} seq {} changed after it closed", t.id, a.seq),
                    )),
                    Some(_) => {}
                    None => {
                        self.closed.insert(key, a.clone());
                    }
                }
            }
        }
        if let Some((inv, detail)) = problems.into_iter().next() {
            self.violate(Kind::Correctness, inv, detail);
        }
    }

    /// Processes: none outlives its relay's lease, or the server's, by more than a second (and
    /// the drift bound), and no two relays run a process for one todo while each believes its
    /// lease valid.
    fn check_processes(&mut self) {
        let mut problems = Vec::new();
        let tolerance = self.o.lease_ttl * MAX_DRIFT_PPM as u64 / 1_000_000 + 1;
        let mut holders: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for (r, h) in self.hosts.iter().enumerate() {
            let (Some(p), Some(m)) = (&h.proc, &h.relay) else {
                continue;
            };
            if p.signalled || h.paused {
                continue;
            }
            if h.refused.contains(&p.run_id) {
                problems.push((
                    "stops_on_refusal",
                    format!(
                        "relay {r}'s process for {} runs on after the server refused its heartbeat",
                        p.todo
                    ),
                ));
            }
            // The truth, whatever the relay believes: the server's own expiry of the attempt
            // (its last accepted claim or heartbeat + ttl, on the server's clock).
            let expiry = h.runs.get(&p.run_id).and_then(|run| {
                self.ledger
                    .attempts(&run.todo)
                    .find(|a| a.seq == run.seq)
                    .map(|a| a.lease_expires_at)
            });
            if let Some(expiry) = expiry
                && self.now > expiry + tolerance + SECOND
            {
                problems.push((
                    "stops_by_server_expiry",
                    format!(
                        "relay {r}'s process for {} runs at {} although the server's lease ended at {expiry}",
                        p.todo, self.now
                    ),
                ));
            }
            let local = h.machine_clock(self.o.mutation).read(self.now);
            match m.lease_deadline() {
                Some(d) if local <= d + SECOND => {
                    if local + tolerance < d {
                        holders.entry(p.todo.as_str()).or_default().push(r);
                    }
                }
                d => problems.push((
                    "process_within_lease",
                    format!(
                        "relay {r}'s process for {} runs at local {} with lease deadline {:?}",
                        p.todo, local, d
                    ),
                )),
            }
        }
        for (todo, rs) in holders {
            if rs.len() > 1 {
                problems.push((
                    "one_holder",
                    format!("relays {rs:?} both run {todo} under a lease they believe valid"),
                ));
            }
        }
        if let Some((inv, detail)) = problems.into_iter().next() {
            self.violate(Kind::Correctness, inv, detail);
        }
    }
}

fn cmd_name(cmd: &Command) -> &'static str {
    match cmd {
        Command::WriteContextFile { .. } => "the context file",
        Command::Spawn { .. } => "the process's argv or environment",
        Command::RunCheck { .. } => "the check's argv or environment",
        Command::WriteRunRecord { .. } => "a run record",
        Command::UploadReceipt { .. } => "a receipt",
        Command::Emit { .. } => "an event",
        Command::WarnRunLog { .. } => "the run log",
        _ => "a command",
    }
}
