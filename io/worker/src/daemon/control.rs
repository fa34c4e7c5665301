//! The control socket: how `relay trigger`, `describe`, `doctor`, `reload`, `stop` and `events`
//! talk to a running daemon. A Unix socket at `<state>/control.sock` (mode 0600, so only the
//! daemon's user may fire its harnesses); one JSON request line in, one JSON answer line out —
//! except `events`, answered with one JSON line per event (the recent ones, then, with `follow`,
//! each new one as it happens).
//!
//! Requests: `{"op":"trigger","harness":H}`, `{"op":"describe","harness":H?}`, `{"op":"doctor"}`,
//! `{"op":"reload"}`, `{"op":"stop","harness":H}`, `{"op":"events","follow":B?}`. Answers carry
//! `"ok": true` or `"ok": false, "error": "…"`; an event line has an `event` field instead, and a
//! follower that falls [`super::events::FOLLOW_BUFFER`] events behind (or stops reading for
//! [`FOLLOW_WRITE_TIMEOUT`]) gets an `"ok": false` line saying so and is disconnected: it never
//! holds the daemon up. Nothing secret crosses the socket: describe shows header names, never
//! values, and no token; events carry names, numbers and codes only.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::task::AbortHandle;
#[cfg(not(madsim))]
use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader},
    net::unix::OwnedWriteHalf,
    net::{UnixListener, UnixStream},
    sync::{broadcast, oneshot},
};

use super::{DaemonHandle, Msg};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    Trigger {
        harness: String,
    },
    Describe {
        #[serde(default)]
        harness: Option<String>,
    },
    Doctor,
    Reload,
    Stop {
        harness: String,
    },
    Events {
        #[serde(default)]
        follow: bool,
    },
}

/// A follower that has not taken a line for this long is disconnected.
pub const FOLLOW_WRITE_TIMEOUT: Duration = Duration::from_secs(10);

pub fn socket_path(state_dir: &Path) -> PathBuf {
    state_dir.join("control.sock")
}

pub(crate) fn error(message: String) -> Value {
    json!({"ok": false, "error": message})
}

/// Removes the socket file of a stopped daemon.
pub(crate) fn remove(state_dir: &Path) {
    let _ = std::fs::remove_file(socket_path(state_dir));
}

/// Binds the socket (replacing a stale one: the journal lock already proved no other daemon
/// owns this state dir) and answers requests until aborted.
#[cfg(not(madsim))]
pub(crate) fn serve(state_dir: &Path, daemon: DaemonHandle) -> std::io::Result<AbortHandle> {
    let path = socket_path(state_dir);
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path)?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
    }
    let task = tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let daemon = daemon.clone();
            tokio::spawn(async move {
                let _ = answer(stream, daemon).await;
            });
        }
    });
    Ok(task.abort_handle())
}

#[cfg(not(madsim))]
async fn answer(stream: UnixStream, daemon: DaemonHandle) -> std::io::Result<()> {
    let (read, mut write) = stream.into_split();
    let mut line = String::new();
    // A request is one short line; refuse anything longer than 64 KiB.
    let mut reader = BufReader::new(read.take(64 * 1024));
    reader.read_line(&mut line).await?;
    let reply = match serde_json::from_str::<Request>(line.trim()) {
        Err(e) => error(format!(
            "bad control request: {e}; send one JSON line such as {{\"op\":\"doctor\"}}"
        )),
        Ok(Request::Events { follow }) => return stream_events(write, daemon, follow).await,
        Ok(request) => {
            let (tx, rx) = oneshot::channel();
            if daemon.send(Msg::Control { request, reply: tx }) {
                rx.await
                    .unwrap_or_else(|_| error("the daemon is stopping".into()))
            } else {
                error("the daemon is stopping".into())
            }
        }
    };
    let mut bytes = serde_json::to_vec(&reply).unwrap_or_default();
    bytes.push(b'\n');
    write.write_all(&bytes).await?;
    write.shutdown().await
}

#[cfg(not(madsim))]
async fn write_line(write: &mut OwnedWriteHalf, line: &str) -> std::io::Result<()> {
    let mut bytes = line.as_bytes().to_vec();
    bytes.push(b'\n');
    match tokio::time::timeout(FOLLOW_WRITE_TIMEOUT, write.write_all(&bytes)).await {
        Ok(r) => r,
        Err(_) => Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "the reader took no line",
        )),
    }
}

/// `events`: the recent events, then (with `follow`) each new one, until the daemon stops, the
/// reader goes away or falls behind.
#[cfg(not(madsim))]
async fn stream_events(
    mut write: OwnedWriteHalf,
    daemon: DaemonHandle,
    follow: bool,
) -> std::io::Result<()> {
    let (tx, rx) = oneshot::channel();
    let feed = if daemon.send(Msg::Events { follow, reply: tx }) {
        rx.await.ok()
    } else {
        None
    };
    let Some((recent, receiver)) = feed else {
        write_line(
            &mut write,
            &error("the daemon is stopping".into()).to_string(),
        )
        .await?;
        return write.shutdown().await;
    };
    for line in &recent {
        write_line(&mut write, line).await?;
    }
    if let Some(mut receiver) = receiver {
        loop {
            match receiver.recv().await {
                Ok(line) => {
                    if let Err(e) = write_line(&mut write, &line).await {
                        tracing::info!(error = %e, "an events follower was disconnected: it stopped reading");
                        return Err(e);
                    }
                }
                Err(broadcast::error::RecvError::Lagged(missed)) => {
                    tracing::info!(
                        missed,
                        "an events follower fell behind and was disconnected"
                    );
                    let line = error(format!(
                        "this follower fell {missed} events behind and was disconnected; run \
                         `relay events --follow` again (`relay events` shows the recent ones)"
                    ));
                    write_line(&mut write, &line.to_string()).await?;
                    break;
                }
                Err(broadcast::error::RecvError::Closed) => break,
            }
        }
    }
    write.shutdown().await
}

/// Why a request got no answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestError {
    /// Nothing listens on the socket: no daemon runs for this state dir.
    NoDaemon(String),
    /// The daemon refused the request, or the conversation failed.
    Failed(String),
}

impl std::fmt::Display for RequestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RequestError::NoDaemon(m) | RequestError::Failed(m) => f.write_str(m),
        }
    }
}

#[cfg(not(madsim))]
async fn connect(state_dir: &Path) -> Result<UnixStream, RequestError> {
    let path = socket_path(state_dir);
    UnixStream::connect(&path).await.map_err(|e| {
        RequestError::NoDaemon(format!(
            "no daemon answers at {} ({e}): start one with `relay daemon --config FILE --state-dir {}`",
            path.display(),
            state_dir.display()
        ))
    })
}

/// `relay events`: sends the request and hands each event line (as the daemon wrote it) to
/// `on_event` until the daemon ends the stream. A line saying `"ok": false` (the daemon is
/// stopping, the follower fell behind) is the error.
#[cfg(not(madsim))]
pub async fn events(
    state_dir: &Path,
    follow: bool,
    mut on_event: impl FnMut(&str),
) -> Result<(), RequestError> {
    let stream = connect(state_dir).await?;
    let (read, mut write) = stream.into_split();
    let failed = |e: std::io::Error| RequestError::Failed(format!("control socket: {e}"));
    let mut bytes = serde_json::to_vec(&Request::Events { follow }).unwrap_or_default();
    bytes.push(b'\n');
    write.write_all(&bytes).await.map_err(failed)?;
    let mut lines = BufReader::new(read).lines();
    while let Some(line) = lines.next_line().await.map_err(failed)? {
        let value: Value = serde_json::from_str(&line).map_err(|e| {
            RequestError::Failed(format!("the daemon answered something unreadable ({e})"))
        })?;
        if value.get("ok") == Some(&Value::Bool(false)) {
            let msg = value
                .get("error")
                .and_then(Value::as_str)
                .unwrap_or("the daemon ended the stream");
            return Err(RequestError::Failed(msg.to_string()));
        }
        on_event(&line);
    }
    Ok(())
}

/// Sends one request to the daemon of `state_dir` and returns its answer. The error says how
/// to start a daemon when none listens.
#[cfg(not(madsim))]
pub async fn request(
    state_dir: &Path,
    request: &Request,
    timeout: Duration,
) -> Result<Value, RequestError> {
    let path = socket_path(state_dir);
    let talk = async {
        let stream = connect(state_dir).await?;
        let failed = RequestError::Failed;
        let (read, mut write) = stream.into_split();
        let mut bytes = serde_json::to_vec(request).map_err(|e| failed(e.to_string()))?;
        bytes.push(b'\n');
        write
            .write_all(&bytes)
            .await
            .map_err(|e| failed(format!("control socket write failed: {e}")))?;
        let mut line = String::new();
        BufReader::new(read)
            .read_line(&mut line)
            .await
            .map_err(|e| failed(format!("control socket read failed: {e}")))?;
        serde_json::from_str::<Value>(&line)
            .map_err(|e| failed(format!("the daemon answered something unreadable ({e})")))
    };
    let answer = tokio::time::timeout(timeout, talk).await.map_err(|_| {
        RequestError::Failed(format!(
            "the daemon at {} did not answer in time",
            path.display()
        ))
    })??;
    if answer.get("ok") == Some(&Value::Bool(false)) {
        let msg = answer
            .get("error")
            .and_then(Value::as_str)
            .unwrap_or("the daemon refused the request");
        return Err(RequestError::Failed(msg.to_string()));
    }
    Ok(answer)
}

/// A madsim build has no control socket (madsim's Unix streams cannot be split into halves):
/// the shell-sim sweep drives its daemons through their [`DaemonHandle`]s.
#[cfg(madsim)]
pub(crate) fn serve(_: &Path, _: DaemonHandle) -> std::io::Result<AbortHandle> {
    Ok(tokio::spawn(async {}).abort_handle())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::events::{EventLog, FOLLOW_BUFFER};
    use relay_core::relay::Event;
    use relay_core::time::Wall;
    use tokio::sync::mpsc;

    fn event(run_id: u64) -> Event {
        Event::RunStarted {
            harness: "w1".into(),
            run_id,
            trigger: "manual".into(),
        }
    }

    /// A follower that does not keep up never holds the actor: every push goes through while
    /// the follower reads nothing, and once it reads again its stream ends with a line saying
    /// how far behind it fell.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_follower_that_falls_behind_is_disconnected_saying_so() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (tx, mut rx) = mpsc::unbounded_channel();
        let server = serve(dir.path(), DaemonHandle { tx }).expect("serve");
        let mut stream = UnixStream::connect(socket_path(dir.path()))
            .await
            .expect("connect");
        stream
            .write_all(b"{\"op\":\"events\",\"follow\":true}\n")
            .await
            .expect("request");
        let mut log = EventLog::default();
        log.push(&event(0), Wall::default());
        match rx.recv().await {
            Some(Msg::Events {
                follow: true,
                reply,
            }) => {
                let _ = reply.send(log.feed(true));
            }
            other => panic!("expected an events request, got {other:?}"),
        }
        // The actor's side: far more than the follower may fall behind by, without waiting.
        let total = FOLLOW_BUFFER as u64 * 20;
        for n in 1..=total {
            log.push(&event(n), Wall::default());
        }
        let mut lines = BufReader::new(stream).lines();
        let mut received = Vec::new();
        while let Some(line) = lines.next_line().await.expect("read") {
            received.push(serde_json::from_str::<Value>(&line).expect("json"));
        }
        let last = received.pop().expect("a last line");
        assert_eq!(last["ok"], false, "{last}");
        let message = last["error"].as_str().unwrap_or_default();
        assert!(
            message.contains("events behind and was disconnected"),
            "{message}"
        );
        assert_eq!(received[0]["run_id"], 0, "the recent events come first");
        assert!((received.len() as u64) < total, "nothing was dropped");
        server.abort();
    }
}
