//! What an attempt's process is given once claimed: its claimant label, its files, the
//! context file's JSON and the relay variables. None of it ever holds the lease token: the
//! functions here never see one.

use serde_json::{Value, json};

use super::types::{ClaimedTodo, PriorAttempt};
use crate::bounds::bound_claimant;
use crate::time::{Wall, rfc3339};

/// `harness/<host>/<harness>/run-<run_id>`, cut to 128 bytes on a char boundary.
pub fn claimant(host: &str, harness: &str, run_id: u64) -> String {
    let label = format!("harness/{host}/{harness}/run-{run_id}");
    bound_claimant(&label).unwrap_or(label)
}

/// The run's files beside its log: `<jobs_dir>/<harness>/<run_id>.relay.json`,
/// `<jobs_dir>/<harness>/<run_id>.summary` and `<jobs_dir>/<harness>/<run_id>.usage.json`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunFiles {
    pub context_file: String,
    pub summary_file: String,
    /// The agent's spend so far, which it rewrites (`HARNESS_USAGE_FILE`).
    pub usage_file: String,
}

pub fn run_files(jobs_dir: &str, harness: &str, run_id: u64) -> RunFiles {
    let dir = format!("{}/{harness}", jobs_dir.trim_end_matches('/'));
    RunFiles {
        context_file: format!("{dir}/{run_id}.relay.json"),
        summary_file: format!("{dir}/{run_id}.summary"),
        usage_file: format!("{dir}/{run_id}.usage.json"),
    }
}

/// The todo fields the context file carries (the contract's, less the attempt counts); anything
/// else the server sent stays out.
pub(crate) const TODO_FIELDS: [&str; 8] = [
    "id",
    "queue",
    "title",
    "kind",
    "source",
    "payload",
    "work_order",
    "created_at",
];

/// JSON paths of text the daemon did not author.
pub const UNTRUSTED: [&str; 6] = [
    "todo.title",
    "todo.payload",
    "todo.work_order",
    "prior_attempts[].summary",
    "prior_attempts[].question",
    "prior_attempts[].answer",
];

/// The context file's JSON. `claimed_at` is the daemon's wall time of the claim answer (the
/// contract's claim answer has no such field), written as RFC 3339.
pub fn context_file(
    claim: &ClaimedTodo,
    claimed_at: Wall,
    lease_ttl_seconds: u64,
    summary_file: &str,
) -> Value {
    let todo: serde_json::Map<String, Value> = TODO_FIELDS
        .iter()
        .map(|f| {
            (
                f.to_string(),
                claim.todo.get(f).cloned().unwrap_or(Value::Null),
            )
        })
        .collect();
    let mut prior: Vec<&PriorAttempt> = claim.prior_attempts.iter().collect();
    prior.sort_by_key(|a| std::cmp::Reverse(a.seq));
    json!({
        "version": 1,
        "todo": todo,
        "attempt": {
            "seq": claim.attempt_seq,
            "number": claim.attempt,
            "max": claim.max_attempts,
            "claimed_at": rfc3339(claimed_at.ms()),
            "lease_ttl_seconds": lease_ttl_seconds,
            "idempotency_key": idempotency_key(claim),
        },
        "prior_attempts": prior,
        "untrusted": UNTRUSTED,
        "summary_file": summary_file,
    })
}

/// The context file's bytes as written.
pub fn context_file_bytes(
    claim: &ClaimedTodo,
    claimed_at: Wall,
    lease_ttl_seconds: u64,
    summary_file: &str,
) -> Vec<u8> {
    let file = context_file(claim, claimed_at, lease_ttl_seconds, summary_file);
    let mut bytes = serde_json::to_vec_pretty(&file).unwrap_or_default();
    bytes.push(b'\n');
    bytes
}

/// The attempt's key for side effects: `<todo_id>:<seq>`. The same across transport retries of
/// one attempt (its seq is the server's), different for every attempt; an agent builds its own
/// keys from it (`create-pr:$HARNESS_IDEMPOTENCY_KEY:<head sha>`).
pub fn idempotency_key(claim: &ClaimedTodo) -> String {
    format!("{}:{}", claim.todo_id, claim.attempt_seq)
}

/// The relay variables; they override the daemon's environment and env_file.
/// `HARNESS_BUDGET_REMAINING` is there only when the claim answer showed a budget.
pub fn relay_env(claim: &ClaimedTodo, files: &RunFiles) -> Vec<(String, String)> {
    let budget = claim
        .budget_remaining
        .as_ref()
        .map(|b| ("HARNESS_BUDGET_REMAINING", b.to_json()));
    [
        ("HARNESS_TODO_ID", claim.todo_id.clone()),
        ("HARNESS_ATTEMPT", claim.attempt.to_string()),
        ("HARNESS_ATTEMPT_SEQ", claim.attempt_seq.to_string()),
        ("HARNESS_IDEMPOTENCY_KEY", idempotency_key(claim)),
        ("HARNESS_MAX_ATTEMPTS", claim.max_attempts.to_string()),
        ("HARNESS_RELAY_FILE", files.context_file.clone()),
        ("HARNESS_ATTEMPT_SUMMARY_FILE", files.summary_file.clone()),
        ("HARNESS_USAGE_FILE", files.usage_file.clone()),
    ]
    .into_iter()
    .chain(budget)
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claimant_is_cut_on_a_char_boundary() {
        assert_eq!(claimant("box", "fixer", 7), "harness/box/fixer/run-7");
        let long = claimant(&"é".repeat(100), "fixer", 7);
        assert!(long.len() <= 128 && long.len() >= 127);
        assert!(long.starts_with("harness/é"));
    }

    #[test]
    fn run_files_sit_beside_the_log() {
        let f = run_files("/state/jobs/", "fixer", 43);
        assert_eq!(f.context_file, "/state/jobs/fixer/43.relay.json");
        assert_eq!(f.summary_file, "/state/jobs/fixer/43.summary");
        assert_eq!(f.usage_file, "/state/jobs/fixer/43.usage.json");
    }
}
