//! etcd restored from a backup (#26 item 3): every member restored with
//! `etcdctl snapshot restore`, so everything written after the backup is
//! gone — among it a block a node claimed and handed addresses out of.
//! Its holder must claim it again before any other node can, so no
//! address ends up with two holders; `verify` on every node is the oracle.
//!
//! Three node namespaces on a bridge underlay, a real 3-member etcd, one
//! agent per node (`ClusterNodes`).

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use ipnet::IpNet;
use lockstep_tests::cluster::ClusterNodes;
use lockstep_tests::etcd::EtcdCluster;
use lockstep_tests::{AgentProc, privileged};

/// The addresses `agent` holds, each with its owner's container ID (empty
/// for owners that are not endpoints).
fn held_by(agent: &AgentProc) -> anyhow::Result<Vec<(IpAddr, String)>> {
    agent
        .json(["allocations", "-o", "json"])?
        .as_array()
        .context("allocations")?
        .iter()
        .map(|x| {
            Ok((
                x["address"].as_str().context("address")?.parse()?,
                x["owner"]["container_id"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            ))
        })
        .collect()
}

/// Allocates one endpoint address named `name` on `agent`; whether it
/// got one.
fn allocate(agent: &AgentProc, name: &str) -> anyhow::Result<bool> {
    Ok(agent
        .cli([
            "allocate", "--kind", "endpoint", "--name", name, "--family", "ipv4",
        ])?
        .status
        .success())
}

/// The blocks etcd gives `node`.
fn blocks_of(n: &ClusterNodes, node: &str) -> anyhow::Result<BTreeSet<IpNet>> {
    Ok(n.blocks()?
        .into_iter()
        .filter(|(_, o)| o == node)
        .map(|(b, _)| b)
        .collect())
}

/// Addresses held by more than one node.
fn doubles(n: &ClusterNodes) -> anyhow::Result<Vec<(IpAddr, Vec<String>)>> {
    Ok(n.holders()?
        .into_iter()
        .filter(|(_, o)| o.len() > 1)
        .collect())
}

/// The scene both tests share, up to the restore: etcd, three nodes, the
/// backup, and the block node-0 claimed after it.
struct Scene {
    cluster: EtcdCluster,
    n: ClusterNodes,
    /// Holds the backup.
    _dir: lockstep_tests::TempDir,
    snap: std::path::PathBuf,
    /// The block node-0 claimed after the backup.
    d: IpNet,
    /// node-0's addresses in it.
    in_d: BTreeSet<IpAddr>,
}

/// The backup is taken with one block per node (and one free); node-0
/// then claims the free block and hands out addresses from it, and frees
/// some in its first block so it needs no new block: nothing but the
/// restore can make it claim one.
fn scene(prefix: &str) -> anyhow::Result<Scene> {
    let cluster = EtcdCluster::start(3)?;
    // Four blocks of 16: one per node at the backup, one spare.
    let pools = "[[pools]]\nname = \"pods\"\nipv4 = [\"10.95.0.0/26\"]\nblock_v4 = 28\n";
    let n = ClusterNodes::build(&cluster, prefix, pools)?;
    // A node answers once it has read the pool.
    let started = Instant::now();
    for (i, a) in n.agents.iter().enumerate() {
        while !allocate(a, "first")? {
            ensure!(
                started.elapsed() < Duration::from_secs(15),
                "node-{i} got no address"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    while n.blocks()?.len() != 3 {
        ensure!(
            started.elapsed() < Duration::from_secs(20),
            "{:?}",
            n.blocks()?
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let at_backup = blocks_of(&n, "node-0")?;
    let dir = lockstep_tests::TempDir::new("cluster-restore")?;
    let snap = dir.path().join("backup.db");
    cluster.snapshot(0, &snap)?;

    ensure!(n.fill(0, "more-", 20)? == 20, "node-0 stopped short");
    let now = blocks_of(&n, "node-0")?;
    let vanishing: Vec<IpNet> = now.difference(&at_backup).copied().collect();
    ensure!(
        vanishing.len() == 1,
        "node-0 holds {now:?}, had {at_backup:?}"
    );
    let d = vanishing[0];
    ensure!(n.blocks()?.len() == 4, "the pool is not full");
    let mut freed = 0;
    for (a, name) in held_by(&n.agents[0])? {
        if !d.contains(&a) && name.starts_with("more-") && freed < 12 {
            let out = n.agents[0].cli([
                "release", "--family", "ipv4", "--kind", "endpoint", "--name", &name,
            ])?;
            ensure!(
                out.status.success(),
                "release {name}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            freed += 1;
        }
    }
    let in_d: BTreeSet<IpAddr> = held_by(&n.agents[0])?
        .into_iter()
        .map(|(a, _)| a)
        .filter(|a| d.contains(a))
        .collect();
    ensure!(!in_d.is_empty(), "node-0 holds nothing in {d}");
    eprintln!(
        "after the backup node-0 claimed {d} and holds {} addresses in it",
        in_d.len()
    );
    Ok(Scene {
        cluster,
        n,
        _dir: dir,
        snap,
        d,
        in_d,
    })
}

/// Pushes node-1 and node-2 to want a new block for `for_how_long`
/// (each asks for up to 30 addresses); how many each got.
fn push_others(n: &ClusterNodes, for_how_long: Duration) -> anyhow::Result<[usize; 2]> {
    let mut asked = [0usize; 2];
    let mut got = [0usize; 2];
    let started = Instant::now();
    while started.elapsed() < for_how_long {
        for (k, i) in [1usize, 2].into_iter().enumerate() {
            if got[k] < 30 {
                let name = format!("after-{}", asked[k]);
                asked[k] += 1;
                if allocate(&n.agents[i], &name)? {
                    got[k] += 1;
                }
            }
        }
    }
    eprintln!(
        "after the restore node-1 got {} addresses, node-2 {}",
        got[0], got[1]
    );
    Ok(got)
}

/// What each node logged about the rollback and its blocks.
fn print_logs(n: &ClusterNodes) {
    for (i, a) in n.agents.iter().enumerate() {
        for l in a
            .log()
            .lines()
            .filter(|l| l.contains("back in time") || l.contains("claimed") || l.contains("FENCED"))
        {
            eprintln!("node-{i}: {l}");
        }
    }
}

/// Every member restored from the backup (with a new cluster token, as
/// docs/cluster.md's procedure says): the block node-0 claimed after it
/// vanishes from etcd. node-1 and node-2 are then pushed to want a new
/// block for longer than the grace a node keeps after a rollback. node-0
/// must claim its block back before either can: no address with two
/// holders, the block in etcd under node-0, `verify` clean on every node.
/// The previous build fenced the block as absent and node-1 or node-2
/// claimed it: 6 addresses with two holders.
#[test]
fn a_block_claimed_after_the_backup_is_claimed_back_by_its_holder_after_a_restore()
-> anyhow::Result<()> {
    privileged!();
    // With the same cluster token the nodes can tell the restore only from
    // etcd's revision, which here goes back by 2 only: a node whose first
    // read or watch answer comes after 2 new writes cannot tell it (2 of 4
    // runs held 6 addresses twice; docs/design/cluster.md). Not a test: the
    // procedure restores with a new token.
    let Scene {
        mut cluster,
        n,
        _dir,
        snap,
        d,
        in_d,
    } = scene("/restore-a/")?;
    cluster.restore_all_as_new_cluster(&snap)?;
    eprintln!("restored: etcd holds {:?}", n.blocks()?);
    let got = push_others(&n, Duration::from_secs(25))?;
    print_logs(&n);
    let twice = doubles(&n)?;
    eprintln!("addresses with two holders: {}", twice.len());
    ensure!(twice.is_empty(), "held twice: {twice:?}");
    // Both filled their own block and wanted another: the pool is full.
    ensure!(got[0] < 30 && got[1] < 30, "the others got {got:?}");
    let blocks = n.blocks()?;
    ensure!(
        blocks.get(&d).map(String::as_str) == Some("node-0"),
        "{d} is not node-0's in etcd: {blocks:?}"
    );
    let kept: BTreeSet<IpAddr> = held_by(&n.agents[0])?.into_iter().map(|(a, _)| a).collect();
    ensure!(kept.is_superset(&in_d), "node-0 lost addresses of {d}");
    ensure!(
        n.agents[0].log().contains("went back in time"),
        "node-0 did not tell etcd went back: {}",
        n.agents[0].log()
    );
    for (i, a) in n.agents.iter().enumerate() {
        a.verify_within(Duration::from_secs(10))
            .with_context(|| format!("node-{i} verify"))?;
    }
    Ok(())
}

/// A block its holder cannot claim back: node-0 is down through the
/// restore and past the grace, so node-1 or node-2 claims its block first.
/// node-0, started again, still tells that etcd went back in time (where
/// it last saw etcd is recorded in its state directory), finds the block
/// another node's and fences it: nothing new from it, its holders kept,
/// `verify` exits 1 naming the block, its holder and every address both
/// sides may hold.
#[test]
fn a_block_another_node_claimed_first_stays_fenced_and_verify_names_it() -> anyhow::Result<()> {
    privileged!();
    let Scene {
        mut cluster,
        mut n,
        _dir,
        snap,
        d,
        in_d,
    } = scene("/restore-b/")?;
    n.agents[0].kill9();
    cluster.restore_all_as_new_cluster(&snap)?;
    push_others(&n, Duration::from_secs(25))?;
    let blocks = n.blocks()?;
    let taker = blocks
        .get(&d)
        .with_context(|| format!("nobody claimed {d}: {blocks:?}"))?
        .clone();
    ensure!(taker != "node-0", "{d} is node-0's");
    n.agents[0].respawn()?;
    n.agents[0].wait_ready()?;
    let started = Instant::now();
    loop {
        let st = n.agents[0].status_json().context("status")?;
        if st["cluster"]["fenced"] == 1 && st["cluster"]["etcd_unreachable"].is_null() {
            break;
        }
        ensure!(
            started.elapsed() < Duration::from_secs(20),
            "node-0 has not fenced {d}: {st}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    print_logs(&n);
    let log = n.agents[0].log();
    ensure!(
        log.contains("went back in time") && log.contains("FENCED"),
        "node-0 did not tell etcd went back, or did not fence {d}: {log}"
    );
    let kept: BTreeSet<IpAddr> = held_by(&n.agents[0])?.into_iter().map(|(a, _)| a).collect();
    ensure!(kept.is_superset(&in_d), "node-0 lost addresses of {d}");
    let verify = n.agents[0].cli(["verify"])?;
    let text = String::from_utf8_lossy(&verify.stdout).into_owned();
    eprintln!("node-0 verify:\n{text}");
    ensure!(verify.status.code() == Some(1), "verify: {text}");
    ensure!(
        text.contains(&format!(
            "block {d} is fenced: etcd gives it to node {taker}"
        )),
        "{text}"
    );
    for a in &in_d {
        ensure!(
            text.contains(&format!("address {a} ("))
                && text.contains(&format!("is inside block {d} held by {taker}")),
            "verify does not name {a}: {text}"
        );
    }
    eprintln!(
        "addresses with two holders (named by node-0's verify): {}",
        doubles(&n)?.len()
    );
    Ok(())
}
