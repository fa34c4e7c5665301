//! The queue's side of a task method (`tasks/get`, `tasks/update`, `tasks/cancel`), sans-IO like
//! a tool call ([`super::Serving`]): the task is found as its todo (`get_todo`, scoped to the
//! caller, so a foreign task is not found), the presented id checked against the one the todo
//! keeps, then the todo is answered as a task ([`crate::task::detailed`]), or its question is
//! answered (`answer_todo`), or it is canceled (`cancel`).
//!
//! The two writes acknowledge as the extension says, cooperatively: a response to an input
//! request that is no longer outstanding is ignored, and so is a `decline` (the question stays
//! open for the operator, or until `answer_within_seconds` dead-letters it); a cancel of a task
//! that has ended changes nothing, and a cancel that loses to a completion committed first (the
//! todo done, or dead-lettered, between the read and the write) is acknowledged too: the ledger
//! refuses it, and the task reads `completed`.

use serde_json::{Value, json};

use super::{Caller, Draw, Drive, Step};
use crate::Millis;
use crate::doorbell::Offer;
use crate::error::{Error, ErrorCode};
use crate::ledger::{Answer, Disposition, Op, Outcome, Todo, TodoState};
use crate::task::{self, Presented, Response, TaskCall, TaskMethod};
use crate::wire;

/// A task method's answer, with what it did that the driver counts or rings for.
#[derive(Clone, Debug, PartialEq)]
pub struct TaskServed {
    pub method: TaskMethod,
    /// The result before the era's frame: the task for `tasks/get`, `{}` for the others.
    pub result: Value,
    /// An attempt a cancel closed.
    pub closed: Option<(Outcome, Disposition)>,
    /// A todo an answer made pending again.
    pub ring: Option<(Todo, Offer)>,
}

/// One task method being served. See the module doc.
#[derive(Debug)]
pub struct TaskServing {
    caller: Caller,
    now: Millis,
    call: TaskCall,
    waiting: Waiting,
}

#[derive(Debug)]
enum Waiting {
    /// The todo's view.
    Found,
    /// An answer's todo.
    Answered,
    /// A cancel's todo; whether an attempt was open.
    Canceled(bool),
}

fn ack(method: TaskMethod) -> TaskServed {
    TaskServed {
        method,
        result: json!({}),
        closed: None,
        ring: None,
    }
}

impl TaskServing {
    /// Starts serving `call` for `caller` at `now`. The caller declared the extension (the
    /// driver refuses a request that did not, with the protocol's error).
    pub fn start(call: TaskCall, caller: Caller, now: Millis) -> (TaskServing, Step<TaskServed>) {
        let step = match call.presented() {
            Presented::Unknown => Step::Done(Err(task::not_found(call.method()))),
            Presented::Shaped(id) => Step::Apply(Op::GetTodo {
                actor: caller.actor(),
                id: id.todo_id().to_string(),
                attempts_limit: wire::ATTEMPTS_LIMIT_DEFAULT as usize,
            }),
        };
        let s = TaskServing {
            caller,
            now,
            call,
            waiting: Waiting::Found,
        };
        (s, step)
    }

    fn poll_interval(&self) -> Millis {
        self.caller.tasks.unwrap_or(task::POLL_INTERVAL_DEFAULT_MS)
    }

    /// The todo's view found: the id checked, then the method's answer or its write.
    fn found(&mut self, answer: Result<Answer, Error>) -> Result<Step<TaskServed>, Error> {
        let method = self.call.method();
        let view = answer.and_then(Answer::view).map_err(|e| match e.code {
            ErrorCode::NotFound => task::not_found(method),
            _ => e,
        })?;
        let Presented::Shaped(presented) = self.call.presented() else {
            return Err(task::not_found(method));
        };
        let same = view
            .todo
            .task_id
            .as_ref()
            .is_some_and(|t| t.same(presented));
        if !same || view.todo.endpoint != self.caller.endpoint {
            return Err(task::not_found(method));
        }
        let todo_id = view.todo.id.clone();
        let actor = self.caller.actor();
        Ok(match &self.call {
            TaskCall::Get(_) => {
                let result = task::detailed(&view, self.poll_interval())
                    .ok_or_else(|| Error::internal("tasks/get: the todo is not a task"))?;
                Step::Done(Ok(TaskServed {
                    result,
                    ..ack(method)
                }))
            }
            TaskCall::Update(_, responses) => {
                let outstanding = (view.todo.state == TodoState::InputRequired)
                    .then(|| {
                        view.attempts
                            .first()
                            .map(|a| (a.seq, task::input_key(a.seq)))
                    })
                    .flatten();
                let accepted = outstanding.and_then(|(seq, open)| {
                    responses.iter().find_map(|(key, r)| match r {
                        Response::Accept(text) if *key == open => Some((seq, key, text)),
                        _ => None,
                    })
                });
                match accepted {
                    None => Step::Done(Ok(ack(method))),
                    // The write names the question: should another be open by then (this one
                    // answered meanwhile, and the todo asked again), the ledger refuses it.
                    Some((seq, key, text)) => {
                        self.waiting = Waiting::Answered;
                        Step::Apply(Op::AnswerTodo {
                            now: self.now,
                            actor,
                            id: todo_id,
                            answer: text.clone(),
                            key: Some(format!("task-{key}")),
                            seq: Some(seq),
                        })
                    }
                }
            }
            TaskCall::Cancel(_) if task::status(&view.todo).terminal() => {
                Step::Done(Ok(ack(method)))
            }
            TaskCall::Cancel(_) => {
                self.waiting = Waiting::Canceled(view.todo.state == TodoState::Claimed);
                Step::Apply(Op::Cancel {
                    now: self.now,
                    actor,
                    id: todo_id,
                })
            }
        })
    }
}

impl Drive for TaskServing {
    type Out = TaskServed;

    fn answered(&mut self, answer: Result<Answer, Error>, _: &mut dyn Draw) -> Step<TaskServed> {
        let method = self.call.method();
        let waiting = std::mem::replace(&mut self.waiting, Waiting::Found);
        let done = match waiting {
            Waiting::Found => return self.found(answer).unwrap_or_else(|e| Step::Done(Err(e))),
            // The question was answered meanwhile (by the operator, or a repeat of this
            // update): the response is no longer outstanding, and is ignored.
            Waiting::Answered => match answer.and_then(Answer::todo) {
                Ok(t) => Ok(TaskServed {
                    ring: (t.state == TodoState::Pending).then_some((t, Offer::Requeued)),
                    ..ack(method)
                }),
                Err(e) if e.code == ErrorCode::Conflict => Ok(ack(method)),
                Err(e) => Err(e),
            },
            // A report committed first (the task completed): the cancel changed nothing.
            Waiting::Canceled(open) => match answer.and_then(Answer::todo) {
                Ok(_) => Ok(TaskServed {
                    closed: open.then_some((Outcome::Canceled, Disposition::Canceled)),
                    ..ack(method)
                }),
                Err(e) if e.code == ErrorCode::Conflict => Ok(ack(method)),
                Err(e) => Err(e),
            },
        };
        Step::Done(done)
    }
}
