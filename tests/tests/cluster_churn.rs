//! Cluster churn through the faults of #26 (its "churn test with the faults
//! above and a ledger"): three node namespaces, a real 3-member etcd, CNI
//! ADD/DEL workers on every node with a ledger of every acknowledged
//! answer ([`Ledger`]), while the test, node after node:
//!
//! - cuts the node off from etcd (a partition: its packets to the members
//!   dropped) and heals it;
//! - lets the node's next claim reach etcd and drops every answer after it
//!   (a lost reply), then lets answers through again;
//! - writes a key no build can read under `blocks/` and deletes it with
//!   `lockstep cluster unreadable delete`;
//! - SIGKILLs the next node's agent and starts it again.
//!
//! Afterwards every acknowledged endpoint is held with its address, no
//! address is held by two nodes, every address lies in a block etcd gives
//! its node, and `verify` is clean on every node.

use std::time::Duration;

use anyhow::ensure;
use lockstep_tests::churn::Ledger;
use lockstep_tests::cluster::ClusterNodes;
use lockstep_tests::etcd::EtcdCluster;
use lockstep_tests::privileged;

#[test]
fn churn_through_partitions_lost_answers_bad_keys_and_kills_keeps_one_owner_per_address()
-> anyhow::Result<()> {
    privileged!();
    let cluster = EtcdCluster::start(3)?;
    let prefix = "/churn-f/";
    // Small blocks and a short release_after, so the churn claims and
    // gives back all the time.
    let mut n = ClusterNodes::build_full(
        &cluster,
        prefix,
        "[[pools]]\nname = \"pods\"\nipv4 = [\"10.98.0.0/20\"]\nblock_v4 = 28\n",
        "release_after = \"2s\"\n",
        "",
    )?;
    let ledger = Ledger::new("cf", 24)?;
    let ep = cluster.endpoint(0).to_string();
    let mut faults = Vec::new();
    let progress = ledger.run(&mut n, |n| {
        for round in 0..6 {
            let i = round % 3;
            n.cut_from_etcd(i)?;
            std::thread::sleep(Duration::from_millis(2500));
            n.heal(i)?;
            faults.push(format!("node-{i} cut off 2.5 s"));

            n.cuts[i].mute_on(b"claimed_at_ms");
            std::thread::sleep(Duration::from_secs(2));
            if n.cuts[i].muted() {
                faults.push(format!("node-{i} lost the answer to a claim"));
            }
            n.cuts[i].unmute();

            let key = format!("{prefix}blocks/pods/garbage-{round}");
            cluster.ctl(&[&ep], &["put", &key, "not a block record"])?;
            std::thread::sleep(Duration::from_secs(1));
            n.cli(&["unreadable", "delete", &key])?;
            faults.push(format!("garbage key {key}"));

            let k = (i + 1) % 3;
            n.agents[k].kill9();
            std::thread::sleep(Duration::from_millis(100));
            n.agents[k].respawn()?;
            n.agents[k].wait_ready()?;
            faults.push(format!("node-{k} killed"));
        }
        Ok(())
    })?;
    eprintln!("faults: {faults:#?}");
    eprintln!("(ADDs, DELs) acknowledged per node: {progress:?}");
    ensure!(
        faults.iter().filter(|f| f.contains("killed")).count() == 6,
        "{faults:?}"
    );
    // Every node has read etcd again since its last fault.
    std::thread::sleep(Duration::from_secs(6));
    let blocks = n.blocks()?;
    for (i, a) in n.agents.iter().enumerate() {
        let node = format!("node-{i}");
        let allocs = a.json(["allocations", "-o", "json"])?;
        for x in allocs.as_array().into_iter().flatten() {
            let Some(addr) = x["address"].as_str() else {
                continue;
            };
            let addr: std::net::IpAddr = addr.parse()?;
            ensure!(
                blocks.iter().any(|(b, o)| *o == node && b.contains(&addr)),
                "{node} holds {addr} outside every block etcd gives it"
            );
        }
    }
    ledger.check(&n)
}
