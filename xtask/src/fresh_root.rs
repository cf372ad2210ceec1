//! `cargo xtask fresh-root`: builds the project inside a throwaway Debian root
//! that holds only what a fresh machine has plus what `cargo xtask setup`
//! installs.
//!
//! Why: CI runs on the developers' own machine, so a package installed there
//! by hand (or pulled in once as a recommendation) makes every CI run green
//! while a newcomer's machine cannot build at all. That happened: the etcd
//! protocol needed `libprotobuf-dev`, which setup never installed (#25). This
//! check cannot be fooled by the machine: the root is made by `debootstrap`
//! from the machine's own Debian release and suites, with the few packages
//! the machine image provides that the project relies on ([`IMAGE_BASE`]);
//! then, inside it, `cargo xtask setup`, the build of every binary and of the
//! eBPF object, and the unit tests. A package missing from setup's list makes
//! one of those steps fail here, not on someone else's machine.
//!
//! Shared with the machine, by bind mount: the Rust toolchains
//! (`~/.rustup`) and cargo's download caches (`~/.cargo/registry`,
//! `~/.cargo/git`), so nothing is fetched twice. Not shared: cargo's `bin/`
//! (the root gets only the rustup proxies), so setup must build its own
//! `bpf-linker` against the root's LLVM and a binary built on the machine
//! cannot hide a missing LLVM package; and `target/`.
//!
//! Not a step here: the aarch64 cross build (`cargo xtask build --arch
//! aarch64`). Setup's arm64 part (dpkg's arm64 architecture, the cross
//! packages, the arm64 bpftool) does run in the root; the cross build itself
//! runs in the integration stage of `cargo xtask test` on the machine, for
//! tests/tests/arm64.rs. Both its builds are whole-program optimised
//! (nightly's std from source, fat LTO): a third one here would put CI over
//! its hour.
//!
//! Debug builds in the root carry no debug info and no incremental state
//! (`CARGO_PROFILE_DEV_DEBUG=0`, `CARGO_INCREMENTAL=0`): what the check
//! proves does not depend on them, and with them the root's `target/`
//! takes 15 GiB instead of a few. The shipped binaries are built without
//! link-time optimisation, in 16 codegen units
//! (`CARGO_PROFILE_SHIP_LTO=off`, `CARGO_PROFILE_SHIP_CODEGEN_UNITS=16`):
//! LTO needs no tool a fresh machine could lack, the machine's own run
//! builds them as they ship, and here it cost three minutes of CI's hour.
//!
//! The root is cached (default `target/fresh-root/`, or
//! `LOCKSTEP_FRESH_ROOT_DIR`; CI keeps it outside the clone) under a key
//! hashed from setup's package list, [`IMAGE_BASE`], the release and this
//! file's [`FORMAT`]: a change to any of them makes a new root from scratch,
//! and the stale ones are removed. Between runs with the same key only the
//! sources are refreshed and the root's own `target/` is reused. Every mount
//! lives in a private mount namespace and every process in a private PID
//! namespace, so nothing outlives a run, even one killed midway.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

/// Packages the project takes from the machine image rather than from
/// setup: a C toolchain (build scripts, `cc`), TLS roots for cargo and pip,
/// and Python with venv (setup makes kubernetes-validate's virtualenv).
/// Each must be in the image's package list (checked when
/// `shared/tools/debian-image-packages.txt` is beside the clone), so the root
/// never holds more than a fresh machine.
pub const IMAGE_BASE: &[&str] = &[
    "build-essential",
    "ca-certificates",
    "python3",
    "python3-venv",
];

/// Bumped when the way the root is made changes, so old roots are not reused.
const FORMAT: &str = "fresh-root 1";

/// The rustup proxies the root gets (all one binary, told apart by name).
const RUSTUP_PROXIES: &[&str] = &[
    "cargo",
    "rustc",
    "rustdoc",
    "rustfmt",
    "cargo-fmt",
    "cargo-clippy",
    "clippy-driver",
];

/// What runs inside the root, in order, each step named when it fails.
const STEPS: &[(&str, &str)] = &[
    ("cargo xtask setup", "cargo xtask setup"),
    ("the eBPF object", "cargo xtask build-ebpf"),
    (
        "the shipped binaries (static musl agent and plugin)",
        "cargo xtask build",
    ),
    (
        "every binary, test and bench of the workspace",
        "cargo build --workspace --all-targets",
    ),
    (
        "the unit tests",
        "cargo test --workspace --exclude lockstep-tests",
    ),
];

/// FNV-1a, 64 bits: a key that is the same on every machine and toolchain.
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The machine's Debian release codename (`/etc/os-release`).
fn codename() -> anyhow::Result<String> {
    let text = std::fs::read_to_string("/etc/os-release").context("reading /etc/os-release")?;
    text.lines()
        .find_map(|l| l.strip_prefix("VERSION_CODENAME="))
        .map(|v| v.trim_matches('"').to_string())
        .filter(|v| !v.is_empty())
        .context("/etc/os-release names no VERSION_CODENAME: not a Debian machine?")
}

/// The machine's Debian mirror: the first `URIs:` (deb822) or `deb` line
/// whose suite list has the release; deb.debian.org otherwise.
fn mirror(codename: &str) -> String {
    let mut texts = Vec::new();
    if let Ok(t) = std::fs::read_to_string("/etc/apt/sources.list") {
        texts.push(t);
    }
    for path in apt_sources() {
        if let Ok(t) = std::fs::read_to_string(path) {
            texts.push(t);
        }
    }
    for text in &texts {
        for stanza in text.split("\n\n") {
            let uri = stanza
                .lines()
                .find_map(|l| l.strip_prefix("URIs:"))
                .map(str::trim);
            let suites = stanza.lines().find_map(|l| l.strip_prefix("Suites:"));
            if let (Some(uri), Some(suites)) = (uri, suites)
                && suites.split_whitespace().any(|s| s == codename)
                && uri.contains("/debian")
                && !uri.contains("security")
            {
                return uri.split_whitespace().next().unwrap_or(uri).to_string();
            }
        }
        for line in text.lines() {
            let words: Vec<&str> = line.split_whitespace().collect();
            if words.first() == Some(&"deb")
                && let Some(i) = words.iter().position(|w| *w == codename)
                && i >= 1
                && !words[i - 1].contains("security")
            {
                return words[i - 1].to_string();
            }
        }
    }
    "http://deb.debian.org/debian".to_string()
}

/// The enabled apt source files of the machine (`*.list`, `*.sources`).
fn apt_sources() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir("/etc/apt/sources.list.d")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "list" || e == "sources"))
        .collect();
    out.sort();
    out
}

/// Refuses an [`IMAGE_BASE`] entry the machine image does not have, when
/// the image's list is at hand (`../shared/tools/` beside the clone).
fn check_image_base() -> anyhow::Result<()> {
    let list = crate::root().join("../shared/tools/debian-image-packages.txt");
    let Ok(text) = std::fs::read_to_string(&list) else {
        println!(
            "fresh-root: {} not found; IMAGE_BASE not checked against the image",
            list.display()
        );
        return Ok(());
    };
    let image: Vec<&str> = text.lines().map(str::trim).collect();
    let extra: Vec<&str> = IMAGE_BASE
        .iter()
        .copied()
        .filter(|p| !image.contains(p))
        .collect();
    if !extra.is_empty() {
        bail!(
            "fresh-root: IMAGE_BASE names {} which the machine image ({}) does not have: \
             the root would hold more than a fresh machine",
            extra.join(", "),
            list.display()
        );
    }
    Ok(())
}

/// The cache key: everything that decides what the root holds.
fn key(codename: &str) -> String {
    let mut text = format!("{FORMAT}\n{codename}\n");
    for p in IMAGE_BASE {
        let _ = writeln!(text, "base {p}");
    }
    for p in crate::setup::PACKAGES {
        let _ = writeln!(text, "setup {p}");
    }
    format!("{}-{:016x}", codename, fnv1a(&text))
}

fn cache_dir() -> PathBuf {
    std::env::var_os("LOCKSTEP_FRESH_ROOT_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::root().join("target/fresh-root"))
}

/// Makes the root with debootstrap unless the cached one is complete.
fn ensure_root(dir: &Path, codename: &str) -> anyhow::Result<PathBuf> {
    let root = dir.join("root");
    let ready = dir.join("ready");
    if ready.exists() {
        println!("fresh-root: reusing {}", root.display());
        return Ok(root);
    }
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    // The root and its build (kept for the next run) take about 8 GiB.
    crate::disk::ensure_free(dir, 9, "the fresh-root check (building a new root)")?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mirror = mirror(codename);
    println!(
        "fresh-root: debootstrap {codename} from {mirror} into {}",
        root.display()
    );
    crate::run(
        Command::new("debootstrap")
            .args(["--variant=minbase", "--include"])
            .arg(IMAGE_BASE.join(","))
            .arg(codename)
            .arg(&root)
            .arg(&mirror),
    )
    .context("debootstrap (installed by `cargo xtask setup`) failed")?;
    // The machine's own suites (llvm-22 comes from the security suite) and
    // the keyrings they are signed with.
    let etc_apt = root.join("etc/apt");
    std::fs::write(etc_apt.join("sources.list"), "")?;
    if let Ok(text) = std::fs::read_to_string("/etc/apt/sources.list") {
        std::fs::write(etc_apt.join("sources.list"), text)?;
    }
    for src in apt_sources() {
        let name = src.file_name().context("source file name")?;
        std::fs::copy(&src, etc_apt.join("sources.list.d").join(name))
            .with_context(|| format!("copying {}", src.display()))?;
    }
    for keys in ["usr/share/keyrings", "etc/apt/trusted.gpg.d"] {
        let from = Path::new("/").join(keys);
        if from.is_dir() {
            crate::run(
                Command::new("cp")
                    .arg("-a")
                    .arg(format!("{}/.", from.display()))
                    .arg(root.join(keys)),
            )?;
        }
    }
    // No package's maintainer script may start a service in the root.
    let policy = root.join("usr/sbin/policy-rc.d");
    std::fs::write(&policy, "#!/bin/sh\nexit 101\n")?;
    set_mode(&policy, 0o755)?;
    // cargo's home in the root: its own bin/ with only the rustup proxies;
    // registry and git are bind-mounted from the machine at each run.
    let bin = root.join("root/.cargo/bin");
    std::fs::create_dir_all(&bin)?;
    for d in [
        "root/.cargo/registry",
        "root/.cargo/git",
        "root/.rustup",
        "src",
    ] {
        std::fs::create_dir_all(root.join(d))?;
    }
    let rustup = home().join(".cargo/bin/rustup");
    std::fs::copy(&rustup, bin.join("rustup"))
        .with_context(|| format!("copying {}", rustup.display()))?;
    for proxy in RUSTUP_PROXIES {
        std::os::unix::fs::symlink("rustup", bin.join(proxy))?;
    }
    std::fs::write(&ready, key(codename))?;
    Ok(root)
}

fn set_mode(path: &Path, mode: u32) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("chmod {}", path.display()))
}

fn home() -> PathBuf {
    std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/root"))
}

/// Build output inside the root's `/src` that a run keeps for the next:
/// cargo's and the eBPF workspace's target directories.
const KEPT: &[&str] = &["target", "ebpf/programs/target"];

/// Removes everything under `dir` (which is `rel` below `/src`) except the
/// [`KEPT`] paths.
fn clear_except_kept(dir: &Path, rel: &str) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let sub = if rel.is_empty() {
            name.to_string()
        } else {
            format!("{rel}/{name}")
        };
        let path = entry.path();
        if KEPT.contains(&sub.as_str()) {
            continue;
        }
        let is_dir = entry.file_type()?.is_dir();
        if is_dir && KEPT.iter().any(|k| k.starts_with(&format!("{sub}/"))) {
            clear_except_kept(&path, &sub)?;
            continue;
        }
        if is_dir {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        }
        .with_context(|| format!("removing {}", path.display()))?;
    }
    Ok(())
}

/// Replaces the root's `/src` with the working tree's files (tracked and
/// untracked, less what git ignores), keeping the [`KEPT`] build output.
fn copy_sources(root: &Path) -> anyhow::Result<()> {
    let src = root.join("src");
    std::fs::create_dir_all(&src)?;
    clear_except_kept(&src, "")?;
    let out = Command::new("git")
        .args([
            "ls-files",
            "-z",
            "--cached",
            "--others",
            "--exclude-standard",
        ])
        .current_dir(crate::root())
        .output()
        .context("git ls-files")?;
    if !out.status.success() {
        bail!(
            "git ls-files failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut list = Vec::new();
    for name in out.stdout.split(|b| *b == 0).filter(|n| !n.is_empty()) {
        let name = std::str::from_utf8(name).context("a file name that is not UTF-8")?;
        // A tracked file deleted in the working tree is not copied.
        if crate::root().join(name).exists() {
            list.extend_from_slice(name.as_bytes());
            list.push(0);
        }
    }
    let list_file = root.join("tmp/fresh-root-files");
    std::fs::create_dir_all(root.join("tmp"))?;
    std::fs::write(&list_file, list)?;
    crate::run(Command::new("bash").arg("-c").arg(format!(
        "set -o pipefail; tar -C '{}' --null -T '{}' -cf - | tar -C '{}' -xf -",
        crate::root().display(),
        list_file.display(),
        src.display()
    )))?;
    std::fs::remove_file(&list_file)?;
    Ok(())
}

/// The script run (in fresh mount and PID namespaces) to enter the root.
fn enter_script(root: &Path, steps: &str) -> String {
    let home = home();
    let r = root.display();
    format!(
        r#"set -eu
R='{r}'
mount --rbind /dev "$R/dev"; mount --make-rslave "$R/dev"
mount -t proc proc "$R/proc"
mount --rbind /sys "$R/sys"; mount --make-rslave "$R/sys"
mount -t tmpfs tmpfs "$R/tmp"
mount --bind '{rustup}' "$R/root/.rustup"
mount --bind '{registry}' "$R/root/.cargo/registry"
if [ -d '{git}' ]; then mount --bind '{git}' "$R/root/.cargo/git"; fi
cp /etc/resolv.conf "$R/etc/resolv.conf"
# The machine's own certificate authorities (not a package: part of the
# machine, as on every fresh one), so cargo, apt and pip trust what they
# trust on the machine.
if [ -d /usr/local/share/ca-certificates ]; then
  cp -a /usr/local/share/ca-certificates/. "$R/usr/local/share/ca-certificates/"
  chroot "$R" update-ca-certificates >/dev/null
fi
exec chroot "$R" /usr/bin/env -i HOME=/root TERM=dumb CARGO_TERM_COLOR=never \
  PATH=/root/.cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  LOCKSTEP_SKIP_FRESH_ROOT=1 CARGO_PROFILE_DEV_DEBUG=0 CARGO_INCREMENTAL=0 \
  CARGO_PROFILE_SHIP_LTO=off CARGO_PROFILE_SHIP_CODEGEN_UNITS=16 \
  {passed} bash -euc 'cd /src; {steps}'
"#,
        rustup = home.join(".rustup").display(),
        registry = home.join(".cargo/registry").display(),
        git = home.join(".cargo/git").display(),
        passed = passed_env(),
    )
}

/// The machine's environment that says how to reach the registries
/// (proxies, certificate bundles, pip's settings), passed into the root as
/// `NAME='value'` words; nothing else of the caller's environment goes in.
fn passed_env() -> String {
    let mut out = String::new();
    for (name, value) in std::env::vars() {
        let wanted =
            PASSED_ENV.contains(&name.as_str()) || name.to_ascii_lowercase().ends_with("_proxy");
        if wanted && !value.contains('\'') {
            let _ = write!(out, "{name}='{value}' ");
        }
    }
    out
}

/// Variables of [`passed_env`] besides `*_proxy`.
const PASSED_ENV: &[&str] = &[
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "CURL_CA_BUNDLE",
    "REQUESTS_CA_BUNDLE",
    "PIP_CERT",
    "PIP_INDEX_URL",
    "PIP_DEFAULT_TIMEOUT",
    "CARGO_HTTP_CAINFO",
    "GIT_SSL_CAINFO",
];

/// Runs the check: the root, then setup, builds and unit tests inside it.
///
/// # Errors
/// Not root, debootstrap failing, or a step inside the root failing: the
/// error names the step, and for setup or a build, what that means.
pub fn check() -> anyhow::Result<()> {
    check_to(None)
}

/// As [`check`], the build's output inside the root into `log` when given
/// (so it can run beside other stages without mixing with their output);
/// on failure the log's end is printed.
///
/// # Errors
/// As [`check`].
pub fn check_to(log: Option<&Path>) -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    if !Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
    {
        bail!(
            "fresh-root needs root (debootstrap, mounts, chroot); set LOCKSTEP_SKIP_FRESH_ROOT=1 to skip it explicitly"
        );
    }
    check_image_base()?;
    let codename = codename()?;
    let cache = cache_dir();
    let key = key(&codename);
    let dir = cache.join(&key);
    std::fs::create_dir_all(&cache)?;
    // Roots of other keys are stale: setup's list or the base changed.
    for entry in std::fs::read_dir(&cache)? {
        let entry = entry?;
        if entry.file_name() != key.as_str() && entry.file_type()?.is_dir() {
            println!("fresh-root: removing stale root {}", entry.path().display());
            std::fs::remove_dir_all(entry.path())?;
        }
    }
    let root = ensure_root(&dir, &codename)?;
    let made = started.elapsed();
    copy_sources(&root)?;
    let mut steps = String::new();
    for (i, (what, cmd)) in STEPS.iter().enumerate() {
        let _ = write!(
            steps,
            "echo \"fresh-root: step {n}/{total}: {what}: {cmd}\"; \
             {cmd} || {{ echo \"fresh-root: FAILED at step {n}: {what} ({cmd})\"; exit 1; }}; ",
            n = i + 1,
            total = STEPS.len(),
        );
    }
    let mut unshare = Command::new("unshare");
    if let Some(log) = log {
        let file =
            std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        unshare.stdout(file.try_clone()?).stderr(file);
    }
    let status = unshare
        .args([
            "--mount",
            "--pid",
            "--fork",
            "--propagation",
            "private",
            "bash",
            "-c",
        ])
        .arg(enter_script(&root, &steps))
        .status()
        .context("starting unshare")?;
    if !status.success() {
        if let Some(log) = log {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(80).collect();
            for line in tail.iter().rev() {
                eprintln!("{line}");
            }
        }
        bail!(
            "fresh-root: the build failed in a root holding only the image's base ({}) and what \
             `cargo xtask setup` installs ({status}); the step is named above. If a tool or \
             library is missing there, add its Debian package to PACKAGES in xtask/src/setup.rs",
            IMAGE_BASE.join(", ")
        );
    }
    println!(
        "fresh-root: setup, build and unit tests passed in a fresh {codename} root in {:.0} s \
         ({:.0} s making or checking the root)",
        started.elapsed().as_secs_f64(),
        made.as_secs_f64()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_changes_with_setup_s_list_and_only_with_it() {
        let a = key("bookworm");
        assert_eq!(a, key("bookworm"), "the key is stable");
        assert_ne!(a, key("trixie"), "another release gets another root");
        let mut text = format!("{FORMAT}\nbookworm\n");
        for p in IMAGE_BASE {
            let _ = writeln!(text, "base {p}");
        }
        let without_one = crate::setup::PACKAGES[1..].iter().fold(text, |mut t, p| {
            let _ = writeln!(t, "setup {p}");
            t
        });
        assert_ne!(
            a,
            format!("bookworm-{:016x}", fnv1a(&without_one)),
            "a package removed from setup's list makes a new root"
        );
    }

    #[test]
    fn clearing_the_sources_keeps_only_the_build_output() -> anyhow::Result<()> {
        let dir = std::env::temp_dir().join(format!("xtask-fresh-root-{}", std::process::id()));
        let files = [
            "target/debug/kept",
            "ebpf/programs/target/kept",
            "ebpf/programs/src/main.rs",
            "ebpf/common/lib.rs",
            "README.md",
        ];
        for f in files {
            let path = dir.join(f);
            std::fs::create_dir_all(path.parent().expect("has a parent"))?;
            std::fs::write(&path, f)?;
        }
        clear_except_kept(&dir, "")?;
        let left: Vec<bool> = files.iter().map(|f| dir.join(f).exists()).collect();
        std::fs::remove_dir_all(&dir)?;
        assert_eq!(left, [true, true, false, false, false]);
        Ok(())
    }

    #[test]
    fn fnv1a_matches_the_reference_vectors() {
        assert_eq!(fnv1a(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a("a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a("foobar"), 0x8594_4171_f739_67e8);
    }
}
