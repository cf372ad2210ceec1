//! lockstep's developer tasks: `cargo xtask <task>`.
//!
//! - `setup`: installs, idempotently, everything the build and the tests need.
//! - `build-ebpf`: builds the eBPF object with BTF.
//! - `build`: the agent (which embeds the object) and the plugin, static
//!   musl binaries, as they ship; `--arch aarch64` cross-builds them.
//! - `image`: the OCI image `lockstep:<version>` (podman, FROM scratch);
//!   `--arch aarch64` the arm64 one.
//! - `test`: formatting, lints, purity of the core, unit tests, then the
//!   root-only integration tests and the three demos.
//! - `bench <suite>`: benchmarks with medians.
//! - `crash <suite> <rounds>`: the long forms of the crash tests (CI runs
//!   them bounded): `startup` (kills aimed at start-up), `power` (power cuts).
//! - `explore`: long random runs of the core's property tests.
//! - `demo`: a sandbox node made of network namespaces.

mod arch;
mod bench;
mod demo;
mod disk;
mod doc_commands;
mod explore;
mod fresh_root;
mod image;
mod protoc;
mod setup;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "xtask")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Debug, Subcommand)]
enum Task {
    /// Install every prerequisite (idempotent; a second run changes nothing).
    Setup,
    /// Build the eBPF programs with BTF.
    BuildEbpf,
    /// Build the agent (embeds the eBPF object) and the plugin as they
    /// ship: static musl binaries, stripped, link-time optimised.
    Build {
        /// The architecture (default: the machine's; `aarch64` is
        /// cross-built with nightly's build-std).
        #[arg(long, value_enum)]
        arch: Option<arch::Arch>,
    },
    /// Build the OCI image `localhost/lockstep:<version>` with podman (FROM
    /// scratch, no registry) from the binaries `build` makes.
    Image {
        /// The version the agent reports and the image is tagged with
        /// (default: the workspace's version).
        #[arg(long)]
        version: Option<String>,
        /// The architecture (default: the machine's); the arm64 image is
        /// tagged `localhost/lockstep:<version>-arm64`.
        #[arg(long, value_enum)]
        arch: Option<arch::Arch>,
    },
    /// Validate the Kubernetes manifests in deploy/ against the API schemas
    /// (offline: kubernetes-validate, installed by setup).
    ValidateManifests,
    /// Check that lockstep-core depends on no I/O, kernel or clock crate.
    CheckCore,
    /// Check that every command the README and docs/ tell a user to run is
    /// run by a test (or, where it cannot run here, that its doc says so).
    DocCommands,
    /// Write docs/configuration.md, the configuration reference generated
    /// from the agent's config types (a unit test fails while the
    /// committed file differs).
    ConfigReference,
    /// Setup, the build of every binary and of the eBPF object, and the
    /// unit tests, inside a throwaway Debian root holding only what a fresh
    /// machine has plus what setup installs (root; cached by setup's list).
    FreshRoot,
    /// Setup, lints, unit tests and the privileged integration tests.
    Test {
        /// Skip `setup` (already done).
        #[arg(long)]
        no_setup: bool,
        /// Only run integration tests whose name contains this.
        filter: Option<String>,
    },
    /// Run a benchmark suite: core, lb, datapath, agent, cni, image, masquerade, cluster, tunnel, all.
    Bench {
        /// The suite.
        suite: String,
        /// A smoke run: small sizes on the debug build, no goal judged
        /// (`cargo xtask test` runs every suite so).
        #[arg(long)]
        smoke: bool,
    },
    /// Run a crash test in its long form: `startup` (SIGKILL at the k-th
    /// write to the database during start-up) or `power` (power cuts on a
    /// file system that drops unsynced writes).
    Crash {
        /// The suite: startup or power.
        suite: String,
        /// How many rounds (kills or cuts).
        rounds: usize,
        /// startup: the largest k (the kill lands at a write from 1 to k).
        #[arg(long, default_value_t = 40)]
        max_k: u64,
    },
    /// Long random runs of the core's property tests (CI runs them with a
    /// fixed seed): fresh seeds, many cases, split over parallel jobs.
    Explore {
        /// Cases per property test, over all jobs (default:
        /// `LOCKSTEP_EXPLORE_CASES`, else 10000).
        #[arg(long)]
        cases: Option<u64>,
        /// The base seed (default: random; printed).
        #[arg(long)]
        seed: Option<u64>,
        /// Parallel test processes (default: the CPUs).
        #[arg(long)]
        jobs: Option<usize>,
        /// Only the tests whose name contains this (e.g. `never_two`).
        filter: Option<String>,
    },
    /// Set up and run the demo node (`--cluster`: three nodes and etcd).
    Demo {
        /// Skip `setup` (already done).
        #[arg(long)]
        no_setup: bool,
        /// Run the cluster demo instead: three node namespaces sharing
        /// pools through a 3-member etcd, pods pinging across nodes.
        #[arg(long)]
        cluster: bool,
        /// Run the Kubernetes demo instead: a LoadBalancer Service gets
        /// its address in its status from the API (the test double) and
        /// the address is answered on the node's uplink.
        #[arg(long, conflicts_with = "cluster")]
        kubernetes: bool,
    },
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the root")
        .to_path_buf()
}

/// Cargo's target directory for this workspace (`CARGO_TARGET_DIR` when
/// set).
fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root().join("target"), PathBuf::from)
}

pub(crate) fn run(cmd: &mut Command) -> anyhow::Result<()> {
    eprintln!("+ {cmd:?}");
    let started = std::time::Instant::now();
    let status = cmd
        .status()
        .with_context(|| format!("starting {:?}", cmd.get_program()))?;
    took(cmd, started);
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

/// Says how long a command took (a line CI's log can be searched for:
/// `took`), so where a run's time goes is read, not guessed.
fn took(cmd: &Command, started: std::time::Instant) {
    let args: Vec<_> = cmd
        .get_args()
        .take(4)
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    eprintln!(
        "took {:.0} s: {} {}",
        started.elapsed().as_secs_f64(),
        cmd.get_program().to_string_lossy(),
        args.join(" ")
    );
}

fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(root());
    cmd
}

/// Crates the pure core must never depend on (directly or not).
const FORBIDDEN_IN_CORE: &[&str] = &[
    "tokio",
    "aya",
    "aya-obj",
    "libc",
    "rtnetlink",
    "netlink-packet-route",
    "netlink-sys",
    "nix",
    "rustix",
    "mio",
    "socket2",
    "tempfile",
    "walkdir",
    "chrono",
    "time",
    "redb",
    "rand",
    "getrandom",
];

fn check_core() -> anyhow::Result<()> {
    let out = cargo()
        .args([
            "tree",
            "-p",
            "lockstep-core",
            "-e",
            "normal",
            "--prefix",
            "none",
            "--format",
            "{p}",
        ])
        .output()
        .context("running cargo tree")?;
    if !out.status.success() {
        bail!(
            "cargo tree failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let tree = String::from_utf8(out.stdout)?;
    let mut bad = Vec::new();
    for line in tree.lines() {
        let name = line.split_whitespace().next().unwrap_or_default();
        if FORBIDDEN_IN_CORE.contains(&name) {
            bad.push(line.to_string());
        }
    }
    bad.sort();
    bad.dedup();
    if !bad.is_empty() {
        bail!(
            "lockstep-core must stay pure, but depends on: {}",
            bad.join(", ")
        );
    }
    let count = tree.lines().count();
    println!(
        "lockstep-core is pure: {count} crates in its normal dependency tree, none of {}",
        FORBIDDEN_IN_CORE.join(", ")
    );
    Ok(())
}

fn test(no_setup: bool, filter: Option<String>) -> anyhow::Result<()> {
    // A fresh clone's test builds take about 9 GiB (70-odd test binaries);
    // the fresh root, when it must be rebuilt, 8 GiB more (checked there).
    disk::ensure_free(&target_dir(), 10, "cargo xtask test")?;
    if !no_setup {
        setup::setup()?;
    }
    // The aarch64 build beside the lints and unit tests (it needs what
    // setup installs); the integration tests wait for it.
    let cross = if skip_arm64() {
        None
    } else {
        Some(arch::start_cross_build()?)
    };
    run(cargo().args(["fmt", "--all", "--check"]))?;
    run(cargo().args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]))?;
    // Documentation links that resolve nowhere (or to a private item from a
    // public one) are bugs in the docs: refused like lints.
    run(cargo()
        .args(["doc", "--workspace", "--no-deps"])
        .env("RUSTDOCFLAGS", "-D warnings"))?;
    // The eBPF programs are a workspace of their own: linted alike.
    lockstep_ebpf_build::lint(&root())?;
    println!("eBPF programs: cargo fmt --check and clippy -D warnings clean");
    check_core()?;
    doc_commands::check(&root())?;
    setup::validate_manifests()?;
    let mut tally = Tally::default();
    let demos_too = filter.as_deref().is_none_or(|f| "demo".contains(f));
    let outcome = run_tests(
        cargo().args(["test", "--workspace", "--exclude", "lockstep-tests"]),
        &mut tally,
    )
    .and_then(|()| integration(filter, &mut tally, cross));
    // The fresh-root check builds in a root of its own (its output in
    // target/fresh-root.log) while the demos and the benchmarks' smoke
    // runs go on: those judge no figure, so its load changes nothing they
    // check, and they leave the CPU mostly idle. After the integration
    // tests, whose timings it would disturb.
    let fresh = std::thread::spawn(fresh_root_unless_skipped);
    // The demos, as a user runs them (each step checks what it claims):
    // after the integration tests, whose failure does not hide theirs.
    let demos = if demos_too {
        stage_agent_with_shipped_plugin().and_then(|bin| demo::all(&bin, &mut tally))
    } else {
        Ok(())
    };
    let outcome = outcome.and(demos);
    // Every benchmark suite as a smoke test, so a bench command that no
    // longer runs is caught here; the goals are judged by `cargo xtask
    // bench`, not on CI's loaded machine.
    let benches = if demos_too {
        bench::smoke_all(&mut tally)
    } else {
        Ok(())
    };
    let outcome = outcome.and(benches);
    // A failure of any stage still shows the others' outcomes.
    let fresh = fresh
        .join()
        .unwrap_or_else(|_| Err(anyhow::anyhow!("the fresh-root check's thread panicked")));
    match &fresh {
        Ok(()) => tally.passed += 1,
        Err(e) => {
            tally.failed += 1;
            eprintln!("{e:#}");
        }
    }
    // One closing line over every suite: the last runner line alone would
    // be the (empty) doc-test run of the test crate.
    println!("tests: {} passed, {} failed", tally.passed, tally.failed);
    outcome.and(fresh)
}

/// Whether `LOCKSTEP_SKIP_ARM64=1` opts out of the aarch64 build and its
/// tests.
fn skip_arm64() -> bool {
    std::env::var_os("LOCKSTEP_SKIP_ARM64").is_some_and(|v| v == "1")
}

/// The fresh-root check (`cargo xtask fresh-root`), unless
/// `LOCKSTEP_SKIP_FRESH_ROOT=1` skips it explicitly (it says so).
fn fresh_root_unless_skipped() -> anyhow::Result<()> {
    if std::env::var_os("LOCKSTEP_SKIP_FRESH_ROOT").is_some_and(|v| v == "1") {
        println!(
            "fresh-root: SKIPPED (LOCKSTEP_SKIP_FRESH_ROOT=1): the build was not checked in a fresh root"
        );
        return Ok(());
    }
    let log = root().join("target/fresh-root.log");
    println!(
        "fresh-root: started beside the demos and benchmarks; its build's output: {}",
        log.display()
    );
    fresh_root::check_to(Some(&log))
}

/// Tests counted over several `cargo test` runs.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    pub(crate) passed: u64,
    pub(crate) failed: u64,
}

/// Runs a `cargo test` command, echoing its output, and adds the counts of
/// its `test result:` lines to `tally`.
fn run_tests(cmd: &mut Command, tally: &mut Tally) -> anyhow::Result<()> {
    use std::io::BufRead as _;
    eprintln!("+ {cmd:?}");
    let started = std::time::Instant::now();
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .spawn()
        .with_context(|| format!("{cmd:?}"))?;
    let stdout = child.stdout.take().context("no stdout")?;
    for line in std::io::BufReader::new(stdout).lines() {
        let line = line?;
        println!("{line}");
        if let Some(rest) = line.strip_prefix("test result: ") {
            let count = |what: &str| -> u64 {
                rest.split(';')
                    .find_map(|part| {
                        part.trim()
                            .trim_start_matches("ok. ")
                            .trim_start_matches("FAILED. ")
                            .strip_suffix(what)
                    })
                    .and_then(|n| n.trim().parse().ok())
                    .unwrap_or(0)
            };
            tally.passed += count(" passed");
            tally.failed += count(" failed");
        }
    }
    let status = child.wait()?;
    took(cmd, started);
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

fn integration(
    filter: Option<String>,
    tally: &mut Tally,
    cross: Option<arch::Background>,
) -> anyhow::Result<()> {
    // This architecture's shipped build, and the aarch64 one started
    // beside the lints; what follows finds them built.
    arch::build_shipped(arch::Arch::host()?, &arch::SHIPPED)?;
    if let Some(cross) = cross {
        cross.wait()?;
    }
    let bin = stage_agent_with_shipped_plugin()?;
    // The image test builds its images from this context (the binaries as
    // they ship), in its own podman storage.
    let context = image::stage(&image::default_version(), arch::Arch::host()?)?;
    let mut cmd = cargo();
    // Every test binary runs even when one fails, so one CI run shows
    // every failure.
    cmd.args(["test", "-p", "lockstep-tests", "--no-fail-fast"])
        .env("LOCKSTEP_BIN", &bin)
        .env("LOCKSTEP_IMAGE_CONTEXT", &context);
    // tests/tests/arm64.rs: the cross-built agent under qemu-user, and the
    // arm64 image built from its context; `LOCKSTEP_SKIP_ARM64=1` skips the
    // cross build and those tests (they say so).
    if skip_arm64() {
        println!("arm64: SKIPPED (LOCKSTEP_SKIP_ARM64=1): the aarch64 build was not made");
    } else {
        let context = image::stage(&image::default_version(), arch::Arch::Aarch64)?;
        cmd.env(
            "LOCKSTEP_ARM64_BIN",
            arch::built(arch::Arch::Aarch64, "lockstep"),
        )
        .env("LOCKSTEP_IMAGE_CONTEXT_ARM64", &context);
    }
    cmd.arg("--");
    if let Some(f) = filter {
        cmd.arg(f);
    }
    run_tests(&mut cmd, tally)
}

/// Builds the agent (cargo's debug build) and the plugin as it ships, and
/// puts them side by side in `target/staged/`. The agent installs the
/// `lockstep-cni` it finds beside its own executable, so the integration
/// tests and the demo run the static musl plugin a node gets, not cargo's
/// debug build of it. The agent is hard-linked (copied across file systems):
/// `/proc/self/exe` names the path it was started from. Returns the agent.
pub(crate) fn stage_agent_with_shipped_plugin() -> anyhow::Result<PathBuf> {
    run(cargo().args(["build", "-p", "lockstep", "--bins"]))?;
    let plugin = build_plugin()?;
    let dir = root().join("target/staged");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let agent = dir.join("lockstep");
    let staged_plugin = dir.join("lockstep-cni");
    for old in [&agent, &staged_plugin] {
        if old.exists() {
            std::fs::remove_file(old).with_context(|| format!("removing {}", old.display()))?;
        }
    }
    let built = root().join("target/debug/lockstep");
    if std::fs::hard_link(&built, &agent).is_err() {
        std::fs::copy(&built, &agent).with_context(|| format!("copying {}", built.display()))?;
    }
    std::fs::copy(&plugin, &staged_plugin)
        .with_context(|| format!("copying {}", plugin.display()))?;
    Ok(agent)
}

/// Builds `lockstep-cni` the way it ships: a static musl binary, position
/// dependent and stripped. A runtime starts one
/// plugin process per call, so start-up is on every pod's path. Measured on
/// the project VM (a Firecracker guest, where each `cpuid` instruction traps
/// to the hypervisor for ~4 us): a static asm `exit` starts in 0.14 ms, a
/// static glibc C `main` that returns at once in 0.40 ms (glibc's start-up
/// probes the CPU with dozens of `cpuid`s to pick its string functions), the
/// plugin on glibc in 0.48 ms and on musl, which probes nothing, in 0.21 ms.
/// Non-PIE gives up ASLR for the plugin's own code, as the Go reference
/// plugins (non-PIE by default) do; the plugin lives for one call and its
/// input comes from the runtime. The target is named explicitly, so the
/// flags reach only the target artifacts, never build scripts or proc
/// macros. `cargo xtask setup` installs the target. The profile is `ship`
/// (link-time optimised, see Cargo.toml). Returns the binary's path.
pub(crate) fn build_plugin() -> anyhow::Result<PathBuf> {
    build_shipped("lockstep-cni")
}

/// Builds `bin` of the `lockstep` package as it ships, for the machine's
/// architecture: the plugin's target and flags (see [`build_plugin`]), in
/// the `ship` profile (link-time optimised). The agent in the image is built
/// the same way, so the two share every compiled dependency (the plugin
/// links the daemon's library too) and the image needs no C library: a
/// static agent adds only its own link step. Being position dependent, the
/// agent's code is not randomised (its stack, heap and mappings are), the
/// price of sharing one build with the plugin. Returns the binary's path.
fn build_shipped(bin: &str) -> anyhow::Result<PathBuf> {
    arch::build_shipped(arch::Arch::host()?, &[bin])?
        .pop()
        .context("the build named no binary")
}

/// The long form of a crash test: the same test CI runs bounded, with more
/// rounds, its output (figures at the end) shown.
fn crash(suite: &str, rounds: usize, max_k: u64) -> anyhow::Result<()> {
    let (test, vars) = match suite {
        "startup" => (
            "startup_kill",
            vec![
                ("LOCKSTEP_STARTUP_KILLS", rounds.to_string()),
                ("LOCKSTEP_STARTUP_KILL_MAX_K", max_k.to_string()),
            ],
        ),
        "power" => (
            "power_loss",
            vec![("LOCKSTEP_POWER_CUTS", rounds.to_string())],
        ),
        other => bail!("unknown crash suite {other}; known: startup, power"),
    };
    let bin = stage_agent_with_shipped_plugin()?;
    run(cargo()
        .args([
            "test",
            "-p",
            "lockstep-tests",
            "--test",
            test,
            "--",
            "--nocapture",
        ])
        .env("LOCKSTEP_BIN", &bin)
        .envs(vars))
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // Every task may build the agent, whose etcd door needs protoc.
    protoc::install()?;
    match cli.task {
        Task::Setup => setup::setup(),
        Task::BuildEbpf => {
            let object = lockstep_ebpf_build::build(&root())?;
            let size = std::fs::metadata(&object)?.len();
            println!("built {} ({size} bytes, with BTF)", object.display());
            Ok(())
        }
        Task::Build { arch } => {
            let arch = arch.map_or_else(arch::Arch::host, Ok)?;
            let started = std::time::Instant::now();
            let built = arch::build_shipped(arch, &arch::SHIPPED)?;
            let (agent, plugin) = (&built[0], &built[1]);
            eprintln!(
                "{} in {:.0} s\nagent: {}\nplugin: {}",
                arch.rust(),
                started.elapsed().as_secs_f64(),
                agent.display(),
                plugin.display()
            );
            Ok(())
        }
        Task::Image { version, arch } => {
            image::build(version, arch.map_or_else(arch::Arch::host, Ok)?).map(drop)
        }
        Task::ValidateManifests => setup::validate_manifests(),
        Task::CheckCore => check_core(),
        Task::DocCommands => doc_commands::check(&root()),
        Task::ConfigReference => run(cargo().args([
            "run",
            "--quiet",
            "-p",
            "lockstep",
            "--example",
            "config_reference",
        ])),
        Task::FreshRoot => fresh_root::check(),
        Task::Test { no_setup, filter } => test(no_setup, filter),
        Task::Bench { suite, smoke } => bench::Runner { smoke }.bench(&suite),
        Task::Crash {
            suite,
            rounds,
            max_k,
        } => crash(&suite, rounds, max_k),
        Task::Explore {
            cases,
            seed,
            jobs,
            filter,
        } => explore::run(&explore::Explore {
            cases: explore::cases_from(cases)?,
            seed,
            jobs: jobs.unwrap_or_else(|| {
                std::thread::available_parallelism().map_or(1, std::num::NonZero::get)
            }),
            filter,
        }),
        Task::Demo {
            no_setup,
            cluster,
            kubernetes,
        } => {
            if !no_setup {
                setup::setup()?;
            }
            let agent = stage_agent_with_shipped_plugin()?;
            let which = if cluster {
                demo::Demo::Cluster
            } else if kubernetes {
                demo::Demo::Kubernetes
            } else {
                demo::Demo::Node
            };
            demo::run(which, &agent)
        }
    }
}
