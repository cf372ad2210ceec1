//! #26 item 2: a partitioned node's blocks are not taken while it may
//! still serve them. Three node namespaces, a real 3-member etcd, one agent
//! per node (`lease_ttl` 3 s); node-2 is cut off from etcd by dropping its
//! packets to the members (its underlay up, its pods running).
//!
//! a. Partition, then `cluster node remove` without `--force` a few seconds
//!    into the cut (its lease already gone): refused, saying how long is
//!    left of `reclaim_after`; its blocks stay. Forced: the output says what
//!    it risks and names the addresses node-2 last published as in use.
//! b. Partition, then wait past a short `reclaim_after`: a live node frees
//!    node-2's blocks by itself; the node that claims them next does not
//!    hand out the addresses node-2's pods still hold; healed, node-2 fences
//!    the block, no address has two holders on any node, and as node-2's
//!    pods let their addresses go, it releases their reservations.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use ipnet::IpNet;
use lockstep_tests::cluster::poll as wait_for;
use lockstep_tests::cluster::{ClusterNodes, held_by};
use lockstep_tests::etcd::EtcdCluster;
use lockstep_tests::{Netns, privileged};

/// The live nodes etcd lists, with the addresses in use each published.
fn live_nodes(n: &ClusterNodes) -> anyhow::Result<BTreeMap<String, u64>> {
    let v: serde_json::Value = serde_json::from_str(&n.cli(&["nodes", "-o", "json"])?)?;
    v.as_array()
        .context("nodes")?
        .iter()
        .map(|x| {
            Ok((
                x["node"]["name"].as_str().context("name")?.to_string(),
                x["node"]["in_use"].as_u64().context("in_use")?,
            ))
        })
        .collect()
}

/// Starts the three nodes with `reclaim_after`; each adds one pod, and
/// node-2 three IPAM addresses more: returns the nodes, the pods'
/// namespaces, node-2's block and the addresses node-2 holds, once its
/// node key says it holds them (so they are published).
fn start(
    cluster: &EtcdCluster,
    tag: &str,
    reclaim_after: &str,
) -> anyhow::Result<(ClusterNodes, Vec<Netns>, IpNet, BTreeSet<IpAddr>)> {
    // Four blocks of 16: one per node and a spare.
    let pools = "[[pools]]\nname = \"pods\"\nipv4 = [\"10.94.0.0/26\"]\nblock_v4 = 28\n";
    let (n, pods) = ClusterNodes::with_pods(
        cluster,
        &format!("/reclaim-{tag}/"),
        pools,
        &format!("lease_ttl = \"3s\"\nreclaim_after = \"{reclaim_after}\"\n"),
        &format!("crc{tag}"),
    )?;
    ensure!(n.fill(2, "two-", 3)? == 3, "node-2 did not allocate 3");
    let held = held_by(&n.agents[2])?;
    let lost = n.blocks_of("node-2")?;
    ensure!(
        lost.len() == 1 && held.len() == 4,
        "node-2: {lost:?} {held:?}"
    );
    let x = *lost.iter().next().context("block")?;
    ensure!(held.iter().all(|a| x.contains(a)), "{held:?} not in {x}");
    wait_for(Duration::from_secs(10), "node-2 publishes 4 in use", || {
        Ok(live_nodes(&n)?.get("node-2") == Some(&4))
    })?;
    Ok((n, pods, x, held))
}

/// a. Cut off, node-2's lease ends within `lease_ttl`; a removal without
/// `--force` must wait for `reclaim_after` (60 s here) from then: node-2
/// may still serve its block. The previous build accepted it as soon as
/// the lease was gone.
#[test]
fn a_partitioned_node_is_not_removed_before_reclaim_after() -> anyhow::Result<()> {
    privileged!();
    let cluster = EtcdCluster::start(3)?;
    let (n, _pods, x, held) = start(&cluster, "a", "60s")?;

    n.cut_from_etcd(2)?;
    let cut = Instant::now();
    wait_for(Duration::from_secs(15), "node-2's key expires", || {
        Ok(!live_nodes(&n)?.contains_key("node-2"))
    })?;
    // A live node records since when at its next read (every 5 s); the
    // removal is refused either way.
    std::thread::sleep(Duration::from_secs(2));
    let into = cut.elapsed();
    let refused = n.cli(&["node", "remove", "node-2"]);
    let after = n.blocks_of("node-2")?;
    eprintln!(
        "node remove {:.1} s into the cut: {}; node-2 holds {after:?}",
        into.as_secs_f64(),
        match &refused {
            Ok(out) => format!("accepted: {out}"),
            Err(e) => format!("refused: {e:#}"),
        }
    );
    ensure!(
        refused.is_err(),
        "node remove without --force accepted {:.1} s into the cut (reclaim_after 60 s): {refused:?}",
        into.as_secs_f64()
    );
    let why = format!("{:#}", refused.err().context("refused")?);
    ensure!(
        why.contains("node-2")
            && why.contains("reclaim_after")
            && (why.contains("s left") || why.contains("not recorded yet")),
        "{why}"
    );
    ensure!(after == BTreeSet::from([x]), "node-2 holds {after:?}");

    // Forced: it says what it risks and names every address node-2 last
    // published as in use.
    let out = n.cli(&["node", "remove", "node-2", "--force"])?;
    eprintln!("{out}");
    ensure!(out.contains("may still be serving its blocks"), "{out}");
    for a in &held {
        ensure!(out.contains(&a.to_string()), "{a} not named: {out}");
    }
    let listed = n.cli(&["addresses"])?;
    ensure!(
        held.iter()
            .all(|a| listed.contains(&format!("{a}\tnode-2"))),
        "{listed}"
    );
    n.heal(2)?;
    Ok(())
}

/// b. Cut off past a short `reclaim_after` (6 s), node-2 loses its block
/// without an operator; node-1, filling up, claims it and hands out none
/// of node-2's four addresses; healed, node-2 fences it, no address has two
/// holders, and the addresses node-2's pods let go are released.
#[test]
fn a_node_gone_for_reclaim_after_loses_its_blocks_but_not_its_pods_addresses() -> anyhow::Result<()>
{
    privileged!();
    let cluster = EtcdCluster::start(3)?;
    let (n, _pods, x, held) = start(&cluster, "b", "6s")?;
    // node-0 takes the spare block: once node-2's is free, it is the only
    // one.
    let got = n.fill(0, "zero-", 20)?;
    ensure!(got == 20, "node-0 stopped at {got}");
    ensure!(n.blocks()?.len() == 4, "{:?}", n.blocks()?);

    n.cut_from_etcd(2)?;
    let cut = Instant::now();
    let freed = wait_for(Duration::from_secs(40), "node-2's block is freed", || {
        Ok(!n.blocks()?.contains_key(&x))
    });
    eprintln!("node-2's block {x} after the cut: {freed:?}");
    let freed = freed.with_context(|| format!("blocks now: {:?}", n.blocks().ok()))?;
    ensure!(
        freed >= Duration::from_secs(6),
        "freed {freed:?} into the cut, before reclaim_after"
    );
    eprintln!(
        "freed {:.1} s into the cut (lease_ttl 3 s, reclaim_after 6 s)",
        cut.elapsed().as_secs_f64()
    );

    // node-1 fills up: it claims x (the only free block) and gets every
    // address of it but node-2's four (and the pool's last address).
    let got = n.fill(1, "one-", 30)?;
    let blocks = n.blocks()?;
    ensure!(
        blocks.get(&x).map(String::as_str) == Some("node-1"),
        "node-1 took {got}; etcd: {blocks:?}"
    );
    let one = held_by(&n.agents[1])?;
    let in_x: BTreeSet<IpAddr> = one.iter().filter(|a| x.contains(*a)).copied().collect();
    let twice: Vec<&IpAddr> = in_x.intersection(&held).collect();
    eprintln!(
        "node-1 holds {} addresses in {x}; of node-2's 4 addresses it holds {}: {twice:?}",
        in_x.len(),
        twice.len()
    );
    ensure!(
        twice.is_empty(),
        "node-1 handed out {twice:?}, held by node-2's pods"
    );
    let dup = n.doubles()?;
    ensure!(
        dup.is_empty(),
        "addresses with two holders: {}: {dup:?}",
        dup.len()
    );

    // Healed: node-2 fences x; still nothing held twice, on any node.
    n.heal(2)?;
    let took = wait_for(Duration::from_secs(30), "node-2 fences its block", || {
        let st = n.agents[2].status_json().context("status")?;
        Ok(st["cluster"]["fenced"] == 1 && st["cluster"]["etcd_unreachable"].is_null())
    })?;
    eprintln!("healed: node-2 fenced {x} after {took:?}");
    ensure!(held_by(&n.agents[2])? == held, "node-2's addresses changed");
    let dup = n.doubles()?;
    ensure!(
        dup.is_empty(),
        "addresses with two holders: {}: {dup:?}",
        dup.len()
    );

    // node-2's IPAM addresses go: it releases their reservations, and
    // node-1 may hand them out again.
    for k in 0..3 {
        let out = n.agents[2].cli([
            "release",
            "--kind",
            "endpoint",
            "--name",
            &format!("two-{k}"),
            "--family",
            "ipv4",
        ])?;
        ensure!(
            out.status.success(),
            "release two-{k}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let left = held_by(&n.agents[2])?;
    ensure!(left.len() == 1, "node-2 holds {left:?}");
    wait_for(
        Duration::from_secs(15),
        "node-2 releases 3 reservations",
        || {
            let listed = n.cli(&["addresses"])?;
            Ok(listed.lines().count() == 1
                && left
                    .iter()
                    .all(|a| listed.contains(&format!("{a}\tnode-2"))))
        },
    )?;
    // node-1 (full) reads them released at its next read.
    let mut k = 0;
    wait_for(
        Duration::from_secs(15),
        "node-1 hands out the 3 released",
        || {
            k += 1;
            n.fill(1, &format!("more{k}-"), 1)?;
            let now = held_by(&n.agents[1])?;
            Ok(held.difference(&left).all(|a| now.contains(a)))
        },
    )?;
    let dup = n.doubles()?;
    ensure!(
        dup.is_empty(),
        "addresses with two holders: {}: {dup:?}",
        dup.len()
    );
    Ok(())
}

/// c. The same moment through `--force`: node-2, cut off, is
/// force-removed; node-1, filling up, claims its block. None of the four
/// addresses node-2 last published (its pod's and three more) may come
/// from node-1 while node-2's pods hold them; `cluster addresses release`
/// frees them by name once the operator knows the pods are gone. The
/// previous build handed out all four again: four addresses with two
/// holders.
#[test]
fn a_force_removed_nodes_published_addresses_are_not_handed_out_again() -> anyhow::Result<()> {
    privileged!();
    let cluster = EtcdCluster::start(3)?;
    let (n, _pods, x, held) = start(&cluster, "c", "1h")?;
    let got = n.fill(0, "zero-", 20)?;
    ensure!(got == 20, "node-0 stopped at {got}");
    n.cut_from_etcd(2)?;
    let out = n.cli(&["node", "remove", "node-2", "--force"])?;
    eprintln!("{out}");
    let got = n.fill(1, "one-", 30)?;
    ensure!(
        n.blocks()?.get(&x).map(String::as_str) == Some("node-1"),
        "node-1 took {got}: {:?}",
        n.blocks()?
    );
    let dup = n.doubles()?;
    eprintln!("addresses with two holders: {}: {dup:?}", dup.len());
    ensure!(
        dup.is_empty(),
        "addresses with two holders: {}: {dup:?}",
        dup.len()
    );

    // The operator releases them by name: node-1 may hand them out.
    let names: Vec<String> = held.iter().map(ToString::to_string).collect();
    let mut args = vec!["addresses", "release"];
    args.extend(names.iter().map(String::as_str));
    let out = n.cli(&args)?;
    ensure!(
        held.iter().all(|a| out.contains(&format!("released {a}"))),
        "{out}"
    );
    let mut k = 0;
    wait_for(
        Duration::from_secs(15),
        "node-1 hands out the released",
        || {
            k += 1;
            n.fill(1, &format!("more{k}-"), 1)?;
            let now = held_by(&n.agents[1])?;
            Ok(held.iter().all(|a| now.contains(a)))
        },
    )?;
    n.heal(2)?;
    Ok(())
}
