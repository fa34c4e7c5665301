//! Time as the shell reads it. Everything in `relay_core` takes `now` as a value; the shell gets
//! it from a [`Clock`], so that tests can drive the server and the daemon on a clock they move by
//! hand instead of sleeping.
//!
//! A clock has two readings. [`Clock::now`] is the wall clock (milliseconds since the epoch): the
//! server's lease times, and every stamp in a record, file or summary. [`Clock::mono`] never
//! steps: the daemon's deadlines run on it (the relay machine takes both, as a [`Now`]), so a wall
//! clock stepped back cannot keep an agent running past its lease.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use relay_core::Millis;
use relay_core::time::Now;

/// A source of "now": a wall and a monotonic reading.
pub trait Clock: Send + Sync + 'static {
    /// Wall time, milliseconds since the Unix epoch. It may step either way.
    fn now(&self) -> Millis;
    /// Monotonic time, milliseconds from an origin of the clock's own. It never decreases.
    fn mono(&self) -> Millis;
    /// Both readings, as the relay machine takes them.
    fn reading(&self) -> Now {
        Now {
            mono: self.mono(),
            wall: self.now(),
        }
    }
}

/// The system's clocks: `CLOCK_REALTIME` for the wall, `CLOCK_BOOTTIME` for the monotonic one.
/// Boot time (not `CLOCK_MONOTONIC`, which stops while the machine is suspended) because a lease
/// runs on at the server while a laptop sleeps: after a resume the daemon must see that its
/// leases are gone, not carry on for the rest of their term.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Millis {
        let since = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
    }

    fn mono(&self) -> Millis {
        match nix::time::clock_gettime(nix::time::ClockId::CLOCK_BOOTTIME) {
            Ok(t) => {
                let ms = i128::from(t.tv_sec()) * 1_000 + i128::from(t.tv_nsec()) / 1_000_000;
                u64::try_from(ms).unwrap_or(0)
            }
            // Not on this kernel: the process's own monotonic clock, which at least never steps.
            Err(_) => {
                static ORIGIN: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
                let origin = ORIGIN.get_or_init(std::time::Instant::now);
                u64::try_from(origin.elapsed().as_millis()).unwrap_or(u64::MAX)
            }
        }
    }
}

/// A clock that moves only when a test moves it. Both readings start at `start` and move
/// together; [`ManualClock::step_wall`] steps the wall reading alone.
#[derive(Clone, Debug, Default)]
pub struct ManualClock {
    mono: Arc<AtomicU64>,
    wall_offset: Arc<AtomicI64>,
}

impl ManualClock {
    pub fn new(start: Millis) -> ManualClock {
        ManualClock {
            mono: Arc::new(AtomicU64::new(start)),
            wall_offset: Arc::default(),
        }
    }
    pub fn advance(&self, by: Millis) {
        self.mono.fetch_add(by, Ordering::SeqCst);
    }
    /// Steps the wall clock by `by` ms, back or forward; the monotonic clock does not move.
    pub fn step_wall(&self, by: i64) {
        self.wall_offset.fetch_add(by, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Millis {
        self.mono()
            .saturating_add_signed(self.wall_offset.load(Ordering::SeqCst))
    }
    fn mono(&self) -> Millis {
        self.mono.load(Ordering::SeqCst)
    }
}

/// Shared handle used by the server and the daemon.
pub type SharedClock = Arc<dyn Clock>;
