//! Pod IPAM from the Node's `spec.podCIDRs` (`[kubernetes] pod_cidr_pool`,
//! the install `lockstep manifests --mode pod-cidr` renders), against the
//! project's Kubernetes API double and the real plugin.
//!
//! - Endpoints added through the plugin get addresses of both families
//!   from the Node's podCIDRs, and none twice.
//! - Restarted while the API does not answer, the agent serves the same
//!   CIDRs from its record: the earlier endpoints keep their addresses and
//!   a new one gets an address of the CIDRs.
//! - A node whose Node has no podCIDRs, and no record, does not start, and
//!   says which Node and why; it never falls back to a default pool.
//! - A Node made again with other CIDRs (and a second family) is followed
//!   live: new endpoints get the new CIDRs at once, the old CIDR drains
//!   (its holder keeps its address, across a restart too) and is gone with
//!   its last holder (#44 item 5).

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use ipnet::IpNet;
use lockstep_tests::cluster::{cni, forward_ports};
use lockstep_tests::kubeapi::ApiDouble;
use lockstep_tests::{AgentProc, Netns, TempDir, privileged, unique};
use serde_json::{Value, json};

const CIDRS: [&str; 2] = ["10.79.3.0/24", "fd79:3::/120"];

fn config(kubeconfig: &std::path::Path, node: &str) -> String {
    format!(
        "pools = []\n[kubernetes]\nkubeconfig = \"{}\"\nnode_name = \"{node}\"\nnode_wait = \"1s\"\npod_cidr_pool = \"pods\"\n",
        kubeconfig.display()
    )
}

/// An endpoint through the plugin (no pool named: the default, the only
/// pool); its addresses.
fn add(agent: &AgentProc, keep: &mut Vec<Netns>) -> anyhow::Result<Vec<IpAddr>> {
    Ok(add_named(agent, keep)?.1)
}

/// As [`add`], with the endpoint's container ID.
fn add_named(agent: &AgentProc, keep: &mut Vec<Netns>) -> anyhow::Result<(String, Vec<IpAddr>)> {
    let ns = Netns::new("pcpod")?;
    let id = unique("pc");
    let (_, result) = cni(&agent.socket(), "ADD", &id, &ns.path())?;
    keep.push(ns);
    let addrs = result["ips"]
        .as_array()
        .context("no ips")?
        .iter()
        .map(|ip| {
            let a = ip["address"].as_str().context("address")?;
            Ok(a.split('/').next().unwrap_or(a).parse()?)
        })
        .collect::<anyhow::Result<Vec<IpAddr>>>()?;
    Ok((id, addrs))
}

fn inside(addrs: &[IpAddr]) -> anyhow::Result<()> {
    let nets: Vec<IpNet> = CIDRS.iter().map(|c| c.parse()).collect::<Result<_, _>>()?;
    ensure!(addrs.len() == 2, "one address per family: {addrs:?}");
    for a in addrs {
        ensure!(
            nets.iter().any(|n| n.contains(a)),
            "{a} is outside {CIDRS:?}"
        );
    }
    Ok(())
}

#[test]
fn endpoints_get_the_nodes_pod_cidrs_and_a_restart_without_the_api_keeps_them() -> anyhow::Result<()>
{
    privileged!();
    let api = ApiDouble::start()?;
    api.create(
        "nodes",
        "",
        &json!({"metadata": {"name": "node-1"}, "spec": {"podCIDR": CIDRS[0], "podCIDRs": CIDRS}}),
    )?;
    let dir = TempDir::new("podcidr")?;
    let kubeconfig = dir.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig)?;
    let node = Netns::new("pcnode")?;
    let cut = forward_ports(&node, &[api.addr().port()])?;
    let mut agent = AgentProc::start(&node, &config(&kubeconfig, "node-1"))?;
    let mut pods = Vec::new();
    let mut seen = BTreeSet::new();
    for _ in 0..4 {
        let addrs = add(&agent, &mut pods)?;
        inside(&addrs)?;
        for a in addrs {
            ensure!(seen.insert(a), "{a} handed out twice");
        }
    }
    let before: Value = agent.json(["allocations", "-o", "json"])?;

    // The API goes away; the agent restarts on its record.
    cut.set(true);
    agent.restart()?;
    let after: Value = agent.json(["allocations", "-o", "json"])?;
    ensure!(
        before == after,
        "allocations changed across the restart:\n{before}\n{after}"
    );
    let addrs = add(&agent, &mut pods)?;
    inside(&addrs)?;
    ensure!(
        addrs.iter().all(|a| !seen.contains(a)),
        "{addrs:?} handed out twice"
    );
    ensure!(
        agent.log().contains("serving the recorded ones"),
        "the agent did not say it served its record"
    );
    cut.set(false);
    Ok(())
}

/// Starts an agent named `name` against a double holding only the Node
/// `node` (no podCIDRs); waits until it stops, failing, and returns its
/// log.
fn refused_start(netns: &str, node: &str, name: &str) -> anyhow::Result<String> {
    let api = ApiDouble::start()?;
    api.create("nodes", "", &json!({"metadata": {"name": node}}))?;
    let dir = TempDir::new("podcidr")?;
    let kubeconfig = dir.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig)?;
    let ns = Netns::new(netns)?;
    let _cut = forward_ports(&ns, &[api.addr().port()])?;
    let mut agent = AgentProc::spawn_unready(&ns, &config(&kubeconfig, name))?;
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = agent.exited()? {
            break s;
        }
        ensure!(
            Instant::now() < deadline,
            "the agent did not stop: {}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    ensure!(!status.success(), "the agent exited 0");
    Ok(agent.log())
}

#[test]
fn a_node_without_pod_cidrs_does_not_start_and_says_why() -> anyhow::Result<()> {
    privileged!();
    let log = refused_start("pcnone", "node-2", "node-2")?;
    ensure!(
        log.contains("Node node-2 has no spec.podCIDRs") && log.contains("--allocate-node-cidrs"),
        "{log}"
    );
    Ok(())
}

/// #44 item 6: the API answers and has no Node of the agent's name (a
/// wrong name, or one not lowercased as kubelet registers it): the agent
/// does not start, naming the name, where it came from and NODE_NAME.
/// Before, it started and served with another node's identity.
#[test]
fn a_node_name_the_api_does_not_know_stops_the_start() -> anyhow::Result<()> {
    privileged!();
    let log = refused_start("pcname", "node-3", "Node-3")?;
    ensure!(
        log.contains("no Node named \"Node-3\"") && log.contains("NODE_NAME"),
        "{log}"
    );
    Ok(())
}

/// The pool `pods` as `lockstep pools -o json` shows it.
fn pods_pool(agent: &AgentProc) -> anyhow::Result<Value> {
    let pools = agent.json(["pools", "-o", "json"])?;
    pools
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == "pods")
        .cloned()
        .context("no pool pods")
}

/// #44 item 5: the Node's podCIDRs are followed while the agent runs.
/// Before, they were read once at start: a Node made again with other
/// CIDRs kept getting addresses of the old one, which the
/// controller-manager may since have given to another node.
#[test]
fn a_node_made_again_with_other_cidrs_is_followed_and_the_old_cidr_drains() -> anyhow::Result<()> {
    privileged!();
    const OLD: &str = "10.79.4.0/24";
    const NEW: [&str; 2] = ["10.79.5.0/24", "fd79:5::/120"];
    let api = ApiDouble::start()?;
    api.create(
        "nodes",
        "",
        &json!({"metadata": {"name": "node-4"}, "spec": {"podCIDR": OLD, "podCIDRs": [OLD]}}),
    )?;
    let dir = TempDir::new("podcidr")?;
    let kubeconfig = dir.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig)?;
    let node = Netns::new("pcmove")?;
    let _cut = forward_ports(&node, &[api.addr().port()])?;
    let mut agent = AgentProc::start(&node, &config(&kubeconfig, "node-4"))?;
    let mut pods = Vec::new();
    let (old_id, old_addrs) = add_named(&agent, &mut pods)?;
    let old: IpNet = OLD.parse()?;
    ensure!(
        old_addrs.len() == 1 && old.contains(&old_addrs[0]),
        "{old_addrs:?} is not one address of {OLD}"
    );

    // The Node is deleted and made again; the controller-manager gives it
    // other CIDRs, of both families now.
    api.delete("nodes", "", "node-4")?;
    api.create(
        "nodes",
        "",
        &json!({"metadata": {"name": "node-4"}, "spec": {"podCIDR": NEW[0], "podCIDRs": NEW}}),
    )?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let p = pods_pool(&agent)?;
        if p["draining"] == json!([OLD]) {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "the agent did not follow the Node: {p}\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let news: Vec<IpNet> = NEW.iter().map(|c| c.parse()).collect::<Result<_, _>>()?;
    let in_new = |addrs: &[IpAddr]| {
        addrs.len() == 2 && addrs.iter().all(|a| news.iter().any(|n| n.contains(a)))
    };
    let addrs = add(&agent, &mut pods)?;
    ensure!(
        in_new(&addrs),
        "{addrs:?} is not one address of each of {NEW:?}"
    );
    let held = agent.json(["allocations", "-o", "json"])?.to_string();
    ensure!(
        held.contains(&old_addrs[0].to_string()),
        "the old CIDR's holder lost {}: {held}",
        old_addrs[0]
    );

    // A restart keeps the holder in a draining range and serves the new
    // CIDRs (the record followed the Node).
    agent.restart()?;
    let p = pods_pool(&agent)?;
    ensure!(
        p["draining_ranges"]
            .to_string()
            .contains(&old_addrs[0].to_string()),
        "no draining range holds {} after the restart: {p}",
        old_addrs[0]
    );
    let addrs = add(&agent, &mut pods)?;
    ensure!(in_new(&addrs), "{addrs:?} after the restart");

    // The last holder goes: so does the old CIDR.
    cni(&agent.socket(), "DEL", &old_id, &pods[0].path())?;
    let p = pods_pool(&agent)?;
    ensure!(
        p["draining_ranges"].as_array().is_none_or(Vec::is_empty)
            && p["draining"].as_array().is_none_or(Vec::is_empty)
            && !p.to_string().contains("10.79.4."),
        "the old CIDR outlived its last holder: {p}"
    );
    Ok(())
}
