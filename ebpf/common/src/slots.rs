//! Direct-mapped slot arrays in front of the ENDPOINTS, L2_RESP_V4 and
//! L2_RESP_V6 hashes.
//!
//! Why they exist: on the kernels lockstep targets, a hash lookup from a BPF
//! program is a call into the kernel (~30 ns on the project VM, whose CPU runs
//! the SRSO "safe RET" mitigation that makes every kernel return expensive),
//! while an array lookup is inlined by the verifier into a bounds check and an
//! add. `from_endpoint` and the ARP responder therefore look in a slot array
//! first and fall back to the hash only when the slot does not hold the key.
//! The hashes stay the source of truth; the agent derives the slots from them
//! (for each slot, the entry with the smallest key that maps to it) and
//! reconciles and verifies them like any other map.
//!
//! Array values are updated in place, so a program can read a slot while the
//! agent rewrites it. Every field a program uses is therefore stored twice,
//! as itself and as its bitwise complement, and the agent only ever rewrites
//! a non-empty slot by clearing it (all zero) first. A byte read from a
//! half-written slot is then either from the complete old value, zero, or
//! from the complete new value, and a field only checks out when each of its
//! bytes matches its complement; zero never matches (!0 is 0xff). Readers copy
//! the slot, check every pair, and re-read the key afterwards, so a copy that
//! spans two rewrites is rejected too. A rejected slot falls back to the hash,
//! whose values are sealed against torn copies (see [`seal`](crate::seal)).

use crate::{EndpointValue, L2RespValue, V4Addr, V6Addr, max_entries};

/// Slot of ENDPOINT_SLOTS for the host-side `ifindex`. Interface indexes
/// are handed out in increasing order, so live endpoints rarely collide.
#[inline(always)]
#[must_use]
pub const fn endpoint(ifindex: u32) -> u32 {
    ifindex & (max_entries::ENDPOINT_SLOTS - 1)
}

/// Slot of L2_RESP_SLOTS for an announced address (Fibonacci hashing:
/// addresses of one range spread over the whole array).
#[inline(always)]
#[must_use]
pub const fn l2_resp(addr: V4Addr) -> u32 {
    u32::from_be_bytes(addr).wrapping_mul(0x9E37_79B1)
        >> (32 - max_entries::L2_RESP_SLOTS.trailing_zeros())
}

/// Slot of L2_RESP6_SLOTS for an announced IPv6 address: its four words
/// mixed (each multiplied in, so addresses that differ in any word spread),
/// then Fibonacci hashing like [`l2_resp`].
#[inline(always)]
#[must_use]
pub const fn l2_resp_v6(addr: V6Addr) -> u32 {
    l2_resp_v6_words(v6_words(addr))
}

/// The address as the four native-endian words a program loads from a
/// packet or a map value (the memory order of its bytes kept).
#[inline(always)]
#[must_use]
pub const fn v6_words(a: V6Addr) -> [u32; 4] {
    [
        u32::from_ne_bytes([a[0], a[1], a[2], a[3]]),
        u32::from_ne_bytes([a[4], a[5], a[6], a[7]]),
        u32::from_ne_bytes([a[8], a[9], a[10], a[11]]),
        u32::from_ne_bytes([a[12], a[13], a[14], a[15]]),
    ]
}

/// The address as the two native-endian 64-bit words of its bytes in
/// memory order (how the NDP responder compares it with a slot).
#[inline(always)]
#[must_use]
pub const fn v6_words64(a: V6Addr) -> [u64; 2] {
    [
        u64::from_ne_bytes([a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]]),
        u64::from_ne_bytes([a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15]]),
    ]
}

/// [`l2_resp_v6`] of the address whose [`v6_words`] are `w`: what the NDP
/// responder computes from the words it loaded, without taking the address
/// apart into bytes.
#[inline(always)]
#[must_use]
pub const fn l2_resp_v6_words(w: [u32; 4]) -> u32 {
    let mut h = u32::from_be(w[0]).wrapping_mul(0x9E37_79B1);
    h = (h ^ u32::from_be(w[1])).wrapping_mul(0x9E37_79B1);
    h = (h ^ u32::from_be(w[2])).wrapping_mul(0x9E37_79B1);
    h = (h ^ u32::from_be(w[3])).wrapping_mul(0x9E37_79B1);
    h >> (32 - max_entries::L2_RESP6_SLOTS.trailing_zeros())
}

/// The bitwise complement of every byte.
#[inline(always)]
#[must_use]
pub const fn not<const N: usize>(mut bytes: [u8; N]) -> [u8; N] {
    let mut i = 0;
    while i < N {
        bytes[i] = !bytes[i];
        i += 1;
    }
    bytes
}

/// One slot of ENDPOINT_SLOTS: the fields of an [`EndpointValue`] that
/// `from_endpoint` reads, each beside its complement (see [`slots`](crate::slots)). All zero
/// means empty. Every field is a whole number of 32-bit words, so a program
/// copies and checks the slot a word at a time ([`EndpointSlot::check`]).
/// IPv4 and ARP frames read the leading [`EndpointSlot::V4_WORDS`] only (key,
/// flags, IPv4 address, MAC).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct EndpointSlot {
    /// Host-side ifindex the slot holds (the ENDPOINTS key).
    pub ifindex: u32,
    /// `!ifindex`.
    pub ifindex_check: u32,
    /// [`endpoint_flags`](crate::endpoint_flags) bits.
    pub flags: u32,
    /// `!flags`.
    pub flags_check: u32,
    /// The endpoint's IPv4 address.
    pub ipv4: V4Addr,
    /// Complement of `ipv4`.
    pub ipv4_check: V4Addr,
    /// The MAC of the endpoint's interface inside its namespace: the only
    /// Ethernet source its IPv4 and IPv6 frames may carry (all zero: not
    /// recorded, not checked).
    pub mac: [u8; 6],
    /// Explicit padding; always zero.
    pub _pad: [u8; 2],
    /// Complement of the eight bytes `mac` and `_pad`.
    pub mac_check: [u8; 8],
    /// The endpoint's IPv6 address.
    pub ipv6: V6Addr,
    /// Complement of `ipv6`.
    pub ipv6_check: V6Addr,
}

/// What `from_endpoint` needs of an endpoint: [`endpoint_flags`](crate::endpoint_flags), IPv4,
/// IPv6, MAC.
pub type EndpointAddrs = (u32, V4Addr, V6Addr, [u8; 6]);

impl EndpointSlot {
    /// Size in 32-bit words.
    pub const WORDS: usize = size_of::<Self>() / 4;
    /// The leading words that IPv4 and ARP packets need: the key, the flags,
    /// the IPv4 address, the MAC and their complements.
    pub const V4_WORDS: usize = 10;

    /// The slot holding the ENDPOINTS entry `ifindex` → `value`.
    #[must_use]
    pub const fn new(ifindex: u32, value: &EndpointValue) -> Self {
        let m = value.mac;
        Self {
            ifindex,
            ifindex_check: !ifindex,
            flags: value.flags,
            flags_check: !value.flags,
            ipv4: value.ipv4,
            ipv4_check: not(value.ipv4),
            mac: m,
            _pad: [0; 2],
            mac_check: not([m[0], m[1], m[2], m[3], m[4], m[5], 0, 0]),
            ipv6: value.ipv6,
            ipv6_check: not(value.ipv6),
        }
    }

    /// Checks a word-by-word copy of a slot: the endpoint's flags,
    /// addresses and MAC when the copy holds `ifindex` and no field of it is
    /// torn.
    #[inline(always)]
    #[must_use]
    pub fn check(w: &[u32; Self::WORDS], ifindex: u32) -> Option<EndpointAddrs> {
        let intact = w[0] == ifindex
            && w[1] == !ifindex
            && w[2] == !w[3]
            && w[4] == !w[5]
            && w[6] == !w[8]
            && w[7] == !w[9]
            && w[10] == !w[14]
            && w[11] == !w[15]
            && w[12] == !w[16]
            && w[13] == !w[17];
        if !intact {
            return None;
        }
        let b = |i: usize| w[i].to_ne_bytes();
        let (v6a, v6b, v6c, v6d) = (b(10), b(11), b(12), b(13));
        let (m, n) = (b(6), b(7));
        Some((
            w[2],
            b(4),
            [
                v6a[0], v6a[1], v6a[2], v6a[3], v6b[0], v6b[1], v6b[2], v6b[3], v6c[0], v6c[1],
                v6c[2], v6c[3], v6d[0], v6d[1], v6d[2], v6d[3],
            ],
            [m[0], m[1], m[2], m[3], n[0], n[1]],
        ))
    }
}

impl EndpointSlot {
    /// [`EndpointSlot::check`] over the first [`EndpointSlot::V4_WORDS`]
    /// words only: flags, IPv4 address and MAC.
    #[inline(always)]
    #[must_use]
    pub fn check_v4(w: &[u32; Self::V4_WORDS], ifindex: u32) -> Option<(u32, V4Addr, [u8; 6])> {
        let intact = w[0] == ifindex
            && w[1] == !ifindex
            && w[2] == !w[3]
            && w[4] == !w[5]
            && w[6] == !w[8]
            && w[7] == !w[9];
        let (m, n) = (w[6].to_ne_bytes(), w[7].to_ne_bytes());
        intact.then(|| {
            (
                w[2],
                w[4].to_ne_bytes(),
                [m[0], m[1], m[2], m[3], n[0], n[1]],
            )
        })
    }
}

/// One slot of L2_RESP_SLOTS: an L2_RESP_V4 entry, each field beside its
/// complement (see [`slots`](crate::slots)). All zero means empty.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct L2RespSlot {
    /// The announced address (the L2_RESP_V4 key).
    pub addr: V4Addr,
    /// Complement of `addr`.
    pub addr_check: V4Addr,
    /// Interface the address is announced on.
    pub ifindex: u32,
    /// `!ifindex`.
    pub ifindex_check: u32,
    /// MAC address to answer with.
    pub mac: [u8; 6],
    /// Explicit padding; always zero.
    pub _pad: [u8; 2],
    /// Complement of the eight bytes `mac` and `_pad`.
    pub mac_check: [u8; 8],
    /// [`L2RespValue::expires_ns`].
    pub expires_ns: u64,
    /// `!expires_ns`.
    pub expires_check: u64,
}

/// What the ARP and NDP responders need of an announcement: the interface,
/// the MAC and the expiry ([`L2RespValue::expires_ns`]).
pub type L2Resp = (u32, [u8; 6], u64);

impl L2RespSlot {
    /// Size in 32-bit words.
    pub const WORDS: usize = size_of::<Self>() / 4;

    /// The slot holding the L2_RESP_V4 entry `addr` → `value`.
    #[must_use]
    pub const fn new(addr: V4Addr, value: &L2RespValue) -> Self {
        let m = value.mac;
        Self {
            addr,
            addr_check: not(addr),
            ifindex: value.ifindex,
            ifindex_check: !value.ifindex,
            mac: m,
            _pad: [0; 2],
            mac_check: not([m[0], m[1], m[2], m[3], m[4], m[5], 0, 0]),
            expires_ns: value.expires_ns,
            expires_check: !value.expires_ns,
        }
    }

    /// Checks a word-by-word copy of a slot: the announcing interface, MAC
    /// and expiry when the copy holds `addr` and no field of it is torn.
    #[inline(always)]
    #[must_use]
    pub fn check(w: &[u32; Self::WORDS], addr: V4Addr) -> Option<L2Resp> {
        let key = u32::from_ne_bytes(addr);
        let intact = w[0] == key
            && w[1] == !key
            && w[2] == !w[3]
            && w[4] == !w[6]
            && w[5] == !w[7]
            && w[8] == !w[10]
            && w[9] == !w[11];
        if !intact {
            return None;
        }
        let (a, b) = (w[4].to_ne_bytes(), w[5].to_ne_bytes());
        let (lo, hi) = (w[8].to_ne_bytes(), w[9].to_ne_bytes());
        let expires = u64::from_ne_bytes([lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]]);
        Some((w[2], [a[0], a[1], a[2], a[3], b[0], b[1]], expires))
    }
}

/// One slot of L2_RESP6_SLOTS: an L2_RESP_V6 entry, each field beside its
/// complement, like [`L2RespSlot`] for IPv4. All zero means empty.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct L2RespSlotV6 {
    /// The announced address (the L2_RESP_V6 key).
    pub addr: V6Addr,
    /// Complement of `addr`.
    pub addr_check: V6Addr,
    /// Interface the address is announced on.
    pub ifindex: u32,
    /// `!ifindex`.
    pub ifindex_check: u32,
    /// MAC address to answer with.
    pub mac: [u8; 6],
    /// Explicit padding; always zero.
    pub _pad: [u8; 2],
    /// Complement of the eight bytes `mac` and `_pad`.
    pub mac_check: [u8; 8],
    /// [`L2RespValue::expires_ns`].
    pub expires_ns: u64,
    /// `!expires_ns`.
    pub expires_check: u64,
}

impl L2RespSlotV6 {
    /// Size in 32-bit words.
    pub const WORDS: usize = size_of::<Self>() / 4;

    /// The slot holding the L2_RESP_V6 entry `addr` → `value`.
    #[must_use]
    pub const fn new(addr: V6Addr, value: &L2RespValue) -> Self {
        let m = value.mac;
        Self {
            addr,
            addr_check: not(addr),
            ifindex: value.ifindex,
            ifindex_check: !value.ifindex,
            mac: m,
            _pad: [0; 2],
            mac_check: not([m[0], m[1], m[2], m[3], m[4], m[5], 0, 0]),
            expires_ns: value.expires_ns,
            expires_check: !value.expires_ns,
        }
    }

    /// Size in 64-bit words (the slot is 8-aligned in its array).
    pub const WORDS64: usize = size_of::<Self>() / 8;

    /// Checks a slot read 64 bits at a time through `word` (word `i` of the
    /// slot, each read exactly once and in ascending order, so reading the
    /// array value in place is as good as a copy and needs no stack): the
    /// announcing interface, MAC and expiry when the slot holds the address
    /// whose native 64-bit halves are `key` ([`v6_words64`]) and no field
    /// of it is torn. Nine loads rather than eighteen: the per-packet cost
    /// of the NDP reply (issue 13). The caller re-reads the key afterwards
    /// (see [`slots`](self)).
    #[inline(always)]
    #[must_use]
    pub fn check_with(mut word: impl FnMut(usize) -> u64, key: [u64; 2]) -> Option<L2Resp> {
        let [k0, k1] = key;
        if word(0) != k0 || word(1) != k1 || word(2) != !k0 || word(3) != !k1 {
            return None;
        }
        // ifindex beside its complement, in memory order.
        let b = word(4).to_ne_bytes();
        let ifindex = u32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
        if u32::from_ne_bytes([b[4], b[5], b[6], b[7]]) != !ifindex {
            return None;
        }
        // The MAC and its two zero bytes, then their complement.
        let mac = word(5);
        if word(6) != !mac {
            return None;
        }
        let expires = word(7);
        if word(8) != !expires {
            return None;
        }
        let m = mac.to_ne_bytes();
        Some((ifindex, [m[0], m[1], m[2], m[3], m[4], m[5]], expires))
    }

    /// [`Self::check_with`] over a word-by-word copy.
    #[must_use]
    pub fn check(w: &[u32; Self::WORDS], addr: V6Addr) -> Option<L2Resp> {
        let pair = |i: usize| {
            let (a, b) = (w[2 * i].to_ne_bytes(), w[2 * i + 1].to_ne_bytes());
            u64::from_ne_bytes([a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]])
        };
        Self::check_with(pair, v6_words64(addr))
    }
}
