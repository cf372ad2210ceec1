//! NodeIPAM end to end (#29 item 5, proof (d)): an agent in a node
//! namespace with `[kubernetes.nodeipam]`, the Kubernetes API double
//! (`lockstep_tests::kubeapi`; its limits are documented beside it) as the
//! API, the test as the operator writing the object's status, and pods
//! made by the real CNI plugin (`lockstep` as a runtime runs it).
//!
//! No etcd: NodeIPAM is the alternative to cluster mode's etcd blocks as
//! the source of a node's CIDRs (the operator, not etcd, decides which
//! node holds which CIDR), and the agent refuses a config with both. The
//! issue's "real 3-member etcd" applies to the other proofs of #29.
//!
//! `a_two_28s_serve_demand_follows_and_a_withdrawn_28_drains`:
//! - the agent makes its NodeIPAM object; a status with two /28s (pool
//!   `eni`, linear, pre-allocate 2) and one /28 (pool `burst`, ceil in
//!   blocks of 16, pre-allocate 2): 32 pods get the 32 addresses of both
//!   /28s, first and last included, and a 33rd gets none;
//! - spec `requested` follows the pods as they come and go, in both modes
//!   (linear: in use + 2 exactly; ceil: that rounded up to 16s);
//! - a bad status (an overlap with a configured pool, a CIDR of the wrong
//!   family) is refused with a condition naming both, and nothing changes;
//! - the second /28 withdrawn while its 16 pods live drains: they keep
//!   their addresses, it is reported (condition, `verify`, `pools`), new
//!   pods get addresses only from the first; the agent restarted with the
//!   API cut off restores every pod into its /28 (from its own record),
//!   serves the free address of the first /28 and hands no address twice;
//!   once the second's last pod goes it leaves the spec;
//! - the agent lists and watches its own object only (a field selector),
//!   and every request it sent is one `deploy/rbac.yaml` allows.

use std::collections::BTreeSet;
use std::io::Write;
use std::net::IpAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, ensure};
use ipnet::IpNet;
use lockstep_tests::cluster::forward_ports;
use lockstep_tests::kube_lab::outside_rbac;
use lockstep_tests::kubeapi::ApiDouble;
use lockstep_tests::{AgentProc, Netns, TempDir, lockstep_bin, privileged, unique, wait_for};
use serde_json::{Value, json};

const NODE: &str = "node-1";

/// A pod made through CNI ADD.
struct Pod {
    _ns: Netns,
    ns_path: std::path::PathBuf,
    id: String,
    addr: IpAddr,
}

/// One CNI call through the plugin; its stdout, or why it failed.
fn cni(
    agent: &AgentProc,
    command: &str,
    id: &str,
    ns: &std::path::Path,
    pool: &str,
) -> anyhow::Result<Value> {
    let conf = json!({
        "cniVersion": "1.0.0",
        "name": "nodeipam",
        "type": "lockstep",
        "agentSocket": agent.socket().display().to_string(),
        "pool": pool,
    });
    let mut child = Command::new(lockstep_bin())
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", id)
        .env("CNI_NETNS", ns)
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", "/opt/cni/bin")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    child
        .stdin
        .take()
        .context("stdin")?
        .write_all(conf.to_string().as_bytes())?;
    let out = child.wait_with_output()?;
    ensure!(
        out.status.success(),
        "CNI {command} {id} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(if text.trim().is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text)?
    })
}

fn add(agent: &AgentProc, pool: &str) -> anyhow::Result<Pod> {
    let ns = Netns::new("nipod")?;
    let id = unique("nip");
    let result = cni(agent, "ADD", &id, &ns.path(), pool)?;
    let ips = result["ips"].as_array().context("no ips")?;
    ensure!(ips.len() == 1, "one IPv4 address expected: {result}");
    let addr = ips[0]["address"]
        .as_str()
        .and_then(|a| a.split('/').next())
        .context("ip without address")?
        .parse()?;
    Ok(Pod {
        ns_path: ns.path(),
        _ns: ns,
        id,
        addr,
    })
}

fn del(agent: &AgentProc, pod: &Pod, pool: &str) -> anyhow::Result<()> {
    cni(agent, "DEL", &pod.id, &pod.ns_path, pool).map(drop)
}

/// The agent's spec entry of `pool`: (requested, CIDRs held).
fn spec_of(api: &ApiDouble, pool: &str) -> Option<(u64, Vec<String>)> {
    let o = api.get("nodeipams", "", NODE).ok()?;
    let p = o["spec"]["pools"]
        .as_array()?
        .iter()
        .find(|p| p["name"] == pool)?
        .clone();
    let cidrs = p["cidrs"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|c| c.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default();
    Some((p["requested"].as_u64()?, cidrs))
}

fn wait_spec(api: &ApiDouble, pool: &str, requested: u64, cidrs: &[&str]) -> anyhow::Result<()> {
    let want: Vec<String> = cidrs.iter().map(|c| (*c).to_string()).collect();
    wait_for(
        &format!("spec of {pool}: requested {requested}, cidrs {want:?}"),
        Duration::from_secs(20),
        || (spec_of(api, pool) == Some((requested, want.clone()))).then_some(()),
    )
    .with_context(|| format!("spec now {:?}", spec_of(api, pool)))
}

/// The agent's condition `t`: (status, reason, message).
fn condition(api: &ApiDouble, t: &str) -> Option<(String, String, String)> {
    let o = api.get("nodeipams", "", NODE).ok()?;
    let c = o["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == t)?
        .clone();
    let s = |k: &str| c[k].as_str().unwrap_or_default().to_string();
    Some((s("status"), s("reason"), s("message")))
}

fn wait_condition(
    api: &ApiDouble,
    t: &str,
    status: &str,
) -> anyhow::Result<(String, String, String)> {
    wait_for(
        &format!("condition {t}={status}"),
        Duration::from_secs(20),
        || condition(api, t).filter(|c| c.0 == status),
    )
    .with_context(|| format!("{t} now {:?}", condition(api, t)))
}

/// The operator's write: the status's pools.
fn offer(api: &ApiDouble, pools: Value) -> anyhow::Result<()> {
    api.patch(
        "nodeipams",
        "",
        NODE,
        &json!({"status": {"pools": pools}}),
        true,
    )
    .map(drop)
}

fn ceil16(n: u64) -> u64 {
    n.div_ceil(16) * 16
}

#[test]
fn a_two_28s_serve_demand_follows_and_a_withdrawn_28_drains() -> anyhow::Result<()> {
    privileged!();
    let api = ApiDouble::start()?;
    api.create("nodes", "", &json!({"metadata": {"name": NODE}}))?;
    let dir = TempDir::new("nipam")?;
    let kubeconfig = dir.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig)?;
    let node = Netns::new("ninode")?;
    node.sysctl("net.ipv4.ip_forward", "1")?;
    let cut = forward_ports(&node, &[api.addr().port()])?;
    let extra = format!(
        r#"reconcile_interval = "300ms"
[[pools]]
name = "local"
ipv4 = ["10.78.0.0/24"]
[kubernetes]
kubeconfig = "{}"
node_name = "{NODE}"
node_wait = "1s"
[kubernetes.nodeipam]
interval = "100ms"
[[kubernetes.nodeipam.pools]]
name = "eni"
demand = "linear"
pre_allocate = 2
[[kubernetes.nodeipam.pools]]
name = "burst"
demand = "ceil"
block_size = 16
pre_allocate = 2
"#,
        kubeconfig.display()
    );
    let mut agent = AgentProc::start(&node, &extra)?;

    // The agent makes its object, asking for its pre-allocation.
    wait_spec(&api, "eni", 2, &[])?;
    wait_spec(&api, "burst", 16, &[])?;
    let (a, b, c) = ("10.77.0.0/28", "10.77.0.16/28", "10.77.1.0/28");
    offer(
        &api,
        json!([{"name": "eni", "ipv4": [a, b]}, {"name": "burst", "ipv4": [c]}]),
    )?;
    wait_condition(&api, "Accepted", "True")?;
    wait_spec(&api, "eni", 2, &[a, b])?;

    // 32 pods: both /28s whole, first and last addresses included.
    let mut eni = Vec::new();
    for _ in 0..32 {
        eni.push(add(&agent, "eni")?);
    }
    let got: BTreeSet<IpAddr> = eni.iter().map(|p| p.addr).collect();
    ensure!(got.len() == 32, "an address twice: {got:?}");
    let (na, nb): (IpNet, IpNet) = (a.parse()?, b.parse()?);
    ensure!(
        got.iter().all(|x| na.contains(x) || nb.contains(x)),
        "{got:?}"
    );
    for edge in ["10.77.0.0", "10.77.0.15", "10.77.0.16", "10.77.0.31"] {
        ensure!(
            got.contains(&edge.parse()?),
            "{edge} not handed out: {got:?}"
        );
    }
    ensure!(add(&agent, "eni").is_err(), "a 33rd address from two /28s");
    eprintln!(
        "32 pods in two /28s: {} .. {}",
        got.first().context("none")?,
        got.last().context("none")?
    );
    // Linear: exactly in use + 2.
    wait_spec(&api, "eni", 34, &[a, b])?;

    // Ceil: in use + 2 rounded up to 16s, as pods come and go.
    let mut burst = Vec::new();
    for n in [3usize, 15] {
        while burst.len() < n {
            burst.push(add(&agent, "burst")?);
        }
        wait_spec(&api, "burst", ceil16(n as u64 + 2), &[c])?;
    }
    for _ in 0..2 {
        del(&agent, &burst.pop().context("pod")?, "burst")?;
    }
    wait_spec(&api, "burst", ceil16(13 + 2), &[c])?;

    // A bad status: refused whole, naming each problem; nothing changes.
    offer(
        &api,
        json!([
            {"name": "eni", "ipv4": [a, "10.78.0.16/28"]},
            {"name": "burst", "ipv4": [c, "fd00:77::/120"]}
        ]),
    )?;
    let refused = wait_condition(&api, "Accepted", "False")?;
    ensure!(
        refused
            .2
            .contains("10.78.0.16/28 overlaps 10.78.0.0/24 of the configured pool local")
            && refused.2.contains("fd00:77::/120 is listed as ipv4"),
        "{refused:?}"
    );
    std::thread::sleep(Duration::from_millis(500));
    wait_spec(&api, "eni", 34, &[a, b])?;
    ensure!(condition(&api, "Draining").is_some_and(|c| c.0 == "False"));

    // The operator withdraws the second /28 while its 16 pods live.
    offer(
        &api,
        json!([{"name": "eni", "ipv4": [a]}, {"name": "burst", "ipv4": [c]}]),
    )?;
    let draining = wait_condition(&api, "Draining", "True")?;
    ensure!(
        draining
            .2
            .starts_with(&format!("{b} of pool eni: 16 address(es) still in use")),
        "{draining:?}"
    );
    wait_condition(&api, "Accepted", "True")?;
    // Still held and counted; reported by verify and pools.
    wait_spec(&api, "eni", 34, &[a, b])?;
    let v = agent.json(["verify", "-o", "json"])?;
    ensure!(v["ok"] == true, "verify: {v}");
    ensure!(
        v["draining"].to_string().contains(b),
        "verify names no draining {b}: {v}"
    );
    let pools = agent.json(["pools", "-o", "json"])?;
    let p = pools
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == "eni")
        .context("pool eni")?;
    ensure!(p["draining"] == json!([b]), "{p}");
    let log = agent.log();
    ensure!(
        log.contains("a CIDR withdrawn while in use drains"),
        "no log line"
    );

    // Pods of the first /28 go; new ones come from it alone.
    let (in_a, in_b): (Vec<Pod>, Vec<Pod>) = eni.into_iter().partition(|p| na.contains(&p.addr));
    let mut in_a = in_a;
    for _ in 0..6 {
        del(&agent, &in_a.pop().context("pod")?, "eni")?;
    }
    wait_spec(&api, "eni", 26 + 2, &[a, b])?;
    for _ in 0..6 {
        let p = add(&agent, "eni")?;
        ensure!(
            na.contains(&p.addr),
            "{} handed out from the draining {b}",
            p.addr
        );
        in_a.push(p);
    }
    ensure!(
        add(&agent, "eni").is_err(),
        "an address from the draining /28"
    );

    // Restart with the API cut off: every pod restores into its /28
    // (the record, not the API), none is handed out twice.
    // One address of the first /28 free before the restart: served again
    // after it (the pool is there before the API answers).
    del(&agent, &in_a.pop().context("pod")?, "eni")?;
    cut.set(true);
    agent.restart()?;
    let p = add(&agent, "eni").context("an ADD with the API cut off, after a restart")?;
    ensure!(na.contains(&p.addr), "{} after the restart", p.addr);
    in_a.push(p);
    let held: Vec<Value> = agent
        .json(["allocations", "-o", "json"])?
        .as_array()
        .cloned()
        .unwrap_or_default();
    let addrs: Vec<String> = held
        .iter()
        .filter(|x| x["pool"] == "eni")
        .filter_map(|x| x["address"].as_str().map(String::from))
        .collect();
    ensure!(addrs.len() == 32, "after the restart eni holds {addrs:?}");
    eprintln!(
        "restarted with the API cut off: {} eni addresses restored",
        addrs.len()
    );
    ensure!(
        add(&agent, "eni").is_err(),
        "an address given twice after the restart"
    );
    agent.verify_within(Duration::from_secs(10))?;
    cut.set(false);

    // The draining /28's pods go: released, gone from the spec.
    for p in &in_b {
        del(&agent, p, "eni")?;
    }
    wait_spec(&api, "eni", 16 + 2, &[a])?;
    wait_condition(&api, "Draining", "False")?;
    let fresh = add(&agent, "eni");
    ensure!(fresh.is_err(), "the released /28 served again");

    eprintln!("final spec: {}", api.get("nodeipams", "", NODE)?["spec"]);
    // The agent watched its own object only (a field selector), never
    // another node's.
    let lists: Vec<_> = api
        .requests()
        .into_iter()
        .filter(|r| r.method == "GET" && r.path.ends_with("/nodeipams"))
        .collect();
    ensure!(!lists.is_empty(), "no NodeIPAM list or watch seen");
    let wide: Vec<String> = lists
        .into_iter()
        .filter(|r| {
            !r.query
                .contains(&format!("fieldSelector=metadata.name%3D{NODE}"))
        })
        .map(|r| r.query)
        .collect();
    ensure!(
        wide.is_empty(),
        "NodeIPAM lists or watches beyond this node's: {wide:?}"
    );
    let outside = outside_rbac(&api)?;
    ensure!(
        outside.is_empty(),
        "requests outside deploy/rbac.yaml: {outside:?}"
    );
    Ok(())
}
