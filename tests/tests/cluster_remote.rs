//! Cluster mode's remote state (#12 item 5): an agent in its node namespace
//! learns the other nodes' blocks from a real 3-member etcd and programs an
//! IPCACHE entry (flag remote, the holder's node address) and a route
//! `block via node_ip proto 213` for each; a node removed takes its entries
//! and routes with it; a route or an entry deleted by hand comes back.
//!
//! The other nodes are real agents in their own namespaces; etcd is reached
//! from every namespace through a forwarder (as in `cluster_agent`).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Context;
use lockstep_tests::cluster::{forward, lpm_v4, metrics_in, remote_entries, sample};
use lockstep_tests::etcd::EtcdCluster;
use lockstep_tests::{AgentProc, Netns, privileged, sh};

/// lockstep's route protocol number (docs/cluster.md).
const PROTO: &str = "213";

fn cli(eps: &[String], args: &[&str]) -> anyhow::Result<String> {
    let out = std::process::Command::new(lockstep_tests::lockstep_bin())
        .args(["cluster", "--etcd", &eps.join(","), "--prefix", "/cr/"])
        .args(args)
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "lockstep cluster {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn config(eps: &[String], node: &str, ip: &str) -> String {
    format!(
        "pools = []\nreconcile_interval = \"300ms\"\n[cluster]\netcd = [{}]\nprefix = \"/cr/\"\nnode_name = \"{node}\"\nnode_ip_v4 = \"{ip}\"\n",
        eps.iter()
            .map(|e| format!("\"{e}\""))
            .collect::<Vec<_>>()
            .join(", "),
    )
}

fn allocate(agent: &AgentProc, name: &str) -> anyhow::Result<()> {
    let mut last = String::new();
    for _ in 0..50 {
        let out = agent.cli([
            "allocate", "--kind", "endpoint", "--name", name, "--family", "ipv4", "-o", "json",
        ])?;
        if out.status.success() {
            return Ok(());
        }
        last = String::from_utf8_lossy(&out.stderr).into_owned();
        std::thread::sleep(Duration::from_millis(100));
    }
    anyhow::bail!("no address for {name}: {last}")
}

/// Blocks by holder, as etcd has them.
fn blocks(eps: &[String]) -> anyhow::Result<BTreeMap<String, String>> {
    let v: serde_json::Value = serde_json::from_str(&cli(eps, &["blocks", "-o", "json"])?)?;
    Ok(v.as_array()
        .context("blocks")?
        .iter()
        .filter_map(|b| {
            Some((
                b["cidr"].as_str()?.to_string(),
                b["node"].as_str()?.to_string(),
            ))
        })
        .collect())
}

/// lockstep's routes in `ns`: destination → gateway.
fn routes(ns: &Netns) -> anyhow::Result<BTreeMap<String, String>> {
    let text = ns.ip(["-j", "-4", "route", "show", "proto", PROTO])?;
    let v: serde_json::Value = serde_json::from_str(&text)?;
    Ok(v.as_array()
        .context("routes")?
        .iter()
        .filter_map(|r| {
            Some((
                r["dst"].as_str()?.to_string(),
                r["gateway"].as_str()?.to_string(),
            ))
        })
        .collect())
}

/// What node `a` should have for the other nodes' blocks: block → node IP.
fn expected(
    eps: &[String],
    ips: &BTreeMap<&str, &str>,
) -> anyhow::Result<BTreeMap<String, String>> {
    Ok(blocks(eps)?
        .into_iter()
        .filter(|(_, n)| n != "node-a")
        .filter_map(|(c, n)| Some((c, ips.get(n.as_str())?.to_string())))
        .collect())
}

/// Waits until `a`'s routes and IPCACHE remote entries are `want`.
fn wait_remote(
    na: &Netns,
    a: &AgentProc,
    eps: &[String],
    ips: &BTreeMap<&str, &str>,
) -> anyhow::Result<(Duration, BTreeMap<String, String>)> {
    let start = Instant::now();
    loop {
        // The other nodes may claim more blocks meanwhile: etcd says what
        // should be there now.
        let want = &expected(eps, ips)?;
        let r = routes(na)?;
        let ipc = lpm_v4(a, "IPCACHE_V4")?;
        let remote = remote_entries(&ipc);
        if &r == want && &remote == want {
            return Ok((start.elapsed(), want.clone()));
        }
        anyhow::ensure!(
            start.elapsed() < Duration::from_secs(15),
            "routes {r:?} and remote IPCACHE {remote:?}, want {want:?}\nlog: {}",
            a.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn other_nodes_blocks_become_routes_and_entries_and_go_with_their_node() -> anyhow::Result<()> {
    privileged!();
    let cluster = EtcdCluster::start(3)?;
    let eps = cluster.endpoints();
    let dir = lockstep_tests::TempDir::new("cluster-remote")?;
    let file = dir.path().join("pools.toml");
    std::fs::write(
        &file,
        "[[pools]]\nname = \"pods\"\nipv4 = [\"10.93.0.0/24\"]\nblock_v4 = 28\nskip_masquerade = true\n",
    )?;
    cli(
        &eps,
        &["pools", "apply", "-f", file.to_str().context("path")?],
    )?;
    let (na, nb, nc) = (Netns::new("cra")?, Netns::new("crb")?, Netns::new("crc")?);
    for ns in [&na, &nb, &nc] {
        forward(ns, &cluster)?;
    }
    // The node addresses of b and c are on-link in a's namespace.
    na.ip(["link", "add", "d0", "type", "veth", "peer", "name", "d1"])?;
    na.ip(["link", "set", "d1", "up"])?;
    na.ip(["addr", "add", "192.0.2.1/24", "dev", "d0"])?;
    na.ip(["link", "set", "d0", "up"])?;
    // A route of another protocol the agent must leave alone.
    na.ip([
        "route",
        "add",
        "10.93.1.0/28",
        "via",
        "192.0.2.9",
        "proto",
        "static",
    ])?;
    let ips: BTreeMap<&str, &str> = [("node-b", "192.0.2.2"), ("node-c", "192.0.2.3")].into();
    let a = AgentProc::start(&na, &config(&eps, "node-a", "192.0.2.1"))?;
    let b = AgentProc::start(&nb, &config(&eps, "node-b", ips["node-b"]))?;
    let mut c = AgentProc::start(&nc, &config(&eps, "node-c", ips["node-c"]))?;
    allocate(&a, "ea")?;
    allocate(&b, "eb")?;
    allocate(&c, "ec")?;

    let (took, want) = wait_remote(&na, &a, &eps, &ips)?;
    assert!(
        want.values().any(|v| v == "192.0.2.2") && want.values().any(|v| v == "192.0.2.3"),
        "b and c hold blocks: {want:?}"
    );
    eprintln!("remote state programmed {took:?} after the claims were read");
    // The skip-masquerade cluster CIDR is in MASQ_SKIP_V4.
    let masq = lpm_v4(&a, "MASQ_SKIP_V4")?;
    assert!(masq.contains_key("10.93.0.0/24"), "{masq:?}");
    // a's own block has no route and no remote entry; the static route stays.
    let own = sh("ip", ["-n", na.name(), "route", "show", "proto", "static"])?;
    assert!(own.contains("10.93.1.0/28"), "{own}");
    assert!(
        a.cli(["verify"])?.status.success(),
        "verify with remote state"
    );

    // A route deleted by hand comes back.
    let (dst, via) = want.iter().next().context("a block")?;
    // verify names it (deleted again if the task restored it first).
    let mut named = false;
    for _ in 0..20 {
        let _ = na.ip(["route", "del", dst, "via", via, "proto", PROTO]);
        let out = a.cli(["verify"])?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        if !out.status.success()
            && text.contains(&format!("route {dst} via {via} proto {PROTO} is missing"))
        {
            named = true;
            break;
        }
    }
    assert!(named, "verify never named the deleted route");
    let (took, _) = wait_remote(&na, &a, &eps, &ips)?;
    eprintln!("deleted route restored in {took:?}");
    // An IPCACHE entry deleted by hand comes back (reconcile).
    let pin = a.pins.path().join("maps/IPCACHE_V4");
    let net: ipnet::Ipv4Net = dst.parse()?;
    let mut key = vec![
        net.prefix_len().to_string(),
        "0".into(),
        "0".into(),
        "0".into(),
    ];
    key.extend(net.network().octets().iter().map(u8::to_string));
    let mut del = vec![
        "map",
        "delete",
        "pinned",
        pin.to_str().context("utf-8")?,
        "key",
    ];
    del.extend(key.iter().map(String::as_str));
    sh("bpftool", &del)?;
    let (took, _) = wait_remote(&na, &a, &eps, &ips)?;
    eprintln!("deleted IPCACHE entry restored in {took:?}");

    // Node c goes: its blocks' routes and entries go with it. Those are
    // changes the agent makes, not drift it repairs: the repairs count
    // (what operators alert on) stays where the hand deletion put it.
    let repairs = || {
        metrics_in(&na).map(|m| sample(&m, "lockstep_reconcile_repairs_total{map=\"IPCACHE_V4\"}"))
    };
    let repaired = repairs()?;
    assert!(
        repaired >= Some(1.0),
        "the hand-deleted entry's repair is not counted: {repaired:?}"
    );
    c.kill9();
    cli(&eps, &["node", "remove", "node-c", "--force"])?;
    let (took, want_b) = wait_remote(&na, &a, &eps, &ips)?;
    assert!(
        !want_b.is_empty() && want_b.values().all(|v| v == "192.0.2.2"),
        "b's blocks only: {want_b:?}"
    );
    eprintln!("removed node's state gone in {took:?}");
    assert_eq!(
        repairs()?,
        repaired,
        "the removed node's entries were counted as repairs"
    );
    assert!(
        sh("ip", ["-n", na.name(), "route", "show", "proto", "static"])?.contains("10.93.1.0/28"),
        "the static route is untouched"
    );
    drop(b);
    Ok(())
}

/// The store's current revision.
fn revision(cluster: &EtcdCluster) -> anyhow::Result<i64> {
    let out = cluster.ctl(&[cluster.endpoint(0)], &["get", "none", "-w", "json"])?;
    let v: serde_json::Value = serde_json::from_str(&out)?;
    v["header"]["revision"].as_i64().context("revision")
}

#[test]
fn a_watch_whose_history_was_compacted_resyncs_by_a_full_read() -> anyhow::Result<()> {
    privileged!();
    let cluster = EtcdCluster::start(3)?;
    let eps = cluster.endpoints();
    let dir = lockstep_tests::TempDir::new("cluster-remote-compact")?;
    let file = dir.path().join("pools.toml");
    std::fs::write(
        &file,
        "[[pools]]\nname = \"pods\"\nipv4 = [\"10.94.0.0/24\"]\nblock_v4 = 28\n",
    )?;
    cli(
        &eps,
        &["pools", "apply", "-f", file.to_str().context("path")?],
    )?;
    let (na, nb, nc) = (Netns::new("cxa")?, Netns::new("cxb")?, Netns::new("cxc")?);
    let cut_a = forward(&na, &cluster)?;
    forward(&nb, &cluster)?;
    forward(&nc, &cluster)?;
    na.ip(["link", "add", "d0", "type", "veth", "peer", "name", "d1"])?;
    na.ip(["link", "set", "d1", "up"])?;
    na.ip(["addr", "add", "192.0.2.1/24", "dev", "d0"])?;
    na.ip(["link", "set", "d0", "up"])?;
    let ips: BTreeMap<&str, &str> = [("node-b", "192.0.2.2"), ("node-c", "192.0.2.3")].into();
    let a = AgentProc::start(&na, &config(&eps, "node-a", "192.0.2.1"))?;
    let b = AgentProc::start(&nb, &config(&eps, "node-b", ips["node-b"]))?;
    let mut c = AgentProc::start(&nc, &config(&eps, "node-c", ips["node-c"]))?;
    allocate(&b, "eb")?;
    allocate(&c, "ec")?;
    let (_, want) = wait_remote(&na, &a, &eps, &ips)?;

    // Node a loses etcd; meanwhile c is removed and the history compacted
    // past a's watch.
    cut_a.set(true);
    let start = Instant::now();
    while !a.log().contains("watch broke") {
        anyhow::ensure!(
            start.elapsed() < Duration::from_secs(10),
            "a's watch did not break"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    c.kill9();
    cli(&eps, &["node", "remove", "node-c", "--force"])?;
    // Compacted exactly at the removal: etcd drops the deletions made at
    // the compaction revision, so a watch resumed there would never hear
    // that node-c went (the agent watches from one revision earlier, which
    // etcd refuses as compacted).
    let rev = revision(&cluster)?;
    cluster.ctl(&[cluster.endpoint(0)], &["compact", &rev.to_string()])?;
    eprintln!("compacted at {rev}");
    // While cut, a keeps what it had (nothing is dropped for lack of etcd).
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(routes(&na)?, want, "routes kept while etcd is unreachable");
    cut_a.set(false);
    let (took, want_b) = wait_remote(&na, &a, &eps, &ips)?;
    assert!(
        !want_b.is_empty() && want_b.values().all(|v| v == "192.0.2.2"),
        "b's blocks only: {want_b:?}"
    );
    eprintln!("resynced after compaction in {took:?} after etcd came back");
    assert!(
        a.log().contains("compacted"),
        "the resync went through the compaction path: {}",
        a.log()
    );
    assert!(a.cli(["verify"])?.status.success(), "no drift after resync");
    drop(b);
    Ok(())
}

/// #26 item 4: etcd restored from a backup goes back in time. A watch
/// resumed from the revision the agent had reached waits for revisions
/// etcd will write anew and never reports what is written below them:
/// before, a node claimed a block after the restore and another node never
/// routed it. Now every watch answer's store revision is checked against
/// what was seen; below it, the agent reads everything again.
#[test]
fn a_watch_across_an_etcd_restore_resyncs_by_a_full_read() -> anyhow::Result<()> {
    privileged!();
    let mut cluster = EtcdCluster::start(3)?;
    let eps = cluster.endpoints();
    let dir = lockstep_tests::TempDir::new("cluster-remote-restore")?;
    let file = dir.path().join("pools.toml");
    std::fs::write(
        &file,
        "[[pools]]\nname = \"pods\"\nipv4 = [\"10.93.0.0/24\"]\nblock_v4 = 28\n",
    )?;
    cli(
        &eps,
        &["pools", "apply", "-f", file.to_str().context("path")?],
    )?;
    let (na, nb) = (Netns::new("rsa")?, Netns::new("rsb")?);
    forward(&na, &cluster)?;
    forward(&nb, &cluster)?;
    na.ip(["link", "add", "d0", "type", "veth", "peer", "name", "d1"])?;
    na.ip(["link", "set", "d1", "up"])?;
    na.ip(["addr", "add", "192.0.2.1/24", "dev", "d0"])?;
    na.ip(["link", "set", "d0", "up"])?;
    let ips: BTreeMap<&str, &str> = [("node-b", "192.0.2.2")].into();
    let a = AgentProc::start(&na, &config(&eps, "node-a", "192.0.2.1"))?;
    let b = AgentProc::start(&nb, &config(&eps, "node-b", ips["node-b"]))?;
    allocate(&b, "eb0")?;
    wait_remote(&na, &a, &eps, &ips)?;

    // The backup. Then writes under the prefix that a's watch sees, so the
    // revision a has reached runs well past the backup's.
    let snap = dir.path().join("backup.db");
    cluster.snapshot(0, &snap)?;
    let backed_up = revision(&cluster)?;
    for i in 0..60 {
        cluster.ctl(
            &[cluster.endpoint(0)],
            &["put", &format!("/cr/test-filler/{i}"), "x"],
        )?;
    }
    let reached = revision(&cluster)?;
    std::thread::sleep(Duration::from_millis(500));

    // Every member restored from the backup: the revision goes back.
    cluster.restore_all(&snap)?;
    let restored = revision(&cluster)?;
    eprintln!("revision {backed_up} backed up, {reached} reached, {restored} after the restore");
    anyhow::ensure!(restored < reached, "the restore did not go back in time");

    // b claims new blocks after the restore, at revisions below the one
    // a had reached: a must route them.
    for i in 1..20 {
        allocate(&b, &format!("eb{i}"))?;
    }
    let after = revision(&cluster)?;
    anyhow::ensure!(
        after < reached,
        "b's claims ({after}) were not written below the revision a had reached ({reached})"
    );
    let (took, want) = wait_remote(&na, &a, &eps, &ips)?;
    anyhow::ensure!(want.len() >= 2, "b holds one block only: {want:?}");
    eprintln!(
        "a routes b's {} blocks {took:?} after b's claims",
        want.len()
    );
    anyhow::ensure!(
        a.log().contains("went back in time"),
        "the resync did not go through the rollback path: {}",
        a.log()
    );
    anyhow::ensure!(a.cli(["verify"])?.status.success(), "no drift after resync");
    drop(b);
    Ok(())
}
