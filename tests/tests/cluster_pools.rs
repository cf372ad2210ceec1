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
//!  6. A node's own configured pool overlapping a cluster pool handed out
//!     addresses another node's block handed out too; the overlapping
//!     configured CIDR is now withheld while the node runs and refused at
//!     its next start, both sides named.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use ipnet::IpNet;
use lockstep_tests::cluster::{
    ClusterNodes, address_of, apply_pools, cluster_cli, cluster_config, cni, node_ip,
};
use lockstep_tests::etcd::EtcdCluster;
use lockstep_tests::{AgentOptions, AgentProc, Netns, privileged, until};

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

/// Waits until every node has read cluster pool `pool` (its status lists
/// it). No block is claimed for it until an allocation names it.
fn wait_pool_known(n: &ClusterNodes, pool: &str) -> anyhow::Result<()> {
    let started = Instant::now();
    loop {
        let knows = n
            .agents
            .iter()
            .filter(|a| {
                a.status_json().is_some_and(|s| {
                    s["cluster"]["pools"]
                        .as_array()
                        .is_some_and(|p| p.iter().any(|p| p["name"] == pool))
                })
            })
            .count();
        if knows == 3 {
            return Ok(());
        }
        ensure!(
            started.elapsed() < Duration::from_secs(30),
            "{knows} of 3 nodes read pool {pool}"
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
    wait_pool_known(&n, "aaa")?;
    wait_default(&n, "pods")?;
    // Nobody asked for it: no node claimed a block of it (#26 item 12).
    ensure!(
        !n.blocks()?.keys().any(|b| aaa_net.contains(&b.network())),
        "blocks of aaa claimed though nothing asked: {:?}",
        n.blocks()?
    );
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

/// node-0's own pool: a /27 a cluster pool will cover, and a /28 nothing
/// else uses.
const MINE: &str = "[[pools]]\nname = \"mine\"\nipv4 = [\"10.90.0.0/27\", \"10.90.1.0/28\"]\n";
/// The cluster pool applied later over node-0's /27: four /29 blocks
/// (a node takes one when an allocation first names the pool).
const MORE: &str = "[[pools]]\nname = \"more\"\nipv4 = [\"10.90.0.0/27\"]\nblock_v4 = 29\n";

#[test]
fn a_configured_pool_overlapping_the_cluster_is_withheld_and_refused_at_start() -> anyhow::Result<()>
{
    privileged!();
    let cluster = EtcdCluster::start(3)?;
    let prefix = "/ovl/";
    let mut n = ClusterNodes::build_each(&cluster, prefix, PODS, "", &|_| String::new(), &|i| {
        if i == 0 {
            MINE.to_string()
        } else {
            String::new()
        }
    })?;
    let overlap: IpNet = "10.90.0.0/27".parse()?;
    let spare: IpNet = "10.90.1.0/28".parse()?;

    // The cluster pool arrives over node-0's /27 while node-0 runs.
    apply_pools(
        &n.eps,
        prefix,
        &format!("default_pool = \"pods\"\n{PODS}{MORE}"),
    )?;
    // node-0 reads pools every 5 s: give it the time (it names the overlap
    // in its status once it has).
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(8) {
        let st = n.agents[0].status_json().unwrap_or_default();
        if st["cluster"]["configured_overlaps"]
            .as_array()
            .is_some_and(|a| !a.is_empty())
        {
            eprintln!(
                "node-0 saw the overlap after {:?}: {}",
                started.elapsed(),
                st["cluster"]["configured_overlaps"]
            );
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    // The other nodes hand out addresses there: the first allocation
    // naming the pool claims its first block (#26 item 12: on demand).
    let started = Instant::now();
    for i in [1, 2] {
        let mut k = 0;
        while k < 5 {
            let out = n.agents[i].cli([
                "allocate",
                "--kind",
                "endpoint",
                "--name",
                &format!("m{k}"),
                "--family",
                "ipv4",
                "--pool",
                "more",
            ])?;
            let err = String::from_utf8_lossy(&out.stderr);
            // Until the node has read the pool it is unknown, or known
            // without a CIDR.
            let not_yet = err.contains("unknown pool more") || err.contains("has no ipv4 CIDR");
            if not_yet && started.elapsed() < Duration::from_secs(30) {
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
            ensure!(out.status.success(), "allocate m{k} on node-{i}: {err}");
            k += 1;
        }
    }
    let blocks = n.blocks()?;
    let holders: std::collections::BTreeSet<&str> = blocks
        .iter()
        .filter(|(b, _)| overlap.contains(&b.network()))
        .map(|(_, node)| node.as_str())
        .collect();
    ensure!(
        holders.contains("node-1") && holders.contains("node-2"),
        "nodes 1 and 2 took no block of more: {blocks:?}"
    );
    // node-0 allocates from its own pool as much as it gives.
    let got = n.fill(0, "l", 44)?;
    // node-0's own block of `more` serves (the manager once refused it as
    // overlapping `mine`).
    let out = n.agents[0].cli([
        "allocate", "--kind", "endpoint", "--name", "own", "--family", "ipv4", "--pool", "more",
    ])?;
    ensure!(
        out.status.success(),
        "node-0 cannot allocate from its block of more: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let holders = n.holders()?;
    let twice: Vec<_> = holders.iter().filter(|(_, o)| o.len() > 1).collect();
    ensure!(
        twice.is_empty(),
        "{} addresses held twice: {twice:?}",
        twice.len()
    );
    let mine: Vec<IpAddr> = holders
        .iter()
        .filter(|(_, o)| o.iter().any(|h| h.starts_with("node-0")))
        .map(|(a, _)| *a)
        .collect();
    ensure!(
        got == 14
            && mine
                .iter()
                .filter(|a| !spare.contains(*a))
                .all(|a| overlap.contains(a))
            && mine.len() == 15,
        "node-0 gave {got} addresses, not the 14 of {spare}: {mine:?}"
    );
    // verify on node-0 names both sides and fails (the block once node-0
    // has read it: at most 5 s); the others are clean.
    let (b1, _) = blocks
        .iter()
        .find(|(b, node)| *node == "node-1" && overlap.contains(&b.network()))
        .context("checked above")?;
    let wants = [
        "cidr 10.90.0.0/27 of configured pool mine overlaps cidr 10.90.0.0/27 of cluster pool more"
            .to_string(),
        format!(
            "cidr 10.90.0.0/27 of configured pool mine overlaps block {b1} of cluster pool more held by node node-1"
        ),
    ];
    let started = Instant::now();
    loop {
        let out = n.agents[0].cli(["verify"])?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        ensure!(!out.status.success(), "verify on node-0 is clean: {text}");
        if wants.iter().all(|w| text.contains(w)) {
            eprintln!("verify on node-0:\n{text}");
            break;
        }
        ensure!(
            started.elapsed() < Duration::from_secs(10),
            "verify on node-0 does not say {wants:?}: {text}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let metrics = n.metrics(0)?;
    let count: usize = metrics
        .lines()
        .find_map(|l| l.strip_prefix("lockstep_cluster_configured_pool_overlaps "))
        .context("no overlap metric")?
        .trim()
        .parse()?;
    ensure!(count >= 2, "the metric counts {count} overlaps");
    n.wait_remote()?;
    for a in &n.agents[1..] {
        a.verify_within(Duration::from_secs(15))?;
    }
    // Restarted with the same configuration, node-0 refuses to start,
    // naming its pool and the cluster pool (from its local record).
    n.agents[0].respawn()?;
    refused_at_start(&mut n.agents[0], "node-0 restarted", &[])?;
    // A new node (no local record: the check is against etcd's pools and
    // blocks) with the same pool is refused as well, naming node-1's block.
    let fresh =
        cluster_config(&n.eps, prefix, "node-3", &node_ip(0)).replacen("pools = []\n", MINE, 1);
    let mut new = AgentProc::launch(
        &n.ns[0],
        &AgentOptions {
            extra: format!("{fresh}[datapath]\nuplink = \"u0\"\n"),
            unready: true,
            ..AgentOptions::default()
        },
    )?;
    let block = format!("overlaps block {b1} of cluster pool more held by node node-1");
    refused_at_start(&mut new, "node-3 started", &[&block])?;
    // The other nodes still hold theirs.
    ensure!(cluster_cli(&n.eps, prefix, &["blocks"])?.contains("node-1"));
    Ok(())
}

/// Waits for `agent` to exit refusing its configured pool `mine` over
/// cluster pool `more`; its last words must name both and each of `also`.
fn refused_at_start(agent: &mut AgentProc, what: &str, also: &[&str]) -> anyhow::Result<()> {
    let e = agent
        .wait_ready_within(Duration::from_secs(15))
        .err()
        .with_context(|| {
            format!("{what}: started with a configured pool overlapping a cluster pool")
        })?;
    let e = format!("{e:#}");
    let last = e.lines().last().unwrap_or_default();
    eprintln!("{what}: {last}");
    let both = "agent start-up failed: invalid request: cidr 10.90.0.0/27 of configured pool mine overlaps cidr 10.90.0.0/27 of cluster pool more";
    ensure!(
        last.contains(both)
            && last.contains("may not share addresses with the cluster's")
            && also.iter().all(|a| last.contains(a)),
        "{what}: the refusal does not name both: {e}"
    );
    Ok(())
}

/// A pool applied by mistake (#26 item 12).
const OOPS: &str = "[[pools]]\nname = \"oops\"\nipv4 = [\"10.95.0.0/24\"]\nblock_v4 = 28\n";

/// One IPAM-only endpoint address from cluster pool `pool` on node `i`:
/// the CLI's output.
fn allocate_from(
    n: &ClusterNodes,
    i: usize,
    pool: &str,
    name: &str,
) -> anyhow::Result<std::process::Output> {
    n.agents[i].cli([
        "allocate", "--kind", "endpoint", "--name", name, "--family", "ipv4", "--pool", pool,
    ])
}

/// The blocks of `cidr` etcd lists, each with its node.
fn blocks_in(n: &ClusterNodes, cidr: IpNet) -> anyhow::Result<Vec<(IpNet, String)>> {
    Ok(n.blocks()?
        .into_iter()
        .filter(|(b, _)| cidr.contains(&b.network()))
        .collect())
}

/// #26 item 12. A pool nobody asks for costs no block (before, every node
/// claimed a block of every pool as soon as it read it); removed while
/// nodes hold blocks of it, the apply is accepted (before: refused, the
/// blocks kept for ever) and the pool drains: nothing new comes from it,
/// an empty block is given back at once, the holders keep their addresses
/// and the pool is gone once its last block is.
#[test]
fn a_pool_applied_by_mistake_costs_no_block_and_drains_when_removed() -> anyhow::Result<()> {
    privileged!();
    let cluster = EtcdCluster::start(3)?;
    let prefix = "/drain/";
    let n = ClusterNodes::build(&cluster, prefix, PODS)?;
    let oops: IpNet = "10.95.0.0/24".parse()?;
    apply_pools(
        &n.eps,
        prefix,
        &format!("default_pool = \"pods\"\n{PODS}{OOPS}"),
    )?;
    wait_pool_known(&n, "oops")?;
    // Three rounds after every node read it: still no block.
    std::thread::sleep(Duration::from_secs(3));
    let early = blocks_in(&n, oops)?;
    ensure!(
        early.is_empty(),
        "{} blocks of oops claimed though no allocation named it: {early:?}",
        early.len()
    );
    // Named by an allocation: the block comes then.
    for (i, name) in [(0, "keep"), (1, "brief")] {
        let out = allocate_from(&n, i, "oops", name)?;
        ensure!(
            out.status.success(),
            "node-{i} allocate from oops: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let held = blocks_in(&n, oops)?;
    ensure!(held.len() == 2, "blocks of oops: {held:?}");

    // Removed while node-0 and node-1 hold blocks of it: accepted, named
    // as draining with its blocks.
    let dir = lockstep_tests::TempDir::new("drain-pools")?;
    let file = dir.path().join("pools.toml");
    std::fs::write(&file, format!("default_pool = \"pods\"\n{PODS}"))?;
    let out = n.cli(&[
        "pools",
        "apply",
        "-f",
        file.to_str().context("path")?,
        "--prune",
    ])?;
    eprintln!("{out}");
    ensure!(
        out.contains("pool oops is draining") && out.contains("node-0") && out.contains("node-1"),
        "{out}"
    );
    ensure!(
        n.cli(&["pools", "get"])?
            .lines()
            .any(|l| l.starts_with("oops\t") && l.ends_with("\tdraining")),
        "pools get does not mark oops as draining"
    );
    // Nothing new from it, on any node, once read (at most 5 s).
    until(Duration::from_secs(10), "node-2 refusing oops", || {
        let out = allocate_from(&n, 2, "oops", "late")?;
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        Ok(
            if !out.status.success() && err.contains("oops is being removed") {
                None
            } else {
                Some(format!("success {}: {err}", out.status.success()))
            },
        )
    })?;
    ensure!(blocks_in(&n, oops)?.len() == 2);
    // node-1's block emptied: given back at once (no release_after).
    n.agents[1].cli([
        "release", "--kind", "endpoint", "--name", "brief", "--family", "ipv4", "--pool", "oops",
    ])?;
    let took = until(Duration::from_secs(10), "node-1's block given back", || {
        let b = blocks_in(&n, oops)?;
        Ok(if b.iter().any(|(_, node)| node == "node-1") {
            Some(format!("{b:?}"))
        } else {
            None
        })
    })?;
    eprintln!("node-1's emptied block of the draining pool was given back after {took:?}");
    // node-0's holder keeps its address.
    ensure!(
        n.holders()?
            .iter()
            .any(|(a, o)| oops.contains(a) && o.iter().any(|h| h.starts_with("node-0"))),
        "node-0 lost its address in oops"
    );
    // Released: the last block goes, and the pool with it.
    n.agents[0].cli([
        "release", "--kind", "endpoint", "--name", "keep", "--family", "ipv4", "--pool", "oops",
    ])?;
    let took = until(Duration::from_secs(15), "oops removed", || {
        let b = blocks_in(&n, oops)?;
        let pools = n.cli(&["pools", "get"])?;
        Ok(if b.is_empty() && !pools.contains("oops") {
            None
        } else {
            Some(format!("blocks {b:?}; pools {pools}"))
        })
    })?;
    eprintln!("oops gone {took:?} after its last address was released");
    for (addr, owners) in n.holders()? {
        ensure!(owners.len() == 1, "{addr} held twice: {owners:?}");
    }
    n.wait_remote()?;
    for a in &n.agents {
        a.verify_within(Duration::from_secs(15))?;
    }
    Ok(())
}
