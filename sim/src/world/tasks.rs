//! MCP task clients (the Tasks extension). Each adds one todo as a task (`add_todo` through
//! core's `Serving`, declaring the extension), then polls it (`tasks/get`), answers its input
//! requests (`tasks/update`: accepted, declined, repeated, or under a stale key), now and then
//! cancels it (`tasks/cancel`, whatever its state) and presents ids that name no task of its
//! own, every method served by core's `TaskServing` over the ledger, as the server serves it.
//! The relays work the todos like any other.
//!
//! The server applies a method's read and its write in two transactions; now and then it stalls
//! between them (for up to two minutes), so that a report or a sweep may commit in between.
//!
//! Around each call the simulator holds the task to its todo: the status a poll answers is the
//! todo's at that instant; a terminal status never changes; a cancel never undoes a completion
//! that committed first; an accepted answer is applied at most once, and only to the question
//! it answers; an id that names no task of the caller's is not found and changes nothing.

use relay_core::ErrorCode;
use relay_core::grant::Grant;
use relay_core::ledger::{Answer, Change, TodoState, transition};
use relay_core::relay::LeaseToken;
use relay_core::serve::{Caller, Draw, Drive, Step, TaskServed, TaskServing, serve, tool_of};
use relay_core::task::{self, TaskCall, TaskMethod, TaskStatus};
use relay_core::time::SECOND;

use crate::options::Mutation;

use super::*;

/// The endpoint a foreign client speaks as: it made no task, and may see none.
const STRANGER: &str = "stranger";
/// Per mille of polls before which the client also presents an id that names no task of its
/// own.
const PROBE: u32 = 120;
/// Per mille of accepted answers the client sends again (the acknowledgement was lost).
const REPEAT: u32 = 300;
/// Per mille of accepted answers sent after a response under a stale key.
const STALE: u32 = 300;
/// Per mille of polls of an ended task after which the client cancels it anyway.
const CANCEL_AFTER_END: u32 = 300;
/// How many more times a client polls its task once it has seen it end.
const POLLS_AFTER_END: u32 = 2;

/// Task `n`'s todo.
pub(super) fn task_todo(n: usize) -> String {
    format!("tk_{n}")
}

/// What a task client does.
#[derive(Clone, Debug)]
pub(super) enum Act {
    /// Adds its task (`replay`: again under the same key, the first answer having been lost).
    Add {
        replay: bool,
    },
    Poll,
    /// Responds to input request `key`: accepts with `answer`, or declines (`None`).
    Update {
        key: String,
        answer: Option<String>,
        repeat: bool,
    },
    Cancel,
    /// Presents, as `endpoint`, an id that names no task of that endpoint's.
    Probe {
        method: TaskMethod,
        endpoint: &'static str,
        presented: String,
    },
}

/// One task client, and what it knows.
#[derive(Clone, Debug, Default)]
pub(super) struct Client {
    /// The task id the first add answered: every repeat of the add must answer it too.
    made: Option<String>,
    /// Polls of the task since the client saw it end.
    after_end: u32,
    /// The input requests it declined (it accepts each at a later poll).
    declined: BTreeSet<String>,
    /// It never answers (only a client whose todo has an answer deadline).
    silent: bool,
}

/// A task method being served: the client's call, and what the checks after it need.
pub(super) struct Call {
    n: usize,
    serving: TaskServing,
    act: Act,
    /// The task's status when the server received the call.
    at_receipt: Option<TaskStatus>,
    /// The input request outstanding then.
    outstanding: Option<String>,
    /// The serving asked for a write.
    wrote: bool,
    /// The server stalled before the write (once per call).
    stalled: bool,
}

/// What the server draws for a task client's add: the todo id the simulator chose, and task
/// secrets from the seeded stream.
struct TaskDraw<'a> {
    id: String,
    secrets: &'a mut Rng,
}

impl Draw for TaskDraw<'_> {
    fn todo_id(&mut self) -> Result<String, relay_core::Error> {
        Ok(self.id.clone())
    }
    fn lease_token(&mut self) -> Result<LeaseToken, relay_core::Error> {
        Err(relay_core::Error::internal("a task client claims nothing"))
    }
    fn task_secret(&mut self) -> Result<String, relay_core::Error> {
        let r = &mut self.secrets;
        Ok(format!(
            "{:016x}{:016x}{:08x}",
            r.next_u64(),
            r.next_u64(),
            r.next_u64() >> 32
        ))
    }
}

impl World {
    /// Task client `n` acts: each task method goes out as its `params`, as a client sends them.
    pub(super) fn task_act(&mut self, n: usize, act: Act) {
        let made = self.clients[n].made.clone();
        let (endpoint, method, params) = match &act {
            Act::Add { replay } => return self.task_add(n, *replay),
            Act::Poll => {
                let Some(id) = made else {
                    let detail = format!("task {n} polled before an add answered its id");
                    return self.violate(Kind::Correctness, "task_created", detail);
                };
                return self.task_poll(n, id);
            }
            Act::Update { key, answer, .. } => {
                let response = match answer {
                    Some(a) => json!({"action": "accept", "content": {"answer": a}}),
                    None => json!({"action": "decline"}),
                };
                let mut responses = serde_json::Map::new();
                responses.insert(key.clone(), response);
                let params = json!({"taskId": made, "inputResponses": responses});
                (ENDPOINT, TaskMethod::Update, params)
            }
            Act::Cancel => (ENDPOINT, TaskMethod::Cancel, json!({"taskId": made})),
            Act::Probe {
                method,
                endpoint,
                presented,
            } => {
                let mut params = json!({"taskId": presented});
                if *method == TaskMethod::Update {
                    params["inputResponses"] =
                        json!({"q1": {"action": "accept", "content": {"answer": "not mine"}}});
                }
                (*endpoint, *method, params)
            }
        };
        self.task_method(n, endpoint, method, &params, act);
    }

    /// Task `n`'s question budget and answer deadline (seconds), drawn from a stream of the
    /// task's own, and whether its client never answers (only when the todo has a deadline, so
    /// that it ends `no_answer` rather than waiting forever).
    fn task_people(&self, n: usize) -> (Option<u32>, Option<u64>, bool) {
        let mut r = Rng::stream(self.o.seed, &format!("task-{n}"));
        let max_input_requests = r.chance(300).then(|| r.range(0, 1) as u32);
        let answer_within = r
            .chance(500)
            .then(|| r.range(5 * MINUTE, crate::options::ANSWER_WITHIN_MAX) / SECOND);
        let silent = answer_within.is_some() && r.chance(250);
        (max_input_requests, answer_within, silent)
    }

    fn task_caller(&self, endpoint: &str) -> Caller {
        let verbs = ["add_todo".to_string(), "get_todo".to_string()];
        Caller {
            endpoint: endpoint.to_string(),
            session: None,
            grant: Grant::new(&verbs, Some(vec![QUEUE.to_string()])),
            tasks: Some(self.o.tasks.poll),
        }
    }

    /// When the client polls next: about the interval the server suggested.
    fn next_poll(&mut self) -> Millis {
        let poll = self.o.tasks.poll;
        self.now + poll / 2 + self.tasking.below(poll)
    }

    /// The client's add, through core's serving of a `tools/call` that declared the extension:
    /// the todo made as a task, its `CreateTaskResult` answered. Now and then that answer is
    /// lost, and the client adds again under the same key: it must hear the same task.
    fn task_add(&mut self, n: usize, replay: bool) {
        let todo = task_todo(n);
        let (max_input_requests, answer_within, silent) = self.task_people(n);
        let mut args = json!({
            "queue": QUEUE,
            "title": format!("task {n}"),
            "payload": {"task": n},
            "max_attempts": self.o.max_attempts,
            "idempotency_key": format!("task-{n}"),
        });
        if let Some(m) = max_input_requests {
            args["max_input_requests"] = json!(m);
        }
        if let Some(s) = answer_within {
            args["answer_within_seconds"] = json!(s);
        }
        let params = json!({"name": "add_todo", "arguments": args});
        let (tool, args) = match tool_of(&params) {
            Ok(t) => t,
            Err(e) => return self.violate(Kind::Correctness, "wire", e),
        };
        let caller = self.task_caller(ENDPOINT);
        let id = if replay {
            format!("{todo}_again")
        } else {
            todo.clone()
        };
        let (ledger, secrets) = (&mut self.ledger, &mut self.secrets);
        let mut draw = TaskDraw { id, secrets };
        let served = serve(tool, args, caller, self.now, &mut draw, |op| {
            ledger.apply(op)
        });
        let s = match served {
            Ok(s) if s.task => s,
            other => {
                let detail = format!("task {n}'s add answered {other:?}, not a task");
                return self.violate(Kind::Correctness, "task_created", detail);
            }
        };
        let ring = s.ring.clone();
        let result = s.result();
        let task_id = result["taskId"].as_str().map(str::to_string);
        let described = self.ledger.todo(&todo).is_some_and(|t| {
            result["status"].as_str() == Some(task::status(t).as_str())
                && t.task_id.as_ref().map(|i| i.expose()) == task_id.as_deref()
                && result["pollIntervalMs"] == json!(self.o.tasks.poll)
        });
        if result["resultType"] != json!("task") || !described {
            let detail = format!("task {n}'s CreateTaskResult does not describe {todo}: {result}");
            return self.violate(Kind::Correctness, "task_created", detail);
        }
        if replay {
            if task_id != self.clients[n].made {
                let detail = format!("a repeated add of task {n} answered another task id");
                return self.violate(Kind::Correctness, "task_replayed", detail);
            }
            self.count("task_replayed");
            let at = self.next_poll();
            self.schedule(at, Ev::Task { n, act: Act::Poll });
            return;
        }
        self.count("task_created");
        self.touched.insert(todo.clone());
        self.added.insert(todo);
        self.clients[n].made = task_id;
        self.clients[n].silent = silent;
        if let Some((t, offer)) = ring {
            self.ring(&[t], offer);
        }
        let (act, at) = if self.tasking.chance(self.o.tasks.replay) {
            let at = self.now + self.tasking.range(SECOND, self.o.tasks.poll);
            (Act::Add { replay: true }, at)
        } else {
            (Act::Poll, self.next_poll())
        };
        self.schedule(at, Ev::Task { n, act });
    }

    /// A poll, and before it now and then an id that names no task of the client's: another
    /// task's secret, the right id presented by another endpoint, an id of no task's shape, or
    /// a plain todo's id with a secret.
    fn task_poll(&mut self, n: usize, id: String) {
        if self.tasking.chance(PROBE) {
            let method = TaskMethod::ALL[self.tasking.below(3) as usize];
            let (endpoint, presented) = match self.tasking.below(4) {
                0 => {
                    let mut wrong = id.clone();
                    let last = if wrong.pop() == Some('0') { '1' } else { '0' };
                    wrong.push(last);
                    (ENDPOINT, wrong)
                }
                1 => (STRANGER, id.clone()),
                2 => match self.tasking.below(3) {
                    0 => (ENDPOINT, task_todo(n)),
                    1 => (ENDPOINT, id.to_uppercase()),
                    _ => (ENDPOINT, id[..id.len() - 1].to_string()),
                },
                _ => {
                    let secret = id.rsplit_once('.').map_or("", |(_, s)| s);
                    (ENDPOINT, format!("{}.{secret}", todo_id(0)))
                }
            };
            let act = Act::Probe {
                method,
                endpoint,
                presented,
            };
            self.task_act(n, act);
        }
        let params = json!({"taskId": id});
        self.task_method(n, ENDPOINT, TaskMethod::Get, &params, Act::Poll);
    }

    /// A task method as the server serves it: decoded by core, then core's `TaskServing` over
    /// the ledger.
    fn task_method(
        &mut self,
        n: usize,
        endpoint: &str,
        method: TaskMethod,
        params: &Value,
        act: Act,
    ) {
        let call = match TaskCall::decode(method, Some(params)) {
            Ok(c) => c,
            Err(e) => return self.violate(Kind::Correctness, "wire", e.to_string()),
        };
        let t = self.ledger.todo(&task_todo(n));
        let at_receipt = t.map(task::status);
        let outstanding = t
            .filter(|t| t.state == TodoState::InputRequired)
            .map(|t| task::input_key(t.attempts_total));
        let (serving, step) = TaskServing::start(call, self.task_caller(endpoint), self.now);
        let call = Call {
            n,
            serving,
            act,
            at_receipt,
            outstanding,
            wrote: false,
            stalled: false,
        };
        self.task_drive(call, step);
    }

    /// Applies the serving's operations until it answers. The server may stall before the write
    /// (a slow store, or its process paused as the relays' hosts pause): the call is parked and
    /// goes on at [`Ev::TaskStep`], its write still stamped with the time of its receipt, as
    /// SQLite keeps the caller's clock.
    pub(super) fn task_drive(&mut self, mut c: Call, mut step: Step<TaskServed>) {
        // A task method takes at most two operations: its read, then one write.
        for _ in 0..3 {
            match step {
                Step::Done(done) => return self.task_answered(c, done),
                Step::Apply(op) => {
                    if op.writes() {
                        if matches!(c.act, Act::Probe { .. }) {
                            let detail =
                                format!("{:?} named no task, and wrote {}", c.act, op.name());
                            return self.violate(Kind::Correctness, "task_not_found", detail);
                        }
                        if !c.stalled && self.tasking.chance(self.o.tasks.stall) {
                            c.stalled = true;
                            self.count("task_stall");
                            let at = self.now + self.tasking.range(100, 2 * MINUTE);
                            self.next_call += 1;
                            self.calls.insert(self.next_call, (c, op));
                            self.schedule(at, Ev::TaskStep(self.next_call));
                            return;
                        }
                    }
                    let answer = self.task_apply(&mut c, op);
                    let mut draw = TaskDraw {
                        id: String::new(),
                        secrets: &mut self.secrets,
                    };
                    step = c.serving.answered(answer, &mut draw);
                }
            }
        }
        let detail = format!("task {}'s {:?} took more than two operations", c.n, c.act);
        self.violate(Kind::Correctness, "server", detail);
    }

    /// A parked task method goes on: the server applies its write now.
    pub(super) fn task_step(&mut self, call: u64) {
        if let Some((c, op)) = self.calls.remove(&call) {
            self.task_drive(c, Step::Apply(op));
        }
    }

    /// Applies one of a task method's operations, watching what a write does to the todo.
    fn task_apply(&mut self, c: &mut Call, op: Op) -> Result<Answer, relay_core::Error> {
        if !op.writes() {
            return self.ledger.apply(op);
        }
        c.wrote = true;
        let id = task_todo(c.n);
        self.touched.insert(id.clone());
        let before = self.ledger.todo(&id).cloned();
        match op {
            Op::Cancel { .. } => {
                let answer = self.ledger.apply(op);
                self.cancel_applied(&id, before.as_ref(), answer.is_ok());
                answer
            }
            Op::AnswerTodo {
                ref answer,
                ref key,
                ..
            } => {
                let (text, key) = (answer.clone(), key.clone().unwrap_or_default());
                let open = before
                    .filter(|t| t.state == TodoState::InputRequired)
                    .map(|t| t.attempts_total);
                let answered = self.ledger.apply(op);
                self.answer_applied(&id, open, &text, &key);
                answered
            }
            other => {
                let detail = format!("a task method wrote {}", other.name());
                self.violate(Kind::Correctness, "server", detail);
                self.ledger.apply(other)
            }
        }
    }

    /// A cancel was applied (`took`: the ledger accepted it): a completion that committed first
    /// stands.
    fn cancel_applied(&mut self, id: &str, before: Option<&Todo>, took: bool) {
        let Some(before) = before else {
            return;
        };
        let Some(after) = self.ledger.todo(id) else {
            return;
        };
        let (was, is) = (task::status(before), task::status(after));
        if was == TaskStatus::Completed && is != TaskStatus::Completed {
            let detail = format!(
                "{id} was {} ({}) when the cancel was applied, and is {} ({}) after",
                before.state,
                was.as_str(),
                after.state,
                is.as_str()
            );
            return self.violate(Kind::Correctness, "task_cancel_keeps_completion", detail);
        }
        if !took {
            // Refused: the task ended between the read and the write.
            self.count("task_cancel_lost_race");
            return;
        }
        self.count("task_canceled");
        self.count(match before.state {
            TodoState::Pending => "task_cancel_pending",
            TodoState::Claimed => "task_cancel_claimed",
            TodoState::InputRequired => "task_cancel_input_required",
            TodoState::Failed if before.dead_letter() => "task_cancel_dead_letter",
            TodoState::Failed => "task_cancel_retrying",
            TodoState::Done | TodoState::Canceled => "task_cancel_ended",
        });
    }

    /// An answer was applied while question `open` (an attempt's seq) waited, if one did. The
    /// response keyed to that question now holds on it (this answer, by the task's endpoint,
    /// under its key); one keyed to another question (answered meanwhile, and another asked
    /// since) changes nothing.
    fn answer_applied(&mut self, id: &str, open: Option<u32>, text: &str, key: &str) {
        let Some(seq) = open else {
            // Nothing was waiting: the ledger ignores it (the checks after the event hold every
            // attempt to the answers accepted).
            self.count("task_update_ignored");
            return;
        };
        let by = transition::answered_by(&Actor::endpoint(ENDPOINT));
        let held = self
            .ledger
            .attempts(id)
            .find(|a| a.seq == seq)
            .and_then(|a| a.question.as_ref())
            .map(|q| {
                (
                    q.answer.clone(),
                    q.answer_key.clone(),
                    q.answered_by.clone(),
                )
            });
        let want = (
            Some(text.to_string()),
            Some(key.to_string()),
            Some(by.clone()),
        );
        let ours = held.as_ref() == Some(&want);
        match (key == format!("task-{}", task::input_key(seq)), ours) {
            (true, true) => {}
            (true, false) => {
                let detail = format!("{id} seq {seq}: the task's answer {text:?} reads {held:?}");
                return self.violate(Kind::Correctness, "task_answer_applied", detail);
            }
            (false, true) => {
                let detail = format!("{id}: the response keyed {key} answered question {seq}");
                return self.violate(Kind::Correctness, "task_answer_on_its_question", detail);
            }
            (false, false) => {
                self.count("task_update_lost_race");
                return;
            }
        }
        let given = Given {
            text: text.to_string(),
            key: key.to_string(),
            by,
        };
        if let Some(first) = self.given.insert((id.to_string(), seq), given) {
            let detail = format!("{id} seq {seq} was answered a second time (first {first:?})");
            return self.violate(Kind::Correctness, "answered_once", detail);
        }
        self.count("task_answered");
    }

    /// The server's answer reached the client: what it expects of it, and what it does next.
    fn task_answered(&mut self, c: Call, done: Result<TaskServed, relay_core::Error>) {
        let n = c.n;
        let served = match (&c.act, done) {
            (Act::Probe { presented, .. }, Err(e)) if e.code == ErrorCode::NotFound => {
                if e.message.contains(presented.as_str()) {
                    let detail = format!("a task's refusal quotes the id: {}", e.message);
                    return self.violate(Kind::Correctness, "task_not_found", detail);
                }
                return self.count("task_not_found");
            }
            (Act::Probe { .. }, other) => {
                let detail = format!("{:?} was answered {other:?}, not not-found", c.act);
                return self.violate(Kind::Correctness, "task_not_found", detail);
            }
            (_, Err(e)) => {
                let detail = format!("task {n}'s own {:?} was refused: {e}", c.act);
                return self.violate(Kind::Correctness, "task_method", detail);
            }
            (_, Ok(s)) => s,
        };
        if let Some((t, offer)) = &served.ring {
            self.ring(std::slice::from_ref(t), *offer);
        }
        match c.act {
            Act::Poll => self.polled(n, &served.result),
            Act::Update {
                key,
                answer,
                repeat,
            } => {
                if !c.wrote {
                    self.count("task_update_ignored");
                }
                let outstanding = c.outstanding.as_deref() == Some(key.as_str());
                if outstanding && answer.is_some() && !c.wrote {
                    let detail = format!("task {n}'s answer to outstanding {key} was not applied");
                    return self.violate(Kind::Correctness, "task_answer_applied", detail);
                }
                if answer.is_some() && !repeat && self.tasking.chance(REPEAT) {
                    self.count("task_update_repeated");
                    let at = self.now + self.tasking.range(SECOND, 10 * MINUTE);
                    let act = Act::Update {
                        key,
                        answer,
                        repeat: true,
                    };
                    self.schedule(at, Ev::Task { n, act });
                }
            }
            Act::Cancel => self.canceled(c),
            Act::Add { .. } | Act::Probe { .. } => {}
        }
    }

    /// A cancel was acknowledged: the task has ended, and a task that had completed when the
    /// cancel arrived still has.
    fn canceled(&mut self, c: Call) {
        let id = task_todo(c.n);
        let ended = c.at_receipt.is_some_and(TaskStatus::terminal);
        if ended {
            self.count("task_cancel_after_end");
            if self.o.mutation == Some(Mutation::TaskCancelOverrides) && !c.wrote {
                self.override_cancel(&id);
            }
        }
        let Some(t) = self.ledger.todo(&id) else {
            return;
        };
        let is = task::status(t);
        let undone = c.at_receipt == Some(TaskStatus::Completed) && is != TaskStatus::Completed;
        if undone || !is.terminal() {
            let detail = format!(
                "{id} read {:?} when its cancel arrived, and {} once it was acknowledged",
                c.at_receipt.map(TaskStatus::as_str),
                is.as_str()
            );
            self.violate(Kind::Correctness, "task_cancel_keeps_completion", detail);
        }
    }

    /// The task-cancel-overrides canary: the server cancels an ended task's todo regardless.
    fn override_cancel(&mut self, id: &str) {
        let Some(mut t) = self.ledger.todo(id).cloned() else {
            return;
        };
        t.state = TodoState::Canceled;
        t.next_retry_at = None;
        t.dead_letter_reason = None;
        t.updated_at = self.now;
        self.touched.insert(id.to_string());
        let change = Change {
            todo: t,
            writes: Vec::new(),
        };
        if let Err(e) = self.ledger.apply_change(change) {
            self.violate(Kind::Correctness, "server", e.to_string());
        }
    }

    /// A poll's answer: the task as its todo is now; then the client answers its question,
    /// cancels it now and then, and polls again until some while after it ended.
    fn polled(&mut self, n: usize, result: &Value) {
        let id = task_todo(n);
        let Some(t) = self.ledger.todo(&id).cloned() else {
            let detail = format!("{id} answered a poll but is not in the ledger");
            return self.violate(Kind::Correctness, "task_status_agrees", detail);
        };
        self.count("task_polled");
        let want = task::status(&t);
        let got = result["status"].as_str().and_then(TaskStatus::parse);
        let error = result.pointer("/result/isError") == Some(&json!(true));
        let key = task::input_key(t.attempts_total);
        let asks = result["inputRequests"]
            .as_object()
            .is_some_and(|m| m.len() == 1 && m.contains_key(&key));
        let agrees = got == Some(want)
            && result["taskId"].as_str() == self.clients[n].made.as_deref()
            && (want != TaskStatus::Completed || error == t.dead_letter())
            && (want != TaskStatus::InputRequired || asks);
        if !agrees {
            let detail = format!(
                "{id} is {} ({}), its task reads {result}",
                t.state,
                want.as_str()
            );
            return self.violate(Kind::Correctness, "task_status_agrees", detail);
        }
        if let Some(detail) = end_problem(&mut self.task_ends, &t) {
            return self.violate(Kind::Correctness, "task_terminal_final", detail);
        }
        let cancel = |w: &mut World, per_mille| {
            if w.tasking.chance(per_mille) {
                let at = w.now + w.tasking.range(SECOND, 10 * SECOND);
                w.schedule(
                    at,
                    Ev::Task {
                        n,
                        act: Act::Cancel,
                    },
                );
                true
            } else {
                false
            }
        };
        match want {
            TaskStatus::Working => {
                cancel(self, self.o.tasks.cancel);
            }
            TaskStatus::InputRequired => {
                // A client asked what it does not want to answer cancels more readily.
                self.count("task_input_required_seen");
                if !cancel(self, self.o.tasks.cancel * 3) {
                    self.respond(n, key, t.attempts_total);
                }
            }
            TaskStatus::Completed | TaskStatus::Failed | TaskStatus::Cancelled => {
                if self.clients[n].after_end == 0 {
                    self.count(match (want, error) {
                        (TaskStatus::Completed, false) => "task_completed",
                        (TaskStatus::Completed, true) => "task_dead_letter_seen",
                        _ => "task_cancelled_seen",
                    });
                }
                cancel(self, CANCEL_AFTER_END);
                self.clients[n].after_end += 1;
                if self.clients[n].after_end > POLLS_AFTER_END {
                    return;
                }
            }
        }
        let at = self.next_poll();
        self.schedule(at, Ev::Task { n, act: Act::Poll });
    }

    /// The client's response to input request `key` (the question of attempt `seq`): declined
    /// the first time now and then, else accepted, sometimes after a response under a stale
    /// key; never, for a silent client.
    fn respond(&mut self, n: usize, key: String, seq: u32) {
        if self.clients[n].silent {
            return;
        }
        let at = self.now + self.tasking.range(SECOND, 30 * SECOND);
        if self.tasking.chance(self.o.tasks.decline) && self.clients[n].declined.insert(key.clone())
        {
            self.count("task_declined");
            let act = Act::Update {
                key,
                answer: None,
                repeat: false,
            };
            return self.schedule(at, Ev::Task { n, act });
        }
        let answer = Some(format!("use release-2 (task {n}, {key})"));
        if self.tasking.chance(STALE) {
            self.count("task_stale_key");
            let act = Act::Update {
                key: task::input_key(seq.saturating_sub(1)),
                answer: answer.clone(),
                repeat: false,
            };
            self.schedule(at, Ev::Task { n, act });
        }
        let act = Act::Update {
            key,
            answer,
            repeat: false,
        };
        self.schedule(at + 1, Ev::Task { n, act });
    }

    /// An operator cancels (or retries) task `n`'s todo at the Board. Applied while the task
    /// works (a retry only where the ledger allows one: a todo failed with a retry scheduled);
    /// refused once it has ended, its end being final (the checks after the event hold the
    /// task to it).
    pub(super) fn operator_on_task(&mut self, n: usize, cancel: bool) {
        let id = task_todo(n);
        let Some(ended) = self.ledger.todo(&id).map(|t| task::status(t).terminal()) else {
            return;
        };
        self.touched.insert(id.clone());
        let (now, actor) = (self.now, Actor::cli());
        let op = if cancel {
            Op::Cancel { now, actor, id }
        } else {
            Op::Retry { now, actor, id }
        };
        match self.ledger.apply(op).and_then(Answer::todo) {
            Ok(_) if cancel => self.count("task_operator_cancel"),
            Ok(t) => {
                self.count("task_operator_retry");
                self.ring(&[t], Offer::Requeued);
            }
            Err(e) if e.code == ErrorCode::Conflict && ended => {
                self.count("task_operator_refused");
            }
            Err(e) if e.code == ErrorCode::Conflict => {}
            Err(e) => self.violate(Kind::Correctness, "server", e.to_string()),
        }
    }

    /// The final ledger state holds every task to the end first seen.
    pub(super) fn check_task_ends(&mut self) {
        let ids: Vec<String> = self.task_ends.keys().cloned().collect();
        for id in ids {
            let Some(t) = self.ledger.todo(&id).cloned() else {
                continue;
            };
            if let Some(detail) = end_problem(&mut self.task_ends, &t) {
                return self.violate(Kind::Correctness, "task_terminal_final", detail);
            }
        }
    }
}

/// A terminal status never changes: the first one seen of a task (by a poll, or in the ledger
/// after an event), with whether it was a dead letter, is remembered in `ends`, and every later
/// look at the task must find it again.
pub(super) fn end_problem(
    ends: &mut BTreeMap<String, (TaskStatus, bool)>,
    t: &Todo,
) -> Option<String> {
    t.task_id.as_ref()?;
    let is = (task::status(t), t.dead_letter());
    match ends.get(&t.id) {
        Some(first) if *first != is => Some(format!(
            "{} ended {} (dead letter: {}), and is now {} (dead letter: {})",
            t.id,
            first.0.as_str(),
            first.1,
            is.0.as_str(),
            is.1
        )),
        Some(_) => None,
        None => {
            if is.0.terminal() {
                ends.insert(t.id.clone(), is);
            }
            None
        }
    }
}
