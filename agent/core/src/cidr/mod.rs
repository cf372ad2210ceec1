//! Per-CIDR address allocators.
//!
//! Every pool is a list of CIDRs, and each CIDR is handed out by one
//! [`CidrAllocator`]. This is the hot path of IPAM, so it exists as its own
//! small module with its own invariants and performance budget:
//!
//! - CIDRs up to [`CidrOptions::dense_limit`] addresses (2^24 by default) use a
//!   two-level-and-up free bitmap: one bit per address plus summary words, so
//!   "next free address" never scans linearly, even in an almost full /8.
//! - Larger CIDRs (an IPv6 /64) use a set of allocated runs whose memory grows
//!   with the allocations, not with the CIDR.
//! - Order is next-fit: the cursor moves forward past each allocation and
//!   wraps, so a just-released address is the last one to be handed out again.
//!   That gives stale state elsewhere (a conntrack entry, a peer's cache) the
//!   longest possible time to expire before the address is reused.
//! - The IPv4 network and broadcast addresses and the IPv6 subnet-router anycast
//!   address are never handed out unless the pool allows it
//!   ([`CidrOptions::allow_first_last`], e.g. cloud /28 prefixes). Point-to-point
//!   sizes (IPv4 /31 and /32, IPv6 /127 and /128) have no such addresses.
//! - Reserved addresses (gateways) are never handed out and are not counted in
//!   [`CidrAllocator::capacity`].
//!
//! Owners, generations and pools live above this module; here an address is
//! only free or used.

mod bitmap;
mod ranges;

use std::collections::BTreeSet;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use bitmap::FreeBitmap;
use ranges::RunSet;

/// Largest CIDR, in addresses, that gets a dense bitmap by default (a /8).
pub const DEFAULT_DENSE_LIMIT: u128 = 1 << 24;

/// Hard ceiling on [`CidrOptions::dense_limit`]: a bitmap of 2^32 bits is
/// 512 MiB, more than a node agent should ever hold for one CIDR.
pub const MAX_DENSE_LIMIT: u128 = 1 << 32;

/// An address family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Family {
    /// IPv4.
    #[serde(rename = "ipv4")]
    V4,
    /// IPv6.
    #[serde(rename = "ipv6")]
    V6,
}

impl Family {
    /// The family of an address.
    pub fn of_addr(addr: IpAddr) -> Family {
        match addr {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }

    /// The family of a CIDR.
    pub fn of_net(net: IpNet) -> Family {
        match net {
            IpNet::V4(_) => Family::V4,
            IpNet::V6(_) => Family::V6,
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Family::V4 => "ipv4",
            Family::V6 => "ipv6",
        })
    }
}

/// Errors of a single CIDR allocator.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CidrError {
    /// The CIDR has host bits set.
    #[error("invalid cidr {cidr}: host bits are set (the network is {network})")]
    HostBitsSet {
        /// The CIDR as given.
        cidr: IpNet,
        /// The same prefix with host bits cleared.
        network: IpNet,
    },
    /// The address is not inside the CIDR (or is of the other family).
    #[error("address {address} is outside {cidr}")]
    Outside {
        /// The address asked for.
        address: IpAddr,
        /// The allocator's CIDR.
        cidr: IpNet,
    },
    /// The address is the network, broadcast or subnet-router anycast address.
    #[error(
        "address {address} is the first or last address of {cidr}, which the pool does not allow"
    )]
    FirstOrLast {
        /// The address asked for.
        address: IpAddr,
        /// The allocator's CIDR.
        cidr: IpNet,
    },
    /// The address is reserved (a gateway).
    #[error("address {address} is reserved in {cidr}")]
    Reserved {
        /// The address asked for.
        address: IpAddr,
        /// The allocator's CIDR.
        cidr: IpNet,
    },
    /// The address is already allocated.
    #[error("address {address} in {cidr} is already allocated")]
    Taken {
        /// The address asked for.
        address: IpAddr,
        /// The allocator's CIDR.
        cidr: IpNet,
    },
    /// The address is not allocated, so it cannot be released.
    #[error("address {address} in {cidr} is not allocated")]
    NotAllocated {
        /// The address asked for.
        address: IpAddr,
        /// The allocator's CIDR.
        cidr: IpNet,
    },
    /// Every allocatable address is in use.
    #[error("cidr {cidr} is exhausted ({capacity} addresses)")]
    Exhausted {
        /// The allocator's CIDR.
        cidr: IpNet,
        /// Its capacity.
        capacity: u128,
    },
    /// A snapshot of another CIDR was given to [`CidrAllocator::restore`].
    #[error("snapshot of {snapshot} cannot be restored into {cidr}")]
    SnapshotMismatch {
        /// The allocator's CIDR.
        cidr: IpNet,
        /// The snapshot's CIDR.
        snapshot: IpNet,
    },
}

/// Checks that a CIDR is canonical (no host bits set).
///
/// # Errors
/// [`CidrError::HostBitsSet`] naming the CIDR and the network it probably meant.
pub fn validate_cidr(cidr: IpNet) -> Result<(), CidrError> {
    let network = cidr.trunc();
    if network == cidr {
        Ok(())
    } else {
        Err(CidrError::HostBitsSet { cidr, network })
    }
}

/// How a [`CidrAllocator`] is built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CidrOptions {
    /// Hand out the IPv4 network and broadcast addresses and the IPv6
    /// subnet-router anycast address too.
    pub allow_first_last: bool,
    /// CIDRs with at most this many addresses get a dense bitmap; larger ones
    /// the sparse run set. Clamped to [`MAX_DENSE_LIMIT`].
    pub dense_limit: u128,
}

impl Default for CidrOptions {
    fn default() -> Self {
        CidrOptions {
            allow_first_last: false,
            dense_limit: DEFAULT_DENSE_LIMIT,
        }
    }
}

/// Plain-data state of one [`CidrAllocator`], for persistence and tests.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CidrSnapshot {
    /// The CIDR.
    pub cidr: IpNet,
    /// Where the next-fit search starts.
    pub cursor: IpAddr,
    /// Allocated addresses, ascending.
    pub allocated: Vec<IpAddr>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Store {
    /// Index `i` is offset `first + i`.
    Dense(FreeBitmap),
    /// Holds offsets directly (used and reserved).
    Sparse(RunSet),
}

/// Allocator of the addresses of one CIDR. See the module documentation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CidrAllocator {
    cidr: IpNet,
    /// The network address as an integer; offsets are relative to it.
    base: u128,
    /// First allocatable offset.
    first: u128,
    /// Last allocatable offset (inclusive); `first <= last` always holds.
    last: u128,
    /// Reserved offsets within `first..=last`; marked used in the store.
    /// The reserved offsets it was made with ([`CidrAllocator::set_excluded`]
    /// withholds more on top of them, never fewer).
    base_reserved: BTreeSet<u128>,
    reserved: BTreeSet<u128>,
    /// Allocated addresses (reserved ones not counted).
    used: u128,
    /// Next-fit cursor, within `first..=last`.
    cursor: u128,
    store: Store,
    /// The offsets [`CidrAllocator::allocate_next`] may hand out (cluster
    /// mode's reservation window, #43); `None`: any.
    window: Option<BTreeSet<u128>>,
}

/// Offset of a CIDR's last address; fits even for `::/0`.
fn top_offset(cidr: IpNet) -> u128 {
    match cidr.max_prefix_len() - cidr.prefix_len() {
        0 => 0,
        host_bits => u128::MAX >> (128 - u32::from(host_bits)),
    }
}

fn addr_bits(addr: IpAddr) -> u128 {
    match addr {
        IpAddr::V4(a) => u128::from(u32::from(a)),
        IpAddr::V6(a) => u128::from(a),
    }
}

impl CidrAllocator {
    /// An allocator for `cidr` with nothing allocated. Reserved addresses
    /// outside the CIDR (or outside its allocatable range) are ignored, so a
    /// pool can pass its whole reserved list to each of its CIDRs.
    ///
    /// # Errors
    /// [`CidrError::HostBitsSet`] if `cidr` is not canonical.
    pub fn new(
        cidr: IpNet,
        options: CidrOptions,
        reserved: impl IntoIterator<Item = IpAddr>,
    ) -> Result<Self, CidrError> {
        validate_cidr(cidr)?;
        let host_bits = cidr.max_prefix_len() - cidr.prefix_len();
        let top = top_offset(cidr);
        let (first, last) = match cidr {
            _ if options.allow_first_last => (0, top),
            IpNet::V4(_) if host_bits >= 2 => (1, top - 1),
            IpNet::V6(_) if host_bits >= 2 => (1, top),
            _ => (0, top),
        };
        let base = addr_bits(cidr.network());
        let reserved: BTreeSet<u128> = reserved
            .into_iter()
            .filter(|a| cidr.contains(a))
            .map(|a| addr_bits(a) - base)
            .filter(|off| (first..=last).contains(off))
            .collect();
        let mut alloc = CidrAllocator {
            cidr,
            base,
            first,
            last,
            base_reserved: reserved.clone(),
            reserved,
            used: 0,
            cursor: first,
            store: Store::Sparse(RunSet::default()),
            window: None,
        };
        let span = last - first;
        if span < options.dense_limit.min(MAX_DENSE_LIMIT) {
            let len = usize::try_from(span + 1).expect("dense limit fits in usize");
            alloc.store = Store::Dense(FreeBitmap::all_free(len));
        }
        for off in alloc.reserved.clone() {
            alloc.store_take(off);
        }
        Ok(alloc)
    }

    /// The CIDR.
    pub fn cidr(&self) -> IpNet {
        self.cidr
    }

    /// The CIDR's family.
    pub fn family(&self) -> Family {
        Family::of_net(self.cidr)
    }

    /// Whether the dense bitmap store is used (as opposed to the sparse one).
    pub fn is_dense(&self) -> bool {
        matches!(self.store, Store::Dense(_))
    }

    /// Number of allocatable addresses: the CIDR minus excluded first/last
    /// addresses minus reserved ones. Saturates at `u128::MAX` (only for
    /// `::/0` with `allow_first_last`).
    pub fn capacity(&self) -> u128 {
        (self.last - self.first)
            .saturating_add(1)
            .saturating_sub(self.reserved.len() as u128)
    }

    /// Number of allocated addresses.
    pub fn used(&self) -> u128 {
        self.used
    }

    /// Number of free addresses: `capacity() - used()`.
    pub fn free(&self) -> u128 {
        self.capacity() - self.used
    }

    /// Whether `addr` is allocated.
    pub fn has(&self, addr: IpAddr) -> bool {
        self.offset_of(addr)
            .is_ok_and(|off| !self.store_is_free(off) && !self.reserved.contains(&off))
    }

    /// Whether `addr` is one of the reserved addresses.
    pub fn is_reserved(&self, addr: IpAddr) -> bool {
        self.cidr.contains(&addr) && self.reserved.contains(&(addr_bits(addr) - self.base))
    }

    /// Whether the first and last addresses are handed out.
    pub fn allows_first_last(&self) -> bool {
        self.first == 0 && self.last == top_offset(self.cidr)
    }

    /// The reserved addresses inside the allocatable range, ascending.
    pub fn reserved(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.reserved.iter().map(|&off| self.addr_at(off))
    }

    /// Withholds `excluded` (those inside the allocatable range) on top of
    /// the reserved addresses the allocator was made with: a free address
    /// listed is taken out of the free ones (and counts as reserved), one
    /// withheld before and no longer listed is free again, and an allocated
    /// one stays with its holder (a later call withholds it once free).
    /// Returns whether anything changed.
    pub fn set_excluded(&mut self, excluded: impl IntoIterator<Item = IpAddr>) -> bool {
        let mut want = self.base_reserved.clone();
        want.extend(excluded.into_iter().filter_map(|a| self.offset_of(a).ok()));
        let gone: Vec<u128> = self.reserved.difference(&want).copied().collect();
        let mut changed = !gone.is_empty();
        for off in gone {
            self.reserved.remove(&off);
            match &mut self.store {
                Store::Dense(map) => map.put((off - self.first) as usize),
                Store::Sparse(set) => set.remove(off),
            }
        }
        for off in want {
            if !self.reserved.contains(&off) && self.store_is_free(off) {
                self.store_take(off);
                self.reserved.insert(off);
                changed = true;
            }
        }
        changed
    }

    /// Limits what [`CidrAllocator::allocate_next`] hands out to `window`
    /// (those inside the allocatable range), or lifts the limit (`None`).
    /// Allocated addresses outside it stay with their holders.
    pub fn set_window(&mut self, window: Option<&BTreeSet<IpAddr>>) {
        self.window = window.map(|w| w.iter().filter_map(|a| self.offset_of(*a).ok()).collect());
    }

    /// Whether a window limits this allocator.
    pub fn windowed(&self) -> bool {
        self.window.is_some()
    }

    /// Whether `addr` may be handed out under the window (always without
    /// one).
    pub fn in_window(&self, addr: IpAddr) -> bool {
        match &self.window {
            None => true,
            Some(w) => self.offset_of(addr).is_ok_and(|off| w.contains(&off)),
        }
    }

    /// How many addresses [`CidrAllocator::allocate_next`] can still hand
    /// out: the free ones, inside the window when there is one.
    pub fn available(&self) -> u128 {
        match &self.window {
            None => self.free(),
            Some(w) => w.iter().filter(|off| self.store_is_free(**off)).count() as u128,
        }
    }

    /// The free addresses of the window, in the order
    /// [`CidrAllocator::allocate_next`] hands them out (none without one).
    pub fn free_in_window(&self) -> Vec<IpAddr> {
        let Some(w) = &self.window else {
            return Vec::new();
        };
        w.range(self.cursor..)
            .chain(w.range(..self.cursor))
            .filter(|off| self.store_is_free(**off))
            .map(|off| self.addr_at(*off))
            .collect()
    }

    /// Up to `n` free addresses outside the window, in the order the
    /// allocator would hand them out next without one (from the cursor,
    /// wrapping around).
    pub fn next_free_outside_window(&self, n: usize) -> Vec<IpAddr> {
        let mut out = Vec::new();
        let outside = |off: u128| self.window.as_ref().is_none_or(|w| !w.contains(&off));
        let scan = |from: u128, to: u128, out: &mut Vec<IpAddr>| {
            let mut at = from;
            while out.len() < n && at <= to {
                let next = match &self.store {
                    Store::Dense(map) => map
                        .next_free((at - self.first) as usize)
                        .map(|i| self.first + i as u128)
                        .filter(|off| *off <= to),
                    Store::Sparse(set) => set.next_free(at, to),
                };
                let Some(off) = next else { break };
                if outside(off) {
                    out.push(self.addr_at(off));
                }
                if off == u128::MAX {
                    break;
                }
                at = off + 1;
            }
        };
        scan(self.cursor, self.last, &mut out);
        if self.cursor > self.first {
            scan(self.first, self.cursor - 1, &mut out);
        }
        out
    }

    /// The address where the next-fit search starts.
    pub fn cursor(&self) -> IpAddr {
        self.addr_at(self.cursor)
    }

    /// Allocates the next free address after the cursor, wrapping around.
    ///
    /// # Errors
    /// [`CidrError::Exhausted`] when no address is free.
    #[inline]
    pub fn allocate_next(&mut self) -> Result<IpAddr, CidrError> {
        if let Some(w) = &self.window {
            let off = w
                .range(self.cursor..)
                .chain(w.range(..self.cursor))
                .copied()
                .find(|off| self.store_is_free(*off))
                .ok_or(CidrError::Exhausted {
                    cidr: self.cidr,
                    capacity: self.capacity(),
                })?;
            self.take(off);
            return Ok(self.addr_at(off));
        }
        let off = match &self.store {
            Store::Dense(map) => {
                let from = (self.cursor - self.first) as usize;
                map.next_free(from)
                    .or_else(|| map.next_free(0))
                    .map(|i| self.first + i as u128)
            }
            Store::Sparse(set) => set
                .next_free(self.cursor, self.last)
                .or_else(|| set.next_free(self.first, self.last)),
        }
        .ok_or(CidrError::Exhausted {
            cidr: self.cidr,
            capacity: self.capacity(),
        })?;
        self.take(off);
        Ok(self.addr_at(off))
    }

    /// Allocates a specific address. The cursor does not move: asking for an
    /// address does not change the order in which the others are handed out.
    ///
    /// # Errors
    /// [`CidrError::Outside`], [`CidrError::FirstOrLast`],
    /// [`CidrError::Reserved`] or [`CidrError::Taken`].
    pub fn allocate(&mut self, addr: IpAddr) -> Result<(), CidrError> {
        let off = self.offset_of(addr)?;
        if !self.store_is_free(off) {
            return Err(self.used_error(
                off,
                addr,
                CidrError::Taken {
                    address: addr,
                    cidr: self.cidr,
                },
            ));
        }
        self.store_take(off);
        self.used += 1;
        Ok(())
    }

    /// Frees an allocated address.
    ///
    /// # Errors
    /// [`CidrError::Outside`], [`CidrError::FirstOrLast`],
    /// [`CidrError::Reserved`] or [`CidrError::NotAllocated`].
    #[inline]
    pub fn release(&mut self, addr: IpAddr) -> Result<(), CidrError> {
        let off = self.offset_of(addr)?;
        if self.store_is_free(off) {
            return Err(CidrError::NotAllocated {
                address: addr,
                cidr: self.cidr,
            });
        }
        if self.reserved.contains(&off) {
            return Err(CidrError::Reserved {
                address: addr,
                cidr: self.cidr,
            });
        }
        match &mut self.store {
            Store::Dense(map) => map.put((off - self.first) as usize),
            Store::Sparse(set) => set.remove(off),
        }
        self.used -= 1;
        Ok(())
    }

    /// Iterates over the allocated addresses in ascending order.
    pub fn allocated(&self) -> Box<dyn Iterator<Item = IpAddr> + '_> {
        let offsets: Box<dyn Iterator<Item = u128> + '_> = match &self.store {
            Store::Dense(map) => Box::new(map.used().map(|i| self.first + i as u128)),
            Store::Sparse(set) => Box::new(set.iter()),
        };
        Box::new(
            offsets
                .filter(|off| !self.reserved.contains(off))
                .map(|off| self.addr_at(off)),
        )
    }

    /// Plain-data copy of the state.
    pub fn snapshot(&self) -> CidrSnapshot {
        CidrSnapshot {
            cidr: self.cidr,
            cursor: self.cursor(),
            allocated: self.allocated().collect(),
        }
    }

    /// Replaces the state with a snapshot's. On error nothing changes.
    ///
    /// # Errors
    /// [`CidrError::SnapshotMismatch`] for another CIDR, or the error of the
    /// first address (or cursor) that cannot be allocated.
    pub fn restore(&mut self, snapshot: &CidrSnapshot) -> Result<(), CidrError> {
        if snapshot.cidr != self.cidr {
            return Err(CidrError::SnapshotMismatch {
                cidr: self.cidr,
                snapshot: snapshot.cidr,
            });
        }
        let mut fresh = self.cleared();
        for &addr in &snapshot.allocated {
            fresh.allocate(addr)?;
        }
        fresh.set_cursor(snapshot.cursor)?;
        *self = fresh;
        Ok(())
    }

    /// Moves the next-fit cursor (used by exact restores).
    ///
    /// # Errors
    /// [`CidrError::Outside`] or [`CidrError::FirstOrLast`] if the cursor is
    /// not an allocatable position.
    pub fn set_cursor(&mut self, cursor: IpAddr) -> Result<(), CidrError> {
        self.cursor = self.offset_of(cursor)?;
        Ok(())
    }

    /// Heap bytes held by the store (excluding reserved addresses), an
    /// estimate for the sparse store (B-tree nodes are not exposed).
    pub fn heap_bytes(&self) -> usize {
        match &self.store {
            Store::Dense(map) => map.heap_bytes(),
            // A B-tree leaf holds up to 11 entries of 32 bytes plus ~100 bytes
            // of header; assume nodes are two-thirds full.
            Store::Sparse(set) => set.runs() * (32 * 3 / 2 + 16),
        }
    }

    /// Same CIDR, options and reservations, nothing allocated.
    fn cleared(&self) -> CidrAllocator {
        let mut alloc = CidrAllocator {
            used: 0,
            cursor: self.first,
            store: match &self.store {
                Store::Dense(map) => Store::Dense(FreeBitmap::all_free(map.len())),
                Store::Sparse(_) => Store::Sparse(RunSet::default()),
            },
            reserved: self.reserved.clone(),
            base_reserved: self.base_reserved.clone(),
            window: self.window.clone(),
            ..*self
        };
        for off in self.reserved.iter().copied() {
            alloc.store_take(off);
        }
        alloc
    }

    fn addr_at(&self, off: u128) -> IpAddr {
        let bits = self.base + off;
        match self.cidr {
            IpNet::V4(_) => IpAddr::V4(Ipv4Addr::from(bits as u32)),
            IpNet::V6(_) => IpAddr::V6(Ipv6Addr::from(bits)),
        }
    }

    /// Offset of an allocatable position (reserved ones included).
    fn offset_of(&self, addr: IpAddr) -> Result<u128, CidrError> {
        if !self.cidr.contains(&addr) {
            return Err(CidrError::Outside {
                address: addr,
                cidr: self.cidr,
            });
        }
        let off = addr_bits(addr) - self.base;
        if off < self.first || off > self.last {
            return Err(CidrError::FirstOrLast {
                address: addr,
                cidr: self.cidr,
            });
        }
        Ok(off)
    }

    /// Picks `Reserved` over `fallback` for a used offset.
    fn used_error(&self, off: u128, addr: IpAddr, fallback: CidrError) -> CidrError {
        if self.reserved.contains(&off) {
            CidrError::Reserved {
                address: addr,
                cidr: self.cidr,
            }
        } else {
            fallback
        }
    }

    #[inline]
    fn store_is_free(&self, off: u128) -> bool {
        match &self.store {
            Store::Dense(map) => map.is_free((off - self.first) as usize),
            Store::Sparse(set) => !set.contains(off),
        }
    }

    #[inline]
    fn store_take(&mut self, off: u128) {
        match &mut self.store {
            Store::Dense(map) => map.take((off - self.first) as usize),
            Store::Sparse(set) => set.insert(off),
        }
    }

    /// Takes a free offset found by the search and advances the cursor.
    #[inline]
    fn take(&mut self, off: u128) {
        self.store_take(off);
        self.used += 1;
        self.cursor = if off == self.last {
            self.first
        } else {
            off + 1
        };
    }
}

#[cfg(test)]
mod tests;
