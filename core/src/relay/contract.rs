//! The client side of the queue server's contract (relay-design, "The Switchboard contract relay
//! uses"): the arguments the daemon sends for each lease command, and what it reads from each
//! answer. The daemon is released apart from the server, so it must work against any server
//! that honours that table, not only our own.
//!
//! # Liberal in what it reads
//!
//! An answer is read for the table's fields only; any other field is ignored, and every field
//! is optional except the few the daemon cannot work without:
//!
//! - `claim_next`: `empty: true` is an empty queue. Otherwise `todo.id` (a non-empty string),
//!   `todo.attempt` and `todo.max_attempts` (whole numbers from 1) and `attempt_seq` (a whole
//!   number) must be there; a missing or mistyped one is an [`AnswerError`] naming it, which the
//!   lease client turns into `claim_failed` (code `malformed_answer`): nothing is spawned and the
//!   lease lapses. A missing (or `null`) `lease_token` is the machine's `no_fence` refusal; one
//!   that is not a non-empty string is an [`AnswerError`]. The other todo fields (`queue`,
//!   `title`, `kind`, `source`, `payload`, `work_order`, `created_at`) are copied into the
//!   context file as they came, `null` when absent; `prior_attempts` entries are read field by
//!   field (the server's `attempt` is the context file's `number`; `question` and `answer` are
//!   read where a server that lets people answer sends them), a field of the wrong type reads as
//!   absent and an entry that is not an object is skipped. `todo.budget` and `todo.spent` are
//!   read for what the budget still allows ([`super::usage::budget_remaining`]); a server that
//!   sends neither gives no budget.
//! - `heartbeat`, `complete`, `release`: any answer that is not a tool error is success; its
//!   content is not read (it need not even be JSON).
//! - `fail` and `request_input`: `dead_letter` is a dead letter only when it is the JSON `true`
//!   (a question past the todo's question or spend budget dead-letters it); `next_retry_at` is
//!   read when it is a string. A fail answer without `dead_letter` is an accepted fail that is
//!   not a dead letter (`relay_outcome = failed`): the server has closed the attempt, so sending
//!   it again could only be refused as a late report, and a dead letter is never inferred
//!   from `state` or attempt counts.
//!
//! Nothing here quotes a value from an answer in an error: a mistyped field might hold a token.
//!
//! # Strict in what it sends
//!
//! [`lease_call`] builds each call's arguments from the wire's typed argument structs, leaving
//! absent options out (a strict schema refuses `null` for a string). An argument beyond the
//! table's ([`ARGUMENTS`]) is an extension (`fail.retryable`, `fail.failure_signature`, `usage`
//! on the heartbeat and every report): it is sent only when the server's schema declares it
//! ([`Capabilities::declares`]), because an undeclared argument fails the whole call. The verb
//! `request_input` is an extension as a whole: the machine chooses it only when
//! [`Capabilities::asks`], and its arguments too are sent only as declared.
//!
//! [`ARGUMENTS`]: super::table::ARGUMENTS

use serde::Serialize;
use serde_json::{Map, Value, json};

use super::capabilities::Capabilities;
use super::context::TODO_FIELDS;
use super::table::contract_arguments;
use super::types::{ClaimedTodo, Command, Input, LeaseError, PriorAttempt, ReportVerb};
use super::usage::budget_remaining;
use crate::time::read_wall_text;
use crate::wire::{
    ClaimNextArgs, FailArgs, HeartbeatArgs, LeaseToken, ReleaseArgs, ReportArgs, RequestInputArgs,
    UsageArg,
};

/// What a malformed answer is: defined beside the [`LeaseError`] that carries one.
pub use super::types::{AnswerError, Problem};

/// A decoded `claim_next` answer.
#[derive(Clone, Debug, PartialEq)]
pub enum ClaimAnswer {
    Empty,
    Claimed(ClaimedTodo),
}

const CLAIM: &str = "claim_next";

fn need<T>(
    field: &'static str,
    v: Option<&Value>,
    want: &'static str,
    read: impl Fn(&Value) -> Option<T>,
) -> Result<T, AnswerError> {
    let problem = match v {
        None | Some(Value::Null) => Problem::Missing,
        Some(v) => match read(v) {
            Some(t) => return Ok(t),
            None => Problem::Not(want),
        },
    };
    Err(AnswerError {
        verb: CLAIM,
        field,
        problem,
    })
}

fn count(v: &Value) -> Option<u32> {
    v.as_u64()
        .filter(|n| *n >= 1)
        .and_then(|n| u32::try_from(n).ok())
}

fn text(v: &Value) -> Option<String> {
    v.as_str().filter(|s| !s.is_empty()).map(str::to_string)
}

/// Reads a `claim_next` answer (the tool result's JSON object).
pub fn decode_claim(answer: &Value) -> Result<ClaimAnswer, AnswerError> {
    if answer.get("empty").and_then(Value::as_bool) == Some(true) {
        return Ok(ClaimAnswer::Empty);
    }
    let todo = need("todo", answer.get("todo"), "an object", |v| {
        v.as_object().cloned()
    })?;
    let todo_id = need("todo.id", todo.get("id"), "a non-empty string", text)?;
    let attempt = need(
        "todo.attempt",
        todo.get("attempt"),
        "a whole number from 1",
        count,
    )?;
    let max_attempts = need(
        "todo.max_attempts",
        todo.get("max_attempts"),
        "a whole number from 1",
        count,
    )?;
    let attempt_seq = need(
        "attempt_seq",
        answer.get("attempt_seq"),
        "a whole number",
        Value::as_u64,
    )?;
    let lease_token = match answer.get("lease_token") {
        // The server ignored require_fence: the machine refuses the claim as `no_fence`.
        None | Some(Value::Null) => None,
        v => Some(need("lease_token", v, "a non-empty string", text).map(LeaseToken::new)?),
    };
    let budget_remaining = budget_remaining(&todo);
    // Only the contract's todo fields travel on (to the context file).
    let todo: Map<String, Value> = TODO_FIELDS
        .iter()
        .map(|f| (f.to_string(), todo.get(*f).cloned().unwrap_or(Value::Null)))
        .collect();
    let prior_attempts = answer
        .get("prior_attempts")
        .and_then(Value::as_array)
        .map(|list| list.iter().filter_map(prior_attempt).collect())
        .unwrap_or_default();
    Ok(ClaimAnswer::Claimed(ClaimedTodo {
        todo_id,
        attempt,
        max_attempts,
        attempt_seq,
        lease_token,
        todo: Value::Object(todo),
        prior_attempts,
        budget_remaining,
    }))
}

/// One `prior_attempts` entry; a field of the wrong type reads as absent.
fn prior_attempt(v: &Value) -> Option<PriorAttempt> {
    let a = v.as_object()?;
    let string = |k: &str| a.get(k).and_then(Value::as_str).map(str::to_string);
    Some(PriorAttempt {
        seq: a.get("seq").and_then(Value::as_u64),
        number: a
            .get("attempt")
            .and_then(Value::as_u64)
            .and_then(|n| u32::try_from(n).ok()),
        outcome: string("outcome"),
        died: a.get("died").and_then(Value::as_bool),
        claimant: string("claimant"),
        claimed_at: string("claimed_at").as_deref().and_then(read_wall_text),
        ended_at: string("ended_at").as_deref().and_then(read_wall_text),
        summary: string("summary"),
        artifact: string("artifact"),
        question: string("question"),
        answer: string("answer"),
    })
}

/// What the daemon reads from an accepted report: `dead_letter` and `next_retry_at` of a
/// `fail` or `request_input` answer (see the module doc for an answer without them); nothing of
/// the others.
pub fn decode_report(verb: ReportVerb, answer: &Value) -> (bool, Option<String>) {
    if !matches!(verb, ReportVerb::Fail | ReportVerb::RequestInput) {
        return (false, None);
    }
    let dead_letter = answer.get("dead_letter").and_then(Value::as_bool) == Some(true);
    let next_retry_at = answer
        .get("next_retry_at")
        .and_then(Value::as_str)
        .map(str::to_string);
    (dead_letter, next_retry_at)
}

/// The machine's input for a lease command's successful tool answer (`answer` is the result's
/// JSON, `Value::Null` when it carried none). `None` for a command that is not a lease call.
pub fn answer_input(command: &Command, answer: &Value) -> Option<Result<Input, AnswerError>> {
    Some(Ok(match command {
        Command::SendClaimNext { request, .. } => match decode_claim(answer) {
            Ok(ClaimAnswer::Empty) => Input::ClaimEmpty { request: *request },
            Ok(ClaimAnswer::Claimed(claim)) => Input::ClaimAnswered {
                request: *request,
                claim,
            },
            Err(e) => return Some(Err(e)),
        },
        Command::SendHeartbeat { request, .. } => Input::HeartbeatOk { request: *request },
        Command::SendReport { request, verb, .. } => {
            let (dead_letter, next_retry_at) = decode_report(*verb, answer);
            Input::ReportAnswered {
                request: *request,
                dead_letter,
                next_retry_at,
            }
        }
        _ => return None,
    }))
}

/// The machine's input for a lease command that failed with `error`. `None` for a command that
/// is not a lease call.
pub fn failed_input(command: &Command, error: LeaseError) -> Option<Input> {
    Some(match command {
        Command::SendClaimNext { request, .. } => Input::ClaimFailed {
            request: *request,
            error,
        },
        Command::SendHeartbeat { request, .. } => Input::HeartbeatFailed {
            request: *request,
            error,
        },
        Command::SendReport { request, .. } => Input::ReportFailed {
            request: *request,
            error,
        },
        _ => return None,
    })
}

/// One `tools/call` to the lease source: the tool and its arguments. The arguments hold the
/// lease token, so `Debug` shows their names only.
#[derive(Clone, PartialEq)]
pub struct LeaseCall {
    pub tool: &'static str,
    pub arguments: Value,
}

impl std::fmt::Debug for LeaseCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&String> = self
            .arguments
            .as_object()
            .map(|o| o.keys().collect())
            .unwrap_or_default();
        f.debug_struct("LeaseCall")
            .field("tool", &self.tool)
            .field("arguments", &names)
            .finish()
    }
}

/// The `tools/call` for a `SendClaimNext`, `SendHeartbeat` or `SendReport`, given what the
/// source's schemas declare, without usage; `None` for any other command.
pub fn lease_call(command: &Command, caps: &Capabilities) -> Option<LeaseCall> {
    lease_call_with(command, caps, None)
}

/// [`lease_call`] with the attempt's usage so far (what the driver read from its usage file,
/// [`super::usage::UsageFile`]), put on a heartbeat or report where the server's schema for
/// that verb declares `usage`; never on a claim.
pub fn lease_call_with(
    command: &Command,
    caps: &Capabilities,
    usage: Option<&UsageArg>,
) -> Option<LeaseCall> {
    let usage = usage.cloned();
    let (tool, args) = match command {
        Command::SendClaimNext {
            queue,
            lease_ttl_seconds,
            require_fence,
            claimant,
            ..
        } => (
            "claim_next",
            object(&ClaimNextArgs {
                queue: queue.clone(),
                lease_ttl_seconds: Some(*lease_ttl_seconds),
                require_fence: Some(*require_fence),
                claimant: Some(claimant.clone()),
            }),
        ),
        Command::SendHeartbeat {
            todo_id,
            lease_ttl_seconds,
            lease_token,
            ..
        } => (
            "heartbeat",
            object(&HeartbeatArgs {
                id: todo_id.clone(),
                lease_ttl_seconds: Some(*lease_ttl_seconds),
                lease_token: Some(lease_token.clone()),
                usage,
            }),
        ),
        Command::SendReport {
            verb: ReportVerb::Release,
            todo_id,
            lease_token,
            summary,
            ..
        } => (
            "release",
            object(&ReleaseArgs {
                id: todo_id.clone(),
                summary: Some(summary.clone()),
                lease_token: Some(lease_token.clone()),
                usage,
            }),
        ),
        Command::SendReport {
            verb: ReportVerb::RequestInput,
            todo_id,
            lease_token,
            summary,
            artifact,
            question,
            ..
        } => (
            "request_input",
            object(&RequestInputArgs {
                id: todo_id.clone(),
                question: question.clone().unwrap_or_default(),
                summary: Some(summary.clone()),
                artifact: artifact.clone(),
                usage,
                lease_token: Some(lease_token.clone()),
            }),
        ),
        Command::SendReport {
            verb: ReportVerb::Fail,
            todo_id,
            lease_token,
            summary,
            artifact,
            result,
            retryable,
            failure_signature,
            ..
        } => (
            "fail",
            // retryable and failure_signature are extensions: keep_declared drops them for a
            // server whose schema does not declare them.
            object(&FailArgs {
                id: todo_id.clone(),
                result: result.as_object().cloned(),
                summary: Some(summary.clone()),
                artifact: artifact.clone(),
                lease_token: Some(lease_token.clone()),
                retryable: *retryable,
                failure_signature: failure_signature.clone(),
                usage,
            }),
        ),
        Command::SendReport {
            verb,
            todo_id,
            lease_token,
            summary,
            artifact,
            result,
            ..
        } => (
            verb.as_str(),
            object(&ReportArgs {
                id: todo_id.clone(),
                result: result.as_object().cloned(),
                summary: Some(summary.clone()),
                artifact: artifact.clone(),
                lease_token: Some(lease_token.clone()),
                usage,
            }),
        ),
        _ => return None,
    };
    Some(LeaseCall {
        tool,
        arguments: Value::Object(keep_declared(tool, args, caps)),
    })
}

/// The `tools/call` params (`{"name", "arguments"}`) for a `SendClaimNext`, `SendHeartbeat` or
/// `SendReport` under what the source's schemas declare ([`lease_call`]); `None` for any other
/// command. What the lease client and the simulator put on the wire.
pub fn call_params(command: &Command, caps: &Capabilities) -> Option<Value> {
    call_params_with(command, caps, None)
}

/// [`call_params`] with the attempt's usage ([`lease_call_with`]).
pub fn call_params_with(
    command: &Command,
    caps: &Capabilities,
    usage: Option<&UsageArg>,
) -> Option<Value> {
    let call = lease_call_with(command, caps, usage)?;
    Some(json!({"name": call.tool, "arguments": call.arguments}))
}

/// The [`LeaseError::Other`] code of a tool error without a readable code.
pub const TOOL_ERROR: &str = "tool_error";

/// Why a `tools/call` result is not a successful lease answer. Server text it holds (an unknown
/// code, a message) may echo anything, a token included: a caller redacts it before quoting it.
#[derive(Clone, PartialEq)]
pub enum ResultError {
    /// The result is not a JSON object: not an MCP server's answer.
    NotAnObject,
    /// The tool answered `isError`, with the error's code and message when readable.
    Tool {
        code: Option<String>,
        message: Option<String>,
    },
    /// An accepted call whose answer lacks a field the daemon needs.
    Malformed(AnswerError),
}

// Hand-written: the server's text stays out of `Debug`.
impl std::fmt::Debug for ResultError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ResultError::NotAnObject => f.write_str("NotAnObject"),
            ResultError::Tool { code, .. } => f
                .debug_struct("Tool")
                .field(
                    "known_code",
                    &code.as_deref().and_then(crate::ErrorCode::parse),
                )
                .finish_non_exhaustive(),
            ResultError::Malformed(e) => f.debug_tuple("Malformed").field(e).finish(),
        }
    }
}

impl ResultError {
    /// The error the machine branches on: a tool error's contract code, an unknown code as
    /// `Other` (through `quote`, which redacts it), none as `Other("tool_error")`; a result
    /// that is not an object is a transport failure.
    pub fn kind(&self, quote: impl Fn(&str) -> String) -> LeaseError {
        match self {
            ResultError::NotAnObject => LeaseError::Transport,
            ResultError::Tool { code: Some(c), .. } => crate::ErrorCode::parse(c)
                .map(LeaseError::Code)
                .unwrap_or_else(|| LeaseError::Other(quote(c))),
            ResultError::Tool { code: None, .. } => LeaseError::Other(TOOL_ERROR.into()),
            ResultError::Malformed(e) => LeaseError::Malformed(Box::new(*e)),
        }
    }
}

/// A `tools/call` result's answer: its `structuredContent` object, or else the JSON of its
/// first text block (servers without structured output put the same JSON there).
fn result_answer(result: &Value) -> Option<Value> {
    result
        .get("structuredContent")
        .filter(|v| v.is_object())
        .cloned()
        .or_else(|| {
            let text = result
                .get("content")?
                .as_array()?
                .iter()
                .find_map(|c| (c.get("type")? == "text").then(|| c.get("text")?.as_str())?)?;
            serde_json::from_str::<Value>(text).ok()
        })
}

/// The machine's input for a lease command's `tools/call` result, read as the contract says
/// (see the module doc), or why it is not a success (the caller hands the machine
/// [`failed_input`] with [`ResultError::kind`]). `None` for a command that is not a lease call.
pub fn result_input(command: &Command, result: &Value) -> Option<Result<Input, ResultError>> {
    if !command.is_lease_call() {
        return None;
    }
    if !result.is_object() {
        return Some(Err(ResultError::NotAnObject));
    }
    let answer = result_answer(result);
    if result.get("isError").and_then(Value::as_bool) == Some(true) {
        let error = answer.as_ref().and_then(|a| a.get("error"));
        let text = |k: &str| {
            error
                .and_then(|e| e.get(k))
                .and_then(Value::as_str)
                .map(str::to_string)
        };
        return Some(Err(ResultError::Tool {
            code: text("code"),
            message: text("message"),
        }));
    }
    answer_input(command, &answer.unwrap_or(Value::Null)).map(|r| r.map_err(ResultError::Malformed))
}

/// The arguments as a JSON object without the absent ones.
fn object(args: &impl Serialize) -> Map<String, Value> {
    let mut map = match serde_json::to_value(args) {
        Ok(Value::Object(map)) => map,
        _ => Map::new(),
    };
    map.retain(|_, v| !v.is_null());
    map
}

/// Drops every extension argument (one beyond [`ARGUMENTS`]) the server's schema for `verb`
/// does not declare.
///
/// [`ARGUMENTS`]: super::table::ARGUMENTS
fn keep_declared(
    verb: &str,
    mut args: Map<String, Value>,
    caps: &Capabilities,
) -> Map<String, Value> {
    let contract = contract_arguments(verb);
    args.retain(|name, _| contract.contains(&name.as_str()) || caps.declares(verb, name));
    args
}

#[cfg(test)]
mod tests;
