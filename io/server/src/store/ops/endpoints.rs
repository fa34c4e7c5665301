//! The endpoints table, the counts, the paused queues and the MCP sessions.

use relay_core::Error;
use relay_core::Millis;
#[cfg(test)]
use relay_core::ledger::Attempt;
use relay_core::ledger::{LedgerConfig, Op, Todo, TokenHash, run};

use super::tx::{Sql, Tx, hash, required, text, token_hash, unsigned};
use crate::store::rows::{Val, time};
use crate::store::types::{Endpoint, McpSessionNew, NewEndpoint};

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
    tx.exec_sql(Sql::new(op, name, sql), vec![text(name)])
        .await?;
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
    tx.exec_sql(Sql::new(op, &new.endpoint, sql), vec![time(op, cutoff)?])
        .await?;
    let sql = "SELECT count(*),
                      coalesce(sum(CASE WHEN endpoint = $1 THEN 1 ELSE 0 END), 0),
                      coalesce(sum(CASE WHEN endpoint = $1
                                         AND (stream_until IS NULL OR stream_until <= $2)
                                        THEN 1 ELSE 0 END), 0)
               FROM mcp_sessions";
    let vals = vec![text(&new.endpoint), time(op, now)?];
    let counts = tx
        .query_sql(Sql::new(op, &new.endpoint, sql), vals, |r| {
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
            .query_sql(Sql::new(op, &new.endpoint, sql), vals, |r| {
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
    tx.exec_sql(Sql::new(op, &new.endpoint, sql), vals).await?;
    Ok(ended)
}

/// How long ago a session of `endpoint` was recorded used, by the store's clock; `None` when
/// there is none (never made, ended, swept, or another endpoint's). With `idle`, a session
/// unused for that long counts as gone too (as in [`mcp_session_touch`]). Reads only: a request
/// checks its session with this, and records its use only when due
/// (`relay_core::limits::session_touch_every`).
pub(crate) async fn mcp_session_check<T: Tx>(
    tx: &mut T,
    now: Millis,
    id_hash: &TokenHash,
    endpoint: &str,
    idle: Option<Millis>,
) -> Result<Option<Millis>, Error> {
    let op = "session";
    let now = tx.clock(now).await?;
    let sql = "SELECT last_used_at FROM mcp_sessions WHERE id_hash = $1 AND endpoint = $2";
    let vals = vec![hash(id_hash), text(endpoint)];
    let used = tx
        .query_sql(Sql::new(op, endpoint, sql), vals, |r| {
            unsigned(r.int(0), "a session's last use")
        })
        .await?;
    let age = used.first().map(|&at| now.saturating_sub(at));
    Ok(age.filter(|&age| idle.is_none_or(|idle| age < idle)))
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
    Ok(tx.exec_sql(Sql::new(op, endpoint, sql), vals).await? == 1)
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
    tx.exec_sql(Sql::new("stream end", endpoint, sql), vals)
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
    Ok(tx
        .exec_sql(Sql::new("session end", endpoint, sql), vals)
        .await?
        == 1)
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
    tx.exec_sql(
        Sql::new(op, "", sql),
        vec![time(op, now.saturating_sub(idle))?],
    )
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
    tx.query_sql(Sql::new(op, endpoint, sql), vals, |r| {
        let what = "a queue count";
        Ok((
            required(r.text(0), what)?,
            required(r.text(1), what)?,
            unsigned(r.int(2), what)?,
        ))
    })
    .await
}
