//! `cargo xtask bench cluster` (#12): block claims through the cluster
//! door against a real 3-member etcd cluster started here, at the scale of
//! a large cluster. Run with `--ignored --nocapture`; prints a table.
//!
//! a. One node claiming blocks one after another: claim p50 / p99 (goal:
//!    p99 ≤ 50 ms).
//! b. 5,000 simulated nodes (the same door the agent uses, no datapath),
//!    each registering under a lease and claiming the blocks 110 endpoints
//!    need (the core's `blocks_to_claim` and `next_block`), 32 at a time,
//!    in waves that take the cluster to 100, 1,000 and 5,000 nodes: claim
//!    p99 in each wave (goal: at 5,000 ≤ 2× at 100), retries after a lost
//!    race, total time and etcd's database size.
//!
//! `cluster_agents` (root): agents in node namespaces on the same kind of
//! cluster.
//!
//! c. Convergence: a block claimed by another node until this node's
//!    IPCACHE holds it (goal: p99 ≤ 250 ms).
//! e. 100 full ADDs at once on a node holding no block (goal: ≤ 1 s wall).
//!
//! `cluster_cni` (root, `cargo xtask bench cni`):
//!
//! d. Full CNI ADD p50 in cluster mode with a block and its reservation
//!    window in hand vs a single-node agent, alternating (goal: ≤ 1.05×:
//!    no etcd round trip on the ADD's path).
//! h. 100 IPAM ADDs/s (each released a second later) for 20 s on one
//!    node: reservation-window publications per second (etcd requests the
//!    window costs the node), and the ADDs that had to wait for one.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use ipnet::IpNet;
use lockstep::cluster::{Claim, Door, DoorOptions, NodeRecord};
use lockstep_core::cidr::Family;
use lockstep_core::cluster::{ClusterPoolSpec, blocks_to_claim, next_block};
use lockstep_tests::etcd::EtcdCluster;

/// Addresses each simulated node needs.
const ENDPOINTS: u64 = 110;
/// Free addresses a node keeps ready (the agent's default low water mark).
const LOW_WATER: u64 = 8;
/// Nodes working at once.
const CONCURRENCY: usize = 32;
/// The cluster's size after each wave.
const WAVES: [usize; 3] = [100, 1_000, 5_000];

/// The waves of this run ([`WAVES`]; small ones in a smoke run).
fn waves() -> [usize; 3] {
    lockstep_tests::bench::size(WAVES, [10, 20, 40])
}

fn rt() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

async fn door(endpoints: Vec<String>, prefix: &str) -> anyhow::Result<Door> {
    let mut opts = DoorOptions::new(endpoints);
    opts.prefix = prefix.to_string();
    Ok(Door::connect(opts).await?)
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn pool() -> anyhow::Result<ClusterPoolSpec> {
    // /10 cut into /26 blocks: 65,536 blocks, room for 5,000 nodes × 2.
    Ok(serde_json::from_value(serde_json::json!({
        "name": "scale",
        "ipv4": ["10.64.0.0/10"],
    }))?)
}

/// etcd's database size in bytes, as the first member reports it.
fn db_size(cluster: &EtcdCluster) -> anyhow::Result<u64> {
    let out = EtcdCluster::etcdctl(
        &[cluster.endpoint(0)],
        &["endpoint", "status", "-w", "json"],
    )?;
    let v: serde_json::Value = serde_json::from_str(&out)?;
    v[0]["Status"]["dbSize"]
        .as_u64()
        .context("etcdctl endpoint status: no dbSize")
}

/// What one simulated node did: each claim's time, races lost.
struct NodeRun {
    claims: Vec<Duration>,
    lost: u32,
    blocks: Vec<IpNet>,
}

/// One node: register, then claim what 110 endpoints need, picking each
/// block as the agent does from the blocks it knows are taken (`seen`, the
/// watch's view, shared by the simulated nodes).
async fn node(
    d: &mut Door,
    name: String,
    pool: &ClusterPoolSpec,
    seen: &Mutex<BTreeSet<IpNet>>,
) -> anyhow::Result<NodeRun> {
    let record = NodeRecord {
        name: name.clone(),
        ips: vec![],
        version: "bench".into(),
        blocks: vec![],
        in_use: 0,
        wanted: ENDPOINTS,
        instance: None,
    };
    d.register_node(&record, &[], Duration::from_secs(3600))
        .await?;
    let block_addrs = 1u64 << (32 - pool.block_len(Family::V4));
    let mut run = NodeRun {
        claims: Vec::new(),
        lost: 0,
        blocks: Vec::new(),
    };
    let mut held: BTreeSet<IpNet> = BTreeSet::new();
    loop {
        let available = held.len() as u64 * block_addrs;
        if blocks_to_claim(ENDPOINTS, 0, available, LOW_WATER, block_addrs) == 0 {
            return Ok(run);
        }
        let candidate = {
            let seen = seen.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
            next_block(pool, Family::V4, &seen, &held, &name).context("pool full")?
        };
        let started = Instant::now();
        let got = d.claim_block(&pool.name, candidate, &name).await?;
        run.claims.push(started.elapsed());
        seen.lock()
            .map_err(|_| anyhow::anyhow!("poisoned"))?
            .insert(candidate);
        match got {
            Claim::Claimed { .. } => {
                held.insert(candidate);
                run.blocks.push(candidate);
            }
            Claim::Taken { .. } | Claim::Unreadable { .. } => run.lost += 1,
        }
    }
}

#[test]
#[ignore = "a benchmark: cargo xtask bench cluster"]
fn cluster_claims_at_scale() -> anyhow::Result<()> {
    let cluster = EtcdCluster::start(3)?;
    let rt = rt()?;
    let pool = pool()?;
    let mut rows: Vec<String> = Vec::new();

    // a. Sequential claims by one node.
    let seq: Vec<f64> = rt.block_on(async {
        let mut d = door(cluster.endpoints(), "/bench-seq/").await?;
        let mut v = Vec::new();
        for i in 0..lockstep_tests::bench::size(300u32, 10) {
            let block: IpNet =
                format!("10.{}.{}.{}/26", 64 + i / 1024, (i / 4) % 256, (i % 4) * 64).parse()?;
            let started = Instant::now();
            let got = d.claim_block("seq", block, "one").await?;
            v.push(ms(started.elapsed()));
            ensure!(matches!(got, Claim::Claimed { .. }), "{block}: {got:?}");
        }
        anyhow::Ok(v)
    })?;
    let mut seq = seq;
    seq.sort_by(f64::total_cmp);
    println!(
        "\na. 300 sequential block claims by one node (3-member etcd on loopback):\n   p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        pct(&seq, 0.5),
        pct(&seq, 0.99),
        pct(&seq, 1.0)
    );
    rows.push(format!(
        "{:<48} {:>18} {:>10} {}",
        "block claim p50 / p99",
        format!("{:.2} / {:.2} ms", pct(&seq, 0.5), pct(&seq, 0.99)),
        "p99 <= 50",
        if pct(&seq, 0.99) <= 50.0 {
            "PASS"
        } else {
            "FAIL"
        }
    ));

    // b. Waves of simulated nodes, under a pool applied as an operator would.
    rt.block_on(async {
        let mut d = door(cluster.endpoints(), "/bench-scale/").await?;
        d.apply_pools(std::slice::from_ref(&pool)).await?;
        anyhow::Ok(())
    })?;
    let seen: Arc<Mutex<BTreeSet<IpNet>>> = Arc::default();
    let all_blocks: Arc<Mutex<Vec<(String, IpNet)>>> = Arc::default();
    let started_all = Instant::now();
    let mut from = 0usize;
    let mut p99s = Vec::new();
    println!(
        "\nb. simulated nodes, {CONCURRENCY} at a time, each registering and claiming for {ENDPOINTS} endpoints (/26 blocks):"
    );
    for to in waves() {
        let started = Instant::now();
        let next = Arc::new(Mutex::new(from));
        let runs: Vec<NodeRun> = rt.block_on(async {
            let mut workers = Vec::new();
            for _ in 0..CONCURRENCY {
                let mut d = door(cluster.endpoints(), "/bench-scale/").await?;
                let (next, seen, pool, all) =
                    (next.clone(), seen.clone(), pool.clone(), all_blocks.clone());
                workers.push(tokio::spawn(async move {
                    let mut out = Vec::new();
                    loop {
                        let i = {
                            let mut n = next.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
                            if *n >= to {
                                break;
                            }
                            *n += 1;
                            *n - 1
                        };
                        let name = format!("node-{i:05}");
                        let run = node(&mut d, name.clone(), &pool, &seen).await?;
                        all.lock()
                            .map_err(|_| anyhow::anyhow!("poisoned"))?
                            .extend(run.blocks.iter().map(|b| (name.clone(), *b)));
                        out.push(run);
                    }
                    anyhow::Ok(out)
                }));
            }
            let mut runs = Vec::new();
            for w in workers {
                runs.extend(w.await??);
            }
            anyhow::Ok(runs)
        })?;
        let took = started.elapsed();
        let mut claims: Vec<f64> = runs
            .iter()
            .flat_map(|r| r.claims.iter().map(|d| ms(*d)))
            .collect();
        claims.sort_by(f64::total_cmp);
        let lost: u32 = runs.iter().map(|r| r.lost).sum();
        let blocks: usize = runs.iter().map(|r| r.blocks.len()).sum();
        ensure!(
            blocks == (to - from) * 2,
            "{blocks} blocks for {} nodes",
            to - from
        );
        let (p50, p99) = (pct(&claims, 0.5), pct(&claims, 0.99));
        println!(
            "   nodes {:>5} → {:>5}: {:>6} claims ({lost} lost races) in {:.1} s; claim p50 {p50:.2} ms, p99 {p99:.2} ms, max {:.2} ms; db {:.1} MiB",
            from,
            to,
            claims.len(),
            took.as_secs_f64(),
            pct(&claims, 1.0),
            db_size(&cluster)? as f64 / 1048576.0
        );
        rows.push(format!(
            "{:<48} {:>18} {:>10} (info)",
            format!("claim p50 / p99 growing to {to} nodes"),
            format!("{p50:.2} / {p99:.2} ms"),
            ""
        ));
        p99s.push(p99);
        from = to;
    }
    let total = started_all.elapsed();
    // Every block has exactly one holder, and etcd agrees with the runs.
    let claimed = all_blocks.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
    let unique: BTreeSet<IpNet> = claimed.iter().map(|(_, b)| *b).collect();
    ensure!(unique.len() == claimed.len(), "a block claimed twice");
    let stored = rt.block_on(async {
        let mut d = door(cluster.endpoints(), "/bench-scale/").await?;
        let (blocks, _) = d.blocks().await?;
        let nodes = d.nodes().await?;
        anyhow::Ok((blocks, nodes.len()))
    })?;
    ensure!(
        stored.0.len() == claimed.len(),
        "etcd holds {} blocks, the nodes claimed {}",
        stored.0.len(),
        claimed.len()
    );
    ensure!(stored.1 == waves()[2], "{} nodes registered", stored.1);
    for b in stored.0.iter() {
        ensure!(
            claimed.contains(&(b.node.clone(), b.cidr)),
            "etcd gives {} to {}, which did not claim it",
            b.cidr,
            b.node
        );
    }
    let ratio = p99s[2] / p99s[0];
    let db = db_size(&cluster)?;
    rows.push(format!(
        "{:<48} {:>18} {:>10} {}",
        "claim p99 at 5,000 nodes / at 100",
        format!("{ratio:.2}x"),
        "<= 2x",
        if ratio <= 2.0 { "PASS" } else { "FAIL" }
    ));
    rows.push(format!(
        "{:<48} {:>18} {:>10} (info)",
        "5,000 nodes, 10,000 blocks: total time",
        format!("{:.1} s", total.as_secs_f64()),
        ""
    ));
    rows.push(format!(
        "{:<48} {:>18} {:>10} (info)",
        "etcd database size",
        format!("{:.1} MiB", db as f64 / 1048576.0),
        ""
    ));
    let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    println!("\n{:<48} {:>18} {:>10} result", "measure", "value", "goal");
    for r in &rows {
        println!("{r}");
    }
    println!(
        "machine: {}, {} CPUs; etcd {} members on loopback, data on {}",
        hostname.trim(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        3,
        cluster.root().display()
    );
    let missed: Vec<&String> = rows.iter().filter(|r| r.ends_with("FAIL")).collect();
    ensure!(
        missed.is_empty() || lockstep_tests::bench::smoke(),
        "goals missed: {missed:?}"
    );
    Ok(())
}

/// One CNI call's time (see `lockstep_tests::cluster::cni`).
fn cni(
    agent: &lockstep_tests::AgentProc,
    command: &str,
    id: &str,
    netns: &std::path::Path,
) -> anyhow::Result<Duration> {
    Ok(lockstep_tests::cluster::cni(&agent.socket(), command, id, netns)?.0)
}

/// What the agent benchmarks start from.
struct Bench {
    cluster: EtcdCluster,
    rt: tokio::runtime::Runtime,
    /// node-b's namespace (`tag`) and its agent in cluster mode.
    nb: lockstep_tests::Netns,
    b: lockstep_tests::AgentProc,
}

/// A 3-member etcd holding the pool 10.92.0.0/16 under `prefix`, a
/// runtime for the doors, and node-b's agent in its own namespace `tag`.
fn bench_cluster(prefix: &str, tag: &str) -> anyhow::Result<Bench> {
    let cluster = EtcdCluster::start(3)?;
    let eps = cluster.endpoints();
    let rt = rt()?;
    rt.block_on(async {
        let mut d = door(eps.clone(), prefix).await?;
        let pools: Vec<ClusterPoolSpec> = serde_json::from_value(serde_json::json!([
            {"name": "pods", "ipv4": ["10.92.0.0/16"]},
        ]))?;
        d.apply_pools(&pools).await?;
        anyhow::Ok(())
    })?;
    let nb = node_ns(tag, "192.0.2.2", &cluster)?;
    let b = lockstep_tests::AgentProc::start(
        &nb,
        &lockstep_tests::cluster::cluster_config(&eps, prefix, "node-b", "192.0.2.2"),
    )?;
    Ok(Bench { cluster, rt, nb, b })
}

/// A node namespace with an underlay address and the etcd forwarder.
fn node_ns(tag: &str, ip: &str, cluster: &EtcdCluster) -> anyhow::Result<lockstep_tests::Netns> {
    lockstep_tests::cluster::lone_node(tag, ip, cluster)
}

/// Whether `agent`'s IPCACHE_V4 holds the prefix `block`.
fn in_ipcache(maps: &lockstep::datapath::PinnedMaps, block: IpNet) -> bool {
    let IpNet::V4(n) = block else { return false };
    let key = aya::maps::lpm_trie::Key::new(u32::from(n.prefix_len()), n.network().octets());
    maps.ipcache_v4().get(&key, 0).is_ok()
}

#[test]
#[ignore = "a benchmark: cargo xtask bench cluster"]
fn cluster_agents() -> anyhow::Result<()> {
    lockstep_tests::privileged!();
    const PREFIX: &str = "/bench-agents/";
    // Every part bound to the end: etcd, the namespace and the agent live
    // as long as the bench.
    let Bench {
        cluster,
        rt,
        nb: _nb,
        b,
    } = bench_cluster(PREFIX, "cbb")?;
    let eps = cluster.endpoints();
    let mut rows: Vec<String> = Vec::new();

    // c. Convergence: a claim by another node (through the door, as its
    // agent would) until the entry is in this node's IPCACHE.
    let maps = lockstep::datapath::PinnedMaps::open(b.pins.path())?;
    let conv: Vec<f64> = rt.block_on(async {
        let mut d = door(eps.clone(), PREFIX).await?;
        d.register_node(
            &NodeRecord {
                name: "node-x".into(),
                ips: vec!["192.0.2.9".parse()?],
                version: "bench".into(),
                blocks: vec![],
                in_use: 0,
                wanted: 0,
                instance: None,
            },
            &[],
            Duration::from_secs(600),
        )
        .await?;
        let mut v = Vec::new();
        for i in 0..lockstep_tests::bench::size(100u32, 5) {
            let block: IpNet = format!("10.92.{}.{}/26", 200 + i / 4, (i % 4) * 64).parse()?;
            let got = d.claim_block("pods", block, "node-x").await?;
            ensure!(matches!(got, Claim::Claimed { .. }), "{block}: {got:?}");
            let claimed = Instant::now();
            while !in_ipcache(&maps, block) {
                ensure!(
                    claimed.elapsed() < Duration::from_secs(5),
                    "{block} never reached node-b's IPCACHE"
                );
                tokio::time::sleep(Duration::from_micros(500)).await;
            }
            v.push(ms(claimed.elapsed()));
        }
        anyhow::Ok(v)
    })?;
    let mut conv = conv;
    conv.sort_by(f64::total_cmp);
    println!(
        "\nc. a claim on another node until this node's IPCACHE holds it (100 claims):\n   p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        pct(&conv, 0.5),
        pct(&conv, 0.99),
        pct(&conv, 1.0)
    );
    rows.push(format!(
        "{:<48} {:>18} {:>10} {}",
        "convergence claim -> remote IPCACHE p50 / p99",
        format!("{:.1} / {:.1} ms", pct(&conv, 0.5), pct(&conv, 0.99)),
        "p99 <= 250",
        if pct(&conv, 0.99) <= 250.0 {
            "PASS"
        } else {
            "FAIL"
        }
    ));

    // e. 100 parallel ADDs on a node holding no block yet.
    let nc = node_ns("cbc", "192.0.2.3", &cluster)?;
    let c = lockstep_tests::AgentProc::start(
        &nc,
        &lockstep_tests::cluster::cluster_config(&eps, PREFIX, "node-c", "192.0.2.3"),
    )?;
    let pods: Vec<lockstep_tests::Netns> = (0..lockstep_tests::bench::size(100, 10))
        .map(|i| lockstep_tests::Netns::new(&format!("cbp{i}")))
        .collect::<anyhow::Result<_>>()?;
    let barrier = std::sync::Barrier::new(pods.len() + 1);
    let (wall, results) = std::thread::scope(|s| {
        let handles: Vec<_> = pods
            .iter()
            .enumerate()
            .map(|(i, ns)| {
                let (barrier, c) = (&barrier, &c);
                s.spawn(move || {
                    barrier.wait();
                    cni(c, "ADD", &format!("par-{i}"), &ns.path())
                })
            })
            .collect();
        barrier.wait();
        let started = Instant::now();
        let results: Vec<anyhow::Result<Duration>> = handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("panicked")))
            })
            .collect();
        (started.elapsed(), results)
    });
    let failed: Vec<String> = results
        .iter()
        .filter_map(|r| r.as_ref().err().map(|e| e.to_string()))
        .collect();
    ensure!(
        failed.is_empty(),
        "{} ADDs failed: {:?}",
        failed.len(),
        &failed[..failed.len().min(3)]
    );
    println!(
        "\ne. 100 full ADDs at once on a node holding no block (it claims two /26): wall {:.0} ms",
        ms(wall)
    );
    rows.push(format!(
        "{:<48} {:>18} {:>10} {}",
        "100 parallel ADDs, no block held: wall",
        format!("{:.0} ms", ms(wall)),
        "<= 1000 ms",
        if wall <= Duration::from_secs(1) {
            "PASS"
        } else {
            "FAIL"
        }
    ));
    for (i, ns) in pods.iter().enumerate() {
        cni(&c, "DEL", &format!("par-{i}"), &ns.path())?;
    }

    println!("\n{:<48} {:>18} {:>10} result", "measure", "value", "goal");
    for r in &rows {
        println!("{r}");
    }
    let missed: Vec<&String> = rows.iter().filter(|r| r.ends_with("FAIL")).collect();
    ensure!(
        missed.is_empty() || lockstep_tests::bench::smoke(),
        "goals missed: {missed:?}"
    );
    Ok(())
}

#[test]
#[ignore = "a benchmark: cargo xtask bench cni"]
fn cluster_cni() -> anyhow::Result<()> {
    lockstep_tests::privileged!();
    let Bench {
        cluster: _cluster,
        rt: _rt,
        nb,
        b,
    } = bench_cluster("/bench-cni/", "cnb")?;
    let mut rows: Vec<String> = Vec::new();

    // d. Full CNI ADD with a block and its window in hand (node-b) beside
    // a single-node agent, alternating blocks of 10, into a ring of
    // container netns.
    let ns_single = lockstep_tests::Netns::new("cbs")?;
    ns_single.exec("sysctl", ["-qw", "net.ipv4.ip_forward=1"])?;
    let single = lockstep_tests::AgentProc::start(
        &ns_single,
        "default_pool = \"pods\"\n[[pools]]\nname = \"pods\"\nipv4 = [\"10.93.0.0/22\"]\n",
    )?;
    // A ring of container namespaces per agent, long enough that a DEL's
    // veth (deleted by the agent's reaper just after the DEL) is gone before
    // its namespace comes round again.
    let rings: Vec<Vec<lockstep_tests::Netns>> = ["cbrb", "cbrs"]
        .iter()
        .map(|t| {
            (0..30)
                .map(|i| lockstep_tests::Netns::new(&format!("{t}{i}")))
                .collect::<anyhow::Result<Vec<_>>>()
        })
        .collect::<anyhow::Result<_>>()?;
    let ring_of = |who: &str| if who == "b" { &rings[0] } else { &rings[1] };
    // Warm-up: node-b claims its first block here.
    for i in 0..10 {
        for (who, a) in [("b", &b), ("s", &single)] {
            let ring = ring_of(who);
            let ns = ring[i % ring.len()].path();
            let id = format!("warm-{who}-{i}");
            cni(a, "ADD", &id, &ns)?;
            cni(a, "DEL", &id, &ns)?;
        }
    }
    let (mut add_b, mut add_s) = (Vec::new(), Vec::new());
    for round in 0..lockstep_tests::bench::size(20, 2) {
        let order: [(&str, &lockstep_tests::AgentProc); 2] = if round % 2 == 0 {
            [("b", &b), ("s", &single)]
        } else {
            [("s", &single), ("b", &b)]
        };
        for (who, a) in order {
            for k in 0..10 {
                let i = round * 10 + k + 10;
                let ring = ring_of(who);
                let ns = ring[i % ring.len()].path();
                let id = format!("add-{who}-{i}");
                let took = ms(cni(a, "ADD", &id, &ns)?);
                if who == "b" {
                    add_b.push(took);
                } else {
                    add_s.push(took);
                }
                cni(a, "DEL", &id, &ns)?;
            }
        }
    }
    add_b.sort_by(f64::total_cmp);
    add_s.sort_by(f64::total_cmp);
    let (pb, ps) = (pct(&add_b, 0.5), pct(&add_s, 0.5));
    println!(
        "\nd. 200 full CNI ADDs each, alternating blocks of 10: cluster mode (block in hand) p50 {pb:.3} ms, single-node p50 {ps:.3} ms"
    );
    rows.push(format!(
        "{:<48} {:>18} {:>10} {}",
        "CNI ADD p50: cluster (block, window held) / single",
        format!("{:.3} / {:.3} ms = {:.2}", pb, ps, pb / ps),
        "<= 1.05",
        if pb / ps <= 1.05 { "PASS" } else { "FAIL" }
    ));

    // h. 100 IPAM ADDs/s on node-b for 20 s, each released a second later:
    // the reservation window's publications per second.
    let publications = |ns: &lockstep_tests::Netns| -> anyhow::Result<f64> {
        let m = lockstep_tests::cluster::metrics_in(ns)?;
        m.lines()
            .find_map(|l| l.strip_prefix("lockstep_cluster_window_publications_total "))
            .context("no window publications metric")?
            .trim()
            .parse::<f64>()
            .context("publications")
    };
    let before = publications(&nb)?;
    let churned = lockstep_tests::cluster::churn_endpoints(
        &b,
        "burst",
        Duration::from_millis(10),
        lockstep_tests::bench::size(Duration::from_secs(20), Duration::from_secs(2)),
    )?;
    let (adds, secs, slow) = (f64::from(churned.adds), churned.secs, churned.slow);
    let published = publications(&nb)? - before;
    println!(
        "\nh. {adds} IPAM ADDs in {secs:.1} s ({:.0}/s, each released 1 s later): {published:.0} window publications ({:.2}/s per node); {slow} ADDs took over 100 ms",
        adds / secs,
        published / secs
    );
    rows.push(format!(
        "{:<48} {:>18} {:>10} (report)",
        "window refills/s per node at ~100 ADDs/s",
        format!("{:.2}/s ({:.0} ADDs/s)", published / secs, adds / secs),
        ""
    ));

    // i. The node lease's keeper under d's and h's load: how late any
    // refresh was sent against its schedule, since node-b started.
    let metric = |name: &str| -> anyhow::Result<f64> {
        let m = lockstep_tests::cluster::metrics_in(&nb)?;
        m.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .with_context(|| format!("no {name}"))?
            .trim()
            .parse::<f64>()
            .with_context(|| name.to_string())
    };
    let renewals = metric("lockstep_cluster_node_lease_renewals_total")?;
    let late_ms = metric("lockstep_cluster_node_lease_renewal_late_max_seconds")? * 1e3;
    println!(
        "\ni. node lease: {renewals:.0} refreshes by the keeper, the latest {late_ms:.1} ms behind its schedule"
    );
    rows.push(format!(
        "{:<48} {:>18} {:>10} {}",
        "node lease refresh, latest behind schedule",
        format!("{late_ms:.1} ms ({renewals:.0} refreshes)"),
        "<= 100 ms",
        if renewals < 1.0 {
            "(no refresh in a short run)"
        } else if late_ms <= 100.0 {
            "PASS"
        } else {
            "FAIL"
        }
    ));

    println!("\n{:<48} {:>18} {:>10} result", "measure", "value", "goal");
    for r in &rows {
        println!("{r}");
    }
    let missed: Vec<&String> = rows.iter().filter(|r| r.ends_with("FAIL")).collect();
    ensure!(
        missed.is_empty() || lockstep_tests::bench::smoke(),
        "goals missed: {missed:?}"
    );
    Ok(())
}
