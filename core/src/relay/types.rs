//! The values the relay machine takes in and hands out: settings, inputs, commands, timers.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::capabilities::Capabilities;
use super::record::{Event, RunRecord};
use super::redact::Redactor;
use super::usage::BudgetRemaining;
use crate::error::ErrorCode;
use crate::time::{Millis, SECOND, Wall};

// One definition of each, in the config model the settings come from.
pub use crate::config::{DEFAULT_KILL_GRACE, OnOverlap};

/// The operator's success check, already validated by the config module.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SuccessCheck {
    pub argv: Vec<String>,
    /// Total time the check may take, across re-runs, from its first start.
    pub timeout: Millis,
    /// Wait before re-running a check that exited 75.
    pub interval: Millis,
    /// Also run the check after the claim and before the spawn.
    pub before: bool,
}

/// One leased harness as the machine needs it: plain, already-validated values. The config
/// module converts its model into this; the machine never parses or validates config.
#[derive(Clone, PartialEq, Eq)]
pub struct HarnessSettings {
    pub harness: String,
    pub host: String,
    /// The lease source reference, `queue.<name>`.
    pub lease: String,
    /// Restricts `claim_next` to one queue; `None` claims from every granted queue.
    pub queue: Option<String>,
    pub lease_ttl: Millis,
    pub heartbeat_interval: Millis,
    pub argv: Vec<String>,
    /// The prompt's bytes, written to the process's stdin.
    pub prompt: Option<Vec<u8>>,
    pub workdir: String,
    /// The run timeout every run has, leased or not.
    pub timeout: Option<Millis>,
    pub kill_grace: Millis,
    pub on_overlap: OnOverlap,
    /// The harness's own `enabled`.
    pub enabled: bool,
    /// The lease source's `enabled`.
    pub lease_enabled: bool,
    pub success_check: Option<SuccessCheck>,
    /// `cairn.<name>` when receipts are on.
    pub attempt_receipt: Option<String>,
    /// The absolute jobs directory; run files live in `<jobs_dir>/<harness>/`.
    pub jobs_dir: String,
    /// Values that must never reach a summary, receipt or warning: resolved header values of
    /// the lease and Cairn sources. `env_file` values are redacted as well.
    pub secrets: Vec<String>,
    /// The harness's env_file variables, for the process and the check.
    pub env_file: Vec<(String, String)>,
    /// Exit codes of the agent or the check that mean "retrying will not help": a failed
    /// report says `retryable: false`.
    pub non_retryable_exit_codes: Vec<i32>,
}

impl std::fmt::Debug for HarnessSettings {
    // Hand-written so that secrets and env_file values never reach a log through `{:?}`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let env_names: Vec<&str> = self.env_file.iter().map(|(k, _)| k.as_str()).collect();
        f.debug_struct("HarnessSettings")
            .field("harness", &self.harness)
            .field("host", &self.host)
            .field("lease", &self.lease)
            .field("queue", &self.queue)
            .field("lease_ttl", &self.lease_ttl)
            .field("heartbeat_interval", &self.heartbeat_interval)
            .field("argv", &self.argv)
            .field("prompt_bytes", &self.prompt.as_ref().map(Vec::len))
            .field("workdir", &self.workdir)
            .field("timeout", &self.timeout)
            .field("kill_grace", &self.kill_grace)
            .field("on_overlap", &self.on_overlap)
            .field("enabled", &self.enabled)
            .field("lease_enabled", &self.lease_enabled)
            .field("success_check", &self.success_check)
            .field("attempt_receipt", &self.attempt_receipt)
            .field("jobs_dir", &self.jobs_dir)
            .field(
                "secrets",
                &format_args!("<{} redacted>", self.secrets.len()),
            )
            .field("env_file", &env_names)
            .field("non_retryable_exit_codes", &self.non_retryable_exit_codes)
            .finish()
    }
}

impl HarnessSettings {
    pub fn lease_ttl_seconds(&self) -> u64 {
        self.lease_ttl / SECOND
    }

    /// Every value the redactor must mask for this harness: header values and env_file values.
    pub fn secret_values(&self) -> impl Iterator<Item = &str> {
        self.secrets
            .iter()
            .chain(self.env_file.iter().map(|(_, v)| v))
            .map(String::as_str)
    }
}

/// The capability a fenced claim returns: the wire's own type, held in memory for the life
/// of its attempt only.
pub use crate::wire::LeaseToken;

/// Names one network request the machine asked for; its answer carries it back, which is how a
/// stale or duplicate answer is recognised.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RequestId(pub u64);

/// Why a lease-source call failed. Each contract code is its own kind so that the attempt logic
/// branches on it (a conflict is never retried as if the network had failed).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeaseError {
    /// The server answered with a contract error code.
    Code(ErrorCode),
    /// No answer: connection refused, timeout, HTTP 5xx, a broken session.
    Transport,
    /// An error code this version does not know; kept verbatim for the record.
    Other(String),
    /// The server accepted the call but its answer lacks a field the daemon needs (or has it
    /// in a form the daemon cannot use): code `malformed_answer`.
    Malformed(Box<AnswerError>),
}

impl LeaseError {
    pub fn code(&self) -> &str {
        match self {
            LeaseError::Code(c) => c.as_str(),
            LeaseError::Transport => "transport",
            LeaseError::Other(code) => code,
            LeaseError::Malformed(_) => "malformed_answer",
        }
    }

    /// The server says this lease is not ours (any more): lease loss.
    pub fn is_lease_loss(&self) -> bool {
        matches!(
            self,
            LeaseError::Code(ErrorCode::Conflict | ErrorCode::NotFound)
        )
    }
}

/// What is wrong with a field of an answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Problem {
    Missing,
    /// Present, but not what the field must be (the text says what it must be).
    Not(&'static str),
}

/// An answer that lacks a field the daemon needs, or has it in a form it cannot use. It names
/// the verb and the field, never the value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AnswerError {
    pub verb: &'static str,
    /// The field's path in the answer, `todo.attempt`.
    pub field: &'static str,
    pub problem: Problem,
}

impl std::fmt::Display for AnswerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.problem {
            Problem::Missing => write!(f, "the {} answer has no {}", self.verb, self.field),
            Problem::Not(what) => {
                write!(f, "the {} answer's {} is not {what}", self.verb, self.field)
            }
        }
    }
}

impl std::error::Error for AnswerError {}

/// One earlier attempt, as the claim answer lists it (newest first). Each field is what the
/// server said, or `None` when it said nothing usable: these are shown to the agent, never
/// relied on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PriorAttempt {
    pub seq: Option<u64>,
    /// The attempt's number (the server's `attempt`).
    pub number: Option<u32>,
    pub outcome: Option<String>,
    pub died: Option<bool>,
    pub claimant: Option<String>,
    /// Read from the server's text once (any RFC 3339 form), written back as [`rfc3339`] writes
    /// it.
    ///
    /// [`rfc3339`]: crate::time::rfc3339
    #[serde(with = "crate::time::wall_text")]
    pub claimed_at: Option<Wall>,
    #[serde(with = "crate::time::wall_text")]
    pub ended_at: Option<Wall>,
    pub summary: Option<String>,
    pub artifact: Option<String>,
    /// The question the attempt ended with (outcome `needs_input`), and its answer once given:
    /// both written by people or agents, never instructions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub question: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<String>,
}

/// A successful `claim_next` answer, as [`super::decode_claim`] reads it from the wire.
#[derive(Clone, Debug, PartialEq)]
pub struct ClaimedTodo {
    pub todo_id: String,
    /// The todo's attempt number after this claim.
    pub attempt: u32,
    pub max_attempts: u32,
    pub attempt_seq: u64,
    /// `None` when the server ignored `require_fence`: the claim is then refused (`no_fence`).
    pub lease_token: Option<LeaseToken>,
    /// The contract's todo fields (`id`, `queue`, `title`, `kind`, `source`, `payload`,
    /// `work_order`, `created_at`), `null` where the server sent none; the context file copies
    /// them.
    pub todo: Value,
    /// Newest first.
    pub prior_attempts: Vec<PriorAttempt>,
    /// What the todo's budget still allows (`HARNESS_BUDGET_REMAINING`); `None` when the answer
    /// shows no budget.
    pub budget_remaining: Option<BudgetRemaining>,
}

/// How a child process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExitStatus {
    Code(i32),
    Signal(i32),
}

impl ExitStatus {
    /// The exit code, or -1 when a signal ended the process (as `HARNESS_AGENT_EXIT` says it).
    pub fn code(self) -> i32 {
        match self {
            ExitStatus::Code(c) => c,
            ExitStatus::Signal(_) => -1,
        }
    }
}

crate::names! {
    /// Why the daemon ends an attempt without a verdict on the work (an abort). Its text is the
    /// value of `result.harness.reason`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
    #[serde(rename_all = "snake_case")]
    pub enum StopReason {
        Shutdown => "daemon_stopping",
        OperatorStop => "operator_stop",
        HarnessRemoved => "harness_removed",
        UsageLimit => "usage_limit",
    }
}

impl StopReason {
    /// The words a release summary uses.
    pub fn words(self) -> &'static str {
        match self {
            StopReason::Shutdown => "daemon stopping",
            StopReason::OperatorStop => "operator stop",
            StopReason::HarnessRemoved => "harness removed",
            StopReason::UsageLimit => "usage limit",
        }
    }
}

/// Everything the driver tells the machine. Network answers carry the [`RequestId`] of the
/// command they answer; process and check events carry the run id of the attempt.
#[derive(Clone, Debug, PartialEq)]
pub enum Input {
    /// The harness fired. `within_hours` is the config's operating-hours answer for `now`.
    Firing {
        trigger: String,
        within_hours: bool,
    },
    ClaimAnswered {
        request: RequestId,
        claim: ClaimedTodo,
    },
    ClaimEmpty {
        request: RequestId,
    },
    ClaimFailed {
        request: RequestId,
        error: LeaseError,
    },
    HeartbeatOk {
        request: RequestId,
    },
    HeartbeatFailed {
        request: RequestId,
        error: LeaseError,
    },
    ProcessSpawned {
        run_id: u64,
    },
    SpawnFailed {
        run_id: u64,
        error: String,
    },
    /// `summary_file`: at most 16 KiB of the attempt summary file, when it exists.
    ProcessExited {
        run_id: u64,
        exit: ExitStatus,
        summary_file: Option<Vec<u8>>,
    },
    /// `output_tail`: the last few KiB of the check's stdout and stderr.
    CheckExited {
        run_id: u64,
        exit: ExitStatus,
        output_tail: Vec<u8>,
    },
    CheckFailedToStart {
        run_id: u64,
        error: String,
    },
    ReportAnswered {
        request: RequestId,
        dead_letter: bool,
        next_retry_at: Option<String>,
    },
    ReportFailed {
        request: RequestId,
        error: LeaseError,
    },
    ReceiptUploaded {
        request: RequestId,
        handle: String,
    },
    ReceiptFailed {
        request: RequestId,
        error: String,
    },
    /// The deadline from [`super::Relay::poll_timeout`] arrived.
    TimerFired,
    StopRequested {
        reason: StopReason,
    },
    /// The lease client's session (re-)initialised and its tools/list was checked.
    CapabilitiesKnown(Capabilities),
    /// The server expired the session; capabilities are unverified until the next check.
    SessionExpired,
}

crate::names! {
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
    #[serde(rename_all = "snake_case")]
    pub enum ReportVerb {
        Complete => "complete",
        Fail => "fail",
        Release => "release",
        /// The agent asked a question (its summary file's `needs_input`): the server holds the
        /// todo until a person answers. Sent only to a server that declares the tool.
        RequestInput => "request_input",
    }
}

// The tool's name.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Signal {
    Term,
    Kill,
}

/// The environment of a spawned process or check, in layers. The driver starts from the
/// daemon's environment, sets `env_file` over it, then `relay` over that: the relay variables
/// win over same-named variables from both. [`ProcessEnv::merged`] does exactly that.
#[derive(Clone, PartialEq, Eq)]
pub struct ProcessEnv {
    pub env_file: Vec<(String, String)>,
    pub relay: Vec<(String, String)>,
}

impl ProcessEnv {
    pub fn merged(
        &self,
        daemon_env: impl IntoIterator<Item = (String, String)>,
    ) -> Vec<(String, String)> {
        let mut env: std::collections::BTreeMap<String, String> = daemon_env.into_iter().collect();
        for (k, v) in self.env_file.iter().chain(&self.relay) {
            env.insert(k.clone(), v.clone());
        }
        env.into_iter().collect()
    }

    /// The value of a relay variable.
    pub fn relay_var(&self, name: &str) -> Option<&str> {
        self.relay
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

impl std::fmt::Debug for ProcessEnv {
    // env_file values are credentials more often than not: show their names only.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.env_file.iter().map(|(k, _)| k.as_str()).collect();
        f.debug_struct("ProcessEnv")
            .field("env_file", &names)
            .field("relay", &self.relay)
            .finish()
    }
}

/// Everything the machine asks the driver to do. Commands addressed to the lease source are
/// the `Send*` ones; they alone carry the lease token.
#[derive(Clone, Debug, PartialEq)]
pub enum Command {
    SendClaimNext {
        request: RequestId,
        run_id: u64,
        queue: Option<String>,
        lease_ttl_seconds: u64,
        require_fence: bool,
        claimant: String,
    },
    SendHeartbeat {
        request: RequestId,
        run_id: u64,
        todo_id: String,
        lease_ttl_seconds: u64,
        lease_token: LeaseToken,
    },
    /// `result` is `Value::Null` for `release`, which takes none.
    SendReport {
        request: RequestId,
        run_id: u64,
        verb: ReportVerb,
        todo_id: String,
        lease_token: LeaseToken,
        summary: String,
        artifact: Option<String>,
        result: Value,
        /// A fail's failure class (`Some(false)`: not retryable); sent only when the server's
        /// `fail` schema declares `retryable`.
        retryable: Option<bool>,
        /// A fail's signature, sent only when declared.
        failure_signature: Option<String>,
        /// A `request_input`'s question (redacted and cut to 2048 bytes); `None` for the others.
        question: Option<String>,
    },
    /// Write with mode 0600 before the spawn.
    WriteContextFile {
        run_id: u64,
        path: String,
        bytes: Vec<u8>,
    },
    /// The driver adds the triggered run's context variables and writes the event file, as for
    /// an unleased run; `summary_file` must not exist yet, and `usage_file` (the agent's
    /// `HARNESS_USAGE_FILE`) is created empty with mode 0600. The driver reads the usage file
    /// before each `SendHeartbeat` and `SendReport` of the run (at most
    /// [`super::usage::USAGE_FILE_MAX_BYTES`] + 1 bytes, a regular file only) and hands what it
    /// read to [`super::usage::UsageFile`] and the result to [`super::lease_call_with`].
    Spawn {
        run_id: u64,
        argv: Vec<String>,
        stdin: Option<Vec<u8>>,
        workdir: String,
        env: ProcessEnv,
        context_file: String,
        summary_file: String,
        usage_file: String,
    },
    Signal {
        run_id: u64,
        signal: Signal,
    },
    /// A plain child outside the PTY; its output goes to the run log under a delimiter line
    /// naming the check.
    RunCheck {
        run_id: u64,
        argv: Vec<String>,
        workdir: String,
        env: ProcessEnv,
    },
    KillCheck {
        run_id: u64,
    },
    /// `markdown` is the receipt without its log section; the driver appends the last
    /// `run_log_lines` lines of the run log with [`super::summary::receipt_log_section`] and
    /// `redactor` (the harness's secret values; the run log never saw the lease token), and
    /// bounds the upload by `timeout` (the machine stops waiting then anyway).
    UploadReceipt {
        request: RequestId,
        run_id: u64,
        source: String,
        markdown: String,
        run_log_lines: usize,
        redactor: Redactor,
        tags: Vec<String>,
        timeout: Millis,
    },
    WriteRunRecord {
        record: RunRecord,
    },
    Emit {
        event: Event,
    },
    WarnRunLog {
        run_id: u64,
        text: String,
    },
}

impl Command {
    /// Whether the command is a call to the lease source.
    pub fn is_lease_call(&self) -> bool {
        matches!(
            self,
            Command::SendClaimNext { .. }
                | Command::SendHeartbeat { .. }
                | Command::SendReport { .. }
        )
    }

    /// The run the command belongs to.
    pub fn run_id(&self) -> u64 {
        match self {
            Command::SendClaimNext { run_id, .. }
            | Command::SendHeartbeat { run_id, .. }
            | Command::SendReport { run_id, .. }
            | Command::WriteContextFile { run_id, .. }
            | Command::Spawn { run_id, .. }
            | Command::Signal { run_id, .. }
            | Command::RunCheck { run_id, .. }
            | Command::KillCheck { run_id, .. }
            | Command::UploadReceipt { run_id, .. }
            | Command::WarnRunLog { run_id, .. } => *run_id,
            Command::WriteRunRecord { record } => record.run_id,
            Command::Emit { event } => event.run_id(),
        }
    }
}

/// Why [`super::Relay::poll_timeout`] wants to be woken. Several may be due at once; the
/// machine handles the lease deadline first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum TimerReason {
    /// The local lease deadline: the lease is lost at this instant.
    LeaseDeadline,
    /// The next heartbeat, or a heartbeat retry after a transport failure.
    Heartbeat,
    /// The run timeout stops the agent.
    AgentTimeout,
    /// SIGTERM went unanswered for the grace period: SIGKILL.
    KillGrace,
    /// The success check's total time is up.
    CheckTimeout,
    /// Re-run a check that exited 75.
    CheckRerun,
    /// Stop waiting for the receipt upload and report without it.
    ReceiptTimeout,
    /// Retry a report that failed on the transport.
    ReportRetry,
}
