//! A started child and the process group it leads: signals to the group, the guard that kills
//! it when dropped unreaped, and the reaping the agent and the check share.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use nix::errno::Errno;
use nix::sys::signal::{Signal as NixSignal, killpg};
use nix::unistd::Pid;
use relay_core::relay::{ExitStatus, Signal};
use tokio::process::Child;

use super::{RunnerError, exit_status};

/// The process group a spawned agent or check leads. Cheap to clone; the driver keeps one per
/// run to carry out the machine's `Signal` and `KillCheck` commands.
///
/// Once the child has been reaped the group is not signalled any more: its id may be reused by
/// an unrelated process group.
#[derive(Clone, Debug)]
pub struct ProcessGroup {
    pgid: i32,
    reaped: Arc<AtomicBool>,
}

impl ProcessGroup {
    pub(crate) fn new(pgid: i32) -> ProcessGroup {
        ProcessGroup {
            pgid,
            reaped: Arc::new(AtomicBool::new(false)),
        }
    }

    /// The group's id, which is the child's pid.
    pub fn pgid(&self) -> i32 {
        self.pgid
    }

    /// Whether the child that leads the group has been reaped.
    pub fn is_reaped(&self) -> bool {
        self.reaped.load(Ordering::SeqCst)
    }

    pub(crate) fn mark_reaped(&self) {
        self.reaped.store(true, Ordering::SeqCst);
    }

    /// Sends SIGTERM or SIGKILL to every process in the group. A group that is already gone,
    /// or whose leader was reaped, is not an error.
    pub fn signal(&self, signal: Signal) -> Result<(), RunnerError> {
        let (sig, name) = match signal {
            Signal::Term => (NixSignal::SIGTERM, "SIGTERM"),
            Signal::Kill => (NixSignal::SIGKILL, "SIGKILL"),
        };
        if self.is_reaped() {
            return Ok(());
        }
        self.raw_signal(sig).map_err(|source| RunnerError::Signal {
            signal: name,
            pgid: self.pgid,
            source,
        })
    }

    /// SIGKILL to the group (`KillCheck`).
    pub fn kill(&self) -> Result<(), RunnerError> {
        self.signal(Signal::Kill)
    }

    /// Signals the group without looking at the reaped flag: for what is left of a group right
    /// after its leader was reaped by us.
    pub(crate) fn raw_signal(&self, sig: NixSignal) -> Result<(), nix::Error> {
        match killpg(Pid::from_raw(self.pgid), sig) {
            Ok(()) | Err(Errno::ESRCH) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// SIGKILLs the group when dropped while armed: a child whose waiter is dropped before it was
/// reaped does not outlive it, and neither does anything it started in its group.
#[derive(Debug)]
pub(crate) struct GroupGuard {
    group: ProcessGroup,
    armed: bool,
}

impl GroupGuard {
    pub(crate) fn new(group: ProcessGroup) -> GroupGuard {
        GroupGuard { group, armed: true }
    }
    pub(crate) fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        if self.armed
            && !self.group.is_reaped()
            && let Err(e) = self.group.raw_signal(NixSignal::SIGKILL)
        {
            tracing::warn!(pgid = self.group.pgid, error = %e, "could not kill a dropped child's process group");
        }
    }
}

/// A started agent or check: the child, its run, and the process group it leads, with the
/// guard that kills the group if this is dropped before the child was reaped.
#[derive(Debug)]
pub struct Spawned {
    run_id: u64,
    pid: u32,
    group: ProcessGroup,
    guard: GroupGuard,
    pub(crate) child: Child,
}

impl Spawned {
    pub(crate) fn new(run_id: u64, pid: u32, child: Child) -> Spawned {
        let group = ProcessGroup::new(i32::try_from(pid).unwrap_or(i32::MAX));
        Spawned {
            run_id,
            pid,
            guard: GroupGuard::new(group.clone()),
            group,
            child,
        }
    }

    pub fn run_id(&self) -> u64 {
        self.run_id
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The process group, for the machine's `Signal` and `KillCheck` commands.
    pub fn group(&self) -> ProcessGroup {
        self.group.clone()
    }

    /// The exit `waited` reports, once the child's wait returned. A wait that failed leaves
    /// the child's fate unknown: its group and the child are SIGKILLed, and the exit is that
    /// signal. `what` names the child in the log.
    pub(crate) async fn exit(
        &mut self,
        waited: std::io::Result<std::process::ExitStatus>,
        what: &str,
    ) -> ExitStatus {
        match waited {
            Ok(status) => exit_status(status),
            Err(e) => {
                let (run_id, pid) = (self.run_id, self.pid);
                tracing::error!(run_id, pid, error = %e, "waiting for the {what} failed; killing its group");
                let _ = self.group.raw_signal(NixSignal::SIGKILL);
                let _ = self.child.kill().await;
                ExitStatus::Signal(NixSignal::SIGKILL as i32)
            }
        }
    }

    /// The child was reaped: its group id may be reused from now on, so the group is not
    /// signalled again and the guard stands down.
    pub(crate) fn reaped(&mut self) {
        self.group.mark_reaped();
        self.guard.disarm();
    }
}
