//! The queues' own rows: which are paused, their flow limits, what those limits hold, and the
//! rate window's claims. Rows only: the rules are `relay_core::ledger::flow`'s.

use relay_core::Error;
use relay_core::Millis;
use relay_core::ledger::Op;
use relay_core::ledger::flow::{self, Limits, Load, QueueLine, WINDOW};

use super::tx::{Sql, Tx, required, text};
use crate::store::rows::{Row, Val, time};

/// The [`Rows`](relay_core::ledger::Rows) methods for the queues' own tables, as a backend's own
/// transaction answers them (through the functions below): written once here for SQLite's and
/// Postgres' transactions, inside their `impl Rows`. (A Postgres batch keeps the paused queues
/// and the limits it read at its start instead.)
macro_rules! queue_rows {
    () => {
        async fn paused_queues(&mut self) -> Result<Vec<String>, relay_core::Error> {
            $crate::store::ops::paused_queues(self).await
        }

        async fn set_paused(
            &mut self,
            now: relay_core::Millis,
            queue: &str,
            paused: bool,
        ) -> Result<(), relay_core::Error> {
            $crate::store::ops::set_paused(self, now, queue, paused).await
        }

        async fn queue_limits(
            &mut self,
        ) -> Result<Vec<(String, relay_core::ledger::Limits)>, relay_core::Error> {
            $crate::store::ops::queue_limits(self).await
        }

        async fn set_queue_limits(
            &mut self,
            now: relay_core::Millis,
            queue: &str,
            l: relay_core::ledger::Limits,
        ) -> Result<(), relay_core::Error> {
            $crate::store::ops::set_queue_limits(self, now, queue, l).await
        }

        async fn flow_load(
            &mut self,
            now: relay_core::Millis,
            lock: bool,
        ) -> Result<relay_core::ledger::Load, relay_core::Error> {
            if lock {
                $crate::store::ops::Tx::lock_flow(self).await?;
            }
            $crate::store::ops::flow_load(self, now).await
        }

        async fn note_claim(
            &mut self,
            now: relay_core::Millis,
            queue: &str,
        ) -> Result<(), relay_core::Error> {
            $crate::store::ops::note_claim(self, now, queue).await
        }
    };
}
pub(crate) use queue_rows;

pub(crate) async fn paused_queues<T: Tx>(tx: &mut T) -> Result<Vec<String>, Error> {
    let sql = "SELECT queue FROM paused_queues ORDER BY queue";
    tx.query_sql(Sql::new("paused_queues", "", sql), vec![], |r| {
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
    tx.exec_sql(Sql::new(op, queue, sql), vals).await.map(drop)
}

/// Every queue's limits, by queue.
pub(crate) const LIMITS: &str = "SELECT queue, max_claimed, max_claimed_per_key, \
     claims_per_minute FROM queue_limits ORDER BY queue";

/// What the limited queues hold: their claimed todos by queue and key (through the small partial
/// index `todos_claimed_keys`), then the claims of the rate window (after `$1`) by queue.
pub(crate) const LOAD: &str = "SELECT 'claimed', t.queue, t.concurrency_key, count(*) \
     FROM todos t WHERE t.state = 'claimed' AND t.queue IN (SELECT queue FROM queue_limits) \
     GROUP BY t.queue, t.concurrency_key \
     UNION ALL SELECT 'recent', c.queue, NULL, count(*) FROM queue_claims c \
     WHERE c.claimed_at > $1 GROUP BY c.queue";

/// A claim in a rate-limited queue, and the window's start: the claims before it go.
pub(crate) const NOTE_CLAIM: &str = "INSERT INTO queue_claims (queue, claimed_at) VALUES ($1, $2)";
pub(crate) const FORGET_CLAIMS: &str =
    "DELETE FROM queue_claims WHERE queue = $1 AND claimed_at <= $2";

/// A row of [`LIMITS`].
pub(crate) fn limits_row(r: &dyn Row) -> Result<(String, Limits), Error> {
    let limit = |i: usize, what: &str| -> Result<Option<u32>, Error> {
        super::tx::column(r.int(i), what)?
            .map(|n| u32::try_from(n).map_err(|e| Error::internal(format!("reading {what}: {e}"))))
            .transpose()
    };
    Ok((
        required(r.text(0), "a limited queue")?,
        Limits {
            max_claimed: limit(1, "max_claimed")?,
            max_claimed_per_key: limit(2, "max_claimed_per_key")?,
            claims_per_minute: limit(3, "claims_per_minute")?,
        },
    ))
}

/// A row of [`LOAD`]: which count, the queue, the key, the count.
pub(crate) type LoadRow = (String, String, Option<String>, u32);

pub(crate) fn load_row(r: &dyn Row) -> Result<LoadRow, Error> {
    let n = required(r.int(3), "a count")?;
    Ok((
        required(r.text(0), "a count's kind")?,
        required(r.text(1), "a limited queue")?,
        super::tx::column(r.text(2), "a concurrency key")?,
        u32::try_from(n).map_err(|e| Error::internal(format!("reading a count: {e}")))?,
    ))
}

/// The [`Load`] of [`LOAD`]'s rows.
pub(crate) fn load_of(rows: Vec<LoadRow>) -> Load {
    let mut load = Load::default();
    for (kind, queue, key, n) in rows {
        if kind == "recent" {
            load.recent.insert(queue, n);
        } else {
            load.claimed.insert((queue, key), n);
        }
    }
    load
}

/// The window's start at `now`: claims at or before it no longer count.
pub(crate) fn window_start(now: Millis) -> Millis {
    now.saturating_sub(WINDOW)
}

pub(crate) async fn queue_limits<T: Tx>(tx: &mut T) -> Result<Vec<(String, Limits)>, Error> {
    tx.query_sql(
        Sql::new("queue_show", "(queues)", LIMITS),
        vec![],
        limits_row,
    )
    .await
}

pub(crate) async fn set_queue_limits<T: Tx>(
    tx: &mut T,
    now: Millis,
    queue: &str,
    l: Limits,
) -> Result<(), Error> {
    let op = "queue_set";
    if l.is_empty() {
        let sql = "DELETE FROM queue_limits WHERE queue = $1";
        tx.exec_sql(Sql::new(op, queue, sql), vec![text(queue)])
            .await?;
        let sql = "DELETE FROM queue_claims WHERE queue = $1";
        return tx
            .exec_sql(Sql::new(op, queue, sql), vec![text(queue)])
            .await
            .map(drop);
    }
    let n = |v: Option<u32>| Val::Big(v.map(i64::from));
    let sql = "INSERT INTO queue_limits
                   (queue, max_claimed, max_claimed_per_key, claims_per_minute, updated_at)
               VALUES ($1, $2, $3, $4, $5)
               ON CONFLICT (queue) DO UPDATE SET max_claimed = $2, max_claimed_per_key = $3,
                   claims_per_minute = $4, updated_at = $5";
    let vals = vec![
        text(queue),
        n(l.max_claimed),
        n(l.max_claimed_per_key),
        n(l.claims_per_minute),
        time(op, now)?,
    ];
    tx.exec_sql(Sql::new(op, queue, sql), vals).await.map(drop)
}

pub(crate) async fn flow_load<T: Tx>(tx: &mut T, now: Millis) -> Result<Load, Error> {
    let vals = vec![time("claim", window_start(now))?];
    let rows = tx
        .query_sql(Sql::new("claim", "(flow)", LOAD), vals, load_row)
        .await?;
    Ok(load_of(rows))
}

pub(crate) async fn note_claim<T: Tx>(tx: &mut T, now: Millis, queue: &str) -> Result<(), Error> {
    let op = "claim";
    let start = time(op, window_start(now))?;
    tx.exec_sql(Sql::new(op, queue, FORGET_CLAIMS), vec![text(queue), start])
        .await?;
    let vals = vec![text(queue), time(op, now)?];
    tx.exec_sql(Sql::new(op, queue, NOTE_CLAIM), vals)
        .await
        .map(drop)
}

/// The limited queues' pending todos that are due at `$1`, by queue and key (what
/// [`flow::lines`](relay_core::ledger::flow::lines) judges held back or not).
const WAITING: &str = "SELECT t.queue, t.concurrency_key, count(*) FROM todos t \
     WHERE t.state = 'pending' AND (t.run_at IS NULL OR t.run_at <= $1) \
     AND t.queue IN (SELECT queue FROM queue_limits) GROUP BY t.queue, t.concurrency_key";

/// Every queue with limits or paused, as an operator reads it at `now`.
pub(crate) async fn queue_lines<T: Tx>(
    tx: &mut T,
    cfg: &relay_core::ledger::LedgerConfig,
    now: Millis,
) -> Result<Vec<QueueLine>, Error> {
    let now = tx.clock(now).await?;
    let flow = relay_core::ledger::run(tx, cfg, Op::QueueFlow { now })
        .await?
        .flow()?;
    let waiting = tx
        .query_sql(
            Sql::new("queue_show", "(queues)", WAITING),
            vec![time("queue_show", now)?],
            |r| {
                let n = required(r.int(2), "a count")?;
                Ok((
                    required(r.text(0), "a limited queue")?,
                    super::tx::column(r.text(1), "a concurrency key")?,
                    u64::try_from(n)
                        .map_err(|e| Error::internal(format!("reading a count: {e}")))?,
                ))
            },
        )
        .await?;
    Ok(flow::lines(&flow, &waiting))
}
