//! The announcer of cluster mode (#27 items 1, 2 and 5): for each LB
//! address, whether this node answers ARP/NDP for it, and the order of the
//! steps that change it. A pure state machine: the daemon feeds it what
//! etcd and the datapath answered, with the time (kernel monotonic ns)
//! passed in, and carries out the [`Action`]s it returns.
//!
//! Why a state machine of its own: the safety of a handover is an order of
//! steps across two systems that fail independently (etcd, the BPF maps),
//! and every shortcut taken when one of them fails or answers late is a
//! window in which two nodes answer, or nobody does. Here the order is
//! written once and property-tested against a model with clocks, delays
//! and failures (`announce/model.rs`).
//!
//! The rules:
//! - **Take → program → announce.** An address is taken by creating its
//!   lease-bound etcd key only if absent ([`Action::Take`]); it goes into
//!   the datapath ([`Action::Program`]) only once etcd said the key is this
//!   node's; it is announced (gratuitous ARP / unsolicited NA,
//!   [`Action::Announce`]) only once the datapath confirmed the write.
//! - **Unprogram → withdraw.** An address given up leaves the datapath
//!   first; its key is withdrawn ([`Action::Withdraw`]) only when no write
//!   that could still make the datapath answer it is outstanding: every
//!   write since the last one the datapath confirmed (failed ones and ones
//!   whose answer never came included) excludes it, or all of them have
//!   expired. The daemon applies writes in sequence order and drops one
//!   older than a write already applied, so a late write never re-adds an
//!   address.
//! - **Finite expiry.** Every write carries `valid_until`, the time up to
//!   which etcd is sure to keep this node's keys (the lease's cap); none is
//!   ever "never expires". A lease lost empties the datapath.
//! - **Sticky.** An address stays with the node holding its key while
//!   that node keeps its lease and may announce it. An address nobody holds
//!   is taken by the best-ranked admitted candidate (rendezvous weight),
//!   the next one only after [`AnnouncerConfig::step_ns`] per rank, so a
//!   member that cannot take (partitioned, stopped, its lease not yet run
//!   out) does not keep it dark. A node returning takes only addresses
//!   nobody holds.
//! - **Rebalancing, one address at a time.** When every address is held
//!   and nothing moved for [`AnnouncerConfig::pace_ns`], the first address
//!   (in address order) whose holder is not its rendezvous choice is given
//!   up by its holder, if that choice has been a member under one lease for
//!   [`AnnouncerConfig::settle_ns`]; every node computes the same first
//!   address from the same read, so one moves at a time and each handover
//!   completes (the address is held again) before the next starts. The
//!   holder that gave it up takes it back for `pace_ns` only as the last
//!   rank, so a choice that cannot take it (cut off while its lease lives
//!   on) keeps it dark no longer than any other unheld address. A node
//!   that came back under a new lease (stopped or cut for longer than its
//!   lease) gets addresses back only after it stayed for `settle_ns`, so a
//!   node stopped around its lease never makes an address go and come back.
//! - **Give up what cannot be answered.** An address this node holds (or
//!   is taking) that is not confirmed answered within one rank step (its
//!   take unanswered, or every write of it failing: a full map, a datapath
//!   that keeps failing) is given up like any other, so the next candidate
//!   takes it a rank step later instead of the address staying dark for
//!   the whole failure. The node then refuses for `pace_ns` after the last
//!   such failure: it takes none of those addresses again, and it
//!   publishes that it does not answer ([`Announcer::answers`]; the
//!   driver joins again with it) so nobody ranks it. What it holds and
//!   answers for it keeps. Back to answering, it counts as a new member:
//!   rebalancing hands it an address only after `settle_ns`, so a node
//!   whose map stays full is tried again rarely, not on every pace.
//!
//! The whole tick around this machine (the lease kept, reads, the actions
//! carried out within a budget) is [`driver::Driver`], the one the daemon
//! runs and the model drives.

use std::cell::{RefCell, RefMut};
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use super::LabelSelector;
use super::cluster::Candidate;
use super::members::{Answering, Members};

/// Kernel monotonic time in nanoseconds (the clock `bpf_ktime_get_ns`
/// reads, so an expiry means the same to the datapath).
pub type Nanos = u64;

const SECOND: Nanos = 1_000_000_000;

/// The announcer's timing, derived from the LB lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AnnouncerConfig {
    /// How long an address nobody holds waits per rank before the
    /// candidate of that rank takes it (rank 0 at once).
    pub step_ns: Nanos,
    /// How long every address must have been held, with no holder
    /// changing, before a rebalancing move starts.
    pub pace_ns: Nanos,
    /// How long a node must have been a member under one lease before an
    /// address is moved to it by rebalancing.
    pub settle_ns: Nanos,
}

impl AnnouncerConfig {
    /// The timing for an LB lease of `ttl_ns`: a rank step of a third of
    /// it (at most 1 s), a pace of one lease, and a settle of ten leases.
    #[must_use]
    pub fn for_lease(ttl_ns: Nanos) -> Self {
        Self {
            step_ns: (ttl_ns / 3).min(SECOND),
            pace_ns: ttl_ns,
            settle_ns: ttl_ns.saturating_mul(10),
        }
    }
}

/// An announcement key as etcd holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    /// The node it names.
    pub node: String,
    /// The lease it is bound to.
    pub lease: i64,
}

/// One read of etcd, as the announcer needs it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Observation {
    /// The addresses to announce, each with its pool's node selector.
    pub addresses: BTreeMap<IpAddr, LabelSelector>,
    /// The members (candidate announcers), each with its membership's
    /// lease: a new lease is a new membership. Shared with the read it
    /// came from, not copied.
    pub members: Members,
    /// Who holds each announcement key.
    pub holders: BTreeMap<IpAddr, Holder>,
}

/// What etcd answered to a [`Action::Take`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Took {
    /// The key is this node's under the current lease (created now, or
    /// already); its create revision names this very key.
    Mine(i64),
    /// Another holder has the key.
    Other,
    /// No answer (timeout, connection lost): the request may have been
    /// applied, now or later.
    Lost,
}

/// What etcd answered to a [`Action::Withdraw`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Withdrew {
    /// The key named is gone (deleted now, or it was gone already).
    Done,
    /// No answer: the request may have been applied, now or later.
    Lost,
}

/// Which announcement key a withdrawal may delete: never a later key of
/// this node's for the same address (a withdrawal applied late, after the
/// address was taken again, must not delete the new key).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyRef {
    /// The key with this create revision (one this node took).
    Created(i64),
    /// Any key of this node's bound to this lease: a lease this node no
    /// longer takes anything under (given up, or before a restart).
    Lease(i64),
}

/// What the datapath answered to a [`Action::Program`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Written {
    /// The maps hold exactly the write's addresses (or a later write
    /// was applied already and this one was dropped: see [`Action::Program`]).
    Done,
    /// The write failed part-way (a full map refuses an insert), and the
    /// maps, read back, answer for exactly these of the node's cluster
    /// addresses; nothing adds the others on its own (the renewer renews
    /// only these). Taken as a confirmed write of this set: an address of
    /// the write missing from it is not answered (it is given up after a
    /// rank step), one given up that is missing from it may be withdrawn.
    Partly(BTreeSet<IpAddr>),
    /// The write failed part-way: the maps hold some mix of this write's
    /// addresses and the previous ones.
    Failed,
    /// No answer in time: the write may still be applied later.
    Lost,
}

/// A step for the daemon to carry out, then report with the matching
/// `Announcer` method.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Make the datapath answer for exactly `addresses` (this node's
    /// cluster announcements), never past `valid_until`. Writes must be
    /// applied in `seq` order: one older than a write already applied is
    /// dropped (and reported [`Written::Done`], as the newer one stands).
    /// Report with [`Announcer::programmed`].
    Program {
        /// The write's sequence number.
        seq: u64,
        /// The addresses to answer for.
        addresses: BTreeSet<IpAddr>,
        /// No entry is answered past this (kernel monotonic ns).
        valid_until: Nanos,
    },
    /// Create the address's key under the current lease if absent.
    /// Report with [`Announcer::took`].
    Take(IpAddr),
    /// Delete the address's key if it is this node's and the one named.
    /// Report with [`Announcer::withdrew`].
    Withdraw(IpAddr, KeyRef),
    /// Send a gratuitous ARP / unsolicited NA for the address (it is in
    /// the datapath now, answered until the write's `valid_until`).
    Announce(IpAddr),
    /// Revoke this lease (stopping, or the uplink cannot answer): the
    /// datapath answers for nothing now. The announcer holds no lease
    /// after it.
    Revoke(i64),
}

/// An address this node is doing something about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// A take under `lease` is to be sent again (`asked`: sent, no answer
    /// yet).
    Taking { asked: bool, lease: i64 },
    /// The key (this create revision) is this node's: in the datapath.
    Held(i64),
    /// Given up: out of the datapath; the key withdrawn once nothing
    /// outstanding may make it answer.
    Releasing(KeyRef),
    /// The withdrawal is sent.
    Withdrawing(KeyRef),
}

impl Phase {
    /// What a give-up withdraws, for a phase that holds or may hold a key.
    fn released(self) -> Self {
        match self {
            Phase::Held(rev) => Phase::Releasing(KeyRef::Created(rev)),
            Phase::Taking { lease, .. } => Phase::Releasing(KeyRef::Lease(lease)),
            other => other,
        }
    }
}

/// One datapath write.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Write {
    set: BTreeSet<IpAddr>,
    valid_until: Nanos,
    /// Issued, answer not yet reported.
    pending: bool,
    /// Failed or unanswered: to be written again.
    retry: bool,
}

/// The announcer of one node.
#[derive(Clone, Debug)]
pub struct Announcer {
    me: String,
    cfg: AnnouncerConfig,
    /// The current LB lease and the cap it gives (kernel monotonic ns).
    lease: Option<(i64, Nanos)>,
    stopping: bool,
    /// The uplink cannot answer: hold nothing until it can.
    silent: bool,
    revoked: bool,
    phases: BTreeMap<IpAddr, Phase>,
    next_seq: u64,
    /// The last write the datapath confirmed.
    confirmed: Option<(u64, Write)>,
    /// Writes issued after it (pending, failed or unanswered): any of them
    /// may be what the datapath holds.
    outstanding: BTreeMap<u64, Write>,
    /// The last read, with what this node learned since (its takes and
    /// withdrawals answered). Shared with `decide`, never cloned whole.
    view: Option<Arc<Observation>>,
    /// Counts changes of `view`: what `derived` holds is of one.
    view_gen: u64,
    /// What is derived from the view, computed once per view and only
    /// when asked, so a tick costs the same whatever the member count.
    derived: RefCell<Derived>,
    /// Each address's ranking for this node, kept from read to read by
    /// the memberships that changed (`standing`).
    standings: Standings,
    /// When each address was first seen held by nobody (reset when held).
    unheld_since: BTreeMap<IpAddr, Nanos>,
    /// When each membership (node, lease) was first seen answering (one
    /// that stops answering for a while is new when it answers again).
    member_since: BTreeMap<(String, i64), Nanos>,
    /// Since when every address has been held and no holder changed.
    quiet_since: Option<Nanos>,
    /// Addresses this node gave up to rebalance: for `pace_ns` it takes
    /// them back only as the last rank.
    gave_away: BTreeMap<IpAddr, Nanos>,
    /// Addresses a take was refused for since the last read (another
    /// holder has them though the read did not show it).
    refused: BTreeSet<IpAddr>,
    /// Since when each address held or being taken has not been confirmed
    /// answered (in the last confirmed write, no write in doubt after it).
    unconfirmed_since: BTreeMap<IpAddr, Nanos>,
    /// Addresses given up because they could not be answered here, with
    /// when: not taken again, and the node publishes that it does not
    /// answer, for `pace_ns` after.
    cannot_answer: BTreeMap<IpAddr, Nanos>,
}

impl Announcer {
    /// The announcer of node `me`.
    #[must_use]
    pub fn new(me: impl Into<String>, cfg: AnnouncerConfig) -> Self {
        Self {
            me: me.into(),
            cfg,
            lease: None,
            stopping: false,
            silent: false,
            revoked: false,
            phases: BTreeMap::new(),
            next_seq: 1,
            confirmed: None,
            outstanding: BTreeMap::new(),
            view: None,
            view_gen: 0,
            derived: RefCell::new(Derived::default()),
            standings: Standings::default(),
            unheld_since: BTreeMap::new(),
            member_since: BTreeMap::new(),
            quiet_since: None,
            gave_away: BTreeMap::new(),
            refused: BTreeSet::new(),
            unconfirmed_since: BTreeMap::new(),
            cannot_answer: BTreeMap::new(),
        }
    }

    /// The addresses whose keys this node holds (taken, not given up).
    #[must_use]
    pub fn held(&self) -> BTreeSet<IpAddr> {
        self.phases
            .iter()
            .filter(|(_, p)| matches!(p, Phase::Held(_)))
            .map(|(a, _)| *a)
            .collect()
    }

    /// Whether this node is to be published as able to answer: not while
    /// an address was given up here for not being answered within a rank
    /// step, until `pace_ns` after the last one (so no node hands it an
    /// address it would fail on again, by rank or by rebalancing).
    #[must_use]
    pub fn answers(&self) -> bool {
        self.cannot_answer.is_empty()
    }

    /// The addresses given up because they could not be answered here
    /// (for status and logs).
    #[must_use]
    pub fn cannot_answer(&self) -> BTreeSet<IpAddr> {
        self.cannot_answer.keys().copied().collect()
    }

    /// The addresses the datapath may answer for now: in the confirmed
    /// write or any outstanding one, and not expired.
    #[must_use]
    pub fn maybe_answering(&self, now: Nanos) -> BTreeSet<IpAddr> {
        self.writes_in_doubt()
            .filter(|w| now < w.valid_until)
            .flat_map(|w| w.set.iter().copied())
            .collect()
    }

    fn writes_in_doubt(&self) -> impl Iterator<Item = &Write> {
        self.confirmed
            .iter()
            .map(|(_, w)| w)
            .chain(self.outstanding.values())
    }

    fn may_answer(&self, a: IpAddr, now: Nanos) -> bool {
        self.writes_in_doubt()
            .any(|w| now < w.valid_until && w.set.contains(&a))
    }

    /// A lease was granted (`id`), valid in the datapath until
    /// `valid_until`. Nothing held under an earlier lease is held now; keys
    /// of one given up (its cap passed) are still withdrawn.
    pub fn lease_granted(&mut self, id: i64, valid_until: Nanos) {
        // Keys of a lease given up while etcd may keep it are still to be
        // withdrawn.
        self.phases
            .retain(|_, p| matches!(p, Phase::Releasing(_) | Phase::Withdrawing(_)));
        self.lease = Some((id, valid_until));
    }

    /// The lease was refreshed: the datapath may answer until `valid_until`.
    pub fn lease_refreshed(&mut self, valid_until: Nanos) {
        if let Some((_, v)) = self.lease.as_mut() {
            *v = (*v).max(valid_until);
        }
    }

    /// The lease is gone (etcd says so): every key of this node went with
    /// it; the datapath is emptied.
    pub fn lease_lost(&mut self) {
        self.lease = None;
        self.phases.clear();
    }

    /// The current lease, if any.
    #[must_use]
    pub fn lease(&self) -> Option<i64> {
        self.lease.map(|(id, _)| id)
    }

    /// The current lease's cap: no entry is answered past it.
    #[must_use]
    pub fn valid_until(&self) -> Option<Nanos> {
        self.lease.map(|(_, v)| v)
    }

    /// Whether the last read shows no membership of this node under its
    /// current lease (a join whose answer was lost, or one overwritten):
    /// the daemon writes it again, or the node is nobody's candidate.
    #[must_use]
    pub fn membership_missing(&self) -> bool {
        match (&self.view, self.lease) {
            (Some(v), Some((lease, _))) => !v.members.contains(&self.me, lease),
            _ => false,
        }
    }

    /// The agent stops: the datapath is emptied, then the lease revoked
    /// ([`Action::Revoke`], only once the empty write is confirmed).
    pub fn stop(&mut self) {
        self.stopping = true;
    }

    /// Whether stopping is finished (the lease revoked, or none held).
    #[must_use]
    pub fn stopped(&self) -> bool {
        self.stopping && (self.revoked || self.lease.is_none())
    }

    /// Whether the uplink can answer. While it cannot (down, without
    /// carrier, gone), the node holds nothing: the datapath is emptied and
    /// then the lease revoked, so the addresses move within a tick rather
    /// than a lease, and no lease is to be granted until it answers again.
    pub fn set_silent(&mut self, silent: bool) {
        if self.silent && !silent {
            self.revoked = false;
        }
        self.silent = silent;
    }

    /// Whether the daemon should hold a lease: not while stopping or
    /// silent.
    #[must_use]
    pub fn wants_lease(&self) -> bool {
        !self.stopping && !self.silent
    }

    fn quitting(&self) -> bool {
        self.stopping || self.silent
    }

    /// A read of etcd at `now`.
    pub fn observed(&mut self, view: Observation, now: Nanos) {
        match &self.view {
            // What changed since the last read: the two reads share all
            // the members that did not change, and those are not visited.
            Some(old) => {
                for c in old.members.answering_changes(&view.members) {
                    match c {
                        Answering::Came(n, l) => {
                            self.member_since.entry((n, l)).or_insert(now);
                        }
                        Answering::Went(n, l) => {
                            self.member_since.remove(&(n, l));
                        }
                    }
                }
            }
            None => {
                self.member_since = view
                    .members
                    .iter()
                    .filter(|(c, _)| c.answers)
                    .map(|(c, l)| ((c.name.clone(), l), now))
                    .collect();
            }
        }
        for a in view.addresses.keys() {
            if view.holders.contains_key(a) {
                self.unheld_since.remove(a);
            } else {
                self.unheld_since.entry(*a).or_insert(now);
            }
        }
        self.unheld_since
            .retain(|a, _| view.addresses.contains_key(a) && !view.holders.contains_key(a));
        let admitted_somewhere = |a: &IpAddr, s: &LabelSelector| {
            view.members.iter().any(|(c, _)| rank::admits(c, s)) || view.holders.contains_key(a)
        };
        let quiet = view
            .addresses
            .iter()
            .filter(|(a, s)| admitted_somewhere(a, s))
            .all(|(a, _)| view.holders.contains_key(a));
        let same = self.view.as_ref().is_some_and(|old| {
            old.holders.len() == view.holders.len()
                && old
                    .holders
                    .iter()
                    .all(|(a, h)| view.holders.get(a).is_some_and(|n| n.node == h.node))
        });
        self.quiet_since = match (quiet, same, self.quiet_since) {
            (false, _, _) => None,
            (true, true, Some(t)) => Some(t),
            (true, _, _) => Some(now),
        };
        self.standings.update(self.view.as_deref(), &view, &self.me);
        self.view = Some(Arc::new(view));
        self.view_gen += 1;
        self.refused.clear();
    }

    /// The datapath's answer to write `seq`.
    pub fn programmed(&mut self, seq: u64, written: Written, now: Nanos) -> Vec<Action> {
        let Some(mut w) = self.outstanding.remove(&seq) else {
            return Vec::new();
        };
        w.pending = false;
        match written {
            Written::Done | Written::Partly(_) => {
                if let Written::Partly(held) = written {
                    // What the datapath answers, read back; the held set
                    // differs, so the next write is due.
                    w.set = held;
                }
                let before: BTreeSet<IpAddr> = self
                    .confirmed
                    .as_ref()
                    .filter(|(_, c)| now < c.valid_until)
                    .map(|(_, c)| c.set.clone())
                    .unwrap_or_default();
                // Writes older than this one can no longer be applied.
                self.outstanding.retain(|s, _| *s > seq);
                let new: Vec<IpAddr> = w.set.difference(&before).copied().collect();
                let live = now < w.valid_until;
                self.confirmed = Some((seq, w));
                if live {
                    new.into_iter().map(Action::Announce).collect()
                } else {
                    Vec::new()
                }
            }
            Written::Failed | Written::Lost => {
                w.retry = true;
                self.outstanding.insert(seq, w);
                Vec::new()
            }
        }
    }

    /// etcd's answer to [`Action::Take`] of `a`.
    pub fn took(&mut self, a: IpAddr, answer: Took) {
        let Some(Phase::Taking { lease, .. }) = self.phases.get(&a).copied() else {
            return;
        };
        match answer {
            Took::Mine(rev) => {
                self.phases.insert(a, Phase::Held(rev));
                // The last read is older than this answer.
                if let Some(view) = self.view.as_mut() {
                    let me = self.me.clone();
                    Arc::make_mut(view)
                        .holders
                        .insert(a, Holder { node: me, lease });
                    self.view_gen += 1;
                    self.unheld_since.remove(&a);
                }
            }
            Took::Other => {
                self.phases.remove(&a);
                self.refused.insert(a);
            }
            // The key may be this node's: asked again (the answer names
            // the key), even if no longer wanted, so that a withdrawal
            // can name it.
            Took::Lost => {
                self.phases.insert(
                    a,
                    Phase::Taking {
                        asked: false,
                        lease,
                    },
                );
            }
        }
    }

    /// etcd's answer to [`Action::Withdraw`] of `a`.
    pub fn withdrew(&mut self, a: IpAddr, answer: Withdrew, now: Nanos) {
        let Some(Phase::Withdrawing(key)) = self.phases.get(&a).copied() else {
            return;
        };
        match answer {
            Withdrew::Done => {
                self.phases.remove(&a);
                // The last read is older than this answer: it must not
                // make the key look like this node's still.
                if let Some(view) = self.view.as_mut()
                    && view.holders.get(&a).is_some_and(|h| h.node == self.me)
                {
                    let view = Arc::make_mut(view);
                    view.holders.remove(&a);
                    self.view_gen += 1;
                    if view.addresses.contains_key(&a) {
                        self.unheld_since.entry(a).or_insert(now);
                    }
                }
            }
            Withdrew::Lost => {
                self.phases.insert(a, Phase::Releasing(key));
            }
        }
    }

    /// Whether `me` may announce `a` per the last read: `a` is to be
    /// announced and this node is a member its pool's selector admits.
    fn admitted(&self, a: IpAddr) -> bool {
        let Some(view) = &self.view else {
            return false;
        };
        let Some(sel) = view.addresses.get(&a) else {
            return false;
        };
        // While refusing, this node publishes that it does not answer;
        // what it holds and answers for it keeps all the same.
        let refusing = !self.answers();
        let mut d = self.derived();
        let me = &self.me;
        let mine = d
            .mine
            .get_or_insert_with(|| view.members.of(me).map(|(c, l)| (c.clone(), l)).collect());
        mine.iter().any(|(c, _)| {
            rank::admits(c, sel) || (refusing && (sel.is_empty() || sel.matches(&c.labels)))
        })
    }

    /// What is derived from the current view (emptied when it changed).
    fn derived(&self) -> RefMut<'_, Derived> {
        let mut d = self.derived.borrow_mut();
        if d.of != self.view_gen {
            *d = Derived {
                of: self.view_gen,
                ..Derived::default()
            };
        }
        d
    }

    /// This node's place in `a`'s ranking and the ranking's length, as
    /// kept from read to read ([`Standings`]).
    fn my_rank(&self, a: IpAddr) -> Option<(usize, usize)> {
        self.standings.place(a)
    }

    /// [`Announcer::first_misplaced`] of the current view, with the
    /// leases of the choice's memberships (computed once per view).
    fn misplaced(&self, view: &Observation) -> Option<Misplaced> {
        self.derived()
            .misplaced
            .get_or_insert_with(|| {
                Self::first_misplaced(view, &self.standings).map(|(a, holder, top)| Misplaced {
                    address: a,
                    holder: holder.to_owned(),
                    top_leases: view.members.of(top).map(|(_, l)| l).collect(),
                    top: top.to_owned(),
                })
            })
            .clone()
    }

    /// The first address (in address order) held by an admitted member
    /// that is not its rendezvous choice, with that choice.
    fn first_misplaced<'v>(
        view: &'v Observation,
        standings: &'v Standings,
    ) -> Option<(IpAddr, &'v str, &'v str)> {
        view.addresses.iter().find_map(|(a, sel)| {
            let h = view.holders.get(a)?;
            let top = standings.top(*a)?;
            (top != h.node && rank::is_admitted(&view.members, &h.node, sel)).then_some((
                *a,
                h.node.as_str(),
                top,
            ))
        })
    }

    /// Whether this node should start a rebalancing move of `a` now;
    /// `misplaced` is [`Announcer::first_misplaced`] of the last read
    /// (made once per [`Announcer::decide`]: it looks at every address,
    /// and `decide` asks for each one held).
    fn rebalance(&self, a: IpAddr, now: Nanos, misplaced: Option<&Misplaced>) -> bool {
        let Some(m) = misplaced else {
            return false;
        };
        if m.address != a || m.holder != self.me {
            return false;
        }
        let settled = m.top_leases.iter().any(|l| {
            self.member_since
                .get(&(m.top.clone(), *l))
                .is_some_and(|t| now >= t.saturating_add(self.cfg.settle_ns))
        });
        let quiet = self
            .quiet_since
            .is_some_and(|t| now >= t.saturating_add(self.cfg.pace_ns));
        settled && quiet
    }

    /// Whether this node takes `a`, held by nobody per the last read.
    fn takes_unheld(&self, a: IpAddr, now: Nanos) -> bool {
        let Some(view) = &self.view else {
            return false;
        };
        if !view.addresses.contains_key(&a) {
            return false;
        }
        if view.holders.contains_key(&a)
            || self.refused.contains(&a)
            || self.cannot_answer.contains_key(&a)
        {
            return false;
        }
        let Some((mut r, len)) = self.my_rank(a) else {
            return false;
        };
        // Given away to rebalance: the giver ranks last, so the choice it
        // was given to (and anyone between) goes first, yet a choice that
        // cannot take it (cut off with its lease still alive) keeps it
        // dark no longer than the last rank would.
        if self
            .gave_away
            .get(&a)
            .is_some_and(|t| now < t.saturating_add(self.cfg.pace_ns))
        {
            r = r.max(len - 1);
        }
        let since = self.unheld_since.get(&a).copied().unwrap_or(now);
        now >= since.saturating_add(self.cfg.step_ns.saturating_mul(r as u64))
    }

    /// The steps to take now. Call after every report and on every tick;
    /// each returned action is to be carried out and reported.
    pub fn poll(&mut self, now: Nanos) -> Vec<Action> {
        let mut out = Vec::new();
        // A cap passed: the entries are dead and every refresh since went
        // unanswered. Keeping the lease would keep the keys (etcd may have
        // renewed it) with nobody answering: it is given up, and the
        // daemon grants a new one.
        // Its keys may live on (etcd may have renewed it): they are
        // withdrawn once nothing may answer them.
        if self.lease.is_some_and(|(_, cap)| now >= cap) {
            self.lease = None;
            for p in self.phases.values_mut() {
                *p = p.released();
            }
        }
        self.gave_away
            .retain(|_, t| now < t.saturating_add(self.cfg.pace_ns));
        self.cannot_answer
            .retain(|_, t| now < t.saturating_add(self.cfg.pace_ns));
        self.track_unconfirmed(now);
        if self.quitting() {
            // Nothing is held: a stop (or a silent uplink) empties the
            // datapath before the lease is revoked.
            for p in self.phases.values_mut() {
                if matches!(p, Phase::Held(_)) {
                    *p = p.released();
                }
            }
        }
        self.decide(now, &mut out);
        // Give up what is to be given up, then write.
        let releasing: Vec<(IpAddr, KeyRef)> = self
            .phases
            .iter()
            .filter_map(|(a, p)| match p {
                Phase::Releasing(k) => Some((*a, *k)),
                _ => None,
            })
            .collect();
        if let Some(w) = self.write(now) {
            out.push(w);
        }
        // With a lease, quitting revokes it instead (every key at once).
        if !(self.quitting() && self.lease.is_some()) {
            for (a, key) in releasing {
                if !self.may_answer(a, now) {
                    self.phases.insert(a, Phase::Withdrawing(key));
                    out.push(Action::Withdraw(a, key));
                }
            }
        }
        if self.quitting()
            && !self.revoked
            && let Some((lease, _)) = self.lease
            && self.maybe_answering(now).is_empty()
            && self.outstanding.is_empty()
        {
            self.revoked = true;
            self.lease = None;
            self.phases.clear();
            out.push(Action::Revoke(lease));
        }
        out
    }

    /// The per-address decisions from the last read. Nothing is taken
    /// without a lease or while quitting; a key of this node's it does not
    /// hold (an older lease's) is withdrawn either way.
    fn decide(&mut self, now: Nanos, out: &mut Vec<Action>) {
        let lease = self.lease.map(|(id, _)| id).filter(|_| !self.quitting());
        let Some(view) = self.view.clone() else {
            return;
        };
        // The first misplaced address of this read, looked up at most once.
        let mut misplaced: Option<Option<Misplaced>> = None;
        let mut all: BTreeSet<IpAddr> = self.phases.keys().copied().collect();
        all.extend(view.addresses.keys().copied());
        all.extend(
            view.holders
                .iter()
                .filter(|(_, h)| h.node == self.me)
                .map(|(a, _)| *a),
        );
        for a in all {
            let admitted = self.admitted(a);
            match self.phases.get(&a).copied() {
                None => match view.holders.get(&a) {
                    // A key of this node's it does not know of: one under
                    // this lease is claimed by a take (the answer names the
                    // key; released after if not wanted), one under another
                    // lease is withdrawn (nothing is taken under it again).
                    Some(h) if h.node == self.me => {
                        if Some(h.lease) == lease {
                            self.phases.insert(
                                a,
                                Phase::Taking {
                                    asked: true,
                                    lease: h.lease,
                                },
                            );
                            out.push(Action::Take(a));
                        } else {
                            self.phases
                                .insert(a, Phase::Releasing(KeyRef::Lease(h.lease)));
                        }
                    }
                    Some(_) => {}
                    None => {
                        if let Some(l) = lease
                            && admitted
                            && self.takes_unheld(a, now)
                        {
                            self.phases.insert(
                                a,
                                Phase::Taking {
                                    asked: true,
                                    lease: l,
                                },
                            );
                            out.push(Action::Take(a));
                        }
                    }
                },
                // A take whose answer was lost: asked again under the same
                // lease (the answer names the key, wanted or not); under a
                // lease given up, withdrawn by that lease.
                Some(Phase::Taking {
                    asked: false,
                    lease: l,
                }) => {
                    if lease == Some(l) {
                        self.phases.insert(
                            a,
                            Phase::Taking {
                                asked: true,
                                lease: l,
                            },
                        );
                        out.push(Action::Take(a));
                    } else {
                        self.phases.insert(a, Phase::Releasing(KeyRef::Lease(l)));
                    }
                }
                Some(Phase::Held(rev)) if self.unanswered(a, now) => {
                    self.give_up_unanswered(a, KeyRef::Created(rev), now);
                }
                Some(Phase::Taking { lease: l, .. })
                    if lease == Some(l) && self.unanswered(a, now) =>
                {
                    self.give_up_unanswered(a, KeyRef::Lease(l), now);
                }
                Some(Phase::Held(rev)) => {
                    if lease.is_none() || !admitted {
                        self.phases
                            .insert(a, Phase::Releasing(KeyRef::Created(rev)));
                    } else if self.rebalance(
                        a,
                        now,
                        misplaced
                            .get_or_insert_with(|| self.misplaced(&view))
                            .as_ref(),
                    ) {
                        self.phases
                            .insert(a, Phase::Releasing(KeyRef::Created(rev)));
                        self.gave_away.insert(a, now);
                        // Not quiet until the move is complete.
                        self.quiet_since = None;
                    }
                }
                Some(
                    Phase::Taking { asked: true, .. } | Phase::Releasing(_) | Phase::Withdrawing(_),
                ) => {}
            }
        }
    }

    /// Starts or clears each held (or being taken) address's clock of not
    /// being confirmed answered: confirmed is in the last confirmed write,
    /// that write still live, and no write in doubt after it.
    fn track_unconfirmed(&mut self, now: Nanos) {
        let settled = self.outstanding.is_empty();
        let answered: BTreeSet<IpAddr> = match &self.confirmed {
            Some((_, w)) if settled && now < w.valid_until => w.set.clone(),
            _ => BTreeSet::new(),
        };
        let mut watched = BTreeMap::new();
        for (a, p) in &self.phases {
            if matches!(p, Phase::Held(_) | Phase::Taking { .. }) && !answered.contains(a) {
                let since = self.unconfirmed_since.get(a).copied().unwrap_or(now);
                watched.insert(*a, since);
            }
        }
        self.unconfirmed_since = watched;
    }

    /// Whether `a` has gone unconfirmed for a rank step (with a lease: a
    /// cap that passed gives everything up anyway).
    fn unanswered(&self, a: IpAddr, now: Nanos) -> bool {
        !self.quitting()
            && self
                .unconfirmed_since
                .get(&a)
                .is_some_and(|t| now >= t.saturating_add(self.cfg.step_ns))
    }

    /// Gives `a` up for not being answered here: out of the next write,
    /// the key withdrawn once nothing may answer it, not taken again (and
    /// the node published as not answering) for `pace_ns`.
    fn give_up_unanswered(&mut self, a: IpAddr, key: KeyRef, now: Nanos) {
        self.phases.insert(a, Phase::Releasing(key));
        self.unconfirmed_since.remove(&a);
        self.cannot_answer.insert(a, now);
        // Not quiet: the address moves.
        self.quiet_since = None;
    }

    /// The datapath write due now, if any: the held set under the lease's
    /// cap, when it differs from the last write, or that one failed or
    /// went unanswered. One write at a time.
    fn write(&mut self, now: Nanos) -> Option<Action> {
        if self.outstanding.values().any(|w| w.pending) {
            return None;
        }
        let (set, valid_until) = match (self.quitting(), self.lease) {
            (false, Some((_, cap))) => (self.held(), cap),
            // Empty; the expiry is the last one written (none answers
            // anyway), never 0.
            _ => (
                BTreeSet::new(),
                self.last_write().map_or(1, |w| w.valid_until).max(1),
            ),
        };
        // A new cap is written even with nothing held: in cluster mode it
        // bounds the node's other announcements (ingress, its own pools)
        // too.
        let due = match self.last_write() {
            None => !set.is_empty() || !self.outstanding.is_empty() || self.lease.is_some(),
            Some(w) => w.retry || w.set != set || w.valid_until != valid_until,
        };
        // A stop or a lost lease with writes in doubt writes empty again.
        let due = due
            || ((self.quitting() || self.lease.is_none()) && !self.maybe_answering(now).is_empty());
        if !due {
            return None;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.outstanding.insert(
            seq,
            Write {
                set: set.clone(),
                valid_until,
                pending: true,
                retry: false,
            },
        );
        Some(Action::Program {
            seq,
            addresses: set,
            valid_until,
        })
    }

    fn last_write(&self) -> Option<&Write> {
        self.outstanding
            .values()
            .next_back()
            .or(self.confirmed.as_ref().map(|(_, w)| w))
    }
}

/// Whether `c` may announce an address whose pool selects `sel`.
/// What the announcer derives from one view ([`Announcer::derived`]).
#[derive(Clone, Debug, Default)]
struct Derived {
    /// The view change it is of.
    of: u64,
    /// This node's memberships.
    mine: Option<Vec<(Candidate, i64)>>,
    /// The first misplaced address, once looked up.
    misplaced: Option<Option<Misplaced>>,
}

/// The first address held by an admitted member that is not its
/// rendezvous choice.
#[derive(Clone, Debug)]
struct Misplaced {
    address: IpAddr,
    holder: String,
    top: String,
    /// The leases of the choice's memberships.
    top_leases: Vec<i64>,
}

pub mod driver;
mod rank;
mod standing;
use standing::Standings;

#[cfg(test)]
mod model;
#[cfg(test)]
mod tests;
