//! #27 item 6: the LB assigner's state stored per service, so no key grows
//! with the cluster's services and no request passes etcd's size limit;
//! and the move from the one-key layout of older agents. Door level (no
//! agent), a real 3-member etcd.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use lockstep::cluster::{ClusterStoreError, Door, DoorOptions, Link, Round};
use lockstep_core::lb::cluster::{assigned, reconcile};
use lockstep_core::lb::{LbIpam, LbPoolSpec, LbSnapshot, ServiceSpec};
use lockstep_tests::etcd::EtcdCluster;

const TTL: Duration = Duration::from_secs(3);

fn rt() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

async fn door(eps: &[String], prefix: &str) -> anyhow::Result<Door> {
    let mut o = DoorOptions::new(eps.to_vec());
    o.prefix = prefix.to_string();
    // A loaded machine can hold etcd's fsync past the 2 s default.
    o.timeout = Duration::from_secs(10);
    Ok(Door::connect(o).await?)
}

fn services(from: usize, to: usize) -> Vec<ServiceSpec> {
    (from..to)
        .map(|i| ServiceSpec::new("web", format!("s{i:05}")))
        .collect()
}

/// Runs assigner rounds for `node` until one finds nothing to do and the
/// state holds `want` services.
async fn assign(d: &mut Door, node: &str, lease: i64, want: usize) -> anyhow::Result<usize> {
    let started = Instant::now();
    let mut rounds = 0;
    loop {
        d.keep_alive(lease).await?;
        match d.lb_round(node, lease).await {
            Ok(Round::Idle) => {
                let v = d.lb_read().await?;
                let have = v.state.as_ref().map_or(0, |(s, _)| s.services.len());
                if have == want {
                    return Ok(rounds);
                }
            }
            Ok(Round::Follower { assigner }) => anyhow::bail!("{assigner} leads"),
            Ok(_) => rounds += 1,
            Err(ClusterStoreError::Unavailable { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        ensure!(
            started.elapsed() < Duration::from_secs(300),
            "{want} services not assigned in 300 s"
        );
    }
}

/// Every assigned address and its services, as the stored state has them.
fn addresses(state: &LbSnapshot) -> anyhow::Result<BTreeMap<IpAddr, BTreeSet<String>>> {
    Ok(assigned(&LbIpam::restore(state)?))
}

/// 3,200 services: each in a key of its own, the meta key small, every
/// address once; the one-key layout would have held them all in one value
/// (its size printed beside).
#[test]
fn thousands_of_services_are_stored_one_key_each() -> anyhow::Result<()> {
    let cluster = EtcdCluster::start(3)?;
    let eps = cluster.endpoints();
    let rt = rt()?;
    const N: usize = 3_200;
    rt.block_on(async {
        let mut d = door(&eps, "/lb-layout/").await?;
        let pool = LbPoolSpec::new("lb").cidr("172.20.0.0/16");
        let (_, _, at) = d.pools().await?;
        d.lb_put(&[pool], &[], at).await?;
        for k in (0..N).step_by(125) {
            d.lb_put(&[], &services(k, (k + 125).min(N)), at).await?;
        }
        let lease = d.lb_lease(TTL).await?;
        let rounds = assign(&mut d, "node-a", lease, N).await?;
        let v = d.lb_read().await?;
        let (state, _) = v.state.clone().context("no state")?;
        let meta = serde_json::to_vec(&v.meta.as_ref().context("no meta key")?.0)?.len();
        let largest = v
            .stored
            .values()
            .map(|s| serde_json::to_vec(s).map(|b| b.len()))
            .collect::<Result<Vec<_>, _>>()?
            .into_iter()
            .max()
            .unwrap_or(0);
        let one_key = serde_json::to_vec(&state)?.len();
        eprintln!(
            "{N} services in {rounds} rounds: meta key {meta} bytes, largest service key {largest} bytes; the one-key layout would hold {one_key} bytes in one value"
        );
        ensure!(v.stored.len() == N, "{} service keys", v.stored.len());
        ensure!(meta < 4_096, "the meta key holds {meta} bytes");
        ensure!(largest < 2_048, "a service key holds {largest} bytes");
        let addrs = addresses(&state)?;
        ensure!(addrs.len() == N, "{} addresses for {N} services", addrs.len());
        ensure!(
            addrs.values().all(|u| u.len() == 1),
            "an address held by two services"
        );
        ensure!(
            v.addresses.len() == N,
            "{} address keys for {N} addresses",
            v.addresses.len()
        );
        anyhow::Ok(())
    })?;
    // `lb/state` holds the marker an older agent cannot read as a state.
    let old = cluster.ctl(
        &[cluster.endpoint(0)],
        &["get", "/lb-layout/lb/state", "--print-value-only"],
    )?;
    ensure!(
        serde_json::from_str::<LbSnapshot>(old.trim()).is_err() && old.contains("moved"),
        "lb/state: {old}"
    );
    Ok(())
}

/// A state an older agent stored in the one-key layout moves to the
/// per-service layout at the new assigner's first round (in parts: it is
/// larger than one transaction), every service keeping its address; an
/// older agent then fails to read `lb/state`, naming why, instead of
/// acting on a state nobody updates.
#[test]
fn a_state_in_the_one_key_layout_moves_and_every_address_stays() -> anyhow::Result<()> {
    let cluster = EtcdCluster::start(3)?;
    let eps = cluster.endpoints();
    let ep = [cluster.endpoint(0)];
    let rt = rt()?;
    const N: usize = 300;
    let pool = LbPoolSpec::new("lb").cidr("172.21.0.0/16");
    // What an older assigner stored: the pools and services, the state in
    // one key, an address key per address.
    let old = reconcile(None, vec![pool.clone()], services(0, N))?;
    rt.block_on(async {
        let mut d = door(&eps, "/lb-move/").await?;
        let (_, _, at) = d.pools().await?;
        d.lb_put(&[pool], &[], at).await?;
        for k in (0..N).step_by(125) {
            d.lb_put(&[], &services(k, (k + 125).min(N)), at).await?;
        }
        anyhow::Ok(())
    })?;
    cluster.ctl(
        &ep,
        &[
            "put",
            "/lb-move/lb/state",
            &serde_json::to_string(&old.state)?,
        ],
    )?;
    for (a, users) in &old.added {
        cluster.ctl(
            &ep,
            &[
                "put",
                &format!("/lb-move/lb/addresses/{a}"),
                &serde_json::to_string(users)?,
            ],
        )?;
    }
    let before = addresses(&old.state)?;
    rt.block_on(async {
        let mut d = door(&eps, "/lb-move/").await?;
        // Read as the old layout first.
        let v = d.lb_read().await?;
        ensure!(v.meta.is_none(), "a meta key before the move");
        ensure!(
            v.state.as_ref().is_some_and(|(s, _)| s.services.len() == N),
            "the one-key state not read"
        );
        let lease = d.lb_lease(TTL).await?;
        let rounds = assign(&mut d, "node-new", lease, N).await?;
        let v = d.lb_read().await?;
        ensure!(v.meta.is_some(), "no meta key after the move");
        ensure!(v.stored.len() == N, "{} service keys", v.stored.len());
        let (state, _) = v.state.clone().context("no state")?;
        let after = addresses(&state)?;
        eprintln!("{N} services moved in {rounds} rounds");
        ensure!(
            after == before,
            "addresses moved: {} differ",
            before
                .iter()
                .filter(|(a, u)| after.get(*a) != Some(*u))
                .count()
        );
        anyhow::Ok(())
    })?;
    let marker = cluster.ctl(&ep, &["get", "/lb-move/lb/state", "--print-value-only"])?;
    let older = serde_json::from_str::<LbSnapshot>(marker.trim())
        .expect_err("an older agent reads the marker as a state");
    ensure!(
        older.to_string().contains("upgrade"),
        "an older agent's error does not say why: {older}"
    );
    Ok(())
}

/// A deleted service leaves the per-service state at the next round:
/// its key is deleted with its addresses' keys, and the round after has
/// nothing to do. Read through a mirror, as an agent reads: one
/// transaction deletes several keys at one revision, and a mirror that
/// applied only the first change of a revision kept the service's key,
/// so the assigner removed it again every round (and a lease's end,
/// which deletes all its keys at one revision, looked like one key gone).
#[test]
fn a_deleted_service_leaves_the_state_in_one_round() -> anyhow::Result<()> {
    let cluster = EtcdCluster::start(3)?;
    let eps = cluster.endpoints();
    let rt = rt()?;
    rt.block_on(async {
        let link = Link::new("/lb-delete/");
        let mut o = DoorOptions::new(eps.clone());
        o.prefix = "/lb-delete/".into();
        o.timeout = Duration::from_secs(10);
        o.link = Some(link.clone());
        let (_stop, stopped) = tokio::sync::watch::channel(false);
        let _mirror = link.mirror().clone().spawn(o.clone(), stopped);
        let mut d = Door::connect(o).await?;
        let pool = LbPoolSpec::new("lb").cidr("172.22.0.0/24");
        let (_, _, at) = d.pools().await?;
        d.lb_put(&[pool], &services(0, 10), at).await?;
        let lease = d.lb_lease(TTL).await?;
        assign(&mut d, "node-a", lease, 10).await?;
        d.lb_delete(&["web/s00003".to_string()], &[]).await?;
        let mut rounds = Vec::new();
        for _ in 0..4 {
            rounds.push(d.lb_round("node-a", lease).await?);
        }
        let v = d.lb_read().await?;
        ensure!(
            !v.stored.contains_key("web/s00003"),
            "the deleted service's key stays; rounds {rounds:?}"
        );
        ensure!(
            matches!(
                rounds[..],
                [Round::Stored { removed: 1, .. }, Round::Idle, ..]
            ),
            "rounds {rounds:?}"
        );
        anyhow::Ok(())
    })
}
