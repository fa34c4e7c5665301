//! A test's kill -9 at a named step.

relay_core::names! {
    /// A step at which a test kills the daemon with SIGKILL, as an operator's `kill -9` or a
    /// power cut would, but exactly there: `RELAY_TEST_KILL_AT` names it. Not a setting: a fault
    /// injection point for the tests that prove the run record survives each step
    /// (tests/daemon.rs); the daemon logs a warning at start when it is set.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub(crate) enum KillAt {
        /// The claim's record is on disk, the context file written; the process not yet started.
        Spawn => "spawn",
        /// The process started; the machine has not heard of it yet.
        Spawned => "spawned",
        /// The attempt is judged; its report not yet sent.
        Report => "report",
    }
}

impl KillAt {
    const VAR: &str = "RELAY_TEST_KILL_AT";

    pub(super) fn from_env() -> Option<KillAt> {
        let v = std::env::var(Self::VAR).ok()?;
        let at = KillAt::parse(&v);
        match at {
            Some(at) => tracing::warn!(
                step = at.as_str(),
                "{} is set: this daemon kills itself at that step (a test's fault injection)",
                Self::VAR
            ),
            None => tracing::warn!(
                "{} names no step (spawn, spawned or report); ignored",
                Self::VAR
            ),
        }
        at
    }

    /// Kills the daemon with SIGKILL when `self` is `at`.
    pub(crate) fn here(this: Option<KillAt>, at: KillAt) {
        if this == Some(at) {
            let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
        }
    }
}
