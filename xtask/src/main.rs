//! lockstep's developer tasks: `cargo xtask <task>`.
//!
//! - `setup`: installs, idempotently, everything the build and the tests need.
//! - `build-ebpf`: builds the eBPF object with BTF.
//! - `build`: the agent (which embeds the object) and the plugin, static
//!   musl binaries, as they ship.
//! - `image`: the OCI image `lockstep:<version>` (podman, FROM scratch).
//! - `test`: formatting, lints, purity of the core, unit tests, then the
//!   root-only integration tests and the three demos.
//! - `bench <suite>`: benchmarks with medians.
//! - `crash <suite> <rounds>`: the long forms of the crash tests (CI runs
//!   them bounded): `startup` (kills aimed at start-up), `power` (power cuts).
//! - `explore`: long random runs of the core's property tests.
//! - `demo`: a sandbox node made of network namespaces.

mod demo;
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
    /// ship: static musl binaries, stripped.
    Build,
    /// Build the OCI image `localhost/lockstep:<version>` with podman (FROM
    /// scratch, no registry) from the binaries `build` makes.
    Image {
        /// The version the agent reports and the image is tagged with
        /// (default: the workspace's version).
        #[arg(long)]
        version: Option<String>,
    },
    /// Validate the Kubernetes manifests in deploy/ against the API schemas
    /// (offline: kubernetes-validate, installed by setup).
    ValidateManifests,
    /// Check that lockstep-core depends on no I/O, kernel or clock crate.
    CheckCore,
    /// Check that every command the README and docs/ tell a user to run is
    /// run by a test (or, where it cannot run here, that its doc says so).
    DocCommands,
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

pub(crate) fn run(cmd: &mut Command) -> anyhow::Result<()> {
    eprintln!("+ {cmd:?}");
    let status = cmd
        .status()
        .with_context(|| format!("starting {:?}", cmd.get_program()))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
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
    if !no_setup {
        setup::setup()?;
    }
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
    .and_then(|()| integration(filter, &mut tally));
    // The demos, as a user runs them (each step checks what it claims):
    // after the integration tests, whose failure does not hide theirs.
    let demos = if demos_too {
        stage_agent_with_shipped_plugin().and_then(|bin| demo::all(&bin, &mut tally))
    } else {
        Ok(())
    };
    let outcome = outcome.and(demos);
    // After the integration tests, so a failure of either still shows the
    // other's outcome.
    let fresh = fresh_root_unless_skipped();
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

/// The fresh-root check (`cargo xtask fresh-root`), unless
/// `LOCKSTEP_SKIP_FRESH_ROOT=1` skips it explicitly (it says so).
fn fresh_root_unless_skipped() -> anyhow::Result<()> {
    if std::env::var_os("LOCKSTEP_SKIP_FRESH_ROOT").is_some_and(|v| v == "1") {
        println!(
            "fresh-root: SKIPPED (LOCKSTEP_SKIP_FRESH_ROOT=1): the build was not checked in a fresh root"
        );
        return Ok(());
    }
    fresh_root::check()
}

/// Tests counted over several `cargo test` runs.
#[derive(Debug, Default)]
struct Tally {
    passed: u64,
    failed: u64,
}

/// Runs a `cargo test` command, echoing its output, and adds the counts of
/// its `test result:` lines to `tally`.
fn run_tests(cmd: &mut Command, tally: &mut Tally) -> anyhow::Result<()> {
    use std::io::BufRead as _;
    eprintln!("+ {cmd:?}");
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
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

fn integration(filter: Option<String>, tally: &mut Tally) -> anyhow::Result<()> {
    let bin = stage_agent_with_shipped_plugin()?;
    // The image test builds its images from this context (the binaries as
    // they ship), in its own podman storage.
    let context = image::stage(&image::default_version())?;
    let mut cmd = cargo();
    // Every test binary runs even when one fails, so one CI run shows
    // every failure.
    cmd.args(["test", "-p", "lockstep-tests", "--no-fail-fast"])
        .env("LOCKSTEP_BIN", &bin)
        .env("LOCKSTEP_IMAGE_CONTEXT", &context)
        .arg("--");
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
fn stage_agent_with_shipped_plugin() -> anyhow::Result<PathBuf> {
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
/// dependent and stripped, in the `plugin` profile. A runtime starts one
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
/// macros. `cargo xtask setup` installs the target. Returns the binary's path.
fn build_plugin() -> anyhow::Result<PathBuf> {
    build_shipped("lockstep-cni")
}

/// Builds `bin` of the `lockstep` package as it ships: the plugin's profile,
/// target and flags (see [`build_plugin`]). The agent in the image is built
/// the same way, so the two share every compiled dependency (the plugin
/// links the daemon's library too) and the image needs no C library: a
/// static agent adds only its own link step. Being position dependent, the
/// agent's code is not randomised (its stack, heap and mappings are), the
/// price of sharing one build with the plugin. Returns the binary's path.
fn build_shipped(bin: &str) -> anyhow::Result<PathBuf> {
    let target = setup::plugin_target();
    run(cargo()
        .args(["build", "--profile", "plugin", "--target", &target])
        .args(["-p", "lockstep", "--bin", bin])
        .env(
            "RUSTFLAGS",
            "-C target-feature=+crt-static -C relocation-model=static",
        ))?;
    Ok(root().join("target").join(target).join("plugin").join(bin))
}

/// Runs every ignored test (the benchmarks) of `tests/tests/<test>.rs`
/// against the release agent, optimised as shipped.
fn release_benchmark_test(test: &str) -> anyhow::Result<()> {
    release_benchmark(test, None)
}

/// As [`release_benchmark_test`], only the ignored tests whose name is
/// `only` when given.
fn release_benchmark(test: &str, only: Option<&str>) -> anyhow::Result<()> {
    run(cargo().args(["build", "--release", "-p", "lockstep", "--bins"]))?;
    let mut cmd = cargo();
    cmd.args(["test", "--release", "-p", "lockstep-tests", "--test", test])
        .args(["--", "--ignored", "--nocapture", "--test-threads", "1"])
        .env("LOCKSTEP_BIN", root().join("target/release/lockstep"));
    if let Some(name) = only {
        cmd.args(["--exact", name]);
    }
    run(&mut cmd)
}

/// The benchmark suites `cargo xtask bench` knows (`all` runs each).
pub(crate) const BENCH_SUITES: &[&str] = &[
    "core",
    "lb",
    "datapath",
    "agent",
    "cni",
    "image",
    "masquerade",
    "cluster",
    "tunnel",
    "all",
];

fn bench(suite: &str) -> anyhow::Result<()> {
    match suite {
        "core" => run(cargo().args(["bench", "-p", "lockstep-core", "--bench", "core"])),
        "lb" => {
            run(cargo().args(["bench", "-p", "lockstep-core", "--bench", "lb"]))?;
            // Cluster mode (three node namespaces, a real 3-member etcd;
            // docs/cluster.md), every ignored test of cluster_lb_e2e:
            // failover gap p50/p99 over at least 50 handovers with the
            // default lease, overlaps counted (lb_failover_bench; goals
            // gated, the suite fails on a miss: no overlap, gap p99 <=
            // 1.5 s, #27); and the
            // assignment p99 in cluster mode, 200 services applied one by
            // one, apply to `lb get` and to an ARP answer
            // (lb_assignment_bench).
            release_benchmark_test("cluster_lb_e2e")?;
            // Kubernetes (#28; docs/kubernetes.md): Service created ->
            // status written, p50/p99 over 200 Services through the API
            // double, goal p99 <= 1 s (the test fails on a miss).
            release_benchmark_test("kubernetes_e2e")?;
            // The responders' per-packet cost (ARP and, #13, NDP replies
            // against the empty program); the masquerade rows are `bench
            // datapath`'s.
            run(cargo()
                .args(["bench", "-p", "lockstep", "--bench", "datapath"])
                .env("LOCKSTEP_BENCH_RESPONDERS_ONLY", "1"))
        }
        "datapath" => run(cargo().args(["bench", "-p", "lockstep", "--bench", "datapath"])),
        "agent" => run(cargo().args(["bench", "-p", "lockstep", "--bench", "agent"])),
        "cni" => {
            let plugin = build_plugin()?;
            run(cargo()
                .args(["bench", "-p", "lockstep", "--bench", "cni"])
                .env("LOCKSTEP_CNI_BIN", plugin))?;
            // Cluster mode (#43): a full ADD with a block and its
            // reservation window in hand beside a single-node agent, and
            // the window's refills under 100 ADDs/s.
            release_benchmark("cluster_bench", Some("cluster_cni"))
        }
        "masquerade" => {
            // lockstep's BPF masquerade beside nftables `masquerade`, in
            // identical namespaces; the test prints the medians and ratios.
            // Optimised: a debug client and server would be what limits
            // connections per second on every side alike.
            release_benchmark_test("masq_bench")?;
            // #31: an established flow's translation beside the NAT lookup
            // alone, through BPF_PROG_TEST_RUN (the datapath bench's rows).
            run(cargo()
                .args(["bench", "-p", "lockstep", "--bench", "datapath"])
                .env("LOCKSTEP_BENCH_MASQUERADE_ONLY", "1"))
        }
        "tunnel" => {
            // Pod-to-pod TCP native vs lockstep's tunnel vs the kernel's own
            // VXLAN with routes, in identical namespaces, rounds rotating
            // (tunnel_bench prints medians and checks the goals); then the
            // encapsulation's per-packet cost over the empty program.
            release_benchmark_test("tunnel_bench")?;
            run(cargo()
                .args(["bench", "-p", "lockstep", "--bench", "datapath"])
                .env("LOCKSTEP_BENCH_TUNNEL_ONLY", "1"))
        }
        "cluster" => {
            // Block claims through the cluster door against a real 3-member
            // etcd started by the test, up to 5,000 simulated nodes; then
            // agents in node namespaces (convergence, ADD in cluster mode,
            // 100 parallel ADDs without a block), optimised as shipped.
            release_benchmark_test("cluster_bench")?;
            // Steady state (#27 item 7): 100, 1,000 and 5,000 simulated
            // nodes running the agent's cluster tasks idle, etcd's own
            // counters per node; 5,000 LB services applied.
            release_benchmark_test("cluster_steady")
        }
        "image" => {
            // The image test prints the figures: image size, and container
            // start to ready with 10k allocations in the store.
            let bin = stage_agent_with_shipped_plugin()?;
            let context = image::stage(&image::default_version())?;
            run(cargo()
                .args(["test", "-p", "lockstep-tests", "--test", "image"])
                .args(["--", "--nocapture", "--test-threads", "1"])
                .env("LOCKSTEP_BIN", &bin)
                .env("LOCKSTEP_IMAGE_CONTEXT", &context))
        }
        "all" => {
            // Every suite runs even when an earlier one misses a goal, so one
            // run gives the whole picture; the misses are listed at the end.
            let mut missed = Vec::new();
            for suite in BENCH_SUITES.iter().copied().filter(|s| *s != "all") {
                if let Err(e) = bench(suite) {
                    eprintln!("bench {suite}: {e}");
                    missed.push(suite);
                }
            }
            if missed.is_empty() {
                Ok(())
            } else {
                bail!(
                    "suites with a goal missed or an error: {}",
                    missed.join(", ")
                )
            }
        }
        other => {
            bail!(
                "unknown bench suite {other}; known: {}",
                BENCH_SUITES.join(", ")
            )
        }
    }
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
        Task::Build => {
            let agent = build_shipped("lockstep")?;
            let plugin = build_plugin()?;
            eprintln!("agent: {}\nplugin: {}", agent.display(), plugin.display());
            Ok(())
        }
        Task::Image { version } => image::build(version),
        Task::ValidateManifests => setup::validate_manifests(),
        Task::CheckCore => check_core(),
        Task::DocCommands => doc_commands::check(&root()),
        Task::FreshRoot => fresh_root::check(),
        Task::Test { no_setup, filter } => test(no_setup, filter),
        Task::Bench { suite } => bench(&suite),
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
