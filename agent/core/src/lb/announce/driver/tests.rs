use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use super::*;
use crate::lb::LabelSelector;
use crate::lb::announce::Holder;
use crate::lb::cluster::Candidate;

const S: Nanos = 1_000_000_000;

fn cfg() -> DriverConfig {
    DriverConfig::for_lease(3 * S)
}

fn addr(i: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(192, 0, 2, i))
}

fn view(me: &str, lease: i64, addrs: &[IpAddr], holders: &[(IpAddr, &str)]) -> Observation {
    Observation {
        addresses: addrs
            .iter()
            .map(|a| (*a, LabelSelector::default()))
            .collect(),
        members: [(
            Candidate {
                name: me.into(),
                labels: BTreeMap::new(),
                answers: true,
            },
            lease,
        )]
        .into_iter()
        .collect(),
        holders: holders
            .iter()
            .map(|(a, n)| {
                (
                    *a,
                    Holder {
                        node: (*n).into(),
                        lease,
                    },
                )
            })
            .collect(),
    }
}

fn io(step: Step) -> Io {
    match step {
        Step::Io(io) => io,
        other => panic!("expected a request, got {other:?}"),
    }
}

/// A driver that holds lease 7 (granted at 0), joined, its first read
/// `v` handed over and its first write confirmed.
fn started(v: Observation) -> Driver {
    started_with(cfg(), v)
}

/// As [`started`], configured with `cfg`.
fn started_with(cfg: DriverConfig, v: Observation) -> Driver {
    let mut d = Driver::new("n", cfg);
    assert_eq!(io(d.step(0)), Io::Grant);
    d.done(
        Done::Granted {
            id: 7,
            ttl_ns: 3 * S,
        },
        10,
    );
    assert_eq!(
        io(d.step(10)),
        Io::Join {
            lease: 7,
            answers: true
        }
    );
    d.done(Done::Joined, 20);
    assert_eq!(io(d.step(20)), Io::Read);
    d.done(Done::Read(Some(v)), 30);
    d
}

#[test]
fn the_cap_counts_from_when_the_grant_and_each_refresh_were_sent() {
    let mut d = started(view("n", 7, &[], &[]));
    // Granted at 0 (answered at 10): the cap is TTL less the margin from 0.
    assert_eq!(d.announcer().valid_until(), Some(3 * S - margin(3 * S)));
    // Drain the first tick (the cap's write).
    while let Step::Io(io) = d.step(40) {
        match io {
            Io::Program { .. } => d.done(Done::Programmed(Written::Done), 41),
            other => panic!("{other:?}"),
        }
    }
    // A third of the TTL later, the next tick refreshes first.
    let sent = S + 5;
    assert_eq!(io(d.step(sent)), Io::Refresh(7));
    d.done(Done::Refreshed(true), sent + 400_000_000);
    assert_eq!(
        d.announcer().valid_until(),
        Some(sent + 3 * S - margin(3 * S))
    );
}

#[test]
fn an_idle_driver_wakes_for_a_refresh_falling_due_between_ticks() {
    let mut d = started(view("n", 7, &[], &[]));
    // The first tick ends (its cap's write done); the next tick would be
    // 200 ms after the tick began at 0.
    let mut now = 40;
    let wait = loop {
        match d.step(now) {
            Step::Io(Io::Program { .. }) => d.done(Done::Programmed(Written::Done), now + 1),
            Step::Wait(until) => break until,
            other => panic!("{other:?}"),
        }
        now += 1;
    };
    assert!(wait <= cfg().tick_ns, "the next tick: {wait}");
    // Ticks come and go; at the refresh's due time (a third of the TTL
    // after the grant was sent, at 0), the driver asks to be woken, not
    // at the tick after it.
    let due = S;
    // The caller wakes 50 ms late once: from then on the ticks fall at
    // 250 ms, 450 ms... and none at the refresh's due time.
    let mut t = wait + 50_000_000;
    let mut woke_at = None;
    while t < 2 * S {
        match d.step(t) {
            Step::Io(Io::Refresh(7)) => {
                woke_at = Some(t);
                break;
            }
            Step::Io(Io::Read) => d.done(Done::Read(None), t),
            Step::Io(other) => panic!("{other:?}"),
            Step::Wait(until) => {
                assert!(
                    until <= due.max(t),
                    "asked to sleep past the refresh: {until}"
                );
                t = until.max(t + 1);
            }
            Step::Announce(_) => {}
        }
    }
    assert_eq!(woke_at, Some(due), "the refresh went out on time");
}

#[test]
fn a_refresh_falling_due_mid_tick_goes_before_the_next_action() {
    let a = addr(1);
    let b = addr(2);
    let mut d = started(view("n", 7, &[a, b], &[]));
    // The tick starts at 1 s - 1 (no refresh due yet): it takes both.
    let t = S - 1;
    let mut now = t;
    let mut seen = Vec::new();
    // Each request takes 300 ms: the refresh falls due in the middle.
    for _ in 0..6 {
        let step = d.step(now);
        let Step::Io(io) = step else { break };
        seen.push(io.clone());
        now += 300_000_000;
        let done = match io {
            Io::Take { addresses, .. } => {
                Done::Took(addresses.iter().map(|_| Took::Mine(1)).collect())
            }
            Io::Program { .. } => Done::Programmed(Written::Done),
            Io::Refresh(_) => Done::Refreshed(true),
            Io::Read => Done::Read(None),
            other => panic!("{other:?}"),
        };
        d.done(done, now);
    }
    let refresh = seen
        .iter()
        .position(|x| *x == Io::Refresh(7))
        .expect("refreshed within the tick");
    assert!(refresh >= 1, "after the first action: {seen:?}");
}

#[test]
fn what_the_budget_leaves_is_reported_lost_and_asked_again_next_tick() {
    let a = addr(1);
    let mut d = started(view("n", 7, &[a], &[]));
    let take = io(d.step(40));
    assert!(matches!(take, Io::Take { .. }), "{take:?}");
    // The answer comes after the budget: the write it would start is not
    // sent this tick.
    let late = 40 + cfg().budget_ns + 1;
    d.done(Done::Took(vec![Took::Mine(3)]), late);
    assert!(
        matches!(d.step(late), Step::Wait(_)),
        "nothing more this tick"
    );
    // Next tick: read, then the write of what is held.
    let next = cfg().tick_ns + 50;
    let mut sent = Vec::new();
    let mut now = next.max(late + 1);
    while let Step::Io(io) = d.step(now) {
        now += 1;
        sent.push(io.clone());
        let done = match io {
            Io::Read => Done::Read(None),
            Io::Program { .. } => Done::Programmed(Written::Done),
            other => panic!("{other:?}"),
        };
        d.done(done, now);
    }
    assert!(
        sent.iter()
            .any(|x| matches!(x, Io::Program { addresses, .. } if addresses.contains(&a))),
        "{sent:?}"
    );
}

#[test]
fn a_node_that_cannot_answer_joins_again_saying_so() {
    let a = addr(1);
    let mut d = started(view("n", 7, &[a], &[]));
    let mut now = 40;
    let mut joins = Vec::new();
    // The map is full: every write answers that only the old set is there.
    while now < 6 * S {
        match d.step(now) {
            Step::Io(Io::Take { addresses, .. }) => {
                d.done(
                    Done::Took(addresses.iter().map(|_| Took::Mine(1)).collect()),
                    now,
                );
            }
            Step::Io(Io::Program { .. }) => {
                d.done(Done::Programmed(Written::Partly(BTreeSet::new())), now);
            }
            Step::Io(Io::Read) => {
                d.done(Done::Read(Some(view("n", 7, &[a], &[(a, "n")]))), now);
            }
            Step::Io(Io::Refresh(_)) => d.done(Done::Refreshed(true), now),
            Step::Io(Io::Withdraw(..)) => d.done(Done::Withdrew(Withdrew::Done), now),
            Step::Io(Io::Join { answers, .. }) => {
                joins.push((now, answers));
                d.done(Done::Joined, now);
            }
            Step::Io(other) => panic!("{other:?}"),
            Step::Announce(_) => {}
            Step::Wait(t) => now = t.max(now + 1),
        }
    }
    let step = AnnouncerConfig::for_lease(3 * S).step_ns;
    let (at, answers) = joins.first().copied().expect("joined again");
    assert!(!answers, "published as not answering: {joins:?}");
    assert!(
        at <= step + 2 * cfg().tick_ns,
        "within a rank step and a tick: {at}"
    );
    assert!(
        d.announcer().cannot_answer().contains(&a),
        "{:?}",
        d.announcer().cannot_answer()
    );
}

/// A driver as [`started`] but configured for a keeper, its first tick
/// drained.
fn started_kept(v: Observation) -> Driver {
    let mut d = started_with(DriverConfig::kept(3 * S), v);
    while let Step::Io(io) = d.step(40) {
        match io {
            Io::Program { .. } => d.done(Done::Programmed(Written::Done), 41),
            other => panic!("{other:?}"),
        }
    }
    d
}

/// Steps the driver from `from` to `to` (answering reads "unchanged" and
/// writes "done"); the first refresh it asks for, and when.
fn first_refresh(d: &mut Driver, from: Nanos, to: Nanos) -> Option<(Nanos, i64)> {
    let mut t = from;
    while t < to {
        match d.step(t) {
            Step::Io(Io::Refresh(l)) => return Some((t, l)),
            Step::Io(Io::Read) => d.done(Done::Read(None), t),
            Step::Io(Io::Program { .. }) => d.done(Done::Programmed(Written::Done), t),
            Step::Io(other) => panic!("{other:?}"),
            Step::Wait(until) => t = until.max(t + 1),
            Step::Announce(_) => {}
        }
    }
    None
}

#[test]
fn with_a_keeper_the_cap_follows_its_refreshes_and_the_driver_steps_in_only_when_it_falls_behind() {
    let mut d = started_kept(view("n", 7, &[], &[]));
    assert_eq!(
        d.kept_lease(),
        Some(KeptLease {
            id: 7,
            ttl_ns: 3 * S,
            sent: 0
        })
    );
    // Ticks run until 850 ms (the last at 800 ms, the next due at 1 s).
    let t = 850 * S / 1000;
    assert_eq!(first_refresh(&mut d, 50, t), None);
    assert!(!d.tick_due(t));
    // The keeper refreshed at 850 ms (sent then, answered later): the cap
    // counts from when it was sent; another lease's or an older refresh
    // changes nothing.
    d.keeper_refreshed(7, t);
    d.keeper_refreshed(8, 2 * S);
    d.keeper_refreshed(7, S / 2);
    let cap = t + 3 * S - margin(3 * S);
    assert_eq!(d.announcer().valid_until(), Some(cap));
    assert_eq!(d.kept_lease().map(|k| k.sent), Some(t));
    // The new cap goes to the datapath at once, not at the next tick.
    assert!(d.tick_due(t + 1), "a tick starts for the new cap");
    let mut written = None;
    for _ in 0..8 {
        match d.step(t + 1) {
            Step::Io(Io::Read) => d.done(Done::Read(None), t + 1),
            Step::Io(Io::Program { valid_until, .. }) => {
                written = Some(valid_until);
                d.done(Done::Programmed(Written::Done), t + 1);
            }
            Step::Io(other) => panic!("{other:?}"),
            Step::Announce(_) => {}
            Step::Wait(_) => break,
        }
    }
    assert_eq!(written, Some(cap));
    // Kept on time, the driver never refreshes itself.
    d.keeper_refreshed(7, 2 * S);
    assert_eq!(first_refresh(&mut d, t + 2, 2 * S + S / 2), None);
    // The keeper falls silent after 2 s: the driver refreshes itself half
    // a TTL after, not a third.
    assert_eq!(
        first_refresh(&mut d, 2 * S + S / 2, 5 * S),
        Some((2 * S + S + S / 2, 7))
    );
}

#[test]
fn no_lease_is_kept_while_the_uplink_is_silent() {
    let mut d = started_kept(view("n", 7, &[], &[]));
    assert!(d.kept_lease().is_some());
    d.set_silent(true);
    // The next tick takes the silence: from then on the lease is not
    // kept, and the driver revokes it.
    let mut t = 50;
    let mut revoked = false;
    while t < S / 2 && !revoked {
        match d.step(t) {
            Step::Io(Io::Revoke(7)) => {
                assert_eq!(d.kept_lease(), None, "a silent node's lease is not kept");
                d.done(Done::Revoked, t);
                revoked = true;
            }
            Step::Io(Io::Program { .. }) => d.done(Done::Programmed(Written::Done), t),
            Step::Io(Io::Read) => d.done(Done::Read(None), t),
            Step::Io(other) => panic!("{other:?}"),
            Step::Wait(until) => t = until.max(t + 1),
            Step::Announce(_) => {}
        }
    }
    assert!(revoked);
    assert_eq!(d.kept_lease(), None);
}

/// Steps the driver from `from` to `to`, answering every etcd request
/// `Lost` 1 ms after it went, and every datapath write done; after each
/// lost request, holds etcd back for `hold` (none: `0`). The etcd
/// requests sent, with when.
fn against_silent_etcd(d: &mut Driver, from: Nanos, to: Nanos, hold: Nanos) -> Vec<(Nanos, Io)> {
    let mut sent = Vec::new();
    let mut now = from;
    while now < to {
        match d.step(now) {
            Step::Io(Io::Program { .. }) => d.done(Done::Programmed(Written::Done), now),
            Step::Io(io) => {
                sent.push((now, io));
                now += 1_000_000;
                d.done(Done::Lost, now);
                if hold > 0 {
                    d.hold_until(now + hold);
                }
            }
            Step::Announce(_) => {}
            Step::Wait(until) => now = until.max(now + 1),
        }
    }
    sent
}

#[test]
fn a_silent_etcd_is_asked_nothing_until_the_hold_is_over() {
    let a = addr(1);
    let d = started(view("n", 7, &[a], &[]));
    // Without a hold, a silent etcd is asked again at every tick.
    let unheld = against_silent_etcd(&mut d.clone(), 40, 4 * S, 0);
    let ticks = (4 * S / cfg().tick_ns) as usize;
    assert!(
        unheld.len() >= ticks,
        "{} requests in {ticks} ticks",
        unheld.len()
    );
    // Held for a second after each lost request: one request a second,
    // each at least a second after the one before.
    let mut held = d.clone();
    let sent = against_silent_etcd(&mut held, 40, 4 * S, S);
    assert!((3..=4).contains(&sent.len()), "{sent:?}");
    for w in sent.windows(2) {
        assert!(w[1].0 >= w[0].0 + S, "{sent:?}");
    }
    // The datapath is still written while held: the cap it holds is
    // what was written, never extended without an answer.
    assert!(held.announcer().valid_until() <= d.announcer().valid_until());
}
