//! Helpers for lockstep's root-only integration tests.
//!
//! Every test builds its own world: network namespaces (named
//! `lockstep-t-<pid>-<n>` so parallel tests and leftovers are recognisable),
//! veth pairs inside them, and a pin root under `/sys/fs/bpf/lockstep-test-*`.
//! Guards remove all of it on drop, also when the test fails.
//!
//! Privileged tests fail when they cannot run; they skip only when
//! `LOCKSTEP_SKIP_PRIVILEGED=1` is set, and say so.

use std::ffi::OsStr;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{Context, bail};

pub mod bgp;
pub mod churn;
pub mod cluster;
pub mod cni_chain;
pub mod etcd;
pub mod kube_lab;
pub mod kube_pods;
pub mod kubeapi;
pub mod lb_lab;
pub mod ledger;
pub mod lossyfs;
pub mod ndp;
pub mod podman;
pub mod progstats;
pub mod routed;
pub mod seqping;
pub mod synthetic;
pub mod traffic;
pub mod world;

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A short name unique to this process and call.
pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// Returns `true` when privileged tests must be skipped (and says so), panics
/// when they cannot run and no opt-out was given.
pub fn skip_privileged(test: &str) -> bool {
    if std::env::var("LOCKSTEP_SKIP_PRIVILEGED").as_deref() == Ok("1") {
        eprintln!("SKIPPED {test}: LOCKSTEP_SKIP_PRIVILEGED=1 is set");
        return true;
    }
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "{test} needs root (namespaces, bpffs); run it through `cargo xtask test` as root, \
         or set LOCKSTEP_SKIP_PRIVILEGED=1 to skip it explicitly"
    );
    false
}

/// Skips the test (returning early) when privileged tests are opted out.
#[macro_export]
macro_rules! privileged {
    () => {
        if $crate::skip_privileged(module_path!()) {
            return Ok(());
        }
    };
}

/// Runs a command, failing with its output when it fails.
pub fn sh<I, S>(program: &str, args: I) -> anyhow::Result<String>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let out = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("starting {program}"))?;
    check(program, out)
}

fn check(what: &str, out: Output) -> anyhow::Result<String> {
    if !out.status.success() {
        bail!(
            "{what} failed ({}):\nstdout: {}\nstderr: {}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The lockstep binary under test (`LOCKSTEP_BIN`: `cargo xtask test` sets it
/// to the agent staged beside the plugin as it ships, in `target/staged/`).
pub fn lockstep_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("LOCKSTEP_BIN") {
        return PathBuf::from(p);
    }
    let fallback = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/debug/lockstep");
    assert!(
        fallback.exists(),
        "lockstep binary not found; run the tests through `cargo xtask test` (sets LOCKSTEP_BIN)"
    );
    fallback
}

// One definition for the benches and the benchmark tests: the module's
// own docs say what a smoke run is.
#[path = "../../agent/daemon/benches/shared/smoke.rs"]
pub mod bench;

/// The `p` quantile (0..=1) of `sorted` durations, by nearest rank: what
/// every benchmark test prints as p50 and p99.
///
/// # Panics
/// `sorted` is empty.
pub fn pct(sorted: &[std::time::Duration], p: f64) -> std::time::Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// A network namespace, deleted on drop.
#[derive(Debug)]
pub struct Netns {
    name: String,
}

impl Netns {
    /// Creates a namespace with a unique name and loopback up.
    ///
    /// # Errors
    /// `ip netns add` failed.
    pub fn new(tag: &str) -> anyhow::Result<Self> {
        let name = unique(&format!("lockstep-t{tag}"));
        sh("ip", ["netns", "add", &name])?;
        let ns = Self { name };
        ns.ip(["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// The namespace's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Path of the namespace file.
    pub fn path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.name)
    }

    /// `ip -n <ns> ...`.
    ///
    /// # Errors
    /// The command failed.
    pub fn ip<I, S>(&self, args: I) -> anyhow::Result<String>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut all: Vec<std::ffi::OsString> = vec!["-n".into(), self.name.clone().into()];
        all.extend(args.into_iter().map(|a| a.as_ref().to_os_string()));
        sh("ip", all)
    }

    /// A command run inside the namespace (network only: `nsenter --net`, so
    /// the bpffs mount stays visible, unlike `ip netns exec`).
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net={}", self.path().display()))
            .arg("--")
            .arg(program);
        cmd
    }

    /// Runs a command inside the namespace; fails when it fails.
    ///
    /// # Errors
    /// The command failed.
    pub fn exec<I, S>(&self, program: &str, args: I) -> anyhow::Result<String>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let out = self
            .command(program)
            .args(args)
            .output()
            .with_context(|| format!("starting {program} in {}", self.name))?;
        check(program, out)
    }

    /// Sets a sysctl inside the namespace.
    ///
    /// # Errors
    /// The write failed.
    pub fn sysctl(&self, key: &str, value: &str) -> anyhow::Result<()> {
        self.exec("sysctl", ["-qw", &format!("{key}={value}")])?;
        Ok(())
    }

    /// Runs `f` on a thread that has entered this namespace; sockets made
    /// there stay in it.
    ///
    /// # Errors
    /// `setns` failed, or `f` did.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> anyhow::Result<T> + Send) -> anyhow::Result<T> {
        let path = self.path();
        std::thread::scope(|s| {
            s.spawn(move || {
                let file = std::fs::File::open(&path)
                    .with_context(|| format!("opening {}", path.display()))?;
                // SAFETY: valid fd of a network namespace file; affects only
                // this thread.
                let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
                if rc != 0 {
                    bail!(
                        "setns {}: {}",
                        path.display(),
                        std::io::Error::last_os_error()
                    );
                }
                f()
            })
            .join()
            .map_err(|_| anyhow::anyhow!("thread in {} panicked", self.name))?
        })
    }

    /// The MAC address of `iface` in this namespace.
    ///
    /// # Errors
    /// No such interface.
    pub fn mac(&self, iface: &str) -> anyhow::Result<String> {
        let out = self.ip(["-j", "link", "show", "dev", iface])?;
        let v: serde_json::Value = serde_json::from_str(&out)?;
        v[0]["address"]
            .as_str()
            .map(str::to_string)
            .context("no address in ip -j link output")
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

/// A veth pair from `a` (named `a_if`) to `b` (named `b_if`), both up.
///
/// # Errors
/// `ip link` failed.
pub fn veth(a: &Netns, a_if: &str, b: &Netns, b_if: &str) -> anyhow::Result<()> {
    a.ip([
        "link",
        "add",
        a_if,
        "type",
        "veth",
        "peer",
        "name",
        b_if,
        "netns",
        b.name(),
    ])?;
    a.ip(["link", "set", a_if, "up"])?;
    b.ip(["link", "set", b_if, "up"])?;
    Ok(())
}

/// A pin root under /sys/fs/bpf, uninstalled (links detached, pins removed) on
/// drop.
#[derive(Debug)]
pub struct PinRoot {
    path: PathBuf,
}

impl PinRoot {
    /// A fresh, unique pin root (not created yet; the agent creates it).
    pub fn new() -> Self {
        Self {
            path: PathBuf::from("/sys/fs/bpf").join(unique("lockstep-test")),
        }
    }

    /// The path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `--pin-root <path>` as arguments.
    pub fn arg(&self) -> [String; 2] {
        ["--pin-root".into(), self.path.display().to_string()]
    }
}

impl Default for PinRoot {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for PinRoot {
    fn drop(&mut self) {
        let _ = Command::new(lockstep_bin())
            .args(["datapath", "uninstall", "--pin-root"])
            .arg(&self.path)
            .output();
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// Runs the lockstep binary inside `ns` with `args`; fails when it fails.
///
/// # Errors
/// The command failed.
pub fn lockstep_in<I, S>(ns: &Netns, args: I) -> anyhow::Result<String>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    ns.exec(lockstep_bin().to_str().context("utf-8 path")?, args)
}

/// Runs the lockstep binary inside `ns`, returning the raw output.
///
/// # Errors
/// It could not be started.
pub fn lockstep_output<I, S>(ns: &Netns, args: I) -> anyhow::Result<Output>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    Ok(ns.command(lockstep_bin()).args(args).output()?)
}

/// The datapath counters as JSON (`lockstep datapath counters -o json`).
///
/// # Errors
/// The command failed or printed no JSON.
pub fn counters(pins: &PinRoot) -> anyhow::Result<serde_json::Value> {
    let mut args = vec![
        "datapath".to_string(),
        "counters".into(),
        "-o".into(),
        "json".into(),
    ];
    args.extend(pins.arg());
    let out = sh(lockstep_bin().to_str().context("utf-8 path")?, args)?;
    Ok(serde_json::from_str(&out)?)
}

/// One counter's value.
///
/// # Errors
/// See [`counters`].
pub fn counter(pins: &PinRoot, name: &str) -> anyhow::Result<u64> {
    counters(pins)?[name]
        .as_u64()
        .with_context(|| format!("no counter {name}"))
}

/// One counter summed over every CPU, read straight from COUNTERS through
/// maps this process holds open (no pin root or CLI needed).
///
/// # Errors
/// COUNTERS could not be read.
pub fn counter_sum(
    maps: &lockstep::datapath::PinnedMaps,
    c: lockstep_common::Counter,
) -> anyhow::Result<u64> {
    Ok(maps
        .counters_map()
        .get(&(c as u32), 0)
        .context("COUNTERS")?
        .iter()
        .sum())
}

/// A scratch directory under /tmp, removed on drop.
#[derive(Debug)]
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    /// Creates a fresh, unique directory.
    ///
    /// # Errors
    /// It could not be created.
    pub fn new(tag: &str) -> anyhow::Result<Self> {
        Self::new_in(&std::env::temp_dir(), tag)
    }

    /// Creates a fresh, unique directory under `base`.
    ///
    /// # Errors
    /// It could not be created.
    pub fn new_in(base: &Path, tag: &str) -> anyhow::Result<Self> {
        let path = base.join(unique(&format!("lockstep-{tag}")));
        std::fs::create_dir_all(&path)?;
        Ok(Self { path })
    }

    /// The path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// Every process below `pid` (children first found through
/// `/proc/PID/task/*/children`), deepest last.
pub fn descendants(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let mut queue = vec![pid];
    while let Some(p) = queue.pop() {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) else {
            continue;
        };
        for task in tasks.filter_map(Result::ok) {
            let children =
                std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
            for child in children.split_whitespace().filter_map(|c| c.parse().ok()) {
                out.push(child);
                queue.push(child);
            }
        }
    }
    out
}

/// A `lockstep agent` process in a node namespace, with its own state
/// directory, socket and pin root. Killed (and its pins removed) on drop.
#[derive(Debug)]
pub struct AgentProc {
    child: Option<std::process::Child>,
    /// State, socket and config live here.
    pub dir: TempDir,
    /// The pin root.
    pub pins: PinRoot,
    /// The config file.
    pub config: PathBuf,
    netns: PathBuf,
    /// The binary it runs (and its CLI calls use).
    bin: PathBuf,
}

/// How [`AgentProc::launch`] starts an agent.
#[derive(Clone, Debug, Default)]
pub struct AgentOptions {
    /// TOML appended to the generated config: pools etc., and `[datapath]`
    /// keys, which are merged with the generated pin root.
    pub extra: String,
    /// The state directory; `None` puts it inside the agent's own scratch
    /// directory.
    pub state_dir: Option<PathBuf>,
    /// Return as soon as the process runs, ready or not.
    pub unready: bool,
    /// The binary to run (default [`lockstep_bin`]): another build's, for
    /// a benchmark's baseline side.
    pub bin: Option<PathBuf>,
}

impl AgentProc {
    /// Writes a config (paths filled in, `extra` TOML appended: pools etc.)
    /// and starts the agent; returns once it reports ready.
    ///
    /// # Errors
    /// It did not become ready within 20 s.
    pub fn start(node: &Netns, extra: &str) -> anyhow::Result<Self> {
        Self::launch(
            node,
            &AgentOptions {
                extra: extra.to_string(),
                ..AgentOptions::default()
            },
        )
    }

    /// Writes a config (the agent's own scratch directory holds it, its
    /// socket and its log; the state directory is `options.state_dir` or in
    /// there too) and starts the agent; unless `options.unready`, returns once
    /// it reports ready.
    ///
    /// # Errors
    /// The config could not be written, the process not started, or it did
    /// not become ready within 20 s.
    pub fn launch(node: &Netns, options: &AgentOptions) -> anyhow::Result<Self> {
        let dir = TempDir::new("agent")?;
        let pins = PinRoot::new();
        let config = dir.path().join("config.toml");
        let extra = &options.extra;
        let state = options
            .state_dir
            .clone()
            .unwrap_or_else(|| dir.path().join("state"));
        let text = format!(
            "state_dir = \"{state}\"\nsocket = \"{sock}\"\nmetrics_addr = \"127.0.0.1:0\"\n{extra}\n[datapath]\npin_root = \"{pins}\"\n",
            state = state.display(),
            sock = dir.path().join("api.sock").display(),
            pins = pins.path().display(),
        );
        // `extra` may carry its own [datapath] keys; merge them by putting
        // them after our header only when it declares the table itself.
        let text = if extra.contains("[datapath]") {
            text.replace(
                &format!("\n[datapath]\npin_root = \"{}\"\n", pins.path().display()),
                "\n",
            )
            .replace(
                "[datapath]\n",
                &format!("[datapath]\npin_root = \"{}\"\n", pins.path().display()),
            )
        } else {
            text
        };
        std::fs::write(&config, text)?;
        let mut agent = Self {
            child: None,
            dir,
            pins,
            config,
            netns: node.path(),
            bin: options.bin.clone().unwrap_or_else(lockstep_bin),
        };
        agent.spawn()?;
        if !options.unready {
            agent.wait_ready()?;
        }
        Ok(agent)
    }

    /// The agent's process id (the wrappers in front of it exec it), while
    /// it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(std::process::Child::id)
    }

    /// The API socket.
    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("api.sock")
    }

    fn spawn(&mut self) -> anyhow::Result<()> {
        self.spawn_under::<[&str; 0], &str>([])
    }

    /// Starts the agent process (not waiting for ready) with `wrapper` in
    /// front of it, for example `strace` to kill it at a chosen syscall.
    ///
    /// # Errors
    /// The log could not be opened or the process not started.
    pub fn spawn_under<I, S>(&mut self, wrapper: I) -> anyhow::Result<()>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("agent.log"))?;
        let child = Command::new("nsenter")
            .arg(format!("--net={}", self.netns.display()))
            .arg("--")
            .args(wrapper)
            .arg(&self.bin)
            .args(["agent", "--config"])
            .arg(&self.config)
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        self.child = Some(child);
        Ok(())
    }

    /// The agent's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("agent.log")).unwrap_or_default()
    }

    /// Polls status until ready.
    ///
    /// # Errors
    /// Not ready within 20 s, or the process exited.
    pub fn wait_ready(&mut self) -> anyhow::Result<std::time::Duration> {
        self.wait_ready_within(std::time::Duration::from_secs(20))
    }

    /// Polls status until ready, for at most `limit`.
    ///
    /// # Errors
    /// Not ready within `limit`, or the process exited.
    pub fn wait_ready_within(
        &mut self,
        limit: std::time::Duration,
    ) -> anyhow::Result<std::time::Duration> {
        let started = std::time::Instant::now();
        let mut last = String::new();
        while started.elapsed() < limit {
            if let Some(child) = self.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                bail!("agent exited with {status}:\n{}", self.log());
            }
            let out = self.cli(["status", "-o", "json"])?;
            if out.status.success() {
                return Ok(started.elapsed());
            }
            last = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        bail!(
            "agent not ready within {limit:?}; last status: {last}\n{}",
            self.log()
        )
    }

    /// Runs a lockstep CLI command against this agent.
    ///
    /// # Errors
    /// It could not be started.
    pub fn cli<I, S>(&self, args: I) -> anyhow::Result<Output>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        Ok(Command::new(&self.bin)
            .arg("--socket")
            .arg(self.socket())
            .args(args)
            .output()?)
    }

    /// Runs a CLI command that must succeed and print JSON.
    ///
    /// # Errors
    /// It failed or printed no JSON.
    pub fn json<I, S>(&self, args: I) -> anyhow::Result<serde_json::Value>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let out = self.cli(args)?;
        let text = check("lockstep", out)?;
        Ok(serde_json::from_str(&text)?)
    }

    /// SIGKILL, as a crash would.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            // The agent may run under a wrapper (strace): kill what runs
            // beneath first, since a killed tracer leaves its tracee running.
            for pid in descendants(child.id()) {
                // SAFETY: plain kill(2) on a process of our own tree.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM and wait; returns the exit status.
    ///
    /// # Errors
    /// Waiting failed.
    pub fn stop(&mut self) -> anyhow::Result<Option<std::process::ExitStatus>> {
        let Some(mut child) = self.child.take() else {
            return Ok(None);
        };
        // SAFETY: plain kill(2) on our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        Ok(Some(child.wait()?))
    }

    /// SIGKILLs the agent (if it runs) and starts it again on the same state
    /// and pins, without waiting for ready: for tests that crash it during
    /// start-up ([`AgentProc::wait_ready`] waits).
    ///
    /// # Errors
    /// The process could not be started.
    pub fn respawn(&mut self) -> anyhow::Result<()> {
        self.kill9();
        self.spawn()
    }

    /// `lockstep lb apply` of `doc` (pools and services, as the file
    /// takes them); the agent's JSON answer.
    ///
    /// # Errors
    /// The file could not be written, or the command failed.
    pub fn lb_apply(&self, doc: &serde_json::Value) -> anyhow::Result<serde_json::Value> {
        let path = self.dir.path().join(format!("{}.json", unique("lb")));
        std::fs::write(&path, doc.to_string())?;
        self.json([
            "lb",
            "apply",
            "-f",
            path.to_str().context("utf-8")?,
            "-o",
            "json",
        ])
    }

    /// Starts the agent again on the same state and pins; waits for ready and
    /// returns how long that took.
    ///
    /// # Errors
    /// It did not become ready.
    pub fn restart(&mut self) -> anyhow::Result<std::time::Duration> {
        self.kill9();
        let started = std::time::Instant::now();
        self.spawn()?;
        self.wait_ready()?;
        Ok(started.elapsed())
    }

    /// Starts the agent with a different config file; returns its output if
    /// it exits within `wait` (a refused config), or `None` if it is running.
    ///
    /// # Errors
    /// Spawning failed.
    pub fn try_config(&mut self, text: &str) -> anyhow::Result<Output> {
        self.kill9();
        let path = self.dir.path().join("other.toml");
        std::fs::write(&path, text)?;
        Ok(Command::new("nsenter")
            .arg(format!("--net={}", self.netns.display()))
            .arg("--")
            .arg(lockstep_bin())
            .args(["agent", "--config"])
            .arg(&path)
            .output()?)
    }
}

impl AgentProc {
    /// Waits (at most `within`) until `lockstep verify` is clean: state
    /// the agent converges on in the background (cluster mode's remote
    /// routes after a start) may take a moment.
    ///
    /// # Errors
    /// Still drifting after `within`, with the last report.
    pub fn verify_within(&self, within: std::time::Duration) -> anyhow::Result<()> {
        let started = std::time::Instant::now();
        loop {
            let out = self.cli(["verify"])?;
            if out.status.success() {
                return Ok(());
            }
            anyhow::ensure!(
                started.elapsed() < within,
                "verify not clean after {within:?}: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    }

    /// `lockstep maps dump -o json` of this agent's pins: it reads the pinned
    /// maps directly, so it works while the agent is down.
    ///
    /// # Errors
    /// The command failed or printed no JSON.
    pub fn maps_dump(&self) -> anyhow::Result<serde_json::Value> {
        let out = Command::new(lockstep_bin())
            .args(["maps", "dump", "-o", "json", "--pin-root"])
            .arg(self.pins.path())
            .output()?;
        Ok(serde_json::from_str(&check("lockstep maps dump", out)?)?)
    }
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        self.kill9();
    }
}

impl AgentProc {
    /// Like [`AgentProc::start`] (no `[datapath]` keys in `extra`), but
    /// returns as soon as the process runs, ready or not: for agents that
    /// wait for something (delegated mode's conflist).
    ///
    /// # Errors
    /// Writing the config or spawning failed.
    pub fn spawn_unready(node: &Netns, extra: &str) -> anyhow::Result<Self> {
        Self::launch(
            node,
            &AgentOptions {
                extra: extra.to_string(),
                unready: true,
                ..AgentOptions::default()
            },
        )
    }

    /// Status as JSON, ready or not (`None` while the socket does not answer).
    pub fn status_json(&self) -> Option<serde_json::Value> {
        let out = self.cli(["status", "-o", "json"]).ok()?;
        serde_json::from_slice(&out.stdout).ok()
    }

    /// Whether the agent process has exited (and with what).
    ///
    /// # Errors
    /// Waiting failed.
    pub fn exited(&mut self) -> anyhow::Result<Option<std::process::ExitStatus>> {
        match self.child.as_mut() {
            Some(c) => Ok(c.try_wait()?),
            None => Ok(None),
        }
    }

    /// Replaces the config file (for the next [`AgentProc::restart`]).
    ///
    /// # Errors
    /// The write failed.
    pub fn rewrite_config(&self, f: impl FnOnce(&str) -> String) -> anyhow::Result<()> {
        let text = std::fs::read_to_string(&self.config)?;
        std::fs::write(&self.config, f(&text))?;
        Ok(())
    }
}

/// Reads a JSON-lines log (one object per line), skipping partial lines.
pub fn json_lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// `sock.recv_from(buf)`, going on after a signal interrupted it (EINTR):
/// the socket's read timeout still bounds each wait. A test thread's
/// receive was once cut short so in CI, and read as "nothing came".
///
/// # Errors
/// What `recv_from` fails with otherwise (a timeout among them).
pub fn recv_from_retrying(
    sock: &std::net::UdpSocket,
    buf: &mut [u8],
) -> std::io::Result<(usize, std::net::SocketAddr)> {
    loop {
        match sock.recv_from(buf) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            r => return r,
        }
    }
}

/// The agent's metrics address in `node` (the tests' agents bind port 0):
/// read from the listening sockets.
///
/// # Errors
/// No lockstep listener, or its address does not parse.
pub fn metrics_addr(node: &Netns) -> anyhow::Result<std::net::SocketAddr> {
    let listening = node.exec("ss", ["-ltnpH"])?;
    let line = listening
        .lines()
        .find(|l| l.contains("\"lockstep\""))
        .ok_or_else(|| anyhow::anyhow!("no lockstep listener in:\n{listening}"))?;
    let addr = line
        .split_whitespace()
        .nth(3)
        .ok_or_else(|| anyhow::anyhow!("no local address in {line:?}"))?;
    Ok(addr.parse()?)
}

/// strace attached to `pid`, delaying each of its fdatasync and fsync
/// calls by `delay` (a commit, and with it the agent's lock, held that
/// long). SIGINT detaches it; the caller waits for it.
///
/// # Errors
/// strace (installed by setup) could not start.
pub fn delay_fsyncs(pid: u32, delay: std::time::Duration) -> anyhow::Result<std::process::Child> {
    Command::new("strace")
        .args([
            "-f",
            "-qq",
            "-o",
            "/dev/null",
            "-e",
            "trace=fdatasync,fsync",
        ])
        .args([
            "-e",
            &format!("inject=fdatasync,fsync:delay_enter={}", delay.as_micros()),
        ])
        .arg("-p")
        .arg(pid.to_string())
        .spawn()
        .map_err(|e| anyhow::anyhow!("strace (installed by setup): {e}"))
}

/// The families of a text-format scrape (its TYPE lines) that
/// docs/metrics.md, the metrics reference, does not name in backquotes.
///
/// # Errors
/// The reference could not be read.
pub fn undocumented_families(text: &str) -> anyhow::Result<Vec<String>> {
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/metrics.md"))?;
    Ok(text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|f| !doc.contains(&format!("`{f}`")))
        .map(str::to_string)
        .collect())
}

/// `promtool check metrics` (Prometheus's own linter, installed by setup)
/// on a scrape in the text format: Ok when it finds nothing.
///
/// # Errors
/// promtool named a problem, or could not run.
pub fn promtool_check_metrics(text: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| {
            anyhow::anyhow!("promtool (the prometheus package, installed by setup): {e}")
        })?;
    child
        .stdin
        .take()
        .ok_or_else(|| anyhow::anyhow!("promtool's stdin"))?
        .write_all(text.as_bytes())?;
    let out = child.wait_with_output()?;
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    anyhow::ensure!(
        out.status.success() && said.trim().is_empty(),
        "promtool check metrics ({}) on {} lines:\n{said}",
        out.status,
        text.lines().count()
    );
    Ok(())
}

/// Polls `f` every 200 ms until it returns `None` (done), for at most
/// `within`; `Some` says what it saw instead. Returns how long it took.
///
/// # Errors
/// `f` failed, or still saw something else after `within` (named with
/// what it last saw).
pub fn until(
    within: std::time::Duration,
    what: &str,
    mut f: impl FnMut() -> anyhow::Result<Option<String>>,
) -> anyhow::Result<std::time::Duration> {
    let started = std::time::Instant::now();
    loop {
        match f()? {
            None => return Ok(started.elapsed()),
            Some(seen) => anyhow::ensure!(
                started.elapsed() < within,
                "{what} not within {within:?}: {seen}"
            ),
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

/// Polls `f` every 20 ms until it returns `Some`, for at most `limit`.
///
/// # Errors
/// It did not within `limit`; the error says what was awaited.
pub fn wait_for<T>(
    what: &str,
    limit: std::time::Duration,
    mut f: impl FnMut() -> Option<T>,
) -> anyhow::Result<T> {
    let started = std::time::Instant::now();
    loop {
        if let Some(v) = f() {
            return Ok(v);
        }
        if started.elapsed() > limit {
            bail!("timed out after {limit:?} waiting for {what}");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}
