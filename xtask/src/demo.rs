//! The three demos (`cargo xtask demo [--cluster | --kubernetes]`), run by
//! a user as the README's first command and by `cargo xtask test` after
//! the integration tests.
//!
//! Why `test` runs them: a demo no test runs breaks unseen. One did: the
//! README's first command failed on every fresh machine (its masquerade
//! step wrote a map value in a layout the map no longer had) while every
//! CI run stayed green. Each demo script checks what each of its steps
//! claims and exits non-zero at the first that does not hold.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::Context;

/// One of the demos.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Demo {
    /// A node made of namespaces: the datapath tools, then the agent.
    Node,
    /// Three nodes and a 3-member etcd.
    Cluster,
    /// A LoadBalancer Service through the Kubernetes API (the double).
    Kubernetes,
}

impl Demo {
    /// Every demo, in the order `test` runs them.
    pub const ALL: [Demo; 3] = [Demo::Node, Demo::Cluster, Demo::Kubernetes];

    /// The command a user runs.
    pub fn command(self) -> &'static str {
        match self {
            Demo::Node => "cargo xtask demo",
            Demo::Cluster => "cargo xtask demo --cluster",
            Demo::Kubernetes => "cargo xtask demo --kubernetes",
        }
    }

    fn script(self) -> &'static str {
        match self {
            Demo::Node => "deploy/demo.sh",
            Demo::Cluster => "deploy/demo-cluster.sh",
            Demo::Kubernetes => "deploy/demo-kubernetes.sh",
        }
    }
}

/// Runs `demo` with the staged `agent` (the Kubernetes demo builds the API
/// double first).
///
/// # Errors
/// A step of the demo failed or did not show what it claims.
pub fn run(demo: Demo, agent: &Path) -> anyhow::Result<()> {
    if demo == Demo::Kubernetes {
        crate::run(crate::cargo().args(["build", "-p", "lockstep-tests", "--bin", "kube-double"]))?;
    }
    crate::run(
        Command::new("bash")
            .arg(crate::root().join(demo.script()))
            .env("LOCKSTEP_BIN", agent)
            .env(
                "KUBE_DOUBLE_BIN",
                crate::root().join("target/debug/kube-double"),
            ),
    )
    .with_context(|| format!("`{}` failed", demo.command()))
}

/// Runs every demo as `cargo xtask test` does: each one's outcome and time
/// printed, every one run even when an earlier one failed. Skipped, saying
/// so, with `LOCKSTEP_SKIP_PRIVILEGED=1` (they need root and namespaces).
///
/// # Errors
/// A demo failed.
pub fn all(agent: &Path, tally: &mut crate::Tally) -> anyhow::Result<()> {
    if std::env::var_os("LOCKSTEP_SKIP_PRIVILEGED").is_some_and(|v| v == "1") {
        println!("demos: SKIPPED (LOCKSTEP_SKIP_PRIVILEGED=1): the three demos were not run");
        return Ok(());
    }
    let mut failed = Vec::new();
    for demo in Demo::ALL {
        let started = Instant::now();
        let outcome = run(demo, agent);
        let took = started.elapsed().as_secs_f64();
        match outcome {
            Ok(()) => {
                tally.passed += 1;
                println!("demo `{}`: passed in {took:.1} s", demo.command());
            }
            Err(e) => {
                tally.failed += 1;
                println!("demo `{}`: FAILED in {took:.1} s: {e:#}", demo.command());
                failed.push(demo.command());
            }
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        anyhow::bail!("demos failed: {}", failed.join(", "))
    }
}
