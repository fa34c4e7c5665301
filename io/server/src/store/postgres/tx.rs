//! One Postgres transaction of its own (an operation outside a writer's batch, a read, a sweep,
//! the store's own tables): `BEGIN`, the ledger's rows and the store's tables in SQL, `COMMIT`.

use std::sync::LazyLock;

use deadpool_postgres::{Object, Transaction};
use relay_core::Error;
use relay_core::Millis;
use relay_core::ledger::rows::{ClaimQuery, Loaded};
use relay_core::ledger::{
    Actor, Attempt, AttemptWrite, Change, Newest, Rows, Sweep, Todo, TodoFilter,
};
use tokio_postgres::Row;
use tokio_postgres::types::ToSql;

use super::encode::{pg_err, pg_vals};
use crate::store::ops::{self, Decode, Sql, Tx, TxKind};
use crate::store::rows::{self, ENDPOINT_COLS, Val, ms};
use crate::store::types::Endpoint;

/// The database's clock as ms since the epoch, read by one statement inside the caller's
/// transaction (`clock_timestamp()`, the time of the read, not of `BEGIN`). Sent with
/// `query_typed`: no statement to prepare, one message, so it pipelines with its neighbours.
pub(crate) async fn db_now(c: &impl tokio_postgres::GenericClient) -> Result<Millis, Error> {
    let op = "reading the database's clock";
    let row = c
        .query_typed_one(
            "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint",
            &[],
        )
        .await
        .map_err(|e| pg_err(op, "", &e))?;
    let ms: i64 = row.try_get(0).map_err(|e| pg_err(op, "", &e))?;
    Millis::try_from(ms).map_err(|_| Error::internal(format!("{op}: {ms} is before the epoch")))
}

/// Which clock an operation's rules read on Postgres.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PgClock {
    /// The database's `clock_timestamp()`, read in the operation's own transaction: every
    /// server on one database computes every lease from one clock, whatever its own says.
    /// What [`PgStore::open`](super::PgStore::open) and
    /// [`PgStore::open_in_schema`](super::PgStore::open_in_schema) use.
    Database,
    /// The `now` the caller passed: for tests that drive time with a manual clock, and for the
    /// model tests that hold the store to the in-memory ledger bit for bit.
    Caller,
}

pub(crate) struct PgTx<'c> {
    t: Transaction<'c>,
    kind: TxKind,
    clock: PgClock,
}

impl<'c> PgTx<'c> {
    /// Starts a transaction on `client`: a write one (READ COMMITTED) takes the change lock
    /// shared before any row lock, a read one is REPEATABLE READ, READ ONLY. Its rules read
    /// `clock`.
    pub(crate) async fn begin(
        client: &'c mut Object,
        kind: TxKind,
        op: &str,
        clock: PgClock,
    ) -> Result<PgTx<'c>, Error> {
        let b = client.build_transaction();
        let b = match kind {
            TxKind::Write => b,
            TxKind::Read => b
                .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
                .read_only(true),
        };
        let t = b.start().await.map_err(|e| pg_err(op, "", &e))?;
        if kind == TxKind::Write {
            // Before any row lock: the doorbell scan waits for every writer holding this to end
            // (see `pending_since`), and a writer that took it first can never wait on the scan.
            t.execute(CHANGE_LOCK_SHARED, &[])
                .await
                .map_err(|e| pg_err(op, "", &e))?;
        }
        Ok(PgTx { t, kind, clock })
    }

    /// Commits on `Ok` (a deferred constraint fires here), rolls back on `Err`.
    pub(crate) async fn finish<R>(
        self,
        op: &str,
        subject: &str,
        result: Result<R, Error>,
    ) -> Result<R, Error> {
        match result {
            Ok(v) => {
                self.t.commit().await.map_err(|e| pg_err(op, subject, &e))?;
                Ok(v)
            }
            Err(e) => {
                // Dropping the transaction rolls it back; say so explicitly to return the
                // connection clean at once.
                let _ = self.t.rollback().await;
                Err(e)
            }
        }
    }

    /// The database's clock in milliseconds since the epoch, read inside this transaction (so
    /// that the time and the rows an operation reads come from one transaction), or the
    /// caller's `now` under [`PgClock::Caller`]. `clock_timestamp()`, not `now()`: the latter is
    /// the transaction's start, the same for every operation of a batch. It is read before the
    /// row locks, so a lock waited for makes it early by the wait: a takeover or a reap only
    /// ever comes later for it, and a lease granted is at most that much shorter by the
    /// database's clock.
    pub(crate) async fn db_now(&self, caller: Millis) -> Result<Millis, Error> {
        match self.clock {
            PgClock::Caller => Ok(caller),
            PgClock::Database => db_now(&*self.t).await,
        }
    }

    /// The transaction itself (tests send raw SQL in it).
    #[cfg(test)]
    pub(crate) fn raw(&self) -> &Transaction<'c> {
        &self.t
    }
}

/// The todo of a query's only row, or `None`.
fn one_todo(rs: &[Row]) -> Result<Option<Todo>, Error> {
    rs.first().map(|r| rows::todo(r, 0)).transpose()
}

/// A claim's reads on Postgres, in a transaction ([`PgTx`]) or a batch of them: each hands on
/// the rows of one statement, and the claim's two reads follow from that.
pub(super) trait PgClaimRows {
    async fn claim_rows(&mut self, sql: Sql<'_>, vals: Vec<Val>) -> Result<Vec<Row>, Error>;
}

impl<T: PgClaimRows> rows::ClaimReads for T {
    type Todo = Row;

    async fn places(&mut self, sql: Sql<'_>, vals: Vec<Val>) -> Result<Vec<rows::Place>, Error> {
        let rs = self.claim_rows(sql, vals).await?;
        rs.iter().map(rows::place).collect()
    }

    async fn todos(&mut self, sql: Sql<'_>, vals: Vec<Val>) -> Result<Vec<Row>, Error> {
        self.claim_rows(sql, vals).await
    }

    fn id_of(t: &Row) -> Option<&str> {
        t.try_get(0).ok()
    }
}

impl PgClaimRows for PgTx<'_> {
    async fn claim_rows(&mut self, sql: Sql<'_>, vals: Vec<Val>) -> Result<Vec<Row>, Error> {
        self.query_vals(sql.op, sql.subject, sql.text, vals).await
    }
}

pub(crate) static SQL: LazyLock<rows::Shared> = LazyLock::new(|| rows::Shared::new('$'));

/// The advisory lock key of this store's change sequence: its object id, so that stores in
/// different schemas of one database (tests, tenants) do not wait on each other.
pub(super) const CHANGE_LOCK_KEY: &str = "'todo_change_seq'::regclass::oid::bigint";
pub(crate) const CHANGE_LOCK_SHARED: &str =
    "SELECT pg_advisory_xact_lock_shared('todo_change_seq'::regclass::oid::bigint)";

/// Sent in a transaction that claims, before its first `claim_next` read. Without statistics
/// on `todos` (a new table, or an endpoint whose backlog grew since the last ANALYZE) the
/// planner takes a claim to match a row or two, and reads every claimable row of the endpoint
/// through a bitmap scan to sort them, where walking `todos_fifo` in its order stops at the
/// first rows it can lock: 24 ms against 0.05 ms a claim with 50 000 todos waiting (see
/// `claims_walk_the_fifo_index_without_statistics`). With no explicit sort to weigh, it walks
/// the index, which already gives the order when the claim names its endpoint. Only in those
/// transactions: a sweep's plan (its partial index, then a sort by id) is right as it is. The
/// claim statements only ever run under it, so a plan Postgres caches for them is this one.
/// The read through the key heads (`rows::heads`) must still sort its few rows, and the cost
/// Postgres then adds to a plan passes the threshold of JIT compilation, which took half a
/// second a claim to save nothing: JIT is off there too.
pub(crate) const CLAIM_PLAN: &str = "SET LOCAL enable_sort = off; SET LOCAL jit = off";
/// `claim_next`'s lock clause: a row another transaction holds is skipped, not waited for.
pub(crate) const CLAIM_LOCK: &str = " FOR UPDATE SKIP LOCKED";
static LOAD_FOR_UPDATE: LazyLock<String> =
    LazyLock::new(|| format!("{} WHERE t.id = $1 FOR UPDATE", SQL.todo_select));
static LOAD: LazyLock<String> = LazyLock::new(|| format!("{} WHERE t.id = $1", SQL.todo_select));

impl PgTx<'_> {
    async fn prepare(
        &self,
        op: &str,
        subject: &str,
        sql: &str,
    ) -> Result<tokio_postgres::Statement, Error> {
        self.t
            .prepare_cached(sql)
            .await
            .map_err(|e| pg_err(op, subject, &e))
    }

    /// Sends the statement when first polled, so joined calls are pipelined in poll order.
    async fn run_query(
        &self,
        op: &str,
        subject: &str,
        st: &tokio_postgres::Statement,
        args: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, Error> {
        self.t
            .query(st, args)
            .await
            .map_err(|e| pg_err(op, subject, &e))
    }

    /// The open attempt from its query's rows; two open attempts are an internal error.
    fn one_open(&self, op: &str, id: &str, rs: &[Row]) -> Result<Option<Attempt>, Error> {
        match rs {
            [] => Ok(None),
            [row] => rows::attempt(row, 0),
            _ => Err(rows::two_open_attempts(op, id)),
        }
    }

    async fn query(
        &self,
        op: &str,
        subject: &str,
        sql: &str,
        args: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, Error> {
        let st = self
            .t
            .prepare_cached(sql)
            .await
            .map_err(|e| pg_err(op, subject, &e))?;
        self.t
            .query(&st, args)
            .await
            .map_err(|e| pg_err(op, subject, &e))
    }

    async fn execute(
        &self,
        op: &str,
        subject: &str,
        sql: &str,
        args: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, Error> {
        let st = self
            .t
            .prepare_cached(sql)
            .await
            .map_err(|e| pg_err(op, subject, &e))?;
        self.t
            .execute(&st, args)
            .await
            .map_err(|e| pg_err(op, subject, &e))
    }
}

impl PgTx<'_> {
    /// Moves the reaper's mark (`lease_due_at`) of every lease still running whose mark has
    /// passed (renewed by heartbeats since it was set) up to its lease, so that the reaper's
    /// search reads each running lease about once a lease, not at every sweep. Run before a
    /// reap, in a transaction of its own: the rows it locks are let go at its commit, not held
    /// while the sweep runs (their holders' heartbeats would wait for it).
    pub(crate) async fn move_reap_marks(&self, now: Millis) -> Result<u64, Error> {
        let op = "reap";
        self.exec(
            op,
            "(the reaper's marks)",
            REAP_MARKS,
            vec![Val::Big(Some(ms(op, now)?))],
        )
        .await
    }

    /// Runs one statement with the values bound in order; the rows it changed.
    async fn exec(&self, op: &str, subject: &str, sql: &str, vals: Vec<Val>) -> Result<u64, Error> {
        let vals = pg_vals(op, vals)?;
        let args: Vec<&(dyn ToSql + Sync)> = vals.iter().map(|v| &**v as _).collect();
        self.execute(op, subject, sql, &args).await
    }

    /// Runs one query with the values bound in order.
    async fn query_vals(
        &self,
        op: &str,
        subject: &str,
        sql: &str,
        vals: Vec<Val>,
    ) -> Result<Vec<Row>, Error> {
        let vals = pg_vals(op, vals)?;
        let args: Vec<&(dyn ToSql + Sync)> = vals.iter().map(|v| &**v as _).collect();
        self.query(op, subject, sql, &args).await
    }

    async fn update_todo(&self, op: &str, t: &Todo) -> Result<(), Error> {
        let vals = rows::todo_update(op, t)?;
        if self.exec(op, &t.id, &SQL.update_todo, vals).await? != 1 {
            return Err(Error::internal(format!(
                "{op} {}: the todo row vanished inside its transaction",
                t.id
            )));
        }
        Ok(())
    }

    async fn insert_attempt_row(&self, op: &str, a: &Attempt) -> Result<(), Error> {
        let vals = rows::attempt_row(op, a)?;
        self.exec(op, &a.todo_id, &SQL.insert_attempt, vals)
            .await
            .map(drop)
    }
}

/// One server at a time runs each background sweep: a transaction-scoped advisory lock, tried
/// and skipped when held, released at commit or rollback, and when its holder's connection dies
/// (a server killed mid-sweep holds nothing). Keyed by the schema and the sweep's name.
/// See [`PgTx::move_reap_marks`]: rows a writer holds are skipped, for a later sweep.
const REAP_MARKS: &str = "UPDATE todos SET lease_due_at = lease_expires_at WHERE id IN (
    SELECT id FROM todos WHERE state = 'claimed' AND lease_due_at <= $1
       AND lease_expires_at > $1 FOR UPDATE SKIP LOCKED)";

/// The flow lock (see `Tx::lock_flow`), keyed by the limits table of this schema.
pub(crate) const FLOW_LOCK: &str =
    "SELECT pg_advisory_xact_lock('queue_limits'::regclass::oid::bigint)";

pub(crate) const TRY_SWEEP_LOCK: &str =
    "SELECT pg_try_advisory_xact_lock(hashtextextended(current_schema() || '/sweep/' || $1, 0))";

impl Rows for PgTx<'_> {
    async fn load(&mut self, op: &str, id: &str) -> Result<Option<Loaded>, Error> {
        // Two statements, pipelined (one round trip), never one join: under READ COMMITTED a
        // `FOR UPDATE` that waited for another transaction returns the row's newest version but
        // a joined row from its older snapshot. The attempt is read by the statement after the
        // lock is granted, so it sees everything the previous holder committed.
        let todo_sql = match self.kind {
            TxKind::Write => &*LOAD_FOR_UPDATE,
            TxKind::Read => &*LOAD,
        };
        let (todo_st, open_st) = (
            self.prepare(op, id, todo_sql).await?,
            self.prepare(op, id, &SQL.open_attempt).await?,
        );
        let (todo, open) = futures_util::future::try_join(
            self.run_query(op, id, &todo_st, &[&id]),
            self.run_query(op, id, &open_st, &[&id]),
        )
        .await?;
        match one_todo(&todo)? {
            None => Ok(None),
            Some(t) => Ok(Some((t, self.one_open(op, id, &open)?))),
        }
    }

    async fn next_claimable(&mut self, claim: &ClaimQuery<'_>) -> Result<Option<Loaded>, Error> {
        let op = claim.op;
        let subject = format!("(next for {})", claim.actor.owner());
        self.t
            .batch_execute(CLAIM_PLAN)
            .await
            .map_err(|e| pg_err(op, &subject, &e))?;
        let rs = rows::claimable(self, &SQL, claim, 1, CLAIM_LOCK).await?;
        let Some(todo) = one_todo(&rs)? else {
            return Ok(None);
        };
        // Read after the lock (see `load`).
        let open = self
            .query(op, &todo.id, &SQL.open_attempt, &[&todo.id])
            .await?;
        let open = self.one_open(op, &todo.id, &open)?;
        Ok(Some((todo, open)))
    }

    async fn by_key(&mut self, endpoint: &str, key: &str) -> Result<Option<Todo>, Error> {
        let op = "add_todo";
        let vals = vec![
            Val::Text(Some(endpoint.into())),
            Val::Text(Some(key.into())),
        ];
        let rs = self
            .query_vals(op, "(idempotency key)", &SQL.by_key, vals)
            .await?;
        one_todo(&rs)
    }

    async fn insert_todo(&mut self, t: &Todo) -> Result<bool, Error> {
        let op = "add_todo";
        let vals = rows::todo_row(op, t)?;
        Ok(self.exec(op, &t.id, &SQL.insert_todo, vals).await? == 1)
    }

    async fn write(&mut self, op: &str, change: &Change) -> Result<Vec<u64>, Error> {
        let (todo, writes) = (&change.todo, &change.writes);
        // Pipelined: every statement goes out before the first answer comes back, one round
        // trip for the whole change. Their order does not matter: the one-open-attempt
        // constraint is checked at commit.
        let this = &*self;
        let todo_row = async { this.update_todo(op, todo).await.map(|()| 0) };
        let attempts = writes.iter().map(|w| async move {
            match w {
                AttemptWrite::Open(a) => this.insert_attempt_row(op, a).await.map(|()| 1),
                AttemptWrite::Update(a) => {
                    let vals = rows::attempt_update(op, a)?;
                    this.exec(op, &a.todo_id, &SQL.update_open_attempt, vals)
                        .await
                }
                AttemptWrite::PruneThrough(n) => {
                    let vals = vec![Val::Text(Some(todo.id.clone())), Val::Count(*n)];
                    this.exec(op, &todo.id, &SQL.prune, vals).await.map(|_| 0)
                }
                AttemptWrite::Amend(a) => {
                    this.exec(
                        op,
                        &a.todo_id,
                        &SQL.update_amend,
                        rows::amend_update(op, a)?,
                    )
                    .await
                }
            }
        });
        let (_, rows) =
            futures_util::future::try_join(todo_row, futures_util::future::try_join_all(attempts))
                .await?;
        Ok(rows)
    }

    async fn attempts(&mut self, op: &str, id: &str, which: Newest) -> Result<Vec<Attempt>, Error> {
        let (sql, vals) = SQL.attempts_query(id, which);
        let rs = self.query_vals(op, id, sql, vals).await?;
        let mut out = Vec::with_capacity(rs.len());
        for row in &rs {
            out.extend(rows::attempt(row, 0)?);
        }
        Ok(out)
    }

    async fn candidates(&mut self, sweep: Sweep<'_>) -> Result<Vec<String>, Error> {
        let op = "sweep";
        // Rows a claimer holds are skipped by the reaper and the requeue (it is closing them);
        // a revocation and a purge wait for them, so that they miss none.
        let lock = match sweep {
            Sweep::Reap { .. } | Sweep::RequeueDue { .. } => " FOR UPDATE SKIP LOCKED",
            Sweep::Revoke { .. } | Sweep::Purge { .. } => " FOR UPDATE",
        };
        let background = match sweep {
            Sweep::Reap { .. } => Some("reap"),
            Sweep::RequeueDue { .. } => Some("requeue"),
            Sweep::Revoke { .. } | Sweep::Purge { .. } => None,
        };
        if let Some(name) = background
            && !ops::Tx::try_sweep_lock(self, op, name).await?
        {
            // Another server is running this sweep right now; it closes what this one would.
            return Ok(Vec::new());
        }
        let (sql, arg) = SQL.sweep(op, sweep)?;
        let sql = format!("{sql} ORDER BY id{lock}");
        let rs = self.query_vals(op, "", &sql, vec![arg]).await?;
        Ok(rs.iter().map(|r| r.get::<_, String>(0)).collect())
    }

    async fn list(&mut self, actor: &Actor, filter: &TodoFilter) -> Result<Vec<Todo>, Error> {
        let (sql, args) = SQL.list(actor, filter);
        let rs = self.query_vals("list_todos", "", &sql, args).await?;
        rs.iter().map(|r| rows::todo(r, 0)).collect()
    }

    async fn delete(&mut self, op: &str, id: &str) -> Result<(), Error> {
        self.execute(op, id, "DELETE FROM todos WHERE id = $1", &[&id])
            .await?;
        Ok(())
    }

    ops::queue_rows!();
}

impl Tx for PgTx<'_> {
    async fn clock(&mut self, caller: Millis) -> Result<Millis, Error> {
        self.db_now(caller).await
    }

    async fn try_sweep_lock(&mut self, op: &str, name: &str) -> Result<bool, Error> {
        let rs = self.query(op, name, TRY_SWEEP_LOCK, &[&name]).await?;
        rs.first()
            .and_then(|r| r.try_get::<_, bool>(0).ok())
            .ok_or_else(|| Error::internal(format!("{op} {name}: the sweep lock read no row")))
    }

    async fn lock_flow(&mut self) -> Result<(), Error> {
        self.execute("claim", "(flow)", FLOW_LOCK, &[])
            .await
            .map(drop)
    }

    async fn lock_sessions(&mut self, op: &str) -> Result<(), Error> {
        self.execute(
            op,
            "(sessions)",
            "SELECT pg_advisory_xact_lock('mcp_sessions'::regclass::oid::bigint)",
            &[],
        )
        .await
        .map(drop)
    }

    #[cfg(test)]
    async fn insert_attempt(&mut self, op: &str, a: &Attempt) -> Result<(), Error> {
        self.insert_attempt_row(op, a).await
    }

    async fn exec_sql(&mut self, sql: Sql<'_>, vals: Vec<Val>) -> Result<u64, Error> {
        self.exec(sql.op, sql.subject, sql.text, vals).await
    }

    async fn query_sql<T>(
        &mut self,
        sql: Sql<'_>,
        vals: Vec<Val>,
        f: Decode<T>,
    ) -> Result<Vec<T>, Error> {
        let rs = self.query_vals(sql.op, sql.subject, sql.text, vals).await?;
        rs.iter().map(|r| f(r)).collect()
    }

    async fn insert_endpoint(&mut self, e: &Endpoint) -> Result<bool, Error> {
        let op = "endpoint create";
        let vals = rows::endpoint_row(op, e)?;
        Ok(self.exec(op, &e.name, &SQL.insert_endpoint, vals).await? == 1)
    }

    async fn endpoint(&mut self, name: &str, lock: bool) -> Result<Option<Endpoint>, Error> {
        let op = "endpoint get";
        let sql = format!(
            "SELECT {ENDPOINT_COLS} FROM endpoints WHERE name = $1{}",
            if lock { " FOR UPDATE" } else { "" }
        );
        let rs = self.query(op, name, &sql, &[&name]).await?;
        rs.first().map(rows::endpoint).transpose()
    }

    async fn count_by_state(&mut self) -> Result<Vec<(String, u64)>, Error> {
        let op = "count todos";
        let rs = self
            .query(
                op,
                "",
                "SELECT state, COUNT(*) FROM todos GROUP BY state ORDER BY state",
                &[],
            )
            .await?;
        rs.iter()
            .map(|r| {
                let state: String = r
                    .try_get(0)
                    .map_err(|e| Error::internal(format!("{op}: {e}")))?;
                let n: i64 = r
                    .try_get(1)
                    .map_err(|e| Error::internal(format!("{op}: {e}")))?;
                Ok((state, u64::try_from(n).unwrap_or(0)))
            })
            .collect()
    }

    async fn endpoints(&mut self) -> Result<Vec<Endpoint>, Error> {
        let rs = self
            .query(
                "endpoint list",
                "",
                &format!("SELECT {ENDPOINT_COLS} FROM endpoints ORDER BY name"),
                &[],
            )
            .await?;
        rs.iter().map(rows::endpoint).collect()
    }

    async fn set_revoked(&mut self, name: &str, at: Millis) -> Result<(), Error> {
        let op = "endpoint revoke";
        self.execute(
            op,
            name,
            "UPDATE endpoints SET revoked_at = $2 WHERE name = $1",
            &[&name, &ms(op, at)?],
        )
        .await?;
        Ok(())
    }
}
