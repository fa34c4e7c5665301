//! The operator's success check (`Command::RunCheck`): a plain child, no terminal.

use std::path::PathBuf;
use std::time::Duration;

use relay_core::relay::{ExitStatus, Input};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::pipe;
use tokio::task::JoinHandle;

use super::files::{FILE_MODE, create_parent};
use super::{CheckSpec, Spawned, Start, StartError, StartKind};

/// How much of a check's latest output is kept for the summary.
pub const CHECK_TAIL_BYTES: usize = 4 * 1024;

/// How long output is still read after the check exited and what was left of its group was
/// killed; only a descendant that left the group can keep the pipe open that long.
const DRAIN_AFTER_EXIT: Duration = Duration::from_secs(2);

/// A running check. Keep its process group ([`Spawned::group`]) for `KillCheck`, and hand the
/// rest to a task with [`Check::deliver`] (or await [`Check::wait`]).
#[derive(Debug)]
pub struct Check {
    process: Spawned,
    name: String,
    output: pipe::Receiver,
    run_log: PathBuf,
}

/// Starts the success check for `Command::RunCheck` and returns without waiting for it: stdin
/// is `/dev/null`, stdout and stderr share one pipe, and the environment is exactly
/// `spec.env.merged(spec.daemon_env)`. The error turns into `Input::CheckFailedToStart`.
pub fn run_check(spec: CheckSpec) -> Result<Check, StartError> {
    let run_id = spec.run_id;
    let env = spec.env.merged(spec.daemon_env);
    let mut start = Start::new(run_id, StartKind::Check, &spec.argv, &spec.workdir, env)?;
    let (sender, output) = pipe::pipe()
        .map_err(|e| start.fail(format!("cannot create a pipe for the success check: {e}")))?;
    // Our copies of the pipe's write end go with the spawn: the read end sees EOF once the
    // check's processes have closed theirs.
    let out = sender
        .into_blocking_fd()
        .map_err(|e| start.fail(format!("cannot set up the success check's output: {e}")))?;
    let err = out
        .try_clone()
        .map_err(|e| start.fail(format!("cannot set up the success check's output: {e}")))?;
    let mut cmd = start.command(&spec.argv);
    cmd.stdin(std::process::Stdio::null())
        .stdout(out)
        .stderr(err);
    let process = start.spawn(cmd)?;
    let pid = process.pid();
    tracing::debug!(run_id, pid, program = %start.program.display(), "success check started");
    Ok(Check {
        process,
        name: start.argv0,
        output,
        run_log: spec.run_log,
    })
}

/// The run log's delimiter line for a check.
pub(crate) fn delimiter(name: &str, run_id: u64) -> String {
    format!("--- success check: {name} (run {run_id}) ---\n")
}

/// Where the check's output goes: the run log (when it can be opened) and the tail.
struct Sink {
    log: Option<tokio::fs::File>,
    run_log: PathBuf,
    tail: Vec<u8>,
}

impl Sink {
    async fn open(run_log: PathBuf) -> Sink {
        let opened = async {
            let parent_log = run_log.clone();
            tokio::task::spawn_blocking(move || create_parent(&parent_log))
                .await
                .map_err(std::io::Error::other)??;
            tokio::fs::OpenOptions::new()
                .append(true)
                .create(true)
                .mode(FILE_MODE)
                .open(&run_log)
                .await
        }
        .await;
        let log = match opened {
            Ok(f) => Some(f),
            Err(e) => {
                tracing::warn!(path = %run_log.display(), error = %e, "cannot open the run log for the success check's output");
                None
            }
        };
        Sink {
            log,
            run_log,
            tail: Vec::new(),
        }
    }

    async fn log(&mut self, bytes: &[u8]) {
        if let Some(f) = &mut self.log
            && let Err(e) = f.write_all(bytes).await
        {
            tracing::warn!(path = %self.run_log.display(), error = %e, "cannot append the success check's output to the run log");
            self.log = None;
        }
    }

    async fn output(&mut self, bytes: &[u8]) {
        self.log(bytes).await;
        self.tail.extend_from_slice(bytes);
        if self.tail.len() > CHECK_TAIL_BYTES {
            let excess = self.tail.len() - CHECK_TAIL_BYTES;
            self.tail.drain(..excess);
        }
    }

    async fn close(mut self) -> Vec<u8> {
        if let Some(f) = &mut self.log
            && let Err(e) = f.flush().await
        {
            tracing::warn!(path = %self.run_log.display(), error = %e, "cannot flush the run log");
        }
        self.tail
    }
}

impl Check {
    /// The child and its process group (for `KillCheck`, [`ProcessGroup::kill`](super::ProcessGroup::kill)).
    pub fn process(&self) -> &Spawned {
        &self.process
    }

    /// Copies the output into the run log under the delimiter line and into the tail, waits
    /// for the check to exit, kills whatever it left running in its group, and yields
    /// `Input::CheckExited`. Dropping the future before then SIGKILLs the group.
    pub async fn wait(self) -> Input {
        let Check {
            mut process,
            name,
            mut output,
            run_log,
        } = self;
        let (run_id, pid, group) = (process.run_id(), process.pid(), process.group());
        let mut sink = Sink::open(run_log).await;
        sink.log(delimiter(&name, run_id).as_bytes()).await;
        let mut buf = vec![0u8; 8 * 1024];
        let mut open = true;
        let waited = loop {
            tokio::select! {
                status = process.child.wait() => break status,
                read = output.read(&mut buf), if open => match read {
                    Ok(0) => open = false,
                    Ok(n) => sink.output(&buf[..n]).await,
                    Err(e) => {
                        tracing::warn!(run_id, error = %e, "reading the success check's output failed");
                        open = false;
                    }
                },
            }
        };
        let exit = process.exit(waited, "success check").await;
        // What the check left behind in its group would hold the pipe open: it goes too.
        if let Err(e) = group.raw_signal(nix::sys::signal::Signal::SIGKILL) {
            tracing::warn!(run_id, pgid = group.pgid(), error = %e, "cannot kill what the success check left running");
        }
        process.reaped();
        if open {
            let drain = async {
                loop {
                    match output.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => sink.output(&buf[..n]).await,
                    }
                }
            };
            if tokio::time::timeout(DRAIN_AFTER_EXIT, drain).await.is_err() {
                tracing::warn!(
                    run_id,
                    "a process the success check started still holds its output open; stopped reading"
                );
            }
        }
        let code = match exit {
            ExitStatus::Code(c) => format!("exit {c}"),
            ExitStatus::Signal(s) => format!("killed by signal {s}"),
        };
        sink.log(format!("--- success check: {code} ---\n").as_bytes())
            .await;
        let output_tail = sink.close().await;
        tracing::debug!(run_id, pid, ?exit, "success check exited");
        Input::CheckExited {
            run_id,
            exit,
            output_tail,
        }
    }

    /// Starts the one task that copies the output, waits for the check and hands
    /// `Input::CheckExited` to `sink`. The task ends right after.
    pub fn deliver(self, sink: impl FnOnce(Input) + Send + 'static) -> JoinHandle<()> {
        tokio::spawn(async move { sink(self.wait().await) })
    }
}
