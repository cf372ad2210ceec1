//! `lockstep agent` with no configuration file runs on the embedded default:
//! one local pool, the default paths. The test gives it those paths in a
//! private mount namespace (tmpfs over /var/lib and /run, a fresh bpffs
//! instance at /sys/fs/bpf, /etc/lockstep hidden), so nothing of the
//! machine's is touched and everything vanishes with the namespace.

use anyhow::Context;
use lockstep_tests::{Netns, lockstep_bin, privileged};

#[test]
fn the_agent_runs_with_no_config_on_the_embedded_default() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("node")?;
    let bin = lockstep_bin();
    let bin = bin.to_str().context("utf-8")?;
    let script = format!(
        r#"set -e
mount -t tmpfs none /var/lib
mount -t tmpfs none /run
mount -t bpf bpf /sys/fs/bpf
if [ -d /etc/lockstep ]; then mount -t tmpfs none /etc/lockstep; fi
{bin} agent >/run/agent.log 2>&1 &
agent=$!
for i in $(seq 200); do {bin} status >/dev/null 2>&1 && break; sleep 0.05; done
{bin} status -o json
{bin} allocate --name no-config --family ipv4 -o json
{bin} allocate --name no-config-6 --family ipv6 -o json
{bin} pools -o json
{bin} verify
kill -TERM $agent
wait $agent
echo "exit=$?"
"#
    );
    let out = node
        .command("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c", &script])
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = text.lines().collect();
    let status: serde_json::Value = serde_json::from_str(lines[0])?;
    assert_eq!(status["ready"], true, "{text}");
    let v4: serde_json::Value = serde_json::from_str(lines[1])?;
    let v6: serde_json::Value = serde_json::from_str(lines[2])?;
    assert!(
        v4["address"]
            .as_str()
            .is_some_and(|a| a.starts_with("10.244.")),
        "{v4}"
    );
    assert!(
        v6["address"]
            .as_str()
            .is_some_and(|a| a.starts_with("fd00:10:244::")),
        "{v6}"
    );
    let pools: serde_json::Value = serde_json::from_str(lines[3])?;
    assert_eq!(pools[0]["name"], "default", "{pools}");
    assert!(
        text.contains("verify: store, core and maps agree"),
        "{text}"
    );
    assert!(text.contains("exit=0"), "SIGTERM is a clean exit: {text}");
    Ok(())
}

#[test]
fn allocate_and_release_without_a_pool_use_the_configured_default_pool() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("defpool")?;
    let agent = lockstep_tests::AgentProc::start(
        &node,
        r#"default_pool = "second"
[[pools]]
name = "first"
ipv4 = ["10.65.0.0/24"]
[[pools]]
name = "second"
ipv4 = ["10.65.1.0/24"]
"#,
    )?;
    let a = agent.json([
        "allocate", "--name", "no-pool", "--family", "ipv4", "-o", "json",
    ])?;
    anyhow::ensure!(
        a["pool"] == "second"
            && a["address"]
                .as_str()
                .is_some_and(|s| s.starts_with("10.65.1.")),
        "the configured default pool, not one named 'default': {a}"
    );
    let out = agent.cli(["release", "--name", "no-pool", "--family", "ipv4"])?;
    anyhow::ensure!(
        out.status.success(),
        "release without --pool: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}
