//! LoadBalancer IPAM end to end: the agent assigns from a pool announced on
//! L2, from_native answers ARP for the address with the node's MAC, a
//! gratuitous ARP goes out on assignment, and answers stop on delete.

use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use lockstep_tests::{AgentProc, Netns, privileged, veth};

const CONFIG: &str = r#"
[[pools]]
name = "pods"
ipv4 = ["10.80.0.0/24"]
"#;

fn arping(nb: &Netns, addr: &str, count: &str, deadline: &str) -> anyhow::Result<(bool, String)> {
    let out = nb
        .command("arping")
        .args(["-c", count, "-w", deadline, "-I", "n0", addr])
        .output()?;
    Ok((
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    ))
}

/// Waits for tcpdump's "listening on" line on its `stderr`.
fn wait_listening(stderr: std::process::ChildStderr) -> anyhow::Result<()> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufRead::lines(std::io::BufReader::new(stderr)) {
            let Ok(line) = line else { break };
            if line.contains("listening on") {
                let _ = tx.send(());
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(20))
        .context("tcpdump did not start listening within 20 s")
}

#[test]
fn announced_lb_addresses_are_answered_by_bpf_and_withdrawn_on_delete() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("node")?;
    let nb = Netns::new("nb")?;
    veth(&node, "u0", &nb, "n0")?;
    nb.ip(["addr", "add", "10.90.0.2/24", "dev", "n0"])?;
    let node_mac = node.mac("u0")?;
    let mut agent = AgentProc::start(&node, &format!("{CONFIG}\n[datapath]\nuplink = \"u0\"\n"))?;
    agent.lb_apply(&serde_json::json!({"pools": [{
        "name": "public", "cidrs": ["10.90.0.16/28"], "announce": "l2",
        "serviceSelector": {"matchLabels": {"expose": "yes"}}
    }]}))?;

    // Capture on the neighbour while the service is assigned.
    let mut capture = nb
        .command("tcpdump")
        .args([
            "-i",
            "n0",
            "-n",
            "-l",
            "-c",
            "1",
            "arp and src host 10.90.0.17 and dst host 10.90.0.17",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    // tcpdump says "listening on" once its capture is open: only then can
    // the gratuitous ARP be seen.
    wait_listening(capture.stderr.take().context("tcpdump stderr")?)?;
    let view = agent.lb_apply(&serde_json::json!({"services": [{
        "namespace": "shop", "name": "web", "labels": {"expose": "yes"},
        "ports": [{"protocol": "TCP", "port": 443}]
    }]}))?;
    let addr = view["services"]["shop/web"]["assignment"]["addresses"][0]
        .as_str()
        .with_context(|| format!("no address assigned: {view}"))?
        .to_string();
    ensure!(
        addr == "10.90.0.17",
        "the first usable address of the /28: {addr}"
    );

    // The gratuitous ARP reached the neighbour.
    let started = Instant::now();
    loop {
        if capture.try_wait()?.is_some() {
            break;
        }
        ensure!(
            started.elapsed() < Duration::from_secs(5),
            "no gratuitous ARP captured"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut seen = String::new();
    std::io::Read::read_to_string(capture.stdout.as_mut().context("stdout")?, &mut seen)?;
    assert!(seen.contains("10.90.0.17"), "capture: {seen}");

    // ARP is answered by from_native with the node's MAC; no kernel address
    // holds 10.90.0.17.
    let (ok, out) = arping(&nb, &addr, "2", "3")?;
    assert!(ok, "no ARP answer: {out}");
    assert!(out.to_ascii_lowercase().contains(&node_mac), "{out}");
    assert!(!node.ip(["-j", "addr"])?.contains("10.90.0.17"));

    // Sticky across a restart.
    agent.restart()?;
    let view = agent.json(["lb", "get", "-o", "json"])?;
    assert_eq!(
        view["services"]["shop/web"]["assignment"]["addresses"][0],
        addr.as_str()
    );
    let out = agent.cli(["verify"])?;
    assert!(
        out.status.success(),
        "verify after the restart: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    // Delete: the address goes back to the pool and answers stop at once.
    let deleted = Instant::now();
    let out = agent.cli(["lb", "delete", "--service", "shop/web"])?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (ok, out) = arping(&nb, &addr, "1", "1")?;
    let silent_after = deleted.elapsed();
    assert!(!ok, "still answered after delete: {out}");
    assert!(silent_after < Duration::from_secs(3), "{silent_after:?}");
    let view = agent.json(["lb", "get", "-o", "json"])?;
    assert_eq!(view["pools"][0]["metrics"]["used"], 0, "{view}");
    assert!(agent.cli(["verify"])?.status.success());
    Ok(())
}

#[test]
fn an_lb_pool_overlapping_a_node_pool_is_refused_and_nothing_changes() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("node")?;
    let agent = AgentProc::start(&node, CONFIG)?;
    let path = agent.dir.path().join("bad.json");
    std::fs::write(
        &path,
        serde_json::json!({"pools": [{"name": "clash", "cidrs": ["10.80.0.128/25"]}]}).to_string(),
    )?;
    let out = agent.cli(["lb", "apply", "-f", path.to_str().context("utf-8")?])?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("10.80.0.128/25 overlaps 10.80.0.0/24 of node pool pods"),
        "{err}"
    );
    let view = agent.json(["lb", "get", "-o", "json"])?;
    assert_eq!(view["pools"].as_array().map(Vec::len), Some(0));
    Ok(())
}
