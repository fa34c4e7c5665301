//! A small seeded PRNG (SplitMix64), split into named streams.
//!
//! Each concern draws from its own stream (options, workload, network, plan), so that changing
//! how often one of them draws does not shift the others: removing a fault from a plan leaves
//! the workload exactly as it was, which is what makes shrinking meaningful.

use relay_core::mix::{SplitMix64, fnv1a};

#[derive(Clone, Debug)]
pub struct Rng(SplitMix64);

impl Rng {
    /// The stream `name` of the run seeded `seed`.
    pub fn stream(seed: u64, name: &str) -> Rng {
        Rng(SplitMix64::new(seed ^ fnv1a(name.as_bytes())))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        // Multiply-shift: no modulo bias worth speaking of at these sizes, and no division.
        ((u128::from(self.next_u64()) * u128::from(n.max(1))) >> 64) as u64
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi.saturating_sub(lo) + 1)
    }

    /// True with probability `per_mille / 1000`.
    pub fn chance(&mut self, per_mille: u32) -> bool {
        self.below(1000) < u64::from(per_mille)
    }

    /// A 16-byte value as 32 hex characters (fence tokens, ids).
    pub fn hex16(&mut self) -> String {
        format!("{:016x}{:016x}", self.next_u64(), self.next_u64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_independent_and_reproducible() {
        let a: Vec<u64> = (0..4).map(|_| Rng::stream(7, "net").next_u64()).collect();
        assert!(a.windows(2).all(|w| w[0] == w[1]), "same seed, same stream");
        assert_ne!(
            Rng::stream(7, "net").next_u64(),
            Rng::stream(7, "plan").next_u64()
        );
        let mut r = Rng::stream(1, "x");
        for _ in 0..1000 {
            let v = r.range(3, 9);
            assert!((3..=9).contains(&v));
        }
    }
}
