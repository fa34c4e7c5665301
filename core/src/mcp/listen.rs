//! The modern era's doorbell: every queue an endpoint may claim from is a resource
//! `relay://queues/<queue>` (a read answers the queue's counts for that endpoint), and a
//! `subscriptions/listen` stream subscribed to it hears `notifications/resources/updated` for
//! it when work may be waiting. Which rings go out is the same gate as the legacy ring
//! ([`crate::doorbell::Gate`]); this module decodes the request and writes the frames.
//!
//! A stream may also watch MCP tasks (`taskIds`, the Tasks extension, for a request that
//! declares it): it hears `notifications/tasks` with the whole task whenever what `tasks/get`
//! would answer changes ([`Watched::look`]). The server looks at the watched tasks every poll
//! interval in the shared store, so a change made through any server of a cluster is heard.

use std::collections::BTreeSet;

use serde_json::{Value, json};

use super::era::META_SUBSCRIPTION;
use crate::error::Error;
use crate::grant::Grant;
use crate::ledger::TaskId;

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

/// A decoded `subscriptions/listen`: the queues to ring for and the tasks to watch, the
/// honoured subset of the request's filter for the acknowledgement.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Listen {
    pub queues: BTreeSet<String>,
    /// Task ids with a task id's shape, at most [`TASKS_PER_LISTEN`] (one that names no task of
    /// this endpoint is watched and never heard of).
    pub tasks: Vec<TaskId>,
}

/// The notification a task watcher hears.
pub const TASK_STATUS: &str = "notifications/tasks";
/// Tasks one stream may watch.
pub const TASKS_PER_LISTEN: usize = 100;

/// Whether a listen request asks for task notifications (the request must then declare the
/// Tasks extension).
pub fn asks_tasks(params: Option<&Value>) -> bool {
    params
        .and_then(|p| p.get("notifications"))
        .and_then(|n| n.get("taskIds"))
        .is_some_and(|t| !t.is_null())
}

fn task_ids(v: Option<&Value>) -> Result<Vec<TaskId>, Error> {
    let bad = || {
        Error::invalid(format!(
            "params.notifications.taskIds must be a list of at most {TASKS_PER_LISTEN} task id \
             strings (the taskId add_todo answered)"
        ))
    };
    let ids = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(ids)) if ids.len() <= TASKS_PER_LISTEN => ids,
        Some(_) => return Err(bad()),
    };
    let mut out: Vec<TaskId> = Vec::with_capacity(ids.len());
    for id in ids {
        let id = id.as_str().ok_or_else(bad)?;
        if let Some(t) = TaskId::parse(id)
            && !out.contains(&t)
        {
            out.push(t);
        }
    }
    Ok(out)
}

/// Decodes a listen request's `notifications` filter for an endpoint with `grant`. Only
/// `resourceSubscriptions` to granted queues are honoured (relay's tool list never changes, so
/// the `*ListChanged` kinds are left out of the acknowledgement, as the specification asks for
/// kinds a server does not send); a URI that is not a granted queue's is refused, naming it.
pub fn decode(grant: &Grant, params: Option<&Value>) -> Result<Listen, Error> {
    let tasks_only = asks_tasks(params)
        && grant.allows(crate::wire::Tool::AddTodo)
        && params
            .and_then(|p| p.get("notifications"))
            .and_then(|n| n.get("resourceSubscriptions"))
            .is_none_or(|r| r.as_array().is_some_and(Vec::is_empty));
    if !offered(grant) && !tasks_only {
        return Err(Error::forbidden(
            "subscriptions/listen: the doorbell is for endpoints that claim work, and this one \
             is granted neither claim_next nor claim (an endpoint granted add_todo may watch \
             its tasks, with taskIds)",
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
    let tasks = task_ids(filter.get("taskIds"))?;
    Ok(Listen { queues, tasks })
}

/// The stream's first message: what of the filter is honoured.
pub fn acknowledged(subscription: &Value, listen: &Listen) -> Value {
    let uris: Vec<String> = listen.queues.iter().map(|q| queue_uri(q)).collect();
    let mut notifications = json!({"resourceSubscriptions": uris});
    if !listen.tasks.is_empty() {
        let ids: Vec<&str> = listen.tasks.iter().map(TaskId::expose).collect();
        notifications["taskIds"] = json!(ids);
    }
    json!({
        "jsonrpc": "2.0",
        "method": ACKNOWLEDGED,
        "params": {
            "_meta": {META_SUBSCRIPTION: subscription},
            "notifications": notifications,
        },
    })
}

/// One task a listen stream watches, and what the stream last heard of it.
#[derive(Clone, Debug, PartialEq)]
pub struct Watched {
    pub id: TaskId,
    last: Option<Value>,
}

/// What one look at a watched task decided.
#[derive(Clone, Debug, PartialEq)]
pub struct Look {
    /// The task to send in `notifications/tasks` ([`task_status`]), when it is news.
    pub news: Option<Value>,
    /// Whether to look at it again.
    pub keep: bool,
}

impl Watched {
    pub fn new(id: TaskId) -> Watched {
        Watched { id, last: None }
    }

    /// Takes what `tasks/get` answered now (`Err`: its refusal's code). It is news when its
    /// status, message or update time moved since the last one sent (the first one always is).
    /// A task that reached a terminal status, or that names no task of the endpoint, is watched
    /// no longer; one whose store did not answer (an internal error) is looked at again.
    pub fn look(&mut self, answer: Result<Value, crate::ErrorCode>) -> Look {
        let now = match answer {
            Ok(now) => now,
            Err(code) => {
                return Look {
                    news: None,
                    keep: code == crate::ErrorCode::Internal,
                };
            }
        };
        let key = |t: &Value| {
            (
                t["status"].clone(),
                t["statusMessage"].clone(),
                t["lastUpdatedAt"].clone(),
            )
        };
        let news = self.last.as_ref().is_none_or(|l| key(l) != key(&now));
        let ended = now["status"]
            .as_str()
            .and_then(crate::task::TaskStatus::parse)
            .is_some_and(crate::task::TaskStatus::terminal);
        let look = Look {
            news: news.then(|| now.clone()),
            keep: !ended,
        };
        self.last = Some(now);
        look
    }
}

/// A watched task's news: the whole task, as `tasks/get` would answer it now.
pub fn task_status(subscription: &Value, task: &Value) -> Value {
    let mut params = match task {
        Value::Object(m) => m.clone(),
        _ => serde_json::Map::new(),
    };
    params.insert("_meta".into(), json!({META_SUBSCRIPTION: subscription}));
    json!({"jsonrpc": "2.0", "method": TASK_STATUS, "params": params})
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
