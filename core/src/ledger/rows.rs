//! How an [`Op`] is applied, once for every backend: read the rows, call the transition, write
//! its [`Change`], assemble the answer.
//!
//! A backend offers [`Rows`]: what one transaction can read and write (a todo with its open
//! attempt, its attempts, the oldest claimable todo, a sweep's candidates). The in-memory
//! [`Ledger`](super::Ledger) implements it over its maps; each SQL store over its transaction,
//! with its own SQL. Everything between the rows and the rules is here: the duplicate-id
//! conflict, the scope checks, the takeover flag and the [`Claimed`] assembly, the replay of a
//! repeated report, and holding every `Update` to exactly one open row.
//!
//! The methods of [`Rows`] are `async` so that a Postgres transaction can await its round trips;
//! the ledger's and SQLite's never wait, and [`ready`] drives them to their end in one poll.

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use super::flow::QueueFlow;
use super::flow::{self, Holds, Limits, Load};
use super::op::{Answer, Op};
use super::transition::{
    self, Actor, AttemptWrite, Change, ClaimOpts, LedgerConfig, Report, Reporter,
};
use super::types::{Attempt, Outcome, Todo, TodoState};
use super::{Claimed, NewTodo, PRIOR_ATTEMPTS, TodoFilter, TodoView};
use crate::error::Error;
use crate::time::Millis;

/// Which rows a sweep looks at. A backend may answer more than the filter says (the in-memory
/// ledger filters by state alone): each candidate's transition still decides, and one that
/// yields nothing is skipped. SQL filters mirror the transitions' preconditions so as to read few rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sweep<'a> {
    /// mirrors transition::reap: claimed with a lapsed lease.
    Reap { now: Millis },
    /// mirrors transition::requeue_due: failed, retry due, attempts left; pending with its
    /// `run_at` come; or pending or failed with a retry scheduled, past the deadline.
    RequeueDue { now: Millis },
    /// mirrors transition::revoke (scoped to one endpoint): claimed.
    Revoke { now: Millis, endpoint: &'a str },
    /// mirrors ledger::purgeable: finished, untouched since `cutoff`.
    Purge { cutoff: Millis },
}

impl Sweep<'_> {
    /// What the sweep does to one candidate: its transition (the revocation only on the
    /// endpoint's own todos), which decides whatever rows a backend read. A purge deletes
    /// instead of transiting: `None` for it.
    pub fn change(&self, t: &Todo, open: Option<&Attempt>) -> Result<Option<Change>, Error> {
        match *self {
            Sweep::Reap { now } => transition::reap(now, t, open),
            Sweep::RequeueDue { now } => Ok(transition::requeue_due(now, t)),
            Sweep::Revoke { now, endpoint } if t.endpoint == endpoint => {
                transition::revoke(now, t, open)
            }
            Sweep::Revoke { .. } | Sweep::Purge { .. } => Ok(None),
        }
    }
}

/// Which of a todo's attempts [`Rows::attempts`] reads: the newest `limit`, all or only closed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Newest {
    pub closed_only: bool,
    pub limit: usize,
}

impl Newest {
    /// The newest `limit` attempts, the open one included.
    pub fn all(limit: usize) -> Newest {
        Newest {
            closed_only: false,
            limit,
        }
    }

    /// The newest `limit` closed attempts.
    pub fn closed(limit: usize) -> Newest {
        Newest {
            closed_only: true,
            limit,
        }
    }
}

/// A todo and its open attempt, as a backend reads them.
pub type Loaded = (Todo, Option<Attempt>);

/// What `claim_next` asks of the rows: the first todo `actor` may claim at `now` from `queues`
/// (valid queue names only; `None`, every queue) that the flow `holds` do not hold back. `op`
/// names the operation in errors.
#[derive(Clone, Copy, Debug)]
pub struct ClaimQuery<'a> {
    pub op: &'a str,
    pub now: Millis,
    pub actor: &'a Actor,
    pub queues: Option<&'a [String]>,
    pub holds: &'a Holds,
}

impl<'a> ClaimQuery<'a> {
    /// The query of a `claim_next`.
    pub fn new(
        now: Millis,
        actor: &'a Actor,
        queues: Option<&'a [String]>,
        holds: &'a Holds,
    ) -> ClaimQuery<'a> {
        ClaimQuery {
            op: "claim_next",
            now,
            actor,
            queues,
            holds,
        }
    }

    /// Whether the query admits `t`: claimable now by the actor from the queues, and not held
    /// back. A backend's claim SQL must agree with it.
    pub fn admits(&self, t: &Todo) -> bool {
        transition::claimable(self.now, t, self.actor, self.queues) && !self.holds.holds(t)
    }
}

/// What a backend offers inside one transaction. Reads of a todo in a writing transaction lock
/// its row until commit; a failed operation's writes are rolled back by the caller.
// Not `Send`-bounded: SQLite's transaction is not `Sync`, and every caller names a concrete
// backend, whose futures are as `Send` as their bodies.
#[allow(async_fn_in_trait)]
pub trait Rows {
    /// The todo and its open attempt, the row locked for the rest of the transaction.
    async fn load(&mut self, op: &str, id: &str) -> Result<Option<Loaded>, Error>;
    /// The first todo in [`super::claim_order`] that `query` admits (see
    /// [`ClaimQuery::admits`]), with its open attempt, locked (Postgres skips rows other
    /// transactions hold).
    async fn next_claimable(&mut self, query: &ClaimQuery<'_>) -> Result<Option<Loaded>, Error>;
    /// The endpoint's todo added with this idempotency key, if it still exists.
    async fn by_key(&mut self, endpoint: &str, key: &str) -> Result<Option<Todo>, Error>;
    /// Inserts a todo; `false` when the id is taken, or the endpoint's idempotency key is (a
    /// unique index, so that concurrent adds with one key make one todo).
    async fn insert_todo(&mut self, t: &Todo) -> Result<bool, Error>;
    /// Writes a change: the columns of its todo a transition may change, then each attempt
    /// write in order (`Open` inserts, `Update` rewrites the attempt only while it is open,
    /// `PruneThrough` deletes closed attempts at or below the floor, `Late` rewrites a closed
    /// attempt's late reports and nothing else). Returns the rows each
    /// attempt write touched, so that [`run`] can hold `Update` to exactly one.
    async fn write(&mut self, op: &str, change: &Change) -> Result<Vec<u64>, Error>;
    /// A todo's attempts newest first, as `which` says.
    async fn attempts(&mut self, op: &str, id: &str, which: Newest) -> Result<Vec<Attempt>, Error>;
    /// Candidate ids of a sweep, in id order, locked.
    async fn candidates(&mut self, sweep: Sweep<'_>) -> Result<Vec<String>, Error>;
    /// Todos in the actor's scope matching the filter (valid queue names only), oldest first.
    async fn list(&mut self, actor: &Actor, filter: &TodoFilter) -> Result<Vec<Todo>, Error>;
    /// Deletes a todo and its attempts.
    async fn delete(&mut self, op: &str, id: &str) -> Result<(), Error>;
    /// The paused queues, by name.
    async fn paused_queues(&mut self) -> Result<Vec<String>, Error>;
    /// Records a queue as paused (from `now`) or not; pausing a paused queue keeps its time.
    async fn set_paused(&mut self, now: Millis, queue: &str, paused: bool) -> Result<(), Error>;
    /// The queues with limits, sorted by queue.
    async fn queue_limits(&mut self) -> Result<Vec<(String, Limits)>, Error>;
    /// Records a queue's limits (none: the queue keeps no row, nor its rate window).
    async fn set_queue_limits(&mut self, now: Millis, queue: &str, l: Limits) -> Result<(), Error>;
    /// What the queues with limits hold at `now` (see [`Load`]). With `lock`, read after
    /// taking the flow lock, which serialises the claims in limited queues until the transaction
    /// ends (Postgres: a transaction lock, so that two servers never count the same free place;
    /// SQLite's single writer and the in-memory ledger need none).
    async fn flow_load(&mut self, now: Millis, lock: bool) -> Result<Load, Error>;
    /// Records a claim in a rate-limited `queue` at `now`, forgetting its claims before the
    /// window.
    async fn note_claim(&mut self, now: Millis, queue: &str) -> Result<(), Error>;
}

/// Applies one operation inside the backend's transaction. See the module doc.
pub async fn run<R: Rows>(rows: &mut R, cfg: &LedgerConfig, op: Op) -> Result<Answer, Error> {
    match op {
        Op::AddTodo { now, endpoint, new } => add_todo(rows, now, &endpoint, new).await,
        Op::Claim {
            now,
            actor,
            id,
            opts,
        } => {
            let (todo, open) = load(rows, "claim", &id).await?;
            let gate = Gate::of(rows, now, Some(std::slice::from_ref(&todo.queue))).await?;
            claim(rows, cfg, now, &actor, todo, open, &opts, &gate)
                .await
                .map(Answer::Claimed)
        }
        Op::ClaimNext {
            now,
            actor,
            queues,
            opts,
        } => {
            transition::check_ttl("claim_next", opts.ttl)?;
            let queues = queues.as_deref().map(super::storable_queue_filter);
            // A paused queue answers `claim_next` empty, and so does one whose limits hold every
            // waiting todo back; nothing else about them changes.
            let paused = rows.paused_queues().await?;
            let gate = Gate::of(rows, now, queues.as_deref()).await?;
            let holds = flow::holds(&gate.limits, &gate.load, &paused);
            let query = ClaimQuery::new(now, &actor, queues.as_deref(), &holds);
            let next = match rows.next_claimable(&query).await? {
                Some((todo, open)) => {
                    Some(claim(rows, cfg, now, &actor, todo, open, &opts, &gate).await?)
                }
                None => None,
            };
            Ok(Answer::Next(next))
        }
        Op::Heartbeat {
            now,
            actor,
            id,
            ttl,
            token_hash,
            usage,
        } => transit(rows, "heartbeat", &id, |t, open| {
            transition::heartbeat(now, t, open, &actor, (ttl, token_hash), usage)
        })
        .await
        .map(Answer::Todo),
        Op::Complete {
            now,
            actor,
            id,
            report,
        } => closed_by(rows, cfg, now, &actor, &id, &report, Outcome::Completed).await,
        Op::Fail {
            now,
            actor,
            id,
            report,
        } => closed_by(rows, cfg, now, &actor, &id, &report, Outcome::Failed).await,
        Op::Release {
            now,
            actor,
            id,
            summary,
            token_hash,
            usage,
        } => {
            let by = Reporter::new(&actor, token_hash, Outcome::Released);
            reported(rows, cfg, "release", &id, by, None, |t, open, _| {
                transition::release(
                    now,
                    t,
                    open,
                    &actor,
                    summary.as_deref(),
                    (token_hash, usage),
                )
            })
            .await
        }
        Op::RequestInput {
            now,
            actor,
            id,
            question,
            report,
        } => {
            let by = Reporter::new(&actor, report.token_hash, Outcome::NeedsInput);
            reported(rows, cfg, "request_input", &id, by, None, |t, open, _| {
                transition::request_input(cfg, now, t, open, &actor, &question, &report)
            })
            .await
        }
        Op::AnswerTodo {
            now,
            actor,
            id,
            answer,
            key,
            seq,
        } => {
            let op = "answer_todo";
            let (todo, _) = load(rows, op, &id).await?;
            let recent = rows
                .attempts(op, &id, Newest::closed(PRIOR_ATTEMPTS))
                .await?;
            let (text, key) = (answer.as_str(), key.as_deref());
            match transition::answer(now, &todo, &recent, &actor, text, key, seq)? {
                Some(change) => write(rows, op, &todo, change).await.map(Answer::Todo),
                None => Ok(Answer::Todo(todo)),
            }
        }
        Op::NoteLate {
            now,
            actor,
            id,
            outcome,
            summary,
            token_hash,
        } => {
            let by = Reporter::new(&actor, token_hash, outcome);
            late(rows, cfg, now, &id, by, summary.as_deref()).await
        }
        Op::Retry { now, actor, id } => {
            let (todo, _) = load(rows, "retry", &id).await?;
            let newest = rows.attempts("retry", &id, Newest::all(1)).await?;
            let change = transition::retry(now, &todo, newest.first(), &actor)?;
            write(rows, "retry", &todo, change).await.map(Answer::Todo)
        }
        Op::Cancel { now, actor, id } => transit(rows, "cancel", &id, |t, open| {
            transition::cancel(now, t, open, &actor)
        })
        .await
        .map(Answer::Todo),
        Op::Reap { now } => sweep(rows, "reap", Sweep::Reap { now })
            .await
            .map(Answer::Todos),
        Op::RequeueDue { now } => sweep(rows, "requeue_due", Sweep::RequeueDue { now })
            .await
            .map(Answer::Todos),
        Op::RevokeEndpoint { now, endpoint } => {
            let which = Sweep::Revoke {
                now,
                endpoint: &endpoint,
            };
            sweep(rows, "revoke", which).await.map(Answer::Todos)
        }
        Op::GetTodo {
            actor,
            id,
            attempts_limit,
        } => {
            let todo = load_scoped(rows, "get_todo", &actor, &id).await?;
            let attempts = rows
                .attempts("get_todo", &id, Newest::all(attempts_limit))
                .await?;
            Ok(Answer::View(TodoView {
                attempts_total: todo.attempts_total,
                attempts_pruned: todo.attempts_pruned,
                todo,
                attempts,
            }))
        }
        Op::ListTodos { actor, filter } => {
            let filter = TodoFilter {
                queues: filter.queues.as_deref().map(super::storable_queue_filter),
                ..filter
            };
            rows.list(&actor, &filter).await.map(Answer::Todos)
        }
        Op::DeleteTodo { actor, id } => {
            load_scoped(rows, "delete", &actor, &id).await?;
            rows.delete("delete", &id).await.map(|()| Answer::Deleted)
        }
        Op::PurgeFinished { now, retention } => {
            purge_finished(rows, now, retention).await.map(Answer::Ids)
        }
        Op::PauseQueue {
            now,
            actor,
            queue,
            paused,
        } => {
            transition::pause(&actor, &queue, paused)?;
            rows.set_paused(now, &queue, paused).await?;
            rows.paused_queues().await.map(Answer::Queues)
        }
        Op::PausedQueues => rows.paused_queues().await.map(Answer::Queues),
        Op::SetQueueLimits {
            now,
            actor,
            queue,
            change,
        } => {
            let limits = rows.queue_limits().await?;
            let before = limits
                .iter()
                .find(|(q, _)| q == &queue)
                .map(|(_, l)| *l)
                .unwrap_or_default();
            let after = transition::set_limits(&actor, &queue, before, &change)?;
            rows.set_queue_limits(now, &queue, after).await?;
            queue_flow(rows, now).await.map(Answer::Flow)
        }
        Op::QueueFlow { now } => queue_flow(rows, now).await.map(Answer::Flow),
    }
}

async fn queue_flow<R: Rows>(rows: &mut R, now: Millis) -> Result<QueueFlow, Error> {
    Ok(QueueFlow {
        limits: rows.queue_limits().await?,
        load: rows.flow_load(now, false).await?,
        paused: rows.paused_queues().await?,
    })
}

/// A claim's view of flow control: the limits of the queues it may take from, and what they
/// hold (read under the flow lock when there is any).
#[derive(Default)]
struct Gate {
    limits: Vec<(String, Limits)>,
    load: Load,
}

impl Gate {
    /// The gate of a claim in `scope` (`None`: every queue).
    async fn of<R: Rows>(
        rows: &mut R,
        now: Millis,
        scope: Option<&[String]>,
    ) -> Result<Gate, Error> {
        let mut limits = rows.queue_limits().await?;
        limits.retain(|(q, _)| scope.is_none_or(|s| s.contains(q)));
        if limits.is_empty() {
            return Ok(Gate::default());
        }
        let load = rows.flow_load(now, true).await?;
        Ok(Gate { limits, load })
    }

    fn limits_of(&self, queue: &str) -> Option<&Limits> {
        self.limits.iter().find(|(q, _)| q == queue).map(|(_, l)| l)
    }
}

/// Writes a transition's change. Updates close exactly once: an `Update` that finds no open row
/// is an internal error, and the caller's transaction rolls back.
pub(super) async fn write<R: Rows>(
    rows: &mut R,
    op: &str,
    before: &Todo,
    change: Change,
) -> Result<Todo, Error> {
    let t = &change.todo;
    // A store writes only what transitions change; a transition that changed anything else
    // would be silently lost, so refuse it loudly instead.
    let same = fixed(t) == fixed(before);
    if !same {
        return Err(Error::internal(format!(
            "{op} {}: the transition changed a column the store does not write",
            t.id
        )));
    }
    let touched = rows.write(op, &change).await?;
    for (w, n) in change.writes.iter().zip(touched) {
        match w {
            AttemptWrite::Update(a) if n != 1 => {
                return Err(Error::internal(format!(
                    "{op} {}: attempt {} is not open; an attempt closes exactly once",
                    t.id, a.seq
                )));
            }
            AttemptWrite::Amend(a) if n != 1 => {
                return Err(Error::internal(format!(
                    "{op} {}: attempt {} is not closed; only a closed attempt is amended",
                    t.id, a.seq
                )));
            }
            _ => {}
        }
    }
    Ok(change.todo)
}

async fn load<R: Rows>(rows: &mut R, op: &str, id: &str) -> Result<(Todo, Option<Attempt>), Error> {
    // A string that is no todo id names no todo, whatever a store would make of it.
    if !super::valid_todo_id(id) {
        return Err(transition::not_found(op, id));
    }
    rows.load(op, id)
        .await?
        .ok_or_else(|| transition::not_found(op, id))
}

/// The todo, when it is in the actor's scope; outside it, it does not exist.
async fn load_scoped<R: Rows>(
    rows: &mut R,
    op: &str,
    actor: &Actor,
    id: &str,
) -> Result<Todo, Error> {
    let (todo, _) = load(rows, op, id).await?;
    if actor.sees(&todo) {
        Ok(todo)
    } else {
        Err(transition::not_found(op, id))
    }
}

/// Reads the todo, runs the transition, writes its change.
async fn transit<R: Rows>(
    rows: &mut R,
    op: &str,
    id: &str,
    f: impl FnOnce(&Todo, Option<&Attempt>) -> Result<Change, Error>,
) -> Result<Todo, Error> {
    let (todo, open) = load(rows, op, id).await?;
    let change = f(&todo, open.as_ref())?;
    write(rows, op, &todo, change).await
}

/// A report: its transition, or, when that is refused as a conflict, the answer to a repeat of
/// a report already applied under the same lease token (see `transition::replay`; `result` is
/// the report's). A fail's transition also gets the todo's newest closed attempts its
/// repeated-failure rule looks at (`max_same_failures - 1` of them).
async fn reported<R: Rows>(
    rows: &mut R,
    cfg: &LedgerConfig,
    op: &str,
    id: &str,
    by: Reporter<'_>,
    result: Option<&serde_json::Value>,
    f: impl FnOnce(&Todo, Option<&Attempt>, &[Attempt]) -> Result<Change, Error>,
) -> Result<Answer, Error> {
    let (todo, open) = load(rows, op, id).await?;
    let history = match by.outcome {
        Outcome::Failed if todo.max_same_failures > 1 && open.is_some() => {
            let n = todo.max_same_failures as usize - 1;
            rows.attempts(op, id, Newest::closed(n)).await?
        }
        _ => Vec::new(),
    };
    let todo = match f(&todo, open.as_ref(), &history) {
        Ok(change) => write(rows, op, &todo, change).await?,
        Err(refused) => {
            let recent = rows
                .attempts(op, id, Newest::closed(PRIOR_ATTEMPTS))
                .await?;
            transition::replay(cfg, refused, &todo, &recent, by, result)?
        }
    };
    Ok(Answer::Todo(todo))
}

/// A `complete` (`outcome` completed) or a `fail` (failed): the report closes the attempt.
async fn closed_by<R: Rows>(
    rows: &mut R,
    cfg: &LedgerConfig,
    now: Millis,
    actor: &Actor,
    id: &str,
    report: &Report,
    outcome: Outcome,
) -> Result<Answer, Error> {
    let by = Reporter::new(actor, report.token_hash, outcome);
    let result = report.result.as_ref();
    if outcome == Outcome::Completed {
        reported(rows, cfg, "complete", id, by, result, |t, open, _| {
            transition::complete(cfg, now, t, open, actor, report)
        })
        .await
    } else {
        reported(rows, cfg, "fail", id, by, result, |t, open, recent| {
            transition::fail(cfg, now, t, open, actor, report, recent)
        })
        .await
    }
}

/// A report refused as stale, kept on the closed attempt `by`'s lease opened (see
/// `transition::note_late`); answers that attempt's seq, or `None` when it was not kept.
async fn late<R: Rows>(
    rows: &mut R,
    cfg: &LedgerConfig,
    now: Millis,
    id: &str,
    by: Reporter<'_>,
    summary: Option<&str>,
) -> Result<Answer, Error> {
    let op = "note_late";
    let (todo, _) = load(rows, op, id).await?;
    if !by.may_own(&todo) {
        // Nothing to keep it on: no attempt read.
        return Ok(Answer::Late(None));
    }
    let retained = cfg.attempts_cap.max(1) as usize;
    let closed = rows.attempts(op, id, Newest::closed(retained)).await?;
    let Some(change) = transition::note_late(now, &todo, &closed, by, summary) else {
        return Ok(Answer::Late(None));
    };
    let seq = change.writes.first().and_then(|w| match w {
        AttemptWrite::Amend(a) => Some(a.seq),
        _ => None,
    });
    write(rows, op, &todo, change).await?;
    Ok(Answer::Late(seq))
}

/// What no transition changes: the todo's identity and what its add set (a store writes only
/// the columns transitions change).
fn fixed(t: &Todo) -> impl PartialEq + '_ {
    (
        (&t.id, &t.endpoint, &t.queue, &t.title, &t.kind, &t.source),
        (
            &t.payload,
            &t.work_order,
            &t.assignee,
            &t.idempotency_key,
            &t.task_id,
        ),
        (
            &t.concurrency_key,
            t.priority,
            t.max_attempts,
            t.max_same_failures,
        ),
        (t.asking.max_requests, t.asking.answer_within, t.created_at),
    )
}

/// Adds a todo, or answers the one an earlier add with the same idempotency key made. The key is
/// looked up first (a repeat reads, it does not write), and again when the insert is refused:
/// a concurrent add with the key committed first, and the unique index let only one through.
async fn add_todo<R: Rows>(
    rows: &mut R,
    now: Millis,
    endpoint: &str,
    new: NewTodo,
) -> Result<Answer, Error> {
    if let Some(k) = &new.idempotency_key {
        super::check_idempotency_key(k)?;
        if let Some(t) = rows.by_key(endpoint, k).await? {
            return Ok(Answer::Existing(t));
        }
    }
    let todo = super::new_todo(now, endpoint, new)?;
    if rows.insert_todo(&todo).await? {
        return Ok(Answer::Todo(todo));
    }
    if let Some(k) = &todo.idempotency_key
        && let Some(t) = rows.by_key(endpoint, k).await?
    {
        return Ok(Answer::Existing(t));
    }
    Err(Error::conflict(format!(
        "add_todo {}: a todo with this id exists; choose another id",
        todo.id
    )))
}

/// Claims a loaded todo and assembles the answer: a claim of a claimed todo is a takeover, and
/// the answer carries the newest closed attempts. A todo its queue's limits in `gate` hold back
/// answers the `conflict` of any todo that cannot be claimed now, saying which limit.
#[allow(clippy::too_many_arguments)]
async fn claim<R: Rows>(
    rows: &mut R,
    cfg: &LedgerConfig,
    now: Millis,
    actor: &Actor,
    todo: Todo,
    open: Option<Attempt>,
    opts: &ClaimOpts,
    gate: &Gate,
) -> Result<Claimed, Error> {
    let op = "claim";
    let takeover = todo.state == TodoState::Claimed;
    let change = transition::claim(cfg, now, &todo, open.as_ref(), actor, opts)?;
    let limits = gate.limits_of(&todo.queue);
    if let Some(h) = limits.and_then(|l| flow::held(l, &gate.load, &todo)) {
        return Err(Error::conflict(format!(
            "{op} {}: todo is {} and cannot be claimed now ({h})",
            todo.id, todo.state
        )));
    }
    let todo = write(rows, op, &todo, change).await?;
    if limits.is_some_and(|l| l.claims_per_minute.is_some()) {
        rows.note_claim(now, &todo.queue).await?;
    }
    // The kept attempts are seqs pruned+1 ..= total and only the newest is open (check_todo), so
    // when the new attempt is the only one kept there is no closed one to read.
    let prior_attempts = if todo.attempts_total > todo.attempts_pruned + 1 {
        rows.attempts(op, &todo.id, Newest::closed(PRIOR_ATTEMPTS))
            .await?
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

/// Applies the sweep's [`Sweep::change`] to every candidate; rows it yields `None` for are skipped.
async fn sweep<R: Rows>(rows: &mut R, op: &str, which: Sweep<'_>) -> Result<Vec<Todo>, Error> {
    let mut changed = Vec::new();
    for id in rows.candidates(which).await? {
        // A candidate deleted meanwhile is simply gone.
        let Some((todo, open)) = rows.load(op, &id).await? else {
            continue;
        };
        if let Some(change) = which.change(&todo, open.as_ref())? {
            changed.push(write(rows, op, &todo, change).await?);
        }
    }
    Ok(changed)
}

async fn purge_finished<R: Rows>(
    rows: &mut R,
    now: Millis,
    retention: Millis,
) -> Result<Vec<String>, Error> {
    let op = "purge_finished";
    // Nothing can be older than the epoch: a retention longer than `now` purges nothing.
    let Some(cutoff) = now.checked_sub(retention) else {
        return Ok(Vec::new());
    };
    let mut purged = Vec::new();
    for id in rows.candidates(Sweep::Purge { cutoff }).await? {
        let Some((todo, _)) = rows.load(op, &id).await? else {
            continue;
        };
        if super::purgeable(&todo, now, retention) {
            rows.delete(op, &id).await?;
            purged.push(id);
        }
    }
    Ok(purged)
}

/// Drives a future that never waits to its end: [`run`] over rows whose methods complete at
/// once (the in-memory ledger's, SQLite's on its blocking thread).
///
/// # Panics
/// When the future does wait: such rows belong on an executor.
#[inline(always)]
pub fn ready<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("ledger::ready: the rows waited; run them on an executor"),
    }
}
