//! `cargo xtask bench cni`: the CNI plugin as a runtime runs it, one new
//! process per call. Needs root and bpffs.
//!
//! a. 1000 sequential ADD+DEL pairs of `lockstep-ipam` (the agent commits with
//!    fsync and programs IPCACHE) beside the reference `host-local` (its own
//!    dataDir, same pool size) and the exec floor (`/bin/true` spawned the
//!    same way), in alternating blocks so all share the machine's noise:
//!    median per call, ADD and DEL separately. Goal: each ≤ 1.2× the floor
//!    (a plugin run as a process cannot go below it); host-local's ratios
//!    are reported. Then a breakdown of where lockstep's time goes.
//! b. 100 full ADDs (veth into 100 fresh netns) fired at once: wall time, p50
//!    and p99 per call; then 100 DELs at once: wall time, and when the
//!    reaper has the last veth deleted and its addresses released.
//! c. Full `lockstep` beside `ptp` + `host-local` ([`full`]).
//! d. The 100 full ADDs again with full reconciles forced one after another
//!    beside them ([`parallel`]): ADD p99 over b.'s, against the longest
//!    reconcile.
//!
//! Everything runs in namespaces and directories this bench creates, and is
//! removed on exit (also on panic).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[path = "shared/smoke.rs"]
mod smoke;

use anyhow::{Context, bail, ensure};
use hyper::Method;
use lockstep::client::call;
use lockstep::datapath::Datapath;
use serde_json::{Value, json};

#[path = "cni/full.rs"]
mod full;
#[path = "cni/parallel.rs"]
mod parallel;

const BIN: &str = env!("CARGO_BIN_EXE_lockstep");
/// Where [`main`] installs the plugin for the runs.
static PLUGIN: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// The plugin as a runtime runs it: `lockstep-cni` as it ships (the static,
/// stripped build `cargo xtask bench cni` passes in `LOCKSTEP_CNI_BIN`; else
/// cargo's), copied into a CNI bin directory as the agent installs it.
fn plugin() -> &'static str {
    PLUGIN
        .get()
        .map_or(env!("CARGO_BIN_EXE_lockstep-cni"), String::as_str)
}
const HOST_LOCAL: &str = "/usr/lib/cni/host-local";
const PAIRS: usize = 1000;
const BLOCK: usize = 50;
const WARMUP: usize = 20;
const PARALLEL: usize = 100;
/// The agent's metrics port, on the node netns's own loopback.
const METRICS_PORT: u16 = 9476;

/// The bench's world: a node netns running the agent, container netns,
/// a scratch directory and a pin root. Removed on drop.
struct World {
    tag: String,
    dir: PathBuf,
    pins: PathBuf,
    netns: Vec<String>,
    agent: Option<Child>,
    /// The node netns the agent runs in.
    node: Option<PathBuf>,
}

impl World {
    fn new() -> anyhow::Result<Self> {
        let tag = format!("lockstep-bench-cni-{}", std::process::id());
        let dir = std::env::temp_dir().join(&tag);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        Ok(Self {
            pins: PathBuf::from("/sys/fs/bpf").join(&tag),
            tag,
            dir,
            netns: Vec::new(),
            agent: None,
            node: None,
        })
    }

    fn netns(&mut self, name: &str) -> anyhow::Result<PathBuf> {
        let name = format!("{}-{name}", self.tag);
        ip(&["netns", "add", &name])?;
        self.netns.push(name.clone());
        Ok(PathBuf::from("/run/netns").join(name))
    }

    fn socket(&self) -> PathBuf {
        self.dir.join("api.sock")
    }

    fn start_agent(&mut self, node: &Path) -> anyhow::Result<()> {
        let config = self.dir.join("config.toml");
        std::fs::write(
            &config,
            format!(
                r#"state_dir = "{state}"
socket = "{sock}"
metrics_addr = "127.0.0.1:{METRICS_PORT}"
reconcile_interval = "60s"
default_pool = "full"
[[pools]]
name = "bench"
ipv4 = ["10.70.0.0/22"]
[[pools]]
name = "full"
ipv4 = ["10.71.0.0/24"]
[[pools]]
name = "held"
ipv4 = ["10.80.0.0/16"]
[datapath]
pin_root = "{pins}"
"#,
                state = self.dir.join("state").display(),
                sock = self.socket().display(),
                pins = self.pins.display(),
            ),
        )?;
        self.node = Some(node.to_path_buf());
        // The metrics listener binds the node's own loopback.
        let name = node
            .file_name()
            .and_then(|n| n.to_str())
            .context("node netns name")?;
        ip(&["-n", name, "link", "set", "lo", "up"])?;
        let log = std::fs::File::create(self.dir.join("agent.log"))?;
        self.agent = Some(
            Command::new("nsenter")
                .arg(format!("--net={}", node.display()))
                .arg("--")
                .arg(BIN)
                .args(["agent", "--config"])
                .arg(&config)
                .stdout(log.try_clone()?)
                .stderr(log)
                .spawn()?,
        );
        let rt = runtime()?;
        let started = Instant::now();
        loop {
            if let Ok(v) = rt.block_on(call(&self.socket(), Method::GET, "/v1/status", None))
                && v["ready"] == true
            {
                return Ok(());
            }
            if started.elapsed() > Duration::from_secs(30) {
                bail!(
                    "agent not ready:\n{}",
                    std::fs::read_to_string(self.dir.join("agent.log")).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for World {
    fn drop(&mut self) {
        if let Some(mut a) = self.agent.take() {
            let _ = a.kill();
            let _ = a.wait();
        }
        for ns in &self.netns {
            let _ = ip(&["netns", "del", ns]);
        }
        let _ = Datapath::uninstall(&self.pins, &[]);
        let _ = std::fs::remove_dir_all(&self.pins);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip").args(args).output()?;
    ensure!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

/// Runs a plugin once as a runtime does (clean environment, config on stdin,
/// result on stdout); returns the time from spawn to exit and the output.
fn invoke(program: &str, env: &[(&str, &str)], stdin: &[u8]) -> anyhow::Result<(Duration, Value)> {
    let started = Instant::now();
    let mut child = Command::new(program)
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {program}"))?;
    child.stdin.take().context("stdin")?.write_all(stdin)?;
    let out = child.wait_with_output()?;
    let took = started.elapsed();
    let text = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "{program} {env:?} failed ({}): {text} {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let value = if text.trim().is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text)?
    };
    Ok((took, value))
}

/// The exec floor: `/bin/true` spawned exactly as [`invoke`] spawns a
/// plugin (environment, three pipes, the request written to its stdin,
/// its output read to the end), so what a plugin call costs above it is
/// the plugin's own. `/bin/true` may exit before reading: a write that
/// finds its stdin closed is fine.
fn exec_floor(stdin: &[u8]) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let mut child = Command::new("/bin/true")
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("CNI_COMMAND", "ADD")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting /bin/true")?;
    let _ = child.stdin.take().context("stdin")?.write_all(stdin);
    let out = child.wait_with_output()?;
    ensure!(out.status.success(), "/bin/true failed: {}", out.status);
    Ok(started.elapsed())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn percentile(v: &[f64], p: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let i = ((v.len() as f64 * p).ceil() as usize).clamp(1, v.len()) - 1;
    v[i]
}

fn median(v: &[f64]) -> f64 {
    percentile(v, 0.5)
}

fn verdict(ok: bool) -> &'static str {
    if ok { "PASS" } else { "FAIL" }
}

/// One plugin under test in part a.
struct Ipam {
    program: &'static str,
    config: Vec<u8>,
    cni_path: &'static str,
    /// lockstep's pin root: every [`CHECK_EVERY`]th pair, outside the timed
    /// calls, the bench looks for the ADD's address in IPCACHE and for its
    /// absence after the DEL, so the figures are those of calls that really
    /// program the maps.
    pins: Option<PathBuf>,
    checked: usize,
    add: Vec<f64>,
    del: Vec<f64>,
}

/// How often the bench checks lockstep's maps (see [`Ipam::pins`]).
const CHECK_EVERY: usize = 25;

fn in_ipcache(pins: &Path, address: &str) -> anyhow::Result<bool> {
    let host: std::net::IpAddr = address
        .split('/')
        .next()
        .context("address")?
        .parse()
        .context("address")?;
    let maps = lockstep::datapath::PinnedMaps::open(pins)?;
    Ok(maps
        .ipcache_entries()?
        .iter()
        .any(|(net, _)| *net == ipnet::IpNet::from(host)))
}

impl Ipam {
    fn pair(&mut self, id: &str, netns: &str, record: bool) -> anyhow::Result<()> {
        let env = |cmd| {
            [
                ("CNI_COMMAND", cmd),
                ("CNI_CONTAINERID", id),
                ("CNI_NETNS", netns),
                ("CNI_IFNAME", "eth0"),
                ("CNI_PATH", self.cni_path),
            ]
        };
        let (add, result) = invoke(self.program, &env("ADD"), &self.config)?;
        ensure!(
            result["ips"][0]["address"]
                .as_str()
                .is_some_and(|a| a.starts_with("10.70.")),
            "{}: unexpected ADD result {result}",
            self.program
        );
        let check = self
            .pins
            .clone()
            .filter(|_| record && self.add.len().is_multiple_of(CHECK_EVERY));
        let address = result["ips"][0]["address"].as_str().unwrap_or_default();
        if let Some(pins) = &check {
            ensure!(
                in_ipcache(pins, address)?,
                "{address} acknowledged but not in IPCACHE"
            );
        }
        let (del, _) = invoke(self.program, &env("DEL"), &self.config)?;
        if let Some(pins) = &check {
            ensure!(
                !in_ipcache(pins, address)?,
                "{address} released but still in IPCACHE"
            );
            self.checked += 1;
        }
        if record {
            self.add.push(ms(add));
            self.del.push(ms(del));
        }
        Ok(())
    }
}

/// Time of `n` runs of `f`, median in ms.
fn median_of(n: usize, mut f: impl FnMut() -> anyhow::Result<Duration>) -> anyhow::Result<f64> {
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        v.push(ms(f()?));
    }
    Ok(median(&v))
}

fn sequential(world: &mut World, rows: &mut Vec<String>) -> anyhow::Result<()> {
    let netns = world.netns("seq")?;
    let netns = netns.to_str().context("utf-8")?.to_string();
    let sock = world.socket();
    let host_local_dir = world.dir.join("host-local");
    let mut lockstep = Ipam {
        program: plugin(),
        config: json!({
            "cniVersion": "1.0.0", "name": "bench", "type": "ptp",
            "ipam": {"type": "lockstep-ipam", "agentSocket": sock, "pool": "bench"},
        })
        .to_string()
        .into_bytes(),
        cni_path: "/opt/cni/bin",
        pins: Some(world.pins.clone()),
        checked: 0,
        add: Vec::new(),
        del: Vec::new(),
    };
    let mut host_local = Ipam {
        program: HOST_LOCAL,
        config: json!({
            "cniVersion": "1.0.0", "name": "bench", "type": "ptp",
            "ipam": {"type": "host-local", "dataDir": host_local_dir,
                     "ranges": [[{"subnet": "10.70.0.0/22"}]]},
        })
        .to_string()
        .into_bytes(),
        cni_path: "/usr/lib/cni",
        pins: None,
        checked: 0,
        add: Vec::new(),
        del: Vec::new(),
    };
    for i in 0..smoke::size(WARMUP, 2) {
        lockstep.pair(&format!("warm-{i}"), &netns, false)?;
        host_local.pair(&format!("warm-{i}"), &netns, false)?;
    }
    let started = Instant::now();
    let mut n = 0;
    // The exec floor, in the same rotation: two spawns per pair.
    let mut floor = Vec::new();
    let request = lockstep.config.clone();
    while n < PAIRS {
        // Alternate which goes first in a round, so neither always follows
        // the other's cache footprint.
        let round = n / BLOCK;
        let order: [&mut Ipam; 2] = if round.is_multiple_of(2) {
            [&mut lockstep, &mut host_local]
        } else {
            [&mut host_local, &mut lockstep]
        };
        for p in order {
            for i in n..n + BLOCK {
                p.pair(&format!("ctr-{i}"), &netns, true)?;
            }
        }
        for _ in 0..2 * BLOCK {
            floor.push(ms(exec_floor(&request)?));
        }
        n += BLOCK;
    }
    let took = started.elapsed();
    // Nothing left behind by either.
    let rt = runtime()?;
    let left = rt.block_on(call(&sock, Method::GET, "/v1/allocations", None))?;
    ensure!(left == json!([]), "lockstep left allocations: {left}");
    ensure!(lockstep.checked > 0, "lockstep's maps were never checked");

    let (la, ld) = (median(&lockstep.add), median(&lockstep.del));
    let (ha, hd) = (median(&host_local.add), median(&host_local.del));
    println!(
        "\na. {PAIRS} sequential ADD+DEL pairs each ({} calls in {:.1} s, blocks of {BLOCK}, alternating):",
        4 * PAIRS,
        took.as_secs_f64()
    );
    println!(
        "   {:<22} {:>10} {:>10} {:>10} {:>10}",
        "per call (ms)", "ADD p50", "ADD p99", "DEL p50", "DEL p99"
    );
    for (name, p) in [("lockstep-ipam", &lockstep), ("host-local", &host_local)] {
        println!(
            "   {name:<22} {:>10.3} {:>10.3} {:>10.3} {:>10.3}",
            median(&p.add),
            percentile(&p.add, 0.99),
            median(&p.del),
            percentile(&p.del, 0.99)
        );
    }
    println!(
        "   lockstep's IPCACHE checked after {} of its ADDs and DELs (outside the timed calls): entry there after ADD, gone after DEL",
        lockstep.checked
    );
    let (ra, rd) = (ha / la, hd / ld);
    // Judged against what no plugin run as a process can beat: the exec
    // floor, measured in the same rotation. host-local is reported beside
    // it (its DEL is only about three times the floor here).
    let f = median(&floor);
    println!(
        "   {:<22} {:>10.3} {:>10.3}   (/bin/true spawned as a plugin is, in the same rotation)",
        "exec floor",
        f,
        percentile(&floor, 0.99)
    );
    rows.push(format!(
        "{:<44} {:>16} {:>12} {}",
        "IPAM ADD median / exec floor",
        format!("{:.2}x ({la:.2} vs {f:.2} ms)", la / f),
        "<= 1.2x",
        verdict(la <= 1.2 * f)
    ));
    rows.push(format!(
        "{:<44} {:>16} {:>12} {}",
        "IPAM DEL median / exec floor",
        format!("{:.2}x ({ld:.2} vs {f:.2} ms)", ld / f),
        "<= 1.2x",
        verdict(ld <= 1.2 * f)
    ));
    rows.push(format!(
        "{:<44} {:>16} {:>12} (info)",
        "IPAM ADD median: host-local / lockstep",
        format!("{ra:.2}x ({la:.2} vs {ha:.2} ms)"),
        ""
    ));
    rows.push(format!(
        "{:<44} {:>16} {:>12} (info)",
        "IPAM DEL median: host-local / lockstep",
        format!("{rd:.2}x ({ld:.2} vs {hd:.2} ms)"),
        ""
    ));
    rows.push(format!(
        "{:<44} {:>16} {:>12} (info)",
        "host-local DEL median / exec floor",
        format!("{:.2}x", hd / f),
        ""
    ));

    // Where lockstep's time goes: the floor of any process start, the two
    // binaries doing no I/O (VERSION), and the agent's share measured from
    // a persistent client (no process, no runtime start).
    let version = br#"{"cniVersion":"1.0.0"}"#;
    let v_env = [("CNI_COMMAND", "VERSION")];
    let spawn_true = f;
    let v_lockstep = median_of(200, || Ok(invoke(plugin(), &v_env, version)?.0))?;
    let v_host_local = median_of(200, || Ok(invoke(HOST_LOCAL, &v_env, version)?.0))?;
    let mut api_add = Vec::new();
    let mut api_del = Vec::new();
    rt.block_on(async {
        for i in 0..200 {
            let id = format!("api-{i}");
            let s = Instant::now();
            call(
                &sock,
                Method::POST,
                "/v1/cni/add",
                Some(json!({"container_id": id, "ifname": "eth0", "netns": netns,
                            "mode": "ipam", "pool": "bench"})),
            )
            .await?;
            api_add.push(ms(s.elapsed()));
            let s = Instant::now();
            call(
                &sock,
                Method::POST,
                "/v1/cni/del",
                Some(json!({"container_id": id, "ifname": "eth0"})),
            )
            .await?;
            api_del.push(ms(s.elapsed()));
        }
        anyhow::Ok(())
    })?;
    let size = |p: &str| {
        std::fs::metadata(p)
            .map(|m| m.len() as f64 / 1e6)
            .unwrap_or(0.0)
    };
    println!("   breakdown (medians, ms):");
    println!("     exec floor (/bin/true spawned as a plugin)     {spawn_true:>8.3}");
    println!(
        "     lockstep VERSION (process start, {:.1} MB binary) {v_lockstep:>8.3}",
        size(plugin())
    );
    println!(
        "     host-local VERSION (process start, {:.1} MB)      {v_host_local:>8.3}",
        size(HOST_LOCAL)
    );
    println!(
        "     agent /v1/cni/add from a warm client (commit+maps) {:>8.3}",
        median(&api_add)
    );
    println!(
        "     agent /v1/cni/del from a warm client (commit+maps) {:>8.3}",
        median(&api_del)
    );
    println!(
        "     rest of a plugin ADD (runtime, connect, parse)     {:>8.3}",
        la - v_lockstep - median(&api_add)
    );
    // The physical floor of a durable ADD: one 4 KiB write and fdatasync
    // on the filesystem that holds the agent's store.
    let sync_file = world.dir.join("state/fdatasync-probe");
    let page = [0x5au8; 4096];
    let fdatasync = median_of(200, || {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(false)
            .open(&sync_file)?;
        let s = Instant::now();
        f.write_all(&page)?;
        f.sync_data()?;
        Ok(s.elapsed())
    })?;
    let _ = std::fs::remove_file(&sync_file);
    println!("     one 4 KiB write + fdatasync on the store's fs  {fdatasync:>8.3}");
    // The best ratio any plugin could reach against host-local here: it must
    // start (VERSION does nothing else) and, to be durable, wait for at
    // least one fdatasync, even if everything else cost nothing. The second
    // bound uses the agent's measured share (commit + maps) instead.
    let bound = ha / (v_lockstep + fdatasync);
    let ceiling = ha / (v_lockstep + median(&api_add));
    println!("     bound: host-local ADD / (start + fdatasync)       {bound:>8.2}x");
    println!("     bound: host-local ADD / (start + agent share)     {ceiling:>8.2}x");
    rows.push(format!(
        "{:<44} {:>16} {:>12} (info)",
        "ratio bound: process start + one fdatasync",
        format!("{bound:.2}x"),
        ""
    ));
    Ok(())
}

fn main() -> anyhow::Result<()> {
    // SAFETY: geteuid has no preconditions.
    ensure!(unsafe { libc::geteuid() } == 0, "the cni bench needs root");
    ensure!(
        Path::new(HOST_LOCAL).exists(),
        "{HOST_LOCAL} is missing (apt-get install containernetworking-plugins)"
    );
    let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "cni bench on {} ({cpus} CPUs, Linux {}); lockstep {}",
        hostname.trim(),
        kernel.trim(),
        BIN
    );
    let mut world = World::new()?;
    let source = std::env::var("LOCKSTEP_CNI_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_lockstep-cni").to_string());
    let bin_dir = world.dir.join("bin");
    std::fs::create_dir_all(&bin_dir)?;
    let installed = bin_dir.join("lockstep-ipam");
    std::fs::copy(&source, &installed).with_context(|| format!("installing {source}"))?;
    println!("plugin: {source}, installed as {}", installed.display());
    let _ = PLUGIN.set(installed.display().to_string());
    let node = world.netns("node")?;
    world.start_agent(&node)?;
    let mut rows = Vec::new();
    sequential(&mut world, &mut rows)?;
    full::side_by_side(&mut world, &node, &mut rows)?;
    parallel::parallel(&mut world, &mut rows)?;
    println!("\n{:<44} {:>16} {:>12} result", "measure", "value", "goal");
    for r in &rows {
        println!("{r}");
    }
    println!(
        "machine: {}, {cpus} CPUs; each call is a new process, as a runtime runs it",
        hostname.trim()
    );
    let missed = rows.iter().filter(|r| r.ends_with("FAIL")).count();
    // A smoke run judges no goal (`shared/smoke.rs`).
    ensure!(missed == 0 || smoke::smoke(), "{missed} cni goal(s) missed");
    Ok(())
}
