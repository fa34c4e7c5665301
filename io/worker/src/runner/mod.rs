//! The daemon's local side effects for a leased run: the processes and the files the relay
//! machine ([`relay_core::relay::Relay`]) asks for with its `Command`s.
//!
//! Nothing here decides anything. Each function does one command and turns its outcome into the
//! [`Input`] the machine expects back:
//!
//! | command | here | input(s) |
//! |---|---|---|
//! | `WriteContextFile` | [`write_context_file`] | none (an error is the driver's to handle) |
//! | `Spawn` | [`spawn_agent`], then [`Agent::deliver`] | `ProcessSpawned` is the driver's to send; `SpawnFailed` from [`StartError`]; `ProcessExited` |
//! | `Signal` | [`ProcessGroup::signal`] | `ProcessExited` arrives from the agent's task |
//! | `RunCheck` | [`run_check`], then [`Check::deliver`] | `CheckFailedToStart` from [`StartError`]; `CheckExited` |
//! | `KillCheck` | [`ProcessGroup::kill`] on the check's group | `CheckExited` arrives from the check's task |
//! | `WarnRunLog` | [`warn_run_log`] | none |
//! | `UploadReceipt` (its log section) | [`run_log_tail`] | none |
//!
//! # Processes
//!
//! The agent and the check each run in a process group of their own, led by the child, so a
//! signal to the group reaches everything they started (unless it left the group on purpose).
//! Their environment is exactly `ProcessEnv::merged(daemon_env)`: the environment is cleared
//! first, and `daemon_env` is an argument so that tests decide it. `argv[0]` is looked up in the
//! `PATH` of that environment (a name with a `/` is taken relative to the workdir).
//!
//! The agent's stdout and stderr are the run log itself, opened for appending, so the two streams
//! interleave exactly as the agent wrote them and no task of ours copies bytes. A check's output
//! goes through one pipe shared by its stdout and stderr, which a single task copies into the
//! run log under a delimiter line and into a [`CHECK_TAIL_BYTES`] tail.
//!
//! # Tasks
//!
//! [`spawn_agent`] and [`run_check`] start the child and return at once; they never wait for it.
//! The one task each needs is the one the caller starts with `deliver` (or the future `wait`
//! returns): it ends when the child has been reaped and its input delivered, so an attempt leaves
//! no task behind. Dropping an `Agent` or a `Check` (or its `wait` future) before the
//! child is reaped SIGKILLs the whole group.
//!
//! Every function must be called inside a tokio runtime.

// The real processes; a madsim build (the shell-sim sweep) has only the `Launcher` seam.
#[cfg(not(madsim))]
mod agent;
#[cfg(not(madsim))]
mod check;
mod files;
mod group;
mod launch;
mod spec;

#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};

#[cfg(not(madsim))]
pub use agent::{Agent, spawn_agent};
#[cfg(not(madsim))]
pub use check::{CHECK_TAIL_BYTES, Check, run_check};
pub use files::{
    TAIL_MAX_BYTES, read_usage_file, run_log_tail, warn_run_log, write_context_file,
    write_context_file_now,
};
pub(crate) use files::{create_dirs, write_private_atomic};
pub use group::{ProcessGroup, Spawned};
#[cfg(not(madsim))]
pub use launch::Processes;
pub use launch::{Control, Launched, Launcher};
pub use spec::{AgentSpec, CheckSpec};

use relay_core::relay::{ExitStatus, Input};

/// An error of a file or signal operation, naming what was being done and to which path.
#[derive(Debug, thiserror::Error)]
pub enum RunnerError {
    #[error(
        "{op} {path}: {source}; check that the directory exists and is writable by the daemon's user"
    )]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("signal {signal} to process group {pgid}: {source}")]
    Signal {
        signal: &'static str,
        pgid: i32,
        #[source]
        source: nix::Error,
    },
    #[error("{op} {path}: the blocking task did not finish: {source}")]
    Join {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: tokio::task::JoinError,
    },
}

/// Which child could not be started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StartKind {
    Agent,
    Check,
}

/// A child that could not be started: the message names the program, the path tried and the
/// OS error. It converts into the machine's `SpawnFailed` or `CheckFailedToStart`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct StartError {
    pub run_id: u64,
    pub kind: StartKind,
    pub message: String,
}

impl StartKind {
    /// How an error names the child before its `argv[0]` ("cannot start the success check `x`").
    fn named(self) -> &'static str {
        match self {
            StartKind::Agent => "",
            StartKind::Check => "the success check ",
        }
    }

    fn what(self) -> &'static str {
        match self {
            StartKind::Agent => "the agent",
            StartKind::Check => "the success check",
        }
    }
}

/// What starting an agent or a check begins with: the workdir checked and `argv[0]` resolved
/// in the child's own environment. Its errors name the child the same way for both.
pub(crate) struct Start {
    pub run_id: u64,
    pub kind: StartKind,
    pub argv0: String,
    pub workdir: PathBuf,
    pub env: Vec<(String, String)>,
    pub program: PathBuf,
}

impl Start {
    pub fn new(
        run_id: u64,
        kind: StartKind,
        argv: &[String],
        workdir: &str,
        env: Vec<(String, String)>,
    ) -> Result<Start, StartError> {
        let argv0 = argv.first().cloned().unwrap_or_default();
        let workdir = PathBuf::from(workdir);
        let fail = |message| StartError {
            run_id,
            kind,
            message,
        };
        let named = kind.named();
        check_workdir(&workdir).map_err(|e| fail(format!("cannot start {named}`{argv0}`: {e}")))?;
        let program = resolve_program(&argv0, &workdir, &env)
            .map_err(|e| fail(format!("cannot start {}: {e}", kind.what())))?;
        Ok(Start {
            run_id,
            kind,
            argv0,
            workdir,
            env,
            program,
        })
    }

    pub fn fail(&self, message: String) -> StartError {
        StartError {
            run_id: self.run_id,
            kind: self.kind,
            message,
        }
    }

    /// The command to start (see [`child_command`]); the caller sets its stdio.
    pub fn command(&mut self, argv: &[String]) -> tokio::process::Command {
        child_command(
            &self.program,
            argv,
            std::mem::take(&mut self.env),
            &self.workdir,
        )
    }

    /// Spawns `cmd`, the leader of a process group of its own.
    pub fn spawn(&self, mut cmd: tokio::process::Command) -> Result<Spawned, StartError> {
        let (named, argv0) = (self.kind.named(), &self.argv0);
        let child = cmd.spawn().map_err(|e| {
            self.fail(format!(
                "cannot start {named}`{argv0}` ({}) in {}: {e}",
                self.program.display(),
                self.workdir.display()
            ))
        })?;
        let Some(pid) = child.id() else {
            return Err(self.fail(format!("{named}`{argv0}` exited before its pid was known")));
        };
        Ok(Spawned::new(self.run_id, pid, child))
    }
}

impl From<StartError> for Input {
    fn from(e: StartError) -> Input {
        match e.kind {
            StartKind::Agent => Input::SpawnFailed {
                run_id: e.run_id,
                error: e.message,
            },
            StartKind::Check => Input::CheckFailedToStart {
                run_id: e.run_id,
                error: e.message,
            },
        }
    }
}

/// The daemon's own environment, as `daemon_env` for [`AgentSpec`] and [`CheckSpec`]. Variables
/// whose name or value is not UTF-8 are left out.
pub fn daemon_env() -> Vec<(String, String)> {
    std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .collect()
}

/// How a reaped child ended, as the machine counts it.
pub(crate) fn exit_status(status: std::process::ExitStatus) -> ExitStatus {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => ExitStatus::Code(code),
        (None, Some(sig)) => ExitStatus::Signal(sig),
        // Neither: only for a stopped or continued status, which `wait` never returns.
        (None, None) => ExitStatus::Code(-1),
    }
}

/// The child's program: `argv[0]` looked up in the `PATH` of the child's own environment, or,
/// when it holds a `/`, taken as a path (relative ones against the workdir).
pub(crate) fn resolve_program(
    argv0: &str,
    workdir: &Path,
    env: &[(String, String)],
) -> Result<PathBuf, String> {
    use std::os::unix::fs::PermissionsExt;
    if argv0.is_empty() {
        return Err("argv is empty: set the command to run in the harness config".into());
    }
    if argv0.contains('/') {
        return Ok(workdir.join(argv0));
    }
    let Some((_, path_var)) = env.iter().find(|(k, _)| k == "PATH") else {
        return Err(format!(
            "`{argv0}` is not a path and PATH is not set in the process's environment: \
             give an absolute path or set PATH"
        ));
    };
    for dir in path_var.split(':') {
        let dir = if dir.is_empty() { "." } else { dir };
        let candidate = workdir.join(dir).join(argv0);
        let executable = std::fs::metadata(&candidate)
            .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            .unwrap_or(false);
        if executable {
            return Ok(candidate);
        }
    }
    Err(format!(
        "`{argv0}` was not found as an executable file in PATH ({path_var}): \
         install it, or give its absolute path"
    ))
}

/// The command both an agent and a check start with: `argv[0]` as written, exactly `env` (nothing
/// inherited), the workdir, a process group of its own (so a signal reaches its children too), and
/// killed if its handle is dropped. The caller sets stdin, stdout and stderr.
pub(crate) fn child_command(
    program: &Path,
    argv: &[String],
    env: Vec<(String, String)>,
    workdir: &Path,
) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(program);
    cmd.arg0(argv.first().map(String::as_str).unwrap_or_default())
        .args(argv.iter().skip(1))
        .env_clear()
        .envs(env)
        .current_dir(workdir)
        .process_group(0)
        .kill_on_drop(true);
    cmd
}

/// Checks the workdir before a spawn, so that a missing one is named as such (the OS reports
/// it as a missing program).
pub(crate) fn check_workdir(workdir: &Path) -> Result<(), String> {
    match std::fs::metadata(workdir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(format!("workdir {} is not a directory", workdir.display())),
        Err(e) => Err(format!(
            "workdir {}: {e}: create it or fix the harness's workdir",
            workdir.display()
        )),
    }
}
