//! Run records and events of a leased harness (REQ-20), and the restart reconciliation
//! (REQ-15). A record never carries a summary, a payload, a header value or a lease token: none
//! of its fields can hold one.

use serde::{Deserialize, Serialize};

use crate::time::{Millis, rfc3339};

/// How a run ended, as SPEC-0008 records it.
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

/// How an attempt ended on the lease side.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RelayOutcome {
    Completed,
    Failed,
    Released,
    LeaseLost,
    ReportLost,
    DeadLettered,
    NoWork,
}

impl RelayOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            RelayOutcome::Completed => "completed",
            RelayOutcome::Failed => "failed",
            RelayOutcome::Released => "released",
            RelayOutcome::LeaseLost => "lease_lost",
            RelayOutcome::ReportLost => "report_lost",
            RelayOutcome::DeadLettered => "dead_lettered",
            RelayOutcome::NoWork => "no_work",
        }
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
    pub(crate) fn new(harness: &str, lease: &str, run_id: u64, trigger: &str, now: Millis) -> Self {
        RunRecord {
            harness: harness.to_string(),
            run_id,
            trigger: trigger.to_string(),
            outcome: RunOutcome::Running,
            skipped_reason: None,
            claim_error: None,
            started_at: rfc3339(now),
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

/// REQ-15: a record a crashed daemon left `running` becomes `interrupted`. Nothing else
/// changes — in particular no relay outcome is invented, because no call is made for it: the
/// lease lapses and the server records the attempt as having died. Other records pass through.
pub fn reconcile_interrupted(mut record: RunRecord, now: Millis) -> RunRecord {
    if record.outcome == RunOutcome::Running {
        record.outcome = RunOutcome::Interrupted;
        record.ended_at = Some(rfc3339(now));
    }
    record
}

/// Protocol events of a leased harness.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
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
}

impl Event {
    pub fn run_id(&self) -> u64 {
        match self {
            Event::RelayClaimed { run_id, .. }
            | Event::RelayReported { run_id, .. }
            | Event::RelayLeaseLost { run_id, .. } => *run_id,
        }
    }
}
