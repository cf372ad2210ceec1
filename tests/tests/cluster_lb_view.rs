//! The LB view a node follows through its mirror (#47 item 2) against the
//! same view read whole from etcd, after every change of a long fixed
//! sequence: pools and services stored and deleted, members joining
//! with labels, leaving (their lease revoked, which deletes their keys),
//! announcements taken and withdrawn, and assigner rounds writing the
//! state, its per-service keys and the address keys. The followed view is
//! made from the last one with only the changed keys written in; the
//! whole read is the definition it must equal.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use anyhow::ensure;
use lockstep::cluster::{ClusterStoreError, Door, DoorOptions, LbView, Link};
use lockstep_core::lb::{LbPoolSpec, ServiceSpec};
use lockstep_tests::etcd::EtcdCluster;
use lockstep_tests::synthetic::Draw;

const PREFIX: &str = "/lbview/";
/// Changes made, one after the other.
const STEPS: usize = 160;
/// Nodes the members are drawn from.
const NODES: usize = 12;

fn options(eps: &[String]) -> DoorOptions {
    let mut o = DoorOptions::new(eps.to_vec());
    o.prefix = PREFIX.into();
    o.timeout = Duration::from_secs(10);
    o
}

/// What a view says, its revision and how it was made left out.
fn said(v: &LbView) -> String {
    format!(
        "pools {:?}\nservices {:?}\nstate {:?}\nstored {:?}\nmeta {:?}\nlegacy {}\naddresses {:?}\nassigner {:?} under {}\nannouncements {:?}\nmembers {:?}",
        v.pools,
        v.services,
        v.state,
        v.stored,
        v.meta,
        v.legacy,
        v.addresses,
        v.assigner,
        v.assigner_lease,
        v.announcements,
        v.members.iter().collect::<Vec<_>>(),
    )
}

#[test]
fn the_followed_view_is_the_view_read_whole_after_every_change() -> anyhow::Result<()> {
    let cluster = EtcdCluster::start(1)?;
    let eps = cluster.endpoints();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let link = Link::new(PREFIX);
    let mut o = options(&eps);
    o.link = Some(link.clone());
    let mirror = {
        let _in = rt.enter();
        link.mirror().clone().spawn(o.clone(), stopped)
    };
    let result = rt.block_on(async {
        // Follows the mirror and never writes: every read after the first
        // is made from the last one.
        let mut follower = Door::connect(o).await?;
        let mut whole = Door::connect(options(&eps)).await?;
        let mut w = Door::connect(options(&eps)).await?;
        let assigner = w.lb_lease(Duration::from_secs(60)).await?;
        let mut leases: BTreeMap<usize, i64> = BTreeMap::new();
        let mut draw = Draw(47);
        let address = |i: usize| IpAddr::V4(Ipv4Addr::new(192, 0, 2, u8::try_from(i).unwrap_or(0)));
        for step in 0..STEPS {
            let node = draw.below(NODES);
            match draw.below(8) {
                0 => {
                    let p = draw.below(3);
                    let pool = LbPoolSpec::new(format!("p{p}")).cidr(&format!("198.51.{p}.0/26"));
                    w.lb_put_pool(&pool).await?;
                }
                1 | 2 => {
                    let s = ServiceSpec::new("web", format!("s{}", draw.below(10)));
                    w.lb_put_service(&s).await?;
                }
                3 => {
                    w.lb_delete_service(&format!("web/s{}", draw.below(10)))
                        .await?;
                }
                4 => {
                    let lease = match leases.get(&node) {
                        Some(l) => *l,
                        None => w.lb_grant(Duration::from_secs(60)).await?.0,
                    };
                    leases.insert(node, lease);
                    let labels = BTreeMap::from([("zone".to_string(), draw.below(2).to_string())]);
                    w.lb_join(&format!("n{node}"), &labels, draw.below(4) != 0, lease)
                        .await?;
                }
                5 => {
                    if let Some(lease) = leases.remove(&node) {
                        w.lb_revoke(lease).await?;
                    }
                }
                6 => {
                    if let Some(lease) = leases.get(&node) {
                        w.lb_announce(address(draw.below(6)), &format!("n{node}"), *lease)
                            .await?;
                    }
                }
                _ => {
                    if draw.below(2) == 0 {
                        w.lb_withdraw(address(draw.below(6)), &format!("n{node}"))
                            .await?;
                    } else {
                        w.keep_alive(assigner).await?;
                        // Definitions the core refuses (a service no pool
                        // can serve) leave the state as it is.
                        match w.lb_round("n-assigner", assigner).await {
                            Ok(_) | Err(ClusterStoreError::Invalid(_)) => {}
                            Err(e) => return Err(e.into()),
                        }
                    }
                }
            }
            // The follower's mirror sees the change within moments; until
            // then its view may be behind, never different once caught up.
            let want = said(&*whole.lb_read().await?);
            let started = Instant::now();
            loop {
                let got = said(&*follower.lb_read().await?);
                if got == want {
                    break;
                }
                ensure!(
                    started.elapsed() < Duration::from_secs(10),
                    "step {step}: the followed view is not the whole read\nfollowed:\n{got}\nwhole:\n{want}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        anyhow::Ok(())
    });
    let _ = stop.send(true);
    let _ = rt.block_on(async { tokio::time::timeout(Duration::from_secs(10), mirror).await });
    result
}
