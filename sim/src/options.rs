//! What a run looks like, drawn from its seed and printed at its start.
//!
//! "Swarm" testing: each seed switches whole fault kinds off, so that some runs are dominated by
//! one kind of trouble and the combinations vary from seed to seed.

use std::fmt;

use serde::{Deserialize, Serialize};

use relay_core::ledger::flow::Limits;
use relay_core::time::{HOUR, MINUTE, Millis, SECOND};

use crate::rng::Rng;

relay_core::names! {
    /// A deliberate bug, to prove that the invariants catch it (the simulator's canaries).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
    #[serde(rename_all = "kebab-case")]
    pub enum Mutation {
        /// The relay driver treats a heartbeat `conflict`/`not_found` as success.
        IgnoreHeartbeatConflict => "ignore-heartbeat-conflict",
        /// The server accepts heartbeats and reports without comparing the fence.
        ServerSkipsFence => "server-skips-fence",
        /// The relay driver holds every report back until its lease deadline has passed.
        ReportAfterDeadline => "report-after-deadline",
        /// The reaper closes each reaped attempt a second time.
        ReaperClosesTwice => "reaper-closes-twice",
        /// The relay driver hands the machine its wall clock as the monotonic one: every deadline
        /// moves with a wall-clock step.
        DeadlinesOnWallClock => "deadlines-on-wall-clock",
        /// The server acknowledges an operator's answer and makes the todo pending again, but does
        /// not keep the answer on the attempt that asked.
        AnswerDropped => "answer-dropped",
        /// The server applies a task's `tasks/cancel` even when the task has ended (it skips
        /// `TaskServing`'s check of a terminal status): a finished todo becomes canceled.
        TaskCancelOverrides => "task-cancel-overrides",
        /// The server hands the ledger each queue's limits raised by one (an off-by-one in the
        /// limit's check): a queue takes one claim more than its operator allowed.
        LimitOffByOne => "limit-off-by-one",
    }
}

relay_core::names! {
    /// What a relay's lease source shows it in `tools/list`, which decides what its daemon sends.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
    #[serde(rename_all = "snake_case")]
    pub enum Surface {
        /// Only the contract table's arguments (and `fail`'s failure class): no `usage`, no
        /// `request_input`, as a server that declares nothing more shows it.
        Contract => "contract",
        /// Our server's schemas to an endpoint not granted `request_input`: `usage` on the heartbeat
        /// and every report, no `request_input` (an agent's question goes out as a retryable fail,
        /// `needs_input_unsupported`).
        Spend => "spend",
        /// Our server's schemas to an endpoint granted `request_input` too: it may ask.
        Asks => "asks",
    }
}

/// People in the loop, and what agents spend: how often an agent asks a question, how the
/// operators answer, which todos carry a spend budget, and what each relay's source shows it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct People {
    /// Per mille of agent runs that end by asking a question (`needs_input`); 0: none asks.
    pub ask: u32,
    /// An operator answers a question within this long of its asking (drawn per question).
    pub answer_delay_max: Millis,
    /// Per mille of questions, on todos with an answer deadline, that nobody ever answers.
    pub unanswered: u32,
    /// Per mille of operators' answers repeated under their key (the first reply was lost).
    pub repeat: u32,
    /// Per mille of todos added with a spend budget.
    pub budgets: u32,
    /// Per relay, what its lease source shows it.
    pub surfaces: Vec<Surface>,
}

/// MCP task clients (the Tasks extension): how many todos they add as tasks, and how they
/// behave. Each task has a client of its own, which polls it until it ends.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Tasks {
    /// Todos added as MCP tasks, besides `todos` (0: no client declares the extension).
    pub count: usize,
    /// The poll interval the server suggests (`pollIntervalMs`); a client keeps about it.
    pub poll: Millis,
    /// Per mille of adds whose `CreateTaskResult` is lost: the client adds again, same key.
    pub replay: u32,
    /// Per mille of polls of a live task at which its client cancels it.
    pub cancel: u32,
    /// Per mille of input requests a client declines at first (it accepts at a later poll).
    pub decline: u32,
    /// Per mille of task methods whose write the server applies only after a stall (another
    /// request's transaction may commit between the method's read and its write).
    pub stall: u32,
}

/// Flow control: the queues the todos go to, the limits each starts with, and the concurrency
/// keys the todos carry. The default (no queue named) is the one queue `work`, without limits,
/// and no keys: the runs drawn before flow control existed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Flow {
    /// Every queue with its limits at the start, `work` (where the tasks go) first.
    pub queues: Vec<(String, Limits)>,
    /// How many concurrency keys the keyed todos draw theirs from (`key-0`, `key-1`, …).
    pub keys: u32,
    /// Per mille of todos added with a key.
    pub keyed: u32,
    /// Whether an operator changes a queue's limits now and then during the faulted phase.
    pub changes: bool,
}

/// The names of the queues a run may have, `work` first.
pub const QUEUES: [&str; 3] = ["work", "batch", "urgent"];

impl Flow {
    /// Whether any queue has limits, at the start or after a change.
    pub fn limited(&self) -> bool {
        self.changes || self.queues.iter().any(|(_, l)| !l.is_empty())
    }

    /// Whether rate limits may hold claims back.
    fn rated(&self) -> bool {
        self.changes
            || self
                .queues
                .iter()
                .any(|(_, l)| l.claims_per_minute.is_some())
    }

    /// A queue's limits, drawn: now and then none; each limit on or off, tight when on
    /// (`max_claimed` 1 to 4, `max_claimed_per_key` 1 to 3, `claims_per_minute` 1 to 4, which
    /// a few relays firing every minute or so reach).
    pub fn draw_limits(r: &mut Rng) -> Limits {
        if r.chance(200) {
            return Limits::default();
        }
        let some =
            |r: &mut Rng, per_mille, lo, hi| r.chance(per_mille).then(|| r.range(lo, hi) as u32);
        Limits {
            max_claimed: some(r, 600, 1, 4),
            max_claimed_per_key: some(r, 600, 1, 3),
            claims_per_minute: some(r, 300, 1, 4),
        }
    }
}

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
    /// A host's config reloaded with a changed heartbeat interval and schedule (drawn from a
    /// stream of its own, so that the other kinds are drawn as before).
    #[serde(default)]
    pub reloads: bool,
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
            reloads: true,
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
    /// Questions, answers and spend (drawn from a stream of their own).
    #[serde(default)]
    pub people: People,
    /// MCP task clients (drawn from a stream of their own).
    #[serde(default)]
    pub tasks: Tasks,
    /// Queues, their limits, and concurrency keys (drawn from a stream of their own).
    #[serde(default)]
    pub flow: Flow,
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

/// The longest answer deadline (`answer_within_seconds`) a todo is added with.
pub const ANSWER_WITHIN_MAX: Millis = 2 * HOUR;

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
            reloads: Rng::stream(seed, "reloads").chance(500),
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
            people: People::default(),
            tasks: Tasks::default(),
            flow: Flow::default(),
        }
        .with_people(seed)
        .with_tasks(seed)
        .with_flow(seed)
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
        o.with_people(seed)
            .with_tasks(seed)
            .with_flow(seed)
            .with_hours(seed)
    }

    /// Draws the people and spend options from their own stream (the others stay as the seed
    /// drew them before agents asked): swarm again, so that some seeds have no agent that asks,
    /// no operator who leaves a question unanswered, or no budget.
    fn with_people(mut self, seed: u64) -> Options {
        let mut r = Rng::stream(seed, "people");
        let ask = if r.chance(650) {
            r.range(40, 250) as u32
        } else {
            0
        };
        let answer_delay_max = r.range(2, 90) * MINUTE;
        let unanswered = if r.chance(600) {
            r.range(200, 700) as u32
        } else {
            0
        };
        let repeat = if r.chance(700) {
            r.range(200, 700) as u32
        } else {
            0
        };
        let budgets = if r.chance(550) {
            r.range(200, 700) as u32
        } else {
            0
        };
        let surfaces = (0..self.relays)
            .map(|_| match r.below(10) {
                0..=4 => Surface::Asks,
                5..=7 => Surface::Spend,
                _ => Surface::Contract,
            })
            .collect();
        self.people = People {
            ask,
            answer_delay_max,
            unanswered,
            repeat,
            budgets,
            surfaces,
        };
        self
    }

    /// Draws the task clients from their own stream (the other options stay as the seed drew
    /// them before tasks existed). Swarm: some seeds have none, some never cancel or decline,
    /// and the server's stalls come and go.
    fn with_tasks(mut self, seed: u64) -> Options {
        let mut r = Rng::stream(seed, "tasks");
        let on = |r: &mut Rng, per_mille, lo, hi| {
            if r.chance(per_mille) {
                r.range(lo, hi) as u32
            } else {
                0
            }
        };
        let count = if r.chance(750) {
            r.range(1, 4) as usize
        } else {
            0
        };
        let poll = r.range(30, 300) * SECOND;
        self.tasks = Tasks {
            count,
            poll,
            replay: on(&mut r, 700, 200, 600),
            cancel: on(&mut r, 600, 20, 150),
            decline: on(&mut r, 700, 300, 700),
            stall: on(&mut r, 600, 100, 500),
        };
        self
    }

    /// Draws the queues, their limits and the concurrency keys from their own stream (the other
    /// options stay as the seed drew them before flow control existed). Swarm: some seeds have
    /// the one queue without limits and no keys, as before; the others one to three queues,
    /// most with tight limits, and keys from a small set.
    fn with_flow(mut self, seed: u64) -> Options {
        let mut r = Rng::stream(seed, "flow");
        if !r.chance(650) {
            self.flow = Flow::default();
            return self;
        }
        let n = r.range(1, QUEUES.len() as u64) as usize;
        let queues = QUEUES[..n]
            .iter()
            .map(|q| (q.to_string(), Flow::draw_limits(&mut r)))
            .collect();
        let (keys, keyed) = if r.chance(850) {
            (r.range(1, 4) as u32, r.range(300, 1000) as u32)
        } else {
            (0, 0)
        };
        self.flow = Flow {
            queues,
            keys,
            keyed,
            changes: r.chance(400),
        };
        self
    }

    /// What relay `r`'s lease source shows it (the contract's surface for a relay the options
    /// name none for: a plan saved before agents asked).
    pub fn surface(&self, r: usize) -> Surface {
        self.people
            .surfaces
            .get(r)
            .copied()
            .unwrap_or(Surface::Contract)
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
    ///
    /// Where agents ask, a todo's questions add attempts that do not count against
    /// `max_attempts` (up to its question budget, and the one past it that dead-letters), and
    /// each question waits for its answer or for its answer deadline: the todos wait side by
    /// side, a todo's questions one after another.
    ///
    /// Where queues have limits, the worst case is one todo at a time (every todo under one key
    /// with `max_claimed_per_key` 1), worked by the relay open longest; a rate limit may hold
    /// each claim back for its window and the next firing.
    fn liveness_bound_for(&self, minutes_open: &[u64]) -> Millis {
        let mut attempt =
            self.agent_timeout.unwrap_or(self.agent_max) + self.fire_every + self.lease_ttl;
        // A rate limit may hold a claim back for its window, then until the next firing.
        if self.flow.rated() {
            attempt += MINUTE + self.fire_every;
        }
        let questions = if self.people.ask > 0 {
            u64::from(relay_core::ledger::MAX_INPUT_REQUESTS_DEFAULT) + 1
        } else {
            0
        };
        let attempts = u64::from(self.max_attempts) + questions;
        let work = attempt * (self.todos + self.tasks.count) as u64 * attempts;
        let wait = questions * self.people.answer_delay_max.max(ANSWER_WITHIN_MAX);
        // Limits may let only one todo run at a time (one key, `max_claimed_per_key` 1): then
        // the relays do not work side by side, and only one of them may be open at a time.
        let open_minutes_an_hour: u64 = if self.flow.limited() {
            minutes_open.iter().copied().max().unwrap_or(0)
        } else {
            minutes_open.iter().sum()
        };
        (work * 60 / open_minutes_an_hour.max(1) + wait).max(24 * HOUR)
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
             operators={} reloads={}",
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
            fl.operators,
            fl.reloads
        )?;
        let p = &self.people;
        let surfaces: Vec<&str> = p.surfaces.iter().map(|s| s.as_str()).collect();
        write!(
            f,
            "\npeople: ask={}‰ answer_delay_max={} unanswered={}‰ repeat={}‰ budgets={}‰ \
             surfaces={}",
            p.ask,
            s(p.answer_delay_max),
            p.unanswered,
            p.repeat,
            p.budgets,
            surfaces.join(",")
        )?;
        let t = &self.tasks;
        if t.count > 0 {
            write!(
                f,
                "\ntasks: count={} poll={} replay={}‰ cancel={}‰ decline={}‰ stall={}‰",
                t.count,
                s(t.poll),
                t.replay,
                t.cancel,
                t.decline,
                t.stall
            )?;
        }
        let fl = &self.flow;
        if !fl.queues.is_empty() {
            let queues: Vec<String> = fl
                .queues
                .iter()
                .map(|(q, l)| format!("{q} ({})", l.describe()))
                .collect();
            write!(
                f,
                "\nflow: queues={} keys={} keyed={}‰ changes={}",
                queues.join(", "),
                fl.keys,
                fl.keyed,
                fl.changes
            )?;
        }
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
