//! Cluster mode under failure, end to end (#12 tests c and d): three node
//! namespaces on a bridge underlay, a real 3-member etcd, one agent per node.
//!
//! c. One etcd member stopped: nothing changes for users (ADDs, claims,
//!    pings). Two stopped (no quorum): ADDs from held blocks succeed, an ADD
//!    that needs a block answers CNI code 11 within 2 s, STATUS answers 51;
//!    quorum back: the claim goes through and every node's remote state
//!    converges on the new block.
//! d. `cluster node remove`: refused while the node's lease lives, then
//!    (forced) the node's blocks become claimable and another node claims
//!    one; the others drop its routes and IPCACHE entries; the node, back,
//!    fences the block it lost.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use ipnet::IpNet;
use lockstep_tests::cluster::{ClusterNodes, address_of, cni, cni_raw};
use lockstep_tests::etcd::EtcdCluster;
use lockstep_tests::{AgentProc, Netns, privileged};

/// Allocates IPAM-only endpoint addresses on `agent` (the CLI's allocate,
/// which in cluster mode waits for a claimed block as a CNI ADD does)
/// until `count` are held or one fails; gives how many were allocated and
/// the error that stopped it.
fn fill(agent: &AgentProc, tag: &str, count: usize) -> anyhow::Result<(usize, Option<String>)> {
    for n in 0..count {
        let out = agent.cli([
            "allocate",
            "--kind",
            "endpoint",
            "--name",
            &format!("{tag}{n}"),
            "--family",
            "ipv4",
        ])?;
        if !out.status.success() {
            return Ok((n, Some(String::from_utf8_lossy(&out.stderr).into_owned())));
        }
    }
    Ok((count, None))
}

/// The blocks etcd gives `node`.
fn blocks_of(n: &ClusterNodes, node: &str) -> anyhow::Result<BTreeSet<IpNet>> {
    Ok(n.blocks()?
        .into_iter()
        .filter(|(_, o)| o == node)
        .map(|(b, _)| b)
        .collect())
}

/// Waits until `agent`'s status says whether etcd is reachable (`want`).
fn wait_reachable(agent: &AgentProc, want: bool) -> anyhow::Result<()> {
    let started = Instant::now();
    loop {
        if let Some(st) = agent.status_json()
            && st["cluster"]["etcd_unreachable"].is_string() != want
        {
            return Ok(());
        }
        ensure!(
            started.elapsed() < Duration::from_secs(30),
            "etcd reachable is not {want} after 30 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// One endpoint through the CNI plugin: its address.
fn add(n: &ClusterNodes, i: usize, id: &str, ns: &Netns) -> anyhow::Result<IpAddr> {
    let (_, answer) = cni(&n.agents[i].socket(), "ADD", id, &ns.path())?;
    address_of(&answer)
}

fn ping(from: &Netns, to: IpAddr) -> anyhow::Result<()> {
    from.exec("ping", ["-c", "1", "-W", "2", &to.to_string()])
        .map(|_| ())
        .with_context(|| format!("ping {to}"))
}

#[test]
fn etcd_losing_a_member_changes_nothing_and_losing_quorum_only_stops_new_blocks()
-> anyhow::Result<()> {
    privileged!();
    let mut cluster = EtcdCluster::start(3)?;
    let n = ClusterNodes::build(
        &cluster,
        "/fail-c/",
        "[[pools]]\nname = \"pods\"\nipv4 = [\"10.98.0.0/20\"]\nblock_v4 = 28\n",
    )?;
    let pods: Vec<Netns> = (0..3)
        .map(|i| Netns::new(&format!("cfc{i}")))
        .collect::<anyhow::Result<_>>()?;
    let mut addrs = Vec::new();
    for (i, ns) in pods.iter().enumerate() {
        addrs.push(add(&n, i, &format!("c-{i}"), ns)?);
    }
    n.wait_remote()?;

    // One member stopped: ADDs, new blocks and pings go on as before.
    cluster.stop_member(2);
    let later: Vec<Netns> = (0..3)
        .map(|i| Netns::new(&format!("cfd{i}")))
        .collect::<anyhow::Result<_>>()?;
    for (i, ns) in later.iter().enumerate() {
        let a = add(&n, i, &format!("d-{i}"), ns)?;
        ensure!(!addrs.contains(&a), "{a} handed out twice");
        addrs.push(a);
    }
    let before = blocks_of(&n, "node-0")?;
    let (got, err) = fill(&n.agents[0], "one-down-", 40)?;
    ensure!(
        got == 40,
        "with one member down node-0 stopped at {got}: {err:?}"
    );
    let grown = blocks_of(&n, "node-0")?;
    ensure!(
        grown.len() > before.len(),
        "no block claimed with one member down: {before:?} -> {grown:?}"
    );
    for i in 0..3 {
        let (code, out, _) = cni_raw(&n.agents[i].socket(), "STATUS", None)?;
        ensure!(code == 0, "node-{i} STATUS with one member down: {out}");
    }
    n.wait_remote()?;
    ping(&pods[0], addrs[1])?;
    ping(&later[2], addrs[0])?;

    // No quorum: held blocks serve; a new block is "try again later".
    cluster.stop_member(1);
    for a in &n.agents {
        wait_reachable(a, false)?;
    }
    let quiet: Vec<Netns> = (0..3)
        .map(|i| Netns::new(&format!("cfq{i}")))
        .collect::<anyhow::Result<_>>()?;
    for (i, ns) in quiet.iter().enumerate() {
        if i == 0 {
            continue;
        }
        let a = add(&n, i, &format!("q-{i}"), ns)?;
        ensure!(!addrs.contains(&a), "{a} handed out twice");
        addrs.push(a);
    }
    for i in 0..3 {
        let (code, out, _) = cni_raw(&n.agents[i].socket(), "STATUS", None)?;
        ensure!(
            code == 1 && out["code"] == 51,
            "node-{i} STATUS without quorum: {out}"
        );
    }
    // Node 0 uses up what it holds; its next ADD needs a block.
    let (_, err) = fill(&n.agents[0], "no-quorum-", 200)?;
    let err = err.context("node-0 never ran out of held addresses")?;
    ensure!(
        err.contains("etcd_unavailable") && err.contains("pods"),
        "{err}"
    );
    let held = blocks_of(&n, "node-0");
    ensure!(held.is_err(), "etcd answered without quorum: {held:?}");
    let (code, out, took) = cni_raw(
        &n.agents[0].socket(),
        "ADD",
        Some(("q-0", &quiet[0].path())),
    )?;
    ensure!(code == 1 && out["code"] == 11, "ADD needing a block: {out}");
    ensure!(
        out["msg"].as_str().unwrap_or_default().contains("etcd"),
        "{out}"
    );
    ensure!(took < Duration::from_secs(2), "answered after {took:?}");
    eprintln!("no quorum: an ADD needing a block answered 11 after {took:?}");
    // Endpoints added before keep working across nodes.
    ping(&pods[1], addrs[2])?;

    // Quorum back: the same ADD claims a block, every node learns of it.
    cluster.start_member(1)?;
    cluster.wait_healthy(1, Duration::from_secs(30))?;
    let started = Instant::now();
    let a = loop {
        let (code, out, _) = cni_raw(
            &n.agents[0].socket(),
            "ADD",
            Some(("q-0", &quiet[0].path())),
        )?;
        if code == 0 {
            break address_of(&out)?;
        }
        ensure!(
            started.elapsed() < Duration::from_secs(20),
            "no ADD 20 s after quorum came back: {out}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    ensure!(!addrs.contains(&a), "{a} handed out twice");
    let owner = n
        .blocks()?
        .into_iter()
        .find(|(b, _)| b.contains(&a))
        .map(|(_, o)| o);
    ensure!(
        owner.as_deref() == Some("node-0"),
        "{a} lies in {owner:?}'s block"
    );
    n.wait_remote()?;
    eprintln!(
        "quorum back: ADD after {:?}, remote state converged after {:?}",
        started.elapsed(),
        started.elapsed()
    );
    for (addr, owners) in n.holders()? {
        ensure!(owners.len() == 1, "{addr} held by {owners:?}");
    }
    ping(&later[1], a)?;
    for (i, agent) in n.agents.iter().enumerate() {
        let v = agent.cli(["verify"])?;
        ensure!(
            v.status.success(),
            "node-{i} verify: {}",
            String::from_utf8_lossy(&v.stdout)
        );
    }
    Ok(())
}

#[test]
fn a_removed_nodes_blocks_are_claimed_by_another_and_it_fences_them_when_back() -> anyhow::Result<()>
{
    privileged!();
    let cluster = EtcdCluster::start(3)?;
    // Four blocks of 16 in the whole pool.
    let mut n = ClusterNodes::build(
        &cluster,
        "/fail-d/",
        "[[pools]]\nname = \"pods\"\nipv4 = [\"10.99.0.0/26\"]\nblock_v4 = 28\n",
    )?;
    let pods: Vec<Netns> = (0..3)
        .map(|i| Netns::new(&format!("cfr{i}")))
        .collect::<anyhow::Result<_>>()?;
    let mut addrs = Vec::new();
    for (i, ns) in pods.iter().enumerate() {
        addrs.push(add(&n, i, &format!("r-{i}"), ns)?);
    }
    n.wait_remote()?;
    let lost = blocks_of(&n, "node-2")?;
    ensure!(!lost.is_empty(), "node-2 holds no block");

    // Refused while node-2's lease lives.
    let refused = n.cli(&["node", "remove", "node-2"]);
    ensure!(refused.is_err(), "removed a live node: {refused:?}");
    let why = format!("{:#}", refused.err().context("refused")?);
    ensure!(why.contains("node-2") && why.contains("lease"), "{why}");
    ensure!(
        blocks_of(&n, "node-2")? == lost,
        "a refused remove changed blocks"
    );

    // The node is cut off (its agent killed, its lease still alive), the
    // operator forces the removal.
    n.agents[2].kill9();
    let out = n.cli(&["node", "remove", "node-2", "--force"])?;
    ensure!(out.contains("node-2"), "{out}");
    ensure!(
        blocks_of(&n, "node-2")?.is_empty(),
        "node-2 still holds blocks"
    );
    // The others drop its routes and IPCACHE entries (wait_remote checks no
    // route is left that etcd does not list).
    n.wait_remote()?;
    for i in 0..2 {
        let routes = n.ns[i].exec("ip", ["-4", "route", "show", "proto", "213"])?;
        let dump = n.agents[i].maps_dump()?.to_string();
        for b in &lost {
            ensure!(
                !routes.contains(&b.to_string()),
                "node-{i} routes {b}: {routes}"
            );
            ensure!(
                !dump.contains(&format!("\"prefix\":\"{b}\"")),
                "node-{i} IPCACHE keeps {b}"
            );
        }
    }
    // Claimable: node-0 grows to three blocks' worth, which only node-2's
    // former blocks can give (node-1 holds the fourth).
    let (got, err) = fill(&n.agents[0], "grow-", 40)?;
    ensure!(got == 40, "node-0 stopped at {got}: {err:?}");
    let mine = blocks_of(&n, "node-0")?;
    for b in &lost {
        ensure!(mine.contains(b), "{b} not claimed by node-0: {mine:?}");
    }

    // node-2 comes back: the block it lost is fenced before anything is
    // served from it; its endpoint keeps its address; verify names it.
    n.agents[2].respawn()?;
    n.agents[2].wait_ready()?;
    let verify = n.agents[2].cli(["verify"])?;
    let text = String::from_utf8_lossy(&verify.stdout).into_owned();
    ensure!(verify.status.code() == Some(1), "verify: {text}");
    for b in &lost {
        ensure!(
            text.contains(&b.to_string()) && text.contains("node-0"),
            "{text}"
        );
    }
    let st = n.agents[2].status_json().context("status")?;
    ensure!(st["cluster"]["fenced"] == lost.len(), "{st}");
    let again = add(&n, 2, "r-2", &pods[2])?;
    ensure!(again == addrs[2], "r-2 moved from {} to {again}", addrs[2]);
    Ok(())
}
