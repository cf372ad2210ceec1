//! `cargo xtask bench cluster`, one node's CPU per cluster event (#47,
//! run b). Run with `--ignored --nocapture`; prints a table and exits
//! non-zero on a missed goal.
//!
//! A synthetic cluster of 100, then 5,000 nodes is written to a real etcd
//! (each node's key and routing key, one block, an LB membership), then
//! one node runs the agent's real cluster tasks — the claim loop
//! (`ClusterNode`), the remote-state task (`RemoteTask`) and the LB agent
//! (`LbAgent`) — with no datapath (an empty agent slot), with the
//! product's default settings (lease, settle, reconcile interval), on a
//! runtime of its own whose threads are named [`NODE_THREADS`]. Its CPU
//! time is the sum of those threads' time on a CPU (`schedstat`, in
//! nanoseconds), so the load this process puts on etcd is not counted.
//!
//! Measured at each size, side by side in one run, in [`ROUNDS`] rounds
//! whose medians are the figures (the node's idle work is of the order of
//! the events' own, so each round measures its own idle rate just before
//! its events):
//! - idle: its CPU per second while nothing in the cluster changes;
//! - churn: [`EVENTS`] cluster events at [`RATE`] per second, cycling a
//!   block claimed by another node, that block given back, another node
//!   publishing a new count of addresses in use, and another node's LB
//!   membership written again. CPU per event = (CPU in the churn window −
//!   the idle rate × the window) / events. The same split per kind of
//!   event (the CPU between one event and the next, above idle) says
//!   which kind grows with the cluster.
//!
//! The goal (#47): CPU per event at 5,000 nodes ≤ 1.5× at 100. This
//! machine has no hardware instruction counters (`perf stat -e
//! instructions` says "not supported"), so the figure is CPU time, and
//! the two sizes are measured in the same run.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use lockstep::cluster::{
    AgentSlot, Block, Claim, ClusterNode, Door, DoorOptions, LbAgent, Link, NodeRecord, RemoteTask,
};
use lockstep::config::Config;
use lockstep_core::cluster::ClusterPoolSpec;
use lockstep_tests::etcd::EtcdCluster;

/// The measured node's runtime threads (at most 15 characters: the
/// kernel's `comm`).
const NODE_THREADS: &str = "replay-node";
/// The cluster's sizes, measured in this order.
const SIZES: [usize; 2] = [100, 5_000];
/// Rounds per size (the figures are their medians).
const ROUNDS: usize = 7;
/// Cluster events per round (a multiple of the four kinds).
const EVENTS: usize = 100;
/// Cluster events per second: fast enough that the events' work stands
/// well above the node's idle work it is measured against.
const RATE: u32 = 25;
/// How long the node is measured idle at the start of each round.
const IDLE: Duration = Duration::from_secs(4);
/// How long after a round's last event its work is still counted.
const SETTLE: Duration = Duration::from_millis(500);
/// Synthetic nodes written at once.
const WRITERS: usize = 16;
/// The goal: CPU per event at the largest size over the smallest.
const GOAL: f64 = 1.5;

fn pool() -> anyhow::Result<ClusterPoolSpec> {
    // /10 cut into /26 blocks: 65,536 blocks, room for every node's block
    // and the churned ones.
    Ok(serde_json::from_value(serde_json::json!({
        "name": "replay",
        "ipv4": ["10.64.0.0/10"],
    }))?)
}

fn options(eps: &[String], prefix: &str) -> DoorOptions {
    lockstep_tests::synthetic::door_options(eps, prefix, Duration::from_secs(5))
}

/// Synthetic node `i`'s record (its underlay address is never used: no
/// traffic goes anywhere).
fn record(i: usize, in_use: u64) -> NodeRecord {
    let ip = IpAddr::V4(Ipv4Addr::new(
        10,
        200 + u8::try_from(i / 65536).unwrap_or(0),
        u8::try_from((i / 256) % 256).unwrap_or(0),
        u8::try_from(i % 256).unwrap_or(0),
    ));
    lockstep_tests::synthetic::node_record(format!("syn-{i:05}"), ip, in_use, "replay")
}

/// The measured node's CPU time so far: every thread of this process
/// named [`NODE_THREADS`] (`/proc/self/task/*/schedstat`, first field).
fn node_cpu() -> anyhow::Result<Duration> {
    let mut total = 0u64;
    for task in std::fs::read_dir("/proc/self/task")? {
        let dir = task?.path();
        let Ok(comm) = std::fs::read_to_string(dir.join("comm")) else {
            continue;
        };
        if comm.trim() != NODE_THREADS {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(dir.join("schedstat")) else {
            continue;
        };
        let ns: u64 = stat
            .split_whitespace()
            .next()
            .context("empty schedstat")?
            .parse()?;
        total += ns;
    }
    Ok(Duration::from_nanos(total))
}

/// Each synthetic node's node lease and LB lease, by index.
type Leases = Vec<(i64, i64)>;

/// Writes `n` synthetic nodes under `prefix`: node key and routing key
/// (under a lease of an hour), one block each, an LB membership; returns
/// their leases (the events write under them again).
async fn write_cluster(eps: &[String], prefix: &str, n: usize) -> anyhow::Result<Leases> {
    let pool = pool()?;
    let mut d = Door::connect(options(eps, prefix)).await?;
    d.apply_pools(std::slice::from_ref(&pool)).await?;
    let mut workers = Vec::new();
    for w in 0..WRITERS {
        let (eps, prefix, pool) = (eps.to_vec(), prefix.to_string(), pool.name.clone());
        workers.push(tokio::spawn(async move {
            let mut d = Door::connect(options(&eps, &prefix)).await?;
            let mut leases = Vec::new();
            for i in (w..n).step_by(WRITERS) {
                let r = record(i, 10);
                let node_lease = d.register_node(&r, &[], Duration::from_secs(3600)).await?;
                let got = d
                    .claim_block(&pool, lockstep_tests::synthetic::block(i)?, &r.name)
                    .await?;
                ensure!(matches!(got, Claim::Claimed { .. }), "{}: {got:?}", r.name);
                let (lease, _) = d.lb_grant(Duration::from_secs(3600)).await?;
                d.lb_join(&r.name, &BTreeMap::new(), true, lease).await?;
                leases.push((i, (node_lease, lease)));
            }
            anyhow::Ok(leases)
        }));
    }
    let mut all = vec![(0, 0); n];
    for w in workers {
        for (i, l) in w.await?? {
            all[i] = l;
        }
    }
    Ok(all)
}

/// The measured node: its tasks on a runtime of their own, stopped on
/// drop.
struct Measured {
    stop: tokio::sync::watch::Sender<bool>,
    thread: Option<std::thread::JoinHandle<anyhow::Result<()>>>,
}

impl Measured {
    fn start(eps: &[String], prefix: &str, dir: &Path) -> anyhow::Result<Measured> {
        let text = format!(
            "state_dir = \"{}\"\n{}",
            dir.display(),
            lockstep_tests::cluster::cluster_config(eps, prefix, "measured", "10.199.0.1")
        );
        let config = Config::parse(Path::new("replay.toml"), &text)?;
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let mut o = options(eps, prefix);
        let link = Link::new(prefix);
        o.link = Some(link.clone());
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .thread_name(NODE_THREADS)
                .enable_all()
                .build()?;
            rt.block_on(async move {
                let mut tasks = vec![link.mirror().clone().spawn(o, stopped.clone())];
                let node = ClusterNode::connect(&config, Some(link.clone()))
                    .await
                    .map_err(|e| anyhow::anyhow!("measured node: {e}"))?;
                let slot: AgentSlot = None;
                tasks.push(node.spawn(slot.clone(), stopped.clone()));
                let remote =
                    RemoteTask::from_config(&config, config.reconcile_interval, Some(link.clone()))
                        .context("remote task")?;
                tasks.push(remote.spawn(slot.clone(), stopped.clone()));
                let lb = LbAgent::from_config(&config, Some(link)).context("lb agent")?;
                tasks.push(lb.spawn(slot, None, stopped.clone()));
                let mut stopped = stopped;
                let _ = stopped.wait_for(|s| *s).await;
                for t in tasks {
                    let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
                }
                anyhow::Ok(())
            })
        });
        Ok(Measured {
            stop,
            thread: Some(thread),
        })
    }

    fn stop(mut self) -> anyhow::Result<()> {
        let _ = self.stop.send(true);
        match self.thread.take() {
            Some(t) => t
                .join()
                .map_err(|_| anyhow::anyhow!("the measured node panicked"))?,
            None => Ok(()),
        }
    }
}

impl Drop for Measured {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Waits until the measured node is registered, holds a block, and its
/// LB agent is a member.
async fn settled(d: &mut Door, within: Duration) -> anyhow::Result<()> {
    let started = Instant::now();
    loop {
        let registered = d.nodes().await?.iter().any(|n| n.record.name == "measured");
        let holds = d.blocks().await?.0.iter().any(|b| b.node == "measured");
        let member = d.lb_read().await?.members.has_node("measured");
        if registered && holds && member {
            return Ok(());
        }
        ensure!(
            started.elapsed() < within,
            "the measured node did not settle within {within:?}: registered {registered}, holds a block {holds}, LB member {member}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// One cluster event (`i`th of the run, on the synthetic nodes holding
/// `leases`); `extra` is the block claimed by the last claim event.
async fn event(
    d: &mut Door,
    leases: &Leases,
    i: usize,
    extra: &mut Option<Block>,
) -> anyhow::Result<()> {
    let n = leases.len();
    let other = (i / 4) % n;
    let (node_lease, lb_lease) = leases[other];
    match i % 4 {
        0 => {
            let cidr = lockstep_tests::synthetic::block(n + i)?;
            let name = record(other, 0).name;
            let got = d.claim_block("replay", cidr, &name).await?;
            let Claim::Claimed { revision } = got else {
                anyhow::bail!("{cidr}: {got:?}");
            };
            *extra = Some(Block {
                pool: "replay".into(),
                cidr,
                node: name,
                instance: None,
                revision,
            });
        }
        1 => {
            let b = extra.take().context("no block to give back")?;
            ensure!(d.release_block(&b).await?, "{} not given back", b.cidr);
        }
        2 => {
            d.publish_node(&record(other, 10 + i as u64), &[], node_lease)
                .await?;
        }
        _ => {
            let labels = BTreeMap::from([("round".to_string(), i.to_string())]);
            d.lb_join(&record(other, 0).name, &labels, true, lb_lease)
                .await?;
        }
    }
    Ok(())
}

/// The kinds of event, in the order [`event`] cycles through them.
const KINDS: [&str; 4] = [
    "a block claimed",
    "that block given back",
    "a node's counts published",
    "an LB membership written",
];

/// What one size measured.
struct Measure {
    idle_per_s: Duration,
    per_event: Duration,
    /// CPU per event of each of [`KINDS`]: what the node spent between
    /// one such event and the next, above idle (an event's work that
    /// outlasts the gap counts to the next one).
    per_kind: [Duration; 4],
}

/// The median of `v` (not empty).
fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// One round: the node idle for `idle`, then `events` cluster events at
/// [`RATE`] and a settle; its idle rate, and its CPU per event above it
/// (all, and per kind). `i` counts events across rounds.
fn churn_round(
    load: &tokio::runtime::Runtime,
    d: &mut Door,
    leases: &Leases,
    idle: Duration,
    events: usize,
    i: &mut usize,
    extra: &mut Option<Block>,
) -> anyhow::Result<Measure> {
    let (c0, t0) = (node_cpu()?, Instant::now());
    std::thread::sleep(idle);
    let (c1, t1) = (node_cpu()?, Instant::now());
    let idle_per_s = (c1 - c0).div_f64((t1 - t0).as_secs_f64());
    let every = Duration::from_secs(1) / RATE;
    let (mut kind_sum, mut kind_count) = ([Duration::ZERO; 4], [0u32; 4]);
    let (mut c_at, mut t_at) = (c1, t1);
    for e in 0..events {
        load.block_on(event(d, leases, *i, extra))?;
        // Paced from the start, not from each write's end.
        let next = t1 + every * u32::try_from(e + 1)?;
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
        let (c, t) = (node_cpu()?, Instant::now());
        kind_sum[*i % 4] += (c - c_at).saturating_sub(idle_per_s.mul_f64((t - t_at).as_secs_f64()));
        kind_count[*i % 4] += 1;
        (c_at, t_at) = (c, t);
        *i += 1;
    }
    // The last events' work lands within a settle.
    std::thread::sleep(SETTLE);
    let (c2, t2) = (node_cpu()?, Instant::now());
    let busy = (c2 - c1).saturating_sub(idle_per_s.mul_f64((t2 - t1).as_secs_f64()));
    Ok(Measure {
        idle_per_s,
        per_event: busy / u32::try_from(events)?,
        per_kind: std::array::from_fn(|k| kind_sum[k] / kind_count[k].max(1)),
    })
}

fn measure(eps: &[String], n: usize) -> anyhow::Result<Measure> {
    let prefix = format!("/replay-{n}/");
    let load = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("replay-load")
        .enable_all()
        .build()?;
    let started = Instant::now();
    let leases = load.block_on(write_cluster(eps, &prefix, n))?;
    println!(
        "   {n} synthetic nodes written in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let dir = lockstep_tests::TempDir::new("replay")?;
    let node = Measured::start(eps, &prefix, dir.path())?;
    let mut d = load.block_on(Door::connect(options(eps, &prefix)))?;
    load.block_on(settled(&mut d, Duration::from_secs(120)))?;
    // Its start-up read and the first rounds fall behind it.
    std::thread::sleep(lockstep_tests::bench::size(
        Duration::from_secs(10),
        Duration::from_secs(2),
    ));
    let idle = lockstep_tests::bench::size(IDLE, Duration::from_secs(1));
    let events = lockstep_tests::bench::size(EVENTS, 20);
    let rounds = lockstep_tests::bench::size(ROUNDS, 2);
    let mut extra = None;
    let mut i = 0;
    let (mut idles, mut per_events, mut kinds) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        let r = churn_round(&load, &mut d, &leases, idle, events, &mut i, &mut extra)?;
        println!(
            "   {n} nodes, round {}: idle {:.2} ms CPU/s; {events} events at {RATE}/s: {:.3} ms per event above idle",
            round + 1,
            r.idle_per_s.as_secs_f64() * 1e3,
            r.per_event.as_secs_f64() * 1e3
        );
        idles.push(r.idle_per_s);
        per_events.push(r.per_event);
        kinds.push(r.per_kind);
    }
    let per_kind: [Duration; 4] =
        std::array::from_fn(|k| median(kinds.iter().map(|p| p[k]).collect()));
    let (idle_per_s, per_event) = (median(idles), median(per_events));
    println!(
        "   {n} nodes, median of {rounds} rounds: idle {:.2} ms CPU/s, {:.3} ms per event",
        idle_per_s.as_secs_f64() * 1e3,
        per_event.as_secs_f64() * 1e3
    );
    for (kind, cpu) in KINDS.iter().zip(per_kind) {
        println!("     {kind}: {:.3} ms", cpu.as_secs_f64() * 1e3);
    }
    node.stop()?;
    Ok(Measure {
        idle_per_s,
        per_event,
        per_kind,
    })
}

#[test]
#[ignore = "a benchmark: cargo xtask bench cluster"]
fn one_node_cpu_per_cluster_event() -> anyhow::Result<()> {
    let cluster = EtcdCluster::start(1)?;
    let eps = cluster.endpoints();
    let sizes = lockstep_tests::bench::size(SIZES, [10, 50]);
    println!(
        "\nb. one node's claim loop, remote-state task and LB agent (product defaults, no datapath) on a synthetic cluster:"
    );
    let mut measured = Vec::new();
    for n in sizes {
        measured.push((n, measure(&eps, n)?));
    }
    let mut rows = Vec::new();
    for (n, m) in &measured {
        rows.push(format!(
            "{:<60} {:>22}",
            format!("one node's idle CPU, {n} nodes"),
            format!("{:.2} ms/s", m.idle_per_s.as_secs_f64() * 1e3)
        ));
        rows.push(format!(
            "{:<60} {:>22}",
            format!("one node's CPU per cluster event, {n} nodes"),
            format!("{:.3} ms", m.per_event.as_secs_f64() * 1e3)
        ));
    }
    let (small, large) = (&measured[0], &measured[measured.len() - 1]);
    for (k, kind) in KINDS.iter().enumerate() {
        let (s, l) = (small.1.per_kind[k], large.1.per_kind[k]);
        rows.push(format!(
            "{:<60} {:>22}",
            format!("  of which {kind}, {} / {} nodes", large.0, small.0),
            format!(
                "{:.3} / {:.3} ms ({:.1}x)",
                l.as_secs_f64() * 1e3,
                s.as_secs_f64() * 1e3,
                l.as_secs_f64() / s.as_secs_f64().max(1e-6)
            )
        ));
    }
    let ratio = large.1.per_event.as_secs_f64() / small.1.per_event.as_secs_f64().max(1e-6);
    let ok = ratio <= GOAL;
    rows.push(format!(
        "{:<60} {:>22} {:>10} {}",
        format!("CPU per event, {} / {} nodes", large.0, small.0),
        format!("{ratio:.2}x"),
        format!("<= {GOAL}x"),
        if ok { "PASS" } else { "FAIL" }
    ));
    println!();
    for r in &rows {
        println!("{r}");
    }
    ensure!(
        ok || lockstep_tests::bench::smoke(),
        "one node's CPU per cluster event grows with the cluster: {ratio:.2}x at {} vs {} nodes (goal <= {GOAL}x)",
        large.0,
        small.0
    );
    Ok(())
}
