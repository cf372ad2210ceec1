//! #47 item 3: while etcd answers nothing, every retry loop of an agent
//! backs off (jittered, growing delays) instead of asking again at its
//! tick. Three agents on a real 3-member etcd; their forwarders relay
//! every request to etcd and drop every answer, so etcd's own metrics
//! count what the agents keep asking of a silent etcd.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::ensure;
use lockstep_tests::cluster::ClusterNodes;
use lockstep_tests::etcd::EtcdCluster;
use lockstep_tests::privileged;

fn pools() -> String {
    "[[pools]]\nname = \"pods\"\nipv4 = [\"10.88.0.0/24\"]\nblock_v4 = 28\n".to_string()
}

/// Every request started at etcd so far, per method (unary calls, and
/// the messages of the watch and lease streams), summed over the members.
fn started(cluster: &EtcdCluster) -> anyhow::Result<BTreeMap<String, f64>> {
    let mut per: BTreeMap<String, f64> = BTreeMap::new();
    for i in 0..3 {
        for (name, v) in cluster.metrics(i)? {
            let counted = name.starts_with("grpc_server_started_total{")
                && name.contains("grpc_type=\"unary\"")
                || name.starts_with("grpc_server_msg_received_total{")
                    && name.contains("_stream\"");
            let Some(method) = name
                .split("grpc_method=\"")
                .nth(1)
                .and_then(|r| r.split('"').next())
            else {
                continue;
            };
            if counted {
                *per.entry(method.to_string()).or_default() += v;
            }
        }
    }
    Ok(per)
}

fn minus(a: &BTreeMap<String, f64>, b: &BTreeMap<String, f64>) -> BTreeMap<String, f64> {
    a.iter()
        .map(|(k, v)| (k.clone(), v - b.get(k).copied().unwrap_or(0.0)))
        .filter(|(_, v)| *v > 0.0)
        .collect()
}

/// etcd silent for 45 s: the requests the three agents send in its last
/// 20 s are a fraction of a fixed pace's (the claim loop read every 1 s,
/// the LB announcer read `lb/` every 200 ms, the assigner every 500 ms),
/// and fewer than in the 20 s before (the delays grow). Once etcd answers
/// again, the agents follow it: a block claimed meanwhile elsewhere is
/// routed by all.
#[test]
fn a_silent_etcd_is_asked_ever_less_often() -> anyhow::Result<()> {
    privileged!();
    let cluster = EtcdCluster::start(3)?;
    let n = ClusterNodes::build(&cluster, "/silence/", &pools())?;
    n.wait_remote()?;
    std::thread::sleep(Duration::from_secs(5));
    for c in &n.cuts {
        c.silence();
    }
    let s0 = started(&cluster)?;
    std::thread::sleep(Duration::from_secs(5));
    let s1 = started(&cluster)?;
    std::thread::sleep(Duration::from_secs(20));
    let s2 = started(&cluster)?;
    std::thread::sleep(Duration::from_secs(20));
    let s3 = started(&cluster)?;
    let (first, middle, last) = (minus(&s1, &s0), minus(&s2, &s1), minus(&s3, &s2));
    eprintln!("0-5 s: {first:?}\n5-25 s: {middle:?}\n25-45 s: {last:?}");
    for c in &n.cuts {
        c.unmute();
    }
    let sum = |m: &BTreeMap<String, f64>| m.values().sum::<f64>();
    let per_s = sum(&last) / 20.0 / 3.0;
    eprintln!("last 20 s: {per_s:.2} requests/s per node");
    ensure!(
        per_s <= 1.0,
        "a silent etcd was asked {per_s:.2} requests/s per node in its last 20 s: {last:?}"
    );
    ensure!(
        sum(&last) < sum(&middle),
        "the pace did not slow: {} then {} requests",
        sum(&middle),
        sum(&last)
    );
    // Answering again: the agents follow etcd (a new block, routed).
    n.fill(1, "s", 20)?;
    n.wait_remote_within(Duration::from_secs(30))?;
    Ok(())
}
