//! The announcer's tick, whole: the LB lease kept (granted, joined,
//! refreshed), `lb/` read, and the [`Announcer`]'s actions carried out
//! within a budget, as one machine that does no I/O. The daemon's LB agent
//! runs it against etcd and the BPF maps; the property tests' model runs
//! the very same code against a simulated etcd and datapath, so what the
//! model proves is what ships.
//!
//! Why a machine of its own: the announcer's safety depends on the glue
//! around it as much as on its own rules. The order a tick does things in
//! (refresh before anything that may take long; read before deciding; a
//! bounded action phase whose leftovers are reported lost) and the time a
//! lease's cap counts from (when its refresh was *sent*) are decisions,
//! and decisions live in the core.
//!
//! The caller loops: [`Driver::step`] says what to do now ([`Step::Io`]:
//! one request, whose outcome goes back through [`Driver::done`];
//! [`Step::Announce`]: a gratuitous ARP / unsolicited NA, nothing to
//! report; [`Step::Wait`]: nothing before that time, or before
//! [`Driver::wake`]). One request is in flight at a time.
//!
//! A tick, every [`DriverConfig::tick_ns`] or at once when woken:
//! 1. the uplink's health (set with [`Driver::set_silent`]) goes to the
//!    announcer;
//! 2. the lease: granted when the announcer wants one and holds none, then
//!    the membership written under it; refreshed every third of its TTL.
//!    A refresh falls due in the middle of the action phase too, and goes
//!    before the next action: no action phase delays it. With a keeper
//!    ([`DriverConfig::kept`]), the daemon's choice: a task of its own
//!    refreshes the lease [`Driver::kept_lease`] names on its own clock,
//!    with a request of its own, so no request of the tick delays it
//!    either; each refresh it had answered goes to
//!    [`Driver::keeper_refreshed`] with the time it was *sent*, and the
//!    driver refreshes itself only when the keeper fell behind by
//!    [`DriverConfig::keeper_slack_ns`];
//! 3. `lb/` read (the caller may answer "unchanged": [`Done::Read`] with
//!    `None`); the membership written again if the read lacks it, or if
//!    whether this node answers changed ([`Announcer::answers`]);
//! 4. the announcer's actions, until it has none, or the tick's budget
//!    ([`DriverConfig::budget_ns`]) or [`DriverConfig::max_polls`] polls
//!    are spent: what is left is reported lost (asked again, or written
//!    again, next tick). Takes in a row go out together, and what they won
//!    is programmed before anything else.
//!
//! Stopping ([`Driver::stop`]) skips the ticks: the announcer empties the
//! datapath and then revokes the lease, polled every
//! [`DriverConfig::stop_poll_ns`] until [`Driver::stopped`].

use std::collections::{BTreeSet, VecDeque};
use std::net::IpAddr;

use super::{
    Action, Announcer, AnnouncerConfig, KeyRef, Nanos, Observation, Took, Withdrew, Written,
};

/// The tick's timing and bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DriverConfig {
    /// The LB lease asked for (etcd may grant another).
    pub ttl_ns: Nanos,
    /// How often a tick runs when nothing wakes it.
    pub tick_ns: Nanos,
    /// The action phase's budget per tick.
    pub budget_ns: Nanos,
    /// At most this many polls of the announcer per tick (take → program
    /// → announce is three; each batch of takes adds one).
    pub max_polls: usize,
    /// At most this many takes go out together.
    pub take_batch: usize,
    /// While stopping, how often the announcer is polled when it has
    /// nothing to do.
    pub stop_poll_ns: Nanos,
    /// Whether this node can answer at all (it has an uplink); published
    /// with the membership.
    pub can_answer: bool,
    /// How long past a refresh's due time the driver waits for a keeper
    /// ([`Driver::kept_lease`], [`Driver::keeper_refreshed`]) before it
    /// refreshes the lease itself; 0: no keeper, the driver refreshes
    /// every third of the TTL.
    pub keeper_slack_ns: Nanos,
}

/// The lease a keeper refreshes on its own clock, every third of its TTL
/// counted from `sent`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeptLease {
    /// The lease.
    pub id: i64,
    /// Its TTL.
    pub ttl_ns: Nanos,
    /// When its last refresh (or grant) the driver knows of was sent.
    pub sent: Nanos,
}

const MS: Nanos = 1_000_000;

impl DriverConfig {
    /// The daemon's timing for a lease of `ttl_ns`: a tick of 200 ms, a
    /// budget of a quarter of the lease (so a slow etcd never holds the
    /// next refresh past its slack), 64 polls, 32 takes together.
    #[must_use]
    pub fn for_lease(ttl_ns: Nanos) -> Self {
        Self {
            ttl_ns,
            tick_ns: 200 * MS,
            budget_ns: ttl_ns / 4,
            max_polls: 64,
            take_batch: 32,
            stop_poll_ns: 50 * MS,
            can_answer: true,
            keeper_slack_ns: 0,
        }
    }

    /// As [`DriverConfig::for_lease`], with a keeper refreshing the lease:
    /// the driver refreshes it itself only half a TTL after the last
    /// refresh, when the keeper fell behind by a sixth of it.
    #[must_use]
    pub fn kept(ttl_ns: Nanos) -> Self {
        Self {
            keeper_slack_ns: ttl_ns / 6,
            ..Self::for_lease(ttl_ns)
        }
    }
}

/// The margin kept between the datapath's cap and a lease of `ttl_ns`: a
/// tenth of it, at least 100 ms (clock rates, the lessor's own timing).
#[must_use]
pub fn margin(ttl_ns: Nanos) -> Nanos {
    (ttl_ns / 10).max(100 * MS)
}

/// One request to carry out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Io {
    /// Grant a lease of the configured TTL. Answer [`Done::Granted`] or
    /// [`Done::Lost`].
    Grant,
    /// Write the membership under `lease`, publishing `answers`. Answer
    /// [`Done::Joined`] or [`Done::Lost`].
    Join {
        /// The lease it is bound to.
        lease: i64,
        /// Whether this node answers (may be handed addresses).
        answers: bool,
    },
    /// Refresh `lease`. Answer [`Done::Refreshed`] or [`Done::Lost`].
    Refresh(i64),
    /// Read `lb/`. Answer [`Done::Read`] or [`Done::Lost`].
    Read,
    /// Create each address's key under `lease` if absent (each its own
    /// transaction, sent together). Answer [`Done::Took`], one per address
    /// in order.
    Take {
        /// The lease.
        lease: i64,
        /// The addresses.
        addresses: Vec<IpAddr>,
    },
    /// Delete the address's key if it is this node's and the one named.
    /// Answer [`Done::Withdrew`].
    Withdraw(IpAddr, KeyRef),
    /// Datapath write `seq` (see [`Action::Program`]). Answer
    /// [`Done::Programmed`].
    Program {
        /// The write's sequence number.
        seq: u64,
        /// The addresses to answer for.
        addresses: BTreeSet<IpAddr>,
        /// No entry is answered past this (kernel monotonic ns).
        valid_until: Nanos,
    },
    /// Revoke `lease` (best effort). Answer [`Done::Revoked`] or
    /// [`Done::Lost`].
    Revoke(i64),
}

/// The outcome of the request in flight.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Done {
    /// A lease `id` of `ttl_ns` was granted.
    Granted {
        /// The lease.
        id: i64,
        /// Its TTL as granted.
        ttl_ns: Nanos,
    },
    /// The membership is written.
    Joined,
    /// The refresh reached etcd: whether the lease was still alive.
    Refreshed(bool),
    /// `lb/` as read; `None`: unchanged since the last read handed over
    /// (the caller knows, from its mirror of etcd, that nothing moved).
    Read(Option<Observation>),
    /// One answer per address of the [`Io::Take`].
    Took(Vec<Took>),
    /// The withdrawal's answer.
    Withdrew(Withdrew),
    /// The datapath's answer to the write.
    Programmed(Written),
    /// The lease is revoked.
    Revoked,
    /// No answer (error or timeout) to a grant, join, refresh, read or
    /// revoke.
    Lost,
}

impl Io {
    /// Whether the request goes to etcd (all but the datapath's writes).
    #[must_use]
    pub fn to_etcd(&self) -> bool {
        !matches!(self, Io::Program { .. })
    }
}

impl Done {
    /// Whether etcd left the request unanswered: no answer at all, or
    /// none for any address of a take. A caller backs off on it
    /// ([`Driver::hold_until`]).
    #[must_use]
    pub fn unanswered(&self) -> bool {
        match self {
            Done::Lost | Done::Withdrew(Withdrew::Lost) => true,
            Done::Took(t) => t.iter().all(|t| *t == Took::Lost),
            _ => false,
        }
    }
}

/// What to do now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Carry out this request and report it with [`Driver::done`].
    Io(Io),
    /// Send a gratuitous ARP / unsolicited NA for the address.
    Announce(IpAddr),
    /// Nothing to do before this time (kernel monotonic ns), unless woken.
    Wait(Nanos),
}

/// The lease the driver holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Lease {
    id: i64,
    ttl_ns: Nanos,
    /// When the last refresh (or the grant) was sent.
    sent: Nanos,
}

/// Where a tick is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// Between ticks.
    Idle,
    /// Lease, join, read.
    Prepare,
    /// The announcer's actions, until `deadline`.
    Act,
}

/// A request in flight, with what the driver needs to take its answer.
#[derive(Clone, Debug, PartialEq, Eq)]
enum InFlight {
    Grant { sent: Nanos },
    Join { answers: bool },
    Refresh { id: i64, sent: Nanos },
    Read,
    Take(Vec<IpAddr>),
    Withdraw(IpAddr),
    Program(u64),
    Revoke,
}

/// The announcer's tick (see the module docs).
#[derive(Clone, Debug)]
pub struct Driver {
    cfg: DriverConfig,
    machine: Announcer,
    lease: Option<Lease>,
    in_flight: Option<InFlight>,
    stage: Stage,
    next_tick: Nanos,
    woken: bool,
    silent: bool,
    /// This tick: a grant or refresh went unanswered (tried again next
    /// tick, not at once).
    lease_failed: bool,
    /// This tick: `lb/` still to be read.
    read_due: bool,
    /// The membership is to be written (again).
    join_due: bool,
    /// No request goes to etcd before this (kernel monotonic ns): the
    /// last one went unanswered ([`Driver::hold_until`]).
    held_until: Nanos,
    /// What the last membership written published.
    published: Option<bool>,
    /// The end of this tick's action phase.
    deadline: Nanos,
    polls: usize,
    queue: VecDeque<Action>,
    stopping: bool,
}

impl Driver {
    /// The tick of node `me`'s announcer.
    #[must_use]
    pub fn new(me: impl Into<String>, cfg: DriverConfig) -> Self {
        Self {
            machine: Announcer::new(me, AnnouncerConfig::for_lease(cfg.ttl_ns)),
            cfg,
            lease: None,
            in_flight: None,
            stage: Stage::Idle,
            next_tick: 0,
            woken: true,
            silent: false,
            lease_failed: false,
            read_due: false,
            join_due: false,
            held_until: 0,
            published: None,
            deadline: 0,
            polls: 0,
            queue: VecDeque::new(),
            stopping: false,
        }
    }

    /// The announcer (what it holds, its lease, its cap).
    #[must_use]
    pub fn announcer(&self) -> &Announcer {
        &self.machine
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &DriverConfig {
        &self.cfg
    }

    /// Whether the uplink cannot answer (down, without carrier, gone):
    /// taken into account at the next tick's start.
    pub fn set_silent(&mut self, silent: bool) {
        self.silent = silent;
    }

    /// Something under `lb/` changed: the next tick starts now.
    pub fn wake(&mut self) {
        self.woken = true;
    }

    /// Whether a tick starts at the next [`Driver::step`] (the caller
    /// looks at the uplink then).
    #[must_use]
    pub fn tick_due(&self, now: Nanos) -> bool {
        !self.stopping && self.stage == Stage::Idle && (self.woken || now >= self.wake_at())
    }

    /// Whether a request is in flight.
    #[must_use]
    pub fn busy(&self) -> bool {
        self.in_flight.is_some()
    }

    /// Stop: the datapath emptied, then the lease revoked.
    pub fn stop(&mut self) {
        self.stopping = true;
        self.machine.stop();
        self.queue.clear();
        self.stage = Stage::Act;
    }

    /// etcd left the last request unanswered: nothing more is asked of it
    /// (no grant, refresh, join, read, take or withdrawal) before `until`,
    /// the caller's jittered backoff (#47 item 3), so a node does not ask
    /// a silent etcd again at every tick. Ticks go on meanwhile: the
    /// announcer acts on what it last read, and what it would send is
    /// reported lost at once, as past a tick's deadline. The revoke at
    /// stop still goes.
    pub fn hold_until(&mut self, until: Nanos) {
        self.held_until = until;
    }

    /// Whether requests to etcd are held back at `now`.
    fn held(&self, now: Nanos) -> bool {
        !self.stopping && now < self.held_until
    }

    /// Whether stopping is finished.
    #[must_use]
    pub fn stopped(&self) -> bool {
        self.machine.stopped()
    }

    /// What to do now. Not to be called while a request is in flight
    /// (it then says to wait).
    pub fn step(&mut self, now: Nanos) -> Step {
        if self.in_flight.is_some() {
            return Step::Wait(now.saturating_add(self.cfg.tick_ns));
        }
        if self.stopping {
            return self.step_stopping(now);
        }
        if self.tick_due(now) {
            self.start_tick(now);
        }
        // A refresh due goes first, whatever the stage.
        if let Some(io) = self.lease_step(now) {
            return Step::Io(io);
        }
        match self.stage {
            Stage::Idle => Step::Wait(self.wake_at()),
            Stage::Prepare => {
                if let Some(io) = self.prepare(now) {
                    return Step::Io(io);
                }
                self.stage = Stage::Act;
                self.deadline = now.saturating_add(self.cfg.budget_ns);
                self.polls = 0;
                self.act(now)
            }
            Stage::Act => self.act(now),
        }
    }

    fn start_tick(&mut self, now: Nanos) {
        self.woken = false;
        self.next_tick = now.saturating_add(self.cfg.tick_ns);
        self.machine.set_silent(self.silent);
        self.stage = Stage::Prepare;
        self.lease_failed = false;
        self.read_due = true;
        // What the last tick left undone was reported lost.
        self.queue.clear();
    }

    /// When the next tick starts: at its period, or earlier when the
    /// lease's refresh falls due first (the refresh goes at a tick's start;
    /// waiting for the period sent refreshes up to a tick late).
    fn wake_at(&self) -> Nanos {
        let refresh = match self.lease {
            Some(l) if self.machine.wants_lease() && !self.lease_failed => {
                self.refresh_due(l).max(self.held_until)
            }
            _ => Nanos::MAX,
        };
        self.next_tick.min(refresh)
    }

    /// When the driver refreshes `l` itself: a third of its TTL after its
    /// last refresh, and the keeper's slack.
    fn refresh_due(&self, l: Lease) -> Nanos {
        l.sent
            .saturating_add(l.ttl_ns / 3)
            .saturating_add(self.cfg.keeper_slack_ns)
    }

    /// The lease a keeper is to refresh: the one held while the announcer
    /// wants one; `None` while it is silent or stopping (the lease is then
    /// revoked, or left to run out, and must not be kept alive).
    #[must_use]
    pub fn kept_lease(&self) -> Option<KeptLease> {
        let l = self.lease?;
        (self.machine.wants_lease() && self.machine.lease() == Some(l.id)).then_some(KeptLease {
            id: l.id,
            ttl_ns: l.ttl_ns,
            sent: l.sent,
        })
    }

    /// The keeper's refresh of lease `id`, sent at `sent`, was answered:
    /// the lease lives. The announcer's cap counts from `sent`, as for the
    /// driver's own refreshes, and a tick starts at once to write it. A
    /// refresh of another lease, or one older than what the driver knows,
    /// changes nothing. (A keeper told the
    /// lease is gone says nothing: the driver's own refresh finds out, in
    /// its order.)
    pub fn keeper_refreshed(&mut self, id: i64, sent: Nanos) {
        if self.machine.lease() != Some(id) {
            return;
        }
        if let Some(l) = self.lease.as_mut().filter(|l| l.id == id && sent > l.sent) {
            l.sent = sent;
            let cap = sent.saturating_add(l.ttl_ns - margin(l.ttl_ns));
            self.machine.lease_refreshed(cap);
            // A tick now writes the new cap: the datapath answers until
            // the cap last written, so one written a tick late would
            // leave a node killed meanwhile silent a refresh early.
            self.woken = true;
        }
    }

    /// The lease step: a grant (with the membership after it) when wanted
    /// and none is held, a refresh every third of the TTL. One that goes
    /// unanswered is tried again next tick; a refresh falling due mid-tick
    /// goes at once.
    fn lease_step(&mut self, now: Nanos) -> Option<Io> {
        // The announcer gave its lease up (revoked while silent, or its
        // cap passed with every refresh unanswered).
        if self.machine.lease().is_none() {
            self.lease = None;
        }
        if self.stage == Stage::Idle || !self.machine.wants_lease() {
            return None;
        }
        if self.lease_failed || self.held(now) {
            return None;
        }
        match self.lease {
            None => {
                self.in_flight = Some(InFlight::Grant { sent: now });
                Some(Io::Grant)
            }
            Some(l) if now >= self.refresh_due(l) => {
                self.in_flight = Some(InFlight::Refresh {
                    id: l.id,
                    sent: now,
                });
                Some(Io::Refresh(l.id))
            }
            _ => None,
        }
    }

    /// Join, then read.
    fn prepare(&mut self, now: Nanos) -> Option<Io> {
        if self.held(now) {
            return None;
        }
        let lease = self.machine.lease()?;
        let answers = self.cfg.can_answer && self.machine.answers();
        if self.join_due || self.published.is_some_and(|p| p != answers) {
            self.join_due = false;
            self.in_flight = Some(InFlight::Join { answers });
            return Some(Io::Join { lease, answers });
        }
        if self.read_due {
            self.read_due = false;
            self.in_flight = Some(InFlight::Read);
            return Some(Io::Read);
        }
        None
    }

    /// The action phase.
    fn act(&mut self, now: Nanos) -> Step {
        loop {
            let late = now >= self.deadline || self.polls >= self.cfg.max_polls;
            if self.queue.is_empty() {
                if late {
                    return self.end_tick();
                }
                self.queue.extend(self.machine.poll(now));
                self.polls += 1;
                if self.queue.is_empty() {
                    return self.end_tick();
                }
            }
            let Some(action) = self.queue.pop_front() else {
                return self.end_tick();
            };
            if let Some(step) = self.carry_out(action, late, now) {
                return step;
            }
        }
    }

    fn end_tick(&mut self) -> Step {
        self.stage = Stage::Idle;
        Step::Wait(self.wake_at())
    }

    /// One action: the request to send, or (late, or nothing to send)
    /// reported lost at once and `None`.
    fn carry_out(&mut self, action: Action, late: bool, now: Nanos) -> Option<Step> {
        // Past the deadline, or etcd held back: what would go to etcd is
        // reported lost at once (the datapath's writes still go).
        let unsent = late || self.held(now);
        match action {
            Action::Program {
                seq,
                addresses,
                valid_until,
            } => {
                if late {
                    self.programmed(seq, Written::Lost, now);
                    return None;
                }
                self.in_flight = Some(InFlight::Program(seq));
                Some(Step::Io(Io::Program {
                    seq,
                    addresses,
                    valid_until,
                }))
            }
            Action::Take(first) => {
                let mut batch = vec![first];
                while batch.len() < self.cfg.take_batch
                    && let Some(Action::Take(a)) = self.queue.front()
                {
                    batch.push(*a);
                    self.queue.pop_front();
                }
                match (unsent, self.machine.lease()) {
                    (false, Some(lease)) => {
                        self.in_flight = Some(InFlight::Take(batch.clone()));
                        Some(Step::Io(Io::Take {
                            lease,
                            addresses: batch,
                        }))
                    }
                    _ => {
                        for a in batch {
                            self.machine.took(a, Took::Lost);
                        }
                        None
                    }
                }
            }
            Action::Withdraw(a, key) => {
                if unsent {
                    self.machine.withdrew(a, Withdrew::Lost, now);
                    return None;
                }
                self.in_flight = Some(InFlight::Withdraw(a));
                Some(Step::Io(Io::Withdraw(a, key)))
            }
            Action::Announce(a) => Some(Step::Announce(a)),
            Action::Revoke(lease) => {
                self.lease = None;
                self.in_flight = Some(InFlight::Revoke);
                Some(Step::Io(Io::Revoke(lease)))
            }
        }
    }

    fn programmed(&mut self, seq: u64, written: Written, now: Nanos) {
        // The announcements go before anything else queued.
        let acts = self.machine.programmed(seq, written, now);
        for a in acts.into_iter().rev() {
            self.queue.push_front(a);
        }
    }

    fn step_stopping(&mut self, now: Nanos) -> Step {
        if self.machine.stopped() {
            return Step::Wait(Nanos::MAX);
        }
        loop {
            if self.queue.is_empty() {
                self.queue.extend(self.machine.poll(now));
                if self.queue.is_empty() {
                    return Step::Wait(now.saturating_add(self.cfg.stop_poll_ns));
                }
            }
            let Some(action) = self.queue.pop_front() else {
                continue;
            };
            if let Some(step) = self.carry_out(action, false, now) {
                return step;
            }
        }
    }

    /// The outcome of the request in flight.
    pub fn done(&mut self, done: Done, now: Nanos) {
        let Some(what) = self.in_flight.take() else {
            return;
        };
        match (what, done) {
            (InFlight::Grant { sent }, Done::Granted { id, ttl_ns }) => {
                self.lease = Some(Lease { id, ttl_ns, sent });
                self.machine
                    .lease_granted(id, sent.saturating_add(ttl_ns - margin(ttl_ns)));
                self.join_due = true;
            }
            (InFlight::Refresh { id, sent }, Done::Refreshed(alive)) => {
                if let Some(l) = self.lease.as_mut().filter(|l| l.id == id) {
                    if alive {
                        // A keeper's later refresh may have come first.
                        l.sent = l.sent.max(sent);
                        let cap = sent.saturating_add(l.ttl_ns - margin(l.ttl_ns));
                        self.machine.lease_refreshed(cap);
                    } else {
                        self.lease = None;
                        self.machine.lease_lost();
                    }
                }
            }
            (InFlight::Join { answers }, Done::Joined) => {
                self.published = Some(answers);
            }
            // Asked again next tick.
            (InFlight::Join { .. }, _) => self.join_due = true,
            (InFlight::Read, Done::Read(view)) => {
                if let Some(view) = view {
                    self.machine.observed(view, now);
                }
                // Not a member under this lease (a join lost, or one
                // overwritten): join again.
                self.join_due |= self.machine.membership_missing();
            }
            (InFlight::Take(batch), Done::Took(answers)) => {
                let mut mine = false;
                for (i, a) in batch.into_iter().enumerate() {
                    let answer = answers.get(i).copied().unwrap_or(Took::Lost);
                    mine |= matches!(answer, Took::Mine(_));
                    self.machine.took(a, answer);
                }
                // What was won is programmed before anything else queued.
                if mine && !self.stopping && now < self.deadline {
                    let acts = self.machine.poll(now);
                    self.polls += 1;
                    for a in acts.into_iter().rev() {
                        self.queue.push_front(a);
                    }
                }
            }
            (InFlight::Take(batch), _) => {
                for a in batch {
                    self.machine.took(a, Took::Lost);
                }
            }
            (InFlight::Withdraw(a), Done::Withdrew(w)) => self.machine.withdrew(a, w, now),
            (InFlight::Withdraw(a), _) => self.machine.withdrew(a, Withdrew::Lost, now),
            (InFlight::Program(seq), Done::Programmed(w)) => self.programmed(seq, w, now),
            (InFlight::Program(seq), _) => self.programmed(seq, Written::Lost, now),
            // A grant or refresh unanswered: tried again next tick.
            (InFlight::Grant { .. } | InFlight::Refresh { .. }, _) => self.lease_failed = true,
            // A read unanswered: read again next tick; a revoke: the lease
            // runs out.
            (InFlight::Read | InFlight::Revoke, _) => {}
        }
    }
}

#[cfg(test)]
mod tests;
