//! #44 item 3: `externalTrafficPolicy: Local` without cluster mode. Three
//! node namespaces on one L2 segment with a neighbour, each agent with
//! `[kubernetes]` and no `[cluster]`, the project's API double serving
//! Services, EndpointSlices and the Leases; the test writes the
//! EndpointSlices as the EndpointSlice controller would.
//!
//! - A `Local` Service's address is answered by the node with its ready
//!   endpoint alone, not by the writer (before: by the writer, which had
//!   no endpoint, a black hole on a real cluster); a `Cluster` Service's
//!   stays with the writer.
//! - A rolling update (new endpoint ready on another node, the old one
//!   terminating, then gone) moves the answers to the new node, never
//!   answered by two nodes in one probe round.
//! - No serving endpoint anywhere: nobody answers, and the Service's
//!   `lockstep.io/Announced` condition says why; an endpoint back takes
//!   the condition away.
//! - The answering node SIGKILLed while another has a ready endpoint: that
//!   node answers, within a bound, never both.
//! - Every request the agents sent is one `deploy/rbac.yaml` allows.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use lockstep_tests::kube_lab::{Ep, KubeLab, pool_spec};
use lockstep_tests::lb_lab::{Capture, judge, wait_answered_elsewhere};
use lockstep_tests::{pct, privileged, wait_for};
use serde_json::json;

const NS: &str = "shop";
const WRITER_LEASE: &str = "lockstep-lb-writer";

fn local_lease(svc: &str) -> String {
    format!("lockstep-lb.{NS}.{svc}")
}

/// A LoadBalancer Service with `externalTrafficPolicy` `policy`.
fn create_service(k: &KubeLab, name: &str, policy: &str) -> anyhow::Result<IpAddr> {
    k.create_service(NS, name, policy)
}

/// Creates, then sets, the EndpointSlice of Service `svc` to `eps`.
fn set_slice(k: &KubeLab, svc: &str, eps: &[Ep]) -> anyhow::Result<()> {
    k.set_slice(NS, svc, eps)
}

/// The Service's `lockstep.io/Announced` condition: (status, reason).
fn announced(k: &KubeLab, svc: &str) -> Option<(String, String)> {
    let s = k.api.get("services", NS, svc).ok()?;
    s["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "lockstep.io/Announced")
        .map(|c| {
            (
                c["status"].as_str().unwrap_or_default().to_owned(),
                c["reason"].as_str().unwrap_or_default().to_owned(),
            )
        })
}

fn lab() -> anyhow::Result<(KubeLab, usize)> {
    let k = KubeLab::build_local([json!({}), json!({}), json!({})], &|_| {
        "node_wait = \"2s\"\n".into()
    })?;
    k.pool("pub", pool_spec())?;
    let w = wait_for("a writer", Duration::from_secs(30), || {
        k.lease_holder(WRITER_LEASE)
    })?;
    Ok((k, w))
}

#[test]
fn local_services_are_answered_where_their_endpoints_are() -> anyhow::Result<()> {
    privileged!();
    let (mut k, w) = lab()?;
    let r = local_scenario(&mut k, w);
    if r.is_err() {
        for (i, a) in k.lab.agents.iter().enumerate() {
            eprintln!("--- node-{i} log ---\n{}", a.log());
        }
    }
    r
}

fn local_scenario(k: &mut KubeLab, w: usize) -> anyhow::Result<()> {
    let (a, b) = ((w + 1) % 3, (w + 2) % 3);
    let plain = create_service(k, "plain", "Cluster")?;
    let web = create_service(k, "web", "Local")?;

    // The Local Service from its endpoint's node, not the writer's.
    set_slice(k, "web", &[(a, true, true, false)])?;
    k.wait_answering(web, &[a])?;
    k.wait_answering(plain, &[w])?;
    ensure!(
        k.lease_holder(&local_lease("web")) == Some(a),
        "web's Lease held by node-{a}"
    );

    // A rolling update: the new endpoint ready on node b, the old one
    // terminating (still serving), then gone.
    let cap = Capture::start(&k.lab, vec![web], Duration::from_millis(50))?;
    std::thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    set_slice(k, "web", &[(a, false, true, true), (b, true, true, false)])?;
    wait_answered_elsewhere(&cap, &[web], k.lab.macs[a], t0, Duration::from_secs(10))?;
    let moved = t0.elapsed();
    set_slice(k, "web", &[(b, true, true, false)])?;
    std::thread::sleep(Duration::from_secs(1));
    k.ensure_moved(
        cap,
        web,
        (a, b),
        true,
        &format!("endpoint moved node-{a} -> node-{b}: answered from node-{b} after {moved:?}"),
    )?;
    k.wait_answering(web, &[b])?;
    ensure!(announced(k, "web").is_none(), "no condition while served");

    // Nothing serving anywhere: nobody answers, and the status says so.
    set_slice(k, "web", &[(b, false, false, true)])?;
    k.wait_answering(web, &[])?;
    wait_for(
        "the NoServingEndpoint condition",
        Duration::from_secs(10),
        || {
            (announced(k, "web") == Some(("False".into(), "NoServingEndpoint".into())))
                .then_some(())
        },
    )?;
    k.wait_answering(plain, &[w])?;

    // Back on the writer's node: answered there, the condition gone.
    set_slice(k, "web", &[(w, true, true, false)])?;
    k.wait_answering(web, &[w])?;
    wait_for("the condition gone", Duration::from_secs(10), || {
        announced(k, "web").is_none().then_some(())
    })?;

    // Ready on two nodes; the one answering SIGKILLed: the other takes
    // over once the Lease expires, never both at once.
    set_slice(k, "web", &[(w, true, true, false), (a, true, true, false)])?;
    std::thread::sleep(Duration::from_secs(1));
    k.wait_answering(web, &[w])?;
    let cap = Capture::start(&k.lab, vec![web], Duration::from_millis(50))?;
    std::thread::sleep(Duration::from_millis(300));
    let t1 = Instant::now();
    k.lab.agents[w].kill9();
    wait_answered_elsewhere(&cap, &[web], k.lab.macs[w], t1, Duration::from_secs(10))?;
    let took = t1.elapsed();
    std::thread::sleep(Duration::from_secs(1));
    k.ensure_moved(
        cap,
        web,
        (w, a),
        false,
        &format!("node-{w} killed: node-{a} answered after {took:?}"),
    )?;
    ensure!(took < Duration::from_secs(5), "took {took:?}");
    k.lab.agents[w].restart()?;

    k.ensure_requests_allowed()
}

/// `cargo xtask bench lb`: an `externalTrafficPolicy: Local` endpoint
/// moving to another node (a rolling update: the new one ready and the
/// old one terminating in one slice update, the old one gone 1 s later),
/// at least 20 moves. Per move, the time from the slice update to the
/// first answer from the new node; overlaps are probe rounds (50 ms)
/// answered by two nodes. Goals (#44), gated: no overlap, p99 <= 1.5 s.
#[test]
#[ignore = "a benchmark: cargo xtask bench lb"]
fn local_endpoint_move_bench() -> anyhow::Result<()> {
    privileged!();
    let (lab, _) = lab()?;
    let k = &lab;
    let web = create_service(k, "move", "Local")?;
    set_slice(k, "move", &[(0, true, true, false)])?;
    k.wait_answering(web, &[0])?;
    let moves = lockstep_tests::bench::size(20, 2);
    let (mut gaps, mut overlaps) = (Vec::new(), 0usize);
    let mut at = 0usize;
    for i in 0..moves {
        let to = (at + 1 + i % 2) % 3;
        let cap = Capture::start(&k.lab, vec![web], Duration::from_millis(50))?;
        std::thread::sleep(Duration::from_millis(300));
        let t0 = Instant::now();
        set_slice(
            k,
            "move",
            &[(at, false, true, true), (to, true, true, false)],
        )?;
        wait_answered_elsewhere(&cap, &[web], k.lab.macs[at], t0, Duration::from_secs(10))?;
        let first = cap
            .seen()
            .iter()
            .filter(|s| s.addr == web && s.at > t0 && s.mac == k.lab.macs[to])
            .map(|s| s.at)
            .min()
            .context("answered from the new node")?;
        gaps.push(first - t0);
        std::thread::sleep(Duration::from_secs(1));
        set_slice(k, "move", &[(to, true, true, false)])?;
        std::thread::sleep(Duration::from_millis(500));
        let (seen, rounds) = cap.finish()?;
        let (o, _, problems) = judge(&k.lab, &seen, &rounds, &[web], k.lab.macs[at]);
        if o > 0 {
            eprintln!("overlap: {problems:?}");
        }
        overlaps += o;
        at = to;
    }
    gaps.sort();
    println!("| externalTrafficPolicy: Local endpoint moved (rolling update, Lease 1 s) | value |");
    println!("|---|---|");
    println!("| moves | {} |", gaps.len());
    println!(
        "| slice updated -> answered from the new node: p50 / p99 | {:.0} / {:.0} ms (goal p99 <= 1500 ms) |",
        pct(&gaps, 0.5).as_secs_f64() * 1e3,
        pct(&gaps, 0.99).as_secs_f64() * 1e3
    );
    println!("| probe rounds answered by two nodes | {overlaps} |");
    ensure!(overlaps == 0, "{overlaps} overlaps");
    ensure!(
        pct(&gaps, 0.99) <= Duration::from_millis(1500) || lockstep_tests::bench::smoke(),
        "goal missed: endpoint move p99 {:?} > 1.5 s",
        pct(&gaps, 0.99)
    );
    Ok(())
}
