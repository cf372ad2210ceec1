//! Cluster mode in the running agent: one background task that registers
//! the node under a lease and keeps it alive, reads the cluster pools and
//! blocks, fences the blocks of the local record that etcd no longer gives
//! this node, claims blocks as the core's demand logic asks and gives empty
//! ones back after `release_after`. The allocator sees only local pools
//! (`Agent::set_cluster_pools`): an ADD served from a held block never
//! waits for etcd.
//!
//! Order of every change, so the local record never lists less than the
//! node may hand out: a claim is committed in etcd, then recorded
//! (`cluster.json`), then served; a give-back is first taken out of the
//! allocator (only when it holds no address), then deleted in etcd (compare
//! on its revision), then forgotten.
//!
//! What the allocator is given follows the record as a desired state
//! ([`Served`]): after every read of etcd, and after every change of a
//! round, the pools the core makes of the record are compared with what the
//! allocator was last given and given again when they differ. A block
//! fenced while the agent runs (a partition healed after the node was
//! removed and its block claimed elsewhere; a restart with etcd cut, then
//! healed) thus leaves the allocator right after the read that found it,
//! before any claim. Before, only a round that claimed or forgot a block
//! gave the allocator its pools, so a fenced block with holders kept
//! serving whenever no claim followed (a full pool, a failing claim).
//!
//! etcd restored from a backup ([`restore`]): a read whose cluster ID or
//! store revision says etcd went back in time makes the node claim back
//! the blocks of its record etcd lost, before it fences and before any new
//! claim, and claim nothing new for a grace period.

mod restore;

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use imbl::OrdMap;
use ipnet::IpNet;
use lockstep_core::cidr::Family;
use lockstep_core::cluster::{
    ClaimedBlock, ClusterPoolSpec, Gate, LocalOverlap, RoundBlock, RoundInput, fence,
    local_overlaps, next_block, plan_round,
};

mod blocks;
mod follow;
mod ips;
pub(crate) use ips::node_ips;
mod keeper;
mod lease;
mod reclaim;
mod served;
mod window;

use served::Served;
pub use served::local_specs;

pub use super::allocator::AgentSlot;
use super::allocator::ClusterAllocator;
pub(crate) use super::allocator::{no_agent, on_agent};
use super::backoff::Backoff;
use super::handle::ClusterHandle;
use super::held::{Held, HeldBlock};
use super::mirror::Cursor;
use super::{
    Block, Claim, ClusterStoreError, Door, DoorOptions, Link, NodeRecord, ReservedRecord, Stamp,
};
use crate::config::{ClusterConfig, Config};

/// The bound on each etcd request of the agent: short, so an ADD that
/// needs a block answers "try again" within 2 s when etcd cannot.
const REQUEST_TIMEOUT: Duration = Duration::from_millis(600);
/// How often the task looks at demand, etcd and the lease when nothing
/// wakes it.
const TICK: Duration = Duration::from_secs(1);
/// The first delay before a round asks etcd again after a request of the
/// round failed, and the longest base delay (doubled from one to the
/// other, each stretched by a random fraction of itself: #47 item 3). An
/// ADD that needs a block meanwhile is told to try again, as it is while
/// etcd fails; one served from a held block never waits.
const RETRY_MIN: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(8);
/// How often pools and blocks are read when nothing asks sooner (a claim
/// due, an ADD waiting, etcd failing): every node reading every block
/// every second would load etcd with the cluster's size squared.
const READ_EVERY: Duration = Duration::from_secs(5);

/// etcd left a request of a round unanswered: the rounds ask it nothing
/// until `until`, or until it is seen answering this agent again (the
/// lease's keeper refreshed the lease, or the mirror's watch delivered a
/// change), whichever comes first.
#[derive(Clone, Copy, Debug)]
struct Hold {
    until: Instant,
    since: Instant,
    /// Where the mirror stood (full reads, last revision) when it began.
    seen: Option<(u64, i64)>,
}

/// A new agent instance identity: 128 random bits, hex.
fn new_instance() -> Result<String, getrandom::Error> {
    let (a, b) = (getrandom::u64()?, getrandom::u64()?);
    Ok(format!("{a:016x}{b:016x}"))
}

/// The running cluster part of the agent.
pub struct ClusterNode {
    config: Config,
    cluster: ClusterConfig,
    name: String,
    /// This agent's instance (kept in the state directory's record):
    /// written into every block and node record, so a second host under
    /// the same name is told apart (#26 item 5).
    instance: String,
    /// Why this agent may not act as its node: another instance holds the
    /// name's live node key. Nothing is claimed while set.
    name_taken: Option<String>,
    ips: Vec<IpAddr>,
    door: Option<Door>,
    held: Held,
    lease: Option<(i64, Instant)>,
    /// The delays between rounds that ask etcd while it fails (#47 item
    /// 3: jittered, growing), and the hold of the present one.
    retries: Backoff,
    hold: Option<Hold>,
    /// Record published with the lease (re-published when it changes).
    published: Option<NodeRecord>,
    /// The addresses in use published with it (in the routing key).
    published_addrs: Vec<IpAddr>,
    /// This node's own reservations (`reserved/<node>`) and their key's
    /// revision, as last read: released as its pods let them go.
    own_reserved: Option<(ReservedRecord, i64)>,
    /// Every node's reservations (node → addresses), as last read or
    /// followed: those of other nodes are kept out of the allocator.
    reservations: BTreeMap<String, Vec<IpAddr>>,
    /// Every claimed block (anyone's), as last read.
    claimed: BTreeSet<IpNet>,
    /// Each cluster pool's key revision, as last read (a drained pool's
    /// removal compares it).
    pool_revisions: BTreeMap<String, i64>,
    empty_since: BTreeMap<IpNet, u64>,
    /// When pools and blocks were last read successfully.
    last_read: Option<Instant>,
    /// A claim is due: read at the next round.
    read_next: bool,
    /// The pools ADDs waited for when the last read began: a claim that
    /// finds no free block answers only those. An ADD asking during the
    /// read may need pools the read missed (an apply landing meanwhile);
    /// it is answered after the next read.
    asked_at_read: BTreeSet<String>,
    /// The blocks etcd gives other nodes (block → node), as last read;
    /// replaced only when a read changes it.
    others: OrdMap<IpNet, String>,
    /// What the allocator was last given (`None`: nothing yet).
    served: Option<Served>,
    /// Configured CIDRs overlapping the cluster's pools or blocks, as last
    /// read: refused at start, withheld from the allocator while running.
    overlaps: Vec<LocalOverlap>,
    /// What the node knows of etcd's history (rollbacks).
    history: restore::History,
    /// The connection and mirror shared with the agent's other cluster
    /// tasks (`None`: reads go to etcd).
    link: Option<Link>,
    /// Where the mirror stood at the last read that came from it.
    synced: Option<Stamp>,
    /// How far the mirror's changes were looked at: from the last read,
    /// or past changes it followed in place ([`ClusterNode::follow`]).
    cursor: Option<Cursor>,
    /// The nodes whose lease-bound key the last read found, and those
    /// followed in place since ([`ClusterNode::follow`]).
    alive: BTreeSet<String>,
    /// The other nodes with a routing key and no live node key (gone
    /// nodes, until reclaimed), as last read or followed: a node come or
    /// gone may change which live node keeps each.
    gone: BTreeSet<String>,
    /// Another node's lease is gone: its gone mark and reclaim are due
    /// with time, so the read runs every [`READ_EVERY`] even when
    /// nothing changes.
    gone_pending: bool,
    /// Blocks a read settled as this node's (a claim whose answer was
    /// lost), per pool: counted as claims once served.
    settled: BTreeMap<String, u64>,
    /// The reservation window (#43).
    window: window::WindowState,
    handle: Arc<ClusterHandle>,
    /// The node lease's keeper (`keeper`): its link, and its ends until
    /// [`ClusterNode::spawn`] starts it.
    keeper: keeper::KeeperLink,
    keeper_ends: Option<keeper::KeeperEnds>,
}

/// The areas the claim loop reads: a change in any of them is read at
/// the next round.
const AREAS: [&str; 6] = [
    "pools/",
    "blocks/",
    "nodes/",
    "node_addrs/",
    "reserved/",
    "default_pool",
];

impl std::fmt::Debug for ClusterNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterNode")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl ClusterNode {
    /// Before the agent serves: reads the local record and, if etcd answers
    /// within its bound, fences what etcd no longer gives this node, so no
    /// address of a fenced block is ever handed out. With etcd down the
    /// agent serves its recorded blocks and fences once etcd answers.
    ///
    /// # Errors
    /// The node addresses cannot be found, or the record is unreadable.
    pub async fn start(
        config: &Config,
        agent: &mut dyn ClusterAllocator,
        link: Option<Link>,
    ) -> Result<Self, String> {
        let mut node = Self::connect(config, link).await?;
        node.apply(agent);
        Ok(node)
    }

    /// As [`ClusterNode::start`] without giving an allocator its pools:
    /// the claim loop of a node whose allocator is elsewhere (the cluster
    /// benchmark's simulated nodes, which run this loop with no agent).
    ///
    /// # Errors
    /// As [`ClusterNode::start`].
    pub async fn connect(config: &Config, link: Option<Link>) -> Result<Self, String> {
        let cluster = config.cluster.clone().ok_or("no [cluster] section")?;
        let name = cluster
            .node_name
            .clone()
            .unwrap_or_else(|| config.node_name());
        // The host name stands in when none is configured: it must make
        // one key segment too (`nodes/<node>`).
        if let Some(why) = lockstep_core::cluster::key_name_problem(&name) {
            return Err(format!(
                "cluster.node_name: {name:?} is not usable as an etcd key segment: {why}; set cluster.node_name"
            ));
        }
        let ips = node_ips(config, &cluster)?;
        let held = Held::load(&config.state_dir).map_err(|e| crate::error_chain(&e))?;
        if !held.node.is_empty() && held.node != name {
            return Err(format!(
                "cluster.node_name: the state directory's blocks were claimed as node {}, this agent is {name}",
                held.node
            ));
        }
        let mut held = held;
        if held.instance.is_empty() {
            // Made once, kept with the blocks: durable before any record
            // carries it.
            held.instance = new_instance().map_err(|e| format!("cluster instance: {e}"))?;
            held.save(&config.state_dir)
                .map_err(|e| crate::error_chain(&e))?;
        }
        let history = restore::History::load(&config.state_dir, &held)?;
        let window = window::WindowState::load(&config.state_dir)?;
        let (keeper, keeper_ends) = keeper::link();
        let mut node = ClusterNode {
            config: config.clone(),
            cluster,
            name,
            instance: held.instance.clone(),
            name_taken: None,
            ips,
            door: None,
            held,
            lease: None,
            retries: Backoff::new(RETRY_MIN, RETRY_MAX),
            hold: None,
            published: None,
            published_addrs: Vec::new(),
            own_reserved: None,
            reservations: BTreeMap::new(),
            claimed: BTreeSet::new(),
            pool_revisions: BTreeMap::new(),
            empty_since: BTreeMap::new(),
            last_read: None,
            read_next: false,
            asked_at_read: BTreeSet::new(),
            others: OrdMap::new(),
            served: None,
            overlaps: Vec::new(),
            history,
            link,
            synced: None,
            cursor: None,
            alive: BTreeSet::new(),
            gone: BTreeSet::new(),
            gone_pending: false,
            settled: BTreeMap::new(),
            window,
            handle: Arc::new(ClusterHandle::default()),
            keeper,
            keeper_ends: Some(keeper_ends),
        };
        node.held.node = node.name.clone();
        let reachable = node.sync().await;
        // A live node key of this name holding another instance: another
        // host runs as this node. Refused, naming both (#26 item 5).
        if reachable
            && let Some(door) = node.door.as_ref()
            && let Ok(Some(theirs)) = door.name_holder(&node.name, &node.instance).await
        {
            return Err(ClusterStoreError::NameTaken {
                name: node.name.clone(),
                theirs,
                ours: node.instance.clone(),
            }
            .to_string());
        }
        if !reachable {
            tracing::warn!(problem = ?node.handle.etcd_problem(), "etcd unreachable at start; serving the blocks recorded locally until it answers");
            // The cluster pools of the record stand in for etcd's.
            node.set_overlaps(Vec::new());
        }
        // A configured pool sharing addresses with the cluster's is a
        // configuration error: refused before anything is served.
        lockstep_core::cluster::check_configured(node.overlaps.clone())
            .map_err(|e| e.to_string())?;
        Ok(node)
    }

    /// The handle the API and metrics read.
    pub fn handle(&self) -> Arc<ClusterHandle> {
        self.handle.clone()
    }

    fn set_problem(&self, e: Option<&ClusterStoreError>) {
        let mut s = self.handle.lock();
        let now = e.map(|e| crate::error_chain(e));
        // Said when it starts or changes, not every round.
        match (&s.problem, &now) {
            (None, Some(p)) => tracing::warn!(problem = %p, "etcd did not answer the claim loop"),
            (Some(a), Some(b)) if a != b => {
                tracing::warn!(problem = %b, "etcd did not answer the claim loop")
            }
            (Some(_), None) => tracing::info!("etcd answers the claim loop again"),
            _ => {}
        }
        s.problem = now;
    }

    fn options(&self) -> DoorOptions {
        let mut opts = DoorOptions::from_cluster_config(&self.cluster, REQUEST_TIMEOUT);
        opts.instance = Some(self.instance.clone());
        opts.link = self.link.clone();
        opts
    }

    /// Reads pools and blocks; fences held blocks etcd does not give this
    /// node; settles unknown claims. Returns whether etcd answered.
    async fn sync(&mut self) -> bool {
        if self.door.is_none() {
            match Door::connect(self.options()).await {
                Ok(d) => self.door = Some(d),
                Err(e) => {
                    self.set_problem(Some(&e));
                    return false;
                }
            }
        }
        let door = self.door.as_mut().expect("connected above");
        let read = async {
            let (default, _) = door.stored_default().await?;
            let (pools, revisions, _) = door.pools().await?;
            let (blocks, _) = door.blocks().await?;
            Ok::<_, ClusterStoreError>((pools, revisions, default, blocks, door.unreadable()))
        };
        let (pools, revisions, default, mut blocks, unreadable) = match read.await {
            Ok(r) => r,
            Err(e) => {
                self.set_problem(Some(&e));
                return false;
            }
        };
        // Nodes gone: marked, reclaimed once due; reservations read.
        if let Err(e) = self.watch_gone().await {
            self.set_problem(Some(&e));
            return false;
        }
        // Read from etcd, the read says it answers. From the mirror, it
        // says nothing new: the loop's own requests (the lease) tell.
        if !self.mirrored() {
            self.set_problem(None);
        }
        self.held.pools = pools;
        self.pool_revisions = revisions;
        self.held.default_pool = default;
        // etcd gone back in time: the blocks it lost are claimed back
        // before the fence below looks at them.
        let mark = self.door.as_ref().and_then(Door::mark);
        self.note_store(mark);
        self.reclaim_lost(&mut blocks).await;
        // Claims and give-backs whose answer never came, settled against
        // what etcd holds, before fencing (an unsettled claim found ours,
        // or claimed again, is served, not fenced).
        self.settle(&mut blocks).await;
        self.claimed = blocks.iter().map(|b| b.cidr).collect();
        // Unsettled claims stay out of every pick until settled.
        self.claimed
            .extend(self.held.unsettled.iter().map(|u| u.cidr));
        // A key this build cannot read was skipped by the read (it no
        // longer stops it); a block it names has an unknown holder: never
        // picked.
        self.claimed
            .extend(unreadable.iter().filter_map(|u| u.block));
        self.handle.lock().unreadable = unreadable
            .iter()
            .map(|u| (u.key.clone(), u.reason.clone()))
            .collect();
        // Who holds each block: a block under this node's name written by
        // another instance (a second host with this name) is another's,
        // named with its instance (#26 item 5).
        let owners: BTreeMap<IpNet, String> = blocks
            .iter()
            .map(|b| {
                let who = if b.node == self.name && !b.held_by(&self.name, &self.instance) {
                    b.holder()
                } else {
                    b.node.clone()
                };
                (b.cidr, who)
            })
            .collect();
        let others: OrdMap<IpNet, String> = owners
            .iter()
            .filter(|(_, n)| **n != self.name)
            .map(|(b, n)| (*b, n.clone()))
            .collect();
        if self.others != others {
            self.others = others;
        }
        self.set_overlaps(
            blocks
                .iter()
                .map(|b| ClaimedBlock {
                    pool: &b.pool,
                    block: b.cidr,
                    node: &b.node,
                })
                .collect(),
        );
        let local: BTreeSet<IpNet> = self.held.serving().map(|b| b.cidr).collect();
        let fenced = fence(&self.name, &local, &owners);
        for hb in &mut self.held.blocks {
            if let Some(b) = blocks
                .iter()
                .find(|b| b.cidr == hb.cidr && b.held_by(&self.name, &self.instance))
            {
                hb.revision = b.revision;
            }
            if let Some(why) = fenced.get(&hb.cidr) {
                let reason = match why {
                    lockstep_core::cluster::Fence::OwnedBy(n) => {
                        format!("etcd gives it to node {n}")
                    }
                    lockstep_core::cluster::Fence::Absent => {
                        "etcd no longer records it (given back or reclaimed)".into()
                    }
                };
                tracing::error!(block = %hb.cidr, pool = %hb.pool, reason = %reason, "FENCED: this node's block is no longer its own; no new address comes from it");
                hb.fenced = Some(reason);
            }
        }
        if !fenced.is_empty()
            && let Err(e) = self.held.save(&self.config.state_dir)
        {
            tracing::error!(error = %crate::error_chain(&e), "the fenced blocks are not recorded");
        }
        {
            let mut s = self.handle.lock();
            s.pools = self
                .held
                .pools
                .iter()
                .map(|p| crate::wire::ClusterPoolFamilies {
                    name: p.name.clone(),
                    ipv4: !p.ipv4.is_empty(),
                    ipv6: !p.ipv6.is_empty(),
                    draining: p.draining,
                })
                .collect();
            // `fenced` is counted once the allocator was told (`serve`).
        }
        true
    }

    /// Finds the configured CIDRs overlapping the cluster pools as last
    /// read or `blocks`; a change is logged and reaches the allocator with
    /// the next [`Served`].
    fn set_overlaps(&mut self, blocks: Vec<ClaimedBlock<'_>>) {
        let overlaps = local_overlaps(&self.config.pools, &self.held.pools, &blocks);
        if overlaps == self.overlaps {
            return;
        }
        for o in overlaps.iter().filter(|o| !self.overlaps.contains(o)) {
            tracing::error!(overlap = %o, "WITHHELD: a configured pool shares addresses with the cluster's; nothing new is allocated from that cidr");
        }
        self.handle.lock().overlaps = overlaps.iter().map(ToString::to_string).collect();
        self.overlaps = overlaps;
    }

    /// What the allocator should be given for the record `held`.
    fn wanted(&self, held: &Held) -> Served {
        Served {
            specs: local_specs(&self.config, held),
            fenced: held
                .blocks
                .iter()
                .filter_map(|b| b.fenced.clone().map(|w| (b.cidr, w)))
                .collect(),
            others: self.others.clone(),
            overlaps: self.overlaps.clone(),
            excluded: held.reserved.iter().copied().collect(),
            windows: self.window.per_block(held),
            // The cluster pool serving requests that name none, as the
            // core decides it from what etcd records (`Err`: why none).
            default: lockstep_core::cluster::default_pool(
                &held.pools,
                held.default_pool.as_deref(),
            )
            .map_err(|e| e.to_string()),
        }
    }

    /// Where the mirror stands for the areas this loop reads (`None`:
    /// no mirror).
    fn stamp(&self) -> Option<Stamp> {
        self.link.as_ref().map(|l| l.mirror().stamp(&AREAS))
    }

    /// Whether the rounds ask etcd nothing now ([`Hold`]); `stamp`: where
    /// the mirror stands.
    fn held(&self, stamp: Option<Stamp>) -> bool {
        let Some(h) = self.hold else {
            return false;
        };
        let refreshed = self
            .keeper
            .fold(self.lease)
            .is_some_and(|(_, at)| at > h.since);
        let changed = stamp.is_some_and(|s| Some((s.generation, s.revision)) != h.seen);
        Instant::now() < h.until && !refreshed && !changed
    }

    /// Whether reads come from a live mirror now.
    fn mirrored(&self) -> bool {
        self.link.as_ref().is_some_and(|l| l.mirror().live())
    }

    /// Gives the allocator the pools of the record (at start, before the
    /// agent serves).
    fn apply(&mut self, agent: &mut dyn ClusterAllocator) {
        let want = self.wanted(&self.held);
        want.give(&self.name, agent, self.served.as_ref());
        self.handle.lock().fenced = want.fenced.len();
        self.served = Some(want);
    }

    /// Gives the allocator what the record now asks for, if that differs
    /// from what it was last given: a block fenced by the last read stops
    /// serving here, at once.
    async fn serve(&mut self, slot: &AgentSlot) {
        let want = self.wanted(&self.held);
        if self.served.as_ref() == Some(&want) || no_agent(slot) {
            return;
        }
        let had = self.served.clone();
        let node = self.name.clone();
        let given = want.clone();
        let done = on_agent(slot, move |a| given.give(&node, a, had.as_ref())).await;
        if done.is_some() {
            self.handle.lock().fenced = want.fenced.len();
            self.served = Some(want);
        }
    }

    /// One round: read etcd, keep the lease, claim and give back.
    async fn round(&mut self, slot: &AgentSlot) {
        // The remote task's watch saw etcd's revision drop: this read
        // tells whether etcd went back in time, against what the watch saw.
        let watch_saw = self.handle.lock().went_back_from.take();
        if let Some(seen) = watch_saw {
            self.watch_saw(seen);
            self.read_next = true;
        }
        // With the mirror live, a read costs etcd nothing and is due when
        // something it reads changed (or a gone node's deadline may have
        // come); without it, every READ_EVERY as before.
        let stamp = self.stamp();
        // What changed since the last read, when only node keys were
        // rewritten (their counts) with no node come or gone, or other
        // nodes' blocks claimed or given back: followed in place
        // (`follow`), and the read is not made.
        let mut cursor = None;
        if let Some(s) = stamp
            && s.live
            && self.synced.is_some_and(|at| at != s)
        {
            match self.follow() {
                Ok(past) => {
                    self.cursor = Some(past);
                    self.synced = Some(s);
                    self.handle.lock().changes_followed += 1;
                }
                Err(at) => cursor = at,
            }
        }
        let every = self.last_read.is_none_or(|t| t.elapsed() >= READ_EVERY);
        // A watch that broke a moment ago is resumed, not read around:
        // what the mirror held was etcd's state until then.
        let resuming = self.link.as_ref().is_some_and(|l| l.mirror().resuming());
        let due = match stamp {
            Some(s) if s.live => self.synced != Some(s) || (self.gone_pending && every),
            _ => every && !resuming,
        };
        // A request of an earlier round failed: etcd is asked nothing
        // until the retry's delay is over, or until it answers the agent
        // again (the round serves what it has meanwhile).
        let held = self.held(stamp);
        // Claims pick from the view without a read when it is as a read
        // would make it now.
        let current = !held && self.view_is_current(stamp);
        let must_read = !held
            && (self.read_next
                || due
                || self.handle.etcd_problem().is_some()
                || (!current && !self.handle.lock().wanted.is_empty()));
        if current && !must_read {
            self.asked_at_read = self.handle.lock().wanted.clone();
        }
        if must_read {
            self.asked_at_read = self.handle.lock().wanted.clone();
            // A read made for another reason (a claim waiting, etcd's
            // problem, a rollback) starts from where the mirror stands
            // now, so the next round's changes are counted from it.
            if cursor.is_none() {
                cursor = self
                    .link
                    .as_ref()
                    .and_then(|l| l.mirror().changes(&AREAS, None))
                    .map(|(_, at)| at);
            }
        }
        let reachable = if must_read { self.sync().await } else { !held };
        if must_read && reachable {
            self.handle.lock().whole_reads += 1;
            self.last_read = Some(Instant::now());
            self.read_next = false;
            self.synced = stamp.filter(|s| s.live);
            self.cursor = cursor.filter(|_| self.synced.is_some());
        }
        // A block the read fenced leaves the allocator now, before any
        // claim (each may take several requests to etcd).
        self.serve(slot).await;
        // Claims pick from the blocks just read, or from the view kept
        // current without one.
        let fresh = (must_read && reachable) || (current && !must_read);
        // What the allocator holds, per pool and family.
        let blocks: Vec<HeldBlock> = self.held.blocks.clone();
        let cidrs: Vec<IpNet> = blocks.iter().map(|b| b.cidr).collect();
        // Read from the owner's published view, without a command: a give-back
        // checks again on the owner (`give_back`).
        let (used, addrs) = match slot.as_ref() {
            Some(d) if d.present() => d.usage(&cidrs),
            _ => (vec![0; cidrs.len()], Vec::new()),
        };
        // The round's decisions are the core's (`plan_round`): which
        // blocks to claim and give back, which fenced ones to forget, what
        // to publish, and whether a gate holds the claims back.
        let round: Vec<RoundBlock<'_>> = blocks
            .iter()
            .zip(&used)
            .map(|(b, u)| RoundBlock {
                cidr: b.cidr,
                pool: &b.pool,
                fenced: b.fenced.is_some(),
                releasing: b.releasing,
                used: *u,
            })
            .collect();
        let reserved: BTreeSet<IpAddr> = self.held.reserved.iter().copied().collect();
        let wanted = self.handle.lock().wanted.clone();
        let plan = plan_round(&RoundInput {
            pools: &self.held.pools,
            stored_default: self.held.default_pool.as_deref(),
            blocks: &round,
            reserved: &reserved,
            wanted: &wanted,
            empty_since: &self.empty_since,
            now_ms: now_ms(),
            release_after_ms: u64::try_from(self.cluster.release_after.as_millis())
                .unwrap_or(u64::MAX),
            name_taken: self.name_taken.is_some(),
            may_claim_new: self.may_claim_new(),
            fresh,
            reachable,
        });
        self.empty_since = plan.empty_since;
        // A fenced block is not ours: forgotten once nothing uses it.
        for &i in &plan.forget {
            self.held.blocks.retain(|h| h.cidr != blocks[i].cidr);
        }
        // No block comes for a pool being removed: its ADDs stop waiting.
        if !plan.unwant.is_empty() {
            let mut s = self.handle.lock();
            s.wanted.retain(|p| !plan.unwant.contains(p));
        }
        if plan.held_back == Some(Gate::Grace) {
            tracing::debug!("no new block in the grace after etcd went back in time");
        }
        if plan.read_next {
            self.read_next = true;
        }
        if plan.wake {
            self.handle.wake.notify_one();
        }
        let (in_use, wanted_total) = (plan.in_use, plan.wanted_total);
        let mut changed = !plan.forget.is_empty();
        let releases: Vec<HeldBlock> = plan.releases.iter().map(|&i| blocks[i].clone()).collect();
        let claims: Vec<(ClusterPoolSpec, Family, u64)> = plan
            .claims
            .into_iter()
            .map(|c| (c.pool, c.family, c.count))
            .collect();
        // Blocks claimed per pool: counted (and the waiting ADDs told) only
        // once the allocator serves them, below; with them those the read
        // settled as this node's.
        let mut claimed: BTreeMap<String, u64> = std::mem::take(&mut self.settled);
        if reachable {
            for (pool, family, n) in claims {
                for _ in 0..n {
                    if self.claim(&pool, family).await {
                        changed = true;
                        *claimed.entry(pool.name.clone()).or_default() += 1;
                    } else {
                        break;
                    }
                }
            }
            // Published after the claims, so the key lists them.
            let record = NodeRecord {
                name: self.name.clone(),
                instance: Some(self.instance.clone()),
                ips: self.ips.clone(),
                version: crate::version::version(),
                blocks: self.held.serving().map(|b| b.cidr).collect(),
                in_use,
                wanted: wanted_total,
            };
            // The addresses in use are no longer published with the routing
            // key every node watches (#43): the reservation window, which
            // only a reclaimer reads, covers them.
            self.lease(record, Vec::new()).await;
            self.release_own(&addrs.iter().copied().collect()).await;
        }
        if changed && let Err(e) = self.held.save(&self.config.state_dir) {
            tracing::error!(error = %crate::error_chain(&e), "the held blocks are not recorded");
        }
        // New blocks (recorded by `claim`), forgotten fenced ones, and a new
        // default (an apply naming another) reach the allocator.
        self.serve(slot).await;
        // The reservation window: grown ahead of need, published before
        // anything of it is handed out (#43).
        self.window_round(slot, &addrs, reachable).await;
        {
            let mut s = self.handle.lock();
            for (pool, n) in claimed {
                *s.claims.entry(pool.clone()).or_default() += n;
                s.wanted.remove(&pool);
            }
        }
        if reachable {
            for b in releases {
                self.give_back(slot, b).await;
            }
            if fresh {
                self.finish_drains().await;
            }
        }
        // Any request of this round unanswered: the next round asks etcd
        // after the retry's delay; answered: at once when due. (The lease
        // stays kept meanwhile: its keeper has retries of its own.)
        if !held {
            if self.handle.etcd_problem().is_some() {
                let now = Instant::now();
                self.hold = Some(Hold {
                    until: now + self.retries.next_delay(),
                    since: now,
                    seen: self.stamp().map(|s| (s.generation, s.revision)),
                });
            } else {
                self.retries.reset();
                self.hold = None;
            }
        }
        let refreshed = self.keeper.fold(self.lease).map(|(_, at)| at);
        let mut s = self.handle.lock();
        s.rounds += 1;
        s.fenced = self
            .held
            .blocks
            .iter()
            .filter(|b| b.fenced.is_some())
            .count();
        s.refreshed_at(refreshed);
        s.serving = self
            .held
            .serving()
            .map(|b| (b.pool.clone(), b.cidr))
            .collect();
        // Nothing to claim for a wanted pool that has room: the ADD retries.
        drop(s);
        self.handle.changed.notify_waiters();
    }

    /// Runs rounds until `stop`: every second, and at once when an ADD
    /// waits for a block.
    pub fn spawn(
        mut self,
        slot: AgentSlot,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) -> tokio::task::JoinHandle<()> {
        let keeper = self.keeper_ends.take().map(|ends| {
            tokio::spawn(keeper::keep(
                ends,
                self.options(),
                self.cluster.lease_ttl,
                self.handle.clone(),
                stop.clone(),
            ))
        });
        tokio::spawn(async move {
            // Ends with the round's task: the keeper keeps nothing the
            // round no longer holds.
            let _keeper = keeper.map(AbortOnDrop);
            loop {
                self.round(&slot).await;
                let handle = self.handle.clone();
                tokio::select! {
                    _ = tokio::time::sleep(TICK) => {}
                    _ = handle.wake.notified() => {}
                    _ = stop.wait_for(|s| *s) => break,
                }
            }
        })
    }
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
