//! The daemon's side of the two eras, pure: which era to speak to a source (forced by
//! `mcp_era`, or probed with `server/discover`), what a probe's answer means, when a modern
//! refusal says the server stopped speaking the modern era, which queues a channel's listen
//! subscribes to, and what a frame of a `subscriptions/listen` stream means. The shells
//! (`relay_worker::lease`) move the bytes and call these.

use std::collections::BTreeSet;

use serde_json::Value;

use super::era::{self, Probe};
use super::listen::{ACKNOWLEDGED, UPDATED, queue_of};
use super::{HEADER_MISMATCH, INVALID_REQUEST, METHOD_NOT_FOUND, UNSUPPORTED_VERSION};

crate::names! {
    /// Which era a source is spoken in: `auto` (the default) probes `server/discover` and falls
    /// back to `initialize`; `modern` and `legacy` skip the probe (to pin a source, or to test a
    /// server in each era).
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
    pub enum EraChoice {
        #[default]
        Auto => "auto",
        Modern => "modern",
        Legacy => "legacy",
    }
}

impl EraChoice {
    /// The era without a probe, when the choice forces one.
    pub fn forced(self) -> Option<Probe> {
        match self {
            EraChoice::Auto => None,
            EraChoice::Modern => Some(Probe::Modern),
            EraChoice::Legacy => Some(Probe::Legacy),
        }
    }
}

/// What came back to `server/discover`, as the client saw it. A transport failure (refused,
/// timed out) never gets here: it says nothing about the era and stays an error.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DiscoverAnswer<'a> {
    /// A 2xx with a JSON-RPC result.
    Result(&'a Value),
    /// A JSON-RPC error object (whatever the status it came with, other than 401/403/5xx).
    Error(i64),
    /// A non-2xx status without a JSON-RPC error the client read.
    Status(u16),
    /// A 2xx that is not a JSON-RPC answer.
    NotJsonRpc,
}

/// Why a probe decided nothing: the source is broken, not old.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeFailure {
    /// HTTP 401/403: the credential is wrong; `initialize` would be refused the same way, and
    /// falling back would hide the cause.
    Unauthorized(u16),
    /// HTTP 5xx: the server failed; its era is unknown until it answers.
    ServerError(u16),
}

/// The era a source speaks, from its answer to `server/discover`: a result sharing
/// [`era::MODERN`] is modern; a JSON-RPC error, a 4xx (a legacy-only server answers e.g. 400
/// "missing Mcp-Session-Id", 404 or -32601), a result without a shared version or an answer that
/// is not JSON-RPC falls back to legacy. 401/403 and 5xx are failures, never a fallback (the
/// TypeScript SDK's rule: an era must not be decided by a wrong token or a crashed server).
pub fn judge_discover(answer: DiscoverAnswer<'_>) -> Result<Probe, ProbeFailure> {
    match answer {
        DiscoverAnswer::Status(s @ (401 | 403)) => Err(ProbeFailure::Unauthorized(s)),
        DiscoverAnswer::Status(s) if s >= 500 => Err(ProbeFailure::ServerError(s)),
        DiscoverAnswer::Status(_) | DiscoverAnswer::NotJsonRpc => Ok(Probe::Legacy),
        DiscoverAnswer::Error(code) => Ok(era::probe(Err(code))),
        DiscoverAnswer::Result(result) => Ok(era::probe(Ok(result))),
    }
}

/// Whether a modern request's refusal says the server may have stopped speaking the modern era
/// (downgraded or replaced under a running daemon): HTTP 400 or 404, or the JSON-RPC codes of
/// an envelope the server does not take (-32600, -32601, -32020, -32022). Every one of these is
/// answered before a tool runs, so the client re-probes and sends the request once more.
pub fn modern_refused(status: u16, code: Option<i64>) -> bool {
    matches!(status, 400 | 404)
        || matches!(
            code,
            Some(INVALID_REQUEST | METHOD_NOT_FOUND | HEADER_MISMATCH | UNSUPPORTED_VERSION)
        )
}

/// The queues a channel's modern listener subscribes to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Subscriptions {
    /// These, by name (`relay://queues/<queue>` each).
    Queues(BTreeSet<String>),
    /// Every queue the endpoint lists as a resource (`resources/list`), as the legacy GET
    /// stream hears every granted queue.
    Granted,
}

/// The queues of the queue resources in a `resources/list` result (other resources, such as
/// todos, are passed over).
pub fn listed_queues(result: &Value) -> BTreeSet<String> {
    result
        .get("resources")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|r| r.get("uri").and_then(Value::as_str))
        .filter_map(queue_of)
        .map(str::to_string)
        .collect()
}

/// One message of a `subscriptions/listen` stream, as the listener acts on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ListenFrame {
    /// The first message: the queues the server honours.
    Acknowledged(BTreeSet<String>),
    /// Work may be waiting in this queue: a ring to forward.
    Ring(String),
    /// The answer to the listen request: the server ended the stream (gracefully with a
    /// result; with an error code when it refused it).
    Closed(Option<i64>),
    /// Anything else (another notification, another subscription's, a server request): ignored.
    Other,
}

/// What `message` on the stream of the listen request `subscription` means.
pub fn listen_frame(message: &Value, subscription: &Value) -> ListenFrame {
    let method = message.get("method").and_then(Value::as_str);
    let Some(method) = method else {
        if message.get("id") == Some(subscription) {
            let code = message
                .get("error")
                .map(|e| e.get("code").and_then(Value::as_i64).unwrap_or(0));
            return ListenFrame::Closed(code);
        }
        return ListenFrame::Other;
    };
    let params = message.get("params");
    let tagged = params
        .and_then(|p| p.get("_meta"))
        .and_then(|m| m.get(era::META_SUBSCRIPTION));
    // Untagged notifications are accepted: the specification requires the tag, but a server
    // with one listen per stream loses nothing by leaving it out.
    if message.get("id").is_some() || tagged.is_some_and(|t| t != subscription) {
        return ListenFrame::Other;
    }
    match method {
        ACKNOWLEDGED => ListenFrame::Acknowledged(
            params
                .and_then(|p| p.get("notifications"))
                .map(|n| json_queues(n.get("resourceSubscriptions")))
                .unwrap_or_default(),
        ),
        UPDATED => match params
            .and_then(|p| p.get("uri"))
            .and_then(Value::as_str)
            .and_then(queue_of)
        {
            Some(q) => ListenFrame::Ring(q.to_string()),
            None => ListenFrame::Other,
        },
        _ => ListenFrame::Other,
    }
}

fn json_queues(uris: Option<&Value>) -> BTreeSet<String> {
    uris.and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .filter_map(queue_of)
        .map(str::to_string)
        .collect()
}

/// A listen request's `params` (before the era's stamp) for `queues`.
pub fn listen_params(queues: &BTreeSet<String>) -> Value {
    let uris: Vec<String> = queues.iter().map(|q| super::listen::queue_uri(q)).collect();
    serde_json::json!({"notifications": {"resourceSubscriptions": uris}})
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn discover_answers_decide_the_era_and_credentials_or_crashes_decide_nothing() {
        let modern = json!({"supportedVersions": ["2026-07-28"], "capabilities": {}});
        let other = json!({"supportedVersions": ["2099-01-01"], "capabilities": {}});
        assert_eq!(
            judge_discover(DiscoverAnswer::Result(&modern)),
            Ok(Probe::Modern)
        );
        for legacy in [
            DiscoverAnswer::Result(&other),
            DiscoverAnswer::Error(METHOD_NOT_FOUND),
            DiscoverAnswer::Error(-32000),
            DiscoverAnswer::Error(UNSUPPORTED_VERSION),
            DiscoverAnswer::Status(400),
            DiscoverAnswer::Status(404),
            DiscoverAnswer::Status(405),
            DiscoverAnswer::NotJsonRpc,
        ] {
            assert_eq!(judge_discover(legacy), Ok(Probe::Legacy), "{legacy:?}");
        }
        assert_eq!(
            judge_discover(DiscoverAnswer::Status(401)),
            Err(ProbeFailure::Unauthorized(401))
        );
        assert_eq!(
            judge_discover(DiscoverAnswer::Status(403)),
            Err(ProbeFailure::Unauthorized(403))
        );
        assert_eq!(
            judge_discover(DiscoverAnswer::Status(503)),
            Err(ProbeFailure::ServerError(503))
        );
        assert_eq!(EraChoice::Auto.forced(), None);
        assert_eq!(EraChoice::parse("legacy"), Some(EraChoice::Legacy));
    }

    #[test]
    fn modern_refusals_that_mean_the_era_is_gone() {
        assert!(modern_refused(404, None));
        assert!(modern_refused(400, None));
        assert!(modern_refused(200, Some(METHOD_NOT_FOUND)));
        assert!(modern_refused(200, Some(UNSUPPORTED_VERSION)));
        assert!(!modern_refused(401, None));
        assert!(!modern_refused(500, None));
        assert!(!modern_refused(200, Some(-32602)));
    }

    #[test]
    fn listen_frames() {
        let sub = json!(7);
        let ack = crate::mcp::listen::acknowledged(
            &sub,
            &crate::mcp::listen::Listen {
                queues: BTreeSet::from(["a".to_string()]),
                tasks: Vec::new(),
            },
        );
        assert_eq!(
            listen_frame(&ack, &sub),
            ListenFrame::Acknowledged(BTreeSet::from(["a".to_string()]))
        );
        let ring = crate::mcp::listen::updated(&sub, "a");
        assert_eq!(listen_frame(&ring, &sub), ListenFrame::Ring("a".into()));
        assert_eq!(listen_frame(&ring, &json!(8)), ListenFrame::Other);
        let untagged =
            json!({"jsonrpc": "2.0", "method": UPDATED, "params": {"uri": "relay://queues/b"}});
        assert_eq!(listen_frame(&untagged, &sub), ListenFrame::Ring("b".into()));
        let foreign = json!({"jsonrpc": "2.0", "method": UPDATED, "params": {"uri": "file:///x"}});
        assert_eq!(listen_frame(&foreign, &sub), ListenFrame::Other);
        let closed = crate::mcp::listen::closed(&sub);
        assert_eq!(listen_frame(&closed, &sub), ListenFrame::Closed(None));
        let refused = json!({"jsonrpc": "2.0", "id": 7, "error": {"code": -32602, "message": "x"}});
        assert_eq!(
            listen_frame(&refused, &sub),
            ListenFrame::Closed(Some(-32602))
        );
        let listed = json!({"resources": [{"uri": "relay://queues/a"}, {"uri": "relay://todos/t1"},
                                          {"uri": "relay://queues/b"}]});
        assert_eq!(
            listed_queues(&listed),
            BTreeSet::from(["a".to_string(), "b".to_string()])
        );
        assert_eq!(
            listen_params(&BTreeSet::from(["a".to_string()])),
            json!({"notifications": {"resourceSubscriptions": ["relay://queues/a"]}})
        );
    }
}
