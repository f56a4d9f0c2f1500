//! A fast hasher for the small integer keys of schedules (actions, links, device pairs): the
//! planner validates and replays thousands of schedules, and the default SipHash of each
//! action's key was most of its time. Not resistant to chosen keys, which these are not.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};

/// A `HashMap` with [`FastHasher`].
pub(crate) type FastMap<K, V> = HashMap<K, V, BuildFastHasher>;

#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct BuildFastHasher;

/// Fx-style mixing (rotate, xor, multiply) of each integer written.
#[derive(Debug, Default)]
pub(crate) struct FastHasher(u64);

impl BuildHasher for BuildFastHasher {
    type Hasher = FastHasher;
    fn build_hasher(&self) -> FastHasher {
        FastHasher(0)
    }
}

impl Hasher for FastHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u8(&mut self, x: u8) {
        self.write_u64(u64::from(x));
    }
    fn write_u32(&mut self, x: u32) {
        self.write_u64(u64::from(x));
    }
    fn write_usize(&mut self, x: usize) {
        self.write_u64(x as u64);
    }
    fn write_isize(&mut self, x: isize) {
        self.write_u64(x as u64);
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = (self.0.rotate_left(5) ^ x).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distinct_small_keys_spread() {
        let mut m: FastMap<(usize, usize), usize> = FastMap::default();
        for a in 0..64 {
            for b in 0..64 {
                m.insert((a, b), a * 64 + b);
            }
        }
        assert_eq!(m.len(), 64 * 64);
        assert_eq!(m[&(3, 5)], 3 * 64 + 5);
        let hash = |k: (usize, usize)| BuildFastHasher.hash_one(k);
        assert_ne!(hash((0, 1)), hash((1, 0)));
    }
}
