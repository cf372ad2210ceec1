//! Pod teardown through the reaper (`agent::reaper`): a full DEL removes
//! its map entries, hands its host veth to the reaper, which deletes the
//! veths of every DEL in flight as one batch, and is answered once the
//! kernel confirms its veth gone (the container no longer sees its
//! interface, #27 item 8); the addresses stay held until then, across a
//! SIGKILL too. `cni.teardown_batch_window` holds the veths for a while so
//! the window in which they still exist is long and certain.

use std::collections::BTreeSet;
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use lockstep_tests::{AgentProc, Netns, lockstep_bin, privileged, unique, wait_for};
use serde_json::{Value, json};

/// A pool of six usable addresses (a /29), filled by the test.
fn config(window: &str) -> String {
    format!(
        r#"
reconcile_interval = "200ms"
default_pool = "small"
[[pools]]
name = "small"
ipv4 = ["10.64.0.0/29"]
[cni]
teardown_batch_window = "{window}"
"#
    )
}

/// One plugin call as a runtime makes it; returns exit code and output.
fn plugin(agent: &AgentProc, command: &str, id: &str, ns: &Netns) -> anyhow::Result<(i32, Value)> {
    let conf = json!({"cniVersion": "1.0.0", "name": "teardown", "type": "lockstep",
                      "agentSocket": agent.socket()});
    let mut child = Command::new(lockstep_bin())
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", id)
        .env("CNI_NETNS", ns.path())
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", "/opt/cni/bin")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting the plugin")?;
    child
        .stdin
        .take()
        .context("stdin")?
        .write_all(conf.to_string().as_bytes())?;
    let out = child.wait_with_output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let v = if text.trim().is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text).with_context(|| format!("not JSON: {text}"))?
    };
    Ok((out.status.code().unwrap_or(-1), v))
}

/// A successful ADD: its address and host interface name.
fn added(v: &Value) -> anyhow::Result<(String, String)> {
    let address = v["ips"][0]["address"]
        .as_str()
        .and_then(|a| a.split('/').next())
        .context("address")?
        .to_string();
    let host = v["interfaces"][0]["name"]
        .as_str()
        .context("host interface")?
        .to_string();
    Ok((address, host))
}

fn links(ns: &Netns) -> anyhow::Result<BTreeSet<String>> {
    let v: Value = serde_json::from_str(&ns.ip(["-j", "link", "show"])?)?;
    Ok(v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|l| l["ifname"].as_str().map(str::to_string))
        .collect())
}

fn held(agent: &AgentProc) -> anyhow::Result<BTreeSet<String>> {
    Ok(agent
        .json(["allocations", "-o", "json"])?
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|a| a["address"].as_str().map(str::to_string))
        .collect())
}

/// Whether IPCACHE (through `maps dump`) has a host entry for `address`.
fn in_ipcache(agent: &AgentProc, address: &str) -> anyhow::Result<bool> {
    let dump = agent.maps_dump()?.to_string();
    Ok(dump.contains(&format!("\"{address}/32\"")) || dump.contains(&format!("\"{address}\"")))
}

fn verify(agent: &AgentProc) -> anyhow::Result<()> {
    let out = agent.cli(["verify"])?;
    ensure!(
        out.status.success(),
        "verify: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// Fills the pool: ADDs until the agent answers "exhausted"; returns
/// (namespace, id, address, host veth) of each.
fn fill(agent: &AgentProc, tag: &str) -> anyhow::Result<Vec<(Netns, String, String, String)>> {
    let mut made = Vec::new();
    for i in 0..16 {
        let ns = Netns::new(&format!("td{tag}{i}"))?;
        let id = unique(&format!("td-{tag}-{i}"));
        let (code, v) = plugin(agent, "ADD", &id, &ns)?;
        if code != 0 {
            ensure!(
                v["msg"].as_str().unwrap_or_default().contains("exhaust")
                    || v["details"]
                        .as_str()
                        .unwrap_or_default()
                        .contains("exhaust"),
                "ADD {i} failed for another reason than exhaustion: {v}"
            );
            break;
        }
        let (address, host) = added(&v)?;
        made.push((ns, id, address, host));
    }
    ensure!(made.len() >= 2, "the pool held {} endpoints", made.len());
    Ok(made)
}

/// Whether the pod namespace still shows the container's interface.
fn sees_eth0(ns: &Netns) -> anyhow::Result<bool> {
    Ok(links(ns)?.contains("eth0"))
}

/// #27 item 8: a runtime that lists the pod's interfaces right after DEL
/// must not find `eth0`. Before, DEL was answered as soon as the map
/// entries were gone and the reaper deleted the veth afterwards: with the
/// 300 ms window here every pod still showed `eth0` after its DEL.
#[test]
fn del_answers_once_the_container_no_longer_sees_its_interface() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("tdgone")?;
    let agent = AgentProc::start(&node, &config("300ms"))?;
    let made = fill(&agent, "g")?;
    let (one_by_one, together) = made.split_at(made.len() / 2);
    let mut took = Vec::new();
    for (ns, id, address, host) in one_by_one {
        let started = Instant::now();
        let (code, v) = plugin(&agent, "DEL", id, ns)?;
        took.push(started.elapsed());
        ensure!(code == 0, "DEL {id}: {v}");
        ensure!(!sees_eth0(ns)?, "{id}: eth0 still in the pod after DEL");
        ensure!(
            !links(&node)?.contains(host),
            "{id}: host veth {host} still on the node after DEL"
        );
        ensure!(
            !in_ipcache(&agent, address)?,
            "{address}: IPCACHE entry outlived the DEL"
        );
    }
    eprintln!("DELs one by one (300 ms window) answered after {took:?}");
    // DELs in flight together share the batch: all answered about one
    // window after the first, not one window each.
    let started = Instant::now();
    let answers: Vec<anyhow::Result<(i32, Value, Duration)>> = std::thread::scope(|s| {
        let handles: Vec<_> = together
            .iter()
            .map(|(ns, id, _, _)| {
                let agent = &agent;
                s.spawn(move || {
                    let (code, v) = plugin(agent, "DEL", id, ns)?;
                    Ok((code, v, started.elapsed()))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("DEL thread"))
            .collect()
    });
    let mut last = Duration::ZERO;
    for ((ns, id, _, _), a) in together.iter().zip(answers) {
        let (code, v, at) = a?;
        ensure!(code == 0, "DEL {id}: {v}");
        ensure!(!sees_eth0(ns)?, "{id}: eth0 still in the pod after DEL");
        last = last.max(at);
    }
    eprintln!("{} DELs at once answered within {last:?}", together.len());
    ensure!(
        last < Duration::from_millis(300) * u32::try_from(together.len())?,
        "{} DELs at once took {last:?}: they did not share a batch",
        together.len()
    );
    wait_for("everything released", Duration::from_secs(10), || {
        held(&agent).ok()?.is_empty().then_some(())
    })?;
    verify(&agent)?;
    Ok(())
}

#[test]
fn dels_in_flight_share_a_batch_and_no_address_returns_while_its_veth_exists() -> anyhow::Result<()>
{
    privileged!();
    let node = Netns::new("tdnode")?;
    let agent = AgentProc::start(&node, &config("5s"))?;
    let made = fill(&agent, "a")?;
    let old: BTreeSet<String> = made.iter().map(|m| m.2.clone()).collect();
    let veths: BTreeSet<String> = made.iter().map(|m| m.3.clone()).collect();

    // Pods for the ADD storm below.
    let storm: Vec<Netns> = (1..made.len())
        .map(|i| Netns::new(&format!("tds{i}")))
        .collect::<anyhow::Result<_>>()?;
    let ids: Vec<String> = (0..storm.len())
        .map(|i| unique(&format!("td-storm-{i}")))
        .collect();
    // DEL every endpoint at once, as a runtime tearing a node down does:
    // their map entries go at once, their veths wait for the 5 s window.
    let del_started = Instant::now();
    std::thread::scope(|scope| -> anyhow::Result<()> {
        let dels: Vec<_> = made
            .iter()
            .map(|(ns, id, _, _)| {
                let agent = &agent;
                scope.spawn(move || plugin(agent, "DEL", id, ns))
            })
            .collect();
        for (_, _, address, _) in &made {
            wait_for("the DEL's map entries gone", Duration::from_secs(3), || {
                (!in_ipcache(&agent, address).ok()?).then_some(())
            })?;
        }
        // The veths still exist (the window), so the addresses are still
        // held, and verify knows them as pending releases, not drift.
        let now = links(&node)?;
        ensure!(
            veths.is_subset(&now),
            "the veths wait for the batch window: {veths:?} vs {now:?}"
        );
        ensure!(
            old.is_subset(&held(&agent)?),
            "addresses held while their veths exist"
        );
        verify(&agent)?;
        storm_while_releasing(&agent, &node, &made, &old, &storm, &ids)?;
        for ((ns, id, _, _), d) in made.iter().zip(dels) {
            let (code, v) = d.join().expect("DEL thread")?;
            ensure!(code == 0, "DEL {id}: {v}");
            ensure!(!sees_eth0(ns)?, "{id}: eth0 still in the pod after DEL");
        }
        Ok(())
    })?;
    let took = del_started.elapsed();
    eprintln!(
        "{} DELs in flight together answered after {took:?}",
        made.len()
    );
    ensure!(
        took >= Duration::from_secs(4) && took < Duration::from_secs(12),
        "the DELs were answered after {took:?}, not after their shared 5 s batch"
    );
    // The same attachment ADDed again after its DEL gets a veth of the old
    // one's name (the old one is gone).
    let (ns0, id0, _, host0) = &made[0];
    let (code, v) = plugin(&agent, "ADD", id0, ns0)?;
    ensure!(code == 0, "re-ADD of {id0} after DEL: {v}");
    ensure!(added(&v)?.1 == *host0, "same host name: {v}");
    let now = links(&node)?;
    ensure!(
        veths
            .iter()
            .filter(|v| *v != host0)
            .all(|v| !now.contains(v)),
        "old veths left after the batch: {now:?}"
    );
    verify(&agent)?;
    for (ns, id) in storm.iter().zip(&ids).chain(std::iter::once((ns0, id0))) {
        let (code, v) = plugin(&agent, "DEL", id, ns)?;
        ensure!(code == 0, "DEL {id}: {v}");
    }
    wait_for("everything released", Duration::from_secs(10), || {
        held(&agent).ok()?.is_empty().then_some(())
    })?;
    Ok(())
}

#[test]
fn sigkill_with_releases_pending_finishes_them_at_restart() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("tdknode")?;
    let mut agent = AgentProc::start(&node, &config("15s"))?;
    let made = fill(&agent, "k")?;
    let veths: BTreeSet<String> = made.iter().map(|m| m.3.clone()).collect();
    // Every DEL in flight (their veths wait for the 15 s window) when the
    // agent is killed: none is answered, as a runtime would see it.
    std::thread::scope(|scope| -> anyhow::Result<()> {
        let dels: Vec<_> = made
            .iter()
            .map(|(ns, id, _, _)| {
                let agent = &agent;
                scope.spawn(move || plugin(agent, "DEL", id, ns))
            })
            .collect();
        for (_, _, address, _) in &made {
            wait_for("the DEL's map entries gone", Duration::from_secs(3), || {
                (!in_ipcache(&agent, address).ok()?).then_some(())
            })?;
        }
        // The release mark is committed right after the map entries go.
        std::thread::sleep(Duration::from_millis(300));
        ensure!(veths.is_subset(&links(&node)?), "veths pending deletion");
        ensure!(held(&agent)?.len() == made.len(), "addresses still held");
        let pid = agent.pid().context("the agent runs")?;
        // SAFETY: plain kill(2) of the agent this test started (the DEL
        // threads borrow it, so `kill9` below only reaps it).
        unsafe { libc::kill(i32::try_from(pid)?, libc::SIGKILL) };
        for ((_, id, _, _), d) in made.iter().zip(dels) {
            let (code, v) = d.join().expect("DEL thread")?;
            ensure!(
                code != 0,
                "DEL {id} answered though its agent was killed: {v}"
            );
        }
        Ok(())
    })?;
    agent.kill9();
    ensure!(
        veths.is_subset(&links(&node)?),
        "the veths outlive the killed agent"
    );
    agent.restart()?;
    // The restart finished every release before it was ready.
    let now = links(&node)?;
    ensure!(
        veths.is_disjoint(&now),
        "veths deleted at start: {veths:?} vs {now:?}"
    );
    ensure!(held(&agent)?.is_empty(), "addresses released at start");
    let eps = agent.json(["allocations", "-o", "json"])?;
    ensure!(eps == json!([]), "no allocation left: {eps}");
    verify(&agent)?;
    // The runtime retries the DELs it saw fail: each is answered, nothing
    // left in the pods.
    for (ns, id, _, _) in &made {
        let (code, v) = plugin(&agent, "DEL", id, ns)?;
        ensure!(code == 0, "retried DEL {id}: {v}");
        ensure!(!sees_eth0(ns)?, "{id}: eth0 still in the pod");
    }
    // No leak: the pool serves as many endpoints as before.
    let again = fill(&agent, "k2")?;
    ensure!(again.len() == made.len(), "pool size after restart");
    // Their DELs at once: one batch after the window.
    std::thread::scope(|scope| -> anyhow::Result<()> {
        let dels: Vec<_> = again
            .iter()
            .map(|(ns, id, _, _)| {
                let agent = &agent;
                scope.spawn(move || plugin(agent, "DEL", id, ns))
            })
            .collect();
        for ((_, id, _, _), d) in again.iter().zip(dels) {
            let (code, v) = d.join().expect("DEL thread")?;
            ensure!(code == 0, "DEL {id}: {v}");
        }
        Ok(())
    })?;
    Ok(())
}

/// An ADD storm while the DEL'd pods' veths exist (one fewer than the
/// addresses, so the first attachment's own re-ADD afterwards finds one):
/// none is handed an address an existing veth's peer holds. Each finds the
/// pool full only of addresses being released, so it waits for the
/// reaper's batch and is served after it (#27 item 8; before, each was
/// refused as exhausted, code 100, though a retry a moment later
/// succeeded).
fn storm_while_releasing(
    agent: &AgentProc,
    node: &Netns,
    made: &[(Netns, String, String, String)],
    old: &BTreeSet<String>,
    storm: &[Netns],
    ids: &[String],
) -> anyhow::Result<()> {
    let sent = Instant::now();
    // Per ADD: its exit code, answer, the node's links right after, and
    // when it was answered.
    type Answered = (i32, Value, BTreeSet<String>, Duration);
    let results: Vec<anyhow::Result<Answered>> = std::thread::scope(|s| {
        let handles: Vec<_> = storm
            .iter()
            .zip(ids)
            .map(|(ns, id)| {
                s.spawn(move || {
                    let (code, v) = plugin(agent, "ADD", id, ns)?;
                    // The node's interfaces right after the answer.
                    Ok((code, v, links(node)?, sent.elapsed()))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("storm thread"))
            .collect()
    });
    let mut slowest = Duration::ZERO;
    for r in results {
        let (code, v, after, took) = r?;
        ensure!(
            code == 0,
            "a storm ADD was not served after the release: {v}"
        );
        slowest = slowest.max(took);
        let (address, _) = added(&v)?;
        ensure!(old.contains(&address), "{address} is not from the pool");
        // Handed out again: only once the veth that held it is gone.
        let holder = &made.iter().find(|m| m.2 == address).expect("old").3;
        ensure!(
            !after.contains(holder),
            "{address} handed out while {holder} still exists"
        );
    }
    eprintln!(
        "{} storm ADDs served after the batch, the last {slowest:?} after they were sent",
        storm.len()
    );
    Ok(())
}
