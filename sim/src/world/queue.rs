//! The simulated queue server: the ledger behind the tool calls, its reaper and retry requeue.

use relay_core::ErrorCode;
use relay_core::ledger::flow::{self, Limits, LimitsChange};
use relay_core::ledger::{
    self, Attempt, Disposition, Op, Outcome, Todo, TodoState, TokenHash, transition,
};
use relay_core::relay::LeaseToken;
use relay_core::relay::summary::VerdictReason;
use relay_core::serve::{Caller, Draw, Serving, Step, refusal, tool_of};
use relay_core::wire::Tool;

use crate::options::Mutation;

use super::*;

impl World {
    pub(super) fn reap(&mut self) {
        // The rows as they were, for the canary that closes an attempt a second time only.
        let canary = self.o.mutation == Some(Mutation::ReaperClosesTwice);
        let before: Vec<(Todo, Option<Attempt>)> = self
            .ledger
            .todos()
            .filter(|t| canary && t.state == TodoState::Claimed)
            .map(|t| {
                let open = self.ledger.attempts(&t.id).last().filter(|a| a.is_open());
                (t.clone(), open.cloned())
            })
            .collect();
        match self
            .ledger
            .apply(Op::Reap { now: self.now })
            .and_then(ledger::Answer::todos)
        {
            Ok(reaped) => {
                for t in &reaped {
                    self.touched.insert(t.id.clone());
                    self.count("reaped");
                    if canary
                        && let Some((old, open)) = before.iter().find(|(b, _)| b.id == t.id)
                        && let Ok(Some(change)) = transition::reap(self.now, old, open.as_ref())
                        && let Err(e) = self.ledger.apply_change(change)
                    {
                        self.violate(Kind::Correctness, "closed_once", e.to_string());
                    }
                }
                self.ring(&reaped, relay_core::doorbell::Offer::Requeued);
            }
            Err(e) => self.violate(Kind::Correctness, "server", e.to_string()),
        }
    }

    /// Todo `n`'s queue and concurrency key, drawn from a stream of the todo's own (`work`
    /// without a key where the options name no queues).
    pub(super) fn todo_flow(&self, n: usize) -> (String, Option<String>) {
        let f = &self.o.flow;
        if f.queues.is_empty() {
            return (QUEUE.into(), None);
        }
        let mut r = Rng::stream(self.o.seed, &format!("flow-{n}"));
        let q = r.below(f.queues.len() as u64) as usize;
        let key = (f.keys > 0 && r.chance(f.keyed))
            .then(|| format!("key-{}", r.below(u64::from(f.keys))));
        (f.queues[q].0.clone(), key)
    }

    /// The operator sets `queue`'s limits (all three; none lifts them) through the ledger's own
    /// operation. The world keeps the operator's limits for its checks; the limit canary hands
    /// the ledger each limit raised by one.
    pub(super) fn set_limits(&mut self, queue: &str, limits: Limits) {
        let handed = if self.o.mutation == Some(Mutation::LimitOffByOne) {
            let up = |l: Option<u32>| l.map(|n| n + 1);
            Limits {
                max_claimed: up(limits.max_claimed),
                max_claimed_per_key: up(limits.max_claimed_per_key),
                claims_per_minute: up(limits.claims_per_minute),
            }
        } else {
            limits
        };
        let op = Op::SetQueueLimits {
            now: self.now,
            actor: Actor::cli(),
            queue: queue.into(),
            change: LimitsChange {
                max_claimed: Some(handed.max_claimed),
                max_claimed_per_key: Some(handed.max_claimed_per_key),
                claims_per_minute: Some(handed.claims_per_minute),
            },
        };
        match self.ledger.apply(op) {
            Ok(ledger::Answer::Flow(f)) => {
                let kept = f.limits.iter().find(|(q, _)| q == queue).map(|(_, l)| *l);
                if kept.unwrap_or_default() != handed {
                    let detail = format!("{queue}'s limits were set to {handed:?}, kept {kept:?}");
                    self.violate(Kind::Correctness, "limits_kept", detail);
                }
                // A limit lowered below what the queue holds: it stays over it until claims
                // close, and no claim is granted meanwhile (see `check_flow`).
                if limits
                    .max_claimed
                    .is_some_and(|m| f.load.claimed_in(queue) > m)
                {
                    self.count("limit_below_claimed");
                }
            }
            Ok(other) => {
                let detail = format!("setting {queue}'s limits answered {other:?}");
                self.violate(Kind::Correctness, "server", detail);
            }
            Err(e) => self.violate(Kind::Correctness, "server", e.to_string()),
        }
        if limits.is_empty() {
            self.limits.remove(queue);
            self.rate_log.remove(queue);
        } else {
            self.limits.insert(queue.into(), limits);
        }
    }

    /// Counts a `claim_next` that answered empty while a todo it could have claimed was held
    /// back by its queue's limits (as the ledger reports its flow, read through `flow::holds`),
    /// and which limit held the first such todo back (`flow::held`).
    fn count_held_back(&mut self, actor: &Actor, queues: Option<&[String]>) {
        let f = match self.ledger.apply(Op::QueueFlow { now: self.now }) {
            Ok(ledger::Answer::Flow(f)) => f,
            other => {
                let detail = format!("the queues' flow answered {other:?}");
                return self.violate(Kind::Correctness, "server", detail);
            }
        };
        let holds = flow::holds(&f.limits, &f.load, &f.paused);
        let now = self.now;
        let held = self
            .ledger
            .todos()
            .filter(|t| transition::claimable(now, t, actor, queues) && holds.holds(t))
            .find_map(|t| {
                let (_, l) = f.limits.iter().find(|(q, _)| q == &t.queue)?;
                flow::held(l, &f.load, t)
            });
        if let Some(h) = held {
            self.count("claims_held_back");
            self.count(match h {
                flow::Held::Full(_) => "held_back_full",
                flow::Held::KeyFull(..) => "held_back_key",
                flow::Held::Rate(_) => "held_back_rate",
            });
        }
    }

    // -----------------------------------------------------------------------------------------
    // The relay side: feeding the machine and carrying out its commands.
    // -----------------------------------------------------------------------------------------

    /// The server's side of relay `r`'s `tools/call`: core's serving over the ledger, the very
    /// conversion the MCP server runs, under the grant of the relay's endpoint. Around it, the
    /// simulator's own checks (a stale fence accepted, dead letters), what it counts, the
    /// operators it sends a question to, the claims that limits held back, and its canary (a
    /// server that skips the fence).
    pub(super) fn serve(&mut self, r: usize, params: &Value) -> Value {
        let (tool, args) = match tool_of(params) {
            Ok(t) => t,
            Err(e) => {
                self.violate(Kind::Correctness, "wire", e.clone());
                return refusal(&relay_core::Error::invalid(e));
            }
        };
        let arg = |k: &str| {
            args.and_then(|a| a.get(k))
                .and_then(Value::as_str)
                .map(str::to_string)
        };
        let (todo, token) = (arg("id"), arg("lease_token"));
        let stale = match (&todo, &token) {
            (Some(t), Some(k)) => self.stale(t, TokenHash::of(k)),
            _ => false,
        };
        // What the call may have changed of the todo's attempts, a late report's note aside
        // (it is no write): every one of them when the fence is stale (any change is a breach),
        // else how many there are and the newest (what a close changes, which the dead-letter
        // count asks about).
        let attempts = |w: &World, id: &str| {
            let all = w.ledger.attempts(id);
            let n = all.clone().count();
            let keep = if stale { n } else { 1 };
            (
                n,
                all.skip(n - keep.min(n))
                    .map(without_late)
                    .collect::<Vec<_>>(),
            )
        };
        let before = todo.as_deref().map(|id| attempts(self, id));
        if let Some(id) = &todo {
            self.touched.insert(id.clone());
        }
        let caller = Caller {
            endpoint: ENDPOINT.into(),
            session: None,
            grant: self.grants[r].clone(),
            tasks: None,
        };
        let skip_fence = self.o.mutation == Some(Mutation::ServerSkipsFence);
        let (ledger, tokens) = (&mut self.ledger, &mut self.tokens);
        let (mut late_kept, mut late_moved, mut came_empty) = (false, None, None);
        let mut apply = |op| {
            let op = if skip_fence {
                skip_the_fence(ledger, op)
            } else {
                op
            };
            let Op::NoteLate { id, .. } = &op else {
                let next = match &op {
                    Op::ClaimNext { actor, queues, .. } => Some((actor.clone(), queues.clone())),
                    _ => None,
                };
                let answer = ledger.apply(op);
                if matches!(answer, Ok(ledger::Answer::Next(None))) {
                    came_empty = next;
                }
                return answer;
            };
            let before = ledger.todo(id).cloned();
            let id = id.clone();
            let answer = ledger.apply(op);
            late_kept = matches!(answer, Ok(ledger::Answer::Late(Some(_))));
            if ledger.todo(&id).cloned() != before {
                late_moved = Some(id);
            }
            answer
        };
        // The serving loop (`relay_core::serve::serve`), kept open here so that a call answered
        // with a refusal although it changed the ledger (a heartbeat that reached the budget)
        // is counted and checked like any other change.
        let (mut serving, mut step) =
            Serving::start(tool, args, caller, self.now, &mut Tokens(tokens));
        let served = loop {
            match step {
                Step::Apply(op) => step = serving.answered(apply(op), &mut Tokens(tokens)),
                Step::Done(done) => break done,
            }
        };
        if late_kept {
            self.count("late_report");
        }
        if let Some((actor, queues)) = came_empty
            && !self.limits.is_empty()
        {
            self.count_held_back(&actor, queues.as_deref());
        }
        if let Some(id) = late_moved {
            self.violate(
                Kind::Correctness,
                "late_report_keeps_state",
                format!("a late report changed todo {id}"),
            );
        }
        let mut s = match served {
            Ok(s) => s,
            Err(e) => {
                if e.code == ErrorCode::Internal {
                    self.violate(Kind::Correctness, "server", e.to_string());
                }
                return refusal(&e);
            }
        };
        let id = todo.or_else(|| s.answer["todo"]["id"].as_str().map(str::to_string));
        let changed = match (&id, before) {
            (Some(id), Some(before)) => attempts(self, id) != before,
            _ => false,
        };
        if let Some(id) = &id {
            self.touched.insert(id.clone());
            if stale && (tool == Tool::Heartbeat || changed) {
                self.violate(
                    Kind::Correctness,
                    "stale_fence",
                    format!(
                        "a {} for {id} under a stale lease was accepted",
                        tool.as_str()
                    ),
                );
            }
        }
        match s.closed {
            Some((Outcome::LeaseExpired, _)) => self.count("takeover"),
            Some((_, Disposition::DeadLettered)) if changed => self.count("dead_letter"),
            _ => {}
        }
        if changed {
            match s.answer["dead_letter_reason"].as_str() {
                Some("non_retryable") => self.count("non_retryable_dead_letter"),
                Some("repeated_failure") => self.count("repeated_failure_dead_letter"),
                Some("input_requests_exhausted") => {
                    self.count("input_requests_exhausted_dead_letter");
                }
                Some("budget_exhausted") => self.count("budget_exhausted_dead_letter"),
                _ => {}
            }
            let reason = args.and_then(|a| a.pointer("/result/harness/reason"));
            if tool == Tool::Fail
                && reason.and_then(serde_json::Value::as_str)
                    == Some(VerdictReason::NeedsInputUnsupported.as_str())
            {
                self.count("asked_unsupported");
            }
            // The server stopped the attempt at its budget: the holder hears a conflict.
            if s.refused.is_some()
                && s.closed == Some((Outcome::Canceled, Disposition::DeadLettered))
            {
                self.count("budget_stop");
            }
        }
        if let (Some(id), true) = (&id, changed)
            && s.closed == Some((Outcome::NeedsInput, Disposition::AwaitingInput))
        {
            self.on_question(id);
        }
        if let Some((t, offer)) = &s.ring {
            self.ring(std::slice::from_ref(t), *offer);
        }
        // Now and then a stale twin of the worker (same lease token) reports success after the
        // fail closed the attempt: refused, and kept as a late report.
        if tool == Tool::Fail
            && changed
            && self.step.is_multiple_of(3)
            && let (Some(id), Some(token)) = (&id, &token)
        {
            let late = json!({"name": "complete", "arguments": {
                "id": id, "lease_token": token, "summary": "a stale twin finished too",
            }});
            if self.serve(r, &late)["isError"] != json!(true) {
                self.violate(
                    Kind::Correctness,
                    "late_report_refused",
                    format!("a complete for {id} after its attempt closed was accepted"),
                );
            }
        }
        match s.refused.take() {
            Some(e) => refusal(&e),
            None => s.result(),
        }
    }

    /// Whether a write under `hash` would be stale: the todo has no open attempt under that
    /// token whose lease is still valid.
    pub(super) fn stale(&self, todo: &str, hash: TokenHash) -> bool {
        let open = self.ledger.attempts(todo).last().filter(|a| a.is_open());
        !open.is_some_and(|a| a.lease_token_hash == Some(hash) && self.now < a.lease_expires_at)
    }

    // -----------------------------------------------------------------------------------------
    // Invariants.
    // -----------------------------------------------------------------------------------------
}

/// An attempt as its close left it, without the late reports it gathered since.
pub(super) fn without_late(a: &Attempt) -> Attempt {
    Attempt {
        late_reports: Vec::new(),
        late_reports_total: 0,
        ..a.clone()
    }
}

/// The fence tokens the simulated server hands out; its relays add no todos.
struct Tokens<'a>(&'a mut Rng);

impl Draw for Tokens<'_> {
    fn todo_id(&mut self) -> Result<String, relay_core::Error> {
        Err(relay_core::Error::internal(
            "the simulated relays add no todos",
        ))
    }
    fn lease_token(&mut self) -> Result<LeaseToken, relay_core::Error> {
        Ok(LeaseToken::new(format!("tok-{}", self.0.hex16())))
    }
    fn task_secret(&mut self) -> Result<String, relay_core::Error> {
        Err(relay_core::Error::internal(
            "the simulated relays make no tasks",
        ))
    }
}

/// The canary of a server that skips the fence: every write compares the open attempt's own
/// token hash, whatever the caller presented.
fn skip_the_fence(ledger: &Ledger, mut op: Op) -> Op {
    let own = |id: &str, presented: Option<TokenHash>| {
        ledger
            .attempts(id)
            .last()
            .filter(|a| a.is_open())
            .map_or(presented, |a| a.lease_token_hash)
    };
    match &mut op {
        Op::Heartbeat { id, token_hash, .. } | Op::Release { id, token_hash, .. } => {
            *token_hash = own(id, *token_hash);
        }
        Op::Complete { id, report, .. } | Op::Fail { id, report, .. } => {
            report.token_hash = own(id, report.token_hash);
        }
        _ => {}
    }
    op
}
