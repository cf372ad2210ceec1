//! The remote state kept per changed key (#47 item 2).
//!
//! Why: a node's remote state ([`super::remote::remote_state_routed`])
//! depends on every block of every node. Computing it whole on every
//! cluster change made each node's work per change grow with the cluster:
//! at 5,000 nodes, one block claimed elsewhere cost each node a pass over
//! 5,000 blocks. [`RemoteIndex`] keeps the inputs and the state, and a
//! change of one key (a block claimed or given back, a node's addresses)
//! recomputes only the prefixes it touches: the blocks at that prefix, or
//! the blocks of that node. A change of the pools (rare: an operator's)
//! touches only the prefixes whose skip-masquerade entry comes or goes.
//!
//! The whole-state function stays the definition: the property test
//! below drives an index through random changes and compares it with
//! [`super::remote::remote_state_routed`] of the same inputs after every
//! one.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;
use lockstep_common::{IpcacheValue, MasqSkipValue, masq_reason};

use super::ClusterPoolSpec;
use super::remote::{NodeDirectory, RemoteState, Unroutable, remote_value, tunnel_value};
use super::routing::{NoPath, Path, Routing};

/// A block as the index knows it: its pool and prefix (the order the
/// whole-state function walks blocks in).
pub type BlockKey = (String, IpNet);

/// One kernel route that changed: its prefix, the next hop it had and the
/// one it has now (`None`: no route).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouteChange {
    /// The route's destination.
    pub dst: IpNet,
    /// The next hop before the change.
    pub was: Option<IpAddr>,
    /// The next hop after it.
    pub now: Option<IpAddr>,
}

/// Which of a node's two published keys an address change came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeKey {
    /// The lease-bound node key (`nodes/<name>`).
    Live,
    /// The routing key (`node_addrs/<name>`, bound to no lease).
    Routing,
}

/// Node `me`'s remote state, kept up to date one changed key at a time.
#[derive(Clone, Debug)]
pub struct RemoteIndex {
    me: String,
    routing: Routing,
    /// Every block: its holder.
    blocks: BTreeMap<BlockKey, String>,
    /// The blocks at each (truncated) prefix: the whole-state function's
    /// entry for a prefix depends on these only.
    at_prefix: BTreeMap<IpNet, BTreeSet<BlockKey>>,
    /// Each node's blocks: what an address change touches.
    of_node: BTreeMap<String, BTreeSet<BlockKey>>,
    nodes: NodeDirectory,
    /// The prefixes of skip-masquerade pools' CIDRs.
    pool_masq: BTreeSet<IpNet>,
    /// The prefixes of blocks reached through the tunnel.
    block_masq: BTreeSet<IpNet>,
    /// Blocks left out, and why, per prefix.
    unroutable: BTreeMap<IpNet, Vec<Unroutable>>,
    /// Whether `state.unroutable` lags `unroutable` (it is made again
    /// when the state is asked for, not at every change of a full read).
    unroutable_stale: bool,
    state: RemoteState,
    /// Routes changed since [`RemoteIndex::take_route_changes`], by
    /// prefix: the next hop each had before the first of them.
    route_changes: BTreeMap<IpNet, Option<IpAddr>>,
    /// Whether the state changed since [`RemoteIndex::take_changed`].
    changed: bool,
}

/// The part of `nodes` that keys of kind `which` fill.
fn directory(nodes: &mut NodeDirectory, which: NodeKey) -> &mut BTreeMap<String, Vec<IpAddr>> {
    match which {
        NodeKey::Live => &mut nodes.live,
        NodeKey::Routing => &mut nodes.routing,
    }
}

fn skip() -> MasqSkipValue {
    MasqSkipValue {
        reason: masq_reason::CLUSTER,
        pool_id: 0,
    }
}

impl RemoteIndex {
    /// An empty index of node `me`, deciding paths with `routing`.
    pub fn new(me: &str, routing: Routing) -> Self {
        RemoteIndex {
            me: me.to_string(),
            routing,
            blocks: BTreeMap::new(),
            at_prefix: BTreeMap::new(),
            of_node: BTreeMap::new(),
            nodes: NodeDirectory::default(),
            pool_masq: BTreeSet::new(),
            block_masq: BTreeSet::new(),
            unroutable: BTreeMap::new(),
            unroutable_stale: false,
            state: RemoteState::default(),
            route_changes: BTreeMap::new(),
            changed: false,
        }
    }

    /// The state now.
    pub fn state(&mut self) -> &RemoteState {
        if std::mem::take(&mut self.unroutable_stale) {
            let mut all: Vec<Unroutable> = self.unroutable.values().flatten().cloned().collect();
            all.sort();
            self.state.unroutable = all;
        }
        &self.state
    }

    /// Whether the state changed since the last call (and forgets it).
    pub fn take_changed(&mut self) -> bool {
        std::mem::take(&mut self.changed)
    }

    /// The routes that changed since the last call, in prefix order (a
    /// route that changed and changed back is left out).
    pub fn take_route_changes(&mut self) -> Vec<RouteChange> {
        std::mem::take(&mut self.route_changes)
            .into_iter()
            .map(|(dst, was)| RouteChange {
                dst,
                was,
                now: self.state.routes.get(&dst).copied(),
            })
            .filter(|c| c.was != c.now)
            .collect()
    }

    /// Block `key` is now held by `node` (`None`: given back, or no
    /// longer readable).
    pub fn set_block(&mut self, key: BlockKey, node: Option<String>) {
        let old = match node {
            Some(n) => {
                if self.blocks.get(&key) == Some(&n) {
                    return;
                }
                self.of_node
                    .entry(n.clone())
                    .or_default()
                    .insert(key.clone());
                self.blocks.insert(key.clone(), n)
            }
            None => self.blocks.remove(&key),
        };
        if let Some(old) = old
            && let Some(set) = self.of_node.get_mut(&old)
        {
            set.remove(&key);
            if set.is_empty() {
                self.of_node.remove(&old);
            }
        }
        let prefix = key.1.trunc();
        if self.blocks.contains_key(&key) {
            self.at_prefix
                .entry(prefix)
                .or_default()
                .insert(key.clone());
        } else if let Some(set) = self.at_prefix.get_mut(&prefix) {
            set.remove(&key);
            if set.is_empty() {
                self.at_prefix.remove(&prefix);
            }
        }
        self.refresh(prefix);
    }

    /// Node `node`'s addresses under its `which` key are now `ips`
    /// (`None`: the key is gone, or no longer readable).
    pub fn set_node(&mut self, which: NodeKey, node: &str, ips: Option<Vec<IpAddr>>) {
        if directory(&mut self.nodes, which).get(node) == ips.as_ref() {
            return;
        }
        let was = self.nodes.addresses(node).map(<[IpAddr]>::to_vec);
        let map = directory(&mut self.nodes, which);
        match ips {
            Some(ips) => map.insert(node.to_string(), ips),
            None => map.remove(node),
        };
        if self.nodes.addresses(node).map(<[IpAddr]>::to_vec) == was {
            return;
        }
        let prefixes: BTreeSet<IpNet> = self
            .of_node
            .get(node)
            .into_iter()
            .flatten()
            .map(|(_, cidr)| cidr.trunc())
            .collect();
        for p in prefixes {
            self.refresh(p);
        }
    }

    /// The cluster's pools are now `pools` (their skip-masquerade CIDRs
    /// are what the remote state takes from them).
    pub fn set_pools(&mut self, pools: &[ClusterPoolSpec]) {
        let now: BTreeSet<IpNet> = pools
            .iter()
            .filter(|p| p.skip_masquerade)
            .flat_map(ClusterPoolSpec::cidrs)
            .map(|c| c.trunc())
            .collect();
        let touched: Vec<IpNet> = now.symmetric_difference(&self.pool_masq).copied().collect();
        self.pool_masq = now;
        for p in touched {
            self.set_masq(p);
        }
    }

    /// Makes the inputs `blocks`, `nodes` and `pools` (a full read),
    /// touching only what differs from the inputs the index had.
    pub fn replace_all(
        &mut self,
        blocks: BTreeMap<BlockKey, String>,
        nodes: &NodeDirectory,
        pools: &[ClusterPoolSpec],
    ) {
        self.set_pools(pools);
        // Nodes first: blocks then come in with their addresses known.
        for (which, now) in [
            (NodeKey::Live, &nodes.live),
            (NodeKey::Routing, &nodes.routing),
        ] {
            let gone: Vec<String> = directory(&mut self.nodes, which)
                .keys()
                .filter(|n| !now.contains_key(*n))
                .cloned()
                .collect();
            for n in gone {
                self.set_node(which, &n, None);
            }
            for (n, ips) in now {
                self.set_node(which, n, Some(ips.clone()));
            }
        }
        let gone: Vec<BlockKey> = self
            .blocks
            .keys()
            .filter(|k| !blocks.contains_key(*k))
            .cloned()
            .collect();
        for k in gone {
            self.set_block(k, None);
        }
        for (k, node) in blocks {
            self.set_block(k, Some(node));
        }
    }

    /// Makes the skip-masquerade entry of `p` what the pools and the
    /// tunnelled blocks say.
    fn set_masq(&mut self, p: IpNet) {
        let want = self.pool_masq.contains(&p) || self.block_masq.contains(&p);
        let changed = match (p, want) {
            (IpNet::V4(n), true) => self.state.masq_v4.insert(n, skip()).is_none(),
            (IpNet::V6(n), true) => self.state.masq_v6.insert(n, skip()).is_none(),
            (IpNet::V4(n), false) => self.state.masq_v4.remove(&n).is_some(),
            (IpNet::V6(n), false) => self.state.masq_v6.remove(&n).is_some(),
        };
        self.changed |= changed;
    }

    fn set_route(&mut self, p: IpNet, via: Option<IpAddr>) {
        let was = match via {
            Some(v) => self.state.routes.insert(p, v),
            None => self.state.routes.remove(&p),
        };
        if was != via {
            self.changed = true;
            self.route_changes.entry(p).or_insert(was);
        }
    }

    fn set_ipcache(&mut self, p: IpNet, value: Option<IpcacheValue>) {
        let was = match (p, value) {
            (IpNet::V4(n), Some(v)) => self.state.ipcache_v4.insert(n, v),
            (IpNet::V6(n), Some(v)) => self.state.ipcache_v6.insert(n, v),
            (IpNet::V4(n), None) => self.state.ipcache_v4.remove(&n),
            (IpNet::V6(n), None) => self.state.ipcache_v6.remove(&n),
        };
        self.changed |= was != value;
    }

    /// Recomputes everything at prefix `p` from the blocks there, in the
    /// order (and with the outcome) of the whole-state function: the last
    /// block's entry wins, a route stays from the last natively routed
    /// one, a skip-masquerade entry from any tunnelled one.
    fn refresh(&mut self, p: IpNet) {
        let keys: Vec<BlockKey> = self
            .at_prefix
            .get(&p)
            .into_iter()
            .flatten()
            .cloned()
            .collect();
        let (mut route, mut value, mut masq) = (None, None, false);
        let mut unroutable = Vec::new();
        for key in &keys {
            let node = &self.blocks[key];
            if *node == self.me {
                continue;
            }
            let (block, node) = (key.1, node.clone());
            let Some(ips) = self.nodes.addresses(&node) else {
                unroutable.push(Unroutable::NodeUnknown { block, node });
                continue;
            };
            match self.routing.path(block.addr().is_ipv4(), ips) {
                Ok(Path::Native(via)) => {
                    route = Some(via);
                    value = Some(remote_value(via));
                }
                Ok(Path::Tunnel(endpoint)) => {
                    masq = true;
                    value = Some(tunnel_value(endpoint));
                }
                Err(NoPath::NoAddressOfFamily) => {
                    unroutable.push(Unroutable::NoAddressOfFamily { block, node });
                }
                Err(NoPath::NoCommonFamily) => {
                    unroutable.push(Unroutable::NoTunnelEndpoint { block, node });
                }
            }
        }
        self.set_route(p, route);
        self.set_ipcache(p, value);
        let had_masq = if masq {
            !self.block_masq.insert(p)
        } else {
            self.block_masq.remove(&p)
        };
        if had_masq != masq {
            self.set_masq(p);
        }
        if self.unroutable.get(&p).map_or(&[][..], Vec::as_slice) != unroutable.as_slice() {
            if unroutable.is_empty() {
                self.unroutable.remove(&p);
            } else {
                self.unroutable.insert(p, unroutable);
            }
            self.unroutable_stale = true;
            self.changed = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::remote::{RemoteBlock, remote_state_routed};
    use crate::cluster::routing::RoutingMode;
    use proptest::prelude::*;

    fn net(s: &str) -> IpNet {
        s.parse().expect("net")
    }

    /// The whole-state function of the index's inputs.
    fn oracle(
        me: &str,
        blocks: &BTreeMap<BlockKey, String>,
        nodes: &NodeDirectory,
        pools: &[ClusterPoolSpec],
        routing: &Routing,
    ) -> RemoteState {
        let list: Vec<RemoteBlock> = blocks
            .iter()
            .map(|((_, cidr), node)| RemoteBlock {
                cidr: *cidr,
                node: node.clone(),
            })
            .collect();
        remote_state_routed(me, &list, nodes, pools, routing)
    }

    /// One change the index is told of.
    #[derive(Clone, Debug)]
    enum Op {
        Block {
            pool: usize,
            cidr: usize,
            node: Option<usize>,
        },
        Node {
            live: bool,
            node: usize,
            ips: Option<Vec<usize>>,
        },
        Pools {
            skip: Vec<bool>,
        },
        /// A full read: some of the blocks and nodes there are now.
        Everything {
            keep_blocks: Vec<bool>,
            keep_nodes: Vec<bool>,
        },
    }

    const NODES: [&str; 4] = ["me", "a", "b", "c"];
    /// Block prefixes, some the same once truncated, some inside a pool.
    const CIDRS: [&str; 6] = [
        "10.0.0.0/24",
        "10.0.0.1/24",
        "10.0.1.0/24",
        "fd00::100/120",
        "fd00::1ff/120",
        "10.0.0.0/16",
    ];
    /// Node addresses: on this node's IPv4 subnet, elsewhere, IPv6, and
    /// ones no route can use being left to the door.
    const IPS: [&str; 5] = [
        "192.0.2.1",
        "198.51.100.3",
        "2001:db8:9::1",
        "2001:db8:3::3",
        "192.0.2.7",
    ];

    fn pool(i: usize, skip: bool) -> ClusterPoolSpec {
        let mut p = ClusterPoolSpec::new(format!("p{i}"));
        if i.is_multiple_of(2) {
            p.ipv4 = vec![net("10.0.0.0/16")];
        } else {
            p.ipv4 = vec![net("10.0.1.0/24")];
            p.ipv6 = vec![net("fd00::/64")];
        }
        p.skip_masquerade = skip;
        p
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0usize..2, 0usize..CIDRS.len(), proptest::option::weighted(0.8, 0usize..NODES.len()))
                .prop_map(|(pool, cidr, node)| Op::Block { pool, cidr, node }),
            3 => (any::<bool>(), 0usize..NODES.len(), proptest::option::weighted(0.8, proptest::collection::vec(0usize..IPS.len(), 0..3)))
                .prop_map(|(live, node, ips)| Op::Node { live, node, ips }),
            1 => proptest::collection::vec(any::<bool>(), 2).prop_map(|skip| Op::Pools { skip }),
            1 => (proptest::collection::vec(any::<bool>(), 12), proptest::collection::vec(any::<bool>(), 8))
                .prop_map(|(keep_blocks, keep_nodes)| Op::Everything { keep_blocks, keep_nodes }),
        ]
    }

    proptest! {
        #![proptest_config(crate::testing::cases(256))]
        /// After every change the index equals the whole-state function
        /// of the same inputs, says whether it changed, and the route
        /// changes it reports turn the routes it had into the routes it
        /// has.
        #[test]
        fn the_index_is_the_whole_state_function_after_every_change(
            mode in prop_oneof![Just(RoutingMode::Native), Just(RoutingMode::Tunnel), Just(RoutingMode::CrossSubnet)],
            ops in proptest::collection::vec(op(), 1..60),
        ) {
            let routing = Routing { mode, own: vec![net("192.0.2.9/24"), net("2001:db8:9::9/64")] };
            let mut index = RemoteIndex::new("me", routing.clone());
            let mut blocks = BTreeMap::new();
            let mut nodes = NodeDirectory::default();
            let mut pools: Vec<ClusterPoolSpec> = Vec::new();
            let mut routes = BTreeMap::new();
            for op in ops {
                let before = index.state().clone();
                // A full read's changes may cancel out: it may report a
                // change that left the state as it was (one extra
                // publication), never miss one. One key: exact.
                let whole = matches!(op, Op::Everything { .. });
                match op {
                    Op::Block { pool, cidr, node } => {
                        let key = (format!("p{pool}"), net(CIDRS[cidr]));
                        let node = node.map(|n| NODES[n].to_string());
                        match &node {
                            Some(n) => blocks.insert(key.clone(), n.clone()),
                            None => blocks.remove(&key),
                        };
                        index.set_block(key, node);
                    }
                    Op::Node { live, node, ips } => {
                        let ips: Option<Vec<IpAddr>> = ips.map(|v| v.iter().map(|i| IPS[*i].parse().expect("ip")).collect());
                        let (which, map) = if live { (NodeKey::Live, &mut nodes.live) } else { (NodeKey::Routing, &mut nodes.routing) };
                        match &ips {
                            Some(v) => map.insert(NODES[node].to_string(), v.clone()),
                            None => map.remove(NODES[node]),
                        };
                        index.set_node(which, NODES[node], ips);
                    }
                    Op::Pools { skip } => {
                        pools = skip.iter().enumerate().map(|(i, s)| pool(i, *s)).collect();
                        index.set_pools(&pools);
                    }
                    Op::Everything { keep_blocks, keep_nodes } => {
                        let mut keep = keep_blocks.into_iter().cycle();
                        blocks.retain(|_, _| keep.next().unwrap_or(true));
                        let mut keep = keep_nodes.into_iter().cycle();
                        nodes.live.retain(|_, _| keep.next().unwrap_or(true));
                        nodes.routing.retain(|_, _| keep.next().unwrap_or(true));
                        pools.pop();
                        index.replace_all(blocks.clone(), &nodes, &pools);
                    }
                }
                let want = oracle("me", &blocks, &nodes, &pools, &routing);
                prop_assert_eq!(index.state(), &want);
                let changed = index.take_changed();
                if whole {
                    prop_assert!(changed || before == want, "a full read's change not reported");
                } else {
                    prop_assert_eq!(changed, before != want);
                }
                for c in index.take_route_changes() {
                    prop_assert_eq!(routes.get(&c.dst).copied(), c.was);
                    match c.now {
                        Some(v) => routes.insert(c.dst, v),
                        None => routes.remove(&c.dst),
                    };
                }
                prop_assert!(routes.iter().eq(want.routes.iter()), "routes {routes:?}, want {:?}", want.routes);
            }
        }
    }

    #[test]
    fn a_block_claimed_elsewhere_touches_its_prefix_only() {
        let mut index = RemoteIndex::new("me", Routing::native());
        index.set_node(
            NodeKey::Live,
            "a",
            Some(vec!["192.0.2.1".parse().expect("ip")]),
        );
        for i in 0..100 {
            index.set_block(
                ("p".into(), net(&format!("10.0.{i}.0/24"))),
                Some("a".into()),
            );
        }
        assert_eq!(index.state().routes.len(), 100);
        assert!(index.take_changed());
        assert_eq!(index.take_route_changes().len(), 100);
        // One block given back: one route goes, nothing else moves.
        index.set_block(("p".into(), net("10.0.7.0/24")), None);
        let changes = index.take_route_changes();
        assert_eq!(
            changes,
            vec![RouteChange {
                dst: net("10.0.7.0/24"),
                was: Some("192.0.2.1".parse().expect("ip")),
                now: None
            }]
        );
        assert!(index.take_changed());
        // The same addresses published again: nothing changes.
        index.set_node(
            NodeKey::Live,
            "a",
            Some(vec!["192.0.2.1".parse().expect("ip")]),
        );
        assert!(!index.take_changed());
        assert!(index.take_route_changes().is_empty());
    }
}
