//! Claims past held keys, through the key heads.
//!
//! A claim walks the FIFO index in claim order and takes the first rows it may. The todos of a
//! key held at its limit sit anywhere in that order, so a walk past a key with a deep backlog
//! reads its every row. Both stores keep `key_heads`, a row per (endpoint, queue, key) with live
//! todos naming the first of them in claim order (triggers keep it: see the migrations
//! `key_heads`). When a claim holds keys back, it reads instead:
//!
//! - for each queue the claim may take from (those it names, or those of the endpoint with live
//!   todos without a key, found one index seek each), its first claimable todos without a key
//!   (the index `todos_keyless`);
//! - the first heads in claim order ([`WINDOWS`]), held keys left out (one entry each), and for
//!   each the first claimable todos of its key (the index `todos_keyed`);
//! - the head after those, the edge.
//!
//! A key's claimable todos come at or after its head, so every todo before the edge was seen:
//! the candidates before it are exactly the walk's first rows. When fewer than the claim needs
//! lie before the edge, it reads again with more heads; when that cannot tell either, or a
//! candidate changed before it was locked, the claim walks the FIFO index as it would without
//! keys held.

use std::cmp::Reverse;

use relay_core::Error;
use relay_core::ledger::Actor;

use super::ClaimQuery;
use super::cols::{Val, label};
use super::decode::Row;
use super::sql::{CLAIM_ORDER, Keys, LIVE, Shared};
use crate::store::ops::Sql;

/// How many heads a claim probes: a few first (the first claimable head most often settles
/// it), then more, then it walks instead. Fewer in the unit tests, so that their programs reach
/// past the edge often.
pub(crate) const WINDOWS: [usize; 2] = if cfg!(test) { [1, 4] } else { [4, 64] };

/// A candidate or the edge: its place in the claim order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Place {
    pub edge: bool,
    pub id: String,
    pub priority: i64,
    pub created_at: i64,
}

impl Place {
    fn order(&self) -> (Reverse<i64>, i64, &str) {
        (Reverse(self.priority), self.created_at, &self.id)
    }
}

/// Decodes a row of [`Shared::heads_first`].
pub(crate) fn place<R: Row + ?Sized>(r: &R) -> Result<Place, Error> {
    let bad = |e: String| Error::internal(format!("reading a claim's place from the store: {e}"));
    let edge = r.int(0).map_err(bad)?.unwrap_or(0) != 0;
    let id = r.text(1).map_err(bad)?.unwrap_or_default();
    let priority = r.int(2).map_err(bad)?.unwrap_or(0);
    let created_at = r.int(3).map_err(bad)?.unwrap_or(0);
    Ok(Place {
        edge,
        id,
        priority,
        created_at,
    })
}

/// The ids of the first `limit` candidates when they are exactly the walk's first rows (fewer
/// when no more are claimable); `None` when the heads read cannot tell.
pub(crate) fn exact(found: &[Place], limit: usize) -> Option<Vec<String>> {
    let edge = found.iter().find(|p| p.edge);
    let mut ids: Vec<&Place> = found
        .iter()
        .filter(|p| !p.edge && edge.is_none_or(|e| p.order() < e.order()))
        .collect();
    ids.sort_by(|a, b| a.order().cmp(&b.order()));
    ids.truncate(limit);
    (edge.is_none() || ids.len() == limit).then(|| ids.into_iter().map(|p| p.id.clone()).collect())
}

/// A claim's two reads, in each backend's terms.
pub(crate) trait ClaimReads {
    /// A row of todo columns, as the backend hands it on.
    type Todo;
    /// The rows of [`Shared::heads_first`].
    async fn places(&mut self, sql: Sql<'_>, vals: Vec<Val>) -> Result<Vec<Place>, Error>;
    /// The rows of a statement that selects todo columns.
    async fn todos(&mut self, sql: Sql<'_>, vals: Vec<Val>) -> Result<Vec<Self::Todo>, Error>;
    /// The id of a row of [`ClaimReads::todos`].
    fn id_of(t: &Self::Todo) -> Option<&str>;
}

/// The first `limit` claimable todos in claim order, `lock` on them: through the heads when
/// keys are held back and they can tell, else by the walk.
pub(crate) async fn claimable<C: ClaimReads>(
    c: &mut C,
    sql: &Shared,
    claim: &ClaimQuery<'_>,
    limit: usize,
    lock: &str,
) -> Result<Vec<C::Todo>, Error> {
    // Each read's text comes in the backend's dialect already (`sql`'s); its errors name the
    // claim's operation, about "(next)".
    let op = claim.op;
    for window in WINDOWS {
        let Some((s, vals)) = sql.heads_first(claim, limit, window)? else {
            break;
        };
        let found = c.places(Sql::new(op, "(next)", &s), vals).await?;
        let Some(ids) = exact(&found, limit) else {
            continue;
        };
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let (s, vals) = sql.claimable_ids(claim, &ids, lock)?;
        let mut rows = c.todos(Sql::new(op, "(next)", &s), vals).await?;
        if rows.len() == ids.len() {
            rows.sort_by_key(|r| ids.iter().position(|id| C::id_of(r) == Some(id.as_str())));
            return Ok(rows);
        }
        break;
    }
    let (s, vals) = sql.next_claimable_n(claim, limit, lock)?;
    c.todos(Sql::new(op, "(next)", &s), vals).await
}

impl Shared {
    /// The read through the first `window` heads (module doc): rows of (edge, id, priority,
    /// created_at), the candidates in claim order, then the edge if there is one. `None` where it
    /// does not apply: no key held back, a claim not scoped to an endpoint (the heads are ordered
    /// within one), or more than one row on SQLite (which has no `LATERAL`).
    pub(crate) fn heads_first(
        &self,
        c: &ClaimQuery<'_>,
        limit: usize,
        window: usize,
    ) -> Result<Option<(String, Vec<Val>)>, Error> {
        let (actor, queues, holds) = (c.actor, c.queues, c.holds);
        let mut q = self.query();
        let Actor::Endpoint { endpoint, .. } = actor else {
            return Ok(None);
        };
        if holds.keys.is_empty() || (q.sqlite() && limit != 1) {
            return Ok(None);
        }
        let keyless = self.claimable_where(&mut q, c, Keys::NoneIn("l"))?;
        let keyed = self.claimable_where(&mut q, c, Keys::Of("h"))?;
        let mut heads = vec![format!("t.endpoint = {}", q.bind_text(endpoint))];
        if let Some(qs) = queues {
            heads.push(q.queue_in(qs));
        }
        if !holds.queues.is_empty() {
            heads.push(format!("NOT ({})", q.queue_in(&holds.queues)));
        }
        heads.push(format!("NOT ({})", q.key_in(&holds.keys)));
        let heads = heads.join(" AND ");
        let lanes = match queues {
            Some(qs) => {
                let mut qs = qs.to_vec();
                qs.sort_unstable();
                qs.dedup();
                if q.sqlite() {
                    let qs = serde_json::to_string(&qs).unwrap_or_else(|_| "[]".into());
                    format!("SELECT value FROM json_each({})", q.bind(label(Some(&qs))))
                } else {
                    format!("SELECT unnest({}::text[])", q.bind(Val::Texts(qs)))
                }
            }
            // The endpoint's queues with live todos without a key, in order, one seek each.
            None => {
                let mut lane = || {
                    format!(
                        "SELECT t.queue FROM todos t WHERE t.endpoint = {} AND {} \
                           AND t.concurrency_key IS NULL",
                        q.bind_text(endpoint),
                        q.one_of("t.state", LIVE)
                    )
                };
                let (first, next) = (lane(), lane());
                format!(
                    "SELECT ({first} ORDER BY t.queue LIMIT 1) \
                     UNION ALL SELECT ({next} AND t.queue > l.queue ORDER BY t.queue LIMIT 1) \
                       FROM lanes l WHERE l.queue IS NOT NULL"
                )
            }
        };
        let (w, w1) = (window, window + 1);
        let ctes = format!(
            "WITH RECURSIVE heads AS (SELECT t.queue, t.concurrency_key, t.priority, t.created_at, \
               t.id FROM key_heads t WHERE {heads} ORDER BY {CLAIM_ORDER} LIMIT {w1}), \
             probed AS (SELECT * FROM heads t ORDER BY {CLAIM_ORDER} LIMIT {w}), \
             lanes (queue) AS ({lanes})"
        );
        let edge = format!(
            "SELECT * FROM (SELECT CAST(1 AS BIGINT), t.id, t.priority, t.created_at FROM heads t \
               ORDER BY {CLAIM_ORDER} LIMIT 1 OFFSET {w}) e"
        );
        let sql = if q.sqlite() {
            format!(
                "{ctes} SELECT * FROM (SELECT CAST(0 AS BIGINT), t.id, t.priority, t.created_at FROM todos t \
                   WHERE t.id IN ( \
                     SELECT (SELECT t.id FROM todos t WHERE {keyless} \
                       ORDER BY {CLAIM_ORDER} LIMIT 1) FROM lanes l \
                     UNION ALL \
                     SELECT (SELECT t.id FROM todos t WHERE {keyed} \
                       ORDER BY {CLAIM_ORDER} LIMIT 1) FROM probed h) \
                   ORDER BY {CLAIM_ORDER} LIMIT 1) c \
                 UNION ALL {edge}"
            )
        } else {
            format!(
                "{ctes} SELECT * FROM (SELECT CAST(0 AS BIGINT), t.id, t.priority, t.created_at FROM ( \
                     (SELECT k.id, k.priority, k.created_at FROM lanes l CROSS JOIN LATERAL \
                       (SELECT t.id, t.priority, t.created_at FROM todos t WHERE {keyless} \
                         ORDER BY {CLAIM_ORDER} LIMIT {limit}) k) \
                     UNION ALL \
                     (SELECT k.id, k.priority, k.created_at FROM probed h CROSS JOIN LATERAL \
                       (SELECT t.id, t.priority, t.created_at FROM todos t WHERE {keyed} \
                         ORDER BY {CLAIM_ORDER} LIMIT {limit}) k)) t \
                   ORDER BY {CLAIM_ORDER} LIMIT {limit}) c \
                 UNION ALL {edge}"
            )
        };
        Ok(Some((sql, q.vals)))
    }

    /// The todos of `ids` that are still claimable, `lock` on them, in no order: on Postgres
    /// the claim plans with sorts off (`CLAIM_PLAN`), and an `ORDER BY` here would walk the FIFO
    /// index to find a few ids instead of reading them by key. [`claimable`] puts them in the
    /// order of `ids`, the claim order.
    pub(crate) fn claimable_ids(
        &self,
        c: &ClaimQuery<'_>,
        ids: &[String],
        lock: &str,
    ) -> Result<(String, Vec<Val>), Error> {
        let mut q = self.query();
        let which = self.claimable_where(&mut q, c, Keys::NotHeld)?;
        let among = if q.sqlite() {
            let ids = serde_json::to_string(ids).unwrap_or_else(|_| "[]".into());
            let ids = q.bind(label(Some(&ids)));
            format!("t.id IN (SELECT value FROM json_each({ids}))")
        } else {
            format!("t.id = ANY({})", q.bind(Val::Texts(ids.to_vec())))
        };
        let sql = format!("{} WHERE {among} AND {which}{lock}", self.todo_select);
        Ok((sql, q.vals))
    }
}
