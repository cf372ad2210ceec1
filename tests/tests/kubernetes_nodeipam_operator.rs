//! #44 item 5: multi-pool pod IPAM with only the API server. Three node
//! namespaces, each agent with `[kubernetes.nodeipam] operator = true` and
//! no `[cluster]`, the project's API double, pods made by the real CNI
//! plugin. The elected LB writer is the NodeIPAM operator: it offers each
//! node CIDRs of the PodIPPool `eni` (a /26 in /28 blocks) from the demand
//! the node writes.
//!
//! - Every node is offered one /28 for its pre-allocation, no two the same
//!   (before: nothing in lockstep filled NodeIPAM, the objects stayed
//!   without an offer and pods got no address).
//! - A node whose pods outgrow its /28 is offered a second; the pool is
//!   then exhausted, and another node that outgrows its /28 gets nothing
//!   more, while no address is ever handed out twice.
//! - The first node's pods go: its second /28 is withdrawn, released by
//!   the node once empty, and offered to the waiting node.
//! - Every request the agents sent is one `deploy/rbac.yaml` allows.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::Duration;

use anyhow::{Context, ensure};
use ipnet::IpNet;
use lockstep_tests::cluster::cni;
use lockstep_tests::kube_lab::KubeLab;
use lockstep_tests::{Netns, privileged, unique, wait_for};
use serde_json::json;

/// A pod made through CNI ADD on a node.
struct Pod {
    ns: Netns,
    id: String,
    addr: IpAddr,
}

/// A pod on `node`. Tried again while the node's CIDRs are full, as
/// kubelet does: the offer for its demand comes within a few passes.
fn add(k: &KubeLab, node: usize) -> anyhow::Result<Pod> {
    let ns = Netns::new("nopod")?;
    let id = unique("nop");
    let socket = k.lab.agents[node].socket();
    let result = wait_for(
        &format!("an address on node-{node}"),
        Duration::from_secs(10),
        || cni(&socket, "ADD", &id, &ns.path()).ok().map(|(_, r)| r),
    )?;
    let addr = result["ips"][0]["address"]
        .as_str()
        .and_then(|a| a.split('/').next())
        .context("no address")?
        .parse()?;
    Ok(Pod { ns, id, addr })
}

fn del(k: &KubeLab, node: usize, pod: &Pod) -> anyhow::Result<()> {
    cni(&k.lab.agents[node].socket(), "DEL", &pod.id, &pod.ns.path()).map(drop)
}

/// Node `i`'s offer of pool `eni` (status) and what it lists as held
/// (spec).
fn of(k: &KubeLab, i: usize) -> (BTreeSet<IpNet>, BTreeSet<IpNet>) {
    let Ok(o) = k.api.get("nodeipams", "", &format!("node-{i}")) else {
        return Default::default();
    };
    let set = |v: &serde_json::Value| -> BTreeSet<IpNet> {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c.as_str()?.parse().ok())
            .collect()
    };
    let offer = o["status"]["pools"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == "eni")
        .map(|p| set(&p["ipv4"]))
        .unwrap_or_default();
    let held = o["spec"]["pools"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == "eni")
        .map(|p| set(&p["cidrs"]))
        .unwrap_or_default();
    (offer, held)
}

/// Waits until node `i`'s offer has `n` /28s; returns them.
fn wait_offer(k: &KubeLab, i: usize, n: usize) -> anyhow::Result<BTreeSet<IpNet>> {
    wait_for(
        &format!("node-{i} offered {n} CIDRs"),
        Duration::from_secs(20),
        || {
            let (offer, _) = of(k, i);
            (offer.len() == n).then_some(offer)
        },
    )
}

#[test]
fn the_writer_offers_each_node_cidrs_as_its_demand_asks() -> anyhow::Result<()> {
    privileged!();
    let config = "[kubernetes.nodeipam]\noperator = true\ninterval = \"200ms\"\n\
                  [[kubernetes.nodeipam.pools]]\nname = \"eni\"\npre_allocate = 2\n";
    let k = KubeLab::build_local([json!({}), json!({}), json!({})], &|_| {
        format!("node_wait = \"2s\"\n{config}")
    })?;
    let r = scenario(&k);
    if r.is_err() {
        for (i, a) in k.lab.agents.iter().enumerate() {
            eprintln!("--- node-{i} log ---\n{}", a.log());
        }
    }
    r
}

fn scenario(k: &KubeLab) -> anyhow::Result<()> {
    k.api.create(
        "podippools",
        "",
        &json!({"apiVersion": "lockstep.io/v1alpha1", "kind": "PodIPPool",
                "metadata": {"name": "eni"},
                "spec": {"ipv4": ["10.77.0.0/26"], "blockV4": 28}}),
    )?;
    // One /28 each, none shared.
    let mut first = BTreeMap::new();
    for i in 0..3 {
        first.insert(i, wait_offer(k, i, 1)?);
    }
    let all: BTreeSet<IpNet> = first.values().flatten().copied().collect();
    ensure!(all.len() == 3, "a /28 offered twice: {first:?}");

    // Node 0 outgrows its /28: a second, the last free one.
    let mut seen = BTreeSet::new();
    let mut pods0 = Vec::new();
    for _ in 0..20 {
        let p = add(k, 0)?;
        ensure!(seen.insert(p.addr), "{} handed out twice", p.addr);
        pods0.push(p);
    }
    let two = wait_offer(k, 0, 2)?;
    let second = *two.difference(&first[&0]).next().context("a second /28")?;
    ensure!(
        pods0
            .iter()
            .all(|p| two.iter().any(|c| c.contains(&p.addr))),
        "node-0's pods outside its offer {two:?}"
    );

    // Node 1 outgrows its /28 too: the pool is exhausted.
    let mut pods1 = Vec::new();
    for _ in 0..15 {
        let p = add(k, 1)?;
        ensure!(seen.insert(p.addr), "{} handed out twice", p.addr);
        pods1.push(p);
    }
    std::thread::sleep(Duration::from_secs(1));
    ensure!(of(k, 1).0.len() == 1, "node-1 offered a /28 nobody freed");

    // Node 0's pods go: its second /28 is withdrawn, released, and
    // offered to node 1.
    for p in &pods0 {
        del(k, 0, p)?;
    }
    let moved = wait_offer(k, 1, 2)?;
    ensure!(
        moved.contains(&second),
        "node-1 was offered {moved:?}, not node-0's released {second}"
    );
    let (offer0, held0) = of(k, 0);
    ensure!(
        !offer0.contains(&second) && !held0.contains(&second),
        "node-0 still has {second}: offered {offer0:?}, held {held0:?}"
    );
    // Node 1's new pod comes from it.
    let p = add(k, 1)?;
    ensure!(seen.insert(p.addr), "{} handed out twice", p.addr);
    ensure!(
        moved.iter().any(|c| c.contains(&p.addr)),
        "{} outside {moved:?}",
        p.addr
    );
    pods1.push(p);
    for p in &pods1 {
        del(k, 1, p)?;
    }
    k.ensure_requests_allowed()
}
