//! Stable mixing for the seeded, deterministic parts: a hash of bytes (FNV-1a) and a
//! pseudo-random sequence (SplitMix64). Neither depends on the platform, the std hasher's random
//! seed or a crate's version, so a seed replays the same run on every machine.

/// The SplitMix64 increment (2^64 divided by the golden ratio).
const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// FNV-1a of `bytes`: a stable 64-bit hash (the std hasher is randomly seeded and may change).
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// SplitMix64 of one value: turns a seed (or any number) into a well-mixed 64-bit value.
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(GOLDEN);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A seeded SplitMix64 sequence: small, quick and good enough for jitter and simulation (not
/// for secrets).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> SplitMix64 {
        SplitMix64(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        let out = splitmix64(self.0);
        self.0 = self.0.wrapping_add(GOLDEN);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reference_values() {
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        let mut r = SplitMix64::new(0);
        assert_eq!(r.next_u64(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(r.next_u64(), 0x6e78_9e6a_a1b9_65f4);
        assert_eq!(splitmix64(0), 0xe220_a839_7b1d_cdaf);
    }
}
