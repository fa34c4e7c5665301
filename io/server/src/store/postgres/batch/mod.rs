//! The Postgres store's writers: the operations waiting for one share one transaction, with
//! their reads and writes as few round trips.
//!
//! A write operation (the ledger's hot ones, see [`batched`]) goes to a queue that
//! [`Tuning::writers`] tasks take from, each with a connection of its own. A writer takes every
//! operation waiting (at most [`Tuning::batch_max`]) and runs them in one transaction, in the
//! order they arrived, each through [`ledger::run`] over a [`Batch`]: the rules stay the core's,
//! SQL only reads and writes rows. The callers are answered only after `COMMIT` returned.
//!
//! Round trips. The first one sends `BEGIN`, the change lock, the database's clock, the paused
//! queues, and every todo the batch names by id with its open attempt, locked (`FOR UPDATE`, in
//! id order). The first `claim_next` of a scope takes as many rows as the batch has claims left
//! (`FOR UPDATE SKIP LOCKED LIMIT K`) and their open attempts (two more). The rows read are kept
//! for the rest of the transaction (they are locked, so only this transaction changes them),
//! and the writes of every operation are held and sent together, pipelined, with the next read
//! that needs them or before `COMMIT`. A batch of heartbeats and completes is three round trips
//! and a commit, whatever its size.
//!
//! As if one transaction each. The operations of a batch are concurrent (none was answered), so
//! any order is one their callers could have seen; each sees the writes of those before it,
//! because every read goes through the rows kept. An operation that fails is undone alone: its
//! held writes are dropped and its rows restored, and where it had already sent writes (an add,
//! a late report, a read after its own writes), a `SAVEPOINT` taken before them is rolled back
//! (and the rows it locked since are forgotten, since that releases their locks). A failure of
//! the database itself (an error from a statement, a row count other than the rows kept
//! predicted, a refused `COMMIT`, a deadlock with another process) rolls the whole transaction
//! back and runs each operation again in a transaction of its own, exactly as without a batch,
//! so that each answers its own error. Only a `COMMIT` whose outcome is unknown (the connection
//! broke during it) answers its error to every operation of the batch, as one operation alone
//! would.

mod rows;
pub(crate) mod stmt;
mod tx;

use std::future::Future;
use std::sync::Arc;

use deadpool_postgres::ClientWrapper;
use relay_core::Error;
use relay_core::ledger::{self, Answer, Op};
use tokio::sync::{Mutex, mpsc, oneshot};

use super::db::Db;
use super::encode::pg_err;
use stmt::Fail;
use tx::Batch;

/// The sizes of the Postgres store's writers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tuning {
    /// At most this many operations share one transaction (and Postgres keeps at most 64
    /// subtransactions a transaction in shared memory: a savepoint per operation stays below).
    pub batch_max: usize,
    /// Writer tasks, each with its own connection, taking batches from one queue.
    pub writers: usize,
}

impl Default for Tuning {
    /// 64 operations a batch, 2 writers (measured with the store bench, see docs/benchmarks.md: one
    /// batch fills while the other waits for its commit).
    fn default() -> Tuning {
        Tuning {
            batch_max: 64,
            writers: 2,
        }
    }
}

/// Whether an operation runs in a writer's batch: the ledger's operations on one todo, and
/// `claim_next`. Sweeps, deletes and pauses run alone, as every read does.
pub(crate) fn batched(op: &Op) -> bool {
    matches!(
        op,
        Op::AddTodo { .. }
            | Op::Claim { .. }
            | Op::ClaimNext { .. }
            | Op::Heartbeat { .. }
            | Op::Complete { .. }
            | Op::Fail { .. }
            | Op::Release { .. }
            | Op::RequestInput { .. }
            | Op::AnswerTodo { .. }
            | Op::NoteLate { .. }
            | Op::Retry { .. }
            | Op::Cancel { .. }
    )
}

type Reply = oneshot::Sender<Result<Answer, Error>>;

#[allow(
    clippy::large_enum_variant,
    reason = "the other variant exists in tests only"
)]
enum Work {
    Op(Op, Reply),
    /// Tests: the writer that takes it waits until told, so what is queued meanwhile is one
    /// batch.
    #[cfg(test)]
    Hold(oneshot::Receiver<()>),
}

/// Where a store's batched operations go.
pub(crate) struct Writers {
    tx: mpsc::UnboundedSender<Work>,
}

impl std::fmt::Debug for Writers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Writers")
    }
}

fn stopped(op: &str) -> Error {
    Error::internal(format!("{op}: the Postgres store's writers have stopped"))
}

impl Writers {
    /// Starts the writer tasks on the current runtime. `store` is the layer below the writers,
    /// with none of its own (the tasks end when the last handle of the store that owns these is
    /// dropped).
    pub(crate) fn start(store: &Db, tuning: Tuning) -> Writers {
        let (tx, rx) = mpsc::unbounded_channel();
        let rx = Arc::new(Mutex::new(rx));
        for _ in 0..tuning.writers.max(1) {
            let (store, rx) = (store.clone(), rx.clone());
            tokio::spawn(writer_loop(store, rx, tuning.batch_max.max(1)));
        }
        Writers { tx }
    }

    /// Queues `op` at once (before the future is first polled) and answers after its commit.
    pub(crate) fn apply(&self, op: Op) -> impl Future<Output = Result<Answer, Error>> + use<> {
        let name = op.name();
        let (reply, answer) = oneshot::channel();
        let sent = self.tx.send(Work::Op(op, reply)).is_ok();
        async move {
            if !sent {
                return Err(stopped(name));
            }
            answer.await.map_err(|_| stopped(name))?
        }
    }

    /// Tests: holds one writer until `release` is sent (or dropped).
    #[cfg(test)]
    pub(crate) fn hold(&self, release: oneshot::Receiver<()>) {
        let _ = self.tx.send(Work::Hold(release));
    }
}

async fn writer_loop(store: Db, rx: Arc<Mutex<mpsc::UnboundedReceiver<Work>>>, batch_max: usize) {
    let mut conn: Option<ClientWrapper> = None;
    loop {
        let mut jobs: Vec<(Op, Reply)> = Vec::new();
        {
            // One writer takes at a time; the others wait here, or on their commits.
            let mut rx = rx.lock().await;
            let Some(first) = rx.recv().await else {
                return; // every store handle is gone
            };
            let mut next = Some(first);
            while let Some(w) = next.take() {
                match w {
                    Work::Op(op, reply) => jobs.push((op, reply)),
                    #[cfg(test)]
                    Work::Hold(release) => {
                        let _ = release.await;
                    }
                }
                if jobs.len() < batch_max {
                    next = rx.try_recv().ok();
                }
            }
        }
        if !jobs.is_empty() {
            run_jobs(&store, &mut conn, jobs).await;
        }
    }
}

/// The planner settings of a writer's connection (its own: it never returns to the pool).
/// Every statement of a batch reads or writes rows by key (an id, a todo's open attempt, the
/// FIFO of an endpoint), and each has an index for it; but a table whose statistics are older
/// than its rows (a new store, a burst into an empty queue: autovacuum analyzes a minute later
/// at best) looks empty to the planner, which then scans it whole, at every batch, for as long
/// as the statistics lag. So sequential scans are ruled out, and each statement keeps the one
/// generic plan it was prepared with, instead of being planned again at each execution.
const WRITER_PLANS: &str = "SET enable_seqscan = off; SET plan_cache_mode = force_generic_plan";

/// A writer's connection: taken out of the pool (a connection left inside a transaction, by a
/// writer dropped in the middle of a batch, must never go back to it), with [`WRITER_PLANS`].
pub(crate) async fn writer_connection(store: &Db) -> Result<ClientWrapper, Error> {
    let c = deadpool_postgres::Object::take(store.client("batch").await?);
    c.batch_execute(WRITER_PLANS)
        .await
        .map_err(|e| pg_err("batch", "", &e))?;
    Ok(c)
}

/// What became of a batch's transaction.
enum Done {
    Committed(Vec<Result<Answer, Error>>),
    /// Rolled back: nothing of it was applied.
    RolledBack,
    /// The COMMIT's outcome is unknown.
    Unknown(Error),
}

async fn run_jobs(store: &Db, conn: &mut Option<ClientWrapper>, jobs: Vec<(Op, Reply)>) {
    if conn.as_ref().is_none_or(|c| c.is_closed()) {
        *conn = match writer_connection(store).await {
            Ok(c) => Some(c),
            Err(e) => {
                for (_, reply) in jobs {
                    let _ = reply.send(Err(e.clone()));
                }
                return;
            }
        };
    }
    let Some(c) = conn.as_ref() else { return };
    let ops: Vec<Op> = jobs.iter().map(|(op, _)| op.clone()).collect();
    match batch(c, store, ops).await {
        Done::Committed(answers) => {
            for ((_, reply), a) in jobs.into_iter().zip(answers) {
                let _ = reply.send(a);
            }
        }
        Done::Unknown(e) => {
            *conn = None;
            for (_, reply) in jobs {
                let _ = reply.send(Err(e.clone()));
            }
        }
        Done::RolledBack => {
            if c.is_closed() {
                *conn = None;
            }
            for (op, reply) in jobs {
                let _ = reply.send(store.apply_alone(op).await);
            }
        }
    }
}

async fn batch(c: &ClientWrapper, store: &Db, ops: Vec<Op>) -> Done {
    let mut b = Batch::new(c);
    let Ok(answers) = run_ops(&mut b, store, ops).await else {
        // A connection that cannot roll back is closed, and the caller drops it.
        let _ = c.batch_execute("ROLLBACK").await;
        return Done::RolledBack;
    };
    match b.commit().await {
        Ok(()) => Done::Committed(answers),
        // The server refused a write or the COMMIT (a deferred constraint, a serialization
        // failure): the transaction is rolled back. (Outside one, this ROLLBACK only warns.)
        Err(Fail::Db(_)) => {
            let _ = c.batch_execute("ROLLBACK").await;
            Done::RolledBack
        }
        Err(Fail::Other(e)) => Done::Unknown(e),
    }
}

/// Runs the operations in order; `Err` when the transaction is lost.
async fn run_ops(
    b: &mut Batch<'_>,
    store: &Db,
    mut ops: Vec<Op>,
) -> Result<Vec<Result<Answer, Error>>, ()> {
    if let Some(now) = b.begin(&ops, store.db_clock()).await.map_err(drop)? {
        for op in &mut ops {
            if let Some(t) = op.now_mut() {
                *t = now;
            }
        }
    }
    let mut claims_left = ops
        .iter()
        .filter(|op| matches!(op, Op::ClaimNext { .. }))
        .count();
    let mut answers = Vec::with_capacity(ops.len());
    for op in ops {
        let claim = matches!(op, Op::ClaimNext { .. });
        b.start_op(claims_left);
        let r = ledger::run(b, store.config(), op).await;
        if b.broken {
            return Err(());
        }
        b.end_op(r.is_ok());
        answers.push(r);
        claims_left -= usize::from(claim);
    }
    Ok(answers)
}
