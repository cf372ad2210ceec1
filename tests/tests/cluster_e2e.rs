//! Cluster mode end to end (#12 tests a and b): three node namespaces on a
//! bridge inside an underlay namespace, a real 3-member etcd, one agent per
//! node, endpoints added through the CNI plugin.
//!
//! a. Every endpoint pings every other across nodes; no address is held
//!    twice; each node's IPCACHE and routes hold the other nodes' blocks with
//!    the right node address.
//! b. Concurrent ADD/DEL churn on all three nodes while agents are SIGKILLed
//!    and restarted (15 kills): no address held twice cluster-wide, every
//!    acknowledged endpoint present afterwards, `verify` clean everywhere.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Duration;

use anyhow::ensure;
use lockstep_tests::churn::Ledger;
use lockstep_tests::cluster::{ClusterNodes, address_of, cni};
use lockstep_tests::etcd::EtcdCluster;
use lockstep_tests::{Netns, privileged};

#[test]
fn endpoints_ping_across_nodes_and_every_node_knows_every_block() -> anyhow::Result<()> {
    privileged!();
    let cluster = EtcdCluster::start(3)?;
    let n = ClusterNodes::build(
        &cluster,
        "/e2e-a/",
        "[[pools]]\nname = \"pods\"\nipv4 = [\"10.96.0.0/16\"]\nblock_v4 = 28\n",
    )?;
    let mut pods: Vec<(usize, Netns, IpAddr)> = Vec::new();
    for i in 0..3 {
        for p in 0..2 {
            let ns = Netns::new(&format!("cep{i}{p}"))?;
            let (_, answer) = cni(
                &n.agents[i].socket(),
                "ADD",
                &format!("pod-{i}-{p}"),
                &ns.path(),
            )?;
            pods.push((i, ns, address_of(&answer)?));
        }
    }
    let addrs: BTreeSet<IpAddr> = pods.iter().map(|p| p.2).collect();
    ensure!(addrs.len() == 6, "an address handed out twice: {addrs:?}");
    for (addr, owners) in n.holders()? {
        ensure!(owners.len() == 1, "{addr} held by {owners:?}");
    }
    // Each node's pods lie in that node's blocks.
    let all = n.blocks()?;
    for (i, _, a) in &pods {
        let owner = all
            .iter()
            .find(|(b, _)| b.contains(a))
            .map(|(_, o)| o.clone());
        ensure!(
            owner.as_deref() == Some(&format!("node-{i}")),
            "{a} of node-{i} lies in {owner:?}'s block"
        );
    }
    n.wait_remote()?;
    for (i, from, src) in &pods {
        for (k, _, dst) in &pods {
            if src == dst {
                continue;
            }
            let out = from.exec("ping", ["-c", "1", "-W", "2", &dst.to_string()]);
            ensure!(
                out.is_ok(),
                "node-{i} {src} -> node-{k} {dst}: {}",
                out.err().map(|e| e.to_string()).unwrap_or_default()
            );
        }
    }
    for a in &n.agents {
        let v = a.cli(["verify"])?;
        ensure!(
            v.status.success(),
            "verify: {}",
            String::from_utf8_lossy(&v.stdout)
        );
    }
    Ok(())
}

#[test]
fn churn_with_agents_killed_holds_no_address_twice_and_loses_nothing() -> anyhow::Result<()> {
    privileged!();
    let cluster = EtcdCluster::start(3)?;
    // Small blocks, so churn claims and gives back.
    let mut n = ClusterNodes::build(
        &cluster,
        "/e2e-b/",
        "[[pools]]\nname = \"pods\"\nipv4 = [\"10.97.0.0/20\"]\nblock_v4 = 28\n",
    )?;
    let ledger = Ledger::new("cb", 24)?;
    let mut kills = 0;
    // The killer: 15 SIGKILLs, round robin, each followed by a restart.
    ledger.run(&mut n, |n| {
        for round in 0..15 {
            std::thread::sleep(Duration::from_millis(400));
            // The workers reach each agent through its socket; only the
            // killer holds the process handles.
            let agent = &mut n.agents[round % 3];
            agent.kill9();
            kills += 1;
            std::thread::sleep(Duration::from_millis(100));
            agent.respawn()?;
            agent.wait_ready()?;
        }
        Ok(())
    })?;
    ensure!(kills >= 15, "{kills} kills");
    ledger.check(&n)
}
