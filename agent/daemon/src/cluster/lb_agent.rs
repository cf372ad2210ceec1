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
use lockstep_core::lb::cluster::unannounced;
use tokio::sync::watch;

use super::lb::LbWake;
use super::lb_announce::{self, Counts};
use super::lb_assigner::Assigner;
use super::lb_handle::{LbHandle, Shared};
use super::{ClusterStoreError, Door, DoorOptions, Link, Stamp};
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
pub(super) async fn changed(wake: &mut Option<LbWake>) -> bool {
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
