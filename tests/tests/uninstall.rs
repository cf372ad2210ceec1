//! `lockstep uninstall` leaves a node whose next CNI serves its pods.
//!
//! - A node of a real 3-member etcd cluster (native routing, so its agent
//!   programs routes of protocol 213 to the other nodes' blocks) installs
//!   its plugin and conflist into the node's CNI directories, which also
//!   hold another CNI's conflist (the reference `bridge` + `host-local`)
//!   that sorts after lockstep's. A pod added as a runtime does it (the
//!   first conflist of the directory, every plugin of its list in turn, as
//!   containerd picks a network, run through `cni_chain`) gets a lockstep
//!   address.
//!   `lockstep uninstall` refuses while the agent answers; once it is
//!   stopped it removes the conflist, the plugin binaries, every pin and
//!   every route of protocol 213, and leaves the other conflist alone. The
//!   next pod added the same way gets the bridge network's address and
//!   reaches the node through it.
//! - The tunnel device a tunnel-mode agent made is removed too, by
//!   `uninstall --wait` as the cleanup DaemonSet runs it: it then waits,
//!   and SIGTERM ends it cleanly.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{Context, ensure};
use lockstep_tests::cluster::ClusterNodes;
use lockstep_tests::cni_chain::Chain;
use lockstep_tests::etcd::EtcdCluster;
use lockstep_tests::{AgentProc, Netns, TempDir, lockstep_bin, lockstep_output, privileged};
use serde_json::{Value, json};

/// The reference plugins, as Debian's containernetworking-plugins installs
/// them.
const REFERENCE_PLUGINS: &str = "/usr/lib/cni";

/// Another CNI's network: a bridge in the node, host-local addresses.
const BRIDGE_CONFLIST: &str = r#"{
  "cniVersion": "1.0.0",
  "name": "next",
  "plugins": [
    {"type": "bridge", "bridge": "nextbr0", "isGateway": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.77.0.0/24"}]],
              "dataDir": "DATA_DIR"}}
  ]
}"#;

/// The first conflist of `conf_dir` in lexical order, as containerd's CRI
/// plugin picks the pod network.
fn first_conflist(conf_dir: &Path) -> anyhow::Result<PathBuf> {
    let mut names: Vec<PathBuf> = std::fs::read_dir(conf_dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.extension()
                .is_some_and(|e| e == "conflist" || e == "conf" || e == "json")
        })
        .collect();
    names.sort();
    names.into_iter().next().context("no CNI config left")
}

/// ADD of `pod` through the node's first conflist as a runtime on `node`
/// runs it: its network's name and the final result.
fn add_through_first_conflist(
    node: &Netns,
    conf_dir: &Path,
    bin_dir: &Path,
    id: &str,
    pod: &Netns,
) -> anyhow::Result<(String, Value)> {
    let chain = Chain::from_file(
        &first_conflist(conf_dir)?,
        bin_dir,
        id,
        &pod.path(),
        json!({}),
    )?;
    let result = chain.add(node)?;
    Ok((
        chain.conflist["name"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
        result,
    ))
}

fn first_ip(result: &Value) -> anyhow::Result<String> {
    let addr = result["ips"][0]["address"]
        .as_str()
        .with_context(|| format!("no address in {result}"))?;
    Ok(addr.split('/').next().unwrap_or(addr).to_string())
}

fn routes_of_213(ns: &Netns) -> anyhow::Result<Vec<String>> {
    let mut out = Vec::new();
    for family in ["-4", "-6"] {
        out.extend(
            ns.ip([family, "route", "show", "proto", "213"])?
                .lines()
                .map(str::to_string),
        );
    }
    Ok(out)
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

fn uninstall(ns: &Netns, agent: &AgentProc) -> anyhow::Result<std::process::Output> {
    lockstep_output(
        ns,
        [
            "uninstall".as_ref(),
            "--config".as_ref(),
            agent.config.as_os_str(),
        ],
    )
}

#[test]
fn uninstall_leaves_a_node_whose_next_cni_works() -> anyhow::Result<()> {
    privileged!();
    let etcd = EtcdCluster::start(3)?;
    let pools = "[[pools]]\nname = \"pods\"\nipv4 = [\"10.98.0.0/16\"]\nblock_v4 = 28\n";
    let mut nodes = ClusterNodes::build(&etcd, "/uninstall/", pools)?;
    // Node 0's agent installs into CNI directories of its own, which
    // already hold the next network's conflist.
    let dirs = TempDir::new("uninstall-cni")?;
    let (bin_dir, conf_dir) = (dirs.path().join("bin"), dirs.path().join("net.d"));
    std::fs::create_dir_all(&conf_dir)?;
    // The runtime's plugin directory holds the next network's plugins too,
    // as a node's /opt/cni/bin does.
    std::fs::create_dir_all(&bin_dir)?;
    for plugin in ["bridge", "host-local"] {
        std::fs::copy(
            Path::new(REFERENCE_PLUGINS).join(plugin),
            bin_dir.join(plugin),
        )?;
    }
    std::fs::write(
        conf_dir.join("10-next.conflist"),
        BRIDGE_CONFLIST.replace("DATA_DIR", &dirs.path().join("ipam").display().to_string()),
    )?;
    let cni_section = format!(
        "\n[cni]\ninstall = true\nbin_dir = \"{}\"\nconf_dir = \"{}\"\n",
        bin_dir.display(),
        conf_dir.display()
    );
    nodes.agents[0].rewrite_config(|c| format!("{c}{cni_section}"))?;
    nodes.agents[0].restart()?;
    nodes.wait_remote()?;
    let node = &nodes.ns[0];
    ensure!(
        entries(&conf_dir) == ["05-lockstep.conflist", "10-next.conflist"],
        "installed: {:?}",
        entries(&conf_dir)
    );

    // A pod before: lockstep's network.
    let pod = Netns::new("unpod")?;
    let (network, result) = add_through_first_conflist(node, &conf_dir, &bin_dir, "before", &pod)?;
    ensure!(network == "lockstep", "the first network was {network}");
    let ip = first_ip(&result)?;
    ensure!(ip.starts_with("10.98."), "lockstep gave {ip}");
    let routes = routes_of_213(node)?;
    ensure!(
        !routes.is_empty(),
        "no route of protocol 213 to the other nodes' blocks"
    );
    ensure!(!entries(nodes.agents[0].pins.path()).is_empty(), "no pins");

    // Refused while the agent answers; nothing removed.
    let refused = uninstall(node, &nodes.agents[0])?;
    ensure!(
        !refused.status.success(),
        "uninstall ran under a live agent"
    );
    let said = String::from_utf8_lossy(&refused.stderr);
    ensure!(said.contains("the agent is running"), "{said}");
    ensure!(
        entries(&conf_dir).len() == 2,
        "a refused uninstall removed files"
    );

    nodes.agents[0].stop()?;
    let out = uninstall(node, &nodes.agents[0])?;
    let said = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "uninstall: {said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{said}");
    ensure!(
        entries(&conf_dir) == ["10-next.conflist"],
        "left in net.d: {:?}",
        entries(&conf_dir)
    );
    ensure!(
        entries(&bin_dir) == ["bridge", "host-local"],
        "left in bin: {:?}",
        entries(&bin_dir)
    );
    let pins = entries(nodes.agents[0].pins.path());
    ensure!(pins.is_empty(), "pins left: {pins:?}");
    let routes = routes_of_213(node)?;
    ensure!(routes.is_empty(), "routes of protocol 213 left: {routes:?}");
    ensure!(
        said.contains(&format!(
            "removed {}",
            conf_dir.join("05-lockstep.conflist").display()
        )),
        "{said}"
    );

    // A pod after: the next network's, and it reaches the node.
    let next = Netns::new("unpod")?;
    let (network, result) = add_through_first_conflist(node, &conf_dir, &bin_dir, "after", &next)?;
    ensure!(network == "next", "the first network was {network}");
    let ip = first_ip(&result)?;
    ensure!(ip.starts_with("10.77.0."), "the next network gave {ip}");
    next.exec("ping", ["-c", "1", "-W", "2", "10.77.0.1"])?;
    let json_out = lockstep_output(
        node,
        [
            "uninstall".as_ref(),
            "--config".as_ref(),
            nodes.agents[0].config.as_os_str(),
            "-o".as_ref(),
            "json".as_ref(),
        ],
    )?;
    let again: Value = serde_json::from_slice(&json_out.stdout)?;
    ensure!(
        again["pins"] == json!(0) && again["routes"] == json!(0),
        "a second uninstall found more: {again}"
    );
    // The bridge the next network made goes with the node's namespace;
    // its addresses' record with the TempDir.
    Ok(())
}

#[test]
fn uninstall_removes_the_tunnel_device() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("untun")?;
    node.ip(["link", "add", "u0", "type", "veth", "peer", "name", "u1"])?;
    node.ip(["link", "set", "u1", "up"])?;
    node.ip(["addr", "add", "10.253.0.1/24", "dev", "u0"])?;
    node.ip(["link", "set", "u0", "up"])?;
    // No etcd is needed: the device is made before the agent reaches it.
    let mut agent = AgentProc::start(
        &node,
        "pools = []\n[cluster]\netcd = [\"http://127.0.0.1:9\"]\nnode_name = \"t\"\nnode_ip_v4 = \"10.253.0.1\"\nrouting = \"tunnel\"\n",
    )?;
    ensure!(
        node.ip(["link", "show", "lockstep_vxlan"]).is_ok(),
        "the agent made no tunnel device"
    );
    agent.stop()?;
    // As the cleanup DaemonSet's pod runs it: done, then waiting to be
    // deleted (SIGTERM), so the pod stays running.
    let mut child = node
        .command(lockstep_bin())
        .args(["uninstall", "--wait", "--config"])
        .arg(&agent.config)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while node.ip(["link", "show", "lockstep_vxlan"]).is_ok() {
        ensure!(std::time::Instant::now() < deadline, "the device stayed");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    std::thread::sleep(std::time::Duration::from_millis(300));
    ensure!(child.try_wait()?.is_none(), "uninstall --wait did not wait");
    // SAFETY: a plain signal to the child this test started.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let out = child.wait_with_output()?;
    ensure!(
        out.status.success(),
        "uninstall: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let said = String::from_utf8_lossy(&out.stdout);
    ensure!(said.contains("removed device lockstep_vxlan"), "{said}");
    ensure!(
        node.ip(["link", "show", "lockstep_vxlan"]).is_err(),
        "the tunnel device is still there"
    );
    ensure!(entries(agent.pins.path()).is_empty(), "pins left");
    Ok(())
}
