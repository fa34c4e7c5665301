//! The relay attempt machine: one per leased harness, pure and sans-IO.
//!
//! A firing of a leased harness is admitted (enabled, overlap, hours, lease source enabled and
//! supported) before anything is sent; an admitted firing claims one todo with a fence, gets a
//! fresh process with a private context file, keeps its lease alive with heartbeats, asks the
//! operator's success check for the verdict, and reports complete, fail or release with a
//! bounded, redacted summary. Per attempt the phases are
//! `claiming → (checking_before) → running → checking → (receipt) → reporting → closed`, and a
//! lost lease or an abort can cut in anywhere before the report.
//!
//! # Driving it
//!
//! ```text
//! let now = clock.reading();          // Now { mono: Mono, wall: Wall }
//! relay.handle_input(now, input)?;    // the one door: a due timer is Input::TimerFired
//! while let Some(cmd) = relay.poll_command() { execute(cmd) }
//! sleep_until_mono(relay.poll_timeout())      // then handle_input(now, Input::TimerFired)
//! ```
//!
//! Drain [`Relay::poll_command`] until `None` after every input, then ask
//! [`Relay::poll_timeout`] for the next deadline and its [`TimerReason`].
//!
//! `now` is a [`Now`](crate::time::Now): a monotonic and a wall reading taken together. Every
//! deadline and timer (lease deadline, heartbeats, run timeout, kill grace, check interval and
//! timeout, receipt wait, report retries) is a [`Mono`](crate::time::Mono), computed and compared
//! on the monotonic reading, and [`Relay::poll_timeout`] answers on it; the wall reading (a
//! [`Wall`](crate::time::Wall)) only stamps the text of run records and `describe`. A wall clock that steps back therefore cannot keep an agent running past
//! its lease. Answers to network
//! commands carry the command's [`RequestId`]; an answer to a request that is no longer awaited
//! (a heartbeat answer after the attempt ended, a duplicate report answer) is an ordinary input
//! and is ignored. Only inputs that name something the machine never asked for are
//! [`ContractError`]s.
//!
//! # What the machine never does
//!
//! It never reads a clock, draws randomness (retry jitter comes from the seed), touches a file,
//! the environment or the network, or starts a process: it returns [`Command`]s. It never
//! persists the lease token, never puts it anywhere but the `SendHeartbeat` and `SendReport`
//! commands (not in records, events, context files, environments, summaries or warnings, and
//! not in any `Debug` output), never opens a notification stream (there is no command for one),
//! never retries a claim, and never sends anything for an attempt after its lease is lost.
//! Restart reconciliation is the driver's: a new machine knows nothing of an old one's
//! attempts, and [`reconcile_interrupted`] turns a record left `running` into `interrupted`.

//! # Choices the spec leaves open
//!
//! - Admission order: enabled, overlap, hours, lease source enabled, lease source supported.
//!   With `on_overlap = "queue"` a firing outside its hours is skipped, not held; one firing is
//!   held, a further one is skipped `overlap`; the held one re-checks enabled and the lease
//!   source when it starts, and any stop request drops it.
//! - The source counts as supported only after a capability check on the current session:
//!   before the first one and after `SessionExpired`, firings are skipped
//!   `lease_source_unsupported` (there is no unchecked mode to fall back to).
//! - The lease deadline runs from the send time of the last successful claim or heartbeat.
//! - A heartbeat answered forbidden/invalid is logged and the regular cadence goes on (the
//!   deadline decides); a report answered forbidden/invalid is `report_lost` at once.
//! - A stop during the claim releases the lease as soon as the claim answers; a stop after the
//!   verdict lets the report go out as decided. A released or failed abort waits for the process
//!   to exit first, so no other worker starts while this one still runs.
//! - A run record is written when the claim is sent (`running`), when it is answered and when
//!   the run ends, after its process and check have exited.
//! - Events: `run_started` follows the running record, the relay_* events follow the step they
//!   name, and `run_finished` (or `run_skipped`) comes just before the final record, so it is a
//!   run's last command.
//! - A reload ([`Relay::reconfigure`]) never changes an attempt in flight: its settings wait for
//!   the close, and apply before a held firing starts. A harness the reload removes is stopped
//!   with `StopReason::HarnessRemoved` like any other abort.
//! - Exit 75 whose re-run would start past the check's total time is inconclusive at once.
//! - A receipt is also made when the agent's handle was dropped as malformed, and for an
//!   attempt the check found already satisfied; an artifact that carries a known secret is
//!   dropped like a malformed one.
//! - An agent that asks (a non-blank `needs_input` in its summary file, whatever its exit) is
//!   not judged by the success check: it did not finish. The question goes out as
//!   `request_input` where the source's tools/list shows that verb ([`Capabilities::asks`]),
//!   recorded with the agent's run outcome and `relay_outcome = input_requested`; elsewhere as
//!   a *retryable* `fail` with reason `needs_input_unsupported` and the question at the head of
//!   the summary: another endpoint may be granted `request_input`, and the same question failing
//!   again gives the same failure signature, so `max_same_failures` bounds the loop.
//! - Usage is not the machine's: the driver reads the agent's usage file before each heartbeat
//!   and report ([`usage::UsageFile`]) and the call builder puts it on the call
//!   ([`lease_call_with`]). A heartbeat refused because the spend reached the budget is a
//!   `conflict` like any other: lease loss, the process stopped.

mod capabilities;
mod context;
pub mod contract;
pub mod doctor;
pub mod invariants;
mod machine;
mod record;
pub mod redact;
mod settings;
pub mod summary;
pub mod table;
mod types;
pub mod usage;

#[cfg(test)]
mod tests;

pub use capabilities::{Capabilities, check_capabilities};
pub use context::{
    RunFiles, UNTRUSTED, claimant, context_file, context_file_bytes, relay_env, run_files,
};
pub use contract::{
    ClaimAnswer, LeaseCall, ResultError, TOOL_ERROR, answer_input, call_params, call_params_with,
    decode_claim, decode_report, failed_input, lease_call, lease_call_with, result_input,
};
pub use machine::{
    AttemptView, ContractError, Describe, RECEIPT_TIMEOUT, RETRY_BASE, Reconfigured, Relay,
    SourceState,
};
pub use record::{
    Event, RelayOutcome, RunOutcome, RunRecord, SkippedReason, reconcile_interrupted,
};
pub use redact::Redactor;
pub use settings::{HostFacts, expand_path, harness_settings};
pub use types::{
    AnswerError, ClaimedTodo, Command, DEFAULT_KILL_GRACE, ExitStatus, HarnessSettings, Input,
    LeaseError, LeaseToken, OnOverlap, PriorAttempt, ProcessEnv, ReportVerb, RequestId, Signal,
    StopReason, SuccessCheck, TimerReason,
};
pub use usage::{BudgetRemaining, UsageFile};
