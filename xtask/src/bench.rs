//! `cargo xtask bench <suite>`: the benchmark suites, each run optimised
//! with its goals judged (medians and ratios measured side by side in one
//! run), or with `--smoke` as a smoke test: small sizes on the debug build,
//! no goal judged, which `cargo xtask test` runs for every suite so that a
//! benchmark command that no longer runs is caught by CI.

use std::process::Command;
use std::time::Instant;

use anyhow::bail;

use crate::{Tally, cargo, root, run};

/// The benchmark suites `cargo xtask bench` knows (`all` runs each).
pub const BENCH_SUITES: &[&str] = &[
    "core",
    "lb",
    "datapath",
    "agent",
    "cni",
    "image",
    "masquerade",
    "cluster",
    "tunnel",
    "bgp",
    "all",
];

/// How the suites run: optimised and judged, or as a smoke test.
#[derive(Clone, Copy, Debug)]
pub struct Runner {
    /// Small sizes on the debug build, no goal judged
    /// (`LOCKSTEP_BENCH_SMOKE=1`).
    pub smoke: bool,
}

impl Runner {
    /// `cargo bench <args>`: the bench profile, or the debug build in a
    /// smoke run.
    fn cargo_bench(self, args: &[&str]) -> Command {
        let mut cmd = cargo();
        cmd.arg("bench").args(args);
        if self.smoke {
            cmd.args(["--profile", "dev"])
                .env("LOCKSTEP_BENCH_SMOKE", "1");
        }
        cmd
    }

    /// Runs every ignored test (the benchmarks) of `tests/tests/<test>.rs`
    /// against the release agent, optimised as shipped (in a smoke run:
    /// the staged debug agent and test build).
    fn benchmark_test(self, test: &str) -> anyhow::Result<()> {
        self.benchmark(test, None)
    }

    /// As [`Runner::benchmark_test`], only the ignored test named `only`
    /// when given.
    fn benchmark(self, test: &str, only: Option<&str>) -> anyhow::Result<()> {
        let bin = if self.smoke {
            crate::stage_agent_with_shipped_plugin()?
        } else {
            run(cargo().args(["build", "--release", "-p", "lockstep", "--bins"]))?;
            root().join("target/release/lockstep")
        };
        let mut cmd = cargo();
        cmd.args(["test", "-p", "lockstep-tests", "--test", test]);
        if self.smoke {
            cmd.env("LOCKSTEP_BENCH_SMOKE", "1");
        } else {
            cmd.arg("--release");
        }
        cmd.args(["--", "--ignored", "--nocapture", "--test-threads", "1"])
            .env("LOCKSTEP_BIN", bin);
        if let Some(name) = only {
            cmd.args(["--exact", name]);
        }
        run(&mut cmd)
    }

    /// Runs `suite`.
    ///
    /// # Errors
    /// A goal missed (not judged in a smoke run), or the suite failed to
    /// build or run.
    pub fn bench(self, suite: &str) -> anyhow::Result<()> {
        match suite {
            "core" => run(&mut self.cargo_bench(&["-p", "lockstep-core", "--bench", "core"])),
            "lb" => {
                run(&mut self.cargo_bench(&["-p", "lockstep-core", "--bench", "lb"]))?;
                // Cluster mode (three node namespaces, a real 3-member etcd;
                // docs/cluster.md), every ignored test of cluster_lb_e2e:
                // failover gap p50/p99 over at least 50 handovers with the
                // default lease, overlaps counted, alone and then beside full
                // CNI ADDs and DELs on every node (lb_failover_bench; goals
                // gated, the suite fails on a miss: no overlap, gap p99 <=
                // 1.5 s, #27, both times, #46); and the
                // assignment p99 in cluster mode, 200 services applied one by
                // one, apply to `lb get` and to an ARP answer
                // (lb_assignment_bench).
                self.benchmark_test("cluster_lb_e2e")?;
                // Kubernetes (#28; docs/kubernetes.md): Service created ->
                // status written, p50/p99 over 200 Services through the API
                // double, goal p99 <= 1 s (the test fails on a miss).
                self.benchmark_test("kubernetes_e2e")?;
                // Without etcd (#44 item 1): the Lease-elected writer
                // SIGKILLed, gap p99 over at least 10 kills, overlaps
                // counted (goals gated: no overlap, p99 <= 1.5 s); and
                // Service created -> status written for 200 Services
                // (goal gated: p99 <= 1 s, no 409).
                self.benchmark_test("kubernetes_one_writer")?;
                // externalTrafficPolicy: Local (#44 item 3): an endpoint
                // moved to another node in a rolling update, slice updated
                // -> answered from the new node, p99 over 20 moves, probe
                // rounds answered by two nodes counted (goals gated: none,
                // p99 <= 1.5 s).
                self.benchmark_test("kubernetes_local_traffic")?;
                // The responders' per-packet cost (ARP and, #13, NDP replies
                // against the empty program); the masquerade rows are `bench
                // datapath`'s.
                run(self
                    .cargo_bench(&["-p", "lockstep", "--bench", "datapath"])
                    .env("LOCKSTEP_BENCH_RESPONDERS_ONLY", "1"))
            }
            "datapath" => run(&mut self.cargo_bench(&["-p", "lockstep", "--bench", "datapath"])),
            "agent" => run(&mut self.cargo_bench(&["-p", "lockstep", "--bench", "agent"])),
            "cni" => {
                let plugin = crate::build_plugin()?;
                run(self
                    .cargo_bench(&["-p", "lockstep", "--bench", "cni"])
                    .env("LOCKSTEP_CNI_BIN", plugin))?;
                // Cluster mode (#43): a full ADD with a block and its
                // reservation window in hand beside a single-node agent, and
                // the window's refills under 100 ADDs/s.
                self.benchmark("cluster_bench", Some("cluster_cni"))
            }
            "masquerade" => {
                // lockstep's BPF masquerade beside nftables `masquerade`, in
                // identical namespaces; the test prints the medians and ratios.
                // Optimised: a debug client and server would be what limits
                // connections per second on every side alike.
                self.benchmark_test("masq_bench")?;
                // #31: an established flow's translation beside the NAT lookup
                // alone, through BPF_PROG_TEST_RUN (the datapath bench's rows).
                run(self
                    .cargo_bench(&["-p", "lockstep", "--bench", "datapath"])
                    .env("LOCKSTEP_BENCH_MASQUERADE_ONLY", "1"))
            }
            "bgp" => {
                // #48: the agent with [bgp] beside BIRD and an FRR router in
                // namespaces; Service applied -> route in the router's table,
                // p50/p99 over 200 Services one by one (goal p99 <= 1 s), and
                // 1,000 Services applied and deleted at once with no session
                // reset (the test fails on a miss).
                self.benchmark_test("bgp_bench")
            }
            "tunnel" => {
                // Pod-to-pod TCP native vs lockstep's tunnel vs the kernel's own
                // VXLAN with routes, in identical namespaces, rounds rotating
                // (tunnel_bench prints medians and checks the goals); then the
                // encapsulation's per-packet cost over the empty program.
                self.benchmark_test("tunnel_bench")?;
                run(self
                    .cargo_bench(&["-p", "lockstep", "--bench", "datapath"])
                    .env("LOCKSTEP_BENCH_TUNNEL_ONLY", "1"))
            }
            "cluster" => {
                // Block claims through the cluster door against a real 3-member
                // etcd started by the test, up to 5,000 simulated nodes; then
                // agents in node namespaces (convergence, ADD in cluster mode,
                // 100 parallel ADDs without a block), optimised as shipped.
                self.benchmark_test("cluster_bench")?;
                // Steady state (#27 item 7): 100, 1,000 and 5,000 simulated
                // nodes running the agent's cluster tasks idle, etcd's own
                // counters per node; 5,000 LB services applied.
                self.benchmark_test("cluster_steady")?;
                // #47 (a): etcd's side of 100, 1,000 and 5,000 nodes, each
                // with its own lease streams and watch, one agent churning.
                self.benchmark_test("cluster_etcd_side")?;
                // #47 (b): one node's cluster tasks on a synthetic 100- and
                // 5,000-node cluster, its CPU per cluster event.
                self.benchmark_test("cluster_replay")
            }
            "image" => self.image(),
            "all" => {
                // Every suite runs even when an earlier one misses a goal, so one
                // run gives the whole picture; the misses are listed at the end.
                let mut missed = Vec::new();
                for suite in BENCH_SUITES.iter().copied().filter(|s| *s != "all") {
                    if let Err(e) = self.bench(suite) {
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
}

impl Runner {
    /// `bench image`: what each part of the image weighs, per architecture,
    /// and the image's size against its goal (#45 item 8: <= 30 MB); then
    /// the image test's figures (size under podman, container start to ready
    /// with 10k allocations). A smoke run reports the parts of the contexts
    /// already staged (the integration stage staged them), judges nothing
    /// and builds no image: the image tests run in the integration stage.
    fn image(self) -> anyhow::Result<()> {
        use crate::arch::Arch;
        let version = crate::image::default_version();
        let host = Arch::host()?;
        let arches = [host, Arch::Aarch64];
        let mut sizes = Vec::new();
        if self.smoke {
            crate::image::stage(&version, host)?;
        } else {
            for arch in arches {
                sizes.push((arch, crate::image::build(Some(version.clone()), arch)?));
            }
        }
        let mb = |b: u64| format!("{:.2} MB", b as f64 / 1e6);
        println!("image parts (the staged rootfs, bytes as files):");
        println!("| {:<29} | {:>10} | {:>10} |", "part", "amd64", "arm64");
        let parts: Vec<Option<[u64; 4]>> = arches
            .iter()
            .map(|a| crate::image::parts(*a))
            .collect::<anyhow::Result<_>>()?;
        let names = [
            "agent (lockstep, static)",
            "plugin (lockstep-cni, static)",
            "bpftool",
            "bpftool's shared libraries",
        ];
        let cell = |p: &Option<[u64; 4]>, i: usize| {
            p.map_or_else(|| "not staged".to_string(), |p| mb(p[i]))
        };
        for (i, name) in names.iter().enumerate() {
            println!(
                "| {name:<29} | {:>10} | {:>10} |",
                cell(&parts[0], i),
                cell(&parts[1], i)
            );
        }
        let total = |p: &Option<[u64; 4]>| {
            p.map_or_else(|| "not staged".to_string(), |p| mb(p.iter().sum()))
        };
        println!(
            "| {:<29} | {:>10} | {:>10} |",
            "total",
            total(&parts[0]),
            total(&parts[1])
        );
        if self.smoke {
            println!(
                "goal: image <= 30 MB (`podman image inspect` .Size), not judged in a smoke run"
            );
            return Ok(());
        }
        let mut missed = Vec::new();
        for (arch, size) in &sizes {
            let verdict = if *size as f64 <= 30e6 { "PASS" } else { "MISS" };
            println!(
                "image {} ({}): {} (goal <= 30 MB) {verdict}",
                crate::image::tag(&version, *arch),
                arch.oci(),
                mb(*size)
            );
            if verdict == "MISS" {
                missed.push(arch.oci());
            }
        }
        // The image test prints the figures under podman: image size, and
        // container start to ready with 10k allocations in the store.
        let bin = crate::stage_agent_with_shipped_plugin()?;
        let context = crate::image::stage(&version, host)?;
        run(cargo()
            .args(["test", "-p", "lockstep-tests", "--test", "image"])
            .args(["--", "--nocapture", "--test-threads", "1"])
            .env("LOCKSTEP_BIN", &bin)
            .env("LOCKSTEP_IMAGE_CONTEXT", &context))?;
        if !missed.is_empty() {
            bail!("image larger than 30 MB: {}", missed.join(", "));
        }
        Ok(())
    }
}

/// Every suite as a smoke test, as `cargo xtask test` runs them: each one's
/// outcome and time printed, every one run. The image suite reports what
/// each part of the image weighs; its tests run in the integration stage.
/// Skipped, saying so, with `LOCKSTEP_SKIP_PRIVILEGED=1` (most need root).
///
/// # Errors
/// A suite failed to build or run.
pub fn smoke_all(tally: &mut Tally) -> anyhow::Result<()> {
    if std::env::var_os("LOCKSTEP_SKIP_PRIVILEGED").is_some_and(|v| v == "1") {
        println!(
            "benchmarks: SKIPPED (LOCKSTEP_SKIP_PRIVILEGED=1): the suites' smoke runs were not made"
        );
        return Ok(());
    }
    let runner = Runner { smoke: true };
    println!(
        "benchmarks: every suite as a smoke run (small sizes, the debug build): the tables \
         print each goal, but none is judged here; `cargo xtask bench <suite>` judges them"
    );
    let mut failed = Vec::new();
    for suite in BENCH_SUITES.iter().copied().filter(|s| *s != "all") {
        let started = Instant::now();
        let outcome = runner.bench(suite);
        let took = started.elapsed().as_secs_f64();
        match outcome {
            Ok(()) => {
                tally.passed += 1;
                println!("bench `{suite}` (smoke): ran in {took:.1} s");
            }
            Err(e) => {
                tally.failed += 1;
                println!("bench `{suite}` (smoke): FAILED in {took:.1} s: {e:#}");
                failed.push(suite);
            }
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        bail!(
            "benchmark suites failed their smoke run: {}",
            failed.join(", ")
        )
    }
}
