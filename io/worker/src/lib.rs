//! relay-worker: the worker side of relay's tokio shell.
//!
//! It moves bytes and time: the lease client ([`lease`]), the agent and check processes
//! ([`runner`]), the run records ([`journal`]) and the daemon that ties them together
//! ([`daemon`]). It never decides a lifecycle rule: every rule is a call into `relay_core`, so
//! the simulator and the fuzz targets exercise the same logic.

// madsim marks `spawn_blocking` deprecated (it runs the closure as an ordinary task there):
// the file writes and config loads that hop to the blocking pool in production run inline in
// the shell-sim sweep, which is what a deterministic world wants.
#![cfg_attr(madsim, allow(deprecated))]
// A madsim build leaves the real processes out (see `runner::Launcher`), and with them the
// callers of their helpers.
#![cfg_attr(madsim, allow(dead_code, unused_imports))]

pub use relay_core as core;

pub mod clock;
pub mod daemon;
pub mod journal;
pub mod lease;
pub mod runner;

#[cfg(test)]
mod test_files;
