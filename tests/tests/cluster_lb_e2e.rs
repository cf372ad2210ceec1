//! LoadBalancer addresses across a cluster (#13), end to end: three node
//! namespaces whose `u0` sit on a bridge underlay, a neighbour namespace on
//! the same bridge, a real 3-member etcd and one agent per node.
//!
//! - `fifty_services_from_two_nodes_are_assigned_once_and_answered_once`:
//!   50 dual-stack services applied from two nodes at once are each given
//!   addresses once; `lb get` agrees on every node; an ARP request and a
//!   Neighbor Solicitation per address from the neighbour get exactly one
//!   answer, from the MAC of the node `lb get` names; a deleted service's
//!   addresses are not answered once `lb delete` returned.
//! - `node_selector_admits_only_matching_announcers`: nodes labelled
//!   zone=a, b, b; a pool selecting zone=b is answered only by node-1 or
//!   node-2's MAC, and when its announcer is SIGKILLed the addresses move
//!   to the other zone=b node, never node-0; a pool selecting zone=c (no
//!   such node) is answered by nobody and `lb get` / metrics name it.
//! - `failover_never_answers_from_two_nodes`: the announcing agent is
//!   SIGKILLed, SIGSTOPped, and its namespace cut from the underlay (link
//!   down, etcd unreachable) while the neighbour probes every 50 ms and
//!   captures every reply: no probe round is answered by two MACs, the new
//!   announcer's gratuitous ARP / unsolicited NA is seen, the gap is
//!   measured and printed; the same holds when the node comes back and
//!   takes its addresses back. Then SIGTERM: the agent unprograms and
//!   revokes its lease on the way out, so the gap is under 1.5 s (a tick,
//!   not a lease). Then the uplink alone set down, and the uplink's carrier
//!   lost (its switch port, the bridge-side veth, set down) with etcd still
//!   reachable: the agent stops refreshing its lease and the addresses
//!   move as for a kill.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use lockstep_tests::cluster::{apply_pools, cni};
use lockstep_tests::etcd::EtcdCluster;
use lockstep_tests::lb_lab::{
    Capture, Handover, Kind, LEASE, Lab, POOL, addresses, judge, probe_once, service, services,
    settled, signal, wait_answered_elsewhere,
};
use lockstep_tests::{Netns, pct, privileged, wait_for};

#[test]
fn fifty_services_from_two_nodes_are_assigned_once_and_answered_once() -> anyhow::Result<()> {
    privileged!();
    let cluster = EtcdCluster::start(3)?;
    let prefix = format!("/{}/", lockstep_tests::unique("lbe2e"));
    // The default lease: this test is not about failover.
    let lab = Lab::build(&cluster, &prefix, None)?;
    lab.apply(0, POOL)?;

    // a. Two nodes apply overlapping halves at once (s15..s34 from both).
    let started = Instant::now();
    std::thread::scope(|s| -> anyhow::Result<()> {
        let a = s.spawn(|| lab.apply(0, &services(0..35)));
        let b = s.spawn(|| lab.apply(1, &services(15..50)));
        a.join().map_err(|_| anyhow::anyhow!("apply panicked"))??;
        b.join().map_err(|_| anyhow::anyhow!("apply panicked"))??;
        Ok(())
    })?;
    let view = wait_for(
        "50 services with 2 addresses each, 100 announced",
        Duration::from_secs(60),
        || {
            let v = lab.get(2).ok()?;
            let a = addresses(&v).ok()?;
            let announced = v["cluster"]["announcements"].as_object()?.len();
            (a.len() == 50 && a.values().all(|x| x.len() == 2) && announced == 100).then_some(v)
        },
    )?;
    eprintln!(
        "50 services assigned and announced {:?} after the applies",
        started.elapsed()
    );
    let by_service = addresses(&view)?;
    let all: Vec<IpAddr> = by_service.values().flatten().copied().collect();
    let unique: BTreeSet<IpAddr> = all.iter().copied().collect();
    ensure!(
        all.len() == 100 && unique.len() == 100,
        "addresses not unique: {by_service:?}"
    );
    // `lb get` agrees on every node (leases left aside: they tick).
    let strip = |mut v: serde_json::Value| {
        if let Some(m) = v["cluster"]["announcements"].as_object_mut() {
            for x in m.values_mut() {
                x["lease_left_s"] = serde_json::Value::Null;
            }
        }
        v
    };
    // Read at three moments: equal once no handover runs between them.
    let agreed = Instant::now();
    loop {
        let views: Vec<serde_json::Value> = (0..3)
            .map(|i| Ok(strip(lab.get(i)?)))
            .collect::<anyhow::Result<_>>()?;
        if views[1] == views[0] && views[2] == views[0] {
            break;
        }
        let differ: Vec<String> = ["pools", "services", "cluster"]
            .iter()
            .flat_map(|k| {
                let views = &views;
                (1..3)
                    .filter(move |i| views[*i][*k] != views[0][*k])
                    .map(move |i| format!("node-{i} {k}"))
            })
            .collect();
        eprintln!("lb get differs ({differ:?}); reading again");
        if agreed.elapsed() > Duration::from_secs(9) {
            for (i, a) in lab.agents.iter().enumerate() {
                let log = a.log();
                let lines: Vec<&str> = log
                    .lines()
                    .filter(|l| l.contains("lb ") || l.contains("lease"))
                    .collect();
                eprintln!(
                    "node-{i} log ({} lines): {:#?}",
                    lines.len(),
                    &lines[lines.len().saturating_sub(15)..]
                );
            }
        }
        ensure!(
            agreed.elapsed() < Duration::from_secs(10),
            "lb get differs for 10 s: {differ:?}\n{}\n{}\n{}",
            views[0],
            views[1],
            views[2]
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let per_node: BTreeMap<usize, usize> =
        lab.announcers(0)?
            .values()
            .fold(BTreeMap::new(), |mut m, n| {
                *m.entry(*n).or_default() += 1;
                m
            });
    eprintln!("announcements per node: {per_node:?}");

    // b. One probe per address: exactly one answer, from the announcer.
    let announcers = lab.announcers(0)?;
    let targets: Vec<IpAddr> = unique.iter().copied().collect();
    let answers = probe_once(&lab, &targets, Duration::from_millis(1500))?;
    for a in &targets {
        let node = announcers
            .get(a)
            .with_context(|| format!("{a} not announced"))?;
        let got = answers.get(a).cloned().unwrap_or_default();
        ensure!(
            got.len() == 1 && got[0] == lab.macs[*node],
            "{a}: answers from {:?}, announcer node-{node}",
            got.iter().map(|m| lab.node_of(*m)).collect::<Vec<_>>()
        );
    }

    // Metrics: each node lists what it announces, one assigner, leases
    // left, handovers counted.
    let (mut assigners, mut takes) = (0, 0);
    for i in 0..3 {
        let m = lab.metrics(i)?;
        let value = |name: &str| -> anyhow::Result<f64> {
            let line = m
                .lines()
                .find(|l| l.starts_with(&format!("{name} ")))
                .with_context(|| format!("node-{i}: no {name} in {m}"))?;
            Ok(line.rsplit(' ').next().context("value")?.parse()?)
        };
        for (a, n) in &announcers {
            let listed = m.contains(&format!("lockstep_lb_announcing{{address=\"{a}\"}} 1"));
            ensure!(
                listed == (*n == i),
                "node-{i} metrics and {a} (announcer node-{n})"
            );
        }
        assigners += value("lockstep_lb_assigner")? as u32;
        takes += value("lockstep_lb_handovers_total")? as u32;
        let left = value("lockstep_lb_announce_lease_remaining_seconds")?;
        ensure!(left > 0.0 && left <= 3.0, "node-{i} lease left {left}");
    }
    ensure!(assigners == 1, "{assigners} assigners");
    ensure!(takes >= 100, "{takes} announcements taken");
    // Cluster mode's and the LB agent's families: clean for promtool
    // (#45 item 3) and in the metrics reference.
    let m = lab.metrics(0)?;
    lockstep_tests::promtool_check_metrics(&m)?;
    let missing = lockstep_tests::undocumented_families(&m)?;
    ensure!(
        missing.is_empty(),
        "families not in docs/metrics.md: {missing:?}"
    );

    // d. A deleted service's addresses: silent once `lb delete` returned.
    let gone = by_service["shop/s07"].clone();
    let t = Instant::now();
    let out = lab.agents[2].cli(["lb", "delete", "--service", "shop/s07"])?;
    ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let took = t.elapsed();
    let answers = probe_once(&lab, &gone, Duration::from_secs(1))?;
    ensure!(
        answers.is_empty(),
        "{gone:?} answered after delete: {answers:?}"
    );
    eprintln!("lb delete returned after {took:?}; no answer in the next probe interval (1 s)");
    let v = lab.get(0)?;
    ensure!(v["services"].get("shop/s07").is_none(), "{v}");
    // An unknown name is refused by name, nothing deleted.
    let out = lab.agents[0].cli([
        "lb",
        "delete",
        "--service",
        "shop/s08",
        "--service",
        "shop/nope",
    ])?;
    ensure!(!out.status.success());
    ensure!(String::from_utf8_lossy(&out.stderr).contains("shop/nope"));
    ensure!(lab.get(0)?["services"].get("shop/s08").is_some());
    // A bad pool beside a good service: refused by name, nothing stored.
    let before = lab.get(1)?;
    let path = lab.agents[1].dir.path().join("bad.json");
    std::fs::write(
        &path,
        format!(
            r#"{{"pools": [{{"name": "bad", "ranges": [{{"start": "10.252.0.9", "stop": "10.252.0.1"}}]}}], "services": [{}]}}"#,
            service(60)
        ),
    )?;
    let out = lab.agents[1].cli(["lb", "apply", "-f", path.to_str().context("utf-8")?])?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(
        !out.status.success() && err.contains("bad") && err.contains("ranges[0]"),
        "bad pool: {err}"
    );
    let after = lab.get(1)?;
    ensure!(
        after["pools"] == before["pools"] && after["services"] == before["services"],
        "a refused apply changed etcd"
    );
    ensure!(
        after["cluster"]["pending"]
            .as_array()
            .is_some_and(Vec::is_empty),
        "{after}"
    );
    drop(lab);
    Ok(())
}

/// How one failover went for one address.
#[derive(Clone, Copy, Debug)]
enum Fault {
    Kill,
    Stop,
    Cut,
    /// SIGTERM: the agent unprograms and revokes its lease on the way out.
    Term,
    /// The uplink alone down, etcd still reachable: the agent stops
    /// refreshing its LB lease, so its addresses move.
    LinkDown,
    /// The uplink's far end (its switch port) down: the uplink is up but
    /// without carrier, etcd still reachable; as `LinkDown`.
    CarrierLoss,
}

/// One fault on the node announcing the most of `total` addresses, its
/// addresses probed every 50 ms from before the fault until it is back
/// and everything settled. Returns the node, the overlaps and the
/// handovers (the first change of MAC per address).
fn fault_once(
    lab: &mut Lab,
    fault: Fault,
    total: usize,
) -> anyhow::Result<(usize, usize, Vec<Handover>)> {
    let (x, targets) = lab.busiest()?;
    let cap = Capture::start(lab, targets.clone(), Duration::from_millis(50))?;
    std::thread::sleep(Duration::from_millis(600));
    let t0 = Instant::now();
    let pid = lab.agents[x].pid().context("agent pid")?;
    match fault {
        Fault::Kill => lab.agents[x].kill9(),
        Fault::Term => {
            lab.agents[x].stop()?;
        }
        Fault::Stop => signal(pid, "-STOP")?,
        Fault::Cut => {
            lab.ns[x].exec("ip", ["link", "set", "u0", "down"])?;
            lab.cuts[x].set(true);
        }
        Fault::LinkDown => {
            lab.ns[x].exec("ip", ["link", "set", "u0", "down"])?;
        }
        Fault::CarrierLoss => {
            lab.underlay
                .exec("ip", ["link", "set", &format!("ul{x}"), "down"])?;
        }
    }
    let old = lab.macs[x];
    let moved = wait_answered_elsewhere(&cap, &targets, old, t0, Duration::from_secs(30));
    let uplink_fault = matches!(fault, Fault::LinkDown | Fault::CarrierLoss);
    if uplink_fault && moved.is_ok() {
        let m = lab.metrics(x)?;
        ensure!(
            m.contains("lockstep_lb_uplink_down 1"),
            "{fault:?}: node-{x} does not report its uplink down:\n{m}"
        );
    }
    // The node comes back (and takes its addresses back: probed too).
    match fault {
        Fault::Kill | Fault::Term => {
            lab.agents[x].restart()?;
        }
        Fault::Stop => signal(pid, "-CONT")?,
        Fault::Cut => {
            lab.cuts[x].set(false);
            lab.ns[x].exec("ip", ["link", "set", "u0", "up"])?;
        }
        Fault::LinkDown => {
            lab.ns[x].exec("ip", ["link", "set", "u0", "up"])?;
        }
        Fault::CarrierLoss => {
            lab.underlay
                .exec("ip", ["link", "set", &format!("ul{x}"), "up"])?;
        }
    }
    std::thread::sleep(Duration::from_secs(6));
    let (seen, rounds) = cap.finish()?;
    moved?;
    if uplink_fault {
        let m = lab.metrics(x)?;
        ensure!(
            m.contains("lockstep_lb_uplink_down 0"),
            "{fault:?}: node-{x} still reports its uplink down:\n{m}"
        );
    }
    let (overlaps, handovers, problems) = judge(lab, &seen, &rounds, &targets, old);
    ensure!(problems.is_empty(), "{fault:?}: {problems:#?}");
    // Settled again: every address answered once, by its announcer.
    settled(lab, total, &format!("after {fault:?}"))?;
    Ok((x, overlaps, handovers))
}

/// Pools for `node_selector_admits_only_matching_announcers`: `zb`'s
/// addresses may be announced by zone=b nodes only, `zc`'s by zone=c nodes
/// (there are none).
const ZONED: &str = r#"{"pools": [
  {"name": "zb", "cidrs": ["10.251.0.128/26"], "announce": "l2",
   "serviceSelector": {"matchLabels": {"app": "b"}}, "nodeSelector": {"matchLabels": {"zone": "b"}}},
  {"name": "zc", "cidrs": ["10.251.0.192/26"], "announce": "l2",
   "serviceSelector": {"matchLabels": {"app": "c"}}, "node_selector": {"match_labels": {"zone": "c"}}}
]}"#;

fn zoned_service(name: &str, app: &str) -> String {
    format!(
        r#"{{"namespace": "zone", "name": "{name}", "labels": {{"app": "{app}"}}, "ports": [{{"protocol": "TCP", "port": 80}}]}}"#
    )
}

#[test]
fn node_selector_admits_only_matching_announcers() -> anyhow::Result<()> {
    privileged!();
    let cluster = EtcdCluster::start(3)?;
    let prefix = format!("/{}/", lockstep_tests::unique("lbsel"));
    let mut lab = Lab::build_labelled(
        &cluster,
        &prefix,
        Some(LEASE),
        [
            "zone = \"a\"",
            "zone = \"b\"",
            "zone = \"b\", rack = \"r2\"",
        ],
    )?;
    lab.apply(0, ZONED)?;
    let list: Vec<String> = (0..8)
        .map(|i| zoned_service(&format!("b{i}"), "b"))
        .chain([zoned_service("c0", "c")])
        .collect();
    lab.apply(0, &format!(r#"{{"services": [{}]}}"#, list.join(", ")))?;
    let view = wait_for(
        "8 zone-b addresses announced, the zone-c one reported unannounced",
        Duration::from_secs(60),
        || {
            let v = lab.get(0).ok()?;
            let a = addresses(&v).ok()?;
            let announced = v["cluster"]["announcements"].as_object()?.len();
            let un = v["cluster"]["unannounced"].as_object()?.len();
            (a.len() == 9 && a.values().all(|x| x.len() == 1) && announced == 8 && un == 1)
                .then_some(v)
        },
    )?;
    let by_service = addresses(&view)?;
    let c_addr = by_service["zone/c0"][0];
    let b_addrs: Vec<IpAddr> = by_service
        .iter()
        .filter(|(id, _)| id.starts_with("zone/b"))
        .flat_map(|(_, a)| a.iter().copied())
        .collect();
    // `lb get` names the address nobody announces and its pool, and the
    // members' labels.
    ensure!(
        view["cluster"]["unannounced"][c_addr.to_string()] == "zc",
        "{}",
        view["cluster"]
    );
    ensure!(
        view["cluster"]["member_labels"]["node-2"]["rack"] == "r2",
        "{}",
        view["cluster"]
    );
    let announcers = lab.announcers(0)?;
    ensure!(
        !announcers.contains_key(&c_addr),
        "{c_addr} (pool zc) announced: {announcers:?}"
    );
    ensure!(
        b_addrs
            .iter()
            .all(|a| matches!(announcers.get(a), Some(1 | 2))),
        "zone-b addresses announced outside zone b: {announcers:?}"
    );
    // Answered once each, by the zone-b announcer's MAC; the zone-c
    // address by nobody.
    let mut targets = b_addrs.clone();
    targets.push(c_addr);
    let answers = probe_once(&lab, &targets, Duration::from_millis(1500))?;
    for a in &b_addrs {
        let got = answers.get(a).cloned().unwrap_or_default();
        let n = announcers[a];
        ensure!(
            got.len() == 1 && got[0] == lab.macs[n],
            "{a}: answers from {:?}, announcer node-{n}",
            got.iter().map(|m| lab.node_of(*m)).collect::<Vec<_>>()
        );
    }
    ensure!(
        !answers.contains_key(&c_addr),
        "{c_addr} answered: {answers:?}"
    );
    // Every node's metrics report it (node-0 too: it announces nothing).
    for i in 0..3 {
        let m = lab.metrics(i)?;
        ensure!(
            m.contains(&format!(
                "lockstep_lb_unannounced{{address=\"{c_addr}\",pool=\"zc\"}} 1"
            )),
            "node-{i} metrics do not report {c_addr}: {m}"
        );
    }

    // Kill the busier zone-b announcer: everything moves to the other
    // zone-b node, never to node-0, while the neighbour probes every 50 ms.
    let x = if announcers.values().filter(|n| **n == 1).count()
        >= announcers.values().filter(|n| **n == 2).count()
    {
        1
    } else {
        2
    };
    let y = 3 - x;
    let cap = Capture::start(&lab, targets.clone(), Duration::from_millis(50))?;
    std::thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    lab.agents[x].kill9();
    let moved = wait_for(
        "every zone-b address announced by the other zone-b node",
        Duration::from_secs(30),
        || {
            let a = lab.announcers(0).ok()?;
            b_addrs.iter().all(|b| a.get(b) == Some(&y)).then_some(())
        },
    );
    let answered = wait_for(
        "every zone-b address answered by the other zone-b node",
        Duration::from_secs(15),
        || {
            let seen = cap.seen();
            b_addrs
                .iter()
                .all(|b| {
                    seen.iter().any(|s| {
                        s.addr == *b && s.kind == Kind::Reply && s.mac == lab.macs[y] && s.at > t0
                    })
                })
                .then_some(())
        },
    );
    std::thread::sleep(Duration::from_millis(500));
    let (seen, _) = cap.finish()?;
    eprintln!(
        "node-{x} killed; zone-b addresses moved to node-{y} in {:?}",
        t0.elapsed()
    );
    moved?;
    answered?;
    let wrong: Vec<String> = seen
        .iter()
        .filter(|s| s.mac == lab.macs[0] || s.addr == c_addr)
        .map(|s| format!("{} {:?} from {}", s.addr, s.kind, lab.node_of(s.mac)))
        .collect();
    ensure!(
        wrong.is_empty(),
        "answers from node-0 or for the zone-c address: {wrong:?}"
    );
    let v = lab.get(0)?;
    ensure!(
        v["cluster"]["unannounced"][c_addr.to_string()] == "zc",
        "{}",
        v["cluster"]
    );
    drop(lab);
    Ok(())
}

#[test]
fn failover_never_answers_from_two_nodes() -> anyhow::Result<()> {
    privileged!();
    let cluster = EtcdCluster::start(3)?;
    let prefix = format!("/{}/", lockstep_tests::unique("lbfo"));
    let mut lab = Lab::with_services(&cluster, &prefix, Some(LEASE), 12)?;
    let mut all_overlaps = 0;
    for fault in [
        Fault::Kill,
        Fault::Stop,
        Fault::Cut,
        Fault::Term,
        Fault::LinkDown,
        Fault::CarrierLoss,
    ] {
        let (x, overlaps, handovers) = fault_once(&mut lab, fault, 24)?;
        all_overlaps += overlaps;
        let mut gaps: Vec<Duration> = handovers.iter().map(|h| h.gap).collect();
        gaps.sort();
        let max = *gaps.last().context("no handover")?;
        let announced = handovers.iter().filter(|h| h.announced).count();
        eprintln!(
            "{fault:?} node-{x} (lease {LEASE}): {} handovers, overlaps {overlaps}, gap p50 {:?} max {max:?}, announced by the new node {announced}; {:?}",
            handovers.len(),
            pct(&gaps, 0.5),
            handovers
                .iter()
                .map(|h| format!("{} {}->{} {:?}", h.addr, h.from, h.to, h.gap))
                .collect::<Vec<_>>()
        );
        ensure!(
            announced == handovers.len(),
            "{fault:?}: no gratuitous ARP / unsolicited NA from the new announcer: {handovers:#?}"
        );
        // Generous on a loaded 2-core machine: lease 2 s, etcd's expiry
        // check (500 ms), a tick (200 ms).
        ensure!(max <= Duration::from_secs(6), "{fault:?}: gap {max:?}");
        // A graceful stop hands over without waiting for the lease.
        if matches!(fault, Fault::Term) {
            ensure!(max < Duration::from_millis(1500), "SIGTERM: gap {max:?}");
        }
    }
    ensure!(all_overlaps == 0, "{all_overlaps} overlaps");
    Ok(())
}

/// Full CNI ADDs and DELs on every node of `lab`, in a loop from two
/// workers per node (each with a pod namespace of its own) until dropped:
/// the agents' owners, stores and the kernel busy while leases must keep
/// time. Calls to an agent that is down (killed, restarting) fail and are
/// counted.
struct CniLoad {
    stop: Arc<AtomicBool>,
    workers: Vec<std::thread::JoinHandle<anyhow::Result<(usize, usize)>>>,
}

impl CniLoad {
    fn start(lab: &Lab) -> anyhow::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut workers = Vec::new();
        for (i, agent) in lab.agents.iter().enumerate() {
            for w in 0..2 {
                let socket = agent.socket();
                let pod = Netns::new(&format!("lbp{i}{w}"))?;
                let stop = stop.clone();
                workers.push(std::thread::spawn(move || {
                    let (mut ok, mut failed) = (0, 0);
                    let mut n = 0u64;
                    while !stop.load(Ordering::SeqCst) {
                        n += 1;
                        let id = format!("load-{i}-{w}-{n}");
                        match cni(&socket, "ADD", &id, &pod.path()) {
                            Ok(_) => ok += 1,
                            Err(_) => {
                                failed += 1;
                                std::thread::sleep(Duration::from_millis(100));
                            }
                        }
                        // Whatever the ADD did: its attachment goes.
                        match cni(&socket, "DEL", &id, &pod.path()) {
                            Ok(_) => ok += 1,
                            Err(_) => failed += 1,
                        }
                    }
                    drop(pod);
                    Ok((ok, failed))
                }));
            }
        }
        Ok(Self { stop, workers })
    }

    /// Stops the workers: the calls answered and failed.
    fn finish(self) -> anyhow::Result<(usize, usize)> {
        self.stop.store(true, Ordering::SeqCst);
        let (mut ok, mut failed) = (0, 0);
        for w in self.workers {
            let (o, f) = w
                .join()
                .map_err(|_| anyhow::anyhow!("a load worker panicked"))??;
            ok += o;
            failed += f;
        }
        Ok((ok, failed))
    }
}

/// `want` kills of the busiest announcer (restarted after): the gaps and
/// the overlaps counted.
fn kills(lab: &mut Lab, want: (usize, usize)) -> anyhow::Result<(Vec<Duration>, usize, usize)> {
    let (mut gaps, mut overlaps, mut faults) = (Vec::new(), 0, 0);
    while gaps.len() < want.0 || faults < want.1 {
        let (_, o, h) = fault_once(lab, Fault::Kill, 60)?;
        overlaps += o;
        faults += 1;
        gaps.extend(h.iter().map(|h| h.gap));
    }
    gaps.sort();
    Ok((gaps, overlaps, faults))
}

/// `cargo xtask bench lb`: failover gaps over at least 50 handovers in at
/// least 10 kills with the default lease (3 s), SIGKILL of the busiest
/// announcer each time (restarted after), every reply captured; overlaps
/// counted. Then the same beside CNI load on every node (#46: leases kept
/// by keepers, no lock). Goals (#27), gated: no overlap, gap p99 <= 1.5 s,
/// alone and beside the load.
#[test]
#[ignore = "a benchmark: cargo xtask bench lb"]
fn lb_failover_bench() -> anyhow::Result<()> {
    privileged!();
    let cluster = EtcdCluster::start(3)?;
    let prefix = format!("/{}/", lockstep_tests::unique("lbfb"));
    // The pods' addresses of the CNI load.
    apply_pools(
        &cluster.endpoints(),
        &prefix,
        "[[pools]]\nname = \"pods\"\nipv4 = [\"10.92.0.0/20\"]\nblock_v4 = 26\n",
    )?;
    let mut lab = Lab::build(&cluster, &prefix, None)?;
    lab.apply(0, POOL)?;
    lab.apply(0, &services(0..30))?;
    wait_for("60 addresses announced", Duration::from_secs(60), || {
        (lab.announcers(0).ok()?.len() == 60).then_some(())
    })?;
    // Each kill moves many addresses on one lease's expiry: their gaps are
    // alike, so at least 10 kills besides at least 50 handovers.
    // A smoke run: one kill, the path only.
    let want = lockstep_tests::bench::size((50, 10), (1, 1));
    let (alone, overlaps_alone, faults_alone) = kills(&mut lab, want)?;
    let load = CniLoad::start(&lab)?;
    let loaded = kills(&mut lab, want);
    let (calls, failed) = load.finish()?;
    let (loaded, overlaps_loaded, faults_loaded) = loaded?;
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!("| LB failover (default lease 3 s, SIGKILL) | alone | beside CNI load |");
    println!("|---|---|---|");
    println!(
        "| handovers | {} (in {faults_alone} kills) | {} (in {faults_loaded} kills) |",
        alone.len(),
        loaded.len()
    );
    for (name, p) in [("p50", 0.5), ("p99", 0.99)] {
        println!(
            "| gap {name} | {:.0} ms | {:.0} ms |",
            ms(pct(&alone, p)),
            ms(pct(&loaded, p))
        );
    }
    println!(
        "| gap max | {:.0} ms | {:.0} ms |",
        alone.last().map_or(0.0, |g| ms(*g)),
        loaded.last().map_or(0.0, |g| ms(*g))
    );
    println!(
        "| overlaps (a probe round answered by two MACs) | {overlaps_alone} | {overlaps_loaded} |"
    );
    println!(
        "| CNI calls beside (full ADD and DEL, 2 workers per node) | | {calls} answered, {failed} refused (to an agent killed or restarting) |"
    );
    let load_avg = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "failover gap p99 {:.0} ms alone, {:.0} ms beside CNI load (goal <= 1500 ms each); load average at the end: {}",
        ms(pct(&alone, 0.99)),
        ms(pct(&loaded, 0.99)),
        load_avg
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    ensure!(
        overlaps_alone + overlaps_loaded == 0,
        "{overlaps_alone} overlaps alone, {overlaps_loaded} beside CNI load"
    );
    // #27: the goal, gated (the bench exits non-zero when it is missed),
    // alone and beside the load.
    for (what, gaps) in [("alone", &alone), ("beside CNI load", &loaded)] {
        ensure!(
            pct(gaps, 0.99) <= Duration::from_millis(1500) || lockstep_tests::bench::smoke(),
            "goal missed: failover gap p99 {:?} > 1.5 s with the default lease, {what}",
            pct(gaps, 0.99)
        );
    }
    Ok(())
}

/// `cargo xtask bench lb`: assignment latency in cluster mode. 200
/// services applied one at a time through `lockstep lb apply` on node-0
/// (three agents, a real 3-member etcd, the assigner wherever elected);
/// for each, the time from starting the apply to its address showing in
/// `lb get` (the apply itself waits for the assigner's state), and to the
/// neighbour's ARP request for it being answered.
#[test]
#[ignore = "a benchmark: cargo xtask bench lb"]
fn lb_assignment_bench() -> anyhow::Result<()> {
    privileged!();
    let n_services = lockstep_tests::bench::size(200, 5);
    let cluster = EtcdCluster::start(3)?;
    let prefix = format!("/{}/", lockstep_tests::unique("lbab"));
    let lab = Lab::build(&cluster, &prefix, None)?;
    lab.apply(
        0,
        r#"{"pools": [{"name": "bench", "cidrs": ["10.251.4.0/23"], "announce": "l2"}]}"#,
    )?;
    let address_of = |v: &serde_json::Value, id: &str| -> Option<IpAddr> {
        v["services"][id]["assignment"]["addresses"][0]
            .as_str()?
            .parse()
            .ok()
    };
    let (mut visible, mut answered) = (
        Vec::with_capacity(n_services),
        Vec::with_capacity(n_services),
    );
    let started = Instant::now();
    for i in 0..n_services {
        let id = format!("bench/a{i:03}");
        let doc = format!(
            r#"{{"services": [{{"namespace": "bench", "name": "a{i:03}", "ports": [{{"protocol": "TCP", "port": 80}}]}}]}}"#
        );
        let t0 = Instant::now();
        let applied = lab.apply(0, &doc)?;
        let addr = match address_of(&applied, &id) {
            Some(a) => a,
            None => wait_for(
                &format!("{id} assigned in lb get"),
                Duration::from_secs(30),
                || address_of(&lab.get(0).ok()?, &id),
            )?,
        };
        visible.push(t0.elapsed());
        let cap = Capture::start(&lab, vec![addr], Duration::from_millis(10))?;
        let got = wait_for(
            &format!("{id} ({addr}) answered by ARP"),
            Duration::from_secs(30),
            || {
                cap.seen()
                    .iter()
                    .find(|s| s.addr == addr && s.kind == Kind::Reply)
                    .map(|s| s.at)
            },
        );
        cap.finish()?;
        answered.push(got?.saturating_duration_since(t0));
    }
    let total = started.elapsed();
    visible.sort();
    answered.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "| LB assignment in cluster mode ({n_services} services, one lb apply each) | value |"
    );
    println!("|---|---|");
    println!(
        "| apply -> in lb get: p50 / p99 / max | {:.0} / {:.0} / {:.0} ms |",
        ms(pct(&visible, 0.5)),
        ms(pct(&visible, 0.99)),
        ms(*visible.last().context("none")?)
    );
    println!(
        "| apply -> answered by ARP: p50 / p99 / max | {:.0} / {:.0} / {:.0} ms |",
        ms(pct(&answered, 0.5)),
        ms(pct(&answered, 0.99)),
        ms(*answered.last().context("none")?)
    );
    println!(
        "assignment p99 in cluster mode: {:.0} ms to lb get, {:.0} ms to an ARP answer ({n_services} services in {:.1} s)",
        ms(pct(&visible, 0.99)),
        ms(pct(&answered, 0.99)),
        total.as_secs_f64()
    );
    drop(lab);
    Ok(())
}
