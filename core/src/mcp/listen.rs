//! The modern era's doorbell: every queue an endpoint may claim from is a resource
//! `relay://queues/<queue>` (a read answers the queue's counts for that endpoint), and a
//! `subscriptions/listen` stream subscribed to it hears `notifications/resources/updated` for
//! it when work may be waiting. Which rings go out is the same gate as the legacy ring
//! ([`crate::doorbell::Gate`]); this module decodes the request and writes the frames.

use std::collections::BTreeSet;

use serde_json::{Value, json};

use super::era::META_SUBSCRIPTION;
use crate::error::Error;
use crate::grant::Grant;

/// Where a queue's resource URI starts; the queue's name follows.
pub const QUEUE_URI_PREFIX: &str = "relay://queues/";
/// The notification a listener hears when work may be waiting in a queue.
pub const UPDATED: &str = "notifications/resources/updated";
/// The stream's first message.
pub const ACKNOWLEDGED: &str = "notifications/subscriptions/acknowledged";

/// A queue's resource URI.
pub fn queue_uri(queue: &str) -> String {
    format!("{QUEUE_URI_PREFIX}{queue}")
}

/// The queue a queue resource URI names, if it is one.
pub fn queue_of(uri: &str) -> Option<&str> {
    uri.strip_prefix(QUEUE_URI_PREFIX).filter(|q| !q.is_empty())
}

/// Whether an endpoint is offered queue resources and the listen stream: when it may claim.
pub fn offered(grant: &Grant) -> bool {
    grant.may_claim()
}

/// Whether an endpoint with `grant` may read the queue resource of `queue`: a queue it may claim
/// from. Any other reads as not found, like a foreign todo.
pub fn readable(grant: &Grant, queue: &str) -> Result<(), Error> {
    if offered(grant) && grant.covers(queue) {
        return Ok(());
    }
    Err(Error::not_found(format!(
        "resources/read: no queue {} for this endpoint (queue resources are the queues it may \
         claim from)",
        crate::limits::escape_text(queue)
    )))
}

/// A decoded `subscriptions/listen`: the queues to ring for, and the honoured subset of the
/// request's filter for the acknowledgement.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listen {
    pub queues: BTreeSet<String>,
}

/// Decodes a listen request's `notifications` filter for an endpoint with `grant`. Only
/// `resourceSubscriptions` to granted queues are honoured (relay's tool list never changes, so
/// the `*ListChanged` kinds are left out of the acknowledgement, as the specification asks for
/// kinds a server does not send); a URI that is not a granted queue's is refused, naming it.
pub fn decode(grant: &Grant, params: Option<&Value>) -> Result<Listen, Error> {
    if !offered(grant) {
        return Err(Error::forbidden(
            "subscriptions/listen: the doorbell is for endpoints that claim work, and this one \
             is granted neither claim_next nor claim",
        ));
    }
    let filter = params.and_then(|p| p.get("notifications")).ok_or_else(|| {
        Error::invalid(
            "subscriptions/listen needs params.notifications, e.g. {\"resourceSubscriptions\": \
                 [\"relay://queues/<queue>\"]}",
        )
    })?;
    let Value::Object(filter) = filter else {
        return Err(Error::invalid("params.notifications must be an object"));
    };
    let mut queues = BTreeSet::new();
    match filter.get("resourceSubscriptions") {
        None | Some(Value::Null) => {}
        Some(Value::Array(uris)) => {
            for uri in uris {
                let Some(uri) = uri.as_str() else {
                    return Err(Error::invalid(
                        "params.notifications.resourceSubscriptions must be a list of URI strings",
                    ));
                };
                let Some(queue) = queue_of(uri) else {
                    return Err(Error::invalid(format!(
                        "params.notifications.resourceSubscriptions: {} is not a queue resource; \
                         subscribe to {QUEUE_URI_PREFIX}<queue>",
                        crate::limits::escape_text(uri)
                    )));
                };
                if !grant.covers(queue) {
                    return Err(Error::forbidden(format!(
                        "params.notifications.resourceSubscriptions: this endpoint is not granted \
                         the queue {}; subscribe only to granted queues",
                        crate::limits::escape_text(queue)
                    )));
                }
                queues.insert(queue.to_string());
            }
        }
        Some(_) => {
            return Err(Error::invalid(
                "params.notifications.resourceSubscriptions must be a list of URI strings",
            ));
        }
    }
    Ok(Listen { queues })
}

/// The stream's first message: what of the filter is honoured.
pub fn acknowledged(subscription: &Value, listen: &Listen) -> Value {
    let uris: Vec<String> = listen.queues.iter().map(|q| queue_uri(q)).collect();
    json!({
        "jsonrpc": "2.0",
        "method": ACKNOWLEDGED,
        "params": {
            "_meta": {META_SUBSCRIPTION: subscription},
            "notifications": {"resourceSubscriptions": uris},
        },
    })
}

/// A ring: work may be waiting in `queue`.
pub fn updated(subscription: &Value, queue: &str) -> Value {
    json!({
        "jsonrpc": "2.0",
        "method": UPDATED,
        "params": {"_meta": {META_SUBSCRIPTION: subscription}, "uri": queue_uri(queue)},
    })
}

/// The graceful end of a stream (the server is stopping): the listen request's answer.
pub fn closed(subscription: &Value) -> Value {
    super::response(
        subscription.clone(),
        json!({"resultType": "complete", "_meta": {META_SUBSCRIPTION: subscription}}),
    )
}

/// A queue resource's read: its todo counts by state for the endpoint.
pub fn read_result(queue: &str, counts: &[(String, u64)]) -> Value {
    let mut by_state = serde_json::Map::new();
    for state in crate::ledger::TodoState::ALL {
        let n = counts
            .iter()
            .find(|(s, _)| s == state.as_str())
            .map_or(0, |(_, n)| *n);
        by_state.insert(state.as_str().into(), json!(n));
    }
    let body = json!({"queue": queue, "counts": by_state});
    json!({"contents": [{
        "uri": queue_uri(queue),
        "mimeType": crate::resources::MIME_JSON,
        "text": body.to_string(),
    }]})
}

/// A queue resource as `resources/list` shows it.
pub fn listed(queue: &str) -> Value {
    json!({
        "uri": queue_uri(queue),
        "name": format!("queue {queue}"),
        "description": "A queue's todo counts; subscribe on subscriptions/listen to hear when \
                        work may be waiting",
        "mimeType": crate::resources::MIME_JSON,
    })
}

/// The queue resources' template.
pub fn template() -> Value {
    json!({
        "uriTemplate": format!("{QUEUE_URI_PREFIX}{{queue}}"),
        "name": "queue",
        "description": "A queue's todo counts for this endpoint (subscribe to hear of new work)",
        "mimeType": crate::resources::MIME_JSON,
    })
}
