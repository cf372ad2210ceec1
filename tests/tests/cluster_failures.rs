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
//! #26 item 9. A node cut off from etcd only (its underlay up): well past
//!    its node key's expiry the others keep its routes and IPCACHE entries
//!    and pods still ping across; healed, nothing is worse. Blocks belong
//!    to nodes, not leases.
//! #26 item 1. A node cut off from etcd while it runs, removed, its block
//!    claimed and filled by another: healed, it fences the block in its
//!    allocator at once (nothing new from it, holders kept) and `verify`
//!    names the block and every address the other node's block covers
//!    (none of them held twice: its reservation window was reserved, #43);
//!    a fenced block nobody took, claimed back by its node, serves again.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use ipnet::IpNet;
use lockstep_tests::cluster::{ClusterNodes, address_of, cni, cni_raw, held_by};
use lockstep_tests::etcd::EtcdCluster;
use lockstep_tests::{AgentProc, Netns, privileged, wait_for};

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
    // When the stopped member led, the others elect a leader first (no
    // read or claim is served meanwhile, from the agents or the CLI).
    cluster.wait_healthy(0, Duration::from_secs(15))?;
    let before = n.blocks_of("node-0")?;
    let (got, err) = fill(&n.agents[0], "one-down-", 40)?;
    ensure!(
        got == 40,
        "with one member down node-0 stopped at {got}: {err:?}\nnode-0's log:\n{}",
        n.agents[0].log()
    );
    let grown = n.blocks_of("node-0")?;
    ensure!(
        grown.len() > before.len(),
        "no block claimed with one member down: {before:?} -> {grown:?}"
    );
    // STATUS tells what the node's last etcd request met. Stopping the
    // member that led etcd leaves the cluster without a leader for about
    // an election timeout (1 s), and a request in that window times out
    // (CI once saw node-2's lease grant do so): the next round (1 s later)
    // answers, so STATUS is 0 again within 3 s, and stays 0.
    for i in 0..3 {
        let took = lockstep_tests::until(
            Duration::from_secs(3),
            &format!("node-{i} STATUS 0 with one member down"),
            || {
                let (code, out, _) = cni_raw(&n.agents[i].socket(), "STATUS", None)?;
                Ok((code != 0).then(|| out.to_string()))
            },
        )?;
        if took > Duration::from_millis(100) {
            eprintln!("node-{i} STATUS 0 after {took:?}");
        }
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
    let held = n.blocks_of("node-0");
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
    let lost = n.blocks_of("node-2")?;
    ensure!(!lost.is_empty(), "node-2 holds no block");

    // Refused while node-2's lease lives.
    let refused = n.cli(&["node", "remove", "node-2"]);
    ensure!(refused.is_err(), "removed a live node: {refused:?}");
    let why = format!("{:#}", refused.err().context("refused")?);
    ensure!(why.contains("node-2") && why.contains("lease"), "{why}");
    ensure!(
        n.blocks_of("node-2")? == lost,
        "a refused remove changed blocks"
    );

    // The node is cut off (its agent killed, its lease still alive), the
    // operator forces the removal.
    n.agents[2].kill9();
    let out = n.cli(&["node", "remove", "node-2", "--force"])?;
    ensure!(out.contains("node-2"), "{out}");
    ensure!(
        n.blocks_of("node-2")?.is_empty(),
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
    // Claimable: node-0 fills until the pool is full. It claims node-2's
    // former block (node-1 holds the fourth) and hands out of it every
    // address node-2's reservation window leaves, none it reserves (#43).
    // How many that is depends on the window node-2 had published: a
    // first ADD that waited for its block reserves the whole block.
    let (got, err) = fill(&n.agents[0], "grow-", 64)?;
    ensure!(
        err.as_deref().is_some_and(|e| e.contains("pods")),
        "node-0 took {got} and the pool never filled: {err:?}"
    );
    let mine = n.blocks_of("node-0")?;
    for b in &lost {
        ensure!(mine.contains(b), "{b} not claimed by node-0: {mine:?}");
    }
    let reserved: BTreeSet<IpAddr> = n
        .cli(&["addresses"])?
        .lines()
        .filter(|l| l.ends_with("\tnode-2"))
        .filter_map(|l| l.split('\t').next()?.parse().ok())
        .collect();
    ensure!(!reserved.is_empty(), "node-2's window reserves nothing");
    let held = held_by(&n.agents[0])?;
    ensure!(
        held.is_disjoint(&reserved),
        "node-0 handed out reserved {:?}",
        held.intersection(&reserved).collect::<Vec<_>>()
    );
    let pool: IpNet = "10.99.0.0/26".parse()?;
    for b in &mine {
        for a in b.hosts().chain([b.network(), b.broadcast()]) {
            let edge = a == pool.network() || a == pool.broadcast();
            ensure!(
                edge || reserved.contains(&a) || held.contains(&a),
                "{a} of node-0's {b} is neither handed out nor reserved ({got} taken)"
            );
        }
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

/// The live nodes etcd lists (`cluster nodes`).
fn live_nodes(n: &ClusterNodes) -> anyhow::Result<BTreeSet<String>> {
    let v: serde_json::Value = serde_json::from_str(&n.cli(&["nodes", "-o", "json"])?)?;
    Ok(v.as_array()
        .context("nodes")?
        .iter()
        .filter_map(|x| x["node"]["name"].as_str().map(str::to_string))
        .collect())
}

#[test]
fn a_node_cut_off_from_etcd_only_keeps_its_routes_on_the_others() -> anyhow::Result<()> {
    privileged!();
    let cluster = EtcdCluster::start(3)?;
    let prefix = "/fail-cut/";
    let mut n = ClusterNodes::build_full(
        &cluster,
        prefix,
        "[[pools]]\nname = \"pods\"\nipv4 = [\"10.97.0.0/24\"]\nblock_v4 = 28\n",
        "lease_ttl = \"3s\"\n",
        "",
    )?;
    let pods: Vec<Netns> = (0..3)
        .map(|i| Netns::new(&format!("cfx{i}")))
        .collect::<anyhow::Result<_>>()?;
    let mut addrs = Vec::new();
    for (i, ns) in pods.iter().enumerate() {
        addrs.push(add(&n, i, &format!("x-{i}"), ns)?);
    }
    n.wait_remote()?;
    ping(&pods[0], addrs[2])?;
    let cut_blocks = n.blocks_of("node-2")?;
    ensure!(!cut_blocks.is_empty(), "node-2 holds no block");
    let ep0 = n.eps[0].clone();

    // A node whose routing key is gone (as one written by an agent that
    // predates them) is still routed through its live node key.
    cluster.ctl(&[&ep0], &["del", &format!("{prefix}node_addrs/node-1")])?;
    std::thread::sleep(Duration::from_secs(1));
    n.wait_remote_within(Duration::from_millis(1))
        .context("a node without a routing key lost its routes")?;

    // node-2 loses etcd; its underlay stays up.
    n.cut_from_etcd(2)?;
    let cut_at = Instant::now();
    wait_reachable(&n.agents[2], false)?;
    // Its node key expires (lease_ttl 3 s)...
    let gone_after = loop {
        if !live_nodes(&n)?.contains("node-2") {
            break cut_at.elapsed();
        }
        ensure!(
            cut_at.elapsed() < Duration::from_secs(20),
            "node-2's key outlived its lease by far: {:?}",
            live_nodes(&n)?
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    eprintln!("node-2's key expired {gone_after:?} after the cut");
    // ... and for 6 s after that, checked every 500 ms, every node still
    // routes node-2's blocks via node-2 with the remote IPCACHE entries
    // (the previous build withdrew them within a watch event).
    let expired = Instant::now();
    while expired.elapsed() < Duration::from_secs(6) {
        n.wait_remote_within(Duration::from_millis(1))
            .with_context(|| {
                format!(
                    "{:?} after node-2's key expired ({:?} after the cut)",
                    expired.elapsed(),
                    cut_at.elapsed()
                )
            })?;
        std::thread::sleep(Duration::from_millis(500));
    }
    for i in 0..2 {
        let routes = n.ns[i].exec("ip", ["-4", "route", "show", "proto", "213"])?;
        for b in &cut_blocks {
            ensure!(
                routes.contains(&format!("{b} via 10.251.0.3")),
                "node-{i} lost the route to {b}: {routes}"
            );
        }
    }
    // Pods on the others still reach the cut node's pod, and back.
    ping(&pods[0], addrs[2])?;
    ping(&pods[1], addrs[2])?;
    ping(&pods[2], addrs[0])?;
    eprintln!(
        "{:?} after the cut ({:?} past node-2's key expiry): routes, IPCACHE and pings kept",
        cut_at.elapsed(),
        expired.elapsed()
    );

    // Healed: node-2 registers again, everything converges, nothing worse.
    n.heal(2)?;
    wait_reachable(&n.agents[2], true)?;
    let started = Instant::now();
    while !live_nodes(&n)?.contains("node-2") {
        ensure!(
            started.elapsed() < Duration::from_secs(20),
            "node-2 not registered again"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    n.wait_remote()?;
    ensure!(
        n.blocks_of("node-2")? == cut_blocks,
        "node-2's blocks changed across the cut"
    );
    let later = Netns::new("cfxl")?;
    let a = add(&n, 2, "x-later", &later)?;
    ensure!(!addrs.contains(&a), "{a} handed out twice");
    n.wait_remote()?;
    ping(&pods[0], a)?;
    ping(&later, addrs[1])?;
    for (addr, owners) in n.holders()? {
        ensure!(owners.len() == 1, "{addr} held by {owners:?}");
    }
    for (i, agent) in n.agents.iter().enumerate() {
        agent
            .verify_within(Duration::from_secs(10))
            .with_context(|| format!("node-{i} verify after the heal"))?;
    }
    // The routing key is the node's until it is removed: `node remove`
    // takes it with the blocks, and the others drop the routes.
    let key = format!("{prefix}node_addrs/node-2");
    ensure!(
        !cluster
            .ctl(&[&ep0], &["get", &key, "--print-value-only"])?
            .trim()
            .is_empty(),
        "node-2 has no routing key"
    );
    n.agents[2].kill9();
    n.cli(&["node", "remove", "node-2", "--force"])?;
    ensure!(
        cluster
            .ctl(&[&ep0], &["get", &key, "--print-value-only"])?
            .trim()
            .is_empty(),
        "node remove left {key}"
    );
    n.wait_remote()?;
    Ok(())
}

/// Issue #26 item 1: a block fenced while its agent runs. node-2 is cut
/// off from etcd (a partition: its packets to the members dropped) and
/// keeps serving its block, as it must, since it cannot know; meanwhile the
/// operator force-removes it and node-0 claims the block and fills it. When
/// the partition heals, node-2 reads etcd, finds the block held by node-0
/// and fences it: from then on nothing new comes from it (the pool is full,
/// so no claim follows the read: before the fix only a claim gave the
/// allocator its pools, and node-2 went on handing out the block), its
/// holders keep their addresses, and `verify` names the block and every
/// address of node-2 that node-0's block covers. Once the pool grows,
/// node-2's new addresses come from a new block, none from the fenced one.
#[test]
fn a_block_taken_while_its_node_is_cut_off_is_fenced_in_the_allocator_once_etcd_answers()
-> anyhow::Result<()> {
    privileged!();
    fenced_once_etcd_answers("f", false)
}

/// As above, with node-2 restarted while cut off (it serves its recorded
/// block, as it must with etcd unreachable at start): the fence found once
/// etcd answers takes effect in the allocator the same way (the issue saw
/// 6 of 6 new addresses come from the fenced block in this case).
#[test]
fn a_block_taken_while_its_node_restarted_cut_off_is_fenced_once_etcd_answers() -> anyhow::Result<()>
{
    privileged!();
    fenced_once_etcd_answers("r", true)
}

/// The scenario of the two tests above (`tag` names its prefix and
/// namespaces); `restart`: node-2 is killed while cut off and started
/// again before the heal.
fn fenced_once_etcd_answers(tag: &str, restart: bool) -> anyhow::Result<()> {
    let cluster = EtcdCluster::start(3)?;
    // Four blocks of 16 in the whole pool: one per node, one spare.
    let pools = "[[pools]]\nname = \"pods\"\nipv4 = [\"10.97.0.0/26\"]\nblock_v4 = 28\n";
    let mut n = ClusterNodes::build(&cluster, &format!("/fail-{tag}/"), pools)?;
    let pods: Vec<Netns> = (0..3)
        .map(|i| Netns::new(&format!("cf{tag}{i}")))
        .collect::<anyhow::Result<_>>()?;
    let mut addrs = Vec::new();
    for (i, ns) in pods.iter().enumerate() {
        addrs.push(add(&n, i, &format!("f-{i}"), ns)?);
    }
    n.wait_remote()?;
    let lost = n.blocks_of("node-2")?;
    ensure!(lost.len() == 1, "node-2 holds {lost:?}");
    let x = *lost.iter().next().context("block")?;
    // Its pod's address published (the round after the ADD): what its
    // removal reserves.
    let started = Instant::now();
    loop {
        let v: serde_json::Value = serde_json::from_str(&n.cli(&["nodes", "-o", "json"])?)?;
        let published = v
            .as_array()
            .context("nodes")?
            .iter()
            .any(|x| x["node"]["name"] == "node-2" && x["node"]["in_use"] == 1);
        if published {
            break;
        }
        ensure!(
            started.elapsed() < Duration::from_secs(10),
            "node-2 does not publish its pod's address: {v}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // Cut off, node-2 serves its block: a pod and three more addresses.
    n.cut_from_etcd(2)?;
    wait_reachable(&n.agents[2], false)?;
    let (got, err) = fill(&n.agents[2], "cut-", 3)?;
    ensure!(got == 3, "node-2 cut off served {got}: {err:?}");
    let before = held_by(&n.agents[2])?;
    ensure!(
        before.iter().all(|a| x.contains(a)) && before.len() == 4,
        "node-2 holds {before:?}, want 4 addresses in {x}"
    );

    if restart {
        n.agents[2].kill9();
    }

    // The operator removes the unreachable node; node-0 takes its block
    // and the spare one, and fills all three it holds: the pool is full.
    let out = n.cli(&["node", "remove", "node-2", "--force"])?;
    ensure!(out.contains("node-2"), "{out}");
    let (got, _) = fill(&n.agents[0], "grow-", 60)?;
    let blocks = n.blocks()?;
    ensure!(
        blocks.get(&x).map(String::as_str) == Some("node-0") && blocks.len() == 4,
        "after node-0 took {got} addresses etcd holds {blocks:?}"
    );
    // Every address of the block but the pool CIDR's first and last, and
    // node-2's reservation window (reserved by the removal: its pods may
    // hold them, those it handed out while cut off included; #43).
    let cidr: IpNet = "10.97.0.0/26".parse()?;
    let reserved_set: BTreeSet<IpAddr> = n
        .cli(&["addresses"])?
        .lines()
        .filter_map(|l| l.split('\t').next()?.parse::<IpAddr>().ok())
        .filter(|a| x.contains(a))
        .collect();
    ensure!(
        before.is_subset(&reserved_set),
        "node-2's addresses {before:?} are not all reserved: {reserved_set:?}"
    );
    let reserved = reserved_set.len();
    let usable = 16
        - reserved
        - [cidr.network(), cidr.broadcast()]
            .iter()
            .filter(|a| x.contains(*a))
            .count();
    let in_x = held_by(&n.agents[0])?
        .iter()
        .filter(|a| x.contains(*a))
        .count();
    ensure!(in_x == usable, "node-0 holds {in_x} of {x}, not {usable}");

    if restart {
        // Still cut off: it serves its recorded block until etcd answers.
        n.agents[2].respawn()?;
        n.agents[2].wait_ready()?;
        wait_reachable(&n.agents[2], false)?;
        ensure!(held_by(&n.agents[2])? == before, "restored other addresses");
    }

    // Healed: node-2 reads etcd and fences the block.
    n.heal(2)?;
    let started = Instant::now();
    loop {
        let st = n.agents[2].status_json().context("status")?;
        if st["cluster"]["fenced"] == 1 && st["cluster"]["etcd_unreachable"].is_null() {
            break;
        }
        ensure!(
            started.elapsed() < Duration::from_secs(30),
            "node-2 has not fenced {x} 30 s after the heal: {st}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("healed: node-2 fenced {x} after {:?}", started.elapsed());

    // Nothing new from the fenced block: the pool is full, so node-2 has
    // no address to give until it grows.
    let (got, err) = fill(&n.agents[2], "after-", 3)?;
    let after = held_by(&n.agents[2])?;
    let new: Vec<&IpAddr> = after.difference(&before).collect();
    ensure!(
        new.iter().all(|a| !x.contains(*a)),
        "node-2 handed out {new:?} from its fenced block {x} ({got} allocations succeeded)"
    );
    ensure!(
        got == 0 && err.as_deref().is_some_and(|e| e.contains("pods")),
        "a full pool gave node-2 {got} addresses: {err:?}"
    );
    // The holders keep their addresses (the pod's ADD answers the same).
    ensure!(after == before, "node-2 holds {after:?}, held {before:?}");
    let again = add(&n, 2, "f-2", &pods[2])?;
    ensure!(again == addrs[2], "f-2 moved from {} to {again}", addrs[2]);
    // No address is held twice: those node-2 served while cut off were in
    // its published window (#43; before, node-0 handed out all four again).
    let doubles: Vec<IpAddr> = n
        .holders()?
        .into_iter()
        .filter(|(_, o)| o.len() > 1)
        .map(|(a, _)| a)
        .collect();
    ensure!(
        doubles.is_empty(),
        "held twice: {doubles:?}; node-2 held {before:?}"
    );

    // verify names the fenced block and every address node-0's block
    // also covers, and exits 1.
    let verify = n.agents[2].cli(["verify"])?;
    let text = String::from_utf8_lossy(&verify.stdout).into_owned();
    eprintln!("node-2 verify:\n{text}");
    ensure!(verify.status.code() == Some(1), "verify: {text}");
    ensure!(
        text.contains(&format!(
            "block {x} is fenced: etcd gives it to node node-0"
        )),
        "{text}"
    );
    for a in &before {
        ensure!(
            text.contains(&format!("address {a} ("))
                && text.contains(&format!("is inside block {x} held by node-0")),
            "verify does not name {a}: {text}"
        );
    }

    // The pool grows by two blocks (node-0, full, takes one): node-2
    // claims a new block and serves from it only.
    let grown =
        "[[pools]]\nname = \"pods\"\nipv4 = [\"10.97.0.0/26\", \"10.97.0.64/27\"]\nblock_v4 = 28\n";
    lockstep_tests::cluster::apply_pools(&n.eps, &n.prefix, grown)?;
    let (got, err) = fill(&n.agents[2], "later-", 5)?;
    ensure!(
        got == 5,
        "node-2 got {got} after the pool grew: {err:?}; etcd: {:?}",
        n.blocks()
    );
    let later = held_by(&n.agents[2])?;
    for a in later.difference(&before) {
        ensure!(
            !x.contains(a) && "10.97.0.64/27".parse::<IpNet>()?.contains(a),
            "node-2 handed out {a} after the fence"
        );
    }
    for (a, owners) in n.holders()? {
        ensure!(owners.len() == 1, "{a} held by {owners:?}");
    }
    Ok(())
}

/// A fenced block its node claims back serves again. node-2, cut off, is
/// force-removed; nobody takes its block (the others have room), so etcd
/// no longer records it and node-2, healed, fences it (absent) and, the
/// pool being otherwise full, claims that very block back: claiming is
/// the way back, and its addresses are its own again. Before, the claim
/// added a second record of the block beside the fenced one: the block
/// stayed out of the allocator while the claim loop counted it as room,
/// so node-2 answered "try again" for ever.
#[test]
fn a_fenced_block_claimed_back_by_its_node_serves_again() -> anyhow::Result<()> {
    privileged!();
    let cluster = EtcdCluster::start(3)?;
    let pools = "[[pools]]\nname = \"pods\"\nipv4 = [\"10.96.0.0/26\"]\nblock_v4 = 28\n";
    let n = ClusterNodes::build(&cluster, "/fail-g/", pools)?;
    let pods: Vec<Netns> = (0..3)
        .map(|i| Netns::new(&format!("cfg{i}")))
        .collect::<anyhow::Result<_>>()?;
    let mut addrs = Vec::new();
    for (i, ns) in pods.iter().enumerate() {
        addrs.push(add(&n, i, &format!("g-{i}"), ns)?);
    }
    // node-0 takes the spare block: the pool is full.
    let (got, err) = fill(&n.agents[0], "grow-", 20)?;
    ensure!(got == 20, "node-0 stopped at {got}: {err:?}");
    ensure!(n.blocks()?.len() == 4, "{:?}", n.blocks()?);
    let lost = n.blocks_of("node-2")?;
    ensure!(lost.len() == 1, "node-2 holds {lost:?}");
    let x = *lost.iter().next().context("block")?;

    n.cut_from_etcd(2)?;
    wait_reachable(&n.agents[2], false)?;
    let (got, err) = fill(&n.agents[2], "cut-", 2)?;
    ensure!(got == 2, "node-2 cut off served {got}: {err:?}");
    let before = held_by(&n.agents[2])?;
    n.cli(&["node", "remove", "node-2", "--force"])?;
    ensure!(!n.blocks()?.contains_key(&x), "{x} still in etcd");

    // Healed: fenced (absent), then claimed back, the only free block.
    n.heal(2)?;
    let started = Instant::now();
    while n.blocks()?.get(&x).map(String::as_str) != Some("node-2") {
        ensure!(
            started.elapsed() < Duration::from_secs(30),
            "node-2 did not claim {x} back: {:?}",
            n.blocks()?
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!(
        "healed: node-2 claimed {x} back after {:?}",
        started.elapsed()
    );
    // The claim is in etcd; the allocator stops draining the block when
    // the claim loop next serves its blocks, sometimes a round later (an
    // ADD in between waits 1.8 s for room and is told to try again: seen
    // in CI). What is under test is that the block serves again: wait
    // for the allocator to hold it, not draining.
    let block = x.to_string();
    wait_for(
        "node-2's allocator to serve its block claimed back",
        Duration::from_secs(30),
        || {
            let pools = n.agents[2].json(["pools", "-o", "json"]).ok()?;
            pools
                .as_array()?
                .iter()
                .any(|p| {
                    let has = |k: &str| {
                        p[k].as_array()
                            .is_some_and(|c| c.iter().any(|c| c.as_str() == Some(block.as_str())))
                    };
                    has("cidrs") && !has("draining")
                })
                .then_some(())
        },
    )?;
    eprintln!(
        "node-2's allocator served {x} after {:?}",
        started.elapsed()
    );
    let (got, err) = fill(&n.agents[2], "back-", 3)?;
    ensure!(
        got == 3,
        "node-2 got {got} from its block claimed back: {err:?}"
    );
    let after = held_by(&n.agents[2])?;
    ensure!(
        after.is_superset(&before) && after.iter().all(|a| x.contains(a)),
        "node-2 holds {after:?}, held {before:?}"
    );
    let again = add(&n, 2, "g-2", &pods[2])?;
    ensure!(again == addrs[2], "g-2 moved from {} to {again}", addrs[2]);
    let st = n.agents[2].status_json().context("status")?;
    ensure!(st["cluster"]["fenced"] == 0, "{st}");
    for (a, owners) in n.holders()? {
        ensure!(owners.len() == 1, "{a} held by {owners:?}");
    }
    n.agents[2].verify_within(Duration::from_secs(10))?;
    Ok(())
}
