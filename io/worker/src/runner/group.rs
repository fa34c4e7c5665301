//! Signals to a child's process group.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use nix::errno::Errno;
use nix::sys::signal::{Signal as NixSignal, killpg};
use nix::unistd::Pid;
use relay_core::relay::Signal;

use super::RunnerError;

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
