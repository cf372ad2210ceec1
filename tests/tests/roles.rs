//! Agent-owned addresses: reserved before any endpoint request is served,
//! stable across restarts, never handed to an endpoint, released when their
//! role is disabled.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context;
use hyper::Method;
use lockstep_tests::{AgentProc, Netns, privileged};
use serde_json::json;

/// A small pool, so endpoints and roles compete for the same addresses.
const CONFIG: &str = r#"
[[pools]]
name = "default"
ipv4 = ["10.85.0.0/26"]
ipv6 = ["fd00:85::/122"]
[roles.ingress]
ipv4 = true
ipv6 = true
announce = true
[roles.health]
ipv4 = true
[roles.router]
ipv4 = true
ipv6 = true
"#;

fn roles(agent: &AgentProc) -> anyhow::Result<serde_json::Value> {
    Ok(agent.json(["status", "-o", "json"])?["roles"].clone())
}

fn role_addresses(v: &serde_json::Value) -> BTreeSet<String> {
    v.as_object()
        .into_iter()
        .flatten()
        .flat_map(|(_, addrs)| addrs.as_array().cloned().unwrap_or_default())
        .filter_map(|a| a.as_str().map(str::to_string))
        .collect()
}

#[test]
fn role_addresses_are_reserved_first_and_never_given_to_endpoints() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("node")?;
    veth_uplink(&node)?;
    let mut agent = AgentProc::start(&node, &format!("{CONFIG}\n[datapath]\nuplink = \"u0\"\n"))?;
    let before = roles(&agent)?;
    let reserved = role_addresses(&before);
    assert_eq!(
        reserved.len(),
        5,
        "ingress v4+v6, health v4, router v4+v6: {before}"
    );

    // In IPCACHE with reserved identities and role flags; ingress announced.
    let dump: serde_json::Value = agent.maps_dump()?;
    let ingress_v4 = before["ingress"]
        .as_array()
        .and_then(|a| {
            a.iter()
                .filter_map(|x| x.as_str())
                .find(|x| x.contains('.'))
        })
        .context("ingress v4")?
        .to_string();
    let entry = dump["IPCACHE_V4"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|e| e["prefix"] == format!("{ingress_v4}/32"))
        .context("ingress in IPCACHE")?;
    assert_eq!(entry["identity"], 8, "{entry}");
    assert_eq!(entry["flags"], json!(["ingress"]), "{entry}");
    assert!(
        dump["L2_RESP_V4"].to_string().contains(&ingress_v4),
        "ingress announced: {}",
        dump["L2_RESP_V4"]
    );

    // Endpoint ADDs flood in from 6 clients while the agent is killed and
    // restarted; every acknowledged endpoint address is recorded.
    let stop = Arc::new(AtomicBool::new(false));
    let socket = agent.socket();
    let mut clients = Vec::new();
    for c in 0..6 {
        let stop = stop.clone();
        let socket = socket.clone();
        clients.push(std::thread::spawn(move || -> Vec<String> {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            let mut got = Vec::new();
            let mut i = 0u32;
            while !stop.load(Ordering::Relaxed) {
                let id = format!("flood-{c}-{i}");
                let add = json!({"container_id": id, "ifname": "eth0", "netns": "/nonexistent", "mode": "ipam"});
                if let Ok(v) = rt.block_on(lockstep::client::call(&socket, Method::POST, "/v1/cni/add", Some(add))) {
                    for a in v["addresses"].as_array().into_iter().flatten() {
                        if let Some(s) = a["address"].as_str() {
                            got.push(s.split('/').next().unwrap_or_default().to_string());
                        }
                    }
                    // Free it again so the small pool keeps cycling.
                    let del = json!({"container_id": id, "ifname": "eth0"});
                    let _ = rt.block_on(lockstep::client::call(&socket, Method::POST, "/v1/cni/del", Some(del)));
                }
                i += 1;
            }
            got
        }));
    }
    for _ in 0..5 {
        std::thread::sleep(Duration::from_millis(300));
        agent.restart()?;
        assert_eq!(
            roles(&agent)?,
            before,
            "role addresses changed across a restart"
        );
    }
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    let mut endpoint_addresses = BTreeSet::new();
    for c in clients {
        endpoint_addresses.extend(c.join().map_err(|_| anyhow::anyhow!("client panicked"))?);
    }
    eprintln!(
        "{} distinct endpoint addresses handed out across 5 restarts; roles {reserved:?}",
        endpoint_addresses.len()
    );
    assert!(endpoint_addresses.len() > 20, "the flood did not get going");
    let clash: Vec<_> = endpoint_addresses.intersection(&reserved).collect();
    assert!(
        clash.is_empty(),
        "endpoints received role addresses: {clash:?}"
    );
    assert!(agent.cli(["verify"])?.status.success());
    Ok(())
}

fn veth_uplink(node: &Netns) -> anyhow::Result<()> {
    node.ip(["link", "add", "u0", "type", "veth", "peer", "name", "u1"])?;
    node.ip(["link", "set", "u0", "up"])?;
    node.ip(["link", "set", "u1", "up"])?;
    Ok(())
}

#[test]
fn disabling_a_role_releases_its_address() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("node")?;
    let mut agent = AgentProc::start(&node, CONFIG)?;
    let before = roles(&agent)?;
    let health = before["health"][0]
        .as_str()
        .context("health address")?
        .to_string();
    // Turn health off and restart.
    let text = std::fs::read_to_string(&agent.config)?;
    std::fs::write(
        &agent.config,
        text.replace(
            "[roles.health]\nipv4 = true",
            "[roles.health]\nipv4 = false",
        ),
    )?;
    agent.restart()?;
    let after = roles(&agent)?;
    assert!(after.get("health").is_none(), "{after}");
    assert_eq!(
        after["ingress"], before["ingress"],
        "other roles keep their addresses"
    );
    assert_eq!(after["router"], before["router"]);
    let all = agent.json(["allocations", "-o", "json"])?;
    assert!(!all.to_string().contains(&format!("\"{health}\"")), "{all}");
    assert!(
        agent.cli(["verify"])?.status.success(),
        "its IPCACHE entry went with it"
    );
    Ok(())
}
