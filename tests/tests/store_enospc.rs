//! A full disk is a passing failure, not a wedge: the agent's state
//! directory is a small tmpfs; it is filled until commits fail, then freed.
//!
//! While it is full the agent must refuse changes with the real cause
//! ("No space left on device") and report not-ready with it; once space is
//! back it must recover by itself — no request needed, the periodic tick
//! does it — and become ready; and after a SIGKILL and restart it must hold
//! exactly what it acknowledged: every acknowledged allocation, none of the
//! refused ones.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use hyper::Method;
use lockstep::client::{ClientError, call};
use lockstep_tests::{AgentOptions, AgentProc, Netns, TempDir, privileged, sh, wait_for};
use serde_json::{Value, json};

const POOL: &str = "full";
const CONFIG: &str = r#"
reconcile_interval = "1s"
[[pools]]
name = "full"
ipv4 = ["10.62.0.0/16"]
"#;

/// A tmpfs of `size`, unmounted on drop.
struct Tmpfs {
    dir: TempDir,
}

impl Tmpfs {
    fn new(size: &str) -> anyhow::Result<Self> {
        let dir = TempDir::new("tmpfs")?;
        sh(
            "mount",
            [
                "-t".as_ref(),
                "tmpfs".as_ref(),
                "-o".as_ref(),
                format!("size={size},mode=0700").as_ref(),
                "lockstep-test".as_ref(),
                dir.path().as_os_str(),
            ] as [&std::ffi::OsStr; 6],
        )?;
        Ok(Self { dir })
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}

/// Writes zeros into `path` until the file system is full.
fn fill(path: &Path) -> anyhow::Result<u64> {
    use std::io::Write as _;
    let mut file = std::fs::File::create(path)?;
    let block = vec![0u8; 64 * 1024];
    let mut written = 0u64;
    loop {
        match file.write(&block) {
            Ok(0) => break,
            Ok(n) => written += n as u64,
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
            Err(e) => return Err(e.into()),
        }
    }
    // The last partial pages too.
    for _ in 0..64 {
        if file.write(&[0u8; 512]).is_err() {
            break;
        }
    }
    Ok(written)
}

fn allocate(rt: &tokio::runtime::Runtime, socket: &Path, name: &str) -> Result<Value, ClientError> {
    let body = json!({"pool": POOL, "family": "ipv4", "owner": {"owner": "resource", "kind": "enospc", "name": name}});
    rt.block_on(call(socket, Method::POST, "/v1/allocations", Some(body)))
}

fn held(rt: &tokio::runtime::Runtime, socket: &Path) -> anyhow::Result<BTreeMap<String, String>> {
    let all = rt.block_on(call(socket, Method::GET, "/v1/allocations", None))?;
    let mut out = BTreeMap::new();
    for a in all.as_array().context("allocations is not a list")? {
        out.insert(
            a["owner"]["name"].as_str().context("name")?.to_string(),
            a["address"].as_str().context("address")?.to_string(),
        );
    }
    Ok(out)
}

#[test]
fn a_full_disk_is_reported_then_recovered_from_without_loss() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("enospc")?;
    let fs = Tmpfs::new("8m")?;
    let state: PathBuf = fs.path().join("state");
    let mut agent = AgentProc::launch(
        &node,
        &AgentOptions {
            extra: CONFIG.to_string(),
            state_dir: Some(state.clone()),
            ..AgentOptions::default()
        },
    )?;
    let socket = agent.socket();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut acked: BTreeMap<String, String> = BTreeMap::new();
    for i in 0..50 {
        let name = format!("before-{i}");
        let v = allocate(&rt, &socket, &name)?;
        acked.insert(name, v["address"].as_str().context("address")?.to_string());
    }

    let filler = fs.path().join("filler");
    let filled = fill(&filler)?;
    eprintln!("filled the state file system with {filled} bytes");
    // Commits go to the preallocated log until a checkpoint into the
    // database needs space it cannot get; from then on they are refused.
    let mut refused = Vec::new();
    let mut message = String::new();
    for i in 0..3000 {
        let name = format!("full-{i}");
        match allocate(&rt, &socket, &name) {
            Ok(v) => {
                acked.insert(name, v["address"].as_str().context("address")?.to_string());
            }
            Err(ClientError::Api {
                status, message: m, ..
            }) => {
                ensure!(status == 500, "refused with {status}: {m}");
                refused.push(name);
                message = m;
                if refused.len() >= 5 {
                    break;
                }
            }
            Err(e) => bail!("allocation {name}: {e}"),
        }
    }
    ensure!(
        !refused.is_empty(),
        "3000 commits on a full file system all succeeded: the test did not fill it"
    );
    ensure!(
        message.contains("No space left on device"),
        "the refusal must name the cause: {message}"
    );
    let status = agent.status_json().context("status")?;
    ensure!(
        status["ready"] == false
            && status["reason"]
                .as_str()
                .is_some_and(|r| r.contains("No space left on device")),
        "not ready with the cause while the disk is full: {status}"
    );
    let verify = agent.cli(["verify"])?;
    ensure!(
        !verify.status.success(),
        "verify cannot read the store while it fails, and must say so"
    );

    std::fs::remove_file(&filler)?;
    // No request: the periodic tick (1 s) recovers the store.
    let took = std::time::Instant::now();
    wait_for(
        "the agent to recover by itself",
        Duration::from_secs(10),
        || {
            agent
                .status_json()
                .filter(|s| s["ready"] == true)
                .map(|_| ())
        },
    )?;
    eprintln!(
        "recovered {:?} after the space came back; {} refused while full",
        took.elapsed(),
        refused.len()
    );
    for i in 0..20 {
        let name = format!("after-{i}");
        let v = allocate(&rt, &socket, &name)?;
        acked.insert(name, v["address"].as_str().context("address")?.to_string());
    }

    for round in ["running", "after a SIGKILL and restart"] {
        let now = held(&rt, &socket)?;
        ensure!(
            now == acked,
            "{round}: the agent holds {} allocations, {} were acknowledged; missing: {:?}, extra: {:?}",
            now.len(),
            acked.len(),
            acked
                .keys()
                .filter(|k| !now.contains_key(*k))
                .collect::<Vec<_>>(),
            now.keys()
                .filter(|k| !acked.contains_key(*k))
                .collect::<Vec<_>>(),
        );
        for name in &refused {
            ensure!(!now.contains_key(name), "{round}: refused {name} is held");
        }
        let verify = agent.cli(["verify"])?;
        ensure!(
            verify.status.success(),
            "{round}: verify: {}{}",
            String::from_utf8_lossy(&verify.stdout),
            String::from_utf8_lossy(&verify.stderr)
        );
        if round == "running" {
            agent.restart()?;
        }
    }
    agent.stop()?;
    Ok(())
}
