//! What starting an agent or a check needs: the machine's command plus the driver's part. Both
//! the real processes ([`super::Processes`]) and a simulated [`super::Launcher`] take these.

use std::path::PathBuf;

use relay_core::relay::{Command, ProcessEnv};

/// Everything starting an agent needs: the machine's `Spawn` command plus the driver's part, the
/// daemon's environment and the run log's path.
#[derive(Clone, Debug)]
pub struct AgentSpec {
    pub run_id: u64,
    pub argv: Vec<String>,
    /// Written to the process's stdin, which is then closed; `None` gives it `/dev/null`.
    pub stdin: Option<Vec<u8>>,
    pub workdir: String,
    pub env: ProcessEnv,
    /// The environment `env` is layered over (see [`super::daemon_env`]).
    pub daemon_env: Vec<(String, String)>,
    /// Read (at most 16 KiB) when the process has exited; removed before the spawn.
    pub summary_file: String,
    /// `HARNESS_USAGE_FILE`: created empty (mode 0600) before the spawn, replacing any stale
    /// one; the daemon reads it before each heartbeat and report.
    pub usage_file: String,
    /// Receives the process's stdout and stderr; appended to, created with mode 0600.
    pub run_log: PathBuf,
}

impl AgentSpec {
    /// The spec for a `Command::Spawn`; any other command gives `None`.
    pub fn from_command(
        command: Command,
        daemon_env: Vec<(String, String)>,
        run_log: PathBuf,
    ) -> Option<AgentSpec> {
        match command {
            Command::Spawn {
                run_id,
                argv,
                stdin,
                workdir,
                env,
                summary_file,
                usage_file,
                ..
            } => Some(AgentSpec {
                run_id,
                argv,
                stdin,
                workdir,
                env,
                daemon_env,
                summary_file,
                usage_file,
                run_log,
            }),
            _ => None,
        }
    }
}

/// Everything starting a success check needs: the machine's `RunCheck` plus the driver's part.
#[derive(Clone, Debug)]
pub struct CheckSpec {
    pub run_id: u64,
    pub argv: Vec<String>,
    pub workdir: String,
    pub env: ProcessEnv,
    /// The environment `env` is layered over (see [`super::daemon_env`]).
    pub daemon_env: Vec<(String, String)>,
    /// The run log the check's output is appended to.
    pub run_log: PathBuf,
}

impl CheckSpec {
    /// The spec for a `Command::RunCheck`; any other command gives `None`.
    pub fn from_command(
        command: Command,
        daemon_env: Vec<(String, String)>,
        run_log: PathBuf,
    ) -> Option<CheckSpec> {
        match command {
            Command::RunCheck {
                run_id,
                argv,
                workdir,
                env,
            } => Some(CheckSpec {
                run_id,
                argv,
                workdir,
                env,
                daemon_env,
                run_log,
            }),
            _ => None,
        }
    }
}
