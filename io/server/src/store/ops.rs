//! The store's own operations over a backend's transaction: the endpoints table and the
//! counts. The ledger's operations are `relay_core::ledger::run` over the same transaction, which
//! each backend offers as [`Rows`]; nothing here decides a lifecycle rule.

use relay_core::Error;
use relay_core::Millis;
#[cfg(test)]
use relay_core::ledger::Attempt;
use relay_core::ledger::{LedgerConfig, Op, Rows, Todo, run};

use relay_core::ledger::TokenHash;

use super::rows::{Row, Val, ms};
use relay_core::board::StateCount;

use super::types::{
    BoardOverview, BoardSession, Bulk, BulkItem, Endpoint, McpSessionNew, NewEndpoint, Operator,
};

/// Whether a transaction writes (SQLite `BEGIN IMMEDIATE`) or only reads (a consistent snapshot).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TxKind {
    Write,
    Read,
}

impl TxKind {
    pub(crate) fn of(op: &Op) -> TxKind {
        if op.writes() {
            TxKind::Write
        } else {
            TxKind::Read
        }
    }
}

/// One backend transaction: the ledger's rows, and the store's own tables.
pub(crate) trait Tx: Rows {
    /// The time this transaction's rules read, given the caller's: SQLite keeps the caller's
    /// (one process, one clock); Postgres reads the database's (see `PgTx::db_now`), so that
    /// several servers on one database compute every lease from one clock.
    async fn clock(&mut self, caller: Millis) -> Result<Millis, Error>;
    /// Serialises session admissions until the transaction ends, so that the caps hold across
    /// servers (SQLite's single writer already does; Postgres takes a transaction lock).
    async fn lock_sessions(&mut self, op: &str) -> Result<(), Error>;
    /// Whether this transaction may run background sweep `name`: `false` while another server
    /// runs it (Postgres' try-lock, see `postgres::tx::TRY_SWEEP_LOCK`); always `true` on SQLite.
    async fn try_sweep_lock(&mut self, op: &str, name: &str) -> Result<bool, Error>;
    /// Inserts an attempt as it is (tests plant broken rows with it).
    #[cfg(test)]
    async fn insert_attempt(&mut self, op: &str, a: &Attempt) -> Result<(), Error>;
    /// How many todos are in each state (states with none are absent).
    async fn count_by_state(&mut self) -> Result<Vec<(String, u64)>, Error>;

    async fn insert_endpoint(&mut self, e: &Endpoint) -> Result<bool, Error>;
    async fn endpoint(&mut self, name: &str, lock: bool) -> Result<Option<Endpoint>, Error>;
    async fn endpoints(&mut self) -> Result<Vec<Endpoint>, Error>;
    async fn set_revoked(&mut self, name: &str, at: Millis) -> Result<(), Error>;

    /// One statement over the store's own tables, written with `$N` placeholders (see
    /// `rows::numbered`); the rows it changed.
    async fn exec_sql(
        &mut self,
        op: &str,
        subject: &str,
        sql: &str,
        vals: Vec<Val>,
    ) -> Result<u64, Error>;
    /// One query over the store's own tables (`$N` placeholders), each row decoded by `f`.
    async fn query_sql<T>(
        &mut self,
        op: &str,
        subject: &str,
        sql: &str,
        vals: Vec<Val>,
        f: fn(&dyn Row) -> Result<T, Error>,
    ) -> Result<Vec<T>, Error>;
}

pub(crate) async fn count_by_state<T: Tx>(tx: &mut T) -> Result<Vec<(String, u64)>, Error> {
    tx.count_by_state().await
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
    let now = tx.clock(now).await?;
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
    cfg: &LedgerConfig,
    now: Millis,
    name: &str,
) -> Result<(Endpoint, Vec<Todo>), Error> {
    let op = "endpoint revoke";
    // It closes attempts: their end is stamped by the clock that decides leases.
    let now = tx.clock(now).await?;
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
    // Its requests are refused 401 from now on; its sessions go with it, on every server.
    let sql = "DELETE FROM mcp_sessions WHERE endpoint = $1";
    tx.exec_sql(op, name, sql, vec![text(name)]).await?;
    e.revoked_at = Some(now);
    let revoke = Op::RevokeEndpoint {
        now,
        endpoint: name.to_string(),
    };
    let todos = run(tx, cfg, revoke).await?.todos()?;
    Ok((e, todos))
}

/// Inserts an attempt as it is, without any transition: only for tests that plant a broken row
/// to prove the database refuses it.
#[cfg(test)]
pub(crate) async fn plant_attempt<T: Tx>(tx: &mut T, a: &Attempt) -> Result<(), Error> {
    tx.insert_attempt("plant", a).await
}

fn text(s: &str) -> Val {
    Val::Text(Some(s.to_string()))
}

fn time(op: &str, at: Millis) -> Result<Val, Error> {
    Ok(Val::Big(Some(ms(op, at)?)))
}

fn hash(h: &TokenHash) -> Val {
    Val::Bytes(Some(h.0.to_vec()))
}

fn column<T>(r: Result<Option<T>, String>, what: &str) -> Result<Option<T>, Error> {
    r.map_err(|e| Error::internal(format!("reading {what} from the store: {e}")))
}

fn required<T>(r: Result<Option<T>, String>, what: &str) -> Result<T, Error> {
    column(r, what)?.ok_or_else(|| Error::internal(format!("reading {what}: a NULL column")))
}

fn millis(r: Result<Option<i64>, String>, what: &str) -> Result<Option<Millis>, Error> {
    column(r, what)?
        .map(|v| Millis::try_from(v).map_err(|e| Error::internal(format!("reading {what}: {e}"))))
        .transpose()
}

const OPERATOR_COLS: &str = "name, token_hash, created_at, revoked_at";

/// Column `i` of `r` as a SHA-256 (a token's or a session id's).
fn token_hash(r: &dyn Row, i: usize, what: &str) -> Result<TokenHash, Error> {
    let bytes = required(r.bytes(i), what)?;
    <[u8; 32]>::try_from(bytes.as_slice())
        .map(TokenHash)
        .map_err(|_| Error::internal(format!("reading {what}: a hash is not 32 bytes")))
}

fn operator_row(r: &dyn Row) -> Result<Operator, Error> {
    let what = "an operator";
    Ok(Operator {
        name: required(r.text(0), what)?,
        token_hash: token_hash(r, 1, what)?,
        created_at: millis(r.int(2), what)?.unwrap_or_default(),
        revoked_at: millis(r.int(3), what)?,
    })
}

pub(crate) async fn operator_create<T: Tx>(
    tx: &mut T,
    now: Millis,
    name: &str,
    token_hash: TokenHash,
) -> Result<Operator, Error> {
    let op = "operator create";
    relay_core::board::check_operator_name(op, name)?;
    let now = tx.clock(now).await?;
    let sql = format!(
        "INSERT INTO operators ({OPERATOR_COLS}) VALUES ($1, $2, $3, NULL) ON CONFLICT DO NOTHING"
    );
    let vals = vec![text(name), hash(&token_hash), time(op, now)?];
    if tx.exec_sql(op, name, &sql, vals).await? != 1 {
        return Err(Error::conflict(format!(
            "{op} {name}: an operator with this name exists; choose another name"
        )));
    }
    Ok(Operator {
        name: name.to_string(),
        token_hash,
        created_at: now,
        revoked_at: None,
    })
}

pub(crate) async fn operators<T: Tx>(tx: &mut T) -> Result<Vec<Operator>, Error> {
    let sql = format!("SELECT {OPERATOR_COLS} FROM operators ORDER BY name");
    tx.query_sql("operator list", "", &sql, vec![], operator_row)
        .await
}

/// Marks the operator revoked and ends its sessions, in one transaction.
pub(crate) async fn operator_revoke<T: Tx>(
    tx: &mut T,
    now: Millis,
    name: &str,
) -> Result<Operator, Error> {
    let op = "operator revoke";
    let now = tx.clock(now).await?;
    let sql = format!("SELECT {OPERATOR_COLS} FROM operators WHERE name = $1");
    let Some(mut o) = tx
        .query_sql(op, name, &sql, vec![text(name)], operator_row)
        .await?
        .pop()
    else {
        return Err(Error::not_found(format!(
            "{op} {name}: no such operator; `relay operator list` shows them"
        )));
    };
    if let Some(at) = o.revoked_at {
        return Err(Error::conflict(format!(
            "{op} {name}: already revoked (at {}); nothing to do",
            relay_core::time::rfc3339(at)
        )));
    }
    let sql = "UPDATE operators SET revoked_at = $2 WHERE name = $1";
    tx.exec_sql(op, name, sql, vec![text(name), time(op, now)?])
        .await?;
    let sql = "DELETE FROM board_sessions WHERE operator = $1";
    tx.exec_sql(op, name, sql, vec![text(name)]).await?;
    o.revoked_at = Some(now);
    Ok(o)
}

/// The active operator whose token hashes to `presented`, if any.
pub(crate) async fn operator_by_token<T: Tx>(
    tx: &mut T,
    presented: &TokenHash,
) -> Result<Option<Operator>, Error> {
    let sql = format!(
        "SELECT {OPERATOR_COLS} FROM operators WHERE token_hash = $1 AND revoked_at IS NULL"
    );
    let found = tx
        .query_sql("board login", "", &sql, vec![hash(presented)], operator_row)
        .await?;
    // The index found the row; compare again in constant time, as endpoints do.
    Ok(found
        .into_iter()
        .find(|o| relay_core::board::hash_matches(&o.token_hash, presented)))
}

pub(crate) async fn session_create<T: Tx>(
    tx: &mut T,
    now: Millis,
    id_hash: &TokenHash,
    operator: &str,
) -> Result<BoardSession, Error> {
    let op = "board login";
    let now = tx.clock(now).await?;
    let expires_at = now.saturating_add(relay_core::board::SESSION_TTL);
    // Expired sessions of anyone are deleted on the way, so the table holds live ones only.
    let sql = "DELETE FROM board_sessions WHERE expires_at <= $1";
    tx.exec_sql(op, operator, sql, vec![time(op, now)?]).await?;
    let sql = "INSERT INTO board_sessions (id_hash, operator, created_at, expires_at)
               VALUES ($1, $2, $3, $4)";
    let vals = vec![
        hash(id_hash),
        text(operator),
        time(op, now)?,
        time(op, expires_at)?,
    ];
    tx.exec_sql(op, operator, sql, vals).await?;
    Ok(BoardSession {
        operator: operator.to_string(),
        expires_at,
    })
}

/// The session whose secret hashes to `id_hash`, when it is live at `now`.
pub(crate) async fn session_get<T: Tx>(
    tx: &mut T,
    now: Millis,
    id_hash: &TokenHash,
) -> Result<Option<BoardSession>, Error> {
    let now = tx.clock(now).await?;
    let sql = "SELECT s.operator, s.expires_at, o.revoked_at FROM board_sessions s
               JOIN operators o ON o.name = s.operator WHERE s.id_hash = $1";
    let found = tx
        .query_sql("board session", "", sql, vec![hash(id_hash)], |r| {
            let what = "a board session";
            Ok((
                required(r.text(0), what)?,
                millis(r.int(1), what)?.unwrap_or_default(),
                millis(r.int(2), what)?,
            ))
        })
        .await?;
    Ok(found
        .into_iter()
        .find_map(|(operator, expires_at, revoked)| {
            relay_core::board::session_live(now, expires_at, revoked.is_some()).then_some(
                BoardSession {
                    operator,
                    expires_at,
                },
            )
        }))
}

pub(crate) async fn session_delete<T: Tx>(tx: &mut T, id_hash: &TokenHash) -> Result<(), Error> {
    let sql = "DELETE FROM board_sessions WHERE id_hash = $1";
    tx.exec_sql("board logout", "", sql, vec![hash(id_hash)])
        .await
        .map(drop)
}

pub(crate) async fn paused_queues<T: Tx>(tx: &mut T) -> Result<Vec<String>, Error> {
    let sql = "SELECT queue FROM paused_queues ORDER BY queue";
    tx.query_sql("paused_queues", "", sql, vec![], |r| {
        required(r.text(0), "a paused queue")
    })
    .await
}

pub(crate) async fn set_paused<T: Tx>(
    tx: &mut T,
    now: Millis,
    queue: &str,
    paused: bool,
) -> Result<(), Error> {
    let (op, sql, vals) = if paused {
        let sql = "INSERT INTO paused_queues (queue, paused_at) VALUES ($1, $2)
                   ON CONFLICT (queue) DO NOTHING";
        ("pause", sql, vec![text(queue), time("pause", now)?])
    } else {
        let sql = "DELETE FROM paused_queues WHERE queue = $1";
        ("resume", sql, vec![text(queue)])
    };
    tx.exec_sql(op, queue, sql, vals).await.map(drop)
}

// ---- MCP sessions ----------------------------------------------------------------------------

/// Opens an MCP session: admitted against the caps counted over the live sessions in the store
/// (shared by every server on it), after forgetting the idle ones. At the endpoint's cap it ends
/// the endpoint's least recently used sessions that hold no doorbell stream, as many as
/// `relay_core::limits::admit_session` says; the ones it ended are the answer.
pub(crate) async fn mcp_session_open<T: Tx>(
    tx: &mut T,
    now: Millis,
    new: &McpSessionNew,
) -> Result<Vec<TokenHash>, Error> {
    let op = "initialize";
    let now = tx.clock(now).await?;
    tx.lock_sessions(op).await?;
    let cutoff = now.saturating_sub(new.idle);
    let sql = "DELETE FROM mcp_sessions WHERE last_used_at <= $1";
    tx.exec_sql(op, &new.endpoint, sql, vec![time(op, cutoff)?])
        .await?;
    let sql = "SELECT count(*),
                      coalesce(sum(CASE WHEN endpoint = $1 THEN 1 ELSE 0 END), 0),
                      coalesce(sum(CASE WHEN endpoint = $1
                                         AND (stream_until IS NULL OR stream_until <= $2)
                                        THEN 1 ELSE 0 END), 0)
               FROM mcp_sessions";
    let vals = vec![text(&new.endpoint), time(op, now)?];
    let counts = tx
        .query_sql(op, &new.endpoint, sql, vals, |r| {
            let n = |i| -> Result<usize, Error> {
                let v = required(r.int(i), "a session count")?;
                Ok(usize::try_from(v).unwrap_or(0))
            };
            Ok((n(0)?, n(1)?, n(2)?))
        })
        .await?;
    let (total, mine, streamless) = counts.first().copied().unwrap_or((0, 0, 0));
    let end = relay_core::limits::admit_session(&new.caps, total, mine, streamless)
        .map_err(Error::conflict)?;
    let mut ended = Vec::new();
    if end > 0 {
        let sql = "DELETE FROM mcp_sessions WHERE id_hash IN (
                       SELECT id_hash FROM mcp_sessions
                       WHERE endpoint = $1 AND (stream_until IS NULL OR stream_until <= $2)
                       ORDER BY last_used_at, id_hash LIMIT $3)
                   RETURNING id_hash";
        let vals = vec![
            text(&new.endpoint),
            time(op, now)?,
            Val::Big(Some(i64::try_from(end).unwrap_or(i64::MAX))),
        ];
        ended = tx
            .query_sql(op, &new.endpoint, sql, vals, |r| {
                token_hash(r, 0, "an ended session")
            })
            .await?;
    }
    let sql = "INSERT INTO mcp_sessions (id_hash, endpoint, protocol, created_at, last_used_at)
               VALUES ($1, $2, $3, $4, $4)";
    let vals = vec![
        hash(&new.id_hash),
        text(&new.endpoint),
        text(&new.protocol),
        time(op, now)?,
    ];
    tx.exec_sql(op, &new.endpoint, sql, vals).await?;
    Ok(ended)
}

/// Marks a session of `endpoint` used at `now`; `false` when there is none (never made, ended,
/// swept, or another endpoint's). With `idle`, a session unused for that long counts as gone
/// too; without, its doorbell stream is open on the calling server: it is kept alive whatever
/// its age, and noted as holding a stream for [`relay_core::limits::STREAM_HOLD`].
pub(crate) async fn mcp_session_touch<T: Tx>(
    tx: &mut T,
    now: Millis,
    id_hash: &TokenHash,
    endpoint: &str,
    idle: Option<Millis>,
) -> Result<bool, Error> {
    let op = "session";
    let now = tx.clock(now).await?;
    let (sql, cutoff) = match idle {
        Some(idle) => (
            "UPDATE mcp_sessions SET last_used_at = $3
             WHERE id_hash = $1 AND endpoint = $2 AND last_used_at > $4",
            now.saturating_sub(idle),
        ),
        None => (
            "UPDATE mcp_sessions SET last_used_at = $3, stream_until = $4
             WHERE id_hash = $1 AND endpoint = $2",
            now.saturating_add(relay_core::limits::STREAM_HOLD),
        ),
    };
    let vals = vec![
        hash(id_hash),
        text(endpoint),
        time(op, now)?,
        time(op, cutoff)?,
    ];
    Ok(tx.exec_sql(op, endpoint, sql, vals).await? == 1)
}

/// Notes that a session's doorbell stream ended (its client went): it may be ended for room
/// again at once, not only when the note lapses.
pub(crate) async fn mcp_session_stream_end<T: Tx>(
    tx: &mut T,
    id_hash: &TokenHash,
    endpoint: &str,
) -> Result<(), Error> {
    let sql = "UPDATE mcp_sessions SET stream_until = NULL WHERE id_hash = $1 AND endpoint = $2";
    let vals = vec![hash(id_hash), text(endpoint)];
    tx.exec_sql("stream end", endpoint, sql, vals)
        .await
        .map(drop)
}

/// Ends a session of `endpoint` (DELETE); `false` when there was none.
pub(crate) async fn mcp_session_end<T: Tx>(
    tx: &mut T,
    id_hash: &TokenHash,
    endpoint: &str,
) -> Result<bool, Error> {
    let sql = "DELETE FROM mcp_sessions WHERE id_hash = $1 AND endpoint = $2";
    let vals = vec![hash(id_hash), text(endpoint)];
    Ok(tx.exec_sql("session end", endpoint, sql, vals).await? == 1)
}

/// Forgets every session unused for `idle`; how many went.
pub(crate) async fn mcp_session_sweep<T: Tx>(
    tx: &mut T,
    now: Millis,
    idle: Millis,
) -> Result<u64, Error> {
    let op = "session sweep";
    if !tx.try_sweep_lock(op, "sessions").await? {
        return Ok(0);
    }
    let now = tx.clock(now).await?;
    let sql = "DELETE FROM mcp_sessions WHERE last_used_at <= $1";
    tx.exec_sql(op, "", sql, vec![time(op, now.saturating_sub(idle))?])
        .await
}

/// An endpoint's todos counted by queue and state, for the queue resources
/// (`relay_core::mcp::listen`): one queue's, or every queue's the endpoint has todos in.
pub(crate) async fn queue_counts<T: Tx>(
    tx: &mut T,
    endpoint: &str,
    queue: Option<&str>,
) -> Result<Vec<(String, String, u64)>, Error> {
    let op = "queue counts";
    let (sql, vals) = match queue {
        Some(q) => (
            "SELECT queue, state, COUNT(*) FROM todos WHERE endpoint = $1 AND queue = $2
             GROUP BY queue, state ORDER BY queue, state",
            vec![text(endpoint), text(q)],
        ),
        None => (
            "SELECT queue, state, COUNT(*) FROM todos WHERE endpoint = $1
             GROUP BY queue, state ORDER BY queue, state",
            vec![text(endpoint)],
        ),
    };
    tx.query_sql(op, endpoint, sql, vals, |r| {
        let what = "a queue count";
        Ok((
            required(r.text(0), what)?,
            required(r.text(1), what)?,
            unsigned(r.int(2), what)?,
        ))
    })
    .await
}

/// What the overview reads, counted by the database: a few grouped sums and short lists,
/// never every todo. `relay_core::board` says what the sums mean.
pub(crate) async fn board_overview<T: Tx>(tx: &mut T, now: Millis) -> Result<BoardOverview, Error> {
    use relay_core::board::{OVERVIEW_DEAD_LETTERS, OVERVIEW_LIST, chart_since, died_outcomes};
    let op = "board overview";
    let todo_cols = super::rows::select_list("t", &super::rows::TODO_COLS);
    let limit = |n: usize| Val::Big(Some(i64::try_from(n).unwrap_or(i64::MAX)));
    let sql = "SELECT queue, state, COUNT(*), COUNT(next_retry_at), MIN(created_at) FROM todos
               GROUP BY queue, state ORDER BY queue, state";
    let groups = tx
        .query_sql(op, "", sql, vec![], |r| {
            let what = "a todo count";
            let state: String = required(r.text(1), what)?;
            Ok(StateCount {
                queue: required(r.text(0), what)?,
                state: relay_core::ledger::TodoState::parse(&state).ok_or_else(|| {
                    Error::internal(format!("reading {what}: unknown state {state:?}"))
                })?,
                todos: unsigned(r.int(2), what)?,
                retry_scheduled: unsigned(r.int(3), what)?,
                oldest_created_at: millis(r.int(4), what)?,
            })
        })
        .await?;
    // Minutes are numbered as relay_core::board::chart reads them: ended_at / MINUTE.
    let sql = "SELECT ended_at / $2, outcome, COUNT(*) FROM todo_attempts
               WHERE ended_at >= $1 GROUP BY 1, 2 ORDER BY 1, 2";
    let vals = vec![
        time(op, chart_since(now))?,
        time(op, relay_core::time::MINUTE)?,
    ];
    let closed = tx
        .query_sql(op, "", sql, vals, |r| {
            let what = "a closed-attempt count";
            Ok((
                unsigned(r.int(0), what)?,
                required(r.text(1), what)?,
                unsigned(r.int(2), what)?,
            ))
        })
        .await?;
    // mirrors Todo::dead_letter (failed, no retry scheduled); the newest first.
    let sql = format!(
        "SELECT {todo_cols} FROM todos t WHERE t.state = 'failed' AND t.next_retry_at IS NULL
         ORDER BY t.updated_at DESC, t.id LIMIT $1"
    );
    let dead_letters = tx
        .query_sql(op, "", &sql, vec![limit(OVERVIEW_DEAD_LETTERS)], |r| {
            super::rows::todo(r, 0)
        })
        .await?;
    let sql = format!(
        "SELECT {todo_cols} FROM todos t WHERE t.state = 'claimed'
           AND t.lease_expires_at IS NOT NULL ORDER BY t.lease_expires_at, t.id LIMIT $1"
    );
    let lapsing = tx
        .query_sql(op, "", &sql, vec![limit(OVERVIEW_LIST)], |r| {
            super::rows::todo(r, 0)
        })
        .await?;
    // Which outcomes are deaths is core's rule; the database only counts them.
    let died = died_outcomes();
    let marks: Vec<String> = (1..=died.len()).map(|i| format!("${i}")).collect();
    let sql = format!(
        "SELECT {todo_cols}, d.n FROM todos t JOIN (SELECT todo_id, COUNT(*) AS n
           FROM todo_attempts WHERE outcome IN ({}) GROUP BY todo_id HAVING COUNT(*) > 1) d
           ON d.todo_id = t.id ORDER BY d.n DESC, t.id LIMIT ${}",
        marks.join(", "),
        died.len() + 1
    );
    let mut vals: Vec<Val> = died.iter().map(|o| text(o)).collect();
    vals.push(limit(OVERVIEW_LIST));
    let died_again = tx
        .query_sql(op, "", &sql, vals, |r| {
            let n = unsigned(r.int(super::rows::TODO_COLS.len()), "a death count")?;
            Ok((super::rows::todo(r, 0)?, n))
        })
        .await?;
    Ok(BoardOverview {
        groups,
        closed,
        dead_letters,
        lapsing,
        died_again,
    })
}

fn unsigned(r: Result<Option<i64>, String>, what: &str) -> Result<u64, Error> {
    let n = required(r, what)?;
    u64::try_from(n).map_err(|e| Error::internal(format!("reading {what}: {e}")))
}

// The Board's bulk actions (`relay_core::board::bulk_step` decides each todo; these only keep
// the record).

const BULK_COLS: &str =
    "id, operator, queue, action, filter, created_at, confirmed_at, finished_at";
const BULK_ITEM_COLS: &str = "todo_id, listed_state, listed_attempts, result, note";
/// Items one INSERT writes: 100 rows of 4 values stays far below either backend's parameter cap.
const BULK_INSERT_ROWS: usize = 100;

fn bulk_row(r: &dyn Row) -> Result<Bulk, Error> {
    let what = "a bulk action";
    let action = required(r.text(3), what)?;
    Ok(Bulk {
        id: required(r.text(0), what)?,
        operator: required(r.text(1), what)?,
        queue: required(r.text(2), what)?,
        action: relay_core::board::BulkAction::parse(&action)
            .ok_or_else(|| Error::internal(format!("reading {what}: action {action:?}")))?,
        filter: required(r.text(4), what)?,
        created_at: millis(r.int(5), what)?.unwrap_or_default(),
        confirmed_at: millis(r.int(6), what)?,
        finished_at: millis(r.int(7), what)?,
        items: Vec::new(),
    })
}

fn bulk_item_row(r: &dyn Row) -> Result<BulkItem, Error> {
    let what = "a bulk action's todo";
    let state = required(r.text(1), what)?;
    let attempts = required(r.int(2), what)?;
    Ok(BulkItem {
        todo_id: required(r.text(0), what)?,
        listed: relay_core::board::Listed {
            state: relay_core::ledger::TodoState::parse(&state)
                .ok_or_else(|| Error::internal(format!("reading {what}: state {state:?}")))?,
            attempts_total: u32::try_from(attempts)
                .map_err(|e| Error::internal(format!("reading {what}: {e}")))?,
        },
        applied: column(r.text(3), what)?.map(|v| v == "applied"),
        note: column(r.text(4), what)?,
    })
}

/// Records a bulk action, not yet confirmed, with every todo it lists as it stands.
pub(crate) async fn bulk_create<T: Tx>(tx: &mut T, now: Millis, new: &Bulk) -> Result<(), Error> {
    let op = "board bulk";
    let now = tx.clock(now).await?;
    let sql =
        format!("INSERT INTO board_bulk ({BULK_COLS}) VALUES ($1, $2, $3, $4, $5, $6, NULL, NULL)");
    let vals = vec![
        text(&new.id),
        text(&new.operator),
        text(&new.queue),
        text(new.action.as_str()),
        text(&new.filter),
        time(op, now)?,
    ];
    tx.exec_sql(op, &new.id, &sql, vals).await?;
    for chunk in new.items.chunks(BULK_INSERT_ROWS) {
        let mut sql = String::from(
            "INSERT INTO board_bulk_items (bulk_id, todo_id, listed_state, listed_attempts) VALUES ",
        );
        let mut vals = Vec::with_capacity(chunk.len() * 4);
        for (k, item) in chunk.iter().enumerate() {
            let n = k * 4;
            if k > 0 {
                sql.push_str(", ");
            }
            sql.push_str(&format!("(${}, ${}, ${}, ${})", n + 1, n + 2, n + 3, n + 4));
            vals.extend([
                text(&new.id),
                text(&item.todo_id),
                text(item.listed.state.as_str()),
                Val::Count(item.listed.attempts_total),
            ]);
        }
        tx.exec_sql(op, &new.id, &sql, vals).await?;
    }
    Ok(())
}

/// A bulk action with every todo it listed (in id order), or `None`.
pub(crate) async fn bulk_get<T: Tx>(tx: &mut T, id: &str) -> Result<Option<Bulk>, Error> {
    let op = "board bulk";
    let sql = format!("SELECT {BULK_COLS} FROM board_bulk WHERE id = $1");
    let Some(mut bulk) = tx
        .query_sql(op, id, &sql, vec![text(id)], bulk_row)
        .await?
        .pop()
    else {
        return Ok(None);
    };
    let sql = format!(
        "SELECT {BULK_ITEM_COLS} FROM board_bulk_items WHERE bulk_id = $1 ORDER BY todo_id"
    );
    bulk.items = tx
        .query_sql(op, id, &sql, vec![text(id)], bulk_item_row)
        .await?;
    Ok(Some(bulk))
}

/// Confirms a bulk action for `operator` (only the one who asked for it may); from then on a
/// server applies it, and resumes it after a stop. Confirming twice changes nothing.
pub(crate) async fn bulk_confirm<T: Tx>(
    tx: &mut T,
    now: Millis,
    id: &str,
    operator: &str,
) -> Result<(), Error> {
    let op = "board bulk confirm";
    let now = tx.clock(now).await?;
    let sql = "UPDATE board_bulk SET confirmed_at = $1
               WHERE id = $2 AND operator = $3 AND confirmed_at IS NULL";
    let changed = tx
        .exec_sql(op, id, sql, vec![time(op, now)?, text(id), text(operator)])
        .await?;
    if changed == 1 {
        return Ok(());
    }
    let sql = format!("SELECT {BULK_COLS} FROM board_bulk WHERE id = $1");
    match tx
        .query_sql(op, id, &sql, vec![text(id)], bulk_row)
        .await?
        .pop()
    {
        None => Err(Error::not_found(format!("{op}: no bulk action {id}"))),
        Some(b) if b.operator != operator => Err(Error::forbidden(format!(
            "{op}: bulk action {id} is {}'s to confirm; make your own from the queue page",
            b.operator
        ))),
        Some(_) => Ok(()),
    }
}

/// The confirmed bulk actions not yet finished, oldest first: what a starting server resumes.
pub(crate) async fn bulk_open<T: Tx>(tx: &mut T) -> Result<Vec<String>, Error> {
    let sql = "SELECT id FROM board_bulk
               WHERE finished_at IS NULL AND confirmed_at IS NOT NULL ORDER BY created_at, id";
    tx.query_sql("board bulk resume", "", sql, vec![], |r| {
        required(r.text(0), "a bulk action's id")
    })
    .await
}

/// Records what became of one listed todo; `false` when it was recorded already (another
/// server resuming the same action got there first).
pub(crate) async fn bulk_record<T: Tx>(
    tx: &mut T,
    now: Millis,
    id: &str,
    todo_id: &str,
    applied: bool,
    note: Option<&str>,
) -> Result<bool, Error> {
    let op = "board bulk";
    let now = tx.clock(now).await?;
    let sql = "UPDATE board_bulk_items SET result = $1, note = $2, done_at = $3
               WHERE bulk_id = $4 AND todo_id = $5 AND result IS NULL";
    let vals = vec![
        text(if applied { "applied" } else { "skipped" }),
        Val::Text(note.map(str::to_string)),
        time(op, now)?,
        text(id),
        text(todo_id),
    ];
    Ok(tx.exec_sql(op, todo_id, sql, vals).await? == 1)
}

/// Marks a bulk action finished (every listed todo has its result).
pub(crate) async fn bulk_finish<T: Tx>(tx: &mut T, now: Millis, id: &str) -> Result<(), Error> {
    let op = "board bulk";
    let now = tx.clock(now).await?;
    let sql = "UPDATE board_bulk SET finished_at = $1 WHERE id = $2 AND finished_at IS NULL";
    tx.exec_sql(op, id, sql, vec![time(op, now)?, text(id)])
        .await
        .map(drop)
}
