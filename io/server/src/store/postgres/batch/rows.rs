//! A batch's transaction as the ledger's [`Rows`]: every read goes through the rows kept, every
//! write is held for the next round trip.

use relay_core::Error;
use relay_core::Millis;
use relay_core::ledger::rows::{ClaimQuery, Loaded};
use relay_core::ledger::{
    Actor, Attempt, AttemptWrite, Change, Limits, Load, Newest, Rows, Sweep, Todo, TodoFilter,
    claim_order,
};
use tokio_postgres::Row;

use super::stmt::claim_key;
use super::tx::{Batch, Entry, Group, Held};
use crate::store::ops::{self, Sql};
use crate::store::postgres::tx::{CLAIM_LOCK, FLOW_LOCK, PgClaimRows, SQL};
use crate::store::rows::{self, Val};

impl PgClaimRows for Batch<'_> {
    async fn claim_rows(&mut self, sql: Sql<'_>, vals: Vec<Val>) -> Result<Vec<Row>, Error> {
        self.read(sql.op, sql.text, vals).await
    }
}

impl Rows for Batch<'_> {
    async fn load(&mut self, op: &str, id: &str) -> Result<Option<Loaded>, Error> {
        if !self.rows.contains_key(id) {
            self.fetch(vec![id.to_string()], true).await?;
        }
        match self.rows.get(id) {
            Some(e) => Self::entry_answer(op, id, e),
            None => Ok(None),
        }
    }

    async fn next_claimable(&mut self, claim: &ClaimQuery<'_>) -> Result<Option<Loaded>, Error> {
        let key = claim_key(claim)?;
        for _ in 0..3 {
            if let Some(g) = self.groups.iter().find(|g| g.key == key) {
                // The first claimable row of those kept (read for this scope or any other, or
                // changed by this batch), when no unread row can come before it.
                let best = self
                    .rows
                    .values()
                    .filter_map(|e| match e {
                        Entry::Row(t, _) if claim.admits(t) => Some(t),
                        _ => None,
                    })
                    .min_by(|a, b| claim_order(a).cmp(&claim_order(b)));
                let before_unread = |t: &Todo| {
                    g.exhausted
                        || g.last
                            .as_ref()
                            .is_some_and(|(p, at, id)| claim_order(t) <= (*p, *at, id.as_str()))
                };
                match best {
                    Some(t) if before_unread(t) => {
                        let id = t.id.clone();
                        return Self::entry_answer(claim.op, &id, &self.rows[&id]);
                    }
                    None if g.exhausted => return Ok(None),
                    _ => {}
                }
                self.groups.retain(|g| g.key != key);
            }
            // Read as many rows as the batch has claims left, after its held writes.
            let k = self.claims_left.max(1);
            let found = rows::claimable(self, &SQL, claim, k, CLAIM_LOCK).await?;
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

    async fn write(&mut self, op: &str, change: &Change) -> Result<Vec<u64>, Error> {
        let (todo, writes) = (&change.todo, &change.writes);
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
                AttemptWrite::Amend(a) => {
                    let vals = rows::amend_update(op, a)?;
                    self.write_now(op, &SQL.update_amend, vals).await?
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

    async fn queue_limits(&mut self) -> Result<Vec<(String, Limits)>, Error> {
        Ok(self.limits.clone())
    }

    async fn set_queue_limits(&mut self, _: Millis, _: &str, _: Limits) -> Result<(), Error> {
        Err(not_batched("queue_set"))
    }

    /// Read through the batch's pipeline, so after its held writes: the claims this batch made
    /// before count.
    async fn flow_load(&mut self, now: Millis, lock: bool) -> Result<Load, Error> {
        if lock {
            self.read("claim", FLOW_LOCK, Vec::new()).await?;
        }
        let start = rows::time("claim", ops::window_start(now))?;
        let found = self.read("claim", ops::LOAD, vec![start]).await?;
        let rows = found
            .iter()
            .map(|r| ops::load_row(r))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ops::load_of(rows))
    }

    async fn note_claim(&mut self, now: Millis, queue: &str) -> Result<(), Error> {
        let op = "claim";
        let q = Val::Text(Some(queue.into()));
        let start = rows::time(op, ops::window_start(now))?;
        self.write_now(op, ops::FORGET_CLAIMS, vec![q.clone(), start])
            .await?;
        let vals = vec![q, rows::time(op, now)?];
        self.write_now(op, ops::NOTE_CLAIM, vals).await.map(drop)
    }
}

/// `batched` keeps these operations out of a batch; reaching one is a bug.
fn not_batched(op: &str) -> Error {
    Error::internal(format!("{op}: not an operation a batch runs"))
}
