//! The architectures the agent and the plugin ship for (#45 item 8): the
//! machine's own (x86_64) and aarch64, both static musl binaries.
//!
//! The machine's architecture builds with stable and the musl target rustup
//! installs. aarch64 is cross-built: rustup cannot fetch that target's
//! standard library on these machines, so nightly builds it from its
//! `rust-src` (`-Z build-std`), and Debian supplies the rest, through the
//! arm64 architecture setup adds to dpkg: musl's arm64 C library and start
//! files (`musl-dev:arm64`, with its `musl-gcc.specs`), the cross compiler and
//! linker (`gcc-aarch64-linux-gnu`: ring's C, and the link, both pointed at
//! musl by those specs), and LLVM's unwinder (`libunwind-16-dev:arm64`, the
//! unwinder Rust's own musl targets ship; the std built from source links
//! `-lunwind`). That libunwind was compiled against glibc and calls glibc's
//! fortified `__fprintf_chk` (only on its debug-logging path); a five-line
//! shim, compiled for musl and added to a copy of the archive under the
//! cross build's `tools/aarch64-musl/`, provides it. The eBPF object is the same
//! bytecode on every architecture (`bpfel`), built once by the agent's build
//! script on the build machine and embedded.
//!
//! The cross build has its own target directory (`target/cross/`, or
//! `LOCKSTEP_CROSS_TARGET_DIR`; CI keeps it outside the clone, so a run
//! rebuilds only what changed, as cargo's fingerprints decide): its host
//! tools are nightly's, and it never waits on the lock of a stable build.
//! The unwinder's directory lives inside it: its path is in every crate's
//! `RUSTFLAGS` (`-L native=...`), so a path inside the clone would differ
//! from clone to clone and make cargo rebuild every crate each time.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, bail, ensure};

/// A shipped architecture.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Arch {
    /// x86_64 (amd64).
    #[value(name = "x86_64", alias = "amd64")]
    X86_64,
    /// aarch64 (arm64).
    #[value(name = "aarch64", alias = "arm64")]
    Aarch64,
}

/// musl's arm64 specs for gcc (from `musl-dev:arm64`).
const MUSL_SPECS: &str = "/usr/lib/aarch64-linux-musl/musl-gcc.specs";

/// LLVM's libunwind for arm64 (from `libunwind-16-dev:arm64`).
const LIBUNWIND: &str = "/usr/lib/aarch64-linux-gnu/libunwind.a";

/// What Debian's libunwind (built against glibc) needs that musl lacks.
const FORTIFY_SHIM: &str = r"#include <stdarg.h>
#include <stdio.h>
int __fprintf_chk(FILE *f, int flag, const char *fmt, ...) {
    (void)flag;
    va_list ap;
    va_start(ap, fmt);
    int r = vfprintf(f, fmt, ap);
    va_end(ap);
    return r;
}
";

impl Arch {
    /// The machine's own architecture.
    pub fn host() -> anyhow::Result<Self> {
        match std::env::consts::ARCH {
            "x86_64" => Ok(Self::X86_64),
            "aarch64" => Ok(Self::Aarch64),
            other => bail!("lockstep ships for x86_64 and aarch64, not {other}"),
        }
    }

    /// The Rust name (`x86_64`, `aarch64`).
    pub fn rust(self) -> &'static str {
        match self {
            Self::X86_64 => "x86_64",
            Self::Aarch64 => "aarch64",
        }
    }

    /// The OCI and Debian name (`amd64`, `arm64`).
    pub fn oci(self) -> &'static str {
        match self {
            Self::X86_64 => "amd64",
            Self::Aarch64 => "arm64",
        }
    }

    /// The static musl target.
    pub fn target(self) -> String {
        format!("{}-unknown-linux-musl", self.rust())
    }

    /// Whether this is the machine's own architecture.
    pub fn is_host(self) -> bool {
        self.rust() == std::env::consts::ARCH
    }
}

/// The binaries that ship: the agent and the CNI plugin.
pub const SHIPPED: [&str; 2] = ["lockstep", "lockstep-cni"];

/// The aarch64 shipped build, running on a thread of its own beside
/// whatever the caller does meanwhile; its output goes to a log file.
/// It is mostly one single-threaded compile and fat-LTO link, so it
/// leaves a core idle on its own: beside the lints and unit tests it
/// costs CI little time. Dropped without [`Background::wait`], it is
/// waited for (never left running).
pub struct Background {
    handle: Option<std::thread::JoinHandle<anyhow::Result<()>>>,
    log: PathBuf,
}

/// Starts the aarch64 build of both shipped binaries in the background,
/// its output in `target/arm64-build.log`.
///
/// # Errors
/// The log file could not be made.
pub fn start_cross_build() -> anyhow::Result<Background> {
    let log = crate::root().join("target/arm64-build.log");
    std::fs::create_dir_all(crate::root().join("target"))?;
    let file =
        std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    eprintln!(
        "aarch64 build started in the background; its output: {}",
        log.display()
    );
    let handle = std::thread::spawn(move || {
        build_shipped_to(Arch::Aarch64, &SHIPPED, Some(file)).map(|_| ())
    });
    Ok(Background {
        handle: Some(handle),
        log,
    })
}

impl Background {
    /// Waits for the build; on failure the log's end is printed.
    ///
    /// # Errors
    /// The build failed (or its thread panicked).
    pub fn wait(mut self) -> anyhow::Result<()> {
        let outcome = self.join();
        if outcome.is_err() {
            let text = std::fs::read_to_string(&self.log).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(60).collect();
            for line in tail.iter().rev() {
                eprintln!("{line}");
            }
        }
        outcome
    }

    fn join(&mut self) -> anyhow::Result<()> {
        match self.handle.take() {
            Some(h) => h
                .join()
                .map_err(|_| anyhow::anyhow!("the aarch64 build's thread panicked"))?,
            None => Ok(()),
        }
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        let _ = self.join();
    }
}

/// Builds `bins` of the `lockstep` package for `arch` as they ship, in one
/// cargo run (their links run in parallel): the `ship` profile, static
/// musl, position dependent (see `build_plugin` in main.rs). Returns the
/// binaries' paths, in the order asked.
pub fn build_shipped(arch: Arch, bins: &[&str]) -> anyhow::Result<Vec<PathBuf>> {
    build_shipped_to(arch, bins, None)
}

/// As [`build_shipped`], cargo's output into `log` when given.
fn build_shipped_to(
    arch: Arch,
    bins: &[&str],
    log: Option<std::fs::File>,
) -> anyhow::Result<Vec<PathBuf>> {
    let target = arch.target();
    let flags = "-C target-feature=+crt-static -C relocation-model=static";
    let bin_args: Vec<&str> = bins.iter().flat_map(|bin| ["--bin", *bin]).collect();
    if arch.is_host() {
        let mut cargo = crate::cargo();
        if let Some(log) = log {
            cargo.stdout(log.try_clone()?).stderr(log);
        }
        if let Some(dir) = ship_dir() {
            // Kept outside the clone: as for the cross build, nothing of
            // xtask's own invocation may reach a build script's
            // fingerprint.
            cargo
                .env("CARGO_TARGET_DIR", dir)
                .env_remove("CARGO_MANIFEST_DIR")
                .env_remove("CARGO_MANIFEST_PATH");
        }
        crate::run(
            cargo
                .args(["build", "--profile", "ship", "--target", &target])
                .args(["-p", "lockstep"])
                .args(&bin_args)
                .env("RUSTFLAGS", flags),
        )?;
        return Ok(bins.iter().map(|bin| built(arch, bin)).collect());
    }
    ensure!(
        arch == Arch::Aarch64 && Arch::host()? == Arch::X86_64,
        "cross builds go from x86_64 to aarch64 only"
    );
    let unwind = unwinder()?;
    let dir = cross_dir();
    let env = target.to_uppercase().replace('-', "_");
    let cc = target.replace('-', "_");
    // rustup's proxy, not the toolchain's cargo `crate::cargo` runs: only
    // the proxy takes `+nightly`.
    let mut cargo = Command::new("cargo");
    // Nor what `cargo run` set for xtask itself: a build script that reads
    // `CARGO_MANIFEST_DIR` (ring's) has cargo record the caller's value in
    // its fingerprint, and xtask's path differs from clone to clone, so a
    // cached target directory would rebuild ring and all above it.
    cargo
        .current_dir(crate::root())
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("RUSTC")
        .env_remove("CARGO_MANIFEST_DIR")
        .env_remove("CARGO_MANIFEST_PATH");
    if let Some(log) = log {
        cargo.stdout(log.try_clone()?).stderr(log);
    }
    crate::run(
        cargo
            .args(["+nightly", "build", "-Z", "build-std=std,panic_unwind"])
            .args(["--profile", "ship", "--target", &target])
            .args(["-p", "lockstep"])
            .args(&bin_args)
            .env("CARGO_TARGET_DIR", &dir)
            .env(
                format!("CARGO_TARGET_{env}_LINKER"),
                "aarch64-linux-gnu-gcc",
            )
            // Only the target's artifacts: build scripts and proc macros
            // stay ordinary host programs.
            .env(
                format!("CARGO_TARGET_{env}_RUSTFLAGS"),
                format!(
                    "{flags} -C link-self-contained=no -C link-arg=-specs={MUSL_SPECS} \
                     -L native={}",
                    unwind.display()
                ),
            )
            .env(format!("CC_{cc}"), "aarch64-linux-gnu-gcc")
            .env(format!("AR_{cc}"), "aarch64-linux-gnu-ar")
            .env(format!("CFLAGS_{cc}"), format!("-specs {MUSL_SPECS}")),
    )?;
    Ok(bins.iter().map(|bin| built(arch, bin)).collect())
}

/// The cross build's target directory: `LOCKSTEP_CROSS_TARGET_DIR` when
/// set, else `target/cross/`.
pub fn cross_dir() -> PathBuf {
    match std::env::var_os("LOCKSTEP_CROSS_TARGET_DIR") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => crate::root().join("target/cross"),
    }
}

/// The host build's own target directory when `LOCKSTEP_SHIP_TARGET_DIR`
/// is set (CI keeps it outside the clone, as the cross build's: a run
/// recompiles only what changed, not every dependency in the ship
/// profile); else the workspace's.
pub fn ship_dir() -> Option<PathBuf> {
    std::env::var_os("LOCKSTEP_SHIP_TARGET_DIR")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
}

/// Where the built binary `bin` of `arch` is, built or not.
pub fn built(arch: Arch, bin: &str) -> PathBuf {
    let base = if arch.is_host() {
        ship_dir().unwrap_or_else(crate::target_dir)
    } else {
        cross_dir()
    };
    base.join(arch.target()).join("ship").join(bin)
}

/// Makes `tools/aarch64-musl/libunwind.a` in the cross build's target
/// directory (Debian's LLVM libunwind with the fortify shim) unless it is
/// there; returns its directory.
fn unwinder() -> anyhow::Result<PathBuf> {
    let dir = cross_dir().join("tools/aarch64-musl");
    let archive = dir.join("libunwind.a");
    let shim_c = dir.join("fortify_shim.c");
    if archive.exists() && std::fs::read_to_string(&shim_c).is_ok_and(|s| s == FORTIFY_SHIM) {
        return Ok(dir);
    }
    ensure!(
        std::path::Path::new(LIBUNWIND).exists() && std::path::Path::new(MUSL_SPECS).exists(),
        "{LIBUNWIND} or {MUSL_SPECS} is missing: run `cargo xtask setup` (it adds dpkg's arm64 \
         architecture and installs libunwind-16-dev:arm64 and musl-dev:arm64)"
    );
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::write(&shim_c, FORTIFY_SHIM)?;
    let shim_o = dir.join("fortify_shim.o");
    crate::run(
        Command::new("aarch64-linux-gnu-gcc")
            .args(["-specs", MUSL_SPECS, "-O2", "-c"])
            .arg(&shim_c)
            .arg("-o")
            .arg(&shim_o),
    )?;
    let partial = dir.join("libunwind.a.partial");
    std::fs::copy(LIBUNWIND, &partial).with_context(|| format!("copying {LIBUNWIND}"))?;
    crate::run(
        Command::new("aarch64-linux-gnu-ar")
            .arg("rs")
            .arg(&partial)
            .arg(&shim_o),
    )?;
    std::fs::rename(&partial, &archive)?;
    Ok(dir)
}
