//! The contract table (relay-design, "The Switchboard contract relay uses") as data: the verbs
//! the daemon calls, the arguments it sends, and those a server must declare. The client side
//! of the contract sends by it, and the capability check holds a server's tools/list to it.

/// The contract table's "Arguments sent", per verb: what every server honouring it accepts
/// (the † ones are checked at initialize: `REQUIRED` and `RELEASE`). Anything else is an
/// extension.
pub const ARGUMENTS: [(&str, &[&str]); 5] = [
    (
        "claim_next",
        &["queue", "lease_ttl_seconds", "require_fence", "claimant"],
    ),
    ("heartbeat", &["id", "lease_ttl_seconds", "lease_token"]),
    (
        "complete",
        &["id", "result", "summary", "artifact", "lease_token"],
    ),
    (
        "fail",
        &["id", "result", "summary", "artifact", "lease_token"],
    ),
    ("release", &["id", "summary", "lease_token"]),
];

/// Verbs beyond the contract table the daemon uses where a server declares them, with the
/// arguments it cannot call them without ([`Capabilities::asks`](super::Capabilities::asks)).
/// Their declared arguments are kept like the drain verbs'.
pub const OPTIONAL_VERBS: [(&str, &[&str]); 1] =
    [("request_input", &["id", "question", "lease_token"])];

/// The drain verbs relay needs, with the arguments each must declare.
pub(super) const REQUIRED: [(&str, &[&str]); 4] = [
    ("claim_next", &["require_fence", "claimant"]),
    ("heartbeat", &["lease_token"]),
    ("complete", &["lease_token", "summary", "artifact"]),
    ("fail", &["lease_token", "summary", "artifact"]),
];

/// `release` is optional (an endpoint may not be granted it), but when it is advertised its
/// schema must carry these.
pub(super) const RELEASE: (&str, &[&str]) = ("release", &["lease_token", "summary"]);

/// The contract's arguments of `verb`; empty for a verb the table does not name.
pub fn contract_arguments(verb: &str) -> &'static [&'static str] {
    ARGUMENTS
        .iter()
        .find(|(v, _)| *v == verb)
        .map_or(&[], |(_, args)| args)
}
