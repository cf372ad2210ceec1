//! Tear protection for the hash values programs read while the agent
//! rewrites them (ENDPOINTS, L2_RESP_V4, L2_RESP_V6).
//!
//! Why it exists: a program gets a pointer into a hash element and copies the
//! value out, while the agent may replace that key's value from another CPU.
//! The kernel puts a replacement in a new element and frees the old one, but
//! it reuses a freed element for the very next update at once — in
//! preallocated hashes and, since the BPF memory allocator, in
//! `BPF_F_NO_PREALLOC` ones too — so a program still copying the old element
//! can see it overwritten half-way: `flags` of one version beside the address
//! of another. `tests/tests/torn_reads.rs` measured 4 such reads in 94 M runs
//! against 8 M rewrites on Linux 6.18 (11 with `BPF_F_NO_PREALLOC`).
//!
//! The fix: every value carries a check word, a mix of the key and every other
//! word of the value, computed by the agent as it writes ([`mix`]). A program
//! copies the value word by word and accepts it only if the check word matches
//! the copy; a copy mixing two versions (or another key's value, when the
//! element went to another key) fails the check except by a 2^-32 chance, and
//! is looked up again. A value that never checks out (damaged, or not written
//! by the agent) reads as absent: the datapath fails closed, and the agent's
//! verify reports the entry as drift and rewrites it.

/// Mixes `key` and every word of `words` except `words[skip]` (the check word
/// itself) into a check word. The same on both sides of the kernel boundary.
#[inline(always)]
#[must_use]
pub const fn mix(key: u32, words: &[u32], skip: usize) -> u32 {
    let mut h = 0x811C_9DC5u32 ^ key.wrapping_mul(0x9E37_79B1);
    let mut i = 0;
    while i < words.len() {
        if i != skip {
            h = (h ^ words[i]).wrapping_mul(0x0100_0193);
            h ^= h >> 15;
        }
        i += 1;
    }
    h ^= h >> 16;
    h = h.wrapping_mul(0x85EB_CA6B);
    h ^= h >> 13;
    h
}

/// Four bytes as the native-endian word they are in memory.
const fn word(b: [u8; 4]) -> u32 {
    u32::from_ne_bytes(b)
}

impl crate::EndpointValue {
    /// Size in 32-bit words.
    pub const WORDS: usize = size_of::<Self>() / 4;
    /// Index of the check word.
    const CHECK: usize = core::mem::offset_of!(Self, check) / 4;

    /// The value's words as they lie in memory.
    #[must_use]
    pub const fn words(&self) -> [u32; Self::WORDS] {
        let g = self.generation.to_ne_bytes();
        let v6 = self.ipv6;
        let m = self.mac;
        let p = self._pad;
        [
            word([g[0], g[1], g[2], g[3]]),
            word([g[4], g[5], g[6], g[7]]),
            word(self.ipv4),
            self.flags,
            word([v6[0], v6[1], v6[2], v6[3]]),
            word([v6[4], v6[5], v6[6], v6[7]]),
            word([v6[8], v6[9], v6[10], v6[11]]),
            word([v6[12], v6[13], v6[14], v6[15]]),
            word([m[0], m[1], m[2], m[3]]),
            word([m[4], m[5], p[0], p[1]]),
            self.check,
            self._pad2,
        ]
    }

    /// The value as written to ENDPOINTS under `ifindex`: check word set.
    #[must_use]
    pub const fn sealed(mut self, ifindex: u32) -> Self {
        self.check = mix(ifindex, &self.words(), Self::CHECK);
        self
    }

    /// Whether the check word matches the key and the rest of the value.
    #[must_use]
    pub const fn is_sealed(&self, ifindex: u32) -> bool {
        self.check == mix(ifindex, &self.words(), Self::CHECK)
    }

    /// Checks a word-by-word copy of the ENDPOINTS value of `ifindex`: its
    /// flags, addresses and MAC when the seal holds.
    #[inline(always)]
    #[must_use]
    pub fn open(w: &[u32; Self::WORDS], ifindex: u32) -> Option<crate::EndpointAddrs> {
        if w[Self::CHECK] != mix(ifindex, w, Self::CHECK) {
            return None;
        }
        let b = |i: usize| w[i].to_ne_bytes();
        let (a, c, d, e) = (b(4), b(5), b(6), b(7));
        let (m, n) = (b(8), b(9));
        Some((
            w[3],
            b(2),
            [
                a[0], a[1], a[2], a[3], c[0], c[1], c[2], c[3], d[0], d[1], d[2], d[3], e[0], e[1],
                e[2], e[3],
            ],
            [m[0], m[1], m[2], m[3], n[0], n[1]],
        ))
    }
}

impl crate::EndpointValue {
    /// Checks a word-by-word copy of the ENDPOINTS value of `ifindex`: the
    /// endpoint's MAC (inside its namespace) when the seal holds. What a
    /// packet delivered to the endpoint from elsewhere is addressed to.
    #[inline(always)]
    #[must_use]
    pub fn open_mac(w: &[u32; Self::WORDS], ifindex: u32) -> Option<[u8; 6]> {
        if w[Self::CHECK] != mix(ifindex, w, Self::CHECK) {
            return None;
        }
        let (a, b) = (w[8].to_ne_bytes(), w[9].to_ne_bytes());
        Some([a[0], a[1], a[2], a[3], b[0], b[1]])
    }
}

impl crate::L2RespValue {
    /// Size in 32-bit words.
    pub const WORDS: usize = size_of::<Self>() / 4;
    /// Index of the check word.
    const CHECK: usize = core::mem::offset_of!(Self, check) / 4;

    /// The value's words as they lie in memory.
    #[must_use]
    pub const fn words(&self) -> [u32; Self::WORDS] {
        let m = self.mac;
        let p = self._pad;
        let e = self.expires_ns.to_ne_bytes();
        [
            self.ifindex,
            word([m[0], m[1], m[2], m[3]]),
            word([m[4], m[5], p[0], p[1]]),
            self.check,
            word([e[0], e[1], e[2], e[3]]),
            word([e[4], e[5], e[6], e[7]]),
        ]
    }

    /// The seal key of an L2_RESP_V6 address: its four words mixed.
    #[inline(always)]
    #[must_use]
    pub const fn v6_key(addr: crate::V6Addr) -> u32 {
        let a = addr;
        Self::v6_key_words([
            word([a[0], a[1], a[2], a[3]]),
            word([a[4], a[5], a[6], a[7]]),
            word([a[8], a[9], a[10], a[11]]),
            word([a[12], a[13], a[14], a[15]]),
        ])
    }

    /// [`Self::v6_key`] of the address whose native words
    /// ([`slots::v6_words`](crate::slots::v6_words)) are `w`.
    #[inline(always)]
    #[must_use]
    pub const fn v6_key_words(w: [u32; 4]) -> u32 {
        mix(0, &w, usize::MAX)
    }

    /// The value as written to L2_RESP_V6 under `addr`: check word set.
    #[must_use]
    pub const fn sealed_v6(mut self, addr: crate::V6Addr) -> Self {
        self.check = mix(Self::v6_key(addr), &self.words(), Self::CHECK);
        self
    }

    /// Whether the check word matches the IPv6 key and the rest of the value.
    #[must_use]
    pub const fn is_sealed_v6(&self, addr: crate::V6Addr) -> bool {
        self.check == mix(Self::v6_key(addr), &self.words(), Self::CHECK)
    }

    /// [`Self::open`] for an L2_RESP_V6 value, under the key's
    /// [`Self::v6_key`].
    #[inline(always)]
    #[must_use]
    pub fn open_keyed(w: &[u32; Self::WORDS], key: u32) -> Option<crate::L2Resp> {
        if w[Self::CHECK] != mix(key, w, Self::CHECK) {
            return None;
        }
        let (a, b) = (w[1].to_ne_bytes(), w[2].to_ne_bytes());
        let (lo, hi) = (w[4].to_ne_bytes(), w[5].to_ne_bytes());
        let expires = u64::from_ne_bytes([lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]]);
        Some((w[0], [a[0], a[1], a[2], a[3], b[0], b[1]], expires))
    }

    /// The value as written to L2_RESP_V4 under `addr`: check word set.
    #[must_use]
    pub const fn sealed(mut self, addr: crate::V4Addr) -> Self {
        self.check = mix(word(addr), &self.words(), Self::CHECK);
        self
    }

    /// Whether the check word matches the key and the rest of the value.
    #[must_use]
    pub const fn is_sealed(&self, addr: crate::V4Addr) -> bool {
        self.check == mix(word(addr), &self.words(), Self::CHECK)
    }

    /// Checks a word-by-word copy of the L2_RESP_V4 value of `addr`: the
    /// announcing interface, MAC and expiry when the seal holds.
    #[inline(always)]
    #[must_use]
    pub fn open(w: &[u32; Self::WORDS], addr: crate::V4Addr) -> Option<crate::L2Resp> {
        Self::open_keyed(w, word(addr))
    }
}

#[cfg(test)]
mod tests {
    use crate::{EndpointValue, L2RespValue, endpoint_flags};

    fn in_memory<T: Copy, const W: usize>(v: &T) -> [u32; W] {
        assert_eq!(size_of::<T>(), W * 4);
        // SAFETY: T is repr(C) without implicit padding, W * 4 bytes long.
        unsafe { core::ptr::read_unaligned((v as *const T).cast::<[u32; W]>()) }
    }

    fn endpoint(last: u8) -> EndpointValue {
        EndpointValue {
            generation: 0x0102_0304_0506_0708,
            ipv4: [10, 0, 1, last],
            flags: endpoint_flags::HAS_V4 | endpoint_flags::HAS_V6,
            ipv6: [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, last],
            mac: [2, 0, 0, 0, 0, last],
            ..Default::default()
        }
    }

    #[test]
    fn words_are_the_memory_layout() {
        let v = endpoint(5).sealed(7);
        assert_eq!(v.words(), in_memory::<_, 12>(&v));
        let l2 = L2RespValue {
            ifindex: 9,
            mac: [2, 0, 0, 0, 0, 9],
            ..Default::default()
        }
        .sealed([10, 0, 0, 9]);
        assert_eq!(l2.words(), in_memory::<_, 6>(&l2));
    }

    #[test]
    fn sealed_values_open_under_their_key_only() {
        let v = endpoint(5);
        let s = v.sealed(7);
        assert!(s.is_sealed(7) && !s.is_sealed(8) && !v.is_sealed(7));
        assert_eq!(
            EndpointValue::open(&s.words(), 7),
            Some((v.flags, v.ipv4, v.ipv6, v.mac))
        );
        assert_eq!(EndpointValue::open(&s.words(), 8), None);
        assert_eq!(EndpointValue::open_mac(&s.words(), 7), Some(s.mac));
        assert_eq!(EndpointValue::open_mac(&s.words(), 8), None);
        assert_eq!(EndpointValue::open(&[0; 12], 0), None);
        let l2 = L2RespValue {
            ifindex: 9,
            mac: [2, 0, 0, 0, 0, 9],
            ..Default::default()
        };
        let sl = l2.sealed([10, 0, 0, 9]);
        assert_eq!(
            L2RespValue::open(&sl.words(), [10, 0, 0, 9]),
            Some((9, l2.mac, 0))
        );
        assert_eq!(L2RespValue::open(&sl.words(), [10, 0, 0, 8]), None);
        // IPv6 keys, and the expiry under the seal.
        let a6 = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 9];
        let mut b6 = a6;
        b6[15] = 8;
        let l2 = L2RespValue {
            expires_ns: 77_000_000_000,
            ..l2
        };
        let s6 = l2.sealed_v6(a6);
        assert!(s6.is_sealed_v6(a6) && !s6.is_sealed_v6(b6));
        let k = L2RespValue::v6_key;
        assert_eq!(
            L2RespValue::open_keyed(&s6.words(), k(a6)),
            Some((9, l2.mac, 77_000_000_000))
        );
        assert_eq!(L2RespValue::open_keyed(&s6.words(), k(b6)), None);
        let mut later = s6;
        later.expires_ns += 1;
        assert_eq!(L2RespValue::open_keyed(&later.words(), k(a6)), None);
    }

    /// A copy that mixes two versions of one key's value word by word (every
    /// mask of 12 words: forward, backward and any other copy order) never
    /// opens, unless it equals one of the versions.
    #[test]
    fn a_copy_mixing_two_versions_never_opens() {
        let versions = [endpoint(5).sealed(7), endpoint(6).sealed(7), {
            let mut v = endpoint(5);
            v.flags = 0;
            v.sealed(7)
        }];
        for a in &versions {
            for b in &versions {
                let (wa, wb) = (a.words(), b.words());
                for mask in 0u32..(1 << 12) {
                    let w: [u32; 12] =
                        core::array::from_fn(|i| if mask & (1 << i) != 0 { wb[i] } else { wa[i] });
                    if w != wa && w != wb {
                        assert_eq!(EndpointValue::open(&w, 7), None, "mask {mask:#x}");
                    }
                }
            }
        }
    }
}
