//! Pod blocks announced over BGP in cluster mode (#48: "pod blocks from
//! their holder (cluster mode)"; and one address, one owner): three
//! nodes on a real etcd (`lease_ttl` 3 s, `reclaim_after` 8 s), BIRD and
//! `lockstep bird-keeper` beside each agent, FRR on the underlay peering
//! with all three. The test samples FRR's own kernel table every 20 ms.
//!
//! - Each node's block is routed via that node only.
//! - The dangerous moment, twice at once: node-2 cut off from etcd (its
//!   agent running, its BGP session up) and node-0's agent SIGKILLed
//!   (BIRD and the keeper left running). Each node's block stays
//!   announced while the node may still hold it, and is withdrawn before
//!   a live node reclaims it (node-2's agent withdraws it itself; node-0's
//!   keeper does, from the hold the last beat carried). Node-1 then
//!   claims the freed blocks and announces them.
//! - Node-0's keeper and BIRD started afresh beside its dead agent, BIRD
//!   from a file that still names the old block: it stays withdrawn.
//! - Healed, node-2 fences its old block and never announces it again.
//! - In no sample does a block have two next hops.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use ipnet::IpNet;
use lockstep_tests::bgp::{BirdProc, Frr, Keeper, bgp_routes, bgp_routes_in, ecmp_router};
use lockstep_tests::cluster::{ClusterNodes, node_ip, poll};
use lockstep_tests::etcd::EtcdCluster;
use lockstep_tests::{Netns, TempDir, privileged, veth};

/// The router's address on the underlay.
const ROUTER: &str = "10.251.0.100";
/// `[cluster] lease_ttl` and `reclaim_after` of every node.
const LEASE_TTL: Duration = Duration::from_secs(3);
const RECLAIM_AFTER: Duration = Duration::from_secs(8);

/// The cluster pool: four blocks of 16.
const POOLS: &str = "[[pools]]\nname = \"pods\"\nipv4 = [\"10.94.0.0/26\"]\nblock_v4 = 28\n";

/// Node `i`'s `[bgp]`: its BIRD's files in `dir`, the pod pool announced.
fn section(i: usize, dir: &std::path::Path) -> String {
    let me = node_ip(i);
    format!(
        "[bgp]\nasn = 64512\nrouter_id = \"{me}\"\nbird_socket = \"{}\"\nbird_config = \"{}\"\n\
         withdraw_after = \"5s\"\n\
         [[bgp.peers]]\nname = \"tor\"\naddress = \"{ROUTER}\"\nasn = 64513\nsource = \"{me}\"\n\
         hold_time = \"9s\"\n[bgp.pools.pods]\n",
        dir.join("bird.ctl").display(),
        dir.join("bird.conf").display()
    )
}

/// The lab; fields drop in order, each daemon before its namespace.
struct Lab {
    frr: Frr,
    keepers: Vec<Keeper>,
    birds: Vec<BirdProc>,
    n: ClusterNodes,
    nb: Netns,
}

impl Lab {
    /// The lab, node `i`'s agent configured with `more(i)` after its
    /// `[bgp]` section.
    fn start(cluster: &EtcdCluster, more: &dyn Fn(usize) -> String) -> anyhow::Result<Self> {
        let dirs: Vec<TempDir> = (0..3)
            .map(|_| TempDir::new("bird"))
            .collect::<anyhow::Result<_>>()?;
        let paths: Vec<std::path::PathBuf> = dirs.iter().map(|d| d.path().to_path_buf()).collect();
        let n = ClusterNodes::build_each(
            cluster,
            "/bgp-cluster/",
            POOLS,
            &format!(
                "lease_ttl = \"{}s\"\nreclaim_after = \"{}s\"\n",
                LEASE_TTL.as_secs(),
                RECLAIM_AFTER.as_secs()
            ),
            &|i| section(i, &paths[i]) + &more(i),
            &|_| String::new(),
        )?;
        let mut birds = Vec::new();
        let mut keepers = Vec::new();
        for (i, dir) in dirs.into_iter().enumerate() {
            let file = paths[i].join("bird.conf");
            poll(Duration::from_secs(20), "the agent's BIRD file", || {
                Ok(file.exists())
            })
            .with_context(|| n.agents[i].log())?;
            birds.push(BirdProc::start_in(&n.ns[i], dir)?);
            keepers.push(Keeper::start(&n.ns[i], &n.agents[i])?);
        }
        let nb = Netns::new("bgcnb")?;
        veth(&n.underlay, "ulnb", &nb, "n0")?;
        n.underlay
            .exec("ip", ["link", "set", "ulnb", "master", "br0"])?;
        nb.ip(["addr", "add", &format!("{ROUTER}/24"), "dev", "n0"])?;
        let nodes: Vec<String> = (0..3).map(node_ip).collect();
        let frr = Frr::start(&nb, &ecmp_router(ROUTER, &nodes))?;
        Ok(Self {
            frr,
            keepers,
            birds,
            n,
            nb,
        })
    }

    /// The block etcd gives each node.
    fn holders(&self) -> anyhow::Result<BTreeMap<IpNet, usize>> {
        let mut out = BTreeMap::new();
        for i in 0..3 {
            for b in self.n.blocks_of(&format!("node-{i}"))? {
                out.insert(b, i);
            }
        }
        Ok(out)
    }

    /// Waits until the router routes exactly the blocks etcd gives the
    /// nodes in `nodes`, each via its holder only.
    fn routed_via_holders(&self, nodes: &[usize], within: Duration) -> anyhow::Result<()> {
        let mut last = String::new();
        poll(within, "every block routed via its holder", || {
            let want: BTreeMap<String, Vec<String>> = self
                .holders()?
                .into_iter()
                .filter(|(_, i)| nodes.contains(i))
                .map(|(b, i)| (b.to_string(), vec![node_ip(i)]))
                .collect();
            let got = bgp_routes(&self.nb)?;
            last = format!("router {got:?}, want {want:?}");
            Ok(got == want)
        })
        .with_context(|| last.clone())
        .with_context(|| self.logs())?;
        Ok(())
    }

    /// How many times node `i`'s session with the router came up.
    fn sessions(&self, i: usize) -> anyhow::Result<u64> {
        let n = self.frr.neighbor(&node_ip(i))?;
        n["connectionsEstablished"]
            .as_u64()
            .with_context(|| format!("no connectionsEstablished in {n}"))
    }

    /// [`Lab::sessions`] of node `i` once settled (the same 3 s apart): at
    /// start FRR may reset a session once (docs/design/bgp.md).
    fn settled(&self, i: usize) -> anyhow::Result<u64> {
        let mut count = self.sessions(i)?;
        poll(Duration::from_secs(30), "the session settled", || {
            std::thread::sleep(Duration::from_secs(3));
            let now = self.sessions(i)?;
            let same = now == count;
            count = now;
            Ok(same)
        })?;
        Ok(count)
    }

    fn logs(&self) -> String {
        let mut out = String::new();
        for i in 0..3 {
            out += &format!(
                "--- node-{i} agent ---\n{}\n--- node-{i} keeper ---\n{}\n--- node-{i} bird ---\n{}\n",
                self.n.agents[i].log(),
                self.keepers[i].log(),
                self.birds[i].log()
            );
        }
        out
    }
}

/// One lab at a time: the tests time withdrawals, and two labs on two
/// CPUs would make each other late.
static ONE_LAB: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The router's BGP routes: prefix → next hops.
type Table = BTreeMap<String, Vec<String>>;

/// Each change of the router's table, with when it was seen.
type Changes = Vec<(Duration, Table)>;

/// The router's table, sampled every 20 ms on a thread of its own: each
/// change with when it was seen, and how many samples were taken.
struct Sampler {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<(Changes, usize)>,
}

impl Sampler {
    fn start(nb: &Netns, t0: Instant) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let (s, name) = (stop.clone(), nb.name().to_string());
        let thread = std::thread::spawn(move || {
            let mut changes: Changes = Vec::new();
            let mut count = 0;
            while !s.load(Ordering::Relaxed) {
                if let Ok(now) = bgp_routes_in(&name) {
                    count += 1;
                    if changes.last().is_none_or(|(_, last)| *last != now) {
                        changes.push((t0.elapsed(), now));
                    }
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            (changes, count)
        });
        Self { stop, thread }
    }

    fn finish(self) -> (Changes, usize) {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}

/// The last moment `block` was seen routed via `hop` in `changes` (the
/// moment of the next change), if it ever was.
fn last_via(changes: &[(Duration, Table)], block: &str, hop: &str) -> Option<Duration> {
    let via = |m: &Table| m.get(block).is_some_and(|h| h.contains(&hop.to_string()));
    let last = changes.iter().rposition(|(_, m)| via(m))?;
    changes.get(last + 1).map(|(t, _)| *t)
}

#[test]
fn blocks_are_announced_by_their_holder_and_withdrawn_before_another_node_may_claim_them()
-> anyhow::Result<()> {
    privileged!();
    let _one = ONE_LAB
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let cluster = EtcdCluster::start(1)?;
    let mut lab = Lab::start(&cluster, &|_| String::new())?;
    for i in 0..3 {
        ensure!(
            lab.n.fill(i, &format!("e{i}-"), 1)? == 1,
            "node-{i} allocated nothing"
        );
    }
    lab.routed_via_holders(&[0, 1, 2], Duration::from_secs(30))?;
    let before = lab.holders()?;
    let block_of = |node: usize| {
        before
            .iter()
            .find(|(_, i)| **i == node)
            .map(|(b, _)| *b)
            .context("a node without a block")
    };
    let (b0, b2) = (block_of(0)?, block_of(2)?);
    eprintln!("blocks: {before:?}");
    let node1_sessions = lab.settled(1)?;

    // The dangerous moment: node-2 cut off from etcd, node-0's agent
    // killed, at once.
    let t0 = Instant::now();
    let sampler = Sampler::start(&lab.nb, t0);
    lab.n.cut_from_etcd(2)?;
    lab.n.agents[0].kill9();
    let mut reclaimed: BTreeMap<IpNet, Duration> = BTreeMap::new();
    let mut status_cut = String::new();
    poll(
        Duration::from_secs(40),
        "node-0's and node-2's blocks reclaimed",
        || {
            let held = lab.holders()?;
            for b in [b0, b2] {
                if !held.contains_key(&b) {
                    reclaimed.entry(b).or_insert_with(|| t0.elapsed());
                }
            }
            if status_cut.is_empty() && t0.elapsed() > RECLAIM_AFTER + Duration::from_secs(1) {
                let out = lab.n.agents[2].cli(["status"])?;
                status_cut = String::from_utf8_lossy(&out.stdout).into_owned();
            }
            Ok(reclaimed.len() == 2)
        },
    )
    .with_context(|| lab.logs())?;
    // Node-1 claims the freed blocks as it fills up, and announces them.
    let given = lab.n.fill(1, "f-", 60)?;
    let node1 = lab.n.blocks_of("node-1")?;
    eprintln!("node-1 allocated {given} more; holds {node1:?}");
    ensure!(
        node1.contains(&b0) && node1.contains(&b2),
        "node-1 holds {node1:?}, not both freed blocks {b0} and {b2}"
    );
    lab.routed_via_holders(&[1], Duration::from_secs(10))?;
    // The dangerous moment again: node-0's keeper and BIRD started
    // afresh beside its dead agent (its BGP pod restarted), BIRD from its
    // file, which still names node-0's old block. The keeper must not
    // take the dead agent's last beat for a new one: the block, node-1's
    // now, never comes back via node-0.
    let before = lab.sessions(0)?;
    lab.keepers[0] = Keeper::start(&lab.n.ns[0], &lab.n.agents[0])?;
    lab.birds[0].graceful_restart(&lab.n.ns[0])?;
    poll(Duration::from_secs(30), "node-0's session up again", || {
        Ok(lab.sessions(0)? > before)
    })
    .with_context(|| lab.logs())?;
    std::thread::sleep(Duration::from_secs(2));
    lab.routed_via_holders(&[1], Duration::from_secs(1))?;
    // Healed, node-2 fences its old block: it announces it no more.
    lab.n.heal(2)?;
    std::thread::sleep(LEASE_TTL + Duration::from_secs(2));
    lab.routed_via_holders(&[1, 2], Duration::from_secs(10))?;
    let (changes, samples) = sampler.finish();

    // Never two next hops for one block.
    for (t, m) in &changes {
        for (block, hops) in m {
            ensure!(
                hops.len() == 1,
                "{block} routed via {hops:?} at {:.2} s",
                t.as_secs_f64()
            );
        }
    }
    // Each withdrawn once its node could no longer be sure it held it,
    // and before a live node reclaimed it.
    for (b, node, how) in [(b0, 0, "agent killed"), (b2, 2, "cut off from etcd")] {
        let gone = last_via(&changes, &b.to_string(), &node_ip(node))
            .with_context(|| format!("{b} never left node-{node}: {changes:?}"))?;
        let freed = reclaimed[&b];
        eprintln!(
            "node-{node} ({how}): {b} withdrawn {:.2} s after, reclaimed {:.2} s after ({:.2} s apart)",
            gone.as_secs_f64(),
            freed.as_secs_f64(),
            (freed.saturating_sub(gone)).as_secs_f64()
        );
        ensure!(
            gone < freed,
            "{b} was still announced by node-{node} when it was reclaimed"
        );
        // Kept while the node held it: withdrawn no sooner than
        // reclaim_after after its lease's last refresh, which was less
        // than a TTL before the cut (the lease was alive). Well past the
        // 5 s `withdraw_after` of LoadBalancer routes.
        ensure!(
            gone >= RECLAIM_AFTER - LEASE_TTL,
            "{b} withdrawn {:.2} s after ({how}): before its hold ran out",
            gone.as_secs_f64()
        );
    }
    ensure!(
        status_cut.contains("bgp pod blocks withdrawn: etcd last renewed"),
        "node-2's status while cut off: {status_cut}"
    );
    ensure!(
        lab.keepers[0]
            .log()
            .contains("hold on its pod blocks ran out"),
        "node-0's keeper: {}",
        lab.keepers[0].log()
    );
    eprintln!("{samples} samples, {} changes", changes.len());
    // The live node's session was never reset through it all.
    ensure!(
        lab.sessions(1)? == node1_sessions,
        "node-1's session was reset: {node1_sessions} -> {}",
        lab.sessions(1)?
    );
    let node1_routes: BTreeSet<String> = node1.iter().map(ToString::to_string).collect();
    ensure!(
        changes
            .last()
            .is_some_and(|(_, m)| node1_routes.iter().all(|b| m[b] == [node_ip(1)])),
        "the router's last table: {:?}",
        changes.last()
    );
    Ok(())
}

/// LoadBalancer pools for the LB test, BGP only (no `announce`): `open`
/// admits every node, `zoned` only zone `a`.
const LB_POOLS: &str = r#"{"pools": [
  {"name": "open", "cidrs": ["198.51.100.0/28"], "serviceSelector": {"matchLabels": {"app": "open"}}},
  {"name": "zoned", "cidrs": ["203.0.113.0/28"], "serviceSelector": {"matchLabels": {"app": "zoned"}},
   "nodeSelector": {"matchLabels": {"zone": "a"}}}
], "services": [
  {"namespace": "shop", "name": "web", "labels": {"app": "open"}, "ports": [{"protocol": "TCP", "port": 80}]},
  {"namespace": "shop", "name": "api", "labels": {"app": "zoned"}, "ports": [{"protocol": "TCP", "port": 80}]}
]}"#;

/// `[lb] announce_lease`, and the keeper's `withdraw_after` (`section`).
const LB_LEASE: Duration = Duration::from_secs(3);
const WITHDRAW_AFTER: Duration = Duration::from_secs(5);

/// The first moment after `from` that `prefix` was seen without `hop`.
fn left_at(
    changes: &[(Duration, Table)],
    prefix: &str,
    hop: &str,
    from: Duration,
) -> Option<Duration> {
    changes
        .iter()
        .filter(|(t, _)| *t >= from)
        .find(|(_, m)| !m.get(prefix).is_some_and(|h| h.contains(&hop.to_string())))
        .map(|(t, _)| *t)
}

/// LoadBalancer addresses in cluster mode without Kubernetes: announced
/// from every node their pool admits (ECMP), withdrawn by a node cut off
/// from etcd when its LB lease runs out, and by a dead agent's keeper.
#[test]
fn lb_addresses_come_from_every_admitted_node_and_leave_with_its_lease() -> anyhow::Result<()> {
    privileged!();
    let _one = ONE_LAB
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let cluster = EtcdCluster::start(1)?;
    let zone = |i: usize| if i == 2 { "b" } else { "a" };
    let lab = Lab::start(&cluster, &|i| {
        format!(
            "[bgp.pools.open]\n[bgp.pools.zoned]\n[lb]\nannounce_lease = \"{}s\"\n\
             [cluster.node_labels]\nzone = \"{}\"\n",
            LB_LEASE.as_secs(),
            zone(i)
        )
    })?;
    let mut lab = lab;
    lab.n.agents[0].lb_apply(&serde_json::from_str(LB_POOLS)?)?;
    let address = |id: &str| -> anyhow::Result<String> {
        let v = lab.n.agents[1].json(["lb", "get", "-o", "json"])?;
        v["services"][id]["assignment"]["addresses"][0]
            .as_str()
            .map(str::to_string)
            .with_context(|| format!("{id} has no address: {v}"))
    };
    let mut web = String::new();
    let mut api = String::new();
    poll(Duration::from_secs(30), "both services assigned", || {
        web = address("shop/web").unwrap_or_default();
        api = address("shop/api").unwrap_or_default();
        Ok(!web.is_empty() && !api.is_empty())
    })?;
    let hops = |nodes: &[usize]| -> Vec<String> { nodes.iter().map(|&i| node_ip(i)).collect() };
    let want_all = |lab: &Lab, w: &[usize], a: &[usize], what: &str| -> anyhow::Result<()> {
        let mut last = String::new();
        poll(Duration::from_secs(30), what, || {
            let got = bgp_routes(&lab.nb)?;
            last = format!("router {got:?}");
            let via = |p: &str| {
                let mut h = got.get(p).cloned().unwrap_or_default();
                h.sort();
                h
            };
            Ok(via(&web) == hops(w) && via(&api) == hops(a))
        })
        .with_context(|| last.clone())
        .with_context(|| lab.logs())?;
        Ok(())
    };
    // Every admitted node announces: web from all three, api (zone a)
    // from node-0 and node-1 only.
    want_all(
        &lab,
        &[0, 1, 2],
        &[0, 1],
        "web via every node, api via zone a",
    )?;
    let status = lab.n.agents[2].json(["status", "-o", "json"])?;
    let why = status["bgp"]["withheld"][&api].as_str().unwrap_or_default();
    ensure!(
        why.contains("pool zoned's node selector does not admit this node"),
        "node-2's status does not say why api is withheld: {status}"
    );
    ensure!(
        status["bgp"]["services"]["shop/web"] == serde_json::json!([web]),
        "node-2's status does not name web's address: {status}"
    );
    let node1_sessions = lab.settled(1)?;

    // Node-2 cut off from etcd: its LB lease runs out, and it withdraws
    // its routes then; the others keep theirs.
    let t0 = Instant::now();
    let sampler = Sampler::start(&lab.nb, t0);
    lab.n.cut_from_etcd(2)?;
    want_all(
        &lab,
        &[0, 1],
        &[0, 1],
        "web no longer via the cut-off node-2",
    )?;
    let status = lab.n.agents[2].json(["status", "-o", "json"])?;
    let why = status["bgp"]["withheld"][&web].as_str().unwrap_or_default();
    ensure!(
        why.contains("LB lease in etcd is not live"),
        "node-2's status does not say why web is withdrawn: {status}"
    );
    // Node-0's agent killed: its keeper withdraws its LoadBalancer routes
    // once the beats stop for `withdraw_after`.
    let t1 = t0.elapsed();
    lab.n.agents[0].kill9();
    want_all(&lab, &[1], &[1], "web and api only via node-1")?;
    // Healed, node-2 takes a lease again and announces web again.
    lab.n.heal(2)?;
    want_all(&lab, &[1, 2], &[1], "web via node-1 and node-2 again")?;
    let (changes, samples) = sampler.finish();

    let cut = left_at(&changes, &web, &node_ip(2), Duration::ZERO)
        .with_context(|| format!("web never left node-2: {changes:?}"))?;
    let killed = left_at(&changes, &web, &node_ip(0), t1)
        .with_context(|| format!("web never left node-0: {changes:?}"))?
        .saturating_sub(t1);
    eprintln!(
        "node-2 cut off: web withdrawn {:.2} s after; node-0 killed: withdrawn {:.2} s after; {samples} samples, {} changes",
        cut.as_secs_f64(),
        killed.as_secs_f64(),
        changes.len()
    );
    ensure!(
        cut <= LB_LEASE + Duration::from_secs(2),
        "node-2 withdrew web {:.2} s after it was cut off: later than its {LB_LEASE:?} lease",
        cut.as_secs_f64()
    );
    ensure!(
        killed <= WITHDRAW_AFTER + Duration::from_secs(2),
        "node-0's keeper withdrew web {:.2} s after the kill (withdraw_after {WITHDRAW_AFTER:?})",
        killed.as_secs_f64()
    );
    // The addresses never left the router's table: some node announced
    // each at every moment.
    for (t, m) in &changes {
        for a in [&web, &api] {
            ensure!(
                m.get(a).is_some_and(|h| !h.is_empty()),
                "{a} unrouted at {:.2} s: {m:?}",
                t.as_secs_f64()
            );
        }
    }
    ensure!(
        lab.sessions(1)? == node1_sessions,
        "node-1's session was reset: {node1_sessions} -> {}",
        lab.sessions(1)?
    );
    Ok(())
}
