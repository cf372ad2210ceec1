//! An ADD that finds its pool full only of addresses being released
//! (#27 item 8): a full DEL is acknowledged before its pod's veth is gone
//! (the reaper deletes it, `docs/teardown.md`), and its addresses stay held
//! until then. An ADD in that window used to be answered "pool exhausted"
//! (a permanent error to the runtime) though a retry a moment later
//! succeeded. Now it waits for the releases (bounded) and is served, or is
//! answered CNI code 11 (try again later) if they do not come in time.
//!
//! The agent runs in a node namespace with a 4-address pool and
//! `teardown_batch_window = "1s"`, so the reaper holds a DEL'd pod's
//! addresses for a second: the window is there on purpose, not by chance.

use std::net::IpAddr;
use std::time::Duration;

use anyhow::ensure;
use lockstep_tests::cluster::{address_of, cni, cni_raw};
use lockstep_tests::{AgentProc, Netns, privileged};

/// A 4-address pool whose DEL'd pods' veths go after `window`.
fn config(window: &str) -> String {
    format!(
        "reconcile_interval = \"60s\"\ndefault_pool = \"tiny\"\n[cni]\nteardown_batch_window = \"{window}\"\n[[pools]]\nname = \"tiny\"\nipv4 = [\"10.66.0.0/30\"]\n"
    )
}

/// Pods (container id, namespace) and their addresses, in order.
type Filled = (Vec<(String, Netns)>, Vec<IpAddr>);

/// Fills the pool with pods (each in its own namespace, with its veth):
/// the pods and their addresses, in order.
fn fill(socket: &std::path::Path, tag: &str) -> anyhow::Result<Filled> {
    let mut pods = Vec::new();
    let mut addrs = Vec::new();
    loop {
        let pod = Netns::new(&format!("{tag}{}", pods.len()))?;
        let id = format!("{tag}-{}", pods.len());
        let (code, answer, _) = cni_raw(socket, "ADD", Some((id.as_str(), pod.path().as_path())))?;
        if code != 0 {
            ensure!(
                answer.to_string().contains("no free"),
                "the pool ran out with something else: {answer}"
            );
            break;
        }
        addrs.push(address_of(&answer)?);
        pods.push((id, pod));
        ensure!(pods.len() <= 4, "a /30 gave more than 4 addresses");
    }
    ensure!(!pods.is_empty(), "no address at all");
    Ok((pods, addrs))
}

#[test]
fn an_add_that_finds_only_releasing_addresses_waits_for_them() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("pend")?;
    let agent = AgentProc::start(&node, &config("1s"))?;
    let socket = agent.socket();
    let (pods, addrs) = fill(&socket, "pend")?;

    // The first pod goes: its DEL is acknowledged at once, its address is
    // held until the reaper deleted its veth (a second from now).
    let (gone_id, gone_ns) = &pods[0];
    cni(&socket, "DEL", gone_id, &gone_ns.path())?;
    let newcomer = Netns::new("pendnew")?;
    let (code, answer, took) = cni_raw(
        &socket,
        "ADD",
        Some(("pend-new", newcomer.path().as_path())),
    )?;
    ensure!(
        code == 0,
        "ADD while the only free address was being released: code {code}, {answer}"
    );
    let got = address_of(&answer)?;
    ensure!(
        got == addrs[0],
        "the newcomer got {got}, not the released {}",
        addrs[0]
    );
    eprintln!("ADD served after the release, in {took:?}");
    ensure!(
        took >= Duration::from_millis(500),
        "served in {took:?}: the release window was not in the way"
    );

    // Nothing is being released now: a full pool is exhausted, at once.
    let extra = Netns::new("pendx")?;
    let (code, answer, took) = cni_raw(&socket, "ADD", Some(("pend-x", extra.path().as_path())))?;
    ensure!(
        code != 0 && answer["code"] != 11 && answer.to_string().contains("no free"),
        "a full pool with nothing being released: code {code}, {answer}"
    );
    ensure!(
        took < Duration::from_millis(500),
        "the exhausted answer waited {took:?} with nothing to wait for"
    );
    for (id, ns) in pods.iter().skip(1) {
        cni(&socket, "DEL", id, &ns.path())?;
    }
    cni(&socket, "DEL", "pend-new", &newcomer.path())?;
    Ok(())
}

/// The releases do not come within the ADD's wait (10 s; the reaper's
/// window here is 30 s): the ADD is answered CNI code 11, try again later,
/// naming the pool, not "exhausted".
#[test]
fn an_add_whose_releases_do_not_come_in_time_is_told_to_try_again() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("pendl")?;
    let agent = AgentProc::start(&node, &config("30s"))?;
    let socket = agent.socket();
    let (pods, _) = fill(&socket, "pendl")?;
    let (gone_id, gone_ns) = &pods[0];
    cni(&socket, "DEL", gone_id, &gone_ns.path())?;
    let newcomer = Netns::new("pendlnew")?;
    let (code, answer, took) = cni_raw(
        &socket,
        "ADD",
        Some(("pendl-new", newcomer.path().as_path())),
    )?;
    eprintln!("ADD answered in {took:?}: code {code}, {answer}");
    ensure!(
        code != 0 && answer["code"] == 11 && answer.to_string().contains("being torn down"),
        "ADD while the release waits 30 s: code {code}, {answer}"
    );
    ensure!(
        took >= Duration::from_secs(9) && took < Duration::from_secs(20),
        "answered after {took:?}, not after the ADD's 10 s wait"
    );
    for (id, ns) in pods.iter().skip(1) {
        cni(&socket, "DEL", id, &ns.path())?;
    }
    Ok(())
}
