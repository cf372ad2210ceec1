//! L2 announcements' datapath: from_native answers Neighbor Solicitations
//! for announced IPv6 LoadBalancer addresses (one advertisement, the node's
//! MAC, a checksum checked here), ignores malformed ones, and both the ARP
//! and the NDP responder stop answering within one announcement lease of
//! the agent hanging (SIGSTOP) and resume once it runs again (SIGCONT).

use std::net::Ipv6Addr;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use lockstep_tests::lb_lab::signal;
use lockstep_tests::ndp::{Prober, checksum_ok, solicitation, with_options};
use lockstep_tests::{AgentProc, Netns, counter, privileged, veth};

/// The lease under test: short, so the test is too.
const LEASE: Duration = Duration::from_millis(900);
const NB_MAC: [u8; 6] = [2, 0, 0, 0x91, 0, 2];

fn config(lease: Duration) -> String {
    format!(
        "[[pools]]\nname = \"pods\"\nipv4 = [\"10.80.0.0/24\"]\n\n[lb]\nannounce_lease = \"{}ms\"\n\n[datapath]\nuplink = \"u0\"\n",
        lease.as_millis()
    )
}

/// The agent on `node` with announcement lease `lease` and the announced
/// dual-stack LB pool `public`.
fn start(node: &Netns, lease: Duration) -> anyhow::Result<AgentProc> {
    let agent = AgentProc::start(node, &config(lease))?;
    agent.lb_apply(&serde_json::json!({"pools": [{
        "name": "public", "cidrs": ["10.91.0.16/28", "fd00:91::10/124"], "announce": "l2"
    }]}))?;
    Ok(agent)
}

fn arp_answered(nb: &Netns, addr: &str) -> anyhow::Result<bool> {
    let out = nb
        .command("arping")
        .args(["-c", "1", "-w", "1", "-I", "n0", addr])
        .output()?;
    Ok(out.status.success())
}

fn mac_bytes(mac: &str) -> anyhow::Result<[u8; 6]> {
    let v: Vec<u8> = mac
        .split(':')
        .map(|h| u8::from_str_radix(h, 16))
        .collect::<Result<_, _>>()?;
    v.try_into()
        .map_err(|_| anyhow::anyhow!("not a MAC: {mac}"))
}

/// Sends one solicitation (valid unless `hop_limit`/`code` say otherwise)
/// and returns the advertisements received within `wait`.
fn solicit(
    nb: &Netns,
    target: Ipv6Addr,
    hop_limit: u8,
    code: u8,
    wait: Duration,
) -> anyhow::Result<Vec<Vec<u8>>> {
    nb.run(|| {
        let p = Prober::open("n0")?;
        p.send(&solicitation(
            NB_MAC,
            "fd00:91::2".parse()?,
            target,
            hop_limit,
            code,
        ))?;
        p.advertisements(target, wait)
    })
}

/// How long after `since` each responder's probes first give `want` and
/// keep giving it (twice in a row): the later of the two responders' times.
/// Each responder is probed on its own thread, so neither probe's wait
/// (arping's 1 s deadline when unanswered) delays the other's, and a time
/// is a probe's start. Gives up after `limit`.
fn until(
    nb: &Netns,
    v4: &str,
    v6: Ipv6Addr,
    want: bool,
    since: Instant,
    limit: Duration,
) -> anyhow::Result<Duration> {
    let streak = |name: &str, probe: &dyn Fn() -> anyhow::Result<bool>| {
        let (mut first, mut seen) = (None, 0);
        loop {
            let t = since.elapsed();
            let got = probe()?;
            if got == want {
                first = first.or(Some(t));
                seen += 1;
                if seen == 2 {
                    return first.context("set above");
                }
            } else {
                (first, seen) = (None, 0);
            }
            ensure!(
                since.elapsed() < limit,
                "{name} answers still {got} after {:?}",
                since.elapsed()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    std::thread::scope(|s| {
        let ndp = s.spawn(|| {
            streak("NDP", &|| {
                Ok(!solicit(nb, v6, 255, 0, Duration::from_millis(150))?.is_empty())
            })
        });
        let arp = streak("ARP", &|| arp_answered(nb, v4));
        let ndp = ndp
            .join()
            .map_err(|_| anyhow::anyhow!("the NDP prober panicked"))?;
        Ok(ndp?.max(arp?))
    })
}

#[test]
fn ndp_is_answered_once_with_the_node_mac_and_both_responders_honour_the_lease()
-> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("ndpnode")?;
    let nb = Netns::new("ndpnb")?;
    veth(&node, "u0", &nb, "n0")?;
    nb.ip(["addr", "add", "10.91.0.2/24", "dev", "n0"])?;
    let node_mac = mac_bytes(&node.mac("u0")?)?;
    let mut agent = start(&node, LEASE)?;

    // The unsolicited advertisement on assignment: listen first.
    let v6: Ipv6Addr = "fd00:91::11".parse()?;
    let unsolicited = std::thread::scope(|s| -> anyhow::Result<Vec<Vec<u8>>> {
        let (tx, rx) = std::sync::mpsc::channel();
        let nb = &nb;
        let listener = s.spawn(move || {
            nb.run(move || {
                let p = Prober::open("n0")?;
                tx.send(()).ok();
                p.advertisements(v6, Duration::from_secs(3))
            })
        });
        rx.recv_timeout(Duration::from_secs(5))?;
        let view = agent.lb_apply(&serde_json::json!({"services": [{
            "namespace": "shop", "name": "web", "ipFamilyPolicy": "RequireDualStack",
            "ports": [{"protocol": "TCP", "port": 443}]
        }]}))?;
        let addrs = &view["services"]["shop/web"]["assignment"]["addresses"];
        ensure!(
            addrs.as_array().is_some_and(|a| a.len() == 2)
                && addrs
                    .as_array()
                    .unwrap()
                    .contains(&serde_json::json!("10.91.0.17"))
                && addrs
                    .as_array()
                    .unwrap()
                    .contains(&serde_json::json!(v6.to_string())),
            "both families assigned: {view}"
        );
        listener
            .join()
            .map_err(|_| anyhow::anyhow!("listener panicked"))?
    })?;
    ensure!(!unsolicited.is_empty(), "no unsolicited NA on assignment");
    let na = &unsolicited[0];
    ensure!(checksum_ok(na), "unsolicited NA checksum: {na:02x?}");
    ensure!(na[6..12] == node_mac && na[80..86] == node_mac, "{na:02x?}");
    ensure!(na[58] & 0x60 == 0x20, "override, not solicited: {na:02x?}");

    // One solicitation, exactly one advertisement, every field checked.
    let got = solicit(&nb, v6, 255, 0, Duration::from_secs(1))?;
    ensure!(got.len() == 1, "{} advertisements: {got:02x?}", got.len());
    let na = &got[0];
    ensure!(na.len() == 86, "NA frame of {} bytes", na.len());
    ensure!(na[0..6] == NB_MAC, "to the solicitor's MAC: {na:02x?}");
    ensure!(na[6..12] == node_mac, "from the node's MAC: {na:02x?}");
    ensure!(na[21] == 255, "hop limit {}", na[21]);
    ensure!(na[22..38] == v6.octets(), "from the target");
    ensure!(
        na[38..54] == "fd00:91::2".parse::<Ipv6Addr>()?.octets(),
        "to the solicitor's address"
    );
    ensure!((na[54], na[55]) == (136, 0), "NA, code 0");
    ensure!(na[58] == 0x60, "solicited and override: {:#x}", na[58]);
    ensure!(
        na[78..80] == [2, 1] && na[80..86] == node_mac,
        "target link-layer option"
    );
    ensure!(checksum_ok(na), "NA checksum does not hold: {na:02x?}");
    ensure!(counter(&agent.pins, "ndp_replied")? >= 1);
    // Solicitations of other sizes (no option; an extra nonce option) get
    // the same 86-byte advertisement: the program grows or trims the frame.
    for options in [0, 2] {
        let got = nb.run(|| {
            let p = Prober::open("n0")?;
            let ns = solicitation(NB_MAC, "fd00:91::2".parse()?, v6, 255, 0);
            p.send(&with_options(ns, options))?;
            p.advertisements(v6, Duration::from_secs(1))
        })?;
        ensure!(got.len() == 1, "{options} options: {got:02x?}");
        let na = &got[0];
        ensure!(
            na.len() == 86 && na[58] == 0x60 && checksum_ok(na),
            "{na:02x?}"
        );
        ensure!(na[80..86] == node_mac, "{na:02x?}");
    }

    // Malformed solicitations are left alone.
    let before = counter(&agent.pins, "ndp_malformed")?;
    for (hop, code) in [(64, 0), (255, 1)] {
        let got = solicit(&nb, v6, hop, code, Duration::from_millis(400))?;
        ensure!(got.is_empty(), "answered hop {hop} code {code}: {got:02x?}");
    }
    ensure!(counter(&agent.pins, "ndp_malformed")? >= before + 2);
    // An address not announced is not answered.
    let other: Ipv6Addr = "fd00:91::1e".parse()?;
    ensure!(solicit(&nb, other, 255, 0, Duration::from_millis(400))?.is_empty());
    ensure!(arp_answered(&nb, "10.91.0.17")?, "ARP answered");
    let out = agent.cli(["verify"])?;
    ensure!(
        out.status.success(),
        "verify with leases: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    // A hung agent: both responders stop within one lease.
    let pid = agent.pid().context("agent pid")?;
    signal(pid, "-STOP")?;
    let stopped = Instant::now();
    let silent = until(&nb, "10.91.0.17", v6, false, stopped, LEASE * 3);
    let resumed = Instant::now();
    signal(pid, "-CONT")?;
    let silent = silent?;
    ensure!(counter(&agent.pins, "announce_expired")? >= 1);
    // It runs again: answers resume within a renewal period (plus probes).
    let back = until(&nb, "10.91.0.17", v6, true, resumed, LEASE * 3)?;
    eprintln!(
        "lease {LEASE:?}: silent {silent:?} after SIGSTOP, answering again {back:?} after SIGCONT"
    );
    // Silence came no later than one lease after the stop (the last renewal
    // was before it), plus one probe round while still answered (~250 ms).
    ensure!(
        silent <= LEASE + Duration::from_millis(400),
        "still answering {silent:?} after SIGSTOP"
    );
    // And not before the lease could have passed: a third of it at least.
    ensure!(silent >= LEASE / 3, "silent after only {silent:?}");

    // A deleted service's addresses stop at once: the next probe is silent.
    let out = agent.cli(["lb", "delete", "--service", "shop/web"])?;
    ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(solicit(&nb, v6, 255, 0, Duration::from_millis(400))?.is_empty());
    ensure!(!arp_answered(&nb, "10.91.0.17")?, "ARP after delete");
    ensure!(agent.cli(["verify"])?.status.success());
    agent.stop()?;
    Ok(())
}

/// `verify` compares what the announcement maps should hold with what they
/// hold while the renewer rewrites their expiries: both must be read at one
/// moment (under the announcements' lock), or a renewal between the two
/// reads is reported as drift (a CI run saw `DRIFT L2_RESP6_SLOTS`). The
/// shortest lease renews every 100 ms; verify runs back to back over many
/// renewals and must never report drift.
#[test]
fn verify_never_reports_a_renewal_in_progress_as_drift() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("ndpvnode")?;
    let nb = Netns::new("ndpvnb")?;
    veth(&node, "u0", &nb, "n0")?;
    let lease = lockstep::config::MIN_ANNOUNCE_LEASE;
    let mut agent = start(&node, lease)?;
    let services: Vec<_> = (0..8)
        .map(|i| {
            serde_json::json!({
                "namespace": "shop", "name": format!("web{i}"), "ipFamilyPolicy": "RequireDualStack",
                "ports": [{"protocol": "TCP", "port": 443}]
            })
        })
        .collect();
    agent.lb_apply(&serde_json::json!({ "services": services }))?;
    let started = Instant::now();
    let (mut runs, mut drifts) = (0, Vec::new());
    while started.elapsed() < lease * 20 {
        let out = agent.cli(["verify"])?;
        runs += 1;
        if !out.status.success() {
            drifts.push(String::from_utf8_lossy(&out.stdout).into_owned());
        }
    }
    eprintln!(
        "{runs} verify runs over {} renewals: {} reported drift",
        20 * 3,
        drifts.len()
    );
    ensure!(runs >= 20, "only {runs} verify runs");
    ensure!(drifts.is_empty(), "verify reported drift: {drifts:?}");
    agent.stop()?;
    Ok(())
}
