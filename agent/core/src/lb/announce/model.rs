//! A model of a cluster for the announcer's property tests: etcd (leases
//! that run out with its expiry check's lag, create-if-absent keys,
//! requests applied after a delay, answers lost), each node's kernel
//! datapath (entries with an expiry, answered whatever the agent does;
//! writes applied in sequence order, failing part-way or landing late),
//! each agent and faults: kills, stops, graceful stops, etcd cut off,
//! answers lost, links down, map writes failing or late.
//!
//! Each agent is the shipped tick: the core's [`Driver`], the code the
//! daemon's LB agent runs, here carried out against the simulated etcd and
//! datapath (one request at a time, each bounded by the driver's
//! timeouts), beside a renewer that rewrites the entries' expiry on its
//! own clock and a keeper that refreshes the LB lease on its own clock,
//! with a request of its own in flight beside the driver's.
//!
//! Time moves in steps of [`STEP`]; after every step the checker looks at
//! who answers each address. How long an address may stay silent is
//! derived from the protocol's constants ([`Bounds`]) and counted from the
//! moment the protocol owes an answer: the last holder of its key stopped
//! renewing its lease (or, still renewing, took the key or saw it go
//! dark), the key went, or a healthy node came back.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr};

use super::driver::{Done, Driver, DriverConfig, Io, Step};
use super::*;
use crate::lb::cluster::Candidate;

pub const MS: Nanos = 1_000_000;
pub const STEP: Nanos = 10 * MS;
/// The LB lease.
pub const TTL: Nanos = 3_000 * MS;
/// The bound on an etcd request (the daemon's).
pub const TIMEOUT: Nanos = 500 * MS;
/// The bound on a datapath write (the daemon's).
pub const WRITE_TIMEOUT: Nanos = 500 * MS;
/// The longest lag of etcd's expiry check behind a lease's TTL.
pub const LAG: Nanos = 500 * MS;
/// The longest a request to etcd takes to apply, and its answer to come
/// back, on a healthy link.
pub const RTT: Nanos = 80 * MS;
/// The longest a map write takes when the datapath is healthy.
pub const WRITE: Nanos = 20 * MS;

/// How long an address may stay silent, derived from the protocol's
/// constants for `nodes` candidates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    /// From the moment nobody holds the key until a healthy node answers:
    /// it reads at its next tick, waits its rank's steps (the worst rank
    /// is the last) counted from that read, takes at the tick after, and
    /// programs; each request a healthy round trip, a request of its own
    /// ahead of each (a refresh, a withdrawal).
    pub free: Nanos,
    /// From the moment a holder that keeps renewing its lease took the key
    /// or its address went dark, until it answers or has withdrawn the
    /// key: a rank step to give up, a tick to notice, every write in doubt
    /// expired (the lease's cap: TTL less the margin, counted from a
    /// refresh sent a third of the TTL earlier at most), a tick, and the
    /// withdrawal's slowest application (a lossy link's).
    pub hold: Nanos,
    /// From the last renewal etcd applied for a holder that stopped
    /// renewing, until its key is gone: the TTL and the expiry check's lag.
    pub expire: Nanos,
    /// From the moment a node became healthy until it can take: a tick, a
    /// grant, the membership, a read.
    pub join: Nanos,
}

impl Bounds {
    /// The bounds of the model's constants with `nodes` candidates.
    #[must_use]
    pub fn derive(nodes: usize) -> Self {
        let cfg = AnnouncerConfig::for_lease(TTL);
        let d = DriverConfig::for_lease(TTL);
        let ranks = (nodes as u64).saturating_sub(1);
        Self {
            free: 3 * d.tick_ns + ranks * cfg.step_ns + 4 * RTT + WRITE + 2 * STEP,
            hold: cfg.step_ns + 2 * d.tick_ns + (TTL - driver::margin(TTL)) + LOSSY_APPLY + TIMEOUT,
            expire: TTL + LAG,
            join: 2 * d.tick_ns + 4 * TIMEOUT,
        }
    }
}

/// The longest a lossy link delays a request's application.
const LOSSY_APPLY: Nanos = 700 * MS;

/// A small deterministic generator (splitmix64).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (0 when n is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// A fault on one node for a while.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// SIGKILL, restarted after the duration (the datapath lives on).
    Kill,
    /// SIGSTOP for the duration.
    Stop,
    /// SIGTERM (graceful), restarted after the duration.
    Term,
    /// etcd unreachable: requests not applied, answers lost.
    Partition,
    /// etcd's answers lost half the time (the requests applied, some late).
    Lossy,
    /// The uplink down: nothing answered, the lease not refreshed.
    LinkDown,
    /// Map writes fail half the time, or hang and land late.
    FlakyMaps,
    /// Every map write fails, nothing of it applied (the announcement map
    /// full).
    MapFull,
}

/// A fault: which node, when (ms), what, for how long (ms).
#[derive(Clone, Copy, Debug)]
pub struct Fault {
    pub node: usize,
    pub at_ms: u64,
    pub kind: FaultKind,
    pub for_ms: u64,
}

#[derive(Clone, Debug)]
enum Op {
    Grant,
    Join(i64, bool),
    Refresh(i64),
    Read,
    Take(Vec<IpAddr>, i64),
    Withdraw(IpAddr, KeyRef),
    Revoke(i64),
}

#[derive(Clone, Debug)]
enum Res {
    Granted(i64),
    Alive(bool),
    View(Observation),
    /// Takes: each key's create revision if it is the node's.
    Took(Vec<Option<i64>>),
    Done,
}

struct Pending {
    apply_at: Nanos,
    node: usize,
    /// The node's request number it answers.
    req: u64,
    op: Op,
    /// When the answer reaches the node (`None`: lost).
    reply_after: Option<Nanos>,
}

/// An etcd lease.
#[derive(Clone, Copy, Debug)]
struct LeaseRec {
    /// When it runs out (etcd's view), and the expiry check's lag.
    expires: Nanos,
    lag: Nanos,
    /// When a grant or refresh of it was last applied.
    renewed: Nanos,
}

/// An announcement key.
#[derive(Clone, Copy, Debug)]
struct KeyRec {
    node: usize,
    lease: i64,
    rev: i64,
    created: Nanos,
}

#[derive(Default)]
struct Etcd {
    leases: BTreeMap<i64, LeaseRec>,
    keys: BTreeMap<IpAddr, KeyRec>,
    /// When each address's key last went.
    freed: BTreeMap<IpAddr, Nanos>,
    /// node → (lease, answers).
    members: BTreeMap<usize, (i64, bool)>,
    next_lease: i64,
    revision: i64,
    pending: Vec<Pending>,
}

/// A node's kernel datapath: survives the agent.
#[derive(Clone, Debug, Default)]
struct Datapath {
    entries: BTreeMap<IpAddr, Nanos>,
    /// What the renewer writes: the last applied write.
    set: BTreeSet<IpAddr>,
    cap: Nanos,
    applied_seq: u64,
    /// Writes that hang and land at a time.
    late: Vec<(Nanos, u64, BTreeSet<IpAddr>, Nanos)>,
}

impl Datapath {
    /// Applies write `seq` (dropped if an equal or later one was applied);
    /// `partial`: only some of the change lands.
    fn apply(
        &mut self,
        now: Nanos,
        seq: u64,
        set: &BTreeSet<IpAddr>,
        cap: Nanos,
        partial: Option<&mut Rng>,
    ) {
        if seq <= self.applied_seq {
            return;
        }
        self.applied_seq = seq;
        self.set = set.clone();
        self.cap = cap;
        let expiry = (now + TTL).min(cap).max(1);
        match partial {
            None => {
                self.entries = set.iter().map(|a| (*a, expiry)).collect();
            }
            Some(rng) => {
                let all: BTreeSet<IpAddr> =
                    self.entries.keys().chain(set.iter()).copied().collect();
                for a in all {
                    if rng.chance(50) {
                        if set.contains(&a) {
                            self.entries.insert(a, expiry);
                        } else {
                            self.entries.remove(&a);
                        }
                    }
                }
            }
        }
    }

    /// A write that fails with nothing applied but removals (a full map
    /// refuses every insert; deletes still work).
    fn apply_removals(&mut self, now: Nanos, seq: u64, set: &BTreeSet<IpAddr>, cap: Nanos) {
        if seq <= self.applied_seq {
            return;
        }
        self.applied_seq = seq;
        self.cap = cap;
        self.entries.retain(|a, _| set.contains(a));
        self.set = self.live(now);
    }

    /// The addresses answered now, as a read back finds them: present,
    /// and not expired.
    fn live(&self, now: Nanos) -> BTreeSet<IpAddr> {
        self.entries
            .iter()
            .filter(|(_, e)| **e > now)
            .map(|(a, _)| *a)
            .collect()
    }

    fn renew(&mut self, now: Nanos) {
        let expiry = (now + TTL).min(self.cap).max(1);
        self.entries = self.set.iter().map(|a| (*a, expiry)).collect();
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Proc {
    Running,
    Stopped,
    Dead,
}

/// What the agent waits for.
enum Wait {
    Etcd { req: u64, deadline: Nanos, what: Op },
    Write { until: Nanos, outcome: Written },
}

/// The keeper's refresh in flight.
#[derive(Clone, Copy, Debug)]
struct Keeping {
    req: u64,
    deadline: Nanos,
    lease: i64,
    sent: Nanos,
}

/// How soon the keeper tries again after a refresh went unanswered (the
/// daemon's).
const KEEPER_RETRY: Nanos = 500 * MS;

struct Agent {
    driver: Driver,
    wait: Option<Wait>,
    /// The lease keeper's request in flight, beside the driver's.
    keeping: Option<Keeping>,
    /// No keeper refresh before this (one went unanswered).
    keep_retry: Nanos,
    /// Answers delivered to the agent: request → (at, result).
    inbox: BTreeMap<u64, (Nanos, Res)>,
    next_req: u64,
    next_renew: Nanos,
    stop_deadline: Option<Nanos>,
}

impl Agent {
    fn new(name: &str, now: Nanos) -> Self {
        // The daemon's timing, on the model's clock, with a keeper.
        let mut cfg = DriverConfig::kept(TTL);
        cfg.stop_poll_ns = 50 * MS;
        Self {
            driver: Driver::new(name, cfg),
            wait: None,
            keeping: None,
            keep_retry: 0,
            inbox: BTreeMap::new(),
            next_req: 1,
            next_renew: now + TTL / 3,
            stop_deadline: None,
        }
    }
}

struct Node {
    name: String,
    proc: Proc,
    agent: Agent,
    dp: Datapath,
    faults: Vec<(FaultKind, Nanos, Nanos)>,
}

/// What the checker saw.
#[derive(Debug, Default)]
pub struct Outcome {
    /// (time, address, nodes) where two nodes answered.
    pub doubles: Vec<(Nanos, IpAddr, Vec<usize>)>,
    /// (address, silent from, how far past its deadline) of silences
    /// longer than [`Bounds`] allow.
    pub long_silences: Vec<(IpAddr, Nanos, Nanos)>,
    /// Handovers: the answering node changed.
    pub moves: usize,
    /// Gratuitous ARPs sent while the entry was live, per address.
    pub announced: usize,
    /// Moves that changed the answering node back within `settle`.
    pub flaps: Vec<(IpAddr, Nanos)>,
    /// The longest silence seen (of an address to be announced).
    pub longest_silence: Nanos,
    /// Every silence that ended: (address, from, answered again at).
    pub silences: Vec<(IpAddr, Nanos, Nanos)>,
    /// LB lease refreshes the keepers sent.
    pub keeper_refreshes: usize,
    /// LB lease refreshes the drivers sent themselves (their keeper fell
    /// behind).
    pub driver_refreshes: usize,
}

/// The cluster under test.
pub struct World {
    pub now: Nanos,
    rng: Rng,
    etcd: Etcd,
    nodes: Vec<Node>,
    /// The addresses to announce now.
    addresses: BTreeMap<IpAddr, LabelSelector>,
    /// Every address, and the windows in which each is not to be announced
    /// (its service deleted, then applied again).
    all: BTreeMap<IpAddr, LabelSelector>,
    removals: Vec<(IpAddr, Nanos, Nanos)>,
    /// Per address: who answered last, since when it is silent.
    last: BTreeMap<IpAddr, (Option<usize>, Option<Nanos>)>,
    /// Per address: the answering nodes in order, with when each began.
    pub history: BTreeMap<IpAddr, Vec<(usize, Nanos)>>,
    pub outcome: Outcome,
    pub bounds: Bounds,
    healthy_since: Vec<Option<Nanos>>,
    /// Debugging: events about this address are printed.
    pub trace: Option<IpAddr>,
}

impl World {
    /// `nodes` nodes, `addrs` addresses, the faults, seeded.
    pub fn new(nodes: usize, addrs: usize, faults: &[Fault], seed: u64) -> Self {
        let addresses: BTreeMap<IpAddr, LabelSelector> = (0..addrs)
            .map(|i| {
                (
                    IpAddr::V4(Ipv4Addr::new(192, 0, 2, 10 + i as u8)),
                    LabelSelector::default(),
                )
            })
            .collect();
        let count = nodes;
        let nodes = (0..nodes)
            .map(|i| {
                let name = format!("node-{i}");
                Node {
                    agent: Agent::new(&name, 0),
                    name,
                    proc: Proc::Running,
                    dp: Datapath::default(),
                    faults: faults
                        .iter()
                        .filter(|f| f.node == i)
                        .map(|f| (f.kind, f.at_ms * MS, (f.at_ms + f.for_ms) * MS))
                        .collect(),
                }
            })
            .collect();
        Self {
            now: 0,
            rng: Rng::new(seed),
            etcd: Etcd {
                next_lease: 100,
                ..Etcd::default()
            },
            nodes,
            all: addresses.clone(),
            addresses,
            removals: Vec::new(),
            last: BTreeMap::new(),
            history: BTreeMap::new(),
            outcome: Outcome::default(),
            bounds: Bounds::derive(count),
            healthy_since: vec![Some(0); count],
            trace: None,
        }
    }

    /// Address number `i` is not announced from `at_ms` for `for_ms`.
    #[must_use]
    pub fn with_removals(mut self, removals: &[(usize, u64, u64)]) -> Self {
        let addrs: Vec<IpAddr> = self.all.keys().copied().collect();
        self.removals = removals
            .iter()
            .map(|(i, at, len)| (addrs[i % addrs.len()], at * MS, (at + len) * MS))
            .collect();
        self
    }

    fn fault(&self, n: usize, kind: FaultKind) -> bool {
        self.nodes[n]
            .faults
            .iter()
            .any(|(k, from, to)| *k == kind && (*from..*to).contains(&self.now))
    }

    /// Whether node `n` is a healthy candidate now: running, reaching
    /// etcd, its link up, its maps written.
    fn healthy(&self, n: usize) -> bool {
        self.nodes[n].proc == Proc::Running
            && self.nodes[n].agent.stop_deadline.is_none()
            && ![
                FaultKind::Partition,
                FaultKind::Lossy,
                FaultKind::LinkDown,
                FaultKind::FlakyMaps,
                FaultKind::MapFull,
                FaultKind::Kill,
                FaultKind::Stop,
                FaultKind::Term,
            ]
            .iter()
            .any(|k| self.fault(n, *k))
    }

    fn answering(&self, n: usize, a: IpAddr) -> bool {
        !self.fault(n, FaultKind::LinkDown)
            && self.nodes[n]
                .dp
                .entries
                .get(&a)
                .is_some_and(|e| *e > self.now)
    }

    /// Runs until `ms` milliseconds; `settle`: a move back to the node
    /// answering before the last one within it is a flap.
    pub fn run(&mut self, ms: u64, settle: Nanos) {
        let end = ms * MS;
        while self.now < end {
            self.now += STEP;
            let now = self.now;
            self.addresses = self
                .all
                .iter()
                .filter(|(a, _)| {
                    !self
                        .removals
                        .iter()
                        .any(|(x, from, to)| *x == **a && (*from..*to).contains(&now))
                })
                .map(|(a, s)| (*a, s.clone()))
                .collect();
            self.processes();
            self.etcd_step();
            for n in 0..self.nodes.len() {
                self.node_step(n);
            }
            for n in 0..self.nodes.len() {
                let ok = self.healthy(n);
                self.healthy_since[n] = match (ok, self.healthy_since[n]) {
                    (false, _) => None,
                    (true, Some(t)) => Some(t),
                    (true, None) => Some(self.now),
                };
            }
            self.check(settle);
        }
    }

    /// When the protocol owes an answer for `a`, dark since `dark`, given
    /// who holds its key now.
    fn owed_from(&self, a: IpAddr, dark: Nanos) -> Nanos {
        let b = self.bounds;
        let key_point = match self.etcd.keys.get(&a) {
            None => self.etcd.freed.get(&a).copied().unwrap_or(0),
            Some(k) => {
                let renewed = self.etcd.leases.get(&k.lease).map_or(0, |l| l.renewed);
                // A holder renews at least every third of the TTL (sent
                // late by a tick, answered or timed out within a request's
                // bound, applied within a lossy link's delay).
                let renewing = self.now
                    <= renewed
                        + TTL / 3
                        + 2 * DriverConfig::for_lease(TTL).tick_ns
                        + TIMEOUT
                        + LOSSY_APPLY;
                if renewing {
                    dark.max(k.created) + b.hold
                } else {
                    renewed + b.expire
                }
            }
        };
        key_point.max(dark)
    }

    fn check(&mut self, settle: Nanos) {
        let addrs: Vec<IpAddr> = self.all.keys().copied().collect();
        let earliest_healthy = self.healthy_since.iter().flatten().min().copied();
        for a in addrs {
            let who: Vec<usize> = (0..self.nodes.len())
                .filter(|n| self.answering(*n, a))
                .collect();
            if who.len() > 1 {
                if self.trace == Some(a) && self.outcome.doubles.is_empty() {
                    eprintln!(
                        "{} DOUBLE {a} {who:?} entries {:?}",
                        self.now / MS,
                        who.iter()
                            .map(|n| self.nodes[*n].dp.entries.get(&a))
                            .collect::<Vec<_>>()
                    );
                }
                self.outcome.doubles.push((self.now, a, who.clone()));
            }
            let (prev, silent) = self.last.get(&a).copied().unwrap_or((None, Some(0)));
            match who.first() {
                Some(&n) => {
                    if let Some(s) = silent {
                        self.outcome.longest_silence =
                            self.outcome.longest_silence.max(self.now - s);
                        self.outcome.silences.push((a, s, self.now));
                    }
                    if prev.is_some_and(|p| p != n) || (prev.is_none() && silent.is_some()) {
                        let h = self.history.entry(a).or_default();
                        if let Some(&(last, _)) = h.last()
                            && last != n
                        {
                            self.outcome.moves += 1;
                            // Back to the node answering before the last one,
                            // within `settle` of leaving it.
                            if h.len() >= 2 {
                                let (before, _) = h[h.len() - 2];
                                let (_, began) = h[h.len() - 1];
                                if before == n && self.now - began < settle {
                                    self.outcome.flaps.push((a, self.now));
                                }
                            }
                        }
                        if h.last().is_none_or(|(l, _)| *l != n) {
                            h.push((n, self.now));
                        }
                    }
                    self.last.insert(a, (Some(n), None));
                }
                // Not to be announced: silence counts from when it is again.
                None if !self.addresses.contains_key(&a) => {
                    self.last.insert(a, (prev, Some(self.now)));
                }
                None => {
                    let since = silent.unwrap_or(self.now);
                    self.last.insert(a, (prev, Some(since)));
                    self.outcome.longest_silence =
                        self.outcome.longest_silence.max(self.now - since);
                    if let Some(h) = earliest_healthy {
                        let owed =
                            self.owed_from(a, since).max(h + self.bounds.join) + self.bounds.free;
                        if self.now > owed
                            && !self
                                .outcome
                                .long_silences
                                .iter()
                                .any(|(x, s, _)| *x == a && *s == since)
                        {
                            self.outcome.long_silences.push((a, since, self.now - owed));
                        }
                    }
                }
            }
        }
    }

    /// Faults starting and ending: process states.
    fn processes(&mut self) {
        for n in 0..self.nodes.len() {
            let kill = self.fault(n, FaultKind::Kill);
            let stop = self.fault(n, FaultKind::Stop);
            let term = self.fault(n, FaultKind::Term);
            let node = &mut self.nodes[n];
            match node.proc {
                Proc::Running if kill => node.proc = Proc::Dead,
                Proc::Running if stop => node.proc = Proc::Stopped,
                Proc::Running if term && node.agent.stop_deadline.is_none() => {
                    node.agent.driver.stop();
                    node.agent.stop_deadline = Some(self.now + 2_000 * MS);
                }
                Proc::Running
                    if node
                        .agent
                        .stop_deadline
                        .is_some_and(|d| self.now >= d || node.agent.driver.stopped())
                        && node.agent.wait.is_none() =>
                {
                    node.proc = Proc::Dead;
                }
                Proc::Stopped if !stop => {
                    node.proc = Proc::Running;
                }
                Proc::Dead if !kill && !term => {
                    // A new agent: its start-up reconcile writes no cluster
                    // entry (it announces nothing yet).
                    node.proc = Proc::Running;
                    node.agent = Agent::new(&node.name, self.now);
                    node.dp.entries.clear();
                    node.dp.set.clear();
                    node.dp.cap = 0;
                    node.dp.applied_seq = 0;
                    node.dp.late.clear();
                }
                _ => {}
            }
        }
    }

    fn etcd_step(&mut self) {
        let now = self.now;
        // Leases run out: their keys go, after the expiry check's lag.
        let gone: Vec<i64> = self
            .etcd
            .leases
            .iter()
            .filter(|(_, l)| now >= l.expires + l.lag)
            .map(|(id, _)| *id)
            .collect();
        for l in gone {
            self.drop_lease(l);
        }
        let (due, rest): (Vec<Pending>, Vec<Pending>) = std::mem::take(&mut self.etcd.pending)
            .into_iter()
            .partition(|p| p.apply_at <= now);
        self.etcd.pending = rest;
        for p in due {
            let res = self.apply(&p);
            if let Some(t) = self.trace {
                let about = match &p.op {
                    Op::Take(a, _) => a.contains(&t),
                    Op::Withdraw(a, _) => *a == t,
                    _ => true,
                };
                if about {
                    eprintln!(
                        "{} etcd applies {:?} from node-{} -> {:?} (answer {})",
                        now / MS,
                        p.op,
                        p.node,
                        match &res {
                            Res::View(v) => format!("view holders {:?}", v.holders.get(&t)),
                            r => format!("{r:?}"),
                        },
                        p.reply_after.is_some()
                    );
                }
            }
            if let Some(after) = p.reply_after {
                self.nodes[p.node]
                    .agent
                    .inbox
                    .insert(p.req, (now + after, res));
            }
        }
    }

    fn drop_lease(&mut self, l: i64) {
        if self.trace.is_some() {
            eprintln!("{} etcd drops lease {l}", self.now / MS);
        }
        let now = self.now;
        self.etcd.leases.remove(&l);
        let freed = &mut self.etcd.freed;
        self.etcd.keys.retain(|a, k| {
            let keep = k.lease != l;
            if !keep {
                freed.insert(*a, now);
            }
            keep
        });
        self.etcd.members.retain(|_, (ml, _)| *ml != l);
    }

    fn lease_alive(&self, l: i64) -> bool {
        self.etcd
            .leases
            .get(&l)
            .is_some_and(|r| self.now < r.expires)
    }

    fn apply(&mut self, p: &Pending) -> Res {
        let now = self.now;
        match &p.op {
            Op::Grant => {
                let id = self.etcd.next_lease;
                self.etcd.next_lease += 1;
                let lag = self.rng.below(LAG / MS) * MS;
                self.etcd.leases.insert(
                    id,
                    LeaseRec {
                        expires: now + TTL,
                        lag,
                        renewed: now,
                    },
                );
                Res::Granted(id)
            }
            Op::Join(l, answers) => {
                if self.lease_alive(*l) {
                    self.etcd.members.insert(p.node, (*l, *answers));
                }
                Res::Done
            }
            Op::Refresh(l) => {
                if self.lease_alive(*l) {
                    let lag = self.rng.below(LAG / MS) * MS;
                    self.etcd.leases.insert(
                        *l,
                        LeaseRec {
                            expires: now + TTL,
                            lag,
                            renewed: now,
                        },
                    );
                    Res::Alive(true)
                } else {
                    Res::Alive(false)
                }
            }
            Op::Read => Res::View(Observation {
                addresses: self.addresses.clone(),
                members: self
                    .etcd
                    .members
                    .iter()
                    .filter(|(_, (l, _))| self.lease_alive(*l))
                    .map(|(n, (l, answers))| {
                        (
                            Candidate {
                                name: self.nodes[*n].name.clone(),
                                labels: BTreeMap::new(),
                                answers: *answers,
                            },
                            *l,
                        )
                    })
                    .collect(),
                holders: self
                    .etcd
                    .keys
                    .iter()
                    .filter(|(_, k)| self.lease_alive(k.lease))
                    .map(|(a, k)| {
                        (
                            *a,
                            Holder {
                                node: self.nodes[k.node].name.clone(),
                                lease: k.lease,
                            },
                        )
                    })
                    .collect(),
            }),
            Op::Take(addrs, l) => Res::Took(
                addrs
                    .iter()
                    .map(|a| self.take(p.node, *a, *l, now))
                    .collect(),
            ),
            Op::Withdraw(a, key) => {
                let named = self.etcd.keys.get(a).is_some_and(|k| {
                    k.node == p.node
                        && match key {
                            KeyRef::Created(r) => *r == k.rev,
                            KeyRef::Lease(x) => *x == k.lease,
                        }
                });
                if named {
                    self.etcd.keys.remove(a);
                    self.etcd.freed.insert(*a, now);
                }
                Res::Done
            }
            Op::Revoke(l) => {
                self.drop_lease(*l);
                Res::Done
            }
        }
    }

    fn take(&mut self, node: usize, a: IpAddr, l: i64, now: Nanos) -> Option<i64> {
        if !self.lease_alive(l) {
            return None;
        }
        match self.etcd.keys.get(&a) {
            None => {
                self.etcd.revision += 1;
                let rev = self.etcd.revision;
                self.etcd.keys.insert(
                    a,
                    KeyRec {
                        node,
                        lease: l,
                        rev,
                        created: now,
                    },
                );
                Some(rev)
            }
            Some(k) => (k.node == node && k.lease == l).then_some(k.rev),
        }
    }

    /// Sends `op` from node `n` (the agent waits for the answer).
    fn send(&mut self, n: usize, op: Op) {
        let deadline = self.now + TIMEOUT;
        let req = self.post(n, op.clone());
        self.nodes[n].agent.wait = Some(Wait::Etcd {
            req,
            deadline,
            what: op,
        });
    }

    /// Sends `op` from node `n` towards etcd; the request's number.
    fn post(&mut self, n: usize, op: Op) -> u64 {
        let now = self.now;
        let partitioned = self.fault(n, FaultKind::Partition);
        let lossy = self.fault(n, FaultKind::Lossy);
        let agent = &mut self.nodes[n].agent;
        let req = agent.next_req;
        agent.next_req += 1;
        if partitioned {
            return req;
        }
        let (to, back) = if lossy {
            (
                self.rng.below(LOSSY_APPLY / MS) * MS,
                self.rng.below(100) * MS,
            )
        } else {
            (
                self.rng.below(RTT / 2 / MS) * MS,
                self.rng.below(RTT / 2 / MS) * MS,
            )
        };
        let lost = lossy && self.rng.chance(50);
        self.etcd.pending.push(Pending {
            apply_at: now + to.max(1),
            node: n,
            req,
            op,
            reply_after: (!lost).then_some(back),
        });
        req
    }

    /// The LB lease's keeper: on its own clock, a refresh of the lease the
    /// driver holds every third of its TTL, whatever the driver waits for;
    /// an answer that it lives goes to the driver at once.
    fn keeper_step(&mut self, n: usize) {
        let now = self.now;
        if let Some(k) = self.nodes[n].agent.keeping.take() {
            let agent = &mut self.nodes[n].agent;
            match agent.inbox.get(&k.req).cloned() {
                Some((at, res)) if at <= now && at <= k.deadline => {
                    agent.inbox.remove(&k.req);
                    if matches!(res, Res::Alive(true)) {
                        agent.driver.keeper_refreshed(k.lease, k.sent);
                    } else {
                        // Gone: the driver's own refresh finds out.
                        agent.keep_retry = now + KEEPER_RETRY;
                    }
                }
                _ if now >= k.deadline => {
                    agent.inbox.remove(&k.req);
                    agent.keep_retry = now + KEEPER_RETRY;
                }
                _ => {
                    agent.keeping = Some(k);
                    return;
                }
            }
        }
        let Some(l) = self.nodes[n].agent.driver.kept_lease() else {
            return;
        };
        let due = (l.sent + l.ttl_ns / 3).max(self.nodes[n].agent.keep_retry);
        if now >= due {
            self.outcome.keeper_refreshes += 1;
            let req = self.post(n, Op::Refresh(l.id));
            self.nodes[n].agent.keeping = Some(Keeping {
                req,
                deadline: now + TIMEOUT,
                lease: l.id,
                sent: now,
            });
        }
    }

    fn node_step(&mut self, n: usize) {
        let now = self.now;
        // The kernel: late writes land (dropped if older than one applied).
        let late: Vec<_> = {
            let dp = &mut self.nodes[n].dp;
            let (due, rest): (Vec<_>, Vec<_>) = dp.late.drain(..).partition(|w| w.0 <= now);
            dp.late = rest;
            due
        };
        for (_, seq, set, cap) in late {
            self.nodes[n].dp.apply(now, seq, &set, cap, None);
        }
        if self.nodes[n].proc != Proc::Running {
            return;
        }
        // The renewer: on its own clock, never waiting for the glue.
        if now >= self.nodes[n].agent.next_renew {
            self.nodes[n].agent.next_renew = now + TTL / 3;
            self.nodes[n].dp.renew(now);
        }
        self.keeper_step(n);
        // The request in flight: answered, timed out, or still waited for.
        if let Some(w) = self.nodes[n].agent.wait.take() {
            let done = match w {
                Wait::Etcd {
                    req,
                    deadline,
                    what,
                } => {
                    let got = self.nodes[n].agent.inbox.get(&req).cloned();
                    match got {
                        Some((at, res)) if at <= now && at <= deadline => {
                            self.nodes[n].agent.inbox.remove(&req);
                            Some(answer(&what, Some(res)))
                        }
                        _ if now >= deadline => {
                            self.nodes[n].agent.inbox.remove(&req);
                            Some(answer(&what, None))
                        }
                        _ => {
                            self.nodes[n].agent.wait = Some(Wait::Etcd {
                                req,
                                deadline,
                                what,
                            });
                            None
                        }
                    }
                }
                Wait::Write { until, outcome } => {
                    if now < until {
                        self.nodes[n].agent.wait = Some(Wait::Write { until, outcome });
                        None
                    } else {
                        Some(Done::Programmed(outcome))
                    }
                }
            };
            match done {
                Some(d) => {
                    if self.trace.is_some() {
                        eprintln!("{} node-{n} done {d:?}", now / MS);
                    }
                    self.nodes[n].agent.driver.done(d, now);
                }
                None => return,
            }
        }
        // The driver's steps until a request is in flight or it waits.
        for _ in 0..256 {
            if self.nodes[n].agent.driver.tick_due(now) {
                let silent = self.fault(n, FaultKind::LinkDown);
                self.nodes[n].agent.driver.set_silent(silent);
            }
            match self.nodes[n].agent.driver.step(now) {
                Step::Wait(_) => return,
                Step::Announce(a) => {
                    if self.answering(n, a) {
                        self.outcome.announced += 1;
                    }
                }
                Step::Io(io) => {
                    if self.trace.is_some() {
                        eprintln!("{} node-{n} {io:?}", now / MS);
                    }
                    self.execute(n, io);
                    return;
                }
            }
        }
    }

    fn execute(&mut self, n: usize, io: Io) {
        let now = self.now;
        match io {
            Io::Program {
                seq,
                addresses,
                valid_until,
            } => {
                let outcome = if self.fault(n, FaultKind::MapFull) {
                    // The daemon reads the maps back after a failed write.
                    self.nodes[n]
                        .dp
                        .apply_removals(now, seq, &addresses, valid_until);
                    Written::Partly(self.nodes[n].dp.set.clone())
                } else {
                    let flaky = self.fault(n, FaultKind::FlakyMaps);
                    let roll = if flaky { self.rng.below(3) } else { 2 };
                    match roll {
                        0 => {
                            let mut rng = Rng::new(self.rng.next());
                            self.nodes[n].dp.apply(
                                now,
                                seq,
                                &addresses,
                                valid_until,
                                Some(&mut rng),
                            );
                            // Read back (the renewer then renews only
                            // what is there), or the read back failed too.
                            if self.rng.chance(50) {
                                let dp = &mut self.nodes[n].dp;
                                dp.set = dp.live(now);
                                Written::Partly(dp.set.clone())
                            } else {
                                Written::Failed
                            }
                        }
                        1 => {
                            let at = now + WRITE_TIMEOUT + self.rng.below(3_000) * MS;
                            self.nodes[n]
                                .dp
                                .late
                                .push((at, seq, addresses, valid_until));
                            Written::Lost
                        }
                        _ => {
                            self.nodes[n]
                                .dp
                                .apply(now, seq, &addresses, valid_until, None);
                            Written::Done
                        }
                    }
                };
                let took = self.rng.below(WRITE / MS) * MS;
                let until = now
                    + if outcome == Written::Lost {
                        WRITE_TIMEOUT
                    } else {
                        took
                    };
                self.nodes[n].agent.wait = Some(Wait::Write { until, outcome });
            }
            Io::Grant => self.send(n, Op::Grant),
            Io::Join { lease, answers } => self.send(n, Op::Join(lease, answers)),
            Io::Refresh(l) => {
                self.outcome.driver_refreshes += 1;
                self.send(n, Op::Refresh(l));
            }
            Io::Read => self.send(n, Op::Read),
            Io::Take { lease, addresses } => self.send(n, Op::Take(addresses, lease)),
            Io::Withdraw(a, key) => self.send(n, Op::Withdraw(a, key)),
            Io::Revoke(l) => self.send(n, Op::Revoke(l)),
        }
    }
}

/// etcd's answer (`None`: none in time) to `what`, as the driver takes it.
fn answer(what: &Op, res: Option<Res>) -> Done {
    match (what, res) {
        (Op::Grant, Some(Res::Granted(id))) => Done::Granted { id, ttl_ns: TTL },
        (Op::Refresh(_), Some(Res::Alive(alive))) => Done::Refreshed(alive),
        (Op::Join(..), Some(_)) => Done::Joined,
        (Op::Read, Some(Res::View(v))) => Done::Read(Some(v)),
        (Op::Take(addrs, _), r) => Done::Took(match r {
            Some(Res::Took(revs)) => revs
                .into_iter()
                .map(|r| r.map_or(Took::Other, Took::Mine))
                .collect(),
            _ => vec![Took::Lost; addrs.len()],
        }),
        (Op::Withdraw(..), r) => Done::Withdrew(if r.is_some() {
            Withdrew::Done
        } else {
            Withdrew::Lost
        }),
        (Op::Revoke(_), Some(_)) => Done::Revoked,
        _ => Done::Lost,
    }
}
