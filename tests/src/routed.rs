//! Nodes on two underlay subnets joined by a router (#30): the router
//! namespace forwards between `10.252.1.0/24` + `fd52:1::/64` (bridge
//! `br1`: nodes 0 and 1) and `10.252.2.0/24` + `fd52:2::/64` (bridge
//! `br2`: node 2) and has no route to any pod block, so native routing
//! cannot cross it; each node's default routes go via the router.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::cluster::{Cut, apply_pools, forward};
use crate::etcd::EtcdCluster;
use crate::{AgentProc, Netns};

/// The subnet (1 or 2) node `i` lies on.
pub fn subnet(i: usize) -> usize {
    if i < 2 { 1 } else { 2 }
}

/// Node `i`'s IPv4 underlay address.
pub fn node_v4(i: usize) -> String {
    format!("10.252.{}.{}", subnet(i), i + 1)
}

/// Node `i`'s IPv6 underlay address.
pub fn node_v6(i: usize) -> String {
    format!("fd52:{}::{}", subnet(i), i + 1)
}

/// Three nodes on two routed subnets, each running an agent in cluster
/// mode on one etcd.
pub struct RoutedNodes {
    /// The router namespace (bridges `br1`, `br2`; node `i`'s underlay
    /// port is `p{i}` there).
    pub router: Netns,
    /// The node namespaces (underlay interface `u0`).
    pub ns: Vec<Netns>,
    /// The agents, one per node.
    pub agents: Vec<AgentProc>,
    /// The etcd endpoints.
    pub eps: Vec<String>,
    /// The cluster key prefix.
    pub prefix: String,
    /// Each node's forwarder switch.
    pub cuts: Vec<Arc<Cut>>,
}

impl RoutedNodes {
    /// Applies `pools` under `prefix` and starts the three nodes, with
    /// `cluster_extra` (keys of `[cluster]`, e.g. `routing = "tunnel"`) in
    /// every agent's `[cluster]` section.
    ///
    /// # Errors
    /// A namespace, link, forwarder or agent could not be made.
    pub fn build(
        cluster: &EtcdCluster,
        prefix: &str,
        pools: &str,
        cluster_extra: &str,
    ) -> anyhow::Result<Self> {
        let eps = cluster.endpoints();
        apply_pools(&eps, prefix, pools)?;
        let router = Netns::new("rtr")?;
        for s in [1, 2] {
            let br = format!("br{s}");
            router.ip(["link", "add", &br, "type", "bridge"])?;
            router.ip(["link", "set", &br, "up"])?;
            router.ip(["addr", "add", &format!("10.252.{s}.254/24"), "dev", &br])?;
            router.ip([
                "-6",
                "addr",
                "add",
                &format!("fd52:{s}::fe/64"),
                "dev",
                &br,
                "nodad",
            ])?;
        }
        router.exec(
            "sysctl",
            [
                "-qw",
                "net.ipv4.ip_forward=1",
                "net.ipv6.conf.all.forwarding=1",
            ],
        )?;
        let mut ns = Vec::new();
        let mut agents = Vec::new();
        let mut cuts = Vec::new();
        for i in 0..3 {
            let node = Netns::new(&format!("rn{i}"))?;
            let port = format!("p{i}");
            node.ip([
                "link",
                "add",
                "u0",
                "type",
                "veth",
                "peer",
                "name",
                &port,
                "netns",
                router.name(),
            ])?;
            router.ip([
                "link",
                "set",
                &port,
                "master",
                &format!("br{}", subnet(i)),
                "up",
            ])?;
            node.ip(["addr", "add", &format!("{}/24", node_v4(i)), "dev", "u0"])?;
            node.ip([
                "-6",
                "addr",
                "add",
                &format!("{}/64", node_v6(i)),
                "dev",
                "u0",
                "nodad",
            ])?;
            node.ip(["link", "set", "u0", "up"])?;
            let s = subnet(i);
            node.ip(["route", "add", "default", "via", &format!("10.252.{s}.254")])?;
            node.ip([
                "-6",
                "route",
                "add",
                "default",
                "via",
                &format!("fd52:{s}::fe"),
            ])?;
            node.exec(
                "sysctl",
                [
                    "-qw",
                    "net.ipv4.ip_forward=1",
                    "net.ipv6.conf.all.forwarding=1",
                    "net.ipv4.conf.all.rp_filter=0",
                ],
            )?;
            cuts.push(forward(&node, cluster)?);
            let eps_list = eps
                .iter()
                .map(|e| format!("\"{e}\""))
                .collect::<Vec<_>>()
                .join(", ");
            let config = format!(
                "reconcile_interval = \"1s\"\npools = []\n[cluster]\netcd = [{eps_list}]\nprefix = \"{prefix}\"\nnode_name = \"node-{i}\"\nnode_ip_v4 = \"{}\"\nnode_ip_v6 = \"{}\"\n{cluster_extra}[datapath]\nuplink = \"u0\"\n",
                node_v4(i),
                node_v6(i),
            );
            agents.push(AgentProc::start(&node, &config)?);
            ns.push(node);
        }
        Ok(Self {
            router,
            ns,
            agents,
            eps,
            prefix: prefix.to_string(),
            cuts,
        })
    }

    /// The remote IPCACHE prefix entries of node `i` (both families):
    /// prefix → value, read through its pinned maps.
    ///
    /// # Errors
    /// The maps could not be opened or read.
    pub fn remote_entries(
        &self,
        i: usize,
    ) -> anyhow::Result<std::collections::BTreeMap<ipnet::IpNet, lockstep_common::IpcacheValue>>
    {
        let maps = lockstep::datapath::PinnedMaps::open(self.agents[i].pins.path())?;
        let mut out = std::collections::BTreeMap::new();
        for kv in maps.ipcache_v4().iter() {
            let (k, v) = kv?;
            let net = ipnet::Ipv4Net::new(k.data().into(), k.prefix_len() as u8)?;
            out.insert(ipnet::IpNet::V4(net), v);
        }
        for kv in maps.ipcache_v6().iter() {
            let (k, v) = kv?;
            let net = ipnet::Ipv6Net::new(k.data().into(), k.prefix_len() as u8)?;
            out.insert(ipnet::IpNet::V6(net), v);
        }
        out.retain(|_, v| v.flags & lockstep_common::ipcache_flags::REMOTE != 0);
        Ok(out)
    }

    /// Waits (at most `within`) until `ok(i, remote entries of node i)`
    /// holds for every node.
    ///
    /// # Errors
    /// Still not after `within`, with the last reason.
    pub fn wait_remote(
        &self,
        within: Duration,
        ok: impl Fn(
            usize,
            &std::collections::BTreeMap<ipnet::IpNet, lockstep_common::IpcacheValue>,
        ) -> Result<(), String>,
    ) -> anyhow::Result<()> {
        let started = Instant::now();
        loop {
            let mut last = Ok(());
            for i in 0..self.agents.len() {
                last = ok(i, &self.remote_entries(i)?);
                if last.is_err() {
                    break;
                }
            }
            match last {
                Ok(()) => return Ok(()),
                Err(why) => anyhow::ensure!(
                    started.elapsed() < within,
                    "remote IPCACHE not as expected after {within:?}: {why}"
                ),
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}
