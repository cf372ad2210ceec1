//! The one table of the maps the agent owns: for each, its name, which part
//! of the desired/observed [`MapContents`] it is, how its keys are written
//! and shown, and how a diff is applied (a hash or trie written in place, a
//! slot array cleared before and filled after the hashes change).
//!
//! It exists so that verify and reconcile walk the same list: a map added
//! here is both checked and repaired, and neither can forget one.

use super::maps::{apply, clear_slots, drift, fill_slots, lpm_key_bytes};
use super::*;

/// One map in the table. Desired contents are computed for all maps at once
/// (`Agent::desired`); each entry picks its part.
pub(super) trait MapSpec: Sync {
    /// The map's name (`lockstep_common::map_names`).
    fn name(&self) -> &'static str;
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
    key: fn(&K) -> Vec<u8>,
    show: fn(&K) -> String,
    counted: bool,
}

impl<K: Ord + Clone + Sync, V: aya::Pod + Clone + PartialEq + Sync> MapSpec for Hash<K, V> {
    fn name(&self) -> &'static str {
        self.name
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
    key: fn(&N) -> Vec<u8>,
}

impl<N: Ord + Clone + Sync + std::fmt::Display, V: aya::Pod + Clone + PartialEq + Sync> MapSpec
    for Trie<N, V>
{
    fn name(&self) -> &'static str {
        self.name
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
    part: fn(&MapContents) -> &[(u32, V)],
}

impl<V: aya::Pod + Default + Clone + PartialEq + Sync> MapSpec for Slots<V> {
    fn name(&self) -> &'static str {
        self.name
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

fn v4_key(k: &V4Addr) -> Vec<u8> {
    k.to_vec()
}
fn v6_key(k: &V6Addr) -> Vec<u8> {
    k.to_vec()
}
fn show_v4(k: &V4Addr) -> String {
    std::net::Ipv4Addr::from(*k).to_string()
}
fn show_v6(k: &V6Addr) -> String {
    std::net::Ipv6Addr::from(*k).to_string()
}
fn lpm_v4(n: &Ipv4Net) -> Vec<u8> {
    lpm_key_bytes(n.prefix_len(), &n.network().octets())
}
fn lpm_v6(n: &Ipv6Net) -> Vec<u8> {
    lpm_key_bytes(n.prefix_len(), &n.network().octets())
}

/// Every map the agent owns, in the order verify reports them and reconcile
/// writes them.
pub(super) static MAPS: &[&dyn MapSpec] = &[
    &Hash {
        name: map_names::L2_RESP_V4,
        part: |c| &c.l2,
        key: v4_key,
        show: show_v4,
        counted: false,
    },
    &Hash {
        name: map_names::ENDPOINTS,
        part: |c| &c.endpoints,
        key: |k: &u32| k.to_ne_bytes().to_vec(),
        show: |k: &u32| format!("ifindex {k}"),
        counted: false,
    },
    &Slots {
        name: map_names::ENDPOINT_SLOTS,
        part: |c| &c.endpoint_slots,
    },
    &Slots {
        name: map_names::L2_RESP_SLOTS,
        part: |c| &c.l2_slots,
    },
    &Hash {
        name: map_names::IPCACHE_HOST_V4,
        part: |c| &c.host_v4,
        key: v4_key,
        show: show_v4,
        counted: true,
    },
    &Hash {
        name: map_names::IPCACHE_HOST_V6,
        part: |c| &c.host_v6,
        key: v6_key,
        show: show_v6,
        counted: true,
    },
    &Trie {
        name: map_names::IPCACHE_V4,
        part: |c| &c.prefix_v4,
        key: lpm_v4,
    },
    &Trie {
        name: map_names::IPCACHE_V6,
        part: |c| &c.prefix_v6,
        key: lpm_v6,
    },
    &Trie {
        name: map_names::MASQ_SKIP_V4,
        part: |c| &c.masq_v4,
        key: lpm_v4,
    },
    &Trie {
        name: map_names::MASQ_SKIP_V6,
        part: |c| &c.masq_v6,
        key: lpm_v6,
    },
];
