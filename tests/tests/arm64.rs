//! #45 item 8: the agent cross-built for aarch64 (static musl,
//! `cargo xtask build --arch aarch64`) runs: under qemu-user (Debian's
//! `qemu-user-static`, installed by setup) it reports the version stamped
//! into it and checks a config as the x86_64 agent does; and the arm64
//! image builds from its staged context.
//!
//! `cargo xtask test` cross-builds the binaries, stages the arm64 image's
//! context, and names them in `LOCKSTEP_ARM64_BIN` and
//! `LOCKSTEP_IMAGE_CONTEXT_ARM64`. `LOCKSTEP_SKIP_ARM64=1` skips the cross
//! build and these tests explicitly (each says so); without it a missing
//! binary fails them.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use anyhow::{Context, ensure};
use lockstep_tests::podman::Podman;
use lockstep_tests::{TempDir, privileged, unique};

/// Whether the arm64 tests are opted out (says so).
fn skipped(test: &str) -> bool {
    if std::env::var("LOCKSTEP_SKIP_ARM64").as_deref() == Ok("1") {
        eprintln!("SKIPPED {test}: LOCKSTEP_SKIP_ARM64=1 is set (the aarch64 build was not made)");
        return true;
    }
    false
}

/// A path `cargo xtask test` names in `var`.
fn given(var: &str) -> anyhow::Result<PathBuf> {
    let path = std::env::var_os(var).map(PathBuf::from).with_context(|| {
        format!(
            "{var} is not set: run the arm64 tests through `cargo xtask test`, which cross-builds \
             the agent (`cargo xtask build --arch aarch64`) and stages the arm64 image's context; \
             LOCKSTEP_SKIP_ARM64=1 skips them explicitly"
        )
    })?;
    ensure!(path.exists(), "{} ({var}) does not exist", path.display());
    Ok(path)
}

/// The arm64 agent run under qemu-user with `args`.
fn qemu(bin: &Path, args: &[&OsStr]) -> anyhow::Result<Output> {
    Command::new("qemu-aarch64-static")
        .arg(bin)
        .args(args)
        .output()
        .context("starting qemu-aarch64-static (Debian's qemu-user-static; `cargo xtask setup`)")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The binary is an aarch64 ELF, statically linked (no interpreter), and
/// under qemu-user `--version` says the version stamped into it, as the
/// image build stamps it.
#[test]
fn the_arm64_agent_reports_its_stamped_version_under_qemu() -> anyhow::Result<()> {
    if skipped(module_path!()) {
        return Ok(());
    }
    let built = given("LOCKSTEP_ARM64_BIN")?;
    let mut binary = std::fs::read(&built)?;
    // e_machine (offset 18, little endian) 183 is EM_AARCH64.
    ensure!(
        binary.starts_with(b"\x7fELF") && binary.get(18..20) == Some(&[183, 0][..]),
        "{} is not an aarch64 ELF",
        built.display()
    );
    // No PT_INTERP program header: static, as the image (no C library)
    // needs it.
    ensure!(
        !interpreted(&binary)?,
        "{} asks for a program interpreter: not static",
        built.display()
    );
    let version = format!("{}-{}", env!("CARGO_PKG_VERSION"), unique("arm64"));
    lockstep::version::stamp(&mut binary, &version)?;
    let dir = TempDir::new("arm64")?;
    let bin = dir.path().join("lockstep");
    std::fs::write(&bin, binary)?;
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755))?;
    }
    let out = qemu(&bin, &[OsStr::new("--version")])?;
    ensure!(
        out.status.success() && text(&out.stdout).trim() == format!("lockstep {version}"),
        "lockstep --version under qemu-aarch64: {:?} {:?} ({})",
        text(&out.stdout),
        text(&out.stderr),
        out.status
    );
    Ok(())
}

/// Whether an ELF64 little-endian file has a PT_INTERP program header.
fn interpreted(elf: &[u8]) -> anyhow::Result<bool> {
    let u16_at = |o: usize| -> anyhow::Result<u64> {
        let b = elf.get(o..o + 2).context("short ELF")?;
        Ok(u64::from(u16::from_le_bytes([b[0], b[1]])))
    };
    let u64_at = |o: usize| -> anyhow::Result<u64> {
        let b: [u8; 8] = elf
            .get(o..o + 8)
            .context("short ELF")?
            .try_into()
            .context("short ELF")?;
        Ok(u64::from_le_bytes(b))
    };
    let phoff = usize::try_from(u64_at(32)?)?;
    let phentsize = usize::try_from(u16_at(54)?)?;
    let phnum = usize::try_from(u16_at(56)?)?;
    for i in 0..phnum {
        let at = phoff + i * phentsize;
        let kind = elf.get(at..at + 4).context("short ELF")?;
        // PT_INTERP = 3.
        if kind == [3, 0, 0, 0] {
            return Ok(true);
        }
    }
    Ok(false)
}

/// `lockstep config check` under qemu-user: the shipped example passes
/// (exit 0), a bad file fails (exit 1) naming each refused field.
#[test]
fn the_arm64_agent_checks_a_config_under_qemu() -> anyhow::Result<()> {
    if skipped(module_path!()) {
        return Ok(());
    }
    let bin = given("LOCKSTEP_ARM64_BIN")?;
    let root = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    let good = root.join("deploy/config.example.toml");
    let out = qemu(
        &bin,
        &[OsStr::new("config"), OsStr::new("check"), good.as_os_str()],
    )?;
    ensure!(
        out.status.code() == Some(0) && text(&out.stdout).contains("valid"),
        "config check of the example under qemu-aarch64 ({}): {}{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );

    let dir = TempDir::new("arm64-config")?;
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "reconcile_interval = \"1ms\"\n[masquerade]\nendpoint_share = 2.0\n",
    )?;
    let out = qemu(
        &bin,
        &[OsStr::new("config"), OsStr::new("check"), bad.as_os_str()],
    )?;
    let said = text(&out.stdout);
    ensure!(
        out.status.code() == Some(1),
        "a bad config under qemu-aarch64 exited {}: {said}{}",
        out.status,
        text(&out.stderr)
    );
    for field in ["`reconcile_interval`", "`masquerade.endpoint_share`"] {
        ensure!(said.contains(field), "{field} not named:\n{said}");
    }
    Ok(())
}

/// The arm64 image builds from its staged context (`podman build --arch
/// arm64`, in a private storage) and podman records it as arm64, holding the
/// arm64 agent, plugin and bpftool (each an aarch64 ELF).
#[test]
fn the_arm64_image_builds() -> anyhow::Result<()> {
    if skipped(module_path!()) {
        return Ok(());
    }
    privileged!();
    let context = given("LOCKSTEP_IMAGE_CONTEXT_ARM64")?;
    for file in [
        "usr/local/bin/lockstep",
        "usr/local/bin/lockstep-cni",
        "usr/sbin/bpftool",
    ] {
        let path = context.join("rootfs").join(file);
        let head = std::fs::read(&path).with_context(|| format!("{}", path.display()))?;
        ensure!(
            head.get(18..20) == Some(&[183, 0][..]),
            "{file} in the arm64 context is not an aarch64 ELF"
        );
    }
    let podman = Podman::new()?;
    let tag = format!("localhost/lockstep:{}-arm64", unique("t"));
    podman.ok([
        OsStr::new("build"),
        OsStr::new("--pull=never"),
        OsStr::new("--quiet"),
        OsStr::new("--arch"),
        OsStr::new("arm64"),
        OsStr::new("--tag"),
        OsStr::new(&tag),
        OsStr::new("--file"),
        context.join("Containerfile").as_os_str(),
        context.as_os_str(),
    ])?;
    let inspect = podman.ok([
        "image",
        "inspect",
        "--format",
        "{{.Architecture}} {{.Os}} {{.Size}}",
        &tag,
    ])?;
    let words: Vec<&str> = inspect.split_whitespace().collect();
    ensure!(
        words.first() == Some(&"arm64") && words.get(1) == Some(&"linux"),
        "podman image inspect of {tag}: {inspect}"
    );
    let size: f64 = words.get(2).context("no size")?.parse()?;
    eprintln!("arm64 image {tag}: {:.1} MB", size / 1e6);
    Ok(())
}
