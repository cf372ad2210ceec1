//! podman as the real CNI client of lockstep.
//!
//! Every podman test runs the agent inside a node network namespace the test
//! creates (an address of each family on its `lo`, forwarding on), mostly
//! with `[cni] install = true` pointed at the test's own plugin and conflist
//! directories (the conflist with `cniVersion` 1.0.0: podman 4.3.1's libcni
//! cannot read 1.1.0 results), and gives podman a private `containers.conf`
//! (`CONTAINERS_CONF`: CNI backend, those directories, its own tmp dir) and
//! its own `--root`/`--runroot`, so nothing of the machine's podman or CNI
//! configuration is read or written. The image is a busybox rootfs imported
//! from the local `busybox-static`; no registry is involved.
//!
//! Where things live: podman creates the container's network namespace and
//! runs the `lockstep` plugin from the machine's root namespace, but the
//! plugin does no interface work itself: it asks the agent over its socket,
//! and the agent (in the node namespace) makes the veth there and moves the
//! peer into the container. So the root namespace is never touched; the tests
//! assert that no `lxc*` interface ever appears in it.
//!
//! The `bridge` + `lockstep-ipam` test cannot use podman: the reference
//! `bridge` plugin creates its bridge and host-side veths in the namespace it
//! runs in, which under podman is the machine's root namespace (forbidden
//! here). That test runs the plugins itself, as a runtime would (env +
//! stdin), from inside the node namespace (`nsenter --net`), against
//! container namespaces it created.
//!
//! The podman tests take a lock and run one at a time: they share two cores,
//! and the packet-loss test measures timing-sensitive traffic.

use std::collections::BTreeSet;
use std::io::Write;
use std::net::IpAddr;
use std::process::{Command, Output, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use lockstep_tests::podman::node_netns;
use lockstep_tests::podman::{Podman, ok};
use lockstep_tests::seqping::SeqPing;
use lockstep_tests::{AgentProc, Netns, TempDir, lockstep_bin, privileged, sh, unique};
use serde_json::Value;

/// An address with a prefix length: enough to test membership.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Cidr {
    addr: IpAddr,
    len: u32,
}

impl Cidr {
    fn parse(s: &str) -> anyhow::Result<Self> {
        let (addr, len) = s
            .split_once('/')
            .with_context(|| format!("{s} has no prefix"))?;
        Ok(Self {
            addr: addr.parse().with_context(|| s.to_string())?,
            len: len.parse().with_context(|| s.to_string())?,
        })
    }

    fn contains(&self, a: &IpAddr) -> bool {
        match (self.addr, a) {
            (IpAddr::V4(n), IpAddr::V4(a)) => {
                let mask = u32::MAX.checked_shl(32 - self.len).unwrap_or(0);
                u32::from(n) & mask == u32::from(*a) & mask
            }
            (IpAddr::V6(n), IpAddr::V6(a)) => {
                let mask = u128::MAX.checked_shl(128 - self.len).unwrap_or(0);
                u128::from(n) & mask == u128::from(*a) & mask
            }
            _ => false,
        }
    }
}

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// No periodic reconcile during a test: `verify` must find the maps right
/// as ADD and DEL left them, not as a reconcile repaired them.
const NO_RECONCILE: &str = r#"reconcile_interval = "1h""#;

/// Pool `pods` with `v4`/`v6` and the CNI install section for `network`
/// into podman's directories.
fn agent_toml(podman: &Podman, network: &str, v4: &str, v6: &str) -> String {
    lockstep_tests::podman::cni_agent_toml(&podman.bin_dir, &podman.net_dir, network, v4, v6)
}

/// Names of the interfaces of a namespace (`ip -j link`); `None` is the
/// machine's root namespace.
fn links(ns: Option<&Netns>) -> anyhow::Result<Vec<String>> {
    let out = match ns {
        Some(ns) => ns.ip(["-j", "link"])?,
        None => sh("ip", ["-j", "link"])?,
    };
    let v: Value = serde_json::from_str(&out)?;
    Ok(v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|l| l["ifname"].as_str().map(str::to_string))
        .collect())
}

fn lxc_links(ns: Option<&Netns>) -> anyhow::Result<Vec<String>> {
    Ok(links(ns)?
        .into_iter()
        .filter(|n| n.starts_with("lxc"))
        .collect())
}

fn assert_root_untouched() -> anyhow::Result<()> {
    let lxc = lxc_links(None)?;
    ensure!(
        lxc.is_empty(),
        "lxc interfaces in the root namespace: {lxc:?}"
    );
    Ok(())
}

/// podman's own namespaces (`/run/netns/netns-*`).
fn podman_netns() -> BTreeSet<String> {
    std::fs::read_dir("/run/netns")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("netns-"))
        .collect()
}

/// Addresses the agent holds for endpoint `container_id`/`eth0`.
fn held_by(agent: &AgentProc, container_id: &str) -> anyhow::Result<BTreeSet<IpAddr>> {
    let all = agent.json(["allocations", "-o", "json"])?;
    let mut held = BTreeSet::new();
    for a in all.as_array().context("allocations is not a list")? {
        if a["owner"]["owner"] == "endpoint" && a["owner"]["container_id"] == container_id {
            ensure!(a["owner"]["ifname"] == "eth0", "{a}");
            held.insert(
                a["address"]
                    .as_str()
                    .context("address")?
                    .parse()
                    .context("address")?,
            );
        }
    }
    Ok(held)
}

fn endpoint_allocations(agent: &AgentProc) -> anyhow::Result<Vec<Value>> {
    Ok(agent
        .json(["allocations", "-o", "json"])?
        .as_array()
        .context("allocations is not a list")?
        .iter()
        .filter(|a| a["owner"]["owner"] == "endpoint")
        .cloned()
        .collect())
}

fn verify(agent: &AgentProc) -> anyhow::Result<()> {
    let out = agent.cli(["verify"])?;
    if !out.status.success() {
        let dump = Command::new(lockstep_bin())
            .args(["maps", "dump", "-o", "json", "--pin-root"])
            .arg(agent.pins.path())
            .output()?;
        bail!(
            "lockstep verify failed:\n{}{}\nmaps:\n{}",
            text(&out.stdout),
            text(&out.stderr),
            text(&dump.stdout),
        );
    }
    Ok(())
}

/// `ping -c <count>` from container `from`; fails unless every packet came
/// back.
fn ping(podman: &Podman, from: &str, to: IpAddr, count: u32) -> anyhow::Result<String> {
    let count_s = count.to_string();
    let to_s = to.to_string();
    let out = podman.exec(
        from,
        &["ping", "-c", &count_s, "-i", "0.2", "-W", "2", &to_s],
    )?;
    let stdout = text(&out.stdout);
    let want = format!("{count} packets transmitted, {count} packets received");
    ensure!(
        out.status.success() && stdout.contains(&want),
        "ping {from} -> {to} lost packets ({}):\n{stdout}{}",
        out.status,
        text(&out.stderr)
    );
    Ok(stdout)
}

/// Three containers get distinct pool addresses that podman and the agent
/// agree on, reach each other and the node, and give them back on removal.
/// The agent installed the plugin and conflist podman used, and removes only
/// the files it wrote that nobody changed.
#[test]
fn three_containers_get_pool_addresses_reach_each_other_and_free_them() -> anyhow::Result<()> {
    privileged!();
    let _serial = serial();
    let podman = Podman::new()?;
    let node = node_netns("10.61.255.1", "fd00:61:ff::1")?;
    let network = unique("lsnet");
    let mut agent = AgentProc::start(
        &node,
        &agent_toml(&podman, &network, "10.61.0.0/24", "fd00:61::/120"),
    )?;
    let v4_pool = Cidr::parse("10.61.0.0/24")?;
    let v6_pool = Cidr::parse("fd00:61::/120")?;

    // The agent installed the plugin (both names: the small lockstep-cni
    // binary built beside it) and the conflist.
    let plugin = lockstep_bin().with_file_name("lockstep-cni");
    let binary = std::fs::read(&plugin).with_context(|| format!("{} missing", plugin.display()))?;
    for name in ["lockstep", "lockstep-ipam"] {
        let path = podman.bin_dir.join(name);
        ensure!(
            std::fs::read(&path).with_context(|| format!("{} missing", path.display()))? == binary,
            "{} is not the lockstep-cni plugin binary",
            path.display()
        );
    }
    let conflist = podman.net_dir.join(format!("{network}.conflist"));
    let conf_text = std::fs::read_to_string(&conflist).context("conflist not installed")?;
    let conf: Value = serde_json::from_str(&conf_text)?;
    ensure!(conf["name"] == network.as_str(), "{conf_text}");
    ensure!(conf["plugins"][0]["type"] == "lockstep", "{conf_text}");
    ensure!(
        conf["plugins"][0]["agentSocket"] == agent.socket().display().to_string().as_str(),
        "{conf_text}"
    );
    let nets = podman.ok(["network", "ls", "--format", "{{.Name}}"])?;
    ensure!(
        nets.lines().any(|l| l == network),
        "podman does not see {network}: {nets}"
    );

    let netns_before = podman_netns();
    let names: Vec<String> = (1..=3).map(|i| format!("{network}-c{i}")).collect();
    let mut ids = Vec::new();
    for name in &names {
        ids.push(podman.run(&network, name)?);
    }
    let mut all = BTreeSet::new();
    let mut addrs = Vec::new();
    for (name, id) in names.iter().zip(&ids) {
        let seen: BTreeSet<IpAddr> = podman.addresses(name, &network)?.into_iter().collect();
        let held = held_by(&agent, id)?;
        ensure!(
            seen == held,
            "{name}: podman says {seen:?}, the agent holds {held:?}"
        );
        ensure!(seen.len() == 2, "{name}: one address per family: {seen:?}");
        for a in &seen {
            ensure!(
                v4_pool.contains(a) || v6_pool.contains(a),
                "{a} is outside the pool"
            );
            ensure!(all.insert(*a), "{a} given twice");
        }
        addrs.push(seen);
    }
    let v4 = |i: usize| addrs[i].iter().copied().find(IpAddr::is_ipv4);
    let v6 = |i: usize| addrs[i].iter().copied().find(IpAddr::is_ipv6);
    eprintln!("addresses: {addrs:?}");
    ensure!(
        lxc_links(Some(&node))?.len() == 3,
        "one host veth per container in the node namespace: {:?}",
        links(Some(&node))?
    );
    assert_root_untouched()?;
    verify(&agent)?;

    // Everyone reaches everyone, and the node, over IPv4; IPv6 too.
    let mut pings = Vec::new();
    for (i, from) in names.iter().enumerate() {
        for j in (0..names.len()).filter(|j| *j != i) {
            pings.push((from, v4(j).context("v4")?));
        }
        pings.push((from, "10.61.255.1".parse()?));
    }
    pings.push((&names[0], v6(1).context("v6")?));
    pings.push((&names[2], v6(0).context("v6")?));
    pings.push((&names[1], "fd00:61:ff::1".parse()?));
    for (from, to) in &pings {
        ping(&podman, from, *to, 3)?;
    }
    eprintln!(
        "{} pings of 3 packets each answered in full ({} packets)",
        pings.len(),
        pings.len() * 3
    );
    assert_root_untouched()?;

    // Removal gives everything back.
    let mut rm = vec!["rm", "-f", "-t", "0"];
    rm.extend(names.iter().map(String::as_str));
    podman.ok(rm)?;
    wait_released(&agent, &node)?;
    for id in &ids {
        let held = held_by(&agent, id)?;
        ensure!(held.is_empty(), "{id} still holds {held:?}");
    }
    ensure!(
        endpoint_allocations(&agent)?.is_empty(),
        "endpoint allocations left"
    );
    verify(&agent)?;
    let left = lxc_links(Some(&node))?;
    ensure!(
        left.is_empty(),
        "veths left in the node namespace: {left:?}"
    );
    let leaked: Vec<_> = podman_netns().difference(&netns_before).cloned().collect();
    ensure!(leaked.is_empty(), "container namespaces left: {leaked:?}");
    assert_root_untouched()?;

    // Uninstall: an operator edits the conflist; restarted with install off,
    // the agent removes the two unchanged binaries and keeps the edit.
    let edited = conf_text.replace("\"plugins\"", "\"plugins\" ");
    std::fs::write(&conflist, &edited)?;
    let config = std::fs::read_to_string(&agent.config)?;
    std::fs::write(
        &agent.config,
        config.replace("install = true", "install = false"),
    )?;
    agent.restart()?;
    for name in ["lockstep", "lockstep-ipam"] {
        let path = podman.bin_dir.join(name);
        ensure!(!path.exists(), "{} was not removed", path.display());
    }
    ensure!(
        std::fs::read_to_string(&conflist).context("the edited conflist was removed")? == edited,
        "the edited conflist changed"
    );
    Ok(())
}

/// With the agent down, `podman run` fails with the plugin's message naming
/// the socket, and leaves nothing behind; once the agent is back, it works.
#[test]
fn podman_run_without_the_agent_fails_clearly_and_leaves_nothing() -> anyhow::Result<()> {
    privileged!();
    let _serial = serial();
    let podman = Podman::new()?;
    let node = node_netns("10.63.255.1", "fd00:63:ff::1")?;
    let network = unique("lsnet");
    let mut agent = AgentProc::start(
        &node,
        &agent_toml(&podman, &network, "10.63.0.0/24", "fd00:63::/120"),
    )?;
    agent.stop()?.context("agent was running")?;

    let netns_before = podman_netns();
    let name = format!("{network}-down");
    let out = podman.try_run(&network, &name)?;
    let stderr = text(&out.stderr);
    eprintln!("podman run with the agent down:\n{stderr}");
    ensure!(
        !out.status.success(),
        "podman run succeeded without the agent"
    );
    let socket = agent.socket().display().to_string();
    ensure!(
        stderr.contains(&socket),
        "stderr does not name the socket {socket}:\n{stderr}"
    );
    ensure!(
        stderr.contains("is it running?"),
        "stderr lacks the plugin's hint:\n{stderr}"
    );
    // Nothing behind: no veth, no namespace, no running container.
    ensure!(
        lxc_links(Some(&node))?.is_empty(),
        "veth left: {:?}",
        links(Some(&node))?
    );
    assert_root_untouched()?;
    let leaked: Vec<_> = podman_netns().difference(&netns_before).cloned().collect();
    ensure!(leaked.is_empty(), "container namespaces left: {leaked:?}");
    let running = podman.ok(["ps", "--format", "{{.Names}}"])?;
    ensure!(running.trim().is_empty(), "running: {running}");
    // A container podman could not start may stay in its store ("created");
    // remove it so the name can be used again.
    if podman.names()?.contains(&name) {
        podman.ok(["rm", "-f", "-t", "0", &name])?;
    }

    agent.restart()?;
    ensure!(
        endpoint_allocations(&agent)?.is_empty(),
        "the failed run left an allocation"
    );
    verify(&agent)?;
    let id = podman.run(&network, &name)?;
    let addrs = podman.addresses(&name, &network)?;
    ensure!(
        held_by(&agent, &id)? == addrs.iter().copied().collect(),
        "{addrs:?}"
    );
    ping(&podman, &name, "10.63.255.1".parse()?, 3)?;
    podman.ok(["rm", "-f", "-t", "0", &name])?;
    wait_released(&agent, &node)?;
    Ok(())
}

/// The plugin and conflist put in place by the test itself (symlinks to the
/// binary under test), for an agent run without `[cni] install`.
fn install_by_hand(podman: &Podman, network: &str, socket: &std::path::Path) -> anyhow::Result<()> {
    for name in ["lockstep", "lockstep-ipam"] {
        std::os::unix::fs::symlink(lockstep_bin(), podman.bin_dir.join(name))?;
    }
    let conflist = serde_json::json!({
        "cniVersion": "1.0.0",
        "name": network,
        "plugins": [{"type": "lockstep", "agentSocket": socket.display().to_string()}],
    });
    std::fs::write(
        podman.net_dir.join(format!("{network}.conflist")),
        conflist.to_string(),
    )?;
    Ok(())
}

/// A container's ping to another (every 50 ms) loses nothing while the agent
/// is killed with SIGKILL and restarted three times.
///
/// The ping's replies are counted as they arrive: the restarts begin after
/// replies flow, each waits for fresh replies, and the count ends with
/// replies after the last restart; every sequence number up to the last
/// reply must have been answered. No window has to fit the restarts.
///
/// This agent does not install the plugin itself: `[cni] install` rewrites
/// both plugin binaries on every start before the agent restores (2 x 168 MB
/// for a debug build, 5-8 s here), which would push the restarts past the
/// end of the ping.
#[test]
fn agent_restarts_lose_no_packet_between_running_containers() -> anyhow::Result<()> {
    privileged!();
    let _serial = serial();
    let podman = Podman::new()?;
    let node = node_netns("10.64.255.1", "fd00:64:ff::1")?;
    let network = unique("lsnet");
    let mut agent = AgentProc::start(
        &node,
        &format!(
            r#"
{NO_RECONCILE}
[[pools]]
name = "pods"
ipv4 = ["10.64.0.0/24"]
ipv6 = ["fd00:64::/120"]
"#
        ),
    )?;
    install_by_hand(&podman, &network, &agent.socket())?;
    let c1 = format!("{network}-c1");
    let c2 = format!("{network}-c2");
    let id1 = podman.run(&network, &c1)?;
    let id2 = podman.run(&network, &c2)?;
    let to = podman
        .addresses(&c2, &network)?
        .into_iter()
        .find(IpAddr::is_ipv4)
        .context("c2 has no IPv4 address")?;
    let before = endpoint_allocations(&agent)?;
    ensure!(before.len() == 4, "two addresses per container: {before:?}");
    verify(&agent)?;
    // Warm up (neighbour entries) outside the measurement.
    ping(&podman, &c1, to, 1)?;

    // A ping every 50 ms; -w only bounds a test gone wrong.
    let mut cmd = podman.command();
    cmd.args(["exec", &c1, "ping", "-i", "0.05", "-w", "300"])
        .arg(to.to_string());
    let pinger = SeqPing::spawn(cmd, format!("{c1} -> {to}"))?;
    pinger.wait_replies(10, Duration::from_secs(30))?;
    let mut restarts = Vec::new();
    for _ in 0..3 {
        restarts.push(agent.restart()?);
        // Packets flow again after each restart before the next one.
        pinger.wait_replies(10, Duration::from_secs(30))?;
    }
    let tally = pinger.stop()?;
    eprintln!(
        "restarts (kill -9 to ready) took {restarts:?}; ping {c1} -> {to}: {} replies, \
         up to seq {}, missing {:?}",
        tally.received, tally.last, tally.missing
    );
    ensure!(
        tally.missing.is_empty(),
        "packets lost across {} agent restarts: no reply to seq {:?} (of 0..={})",
        restarts.len(),
        tally.missing,
        tally.last
    );
    // The agent came back with the same endpoints, found the maps it left
    // right (nothing to re-program), and everything matches.
    let status = agent.json(["status", "-o", "json"])?;
    ensure!(status["restored"]["added"] == 0, "{status}");
    ensure!(
        endpoint_allocations(&agent)? == before,
        "allocations changed"
    );
    verify(&agent)?;
    assert_root_untouched()?;
    podman.ok(["rm", "-f", "-t", "0", &c1, &c2])?;
    wait_released(&agent, &node)?;
    ensure!(held_by(&agent, &id1)?.is_empty() && held_by(&agent, &id2)?.is_empty());
    Ok(())
}

/// Waits until the agent holds no endpoint address and no agent veth is
/// left in `node`: a full DEL answers before its veth is gone, and the
/// addresses wait for it (docs/teardown.md).
fn wait_released(agent: &AgentProc, node: &Netns) -> anyhow::Result<()> {
    lockstep_tests::wait_for(
        "every endpoint address released and every veth gone",
        Duration::from_secs(15),
        || {
            (endpoint_allocations(agent).ok()?.is_empty() && lxc_links(Some(node)).ok()?.is_empty())
                .then_some(())
        },
    )
}

/// Runs a CNI plugin from inside `node`, as a runtime would.
fn cni_exec(
    node: &Netns,
    plugin: &str,
    command: &str,
    container: &Netns,
    container_id: &str,
    cni_path: &str,
    config: &Value,
) -> anyhow::Result<Output> {
    let mut child = node
        .command(plugin)
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", container_id)
        .env("CNI_NETNS", container.path())
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", cni_path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    child
        .stdin
        .take()
        .context("stdin")?
        .write_all(config.to_string().as_bytes())?;
    Ok(child.wait_with_output()?)
}

fn ping_ns(from: &Netns, to: &str) -> anyhow::Result<()> {
    let out = from
        .command("ping")
        .args(["-c", "3", "-i", "0.2", "-W", "2", to])
        .output()?;
    let stdout = text(&out.stdout);
    ensure!(
        out.status.success() && stdout.contains("3 packets transmitted, 3 received"),
        "ping {} -> {to} failed:\n{stdout}{}",
        from.name(),
        text(&out.stderr)
    );
    Ok(())
}

/// The reference `bridge` plugin with `lockstep-ipam`: each container gets a
/// pool address with the pool's prefix and the reserved gateway, they reach
/// each other and the gateway through the bridge, CHECK passes and DEL frees
/// the addresses.
///
/// The plugins run from inside the node namespace, not under podman: the
/// bridge plugin makes its bridge in the namespace it runs in, and podman
/// runs plugins in the machine's root namespace.
#[test]
fn bridge_with_lockstep_ipam_allocates_connects_checks_and_frees() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("node")?;
    let cni = TempDir::new("cni-bridge")?;
    let bin_dir = cni.path().join("bin");
    let mut agent = AgentProc::start(
        &node,
        &format!(
            r#"
{NO_RECONCILE}
[[pools]]
name = "bridged"
ipv4 = ["10.62.0.0/24"]
ipv6 = ["fd00:62::/120"]
reserved = ["10.62.0.1", "fd00:62::1"]

[cni]
install = true
bin_dir = "{bin}"
conf_dir = "{conf}"
"#,
            bin = bin_dir.display(),
            conf = cni.path().join("net.d").display(),
        ),
    )?;
    let ipam = bin_dir.join("lockstep-ipam");
    ensure!(ipam.exists(), "{} not installed", ipam.display());
    let bridge = unique("lsb");
    let config = serde_json::json!({
        "cniVersion": "1.0.0",
        "name": unique("lsbridged"),
        "type": "bridge",
        "bridge": bridge,
        "isGateway": true,
        "ipMasq": false,
        "ipam": {
            "type": "lockstep-ipam",
            "agentSocket": agent.socket().display().to_string(),
            "pool": "bridged",
        },
    });
    let cni_path = format!("{}:/usr/lib/cni", bin_dir.display());
    let v4_pool = Cidr::parse("10.62.0.0/24")?;
    let v6_pool = Cidr::parse("fd00:62::/120")?;

    let ctrs = [Netns::new("ctr")?, Netns::new("ctr")?];
    let ids = [unique("bridged-a"), unique("bridged-b")];
    let mut results = Vec::new();
    for (ns, id) in ctrs.iter().zip(&ids) {
        let out = cni_exec(
            &node,
            "/usr/lib/cni/bridge",
            "ADD",
            ns,
            id,
            &cni_path,
            &config,
        )?;
        let result: Value = serde_json::from_str(&ok("bridge ADD", out)?)?;
        results.push(result);
    }
    eprintln!("results: {results:#?}");
    let mut all = BTreeSet::new();
    let mut v4s = Vec::new();
    let mut v6s = Vec::new();
    for (result, id) in results.iter().zip(&ids) {
        let mut got = BTreeSet::new();
        for ip in result["ips"].as_array().context("ips")? {
            let net = Cidr::parse(ip["address"].as_str().context("address")?)?;
            let gw: IpAddr = ip["gateway"].as_str().context("gateway")?.parse()?;
            if net.addr.is_ipv4() {
                ensure!(net.len == 24 && v4_pool.contains(&net.addr), "{net:?}");
                ensure!(gw == "10.62.0.1".parse::<IpAddr>()?, "{gw}");
                v4s.push(net.addr);
            } else {
                ensure!(net.len == 120 && v6_pool.contains(&net.addr), "{net:?}");
                ensure!(gw == "fd00:62::1".parse::<IpAddr>()?, "{gw}");
                v6s.push(net.addr);
            }
            ensure!(all.insert(net.addr), "{net:?} given twice");
            got.insert(net.addr);
        }
        ensure!(
            got == held_by(&agent, id)?,
            "result and agent disagree for {id}"
        );
    }
    ensure!(v4s.len() == 2 && v6s.len() == 2, "{all:?}");
    verify(&agent)?;

    // The bridge is in the node namespace, holding the gateways; the root
    // namespace has no trace of it.
    let br = node.ip(["-j", "addr", "show", "dev", &bridge])?;
    ensure!(
        br.contains("\"10.62.0.1\"") && br.contains("\"fd00:62::1\""),
        "{br}"
    );
    ensure!(
        !links(None)?.contains(&bridge),
        "bridge {bridge} in the root namespace"
    );

    ping_ns(&ctrs[0], &v4s[1].to_string())?;
    ping_ns(&ctrs[1], &v4s[0].to_string())?;
    ping_ns(&ctrs[0], "10.62.0.1")?;
    ping_ns(&ctrs[1], &v6s[0].to_string())?;
    ping_ns(&ctrs[0], "fd00:62::1")?;

    // CHECK, with the ADD result as prevResult.
    for ((ns, id), result) in ctrs.iter().zip(&ids).zip(&results) {
        let mut with_prev = config.clone();
        with_prev["prevResult"] = result.clone();
        let out = cni_exec(
            &node,
            "/usr/lib/cni/bridge",
            "CHECK",
            ns,
            id,
            &cni_path,
            &with_prev,
        )?;
        ok("bridge CHECK", out)?;
    }

    // DEL frees the addresses and the veths; a second DEL is fine too.
    for round in 0..2 {
        for ((ns, id), result) in ctrs.iter().zip(&ids).zip(&results) {
            let mut with_prev = config.clone();
            with_prev["prevResult"] = result.clone();
            let out = cni_exec(
                &node,
                "/usr/lib/cni/bridge",
                "DEL",
                ns,
                id,
                &cni_path,
                &with_prev,
            )?;
            ok(&format!("bridge DEL (round {round})"), out)?;
            ensure!(
                held_by(&agent, id)?.is_empty(),
                "{id} still holds addresses"
            );
        }
    }
    let ports = node.ip(["-j", "link", "show", "master", &bridge])?;
    let ports: Value = serde_json::from_str(if ports.trim().is_empty() {
        "[]"
    } else {
        &ports
    })?;
    ensure!(
        ports.as_array().is_none_or(Vec::is_empty),
        "veths left on the bridge: {ports}"
    );
    ensure!(endpoint_allocations(&agent)?.is_empty());
    verify(&agent)?;
    agent.stop()?;
    Ok(())
}
