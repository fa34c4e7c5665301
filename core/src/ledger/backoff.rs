//! Retry backoff after a failed attempt: exponential, capped, with deterministic jitter.
//!
//! Defaults: 30 s after the first failure, doubling each time (30 s, 1 m, 2 m, 4 m …), capped
//! at 1 h, each delay shortened by up to 20 % of itself. The jitter is drawn from a seed (a
//! setting of the server) mixed with the todo id and the attempt's seq, so that failures of many
//! todos at once spread out, while the ledger and every store compute the same instant for the
//! same failure — which is what lets the stores be tested against the ledger.

use crate::mix;
use crate::time::{HOUR, Millis, SECOND};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Backoff {
    /// The delay after the first failure.
    pub base: Millis,
    /// No delay is longer than this.
    pub cap: Millis,
    /// Up to this percentage of a delay is taken off it at random (0 = no jitter, max 100).
    pub jitter_percent: u8,
    /// The jitter's seed.
    pub seed: u64,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            base: 30 * SECOND,
            cap: HOUR,
            jitter_percent: 20,
            seed: 0x05ee_d0f4_e1a7,
        }
    }
}

impl Backoff {
    /// The delay before the retry after failed attempt number `attempt` (1-based) whose seq is
    /// `seq`, of the todo `todo_id`.
    pub fn delay(&self, todo_id: &str, seq: u32, attempt: u32) -> Millis {
        let exp = attempt.saturating_sub(1).min(40);
        let full = self.base.saturating_mul(1u64 << exp).min(self.cap);
        let span = full / 100 * u64::from(self.jitter_percent.min(100));
        if span == 0 {
            return full;
        }
        let draw = mix::splitmix64(self.seed ^ mix::fnv1a(todo_id.as_bytes()) ^ u64::from(seq));
        full - draw % (span + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::MINUTE;

    #[test]
    fn grows_exponentially_within_the_jitter_band_and_caps() {
        let b = Backoff::default();
        for attempt in 1..=12u32 {
            let full = (30 * SECOND * (1 << (attempt - 1))).min(HOUR);
            let d = b.delay("td_1", attempt, attempt);
            assert!(d <= full && d >= full - full / 5, "attempt {attempt}: {d}");
        }
        assert!(b.delay("td_1", 99, 99) <= HOUR);
    }

    #[test]
    fn jitter_is_deterministic_per_seed_and_spread_across_todos() {
        let b = Backoff::default();
        assert_eq!(b.delay("td_1", 3, 3), b.delay("td_1", 3, 3));
        let distinct: std::collections::BTreeSet<_> =
            (0..50).map(|i| b.delay(&format!("td_{i}"), 3, 3)).collect();
        assert!(distinct.len() > 40, "jitter barely varies: {distinct:?}");
        let other = Backoff {
            seed: 7,
            ..b.clone()
        };
        assert_ne!(
            (0..10)
                .map(|i| b.delay(&format!("td_{i}"), 1, 1))
                .collect::<Vec<_>>(),
            (0..10)
                .map(|i| other.delay(&format!("td_{i}"), 1, 1))
                .collect::<Vec<_>>()
        );
    }

    #[test]
    fn no_jitter_means_exact_delays() {
        let b = Backoff {
            jitter_percent: 0,
            ..Backoff::default()
        };
        assert_eq!(b.delay("x", 1, 1), 30 * SECOND);
        assert_eq!(b.delay("x", 2, 2), MINUTE);
        assert_eq!(b.delay("x", 3, 3), 2 * MINUTE);
    }
}
