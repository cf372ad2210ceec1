//! The one table of the maps the agent owns: for each, its name, which part
//! of the desired/observed [`MapContents`] it is, how it is read, how its keys are written
//! and shown, and how a diff is applied (a hash or trie written in place, a
//! slot array cleared before and filled after the hashes change).
//!
//! It exists so that reading, verify and reconcile walk the same list: a map
//! added here is read, checked and repaired, and none of them can forget one.

use super::maps::{apply, clear_slots, drift, fill_slots, lpm_key_bytes, read_hash, read_slots};
use super::*;
use aya::maps::{MapData, MapError, lpm_trie::LpmTrie};

/// One map in the table. Desired contents are computed for all maps at once
/// (`Agent::desired`); each entry picks its part.
pub(super) trait MapSpec: Sync {
    /// The map's name (`lockstep_common::map_names`).
    fn name(&self) -> &'static str;
    /// Reads the map from its pin into its part of `into`.
    fn observe(&self, maps: &PinnedMaps, into: &mut MapContents) -> Result<(), AgentError>;
    /// Adds the differences between `want` and `have` to `out`.
    fn drift(&self, want: &MapContents, have: &MapContents, out: &mut Vec<Drift>);
    /// Before any hash changes: clears the slots that go (slot arrays only).
    fn clear(&self, _: &PinnedMaps, _: &MapContents, _: &MapContents) -> Result<(), AgentError> {
        Ok(())
    }
    /// Applies the diff to a hash or trie (slot arrays: nothing).
    fn apply(
        &self,
        _: &PinnedMaps,
        _: &MapContents,
        _: &MapContents,
        _: &mut ReconcileReport,
    ) -> Result<(), AgentError> {
        Ok(())
    }
    /// After every hash changed: fills the slots that are new or differ.
    fn fill(
        &self,
        _: &PinnedMaps,
        _: &MapContents,
        _: &MapContents,
        _: &mut ReconcileReport,
    ) -> Result<(), AgentError> {
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
    fn observe(&self, maps: &PinnedMaps, into: &mut MapContents) -> Result<(), AgentError> {
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
    ) -> Result<(), AgentError> {
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
    fn observe(&self, maps: &PinnedMaps, into: &mut MapContents) -> Result<(), AgentError> {
        *(self.part_mut)(into) = (self.read)(maps).map_err(|e| AgentError::Program {
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
    ) -> Result<(), AgentError> {
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
    fn observe(&self, maps: &PinnedMaps, into: &mut MapContents) -> Result<(), AgentError> {
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
    ) -> Result<(), AgentError> {
        let d = diff_sorted((self.part)(want), (self.part)(have));
        clear_slots::<V>(maps, self.name, &d)
    }
    fn fill(
        &self,
        maps: &PinnedMaps,
        want: &MapContents,
        have: &MapContents,
        report: &mut ReconcileReport,
    ) -> Result<(), AgentError> {
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
pub(super) static MAPS: &[&dyn MapSpec] = &[
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
