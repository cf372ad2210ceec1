//! Peers as `BGPPeer` objects, with node selectors, and per-node
//! overrides from Node annotations (#48 item 2): three node namespaces,
//! each with an agent under `[kubernetes]` whose `[bgp]` names no peer,
//! and BIRD beside it; FRR in the neighbour accepts sessions from the
//! segment (dynamic neighbours). The test reads FRR's own view of each
//! session.
//!
//! - A `BGPPeer` selecting `rack=r1` is peered with by node-0 and node-1
//!   only; a Service's route comes from those two.
//! - node-1 annotated with another AS number peers in that AS.
//! - node-2 labelled into the rack, with a router ID and a source address
//!   from annotations, peers from that address with that router ID.
//! - A second object for the same router is refused, named in `lockstep
//!   status`, and resets no session.
//! - An agent restarted sends the router nothing and keeps its session.
//! - The object deleted: every session goes down.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use lockstep_tests::bgp::{KubeBirds, bgp_routes};
use lockstep_tests::cluster::node_ip;
use lockstep_tests::lb_lab::NB_V4;
use lockstep_tests::{privileged, wait_for};
use serde_json::{Value, json};

/// node-2's second address, its source by annotation.
const SOURCE: &str = "10.251.0.50";
/// node-2's router ID by annotation.
const ROUTER_ID: &str = "10.255.0.2";

/// The lab (`KubeBirds`), with this test's reading of the router.
struct PeersLab(KubeBirds);

impl std::ops::Deref for PeersLab {
    type Target = KubeBirds;
    fn deref(&self) -> &KubeBirds {
        &self.0
    }
}

impl std::ops::DerefMut for PeersLab {
    fn deref_mut(&mut self) -> &mut KubeBirds {
        &mut self.0
    }
}

/// Node `i`'s `[bgp]`: no peer (the objects give them), pool `public`.
fn section(dir: &std::path::Path) -> String {
    format!(
        "node_wait = \"2s\"\n[bgp]\nasn = 64512\n\
         bird_socket = \"{}\"\nbird_config = \"{}\"\n[bgp.pools.public]\n",
        dir.join("bird.ctl").display(),
        dir.join("bird.conf").display()
    )
}

/// FRR: AS 64513, accepting a session from any address of the segment in
/// any other AS, ECMP.
fn frr_config() -> String {
    format!(
        "frr defaults datacenter\n!\nrouter bgp 64513\n bgp router-id {NB_V4}\n \
         no bgp ebgp-requires-policy\n neighbor nodes peer-group\n \
         neighbor nodes remote-as external\n neighbor nodes timers 3 9\n \
         bgp listen range 10.251.0.0/24 peer-group nodes\n \
         address-family ipv4 unicast\n  maximum-paths 8\n exit-address-family\n!\n"
    )
}

impl PeersLab {
    fn start() -> anyhow::Result<Self> {
        let lab = KubeBirds::start(
            [json!({"rack": "r1"}), json!({"rack": "r1"}), json!({})],
            &section,
            &frr_config(),
        )?;
        lab.k.lab.ns[2].exec("ip", ["addr", "add", &format!("{SOURCE}/24"), "dev", "u0"])?;
        lab.k
            .pool("public", json!({"cidrs": ["198.51.100.0/28"]}))?;
        Ok(Self(lab))
    }

    /// FRR's sessions: peer address → (state, remote AS, times
    /// established).
    fn sessions(&self) -> anyhow::Result<BTreeMap<String, (String, u64, u64)>> {
        let out = self.frr.vtysh("show bgp ipv4 unicast summary json")?;
        let v: Value = serde_json::from_str(&out).with_context(|| format!("vtysh said {out}"))?;
        Ok(v["peers"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(addr, p)| {
                (
                    addr.clone(),
                    (
                        p["state"].as_str().unwrap_or_default().to_string(),
                        p["remoteAs"].as_u64().unwrap_or(0),
                        p["connectionsEstablished"].as_u64().unwrap_or(0),
                    ),
                )
            })
            .collect())
    }

    /// The addresses FRR has an established session with, and their AS.
    fn established(&self) -> anyhow::Result<BTreeMap<String, u64>> {
        Ok(self
            .sessions()?
            .into_iter()
            .filter(|(_, (state, _, _))| state == "Established")
            .map(|(a, (_, asn, _))| (a, asn))
            .collect())
    }

    /// Waits until the established sessions are `want` (address → AS),
    /// at most `within`; how long it took.
    fn wait_established(&self, want: &[(&str, u64)], within: Duration) -> anyhow::Result<Duration> {
        let want: BTreeMap<String, u64> =
            want.iter().map(|(a, n)| ((*a).to_string(), *n)).collect();
        let started = Instant::now();
        loop {
            let got = self.established()?;
            if got == want {
                return Ok(started.elapsed());
            }
            if started.elapsed() > within {
                bail!(
                    "sessions {got:?}, not {want:?}, after {within:?}\n{}",
                    self.logs().join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn annotate(&self, node: usize, annotations: Value) -> anyhow::Result<()> {
        self.k.api.patch(
            "nodes",
            "",
            &format!("node-{node}"),
            &json!({"metadata": {"annotations": annotations}}),
            false,
        )?;
        Ok(())
    }
}

fn peer(name: &str, selector: Value) -> Value {
    json!({
        "apiVersion": "lockstep.io/v1alpha1", "kind": "BGPPeer",
        "metadata": {"name": name},
        "spec": {"address": NB_V4.to_string(), "asn": 64513, "nodeSelector": selector,
                 "bfd": false, "holdTimeSeconds": 9},
    })
}

#[test]
fn peers_follow_their_objects_and_each_node_s_annotations() -> anyhow::Result<()> {
    privileged!();
    let mut lab = PeersLab::start()?;
    let r = scenario(&mut lab);
    if r.is_err() {
        for l in lab.logs() {
            eprintln!("{l}");
        }
    }
    r
}

fn scenario(lab: &mut PeersLab) -> anyhow::Result<()> {
    let (n0, n1) = (node_ip(0), node_ip(1));
    // No object yet: no session.
    std::thread::sleep(Duration::from_secs(2));
    ensure!(
        lab.established()?.is_empty(),
        "sessions without a BGPPeer: {:?}",
        lab.sessions()?
    );

    // The rack's router: node-0 and node-1 peer, node-2 does not.
    lab.k.api.create(
        "bgppeers",
        "",
        &peer("tor-r1", json!({"matchLabels": {"rack": "r1"}})),
    )?;
    let took = lab.wait_established(
        &[(n0.as_str(), 64512), (n1.as_str(), 64512)],
        Duration::from_secs(30),
    )?;
    eprintln!("BGPPeer created: node-0 and node-1 established {took:?} later");
    let web = lab.k.create_service("shop", "web", "Cluster")?;
    wait_for(
        "the route from node-0 and node-1",
        Duration::from_secs(10),
        || {
            let hops = bgp_routes(&lab.k.lab.nb).ok()?.remove(&web.to_string())?;
            let mut hops: Vec<String> = hops;
            hops.sort();
            (hops == [n0.clone(), n1.clone()]).then_some(())
        },
    )?;

    // node-1 in another AS, by annotation.
    lab.annotate(1, json!({"bgp.lockstep.io/asn": "64600"}))?;
    lab.wait_established(
        &[(n0.as_str(), 64512), (n1.as_str(), 64600)],
        Duration::from_secs(30),
    )?;

    // node-2 joins the rack, with its own router ID and source address.
    lab.annotate(
        2,
        json!({"bgp.lockstep.io/router-id": ROUTER_ID, "bgp.lockstep.io/source-address": SOURCE}),
    )?;
    lab.k.api.patch(
        "nodes",
        "",
        "node-2",
        &json!({"metadata": {"labels": {"rack": "r1"}}}),
        false,
    )?;
    lab.wait_established(
        &[(n0.as_str(), 64512), (n1.as_str(), 64600), (SOURCE, 64512)],
        Duration::from_secs(30),
    )?;
    let n2 = lab.frr.neighbor(SOURCE)?;
    ensure!(
        n2["remoteRouterId"] == ROUTER_ID,
        "node-2's router ID at FRR: {}",
        n2["remoteRouterId"]
    );
    eprintln!("node-2 peers from {SOURCE} with router ID {ROUTER_ID}; node-1 in AS 64600");

    // A second object for the same router: refused, named, nothing reset.
    let before = lab.sessions()?;
    lab.k
        .api
        .create("bgppeers", "", &peer("tor-again", json!({})))?;
    let named = wait_for(
        "node-0 to name the refused object",
        Duration::from_secs(10),
        || {
            let status = lab.k.lab.agents[0].json(["status", "-o", "json"]).ok()?;
            status["bgp"]["refused"]["BGPPeer tor-again"]
                .as_str()
                .map(str::to_string)
        },
    )?;
    ensure!(
        named.contains("another peer's address"),
        "node-0 says of tor-again: {named}"
    );
    let text = String::from_utf8(lab.k.lab.agents[0].cli(["status"])?.stdout)?;
    ensure!(
        text.contains("bgp refused BGPPeer tor-again:"),
        "status:\n{text}"
    );
    std::thread::sleep(Duration::from_secs(2));
    ensure!(
        lab.sessions()? == before,
        "the refused object changed the sessions: {before:?} -> {:?}",
        lab.sessions()?
    );

    // node-0's agent restarted: not one update, the session kept.
    let updates = |lab: &PeersLab| -> anyhow::Result<u64> {
        let n = lab.frr.neighbor(&n0)?;
        n["messageStats"]["updatesRecv"]
            .as_u64()
            .with_context(|| format!("no updatesRecv in {n}"))
    };
    let (u_before, s_before) = (updates(lab)?, lab.sessions()?);
    let took = lab.k.lab.agents[0].restart()?;
    std::thread::sleep(Duration::from_secs(3));
    let (u_after, s_after) = (updates(lab)?, lab.sessions()?);
    eprintln!("node-0's agent restarted in {took:?}: updates {u_before} -> {u_after}");
    ensure!(
        u_after == u_before && s_after == s_before,
        "an agent restart reached the router: updates {u_before} -> {u_after}, sessions {s_before:?} -> {s_after:?}"
    );

    // Both objects deleted: every node ends its session.
    lab.k.api.delete("bgppeers", "", "tor-again")?;
    lab.k.api.delete("bgppeers", "", "tor-r1")?;
    let took = lab.wait_established(&[], Duration::from_secs(15))?;
    eprintln!("BGPPeers deleted: every session down {took:?} later");
    Ok(())
}
