use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr};

use proptest::prelude::*;

use super::model::{Fault, FaultKind, MS, TTL, World};
use super::*;
use crate::lb::cluster::announcer;

const S: Nanos = 1_000_000_000;

fn addr(i: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(192, 0, 2, i))
}

fn member(name: &str, lease: i64) -> (Candidate, i64) {
    (
        Candidate {
            name: name.into(),
            labels: BTreeMap::new(),
            answers: true,
        },
        lease,
    )
}

fn view(addrs: &[IpAddr], members: &[(&str, i64)], holders: &[(IpAddr, &str, i64)]) -> Observation {
    Observation {
        addresses: addrs
            .iter()
            .map(|a| (*a, LabelSelector::default()))
            .collect(),
        members: members.iter().map(|(n, l)| member(n, *l)).collect(),
        holders: holders
            .iter()
            .map(|(a, n, l)| {
                (
                    *a,
                    Holder {
                        node: (*n).into(),
                        lease: *l,
                    },
                )
            })
            .collect(),
    }
}

const NODES: [(&str, i64); 3] = [("node-0", 10), ("node-1", 11), ("node-2", 12)];

/// The rendezvous choice of `a` among the three nodes.
fn top(a: IpAddr) -> String {
    let c: Vec<Candidate> = NODES.iter().map(|(n, l)| member(n, *l).0).collect();
    announcer(a, &LabelSelector::default(), &c)
        .unwrap()
        .name
        .clone()
}

/// An address whose rendezvous choice is `node`.
fn addr_for(node: &str) -> IpAddr {
    (1..=250).map(addr).find(|a| top(*a) == node).unwrap()
}

/// An announcer holding `lease`, its first write (nothing held, the
/// lease's cap: it bounds the node's other announcements too) confirmed.
fn fresh(me: &str, lease: i64, now: Nanos) -> Announcer {
    let mut m = Announcer::new(me, AnnouncerConfig::for_lease(3 * S));
    m.lease_granted(lease, now + 3 * S);
    let acts = m.poll(now);
    let (seq, set, until) = program_of(&acts).expect("the cap is written at once");
    assert!(set.is_empty() && until == now + 3 * S, "{acts:?}");
    m.programmed(seq, Written::Done, now);
    m
}

fn withdraws(acts: &[Action], a: IpAddr) -> bool {
    acts.iter()
        .any(|x| matches!(x, Action::Withdraw(w, _) if *w == a))
}

fn program_of(acts: &[Action]) -> Option<(u64, BTreeSet<IpAddr>, Nanos)> {
    acts.iter().find_map(|a| match a {
        Action::Program {
            seq,
            addresses,
            valid_until,
        } => Some((*seq, addresses.clone(), *valid_until)),
        _ => None,
    })
}

/// Takes `a` through take → program → confirm; returns the actions of
/// the confirmation.
fn hold(m: &mut Announcer, a: IpAddr, now: Nanos) -> Vec<Action> {
    let acts = m.poll(now);
    assert!(acts.contains(&Action::Take(a)), "{acts:?}");
    m.took(a, Took::Mine(1));
    let acts = m.poll(now);
    let (seq, set, _) = program_of(&acts).expect("programmed after the take");
    assert!(set.contains(&a));
    m.programmed(seq, Written::Done, now)
}

#[test]
fn take_then_program_then_announce() {
    let a = addr_for("node-0");
    let mut m = fresh("node-0", 10, 0);
    m.observed(view(&[a], &NODES, &[]), 0);
    let acts = m.poll(0);
    assert_eq!(
        acts,
        vec![Action::Take(a)],
        "the key first, nothing programmed"
    );
    // No answer yet: nothing else happens.
    assert!(m.poll(10).is_empty());
    m.took(a, Took::Mine(1));
    let acts = m.poll(20);
    let (seq, set, until) = program_of(&acts).unwrap();
    assert_eq!(set, BTreeSet::from([a]));
    assert!(until > 0 && until <= 3 * S, "a finite expiry under the cap");
    assert!(
        !acts.contains(&Action::Announce(a)),
        "not before the datapath confirmed"
    );
    assert_eq!(
        m.programmed(seq, Written::Done, 30),
        vec![Action::Announce(a)]
    );
}

#[test]
fn a_refused_take_programs_nothing_and_a_lost_one_is_asked_again() {
    let a = addr_for("node-0");
    let mut m = fresh("node-0", 10, 0);
    m.observed(view(&[a], &NODES, &[]), 0);
    m.poll(0);
    m.took(a, Took::Other);
    assert!(program_of(&m.poll(10)).is_none());
    // A lost answer: the key may be this node's, so it asks again.
    m.observed(view(&[a], &NODES, &[]), 20);
    assert_eq!(m.poll(20), vec![Action::Take(a)]);
    m.took(a, Took::Lost);
    assert_eq!(m.poll(30), vec![Action::Take(a)]);
    // No longer wanted: still asked again, so the answer names the key the
    // lost take may have created, and that key is withdrawn (it was never
    // programmed).
    m.took(a, Took::Lost);
    m.observed(view(&[], &NODES, &[]), 40);
    assert_eq!(m.poll(40), vec![Action::Take(a)]);
    m.took(a, Took::Mine(5));
    assert_eq!(m.poll(50), vec![Action::Withdraw(a, KeyRef::Created(5))]);
}

#[test]
fn a_failed_or_unanswered_unprogram_is_never_followed_by_the_withdrawal() {
    let a = addr_for("node-0");
    let mut m = fresh("node-0", 10, 0);
    m.observed(view(&[a], &NODES, &[]), 0);
    hold(&mut m, a, 0);
    // The service is gone: out of the datapath first.
    m.observed(view(&[], &NODES, &[(a, "node-0", 10)]), 100);
    let acts = m.poll(100);
    let (seq, set, _) = program_of(&acts).unwrap();
    assert!(set.is_empty());
    assert!(!withdraws(&acts, a), "{acts:?}");
    // The write fails: written again, never withdrawn.
    m.programmed(seq, Written::Failed, 110);
    let acts = m.poll(120);
    assert!(!withdraws(&acts, a), "{acts:?}");
    let (seq, _, _) = program_of(&acts).expect("written again");
    // Timed out (it may land later): still not withdrawn.
    m.programmed(seq, Written::Lost, 130);
    let acts = m.poll(140);
    assert!(!withdraws(&acts, a), "{acts:?}");
    let (seq, _, _) = program_of(&acts).expect("written again");
    // Confirmed: now the key goes.
    m.programmed(seq, Written::Done, 150);
    assert_eq!(m.poll(160), vec![Action::Withdraw(a, KeyRef::Created(1))]);
    m.withdrew(a, Withdrew::Done, 170);
    assert!(m.poll(180).is_empty());
}

#[test]
fn a_datapath_that_never_confirms_keeps_the_key_until_its_writes_expired() {
    let a = addr_for("node-0");
    let mut m = fresh("node-0", 10, 0);
    m.observed(view(&[a], &NODES, &[]), 0);
    hold(&mut m, a, 0);
    m.observed(view(&[], &NODES, &[(a, "node-0", 10)]), 100);
    let mut now = 100;
    while now < 3 * S {
        for act in m.poll(now) {
            match act {
                Action::Program { seq, .. } => {
                    m.programmed(seq, Written::Lost, now);
                }
                Action::Withdraw(..) => panic!("withdrawn at {now} with the datapath in doubt"),
                _ => {}
            }
        }
        now += 200 * 1_000_000;
        m.lease_refreshed(now + 3 * S);
    }
}

#[test]
fn every_write_carries_a_finite_expiry_even_a_stop_or_a_lost_lease() {
    let a = addr_for("node-0");
    let mut m = fresh("node-0", 10, 0);
    m.observed(view(&[a], &NODES, &[]), 0);
    hold(&mut m, a, 0);
    m.lease_lost();
    let (seq, set, until) = program_of(&m.poll(10)).unwrap();
    assert!(set.is_empty() && until != 0);
    m.programmed(seq, Written::Done, 20);
    let mut m = fresh("node-0", 10, 0);
    m.observed(view(&[a], &NODES, &[]), 0);
    hold(&mut m, a, 0);
    m.stop();
    let acts = m.poll(10);
    let (seq, set, until) = program_of(&acts).unwrap();
    assert!(set.is_empty() && until != 0);
    assert!(
        !acts.contains(&Action::Revoke(10)),
        "not before the datapath is empty"
    );
    m.programmed(seq, Written::Failed, 20);
    let acts = m.poll(30);
    assert!(
        !acts.contains(&Action::Revoke(10)),
        "a failed write does not revoke"
    );
    let (seq, _, _) = program_of(&acts).unwrap();
    m.programmed(seq, Written::Done, 40);
    assert_eq!(m.poll(50), vec![Action::Revoke(10)]);
    assert!(m.stopped());
}

#[test]
fn an_address_stays_with_a_live_holder_that_is_not_its_choice() {
    // node-0 is the rendezvous choice; node-1 holds the key (it took it
    // while node-0 was away). node-0 back takes nothing; node-1 keeps it.
    let a = addr_for("node-0");
    let mut back = fresh("node-0", 20, 0);
    back.observed(view(&[a], &NODES, &[(a, "node-1", 11)]), 0);
    assert!(back.poll(0).is_empty());
    let mut holder = fresh("node-1", 11, 0);
    holder.observed(view(&[a], &NODES, &[]), 0);
    // node-1 is not the choice: it takes an unheld address only after a
    // rank step.
    assert!(holder.poll(0).is_empty());
    let step = AnnouncerConfig::for_lease(3 * S).step_ns;
    let rank = {
        let v = view(&[a], &NODES, &[]);
        let c: Vec<&str> = rank::ranking(&v.members, a, &LabelSelector::default());
        c.iter().position(|n| *n == "node-1").unwrap() as u64
    };
    holder.observed(view(&[a], &NODES, &[]), step * rank);
    hold(&mut holder, a, step * rank);
    // Held, node-0 (the choice) back under a new lease: kept, and no
    // move before node-0 has stayed `settle`.
    let members = [("node-0", 20), ("node-1", 11), ("node-2", 12)];
    let mut now = step * rank;
    for _ in 0..20 {
        now += S;
        holder.observed(view(&[a], &members, &[(a, "node-1", 11)]), now);
        holder.lease_refreshed(now + 3 * S);
        let acts = holder.poll(now);
        assert!(
            program_of(&acts).is_none_or(|(_, s, _)| s.contains(&a)),
            "{acts:?}"
        );
        assert!(!withdraws(&acts, a));
        // The datapath confirms (one that never does gives it up: below).
        if let Some((seq, _, _)) = program_of(&acts) {
            holder.programmed(seq, Written::Done, now);
        }
    }
}

#[test]
fn rebalancing_moves_only_the_first_misplaced_address_once_settled_and_quiet() {
    let cfg = AnnouncerConfig::for_lease(3 * S);
    // node-1 holds two addresses whose choice is node-0.
    let mut misplaced: Vec<IpAddr> = (1..=250)
        .map(addr)
        .filter(|a| top(*a) == "node-0")
        .take(2)
        .collect();
    misplaced.sort();
    let (a, b) = (misplaced[0], misplaced[1]);
    let mut m = fresh("node-1", 11, 0);
    let members = [("node-0", 20), ("node-1", 11), ("node-2", 12)];
    let held = [(a, "node-1", 11), (b, "node-1", 11)];
    // Claimed as this node's keys under its lease.
    m.observed(view(&[a, b], &members, &held), 0);
    let acts = m.poll(0);
    assert_eq!(acts, vec![Action::Take(a), Action::Take(b)]);
    m.took(a, Took::Mine(1));
    m.took(b, Took::Mine(2));
    let (seq, _, _) = program_of(&m.poll(0)).unwrap();
    m.programmed(seq, Written::Done, 0);
    let mut now = 0;
    let mut released = Vec::new();
    let mut in_dp = true;
    while now <= cfg.settle_ns + cfg.pace_ns + S {
        now += 200 * 1_000_000;
        m.lease_refreshed(now + 3 * S);
        m.observed(view(&[a, b], &members, &held), now);
        for act in m.poll(now) {
            match act {
                Action::Program { seq, addresses, .. } => {
                    m.programmed(seq, Written::Done, now);
                    if in_dp && !addresses.contains(&a) {
                        released.push((now, a));
                    }
                    in_dp = addresses.contains(&a);
                    assert!(addresses.contains(&b), "two at once");
                }
                Action::Withdraw(x, _) => {
                    assert_eq!(x, a);
                    assert!(now >= cfg.settle_ns, "moved before node-0 settled");
                }
                _ => {}
            }
        }
    }
    assert_eq!(released.len(), 1, "{released:?}");
}

#[test]
fn a_stale_read_does_not_make_a_withdrawn_key_look_held() {
    let a = addr_for("node-0");
    let mut m = fresh("node-0", 10, 0);
    m.observed(view(&[a], &NODES, &[]), 0);
    hold(&mut m, a, 0);
    // Gone from the state; the read still shows the key.
    let stale = view(&[], &NODES, &[(a, "node-0", 10)]);
    m.observed(stale, 100);
    let (seq, _, _) = program_of(&m.poll(100)).unwrap();
    m.programmed(seq, Written::Done, 110);
    assert_eq!(m.poll(120), vec![Action::Withdraw(a, KeyRef::Created(1))]);
    m.withdrew(a, Withdrew::Done, 130);
    // The same (now stale) read polled again: nothing taken back.
    assert!(m.poll(140).is_empty());
}

/// One fault of a kind on one node.
fn fault() -> impl Strategy<Value = Fault> {
    (
        0usize..3,
        2_000u64..30_000,
        prop_oneof![
            Just(FaultKind::Kill),
            Just(FaultKind::Stop),
            Just(FaultKind::Term),
            Just(FaultKind::Partition),
            Just(FaultKind::Lossy),
            Just(FaultKind::LinkDown),
            Just(FaultKind::FlakyMaps),
        ],
        // Around the lease on purpose: just under, just over, and longer.
        prop_oneof![200u64..2_000, 2_500u64..3_500, 3_500u64..8_000,],
    )
        .prop_map(|(node, at_ms, kind, for_ms)| Fault {
            node,
            at_ms,
            kind,
            for_ms,
        })
}

proptest! {
    #![proptest_config(crate::testing::cases(48))]

    /// Never two answering nodes for one address, and no address silent
    /// longer than the lease + 1 s while a healthy node exists, through
    /// kills, stops, graceful stops, partitions, lost and late answers,
    /// links down and map writes failing or landing late, with services
    /// deleted and applied again meanwhile (so addresses are given up and
    /// taken again, not only handed over by a lease running out).
    #[test]
    fn never_two_answer_and_none_stays_dark(
        faults in proptest::collection::vec(fault(), 0..6),
        removals in proptest::collection::vec((0usize..6, 2_000u64..35_000, 100u64..3_000), 0..8),
        seed in any::<u64>(),
    ) {
        let mut w = World::new(3, 6, &faults, seed).with_removals(&removals);
        w.run(40_000, 0);
        prop_assert!(w.outcome.doubles.is_empty(), "two answer: {:?}", &w.outcome.doubles[..w.outcome.doubles.len().min(5)]);
        prop_assert!(w.outcome.long_silences.is_empty(), "dark: {:?}", w.outcome.long_silences);
    }
}

proptest! {
    #![proptest_config(crate::testing::cases(32))]

    /// The dangerous moment of item 2 made common: a node killed early,
    /// so its addresses stay with nodes that are not their choice (sticky);
    /// then map writes failing or landing late on those nodes while their
    /// addresses are given up and applied again, so the choice takes them
    /// at once. Never two answering.
    #[test]
    fn a_write_in_doubt_is_never_followed_by_a_second_answer(
        killed in 0usize..3,
        flaky_from in 6_000u64..12_000,
        removals in proptest::collection::vec((0usize..12, 10_000u64..38_000, 200u64..1_500), 8..24),
        seed in any::<u64>(),
    ) {
        let mut faults: Vec<Fault> = (0..3)
            .filter(|node| *node != killed)
            .map(|node| Fault { node, at_ms: flaky_from, kind: FaultKind::FlakyMaps, for_ms: 40_000 })
            .collect();
        faults.push(Fault { node: killed, at_ms: 2_000, kind: FaultKind::Kill, for_ms: 4_000 });
        let mut w = World::new(3, 12, &faults, seed).with_removals(&removals);
        w.run(40_000, 0);
        prop_assert!(w.outcome.doubles.is_empty(), "two answer: {:?}", &w.outcome.doubles[..w.outcome.doubles.len().min(5)]);
    }
}

#[test]
fn a_node_stopped_just_under_or_over_the_lease_causes_no_flap() {
    // Ten stops of node-0 around the lease (2.6 s to 3.4 s), 8 s apart:
    // its addresses may move away when its lease runs out, and then stay
    // where they went (settle is ten leases).
    for seed in 0..8u64 {
        let faults: Vec<Fault> = (0..10)
            .map(|i| Fault {
                node: 0,
                at_ms: 3_000 + i * 8_000,
                kind: FaultKind::Stop,
                for_ms: 2_600 + (i * 97 + seed * 31) % 800,
            })
            .collect();
        let mut w = World::new(3, 24, &faults, seed);
        let settle = AnnouncerConfig::for_lease(TTL).settle_ns;
        w.run(85_000, settle);
        assert!(w.outcome.doubles.is_empty(), "{:?}", w.outcome.doubles);
        assert!(
            w.outcome.flaps.is_empty(),
            "seed {seed}: {:?}",
            w.outcome.flaps
        );
        assert!(
            w.outcome.long_silences.is_empty(),
            "{:?}",
            w.outcome.long_silences
        );
    }
}

#[test]
fn a_node_cut_from_etcd_and_back_darkens_nothing_when_it_rejoins() {
    // node-0 cut for 7 s: its addresses move once (failover); when it
    // comes back nothing moves and nothing goes dark.
    for seed in 0..8u64 {
        let faults = [Fault {
            node: 0,
            at_ms: 5_000,
            kind: FaultKind::Partition,
            for_ms: 7_000,
        }];
        let mut w = World::new(3, 24, &faults, seed);
        w.run(12_000, 0);
        let moves_at_cut = w.outcome.moves;
        let silence_before = w.outcome.longest_silence;
        // From the rejoin on, 16 s (before anyone's membership is old
        // enough for rebalancing): no move, no silence.
        w.outcome.longest_silence = 0;
        w.run(28_000, 0);
        assert!(w.outcome.doubles.is_empty(), "{:?}", w.outcome.doubles);
        assert_eq!(
            w.outcome.moves, moves_at_cut,
            "seed {seed}: addresses moved after the rejoin"
        );
        assert_eq!(
            w.outcome.longest_silence, 0,
            "seed {seed}: dark after the rejoin (before it: {silence_before})"
        );
    }
}

#[test]
fn a_withdrawal_applied_late_never_deletes_the_key_taken_again() {
    // Found by the property test: node-1's answers lost, its cap passed, it
    // withdrew its key (the answer lost, the request applied 660 ms
    // later), withdrew again (answered), took the address again under a
    // new lease, and then the first withdrawal landed: it deleted the new
    // key while node-1 answered, and node-0 took the address too. A
    // withdrawal names its key (create revision, or a lease given up).
    let faults = [Fault {
        node: 1,
        at_ms: 5331,
        kind: FaultKind::Lossy,
        for_ms: 2610,
    }];
    let mut w = World::new(3, 6, &faults, 9_785_027_987_686_028_784);
    w.run(12_000, 0);
    assert!(w.outcome.doubles.is_empty(), "{:?}", w.outcome.doubles);
}

#[test]
fn ci_counterexample_of_5ff72b3_a_write_retried_through_flaky_maps_darkens_nothing_past_the_bound()
{
    // Drawn by CI at 5ff72b3 (and committed to the regressions file): node-2
    // withdrew an address given up then applied again while its map
    // writes failed, took it again and was killed before programming it;
    // the address was dark a whole lease. The bound counts from the last
    // renewal of the lease that held it, and the driver reads and renews
    // while writes are retried.
    let faults = [
        Fault {
            node: 2,
            at_ms: 9351,
            kind: FaultKind::Partition,
            for_ms: 3150,
        },
        Fault {
            node: 0,
            at_ms: 15621,
            kind: FaultKind::Partition,
            for_ms: 5210,
        },
        Fault {
            node: 2,
            at_ms: 26005,
            kind: FaultKind::FlakyMaps,
            for_ms: 1886,
        },
        Fault {
            node: 1,
            at_ms: 7181,
            kind: FaultKind::Lossy,
            for_ms: 1320,
        },
        Fault {
            node: 2,
            at_ms: 28421,
            kind: FaultKind::Kill,
            for_ms: 2500,
        },
    ];
    let removals = [(4, 24344, 1657), (2, 26019, 313)];
    replay(&faults, &removals, 5_570_905_772_620_306_082);
}

/// Runs three nodes and six addresses through `faults` and `removals` for
/// 40 s: never two answering, no silence past the bounds.
fn replay(faults: &[Fault], removals: &[(usize, u64, u64)], seed: u64) {
    let mut w = World::new(3, 6, faults, seed).with_removals(removals);
    w.run(40_000, 0);
    assert!(w.outcome.doubles.is_empty(), "{:?}", w.outcome.doubles);
    assert!(
        w.outcome.long_silences.is_empty(),
        "{:?}",
        w.outcome.long_silences
    );
}

/// The rendezvous choice among the model's three nodes of the model's
/// address `i` (192.0.2.10 + i).
fn model_top(i: u8) -> String {
    top(addr(10 + i))
}

#[test]
fn a_node_that_cannot_program_an_address_gives_it_up_within_a_rank_step() {
    // node-0's announcement map is full from 4 s to 24 s: every write
    // fails, nothing inserted (what it answered already stays). Its
    // addresses are withdrawn at 6 s and applied again at 7 s, so node-0,
    // their choice, takes them back and cannot program them. It must give
    // each up within a rank step, and another node answer within the
    // bound, not leave them dark until the map has room.
    let cfg = AnnouncerConfig::for_lease(TTL);
    let mine: Vec<usize> = (0..6u8)
        .filter(|i| model_top(*i) == "node-0")
        .map(usize::from)
        .collect();
    assert!(!mine.is_empty(), "node-0 is the choice of some address");
    for seed in 0..8u64 {
        let faults = [Fault {
            node: 0,
            at_ms: 4_000,
            kind: FaultKind::MapFull,
            for_ms: 20_000,
        }];
        let removals: Vec<(usize, u64, u64)> = mine.iter().map(|i| (*i, 6_000, 1_000)).collect();
        let mut w = World::new(3, 6, &faults, seed).with_removals(&removals);
        w.run(24_000, 0);
        assert!(w.outcome.doubles.is_empty(), "{:?}", w.outcome.doubles);
        assert!(
            w.outcome.long_silences.is_empty(),
            "seed {seed}: {:?} (bounds {:?})",
            w.outcome.long_silences,
            w.bounds
        );
        for i in &mine {
            let a = addr(10 + *i as u8);
            // After the re-apply at 7 s: answered by another node within a
            // rank step (node-0 gives it up) and the bound of a key nobody
            // holds (the others' ranks, read, take and write).
            let at = w
                .outcome
                .silences
                .iter()
                .find(|(x, from, _)| *x == a && *from > 6_000 * MS)
                .map(|(_, _, to)| *to)
                .unwrap_or_else(|| panic!("seed {seed}: {a} never answered after 7 s"));
            let by = w.history[&a].last().expect("answered").0;
            assert_ne!(by, 0, "node-0 cannot answer");
            let within = cfg.step_ns + w.bounds.free;
            assert!(
                at - 7_000 * MS <= within,
                "seed {seed}: {a} dark {} ms after its re-apply (bound {} ms)",
                (at - 7_000 * MS) / MS,
                within / MS
            );
        }
    }
}

#[test]
fn a_write_read_back_after_a_stop_renews_no_entry_that_had_expired() {
    // Found by `cargo xtask explore`: node-1, stopped past its cap, came
    // back under a new lease with flaky maps; a failed write read back
    // its old entries (present, expired) as answered, and the renewer
    // brought them back to life under the new cap while node-0 held the
    // keys. A read back counts live entries only.
    let faults = [
        Fault {
            node: 1,
            at_ms: 11123,
            kind: FaultKind::FlakyMaps,
            for_ms: 3068,
        },
        Fault {
            node: 1,
            at_ms: 10871,
            kind: FaultKind::Stop,
            for_ms: 2540,
        },
        Fault {
            node: 0,
            at_ms: 3611,
            kind: FaultKind::Term,
            for_ms: 4150,
        },
    ];
    replay(&faults, &[(2, 9101, 140)], 4_145_005_733_891_278_206);
}

#[test]
fn the_keeper_refreshes_every_lease_and_the_drivers_never_need_to() {
    // 3 nodes, 24 addresses, 30 s with no fault: every refresh is the
    // keeper's (one a third of the TTL after the last, from the grant
    // on), none a driver's, and nothing answers twice or stays dark.
    for seed in 0..4u64 {
        let mut w = World::new(3, 24, &[], seed);
        w.run(30_000, 0);
        let o = &w.outcome;
        assert!(o.doubles.is_empty(), "seed {seed}: {:?}", o.doubles);
        assert!(
            o.long_silences.is_empty(),
            "seed {seed}: {:?}",
            o.long_silences
        );
        assert_eq!(o.driver_refreshes, 0, "seed {seed}");
        let per_node = (30_000 - 1_000) / (TTL / 3 / MS) as usize;
        assert!(
            o.keeper_refreshes >= 3 * per_node,
            "seed {seed}: {} refreshes, at least {} due",
            o.keeper_refreshes,
            3 * per_node
        );
    }
}

#[test]
fn a_rebalanced_address_whose_choice_cannot_take_it_is_taken_back_as_the_last_rank() {
    // Found by exploration: node-0 cut off (it revokes its lease), node-1
    // lossy with its old lease still alive in etcd, so it stays a member
    // and the rendezvous choice of 192.0.2.10 but cannot take it. node-2
    // gives the address up to node-1 to rebalance. It used to refuse it
    // for a whole pace (the lease, 3 s: 3.2 s dark); as the last rank it
    // takes it back within the bound of any address nobody holds.
    let faults = [
        Fault {
            node: 1,
            at_ms: 27_371,
            kind: FaultKind::Lossy,
            for_ms: 5_930,
        },
        Fault {
            node: 0,
            at_ms: 27_891,
            kind: FaultKind::LinkDown,
            for_ms: 5_400,
        },
        Fault {
            node: 0,
            at_ms: 7_666,
            kind: FaultKind::Kill,
            for_ms: 2_565,
        },
    ];
    replay(&faults, &[(3, 2_081, 100)], 6_749_882_640_575_698_994);
}

/// What the announcer derives from its view and keeps between changes
/// (its memberships, its place in each ranking, the first misplaced
/// address) is what a fresh computation from the view says.
fn derived_is_fresh(a: &Announcer) -> Result<(), TestCaseError> {
    let Some(view) = a.view.clone() else {
        return Ok(());
    };
    // The first address held by an admitted member that is not its
    // first choice, by the whole rankings.
    let fresh = view.addresses.iter().find_map(|(x, sel)| {
        let h = view.holders.get(x)?;
        let rank = rank::ranking(&view.members, *x, sel);
        let top = *rank.first()?;
        (rank.contains(&h.node.as_str()) && top != h.node)
            .then(|| (*x, h.node.clone(), top.to_owned()))
    });
    let kept = a.misplaced(&view).map(|m| (m.address, m.holder, m.top));
    prop_assert_eq!(kept, fresh);
    for (addr, sel) in &view.addresses {
        let rank = rank::ranking(&view.members, *addr, sel);
        let fresh = rank
            .iter()
            .position(|n| *n == a.me)
            .map(|p| (p, rank.len()));
        prop_assert_eq!(a.my_rank(*addr), fresh);
        let refusing = !a.answers();
        let fresh = view.members.iter().any(|(c, _)| {
            c.name == a.me
                && (rank::admits(c, sel)
                    || (refusing && (sel.is_empty() || sel.matches(&c.labels))))
        });
        prop_assert_eq!(a.admitted(*addr), fresh);
    }
    Ok(())
}

proptest! {
    #![proptest_config(crate::testing::cases(64))]

    /// The whole-view computations are the oracle of what the announcer
    /// keeps between reads: after every read, tick and answer (a take or
    /// withdrawal answered changes the view it keeps), they agree.
    #[test]
    fn what_the_announcer_keeps_between_reads_is_what_its_view_says(
        reads in proptest::collection::vec(
            (
                proptest::collection::vec(any::<bool>(), 4),
                proptest::collection::vec(0u8..6, 6),
                proptest::collection::vec(0u8..3, 8),
            ),
            1..8,
        ),
    ) {
        let addrs: Vec<IpAddr> = (0..6u8).map(|i| IpAddr::V4(Ipv4Addr::new(192, 0, 2, i))).collect();
        let mut a = Announcer::new("node-0", AnnouncerConfig::for_lease(TTL));
        let mut now = 1_000 * MS;
        a.lease_granted(7, now + TTL);
        let mut rev = 0;
        for (members, holders, answers) in reads {
            let view = Observation {
                addresses: addrs.iter().map(|x| (*x, LabelSelector::default())).collect(),
                members: members
                    .iter()
                    .enumerate()
                    .filter(|(i, on)| **on || *i == 0)
                    .map(|(i, on)| {
                        let c = Candidate { name: format!("node-{i}"), labels: BTreeMap::new(), answers: *on };
                        (c, 7 + i as i64)
                    })
                    .collect(),
                holders: addrs
                    .iter()
                    .zip(&holders)
                    .filter(|(_, h)| **h < 4)
                    .map(|(x, h)| (*x, Holder { node: format!("node-{h}"), lease: 7 + i64::from(*h) }))
                    .collect(),
            };
            a.observed(view, now);
            derived_is_fresh(&a)?;
            // Followed from read to read by what changed, the memberships
            // with a since-time are those of the read that answer.
            let answering: BTreeSet<(String, i64)> = a
                .view
                .as_ref()
                .map(|v| {
                    v.members
                        .iter()
                        .filter(|(c, _)| c.answers)
                        .map(|(c, l)| (c.name.clone(), l))
                        .collect()
                })
                .unwrap_or_default();
            prop_assert_eq!(a.member_since.keys().cloned().collect::<BTreeSet<_>>(), answering);
            for answer in &answers {
                now += 200 * MS;
                a.lease_refreshed(now + TTL);
                let mut queue = a.poll(now);
                derived_is_fresh(&a)?;
                while let Some(act) = queue.pop() {
                    match act {
                        Action::Take(x) => {
                            rev += 1;
                            let took = match answer {
                                0 => Took::Mine(rev),
                                1 => Took::Other,
                                _ => Took::Lost,
                            };
                            a.took(x, took);
                        }
                        Action::Withdraw(x, _) => {
                            let w = if *answer == 2 { Withdrew::Lost } else { Withdrew::Done };
                            a.withdrew(x, w, now);
                        }
                        Action::Program { seq, .. } => {
                            queue.extend(a.programmed(seq, Written::Done, now));
                        }
                        _ => {}
                    }
                    derived_is_fresh(&a)?;
                }
            }
        }
    }
}
