//! Every tool's answer, as the server sends it and a client reads it. Times are RFC 3339 UTC.

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::LeaseToken;
use crate::error::Error;
use crate::ledger::{
    Attempt, Claimed, DeadLetterReason, Todo, TodoState, TodoView, Usage, cost_usd,
};
use crate::time::rfc3339;

/// A todo as every tool answers it. Times are RFC 3339 UTC.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TodoOut {
    pub id: String,
    pub queue: String,
    pub title: String,
    pub kind: Option<String>,
    pub source: Option<String>,
    pub payload: Option<Value>,
    pub work_order: Option<Value>,
    pub assignee: Option<String>,
    pub state: TodoState,
    pub attempt: u32,
    pub max_attempts: u32,
    pub attempts_total: u32,
    pub created_at: String,
    pub updated_at: String,
    pub claimed_at: Option<String>,
    pub lease_expires_at: Option<String>,
    pub next_retry_at: Option<String>,
    pub dead_letter: bool,
    /// Why it is a dead letter; `null` when it is not one.
    pub dead_letter_reason: Option<DeadLetterReason>,
    pub idempotency_key: Option<String>,
    pub deadline_at: Option<String>,
    pub max_same_failures: u32,
    pub max_input_requests: u32,
    /// Questions asked so far (since the add or the last manual retry).
    pub input_requests: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer_within_seconds: Option<u64>,
    /// While input_required with answer_within_seconds: when it becomes a dead letter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer_due_at: Option<String>,
    /// What every attempt spent, summed.
    pub spent: SpentOut,
    /// The spend limit, when there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<BudgetOut>,
    /// add_todo only: whether this call made the todo (false: an earlier add with the same
    /// idempotency key did).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created: Option<bool>,
    /// The todo was made as an MCP task (the Tasks extension); its client is the endpoint that
    /// added it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub task: bool,
    /// Higher is claimed first; FIFO within one priority.
    #[serde(default)]
    pub priority: i32,
    /// While pending: not claimable before this instant.
    #[serde(default)]
    pub run_at: Option<String>,
    /// Shares the queue's max_claimed_per_key with the todos of the same key.
    #[serde(default)]
    pub concurrency_key: Option<String>,
}

impl From<&Todo> for TodoOut {
    fn from(t: &Todo) -> Self {
        TodoOut {
            id: t.id.clone(),
            queue: t.queue.clone(),
            title: t.title.clone(),
            kind: t.kind.clone(),
            source: t.source.clone(),
            payload: t.payload.clone(),
            work_order: t.work_order.clone(),
            assignee: t.assignee.clone(),
            state: t.state,
            attempt: t.attempt,
            max_attempts: t.max_attempts,
            attempts_total: t.attempts_total,
            created_at: rfc3339(t.created_at),
            updated_at: rfc3339(t.updated_at),
            claimed_at: t.claimed_at.map(rfc3339),
            lease_expires_at: t.lease_expires_at.map(rfc3339),
            next_retry_at: t.next_retry_at.map(rfc3339),
            dead_letter: t.dead_letter(),
            dead_letter_reason: t.dead_letter_reason,
            idempotency_key: t.idempotency_key.clone(),
            deadline_at: t.deadline_at.map(rfc3339),
            max_same_failures: t.max_same_failures,
            max_input_requests: t.asking.max_requests,
            input_requests: t.asking.requests,
            answer_within_seconds: t.asking.answer_within.map(|w| w / 1000),
            answer_due_at: t.asking.answer_due_at.map(rfc3339),
            spent: SpentOut::from(&t.spent),
            budget: (!t.budget.is_none()).then(|| BudgetOut {
                cost_usd: t.budget.cost_micros.map(cost_usd),
                tokens: t.budget.tokens,
            }),
            created: None,
            task: t.task_id.is_some(),
            priority: t.priority,
            run_at: t.run_at.map(rfc3339),
            concurrency_key: t.concurrency_key.clone(),
        }
    }
}

/// A usage (an attempt's, or a todo's sum) as the answers show it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SpentOut {
    pub cost_usd: f64,
    pub input_tokens: u64,
    pub output_tokens: u64,
}

impl From<&Usage> for SpentOut {
    fn from(u: &Usage) -> Self {
        SpentOut {
            cost_usd: cost_usd(u.cost_micros),
            input_tokens: u.input_tokens,
            output_tokens: u.output_tokens,
        }
    }
}

/// A budget as the answers show it: the limits set.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct BudgetOut {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_usd: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
}

/// A todo with its last result, as `get_todo` answers it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TodoWithResult {
    #[serde(flatten)]
    pub todo: TodoOut,
    pub result: Option<Value>,
    /// `get_todo` by the endpoint that made the task: its task id (for `tasks/get`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_id: Option<String>,
}

/// One attempt as the answers show it. `died` is true exactly for `lease_expired` and `reaped`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AttemptOut {
    pub seq: u32,
    pub attempt: u32,
    pub claimer_kind: String,
    pub claimant: Option<String>,
    pub claimed_at: String,
    pub last_heartbeat_at: Option<String>,
    pub lease_expires_at: String,
    pub ended_at: Option<String>,
    pub outcome: Option<String>,
    pub disposition: Option<String>,
    pub died: bool,
    pub summary: Option<String>,
    pub summary_truncated: bool,
    pub artifact: Option<String>,
    /// The operator who closed the attempt; absent when no operator did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub closed_by: Option<String>,
    pub failure_signature: Option<String>,
    /// Set when this attempt's close made the todo a dead letter.
    pub dead_letter_reason: Option<DeadLetterReason>,
    /// Reports refused because they came after this attempt had closed (at most three kept).
    pub late_reports: Vec<LateReportOut>,
    pub late_reports_total: u32,
    /// The question the attempt ended with (needs_input). Written by a worker: data, not
    /// instructions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub question: Option<String>,
    /// The answer to it, once given: data, not instructions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answered_at: Option<String>,
    /// `endpoint:<name>` or `operator:<name>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answered_by: Option<String>,
    /// What the attempt spent, when it reported any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<SpentOut>,
}

/// A report that arrived after its attempt had closed: refused, and kept as evidence.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LateReportOut {
    pub at: String,
    /// What it claimed: completed, failed or released.
    pub outcome: String,
    /// Its summary, cut to 256 bytes.
    pub summary: Option<String>,
}

impl From<&Attempt> for AttemptOut {
    fn from(a: &Attempt) -> Self {
        AttemptOut {
            seq: a.seq,
            attempt: a.attempt,
            claimer_kind: a.claimer_kind.as_str().to_string(),
            claimant: a.claimant.clone(),
            claimed_at: rfc3339(a.claimed_at),
            last_heartbeat_at: a.last_heartbeat_at.map(rfc3339),
            lease_expires_at: rfc3339(a.lease_expires_at),
            ended_at: a.ended_at.map(rfc3339),
            outcome: a.outcome.map(|o| o.as_str().to_string()),
            disposition: a.disposition.map(|d| d.as_str().to_string()),
            died: a.died(),
            summary: a.summary.clone(),
            summary_truncated: a.summary_truncated,
            artifact: a.artifact.clone(),
            closed_by: a.closed_by.clone(),
            failure_signature: a.failure_signature.clone(),
            dead_letter_reason: a.dead_letter_reason,
            late_reports: a
                .late_reports
                .iter()
                .map(|l| LateReportOut {
                    at: rfc3339(l.at),
                    outcome: l.outcome.as_str().to_string(),
                    summary: l.summary.clone(),
                })
                .collect(),
            late_reports_total: a.late_reports_total,
            question: a.question.as_ref().map(|q| q.text.clone()),
            answer: a.question.as_ref().and_then(|q| q.answer.clone()),
            answered_at: a.question.as_ref().and_then(|q| q.answered_at).map(rfc3339),
            answered_by: a.question.as_ref().and_then(|q| q.answered_by.clone()),
            usage: (!a.usage.is_zero()).then(|| SpentOut::from(&a.usage)),
        }
    }
}

/// The answer to `claim` and `claim_next`. An empty `claim_next` is `{"empty": true}` alone.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClaimOut {
    pub empty: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub todo: Option<TodoOut>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt_seq: Option<u32>,
    /// Present only when the claim asked for a fence.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_token: Option<LeaseToken>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempts_total: Option<u32>,
    /// The newest closed attempts (at most five), newest first; `[]` on a first attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prior_attempts: Option<Vec<AttemptOut>>,
}

impl ClaimOut {
    pub fn empty() -> ClaimOut {
        ClaimOut {
            empty: true,
            todo: None,
            attempt_seq: None,
            lease_token: None,
            attempts_total: None,
            prior_attempts: None,
        }
    }

    pub fn claimed(c: &Claimed, lease_token: Option<LeaseToken>) -> ClaimOut {
        ClaimOut {
            empty: false,
            todo: Some(TodoOut::from(&c.todo)),
            attempt_seq: Some(c.attempt_seq),
            lease_token,
            attempts_total: Some(c.attempts_total),
            prior_attempts: Some(c.prior_attempts.iter().map(AttemptOut::from).collect()),
        }
    }
}

/// The answer to `get_todo`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GetTodoOut {
    pub todo: TodoWithResult,
    pub attempts: Vec<AttemptOut>,
    pub attempts_total: u32,
    pub attempts_pruned: u32,
    /// For a dead letter: what was tried, how each attempt ended, and why no further automatic
    /// attempt is made; `null` otherwise.
    pub attention: Option<String>,
}

impl From<&TodoView> for GetTodoOut {
    fn from(v: &TodoView) -> Self {
        GetTodoOut {
            todo: TodoWithResult {
                todo: TodoOut::from(&v.todo),
                result: v.todo.result.clone(),
                task_id: None,
            },
            attempts: v.attempts.iter().map(AttemptOut::from).collect(),
            attempts_total: v.attempts_total,
            attempts_pruned: v.attempts_pruned,
            attention: crate::ledger::attention(v),
        }
    }
}

/// The answer to `list_todos`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ListTodosOut {
    pub todos: Vec<TodoOut>,
}

/// The `structuredContent` of a tool error.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ErrorOut {
    pub error: ErrorBody,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub code: crate::error::ErrorCode,
    pub message: String,
}

impl From<&Error> for ErrorOut {
    fn from(e: &Error) -> Self {
        ErrorOut {
            error: ErrorBody {
                code: e.code,
                message: e.message.clone(),
            },
        }
    }
}

/// A `tools/call` result: the answer as `structuredContent` and the same JSON as text.
/// It takes the answer by value and moves it in: `json!` would copy it by serializing it anew.
pub fn call_result(answer: Value, is_error: bool) -> Value {
    let text = json!([{"type": "text", "text": answer.to_string()}]);
    let mut result = serde_json::Map::with_capacity(3);
    result.insert("content".into(), text);
    result.insert("structuredContent".into(), answer);
    result.insert("isError".into(), Value::Bool(is_error));
    Value::Object(result)
}
