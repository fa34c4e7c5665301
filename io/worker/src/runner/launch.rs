//! The seam between the daemon and its processes: [`Launcher`] starts an attempt's agent and
//! its success checks, [`Processes`] with real children in production, a model of them in the
//! shell-sim sweep (madsim cannot host a child process). The daemon goes through it only.

use std::sync::Arc;

use relay_core::relay::{Input, Signal};
use tokio::task::JoinHandle;

use super::{AgentSpec, CheckSpec, RunnerError, StartError};
use crate::lease::BoxFuture;

/// Starts the processes of an attempt. Each returns at once; the process runs on its own.
pub trait Launcher: Send + Sync + 'static {
    /// `Command::Spawn`.
    fn agent(&self, spec: AgentSpec) -> Result<Launched, StartError>;
    /// `Command::RunCheck`.
    fn check(&self, spec: CheckSpec) -> Result<Launched, StartError>;
}

/// Reaches a started process (its whole group, for a real one).
pub trait Control: Send + Sync {
    /// The machine's `Signal` (SIGTERM or SIGKILL). A process already gone is not an error.
    fn signal(&self, signal: Signal) -> Result<(), RunnerError>;
    /// `KillCheck`: SIGKILL.
    fn kill(&self) -> Result<(), RunnerError> {
        self.signal(Signal::Kill)
    }
}

/// A started agent or check: the handle that signals it, and its end. `wait` resolves with
/// `Input::ProcessExited` or `Input::CheckExited`; dropping it before then kills the process.
pub struct Launched {
    pub control: Arc<dyn Control>,
    pub wait: BoxFuture<'static, Input>,
}

impl std::fmt::Debug for Launched {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Launched").finish_non_exhaustive()
    }
}

impl Launched {
    /// Starts the one task that waits for the process and hands its exit to `sink`.
    pub fn deliver(self, sink: impl FnOnce(Input) + Send + 'static) -> JoinHandle<()> {
        let wait = self.wait;
        tokio::spawn(async move { sink(wait.await) })
    }
}

/// Real child processes: [`super::spawn_agent`] and [`super::run_check`].
#[cfg(not(madsim))]
#[derive(Clone, Copy, Debug, Default)]
pub struct Processes;

#[cfg(not(madsim))]
impl Launcher for Processes {
    fn agent(&self, spec: AgentSpec) -> Result<Launched, StartError> {
        let agent = super::spawn_agent(spec)?;
        Ok(Launched {
            control: Arc::new(agent.process().group()),
            wait: Box::pin(agent.wait()),
        })
    }

    fn check(&self, spec: CheckSpec) -> Result<Launched, StartError> {
        let check = super::run_check(spec)?;
        Ok(Launched {
            control: Arc::new(check.process().group()),
            wait: Box::pin(check.wait()),
        })
    }
}

impl Control for super::ProcessGroup {
    fn signal(&self, signal: Signal) -> Result<(), RunnerError> {
        super::ProcessGroup::signal(self, signal)
    }
}
