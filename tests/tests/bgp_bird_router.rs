//! The node's BIRD against a second kind of router (#48 "Show it with":
//! "one run with BIRD or gobgpd"): here the peer router is BIRD itself,
//! importing what the node announces and exporting it into its own
//! namespace's kernel table, which the test reads (`proto bird`).
//!
//! - Announcements configured through lockstep's door reach the router's
//!   table with the node as next hop, and leave it when withdrawn, the
//!   session up throughout (session resets are counted against FRR, whose
//!   counters say so: `bgp_bird`).
//! - A link cut without a TCP close is withdrawn by BFD within a second.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use lockstep_core::bgp::{Announcements, BfdSpec, BgpSpec, PeerSpec, render_bird};
use lockstep_tests::bgp::{BirdProc, announce};
use lockstep_tests::{Netns, privileged};

const NODE: &str = "10.251.7.1";
const ROUTER: &str = "10.251.7.2";

/// The peer router's BIRD: AS 64513, BFD at 100 ms × 3, everything the
/// node sends imported and written to the kernel.
fn router_config() -> String {
    format!(
        "router id {ROUTER};\n\
         protocol device {{ scan time 10; }}\n\
         protocol kernel {{ ipv4 {{ import none; export all; }}; }}\n\
         protocol bfd {{ interface \"*\" {{ min rx interval 100 ms; min tx interval 100 ms; multiplier 3; }}; }}\n\
         protocol bgp node {{\n  local {ROUTER} as 64513;\n  neighbor {NODE} as 64512;\n  \
         hold time 9;\n  bfd on;\n  ipv4 {{ import all; export none; }};\n}}\n"
    )
}

fn node_spec() -> anyhow::Result<BgpSpec> {
    Ok(BgpSpec {
        asn: 64512,
        router_id: NODE.parse::<Ipv4Addr>()?,
        peers: vec![PeerSpec {
            name: "tor-0".into(),
            address: ROUTER.parse()?,
            asn: 64513,
            source: Some(NODE.parse()?),
            bfd: true,
            hold_time_s: 9,
        }],
        bfd: BfdSpec::default(),
        graceful_restart_s: 120,
    })
}

/// The routes BIRD wrote into `ns`'s kernel: prefix → next hop.
fn kernel_routes(ns: &Netns) -> anyhow::Result<BTreeMap<String, String>> {
    let text = ns.ip(["-4", "route", "show", "proto", "bird"])?;
    Ok(text
        .lines()
        .filter_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            let via = w.iter().position(|x| *x == "via")?;
            Some((w[0].to_string(), w.get(via + 1)?.to_string()))
        })
        .collect())
}

/// Waits until the router's kernel holds exactly `want`, each via the
/// node; how long it took.
fn routes_become(ns: &Netns, want: &[&str], within: Duration) -> anyhow::Result<Duration> {
    let want: BTreeMap<String, String> = want
        .iter()
        .map(|p| (p.to_string(), NODE.to_string()))
        .collect();
    let started = Instant::now();
    loop {
        let got = kernel_routes(ns)?;
        if got == want {
            return Ok(started.elapsed());
        }
        if started.elapsed() > within {
            bail!("the router's kernel holds {got:?}, not {want:?}, after {within:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Whether the router's session to the node is established.
fn established(router: &BirdProc) -> anyhow::Result<bool> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let protocols = rt.block_on(router.door().protocols())?;
    Ok(protocols
        .iter()
        .any(|p| p.name == "node" && p.established()))
}

#[test]
fn bird_as_the_router_learns_withdraws_and_sees_a_cut_through_bfd() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("bgpn")?;
    let router_ns = Netns::new("bgpr")?;
    lockstep_tests::veth(&node, "up0", &router_ns, "down0")?;
    node.ip(["addr", "add", &format!("{NODE}/30"), "dev", "up0"])?;
    router_ns.ip(["addr", "add", &format!("{ROUTER}/30"), "dev", "down0"])?;
    let router = BirdProc::start(&router_ns, &router_config())?;
    let spec = node_spec()?;
    let bird = BirdProc::start(
        &node,
        &render_bird(
            &spec,
            &announce(&["198.51.100.7/32"]),
            &Announcements::new(),
        )?,
    )?;
    let r = scenario(&router_ns, &bird, &router, &spec);
    if r.is_err() {
        eprintln!(
            "--- node bird ---\n{}\n--- router bird ---\n{}",
            bird.log(),
            router.log()
        );
    }
    r
}

fn scenario(
    router_ns: &Netns,
    bird: &BirdProc,
    router: &BirdProc,
    spec: &BgpSpec,
) -> anyhow::Result<()> {
    let took = routes_become(router_ns, &["198.51.100.7"], Duration::from_secs(30))?;
    eprintln!("BIRD router: the first route in its kernel {took:?} after start");
    // Let the session settle (a reset at start is BFD's, as with FRR).
    std::thread::sleep(Duration::from_secs(3));
    ensure!(established(router)?, "the router's session is not up");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let door = bird.door();
    for step in [
        &["198.51.100.7/32", "198.51.100.8/32"][..],
        &["198.51.100.8/32"][..],
    ] {
        rt.block_on(door.apply(&render_bird(spec, &announce(step), &Announcements::new())?))?;
        let want: Vec<&str> = step.iter().map(|p| p.trim_end_matches("/32")).collect();
        let took = routes_become(router_ns, &want, Duration::from_secs(10))?;
        eprintln!("BIRD router: {want:?} in its kernel {took:?} after the configure");
    }
    ensure!(established(router)?, "a configure took the session down");
    // A cut that sends no TCP close: every packet from the node dropped
    // at the router.
    let dir = lockstep_tests::TempDir::new("bgpcut")?;
    let rules = dir.path().join("cut.nft");
    std::fs::write(
        &rules,
        format!(
            "table inet lockstep_cut {{\n chain in {{ type filter hook input priority 0; ip saddr {NODE} drop; }}\n \
             chain out {{ type filter hook output priority 0; ip daddr {NODE} drop; }}\n}}\n"
        ),
    )?;
    let started = Instant::now();
    router_ns.exec("nft", ["-f", &rules.display().to_string()])?;
    let gone = routes_become(router_ns, &[], Duration::from_secs(15));
    let elapsed = started.elapsed();
    router_ns.exec("nft", ["delete", "table", "inet", "lockstep_cut"])?;
    gone.context("after the cut")?;
    eprintln!("BIRD router: the cut withdrawn after {elapsed:?} (BFD 100 ms x 3)");
    ensure!(
        elapsed <= Duration::from_secs(1),
        "withdrawn {elapsed:?} after the cut"
    );
    Ok(())
}
