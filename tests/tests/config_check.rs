//! #45 item 5: `lockstep config check FILE` checks a config as the agent
//! would read it, without starting it, and names every value it refuses;
//! the shipped example and the DaemonSets' configs pass it.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, ensure};

fn root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// `lockstep config check FILE`: exit code and stdout.
fn check(file: &Path) -> anyhow::Result<(i32, String)> {
    let out = Command::new(lockstep_tests::lockstep_bin())
        .args(["config", "check"])
        .arg(file)
        .output()?;
    Ok((
        out.status.code().context("exit code")?,
        String::from_utf8_lossy(&out.stdout).into_owned(),
    ))
}

#[test]
fn every_refused_value_is_named_and_the_shipped_configs_pass() -> anyhow::Result<()> {
    let dir = lockstep_tests::TempDir::new("config-check")?;
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "state_dir = \"relative/state\"\nreconcile_interval = \"1ms\"\n\
         [[pools]]\nname = \"a\"\nipv4 = [\"10.0.0.0/24\"]\n\
         [[pools]]\nname = \"a\"\nipv4 = [\"10.1.0.0/24\"]\n\
         [masquerade]\nendpoint_share = 2.0\n",
    )?;
    let (code, out) = check(&bad)?;
    ensure!(code == 1, "exit {code}: {out}");
    for field in [
        "`reconcile_interval`",
        "`state_dir`",
        "`masquerade.endpoint_share`",
        "`pools[1].name`",
    ] {
        ensure!(out.contains(field), "{field} not named:\n{out}");
    }
    ensure!(out.contains("4 problems"), "{out}");

    // A syntax error or an unknown key: named with its line.
    std::fs::write(&bad, "reconcile_intervall = \"10s\"\n")?;
    let (code, out) = check(&bad)?;
    ensure!(
        code == 1 && out.contains("reconcile_intervall") && out.contains("line 1"),
        "exit {code}: {out}"
    );

    // What ships passes: the example and each DaemonSet's ConfigMap.
    let (code, out) = check(&root().join("deploy/config.example.toml"))?;
    ensure!(
        code == 0 && out.contains("valid"),
        "config.example.toml: {out}"
    );
    for manifest in ["deploy/daemonset.yaml", "deploy/daemonset-cluster.yaml"] {
        let text = std::fs::read_to_string(root().join(manifest))?;
        // The block under `config.toml: |`, four spaces in.
        let config: String = text
            .lines()
            .skip_while(|l| l.trim() != "config.toml: |")
            .skip(1)
            .take_while(|l| l.is_empty() || l.starts_with("    "))
            .map(|l| format!("{}\n", l.strip_prefix("    ").unwrap_or(l)))
            .collect();
        ensure!(
            config.contains("state_dir"),
            "{manifest}: no config.toml found"
        );
        let file = dir.path().join("configmap.toml");
        std::fs::write(&file, &config)?;
        let (code, out) = check(&file)?;
        ensure!(code == 0, "{manifest}'s config: {out}\n{config}");
    }
    Ok(())
}
