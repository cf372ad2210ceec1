//! A model of a cluster for the announcer's property tests: etcd (leases
//! that run out with its expiry check's lag, create-if-absent keys,
//! requests applied after a delay, answers lost), each node's kernel
//! datapath (entries with an expiry, answered whatever the agent does;
//! writes applied in sequence order, failing part-way or landing late),
//! each agent (the glue's tick: lease, read, the [`Announcer`]'s actions,
//! one request at a time with a timeout; a renewer that rewrites the
//! expiry on its own clock) and faults: kills, stops, graceful stops,
//! etcd cut off, answers lost, links down, map writes failing or late.
//!
//! Time moves in steps of [`STEP`]; after every step the checker looks at
//! who answers each address.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::{IpAddr, Ipv4Addr};

use super::*;
use crate::lb::cluster::Candidate;

pub const MS: Nanos = 1_000_000;
pub const STEP: Nanos = 10 * MS;
/// The LB lease.
pub const TTL: Nanos = 3_000 * MS;
/// The margin between the datapath's cap and the lease.
pub const MARGIN: Nanos = 300 * MS;
/// The glue's tick.
pub const TICK: Nanos = 200 * MS;
/// The bound on an etcd request.
pub const TIMEOUT: Nanos = 500 * MS;
/// The bound on a datapath write.
pub const WRITE_TIMEOUT: Nanos = 300 * MS;

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
    Join(i64),
    Refresh(i64),
    Read,
    Take(IpAddr, i64),
    Withdraw(IpAddr, KeyRef),
    Revoke(i64),
}

#[derive(Clone, Debug)]
enum Res {
    Granted(i64),
    Alive(bool),
    View(Observation),
    /// A take: the key's create revision if it is the node's.
    Took(Option<i64>),
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

#[derive(Default)]
struct Etcd {
    /// lease → (node, expires at (etcd's view), deletion lag).
    leases: BTreeMap<i64, (usize, Nanos, Nanos)>,
    /// address → (node, lease, create revision).
    keys: BTreeMap<IpAddr, (usize, i64, i64)>,
    members: BTreeMap<usize, i64>,
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
    Etcd {
        req: u64,
        sent: Nanos,
        deadline: Nanos,
        what: Op,
    },
    Write {
        seq: u64,
        until: Nanos,
        outcome: Written,
    },
}

struct Agent {
    machine: Announcer,
    /// The glue's lease: id and when its last refresh (or grant) was sent.
    lease: Option<(i64, Nanos)>,
    wait: Option<Wait>,
    /// Answers delivered to the agent: request → (at, result).
    inbox: BTreeMap<u64, (Nanos, Res)>,
    next_req: u64,
    queue: VecDeque<Action>,
    next_tick: Nanos,
    next_renew: Nanos,
    /// This tick still reads etcd after the lease step.
    read_due: bool,
    /// The membership is to be written (under the glue's lease).
    join_due: bool,
    stop_deadline: Option<Nanos>,
}

impl Agent {
    fn new(name: &str, now: Nanos) -> Self {
        Self {
            machine: Announcer::new(name, AnnouncerConfig::for_lease(TTL)),
            lease: None,
            wait: None,
            inbox: BTreeMap::new(),
            next_req: 1,
            queue: VecDeque::new(),
            next_tick: now,
            next_renew: now + TTL / 3,
            read_due: false,
            join_due: false,
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
    /// (address, silent from, silent for) of silences longer than the
    /// bound while a healthy node existed.
    pub long_silences: Vec<(IpAddr, Nanos, Nanos)>,
    /// Handovers: the answering node changed.
    pub moves: usize,
    /// Gratuitous ARPs sent while the entry was live, per address.
    pub announced: usize,
    /// Moves that changed the answering node back within `settle`.
    pub flaps: Vec<(IpAddr, Nanos)>,
    /// The longest silence seen.
    pub longest_silence: Nanos,
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

    /// Runs for `ms` milliseconds; `bound`: the longest silence allowed
    /// while a healthy node exists.
    pub fn run(&mut self, ms: u64, bound: Nanos, settle: Nanos) {
        let end = ms * MS;
        let mut healthy_since: Vec<Option<Nanos>> = vec![Some(0); self.nodes.len()];
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
            for (n, h) in healthy_since.iter_mut().enumerate() {
                let ok = self.healthy(n);
                *h = match (ok, *h) {
                    (false, _) => None,
                    (true, Some(t)) => Some(t),
                    (true, None) => Some(self.now),
                };
            }
            self.check(&healthy_since, bound, settle);
        }
    }

    fn check(&mut self, healthy_since: &[Option<Nanos>], bound: Nanos, settle: Nanos) {
        let addrs: Vec<IpAddr> = self.all.keys().copied().collect();
        let earliest_healthy = healthy_since.iter().flatten().min().copied();
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
                                let (before, left) = h[h.len() - 2];
                                let _ = left;
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
                    if let Some(h) = earliest_healthy {
                        let from = since.max(h);
                        if self.now - from > bound
                            && !self
                                .outcome
                                .long_silences
                                .iter()
                                .any(|(x, s, _)| *x == a && *s == since)
                        {
                            self.outcome.long_silences.push((a, since, self.now - from));
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
                    node.agent.machine.stop();
                    node.agent.stop_deadline = Some(self.now + 1_000 * MS);
                    node.agent.queue.clear();
                }
                Proc::Running
                    if node
                        .agent
                        .stop_deadline
                        .is_some_and(|d| self.now >= d || node.agent.machine.stopped())
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
            .filter(|(_, (_, exp, lag))| now >= exp + lag)
            .map(|(l, _)| *l)
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
                    Op::Take(a, _) | Op::Withdraw(a, _) => *a == t,
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
        self.etcd.leases.remove(&l);
        self.etcd.keys.retain(|_, (_, kl, _)| *kl != l);
        self.etcd.members.retain(|_, ml| *ml != l);
    }

    fn lease_alive(&self, l: i64) -> bool {
        self.etcd
            .leases
            .get(&l)
            .is_some_and(|(_, exp, _)| self.now < *exp)
    }

    fn apply(&mut self, p: &Pending) -> Res {
        let now = self.now;
        match &p.op {
            Op::Grant => {
                let id = self.etcd.next_lease;
                self.etcd.next_lease += 1;
                let lag = self.rng.below(500) * MS;
                self.etcd.leases.insert(id, (p.node, now + TTL, lag));
                Res::Granted(id)
            }
            Op::Join(l) => {
                if self.lease_alive(*l) {
                    self.etcd.members.insert(p.node, *l);
                }
                Res::Done
            }
            Op::Refresh(l) => {
                if self.lease_alive(*l) {
                    let lag = self.rng.below(500) * MS;
                    self.etcd.leases.insert(*l, (p.node, now + TTL, lag));
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
                    .filter(|(_, l)| self.lease_alive(**l))
                    .map(|(n, l)| {
                        (
                            Candidate {
                                name: self.nodes[*n].name.clone(),
                                labels: BTreeMap::new(),
                                answers: true,
                            },
                            *l,
                        )
                    })
                    .collect(),
                holders: self
                    .etcd
                    .keys
                    .iter()
                    .filter(|(_, (_, l, _))| self.lease_alive(*l))
                    .map(|(a, (n, l, _))| {
                        (
                            *a,
                            Holder {
                                node: self.nodes[*n].name.clone(),
                                lease: *l,
                            },
                        )
                    })
                    .collect(),
            }),
            Op::Take(a, l) => {
                if !self.lease_alive(*l) {
                    return Res::Took(None);
                }
                match self.etcd.keys.get(a) {
                    None => {
                        self.etcd.revision += 1;
                        let rev = self.etcd.revision;
                        self.etcd.keys.insert(*a, (p.node, *l, rev));
                        Res::Took(Some(rev))
                    }
                    Some((n, kl, rev)) => Res::Took((*n == p.node && kl == l).then_some(*rev)),
                }
            }
            Op::Withdraw(a, key) => {
                let named = self.etcd.keys.get(a).is_some_and(|(n, l, rev)| {
                    *n == p.node
                        && match key {
                            KeyRef::Created(r) => r == rev,
                            KeyRef::Lease(x) => x == l,
                        }
                });
                if named {
                    self.etcd.keys.remove(a);
                }
                Res::Done
            }
            Op::Revoke(l) => {
                self.drop_lease(*l);
                Res::Done
            }
        }
    }

    /// Sends `op` from node `n` (the agent waits for the answer).
    fn send(&mut self, n: usize, op: Op) {
        let now = self.now;
        let partitioned = self.fault(n, FaultKind::Partition);
        let lossy = self.fault(n, FaultKind::Lossy);
        let agent = &mut self.nodes[n].agent;
        let req = agent.next_req;
        agent.next_req += 1;
        agent.wait = Some(Wait::Etcd {
            req,
            sent: now,
            deadline: now + TIMEOUT,
            what: op.clone(),
        });
        if partitioned {
            return;
        }
        let (to, back) = if lossy {
            (self.rng.below(700) * MS, self.rng.below(100) * MS)
        } else {
            (self.rng.below(40) * MS, self.rng.below(40) * MS)
        };
        let lost = lossy && self.rng.chance(50);
        self.etcd.pending.push(Pending {
            apply_at: now + to.max(1),
            node: n,
            req,
            op,
            reply_after: (!lost).then_some(back),
        });
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
        // The glue: one request at a time.
        if let Some(w) = self.nodes[n].agent.wait.take() {
            match w {
                Wait::Etcd {
                    req,
                    sent,
                    deadline,
                    what,
                } => {
                    let got = self.nodes[n].agent.inbox.get(&req).cloned();
                    match got {
                        Some((at, res)) if at <= now && at <= deadline => {
                            self.nodes[n].agent.inbox.remove(&req);
                            self.etcd_answer(n, what, sent, Some(res));
                        }
                        _ if now >= deadline => {
                            self.nodes[n].agent.inbox.remove(&req);
                            self.etcd_answer(n, what, sent, None);
                        }
                        _ => {
                            self.nodes[n].agent.wait = Some(Wait::Etcd {
                                req,
                                sent,
                                deadline,
                                what,
                            });
                            return;
                        }
                    }
                }
                Wait::Write {
                    seq,
                    until,
                    outcome,
                } => {
                    if now < until {
                        self.nodes[n].agent.wait = Some(Wait::Write {
                            seq,
                            until,
                            outcome,
                        });
                        return;
                    }
                    let acts = self.nodes[n].agent.machine.programmed(seq, outcome, now);
                    self.nodes[n].agent.queue.extend(acts);
                    self.repoll(n);
                }
            }
        }
        if self.nodes[n].agent.wait.is_some() {
            return;
        }
        if let Some(act) = self.nodes[n].agent.queue.pop_front() {
            self.execute(n, act);
            return;
        }
        if self.nodes[n].agent.join_due
            && let Some((l, _)) = self.nodes[n].agent.lease
        {
            self.nodes[n].agent.join_due = false;
            self.send(n, Op::Join(l));
            return;
        }
        if self.nodes[n].agent.read_due {
            self.nodes[n].agent.read_due = false;
            self.send(n, Op::Read);
            return;
        }
        if self.nodes[n].agent.stop_deadline.is_some() {
            self.repoll(n);
            if let Some(act) = self.nodes[n].agent.queue.pop_front() {
                self.execute(n, act);
            }
            return;
        }
        if now < self.nodes[n].agent.next_tick {
            return;
        }
        self.nodes[n].agent.next_tick = now + TICK;
        // The uplink cannot answer: empty, revoke, hold nothing.
        let silent = self.fault(n, FaultKind::LinkDown);
        self.nodes[n].agent.machine.set_silent(silent);
        self.repoll(n);
        let agent = &mut self.nodes[n].agent;
        // The machine may have given the lease up (its cap passed).
        if agent.machine.lease().is_none() {
            agent.lease = None;
        }
        if !agent.queue.is_empty() {
            return;
        }
        agent.read_due = true;
        match agent.lease {
            None if agent.machine.wants_lease() => self.send(n, Op::Grant),
            None => {}
            Some((l, sent)) if now >= sent + TTL / 3 => self.send(n, Op::Refresh(l)),
            Some(_) => {}
        }
    }

    /// Polls the machine and queues what it says.
    fn repoll(&mut self, n: usize) {
        let now = self.now;
        let agent = &mut self.nodes[n].agent;
        let acts = agent.machine.poll(now);
        agent.queue.extend(acts);
    }

    fn execute(&mut self, n: usize, act: Action) {
        let now = self.now;
        if self.trace.is_some() {
            eprintln!("{} node-{n} executes {act:?}", now / MS);
        }
        match act {
            Action::Program {
                seq,
                addresses,
                valid_until,
            } => {
                let flaky = self.fault(n, FaultKind::FlakyMaps);
                let roll = if flaky { self.rng.below(3) } else { 2 };
                let took = self.rng.below(20) * MS;
                let outcome = match roll {
                    0 => {
                        let mut rng = Rng::new(self.rng.next());
                        self.nodes[n]
                            .dp
                            .apply(now, seq, &addresses, valid_until, Some(&mut rng));
                        Written::Failed
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
                };
                let until = now
                    + if outcome == Written::Lost {
                        WRITE_TIMEOUT
                    } else {
                        took
                    };
                self.nodes[n].agent.wait = Some(Wait::Write {
                    seq,
                    until,
                    outcome,
                });
            }
            Action::Take(a) => match self.nodes[n].agent.machine.lease() {
                Some(l) => self.send(n, Op::Take(a, l)),
                None => self.nodes[n].agent.machine.took(a, Took::Lost),
            },
            Action::Withdraw(a, key) => self.send(n, Op::Withdraw(a, key)),
            Action::Announce(a) => {
                if self.answering(n, a) {
                    self.outcome.announced += 1;
                }
            }
            Action::Revoke(l) => {
                self.nodes[n].agent.lease = None;
                self.send(n, Op::Revoke(l));
            }
        }
    }

    fn etcd_answer(&mut self, n: usize, what: Op, sent: Nanos, res: Option<Res>) {
        let now = self.now;
        let agent = &mut self.nodes[n].agent;
        match (what, res) {
            (Op::Grant, Some(Res::Granted(id))) => {
                // The cap counts from when the grant was sent.
                agent.lease = Some((id, sent));
                agent.machine.lease_granted(id, sent + TTL - MARGIN);
                agent.join_due = true;
            }
            (Op::Refresh(l), Some(Res::Alive(alive)))
                if agent.lease.is_some_and(|(x, _)| x == l) =>
            {
                if alive {
                    agent.lease = Some((l, sent));
                    agent.machine.lease_refreshed(sent + TTL - MARGIN);
                } else {
                    agent.lease = None;
                    agent.machine.lease_lost();
                }
            }
            (Op::Read, Some(Res::View(v))) => {
                agent.machine.observed(v, now);
                // Not a member under this lease (a join lost): join again.
                agent.join_due |= agent.machine.membership_missing();
            }
            (Op::Join(_), None) => agent.join_due = true,
            (Op::Take(a, _), r) => agent.machine.took(
                a,
                match r {
                    Some(Res::Took(Some(rev))) => Took::Mine(rev),
                    Some(_) => Took::Other,
                    None => Took::Lost,
                },
            ),
            (Op::Withdraw(a, _), r) => agent.machine.withdrew(
                a,
                if r.is_some() {
                    Withdrew::Done
                } else {
                    Withdrew::Lost
                },
                now,
            ),
            (Op::Revoke(_), Some(_)) => {
                agent.lease = None;
            }
            _ => {}
        }
        self.repoll(n);
    }
}
