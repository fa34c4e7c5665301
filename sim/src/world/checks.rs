//! The invariants, checked after every event.

use std::collections::{BTreeMap, BTreeSet};

use relay_core::ledger::flow::{self, Load};
use relay_core::ledger::{Budget, Outcome, TodoState, Usage};
use relay_core::relay::{Relay, RelayOutcome, RunRecord};
use relay_core::time::SECOND;

use crate::options::MAX_DRIFT_PPM;

use super::*;

impl World {
    /// A report the driver held back (the late-send canary) goes on the wire only while the
    /// machine's lease is live. Calls the machine sends as it steps are the monitor's
    /// (`silent_after_lease_loss`, judged from the server's answers).
    pub(super) fn check_late_send(&mut self, r: usize, run_id: u64) {
        let h = &self.hosts[r];
        let local = h.machine_clock(self.o.mutation).read(self.now);
        let live = h
            .relay
            .as_ref()
            .and_then(Relay::lease_deadline)
            .is_some_and(|d| local < d);
        if !live {
            self.violate(
                Kind::Correctness,
                "nothing_after_lease_loss",
                format!("relay {r} sent a report for run {run_id} without a live lease"),
            );
        }
    }

    /// The lease token appears in nothing but lease calls.
    pub(super) fn check_relay_outcome(
        &mut self,
        r: usize,
        record: &RunRecord,
        outcome: RelayOutcome,
    ) {
        let Some(run) = self.hosts[r].runs.get(&record.run_id).cloned() else {
            return;
        };
        let attempt = self
            .ledger
            .attempts(&run.todo)
            .find(|a| a.seq == run.seq)
            .cloned();
        let Some(a) = attempt else {
            return; // pruned or deleted: nothing left to compare
        };
        let got = (a.outcome, a.disposition);
        use relay_core::ledger::Disposition as D;
        let agrees = match outcome {
            RelayOutcome::Completed => got.0 == Some(Outcome::Completed),
            RelayOutcome::Failed => got == (Some(Outcome::Failed), Some(D::RetryScheduled)),
            RelayOutcome::DeadLettered => {
                matches!(got.0, Some(Outcome::Failed | Outcome::NeedsInput))
                    && got.1 == Some(D::DeadLettered)
            }
            RelayOutcome::InputRequested => {
                got == (Some(Outcome::NeedsInput), Some(D::AwaitingInput))
            }
            RelayOutcome::Released => got.0 == Some(Outcome::Released),
            // The relay lost the lease: no report of its own closed the attempt.
            RelayOutcome::LeaseLost => !matches!(
                got.0,
                Some(Outcome::Completed | Outcome::Failed | Outcome::Released)
            ),
            // No answer to any report reached it; the server may still have applied one whose
            // answer was lost (then the attempt shows that report's outcome).
            RelayOutcome::ReportLost => !run.report_answered,
            RelayOutcome::NoWork => true,
        };
        match outcome {
            RelayOutcome::LeaseLost => self.count("lease_lost"),
            RelayOutcome::ReportLost => self.count("report_lost"),
            RelayOutcome::DeadLettered => self.count("relay_dead_lettered"),
            _ => {}
        }
        if !agrees {
            self.violate(
                Kind::Correctness,
                "outcomes_agree",
                format!(
                    "relay {r} run {} recorded {} for {} seq {} but the ledger says {:?}/{:?}",
                    record.run_id,
                    outcome.as_str(),
                    run.todo,
                    run.seq,
                    got.0,
                    got.1
                ),
            );
        }
    }

    pub(super) fn check_invariants(&mut self) {
        if self.violation.is_some() {
            return;
        }
        if !self.touched.is_empty() {
            let touched = std::mem::take(&mut self.touched);
            if !self.o.flow.queues.is_empty() {
                self.check_flow();
            }
            self.since_full_check += 1;
            // Every touched todo is checked at once; the whole ledger (its index, the count of
            // todos) now and then and whenever work arrives.
            let full = self.since_full_check >= 256 || touched.len() > 4;
            if full {
                self.since_full_check = 0;
            }
            self.check_todos(&touched, full);
        }
        self.check_processes();
    }

    /// Flow control, from the ledger's truth rather than any relay's belief: each claim made
    /// since the last check (an attempt opened on a todo) is held to the limits its queue's
    /// operator set, under the load the world recounts from the ledger's rows (the todos in
    /// state claimed, by queue and key) and the claims it saw within the window. A claim is
    /// never granted when, at its instant, core's rule (`flow::held`) would hold it back: its
    /// queue had `max_claimed` todos claimed, or `max_claimed_per_key` with its key, or had
    /// made `claims_per_minute` claims within the window. So no queue ever goes over a limit,
    /// except that one lowered below what is claimed leaves the queue over it until claims
    /// close: only the claims made after the change count against it.
    pub(super) fn check_flow(&mut self) {
        let claimed: Vec<Todo> = self
            .ledger
            .todos()
            .filter(|t| t.attempts_total > self.claims_seen.get(&t.id).copied().unwrap_or(0))
            .cloned()
            .collect();
        if claimed.is_empty() {
            return;
        }
        let mut load = Load::default();
        for t in self
            .ledger
            .todos()
            .filter(|t| t.state == TodoState::Claimed)
        {
            let k = (t.queue.clone(), t.concurrency_key.clone());
            *load.claimed.entry(k).or_default() += 1;
        }
        let since = self.now.saturating_sub(flow::WINDOW);
        for t in claimed {
            self.claims_seen.insert(t.id.clone(), t.attempts_total);
            let Some(limits) = self.limits.get(&t.queue).copied() else {
                continue;
            };
            self.count("flow_claim");
            let log = self.rate_log.entry(t.queue.clone()).or_default();
            log.retain(|&at| at > since);
            load.recent.insert(t.queue.clone(), log.len() as u32);
            if limits.claims_per_minute.is_some() {
                log.push(self.now);
            }
            // The todo counts in `load` when it is claimed still, and `held` does not count it
            // against itself: either way, what the others held at its claim.
            if let Some(h) = flow::held(&limits, &load, &t) {
                let detail = format!(
                    "{} (queue {}, key {:?}) was claimed although {h} ({})",
                    t.id,
                    t.queue,
                    t.concurrency_key,
                    limits.describe()
                );
                return self.violate(Kind::Correctness, "flow_limits", detail);
            }
        }
    }

    /// The server's invariants, over one todo or all: the ledger's own (among them, died exactly
    /// when the lease lapsed), nothing lost, history immutable, dead letters only at the cap.
    pub(super) fn check_todos(&mut self, touched: &BTreeSet<String>, full: bool) {
        if full {
            if let Err(e) = self.ledger.check() {
                self.violate(Kind::Correctness, "ledger_check", e);
                return;
            }
            // No todo lost or duplicated: ids are unique in the ledger, and none is ever deleted.
            let held = self.ledger.todos().count();
            if held != self.added.len() {
                self.violate(
                    Kind::Correctness,
                    "no_todo_lost",
                    format!("{} todos added, the ledger holds {held}", self.added.len()),
                );
                return;
            }
        }
        let mut problems = Vec::new();
        for t in touched.iter().filter_map(|id| self.ledger.todo(id)) {
            if let Err(e) = relay_core::ledger::check_todo(t, self.ledger.attempts(&t.id)) {
                problems.push(("ledger_check", format!("todo {}: {e}", t.id)));
            }
            // Only the attempt budget's dead letters wait for the cap; the other reasons
            // (a non-retryable fail, a repeated failure, a deadline) stop it early on purpose.
            if t.dead_letter_reason == Some(relay_core::ledger::DeadLetterReason::AttemptsExhausted)
                && t.attempt < t.max_attempts
            {
                problems.push((
                    "dead_letter_at_cap",
                    format!(
                        "{} dead-lettered at attempt {}/{}",
                        t.id, t.attempt, t.max_attempts
                    ),
                ));
            }
            // The lease rule of each close (died exactly when the lease lapsed, no stale
            // write) is check_todo's, above.
            for a in self.ledger.attempts(&t.id).filter(|a| !a.is_open()) {
                let key = (t.id.clone(), a.seq);
                match self.closed.get_mut(&key) {
                    Some(seen) if seen == a => {}
                    Some(seen) if may_follow(seen, a) => *seen = a.clone(),
                    Some(_) => problems.push((
                        "closed_once",
                        format!("{} seq {} changed after it closed", t.id, a.seq),
                    )),
                    None => {
                        self.closed.insert(key, a.clone());
                    }
                }
            }
            if let Some(p) = answer_problem(&self.given, t, self.ledger.attempts(&t.id)) {
                problems.push(p);
            }
            if let Some(detail) = super::tasks::end_problem(&mut self.task_ends, t) {
                problems.push(("task_terminal_final", detail));
            }
            let (seen, problem) = spend_problem(self.spend.get(&t.id), t);
            problems.extend(problem);
            match self.spend.get_mut(&t.id) {
                Some(s) => *s = seen,
                None => {
                    self.spend.insert(t.id.clone(), seen);
                }
            }
        }
        if let Some((inv, detail)) = problems.into_iter().next() {
            self.violate(Kind::Correctness, inv, detail);
        }
    }

    /// Processes: none outlives its relay's lease, or the server's, by more than a second (and
    /// the drift bound), and no two relays run a process for one todo while each believes its
    /// lease valid.
    pub(super) fn check_processes(&mut self) {
        let mut problems = Vec::new();
        let tolerance = self.o.lease_ttl * MAX_DRIFT_PPM as u64 / 1_000_000 + 1;
        let mut holders: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for (r, h) in self.hosts.iter().enumerate() {
            let (Some(p), Some(m)) = (&h.proc, &h.relay) else {
                continue;
            };
            if p.signalled || h.paused {
                continue;
            }
            if h.refused.contains(&p.run_id) {
                problems.push((
                    "stops_on_refusal",
                    format!(
                        "relay {r}'s process for {} runs on after the server refused its heartbeat",
                        p.todo
                    ),
                ));
            }
            // The truth, whatever the relay believes: the server's own expiry of the attempt
            // (its last accepted claim or heartbeat + ttl, on the server's clock).
            let expiry = h.runs.get(&p.run_id).and_then(|run| {
                self.ledger
                    .attempts(&run.todo)
                    .find(|a| a.seq == run.seq)
                    .map(|a| a.lease_expires_at)
            });
            if let Some(expiry) = expiry
                && self.now > expiry + tolerance + SECOND
            {
                problems.push((
                    "stops_by_server_expiry",
                    format!(
                        "relay {r}'s process for {} runs at {} although the server's lease ended at {expiry}",
                        p.todo, self.now
                    ),
                ));
            }
            let local = h.machine_clock(self.o.mutation).read(self.now);
            match m.lease_deadline() {
                Some(d) if local <= d + SECOND => {
                    if local + tolerance < d {
                        holders.entry(p.todo.as_str()).or_default().push(r);
                    }
                }
                d => problems.push((
                    "process_within_lease",
                    format!(
                        "relay {r}'s process for {} runs at local {} with lease deadline {:?}",
                        p.todo,
                        local.ms(),
                        d.map(Mono::ms)
                    ),
                )),
            }
        }
        for (todo, rs) in holders {
            if rs.len() > 1 {
                problems.push((
                    "one_holder",
                    format!("relays {rs:?} both run {todo} under a lease they believe valid"),
                ));
            }
        }
        if let Some((inv, detail)) = problems.into_iter().next() {
            self.violate(Kind::Correctness, inv, detail);
        }
    }
}

/// What a closed attempt may still become: late reports gather on it, and its question's answer
/// is written once; nothing else of it changes.
fn may_follow(seen: &Attempt, a: &Attempt) -> bool {
    let settled = |x: &Attempt| {
        let mut x = super::queue::without_late(x);
        if let Some(q) = x.question.as_mut() {
            (q.answer, q.answered_at, q.answered_by, q.answer_key) = (None, None, None, None);
        }
        x
    };
    let late = a.late_reports_total > seen.late_reports_total
        || (a.late_reports_total == seen.late_reports_total && a.late_reports == seen.late_reports);
    let answer = |x: &Attempt| {
        x.question
            .clone()
            .map(|q| (q.answer, q.answered_at, q.answered_by, q.answer_key))
    };
    let unanswered = seen.question.as_ref().is_some_and(|q| q.answer.is_none());
    late && (unanswered || answer(seen) == answer(a)) && settled(seen) == settled(a)
}

/// An answered question is never lost nor answered twice: each answer the ledger accepted
/// (`given`, by todo and the seq of the attempt that asked) is on that attempt exactly as given,
/// by whoever gave it (an operator, or a task's client), for as long as the attempt is kept;
/// and no attempt holds an answer the ledger did not accept.
pub(super) fn answer_problem<'a>(
    given: &BTreeMap<(String, u32), Given>,
    t: &Todo,
    attempts: impl Iterator<Item = &'a Attempt>,
) -> Option<(&'static str, String)> {
    let todo = |seq| (t.id.clone(), seq);
    let mine: Vec<(u32, &Given)> = given
        .range(todo(0)..=todo(u32::MAX))
        .map(|((_, seq), g)| (*seq, g))
        .collect();
    let mut kept = BTreeSet::new();
    for a in attempts {
        kept.insert(a.seq);
        let held = a.question.as_ref().and_then(|q| {
            q.answer.as_ref().map(|x| {
                (
                    x.as_str(),
                    q.answer_key.as_deref(),
                    q.answered_by.as_deref(),
                )
            })
        });
        let given = mine.iter().find(|(seq, _)| *seq == a.seq).map(|(_, g)| *g);
        match (given, held) {
            (None, None) => {}
            (Some(g), Some(h))
                if h == (g.text.as_str(), Some(g.key.as_str()), Some(g.by.as_str())) => {}
            (Some(g), h) => {
                return Some((
                    "answer_kept",
                    format!(
                        "{} seq {}: the answer {:?} the ledger accepted reads {h:?} on its attempt",
                        t.id, a.seq, g.text
                    ),
                ));
            }
            (None, Some(h)) => {
                return Some((
                    "answered_once",
                    format!(
                        "{} seq {} holds an answer no accepted call gave: {h:?}",
                        t.id, a.seq
                    ),
                ));
            }
        }
    }
    let lost = mine
        .into_iter()
        .find(|(seq, _)| *seq > t.attempts_pruned && !kept.contains(seq));
    lost.map(|(seq, g)| {
        (
            "answer_kept",
            format!(
                "{} seq {seq}, answered {:?}, is gone although not pruned",
                t.id, g.text
            ),
        )
    })
}

/// What the invariants remember of a todo's spend between checks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct SpendSeen {
    spent: Usage,
    /// The todo had reached its budget: its newest attempt then, and that budget.
    over: Option<(u32, Budget)>,
}

/// Spend never decreases, figure by figure; and a todo whose spend reached its budget is never
/// claimed again (no attempt opens on it) unless an operator's retry lifted the budget. Answers
/// what to remember for the next check, and the first rule broken.
pub(super) fn spend_problem(
    seen: Option<&SpendSeen>,
    t: &Todo,
) -> (SpendSeen, Option<(&'static str, String)>) {
    let mut problem = None;
    if let Some(s) = seen {
        let (was, now) = (s.spent, t.spent);
        if now.cost_micros < was.cost_micros
            || now.input_tokens < was.input_tokens
            || now.output_tokens < was.output_tokens
        {
            problem = Some((
                "spend_never_decreases",
                format!("{} had spent {was:?}, now {now:?}", t.id),
            ));
        }
        if let Some((seq, budget)) = s.over
            && budget == t.budget
            && t.attempts_total > seq
        {
            problem = Some((
                "never_claimed_over_budget",
                format!(
                    "{} reached its budget {budget:?} at attempt {seq}, and attempt {} opened",
                    t.id, t.attempts_total
                ),
            ));
        }
    }
    let over = match seen.and_then(|s| s.over) {
        Some((seq, budget)) if budget == t.budget => Some((seq, budget)),
        _ => t.over_budget().then_some((t.attempts_total, t.budget)),
    };
    let seen = SpendSeen {
        spent: t.spent,
        over,
    };
    (seen, problem)
}

#[cfg(test)]
mod tests {
    use relay_core::ledger::{Ledger, LedgerConfig, NewTodo, Op};

    use super::*;

    fn todo() -> Todo {
        let mut ledger = Ledger::new(LedgerConfig::default());
        let add = Op::AddTodo {
            now: T0,
            endpoint: ENDPOINT.into(),
            new: NewTodo {
                id: "td_0".into(),
                queue: QUEUE.into(),
                title: "fix thing 0".into(),
                budget: Budget {
                    cost_micros: None,
                    tokens: Some(1_000),
                },
                ..NewTodo::default()
            },
        };
        ledger
            .apply(add)
            .and_then(relay_core::ledger::Answer::todo)
            .expect("added")
    }

    #[test]
    fn spend_that_decreases_is_caught() {
        let mut t = todo();
        t.spent.output_tokens = 40;
        let (seen, problem) = spend_problem(None, &t);
        assert_eq!(problem, None);
        t.spent.input_tokens = 500;
        let (seen, problem) = spend_problem(Some(&seen), &t);
        assert_eq!(problem, None, "growing is fine");
        t.spent.output_tokens = 39;
        let (_, problem) = spend_problem(Some(&seen), &t);
        assert_eq!(problem.map(|p| p.0), Some("spend_never_decreases"));
    }

    #[test]
    fn a_claim_after_the_budget_was_reached_is_caught_unless_a_retry_lifted_it() {
        let mut t = todo();
        t.attempts_total = 2;
        t.spent.input_tokens = 600;
        let (seen, _) = spend_problem(None, &t);
        t.spent.output_tokens = 400;
        let (seen, problem) = spend_problem(Some(&seen), &t);
        assert_eq!((problem, seen.over), (None, Some((2, t.budget))));
        // Another attempt opens on the todo at its budget.
        let mut claimed = t.clone();
        claimed.attempts_total = 3;
        let (_, problem) = spend_problem(Some(&seen), &claimed);
        assert_eq!(problem.map(|p| p.0), Some("never_claimed_over_budget"));
        // The operator's retry lifted the budget: the next claim is allowed.
        claimed.budget = Budget::default();
        let (after, problem) = spend_problem(Some(&seen), &claimed);
        assert_eq!((problem, after.over), (None, None));
    }
}
