//! `cargo xtask bench datapath`: per-packet cost of each program through
//! `BPF_PROG_TEST_RUN`, with IPCACHE_V4 holding 64k entries, beside the no-op
//! program measured in the same run. Needs root and a mounted bpffs.
//!
//! The kernel reports the mean time per run; each figure is the median of
//! several such means.
//!
//! Encapsulation rows (#30, `cargo xtask bench tunnel`; reported: the
//! < 60 ns once aimed at is below what the collect-metadata mechanism costs
//! by itself here, the `encap_floor` row): from_endpoint sending to a remote block flagged
//! `ENCAP` (IPCACHE lookup, tunnel key set, redirect to the tunnel
//! device), over an IPv4 and an IPv6 underlay; and, for the record, a
//! 1,400-byte packet over the IPv6 underlay, which also asks the FIB for
//! the path MTU. Beside them, `encap_floor`: a program that only sets a
//! fixed tunnel key and redirects, the part of the cost no program
//! choosing the tunnel endpoint can avoid.
//!
//! Masquerade rows (reported: the < 80 ns and ≤ 1.5× the lookup once aimed
//! at were shown out of reach, even with no L4 checksum at all; the
//! masquerade's goals are judged in traffic beside nftables,
//! `tests/tests/masq_bench.rs`): an established
//! flow's translation in each direction, with 64k other flows in each NAT
//! map; and (#31) the IPv4 forward translation beside `nat_lookup`, a
//! program that only parses the tuple and looks it up, measured the same
//! way (the translation against the lookup, both over the empty
//! program). `LOCKSTEP_BENCH_MASQUERADE_ONLY` (`cargo xtask bench
//! masquerade`) runs these rows alone. A translation rewrites its packet, and `BPF_PROG_TEST_RUN` with a
//! repeat count runs the program again and again on the one packet (the
//! second run would see the translated packet), so these rows use single
//! runs, like the ARP reply: each run gets the original packet afresh and
//! translates it for real, and the empty program is timed the same way.

use std::net::Ipv4Addr;
use std::time::Duration;

#[path = "shared/smoke.rs"]
mod smoke;

use lockstep::datapath::{Datapath, DatapathOptions, sys};
use lockstep_common::{
    EndpointSlot, EndpointValue, IpcacheValue, L2RespSlot, L2RespValue, MasqConfig, NatKeyV4,
    NatKeyV6, NatValueV4, NatValueV6, endpoint_flags, identity, ipcache_flags, masq_flags,
    program_names, slots,
};

const IPCACHE_ENTRIES: u32 = 65_536;
const ROUNDS: usize = 15;
const REPEAT: u32 = 200_000;
/// Single runs per round for the ARP reply path (which rewrites its packet).
const SINGLE_RUNS: usize = 2_000;

fn ipv4_udp(src: [u8; 4], dst: [u8; 4]) -> Vec<u8> {
    let mut p = vec![0u8; 14 + 20 + 8 + 18];
    p[0..6].copy_from_slice(&[0x02, 0, 0, 0, 0, 2]);
    p[6..12].copy_from_slice(&[0x02, 0, 0, 0, 0, 1]);
    p[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
    p[14] = 0x45;
    let ip_len = (p.len() - 14) as u16;
    p[16..18].copy_from_slice(&ip_len.to_be_bytes());
    p[22] = 64;
    p[23] = 17;
    p[26..30].copy_from_slice(&src);
    p[30..34].copy_from_slice(&dst);
    p
}

/// An IPv4 TCP segment (ACK, 20 bytes of payload).
fn ipv4_tcp(src: [u8; 4], dst: [u8; 4], sport: u16, dport: u16) -> Vec<u8> {
    let mut p = vec![0u8; 14 + 20 + 20 + 20];
    p[0..6].copy_from_slice(&[0x02, 0, 0, 0, 0, 2]);
    p[6..12].copy_from_slice(&[0x02, 0, 0, 0, 0, 1]);
    p[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
    p[14] = 0x45;
    let ip_len = (p.len() - 14) as u16;
    p[16..18].copy_from_slice(&ip_len.to_be_bytes());
    p[20] = 0x40; // DF
    p[22] = 64;
    p[23] = 6;
    p[26..30].copy_from_slice(&src);
    p[30..34].copy_from_slice(&dst);
    p[34..36].copy_from_slice(&sport.to_be_bytes());
    p[36..38].copy_from_slice(&dport.to_be_bytes());
    p[46] = 0x50; // data offset 5
    p[47] = 0x10; // ACK
    p
}

/// An IPv6 TCP segment (ACK, 20 bytes of payload).
fn ipv6_tcp(src: [u8; 16], dst: [u8; 16], sport: u16, dport: u16) -> Vec<u8> {
    let mut p = vec![0u8; 14 + 40 + 20 + 20];
    p[0..6].copy_from_slice(&[0x02, 0, 0, 0, 0, 2]);
    p[6..12].copy_from_slice(&[0x02, 0, 0, 0, 0, 1]);
    p[12..14].copy_from_slice(&0x86ddu16.to_be_bytes());
    p[14] = 0x60;
    p[18..20].copy_from_slice(&40u16.to_be_bytes());
    p[20] = 6;
    p[21] = 64;
    p[22..38].copy_from_slice(&src);
    p[38..54].copy_from_slice(&dst);
    p[54..56].copy_from_slice(&sport.to_be_bytes());
    p[56..58].copy_from_slice(&dport.to_be_bytes());
    p[66] = 0x50;
    p[67] = 0x10;
    p
}

fn arp_request(sender: [u8; 4], target: [u8; 4]) -> Vec<u8> {
    let mut p = vec![0u8; 42];
    p[0..6].copy_from_slice(&[0xff; 6]);
    p[6..12].copy_from_slice(&[0x02, 0, 0, 0, 0, 9]);
    p[12..14].copy_from_slice(&0x0806u16.to_be_bytes());
    p[14..22].copy_from_slice(&[0, 1, 0x08, 0x00, 6, 4, 0, 1]);
    p[22..28].copy_from_slice(&[0x02, 0, 0, 0, 0, 9]);
    p[28..32].copy_from_slice(&sender);
    p[38..42].copy_from_slice(&target);
    p
}

/// A Neighbor Solicitation for `target` with a source link-layer option
/// (the responder does not check the received checksum).
fn ndp_solicitation(target: [u8; 16]) -> Vec<u8> {
    let mut p = vec![0u8; 86];
    p[0..6].copy_from_slice(&[0x33, 0x33, 0xff, target[13], target[14], target[15]]);
    p[6..12].copy_from_slice(&[0x02, 0, 0, 0, 0, 9]);
    p[12..14].copy_from_slice(&0x86DDu16.to_be_bytes());
    p[14..22].copy_from_slice(&[0x60, 0, 0, 0, 0, 32, 58, 255]);
    p[22..38].copy_from_slice(&[0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]);
    p[38..54].copy_from_slice(&[
        0xff, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0xff, target[13], target[14], target[15],
    ]);
    p[54] = 135;
    p[62..78].copy_from_slice(&target);
    p[78..80].copy_from_slice(&[1, 1]);
    p[80..86].copy_from_slice(&[0x02, 0, 0, 0, 0, 9]);
    p
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median over rounds of (program − noop), each round measuring both back to
/// back so machine noise hits both alike. Returns (program median, difference
/// median).
fn paired(
    dp: &mut Datapath,
    prog: &str,
    packet: &[u8],
    want: i32,
    single: bool,
) -> anyhow::Result<(f64, f64)> {
    let mut run = |name: &str, expect: i32| -> anyhow::Result<f64> {
        if single {
            let mut total = Duration::ZERO;
            for _ in 0..SINGLE_RUNS {
                let (ret, t) = dp.test_run(name, packet, 1, 1)?;
                anyhow::ensure!(ret == expect, "{name} returned {ret}, expected {expect}");
                total += t;
            }
            Ok(total.as_nanos() as f64 / SINGLE_RUNS as f64)
        } else {
            let (ret, mean) = dp.test_run(name, packet, 1, REPEAT)?;
            anyhow::ensure!(ret == expect, "{name} returned {ret}, expected {expect}");
            Ok(mean.as_nanos() as f64)
        }
    };
    let mut progs = Vec::new();
    let mut diffs = Vec::new();
    for _ in 0..smoke::size(ROUNDS, 3) {
        let base = run(program_names::NOOP, NEXT)?;
        let p = run(prog, want)?;
        progs.push(p);
        diffs.push(p - base);
    }
    Ok((median(progs), median(diffs)))
}

const NEXT: i32 = -1;
const DROP: i32 = 2;
const REDIRECT: i32 = 7;

fn main() -> anyhow::Result<()> {
    // SAFETY: geteuid has no preconditions.
    anyhow::ensure!(
        unsafe { libc::geteuid() } == 0,
        "the datapath bench needs root"
    );
    let pin_root =
        std::path::PathBuf::from(format!("/sys/fs/bpf/lockstep-bench-{}", std::process::id()));
    let result = run(&pin_root);
    Datapath::uninstall(&pin_root, &[])?;
    result
}

fn run(pin_root: &std::path::Path) -> anyhow::Result<()> {
    let mut dp = Datapath::open(DatapathOptions::new(pin_root))?;
    let mut maps = dp.maps()?;

    // 64k /32 entries in 10.128.0.0/16 (host entries: the IPCACHE_HOST_V4 hash),
    // written with batch syscalls, plus prefixes in the IPCACHE_V4 trie.
    let mut keys = Vec::new();
    let mut values = Vec::new();
    let remote = IpcacheValue {
        identity: identity::ENDPOINT + 1,
        flags: ipcache_flags::REMOTE,
        ..Default::default()
    };
    for i in 0..IPCACHE_ENTRIES {
        let addr = u32::from(Ipv4Addr::new(10, 128, 0, 0)) + i;
        keys.extend_from_slice(&addr.to_be_bytes());
        // SAFETY: IpcacheValue is repr(C) plain data without padding.
        values.extend_from_slice(unsafe {
            std::slice::from_raw_parts(
                (&remote as *const IpcacheValue).cast::<u8>(),
                size_of::<IpcacheValue>(),
            )
        });
    }
    let raw = maps.raw(lockstep_common::map_names::IPCACHE_HOST_V4)?;
    let started = std::time::Instant::now();
    sys::update_batch(raw.fd(), 4, size_of::<IpcacheValue>(), &keys, &values)?;
    let fill = started.elapsed();
    for i in 0..=255u8 {
        maps.ipcache_insert(
            ipnet::IpNet::V4(ipnet::Ipv4Net::new(Ipv4Addr::new(10, 64, i, 0), 24)?),
            remote,
        )?;
    }

    // The endpoint on ifindex 1 (loopback, where test runs arrive), with
    // the MAC its frames carry, so from_endpoint's rows (the tunnel's too)
    // include the MAC check every ADDed endpoint gets (#31 item 1).
    let ep = [10, 0, 0, 1];
    maps.endpoint_insert(
        1,
        &EndpointValue {
            generation: 1,
            ipv4: ep,
            mac: [0x02, 0, 0, 0, 0, 1],
            flags: endpoint_flags::HAS_V4,
            ..Default::default()
        },
    )?;
    maps.ipcache_host_v4_mut().insert(
        ep,
        IpcacheValue {
            identity: identity::ENDPOINT,
            flags: ipcache_flags::ENDPOINT,
            ifindex: 1,
            ..Default::default()
        },
        0,
    )?;
    maps.l2_insert(
        [10, 0, 0, 50],
        &L2RespValue {
            ifindex: 1,
            mac: [2, 0, 0, 0, 0, 0x50],
            ..Default::default()
        },
    )?;

    // `cargo xtask bench tunnel` wants the encapsulation rows only.
    if std::env::var_os("LOCKSTEP_BENCH_TUNNEL_ONLY").is_some() {
        return tunnel_rows(&mut dp, ep);
    }
    let to_remote = ipv4_udp(ep, [10, 128, 200, 7]);
    let spoofed = ipv4_udp([10, 0, 0, 99], [10, 128, 200, 7]);
    let to_world = ipv4_udp(ep, [192, 0, 2, 10]);
    let from_node = ipv4_udp([192, 0, 2, 1], [192, 0, 2, 10]);
    let arp_ours = arp_request([10, 0, 0, 2], [10, 0, 0, 50]);
    let arp_other = arp_request([10, 0, 0, 2], [10, 0, 0, 51]);
    let rows = [
        (
            "from_endpoint (genuine, IPCACHE hit)",
            program_names::FROM_ENDPOINT,
            &to_remote,
            NEXT,
            false,
        ),
        (
            "from_endpoint (spoofed, dropped)",
            program_names::FROM_ENDPOINT,
            &spoofed,
            DROP,
            false,
        ),
        (
            "to_native (endpoint to world)",
            program_names::TO_NATIVE,
            &to_world,
            NEXT,
            false,
        ),
        (
            "to_native (node's own traffic)",
            program_names::TO_NATIVE,
            &from_node,
            NEXT,
            false,
        ),
        (
            "from_native (ARP, not announced)",
            program_names::FROM_NATIVE,
            &arp_other,
            NEXT,
            false,
        ),
        // The reply rewrites its packet, so each run needs a fresh one.
        (
            "from_native (ARP reply, single runs)",
            program_names::FROM_NATIVE,
            &arp_ours,
            REDIRECT,
            true,
        ),
    ];
    println!(
        "datapath bench: BPF_PROG_TEST_RUN, IPCACHE with {} host entries + 256 /24 prefixes (batch fill {:.1} ms, {:.2} M/s); median of {} rounds, each pairing the program with the empty program",
        IPCACHE_ENTRIES + 1,
        fill.as_secs_f64() * 1e3,
        f64::from(IPCACHE_ENTRIES) / fill.as_secs_f64() / 1e6,
        smoke::size(ROUNDS, 3)
    );
    println!(
        "{:<40} {:>10} {:>12} {:>8}",
        "program", "ns/packet", "over empty", "<50 ns"
    );
    let masq_only = std::env::var_os("LOCKSTEP_BENCH_MASQUERADE_ONLY").is_some();
    let mut ok = true;
    for (name, prog, packet, want, single) in rows {
        if masq_only {
            break;
        }
        let (ns, over) = paired(&mut dp, prog, packet, want, single)?;
        let pass = over < 50.0;
        ok &= pass;
        println!(
            "{name:<40} {ns:>10.1} {over:>12.1} {:>8}",
            if pass { "PASS" } else { "FAIL" }
        );
    }
    // For the record, not a goal: the same paths when the slot does not hold
    // the key (another entry with a smaller key took it), so the program
    // falls back to the hash, as it does for the rare colliding endpoint.
    maps.endpoint_slots_mut()
        .set(slots::endpoint(1), EndpointSlot::default(), 0)?;
    maps.l2_resp_slots_mut()
        .set(slots::l2_resp([10, 0, 0, 50]), L2RespSlot::default(), 0)?;
    for (name, prog, packet, want, single) in [
        (
            "  same, slot not held: ENDPOINTS hash",
            program_names::FROM_ENDPOINT,
            &to_remote,
            NEXT,
            false,
        ),
        (
            "  same, slot not held: L2_RESP_V4 hash",
            program_names::FROM_NATIVE,
            &arp_ours,
            REDIRECT,
            true,
        ),
    ] {
        let (ns, over) = paired(&mut dp, prog, packet, want, single)?;
        println!("{name:<40} {ns:>10.1} {over:>12.1} {:>8}", "(info)");
    }
    // Announcement leases (for the record): an ARP reply for an entry that
    // expires (its check reads the per-CPU clock cache), and the NDP reply
    // (a hash lookup, the checksum, the redirect).
    let in_an_hour = lockstep::announce::monotonic_ns() + 3_600_000_000_000;
    let expiring = L2RespValue {
        ifindex: 1,
        mac: [2, 0, 0, 0, 0, 0x52],
        expires_ns: in_an_hour,
        ..Default::default()
    };
    maps.l2_insert([10, 0, 0, 52], &expiring)?;
    let v6: [u8; 16] = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x52];
    maps.l2_insert_v6(v6, &expiring)?;
    for (name, prog, packet, want, single) in [
        (
            "from_native (ARP reply, expiring entry)",
            program_names::FROM_NATIVE,
            &arp_request([10, 0, 0, 2], [10, 0, 0, 52]),
            REDIRECT,
            true,
        ),
        (
            "from_native (NDP reply, single runs)",
            program_names::FROM_NATIVE,
            &ndp_solicitation(v6),
            REDIRECT,
            true,
        ),
    ] {
        if masq_only {
            break;
        }
        let (ns, over) = paired(&mut dp, prog, packet, want, single)?;
        // The NDP reply has the ARP reply's goal (issue 13): < 50 ns over
        // the empty program, for the entries the agent writes (they expire).
        let verdict = if !name.contains("NDP") {
            "(info)"
        } else if over < 50.0 {
            "PASS"
        } else {
            ok = false;
            "FAIL"
        };
        println!("{name:<40} {ns:>10.1} {over:>12.1} {verdict:>8}");
    }
    // `cargo xtask bench lb` wants the responders' rows only.
    if std::env::var_os("LOCKSTEP_BENCH_RESPONDERS_ONLY").is_some() {
        anyhow::ensure!(
            ok || smoke::smoke(),
            "a program costs 50 ns or more over the empty program"
        );
        return Ok(());
    }
    masquerade_rows(&mut dp)?;
    if masq_only {
        return Ok(());
    }
    anyhow::ensure!(
        ok || smoke::smoke(),
        "a program costs 50 ns or more over the empty program"
    );
    Ok(())
}

fn nat_key4(src: [u8; 4], dst: [u8; 4], sport: u16, dport: u16) -> NatKeyV4 {
    NatKeyV4 {
        src_addr: src,
        dst_addr: dst,
        src_port: sport,
        dst_port: dport,
        proto: 6,
        _pad: [0; 3],
    }
}

fn nat_key6(src: [u8; 16], dst: [u8; 16], sport: u16, dport: u16) -> NatKeyV6 {
    NatKeyV6 {
        src_addr: src,
        dst_addr: dst,
        src_port: sport,
        dst_port: dport,
        proto: 6,
        _pad: [0; 3],
    }
}

/// Other flows written around the measured ones, per map (room left for
/// the measured flows under max_entries 65,536).
const NAT_FILL: u32 = 65_520;

/// The masquerade rows (see the module doc). Returns whether each is under
/// 80 ns over the empty program, and whether the IPv4 forward translation
/// costs at most 1.5× the lookup alone.
fn masquerade_rows(dp: &mut Datapath) -> anyhow::Result<()> {
    let mut maps = dp.maps()?;
    let ep = [10, 0, 0, 1];
    let ep6 = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
    let node = [192, 0, 2, 1];
    let node6 = [0x20, 1, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
    let world = [198, 51, 100, 7];
    let world6 = [0x20, 1, 0x0d, 0xb8, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 7];
    let (sport, dport, tport) = (40_000u16, 443u16, 61_234u16);
    maps.ipcache_host_v6_mut().insert(
        ep6,
        IpcacheValue {
            identity: identity::ENDPOINT,
            flags: ipcache_flags::ENDPOINT,
            ifindex: 1,
            ..Default::default()
        },
        0,
    )?;
    maps.masq_config_mut().set(
        0,
        MasqConfig {
            node_v4: node,
            node_v6: node6,
            port_min: 61_000,
            port_max: 65_535,
            flags: masq_flags::ENABLED_V4 | masq_flags::ENABLED_V6,
            reply_min: 0,
            reply_max: 0,
            endpoint_max: 0,
            _pad: 0,
        },
        0,
    )?;
    // Other flows: one endpoint port each towards the world address.
    let started = std::time::Instant::now();
    for i in 0..NAT_FILL {
        let (p, t) = ((1_000 + i % 60_000) as u16, (i / 60_000) as u8);
        let key = NatKeyV4 {
            src_addr: [10, 1, t, 1],
            dst_addr: world,
            src_port: p,
            dst_port: dport,
            proto: 6,
            _pad: [0; 3],
        };
        let value = NatValueV4 {
            addr: node,
            port: p,
            ..Default::default()
        };
        maps.nat_fwd_v4_mut().insert(key, value, 0)?;
        let rkey = NatKeyV4 {
            src_addr: world,
            dst_addr: [192, 0, 3, t],
            src_port: dport,
            dst_port: p,
            proto: 6,
            _pad: [0; 3],
        };
        maps.nat_rev_v4_mut().insert(rkey, value, 0)?;
    }
    let fill = started.elapsed();
    // The measured flows: endpoint port `sport` to the world, translated to
    // the node address and port `tport`.
    maps.nat_fwd_v4_mut().insert(
        NatKeyV4 {
            src_addr: ep,
            dst_addr: world,
            src_port: sport,
            dst_port: dport,
            proto: 6,
            _pad: [0; 3],
        },
        NatValueV4 {
            addr: node,
            port: tport,
            ..Default::default()
        },
        0,
    )?;
    maps.nat_rev_v4_mut().insert(
        NatKeyV4 {
            src_addr: world,
            dst_addr: node,
            src_port: dport,
            dst_port: tport,
            proto: 6,
            _pad: [0; 3],
        },
        NatValueV4 {
            addr: ep,
            port: sport,
            ..Default::default()
        },
        0,
    )?;
    maps.nat_fwd_v6_mut().insert(
        NatKeyV6 {
            src_addr: ep6,
            dst_addr: world6,
            src_port: sport,
            dst_port: dport,
            proto: 6,
            _pad: [0; 3],
        },
        NatValueV6 {
            addr: node6,
            port: tport,
            ..Default::default()
        },
        0,
    )?;
    maps.nat_rev_v6_mut().insert(
        NatKeyV6 {
            src_addr: world6,
            dst_addr: node6,
            src_port: dport,
            dst_port: tport,
            proto: 6,
            _pad: [0; 3],
        },
        NatValueV6 {
            addr: ep6,
            port: sport,
            ..Default::default()
        },
        0,
    )?;
    let fwd4 = ipv4_tcp(ep, world, sport, dport);
    let rev4 = ipv4_tcp(world, node, dport, tport);
    let fwd6 = ipv6_tcp(ep6, world6, sport, dport);
    let rev6 = ipv6_tcp(world6, node6, dport, tport);
    let other = ipv4_tcp(world, [192, 0, 2, 9], dport, tport);
    println!(
        "masquerade: NAT_FWD_V4 / NAT_REV_V4 hold {NAT_FILL} other flows each (filled in {:.1} ms), MASQ_CONFIG enables both families",
        fill.as_secs_f64() * 1e3
    );
    println!(
        "{:<52} {:>10} {:>12} {:>8}",
        "program", "ns/packet", "over empty", "(report)"
    );
    for (name, prog, packet, goal, single) in [
        (
            "to_native (TCP v4, established, single runs)",
            program_names::TO_NATIVE,
            &fwd4,
            true,
            true,
        ),
        (
            "from_native (TCP v4 reply, established, single runs)",
            program_names::FROM_NATIVE,
            &rev4,
            true,
            true,
        ),
        (
            "to_native (TCP v6, established, single runs)",
            program_names::TO_NATIVE,
            &fwd6,
            true,
            true,
        ),
        (
            "from_native (TCP v6 reply, established, single runs)",
            program_names::FROM_NATIVE,
            &rev6,
            true,
            true,
        ),
        (
            "from_native (v4, not to the node address)",
            program_names::FROM_NATIVE,
            &other,
            false,
            false,
        ),
    ] {
        let (ns, over) = paired(dp, prog, packet, NEXT, single)?;
        let verdict = if goal { "" } else { "(info)" };
        println!("{name:<52} {ns:>10.1} {over:>12.1} {verdict:>8}");
    }
    // #31: the translation beside the lookup it cannot do without, both
    // single runs over the empty program, in alternating rounds.
    let (lookup_ns, lookup_over) = paired(dp, program_names::NAT_LOOKUP, &fwd4, DROP, true)?;
    let (xlate_ns, xlate_over) = paired(dp, program_names::TO_NATIVE, &fwd4, NEXT, true)?;
    let ratio = xlate_over / lookup_over;
    println!(
        "{:<52} {lookup_ns:>10.1} {lookup_over:>12.1} {:>8}",
        "nat_lookup (TCP v4 tuple + NAT_FWD_V4 hit only)", "(ref)"
    );
    println!(
        "{:<52} {xlate_ns:>10.1} {xlate_over:>12.1} {:>8}",
        format!("to_native (the same packet) = {ratio:.2}x the lookup"),
        ""
    );
    // For the record, the steady state (repeat mode, warm caches): each
    // packet flips between two flows' translations, so every run translates
    // for real. Forward: the translated packet's own tuple has an entry that
    // translates it back. Reverse: the destination must stay the node
    // address (from_native's first check), so only the port flips, and with
    // no address change the checksum takes the two-helper way (an upper
    // bound).
    let (ta, tb) = (61_500u16, 61_501u16);
    maps.nat_fwd_v4_mut().insert(
        nat_key4(node, world, tport, dport),
        NatValueV4 {
            addr: ep,
            port: sport,
            ..Default::default()
        },
        0,
    )?;
    maps.nat_fwd_v6_mut().insert(
        nat_key6(node6, world6, tport, dport),
        NatValueV6 {
            addr: ep6,
            port: sport,
            ..Default::default()
        },
        0,
    )?;
    for (from, to) in [(ta, tb), (tb, ta)] {
        maps.nat_rev_v4_mut().insert(
            nat_key4(world, node, dport, from),
            NatValueV4 {
                addr: node,
                port: to,
                ..Default::default()
            },
            0,
        )?;
        maps.nat_rev_v6_mut().insert(
            nat_key6(world6, node6, dport, from),
            NatValueV6 {
                addr: node6,
                port: to,
                ..Default::default()
            },
            0,
        )?;
    }
    for (name, prog, packet) in [
        (
            "  to_native TCP v4, repeat mode (flipping)",
            program_names::TO_NATIVE,
            &fwd4,
        ),
        (
            "  from_native TCP v4, repeat mode (port only)",
            program_names::FROM_NATIVE,
            &ipv4_tcp(world, node, dport, ta),
        ),
        (
            "  to_native TCP v6, repeat mode (flipping)",
            program_names::TO_NATIVE,
            &fwd6,
        ),
        (
            "  from_native TCP v6, repeat mode (port only)",
            program_names::FROM_NATIVE,
            &ipv6_tcp(world6, node6, dport, ta),
        ),
    ] {
        let (ns, over) = paired(dp, prog, packet, NEXT, false)?;
        println!("{name:<52} {ns:>10.1} {over:>12.1} {:>8}", "(info)");
    }
    let counters = maps.counters()?;
    let count = |want| {
        counters
            .iter()
            .find(|(c, _)| *c == want)
            .map_or(0, |(_, v)| *v)
    };
    anyhow::ensure!(
        count(lockstep_common::Counter::MasqTranslated) > 0
            && count(lockstep_common::Counter::MasqReversed) > 0,
        "nothing was translated: the rows measured the wrong path"
    );
    Ok(())
}

/// The encapsulation rows (see the module doc), from the endpoint `ep` on
/// ifindex 1; TUNNEL_CONFIG names ifindex 1 as the device (a test run
/// returns the redirect without performing it).
fn tunnel_rows(dp: &mut Datapath, ep: [u8; 4]) -> anyhow::Result<()> {
    let mut maps = dp.maps()?;
    maps.set_tunnel_config(lockstep_common::TunnelConfig {
        ifindex: 1,
        vni: 1,
        local_v4: [192, 0, 2, 1],
        local_v6: [0x20, 1, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
        ..Default::default()
    })?;
    let v4_node = lockstep_core::cluster::remote::tunnel_value("192.0.2.2".parse()?);
    let v6_node = lockstep_core::cluster::remote::tunnel_value("2001:db8::2".parse()?);
    maps.ipcache_insert("10.65.0.0/24".parse()?, v4_node)?;
    maps.ipcache_insert("10.65.1.0/24".parse()?, v6_node)?;
    let mut large = ipv4_udp(ep, [10, 65, 1, 7]);
    large.resize(1400, 0);
    let ip_len = (large.len() - 14) as u16;
    large[16..18].copy_from_slice(&ip_len.to_be_bytes());
    println!(
        "{:<40} {:>10} {:>12} {:>8}",
        "program (encapsulation)", "ns/packet", "over empty", "(report)"
    );
    maps.ipcache_insert(
        "10.65.2.0/24".parse()?,
        lockstep_core::cluster::remote::remote_value("192.0.2.3".parse()?),
    )?;
    // The floor: the tunnel key and the redirect alone (`encap_floor`),
    // what any collect-metadata encapsulation pays whatever decides it.
    let (floor_ns, floor_over) = paired(
        dp,
        program_names::ENCAP_FLOOR,
        &ipv4_udp(ep, [10, 65, 0, 7]),
        REDIRECT,
        false,
    )?;
    println!(
        "{:<40} {floor_ns:>10.1} {floor_over:>12.1} {:>8}",
        "  floor: tunnel key + redirect only", "(ref)"
    );
    for (name, packet, goal) in [
        (
            "  for reference: a native remote block",
            ipv4_udp(ep, [10, 65, 2, 7]),
            false,
        ),
        (
            "from_endpoint (encap, IPv4 underlay)",
            ipv4_udp(ep, [10, 65, 0, 7]),
            true,
        ),
        (
            "from_endpoint (encap, IPv6 underlay)",
            ipv4_udp(ep, [10, 65, 1, 7]),
            true,
        ),
        ("  same, 1400 bytes (path MTU asked)", large, false),
    ] {
        let want = if name.contains("native") {
            NEXT
        } else {
            REDIRECT
        };
        let (ns, over) = paired(dp, program_names::FROM_ENDPOINT, &packet, want, false)?;
        let verdict = if goal { "" } else { "(info)" };
        println!("{name:<40} {ns:>10.1} {over:>12.1} {verdict:>8}");
    }
    Ok(())
}
