//! An ADD that finds its pool full only of addresses being released
//! (#27 item 8): a full DEL's map entries go at once, its pod's veth is
//! deleted by the reaper's next batch (`docs/teardown.md`), and its
//! addresses stay held until then. An ADD arriving while such a DEL is in
//! flight used to be answered "pool exhausted" (a permanent error to the
//! runtime) though a retry a moment later succeeded. Now it waits for the
//! releases (bounded) and is served, or is answered CNI code 11 (try again
//! later) if they do not come in time.
//!
//! The agent runs in a node namespace with a 4-address pool and a
//! `teardown_batch_window`, so the reaper holds a DEL'd pod's addresses for
//! that long: the window is there on purpose, not by chance.

use std::net::IpAddr;
use std::time::Duration;

use anyhow::ensure;
use lockstep_tests::cluster::{address_of, cni, cni_raw};
use lockstep_tests::{AgentProc, Netns, privileged, wait_for};

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

/// Starts the DEL of `pod` on its own thread (it is answered once its veth
/// is gone, after the window) and returns once its address has left the
/// maps, that is, once its release is pending.
fn del_in_flight<'s>(
    scope: &'s std::thread::Scope<'s, '_>,
    agent: &'s AgentProc,
    pod: &'s (String, Netns),
    address: IpAddr,
) -> anyhow::Result<std::thread::ScopedJoinHandle<'s, anyhow::Result<Duration>>> {
    let socket = agent.socket();
    let del = scope.spawn(move || Ok(cni(&socket, "DEL", &pod.0, &pod.1.path())?.0));
    wait_for("the DEL's map entries gone", Duration::from_secs(3), || {
        let dump = agent.maps_dump().ok()?.to_string();
        let held =
            dump.contains(&format!("\"{address}/32\"")) || dump.contains(&format!("\"{address}\""));
        (!held).then_some(())
    })?;
    Ok(del)
}

#[test]
fn an_add_that_finds_only_releasing_addresses_waits_for_them() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("pend")?;
    let agent = AgentProc::start(&node, &config("1s"))?;
    let socket = agent.socket();
    let (pods, addrs) = fill(&socket, "pend")?;

    // The first pod goes: its DEL's map entries go at once, its address is
    // held until the reaper deleted its veth (a second from now).
    let newcomer = Netns::new("pendnew")?;
    let (code, answer, took) = std::thread::scope(|scope| {
        let del = del_in_flight(scope, &agent, &pods[0], addrs[0])?;
        let added = cni_raw(
            &socket,
            "ADD",
            Some(("pend-new", newcomer.path().as_path())),
        )?;
        let del_took = del.join().expect("DEL thread")?;
        eprintln!("the DEL was answered after {del_took:?}");
        anyhow::Ok(added)
    })?;
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
/// window here is 15 s): the ADD is answered CNI code 11, try again later,
/// naming the pool, not "exhausted"; the DEL is answered once the window
/// has passed and the veth is gone.
#[test]
fn an_add_whose_releases_do_not_come_in_time_is_told_to_try_again() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("pendl")?;
    let agent = AgentProc::start(&node, &config("15s"))?;
    let socket = agent.socket();
    let (pods, addrs) = fill(&socket, "pendl")?;
    let newcomer = Netns::new("pendlnew")?;
    let (code, answer, took) = std::thread::scope(|scope| {
        let del = del_in_flight(scope, &agent, &pods[0], addrs[0])?;
        let added = cni_raw(
            &socket,
            "ADD",
            Some(("pendl-new", newcomer.path().as_path())),
        )?;
        let del_took = del.join().expect("DEL thread")?;
        eprintln!("the DEL was answered after {del_took:?}");
        ensure!(
            del_took >= Duration::from_secs(14),
            "the DEL was answered after {del_took:?}, before its veth's 15 s window"
        );
        anyhow::Ok(added)
    })?;
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
