//! The one table of the maps the agent owns: for each, its name, which part
//! of the desired/observed [`MapContents`] it is, how it is read, how its keys are written
//! and shown, and how a diff is applied (a hash or trie written in place, a
//! slot array cleared before and filled after the hashes change).
//!
//! It exists so that reading, verify and reconcile walk the same list: a map
//! added here is read, checked and repaired, and none of them can forget one.
//! It is a leaf under both of its writers: the agent's verify and reconcile
//! walk the whole table, and the announcements (`crate::announce`) read and
//! write their four maps through the same entries under a lock of their
//! own, so neither imports the other for it. What a walk finds and does is
//! reported here too ([`Drift`], [`ReconcileReport`]): plain data.

use std::collections::BTreeMap;

use aya::maps::{MapData, MapError, lpm_trie::LpmTrie};
use ipnet::{Ipv4Net, Ipv6Net};
use lockstep_common::{V4Addr, V6Addr, map_names, max_entries};
pub use lockstep_core::plan::desired::MapContents;
use lockstep_core::plan::{diff, diff_sorted};
use serde::{Deserialize, Serialize};

use crate::datapath::{DatapathError, PinnedMaps, sys};
use io::{apply, clear_slots, drift, fill_slots, lpm_key_bytes, read_hash, read_slots};

mod io;

/// Why a map of the table could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum MapTableError {
    /// The map's pin could not be opened.
    #[error(transparent)]
    Datapath(#[from] DatapathError),
    /// Reading an LPM trie failed.
    #[error("reading map {map} failed")]
    Read {
        /// The map.
        map: &'static str,
        /// aya's error.
        #[source]
        source: Box<MapError>,
    },
    /// A batch syscall reading or writing the map failed.
    #[error("reconciling map {map} failed")]
    Reconcile {
        /// The map.
        map: &'static str,
        /// The syscall error.
        #[source]
        source: sys::SysError,
    },
}

/// One difference between what should be in a map and what is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Drift {
    /// The map.
    pub map: String,
    /// The key, printed.
    pub key: String,
    /// `missing`, `unexpected` or `different`.
    pub kind: String,
}

/// What a reconcile did.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReconcileReport {
    /// Entries written that were missing.
    pub added: usize,
    /// Entries rewritten because their value differed.
    pub updated: usize,
    /// Entries removed that nothing owns.
    pub removed: usize,
    /// Changes per map.
    pub per_map: BTreeMap<String, usize>,
    /// Wall time of the whole reconcile (plan, read, diff, write), µs.
    pub micros: u64,
}

impl ReconcileReport {
    /// Total changes.
    pub fn total(&self) -> usize {
        self.added + self.updated + self.removed
    }
}

/// One map in the table. Desired contents are computed for all maps at once
/// (the agent's `desired`); each entry picks its part.
pub(crate) trait MapSpec: Sync {
    /// The map's name (`lockstep_common::map_names`).
    fn name(&self) -> &'static str;
    /// Reads the map from its pin into its part of `into`.
    fn observe(&self, maps: &PinnedMaps, into: &mut MapContents) -> Result<(), MapTableError>;
    /// Adds the differences between `want` and `have` to `out`.
    fn drift(&self, want: &MapContents, have: &MapContents, out: &mut Vec<Drift>);
    /// Before any hash changes: clears the slots that go (slot arrays only).
    fn clear(&self, _: &PinnedMaps, _: &MapContents, _: &MapContents) -> Result<(), MapTableError> {
        Ok(())
    }
    /// Applies the diff to a hash or trie (slot arrays: nothing).
    fn apply(
        &self,
        _: &PinnedMaps,
        _: &MapContents,
        _: &MapContents,
        _: &mut ReconcileReport,
    ) -> Result<(), MapTableError> {
        Ok(())
    }
    /// After every hash changed: fills the slots that are new or differ.
    fn fill(
        &self,
        _: &PinnedMaps,
        _: &MapContents,
        _: &MapContents,
        _: &mut ReconcileReport,
    ) -> Result<(), MapTableError> {
        Ok(())
    }
    /// The number of desired entries, for the maps whose fill is reported
    /// in the agent's stats.
    fn counted(&self, _: &MapContents) -> Option<usize> {
        None
    }
}

/// A hash map held sorted by key.
struct Hash<K: 'static, V: 'static> {
    name: &'static str,
    part: fn(&MapContents) -> &[(K, V)],
    part_mut: fn(&mut MapContents) -> &mut Vec<(K, V)>,
    /// Appends the key's bytes (no allocation per key: a reconcile writes
    /// 100k of them).
    key: fn(&K, &mut Vec<u8>),
    show: fn(&K) -> String,
    counted: bool,
}

impl<K: sys::RawKey + Sync, V: aya::Pod + Clone + PartialEq + Sync> MapSpec for Hash<K, V> {
    fn name(&self) -> &'static str {
        self.name
    }
    fn observe(&self, maps: &PinnedMaps, into: &mut MapContents) -> Result<(), MapTableError> {
        *(self.part_mut)(into) = read_hash(maps, self.name)?;
        Ok(())
    }
    fn drift(&self, want: &MapContents, have: &MapContents, out: &mut Vec<Drift>) {
        let d = diff_sorted((self.part)(want), (self.part)(have));
        drift(self.name, &d, self.show, out);
    }
    fn apply(
        &self,
        maps: &PinnedMaps,
        want: &MapContents,
        have: &MapContents,
        report: &mut ReconcileReport,
    ) -> Result<(), MapTableError> {
        let d = diff_sorted((self.part)(want), (self.part)(have));
        apply(maps, self.name, &d, self.key, report)
    }
    fn counted(&self, want: &MapContents) -> Option<usize> {
        self.counted.then(|| (self.part)(want).len())
    }
}

/// An LPM trie keyed by prefix.
struct Trie<N: 'static, V: 'static> {
    name: &'static str,
    part: fn(&MapContents) -> &BTreeMap<N, V>,
    part_mut: fn(&mut MapContents) -> &mut BTreeMap<N, V>,
    read: fn(&PinnedMaps) -> Result<BTreeMap<N, V>, MapError>,
    /// Appends the key's bytes.
    key: fn(&N, &mut Vec<u8>),
}

impl<N: Ord + Clone + Sync + std::fmt::Display, V: aya::Pod + Clone + PartialEq + Sync> MapSpec
    for Trie<N, V>
{
    fn name(&self) -> &'static str {
        self.name
    }
    fn observe(&self, maps: &PinnedMaps, into: &mut MapContents) -> Result<(), MapTableError> {
        *(self.part_mut)(into) = (self.read)(maps).map_err(|e| MapTableError::Read {
            map: self.name,
            source: Box::new(e),
        })?;
        Ok(())
    }
    fn drift(&self, want: &MapContents, have: &MapContents, out: &mut Vec<Drift>) {
        let d = diff((self.part)(want), (self.part)(have));
        drift(self.name, &d, |n| n.to_string(), out);
    }
    fn apply(
        &self,
        maps: &PinnedMaps,
        want: &MapContents,
        have: &MapContents,
        report: &mut ReconcileReport,
    ) -> Result<(), MapTableError> {
        let d = diff((self.part)(want), (self.part)(have));
        apply(maps, self.name, &d, self.key, report)
    }
    fn counted(&self, want: &MapContents) -> Option<usize> {
        Some((self.part)(want).len())
    }
}

/// A slot array (mmapped), holding what a hash holds, by slot.
struct Slots<V: 'static> {
    name: &'static str,
    len: u32,
    part: fn(&MapContents) -> &[(u32, V)],
    part_mut: fn(&mut MapContents) -> &mut Vec<(u32, V)>,
}

impl<V: aya::Pod + Default + Clone + PartialEq + Sync> MapSpec for Slots<V> {
    fn name(&self) -> &'static str {
        self.name
    }
    fn observe(&self, maps: &PinnedMaps, into: &mut MapContents) -> Result<(), MapTableError> {
        *(self.part_mut)(into) = read_slots(maps, self.name, self.len)?;
        Ok(())
    }
    fn drift(&self, want: &MapContents, have: &MapContents, out: &mut Vec<Drift>) {
        let d = diff_sorted((self.part)(want), (self.part)(have));
        drift(self.name, &d, |k| format!("slot {k}"), out);
    }
    fn clear(
        &self,
        maps: &PinnedMaps,
        want: &MapContents,
        have: &MapContents,
    ) -> Result<(), MapTableError> {
        let d = diff_sorted((self.part)(want), (self.part)(have));
        clear_slots::<V>(maps, self.name, &d)
    }
    fn fill(
        &self,
        maps: &PinnedMaps,
        want: &MapContents,
        have: &MapContents,
        report: &mut ReconcileReport,
    ) -> Result<(), MapTableError> {
        let d = diff_sorted((self.part)(want), (self.part)(have));
        fill_slots(maps, self.name, &d, report)
    }
}

fn v4_key(k: &V4Addr, out: &mut Vec<u8>) {
    out.extend_from_slice(k);
}
fn v6_key(k: &V6Addr, out: &mut Vec<u8>) {
    out.extend_from_slice(k);
}
fn show_v4(k: &V4Addr) -> String {
    std::net::Ipv4Addr::from(*k).to_string()
}
fn show_v6(k: &V6Addr) -> String {
    std::net::Ipv6Addr::from(*k).to_string()
}
/// Every entry of an LPM trie keyed by an address of `N` bytes, as prefixes
/// (LPM tries have no batch lookup: aya's iteration).
fn read_trie<A, N, V>(
    trie: &LpmTrie<MapData, A, V>,
    prefix: fn(A, u8) -> Option<N>,
) -> Result<BTreeMap<N, V>, MapError>
where
    A: aya::Pod,
    N: Ord,
    V: aya::Pod,
{
    let mut out = BTreeMap::new();
    for item in trie.iter() {
        let (k, v) = item?;
        if let Some(n) = prefix(k.data(), k.prefix_len() as u8) {
            out.insert(n, v);
        }
    }
    Ok(out)
}
fn net_v4(a: V4Addr, len: u8) -> Option<Ipv4Net> {
    Ipv4Net::new(a.into(), len).ok()
}
fn net_v6(a: V6Addr, len: u8) -> Option<Ipv6Net> {
    Ipv6Net::new(a.into(), len).ok()
}
fn lpm_v4(n: &Ipv4Net, out: &mut Vec<u8>) {
    lpm_key_bytes(n.prefix_len(), &n.network().octets(), out);
}
fn lpm_v6(n: &Ipv6Net, out: &mut Vec<u8>) {
    lpm_key_bytes(n.prefix_len(), &n.network().octets(), out);
}

/// Every map the agent owns, in the order verify reports them and reconcile
/// writes them.
pub(crate) static MAPS: &[&dyn MapSpec] = &[
    &Hash {
        name: map_names::L2_RESP_V4,
        part: |c| &c.l2,
        part_mut: |c| &mut c.l2,
        key: v4_key,
        show: show_v4,
        counted: false,
    },
    &Hash {
        name: map_names::L2_RESP_V6,
        part: |c| &c.l2_v6,
        part_mut: |c| &mut c.l2_v6,
        key: v6_key,
        show: show_v6,
        counted: false,
    },
    &Hash {
        name: map_names::ENDPOINTS,
        part: |c| &c.endpoints,
        part_mut: |c| &mut c.endpoints,
        key: |k: &u32, out: &mut Vec<u8>| out.extend_from_slice(&k.to_ne_bytes()),
        show: |k: &u32| format!("ifindex {k}"),
        counted: false,
    },
    &Slots {
        name: map_names::ENDPOINT_SLOTS,
        len: max_entries::ENDPOINT_SLOTS,
        part: |c| &c.endpoint_slots,
        part_mut: |c| &mut c.endpoint_slots,
    },
    &Slots {
        name: map_names::L2_RESP_SLOTS,
        len: max_entries::L2_RESP_SLOTS,
        part: |c| &c.l2_slots,
        part_mut: |c| &mut c.l2_slots,
    },
    &Slots {
        name: map_names::L2_RESP6_SLOTS,
        len: max_entries::L2_RESP6_SLOTS,
        part: |c| &c.l2_v6_slots,
        part_mut: |c| &mut c.l2_v6_slots,
    },
    &Hash {
        name: map_names::IPCACHE_HOST_V4,
        part: |c| &c.host_v4,
        part_mut: |c| &mut c.host_v4,
        key: v4_key,
        show: show_v4,
        counted: true,
    },
    &Hash {
        name: map_names::IPCACHE_HOST_V6,
        part: |c| &c.host_v6,
        part_mut: |c| &mut c.host_v6,
        key: v6_key,
        show: show_v6,
        counted: true,
    },
    &Trie {
        name: map_names::IPCACHE_V4,
        part: |c| &c.prefix_v4,
        part_mut: |c| &mut c.prefix_v4,
        read: |m| read_trie(m.ipcache_v4(), net_v4),
        key: lpm_v4,
    },
    &Trie {
        name: map_names::IPCACHE_V6,
        part: |c| &c.prefix_v6,
        part_mut: |c| &mut c.prefix_v6,
        read: |m| read_trie(m.ipcache_v6(), net_v6),
        key: lpm_v6,
    },
    &Trie {
        name: map_names::MASQ_SKIP_V4,
        part: |c| &c.masq_v4,
        part_mut: |c| &mut c.masq_v4,
        read: |m| read_trie(m.masq_skip_v4(), net_v4),
        key: lpm_v4,
    },
    &Trie {
        name: map_names::MASQ_SKIP_V6,
        part: |c| &c.masq_v6,
        part_mut: |c| &mut c.masq_v6,
        read: |m| read_trie(m.masq_skip_v6(), net_v6),
        key: lpm_v6,
    },
];
