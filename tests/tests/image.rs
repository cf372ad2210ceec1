//! The image as the DaemonSet runs it, with podman as the kubelet.
//!
//! `cargo xtask test` stages the image's build context (the static agent and
//! plugin as they ship, bpftool, `deploy/Containerfile`) and names it in
//! `LOCKSTEP_IMAGE_CONTEXT`. Each test builds its own images from it with
//! `podman build`, in a private podman storage (removed afterwards), the
//! agent's version stamped per image as `cargo xtask image --version` does.
//!
//! The agent container runs the way the DaemonSet `lockstep manifests`
//! renders runs the pod: not privileged, every capability dropped and
//! exactly the ones the manifest adds added back (read from the rendered
//! DaemonSet, so the two cannot differ), no privilege escalation, the
//! runtime's default seccomp profile, read-only root, in the node's network namespace (here a
//! namespace the test creates, as the pod's host network), with bpffs, the
//! CNI bin and conf directories, the state and run directories and
//! `/run/netns` (slave propagation, as `HostToContainer`) bind-mounted at
//! the same paths as on the "node" (the plugin runs there and reaches the
//! socket by the path in the conflist), and its config file mounted
//! read-only at `/etc/lockstep` as the ConfigMap. The agent installs its
//! plugin and conflist into the mounted directories; busybox containers (the
//! "pods") get their addresses through it.

use std::ffi::OsStr;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use lockstep_tests::podman::{Podman, ok};
use lockstep_tests::seqping::SeqPing;
use lockstep_tests::{Netns, PinRoot, TempDir, lockstep_bin, privileged, sh, unique, veth};
use serde_json::Value;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The staged build context (`cargo xtask test` sets the variable).
fn context() -> anyhow::Result<PathBuf> {
    let dir = std::env::var_os("LOCKSTEP_IMAGE_CONTEXT")
        .map(PathBuf::from)
        .context(
            "LOCKSTEP_IMAGE_CONTEXT is not set: run the image tests through `cargo xtask test` \
         (or `cargo xtask bench image`), which stages the image's build context",
        )?;
    ensure!(
        dir.join("Containerfile").exists(),
        "{} holds no Containerfile",
        dir.display()
    );
    Ok(dir)
}

/// The capabilities the DaemonSet of `lockstep manifests` adds (mode
/// local, the pod IPAM the test exercises).
fn manifest_capabilities() -> anyhow::Result<Vec<String>> {
    let out = std::process::Command::new(lockstep_bin())
        .args(["manifests", "--mode", "local", "--pool", "10.244.0.0/24"])
        .output()?;
    ensure!(
        out.status.success(),
        "lockstep manifests: {}",
        text(&out.stderr)
    );
    let docs: Vec<Value> =
        serde_saphyr::from_multiple(&text(&out.stdout)).map_err(|e| anyhow::anyhow!("{e}"))?;
    let ds = docs
        .iter()
        .find(|d| d["kind"] == "DaemonSet")
        .context("no DaemonSet rendered")?;
    let sc = &ds["spec"]["template"]["spec"]["containers"][0]["securityContext"];
    ensure!(sc["privileged"] == false, "the DaemonSet is privileged");
    ensure!(
        sc["capabilities"]["drop"] == serde_json::json!(["ALL"]),
        "{sc}"
    );
    sc["capabilities"]["add"]
        .as_array()
        .context("no capabilities added")?
        .iter()
        .map(|c| c.as_str().map(str::to_string).context("a capability"))
        .collect()
}

fn copy_tree(from: &Path, to: &Path) -> anyhow::Result<()> {
    sh("cp", [OsStr::new("-a"), from.as_os_str(), to.as_os_str()])?;
    Ok(())
}

/// Builds `localhost/lockstep:<version>` from the staged context with the
/// agent stamped as `version`; returns the tag and the image size in bytes.
fn build_image(podman: &Podman, scratch: &Path, version: &str) -> anyhow::Result<(String, u64)> {
    let ctx = scratch.join(format!("context-{version}"));
    copy_tree(&context()?, &ctx)?;
    let agent = ctx.join("rootfs/usr/local/bin/lockstep");
    let mut binary = std::fs::read(&agent)?;
    lockstep::version::stamp(&mut binary, version)?;
    std::fs::write(&agent, binary)?;
    let tag = format!("localhost/lockstep:{version}");
    let size = podman.build(&ctx, &tag)?;
    std::fs::remove_dir_all(&ctx)?;
    Ok((tag, size))
}

/// The node, its paths, and the config the "ConfigMap" holds.
struct Node {
    ns: Netns,
    _neighbour: Netns,
    pins: PinRoot,
    dir: TempDir,
    network: String,
}

impl Node {
    /// A node namespace (an address of each family on `lo`, forwarding on)
    /// with an uplink veth `up0` to a neighbour namespace, a pin root, state,
    /// run and config directories, and the config file.
    fn new(podman: &Podman, v4_node: &str, pool_v4: &str, pool_v6: &str) -> anyhow::Result<Self> {
        let ns = Netns::new("node")?;
        ns.ip(["addr", "add", &format!("{v4_node}/32"), "dev", "lo"])?;
        ns.sysctl("net.ipv4.ip_forward", "1")?;
        ns.sysctl("net.ipv6.conf.all.forwarding", "1")?;
        let neighbour = Netns::new("nb")?;
        veth(&ns, "up0", &neighbour, "n0")?;
        let dir = TempDir::new("image")?;
        for d in ["state", "run", "config"] {
            std::fs::create_dir_all(dir.path().join(d))?;
        }
        let node = Self {
            ns,
            _neighbour: neighbour,
            pins: PinRoot::new(),
            dir,
            network: unique("lsimg"),
        };
        let config = format!(
            r#"node_name = "image-node"
state_dir = "{state}"
socket = "{socket}"
metrics_addr = "127.0.0.1:9476"
reconcile_interval = "10s"

[datapath]
pin_root = "{pins}"
uplink = "up0"

[cni]
install = true
bin_dir = "{bin}"
conf_dir = "{conf}"
conflist_name = "{net}.conflist"
network_name = "{net}"
cni_version = "1.0.0"

[[pools]]
name = "pods"
ipv4 = ["{pool_v4}"]
ipv6 = ["{pool_v6}"]
"#,
            state = node.path("state").display(),
            socket = node.socket().display(),
            pins = node.pins.path().display(),
            bin = podman.bin_dir.display(),
            conf = podman.net_dir.display(),
            net = node.network,
        );
        std::fs::write(node.path("config").join("config.toml"), config)?;
        Ok(node)
    }

    fn path(&self, what: &str) -> PathBuf {
        self.dir.path().join(what)
    }

    fn socket(&self) -> PathBuf {
        self.path("run").join("lockstep.sock")
    }

    /// Status through the socket from the node side (no `podman exec`, so
    /// start-to-ready is timed without its overhead); `None` while no agent
    /// answers.
    fn status(&self) -> Option<Value> {
        let out = std::process::Command::new(lockstep_bin())
            .arg("--socket")
            .arg(self.socket())
            .args(["status", "-o", "json"])
            .output()
            .ok()?;
        serde_json::from_slice(&out.stdout).ok()
    }
}

/// A running agent container ("the DaemonSet's pod"), removed on drop.
struct AgentContainer<'a> {
    podman: &'a Podman,
    name: String,
}

impl<'a> AgentContainer<'a> {
    /// `podman run` of `tag` as the DaemonSet's pod spec runs it.
    fn run(podman: &'a Podman, node: &Node, tag: &str) -> anyhow::Result<Self> {
        let name = unique("lockstep-agent");
        let same = |p: &Path| format!("{0}:{0}", p.display());
        let mut args: Vec<String> = vec![
            "run".into(),
            "-d".into(),
            "--name".into(),
            name.clone(),
            "--cap-drop=ALL".into(),
        ];
        args.extend(
            manifest_capabilities()?
                .iter()
                .map(|c| format!("--cap-add=CAP_{c}")),
        );
        args.extend::<[String; _]>([
            "--security-opt".into(),
            "no-new-privileges".into(),
            "--read-only".into(),
            format!("--network=ns:{}", node.ns.path().display()),
            "--ulimit".into(),
            "nofile=1024:1024".into(),
            "--ulimit".into(),
            "nproc=1024:1024".into(),
            // The ConfigMap.
            "-v".into(),
            format!("{}:/etc/lockstep:ro", node.path("config").display()),
            // hostPath volumes, at the node's own paths.
            "-v".into(),
            same(&node.path("state")),
            "-v".into(),
            same(&node.path("run")),
            "-v".into(),
            "/sys/fs/bpf:/sys/fs/bpf:rslave".into(),
            "-v".into(),
            same(&podman.bin_dir),
            "-v".into(),
            same(&podman.net_dir),
            "-v".into(),
            "/run/netns:/run/netns:rslave".into(),
            tag.into(),
            "agent".into(),
            "--config".into(),
            "/etc/lockstep/config.toml".into(),
            "--log-json".into(),
        ]);
        ok("podman run (agent)", podman.output(&args)?)?;
        Ok(Self { podman, name })
    }

    /// `lockstep <args>` inside the container.
    fn lockstep(&self, args: &[&str]) -> anyhow::Result<Output> {
        let mut all = vec!["lockstep"];
        all.extend_from_slice(args);
        self.podman.exec(&self.name, &all)
    }

    fn logs(&self) -> String {
        self.podman
            .output(["logs", &self.name])
            .map(|o| text(&o.stdout) + &text(&o.stderr))
            .unwrap_or_default()
    }

    /// Waits until the agent reports ready; returns its status.
    fn wait_ready(&self, node: &Node) -> anyhow::Result<Value> {
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(60) {
            if let Some(status) = node.status()
                && status["ready"] == true
            {
                return Ok(status);
            }
            let state = self
                .podman
                .ok(["inspect", "--format", "{{.State.Status}}", &self.name])?;
            if state.trim() == "exited" {
                bail!("the agent container exited:\n{}", self.logs());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        bail!("the agent was not ready within 60 s:\n{}", self.logs())
    }

    /// `podman stop` (SIGTERM, as the kubelet stops a pod) and removal;
    /// returns the agent's log.
    fn stop(self) -> anyhow::Result<String> {
        ok(
            "podman stop",
            self.podman.output(["stop", "-t", "30", &self.name])?,
        )?;
        let state = self
            .podman
            .ok(["inspect", "--format", "{{.State.ExitCode}}", &self.name])?;
        let logs = self.logs();
        ensure!(
            state.trim() == "0",
            "the agent exited with {} on SIGTERM:\n{logs}",
            state.trim()
        );
        Ok(logs)
    }
}

impl Drop for AgentContainer<'_> {
    fn drop(&mut self) {
        let _ = self.podman.output(["rm", "-f", "-t", "5", &self.name]);
    }
}

/// IDs of every pinned map and link (with its program) under the pin root,
/// through bpftool on the node.
#[derive(Debug, PartialEq)]
struct Pins {
    maps: Vec<(String, u64)>,
    links: Vec<(String, u64, u64)>,
}

fn pins(root: &Path) -> anyhow::Result<Pins> {
    let mut maps = Vec::new();
    for entry in std::fs::read_dir(root.join("maps"))? {
        let path = entry?.path();
        let v: Value = serde_json::from_str(&sh(
            "bpftool",
            [
                OsStr::new("-j"),
                OsStr::new("map"),
                OsStr::new("show"),
                OsStr::new("pinned"),
                path.as_os_str(),
            ],
        )?)?;
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        maps.push((
            name.unwrap_or_default(),
            v["id"].as_u64().context("map id")?,
        ));
    }
    let mut links = Vec::new();
    for entry in std::fs::read_dir(root.join("links"))? {
        let path = entry?.path();
        let v: Value = serde_json::from_str(&sh(
            "bpftool",
            [
                OsStr::new("-j"),
                OsStr::new("link"),
                OsStr::new("show"),
                OsStr::new("pinned"),
                path.as_os_str(),
            ],
        )?)?;
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        links.push((
            name.unwrap_or_default(),
            v["id"].as_u64().context("link id")?,
            v["prog_id"].as_u64().context("prog id")?,
        ));
    }
    maps.sort();
    links.sort();
    Ok(Pins { maps, links })
}

fn address(podman: &Podman, name: &str, network: &str, v4: bool) -> anyhow::Result<IpAddr> {
    podman
        .addresses(name, network)?
        .into_iter()
        .find(|a| a.is_ipv4() == v4)
        .with_context(|| format!("{name} has no address of that family"))
}

/// Replaces the running agent container by one of `tag` while the pods ping
/// each other every 10 ms both ways; returns the new container, the packets
/// lost and how long the swap took (old stop to new ready).
///
/// Replies are counted as they arrive: the swap starts once replies flow
/// both ways and the count ends with 100 fresh replies each way after the
/// new agent is ready; every sequence number up to the last reply counts.
fn swap<'a>(
    podman: &'a Podman,
    node: &Node,
    old: AgentContainer<'a>,
    tag: &str,
    pods: (&str, &str),
    to: (IpAddr, IpAddr),
) -> anyhow::Result<(AgentContainer<'a>, u64, Duration)> {
    let ping = |from: &str, to: IpAddr| {
        let mut cmd = podman.command();
        // -w only bounds a test gone wrong.
        cmd.args(["exec", from, "ping", "-i", "0.01", "-W", "2", "-w", "300"])
            .arg(to.to_string());
        SeqPing::spawn(cmd, format!("{from} -> {to}"))
    };
    let forth = ping(pods.0, to.1)?;
    let back = ping(pods.1, to.0)?;
    for p in [&forth, &back] {
        p.wait_replies(50, Duration::from_secs(120))?;
    }
    let started = Instant::now();
    old.stop()?;
    let new = AgentContainer::run(podman, node, tag)?;
    new.wait_ready(node)?;
    let took = started.elapsed();
    for p in [&forth, &back] {
        p.wait_replies(100, Duration::from_secs(120))?;
    }
    let mut lost = 0;
    for (p, what) in [(forth, "forth"), (back, "back")] {
        let tally = p.stop()?;
        eprintln!(
            "ping {what}: {} replies up to seq {}, missing {:?}",
            tally.received, tally.last, tally.missing
        );
        lost += tally.missing.len() as u64;
    }
    Ok((new, lost, took))
}

fn status_in(agent: &AgentContainer, node: &Node) -> anyhow::Result<Value> {
    let out = agent.lockstep(&[
        "--socket",
        &node.socket().display().to_string(),
        "status",
        "-o",
        "json",
    ])?;
    Ok(serde_json::from_str(&ok(
        "lockstep status (in the image)",
        out,
    )?)?)
}

/// `lockstep verify`, `maps dump` and bpftool run inside the image and see
/// the pods' addresses.
fn inspect_in_image(agent: &AgentContainer, node: &Node, addrs: &[IpAddr]) -> anyhow::Result<()> {
    let socket = node.socket().display().to_string();
    let pin_root = node.pins.path().display().to_string();
    ok(
        "lockstep verify (in the image)",
        agent.lockstep(&["--socket", &socket, "verify"])?,
    )?;
    let dump = ok(
        "lockstep maps dump (in the image)",
        agent.lockstep(&["maps", "dump", "-o", "json", "--pin-root", &pin_root])?,
    )?;
    for a in addrs {
        ensure!(
            dump.contains(&a.to_string()),
            "maps dump lacks {a}:\n{dump}"
        );
    }
    let bpftool = ok(
        "bpftool (in the image)",
        agent.podman.exec(
            &agent.name,
            &[
                "bpftool",
                "-j",
                "map",
                "dump",
                "pinned",
                &format!("{pin_root}/maps/IPCACHE_HOST_V4"),
            ],
        )?,
    )?;
    let v4 = addrs
        .iter()
        .find_map(|a| match a {
            IpAddr::V4(v4) => Some(*v4),
            IpAddr::V6(_) => None,
        })
        .context("no IPv4 address")?;
    let key: Vec<Value> = v4.octets().iter().map(|o| Value::from(*o)).collect();
    let entries: Value = serde_json::from_str(&bpftool)?;
    ensure!(
        entries.as_array().is_some_and(|es| es
            .iter()
            .any(|e| e["formatted"]["key"] == Value::Array(key.clone()))),
        "bpftool in the image does not show {v4} in IPCACHE_HOST_V4:\n{bpftool}"
    );
    Ok(())
}

/// The program IDs of the `from_endpoint` filters on each host-side veth in
/// the node, by veth (restarts replace them in place, never stack a second).
fn endpoint_filters(node: &Node) -> anyhow::Result<Vec<(String, Vec<u64>)>> {
    let links: Value = serde_json::from_str(&node.ns.ip(["-j", "link"])?)?;
    let mut out = Vec::new();
    for l in links.as_array().into_iter().flatten() {
        let Some(name) = l["ifname"].as_str().filter(|n| n.starts_with("lxc")) else {
            continue;
        };
        let filters = node
            .ns
            .exec("tc", ["filter", "show", "dev", name, "ingress"])?;
        // "... handle 0x4c53 from_endpoint direct-action not_in_hw id 42 name ..."
        let ids = filters
            .lines()
            .filter(|l| l.contains("from_endpoint"))
            .filter_map(|l| {
                let words: Vec<&str> = l.split_whitespace().collect();
                words
                    .windows(2)
                    .find(|w| w[0] == "id")
                    .and_then(|w| w[1].parse().ok())
            })
            .collect();
        out.push((name.to_string(), ids));
    }
    out.sort();
    Ok(out)
}

/// The image runs as the DaemonSet's pod: it installs the plugin and
/// conflist, pods get addresses and reach each other and the node, and
/// `status`, `maps dump`, `verify` and bpftool work inside it. Then it is
/// upgraded to a second build (another version) and rolled back while the
/// pods ping each other every 10 ms both ways: no packet lost, every pinned
/// map and link reused (the links' programs replaced in place), and status
/// reports each version in turn.
#[test]
fn image_runs_as_the_daemonset_and_upgrades_and_rolls_back_without_loss() -> anyhow::Result<()> {
    privileged!();
    let _serial = serial();
    let podman = Podman::new()?;
    let scratch = TempDir::new("image-build")?;
    let base = env!("CARGO_PKG_VERSION");
    let tag = unique("t");
    let (old_version, new_version) = (format!("{base}-{tag}.a"), format!("{base}-{tag}.b"));
    let (old_image, old_size) = build_image(&podman, scratch.path(), &old_version)?;
    let (new_image, new_size) = build_image(&podman, scratch.path(), &new_version)?;
    eprintln!(
        "images: {old_image} {:.1} MB, {new_image} {:.1} MB",
        old_size as f64 / 1e6,
        new_size as f64 / 1e6
    );
    let node = Node::new(&podman, "10.66.255.1", "10.66.0.0/24", "fd00:66::/120")?;
    let network = node.network.clone();

    let agent = AgentContainer::run(&podman, &node, &old_image)?;
    agent.wait_ready(&node)?;
    let status = status_in(&agent, &node)?;
    ensure!(status["version"] == old_version.as_str(), "{status}");
    // `--version` says the same as `status` (#45 item 5), as
    // `kubectl exec` into the pod would run it.
    let out = agent.lockstep(&["--version"])?;
    let said = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success() && said.trim() == format!("lockstep {old_version}"),
        "lockstep --version in {old_image}: {said:?} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // `--log-json` lines carry their fields flat, beside the message.
    let logs = agent.logs();
    let line = logs
        .lines()
        .find(|l| l.contains("API listening"))
        .with_context(|| format!("no start line in the agent's log:\n{logs}"))?;
    let v: Value = serde_json::from_str(line).with_context(|| line.to_string())?;
    ensure!(
        v["message"].is_string() && v["socket"].is_string() && v.get("fields").is_none(),
        "a JSON log line with nested fields: {line}"
    );

    // What the agent installed is the plugin in the image.
    let plugin = std::fs::read(context()?.join("rootfs/usr/local/bin/lockstep-cni"))?;
    for name in ["lockstep", "lockstep-ipam"] {
        let path = podman.bin_dir.join(name);
        ensure!(
            std::fs::read(&path).with_context(|| format!("{} not installed", path.display()))?
                == plugin,
            "{} is not the image's lockstep-cni",
            path.display()
        );
    }
    let conflist: Value = serde_json::from_str(&std::fs::read_to_string(
        podman.net_dir.join(format!("{network}.conflist")),
    )?)?;
    ensure!(
        conflist["plugins"][0]["agentSocket"] == node.socket().display().to_string().as_str(),
        "{conflist}"
    );

    // Two pods.
    let pods = (format!("{network}-p1"), format!("{network}-p2"));
    podman.run(&network, &pods.0)?;
    podman.run(&network, &pods.1)?;
    let v4 = (
        address(&podman, &pods.0, &network, true)?,
        address(&podman, &pods.1, &network, true)?,
    );
    let v6 = (
        address(&podman, &pods.0, &network, false)?,
        address(&podman, &pods.1, &network, false)?,
    );
    eprintln!("pods: {} {v4:?} {v6:?}", network);
    for (from, to) in [
        (&pods.0, v4.1),
        (&pods.1, v4.0),
        (&pods.0, v6.1),
        (&pods.0, "10.66.255.1".parse()?),
        (&pods.1, "10.66.255.1".parse()?),
    ] {
        let out = podman.exec(
            from,
            &["ping", "-c", "3", "-i", "0.2", "-W", "2", &to.to_string()],
        )?;
        ensure!(
            out.status.success() && text(&out.stdout).contains("3 packets received"),
            "ping {from} -> {to}:\n{}{}",
            text(&out.stdout),
            text(&out.stderr)
        );
    }
    inspect_in_image(&agent, &node, &[v4.0, v4.1, v6.0, v6.1])?;
    let pins_before = pins(node.pins.path())?;
    let filters_before = endpoint_filters(&node)?;
    ensure!(
        filters_before.len() == 2 && filters_before.iter().all(|(_, ids)| ids.len() == 1),
        "one from_endpoint filter per pod veth: {filters_before:?}"
    );
    ensure!(
        pins_before.links.len() == 2,
        "to_native and from_native pinned on the uplink: {pins_before:?}"
    );

    // Upgrade.
    let (agent, lost_up, took_up) = swap(
        &podman,
        &node,
        agent,
        &new_image,
        (&pods.0, &pods.1),
        (v4.0, v4.1),
    )?;
    let status = status_in(&agent, &node)?;
    ensure!(status["version"] == new_version.as_str(), "{status}");
    ensure!(
        status["restored"]["added"] == 0,
        "nothing to re-program: {status}"
    );
    let pins_up = pins(node.pins.path())?;
    ensure!(
        pins_up.maps == pins_before.maps,
        "maps were not reused: {pins_before:?} -> {pins_up:?}"
    );
    for (before, after) in pins_before.links.iter().zip(&pins_up.links) {
        ensure!(
            before.0 == after.0 && before.1 == after.1 && before.2 != after.2,
            "link {} must stay (id {}) with a new program: {before:?} -> {after:?}",
            before.0,
            before.1
        );
    }
    let filters_up = endpoint_filters(&node)?;
    ensure!(
        filters_up.len() == 2
            && filters_up
                .iter()
                .zip(&filters_before)
                .all(|(after, before)| after.0 == before.0
                    && after.1.len() == 1
                    && after.1 != before.1),
        "each pod veth keeps one from_endpoint filter, now the new program: \
         {filters_before:?} -> {filters_up:?}"
    );
    inspect_in_image(&agent, &node, &[v4.0, v4.1, v6.0, v6.1])?;

    // Rollback.
    let (agent, lost_back, took_back) = swap(
        &podman,
        &node,
        agent,
        &old_image,
        (&pods.0, &pods.1),
        (v4.0, v4.1),
    )?;
    let status = status_in(&agent, &node)?;
    ensure!(status["version"] == old_version.as_str(), "{status}");
    let pins_back = pins(node.pins.path())?;
    ensure!(
        pins_back.maps == pins_before.maps,
        "maps were not reused on rollback"
    );
    ensure!(
        pins_back
            .links
            .iter()
            .map(|l| l.1)
            .eq(pins_before.links.iter().map(|l| l.1)),
        "links were not reused on rollback"
    );
    let filters = endpoint_filters(&node)?;
    ensure!(
        filters.len() == 2 && filters.iter().all(|(_, ids)| ids.len() == 1),
        "one from_endpoint filter per pod veth after two replacements: {filters:?}"
    );
    inspect_in_image(&agent, &node, &[v4.0, v4.1, v6.0, v6.1])?;
    eprintln!(
        "upgrade {old_version} -> {new_version}: {lost_up} packets lost, stop to ready {took_up:?}; \
         rollback: {lost_back} packets lost, stop to ready {took_back:?}"
    );
    ensure!(lost_up == 0, "{lost_up} packets lost during the upgrade");
    ensure!(
        lost_back == 0,
        "{lost_back} packets lost during the rollback"
    );

    // The pods go; their addresses come back; the agent stops cleanly.
    podman.ok(["rm", "-f", "-t", "0", &pods.0, &pods.1])?;
    let allocations: Value = serde_json::from_str(&ok(
        "lockstep allocations",
        agent.lockstep(&[
            "--socket",
            &node.socket().display().to_string(),
            "allocations",
            "-o",
            "json",
        ])?,
    )?)?;
    ensure!(
        !allocations
            .as_array()
            .into_iter()
            .flatten()
            .any(|a| a["owner"]["owner"] == "endpoint"),
        "endpoint allocations left: {allocations}"
    );
    ok(
        "lockstep verify",
        agent.lockstep(&["--socket", &node.socket().display().to_string(), "verify"])?,
    )?;
    agent.stop()?;
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Benchmark figures (no timed assertion): the image's size, and the time
/// from `podman run` to ready with 10k allocations in the store, median of
/// three starts (each after a clean stop of the previous container).
#[test]
fn image_size_and_start_to_ready_with_10k_allocations() -> anyhow::Result<()> {
    privileged!();
    let _serial = serial();
    let podman = Podman::new()?;
    let scratch = TempDir::new("image-build")?;
    let version = format!("{}-{}", env!("CARGO_PKG_VERSION"), unique("bench"));
    let (image, size) = build_image(&podman, scratch.path(), &version)?;
    let node = Node::new(&podman, "10.67.255.1", "10.67.0.0/16", "fd00:67::/112")?;
    let mut agent = AgentContainer::run(&podman, &node, &image)?;
    agent.wait_ready(&node)?;

    // 10k allocations through the API, 16 clients.
    let n_clients = 16;
    let per_client = 625;
    let socket = node.socket();
    let filled = Instant::now();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(async {
            let mut tasks = Vec::new();
            for c in 0..n_clients {
                let socket = socket.clone();
                tasks.push(tokio::spawn(async move {
                    for i in 0..per_client {
                        lockstep::client::call(
                            &socket,
                            hyper::Method::POST,
                            "/v1/allocations",
                            Some(serde_json::json!({
                                "pool": "pods", "family": "ipv4",
                                "owner": {"owner": "endpoint", "container_id": format!("bench-{c}-{i}"), "ifname": "eth0"},
                            })),
                        )
                        .await?;
                    }
                    anyhow::Ok(())
                }));
            }
            for t in tasks {
                t.await??;
            }
            anyhow::Ok(())
        })?;
    let want = n_clients * per_client;
    eprintln!("{want} allocations made in {:?}", filled.elapsed());

    let mut times = Vec::new();
    for _ in 0..3 {
        agent.stop()?;
        let started = Instant::now();
        agent = AgentContainer::run(&podman, &node, &image)?;
        let status = agent.wait_ready(&node)?;
        times.push(started.elapsed().as_secs_f64() * 1e3);
        ensure!(status["allocations"] == want, "{status}");
    }
    ok(
        "lockstep verify",
        agent.lockstep(&["--socket", &socket.display().to_string(), "verify"])?,
    )?;
    agent.stop()?;
    println!(
        "image {image}: {:.1} MB ({size} bytes; goal <= 30 MB)",
        size as f64 / 1e6
    );
    println!(
        "container start (podman run) to ready with {want} allocations: median {:.0} ms (runs {times:.0?} ms)",
        median(times.clone())
    );
    Ok(())
}
