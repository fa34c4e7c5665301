//! The queue's side of a tool call, once: the call's arguments decoded, the endpoint's grant
//! checked, the ledger [`Op`] built, its [`Answer`] shaped as the tool's result. The MCP server
//! runs it over its store; the simulator and the core scenario tests run it over an in-memory
//! ledger, so all three go through the same wire conversion (a break in it shows in every one).
//!
//! # Driving it
//!
//! Sans-IO: [`Serving::start`] takes the call and answers the first [`Step`]. The driver applies
//! each [`Step::Apply`] wherever its ledger lives (a store's transaction, `Ledger::apply`) and
//! hands the answer to [`Serving::answered`], until [`Step::Done`]. A call takes one operation,
//! except a `claim` by an endpoint granted only some queues: it reads the todo's queue first.
//! [`serve`] is that loop for a ledger at hand.
//!
//! Randomness arrives as values: a new todo's id and a fence token are asked of the driver
//! ([`Draw`]) only when the call needs one, in the order the call needs them.
//!
//! # What it leaves to the driver
//!
//! What a [`Served`] reports (the attempt it closed, the todo it made claimable) for metrics and
//! the doorbell; the JSON-RPC envelope and the handling of internal errors, which the server
//! answers with an error id and the simulator counts as a violation.

use serde::Serialize;
use serde_json::Value;

use crate::Millis;
use crate::doorbell::Offer;
use crate::error::{Error, ErrorCode};
use crate::grant::Grant;
use crate::ledger::transition::not_found;
use crate::ledger::{
    Actor, Answer, ClaimOpts, Claimed, Disposition, Op, Outcome, Report, TaskId, Todo, TodoFilter,
    TodoState,
};
use crate::wire::{
    self, ClaimArgs, ClaimOut, ErrorOut, GetTodoOut, LeaseToken, ListTodosOut, TodoOut, Tool,
    ToolCall, lease_ttl_ms,
};

/// Who calls: the endpoint (its session, when it has one) and what it was granted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    pub endpoint: String,
    /// The MCP session, recorded on the attempts the call opens.
    pub session: Option<String>,
    pub grant: Grant,
    /// Set when the request declared the Tasks extension (a 2026-07-28 request only): the
    /// server's suggested poll interval. An `add_todo` then makes the todo a task and answers
    /// its `CreateTaskResult`.
    pub tasks: Option<Millis>,
}

impl Caller {
    fn actor(&self) -> Actor {
        Actor::Endpoint {
            endpoint: self.endpoint.clone(),
            session: self.session.clone(),
        }
    }
}

/// The values a call may need that core does not draw.
pub trait Draw {
    /// A new todo's id (`add_todo`).
    fn todo_id(&mut self) -> Result<String, Error>;
    /// A fence token (a claim with `require_fence`).
    fn lease_token(&mut self) -> Result<LeaseToken, Error>;
    /// A task id's secret: [`crate::ledger::TASK_SECRET_HEX`] lower-case hex digits (an
    /// `add_todo` made as a task).
    fn task_secret(&mut self) -> Result<String, Error>;
}

/// What to do next.
#[derive(Debug)]
#[allow(
    clippy::large_enum_variant,
    reason = "one Step lives per call, moved a few times: a box per operation would cost more"
)]
pub enum Step<T = Served> {
    /// Apply this operation and hand its answer to [`Serving::answered`].
    Apply(Op),
    /// The call is answered: the tool's answer, or its refusal.
    Done(Result<T, Error>),
}

/// A call being served, as its driver sees it: hand it each operation's answer until it is
/// [`Step::Done`]. [`Serving`] (a tool) and [`TaskServing`] (a task method) are driven alike.
pub trait Drive {
    type Out;
    fn answered(&mut self, answer: Result<Answer, Error>, draw: &mut dyn Draw) -> Step<Self::Out>;
}

/// A call's answer, with what it did that the driver counts or rings for.
#[derive(Clone, Debug, PartialEq)]
pub struct Served {
    pub tool: Tool,
    /// The tool's answer object (`structuredContent`).
    pub answer: Value,
    /// An attempt the call closed (a report, or a takeover of a lapsed lease), and what became
    /// of its todo.
    pub closed: Option<(Outcome, Disposition)>,
    /// A todo the call may have made claimable, and how to offer it to the doorbell.
    pub ring: Option<(Todo, Offer)>,
    /// The call's answer is this refusal although the operation changed the ledger: a
    /// heartbeat whose usage reached the budget stopped its attempt (`closed` says how), and its
    /// holder hears what a cancel tells it. The driver counts `closed`, then answers the error.
    pub refused: Option<Error>,
    /// `answer` is an `add_todo`'s `CreateTaskResult` (the todo is a task), not a tool answer.
    pub task: bool,
}

impl Served {
    /// The `tools/call` result: the tool's answer, or the task that stands for it.
    pub fn result(self) -> Value {
        if self.task {
            self.answer
        } else {
            wire::call_result(self.answer, false)
        }
    }
}

/// The `tools/call` result of a refused call: the error as a tool error.
pub fn refusal(e: &Error) -> Value {
    let out = serde_json::to_value(ErrorOut::from(e)).unwrap_or_default();
    wire::call_result(out, true)
}

/// The tool a `tools/call`'s params name, and its arguments. The error is the sentence a
/// JSON-RPC `invalid params` carries: the call names no tool, or one that does not exist.
pub fn tool_of(params: &Value) -> Result<(Tool, Option<&Value>), String> {
    let Some(name) = params.get("name").and_then(Value::as_str) else {
        return Err("tools/call needs params.name (a tool from tools/list)".into());
    };
    let Some(tool) = Tool::parse(name) else {
        return Err(format!(
            "unknown tool {name:?}; tools/list names the tools of this endpoint"
        ));
    };
    Ok((tool, params.get("arguments")))
}

/// One call being served. See the module doc.
#[derive(Debug)]
pub struct Serving {
    caller: Caller,
    now: Millis,
    tool: Tool,
    waiting: Waiting,
}

/// The answer the serving waits for, and what it will make of it.
#[derive(Debug)]
enum Waiting {
    /// A scoped `claim`'s read of the todo's queue.
    ClaimScope(ClaimArgs),
    /// A claim's answer; the token goes out with it.
    Claimed(Option<LeaseToken>),
    Todo,
    /// A fenced report's answer; refused as `conflict`, the note keeps it as a late report.
    Report(Box<Op>),
    /// The late-report note's answer; then the report's refusal stands.
    Late(Error),
    /// `get_todo`'s view, checked against the granted queues.
    View(String),
    Todos,
    Nothing,
}

fn encode<T: Serialize>(v: &T) -> Result<Value, Error> {
    serde_json::to_value(v).map_err(|e| Error::internal(format!("encoding the answer: {e}")))
}

fn report_of(
    result: Option<serde_json::Map<String, Value>>,
    summary: Option<String>,
    artifact: Option<String>,
    token: Option<&LeaseToken>,
) -> Report {
    Report {
        result: result.map(Value::Object),
        summary,
        artifact,
        token_hash: token.map(LeaseToken::hash),
        ..Report::default()
    }
}

/// What a report waits for: its todo, and, when it is fenced, the late-report note that a
/// refusal leads to (what it claimed, under which fence).
fn report_waits(
    now: Millis,
    actor: &Actor,
    id: &str,
    outcome: Outcome,
    summary: Option<&str>,
    token: Option<&LeaseToken>,
) -> Waiting {
    token.map_or(Waiting::Todo, |t| {
        Waiting::Report(Box::new(Op::NoteLate {
            now,
            actor: actor.clone(),
            id: id.to_string(),
            outcome,
            summary: summary.map(str::to_string),
            token_hash: Some(t.hash()),
        }))
    })
}

impl Serving {
    /// Starts serving `tool` with its `arguments` (absent: `{}`) for `caller` at `now`.
    pub fn start(
        tool: Tool,
        arguments: Option<&Value>,
        caller: Caller,
        now: Millis,
        draw: &mut dyn Draw,
    ) -> (Serving, Step) {
        let mut s = Serving {
            caller,
            now,
            tool,
            waiting: Waiting::Nothing,
        };
        let call = s
            .caller
            .grant
            .check_tool(tool)
            .and_then(|()| tool.decode(arguments));
        let step = match call.and_then(|call| s.op(call, draw)) {
            Ok(op) => Step::Apply(op),
            Err(e) => Step::Done(Err(e)),
        };
        (s, step)
    }

    /// Hands over the answer to the last [`Step::Apply`].
    pub fn answered(&mut self, answer: Result<Answer, Error>, draw: &mut dyn Draw) -> Step {
        Drive::answered(self, answer, draw)
    }
}

impl Drive for Serving {
    type Out = Served;

    fn answered(&mut self, answer: Result<Answer, Error>, draw: &mut dyn Draw) -> Step {
        let waiting = std::mem::replace(&mut self.waiting, Waiting::Nothing);
        let next = match waiting {
            Waiting::ClaimScope(a) => self.scoped_claim(a, answer, draw).map(Step::Apply),
            Waiting::Report(note) => match answer {
                Err(e) if e.code == ErrorCode::Conflict => {
                    self.waiting = Waiting::Late(e);
                    Ok(Step::Apply(*note))
                }
                answer => answer
                    .and_then(|a| self.served(Waiting::Todo, a))
                    .map(|s| Step::Done(Ok(s))),
            },
            // Whatever the note answered, the caller hears the refusal of its report.
            Waiting::Late(refused) => Err(refused),
            w => answer
                .and_then(|a| self.served(w, a))
                .map(|s| Step::Done(Ok(s))),
        };
        next.unwrap_or_else(|e| Step::Done(Err(e)))
    }
}

impl Serving {
    fn claim_opts(
        &self,
        require_fence: Option<bool>,
        lease_ttl_seconds: Option<u64>,
        claimant: Option<String>,
        draw: &mut dyn Draw,
    ) -> Result<(ClaimOpts, Option<LeaseToken>), Error> {
        let token = if require_fence.unwrap_or(false) {
            Some(draw.lease_token()?)
        } else {
            None
        };
        let opts = ClaimOpts {
            ttl: lease_ttl_ms(lease_ttl_seconds),
            claimant,
            token_hash: token.as_ref().map(LeaseToken::hash),
        };
        Ok((opts, token))
    }

    /// The operation for a decoded call, and what its answer will be waited as.
    fn op(&mut self, call: ToolCall, draw: &mut dyn Draw) -> Result<Op, Error> {
        let (now, actor, grant) = (self.now, self.caller.actor(), &self.caller.grant);
        let (op, waiting) = match call {
            ToolCall::ClaimNext(a) => {
                let queues = grant.scope(Tool::ClaimNext, a.queue.as_deref())?;
                let (opts, token) =
                    self.claim_opts(a.require_fence, a.lease_ttl_seconds, a.claimant, draw)?;
                let op = Op::ClaimNext {
                    now,
                    actor,
                    queues,
                    opts,
                };
                (op, Waiting::Claimed(token))
            }
            ToolCall::Claim(a) if grant.queues().is_some() => {
                let op = Op::GetTodo {
                    actor,
                    id: a.id.clone(),
                    attempts_limit: 1,
                };
                (op, Waiting::ClaimScope(a))
            }
            ToolCall::Claim(a) => return self.claim(a, draw),
            ToolCall::Heartbeat(a) => {
                let op = Op::Heartbeat {
                    now,
                    actor,
                    ttl: lease_ttl_ms(a.lease_ttl_seconds),
                    token_hash: a.lease_token.as_ref().map(LeaseToken::hash),
                    usage: wire::usage_of("heartbeat", a.usage.as_ref())?,
                    id: a.id,
                };
                (op, Waiting::Todo)
            }
            ToolCall::Complete(a) => {
                let waits = report_waits(
                    now,
                    &actor,
                    &a.id,
                    Outcome::Completed,
                    a.summary.as_deref(),
                    a.lease_token.as_ref(),
                );
                let report = Report {
                    usage: wire::usage_of("complete", a.usage.as_ref())?,
                    ..report_of(a.result, a.summary, a.artifact, a.lease_token.as_ref())
                };
                let op = Op::Complete {
                    now,
                    actor,
                    id: a.id,
                    report,
                };
                (op, waits)
            }
            ToolCall::Fail(a) => {
                let waits = report_waits(
                    now,
                    &actor,
                    &a.id,
                    Outcome::Failed,
                    a.summary.as_deref(),
                    a.lease_token.as_ref(),
                );
                let report = Report {
                    retryable: a.retryable,
                    failure_signature: a.failure_signature,
                    usage: wire::usage_of("fail", a.usage.as_ref())?,
                    ..report_of(a.result, a.summary, a.artifact, a.lease_token.as_ref())
                };
                let op = Op::Fail {
                    now,
                    actor,
                    id: a.id,
                    report,
                };
                (op, waits)
            }
            ToolCall::Release(a) => {
                let waits = report_waits(
                    now,
                    &actor,
                    &a.id,
                    Outcome::Released,
                    a.summary.as_deref(),
                    a.lease_token.as_ref(),
                );
                let op = Op::Release {
                    now,
                    actor,
                    id: a.id,
                    summary: a.summary,
                    token_hash: a.lease_token.as_ref().map(LeaseToken::hash),
                    usage: wire::usage_of("release", a.usage.as_ref())?,
                };
                (op, waits)
            }
            ToolCall::RequestInput(a) => {
                let waits = report_waits(
                    now,
                    &actor,
                    &a.id,
                    Outcome::NeedsInput,
                    a.summary.as_deref(),
                    a.lease_token.as_ref(),
                );
                let report = Report {
                    usage: wire::usage_of("request_input", a.usage.as_ref())?,
                    ..report_of(None, a.summary, a.artifact, a.lease_token.as_ref())
                };
                let op = Op::RequestInput {
                    now,
                    actor,
                    id: a.id,
                    question: a.question,
                    report,
                };
                (op, waits)
            }
            ToolCall::AnswerTodo(a) => {
                let op = Op::AnswerTodo {
                    now,
                    actor,
                    id: a.id,
                    answer: a.answer,
                    key: a.idempotency_key,
                    seq: None,
                };
                (op, Waiting::Todo)
            }
            ToolCall::GetTodo(a) => {
                let limit = a.attempts_limit.unwrap_or(wire::ATTEMPTS_LIMIT_DEFAULT) as usize;
                let op = Op::GetTodo {
                    actor,
                    id: a.id.clone(),
                    attempts_limit: limit,
                };
                (op, Waiting::View(a.id))
            }
            ToolCall::ListTodos(a) => {
                let filter = TodoFilter {
                    queues: grant.scope(Tool::ListTodos, a.queue.as_deref())?,
                    state: a.state,
                    after: None,
                    limit: a.limit.unwrap_or(wire::LIST_LIMIT_DEFAULT) as usize,
                };
                (Op::ListTodos { actor, filter }, Waiting::Todos)
            }
            ToolCall::AddTodo(a) => {
                grant.check_queue(Tool::AddTodo, &a.queue)?;
                let id = draw.todo_id()?;
                let task_id = match self.caller.tasks {
                    Some(_) => Some(TaskId::new(&id, &draw.task_secret()?)),
                    None => None,
                };
                let new = a.into_new_todo("add_todo", id, task_id)?;
                let op = Op::AddTodo {
                    now,
                    endpoint: self.caller.endpoint.clone(),
                    new,
                };
                (op, Waiting::Todo)
            }
        };
        self.waiting = waiting;
        Ok(op)
    }

    fn claim(&mut self, a: ClaimArgs, draw: &mut dyn Draw) -> Result<Op, Error> {
        let (opts, token) =
            self.claim_opts(a.require_fence, a.lease_ttl_seconds, a.claimant, draw)?;
        self.waiting = Waiting::Claimed(token);
        Ok(Op::Claim {
            now: self.now,
            actor: self.caller.actor(),
            id: a.id,
            opts,
        })
    }

    /// A scoped claim, once the todo's queue is known: a todo the endpoint cannot see is not
    /// found by `claim`, one in a queue it was not granted is forbidden.
    fn scoped_claim(
        &mut self,
        a: ClaimArgs,
        answer: Result<Answer, Error>,
        draw: &mut dyn Draw,
    ) -> Result<Op, Error> {
        let view = answer.and_then(Answer::view).map_err(|e| {
            if e.code == ErrorCode::NotFound {
                not_found("claim", &a.id)
            } else {
                e
            }
        })?;
        self.caller
            .grant
            .check_queue(Tool::Claim, &view.todo.queue)?;
        self.claim(a, draw)
    }

    fn served(&self, waiting: Waiting, answer: Answer) -> Result<Served, Error> {
        let mut closed = None;
        let mut ring = None;
        let mut refused = None;
        let mut task = false;
        let answer = match waiting {
            Waiting::Claimed(token) => {
                let claimed: Option<Claimed> = match self.tool {
                    Tool::ClaimNext => answer.next()?,
                    _ => Some(answer.claimed()?),
                };
                match claimed {
                    None => encode(&ClaimOut::empty())?,
                    Some(c) => {
                        if c.takeover {
                            closed = Some((Outcome::LeaseExpired, Disposition::Requeued));
                        }
                        encode(&ClaimOut::claimed(&c, token))?
                    }
                }
            }
            Waiting::Todo => {
                let created = match (&answer, self.tool) {
                    (Answer::Existing(_), _) => Some(false),
                    (_, Tool::AddTodo) => Some(true),
                    _ => None,
                };
                let t = answer.todo()?;
                if self.tool == Tool::Heartbeat && t.state != TodoState::Claimed {
                    // The heartbeat's usage reached the budget and the attempt was stopped:
                    // the holder hears what a cancel tells it, a conflict.
                    refused = Some(Error::conflict(format!(
                        "heartbeat {}: the todo's spend reached its budget ({}); the attempt \
                         was stopped and the todo dead-lettered (budget_exhausted): stop work",
                        t.id,
                        t.budget.describe()
                    )));
                }
                closed = match self.tool {
                    Tool::Complete => Some((Outcome::Completed, Disposition::Done)),
                    Tool::Fail if t.dead_letter() => {
                        Some((Outcome::Failed, Disposition::DeadLettered))
                    }
                    Tool::Fail => Some((Outcome::Failed, Disposition::RetryScheduled)),
                    Tool::Release if t.dead_letter() => {
                        Some((Outcome::Released, Disposition::DeadLettered))
                    }
                    Tool::Release => Some((Outcome::Released, Disposition::Requeued)),
                    Tool::RequestInput if t.dead_letter() => {
                        Some((Outcome::NeedsInput, Disposition::DeadLettered))
                    }
                    Tool::RequestInput => Some((Outcome::NeedsInput, Disposition::AwaitingInput)),
                    Tool::Heartbeat if refused.is_some() => {
                        Some((Outcome::Canceled, Disposition::DeadLettered))
                    }
                    _ => None,
                };
                let out = match (&t.task_id, self.caller.tasks, self.tool) {
                    (Some(id), Some(poll), Tool::AddTodo) => {
                        task = true;
                        crate::task::created(&t, id, poll)
                    }
                    _ => encode(&TodoOut {
                        created,
                        ..TodoOut::from(&t)
                    })?,
                };
                ring = match self.tool {
                    Tool::Release if !t.dead_letter() => Some((t, Offer::Requeued)),
                    Tool::AnswerTodo if t.state == TodoState::Pending => Some((t, Offer::Requeued)),
                    Tool::AddTodo if created == Some(true) => Some((t, Offer::Fresh)),
                    _ => None,
                };
                out
            }
            Waiting::View(id) => {
                let view = answer.view()?;
                if !self.caller.grant.covers(&view.todo.queue) {
                    // What the endpoint cannot enumerate does not exist for it.
                    return Err(not_found("get_todo", &id));
                }
                let mut out = GetTodoOut::from(&view);
                // The task's client hears its task id; no one else (an operator's view
                // included) ever sees it.
                if view.todo.endpoint == self.caller.endpoint {
                    out.todo.task_id = view.todo.task_id.as_ref().map(|t| t.expose().to_string());
                }
                encode(&out)?
            }
            Waiting::Todos => {
                let todos = answer.todos()?;
                encode(&ListTodosOut {
                    todos: todos.iter().map(TodoOut::from).collect(),
                })?
            }
            Waiting::ClaimScope(_) | Waiting::Report(_) | Waiting::Late(_) | Waiting::Nothing => {
                return Err(Error::internal(format!(
                    "{}: an answer arrived that nothing waited for",
                    self.tool.as_str()
                )));
            }
        };
        Ok(Served {
            tool: self.tool,
            answer,
            closed,
            ring,
            refused,
            task,
        })
    }
}

/// Serves one call over a ledger the caller applies at once (`apply`: e.g. `Ledger::apply`).
pub fn serve(
    tool: Tool,
    arguments: Option<&Value>,
    caller: Caller,
    now: Millis,
    draw: &mut dyn Draw,
    apply: impl FnMut(Op) -> Result<Answer, Error>,
) -> Result<Served, Error> {
    let (mut serving, step) = Serving::start(tool, arguments, caller, now, draw);
    match drive(&mut serving, step, draw, apply) {
        Ok(Served {
            refused: Some(e), ..
        }) => Err(e),
        done => done,
    }
}

/// Drives a call being served to its end over a ledger at hand, from its first step.
pub fn drive<D: Drive>(
    serving: &mut D,
    mut step: Step<D::Out>,
    draw: &mut dyn Draw,
    mut apply: impl FnMut(Op) -> Result<Answer, Error>,
) -> Result<D::Out, Error> {
    loop {
        match step {
            Step::Apply(op) => step = serving.answered(apply(op), draw),
            Step::Done(done) => return done,
        }
    }
}

mod task;
pub use task::{TaskServed, TaskServing};

#[cfg(test)]
mod tests;
