//! The attempt's process (`Command::Spawn`).

use std::path::{Path, PathBuf};
use std::process::Stdio;

use relay_core::relay::Input;
use relay_core::relay::summary::AGENT_SUMMARY_MAX_BYTES;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::ChildStdin;
use tokio::task::JoinHandle;

use super::files::{open_append, write_private};
use super::{AgentSpec, Spawned, Start, StartError, StartKind};

/// A running agent. Keep its process group ([`Spawned::group`]) to signal it, and hand the rest to a task with
/// [`Agent::deliver`] (or await [`Agent::wait`]).
#[derive(Debug)]
pub struct Agent {
    process: Spawned,
    stdin: Option<(ChildStdin, Vec<u8>)>,
    summary_file: PathBuf,
}

/// Starts the attempt's process for `Command::Spawn` and returns without waiting for it.
///
/// The process gets exactly `spec.env.merged(spec.daemon_env)` as its environment, `workdir` as
/// its working directory, a process group of its own, the prompt on stdin, and the run log as
/// stdout and stderr. A stale summary file is removed first, so that what is read after the exit
/// is the agent's own, and the usage file is created empty (mode 0600), so that the agent finds
/// it and no earlier attempt's figures are sent for this one. The error names the program, the path tried and the OS error, and turns
/// into `Input::SpawnFailed` with `.into()`.
pub fn spawn_agent(spec: AgentSpec) -> Result<Agent, StartError> {
    let run_id = spec.run_id;
    let env = spec.env.merged(spec.daemon_env);
    let mut start = Start::new(run_id, StartKind::Agent, &spec.argv, &spec.workdir, env)?;
    let fail = |message: String| start.fail(message);
    let log = open_append(&spec.run_log).map_err(|e| {
        fail(format!(
            "cannot open the run log {}: {e}: check that the jobs directory is writable",
            spec.run_log.display()
        ))
    })?;
    let log_err = log.try_clone().map_err(|e| {
        fail(format!(
            "cannot share the run log {} with stderr: {e}",
            spec.run_log.display()
        ))
    })?;
    let summary_file = PathBuf::from(&spec.summary_file);
    match std::fs::remove_file(&summary_file) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(fail(format!(
                "cannot remove the stale summary file {}: {e}",
                summary_file.display()
            )));
        }
    }

    write_private(Path::new(&spec.usage_file), b"", false).map_err(|e| {
        fail(format!(
            "cannot create the usage file {}: {e}: check that the jobs directory is writable",
            spec.usage_file
        ))
    })?;

    // The command goes with the spawn, and its copies of the log's descriptors with it.
    let mut cmd = start.command(&spec.argv);
    cmd.stdin(if spec.stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::from(log))
    .stderr(Stdio::from(log_err));
    let mut process = start.spawn(cmd)?;
    let stdin = match (process.child.stdin.take(), spec.stdin) {
        (Some(pipe), Some(bytes)) => Some((pipe, bytes)),
        _ => None,
    };
    let pid = process.pid();
    tracing::debug!(run_id, pid, program = %start.program.display(), "agent spawned");
    Ok(Agent {
        process,
        stdin,
        summary_file,
    })
}

impl Agent {
    /// The child and its process group (for the machine's `Signal` commands).
    pub fn process(&self) -> &Spawned {
        &self.process
    }

    /// Writes the prompt, waits for the process to exit, and reads the summary file:
    /// `Input::ProcessExited`. Dropping the future before then SIGKILLs the group.
    pub async fn wait(self) -> Input {
        let Agent {
            mut process,
            stdin,
            summary_file,
        } = self;
        let (run_id, pid) = (process.run_id(), process.pid());
        let write = async move {
            if let Some((mut pipe, bytes)) = stdin {
                // A process that exits or closes stdin early is its own business.
                if let Err(e) = pipe.write_all(&bytes).await {
                    tracing::debug!(run_id, error = %e, "agent stdin not fully written");
                }
            }
        };
        tokio::pin!(write);
        let waited = tokio::select! {
            status = process.child.wait() => status,
            () = &mut write => process.child.wait().await,
        };
        // The stdin pipe is closed here at the latest (the write future is dropped).
        let exit = process.exit(waited, "agent").await;
        process.reaped();
        tracing::debug!(run_id, pid, ?exit, "agent exited");
        let summary_file = read_summary(&summary_file).await;
        Input::ProcessExited {
            run_id,
            exit,
            summary_file,
        }
    }

    /// Starts the one task that waits for the process and hands `Input::ProcessExited` to
    /// `sink` (for example `move |i| { let _ = tx.send(i); }`). The task ends right after.
    pub fn deliver(self, sink: impl FnOnce(Input) + Send + 'static) -> JoinHandle<()> {
        tokio::spawn(async move { sink(self.wait().await) })
    }
}

/// At most [`AGENT_SUMMARY_MAX_BYTES`] of the summary file, when it is a regular file (a FIFO
/// planted there must not hang the daemon).
async fn read_summary(path: &std::path::Path) -> Option<Vec<u8>> {
    let meta = tokio::fs::metadata(path).await.ok()?;
    if !meta.is_file() {
        tracing::warn!(path = %path.display(), "the attempt summary file is not a regular file; ignored");
        return None;
    }
    let file = match tokio::fs::File::open(path).await {
        Ok(f) => f,
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot read the attempt summary file");
            return None;
        }
    };
    let mut bytes = Vec::new();
    let limit = u64::try_from(AGENT_SUMMARY_MAX_BYTES).unwrap_or(u64::MAX);
    if let Err(e) = file.take(limit).read_to_end(&mut bytes).await {
        tracing::warn!(path = %path.display(), error = %e, "cannot read the attempt summary file");
        return None;
    }
    Some(bytes)
}
