//! Two hosts with one node name (#26 item 5): cloned hosts, or a host name
//! reused, run agents that both default to one `node_name`. Every agent
//! has an instance identity kept in its state directory and written into
//! every block and node record, so:
//!
//! - an agent started while a live node key of its name holds another
//!   instance refuses to start, naming both instances;
//! - two agents started at once under one name never hand out one
//!   address twice: a block key written by one instance is not the
//!   other's, and the one that finds the name registered by another
//!   claims nothing more and says so in `verify`.
//!
//! Before, the second agent found "its" name on the first one's block key,
//! took the block as its own and handed out the same addresses.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use lockstep_tests::cluster::{apply_pools, cluster_cli, cluster_config, forward};
use lockstep_tests::etcd::EtcdCluster;
use lockstep_tests::{AgentOptions, AgentProc, Netns, privileged};

const POOLS: &str = "[[pools]]\nname = \"pods\"\nipv4 = [\"10.86.0.0/24\"]\nblock_v4 = 28\n";

/// A node namespace reaching etcd, with the underlay subnet on link.
fn node_ns(tag: &str, cluster: &EtcdCluster, ip: &str) -> anyhow::Result<Netns> {
    let ns = Netns::new(tag)?;
    ns.ip(["link", "add", "ul0", "type", "veth", "peer", "name", "ul1"])?;
    ns.ip(["addr", "add", &format!("{ip}/24"), "dev", "ul0"])?;
    ns.ip(["link", "set", "ul1", "up"])?;
    ns.ip(["link", "set", "ul0", "up"])?;
    forward(&ns, cluster)?;
    Ok(ns)
}

/// An agent named `name` in `ns`, not waited for.
fn launch(
    ns: &Netns,
    eps: &[String],
    prefix: &str,
    name: &str,
    ip: &str,
) -> anyhow::Result<AgentProc> {
    AgentProc::launch(
        ns,
        &AgentOptions {
            extra: cluster_config(eps, prefix, name, ip),
            unready: true,
            ..AgentOptions::default()
        },
    )
}

/// Up to `count` IPAM-only addresses from `agent` (stops at the first
/// refusal).
fn fill(agent: &AgentProc, tag: &str, count: usize) -> anyhow::Result<BTreeSet<IpAddr>> {
    let mut got = BTreeSet::new();
    let started = Instant::now();
    let mut k = 0;
    while k < count {
        let out = agent.cli([
            "allocate",
            "--kind",
            "endpoint",
            "--name",
            &format!("{tag}{k}"),
            "--family",
            "ipv4",
            "-o",
            "json",
        ])?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr).into_owned();
            // Just after start the first block may not be served yet.
            if err.contains("has no ipv4 CIDR") && started.elapsed() < Duration::from_secs(5) {
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
            eprintln!("{tag}{k}: {}", err.trim());
            break;
        }
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        got.insert(v["address"].as_str().context("address")?.parse()?);
        k += 1;
    }
    Ok(got)
}

/// The 32-hex-digit instance identities named in `text`.
fn instances(text: &str) -> BTreeSet<String> {
    text.split(|c: char| !c.is_ascii_hexdigit())
        .filter(|w| w.len() == 32)
        .map(str::to_string)
        .collect()
}

/// An agent started while another holds its name's live node key refuses
/// to start, naming both instances; the first keeps its blocks.
#[test]
fn a_second_host_with_a_live_nodes_name_refuses_to_start() -> anyhow::Result<()> {
    privileged!();
    let cluster = EtcdCluster::start(3)?;
    let eps = cluster.endpoints();
    let prefix = "/twin-s/";
    apply_pools(&eps, prefix, POOLS)?;
    let na = node_ns("twsa", &cluster, "192.0.2.1")?;
    let nb = node_ns("twsb", &cluster, "192.0.2.2")?;
    let mut a = launch(&na, &eps, prefix, "twin", "192.0.2.1")?;
    a.wait_ready()?;
    let first = fill(&a, "a", 5)?;
    ensure!(first.len() == 5, "the first agent gave {first:?}");
    let mut b = launch(&nb, &eps, prefix, "twin", "192.0.2.2")?;
    let refused = b.wait_ready_within(Duration::from_secs(20));
    let second = if refused.is_ok() {
        fill(&b, "b", 5)?
    } else {
        BTreeSet::new()
    };
    let both: Vec<_> = first.intersection(&second).collect();
    ensure!(
        refused.is_err(),
        "the second agent named twin started; addresses with two holders: {} {both:?}",
        both.len()
    );
    let e = format!("{:#}", refused.err().context("refused")?);
    let last = e.lines().last().unwrap_or_default().to_string();
    eprintln!("second agent: {last}");
    ensure!(
        last.contains("node name twin is in use by another agent") && instances(&last).len() == 2,
        "the refusal does not name both instances: {e}"
    );
    // The first is untouched: its addresses, its blocks, verify clean.
    ensure!(fill(&a, "c", 1)?.len() == 1);
    a.verify_within(Duration::from_secs(15))?;
    Ok(())
}

/// Two agents started at once under one name: whichever registers first
/// keeps the name; no address is handed out by both, and the other says
/// in `verify` that its name is taken.
#[test]
fn two_hosts_starting_at_once_under_one_name_never_share_an_address() -> anyhow::Result<()> {
    privileged!();
    let cluster = EtcdCluster::start(3)?;
    let eps = cluster.endpoints();
    let prefix = "/twin-r/";
    apply_pools(&eps, prefix, POOLS)?;
    let na = node_ns("twra", &cluster, "192.0.2.1")?;
    let nb = node_ns("twrb", &cluster, "192.0.2.2")?;
    let mut agents = [
        launch(&na, &eps, prefix, "twin", "192.0.2.1")?,
        launch(&nb, &eps, prefix, "twin", "192.0.2.2")?,
    ];
    let mut up = Vec::new();
    for (i, a) in agents.iter_mut().enumerate() {
        match a.wait_ready_within(Duration::from_secs(20)) {
            Ok(_) => up.push(i),
            Err(e) => eprintln!("agent {i} refused: {:#}", e),
        }
    }
    ensure!(!up.is_empty(), "neither agent started");
    let mut held: Vec<BTreeSet<IpAddr>> = vec![BTreeSet::new(), BTreeSet::new()];
    for &i in &up {
        held[i] = fill(&agents[i], &format!("r{i}-"), 10)?;
    }
    let both: Vec<_> = held[0].intersection(&held[1]).collect();
    ensure!(
        both.is_empty(),
        "addresses with two holders: {} {both:?}",
        both.len()
    );
    if up.len() == 2 {
        // Both started before either registered: the one whose name is
        // taken says so.
        let started = Instant::now();
        loop {
            let texts: Vec<String> = agents
                .iter()
                .map(|a| {
                    a.cli(["verify"])
                        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                        .unwrap_or_default()
                })
                .collect();
            let taken = texts
                .iter()
                .filter(|t| t.contains("node name twin is in use by another agent"))
                .count();
            if taken == 1 {
                break;
            }
            ensure!(
                started.elapsed() < Duration::from_secs(15),
                "{taken} agents say their name is taken: {texts:?}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    let blocks = cluster_cli(&eps, prefix, &["blocks"])?;
    eprintln!("blocks:\n{blocks}");
    Ok(())
}
