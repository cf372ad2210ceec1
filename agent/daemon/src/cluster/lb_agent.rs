//! The LoadBalancer agent of cluster mode (#13): every node runs one. It
//! holds an LB lease in etcd and, under it, a membership key (the node is a
//! candidate announcer), the assigner key while elected, and one
//! `lb/announce/<ip>` key per address it announces.
//!
//! Each tick (200 ms) it:
//! 1. keeps the lease (a refresh every third of its TTL); the time up to
//!    which etcd is sure to keep it is the datapath's cap: no L2_RESP entry
//!    of this node is answered past it ([`Agent::set_cluster_announcements`]);
//! 2. plans its announcements (the core's [`announce_plan`] over the
//!    members) and acts in the safe order: an address it must stop
//!    announcing leaves the datapath first, then its key is withdrawn; an
//!    address it must start announcing is taken only when no key stands
//!    (the previous holder withdrew, or its lease ended), then programmed,
//!    then announced by gratuitous ARP / unsolicited NA;
//! 3. runs an assigner round ([`Door::lb_round`], campaigning with the same
//!    lease) at most every [`ROUND_EVERY`], at once again while it stores.
//!
//! A tick also comes at once when anything under `lb/` changes (an etcd
//! watch that only wakes the loop): a service stored by `lb apply` is
//! assigned, and an address assigned or withdrawn is taken, without
//! waiting out the 200 ms.
//!
//! Steps 2 and 3 are bounded by a quarter of the TTL, so a slow etcd never
//! holds the next refresh back; each step is idempotent and ordered after
//! what it depends on, so a round cut short is finished by the next.
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

use lockstep_core::lb::cluster::{announce_plan, assigned, reconcile, unannounced};
use lockstep_core::lb::{LbIpam, LbPoolSpec, ServiceSpec};
use serde::Serialize;

use super::lb::LbWake;
use super::{ClusterStoreError, Door, DoorOptions, LbView, Link, Round, Stamp};
use crate::agent::announce::monotonic_ns;
use crate::agent::{Agent, UplinkHealth};

/// The bound on each etcd request: well under a third of the shortest
/// lease, so a refresh that cannot be answered is known in time.
const REQUEST_TIMEOUT: Duration = Duration::from_millis(500);
/// How often the agent looks at its lease, the plan and etcd.
pub const TICK: Duration = Duration::from_millis(200);
/// How often an assigner round runs when nothing was stored last time.
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
        for p in &pools {
            p.validate().map_err(|e| invalid(e.to_string()))?;
        }
        for s in &services {
            s.validate().map_err(|e| invalid(e.to_string()))?;
        }
        let ids: BTreeSet<String> = services.iter().map(ServiceSpec::id).collect();
        let mut d = self.door().await?;
        let (cluster_pools, _, cluster_pools_at) = d.pools().await?;
        for p in &pools {
            lockstep_core::lb::check_against_cluster_pools(p, &cluster_pools)
                .map_err(|e| invalid(e.to_string()))?;
        }
        let view = d.lb_read().await?;
        let mut all_pools = view.pools.clone();
        for p in &pools {
            all_pools.insert(p.name.clone(), p.clone());
        }
        let mut all_services = view.services.clone();
        for s in &services {
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

/// Whether services are stored that the state does not have, or the
/// state has services no longer stored.
fn has_pending(view: &LbView) -> bool {
    let in_state: BTreeSet<String> = view
        .state
        .as_ref()
        .map(|(s, _)| s.services.iter().map(|r| r.spec.id()).collect())
        .unwrap_or_default();
    in_state.len() != view.services.len() || view.services.keys().any(|id| !in_state.contains(id))
}

fn restore(state: &lockstep_core::lb::LbSnapshot) -> Result<LbIpam, ClusterStoreError> {
    LbIpam::restore(state).map_err(|e| ClusterStoreError::Corrupt {
        key: "lb/state".into(),
        reason: e.to_string(),
    })
}

/// The `lockstep lb get` answer of cluster mode: the single-node shape
/// (`pools`, `services`) from the stored state, plus `cluster`.
fn render_view(
    view: &LbView,
    leases: &BTreeMap<i64, Option<i64>>,
) -> Result<serde_json::Value, ClusterStoreError> {
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
        assigner: view.assigner.as_ref().map(|a| a.0.clone()),
        members: view.members.keys().cloned().collect(),
        pending: view
            .services
            .keys()
            .filter(|id| !local.services.contains_key(*id))
            .cloned()
            .collect(),
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
    /// Kernel monotonic ns up to which the datapath may answer.
    valid_until_ns: u64,
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
    /// Addresses in the datapath (keys held under `lease`).
    announcing: BTreeSet<IpAddr>,
    last_round: Option<Instant>,
    /// The last round refused the stored definitions: rounds keep their
    /// pace even with services pending.
    refused: bool,
    /// Wakes the loop when anything under `lb/` changes (`None` until
    /// connected, or after it broke: opened again next tick).
    wake: Option<LbWake>,
    /// When opening `wake` was last tried (at most once a second, so an
    /// etcd that does not answer slows no tick).
    wake_tried: Option<Instant>,
    /// Where `lb/` stood in the mirror when the last round that left
    /// nothing to do began, and when (#27 item 6: a round over an
    /// unchanged mirror is skipped, so an idle agent costs etcd only its
    /// lease refresh and itself almost nothing).
    acted: Option<(Stamp, Instant)>,
    handle: Arc<LbHandle>,
}

/// What ended the loop's wait.
enum Woke {
    /// The tick's time.
    Tick,
    /// Something under `lb/` changed.
    Change,
    /// The wake-up watch broke.
    Broken,
    /// The agent stops.
    Stop,
}

/// The next message of the wake-up watch: whether one came (`false`: the
/// stream broke or ended). Never ready without a watch.
async fn changed(wake: &mut Option<LbWake>) -> bool {
    match wake {
        Some(w) => w.changed().await,
        None => std::future::pending().await,
    }
}

impl std::fmt::Debug for LbAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LbAgent")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

fn lock_agent(slot: &Mutex<Option<Agent>>) -> std::sync::MutexGuard<'_, Option<Agent>> {
    slot.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl LbAgent {
    /// An LB agent for node `name`, its lease `ttl` (raised to
    /// [`MIN_LEASE`], whole seconds), reaching etcd with `opts`.
    pub fn new(name: String, ttl: Duration, opts: DoorOptions) -> Self {
        let secs = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
        let ttl = Duration::from_secs(secs).max(MIN_LEASE);
        LbAgent {
            name,
            labels: BTreeMap::new(),
            answers: true,
            ttl,
            door: None,
            lease: None,
            announcing: BTreeSet::new(),
            last_round: None,
            refused: false,
            wake: None,
            wake_tried: None,
            acted: None,
            handle: Arc::new(LbHandle {
                opts,
                door: tokio::sync::Mutex::new(None),
                shared: Mutex::new(Shared::default()),
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

    /// Gives the datapath `announcing` under the lease's cap.
    async fn push(&mut self, slot: &Arc<Mutex<Option<Agent>>>) {
        let cap = self.lease.map_or(0, |l| l.valid_until_ns);
        let addrs = self.announcing.clone();
        let slot = slot.clone();
        let shown = addrs.clone();
        let r = tokio::task::spawn_blocking(move || {
            lock_agent(&slot)
                .as_mut()
                .map(|a| a.set_cluster_announcements(addrs, cap))
        })
        .await;
        match r {
            Ok(Some(Err(e))) => {
                tracing::error!(error = %crate::error_chain(&e), "cluster announcements not programmed")
            }
            Ok(_) => {}
            Err(e) => tracing::error!(error = %e, "cluster announcement task failed"),
        }
        let mut s = self.handle.lock();
        s.announcing = shown;
        s.valid_until_ns = cap;
    }

    /// Grants the lease if none, refreshes it every third of its TTL.
    /// Returns whether the cap moved.
    async fn keep_lease(&mut self) -> Result<bool, ClusterStoreError> {
        let door = self.door.as_mut().expect("connected by the caller");
        let ttl = self.ttl;
        match self.lease {
            None => {
                let sent = Instant::now();
                let sent_ns = monotonic_ns();
                let (id, granted) = door.lb_grant(ttl).await?;
                door.lb_join(&self.name, &self.labels, self.answers, id)
                    .await?;
                let valid_until_ns = sent_ns + (granted - margin(granted)).as_nanos() as u64;
                tracing::info!(lease = id, ttl = ?granted, "lb lease granted; joined the announcers");
                self.lease = Some(Held {
                    id,
                    ttl: granted,
                    sent,
                    valid_until_ns,
                });
                Ok(true)
            }
            Some(held) if held.sent.elapsed() >= held.ttl / 3 => {
                let sent = Instant::now();
                let sent_ns = monotonic_ns();
                if door.keep_alive(held.id).await? {
                    self.lease = Some(Held {
                        sent,
                        valid_until_ns: sent_ns + (held.ttl - margin(held.ttl)).as_nanos() as u64,
                        ..held
                    });
                    Ok(true)
                } else {
                    tracing::warn!(
                        lease = held.id,
                        "lb lease expired; its announcements are gone (a new lease next)"
                    );
                    self.lease = None;
                    self.announcing.clear();
                    Ok(true)
                }
            }
            Some(_) => Ok(false),
        }
    }

    /// One tick; returns whether another should follow at once.
    async fn tick(&mut self, slot: &Arc<Mutex<Option<Agent>>>) -> bool {
        if self.door.is_none() {
            match Door::connect(self.handle.opts.clone()).await {
                Ok(d) => self.door = Some(d),
                Err(e) => {
                    self.problem(Some(&e));
                    return false;
                }
            }
        }
        // An uplink that is down, without carrier or gone answers nobody:
        // no refresh (the lease runs out and the addresses move to nodes
        // that can answer), no round. One created again gets the programs
        // attached anew first (`Agent::uplink_health`).
        let slot2 = slot.clone();
        let health = if super::node::no_agent(slot) {
            UplinkHealth::Unknown
        } else {
            tokio::task::spawn_blocking(move || {
                lock_agent(&slot2)
                    .as_mut()
                    .map_or(UplinkHealth::Unknown, Agent::uplink_health)
            })
            .await
            .unwrap_or(UplinkHealth::Unknown)
        };
        let silent = matches!(health, UplinkHealth::Silent(_));
        let was_down = std::mem::replace(&mut self.handle.lock().uplink_down, silent);
        if let UplinkHealth::Silent(why) = &health {
            if !was_down {
                tracing::warn!(
                    reason = %why,
                    "the uplink cannot answer: LB lease no longer refreshed; announcements move to other nodes"
                );
            }
            return false;
        }
        if was_down {
            tracing::info!("the uplink answers again: LB lease refreshed");
        }
        let moved = match self.keep_lease().await {
            Ok(m) => m,
            Err(e) => {
                // Not renewed: the datapath stops answering at the cap.
                self.problem(Some(&e));
                return false;
            }
        };
        if moved {
            self.push(slot).await;
        }
        let Some(lease) = self.lease else {
            return false;
        };
        // Nothing under `lb/` changed since a round that left nothing to
        // do: skipped (one round every IDLE_ROUND all the same).
        let stamp = self
            .handle
            .opts
            .link
            .as_ref()
            .map(|l| l.mirror().stamp(&["lb/"]))
            .filter(|s| s.live);
        if !moved
            && let (Some(now), Some((then, at))) = (stamp, self.acted)
            && now == then
            && at.elapsed() < IDLE_ROUND
        {
            return false;
        }
        self.acted = None;
        // Only a round that ran the assigner step too may be skipped
        // after (a follower campaigns in it when the assigner is gone).
        let round_due = self.last_round.is_none_or(|t| t.elapsed() >= ROUND_EVERY);
        // Bounded, so a slow etcd never delays the next lease refresh past
        // its slack: every step of `act` is idempotent and each comes after
        // the one it depends on, so one cut short is finished next tick.
        let bound = lease.ttl / 4;
        match tokio::time::timeout(bound, self.act(slot, lease.id)).await {
            Ok(Ok(again)) => {
                self.problem(None);
                if !again && round_due {
                    self.acted = stamp.map(|s| (s, Instant::now()));
                }
                again
            }
            Ok(Err(e)) => {
                self.problem(Some(&e));
                false
            }
            Err(_) => {
                tracing::debug!(?bound, "lb round cut short to refresh the lease in time");
                false
            }
        }
    }

    /// The announcement plan first (what answers), then the assigner
    /// round when due.
    async fn act(
        &mut self,
        slot: &Arc<Mutex<Option<Agent>>>,
        lease: i64,
    ) -> Result<bool, ClusterStoreError> {
        let door = self.door.as_mut().expect("connected");
        let view = door.lb_read().await?;
        // Each address with its pool's node selector; the members with
        // their labels.
        let to_announce = view.to_announce()?;
        let addresses = super::lb::selectors(&to_announce);
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
        // A key of this node's under another lease (a lease this agent
        // lost track of) is not this node's to keep: out of the datapath,
        // withdrawn, and taken again under the current lease.
        let mut held: BTreeMap<IpAddr, String> = BTreeMap::new();
        let mut stale_keys = Vec::new();
        for (a, (node, l)) in &view.announcements {
            if *node == self.name && *l != lease {
                stale_keys.push(*a);
            } else {
                held.insert(*a, node.clone());
            }
        }
        if stale_keys.iter().any(|a| self.announcing.contains(a)) {
            self.announcing.retain(|a| !stale_keys.contains(a));
            self.push(slot).await;
        }
        let door = self.door.as_mut().expect("connected");
        for a in &stale_keys {
            door.lb_withdraw(*a, &self.name).await?;
        }
        let plan = announce_plan(&addresses, &nodes, &self.name, &held);
        // Stop answering before the key goes.
        let keep: BTreeSet<IpAddr> = plan.keep.iter().copied().collect();
        let stale: Vec<IpAddr> = self.announcing.difference(&keep).copied().collect();
        if !stale.is_empty() {
            self.announcing.retain(|a| keep.contains(a));
            self.push(slot).await;
        }
        let door = self.door.as_mut().expect("connected");
        for a in &plan.drop {
            if door.lb_withdraw(*a, &self.name).await? {
                tracing::info!(address = %a, "lb announcement withdrawn");
                self.handle.lock().withdrawals += 1;
            }
        }
        // Take: key first (only if none stands), then the datapath.
        let mut took = false;
        for a in &plan.take {
            if door.lb_announce(*a, &self.name, lease).await? {
                tracing::info!(address = %a, "lb announcement taken");
                self.announcing.insert(*a);
                self.handle.lock().takes += 1;
                took = true;
            }
        }
        // Held keys not in the datapath (a take whose answer was cut
        // short, see `tick`): programmed now, and counted as taken.
        for a in &plan.keep {
            if self.announcing.insert(*a) {
                self.handle.lock().takes += 1;
                took = true;
            }
        }
        if took {
            self.push(slot).await;
        }
        let mut again = false;
        let door = self.door.as_mut().expect("connected");
        // The assigner does not wait out ROUND_EVERY for a service stored
        // but not in its state (a `lb apply` waiting on it).
        let pending = !self.refused && self.handle.lock().assigner && has_pending(&view);
        if pending || self.last_round.is_none_or(|t| t.elapsed() >= ROUND_EVERY) {
            let round = door.lb_round(&self.name, lease).await;
            self.last_round = Some(Instant::now());
            self.refused = matches!(round, Err(ClusterStoreError::Invalid(_)));
            match round {
                Ok(Round::Stored { added, removed }) => {
                    tracing::info!(added, removed, "lb state stored");
                    self.handle.lock().assigner = true;
                    again = true;
                    self.last_round = None;
                }
                Ok(Round::Idle) => self.handle.lock().assigner = true,
                Ok(Round::Lost) => self.last_round = None,
                Ok(Round::Follower { .. }) => self.handle.lock().assigner = false,
                // A refused definition is named; announcing goes on.
                Err(ClusterStoreError::Invalid(why)) => {
                    tracing::error!(reason = %why, "lb assigner: the stored pools and services are refused");
                }
                Err(e) => return Err(e),
            }
        }
        Ok(again)
    }

    /// Stops: out of the datapath, then the lease revoked (every key of
    /// this node's goes at once, so the next announcer need not wait for
    /// the lease to run out).
    async fn stop(&mut self, slot: &Arc<Mutex<Option<Agent>>>) {
        let lease = self.lease.take();
        self.announcing.clear();
        self.push(slot).await;
        if let (Some(l), Some(door)) = (lease, self.door.as_mut())
            && let Err(e) = door.lb_revoke(l.id).await
        {
            tracing::warn!(error = %crate::error_chain(&e), "lb lease not revoked; it runs out");
        }
    }

    /// Runs ticks until `stop`.
    pub fn spawn(
        mut self,
        slot: Arc<Mutex<Option<Agent>>>,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            loop {
                let again = self.tick(&slot).await;
                if again {
                    continue;
                }
                if self.wake.is_none()
                    && self
                        .wake_tried
                        .is_none_or(|t| t.elapsed() >= Duration::from_secs(1))
                    && let Some(door) = self.door.as_mut()
                {
                    // Bounded by a tick: a slow etcd never delays the next
                    // lease refresh for a wake-up.
                    self.wake_tried = Some(Instant::now());
                    self.wake = tokio::time::timeout(TICK, door.lb_watch())
                        .await
                        .ok()
                        .and_then(Result::ok);
                }
                let woke = tokio::select! {
                    _ = tokio::time::sleep(TICK) => Woke::Tick,
                    came = changed(&mut self.wake) => if came { Woke::Change } else { Woke::Broken },
                    _ = stop.wait_for(|s| *s) => Woke::Stop,
                };
                match woke {
                    Woke::Stop => break,
                    Woke::Broken => self.wake = None,
                    Woke::Tick | Woke::Change => {}
                }
            }
            self.wake = None;
            self.stop(&slot).await;
        })
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
