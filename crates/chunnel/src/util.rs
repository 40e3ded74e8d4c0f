//! Small helpers the chunnel crates share: the FNV-1a hash that sharding is specified with,
//! random identifiers, and a lock that ignores poisoning.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

/// 64-bit FNV-1a of `bytes` (offset basis `0xcbf29ce484222325`, prime `0x100000001b3`): the
/// documented, stable hash sharding uses (`chunnel_std::shard::shard_of`, the XDP shard
/// program).
///
/// ```
/// assert_eq!(chunnel::util::fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
/// assert_eq!(chunnel::util::fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
/// ```
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// A random 64-bit identifier (connection ids, transaction ids, member ids): a counter
/// hashed with a key drawn from the operating system's randomness once per process
/// (SipHash, `std`'s `RandomState`), so values do not repeat within a process and cannot be
/// predicted from outside it. No allocation, no system call after the first.
pub fn random_u64() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    static KEY: OnceLock<RandomState> = OnceLock::new();
    let mut h = KEY.get_or_init(RandomState::new).build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.finish()
}

/// Locks `m`, taking the data over if a thread panicked while holding it (the protected
/// state is left consistent at every unlock in the chunnel crates, so poisoning carries no
/// information there).
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    #[test]
    fn random_ids_differ() {
        let ids: std::collections::HashSet<u64> =
            (0..10_000).map(|_| super::random_u64()).collect();
        assert_eq!(ids.len(), 10_000);
    }
}
