//! `cargo xtask bench cluster`, etcd's side of a large cluster (#47,
//! run a). Run with `--ignored --nocapture`; prints a table and exits
//! non-zero on a missed goal.
//!
//! What every node costs etcd is two lease streams and one watch: an idle
//! agent reads from its watch-fed mirror and sends no request (run f of
//! `cluster_steady` and `cluster_watch` count that with real agents). So
//! here each of 100, 1,000 and 5,000 simulated nodes is *thin*: its keys
//! are written as an agent writes them (node key and routing key under its
//! node lease, one block, an LB membership under its LB lease, through the
//! product's door), then it keeps both leases alive on streams of its own
//! at the product's default cadence (`cluster.lease_ttl` 15 s refreshed
//! every 5 s, `lb.announce_lease` 3 s refreshed every second) and follows
//! the prefix with a watch of its own, opened as the agent's mirror opens
//! it (prefix, start revision, progress notifications). What it receives
//! is counted and dropped. Fifty thin nodes share one connection (one
//! HTTP/2 connection carries many streams; etcd counts and sends per
//! stream), so the figures are etcd's, not this process's.
//!
//! Beside them, one real agent (its own namespace, the whole product)
//! churns 100 pod events/s: 50 IPAM ADDs a second, each released a second
//! later. Pod churn is concentrated on one node here; spread over many, it
//! writes the same kinds of keys (a node's reservation window, outside the
//! watched prefix, and now and then a block), only from more writers.
//!
//! For each size, on a fresh 3-member etcd, over a window of [`WINDOW`]:
//! etcd's own counters (`/metrics` of every member) give per node
//! requests/s (unary calls and streams opened), stream messages/s (lease
//! refreshes) and bytes/s sent, idle and churning. A lease that ran out,
//! a watch that broke or a node missing from the LB membership at the end
//! fails the run: the figures would count a cluster in turmoil.
//!
//! Goals (#47): idle requests/s per node ≤ 1 at 5,000; idle bytes/s per
//! node at 5,000 ≤ 1.2× at 100; churning at 100 pod events/s, bytes/s
//! sent per node at 5,000 ≤ 2 KiB/s.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use etcd_client::{Client, GetOptions, WatchOptions};
use lockstep::cluster::{Claim, Door, DoorOptions};
use lockstep::config::Config;
use lockstep_core::cluster::ClusterPoolSpec;
use lockstep_tests::etcd::{EtcdCluster, Traffic};

/// The cluster's sizes, measured in this order.
const SIZES: [usize; 3] = [100, 1_000, 5_000];
/// Thin nodes sharing one connection.
const GROUP: usize = 50;
/// Groups writing their nodes at once.
const WRITERS: usize = 16;
/// Each measured window (idle, then churning).
const WINDOW: Duration = Duration::from_secs(30);
/// After the cluster is up and the real agent settled, before measuring.
const SETTLE: Duration = Duration::from_secs(10);
/// One IPAM ADD every so often on the churning agent, each released a
/// second later: 100 pod events/s.
const CHURN_EVERY: Duration = Duration::from_millis(20);
/// The largest size's churning bytes/s per node, at most.
const CHURN_BYTES_GOAL: f64 = 2048.0;

fn sizes() -> Vec<usize> {
    lockstep_tests::bench::size(SIZES.to_vec(), vec![10, 20])
}

fn window() -> Duration {
    lockstep_tests::bench::size(WINDOW, Duration::from_secs(2))
}

fn settle() -> Duration {
    lockstep_tests::bench::size(SETTLE, Duration::from_secs(2))
}

fn pool() -> anyhow::Result<ClusterPoolSpec> {
    // /10 in /26 blocks: a block for every node and room for the agent's.
    Ok(serde_json::from_value(serde_json::json!({
        "name": "side",
        "ipv4": ["10.64.0.0/10"],
    }))?)
}

fn options(eps: &[String], prefix: &str) -> DoorOptions {
    lockstep_tests::synthetic::door_options(eps, prefix, Duration::from_secs(10))
}

/// Thin node `i`'s record: its underlay address is in 10.200.0.0/16,
/// which the real agent's namespace has on link (its routes to the thin
/// nodes' blocks install; no packet goes anywhere).
fn record(i: usize) -> anyhow::Result<lockstep::cluster::NodeRecord> {
    let ip = IpAddr::V4(Ipv4Addr::new(
        10,
        200,
        u8::try_from(i / 256)?,
        u8::try_from(i % 256)?,
    ));
    Ok(lockstep_tests::synthetic::node_record(
        format!("thin-{i:05}"),
        ip,
        0,
        "side",
    ))
}

/// What the thin nodes saw, summed.
#[derive(Default)]
struct Seen {
    /// Lease refreshes answered alive.
    refreshed: AtomicU64,
    /// Lease refreshes etcd answered with the lease gone, or that failed.
    lost: AtomicU64,
    /// Watches created.
    watching: AtomicU64,
    /// Watches that ended or failed before the stop.
    broken: AtomicU64,
    /// Events received on the watches.
    events: AtomicU64,
}

/// The product's default lease settings: (node lease TTL, LB lease TTL,
/// LB refresh interval).
fn defaults() -> anyhow::Result<(Duration, Duration, Duration)> {
    let text = lockstep_tests::cluster::cluster_config(
        &["http://127.0.0.1:1".into()],
        "/x/",
        "n",
        "10.0.0.1",
    );
    let config = Config::parse(Path::new("defaults.toml"), &text)?;
    let cluster = config.cluster.context("no [cluster]")?;
    Ok((
        cluster.lease_ttl,
        config.lb.announce_lease,
        config.lb.renew_every(),
    ))
}

/// Keeps `lease` alive every `every` on a stream of its own until `stop`.
async fn keep(
    mut client: Client,
    lease: i64,
    every: Duration,
    phase: Duration,
    seen: Arc<Seen>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let Ok((mut keeper, mut stream)) = client.lease_keep_alive(lease).await else {
        seen.lost.fetch_add(1, Ordering::Relaxed);
        return;
    };
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + phase, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = tick.tick() => {}
        }
        let alive = async {
            keeper.keep_alive().await?;
            anyhow::Ok(stream.message().await?.is_some_and(|r| r.ttl() > 0))
        }
        .await;
        match alive {
            Ok(true) => seen.refreshed.fetch_add(1, Ordering::Relaxed),
            _ => seen.lost.fetch_add(1, Ordering::Relaxed),
        };
    }
}

/// Follows `prefix` from the revision `from` gives, counting events,
/// until `stop`.
async fn follow(
    mut client: Client,
    prefix: String,
    mut from: tokio::sync::watch::Receiver<i64>,
    seen: Arc<Seen>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let Ok(rev) = from.wait_for(|r| *r > 0).await.map(|r| *r) else {
        return;
    };
    // As the agent's mirror watches (`Door::watch_raw`).
    let o = WatchOptions::new()
        .with_prefix()
        .with_start_revision(rev)
        .with_progress_notify();
    let Ok(mut stream) = client.watch(prefix, Some(o)).await else {
        seen.broken.fetch_add(1, Ordering::Relaxed);
        return;
    };
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            m = stream.message() => match m {
                Ok(Some(r)) => {
                    if r.created() {
                        seen.watching.fetch_add(1, Ordering::Relaxed);
                    }
                    if r.canceled() {
                        seen.broken.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                    seen.events.fetch_add(r.events().len() as u64, Ordering::Relaxed);
                }
                _ => {
                    seen.broken.fetch_add(1, Ordering::Relaxed);
                    return;
                }
            },
        }
    }
}

/// The thin nodes of one size.
struct Thin {
    seen: Arc<Seen>,
    stop: tokio::sync::watch::Sender<bool>,
    from: tokio::sync::watch::Sender<i64>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Thin {
    /// Writes `n` thin nodes under `prefix` and starts their lease
    /// refreshes (each right after its own keys are written, as an agent
    /// refreshes from its registration on); their watches wait for
    /// [`Thin::watch_from`].
    async fn start(eps: &[String], prefix: &str, n: usize) -> anyhow::Result<Thin> {
        let (node_ttl, lb_ttl, lb_every) = defaults()?;
        let seen = Arc::new(Seen::default());
        let stop = tokio::sync::watch::Sender::new(false);
        let from = tokio::sync::watch::Sender::new(0i64);
        let gate = Arc::new(tokio::sync::Semaphore::new(WRITERS));
        let mut groups = Vec::new();
        for g in 0..n.div_ceil(GROUP) {
            let (eps, prefix, seen, gate) =
                (eps.to_vec(), prefix.to_string(), seen.clone(), gate.clone());
            let (stop, from) = (stop.subscribe(), from.subscribe());
            groups.push(tokio::spawn(async move {
                let client = Client::connect(&eps, None).await?;
                let mut tasks = Vec::new();
                let permit = gate.acquire_owned().await?;
                let mut d = Door::connect(options(&eps, &prefix)).await?;
                for i in (g * GROUP)..((g + 1) * GROUP).min(n) {
                    let r = record(i)?;
                    let node_lease = d.register_node(&r, &[], node_ttl).await?;
                    let got = d
                        .claim_block("side", lockstep_tests::synthetic::block(i)?, &r.name)
                        .await?;
                    ensure!(matches!(got, Claim::Claimed { .. }), "{}: {got:?}", r.name);
                    let (lb_lease, _) = d.lb_grant(lb_ttl).await?;
                    d.lb_join(&r.name, &BTreeMap::new(), true, lb_lease).await?;
                    // Agents' refreshes fall at unrelated moments.
                    let phase = Duration::from_millis((i as u64 * 7919) % 1000);
                    tasks.push(tokio::spawn(keep(
                        client.clone(),
                        node_lease,
                        node_ttl / 3,
                        phase,
                        seen.clone(),
                        stop.clone(),
                    )));
                    tasks.push(tokio::spawn(keep(
                        client.clone(),
                        lb_lease,
                        lb_every,
                        phase,
                        seen.clone(),
                        stop.clone(),
                    )));
                    tasks.push(tokio::spawn(follow(
                        client.clone(),
                        prefix.clone(),
                        from.clone(),
                        seen.clone(),
                        stop.clone(),
                    )));
                }
                drop(permit);
                anyhow::Ok(tasks)
            }));
        }
        let mut tasks = Vec::new();
        for g in groups {
            tasks.extend(g.await??);
        }
        Ok(Thin {
            seen,
            stop,
            from,
            tasks,
        })
    }

    /// Opens every thin node's watch from etcd's revision now, and waits
    /// until all are created.
    async fn watch_from(&self, eps: &[String], prefix: &str, n: usize) -> anyhow::Result<()> {
        let mut c = Client::connect(eps, None).await?;
        let now = c
            .get(
                prefix,
                Some(GetOptions::new().with_prefix().with_count_only()),
            )
            .await?
            .header()
            .context("no header")?
            .revision();
        self.from.send_replace(now + 1);
        let started = Instant::now();
        while self.seen.watching.load(Ordering::Relaxed) < n as u64 {
            ensure!(
                started.elapsed() < Duration::from_secs(120),
                "{} of {n} watches created in 120 s ({} broken)",
                self.seen.watching.load(Ordering::Relaxed),
                self.seen.broken.load(Ordering::Relaxed)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(())
    }

    async fn stop(self) {
        self.stop.send_replace(true);
        for t in self.tasks {
            let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
        }
    }
}

/// One size's figures, per node per second.
#[derive(Clone, Copy, Debug)]
struct Figures {
    idle: Traffic,
    churn: Traffic,
    events_per_s: f64,
}

/// `t` per node (`nodes`) per second (`secs`).
fn per_node(t: Traffic, nodes: usize, secs: f64) -> Traffic {
    let k = nodes as f64 * secs;
    Traffic {
        unary: t.unary / k,
        streams: t.streams / k,
        stream_msgs: t.stream_msgs / k,
        sent_bytes: t.sent_bytes / k,
    }
}

/// Measures `n` thin nodes and one churning agent on a fresh etcd.
fn measure(n: usize, bin: &Path) -> anyhow::Result<Figures> {
    let cluster = EtcdCluster::start(3)?;
    let eps = cluster.endpoints();
    let prefix = "/side/";
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let up = Instant::now();
    let thin = rt.block_on(async {
        let mut d = Door::connect(options(&eps, prefix)).await?;
        d.apply_pools(&[pool()?]).await?;
        let thin = Thin::start(&eps, prefix, n).await?;
        thin.watch_from(&eps, prefix, n).await?;
        anyhow::Ok(thin)
    })?;
    println!(
        "   {n} thin nodes written, refreshing and watching in {:.1} s",
        up.elapsed().as_secs_f64()
    );
    let ns = lockstep_tests::cluster::lone_node(&format!("side{n}"), "192.0.2.2", &cluster)?;
    // The thin nodes' underlay on link: the agent's routes to their
    // blocks install (nothing is sent).
    ns.exec("ip", ["route", "add", "10.200.0.0/16", "dev", "u0"])?;
    let mut agent = lockstep_tests::AgentProc::launch(
        &ns,
        &lockstep_tests::AgentOptions {
            extra: lockstep_tests::cluster::cluster_config(&eps, prefix, "churner", "192.0.2.2"),
            bin: Some(bin.to_path_buf()),
            ..Default::default()
        },
    )?;
    agent.wait_ready()?;
    // A block held and a first address handed out before measuring.
    lockstep_tests::cluster::churn_endpoints(
        &agent,
        "warm",
        Duration::from_millis(100),
        Duration::from_millis(200),
    )?;
    std::thread::sleep(settle());
    let nodes = n + 1;
    let before = cluster.traffic()?;
    let t = Instant::now();
    std::thread::sleep(window());
    let idle = per_node(
        cluster.traffic()? - before,
        nodes,
        t.elapsed().as_secs_f64(),
    );
    let before = cluster.traffic()?;
    let events_before = thin.seen.events.load(Ordering::Relaxed);
    let churned = lockstep_tests::cluster::churn_endpoints(&agent, "pod", CHURN_EVERY, window())?;
    let churn = per_node(cluster.traffic()? - before, nodes, churned.secs);
    let events = thin.seen.events.load(Ordering::Relaxed) - events_before;
    // Every thin node still a member, no lease lost, no watch broken.
    let members = rt.block_on(async {
        let mut d = Door::connect(options(&eps, prefix)).await?;
        anyhow::Ok(d.lb_read().await?.members.len())
    })?;
    let (lost, broken, refreshed) = (
        thin.seen.lost.load(Ordering::Relaxed),
        thin.seen.broken.load(Ordering::Relaxed),
        thin.seen.refreshed.load(Ordering::Relaxed),
    );
    println!(
        "   {n} nodes: {refreshed} lease refreshes, {lost} lost; {broken} watches broken; {events} events to the thin nodes while churning ({:.1} pod events/s, {} ADDs over 100 ms); {members} LB members",
        churned.events_per_s(),
        churned.slow
    );
    drop(agent);
    rt.block_on(thin.stop());
    ensure!(
        lost == 0,
        "{lost} lease refreshes of thin nodes were lost: the figures count leases running out"
    );
    ensure!(broken == 0, "{broken} thin nodes' watches broke");
    ensure!(
        members == nodes,
        "{members} LB members, not {nodes}: a lease ran out"
    );
    Ok(Figures {
        idle,
        churn,
        events_per_s: churned.events_per_s(),
    })
}

/// One row of the table.
fn row(rows: &mut Vec<String>, what: &str, value: String, goal: &str, ok: Option<bool>) {
    rows.push(format!(
        "{what:<56} {value:>20} {goal:>10} {}",
        match ok {
            Some(true) => "PASS",
            Some(false) => "FAIL",
            None => "(info)",
        }
    ));
}

#[test]
#[ignore = "a benchmark: cargo xtask bench cluster"]
fn cluster_etcd_side() -> anyhow::Result<()> {
    lockstep_tests::privileged!();
    let bin = lockstep_tests::lockstep_bin();
    let sizes = sizes();
    println!(
        "\na. etcd's side: thin nodes (two lease streams and a watch each, the product's lease defaults) and one agent churning {:.0} pod events/s, {:?} windows:",
        2.0 / CHURN_EVERY.as_secs_f64(),
        window()
    );
    let mut all = Vec::new();
    for &n in &sizes {
        all.push((n, measure(n, &bin)?));
    }
    let judge = !lockstep_tests::bench::smoke();
    let mut rows = Vec::new();
    for (n, f) in &all {
        row(
            &mut rows,
            &format!("{n} nodes idle: requests/s per node"),
            format!("{:.4}", f.idle.unary + f.idle.streams),
            "≤ 1",
            judge.then_some(f.idle.unary + f.idle.streams <= 1.0),
        );
        row(
            &mut rows,
            &format!("{n} nodes idle: stream messages/s per node"),
            format!("{:.3}", f.idle.stream_msgs),
            "",
            None,
        );
        row(
            &mut rows,
            &format!("{n} nodes idle: bytes/s sent per node"),
            format!("{:.1}", f.idle.sent_bytes),
            "",
            None,
        );
        row(
            &mut rows,
            &format!(
                "{n} nodes, {:.0} pod events/s: requests/s per node",
                f.events_per_s
            ),
            format!("{:.4}", f.churn.unary + f.churn.streams),
            "",
            None,
        );
        row(
            &mut rows,
            &format!(
                "{n} nodes, {:.0} pod events/s: bytes/s sent per node",
                f.events_per_s
            ),
            format!("{:.1}", f.churn.sent_bytes),
            "",
            None,
        );
    }
    let (first, last) = (
        all.first().context("no size")?,
        all.last().context("no size")?,
    );
    let ratio = last.1.idle.sent_bytes / first.1.idle.sent_bytes;
    row(
        &mut rows,
        &format!("idle bytes/s per node, {} / {} nodes", last.0, first.0),
        format!("{ratio:.3}×"),
        "≤ 1.2×",
        judge.then_some(ratio <= 1.2),
    );
    row(
        &mut rows,
        &format!("churning bytes/s per node at {} nodes", last.0),
        format!("{:.1}", last.1.churn.sent_bytes),
        "≤ 2048",
        judge.then_some(last.1.churn.sent_bytes <= CHURN_BYTES_GOAL),
    );
    println!("\n{:<56} {:>20} {:>10} result", "measure", "value", "goal");
    for r in &rows {
        println!("{r}");
    }
    ensure!(
        !rows.iter().any(|r| r.ends_with("FAIL")),
        "a goal was missed"
    );
    Ok(())
}
