//! The CNI plugin as a container runtime runs it: a new `lockstep` process per
//! call, `CNI_*` in the environment, the network configuration on stdin, the
//! result or error object on stdout. The agent runs in a node namespace and
//! makes the host-side veths there; "containers" are namespaces the tests
//! make.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use hyper::Method;
use lockstep_tests::{AgentProc, Netns, lockstep_bin, privileged, unique, wait_for};
use serde_json::{Value, json};

const POOLS: &str = r#"
reconcile_interval = "300ms"
default_pool = "default"
[[pools]]
name = "default"
ipv4 = ["10.61.0.0/24"]
ipv6 = ["fd00:61::/120"]
[[pools]]
name = "second"
ipv4 = ["10.62.0.0/24"]
[[pools]]
name = "tiny"
ipv4 = ["10.63.0.0/30"]
"#;

const VERSIONS: [&str; 4] = ["0.3.1", "0.4.0", "1.0.0", "1.1.0"];

/// What one plugin process did.
#[derive(Debug)]
struct Call {
    exit: i32,
    out: Value,
    stdout: String,
    stderr: String,
}

impl Call {
    fn ok(&self) -> anyhow::Result<&Value> {
        ensure!(
            self.exit == 0,
            "plugin failed (exit {}): {}\nstderr: {}",
            self.exit,
            self.stdout,
            self.stderr
        );
        Ok(&self.out)
    }

    fn code(&self) -> Option<u64> {
        self.out["code"].as_u64()
    }

    fn msg(&self) -> &str {
        self.out["msg"].as_str().unwrap_or_default()
    }
}

/// Runs the plugin once, as a runtime does: a clean environment with only
/// `PATH` and the given variables, `stdin` written and closed.
fn plugin_os(env: &[(&str, std::ffi::OsString)], stdin: &[u8]) -> anyhow::Result<Call> {
    let mut cmd = Command::new(lockstep_bin());
    cmd.env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().context("starting the plugin")?;
    let mut input = child.stdin.take().context("stdin")?;
    let data = stdin.to_vec();
    // A refused (oversized) stdin is not read to the end: ignore EPIPE.
    let writer = std::thread::spawn(move || {
        let _ = input.write_all(&data);
    });
    let out = child.wait_with_output()?;
    let _ = writer.join();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let parsed = if stdout.trim().is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&stdout)
            .with_context(|| format!("plugin stdout is not JSON: {stdout:?}"))?
    };
    Ok(Call {
        exit: out.status.code().unwrap_or(-1),
        out: parsed,
        stdout,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    })
}

fn plugin(env: &[(&str, String)], stdin: &Value) -> anyhow::Result<Call> {
    let env: Vec<(&str, std::ffi::OsString)> = env.iter().map(|(k, v)| (*k, v.into())).collect();
    plugin_os(&env, stdin.to_string().as_bytes())
}

/// The environment of an attachment command.
fn env(command: &str, id: &str, netns: Option<&Path>, ifname: &str) -> Vec<(&'static str, String)> {
    let mut e = vec![
        ("CNI_COMMAND", command.to_string()),
        ("CNI_CONTAINERID", id.to_string()),
        ("CNI_IFNAME", ifname.to_string()),
        ("CNI_PATH", "/opt/cni/bin".to_string()),
    ];
    if let Some(ns) = netns {
        e.push(("CNI_NETNS", ns.display().to_string()));
    }
    e
}

fn net_env(command: &str) -> Vec<(&'static str, String)> {
    vec![
        ("CNI_COMMAND", command.to_string()),
        ("CNI_PATH", "/opt/cni/bin".to_string()),
    ]
}

/// A full-plugin configuration; `extra`'s top-level keys are merged in.
fn conf(version: &str, socket: &Path, extra: Value) -> Value {
    let mut v = json!({
        "cniVersion": version,
        "name": "lockstep-test",
        "type": "lockstep",
        "agentSocket": socket.display().to_string(),
    });
    if let (Some(base), Value::Object(more)) = (v.as_object_mut(), extra) {
        base.extend(more);
    }
    v
}

fn api(
    agent: &AgentProc,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> anyhow::Result<Value> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    Ok(rt.block_on(lockstep::client::call(&agent.socket(), method, path, body))?)
}

/// Everything the agent stores: allocations (CLI) and endpoints (API).
fn snapshot(agent: &AgentProc) -> anyhow::Result<(Value, Value)> {
    Ok((
        agent.json(["allocations", "-o", "json"])?,
        api(agent, Method::GET, "/v1/endpoints", None)?,
    ))
}

/// Waits for a full DEL's reaping: the host veth `host` gone from `node`,
/// then `held` (addresses still held) empty; the addresses are never free
/// while the veth exists.
fn released(
    node: &Netns,
    host: &str,
    held: impl Fn() -> anyhow::Result<BTreeSet<String>>,
) -> anyhow::Result<()> {
    wait_for(
        "the host veth gone and its addresses released",
        Duration::from_secs(5),
        || {
            let veth = links(node).ok()?.contains(host);
            let held = held().ok()?;
            (!veth && held.is_empty()).then_some(())
        },
    )
}

fn links(ns: &Netns) -> anyhow::Result<BTreeSet<String>> {
    let v: Value = serde_json::from_str(&ns.ip(["-j", "link", "show"])?)?;
    Ok(v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|l| l["ifname"].as_str().map(str::to_string))
        .collect())
}

/// The addresses (`addr/prefix`, global scope) on `iface` in `ns`, if it exists.
fn addrs(ns: &Netns, iface: &str) -> anyhow::Result<Option<BTreeSet<String>>> {
    let Ok(out) = ns.ip(["-j", "addr", "show", "dev", iface]) else {
        return Ok(None);
    };
    let v: Value = serde_json::from_str(&out)?;
    Ok(Some(
        v[0]["addr_info"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|a| a["scope"] == "global")
            .filter_map(|a| Some(format!("{}/{}", a["local"].as_str()?, a["prefixlen"])))
            .collect(),
    ))
}

/// The `ips[].address` of a result.
fn result_addrs(result: &Value) -> BTreeSet<String> {
    result["ips"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|i| i["address"].as_str().map(str::to_string))
        .collect()
}

fn bare(addr: &str) -> &str {
    addr.split('/').next().unwrap_or(addr)
}

/// Checks a full-plugin ADD result against the shape of `version`.
fn check_shape(result: &Value, version: &str, netns: &Path) -> anyhow::Result<()> {
    ensure!(result["cniVersion"] == version, "cniVersion: {result}");
    let ifaces = result["interfaces"].as_array().context("interfaces")?;
    ensure!(ifaces.len() == 2, "two interfaces: {result}");
    ensure!(
        ifaces[0]["name"]
            .as_str()
            .is_some_and(|n| n.starts_with("lxc")),
        "host side first: {result}"
    );
    ensure!(
        ifaces[0].get("sandbox").is_none(),
        "host has no sandbox: {result}"
    );
    ensure!(ifaces[1]["name"] == "eth0", "container side: {result}");
    ensure!(
        ifaces[1]["sandbox"] == netns.display().to_string(),
        "sandbox is the netns: {result}"
    );
    for i in ifaces {
        let mac = i["mac"].as_str().context("mac")?;
        ensure!(mac.len() == 17 && mac.split(':').count() == 6, "mac {mac}");
    }
    let ips = result["ips"].as_array().context("ips")?;
    ensure!(ips.len() == 2, "one address per family: {result}");
    let old = matches!(version, "0.3.1" | "0.4.0");
    for ip in ips {
        let addr = ip["address"].as_str().context("address")?;
        let v4 = addr.contains('.');
        if v4 {
            ensure!(
                addr.starts_with("10.61.0.") && addr.ends_with("/32"),
                "{addr}"
            );
            ensure!(ip["gateway"] == "169.254.1.1", "{ip}");
        } else {
            ensure!(
                addr.starts_with("fd00:61::") && addr.ends_with("/128"),
                "{addr}"
            );
            ensure!(ip["gateway"] == "fe80::1", "{ip}");
        }
        ensure!(
            ip["interface"] == 1,
            "ips point at the container interface: {ip}"
        );
        if old {
            ensure!(
                ip["version"] == if v4 { "4" } else { "6" },
                "{version} has ips[].version: {ip}"
            );
        } else {
            ensure!(
                ip.get("version").is_none(),
                "{version} has no ips[].version: {ip}"
            );
        }
    }
    let routes = result["routes"].as_array().context("routes")?;
    let dsts: BTreeSet<&str> = routes.iter().filter_map(|r| r["dst"].as_str()).collect();
    ensure!(
        dsts == BTreeSet::from(["0.0.0.0/0", "::/0"]),
        "default routes: {result}"
    );
    Ok(())
}

fn ping(from: &Netns, to: &str) -> anyhow::Result<()> {
    let started = Instant::now();
    loop {
        let out = from
            .command("ping")
            .args(["-c", "1", "-W", "1", to])
            .output()?;
        if out.status.success() {
            return Ok(());
        }
        // IPv6 addresses may still be in duplicate address detection.
        if started.elapsed() > Duration::from_secs(5) {
            bail!(
                "ping {to} from {} failed: {}{}",
                from.name(),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn node_with_forwarding() -> anyhow::Result<Netns> {
    let node = Netns::new("node")?;
    node.sysctl("net.ipv4.ip_forward", "1")?;
    node.sysctl("net.ipv6.conf.all.forwarding", "1")?;
    Ok(node)
}

/// The allocations held by the attachment `(id, eth0)`.
fn held_by(agent: &AgentProc, id: &str) -> anyhow::Result<BTreeSet<String>> {
    Ok(agent
        .json(["allocations", "-o", "json"])?
        .as_array()
        .into_iter()
        .flatten()
        .filter(|a| a["owner"]["container_id"] == id)
        .filter_map(|a| a["address"].as_str().map(str::to_string))
        .collect())
}

fn verify(agent: &AgentProc) -> anyhow::Result<()> {
    let out = agent.cli(["verify"])?;
    ensure!(
        out.status.success(),
        "verify: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

#[test]
fn add_check_del_across_versions_and_the_containers_ping_each_other() -> anyhow::Result<()> {
    privileged!();
    let node = node_with_forwarding()?;
    let agent = AgentProc::start(&node, POOLS)?;
    let sock = agent.socket();
    let a_ns = Netns::new("ca")?;
    let b_ns = Netns::new("cb")?;
    let a = unique("ctra");
    let b = unique("ctrb");

    // ADD: A in 0.3.1, B in 1.0.0.
    let a_res = plugin(
        &env("ADD", &a, Some(&a_ns.path()), "eth0"),
        &conf("0.3.1", &sock, json!({})),
    )?
    .ok()?
    .clone();
    check_shape(&a_res, "0.3.1", &a_ns.path())?;
    let b_res = plugin(
        &env("ADD", &b, Some(&b_ns.path()), "eth0"),
        &conf("1.0.0", &sock, json!({})),
    )?
    .ok()?
    .clone();
    check_shape(&b_res, "1.0.0", &b_ns.path())?;
    let a_addrs = result_addrs(&a_res);
    let b_addrs = result_addrs(&b_res);
    ensure!(a_addrs.is_disjoint(&b_addrs), "{a_addrs:?} {b_addrs:?}");

    // The interfaces inside the containers carry exactly those addresses.
    ensure!(addrs(&a_ns, "eth0")? == Some(a_addrs.clone()), "A's eth0");
    ensure!(addrs(&b_ns, "eth0")? == Some(b_addrs.clone()), "B's eth0");
    // And the agent stored them for the right owners.
    let bare_set = |s: &BTreeSet<String>| s.iter().map(|a| bare(a).to_string()).collect();
    ensure!(
        held_by(&agent, &a)? == bare_set(&a_addrs),
        "A's allocations"
    );
    ensure!(
        held_by(&agent, &b)? == bare_set(&b_addrs),
        "B's allocations"
    );
    let host_a = a_res["interfaces"][0]["name"]
        .as_str()
        .context("host")?
        .to_string();
    let host_b = b_res["interfaces"][0]["name"]
        .as_str()
        .context("host")?
        .to_string();
    ensure!(links(&node)?.contains(&host_a) && links(&node)?.contains(&host_b));
    // Each host veth carries exactly one filter: the pinned from_endpoint,
    // direct-action, attached by the ADD's own netlink batch.
    let pinned = agent.pins.path().join("progs/from_endpoint");
    let prog: Value = serde_json::from_slice(
        &Command::new("bpftool")
            .args(["-j", "prog", "show", "pinned"])
            .arg(&pinned)
            .output()?
            .stdout,
    )?;
    let id = prog["id"].as_u64().context("pinned from_endpoint id")?;
    for host in [&host_a, &host_b] {
        let filters = node.exec("tc", ["filter", "show", "dev", host, "ingress"])?;
        let ours: Vec<&str> = filters.lines().filter(|l| l.contains(" handle ")).collect();
        ensure!(ours.len() == 1, "one bpf filter on {host}: {filters}");
        ensure!(
            ours[0].contains("from_endpoint")
                && ours[0].contains("direct-action")
                && ours[0].contains(&format!(" id {id} ")),
            "{host}: the pinned from_endpoint (id {id}), direct-action: {filters}"
        );
    }
    // The host sides only forward: no IPv6 link-local address of their own
    // (the IPv6 pings below cross them all the same).
    for host in [&host_a, &host_b] {
        let v6 = node.exec("ip", ["-6", "-o", "addr", "show", "dev", host])?;
        ensure!(v6.trim().is_empty(), "{host} has IPv6 addresses: {v6}");
    }
    let passed = lockstep_tests::counter(&agent.pins, "from_endpoint_passed")?;

    for addr in &b_addrs {
        ping(&a_ns, bare(addr))?;
    }
    for addr in &a_addrs {
        ping(&b_ns, bare(addr))?;
    }
    let now = lockstep_tests::counter(&agent.pins, "from_endpoint_passed")?;
    ensure!(
        now > passed,
        "the pings went through from_endpoint: {passed} -> {now}"
    );

    // ADD again (0.4.0 and 1.1.0 now): the same addresses and interfaces.
    let a_again = plugin(
        &env("ADD", &a, Some(&a_ns.path()), "eth0"),
        &conf("0.4.0", &sock, json!({})),
    )?
    .ok()?
    .clone();
    check_shape(&a_again, "0.4.0", &a_ns.path())?;
    ensure!(
        result_addrs(&a_again) == a_addrs,
        "idempotent ADD: {a_again}"
    );
    ensure!(
        a_again["interfaces"] == a_res["interfaces"],
        "same interfaces"
    );
    let b_again = plugin(
        &env("ADD", &b, Some(&b_ns.path()), "eth0"),
        &conf("1.1.0", &sock, json!({})),
    )?
    .ok()?
    .clone();
    check_shape(&b_again, "1.1.0", &b_ns.path())?;
    ensure!(
        result_addrs(&b_again) == b_addrs,
        "idempotent ADD: {b_again}"
    );
    ensure!(
        agent
            .json(["allocations", "-o", "json"])?
            .as_array()
            .map(Vec::len)
            == Some(4)
    );

    // CHECK with prevResult passes in 0.4.0, 1.0.0 and 1.1.0.
    for (id, ns, res, versions) in [
        (&a, &a_ns, &a_again, ["0.4.0", "1.0.0"]),
        (&b, &b_ns, &b_again, ["1.0.0", "1.1.0"]),
    ] {
        for v in versions {
            let mut prev = res.clone();
            prev["cniVersion"] = json!(v);
            if v != "0.4.0" {
                for ip in prev["ips"].as_array_mut().into_iter().flatten() {
                    if let Some(o) = ip.as_object_mut() {
                        o.remove("version");
                    }
                }
            }
            let call = plugin(
                &env("CHECK", id, Some(&ns.path()), "eth0"),
                &conf(v, &sock, json!({"prevResult": prev})),
            )?;
            call.ok().with_context(|| format!("CHECK {v}"))?;
            ensure!(call.out.is_null(), "CHECK prints nothing: {}", call.stdout);
        }
    }

    // Delete A's interface by hand: CHECK fails and names it.
    a_ns.ip(["link", "del", "eth0"])?;
    let check = plugin(
        &env("CHECK", &a, Some(&a_ns.path()), "eth0"),
        &conf("1.0.0", &sock, json!({"prevResult": b_again.clone()})),
    )?;
    ensure!(check.exit == 1, "CHECK must fail: {}", check.stdout);
    ensure!(check.code() == Some(100), "{}", check.stdout);
    ensure!(
        check.msg().contains("eth0"),
        "names the interface: {}",
        check.stdout
    );
    ensure!(
        check.out["details"]
            .as_str()
            .unwrap_or_default()
            .contains("check_failed"),
        "{}",
        check.stdout
    );

    // DEL frees everything, and is idempotent.
    for v in ["1.0.0", "0.3.1"] {
        plugin(
            &env("DEL", &a, Some(&a_ns.path()), "eth0"),
            &conf(v, &sock, json!({})),
        )?
        .ok()
        .with_context(|| format!("DEL A in {v}"))?;
        // DEL is acknowledged once the map entries are gone; the reaper
        // deletes the veth, then releases the addresses (docs/cni.md).
        released(&node, &host_a, || held_by(&agent, &a))?;
    }
    // B's namespace goes first (the runtime tore the sandbox down): DEL with
    // the stale path, then without CNI_NETNS, both succeed.
    let b_path = b_ns.path();
    drop(b_ns);
    ensure!(!b_path.exists());
    plugin(
        &env("DEL", &b, Some(&b_path), "eth0"),
        &conf("0.4.0", &sock, json!({"prevResult": b_res})),
    )?
    .ok()
    .context("DEL after the netns is gone")?;
    plugin(
        &env("DEL", &b, None, "eth0"),
        &conf("1.1.0", &sock, json!({})),
    )?
    .ok()
    .context("DEL without CNI_NETNS")?;
    released(&node, &host_b, || held_by(&agent, &b))?;
    let (allocs, eps) = snapshot(&agent)?;
    ensure!(allocs == json!([]), "nothing allocated: {allocs}");
    ensure!(eps == json!([]), "no endpoints: {eps}");
    verify(&agent)?;
    Ok(())
}

#[test]
fn pools_and_requested_addresses_are_honoured_and_refusals_store_nothing() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("node")?;
    let agent = AgentProc::start(&node, POOLS)?;
    let sock = agent.socket();
    let v = "1.1.0";

    // (how, extra config, CNI_ARGS, the v4 address wanted or the pool's prefix)
    let cases: [(&str, Value, &str, &str); 6] = [
        (
            "runtimeConfig.pool",
            json!({"runtimeConfig": {"pool": "second"}}),
            "",
            "10.62.0.",
        ),
        (
            "args.cni.pool",
            json!({"args": {"cni": {"pool": "second"}}}),
            "",
            "10.62.0.",
        ),
        (
            "runtimeConfig.ips (ips capability)",
            json!({"runtimeConfig": {"ips": ["10.61.0.77/24"]}}),
            "",
            "10.61.0.77/32",
        ),
        (
            "args.cni.ips with args.cni.pool",
            json!({"args": {"cni": {"ips": ["10.62.0.50"], "pool": "second"}}}),
            "",
            "10.62.0.50/32",
        ),
        (
            "CNI_ARGS IP=",
            json!({}),
            "K8S_POD_NAMESPACE=default;K8S_POD_NAME=web;IP=10.61.0.79",
            "10.61.0.79/32",
        ),
        (
            "runtimeConfig.ips, both families",
            json!({"runtimeConfig": {"ips": ["10.61.0.78", "fd00:61::78"]}}),
            "",
            "10.61.0.78/32",
        ),
    ];
    let mut keep = Vec::new();
    for (how, extra, args, want) in cases {
        let ns = Netns::new("c")?;
        let id = unique("ctr");
        let mut e = env("ADD", &id, Some(&ns.path()), "eth0");
        if !args.is_empty() {
            e.push(("CNI_ARGS", args.to_string()));
        }
        let res = plugin(&e, &conf(v, &sock, extra))?
            .ok()
            .with_context(|| how.to_string())?
            .clone();
        let got = result_addrs(&res);
        let v4: Vec<&String> = got.iter().filter(|a| a.contains('.')).collect();
        ensure!(v4.len() == 1, "{how}: {res}");
        if want.ends_with('.') {
            ensure!(
                v4[0].starts_with(want),
                "{how}: {} not in pool ({want})",
                v4[0]
            );
            ensure!(got.len() == 1, "{how}: the second pool is IPv4 only: {res}");
        } else {
            ensure!(v4[0] == want, "{how}: got {}, wanted {want}", v4[0]);
        }
        if how.contains("both families") {
            ensure!(got.contains("fd00:61::78/128"), "{how}: {res}");
        }
        ensure!(
            addrs(&ns, "eth0")? == Some(got.clone()),
            "{how}: container addresses"
        );
        let stored: BTreeSet<String> = got.iter().map(|a| bare(a).to_string()).collect();
        ensure!(held_by(&agent, &id)? == stored, "{how}: stored");
        keep.push((ns, id));
    }

    // Refusals: outside every pool, outside the chosen pool, taken, unknown
    // pool. Each is code 100 naming the cause, and stores nothing.
    let refusals: [(&str, Value, &str, &str); 5] = [
        (
            "outside every pool",
            json!({"runtimeConfig": {"ips": ["10.99.0.1"]}}),
            "10.99.0.1",
            "address_outside_pool",
        ),
        (
            "outside the requested pool",
            json!({"runtimeConfig": {"ips": ["10.61.0.5"], "pool": "second"}}),
            "10.61.0.5",
            "address_outside_pool",
        ),
        (
            "CNI_ARGS IP= outside the pool",
            json!({"args": {}}),
            "10.99.0.2",
            "address_outside_pool",
        ),
        (
            "already taken",
            json!({"runtimeConfig": {"ips": ["10.61.0.77"]}}),
            "10.61.0.77",
            "address_taken",
        ),
        (
            "unknown pool",
            json!({"runtimeConfig": {"pool": "nosuchpool"}}),
            "nosuchpool",
            "unknown_pool",
        ),
    ];
    for (how, extra, needle, code) in refusals {
        let ns = Netns::new("c")?;
        let id = unique("ctr");
        let mut e = env("ADD", &id, Some(&ns.path()), "eth0");
        if how.starts_with("CNI_ARGS") {
            e.push((
                "CNI_ARGS",
                format!("K8S_POD_NAMESPACE=shop;K8S_POD_NAME=cart;IP={needle}"),
            ));
        }
        let before = snapshot(&agent)?;
        let node_links = links(&node)?;
        let call = plugin(&e, &conf(v, &sock, extra))?;
        ensure!(call.exit == 1, "{how}: must fail: {}", call.stdout);
        ensure!(call.code() == Some(100), "{how}: {}", call.stdout);
        ensure!(
            call.msg().contains(needle),
            "{how}: message names {needle}: {}",
            call.stdout
        );
        ensure!(
            call.out["details"]
                .as_str()
                .unwrap_or_default()
                .contains(code),
            "{how}: details carry {code}: {}",
            call.stdout
        );
        ensure!(call.out["cniVersion"] == v, "{how}: {}", call.stdout);
        ensure!(snapshot(&agent)? == before, "{how}: nothing stored");
        ensure!(
            links(&node)? == node_links,
            "{how}: no veth left on the node"
        );
        ensure!(
            addrs(&ns, "eth0")?.is_none(),
            "{how}: no eth0 in the container"
        );
        // The agent logs the failure, naming the container, the pod when
        // the runtime said which, and the error (#45 item 6).
        let log = agent.log();
        let line = log
            .lines()
            .find(|l| l.contains("CNI ADD failed") && l.contains(&id))
            .with_context(|| format!("{how}: no log line for {id}:\n{log}"))?;
        ensure!(
            line.contains(code),
            "{how}: the log line names {code}: {line}"
        );
        if how.starts_with("CNI_ARGS") {
            ensure!(
                line.contains("shop/cart"),
                "{how}: the log line names the pod: {line}"
            );
        }
    }

    for (ns, id) in &keep {
        plugin(
            &env("DEL", id, Some(&ns.path()), "eth0"),
            &conf(v, &sock, json!({})),
        )?
        .ok()?;
    }
    wait_for("all released", Duration::from_secs(5), || {
        (snapshot(&agent).ok()? == (json!([]), json!([]))).then_some(())
    })?;
    verify(&agent)?;
    Ok(())
}

#[test]
fn gc_releases_attachments_not_listed_and_spares_other_owners() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("node")?;
    let agent = AgentProc::start(&node, POOLS)?;
    let sock = agent.socket();
    let mut attached = Vec::new();
    for _ in 0..3 {
        let ns = Netns::new("c")?;
        let id = unique("ctr");
        let res = plugin(
            &env("ADD", &id, Some(&ns.path()), "eth0"),
            &conf("1.1.0", &sock, json!({})),
        )?
        .ok()?
        .clone();
        let host = res["interfaces"][0]["name"]
            .as_str()
            .context("host")?
            .to_string();
        attached.push((ns, id, host));
    }
    // Other owners, made through the agent API: a resource (CLI), a
    // LoadBalancer, and a resource in the second pool (the API refuses the
    // agent-only `delegated` kind; delegated attachments are GC-tested in
    // tests/tests/delegated.rs).
    agent.json([
        "allocate", "--kind", "node", "--name", "n1", "--family", "ipv4", "-o", "json",
    ])?;
    api(
        &agent,
        Method::POST,
        "/v1/allocations",
        Some(json!({"pool": "default", "family": "ipv6",
                    "owner": {"owner": "loadbalancer", "service": "default/web"}})),
    )?;
    api(
        &agent,
        Method::POST,
        "/v1/allocations",
        Some(json!({"pool": "second", "family": "ipv4",
                    "owner": {"owner": "resource", "kind": "vm", "name": "other"}})),
    )?;
    let others = |allocs: &Value| -> Vec<Value> {
        allocs
            .as_array()
            .into_iter()
            .flatten()
            .filter(|a| a["owner"]["owner"] != "endpoint")
            .cloned()
            .collect()
    };
    let (allocs, eps) = snapshot(&agent)?;
    let other_before = others(&allocs);
    ensure!(other_before.len() == 3, "{allocs}");
    ensure!(eps.as_array().map(Vec::len) == Some(3), "{eps}");

    let (keep_ns, keep_id, keep_host) = &attached[0];
    let gc = conf(
        "1.1.0",
        &sock,
        json!({"cni.dev/valid-attachments": [{"containerID": keep_id, "ifname": "eth0"}]}),
    );
    for round in 0..2 {
        let call = plugin(&net_env("GC"), &gc)?;
        call.ok().with_context(|| format!("GC round {round}"))?;
        ensure!(call.out.is_null(), "GC prints nothing: {}", call.stdout);
        let (allocs, eps) = snapshot(&agent)?;
        ensure!(
            others(&allocs) == other_before,
            "GC touched another owner: {allocs}"
        );
        let ids: BTreeSet<&str> = eps
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|e| e["container_id"].as_str())
            .collect();
        ensure!(ids == BTreeSet::from([keep_id.as_str()]), "{eps}");
        ensure!(
            held_by(&agent, keep_id)?.len() == 2,
            "the kept attachment keeps both"
        );
        for (ns, id, host) in &attached[1..] {
            // GC releases as DEL does: the reaper deletes the veth, then
            // the addresses go.
            released(&node, host, || held_by(&agent, id)).with_context(|| id.clone())?;
            ensure!(
                addrs(ns, "eth0")?.is_none(),
                "{id}'s eth0 went with its veth"
            );
        }
        ensure!(links(&node)?.contains(keep_host), "kept veth stays");
        ensure!(addrs(keep_ns, "eth0")?.is_some_and(|a| a.len() == 2));
    }
    verify(&agent)?;
    Ok(())
}

fn bad<'a>(
    name: &'static str,
    env: Vec<(&'static str, std::ffi::OsString)>,
    stdin: Vec<u8>,
    code: u64,
    msg: &'a str,
) -> Bad<'a> {
    Bad {
        name,
        env,
        stdin,
        code,
        msg,
    }
}

/// One malformed invocation and what it must produce.
struct Bad<'a> {
    name: &'static str,
    env: Vec<(&'static str, std::ffi::OsString)>,
    stdin: Vec<u8>,
    code: u64,
    msg: &'a str,
}

#[test]
fn malformed_invocations_get_the_spec_code_a_clear_message_and_change_nothing() -> anyhow::Result<()>
{
    use std::os::unix::ffi::OsStrExt;
    privileged!();
    let node = Netns::new("node")?;
    let agent = AgentProc::start(&node, POOLS)?;
    let sock = agent.socket();
    // State for the cases to leave alone: one attachment.
    let live_ns = Netns::new("c")?;
    let live = unique("live");
    let live_res = plugin(
        &env("ADD", &live, Some(&live_ns.path()), "eth0"),
        &conf("1.1.0", &sock, json!({})),
    )?
    .ok()?
    .clone();
    let live_v4 = result_addrs(&live_res)
        .into_iter()
        .find(|a| a.contains('.'))
        .context("v4")?;
    let c_ns = Netns::new("c")?;
    let id = unique("ctr");

    let os = |pairs: Vec<(&'static str, String)>| -> Vec<(&'static str, std::ffi::OsString)> {
        pairs.into_iter().map(|(k, v)| (k, v.into())).collect()
    };
    let add_env = || os(env("ADD", &id, Some(&c_ns.path()), "eth0"));
    let without = |cmd: &str, drop: &[&str]| {
        os(env(cmd, &id, Some(&c_ns.path()), "eth0")
            .into_iter()
            .filter(|(k, _)| !drop.contains(k))
            .collect())
    };
    let with = |cmd: &str, key: &'static str, value: &str| {
        let mut e: Vec<(&'static str, String)> = env(cmd, &id, Some(&c_ns.path()), "eth0")
            .into_iter()
            .filter(|(k, _)| *k != key)
            .collect();
        e.push((key, value.to_string()));
        os(e)
    };
    let good = |v: &str| conf(v, &sock, json!({})).to_string().into_bytes();
    let cfg = |v: &str, extra: Value| conf(v, &sock, extra).to_string().into_bytes();
    let raw = |text: &str| text.as_bytes().to_vec();
    let nowhere = PathBuf::from(format!("/run/lockstep-nowhere-{}.sock", std::process::id()));
    let mut huge = conf("1.0.0", &sock, json!({}));
    huge["padding"] = json!("x".repeat(1 << 20));
    let gone_ns = format!("/run/netns/lockstep-t-gone-{}", std::process::id());
    let prev = json!({"cniVersion": "1.0.0", "interfaces": [], "ips": [], "routes": []});

    let cases: Vec<Bad> = vec![
        // Environment: code 4, naming the variable.
        // A missing CNI_COMMAND cannot be told apart from `lockstep` run
        // with no arguments (the CLI's usage error); an empty one can.
        bad(
            "empty CNI_COMMAND",
            with("ADD", "CNI_COMMAND", ""),
            good("1.0.0"),
            4,
            "CNI_COMMAND",
        ),
        bad(
            "unknown CNI_COMMAND",
            with("ADD", "CNI_COMMAND", "ATTACH"),
            good("1.0.0"),
            4,
            "CNI_COMMAND",
        ),
        bad(
            "lower-case command",
            with("ADD", "CNI_COMMAND", "add"),
            good("1.0.0"),
            4,
            "CNI_COMMAND",
        ),
        bad(
            "ADD without CNI_CONTAINERID",
            without("ADD", &["CNI_CONTAINERID"]),
            good("1.0.0"),
            4,
            "CNI_CONTAINERID",
        ),
        bad(
            "ADD without CNI_NETNS",
            without("ADD", &["CNI_NETNS"]),
            good("1.0.0"),
            4,
            "CNI_NETNS",
        ),
        bad(
            "ADD without CNI_IFNAME",
            without("ADD", &["CNI_IFNAME"]),
            good("1.0.0"),
            4,
            "CNI_IFNAME",
        ),
        bad(
            "ADD without all three",
            without("ADD", &["CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME"]),
            good("1.0.0"),
            4,
            "CNI_CONTAINERID, CNI_NETNS, CNI_IFNAME",
        ),
        bad(
            "CHECK without CNI_NETNS",
            without("CHECK", &["CNI_NETNS"]),
            good("1.0.0"),
            4,
            "CNI_NETNS",
        ),
        bad(
            "DEL without CNI_CONTAINERID",
            without("DEL", &["CNI_CONTAINERID"]),
            good("1.0.0"),
            4,
            "CNI_CONTAINERID",
        ),
        bad(
            "DEL without CNI_IFNAME",
            without("DEL", &["CNI_IFNAME"]),
            good("1.0.0"),
            4,
            "CNI_IFNAME",
        ),
        bad(
            "GC without CNI_PATH",
            os(vec![("CNI_COMMAND", "GC".into())]),
            cfg("1.1.0", json!({"cni.dev/valid-attachments": []})),
            4,
            "CNI_PATH",
        ),
        bad(
            "empty CNI_CONTAINERID",
            with("ADD", "CNI_CONTAINERID", ""),
            good("1.0.0"),
            4,
            "CNI_CONTAINERID",
        ),
        bad(
            "container ID with '/'",
            with("ADD", "CNI_CONTAINERID", "bad/id"),
            good("1.0.0"),
            4,
            "CNI_CONTAINERID",
        ),
        bad(
            "container ID starting with '-'",
            with("ADD", "CNI_CONTAINERID", "-x"),
            good("1.0.0"),
            4,
            "CNI_CONTAINERID",
        ),
        bad(
            "relative CNI_NETNS",
            with("ADD", "CNI_NETNS", "run/netns/x"),
            good("1.0.0"),
            4,
            "CNI_NETNS",
        ),
        bad(
            "ifname of 16 bytes",
            with("ADD", "CNI_IFNAME", "eth0123456789abc"),
            good("1.0.0"),
            4,
            "CNI_IFNAME",
        ),
        bad(
            "ifname with '/'",
            with("ADD", "CNI_IFNAME", "eth/0"),
            good("1.0.0"),
            4,
            "CNI_IFNAME",
        ),
        bad(
            "ifname '..'",
            with("ADD", "CNI_IFNAME", ".."),
            good("1.0.0"),
            4,
            "CNI_IFNAME",
        ),
        bad(
            "ifname with a space",
            with("ADD", "CNI_IFNAME", "eth 0"),
            good("1.0.0"),
            4,
            "CNI_IFNAME",
        ),
        bad(
            "CNI_ARGS pair without '='",
            with("ADD", "CNI_ARGS", "IP"),
            good("1.0.0"),
            4,
            "CNI_ARGS",
        ),
        bad(
            "CNI_ARGS key twice",
            with("ADD", "CNI_ARGS", "A=1;A=2"),
            good("1.0.0"),
            4,
            "CNI_ARGS",
        ),
        bad(
            "CNI_ARGS IP= not an address",
            with("ADD", "CNI_ARGS", "IP=10.61.0.300"),
            good("1.0.0"),
            4,
            "10.61.0.300",
        ),
        bad(
            "CNI_ARGS IP= bad prefix",
            with("ADD", "CNI_ARGS", "IP=10.61.0.9/40"),
            good("1.0.0"),
            4,
            "CNI_ARGS",
        ),
        bad(
            "CNI_NETNS not UTF-8",
            {
                let mut e = without("ADD", &["CNI_NETNS"]);
                e.push((
                    "CNI_NETNS",
                    std::ffi::OsStr::from_bytes(b"/run/netns/\xff").to_os_string(),
                ));
                e
            },
            good("1.0.0"),
            4,
            "not valid UTF-8",
        ),
        // Stdin and JSON: 5 and 6.
        bad(
            "stdin over 1 MiB",
            add_env(),
            huge.to_string().into_bytes(),
            5,
            "larger than 1048576 bytes",
        ),
        bad("empty stdin", add_env(), Vec::new(), 6, "not valid JSON"),
        bad(
            "truncated JSON",
            add_env(),
            raw("{\"cniVersion\": \"1.0.0\""),
            6,
            "not valid JSON",
        ),
        bad(
            "a list, not an object",
            add_env(),
            raw("[]"),
            6,
            "must be an object",
        ),
        bad(
            "cniVersion a number",
            add_env(),
            cfg("1.0.0", json!({"cniVersion": 1})),
            6,
            "cniVersion",
        ),
        bad(
            "cniVersion not a triple",
            add_env(),
            cfg("1.0", json!({})),
            6,
            "MAJOR.MINOR.PATCH",
        ),
        bad(
            "mtu a string",
            add_env(),
            cfg("1.0.0", json!({"mtu": "1500"})),
            6,
            "mtu",
        ),
        bad(
            "runtimeConfig.ips not a list",
            add_env(),
            cfg("1.0.0", json!({"runtimeConfig": {"ips": "10.61.0.5"}})),
            6,
            "runtimeConfig.ips",
        ),
        bad(
            "args.cni.ips of numbers",
            add_env(),
            cfg("1.0.0", json!({"args": {"cni": {"ips": [42]}}})),
            6,
            "args.cni.ips",
        ),
        // Versions and commands: 1.
        bad(
            "no cniVersion",
            add_env(),
            raw(&format!(
                "{{\"name\":\"n\",\"type\":\"lockstep\",\"agentSocket\":\"{}\"}}",
                sock.display()
            )),
            1,
            "cniVersion",
        ),
        bad("cniVersion 0.2.0", add_env(), good("0.2.0"), 1, "0.2.0"),
        bad("cniVersion 2.0.0", add_env(), good("2.0.0"), 1, "2.0.0"),
        bad(
            "CHECK on 0.3.1",
            os(env("CHECK", &live, Some(&live_ns.path()), "eth0")),
            cfg("0.3.1", json!({"prevResult": live_res.clone()})),
            1,
            "CHECK needs cniVersion 0.4.0",
        ),
        bad(
            "GC on 1.0.0",
            os(net_env("GC")),
            cfg("1.0.0", json!({"cni.dev/valid-attachments": []})),
            1,
            "GC needs cniVersion 1.1.0",
        ),
        bad(
            "STATUS on 0.4.0",
            os(net_env("STATUS")),
            good("0.4.0"),
            1,
            "STATUS needs cniVersion 1.1.0",
        ),
        // Configuration: 2 and 7.
        bad(
            "ipam section on the full plugin",
            add_env(),
            cfg("1.0.0", json!({"ipam": {"type": "host-local"}})),
            2,
            "ipam",
        ),
        bad(
            "host-local subnet under lockstep-ipam",
            add_env(),
            cfg(
                "1.0.0",
                json!({"type": "ptp", "ipam": {"type": "lockstep-ipam", "subnet": "10.61.0.0/24"}}),
            ),
            2,
            "ipam.subnet",
        ),
        bad(
            "not for lockstep",
            add_env(),
            cfg("1.0.0", json!({"type": "bridge"})),
            7,
            "bridge",
        ),
        bad(
            "no name",
            add_env(),
            raw(&format!(
                "{{\"cniVersion\":\"1.0.0\",\"type\":\"lockstep\",\"agentSocket\":\"{}\"}}",
                sock.display()
            )),
            7,
            "name",
        ),
        bad(
            "bad network name",
            add_env(),
            cfg("1.0.0", json!({"name": "bad name"})),
            7,
            "name",
        ),
        bad(
            "relative agentSocket",
            add_env(),
            cfg("1.0.0", json!({"agentSocket": "lockstep.sock"})),
            7,
            "agentSocket",
        ),
        bad(
            "mtu 10",
            add_env(),
            cfg("1.0.0", json!({"mtu": 10})),
            7,
            "mtu",
        ),
        bad(
            "requested address 10.61.0.300",
            add_env(),
            cfg("1.0.0", json!({"runtimeConfig": {"ips": ["10.61.0.300"]}})),
            7,
            "10.61.0.300",
        ),
        bad(
            "requested prefix /33",
            add_env(),
            cfg("1.0.0", json!({"runtimeConfig": {"ips": ["10.61.0.5/33"]}})),
            7,
            "33",
        ),
        bad(
            "requested IPv6 garbage",
            add_env(),
            cfg("1.0.0", json!({"runtimeConfig": {"ips": ["fd00:61::zz"]}})),
            7,
            "fd00:61::zz",
        ),
        bad(
            "same address, two prefixes",
            add_env(),
            cfg(
                "1.0.0",
                json!({"runtimeConfig": {"ips": ["10.61.0.5/24", "10.61.0.5/25"]}}),
            ),
            7,
            "conflicts",
        ),
        bad(
            "bad pool name",
            add_env(),
            cfg("1.0.0", json!({"runtimeConfig": {"pool": "no pool!"}})),
            7,
            "runtimeConfig.pool",
        ),
        bad(
            "CHECK without prevResult",
            os(env("CHECK", &live, Some(&live_ns.path()), "eth0")),
            good("1.0.0"),
            7,
            "prevResult",
        ),
        bad(
            "GC without valid-attachments",
            os(net_env("GC")),
            good("1.1.0"),
            7,
            "cni.dev/valid-attachments",
        ),
        bad(
            "GC with a bad containerID",
            os(net_env("GC")),
            cfg(
                "1.1.0",
                json!({"cni.dev/valid-attachments": [{"containerID": "a b", "ifname": "eth0"}]}),
            ),
            7,
            "containerID",
        ),
        bad(
            "CHECK with a malformed prevResult",
            os(env("CHECK", &live, Some(&live_ns.path()), "eth0")),
            cfg(
                "1.0.0",
                json!({"prevResult": {"cniVersion": "1.0.0", "ips": [{"address": "nope"}]}}),
            ),
            7,
            "prevResult",
        ),
        // A namespace that does not exist: the container does not exist
        // (3), and nothing is allocated.
        bad(
            "nonexistent netns path",
            with("ADD", "CNI_NETNS", &gone_ns),
            good("1.0.0"),
            3,
            "lockstep-t-gone",
        ),
        // Refused by the agent: 100, the agent's code in details.
        bad(
            "unknown pool",
            add_env(),
            cfg("1.0.0", json!({"pool": "nosuchpool"})),
            100,
            "nosuchpool",
        ),
        bad(
            "address outside the pool",
            add_env(),
            cfg("1.0.0", json!({"runtimeConfig": {"ips": ["192.0.2.1"]}})),
            100,
            "192.0.2.1",
        ),
        bad(
            "address of another container",
            add_env(),
            cfg(
                "1.0.0",
                json!({"runtimeConfig": {"ips": [live_v4.clone()]}}),
            ),
            100,
            bare(&live_v4),
        ),
        bad(
            "ifname taken in the container",
            with("ADD", "CNI_IFNAME", "lo"),
            good("1.0.0"),
            100,
            "lo already exists",
        ),
        bad(
            "CHECK of an unknown attachment",
            os(env("CHECK", &id, Some(&c_ns.path()), "eth0")),
            cfg("1.0.0", json!({"prevResult": prev})),
            100,
            "no attachment",
        ),
        // The agent is not there: 11.
        bad(
            "agentSocket nowhere (ADD)",
            add_env(),
            cfg("1.0.0", json!({"agentSocket": nowhere})),
            11,
            "not reachable",
        ),
        bad(
            "agentSocket nowhere (DEL)",
            os(env("DEL", &live, None, "eth0")),
            cfg("1.0.0", json!({"agentSocket": nowhere})),
            11,
            "not reachable",
        ),
        bad(
            "agentSocket nowhere (GC)",
            os(net_env("GC")),
            cfg(
                "1.1.0",
                json!({"agentSocket": nowhere, "cni.dev/valid-attachments": []}),
            ),
            11,
            "not reachable",
        ),
    ];
    ensure!(cases.len() >= 40, "{} cases", cases.len());

    let node_links = links(&node)?;
    let c_links = links(&c_ns)?;
    let mut failures = Vec::new();
    for case in &cases {
        let before = snapshot(&agent)?;
        let call = plugin_os(&case.env, &case.stdin)?;
        eprintln!("{:<40} {:?} {}", case.name, call.code(), call.msg());
        let mut problems = Vec::new();
        if call.exit != 1 {
            problems.push(format!("exit {} instead of 1", call.exit));
        }
        if call.code() != Some(case.code) {
            problems.push(format!("code {:?} instead of {}", call.code(), case.code));
        }
        if !call.msg().contains(case.msg) {
            problems.push(format!("msg does not contain {:?}", case.msg));
        }
        if call.out["cniVersion"].as_str().is_none() || call.out["details"].as_str().is_none() {
            problems.push("error object without cniVersion or details".into());
        }
        if snapshot(&agent)? != before {
            problems.push("stored state changed".into());
        }
        if links(&node)? != node_links || links(&c_ns)? != c_links {
            problems.push("interfaces changed".into());
        }
        if !problems.is_empty() {
            failures.push(format!(
                "{}: {} (stdout {})",
                case.name,
                problems.join(", "),
                call.stdout.trim()
            ));
        }
    }
    ensure!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
    eprintln!("{} malformed invocations refused correctly", cases.len());
    // The live attachment is intact.
    ensure!(addrs(&live_ns, "eth0")?.is_some_and(|a| a.len() == 2));
    verify(&agent)?;
    Ok(())
}

#[test]
fn status_reports_ready_exhausted_and_stopped() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("node")?;
    let mut agent = AgentProc::start(&node, POOLS)?;
    let sock = agent.socket();
    let status = |extra: Value| plugin(&net_env("STATUS"), &conf("1.1.0", &sock, extra));

    // VERSION needs no agent and lists every version.
    for v in VERSIONS {
        let call = plugin(&net_env("VERSION"), &json!({"cniVersion": v}))?;
        ensure!(
            call.ok()?["supportedVersions"] == json!(VERSIONS),
            "{}",
            call.stdout
        );
        ensure!(call.out["cniVersion"] == v, "{}", call.stdout);
    }

    let ready = status(json!({}))?;
    ready.ok()?;
    ensure!(
        ready.out.is_null(),
        "STATUS prints nothing on success: {}",
        ready.stdout
    );
    status(json!({"pool": "tiny"}))?.ok()?;

    // Exhaust the tiny pool (a /30: two usable addresses).
    for n in ["t1", "t2"] {
        agent.json([
            "allocate", "--pool", "tiny", "--kind", "node", "--name", n, "--family", "ipv4", "-o",
            "json",
        ])?;
    }
    let exhausted = status(json!({"pool": "tiny"}))?;
    ensure!(exhausted.exit == 1, "{}", exhausted.stdout);
    ensure!(exhausted.code() == Some(50), "{}", exhausted.stdout);
    ensure!(exhausted.msg().contains("tiny"), "{}", exhausted.stdout);
    // Other pools still have room.
    status(json!({}))?.ok()?;
    status(json!({"runtimeConfig": {"pool": "second"}}))?.ok()?;

    agent.stop()?;
    let stopped = status(json!({}))?;
    ensure!(stopped.exit == 1, "{}", stopped.stdout);
    ensure!(stopped.code() == Some(50), "{}", stopped.stdout);
    ensure!(
        stopped.msg().contains(&sock.display().to_string()),
        "names the socket: {}",
        stopped.stdout
    );
    Ok(())
}

#[test]
fn status_follows_the_default_pool_and_unusable_sockets_are_permanent_errors() -> anyhow::Result<()>
{
    privileged!();
    let node = Netns::new("node")?;
    let agent = AgentProc::start(
        &node,
        r#"default_pool = "small"
[[pools]]
name = "big"
ipv4 = ["10.67.0.0/24"]
[[pools]]
name = "small"
ipv4 = ["10.67.1.0/30"]
"#,
    )?;
    let sock = agent.socket();
    let status = |extra: Value| plugin(&net_env("STATUS"), &conf("1.1.0", &sock, extra));
    status(json!({}))?.ok()?;
    let mut held = Vec::new();
    for n in ["s1", "s2"] {
        held.push(agent.json([
            "allocate", "--pool", "small", "--kind", "node", "--name", n, "--family", "ipv4", "-o",
            "json",
        ])?);
    }
    // The default pool is full while another has room: no ADD without a
    // pool can be served, and STATUS says so (it summed every pool before).
    let full = status(json!({}))?;
    ensure!(full.code() == Some(50), "{}", full.stdout);
    ensure!(full.msg().contains("small"), "{}", full.stdout);
    status(json!({"pool": "big"}))?.ok()?;
    let out = agent.cli([
        "release", "--pool", "small", "--kind", "node", "--name", "s1", "--family", "ipv4",
    ])?;
    ensure!(out.status.success(), "release");
    status(json!({}))?.ok()?;

    // An agentSocket that is a regular file or a directory: retrying will
    // never help, so not code 11.
    let scratch = lockstep_tests::TempDir::new("badsock")?;
    let file = scratch.path().join("file.sock");
    std::fs::write(&file, b"")?;
    for (path, what) in [
        (file.as_path(), "not a socket"),
        (scratch.path(), "a directory"),
    ] {
        let ns = Netns::new("c")?;
        let call = plugin(
            &env("ADD", &unique("badsock"), Some(&ns.path()), "eth0"),
            &conf("1.0.0", path, json!({})),
        )?;
        ensure!(call.exit == 1, "{}", call.stdout);
        ensure!(call.code() == Some(7), "{what}: {}", call.stdout);
        ensure!(call.msg().contains(what), "{what}: {}", call.stdout);
    }
    Ok(())
}

/// A normal ADD looks no interface up before creating its pair, so the
/// two ways a name can be taken are found on the kernel's `EEXIST`: the
/// container's interface name in use (refused, nothing stored, nothing
/// left), and the host name held by the leftovers of an ADD that crashed
/// before its commit (removed, and the ADD goes on).
#[test]
fn taken_interface_names_are_refused_or_reclaimed() -> anyhow::Result<()> {
    privileged!();
    let node = node_with_forwarding()?;
    let agent = AgentProc::start(&node, POOLS)?;
    let sock = agent.socket();
    let config = conf("1.0.0", &sock, json!({}));

    // The container already has an eth0.
    let taken = Netns::new("taken")?;
    taken.ip([
        "link", "add", "eth0", "type", "veth", "peer", "name", "eth0peer",
    ])?;
    let id = unique("taken");
    let before = links(&node)?;
    let call = plugin(&env("ADD", &id, Some(&taken.path()), "eth0"), &config)?;
    ensure!(
        call.exit != 0,
        "ADD over an existing eth0 succeeded: {}",
        call.stdout
    );
    ensure!(
        call.msg().contains("already exists") && call.msg().contains("eth0"),
        "the refusal names the interface: {}",
        call.stdout
    );
    ensure!(
        held_by(&agent, &id)?.is_empty(),
        "the refused ADD holds addresses"
    );
    ensure!(
        links(&node)? == before,
        "the refused ADD left host interfaces"
    );
    ensure!(
        links(&taken)?.contains("eth0"),
        "the container's own eth0 was touched"
    );

    // A crashed ADD's host veth, under the name this attachment's ADD uses.
    let fresh = Netns::new("fresh")?;
    let id = unique("left");
    let host = lockstep::agent::endpoints::host_ifname(&id, "eth0");
    node.ip([
        "link",
        "add",
        &host,
        "type",
        "veth",
        "peer",
        "name",
        "leftover0",
    ])?;
    let stale = node.ip(["-j", "link", "show", &host])?;
    let result = plugin(&env("ADD", &id, Some(&fresh.path()), "eth0"), &config)?;
    let result = result.ok()?;
    let now = node.ip(["-j", "link", "show", &host])?;
    ensure!(now != stale, "the leftover veth {host} was kept: {now}");
    ensure!(
        !links(&node)?.contains("leftover0"),
        "the leftover's peer outlived it"
    );
    let addrs = result_addrs(result);
    ensure!(!addrs.is_empty(), "no addresses: {result}");
    ensure!(
        addrs
            .iter()
            .all(|a| held_by(&agent, &id).is_ok_and(|h| h.contains(bare(a)))),
        "the reply's addresses are not held: {addrs:?}"
    );
    verify(&agent)?;
    plugin(&env("DEL", &id, Some(&fresh.path()), "eth0"), &config)?.ok()?;
    released(&node, &host, || held_by(&agent, &id))?;
    Ok(())
}
