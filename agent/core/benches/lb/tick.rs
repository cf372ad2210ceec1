//! An LB holder's work per tick against the member count (#47): the
//! announcer of a node holding 10 of 40 addresses, in a cluster of 10 or
//! 1,000 members, ticked with nothing read in between (the daemon hands
//! over no read while `lb/` is unchanged). Its per-tick cost must not
//! grow with the members.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::time::Instant;

use lockstep_core::lb::LabelSelector;
use lockstep_core::lb::announce::{
    Action, Announcer, AnnouncerConfig, Holder, Observation, Took, Written,
};
use lockstep_core::lb::cluster::Candidate;

const MS: u64 = 1_000_000;
const TTL: u64 = 3_000 * MS;
const LEASE: i64 = 7;

/// The cluster: `members` nodes, 40 addresses; node-0 holds every fourth,
/// the others are held by node-1 (so most are not where their rendezvous
/// choice is, the case that costs most).
fn view(members: usize) -> Observation {
    let addrs: Vec<IpAddr> = (0..40u8)
        .map(|i| IpAddr::V4(Ipv4Addr::new(192, 0, 2, i)))
        .collect();
    Observation {
        addresses: addrs
            .iter()
            .map(|a| (*a, LabelSelector::default()))
            .collect(),
        members: (0..members)
            .map(|i| {
                (
                    Candidate {
                        name: format!("node-{i}"),
                        labels: BTreeMap::new(),
                        answers: true,
                    },
                    LEASE + i as i64,
                )
            })
            .collect(),
        holders: addrs
            .iter()
            .enumerate()
            .map(|(i, a)| {
                let (node, lease) = if i % 4 == 0 {
                    (0, LEASE)
                } else {
                    (1, LEASE + 1)
                };
                (
                    *a,
                    Holder {
                        node: format!("node-{node}"),
                        lease,
                    },
                )
            })
            .collect(),
    }
}

/// Answers `actions` as a healthy etcd and datapath would.
fn answer(a: &mut Announcer, actions: Vec<Action>, now: u64) {
    let mut rev = 100;
    let mut queue = actions;
    while let Some(act) = queue.pop() {
        match act {
            Action::Take(addr) => {
                rev += 1;
                a.took(addr, Took::Mine(rev));
            }
            Action::Program { seq, .. } => queue.extend(a.programmed(seq, Written::Done, now)),
            _ => {}
        }
    }
}

/// node-0's announcer having read `view`, settled: every address of its
/// own taken and written; and the time then.
fn settled(view: Observation) -> (Announcer, u64) {
    let mut a = Announcer::new("node-0", AnnouncerConfig::for_lease(TTL));
    let mut now = 1_000 * MS;
    a.lease_granted(LEASE, now + TTL);
    a.observed(view, now);
    for _ in 0..5 {
        now += 200 * MS;
        a.lease_refreshed(now + TTL);
        let acts = a.poll(now);
        answer(&mut a, acts, now);
    }
    assert_eq!(a.held().len(), 10, "node-0 holds its ten addresses");
    (a, now)
}

/// Nanoseconds per tick (median of `runs`, each `ticks` ticks 200 ms
/// apart) of node-0's announcer among `members` members.
pub fn per_tick(members: usize, runs: usize, ticks: usize) -> f64 {
    let mut xs = Vec::with_capacity(runs);
    for _ in 0..runs {
        let (mut a, mut now) = settled(view(members));
        let t = Instant::now();
        for _ in 0..ticks {
            now += 200 * MS;
            a.lease_refreshed(now + TTL);
            let acts = a.poll(now);
            answer(&mut a, std::hint::black_box(acts), now);
        }
        xs.push(t.elapsed().as_nanos() as f64 / ticks as f64);
    }
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Nanoseconds per membership change (median of `runs`, each `changes`
/// changes) to node-0's announcer among `members` members: another
/// node's membership written again under a new lease, the view read
/// and the tick that follows: what each holder pays once per change, not
/// per tick. Places and first choices follow the changed membership
/// (`standing`) rather than being worked out again from every member.
pub fn per_view_change(members: usize, runs: usize, changes: usize) -> f64 {
    let mut xs = Vec::with_capacity(runs);
    for _ in 0..runs {
        let mut v = view(members);
        let (mut a, mut now) = settled(v.clone());
        let t = Instant::now();
        for k in 0..changes {
            // The last node's membership, under a new lease.
            let name = format!("node-{}", members - 1);
            v.members.remove_node(&name);
            v.members.insert(
                Candidate {
                    name,
                    labels: BTreeMap::new(),
                    answers: true,
                },
                LEASE + (members + k) as i64,
            );
            now += 200 * MS;
            a.lease_refreshed(now + TTL);
            a.observed(v.clone(), now);
            let acts = a.poll(now);
            answer(&mut a, std::hint::black_box(acts), now);
        }
        xs.push(t.elapsed().as_nanos() as f64 / changes as f64);
    }
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}
