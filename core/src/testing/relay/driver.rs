//! The scripted driver and the ledger-backed lease source: everything a relay test needs to
//! drive [`crate::relay::Relay`] in a few lines.

use serde_json::{Value, json};

use crate::grant::Grant;
use crate::ledger::Ledger;
use crate::relay::{
    Capabilities, ClaimedTodo, Command, ContractError, Describe, ExitStatus, HarnessSettings,
    Input, LeaseError, LeaseToken, OnOverlap, Relay, RequestId, RunRecord, SuccessCheck,
    call_params_with, failed_input, result_input,
};
use crate::serve::{Caller, Draw, refusal, serve, tool_of};
use crate::time::{MINUTE, Millis, Mono, Now, Wall, parse_rfc3339};
use crate::wire::UsageArg;

/// 2026-09-22T12:00:00Z, where every scripted test starts.
pub fn t0() -> Millis {
    parse_rfc3339("2026-09-22T12:00:00Z").unwrap_or_default()
}

/// Header and env_file values the tests plant, to prove they never leak.
pub const HEADER_SECRET: &str = "hdr-s3cr3t-value";
pub const ENV_FILE_SECRET: &str = "envfile-s3cr3t-value";

/// `fixer` on `buildbox`, bound to `queue.ci`: 5 m lease, 1 m heartbeats, no check.
pub fn settings() -> HarnessSettings {
    HarnessSettings {
        harness: "fixer".into(),
        host: "buildbox".into(),
        lease: "queue.ci".into(),
        queue: Some("ci-failures".into()),
        lease_ttl: 5 * MINUTE,
        heartbeat_interval: MINUTE,
        argv: vec!["claude".into(), "-p".into()],
        prompt: Some(b"Fix the CI failure described in $HARNESS_RELAY_FILE.".to_vec()),
        workdir: "/src/app".into(),
        timeout: None,
        kill_grace: crate::relay::DEFAULT_KILL_GRACE,
        on_overlap: OnOverlap::Skip,
        enabled: true,
        lease_enabled: true,
        success_check: None,
        attempt_receipt: None,
        jobs_dir: "/state/jobs".into(),
        secrets: vec![HEADER_SECRET.into()],
        env_file: vec![("GH_TOKEN".into(), ENV_FILE_SECRET.into())],
        non_retryable_exit_codes: vec![3],
    }
}

/// The settings with a success check.
pub fn with_check(mut s: HarnessSettings, timeout: Millis, interval: Millis) -> HarnessSettings {
    s.success_check = Some(SuccessCheck {
        argv: vec!["./scripts/required-checks-green.sh".into()],
        timeout,
        interval,
        before: false,
    });
    s
}

/// A claim answer for `todo_id` at `attempt` of `max`, fenced with `token` when given.
pub fn claimed(todo_id: &str, attempt: u32, max: u32, token: Option<&str>) -> ClaimedTodo {
    ClaimedTodo {
        todo_id: todo_id.into(),
        attempt,
        max_attempts: max,
        attempt_seq: u64::from(attempt),
        lease_token: token.map(LeaseToken::new),
        todo: json!({
            "id": todo_id, "queue": "ci-failures", "title": "CI red on main",
            "kind": "check_suite", "source": "gitea", "payload": {"sha": "abc123"},
            "work_order": null, "created_at": "2026-09-22T11:58:00Z",
        }),
        prior_attempts: Vec::new(),
        budget_remaining: None,
    }
}

/// A tools/list answer declaring `verbs`, each with its input properties (and
/// `additionalProperties: false`, as the queue server's schemas have it).
pub fn tools_list(verbs: &[(&str, &[&str])]) -> Value {
    let tools: Vec<Value> = verbs
        .iter()
        .map(|(name, props)| {
            let props: serde_json::Map<String, Value> =
                props.iter().map(|p| (p.to_string(), json!({}))).collect();
            json!({"name": name, "inputSchema": {"type": "object", "properties": props,
                "additionalProperties": false}})
        })
        .collect();
    json!({ "tools": tools })
}

/// The drain verbs with every argument the contract adds (attempt history, fence, summary and
/// artifact), release included.
pub fn contract_tools() -> Value {
    let mut verbs = crate::relay::table::ARGUMENTS.to_vec();
    verbs.push(("list_todos", &["queue", "state", "limit"]));
    tools_list(&verbs)
}

/// What our own server declares to an endpoint granted every verb: the contract's surface and
/// its extensions (`request_input`, `usage`, the fail class and signature).
pub fn our_server_capabilities() -> Capabilities {
    crate::relay::check_capabilities(&crate::wire::tools_list(&crate::wire::Tool::ALL))
}

/// The request id of the last command in `cmds` that `pick` selects.
pub fn request_in(cmds: &[Command], pick: fn(&Command) -> bool) -> Option<RequestId> {
    cmds.iter().rev().filter(|c| pick(c)).find_map(request_of)
}

pub fn request_of(c: &Command) -> Option<RequestId> {
    match c {
        Command::SendClaimNext { request, .. }
        | Command::SendHeartbeat { request, .. }
        | Command::SendReport { request, .. }
        | Command::UploadReceipt { request, .. } => Some(*request),
        _ => None,
    }
}

pub fn is_claim(c: &Command) -> bool {
    matches!(c, Command::SendClaimNext { .. })
}
pub fn is_heartbeat(c: &Command) -> bool {
    matches!(c, Command::SendHeartbeat { .. })
}
pub fn is_report(c: &Command) -> bool {
    matches!(c, Command::SendReport { .. })
}
pub fn is_receipt(c: &Command) -> bool {
    matches!(c, Command::UploadReceipt { .. })
}

/// The run records among `cmds`.
pub fn records(cmds: &[Command]) -> Vec<&RunRecord> {
    cmds.iter()
        .filter_map(|c| match c {
            Command::WriteRunRecord { record } => Some(record),
            _ => None,
        })
        .collect()
}

/// How the scripted driver answers heartbeats on its own.
#[derive(Clone, Debug, PartialEq)]
pub enum AutoHeartbeat {
    /// Leave them unanswered; the test answers.
    Off,
    /// Answer each at once, with this result.
    Reply(Result<(), LeaseError>),
}

/// A scripted driver: feeds inputs at explicit times, fires due timers at their own
/// instants, and keeps every command it saw.
pub struct Driver {
    pub relay: Relay,
    /// The scripted world's time: the ledger serves at it, and the host's monotonic clock reads
    /// it (the wall clock reads `now + wall_offset`).
    pub now: Millis,
    /// How far the wall clock has been stepped from the monotonic one (0: they agree).
    pub wall_offset: i64,
    /// Every command with the time it was emitted.
    pub log: Vec<(Millis, Command)>,
    pub auto_heartbeat: AutoHeartbeat,
}

impl Driver {
    /// A relay at [`t0`] whose lease source advertises the whole contract, release included.
    pub fn new(settings: HarnessSettings) -> Driver {
        Self::with_capabilities(settings, Capabilities::full(true))
    }

    pub fn with_capabilities(settings: HarnessSettings, caps: Capabilities) -> Driver {
        Self::new_with(settings, caps, 1, t0())
    }

    /// A relay whose first run id is `first_run_id`, starting at `now`.
    pub fn new_with(
        settings: HarnessSettings,
        caps: Capabilities,
        first_run_id: u64,
        now: Millis,
    ) -> Driver {
        let mut d = Driver {
            relay: Relay::new(settings, 7, first_run_id),
            now,
            wall_offset: 0,
            log: Vec::new(),
            auto_heartbeat: AutoHeartbeat::Reply(Ok(())),
        };
        d.input(Input::CapabilitiesKnown(caps));
        d
    }

    /// Feeds `input` at the current time; panics on a contract error.
    pub fn input(&mut self, input: Input) -> Vec<Command> {
        match self.try_input(input) {
            Ok(cmds) => cmds,
            Err(e) => panic!("contract error: {e}"),
        }
    }

    pub fn try_input(&mut self, input: Input) -> Result<Vec<Command>, ContractError> {
        self.relay.handle_input(self.clock(), input)?;
        Ok(self.drain())
    }

    /// Both clocks as the machine reads them now.
    pub fn clock(&self) -> Now {
        Now {
            mono: Mono::from_ms(self.now),
            wall: Wall::from_ms(self.now.saturating_add_signed(self.wall_offset)),
        }
    }

    /// `harness describe` now.
    pub fn describe(&self) -> Describe {
        self.relay.describe(self.clock())
    }

    fn drain(&mut self) -> Vec<Command> {
        let mut out = Vec::new();
        while let Some(c) = self.relay.poll_command() {
            self.log.push((self.now, c.clone()));
            out.push(c);
        }
        if let AutoHeartbeat::Reply(reply) = self.auto_heartbeat.clone() {
            let requests: Vec<RequestId> = out
                .iter()
                .filter(|c| is_heartbeat(c))
                .filter_map(request_of)
                .collect();
            for request in requests {
                let input = match reply.clone() {
                    Ok(()) => Input::HeartbeatOk { request },
                    Err(error) => Input::HeartbeatFailed { request, error },
                };
                out.extend(self.input(input));
            }
        }
        out
    }

    /// Moves time to `t`, handling each timer at the instant it is due.
    pub fn advance_to(&mut self, t: Millis) -> Vec<Command> {
        let mut out = Vec::new();
        // Bounded: a machine whose due timer does not move would otherwise spin forever.
        for _ in 0..100_000 {
            // The monotonic clock reads the world's time, so a timer is due at its own reading.
            let due = self.relay.poll_timeout().map(|(at, _)| at.ms());
            let Some(at) = due.filter(|at| *at <= t) else {
                self.now = self.now.max(t);
                return out;
            };
            self.now = self.now.max(at);
            out.extend(self.input(Input::TimerFired));
        }
        panic!("timers due by {t} did not settle: a handled timer must move or disarm");
    }

    pub fn advance(&mut self, by: Millis) -> Vec<Command> {
        self.advance_to(self.now + by)
    }

    /// A doorbell firing within hours.
    pub fn fire(&mut self) -> Vec<Command> {
        self.input(Input::Firing {
            trigger: "channel.sb".into(),
            within_hours: true,
        })
    }

    /// The last request of the kind `pick` selects, over the whole log.
    pub fn last_request(&self, pick: fn(&Command) -> bool) -> RequestId {
        let cmds: Vec<Command> = self.log.iter().map(|(_, c)| c.clone()).collect();
        request_in(&cmds, pick).unwrap_or_else(|| panic!("no such request in the log"))
    }

    /// The run id of the attempt in flight.
    pub fn run_id(&self) -> u64 {
        self.describe()
            .attempt
            .map(|a| a.run_id)
            .unwrap_or_else(|| panic!("no attempt in flight"))
    }

    /// Fires and answers the claim with `claim`.
    pub fn claim(&mut self, claim: ClaimedTodo) -> Vec<Command> {
        let mut out = self.fire();
        let request = request_in(&out, is_claim).unwrap_or_else(|| panic!("no claim sent"));
        out.extend(self.input(Input::ClaimAnswered { request, claim }));
        out
    }

    /// Fires, claims `claim` and reports the process started.
    pub fn start(&mut self, claim: ClaimedTodo) -> Vec<Command> {
        let mut out = self.claim(claim);
        let run_id = self.run_id();
        out.extend(self.input(Input::ProcessSpawned { run_id }));
        out
    }

    pub fn spawned(&mut self) -> Vec<Command> {
        let run_id = self.run_id();
        self.input(Input::ProcessSpawned { run_id })
    }

    pub fn exit(&mut self, code: i32, summary_file: Option<&[u8]>) -> Vec<Command> {
        let run_id = self.run_id();
        self.input(Input::ProcessExited {
            run_id,
            exit: if code < 0 {
                ExitStatus::Signal(-code)
            } else {
                ExitStatus::Code(code)
            },
            summary_file: summary_file.map(<[u8]>::to_vec),
        })
    }

    pub fn check_exit(&mut self, code: i32, output: &str) -> Vec<Command> {
        let run_id = self.run_id();
        self.input(Input::CheckExited {
            run_id,
            exit: ExitStatus::Code(code),
            output_tail: output.as_bytes().to_vec(),
        })
    }

    /// Accepts the last report.
    pub fn report_ok(&mut self, dead_letter: bool) -> Vec<Command> {
        let request = self.last_request(is_report);
        self.input(Input::ReportAnswered {
            request,
            dead_letter,
            next_retry_at: None,
        })
    }

    pub fn report_failed(&mut self, error: LeaseError) -> Vec<Command> {
        let request = self.last_request(is_report);
        self.input(Input::ReportFailed { request, error })
    }

    /// Every command so far.
    pub fn commands(&self) -> Vec<Command> {
        self.log.iter().map(|(_, c)| c.clone()).collect()
    }

    /// The last record written.
    pub fn last_record(&self) -> RunRecord {
        let cmds = self.commands();
        records(&cmds)
            .last()
            .map(|r| (*r).clone())
            .unwrap_or_else(|| panic!("no record written"))
    }
}

/// A lease source backed by the real [`Ledger`], speaking the machine's commands over the wire
/// both ways: the lease client's `tools/call` params, the queue's serving function, the result
/// read as the lease client reads it. Tokens are `tok-<endpoint>-<n>`; each relay is a
/// different endpoint-session of one endpoint.
pub struct LedgerSource {
    pub ledger: Ledger,
    pub endpoint: String,
    /// What the calls are built against (default: the contract's surface, release included).
    pub caps: Capabilities,
    next_token: u32,
}

impl LedgerSource {
    pub fn new(ledger: Ledger, endpoint: &str) -> LedgerSource {
        LedgerSource {
            ledger,
            endpoint: endpoint.into(),
            caps: Capabilities::full(true),
            next_token: 0,
        }
    }

    /// Serves one lease-source command at `now`; `None` for any other command.
    pub fn serve(&mut self, now: Millis, c: &Command) -> Option<Input> {
        self.serve_with(now, c, None)
    }

    /// [`LedgerSource::serve`] with the attempt's usage, as the driver sends it.
    pub fn serve_with(
        &mut self,
        now: Millis,
        c: &Command,
        usage: Option<&UsageArg>,
    ) -> Option<Input> {
        let params = call_params_with(c, &self.caps, usage)?;
        let (tool, args) = tool_of(&params).ok()?;
        let caller = Caller {
            endpoint: self.endpoint.clone(),
            session: None,
            grant: Grant::all(),
            tasks: None,
        };
        let mut tokens = Tokens {
            endpoint: &self.endpoint,
            next: &mut self.next_token,
        };
        let ledger = &mut self.ledger;
        let result = match serve(tool, args, caller, now, &mut tokens, |op| ledger.apply(op)) {
            Ok(served) => served.result(),
            Err(e) => refusal(&e),
        };
        match result_input(c, &result)? {
            Ok(input) => Some(input),
            Err(e) => failed_input(c, e.kind(str::to_string)),
        }
    }
}

/// The source's fence tokens, in sequence; it adds no todos of its own.
struct Tokens<'a> {
    endpoint: &'a str,
    next: &'a mut u32,
}

impl Draw for Tokens<'_> {
    fn todo_id(&mut self) -> Result<String, crate::Error> {
        Err(crate::Error::internal("the ledger source adds no todos"))
    }
    fn lease_token(&mut self) -> Result<LeaseToken, crate::Error> {
        *self.next += 1;
        Ok(LeaseToken::new(format!(
            "tok-{}-{}",
            self.endpoint, self.next
        )))
    }
    fn task_secret(&mut self) -> Result<String, crate::Error> {
        Err(crate::Error::internal("the ledger source makes no tasks"))
    }
}
