//! A private podman for the integration tests: its own storage, run root,
//! tmp dir, `containers.conf` (CNI backend), CNI plugin and conflist
//! directories, so nothing of the machine's podman or CNI configuration is
//! read or written. The pods' image is a busybox rootfs imported from the
//! local `busybox-static`; no registry is involved.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use anyhow::{Context, ensure};
use serde_json::Value;

use crate::{TempDir, sh};

/// The busybox image every [`Podman`] imports.
pub const IMAGE: &str = "localhost/lockstep-busybox";

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Fails with the output when `out` is a failure; stdout otherwise.
///
/// # Errors
/// The command failed.
pub fn ok(what: &str, out: Output) -> anyhow::Result<String> {
    ensure!(
        out.status.success(),
        "{what} failed ({}):\nstdout: {}\nstderr: {}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
    Ok(text(&out.stdout))
}

/// A private podman: its own storage, run root, tmp dir, containers.conf,
/// CNI plugin and conflist directories. Removes its containers, images and
/// mounts on drop.
pub struct Podman {
    dir: TempDir,
    conf: PathBuf,
    /// The network namespace podman runs in (`nsenter --net`), if not the
    /// machine's root namespace: CNI plugins run where the runtime runs, so
    /// chained plugins that program the host (portmap's iptables rules,
    /// bandwidth's qdiscs) program this namespace instead.
    netns: Option<PathBuf>,
    /// The CNI plugin directory podman searches (first).
    pub bin_dir: PathBuf,
    /// The directory of podman's CNI network configs.
    pub net_dir: PathBuf,
}

impl Podman {
    /// Sets up the directories and imports the busybox image.
    ///
    /// # Errors
    /// A directory, the config or the import failed.
    pub fn new() -> anyhow::Result<Self> {
        let dir = TempDir::new("podman")?;
        let bin_dir = dir.path().join("cni-bin");
        let net_dir = dir.path().join("net.d");
        let tmp = dir.path().join("tmp");
        for d in [&bin_dir, &net_dir, &tmp] {
            std::fs::create_dir_all(d)?;
        }
        let conf = dir.path().join("containers.conf");
        std::fs::write(
            &conf,
            format!(
                "[network]\nnetwork_backend = \"cni\"\ncni_plugin_dirs = [\"{bin}\", \"/usr/lib/cni\"]\n\
                 network_config_dir = \"{net}\"\n\n[engine]\nruntime = \"runc\"\n\
                 tmp_dir = \"{tmp}\"\nevents_logger = \"file\"\n",
                bin = bin_dir.display(),
                net = net_dir.display(),
                tmp = tmp.display(),
            ),
        )?;
        let podman = Self {
            dir,
            conf,
            netns: None,
            bin_dir,
            net_dir,
        };
        podman.import_image()?;
        Ok(podman)
    }

    fn import_image(&self) -> anyhow::Result<()> {
        let rootfs = self.dir.path().join("rootfs");
        let bin = rootfs.join("bin");
        for d in ["bin", "tmp", "etc", "proc", "sys", "dev"] {
            std::fs::create_dir_all(rootfs.join(d))?;
        }
        std::fs::copy("/bin/busybox", bin.join("busybox"))
            .context("copying /bin/busybox (package busybox-static)")?;
        for applet in sh("/bin/busybox", ["--list"])?.lines() {
            if applet != "busybox" && !applet.is_empty() {
                std::os::unix::fs::symlink("busybox", bin.join(applet))?;
            }
        }
        let mut tar = Command::new("tar")
            .arg("-C")
            .arg(&rootfs)
            .args(["-c", "."])
            .stdout(Stdio::piped())
            .spawn()?;
        let tar_out = tar.stdout.take().context("tar stdout")?;
        let out = self
            .command()
            .args(["import", "-q", "-", IMAGE])
            .stdin(tar_out)
            .output()?;
        ensure!(tar.wait()?.success(), "tar of the rootfs failed");
        ok("podman import", out)?;
        std::fs::remove_dir_all(&rootfs)?;
        Ok(())
    }

    /// `podman` with the private config and storage.
    pub fn command(&self) -> Command {
        let mut cmd = match &self.netns {
            Some(ns) => {
                let mut cmd = Command::new("nsenter");
                cmd.arg(format!("--net={}", ns.display()))
                    .args(["--", "podman"]);
                cmd
            }
            None => Command::new("podman"),
        };
        cmd.env("CONTAINERS_CONF", &self.conf)
            .arg("--root")
            .arg(self.dir.path().join("storage"))
            .arg("--runroot")
            .arg(self.dir.path().join("run"))
            .args(["--runtime", "runc"]);
        cmd
    }

    /// Runs podman with `args`, raw output.
    ///
    /// # Errors
    /// It could not be started.
    pub fn output<I, S>(&self, args: I) -> anyhow::Result<Output>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<std::ffi::OsStr>,
    {
        Ok(self.command().args(args).output()?)
    }

    /// Runs podman with `args`; fails when it fails.
    ///
    /// # Errors
    /// It failed.
    pub fn ok<I, S>(&self, args: I) -> anyhow::Result<String>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<std::ffi::OsStr>,
    {
        ok("podman", self.output(args)?)
    }

    /// `podman run` of a sleeping busybox on `network`, raw output.
    ///
    /// # Errors
    /// podman could not be started.
    pub fn try_run(&self, network: &str, name: &str) -> anyhow::Result<Output> {
        self.try_run_with(network, name, &[], &[])
    }

    /// From now on, runs podman (and so the CNI plugins it calls) inside the
    /// network namespace at `path` (the test's node), not the root one.
    pub fn enter(&mut self, path: &Path) {
        self.netns = Some(path.to_path_buf());
    }

    /// [`Podman::try_run`] with more `podman run` options (`-p 8080:80`)
    /// and a command other than `sleep 300`, if `command` is not empty.
    ///
    /// # Errors
    /// podman could not be started.
    pub fn try_run_with(
        &self,
        network: &str,
        name: &str,
        extra: &[&str],
        command: &[&str],
    ) -> anyhow::Result<Output> {
        let mut args = vec!["run", "-d", "--name", name, "--network", network];
        args.extend_from_slice(extra);
        args.extend([
            "--ulimit",
            "nofile=1024:1024",
            "--ulimit",
            "nproc=1024:1024",
            IMAGE,
        ]);
        if command.is_empty() {
            args.extend(["sleep", "300"]);
        } else {
            args.extend_from_slice(command);
        }
        self.output(args)
    }

    /// Starts a container; returns its full ID.
    ///
    /// # Errors
    /// `podman run` failed.
    pub fn run(&self, network: &str, name: &str) -> anyhow::Result<String> {
        let id = ok("podman run", self.try_run(network, name)?)?;
        Ok(id.trim().to_string())
    }

    /// `podman exec <name> <args>`, raw output.
    ///
    /// # Errors
    /// podman could not be started.
    pub fn exec(&self, name: &str, args: &[&str]) -> anyhow::Result<Output> {
        let mut all = vec!["exec", name];
        all.extend_from_slice(args);
        self.output(all)
    }

    /// The container's addresses on `network` as podman reports them.
    ///
    /// # Errors
    /// podman failed or reports none.
    pub fn addresses(&self, name: &str, network: &str) -> anyhow::Result<Vec<IpAddr>> {
        let out = self.ok([
            "inspect",
            "--format",
            "{{json .NetworkSettings.Networks}}",
            name,
        ])?;
        let v: Value = serde_json::from_str(out.trim())?;
        let net = &v[network];
        let mut addrs = Vec::new();
        for key in ["IPAddress", "GlobalIPv6Address"] {
            if let Some(a) = net[key].as_str().filter(|a| !a.is_empty()) {
                addrs.push(a.parse()?);
            }
        }
        ensure!(
            !addrs.is_empty(),
            "podman reports no address for {name}: {v}"
        );
        Ok(addrs)
    }

    /// Names of all containers (running or not).
    ///
    /// # Errors
    /// `podman ps` failed.
    pub fn names(&self) -> anyhow::Result<BTreeSet<String>> {
        Ok(self
            .ok(["ps", "-a", "--format", "{{.Names}}"])?
            .lines()
            .map(str::to_string)
            .collect())
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        let _ = self.output(["rm", "-a", "-f", "-t", "0"]);
        let _ = self.output(["rmi", "-a", "-f"]);
        // Whatever storage mounts are left (deepest first), then the files.
        let root = self.dir.path().display().to_string();
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
        let mut ours: Vec<&str> = mounts
            .lines()
            .filter_map(|l| l.split_whitespace().nth(1))
            .filter(|m| m.starts_with(&root))
            .collect();
        ours.sort_by_key(|m| std::cmp::Reverse(m.len()));
        for m in ours {
            let _ = Command::new("umount").arg("-l").arg(m).output();
        }
    }
}

impl Podman {
    /// The private directory (storage, run root, configs).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// `podman build` of `context` (its `Containerfile`) as `tag`, never
    /// pulling; returns the image's size in bytes.
    ///
    /// # Errors
    /// The build or the inspection failed.
    pub fn build(&self, context: &Path, tag: &str) -> anyhow::Result<u64> {
        let mut args: Vec<std::ffi::OsString> = ["build", "--pull=never", "--quiet", "--tag", tag]
            .iter()
            .map(Into::into)
            .collect();
        args.push("--file".into());
        args.push(context.join("Containerfile").into());
        args.push(context.into());
        self.ok(args)?;
        let size = self.ok(["image", "inspect", "--format", "{{.Size}}", tag])?;
        size.trim().parse().context("image size")
    }
}

/// An agent's config for the CNI tests: pool `pods` with `v4`/`v6`, no
/// periodic reconcile, and the CNI install of `network` into `bin`/`conf`.
///
/// The conflist says `cniVersion = "1.0.0"`: the agent's default, 1.1.0, is
/// newer than podman 4.3.1's libcni (1.1.2) understands: it runs the plugin,
/// then fails with `unsupported CNI result version "1.1.0"`.
pub fn cni_agent_toml(bin: &Path, conf: &Path, network: &str, v4: &str, v6: &str) -> String {
    format!(
        r#"
reconcile_interval = "1h"
[[pools]]
name = "pods"
ipv4 = ["{v4}"]
ipv6 = ["{v6}"]

[cni]
install = true
bin_dir = "{bin}"
conf_dir = "{conf}"
conflist_name = "{network}.conflist"
network_name = "{network}"
cni_version = "1.0.0"
"#,
        bin = bin.display(),
        conf = conf.display(),
    )
}

/// The node namespace an agent runs in for the podman and CNI-chain tests:
/// an address of each family on `lo` (outside the pool) and forwarding on.
///
/// # Errors
/// The namespace, an address or a sysctl could not be made.
pub fn node_netns(v4: &str, v6: &str) -> anyhow::Result<crate::Netns> {
    let node = crate::Netns::new("node")?;
    node.ip(["addr", "add", &format!("{v4}/32"), "dev", "lo"])?;
    node.ip(["-6", "addr", "add", &format!("{v6}/128"), "dev", "lo"])?;
    node.sysctl("net.ipv4.ip_forward", "1")?;
    node.sysctl("net.ipv6.conf.all.forwarding", "1")?;
    Ok(node)
}
