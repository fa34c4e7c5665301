//! The Board's tables: operators, their sessions, the overview's counts and the bulk actions.

use relay_core::Error;
use relay_core::Millis;
use relay_core::board::StateCount;
use relay_core::ledger::TokenHash;

use super::tx::{Sql, Tx, column, hash, millis, required, text, token_hash, unsigned};
use crate::store::rows::{self, Row, Val, time};
use crate::store::types::{BoardOverview, BoardSession, Bulk, BulkItem, BulkResult, Operator};

const OPERATOR_COLS: &str = "name, token_hash, created_at, revoked_at";

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
    if tx.exec_sql(Sql::new(op, name, &sql), vals).await? != 1 {
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
    tx.query_sql(Sql::new("operator list", "", &sql), vec![], operator_row)
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
        .query_sql(Sql::new(op, name, &sql), vec![text(name)], operator_row)
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
    tx.exec_sql(Sql::new(op, name, sql), vec![text(name), time(op, now)?])
        .await?;
    let sql = "DELETE FROM board_sessions WHERE operator = $1";
    tx.exec_sql(Sql::new(op, name, sql), vec![text(name)])
        .await?;
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
        .query_sql(
            Sql::new("board login", "", &sql),
            vec![hash(presented)],
            operator_row,
        )
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
    tx.exec_sql(Sql::new(op, operator, sql), vec![time(op, now)?])
        .await?;
    let sql = "INSERT INTO board_sessions (id_hash, operator, created_at, expires_at)
               VALUES ($1, $2, $3, $4)";
    let vals = vec![
        hash(id_hash),
        text(operator),
        time(op, now)?,
        time(op, expires_at)?,
    ];
    tx.exec_sql(Sql::new(op, operator, sql), vals).await?;
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
        .query_sql(
            Sql::new("board session", "", sql),
            vec![hash(id_hash)],
            |r| {
                let what = "a board session";
                Ok((
                    required(r.text(0), what)?,
                    millis(r.int(1), what)?.unwrap_or_default(),
                    millis(r.int(2), what)?,
                ))
            },
        )
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
    tx.exec_sql(Sql::new("board logout", "", sql), vec![hash(id_hash)])
        .await
        .map(drop)
}

/// What the overview reads, counted by the database: a few grouped sums and short lists,
/// never every todo. `relay_core::board` says what the sums mean.
pub(crate) async fn board_overview<T: Tx>(tx: &mut T, now: Millis) -> Result<BoardOverview, Error> {
    use relay_core::board::{OVERVIEW_DEAD_LETTERS, OVERVIEW_LIST, chart_since, died_outcomes};
    let op = "board overview";
    let todo_cols = rows::select_list("t", &rows::TODO_COLS);
    let limit = |n: usize| Val::Big(Some(i64::try_from(n).unwrap_or(i64::MAX)));
    let sql = "SELECT queue, state, COUNT(*), COUNT(next_retry_at), MIN(created_at),
               MIN(updated_at) FROM todos GROUP BY queue, state ORDER BY queue, state";
    let groups = tx
        .query_sql(Sql::new(op, "", sql), vec![], |r| {
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
                oldest_updated_at: millis(r.int(5), what)?,
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
        .query_sql(Sql::new(op, "", sql), vals, |r| {
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
        .query_sql(
            Sql::new(op, "", &sql),
            vec![limit(OVERVIEW_DEAD_LETTERS)],
            |r| rows::todo(r, 0),
        )
        .await?;
    let sql = format!(
        "SELECT {todo_cols} FROM todos t WHERE t.state = 'claimed'
           AND t.lease_expires_at IS NOT NULL ORDER BY t.lease_expires_at, t.id LIMIT $1"
    );
    let lapsing = tx
        .query_sql(Sql::new(op, "", &sql), vec![limit(OVERVIEW_LIST)], |r| {
            rows::todo(r, 0)
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
        .query_sql(Sql::new(op, "", &sql), vals, |r| {
            let n = unsigned(r.int(rows::TODO_COLS.len()), "a death count")?;
            Ok((rows::todo(r, 0)?, n))
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
    tx.exec_sql(Sql::new(op, &new.id, &sql), vals).await?;
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
        tx.exec_sql(Sql::new(op, &new.id, &sql), vals).await?;
    }
    Ok(())
}

/// A bulk action with every todo it listed (in id order), or `None`.
pub(crate) async fn bulk_get<T: Tx>(tx: &mut T, id: &str) -> Result<Option<Bulk>, Error> {
    let op = "board bulk";
    let sql = format!("SELECT {BULK_COLS} FROM board_bulk WHERE id = $1");
    let Some(mut bulk) = tx
        .query_sql(Sql::new(op, id, &sql), vec![text(id)], bulk_row)
        .await?
        .pop()
    else {
        return Ok(None);
    };
    let sql = format!(
        "SELECT {BULK_ITEM_COLS} FROM board_bulk_items WHERE bulk_id = $1 ORDER BY todo_id"
    );
    bulk.items = tx
        .query_sql(Sql::new(op, id, &sql), vec![text(id)], bulk_item_row)
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
        .exec_sql(
            Sql::new(op, id, sql),
            vec![time(op, now)?, text(id), text(operator)],
        )
        .await?;
    if changed == 1 {
        return Ok(());
    }
    let sql = format!("SELECT {BULK_COLS} FROM board_bulk WHERE id = $1");
    match tx
        .query_sql(Sql::new(op, id, &sql), vec![text(id)], bulk_row)
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
    tx.query_sql(Sql::new("board bulk resume", "", sql), vec![], |r| {
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
    r: &BulkResult,
) -> Result<bool, Error> {
    let op = "board bulk";
    let now = tx.clock(now).await?;
    let sql = "UPDATE board_bulk_items SET result = $1, note = $2, done_at = $3
               WHERE bulk_id = $4 AND todo_id = $5 AND result IS NULL";
    let vals = vec![
        text(if r.applied { "applied" } else { "skipped" }),
        Val::Text(r.note.clone()),
        time(op, now)?,
        text(id),
        text(&r.todo_id),
    ];
    Ok(tx.exec_sql(Sql::new(op, &r.todo_id, sql), vals).await? == 1)
}

/// Marks a bulk action finished (every listed todo has its result).
pub(crate) async fn bulk_finish<T: Tx>(tx: &mut T, now: Millis, id: &str) -> Result<(), Error> {
    let op = "board bulk";
    let now = tx.clock(now).await?;
    let sql = "UPDATE board_bulk SET finished_at = $1 WHERE id = $2 AND finished_at IS NULL";
    tx.exec_sql(Sql::new(op, id, sql), vec![time(op, now)?, text(id)])
        .await
        .map(drop)
}

/// What the todos kept in each queue have spent, summed (`/metrics`): queues that spent
/// nothing are absent. Counted by the database, one grouped sum.
pub(crate) async fn spend_by_queue<T: Tx>(
    tx: &mut T,
) -> Result<Vec<(String, relay_core::ledger::Usage)>, Error> {
    // Summed as bigint: Postgres' SUM of bigint is numeric.
    let sql = "SELECT queue, CAST(SUM(spent_cost_micros) AS bigint),
                      CAST(SUM(spent_input_tokens) AS bigint),
                      CAST(SUM(spent_output_tokens) AS bigint)
               FROM todos GROUP BY queue
               HAVING SUM(spent_cost_micros) > 0 OR SUM(spent_input_tokens) > 0
                   OR SUM(spent_output_tokens) > 0
               ORDER BY queue";
    tx.query_sql(Sql::new("spend by queue", "", sql), vec![], |r| {
        let what = "a queue's spend";
        Ok((
            required(r.text(0), what)?,
            relay_core::ledger::Usage {
                cost_micros: unsigned(r.int(1), what)?,
                input_tokens: unsigned(r.int(2), what)?,
                output_tokens: unsigned(r.int(3), what)?,
            },
        ))
    })
    .await
}
