//! The agent's masquerade settings (#14): a translated port range that
//! meets the node's own ephemeral ports is refused before the agent starts,
//! naming both ranges, and nothing is translated; a range clear of them is
//! written to MASQ_CONFIG with the uplink's addresses.

use std::time::{Duration, Instant};

use anyhow::ensure;
use lockstep_tests::world::{NODE_V4, NODE_V6, World};
use lockstep_tests::{AgentProc, privileged, sh};

const POOLS: &str = "[[pools]]\nname = \"pods\"\nipv4 = [\"10.89.0.0/24\"]\n";

#[test]
fn a_port_range_meeting_the_ephemeral_ports_is_refused_naming_both() -> anyhow::Result<()> {
    privileged!();
    let w = World::new()?;
    w.node
        .sysctl("net.ipv4.ip_local_port_range", "32768 60999")?;
    let mut agent = AgentProc::spawn_unready(
        &w.node,
        &World::agent_config(POOLS, "[masquerade]\nports = \"60000-65535\"\n"),
    )?;
    let started = Instant::now();
    let status = loop {
        if let Some(s) = agent.exited()? {
            break s;
        }
        ensure!(
            started.elapsed() < Duration::from_secs(10),
            "the agent kept running with an overlapping range: {}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let log = agent.log();
    ensure!(!status.success(), "exit {status}: {log}");
    ensure!(
        log.contains("60000-65535") && log.contains("32768-60999"),
        "the refusal names both ranges: {log}"
    );
    // Refused before the datapath was touched: no MASQ_CONFIG was written.
    ensure!(
        !agent.pins.path().join("maps/MASQ_CONFIG").exists(),
        "the refused agent made its maps"
    );
    Ok(())
}

#[test]
fn a_clear_range_and_the_uplink_addresses_reach_masq_config() -> anyhow::Result<()> {
    privileged!();
    let w = World::new()?;
    let agent = AgentProc::start(
        &w.node,
        &World::agent_config(POOLS, "[masquerade]\nports = \"61100-61199\"\n"),
    )?;
    let pin = agent.pins.path().join("maps/MASQ_CONFIG");
    let dump: serde_json::Value = serde_json::from_str(&sh(
        "bpftool",
        ["map", "dump", "pinned", &pin.display().to_string()],
    )?)?;
    let v = &dump[0]["value"];
    let v4: Vec<u8> = NODE_V4.parse::<std::net::Ipv4Addr>()?.octets().to_vec();
    let v6: Vec<u8> = NODE_V6.parse::<std::net::Ipv6Addr>()?.octets().to_vec();
    ensure!(v["port_min"] == 61100 && v["port_max"] == 61199, "{v}");
    ensure!(v["flags"] == 3, "both families enabled: {v}");
    ensure!(v["node_v4"] == serde_json::json!(v4), "{v}");
    ensure!(v["node_v6"] == serde_json::json!(v6), "{v}");
    Ok(())
}
