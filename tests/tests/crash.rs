//! Crash consistency: eight clients allocate and release through the API
//! while the agent is killed with SIGKILL at random moments, fifty times.
//!
//! Clients record what was acknowledged (a 2xx reply). A request that got no
//! reply (reset, cut connection) may or may not have taken effect: its owner is
//! "uncertain" until the next check, which resolves it from what the restarted
//! agent reports. After every restart, with the clients paused, the agent must
//! hold every acknowledged allocation (same address, same generation), nothing
//! acknowledged-released, no address twice, no owner twice per pool and
//! family, and `lockstep verify` must pass.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use lockstep_tests::ledger::{self, Gate, Model, Pool, Rng, Shared, StopOnDrop, get};
use lockstep_tests::{AgentProc, Netns, privileged};

const POOL: Pool = Pool {
    name: "crash",
    v4_base: Ipv4Addr::new(10, 60, 0, 0),
    v4_prefix: 22,
    v6_base: Ipv6Addr::new(0xfd00, 0x60, 0, 0, 0, 0, 0, 0),
    v6_prefix: 118,
    owner_tag: "crash",
};

const KILLS: usize = 50;

#[test]
fn sigkill_at_random_moments_loses_no_acknowledged_change() -> anyhow::Result<()> {
    privileged!();
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos() as u64;
    eprintln!("crash test seed {seed:#x}");
    let node = Netns::new("crash")?;
    let mut agent = AgentProc::start(&node, &POOL.config())?;
    let socket = agent.socket();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let gate = Gate::default();
    let shared = Shared::default();
    let models: Vec<Model> = ledger::models();
    let mut rng = Rng(seed);
    let started = Instant::now();
    let mut max_ready = Duration::ZERO;
    let mut kills = 0;

    std::thread::scope(|s| -> anyhow::Result<()> {
        let _stop = StopOnDrop(&gate);
        ledger::spawn_clients(s, &POOL, &socket, &gate, &models, &shared, seed);
        for round in 0..KILLS {
            gate.resume();
            std::thread::sleep(Duration::from_millis(20 + rng.below(281)));
            agent.kill9();
            kills += 1;
            gate.pause();
            let took = agent
                .restart()
                .with_context(|| format!("restart after kill {}", round + 1))?;
            max_ready = max_ready.max(took);
            ledger::check(&POOL, &rt, &agent, &models, &shared, round)?;
        }
        Ok(())
    })?;

    // A clean stop keeps everything too.
    let status = agent.stop()?.context("agent was running")?;
    ensure!(status.success(), "SIGTERM is a clean exit: {status}");
    max_ready = max_ready.max(agent.restart()?);
    ledger::check(&POOL, &rt, &agent, &models, &shared, KILLS)?;

    let c = &shared.counts;
    let held = ledger::held(&models);
    eprintln!(
        "crash test: {kills} kills in {:.1?}; {}; {held} held at the end; \
         max time to ready {max_ready:?}",
        started.elapsed(),
        ledger::summary(c),
    );
    assert_eq!(kills, KILLS);
    assert!(
        get(&c.acked_allocations) > 500,
        "too few acknowledged allocations"
    );
    assert!(
        get(&c.acked_releases) > 200,
        "too few acknowledged releases"
    );
    assert!(get(&c.idempotent) > 50, "too few idempotent repeats");
    assert!(get(&c.stale_refused) > 20, "too few stale releases");
    assert!(
        max_ready < Duration::from_secs(10),
        "restart took {max_ready:?}"
    );
    Ok(())
}

const FULL_POOL: &str = r#"
reconcile_interval = "60s"
default_pool = "killfull"
[[pools]]
name = "killfull"
ipv4 = ["10.66.0.0/22"]
[datapath]
endpoint_attach_mode = "tcx"
"#;

/// Host-side interfaces with the agent's names (`lxc`/`tmp` + 12 hex) in `ns`.
fn agent_veths(ns: &Netns) -> anyhow::Result<std::collections::BTreeMap<String, u32>> {
    let out = ns.ip(["-o", "link", "show"])?;
    Ok(out
        .lines()
        .filter_map(|l| {
            let mut parts = l.split(": ");
            let index = parts.next()?.trim().parse().ok()?;
            let name = parts.next()?.split('@').next()?.to_string();
            let hex = name
                .strip_prefix("lxc")
                .or_else(|| name.strip_prefix("tmp"))?;
            (hex.len() == 12).then_some((name, index))
        })
        .collect())
}

/// Interface indexes of the `from_endpoint` link pins under `pins`.
fn endpoint_link_pins(pins: &std::path::Path) -> anyhow::Result<std::collections::BTreeSet<u32>> {
    let mut out = std::collections::BTreeSet::new();
    let dir = pins.join("links");
    if !dir.exists() {
        return Ok(out);
    }
    for entry in std::fs::read_dir(&dir)? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if let Some(i) = name.strip_prefix("from_endpoint-ingress-") {
            out.insert(i.parse()?);
        }
    }
    Ok(out)
}

/// Full-mode ADDs (veth into a namespace, TCX link pinned, then the commit)
/// and DELs, with the agent SIGKILLed at random moments. An ADD killed
/// between its interfaces and its commit leaves a veth and a link pin no
/// record owns: the restarted agent must sweep them before it is ready,
/// and a DEL of an attachment with no record must remove what a half-done
/// ADD of it made. After every restart every agent-named interface and
/// every `from_endpoint` link pin belongs to a record; at the end, after a
/// DEL of every attachment ever tried, nothing is left.
#[test]
fn sigkill_during_full_adds_leaves_no_interface_or_link_pin() -> anyhow::Result<()> {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};

    use hyper::Method;
    use lockstep::client::call;
    use serde_json::json;

    privileged!();
    const ROUNDS: usize = 12;
    const CLIENTS: usize = 2;
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos() as u64;
    eprintln!("full-ADD crash test seed {seed:#x}");
    let mut rng = Rng(seed);
    let node = Netns::new("killfull")?;
    let pods: Vec<Netns> = (0..CLIENTS)
        .map(|_| Netns::new("killpod"))
        .collect::<anyhow::Result<_>>()?;
    let mut agent = AgentProc::start(&node, FULL_POOL)?;
    let socket = agent.socket();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let tried: Mutex<Vec<String>> = Mutex::new(Vec::new());
    // ADDs whose DEL failed (the agent was down): DEL'd again once it is
    // back, as the runtime retries.
    let undone: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let mut acked = 0usize;
    for round in 0..ROUNDS {
        let stop = AtomicBool::new(false);
        let acked_round = std::thread::scope(|s| -> anyhow::Result<usize> {
            let workers: Vec<_> = pods
                .iter()
                .enumerate()
                .map(|(c, pod)| {
                    let (socket, stop, tried, undone) = (&socket, &stop, &tried, &undone);
                    s.spawn(move || -> anyhow::Result<usize> {
                        let rt = tokio::runtime::Builder::new_current_thread()
                            .enable_all()
                            .build()?;
                        let mut acked = 0;
                        let mut n = 0;
                        while !stop.load(Ordering::SeqCst) {
                            let id = format!("kill{round}c{c}n{n}");
                            n += 1;
                            tried.lock().expect("lock").push(id.clone());
                            let add = rt.block_on(call(
                                socket,
                                Method::POST,
                                "/v1/cni/add",
                                Some(json!({"container_id": id, "ifname": "eth0",
                                    "netns": pod.path(), "mode": "full"})),
                            ));
                            // Every ADD is DEL'd, as a runtime does after a
                            // failed one too (it may have committed and died
                            // before answering; its eth0 would block the pod).
                            // A DEL the kill cut short is retried once the
                            // agent is back.
                            let del = rt.block_on(call(
                                socket,
                                Method::POST,
                                "/v1/cni/del",
                                Some(json!({"container_id": id, "ifname": "eth0"})),
                            ));
                            if del.is_err() {
                                undone.lock().expect("lock").push(id);
                            }
                            if add.is_ok() {
                                acked += 1;
                            } else {
                                std::thread::sleep(Duration::from_millis(5));
                            }
                        }
                        Ok(acked)
                    })
                })
                .collect();
            std::thread::sleep(Duration::from_millis(40 + rng.below(160)));
            agent.kill9();
            stop.store(true, Ordering::SeqCst);
            let mut acked = 0;
            for w in workers {
                acked += w.join().expect("client thread")?;
            }
            Ok(acked)
        })?;
        acked += acked_round;
        agent
            .restart()
            .with_context(|| format!("restart after kill {}", round + 1))?;
        let records = rt.block_on(call(&socket, Method::GET, "/v1/endpoints", None))?;
        let owned: std::collections::BTreeMap<String, u32> = records
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|r| {
                Some((
                    r["host_ifname"].as_str()?.to_string(),
                    u32::try_from(r["host_ifindex"].as_u64()?).ok()?,
                ))
            })
            .collect();
        let veths = agent_veths(&node)?;
        for (name, index) in &veths {
            ensure!(
                owned.get(name) == Some(index),
                "round {round}: interface {name} ({index}) belongs to no record after restart; records: {owned:?}"
            );
        }
        let owned_index: std::collections::BTreeSet<u32> = owned.values().copied().collect();
        let pins = endpoint_link_pins(agent.pins.path())?;
        ensure!(
            pins.is_subset(&owned_index),
            "round {round}: link pins {pins:?} include some no record owns ({owned_index:?})"
        );
        for id in std::mem::take(&mut *undone.lock().expect("lock")) {
            rt.block_on(call(
                &socket,
                Method::POST,
                "/v1/cni/del",
                Some(json!({"container_id": id, "ifname": "eth0"})),
            ))
            .with_context(|| format!("round {round}: DEL of the failed ADD {id}"))?;
        }
    }
    // A DEL of every attachment ever tried removes everything.
    for id in tried.lock().expect("lock").iter() {
        rt.block_on(call(
            &socket,
            Method::POST,
            "/v1/cni/del",
            Some(serde_json::json!({"container_id": id, "ifname": "eth0"})),
        ))
        .with_context(|| format!("DEL of {id}"))?;
    }
    // A full DEL's veth goes through the reaper, then its addresses.
    let _ = lockstep_tests::wait_for(
        "the last veth reaped and its addresses released",
        Duration::from_secs(5),
        || {
            let held = agent.json(["allocations", "-o", "json"]).ok()?;
            (agent_veths(&node).ok()?.is_empty() && held.as_array().is_some_and(Vec::is_empty))
                .then_some(())
        },
    );
    let veths = agent_veths(&node)?;
    ensure!(
        veths.is_empty(),
        "interfaces left after DEL of all: {veths:?}"
    );
    let pins = endpoint_link_pins(agent.pins.path())?;
    ensure!(pins.is_empty(), "link pins left after DEL of all: {pins:?}");
    for pod in &pods {
        let links = pod.ip(["-o", "link", "show"])?;
        ensure!(
            !links.contains("eth0"),
            "eth0 left in {}: {links}",
            pod.name()
        );
    }
    let held = agent.json(["allocations", "-o", "json"])?;
    ensure!(
        held.as_array().is_some_and(Vec::is_empty),
        "allocations left: {held}"
    );
    let swept = agent
        .log()
        .matches("removing what a half-done ADD left")
        .count()
        + agent.log().matches("link pin no record owns").count();
    eprintln!(
        "full-ADD crash test: {ROUNDS} kills, {acked} ADDs acknowledged, {} attachments tried, {swept} leftovers swept",
        tried.lock().expect("lock").len()
    );
    ensure!(acked > ROUNDS, "too few acknowledged ADDs: {acked}");
    ensure!(
        swept > 0,
        "no kill landed between an ADD's interfaces and its commit: the test did not exercise the sweep"
    );
    Ok(())
}
