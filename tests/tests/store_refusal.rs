//! A store that cannot be trusted is refused, never replaced: the agent stays
//! up and not ready, says why, and leaves the files and the maps alone until
//! an operator acts (docs/store.md, "Recovery").

use std::os::unix::fs::FileExt as _;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, ensure};
use lockstep_tests::{AgentProc, Netns, lockstep_bin, privileged, sh, wait_for};
use serde_json::Value;

const CONFIG: &str = r#"
reconcile_interval = "1s"
[[pools]]
name = "refuse"
ipv4 = ["10.63.0.0/24"]
"#;

fn flip(path: &Path, at: u64) -> anyhow::Result<()> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)?;
    let mut byte = [0u8; 1];
    file.read_exact_at(&mut byte, at)?;
    byte[0] ^= 0x10;
    file.write_all_at(&byte, at)?;
    file.sync_all()?;
    Ok(())
}

fn allocate(agent: &AgentProc, name: &str) -> anyhow::Result<Value> {
    agent.json([
        "allocate", "--kind", "resource", "--name", name, "--pool", "refuse", "--family", "ipv4",
        "-o", "json",
    ])
}

fn names(agent: &AgentProc) -> anyhow::Result<Vec<String>> {
    let all = agent.json(["allocations", "-o", "json"])?;
    let mut out: Vec<String> = all
        .as_array()
        .context("allocations is not a list")?
        .iter()
        .filter_map(|a| a["owner"]["name"].as_str().map(str::to_string))
        .collect();
    out.sort();
    Ok(out)
}

/// The pinned maps as `lockstep maps dump` reads them (agent up or not),
/// without the packet counters.
fn programmed(agent: &AgentProc) -> anyhow::Result<Value> {
    let mut dump = agent.maps_dump()?;
    dump.as_object_mut()
        .context("dump is not an object")?
        .remove("COUNTERS");
    Ok(dump)
}

/// Starts the agent on a store it must refuse; checks it stays up, not
/// ready, naming `why`, that requests are refused with that reason, and that
/// the maps are untouched; then stops it.
fn refused(agent: &mut AgentProc, why: &str, maps: &Value) -> anyhow::Result<()> {
    agent.kill9();
    agent.spawn_under::<[&str; 0], &str>([])?;
    let status = wait_for("a not-ready status", Duration::from_secs(20), || {
        agent
            .status_json()
            .filter(|s| s["reason"].as_str().is_some_and(|r| r.contains(why)))
    })?;
    ensure!(status["ready"] == false, "{status}");
    ensure!(
        status["reason"]
            .as_str()
            .is_some_and(|r| r.contains("docs/store.md")),
        "the reason points to the recovery steps: {status}"
    );
    std::thread::sleep(Duration::from_millis(300));
    ensure!(
        agent.exited()?.is_none(),
        "the agent stays up (no crash loop):\n{}",
        agent.log()
    );
    let out = agent.cli([
        "allocate", "--kind", "resource", "--name", "late", "--pool", "refuse", "--family", "ipv4",
    ])?;
    ensure!(
        !out.status.success() && String::from_utf8_lossy(&out.stderr).contains(why),
        "a request is refused with the reason: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(
        programmed(agent)? == *maps,
        "the maps are left as they were"
    );
    let status = agent.stop()?.context("was running")?;
    ensure!(!status.success(), "it exits with an error when stopped");
    Ok(())
}

#[test]
fn a_damaged_store_is_refused_not_replaced_and_recovery_works() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("refuse")?;
    let mut agent = AgentProc::start(&node, CONFIG)?;
    let state = agent.dir.path().join("state");
    for i in 0..5 {
        allocate(&agent, &format!("checkpointed-{i}"))?;
    }
    // A clean stop checkpoints; the next five stay in the log only.
    agent.stop()?;
    agent.restart()?;
    for i in 0..5 {
        allocate(&agent, &format!("logged-{i}"))?;
    }
    let all = names(&agent)?;
    ensure!(all.len() == 10, "{all:?}");
    let maps = programmed(&agent)?;

    // 1. A damaged log header.
    let log = state.join("lockstep.wal");
    flip(&log, 20)?;
    refused(&mut agent, "damaged header", &maps)?;
    flip(&log, 20)?;
    agent.restart()?;
    ensure!(names(&agent)? == all, "mended: every commit is back");

    // 2. A database redb cannot open.
    agent.kill9();
    let db = state.join("lockstep.redb");
    let saved = std::fs::read(&db)?;
    flip(&db, 0)?;
    refused(&mut agent, "cannot open the store", &maps)?;
    std::fs::write(&db, &saved)?;
    agent.restart()?;
    ensure!(names(&agent)? == all, "restored: every commit is back");

    // 3. The operator gives up the log: `lockstep store reset-log`. The
    // restart above checkpointed all ten; three more are in the log only.
    for i in 0..3 {
        allocate(&agent, &format!("given-up-{i}"))?;
    }
    agent.kill9();
    flip(&log, 20)?;
    let out = sh(
        lockstep_bin().to_str().context("path")?,
        [
            "store".as_ref(),
            "reset-log".as_ref(),
            "--state-dir".as_ref(),
            state.as_os_str(),
        ] as [&std::ffi::OsStr; 4],
    )?;
    ensure!(out.contains("moved the store log"), "{out}");
    ensure!(
        std::fs::read_dir(&state)?.filter_map(Result::ok).any(|e| e
            .file_name()
            .to_string_lossy()
            .starts_with("lockstep.wal.discarded-")),
        "the old log is kept"
    );
    agent.restart()?;
    ensure!(
        names(&agent)? == all,
        "after reset-log: the checkpointed ten, not the three given up"
    );
    let verify = agent.cli(["verify"])?;
    ensure!(verify.status.success(), "verify after reset-log");
    agent.stop()?;
    Ok(())
}
