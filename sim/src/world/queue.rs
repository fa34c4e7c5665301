//! The simulated queue server: the ledger behind the tool calls, its reaper and retry requeue.

use relay_core::ErrorCode;
use relay_core::ledger::{
    self, Actor, Attempt, ClaimOpts, Op, Report, Todo, TodoState, TokenHash, transition,
};
use relay_core::relay::{ClaimAnswer, LeaseToken, decode_claim};
use relay_core::wire::ClaimOut;

use crate::options::Mutation;

use super::*;

impl World {
    pub(super) fn reap(&mut self) {
        let before: Vec<(Todo, Option<Attempt>)> = self
            .ledger
            .todos()
            .filter(|t| t.state == TodoState::Claimed)
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
                    if self.o.mutation == Some(Mutation::ReaperClosesTwice)
                        && let Some((old, open)) = before.iter().find(|(b, _)| b.id == t.id)
                        && let Ok(Some(change)) = transition::reap(self.now, old, open.as_ref())
                        && let Err(e) = self.ledger.apply_change(change)
                    {
                        self.violate(Kind::Correctness, "closed_once", e.to_string());
                    }
                }
                if !reaped.is_empty() {
                    self.ring();
                }
            }
            Err(e) => self.violate(Kind::Correctness, "server", e.to_string()),
        }
    }

    // -----------------------------------------------------------------------------------------
    // The relay side: feeding the machine and carrying out its commands.
    // -----------------------------------------------------------------------------------------

    pub(super) fn serve(&mut self, call: Call) -> Result<Answer, ErrorCode> {
        let endpoint = Actor::Endpoint {
            endpoint: ENDPOINT.into(),
            session: None,
        };
        let now = self.now;
        match call {
            Call::ClaimNext {
                ttl,
                fence,
                claimant,
            } => {
                let token = fence.then(|| format!("tok-{}", self.tokens.hex16()));
                let opts = ClaimOpts {
                    ttl,
                    claimant: Some(claimant),
                    token_hash: token.as_deref().map(TokenHash::of),
                };
                let op = Op::ClaimNext {
                    now,
                    actor: endpoint,
                    queues: Some(vec![QUEUE.to_string()]),
                    opts,
                };
                match self.ledger.apply(op).and_then(ledger::Answer::next) {
                    Ok(None) => Ok(Answer::Empty),
                    Ok(Some(c)) => {
                        self.touched.insert(c.todo.id.clone());
                        if c.takeover {
                            self.count("takeover");
                        }
                        let out = ClaimOut::claimed(&c, token.map(LeaseToken::new));
                        // The daemon's own decoder reads the answer as JSON, as off the wire.
                        let answer = serde_json::to_value(&out).unwrap_or_default();
                        match decode_claim(&answer) {
                            Ok(ClaimAnswer::Claimed(ct)) => Ok(Answer::Claimed(Box::new(ct))),
                            Ok(ClaimAnswer::Empty) | Err(_) => {
                                self.violate(
                                    Kind::Correctness,
                                    "wire",
                                    "a claim answer did not decode".into(),
                                );
                                Err(ErrorCode::Internal)
                            }
                        }
                    }
                    Err(e) => self.server_error(e),
                }
            }
            Call::Heartbeat { todo, ttl, token } => {
                self.touched.insert(todo.clone());
                let hash = TokenHash::of(&token);
                let stale = self.stale(&todo, hash);
                let fence = self.fence(&todo, hash);
                let op = Op::Heartbeat {
                    now,
                    actor: endpoint,
                    id: todo.clone(),
                    ttl,
                    token_hash: fence,
                };
                match self.ledger.apply(op) {
                    Ok(_) => {
                        if stale {
                            self.violate(
                                Kind::Correctness,
                                "stale_fence",
                                format!("a heartbeat for {todo} under a stale lease was accepted"),
                            );
                        }
                        Ok(Answer::HeartbeatOk)
                    }
                    Err(e) => self.server_error(e),
                }
            }
            Call::Report {
                verb,
                todo,
                token,
                summary,
                artifact,
                result,
            } => {
                self.touched.insert(todo.clone());
                let hash = TokenHash::of(&token);
                let stale = self.stale(&todo, hash);
                let before = self.ledger.attempts(&todo).cloned().collect::<Vec<_>>();
                let actor = endpoint;
                let fence = self.fence(&todo, hash);
                let report = Report {
                    result: result.as_object().map(|_| result.clone()),
                    summary: Some(summary.clone()),
                    artifact,
                    token_hash: fence,
                };
                let op = verb.op(now, actor, todo.clone(), report);
                match self.ledger.apply(op).and_then(ledger::Answer::todo) {
                    Ok(t) => {
                        let changed =
                            self.ledger.attempts(&todo).cloned().collect::<Vec<_>>() != before;
                        if stale && changed {
                            self.violate(
                                Kind::Correctness,
                                "stale_fence",
                                format!("a {verb:?} for {todo} under a stale lease was accepted"),
                            );
                        }
                        if t.dead_letter() && changed {
                            self.count("dead_letter");
                        }
                        Ok(Answer::Reported {
                            dead_letter: t.dead_letter(),
                        })
                    }
                    Err(e) => self.server_error(e),
                }
            }
        }
    }

    /// The token hash the server compares. The canary that skips the fence compares the open
    /// attempt's own hash, whatever the caller presented.
    pub(super) fn fence(&self, todo: &str, presented: TokenHash) -> Option<TokenHash> {
        if self.o.mutation == Some(Mutation::ServerSkipsFence) {
            self.ledger
                .attempts(todo)
                .last()
                .filter(|a| a.is_open())
                .map_or(Some(presented), |a| a.lease_token_hash)
        } else {
            Some(presented)
        }
    }

    /// Whether a write under `hash` would be stale: the todo has no open attempt under that
    /// token whose lease is still valid.
    pub(super) fn stale(&self, todo: &str, hash: TokenHash) -> bool {
        let open = self.ledger.attempts(todo).last().filter(|a| a.is_open());
        !open.is_some_and(|a| a.lease_token_hash == Some(hash) && self.now < a.lease_expires_at)
    }

    pub(super) fn server_error(&mut self, e: relay_core::Error) -> Result<Answer, ErrorCode> {
        if e.code == ErrorCode::Internal {
            self.violate(Kind::Correctness, "server", e.to_string());
        }
        Err(e.code)
    }

    // -----------------------------------------------------------------------------------------
    // Invariants.
    // -----------------------------------------------------------------------------------------
}
