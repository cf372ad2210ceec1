//! Desired datapath contents, and the minimal change to reach them.
//!
//! The agent never programs a BPF map entry by entry as events happen, and
//! never flushes a map. Instead the core derives, from allocations and pools
//! alone, what IPCACHE and MASQ_SKIP *should* contain ([`DatapathPlan`]), and
//! [`diff`] compares that with what the kernel holds. The daemon applies only
//! the difference. The same path serves start-up (reconcile after restore),
//! every change (a pool's `skip_masquerade` flag flipping re-derives entries
//! for existing endpoints too) and drift repair (an entry deleted by hand with
//! bpftool shows up as an add).
//!
//! Keys are LPM prefixes as [`ipnet`] types with host bits zeroed (see
//! [`LpmKey`]): the kernel's LPM trie treats `10.0.0.1/24` and `10.0.0.0/24`
//! as the same entry, so observed keys must be canonicalised ([`canonicalize`])
//! before diffing or the diff would chase a phantom difference forever.

use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use lockstep_common::{IpcacheValue, MasqSkipValue, V6Addr, identity, ipcache_flags, masq_reason};

use crate::manager::{Allocation, PoolManager, PoolSource};
use crate::owner::{AgentRole, Owner};

/// Errors while building a plan.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// Two allocations (from different managers) claim one address.
    #[error("address {address} is allocated to both {first} and {second}")]
    DuplicateAddress {
        /// The address.
        address: IpAddr,
        /// The owner added first (boxed: keeps `Result`s small).
        first: Box<Owner>,
        /// The owner added second.
        second: Box<Owner>,
    },
}

/// A prefix usable as an LPM trie key.
pub trait LpmKey: Ord + Copy {
    /// The same prefix with host bits zeroed.
    fn canonical(self) -> Self;
}

impl LpmKey for Ipv4Net {
    fn canonical(self) -> Self {
        self.trunc()
    }
}

impl LpmKey for Ipv6Net {
    fn canonical(self) -> Self {
        self.trunc()
    }
}

/// Identity and IPCACHE flags for an owner kind, or `None` for owners that
/// have no datapath meaning ([`Owner::Resource`]). A delegated address is an
/// endpoint interface whose address came from an external plugin, so it is an
/// endpoint to the datapath.
pub fn classify(owner: &Owner) -> Option<(u32, u32)> {
    Some(match owner {
        Owner::Endpoint { .. } | Owner::Delegated { .. } => {
            (identity::ENDPOINT, ipcache_flags::ENDPOINT)
        }
        Owner::Agent {
            role: AgentRole::Ingress,
        } => (identity::INGRESS, ipcache_flags::INGRESS),
        Owner::Agent {
            role: AgentRole::Health,
        } => (identity::HEALTH, ipcache_flags::HEALTH),
        Owner::Agent {
            role: AgentRole::Router,
        } => (identity::ROUTER, ipcache_flags::ROUTER),
        Owner::LoadBalancer { .. } => (identity::LOADBALANCER, ipcache_flags::LOADBALANCER),
        Owner::Resource { .. } => return None,
    })
}

/// Per-allocation data the core does not know, supplied by the caller
/// (typically from its endpoint records).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EntryExtra {
    /// Host-side interface of a local endpoint, 0 otherwise.
    pub ifindex: u32,
    /// Address of the node hosting a remote prefix, zero for local ones.
    pub node_addr: V6Addr,
}

impl EntryExtra {
    /// The IPCACHE value of an allocation classified as (`identity`, `flags`).
    pub fn value(self, identity: u32, flags: u32) -> IpcacheValue {
        IpcacheValue {
            identity,
            flags,
            ifindex: self.ifindex,
            _pad: 0,
            node_addr: self.node_addr,
        }
    }
}

/// Desired contents of the IPCACHE and MASQ_SKIP maps. Plain data.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DatapathPlan {
    /// IPCACHE_V4.
    pub ipcache_v4: BTreeMap<Ipv4Net, IpcacheValue>,
    /// IPCACHE_V6.
    pub ipcache_v6: BTreeMap<Ipv6Net, IpcacheValue>,
    /// MASQ_SKIP_V4.
    pub masq_skip_v4: BTreeMap<Ipv4Net, MasqSkipValue>,
    /// MASQ_SKIP_V6.
    pub masq_skip_v6: BTreeMap<Ipv6Net, MasqSkipValue>,
}

impl DatapathPlan {
    /// The plan of one manager: IPCACHE entries for its allocations, MASQ_SKIP
    /// entries for its pools under its masquerade rule, plus the configured
    /// non-masquerade CIDRs. Several managers are combined with
    /// [`PlanBuilder`].
    ///
    /// # Errors
    /// See [`PlanBuilder::allocations`].
    pub fn from_manager<S: PoolSource>(
        manager: &PoolManager<S>,
        non_masquerade: impl IntoIterator<Item = IpNet>,
        extra: impl Fn(&Allocation) -> EntryExtra,
    ) -> Result<DatapathPlan, PlanError> {
        let mut b = PlanBuilder::default();
        b.manager(manager, extra)?;
        b.masq_skip(non_masquerade, masq_reason::CONFIG, 0);
        Ok(b.finish())
    }
}

/// Accumulates a [`DatapathPlan`] from several managers and config.
#[derive(Clone, Debug, Default)]
pub struct PlanBuilder {
    plan: DatapathPlan,
    owners: BTreeMap<IpAddr, Owner>,
}

impl PlanBuilder {
    /// Adds one manager's allocations and masquerade contribution.
    ///
    /// # Errors
    /// See [`PlanBuilder::allocations`].
    pub fn manager<S: PoolSource>(
        &mut self,
        manager: &PoolManager<S>,
        extra: impl Fn(&Allocation) -> EntryExtra,
    ) -> Result<&mut Self, PlanError> {
        self.allocations(manager.allocations(), extra)?;
        for (cidr, pool_id) in manager.masq_skip_cidrs() {
            self.masq_skip([cidr], masq_reason::POOL, pool_id);
        }
        Ok(self)
    }

    /// Adds a host-prefix IPCACHE entry per allocation, identity and flags by
    /// owner kind ([`classify`]), `extra` looked up per allocation.
    ///
    /// # Errors
    /// [`PlanError::DuplicateAddress`] if an address was already added for
    /// another owner.
    pub fn allocations<'a>(
        &mut self,
        allocations: impl IntoIterator<Item = &'a Allocation>,
        extra: impl Fn(&Allocation) -> EntryExtra,
    ) -> Result<&mut Self, PlanError> {
        for a in allocations {
            let Some((identity, flags)) = classify(&a.owner) else {
                continue;
            };
            if let Some(first) = self.owners.get(&a.address)
                && *first != a.owner
            {
                return Err(PlanError::DuplicateAddress {
                    address: a.address,
                    first: Box::new(first.clone()),
                    second: Box::new(a.owner.clone()),
                });
            }
            self.owners.insert(a.address, a.owner.clone());
            let value = extra(a).value(identity, flags);
            match a.address {
                IpAddr::V4(addr) => {
                    self.plan.ipcache_v4.insert(Ipv4Net::from(addr), value);
                }
                IpAddr::V6(addr) => {
                    self.plan.ipcache_v6.insert(Ipv6Net::from(addr), value);
                }
            }
        }
        Ok(self)
    }

    /// Adds MASQ_SKIP entries (canonicalised). When two sources name the same
    /// prefix, the lower reason wins (pool over config over cluster), then the
    /// lower pool id, so the result does not depend on call order.
    pub fn masq_skip(
        &mut self,
        cidrs: impl IntoIterator<Item = IpNet>,
        reason: u32,
        pool_id: u32,
    ) -> &mut Self {
        let value = MasqSkipValue { reason, pool_id };
        for cidr in cidrs {
            match cidr {
                IpNet::V4(n) => keep_min(&mut self.plan.masq_skip_v4, n.canonical(), value),
                IpNet::V6(n) => keep_min(&mut self.plan.masq_skip_v6, n.canonical(), value),
            }
        }
        self
    }

    /// The plan.
    pub fn finish(self) -> DatapathPlan {
        self.plan
    }
}

fn keep_min<K: Ord>(map: &mut BTreeMap<K, MasqSkipValue>, key: K, value: MasqSkipValue) {
    let rank = |v: &MasqSkipValue| (v.reason, v.pool_id);
    map.entry(key)
        .and_modify(|old| {
            if rank(&value) < rank(old) {
                *old = value;
            }
        })
        .or_insert(value);
}

/// Collects observed LPM entries with canonical keys (host bits zeroed). If
/// two observed keys collapse into one, the later value is kept; the kernel
/// never holds both.
pub fn canonicalize<K: LpmKey, V>(observed: impl IntoIterator<Item = (K, V)>) -> BTreeMap<K, V> {
    observed
        .into_iter()
        .map(|(k, v)| (k.canonical(), v))
        .collect()
}

/// The minimal change turning an observed map into a desired one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapDiff<K, V> {
    /// Keys missing from the observed map.
    pub add: Vec<(K, V)>,
    /// Keys present in both with a different value.
    pub update: Vec<(K, V)>,
    /// Keys not desired.
    pub delete: Vec<K>,
}

impl<K, V> Default for MapDiff<K, V> {
    fn default() -> Self {
        MapDiff {
            add: Vec::new(),
            update: Vec::new(),
            delete: Vec::new(),
        }
    }
}

impl<K: Ord + Clone, V: Clone> MapDiff<K, V> {
    /// Whether nothing needs to change.
    pub fn is_empty(&self) -> bool {
        self.add.is_empty() && self.update.is_empty() && self.delete.is_empty()
    }

    /// Number of operations.
    pub fn len(&self) -> usize {
        self.add.len() + self.update.len() + self.delete.len()
    }

    /// Applies the diff to an in-memory map (for tests and in-memory
    /// datapath doubles).
    pub fn apply(&self, map: &mut BTreeMap<K, V>) {
        for k in &self.delete {
            map.remove(k);
        }
        for (k, v) in self.add.iter().chain(&self.update) {
            map.insert(k.clone(), v.clone());
        }
    }
}

/// Compares desired and observed contents in one ordered pass
/// (`O(n + m)`); keys come out sorted in each list.
pub fn diff<K: Ord + Clone, V: PartialEq + Clone>(
    desired: &BTreeMap<K, V>,
    observed: &BTreeMap<K, V>,
) -> MapDiff<K, V> {
    merge(desired.iter(), observed.iter())
}

/// [`diff`] over slices sorted by key with unique keys, as read in bulk from
/// a hash map and sorted: no tree is built, which matters at 100k entries.
///
/// # Panics
/// Debug builds check that both slices are sorted with unique keys.
pub fn diff_sorted<K: Ord + Clone, V: PartialEq + Clone>(
    desired: &[(K, V)],
    observed: &[(K, V)],
) -> MapDiff<K, V> {
    debug_assert!(
        desired.windows(2).all(|w| w[0].0 < w[1].0),
        "desired not sorted"
    );
    debug_assert!(
        observed.windows(2).all(|w| w[0].0 < w[1].0),
        "observed not sorted"
    );
    merge(
        desired.iter().map(|(k, v)| (k, v)),
        observed.iter().map(|(k, v)| (k, v)),
    )
}

fn merge<'a, K: Ord + Clone + 'a, V: PartialEq + Clone + 'a>(
    desired: impl Iterator<Item = (&'a K, &'a V)>,
    observed: impl Iterator<Item = (&'a K, &'a V)>,
) -> MapDiff<K, V> {
    let mut out = MapDiff::default();
    // Room for the common large diffs (a restart into empty maps: all adds;
    // a pool emptied: all deletes) without growing 100k-entry vectors.
    let (nd, no) = (desired.size_hint().0, observed.size_hint().0);
    out.add.reserve(nd.saturating_sub(no));
    out.delete.reserve(no.saturating_sub(nd));
    let mut d = desired.peekable();
    let mut o = observed.peekable();
    loop {
        let order = match (d.peek(), o.peek()) {
            (None, None) => break,
            (Some(_), None) => Ordering::Less,
            (None, Some(_)) => Ordering::Greater,
            (Some((dk, _)), Some((ok, _))) => dk.cmp(ok),
        };
        match order {
            Ordering::Less => {
                let (k, v) = d.next().expect("peeked");
                out.add.push((k.clone(), v.clone()));
            }
            Ordering::Greater => {
                let (k, _) = o.next().expect("peeked");
                out.delete.push(k.clone());
            }
            Ordering::Equal => {
                let (k, dv) = d.next().expect("peeked");
                let (_, ov) = o.next().expect("peeked");
                if dv != ov {
                    out.update.push((k.clone(), dv.clone()));
                }
            }
        }
    }
    out
}

/// IPCACHE host entries (/32 and /128) of a set of allocations, sorted by
/// address: the flat form of what [`PlanBuilder::allocations`] puts in the
/// plan, for the host hash maps. Built without trees or owner clones, so a
/// reconcile of 100k allocations is dominated by the map syscalls.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostEntries {
    /// IPv4 address → value, sorted, unique.
    pub v4: Vec<(lockstep_common::V4Addr, IpcacheValue)>,
    /// IPv6 address → value, sorted, unique.
    pub v6: Vec<(V6Addr, IpcacheValue)>,
}

/// Builds [`HostEntries`] with identity and flags by owner kind ([`classify`])
/// and `extra` looked up per allocation.
///
/// # Errors
/// [`PlanError::DuplicateAddress`] if two different owners hold one address.
pub fn host_entries<'a>(
    allocations: impl IntoIterator<Item = &'a Allocation>,
    extra: impl Fn(&Allocation) -> EntryExtra,
) -> Result<HostEntries, PlanError> {
    let allocations = allocations.into_iter();
    // Sized once (most nodes hold one family): 100k pushes would otherwise
    // regrow and copy the vector ~17 times.
    let most = allocations.size_hint();
    let mut v4: Vec<(lockstep_common::V4Addr, IpcacheValue, &Owner)> =
        Vec::with_capacity(most.1.unwrap_or(most.0));
    let mut v6: Vec<(V6Addr, IpcacheValue, &Owner)> = Vec::new();
    for a in allocations {
        let Some((identity, flags)) = classify(&a.owner) else {
            continue;
        };
        let value = extra(a).value(identity, flags);
        match a.address {
            IpAddr::V4(addr) => v4.push((addr.octets(), value, &a.owner)),
            IpAddr::V6(addr) => v6.push((addr.octets(), value, &a.owner)),
        }
    }
    fn finish<K: Ord + Copy + Into<IpAddr>>(
        mut entries: Vec<(K, IpcacheValue, &Owner)>,
    ) -> Result<Vec<(K, IpcacheValue)>, PlanError> {
        entries.sort_unstable_by_key(|e| e.0);
        if let Some(w) = entries
            .windows(2)
            .find(|w| w[0].0 == w[1].0 && w[0].2 != w[1].2)
        {
            return Err(PlanError::DuplicateAddress {
                address: w[0].0.into(),
                first: Box::new(w[0].2.clone()),
                second: Box::new(w[1].2.clone()),
            });
        }
        entries.dedup_by(|a, b| a.0 == b.0);
        Ok(entries.into_iter().map(|(k, v, _)| (k, v)).collect())
    }
    Ok(HostEntries {
        v4: finish(v4)?,
        v6: finish(v6)?,
    })
}

/// The contents of a direct-mapped slot array in front of a hash map (see
/// `lockstep_common::slots`): for each slot, the entry with the smallest key
/// among those that `slot_of` maps to it. `entries` must be sorted by key
/// with unique keys (as [`diff_sorted`] wants them). Returns `(slot, key,
/// value)` sorted by slot; slots no key maps to are absent (empty).
///
/// Deterministic in the entries alone, so a restarted agent derives the same
/// slots and a reconcile finds nothing to change. A key that loses its slot
/// to a smaller one is still found: programs fall back to the hash.
///
/// # Panics
/// Debug builds check that `entries` is sorted with unique keys.
pub fn direct_mapped<K: Ord + Copy, V: Copy>(
    entries: &[(K, V)],
    slot_of: impl Fn(&K) -> u32,
) -> Vec<(u32, K, V)> {
    debug_assert!(
        entries.windows(2).all(|w| w[0].0 < w[1].0),
        "entries not sorted"
    );
    let mut out: Vec<(u32, K, V)> = entries.iter().map(|&(k, v)| (slot_of(&k), k, v)).collect();
    // Stable: within a slot the smallest key stays first.
    out.sort_by_key(|e| e.0);
    out.dedup_by_key(|e| e.0);
    out
}

/// The entry a slot should hold: [`direct_mapped`] for the one slot `slot`,
/// over entries in any order. For incremental updates of one slot.
pub fn slot_holder<K: Ord + Copy, V: Copy>(
    entries: impl IntoIterator<Item = (K, V)>,
    slot: u32,
    slot_of: impl Fn(&K) -> u32,
) -> Option<(K, V)> {
    entries
        .into_iter()
        .filter(|(k, _)| slot_of(k) == slot)
        .min_by_key(|(k, _)| *k)
}

pub mod desired;

#[cfg(test)]
mod tests;
