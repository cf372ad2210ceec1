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

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, ensure};
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
    let pods: Vec<Vec<Netns>> = (0..3)
        .map(|i| {
            (0..24)
                .map(|p| Netns::new(&format!("cb{i}p{p}")))
                .collect::<anyhow::Result<Vec<_>>>()
        })
        .collect::<anyhow::Result<_>>()?;
    // Acknowledged state per node: container id → address.
    let acked: Vec<Arc<Mutex<BTreeMap<String, IpAddr>>>> = (0..3).map(|_| Arc::default()).collect();
    // Endpoints whose last DEL failed: whether the agent did it is unknown.
    let unsure: Vec<Arc<Mutex<BTreeSet<String>>>> = (0..3).map(|_| Arc::default()).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let kills = std::thread::scope(|s| -> anyhow::Result<usize> {
        let mut workers = Vec::new();
        for i in 0..3 {
            let (acked, stop, pods) = (acked[i].clone(), stop.clone(), &pods[i]);
            let unsure_del = unsure[i].clone();
            let socket = n.agents[i].socket();
            let agent = socket.as_path().to_path_buf();
            workers.push(s.spawn(move || -> anyhow::Result<(usize, usize)> {
                let agent = agent.as_path();
                let (mut adds, mut dels) = (0, 0);
                let mut k = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    let slot = k % pods.len();
                    let id = format!("churn-{i}-{slot}");
                    let ns = pods[slot].path();
                    let held = acked
                        .lock()
                        .map_err(|_| anyhow::anyhow!("poisoned"))?
                        .contains_key(&id);
                    if held {
                        // A DEL counts once acknowledged. A failed one (the
                        // agent killed meanwhile) may or may not have been
                        // done: the endpoint stays in `acked`, marked
                        // unsure, and its DEL is retried (as a runtime
                        // retries a DEL until it succeeds).
                        let mut acked = acked.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
                        if cni(agent, "DEL", &id, &ns).is_ok() {
                            acked.remove(&id);
                            unsure_del
                                .lock()
                                .map_err(|_| anyhow::anyhow!("poisoned"))?
                                .remove(&id);
                            dels += 1;
                        } else {
                            unsure_del
                                .lock()
                                .map_err(|_| anyhow::anyhow!("poisoned"))?
                                .insert(id);
                        }
                    } else if let Ok((_, answer)) = cni(agent, "ADD", &id, &ns) {
                        let a = address_of(&answer)?;
                        acked
                            .lock()
                            .map_err(|_| anyhow::anyhow!("poisoned"))?
                            .insert(id, a);
                        adds += 1;
                    } else {
                        // An ADD that failed may still have been done by
                        // the agent before it died: the runtime's DEL cleans
                        // it, as a runtime does after a failed ADD.
                        let _ = cni(agent, "DEL", &id, &ns);
                    }
                    k += 7;
                }
                Ok((adds, dels))
            }));
        }
        // The killer: 15 SIGKILLs, round robin, each followed by a restart.
        let mut kills = 0;
        let result = (|| -> anyhow::Result<()> {
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
        })();
        stop.store(true, Ordering::Relaxed);
        for w in workers {
            let (adds, dels) = w
                .join()
                .map_err(|_| anyhow::anyhow!("a worker panicked"))??;
            ensure!(
                adds > 0 && dels > 0,
                "a worker made no progress: {adds} {dels}"
            );
        }
        result?;
        Ok(kills)
    })?;
    ensure!(kills >= 15, "{kills} kills");
    // The runtime's retry of every DEL whose outcome was unknown: it must
    // succeed now that every agent runs.
    for (i, (acked, unsure)) in acked.iter().zip(&unsure).enumerate() {
        let unsure = unsure.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
        let mut acked = acked.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
        eprintln!("node-{i}: {} DELs of unknown outcome retried", unsure.len());
        for id in unsure.iter() {
            let slot: usize = id.rsplit('-').next().context("slot")?.parse()?;
            cni(&n.agents[i].socket(), "DEL", id, &pods[i][slot].path())?;
            acked.remove(id);
        }
    }
    // Afterwards: every endpoint whose last change was an acknowledged ADD
    // is held by its node with its address; no address is held twice
    // anywhere; verify is clean.
    for (i, (acked, agent)) in acked.iter().zip(&n.agents).enumerate() {
        let want = acked.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
        let allocs = agent.json(["allocations", "-o", "json"])?;
        let have: BTreeMap<String, String> = allocs
            .as_array()
            .context("allocations")?
            .iter()
            .filter_map(|x| {
                Some((
                    x["owner"]["container_id"].as_str()?.to_string(),
                    x["address"].as_str()?.to_string(),
                ))
            })
            .collect();
        for (id, a) in want.iter() {
            ensure!(
                have.get(id).map(String::as_str) == Some(a.to_string().as_str()),
                "node-{i}: acknowledged {id} {a} is {:?} after the churn",
                have.get(id)
            );
        }
    }
    for (addr, owners) in n.holders()? {
        ensure!(owners.len() == 1, "{addr} held twice: {owners:?}");
    }
    for (i, a) in n.agents.iter().enumerate() {
        let v = a.cli(["verify"])?;
        ensure!(
            v.status.success(),
            "node-{i} verify: {}",
            String::from_utf8_lossy(&v.stdout)
        );
    }
    Ok(())
}
