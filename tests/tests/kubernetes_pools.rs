//! The cluster seen through the Kubernetes API (#29 items 1 and 4), end to
//! end: the API double (tests/src/kubeapi) on loopback, three node
//! namespaces running agents in cluster mode on a real 3-member etcd, and
//! the real CNI plugin called as kubelet calls it.
//!
//! (a) `PodIPPool` objects are the cluster pools: the elected writer
//!     applies them through etcd's `cluster pools apply` checks; a pod
//!     annotated for one and a pod in an annotated namespace get addresses
//!     from it; an object the checks refuse says why in its status and
//!     changes nothing stored; `cluster pools apply` then refuses; a pool
//!     whose object is deleted while in use drains.
//! (c) A Node deleted from the API: its blocks are released only once its
//!     agent's lease has been gone `reclaim_after` (the rule of `cluster
//!     node remove` without `--force`), the addresses its pods last used
//!     stay reserved until the API binds no pod to it, and a Node deleted
//!     while its agent runs keeps everything.
//!
//! The double's limits are listed in tests/src/kubeapi/mod.rs; the
//! ClusterRole is checked against every request the agents sent.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use ipnet::IpNet;
use lockstep_tests::cluster::{apply_pools, cluster_cli, held_by};
use lockstep_tests::etcd::EtcdCluster;
use lockstep_tests::kube_lab::KubeLab;
use lockstep_tests::kube_pods::{add, add_ok, del, namespace, pod};
use lockstep_tests::{privileged, unique, wait_for};
use serde_json::{Value, json};

fn cidr(text: &str) -> IpNet {
    text.parse().expect("cidr")
}

/// Waits for `f` to say yes (an error counts as no).
fn until(
    what: &str,
    limit: Duration,
    mut f: impl FnMut() -> anyhow::Result<bool>,
) -> anyhow::Result<()> {
    wait_for(what, limit, || f().ok().filter(|yes| *yes).map(|_| ()))
}

/// Creates PodIPPool `name` with `spec`.
fn pod_pool(lab: &KubeLab, name: &str, spec: Value) -> anyhow::Result<()> {
    lab.api.create(
        "podippools",
        "",
        &json!({"metadata": {"name": name}, "spec": spec}),
    )?;
    Ok(())
}

/// The Accepted condition of PodIPPool `name`: (status, reason, message),
/// and its status counts.
fn accepted(lab: &KubeLab, name: &str) -> Option<(String, String, String, Value)> {
    let o = lab.api.get("podippools", "", name).ok()?;
    let c = o["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "Accepted")?
        .clone();
    Some((
        c["status"].as_str()?.to_string(),
        c["reason"].as_str()?.to_string(),
        c["message"].as_str()?.to_string(),
        o["status"].clone(),
    ))
}

/// The stored cluster pools, as `cluster pools get -o json` lists them.
fn pools_get(eps: &[String], prefix: &str) -> anyhow::Result<Vec<Value>> {
    let v: Value =
        serde_json::from_str(&cluster_cli(eps, prefix, &["pools", "get", "-o", "json"])?)?;
    Ok(v.as_array().context("pools")?.clone())
}

/// The stored cluster pools: name → draining.
fn stored_pools(eps: &[String], prefix: &str) -> anyhow::Result<Vec<(String, bool)>> {
    pools_get(eps, prefix)?
        .iter()
        .map(|p| {
            Ok((
                p["name"].as_str().context("name")?.to_string(),
                p["draining"].as_bool().unwrap_or(false),
            ))
        })
        .collect()
}

/// Sets PodIPPool `name`'s IPv4 CIDRs to `cidr` and waits for its
/// Accepted condition to read `want`; returns the condition.
fn edit_v4(
    lab: &KubeLab,
    name: &str,
    cidr: &str,
    want: &str,
) -> anyhow::Result<(String, String, String, Value)> {
    lab.api.patch(
        "podippools",
        "",
        name,
        &json!({"spec": {"ipv4": [cidr]}}),
        false,
    )?;
    until(
        &format!("{name} Accepted={want}"),
        Duration::from_secs(10),
        || Ok(accepted(lab, name).is_some_and(|a| a.0 == want)),
    )?;
    accepted(lab, name).context("no condition")
}

#[test]
fn pod_ip_pools_are_the_cluster_pools_and_pods_pick_them_by_annotation() -> anyhow::Result<()> {
    privileged!();
    let cluster = EtcdCluster::start(3)?;
    let eps = cluster.endpoints();
    let prefix = format!("/{}/", unique("kpools"));
    let lab = KubeLab::build_keys(
        &cluster,
        &prefix,
        [json!({}), json!({}), json!({})],
        "release_after = \"2s\"\n",
        &|_| "pod_pools = true\n[kubernetes.pods]\npool_wait = \"3s\"\n".to_string(),
    )?;
    pod_pool(
        &lab,
        "pods",
        json!({"ipv4": ["10.96.0.0/24"], "blockV4": 28, "default": true}),
    )?;
    pod_pool(
        &lab,
        "blue",
        json!({"ipv4": ["10.97.0.0/24"], "blockV4": 28}),
    )?;
    pod_pool(
        &lab,
        "green",
        json!({"ipv4": ["10.98.0.0/24"], "blockV4": 28}),
    )?;
    let started = Instant::now();
    until("the pools applied", Duration::from_secs(20), || {
        Ok(["pods", "blue", "green"]
            .iter()
            .all(|n| accepted(&lab, n).is_some_and(|a| a.0 == "True")))
    })
    .with_context(|| {
        format!(
            "statuses: {:?}\nnode-0's log:\n{}",
            ["pods", "blue", "green"].map(|n| accepted(&lab, n)),
            lab.lab.agents[0].log()
        )
    })?;
    eprintln!(
        "PodIPPools applied and their statuses written in {:?}",
        started.elapsed()
    );
    // Overlaps stored blue: refused, said on the object, nothing of it
    // stored.
    pod_pool(
        &lab,
        "bad",
        json!({"ipv4": ["10.97.0.128/25"], "blockV4": 28}),
    )?;
    until("bad's condition", Duration::from_secs(10), || {
        Ok(accepted(&lab, "bad").is_some())
    })?;
    let bad = accepted(&lab, "bad").context("bad has no condition")?;
    ensure!(
        bad.0 == "False" && bad.2.contains("10.97.0.128/25"),
        "bad's condition: {bad:?}"
    );
    eprintln!("bad: {} {}: {}", bad.0, bad.1, bad.2);
    let stored = stored_pools(&eps, &prefix)?;
    let names: BTreeSet<&str> = stored.iter().map(|(n, _)| n.as_str()).collect();
    ensure!(
        names == BTreeSet::from(["pods", "blue", "green"]),
        "stored pools: {stored:?}"
    );
    // The CLI no longer owns them.
    let dir = lockstep_tests::TempDir::new("kpools")?;
    let file = dir.path().join("pools.toml");
    std::fs::write(
        &file,
        "[[pools]]\nname = \"x\"\nipv4 = [\"10.99.0.0/24\"]\n",
    )?;
    let refused = cluster_cli(
        &eps,
        &prefix,
        &["pools", "apply", "-f", file.to_str().context("path")?],
    )
    .expect_err("cluster pools apply must refuse while PodIPPools own the pools");
    ensure!(
        format!("{refused:#}").contains("PodIPPool"),
        "the refusal does not say why: {refused:#}"
    );
    // Every agent learns the cluster pools from etcd (its next read).
    for (i, agent) in lab.lab.agents.iter().enumerate() {
        until(
            &format!("node-{i} knows the pools"),
            Duration::from_secs(20),
            || {
                let pools = agent.json(["pools", "-o", "json"])?;
                let names: BTreeSet<&str> = pools
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|p| p["name"].as_str())
                    .collect();
                Ok(["pods", "blue", "green"].iter().all(|n| names.contains(n)))
            },
        )?;
    }
    eprintln!(
        "every agent knows the pools {:?} after they were applied",
        started.elapsed()
    );
    // Pods pick pools by annotation, the pod's else its namespace's.
    namespace(&lab, "shop", Some("green"))?;
    namespace(&lab, "plain", None)?;
    pod(&lab, "shop", "web", 0, Some("blue"))?;
    pod(&lab, "shop", "db", 1, None)?;
    pod(&lab, "plain", "x", 2, None)?;
    let agents = &lab.lab.agents;
    let mut held = Vec::new();
    for (i, ns, name, want) in [
        (0, "shop", "web", cidr("10.97.0.0/24")),
        (1, "shop", "db", cidr("10.98.0.0/24")),
        (2, "plain", "x", cidr("10.96.0.0/24")),
    ] {
        let (sb, a) = add_ok(&agents[i], ns, name, None)?;
        ensure!(want.contains(&a), "{ns}/{name} got {a}, not from {want}");
        eprintln!("{ns}/{name}: {a} (from {want})");
        held.push((i, sb));
    }
    // Counts follow the blocks claimed.
    until("blue counts its block", Duration::from_secs(10), || {
        Ok(accepted(&lab, "blue").is_some_and(|a| a.3["blocks"] == 1 && a.3["nodes"] == 1))
    })?;
    eprintln!("blue status: {}", accepted(&lab, "blue").context("blue")?.3);
    // blue's CIDR replaced while shop/web holds an address in it: refused
    // as `cluster pools apply` refuses it, the stored pool unchanged.
    let said = edit_v4(&lab, "blue", "10.99.0.0/24", "False")?;
    ensure!(
        said.2.contains("10.97.0.0/24"),
        "blue's refusal does not name the CIDR in use: {said:?}"
    );
    eprintln!("blue's CIDR edit refused: {}", said.2);
    let stored_blue = pools_get(&eps, &prefix)?
        .into_iter()
        .find(|p| p["name"] == "blue")
        .context("blue not stored")?
        .to_string();
    ensure!(
        stored_blue.contains("10.97.0.0/24") && !stored_blue.contains("10.99.0.0/24"),
        "stored blue changed: {stored_blue}"
    );
    edit_v4(&lab, "blue", "10.97.0.0/24", "True")?;
    // The green object deleted while shop/db holds an address: drains.
    lab.api.delete("podippools", "", "green")?;
    until("green drains", Duration::from_secs(10), || {
        Ok(stored_pools(&eps, &prefix)?.contains(&("green".to_string(), true)))
    })?;
    let (code, v) = {
        let (_sb, code, v) = add(&agents[1], "shop", "db2", None)?;
        (code, v)
    };
    ensure!(code != 0, "an ADD from draining green succeeded: {v}");
    eprintln!("ADD into draining green refused: {}", v["msg"]);
    ensure!(
        held_by(&agents[1])?.len() == 1,
        "shop/db lost its address while green drains"
    );
    // Its last address gone, the pool goes.
    let (i, sb) = held.remove(1);
    del(&agents[i], &sb)?;
    until("green removed", Duration::from_secs(20), || {
        Ok(!stored_pools(&eps, &prefix)?
            .iter()
            .any(|(n, _)| n == "green"))
    })?;
    for (i, sb) in &held {
        del(&agents[*i], sb)?;
    }
    let outside = lab.outside_rbac()?;
    ensure!(
        outside.is_empty(),
        "requests outside deploy/rbac.yaml: {outside:?}"
    );
    Ok(())
}

/// Blocks etcd gives `node`.
fn blocks_of(eps: &[String], prefix: &str, node: &str) -> anyhow::Result<BTreeSet<IpNet>> {
    let v: Value = serde_json::from_str(&cluster_cli(eps, prefix, &["blocks", "-o", "json"])?)?;
    v.as_array()
        .context("blocks")?
        .iter()
        .filter(|b| b["node"] == node)
        .map(|b| Ok(b["cidr"].as_str().context("cidr")?.parse()?))
        .collect()
}

/// Addresses reserved for `node`.
fn reserved_for(eps: &[String], prefix: &str, node: &str) -> anyhow::Result<BTreeSet<IpAddr>> {
    let v: Value = serde_json::from_str(&cluster_cli(eps, prefix, &["addresses", "-o", "json"])?)?;
    v.as_array()
        .context("addresses")?
        .iter()
        .filter(|r| r["node"] == node)
        .map(|r| Ok(r["address"].as_str().context("address")?.parse()?))
        .collect()
}

#[test]
fn a_deleted_node_loses_its_blocks_only_after_reclaim_after_and_its_reserved_addresses_with_its_pods()
-> anyhow::Result<()> {
    privileged!();
    let cluster = EtcdCluster::start(3)?;
    let eps = cluster.endpoints();
    let prefix = format!("/{}/", unique("knodes"));
    apply_pools(
        &eps,
        &prefix,
        "default_pool = \"pods\"\n[[pools]]\nname = \"pods\"\nipv4 = [\"10.96.0.0/24\"]\nblock_v4 = 28\n",
    )?;
    let reclaim_after = Duration::from_secs(10);
    let mut lab = KubeLab::build_keys(
        &cluster,
        &prefix,
        [json!({}), json!({}), json!({})],
        &format!(
            "lease_ttl = \"2s\"\nreclaim_after = \"{}s\"\n",
            reclaim_after.as_secs()
        ),
        &|_| String::new(),
    )?;
    namespace(&lab, "sys", None)?;
    pod(&lab, "sys", "p1", 1, None)?;
    pod(&lab, "sys", "p2", 2, None)?;
    let (sb1, _) = add_ok(&lab.lab.agents[1], "sys", "p1", None)?;
    let (_sb2, a2) = add_ok(&lab.lab.agents[2], "sys", "p2", None)?;
    let node1 = blocks_of(&eps, &prefix, "node-1")?;
    let node2 = blocks_of(&eps, &prefix, "node-2")?;
    ensure!(
        !node1.is_empty() && !node2.is_empty(),
        "blocks: {node1:?} {node2:?}"
    );
    // node-2 has published its address as in use (what a removal
    // reserves).
    until("node-2 publishes 1 in use", Duration::from_secs(15), || {
        let v: Value =
            serde_json::from_str(&cluster_cli(&eps, &prefix, &["nodes", "-o", "json"])?)?;
        Ok(v.as_array()
            .into_iter()
            .flatten()
            .any(|x| x["node"]["name"] == "node-2" && x["node"]["in_use"] == 1))
    })?;
    // node-1's Node deleted while its agent runs: nothing taken.
    lab.api.delete("nodes", "", "node-1")?;
    // node-2's agent dies and its Node is deleted (the VM is gone); its
    // pod stays bound in the API until the pod collector deletes it.
    lab.lab.agents[2].kill9();
    let gone = Instant::now();
    lab.api.delete("nodes", "", "node-2")?;
    let mut freed_after = None;
    while gone.elapsed() < reclaim_after + Duration::from_secs(30) {
        if blocks_of(&eps, &prefix, "node-2")?.is_empty() {
            freed_after = Some(gone.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    let freed_after = freed_after.context("node-2's blocks never freed")?;
    eprintln!(
        "node-2's blocks freed {freed_after:?} after its agent died (reclaim_after {reclaim_after:?})"
    );
    ensure!(
        freed_after >= reclaim_after,
        "node-2's blocks freed {freed_after:?} after it died, before reclaim_after ({reclaim_after:?})"
    );
    // Its pod's address stays reserved while the pod is bound to it.
    let reserved = reserved_for(&eps, &prefix, "node-2")?;
    ensure!(
        reserved.contains(&a2),
        "{a2} not reserved: {reserved:?}; the writers said:\n{}",
        [0, 1]
            .map(|i| lab.lab.agents[i].log())
            .join("\n")
            .lines()
            .filter(|l| l.contains("Node deleted") || l.contains("RECLAIMED"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    std::thread::sleep(Duration::from_secs(5));
    let reserved = reserved_for(&eps, &prefix, "node-2")?;
    ensure!(
        reserved.contains(&a2),
        "{a2} released while sys/p2 is still bound to node-2: {reserved:?}"
    );
    // The pod collector deletes the pod: the reservation goes.
    lab.api.delete("pods", "sys", "p2")?;
    let deleted = Instant::now();
    until(
        "node-2's reservation released",
        Duration::from_secs(15),
        || Ok(reserved_for(&eps, &prefix, "node-2")?.is_empty()),
    )?;
    eprintln!(
        "node-2's reserved {a2} released {:?} after its pod was deleted",
        deleted.elapsed()
    );
    // node-1, deleted from the API but alive, kept its blocks long past
    // reclaim_after, and its pod its address.
    ensure!(
        blocks_of(&eps, &prefix, "node-1")? == node1,
        "node-1's blocks changed"
    );
    del(&lab.lab.agents[1], &sb1)?;
    let outside = lab.outside_rbac()?;
    ensure!(
        outside.is_empty(),
        "requests outside deploy/rbac.yaml: {outside:?}"
    );
    Ok(())
}
