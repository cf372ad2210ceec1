//! The cluster door against a real 3-member etcd cluster (#12): racing
//! claims have one winner, pool applies are validated and guarded, a stale
//! give-back deletes nothing, node keys die with their lease while blocks
//! stay, and a claim without quorum fails within its bound and is settled
//! by reading back once quorum returns.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use ipnet::IpNet;
use lockstep::cluster::{Change, Claim, ClusterStoreError, Door, DoorOptions, NodeRecord};
use lockstep_core::cluster::{ClusterError, ClusterPoolSpec, validate_pools};
use lockstep_tests::etcd::EtcdCluster;

fn rt() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

fn net(s: &str) -> IpNet {
    s.parse().expect("net")
}

/// A door to `endpoints` under a prefix of its own (tests share nothing).
async fn door(endpoints: Vec<String>, prefix: &str, timeout: Duration) -> anyhow::Result<Door> {
    let mut opts = DoorOptions::new(endpoints);
    opts.prefix = prefix.to_string();
    opts.timeout = timeout;
    Ok(Door::connect(opts).await?)
}

#[test]
fn racing_claims_have_one_winner_and_the_holder_may_claim_again() -> anyhow::Result<()> {
    let cluster = EtcdCluster::start(3)?;
    let rt = rt()?;
    rt.block_on(async {
        let blocks: Vec<IpNet> = (0..24)
            .map(|i| net(&format!("10.20.{}.{}/26", i / 4, (i % 4) * 64)))
            .collect();
        let mut tasks = Vec::new();
        for (i, ep) in cluster.endpoints().into_iter().enumerate() {
            let mut d = door(vec![ep], "/race/", Duration::from_secs(2)).await?;
            let blocks = blocks.clone();
            tasks.push(tokio::spawn(async move {
                let node = format!("node-{i}");
                let mut got = Vec::new();
                for b in blocks {
                    got.push((b, d.claim_block("p", b, &node).await));
                }
                (node, got)
            }));
        }
        let mut winners: BTreeMap<IpNet, Vec<String>> = BTreeMap::new();
        let mut losers: BTreeMap<IpNet, Vec<String>> = BTreeMap::new();
        for t in tasks {
            let (node, got) = t.await?;
            for (b, claim) in got {
                match claim.with_context(|| format!("{node} claiming {b}"))? {
                    Claim::Claimed { .. } => winners.entry(b).or_default().push(node.clone()),
                    Claim::Taken { by } => losers.entry(b).or_default().push(by),
                    Claim::Unreadable { reason } => {
                        anyhow::bail!(
                            "{node} claiming {b} read its own writes as garbage: {reason}"
                        )
                    }
                }
            }
        }
        for b in &blocks {
            let w = winners.get(b).cloned().unwrap_or_default();
            ensure!(w.len() == 1, "block {b} won by {w:?}");
            let named = losers.get(b).cloned().unwrap_or_default();
            ensure!(
                named.len() == 2 && named.iter().all(|n| n == &w[0]),
                "losers of {b} were told {named:?}, the winner is {}",
                w[0]
            );
        }
        let mut d = door(cluster.endpoints(), "/race/", Duration::from_secs(2)).await?;
        let (stored, _) = d.blocks().await?;
        ensure!(stored.len() == blocks.len(), "{stored:?}");
        for s in stored.iter() {
            ensure!(winners[&s.cidr] == vec![s.node.clone()], "{s:?}");
            // The holder claiming again (a restart) gets it at its revision.
            let again = d.claim_block("p", s.cidr, &s.node).await?;
            ensure!(
                again
                    == Claim::Claimed {
                        revision: s.revision
                    },
                "re-claim of {}: {again:?}",
                s.cidr
            );
        }
        Ok(())
    })
}

#[test]
fn pool_applies_are_validated_guarded_and_keep_claimed_cidrs() -> anyhow::Result<()> {
    let cluster = EtcdCluster::start(3)?;
    let rt = rt()?;
    rt.block_on(async {
        let eps = cluster.endpoints();
        let mut d = door(eps.clone(), "/pools/", Duration::from_secs(2)).await?;
        let a = ClusterPoolSpec::new("a")
            .with_cidr(net("10.30.0.0/24"))
            .with_cidr(net("10.30.1.0/24"));
        d.apply_pools(std::slice::from_ref(&a)).await?;
        let (read, _, _) = d.pools().await?;
        ensure!(read == vec![a.clone()], "{read:?}");

        // Overlap: refused by the core, nothing written.
        let b = ClusterPoolSpec::new("b").with_cidr(net("10.30.1.128/25"));
        let err = d.apply_pools(&[a.clone(), b]).await.unwrap_err();
        ensure!(
            matches!(err, ClusterStoreError::Refused(_)),
            "overlap: {err:?}"
        );
        ensure!(
            d.pools().await?.0 == vec![a.clone()],
            "the refused apply wrote"
        );

        // A claimed block keeps its CIDR: removing it is refused, naming the
        // CIDR, the block and its node.
        let claim = d.claim_block("a", net("10.30.1.64/26"), "node-x").await?;
        ensure!(matches!(claim, Claim::Claimed { .. }), "{claim:?}");
        let shrunk = ClusterPoolSpec::new("a").with_cidr(net("10.30.0.0/24"));
        let err = d
            .apply_pools(std::slice::from_ref(&shrunk))
            .await
            .unwrap_err();
        match &err {
            ClusterStoreError::Refused(ClusterError::CidrInUse { cidr, blocks, .. }) => {
                ensure!(*cidr == net("10.30.1.0/24"), "{err}");
                ensure!(
                    blocks == &vec![(net("10.30.1.64/26"), "node-x".to_string())],
                    "{err}"
                );
            }
            other => anyhow::bail!("removing a claimed CIDR: {other:?}"),
        }
        ensure!(
            d.pools().await?.0 == vec![a.clone()],
            "the refused apply wrote"
        );

        // Racing applies of two pools over the same CIDR (each valid alone),
        // through two doors under a prefix of their own: the guard lets no
        // mix of the two be stored.
        let mut d = door(eps.clone(), "/pools-race/", Duration::from_secs(2)).await?;
        let mut d2 = door(eps.clone(), "/pools-race/", Duration::from_secs(2)).await?;
        for round in 0..10 {
            let x = vec![ClusterPoolSpec::new(format!("x{round}")).with_cidr(net("10.40.0.0/24"))];
            let y = vec![ClusterPoolSpec::new(format!("y{round}")).with_cidr(net("10.40.0.0/24"))];
            let (rx, ry) = tokio::join!(d.apply_pools(&x), d2.apply_pools(&y));
            for r in [&rx, &ry] {
                ensure!(
                    matches!(
                        r,
                        Ok(_)
                            | Err(
                                ClusterStoreError::Conflict { .. } | ClusterStoreError::Refused(_)
                            )
                    ),
                    "round {round}: {r:?}"
                );
            }
            ensure!(rx.is_ok() || ry.is_ok(), "round {round}: neither applied");
            let (now, _, _) = d.pools().await?;
            validate_pools(&now).with_context(|| format!("round {round}: stored {now:?}"))?;
            ensure!(now == x || now == y, "round {round}: stored {now:?}");
        }
        Ok(())
    })
}

#[test]
fn a_stale_give_back_deletes_nothing() -> anyhow::Result<()> {
    let cluster = EtcdCluster::start(3)?;
    let rt = rt()?;
    rt.block_on(async {
        let mut d = door(cluster.endpoints(), "/give/", Duration::from_secs(2)).await?;
        let b = net("10.50.0.0/26");
        ensure!(matches!(
            d.claim_block("p", b, "node-a").await?,
            Claim::Claimed { .. }
        ));
        let (held, _) = d.blocks().await?;
        let mine = held.first().context("the claimed block")?.clone();
        // An operator reclaims it and node-b claims it.
        let eps = cluster.endpoints();
        let eps: Vec<&str> = eps.iter().map(String::as_str).collect();
        EtcdCluster::etcdctl(&eps, &["del", "/give/blocks/p/10.50.0.0-26"])?;
        ensure!(matches!(
            d.claim_block("p", b, "node-b").await?,
            Claim::Claimed { .. }
        ));
        ensure!(
            !d.release_block(&mine).await?,
            "node-a's stale give-back deleted node-b's block"
        );
        let (now, _) = d.blocks().await?;
        ensure!(now.len() == 1 && now[0].node == "node-b", "{now:?}");
        // node-b's own give-back, at its revision, deletes it.
        ensure!(d.release_block(&now[0]).await?);
        ensure!(d.blocks().await?.0.is_empty());
        Ok(())
    })
}

#[test]
fn node_keys_die_with_their_lease_and_blocks_and_routing_keys_stay() -> anyhow::Result<()> {
    let cluster = EtcdCluster::start(3)?;
    let rt = rt()?;
    rt.block_on(async {
        let mut d = door(cluster.endpoints(), "/lease/", Duration::from_secs(2)).await?;
        let record = |name: &str| NodeRecord {
            name: name.to_string(),
            ips: vec!["192.0.2.10".parse().expect("ip")],
            version: "test".into(),
            blocks: vec![net("10.60.0.0/26")],
            in_use: 3,
            wanted: 8,
            instance: None,
        };
        let gone = d
            .register_node(
                &record("gone"),
                &["10.60.0.5".parse()?, "10.60.0.6".parse()?],
                Duration::from_secs(2),
            )
            .await?;
        let kept = d
            .register_node(&record("kept"), &[], Duration::from_secs(2))
            .await?;
        ensure!(matches!(
            d.claim_block("p", net("10.60.0.0/26"), "gone").await?,
            Claim::Claimed { .. }
        ));
        let names = |nodes: &[lockstep::cluster::Node]| -> BTreeSet<String> {
            nodes.iter().map(|n| n.record.name.clone()).collect()
        };
        let listed = d.nodes().await?;
        ensure!(names(&listed) == BTreeSet::from(["gone".into(), "kept".into()]));
        ensure!(
            listed
                .iter()
                .any(|n| n.record == record("gone") && n.lease == gone)
        );
        // `kept` is refreshed, `gone` is not: only `gone` expires.
        let started = Instant::now();
        loop {
            ensure!(d.keep_alive(kept).await?, "a live lease was not refreshed");
            let now = names(&d.nodes().await?);
            if now == BTreeSet::from(["kept".to_string()]) {
                break;
            }
            ensure!(
                started.elapsed() < Duration::from_secs(10),
                "gone's key outlived its lease: {now:?}"
            );
            tokio::time::sleep(Duration::from_millis(400)).await;
        }
        ensure!(!d.keep_alive(gone).await?, "an expired lease was refreshed");
        // The block outlives the lease.
        let (blocks, _) = d.blocks().await?;
        ensure!(
            blocks.len() == 1 && blocks[0].node == "gone",
            "the block went with the lease: {blocks:?}"
        );
        // So does the routing key (#26 item 9): the others keep routing
        // `gone`'s block to its address. Removing the node takes both.
        let addrs = d.routing_keys().await?;
        ensure!(
            addrs
                .iter()
                .any(|(a, _)| a.name == "gone" && a.ips == record("gone").ips),
            "the routing key went with the lease: {addrs:?}"
        );
        // Its lease gone is not enough (#26 item 2): until a live node
        // records since when, and that is reclaim_after old, a removal
        // without --force is refused.
        let refused = d.remove_node("gone", false).await;
        ensure!(
            refused
                .as_ref()
                .is_err_and(|e| e.to_string().contains("not recorded yet")),
            "{refused:?}"
        );
        let (rec, rev) = d
            .routing_keys()
            .await?
            .iter()
            .find(|(r, _)| r.name == "gone")
            .cloned()
            .context("routing key")?;
        let mark = lockstep_core::cluster::GoneMark {
            since_ms: 1,
            reclaim_after_ms: 0,
        };
        ensure!(d.mark_gone(&rec, rev, mark).await?, "the first mark lost");
        ensure!(!d.mark_gone(&rec, rev, mark).await?, "a second mark won");
        let removed = d.remove_node("gone", false).await?;
        ensure!(removed.freed.len() == 1, "{removed:?}");
        ensure!(
            removed.removal == lockstep_core::cluster::Removal::Due,
            "{removed:?}"
        );
        let reserved: Vec<String> = d
            .reservations()
            .await?
            .iter()
            .flat_map(|(r, _)| r.addresses.iter().map(move |a| format!("{a} {}", r.name)))
            .collect();
        ensure!(
            reserved == ["10.60.0.5 gone", "10.60.0.6 gone"],
            "{reserved:?}"
        );
        ensure!(
            d.release_reserved(&["10.60.0.7".parse()?]).await.is_err(),
            "an address not reserved was released"
        );
        d.release_reserved(&["10.60.0.5".parse()?, "10.60.0.6".parse()?])
            .await?;
        ensure!(d.reservations().await?.is_empty());
        let addrs = d.routing_keys().await?;
        ensure!(
            addrs.iter().all(|(a, _)| a.name != "gone"),
            "node remove left the routing key: {addrs:?}"
        );
        ensure!(d.blocks().await?.0.is_empty());
        Ok(())
    })
}

#[test]
fn without_quorum_a_claim_fails_in_bound_and_settles_by_reading_back() -> anyhow::Result<()> {
    let mut cluster = EtcdCluster::start(3)?;
    let rt = rt()?;
    let bound = Duration::from_secs(1);
    let b = net("10.70.0.0/26");
    let last = cluster.endpoint(2).to_string();
    rt.block_on(async {
        let mut d = door(vec![last.clone()], "/quorum/", bound).await?;
        ensure!(d.blocks().await?.0.is_empty());
        Ok::<_, anyhow::Error>(())
    })?;
    cluster.stop_member(0);
    cluster.stop_member(1);
    let err = rt.block_on(async {
        let mut d = door(vec![last.clone()], "/quorum/", bound).await?;
        let started = Instant::now();
        let r = d.claim_block("p", b, "node-a").await;
        // The claim and its read-back, each bounded.
        ensure!(
            started.elapsed() < 2 * bound + Duration::from_millis(500),
            "took {:?}",
            started.elapsed()
        );
        Ok::<_, anyhow::Error>(r)
    })?;
    match err {
        Err(ClusterStoreError::Unavailable {
            maybe_written,
            what,
            ..
        }) => {
            ensure!(
                maybe_written,
                "a claim without an answer must count as maybe written: {what}"
            );
        }
        other => anyhow::bail!("claim without quorum: {other:?}"),
    }
    cluster.start_member(0)?;
    cluster.start_member(1)?;
    for i in 0..3 {
        cluster.wait_healthy(i, Duration::from_secs(30))?;
    }
    rt.block_on(async {
        let mut d = door(cluster.endpoints(), "/quorum/", Duration::from_secs(2)).await?;
        let started = Instant::now();
        // Whether or not the timed-out claim committed, claiming again
        // settles it: ours, once.
        let claim = loop {
            match d.claim_block("p", b, "node-a").await {
                Ok(c) => break c,
                Err(e) => ensure!(
                    started.elapsed() < Duration::from_secs(15),
                    "no claim after quorum returned: {e}"
                ),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        ensure!(matches!(claim, Claim::Claimed { .. }), "{claim:?}");
        let (blocks, _) = d.blocks().await?;
        ensure!(
            blocks.len() == 1 && blocks[0].node == "node-a",
            "{blocks:?}"
        );
        Ok(())
    })
}

/// Collects changes from `w` until one satisfies `want` (5 s at most).
async fn wait_change(
    w: &mut lockstep::cluster::Watch,
    what: &str,
    want: impl Fn(&Change) -> bool,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let batch = tokio::time::timeout(left, w.next())
            .await
            .with_context(|| format!("no change {what} within 5 s"))??;
        if batch.iter().any(&want) {
            return Ok(());
        }
    }
}

#[test]
fn watches_follow_every_change_and_compaction_forces_a_resync() -> anyhow::Result<()> {
    let cluster = EtcdCluster::start(3)?;
    let rt = rt()?;
    rt.block_on(async {
        let eps = cluster.endpoints();
        let mut a = door(eps.clone(), "/watch/", Duration::from_secs(2)).await?;
        let mut b = door(eps.clone(), "/watch/", Duration::from_secs(2)).await?;
        let (_, read_at) = a.blocks().await?;
        let mut w = a.watch(read_at + 1).await?;

        let x = net("10.80.0.0/26");
        ensure!(matches!(
            b.claim_block("p", x, "node-b").await?,
            Claim::Claimed { .. }
        ));
        wait_change(&mut w, "claim", |c| {
            matches!(c, Change::Block { cidr, node: Some(n), .. } if *cidr == x && n == "node-b")
        })
        .await?;
        let (held, _) = b.blocks().await?;
        ensure!(b.release_block(&held[0]).await?);
        wait_change(
            &mut w,
            "give-back",
            |c| matches!(c, Change::Block { cidr, node: None, .. } if *cidr == x),
        )
        .await?;
        let rec = NodeRecord {
            name: "node-b".into(),
            ips: vec!["192.0.2.11".parse()?],
            version: "test".into(),
            blocks: Vec::new(),
            in_use: 0,
            wanted: 0,
            instance: None,
        };
        b.register_node(&rec, &[], Duration::from_secs(5)).await?;
        wait_change(
            &mut w,
            "node",
            |c| matches!(c, Change::Node { record: Some(r), .. } if *r == rec),
        )
        .await?;
        let spec = ClusterPoolSpec::new("p").with_cidr(net("10.80.0.0/24"));
        b.apply_pools(std::slice::from_ref(&spec)).await?;
        wait_change(
            &mut w,
            "pool",
            |c| matches!(c, Change::Pool { spec: Some(s), .. } if *s == spec),
        )
        .await?;
        ensure!(w.resume_from() > read_at + 1, "resume point never moved");

        // History compacted past a watcher's revision: it is told to resync.
        let (_, now) = a.blocks().await?;
        let eps_ref: Vec<&str> = eps.iter().map(String::as_str).collect();
        EtcdCluster::etcdctl(&eps_ref, &["compact", &now.to_string()])?;
        let mut stale = a.watch(read_at + 1).await?;
        match tokio::time::timeout(Duration::from_secs(5), stale.next()).await? {
            Err(ClusterStoreError::Compacted { compacted }) => {
                ensure!(compacted >= now, "compacted at {compacted}, asked {now}");
            }
            other => anyhow::bail!("a watch below the compaction: {other:?}"),
        }
        // The resync: read the state, watch from after the read.
        let (blocks, at) = a.blocks().await?;
        ensure!(blocks.is_empty(), "{blocks:?}");
        let mut fresh = a.watch(at + 1).await?;
        let y = net("10.80.0.64/26");
        ensure!(matches!(
            b.claim_block("p", y, "node-b").await?,
            Claim::Claimed { .. }
        ));
        wait_change(
            &mut fresh,
            "claim after resync",
            |c| matches!(c, Change::Block { cidr, .. } if *cidr == y),
        )
        .await
    })
}

/// `lockstep cluster --etcd URLS ... ARGS`: exit status, stdout, stderr.
fn cli(eps: &[String], args: &[&str]) -> anyhow::Result<(bool, String, String)> {
    let out = std::process::Command::new(lockstep_tests::lockstep_bin())
        .args(["cluster", "--etcd", &eps.join(","), "--prefix", "/cli/"])
        .args(args)
        .output()?;
    Ok((
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

#[test]
fn the_cluster_cli_applies_pools_lists_blocks_and_nodes_and_removes_nodes() -> anyhow::Result<()> {
    let cluster = EtcdCluster::start(3)?;
    let eps = cluster.endpoints();
    let dir = lockstep_tests::TempDir::new("cluster-cli")?;
    let file = dir.path().join("pools.toml");
    std::fs::write(
        &file,
        "[[pools]]\nname = \"default\"\nipv4 = [\"10.90.0.0/24\"]\nipv6 = [\"fd00:90::/120\"]\n",
    )?;
    let f = file.display().to_string();
    let (ok, out, err) = cli(&eps, &["pools", "apply", "-f", &f, "-o", "json"])?;
    ensure!(ok, "apply: {out}{err}");
    let (ok, out, err) = cli(&eps, &["pools", "get", "-o", "json"])?;
    ensure!(ok, "get: {err}");
    let pools: serde_json::Value = serde_json::from_str(&out)?;
    ensure!(
        pools[0]["name"] == "default" && pools[0]["ipv4"][0] == "10.90.0.0/24",
        "{pools}"
    );
    // A bad file names what is wrong and changes nothing.
    std::fs::write(
        &file,
        "[[pools]]\nname = \"bad\"\nipv4 = [\"10.90.0.1/24\"]\n",
    )?;
    let (ok, out, err) = cli(&eps, &["pools", "apply", "-f", &f, "--prune"])?;
    ensure!(!ok && err.contains("10.90.0.1/24"), "bad CIDR: {out}{err}");
    let (_, after, _) = cli(&eps, &["pools", "get", "-o", "json"])?;
    ensure!(
        serde_json::from_str::<serde_json::Value>(&after)? == pools,
        "{after}"
    );
    // A file that leaves a stored pool out (an empty list here) would
    // drain it: refused without --prune, naming it, nothing changed
    // (#45 item 7).
    std::fs::write(&file, "pools = []\n")?;
    let (ok, out, err) = cli(&eps, &["pools", "apply", "-f", &f])?;
    ensure!(
        !ok && err.contains("leaves out the stored pools default") && err.contains("--prune"),
        "an apply draining every pool: {out}{err}"
    );
    let (_, after, _) = cli(&eps, &["pools", "get", "-o", "json"])?;
    ensure!(
        serde_json::from_str::<serde_json::Value>(&after)? == pools,
        "{after}"
    );

    let rt = rt()?;
    rt.block_on(async {
        let mut d = door(eps.clone(), "/cli/", Duration::from_secs(2)).await?;
        d.claim_block("default", net("10.90.0.64/26"), "node-a")
            .await?;
        d.register_node(
            &NodeRecord {
                name: "node-a".into(),
                ips: vec!["192.0.2.20".parse()?],
                version: "test".into(),
                blocks: vec![net("10.90.0.64/26")],
                in_use: 1,
                wanted: 2,
                instance: None,
            },
            &["10.90.0.70".parse()?],
            Duration::from_secs(30),
        )
        .await?;
        Ok::<_, anyhow::Error>(())
    })?;
    let (ok, out, _) = cli(&eps, &["blocks", "-o", "json"])?;
    let blocks: serde_json::Value = serde_json::from_str(&out)?;
    ensure!(
        ok && blocks[0]["cidr"] == "10.90.0.64/26" && blocks[0]["node"] == "node-a",
        "{blocks}"
    );
    let (ok, out, _) = cli(&eps, &["nodes", "-o", "json"])?;
    let nodes: serde_json::Value = serde_json::from_str(&out)?;
    ensure!(ok && nodes[0]["node"]["name"] == "node-a", "{nodes}");
    // A node etcd has nothing of (a mistyped name): an error naming it,
    // forced or not, and nothing changes (#26 item 2).
    for args in [
        &["node", "remove", "node-aa"][..],
        &["node", "remove", "node-aa", "--force"][..],
    ] {
        let (ok, out, err) = cli(&eps, args)?;
        ensure!(
            !ok && err.contains("no node node-aa in etcd"),
            "{args:?} of an unknown node: {out}{err}"
        );
    }
    let (_, out, _) = cli(&eps, &["blocks", "-o", "json"])?;
    ensure!(serde_json::from_str::<serde_json::Value>(&out)? == blocks);
    // Alive: refused, nothing freed; forced: its block is free.
    let (ok, out, err) = cli(&eps, &["node", "remove", "node-a"])?;
    ensure!(
        !ok && err.contains("node-a"),
        "removing a live node: {out}{err}"
    );
    let (_, out, _) = cli(&eps, &["blocks", "-o", "json"])?;
    ensure!(serde_json::from_str::<serde_json::Value>(&out)? == blocks);
    let (ok, out, err) = cli(&eps, &["node", "remove", "node-a", "--force"])?;
    ensure!(
        ok && out.contains("10.90.0.64/26"),
        "forced removal: {out}{err}"
    );
    // Forced, it says what it risks and names the addresses the node
    // last published as in use, which stay reserved until released.
    ensure!(
        out.contains("may still be serving its blocks") && out.contains("10.90.0.70"),
        "forced removal: {out}"
    );
    let (ok, out, err) = cli(&eps, &["addresses"])?;
    ensure!(
        ok && out.trim() == "10.90.0.70\tnode-a",
        "addresses: {out}{err}"
    );
    let (ok, out, err) = cli(&eps, &["addresses", "release", "10.90.0.71"])?;
    ensure!(
        !ok && err.contains("10.90.0.71 is not reserved"),
        "released an address not reserved: {out}{err}"
    );
    let (ok, out, err) = cli(&eps, &["addresses", "release", "10.90.0.70"])?;
    ensure!(ok && out.contains("released 10.90.0.70"), "{out}{err}");
    let (_, out, _) = cli(&eps, &["addresses", "-o", "json"])?;
    ensure!(out.trim() == "[]", "reserved left: {out}");
    let (_, out, _) = cli(&eps, &["blocks", "-o", "json"])?;
    ensure!(out.trim() == "[]", "blocks left: {out}");
    let (_, out, _) = cli(&eps, &["nodes", "-o", "json"])?;
    ensure!(out.trim() == "[]", "node left: {out}");
    Ok(())
}

/// #45 item 7: inside the agent's pod, `lockstep cluster ...` needs no
/// flags: the endpoints, prefix and TLS files come from the agent's config
/// (`--config`, default /etc/lockstep/config.toml). A config without
/// `[cluster]` is named.
#[test]
fn the_cluster_cli_takes_etcd_from_the_agents_config() -> anyhow::Result<()> {
    let cluster = EtcdCluster::start(1)?;
    let eps = cluster.endpoints();
    let dir = lockstep_tests::TempDir::new("cluster-config")?;
    let pools = dir.path().join("pools.toml");
    std::fs::write(
        &pools,
        "[[pools]]\nname = \"pods\"\nipv4 = [\"10.91.0.0/24\"]\n",
    )?;
    let (ok, out, err) = cli(
        &eps,
        &["pools", "apply", "-f", &pools.display().to_string()],
    )?;
    ensure!(ok, "apply: {out}{err}");
    let (_, by_flags, _) = cli(&eps, &["pools", "get", "-o", "json"])?;
    let config = dir.path().join("config.toml");
    std::fs::write(
        &config,
        format!(
            "[cluster]\netcd = [{}]\nprefix = \"/cli/\"\nnode_ip_v4 = \"192.0.2.1\"\n",
            eps.iter()
                .map(|e| format!("\"{e}\""))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    )?;
    let run = |config: &std::path::Path| -> anyhow::Result<std::process::Output> {
        Ok(std::process::Command::new(lockstep_tests::lockstep_bin())
            .args(["cluster", "--config"])
            .arg(config)
            .args(["pools", "get", "-o", "json"])
            .output()?)
    };
    let out = run(&config)?;
    ensure!(
        out.status.success() && String::from_utf8_lossy(&out.stdout) == by_flags,
        "pools get from the config: {out:?}, by flags: {by_flags}"
    );
    std::fs::write(&config, "reconcile_interval = \"5s\"\n")?;
    let out = run(&config)?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(
        !out.status.success() && err.contains("has no [cluster] section") && err.contains("--etcd"),
        "a config without [cluster]: {err}"
    );
    Ok(())
}

/// #26 item 13: 2,000 pools in one apply exceed etcd's operations per
/// transaction (`--max-txn-ops`, 128 by default). The CLI used to say
/// "etcd unavailable, the write may still commit"; it must say what etcd
/// refused, that nothing was written, and answer at once.
#[test]
fn the_cli_names_what_etcd_refused() -> anyhow::Result<()> {
    let cluster = EtcdCluster::start(3)?;
    let eps = cluster.endpoints();
    let dir = lockstep_tests::TempDir::new("cluster-refused")?;
    let file = dir.path().join("pools.toml");
    std::fs::write(
        &file,
        "[[pools]]\nname = \"first\"\nipv4 = [\"10.80.0.0/24\"]\n",
    )?;
    let f = file.display().to_string();
    let (ok, out, err) = cli(&eps, &["pools", "apply", "-f", &f])?;
    ensure!(ok, "apply: {out}{err}");
    let (_, before, _) = cli(&eps, &["pools", "get", "-o", "json"])?;

    let mut many = String::from("default_pool = \"p0\"\n");
    for i in 0..2000u32 {
        let base = u32::from(std::net::Ipv4Addr::new(10, 81, 0, 0)) + i * 64;
        many.push_str(&format!(
            "[[pools]]\nname = \"p{i}\"\nipv4 = [\"{}/26\"]\n",
            std::net::Ipv4Addr::from(base)
        ));
    }
    std::fs::write(&file, many)?;
    let started = Instant::now();
    let (ok, out, err) = cli(&eps, &["pools", "apply", "-f", &f, "--prune"])?;
    let took = started.elapsed();
    eprintln!("2,000 pools: {took:?}: {err}");
    ensure!(!ok, "2,000 pools applied in one transaction: {out}");
    ensure!(
        err.contains("etcd refused apply pools (2000 pools")
            && err.contains("too many operations in txn request")
            && err.contains("nothing was written"),
        "the refusal is not named: {err}"
    );
    ensure!(
        !err.contains("unavailable") && !err.contains("may still commit"),
        "a refusal reported as an outage: {err}"
    );
    ensure!(took < Duration::from_secs(2), "answered after {took:?}");
    let (_, after, _) = cli(&eps, &["pools", "get", "-o", "json"])?;
    ensure!(after == before, "something was stored: {after}");
    Ok(())
}
