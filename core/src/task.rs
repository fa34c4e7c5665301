//! A todo seen as an MCP task (the 2026-07-28 Tasks extension, `io.modelcontextprotocol/tasks`):
//! which task status a todo is in, the task object `tasks/get` and the status notifications
//! answer, the `CreateTaskResult` of an `add_todo`, and the task methods' requests decoded.
//! Pure: the serving function and the listen stream call these, in both the server and the
//! simulator.
//!
//! # The mapping
//!
//! | todo | task |
//! |---|---|
//! | pending, claimed, failed with a retry scheduled | `working`, the message says which attempt |
//! | input_required | `input_required`, the question as an `elicitation/create` input request |
//! | done | `completed`, the todo (with its result) as the tool's result |
//! | a dead letter | `completed` with `isError: true`, the attention text as the content |
//! | canceled | `cancelled` |
//!
//! `failed` (a JSON-RPC error during execution) never happens: an attempt's failure is the
//! worker's report, not a protocol error. A terminal status never changes: an operator's retry
//! of a task's finished todo is refused (`transition::retry`), and so is a cancel of its dead
//! letter (`transition::cancel`), since its client may already have taken the result.
//!
//! `relay serve` discards no todo on its own, so `ttlMs` is `null`; a todo removed from the
//! store is a task not found. An input request's key is `q<seq>`, the attempt that asked: unique over the
//! task's life, as the extension requires.

use serde_json::{Map, Value, json};

use crate::Millis;
use crate::error::Error;
use crate::ledger::{self, TaskId, Todo, TodoState, TodoView};
use crate::time::rfc3339;
use crate::wire::{self, TodoOut, TodoWithResult};

/// The extension's identifier, as capabilities name it.
pub const EXTENSION: &str = "io.modelcontextprotocol/tasks";

/// How long a task's client should wait between polls, unless the server says otherwise.
pub const POLL_INTERVAL_DEFAULT_MS: Millis = 5_000;

crate::names! {
    /// A task's status.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
    pub enum TaskStatus {
        Working => "working",
        InputRequired => "input_required",
        Completed => "completed",
        Failed => "failed",
        Cancelled => "cancelled",
    }
}

impl TaskStatus {
    /// Completed, failed or cancelled: the status never changes again.
    pub fn terminal(self) -> bool {
        matches!(
            self,
            TaskStatus::Completed | TaskStatus::Failed | TaskStatus::Cancelled
        )
    }
}

/// The task status of a todo.
pub fn status(t: &Todo) -> TaskStatus {
    match t.state {
        TodoState::Done => TaskStatus::Completed,
        TodoState::Canceled => TaskStatus::Cancelled,
        TodoState::InputRequired => TaskStatus::InputRequired,
        TodoState::Failed if t.dead_letter() => TaskStatus::Completed,
        TodoState::Pending | TodoState::Claimed | TodoState::Failed => TaskStatus::Working,
    }
}

/// The key of the input request that the attempt `seq` asked.
pub fn input_key(seq: u32) -> String {
    format!("q{seq}")
}

/// The `Task` fields every answer carries: id, status, message, times, TTL and poll interval.
fn base(t: &Todo, id: &TaskId, poll_interval: Millis) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("taskId".into(), json!(id.expose()));
    m.insert("status".into(), json!(status(t).as_str()));
    m.insert("statusMessage".into(), json!(message(t)));
    m.insert("createdAt".into(), json!(rfc3339(t.created_at)));
    m.insert("lastUpdatedAt".into(), json!(rfc3339(t.updated_at)));
    m.insert("ttlMs".into(), Value::Null);
    m.insert("pollIntervalMs".into(), json!(poll_interval));
    m
}

/// A status message for people and models: where the work is.
fn message(t: &Todo) -> String {
    let of = |n: u32| format!("attempt {n}/{}", t.max_attempts);
    match t.state {
        TodoState::Pending if t.attempt == 0 => "waiting for a worker".into(),
        TodoState::Pending => format!("waiting for a worker ({} next)", of(t.attempt + 1)),
        TodoState::Claimed => format!("{} running", of(t.attempt)),
        TodoState::Failed => match t.next_retry_at {
            Some(at) => format!("{} failed; retry at {}", of(t.attempt), rfc3339(at)),
            None => format!(
                "stopped: a dead letter ({})",
                t.dead_letter_reason.map_or("unknown", |r| r.as_str())
            ),
        },
        TodoState::InputRequired => {
            "a worker asked a question: answer it with tasks/update (inputRequests)".into()
        }
        TodoState::Done => format!("completed after {}", of(t.attempt)),
        TodoState::Canceled => "canceled".into(),
    }
}

/// The `CreateTaskResult` for a todo made as a task (`resultType: "task"`, the task's fields at
/// the top level).
pub fn created(t: &Todo, id: &TaskId, poll_interval: Millis) -> Value {
    let mut m = base(t, id, poll_interval);
    m.insert("resultType".into(), json!("task"));
    Value::Object(m)
}

/// The task as `tasks/get` and `notifications/tasks` carry it (a `DetailedTask`): the status's
/// own field added, from the todo and its newest attempts (`view`). `None` when the todo is not
/// a task.
pub fn detailed(view: &TodoView, poll_interval: Millis) -> Option<Value> {
    let t = &view.todo;
    let id = t.task_id.as_ref()?;
    let mut m = base(t, id, poll_interval);
    match status(t) {
        TaskStatus::InputRequired => {
            m.insert("inputRequests".into(), input_requests(view));
        }
        TaskStatus::Completed => {
            m.insert("result".into(), tool_result(view));
        }
        TaskStatus::Working | TaskStatus::Failed | TaskStatus::Cancelled => {}
    }
    Some(Value::Object(m))
}

/// The open question as an elicitation: a form with one text field, `answer`.
fn input_requests(view: &TodoView) -> Value {
    let asked = view
        .attempts
        .iter()
        .find(|a| a.question.as_ref().is_some_and(|q| q.answer.is_none()));
    let Some((seq, q)) = asked.and_then(|a| Some((a.seq, a.question.as_ref()?))) else {
        return json!({});
    };
    let mut requests = Map::new();
    requests.insert(
        input_key(seq),
        json!({
            "method": "elicitation/create",
            "params": {
                "mode": "form",
                "message": q.text,
                "requestedSchema": {
                    "type": "object",
                    "properties": {"answer": {
                        "type": "string",
                        "title": "Answer",
                        "description": "The answer the next attempt reads (untrusted input to it)",
                    }},
                    "required": ["answer"],
                },
            },
        }),
    );
    Value::Object(requests)
}

/// The tool's result of a finished todo, as the `tools/call` would have answered it in the
/// 2026-07-28 era: the todo with its result as the structured content; for a dead letter
/// `isError: true` with the attention text as the content. It says `resultType: "complete"`
/// like every result of that era (`CompletedTask.result` is the original request's result
/// type, and a `CallToolResult` is a `Result`, whose `resultType` servers MUST include).
fn tool_result(view: &TodoView) -> Value {
    let t = &view.todo;
    let out = TodoWithResult {
        todo: TodoOut::from(t),
        result: t.result.clone(),
        task_id: None,
    };
    let structured = serde_json::to_value(&out).unwrap_or_default();
    let mut result = match ledger::attention(view) {
        Some(why) => json!({
            "content": [{"type": "text", "text": why}],
            "structuredContent": structured,
            "isError": true,
        }),
        None => wire::call_result(structured, false),
    };
    if let Value::Object(m) = &mut result {
        m.insert("resultType".into(), json!("complete"));
    }
    result
}

/// A task method's request, decoded.
#[derive(Clone, Debug, PartialEq)]
pub enum TaskCall {
    Get(Presented),
    /// `tasks/update`: the answers to input requests, by key (each the elicitation's response).
    Update(Presented, Vec<(String, Response)>),
    Cancel(Presented),
}

/// The task id a request presented: one with a task id's shape, or one that cannot name a task
/// (which is not found, like an unknown one).
#[derive(Clone, Debug, PartialEq)]
pub enum Presented {
    Shaped(TaskId),
    Unknown,
}

/// A response to an input request, as an elicitation's result says it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Response {
    /// `accept` with `content.answer` (the form's field).
    Accept(String),
    /// `decline` or `cancel`: the human will not answer; the question stays open.
    Refused,
}

crate::names! {
    /// The task methods.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
    pub enum TaskMethod {
        Get => "tasks/get",
        Update => "tasks/update",
        Cancel => "tasks/cancel",
    }
}

fn invalid(method: TaskMethod, what: impl std::fmt::Display) -> Error {
    Error::invalid(format!("{}: {what}", method.as_str()))
}

impl TaskCall {
    /// Decodes the params of `method` (absent: `{}`). Strict in the fields it takes: an unknown
    /// one is refused by name; `_meta` is the envelope's.
    pub fn decode(method: TaskMethod, params: Option<&Value>) -> Result<TaskCall, Error> {
        let empty = Map::new();
        let p = match params {
            None => &empty,
            Some(Value::Object(p)) => p,
            Some(_) => return Err(invalid(method, "params must be an object")),
        };
        let allowed: &[&str] = match method {
            TaskMethod::Update => &["taskId", "inputResponses", "_meta"],
            TaskMethod::Get | TaskMethod::Cancel => &["taskId", "_meta"],
        };
        if let Some(k) = p.keys().find(|k| !allowed.contains(&k.as_str())) {
            return Err(invalid(
                method,
                format!(
                    "unknown field {:?}; it takes {}",
                    crate::bounds::cut_at_char_boundary(k, 64),
                    allowed.join(", ")
                ),
            ));
        }
        let id = match p.get("taskId") {
            Some(Value::String(s)) => {
                TaskId::parse(s).map_or(Presented::Unknown, Presented::Shaped)
            }
            Some(_) => return Err(invalid(method, "taskId must be a string")),
            None => {
                return Err(invalid(
                    method,
                    "taskId is required (the id add_todo answered)",
                ));
            }
        };
        Ok(match method {
            TaskMethod::Get => TaskCall::Get(id),
            TaskMethod::Cancel => TaskCall::Cancel(id),
            TaskMethod::Update => TaskCall::Update(id, responses(p.get("inputResponses"))?),
        })
    }

    /// The id the call presented.
    pub fn presented(&self) -> &Presented {
        match self {
            TaskCall::Get(p) | TaskCall::Update(p, _) | TaskCall::Cancel(p) => p,
        }
    }

    pub fn method(&self) -> TaskMethod {
        match self {
            TaskCall::Get(_) => TaskMethod::Get,
            TaskCall::Update(..) => TaskMethod::Update,
            TaskCall::Cancel(_) => TaskMethod::Cancel,
        }
    }
}

fn responses(v: Option<&Value>) -> Result<Vec<(String, Response)>, Error> {
    let m = TaskMethod::Update;
    let Some(Value::Object(map)) = v else {
        return Err(invalid(
            m,
            "inputResponses is required: an object of responses by inputRequests key",
        ));
    };
    let mut out = Vec::with_capacity(map.len());
    for (key, r) in map {
        let Value::Object(r) = r else {
            return Err(invalid(m, "each inputResponses entry must be an object"));
        };
        let answer = match r.get("action").and_then(Value::as_str) {
            Some("accept") => {
                let text = r
                    .get("content")
                    .and_then(|c| c.get("answer"))
                    .and_then(Value::as_str);
                match text {
                    Some(t) => Response::Accept(t.to_string()),
                    None => {
                        return Err(invalid(
                            m,
                            "an accepted response needs content.answer, a string (the form's \
                             one field)",
                        ));
                    }
                }
            }
            Some("decline" | "cancel") => Response::Refused,
            _ => {
                return Err(invalid(
                    m,
                    "each response needs action \"accept\", \"decline\" or \"cancel\"",
                ));
            }
        };
        out.push((key.clone(), answer));
    }
    Ok(out)
}

/// The refusal of an unknown, deleted or foreign task: the extension's invalid-params error.
/// It never quotes the id.
pub fn not_found(method: TaskMethod) -> Error {
    Error::not_found(format!(
        "{}: task not found (unknown, deleted, or made by another endpoint); use the taskId \
         add_todo answered",
        method.as_str()
    ))
}

#[cfg(test)]
mod tests;
