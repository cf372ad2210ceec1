//! The failover prober of #27 ("Show it with"): three node namespaces on a
//! bridge, a neighbour namespace probing all 24 dual-stack LB addresses
//! (ARP and NDP) every 100 ms and capturing every reply and announcement,
//! a real 3-member etcd, the LB lease 2 s. One capture runs through every
//! fault in turn, each on the node announcing the most at the time:
//! SIGKILL (restarted), SIGSTOP just under the lease (1.6 s, six times)
//! and just over it (2.6 s, twice), the uplink set down, its carrier lost,
//! the node cut from the underlay and etcd for 7 s, and cut from etcd alone
//! for 7 s; after each, the node rejoins and is watched for 8 s.
//!
//! Judged over the whole capture:
//! - no probe round answered by two MACs;
//! - no address silent longer than the lease + 1 s;
//! - no address darkened by a rejoin (answered just before the node came
//!   back, then unanswered for more than 1 s within 8 s of it);
//! - no address flapped by a rejoin (went away from the node at its
//!   fault and came straight back to it, moved by a node under no fault;
//!   rebalancing toward a node waits ten leases, 20 s, after it rejoined
//!   and may fall in a later fault's window: it moves other addresses);
//! - every handover (a change of answering MAC) announced by the new MAC
//!   (gratuitous ARP / unsolicited NA).
//!
//! The figures are printed; run against the build before #27 item 1
//! (`LOCKSTEP_BIN` pointing at it) the rejoins darken and flap addresses.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use lockstep_tests::etcd::EtcdCluster;
use lockstep_tests::lb_lab::{Capture, Kind, LEASE, Lab, Seen, TAGS, signal};
use lockstep_tests::privileged;

/// The lease under test ([`LEASE`]).
const LEASE_D: Duration = Duration::from_secs(2);
/// How often the neighbour probes.
const EVERY: Duration = Duration::from_millis(100);
/// How long a rejoined node is watched.
const AFTER: Duration = Duration::from_secs(8);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    Kill,
    StopUnder,
    StopOver,
    LinkDown,
    CarrierLoss,
    /// The uplink down and etcd unreachable (cut from everything).
    Cut,
    /// etcd unreachable, the uplink up.
    EtcdCut,
}

/// One fault: on which node, when it began, when the node was back.
#[derive(Debug)]
struct Event {
    fault: Fault,
    node: usize,
    at: Instant,
    back: Instant,
}

/// Injects `fault` on node `x`, lets it last, ends it; returns when the
/// node was back.
fn inject(lab: &mut Lab, fault: Fault, x: usize) -> anyhow::Result<Instant> {
    let pid = lab.agents[x].pid().context("agent pid")?;
    match fault {
        Fault::Kill => {
            lab.agents[x].kill9();
            std::thread::sleep(Duration::from_secs(4));
            lab.agents[x].restart()?;
        }
        Fault::StopUnder | Fault::StopOver => {
            signal(pid, "-STOP")?;
            std::thread::sleep(if fault == Fault::StopUnder {
                Duration::from_millis(1600)
            } else {
                Duration::from_millis(2600)
            });
            signal(pid, "-CONT")?;
        }
        Fault::LinkDown => {
            lab.ns[x].exec("ip", ["link", "set", "u0", "down"])?;
            std::thread::sleep(Duration::from_secs(4));
            lab.ns[x].exec("ip", ["link", "set", "u0", "up"])?;
        }
        Fault::CarrierLoss => {
            let port = format!("ul{x}");
            lab.underlay.exec("ip", ["link", "set", &port, "down"])?;
            std::thread::sleep(Duration::from_secs(4));
            lab.underlay.exec("ip", ["link", "set", &port, "up"])?;
        }
        Fault::Cut => {
            lab.ns[x].exec("ip", ["link", "set", "u0", "down"])?;
            lab.cuts[x].set(true);
            std::thread::sleep(Duration::from_secs(7));
            lab.cuts[x].set(false);
            lab.ns[x].exec("ip", ["link", "set", "u0", "up"])?;
        }
        Fault::EtcdCut => {
            lab.cuts[x].set(true);
            std::thread::sleep(Duration::from_secs(7));
            lab.cuts[x].set(false);
        }
    }
    Ok(Instant::now())
}

/// Per address, each probe round's answering MACs.
type Answers = BTreeMap<IpAddr, BTreeMap<usize, BTreeSet<[u8; 6]>>>;

/// Attributes each reply to the last round sent with its tag before it
/// was received.
fn answers(seen: &[Seen], rounds: &[Instant]) -> Answers {
    let mut out: Answers = BTreeMap::new();
    for s in seen.iter().filter(|s| s.kind == Kind::Reply) {
        let Some(tag) = s.tag else { continue };
        let upto = rounds.partition_point(|r| *r <= s.at);
        if let Some(i) = (upto.saturating_sub(TAGS)..upto)
            .rev()
            .find(|i| i % TAGS == tag)
        {
            out.entry(s.addr)
                .or_default()
                .entry(i)
                .or_default()
                .insert(s.mac);
        }
    }
    out
}

/// A change of the MAC answering an address.
#[derive(Debug)]
struct Move {
    addr: IpAddr,
    /// The first round the new MAC answered.
    at: Instant,
    from: [u8; 6],
    to: [u8; 6],
    /// Whether the new MAC sent a gratuitous ARP / unsolicited NA for it.
    announced: bool,
}

/// What the judge found.
#[derive(Debug, Default)]
struct Verdict {
    overlaps: Vec<String>,
    /// (address, from, length, the MAC answering before) of every silence
    /// of more than one round.
    silences: Vec<(IpAddr, Instant, Duration, [u8; 6])>,
    handovers: Vec<Move>,
}

fn judge(seen: &[Seen], rounds: &[Instant], targets: &[IpAddr], lab: &Lab) -> Verdict {
    let by_round = answers(seen, rounds);
    let mut v = Verdict::default();
    for a in targets {
        let empty = BTreeMap::new();
        let mine = by_round.get(a).unwrap_or(&empty);
        // The answering MAC per round (None: unanswered), from the first
        // answer on.
        let Some(first) = mine.keys().next().copied() else {
            v.overlaps.push(format!("{a}: never answered"));
            continue;
        };
        let mut last: Option<(usize, [u8; 6])> = None;
        for i in first..rounds.len().saturating_sub(TAGS) {
            let Some(macs) = mine.get(&i) else { continue };
            if macs.len() > 1 {
                v.overlaps.push(format!(
                    "{a}: round {i} answered by {:?}",
                    macs.iter().map(|m| lab.node_of(*m)).collect::<Vec<_>>()
                ));
            }
            let mac = *macs.iter().next().expect("non-empty");
            if let Some((j, prev)) = last {
                if i > j + 1 {
                    v.silences
                        .push((*a, rounds[j], rounds[i] - rounds[j], prev));
                }
                if prev != mac {
                    let at = rounds[i];
                    let announced = seen.iter().any(|s| {
                        s.addr == *a
                            && s.kind == Kind::Announce
                            && s.mac == mac
                            && s.at + Duration::from_millis(1500) >= at
                            && s.at <= at + Duration::from_secs(1)
                    });
                    v.handovers.push(Move {
                        addr: *a,
                        at,
                        from: prev,
                        to: mac,
                        announced,
                    });
                }
            }
            last = Some((i, mac));
        }
    }
    v
}

#[test]
fn failover_prober_kills_stops_links_cuts_and_rejoins() -> anyhow::Result<()> {
    privileged!();
    let cluster = EtcdCluster::start(3)?;
    let prefix = format!("/{}/", lockstep_tests::unique("lbfp"));
    let mut lab = Lab::with_services(&cluster, &prefix, Some(LEASE), 12)?;
    let targets: Vec<IpAddr> = lab.announcers(0)?.keys().copied().collect();
    ensure!(targets.len() == 24, "{targets:?}");
    let cap = Capture::start(&lab, targets.clone(), EVERY)?;
    std::thread::sleep(Duration::from_secs(2));
    let mut plan = vec![Fault::Kill];
    plan.extend([Fault::StopUnder; 6]);
    plan.extend([Fault::StopOver; 2]);
    plan.extend([
        Fault::LinkDown,
        Fault::CarrierLoss,
        Fault::Cut,
        Fault::EtcdCut,
    ]);
    let mut events = Vec::new();
    let run = (|| -> anyhow::Result<()> {
        for fault in plan {
            let (x, held) = lab.busiest()?;
            let at = Instant::now();
            let back = inject(&mut lab, fault, x)?;
            eprintln!(
                "{fault:?} on node-{x} ({} addresses), back after {:?}",
                held.len(),
                back - at
            );
            events.push(Event {
                fault,
                node: x,
                at,
                back,
            });
            std::thread::sleep(AFTER);
        }
        Ok(())
    })();
    let (seen, rounds) = cap.finish()?;
    run?;
    let v = judge(&seen, &rounds, &targets, &lab);

    // Each rejoin's window: from the node's return until the next fault
    // (at most AFTER).
    let windows: Vec<(Instant, Instant)> = events
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let next = events.get(i + 1).map_or(e.back + AFTER, |n| n.at);
            (e.back, next.min(e.back + AFTER))
        })
        .collect();
    // Darkened by a rejoin: an address another node answered until the
    // node came back (or later), then silent for more than 1 s, the
    // silence starting before the next fault. (The rejoining node's own
    // addresses were dark during its fault: the lease + 1 s bound judges
    // those.) A silence's start is its last answered round, so one that
    // begins within half a second of the next fault is that fault's (the
    // same slack the per-fault figures use below): CI once counted the
    // node cut next, silent from the cut, as darkened by the rejoin before.
    let mut darkened = Vec::new();
    for (e, (from_w, to_w)) in events.iter().zip(&windows) {
        for (a, from, len, mac) in &v.silences {
            if *from + Duration::from_millis(300) >= *from_w
                && *from + Duration::from_millis(500) < *to_w
                && *len > Duration::from_secs(1)
                && *mac != lab.macs[e.node]
            {
                darkened.push(format!(
                    "{a}: {len:?} after node-{} rejoined ({:?})",
                    e.node, e.fault
                ));
            }
        }
    }
    // A move away from a node under no fault (within the lease + 2 s of
    // one) is voluntary: the rejoin of another node pulled it, or
    // rebalancing. Flapped by a rejoin: an address that went away from the
    // node at its fault and came straight back to it, voluntarily, within
    // its window. Rebalancing (ten leases, 20 s, after a node rejoined,
    // one address at a time) may move other addresses to a node inside a
    // later fault's window: CI once ran the plan so that the rebalancing
    // after node-2's kill fell 1 s after one of its stops; those are not
    // flaps, as they never went away at that fault.
    let faulted = |node: usize, at: Instant| {
        events.iter().any(|e| {
            e.node == node && e.at <= at && at <= e.back + LEASE_D + Duration::from_secs(2)
        })
    };
    let node_of = |mac: [u8; 6]| lab.macs.iter().position(|m| *m == mac);
    let voluntary: Vec<&Move> = v
        .handovers
        .iter()
        .filter(|m| node_of(m.from).is_some_and(|n| !faulted(n, m.at)))
        .collect();
    let mut flaps = Vec::new();
    for (e, (from_w, to_w)) in events.iter().zip(&windows) {
        for m in &voluntary {
            let went_away = || {
                v.handovers.iter().any(|away| {
                    away.addr == m.addr
                        && node_of(away.from) == Some(e.node)
                        && away.at >= e.at
                        && away.at < m.at
                })
            };
            if node_of(m.to) == Some(e.node) && m.at >= *from_w && m.at < *to_w && went_away() {
                flaps.push(format!(
                    "{}: {} -> node-{} {:?} after node-{} rejoined ({:?})",
                    m.addr,
                    lab.node_of(m.from),
                    e.node,
                    m.at - e.back,
                    e.node,
                    e.fault
                ));
            }
        }
    }
    let bound = LEASE_D + Duration::from_secs(1);
    let longest = v
        .silences
        .iter()
        .max_by_key(|(_, _, l, _)| *l)
        .map(|(a, _, l, _)| (*a, *l));
    for e in &events {
        let own: Vec<Duration> = v
            .silences
            .iter()
            .filter(|(_, from, ..)| {
                *from + Duration::from_millis(500) >= e.at && *from < e.back + AFTER
            })
            .map(|(_, _, l, _)| *l)
            .collect();
        let moved = v
            .handovers
            .iter()
            .filter(|m| m.at >= e.at && m.at < e.back + AFTER)
            .count();
        eprintln!(
            "{:?} node-{}: {moved} handovers, longest silence {:?}",
            e.fault,
            e.node,
            own.iter().max().copied().unwrap_or_default()
        );
    }
    let unannounced: Vec<String> = v
        .handovers
        .iter()
        .filter(|m| !m.announced)
        .map(|m| {
            format!(
                "{} {} -> {}",
                m.addr,
                lab.node_of(m.from),
                lab.node_of(m.to)
            )
        })
        .collect();
    eprintln!(
        "faults {}, probe rounds {}, handovers {} (voluntary {}), overlaps {}, longest silence {longest:?} (bound {bound:?}), darkened by a rejoin {}, flapped by a rejoin {}, handovers without an announcement {}",
        events.len(),
        rounds.len(),
        v.handovers.len(),
        voluntary.len(),
        v.overlaps.len(),
        darkened.len(),
        flaps.len(),
        unannounced.len()
    );
    eprintln!("darkened: {darkened:#?}\nflaps: {flaps:#?}");
    for m in &voluntary {
        eprintln!(
            "voluntary move: {} {} -> {} at {:?} from the start",
            m.addr,
            lab.node_of(m.from),
            lab.node_of(m.to),
            m.at - rounds[0]
        );
    }
    ensure!(
        v.overlaps.is_empty(),
        "answered by two MACs: {:#?}",
        v.overlaps
    );
    ensure!(
        longest.is_none_or(|(_, l)| l <= bound),
        "an address silent longer than the lease + 1 s: {longest:?}"
    );
    ensure!(darkened.is_empty(), "darkened by a rejoin: {darkened:#?}");
    ensure!(flaps.is_empty(), "flapped by a rejoin: {flaps:#?}");
    ensure!(
        unannounced.is_empty(),
        "handovers without a gratuitous ARP / NA: {unannounced:?}"
    );
    drop(lab);
    Ok(())
}
