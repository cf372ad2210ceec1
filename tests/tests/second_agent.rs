//! A second agent started on a running agent's state directory and pin
//! root is refused by the store's lock before it touches any pin, even
//! with `migrate` set and a map definition that differs (which would make
//! it replace the pinned map the running agent and its programs use).

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use lockstep_tests::{AgentProc, Netns, lockstep_bin, privileged, sh};

const POOL: &str = r#"
reconcile_interval = "60s"
default_pool = "second"
[[pools]]
name = "second"
ipv4 = ["10.65.0.0/24"]
"#;

/// The id of the map pinned at `path`.
fn map_id(path: &std::path::Path) -> anyhow::Result<u64> {
    let out = sh(
        "bpftool",
        ["-j", "map", "show", "pinned", &path.display().to_string()],
    )?;
    let v: serde_json::Value = serde_json::from_str(&out)?;
    v["id"].as_u64().context("bpftool printed no map id")
}

#[test]
fn a_second_agent_on_the_same_state_is_refused_before_it_migrates_pins() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("second")?;
    let agent = AgentProc::start(&node, POOL)?;
    let endpoints = agent.pins.path().join("maps/ENDPOINTS");
    let before = map_id(&endpoints)?;

    let config = agent.dir.path().join("second.toml");
    std::fs::write(
        &config,
        format!(
            "state_dir = \"{state}\"\nsocket = \"{sock}\"\nmetrics_addr = \"127.0.0.1:0\"\n{POOL}\n\
             [datapath]\npin_root = \"{pins}\"\nmigrate = true\nendpoints_max_entries = 4096\n",
            state = agent.dir.path().join("state").display(),
            sock = agent.dir.path().join("second.sock").display(),
            pins = agent.pins.path().display(),
        ),
    )?;
    let mut second = Command::new("nsenter")
        .arg(format!("--net={}", node.path().display()))
        .arg("--")
        .arg(lockstep_bin())
        .args(["agent", "--config"])
        .arg(&config)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let started = Instant::now();
    let status = loop {
        if let Some(status) = second.try_wait()? {
            break status;
        }
        if started.elapsed() > Duration::from_secs(20) {
            let _ = second.kill();
            let _ = second.wait();
            bail!("a second agent on the same state directory kept running");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = second.wait_with_output()?;
    let stderr =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    ensure!(
        !status.success(),
        "the second agent exited cleanly:\n{stderr}"
    );
    ensure!(
        stderr.contains("held by another process"),
        "refused for another reason than the store's lock:\n{stderr}"
    );
    let after = map_id(&endpoints)?;
    ensure!(
        before == after,
        "the refused agent replaced the pinned ENDPOINTS map (id {before} → {after})"
    );
    let verify = agent.cli(["verify"])?;
    ensure!(
        verify.status.success(),
        "the running agent's maps drifted: {}",
        String::from_utf8_lossy(&verify.stdout)
    );
    Ok(())
}
