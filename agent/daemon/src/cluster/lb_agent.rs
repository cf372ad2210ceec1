//! The LoadBalancer agent of cluster mode (#13): every node runs one. It
//! holds an LB lease in etcd and, under it, a membership key (the node is a
//! candidate announcer), the assigner key while elected, and one
//! `lb/announce/<ip>` key per address it announces.
//!
//! What it announces, the order of every step that changes it, and the
//! tick around them (the lease granted, joined and refreshed, `lb/` read,
//! the actions carried out within a budget) are the core's: the announcer
//! (`lockstep_core::lb::announce`) and its driver
//! (`lockstep_core::lb::announce::driver`), the very code the property
//! tests' model drives. This module carries out the driver's requests:
//! against etcd through the cluster door, against the announcement maps
//! through [`Announcements`] (`lb_announce`), and it tells the driver what
//! it cannot know itself. The lease's refreshes are a keeper's
//! (`lb_keeper`), a task of its own, so no request of the tick delays
//! them; the driver refreshes itself only when the keeper fell behind. It
//! tells the driver what it cannot know itself:
//! - the uplink's health at each tick's start (without waiting for the
//!   agent's owner): one that cannot answer makes the announcer empty the
//!   datapath and revoke the lease, so the addresses move within a tick;
//! - whether `lb/` changed since the last read: a read is answered from
//!   the agent's mirror of etcd (#27 item 6: no request), and "unchanged"
//!   while the mirror's `lb/` stands where it stood and the last read has
//!   this node's own writes;
//! - a wake-up at once when anything under `lb/` changes (the mirror's
//!   bell, or a watch of its own without a mirror): an address assigned or
//!   withdrawn is taken without waiting out the 200 ms.
//!
//! It publishes the lease the announcer holds to the node's assigner
//! (`lb_assigner`), which runs its rounds ([`Door::lb_round`], campaigning
//! with the same lease) on a loop of its own, so a tick of takes never
//! holds an assignment back.
//!
//! Why never two nodes answer: an entry's expiry is at most `t + TTL -
//! margin`, `t` the moment the last lease refresh (or grant) was *sent*;
//! etcd renews the lease when it receives the refresh, later than `t`, so
//! it keeps the lease (and the keys) at least until `t + TTL`. A new holder
//! can create the key only after etcd deleted it, so after the old entry
//! expired (docs/design/cluster.md, "Announcement handover").

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lockstep_core::lb::announce::driver::{Done, Driver, DriverConfig, Io, Step};
use lockstep_core::lb::announce::{Observation, Written};
use lockstep_core::lb::cluster::unannounced;
use tokio::sync::watch;

use super::backoff::Backoff;
use super::lb_announce::{self, AnnounceDatapath, AnnounceKeys, Counts};
use super::lb_assigner::Assigner;
use super::lb_handle::{LbHandle, Shared};
use super::lb_keeper::{KeeperEnds, KeeperLink};
use super::lb_timing::{IDLE_ROUND, MIN_LEASE, RETRY_MAX, RETRY_MIN, TICK, Wake, mirror_stamp};
use super::{ClusterStoreError, Door, DoorOptions, Link, Stamp};
use crate::announce::{Announcements, UplinkHealth, UplinkProbe, monotonic_ns};

/// The bound on each etcd request: well under a third of the shortest
/// lease, so a refresh that cannot be answered is known in time.
const REQUEST_TIMEOUT: Duration = Duration::from_millis(500);
/// How long a stop waits for the datapath to be emptied and the lease
/// revoked.
const STOP_WITHIN: Duration = Duration::from_secs(2);

/// The running LB agent of one node.
pub struct LbAgent {
    name: String,
    /// Published with the membership, for pools' node selectors.
    labels: BTreeMap<String, String>,
    ttl: Duration,
    door: Option<Door>,
    /// The announcer and its tick (the core's machines).
    driver: Driver,
    /// The uplink's health as last seen.
    health: UplinkHealth,
    /// Where it is seen ([`LbAgent::with_uplink`]).
    uplink: Uplink,
    /// Wakes the loop when anything under `lb/` changes.
    wake: Wake,
    /// The lease the announcer holds, for the assigner.
    lease_held: watch::Sender<Option<i64>>,
    /// The last read of `lb/` handed to the announcer (#27 item 6: while
    /// the mirror's `lb/` stays where it was, the announcer keeps that
    /// read rather than being handed the same one again every tick).
    seen: Option<Seen>,
    /// The first etcd error of the current tick.
    problem: Option<ClusterStoreError>,
    /// How long etcd is left alone after it answered nothing.
    retries: Backoff,
    counts: Counts,
    handle: Arc<LbHandle>,
    /// The lease's keeper (`lb_keeper`): told the lease to keep, its
    /// refreshes taken back.
    keeper: KeeperLink,
    /// The keeper's ends, until [`LbAgent::spawn`] starts it.
    keeper_ends: Option<KeeperEnds>,
}

/// Where an LB agent sees its uplink's health.
#[derive(Debug)]
enum Uplink {
    /// Not given (a simulated node, no agent): the health stays.
    Unset,
    /// The agent has no uplink.
    None,
    /// The kernel, through the agent's uplink's probe.
    Probe(UplinkProbe),
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

impl std::fmt::Debug for LbAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LbAgent")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// An error for a request that cannot be sent (no connection to etcd).
fn not_connected() -> ClusterStoreError {
    ClusterStoreError::Invalid("not connected to etcd".into())
}

impl LbAgent {
    /// An LB agent for node `name`, its lease `ttl` (raised to
    /// [`MIN_LEASE`], whole seconds), reaching etcd with `opts`.
    pub fn new(name: String, ttl: Duration, opts: DoorOptions) -> Self {
        let secs = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
        let ttl = Duration::from_secs(secs).max(MIN_LEASE);
        // A keeper refreshes the lease (`lb_keeper`); the driver steps in
        // only when it falls behind.
        let cfg = DriverConfig {
            tick_ns: TICK.as_nanos() as u64,
            ..DriverConfig::kept(ttl.as_nanos() as u64)
        };
        let (keeper, keeper_ends) = super::lb_keeper::link();
        LbAgent {
            driver: Driver::new(name.clone(), cfg),
            name,
            labels: BTreeMap::new(),
            ttl,
            door: None,
            health: UplinkHealth::Unknown,
            uplink: Uplink::Unset,
            wake: Wake::default(),
            lease_held: watch::Sender::new(None),
            seen: None,
            problem: None,
            retries: Backoff::new(RETRY_MIN, RETRY_MAX),
            counts: Counts::default(),
            keeper,
            keeper_ends: Some(keeper_ends),
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
        let cfg = DriverConfig {
            can_answer: answers,
            ..*self.driver.config()
        };
        self.driver = Driver::new(self.name.clone(), cfg);
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

    /// Notes the first etcd error of the tick.
    fn note(&mut self, e: ClusterStoreError) {
        self.problem.get_or_insert(e);
    }

    /// The uplink whose health this agent follows: the agent's uplink
    /// (`None`: the agent has none). Without it (a benchmark's simulated
    /// node, with no agent) the health stays as it was.
    #[must_use]
    pub fn with_uplink(mut self, probe: Option<UplinkProbe>) -> Self {
        self.uplink = match probe {
            Some(p) => Uplink::Probe(p),
            None => Uplink::None,
        };
        self
    }

    /// The uplink's health, asked of the kernel, not of the agent: a CNI
    /// call or a reconcile holding the agent delays no tick. Only an uplink
    /// created again under its name is handed to the agent, which attaches
    /// the programs to it.
    async fn uplink_health(&mut self, slot: &super::node::AgentSlot) -> UplinkHealth {
        let mut probe = match std::mem::replace(&mut self.uplink, Uplink::Unset) {
            Uplink::Probe(p) => p,
            other => {
                if matches!(other, Uplink::None) {
                    self.health = UplinkHealth::None;
                }
                self.uplink = other;
                return self.health.clone();
            }
        };
        let seen = tokio::task::spawn_blocking(move || {
            let seen = probe.check();
            (probe, seen)
        })
        .await;
        let Ok((probe, seen)) = seen else {
            // The probe panicked: the agent answers instead from now on.
            return self.health.clone();
        };
        self.uplink = Uplink::Probe(probe);
        self.health = match seen {
            Some(h) => h,
            None => super::node::on_agent(slot, |a| a.uplink_health())
                .await
                .unwrap_or(UplinkHealth::Unknown),
        };
        self.health.clone()
    }

    /// A tick's start: the connection, the uplink's health, the wake-up.
    async fn tick_start(&mut self, slot: &super::node::AgentSlot) {
        if self.door.is_none() {
            match Door::connect(self.handle.opts.clone()).await {
                Ok(d) => self.door = Some(d),
                Err(e) => self.note(e),
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
        self.driver.set_silent(silent);
        self.wake.open(self.door.as_mut()).await;
    }

    /// Shows the announcer's state to the API and metrics, and the tick's
    /// problem; a new address given up for not being answered here is
    /// logged.
    fn show(&mut self) {
        let problem = self.problem.take();
        let machine = self.driver.announcer();
        let cannot = machine.cannot_answer();
        let mut s = self.handle.lock();
        for a in cannot.difference(&s.cannot_answer) {
            tracing::warn!(
                address = %a,
                "lb address not answered here within a rank step (the announcement map refused it, or writes keep failing): given up to another node; this node publishes that it does not answer for a while"
            );
        }
        s.cannot_answer = cannot;
        s.announcing = machine.held();
        s.valid_until_ns = machine.valid_until().unwrap_or(0);
        s.takes += std::mem::take(&mut self.counts.took);
        s.withdrawals += std::mem::take(&mut self.counts.withdrew);
        s.problem = problem.map(|e| crate::error_chain(&e));
    }

    /// Tells the assigner which lease the announcer holds (its rounds
    /// campaign and write under it).
    fn publish_lease(&self) {
        let now = self.driver.announcer().lease();
        self.lease_held.send_if_modified(|held| {
            let changed = *held != now;
            *held = now;
            changed
        });
    }

    /// Carries out one of the driver's requests; its outcome.
    async fn carry_out(&mut self, io: Io, announcements: &Maps) -> Done {
        match io {
            Io::Grant => match self.door.as_mut() {
                None => {
                    self.note(not_connected());
                    Done::Lost
                }
                Some(door) => match door.lb_grant(self.ttl).await {
                    Ok((id, granted)) => {
                        tracing::info!(lease = id, ttl = ?granted, "lb lease granted");
                        Done::Granted {
                            id,
                            ttl_ns: granted.as_nanos() as u64,
                        }
                    }
                    Err(e) => {
                        self.note(e);
                        Done::Lost
                    }
                },
            },
            Io::Join { lease, answers } => {
                let Some(door) = self.door.as_mut() else {
                    self.note(not_connected());
                    return Done::Lost;
                };
                match door.lb_join(&self.name, &self.labels, answers, lease).await {
                    Ok(()) => {
                        tracing::info!(lease, answers, "joined the lb announcers");
                        Done::Joined
                    }
                    Err(e) => {
                        self.note(e);
                        Done::Lost
                    }
                }
            }
            Io::Refresh(lease) => {
                let Some(door) = self.door.as_mut() else {
                    self.note(not_connected());
                    return Done::Lost;
                };
                // The last refresh the driver knows of (its own or the
                // keeper's): how late this one goes out is against it.
                let last = self.driver.kept_lease().map(|k| k.sent);
                let sent = monotonic_ns();
                match door.keep_alive(lease).await {
                    Ok(true) => {
                        if let Some(last) = last {
                            let due = last + self.ttl.as_nanos() as u64 / 3;
                            let late = Duration::from_nanos(sent.saturating_sub(due));
                            let mut s = self.handle.lock();
                            s.lease_renewals += 1;
                            s.lease_late_max = s.lease_late_max.max(late);
                        }
                        Done::Refreshed(true)
                    }
                    Ok(false) => {
                        tracing::warn!(
                            lease,
                            "lb lease expired; its announcements are gone (a new lease next)"
                        );
                        Done::Refreshed(false)
                    }
                    Err(e) => {
                        self.note(e);
                        Done::Lost
                    }
                }
            }
            Io::Read => match self.read().await {
                Ok(view) => Done::Read(view),
                Err(e) => {
                    self.note(e);
                    Done::Lost
                }
            },
            Io::Revoke(lease) => {
                let r = match self.door.as_mut() {
                    Some(door) => AnnounceKeys::revoke(door, lease).await,
                    None => Err(not_connected()),
                };
                match r {
                    Ok(()) => Done::Revoked,
                    // Best effort: a lease not revoked runs out.
                    Err(e) => {
                        tracing::warn!(error = %crate::error_chain(&e), "lb lease not revoked; it runs out");
                        Done::Lost
                    }
                }
            }
            other => {
                let (done, problem) = match self.door.as_mut() {
                    Some(door) => {
                        lb_announce::carry_out(
                            other,
                            door,
                            announcements,
                            &self.name,
                            &mut self.counts,
                        )
                        .await
                    }
                    None => {
                        lb_announce::carry_out(
                            other,
                            &mut NoKeys,
                            announcements,
                            &self.name,
                            &mut self.counts,
                        )
                        .await
                    }
                };
                if let Some(e) = problem {
                    self.note(e);
                }
                done
            }
        }
    }

    /// Reads `lb/` (from the mirror while it is live) for the announcer;
    /// `None` when it need not be handed a new one.
    ///
    /// Skipped while the mirror's `lb/` stands as it did at the last read,
    /// that read has every write of this door (a take, a withdrawal, a
    /// join), and this node's membership shows in it (#27 item 6): the
    /// announcer keeps the read it has, which its own answers since
    /// updated. It is handed a fresh one every [`IDLE_ROUND`] all the same.
    async fn read(&mut self) -> Result<Option<Observation>, ClusterStoreError> {
        let stamp = mirror_stamp(&self.handle.opts);
        let door = self.door.as_mut().ok_or_else(not_connected)?;
        if let (Some(now), Some(seen)) = (stamp, self.seen)
            && now == seen.stamp
            && door.written() <= seen.revision
            && seen.at.elapsed() < IDLE_ROUND
            && !self.driver.announcer().membership_missing()
        {
            return Ok(None);
        }
        self.seen = None;
        let view = door.lb_read().await?;
        // Each address with its pool's node selector; the members with
        // their labels.
        let to_announce = view.to_announce()?;
        let nobody = unannounced(&to_announce, view.candidates());
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
        let observation = lb_announce::observation(&view)?;
        self.seen = stamp.map(|stamp| Seen {
            stamp,
            revision: view.revision,
            at: Instant::now(),
        });
        Ok(Some(observation))
    }

    /// Runs the driver until `stop`.
    async fn run(
        &mut self,
        slot: &super::node::AgentSlot,
        announcements: &Maps,
        stop: &mut watch::Receiver<bool>,
    ) {
        loop {
            if *stop.borrow() {
                return;
            }
            self.fold_kept();
            if self.driver.tick_due(monotonic_ns()) {
                self.tick_start(slot).await;
            }
            let step = self.driver.step(monotonic_ns());
            // Before any request waits: the keeper keeps what the driver
            // holds now (nothing while silent or stopping).
            self.keeper.tell(self.driver.kept_lease());
            match step {
                Step::Io(io) => {
                    let to_etcd = io.to_etcd();
                    let done = self.carry_out(io, announcements).await;
                    let unanswered = to_etcd && done.unanswered();
                    self.driver.done(done, monotonic_ns());
                    // etcd silent: asked again only after a jittered,
                    // growing delay (#47 item 3).
                    if unanswered {
                        let wait = self.retries.next_delay();
                        self.driver
                            .hold_until(monotonic_ns().saturating_add(wait.as_nanos() as u64));
                    } else if to_etcd {
                        self.retries.reset();
                    }
                    self.keeper.tell(self.driver.kept_lease());
                    self.publish_lease();
                }
                Step::Announce(a) => announcements.announce(a),
                Step::Wait(until) => {
                    self.publish_lease();
                    self.show();
                    let wait = Duration::from_nanos(until.saturating_sub(monotonic_ns()));
                    tokio::select! {
                        () = tokio::time::sleep(wait) => {}
                        () = self.wake.changed() => self.driver.wake(),
                        () = self.keeper.changed() => {}
                        _ = stop.wait_for(|s| *s) => return,
                    }
                }
            }
        }
    }

    /// Hands the driver the keeper's latest refresh of the lease it holds.
    fn fold_kept(&mut self) {
        if let Some((id, sent)) = self.keeper.take()
            && self.driver.kept_lease().is_some_and(|k| k.id == id)
        {
            self.driver.keeper_refreshed(id, sent);
        }
    }

    /// Stops: out of the datapath, then the lease revoked (every key of
    /// this node's goes at once, so the next announcer need not wait for
    /// the lease to run out). A datapath write that is not confirmed
    /// leaves the lease to run out instead: nothing is withdrawn on a
    /// write in doubt.
    async fn stop(&mut self, announcements: &Maps) {
        self.driver.stop();
        let deadline = Instant::now() + STOP_WITHIN;
        while !self.driver.stopped() && Instant::now() < deadline {
            match self.driver.step(monotonic_ns()) {
                Step::Io(io) => {
                    let done = self.carry_out(io, announcements).await;
                    self.driver.done(done, monotonic_ns());
                }
                Step::Announce(a) => announcements.announce(a),
                Step::Wait(until) => {
                    let wait = Duration::from_nanos(until.saturating_sub(monotonic_ns()));
                    tokio::time::sleep(
                        wait.min(deadline.saturating_duration_since(Instant::now())),
                    )
                    .await;
                }
            }
        }
        if !self.driver.stopped() {
            tracing::warn!("lb lease not revoked; it runs out");
        }
        self.show();
    }

    /// Runs until `stop`, writing this node's announcements into
    /// `announcements` (`None`: a node without a datapath, as a
    /// benchmark's simulated nodes are).
    pub fn spawn(
        mut self,
        slot: super::node::AgentSlot,
        announcements: Option<Announcements>,
        mut stop: watch::Receiver<bool>,
    ) -> tokio::task::JoinHandle<()> {
        let announcements = Maps(announcements);
        let assigner = Assigner::new(self.name.clone(), self.ttl, self.handle.clone());
        let assigner = tokio::spawn(assigner.run(self.lease_held.subscribe(), stop.clone()));
        let keeper = self.keeper_ends.take().map(|ends| {
            tokio::spawn(super::lb_keeper::keep(
                ends,
                self.handle.opts.clone(),
                self.handle.clone(),
                stop.clone(),
            ))
        });
        tokio::spawn(async move {
            self.run(&slot, &announcements, &mut stop).await;
            // No round while the lease goes (an interrupted one is fenced
            // like any other: stored whole or not at all), and no refresh:
            // the lease is revoked, or left to run out.
            assigner.abort();
            let _ = assigner.await;
            if let Some(k) = keeper {
                k.abort();
                let _ = k.await;
            }
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

impl AnnounceDatapath for Maps {
    async fn program(&self, seq: u64, addresses: BTreeSet<IpAddr>, valid_until: u64) -> Written {
        match &self.0 {
            Some(maps) => maps.program(seq, addresses, valid_until).await,
            None => Written::Done,
        }
    }

    fn announce(&self, address: IpAddr) {
        if let Some(maps) = &self.0 {
            Announcements::announce(maps, address);
        }
    }
}

/// etcd out of reach: every request is lost.
struct NoKeys;

impl AnnounceKeys for NoKeys {
    async fn take(&self, _: IpAddr, _: &str, _: i64) -> Result<Option<i64>, ClusterStoreError> {
        Err(not_connected())
    }

    async fn withdraw(
        &mut self,
        _: IpAddr,
        _: &str,
        _: lockstep_core::lb::announce::KeyRef,
    ) -> Result<(), ClusterStoreError> {
        Err(not_connected())
    }

    async fn revoke(&mut self, _: i64) -> Result<(), ClusterStoreError> {
        Err(not_connected())
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
        use lockstep_core::lb::announce::driver::margin;
        for secs in [2u64, 3, 15, 600] {
            let ttl = secs * 1_000_000_000;
            let m = margin(ttl);
            assert!(m >= 100_000_000 && m <= ttl / 10 + 100_000_000);
            // Refreshed every third of the TTL: the cap is always ahead.
            assert!(ttl - m > ttl / 3, "{secs}s");
        }
    }
}
