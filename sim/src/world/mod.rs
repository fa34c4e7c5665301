//! The simulated world: one queue server (the ledger, its reaper and retry requeue), N relay
//! hosts (a relay machine each, with a modelled agent process and success check), a network
//! between them, a clock per host, and the plan's faults. Events are ordered by (time, seq) and
//! the clock jumps from one to the next; every invariant is checked after every event.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};

use relay_core::config::{OperatingHours, Schedule, within_hours};
use relay_core::doorbell::{self, Gate, Offer, worth_a_ring};
use relay_core::fleet::Timetable;
use relay_core::grant::Grant;
use relay_core::ledger::flow::Limits;
use relay_core::ledger::{self, Actor, Attempt, Budget, Ledger, LedgerConfig, NewTodo, Op, Todo};
use relay_core::relay::{
    Capabilities, Command, ExitStatus, HarnessSettings, Input, LeaseError, OnOverlap, Relay,
    RequestId, SuccessCheck, reconcile_interrupted,
};
use relay_core::time::{HOUR, MINUTE, Millis, Mono, SECOND};
use serde_json::{Value, json};

use crate::options::{ANSWER_WITHIN_MAX, MAX_DRIFT_PPM, Options, Surface};
use crate::plan::{Fault, Plan, Work};
use crate::rng::Rng;

mod checks;
mod host;
mod net;
mod people;
mod queue;
mod relay;
mod reload;
mod tasks;

use relay_core::relay::invariants::Monitor;

use host::{Host, HostClock, HostConfig};

/// Where simulated time starts (an ordinary instant in 2026).
pub const T0: Millis = 1_790_000_000_000;
/// How long the lease client waits for an answer before it calls the request failed.
pub const REQUEST_TIMEOUT: Millis = 10 * SECOND;
const ENDPOINT: &str = "sim";
/// The queue of the runs without several, and of the tasks.
const QUEUE: &str = crate::options::QUEUES[0];

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
    /// The schedule's clock (not a host event: it keeps ticking while a host is down), of
    /// one chain of ticks (`Host::tick_gen`).
    Tick {
        relay: usize,
        generation: u64,
    },
    /// A firing on the host: the schedule's or the doorbell's.
    Fire(usize),
    Timer {
        relay: usize,
        generation: u64,
    },
    /// A `tools/call` reaching the server: its params, as the lease client sends them.
    ServerRecv {
        relay: usize,
        life: u32,
        req: RequestId,
        params: Value,
    },
    /// The `tools/call` result reaching the lease client.
    ClientRecv {
        relay: usize,
        life: u32,
        req: RequestId,
        result: Value,
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
        command: Command,
    },
    /// An operator answers todo `id`'s question (`repeat`: again, under the same key, after
    /// the first reply was lost).
    Answer {
        id: String,
        text: String,
        key: String,
        repeat: bool,
    },
    /// Task client `n` acts.
    Task {
        n: usize,
        act: tasks::Act,
    },
    /// The server goes on with a task method it stalled before its write.
    TaskStep(u64),
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
    /// What the run's agent spends, once it is spawned.
    spend: Option<people::Spend>,
    /// The driver's reading of the agent's usage file (its one warning per attempt).
    usage_file: relay_core::relay::usage::UsageFile,
}

/// An answer the ledger accepted: kept on the attempt that asked, exactly so, for good.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Given {
    text: String,
    key: String,
    /// Who gave it, as the attempt records it (`operator:cli`, or a task's `endpoint:sim`).
    by: String,
}

#[derive(Clone, Debug)]
struct Pending {
    run_id: u64,
    /// The lease command the request carries out: its answer is read for it.
    command: Command,
}

/// The agent's world: has the todo's fix landed (the check's truth)?
#[derive(Default)]
struct Truth {
    fixed: BTreeSet<String>,
}

pub struct World {
    o: Options,
    /// The true time, which the queue server reads as its one clock (a bare `Millis`, as the
    /// ledger keeps it); each host's [`Mono`] and wall clocks read their own from it.
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
    /// The MCP task clients, by task number, and their stream; the task secrets' stream.
    clients: Vec<tasks::Client>,
    tasking: Rng,
    secrets: Rng,
    /// Task methods the server stalled between their read and their write, by call number.
    calls: BTreeMap<u64, (tasks::Call, Op)>,
    next_call: u64,
    /// Per task's todo, the terminal status first seen, and whether it was a dead letter.
    task_ends: BTreeMap<String, (relay_core::task::TaskStatus, bool)>,
    /// Print every event and command to stderr (`relay sim --trace`).
    pub trace: bool,
    /// The todos the server changed since their invariants were last checked.
    touched: BTreeSet<String>,
    /// Server events since the last full check of the ledger.
    since_full_check: u32,
    /// The server's doorbell gate, one session per relay lifetime.
    gate: Gate,
    /// Each relay's harness schedule (`@every fire_every`) and its next firing on the host's
    /// wall clock, kept by the daemon's rule.
    timetables: Vec<Timetable>,
    /// What the server shows each relay (its surface), and what each relay's endpoint was
    /// granted; built once.
    caps: Vec<Capabilities>,
    grants: Vec<Grant>,
    /// The agents' questions and spend.
    asking: Rng,
    /// The operators who answer questions.
    answering: Rng,
    /// Every answer the ledger accepted, by todo and the seq of the attempt that asked.
    given: BTreeMap<(String, u32), Given>,
    /// Per todo, its spend when last checked, and whether (since which attempt, under which
    /// budget) it had reached its budget.
    spend: BTreeMap<String, checks::SpendSeen>,
    /// Each queue's limits as its operator set them last (what the ledger was asked to keep;
    /// the limit canary hands it others).
    limits: BTreeMap<String, Limits>,
    /// Per todo, its `attempts_total` when last checked: each attempt opened since is a claim.
    claims_seen: BTreeMap<String, u32>,
    /// Per queue, the times of the claims made while its operator's limits had a rate limit,
    /// within the last window (forgotten when the queue's limits are all lifted, as the
    /// ledger forgets them).
    rate_log: BTreeMap<String, Vec<Millis>>,
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
                mono: HostClock::new(
                    setup.range(MINUTE, 30 * 24 * HOUR) as i64 - T0 as i64,
                    drift(&mut setup),
                ),
                wall: HostClock::new(0, drift(&mut setup)),
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
                monitor: Monitor::new(o.lease_ttl),
                hours: None,
                refused: BTreeSet::new(),
                config: HostConfig {
                    heartbeat_interval: o.heartbeat_interval,
                    fire_every: o.fire_every,
                },
                tick_gen: 0,
                reload_waiting: false,
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
            gate: Gate::new(doorbell::WINDOW),
            timetables: Vec::new(),
            caps: (0..o.relays).map(|r| World::surface(&o, r).0).collect(),
            grants: (0..o.relays).map(|r| World::surface(&o, r).1).collect(),
            asking: Rng::stream(o.seed, "asking"),
            answering: Rng::stream(o.seed, "answering"),
            given: BTreeMap::new(),
            spend: BTreeMap::new(),
            clients: vec![tasks::Client::default(); o.tasks.count],
            tasking: Rng::stream(o.seed, "task-clients"),
            secrets: Rng::stream(o.seed, "task-secrets"),
            calls: BTreeMap::new(),
            next_call: 0,
            task_ends: BTreeMap::new(),
            limits: BTreeMap::new(),
            claims_seen: BTreeMap::new(),
            rate_log: BTreeMap::new(),
            o,
        };
        // The operator sets each queue's limits before any work arrives.
        for (queue, limits) in w.o.flow.queues.clone() {
            if !limits.is_empty() {
                w.count("flow_limited_queue");
                w.set_limits(&queue, limits);
            }
        }
        for r in 0..w.hosts.len() {
            let windows = w.o.hours.get(r).filter(|h| !h.is_empty());
            match windows.map(|h| OperatingHours::parse(h)).transpose() {
                Ok(hours) => w.hosts[r].hours = hours,
                Err((i, e)) => w.violate(Kind::Correctness, "options", format!("hours[{i}] {e}")),
            }
        }
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
            let every = Schedule::Every(w.o.fire_every);
            let table = Timetable::starting_at(every, w.hosts[r].wall.read(first));
            w.timetables.push(table);
            let generation = w.hosts[r].tick_gen;
            w.schedule(
                first,
                Ev::Tick {
                    relay: r,
                    generation,
                },
            );
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

    /// Relay `r`'s harness settings, from its host's config as it reads now.
    fn settings(&self, r: usize) -> HarnessSettings {
        let o = &self.o;
        let config = self.hosts[r].config;
        HarnessSettings {
            harness: format!("worker-{r}"),
            host: format!("host-{r}"),
            lease: "queue.sim".into(),
            // With several queues, every relay claims from all of them.
            queue: (o.flow.queues.len() <= 1).then(|| QUEUE.into()),
            lease_ttl: o.lease_ttl,
            heartbeat_interval: config.heartbeat_interval,
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
            // The simulated agent exits 3 now and then: a failure not worth retrying.
            non_retryable_exit_codes: vec![3],
        }
    }

    /// What relay `r`'s endpoint was granted (the relay's verbs on the one queue, and
    /// `request_input` where it may ask), and what the server's `tools/list` shows it, read as
    /// the daemon reads it: our server's schemas for those verbs, or (for a relay whose source
    /// declares only the contract's table) the contract's arguments and `fail`'s failure class.
    fn surface(o: &Options, r: usize) -> (Capabilities, Grant) {
        let mut verbs = vec!["claim_next", "heartbeat", "complete", "fail"];
        if o.release_granted {
            verbs.push("release");
        }
        let surface = o.surface(r);
        if surface == Surface::Asks {
            verbs.push("request_input");
        }
        let verbs: Vec<String> = verbs.into_iter().map(str::to_string).collect();
        let grant = Grant::new(&verbs, Some(World::queues(o)));
        let caps = match surface {
            Surface::Contract => {
                let mut caps = Capabilities::full(o.release_granted);
                if let Some(fail) = caps.declared.get_mut("fail") {
                    fail.extend(["retryable".to_string(), "failure_signature".to_string()]);
                }
                caps
            }
            Surface::Spend | Surface::Asks => {
                relay_core::relay::check_capabilities(&relay_core::wire::tools_list(&grant.tools()))
            }
        };
        (caps, grant)
    }

    /// The run's queues: those the flow options name, or `work` alone.
    fn queues(o: &Options) -> Vec<String> {
        if o.flow.queues.is_empty() {
            vec![QUEUE.to_string()]
        } else {
            o.flow.queues.iter().map(|(q, _)| q.clone()).collect()
        }
    }

    fn start_relay(&mut self, r: usize) {
        let settings = self.settings(r);
        let seed = self.o.seed ^ (r as u64) << 32 ^ u64::from(self.hosts[r].life);
        let first = self.hosts[r].next_run_id;
        let mut relay = Relay::new(settings, seed, first);
        let now = self.hosts[r].now(self.now, self.o.mutation);
        let input = Input::CapabilitiesKnown(self.caps[r].clone());
        let h = &mut self.hosts[r];
        h.monitor.input(h.mono.read(self.now), &input);
        if let Err(e) = relay.handle_input(now, input) {
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
        if self.violation.is_none() {
            self.check_task_ends();
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
        self.added.len() == self.o.todos + self.o.tasks.count
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
                let requeue = Op::RequeueDue { now: self.now };
                match self.ledger.apply(requeue).and_then(ledger::Answer::todos) {
                    Ok(moved) if !moved.is_empty() => {
                        self.touched.extend(moved.iter().map(|t| t.id.clone()));
                        for t in moved.iter().filter(|t| t.dead_letter()) {
                            match t.dead_letter_reason {
                                Some(ledger::DeadLetterReason::NoAnswer) => {
                                    self.count("no_answer_dead_letter");
                                }
                                _ => self.count("deadline_dead_letter"),
                            }
                        }
                        let (due, _): (Vec<Todo>, Vec<Todo>) =
                            moved.into_iter().partition(|t| !t.dead_letter());
                        self.ring(&due, Offer::Requeued);
                    }
                    Ok(_) => {}
                    Err(e) => self.violate(Kind::Correctness, "server", e.to_string()),
                }
                // The server's doorbell sweep runs beside the requeue: owed rings go out.
                self.flush_doorbell();
                self.schedule(self.now + self.o.requeue_every, Ev::Requeue);
            }
            Ev::Tick {
                relay: r,
                generation,
            } => {
                if self.hosts[r].tick_gen != generation {
                    return;
                }
                // Due and next on the host's wall clock, by the daemon's rule (a stepped or
                // drifting wall clock moves the firings with it; one stepped back waits).
                let wall = &self.hosts[r].wall;
                let due = self.timetables[r].due(wall.read(self.now));
                let next = self.timetables[r]
                    .next()
                    .expect("every relay has a schedule");
                let at = wall.when(next).max(self.now + 1);
                if due {
                    self.schedule(self.now, Ev::Fire(r));
                } else {
                    self.count("schedule_waits");
                }
                self.schedule(
                    at,
                    Ev::Tick {
                        relay: r,
                        generation,
                    },
                );
            }
            Ev::Fire(r) => {
                // Hours are read on the host's wall clock, as the daemon reads them.
                let wall = self.hosts[r].wall.read(self.now);
                let within_hours = within_hours(self.hosts[r].hours.as_ref(), wall);
                if !within_hours {
                    self.count("outside_hours");
                }
                self.feed(
                    r,
                    Input::Firing {
                        trigger: "schedule".into(),
                        within_hours,
                    },
                );
            }
            Ev::Timer { relay, generation } => {
                if self.hosts[relay].timer_gen == generation && self.hosts[relay].relay.is_some() {
                    self.feed(relay, Input::TimerFired);
                }
            }
            Ev::ServerRecv {
                relay,
                life,
                req,
                params,
            } => self.on_server_recv(relay, life, req, &params),
            Ev::ClientRecv {
                relay,
                life,
                req,
                result,
            } => self.on_client_recv(relay, life, req, &result),
            Ev::ClientTimeout { relay, life, req } => {
                if self.hosts[relay].life == life
                    && let Some(p) = self.hosts[relay].pending.remove(&req)
                {
                    self.answer(relay, &p, Err(LeaseError::Transport));
                }
            }
            Ev::LateSend {
                relay,
                life,
                req,
                run_id,
                command,
            } => {
                if self.hosts[relay].life == life {
                    self.check_late_send(relay, run_id);
                    self.send(relay, req, run_id, command);
                }
            }
            Ev::Local { relay, life, input } => {
                if self.hosts[relay].life == life && self.hosts[relay].relay.is_some() {
                    self.on_local(relay, input);
                }
            }
            Ev::Answer {
                id,
                text,
                key,
                repeat,
            } => self.operator_answers(&id, text, key, repeat),
            Ev::Task { n, act } => self.task_act(n, act),
            Ev::TaskStep(call) => self.task_step(call),
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
            | Ev::Restart(r)
            | Ev::Fault(Fault::Reload { relay: r, .. }) => Some(*r),
            _ => None,
        }
    }

    fn on_work(&mut self, w: Work) {
        let op = Actor::cli();
        match w {
            Work::Add(n) => {
                let id = todo_id(n);
                let (max_input_requests, answer_within_seconds, budget) = self.todo_people(n);
                let (queue, concurrency_key) = self.todo_flow(n);
                let new = NewTodo {
                    id: id.clone(),
                    queue,
                    concurrency_key,
                    title: format!("fix thing {n}"),
                    payload: Some(json!({"n": n})),
                    max_attempts: Some(self.o.max_attempts),
                    // Every add is keyed, as a webhook's would be; every third has a time
                    // budget of about two leases' worth of attempts.
                    idempotency_key: Some(format!("event-{n}")),
                    deadline_seconds: n.is_multiple_of(3).then(|| self.o.lease_ttl / 1000 * 8),
                    max_input_requests,
                    answer_within_seconds,
                    budget,
                    ..NewTodo::default()
                };
                let add = Op::AddTodo {
                    now: self.now,
                    endpoint: ENDPOINT.into(),
                    new: new.clone(),
                };
                match self.ledger.apply(add).and_then(ledger::Answer::todo) {
                    Ok(t) => {
                        self.touched.insert(id.clone());
                        self.added.insert(id);
                        self.ring(&[t], Offer::Fresh);
                    }
                    Err(e) => self.violate(Kind::Correctness, "server", e.to_string()),
                }
                // The event delivered twice: the repeat answers the first todo, adds nothing.
                let repeat = Op::AddTodo {
                    now: self.now,
                    endpoint: ENDPOINT.into(),
                    new: NewTodo {
                        id: format!("{}_again", todo_id(n)),
                        ..new
                    },
                };
                match self.ledger.apply(repeat) {
                    Ok(ledger::Answer::Existing(t)) if t.id == todo_id(n) => {
                        self.count("idempotent_repeat");
                    }
                    other => self.violate(
                        Kind::Correctness,
                        "idempotent_add",
                        format!("a repeated add of {} answered {other:?}", todo_id(n)),
                    ),
                }
            }
            Work::Cancel(n) if !self.healed => {
                self.touched.insert(todo_id(n));
                let (now, actor, id) = (self.now, op.clone(), todo_id(n));
                if self.ledger.apply(Op::Cancel { now, actor, id }).is_ok() {
                    self.count("operator_cancel");
                }
            }
            Work::Retry(n) if !self.healed => {
                self.touched.insert(todo_id(n));
                let (now, actor, id) = (self.now, op.clone(), todo_id(n));
                let retry = Op::Retry { now, actor, id };
                if let Ok(t) = self.ledger.apply(retry).and_then(ledger::Answer::todo) {
                    self.count("operator_retry");
                    self.ring(&[t], Offer::Requeued);
                }
            }
            Work::Cancel(_) | Work::Retry(_) => {}
            Work::Limits { queue, limits } => {
                self.count("limits_changed");
                self.set_limits(&queue, limits);
            }
            Work::Task(n) => self.task_act(n, tasks::Act::Add { replay: false }),
            Work::CancelTask(n) if !self.healed => self.operator_on_task(n, true),
            Work::RetryTask(n) if !self.healed => self.operator_on_task(n, false),
            Work::CancelTask(_) | Work::RetryTask(_) => {}
        }
    }

    /// The doorbell, as the server rings it: each todo a change made claimable is offered to
    /// the gate for every running relay's session; a ring reaches its host shortly after, as a
    /// firing.
    fn ring(&mut self, todos: &[Todo], offer: Offer) {
        for t in todos.iter().filter(|t| worth_a_ring(t)) {
            for r in 0..self.hosts.len() {
                if self.hosts[r].relay.is_none() {
                    continue;
                }
                let session = self.session(r);
                if self.gate.offer(&session, &t.id, &t.queue, offer, self.now) {
                    self.deliver_ring(r);
                }
            }
        }
    }

    /// The owed rings whose window has passed.
    fn flush_doorbell(&mut self) {
        for (session, _) in self.gate.flush(self.now) {
            if let Some(r) = (0..self.hosts.len()).find(|r| self.session(*r) == session) {
                self.count("owed_ring");
                self.deliver_ring(r);
            }
        }
    }

    fn deliver_ring(&mut self, r: usize) {
        self.count("ring");
        let at = self.now + self.net.range(1, 500);
        self.schedule(at, Ev::Fire(r));
    }

    /// A relay's doorbell session: one per lifetime (a restarted daemon opens a new one).
    fn session(&self, r: usize) -> String {
        format!("relay-{r}.{}", self.hosts[r].life)
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
                let session = self.session(relay);
                self.gate.forget(&session);
                let h = &mut self.hosts[relay];
                // The host dies with its processes; its volatile state is gone, the journal
                // stays, and a run left `running` is reconciled as interrupted on restart.
                h.relay = None;
                h.proc = None;
                h.check = None;
                h.pending.clear();
                h.refused.clear();
                h.reload_waiting = false;
                h.paused = false;
                h.deferred.clear();
                h.life += 1;
                h.timer_gen += 1;
                let wall = h.wall.read(self.now + down);
                for rec in h.journal.values_mut() {
                    *rec = reconcile_interrupted(rec.clone(), wall);
                }
                if let Some(uptime) = reboot {
                    h.mono.set(self.now + down, Mono::from_ms(uptime));
                }
                self.schedule(self.now + down, Ev::Restart(relay));
            }
            Fault::Pause { relay, len } => {
                if self.hosts[relay].relay.is_some() && !self.hosts[relay].paused {
                    self.hosts[relay].paused = true;
                    self.schedule(self.now + len, Ev::Resume(relay));
                }
            }
            Fault::Reload {
                relay,
                heartbeat_interval,
                fire_every,
            } => self.reload(
                relay,
                HostConfig {
                    heartbeat_interval,
                    fire_every,
                },
            ),
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
        self.feed(r, Input::TimerFired);
    }
}
