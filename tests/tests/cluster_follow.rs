//! The claim loop following the cluster per changed key (#47 item 2)
//! against a real etcd: other nodes' blocks claimed and given back, their
//! counts published, and now and then a pool applied (which the loop
//! reads whole). After every change, the other nodes' blocks the loop
//! hands its allocator are those a whole read of etcd finds, whether the
//! loop followed the change in place or read everything again.
//!
//! The allocator is a recording double of the agent's [`ClusterAllocator`]
//! side: the test looks at what the claim loop tells it, the loop's one
//! output for these changes (the agent's own handling is the agent tests').

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use ipnet::IpNet;
use lockstep::announce::UplinkHealth;
use lockstep::cluster::allocator::{AllocatorDoor, ClusterAllocator, DoorFuture, Job};
use lockstep::cluster::{
    AgentSlot, Block, Claim, ClusterHandle, ClusterNode, Door, DoorOptions, Link, NodeRecord,
};
use lockstep::config::Config;
use lockstep_core::cidr::Family;
use lockstep_core::cluster::remote::RemoteState;
use lockstep_core::cluster::{ClusterPoolSpec, LocalOverlap};
use lockstep_core::pool::PoolSpec;
use lockstep_tests::etcd::EtcdCluster;
use lockstep_tests::synthetic::{Draw, node_record};

const PREFIX: &str = "/follow/";
/// Changes made, one after the other.
const STEPS: usize = 60;
/// Other nodes.
const OTHERS: usize = 6;

/// What the claim loop last told the allocator of the other nodes'
/// blocks, and of the addresses never to hand out.
#[derive(Default)]
struct Recorder {
    others: Option<BTreeMap<IpNet, String>>,
    reserved: Option<BTreeSet<IpAddr>>,
}

impl ClusterAllocator for Recorder {
    fn set_cluster_windows(&mut self, _: BTreeMap<IpNet, BTreeSet<IpAddr>>) {}
    fn window_views(
        &self,
        groups: &[(String, Family)],
        _: usize,
    ) -> Vec<(Vec<IpAddr>, Vec<IpAddr>)> {
        groups.iter().map(|_| (Vec::new(), Vec::new())).collect()
    }
    fn set_local_overlaps(&mut self, _: Vec<LocalOverlap>) {}
    fn set_cluster_pools(
        &mut self,
        _: Vec<PoolSpec>,
        _: BTreeMap<IpNet, String>,
        reserved: BTreeSet<IpAddr>,
    ) -> Result<(), String> {
        self.reserved = Some(reserved);
        Ok(())
    }
    fn set_cluster_others(&mut self, _: &str, others: imbl::OrdMap<IpNet, String>) {
        self.others = Some(others.into_iter().collect());
    }
    fn set_cluster_default(&mut self, _: Result<Option<String>, String>) {}
    fn block_usage(&self, blocks: &[IpNet]) -> Vec<u64> {
        vec![0; blocks.len()]
    }
    fn addresses_in(&self, _: &[IpNet]) -> Vec<IpAddr> {
        Vec::new()
    }
    fn reconcile(&mut self) -> Result<(), String> {
        Ok(())
    }
    fn follow_remote(&mut self, _: &RemoteState, _: &RemoteState) -> Result<(), String> {
        Ok(())
    }
    fn uplink_health(&mut self) -> UplinkHealth {
        UplinkHealth::None
    }
}

/// The way to the recorder, and whether the node's blocks are full.
struct RecorderDoor(Mutex<Recorder>, AtomicBool);

impl AllocatorDoor for RecorderDoor {
    fn present(&self) -> bool {
        true
    }
    /// Every block empty, or (with the flag up) every address in use:
    /// the loop claims another block each round, as it does for a node
    /// whose pods keep coming.
    fn usage(&self, blocks: &[IpNet]) -> (Vec<u64>, Vec<IpAddr>) {
        let full = self.1.load(Ordering::SeqCst);
        let used = blocks
            .iter()
            .map(|b| {
                if full {
                    b.hosts().count() as u64 + 2
                } else {
                    0
                }
            })
            .collect();
        (used, Vec::new())
    }
    fn run(&self, job: Job) -> DoorFuture<'_, bool> {
        let mut r = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        job(&mut *r);
        Box::pin(async { true })
    }
}

fn options(eps: &[String]) -> DoorOptions {
    lockstep_tests::synthetic::door_options(eps, PREFIX, Duration::from_secs(10))
}

fn pool(extra: usize) -> anyhow::Result<ClusterPoolSpec> {
    let mut ipv4 = vec!["10.64.0.0/16".to_string()];
    ipv4.extend((0..extra).map(|i| format!("10.{}.0.0/16", 80 + i)));
    Ok(serde_json::from_value(
        serde_json::json!({ "name": "follow", "ipv4": ipv4 }),
    )?)
}

fn record(i: usize, in_use: u64) -> NodeRecord {
    let ip = IpAddr::V4(Ipv4Addr::new(10, 201, 0, u8::try_from(i).unwrap_or(0)));
    node_record(format!("other-{i}"), ip, in_use, "follow")
}

/// What both tests start from: a one-member etcd, the claim loop's
/// config as node "me", a runtime, the stop switch and the recorder.
struct Fixture {
    cluster: EtcdCluster,
    eps: Vec<String>,
    dir: lockstep_tests::TempDir,
    config: Config,
    rt: tokio::runtime::Runtime,
    stop: tokio::sync::watch::Sender<bool>,
    stopped: tokio::sync::watch::Receiver<bool>,
    door: Arc<RecorderDoor>,
}

impl Fixture {
    fn new() -> anyhow::Result<Fixture> {
        let cluster = EtcdCluster::start(1)?;
        let eps = cluster.endpoints();
        let dir = lockstep_tests::TempDir::new("follow")?;
        let text = format!(
            "state_dir = \"{}\"\n{}release_after = \"1s\"\n",
            dir.path().display(),
            lockstep_tests::cluster::cluster_config(&eps, PREFIX, "me", "10.199.0.1")
        );
        let config = Config::parse(Path::new("follow.toml"), &text)?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let (stop, stopped) = tokio::sync::watch::channel(false);
        Ok(Fixture {
            cluster,
            eps,
            dir,
            config,
            rt,
            stop,
            stopped,
            door: Arc::new(RecorderDoor(
                Mutex::new(Recorder::default()),
                AtomicBool::new(false),
            )),
        })
    }
}

/// What a test's body is given: etcd's endpoints, the claim loop's
/// config, the recorder and the stop switch.
struct Parts {
    eps: Vec<String>,
    config: Config,
    door: Arc<RecorderDoor>,
    stop: tokio::sync::watch::Sender<bool>,
    stopped: tokio::sync::watch::Receiver<bool>,
}

impl Fixture {
    /// Runs a test's body on the runtime, etcd and the state directory
    /// kept until it is done; the stop switch goes with the body, so
    /// whatever it left running stops when it ends, failed or not.
    fn run<F: Future<Output = anyhow::Result<()>>>(
        self,
        body: impl FnOnce(Parts) -> F,
    ) -> anyhow::Result<()> {
        let Fixture {
            cluster: _cluster,
            eps,
            dir: _dir,
            config,
            rt,
            stop,
            stopped,
            door,
        } = self;
        rt.block_on(body(Parts {
            eps,
            config,
            door,
            stop,
            stopped,
        }))
    }
}

/// The mirror's task, the claim loop's, and the loop's handle.
type Spawned = (
    tokio::task::JoinHandle<()>,
    tokio::task::JoinHandle<()>,
    Arc<ClusterHandle>,
);

/// Starts the mirror and the claim loop (its allocator the recorder).
async fn spawn_loop(p: &Parts) -> anyhow::Result<Spawned> {
    let link = Link::new(PREFIX);
    let mut o = options(&p.eps);
    o.link = Some(link.clone());
    let mirror = link.mirror().clone().spawn(o, p.stopped.clone());
    let node = ClusterNode::connect(&p.config, Some(link))
        .await
        .map_err(|e| anyhow::anyhow!("claim loop: {e}"))?;
    let handle = node.handle();
    let slot: AgentSlot = Some(p.door.clone());
    Ok((mirror, node.spawn(slot, p.stopped.clone()), handle))
}

/// A writer's door on etcd with the pool applied and `count` other nodes
/// registered under long leases (returned, in order).
async fn others(eps: &[String], count: usize) -> anyhow::Result<(Door, Vec<i64>)> {
    let mut w = Door::connect(options(eps)).await?;
    w.apply_pools(&[pool(0)?]).await?;
    let mut leases = Vec::new();
    for i in 0..count {
        leases.push(
            w.register_node(&record(i, 1), &[], Duration::from_secs(600))
                .await?,
        );
    }
    Ok((w, leases))
}

/// Stops the loop and its mirror, waiting for both.
async fn finish(stop: &tokio::sync::watch::Sender<bool>, tasks: [tokio::task::JoinHandle<()>; 2]) {
    let _ = stop.send(true);
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
    }
}

/// Waits until the loop is settled: "me" registered and holding a block,
/// its own writes behind it (they are read, not followed).
async fn settled(w: &mut Door) -> anyhow::Result<()> {
    let started = Instant::now();
    while !(w.nodes().await?.iter().any(|n| n.record.name == "me")
        && w.blocks().await?.0.iter().any(|b| b.node == "me"))
    {
        ensure!(
            started.elapsed() < Duration::from_secs(15),
            "me never registered and held a block"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    Ok(())
}

#[test]
fn the_other_nodes_blocks_followed_per_change_are_the_whole_read() -> anyhow::Result<()> {
    Fixture::new()?.run(|p|  async move {
        let (mut w, leases) = others(&p.eps, OTHERS).await?;
        let (mirror, task, _) = spawn_loop(&p).await?;
        let mut held: BTreeMap<IpNet, Block> = BTreeMap::new();
        let mut draw = Draw(47);
        let mut pools_applied = 0;
        for step in 0..STEPS {
            let other = draw.below(OTHERS);
            match draw.below(10) {
                0..=3 => {
                    let cidr = lockstep_tests::synthetic::block(draw.below(40))?;
                    if let std::collections::btree_map::Entry::Vacant(free) = held.entry(cidr) {
                        let name = record(other, 0).name;
                        let got = w.claim_block("follow", cidr, &name).await?;
                        if let Claim::Claimed { revision } = got {
                            free.insert(Block {
                                pool: "follow".into(),
                                cidr,
                                node: name,
                                instance: None,
                                revision,
                            });
                        }
                    }
                }
                4..=6 => {
                    let pick = draw.below(held.len().max(1));
                    if let Some(cidr) = held.keys().nth(pick).copied() {
                        let b = held.remove(&cidr).context("held")?;
                        ensure!(w.release_block(&b).await?, "{cidr} not given back");
                    }
                }
                7 | 8 => {
                    w.publish_node(&record(other, draw.below(60) as u64), &[], leases[other])
                        .await?;
                }
                _ => {
                    pools_applied += 1;
                    w.apply_pools(&[pool(pools_applied % 3)?]).await?;
                }
            }
            let (blocks, _) = w.blocks().await?;
            let want: BTreeMap<IpNet, String> = blocks
                .iter()
                .filter(|b| b.node != "me")
                .map(|b| (b.cidr, b.node.clone()))
                .collect();
            let started = Instant::now();
            loop {
                let got = p
                    .door
                    .0
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .others
                    .clone();
                if got.as_ref() == Some(&want) {
                    break;
                }
                ensure!(
                    started.elapsed() < Duration::from_secs(15),
                    "step {step}: the claim loop's other nodes' blocks are not the whole read\nloop: {got:?}\netcd: {want:?}"
                );
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
        }
        finish(&p.stop, [task, mirror]).await;
        anyhow::Ok(())
    })
}

/// A node that comes is followed in place (no read: at a cluster's
/// bring-up every node sees every other come), and the loop still knows
/// it is alive: when its lease goes, the loop, its keeper, marks it gone.
/// Were it not counted alive, its key's deletion would look like nothing
/// to the loop, and no mark would come.
#[test]
fn a_node_come_followed_in_place_is_marked_gone_when_its_lease_goes() -> anyhow::Result<()> {
    Fixture::new()?.run(|p| async move {
        let (mut w, _) = others(&p.eps, 3).await?;
        let (mirror, task, _) = spawn_loop(&p).await?;
        settled(&mut w).await?;
        // A node comes ("zz-…" sorts last: its keeper, the next live name
        // round the ring, is "me"), and its lease goes a moment later.
        let late = node_record("zz-late".into(), "10.201.0.99".parse()?, 1, "follow");
        let lease = w
            .register_node(&late, &[], Duration::from_secs(600))
            .await?;
        // The loop sees it come (a round follows every change within its
        // tick) before it goes: both in one look would be a read.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let mut raw = etcd_client::Client::connect(&p.eps, None).await?;
        raw.lease_revoke(lease).await?;
        let started = Instant::now();
        loop {
            let routing = w.routing_keys().await?;
            let mark = routing
                .iter()
                .find(|(r, _)| r.name == "zz-late")
                .and_then(|(r, _)| r.gone);
            if mark.is_some() {
                break;
            }
            ensure!(
                started.elapsed() < Duration::from_secs(10),
                "zz-late's lease is gone, but its keeper never marked it gone: {routing:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        finish(&p.stop, [task, mirror]).await;
        anyhow::Ok(())
    })
}

/// A node's death, followed in place: another node's lease goes, and its
/// keeper (not this loop's node) marks it gone and later reclaims it,
/// freeing its block and reserving its window's addresses. Each of the
/// three changes is followed without a whole read, and the loop hands its
/// allocator what a whole read finds: the other nodes' blocks, and the
/// reserved addresses kept out. Before, each made every node of the
/// cluster read it whole.
#[test]
fn a_node_gone_marked_and_reclaimed_elsewhere_is_followed_without_a_read() -> anyhow::Result<()> {
    Fixture::new()?.run(|p|  async move {
        let (mut w, leases) = others(&p.eps, 4).await?;
        // other-1 holds a block and has published a window in it.
        let cidr = lockstep_tests::synthetic::block(7)?;
        let got = w.claim_block("follow", cidr, "other-1").await?;
        ensure!(matches!(got, Claim::Claimed { .. }), "{got:?}");
        let window: BTreeSet<IpAddr> = cidr.hosts().take(3).collect();
        w.put_window("other-1", &window, 0).await?;
        let (mirror, task, handle) = spawn_loop(&p).await?;
        settled(&mut w).await?;
        let reads = handle.figures().whole_reads;
        let followed = handle.figures().changes_followed;
        // What the loop hands its allocator, against a whole read.
        let agrees = |door: &RecorderDoor, want_others: &BTreeMap<IpNet, String>, want_reserved: &BTreeSet<IpAddr>| {
            let r = door.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            r.others.as_ref() == Some(want_others) && r.reserved.as_ref() == Some(want_reserved)
        };
        // 1. other-1's lease goes (its keeper is other-2, the next name).
        let mut raw = etcd_client::Client::connect(&p.eps, None).await?;
        raw.lease_revoke(leases[1]).await?;
        tokio::time::sleep(Duration::from_secs(3)).await;
        // 2. Its keeper marks it gone, long enough ago to reclaim it.
        let (routing, revision) = w
            .routing_keys()
            .await?
            .iter()
            .find(|(r, _)| r.name == "other-1")
            .cloned()
            .context("other-1's routing key")?;
        let mark = lockstep_core::cluster::GoneMark {
            since_ms: 1,
            reclaim_after_ms: 1,
        };
        ensure!(w.mark_gone(&routing, revision, mark).await?, "not marked");
        tokio::time::sleep(Duration::from_secs(3)).await;
        // 3. Its keeper reclaims it: the block freed, the window reserved.
        let removed = w.reclaim_node("other-1").await?;
        ensure!(!removed.freed.is_empty(), "{removed:?}");
        let (blocks, _) = w.blocks().await?;
        let want_others: BTreeMap<IpNet, String> = blocks
            .iter()
            .filter(|b| b.node != "me")
            .map(|b| (b.cidr, b.node.clone()))
            .collect();
        let want_reserved: BTreeSet<IpAddr> = w
            .reservations()
            .await?
            .iter()
            .filter(|(r, _)| r.name != "me")
            .flat_map(|(r, _)| r.addresses.iter().copied())
            .collect();
        ensure!(want_reserved == window, "reserved {want_reserved:?}, window {window:?}");
        let started = Instant::now();
        while !agrees(&p.door, &want_others, &want_reserved) {
            ensure!(
                started.elapsed() < Duration::from_secs(15),
                "the loop's other blocks and reserved addresses are not the whole read's: etcd {want_others:?}, {want_reserved:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let f = handle.figures();
        eprintln!(
            "gone, marked, reclaimed: {} whole reads, {} batches followed",
            f.whole_reads - reads,
            f.changes_followed - followed
        );
        ensure!(
            f.whole_reads == reads,
            "the loop read the cluster whole {} times for another node's death",
            f.whole_reads - reads
        );
        ensure!(f.changes_followed >= followed + 3, "{} batches followed", f.changes_followed - followed);
        finish(&p.stop, [task, mirror]).await;
        anyhow::Ok(())
    })
}

/// This node's own blocks, claimed as its pods fill them and given back
/// as they empty, are followed without a read: its claim's echo and its
/// give-back's are what it made them, and each next claim picks from the
/// view so kept (#47 item 2). Before, each own claim took two whole reads
/// (one to pick from, one for the echo): at 5,000 nodes, a node's own
/// pod churn cost it the cluster's size per block.
#[test]
fn own_claims_and_give_backs_are_followed_without_a_read() -> anyhow::Result<()> {
    Fixture::new()?.run(|p| async move {
        let (mut w, _) = others(&p.eps, 3).await?;
        let (mirror, task, handle) = spawn_loop(&p).await?;
        settled(&mut w).await?;
        let mine = |blocks: &[Block]| blocks.iter().filter(|b| b.node == "me").count();
        let base = mine(&w.blocks().await?.0);
        let reads = handle.figures().whole_reads;
        let claims = handle.figures().block_claims;
        // Pods fill every block: one claimed each round.
        p.door.1.store(true, Ordering::SeqCst);
        let started = Instant::now();
        while mine(&w.blocks().await?.0) < base + 6 {
            ensure!(
                started.elapsed() < Duration::from_secs(20),
                "me never claimed 6 more blocks: {:?}",
                w.blocks().await?.0
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // They go: the empty blocks are given back after `release_after`.
        p.door.1.store(false, Ordering::SeqCst);
        let peak = mine(&w.blocks().await?.0);
        let started = Instant::now();
        while mine(&w.blocks().await?.0) > base {
            ensure!(
                started.elapsed() < Duration::from_secs(20),
                "me never gave its empty blocks back: {:?}",
                w.blocks().await?.0
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Every echo followed before the figures are read.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let f = handle.figures();
        eprintln!(
            "{} blocks claimed, {} given back: {} whole reads, {} batches followed",
            f.block_claims - claims,
            peak - base,
            f.whole_reads - reads,
            f.changes_followed
        );
        ensure!(
            f.block_claims >= claims + 6,
            "{} claims",
            f.block_claims - claims
        );
        ensure!(
            f.whole_reads == reads,
            "the loop read the cluster whole {} times for its own {} claims and give-backs",
            f.whole_reads - reads,
            peak - base
        );
        finish(&p.stop, [task, mirror]).await;
        anyhow::Ok(())
    })
}

/// Nodes come and go while others are gone, followed in place, and the
/// duty for a gone node passes with its keeper: "a-0" goes (its keeper
/// "a-1", which the test plays and which marks nothing), "other-9"
/// comes, and "other-1" goes (kept by "other-9"): none is a read for
/// this node, which keeps none of them. Then "a-1" goes: this node ("me", the next live name)
/// now keeps "a-0" and "a-1", reads, and marks both gone. Before, a node
/// come or gone while another was gone was read whole by every node, and
/// in a large cluster some node is nearly always gone.
#[test]
fn nodes_come_and_gone_while_others_are_gone_are_followed_and_the_duty_passes() -> anyhow::Result<()>
{
    Fixture::new()?.run(|p| async move {
        let (mut w, mut leases) = others(&p.eps, 2).await?;
        for (i, name) in ["a-0", "a-1"].iter().enumerate() {
            let ip: IpAddr = format!("10.202.0.{}", i + 1).parse()?;
            let r = node_record((*name).into(), ip, 1, "follow");
            leases.push(w.register_node(&r, &[], Duration::from_secs(600)).await?);
        }
        let (mirror, task, handle) = spawn_loop(&p).await?;
        settled(&mut w).await?;
        let reads = handle.figures().whole_reads;
        let mut raw = etcd_client::Client::connect(&p.eps, None).await?;
        // 1. a-0 goes: kept by a-1.
        raw.lease_revoke(leases[2]).await?;
        tokio::time::sleep(Duration::from_secs(2)).await;
        // 2. A node comes while a-0 is gone.
        let late = node_record("other-9".into(), "10.201.0.99".parse()?, 1, "follow");
        w.register_node(&late, &[], Duration::from_secs(600))
            .await?;
        tokio::time::sleep(Duration::from_secs(2)).await;
        // 3. other-1 goes too: kept by other-9.
        raw.lease_revoke(leases[1]).await?;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let f = handle.figures();
        eprintln!(
            "a-0 gone, other-9 come, other-1 gone: {} whole reads",
            f.whole_reads - reads
        );
        ensure!(
            f.whole_reads == reads,
            "the loop read the cluster whole {} times for nodes come and gone it keeps none of",
            f.whole_reads - reads
        );
        let marked = |routing: &[(lockstep::cluster::NodeAddrRecord, i64)], name: &str| {
            routing
                .iter()
                .any(|(r, _)| r.name == name && r.gone.is_some())
        };
        let routing = w.routing_keys().await?;
        ensure!(
            !marked(&routing, "a-0") && !marked(&routing, "other-1"),
            "a gone node kept by another was marked by this loop: {routing:?}"
        );
        // 4. a-1 goes: this node keeps a-0 and a-1 now.
        raw.lease_revoke(leases[3]).await?;
        let started = Instant::now();
        loop {
            let routing = w.routing_keys().await?;
            if marked(&routing, "a-0") && marked(&routing, "a-1") {
                break;
            }
            ensure!(
                started.elapsed() < Duration::from_secs(10),
                "a-1 went and this node keeps a-0 and a-1, but never marked them: {routing:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        finish(&p.stop, [task, mirror]).await;
        anyhow::Ok(())
    })
}
