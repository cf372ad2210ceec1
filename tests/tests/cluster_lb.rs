//! LoadBalancer IPAM in etcd (#13 items 1-2), against a real 3-member etcd:
//! two agents' assigners campaign at once and 50 services are stored from
//! two writers at once; every address is assigned once (its key created
//! once, matching the stored state), one assigner leads, a deposed
//! assigner's write is refused, the survivor takes over within its lease
//! and keeps every assignment, and a deleted service's address key goes.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use lockstep::cluster::{ClusterStoreError, Door, DoorOptions, LbView, Round};
use lockstep_core::lb::cluster::{LbChange, assigned};
use lockstep_core::lb::{LbIpam, LbPoolSpec, ServiceSpec};
use lockstep_tests::etcd::EtcdCluster;

const TTL: Duration = Duration::from_secs(2);

fn rt() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

fn options(eps: Vec<String>) -> DoorOptions {
    let mut o = DoorOptions::new(eps);
    o.prefix = "/lbtest/".into();
    // A loaded CI machine can hold etcd's fsync past the 2 s default.
    o.timeout = Duration::from_secs(10);
    o
}

async fn door(eps: Vec<String>) -> anyhow::Result<Door> {
    Ok(Door::connect(options(eps)).await?)
}

/// etcd did not answer in time: an agent's loop tries again next round.
fn transient(e: &ClusterStoreError) -> bool {
    matches!(e, ClusterStoreError::Unavailable { .. })
}

/// An agent's assigner: a lease kept alive and a round every 50 ms until
/// `stop`. Returns the rounds it saw.
fn assigner(
    rt: &tokio::runtime::Runtime,
    eps: Vec<String>,
    node: &'static str,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<anyhow::Result<(i64, Vec<Round>)>> {
    rt.spawn(async move {
        let mut d = door(eps).await?;
        let lease = d.lb_lease(TTL).await?;
        let mut rounds = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            match d.keep_alive(lease).await {
                Err(e) if !transient(&e) => return Err(e.into()),
                _ => {}
            }
            match d.lb_round(node, lease).await {
                Ok(r) => rounds.push(r),
                Err(e) if transient(&e) => {}
                Err(e) => return Err(e.into()),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok((lease, rounds))
    })
}

/// Waits until `ok(view)` holds.
async fn until(
    d: &mut Door,
    what: &str,
    ok: impl Fn(&LbView) -> bool,
) -> anyhow::Result<Arc<LbView>> {
    let started = Instant::now();
    loop {
        match d.lb_read().await {
            Ok(v) if ok(&v) => return Ok(v),
            Err(e) if !transient(&e) => return Err(e.into()),
            _ => {}
        }
        ensure!(
            started.elapsed() < Duration::from_secs(15),
            "{what}: not within 15 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The stored state's assignments, and checks that the address keys say
/// exactly the same and no address has two services.
fn check_unique(v: &LbView) -> anyhow::Result<BTreeMap<IpAddr, BTreeSet<String>>> {
    let (state, _) = v.state.as_ref().context("no state")?;
    let lb = LbIpam::restore(state)?;
    let by_addr = assigned(&lb);
    ensure!(
        by_addr == v.addresses,
        "address keys {:?} != state {:?}",
        v.addresses,
        by_addr
    );
    for (a, users) in &by_addr {
        ensure!(users.len() == 1, "{a} held by {users:?}");
    }
    let mut seen = BTreeSet::new();
    for (id, st) in lb.services() {
        for a in st.addresses() {
            ensure!(seen.insert(*a), "{a} twice (second: {id})");
        }
    }
    Ok(by_addr)
}

fn assigned_count(v: &LbView) -> usize {
    v.state
        .as_ref()
        .and_then(|(s, _)| LbIpam::restore(s).ok())
        .map_or(0, |lb| {
            lb.services()
                .filter(|(_, st)| !st.addresses().is_empty())
                .count()
        })
}

#[test]
fn addresses_are_assigned_once_by_one_fenced_assigner_across_failover() -> anyhow::Result<()> {
    let cluster = EtcdCluster::start(3)?;
    let eps = cluster.endpoints();
    let rt = rt()?;
    rt.block_on(async {
        let mut w = door(eps.clone()).await?;
        w.lb_put_pool(&LbPoolSpec::new("pub").cidr("192.0.2.0/26"))
            .await?;
        anyhow::Ok(())
    })?;
    let (stop_a, stop_b) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let a = assigner(&rt, eps.clone(), "node-a", stop_a.clone());
    let b = assigner(&rt, eps.clone(), "node-b", stop_b.clone());
    // 50 services from two writers at once.
    rt.block_on(async {
        let mut writers = Vec::new();
        for w in 0..2 {
            let eps = eps.clone();
            writers.push(tokio::spawn(async move {
                let mut d = door(eps).await?;
                for i in 0..25 {
                    d.lb_put_service(&ServiceSpec::new("web", format!("s{w}-{i:02}")))
                        .await?;
                }
                anyhow::Ok(())
            }));
        }
        for t in writers {
            t.await??;
        }
        anyhow::Ok(())
    })?;
    let (first, leader) = rt.block_on(async {
        let mut d = door(eps.clone()).await?;
        let v = until(&mut d, "50 services assigned", |v| assigned_count(v) == 50).await?;
        let leader = v.assigner.clone().context("no assigner")?;
        anyhow::Ok((check_unique(&v)?, leader))
    })?;
    ensure!(first.len() == 50, "{} addresses", first.len());
    for addr in first.keys() {
        ensure!(
            "192.0.2.0/26".parse::<ipnet::IpNet>()?.contains(addr),
            "{addr} outside the pool"
        );
    }

    // The leader dies (its rounds and keep-alives stop); the other takes
    // over once the lease is gone, and keeps every assignment.
    let (dead, dead_task, survivor) = if leader.0 == "node-a" {
        (stop_a.clone(), a, b)
    } else {
        (stop_b.clone(), b, a)
    };
    dead.store(true, Ordering::Relaxed);
    let (dead_lease, dead_rounds) = rt.block_on(dead_task)??;
    ensure!(
        dead_rounds
            .iter()
            .any(|r| matches!(r, Round::Stored { .. })),
        "the leader stored nothing: {dead_rounds:?}"
    );
    let took_over = Instant::now();
    rt.block_on(async {
        let mut d = door(eps.clone()).await?;
        for i in 0..5 {
            d.lb_put_service(&ServiceSpec::new("web", format!("late-{i}")))
                .await?;
        }
        let v = until(&mut d, "the survivor assigns the late services", |v| {
            assigned_count(v) == 55
        })
        .await?;
        let new_leader = v.assigner.clone().context("no assigner")?;
        ensure!(new_leader.0 != leader.0, "still {leader:?}");
        let now = check_unique(&v)?;
        for (addr, users) in &first {
            ensure!(now.get(addr) == Some(users), "{addr} moved in the failover");
        }
        // The deposed assigner's fence no longer writes anything.
        let (state, _) = v.state.clone().context("state")?;
        let stale = LbChange {
            state,
            added: BTreeMap::from([(
                "192.0.2.63".parse::<IpAddr>()?,
                BTreeSet::from(["web/intruder".to_string()]),
            )]),
            updated: BTreeMap::new(),
            removed: BTreeSet::new(),
            changed: true,
        };
        ensure!(
            !d.lb_commit(leader.1, &v, &stale).await?,
            "a deposed assigner stored a state"
        );
        let after = d.lb_read().await?;
        ensure!(
            !after
                .addresses
                .contains_key(&"192.0.2.63".parse::<IpAddr>()?),
            "the deposed write created an address key"
        );

        // A deleted service's address key goes.
        let (gone_addr, gone_id) = first
            .iter()
            .next()
            .map(|(a, u)| (*a, u.iter().next().cloned().unwrap_or_default()))
            .context("first")?;
        ensure!(d.lb_delete_service(&gone_id).await?, "{gone_id} not stored");
        let v = until(&mut d, "a deleted service's address freed", |v| {
            !v.addresses.contains_key(&gone_addr)
        })
        .await?;
        check_unique(&v)?;
        anyhow::Ok(())
    })?;
    println!(
        "takeover after the leader's death: {:?} (lease {} s); dead lease {dead_lease}",
        took_over.elapsed(),
        TTL.as_secs()
    );
    stop_a.store(true, Ordering::Relaxed);
    stop_b.store(true, Ordering::Relaxed);
    let (_, rounds) = rt.block_on(survivor)??;
    ensure!(
        rounds.iter().any(|r| matches!(r, Round::Follower { .. })),
        "the survivor never followed: both led at once?"
    );
    Ok(())
}

#[test]
fn a_bad_pool_or_service_is_refused_before_anything_is_written() -> anyhow::Result<()> {
    let cluster = EtcdCluster::start(1)?;
    let rt = rt()?;
    rt.block_on(async {
        let mut d = door(cluster.endpoints()).await?;
        let e = d
            .lb_put_pool(&LbPoolSpec::new("bad").cidr("192.0.2.1/24"))
            .await
            .err()
            .context("a pool with host bits stored")?;
        ensure!(e.to_string().contains("192.0.2.1/24"), "{e}");
        let mut s = ServiceSpec::new("web", "two-v4");
        s.load_balancer_ips = vec!["192.0.2.1".parse()?, "192.0.2.2".parse()?];
        let e = d
            .lb_put_service(&s)
            .await
            .err()
            .context("a bad service stored")?;
        ensure!(
            e.to_string().contains("two-v4") || e.to_string().contains("192.0.2"),
            "{e}"
        );
        let v = d.lb_read().await?;
        ensure!(v.pools.is_empty() && v.services.is_empty(), "{v:?}");
        anyhow::Ok(())
    })
}

/// An LB pool may not share an address with a cluster (endpoint) pool,
/// whichever is applied first: `lb apply` in cluster mode refuses the LB
/// pool, `pools apply` the cluster pool, both naming the two pools and
/// storing nothing; and an LB pool checked against cluster pools that
/// changed before it was stored is not stored (the transaction's guard).
#[test]
fn lb_pools_and_cluster_pools_never_overlap_whichever_comes_first() -> anyhow::Result<()> {
    use lockstep::cluster::LbAgent;
    use lockstep_core::cluster::ClusterPoolSpec;

    let cluster = EtcdCluster::start(1)?;
    let rt = rt()?;
    rt.block_on(async {
        let mut d = door(cluster.endpoints()).await?;
        let mut pods = ClusterPoolSpec::new("pods");
        pods.ipv4 = vec!["10.70.0.0/16".parse()?];
        pods.ipv6 = vec!["fd00:70::/112".parse()?];
        d.apply_pools(std::slice::from_ref(&pods)).await?;
        let lb = LbAgent::new("node-a".into(), TTL, options(cluster.endpoints())).handle();
        // The LB pool overlaps the cluster pool by one CIDR of two: refused,
        // both named, nothing stored (not even the good service).
        let bad = LbPoolSpec::new("public")
            .cidr("192.0.2.0/24")
            .cidr("fd00:70::100/120");
        let svc = ServiceSpec::new("web", "front");
        let e = lb
            .apply(vec![bad], vec![svc.clone()], Duration::ZERO)
            .await
            .err()
            .context("an LB pool inside a cluster pool was stored")?;
        ensure!(
            e.to_string().contains(
                "lb pool public: fd00:70::100/120 overlaps fd00:70::/112 of cluster pool pods"
            ),
            "{e}"
        );
        let v = d.lb_read().await?;
        ensure!(v.pools.is_empty() && v.services.is_empty(), "{v:?}");
        // A disjoint LB pool is stored; a cluster pool grown over it is then
        // refused, naming both, and the cluster pools stay as they were.
        let good = LbPoolSpec::new("public").cidr("192.0.2.0/24");
        lb.apply(vec![good.clone()], vec![svc], Duration::ZERO)
            .await?;
        let mut grown = pods.clone();
        grown.ipv4.push("192.0.0.0/22".parse()?);
        let e = d
            .apply_pools(&[grown])
            .await
            .err()
            .context("a cluster pool over an LB pool was stored")?;
        ensure!(
            e.to_string().contains(
                "lb pool public: 192.0.2.0/24 overlaps 192.0.0.0/22 of cluster pool pods"
            ),
            "{e}"
        );
        let (now, _, _) = d.pools().await?;
        ensure!(now == vec![pods.clone()], "cluster pools changed: {now:?}");
        // The guard: LB pools checked against the cluster pools of an
        // earlier revision are not stored once a cluster pool was written.
        let (_, _, checked_at) = d.pools().await?;
        let mut more = pods.clone();
        more.ipv4.push("10.71.0.0/16".parse()?);
        d.apply_pools(&[more]).await?;
        let late = LbPoolSpec::new("late").cidr("198.51.100.0/24");
        let e = d
            .lb_put(std::slice::from_ref(&late), &[], checked_at)
            .await
            .err()
            .context("stored against stale cluster pools")?;
        ensure!(matches!(e, ClusterStoreError::Conflict { .. }), "{e}");
        let v = d.lb_read().await?;
        ensure!(
            v.pools.keys().collect::<Vec<_>>() == ["public"],
            "{:?}",
            v.pools.keys()
        );
        anyhow::Ok(())
    })
}

/// A node's announcement loop: its node key and announcements under one
/// lease kept alive, a plan every 100 ms, acted on (no datapath here: the
/// door-level half of the handover).
fn announcer_loop(
    rt: &tokio::runtime::Runtime,
    eps: Vec<String>,
    node: String,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<anyhow::Result<()>> {
    rt.spawn(async move {
        let mut d = door(eps).await?;
        let record = lockstep::cluster::NodeRecord {
            name: node.clone(),
            ips: vec![],
            version: "test".into(),
            blocks: vec![],
            in_use: 0,
            wanted: 0,
            instance: None,
        };
        let lease = d.register_node(&record, &[], TTL).await?;
        while !stop.load(Ordering::Relaxed) {
            let round = async {
                d.keep_alive(lease).await?;
                let plan = d.lb_announce_plan(&node).await?;
                for a in plan.drop {
                    d.lb_withdraw(a, &node).await?;
                }
                for a in plan.take {
                    d.lb_announce(a, &node, lease).await?;
                }
                Ok::<(), ClusterStoreError>(())
            };
            match round.await {
                Err(e) if !transient(&e) => return Err(e.into()),
                _ => {}
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(())
    })
}

#[test]
fn each_address_is_announced_by_its_one_chosen_node_and_handed_over_after_the_lease()
-> anyhow::Result<()> {
    use lockstep_core::lb::LabelSelector;
    use lockstep_core::lb::cluster::{Candidate, announcer};
    let cluster = EtcdCluster::start(3)?;
    let eps = cluster.endpoints();
    let rt = rt()?;
    // 30 services assigned by one assigner.
    rt.block_on(async {
        let mut d = door(eps.clone()).await?;
        d.lb_put_pool(&LbPoolSpec::new("pub").cidr("198.51.100.0/26"))
            .await?;
        for i in 0..30 {
            d.lb_put_service(&ServiceSpec::new("web", format!("s{i:02}")))
                .await?;
        }
        let lease = d.lb_lease(Duration::from_secs(30)).await?;
        for _ in 0..5 {
            d.lb_round("assigner", lease).await?;
        }
        let v = until(&mut d, "30 assigned", |v| assigned_count(v) == 30).await?;
        check_unique(&v)?;
        anyhow::Ok(())
    })?;
    let names = ["node-0", "node-1", "node-2"];
    let stops: Vec<Arc<AtomicBool>> = names.iter().map(|_| Arc::default()).collect();
    let tasks: Vec<_> = names
        .iter()
        .zip(&stops)
        .map(|(n, s)| announcer_loop(&rt, eps.clone(), n.to_string(), s.clone()))
        .collect();
    let all = LabelSelector::default();
    let cands = |live: &[&str]| -> Vec<Candidate> {
        live.iter()
            .map(|n| Candidate {
                name: n.to_string(),
                labels: BTreeMap::new(),
                answers: true,
            })
            .collect()
    };
    // Converged: every address announced, each by its chosen node.
    let converged = |live: &'static [&'static str]| {
        let eps = eps.clone();
        let cands = cands(live);
        let all = all.clone();
        async move {
            let mut d = door(eps).await?;
            let started = Instant::now();
            loop {
                let v = d.lb_read().await?;
                let held = d.lb_announcements().await?;
                let want: BTreeMap<IpAddr, String> = v
                    .addresses
                    .keys()
                    .map(|a| {
                        (
                            *a,
                            announcer(*a, &all, &cands).map_or(String::new(), |c| c.name.clone()),
                        )
                    })
                    .collect();
                let have: BTreeMap<IpAddr, String> =
                    held.into_iter().map(|(a, (n, _))| (a, n)).collect();
                if want == have && want.len() == 30 {
                    return anyhow::Ok(started.elapsed());
                }
                ensure!(
                    started.elapsed() < Duration::from_secs(15),
                    "not converged: want {want:?}, have {have:?}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    rt.block_on(converged(&["node-0", "node-1", "node-2"]))?;
    let of1: BTreeSet<IpAddr> = rt.block_on(async {
        let mut d = door(eps.clone()).await?;
        let held = d.lb_announcements().await?;
        anyhow::Ok(
            held.into_iter()
                .filter(|(_, (n, _))| n == "node-1")
                .map(|(a, _)| a)
                .collect(),
        )
    })?;
    ensure!(!of1.is_empty(), "node-1 announces nothing");

    // node-1 dies: its keys stand until its lease ends (no other node
    // takes them meanwhile), then the others take them.
    stops[1].store(true, Ordering::Relaxed);
    let died = Instant::now();
    let mut last_seen = Duration::ZERO;
    rt.block_on(async {
        let mut d = door(eps.clone()).await?;
        loop {
            let held = d.lb_announcements().await?;
            let still: Vec<&IpAddr> = of1
                .iter()
                .filter(|a| held.get(*a).is_some_and(|(n, _)| n == "node-1"))
                .collect();
            for a in &of1 {
                if let Some((n, _)) = held.get(a) {
                    ensure!(
                        n == "node-1" || still.is_empty() || !still.contains(&a),
                        "{a} taken by {n} while node-1's key stands"
                    );
                }
            }
            if still.is_empty() {
                break;
            }
            last_seen = died.elapsed();
            ensure!(
                died.elapsed() < Duration::from_secs(10),
                "node-1's keys outlive its lease"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        anyhow::Ok(())
    })?;
    let took = rt.block_on(converged(&["node-0", "node-2"]))?;
    println!(
        "node-1's announcements stood {last_seen:?} after it stopped (lease {} s); all re-announced {took:?} later",
        TTL.as_secs()
    );
    ensure!(
        last_seen >= Duration::from_millis(500),
        "withdrawn too early: {last_seen:?}"
    );
    for s in &stops {
        s.store(true, Ordering::Relaxed);
    }
    for t in tasks {
        rt.block_on(t)??;
    }
    Ok(())
}
