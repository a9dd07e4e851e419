//! The relay's own ids: request ids as the wire shows them, and the maps and sets keyed by
//! them ([`RequestId`], [`WorkerId`], task ids).
//!
//! The standard `HashMap` hashes with SipHash, which resists keys chosen to collide: the
//! right default for anything a client names. These keys are counters the relay hands
//! out itself, never chosen by a client or a worker (a worker's text id is parsed and
//! looked up, and a lookup cannot build a collision chain). A request touches these maps
//! about thirty times on its way through the dispatcher, and SipHash cost about 150
//! instructions each time, some 5 % of the server's own work per request (callgrind,
//! `docs/proving.md`). One multiplication spreads a counter over the table as well.
//!
//! [`RequestId`]: super::RequestId
//! [`WorkerId`]: super::WorkerId

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

/// A `HashMap` keyed by one of the relay's own `u64` ids.
pub type IdMap<V> = HashMap<u64, V, BuildHasherDefault<IdHasher>>;
/// A `HashSet` of the relay's own `u64` ids.
pub type IdSet = HashSet<u64, BuildHasherDefault<IdHasher>>;

/// Multiplies the id by an odd constant (the golden ratio's, as Fibonacci hashing does):
/// consecutive ids land in different buckets, and the top bits hashbrown uses as a
/// bucket's tag differ too.
#[derive(Default, Clone, Copy)]
pub struct IdHasher(u64);

const SPREAD: u64 = 0x9E37_79B9_7F4A_7C15;

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write_u64(&mut self, id: u64) {
        self.0 = (self.0 ^ id).wrapping_mul(SPREAD);
    }

    /// Only `u64` keys use this hasher; any other input is still hashed, byte by byte.
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(u64::from(*b));
        }
    }
}

/// Renders a request id as sent on the wire and in `X-Request-Id`.
pub fn wire_request_id(id: super::RequestId) -> String {
    use std::fmt::Write;
    // Sized up front: `format!` grew its string twice on the way to 18 bytes.
    let mut wire = String::with_capacity(18);
    let _ = write!(wire, "r-{id:016x}");
    wire
}

/// Parses a wire request id back; foreign ids are `None`.
pub fn parse_request_id(wire: &str) -> Option<super::RequestId> {
    let hex = wire.strip_prefix("r-")?;
    if hex.len() != 16 {
        return None;
    }
    u64::from_str_radix(hex, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    #[test]
    fn consecutive_ids_spread_over_buckets_and_tags() {
        let build = BuildHasherDefault::<IdHasher>::default();
        let hashes: Vec<u64> = (1..=1024u64).map(|id| build.hash_one(id)).collect();
        let buckets: HashSet<u64> = hashes.iter().map(|h| h & 1023).collect();
        let tags: HashSet<u64> = hashes.iter().map(|h| h >> 57).collect();
        // Every id its own bucket of 1,024, and nearly all 128 tags in use.
        assert_eq!(buckets.len(), 1024);
        assert!(tags.len() > 120, "{} tags", tags.len());
    }

    #[test]
    fn maps_keep_every_entry() {
        let mut map: IdMap<u64> = IdMap::default();
        for id in 0..10_000u64 {
            map.insert(id * 7, id);
        }
        assert!((0..10_000u64).all(|id| map.get(&(id * 7)) == Some(&id)));
        assert_eq!(map.len(), 10_000);
    }
}
