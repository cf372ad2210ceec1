//! CNI calls of one attachment racing each other through the agent API, and
//! what a DEL must clean up when no record says what an ADD made.
//!
//! The agent runs in a node namespace; the "container" is a namespace the
//! test makes. Calls go straight to the API (the plugin adds nothing to the
//! race but process start-up time, which would only narrow it).

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, ensure};
use hyper::Method;
use lockstep::client::{ClientError, call};
use lockstep_tests::{AgentProc, Netns, privileged};
use serde_json::{Value, json};

const POOL: &str = r#"
reconcile_interval = "60s"
default_pool = "race"
[[pools]]
name = "race"
ipv4 = ["10.64.0.0/24"]
"#;

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

fn add_body(id: &str, netns: &Path) -> Value {
    json!({
        "container_id": id,
        "ifname": "eth0",
        "netns": netns,
        "mode": "full",
    })
}

fn del_body(id: &str) -> Value {
    json!({"container_id": id, "ifname": "eth0"})
}

/// The interfaces in `ns` whose names start with `lxc` (host-side veths).
fn host_veths(ns: &Netns) -> anyhow::Result<BTreeSet<String>> {
    Ok(ns
        .ip(["-o", "link", "show"])?
        .lines()
        .filter_map(|l| l.split(": ").nth(1))
        .map(|n| n.split('@').next().unwrap_or(n).to_string())
        .filter(|n| n.starts_with("lxc"))
        .collect())
}

/// A DEL sent while a full ADD of the same attachment is under way must be
/// served whatever state the attachment reaches meanwhile: before the fix
/// the API decided on the worker thread, before taking the agent lock,
/// whether a call was "bounded" (no interfaces), and a DEL that found no
/// record, then the ADD's commit, then took the lock, deleted the veth on
/// the runtime's worker, where the netlink door's `block_on` panics: the
/// DEL got no answer and the veth leaked.
#[test]
fn dels_racing_full_adds_are_answered_and_leave_no_veth() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("race")?;
    let pod = Netns::new("racepod")?;
    let agent = AgentProc::start(&node, POOL)?;
    let socket = agent.socket();
    let pod_path = pod.path();
    let rounds = 120;
    let mut dels = 0usize;
    let mut busy = 0usize;
    for round in 0..rounds {
        let id = format!("race{round}");
        let done = AtomicBool::new(false);
        std::thread::scope(|s| -> anyhow::Result<()> {
            let adder = s.spawn(|| -> anyhow::Result<()> {
                let rt = runtime()?;
                let r = rt.block_on(call(
                    &socket,
                    Method::POST,
                    "/v1/cni/add",
                    Some(add_body(&id, &pod_path)),
                ));
                done.store(true, Ordering::SeqCst);
                r.with_context(|| format!("full ADD of {id}"))?;
                Ok(())
            });
            let rt = runtime()?;
            while !done.load(Ordering::SeqCst) {
                dels += 1;
                match rt.block_on(call(
                    &socket,
                    Method::POST,
                    "/v1/cni/del",
                    Some(del_body(&id)),
                )) {
                    Ok(_) => {}
                    Err(ClientError::Api { code, .. }) if code == "busy" => busy += 1,
                    Err(e) => {
                        return Err(anyhow::Error::new(e).context(format!(
                            "DEL of {id} racing its ADD got no answer (round {round}); agent log:\n{}",
                            agent.log()
                        )));
                    }
                }
            }
            adder.join().expect("adder thread")?;
            Ok(())
        })?;
        rt_del(&socket, &id)?;
    }
    eprintln!("{rounds} full ADDs, {dels} racing DELs ({busy} answered busy)");
    ensure!(
        !agent.log().contains("panicked"),
        "the agent panicked:\n{}",
        agent.log()
    );
    // The last DEL's veth goes through the reaper, then its addresses.
    let settled = lockstep_tests::wait_for(
        "the last veth reaped",
        std::time::Duration::from_secs(5),
        || {
            let held = agent.json(["allocations", "-o", "json"]).ok()?;
            (host_veths(&node).ok()?.is_empty() && held.as_array().is_some_and(Vec::is_empty))
                .then_some(())
        },
    );
    let left = host_veths(&node)?;
    ensure!(left.is_empty(), "host veths leaked: {left:?}");
    let held = agent.json(["allocations", "-o", "json"])?;
    ensure!(
        held.as_array().is_some_and(Vec::is_empty),
        "allocations left: {held}"
    );
    settled?;
    Ok(())
}

fn rt_del(socket: &Path, id: &str) -> anyhow::Result<()> {
    runtime()?
        .block_on(call(
            socket,
            Method::POST,
            "/v1/cni/del",
            Some(del_body(id)),
        ))
        .with_context(|| format!("final DEL of {id}"))?;
    Ok(())
}

/// What an ADD that died between making its interfaces and its commit
/// leaves (the veth, its peer inside the container) is removed by the DEL
/// the runtime sends, though no record names it: found by the host-side
/// name the ADD gives it. Before, a DEL without a record removed nothing.
#[test]
fn a_del_without_a_record_removes_a_half_done_adds_veth() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("orphan")?;
    let pod = Netns::new("orphanpod")?;
    let agent = AgentProc::start(&node, POOL)?;
    let id = "half-done-add";
    let host = lockstep::agent::endpoints::host_ifname(id, "eth0");
    node.ip([
        "link",
        "add",
        &host,
        "type",
        "veth",
        "peer",
        "name",
        "eth0",
        "netns",
        pod.name(),
    ])?;
    ensure!(
        host_veths(&node)?.contains(&host),
        "the leftover veth was made"
    );
    rt_del(&agent.socket(), id)?;
    let left = host_veths(&node)?;
    ensure!(left.is_empty(), "a DEL without a record left {left:?}");
    let inside = pod.ip(["-o", "link", "show"])?;
    ensure!(
        !inside.contains("eth0"),
        "the peer is left in the pod: {inside}"
    );
    // A repeated DEL is still a success.
    rt_del(&agent.socket(), id)?;
    Ok(())
}
