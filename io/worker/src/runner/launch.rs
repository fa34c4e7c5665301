//! The seam between the daemon and the processes of an attempt.
//!
//! The daemon starts agents and checks only through a [`Launcher`], and signals them only
//! through the [`ProcessControl`] it hands back, so that a build which cannot host real children
//! (a deterministic simulator replaces tokio's runtime there) can put a model of them in their
//! place. [`Processes`] is the real one: [`spawn_agent`] and [`run_check`], unchanged.

use std::sync::Arc;

use futures_util::future::BoxFuture;
use relay_core::relay::{Input, Signal};
use tokio::task::JoinHandle;

use super::{
    Agent, AgentSpec, Check, CheckSpec, ProcessGroup, RunnerError, StartError, run_check,
    spawn_agent,
};

/// Starts the processes of an attempt: real children in production, a model in simulation.
///
/// Both calls return as soon as the process exists and never wait for it; what it ends with
/// comes from [`Launched::wait`]. An error is the child that could not be started, and turns
/// into the machine's `SpawnFailed` or `CheckFailedToStart`.
pub trait Launcher: Send + Sync + 'static {
    /// `Command::Spawn`. The daemon calls it on a blocking thread (a fork and exec may hang on
    /// a stuck filesystem), so it may block.
    fn agent(&self, spec: AgentSpec) -> Result<Launched, StartError>;
    /// `Command::RunCheck`, called on the daemon's actor.
    fn check(&self, spec: CheckSpec) -> Result<Launched, StartError>;
}

/// Signals a started agent or check: the machine's `Signal` and `KillCheck` commands.
///
/// Named for the process, not `Control`, so that it is not mistaken for the daemon's control
/// socket. Signals after the process ended are no error (see [`ProcessGroup::signal`]).
pub trait ProcessControl: Send + Sync + 'static {
    /// SIGTERM or SIGKILL to the process and everything it started.
    fn signal(&self, signal: Signal) -> Result<(), RunnerError>;
    /// `KillCheck`: SIGKILL.
    fn kill(&self) -> Result<(), RunnerError> {
        self.signal(Signal::Kill)
    }
}

impl ProcessControl for ProcessGroup {
    fn signal(&self, signal: Signal) -> Result<(), RunnerError> {
        ProcessGroup::signal(self, signal)
    }
    fn kill(&self) -> Result<(), RunnerError> {
        ProcessGroup::kill(self)
    }
}

/// A started agent or check: a handle to signal it, and its end.
///
/// `wait` owns the process: dropping it (or this, before it was awaited) before the process
/// ended kills the process, so a run that closed before its process came, or whose task was
/// aborted, leaves nothing running.
pub struct Launched {
    pub control: Arc<dyn ProcessControl>,
    /// Resolves with `Input::ProcessExited` (an agent) or `Input::CheckExited` (a check).
    pub wait: BoxFuture<'static, Input>,
}

impl std::fmt::Debug for Launched {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Launched").finish_non_exhaustive()
    }
}

impl Launched {
    /// Starts the one task that awaits the end and hands its input to `sink`; the task ends
    /// right after. Keep a clone of `control` first to signal the process meanwhile.
    pub fn deliver(self, sink: impl FnOnce(Input) + Send + 'static) -> JoinHandle<()> {
        let wait = self.wait;
        tokio::spawn(async move { sink(wait.await) })
    }
}

impl From<Agent> for Launched {
    fn from(agent: Agent) -> Launched {
        Launched {
            control: Arc::new(agent.group()),
            wait: Box::pin(agent.wait()),
        }
    }
}

impl From<Check> for Launched {
    fn from(check: Check) -> Launched {
        Launched {
            control: Arc::new(check.group()),
            wait: Box::pin(check.wait()),
        }
    }
}

/// The production [`Launcher`]: real children in process groups of their own, as
/// [`spawn_agent`] and [`run_check`] start them.
#[derive(Clone, Copy, Debug, Default)]
pub struct Processes;

impl Launcher for Processes {
    fn agent(&self, spec: AgentSpec) -> Result<Launched, StartError> {
        spawn_agent(spec).map(Launched::from)
    }
    fn check(&self, spec: CheckSpec) -> Result<Launched, StartError> {
        run_check(spec).map(Launched::from)
    }
}
