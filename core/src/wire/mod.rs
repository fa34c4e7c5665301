//! The MCP surface as values: every tool's arguments and answers, and each tool's input JSON
//! Schema, generated from the argument types themselves so the schema and the decoder are one
//! place. Every argument struct denies unknown fields, which is what the schema's
//! `additionalProperties: false` promises, and what the relay's capability check (it reads the
//! declared properties) relies on.
//!
//! Summaries of earlier attempts travel in these answers. They are data written by earlier
//! claimers, bounded and never interpreted here; the tool descriptions say so to clients.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

mod answers;
mod args;
mod tool;

pub use answers::{
    AttemptOut, BudgetOut, ClaimOut, ErrorBody, ErrorOut, GetTodoOut, LateReportOut, ListTodosOut,
    SpentOut, TodoOut, TodoWithResult, call_result,
};
pub use args::{
    AddTodoArgs, AnswerTodoArgs, BudgetArg, ClaimArgs, ClaimNextArgs, FailArgs, GetTodoArgs,
    HeartbeatArgs, ListTodosArgs, ReleaseArgs, ReportArgs, RequestInputArgs, UsageArg,
    lease_ttl_ms, usage_of,
};
pub use tool::{Tool, ToolCall, tools_for, tools_list};

/// `get_todo`'s `attempts_limit`: default and bounds.
pub const ATTEMPTS_LIMIT_DEFAULT: u32 = 20;
pub const ATTEMPTS_LIMIT_MAX: u32 = 100;
/// `list_todos`' `limit`: default and bounds.
pub const LIST_LIMIT_DEFAULT: u32 = 100;
pub const LIST_LIMIT_MAX: u32 = 500;

/// A lease token: the capability a fenced claim hands out. The server keeps only its SHA-256;
/// the holder keeps it in memory for the life of its attempt and puts it on the wire in the
/// `lease_token` argument and nowhere else. Its `Debug` form never shows it, and there is no
/// `Display`, so it cannot leak through a log line or an error by accident.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(transparent)]
pub struct LeaseToken(String);

impl std::fmt::Debug for LeaseToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LeaseToken(<redacted>)")
    }
}

impl LeaseToken {
    pub fn new(token: impl Into<String>) -> LeaseToken {
        LeaseToken(token.into())
    }

    /// The token's text, for the wire (and the server's hash) only.
    pub fn expose(&self) -> &str {
        &self.0
    }

    pub fn hash(&self) -> crate::ledger::TokenHash {
        crate::ledger::TokenHash::of(&self.0)
    }
}

#[cfg(test)]
mod tests;
