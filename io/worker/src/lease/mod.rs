//! The daemon's network clients: the lease client of each `[queue.<name>]` source, the doorbell
//! listener of each `[channel.<name>]` source, and the receipt client of each `[cairn.<name>]`
//! source, over one HTTP seam.
//!
//! - [`Transport`] is the seam: `ReqwestTransport` in production (the `reqwest` feature, on by
//!   default), [`HyperTransport`] (hyper-util over a pluggable dialer) where the network is
//!   simulated (turmoil).
//! - [`LeaseClient`] turns the relay machine's `SendClaimNext`, `SendHeartbeat` and `SendReport`
//!   commands into `tools/call`s and their answers into the machine's inputs
//!   ([`LeaseClient::execute`]), on a link used for `tools/list` and `tools/call` only: the
//!   modern era (2026-07-28, no session) when a `server/discover` probe finds it, else a legacy
//!   session (`relay_core::mcp::client` decides; `mcp_era` forces one). It checks the server's
//!   tool schemas on every (re-)open and re-opens (probing afresh) once when the server expires
//!   the session or refuses the era, reporting both as [`SessionNews`].
//! - [`DoorbellListener`] holds the one doorbell stream of a channel source (a
//!   `subscriptions/listen` where the server is modern, the session's GET stream where it is
//!   legacy) and forwards its rings; it calls no tools.
//! - [`ReceiptClient`] uploads attempt receipts; the upload's shape is in [`receipt`].
//!
//! # What these clients never do
//!
//! They never put a header value or a lease token in an error, a log line or a `Debug` form
//! (server text is redacted before it is quoted), never open a GET or listen stream on a lease
//! link, never retry a call the server may have run (only a session 404 or a modern refusal of
//! the era, which the server answers without running the call, is retried, once), and never
//! decide anything about an attempt: each answer goes back to the machine as an input.

mod client;
mod doorbell;
mod mcp;
pub mod receipt;
pub mod sse;
mod transport;

// Most of these drive the clients over `ReqwestTransport`.
#[cfg(all(test, feature = "reqwest"))]
mod tests;

pub use client::{
    LeaseCallError, LeaseClient, LeaseOutcome, NotALeaseCall, RPC_ERROR, SessionNews, TOOL_ERROR,
    ToolsList, UNAUTHORIZED, UNSUPPORTED,
};
pub use doorbell::{Doorbell, DoorbellListener, ReconnectBackoff};
pub use mcp::{DEFAULT_TIMEOUT, PROTOCOL_VERSION};
pub use receipt::{ReceiptClient, ReceiptError, compose_receipt};
pub use sse::{SseEvent, SseParser, parse_sse};
#[cfg(feature = "reqwest")]
pub use transport::ReqwestTransport;
pub use transport::{
    Answer, BodyStream, BoxFuture, DialedIo, HttpRequest, HttpResponse, HyperTransport,
    MAX_RESPONSE_BYTES, Response, StreamResponse, Transport, TransportError,
};
