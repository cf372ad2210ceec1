//! b. [`PARALLEL`] full ADDs at once, then the DEL of all at once; d. the
//!    same round alone and with one full reconcile forced mid-burst,
//!    alternating (#46: an ADD waits for at most the reconcile in progress
//!    on the agent's owner, so its p99 grows by no more than that
//!    reconcile's duration), then beside reconciles forced back to back
//!    (reported).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use hyper::Method;
use lockstep::client::call;
use serde_json::json;

use super::{
    METRICS_PORT, PARALLEL, World, invoke, median, ms, percentile, plugin, runtime, verdict,
};

/// One round of [`PARALLEL`] full ADDs at once into `netns`, then the DEL
/// of all at once: what it measured.
struct Round {
    wall: Duration,
    per_call: Vec<f64>,
    del_wall: Duration,
    reaped: Duration,
}

fn parallel_round(sock: &Path, netns: &[PathBuf], tag: &str) -> anyhow::Result<Round> {
    let config = json!({"cniVersion": "1.1.0", "name": "bench", "type": "lockstep",
                        "agentSocket": sock})
    .to_string()
    .into_bytes();
    let config = Arc::new(config);
    let barrier = Arc::new(Barrier::new(PARALLEL + 1));
    let mut threads = Vec::new();
    for (i, ns) in netns.iter().enumerate() {
        let (barrier, config, ns) = (barrier.clone(), config.clone(), ns.clone());
        let id = format!("{tag}-{i}");
        threads.push(std::thread::spawn(
            move || -> anyhow::Result<(Instant, f64)> {
                let ns = ns.to_str().context("utf-8")?.to_string();
                let env = [
                    ("CNI_COMMAND", "ADD"),
                    ("CNI_CONTAINERID", id.as_str()),
                    ("CNI_NETNS", ns.as_str()),
                    ("CNI_IFNAME", "eth0"),
                    ("CNI_PATH", "/opt/cni/bin"),
                ];
                barrier.wait();
                let (took, result) = invoke(plugin(), &env, &config)?;
                ensure!(
                    result["interfaces"].as_array().map(Vec::len) == Some(2),
                    "{result}"
                );
                Ok((Instant::now(), ms(took)))
            },
        ));
    }
    barrier.wait();
    let started = Instant::now();
    let mut per_call = Vec::new();
    let mut last = started;
    for t in threads {
        let (end, took) = t.join().map_err(|_| anyhow::anyhow!("thread panicked"))??;
        last = last.max(end);
        per_call.push(took);
    }
    let wall = last - started;
    let rt = runtime()?;
    let eps = rt.block_on(call(sock, Method::GET, "/v1/endpoints", None))?;
    ensure!(
        eps.as_array().map(Vec::len) == Some(PARALLEL),
        "{} endpoints",
        eps.as_array().map_or(0, Vec::len)
    );
    // DEL all, also at once.
    let del_started = Instant::now();
    let mut dels = Vec::new();
    for (i, ns) in netns.iter().enumerate() {
        let (config, ns) = (config.clone(), ns.clone());
        let id = format!("{tag}-{i}");
        dels.push(std::thread::spawn(move || -> anyhow::Result<()> {
            let ns = ns.to_str().context("utf-8")?.to_string();
            let env = [
                ("CNI_COMMAND", "DEL"),
                ("CNI_CONTAINERID", id.as_str()),
                ("CNI_NETNS", ns.as_str()),
                ("CNI_IFNAME", "eth0"),
                ("CNI_PATH", "/opt/cni/bin"),
            ];
            invoke(plugin(), &env, &config)?;
            Ok(())
        }));
    }
    for t in dels {
        t.join().map_err(|_| anyhow::anyhow!("thread panicked"))??;
    }
    let del_wall = del_started.elapsed();
    let left = rt.block_on(call(sock, Method::GET, "/v1/endpoints", None))?;
    ensure!(left == json!([]), "endpoints left: {left}");
    // The DELs are answered once their veths are gone (the reaper deletes
    // the veths of the DELs in flight in batches); the addresses are
    // released right after.
    let reaped = loop {
        let held = rt.block_on(call(sock, Method::GET, "/v1/allocations", None))?;
        if held.as_array().is_some_and(|a| {
            !a.iter().any(|x| {
                x["address"]
                    .as_str()
                    .is_some_and(|s| s.starts_with("10.71."))
            })
        }) {
            break del_started.elapsed();
        }
        ensure!(
            del_started.elapsed() < Duration::from_secs(30),
            "the reaper did not release the addresses: {held}"
        );
        std::thread::sleep(Duration::from_millis(2));
    };
    Ok(Round {
        wall,
        per_call,
        del_wall,
        reaped,
    })
}

/// Rounds of part d, each alone and with one reconcile.
const ROUNDS: usize = 21;

/// Addresses the node holds besides the pods in part d: a full reconcile
/// then checks that many map entries more.
const HELD: usize = 60_000;

/// Allocates `n` addresses from the pool `held` ([`CLIENTS`] callers at
/// once), owned by resources named `held-<i>`.
fn hold(sock: &Path, n: usize) -> anyhow::Result<()> {
    const CLIENTS: usize = 32;
    let rt = runtime()?;
    rt.block_on(async {
        let next = std::sync::atomic::AtomicUsize::new(0);
        let client = || async {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    return anyhow::Ok(());
                }
                let owner =
                    json!({"owner": "resource", "kind": "bench", "name": format!("held-{i}")});
                call(
                    sock,
                    Method::POST,
                    "/v1/allocations",
                    Some(json!({"pool": "held", "family": "ipv4", "owner": owner})),
                )
                .await
                .with_context(|| format!("holding address {i}"))?;
            }
        };
        futures::future::try_join_all((0..CLIENTS).map(|_| client())).await?;
        anyhow::Ok(())
    })
}

/// The store's commits and log syncs so far, from the agent's metrics
/// (scraped inside the node netns).
fn store_counts(world: &World) -> anyhow::Result<(u64, u64)> {
    let node = world.node.as_ref().context("no agent running")?;
    let out = std::process::Command::new("nsenter")
        .arg(format!("--net={}", node.display()))
        .args(["--", "curl", "-sf", "-m", "10"])
        .arg(format!("http://127.0.0.1:{METRICS_PORT}/metrics"))
        .output()?;
    ensure!(out.status.success(), "scraping the agent's metrics failed");
    let text = String::from_utf8(out.stdout)?;
    let value = |name: &str| -> anyhow::Result<u64> {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<f64>().ok())
            .map(|v| v as u64)
            .with_context(|| format!("no {name} in the metrics"))
    };
    Ok((
        value("lockstep_store_commits_total")?,
        value("lockstep_store_log_syncs_total")?,
    ))
}

/// Full reconciles forced through the API one after another until `stop`:
/// each one's duration in ms.
fn reconciles(sock: PathBuf, stop: Arc<AtomicBool>) -> anyhow::Result<Vec<f64>> {
    let rt = runtime()?;
    let mut took = Vec::new();
    while !stop.load(Ordering::SeqCst) {
        let t = Instant::now();
        rt.block_on(call(&sock, Method::POST, "/v1/reconcile", None))?;
        took.push(ms(t.elapsed()));
    }
    Ok(took)
}

pub(super) fn parallel(world: &mut World, rows: &mut Vec<String>) -> anyhow::Result<()> {
    let sock = world.socket();
    let made = Instant::now();
    let mut netns = Vec::new();
    for i in 0..PARALLEL {
        netns.push(world.netns(&format!("p{i}"))?);
    }
    let made = made.elapsed();
    let (commits_before, syncs_before) = store_counts(world)?;
    let Round {
        wall,
        per_call,
        del_wall,
        reaped,
    } = parallel_round(&sock, &netns, "par")?;
    let (commits_after, syncs_after) = store_counts(world)?;
    let (commits, syncs) = (commits_after - commits_before, syncs_after - syncs_before);
    let (p50, p99) = (median(&per_call), percentile(&per_call, 0.99));
    println!(
        "\nb. {PARALLEL} full ADDs at once (veth into {PARALLEL} netns made beforehand in {:.2} s):",
        made.as_secs_f64()
    );
    println!(
        "   wall {:.0} ms, per call p50 {p50:.1} ms, p99 {p99:.1} ms, max {:.1} ms; DEL of all at once {:.0} ms (veths gone, addresses released after {:.0} ms)",
        ms(wall),
        percentile(&per_call, 1.0),
        ms(del_wall),
        ms(reaped)
    );
    rows.push(format!(
        "{:<44} {:>16} {:>12} {}",
        format!("{PARALLEL} parallel full ADDs: wall"),
        format!("{:.0} ms", ms(wall)),
        "<= 1000 ms",
        verdict(wall <= Duration::from_secs(1))
    ));
    rows.push(format!(
        "{:<44} {:>16} {:>12}",
        "  per call p50 / p99",
        format!("{p50:.0} / {p99:.0} ms"),
        ""
    ));
    // Group commit: the ADDs and DELs of a batch share one log record and
    // one fdatasync (a count, which load does not move).
    println!(
        "   the store: {commits} commits in {syncs} log syncs ({:.2} syncs per commit)",
        syncs as f64 / commits.max(1) as f64
    );
    rows.push(format!(
        "{:<44} {:>16} {:>12} {}",
        "  store log syncs per commit (ADDs and DELs)",
        format!("{syncs} / {commits}"),
        "< 1",
        verdict(commits > 0 && syncs < commits)
    ));
    rows.push(format!(
        "{:<44} {:>16} {:>12} {}",
        format!("{PARALLEL} parallel full DELs: wall"),
        format!("{:.0} ms", ms(del_wall)),
        "<= 1000 ms",
        verdict(del_wall <= Duration::from_secs(1))
    ));
    rows.push(format!(
        "{:<44} {:>16} {:>12} (info)",
        "  veths reaped, addresses free after",
        format!("{:.0} ms", ms(reaped)),
        ""
    ));
    // d. #46: an ADD waits for at most the reconcile in progress on the
    // owner. The node first holds [`HELD`] more addresses, so a full
    // reconcile lasts well beyond the rounds' noise; its own duration is
    // the median of reconciles forced with nothing else running. Then
    // rounds alone and rounds with one full reconcile forced in the middle
    // of the burst alternate (side by side in one run): the ADDs' p99 with
    // it grows by no more than that duration.
    let held = super::smoke::size(HELD, 500);
    hold(&sock, held)?;
    let own = {
        let rt = runtime()?;
        let mut took = Vec::new();
        for _ in 0..5 {
            let t = Instant::now();
            rt.block_on(call(&sock, Method::POST, "/v1/reconcile", None))?;
            took.push(ms(t.elapsed()));
        }
        median(&took)
    };
    let (mut alone, mut with, mut passes) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..super::smoke::size(ROUNDS, 1) {
        let round = parallel_round(&sock, &netns, &format!("alone{r}"))?;
        alone.push(percentile(&round.per_call, 0.99));
        let forced = {
            let sock = sock.clone();
            let after = Duration::from_secs_f64(p50 / 2e3);
            std::thread::spawn(move || -> anyhow::Result<f64> {
                std::thread::sleep(after);
                let rt = runtime()?;
                let t = Instant::now();
                rt.block_on(call(&sock, Method::POST, "/v1/reconcile", None))?;
                Ok(ms(t.elapsed()))
            })
        };
        let round = parallel_round(&sock, &netns, &format!("one{r}"));
        passes.push(
            forced
                .join()
                .map_err(|_| anyhow::anyhow!("thread panicked"))??,
        );
        with.push(percentile(&round?.per_call, 0.99));
    }
    let (p99_alone, p99_with) = (median(&alone), median(&with));
    println!(
        "\nd. with {held} more addresses held, a full reconcile alone takes {own:.1} ms (median of 5); {} rounds of {PARALLEL} ADDs alone and as many with one full reconcile forced mid-burst (there: median {:.1} ms, longest {:.1} ms, waits included): ADD p99 median {p99_alone:.1} ms alone, {p99_with:.1} ms with it",
        alone.len(),
        median(&passes),
        percentile(&passes, 1.0),
    );
    rows.push(format!(
        "{:<44} {:>16} {:>12} {}",
        "  p99 with one reconcile, over alone",
        format!("{:+.0} ms", p99_with - p99_alone),
        format!("<= {own:.0} ms"),
        verdict(p99_with - p99_alone <= own)
    ));
    // The same, with reconciles forced one after another through the
    // whole round (the owner never idle): how far load on the owner and
    // on the CPUs beyond one reconcile moves the p99.
    let stop = Arc::new(AtomicBool::new(false));
    let reconciler = {
        let (sock, stop) = (sock.clone(), stop.clone());
        std::thread::spawn(move || reconciles(sock, stop))
    };
    let beside = parallel_round(&sock, &netns, "rec");
    stop.store(true, Ordering::SeqCst);
    let passes = reconciler
        .join()
        .map_err(|_| anyhow::anyhow!("thread panicked"))??;
    let beside = beside?;
    let p99_beside = percentile(&beside.per_call, 0.99);
    let longest = passes.iter().copied().fold(0.0, f64::max);
    println!(
        "   the same {PARALLEL} ADDs beside {} reconciles forced back to back (p50 {:.1} ms, longest {longest:.1} ms): per call p50 {:.1} ms, p99 {p99_beside:.1} ms, wall {:.0} ms",
        passes.len(),
        median(&passes),
        median(&beside.per_call),
        ms(beside.wall)
    );
    rows.push(format!(
        "{:<44} {:>16} {:>12} (info)",
        "  p99 beside back-to-back reconciles",
        format!("{:+.0} ms", p99_beside - p99_alone),
        format!("longest {longest:.0} ms"),
    ));
    Ok(())
}
