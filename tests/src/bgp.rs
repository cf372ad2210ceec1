//! Real routing daemons for the BGP tests (#48): BIRD as the node's
//! speaker, and FRR (zebra, bgpd, bfdd) as the peer router whose own
//! routing table the tests read. Each runs in a namespace the test made,
//! in the foreground as a child of the test, and is killed on drop with
//! its files.

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::{Netns, TempDir, sh};

/// Waits until `path` exists, at most `within`.
fn wait_for(path: &Path, within: Duration, what: &str) -> anyhow::Result<()> {
    let started = Instant::now();
    while !path.exists() {
        if started.elapsed() > within {
            bail!("{what}: {} never appeared", path.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// Kills and reaps `children`.
fn kill_all(children: &mut Vec<Child>) {
    for c in children.iter_mut() {
        let _ = c.kill();
        let _ = c.wait();
    }
    children.clear();
}

/// BIRD in a namespace, reached through lockstep's door.
pub struct BirdProc {
    dir: TempDir,
    child: Vec<Child>,
}

impl BirdProc {
    /// Starts BIRD in `ns` with `config` as its file.
    ///
    /// # Errors
    /// BIRD refused the config or never opened its control socket.
    pub fn start(ns: &Netns, config: &str) -> anyhow::Result<Self> {
        let dir = TempDir::new("bird")?;
        let conf = dir.path().join("bird.conf");
        std::fs::write(&conf, config)?;
        let log = std::fs::File::create(dir.path().join("bird.log"))?;
        let child = ns
            .command("bird")
            .arg("-f")
            .arg("-c")
            .arg(&conf)
            .arg("-s")
            .arg(dir.path().join("bird.ctl"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting bird")?;
        let mut me = Self {
            dir,
            child: vec![child],
        };
        if let Err(e) = wait_for(&me.socket(), Duration::from_secs(10), "bird") {
            kill_all(&mut me.child);
            bail!("{e}\nbird's log:\n{}", me.log());
        }
        Ok(me)
    }

    /// The control socket.
    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("bird.ctl")
    }

    /// lockstep's door to it.
    pub fn door(&self) -> lockstep::bgp::Bird {
        lockstep::bgp::Bird::new(self.socket(), self.dir.path().join("bird.conf"))
    }

    /// What BIRD logged.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("bird.log")).unwrap_or_default()
    }
}

impl Drop for BirdProc {
    fn drop(&mut self) {
        kill_all(&mut self.child);
    }
}

/// FRR's zebra, bgpd and bfdd in a namespace: the peer router.
pub struct Frr {
    ns_name: String,
    dir: TempDir,
    children: Vec<Child>,
}

impl Frr {
    /// Starts the three daemons in `ns` and loads `config` (FRR's
    /// integrated syntax) through vtysh.
    ///
    /// # Errors
    /// A daemon did not start, or vtysh refused the config.
    pub fn start(ns: &Netns, config: &str) -> anyhow::Result<Self> {
        let dir = TempDir::new("frr")?;
        // The daemons drop to the frr user and make their sockets here.
        sh("chown", ["frr:frr", &dir.path().display().to_string()])?;
        let d = dir.path().to_path_buf();
        let mut me = Self {
            ns_name: ns.name().to_string(),
            dir,
            children: Vec::new(),
        };
        for daemon in ["zebra", "bgpd", "bfdd"] {
            let log = std::fs::File::create(d.join(format!("{daemon}.log")))?;
            let mut cmd = ns.command(format!("/usr/lib/frr/{daemon}"));
            cmd.arg("-f")
                .arg("/dev/null")
                .arg("-i")
                .arg(d.join(format!("{daemon}.pid")))
                .arg("--vty_socket")
                .arg(&d)
                .arg("-z")
                .arg(d.join("zserv.api"))
                .arg("-P")
                .arg("0");
            if daemon == "bfdd" {
                cmd.arg("--bfdctl").arg(d.join("bfdd.sock"));
            }
            let child = cmd
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .with_context(|| format!("starting {daemon}"))?;
            me.children.push(child);
            wait_for(
                &d.join(format!("{daemon}.vty")),
                Duration::from_secs(10),
                daemon,
            )?;
        }
        let file = d.join("frr.conf");
        std::fs::write(&file, config)?;
        me.vtysh_args(&["-f", &file.display().to_string()])?;
        Ok(me)
    }

    fn vtysh_args(&self, args: &[&str]) -> anyhow::Result<String> {
        let out = std::process::Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", self.ns_name))
            .arg("--")
            .arg("vtysh")
            .arg("--vty_socket")
            .arg(self.dir.path())
            .args(args)
            .output()
            .context("starting vtysh")?;
        if !out.status.success() {
            bail!(
                "vtysh {args:?} failed ({}): {}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// One vtysh command's output.
    ///
    /// # Errors
    /// vtysh failed.
    pub fn vtysh(&self, command: &str) -> anyhow::Result<String> {
        self.vtysh_args(&["-c", command])
    }

    /// `show bgp neighbors <addr> json`, for that neighbour.
    ///
    /// # Errors
    /// vtysh failed or answered no JSON for it.
    pub fn neighbor(&self, address: &str) -> anyhow::Result<serde_json::Value> {
        let out = self.vtysh(&format!("show bgp neighbors {address} json"))?;
        let v: serde_json::Value =
            serde_json::from_str(&out).with_context(|| format!("vtysh said {out}"))?;
        v.get(address)
            .cloned()
            .with_context(|| format!("no neighbour {address} in {out}"))
    }
}

impl Drop for Frr {
    fn drop(&mut self) {
        kill_all(&mut self.children);
    }
}

/// The routes the kernel of `ns` holds from BGP (`proto bgp`): prefix →
/// next hops.
///
/// # Errors
/// `ip route` failed.
pub fn bgp_routes(ns: &Netns) -> anyhow::Result<std::collections::BTreeMap<String, Vec<String>>> {
    let mut out = std::collections::BTreeMap::new();
    for family in ["-4", "-6"] {
        let text = ns.ip([family, "route", "show", "proto", "bgp"])?;
        let mut current: Option<String> = None;
        for line in text.lines() {
            let words: Vec<&str> = line.split_whitespace().collect();
            if !line.starts_with(char::is_whitespace) {
                let prefix = words.first().copied().unwrap_or_default().to_string();
                let hops: Vec<String> = words
                    .windows(2)
                    .filter(|w| w[0] == "via")
                    .map(|w| w[1].to_string())
                    .collect();
                out.insert(prefix.clone(), hops);
                current = Some(prefix);
            } else if let Some(p) = &current
                && let Some(i) = words.iter().position(|w| *w == "via")
                && let Some(hop) = words.get(i + 1)
            {
                // A multipath route: one `nexthop via` line per hop.
                out.entry(p.clone()).or_default().push((*hop).to_string());
            }
        }
    }
    Ok(out)
}
