//! The network between relays and the server: sends, delays, losses and answers.

use relay_core::relay::{
    Command, Input, LeaseError, RequestId, ResultError, call_params_with, failed_input,
    result_input,
};
use relay_core::time::{Millis, SECOND};

use crate::options::Mutation;

use super::*;

impl World {
    /// Puts a lease command on the wire as the lease client does: its `tools/call` params,
    /// built by core's client side of the contract, with the agent's usage on a heartbeat or
    /// report (read from its usage file now, as the driver reads it; sent where declared).
    pub(super) fn send(&mut self, r: usize, req: RequestId, run_id: u64, command: Command) {
        let life = self.hosts[r].life;
        let usage = match command {
            Command::SendHeartbeat { .. } | Command::SendReport { .. } => self.usage_of(r, run_id),
            _ => None,
        };
        let Some(params) = call_params_with(&command, &self.caps[r], usage.as_ref()) else {
            self.violate(
                Kind::Correctness,
                "contract",
                format!("relay {r}: sent a command that is not a lease call"),
            );
            return;
        };
        if params["arguments"].get("usage").is_some() {
            self.count("usage_reported");
        }
        self.hosts[r]
            .pending
            .insert(req, Pending { run_id, command });
        self.schedule(
            self.now + REQUEST_TIMEOUT,
            Ev::ClientTimeout {
                relay: r,
                life,
                req,
            },
        );
        if self.hosts[r].partitioned
            || (!self.healed && self.net.chance(self.o.faults.request_loss))
        {
            self.count("request_lost");
            return;
        }
        let copies = if !self.healed && self.net.chance(self.o.faults.duplicate) {
            self.count("duplicate");
            2
        } else {
            1
        };
        for copy in 0..copies {
            // A duplicate may also straggle in long after the original (a retransmission
            // stuck in a proxy): by then the lease it speaks for may belong to someone else.
            let straggle = if copy > 0 && self.net.chance(500) {
                self.net.range(SECOND, 2 * self.o.lease_ttl)
            } else {
                0
            };
            let at = self.now + self.delay() + straggle;
            self.schedule(
                at,
                Ev::ServerRecv {
                    relay: r,
                    life,
                    req,
                    params: params.clone(),
                },
            );
        }
    }

    pub(super) fn delay(&mut self) -> Millis {
        let max = if self.healed {
            0
        } else {
            self.o.faults.delay_max
        };
        self.net.range(1, 20) + if max > 0 { self.net.below(max) } else { 0 }
    }

    pub(super) fn on_client_recv(&mut self, r: usize, life: u32, req: RequestId, result: &Value) {
        if self.hosts[r].life != life {
            return;
        }
        // An answer after the client gave up on the request is dropped, as a real client does.
        let Some(p) = self.hosts[r].pending.remove(&req) else {
            return;
        };
        self.answer(r, &p, Ok(result));
    }

    /// Hands the machine what the lease client would: the result read by core's client side of
    /// the contract, or the failure (`Err`: the request got no answer).
    pub(super) fn answer(&mut self, r: usize, p: &Pending, result: Result<&Value, LeaseError>) {
        let read = match result {
            Ok(result) => result_input(&p.command, result),
            Err(e) => failed_input(&p.command, e).map(Ok),
        };
        let mut input = match read {
            Some(Ok(input)) => input,
            Some(Err(e)) => {
                if let ResultError::Malformed(a) = &e {
                    self.violate(Kind::Correctness, "wire", format!("our own answer: {a}"));
                }
                let kind = e.kind(str::to_string);
                match failed_input(&p.command, kind) {
                    Some(input) => input,
                    None => return,
                }
            }
            None => return,
        };
        match &input {
            Input::ClaimAnswered { claim, .. } => {
                let run = Run {
                    todo: claim.todo_id.clone(),
                    seq: claim.attempt_seq as u32,
                    report_answered: false,
                    ..Run::default()
                };
                self.hosts[r].runs.insert(p.run_id, run);
            }
            Input::ReportAnswered { .. } => {
                if let Some(run) = self.hosts[r].runs.get_mut(&p.run_id) {
                    run.report_answered = true;
                }
            }
            Input::HeartbeatFailed { request, error } if error.is_lease_loss() => {
                self.hosts[r].refused.insert(p.run_id);
                if self.o.mutation == Some(Mutation::IgnoreHeartbeatConflict) {
                    input = Input::HeartbeatOk { request: *request };
                }
            }
            _ => {}
        }
        self.feed(r, input);
    }

    // -----------------------------------------------------------------------------------------
    // The server side.
    // -----------------------------------------------------------------------------------------

    pub(super) fn on_server_recv(&mut self, r: usize, life: u32, req: RequestId, params: &Value) {
        if self.outage {
            self.count("request_lost");
            return;
        }
        let result = if modern(self.o.seed, r) {
            self.serve_modern(r, params)
        } else {
            self.serve(r, params)
        };
        if self.hosts[r].partitioned
            || (!self.healed && self.net.chance(self.o.faults.response_loss))
        {
            self.count("response_lost");
            return;
        }
        let at = self.now + self.delay();
        self.schedule(
            at,
            Ev::ClientRecv {
                relay: r,
                life,
                req,
                result,
            },
        );
    }
}

/// Whether relay `r` speaks the 2026-07-28 era (the daemon's lease client speaks whichever its
/// server does): half the relays of a seed, alternating, so that every seed with two relays or
/// more mixes the eras on one ledger. Derived, not drawn, so that the options' stream is as it
/// was.
fn modern(seed: u64, r: usize) -> bool {
    (seed as usize).wrapping_add(r).is_multiple_of(2)
}

impl World {
    /// A `tools/call` in the 2026-07-28 era, through core's era rules on both sides: stamped as
    /// the client stamps it, classified as the server classifies it (it must be served
    /// modern, never refused), served, and framed for the era (the relay reads the framed
    /// answer as liberally as any).
    fn serve_modern(&mut self, r: usize, params: &Value) -> Value {
        use relay_core::mcp::{self, Method, era};
        let info = json!({"name": "relay-sim", "version": "0"});
        let (stamped, headers) = era::stamp("tools/call", params.clone(), &info);
        let h = era::Headers::of_pairs(&headers);
        let id = json!(0);
        let served = era::classify(&h, "tools/call", Some(&stamped), &id)
            .and_then(|e| Method::of("tools/call", &e, &id).map(|m| (e, m)));
        match served {
            Ok((era, method)) if era.is_modern() => {
                self.count("modern_call");
                let result = self.serve(r, &stamped);
                mcp::framed(&era, method, result)
            }
            other => {
                self.violate(
                    Kind::Correctness,
                    "era",
                    format!("a stamped 2026-07-28 call was not served in its era: {other:?}"),
                );
                relay_core::serve::refusal(&relay_core::Error::invalid("era"))
            }
        }
    }
}
