//! Time in the world: the true clock and the wall clocks the faults step.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use relay_core::Millis;
use relay_core::time::{Clock, Mono, WallClock};

/// Milliseconds of the simulated wall clock (madsim's, inside the world).
pub(super) fn true_ms() -> Millis {
    let d = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    u64::try_from(d.as_millis()).unwrap_or(0)
}

/// A node's clocks: the simulated wall clock plus a step the fault plan moves; the monotonic
/// one (boot time, madsim's instant) never steps.
#[derive(Clone, Default)]
pub(super) struct SteppedClock {
    pub(super) offset: Arc<AtomicI64>,
}

impl WallClock for SteppedClock {
    fn now(&self) -> Millis {
        true_ms().saturating_add_signed(self.offset.load(Ordering::Relaxed))
    }
}

impl Clock for SteppedClock {
    fn mono(&self) -> Mono {
        relay_worker::clock::SystemClock.mono()
    }
}
