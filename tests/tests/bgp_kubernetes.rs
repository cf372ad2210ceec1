//! BGP under Kubernetes (#48 items 2 and 5, "Show it with"): three node
//! namespaces on one segment, each running an agent with `[kubernetes]`
//! (no etcd: the LB writer elected on a Lease) and `[bgp]`, and BIRD
//! beside it; a neighbour runs FRR peering with all three, with ECMP; the
//! project's API double serves the Services, EndpointSlices and Nodes.
//! The test reads FRR's own kernel table.
//!
//! - A `Cluster` Service's address is learned with one next hop per node.
//! - A `Local` Service's next hops are the nodes with a ready endpoint,
//!   and follow them through a rolling update (new pod on another node
//!   ready, the old one terminating, then gone) without the route ever
//!   missing from the router's table.
//! - A node labelled excluded from external load balancers withdraws its
//!   next hop.
//! - Each node's podCIDR (`[kubernetes] pod_cidr_pool`) is learned with
//!   that node as its one next hop, and stays when the node is excluded
//!   (pod blocks route to pods, not to Services).
//! - Each node's `BGPNodeState` object says which Services it announces,
//!   its session and its pod block, and why it withholds an address.
//! - None of it resets a session.
//! - An agent restarted (an upgrade) sends the router nothing: no update,
//!   not even while it reads the API again.
//! - No node's config names a router ID: each is its Node's InternalIP.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use lockstep_tests::bgp::{KubeBirds, bgp_routes};
use lockstep_tests::cluster::node_ip;
use lockstep_tests::etcd::EtcdCluster;
use lockstep_tests::kube_lab::{Ep, KubeLab, pod_cidr};
use lockstep_tests::lb_lab::NB_V4;
use lockstep_tests::{privileged, wait_for};
use serde_json::{Value, json};

const NS: &str = "shop";
const EXCLUDE: &str = "node.kubernetes.io/exclude-from-external-load-balancers";

/// The lab (`KubeBirds`), with this test's reading of the router.
struct BgpLab(KubeBirds);

impl std::ops::Deref for BgpLab {
    type Target = KubeBirds;
    fn deref(&self) -> &KubeBirds {
        &self.0
    }
}

impl std::ops::DerefMut for BgpLab {
    fn deref_mut(&mut self) -> &mut KubeBirds {
        &mut self.0
    }
}

/// Node `i`'s `[bgp]`: peering with the neighbour, pool `public` and
/// the pod pool made of the Node's podCIDR announced. No router ID nor source address: the Node's InternalIP
/// stands in for the one, BIRD picks the other; only BIRD's files differ
/// from node to node here (in a pod they are the same path).
fn section(dir: &std::path::Path) -> String {
    format!(
        "node_wait = \"2s\"\npod_cidr_pool = \"pods\"\n[bgp]\nasn = 64512\n\
         bird_socket = \"{}\"\nbird_config = \"{}\"\n\
         [[bgp.peers]]\nname = \"tor\"\naddress = \"{NB_V4}\"\nasn = 64513\n\
         hold_time = \"9s\"\n[bgp.pools.public]\n[bgp.pools.pods]\n",
        dir.join("bird.ctl").display(),
        dir.join("bird.conf").display()
    )
}

/// FRR in the neighbour: AS 64513, one eBGP session with BFD per node,
/// ECMP over all of them.
fn frr_config() -> String {
    lockstep_tests::bgp::ecmp_router(&NB_V4.to_string(), &(0..3).map(node_ip).collect::<Vec<_>>())
}

/// Node `i`'s `[bgp]` in cluster mode: as [`section`], pool `public`
/// only (the pod blocks come from etcd).
fn cluster_section(dir: &std::path::Path) -> String {
    format!(
        "node_wait = \"2s\"\n[bgp]\nasn = 64512\n\
         bird_socket = \"{}\"\nbird_config = \"{}\"\n\
         [[bgp.peers]]\nname = \"tor\"\naddress = \"{NB_V4}\"\nasn = 64513\n\
         hold_time = \"9s\"\n[bgp.pools.public]\n",
        dir.join("bird.ctl").display(),
        dir.join("bird.conf").display()
    )
}

/// One lab at a time: the tests time withdrawals, and two labs on two
/// CPUs would make each other late.
static ONE_LAB: std::sync::Mutex<()> = std::sync::Mutex::new(());

impl BgpLab {
    fn start() -> anyhow::Result<Self> {
        let lab = KubeBirds::start([json!({}), json!({}), json!({})], &section, &frr_config())?;
        lab.k
            .pool("public", json!({"cidrs": ["198.51.100.0/28"]}))?;
        Ok(Self(lab))
    }

    /// As [`BgpLab::start`], the agents in cluster mode on `cluster`.
    fn start_cluster(cluster: &EtcdCluster) -> anyhow::Result<Self> {
        let labels = [json!({}), json!({}), json!({})];
        let lab = KubeBirds::start_cluster(
            cluster,
            "/bgp-kube-cluster/",
            labels,
            &cluster_section,
            &frr_config(),
        )?;
        lab.k
            .pool("public", json!({"cidrs": ["198.51.100.0/28"]}))?;
        Ok(Self(lab))
    }

    /// `r`, every log printed first when it failed.
    fn told(&self, r: anyhow::Result<()>) -> anyhow::Result<()> {
        if r.is_err() {
            for l in self.logs() {
                eprintln!("{l}");
            }
        }
        r
    }

    /// How many times each node's session came up, once all have
    /// settled: BFD up on every one, and the counts the same 3 s later
    /// (a session may reset once at start: docs/design/bgp.md).
    fn settled(&self) -> anyhow::Result<Vec<u64>> {
        let started = Instant::now();
        loop {
            let before = self.established()?;
            let bfd = self.bfd_up()?;
            std::thread::sleep(Duration::from_secs(3));
            if bfd && self.established()? == before && before.iter().all(|c| *c > 0) {
                return Ok(before);
            }
            if started.elapsed() > Duration::from_secs(60) {
                bail!("the sessions never settled: {:?}", self.logs());
            }
        }
    }

    fn established(&self) -> anyhow::Result<Vec<u64>> {
        (0..3)
            .map(|i| {
                let n = self.frr.neighbor(&node_ip(i))?;
                Ok(n.get("connectionsEstablished")
                    .and_then(Value::as_u64)
                    .unwrap_or(0))
            })
            .collect()
    }

    fn bfd_up(&self) -> anyhow::Result<bool> {
        for i in 0..3 {
            let out = self
                .frr
                .vtysh(&format!("show bfd peer {} json", node_ip(i)))?;
            let v: Value = serde_json::from_str(&out).unwrap_or_default();
            if v.get("status").and_then(Value::as_str) != Some("up") {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// The router's next hops for `prefix` (an address: its host
    /// route), as node indexes.
    fn next_hops(&self, prefix: impl std::fmt::Display) -> anyhow::Result<BTreeSet<usize>> {
        let routes = bgp_routes(&self.k.lab.nb)?;
        Ok(routes
            .get(&prefix.to_string())
            .into_iter()
            .flatten()
            .filter_map(|hop| (0..3).find(|i| node_ip(*i) == *hop))
            .collect())
    }

    /// Waits until the router's next hops for `addr` (or a prefix) are
    /// `want`, at most `within`; how long it took.
    fn wait_hops(
        &self,
        addr: impl std::fmt::Display,
        want: &[usize],
        within: Duration,
    ) -> anyhow::Result<Duration> {
        let want: BTreeSet<usize> = want.iter().copied().collect();
        let started = Instant::now();
        loop {
            let got = self.next_hops(&addr)?;
            if got == want {
                return Ok(started.elapsed());
            }
            if started.elapsed() > within {
                bail!(
                    "{addr}: next hops {got:?}, not {want:?}, after {within:?}\n{}",
                    self.logs().join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Labels node `node` excluded from external load balancers.
fn exclude(k: &KubeLab, node: usize) -> anyhow::Result<()> {
    k.api.patch(
        "nodes",
        "",
        &format!("node-{node}"),
        &json!({"metadata": {"labels": {EXCLUDE: "true"}}}),
        false,
    )?;
    Ok(())
}

/// Why node `node` does not announce `addr`, as its status says (empty:
/// it does).
fn withheld(k: &KubeLab, node: usize, addr: IpAddr) -> anyhow::Result<String> {
    let status = k.lab.agents[node].json(["status", "-o", "json"])?;
    Ok(status["bgp"]["withheld"][addr.to_string()]
        .as_str()
        .unwrap_or_default()
        .to_string())
}

fn create_service(k: &KubeLab, name: &str, policy: &str) -> anyhow::Result<IpAddr> {
    k.create_service(NS, name, policy)
}

fn set_slice(k: &KubeLab, svc: &str, eps: &[Ep]) -> anyhow::Result<()> {
    k.set_slice(NS, svc, eps)
}

#[test]
fn next_hops_follow_the_nodes_that_may_serve_and_the_endpoints() -> anyhow::Result<()> {
    privileged!();
    let _one = ONE_LAB
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut lab = BgpLab::start()?;
    let r = scenario(&lab).and_then(|()| upgrade(&mut lab));
    lab.told(r)
}

fn scenario(lab: &BgpLab) -> anyhow::Result<()> {
    let k = &lab.k;
    let sessions = lab.settled()?;

    // Each node's podCIDR, from that node alone.
    for i in 0..3 {
        lab.wait_hops(pod_cidr(i), &[i], Duration::from_secs(10))?;
    }

    // Cluster: every node announces; the router spreads over all three.
    let plain = create_service(k, "plain", "Cluster")?;
    let took = lab.wait_hops(plain, &[0, 1, 2], Duration::from_secs(10))?;
    eprintln!("Cluster Service {plain}: three next hops {took:?} after its address");

    // Local: only the node with the ready endpoint.
    let web = create_service(k, "web", "Local")?;
    set_slice(k, "web", &[(0, true, true, false)])?;
    lab.wait_hops(web, &[0], Duration::from_secs(10))?;

    // A rolling update from node-0 to node-1, the route sampled all the
    // while: it must never leave the router's table.
    let steps: [&[Ep]; 4] = [
        // The new pod scheduled on node-1, not ready yet.
        &[(0, true, true, false), (1, false, false, false)],
        // Ready: both nodes serve.
        &[(0, true, true, false), (1, true, true, false)],
        // The old one terminating (serving through its grace period).
        &[(0, false, true, true), (1, true, true, false)],
        // Gone.
        &[(1, true, true, false)],
    ];
    let want: [&[usize]; 4] = [&[0], &[0, 1], &[1], &[1]];
    let done = std::sync::atomic::AtomicBool::new(false);
    let samples = std::thread::scope(|scope| -> anyhow::Result<Vec<(Instant, BTreeSet<usize>)>> {
        let sampler = scope.spawn(|| -> anyhow::Result<Vec<(Instant, BTreeSet<usize>)>> {
            let mut out = Vec::new();
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                out.push((Instant::now(), lab.next_hops(web)?));
                std::thread::sleep(Duration::from_millis(10));
            }
            Ok(out)
        });
        let run = (|| -> anyhow::Result<()> {
            for (eps, hops) in steps.iter().zip(want) {
                set_slice(k, "web", eps)?;
                lab.wait_hops(web, hops, Duration::from_secs(10))?;
                std::thread::sleep(Duration::from_millis(500));
            }
            Ok(())
        })();
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        let samples = sampler
            .join()
            .map_err(|_| anyhow::anyhow!("the sampler panicked"))??;
        run.map(|()| samples)
    })?;
    let missing: Vec<_> = samples.iter().filter(|(_, h)| h.is_empty()).collect();
    ensure!(
        missing.is_empty(),
        "the Local Service's route left the router {} times in {} samples during the rolling update",
        missing.len(),
        samples.len()
    );
    eprintln!(
        "rolling update: {} samples of the router's table, the route present in every one",
        samples.len()
    );

    // Node-2 excluded from external load balancers: it withdraws.
    exclude(k, 2)?;
    let took = lab.wait_hops(plain, &[0, 1], Duration::from_secs(10))?;
    eprintln!("node-2 excluded: its next hop withdrawn {took:?} after the label");
    lab.wait_hops(web, &[1], Duration::ZERO)?;
    // Its pod block stays announced.
    lab.wait_hops(pod_cidr(2), &[2], Duration::ZERO)?;
    // Each node says why it does not announce an address.
    let why = |node: usize, addr: IpAddr| withheld(k, node, addr);
    let excluded = why(2, plain)?;
    ensure!(
        excluded.contains(EXCLUDE),
        "node-2 on {plain}: {excluded:?}"
    );
    let local = why(0, web)?;
    ensure!(
        local.contains("externalTrafficPolicy is Local"),
        "node-0 on {web}: {local:?}"
    );
    ensure!(why(1, web)?.is_empty(), "node-1 announces {web}");

    // Each node's BGPNodeState in the API server: which Services it
    // announces, its session, its pod block.
    let announces = |node: usize| -> Option<BTreeMap<String, Vec<String>>> {
        let st = k
            .api
            .get("bgpnodestates", "", &format!("node-{node}"))
            .ok()?;
        let st = &st["status"];
        (st["sessionsUp"] == "1/1" && st["blocks"] == json!([pod_cidr(node)])).then_some(())?;
        Some(
            st["services"]
                .as_array()?
                .iter()
                .map(|s| {
                    let addrs = s["addresses"].as_array().into_iter().flatten();
                    (
                        s["service"].as_str().unwrap_or_default().to_string(),
                        addrs
                            .filter_map(|a| a.as_str().map(str::to_string))
                            .collect(),
                    )
                })
                .collect(),
        )
    };
    let (p, w) = (plain.to_string(), web.to_string());
    let want: [BTreeMap<String, Vec<String>>; 3] = [
        [(format!("{NS}/plain"), vec![p.clone()])].into(),
        [
            (format!("{NS}/plain"), vec![p]),
            (format!("{NS}/web"), vec![w]),
        ]
        .into(),
        BTreeMap::new(),
    ];
    for (node, want) in want.iter().enumerate() {
        wait_for(
            &format!("node-{node}'s BGPNodeState to say {want:?}"),
            Duration::from_secs(10),
            || (announces(node).as_ref() == Some(want)).then_some(()),
        )
        .with_context(|| {
            format!(
                "{:?}",
                k.api.get("bgpnodestates", "", &format!("node-{node}"))
            )
        })?;
    }
    let excluded = k.api.get("bgpnodestates", "", "node-2")?;
    ensure!(
        excluded["status"]["withheld"][plain.to_string()]
            .as_str()
            .unwrap_or_default()
            .contains(EXCLUDE),
        "node-2's BGPNodeState: {excluded}"
    );

    // None of it reset a session.
    let now = lab.established()?;
    ensure!(
        now == sessions,
        "sessions reset: connectionsEstablished {sessions:?} -> {now:?}"
    );
    let routes: BTreeMap<String, Vec<String>> = bgp_routes(&k.lab.nb)?;
    ensure!(
        routes.len() == 5,
        "the router holds {routes:?}, not the two Services' routes and three pod blocks"
    );
    Ok(())
}

/// Node-0's agent killed and started again: the router's update count
/// from node-0 does not move, nor does its session.
fn upgrade(lab: &mut BgpLab) -> anyhow::Result<()> {
    let updates = |lab: &BgpLab| -> anyhow::Result<(u64, u64)> {
        let n = lab.frr.neighbor(&node_ip(0))?;
        Ok((
            n["messageStats"]["updatesRecv"]
                .as_u64()
                .with_context(|| format!("no messageStats.updatesRecv in {n}"))?,
            n["connectionsEstablished"].as_u64().unwrap_or(0),
        ))
    };
    let before = updates(lab)?;
    let took = lab.k.lab.agents[0].restart()?;
    // Past a round of every loop the agent starts (and the speaker's).
    std::thread::sleep(Duration::from_secs(3));
    let after = updates(lab)?;
    eprintln!(
        "node-0's agent restarted in {took:?}: (updates, sessions) at the router {before:?} -> {after:?}"
    );
    ensure!(
        after == before,
        "an agent restart reached the router: (updates, sessions) {before:?} -> {after:?}"
    );
    Ok(())
}

/// Cluster mode under Kubernetes: the same rules from the Services, their
/// endpoints and the Nodes, and a node cut off from etcd withdraws its
/// LoadBalancer routes when its LB lease runs out.
#[test]
fn in_cluster_mode_next_hops_follow_the_same_rules_and_the_lb_lease() -> anyhow::Result<()> {
    privileged!();
    let _one = ONE_LAB
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let cluster = EtcdCluster::start(1)?;
    let lab = BgpLab::start_cluster(&cluster)?;
    let r = in_cluster_mode(&lab);
    lab.told(r)
}

fn in_cluster_mode(lab: &BgpLab) -> anyhow::Result<()> {
    let k = &lab.k;
    let sessions = lab.settled()?;
    // Cluster: every node; Local: the node with the ready endpoint.
    let plain = create_service(k, "plain", "Cluster")?;
    lab.wait_hops(plain, &[0, 1, 2], Duration::from_secs(10))?;
    let web = create_service(k, "web", "Local")?;
    set_slice(k, "web", &[(1, true, true, false)])?;
    lab.wait_hops(web, &[1], Duration::from_secs(10))?;
    // Excluded from external load balancers: node-2 withdraws.
    exclude(k, 2)?;
    lab.wait_hops(plain, &[0, 1], Duration::from_secs(10))?;
    let why = |node: usize, addr: IpAddr| withheld(k, node, addr);
    ensure!(why(2, plain)?.contains(EXCLUDE), "node-2 on {plain}");
    ensure!(
        why(0, web)?.contains("externalTrafficPolicy is Local"),
        "node-0 on {web}"
    );
    // Node-0 cut off from etcd: its LB lease runs out (3 s) and it
    // withdraws; the API server still answers it.
    k.lab.cuts[0].set(true);
    let took = lab.wait_hops(plain, &[1], Duration::from_secs(10))?;
    eprintln!("node-0 cut off from etcd: its next hop withdrawn {took:?} after");
    ensure!(
        took <= Duration::from_secs(5),
        "node-0 withdrew {plain} {took:?} after the cut: later than its 3 s LB lease"
    );
    let cut = why(0, plain)?;
    ensure!(
        cut.contains("LB lease in etcd is not live"),
        "node-0 on {plain} while cut off: {cut:?}"
    );
    lab.wait_hops(web, &[1], Duration::ZERO)?;
    k.lab.cuts[0].set(false);
    lab.wait_hops(plain, &[0, 1], Duration::from_secs(15))?;
    let now = lab.established()?;
    ensure!(
        now == sessions,
        "sessions reset: connectionsEstablished {sessions:?} -> {now:?}"
    );
    Ok(())
}
