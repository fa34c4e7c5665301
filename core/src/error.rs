//! The error codes of the contract, shared by the ledger, the wire and the relay machine.

use serde::{Deserialize, Serialize};

crate::names! {
    /// What went wrong, as the MCP surface names it. `Internal` never crosses the wire as a code of
    /// its own meaning: it marks a broken invariant (a bug or a corrupted store), never bad input.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
    #[serde(rename_all = "snake_case")]
    pub enum ErrorCode {
        /// The todo exists but the caller may not do this to it now: not the lease holder, a fence
        /// mismatch, an expired lease, or a state that does not allow the operation.
        Conflict => "conflict",
        /// No such todo in the caller's scope. A foreign id looks exactly like an unknown one.
        NotFound => "not_found",
        /// The caller's endpoint is not granted the verb or the queue.
        Forbidden => "forbidden",
        /// The input is malformed or out of bounds; nothing was changed.
        Invalid => "invalid",
        /// An invariant broke (a second open attempt, a double close); nothing was changed.
        Internal => "internal",
    }
}

/// An error with its contract code and a message that says what was wrong and what to do.
/// Messages name the todo and the operation, and never carry a lease token.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct Error {
    pub code: ErrorCode,
    pub message: String,
}

impl Error {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Error {
            code,
            message: message.into(),
        }
    }
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Conflict, message)
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::NotFound, message)
    }
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Forbidden, message)
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Invalid, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Internal, message)
    }
}
