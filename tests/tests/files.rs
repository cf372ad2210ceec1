//! The agent's files are root's alone, and nothing planted in its paths
//! redirects a write or a removal: checked against the real agent, with a
//! permissive umask, an unprivileged user (`setpriv`), and symlinks planted
//! before start.

use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use anyhow::{Context, ensure};
use lockstep_tests::{AgentProc, Netns, TempDir, lockstep_bin, privileged};

const POOLS: &str = r#"
[[pools]]
name = "files"
ipv4 = ["10.64.0.0/24"]
"#;

fn mode(path: &Path) -> anyhow::Result<u32> {
    Ok(std::fs::symlink_metadata(path)
        .with_context(|| format!("stat {}", path.display()))?
        .permissions()
        .mode()
        & 0o777)
}

/// Runs `program args` as the unprivileged user `nobody`.
fn as_nobody(program: &Path, args: &[&str]) -> anyhow::Result<Output> {
    Ok(Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(program)
        .args(args)
        .output()?)
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn under_umask_000_state_and_socket_are_root_only() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("files")?;
    let mut agent = AgentProc::start(&node, POOLS)?;
    // Again, from a shell whose umask grants everything to everyone.
    agent.kill9();
    agent.spawn_under(["sh", "-c", "umask 000; exec \"$0\" \"$@\""])?;
    agent.wait_ready()?;
    agent.json([
        "allocate", "--kind", "resource", "--name", "f1", "--pool", "files", "--family", "ipv4",
        "-o", "json",
    ])?;
    let state = agent.dir.path().join("state");
    ensure!(mode(&state)? == 0o700, "state dir {:o}", mode(&state)?);
    for file in ["lockstep.redb", "lockstep.wal"] {
        let m = mode(&state.join(file))?;
        ensure!(m == 0o600, "{file} is {m:o}");
    }
    let socket = agent.socket();
    ensure!(mode(&socket)? == 0o600, "socket {:o}", mode(&socket)?);
    // The agent's scratch dir is world-traversable, so only the modes stop
    // an unprivileged user.
    std::fs::set_permissions(agent.dir.path(), std::fs::Permissions::from_mode(0o755))?;
    let status = as_nobody(
        &lockstep_bin(),
        &["--socket", socket.to_str().context("path")?, "status"],
    )?;
    ensure!(
        !status.status.success() && text(&status).contains("ermission denied"),
        "an unprivileged user reached the API: {}",
        text(&status)
    );
    let read = as_nobody(
        Path::new("/bin/cat"),
        &[state.join("lockstep.redb").to_str().context("path")?],
    )?;
    ensure!(
        !read.status.success(),
        "an unprivileged user read the store"
    );
    // No bind directory is left beside the socket.
    let leftovers: Vec<String> = std::fs::read_dir(agent.dir.path())?
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".lockstep-bind"))
        .collect();
    ensure!(leftovers.is_empty(), "{leftovers:?}");
    agent.stop()?;
    ensure!(!socket.exists(), "a clean stop removes the socket");
    Ok(())
}

/// A config with its own state directory and socket, for starts that must
/// fail.
fn config(dir: &Path, state: &Path, socket: &Path, extra: &str) -> String {
    format!(
        "state_dir = \"{}\"\nsocket = \"{}\"\nmetrics_addr = \"127.0.0.1:0\"\n{POOLS}\n{extra}\n[datapath]\npin_root = \"/sys/fs/bpf/{}\"\n",
        state.display(),
        socket.display(),
        dir.file_name().unwrap_or_default().to_string_lossy()
    )
}

/// Starts an agent that must refuse to start; returns its output.
fn refused_start(node: &Netns, scratch: &TempDir, config_text: &str) -> anyhow::Result<String> {
    let path = scratch.path().join("config.toml");
    std::fs::write(&path, config_text)?;
    let out = Command::new("timeout")
        .args(["20", "nsenter"])
        .arg(format!("--net={}", node.path().display()))
        .arg("--")
        .arg(lockstep_bin())
        .args(["agent", "--config"])
        .arg(&path)
        .output()?;
    ensure!(
        !out.status.success() && out.status.code() != Some(124),
        "the agent should have refused to start: {}",
        text(&out)
    );
    Ok(text(&out))
}

#[test]
fn unsafe_state_dirs_and_planted_symlinks_are_refused() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("unsafe")?;
    let scratch = TempDir::new("unsafe")?;
    let pins = PathBuf::from("/sys/fs/bpf").join(
        scratch
            .path()
            .file_name()
            .context("name")?
            .to_string_lossy()
            .into_owned(),
    );
    let _cleanup = PinsGone(pins);
    let socket = scratch.path().join("api.sock");
    let victim = scratch.path().join("victim");
    std::fs::write(&victim, b"precious")?;
    let real = scratch.path().join("real-state");
    std::fs::create_dir(&real)?;
    std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o700))?;

    // A symlinked state directory.
    let link = scratch.path().join("linked-state");
    std::os::unix::fs::symlink(&real, &link)?;
    let out = refused_start(&node, &scratch, &config(scratch.path(), &link, &socket, ""))?;
    ensure!(out.contains("symbolic link"), "{out}");
    ensure!(!socket.exists(), "a failed start leaves no socket behind");

    // One others may write to.
    let open = scratch.path().join("open-state");
    std::fs::create_dir(&open)?;
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777))?;
    let out = refused_start(&node, &scratch, &config(scratch.path(), &open, &socket, ""))?;
    ensure!(out.contains("may write"), "{out}");

    // A regular file: named as such, not as a CNI manifest problem.
    let file = scratch.path().join("file-state");
    std::fs::write(&file, b"")?;
    let out = refused_start(&node, &scratch, &config(scratch.path(), &file, &socket, ""))?;
    ensure!(
        out.contains("not a directory") && !out.contains("manifest"),
        "{out}"
    );

    // A symlink planted at the log's path in a proper state directory.
    std::os::unix::fs::symlink(&victim, real.join("lockstep.wal"))?;
    let out = refused_start(&node, &scratch, &config(scratch.path(), &real, &socket, ""))?;
    ensure!(out.contains("lockstep.wal"), "{out}");
    ensure!(
        std::fs::read(&victim)? == b"precious",
        "never written through"
    );
    ensure!(!socket.exists(), "a failed start leaves no socket behind");
    std::fs::remove_file(real.join("lockstep.wal"))?;
    std::fs::remove_file(real.join("lockstep.redb"))?;

    // A dangling symlink at the socket path: said so, not "address in use".
    let dangling = scratch.path().join("dangling.sock");
    std::os::unix::fs::symlink(scratch.path().join("nowhere"), &dangling)?;
    let out = refused_start(
        &node,
        &scratch,
        &config(scratch.path(), &real, &dangling, ""),
    )?;
    ensure!(
        out.contains("symbolic link") && !out.contains("in use"),
        "{out}"
    );
    ensure!(
        std::fs::symlink_metadata(&dangling)?
            .file_type()
            .is_symlink(),
        "left as it was"
    );
    Ok(())
}

#[test]
fn cni_install_never_follows_or_removes_what_it_did_not_write() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("install")?;
    let cni = TempDir::new("cni")?;
    let (bin, conf) = (cni.path().join("bin"), cni.path().join("net.d"));
    std::fs::create_dir_all(&bin)?;
    let victim = cni.path().join("victim");
    std::fs::write(&victim, b"precious")?;
    // The temporary name older versions used, planted before start.
    std::os::unix::fs::symlink(&victim, bin.join(".lockstep.lockstep-tmp"))?;
    let section = |install: bool| {
        format!(
            "{POOLS}\n[cni]\ninstall = {install}\nbin_dir = \"{}\"\nconf_dir = \"{}\"\n",
            bin.display(),
            conf.display()
        )
    };
    let mut agent = AgentProc::start(&node, &section(true))?;
    ensure!(
        std::fs::read(&victim)? == b"precious",
        "never written through"
    );
    let plugin = std::fs::read(bin.join("lockstep"))?;
    ensure!(!plugin.is_empty(), "the plugin is installed");
    ensure!(
        std::fs::metadata(bin.join("lockstep"))?.ino() != std::fs::metadata(&victim)?.ino(),
        "a real file, not the victim"
    );

    // A manifest tampered to list a file outside the agent's names, with
    // the plugin's exact size and content hash.
    agent.kill9();
    std::fs::write(&victim, &plugin)?;
    let manifest = agent.dir.path().join("state").join("cni-installed.json");
    let mut listed: Vec<serde_json::Value> = serde_json::from_slice(&std::fs::read(&manifest)?)?;
    let mut forged = listed[0].clone();
    forged["path"] = serde_json::json!(victim.display().to_string());
    listed.push(forged);
    std::fs::write(&manifest, serde_json::to_vec(&listed)?)?;
    agent.rewrite_config(|text| text.replace("install = true", "install = false"))?;
    agent.restart()?;
    ensure!(
        victim.exists(),
        "a listed file outside the agent's names stays"
    );
    ensure!(
        !bin.join("lockstep").exists(),
        "the agent's own file is uninstalled"
    );
    agent.stop()?;
    Ok(())
}

/// Removes a pin directory a refused agent may have made.
struct PinsGone(PathBuf);

impl Drop for PinsGone {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
