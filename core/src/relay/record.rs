//! Run records and events of a leased harness, and the reconciliation after a restart. A record
//! never carries a summary, a payload, a header value or a lease token: none of its fields can
//! hold one.

use serde::{Deserialize, Serialize};

use crate::time::{Wall, rfc3339};

/// How a run ended, as every run's record (leased or not) says it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunOutcome {
    /// Written when the claim is sent; a record still `running` after a restart is reconciled
    /// as `interrupted`.
    Running,
    Success,
    Failed,
    TimedOut,
    Cancelled,
    Skipped,
    Interrupted,
}

/// Why a firing started no process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SkippedReason {
    Disabled,
    Overlap,
    OutsideHours,
    LeaseDisabled,
    LeaseSourceUnsupported,
    NoWork,
    /// With the error code in [`RunRecord::claim_error`].
    ClaimFailed,
}

crate::names! {
    /// How an attempt ended on the lease side.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
    #[serde(rename_all = "snake_case")]
    pub enum RelayOutcome {
        Completed => "completed",
        Failed => "failed",
        Released => "released",
        LeaseLost => "lease_lost",
        ReportLost => "report_lost",
        DeadLettered => "dead_lettered",
        NoWork => "no_work",
        /// A `request_input` was accepted: the todo waits for a person's answer.
        InputRequested => "input_requested",
    }
}

/// One run of a leased harness. Written when the claim is sent (`running`), again when it is
/// answered, and once more when the run ends; a skipped firing is written once.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunRecord {
    pub harness: String,
    pub run_id: u64,
    pub trigger: String,
    pub outcome: RunOutcome,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skipped_reason: Option<SkippedReason>,
    /// The claim's error code with `skipped_reason = claim_failed` (`forbidden`, `transport`,
    /// `no_fence` …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim_error: Option<String>,
    pub started_at: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_at: Option<String>,
    /// The agent's exit code; absent when no process ran or a signal ended it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// The lease source reference, `queue.<name>`.
    pub lease: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub todo_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub relay_outcome: Option<RelayOutcome>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub check_exit: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact: Option<String>,
}

impl RunRecord {
    pub(crate) fn new(harness: &str, lease: &str, run_id: u64, trigger: &str, now: Wall) -> Self {
        RunRecord {
            harness: harness.to_string(),
            run_id,
            trigger: trigger.to_string(),
            outcome: RunOutcome::Running,
            skipped_reason: None,
            claim_error: None,
            started_at: rfc3339(now.ms()),
            ended_at: None,
            exit_code: None,
            lease: lease.to_string(),
            todo_id: None,
            attempt: None,
            relay_outcome: None,
            check_exit: None,
            artifact: None,
        }
    }
}

/// After a restart, a record a crashed daemon left `running` becomes `interrupted`. Nothing else
/// changes — in particular no relay outcome is invented, because no call is made for it: the
/// lease lapses and the server records the attempt as having died. Other records pass through.
pub fn reconcile_interrupted(mut record: RunRecord, now: Wall) -> RunRecord {
    if record.outcome == RunOutcome::Running {
        record.outcome = RunOutcome::Interrupted;
        record.ended_at = Some(rfc3339(now.ms()));
    }
    record
}

/// The events of a leased harness, as `relay events` prints them: each names its harness
/// and run. A run that claims starts with `run_started`; every run ends with exactly one
/// `run_finished`, or `run_skipped` when the firing started nothing (admission refused it, or the
/// claim found no work or failed) — so a skipped firing is one `run_skipped` alone. The relay_*
/// events fall between. Like a record, no event can hold a summary, a payload, a header value or
/// a token: every field is a name, a number or a code.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// The claim is being sent (the run record says `running`).
    RunStarted {
        harness: String,
        run_id: u64,
        trigger: String,
    },
    /// The firing started no process; `claim_error` as in [`RunRecord::claim_error`].
    RunSkipped {
        harness: String,
        run_id: u64,
        trigger: String,
        reason: SkippedReason,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        claim_error: Option<String>,
    },
    RelayClaimed {
        harness: String,
        run_id: u64,
        todo_id: String,
        attempt: u32,
    },
    /// A report was accepted.
    RelayReported {
        harness: String,
        run_id: u64,
        todo_id: String,
        relay_outcome: RelayOutcome,
        dead_letter: bool,
    },
    RelayLeaseLost {
        harness: String,
        run_id: u64,
        todo_id: String,
    },
    /// The run's final record is written next; nothing more happens for it.
    RunFinished {
        harness: String,
        run_id: u64,
        outcome: RunOutcome,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        relay_outcome: Option<RelayOutcome>,
    },
}

impl Event {
    pub fn run_id(&self) -> u64 {
        match self {
            Event::RunStarted { run_id, .. }
            | Event::RunSkipped { run_id, .. }
            | Event::RelayClaimed { run_id, .. }
            | Event::RelayReported { run_id, .. }
            | Event::RelayLeaseLost { run_id, .. }
            | Event::RunFinished { run_id, .. } => *run_id,
        }
    }

    pub fn harness(&self) -> &str {
        match self {
            Event::RunStarted { harness, .. }
            | Event::RunSkipped { harness, .. }
            | Event::RelayClaimed { harness, .. }
            | Event::RelayReported { harness, .. }
            | Event::RelayLeaseLost { harness, .. }
            | Event::RunFinished { harness, .. } => harness,
        }
    }

    /// The event that ends a run whose final record is `record`: `run_skipped` for a skipped
    /// run, `run_finished` otherwise.
    pub fn closing(record: &RunRecord) -> Event {
        match (record.outcome, record.skipped_reason) {
            (RunOutcome::Skipped, Some(reason)) => Event::RunSkipped {
                harness: record.harness.clone(),
                run_id: record.run_id,
                trigger: record.trigger.clone(),
                reason,
                claim_error: record.claim_error.clone(),
            },
            (outcome, _) => Event::RunFinished {
                harness: record.harness.clone(),
                run_id: record.run_id,
                outcome,
                relay_outcome: record.relay_outcome,
            },
        }
    }
}
