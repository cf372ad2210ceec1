//! Addresses a node holds inside blocks etcd gives other nodes.
//!
//! A node cut off from etcd keeps serving its blocks (it cannot know it
//! lost them); if it was removed meanwhile and another node claimed one of
//! them, both may have handed out the same address. Once the node reads
//! etcd again it fences the block (nothing new comes from it), keeps its
//! holders (a running pod is never yanked) and names each of them here, so
//! `verify` shows exactly which addresses may have two holders.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use imbl::OrdMap;
use ipnet::IpNet;

/// One address held on this node that another node's block also covers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Covered<T> {
    /// The address.
    pub address: IpAddr,
    /// Who holds it on this node (as the caller describes it).
    pub holder: T,
    /// The other node's block covering it.
    pub block: IpNet,
    /// The node etcd gives that block.
    pub node: String,
}

/// Every address of `held` (address, holder) that lies in a block of
/// `blocks` (block → node, as etcd records them) given to a node other than
/// `node`, in the order of `held`.
///
/// Blocks are looked up by prefix length (one lookup per distinct length),
/// so a node with many addresses and a cluster with many blocks costs
/// addresses × lengths, not addresses × blocks.
pub fn covered_by_others<T>(
    node: &str,
    held: impl IntoIterator<Item = (IpAddr, T)>,
    blocks: &OrdMap<IpNet, String>,
) -> Vec<Covered<T>> {
    let others: BTreeMap<IpNet, &str> = blocks
        .iter()
        .filter(|(_, n)| n.as_str() != node)
        .map(|(b, n)| (b.trunc(), n.as_str()))
        .collect();
    let lens: BTreeSet<(bool, u8)> = others
        .keys()
        .map(|b| (b.addr().is_ipv4(), b.prefix_len()))
        .collect();
    held.into_iter()
        .filter_map(|(address, holder)| {
            let found = lens
                .iter()
                .filter(|(v4, _)| *v4 == address.is_ipv4())
                .find_map(|(_, len)| {
                    let b = IpNet::new(address, *len).ok()?.trunc();
                    others.get(&b).map(|n| (b, *n))
                });
            found.map(|(block, n)| Covered {
                address,
                holder,
                block,
                node: n.to_owned(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn net(s: &str) -> IpNet {
        s.parse().expect("net")
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    #[test]
    fn addresses_in_another_nodes_block_are_named_with_it_and_its_node() {
        let blocks: OrdMap<IpNet, String> = [
            (net("10.0.0.0/28"), "node-1".to_string()),
            (net("10.0.0.16/28"), "node-0".to_string()),
            (net("fd00::/122"), "node-2".to_string()),
        ]
        .into_iter()
        .collect();
        let held = [
            (ip("10.0.0.5"), "a"),
            (ip("10.0.0.17"), "b"),
            (ip("10.0.0.40"), "c"),
            (ip("fd00::3"), "d"),
        ];
        let got = covered_by_others("node-0", held, &blocks);
        assert_eq!(
            got,
            vec![
                Covered {
                    address: ip("10.0.0.5"),
                    holder: "a",
                    block: net("10.0.0.0/28"),
                    node: "node-1".into(),
                },
                Covered {
                    address: ip("fd00::3"),
                    holder: "d",
                    block: net("fd00::/122"),
                    node: "node-2".into(),
                },
            ]
        );
        // The node's own blocks and addresses outside every block: none.
        assert!(covered_by_others("node-1", [(ip("10.0.0.5"), ())], &blocks).is_empty());
        assert!(covered_by_others("node-0", [(ip("10.9.0.1"), ())], &OrdMap::new()).is_empty());
    }

    proptest! {
        /// Whatever the blocks (sizes mixed, overlapping or not) and the
        /// addresses, the answer is exactly the addresses some other
        /// node's block contains, each with such a block and its node.
        #[test]
        fn exactly_the_addresses_another_nodes_block_contains(
            blocks in proptest::collection::vec((0u32..64, 26u8..=30, 0usize..3), 0..12),
            held in proptest::collection::vec(0u32..256, 0..40),
        ) {
            let base = u32::from(std::net::Ipv4Addr::new(10, 5, 0, 0));
            let blocks: OrdMap<IpNet, String> = blocks
                .into_iter()
                .map(|(i, len, n)| {
                    let a = std::net::Ipv4Addr::from(base + i * 4);
                    (IpNet::new(a.into(), len).expect("len").trunc(), format!("node-{n}"))
                })
                .collect();
            let held: Vec<(IpAddr, u32)> = held
                .iter()
                .map(|&k| (IpAddr::from(std::net::Ipv4Addr::from(base + k)), k))
                .collect();
            let got = covered_by_others("node-0", held.iter().copied(), &blocks);
            let want: Vec<u32> = held
                .iter()
                .filter(|(a, _)| blocks.iter().any(|(b, n)| n != "node-0" && b.contains(a)))
                .map(|(_, k)| *k)
                .collect();
            prop_assert_eq!(got.iter().map(|c| c.holder).collect::<Vec<_>>(), want);
            for c in &got {
                prop_assert!(c.block.contains(&c.address));
                prop_assert_eq!(blocks.get(&c.block), Some(&c.node));
                prop_assert!(c.node != "node-0");
            }
        }
    }
}
