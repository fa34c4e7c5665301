//! [`DoorbellListener`]: the one GET notification stream of a `[channel.<name>]` source.
//!
//! It opens its own session (`initialize`, `notifications/initialized`, and no tool calls, ever),
//! then holds the session's GET SSE stream and forwards every server notification
//! (`notifications/todo_ready` and any other method) to an mpsc channel. When the stream ends
//! or fails it reconnects after a capped exponential backoff; a 404 means the server forgot the
//! session, so it re-initializes first. It stops when the stop signal turns `true` (or its
//! sender is dropped), or when the receiver of the doorbells is gone.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use relay_core::config::{ResolvedConfig, Secret, SourceKind, SourceRef};
use serde_json::Value;
use tokio::sync::{mpsc, watch};

use super::mcp::{Session, SourceLink};
use super::sse::SseParser;
use super::transport::Transport;

/// One server notification from the stream.
#[derive(Clone, Debug, PartialEq)]
pub struct Doorbell {
    /// `channel.bell`.
    pub source: String,
    /// `notifications/todo_ready`, or whatever else the server sent.
    pub method: String,
    /// `params`, or `Value::Null` when there were none.
    pub params: Value,
}

/// The backoff between reconnects: `initial`, doubling per failed attempt up to `max`; back to
/// `initial` once a stream opens (a server that closes idle streams is not failing).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReconnectBackoff {
    pub initial: Duration,
    pub max: Duration,
}

impl Default for ReconnectBackoff {
    fn default() -> Self {
        ReconnectBackoff {
            initial: Duration::from_millis(500),
            max: Duration::from_secs(30),
        }
    }
}

/// The doorbell listener of one channel source. See the module doc.
#[derive(Debug)]
pub struct DoorbellListener {
    ep: SourceLink,
    backoff: ReconnectBackoff,
}

/// How one connected stream ended.
enum StreamEnd {
    Stopped,
    /// The receiver of doorbells is gone: nobody listens any more.
    Closed,
    /// The stream ended or failed; `opened` says whether the server had accepted it.
    Lost {
        opened: bool,
    },
    /// The server no longer knows the session.
    SessionGone,
}

/// Resolves when the stop signal is `true` or its sender is gone.
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

impl DoorbellListener {
    pub fn new(
        source: impl Into<String>,
        url: impl Into<String>,
        headers: impl IntoIterator<Item = (String, Secret)>,
        transport: Arc<dyn Transport>,
    ) -> DoorbellListener {
        DoorbellListener {
            ep: SourceLink::new(source, url, headers, transport),
            backoff: ReconnectBackoff::default(),
        }
    }

    /// The listener of `[channel.<name>]` in a resolved config.
    pub fn from_config(
        config: &ResolvedConfig,
        name: &str,
        transport: Arc<dyn Transport>,
    ) -> Option<DoorbellListener> {
        let source = config.config.channels.get(name)?;
        let r = SourceRef {
            kind: SourceKind::Channel,
            name: name.to_string(),
        };
        let headers = config.headers(&r).cloned().unwrap_or_default();
        Some(DoorbellListener::new(
            r.to_string(),
            source.address.url.as_str(),
            headers,
            transport,
        ))
    }

    /// Bounds each POST and the wait for the stream's headers (default 10 s); the open stream
    /// itself has no deadline.
    pub fn with_timeout(mut self, timeout: Duration) -> DoorbellListener {
        self.ep.timeout = timeout;
        self
    }

    pub fn with_backoff(mut self, backoff: ReconnectBackoff) -> DoorbellListener {
        self.backoff = backoff;
        self
    }

    /// Runs [`DoorbellListener::run`] on a task.
    pub fn spawn(
        self,
        doorbells: mpsc::Sender<Doorbell>,
        stop: watch::Receiver<bool>,
    ) -> tokio::task::JoinHandle<()> {
        tokio::spawn(self.run(doorbells, stop))
    }

    /// Listens until stopped. Every failure is logged and retried; nothing here is fatal.
    pub async fn run(self, doorbells: mpsc::Sender<Doorbell>, mut stop: watch::Receiver<bool>) {
        let mut delay = self.backoff.initial;
        let mut session: Option<Session> = None;
        let mut last_event_id: Option<String> = None;
        loop {
            if *stop.borrow() {
                return;
            }
            let current = match session.clone() {
                Some(s) => s,
                None => {
                    let opened = tokio::select! {
                        _ = stopped(&mut stop) => return,
                        r = self.ep.open_session() => r,
                    };
                    match opened {
                        Ok(s) => {
                            last_event_id = None;
                            session = Some(s.clone());
                            s
                        }
                        Err(e) => {
                            tracing::warn!(
                                source = %self.ep.source,
                                "doorbell: initialize failed: {}; retrying in {delay:?}",
                                e.describe()
                            );
                            if self.pause(&mut stop, &mut delay).await {
                                return;
                            }
                            continue;
                        }
                    }
                }
            };
            match self
                .listen(&current, &mut last_event_id, &doorbells, &mut stop)
                .await
            {
                StreamEnd::Stopped | StreamEnd::Closed => return,
                StreamEnd::SessionGone => {
                    tracing::info!(source = %self.ep.source, "doorbell: the server expired the session; re-initializing");
                    session = None;
                    // A forgotten session is not a failing server: re-initialize at once.
                    continue;
                }
                StreamEnd::Lost { opened } => {
                    if opened {
                        delay = self.backoff.initial;
                    }
                    if self.pause(&mut stop, &mut delay).await {
                        return;
                    }
                }
            }
        }
    }

    /// Waits `delay` (doubling it for next time, capped); true when stopped meanwhile.
    async fn pause(&self, stop: &mut watch::Receiver<bool>, delay: &mut Duration) -> bool {
        let wait = *delay;
        *delay = (*delay * 2).min(self.backoff.max);
        tokio::select! {
            _ = stopped(stop) => true,
            _ = tokio::time::sleep(wait) => false,
        }
    }

    /// Opens the GET stream on `session` and forwards its notifications until it ends.
    async fn listen(
        &self,
        session: &Session,
        last_event_id: &mut Option<String>,
        doorbells: &mpsc::Sender<Doorbell>,
        stop: &mut watch::Receiver<bool>,
    ) -> StreamEnd {
        let mut req = self
            .ep
            .request(Some(session), "text/event-stream", Vec::new());
        if let Some(id) = last_event_id.as_deref() {
            req.headers.push(("last-event-id".into(), id.to_string()));
        }
        let opened = tokio::select! {
            _ = stopped(stop) => return StreamEnd::Stopped,
            r = self.ep.transport.get_stream(req) => r,
        };
        let mut resp = match opened {
            Ok(resp) => resp,
            Err(e) => {
                tracing::warn!(source = %self.ep.source, "doorbell: the stream did not open: {e}");
                return StreamEnd::Lost { opened: false };
            }
        };
        match resp.status {
            200..=299 => {}
            404 if session.id.is_some() => return StreamEnd::SessionGone,
            401 | 403 => {
                tracing::error!(
                    source = %self.ep.source,
                    status = resp.status,
                    "doorbell: the server refused the credential; check the source's \
                     Authorization header and the token in its env_file"
                );
                return StreamEnd::Lost { opened: false };
            }
            status => {
                tracing::warn!(
                    source = %self.ep.source,
                    status,
                    "doorbell: the server answered the GET stream with HTTP {status}; check that \
                     the source's url is the server's /mcp/<endpoint> URL"
                );
                return StreamEnd::Lost { opened: false };
            }
        }
        let mut parser = SseParser::new();
        loop {
            let chunk = tokio::select! {
                _ = stopped(stop) => return StreamEnd::Stopped,
                c = resp.body.next() => c,
            };
            let chunk = match chunk {
                Some(Ok(chunk)) => chunk,
                Some(Err(e)) => {
                    tracing::info!(source = %self.ep.source, "doorbell: the stream broke: {e}; reconnecting");
                    return StreamEnd::Lost { opened: true };
                }
                None => {
                    tracing::info!(source = %self.ep.source, "doorbell: the server closed the stream; reconnecting");
                    return StreamEnd::Lost { opened: true };
                }
            };
            for event in parser.push(&chunk) {
                if let Some(id) = parser.last_event_id() {
                    *last_event_id = Some(id.to_string());
                }
                if event.event.as_deref().is_some_and(|t| t != "message") {
                    continue;
                }
                let Ok(message) = serde_json::from_str::<Value>(&event.data) else {
                    tracing::warn!(source = %self.ep.source, "doorbell: an event that is not JSON was ignored");
                    continue;
                };
                // Notifications have a method and no id; a server request (it has an id) is
                // not answered: this session calls nothing and answers nothing.
                let Some(method) = message.get("method").and_then(Value::as_str) else {
                    continue;
                };
                if message.get("id").is_some() {
                    continue;
                }
                let bell = Doorbell {
                    source: self.ep.source.clone(),
                    method: method.to_string(),
                    params: message.get("params").cloned().unwrap_or(Value::Null),
                };
                tokio::select! {
                    _ = stopped(stop) => return StreamEnd::Stopped,
                    sent = doorbells.send(bell) => if sent.is_err() {
                        return StreamEnd::Closed;
                    },
                }
            }
        }
    }
}
