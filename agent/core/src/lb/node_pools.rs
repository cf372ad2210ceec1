//! LB pools against the endpoint pools: an LB pool may not share an
//! address with a node pool (single-node mode) or a cluster pool (cluster
//! mode), or the two allocators would hand out the same address twice.

use ipnet::IpNet;

use super::{LbError, LbPoolSpec, range_to_cidrs};
use crate::cluster::ClusterPoolSpec;
use crate::pool::{PoolSpec, overlaps};

/// Refuses an LB pool that overlaps a CIDR of one of `node_pools`, naming
/// the first such pair: its block (a CIDR, or one CIDR of a range, in the
/// order written) and the node pool's CIDR.
///
/// # Errors
/// [`LbError::OverlapsNodePool`].
pub fn check_against_node_pools(spec: &LbPoolSpec, node_pools: &[PoolSpec]) -> Result<(), LbError> {
    let named = node_pools
        .iter()
        .flat_map(|p| p.cidrs().map(move |c| (p.name.as_str(), c)));
    match first_overlap(spec, named) {
        Some((block, node_cidr, node_pool)) => Err(LbError::OverlapsNodePool {
            pool: spec.name.clone(),
            block,
            node_cidr,
            node_pool: node_pool.to_string(),
        }),
        None => Ok(()),
    }
}

/// Refuses an LB pool that overlaps a CIDR of one of the cluster's pools
/// (cluster mode: every node's endpoints are allocated from them), naming
/// the first such pair as [`check_against_node_pools`] does.
///
/// # Errors
/// [`LbError::OverlapsClusterPool`].
pub fn check_against_cluster_pools(
    spec: &LbPoolSpec,
    cluster_pools: &[ClusterPoolSpec],
) -> Result<(), LbError> {
    let named = cluster_pools
        .iter()
        .flat_map(|p| p.cidrs().map(move |c| (p.name.as_str(), c)));
    match first_overlap(spec, named) {
        Some((block, cluster_cidr, cluster_pool)) => Err(LbError::OverlapsClusterPool {
            pool: spec.name.clone(),
            block,
            cluster_cidr,
            cluster_pool: cluster_pool.to_string(),
        }),
        None => Ok(()),
    }
}

/// The first (LB block, endpoint CIDR, endpoint pool) that overlap, in the
/// order of `named`.
fn first_overlap<'a>(
    spec: &LbPoolSpec,
    named: impl Iterator<Item = (&'a str, IpNet)>,
) -> Option<(IpNet, IpNet, &'a str)> {
    let mut blocks: Vec<IpNet> = spec.cidrs.clone();
    for r in &spec.ranges {
        blocks.extend(range_to_cidrs(r.start, r.stop));
    }
    for (pool, cidr) in named {
        if let Some(block) = blocks.iter().find(|b| overlaps(**b, cidr)) {
            return Some((*block, cidr, pool));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lb::AddrRange;

    fn node(name: &str, v4: &[&str], v6: &[&str]) -> PoolSpec {
        PoolSpec {
            name: name.into(),
            ipv4: v4.iter().map(|c| c.parse().expect("cidr")).collect(),
            ipv6: v6.iter().map(|c| c.parse().expect("cidr")).collect(),
            reserved: Vec::new(),
            allow_first_last: false,
            skip_masquerade: false,
            allow_link_local: false,
            families: Vec::new(),
        }
    }

    fn lb(cidrs: &[&str], ranges: &[(&str, &str)]) -> LbPoolSpec {
        LbPoolSpec {
            name: "public".into(),
            cidrs: cidrs.iter().map(|c| c.parse().expect("cidr")).collect(),
            ranges: ranges
                .iter()
                .map(|(a, b)| AddrRange {
                    start: a.parse().expect("addr"),
                    stop: b.parse().expect("addr"),
                })
                .collect(),
            allow_first_last: false,
            disabled: false,
            service_selector: Default::default(),
            node_selector: Default::default(),
            announce: None,
        }
    }

    #[test]
    fn disjoint_pools_pass() {
        let nodes = [node("pods", &["10.0.0.0/16"], &["fd00::/64"])];
        let spec = lb(
            &["192.0.2.0/24", "fd01::/120"],
            &[("198.51.100.1", "198.51.100.9")],
        );
        assert_eq!(check_against_node_pools(&spec, &nodes), Ok(()));
    }

    #[test]
    fn a_cidr_inside_a_node_pool_is_refused_naming_both() {
        let nodes = [node("pods", &["10.0.0.0/16"], &[])];
        let e = check_against_node_pools(&lb(&["10.0.5.0/24"], &[]), &nodes).unwrap_err();
        assert_eq!(
            e,
            LbError::OverlapsNodePool {
                pool: "public".into(),
                block: "10.0.5.0/24".parse().expect("cidr"),
                node_cidr: "10.0.0.0/16".parse().expect("cidr"),
                node_pool: "pods".into(),
            }
        );
        assert_eq!(
            e.to_string(),
            "lb pool public: 10.0.5.0/24 overlaps 10.0.0.0/16 of node pool pods"
        );
    }

    #[test]
    fn a_cidr_containing_a_node_pool_is_refused() {
        let nodes = [node("pods", &["10.0.7.0/24"], &[])];
        let e = check_against_node_pools(&lb(&["10.0.0.0/8"], &[]), &nodes).unwrap_err();
        assert!(
            matches!(e, LbError::OverlapsNodePool { ref node_pool, .. } if node_pool == "pods")
        );
    }

    #[test]
    fn a_range_touching_a_node_pool_by_one_address_is_refused() {
        // The range ends on the node pool's first address.
        let nodes = [node("pods", &["10.1.0.0/24"], &[])];
        let spec = lb(&[], &[("10.0.255.250", "10.1.0.0")]);
        let e = check_against_node_pools(&spec, &nodes).unwrap_err();
        assert!(
            matches!(e, LbError::OverlapsNodePool { block, .. } if block == "10.1.0.0/32".parse::<IpNet>().expect("cidr")),
            "{e}"
        );
    }

    #[test]
    fn a_range_ending_just_before_a_node_pool_passes() {
        let nodes = [node("pods", &["10.1.0.0/24"], &[])];
        let spec = lb(&[], &[("10.0.255.250", "10.0.255.255")]);
        assert_eq!(check_against_node_pools(&spec, &nodes), Ok(()));
    }

    #[test]
    fn ipv6_overlaps_are_found_in_any_node_pool() {
        let nodes = [
            node("pods", &["10.0.0.0/16"], &[]),
            node("v6", &[], &["fd00:1::/64"]),
        ];
        let e = check_against_node_pools(&lb(&["fd00:1::100/120"], &[]), &nodes).unwrap_err();
        assert_eq!(
            e.to_string(),
            "lb pool public: fd00:1::100/120 overlaps fd00:1::/64 of node pool v6"
        );
    }

    #[test]
    fn families_never_overlap_each_other() {
        // ::ffff:10.0.0.0/104 style blocks are refused elsewhere; a v6
        // block never overlaps a v4 node pool here.
        let nodes = [node("pods", &["10.0.0.0/8"], &[])];
        assert_eq!(
            check_against_node_pools(&lb(&["fd00::/8"], &[]), &nodes),
            Ok(())
        );
    }

    #[test]
    fn no_node_pools_means_nothing_to_overlap() {
        assert_eq!(
            check_against_node_pools(&lb(&["10.0.0.0/8"], &[]), &[]),
            Ok(())
        );
    }

    fn cluster(name: &str, cidrs: &[&str]) -> ClusterPoolSpec {
        let mut p = ClusterPoolSpec::new(name);
        for c in cidrs {
            let c: IpNet = c.parse().expect("cidr");
            match c {
                IpNet::V4(_) => p.ipv4.push(c),
                IpNet::V6(_) => p.ipv6.push(c),
            }
        }
        p
    }

    #[test]
    fn a_block_overlapping_a_cluster_pool_is_refused_naming_both() {
        let pools = [
            cluster("pods", &["10.0.0.0/16"]),
            cluster("pods6", &["fd00:9::/64"]),
        ];
        assert_eq!(
            check_against_cluster_pools(&lb(&["192.0.2.0/24", "fd01::/120"], &[]), &pools),
            Ok(())
        );
        let e = check_against_cluster_pools(&lb(&["192.0.2.0/24", "fd00:9::/120"], &[]), &pools)
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "lb pool public: fd00:9::/120 overlaps fd00:9::/64 of cluster pool pods6"
        );
        let spec = lb(&[], &[("9.255.255.255", "10.0.0.0")]);
        assert!(matches!(
            check_against_cluster_pools(&spec, &pools),
            Err(LbError::OverlapsClusterPool { block, ref cluster_pool, .. })
                if block == "10.0.0.0/32".parse::<IpNet>().expect("cidr") && cluster_pool == "pods"
        ));
    }
}
