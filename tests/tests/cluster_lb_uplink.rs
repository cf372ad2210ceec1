//! Only a node that can answer may hold an LB announcement (#27 item 4),
//! end to end on the LB lab (`lockstep_tests::lb_lab`: three node
//! namespaces on a bridge, a neighbour probing, a real 3-member etcd).
//!
//! - `a_node_without_an_uplink_never_announces_and_may_still_assign`: node-2
//!   runs without `[datapath] uplink`. Before, it joined the announcers and
//!   took about a third of the addresses, which nobody answered. Now it
//!   joins as a member that does not answer: it never holds an
//!   announcement, `lb get` names it under `cluster.silent`, every address
//!   is answered once by its announcer's MAC, and with the other two agents
//!   stopped it is still elected assigner and assigns a new service (whose
//!   address nobody announces, and `lb get` says so).
//! - `a_deleted_uplink_gives_its_addresses_up_and_one_created_again_answers`:
//!   the busiest announcer's uplink is deleted, etcd still reachable. Before,
//!   the agent kept refreshing its LB lease (the link being gone read as
//!   "cannot tell") and its addresses stayed dark. Now they move to the
//!   other nodes within a lease, with no probe answered by two MACs; the
//!   node reports `lockstep_lb_uplink_down 1`. The uplink created again
//!   under its name (a new interface, a new MAC) gets the programs attached
//!   anew, the node rejoins, and every address is answered by its
//!   announcer's MAC, the new one included.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use lockstep_tests::etcd::EtcdCluster;
use lockstep_tests::lb_lab::{
    Capture, LEASE, Lab, POOL, addresses, judge, service, services, settled,
    wait_answered_elsewhere,
};
use lockstep_tests::{privileged, wait_for};

#[test]
fn a_node_without_an_uplink_never_announces_and_may_still_assign() -> anyhow::Result<()> {
    privileged!();
    let cluster = EtcdCluster::start(3)?;
    let prefix = format!("/{}/", lockstep_tests::unique("lbnoup"));
    let mut lab = Lab::build_with(
        &cluster,
        &prefix,
        Some(LEASE),
        ["", "", ""],
        [true, true, false],
    )?;
    lab.apply(0, POOL)?;
    lab.apply(0, &services(0..12))?;
    let view = wait_for(
        "24 addresses announced, node-2 a silent member",
        Duration::from_secs(60),
        || {
            let v = lab.get(0).ok()?;
            let announced = v["cluster"]["announcements"].as_object()?.len();
            let members = v["cluster"]["members"].as_array()?.len();
            (announced == 24 && members == 3).then_some(v)
        },
    );
    let announcers = lab.announcers(0)?;
    let by_node2: Vec<&IpAddr> = announcers
        .iter()
        .filter(|(_, n)| **n == 2)
        .map(|(a, _)| a)
        .collect();
    ensure!(
        by_node2.is_empty(),
        "node-2 has no uplink but holds {} announcements: {by_node2:?}",
        by_node2.len()
    );
    let view = view?;
    ensure!(
        view["cluster"]["silent"] == serde_json::json!(["node-2"]),
        "lb get does not name node-2 silent: {}",
        view["cluster"]
    );
    // Every address answered once, by its announcer; node-2's MAC never.
    settled(&lab, 24, "node-2 without uplink")?;

    // The two nodes that answer stop (SIGTERM: they revoke their leases):
    // node-2 becomes the assigner and still assigns, and says nobody
    // announces the new address.
    lab.agents[0].stop()?;
    lab.agents[1].stop()?;
    let path = lab.agents[2]
        .dir
        .path()
        .join(format!("lb-{}.json", lockstep_tests::unique("one")));
    std::fs::write(&path, format!(r#"{{"services": [{}]}}"#, service(40)))?;
    let out = lab.agents[2].cli(["lb", "apply", "-f", path.to_str().context("utf-8")?])?;
    ensure!(
        out.status.success(),
        "lb apply on node-2 alone: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = wait_for(
        "node-2 assigns shop/s40 and reports it unannounced",
        Duration::from_secs(30),
        || {
            let v = lab.get(2).ok()?;
            let a = addresses(&v).ok()?;
            let mine = a.get("shop/s40")?.clone();
            let un = v["cluster"]["unannounced"].as_object()?;
            (v["cluster"]["assigner"] == "node-2"
                && !mine.is_empty()
                && mine.iter().all(|x| un.contains_key(&x.to_string())))
            .then_some(v)
        },
    )?;
    ensure!(
        v["cluster"]["announcements"]
            .as_object()
            .is_some_and(serde_json::Map::is_empty),
        "announced with only node-2 left: {}",
        v["cluster"]
    );
    drop(lab);
    Ok(())
}

#[test]
fn a_deleted_uplink_gives_its_addresses_up_and_one_created_again_answers() -> anyhow::Result<()> {
    privileged!();
    let cluster = EtcdCluster::start(3)?;
    let prefix = format!("/{}/", lockstep_tests::unique("lbgone"));
    let mut lab = Lab::with_services(&cluster, &prefix, Some(LEASE), 12)?;
    let (x, targets) = lab.busiest()?;
    let old = lab.macs[x];
    let cap = Capture::start(&lab, targets.clone(), Duration::from_millis(50))?;
    std::thread::sleep(Duration::from_millis(600));
    let t0 = Instant::now();
    lab.ns[x].exec("ip", ["link", "del", "u0"])?;
    let moved = wait_answered_elsewhere(&cap, &targets, old, t0, Duration::from_secs(20));
    let (seen, rounds) = cap.finish()?;
    moved?;
    eprintln!(
        "node-{x}'s uplink deleted: {} addresses answered by others after {:?}",
        targets.len(),
        t0.elapsed()
    );
    let (overlaps, handovers, problems) = judge(&lab, &seen, &rounds, &targets, old);
    ensure!(problems.is_empty(), "uplink deleted: {problems:#?}");
    ensure!(overlaps == 0, "uplink deleted: {overlaps} overlaps");
    let max = handovers
        .iter()
        .map(|h| h.gap)
        .max()
        .context("no handover")?;
    ensure!(max <= Duration::from_secs(6), "uplink deleted: gap {max:?}");
    let m = lab.metrics(x)?;
    ensure!(
        m.contains("lockstep_lb_uplink_down 1"),
        "node-{x} does not report its uplink down:\n{m}"
    );
    ensure!(
        lab.announcers(0)?.values().all(|n| *n != x),
        "node-{x} still holds announcements without an uplink"
    );

    // The uplink created again under its name: a new interface and MAC.
    lab.plug_node(x)?;
    ensure!(lab.macs[x] != old, "the new u0 kept the old MAC");
    wait_for(
        "the node with its new uplink answers again",
        Duration::from_secs(30),
        || {
            let a = lab.announcers(0).ok()?;
            (a.len() == 24 && a.values().any(|n| *n == x)).then_some(())
        },
    )?;
    settled(&lab, 24, "uplink created again")?;
    let m = lab.metrics(x)?;
    ensure!(
        m.contains("lockstep_lb_uplink_down 0"),
        "node-{x} still reports its uplink down:\n{m}"
    );
    drop(lab);
    Ok(())
}
