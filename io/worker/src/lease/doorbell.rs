//! [`DoorbellListener`]: the one doorbell stream of a `[channel.<name>]` source.
//!
//! It finds the source's era like the lease client (`mcp_era`, or the `server/discover` probe)
//! and calls no tools, ever:
//! - **modern**: a `subscriptions/listen` POST subscribed to the channel's queues
//!   (`relay_core::fleet::channel_subscriptions`: the `queue` keys of the lease sources
//!   its harnesses claim from, or every queue the endpoint lists as a resource); each
//!   `notifications/resources/updated` for one of them is forwarded;
//! - **legacy**: its own session (`initialize`, `notifications/initialized`) and the session's
//!   GET SSE stream; every server notification (`notifications/todo_ready` and any other
//!   method) is forwarded.
//!
//! When the stream ends or fails it reconnects after a capped exponential backoff; a 404 on a
//! legacy session (forgotten) re-opens at once, and a modern refusal that says the era is gone
//! re-opens after the backoff: both probe afresh, so a server upgraded or downgraded under the
//! daemon is followed. It stops when the stop signal turns `true` (or its sender is dropped), or
//! when the receiver of the doorbells is gone.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use relay_core::config::{ResolvedConfig, Secret, SourceKind, SourceRef};
use relay_core::mcp::client::{self as era_rules, ListenFrame, Subscriptions};
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};

use super::mcp::{ClientSession, RpcError, SourceLink};
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
    /// What a modern listen subscribes to.
    subscriptions: Subscriptions,
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
    /// The server refused a modern request as if it no longer spoke the era: probe again after
    /// the backoff (at once could spin against a server that answers discover but nothing else).
    EraGone,
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
            subscriptions: Subscriptions::Granted,
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
        Some(
            DoorbellListener::new(
                r.to_string(),
                source.address.url.as_str(),
                headers,
                transport,
            )
            .with_era(source.address.mcp_era)
            .with_subscriptions(relay_core::fleet::channel_subscriptions(
                &config.config,
                name,
            )),
        )
    }

    /// Forces an era (`mcp_era`); `Auto` probes.
    pub fn with_era(mut self, era: relay_core::mcp::client::EraChoice) -> DoorbellListener {
        self.ep.era = era;
        self
    }

    /// What a modern listen subscribes to (default: every queue the endpoint lists).
    pub fn with_subscriptions(mut self, subscriptions: Subscriptions) -> DoorbellListener {
        self.subscriptions = subscriptions;
        self
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
        let mut session: Option<ClientSession> = None;
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
                        r = self.ep.open() => r,
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
            let end = if current.modern {
                self.listen_modern(&current, &doorbells, &mut stop).await
            } else {
                self.listen(&current, &mut last_event_id, &doorbells, &mut stop)
                    .await
            };
            match end {
                StreamEnd::Stopped | StreamEnd::Closed => return,
                StreamEnd::SessionGone => {
                    tracing::info!(source = %self.ep.source, "doorbell: the server expired the session; re-initializing");
                    session = None;
                    // A forgotten session is not a failing server: re-initialize at once.
                    continue;
                }
                StreamEnd::EraGone => {
                    tracing::info!(source = %self.ep.source, "doorbell: the server refused the 2026-07-28 era; probing again");
                    session = None;
                    if self.pause(&mut stop, &mut delay).await {
                        return;
                    }
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

    /// The queues to subscribe to: the configured ones, or every queue resource the endpoint
    /// lists. `Err`: how the stream ended without opening.
    async fn queues(
        &self,
        session: &ClientSession,
    ) -> Result<std::collections::BTreeSet<String>, StreamEnd> {
        let queues = match &self.subscriptions {
            Subscriptions::Queues(q) => q.clone(),
            Subscriptions::Granted => {
                match self
                    .ep
                    .rpc(Some(session), "resources/list", json!({}))
                    .await
                {
                    Ok((result, _)) => era_rules::listed_queues(&result),
                    Err(RpcError::EraGone { .. }) => return Err(StreamEnd::EraGone),
                    Err(e) => {
                        tracing::warn!(source = %self.ep.source, "doorbell: resources/list failed: {}", e.describe());
                        return Err(StreamEnd::Lost { opened: false });
                    }
                }
            }
        };
        if queues.is_empty() {
            // An endpoint granted every queue lists the queues that hold its todos: none yet.
            tracing::warn!(
                source = %self.ep.source,
                "doorbell: the endpoint lists no queue to subscribe to yet; listing again after \
                 the backoff (set queue = \"<name>\" on the [queue.<name>] sources this channel's \
                 harnesses lease from to subscribe by name)"
            );
            return Err(StreamEnd::Lost { opened: false });
        }
        Ok(queues)
    }

    /// Waits for a stream's answer (`what` names it in the log) and checks its status: `Ok` for
    /// a 2xx, else how the stream ended (`special` first: a status with a meaning of its own).
    async fn open(
        &self,
        what: &str,
        opening: super::transport::Answer<super::transport::StreamResponse>,
        special: impl Fn(u16) -> Option<StreamEnd>,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<super::transport::StreamResponse, StreamEnd> {
        let opened = tokio::select! {
            _ = stopped(stop) => return Err(StreamEnd::Stopped),
            r = opening => r,
        };
        let resp = match opened {
            Ok(resp) => resp,
            Err(e) => {
                tracing::warn!(source = %self.ep.source, "doorbell: {what} did not open: {e}");
                return Err(StreamEnd::Lost { opened: false });
            }
        };
        let status = resp.status;
        if (200..=299).contains(&status) {
            return Ok(resp);
        }
        if let Some(end) = special(status) {
            return Err(end);
        }
        if status == 401 || status == 403 {
            tracing::error!(
                source = %self.ep.source,
                status,
                "doorbell: the server refused the credential; check the source's \
                 Authorization header and the token in its env_file"
            );
        } else {
            tracing::warn!(
                source = %self.ep.source,
                status,
                "doorbell: the server answered {what} with HTTP {status}; check that the \
                 source's url is the server's /mcp/<endpoint> URL"
            );
        }
        Err(StreamEnd::Lost { opened: false })
    }

    /// The open stream's next chunk, or how it ended: stopped, or lost (broken or closed by
    /// the server, logged as the `what` it is), `opened` saying whether it had been listening.
    async fn chunk(
        &self,
        resp: &mut super::transport::StreamResponse,
        what: &str,
        opened: bool,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<bytes::Bytes, StreamEnd> {
        let chunk = tokio::select! {
            _ = stopped(stop) => return Err(StreamEnd::Stopped),
            c = resp.body.next() => c,
        };
        match chunk {
            Some(Ok(chunk)) => Ok(chunk),
            Some(Err(e)) => {
                tracing::info!(source = %self.ep.source, "doorbell: the {what} broke: {e}; reconnecting");
                Err(StreamEnd::Lost { opened })
            }
            None => {
                tracing::info!(source = %self.ep.source, "doorbell: the server closed the {what}; reconnecting");
                Err(StreamEnd::Lost { opened })
            }
        }
    }

    /// Opens a `subscriptions/listen` stream (modern era) and forwards its rings until it ends.
    async fn listen_modern(
        &self,
        session: &ClientSession,
        doorbells: &mpsc::Sender<Doorbell>,
        stop: &mut watch::Receiver<bool>,
    ) -> StreamEnd {
        let queues = tokio::select! {
            _ = stopped(stop) => return StreamEnd::Stopped,
            q = self.queues(session) => match q {
                Ok(q) => q,
                Err(end) => return end,
            },
        };
        let id = self.ep.next_id();
        let subscription = json!(id);
        let req = self.ep.call_request(
            Some(session),
            id,
            relay_core::mcp::Method::Listen.as_str(),
            era_rules::listen_params(&queues),
        );
        let refused = |s| era_rules::modern_refused(s, None).then_some(StreamEnd::EraGone);
        let opening = self.ep.transport.post_stream(req);
        let mut resp = match self.open("the listen stream", opening, refused, stop).await {
            Ok(resp) => resp,
            Err(end) => return end,
        };
        let is_stream = resp
            .header("content-type")
            .is_some_and(|c| c.trim_start().starts_with("text/event-stream"));
        let mut parser = SseParser::new();
        let mut acknowledged = false;
        loop {
            let chunk = match self
                .chunk(&mut resp, "listen stream", acknowledged, stop)
                .await
            {
                Ok(chunk) => chunk,
                Err(end) => return end,
            };
            let messages: Vec<Value> = if is_stream {
                parser
                    .push(&chunk)
                    .into_iter()
                    .filter(|e| e.event.as_deref().is_none_or(|t| t == "message"))
                    .filter_map(|e| serde_json::from_str(&e.data).ok())
                    .collect()
            } else {
                // A JSON answer instead of a stream: the listen's refusal, whole in one chunk
                // or not at all (then it is read as a closed stream).
                serde_json::from_slice(&chunk).into_iter().collect()
            };
            for message in messages {
                match era_rules::listen_frame(&message, &subscription) {
                    ListenFrame::Acknowledged(honoured) => {
                        acknowledged = true;
                        let missing: Vec<&String> = queues.difference(&honoured).collect();
                        if missing.is_empty() {
                            tracing::info!(source = %self.ep.source, queues = honoured.len(), "doorbell: listening");
                        } else {
                            tracing::warn!(source = %self.ep.source, ?missing, "doorbell: the server does not ring for these queues");
                        }
                    }
                    ListenFrame::Ring(queue) => {
                        let bell = Doorbell {
                            source: self.ep.source.clone(),
                            method: relay_core::mcp::listen::UPDATED.to_string(),
                            params: json!({"uri": relay_core::mcp::listen::queue_uri(&queue)}),
                        };
                        if let Err(end) = ring(bell, doorbells, stop).await {
                            return end;
                        }
                    }
                    ListenFrame::Closed(Some(code))
                        if era_rules::modern_refused(200, Some(code)) =>
                    {
                        return StreamEnd::EraGone;
                    }
                    ListenFrame::Closed(code) => {
                        if let Some(code) = code {
                            tracing::warn!(source = %self.ep.source, code, "doorbell: the server refused subscriptions/listen");
                        }
                        return StreamEnd::Lost {
                            opened: acknowledged,
                        };
                    }
                    ListenFrame::Other => {}
                }
            }
        }
    }

    /// Opens the GET stream on `session` and forwards its notifications until it ends.
    async fn listen(
        &self,
        session: &ClientSession,
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
        let gone = |s| (s == 404 && session.id.is_some()).then_some(StreamEnd::SessionGone);
        let opening = self.ep.transport.get_stream(req);
        let mut resp = match self.open("the GET stream", opening, gone, stop).await {
            Ok(resp) => resp,
            Err(end) => return end,
        };
        let mut parser = SseParser::new();
        loop {
            let chunk = match self.chunk(&mut resp, "stream", true, stop).await {
                Ok(chunk) => chunk,
                Err(end) => return end,
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
                if let Err(end) = ring(bell, doorbells, stop).await {
                    return end;
                }
            }
        }
    }
}

/// Hands one ring to the daemon, unless stopped first or the daemon's end is closed.
async fn ring(
    bell: Doorbell,
    doorbells: &mpsc::Sender<Doorbell>,
    stop: &mut watch::Receiver<bool>,
) -> Result<(), StreamEnd> {
    tokio::select! {
        _ = stopped(stop) => Err(StreamEnd::Stopped),
        sent = doorbells.send(bell) => sent.map_err(|_| StreamEnd::Closed),
    }
}
