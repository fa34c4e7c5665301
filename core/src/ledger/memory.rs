//! The in-memory ledger: todos and attempts in ordered maps, offered to [`run`] as the rows of
//! one transaction. The reference every store is held to, the simulator's queue server, and the
//! fuzz targets' subject.

use std::collections::{BTreeMap, BTreeSet};

use super::rows::{self, ClaimQuery, Loaded, Newest, Rows, Sweep, run};
use super::{
    Actor, Answer, Attempt, AttemptWrite, Change, LedgerConfig, Limits, Load, Op, Todo, TodoFilter,
    TodoState, check_todo, claim_order, flow,
};
use crate::error::Error;
use crate::time::Millis;

/// A todo and its attempts by seq. Seen by the ledger's tests, which break its rules behind its
/// back to see [`Ledger::check`] catch them.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Entry {
    pub(super) todo: Todo,
    pub(super) attempts: BTreeMap<u32, Attempt>,
}

impl Entry {
    pub(super) fn open(&self) -> Option<&Attempt> {
        self.attempts.values().next_back().filter(|a| a.is_open())
    }
}

/// The in-memory ledger. See the [`ledger`](super) module doc.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Ledger {
    cfg: LedgerConfig,
    pub(super) todos: BTreeMap<String, Entry>,
    /// FIFO order for `claim_next`: (created_at, id).
    order: BTreeSet<(Millis, String)>,
    /// Paused queues, and since when.
    paused: BTreeMap<String, Millis>,
    /// Queues with limits.
    limits: BTreeMap<String, Limits>,
    /// By queue with a rate limit, its claims within the window.
    claims: BTreeMap<String, Vec<Millis>>,
}

impl Ledger {
    pub fn new(cfg: LedgerConfig) -> Ledger {
        Ledger {
            cfg,
            ..Ledger::default()
        }
    }

    pub fn config(&self) -> &LedgerConfig {
        &self.cfg
    }

    /// Applies one operation (see [`run`]). The in-memory ledger has no transaction to roll
    /// back, but it needs none: every check precedes the writes, and a write that would break
    /// the attempt rows is refused with nothing applied (see [`Ledger::apply_change`]).
    pub fn apply(&mut self, op: Op) -> Result<Answer, Error> {
        let cfg = self.cfg.clone();
        rows::ready(run(&mut Mem(self), &cfg, op))
    }

    /// Applies a transition's change, as a store applies one inside its transaction.
    /// All-or-nothing: the writes are checked first, so a change that would break the attempt
    /// rows (a second open attempt, closing a closed one) is refused as an internal error with
    /// nothing applied. The simulator's canaries call it directly to plant such bugs.
    pub fn apply_change(&mut self, change: Change) -> Result<Todo, Error> {
        self.write_rows(&change)?;
        Ok(change.todo)
    }

    /// [`Ledger::apply_change`] on a borrowed change, as [`Rows::write`] hands it over: each row
    /// is copied once, into the map.
    fn write_rows(&mut self, change: &Change) -> Result<(), Error> {
        let (todo, writes) = (&change.todo, &change.writes);
        let id = &todo.id;
        let entry = self
            .todos
            .get(id)
            .ok_or_else(|| Error::internal(format!("apply {id}: the todo vanished")))?;
        for w in writes {
            match w {
                AttemptWrite::Open(a) if entry.attempts.contains_key(&a.seq) => {
                    return Err(Error::internal(format!(
                        "apply {id}: attempt {} already exists",
                        a.seq
                    )));
                }
                AttemptWrite::Update(a)
                    if !entry.attempts.get(&a.seq).is_some_and(Attempt::is_open) =>
                {
                    return Err(Error::internal(format!(
                        "apply {id}: attempt {} is not open; an attempt closes exactly once",
                        a.seq
                    )));
                }
                AttemptWrite::Amend(a)
                    if entry.attempts.get(&a.seq).is_none_or(Attempt::is_open) =>
                {
                    return Err(Error::internal(format!(
                        "apply {id}: attempt {} is not closed; only a closed attempt is amended",
                        a.seq
                    )));
                }
                _ => {}
            }
        }
        let entry = self.todos.get_mut(id).expect("checked above");
        for w in writes {
            match w {
                AttemptWrite::Open(a) | AttemptWrite::Update(a) => {
                    entry.attempts.insert(a.seq, a.clone());
                }
                // Only the late reports and the answer: the rest of a closed attempt is
                // immutable.
                AttemptWrite::Amend(a) => {
                    if let Some(kept) = entry.attempts.get_mut(&a.seq) {
                        kept.late_reports.clone_from(&a.late_reports);
                        kept.late_reports_total = a.late_reports_total;
                        if let (Some(k), Some(q)) = (kept.question.as_mut(), a.question.as_ref()) {
                            k.answer.clone_from(&q.answer);
                            k.answered_at = q.answered_at;
                            k.answered_by.clone_from(&q.answered_by);
                            k.answer_key.clone_from(&q.answer_key);
                        }
                    }
                }
                AttemptWrite::PruneThrough(n) => {
                    entry.attempts.retain(|seq, a| seq > n || a.is_open());
                }
            }
        }
        entry.todo.clone_from(todo);
        Ok(())
    }

    /// One todo by id, unscoped (for checkers and tests).
    pub fn todo(&self, id: &str) -> Option<&Todo> {
        self.todos.get(id).map(|e| &e.todo)
    }

    /// Every todo, in FIFO order (for checkers and tests).
    pub fn todos(&self) -> impl Iterator<Item = &Todo> {
        self.order.iter().map(|(_, id)| &self.todos[id].todo)
    }

    /// Every attempt of a todo, oldest first (for checkers and tests).
    pub fn attempts(&self, id: &str) -> impl Iterator<Item = &Attempt> + Clone {
        self.todos
            .get(id)
            .into_iter()
            .flat_map(|e| e.attempts.values())
    }

    /// Checks every invariant of the ledger; the first broken one is described in the error.
    pub fn check(&self) -> Result<(), String> {
        if self.order.len() != self.todos.len() {
            return Err("the FIFO index and the todo map disagree".into());
        }
        for (id, entry) in &self.todos {
            if !self.order.contains(&(entry.todo.created_at, id.clone())) {
                return Err(format!("todo {id} is missing from the FIFO index"));
            }
            check_todo(&entry.todo, entry.attempts.values())
                .map_err(|e| format!("todo {id}: {e}"))?;
        }
        Ok(())
    }
}

/// The ledger as the rows of one transaction (see [`run`]).
pub(super) struct Mem<'a>(pub(super) &'a mut Ledger);

impl Mem<'_> {
    fn loaded(&self, id: &str) -> Option<Loaded> {
        self.0
            .todos
            .get(id)
            .map(|e| (e.todo.clone(), e.open().cloned()))
    }
}

impl Rows for Mem<'_> {
    async fn load(&mut self, _op: &str, id: &str) -> Result<Option<Loaded>, Error> {
        Ok(self.loaded(id))
    }

    async fn next_claimable(&mut self, claim: &ClaimQuery<'_>) -> Result<Option<Loaded>, Error> {
        let next = self
            .0
            .todos()
            .filter(|t| claim.admits(t))
            .min_by(|a, b| claim_order(a).cmp(&claim_order(b)))
            .map(|t| t.id.clone());
        Ok(next.and_then(|id| self.loaded(&id)))
    }

    async fn by_key(&mut self, endpoint: &str, key: &str) -> Result<Option<Todo>, Error> {
        Ok(self
            .0
            .todos
            .values()
            .map(|e| &e.todo)
            .find(|t| t.endpoint == endpoint && t.idempotency_key.as_deref() == Some(key))
            .cloned())
    }

    async fn insert_todo(&mut self, t: &Todo) -> Result<bool, Error> {
        let l = &mut *self.0;
        let key_taken = |l: &Ledger| {
            t.idempotency_key.as_deref().is_some_and(|k| {
                l.todos.values().any(|e| {
                    e.todo.endpoint == t.endpoint && e.todo.idempotency_key.as_deref() == Some(k)
                })
            })
        };
        // As the stores' unique indexes refuse either: the id, or the endpoint's key.
        if l.todos.contains_key(&t.id) || key_taken(l) {
            return Ok(false);
        }
        l.order.insert((t.created_at, t.id.clone()));
        l.todos.insert(
            t.id.clone(),
            Entry {
                todo: t.clone(),
                attempts: BTreeMap::new(),
            },
        );
        Ok(true)
    }

    async fn write(&mut self, _op: &str, change: &Change) -> Result<Vec<u64>, Error> {
        // write_rows refuses a write that touches no open row, so each touched one.
        self.0.write_rows(change)?;
        Ok(vec![1; change.writes.len()])
    }

    async fn attempts(
        &mut self,
        _op: &str,
        id: &str,
        which: Newest,
    ) -> Result<Vec<Attempt>, Error> {
        let all = self.0.todos.get(id).map(|e| &e.attempts);
        Ok(all
            .into_iter()
            .flat_map(|a| a.values().rev())
            .filter(|a| !which.closed_only || !a.is_open())
            .take(which.limit)
            .cloned()
            .collect())
    }

    async fn candidates(&mut self, sweep: Sweep<'_>) -> Result<Vec<String>, Error> {
        // Not SQL's narrower filters: a todo in one of the sweep's states is a candidate when
        // the sweep's own transition (`Sweep::change`) acts on it, or refuses it (the error then
        // surfaces when `run` transits it). So the transitions decide every time and owner
        // test, the model tests hold SQL's filters to them, and a sweep loads (clones) only the
        // todos it changes.
        let state = |t: &Todo| match sweep {
            Sweep::Reap { .. } | Sweep::Revoke { .. } => t.state == TodoState::Claimed,
            // Failed todos whose retry is due, pending, failed or waiting ones past a deadline,
            // waiting ones past their answer's due time.
            Sweep::RequeueDue { .. } => matches!(
                t.state,
                TodoState::Failed | TodoState::Pending | TodoState::InputRequired
            ),
            Sweep::Purge { .. } => !matches!(
                t.state,
                TodoState::Pending | TodoState::Claimed | TodoState::InputRequired
            ),
        };
        let acts = |e: &Entry| match sweep {
            Sweep::Purge { .. } => true,
            _ => !matches!(sweep.change(&e.todo, e.open()), Ok(None)),
        };
        Ok(self
            .0
            .todos
            .iter()
            .filter(|(_, e)| state(&e.todo) && acts(e))
            .map(|(id, _)| id.clone())
            .collect())
    }

    async fn list(&mut self, actor: &Actor, filter: &TodoFilter) -> Result<Vec<Todo>, Error> {
        Ok(self
            .0
            .todos()
            .filter(|t| actor.sees(t))
            .filter(|t| {
                filter
                    .queues
                    .as_ref()
                    .is_none_or(|qs| qs.iter().any(|q| q == &t.queue))
            })
            .filter(|t| filter.state.is_none_or(|s| s == t.state))
            .filter(|t| filter.is_after(t))
            .take(filter.limit)
            .cloned()
            .collect())
    }

    async fn delete(&mut self, _op: &str, id: &str) -> Result<(), Error> {
        let l = &mut *self.0;
        if let Some(e) = l.todos.remove(id) {
            l.order.remove(&(e.todo.created_at, e.todo.id));
        }
        Ok(())
    }

    async fn paused_queues(&mut self) -> Result<Vec<String>, Error> {
        Ok(self.0.paused.keys().cloned().collect())
    }

    async fn set_paused(&mut self, now: Millis, queue: &str, paused: bool) -> Result<(), Error> {
        if paused {
            self.0.paused.entry(queue.to_string()).or_insert(now);
        } else {
            self.0.paused.remove(queue);
        }
        Ok(())
    }

    async fn queue_limits(&mut self) -> Result<Vec<(String, Limits)>, Error> {
        Ok(self.0.limits.iter().map(|(q, l)| (q.clone(), *l)).collect())
    }

    async fn set_queue_limits(&mut self, _: Millis, queue: &str, l: Limits) -> Result<(), Error> {
        if l.is_empty() {
            self.0.limits.remove(queue);
            self.0.claims.remove(queue);
        } else {
            self.0.limits.insert(queue.to_string(), l);
        }
        Ok(())
    }

    async fn flow_load(&mut self, now: Millis, _lock: bool) -> Result<Load, Error> {
        let mut load = Load::default();
        for t in self.0.todos() {
            if t.state == TodoState::Claimed && self.0.limits.contains_key(&t.queue) {
                let k = (t.queue.clone(), t.concurrency_key.clone());
                *load.claimed.entry(k).or_default() += 1;
            }
        }
        for (q, at) in &self.0.claims {
            let n = at
                .iter()
                .filter(|&&t| t > now.saturating_sub(flow::WINDOW))
                .count();
            if n > 0 {
                load.recent
                    .insert(q.clone(), u32::try_from(n).unwrap_or(u32::MAX));
            }
        }
        Ok(load)
    }

    async fn note_claim(&mut self, now: Millis, queue: &str) -> Result<(), Error> {
        let at = self.0.claims.entry(queue.to_string()).or_default();
        at.retain(|&t| t > now.saturating_sub(flow::WINDOW));
        at.push(now);
        Ok(())
    }
}
