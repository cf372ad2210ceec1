//! `externalTrafficPolicy: Local` without cluster mode (#44 item 3): each
//! such Service's addresses are answered (ARP, NDP) by one node with a
//! ready local endpoint, never by the writer for it, and never by two
//! nodes at once.
//!
//! Why a Lease per Service: the node that answers must follow the
//! endpoints (a rolling update moves them), and the old node must have
//! stopped before the new one starts. The nodes the core's
//! `lb::kubernetes::local::candidate` names take part in an election on
//! the Service's own `coordination.k8s.io/v1` Lease
//! (`lockstep-lb.<namespace>.<name>`, in `[kubernetes.election]`'s
//! namespace, with its timing), run by the same core `Elector` and Lease
//! door as the writer's. A holder that stops being a candidate (its
//! endpoint went) stops answering at once and releases the Lease once its
//! deadline has passed; a candidate takes it on its next round. A holder
//! that dies stops answering at its deadline (the announcement entries
//! expire then) and another candidate takes over after one duration.
//! Nodes with no local endpoint send no request for the Service at all.
//!
//! Pools with a `nodeSelector` (#44 item 4) are kept the same way: each
//! has a Lease (`lockstep-lbpool.<pool>`) among the nodes whose labels,
//! as they are now, the selector admits; a node relabelled out of it steps
//! aside at once, like a node whose endpoint went. The core's
//! `lb::kubernetes::seats` says which election each address goes to.
//!
//! Each Lease is kept by a task of its own (`seat`): this task derives
//! the elections when the stores change and tells each keeper whether
//! this node stands and for which addresses; it never waits for the API,
//! and no derivation delays a renewal.
//!
//! With `[bgp]` ([`LocalTraffic::with_bgp`]) the same rounds, from the
//! same stores, also decide what this node announces over BGP: there,
//! every node that may serve an address announces it, so no Lease is
//! needed, only the rules (core `bgp::announce`).
//!
//! The task publishes [`LocalAnswers`]: the announcer answers what this
//! node holds, the writer's part leaves every seated address out, and the
//! writer's status pass says when a Service has no serving endpoint.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Client;
use kube::api::Api;
use kube::runtime::reflector::Store;
use lockstep_core::bgp::announce::Decision;
use lockstep_core::lb::kubernetes::local::{Endpoint, candidates, local_addresses};
use lockstep_core::lb::kubernetes::seats::{Placement, SelectorPool, placements};
use tokio::sync::Notify;

use super::candidacy::Labels;
use super::crd::LoadBalancerIPPool;
use super::election::{LeaseDoor, elector, now_ms};
pub use super::local_answers::LocalAnswers;
use super::objects::{endpoints, service};
use super::reflectors::{Services, drive};
use super::seat::{Links, Seat, Want};
use crate::config::ElectionConfig;

/// What a round reads.
struct View<'a> {
    services: &'a Store<Service>,
    slices: &'a Store<EndpointSlice>,
    pools: &'a Store<LoadBalancerIPPool>,
    /// This node's labels (`None` before the Node is read).
    labels: Option<&'a BTreeMap<String, String>>,
    /// Whether this node may answer at all, else why not.
    may: Result<(), String>,
}

/// Follows the `Local` Services' endpoints and the selector pools, and
/// keeps their Leases.
pub struct LocalTraffic {
    client: Client,
    config: ElectionConfig,
    node: String,
    /// Each election this node takes part in, kept by a task of its own.
    seats: BTreeMap<String, Seat>,
    /// What the stores said when they last changed.
    derived: Derived,
    tx: tokio::sync::watch::Sender<LocalAnswers>,
    /// With `[bgp]`: the pools it announces (with their routes'
    /// attributes), and where what this node announces goes.
    bgp: Option<(BgpPools, tokio::sync::watch::Sender<Option<Arc<Decision>>>)>,
}

pub use super::bgp_services::BgpPools;

/// The pools with a node selector (a pool the writer refuses is left
/// out: it serves no address).
fn selector_pools(pools: &Store<LoadBalancerIPPool>) -> Vec<SelectorPool> {
    pools
        .state()
        .iter()
        .filter_map(|p| lockstep_core::lb::kubernetes::pool_spec(&p.to_core()).ok())
        .filter_map(|spec| SelectorPool::of(&spec))
        .collect()
}

impl LocalTraffic {
    /// Node `node`'s elections under `config`'s timing (checked with the
    /// writer's, `election::Keeper::new`: a Service's seat is never made
    /// with a timing the core refuses); the receiver follows what it
    /// answers.
    #[must_use]
    pub fn new(
        client: Client,
        config: &ElectionConfig,
        node: &str,
    ) -> (Self, tokio::sync::watch::Receiver<LocalAnswers>) {
        let (tx, rx) = tokio::sync::watch::channel(LocalAnswers::default());
        (
            Self {
                client,
                config: config.clone(),
                node: node.to_owned(),
                seats: BTreeMap::new(),
                derived: Derived::default(),
                tx,
                bgp: None,
            },
            rx,
        )
    }

    /// Decides, too, what this node announces over BGP of the addresses
    /// of `pools` (the core's `bgp::announce`: every node that may serve
    /// an address announces it; under `Local` only while a candidate),
    /// from the same stores, each change sent on the receiver (`None`
    /// until the stores were first read: nothing is decided yet, and an
    /// agent starting again must not withdraw what BIRD announces).
    #[must_use]
    pub fn with_bgp(
        mut self,
        pools: BgpPools,
    ) -> (Self, tokio::sync::watch::Receiver<Option<Arc<Decision>>>) {
        let (tx, rx) = tokio::sync::watch::channel(None);
        self.bgp = Some((pools, tx));
        (self, rx)
    }

    /// Runs until `stop` over `services` (the LB loop's reflector): while
    /// `candidacy` says no, this node answers none of them; `labels` are
    /// this node's, for pools' node selectors. `applied` is the
    /// announcer's: the last [`LocalAnswers::version`] written into the
    /// datapath.
    pub async fn run(
        mut self,
        mut services: Services,
        mut candidacy: tokio::sync::watch::Receiver<Result<(), String>>,
        mut labels: Labels,
        applied: tokio::sync::watch::Receiver<u64>,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) {
        let wake = Arc::new(Notify::new());
        let (slices, task) = drive(Api::<EndpointSlice>::all(self.client.clone()), wake.clone());
        let (pools, pool_task) = drive(
            Api::<LoadBalancerIPPool>::all(self.client.clone()),
            wake.clone(),
        );
        let ready = async {
            services.listed().await;
            let _ = slices.wait_until_ready().await;
            let _ = pools.wait_until_ready().await;
        };
        let stopped = tokio::select! {
            () = ready => false,
            _ = stop.wait_for(|s| *s) => true,
        };
        if !stopped {
            // The keepers wake this task whenever one publishes.
            let changed = Arc::new(Notify::new());
            // The stores, labels or candidacy changed since the elections
            // were last derived: derive them again.
            let mut fresh = true;
            loop {
                let may = candidacy.borrow_and_update().clone();
                let these = labels.borrow_and_update().clone();
                let view = View {
                    services: &services.store,
                    slices: &slices,
                    pools: &pools,
                    labels: these.as_ref(),
                    may,
                };
                services.changes.borrow_and_update();
                self.round(fresh.then_some(&view), &changed, &applied, &stop);
                fresh = false;
                // Wake when a hold lapses, to stop answering at once.
                let lapse = self
                    .tx
                    .borrow()
                    .held
                    .values()
                    .min()
                    .map_or(self.config.retry_period, |u| {
                        Duration::from_nanos(u.saturating_sub(now_ms() * 1_000_000))
                    });
                tokio::select! {
                    () = tokio::time::sleep(self.config.retry_period.min(lapse)) => {}
                    () = wake.notified() => fresh = true,
                    () = changed.notified() => {}
                    r = services.changes.changed() => {
                        fresh = true;
                        if r.is_err() {
                            services.changes = tokio::sync::watch::channel(0).1;
                        }
                    },
                    r = candidacy.changed() => {
                        fresh = true;
                        if r.is_err() {
                            candidacy = tokio::sync::watch::channel(Ok(())).1;
                        }
                    },
                    r = labels.changed() => {
                        fresh = true;
                        if r.is_err() {
                            labels = tokio::sync::watch::channel(None).1;
                        }
                    },
                    _ = stop.wait_for(|s| *s) => break,
                }
            }
        }
        task.abort();
        pool_task.abort();
        self.release_all().await;
    }

    /// One round: candidacies from the endpoints and labels (derived again
    /// from `view` when it is given: something changed), told to each
    /// seat's keeper (started when this node first stands for it), and what
    /// this node answers published. The keepers read and write the Leases
    /// on their own clocks: nothing here waits for the API.
    fn round(
        &mut self,
        view: Option<&View<'_>>,
        changed: &Arc<Notify>,
        applied: &tokio::sync::watch::Receiver<u64>,
        stop: &tokio::sync::watch::Receiver<bool>,
    ) {
        if let Some(view) = view {
            // Every Service's endpoints, walked once for both.
            let eps = endpoints(view.slices);
            self.derived = derive(view, &eps, &self.node);
            if let Some((pools, tx)) = &self.bgp {
                let stores = super::bgp_services::Stores {
                    services: view.services,
                    pools: view.pools,
                    endpoints: &eps,
                    labels: view.labels,
                    may: &view.may,
                };
                let d = super::bgp_services::decision(&stores, &self.node, pools);
                tx.send_if_modified(|cur| {
                    let changed = cur.as_deref() != Some(&d);
                    if changed {
                        *cur = Some(Arc::new(d));
                    }
                    changed
                });
            }
        }
        let Derived {
            plans,
            seated,
            unserved,
        } = &self.derived;
        // A keeper that ended (or panicked) is forgotten; one is started
        // again below if this node stands for its seat.
        self.seats.retain(|_, seat| !seat.gone());
        for (key, p) in plans {
            let want = Want {
                here: p.here.is_ok(),
                addrs: p.addrs.clone(),
            };
            if let Some(seat) = self.seats.get(key) {
                seat.ask(want);
            } else if want.here {
                let Ok(elector) = elector(&self.config, &self.node) else {
                    continue;
                };
                let door = LeaseDoor::new(self.client.clone(), &self.config, &p.lease);
                let links = Links {
                    answers: self.tx.subscribe(),
                    applied: applied.clone(),
                    changed: changed.clone(),
                    stop: stop.clone(),
                };
                self.seats.insert(
                    key.clone(),
                    Seat::start(door, elector, self.config.retry_period, want, links),
                );
            }
        }
        // A seat gone from the plans: this node no longer stands for it.
        for (key, seat) in &self.seats {
            if !plans.contains_key(key) {
                seat.ask(Want {
                    here: false,
                    addrs: seat.wanted().addrs,
                });
            }
        }
        publish(&self.tx, &self.seats, seated, unserved);
    }

    /// Stopping: nothing is answered from now on; every keeper releases
    /// its Lease once its deadline has passed (they see the same stop).
    async fn release_all(&mut self) {
        self.tx.send_if_modified(|cur| {
            let changed = !cur.held.is_empty() || !cur.unserved.is_empty();
            cur.held.clear();
            cur.unserved.clear();
            if changed {
                cur.version += 1;
            }
            changed
        });
        let seats = std::mem::take(&mut self.seats);
        futures::future::join_all(seats.into_values().map(Seat::join)).await;
    }
}

/// Publishes what this node answers now (only when it changed).
fn publish(
    tx: &tokio::sync::watch::Sender<LocalAnswers>,
    seats: &BTreeMap<String, Seat>,
    seated: &BTreeSet<IpAddr>,
    unserved: &BTreeSet<String>,
) {
    let now = now_ms();
    let mut held = BTreeMap::new();
    for seat in seats.values() {
        // Only a seat this node still stands for: stepping aside shows at
        // once, before its keeper has heard of it.
        let want = seat.wanted();
        if !want.here {
            continue;
        }
        if let Some(until) = seat.held().until_ms.filter(|u| now < *u) {
            for a in &want.addrs {
                held.insert(*a, until.saturating_mul(1_000_000));
            }
        }
    }
    tx.send_if_modified(|cur| {
        if cur.listed && cur.seated == *seated && cur.held == held && cur.unserved == *unserved {
            return false;
        }
        *cur = LocalAnswers {
            listed: true,
            seated: seated.clone(),
            held,
            unserved: unserved.clone(),
            version: cur.version + 1,
        };
        true
    });
}

/// What the stores say of every election, recomputed only when they (or
/// this node's labels or candidacy) change.
#[derive(Default)]
struct Derived {
    /// Each election's placement, by key.
    plans: BTreeMap<String, Placement>,
    /// Every address a seat answers (the writer's part leaves them out).
    seated: BTreeSet<IpAddr>,
    /// `Local` Services with no serving endpoint anywhere.
    unserved: BTreeSet<String>,
}

/// [`Derived`] from `view` and each Service's endpoints `eps`, for node
/// `node`.
fn derive(view: &View<'_>, eps: &BTreeMap<String, Vec<Endpoint>>, node: &str) -> Derived {
    let pools = selector_pools(view.pools);
    let mut d = Derived::default();
    for s in view.services.state() {
        if s.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let svc = service(&s);
        let key = format!("{}/{}", svc.namespace, svc.name);
        let these = eps.get(&key).map_or(&[][..], Vec::as_slice);
        if local_addresses(&svc).is_some() && candidates(these).is_empty() {
            d.unserved.insert(key);
        }
        for p in placements(&svc, these, &pools, node, view.labels, view.may.is_ok()) {
            d.seated.extend(p.addrs.iter().copied());
            match d.plans.entry(p.key.clone()) {
                std::collections::btree_map::Entry::Vacant(v) => {
                    v.insert(p);
                }
                std::collections::btree_map::Entry::Occupied(mut o) => {
                    o.get_mut().addrs.extend(p.addrs);
                }
            }
        }
    }
    d
}
