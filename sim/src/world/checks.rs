//! The invariants, checked after every event.

use std::collections::{BTreeMap, BTreeSet};

use relay_core::ledger::Outcome;
use relay_core::relay::{Relay, RelayOutcome, RunRecord};
use relay_core::time::SECOND;

use crate::options::MAX_DRIFT_PPM;

use super::*;

impl World {
    /// No lease call is put on the wire unless the relay holds a live lease: live now, or live
    /// when it began the step that sent the call and not ended earlier in that step. A call
    /// sent outside any step (`strict`, the late-send canary) must be live now.
    pub(super) fn check_lease_live(&mut self, r: usize, run_id: u64, strict: bool, what: &str) {
        let h = &self.hosts[r];
        let local = h.machine_clock(self.o.mutation).read(self.now);
        let live_now = h
            .relay
            .as_ref()
            .and_then(Relay::lease_deadline)
            .is_some_and(|d| local < d);
        let live_in_step = !strict && h.was_live && !h.ended_now.contains(&run_id);
        if !(live_now || live_in_step) {
            self.violate(
                Kind::Correctness,
                "nothing_after_lease_loss",
                format!("relay {r} sent a {what} for run {run_id} without a live lease"),
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

    /// The server's invariants, over one todo or all: the ledger's own, nothing lost, history
    /// immutable, died exactly when the lease lapsed, dead letters only at the cap.
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
            for a in self.ledger.attempts(&t.id).filter(|a| !a.is_open()) {
                let ended = a.ended_at.unwrap_or(0);
                let lapsed = ended >= a.lease_expires_at;
                let reported = matches!(
                    a.outcome,
                    Some(Outcome::Completed | Outcome::Failed | Outcome::Released)
                );
                if a.died() && !lapsed || reported && lapsed {
                    problems.push((
                        "died_iff_lapsed",
                        format!(
                            "{} seq {} closed {:?} at {} with the lease until {}",
                            t.id, a.seq, a.outcome, ended, a.lease_expires_at
                        ),
                    ));
                }
                let key = (t.id.clone(), a.seq);
                match self.closed.get_mut(&key) {
                    // Late reports gather on a closed attempt; nothing else of it changes.
                    Some(seen)
                        if a.late_reports_total > seen.late_reports_total
                            && super::queue::without_late(seen)
                                == super::queue::without_late(a) =>
                    {
                        *seen = a.clone();
                    }
                    Some(seen) if seen != a => problems.push((
                        "closed_once",
                        format!("{} seq {} changed after it closed", t.id, a.seq),
                    )),
                    Some(_) => {}
                    None => {
                        self.closed.insert(key, a.clone());
                    }
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
                        p.todo, local, d
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
