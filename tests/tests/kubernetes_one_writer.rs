//! #44 item 1: one writer without cluster mode. Three node namespaces on
//! one L2 segment with a neighbour, each agent with `[kubernetes]` and no
//! `[cluster]` (no etcd), the project's API double serving the
//! `coordination.k8s.io` Lease they elect their writer on.
//!
//! - One agent holds the Lease; every Service's status is written once,
//!   with no 409 (before: every node PATCHed, one got 200, the others 409).
//! - Each address is answered by one node, the Lease holder's (before:
//!   all three nodes' MACs answered).
//! - The holder SIGKILLed: another node takes the Lease and answers every
//!   address, keeping every address (the followers mirrored them), within
//!   a bound; never two nodes at once once it answers; a Service created
//!   then is served by the new writer.
//! - The holder stopped with SIGTERM releases the Lease: the last node
//!   takes over without waiting for it to expire.
//! - Every request the agents sent is one `deploy/rbac.yaml` allows (the
//!   Lease through the Role in the agent's namespace).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use lockstep_tests::kube_lab::{KubeLab, lb_service, pool_spec};
use lockstep_tests::lb_lab::{Capture, probe_once, wait_answered_elsewhere};
use lockstep_tests::{pct, privileged, wait_for};
use serde_json::{Value, json};

const NS: &str = "shop";
const LEASE_NS: &str = "kube-system";
const LEASE: &str = "lockstep-lb-writer";

fn holder(k: &KubeLab) -> Option<String> {
    let l = k.api.get("leases", LEASE_NS, LEASE).ok()?;
    l["spec"]["holderIdentity"]
        .as_str()
        .filter(|h| !h.is_empty())
        .map(str::to_owned)
}

fn node_index(name: &str) -> anyhow::Result<usize> {
    name.strip_prefix("node-")
        .and_then(|i| i.parse().ok())
        .with_context(|| format!("not a lab node: {name}"))
}

/// Status writes per Service, and how many were refused with 409.
fn status_writes(k: &KubeLab) -> (BTreeMap<String, usize>, usize) {
    let mut per: BTreeMap<String, usize> = BTreeMap::new();
    let mut conflicts = 0;
    for r in k.api.requests() {
        if r.method == "GET" || !r.path.ends_with("/status") || !r.path.contains("/services/") {
            continue;
        }
        *per.entry(r.path.clone()).or_default() += 1;
        if r.code == 409 {
            conflicts += 1;
        }
    }
    (per, conflicts)
}

fn create(k: &KubeLab, names: &[String]) -> anyhow::Result<BTreeSet<String>> {
    for n in names {
        k.api
            .create("services", NS, &lb_service(NS, n, 80, json!({}), json!({})))?;
    }
    Ok(names.iter().map(|n| format!("{NS}/{n}")).collect())
}

/// Each of `addrs` answered by node `node` alone.
fn answered_by(k: &KubeLab, addrs: &[IpAddr], node: usize) -> anyhow::Result<()> {
    let answers = probe_once(&k.lab, addrs, Duration::from_millis(1500))?;
    for a in addrs {
        let got = answers.get(a).cloned().unwrap_or_default();
        let nodes: BTreeSet<String> = got.iter().map(|m| k.lab.node_of(*m)).collect();
        ensure!(
            !got.is_empty() && got.iter().all(|m| *m == k.lab.macs[node]),
            "{a}: answered by {nodes:?}, the Lease holder is node-{node}"
        );
    }
    Ok(())
}

fn addrs(got: &BTreeMap<String, Vec<IpAddr>>) -> Vec<IpAddr> {
    got.values().flatten().copied().collect()
}

#[test]
fn one_writer_one_answer_and_failover_keeps_every_address() -> anyhow::Result<()> {
    privileged!();
    let mut k = KubeLab::build_local([json!({}), json!({}), json!({})], &|_| {
        "node_wait = \"2s\"\n".into()
    })?;
    k.pool("pub", pool_spec())?;
    let first = wait_for("a Lease holder", Duration::from_secs(30), || holder(&k))?;
    let w0 = node_index(&first)?;

    // One writer: every status written once, never refused.
    let names: Vec<String> = (0..6).map(|i| format!("s{i}")).collect();
    let ids = create(&k, &names)?;
    let got = k.wait_assigned(&ids, 1, Duration::from_secs(30))?;
    let before: Vec<IpAddr> = addrs(&got);
    let distinct: BTreeSet<IpAddr> = before.iter().copied().collect();
    ensure!(distinct.len() == names.len(), "addresses repeat: {got:?}");
    // Let any other agent's pass run (it would write now if it could).
    std::thread::sleep(Duration::from_secs(2));
    let (per, conflicts) = status_writes(&k);
    ensure!(
        conflicts == 0,
        "{conflicts} status writes refused with 409: {per:?}"
    );
    ensure!(
        per.len() == names.len() && per.values().all(|n| *n == 1),
        "each Service's status written once, by one writer: {per:?}"
    );
    // One node answers: the holder's.
    answered_by(&k, &before, w0)?;

    // The writer SIGKILLed: another takes over, every address kept.
    let cap = Capture::start(&k.lab, before.clone(), Duration::from_millis(50))?;
    std::thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    k.lab.agents[w0].kill9();
    wait_answered_elsewhere(&cap, &before, k.lab.macs[w0], t0, Duration::from_secs(10))?;
    let took = t0.elapsed();
    std::thread::sleep(Duration::from_secs(1));
    let (seen, _) = cap.finish()?;
    let second = wait_for("a new Lease holder", Duration::from_secs(10), || {
        holder(&k).filter(|h| *h != first)
    })?;
    let w1 = node_index(&second)?;
    eprintln!("node-{w0} killed: node-{w1} answered every address after {took:?}");
    // Once the new writer answered an address, nobody else did.
    for a in &before {
        let from = seen
            .iter()
            .filter(|s| s.addr == *a && s.at > t0 && s.mac == k.lab.macs[w1])
            .map(|s| s.at)
            .min()
            .context("answered by the new writer")?;
        let others: Vec<String> = seen
            .iter()
            .filter(|s| s.addr == *a && s.at > from && s.mac != k.lab.macs[w1])
            .map(|s| k.lab.node_of(s.mac))
            .collect();
        ensure!(
            others.is_empty(),
            "{a} answered after the takeover by {others:?} too"
        );
    }
    let after = k.wait_assigned(&ids, 1, Duration::from_secs(5))?;
    ensure!(
        after == got,
        "addresses changed in the takeover: {got:?} -> {after:?}"
    );
    answered_by(&k, &before, w1)?;
    // The new writer serves new Services.
    let more = create(&k, &["late".to_string()])?;
    let late = k.wait_assigned(&more, 1, Duration::from_secs(10))?;
    let late_addrs = addrs(&late);
    ensure!(
        !distinct.contains(&late_addrs[0]),
        "a taken address given again: {late:?}"
    );
    answered_by(&k, &late_addrs, w1)?;

    // SIGTERM: the Lease is released, the last node takes it at once.
    let t1 = Instant::now();
    k.lab.agents[w1].stop()?;
    let third = wait_for(
        "the last node holds the Lease",
        Duration::from_secs(5),
        || holder(&k).filter(|h| *h != first && *h != second),
    )?;
    let w2 = node_index(&third)?;
    eprintln!(
        "node-{w1} stopped: node-{w2} held the Lease after {:?}",
        t1.elapsed()
    );
    let mut all = before.clone();
    all.extend(late_addrs);
    wait_for("the last node answers", Duration::from_secs(5), || {
        answered_by(&k, &all, w2).ok()
    })?;
    let lease: Value = k.api.get("leases", LEASE_NS, LEASE)?;
    ensure!(
        lease["spec"]["leaseTransitions"].as_i64() == Some(2),
        "two takeovers counted: {lease}"
    );
    k.ensure_requests_allowed()
}

/// `cargo xtask bench lb`: failover without cluster mode. Three agents
/// electing their writer on the Lease (default timing), 10 Services; at
/// least 10 SIGKILLs of the holder (restarted after), every ARP reply
/// captured at a 50 ms probe interval. Per address, the gap from the kill
/// to the first reply from another node; overlaps are replies from any
/// other node after the new holder answered. Goals (#44), gated: no
/// overlap, gap p99 <= 1.5 s.
#[test]
#[ignore = "a benchmark: cargo xtask bench lb"]
fn lease_failover_bench() -> anyhow::Result<()> {
    privileged!();
    let mut k = KubeLab::build_local([json!({}), json!({}), json!({})], &|_| {
        "node_wait = \"2s\"\n".into()
    })?;
    k.pool("pub", pool_spec())?;
    let names: Vec<String> = (0..10).map(|i| format!("f{i}")).collect();
    let ids = create(&k, &names)?;
    let got = k.wait_assigned(&ids, 1, Duration::from_secs(30))?;
    let targets = addrs(&got);
    let kills = lockstep_tests::bench::size(10, 1);
    let (mut gaps, mut overlaps) = (Vec::new(), 0usize);
    for _ in 0..kills {
        let name = wait_for("a Lease holder", Duration::from_secs(30), || holder(&k))?;
        let w = node_index(&name)?;
        wait_for("the holder answers", Duration::from_secs(10), || {
            answered_by(&k, &targets, w).ok()
        })?;
        let cap = Capture::start(&k.lab, targets.clone(), Duration::from_millis(50))?;
        std::thread::sleep(Duration::from_millis(300));
        let t0 = Instant::now();
        k.lab.agents[w].kill9();
        wait_answered_elsewhere(&cap, &targets, k.lab.macs[w], t0, Duration::from_secs(10))?;
        std::thread::sleep(Duration::from_millis(1500));
        let (seen, _) = cap.finish()?;
        for a in &targets {
            let first = seen
                .iter()
                .filter(|s| s.addr == *a && s.at > t0 && s.mac != k.lab.macs[w])
                .min_by_key(|s| s.at)
                .context("answered elsewhere")?;
            gaps.push(first.at - t0);
            overlaps += seen
                .iter()
                .filter(|s| s.addr == *a && s.at > first.at && s.mac != first.mac)
                .count();
        }
        k.lab.agents[w].restart()?;
    }
    gaps.sort();
    println!("| LB failover without etcd (Lease 1 s, SIGKILL) | value |");
    println!("|---|---|");
    println!("| handovers | {} (in {kills} kills) |", gaps.len());
    println!(
        "| gap p50 | {:.0} ms |",
        pct(&gaps, 0.5).as_secs_f64() * 1e3
    );
    println!(
        "| gap p99 | {:.0} ms |",
        pct(&gaps, 0.99).as_secs_f64() * 1e3
    );
    println!("| overlaps (a reply from another node after the new holder's) | {overlaps} |");
    ensure!(overlaps == 0, "{overlaps} overlaps");
    ensure!(
        pct(&gaps, 0.99) <= Duration::from_millis(1500) || lockstep_tests::bench::smoke(),
        "goal missed: failover gap p99 {:?} > 1.5 s",
        pct(&gaps, 0.99)
    );
    Ok(())
}

/// Patches Node `node-i`'s object (`status`: through the subresource).
fn patch_node(k: &KubeLab, i: usize, patch: &Value, status: bool) -> anyhow::Result<()> {
    k.api
        .patch("nodes", "", &format!("node-{i}"), patch, status)
        .map(drop)
}

/// No reply at all for any of `addrs`.
fn unanswered(k: &KubeLab, addrs: &[IpAddr]) -> anyhow::Result<()> {
    let answers = probe_once(&k.lab, addrs, Duration::from_millis(1500))?;
    let heard: Vec<String> = answers
        .iter()
        .flat_map(|(a, ms)| {
            ms.iter()
                .map(move |m| format!("{a} by {}", k.lab.node_of(*m)))
        })
        .collect();
    ensure!(
        heard.is_empty(),
        "answered though no node may answer: {heard:?}"
    );
    Ok(())
}

/// #44 item 4: excluded, cordoned, NotReady nodes never answer, followed
/// live from their Node objects. The holder labelled
/// `node.kubernetes.io/exclude-from-external-load-balancers` steps aside
/// and another node answers; the next holder cordoned: the last one
/// answers; that one's Ready condition False: nobody may, so nobody
/// answers and the Lease is left without a holder; uncordoned: that node
/// takes over and answers, with the same addresses.
#[test]
fn excluded_cordoned_and_not_ready_nodes_never_answer() -> anyhow::Result<()> {
    privileged!();
    let k = KubeLab::build_local([json!({}), json!({}), json!({})], &|_| {
        "node_wait = \"2s\"\n".into()
    })?;
    k.pool("pub", pool_spec())?;
    let names: Vec<String> = (0..3).map(|i| format!("n{i}")).collect();
    let ids = create(&k, &names)?;
    let got = k.wait_assigned(&ids, 1, Duration::from_secs(30))?;
    let targets = addrs(&got);
    let w0 = node_index(&wait_for("a holder", Duration::from_secs(30), || {
        holder(&k)
    })?)?;
    // The holder's announcer programs the responders after the statuses
    // are written: answered within a bound, as after each move below (CI
    // once probed before it had, and heard no one).
    wait_for("the holder answers alone", Duration::from_secs(10), || {
        answered_by(&k, &targets, w0).ok()
    })?;

    patch_node(
        &k,
        w0,
        &json!({"metadata": {"labels": {"node.kubernetes.io/exclude-from-external-load-balancers": "true"}}}),
        false,
    )?;
    let w1 = node_index(&wait_for(
        "another holder",
        Duration::from_secs(10),
        || holder(&k).filter(|h| *h != format!("node-{w0}")),
    )?)?;
    wait_for(
        "the new holder answers alone",
        Duration::from_secs(10),
        || answered_by(&k, &targets, w1).ok(),
    )?;

    patch_node(&k, w1, &json!({"spec": {"unschedulable": true}}), false)?;
    let w2 = node_index(&wait_for(
        "the last node holds",
        Duration::from_secs(10),
        || holder(&k).filter(|h| *h != format!("node-{w0}") && *h != format!("node-{w1}")),
    )?)?;
    wait_for(
        "the last node answers alone",
        Duration::from_secs(10),
        || answered_by(&k, &targets, w2).ok(),
    )?;

    patch_node(
        &k,
        w2,
        &json!({"status": {"conditions": [{"type": "Ready", "status": "False", "reason": "KubeletNotReady"}]}}),
        true,
    )?;
    wait_for("no holder", Duration::from_secs(10), || {
        holder(&k).is_none().then_some(())
    })?;
    unanswered(&k, &targets)?;
    // Stays so: no node may take it.
    std::thread::sleep(Duration::from_secs(2));
    ensure!(
        holder(&k).is_none(),
        "a node that may not took the Lease: {:?}",
        holder(&k)
    );

    patch_node(&k, w1, &json!({"spec": {"unschedulable": false}}), false)?;
    wait_for("the uncordoned node holds", Duration::from_secs(10), || {
        (holder(&k) == Some(format!("node-{w1}"))).then_some(())
    })?;
    wait_for(
        "the uncordoned node answers",
        Duration::from_secs(10),
        || answered_by(&k, &targets, w1).ok(),
    )?;
    let after = k.wait_assigned(&ids, 1, Duration::from_secs(5))?;
    ensure!(after == got, "addresses changed: {got:?} -> {after:?}");
    Ok(())
}

/// `cargo xtask bench lb`: "Service created → status written" without
/// etcd. Three agents electing their writer on the Lease; 200 Services
/// created one every 10 ms, each timed from its creation to the first
/// stored write of its status with an address, as the double records them.
/// Goal (#44): p99 ≤ 1 s, gated; and every status written once, by the
/// one writer.
#[test]
#[ignore = "a benchmark: cargo xtask bench lb"]
fn status_bench_without_etcd() -> anyhow::Result<()> {
    privileged!();
    const GOAL: Duration = Duration::from_secs(1);
    let n_services = lockstep_tests::bench::size(200, 5);
    let k = KubeLab::build_local([json!({}), json!({}), json!({})], &|_| {
        "node_wait = \"2s\"\n".into()
    })?;
    k.pool(
        "bench",
        json!({"cidrs": ["10.251.4.0/23"], "announce": "l2"}),
    )?;
    // One Service first: the writer is elected and its reflectors listed.
    let warm = create(&k, &["warm".to_string()])?;
    k.wait_assigned(&warm, 1, Duration::from_secs(60))?;
    let names: Vec<String> = (0..n_services).map(|i| format!("b{i:03}")).collect();
    let mut created = BTreeMap::new();
    let started = Instant::now();
    for n in &names {
        created.insert(format!("{NS}/{n}"), Instant::now());
        k.api
            .create("services", NS, &lb_service(NS, n, 80, json!({}), json!({})))?;
        std::thread::sleep(Duration::from_millis(10));
    }
    let ids: BTreeSet<String> = created.keys().cloned().collect();
    k.wait_assigned(&ids, 1, Duration::from_secs(120))?;
    let total = started.elapsed();
    let lat = k.status_latencies(&created)?;
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let p99 = pct(&lat, 0.99);
    let (per, conflicts) = status_writes(&k);
    println!(
        "| Kubernetes LoadBalancer without etcd ({n_services} Services, one every 10 ms) | value |"
    );
    println!("|---|---|");
    println!(
        "| Service created -> status written: p50 / p99 / max | {:.0} / {:.0} / {:.0} ms (goal p99 <= {:.0} ms) |",
        ms(pct(&lat, 0.5)),
        ms(p99),
        ms(*lat.last().context("none")?),
        ms(GOAL)
    );
    println!(
        "| status writes per Service (max) / refused with 409 | {} / {conflicts} |",
        per.values().max().copied().unwrap_or(0)
    );
    println!(
        "all {n_services} written {:.1} s after the first creation",
        total.as_secs_f64()
    );
    ensure!(conflicts == 0, "{conflicts} status writes refused with 409");
    ensure!(
        p99 <= GOAL || lockstep_tests::bench::smoke(),
        "goal missed: Service created -> status written p99 {p99:?} > {GOAL:?}"
    );
    Ok(())
}
