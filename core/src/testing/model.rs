//! The queue side's operations as one trait, so that the ledger and both stores can be driven
//! by the same program and their answers compared.

use crate::error::Error;
use crate::ledger::{
    Actor, ClaimOpts, Claimed, Ledger, NewTodo, Report, Todo, TodoFilter, TodoView, TokenHash,
};
use crate::time::Millis;

/// The queue side's operations, as the ledger offers them. The stores implement it too (in
/// their tests, blocking on each call), so one random program can drive both and their answers
/// can be compared: that is the model-based test that holds every store to the ledger.
#[allow(missing_docs)]
pub trait Queue {
    fn add_todo(&mut self, now: Millis, endpoint: &str, new: NewTodo) -> Result<Todo, Error>;
    fn claim(
        &mut self,
        now: Millis,
        actor: &Actor,
        id: &str,
        opts: &ClaimOpts,
    ) -> Result<Claimed, Error>;
    fn claim_next(
        &mut self,
        now: Millis,
        actor: &Actor,
        queues: Option<&[String]>,
        opts: &ClaimOpts,
    ) -> Result<Option<Claimed>, Error>;
    fn heartbeat(
        &mut self,
        now: Millis,
        actor: &Actor,
        id: &str,
        ttl: Millis,
        token_hash: Option<TokenHash>,
    ) -> Result<Todo, Error>;
    fn complete(&mut self, now: Millis, actor: &Actor, id: &str, r: &Report)
    -> Result<Todo, Error>;
    fn fail(&mut self, now: Millis, actor: &Actor, id: &str, r: &Report) -> Result<Todo, Error>;
    fn release(
        &mut self,
        now: Millis,
        actor: &Actor,
        id: &str,
        summary: Option<&str>,
        token_hash: Option<TokenHash>,
    ) -> Result<Todo, Error>;
    fn retry(&mut self, now: Millis, actor: &Actor, id: &str) -> Result<Todo, Error>;
    fn cancel(&mut self, now: Millis, actor: &Actor, id: &str) -> Result<Todo, Error>;
    fn reap(&mut self, now: Millis) -> Result<Vec<Todo>, Error>;
    fn requeue_due(&mut self, now: Millis) -> Result<Vec<Todo>, Error>;
    fn revoke_endpoint(&mut self, now: Millis, endpoint: &str) -> Result<Vec<Todo>, Error>;
    fn get_todo(&mut self, actor: &Actor, id: &str, limit: usize) -> Result<TodoView, Error>;
    fn list_todos(&mut self, actor: &Actor, filter: &TodoFilter) -> Result<Vec<Todo>, Error>;
    fn delete_todo(&mut self, actor: &Actor, id: &str) -> Result<(), Error>;
    fn purge_finished(&mut self, now: Millis, retention: Millis) -> Result<Vec<String>, Error>;
}

impl Queue for Ledger {
    fn add_todo(&mut self, now: Millis, endpoint: &str, new: NewTodo) -> Result<Todo, Error> {
        Ledger::add_todo(self, now, endpoint, new)
    }
    fn claim(
        &mut self,
        now: Millis,
        actor: &Actor,
        id: &str,
        opts: &ClaimOpts,
    ) -> Result<Claimed, Error> {
        Ledger::claim(self, now, actor, id, opts)
    }
    fn claim_next(
        &mut self,
        now: Millis,
        actor: &Actor,
        queues: Option<&[String]>,
        opts: &ClaimOpts,
    ) -> Result<Option<Claimed>, Error> {
        Ledger::claim_next(self, now, actor, queues, opts)
    }
    fn heartbeat(
        &mut self,
        now: Millis,
        actor: &Actor,
        id: &str,
        ttl: Millis,
        token_hash: Option<TokenHash>,
    ) -> Result<Todo, Error> {
        Ledger::heartbeat(self, now, actor, id, ttl, token_hash)
    }
    fn complete(
        &mut self,
        now: Millis,
        actor: &Actor,
        id: &str,
        r: &Report,
    ) -> Result<Todo, Error> {
        Ledger::complete(self, now, actor, id, r)
    }
    fn fail(&mut self, now: Millis, actor: &Actor, id: &str, r: &Report) -> Result<Todo, Error> {
        Ledger::fail(self, now, actor, id, r)
    }
    fn release(
        &mut self,
        now: Millis,
        actor: &Actor,
        id: &str,
        summary: Option<&str>,
        token_hash: Option<TokenHash>,
    ) -> Result<Todo, Error> {
        Ledger::release(self, now, actor, id, summary, token_hash)
    }
    fn retry(&mut self, now: Millis, actor: &Actor, id: &str) -> Result<Todo, Error> {
        Ledger::retry(self, now, actor, id)
    }
    fn cancel(&mut self, now: Millis, actor: &Actor, id: &str) -> Result<Todo, Error> {
        Ledger::cancel(self, now, actor, id)
    }
    fn reap(&mut self, now: Millis) -> Result<Vec<Todo>, Error> {
        Ledger::reap(self, now)
    }
    fn requeue_due(&mut self, now: Millis) -> Result<Vec<Todo>, Error> {
        Ledger::requeue_due(self, now)
    }
    fn revoke_endpoint(&mut self, now: Millis, endpoint: &str) -> Result<Vec<Todo>, Error> {
        Ledger::revoke_endpoint(self, now, endpoint)
    }
    fn get_todo(&mut self, actor: &Actor, id: &str, limit: usize) -> Result<TodoView, Error> {
        Ledger::get_todo(self, actor, id, limit)
    }
    fn list_todos(&mut self, actor: &Actor, filter: &TodoFilter) -> Result<Vec<Todo>, Error> {
        Ok(Ledger::list_todos(self, actor, filter))
    }
    fn delete_todo(&mut self, actor: &Actor, id: &str) -> Result<(), Error> {
        Ledger::delete_todo(self, actor, id)
    }
    fn purge_finished(&mut self, now: Millis, retention: Millis) -> Result<Vec<String>, Error> {
        Ok(Ledger::purge_finished(self, now, retention))
    }
}
