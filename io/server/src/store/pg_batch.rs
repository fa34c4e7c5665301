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

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use deadpool_postgres::ClientWrapper;
use relay_core::Error;
use relay_core::Millis;
use relay_core::ledger::{
    self, Actor, Answer, Attempt, AttemptWrite, Newest, Op, Rows, Sweep, Todo, TodoFilter,
    TodoState, transition,
};
use tokio::sync::{Mutex, mpsc, oneshot};
use tokio_postgres::Statement;
use tokio_postgres::types::ToSql;

use super::postgres::{
    CHANGE_LOCK_SHARED, CLAIM_LOCK, CLAIM_PLAN, PgStore, SQL, db_now, pg_err, pg_vals,
};
use super::rows::{self, Val};

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
            | Op::NoteLate { .. }
            | Op::Retry { .. }
            | Op::Cancel { .. }
    )
}

/// The todo an operation names by id.
fn named(op: &Op) -> Option<&str> {
    match op {
        Op::Claim { id, .. }
        | Op::Heartbeat { id, .. }
        | Op::Complete { id, .. }
        | Op::Fail { id, .. }
        | Op::Release { id, .. }
        | Op::NoteLate { id, .. }
        | Op::Retry { id, .. }
        | Op::Cancel { id, .. } => Some(id),
        _ => None,
    }
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
    /// Starts the writer tasks on the current runtime. `store` has no writers of its own (the
    /// tasks end when the last handle of the store that owns these is dropped).
    pub(crate) fn start(store: &PgStore, tuning: Tuning) -> Writers {
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

async fn writer_loop(
    store: PgStore,
    rx: Arc<Mutex<mpsc::UnboundedReceiver<Work>>>,
    batch_max: usize,
) {
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

/// What became of a batch's transaction.
enum Done {
    Committed(Vec<Result<Answer, Error>>),
    /// Rolled back: nothing of it was applied.
    RolledBack,
    /// The COMMIT's outcome is unknown.
    Unknown(Error),
}

async fn run_jobs(store: &PgStore, conn: &mut Option<ClientWrapper>, jobs: Vec<(Op, Reply)>) {
    if conn.as_ref().is_none_or(|c| c.is_closed()) {
        // Taken out of the pool: a connection left inside a transaction (a writer dropped in the
        // middle of a batch) must never go back to it.
        *conn = match store.client("batch").await {
            Ok(c) => Some(deadpool_postgres::Object::take(c)),
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

async fn batch(c: &ClientWrapper, store: &PgStore, ops: Vec<Op>) -> Done {
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
    store: &PgStore,
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

/// A todo row as the batch knows it: locked by this transaction, so only it changes it.
#[derive(Clone, Debug)]
enum Entry {
    Absent,
    /// The todo and its open attempts (one at most, unless the table is broken).
    Row(Box<Todo>, Vec<Attempt>),
}

/// A write held until the next round trip, with the rows it must touch.
enum Held {
    Todo(Todo),
    Open(Attempt),
    Update(Attempt),
    Prune(String, u32),
}

/// What a `claim_next` scope has read: the rows after `last` (by created_at, id) that are
/// claimable and no other transaction holds are not read yet, unless `exhausted`.
struct Group {
    key: (String, Vec<Val>),
    last: Option<(Millis, String)>,
    exhausted: bool,
}

/// One statement of a round trip.
struct Stmt {
    st: Statement,
    args: Vec<Box<dyn ToSql + Sync + Send>>,
}

enum Out {
    Count(u64),
    Rows(Vec<tokio_postgres::Row>),
}

/// Why a round trip failed: the server refused a statement (the transaction is then rolled
/// back, or must be), or something else did (the connection: a COMMIT's outcome is unknown).
enum Fail {
    Db(Error),
    Other(Error),
}

impl From<tokio_postgres::Error> for Fail {
    fn from(e: tokio_postgres::Error) -> Fail {
        let err = pg_err("batch", "", &e);
        if e.as_db_error().is_some() {
            Fail::Db(err)
        } else {
            Fail::Other(err)
        }
    }
}

impl Fail {
    fn into_error(self) -> Error {
        match self {
            Fail::Db(e) | Fail::Other(e) => e,
        }
    }
}

type Fut<'a> = Pin<Box<dyn Future<Output = Result<Out, Fail>> + Send + 'a>>;

/// The held writes that must touch exactly one row, each answering one row itself or, when it
/// touched another number, failing (a text that is no integer), so that the database refuses
/// the batch before its COMMIT: the todo update, the attempt insert, the open attempt's update.
static CHECKED: std::sync::LazyLock<(String, String, String)> = std::sync::LazyLock::new(|| {
    let one = |sql: &str| {
        format!(
            "WITH w AS ({sql} RETURNING 1) SELECT CASE WHEN count(*) = 1 THEN 0 \
             ELSE ('a batched write touched ' || count(*) || ' rows, not 1')::int END FROM w"
        )
    };
    (
        one(&SQL.update_todo),
        one(&SQL.insert_attempt),
        one(&SQL.update_open_attempt),
    )
});

/// The transaction of one batch, as the ledger's [`Rows`].
struct Batch<'c> {
    c: &'c ClientWrapper,
    paused: Vec<String>,
    rows: HashMap<String, Entry>,
    groups: Vec<Group>,
    held: Vec<Held>,
    /// Where the current operation's held writes start.
    mark: usize,
    /// The current operation has sent writes after `SAVEPOINT op`.
    savepoint: bool,
    /// Rows first read inside the current operation's savepoint (its rollback unlocks them).
    read_in_savepoint: Vec<String>,
    /// Savepoint commands to send before the next statement.
    cmds: Vec<&'static str>,
    /// The rows the current operation changed, as they were before.
    undo: Vec<(String, Option<Entry>)>,
    claims_left: usize,
    /// A statement failed: the transaction is lost.
    broken: bool,
}

const SAVEPOINT: &str = "SAVEPOINT op";
const RELEASE: &str = "RELEASE SAVEPOINT op";
const ROLLBACK_TO: &str = "ROLLBACK TO SAVEPOINT op";
const PAUSED: &str = "SELECT queue FROM paused_queues ORDER BY queue";

impl<'c> Batch<'c> {
    fn new(c: &'c ClientWrapper) -> Batch<'c> {
        Batch {
            c,
            paused: Vec::new(),
            rows: HashMap::new(),
            groups: Vec::new(),
            held: Vec::new(),
            mark: 0,
            savepoint: false,
            read_in_savepoint: Vec::new(),
            cmds: Vec::new(),
            undo: Vec::new(),
            claims_left: 0,
            broken: false,
        }
    }

    async fn prepare(&mut self, op: &str, sql: &str) -> Result<Statement, Error> {
        let r = self.c.prepare_cached(sql).await;
        r.map_err(|e| {
            self.broken = true;
            pg_err(op, "(a batch)", &e)
        })
    }

    /// The first round trip: `BEGIN`, the change lock (before any row lock, see
    /// `PgStore::pending_since`), the database's clock when it decides, the paused queues, and
    /// the todos the operations name, locked, with their open attempts.
    async fn begin(&mut self, ops: &[Op], db_clock: bool) -> Result<Option<Millis>, Error> {
        let r = self.begin_inner(ops, db_clock).await;
        if r.is_err() {
            self.broken = true;
        }
        r
    }

    async fn begin_inner(&mut self, ops: &[Op], db_clock: bool) -> Result<Option<Millis>, Error> {
        let mut ids: Vec<String> = ops.iter().filter_map(named).map(String::from).collect();
        ids.sort_unstable();
        ids.dedup();
        let (paused, load, open) = self.statements().await?;
        // Each claim_next scope's rows, read in this round trip too: as many as the batch has
        // claims in that scope, at the earliest of their callers' `now` (each row is judged
        // again at its operation's own `now`), assuming no queue is paused (when one is, these
        // reads match no claim, and the claims read their own).
        let mut scopes: Vec<(Group, Millis, usize)> = Vec::new();
        for op in ops {
            if let Op::ClaimNext {
                now, actor, queues, ..
            } = op
            {
                let queues = queues.as_deref().map(ledger::storable_queue_filter);
                let key = claim_key(*now, actor, queues.as_deref(), &[])?;
                match scopes.iter_mut().find(|(g, ..)| g.key == key) {
                    Some((_, at, n)) => {
                        *at = (*at).min(*now);
                        *n += 1;
                    }
                    None => scopes.push((
                        Group {
                            key,
                            last: None,
                            exhausted: false,
                        },
                        *now,
                        1,
                    )),
                }
            }
        }
        let c = self.c;
        // A claim_next scope's read judges leases at the batch's `now`: under the database's
        // clock that is the clock itself, so it is read first (one more round trip, only for a
        // batch that claims); otherwise it rides in the pipeline below.
        let clock_first = match db_clock && !scopes.is_empty() {
            true => Some(db_now(&**c).await?),
            false => None,
        };
        if let Some(t) = clock_first {
            for (_, at, _) in &mut scopes {
                *at = t;
            }
        }
        let mut claims = Vec::with_capacity(scopes.len());
        for (g, at, n) in &scopes {
            let mut vals = g.key.1.clone();
            vals.insert(0, Val::Big(Some(rows::ms("claim_next", *at)?)));
            let sql = limited(&g.key.0, *n);
            claims.push(self.stmt("claim_next", &sql, vals).await?);
        }
        let begin = begin_sql(!claims.is_empty());
        let none: &[&(dyn ToSql + Sync)] = &[];
        let mut futs: Vec<Fut<'_>> = vec![
            Box::pin(async {
                c.batch_execute(&begin)
                    .await
                    .map(|()| Out::Count(0))
                    .map_err(Fail::from)
            }),
            Box::pin(async move {
                match clock_first {
                    Some(t) => Ok(Out::Count(t)),
                    None if db_clock => db_now(&**c).await.map(Out::Count).map_err(Fail::Other),
                    None => Ok(Out::Count(0)),
                }
            }),
            Box::pin(async {
                c.query(&paused, none)
                    .await
                    .map(Out::Rows)
                    .map_err(Fail::from)
            }),
        ];
        if !ids.is_empty() {
            let ids = &ids;
            let (load, open) = (&load, &open);
            futs.push(Box::pin(async move {
                c.query(load, &[ids])
                    .await
                    .map(Out::Rows)
                    .map_err(Fail::from)
            }));
            futs.push(Box::pin(async move {
                c.query(open, &[ids])
                    .await
                    .map(Out::Rows)
                    .map_err(Fail::from)
            }));
        }
        futs.extend(claims.iter().map(|s| send(c, s)));
        let mut outs = in_order(futs).await.map_err(Fail::into_error)?;
        let claimed = outs.split_off(outs.len() - claims.len());
        let now = match outs[1] {
            Out::Count(t) => db_clock.then_some(t),
            Out::Rows(_) => None,
        };
        if let Out::Rows(rs) = &outs[2] {
            self.paused = rs.iter().map(|r| r.get::<_, String>(0)).collect();
        }
        if !ids.is_empty()
            && let (Some(Out::Rows(opens)), Some(Out::Rows(todos))) = (outs.pop(), outs.pop())
        {
            self.keep(&ids, &todos, &opens, true)?;
        }
        for ((mut g, _, n), out) in scopes.into_iter().zip(claimed) {
            if let Out::Rows(rs) = out {
                let (last, len) = self.keep_claimable(&rs).await?;
                g.last = last;
                g.exhausted = len < n;
                self.groups.push(g);
            }
        }
        Ok(now)
    }

    /// Keeps the rows a claim_next read returned (those not kept yet), and answers the last
    /// one's place and how many there were. Their open attempts are read after the lock (see
    /// `PgTx::load`), but only for claimed rows (a takeover): any other has none, and were one
    /// there after all, the deferred one-open-attempt constraint refuses the batch's COMMIT and
    /// its operations run again alone, where the attempt is read.
    async fn keep_claimable(
        &mut self,
        found: &[tokio_postgres::Row],
    ) -> Result<(Option<(Millis, String)>, usize), Error> {
        let mut last = None;
        let mut takeovers = Vec::new();
        for r in found {
            let t = rows::todo(r, 0)?;
            last = Some((t.created_at, t.id.clone()));
            if self.rows.contains_key(&t.id) {
                continue;
            }
            if t.state == TodoState::Claimed {
                takeovers.push(t.id);
            } else {
                if self.savepoint {
                    self.read_in_savepoint.push(t.id.clone());
                }
                self.rows
                    .insert(t.id.clone(), Entry::Row(Box::new(t), Vec::new()));
            }
        }
        self.fetch(takeovers, false).await?;
        Ok((last, found.len()))
    }

    async fn statements(&mut self) -> Result<(Statement, Statement, Statement), Error> {
        Ok((
            self.prepare("batch", PAUSED).await?,
            self.prepare("batch", &LOAD_MANY).await?,
            self.prepare("batch", &OPEN_MANY).await?,
        ))
    }

    /// Keeps the rows read of `ids` (those not kept yet; `absent`: an id without a row is
    /// kept as absent).
    fn keep(
        &mut self,
        ids: &[String],
        todos: &[tokio_postgres::Row],
        opens: &[tokio_postgres::Row],
        absent: bool,
    ) -> Result<(), Error> {
        let mut found: HashMap<String, Entry> = HashMap::new();
        for r in todos {
            let t = rows::todo(r, 0)?;
            found.insert(t.id.clone(), Entry::Row(Box::new(t), Vec::new()));
        }
        for r in opens {
            if let Some(a) = rows::attempt(r, 0)?
                && let Some(Entry::Row(_, open)) = found.get_mut(&a.todo_id)
            {
                open.push(a);
            }
        }
        for id in ids {
            if self.rows.contains_key(id) {
                continue;
            }
            let e = match found.remove(id) {
                Some(e) => e,
                None if absent => Entry::Absent,
                None => continue,
            };
            if self.savepoint {
                self.read_in_savepoint.push(id.clone());
            }
            self.rows.insert(id.clone(), e);
        }
        Ok(())
    }

    fn start_op(&mut self, claims_left: usize) {
        self.mark = self.held.len();
        self.savepoint = false;
        self.read_in_savepoint.clear();
        self.undo.clear();
        self.claims_left = claims_left;
    }

    fn end_op(&mut self, ok: bool) {
        if !ok {
            self.held.truncate(self.mark);
            while let Some((id, before)) = self.undo.pop() {
                match before {
                    Some(e) => self.rows.insert(id, e),
                    None => self.rows.remove(&id),
                };
            }
            if self.savepoint {
                self.cmds.push(ROLLBACK_TO);
                // The rollback releases the locks taken since: those rows are no longer ours,
                // and what a claim scope read may be among them.
                for id in self.read_in_savepoint.drain(..) {
                    self.rows.remove(&id);
                }
                self.groups.clear();
            }
        }
        if self.savepoint {
            self.cmds.push(RELEASE);
        }
        self.savepoint = false;
        self.mark = self.held.len();
    }

    /// One round trip: the savepoint commands, every held write (the current operation's after
    /// its savepoint, which is opened when it has any or when `direct` writes follow), then
    /// `stmts` (reads, or direct writes). Answers what each of `stmts` returned, in order.
    async fn pipeline(&mut self, stmts: Vec<Stmt>, direct: bool) -> Result<Vec<Out>, Error> {
        let r = self.pipeline_inner(stmts, direct, false).await;
        if r.is_err() {
            self.broken = true;
        }
        r.map_err(Fail::into_error)
    }

    async fn pipeline_inner(
        &mut self,
        stmts: Vec<Stmt>,
        direct: bool,
        commit: bool,
    ) -> Result<Vec<Out>, Fail> {
        let held: Vec<Held> = self.held.drain(..).collect();
        let mark = std::mem::replace(&mut self.mark, 0).min(held.len());
        let before = self.held_stmts(&held[..mark]).await.map_err(Fail::Other)?;
        let mine = self.held_stmts(&held[mark..]).await.map_err(Fail::Other)?;
        let cmds = std::mem::take(&mut self.cmds).join("; ");
        let savepoint = (direct || !mine.is_empty()) && !self.savepoint;
        if savepoint {
            self.savepoint = true;
        }
        let c = self.c;
        let simple = |sql: &'static str| -> Fut<'_> {
            Box::pin(async move {
                c.batch_execute(sql)
                    .await
                    .map(|()| Out::Count(0))
                    .map_err(Fail::from)
            })
        };
        // In the order they are sent: futures are polled, and so sent, in order.
        let mut futs: Vec<Fut<'_>> = Vec::new();
        if !cmds.is_empty() {
            let cmds = &cmds;
            futs.push(Box::pin(async move {
                c.batch_execute(cmds)
                    .await
                    .map(|()| Out::Count(0))
                    .map_err(Fail::from)
            }));
        }
        futs.extend(before.iter().map(|s| send(c, s)));
        if savepoint {
            futs.push(simple(SAVEPOINT));
        }
        futs.extend(mine.iter().map(|s| send(c, s)));
        futs.extend(stmts.iter().map(|s| send(c, s)));
        if commit {
            // After a refused statement the server answers this COMMIT with a rollback.
            futs.push(simple("COMMIT"));
        }
        let mut outs = in_order(futs).await?;
        if commit {
            outs.pop();
        }
        Ok(outs.split_off(outs.len() - stmts.len()))
    }

    /// The last round trip: the held writes and `COMMIT`.
    async fn commit(&mut self) -> Result<(), Fail> {
        self.pipeline_inner(Vec::new(), false, true).await.map(drop)
    }

    /// The statements of held writes, in an order with their effect: attempts inserted, open
    /// attempts rewritten, closed ones pruned, todos rewritten. Writes of one row are folded
    /// into its last (an attempt inserted and then rewritten is inserted as rewritten), and
    /// each kind of write to more than one row is one statement over arrays (`unnest`).
    async fn held_stmts(&mut self, held: &[Held]) -> Result<Vec<Stmt>, Error> {
        let op = "batch";
        let mut opens: Vec<Attempt> = Vec::new();
        let mut updates: Vec<Attempt> = Vec::new();
        let mut prunes: Vec<(String, u32)> = Vec::new();
        let mut todos: Vec<&Todo> = Vec::new();
        for h in held {
            match h {
                Held::Open(a) => opens.push(a.clone()),
                Held::Update(a) => {
                    let same = |o: &&mut Attempt| o.todo_id == a.todo_id && o.seq == a.seq;
                    match opens.iter_mut().find(same) {
                        Some(o) => *o = a.clone(),
                        None => match updates.iter_mut().find(same) {
                            Some(u) => *u = a.clone(),
                            None => updates.push(a.clone()),
                        },
                    }
                }
                Held::Prune(id, n) => prunes.push((id.clone(), *n)),
                Held::Todo(t) => match todos.iter_mut().find(|o| o.id == t.id) {
                    Some(o) => *o = t,
                    None => todos.push(t),
                },
            }
        }
        let mut out = Vec::new();
        if opens.len() > 1 {
            let rows = opens
                .iter()
                .map(|a| rows::attempt_row(op, a))
                .collect::<Result<Vec<_>, _>>()?;
            out.push(self.many(Many::Insert, rows).await?);
        } else if let Some(a) = opens.first() {
            out.push(self.held_stmt(&Held::Open(a.clone())).await?);
        }
        if updates.len() > 1 {
            let rows = updates
                .iter()
                .map(|a| rows::attempt_update(op, a))
                .collect::<Result<Vec<_>, _>>()?;
            out.push(self.many(Many::UpdateAttempt, rows).await?);
        } else if let Some(a) = updates.first() {
            out.push(self.held_stmt(&Held::Update(a.clone())).await?);
        }
        for (id, n) in prunes {
            out.push(self.held_stmt(&Held::Prune(id, n)).await?);
        }
        if todos.len() > 1 {
            let rows = todos
                .iter()
                .map(|t| rows::todo_update(op, t))
                .collect::<Result<Vec<_>, _>>()?;
            out.push(self.many(Many::UpdateTodo, rows).await?);
        } else if let Some(t) = todos.first() {
            out.push(self.held_stmt(&Held::Todo((*t).clone())).await?);
        }
        Ok(out)
    }

    /// One statement writing `rows` (each a value per column, as the one-row statement binds
    /// them) through arrays, checked by the database to touch exactly that many rows.
    async fn many(&mut self, kind: Many, rows: Vec<Vec<Val>>) -> Result<Stmt, Error> {
        let op = "batch";
        let n = rows.len();
        let (types, mut args) = columns(op, rows)?;
        let arrays = types
            .iter()
            .enumerate()
            .map(|(i, t)| format!("${}::{t}[]", i + 2))
            .collect::<Vec<_>>()
            .join(", ");
        let write = match kind {
            Many::Insert => format!(
                "INSERT INTO todo_attempts ({}) SELECT * FROM unnest({arrays})",
                rows::ATTEMPT_COLS.join(", ")
            ),
            Many::UpdateAttempt => {
                let cols = rows::attempt_update_cols();
                format!(
                    "UPDATE todo_attempts a SET {} FROM unnest({arrays}) AS v({}) \
                     WHERE a.todo_id = v.todo_id AND a.seq = v.seq AND a.ended_at IS NULL",
                    set_from_v(&cols[2..]),
                    cols.join(", ")
                )
            }
            Many::UpdateTodo => {
                let cols = rows::todo_update_cols();
                format!(
                    "UPDATE todos t SET {} FROM unnest({arrays}) AS v({}) WHERE t.id = v.id",
                    set_from_v(&cols[1..]),
                    cols.join(", ")
                )
            }
        };
        let sql = format!(
            "WITH w AS ({write} RETURNING 1) SELECT CASE WHEN count(*) = $1::int8 THEN 0 \
             ELSE ('a batched write touched ' || count(*) || ' rows, not ' || $1::int8)::int \
             END FROM w"
        );
        args.insert(0, Box::new(i64::try_from(n).unwrap_or(i64::MAX)));
        Ok(Stmt {
            st: self.prepare(op, &sql).await?,
            args,
        })
    }

    /// The statement of a held write. The database itself checks that it touched the one row
    /// the rows kept predicted (an error rolls the batch back: its COMMIT is sent with it).
    async fn held_stmt(&mut self, h: &Held) -> Result<Stmt, Error> {
        let op = "batch";
        let (sql, vals): (&str, Vec<Val>) = match h {
            Held::Todo(t) => (&CHECKED.0, rows::todo_update(op, t)?),
            Held::Open(a) => (&CHECKED.1, rows::attempt_row(op, a)?),
            Held::Update(a) => (&CHECKED.2, rows::attempt_update(op, a)?),
            Held::Prune(id, n) => (
                &SQL.prune,
                vec![Val::Text(Some(id.clone())), Val::Count(*n)],
            ),
        };
        Ok(Stmt {
            st: self.prepare(op, sql).await?,
            args: pg_vals(op, vals)?,
        })
    }

    async fn stmt(&mut self, op: &str, sql: &str, vals: Vec<Val>) -> Result<Stmt, Error> {
        let args = pg_vals(op, vals)?;
        Ok(Stmt {
            st: self.prepare(op, sql).await?,
            args,
        })
    }

    /// One read (after the held writes); its rows.
    async fn read(
        &mut self,
        op: &str,
        sql: &str,
        vals: Vec<Val>,
    ) -> Result<Vec<tokio_postgres::Row>, Error> {
        let s = self.stmt(op, sql, vals).await?;
        match self.pipeline(vec![s], false).await?.pop() {
            Some(Out::Rows(rs)) => Ok(rs),
            _ => Ok(Vec::new()),
        }
    }

    /// One write sent now (after the held writes, in the operation's savepoint); its count.
    async fn write_now(&mut self, op: &str, sql: &str, vals: Vec<Val>) -> Result<u64, Error> {
        let s = self.stmt(op, sql, vals).await?;
        match self.pipeline(vec![s], true).await?.pop() {
            Some(Out::Count(n)) => Ok(n),
            _ => Ok(0),
        }
    }

    /// Reads the todos `ids` not kept yet, locked, with their open attempts.
    async fn fetch(&mut self, ids: Vec<String>, absent: bool) -> Result<(), Error> {
        let ids: Vec<String> = ids
            .into_iter()
            .filter(|id| !self.rows.contains_key(id))
            .collect();
        if ids.is_empty() {
            return Ok(());
        }
        let (todos, opens) = (
            self.stmt("batch", &LOAD_MANY, vec![Val::Texts(ids.clone())])
                .await?,
            self.stmt("batch", &OPEN_MANY, vec![Val::Texts(ids.clone())])
                .await?,
        );
        let mut outs = self.pipeline(vec![todos, opens], false).await?;
        let (Some(Out::Rows(opens)), Some(Out::Rows(todos))) = (outs.pop(), outs.pop()) else {
            return Err(Error::internal("batch: a read answered no rows"));
        };
        let r = self.keep(&ids, &todos, &opens, absent);
        if r.is_err() {
            self.broken = true;
        }
        r
    }

    /// Records a change of a kept row, to undo it should the operation fail.
    fn change(&mut self, id: &str, e: Entry) {
        let before = self.rows.insert(id.to_string(), e);
        self.undo.push((id.to_string(), before));
    }

    fn entry_answer(
        op: &str,
        id: &str,
        e: &Entry,
    ) -> Result<Option<(Todo, Option<Attempt>)>, Error> {
        match e {
            Entry::Absent => Ok(None),
            Entry::Row(t, open) => match open.as_slice() {
                [] => Ok(Some(((**t).clone(), None))),
                [a] => Ok(Some(((**t).clone(), Some(a.clone())))),
                _ => Err(rows::two_open_attempts(op, id)),
            },
        }
    }
}

/// Awaits the statements of one round trip, each polled once in order first: that is when each
/// is sent, so they go out (and the server runs them) in this order, whatever their number.
async fn in_order(futs: Vec<Fut<'_>>) -> Result<Vec<Out>, Fail> {
    use futures_util::future::{MaybeDone, maybe_done};
    let mut futs: Vec<MaybeDone<Fut<'_>>> = futs.into_iter().map(maybe_done).collect();
    std::future::poll_fn(|cx| {
        for f in &mut futs {
            let _ = Pin::new(f).poll(cx);
        }
        std::task::Poll::Ready(())
    })
    .await;
    let mut outs = Vec::with_capacity(futs.len());
    for mut f in futs {
        (&mut f).await;
        match Pin::new(&mut f).take_output() {
            Some(out) => outs.push(out?),
            None => {
                return Err(Fail::Other(Error::internal(
                    "batch: a statement answered nothing",
                )));
            }
        }
    }
    Ok(outs)
}

/// A bound value.
type Arg = Box<dyn ToSql + Sync + Send>;

/// Which write [`Batch::many`] makes.
#[derive(Clone, Copy)]
enum Many {
    Insert,
    UpdateAttempt,
    UpdateTodo,
}

/// `col = v.col, …`
fn set_from_v(cols: &[&str]) -> String {
    cols.iter()
        .map(|c| format!("{c} = v.{c}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Rows of values as one array per column, with each column's element type (from the value's
/// kind: the rows of one statement bind the same kinds in the same places).
fn columns(op: &str, rows: Vec<Vec<Val>>) -> Result<(Vec<&'static str>, Vec<Arg>), Error> {
    let width = rows.first().map_or(0, Vec::len);
    let mut cols: Vec<Vec<Val>> = (0..width).map(|_| Vec::with_capacity(rows.len())).collect();
    for row in rows {
        for (c, v) in cols.iter_mut().zip(row) {
            c.push(v);
        }
    }
    let mut types = Vec::with_capacity(width);
    let mut args: Vec<Arg> = Vec::with_capacity(width);
    let mixed = || Error::internal(format!("{op}: a column of a batched write mixes kinds"));
    for col in cols {
        let (t, a): (&'static str, Arg) = match col.first() {
            Some(Val::Text(_)) | None => {
                let v = col.into_iter().map(|v| match v {
                    Val::Text(t) => Ok(t),
                    _ => Err(mixed()),
                });
                ("text", Box::new(v.collect::<Result<Vec<_>, _>>()?))
            }
            Some(Val::Count(_)) => {
                let v = col.into_iter().map(|v| match v {
                    Val::Count(n) => i32::try_from(n)
                        .map_err(|_| Error::invalid(format!("{op}: count {n} is out of range"))),
                    _ => Err(mixed()),
                });
                ("int4", Box::new(v.collect::<Result<Vec<_>, _>>()?))
            }
            Some(Val::Big(_)) => {
                let v = col.into_iter().map(|v| match v {
                    Val::Big(n) => Ok(n),
                    _ => Err(mixed()),
                });
                ("int8", Box::new(v.collect::<Result<Vec<_>, _>>()?))
            }
            Some(Val::Bool(_)) => {
                let v = col.into_iter().map(|v| match v {
                    Val::Bool(b) => Ok(b),
                    _ => Err(mixed()),
                });
                ("bool", Box::new(v.collect::<Result<Vec<_>, _>>()?))
            }
            Some(Val::Bytes(_)) => {
                let v = col.into_iter().map(|v| match v {
                    Val::Bytes(b) => Ok(b),
                    _ => Err(mixed()),
                });
                ("bytea", Box::new(v.collect::<Result<Vec<_>, _>>()?))
            }
            Some(Val::Texts(_)) => return Err(mixed()),
        };
        types.push(t);
        args.push(a);
    }
    Ok((types, args))
}

/// Sends one statement when first polled: a write answers its count, a read its rows.
fn send<'a>(c: &'a ClientWrapper, s: &'a Stmt) -> Fut<'a> {
    let args: Vec<&(dyn ToSql + Sync)> = s.args.iter().map(|v| &**v as _).collect();
    let st = &s.st;
    if st.columns().is_empty() {
        Box::pin(async move {
            c.execute(st, &args)
                .await
                .map(Out::Count)
                .map_err(Fail::from)
        })
    } else {
        Box::pin(async move { c.query(st, &args).await.map(Out::Rows).map_err(Fail::from) })
    }
}

/// Every todo of `ids`, locked in id order (two batches of this process or another never wait
/// on each other in a cycle here).
static LOAD_MANY: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "{} WHERE t.id = ANY($1) ORDER BY t.id FOR UPDATE",
        SQL.todo_select
    )
});
static OPEN_MANY: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "SELECT {} FROM todo_attempts a WHERE a.todo_id = ANY($1) AND a.ended_at IS NULL",
        rows::select_list("a", &rows::ATTEMPT_COLS)
    )
});

/// The batch's first statements: `BEGIN`, the change lock, and for a batch that claims, the
/// claim's planner setting (every `claim_next` of the batch reads in this transaction).
pub(super) fn begin_sql(claims: bool) -> String {
    match claims {
        true => format!("BEGIN; {CHANGE_LOCK_SHARED}; {CLAIM_PLAN}"),
        false => format!("BEGIN; {CHANGE_LOCK_SHARED}"),
    }
}

/// A claim_next scope: its statement and values but `now` (bound first), so that callers whose
/// clocks differ by a millisecond share one read (each row is still judged at each one's `now`).
fn claim_key(
    now: Millis,
    actor: &Actor,
    queues: Option<&[String]>,
    paused: &[String],
) -> Result<(String, Vec<Val>), Error> {
    let (sql, vals) = SQL.next_claimable("claim_next", now, actor, queues, paused, CLAIM_LOCK)?;
    Ok(match vals.split_first() {
        Some((Val::Big(Some(_)), rest)) => (sql, rest.to_vec()),
        _ => (sql, vals),
    })
}

/// A scope's statement with room for `n` rows.
fn limited(sql: &str, n: usize) -> String {
    sql.replacen(
        &format!("LIMIT 1{CLAIM_LOCK}"),
        &format!("LIMIT {n}{CLAIM_LOCK}"),
        1,
    )
}

fn fifo(t: &Todo) -> (Millis, &str) {
    (t.created_at, t.id.as_str())
}

impl Rows for Batch<'_> {
    async fn load(&mut self, op: &str, id: &str) -> Result<Option<(Todo, Option<Attempt>)>, Error> {
        if !self.rows.contains_key(id) {
            self.fetch(vec![id.to_string()], true).await?;
        }
        match self.rows.get(id) {
            Some(e) => Self::entry_answer(op, id, e),
            None => Ok(None),
        }
    }

    async fn next_claimable(
        &mut self,
        now: Millis,
        actor: &Actor,
        queues: Option<&[String]>,
        paused: &[String],
    ) -> Result<Option<(Todo, Option<Attempt>)>, Error> {
        let op = "claim_next";
        let key = claim_key(now, actor, queues, paused)?;
        for _ in 0..3 {
            if let Some(g) = self.groups.iter().find(|g| g.key == key) {
                // The first claimable row of those kept (read for this scope or any other, or
                // changed by this batch), when no unread row can come before it.
                let best = self
                    .rows
                    .values()
                    .filter_map(|e| match e {
                        Entry::Row(t, _)
                            if transition::claimable(now, t, actor, queues)
                                && !paused.contains(&t.queue) =>
                        {
                            Some(t)
                        }
                        _ => None,
                    })
                    .min_by(|a, b| fifo(a).cmp(&fifo(b)));
                let before_unread = |t: &Todo| {
                    g.exhausted
                        || g.last
                            .as_ref()
                            .is_some_and(|(at, id)| fifo(t) <= (*at, id.as_str()))
                };
                match best {
                    Some(t) if before_unread(t) => {
                        let id = t.id.clone();
                        return Self::entry_answer(op, &id, &self.rows[&id]);
                    }
                    None if g.exhausted => return Ok(None),
                    _ => {}
                }
                self.groups.retain(|g| g.key != key);
            }
            // Read as many rows as the batch has claims left, after its held writes.
            let k = self.claims_left.max(1);
            let (sql_k, vals_k) =
                SQL.next_claimable_n(op, now, actor, queues, paused, k, CLAIM_LOCK)?;
            let found = self.read(op, &sql_k, vals_k).await?;
            let (last, len) = self.keep_claimable(&found).await?;
            self.groups.push(Group {
                key: key.clone(),
                last,
                exhausted: len < k,
            });
        }
        Err(Error::internal(
            "claim_next: the batch's rows and the database disagree on what is claimable",
        ))
    }

    async fn by_key(&mut self, endpoint: &str, key: &str) -> Result<Option<Todo>, Error> {
        let vals = vec![
            Val::Text(Some(endpoint.into())),
            Val::Text(Some(key.into())),
        ];
        let rs = self.read("add_todo", &SQL.by_key, vals).await?;
        rs.first().map(|r| rows::todo(r, 0)).transpose()
    }

    async fn insert_todo(&mut self, t: &Todo) -> Result<bool, Error> {
        let op = "add_todo";
        let vals = rows::todo_row(op, t)?;
        let inserted = self.write_now(op, &SQL.insert_todo, vals).await? == 1;
        if inserted {
            self.change(&t.id, Entry::Row(Box::new(t.clone()), Vec::new()));
        }
        Ok(inserted)
    }

    async fn write(
        &mut self,
        op: &str,
        todo: &Todo,
        writes: &[AttemptWrite],
    ) -> Result<Vec<u64>, Error> {
        let mut open = match self.rows.get(&todo.id) {
            Some(Entry::Row(_, open)) => open.clone(),
            _ => {
                return Err(Error::internal(format!(
                    "{op} {}: a write of a todo the batch did not read",
                    todo.id
                )));
            }
        };
        let mut counts = Vec::with_capacity(writes.len());
        self.held.push(Held::Todo(todo.clone()));
        for w in writes {
            counts.push(match w {
                AttemptWrite::Open(a) => {
                    self.held.push(Held::Open(a.clone()));
                    open.push(a.clone());
                    1
                }
                AttemptWrite::Update(a) => {
                    // Touches the open attempt of that seq, or nothing (and `run` refuses).
                    match open.iter().position(|o| o.seq == a.seq) {
                        None => 0,
                        Some(i) => {
                            self.held.push(Held::Update(a.clone()));
                            if a.is_open() {
                                open[i] = a.clone();
                            } else {
                                open.remove(i);
                            }
                            1
                        }
                    }
                }
                AttemptWrite::PruneThrough(n) => {
                    self.held.push(Held::Prune(todo.id.clone(), *n));
                    0
                }
                AttemptWrite::Late(a) => {
                    let vals = rows::late_update(a);
                    self.write_now(op, &SQL.update_late, vals).await?
                }
            });
        }
        self.change(&todo.id, Entry::Row(Box::new(todo.clone()), open));
        Ok(counts)
    }

    async fn attempts(&mut self, op: &str, id: &str, which: Newest) -> Result<Vec<Attempt>, Error> {
        let (sql, vals) = SQL.attempts_query(id, which);
        let rs = self.read(op, sql, vals).await?;
        let mut out = Vec::with_capacity(rs.len());
        for row in &rs {
            out.extend(rows::attempt(row, 0)?);
        }
        Ok(out)
    }

    async fn candidates(&mut self, _: Sweep<'_>) -> Result<Vec<String>, Error> {
        Err(not_batched("sweep"))
    }

    async fn list(&mut self, _: &Actor, _: &TodoFilter) -> Result<Vec<Todo>, Error> {
        Err(not_batched("list_todos"))
    }

    async fn delete(&mut self, op: &str, _: &str) -> Result<(), Error> {
        Err(not_batched(op))
    }

    async fn paused_queues(&mut self) -> Result<Vec<String>, Error> {
        Ok(self.paused.clone())
    }

    async fn set_paused(&mut self, _: Millis, _: &str, _: bool) -> Result<(), Error> {
        Err(not_batched("pause"))
    }
}

/// `batched` keeps these operations out of a batch; reaching one is a bug.
fn not_batched(op: &str) -> Error {
    Error::internal(format!("{op}: not an operation a batch runs"))
}
