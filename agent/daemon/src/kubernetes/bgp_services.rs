//! What this node announces over BGP of the LoadBalancer Services (#48
//! item 2), from the Services, their EndpointSlices, the
//! LoadBalancerIPPools and this Node, by the core's rules
//! (`bgp::announce`): every node that may serve an address announces it;
//! under `externalTrafficPolicy: Local` only while it has an endpoint
//! that may serve; a node kept out of load balancing or not admitted by
//! the pool's `nodeSelector`, never.
//!
//! Without cluster mode `local_traffic` makes this decision in its own
//! rounds ([`decision`]), from the stores it already follows for its
//! elections. In cluster mode that task does not run (etcd elects who
//! answers by ARP/NDP), so [`spawn`] follows the same objects itself,
//! and adds cluster mode's rule: a node announces LoadBalancer addresses
//! only while its LB lease in etcd is live (a node cut off from etcd
//! withdraws them when its lease's term ends, as its ARP/NDP answers
//! stop then).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Client;
use kube::api::Api;
use kube::runtime::reflector::Store;
use lockstep_core::bgp::RouteAttrs;
use lockstep_core::bgp::announce::{Decision, LEASE_NOT_LIVE, decide, service_addresses};
use lockstep_core::lb::LbPoolSpec;
use lockstep_core::lb::kubernetes::local::Endpoint;
use tokio::sync::{Notify, watch};

use super::candidacy::Labels;
use super::crd::LoadBalancerIPPool;
use super::objects::{endpoints, service};
use super::reflectors::{Services, drive};
use crate::cluster::LbHandle;

/// How often the LB lease is looked at.
pub const TICK: Duration = Duration::from_millis(250);

/// The pools BGP announces, by name, with their routes' attributes.
pub type BgpPools = BTreeMap<String, RouteAttrs>;

/// What the decision reads.
pub struct Stores<'a> {
    /// The Services.
    pub services: &'a Store<Service>,
    /// The LoadBalancerIPPools.
    pub pools: &'a Store<LoadBalancerIPPool>,
    /// Each Service's endpoints (`namespace/name`), from the slices.
    pub endpoints: &'a BTreeMap<String, Vec<Endpoint>>,
    /// This node's labels (`None` before the Node is read).
    pub labels: Option<&'a BTreeMap<String, String>>,
    /// Whether this node may serve LoadBalancer addresses at all, else
    /// why not.
    pub may: &'a Result<(), String>,
}

/// What node `node` announces over BGP of the addresses of `announced`'s
/// pools, from `stores`.
pub fn decision(stores: &Stores<'_>, node: &str, announced: &BgpPools) -> Decision {
    let pools: Vec<LbPoolSpec> = stores
        .pools
        .state()
        .iter()
        .filter_map(|p| lockstep_core::lb::kubernetes::pool_spec(&p.to_core()).ok())
        .collect();
    let services: Vec<_> = stores
        .services
        .state()
        .iter()
        .filter(|s| s.metadata.deletion_timestamp.is_none())
        .map(|s| service(s))
        .collect();
    let mut addresses = Vec::new();
    let mut of = BTreeMap::new();
    for svc in &services {
        let key = format!("{}/{}", svc.namespace, svc.name);
        let these = stores.endpoints.get(&key).map_or(&[][..], Vec::as_slice);
        let start = addresses.len();
        addresses.extend(service_addresses(
            svc,
            these,
            &pools,
            stores.labels,
            announced,
        ));
        for a in &addresses[start..] {
            of.insert(a.address, key.clone());
        }
    }
    let mut d = decide(node, stores.may, &addresses, &[], announced);
    d.services = of
        .into_iter()
        .filter(|(a, _)| d.routes.contains_key(&ipnet::IpNet::from(*a)))
        .collect();
    d
}

/// What [`spawn`] follows beside the Services.
pub struct Follow {
    /// This Node's candidacy (`candidacy::follow`).
    pub candidacy: watch::Receiver<Result<(), String>>,
    /// This Node's labels.
    pub labels: Labels,
    /// The LB agent's handle: its lease says whether this node may
    /// announce.
    pub lease: Arc<LbHandle>,
}

/// Cluster mode: decides what node `node` announces of `announced`'s
/// pools from `services` and the EndpointSlices and LoadBalancerIPPools
/// it follows, each change sent on `tx` (`None` until every store
/// listed), until `stop`.
pub fn spawn(
    client: Client,
    node: String,
    announced: BgpPools,
    mut services: Services,
    follow: Follow,
    tx: watch::Sender<Option<Arc<Decision>>>,
    mut stop: watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    let Follow {
        mut candidacy,
        mut labels,
        lease,
    } = follow;
    tokio::spawn(async move {
        let wake = Arc::new(Notify::new());
        let (slices, slice_task) = drive(Api::<EndpointSlice>::all(client.clone()), wake.clone());
        let (pools, pool_task) = drive(Api::<LoadBalancerIPPool>::all(client), wake.clone());
        let ready = async {
            services.listed().await;
            let _ = slices.wait_until_ready().await;
            let _ = pools.wait_until_ready().await;
        };
        let listed = tokio::select! {
            () = ready => true,
            _ = stop.wait_for(|s| *s) => false,
        };
        if listed {
            // Decided again when a store, the Node or the lease changed.
            let mut fresh = true;
            let mut live = false;
            loop {
                let now_live = lease.lease_live();
                if fresh || now_live != live {
                    live = now_live;
                    let may = match candidacy.borrow_and_update().clone() {
                        Ok(()) if !live => Err(LEASE_NOT_LIVE.to_string()),
                        may => may,
                    };
                    let these = labels.borrow_and_update().clone();
                    services.changes.borrow_and_update();
                    let eps = endpoints(&slices);
                    let stores = Stores {
                        services: &services.store,
                        pools: &pools,
                        endpoints: &eps,
                        labels: these.as_ref(),
                        may: &may,
                    };
                    let d = decision(&stores, &node, &announced);
                    tx.send_if_modified(|cur| {
                        let changed = cur.as_deref() != Some(&d);
                        if changed {
                            *cur = Some(Arc::new(d));
                        }
                        changed
                    });
                }
                fresh = false;
                tokio::select! {
                    () = tokio::time::sleep(TICK) => {}
                    () = wake.notified() => fresh = true,
                    r = services.changes.changed() => {
                        fresh = true;
                        if r.is_err() {
                            services.changes = watch::channel(0).1;
                        }
                    },
                    r = candidacy.changed() => {
                        fresh = true;
                        if r.is_err() {
                            candidacy = watch::channel(Ok(())).1;
                        }
                    },
                    r = labels.changed() => {
                        fresh = true;
                        if r.is_err() {
                            labels = watch::channel(None).1;
                        }
                    },
                    _ = stop.wait_for(|s| *s) => break,
                }
            }
        }
        slice_task.abort();
        pool_task.abort();
    })
}
