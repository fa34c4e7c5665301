//! The network between relays and the server: sends, delays, losses and answers.

use relay_core::ErrorCode;
use relay_core::relay::{Input, LeaseError, RequestId};
use relay_core::time::{Millis, SECOND};

use crate::options::Mutation;

use super::*;

impl World {
    pub(super) fn send(&mut self, r: usize, req: RequestId, run_id: u64, call: Call) {
        let life = self.hosts[r].life;
        let (is_report, is_heartbeat) = (
            matches!(call, Call::Report { .. }),
            matches!(call, Call::Heartbeat { .. }),
        );
        self.hosts[r].pending.insert(
            req,
            Pending {
                run_id,
                is_report,
                is_heartbeat,
            },
        );
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
                    call: call.clone(),
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

    pub(super) fn on_client_recv(
        &mut self,
        r: usize,
        life: u32,
        req: RequestId,
        answer: Result<Answer, ErrorCode>,
    ) {
        if self.hosts[r].life != life {
            return;
        }
        // An answer after the client gave up on the request is dropped, as a real client does.
        let Some(p) = self.hosts[r].pending.remove(&req) else {
            return;
        };
        self.answer(r, req, &p, answer.map_err(LeaseError::Code));
    }

    pub(super) fn answer(
        &mut self,
        r: usize,
        req: RequestId,
        p: &Pending,
        result: Result<Answer, LeaseError>,
    ) {
        let input = match result {
            Ok(Answer::Claimed(c)) => {
                let c = *c;
                self.hosts[r].runs.insert(
                    p.run_id,
                    Run {
                        todo: c.todo_id.clone(),
                        seq: c.attempt_seq as u32,
                        report_answered: false,
                    },
                );
                Input::ClaimAnswered {
                    request: req,
                    claim: c,
                }
            }
            Ok(Answer::Empty) => Input::ClaimEmpty { request: req },
            Ok(Answer::HeartbeatOk) => Input::HeartbeatOk { request: req },
            Ok(Answer::Reported { dead_letter }) => {
                if let Some(run) = self.hosts[r].runs.get_mut(&p.run_id) {
                    run.report_answered = true;
                }
                Input::ReportAnswered {
                    request: req,
                    dead_letter,
                    next_retry_at: None,
                }
            }
            Err(e) if p.is_heartbeat => {
                if e.is_lease_loss() {
                    self.hosts[r].refused.insert(p.run_id);
                }
                if self.o.mutation == Some(Mutation::IgnoreHeartbeatConflict) && e.is_lease_loss() {
                    Input::HeartbeatOk { request: req }
                } else {
                    Input::HeartbeatFailed {
                        request: req,
                        error: e,
                    }
                }
            }
            Err(e) if p.is_report => Input::ReportFailed {
                request: req,
                error: e,
            },
            Err(e) => Input::ClaimFailed {
                request: req,
                error: e,
            },
        };
        self.feed(r, input);
    }

    // -----------------------------------------------------------------------------------------
    // The server side.
    // -----------------------------------------------------------------------------------------

    pub(super) fn on_server_recv(&mut self, r: usize, life: u32, req: RequestId, call: Call) {
        if self.outage {
            self.count("request_lost");
            return;
        }
        let answer = self.serve(call);
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
                answer,
            },
        );
    }
}
