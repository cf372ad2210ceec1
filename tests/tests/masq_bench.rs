//! `cargo xtask bench masquerade`: lockstep's BPF masquerade beside the
//! kernel's own (nftables `masquerade`, conntrack), in two identical
//! [`World`] topologies built side by side (and a third without any
//! translation, its world routing back, as the reference), rounds rotating
//! between them.
//! In the nftables world lockstep's programs are not attached. Figures:
//! TCP throughput (iperf3), TCP connections per second (connect, 16-byte
//! request, 64-byte reply, close), UDP packets per second (64-byte
//! datagrams, counted at the receiver). Medians of the rounds and the
//! ratios are printed; the goals (throughput ≥ nftables, connections/s ≥
//! nftables, in the same run) are checked, and the run fails when one is
//! missed. The no-translation reference is reported beside them, with the
//! programs' share of a connection's CPU: the whole datapath costs a few
//! percent of a connection, so a ratio to it is met or missed by noise.
//!
//! Ignored in the test suite (it takes about a minute); the xtask runs it.

use std::collections::BTreeSet;
use std::io::Write;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use lockstep::datapath::PinnedMaps;
use lockstep_common::{MasqConfig, masq_flags};
use lockstep_tests::traffic::{
    IperfServer, check_goals, connections, median, paired_ratio, request_reply_server, throughput,
};
use lockstep_tests::world::{NODE_V4, NODE_V6, WORLD_V4, World};
use lockstep_tests::{Netns, PinRoot, counter, lockstep_in, privileged, progstats};

const EP_V4: &str = "10.200.0.2";
const EP_V6: &str = "fd00:200::2";
/// Rounds per side (1 in a smoke run).
fn rounds() -> usize {
    lockstep_tests::bench::size(7, 1)
}
const CLIENT_THREADS: usize = 4;
/// One connections round (shorter in a smoke run).
fn round_len() -> Duration {
    lockstep_tests::bench::size(Duration::from_secs(2), Duration::from_millis(300))
}

/// One side of the comparison: a world, its endpoint, the servers in the
/// world that the rounds use.
struct Side {
    name: &'static str,
    w: World,
    ep: Netns,
    _iperf: IperfServer,
    rr: SocketAddr,
    _pins: Option<PinRoot>,
    /// The BPF programs loaded for this side (none without lockstep's).
    progs: BTreeSet<u32>,
}

/// What translates on a side.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// lockstep's programs and MASQ_CONFIG.
    Lockstep,
    /// An nftables masquerade rule (kernel conntrack).
    Nftables,
    /// Nothing: the world routes the endpoint back (the reference the two
    /// are measured against, not a goal).
    Plain,
    /// lockstep's programs with the translation off (MASQ_CONFIG zeroed,
    /// as `enabled = false` writes it), the world routing back: what
    /// the endpoint's checks and the uplink's programs cost without the
    /// translation. Reported beside the reference, not a goal.
    ProgramsOnly,
}

fn build(name: &'static str, mode: Mode) -> anyhow::Result<Side> {
    let loaded_before = progstats::loaded_ids()?;
    let w = World::new()?;
    let ep = w.plain_endpoint("h1", EP_V4, EP_V6)?;
    // The endpoint's own ephemeral ports: fewer than the masquerade range,
    // so a connection-rate round reuses tuples (as a busy client does)
    // instead of filling the tables with one-off ones.
    ep.sysctl("net.ipv4.ip_local_port_range", "50000 53999")?;
    if matches!(mode, Mode::Plain | Mode::ProgramsOnly) {
        w.world.ip(["route", "add", EP_V4, "via", NODE_V4])?;
    }
    let pins = match mode {
        Mode::Plain => None,
        Mode::Lockstep | Mode::ProgramsOnly => {
            let pins = PinRoot::new();
            let cli = |args: &[&str]| -> anyhow::Result<String> {
                let mut all: Vec<String> = args.iter().map(|s| s.to_string()).collect();
                all.extend(pins.arg());
                lockstep_in(&w.node, all)
            };
            cli(&["datapath", "install", "--uplink", "u0"])?;
            cli(&[
                "datapath", "endpoint", "--iface", "h1", "--ipv4", EP_V4, "--ipv6", EP_V6,
            ])?;
            let v4: std::net::Ipv4Addr = NODE_V4.parse()?;
            let v6: std::net::Ipv6Addr = NODE_V6.parse()?;
            // Off: what the agent writes with `enabled = false`.
            let config = if mode == Mode::Lockstep {
                MasqConfig {
                    node_v4: v4.octets(),
                    node_v6: v6.octets(),
                    port_min: 61_000,
                    port_max: 65_535,
                    flags: masq_flags::ENABLED_V4 | masq_flags::ENABLED_V6,
                    ..Default::default()
                }
            } else {
                MasqConfig::default()
            };
            PinnedMaps::open(pins.path())?.set_masq_config(config)?;
            Some(pins)
        }
        Mode::Nftables => {
            let rules = "table inet mqbench {\n chain post {\n  type nat hook postrouting priority srcnat; policy accept;\n  oifname \"u0\" masquerade\n }\n}\n";
            let mut nft = w
                .node
                .command("nft")
                .args(["-f", "-"])
                .stdin(Stdio::piped())
                .spawn()?;
            nft.stdin
                .take()
                .context("nft stdin")?
                .write_all(rules.as_bytes())?;
            ensure!(nft.wait()?.success(), "nft refused the ruleset");
            None
        }
    };
    let iperf = IperfServer::start(&w.world, WORLD_V4)?;
    let rr = request_reply_server(&w.world, WORLD_V4, CLIENT_THREADS)?;
    let progs = match mode {
        Mode::Lockstep | Mode::ProgramsOnly => progstats::loaded_ids()?
            .difference(&loaded_before)
            .copied()
            .collect(),
        Mode::Nftables | Mode::Plain => BTreeSet::new(),
    };
    Ok(Side {
        name,
        w,
        ep,
        _iperf: iperf,
        rr,
        _pins: pins,
        progs,
    })
}

/// One more connections round on `side` with the kernel's per-program
/// statistics on (and only then: the compared rounds run without their
/// clock reads): what each of its programs costs per packet in this
/// traffic, and all of them per connection beside the machine's busy CPU
/// time per connection. Reported, not a goal: the no-translation goal
/// leaves the whole datapath 3% of a connection.
fn in_traffic(side: &Side) -> anyhow::Result<()> {
    let ((cps, _), runs, busy) = progstats::measure(&side.progs, || {
        connections(&side.ep, side.rr, CLIENT_THREADS, round_len())
    })?;
    let conns = cps * round_len().as_secs_f64();
    ensure!(
        conns > 0.0 && runs.get("to_native").is_some_and(|r| r.count > 0),
        "{}: the statistics round saw no connection or no run of to_native",
        side.name
    );
    let each: Vec<String> = runs
        .iter()
        .filter(|(_, r)| r.count > 0)
        .map(|(name, r)| {
            format!(
                "{name} {:.0} ns x {:.1}",
                r.ns_per_run(),
                r.count as f64 / conns
            )
        })
        .collect();
    let programs: Duration = runs.values().map(|r| r.time).sum();
    let (programs_us, busy_us) = (
        programs.as_secs_f64() * 1e6 / conns,
        busy.as_secs_f64() * 1e6 / conns,
    );
    println!(
        "  in the traffic, {} ({cps:.0} connections/s, statistics on): per connection {} ; the programs {programs_us:.2} us of {busy_us:.1} us busy CPU ({:.1}%)",
        side.name,
        each.join(", "),
        100.0 * programs_us / busy_us
    );
    Ok(())
}

/// UDP datagrams per second received in the world.
fn udp(side: &Side) -> anyhow::Result<f64> {
    let ip: IpAddr = WORLD_V4.parse()?;
    let srv = side
        .w
        .world
        .run(|| Ok(UdpSocket::bind(SocketAddr::new(ip, 0))?))?;
    srv.set_read_timeout(Some(Duration::from_millis(200)))?;
    let to = srv.local_addr()?;
    let stop = AtomicBool::new(false);
    let received = AtomicU64::new(0);
    let mut window = Duration::ZERO;
    let started = Instant::now();
    std::thread::scope(|s| -> anyhow::Result<()> {
        s.spawn(|| {
            let mut buf = [0u8; 128];
            // Until the senders are done and nothing more arrives for the
            // read timeout (what was in flight has landed).
            loop {
                if srv.recv(&mut buf).is_ok() {
                    received.fetch_add(1, Ordering::Relaxed);
                } else if stop.load(Ordering::Relaxed) {
                    break;
                }
            }
        });
        let senders: Vec<_> = (0..CLIENT_THREADS - 1)
            .map(|_| {
                s.spawn(|| {
                    side.ep.run(|| {
                        let started = &started;
                        let sock = UdpSocket::bind("0.0.0.0:0")?;
                        sock.connect(to)?;
                        let payload = [3u8; 64];
                        while started.elapsed() < round_len() {
                            let _ = sock.send(&payload);
                        }
                        Ok(())
                    })
                })
            })
            .collect();
        for t in senders {
            t.join().map_err(|_| anyhow::anyhow!("sender panicked"))??;
        }
        window = started.elapsed();
        stop.store(true, Ordering::Relaxed);
        Ok(())
    })?;
    Ok(received.load(Ordering::Relaxed) as f64 / window.as_secs_f64())
}

#[test]
#[ignore = "a benchmark: cargo xtask bench masquerade"]
fn masquerade_bpf_beside_nftables() -> anyhow::Result<()> {
    privileged!();
    let sides = [
        build("lockstep", Mode::Lockstep)?,
        build("nftables", Mode::Nftables)?,
        build("no translation", Mode::Plain)?,
        build("lockstep, translation off", Mode::ProgramsOnly)?,
    ];
    // [side][metric] per round.
    let mut figures: [[Vec<f64>; 3]; 4] = Default::default();
    let mut failed = [0u64; 4];
    for round in 0..rounds() {
        // Rotate which side goes first, so drift hurts all alike.
        for i in (0..4).map(|k| (k + round) % 4) {
            let side = &sides[i];
            figures[i][0].push(throughput(&side.ep, WORLD_V4).context(side.name)? / 1e9);
            let (cps, f) = connections(&side.ep, side.rr, CLIENT_THREADS, round_len());
            figures[i][1].push(cps);
            failed[i] += f;
            figures[i][2].push(udp(side)?);
        }
    }
    let translated = counter(sides[0]._pins.as_ref().context("pins")?, "masq_translated")?;
    ensure!(
        translated > 0,
        "lockstep's side translated nothing: the bench measured no masquerade"
    );
    // Per-round ratios, before median() sorts the rounds (reported beside
    // the goals, which are judged on the medians).
    let paired: Vec<[f64; 3]> = (0..3)
        .map(|k| {
            [
                paired_ratio(&figures[0][k], &figures[1][k]),
                paired_ratio(&figures[0][k], &figures[2][k]),
                paired_ratio(&figures[0][k], &figures[3][k]),
            ]
        })
        .collect();
    let med: Vec<[f64; 3]> = figures
        .iter_mut()
        .map(|f| [median(&mut f[0]), median(&mut f[1]), median(&mut f[2])])
        .collect();
    println!(
        "masquerade bench, {} rounds, medians (lockstep BPF | nftables masquerade | ratio | no translation, for reference):",
        rounds()
    );
    for (k, (what, unit)) in [
        ("TCP throughput", "Gbit/s"),
        ("TCP connections", "/s"),
        ("UDP packets", "/s"),
    ]
    .iter()
    .enumerate()
    {
        println!(
            "  {what:<16} {:>12.2} {unit:<7} | {:>12.2} {unit:<7} | {:.2}x | {:>12.2}",
            med[0][k],
            med[1][k],
            med[0][k] / med[1][k],
            med[2][k]
        );
        println!(
            "  {:<16} per-round ratios, median: {:.2}x nftables, {:.2}x no translation",
            "", paired[k][0], paired[k][1]
        );
        // The best round of each side: on a shared machine the least
        // disturbed one (the rounds are sorted by median()).
        let best = |i: usize| figures[i][k].last().copied().unwrap_or(f64::NAN);
        println!(
            "  {:<16} {:>12.2} {unit:<7} | {:>12.2} {unit:<7} | {:.2}x | {:>12.2}   (best round)",
            "",
            best(0),
            best(1),
            best(0) / best(1),
            best(2)
        );
        println!(
            "  {:<16} lockstep with the translation off: {:.2} {unit}; the translation {:.2}x it (per round {:.2}x); it {:.2}x no translation",
            "",
            med[3][k],
            med[0][k] / med[3][k],
            paired[k][2],
            med[3][k] / med[2][k]
        );
    }
    println!(
        "  failed connection attempts: lockstep {}, nftables {}, none {}, translation off {}; rounds: {figures:?}",
        failed[0], failed[1], failed[2], failed[3]
    );
    in_traffic(&sides[0])?;
    in_traffic(&sides[3])?;
    let mut missed = vec![];
    if med[0][0] < med[1][0] {
        missed.push("throughput ≥ nftables");
    }
    if med[0][1] < med[1][1] {
        missed.push("connections/s ≥ nftables");
    }
    check_goals(&missed)
}
