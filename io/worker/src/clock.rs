//! The worker's clock. Everything in `relay_core` takes `now` as a value; the daemon gets it
//! from a [`Clock`] (wall for every stamp in a record, file or summary; monotonic for deadlines),
//! so that tests can drive it on a [`ManualClock`](relay_core::time::ManualClock) instead of
//! sleeping.

use std::sync::Arc;

use relay_core::Millis;
use relay_core::time::{Clock, Mono, WallClock, millis};

/// The system's clocks: `CLOCK_REALTIME` for the wall, `CLOCK_BOOTTIME` for the monotonic one.
/// Boot time (not `CLOCK_MONOTONIC`, which stops while the machine is suspended) because a lease
/// runs on at the server while a laptop sleeps: after a resume the daemon must see that its
/// leases are gone, not carry on for the rest of their term.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl WallClock for SystemClock {
    fn now(&self) -> Millis {
        read(nix::time::ClockId::CLOCK_REALTIME).unwrap_or(0)
    }
}

impl Clock for SystemClock {
    fn mono(&self) -> Mono {
        let ms = read(nix::time::ClockId::CLOCK_BOOTTIME).unwrap_or_else(|| {
            // Not on this kernel: the process's own monotonic clock, which at least never steps.
            static ORIGIN: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
            millis(ORIGIN.get_or_init(std::time::Instant::now).elapsed())
        });
        Mono::from_ms(ms)
    }
}

/// One of the kernel's clocks in milliseconds (0 before its origin); `None` where it has none.
fn read(id: nix::time::ClockId) -> Option<Millis> {
    let t = nix::time::clock_gettime(id).ok()?;
    let ms = i128::from(t.tv_sec()) * 1_000 + i128::from(t.tv_nsec()) / 1_000_000;
    Some(u64::try_from(ms).unwrap_or(0))
}

/// Shared handle used by the daemon.
pub type SharedClock = Arc<dyn Clock>;
