//! `cargo xtask image`: the OCI image `lockstep:<version>`, built with
//! `podman build` from `deploy/Containerfile` (FROM scratch: no registry),
//! out of the binaries `cargo xtask build` makes.
//!
//! The build context is staged in `target/image/context/`: the Containerfile
//! and a `rootfs/` with the static agent (its version stamped, see
//! `lockstep::version`), the static plugin, and Debian's bpftool with the
//! shared libraries `ldd` names. The image test (`tests/tests/image.rs`)
//! builds its own images from the same context (`LOCKSTEP_IMAGE_CONTEXT`).
//!
//! `--arch aarch64` stages `target/image/context-arm64/` from the cross-built
//! binaries and Debian's arm64 bpftool (which setup unpacks under
//! `target/tools/bpftool-arm64/`: it cannot be installed beside the amd64
//! one) with its arm64 libraries (installed by setup through dpkg's arm64
//! architecture, found by arm64's own loader `--list` run under
//! qemu-user), and builds it with `podman build --arch arm64`: `FROM
//! scratch` and `COPY` run nothing, so no emulation is needed to build.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail, ensure};

use crate::arch::Arch;

/// The marker in front of the version in the agent's stamp, as
/// `lockstep::version::STAMP_MARKER` (xtask does not depend on the daemon
/// crate; the image test checks that a stamped image reports its version).
const STAMP_MARKER: &[u8] = b"lockstep-version-stamp:";
/// `lockstep::version::STAMP_LEN`.
const STAMP_LEN: usize = 96;

/// Where the context of `arch` is staged.
pub fn context_dir(arch: Arch) -> PathBuf {
    if arch.is_host() {
        crate::root().join("target/image/context")
    } else {
        crate::root().join(format!("target/image/context-{}", arch.oci()))
    }
}

/// The arm64 bpftool setup unpacks (`crate::setup::bpftool_arm64`).
pub fn bpftool_arm64() -> PathBuf {
    crate::root().join("target/tools/bpftool-arm64/usr/sbin/bpftool")
}

/// The image's tag: the version, with the architecture for a foreign one.
pub fn tag(version: &str, arch: Arch) -> String {
    if arch.is_host() {
        format!("localhost/lockstep:{version}")
    } else {
        format!("localhost/lockstep:{version}-{}", arch.oci())
    }
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

/// The shared libraries a dynamically linked program of `arch` loads: from
/// `ldd`, or for arm64 from its loader's `--list` under qemu-user (the
/// libraries are the machine's arm64 ones, installed by setup).
fn shared_libraries(program: &Path, arch: Arch) -> anyhow::Result<Vec<PathBuf>> {
    let out = if arch.is_host() {
        Command::new("ldd").arg(program).output()
    } else {
        Command::new("qemu-aarch64-static")
            .args(["-L", "/", "/lib/ld-linux-aarch64.so.1", "--list"])
            .arg(program)
            .output()
    }
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

/// Builds the static binaries for `arch` and stages the build context with
/// the agent stamped as `version`. Returns the context directory.
pub fn stage(version: &str, arch: Arch) -> anyhow::Result<PathBuf> {
    let [agent, plugin]: [PathBuf; 2] = crate::arch::build_shipped(arch, &crate::arch::SHIPPED)?
        .try_into()
        .map_err(|_| anyhow::anyhow!("the build named other than two binaries"))?;
    let dir = context_dir(arch);
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
    let from = if arch.is_host() {
        bpftool.to_path_buf()
    } else {
        bpftool_arm64()
    };
    ensure!(
        from.exists(),
        "{} is missing: run `cargo xtask setup`",
        from.display()
    );
    put(&rootfs, &from, bpftool, 0o755)?;
    for lib in shared_libraries(&from, arch)? {
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

/// `podman build` of the staged context of `arch` as
/// `localhost/lockstep:<version>` (`-arm64` appended for arm64) in the
/// machine's podman storage; prints the image's size and returns it in
/// bytes.
pub fn build(version: Option<String>, arch: Arch) -> anyhow::Result<u64> {
    let version = version.unwrap_or_else(default_version);
    let dir = stage(&version, arch)?;
    let tag = tag(&version, arch);
    crate::run(
        Command::new("podman")
            .args(["build", "--pull=never", "--tag", &tag])
            .args(["--arch", arch.oci()])
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
        "built {tag} ({}): {:.1} MB ({bytes} bytes); `podman save {tag}` exports it",
        arch.oci(),
        bytes as f64 / 1e6
    );
    Ok(bytes)
}

/// What each part of a staged context weighs, in bytes: the agent, the
/// plugin, bpftool, bpftool's libraries; `None` when the context is not
/// staged.
pub fn parts(arch: Arch) -> anyhow::Result<Option<[u64; 4]>> {
    let rootfs = context_dir(arch).join("rootfs");
    if !rootfs.is_dir() {
        return Ok(None);
    }
    let size = |p: &str| -> anyhow::Result<u64> {
        let path = rootfs.join(p);
        Ok(std::fs::metadata(&path)
            .with_context(|| format!("{}", path.display()))?
            .len())
    };
    let mut libs = 0;
    for dir in ["lib", "lib64", "usr/lib"] {
        let mut stack = vec![rootfs.join(dir)];
        while let Some(d) = stack.pop() {
            let Ok(entries) = std::fs::read_dir(&d) else {
                continue;
            };
            for e in entries {
                let e = e?;
                let meta = e.metadata()?;
                if meta.is_dir() {
                    stack.push(e.path());
                } else {
                    libs += meta.len();
                }
            }
        }
    }
    Ok(Some([
        size("usr/local/bin/lockstep")?,
        size("usr/local/bin/lockstep-cni")?,
        size("usr/sbin/bpftool")?,
        libs,
    ]))
}
