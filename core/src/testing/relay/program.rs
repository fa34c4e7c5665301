//! Relay programs: a program of inputs decoded from bytes, run against one relay with a world
//! that answers only what was asked (plus stale replays), then healed until the machine is
//! idle. The properties read the recorded trace.

use std::collections::BTreeMap;

use serde_json::json;

use crate::error::ErrorCode;
use crate::relay::{
    Capabilities, Command, ExitStatus, HarnessSettings, Input, LeaseError, OnOverlap, Relay,
    RequestId, StopReason,
};
use crate::time::{MINUTE, Millis, Mono, Now, SECOND, Wall};

use super::driver::*;

/// One step of a program.
#[derive(Clone, Debug, PartialEq)]
pub enum RelayOp {
    Advance(Millis),
    Fire {
        within_hours: bool,
    },
    /// Answers the awaited claim (by `x % 8`): 0-2 fenced todo, 3 unfenced todo, 4 empty,
    /// 5 transport, 6 conflict, 7 forbidden.
    ClaimAnswer(u8),
    /// Answers one awaited heartbeat (by `answer % 8`): 0-4 ok, 5 transport, 6 conflict,
    /// 7 not_found.
    HeartbeatAnswer {
        pick: u8,
        answer: u8,
    },
    /// Answers the awaited report (by `x % 8`): 0-2 ok, 3 ok with dead letter,
    /// 4-5 transport, 6 conflict, 7 invalid.
    ReportAnswer(u8),
    ReceiptAnswer {
        ok: bool,
    },
    Spawned,
    SpawnFailed,
    /// The process exits; `summary` 0 none, 1 text, 2 JSON naming the lease token and a
    /// handle, 3 JSON with a malformed handle, 4 a question naming the lease token.
    Exit {
        code: i32,
        summary: u8,
    },
    /// The check exits; its output names the lease token when `leak`.
    CheckExit {
        code: i32,
        leak: bool,
    },
    CheckFailedToStart,
    Stop(StopReason),
    Capabilities {
        supported: bool,
        release: bool,
        /// The server lists `request_input`.
        asks: bool,
    },
    SessionExpired,
    /// Feeds an answer given earlier once more.
    Replay(u8),
    /// The wall clock steps by this many ms (either way); the monotonic one does not.
    WallStep(i64),
}

/// A decoded program: the harness settings it runs under and its steps.
#[derive(Clone, Debug)]
pub struct RelayProgram {
    pub settings: HarnessSettings,
    pub ops: Vec<RelayOp>,
    /// The world answers every heartbeat at once with success (long attempts get to their
    /// check and report); otherwise heartbeats wait for `HeartbeatAnswer` operations.
    pub auto_heartbeat: bool,
}

/// Every byte string is a valid program: the first bytes choose the settings, the rest are
/// operations.
pub fn decode_relay_program(bytes: &[u8]) -> RelayProgram {
    let mut it = bytes.iter().copied();
    let mut b = || it.next().unwrap_or(0);
    let mut s = settings();
    let (f0, f1, f2) = (b(), b(), b());
    s.on_overlap = if f0 & 1 == 0 {
        OnOverlap::Skip
    } else {
        OnOverlap::Queue
    };
    // Mostly enabled: a disabled harness only ever writes skipped records.
    s.enabled = f0 & 0b1110 != 0b1110;
    s.lease_enabled = f0 & 0b111_0000 != 0b111_0000;
    s.heartbeat_interval = [MINUTE, 30 * SECOND, 2 * MINUTE][usize::from(f1 % 3)];
    if f1 & 0b100 != 0 {
        let mut c = with_check(settings(), 3 * MINUTE, 30 * SECOND).success_check;
        if let Some(c) = c.as_mut() {
            c.before = f1 & 0b1000 != 0;
        }
        s.success_check = c;
    }
    s.attempt_receipt = (f1 & 0b10000 != 0).then(|| "cairn.main".into());
    s.timeout = (f1 & 0b100000 != 0).then_some(4 * MINUTE);
    let mut ops = vec![RelayOp::Capabilities {
        supported: f2 & 0b111 != 0b111,
        release: f2 & 0b1000 == 0,
        asks: f2 & 0b1_0000 == 0,
    }];
    let auto_heartbeat = f1 & 0b100_0000 == 0;
    let rest: Vec<u8> = it.collect();
    let mut it = rest.into_iter();
    while let Some(tag) = it.next() {
        let mut b = || it.next().unwrap_or(0);
        ops.push(match tag % 20 {
            0 => RelayOp::Advance(Millis::from(b()) * SECOND),
            1 => RelayOp::Advance(Millis::from(b() % 32) * 15 * SECOND),
            2 | 3 => RelayOp::Fire {
                within_hours: b() % 4 != 0,
            },
            4 | 5 => RelayOp::ClaimAnswer(b()),
            6 | 7 => RelayOp::HeartbeatAnswer {
                pick: b(),
                answer: b(),
            },
            8 | 9 => RelayOp::ReportAnswer(b()),
            10 => RelayOp::ReceiptAnswer { ok: b() % 3 != 0 },
            11 | 12 => RelayOp::Spawned,
            13 | 14 => match b() % 8 {
                0 => RelayOp::SpawnFailed,
                x => RelayOp::Exit {
                    code: [0, 1, 2, -9, 0, 75, 0][usize::from(x - 1)],
                    summary: b() % 5,
                },
            },
            15 | 16 => match b() % 6 {
                0 => RelayOp::CheckFailedToStart,
                x => RelayOp::CheckExit {
                    code: [0, 1, 75, 75, 0][usize::from(x - 1)],
                    leak: b() % 2 == 0,
                },
            },
            17 => match b() % 8 {
                0..=2 => RelayOp::Stop(
                    [
                        StopReason::Shutdown,
                        StopReason::OperatorStop,
                        StopReason::HarnessRemoved,
                        StopReason::UsageLimit,
                    ][usize::from(b() % 4)],
                ),
                3 => RelayOp::SessionExpired,
                _ => RelayOp::Capabilities {
                    supported: b() % 4 != 0,
                    release: b() % 2 == 0,
                    asks: b() % 2 == 0,
                },
            },
            18 => RelayOp::Replay(b()),
            _ => RelayOp::WallStep((i64::from(b()) - 128) * 30 * SECOND as i64),
        });
    }
    RelayProgram {
        settings: s,
        ops,
        auto_heartbeat,
    }
}

/// One input and what it led to.
#[derive(Clone, Debug)]
pub struct Step {
    /// The monotonic reading the input was handled at.
    pub now: Mono,
    pub input: Input,
    pub commands: Vec<Command>,
    /// `harness describe` after the step, as JSON.
    pub describe: String,
    /// The relay's own `Debug` after the step.
    pub debug: String,
}

/// What a program did.
#[derive(Clone, Debug)]
pub struct Trace {
    pub settings: HarnessSettings,
    pub steps: Vec<Step>,
    /// The lease token handed to each run.
    pub tokens: BTreeMap<u64, String>,
}

/// The world around one relay: what it asked for and has not been answered yet.
struct World {
    relay: Relay,
    /// The host's monotonic clock; the wall clock reads `now + wall_offset` (see
    /// [`RelayOp::WallStep`]).
    now: Mono,
    wall_offset: i64,
    /// Whether `WallStep` operations step the wall clock (the comparison run ignores them).
    wall_steps: bool,
    trace: Trace,
    claim: Option<(RequestId, u64)>,
    heartbeats: Vec<RequestId>,
    report: Option<RequestId>,
    receipt: Option<RequestId>,
    /// The process: run id and whether it started.
    process: Option<(u64, bool)>,
    check: Option<u64>,
    answered: Vec<Input>,
    auto_heartbeat: bool,
}

impl World {
    fn feed(&mut self, input: Input) -> Result<(), String> {
        // A timer due now goes first, in a step of its own, as a punctual driver delivers
        // it; the machine would handle it first anyway, and the trace then shows which
        // commands the timer caused and which the input.
        if input != Input::TimerFired
            && self
                .relay
                .poll_timeout()
                .is_some_and(|(at, _)| at <= self.now)
        {
            self.feed(Input::TimerFired)?;
        }
        let now = self.clock();
        self.relay
            .handle_input(now, input.clone())
            .map_err(|e| format!("at {}: {input:?} was refused: {e}", self.now.ms()))?;
        let mut commands = Vec::new();
        while let Some(c) = self.relay.poll_command() {
            match &c {
                Command::SendClaimNext {
                    request, run_id, ..
                } => {
                    self.claim = Some((*request, *run_id));
                }
                Command::SendHeartbeat { request, .. } => self.heartbeats.push(*request),
                Command::SendReport { request, .. } => self.report = Some(*request),
                Command::UploadReceipt { request, .. } => self.receipt = Some(*request),
                Command::Spawn { run_id, .. } => self.process = Some((*run_id, false)),
                Command::RunCheck { run_id, .. } => self.check = Some(*run_id),
                _ => {}
            }
            commands.push(c);
        }
        let describe = serde_json::to_string(&self.relay.describe(now)).unwrap_or_default();
        let debug = format!("{:?}", self.relay);
        self.trace.steps.push(Step {
            now: self.now,
            input,
            commands,
            describe,
            debug,
        });
        if self.auto_heartbeat {
            for request in std::mem::take(&mut self.heartbeats) {
                self.answer(Input::HeartbeatOk { request })?;
            }
        }
        Ok(())
    }

    /// Both clocks as the machine reads them now.
    fn clock(&self) -> Now {
        Now {
            mono: self.now,
            wall: Wall::from_ms(self.now.ms().saturating_add_signed(self.wall_offset)),
        }
    }

    fn answer(&mut self, input: Input) -> Result<(), String> {
        self.answered.push(input.clone());
        self.feed(input)
    }

    /// Moves to `t` the way a driver does: each timer at its own instant.
    fn advance_to(&mut self, t: Mono) -> Result<(), String> {
        for _ in 0..10_000 {
            match self.relay.poll_timeout() {
                Some((at, _)) if at <= t => {
                    self.now = self.now.max(at);
                    self.feed(Input::TimerFired)?;
                }
                _ => break,
            }
        }
        self.now = self.now.max(t);
        Ok(())
    }

    fn token_of(&self, run_id: u64) -> String {
        self.trace.tokens.get(&run_id).cloned().unwrap_or_default()
    }

    fn apply(&mut self, op: &RelayOp) -> Result<(), String> {
        let lease_error = |x: u8| match x {
            1 => LeaseError::Transport,
            2 => LeaseError::Code(ErrorCode::Conflict),
            3 => LeaseError::Code(ErrorCode::NotFound),
            4 => LeaseError::Code(ErrorCode::Forbidden),
            _ => LeaseError::Code(ErrorCode::Invalid),
        };
        match op {
            RelayOp::Advance(by) => self.advance_to(self.now + *by)?,
            RelayOp::WallStep(by) if self.wall_steps => self.wall_offset += by,
            RelayOp::WallStep(_) => {}
            RelayOp::Fire { within_hours } => self.feed(Input::Firing {
                trigger: "channel.sb".into(),
                within_hours: *within_hours,
            })?,
            RelayOp::ClaimAnswer(kind) => {
                let Some((request, run_id)) = self.claim.take() else {
                    return Ok(());
                };
                let input = match kind % 8 {
                    k @ 0..=3 => {
                        let token = format!("LT{run_id}-q3vZw8Kp");
                        let fenced = k < 3;
                        if fenced {
                            self.trace.tokens.insert(run_id, token.clone());
                        }
                        let token = fenced.then_some(token.as_str());
                        let claim = claimed(&format!("td_{run_id}"), 1, 3, token);
                        Input::ClaimAnswered { request, claim }
                    }
                    4 => Input::ClaimEmpty { request },
                    x => Input::ClaimFailed {
                        request,
                        error: lease_error(x - 4),
                    },
                };
                self.answer(input)?;
            }
            RelayOp::HeartbeatAnswer { pick, answer } => {
                if self.heartbeats.is_empty() {
                    return Ok(());
                }
                let i = usize::from(*pick) % self.heartbeats.len();
                let request = self.heartbeats.remove(i);
                let input = match answer % 8 {
                    0..=4 => Input::HeartbeatOk { request },
                    x => Input::HeartbeatFailed {
                        request,
                        error: lease_error(x - 4),
                    },
                };
                self.answer(input)?;
            }
            RelayOp::ReportAnswer(kind) => {
                let Some(request) = self.report.take() else {
                    return Ok(());
                };
                let input = match kind % 8 {
                    k @ 0..=3 => Input::ReportAnswered {
                        request,
                        dead_letter: k == 3,
                        next_retry_at: None,
                    },
                    4 | 5 => Input::ReportFailed {
                        request,
                        error: LeaseError::Transport,
                    },
                    6 => Input::ReportFailed {
                        request,
                        error: lease_error(2),
                    },
                    _ => Input::ReportFailed {
                        request,
                        error: lease_error(7),
                    },
                };
                self.answer(input)?;
            }
            RelayOp::ReceiptAnswer { ok } => {
                let Some(request) = self.receipt.take() else {
                    return Ok(());
                };
                let input = if *ok {
                    Input::ReceiptUploaded {
                        request,
                        handle: "mcp://cairn/Rc9".into(),
                    }
                } else {
                    Input::ReceiptFailed {
                        request,
                        error: "connection refused".into(),
                    }
                };
                self.answer(input)?;
            }
            RelayOp::Spawned => {
                if let Some((run_id, false)) = self.process {
                    self.process = Some((run_id, true));
                    self.feed(Input::ProcessSpawned { run_id })?;
                }
            }
            RelayOp::SpawnFailed => {
                if let Some((run_id, false)) = self.process {
                    self.process = None;
                    self.feed(Input::SpawnFailed {
                        run_id,
                        error: "ENOENT".into(),
                    })?;
                }
            }
            RelayOp::Exit { code, summary } => {
                if let Some((run_id, true)) = self.process {
                    self.process = None;
                    let token = self.token_of(run_id);
                    let summary_file = match summary {
                        0 => None,
                        1 => Some(format!("tried; {ENV_FILE_SECRET} was set").into_bytes()),
                        2 => Some(
                            json!({"summary": format!("lease {token} in hand"),
                                   "artifact": "mcp://cairn/Ab12Cd34"})
                            .to_string()
                            .into_bytes(),
                        ),
                        3 => {
                            Some(br#"{"summary": "x", "artifact": "file:///etc/passwd"}"#.to_vec())
                        }
                        _ => Some(
                            json!({"needs_input": format!("which branch? {token}"),
                                   "summary": format!("holding {token}")})
                            .to_string()
                            .into_bytes(),
                        ),
                    };
                    let exit = if *code < 0 {
                        ExitStatus::Signal(-code)
                    } else {
                        ExitStatus::Code(*code)
                    };
                    self.feed(Input::ProcessExited {
                        run_id,
                        exit,
                        summary_file,
                    })?;
                }
            }
            RelayOp::CheckExit { code, leak } => {
                if let Some(run_id) = self.check.take() {
                    let output = if *leak {
                        format!("FAIL auth with {}\n", self.token_of(run_id))
                    } else {
                        "ok\n".to_string()
                    };
                    self.feed(Input::CheckExited {
                        run_id,
                        exit: ExitStatus::Code(*code),
                        output_tail: output.into_bytes(),
                    })?;
                }
            }
            RelayOp::CheckFailedToStart => {
                if let Some(run_id) = self.check.take() {
                    self.feed(Input::CheckFailedToStart {
                        run_id,
                        error: "EACCES".into(),
                    })?;
                }
            }
            RelayOp::Stop(reason) => self.feed(Input::StopRequested { reason: *reason })?,
            RelayOp::Capabilities {
                supported,
                release,
                asks,
            } => {
                let caps = if *supported {
                    let mut caps = Capabilities::full(*release);
                    if *asks {
                        let (verb, args) = crate::relay::table::OPTIONAL_VERBS[0];
                        let args = args.iter().map(|a| a.to_string()).collect();
                        caps.declared.insert(verb.to_string(), args);
                    }
                    caps
                } else {
                    Capabilities {
                        missing: vec!["claim_next.require_fence".into()],
                        release_advertised: *release,
                        ..Capabilities::default()
                    }
                };
                self.feed(Input::CapabilitiesKnown(caps))?;
            }
            RelayOp::SessionExpired => self.feed(Input::SessionExpired)?,
            RelayOp::Replay(pick) => {
                if !self.answered.is_empty() {
                    let i = usize::from(*pick) % self.answered.len();
                    let input = self.answered[i].clone();
                    self.feed(input)?;
                }
            }
        }
        Ok(())
    }

    /// Answers everything favourably and lets time pass until the relay is idle.
    fn heal(&mut self) -> Result<(), String> {
        for _ in 0..2_000 {
            if !self.relay.in_flight() {
                return Ok(());
            }
            if let Some((request, _)) = self.claim.take() {
                self.answer(Input::ClaimEmpty { request })?;
            } else if let Some(request) = self.report.take() {
                self.answer(Input::ReportAnswered {
                    request,
                    dead_letter: false,
                    next_retry_at: None,
                })?;
            } else if self.receipt.is_some() {
                self.apply(&RelayOp::ReceiptAnswer { ok: true })?;
            } else if !self.heartbeats.is_empty() {
                self.apply(&RelayOp::HeartbeatAnswer { pick: 0, answer: 0 })?;
            } else if let Some((_, false)) = self.process {
                self.apply(&RelayOp::Spawned)?;
            } else if let Some((_, true)) = self.process {
                self.apply(&RelayOp::Exit {
                    code: 0,
                    summary: 0,
                })?;
            } else if self.check.is_some() {
                self.apply(&RelayOp::CheckExit {
                    code: 0,
                    leak: false,
                })?;
            } else if let Some((at, _)) = self.relay.poll_timeout() {
                self.advance_to(at)?;
            } else {
                return Err(format!(
                    "stuck: in flight with nothing awaited and no timer: {}",
                    serde_json::to_string(&self.relay.describe(Now::agreeing(self.now.ms())))
                        .unwrap_or_default()
                ));
            }
        }
        Err("the relay did not become idle".into())
    }
}

/// Runs a program and heals the world; the trace is what the properties read.
pub fn run_relay_program(program: &RelayProgram) -> Result<Trace, String> {
    run_relay_program_with(program, true)
}

/// Runs a program, with its wall-clock steps or without them.
pub(super) fn run_relay_program_with(
    program: &RelayProgram,
    wall_steps: bool,
) -> Result<Trace, String> {
    let mut w = World {
        relay: Relay::new(program.settings.clone(), 11, 1),
        now: Mono::from_ms(t0()),
        wall_offset: 0,
        wall_steps,
        trace: Trace {
            settings: program.settings.clone(),
            steps: Vec::new(),
            tokens: BTreeMap::new(),
        },
        claim: None,
        heartbeats: Vec::new(),
        report: None,
        receipt: None,
        process: None,
        check: None,
        answered: Vec::new(),
        auto_heartbeat: program.auto_heartbeat,
    };
    for op in &program.ops {
        w.apply(op)?;
    }
    w.heal()?;
    Ok(w.trace)
}

pub(super) fn trace_of(bytes: &[u8]) -> Result<Trace, String> {
    run_relay_program(&decode_relay_program(bytes))
}
