//! A node's agent restarted in cluster mode withdraws none of the remote
//! state the node has: its routes to the other nodes' blocks (protocol
//! 213), their IPCACHE entries and the cluster's skip-masquerade entries
//! stay as they were from the kill until the new agent has read etcd, and
//! for as long as etcd cannot be read at all.
//!
//! Before, the new agent's first reconcile (an empty remote view) deleted
//! the entries and its route task's first tick deleted every route, until
//! etcd was read: a blink on every restart, and a node cut off from its
//! cluster for the whole time etcd was unreachable.
//!
//! Three node namespaces on one underlay, a real 3-member etcd, one pod
//! per node through the CNI plugin; the node's remote state is sampled
//! every few milliseconds through each restart.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use lockstep_tests::cluster::{ClusterNodes, lpm_v4_at, remote_entries};
use lockstep_tests::etcd::EtcdCluster;
use lockstep_tests::{Netns, privileged};

/// What node 0 has of the remote state: its lockstep routes, its remote
/// IPCACHE entries (prefix → node address) and its skip-masquerade
/// entries of reason cluster.
#[derive(Debug, PartialEq, Eq)]
struct Remote {
    routes: Vec<String>,
    ipcache: BTreeMap<String, String>,
    masq: Vec<String>,
}

fn remote_of(ns: &Netns, pins: &Path) -> anyhow::Result<Remote> {
    let mut routes: Vec<String> = ns
        .exec("ip", ["-4", "route", "show", "proto", "213"])?
        .lines()
        .map(|l| l.trim().to_string())
        .collect();
    routes.sort();
    let ipcache = remote_entries(&lpm_v4_at(&pins.join("maps/IPCACHE_V4"))?);
    // MASQ_SKIP_V4's value: reason (3: the cluster's), pool id.
    let masq = lpm_v4_at(&pins.join("maps/MASQ_SKIP_V4"))?
        .into_iter()
        .filter(|(_, v)| v.len() >= 4 && u32::from_le_bytes([v[0], v[1], v[2], v[3]]) == 3)
        .map(|(k, _)| k)
        .collect();
    Ok(Remote {
        routes,
        ipcache,
        masq,
    })
}

/// Samples node 0's remote state until `done` is set, returning how many
/// samples were taken and every one that differed from `want`.
fn sample(
    ns: &Netns,
    pins: &Path,
    want: &Remote,
    done: &std::sync::atomic::AtomicBool,
) -> anyhow::Result<(usize, Vec<(Duration, Remote)>)> {
    let started = Instant::now();
    let (mut n, mut off) = (0, Vec::new());
    while !done.load(std::sync::atomic::Ordering::Relaxed) {
        let got = remote_of(ns, pins)?;
        n += 1;
        if got != *want {
            off.push((started.elapsed(), got));
        }
    }
    Ok((n, off))
}

/// The IPv4 address of a pod's `eth0`.
fn pod_address(pod: &Netns) -> anyhow::Result<IpAddr> {
    let v: serde_json::Value =
        serde_json::from_str(&pod.ip(["-j", "-4", "addr", "show", "dev", "eth0"])?)?;
    Ok(v[0]["addr_info"][0]["local"]
        .as_str()
        .context("no IPv4 address on eth0")?
        .parse()?)
}

fn ping(from: &Netns, to: IpAddr) -> anyhow::Result<()> {
    from.exec("ping", ["-c", "1", "-W", "2", &to.to_string()])
        .map(drop)
        .with_context(|| format!("ping {to}"))
}

#[test]
fn a_restarted_agent_withdraws_no_remote_route_or_entry_even_cut_off() -> anyhow::Result<()> {
    privileged!();
    let cluster = EtcdCluster::start(3)?;
    let pools = "[[pools]]\nname = \"pods\"\nipv4 = [\"10.98.0.0/24\"]\nblock_v4 = 28\nskip_masquerade = true\n";
    let (mut n, pods) = ClusterNodes::with_pods(&cluster, "/restart/", pools, "", "crs")?;
    n.wait_remote()?;
    let pins = n.agents[0].pins.path().to_path_buf();
    let want = remote_of(&n.ns[0], &pins)?;
    ensure!(
        want.routes.len() == 2 && want.ipcache.len() == 2 && want.masq.len() == 1,
        "node 0 before the restarts: {want:?}"
    );
    let far = pod_address(&pods[1])?;
    ping(&pods[0], far)?;

    // 1. Killed and started again with etcd answering: sampled from the
    //    kill until two seconds after the new agent is ready.
    let done = std::sync::atomic::AtomicBool::new(false);
    let ((samples, off), took) = std::thread::scope(|s| -> anyhow::Result<_> {
        let sampler = s.spawn(|| sample(&n.ns[0], &pins, &want, &done));
        std::thread::sleep(Duration::from_millis(200));
        let took = n.agents[0].restart();
        std::thread::sleep(Duration::from_secs(2));
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        let got = sampler
            .join()
            .map_err(|_| anyhow::anyhow!("sampler panicked"))??;
        Ok((got, took?))
    })?;
    eprintln!(
        "restart (etcd answering): ready in {took:?}; {samples} samples, {} off",
        off.len()
    );
    ensure!(
        off.is_empty(),
        "the restart changed node 0's remote state: first {:?}",
        off.first()
    );
    ensure!(samples > 10, "only {samples} samples");
    ping(&pods[0], far)?;

    // 2. Cut from etcd, killed and started again: the new agent cannot
    //    read etcd at all; what the node had stays, and the pod still
    //    reaches the other node's pod.
    n.cut_from_etcd(0)?;
    let done = std::sync::atomic::AtomicBool::new(false);
    let (samples, off) = std::thread::scope(|s| -> anyhow::Result<_> {
        let sampler = s.spawn(|| sample(&n.ns[0], &pins, &want, &done));
        std::thread::sleep(Duration::from_millis(200));
        n.agents[0].respawn()?;
        n.agents[0].wait_ready()?;
        // Several route ticks and reconciles of the new agent.
        std::thread::sleep(Duration::from_secs(5));
        ping(&pods[0], far)?;
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        sampler
            .join()
            .map_err(|_| anyhow::anyhow!("sampler panicked"))?
    })?;
    eprintln!(
        "restart cut off from etcd: {samples} samples, {} off",
        off.len()
    );
    ensure!(
        off.is_empty(),
        "the restart cut off changed node 0's remote state: first {:?}",
        off.first()
    );
    let status = n.agents[0].status_json().context("status")?;
    ensure!(
        !status["cluster"]["etcd_unreachable"].is_null(),
        "node 0 reads etcd though cut off: {status}"
    );

    // Healed: the agent reads etcd and the state is etcd's again, checked
    // by verify too.
    n.heal(0)?;
    n.wait_remote()?;
    ensure!(remote_of(&n.ns[0], &pins)? == want, "after the heal");
    n.agents[0].verify_within(Duration::from_secs(10))?;
    ping(&pods[0], far)?;
    Ok(())
}
