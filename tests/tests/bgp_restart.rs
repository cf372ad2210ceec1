//! A planned BIRD restart keeps the node's routes at the router (#48 item
//! 3: "a planned daemon restart uses graceful restart, with the BFD
//! interplay configured so routes are not flushed").
//!
//! BIRD, configured by core `bgp::render_bird` (graceful restart on every
//! session, BFD), peers with FRR, a graceful-restart helper whose BFD
//! checks for control-plane failure (`bfd check-control-plane-failure`):
//! BIRD's BFD runs in its control plane (it sends C = 0), so when BFD goes
//! down with BIRD during a graceful restart, FRR keeps the routes as
//! stale instead of flushing them. `birdc graceful restart`, then BIRD
//! started again with `-R` (docs/bgp.md): the route is sampled in FRR's
//! kernel table every 10 ms throughout, and is never missing.
//!
//! Against a router that is no graceful-restart helper, the same restart
//! flushes the route: the second half shows graceful restart is what
//! keeps it.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use lockstep_core::bgp::{Announcements, BfdSpec, BgpSpec, PeerSpec, RouteAttrs, render_bird};
use lockstep_tests::bgp::{Lab, bgp_routes};
use lockstep_tests::privileged;

/// The router's graceful-restart helper settings.
const HELPER: &str = " bgp graceful-restart\n";
/// And BFD that lets a control-plane restart through.
const INTERPLAY: &str = " neighbor {node} bfd check-control-plane-failure\n";

const ROUTE: &str = "198.51.100.9";

fn lab(router_extra: &str) -> anyhow::Result<Lab> {
    Lab::new_with(1, 64513, router_extra, |links| {
        let (node, router) = &links[0];
        let spec = BgpSpec {
            asn: 64512,
            router_id: Ipv4Addr::new(10, 251, 0, 1),
            peers: vec![PeerSpec {
                name: "tor-0".into(),
                address: router.parse()?,
                asn: 64513,
                source: Some(node.parse()?),
                bfd: true,
                hold_time_s: 9,
            }],
            bfd: BfdSpec::default(),
            graceful_restart_s: 120,
        };
        let routes: Announcements = [(
            format!("{ROUTE}/32").parse().context("prefix")?,
            RouteAttrs::default(),
        )]
        .into();
        Ok(render_bird(&spec, &routes, &Announcements::new())?)
    })
}

/// Restarts BIRD gracefully while sampling the router's table; how many
/// samples lacked the route, of how many, and how long until the session
/// was up again.
fn restart_sampled(lab: &mut Lab) -> anyhow::Result<(usize, usize, Duration)> {
    lab.settled(0)?;
    lab.routes_become(0, &[ROUTE], Duration::from_secs(10))?;
    let router = &lab.routers[0].ns;
    let done = std::sync::atomic::AtomicBool::new(false);
    let (missing, total, back) = std::thread::scope(|scope| -> anyhow::Result<_> {
        let sampler = scope.spawn(|| -> anyhow::Result<(usize, usize)> {
            let (mut missing, mut total) = (0, 0);
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                total += 1;
                if !bgp_routes(router)?.contains_key(ROUTE) {
                    missing += 1;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Ok((missing, total))
        });
        // Disjoint fields of the lab: BIRD restarted, the router's BFD
        // read, its table sampled.
        let r = &lab.routers[0];
        let sessions = |r: &lockstep_tests::bgp::Router| -> anyhow::Result<u64> {
            let n = r.frr.neighbor(&r.node_addr)?;
            n["connectionsEstablished"]
                .as_u64()
                .with_context(|| format!("no connectionsEstablished in {n}"))
        };
        let before = sessions(r)?;
        let started = Instant::now();
        let run = lab.bird.graceful_restart(&lab.node).and_then(|()| {
            // A new session up (and BFD with it), and a few seconds more
            // for the router to replace its stale route.
            loop {
                let out = r
                    .frr
                    .vtysh(&format!("show bfd peer {} json", r.node_addr))?;
                let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
                if sessions(r)? > before
                    && v.get("status").and_then(serde_json::Value::as_str) == Some("up")
                {
                    break;
                }
                ensure!(
                    started.elapsed() < Duration::from_secs(30),
                    "the session never came back: {out}"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
            let back = started.elapsed();
            std::thread::sleep(Duration::from_secs(3));
            Ok(back)
        });
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        let (missing, total) = sampler
            .join()
            .map_err(|_| anyhow::anyhow!("the sampler panicked"))??;
        Ok((missing, total, run?))
    })?;
    Ok((missing, total, back))
}

#[test]
fn a_graceful_bird_restart_keeps_the_route_at_the_router_with_bfd() -> anyhow::Result<()> {
    privileged!();
    let mut kept = lab(&format!("{HELPER}{INTERPLAY}"))?;
    let (missing, total, back) = restart_sampled(&mut kept)?;
    eprintln!(
        "graceful restart, router checks control-plane failure: session back in {back:?}, \
         route missing in {missing} of {total} samples"
    );
    ensure!(
        missing == 0,
        "the route left the router in {missing} of {total} samples:\n{}",
        kept.bird.log()
    );
    kept.routes_become(0, &[ROUTE], Duration::ZERO)?;
    // And the restarted BIRD (started with -R) announced it again: the
    // router's path is no longer the stale one it kept.
    let started = Instant::now();
    loop {
        let out = kept.routers[0]
            .frr
            .vtysh(&format!("show bgp ipv4 unicast {ROUTE}/32 json"))?;
        let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
        let paths = v["paths"].as_array().cloned().unwrap_or_default();
        if !paths.is_empty() && paths.iter().all(|p| p.get("stale").is_none()) {
            eprintln!(
                "the route announced afresh {:?} after the session came back",
                started.elapsed()
            );
            break;
        }
        ensure!(
            started.elapsed() < Duration::from_secs(30),
            "the router still holds only the stale path: {out}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(kept);

    // The same restart against a router that is no graceful-restart
    // helper: the route is flushed while BIRD is away. Graceful restart
    // is what keeps it.
    let mut flushed = lab(" bgp graceful-restart-disable\n")?;
    let (missing, total, _) = restart_sampled(&mut flushed)?;
    eprintln!(
        "the same restart, the router no graceful-restart helper: route missing in {missing} of {total} samples"
    );
    ensure!(
        missing > 0,
        "without graceful restart at the router the route was never flushed: the test shows nothing"
    );
    Ok(())
}
