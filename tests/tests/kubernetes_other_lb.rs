//! #44 item 2: other controllers' Services are left alone. One node
//! agent with `[kubernetes]` and no `[cluster]` (it is the writer), the
//! project's API double, and a neighbour on the node's uplink that asks
//! ARP for the addresses.
//!
//! - Before any lockstep pool exists, nothing is written on any Service:
//!   no status PATCH reaches the API and no Event is published.
//! - A class-less Service whose status holds an address another controller
//!   set outside lockstep's pools is never written, never assigned and
//!   never announced.
//! - A class-less Service whose status holds an address inside lockstep's
//!   pool is adopted: it keeps that address, and the node answers ARP for
//!   it (a migration from MetalLB or Cilium renumbers nothing).
//! - A second Service holding that same address (taken) gets lockstep's
//!   condition saying so, and its address is never replaced by an empty
//!   ingress.
//! - With `serve_classless = false`, class-less Services are not lockstep's:
//!   the ones it had served lose its condition and its address, and a Service
//!   of lockstep's class is still served.

use std::time::Duration;

use anyhow::ensure;
use lockstep_tests::cluster::forward_ports;
use lockstep_tests::kube_lab::{condition_of, ingress_of};
use lockstep_tests::kubeapi::ApiDouble;
use lockstep_tests::{AgentProc, Netns, TempDir, privileged, veth, wait_for};
use serde_json::{Value, json};

const NS: &str = "shop";

fn config(kubeconfig: &std::path::Path, classless: bool) -> String {
    format!(
        "node_name = \"node-1\"\n[[pools]]\nname = \"pods\"\nipv4 = [\"10.81.0.0/24\"]\n\
         [kubernetes]\nkubeconfig = \"{}\"\nnode_wait = \"1s\"\nserve_classless = {classless}\n\
         [datapath]\nuplink = \"u0\"\n",
        kubeconfig.display()
    )
}

fn service(name: &str, class: Option<&str>) -> Value {
    let mut s = json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"namespace": NS, "name": name},
        "spec": {"type": "LoadBalancer", "ports": [{"port": 80, "protocol": "TCP"}]},
    });
    if let Some(c) = class {
        s["spec"]["loadBalancerClass"] = json!(c);
    }
    s
}

/// A Service whose status another controller set to `ip`.
fn held(api: &ApiDouble, name: &str, ip: &str) -> anyhow::Result<Value> {
    api.create("services", NS, &service(name, None))?;
    api.patch(
        "services",
        NS,
        name,
        &json!({"status": {"loadBalancer": {"ingress": [{"ip": ip}]}}}),
        true,
    )
}

/// Status writes (`PATCH .../status`) the agent sent for Service `name`.
fn status_writes(api: &ApiDouble, name: &str) -> usize {
    let path = format!("/api/v1/namespaces/{NS}/services/{name}/status");
    api.requests()
        .iter()
        .filter(|r| r.method != "GET" && r.path == path)
        .count()
}

fn events(api: &ApiDouble) -> Vec<Value> {
    api.list("events")
}

/// Whether the neighbour's ARP request for `ip` is answered with `mac`.
fn answered(nb: &Netns, ip: &str, mac: &str) -> anyhow::Result<bool> {
    let out = nb
        .command("arping")
        .args(["-c", "2", "-w", "3", "-I", "n0", ip])
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout).to_lowercase();
    Ok(out.status.success() && text.contains(&mac.to_lowercase()))
}

fn get(api: &ApiDouble, name: &str) -> anyhow::Result<Value> {
    api.get("services", NS, name)
}

#[test]
fn other_controllers_services_are_left_alone_and_in_pool_addresses_adopted() -> anyhow::Result<()> {
    privileged!();
    let api = ApiDouble::start()?;
    api.create("nodes", "", &json!({"metadata": {"name": "node-1"}}))?;
    let dir = TempDir::new("otherlb")?;
    let kubeconfig = dir.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig)?;
    let node = Netns::new("olnode")?;
    let nb = Netns::new("olnb")?;
    veth(&node, "u0", &nb, "n0")?;
    nb.ip(["addr", "add", "10.91.0.2/24", "dev", "n0"])?;
    let mac = node.mac("u0")?;
    let _cut = forward_ports(&node, &[api.addr().port()])?;

    // Before any pool: another controller's Service, a Service whose
    // address will turn out to lie in lockstep's pool, and a new one.
    let theirs = held(&api, "theirs", "203.0.113.10")?;
    let theirs_version = theirs["metadata"]["resourceVersion"].clone();
    held(&api, "migrated", "10.91.0.150")?;
    api.create("services", NS, &service("fresh", None))?;
    let mut agent = AgentProc::start(&node, &config(&kubeconfig, true))?;
    // The agent has listed the Services (its watch is open) and had time
    // for passes: still nothing written, nothing published.
    wait_for("the agent's watches", Duration::from_secs(20), || {
        (api.open_watches() >= 2).then_some(())
    })?;
    std::thread::sleep(Duration::from_secs(2));
    for name in ["theirs", "migrated", "fresh"] {
        ensure!(
            status_writes(&api, name) == 0,
            "{name}'s status was written before any lockstep pool existed"
        );
    }
    ensure!(
        events(&api).is_empty(),
        "Events before any pool: {:?}",
        events(&api)
    );

    // The pool: fresh gets an address, migrated keeps its own.
    api.create(
        "loadbalancerippools",
        "",
        &json!({"apiVersion": "lockstep.io/v1alpha1", "kind": "LoadBalancerIPPool",
                "metadata": {"name": "public"},
                "spec": {"cidrs": ["10.91.0.128/25"], "announce": "l2"}}),
    )?;
    for name in ["fresh", "migrated"] {
        wait_for(&format!("{name} assigned"), Duration::from_secs(30), || {
            get(&api, name)
                .ok()
                .and_then(|s| condition_of(&s))
                .filter(|c| c.0 == "True")
        })?;
    }
    let migrated = get(&api, "migrated")?;
    ensure!(
        ingress_of(&migrated) == ["10.91.0.150".parse::<std::net::IpAddr>()?],
        "the migrated Service was renumbered: {}",
        migrated["status"]
    );
    // The status and the datapath are written side by side: answered
    // within moments of the status, not necessarily before it.
    wait_for(
        &format!("10.91.0.150 (adopted) answered with the node's MAC {mac}"),
        Duration::from_secs(10),
        || answered(&nb, "10.91.0.150", &mac).ok().filter(|a| *a),
    )?;

    // The same address held by a second Service: taken. Lockstep says so
    // and leaves the address in its status.
    held(&api, "second", "10.91.0.150")?;
    let c = wait_for("second's condition", Duration::from_secs(30), || {
        get(&api, "second").ok().and_then(|s| condition_of(&s))
    })?;
    ensure!(c.0 == "False" && c.1 == "RequestedTaken", "{c:?}");
    let second = get(&api, "second")?;
    ensure!(
        ingress_of(&second) == ["10.91.0.150".parse::<std::net::IpAddr>()?],
        "second's ingress was replaced: {}",
        second["status"]
    );

    // Another controller's Service: never written, never served.
    let theirs = get(&api, "theirs")?;
    ensure!(
        theirs["metadata"]["resourceVersion"] == theirs_version
            && status_writes(&api, "theirs") == 0,
        "another controller's Service was written: {}",
        theirs["status"]
    );
    let lb = agent.json(["lb", "get", "-o", "json"])?;
    ensure!(
        !lb.to_string().contains("shop/theirs"),
        "another controller's Service is in lockstep's LB state: {lb}"
    );
    ensure!(
        !answered(&nb, "203.0.113.10", &mac)?,
        "another controller's address is answered by lockstep's node"
    );

    // Class-less Services no longer served: fresh loses lockstep's address
    // and condition; a Service of lockstep's class is still served.
    let text = std::fs::read_to_string(&agent.config)?
        .replace("serve_classless = true", "serve_classless = false");
    std::fs::write(&agent.config, text)?;
    agent.restart()?;
    api.create("services", NS, &service("classed", Some("lockstep.io/lb")))?;
    wait_for("classed assigned", Duration::from_secs(30), || {
        get(&api, "classed")
            .ok()
            .and_then(|s| condition_of(&s))
            .filter(|c| c.0 == "True")
    })?;
    let fresh = wait_for("fresh released", Duration::from_secs(30), || {
        get(&api, "fresh")
            .ok()
            .filter(|s| condition_of(s).is_none() && ingress_of(s).is_empty())
    })?;
    ensure!(
        fresh["status"]["conditions"]
            .as_array()
            .is_none_or(Vec::is_empty)
    );
    // second's address was never lockstep's: it stays.
    let second = get(&api, "second")?;
    ensure!(
        ingress_of(&second) == ["10.91.0.150".parse::<std::net::IpAddr>()?],
        "second's ingress was removed: {}",
        second["status"]
    );
    ensure!(status_writes(&api, "theirs") == 0);
    Ok(())
}
