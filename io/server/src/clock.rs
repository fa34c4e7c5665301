//! The queue server's clock: wall time only (lease times and every stamp), from a
//! [`WallClock`], so that tests drive lease expiry, retries, session expiry and the doorbell
//! window on a [`ManualClock`](relay_core::time::ManualClock) instead of sleeping.

use std::sync::Arc;

use relay_core::Millis;
use relay_core::time::{WallClock, millis};

/// The system's wall clock (`CLOCK_REALTIME`).
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl WallClock for SystemClock {
    fn now(&self) -> Millis {
        let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
        millis(since.unwrap_or_default())
    }
}

/// Shared handle used by the server.
pub type SharedClock = Arc<dyn WallClock>;
