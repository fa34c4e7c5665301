//! The queue side as one trait over [`Op`], so that the ledger and both stores can be driven by
//! the same program and their answers compared, and so that hand-written tests can call an
//! operation by name.

use crate::error::Error;
use crate::ledger::{
    Actor, Answer, ClaimOpts, Claimed, Ledger, Limits, LimitsChange, NewTodo, Op, QueueFlow,
    Report, Todo, TodoFilter, TodoView, TokenHash,
};
use crate::time::Millis;

/// Anything that applies an [`Op`]: the ledger answers at once, a store (in its tests) with a
/// future. The one required method is [`Queue::call`]; the named calls below are conveniences
/// for tests, each building its `Op` and taking its answer's shape, nothing else.
pub trait Queue {
    /// What a call gives back: the result itself, or a future of it.
    type Out<T: 'static>;

    /// Applies `op` and takes the answer's shape with `shape` (an [`Answer`] accessor).
    fn call<T: 'static>(&mut self, op: Op, shape: fn(Answer) -> Result<T, Error>) -> Self::Out<T>;

    /// Applies `op` and hands back the whole answer.
    fn apply_op(&mut self, op: Op) -> Self::Out<Answer> {
        self.call(op, Ok)
    }

    fn add_todo(&mut self, now: Millis, endpoint: &str, new: NewTodo) -> Self::Out<Todo> {
        let endpoint = endpoint.into();
        self.call(Op::AddTodo { now, endpoint, new }, Answer::todo)
    }
    fn claim(&mut self, now: Millis, a: &Actor, id: &str, o: &ClaimOpts) -> Self::Out<Claimed> {
        let op = Op::Claim {
            now,
            actor: a.clone(),
            id: id.into(),
            opts: o.clone(),
        };
        self.call(op, Answer::claimed)
    }
    fn claim_next(
        &mut self,
        now: Millis,
        a: &Actor,
        queues: Option<&[String]>,
        o: &ClaimOpts,
    ) -> Self::Out<Option<Claimed>> {
        let op = Op::ClaimNext {
            now,
            actor: a.clone(),
            queues: queues.map(<[String]>::to_vec),
            opts: o.clone(),
        };
        self.call(op, Answer::next)
    }
    fn heartbeat(
        &mut self,
        now: Millis,
        a: &Actor,
        id: &str,
        ttl: Millis,
        token_hash: Option<TokenHash>,
    ) -> Self::Out<Todo> {
        let (actor, id) = (a.clone(), id.into());
        let op = Op::Heartbeat {
            ttl,
            token_hash,
            now,
            actor,
            id,
            usage: None,
        };
        self.call(op, Answer::todo)
    }
    fn complete(&mut self, now: Millis, a: &Actor, id: &str, r: &Report) -> Self::Out<Todo> {
        let op = Op::Complete {
            now,
            actor: a.clone(),
            id: id.into(),
            report: r.clone(),
        };
        self.call(op, Answer::todo)
    }
    fn fail(&mut self, now: Millis, a: &Actor, id: &str, r: &Report) -> Self::Out<Todo> {
        let (actor, id, report) = (a.clone(), id.into(), r.clone());
        self.call(
            Op::Fail {
                now,
                actor,
                id,
                report,
            },
            Answer::todo,
        )
    }
    fn release(
        &mut self,
        now: Millis,
        a: &Actor,
        id: &str,
        summary: Option<&str>,
        token_hash: Option<TokenHash>,
    ) -> Self::Out<Todo> {
        let op = Op::Release {
            now,
            actor: a.clone(),
            id: id.into(),
            summary: summary.map(str::to_string),
            token_hash,
            usage: None,
        };
        self.call(op, Answer::todo)
    }
    fn retry(&mut self, now: Millis, a: &Actor, id: &str) -> Self::Out<Todo> {
        let (actor, id) = (a.clone(), id.into());
        self.call(Op::Retry { now, actor, id }, Answer::todo)
    }
    fn cancel(&mut self, now: Millis, a: &Actor, id: &str) -> Self::Out<Todo> {
        let (actor, id) = (a.clone(), id.into());
        self.call(Op::Cancel { now, actor, id }, Answer::todo)
    }
    /// The operator sets `queue`'s limits (each `None` lifted).
    fn set_limits(&mut self, now: Millis, queue: &str, l: Limits) -> Self::Out<QueueFlow> {
        let op = Op::SetQueueLimits {
            now,
            actor: Actor::cli(),
            queue: queue.into(),
            change: LimitsChange {
                max_claimed: Some(l.max_claimed),
                max_claimed_per_key: Some(l.max_claimed_per_key),
                claims_per_minute: Some(l.claims_per_minute),
            },
        };
        self.call(op, Answer::flow)
    }
    fn reap(&mut self, now: Millis) -> Self::Out<Vec<Todo>> {
        self.call(Op::Reap { now }, Answer::todos)
    }
    fn requeue_due(&mut self, now: Millis) -> Self::Out<Vec<Todo>> {
        self.call(Op::RequeueDue { now }, Answer::todos)
    }
    fn revoke_endpoint(&mut self, now: Millis, endpoint: &str) -> Self::Out<Vec<Todo>> {
        let endpoint = endpoint.into();
        self.call(Op::RevokeEndpoint { now, endpoint }, Answer::todos)
    }
    fn get_todo(&mut self, a: &Actor, id: &str, attempts_limit: usize) -> Self::Out<TodoView> {
        let (actor, id) = (a.clone(), id.into());
        let op = Op::GetTodo {
            actor,
            id,
            attempts_limit,
        };
        self.call(op, Answer::view)
    }
    fn list_todos(&mut self, a: &Actor, filter: &TodoFilter) -> Self::Out<Vec<Todo>> {
        let (actor, filter) = (a.clone(), filter.clone());
        self.call(Op::ListTodos { actor, filter }, Answer::todos)
    }
    fn delete_todo(&mut self, a: &Actor, id: &str) -> Self::Out<()> {
        let (actor, id) = (a.clone(), id.into());
        self.call(Op::DeleteTodo { actor, id }, Answer::deleted)
    }
    fn purge_finished(&mut self, now: Millis, retention: Millis) -> Self::Out<Vec<String>> {
        self.call(Op::PurgeFinished { now, retention }, Answer::ids)
    }
    fn pause_queue(
        &mut self,
        now: Millis,
        a: &Actor,
        queue: &str,
        paused: bool,
    ) -> Self::Out<Vec<String>> {
        let op = Op::PauseQueue {
            now,
            actor: a.clone(),
            queue: queue.into(),
            paused,
        };
        self.call(op, Answer::queues)
    }
}

impl Queue for Ledger {
    type Out<T: 'static> = Result<T, Error>;

    fn call<T: 'static>(
        &mut self,
        op: Op,
        shape: fn(Answer) -> Result<T, Error>,
    ) -> Result<T, Error> {
        self.apply(op).and_then(shape)
    }
}
