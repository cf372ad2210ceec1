//! The agent end to end: real store, real pinned maps, real API socket.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{Context, ensure};
use lockstep_tests::{AgentProc, Netns, privileged, sh};

const POOLS: &str = r#"
reconcile_interval = "300ms"
[[pools]]
name = "default"
ipv4 = ["10.50.0.0/24"]
ipv6 = ["fd00:50::/120"]
"#;

fn stdout(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn allocate(agent: &AgentProc, name: &str, family: &str) -> anyhow::Result<serde_json::Value> {
    agent.json([
        "allocate", "--kind", "endpoint", "--name", name, "--family", family, "-o", "json",
    ])
}

fn allocations(agent: &AgentProc) -> anyhow::Result<Vec<serde_json::Value>> {
    Ok(agent
        .json(["allocations", "-o", "json"])?
        .as_array()
        .context("allocations is not a list")?
        .clone())
}

#[test]
fn a_full_map_refuses_the_allocation_and_changes_nothing() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("node")?;
    let agent = AgentProc::start(
        &node,
        &format!("{POOLS}\n[datapath]\nipcache_max_entries = 4\n"),
    )?;
    for i in 0..4 {
        allocate(&agent, &format!("c{i}"), "ipv4")?;
    }
    let before = allocations(&agent)?;
    assert_eq!(before.len(), 4);
    let out = agent.cli([
        "allocate", "--kind", "endpoint", "--name", "c4", "--family", "ipv4",
    ])?;
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("map_full"), "{err}");
    assert!(err.contains("IPCACHE_HOST_V4 is full (4 entries)"), "{err}");
    assert!(err.contains("rolled back"), "{err}");
    assert_eq!(allocations(&agent)?, before, "nothing stored changed");
    // And nothing changed durably either: the store after a restart agrees.
    let mut agent = agent;
    agent.restart()?;
    assert_eq!(allocations(&agent)?, before);
    assert!(agent.cli(["verify"])?.status.success());
    // The pool still had room; the map was the limit.
    let pools = agent.json(["pools", "-o", "json"])?;
    assert_eq!(pools[0]["v4"][0], 4);
    Ok(())
}

fn key_bytes(addr: &str) -> Vec<String> {
    addr.split('.').map(str::to_string).collect()
}

#[test]
fn drift_is_reported_by_verify_and_repaired_by_reconcile() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("node")?;
    let agent = AgentProc::start(&node, POOLS)?;
    let a = allocate(&agent, "c1", "ipv4")?;
    let b = allocate(&agent, "c2", "ipv4")?;
    assert!(agent.cli(["verify"])?.status.success());
    let pin = agent.pins.path().join("maps/IPCACHE_HOST_V4");
    let pin = pin.to_str().context("utf-8")?;
    let a_addr = a["address"].as_str().context("address")?.to_string();
    let b_addr = b["address"].as_str().context("address")?.to_string();

    // Delete one entry, corrupt another, plant a third, all behind the
    // agent's back with bpftool.
    let mut del = vec!["map", "delete", "pinned", pin, "key"];
    let ka = key_bytes(&a_addr);
    del.extend(ka.iter().map(String::as_str));
    sh("bpftool", &del)?;
    let kb = key_bytes(&b_addr);
    let mut upd = vec!["map", "update", "pinned", pin, "key"];
    upd.extend(kb.iter().map(String::as_str));
    upd.push("value");
    let bad_value = ["7", "0", "0", "0"]
        .into_iter()
        .chain(std::iter::repeat_n("0", 28))
        .collect::<Vec<_>>();
    upd.extend(bad_value.iter().copied());
    sh("bpftool", &upd)?;
    let mut plant = vec![
        "map", "update", "pinned", pin, "key", "10", "50", "0", "200", "value",
    ];
    plant.extend(bad_value.iter().copied());
    sh("bpftool", &plant)?;
    // A slot array entry no ENDPOINTS entry backs (this agent has none).
    let slots_pin = agent.pins.path().join("maps/ENDPOINT_SLOTS");
    let slots_pin = slots_pin.to_str().context("utf-8")?;
    let mut slot = vec![
        "map", "update", "pinned", slots_pin, "key", "7", "0", "0", "0", "value",
    ];
    slot.extend(std::iter::repeat_n(
        "9",
        size_of::<lockstep_common::EndpointSlot>(),
    ));
    sh("bpftool", &slot)?;
    // The same in the NDP responder's slot array (no L2_RESP_V6 entry here).
    let slots6_pin = agent.pins.path().join("maps/L2_RESP6_SLOTS");
    let slots6_pin = slots6_pin.to_str().context("utf-8")?;
    let mut slot6 = vec![
        "map", "update", "pinned", slots6_pin, "key", "7", "0", "0", "0", "value",
    ];
    slot6.extend(std::iter::repeat_n(
        "9",
        size_of::<lockstep_common::L2RespSlotV6>(),
    ));
    sh("bpftool", &slot6)?;

    // verify sees them all right away (the reconcile interval is 300 ms, so
    // run it before that can repair; retry if a reconcile raced us).
    let mut found = None;
    for _ in 0..20 {
        let out = agent.cli(["verify"])?;
        if !out.status.success() {
            found = Some(stdout(&out));
            break;
        }
        sh("bpftool", &del)?;
        sh("bpftool", &upd)?;
        sh("bpftool", &plant)?;
        sh("bpftool", &slot)?;
        sh("bpftool", &slot6)?;
    }
    let text = found.context("verify never reported the drift")?;
    assert!(
        text.contains(&format!("IPCACHE_HOST_V4 {a_addr} missing")),
        "{text}"
    );
    assert!(
        text.contains(&format!("IPCACHE_HOST_V4 {b_addr} different")),
        "{text}"
    );
    assert!(
        text.contains("IPCACHE_HOST_V4 10.50.0.200 unexpected"),
        "{text}"
    );
    assert!(text.contains("ENDPOINT_SLOTS slot 7 unexpected"), "{text}");
    assert!(text.contains("L2_RESP6_SLOTS slot 7 unexpected"), "{text}");

    // The periodic reconcile repairs it and counts the repairs.
    let started = std::time::Instant::now();
    loop {
        if agent.cli(["verify"])?.status.success() {
            break;
        }
        ensure!(
            started.elapsed() < Duration::from_secs(5),
            "drift not repaired"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let status = agent.json(["status", "-o", "json"])?;
    assert!(status["repairs"].as_u64().unwrap_or(0) >= 5, "{status}");
    let metrics = node.exec(
        "sh",
        [
            "-c",
            "curl -s http://$(ss -ltnH | awk '{print $4}' | head -1)/metrics",
        ],
    )?;
    assert!(
        metrics.contains("lockstep_reconcile_repairs_total{map=\"IPCACHE_HOST_V4\"} "),
        "{metrics}"
    );
    Ok(())
}

#[test]
fn restart_restores_every_allocation_and_reuses_the_maps() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("node")?;
    let mut agent = AgentProc::start(&node, POOLS)?;
    let mut want = BTreeSet::new();
    for i in 0..20 {
        let fam = if i % 2 == 0 { "ipv4" } else { "ipv6" };
        let a = allocate(&agent, &format!("c{i}"), fam)?;
        want.insert(a["address"].as_str().context("address")?.to_string());
    }
    let status = agent.stop()?.context("agent was running")?;
    assert!(status.success(), "SIGTERM is a clean exit: {status}");
    // The maps keep their entries while the agent is down.
    let dump: serde_json::Value = agent.maps_dump()?;
    let mut in_maps = BTreeSet::new();
    for fam in ["IPCACHE_V4", "IPCACHE_V6"] {
        for e in dump[fam].as_array().into_iter().flatten() {
            let p = e["prefix"].as_str().context("prefix")?;
            in_maps.insert(p.split('/').next().unwrap_or_default().to_string());
        }
    }
    assert_eq!(in_maps, want);
    agent.restart()?;
    let got: BTreeSet<String> = allocations(&agent)?
        .iter()
        .filter_map(|a| a["address"].as_str().map(str::to_string))
        .collect();
    assert_eq!(got, want);
    // Idempotent across the restart: same owner, same address.
    let again = allocate(&agent, "c0", "ipv4")?;
    assert!(want.contains(again["address"].as_str().context("address")?));
    // Nothing had to be re-programmed: the restore reconcile found the maps right.
    let status = agent.json(["status", "-o", "json"])?;
    assert_eq!(status["restored"]["added"], 0, "{status}");
    assert!(agent.cli(["verify"])?.status.success());
    Ok(())
}
