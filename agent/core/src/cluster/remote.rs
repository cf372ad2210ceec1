//! The remote state a node programs for the rest of the cluster: where
//! every other node's blocks live (IPCACHE prefix entries flagged
//! [`REMOTE`](ipcache_flags::REMOTE), kernel routes `block via node_ip`) and
//! which cluster CIDRs skip masquerade. Pure: the daemon reads blocks,
//! nodes and pools from etcd, asks [`remote_state`] what should exist and
//! [`diff`] what to change, and applies it.
//!
//! Blocks belong to nodes, not leases: a block is routed as long as etcd
//! says a node holds it, whether or not that node's lease lives. The
//! address a block is routed to comes from the node's lease-bound key
//! while it lives, else from its routing key (no lease: it outlives a
//! node cut off from etcd, and goes with `cluster node remove`), see
//! [`NodeDirectory`]. Withdrawing a cut-off node's routes would cut its
//! pods off from the cluster for a control-plane fault.
//!
//! For the same reason a restarted agent keeps what the node already has
//! ([`RemoteState::carried_over`]) until it has read etcd once: a restart
//! while etcd is unreachable must not withdraw every remote route.

use std::collections::BTreeMap;
use std::net::IpAddr;

use imbl::OrdMap;
use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use lockstep_common::{IpcacheValue, MasqSkipValue, identity, ipcache_flags, masq_reason};

use super::ClusterPoolSpec;
use super::routing::{NoPath, Path, Routing};

/// A claimed block as the remote state needs it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct RemoteBlock {
    /// The block's prefix.
    pub cidr: IpNet,
    /// The node holding it.
    pub node: String,
}

/// Where etcd says each node is reached: the two keys a node publishes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeDirectory {
    /// From the lease-bound node keys (`nodes/<name>`): live nodes only.
    pub live: BTreeMap<String, Vec<IpAddr>>,
    /// From the routing keys (`node_addrs/<name>`, bound to no lease):
    /// every node that registered with a build that writes them, until
    /// it is removed.
    pub routing: BTreeMap<String, Vec<IpAddr>>,
}

impl NodeDirectory {
    /// The addresses `node`'s blocks are routed to: its live key's while
    /// its lease lives (the freshest: every version rewrites it at each
    /// registration, so an agent downgraded to one that predates routing
    /// keys and moved to another address is still followed), else its
    /// routing key's (a node cut off from etcd, whose lease ended, keeps
    /// its routes). `None`: the node published neither (a node of an
    /// older version whose lease ended, or none at all).
    pub fn addresses(&self, node: &str) -> Option<&[IpAddr]> {
        self.live
            .get(node)
            .or_else(|| self.routing.get(node))
            .map(Vec::as_slice)
    }
}

/// Why a routing key's addresses cannot be used: none at all, or one no
/// route can go via (unspecified, multicast, the IPv4 broadcast).
/// `None` when they are usable.
pub fn node_addresses_problem(ips: &[IpAddr]) -> Option<String> {
    if ips.is_empty() {
        return Some("no address".into());
    }
    for ip in ips {
        let bad = ip.is_unspecified()
            || ip.is_multicast()
            || matches!(ip, IpAddr::V4(a) if a.is_broadcast());
        if bad {
            return Some(format!("{ip} is not a unicast address"));
        }
    }
    None
}

/// Why a block of another node gets no entry and no route.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Unroutable {
    /// The holder published no address: no live node key and no routing
    /// key (a node of a version that predates routing keys, whose lease
    /// ended; or a block whose holder never registered).
    NodeUnknown {
        /// The block.
        block: IpNet,
        /// Its holder.
        node: String,
    },
    /// The holder published no address of the block's family.
    NoAddressOfFamily {
        /// The block.
        block: IpNet,
        /// Its holder.
        node: String,
    },
    /// The block needs the tunnel and the holder has no address of a
    /// family this node's underlay has.
    NoTunnelEndpoint {
        /// The block.
        block: IpNet,
        /// Its holder.
        node: String,
    },
}

impl std::fmt::Display for Unroutable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unroutable::NodeUnknown { block, node } => {
                write!(
                    f,
                    "block {block} of node {node}: node {node} published no address (no live node key, no routing key)"
                )
            }
            Unroutable::NoAddressOfFamily { block, node } => write!(
                f,
                "block {block} of node {node}: node {node} has no {} address",
                if block.addr().is_ipv4() {
                    "IPv4"
                } else {
                    "IPv6"
                }
            ),
            Unroutable::NoTunnelEndpoint { block, node } => write!(
                f,
                "block {block} of node {node}: node {node} has no address of a family this node's underlay has (no tunnel endpoint)"
            ),
        }
    }
}

/// What a node should program for the other nodes. Its maps are
/// persistent (#47 item 2): the remote task publishes a copy after every
/// change, which shares everything with the one it keeps following.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RemoteState {
    /// IPCACHE_V4 prefix entries of other nodes' IPv4 blocks.
    pub ipcache_v4: OrdMap<Ipv4Net, IpcacheValue>,
    /// IPCACHE_V6 prefix entries of other nodes' IPv6 blocks.
    pub ipcache_v6: OrdMap<Ipv6Net, IpcacheValue>,
    /// Kernel routes: block → the holder's node address (same family);
    /// blocks reached through the tunnel have none.
    pub routes: OrdMap<IpNet, IpAddr>,
    /// MASQ_SKIP_V4 entries of cluster pools with `skip_masquerade`, and
    /// of the blocks reached through the tunnel.
    pub masq_v4: OrdMap<Ipv4Net, MasqSkipValue>,
    /// MASQ_SKIP_V6 entries of cluster pools with `skip_masquerade`.
    pub masq_v6: OrdMap<Ipv6Net, MasqSkipValue>,
    /// Blocks of other nodes left out, and why (for the log and STATUS).
    pub unroutable: Vec<Unroutable>,
}

/// The IPCACHE value of a block living on the node at `node_ip`.
pub fn remote_value(node_ip: IpAddr) -> IpcacheValue {
    let mut node_addr = [0u8; 16];
    match node_ip {
        IpAddr::V4(a) => node_addr[..4].copy_from_slice(&a.octets()),
        IpAddr::V6(a) => node_addr = a.octets(),
    }
    IpcacheValue {
        identity: identity::ENDPOINT,
        flags: ipcache_flags::REMOTE,
        ifindex: 0,
        _pad: 0,
        node_addr,
    }
}

/// The IPCACHE value of a block reached through the tunnel to `endpoint`
/// (the holder's underlay address, either family).
pub fn tunnel_value(endpoint: IpAddr) -> IpcacheValue {
    let mut v = remote_value(endpoint);
    v.flags |= ipcache_flags::ENCAP;
    if endpoint.is_ipv6() {
        v.flags |= ipcache_flags::TUNNEL_V6;
    }
    v
}

/// [`remote_state_routed`] with native routing.
pub fn remote_state(
    me: &str,
    blocks: &[RemoteBlock],
    nodes: &NodeDirectory,
    pools: &[ClusterPoolSpec],
) -> RemoteState {
    remote_state_routed(me, blocks, nodes, pools, &Routing::native())
}

/// The desired remote state of node `me`: for every block held by another
/// node, an IPCACHE entry and a route via that node's first address of the
/// block's family ([`NodeDirectory::addresses`]: whether or not its lease
/// lives; a block whose node published no address, or none of that
/// family, is left out and reported in [`RemoteState::unroutable`]); this
/// node's own blocks are local and get nothing here. Every CIDR of a pool with
/// `skip_masquerade` gets a MASQ_SKIP entry (reason
/// [`masq_reason::CLUSTER`]).
///
/// `routing` decides each block's path ([`Routing::path`]): a native one
/// gets the route and an entry naming the next hop; one through the tunnel
/// gets no route, an entry flagged [`ipcache_flags::ENCAP`] naming the
/// tunnel endpoint, and a MASQ_SKIP entry (reason
/// [`masq_reason::CLUSTER`]): pod-to-pod traffic keeps its addresses
/// whichever way it goes.
pub fn remote_state_routed(
    me: &str,
    blocks: &[RemoteBlock],
    nodes: &NodeDirectory,
    pools: &[ClusterPoolSpec],
    routing: &Routing,
) -> RemoteState {
    let skip = MasqSkipValue {
        reason: masq_reason::CLUSTER,
        pool_id: 0,
    };
    let mut out = RemoteState::default();
    for b in blocks {
        if b.node == me {
            continue;
        }
        let Some(ips) = nodes.addresses(&b.node) else {
            out.unroutable.push(Unroutable::NodeUnknown {
                block: b.cidr,
                node: b.node.clone(),
            });
            continue;
        };
        let (block, node) = (b.cidr, b.node.clone());
        let value = match routing.path(b.cidr.addr().is_ipv4(), ips) {
            Ok(Path::Native(via)) => {
                out.routes.insert(b.cidr.trunc(), via);
                remote_value(via)
            }
            Ok(Path::Tunnel(endpoint)) => {
                match b.cidr.trunc() {
                    IpNet::V4(n) => out.masq_v4.insert(n, skip),
                    IpNet::V6(n) => out.masq_v6.insert(n, skip),
                };
                tunnel_value(endpoint)
            }
            Err(NoPath::NoAddressOfFamily) => {
                out.unroutable
                    .push(Unroutable::NoAddressOfFamily { block, node });
                continue;
            }
            Err(NoPath::NoCommonFamily) => {
                out.unroutable
                    .push(Unroutable::NoTunnelEndpoint { block, node });
                continue;
            }
        };
        match b.cidr.trunc() {
            IpNet::V4(n) => {
                out.ipcache_v4.insert(n, value);
            }
            IpNet::V6(n) => {
                out.ipcache_v6.insert(n, value);
            }
        }
    }
    for cidr in pools
        .iter()
        .filter(|p| p.skip_masquerade)
        .flat_map(ClusterPoolSpec::cidrs)
    {
        match cidr.trunc() {
            IpNet::V4(n) => {
                out.masq_v4.insert(n, skip);
            }
            IpNet::V6(n) => {
                out.masq_v6.insert(n, skip);
            }
        }
    }
    out.unroutable.sort();
    out
}

/// The entries of `map` whose value `keep` accepts.
fn kept<K: Ord + Copy, V: Copy>(map: &BTreeMap<K, V>, keep: impl Fn(&V) -> bool) -> OrdMap<K, V> {
    map.iter()
        .filter(|(_, v)| keep(v))
        .map(|(k, v)| (*k, *v))
        .collect()
}

impl RemoteState {
    /// The remote state the node already has, as a restarted agent finds
    /// it: the IPCACHE prefix entries flagged
    /// [`REMOTE`](ipcache_flags::REMOTE), the skip-masquerade entries of
    /// reason [`CLUSTER`](masq_reason::CLUSTER) (only the remote state
    /// writes either) and lockstep's kernel routes (`routes`). An agent
    /// keeps these as they are until it has read etcd once, so that a
    /// restart, above all one while etcd cannot be reached, does not cut
    /// the node's pods off from the rest of the cluster.
    pub fn carried_over(
        observed: &crate::plan::desired::MapContents,
        routes: BTreeMap<IpNet, IpAddr>,
    ) -> RemoteState {
        let remote = |v: &IpcacheValue| v.flags & ipcache_flags::REMOTE != 0;
        let cluster = |v: &MasqSkipValue| v.reason == masq_reason::CLUSTER;
        RemoteState {
            ipcache_v4: kept(&observed.prefix_v4, remote),
            ipcache_v6: kept(&observed.prefix_v6, remote),
            routes: routes.into(),
            masq_v4: kept(&observed.masq_v4, cluster),
            masq_v6: kept(&observed.masq_v6, cluster),
            unroutable: Vec::new(),
        }
    }

    /// Adds the remote entries to the agent's desired map contents; an
    /// entry the agent's own state already decides for the same key wins
    /// (a local decision is never replaced by a remote one).
    pub fn merge_into(&self, maps: &mut crate::plan::desired::MapContents) {
        for (k, v) in &self.ipcache_v4 {
            maps.prefix_v4.entry(*k).or_insert(*v);
        }
        for (k, v) in &self.ipcache_v6 {
            maps.prefix_v6.entry(*k).or_insert(*v);
        }
        for (k, v) in &self.masq_v4 {
            maps.masq_v4.entry(*k).or_insert(*v);
        }
        for (k, v) in &self.masq_v6 {
            maps.masq_v6.entry(*k).or_insert(*v);
        }
    }
}

/// What turns an observed map (or route table) into the desired one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Diff<K, V> {
    /// Keys desired and absent, with their values.
    pub adds: Vec<(K, V)>,
    /// Keys present and not desired.
    pub removes: Vec<K>,
    /// Keys present with another value, with the desired value.
    pub changes: Vec<(K, V)>,
}

impl<K, V> Diff<K, V> {
    /// Nothing to do.
    pub fn is_empty(&self) -> bool {
        self.adds.is_empty() && self.removes.is_empty() && self.changes.is_empty()
    }
}

/// The difference from `observed` to `desired`, in key order.
pub fn diff<K: Ord + Clone, V: PartialEq + Clone>(
    desired: &BTreeMap<K, V>,
    observed: &BTreeMap<K, V>,
) -> Diff<K, V> {
    let mut d = Diff {
        adds: Vec::new(),
        removes: Vec::new(),
        changes: Vec::new(),
    };
    for (k, v) in desired {
        match observed.get(k) {
            None => d.adds.push((k.clone(), v.clone())),
            Some(o) if o != v => d.changes.push((k.clone(), v.clone())),
            Some(_) => {}
        }
    }
    d.removes = observed
        .keys()
        .filter(|k| !desired.contains_key(*k))
        .cloned()
        .collect();
    d
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::routing::RoutingMode;
    use proptest::prelude::*;

    fn net(s: &str) -> IpNet {
        s.parse().expect("net")
    }
    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }
    fn block(cidr: &str, node: &str) -> RemoteBlock {
        RemoteBlock {
            cidr: net(cidr),
            node: node.into(),
        }
    }
    /// Block `i` owned by `names[owners[i]]`: `10.0.<i>.0/24`, or an IPv6
    /// /120 where `v6[i]` says so.
    fn generated_blocks(owners: &[usize], v6: &[bool], names: &[&str]) -> Vec<RemoteBlock> {
        owners
            .iter()
            .zip(v6.iter().chain(std::iter::repeat(&false)))
            .enumerate()
            .map(|(i, (o, six))| RemoteBlock {
                cidr: if *six {
                    net(&format!("fd00::{:x}00/120", i + 1))
                } else {
                    net(&format!("10.0.{i}.0/24"))
                },
                node: names[*o].to_string(),
            })
            .collect()
    }
    /// Nodes that are all alive, as before routing keys.
    fn live(nodes: &BTreeMap<String, Vec<IpAddr>>) -> NodeDirectory {
        NodeDirectory {
            live: nodes.clone(),
            routing: BTreeMap::new(),
        }
    }

    #[test]
    fn other_nodes_blocks_get_entries_and_routes_own_blocks_none() {
        let nodes: BTreeMap<String, Vec<IpAddr>> = [
            ("a".to_string(), vec![ip("192.0.2.1"), ip("2001:db8::1")]),
            ("b".to_string(), vec![ip("2001:db8::2"), ip("192.0.2.2")]),
        ]
        .into();
        let blocks = [
            block("10.0.0.0/26", "a"),
            block("10.0.0.64/26", "b"),
            block("10.0.0.128/26", "me"),
            block("fd00::/122", "b"),
        ];
        let s = remote_state("me", &blocks, &live(&nodes), &[]);
        assert_eq!(s.unroutable, vec![]);
        assert_eq!(
            s.routes,
            [
                (net("10.0.0.0/26"), ip("192.0.2.1")),
                (net("10.0.0.64/26"), ip("192.0.2.2")),
                (net("fd00::/122"), ip("2001:db8::2")),
            ]
            .into_iter()
            .collect()
        );
        let v = s.ipcache_v4[&"10.0.0.64/26".parse::<Ipv4Net>().expect("n")];
        assert_eq!(v.flags, ipcache_flags::REMOTE);
        assert_eq!(&v.node_addr[..4], &[192, 0, 2, 2]);
        assert_eq!(v.node_addr[4..], [0u8; 12]);
        let v6 = s.ipcache_v6[&"fd00::/122".parse::<Ipv6Net>().expect("n")];
        assert_eq!(IpAddr::from(v6.node_addr), ip("2001:db8::2"));
        assert_eq!(s.ipcache_v4.len(), 2);
    }

    #[test]
    fn blocks_without_a_usable_node_address_are_reported_not_routed() {
        let nodes: BTreeMap<String, Vec<IpAddr>> =
            [("v4only".to_string(), vec![ip("192.0.2.1")])].into();
        let blocks = [block("fd00::/122", "v4only"), block("10.0.0.0/26", "gone")];
        let s = remote_state("me", &blocks, &live(&nodes), &[]);
        assert!(s.routes.is_empty() && s.ipcache_v4.is_empty() && s.ipcache_v6.is_empty());
        assert_eq!(
            s.unroutable,
            vec![
                Unroutable::NodeUnknown {
                    block: net("10.0.0.0/26"),
                    node: "gone".into()
                },
                Unroutable::NoAddressOfFamily {
                    block: net("fd00::/122"),
                    node: "v4only".into()
                },
            ]
        );
        assert_eq!(
            s.unroutable[1].to_string(),
            "block fd00::/122 of node v4only: node v4only has no IPv6 address"
        );
    }

    #[test]
    fn a_node_whose_lease_ended_keeps_its_routes_while_it_holds_blocks() {
        let dir = NodeDirectory {
            // "moved" lives at .9 (a downgraded agent rewrote only its
            // live key); its routing key still says .8.
            live: [
                ("up".to_string(), vec![ip("192.0.2.1")]),
                ("moved".to_string(), vec![ip("192.0.2.9")]),
            ]
            .into(),
            // "cut": its lease ended (cut off from etcd), its routing key
            // stays. "old": an older agent, no routing key, lease ended.
            routing: [
                ("up".to_string(), vec![ip("192.0.2.1")]),
                ("cut".to_string(), vec![ip("192.0.2.2")]),
                ("moved".to_string(), vec![ip("192.0.2.8")]),
                ("removed".to_string(), vec![ip("192.0.2.4")]),
            ]
            .into(),
        };
        let blocks = [
            block("10.0.0.0/26", "up"),
            block("10.0.0.64/26", "cut"),
            block("10.0.0.128/26", "old"),
            block("10.0.0.192/26", "moved"),
        ];
        let s = remote_state("me", &blocks, &dir, &[]);
        assert_eq!(
            s.routes,
            [
                (net("10.0.0.0/26"), ip("192.0.2.1")),
                (net("10.0.0.64/26"), ip("192.0.2.2")),
                (net("10.0.0.192/26"), ip("192.0.2.9")),
            ]
            .into_iter()
            .collect()
        );
        let cut = s.ipcache_v4[&"10.0.0.64/26".parse::<Ipv4Net>().expect("n")];
        assert_eq!(&cut.node_addr[..4], &[192, 0, 2, 2]);
        // An older node whose lease ended: as before, not routed, reported.
        assert_eq!(
            s.unroutable,
            vec![Unroutable::NodeUnknown {
                block: net("10.0.0.128/26"),
                node: "old".into()
            }]
        );
        assert!(s.unroutable[0].to_string().contains("no routing key"));
        // A routing key without blocks (the node holds none) routes nothing.
        assert!(!s.routes.values().any(|v| *v == ip("192.0.2.4")));
    }

    #[test]
    fn routing_keys_need_unicast_addresses() {
        assert_eq!(
            node_addresses_problem(&[ip("192.0.2.1"), ip("fd00::1")]),
            None
        );
        assert_eq!(node_addresses_problem(&[]), Some("no address".into()));
        for bad in ["0.0.0.0", "::", "224.0.0.1", "ff02::1", "255.255.255.255"] {
            let e = node_addresses_problem(&[ip("192.0.2.1"), ip(bad)]).expect(bad);
            assert!(e.contains(bad), "{e}");
        }
    }

    #[test]
    fn skip_masquerade_pools_give_masq_skip_entries() {
        let mut p = ClusterPoolSpec::new("p")
            .with_cidr(net("10.1.0.0/16"))
            .with_cidr(net("fd01::/64"));
        p.skip_masquerade = true;
        let q = ClusterPoolSpec::new("q").with_cidr(net("10.2.0.0/16"));
        let s = remote_state("me", &[], &NodeDirectory::default(), &[p, q]);
        assert_eq!(
            s.masq_v4.keys().collect::<Vec<_>>(),
            vec![&"10.1.0.0/16".parse::<Ipv4Net>().expect("n")]
        );
        assert_eq!(s.masq_v6.len(), 1);
        assert_eq!(
            s.masq_v4.values().next().map(|v| v.reason),
            Some(masq_reason::CLUSTER)
        );
    }

    #[test]
    fn merge_adds_remote_entries_and_keeps_local_ones() {
        let nodes: BTreeMap<String, Vec<IpAddr>> =
            [("a".to_string(), vec![ip("192.0.2.1")])].into();
        let mut p = ClusterPoolSpec::new("p").with_cidr(net("10.0.0.0/16"));
        p.skip_masquerade = true;
        let s = remote_state(
            "me",
            &[block("10.0.0.0/26", "a"), block("10.0.0.64/26", "a")],
            &live(&nodes),
            &[p],
        );
        let mut maps = crate::plan::desired::MapContents::default();
        let local = IpcacheValue {
            identity: 7,
            ..IpcacheValue::default()
        };
        let k: Ipv4Net = "10.0.0.0/26".parse().expect("n");
        maps.prefix_v4.insert(k, local);
        s.merge_into(&mut maps);
        assert_eq!(maps.prefix_v4[&k], local);
        assert_eq!(
            maps.prefix_v4[&"10.0.0.64/26".parse().expect("n")].flags,
            ipcache_flags::REMOTE
        );
        assert_eq!(maps.masq_v4.len(), 1);
    }

    #[test]
    fn diff_names_adds_removes_changes() {
        let desired: BTreeMap<u8, u8> = [(1, 1), (2, 2), (3, 3)].into();
        let observed: BTreeMap<u8, u8> = [(2, 2), (3, 9), (4, 4)].into();
        let d = diff(&desired, &observed);
        assert_eq!(d.adds, vec![(1, 1)]);
        assert_eq!(d.changes, vec![(3, 3)]);
        assert_eq!(d.removes, vec![4]);
        assert!(diff(&desired, &desired).is_empty());
    }

    fn apply(observed: &mut BTreeMap<u8, u8>, d: &Diff<u8, u8>) {
        for k in &d.removes {
            observed.remove(k);
        }
        for (k, v) in d.adds.iter().chain(&d.changes) {
            observed.insert(*k, *v);
        }
    }

    /// Three peers, a sharing this node's IPv4 subnet, b elsewhere (IPv6
    /// only), c elsewhere in both families; and this node's routing in
    /// `mode`.
    fn peers_and_routing(mode: RoutingMode) -> (BTreeMap<String, Vec<IpAddr>>, Routing) {
        let nodes = [
            ("a".to_string(), vec![ip("192.0.2.1")]),
            ("b".to_string(), vec![ip("2001:db8:2::2")]),
            (
                "c".to_string(),
                vec![ip("2001:db8:3::3"), ip("198.51.100.3")],
            ),
        ]
        .into();
        let routing = Routing {
            mode,
            own: vec![net("192.0.2.9/24"), net("2001:db8:9::9/64")],
        };
        (nodes, routing)
    }

    proptest! {
        #[test]
        fn applying_the_diff_yields_the_desired_state(
            desired in proptest::collection::btree_map(any::<u8>(), 0u8..4, 0..40),
            observed in proptest::collection::btree_map(any::<u8>(), 0u8..4, 0..40),
        ) {
            let d = diff(&desired, &observed);
            let mut o = observed.clone();
            apply(&mut o, &d);
            prop_assert_eq!(&o, &desired);
            prop_assert!(diff(&desired, &o).is_empty());
            // Every key is in at most one list.
            prop_assert_eq!(d.adds.len() + d.changes.len() + d.removes.len(),
                desired.keys().chain(observed.keys())
                    .collect::<std::collections::BTreeSet<_>>().len()
                    - desired.iter().filter(|(k, v)| observed.get(k) == Some(v)).count());
        }

        /// A lease ending changes no route of a node that wrote a
        /// routing key: the routes of every node alive equal those of
        /// every node's lease gone, and a node with neither key gets none.
        #[test]
        fn routes_do_not_depend_on_leases(
            owners in proptest::collection::vec(0usize..5, 0..30),
            alive in proptest::collection::vec(any::<bool>(), 5),
        ) {
            let names = ["me", "a", "b", "c", "old"];
            let keys: BTreeMap<String, Vec<IpAddr>> = [
                ("a".to_string(), vec![ip("192.0.2.1")]),
                ("b".to_string(), vec![ip("2001:db8::2"), ip("192.0.2.2")]),
                ("c".to_string(), vec![ip("192.0.2.3")]),
            ].into();
            let blocks: Vec<RemoteBlock> = owners.iter().enumerate()
                .map(|(i, o)| block(&format!("10.0.{i}.0/24"), names[*o]))
                .collect();
            let everyone = NodeDirectory { live: keys.clone(), routing: keys.clone() };
            let some = NodeDirectory {
                live: keys.iter()
                    .filter(|(n, _)| alive[names.iter().position(|x| x == n).expect("name")])
                    .map(|(n, v)| (n.clone(), v.clone()))
                    .collect(),
                routing: keys.clone(),
            };
            let a = remote_state("me", &blocks, &everyone, &[]);
            let b = remote_state("me", &blocks, &some, &[]);
            prop_assert_eq!(&a, &b);
            for bl in &blocks {
                let routed = a.routes.contains_key(&bl.cidr);
                prop_assert_eq!(routed, keys.contains_key(&bl.node), "{:?}", bl);
            }
        }

        #[test]
        fn no_route_to_own_blocks_and_every_route_matches_family(
            owners in proptest::collection::vec(0usize..4, 0..30),
            v6 in proptest::collection::vec(any::<bool>(), 0..30),
        ) {
            let names = ["me", "a", "b", "c"];
            let nodes: BTreeMap<String, Vec<IpAddr>> = [
                ("a".to_string(), vec![ip("192.0.2.1")]),
                ("b".to_string(), vec![ip("2001:db8::2")]),
                ("c".to_string(), vec![ip("2001:db8::3"), ip("192.0.2.3")]),
            ].into();
            let blocks = generated_blocks(&owners, &v6, &names);
            let s = remote_state("me", &blocks, &live(&nodes), &[]);
            for b in &blocks {
                let routed = s.routes.get(&b.cidr);
                if b.node == "me" {
                    prop_assert!(routed.is_none());
                    continue;
                }
                match routed {
                    Some(via) => {
                        prop_assert_eq!(via.is_ipv4(), b.cidr.addr().is_ipv4());
                        prop_assert!(nodes[&b.node].contains(via));
                    }
                    None => {
                        let reported = s.unroutable.iter().any(|u| {
                            matches!(u, Unroutable::NoAddressOfFamily { block, .. } if *block == b.cidr)
                        });
                        prop_assert!(reported);
                    }
                }
            }
            prop_assert_eq!(s.routes.len(), s.ipcache_v4.len() + s.ipcache_v6.len());
        }

        /// A restarted agent finds in its maps and routes exactly the
        /// remote state it programmed, beside the node's own entries
        /// (which it does not take for remote ones), under every routing
        /// mode.
        #[test]
        fn a_restart_carries_over_exactly_the_remote_state(
            mode in prop_oneof![
                Just(RoutingMode::Native), Just(RoutingMode::Tunnel), Just(RoutingMode::CrossSubnet)
            ],
            owners in proptest::collection::vec(0usize..4, 0..30),
            v6 in proptest::collection::vec(any::<bool>(), 0..30),
            skip in any::<bool>(),
        ) {
            let names = ["me", "a", "b", "c"];
            let (nodes, routing) = peers_and_routing(mode);
            let mut pool = ClusterPoolSpec::new("p")
                .with_cidr(net("10.0.0.0/16"))
                .with_cidr(net("fd00::/64"));
            pool.skip_masquerade = skip;
            let blocks = generated_blocks(&owners, &v6, &names);
            let s = remote_state_routed("me", &blocks, &live(&nodes), &[pool], &routing);
            // The node's own entries: a local prefix and a pool's skip.
            let mut maps = crate::plan::desired::MapContents::default();
            maps.prefix_v4.insert(
                "10.200.0.0/24".parse().expect("n"),
                IpcacheValue { identity: identity::ENDPOINT, ..IpcacheValue::default() },
            );
            maps.masq_v4.insert(
                "10.201.0.0/16".parse().expect("n"),
                MasqSkipValue { reason: masq_reason::POOL, pool_id: 1 },
            );
            maps.masq_v6.insert(
                "fd02::/64".parse().expect("n"),
                MasqSkipValue { reason: masq_reason::CONFIG, pool_id: 0 },
            );
            s.merge_into(&mut maps);
            let carried = RemoteState::carried_over(&maps, s.routes.iter().map(|(k, v)| (*k, *v)).collect());
            let want = RemoteState { unroutable: Vec::new(), ..s };
            prop_assert_eq!(carried, want);
        }

        /// Under every routing mode, each other node's block gets exactly
        /// one of: a route and an entry naming the next hop (native), an
        /// `ENCAP` entry naming the tunnel endpoint with a MASQ_SKIP entry
        /// and no route (tunnel), or a report; own blocks get nothing.
        /// Native mode is exactly the state before routing modes.
        #[test]
        fn every_remote_block_is_routed_tunnelled_or_reported(
            mode in prop_oneof![
                Just(RoutingMode::Native), Just(RoutingMode::Tunnel), Just(RoutingMode::CrossSubnet)
            ],
            owners in proptest::collection::vec(0usize..4, 0..30),
            v6 in proptest::collection::vec(any::<bool>(), 0..30),
        ) {
            let names = ["me", "a", "b", "c"];
            // a shares this node's IPv4 subnet, b is elsewhere (IPv6
            // only), c elsewhere in both families.
            let (nodes, routing) = peers_and_routing(mode);
            let blocks = generated_blocks(&owners, &v6, &names);
            let s = remote_state_routed("me", &blocks, &live(&nodes), &[], &routing);
            if mode == RoutingMode::Native {
                prop_assert_eq!(&s, &remote_state("me", &blocks, &live(&nodes), &[]));
            }
            for b in &blocks {
                let entry = match b.cidr {
                    IpNet::V4(n) => s.ipcache_v4.get(&n).copied(),
                    IpNet::V6(n) => s.ipcache_v6.get(&n).copied(),
                };
                let skipped = match b.cidr {
                    IpNet::V4(n) => s.masq_v4.contains_key(&n),
                    IpNet::V6(n) => s.masq_v6.contains_key(&n),
                };
                let route = s.routes.get(&b.cidr);
                if b.node == "me" {
                    prop_assert!(entry.is_none() && route.is_none() && !skipped);
                    continue;
                }
                let reported = s.unroutable.iter().any(|u| match u {
                    Unroutable::NodeUnknown { block, .. }
                    | Unroutable::NoAddressOfFamily { block, .. }
                    | Unroutable::NoTunnelEndpoint { block, .. } => *block == b.cidr,
                });
                match entry {
                    None => prop_assert!(reported && route.is_none()),
                    Some(v) if v.flags & ipcache_flags::ENCAP != 0 => {
                        prop_assert!(mode != RoutingMode::Native);
                        prop_assert!(route.is_none() && skipped && !reported);
                        let endpoint = if v.flags & ipcache_flags::TUNNEL_V6 != 0 {
                            IpAddr::from(v.node_addr)
                        } else {
                            IpAddr::from([v.node_addr[0], v.node_addr[1], v.node_addr[2], v.node_addr[3]])
                        };
                        prop_assert!(nodes[&b.node].contains(&endpoint));
                        // Cross-subnet tunnels only what is off-link.
                        if mode == RoutingMode::CrossSubnet {
                            prop_assert!(!(b.node == "a" && b.cidr.addr().is_ipv4()));
                        }
                    }
                    Some(v) => {
                        prop_assert!(mode != RoutingMode::Tunnel);
                        let via = route.copied();
                        prop_assert!(via.is_some() && !reported);
                        prop_assert_eq!(v, remote_value(via.expect("route")));
                        if mode == RoutingMode::CrossSubnet {
                            prop_assert!(b.node == "a" && b.cidr.addr().is_ipv4());
                        }
                    }
                }
            }
        }
    }
}
