//! `cargo xtask image`: the OCI image `lockstep:<version>`, built with
//! `podman build` from `deploy/Containerfile` (FROM scratch: no registry),
//! out of the binaries `cargo xtask build` makes.
//!
//! The build context is staged in `target/image/context/`: the Containerfile
//! and a `rootfs/` with the static agent (its version stamped, see
//! `lockstep::version`), the static plugin, and Debian's bpftool with the
//! shared libraries `ldd` names. The image test (`tests/tests/image.rs`)
//! builds its own images from the same context (`LOCKSTEP_IMAGE_CONTEXT`).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail, ensure};

/// The marker in front of the version in the agent's stamp, as
/// `lockstep::version::STAMP_MARKER` (xtask does not depend on the daemon
/// crate; the image test checks that a stamped image reports its version).
const STAMP_MARKER: &[u8] = b"lockstep-version-stamp:";
/// `lockstep::version::STAMP_LEN`.
const STAMP_LEN: usize = 96;

/// Where the context is staged.
pub fn context_dir() -> PathBuf {
    crate::root().join("target/image/context")
}

/// The version an image gets when none is asked for: the workspace's.
pub fn default_version() -> String {
    env!("CARGO_PKG_VERSION").to_string()
}

/// Writes `version` into the agent binary's stamp.
fn stamp(binary: &mut [u8], version: &str) -> anyhow::Result<()> {
    let max = STAMP_LEN - STAMP_MARKER.len() - 1;
    ensure!(
        !version.is_empty() && version.len() <= max && !version.contains('\0'),
        "version {version:?} is empty or longer than {max} bytes"
    );
    let at: Vec<usize> = binary
        .windows(STAMP_MARKER.len())
        .enumerate()
        .filter(|(_, w)| *w == STAMP_MARKER)
        .map(|(i, _)| i)
        .collect();
    let [at] = at[..] else {
        bail!(
            "the agent's version stamp occurs {} times, not once",
            at.len()
        );
    };
    let value = &mut binary[at + STAMP_MARKER.len()..at + STAMP_LEN];
    value.fill(0);
    value[..version.len()].copy_from_slice(version.as_bytes());
    Ok(())
}

/// The shared libraries a dynamically linked program loads, from `ldd`.
fn shared_libraries(program: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(program)
        .output()
        .context("running ldd")?;
    ensure!(out.status.success(), "ldd {} failed", program.display());
    let mut libs = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        // "libelf.so.1 => /lib/x86_64-linux-gnu/libelf.so.1 (0x...)" or
        // "/lib64/ld-linux-x86-64.so.2 (0x...)"; the vDSO has no file.
        let path = match line.split_once("=>") {
            Some((_, right)) => right.split_whitespace().next(),
            None => line.split_whitespace().next(),
        };
        if let Some(p) = path.filter(|p| p.starts_with('/')) {
            libs.push(PathBuf::from(p));
        }
    }
    Ok(libs)
}

/// Copies `from` to `<rootfs><to>`, following symlinks, with mode `mode`.
fn put(rootfs: &Path, from: &Path, to: &Path, mode: u32) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let dest = rootfs.join(to.strip_prefix("/").unwrap_or(to));
    if let Some(dir) = dest.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::copy(from, &dest)
        .with_context(|| format!("copying {} to {}", from.display(), dest.display()))?;
    std::fs::set_permissions(&dest, std::fs::Permissions::from_mode(mode))?;
    Ok(())
}

/// Builds the static binaries and stages the build context with the agent
/// stamped as `version`. Returns the context directory.
pub fn stage(version: &str) -> anyhow::Result<PathBuf> {
    let agent = crate::build_shipped("lockstep")?;
    let plugin = crate::build_shipped("lockstep-cni")?;
    let dir = context_dir();
    if dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    let rootfs = dir.join("rootfs");
    std::fs::create_dir_all(&rootfs)?;
    std::fs::copy(
        crate::root().join("deploy/Containerfile"),
        dir.join("Containerfile"),
    )
    .context("copying deploy/Containerfile")?;
    let mut binary =
        std::fs::read(&agent).with_context(|| format!("reading {}", agent.display()))?;
    stamp(&mut binary, version)?;
    let staged = dir.join("lockstep.stamped");
    std::fs::write(&staged, &binary)?;
    put(
        &rootfs,
        &staged,
        Path::new("/usr/local/bin/lockstep"),
        0o755,
    )?;
    std::fs::remove_file(&staged)?;
    put(
        &rootfs,
        &plugin,
        Path::new("/usr/local/bin/lockstep-cni"),
        0o755,
    )?;
    let bpftool = Path::new("/usr/sbin/bpftool");
    put(&rootfs, bpftool, bpftool, 0o755)?;
    for lib in shared_libraries(bpftool)? {
        put(&rootfs, &lib, &lib, 0o755)?;
    }
    // Mount points the pod's volumes land on, and a /tmp.
    for d in [
        "etc/lockstep",
        "var/lib/lockstep",
        "run/lockstep",
        "sys/fs/bpf",
        "opt/cni/bin",
        "etc/cni/net.d",
        "tmp",
    ] {
        std::fs::create_dir_all(rootfs.join(d))?;
    }
    Ok(dir)
}

/// `podman build` of the staged context as `localhost/lockstep:<version>`
/// in the machine's podman storage; prints the image's size.
pub fn build(version: Option<String>) -> anyhow::Result<()> {
    let version = version.unwrap_or_else(default_version);
    let dir = stage(&version)?;
    let tag = format!("localhost/lockstep:{version}");
    crate::run(
        Command::new("podman")
            .args(["build", "--pull=never", "--tag", &tag])
            .args([
                "--label",
                &format!("org.opencontainers.image.version={version}"),
            ])
            .arg("--file")
            .arg(dir.join("Containerfile"))
            .arg(&dir),
    )?;
    let size = Command::new("podman")
        .args(["image", "inspect", "--format", "{{.Size}}", &tag])
        .output()
        .context("podman image inspect")?;
    let bytes: u64 = String::from_utf8_lossy(&size.stdout)
        .trim()
        .parse()
        .context("image size")?;
    println!(
        "built {tag}: {:.1} MB ({bytes} bytes); `podman save {tag}` exports it",
        bytes as f64 / 1e6
    );
    Ok(())
}
