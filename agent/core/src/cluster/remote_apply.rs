//! A change of the remote state as map writes. When the remote view moves
//! from one state to the next, the agent writes only the entries that
//! changed, in place of a whole reconcile: a reconcile reads every map,
//! work in proportion to the cluster, where this is in proportion to the
//! change. A local entry wins over a remote one for the same key, as in
//! [`RemoteState::merge_into`], so a changed key the node itself holds is
//! left alone. The periodic reconcile still repairs whatever drifted.

use std::collections::BTreeMap;

use imbl::OrdMap;
use imbl::ordmap::DiffItem;

use super::remote::RemoteState;
use crate::plan::desired::MapContents;

/// The entries a remote change touches, restricted to its keys: what
/// they should hold (`want`) and what the maps hold for them now
/// (`have`), the inputs of the map table's diff-and-apply.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RemoteWrites {
    /// The changed keys' new values (a removed key is absent).
    pub want: MapContents,
    /// The changed keys' old values (a new key is absent).
    pub have: MapContents,
}

impl RemoteWrites {
    /// Whether the change touches no entry.
    pub fn is_empty(&self) -> bool {
        self.want == MapContents::default() && self.have == MapContents::default()
    }
}

/// What changes in the maps when the remote state moves from `old` to
/// `new`, with `local` the maps' desired contents without any remote
/// entry. Visits only the parts of the two states they do not share:
/// for a `new` made from `old` by a few changes, O(changes × log n).
pub fn remote_writes(old: &RemoteState, new: &RemoteState, local: &MapContents) -> RemoteWrites {
    let mut w = RemoteWrites::default();
    changed(
        &old.ipcache_v4,
        &new.ipcache_v4,
        &local.prefix_v4,
        &mut w.want.prefix_v4,
        &mut w.have.prefix_v4,
    );
    changed(
        &old.ipcache_v6,
        &new.ipcache_v6,
        &local.prefix_v6,
        &mut w.want.prefix_v6,
        &mut w.have.prefix_v6,
    );
    changed(
        &old.masq_v4,
        &new.masq_v4,
        &local.masq_v4,
        &mut w.want.masq_v4,
        &mut w.have.masq_v4,
    );
    changed(
        &old.masq_v6,
        &new.masq_v6,
        &local.masq_v6,
        &mut w.want.masq_v6,
        &mut w.have.masq_v6,
    );
    w
}

/// The keys that differ from `old` to `new` and `local` does not hold:
/// their new values into `want`, their old ones into `have`.
fn changed<K: Ord + Clone, V: Clone + PartialEq>(
    old: &OrdMap<K, V>,
    new: &OrdMap<K, V>,
    local: &BTreeMap<K, V>,
    want: &mut BTreeMap<K, V>,
    have: &mut BTreeMap<K, V>,
) {
    for d in old.diff(new) {
        let (k, before, after) = match d {
            DiffItem::Add(k, v) => (k, None, Some(v)),
            DiffItem::Remove(k, v) => (k, Some(v), None),
            DiffItem::Update {
                old: (k, o),
                new: (_, n),
            } => (k, Some(o), Some(n)),
        };
        if local.contains_key(k) || before == after {
            continue;
        }
        if let Some(v) = before {
            have.insert(k.clone(), v.clone());
        }
        if let Some(v) = after {
            want.insert(k.clone(), v.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::remote::Diff;
    use ipnet::{Ipv4Net, Ipv6Net};
    use lockstep_common::{IpcacheValue, MasqSkipValue};
    use proptest::prelude::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    fn v4(i: u8) -> Ipv4Net {
        Ipv4Net::new(Ipv4Addr::new(10, 0, i, 0), 28).unwrap()
    }

    fn v6(i: u8) -> Ipv6Net {
        Ipv6Net::new(Ipv6Addr::new(0xfd00, 0, u16::from(i), 0, 0, 0, 0, 0), 120).unwrap()
    }

    fn ipc(n: u8) -> IpcacheValue {
        crate::cluster::remote::remote_value(std::net::IpAddr::V4(Ipv4Addr::new(192, 0, 2, n)))
    }

    fn masq(n: u8) -> MasqSkipValue {
        MasqSkipValue {
            reason: 1,
            pool_id: u32::from(n),
        }
    }

    /// One write to a state or the local maps: which map (0..4), which
    /// key, and a value (`None`: removed).
    type Op = (u8, u8, Option<u8>);

    fn apply(s: &mut RemoteState, (map, k, v): Op) {
        match (map % 4, v) {
            (0, Some(v)) => drop(s.ipcache_v4.insert(v4(k), ipc(v))),
            (0, None) => drop(s.ipcache_v4.remove(&v4(k))),
            (1, Some(v)) => drop(s.ipcache_v6.insert(v6(k), ipc(v))),
            (1, None) => drop(s.ipcache_v6.remove(&v6(k))),
            (2, Some(v)) => drop(s.masq_v4.insert(v4(k), masq(v))),
            (2, None) => drop(s.masq_v4.remove(&v4(k))),
            (_, Some(v)) => drop(s.masq_v6.insert(v6(k), masq(v))),
            (_, None) => drop(s.masq_v6.remove(&v6(k))),
        }
    }

    fn merged(local: &MapContents, s: &RemoteState) -> MapContents {
        let mut m = local.clone();
        s.merge_into(&mut m);
        m
    }

    fn ops() -> impl Strategy<Value = Vec<Op>> {
        proptest::collection::vec(
            (0u8..4, 0u8..12, proptest::option::weighted(0.7, 0u8..3)),
            0..40,
        )
    }

    /// The whole-state diffs, per map, in the form the map table applies.
    type Diffs = (
        Diff<Ipv4Net, IpcacheValue>,
        Diff<Ipv6Net, IpcacheValue>,
        Diff<Ipv4Net, MasqSkipValue>,
        Diff<Ipv6Net, MasqSkipValue>,
    );

    fn diffs(want: &MapContents, have: &MapContents) -> Diffs {
        use crate::cluster::remote::diff;
        (
            diff(&want.prefix_v4, &have.prefix_v4),
            diff(&want.prefix_v6, &have.prefix_v6),
            diff(&want.masq_v4, &have.masq_v4),
            diff(&want.masq_v6, &have.masq_v6),
        )
    }

    proptest! {
        #![proptest_config(crate::testing::cases(256))]

        /// Applying the writes of a change does what a whole reconcile
        /// does: the diff of the changed keys equals the diff of the
        /// whole maps (local entries merged with the old state, against
        /// the same with the new one).
        #[test]
        fn the_writes_of_a_change_are_what_a_whole_reconcile_writes(
            start in ops(),
            change in ops(),
            local_ops in ops(),
        ) {
            let mut old = RemoteState::default();
            for o in &start {
                apply(&mut old, *o);
            }
            let mut new = old.clone();
            for o in &change {
                apply(&mut new, *o);
            }
            // Local entries: made the same way, then taken as plain maps.
            let mut l = RemoteState::default();
            for o in &local_ops {
                apply(&mut l, *o);
            }
            let local = merged(&MapContents::default(), &l);
            let w = remote_writes(&old, &new, &local);
            prop_assert_eq!(
                diffs(&w.want, &w.have),
                diffs(&merged(&local, &new), &merged(&local, &old))
            );
            prop_assert_eq!(w.is_empty(), merged(&local, &new) == merged(&local, &old));
        }
    }
}
