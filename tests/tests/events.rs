//! Rare datapath events reach the agent's log through aya-log when the
//! DATAPATH_DEBUG switch is on, and not while it is off.
//!
//! The event used is an ARP request for an announced LoadBalancer address,
//! answered by from_native: a neighbour namespace sends it with `arping`.
//! Waits are for the log line itself, never a fixed time.

use std::time::Duration;

use anyhow::{Context, ensure};
use lockstep_tests::{AgentProc, Netns, lockstep_bin, privileged, veth, wait_for};

/// `lockstep datapath debug STATE` on the agent's pin root; its output.
fn debug(agent: &AgentProc, state: &str) -> anyhow::Result<String> {
    let out = std::process::Command::new(lockstep_bin())
        .args(["datapath", "debug", state, "--pin-root"])
        .arg(agent.pins.path())
        .output()?;
    ensure!(
        out.status.success(),
        "datapath debug {state}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn arping(nb: &Netns, addr: &str) -> anyhow::Result<()> {
    let out = nb
        .command("arping")
        .args(["-c", "1", "-w", "3", "-I", "n0", addr])
        .output()?;
    ensure!(
        out.status.success(),
        "no ARP answer for {addr}: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    Ok(())
}

/// Lines of the agent's log that report an answered ARP request for `addr`.
fn arp_events(agent: &AgentProc, addr: &str) -> usize {
    agent
        .log()
        .lines()
        .filter(|l| l.contains("answered ARP for") && l.contains(addr))
        .count()
}

#[test]
fn an_answered_arp_request_is_logged_only_while_events_are_on() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("node")?;
    let nb = Netns::new("nb")?;
    veth(&node, "u0", &nb, "n0")?;
    nb.ip(["addr", "add", "10.91.0.2/24", "dev", "n0"])?;
    let agent = AgentProc::start(
        &node,
        "[[pools]]\nname = \"pods\"\nipv4 = [\"10.81.0.0/24\"]\n[datapath]\nuplink = \"u0\"\n",
    )?;
    agent.lb_apply(&serde_json::json!({
        "pools": [{"name": "public", "cidrs": ["10.91.0.16/28"], "announce": "l2"}],
        "services": [{"namespace": "shop", "name": "web",
                      "ports": [{"protocol": "TCP", "port": 443}]}]
    }))?;
    let addr = "10.91.0.17";
    ensure!(debug(&agent, "status")?.contains("off"), "events start off");

    // Off: the request is answered, no event is logged. The switch goes on
    // after this answer, and the next answer's event is the first: had the
    // first answer been logged, the count below would be two.
    arping(&nb, addr)?;
    ensure!(debug(&agent, "on")?.contains("on"));
    arping(&nb, addr)?;
    wait_for(
        "the ARP event in the agent's log",
        Duration::from_secs(10),
        || (arp_events(&agent, addr) >= 1).then_some(()),
    )?;
    let log = agent.log();
    let line = log
        .lines()
        .find(|l| l.contains("answered ARP for"))
        .context("event line")?;
    ensure!(
        line.contains("10.91.0.2") && line.contains("from_native"),
        "{line}"
    );

    // Off again: a third answer adds no event. Then on, and a fourth answer:
    // the ring is read in order, so once the fourth answer's event is in the
    // log, the third's would be too, had it been written.
    ensure!(debug(&agent, "off")?.contains("off"));
    arping(&nb, addr)?;
    ensure!(debug(&agent, "on")?.contains("on"));
    arping(&nb, addr)?;
    wait_for("the fourth answer's event", Duration::from_secs(10), || {
        (arp_events(&agent, addr) >= 2).then_some(())
    })?;
    ensure!(
        arp_events(&agent, addr) == 2,
        "events for the second and fourth answers only (on), none for the first and third (off):\n{}",
        agent.log()
    );
    eprintln!("{line}");
    Ok(())
}
