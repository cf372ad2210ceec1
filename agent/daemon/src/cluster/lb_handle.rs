//! The LB agent's handle (`cluster::lb_agent`): what the API, the CLI and
//! metrics read of cluster mode's LoadBalancer state, and the door
//! `lockstep lb` and the Kubernetes door use to change it (apply, store,
//! remove, delete), checked as the single-node LB IPAM checks.
//!
//! Apart from the agent's loop because it is the other side of it: the
//! loop writes what it announces and holds into the handle; readers and
//! writers of the LB state come through here without touching the loop.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use lockstep_core::lb::cluster::{assigned, reconcile, unannounced};
use lockstep_core::lb::{LbIpam, LbPoolSpec, ServiceSpec};
use serde::Serialize;
use tokio::sync::watch;

use super::backoff::Backoff;
use super::lb_timing::{TICK, changed};
use super::{ClusterStoreError, Door, DoorOptions, LbView};
use crate::announce::monotonic_ns;
/// What the API, the CLI and metrics read of the LB agent, and the door
/// `lockstep lb` uses in cluster mode.
#[derive(Debug)]
pub struct LbHandle {
    pub(super) opts: DoorOptions,
    pub(super) door: tokio::sync::Mutex<Option<Door>>,
    pub(super) shared: Mutex<Shared>,
    /// The revision of the last state this node's assigner stored.
    pub(super) stored: watch::Sender<i64>,
}

/// What the loop writes and readers read.
#[derive(Debug, Default)]
pub(super) struct Shared {
    /// Addresses this node announces.
    pub(super) announcing: BTreeSet<IpAddr>,
    /// The datapath's cap (kernel monotonic ns).
    pub(super) valid_until_ns: u64,
    /// Addresses taken since start.
    pub(super) takes: u64,
    /// Addresses withdrawn since start.
    pub(super) withdrawals: u64,
    /// Whether this node is the assigner.
    pub(super) assigner: bool,
    /// Why etcd did not answer, while it does not.
    pub(super) problem: Option<String>,
    /// Addresses no live node is admitted to announce (their pool's node
    /// selector matches none): address → pool.
    pub(super) unannounced: BTreeMap<IpAddr, String>,
    /// The uplink cannot answer (down, without carrier, gone): the LB
    /// lease is not refreshed, so this node's addresses move to others.
    pub(super) uplink_down: bool,
    /// Addresses this node gave up because they were not answered here
    /// within a rank step (the announcement map refused them, or writes
    /// keep failing): it publishes that it does not answer for a while.
    pub(super) cannot_answer: BTreeSet<IpAddr>,
    /// LB lease refreshes sent and answered since start.
    pub(super) lease_renewals: u64,
    /// The latest an LB lease refresh went out against its schedule.
    pub(super) lease_late_max: Duration,
}

/// An address's announcement as `lockstep lb get` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Announcement {
    /// The announcing node.
    pub node: String,
    /// Seconds left on its lease as etcd counts them (`None`: unknown).
    pub lease_left_s: Option<i64>,
}

/// The cluster part of `lockstep lb get`.
#[derive(Clone, Debug, Serialize)]
pub struct ClusterLbView {
    /// The elected assigner.
    pub assigner: Option<String>,
    /// Nodes that are candidate announcers.
    pub members: Vec<String>,
    /// Services stored but not yet in the assigner's state.
    pub pending: Vec<String>,
    /// Announced addresses.
    pub announcements: BTreeMap<IpAddr, Announcement>,
    /// Addresses to announce that no live node may announce (their pool's
    /// `node_selector` matches no member's labels): address → pool.
    /// Nobody answers for them.
    pub unannounced: BTreeMap<IpAddr, String>,
    /// Members' labels (`[cluster] node_labels`), those that have any.
    pub member_labels: BTreeMap<String, BTreeMap<String, String>>,
    /// Members that cannot answer for an address (no uplink configured):
    /// candidate assigners, never announcers.
    pub silent: Vec<String>,
}

fn invalid(reason: impl Into<String>) -> ClusterStoreError {
    ClusterStoreError::Invalid(reason.into())
}

impl LbHandle {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A door for one request, on the connection made on first use (the
    /// lock is held only while connecting): requests from the API and the
    /// Kubernetes loop run side by side, and one waiting out `lb apply`'s
    /// answer holds up no other.
    async fn door(&self) -> Result<Door, ClusterStoreError> {
        let mut guard = self.door.lock().await;
        if guard.is_none() {
            *guard = Some(Door::connect(self.opts.clone()).await?);
        }
        Ok(guard.as_ref().expect("connected above").sibling())
    }

    /// The addresses this node announces.
    pub fn announcing(&self) -> BTreeSet<IpAddr> {
        self.lock().announcing.clone()
    }

    /// Whether this node's LB lease is live now: refreshed in etcd
    /// within its term, so no other node can have taken over what this
    /// node serves (false before the first refresh, past the lease's cap,
    /// and while the uplink is down).
    pub fn lease_live(&self) -> bool {
        self.lock().valid_until_ns > monotonic_ns()
    }

    /// How the LB loops reach etcd.
    pub(super) fn options(&self) -> &DoorOptions {
        &self.opts
    }

    /// Whether this node is the assigner, as its last round found.
    pub(super) fn is_assigner(&self) -> bool {
        self.lock().assigner
    }

    /// Notes whether this node is the assigner.
    pub(super) fn set_assigner(&self, assigner: bool) {
        self.lock().assigner = assigner;
    }

    /// Notes a state this node's assigner stored, at `revision`
    /// ([`LbHandle::stored`] tells its readers).
    pub(super) fn note_stored(&self, revision: i64) {
        self.stored.send_replace(revision);
    }

    /// `lockstep lb get` in cluster mode: pools and services as the stored
    /// state has them, and who announces what.
    ///
    /// # Errors
    /// etcd unavailable, or the stored state unreadable.
    pub async fn view(&self) -> Result<serde_json::Value, ClusterStoreError> {
        let mut d = self.door().await?;
        let view = d.lb_read().await?;
        let mut leases: BTreeMap<i64, Option<i64>> = BTreeMap::new();
        for (_, lease) in view.announcements.values() {
            if !leases.contains_key(lease) {
                leases.insert(*lease, d.lb_lease_left(*lease).await?);
            }
        }
        render_view(&view, &leases)
    }

    /// The assigner, and pools and services as its stored state has them
    /// (the Kubernetes door reads this every pass): [`LbHandle::view`]
    /// without the announcements, so without a request to etcd while the
    /// mirror is live (`view` asks etcd for each announcer's lease). Has
    /// every state this node's assigner stored ([`LbHandle::stored`]).
    ///
    /// # Errors
    /// etcd unavailable, or the stored state unreadable.
    pub async fn assignments(&self) -> Result<Assignments, ClusterStoreError> {
        let mut d = self.door().await?;
        d.follow(*self.stored.borrow());
        let view = d.lb_read().await?;
        assignments_of(&view)
    }

    /// Changes with every state this node's assigner stores (to the
    /// revision it was stored at): whoever reads [`LbHandle::assignments`]
    /// learns of new assignments at once rather than at its next poll.
    pub fn stored(&self) -> watch::Receiver<i64> {
        self.stored.subscribe()
    }

    /// Checks pools and services before they are stored: alone, against
    /// the cluster's endpoint pools, and with everything stored, through
    /// the core's [`reconcile`]. Returns the revision the cluster pools
    /// were read at ([`Door::lb_put`] holds only if none changed since).
    async fn check(
        d: &mut Door,
        pools: &[LbPoolSpec],
        services: &[ServiceSpec],
    ) -> Result<i64, ClusterStoreError> {
        for p in pools {
            p.validate().map_err(|e| invalid(e.to_string()))?;
        }
        for s in services {
            s.validate().map_err(|e| invalid(e.to_string()))?;
        }
        let (cluster_pools, _, cluster_pools_at) = d.pools().await?;
        for p in pools {
            lockstep_core::lb::check_against_cluster_pools(p, &cluster_pools)
                .map_err(|e| invalid(e.to_string()))?;
        }
        let view = d.lb_read().await?;
        let mut all_pools = view.pools.clone();
        for p in pools {
            all_pools.insert(p.name.clone(), p.clone());
        }
        let mut all_services = view.services.clone();
        for s in services {
            all_services.insert(s.id(), s.clone());
        }
        // What the assigner would refuse is refused here, before
        // anything is stored.
        reconcile(
            view.state.as_ref().map(|(s, _)| s),
            all_pools.into_values().collect(),
            all_services.into_values().collect(),
        )
        .map_err(|e| invalid(e.to_string()))?;
        Ok(cluster_pools_at)
    }

    /// `lockstep lb apply` in cluster mode: checks the pools and services
    /// (alone, against the cluster's endpoint pools, and with everything
    /// stored, through the core's [`reconcile`]), stores them in one
    /// transaction that holds only if no cluster pool changed since it was
    /// read, and waits (at most `within`) for the assigner to take them
    /// into its state.
    ///
    /// # Errors
    /// A bad pool or service, or a pool overlapping a cluster pool (named;
    /// nothing stored), a cluster pool changed meanwhile (nothing stored;
    /// retry), or etcd unavailable.
    pub async fn apply(
        &self,
        pools: Vec<LbPoolSpec>,
        services: Vec<ServiceSpec>,
        within: Duration,
    ) -> Result<serde_json::Value, ClusterStoreError> {
        let ids: BTreeSet<String> = services.iter().map(ServiceSpec::id).collect();
        let mut d = self.door().await?;
        let cluster_pools_at = Self::check(&mut d, &pools, &services).await?;
        // Watched from before the write, so the assigner's state is read
        // as soon as it is stored (every 100 ms too, without a watch).
        let mut wake = tokio::time::timeout(TICK, d.lb_watch())
            .await
            .ok()
            .and_then(Result::ok);
        d.lb_put(&pools, &services, cluster_pools_at).await?;
        let deadline = Instant::now() + within;
        loop {
            let view = d.lb_read().await?;
            let in_state: BTreeSet<String> = view
                .state
                .as_ref()
                .map(|(s, _)| s.services.iter().map(|r| r.spec.id()).collect())
                .unwrap_or_default();
            if ids.is_subset(&in_state) || Instant::now() >= deadline {
                return render_view(&view, &BTreeMap::new());
            }
            if let Ok(false) =
                tokio::time::timeout(Duration::from_millis(100), changed(&mut wake)).await
            {
                wake = None;
            }
        }
    }

    /// [`LbHandle::apply`] without the wait and without the answer: checks
    /// and stores, the assigner assigns later ([`LbHandle::stored`] tells
    /// when). What the Kubernetes door calls.
    ///
    /// # Errors
    /// As [`LbHandle::apply`].
    pub async fn store(
        &self,
        pools: Vec<LbPoolSpec>,
        services: Vec<ServiceSpec>,
    ) -> Result<(), ClusterStoreError> {
        let mut d = self.door().await?;
        let cluster_pools_at = Self::check(&mut d, &pools, &services).await?;
        d.lb_put(&pools, &services, cluster_pools_at).await
    }

    /// [`LbHandle::delete`] without the wait and without the answer: all
    /// named or none.
    ///
    /// # Errors
    /// An unknown name (nothing deleted), or etcd unavailable.
    pub async fn remove(
        &self,
        services: Vec<String>,
        pools: Vec<String>,
    ) -> Result<(), ClusterStoreError> {
        self.door().await?.lb_delete(&services, &pools).await
    }

    /// `lockstep lb delete` in cluster mode: all named or none. Waits (at
    /// most `within`) until the assigner dropped the services and no node
    /// holds the announcement of an address they alone held: a node
    /// stops answering before it deletes its key, so when this returns
    /// nobody answers for those addresses.
    ///
    /// # Errors
    /// An unknown name (nothing deleted), or etcd unavailable.
    pub async fn delete(
        &self,
        services: Vec<String>,
        pools: Vec<String>,
        within: Duration,
    ) -> Result<serde_json::Value, ClusterStoreError> {
        let mut d = self.door().await?;
        let before = d.lb_read().await?;
        let gone: BTreeSet<&String> = services.iter().collect();
        let freed: BTreeSet<IpAddr> = match &before.state {
            Some((s, _)) => assigned(&restore(s)?)
                .into_iter()
                .filter(|(_, users)| users.iter().all(|u| gone.contains(u)))
                .map(|(a, _)| a)
                .collect(),
            None => BTreeSet::new(),
        };
        d.lb_delete(&services, &pools).await?;
        let deadline = Instant::now() + within;
        // Looked at again after 50 ms, then ever less often (jittered, up
        // to 800 ms): a read that goes to etcd (the mirror not live) is
        // not repeated at a fixed pace (#47 item 3).
        let mut pace = Backoff::new(Duration::from_millis(50), Duration::from_millis(800));
        loop {
            let view = d.lb_read().await?;
            let in_state = view
                .state
                .as_ref()
                .is_some_and(|(s, _)| s.services.iter().any(|r| gone.contains(&r.spec.id())));
            let announced = freed.iter().any(|a| view.announcements.contains_key(a));
            if !(in_state || announced) || Instant::now() >= deadline {
                return render_view(&view, &BTreeMap::new());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            tokio::time::sleep(pace.next_delay().min(left)).await;
        }
    }
}

fn restore(state: &lockstep_core::lb::LbSnapshot) -> Result<LbIpam, ClusterStoreError> {
    LbIpam::restore(state).map_err(|e| ClusterStoreError::Corrupt {
        key: "lb/state".into(),
        reason: e.to_string(),
    })
}

/// What the stored state says: [`LbHandle::assignments`].
#[derive(Clone, Debug, PartialEq)]
pub struct Assignments {
    /// The elected assigner.
    pub assigner: Option<String>,
    /// Pools and services as the stored state has them (the single-node
    /// shape).
    pub lb: crate::lb_view::LbView,
    /// Services stored but not yet in the state.
    pub pending: Vec<String>,
}

fn assignments_of(view: &LbView) -> Result<Assignments, ClusterStoreError> {
    let lb = match &view.state {
        Some((s, _)) => restore(s)?,
        None => LbIpam::new(),
    };
    let local = crate::lb_view::LbView::of(&lb);
    Ok(Assignments {
        assigner: view.assigner.as_ref().map(|a| a.0.clone()),
        pending: view
            .services
            .keys()
            .filter(|id| !local.services.contains_key(*id))
            .cloned()
            .collect(),
        lb: local,
    })
}

/// The `lockstep lb get` answer of cluster mode: the single-node shape
/// (`pools`, `services`) from the stored state, plus `cluster`.
fn render_view(
    view: &LbView,
    leases: &BTreeMap<i64, Option<i64>>,
) -> Result<serde_json::Value, ClusterStoreError> {
    let Assignments {
        assigner,
        lb: local,
        pending,
    } = assignments_of(view)?;
    let unannounced = unannounced(&view.to_announce()?, view.candidates());
    let cluster = ClusterLbView {
        unannounced,
        member_labels: view.members.labels(),
        silent: view
            .candidates()
            .filter(|c| !c.answers)
            .map(|c| c.name.clone())
            .collect(),
        assigner,
        members: view.members.nodes().map(str::to_string).collect(),
        pending,
        announcements: view
            .announcements
            .iter()
            .map(|(a, (node, lease))| {
                (
                    *a,
                    Announcement {
                        node: node.clone(),
                        lease_left_s: leases.get(lease).copied().flatten(),
                    },
                )
            })
            .collect(),
    };
    let mut v = serde_json::to_value(&local).map_err(|e| invalid(e.to_string()))?;
    v["cluster"] = serde_json::to_value(&cluster).map_err(|e| invalid(e.to_string()))?;
    Ok(v)
}

/// The LB agent's figures for the metrics (`crate::metrics` makes the
/// families).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LbFigures {
    /// Addresses this node announces (holds the etcd key of).
    pub announcing: Vec<IpAddr>,
    /// Seconds its announcements are answered without another lease
    /// refresh.
    pub lease_remaining_seconds: f64,
    /// Announcements this node took since start.
    pub handovers: u64,
    /// Announcements this node gave up since start.
    pub withdrawals: u64,
    /// Whether this node is the elected assigner.
    pub assigner: bool,
    /// Whether the uplink is down or without carrier.
    pub uplink_down: bool,
    /// Addresses to announce that no live node's labels admit, with their
    /// pool.
    pub unannounced: Vec<(IpAddr, String)>,
    /// Addresses this node gave up because it could not answer them.
    pub cannot_answer: Vec<IpAddr>,
    /// LB lease refreshes sent and answered since start.
    pub lease_renewals: u64,
    /// The latest an LB lease refresh went out against its schedule.
    pub lease_late_max: Duration,
}

impl LbHandle {
    /// What the metrics report of the LB agent now.
    pub fn figures(&self) -> LbFigures {
        let s = self.lock();
        LbFigures {
            announcing: s.announcing.iter().copied().collect(),
            lease_remaining_seconds: s.valid_until_ns.saturating_sub(monotonic_ns()) as f64 / 1e9,
            handovers: s.takes,
            withdrawals: s.withdrawals,
            assigner: s.assigner,
            uplink_down: s.uplink_down,
            unannounced: s.unannounced.iter().map(|(a, p)| (*a, p.clone())).collect(),
            cannot_answer: s.cannot_answer.iter().copied().collect(),
            lease_renewals: s.lease_renewals,
            lease_late_max: s.lease_late_max,
        }
    }
}
