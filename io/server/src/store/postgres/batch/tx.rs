//! One batch's transaction: the rows it read and locked, the writes it holds, and the round
//! trips that read and write them.

use std::collections::HashMap;

use deadpool_postgres::ClientWrapper;
use relay_core::Error;
use relay_core::Millis;
use relay_core::ledger::rows::{ClaimQuery, Loaded};
use relay_core::ledger::{self, Attempt, Holds, Limits, Op, Todo, TodoState};
use tokio_postgres::Statement;
use tokio_postgres::types::ToSql;

use super::stmt::{
    Fail, Fut, LOAD_MANY, Many, OPEN_MANY, Out, Stmt, begin_sql, claim_key, columns, in_order,
    limited, send, set_from_v,
};
use crate::store::ops;
use crate::store::postgres::encode::{pg_err, pg_vals};
use crate::store::postgres::tx::{SQL, db_now};
use crate::store::rows::{self, Val};

/// A todo row as the batch knows it: locked by this transaction, so only it changes it.
#[derive(Clone, Debug)]
pub(super) enum Entry {
    Absent,
    /// The todo and its open attempts (one at most, unless the table is broken).
    Row(Box<Todo>, Vec<Attempt>),
}

/// A write held until the next round trip, with the rows it must touch.
pub(super) enum Held {
    Todo(Todo),
    Open(Attempt),
    Update(Attempt),
    Prune(String, u32),
}

/// What a `claim_next` scope has read: the rows after `last` (in `ledger::claim_order`) that
/// are claimable and no other transaction holds are not read yet, unless `exhausted`.
pub(super) struct Group {
    pub(super) key: (String, Vec<Val>),
    pub(super) last: Option<Place>,
    pub(super) exhausted: bool,
}

/// A todo's place in `ledger::claim_order`, owned.
pub(super) type Place = (std::cmp::Reverse<i32>, Millis, String);

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
pub(super) struct Batch<'c> {
    pub(super) c: &'c ClientWrapper,
    pub(super) paused: Vec<String>,
    /// The queues' limits, read with the paused ones.
    pub(super) limits: Vec<(String, Limits)>,
    pub(super) rows: HashMap<String, Entry>,
    pub(super) groups: Vec<Group>,
    pub(super) held: Vec<Held>,
    /// Where the current operation's held writes start.
    pub(super) mark: usize,
    /// The current operation has sent writes after `SAVEPOINT op`.
    pub(super) savepoint: bool,
    /// Rows first read inside the current operation's savepoint (its rollback unlocks them).
    pub(super) read_in_savepoint: Vec<String>,
    /// Savepoint commands to send before the next statement.
    pub(super) cmds: Vec<&'static str>,
    /// The rows the current operation changed, as they were before.
    pub(super) undo: Vec<(String, Option<Entry>)>,
    pub(super) claims_left: usize,
    /// A statement failed: the transaction is lost.
    pub(super) broken: bool,
}

const SAVEPOINT: &str = "SAVEPOINT op";
const RELEASE: &str = "RELEASE SAVEPOINT op";
const ROLLBACK_TO: &str = "ROLLBACK TO SAVEPOINT op";
const PAUSED: &str = "SELECT queue FROM paused_queues ORDER BY queue";

impl<'c> Batch<'c> {
    pub(super) fn new(c: &'c ClientWrapper) -> Batch<'c> {
        Batch {
            c,
            paused: Vec::new(),
            limits: Vec::new(),
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

    pub(super) async fn prepare(&mut self, op: &str, sql: &str) -> Result<Statement, Error> {
        let r = self.c.prepare_cached(sql).await;
        r.map_err(|e| {
            self.broken = true;
            pg_err(op, "(a batch)", &e)
        })
    }

    /// The first round trip: `BEGIN`, the change lock (before any row lock, see
    /// `PgStore::pending_since`), the database's clock when it decides, the paused queues and the
    /// queues' limits, and
    /// the todos the operations name, locked, with their open attempts.
    pub(super) async fn begin(
        &mut self,
        ops: &[Op],
        db_clock: bool,
    ) -> Result<Option<Millis>, Error> {
        let r = self.begin_inner(ops, db_clock).await;
        if r.is_err() {
            self.broken = true;
        }
        r
    }

    pub(super) async fn begin_inner(
        &mut self,
        ops: &[Op],
        db_clock: bool,
    ) -> Result<Option<Millis>, Error> {
        let mut ids: Vec<String> = ops
            .iter()
            .filter_map(Op::todo_id)
            .map(String::from)
            .collect();
        ids.sort_unstable();
        ids.dedup();
        let (paused, load, open) = self.statements().await?;
        let limits = self.prepare("batch", ops::LIMITS).await?;
        // Each claim_next scope's rows, read in this round trip too: as many as the batch has
        // claims in that scope, at the earliest of their callers' `now` (each row is judged
        // again at its operation's own `now`), assuming nothing is held back (when a queue is
        // paused or a limit holds, these reads match no claim, and the claims read their own).
        let mut scopes: Vec<(Group, Millis, usize)> = Vec::new();
        for op in ops {
            if let Op::ClaimNext {
                now, actor, queues, ..
            } = op
            {
                let queues = queues.as_deref().map(ledger::storable_queue_filter);
                let holds = Holds::default();
                let key = claim_key(&ClaimQuery::new(*now, actor, queues.as_deref(), &holds))?;
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
            Box::pin(async {
                c.query(&limits, none)
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
        if let Out::Rows(rs) = &outs[3] {
            self.limits = rs
                .iter()
                .map(|r| ops::limits_row(r))
                .collect::<Result<_, _>>()?;
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
    /// one's place in the claim order and how many there were. Their open attempts are read after the lock (see
    /// `PgTx::load`), but only for claimed rows (a takeover): any other has none, and were one
    /// there after all, the deferred one-open-attempt constraint refuses the batch's COMMIT and
    /// its operations run again alone, where the attempt is read.
    pub(super) async fn keep_claimable(
        &mut self,
        found: &[tokio_postgres::Row],
    ) -> Result<(Option<Place>, usize), Error> {
        let mut last = None;
        let mut takeovers = Vec::new();
        for r in found {
            let t = rows::todo(r, 0)?;
            // The last in claim order, whatever order the rows came in.
            let (p, at, id) = ledger::claim_order(&t);
            last = last.max(Some((p, at, id.to_string())));
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

    pub(super) async fn statements(&mut self) -> Result<(Statement, Statement, Statement), Error> {
        Ok((
            self.prepare("batch", PAUSED).await?,
            self.prepare("batch", &LOAD_MANY).await?,
            self.prepare("batch", &OPEN_MANY).await?,
        ))
    }

    /// Keeps the rows read of `ids` (those not kept yet; `absent`: an id without a row is
    /// kept as absent).
    pub(super) fn keep(
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

    pub(super) fn start_op(&mut self, claims_left: usize) {
        self.mark = self.held.len();
        self.savepoint = false;
        self.read_in_savepoint.clear();
        self.undo.clear();
        self.claims_left = claims_left;
    }

    pub(super) fn end_op(&mut self, ok: bool) {
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
    pub(super) async fn pipeline(
        &mut self,
        stmts: Vec<Stmt>,
        direct: bool,
    ) -> Result<Vec<Out>, Error> {
        let r = self.pipeline_inner(stmts, direct, false).await;
        if r.is_err() {
            self.broken = true;
        }
        r.map_err(Fail::into_error)
    }

    pub(super) async fn pipeline_inner(
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
    pub(super) async fn commit(&mut self) -> Result<(), Fail> {
        self.pipeline_inner(Vec::new(), false, true).await.map(drop)
    }

    /// The statements of held writes, in an order with their effect: attempts inserted, open
    /// attempts rewritten, closed ones pruned, todos rewritten. Writes of one row are folded
    /// into its last (an attempt inserted and then rewritten is inserted as rewritten), and
    /// each kind of write to more than one row is one statement over arrays (`unnest`).
    pub(super) async fn held_stmts(&mut self, held: &[Held]) -> Result<Vec<Stmt>, Error> {
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
    pub(super) async fn many(&mut self, kind: Many, rows: Vec<Vec<Val>>) -> Result<Stmt, Error> {
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
                    "UPDATE todos t SET {}{} FROM unnest({arrays}) AS v({}) WHERE t.id = v.id",
                    set_from_v(&cols[1..]),
                    rows::pg_derived_set("t", |c| format!("v.{c}")),
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
    pub(super) async fn held_stmt(&mut self, h: &Held) -> Result<Stmt, Error> {
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

    pub(super) async fn stmt(
        &mut self,
        op: &str,
        sql: &str,
        vals: Vec<Val>,
    ) -> Result<Stmt, Error> {
        let args = pg_vals(op, vals)?;
        Ok(Stmt {
            st: self.prepare(op, sql).await?,
            args,
        })
    }

    /// One read (after the held writes); its rows.
    pub(super) async fn read(
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
    pub(super) async fn write_now(
        &mut self,
        op: &str,
        sql: &str,
        vals: Vec<Val>,
    ) -> Result<u64, Error> {
        let s = self.stmt(op, sql, vals).await?;
        match self.pipeline(vec![s], true).await?.pop() {
            Some(Out::Count(n)) => Ok(n),
            _ => Ok(0),
        }
    }

    /// Reads the todos `ids` not kept yet, locked, with their open attempts.
    pub(super) async fn fetch(&mut self, ids: Vec<String>, absent: bool) -> Result<(), Error> {
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
    pub(super) fn change(&mut self, id: &str, e: Entry) {
        let before = self.rows.insert(id.to_string(), e);
        self.undo.push((id.to_string(), before));
    }

    pub(super) fn entry_answer(op: &str, id: &str, e: &Entry) -> Result<Option<Loaded>, Error> {
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
