//! The control socket: how `relay trigger`, `relay describe` and `relay doctor` talk to a
//! running daemon. A Unix socket at `<state>/control.sock` (mode 0600, so only the daemon's
//! user may fire its harnesses); one JSON request line in, one JSON answer line out.
//!
//! Requests: `{"op":"trigger","harness":H}`, `{"op":"describe","harness":H?}`, `{"op":"doctor"}`.
//! Answers carry `"ok": true` or `"ok": false, "error": "…"`. Nothing secret crosses it: describe
//! shows header names, never values, and no token.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::oneshot;
use tokio::task::AbortHandle;

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
}

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

/// Sends one request to the daemon of `state_dir` and returns its answer. The error says how
/// to start a daemon when none listens.
pub async fn request(
    state_dir: &Path,
    request: &Request,
    timeout: Duration,
) -> Result<Value, String> {
    let path = socket_path(state_dir);
    let talk = async {
        let stream = UnixStream::connect(&path).await.map_err(|e| {
            format!(
                "no daemon answers at {} ({e}): start one with `relay daemon --config FILE --state-dir {}`",
                path.display(),
                state_dir.display()
            )
        })?;
        let (read, mut write) = stream.into_split();
        let mut bytes = serde_json::to_vec(request).map_err(|e| e.to_string())?;
        bytes.push(b'\n');
        write
            .write_all(&bytes)
            .await
            .map_err(|e| format!("control socket write failed: {e}"))?;
        let mut line = String::new();
        BufReader::new(read)
            .read_line(&mut line)
            .await
            .map_err(|e| format!("control socket read failed: {e}"))?;
        serde_json::from_str::<Value>(&line)
            .map_err(|e| format!("the daemon answered something unreadable ({e})"))
    };
    let answer = tokio::time::timeout(timeout, talk)
        .await
        .map_err(|_| format!("the daemon at {} did not answer in time", path.display()))??;
    if answer.get("ok") == Some(&Value::Bool(false)) {
        let msg = answer
            .get("error")
            .and_then(Value::as_str)
            .unwrap_or("the daemon refused the request");
        return Err(msg.to_string());
    }
    Ok(answer)
}
