//! A restarted agent resumes its watch from the mirror's copy in its state
//! directory (#47 item 3) against a real etcd, instead of reading the
//! whole prefix again: what etcd sends it for the restart, counted with
//! etcd's own metrics, beside a restart without the copy (a cold start).
//! The changes made while it was down reach its datapath either way (as
//! changes, not as drift repaired); a copy whose revision etcd compacted
//! away makes a full read, and the datapath is right after it too.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use lockstep::cluster::{Block, Claim, Door, DoorOptions};
use lockstep_tests::cluster::{cluster_config, lone_node, lpm_v4, remote_entries};
use lockstep_tests::etcd::EtcdCluster;
use lockstep_tests::{AgentOptions, AgentProc};

const PREFIX: &str = "/resume/";
/// Other nodes written before the agent starts: a prefix of a few hundred
/// keys, so a full read stands out.
const OTHERS: usize = 300;

fn options(eps: &[String]) -> DoorOptions {
    lockstep_tests::synthetic::door_options(eps, PREFIX, Duration::from_secs(10))
}

fn name(i: usize) -> String {
    format!("other-{i:03}")
}

/// Node `i`'s underlay address: in 10.200.0.0/16, on link in the agent's
/// namespace.
fn ip(i: usize) -> anyhow::Result<IpAddr> {
    Ok(IpAddr::V4(Ipv4Addr::new(
        10,
        200,
        u8::try_from(i / 256)?,
        u8::try_from(i % 256)?,
    )))
}

/// The other nodes' blocks, as etcd holds them: block → node address.
async fn others_in_etcd(d: &mut Door) -> anyhow::Result<BTreeMap<String, String>> {
    let addrs: BTreeMap<String, IpAddr> = d
        .nodes()
        .await?
        .iter()
        .filter_map(|n| Some((n.record.name.clone(), *n.record.ips.first()?)))
        .collect();
    Ok(d.blocks()
        .await?
        .0
        .iter()
        .filter(|b| b.node != "me")
        .filter_map(|b| Some((b.cidr.to_string(), addrs.get(&b.node)?.to_string())))
        .collect())
}

/// Waits until the agent's remote IPCACHE entries are the other nodes'
/// blocks etcd holds.
fn converged(agent: &AgentProc, want: &BTreeMap<String, String>) -> anyhow::Result<Duration> {
    let started = Instant::now();
    loop {
        let got = remote_entries(&lpm_v4(agent, "IPCACHE_V4")?);
        if &got == want {
            return Ok(started.elapsed());
        }
        ensure!(
            started.elapsed() < Duration::from_secs(30),
            "the agent's remote entries are not etcd's after 30 s: {} of {} (missing {:?}, extra {:?})\n{}",
            got.len(),
            want.len(),
            want.keys()
                .filter(|k| !got.contains_key(*k))
                .take(5)
                .collect::<Vec<_>>(),
            got.keys()
                .filter(|k| !want.contains_key(*k))
                .take(5)
                .collect::<Vec<_>>(),
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// What etcd sent while the agent restarted (SIGKILL) and converged on
/// `want`: bytes, and Range calls.
fn restart(
    cluster: &EtcdCluster,
    agent: &mut AgentProc,
    want: &BTreeMap<String, String>,
) -> anyhow::Result<(f64, f64)> {
    let before = cluster.traffic()?;
    let ranges = cluster.counter("grpc_server_handled_total{", &["grpc_method=\"Range\""])?;
    agent.restart()?;
    converged(agent, want)?;
    let after = cluster.traffic()?;
    let ranges_after = cluster.counter("grpc_server_handled_total{", &["grpc_method=\"Range\""])?;
    Ok((after.sent_bytes - before.sent_bytes, ranges_after - ranges))
}

#[test]
fn a_restarted_agent_resumes_from_its_copy_and_a_compacted_one_reads_everything()
-> anyhow::Result<()> {
    lockstep_tests::privileged!();
    let cluster = EtcdCluster::start(1)?;
    let eps = cluster.endpoints();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut d = rt.block_on(async {
        let mut d = Door::connect(options(&eps)).await?;
        d.apply_pools(&[serde_json::from_value(
            serde_json::json!({ "name": "resume", "ipv4": ["10.64.0.0/12"] }),
        )?])
        .await?;
        for i in 0..OTHERS {
            let r = lockstep_tests::synthetic::node_record(name(i), ip(i)?, 0, "resume");
            d.register_node(&r, &[], Duration::from_secs(3600)).await?;
            let got = d
                .claim_block("resume", lockstep_tests::synthetic::block(i)?, &r.name)
                .await?;
            ensure!(matches!(got, Claim::Claimed { .. }), "{}: {got:?}", r.name);
        }
        anyhow::Ok(d)
    })?;
    let ns = lone_node("resume", "192.0.2.2", &cluster)?;
    ns.exec("ip", ["route", "add", "10.200.0.0/16", "dev", "u0"])?;
    let mut agent = AgentProc::launch(
        &ns,
        &AgentOptions {
            extra: cluster_config(&eps, PREFIX, "me", "192.0.2.2"),
            ..Default::default()
        },
    )?;
    let copy = agent.dir.path().join("state").join("cluster-mirror.json");
    let want = rt.block_on(others_in_etcd(&mut d))?;
    converged(&agent, &want)?;
    lockstep_tests::until(Duration::from_secs(10), "the mirror's copy", || {
        Ok((!copy.exists()).then(|| format!("{} not written", copy.display())))
    })?;

    // Changes the copy does not hold (a block claimed, one given back),
    // made while the agent runs and while it is down.
    let mut extra = OTHERS;
    let mut change = |d: &mut Door| -> anyhow::Result<()> {
        rt.block_on(async {
            let node = name(extra % OTHERS);
            let got = d
                .claim_block("resume", lockstep_tests::synthetic::block(extra)?, &node)
                .await?;
            ensure!(matches!(got, Claim::Claimed { .. }), "{node}: {got:?}");
            let (blocks, _) = d.blocks().await?;
            let gone: Block = blocks
                .iter()
                .find(|b| b.node == name(extra % OTHERS + 1))
                .cloned()
                .context("a block to give back")?;
            ensure!(
                d.release_block(&gone).await?,
                "{} not given back",
                gone.cidr
            );
            anyhow::Ok(())
        })?;
        extra += 1;
        Ok(())
    };
    change(&mut d)?;
    agent.kill9();
    change(&mut d)?;
    let want = rt.block_on(others_in_etcd(&mut d))?;
    let (resumed, resumed_ranges) = restart(&cluster, &mut agent, &want)?;
    // What changed while it was away is a change it makes, not drift it
    // repaired.
    let metrics = lockstep_tests::cluster::metrics_in(&ns)?;
    ensure!(
        metrics.contains("lockstep_reconcile"),
        "no metrics read from the agent: {metrics}"
    );
    let repairs = lockstep_tests::cluster::sample(
        &metrics,
        "lockstep_reconcile_repairs_total{map=\"IPCACHE_V4\"}",
    );
    ensure!(
        repairs.unwrap_or(0.0) == 0.0,
        "the blocks changed while the agent was away were counted as repairs: {repairs:?}"
    );
    let log = agent.log();
    ensure!(
        log.contains("resuming the watch from the saved copy's revision")
            && log.contains("the saved copy caught up with etcd"),
        "the agent did not resume from its copy and catch up:\n{log}"
    );

    // The same restart without the copy: everything is read.
    change(&mut d)?;
    let want = rt.block_on(others_in_etcd(&mut d))?;
    agent.kill9();
    std::fs::remove_file(&copy)?;
    let (cold, cold_ranges) = restart(&cluster, &mut agent, &want)?;
    println!(
        "etcd sent {resumed:.0} bytes in {resumed_ranges:.0} Range calls for a restart resumed from the copy, {cold:.0} bytes in {cold_ranges:.0} for a cold one ({OTHERS} other nodes)"
    );
    ensure!(
        resumed * 10.0 < cold,
        "a resumed restart cost etcd {resumed:.0} bytes, a cold one {cold:.0}: not a tenth\n{}",
        agent.log()
    );

    // A copy etcd compacted away: a full read, and the datapath right.
    lockstep_tests::until(Duration::from_secs(10), "the mirror's copy", || {
        Ok((!copy.exists()).then(|| format!("{} not written", copy.display())))
    })?;
    agent.kill9();
    change(&mut d)?;
    let revision = rt.block_on(async { anyhow::Ok(d.blocks().await?.1) })?;
    cluster.ctl(&[cluster.endpoint(0)], &["compact", &revision.to_string()])?;
    let want = rt.block_on(others_in_etcd(&mut d))?;
    agent.restart()?;
    converged(&agent, &want)?;
    ensure!(
        agent.log().contains("compacted"),
        "the agent did not say the copy's history was compacted:\n{}",
        agent.log()
    );
    Ok(())
}
