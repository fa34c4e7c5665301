//! Every store operation, once, over a backend's transaction: read, call core, write.
//!
//! The functions here are generic over [`Tx`]; the SQLite and Postgres backends implement it
//! with their own SQL. Nothing here decides a lifecycle rule: those are the calls into
//! `relay_core::ledger::transition`.

use relay_core::Error;
use relay_core::Millis;
use relay_core::ledger::{
    self, Actor, Attempt, AttemptWrite, Change, ClaimOpts, Claimed, LedgerConfig, NewTodo, Outcome,
    PRIOR_ATTEMPTS, Report, Todo, TodoFilter, TodoState, TodoView, TokenHash, transition,
};

use super::{Endpoint, NewEndpoint};

/// Whether a transaction writes (SQLite `BEGIN IMMEDIATE`) or only reads (a consistent snapshot).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TxKind {
    Write,
    Read,
}

/// Which rows a sweep looks at. Each filter mirrors the precondition of its transition; the
/// transition still decides, and a candidate whose transition yields nothing is skipped.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Sweep<'a> {
    /// mirrors transition::reap: claimed with a lapsed lease.
    Reap { now: Millis },
    /// mirrors transition::requeue_due: failed, retry due, attempts left.
    RequeueDue { now: Millis },
    /// mirrors transition::revoke (scoped to one endpoint): claimed.
    Revoke { endpoint: &'a str },
    /// mirrors ledger::purgeable: finished, untouched since `cutoff`.
    Purge { cutoff: Millis },
}

/// One backend transaction. Reads of a todo for a write lock its row until commit.
pub(crate) trait Tx {
    /// The todo and its open attempt, the row locked for the rest of the transaction.
    async fn load(&mut self, op: &str, id: &str) -> Result<Option<(Todo, Option<Attempt>)>, Error>;
    /// The first claimable todo by (created_at, id) with its open attempt, locked (Postgres skips
    /// rows other transactions hold).
    async fn next_claimable(
        &mut self,
        now: Millis,
        actor: &Actor,
        queues: Option<&[String]>,
    ) -> Result<Option<(Todo, Option<Attempt>)>, Error>;
    /// Inserts a todo; `false` when the id is taken.
    async fn insert_todo(&mut self, t: &Todo) -> Result<bool, Error>;
    /// Writes a change: the columns of the todo a transition may change, then each attempt
    /// write in order (`Open` inserts, `Update` rewrites the attempt only while it is open,
    /// `PruneThrough` deletes closed attempts at or below the floor). Returns the rows each
    /// attempt write touched, so the caller can hold `Update` to exactly one.
    async fn write(
        &mut self,
        op: &str,
        todo: &Todo,
        writes: &[AttemptWrite],
    ) -> Result<Vec<u64>, Error>;
    /// Inserts an attempt as it is (tests plant broken rows with it).
    #[cfg(test)]
    async fn insert_attempt(&mut self, op: &str, a: &Attempt) -> Result<(), Error>;
    /// Attempts newest first: all, or only closed ones.
    async fn attempts(
        &mut self,
        op: &str,
        id: &str,
        closed_only: bool,
        limit: usize,
    ) -> Result<Vec<Attempt>, Error>;
    /// Candidate ids of a sweep, in id order, locked.
    async fn candidates(&mut self, sweep: Sweep<'_>) -> Result<Vec<String>, Error>;
    async fn list(&mut self, actor: &Actor, filter: &TodoFilter) -> Result<Vec<Todo>, Error>;
    /// How many todos are in each state (states with none are absent).
    async fn count_by_state(&mut self) -> Result<Vec<(String, u64)>, Error>;
    async fn delete(&mut self, op: &str, id: &str) -> Result<(), Error>;

    async fn insert_endpoint(&mut self, e: &Endpoint) -> Result<bool, Error>;
    async fn endpoint(&mut self, name: &str, lock: bool) -> Result<Option<Endpoint>, Error>;
    async fn endpoints(&mut self) -> Result<Vec<Endpoint>, Error>;
    async fn set_revoked(&mut self, name: &str, at: Millis) -> Result<(), Error>;
}

/// Writes a transition's change. Updates close exactly once: an `Update` that finds no open row
/// is an internal error, and the caller's transaction rolls back.
async fn apply<T: Tx>(tx: &mut T, op: &str, before: &Todo, change: Change) -> Result<Todo, Error> {
    let t = &change.todo;
    // The store writes only what transitions change; a transition that changed anything else
    // would be silently lost, so refuse it loudly instead.
    let same = t.id == before.id
        && t.endpoint == before.endpoint
        && t.queue == before.queue
        && t.title == before.title
        && t.kind == before.kind
        && t.source == before.source
        && t.assignee == before.assignee
        && t.max_attempts == before.max_attempts
        && t.created_at == before.created_at
        && t.payload == before.payload
        && t.work_order == before.work_order;
    if !same {
        return Err(Error::internal(format!(
            "{op} {}: the transition changed a column the store does not write",
            t.id
        )));
    }
    let rows = tx.write(op, t, &change.writes).await?;
    for (w, n) in change.writes.iter().zip(rows) {
        if let AttemptWrite::Update(a) = w
            && n != 1
        {
            return Err(Error::internal(format!(
                "{op} {}: attempt {} is not open; an attempt closes exactly once",
                t.id, a.seq
            )));
        }
    }
    Ok(change.todo)
}

async fn load<T: Tx>(tx: &mut T, op: &str, id: &str) -> Result<(Todo, Option<Attempt>), Error> {
    // core's rule: a string that is no todo id names no todo, whatever a store would make of it.
    if !ledger::valid_todo_id(id) {
        return Err(transition::not_found(op, id));
    }
    tx.load(op, id)
        .await?
        .ok_or_else(|| transition::not_found(op, id))
}

/// Reads the todo, runs the transition, writes its change.
async fn transit<T: Tx>(
    tx: &mut T,
    op: &str,
    id: &str,
    f: impl FnOnce(&Todo, Option<&Attempt>) -> Result<Change, Error>,
) -> Result<Todo, Error> {
    let (todo, open) = load(tx, op, id).await?;
    let change = f(&todo, open.as_ref())?;
    apply(tx, op, &todo, change).await
}

/// A report: its transition, or, when that is refused as a conflict, the answer to a repeat of
/// a report already applied under the same lease token (see `transition::replay`).
async fn reported<T: Tx>(
    tx: &mut T,
    op: &str,
    id: &str,
    actor: &Actor,
    token_hash: Option<TokenHash>,
    outcome: Outcome,
    f: impl FnOnce(&Todo, Option<&Attempt>) -> Result<Change, Error>,
) -> Result<Todo, Error> {
    let (todo, open) = load(tx, op, id).await?;
    match f(&todo, open.as_ref()) {
        Ok(change) => apply(tx, op, &todo, change).await,
        Err(refused) => {
            let recent = tx.attempts(op, id, true, PRIOR_ATTEMPTS).await?;
            transition::replay(refused, &todo, &recent, actor, token_hash, outcome)
        }
    }
}

pub(crate) async fn add_todo<T: Tx>(
    tx: &mut T,
    now: Millis,
    endpoint: &str,
    new: NewTodo,
) -> Result<Todo, Error> {
    let todo = ledger::new_todo(now, endpoint, new)?;
    if tx.insert_todo(&todo).await? {
        Ok(todo)
    } else {
        Err(Error::conflict(format!(
            "add_todo {}: a todo with this id exists; choose another id",
            todo.id
        )))
    }
}

async fn claim_loaded<T: Tx>(
    tx: &mut T,
    cfg: &LedgerConfig,
    now: Millis,
    actor: &Actor,
    todo: Todo,
    open: Option<Attempt>,
    opts: &ClaimOpts,
) -> Result<Claimed, Error> {
    let op = "claim";
    let takeover = todo.state == TodoState::Claimed;
    let change = transition::claim(cfg, now, &todo, open.as_ref(), actor, opts)?;
    let todo = apply(tx, op, &todo, change).await?;
    // The kept attempts are seqs pruned+1 ..= total and only the newest is open (check_todo), so
    // when the new attempt is the only one kept there is no closed one to read.
    let prior_attempts = if todo.attempts_total > todo.attempts_pruned + 1 {
        tx.attempts(op, &todo.id, true, PRIOR_ATTEMPTS).await?
    } else {
        Vec::new()
    };
    Ok(Claimed {
        attempt_seq: todo.attempts_total,
        attempts_total: todo.attempts_total,
        prior_attempts,
        takeover,
        todo,
    })
}

pub(crate) async fn claim<T: Tx>(
    tx: &mut T,
    cfg: &LedgerConfig,
    now: Millis,
    actor: &Actor,
    id: &str,
    opts: &ClaimOpts,
) -> Result<Claimed, Error> {
    let (todo, open) = load(tx, "claim", id).await?;
    claim_loaded(tx, cfg, now, actor, todo, open, opts).await
}

pub(crate) async fn claim_next<T: Tx>(
    tx: &mut T,
    cfg: &LedgerConfig,
    now: Millis,
    actor: &Actor,
    queues: Option<&[String]>,
    opts: &ClaimOpts,
) -> Result<Option<Claimed>, Error> {
    transition::check_ttl("claim_next", opts.ttl)?;
    let queues = queues.map(ledger::storable_queue_filter);
    match tx.next_claimable(now, actor, queues.as_deref()).await? {
        Some((todo, open)) => claim_loaded(tx, cfg, now, actor, todo, open, opts)
            .await
            .map(Some),
        None => Ok(None),
    }
}

pub(crate) async fn heartbeat<T: Tx>(
    tx: &mut T,
    now: Millis,
    actor: &Actor,
    id: &str,
    ttl: Millis,
    token_hash: Option<TokenHash>,
) -> Result<Todo, Error> {
    transit(tx, "heartbeat", id, |t, open| {
        transition::heartbeat(now, t, open, actor, ttl, token_hash)
    })
    .await
}

pub(crate) async fn complete<T: Tx>(
    tx: &mut T,
    cfg: &LedgerConfig,
    now: Millis,
    actor: &Actor,
    id: &str,
    report: &Report,
) -> Result<Todo, Error> {
    let f =
        |t: &Todo, open: Option<&Attempt>| transition::complete(cfg, now, t, open, actor, report);
    reported(
        tx,
        "complete",
        id,
        actor,
        report.token_hash,
        Outcome::Completed,
        f,
    )
    .await
}

pub(crate) async fn fail<T: Tx>(
    tx: &mut T,
    cfg: &LedgerConfig,
    now: Millis,
    actor: &Actor,
    id: &str,
    report: &Report,
) -> Result<Todo, Error> {
    let f = |t: &Todo, open: Option<&Attempt>| transition::fail(cfg, now, t, open, actor, report);
    reported(tx, "fail", id, actor, report.token_hash, Outcome::Failed, f).await
}

pub(crate) async fn release<T: Tx>(
    tx: &mut T,
    now: Millis,
    actor: &Actor,
    id: &str,
    summary: Option<&str>,
    token_hash: Option<TokenHash>,
) -> Result<Todo, Error> {
    let f = |t: &Todo, open: Option<&Attempt>| {
        transition::release(now, t, open, actor, summary, token_hash)
    };
    reported(tx, "release", id, actor, token_hash, Outcome::Released, f).await
}

pub(crate) async fn retry<T: Tx>(
    tx: &mut T,
    now: Millis,
    actor: &Actor,
    id: &str,
) -> Result<Todo, Error> {
    let (todo, _) = load(tx, "retry", id).await?;
    let newest = tx.attempts("retry", id, false, 1).await?;
    let change = transition::retry(now, &todo, newest.first(), actor)?;
    apply(tx, "retry", &todo, change).await
}

pub(crate) async fn cancel<T: Tx>(
    tx: &mut T,
    now: Millis,
    actor: &Actor,
    id: &str,
) -> Result<Todo, Error> {
    transit(tx, "cancel", id, |t, open| {
        transition::cancel(now, t, open, actor)
    })
    .await
}

/// Applies `f` to every candidate of the sweep; rows whose transition yields `None` are skipped.
async fn sweep<T: Tx>(
    tx: &mut T,
    op: &str,
    which: Sweep<'_>,
    f: impl Fn(&Todo, Option<&Attempt>) -> Result<Option<Change>, Error>,
) -> Result<Vec<Todo>, Error> {
    let mut changed = Vec::new();
    for id in tx.candidates(which).await? {
        // A candidate deleted meanwhile is simply gone.
        let Some((todo, open)) = tx.load(op, &id).await? else {
            continue;
        };
        if let Some(change) = f(&todo, open.as_ref())? {
            changed.push(apply(tx, op, &todo, change).await?);
        }
    }
    Ok(changed)
}

pub(crate) async fn reap<T: Tx>(tx: &mut T, now: Millis) -> Result<Vec<Todo>, Error> {
    sweep(tx, "reap", Sweep::Reap { now }, |t, open| {
        transition::reap(now, t, open)
    })
    .await
}

pub(crate) async fn requeue_due<T: Tx>(tx: &mut T, now: Millis) -> Result<Vec<Todo>, Error> {
    sweep(tx, "requeue_due", Sweep::RequeueDue { now }, |t, _| {
        Ok(transition::requeue_due(now, t))
    })
    .await
}

pub(crate) async fn revoke_todos<T: Tx>(
    tx: &mut T,
    now: Millis,
    endpoint: &str,
) -> Result<Vec<Todo>, Error> {
    sweep(tx, "revoke", Sweep::Revoke { endpoint }, |t, open| {
        transition::revoke(now, t, open)
    })
    .await
}

pub(crate) async fn get_todo<T: Tx>(
    tx: &mut T,
    actor: &Actor,
    id: &str,
    attempts_limit: usize,
) -> Result<TodoView, Error> {
    let op = "get_todo";
    let (todo, _) = load(tx, op, id).await?;
    if !actor.sees(&todo) {
        return Err(transition::not_found(op, id));
    }
    let attempts = tx.attempts(op, id, false, attempts_limit).await?;
    Ok(TodoView {
        attempts_total: todo.attempts_total,
        attempts_pruned: todo.attempts_pruned,
        todo,
        attempts,
    })
}

pub(crate) async fn list_todos<T: Tx>(
    tx: &mut T,
    actor: &Actor,
    filter: &TodoFilter,
) -> Result<Vec<Todo>, Error> {
    let filter = TodoFilter {
        queues: filter.queues.as_deref().map(ledger::storable_queue_filter),
        ..filter.clone()
    };
    tx.list(actor, &filter).await
}

pub(crate) async fn count_by_state<T: Tx>(tx: &mut T) -> Result<Vec<(String, u64)>, Error> {
    tx.count_by_state().await
}

pub(crate) async fn delete_todo<T: Tx>(tx: &mut T, actor: &Actor, id: &str) -> Result<(), Error> {
    let op = "delete";
    let (todo, _) = load(tx, op, id).await?;
    if !actor.sees(&todo) {
        return Err(transition::not_found(op, id));
    }
    tx.delete(op, id).await
}

pub(crate) async fn purge_finished<T: Tx>(
    tx: &mut T,
    now: Millis,
    retention: Millis,
) -> Result<Vec<String>, Error> {
    let op = "purge_finished";
    // Nothing can be older than the epoch: a retention longer than `now` purges nothing.
    let Some(cutoff) = now.checked_sub(retention) else {
        return Ok(Vec::new());
    };
    let mut purged = Vec::new();
    for id in tx.candidates(Sweep::Purge { cutoff }).await? {
        let Some((todo, _)) = tx.load(op, &id).await? else {
            continue;
        };
        if ledger::purgeable(&todo, now, retention) {
            tx.delete(op, &id).await?;
            purged.push(id);
        }
    }
    Ok(purged)
}

pub(crate) async fn endpoint_create<T: Tx>(
    tx: &mut T,
    now: Millis,
    new: NewEndpoint,
) -> Result<Endpoint, Error> {
    if new.name.is_empty() {
        return Err(Error::invalid(
            "endpoint create: the name must not be empty",
        ));
    }
    let e = Endpoint {
        name: new.name,
        token_hash: new.token_hash,
        verbs: new.verbs,
        queues: new.queues,
        created_at: now,
        revoked_at: None,
    };
    if tx.insert_endpoint(&e).await? {
        Ok(e)
    } else {
        Err(Error::conflict(format!(
            "endpoint create {}: an endpoint with this name exists; choose another name",
            e.name
        )))
    }
}

pub(crate) async fn endpoint_list<T: Tx>(tx: &mut T) -> Result<Vec<Endpoint>, Error> {
    tx.endpoints().await
}

pub(crate) async fn endpoint_get<T: Tx>(tx: &mut T, name: &str) -> Result<Option<Endpoint>, Error> {
    tx.endpoint(name, false).await
}

pub(crate) async fn endpoint_revoke<T: Tx>(
    tx: &mut T,
    now: Millis,
    name: &str,
) -> Result<(Endpoint, Vec<Todo>), Error> {
    let op = "endpoint revoke";
    let Some(mut e) = tx.endpoint(name, true).await? else {
        return Err(Error::not_found(format!(
            "{op} {name}: no such endpoint; `relay endpoint list` shows them"
        )));
    };
    if let Some(at) = e.revoked_at {
        return Err(Error::conflict(format!(
            "{op} {name}: already revoked (at {}); nothing to do",
            relay_core::time::rfc3339(at)
        )));
    }
    tx.set_revoked(name, now).await?;
    e.revoked_at = Some(now);
    let todos = revoke_todos(tx, now, name).await?;
    Ok((e, todos))
}

/// Inserts an attempt as it is, without any transition: only for tests that plant a broken row
/// to prove the database refuses it.
#[cfg(test)]
pub(crate) async fn plant_attempt<T: Tx>(tx: &mut T, a: &Attempt) -> Result<(), Error> {
    tx.insert_attempt("plant", a).await
}
