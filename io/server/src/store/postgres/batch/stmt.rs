//! The statements of a batch's round trips: how each is bound and sent, and the ones the batch
//! builds (its first statements, the reads of many rows at once, a claim scope's read).

use std::future::Future;
use std::pin::Pin;

use deadpool_postgres::ClientWrapper;
use relay_core::Error;
use tokio_postgres::Statement;
use tokio_postgres::types::ToSql;

use crate::store::postgres::encode::{n32, pg_err};
use crate::store::postgres::tx::{CHANGE_LOCK_SHARED, CLAIM_LOCK, CLAIM_PLAN, SQL};
use crate::store::rows::{self, ClaimQuery, Val};

/// One statement of a round trip.
pub(super) struct Stmt {
    pub(super) st: Statement,
    pub(super) args: Vec<Box<dyn ToSql + Sync + Send>>,
}

pub(super) enum Out {
    Count(u64),
    Rows(Vec<tokio_postgres::Row>),
}

/// Why a round trip failed: the server refused a statement (the transaction is then rolled
/// back, or must be), or something else did (the connection: a COMMIT's outcome is unknown).
pub(super) enum Fail {
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
    pub(super) fn into_error(self) -> Error {
        match self {
            Fail::Db(e) | Fail::Other(e) => e,
        }
    }
}

pub(super) type Fut<'a> = Pin<Box<dyn Future<Output = Result<Out, Fail>> + Send + 'a>>;

/// Awaits the statements of one round trip, each polled once in order first: that is when each
/// is sent, so they go out (and the server runs them) in this order, whatever their number.
pub(super) async fn in_order(futs: Vec<Fut<'_>>) -> Result<Vec<Out>, Fail> {
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
pub(super) type Arg = Box<dyn ToSql + Sync + Send>;

/// Which write [`Batch::many`] makes.
///
/// [`Batch::many`]: super::Batch::many
#[derive(Clone, Copy)]
pub(super) enum Many {
    Insert,
    UpdateAttempt,
    UpdateTodo,
}

/// `col = v.col, …`
pub(super) fn set_from_v(cols: &[&str]) -> String {
    cols.iter()
        .map(|c| format!("{c} = v.{c}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Rows of values as one array per column, with each column's element type (from the value's
/// kind: the rows of one statement bind the same kinds in the same places).
pub(super) fn columns(
    op: &str,
    rows: Vec<Vec<Val>>,
) -> Result<(Vec<&'static str>, Vec<Arg>), Error> {
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
                    Val::Count(n) => n32(op, n),
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
pub(super) fn send<'a>(c: &'a ClientWrapper, s: &'a Stmt) -> Fut<'a> {
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
pub(super) static LOAD_MANY: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "{} WHERE t.id = ANY($1) ORDER BY t.id FOR UPDATE",
        SQL.todo_select
    )
});
pub(crate) static OPEN_MANY: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "SELECT {} FROM todo_attempts a WHERE a.todo_id = ANY($1) AND a.ended_at IS NULL",
        rows::select_list("a", &rows::ATTEMPT_COLS)
    )
});

/// The batch's first statements: `BEGIN`, the change lock, and for a batch that claims, the
/// claim's planner setting (every `claim_next` of the batch reads in this transaction).
pub(crate) fn begin_sql(claims: bool) -> String {
    match claims {
        true => format!("BEGIN; {CHANGE_LOCK_SHARED}; {CLAIM_PLAN}"),
        false => format!("BEGIN; {CHANGE_LOCK_SHARED}"),
    }
}

/// A claim_next scope: its statement and values but `now` (bound first), so that callers whose
/// clocks differ by a millisecond share one read (each row is still judged at each one's `now`).
pub(super) fn claim_key(claim: &ClaimQuery<'_>) -> Result<(String, Vec<Val>), Error> {
    let (sql, vals) = SQL.next_claimable_n(claim, 1, CLAIM_LOCK)?;
    Ok(match vals.split_first() {
        Some((Val::Big(Some(_)), rest)) => (sql, rest.to_vec()),
        _ => (sql, vals),
    })
}

/// A scope's statement with room for `n` rows.
pub(super) fn limited(sql: &str, n: usize) -> String {
    sql.replacen(
        &format!("LIMIT 1{CLAIM_LOCK}"),
        &format!("LIMIT {n}{CLAIM_LOCK}"),
        1,
    )
}
