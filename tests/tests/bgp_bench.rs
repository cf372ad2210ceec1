//! `cargo xtask bench bgp` (#48): the agent with `[bgp]` beside BIRD,
//! one FRR router, the router's own kernel table read.
//!
//! - **Announce latency**: Services applied one by one with `lockstep lb
//!   apply`, each timed from the command's start to its route in the
//!   router's table; p50 and p99. Goal: p99 <= 1 s.
//! - **A large change**: 1,000 Services applied at once (`lb apply`s of
//!   200, back to back); the time until all 1,000 routes are in the
//!   router's table, and the
//!   session's resets meanwhile (FRR's `connectionsEstablished`). Goal:
//!   no reset. Then all 1,000 deleted: withdrawn, still no reset.
//!
//! A smoke run (`--smoke`) applies 5 and 20.

use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use lockstep_tests::bench::size;
use lockstep_tests::bgp::{AgentLab, service};
use lockstep_tests::traffic::check_goals;
use lockstep_tests::{pct, privileged};

/// The public pool: room for the large change.
fn pools() -> serde_json::Value {
    serde_json::json!({"pools": [
        {"name": "public", "cidrs": ["198.18.0.0/20"],
         "serviceSelector": {"matchLabels": {"pool": "public"}}}
    ]})
}

/// The router's BGP routes, as host addresses.
fn at_router(lab: &lockstep_tests::bgp::Lab) -> anyhow::Result<std::collections::BTreeSet<String>> {
    Ok(lockstep_tests::bgp::bgp_routes(&lab.routers[0].ns)?
        .into_keys()
        .collect())
}

#[test]
#[ignore = "a benchmark: cargo xtask bench bgp"]
fn bgp_bench() -> anyhow::Result<()> {
    privileged!();
    let AgentLab { agent, lab, .. } = AgentLab::start()?;
    let established = lab.settled(0)?;
    agent.lb_apply(&pools())?;

    // Announce latency, one Service at a time.
    let count = size(200, 5);
    let mut took = Vec::new();
    for i in 0..count {
        let one = service("bench", &format!("s{i}"), "public");
        let started = Instant::now();
        let view = agent.lb_apply(&serde_json::json!({ "services": [one] }))?;
        let addr = view["services"][format!("bench/s{i}")]["assignment"]["addresses"][0]
            .as_str()
            .with_context(|| format!("bench/s{i} has no address: {view}"))?
            .to_string();
        loop {
            if at_router(&lab)?.contains(&addr) {
                break;
            }
            ensure!(
                started.elapsed() < Duration::from_secs(10),
                "{addr} never reached the router"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        took.push(started.elapsed());
    }
    took.sort();
    let (p50, p99) = (pct(&took, 0.5), pct(&took, 0.99));
    println!(
        "bgp: Service applied -> route at the router, {count} Services one by one: p50 {p50:?}, p99 {p99:?}"
    );

    // A large change in one apply, then all of it deleted.
    let large = size(1000, 20);
    let doc: Vec<serde_json::Value> = (0..large)
        .map(|i| service("large", &format!("s{i}"), "public"))
        .collect();
    let before = at_router(&lab)?.len();
    let started = Instant::now();
    // In applies of 200 (a request body is at most 64 KiB).
    for chunk in doc.chunks(200) {
        agent.lb_apply(&serde_json::json!({ "services": chunk }))?;
    }
    let applied = started.elapsed();
    while at_router(&lab)?.len() < before + large {
        ensure!(
            started.elapsed() < Duration::from_secs(60),
            "{} of {large} routes at the router after 60 s",
            at_router(&lab)?.len() - before
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let all_in = started.elapsed();
    let names: Vec<String> = (0..large).map(|i| format!("large/s{i}")).collect();
    let started = Instant::now();
    let mut delete = vec!["lb".to_string(), "delete".to_string()];
    for n in &names {
        delete.push("--service".into());
        delete.push(n.clone());
    }
    let out = agent.cli(&delete)?;
    ensure!(
        out.status.success(),
        "lb delete: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    while at_router(&lab)?.len() > before {
        ensure!(
            started.elapsed() < Duration::from_secs(60),
            "{} routes left at the router after 60 s",
            at_router(&lab)?.len() - before
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let all_out = started.elapsed();
    let resets = lab.established_count(0)? - established;
    println!(
        "bgp: {large} Services applied at once: answered in {applied:?}, all at the router in {all_in:?}; \
         all deleted: withdrawn in {all_out:?}; session resets: {resets}"
    );
    let mut missed = Vec::new();
    if p99 > Duration::from_secs(1) {
        missed.push("announce p99 <= 1 s");
    }
    if resets > 0 {
        missed.push("no session reset");
    }
    check_goals(&missed)
}
