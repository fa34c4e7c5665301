//! One operation's SQLite transaction: the ledger's rows and the store's own tables in SQL, on
//! the connection of the thread that runs it.

use std::sync::LazyLock;

use relay_core::Error;
use relay_core::Millis;
use relay_core::ledger::rows::{ClaimQuery, Loaded};
use relay_core::ledger::{
    Actor, Attempt, AttemptWrite, Change, Newest, Rows, Sweep, Todo, TodoFilter,
};
use rusqlite::{Connection, OptionalExtension, params};

use crate::store::ops::{self, Decode, Sql, Tx};
use crate::store::rows::{self, ENDPOINT_COLS, Val, ms};
use crate::store::types::Endpoint;

/// An SQL failure as the internal error it is, naming the operation and its todo.
pub(super) fn sql_err(op: &str, subject: &str, e: rusqlite::Error) -> Error {
    let what = match &e {
        rusqlite::Error::SqliteFailure(f, _)
            if f.extended_code == rusqlite::ffi::SQLITE_CONSTRAINT_UNIQUE
                && e.to_string().contains("todo_attempts.todo_id") =>
        {
            "a second open attempt was refused (a todo has at most one open attempt)"
        }
        rusqlite::Error::SqliteFailure(f, _) if f.code == rusqlite::ErrorCode::DatabaseBusy => {
            "the database stayed locked past the busy timeout; retry"
        }
        _ => "the SQLite store failed",
    };
    Error::internal(format!("{op} {subject}: {what}: {e}"))
}

/// One operation's view of the transaction its thread opened (a savepoint of the writer's
/// batch, or a reader's snapshot).
pub(crate) struct SqliteTx<'a> {
    pub(super) c: &'a Connection,
}

impl rows::Row for rusqlite::Row<'_> {
    fn text(&self, i: usize) -> Result<Option<String>, String> {
        self.get(i).map_err(|e| e.to_string())
    }
    fn int(&self, i: usize) -> Result<Option<i64>, String> {
        self.get(i).map_err(|e| e.to_string())
    }
    fn boolean(&self, i: usize) -> Result<bool, String> {
        self.get(i).map_err(|e| e.to_string())
    }
    fn bytes(&self, i: usize) -> Result<Option<Vec<u8>>, String> {
        self.get(i).map_err(|e| e.to_string())
    }
}

pub(super) static SQL: LazyLock<rows::Shared> = LazyLock::new(|| rows::Shared::new('?'));

static ENDPOINT_GET: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {ENDPOINT_COLS} FROM endpoints WHERE name = ?1"));
// A todo and its open attempt in one statement: the todo's columns, then the attempt's (NULL
// without one; two rows with two). One writer, so no row changes between the two reads that a
// join could mix up (unlike Postgres' `FOR UPDATE`, see `PgTx::load`). The id is cast for the
// reason `rows::Query::bind_text` gives: a bare `a.todo_id = t.id AND t.id = ?1` made SQLite
// re-prepare the cached join on every use.
pub(super) static LOAD: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {}, {} FROM todos t LEFT JOIN todo_attempts a \
         ON a.todo_id = t.id AND a.ended_at IS NULL WHERE t.id = CAST(?1 AS TEXT)",
        rows::select_list("t", &rows::TODO_COLS),
        rows::select_list("a", &rows::ATTEMPT_COLS)
    )
});

impl rows::ClaimReads for SqliteTx<'_> {
    type Todo = Todo;

    async fn places(&mut self, sql: Sql<'_>, vals: Vec<Val>) -> Result<Vec<rows::Place>, Error> {
        self.rows(sql.op, sql.subject, sql.text, &vals, |r| rows::place(r))
    }

    async fn todos(&mut self, sql: Sql<'_>, vals: Vec<Val>) -> Result<Vec<Todo>, Error> {
        self.rows(sql.op, sql.subject, sql.text, &vals, |r| rows::todo(r, 0))
    }

    fn id_of(t: &Todo) -> Option<&str> {
        Some(&t.id)
    }
}

impl SqliteTx<'_> {
    /// The open attempt of a todo; two open attempts are an internal error.
    fn open_attempt(&self, op: &str, id: &str) -> Result<Option<Attempt>, Error> {
        let mut st = self
            .c
            .prepare_cached(&SQL.open_attempt)
            .map_err(|e| sql_err(op, id, e))?;
        let mut rs = st.query(params![id]).map_err(|e| sql_err(op, id, e))?;
        let Some(row) = rs.next().map_err(|e| sql_err(op, id, e))? else {
            return Ok(None);
        };
        let open = rows::attempt(row, 0)?;
        if rs.next().map_err(|e| sql_err(op, id, e))?.is_some() {
            return Err(rows::two_open_attempts(op, id));
        }
        Ok(open)
    }
}

impl rusqlite::ToSql for Val {
    fn to_sql(&self) -> rusqlite::Result<rusqlite::types::ToSqlOutput<'_>> {
        use rusqlite::types::{ToSqlOutput, Value as Sql, ValueRef};
        Ok(match self {
            Val::Text(Some(s)) => ToSqlOutput::Borrowed(ValueRef::Text(s.as_bytes())),
            Val::Bytes(Some(b)) => ToSqlOutput::Borrowed(ValueRef::Blob(b)),
            Val::Text(None) | Val::Big(None) | Val::Bytes(None) => ToSqlOutput::Owned(Sql::Null),
            Val::Count(n) => ToSqlOutput::Owned(Sql::Integer(i64::from(*n))),
            Val::Big(Some(n)) => ToSqlOutput::Owned(Sql::Integer(*n)),
            Val::Bool(b) => ToSqlOutput::Owned(Sql::Integer(i64::from(*b))),
            Val::Texts(_) => {
                return Err(rusqlite::Error::ToSqlConversionFailure(
                    "SQLite binds a list one placeholder per entry".into(),
                ));
            }
        })
    }
}

impl SqliteTx<'_> {
    /// Runs one statement with the values bound in order; the rows it changed.
    fn exec(&self, op: &str, subject: &str, sql: &str, vals: &[Val]) -> Result<u64, Error> {
        let mut st = self
            .c
            .prepare_cached(sql)
            .map_err(|e| sql_err(op, subject, e))?;
        let n = st
            .execute(rusqlite::params_from_iter(vals))
            .map_err(|e| sql_err(op, subject, e))?;
        Ok(n as u64)
    }

    /// Runs one query with the values bound in order, each row through `f`.
    fn rows<T>(
        &self,
        op: &str,
        subject: &str,
        sql: &str,
        vals: &[Val],
        mut f: impl FnMut(&rusqlite::Row<'_>) -> Result<T, Error>,
    ) -> Result<Vec<T>, Error> {
        let mut st = self
            .c
            .prepare_cached(sql)
            .map_err(|e| sql_err(op, subject, e))?;
        let mut rs = st
            .query(rusqlite::params_from_iter(vals))
            .map_err(|e| sql_err(op, subject, e))?;
        let mut out = Vec::new();
        while let Some(row) = rs.next().map_err(|e| sql_err(op, subject, e))? {
            out.push(f(row)?);
        }
        Ok(out)
    }

    fn update_todo(&self, op: &str, t: &Todo) -> Result<(), Error> {
        if self.exec(op, &t.id, &SQL.update_todo, &rows::todo_update(op, t)?)? != 1 {
            return Err(Error::internal(format!(
                "{op} {}: the todo row vanished inside its transaction",
                t.id
            )));
        }
        Ok(())
    }

    fn insert_attempt_row(&self, op: &str, a: &Attempt) -> Result<(), Error> {
        let vals = rows::attempt_row(op, a)?;
        self.exec(op, &a.todo_id, &SQL.insert_attempt, &vals)
            .map(drop)
    }
}

impl Rows for SqliteTx<'_> {
    async fn load(&mut self, op: &str, id: &str) -> Result<Option<Loaded>, Error> {
        let mut st = self
            .c
            .prepare_cached(&LOAD)
            .map_err(|e| sql_err(op, id, e))?;
        let mut rs = st.query(params![id]).map_err(|e| sql_err(op, id, e))?;
        let Some(row) = rs.next().map_err(|e| sql_err(op, id, e))? else {
            return Ok(None);
        };
        let todo = rows::todo(row, 0)?;
        let open = rows::attempt(row, rows::TODO_COLS.len())?;
        if rs.next().map_err(|e| sql_err(op, id, e))?.is_some() {
            return Err(rows::two_open_attempts(op, id));
        }
        Ok(Some((todo, open)))
    }

    async fn next_claimable(&mut self, claim: &ClaimQuery<'_>) -> Result<Option<Loaded>, Error> {
        let found = rows::claimable(self, &SQL, claim, 1, "").await?;
        let Some(todo) = found.into_iter().next() else {
            return Ok(None);
        };
        let open = self.open_attempt(claim.op, &todo.id)?;
        Ok(Some((todo, open)))
    }

    async fn by_key(&mut self, endpoint: &str, key: &str) -> Result<Option<Todo>, Error> {
        let op = "add_todo";
        let vals = [
            Val::Text(Some(endpoint.into())),
            Val::Text(Some(key.into())),
        ];
        let found = self.rows(op, "(idempotency key)", &SQL.by_key, &vals, |r| {
            rows::todo(r, 0)
        })?;
        Ok(found.into_iter().next())
    }

    async fn insert_todo(&mut self, t: &Todo) -> Result<bool, Error> {
        let op = "add_todo";
        let vals = rows::todo_row(op, t)?;
        Ok(self.exec(op, &t.id, &SQL.insert_todo, &vals)? == 1)
    }

    async fn write(&mut self, op: &str, change: &Change) -> Result<Vec<u64>, Error> {
        let (todo, writes) = (&change.todo, &change.writes);
        // In order: SQLite checks the one-open-attempt index row by row, and a takeover's
        // change closes the dead attempt before it opens the next.
        self.update_todo(op, todo)?;
        let mut rows = Vec::with_capacity(writes.len());
        for w in writes {
            rows.push(match w {
                AttemptWrite::Open(a) => self.insert_attempt_row(op, a).map(|()| 1)?,
                AttemptWrite::Update(a) => {
                    let vals = rows::attempt_update(op, a)?;
                    self.exec(op, &a.todo_id, &SQL.update_open_attempt, &vals)?
                }
                AttemptWrite::PruneThrough(n) => {
                    let vals = [Val::Text(Some(todo.id.clone())), Val::Count(*n)];
                    self.exec(op, &todo.id, &SQL.prune, &vals).map(|_| 0)?
                }
                AttemptWrite::Amend(a) => self.exec(
                    op,
                    &a.todo_id,
                    &SQL.update_amend,
                    &rows::amend_update(op, a)?,
                )?,
            });
        }
        Ok(rows)
    }

    async fn attempts(&mut self, op: &str, id: &str, which: Newest) -> Result<Vec<Attempt>, Error> {
        let (sql, vals) = SQL.attempts_query(id, which);
        let rows = self.rows(op, id, sql, &vals, |r| rows::attempt(r, 0))?;
        Ok(rows.into_iter().flatten().collect())
    }

    async fn candidates(&mut self, sweep: Sweep<'_>) -> Result<Vec<String>, Error> {
        let op = "sweep";
        let (sql, arg) = SQL.sweep(op, sweep)?;
        let mut ids: Vec<String> = self.rows(op, "", &sql, &[arg], |r| {
            r.get(0).map_err(|e| sql_err(op, "", e))
        })?;
        // In id order, as the trait promises (ids sort bytewise in SQLite as in Rust), each
        // once (the requeue's two halves may both find one).
        ids.sort_unstable();
        ids.dedup();
        Ok(ids)
    }

    async fn list(&mut self, actor: &Actor, filter: &TodoFilter) -> Result<Vec<Todo>, Error> {
        let (sql, args) = SQL.list(actor, filter);
        self.rows("list_todos", "", &sql, &args, |r| rows::todo(r, 0))
    }

    async fn delete(&mut self, op: &str, id: &str) -> Result<(), Error> {
        let mut st = self
            .c
            .prepare_cached("DELETE FROM todos WHERE id = ?1")
            .map_err(|e| sql_err(op, id, e))?;
        st.execute(params![id]).map_err(|e| sql_err(op, id, e))?;
        Ok(())
    }

    ops::queue_rows!();
}

impl Tx for SqliteTx<'_> {
    async fn clock(&mut self, caller: Millis) -> Result<Millis, Error> {
        Ok(caller)
    }

    async fn try_sweep_lock(&mut self, _op: &str, _name: &str) -> Result<bool, Error> {
        // One writer (and `BEGIN IMMEDIATE` between processes): sweeps never overlap.
        Ok(true)
    }

    async fn lock_flow(&mut self) -> Result<(), Error> {
        // One writer: every write transaction is alone already.
        Ok(())
    }

    async fn lock_sessions(&mut self, _op: &str) -> Result<(), Error> {
        // One writer: every write transaction is alone already.
        Ok(())
    }

    #[cfg(test)]
    async fn insert_attempt(&mut self, op: &str, a: &Attempt) -> Result<(), Error> {
        self.insert_attempt_row(op, a)
    }

    async fn exec_sql(&mut self, sql: Sql<'_>, vals: Vec<Val>) -> Result<u64, Error> {
        let text = rows::numbered('?', sql.text);
        self.exec(sql.op, sql.subject, &text, &vals)
    }

    async fn query_sql<T>(
        &mut self,
        sql: Sql<'_>,
        vals: Vec<Val>,
        f: Decode<T>,
    ) -> Result<Vec<T>, Error> {
        let text = rows::numbered('?', sql.text);
        self.rows(sql.op, sql.subject, &text, &vals, |r| f(r))
    }

    async fn insert_endpoint(&mut self, e: &Endpoint) -> Result<bool, Error> {
        let op = "endpoint create";
        let vals = rows::endpoint_row(op, e)?;
        Ok(self.exec(op, &e.name, &SQL.insert_endpoint, &vals)? == 1)
    }

    async fn endpoint(&mut self, name: &str, _lock: bool) -> Result<Option<Endpoint>, Error> {
        // Every MCP request authenticates through here: a cached statement, not one prepared
        // per call.
        let op = "endpoint get";
        let mut st = self
            .c
            .prepare_cached(&ENDPOINT_GET)
            .map_err(|e| sql_err(op, name, e))?;
        st.query_row(params![name], |r| Ok(rows::endpoint(r)))
            .optional()
            .map_err(|e| sql_err(op, name, e))?
            .transpose()
    }

    async fn count_by_state(&mut self) -> Result<Vec<(String, u64)>, Error> {
        let op = "count todos";
        let sql = "SELECT state, COUNT(*) FROM todos GROUP BY state ORDER BY state";
        self.rows(op, "", sql, &[], |r| {
            let state: String = r.get(0).map_err(|e| sql_err(op, "", e))?;
            let n: i64 = r.get(1).map_err(|e| sql_err(op, "", e))?;
            Ok((state, u64::try_from(n).unwrap_or(0)))
        })
    }

    async fn endpoints(&mut self) -> Result<Vec<Endpoint>, Error> {
        let sql = format!("SELECT {ENDPOINT_COLS} FROM endpoints ORDER BY name");
        self.rows("endpoint list", "", &sql, &[], |r| rows::endpoint(r))
    }

    async fn set_revoked(&mut self, name: &str, at: Millis) -> Result<(), Error> {
        let op = "endpoint revoke";
        self.c
            .execute(
                "UPDATE endpoints SET revoked_at = ?2 WHERE name = ?1",
                params![name, ms(op, at)?],
            )
            .map_err(|e| sql_err(op, name, e))?;
        Ok(())
    }
}
