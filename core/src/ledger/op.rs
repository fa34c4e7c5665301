//! The queue side's operations, as values: one [`Op`] per request, one [`Answer`] per result.
//!
//! This is the operation list, written once. The in-memory [`Ledger`](super::Ledger) and both
//! SQL stores apply an `Op` (see [`run`](super::run)), the MCP server builds one from a tool
//! call's arguments, the simulator's queue server and the model tests send them, and the fuzz
//! program decodes bytes into them. Adding an operation is a variant here, its arm in `run`, and
//! whatever speaks it on the wire.
//!
//! An `Op` owns its arguments, so it can be sent to a blocking thread or kept in a test's log.
//! `now` travels in the operations whose rules read the time; the actor in those that are scoped
//! to one. Neither `Op` nor `Answer` prints a secret: fences and tokens are only ever
//! [`TokenHash`]es, whose `Debug` shows two bytes.

use super::{
    Actor, ClaimOpts, Claimed, LimitsChange, NewTodo, Outcome, QueueFlow, Report, Todo, TodoFilter,
    TodoView, TokenHash, Usage,
};
use crate::error::Error;
use crate::time::Millis;

/// One operation on the queue ledger.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// Adds a todo owned by `endpoint`. Answers [`Answer::Todo`]; `conflict` when the id is taken.
    /// With an idempotency key the endpoint already used, answers [`Answer::Existing`] with the
    /// todo that key made, and adds nothing (whatever the other arguments say).
    AddTodo {
        now: Millis,
        endpoint: String,
        new: NewTodo,
    },
    /// Claims one todo by id. Answers [`Answer::Claimed`].
    Claim {
        now: Millis,
        actor: Actor,
        id: String,
        opts: ClaimOpts,
    },
    /// Claims the oldest claimable todo (by creation, then id) in `queues` (`None`: any).
    /// Answers [`Answer::Next`].
    ClaimNext {
        now: Millis,
        actor: Actor,
        queues: Option<Vec<String>>,
        opts: ClaimOpts,
    },
    /// Extends the lease to `now + ttl`, and records the attempt's usage. Answers
    /// [`Answer::Todo`]: no longer claimed when the usage reached the budget (the attempt was
    /// stopped).
    Heartbeat {
        now: Millis,
        actor: Actor,
        id: String,
        ttl: Millis,
        token_hash: Option<TokenHash>,
        usage: Option<Usage>,
    },
    /// Completes the attempt. Answers [`Answer::Todo`].
    Complete {
        now: Millis,
        actor: Actor,
        id: String,
        report: Report,
    },
    /// Fails the attempt; the answered todo carries `next_retry_at` and `dead_letter()`.
    Fail {
        now: Millis,
        actor: Actor,
        id: String,
        report: Report,
    },
    /// Gives the todo back unworked. Answers [`Answer::Todo`].
    Release {
        now: Millis,
        actor: Actor,
        id: String,
        summary: Option<String>,
        token_hash: Option<TokenHash>,
        usage: Option<Usage>,
    },
    /// The attempt asks a human `question` and stops; the todo waits for an answer (see
    /// `transition::request_input`). The report's result, retryable and signature are not
    /// read. Answers [`Answer::Todo`].
    RequestInput {
        now: Millis,
        actor: Actor,
        id: String,
        question: String,
        report: Report,
    },
    /// Answers the question a waiting todo asked; it is pending again. A repeat under the same
    /// `key` answers the todo as it is. `seq`, when set, names the attempt whose question this
    /// answers (a task's input request): a `conflict` once the todo waits on another question.
    /// Answers [`Answer::Todo`].
    AnswerTodo {
        now: Millis,
        actor: Actor,
        id: String,
        answer: String,
        key: Option<String>,
        seq: Option<u32>,
    },
    /// Keeps a report that was refused as stale on the closed attempt its lease token names
    /// (see `transition::note_late`). Answers [`Answer::Late`]: the attempt's seq, or `None`
    /// when no closed attempt matches. Never changes the todo.
    NoteLate {
        now: Millis,
        actor: Actor,
        id: String,
        /// What the refused report claimed: completed, failed or released.
        outcome: Outcome,
        summary: Option<String>,
        token_hash: Option<TokenHash>,
    },
    /// The operator's manual retry. Answers [`Answer::Todo`].
    Retry {
        now: Millis,
        actor: Actor,
        id: String,
    },
    /// Answers [`Answer::Todo`].
    Cancel {
        now: Millis,
        actor: Actor,
        id: String,
    },
    /// The reaper: closes every lapsed lease as `reaped`. Answers [`Answer::Todos`], the changed
    /// ones in id order.
    Reap { now: Millis },
    /// Moves failed todos whose retry is due back to pending. Answers [`Answer::Todos`].
    RequeueDue { now: Millis },
    /// The endpoint's open attempts close `revoked`, its claimed todos dead-letter. Answers
    /// [`Answer::Todos`]. (The endpoint row is the store's business.)
    RevokeEndpoint { now: Millis, endpoint: String },
    /// A todo and its newest `attempts_limit` attempts. Answers [`Answer::View`].
    GetTodo {
        actor: Actor,
        id: String,
        attempts_limit: usize,
    },
    /// Todos in the actor's scope, oldest first. Answers [`Answer::Todos`].
    ListTodos { actor: Actor, filter: TodoFilter },
    /// Deletes a todo and its attempts. Answers [`Answer::Deleted`].
    DeleteTodo { actor: Actor, id: String },
    /// Retention: deletes finished todos untouched for `retention`. Answers [`Answer::Ids`].
    PurgeFinished { now: Millis, retention: Millis },
    /// Pauses (`paused: true`) or resumes a queue: `claim_next` skips a paused queue, adds and
    /// claims by id still work. Only the operator may. Answers [`Answer::Queues`].
    PauseQueue {
        now: Millis,
        actor: Actor,
        queue: String,
        paused: bool,
    },
    /// The paused queues, by name. Answers [`Answer::Queues`].
    PausedQueues,
    /// Changes a queue's limits (see [`flow`](super::flow)). Only the operator may. Answers
    /// [`Answer::Flow`].
    SetQueueLimits {
        now: Millis,
        actor: Actor,
        queue: String,
        change: LimitsChange,
    },
    /// Every queue's limits and what they hold at `now`, and the paused queues. Answers
    /// [`Answer::Flow`].
    QueueFlow { now: Millis },
}

impl Op {
    /// The operation's name, as errors and logs spell it.
    pub fn name(&self) -> &'static str {
        match self {
            Op::AddTodo { .. } => "add_todo",
            Op::Claim { .. } => "claim",
            Op::ClaimNext { .. } => "claim_next",
            Op::Heartbeat { .. } => "heartbeat",
            Op::Complete { .. } => "complete",
            Op::Fail { .. } => "fail",
            Op::Release { .. } => "release",
            Op::RequestInput { .. } => "request_input",
            Op::AnswerTodo { .. } => "answer_todo",
            Op::NoteLate { .. } => "note_late",
            Op::Retry { .. } => "retry",
            Op::Cancel { .. } => "cancel",
            Op::Reap { .. } => "reap",
            Op::RequeueDue { .. } => "requeue_due",
            Op::RevokeEndpoint { .. } => "revoke",
            Op::GetTodo { .. } => "get_todo",
            Op::ListTodos { .. } => "list_todos",
            Op::DeleteTodo { .. } => "delete",
            Op::PurgeFinished { .. } => "purge_finished",
            Op::PauseQueue { paused: true, .. } => "pause",
            Op::PauseQueue { paused: false, .. } => "resume",
            Op::PausedQueues => "paused_queues",
            Op::SetQueueLimits { .. } => "queue_set",
            Op::QueueFlow { .. } => "queue_show",
        }
    }

    /// The existing todo the operation names by id: `None` for an add (the id it carries is the
    /// new todo's) and for the operations over many todos or none.
    pub fn todo_id(&self) -> Option<&str> {
        match self {
            Op::Claim { id, .. }
            | Op::Heartbeat { id, .. }
            | Op::Complete { id, .. }
            | Op::Fail { id, .. }
            | Op::Release { id, .. }
            | Op::RequestInput { id, .. }
            | Op::AnswerTodo { id, .. }
            | Op::NoteLate { id, .. }
            | Op::Retry { id, .. }
            | Op::Cancel { id, .. }
            | Op::GetTodo { id, .. }
            | Op::DeleteTodo { id, .. } => Some(id),
            Op::AddTodo { .. }
            | Op::ClaimNext { .. }
            | Op::Reap { .. }
            | Op::RequeueDue { .. }
            | Op::RevokeEndpoint { .. }
            | Op::ListTodos { .. }
            | Op::PurgeFinished { .. }
            | Op::PauseQueue { .. }
            | Op::PausedQueues
            | Op::SetQueueLimits { .. }
            | Op::QueueFlow { .. } => None,
        }
    }

    /// What the operation is about, for an error's subject: the todo id, or what it ranges over.
    pub fn subject(&self) -> String {
        match self {
            Op::AddTodo { new, .. } => new.id.clone(),
            Op::ClaimNext { actor, .. } => format!("(next for {})", actor.owner()),
            Op::Reap { .. } | Op::RequeueDue { .. } | Op::PurgeFinished { .. } => "(sweep)".into(),
            Op::RevokeEndpoint { endpoint, .. } => format!("(endpoint {endpoint})"),
            Op::ListTodos { .. } => "(list)".into(),
            Op::PauseQueue { queue, .. } | Op::SetQueueLimits { queue, .. } => {
                format!("(queue {queue})")
            }
            Op::PausedQueues | Op::QueueFlow { .. } => "(queues)".into(),
            // The rest name their todo.
            named => named.todo_id().unwrap_or_default().to_string(),
        }
    }

    /// The time the operation's rules read, for a store whose clock decides instead of the
    /// caller's (Postgres shared by several servers: the database's clock, read in the same
    /// transaction, so every server computes every lease from one clock). `None` for the
    /// operations that read no time.
    pub fn now_mut(&mut self) -> Option<&mut Millis> {
        match self {
            Op::AddTodo { now, .. }
            | Op::Claim { now, .. }
            | Op::ClaimNext { now, .. }
            | Op::Heartbeat { now, .. }
            | Op::Complete { now, .. }
            | Op::Fail { now, .. }
            | Op::Release { now, .. }
            | Op::RequestInput { now, .. }
            | Op::AnswerTodo { now, .. }
            | Op::NoteLate { now, .. }
            | Op::Retry { now, .. }
            | Op::Cancel { now, .. }
            | Op::Reap { now }
            | Op::RequeueDue { now }
            | Op::RevokeEndpoint { now, .. }
            | Op::PurgeFinished { now, .. }
            | Op::PauseQueue { now, .. }
            | Op::SetQueueLimits { now, .. }
            | Op::QueueFlow { now } => Some(now),
            Op::GetTodo { .. }
            | Op::ListTodos { .. }
            | Op::DeleteTodo { .. }
            | Op::PausedQueues => None,
        }
    }

    /// Whether the operation may write (a store takes its write lock up front) or only reads.
    pub fn writes(&self) -> bool {
        !matches!(
            self,
            Op::GetTodo { .. } | Op::ListTodos { .. } | Op::PausedQueues | Op::QueueFlow { .. }
        )
    }
}

/// What an [`Op`] answers, one variant per shape. Each `Op` documents the one it answers; the
/// accessors take that shape out (another one is an internal error: a bug, not a refusal).
#[derive(Clone, Debug, PartialEq)]
pub enum Answer {
    /// add_todo, heartbeat, complete, fail, release, request_input, answer_todo, retry, cancel.
    Todo(Todo),
    /// add_todo repeated with a key already used: the todo the first add made.
    Existing(Todo),
    /// note_late: the seq of the attempt the late report was kept on, if any.
    Late(Option<u32>),
    /// claim.
    Claimed(Claimed),
    /// claim_next: `None` when nothing is claimable.
    Next(Option<Claimed>),
    /// reap, requeue_due, revoke, list_todos.
    Todos(Vec<Todo>),
    /// get_todo.
    View(TodoView),
    /// purge_finished: the deleted ids.
    Ids(Vec<String>),
    /// delete.
    Deleted,
    /// pause, resume, paused_queues: the paused queues after the operation, by name.
    Queues(Vec<String>),
    /// queue_set, queue_show: every queue's limits and load after the operation.
    Flow(QueueFlow),
}

/// An accessor per shape: `Ok` with the value, or an internal error naming both shapes.
macro_rules! shapes {
    ($($(#[$doc:meta])* $fn:ident: $variant:ident($ty:ty);)*) => {
        impl Answer {
            $(
                $(#[$doc])*
                pub fn $fn(self) -> Result<$ty, Error> {
                    match self {
                        Answer::$variant(v) => Ok(v),
                        other => Err(other.mismatch(stringify!($variant))),
                    }
                }
            )*
        }
    };
}

shapes! {
    /// The claim of a `claim`.
    claimed: Claimed(Claimed);
    /// The claim (or none) of a `claim_next`.
    next: Next(Option<Claimed>);
    /// The todos of a sweep or a list.
    todos: Todos(Vec<Todo>);
    /// The view of a `get_todo`.
    view: View(TodoView);
    /// The ids a purge deleted.
    ids: Ids(Vec<String>);
    /// The paused queues.
    queues: Queues(Vec<String>);
    /// The queues' limits and load.
    flow: Flow(QueueFlow);
}

impl Answer {
    /// The todo of a single-todo operation (an add's new or existing one).
    pub fn todo(self) -> Result<Todo, Error> {
        match self {
            Answer::Todo(t) | Answer::Existing(t) => Ok(t),
            other => Err(other.mismatch("Todo")),
        }
    }

    /// The attempt a `note_late` kept its report on.
    pub fn late(self) -> Result<Option<u32>, Error> {
        match self {
            Answer::Late(seq) => Ok(seq),
            other => Err(other.mismatch("Late")),
        }
    }

    /// `Ok` for the answer of a `delete`.
    pub fn deleted(self) -> Result<(), Error> {
        match self {
            Answer::Deleted => Ok(()),
            other => Err(other.mismatch("Deleted")),
        }
    }

    fn mismatch(&self, wanted: &str) -> Error {
        let got = match self {
            Answer::Todo(_) => "Todo",
            Answer::Existing(_) => "Existing",
            Answer::Late(_) => "Late",
            Answer::Claimed(_) => "Claimed",
            Answer::Next(_) => "Next",
            Answer::Todos(_) => "Todos",
            Answer::View(_) => "View",
            Answer::Ids(_) => "Ids",
            Answer::Deleted => "Deleted",
            Answer::Queues(_) => "Queues",
            Answer::Flow(_) => "Flow",
        };
        Error::internal(format!("the ledger answered {got} where {wanted} was due"))
    }
}
