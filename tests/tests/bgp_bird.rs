//! lockstep driving BIRD against a real peer router (#48, first part): a
//! node namespace runs BIRD with the configuration core `bgp` writes,
//! applied through lockstep's door (`lockstep::bgp::Bird`); a neighbour
//! namespace runs FRR (bgpd, bfdd, zebra), and the test reads the routes
//! FRR installed in that namespace's kernel table.
//!
//! Shown here: an announced address reaches the peer's table with the
//! node as next hop, and nothing reaches the node's own kernel table; announcements added and withdrawn by a configure
//! never reset the session; a configuration BIRD refuses changes nothing
//! (the running one and its file stay); and a link cut without a TCP
//! close (every packet dropped at the peer) is withdrawn by BFD within a
//! second, over ten cuts.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use lockstep_core::bgp::{Announcements, BfdSpec, BgpSpec, PeerSpec, RouteAttrs, render_bird};
use lockstep_tests::bgp::{Lab, announce};

/// The node's speaker: one peer per link, with BFD, AS `asns[i]` on link
/// i (the routers are AS 64513).
fn spec(links: &[(String, String)], asns: &[u32]) -> anyhow::Result<BgpSpec> {
    let mut peers = Vec::new();
    for (i, ((node, router), asn)) in links.iter().zip(asns).enumerate() {
        peers.push(PeerSpec {
            name: format!("tor-{i}"),
            address: router.parse()?,
            asn: *asn,
            source: Some(node.parse()?),
            bfd: true,
            hold_time_s: 9,
        });
    }
    Ok(BgpSpec {
        asn: 64512,
        router_id: Ipv4Addr::new(10, 251, 0, 1),
        peers,
        bfd: BfdSpec::default(),
        graceful_restart_s: 120,
    })
}

/// The node and one router, announcing `routes`.
fn one_router(routes: &Announcements) -> anyhow::Result<(Lab, BgpSpec)> {
    let mut s = None;
    let lab = Lab::new(1, 64513, |links| {
        let spec = spec(links, &[64513])?;
        let text = render_bird(&spec, routes, &Announcements::new())?;
        s = Some(spec);
        Ok(text)
    })?;
    Ok((lab, s.context("no spec")?))
}

#[test]
fn announcements_reach_the_peer_and_change_without_a_session_reset() -> anyhow::Result<()> {
    lockstep_tests::privileged!();
    let (lab, spec) = one_router(&announce(&["198.51.100.7/32"]))?;
    lab.routes_become(0, &["198.51.100.7/32"], Duration::from_secs(30))?;
    let established = lab.settled(0)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let bird = lab.bird.door();
    // Two more addresses, then one withdrawn: each a configure.
    let steps: [&[&str]; 3] = [
        &["198.51.100.7/32", "198.51.100.8/32", "198.51.100.9/32"],
        &["198.51.100.7/32", "198.51.100.9/32"],
        &["198.51.100.9/32"],
    ];
    for step in steps {
        rt.block_on(bird.apply(&render_bird(&spec, &announce(step), &Announcements::new())?))?;
        lab.routes_become(0, step, Duration::from_secs(10))?;
    }
    // A configuration BIRD refuses: an error naming BIRD's reason, the
    // running configuration and its file unchanged.
    let before = std::fs::read_to_string(bird.config_path())?;
    let bad = format!("{before}\nprotocol bgp broken {{ neighbor as; }}\n");
    let e = rt
        .block_on(bird.apply(&bad))
        .expect_err("BIRD took a broken configuration");
    eprintln!("refused: {e}");
    ensure!(e.to_string().contains("syntax error"), "{e}");
    ensure!(
        std::fs::read_to_string(bird.config_path())? == before,
        "the file changed"
    );
    lab.routes_become(0, &["198.51.100.9/32"], Duration::from_secs(5))?;
    let sessions = rt.block_on(bird.protocols())?;
    ensure!(
        sessions
            .iter()
            .any(|p| p.name == "peer_tor_0" && p.established()),
        "{sessions:?}"
    );
    // BIRD installs nothing in the node's kernel: the BPF datapath is
    // the only forwarder.
    for family in ["-4", "-6"] {
        let routes = lab.node.ip([family, "route", "show", "table", "all"])?;
        ensure!(
            !routes.contains("198.51.100.") && !routes.contains("proto bird"),
            "BIRD touched the node's routes:\n{routes}"
        );
    }
    let after = lab.established_count(0)?;
    ensure!(
        after == established,
        "the session came up {after} times, {established} before three configures (a reset)"
    );
    Ok(())
}

#[test]
fn a_link_cut_without_a_close_is_withdrawn_by_bfd_within_a_second() -> anyhow::Result<()> {
    lockstep_tests::privileged!();
    let (lab, _) = one_router(&announce(&["198.51.100.7/32"]))?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let bird = lab.bird.door();
    let mut took = Vec::new();
    for run in 0..10 {
        lab.routes_become(0, &["198.51.100.7/32"], Duration::from_secs(30))
            .with_context(|| format!("run {run}: before the cut"))?;
        lab.bfd_up(0, Duration::from_secs(10))?;
        let started = Instant::now();
        lab.routers[0].cut()?;
        let gone = lab.routes_become(0, &[], Duration::from_secs(15));
        let elapsed = started.elapsed();
        lab.routers[0].uncut()?;
        gone.with_context(|| format!("run {run}: after the cut"))?;
        took.push(elapsed);
        // BIRD waits ever longer before trying a session that keeps
        // failing (a flapping link is damped, up to a minute): each run
        // starts the session at once, as an operator's restart does.
        rt.block_on(bird.command("restart peer_tor_0"))?;
    }
    took.sort();
    let p50 = lockstep_tests::pct(&took, 0.5);
    let max = took[took.len() - 1];
    eprintln!("withdrawn after a cut: p50 {p50:?}, p99 (the slowest of 10) {max:?}; all {took:?}");
    // BFD: 3 × 100 ms; without it, the 9 s hold time.
    ensure!(
        max <= Duration::from_secs(1),
        "withdrawn after {max:?}: {took:?}"
    );
    Ok(())
}

/// Every form the configuration takes parses in BIRD itself (`bird -p`):
/// both families, peers with and without BFD, a source address, no hold
/// time, and every route attribute.
#[test]
fn every_form_of_the_configuration_parses_in_bird() -> anyhow::Result<()> {
    let links = [("10.251.0.1".to_string(), "10.251.0.2".to_string())];
    let mut s = spec(&links, &[64513])?;
    s.peers.push(PeerSpec {
        name: "tor-v6".into(),
        address: "2001:db8::fe".parse()?,
        asn: 64512,
        source: None,
        bfd: false,
        hold_time_s: 0,
    });
    let mut routes = announce(&["198.51.100.7/32", "10.64.0.0/26", "2001:db8:5::7/128"]);
    routes.insert(
        "2001:db8:6::/64".parse()?,
        RouteAttrs {
            communities: [(64512, 100), (65535, 666)].into(),
            large_communities: [(64512, 1, 2)].into(),
            local_pref: Some(200),
        },
    );
    let dir = lockstep_tests::TempDir::new("birdparse")?;
    for (name, routes) in [("empty", Announcements::new()), ("full", routes)] {
        let file = dir.path().join(format!("{name}.conf"));
        // The pod blocks' protocols as full as the LoadBalancer ones.
        std::fs::write(&file, render_bird(&s, &routes, &routes)?)?;
        lockstep_tests::sh("bird", ["-p", "-c", &file.display().to_string()])
            .with_context(|| format!("the {name} configuration"))?;
    }
    Ok(())
}

/// A peer refusing the session (this node has the wrong AS number for
/// it) is named with BIRD's reason and takes nothing from the other
/// peer; correcting it in a configure brings its session up and leaves
/// the other's alone.
#[test]
fn a_refused_session_is_named_and_its_repair_resets_no_other() -> anyhow::Result<()> {
    lockstep_tests::privileged!();
    let routes = announce(&["198.51.100.7/32"]);
    let mut links = Vec::new();
    let lab = Lab::new(2, 64513, |l| {
        links = l.to_vec();
        Ok(render_bird(
            &spec(l, &[64513, 64599])?,
            &routes,
            &Announcements::new(),
        )?)
    })?;
    lab.routes_become(0, &["198.51.100.7/32"], Duration::from_secs(30))?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let bird = lab.bird.door();
    // tor-1 is refused, named, while tor-0 is up. (tor-0 may be reset
    // once in its first second, the start-up reset docs/design/bgp.md
    // records: it is waited for, not taken as a failure.)
    let started = Instant::now();
    let problem = loop {
        let sessions = rt.block_on(bird.protocols())?;
        let of = |name: &str| sessions.iter().find(|p| p.name == name).cloned();
        let (a, b) = (of("peer_tor_0"), of("peer_tor_1"));
        let up = a.as_ref().is_some_and(lockstep::bgp::Protocol::established);
        if up && let Some(p) = b.as_ref().and_then(lockstep::bgp::Protocol::problem) {
            break p;
        }
        ensure!(
            started.elapsed() < Duration::from_secs(20),
            "tor-1's refusal was never named with tor-0 up: {sessions:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    eprintln!("tor-1: {problem}");
    ensure!(problem.contains("Bad peer AS"), "{problem}");
    ensure!(
        lab.routes_become(1, &[], Duration::from_secs(1)).is_ok(),
        "tor-1 has routes from a refused session"
    );
    // Corrected: tor-1 comes up, tor-0's session stays the one it had.
    let before = lab.settled(0)?;
    rt.block_on(bird.apply(&render_bird(
        &spec(&links, &[64513, 64513])?,
        &routes,
        &Announcements::new(),
    )?))?;
    lab.routes_become(1, &["198.51.100.7/32"], Duration::from_secs(30))?;
    lab.routes_become(0, &["198.51.100.7/32"], Duration::from_secs(1))?;
    let after = lab.established_count(0)?;
    ensure!(
        after == before,
        "tor-0's session came up {before} then {after} times: repairing tor-1 reset it"
    );
    Ok(())
}
