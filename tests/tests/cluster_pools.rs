//! Cluster pools as allocations see them (#26 items 10 and 11): three node
//! namespaces on a bridge underlay, a real 3-member etcd, one agent per
//! node.
//!
//! 10. Blocks with reserved addresses (/30 blocks of /30 CIDRs: 2 usable
//!     of 4) once stalled: a node got 2 addresses, then "try again" for
//!     ever while free blocks existed, because its capacity was counted
//!     as 4 per block.
//! 11. Adding a pool moved every request that names none to the pool first
//!     in etcd's key order; the default is now recorded and changes only
//!     when an apply names another.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use anyhow::ensure;
use ipnet::IpNet;
use lockstep_tests::cluster::{ClusterNodes, address_of, apply_pools, cni};
use lockstep_tests::etcd::EtcdCluster;
use lockstep_tests::{Netns, privileged};

#[test]
fn blocks_with_reserved_addresses_are_counted_by_usable_addresses() -> anyhow::Result<()> {
    privileged!();
    let cluster = EtcdCluster::start(3)?;
    // Eight /30 CIDRs cut in /30 blocks: 2 usable addresses each, 16 in all.
    let cidrs: Vec<String> = (0..8)
        .map(|i| format!("\"10.95.0.{}/30\"", i * 4))
        .collect();
    let pools = format!(
        "[[pools]]\nname = \"tiny\"\nipv4 = [{}]\nblock_v4 = 30\n",
        cidrs.join(", ")
    );
    let n = ClusterNodes::build(&cluster, "/tiny/", &pools)?;
    for (i, want) in [(0, 6), (1, 4), (2, 2)] {
        let got = n.fill(i, &format!("t{i}-"), want)?;
        ensure!(
            got == want,
            "node-{i} stopped at {got} of {want} addresses with free blocks in etcd: {:?}",
            n.blocks()?
        );
    }
    for (addr, owners) in n.holders()? {
        ensure!(owners.len() == 1, "{addr} held twice: {owners:?}");
        let last = match addr {
            IpAddr::V4(a) => a.octets()[3] % 4,
            IpAddr::V6(_) => 1,
        };
        ensure!(
            last == 1 || last == 2,
            "{addr} is a reserved first or last address"
        );
    }
    n.wait_remote()?;
    for a in &n.agents {
        a.verify_within(Duration::from_secs(15))?;
    }
    Ok(())
}

const PODS: &str = "[[pools]]\nname = \"pods\"\nipv4 = [\"10.94.0.0/20\"]\nblock_v4 = 28\n";
const AAA: &str = "[[pools]]\nname = \"aaa\"\nipv4 = [\"10.93.0.0/24\"]\nblock_v4 = 28\n";

/// Waits until every node holds a block of `cidr`: each has read the pool
/// and taken it into its allocator.
fn wait_blocks_in(n: &ClusterNodes, cidr: IpNet) -> anyhow::Result<()> {
    let started = Instant::now();
    loop {
        let holders: std::collections::BTreeSet<String> = n
            .blocks()?
            .into_iter()
            .filter(|(b, _)| cidr.contains(&b.network()))
            .map(|(_, node)| node)
            .collect();
        if holders.len() == 3 {
            return Ok(());
        }
        ensure!(
            started.elapsed() < Duration::from_secs(30),
            "not every node took a block of {cidr}: {holders:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Waits until every node's status names `pool` as its default pool.
fn wait_default(n: &ClusterNodes, pool: &str) -> anyhow::Result<()> {
    let started = Instant::now();
    loop {
        let defaults: Vec<String> = n
            .agents
            .iter()
            .map(|a| {
                a.status_json()
                    .map(|s| s["default_pool"].to_string())
                    .unwrap_or_default()
            })
            .collect();
        if defaults.iter().all(|d| d == &format!("\"{pool}\"")) {
            return Ok(());
        }
        ensure!(
            started.elapsed() < Duration::from_secs(20),
            "default pools {defaults:?}, want {pool}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// One endpoint per node through the CNI plugin, naming no pool: each
/// address must be in `cidr`.
fn adds_land_in(n: &ClusterNodes, tag: &str, cidr: IpNet) -> anyhow::Result<Vec<Netns>> {
    let mut pods = Vec::new();
    for i in 0..3 {
        let ns = Netns::new(&format!("{tag}{i}"))?;
        let (_, answer) = cni(
            &n.agents[i].socket(),
            "ADD",
            &format!("{tag}-{i}"),
            &ns.path(),
        )?;
        let a: IpAddr = address_of(&answer)?;
        ensure!(
            cidr.contains(&a),
            "node-{i}: a request naming no pool got {a}, not from {cidr}"
        );
        pods.push(ns);
    }
    Ok(pods)
}

#[test]
fn adding_a_pool_never_moves_the_default_and_naming_one_does() -> anyhow::Result<()> {
    privileged!();
    let cluster = EtcdCluster::start(3)?;
    let prefix = "/dflt/";
    // A single-pool setup, applied as before (no default named).
    let n = ClusterNodes::build(&cluster, prefix, PODS)?;
    let pods_net: IpNet = "10.94.0.0/20".parse()?;
    let aaa_net: IpNet = "10.93.0.0/24".parse()?;
    let mut keep = adds_land_in(&n, "cdfa", pods_net)?;

    // `aaa` sorts before `pods` in etcd: adding it moves nothing.
    apply_pools(&n.eps, prefix, &format!("{PODS}{AAA}"))?;
    wait_blocks_in(&n, aaa_net)?;
    wait_default(&n, "pods")?;
    keep.extend(adds_land_in(&n, "cdfb", pods_net)?);

    // Refused, nothing stored: a default that is no pool, and an apply
    // dropping the default without naming another.
    let before = n.cli(&["pools", "get", "-o", "json"])?;
    let e = apply_pools(
        &n.eps,
        prefix,
        &format!("default_pool = \"nope\"\n{PODS}{AAA}"),
    )
    .expect_err("an unknown default was accepted");
    ensure!(
        format!("{e:#}").contains("default_pool nope is not a cluster pool"),
        "{e:#}"
    );
    let bbb = "[[pools]]\nname = \"bbb\"\nipv4 = [\"10.92.0.0/24\"]\nblock_v4 = 28\n";
    let e =
        apply_pools(&n.eps, prefix, &format!("{AAA}{bbb}")).expect_err("the default was dropped");
    ensure!(
        format!("{e:#}").contains("removes cluster pool pods, the default"),
        "{e:#}"
    );
    ensure!(n.cli(&["pools", "get", "-o", "json"])? == before);

    // Named: it moves, on every node.
    apply_pools(
        &n.eps,
        prefix,
        &format!("default_pool = \"aaa\"\n{PODS}{AAA}"),
    )?;
    ensure!(
        n.cli(&["pools", "get"])?
            .lines()
            .any(|l| l.starts_with("aaa\t") && l.ends_with("\tdefault")),
        "pools get does not mark aaa as the default"
    );
    wait_default(&n, "aaa")?;
    keep.extend(adds_land_in(&n, "cdfc", aaa_net)?);
    for (addr, owners) in n.holders()? {
        ensure!(owners.len() == 1, "{addr} held twice: {owners:?}");
    }
    n.wait_remote()?;
    for a in &n.agents {
        a.verify_within(Duration::from_secs(15))?;
    }
    drop(keep);
    Ok(())
}
