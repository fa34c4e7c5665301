//! Everything a relay test needs to drive [`crate::relay::Relay`] in a few lines, and the
//! bodies of its property tests (each takes the bytes of a program, so a fuzz target can
//! reuse it as it is).

mod driver;
mod program;
mod properties;

pub use driver::*;
pub use program::*;
pub use properties::*;

use crate::relay::{Command, LeaseToken, ReportVerb, RequestId};

/// Run 1's report for `td_1` under `token`, with a summary, an artifact and a result: the one
/// the contract's and the lease client's tests send.
pub fn report_command(request: u64, verb: ReportVerb, token: &str) -> Command {
    Command::SendReport {
        request: RequestId(request),
        run_id: 1,
        verb,
        todo_id: "td_1".into(),
        lease_token: LeaseToken::new(token),
        summary: "attempt 1/5 · agent failed".into(),
        artifact: Some("mcp://cairn/Ab12".into()),
        result: serde_json::json!({"harness": {"run_id": 1}}),
        retryable: (verb == ReportVerb::Fail).then_some(false),
        failure_signature: (verb == ReportVerb::Fail).then(|| "0123abcd".into()),
        question: (verb == ReportVerb::RequestInput).then(|| "which branch?".into()),
    }
}
