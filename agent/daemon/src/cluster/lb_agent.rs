//! The LoadBalancer agent of cluster mode (#13): every node runs one. It
//! holds an LB lease in etcd and, under it, a membership key (the node is a
//! candidate announcer), the assigner key while elected, and one
//! `lb/announce/<ip>` key per address it announces.
//!
//! What it announces, and the order of every step that changes it, is the
//! core's announcer (`lockstep_core::lb::announce`, #27): sticky
//! announcements, take → program → announce, unprogram → (confirmed) →
//! withdraw, rebalancing one address at a time. This module feeds it and
//! carries out its actions (`lb_announce`). Each tick (200 ms) it:
//! 1. checks the uplink (without waiting for the agent lock): one that
//!    cannot answer makes the announcer empty the datapath and revoke the
//!    lease, so the addresses move within a tick;
//! 2. keeps the lease (a refresh every third of its TTL); the time up to
//!    which etcd is sure to keep it is the datapath's cap: no L2_RESP entry
//!    of this node is answered past it ([`Announcements::set_cluster`]);
//! 3. hands the announcer what `lb/` holds, read from the agent's mirror
//!    of etcd (#27 item 6: no request; not handed again while nothing
//!    under `lb/` changed and the last read has this node's own writes);
//! 4. carries out the announcer's actions until it has none, or a quarter
//!    of the TTL has passed (what is left is reported lost: asked again
//!    next tick), so a slow etcd never holds the next refresh back. The
//!    announcer runs every tick, changed or not: its clocks move (rank
//!    steps, pace, the lease's cap);
//! 5. publishes the lease it holds to the node's assigner
//!    (`lb_assigner`), which runs its rounds ([`Door::lb_round`],
//!    campaigning with the same lease) on a loop of its own, so a tick of
//!    takes never holds an assignment back.
//!
//! A tick also comes at once when anything under `lb/` changes (the
//! mirror's bell, or a watch of its own without a mirror; it only wakes
//! the loop): an address assigned or withdrawn is taken without waiting
//! out the 200 ms.
//!
//! Why never two nodes answer: an entry's expiry is at most `t + TTL -
//! margin`, `t` the moment the last lease refresh (or grant) was *sent*;
//! etcd renews the lease when it receives the refresh, later than `t`, so
//! it keeps the lease (and the keys) at least until `t + TTL`. A new holder
//! can create the key only after etcd deleted it, so after the old entry
//! expired (docs/cluster.md, "Announcement handover").

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lockstep_core::lb::announce::{Announcer, AnnouncerConfig};
use lockstep_core::lb::cluster::{assigned, reconcile, unannounced};
use lockstep_core::lb::{LbIpam, LbPoolSpec, ServiceSpec};
use serde::Serialize;
use tokio::sync::watch;

use super::lb::LbWake;
use super::lb_announce::{self, Counts};
use super::lb_assigner::Assigner;
use super::{ClusterStoreError, Door, DoorOptions, LbView, Link, Stamp};
use crate::agent::announce::monotonic_ns;
use crate::agent::{Agent, Announcements, UplinkHealth};

/// The bound on each etcd request: well under a third of the shortest
/// lease, so a refresh that cannot be answered is known in time.
const REQUEST_TIMEOUT: Duration = Duration::from_millis(500);
/// How often the agent looks at its lease, the plan and etcd.
pub const TICK: Duration = Duration::from_millis(200);
/// How often an assigner round runs when nothing was stored last time
/// and no service is pending.
pub const ROUND_EVERY: Duration = Duration::from_millis(500);
/// How often a round runs when nothing under `lb/` changed in the
/// mirror (it reads nothing from etcd then).
pub const IDLE_ROUND: Duration = Duration::from_secs(5);
/// The shortest LB lease etcd grants with its default timing (it raises
/// shorter ones to this).
pub const MIN_LEASE: Duration = Duration::from_secs(2);

/// What the API, the CLI and metrics read of the LB agent, and the door
/// `lockstep lb` uses in cluster mode.
#[derive(Debug)]
pub struct LbHandle {
    opts: DoorOptions,
    door: tokio::sync::Mutex<Option<Door>>,
    shared: Mutex<Shared>,
    /// The revision of the last state this node's assigner stored.
    stored: watch::Sender<i64>,
}

#[derive(Debug, Default)]
struct Shared {
    /// Addresses this node announces.
    announcing: BTreeSet<IpAddr>,
    /// The datapath's cap (kernel monotonic ns).
    valid_until_ns: u64,
    /// Addresses taken since start.
    takes: u64,
    /// Addresses withdrawn since start.
    withdrawals: u64,
    /// Whether this node is the assigner.
    assigner: bool,
    /// Why etcd did not answer, while it does not.
    problem: Option<String>,
    /// Addresses no live node is admitted to announce (their pool's node
    /// selector matches none): address → pool.
    unannounced: BTreeMap<IpAddr, String>,
    /// The uplink cannot answer (down, without carrier, gone): the LB
    /// lease is not refreshed, so this node's addresses move to others.
    uplink_down: bool,
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
    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The API's door, connected on first use (requests from the API
    /// take turns on it).
    async fn door(&self) -> Result<tokio::sync::MappedMutexGuard<'_, Door>, ClusterStoreError> {
        let mut guard = self.door.lock().await;
        if guard.is_none() {
            *guard = Some(Door::connect(self.opts.clone()).await?);
        }
        Ok(tokio::sync::MutexGuard::map(guard, |d| {
            d.as_mut().expect("connected above")
        }))
    }

    /// The addresses this node announces.
    pub fn announcing(&self) -> BTreeSet<IpAddr> {
        self.lock().announcing.clone()
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
            tokio::time::sleep(Duration::from_millis(50)).await;
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
    pub lb: crate::agent::lb::LbView,
    /// Services stored but not yet in the state.
    pub pending: Vec<String>,
}

fn assignments_of(view: &LbView) -> Result<Assignments, ClusterStoreError> {
    let lb = match &view.state {
        Some((s, _)) => restore(s)?,
        None => LbIpam::new(),
    };
    let local = crate::agent::lb::LbView {
        pools: lb.pools().collect(),
        services: lb
            .services()
            .map(|(id, st)| (id.to_string(), st.clone()))
            .collect(),
    };
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
    let unannounced = unannounced(&view.to_announce()?, &view.candidates());
    let cluster = ClusterLbView {
        unannounced,
        member_labels: view
            .member_labels
            .iter()
            .filter(|(_, l)| !l.is_empty())
            .map(|(n, l)| (n.clone(), l.clone()))
            .collect(),
        silent: view.silent.iter().cloned().collect(),
        assigner,
        members: view.members.keys().cloned().collect(),
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

/// The LB agent's metrics, in the Prometheus text format.
pub fn render_metrics(h: &LbHandle) -> String {
    let s = h.lock();
    let left = s.valid_until_ns.saturating_sub(monotonic_ns()) as f64 / 1e9;
    let mut out = String::from(
        "# HELP lockstep_lb_announcing Addresses this node announces (holds the etcd key of).\n\
         # TYPE lockstep_lb_announcing gauge\n",
    );
    for a in &s.announcing {
        out.push_str(&format!("lockstep_lb_announcing{{address=\"{a}\"}} 1\n"));
    }
    out.push_str(&format!(
        "# HELP lockstep_lb_announce_lease_remaining_seconds How long this node's announcements are answered without another etcd lease refresh.\n\
         # TYPE lockstep_lb_announce_lease_remaining_seconds gauge\n\
         lockstep_lb_announce_lease_remaining_seconds {left:.3}\n\
         # HELP lockstep_lb_handovers_total Announcements this node took (key created, then programmed).\n\
         # TYPE lockstep_lb_handovers_total counter\n\
         lockstep_lb_handovers_total {}\n\
         # HELP lockstep_lb_withdrawals_total Announcements this node gave up (unprogrammed, then key deleted).\n\
         # TYPE lockstep_lb_withdrawals_total counter\n\
         lockstep_lb_withdrawals_total {}\n\
         # HELP lockstep_lb_assigner Whether this node is the elected LB assigner.\n\
         # TYPE lockstep_lb_assigner gauge\n\
         lockstep_lb_assigner {}\n\
         # HELP lockstep_lb_uplink_down Whether the uplink is down or without carrier: this node stopped refreshing its LB lease, so its announcements move to other nodes.\n\
         # TYPE lockstep_lb_uplink_down gauge\n\
         lockstep_lb_uplink_down {}\n\
         # HELP lockstep_lb_unannounced Addresses to announce that no live node's labels admit (their pool's node_selector matches none): nobody answers for them.\n\
         # TYPE lockstep_lb_unannounced gauge\n",
        s.takes,
        s.withdrawals,
        u8::from(s.assigner),
        u8::from(s.uplink_down)
    ));
    for (a, pool) in &s.unannounced {
        out.push_str(&format!(
            "lockstep_lb_unannounced{{address=\"{a}\",pool=\"{pool}\"}} 1\n"
        ));
    }
    out
}

/// The lease the agent holds.
#[derive(Clone, Copy, Debug)]
struct Held {
    id: i64,
    ttl: Duration,
    /// When the last refresh (or the grant) was sent.
    sent: Instant,
}

/// The margin kept between the datapath's cap and the etcd lease: a tenth
/// of the TTL, at least 100 ms (clock rates, the lessor's own timing).
fn margin(ttl: Duration) -> Duration {
    (ttl / 10).max(Duration::from_millis(100))
}

/// The running LB agent of one node.
pub struct LbAgent {
    name: String,
    /// Published with the membership, for pools' node selectors.
    labels: BTreeMap<String, String>,
    /// Published with the membership: whether this node can answer for
    /// an address at all (it has an uplink). A node without one runs for
    /// assigner but never announces.
    answers: bool,
    ttl: Duration,
    door: Option<Door>,
    lease: Option<Held>,
    /// What this node announces, and the order of every step that changes
    /// it (the core's state machine).
    machine: Announcer,
    /// The uplink's health as last seen (kept while the agent lock is
    /// busy: the check never waits for it).
    health: UplinkHealth,
    /// Wakes the loop when anything under `lb/` changes.
    wake: Wake,
    /// The lease the announcer holds, for the assigner.
    lease_held: watch::Sender<Option<i64>>,
    /// The last read of `lb/` handed to the announcer (#27 item 6: while
    /// the mirror's `lb/` stays where it was, the announcer keeps that
    /// read rather than being handed the same one again every tick).
    seen: Option<Seen>,
    handle: Arc<LbHandle>,
}

/// A read of `lb/` handed to the announcer.
#[derive(Clone, Copy, Debug)]
struct Seen {
    /// Where the mirror's `lb/` stood before the read.
    stamp: Stamp,
    /// The read's store revision.
    revision: i64,
    /// When it was read.
    at: Instant,
}

/// The next message of the wake-up watch: whether one came (`false`: the
/// stream broke or ended). Never ready without a watch.
async fn changed(wake: &mut Option<LbWake>) -> bool {
    match wake {
        Some(w) => w.changed().await,
        None => std::future::pending().await,
    }
}

/// An LB loop's wake-up when anything under `lb/` changes: opened once
/// connected, and again after it broke.
#[derive(Default)]
pub(super) struct Wake {
    wake: Option<LbWake>,
    /// When opening it was last tried (at most once a second, so an etcd
    /// that does not answer slows no loop).
    tried: Option<Instant>,
}

impl Wake {
    /// Opens the wake-up through `door` if there is none (bounded by a
    /// tick: a slow etcd never delays the loop for a wake-up).
    pub(super) async fn open(&mut self, door: Option<&mut Door>) {
        if self.wake.is_some()
            || self
                .tried
                .is_some_and(|t| t.elapsed() < Duration::from_secs(1))
        {
            return;
        }
        let Some(door) = door else { return };
        self.tried = Some(Instant::now());
        self.wake = tokio::time::timeout(TICK, door.lb_watch())
            .await
            .ok()
            .and_then(Result::ok);
    }

    /// Returns when something under `lb/` changed, or the wake-up broke
    /// (opened again by [`Wake::open`]); never without one.
    pub(super) async fn changed(&mut self) {
        if !changed(&mut self.wake).await {
            self.wake = None;
        }
    }
}

/// Where `lb/` stands in the mirror of `opts`'s link while it is live
/// (`None`: no mirror, or one not live: then everything is read).
pub(super) fn mirror_stamp(opts: &DoorOptions) -> Option<Stamp> {
    opts.link
        .as_ref()
        .map(|l| l.mirror().stamp(&["lb/"]))
        .filter(|s| s.live)
}

impl std::fmt::Debug for LbAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LbAgent")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl LbAgent {
    /// An LB agent for node `name`, its lease `ttl` (raised to
    /// [`MIN_LEASE`], whole seconds), reaching etcd with `opts`.
    pub fn new(name: String, ttl: Duration, opts: DoorOptions) -> Self {
        let secs = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
        let ttl = Duration::from_secs(secs).max(MIN_LEASE);
        LbAgent {
            machine: Announcer::new(
                name.clone(),
                AnnouncerConfig::for_lease(ttl.as_nanos() as u64),
            ),
            name,
            labels: BTreeMap::new(),
            answers: true,
            ttl,
            door: None,
            lease: None,
            health: UplinkHealth::Unknown,
            wake: Wake::default(),
            lease_held: watch::Sender::new(None),
            seen: None,
            handle: Arc::new(LbHandle {
                opts,
                door: tokio::sync::Mutex::new(None),
                shared: Mutex::new(Shared::default()),
                stored: watch::Sender::new(0),
            }),
        }
    }

    /// The LB agent of cluster mode (`None` without `[cluster]`): named as
    /// the cluster node, its lease `[lb] announce_lease` (whole seconds, at
    /// least [`MIN_LEASE`]).
    /// Its requests go through `link` (the agent's connection, and reads
    /// from its mirror: #27 item 6) when given.
    pub fn from_config(config: &crate::config::Config, link: Option<Link>) -> Option<Self> {
        let cluster = config.cluster.as_ref()?;
        let name = cluster
            .node_name
            .clone()
            .unwrap_or_else(|| config.node_name());
        let mut opts = DoorOptions::from_cluster_config(cluster, REQUEST_TIMEOUT);
        opts.link = link;
        Some(
            Self::new(name, config.lb.announce_lease, opts)
                .with_labels(cluster.node_labels.clone())
                .with_answers(config.datapath.uplink.is_some()),
        )
    }

    /// Sets whether this node can answer for an address (builder style):
    /// false without an uplink.
    pub fn with_answers(mut self, answers: bool) -> Self {
        self.answers = answers;
        self
    }

    /// Sets the labels published with the membership (builder style).
    pub fn with_labels(mut self, labels: BTreeMap<String, String>) -> Self {
        self.labels = labels;
        self
    }

    /// The handle the API and metrics read.
    pub fn handle(&self) -> Arc<LbHandle> {
        self.handle.clone()
    }

    fn problem(&self, e: Option<&ClusterStoreError>) {
        let mut s = self.handle.lock();
        s.problem = e.map(|e| crate::error_chain(e));
    }

    /// Grants the lease if the announcer wants one and holds none, and
    /// refreshes it every third of its TTL. The cap handed to the
    /// announcer counts from when the request was *sent*.
    async fn keep_lease(&mut self) -> Result<(), ClusterStoreError> {
        // The announcer gave its lease up (revoked while the uplink is
        // silent, or its cap passed with every refresh unanswered).
        if self.machine.lease().is_none() {
            self.lease = None;
        }
        if !self.machine.wants_lease() {
            return Ok(());
        }
        let door = self.door.as_mut().expect("connected by the caller");
        match self.lease {
            None => {
                let sent = Instant::now();
                let sent_ns = monotonic_ns();
                let (id, granted) = door.lb_grant(self.ttl).await?;
                let cap = sent_ns + (granted - margin(granted)).as_nanos() as u64;
                self.machine.lease_granted(id, cap);
                self.lease = Some(Held {
                    id,
                    ttl: granted,
                    sent,
                });
                door.lb_join(&self.name, &self.labels, self.answers, id)
                    .await?;
                tracing::info!(lease = id, ttl = ?granted, "lb lease granted; joined the announcers");
                Ok(())
            }
            Some(held) if held.sent.elapsed() >= held.ttl / 3 => {
                let sent = Instant::now();
                let sent_ns = monotonic_ns();
                if door.keep_alive(held.id).await? {
                    self.lease = Some(Held { sent, ..held });
                    self.machine
                        .lease_refreshed(sent_ns + (held.ttl - margin(held.ttl)).as_nanos() as u64);
                } else {
                    tracing::warn!(
                        lease = held.id,
                        "lb lease expired; its announcements are gone (a new lease next)"
                    );
                    self.lease = None;
                    self.machine.lease_lost();
                }
                Ok(())
            }
            Some(_) => Ok(()),
        }
    }

    /// The uplink's health, without waiting for the agent's lock: while
    /// the lock is busy (a CNI call, a reconcile) the last health stands.
    async fn uplink_health(&mut self, slot: &Arc<Mutex<Option<Agent>>>) -> UplinkHealth {
        // No agent (a benchmark's simulated node): nothing to ask, and no
        // blocking task per tick.
        if super::node::no_agent(slot) {
            return self.health.clone();
        }
        let slot = slot.clone();
        let now = tokio::task::spawn_blocking(move || match slot.try_lock() {
            Ok(mut g) => g.as_mut().map(Agent::uplink_health),
            Err(std::sync::TryLockError::Poisoned(p)) => {
                p.into_inner().as_mut().map(Agent::uplink_health)
            }
            Err(std::sync::TryLockError::WouldBlock) => None,
        })
        .await
        .ok()
        .flatten();
        if let Some(h) = now {
            self.health = h;
        }
        self.health.clone()
    }

    /// Shows the announcer's state to the API and metrics.
    fn show(&self, counts: Counts) {
        let mut s = self.handle.lock();
        s.announcing = self.machine.held();
        s.valid_until_ns = self.machine.valid_until().unwrap_or(0);
        s.takes += counts.took;
        s.withdrawals += counts.withdrew;
    }

    /// One tick.
    async fn tick(&mut self, slot: &Arc<Mutex<Option<Agent>>>, announcements: &Maps) {
        if self.door.is_none() {
            match Door::connect(self.handle.opts.clone()).await {
                Ok(d) => self.door = Some(d),
                Err(e) => {
                    self.problem(Some(&e));
                    return;
                }
            }
        }
        // An uplink that is down, without carrier or gone answers nobody:
        // the announcer empties the datapath and revokes its lease, so the
        // addresses move at once, and holds nothing until it answers
        // again. One created again gets the programs attached anew first
        // (`Agent::uplink_health`).
        let health = self.uplink_health(slot).await;
        let silent = matches!(health, UplinkHealth::Silent(_));
        let was_down = std::mem::replace(&mut self.handle.lock().uplink_down, silent);
        if let UplinkHealth::Silent(why) = &health
            && !was_down
        {
            tracing::warn!(
                reason = %why,
                "the uplink cannot answer: LB announcements given up; they move to other nodes"
            );
        }
        if was_down && !silent {
            tracing::info!("the uplink answers again: LB lease taken again");
        }
        self.machine.set_silent(silent);
        let lease_problem = self.keep_lease().await.err();
        // Bounded, so a slow etcd never delays the next lease refresh past
        // its slack: an action not carried out in time is reported lost
        // to the announcer, which asks again (or writes again) next tick.
        let deadline = Instant::now() + self.ttl / 4;
        let mut problem = lease_problem;
        self.publish_lease();
        let stamp = mirror_stamp(&self.handle.opts);
        if let Some(lease) = self.machine.lease()
            && let Err(e) = self.read(lease, stamp).await
        {
            problem.get_or_insert(e);
        }
        let mut counts = Counts::default();
        if let Some(door) = self.door.as_mut() {
            let e = lb_announce::run(
                &mut self.machine,
                door,
                announcements,
                &self.name,
                deadline,
                &mut counts,
            )
            .await;
            if let Some(e) = e {
                problem.get_or_insert(e);
            }
        }
        self.publish_lease();
        self.show(counts);
        self.problem(problem.as_ref());
    }

    /// Tells the assigner which lease the announcer holds (its rounds
    /// campaign and write under it).
    fn publish_lease(&self) {
        let now = self.machine.lease();
        self.lease_held.send_if_modified(|held| {
            let changed = *held != now;
            *held = now;
            changed
        });
    }

    /// Reads `lb/` (from the mirror while it is live) and hands it to the
    /// announcer (joining again if the read shows this node's membership
    /// missing).
    ///
    /// Skipped while the mirror's `lb/` stands at `stamp` as it did at the
    /// last read, that read has every write of this door (a take, a
    /// withdrawal, a join), and this node's membership shows in it (#27
    /// item 6): the announcer keeps the read it has, which its own
    /// answers since updated; handing it the same one again changes
    /// nothing. It is handed a fresh one every [`IDLE_ROUND`] all the same.
    /// The announcer itself still runs every tick (its clocks move: rank
    /// steps, pace, the lease's cap).
    async fn read(&mut self, lease: i64, stamp: Option<Stamp>) -> Result<(), ClusterStoreError> {
        let door = self.door.as_mut().expect("connected");
        if let (Some(now), Some(seen)) = (stamp, self.seen)
            && now == seen.stamp
            && door.written() <= seen.revision
            && seen.at.elapsed() < IDLE_ROUND
            && !self.machine.membership_missing()
        {
            return Ok(());
        }
        self.seen = None;
        let view = door.lb_read().await?;
        // Each address with its pool's node selector; the members with
        // their labels.
        let to_announce = view.to_announce()?;
        let nodes = view.candidates();
        let nobody = unannounced(&to_announce, &nodes);
        {
            let mut s = self.handle.lock();
            if s.unannounced != nobody {
                for (a, pool) in nobody
                    .iter()
                    .filter(|(a, _)| !s.unannounced.contains_key(*a))
                {
                    tracing::warn!(address = %a, pool = %pool, "lb address announced by nobody: its pool's node_selector admits no live node");
                }
                s.unannounced = nobody;
            }
        }
        self.machine
            .observed(lb_announce::observation(&view)?, monotonic_ns());
        if self.machine.membership_missing() {
            tracing::info!(
                lease,
                "lb membership missing under the current lease: joining again"
            );
            door.lb_join(&self.name, &self.labels, self.answers, lease)
                .await?;
        }
        self.seen = stamp.map(|stamp| Seen {
            stamp,
            revision: view.revision,
            at: Instant::now(),
        });
        Ok(())
    }

    /// Stops: out of the datapath, then the lease revoked (every key of
    /// this node's goes at once, so the next announcer need not wait for
    /// the lease to run out). A datapath write that is not confirmed
    /// leaves the lease to run out instead: nothing is withdrawn on a
    /// write in doubt.
    async fn stop(&mut self, announcements: &Maps) {
        self.machine.stop();
        let deadline = Instant::now() + Duration::from_secs(2);
        let mut counts = Counts::default();
        while !self.machine.stopped() && Instant::now() < deadline {
            match self.door.as_mut() {
                Some(door) => {
                    lb_announce::run(
                        &mut self.machine,
                        door,
                        announcements,
                        &self.name,
                        deadline,
                        &mut counts,
                    )
                    .await;
                }
                None => {
                    // No etcd: the datapath is still emptied.
                    let mut nothing = NoKeys;
                    lb_announce::run(
                        &mut self.machine,
                        &mut nothing,
                        announcements,
                        &self.name,
                        deadline,
                        &mut counts,
                    )
                    .await;
                    break;
                }
            }
            if !self.machine.stopped() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        if !self.machine.stopped() {
            tracing::warn!("lb lease not revoked; it runs out");
        }
        self.show(counts);
    }

    /// Runs ticks until `stop`, writing this node's announcements into
    /// `announcements` (`None`: a node without a datapath, as a
    /// benchmark's simulated nodes are).
    pub fn spawn(
        mut self,
        slot: Arc<Mutex<Option<Agent>>>,
        announcements: Option<Announcements>,
        mut stop: watch::Receiver<bool>,
    ) -> tokio::task::JoinHandle<()> {
        let announcements = Maps(announcements);
        let assigner = Assigner::new(self.name.clone(), self.ttl, self.handle.clone());
        let assigner = tokio::spawn(assigner.run(self.lease_held.subscribe(), stop.clone()));
        tokio::spawn(async move {
            loop {
                self.tick(&slot, &announcements).await;
                self.wake.open(self.door.as_mut()).await;
                tokio::select! {
                    () = tokio::time::sleep(TICK) => {}
                    () = self.wake.changed() => {}
                    _ = stop.wait_for(|s| *s) => break,
                }
            }
            // No round while the lease goes (an interrupted one is fenced
            // like any other: stored whole or not at all).
            assigner.abort();
            let _ = assigner.await;
            self.wake = Wake::default();
            self.stop(&announcements).await;
        })
    }
}

/// Where the announcer's writes go: the agent's announcement maps, or
/// none on a node without a datapath (nothing there can answer for an
/// address, so a write holds trivially; as before the announcer, when an
/// agent slot without an agent made the write a no-op).
struct Maps(Option<Announcements>);

impl lb_announce::AnnounceDatapath for Maps {
    async fn program(
        &self,
        seq: u64,
        addresses: BTreeSet<IpAddr>,
        valid_until: u64,
    ) -> lockstep_core::lb::announce::Written {
        match &self.0 {
            Some(maps) => maps.program(seq, addresses, valid_until).await,
            None => lockstep_core::lb::announce::Written::Done,
        }
    }

    fn announce(&self, address: IpAddr) {
        if let Some(maps) = &self.0 {
            Announcements::announce(maps, address);
        }
    }
}

/// etcd out of reach at a stop: every request is lost.
struct NoKeys;

impl lb_announce::AnnounceKeys for NoKeys {
    async fn take(&self, _: IpAddr, _: &str, _: i64) -> Result<Option<i64>, ClusterStoreError> {
        Err(ClusterStoreError::Invalid("not connected to etcd".into()))
    }

    async fn withdraw(
        &mut self,
        _: IpAddr,
        _: &str,
        _: lockstep_core::lb::announce::KeyRef,
    ) -> Result<(), ClusterStoreError> {
        Err(ClusterStoreError::Invalid("not connected to etcd".into()))
    }

    async fn revoke(&mut self, _: i64) -> Result<(), ClusterStoreError> {
        Err(ClusterStoreError::Invalid("not connected to etcd".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agent(ttl: Duration) -> LbAgent {
        LbAgent::new("a".into(), ttl, DoorOptions::new(vec!["http://x".into()]))
    }

    #[test]
    fn the_lease_is_whole_seconds_and_at_least_etcds_shortest() {
        assert_eq!(agent(Duration::from_millis(300)).ttl, MIN_LEASE);
        assert_eq!(agent(Duration::from_secs(3)).ttl, Duration::from_secs(3));
        assert_eq!(
            agent(Duration::from_millis(3100)).ttl,
            Duration::from_secs(4)
        );
    }

    #[test]
    fn the_datapath_cap_stays_a_margin_inside_the_lease() {
        for secs in [2, 3, 15, 600] {
            let ttl = Duration::from_secs(secs);
            let m = margin(ttl);
            assert!(m >= Duration::from_millis(100) && m <= ttl / 10 + Duration::from_millis(100));
            // Refreshed every third of the TTL: the cap is always ahead.
            assert!(ttl - m > ttl / 3, "{secs}s");
        }
    }
}
