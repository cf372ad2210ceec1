//! Cluster mode without Kubernetes: what this node announces over BGP of
//! the LoadBalancer addresses the elected assigner stored in etcd.
//!
//! Apart from the speaker because its source is another door: every
//! [`READ_EVERY`] it reads the stored assignments through the LB agent's
//! handle (`cluster::LbHandle`, served from the etcd mirror while it is
//! live), and decides (core `bgp::announce::decide_stored`): every node
//! whose labels the address's pool admits announces it (ECMP), but only
//! while its LB lease in etcd is live (looked at every [`TICK`]). It
//! decides again only when the read or the lease changed. A node cut off
//! from etcd withdraws its LoadBalancer routes when its lease's term
//! runs out, the moment another node may act on its absence, as the L2
//! path stops answering then. The decision goes out on the watch channel
//! the speaker reads (`None` until etcd answered once: an agent starting
//! again withdraws nothing).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lockstep_core::bgp::RouteAttrs;
use lockstep_core::bgp::announce::{Decision, LEASE_NOT_LIVE, decide_stored};
use lockstep_core::lb::{PoolStatus, ServiceStatus};
use tokio::sync::watch;

use crate::cluster::LbHandle;

/// How often the lease is looked at and the decision made again.
pub const TICK: Duration = Duration::from_millis(250);
/// How often the stored assignments are read.
pub const READ_EVERY: Duration = Duration::from_secs(1);
/// How long one read may take before the last one read stands.
pub const READ_TIMEOUT: Duration = Duration::from_secs(1);

/// What the follower needs: where it reads, and whom it decides for.
#[derive(Clone)]
pub struct Stored {
    /// The LB agent's handle.
    pub handle: Arc<LbHandle>,
    /// This node's name in cluster mode.
    pub node: String,
    /// `[cluster] node_labels`, matched against pools' node selectors.
    pub labels: BTreeMap<String, String>,
    /// The pools `[bgp.pools]` names, with their routes' attributes.
    pub attrs: BTreeMap<String, RouteAttrs>,
}

/// Starts deciding for `stored` into `tx`, until `stop`.
pub fn spawn(
    stored: Stored,
    tx: watch::Sender<Option<Arc<Decision>>>,
    mut stop: watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut read: Option<(Vec<PoolStatus>, BTreeMap<String, ServiceStatus>)> = None;
        let mut read_at: Option<Instant> = None;
        let mut failing: Option<String> = None;
        // Decided again only when the read or the lease changed.
        let mut fresh = false;
        let mut live = false;
        loop {
            if read_at.is_none_or(|at| at.elapsed() >= READ_EVERY) {
                read_at = Some(Instant::now());
                match tokio::time::timeout(READ_TIMEOUT, stored.handle.assignments()).await {
                    Ok(Ok(a)) => {
                        if failing.take().is_some() {
                            tracing::info!("bgp: the stored LoadBalancer addresses are read again");
                        }
                        let now = Some((a.lb.pools, a.lb.services));
                        fresh |= now != read;
                        read = now;
                    }
                    Ok(Err(e)) => note(&mut failing, crate::error_chain(&e)),
                    Err(_) => note(&mut failing, format!("no answer within {READ_TIMEOUT:?}")),
                }
            }
            let now_live = stored.handle.lease_live();
            if let Some((pools, services)) = &read
                && (fresh || now_live != live)
            {
                fresh = false;
                live = now_live;
                let may = if live {
                    Ok(())
                } else {
                    Err(LEASE_NOT_LIVE.to_string())
                };
                let d = decide_stored(
                    &stored.node,
                    &may,
                    pools,
                    services,
                    &stored.labels,
                    &stored.attrs,
                );
                tx.send_if_modified(|cur| {
                    let changed = cur.as_deref() != Some(&d);
                    if changed {
                        *cur = Some(Arc::new(d));
                    }
                    changed
                });
            }
            tokio::select! {
                () = tokio::time::sleep(TICK) => {}
                _ = stop.wait_for(|s| *s) => return,
            }
        }
    })
}

/// Says once per distinct error that the stored assignments cannot be
/// read (the last read stands meanwhile).
fn note(failing: &mut Option<String>, why: String) {
    if failing.as_deref() != Some(why.as_str()) {
        tracing::warn!(error = %why, "bgp: the stored LoadBalancer addresses cannot be read; the last read stands");
        *failing = Some(why);
    }
}
