//! A pin root has one owner, and its pins name the maps the programs use
//! (issue #16, items 1 and 2).
//!
//! - A second agent with its own state directory and socket on a running
//!   agent's pin root is refused, with and without `migrate`, naming both
//!   stores (ids read from each store's log header) and state directories;
//!   the first keeps serving, its entries intact through several reconcile
//!   intervals. A restart of the same agent (an upgrade with `--migrate` and
//!   a changed capacity included) is accepted.
//! - A stale record (the owner's state directory is gone) is refused, and
//!   says so; `--take-over-pin-root` takes it.
//! - The record is a frozen map pinned 0600; a symbolic link planted at its
//!   path is refused, not followed.
//! - With `--take-over-pin-root` the second agent starts; the first goes not
//!   ready naming who took over and writes no map again.
//! - A map pin removed with `rm`, or replaced by another map of the same
//!   definition (`bpftool map create`), is named by `verify` (non-zero exit),
//!   makes status not ready, and is repaired by the next reconcile tick: the
//!   pin names the programs' map again (by id, from `bpftool prog show`),
//!   its entries are back, and the repair is counted.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use lockstep_tests::{AgentProc, Netns, TempDir, lockstep_bin, privileged, sh, wait_for};

/// The reconcile interval of every agent here.
const INTERVAL: Duration = Duration::from_millis(200);

const POOL: &str = r#"
reconcile_interval = "200ms"
default_pool = "pins"
[[pools]]
name = "pins"
ipv4 = ["10.66.0.0/24"]
"#;

/// A second agent on another agent's pin root, with its own state
/// directory, socket and log. Killed on drop.
struct Other {
    child: Option<Child>,
    dir: TempDir,
}

impl Other {
    /// Starts `lockstep agent` with its own state and socket on `pins`;
    /// `datapath` is appended under `[datapath]`, `args` to the command.
    fn spawn(node: &Netns, pins: &Path, datapath: &str, args: &[&str]) -> anyhow::Result<Self> {
        let dir = TempDir::new("other")?;
        let config = dir.path().join("config.toml");
        std::fs::write(
            &config,
            format!(
                "state_dir = \"{state}\"\nsocket = \"{sock}\"\nmetrics_addr = \"127.0.0.1:0\"\n{POOL}\n\
                 [datapath]\npin_root = \"{pins}\"\n{datapath}\n",
                state = dir.path().join("state").display(),
                sock = dir.path().join("api.sock").display(),
                pins = pins.display(),
            ),
        )?;
        let log = std::fs::File::create(dir.path().join("agent.log"))?;
        let child = Command::new("nsenter")
            .arg(format!("--net={}", node.path().display()))
            .arg("--")
            .arg(lockstep_bin())
            .args(["agent", "--config"])
            .arg(&config)
            .args(args)
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        Ok(Self {
            child: Some(child),
            dir,
        })
    }

    fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("agent.log")).unwrap_or_default()
    }

    fn cli(&self, args: &[&str]) -> anyhow::Result<Output> {
        Ok(Command::new(lockstep_bin())
            .arg("--socket")
            .arg(self.dir.path().join("api.sock"))
            .args(args)
            .output()?)
    }

    /// Waits for the process to exit; fails when it keeps running.
    fn refused(&mut self, limit: Duration) -> anyhow::Result<String> {
        let child = self.child.as_mut().context("not started")?;
        let started = Instant::now();
        loop {
            if let Some(status) = child.try_wait()? {
                self.child = None;
                ensure!(!status.success(), "it exited cleanly:\n{}", self.log());
                return Ok(self.log());
            }
            if started.elapsed() > limit {
                bail!(
                    "a second agent on the same pin root kept running:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn wait_ready(&mut self) -> anyhow::Result<()> {
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(20) {
            if let Some(child) = self.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                bail!("the second agent exited with {status}:\n{}", self.log());
            }
            if self.cli(&["status", "-o", "json"])?.status.success() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        bail!("the second agent was not ready in 20 s:\n{}", self.log())
    }
}

impl Drop for Other {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The store id in the header of the log of the store in `state`, as the
/// agent prints it.
fn store_id(state: &Path) -> anyhow::Result<String> {
    let wal = std::fs::read(state.join("lockstep.wal"))
        .with_context(|| format!("no store log in {}", state.display()))?;
    let id = u64::from_le_bytes(wal.get(16..24).context("short log")?.try_into()?);
    Ok(format!("{id:016x}"))
}

/// The id of the map pinned at `pin` (`None`: no such pin).
fn pinned_id(pin: &Path) -> Option<u64> {
    let out = sh(
        "bpftool",
        ["-j", "map", "show", "pinned", &pin.display().to_string()],
    )
    .ok()?;
    serde_json::from_str::<serde_json::Value>(&out).ok()?["id"].as_u64()
}

/// The id of every map pin under `pins`.
fn map_ids(pins: &Path) -> anyhow::Result<BTreeMap<String, u64>> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(pins.join("maps"))? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        out.insert(
            name.clone(),
            pinned_id(&e.path()).with_context(|| format!("pin {name} is no map"))?,
        );
    }
    Ok(out)
}

/// The ids of the maps the pinned `from_endpoint` program uses.
fn program_map_ids(pins: &Path) -> anyhow::Result<BTreeSet<u64>> {
    let out = sh(
        "bpftool",
        [
            "-j",
            "prog",
            "show",
            "pinned",
            &pins.join("progs/from_endpoint").display().to_string(),
        ],
    )?;
    let v: serde_json::Value = serde_json::from_str(&out)?;
    Ok(v["map_ids"]
        .as_array()
        .context("bpftool printed no map_ids")?
        .iter()
        .filter_map(serde_json::Value::as_u64)
        .collect())
}

fn allocate(agent: &AgentProc, name: &str) -> anyhow::Result<String> {
    let v = agent.json([
        "allocate", "--kind", "endpoint", "--name", name, "--family", "ipv4", "-o", "json",
    ])?;
    Ok(v["address"].as_str().context("no address")?.to_string())
}

/// The /32 host entries in the pinned IPCACHE maps.
fn host_entries(agent: &AgentProc) -> anyhow::Result<BTreeSet<String>> {
    let dump = agent.maps_dump()?;
    Ok(dump["IPCACHE_V4"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e["prefix"].as_str()?.strip_suffix("/32"))
        .map(str::to_string)
        .collect())
}

fn text(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr)
}

/// The first agent still serves and owns its entries, several reconcile
/// intervals after a refused second agent.
fn first_intact(agent: &AgentProc, held: &BTreeSet<String>) -> anyhow::Result<()> {
    for _ in 0..5 {
        std::thread::sleep(INTERVAL);
        let entries = host_entries(agent)?;
        ensure!(
            held.is_subset(&entries),
            "the first agent's entries went: held {held:?}, in the maps {entries:?}"
        );
    }
    let verify = agent.cli(["verify"])?;
    ensure!(verify.status.success(), "{}", text(&verify));
    ensure!(
        agent.json(["status", "-o", "json"])?["ready"] == true,
        "the first agent is not ready"
    );
    Ok(())
}

#[test]
fn a_second_agent_on_the_same_pin_root_is_refused_naming_both() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("pinown")?;
    let mut first = AgentProc::start(&node, POOL)?;
    let mut held = BTreeSet::new();
    for i in 0..3 {
        held.insert(allocate(&first, &format!("first-{i}"))?);
    }
    let first_id = store_id(&first.dir.path().join("state"))?;
    // The record: a pinned, frozen map, root-only.
    let record = first.pins.path().join("owner");
    let meta = std::fs::symlink_metadata(&record).context("no owner record")?;
    ensure!(
        meta.file_type().is_file() && meta.permissions().mode() & 0o777 == 0o600,
        "owner record mode {:o}",
        meta.permissions().mode()
    );
    let shown: serde_json::Value = serde_json::from_str(&sh(
        "bpftool",
        ["-j", "map", "show", "pinned", &record.display().to_string()],
    )?)?;
    ensure!(
        shown["name"] == "lockstep_owner" && shown["frozen"] == 1,
        "{shown}"
    );
    for (datapath, how) in [
        ("", "without migrate"),
        (
            "migrate = true\nendpoints_max_entries = 4096",
            "with migrate",
        ),
    ] {
        let maps_before = map_ids(first.pins.path())?;
        let mut second = Other::spawn(&node, first.pins.path(), datapath, &[])?;
        let log = second
            .refused(Duration::from_secs(10))
            .with_context(|| how.to_string())?;
        let second_id = store_id(&second.state())?;
        for want in [
            "belongs to another agent".to_string(),
            first_id.clone(),
            first.dir.path().join("state").display().to_string(),
            second_id.clone(),
            second.state().display().to_string(),
            "--take-over-pin-root".to_string(),
        ] {
            ensure!(log.contains(&want), "{how}: {want} is not named:\n{log}");
        }
        ensure!(
            map_ids(first.pins.path())? == maps_before,
            "{how}: the refused agent replaced pinned maps"
        );
        first_intact(&first, &held).with_context(|| how.to_string())?;
    }
    // The same agent (same store) restarts on its pin root, an upgrade that
    // migrates a changed capacity included.
    first.kill9();
    first.rewrite_config(|t| {
        t.replace(
            "[datapath]\n",
            "[datapath]\nmigrate = true\nendpoints_max_entries = 4096\n",
        )
    })?;
    first.restart()?;
    first_intact(&first, &held)?;
    Ok(())
}

#[test]
fn a_stale_owner_is_refused_until_taken_over() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("pinstale")?;
    let mut first = AgentProc::start(&node, POOL)?;
    allocate(&first, "gone")?;
    let old_state = first.dir.path().join("state");
    let old_id = store_id(&old_state)?;
    first.stop()?;
    std::fs::remove_dir_all(&old_state)?;
    let mut second = Other::spawn(&node, first.pins.path(), "", &[])?;
    let log = second.refused(Duration::from_secs(10))?;
    for want in [old_id.as_str(), "stale", "take-over"] {
        ensure!(log.contains(want), "{want} is not named:\n{log}");
    }
    let mut third = Other::spawn(&node, first.pins.path(), "", &["--take-over-pin-root"])?;
    third.wait_ready()?;
    let verify = third.cli(&["verify"])?;
    ensure!(verify.status.success(), "{}", text(&verify));
    Ok(())
}

#[test]
fn a_symlink_at_the_owner_record_is_refused_not_followed() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("pinlink")?;
    let pins = lockstep_tests::PinRoot::new();
    std::fs::create_dir_all(pins.path())?;
    let target = pins.path().join("elsewhere");
    std::os::unix::fs::symlink(&target, pins.path().join("owner"))?;
    let mut agent = Other::spawn(&node, pins.path(), "", &[])?;
    let log = agent.refused(Duration::from_secs(10))?;
    ensure!(
        log.contains("is not a lockstep owner record") && log.contains("symbolic link"),
        "{log}"
    );
    ensure!(
        !target.exists() && !pins.path().join("maps").exists(),
        "the refused agent wrote under the pin root"
    );
    std::fs::remove_file(pins.path().join("owner"))?;
    Ok(())
}

#[test]
fn a_take_over_stops_the_first_agent_writing() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("pintake")?;
    let first = AgentProc::start(&node, POOL)?;
    allocate(&first, "before")?;
    let mut second = Other::spawn(&node, first.pins.path(), "", &["--take-over-pin-root"])?;
    second.wait_ready()?;
    let second_id = store_id(&second.state())?;
    // The first notices at its next check and refuses changes.
    let status = wait_for("the first agent to go not ready", 10 * INTERVAL, || {
        let s = first.status_json()?;
        (s["ready"] == false).then_some(s)
    })?;
    let reason = status["reason"].as_str().unwrap_or_default().to_string();
    ensure!(
        reason.contains("lost pin root") && reason.contains(&second_id),
        "{reason}"
    );
    let refused = first.cli([
        "allocate", "--kind", "endpoint", "--name", "after", "--family", "ipv4",
    ])?;
    ensure!(
        !refused.status.success() && text(&refused).contains("lost pin root"),
        "the first agent still allocates: {}",
        text(&refused)
    );
    let verify = first.cli(["verify"])?;
    ensure!(!verify.status.success(), "{}", text(&verify));
    // The second's entries stay through several of the first's intervals.
    let v = second.cli(&[
        "allocate", "--kind", "endpoint", "--name", "second", "--family", "ipv4", "-o", "json",
    ])?;
    ensure!(v.status.success(), "{}", text(&v));
    let address = serde_json::from_slice::<serde_json::Value>(&v.stdout)?["address"]
        .as_str()
        .context("no address")?
        .to_string();
    for _ in 0..5 {
        std::thread::sleep(INTERVAL);
        ensure!(
            host_entries(&first)?.contains(&address),
            "the first agent removed the second's entry {address}"
        );
    }
    let verify = second.cli(&["verify"])?;
    ensure!(verify.status.success(), "{}", text(&verify));
    Ok(())
}

/// Lines of the metrics page of the only agent in `node`.
fn metrics(node: &Netns) -> anyhow::Result<String> {
    node.exec(
        "sh",
        [
            "-c",
            "curl -s http://$(ss -ltnH | awk '{print $4}' | head -1)/metrics",
        ],
    )
}

/// Breaks the pin of IPCACHE_HOST_V4 with `break_it`, then checks what
/// verify, status and the next tick make of it.
fn pin_fault(
    tag: &str,
    kind: &str,
    break_it: impl FnOnce(&Path) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let node = Netns::new(tag)?;
    // A slow tick: its first run comes 4 s after start, well after the
    // checks below, so verify and status are read before it repairs.
    let agent = AgentProc::start(&node, &POOL.replace("200ms", "4s"))?;
    let mut held = BTreeSet::new();
    for i in 0..3 {
        held.insert(allocate(&agent, &format!("pin-{i}"))?);
    }
    let pin = agent.pins.path().join("maps/IPCACHE_HOST_V4");
    let program_id = pinned_id(&pin).context("no pin")?;
    ensure!(program_map_ids(agent.pins.path())?.contains(&program_id));
    break_it(&pin)?;
    // Allocations go on into the programs' map meanwhile.
    held.insert(allocate(&agent, "during")?);
    let verify = agent.cli(["verify"])?;
    let said = text(&verify);
    ensure!(
        !verify.status.success() && said.contains("IPCACHE_HOST_V4") && said.contains(kind),
        "verify does not name the {kind} pin: {said}"
    );
    let status = agent.status_json().context("no status")?;
    ensure!(
        status["ready"] == false
            && status["reason"]
                .as_str()
                .is_some_and(|r| r.contains("IPCACHE_HOST_V4")),
        "status while the pin is {kind}: {status}"
    );
    wait_for(
        "the tick to repair the pin",
        Duration::from_secs(10),
        || (pinned_id(&pin) == Some(program_id)).then_some(()),
    )?;
    ensure!(
        program_map_ids(agent.pins.path())?.contains(&program_id),
        "the programs changed map"
    );
    let entries = host_entries(&agent)?;
    ensure!(
        held.is_subset(&entries),
        "entries not back: held {held:?}, pinned {entries:?}"
    );
    let verify = agent.cli(["verify"])?;
    ensure!(verify.status.success(), "{}", text(&verify));
    let status = agent.json(["status", "-o", "json"])?;
    ensure!(
        status["ready"] == true && status["pin_repairs"] == 1,
        "{status}"
    );
    let m = metrics(&node)?;
    ensure!(
        m.contains("lockstep_pin_repairs_total{map=\"IPCACHE_HOST_V4\"} 1"),
        "{m}"
    );
    Ok(())
}

#[test]
fn a_removed_pin_is_named_repaired_and_counted() -> anyhow::Result<()> {
    privileged!();
    pin_fault("pinrm", "removed", |pin| {
        std::fs::remove_file(pin)?;
        Ok(())
    })
}

#[test]
fn a_pin_replaced_by_a_map_of_the_same_definition_is_found_by_id() -> anyhow::Result<()> {
    privileged!();
    pin_fault("pinswap", "replaced", |pin| {
        let show = sh(
            "bpftool",
            ["-j", "map", "show", "pinned", &pin.display().to_string()],
        )?;
        let def: serde_json::Value = serde_json::from_str(&show)?;
        // Made beside it and renamed over it: the path never lacks a pin.
        let temp = pin.with_file_name("impostor");
        let num = |k: &str| {
            def[k]
                .as_u64()
                .map(|n| n.to_string())
                .context(k.to_string())
        };
        sh(
            "bpftool",
            [
                "map",
                "create",
                &temp.display().to_string(),
                "type",
                "hash",
                "key",
                &num("bytes_key")?,
                "value",
                &num("bytes_value")?,
                "entries",
                &num("max_entries")?,
                "name",
                "IPCACHE_HOST_V4",
                "flags",
                &num("flags")?,
            ],
        )?;
        std::fs::rename(&temp, pin)?;
        Ok(())
    })
}
