//! #44 item 4: a LoadBalancer pool's `nodeSelector` without cluster mode,
//! with node labels followed live. Three node namespaces on one L2
//! segment with a neighbour, each agent with `[kubernetes]` and no
//! `[cluster]`, the project's API double.
//!
//! - An address of a pool whose selector admits no node is answered by
//!   nobody, not by the writer (before: the writer answered every address,
//!   whatever the pool's selector said).
//! - A node labelled into the selector while its agent runs answers it;
//!   the writer keeps answering the other pool's addresses.
//! - The label moved to another node: the answers move there, never from
//!   two nodes in one probe round.
//! - Every request the agents sent is one `deploy/rbac.yaml` allows.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use lockstep_tests::kube_lab::{KubeLab, lb_service, pool_spec};
use lockstep_tests::lb_lab::{Capture, wait_answered_elsewhere};
use lockstep_tests::{privileged, wait_for};
use serde_json::json;

const NS: &str = "shop";
const EAST: &str = "10.251.0.70";

/// Sets (or, with `None`, removes) node `i`'s `zone` label.
fn zone(k: &KubeLab, i: usize, zone: Option<&str>) -> anyhow::Result<()> {
    k.api.patch(
        "nodes",
        "",
        &format!("node-{i}"),
        &json!({"metadata": {"labels": {"zone": zone}}}),
        false,
    )?;
    Ok(())
}

#[test]
fn a_pools_node_selector_picks_its_answering_node_from_live_labels() -> anyhow::Result<()> {
    privileged!();
    let mut k = KubeLab::build_local([json!({}), json!({}), json!({})], &|_| {
        "node_wait = \"2s\"\n".into()
    })?;
    let r = scenario(&mut k);
    if r.is_err() {
        for (i, a) in k.lab.agents.iter().enumerate() {
            eprintln!("--- node-{i} log ---\n{}", a.log());
        }
    }
    r
}

fn scenario(k: &mut KubeLab) -> anyhow::Result<()> {
    k.pool("pub", pool_spec())?;
    k.pool(
        "east",
        json!({"cidrs": ["10.251.0.64/27"], "announce": "l2",
               "nodeSelector": {"matchLabels": {"zone": "east"}},
               "serviceSelector": {"matchLabels": {"pool": "east"}}}),
    )?;
    let w = wait_for("a writer", Duration::from_secs(30), || {
        k.lease_holder("lockstep-lb-writer")
    })?;
    let (a, b) = ((w + 1) % 3, (w + 2) % 3);
    k.api.create(
        "services",
        NS,
        &lb_service(NS, "plain", 80, json!({}), json!({})),
    )?;
    k.api.create(
        "services",
        NS,
        &lb_service(
            NS,
            "east",
            80,
            json!({"pool": "east"}),
            json!({"lockstep.io/ips": EAST}),
        ),
    )?;
    let ids = BTreeSet::from([format!("{NS}/plain"), format!("{NS}/east")]);
    let got = k.wait_assigned(&ids, 1, Duration::from_secs(30))?;
    let plain = *got[&format!("{NS}/plain")]
        .first()
        .context("plain's address")?;
    let east: IpAddr = EAST.parse()?;
    ensure!(
        got[&format!("{NS}/east")] == vec![east],
        "east was given {:?}",
        got[&format!("{NS}/east")]
    );

    // No node in the zone: the writer answers its pool, not east's.
    k.wait_answering(plain, &[w])?;
    std::thread::sleep(Duration::from_secs(1));
    let now = k.answering(east)?;
    ensure!(
        now.is_empty(),
        "{east} answered by {now:?}: no node is in zone east"
    );

    // Node a labelled into the zone while its agent runs.
    zone(k, a, Some("east"))?;
    k.wait_answering(east, &[a])?;
    k.wait_answering(plain, &[w])?;

    // The zone moves to node b: the answers follow, never from two nodes.
    let cap = Capture::start(&k.lab, vec![east], Duration::from_millis(50))?;
    std::thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    zone(k, b, Some("east"))?;
    zone(k, a, None)?;
    wait_answered_elsewhere(&cap, &[east], k.lab.macs[a], t0, Duration::from_secs(10))?;
    let moved = t0.elapsed();
    std::thread::sleep(Duration::from_secs(1));
    k.ensure_moved(
        cap,
        east,
        (a, b),
        true,
        &format!("zone moved node-{a} -> node-{b}: answered from node-{b} after {moved:?}"),
    )?;
    k.wait_answering(east, &[b])?;
    k.wait_answering(plain, &[w])?;

    k.ensure_requests_allowed()
}
