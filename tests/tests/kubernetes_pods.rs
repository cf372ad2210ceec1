//! Pods as the Kubernetes API shows them (#29 items 2 and 3), end to end:
//! the API double (tests/src/kubeapi) on loopback, three node namespaces
//! running agents in cluster mode on a real 3-member etcd, and the real
//! CNI plugin called as kubelet calls it (`CNI_ARGS` with
//! `K8S_POD_NAMESPACE`, `K8S_POD_NAME`, `K8S_POD_UID`).
//!
//! (a) The pool by annotation: the pod's `lockstep.io/ip-pool`, else its
//!     namespace's, else the default; a pod the agent's cache has not
//!     shown yet is waited for (bounded), then its ADD fails with "try
//!     again" (CNI code 11) naming it, never given a guessed pool; an
//!     annotation that cannot name a pool, or names none, fails the ADD
//!     naming the annotation.
//! (b) Leaks: a pod deleted from the API without a CNI DEL leaves its
//!     allocation; after the grace period (shortened here) it is reported
//!     (verify, metric) and released only on the node configured to; an
//!     attachment made without a pod is never judged.
//!
//! What the double does not do (no RBAC enforcement, no admission, a
//! watch's selectors judge the object after each change only) is listed in
//! tests/src/kubeapi/mod.rs; the ClusterRole is checked against every
//! request the agents sent.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Duration;

use anyhow::ensure;
use ipnet::IpNet;
use lockstep_tests::cluster::{address_of, apply_pools, held_by, metrics_in};
use lockstep_tests::etcd::EtcdCluster;
use lockstep_tests::kube_lab::KubeLab;
use lockstep_tests::kube_pods::{add, add_ok, del, namespace, pod};
use lockstep_tests::{AgentProc, Netns, privileged, unique, wait_for};
use serde_json::{Value, json};

const POOLS: &str = "default_pool = \"pods\"\n\
[[pools]]\nname = \"pods\"\nipv4 = [\"10.96.0.0/24\"]\nblock_v4 = 28\n\
[[pools]]\nname = \"blue\"\nipv4 = [\"10.97.0.0/24\"]\nblock_v4 = 28\n\
[[pools]]\nname = \"green\"\nipv4 = [\"10.98.0.0/24\"]\nblock_v4 = 28\n";

fn cidr(text: &str) -> IpNet {
    text.parse().expect("cidr")
}

/// `lockstep verify -o json`, whatever its exit code.
fn verify(agent: &AgentProc) -> anyhow::Result<Value> {
    let out = agent.cli(["verify", "-o", "json"])?;
    Ok(serde_json::from_slice(&out.stdout)?)
}

fn leaked(agent: &AgentProc) -> anyhow::Result<Vec<String>> {
    Ok(verify(agent)?["leaked"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s.as_str().map(str::to_owned))
        .collect())
}

fn metric(ns: &Netns, name: &str) -> anyhow::Result<Option<f64>> {
    Ok(metrics_in(ns)?.lines().find_map(|l| {
        l.strip_prefix(&format!("{name} "))
            .and_then(|v| v.trim().parse().ok())
    }))
}

#[test]
fn pods_get_the_pool_their_annotation_or_namespace_names() -> anyhow::Result<()> {
    privileged!();
    let cluster = EtcdCluster::start(3)?;
    let prefix = format!("/{}/", unique("kpods"));
    apply_pools(&cluster.endpoints(), &prefix, POOLS)?;
    let lab = KubeLab::build_with(
        &cluster,
        &prefix,
        [json!({}), json!({}), json!({})],
        &|_| "[kubernetes.pods]\npool_wait = \"3s\"\n".to_string(),
    )?;
    namespace(&lab, "shop", Some("green"))?;
    namespace(&lab, "plain", None)?;
    let (blue, green, pods) = (
        cidr("10.97.0.0/24"),
        cidr("10.98.0.0/24"),
        cidr("10.96.0.0/24"),
    );
    let web = pod(&lab, "shop", "web", 0, Some("blue"))?;
    let db = pod(&lab, "shop", "db", 0, None)?;
    let x = pod(&lab, "plain", "x", 1, None)?;
    let y = pod(&lab, "plain", "y", 2, Some("green"))?;
    let agents = &lab.lab.agents;
    let mut sandboxes = Vec::new();
    for (agent, ns, name, uid, want) in [
        (&agents[0], "shop", "web", &web, blue),
        (&agents[0], "shop", "db", &db, green),
        (&agents[1], "plain", "x", &x, pods),
        (&agents[2], "plain", "y", &y, green),
    ] {
        // The first ADDs may come before the cache listed: bounded wait.
        let (sb, a) = add_ok(agent, ns, name, Some(uid))?;
        ensure!(want.contains(&a), "{ns}/{name} got {a}, not from {want}");
        eprintln!("{ns}/{name}: {a} (from {want})");
        sandboxes.push((agent, sb));
    }
    // A pod created while its ADD waits for the cache: its annotation.
    let (sb, a) = std::thread::scope(|s| {
        let creator = s.spawn(|| -> anyhow::Result<()> {
            std::thread::sleep(Duration::from_millis(500));
            pod(&lab, "plain", "late", 1, Some("blue"))?;
            Ok(())
        });
        let added = add_ok(&agents[1], "plain", "late", None);
        creator.join().expect("creator")?;
        added
    })?;
    ensure!(
        blue.contains(&a),
        "plain/late got {a}, not from its annotation's pool"
    );
    sandboxes.push((&agents[1], sb));
    // A pod the API never shows: after the wait, "try again" (CNI code
    // 11) naming it; never its namespace's pool, which its own unseen
    // annotation might override.
    let before = agents[1].json(["allocations", "-o", "json"])?;
    let started = std::time::Instant::now();
    let (_ghost, code, v) = add(&agents[1], "shop", "ghost", None)?;
    let text = v.to_string();
    ensure!(
        code != 0 && v["code"] == 11 && text.contains("shop/ghost"),
        "an unseen pod's ADD: code {code}, {text}"
    );
    ensure!(
        started.elapsed() >= Duration::from_secs(3),
        "did not wait for the cache"
    );
    ensure!(
        agents[1].json(["allocations", "-o", "json"])? == before,
        "the refused ADD allocated"
    );
    // Annotations that cannot name a pool, or name none: refused, named.
    pod(&lab, "plain", "spaced", 2, Some("two words"))?;
    pod(&lab, "plain", "nope", 2, Some("nope"))?;
    let (_sb1, code, v) = add(&agents[2], "plain", "spaced", None)?;
    let text = v.to_string();
    ensure!(
        code != 0 && text.contains("lockstep.io/ip-pool") && text.contains("plain/spaced"),
        "{code} {text}"
    );
    let (_sb2, code, v) = add(&agents[2], "plain", "nope", None)?;
    let text = v.to_string();
    ensure!(
        code != 0 && text.contains("nope") && text.contains("annotation"),
        "{code} {text}"
    );
    let outside = lab.outside_rbac()?;
    ensure!(
        outside.is_empty(),
        "requests outside deploy/rbac.yaml: {outside:?}"
    );
    for (agent, sb) in &sandboxes {
        del(agent, sb)?;
    }
    Ok(())
}

#[test]
fn a_leak_is_reported_after_the_grace_and_released_only_when_configured() -> anyhow::Result<()> {
    privileged!();
    let cluster = EtcdCluster::start(3)?;
    let prefix = format!("/{}/", unique("kleak"));
    apply_pools(&cluster.endpoints(), &prefix, POOLS)?;
    // Node 0 reports only; node 1 releases.
    let lab = KubeLab::build_with(&cluster, &prefix, [json!({}), json!({}), json!({})], &|i| {
        format!(
            "[kubernetes.pods]\nleak_grace = \"3s\"\nleak_check_every = \"500ms\"\nrelease_leaks = {}\n",
            i == 1
        )
    })?;
    namespace(&lab, "shop", None)?;
    let agents = &lab.lab.agents;
    let a_uid = pod(&lab, "shop", "a", 0, None)?;
    let b_uid = pod(&lab, "shop", "b", 1, None)?;
    let keep_uid = pod(&lab, "shop", "keep", 0, None)?;
    let (sa, addr_a) = add_ok(&agents[0], "shop", "a", Some(&a_uid))?;
    let (sb, addr_b) = add_ok(&agents[1], "shop", "b", Some(&b_uid))?;
    let (sk, addr_keep) = add_ok(&agents[0], "shop", "keep", Some(&keep_uid))?;
    // An attachment without a pod (not kubelet's): never judged.
    let bare = Netns::new("kbare")?;
    let bare_id = unique("bare");
    let (code, v, _) = lockstep_tests::cluster::cni_raw(
        &agents[1].socket(),
        "ADD",
        Some((&bare_id, &bare.path())),
    )?;
    ensure!(code == 0, "bare ADD: {v}");
    let addr_bare = address_of(&v)?;
    // A static pod on node 1 (which releases leaks): kubelet ADDs it with
    // the static pod's UID (its config hash); the API shows its mirror pod
    // under another UID, the hash in `kubernetes.io/config.mirror`.
    let hash = "5f2c9e0b7a4d1e36c8b2a9f0d3e1c7b4";
    namespace(&lab, "kube-system", None)?;
    let mirror = lab.api.create(
        "pods",
        "kube-system",
        &json!({
            "metadata": {"namespace": "kube-system", "name": "static-node-1",
                         "annotations": {"kubernetes.io/config.mirror": hash}},
            "spec": {"nodeName": "node-1", "containers": [{"name": "c", "image": "x"}]},
        }),
    )?;
    ensure!(
        mirror["metadata"]["uid"] != hash,
        "the mirror pod has a UID of its own"
    );
    let (ss, addr_static) = add_ok(&agents[1], "kube-system", "static-node-1", Some(hash))?;
    std::thread::sleep(Duration::from_secs(4));
    ensure!(
        leaked(&agents[0])?.is_empty() && leaked(&agents[1])?.is_empty(),
        "a leak while every pod runs"
    );
    // The pods go from the API; kubelet never sends the DELs.
    let gone = std::time::Instant::now();
    lab.api.delete("pods", "shop", "a")?;
    lab.api.delete("pods", "shop", "b")?;
    // Node 1 releases b's address after the grace.
    wait_for(
        "node-1 to release shop/b's address",
        Duration::from_secs(20),
        || {
            held_by(&agents[1])
                .ok()
                .filter(|h| !h.contains(&addr_b))
                .map(|_| ())
        },
    )?;
    let took = gone.elapsed();
    ensure!(
        took >= Duration::from_secs(3),
        "released after {took:?}, inside the 3 s grace"
    );
    eprintln!("shop/b released {took:?} after its pod was deleted");
    // Node 0 reports a, keeps its address, and keeps the running pod's.
    let said = wait_for("node-0 to report shop/a", Duration::from_secs(20), || {
        leaked(&agents[0]).ok().filter(|l| !l.is_empty())
    })?;
    ensure!(said.len() == 1 && said[0].contains("shop/a"), "{said:?}");
    let v = verify(&agents[0])?;
    ensure!(v["ok"] == false, "verify must fail on a leak: {v}");
    let held0: BTreeSet<IpAddr> = held_by(&agents[0])?;
    ensure!(
        held0.contains(&addr_a) && held0.contains(&addr_keep),
        "node-0 released: {held0:?}"
    );
    ensure!(
        metric(&lab.lab.ns[0], "lockstep_endpoint_leaks")? == Some(1.0),
        "node-0 metric: {:?}",
        metric(&lab.lab.ns[0], "lockstep_endpoint_leaks")?
    );
    ensure!(
        metric(&lab.lab.ns[1], "lockstep_endpoint_leaks_released_total")? == Some(1.0),
        "node-1 metric: {:?}",
        metric(&lab.lab.ns[1], "lockstep_endpoint_leaks_released_total")?
    );
    ensure!(
        leaked(&agents[1])?.is_empty(),
        "node-1 still reports a released leak"
    );
    ensure!(
        held_by(&agents[1])?.contains(&addr_bare),
        "the attachment without a pod was released"
    );
    ensure!(
        held_by(&agents[1])?.contains(&addr_static),
        "the static pod's address was released though its mirror pod runs"
    );
    // A pod replaced by one of the same name (another UID): the old
    // sandbox's allocation is a leak too.
    lab.api.delete("pods", "shop", "keep")?;
    pod(&lab, "shop", "keep", 0, None)?;
    let said = wait_for(
        "node-0 to report the replaced shop/keep",
        Duration::from_secs(20),
        || leaked(&agents[0]).ok().filter(|l| l.len() == 2),
    )?;
    ensure!(said.iter().any(|s| s.contains("shop/keep")), "{said:?}");
    // The operator's DEL clears the report.
    del(&agents[0], &sa)?;
    del(&agents[0], &sk)?;
    wait_for("node-0's report to clear", Duration::from_secs(20), || {
        leaked(&agents[0]).ok().filter(Vec::is_empty)
    })?;
    del(&agents[1], &sb)?;
    del(&agents[1], &ss)?;
    let (code, v, _) = lockstep_tests::cluster::cni_raw(
        &agents[1].socket(),
        "DEL",
        Some((&bare_id, &bare.path())),
    )?;
    ensure!(code == 0, "bare DEL: {v}");
    let outside = lab.outside_rbac()?;
    ensure!(
        outside.is_empty(),
        "requests outside deploy/rbac.yaml: {outside:?}"
    );
    Ok(())
}
