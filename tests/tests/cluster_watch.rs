//! #27 item 6: in steady state the agents follow etcd through one watch
//! each, read nothing periodically, and keep their node lease alive
//! instead of granting a new one. Three agents in node namespaces, a real
//! 3-member etcd; requests counted by etcd's own metrics.

use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use lockstep::cluster::{Door, DoorOptions};
use lockstep_tests::cluster::ClusterNodes;
use lockstep_tests::etcd::EtcdCluster;
use lockstep_tests::privileged;

fn pools() -> String {
    "[[pools]]\nname = \"pods\"\nipv4 = [\"10.87.0.0/24\"]\nblock_v4 = 28\n".to_string()
}

fn rt() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

/// Reads (Range), writes (Txn, Put) and every other unary call etcd
/// answered, summed over the members.
fn calls(cluster: &EtcdCluster) -> anyhow::Result<(f64, f64)> {
    Ok((
        cluster.counter("grpc_server_handled_total{", &["grpc_method=\"Range\""])?,
        cluster.counter("grpc_server_handled_total{", &["grpc_type=\"unary\""])?,
    ))
}

/// Node `name`'s lease and the blocks its node key lists, as etcd has
/// them.
fn node_key(n: &ClusterNodes, name: &str) -> anyhow::Result<(i64, usize)> {
    rt()?.block_on(async {
        let mut o = DoorOptions::new(n.eps.clone());
        o.prefix = n.prefix.clone();
        let mut d = Door::connect(o).await?;
        let nodes = d.nodes().await?;
        let node = nodes
            .iter()
            .find(|x| x.record.name == name)
            .with_context(|| format!("no node key of {name}"))?;
        anyhow::Ok((node.lease, node.record.blocks.len()))
    })
}

/// Idle agents ask etcd nothing but their lease refreshes (streamed): no
/// read, no write in 12 s, where every node used to read pools, blocks,
/// nodes, routing keys and reservations every 5 s and all of `lb/` every
/// 200 ms. A change still reaches the others at once, through the watch.
#[test]
fn idle_agents_read_nothing_and_a_change_arrives_through_the_watch() -> anyhow::Result<()> {
    privileged!();
    let cluster = EtcdCluster::start(3)?;
    let n = ClusterNodes::build(&cluster, "/watch-idle/", &pools())?;
    n.wait_remote()?;
    // Let the start settle (claims, LB membership and election).
    std::thread::sleep(Duration::from_secs(5));
    let (reads0, calls0) = calls(&cluster)?;
    let window = Duration::from_secs(12);
    std::thread::sleep(window);
    let (reads1, calls1) = calls(&cluster)?;
    let (reads, all) = (reads1 - reads0, calls1 - calls0);
    eprintln!("idle {window:?}, 3 agents: {reads} reads, {all} unary calls");
    ensure!(
        reads == 0.0 && all == 0.0,
        "idle agents asked etcd {all} unary calls, {reads} of them reads, in {window:?}"
    );
    // A change: node-1 needs a second block; node-0 routes it, told by
    // its watch (the others read nothing to learn it). Counted over the
    // ADDs alone: the test's own checks read etcd through the CLI.
    let before = n.blocks_of("node-1")?.len();
    let (reads1, _) = calls(&cluster)?;
    n.fill(1, "w", 20)?;
    let (reads2, _) = calls(&cluster)?;
    ensure!(
        n.blocks_of("node-1")?.len() > before,
        "node-1 claimed no second block"
    );
    n.wait_remote_within(Duration::from_secs(5))?;
    eprintln!(
        "node-1's second block is routed by the others; {} reads while it claimed it",
        reads2 - reads1
    );
    // node-1's guarded write of its node key reads the key first, and its
    // counts are published with its next refresh; nobody reads an area.
    ensure!(
        reads2 - reads1 <= 2.0,
        "{} reads while one node claimed a block",
        reads2 - reads1
    );
    Ok(())
}

/// The node lease is granted once and kept alive: what the node publishes
/// (its blocks, its counts) is written under the same lease. Before, every
/// change of the node's record granted a new lease and registered again.
#[test]
fn the_node_lease_stays_the_same_while_what_the_node_publishes_changes() -> anyhow::Result<()> {
    privileged!();
    let cluster = EtcdCluster::start(3)?;
    let n = ClusterNodes::build(&cluster, "/watch-lease/", &pools())?;
    n.wait_remote()?;
    let (lease, blocks) = node_key(&n, "node-0")?;
    ensure!(blocks == 1, "node-0 publishes {blocks} blocks");
    // More than a block's worth of addresses: a second block, published.
    let got = n.fill(0, "l", 20)?;
    ensure!(got == 20, "{got} of 20 addresses");
    let started = Instant::now();
    let (after, blocks) = loop {
        let (l, b) = node_key(&n, "node-0")?;
        if b >= 2 {
            break (l, b);
        }
        ensure!(
            started.elapsed() < Duration::from_secs(10),
            "the node key never listed the second block"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    // And its counts, published with the next refresh.
    std::thread::sleep(Duration::from_secs(6));
    let (last, _) = node_key(&n, "node-0")?;
    eprintln!("lease {lease:x}: {after:x} with {blocks} blocks, {last:x} after the counts");
    ensure!(
        after == lease && last == lease,
        "the node lease changed: {lease:x} → {after:x} → {last:x}"
    );
    Ok(())
}

/// The leader and the other members' IDs (hex, as etcdctl takes them):
/// `etcdctl endpoint status` on every endpoint.
fn leader(cluster: &EtcdCluster) -> anyhow::Result<(String, Vec<(String, String)>)> {
    let eps = cluster.endpoints();
    let eps: Vec<&str> = eps.iter().map(String::as_str).collect();
    let out = cluster.ctl(&eps, &["endpoint", "status", "-w", "json"])?;
    let v: serde_json::Value = serde_json::from_str(&out)?;
    let mut leader = None;
    let mut members = Vec::new();
    for s in v.as_array().context("endpoint status is a list")? {
        let id = s["Status"]["header"]["member_id"]
            .as_u64()
            .context("member id")?;
        let l = s["Status"]["leader"].as_u64().context("leader id")?;
        leader = Some(format!("{l:x}"));
        members.push((
            format!("{id:x}"),
            s["Endpoint"].as_str().unwrap_or("").to_string(),
        ));
    }
    Ok((leader.context("no member answered")?, members))
}

/// The agents' requests (unary KV and Lease calls: reads, writes, lease
/// grants and revokes; not etcdctl's member and maintenance calls) that
/// `members` answered.
fn agent_calls(cluster: &EtcdCluster, members: &[usize]) -> anyhow::Result<f64> {
    Ok(agent_calls_by_method(cluster, members)?.values().sum())
}

/// [`agent_calls`] per method (`Range`, `Txn`, `LeaseGrant`…).
fn agent_calls_by_method(
    cluster: &EtcdCluster,
    members: &[usize],
) -> anyhow::Result<std::collections::BTreeMap<String, f64>> {
    let mut by = std::collections::BTreeMap::new();
    for &i in members {
        for (n, v) in cluster.metrics(i)? {
            if n.starts_with("grpc_server_handled_total{")
                && n.contains("grpc_type=\"unary\"")
                && (n.contains("grpc_service=\"etcdserverpb.KV\"")
                    || n.contains("grpc_service=\"etcdserverpb.Lease\""))
                && let Some(m) = n
                    .split("grpc_method=\"")
                    .nth(1)
                    .and_then(|r| r.split('"').next())
            {
                *by.entry(m.to_string()).or_insert(0.0) += v;
            }
        }
    }
    Ok(by)
}

/// A leader change costs each node at most 2 requests to etcd in the 10 s
/// after it (#47 item 3): the watches stand, nothing is read again.
#[test]
fn a_leader_change_costs_each_node_at_most_two_requests() -> anyhow::Result<()> {
    privileged!();
    let cluster = EtcdCluster::start(3)?;
    let n = ClusterNodes::build(&cluster, "/watch-leader/", &pools())?;
    n.wait_remote()?;
    std::thread::sleep(Duration::from_secs(5));
    let (old, members) = leader(&cluster)?;
    let (to, _) = members
        .iter()
        .find(|(id, _)| *id != old)
        .context("a member that does not lead")?;
    let (_, at) = members
        .iter()
        .find(|(id, _)| *id == old)
        .context("the leader's endpoint")?;
    let calls0 = agent_calls(&cluster, &[0, 1, 2])?;
    cluster.ctl(&[at.as_str()], &["move-leader", to])?;
    std::thread::sleep(Duration::from_secs(10));
    let calls1 = agent_calls(&cluster, &[0, 1, 2])?;
    let (now, _) = leader(&cluster)?;
    ensure!(now == *to, "the leader moved to {now}, not {to}");
    let per_node = (calls1 - calls0) / 3.0;
    eprintln!("a leader change: {per_node} requests per node in the 10 s after it");
    ensure!(
        per_node <= 2.0,
        "{per_node} requests per node in the 10 s after a leader change"
    );
    Ok(())
}

/// A member stopping breaks the watches it served; the agents resume them
/// on the others from where they were, reading nothing again: at most 2
/// requests per node in the 10 s after, counted on the members that stay.
#[test]
fn a_member_stopping_costs_each_node_at_most_two_requests() -> anyhow::Result<()> {
    privileged!();
    let mut cluster = EtcdCluster::start(3)?;
    let n = ClusterNodes::build(&cluster, "/watch-member/", &pools())?;
    n.wait_remote()?;
    std::thread::sleep(Duration::from_secs(5));
    // The member serving the most watch streams is the one stopped.
    let mut streams = Vec::new();
    for i in 0..3 {
        let m = cluster.metrics(i)?;
        let s = m
            .iter()
            .find(|(k, _)| k == "etcd_debugging_mvcc_watch_stream_total")
            .map_or(0.0, |(_, v)| *v);
        streams.push((s, i));
    }
    let (most, stop) = streams
        .iter()
        .copied()
        .fold((f64::MIN, 0), |a, b| if b.0 > a.0 { b } else { a });
    ensure!(most >= 1.0, "no member serves a watch: {streams:?}");
    let stay: Vec<usize> = (0..3).filter(|i| *i != stop).collect();
    let before = agent_calls_by_method(&cluster, &stay)?;
    cluster.stop_member(stop);
    std::thread::sleep(Duration::from_secs(10));
    let after = agent_calls_by_method(&cluster, &stay)?;
    let (calls0, calls1) = (before.values().sum::<f64>(), after.values().sum::<f64>());
    let made: Vec<String> = after
        .iter()
        .filter_map(|(m, v)| {
            let d = v - before.get(m).copied().unwrap_or(0.0);
            (d > 0.0).then(|| format!("{m} {d}"))
        })
        .collect();
    eprintln!("requests made: {made:?}");
    let broke = n
        .agents
        .iter()
        .filter(|a| a.log().contains("cluster mirror: watch broke"))
        .count();
    ensure!(
        broke >= 1,
        "no agent's watch broke when member {stop} stopped"
    );
    let per_node = (calls1 - calls0) / 3.0;
    eprintln!(
        "member {stop} stopped ({most} watch streams, {broke} agents' watches broke): \
         {per_node} requests per node in the 10 s after it"
    );
    ensure!(
        per_node <= 2.0,
        "{per_node} requests per node in the 10 s after a member stopped"
    );
    Ok(())
}
