//! IPv6: `to_native` source translation, `from_native` reverse
//! translation of replies and ICMPv6 errors.

use core::ptr::addr_of_mut;

use aya_ebpf::{
    bindings::{BPF_F_PSEUDO_HDR, BPF_NOEXIST},
    btf_maps::lpm_trie::Key,
    helpers::bpf_ktime_get_ns,
    programs::TcContext,
};
use aya_log_ebpf::info;
use lockstep_common::{
    Counter, MasqConfig, NatKeyV6, NatValueV6, PORT_TRIES, V6Addr, masq_flags, nat_state,
};

use super::{
    EEXIST, Flow, ICMPV6, IP, L4_V6, V6_DST, V6_SRC, candidates, config, csum_diff16, is_cluster,
    is_local_endpoint, l4_csum_v6, ne16, parse_l4, touch, write,
};
use crate::{
    DROP, IPCACHE_HOST_V6, MASQ_SKIP_V6, NAT_FWD_V6, NAT_REV_V6, NEXT, count, events_on,
    ipcache_v6, read,
};

/// `to_native` for IPv6.
#[inline(always)]
pub(crate) fn egress_v6(ctx: &TcContext) -> i32 {
    let Some(ip) = read::<[u8; 40]>(ctx, IP) else {
        count(Counter::Malformed);
        return NEXT;
    };
    let mut src: V6Addr = [0; 16];
    let mut dst: V6Addr = [0; 16];
    src.copy_from_slice(&ip[V6_SRC..V6_SRC + 16]);
    dst.copy_from_slice(&ip[V6_DST..V6_DST + 16]);
    let cfg = config();
    let flow = if cfg.flags & masq_flags::ENABLED_V6 == 0 {
        None
    } else {
        parse_l4(ctx, L4_V6, ip[6], 128, false)
    };
    let Some(flow) = flow else {
        return count_only_v6(src, dst);
    };
    let key = NatKeyV6 {
        src_addr: src,
        dst_addr: dst,
        src_port: flow.sport,
        dst_port: flow.dport,
        proto: flow.proto,
        _pad: [0; 3],
    };
    let (addr, port) = match NAT_FWD_V6.get_ptr_mut(key) {
        Some(v) => {
            // SAFETY: `v` points at the map value for this run.
            unsafe {
                touch(
                    addr_of_mut!((*v).last_seen_ns),
                    addr_of_mut!((*v).state),
                    flow.state_bits(nat_state::FIN_OUT),
                );
                ((*v).addr, (*v).port)
            }
        }
        None => {
            // SAFETY: copied out at once.
            if !is_local_endpoint(unsafe { IPCACHE_HOST_V6.get(src) }) {
                count(Counter::MasqNotEndpoint);
                return NEXT;
            }
            if MASQ_SKIP_V6.get(&Key::new(128, dst)).is_some() || is_cluster(ipcache_v6(dst)) {
                count(Counter::MasqSkipped);
                return NEXT;
            }
            match claim_v6(ctx, &key, &cfg, flow.state_bits(nat_state::FIN_OUT)) {
                Ok(found) => found,
                Err(verdict) => return verdict,
            }
        }
    };
    if snat_v6(ctx, &src, &dst, &flow, &addr, port).is_err() {
        count(Counter::Malformed);
        return DROP;
    }
    count(Counter::MasqTranslated);
    NEXT
}

/// See [`count_only_v4`].
#[inline(always)]
fn count_only_v6(src: V6Addr, dst: V6Addr) -> i32 {
    // SAFETY: copied out at once.
    if !is_local_endpoint(unsafe { IPCACHE_HOST_V6.get(src) }) {
        count(Counter::MasqNotEndpoint);
    } else if MASQ_SKIP_V6.get(&Key::new(128, dst)).is_some() {
        count(Counter::MasqSkipped);
    } else {
        count(Counter::MasqWouldTranslate);
    }
    NEXT
}

/// See [`claim_v4`].
#[inline(always)]
fn claim_v6(
    ctx: &TcContext,
    key: &NatKeyV6,
    cfg: &MasqConfig,
    state: u8,
) -> Result<(V6Addr, u16), i32> {
    let (start, range, tries) = candidates(cfg);
    // SAFETY: plain helper call.
    let now = unsafe { bpf_ktime_get_ns() };
    let back = NatValueV6 {
        last_seen_ns: now,
        addr: key.src_addr,
        port: key.src_port,
        state: 0,
        _pad: 0,
        _pad2: 0,
    };
    for i in 0..PORT_TRIES {
        if i >= tries {
            break;
        }
        let Some(offset) = (start + i).checked_rem(range) else {
            break;
        };
        let port = cfg.port_min + offset as u16;
        let rkey = NatKeyV6 {
            src_addr: key.dst_addr,
            dst_addr: cfg.node_v6,
            src_port: key.dst_port,
            dst_port: port,
            proto: key.proto,
            _pad: [0; 3],
        };
        match NAT_REV_V6.insert(rkey, back, u64::from(BPF_NOEXIST)) {
            Ok(()) => {}
            Err(e) if e == -EEXIST => continue,
            Err(_) => {
                count(Counter::MasqTableFull);
                return Err(DROP);
            }
        }
        let fwd = NatValueV6 {
            last_seen_ns: now,
            addr: cfg.node_v6,
            port,
            state,
            _pad: 0,
            _pad2: 0,
        };
        return match NAT_FWD_V6.insert(key, fwd, u64::from(BPF_NOEXIST)) {
            Ok(()) => Ok((cfg.node_v6, port)),
            Err(e) => {
                let _ = NAT_REV_V6.remove(rkey);
                // SAFETY: copied out at once.
                match (e == -EEXIST)
                    .then(|| unsafe { NAT_FWD_V6.get(key) })
                    .flatten()
                {
                    Some(v) => Ok((v.addr, v.port)),
                    None => {
                        count(Counter::MasqTableFull);
                        Err(DROP)
                    }
                }
            }
        };
    }
    count(Counter::MasqExhausted);
    if events_on() {
        info!(
            ctx,
            "to_native: no free masquerade port for [{:i}]:{} to [{:i}]:{} (protocol {}), dropped",
            key.src_addr,
            key.src_port,
            key.dst_addr,
            key.dst_port,
            key.proto
        );
    }
    Err(DROP)
}

/// Rewrites the source of an IPv6 packet to `addr`:`port`.
#[inline(always)]
fn snat_v6(
    ctx: &TcContext,
    src: &V6Addr,
    dst: &V6Addr,
    flow: &Flow,
    addr: &V6Addr,
    port: u16,
) -> Result<(), i64> {
    let p = port.to_be_bytes();
    // Source, destination (unchanged) and source port (or, for ICMPv6, the
    // source alone and then the identifier).
    if flow.proto == ICMPV6 {
        ctx.store(IP + V6_SRC, addr, 0)?;
        ctx.store(L4_V6 + 4, &p, 0)?;
    } else {
        let mut bytes = [0u8; 34];
        bytes[..16].copy_from_slice(addr);
        bytes[16..32].copy_from_slice(dst);
        bytes[32] = p[0];
        bytes[33] = p[1];
        ctx.store(IP + V6_SRC, &bytes, 0)?;
    }
    let csum = L4_V6 + flow.csum_off();
    let diff = csum_diff16(src, addr);
    l4_csum_v6(
        ctx,
        csum,
        0,
        u64::from(diff),
        u64::from(BPF_F_PSEUDO_HDR) | flow.mangled(),
    )?;
    l4_csum_v6(ctx, csum, ne16(flow.sport), ne16(port), 2 | flow.mangled())
}

/// `from_native` for IPv6; see [`ingress_v4`].
#[inline(always)]
pub(crate) fn ingress_v6(ctx: &TcContext) -> i32 {
    let cfg = config();
    if cfg.flags & masq_flags::ENABLED_V6 == 0 {
        return NEXT;
    }
    let Some(ip) = read::<[u8; 40]>(ctx, IP) else {
        return NEXT;
    };
    let mut dst: V6Addr = [0; 16];
    dst.copy_from_slice(&ip[V6_DST..V6_DST + 16]);
    if dst != cfg.node_v6 {
        return NEXT;
    }
    let Some(flow) = parse_l4(ctx, L4_V6, ip[6], 129, true) else {
        if ip[6] == ICMPV6 {
            return icmp_error_v6(ctx, &dst, &cfg);
        }
        return NEXT;
    };
    if flow.dport < cfg.port_min || flow.dport > cfg.port_max {
        return NEXT;
    }
    let mut src: V6Addr = [0; 16];
    src.copy_from_slice(&ip[V6_SRC..V6_SRC + 16]);
    let key = NatKeyV6 {
        src_addr: src,
        dst_addr: dst,
        src_port: flow.sport,
        dst_port: flow.dport,
        proto: flow.proto,
        _pad: [0; 3],
    };
    let Some(v) = NAT_REV_V6.get_ptr_mut(key) else {
        return NEXT;
    };
    // SAFETY: `v` points at the map value for this run.
    let (addr, port) = unsafe {
        touch(
            addr_of_mut!((*v).last_seen_ns),
            addr_of_mut!((*v).state),
            flow.state_bits(nat_state::FIN_IN),
        );
        ((*v).addr, (*v).port)
    };
    let port_at = if flow.proto == ICMPV6 {
        L4_V6 + 4
    } else {
        L4_V6 + 2
    };
    let written =
        write(ctx, IP + V6_DST, addr).and_then(|()| write(ctx, port_at, port.to_be_bytes()));
    let csum = L4_V6 + flow.csum_off();
    let fixed = written.is_some()
        && l4_csum_v6(
            ctx,
            csum,
            0,
            u64::from(csum_diff16(&dst, &addr)),
            u64::from(BPF_F_PSEUDO_HDR) | flow.mangled(),
        )
        .is_ok()
        && l4_csum_v6(ctx, csum, ne16(flow.dport), ne16(port), 2 | flow.mangled()).is_ok();
    if !fixed {
        count(Counter::Malformed);
        return DROP;
    }
    count(Counter::MasqReversed);
    NEXT
}

/// See [`icmp_error_v4`]: destination unreachable (1), packet too big (2)
/// and time exceeded (3). The ICMPv6 checksum covers the pseudo-header, so
/// the outer destination's change enters it too.
#[inline(always)]
fn icmp_error_v6(ctx: &TcContext, outer_dst: &V6Addr, cfg: &MasqConfig) -> i32 {
    const INNER: usize = L4_V6 + 8;
    const INNER_L4: usize = INNER + 40;
    let Some(icmp) = read::<[u8; 2]>(ctx, L4_V6) else {
        return NEXT;
    };
    if !(1..=3).contains(&icmp[0]) {
        return NEXT;
    }
    let Some(inner) = read::<[u8; 40]>(ctx, INNER) else {
        return NEXT;
    };
    let mut node: V6Addr = [0; 16];
    node.copy_from_slice(&inner[V6_SRC..V6_SRC + 16]);
    if node != cfg.node_v6 {
        return NEXT;
    }
    let Some(quoted) = parse_l4(ctx, INNER_L4, inner[6], 128, false) else {
        return NEXT;
    };
    let mut remote: V6Addr = [0; 16];
    remote.copy_from_slice(&inner[V6_DST..V6_DST + 16]);
    let key = NatKeyV6 {
        src_addr: remote,
        dst_addr: node,
        src_port: quoted.dport,
        dst_port: quoted.sport,
        proto: quoted.proto,
        _pad: [0; 3],
    };
    // SAFETY: copied out at once.
    let Some(&e) = (unsafe { NAT_REV_V6.get(key) }) else {
        return NEXT;
    };
    let port_at = if quoted.proto == ICMPV6 {
        INNER_L4 + 4
    } else {
        INNER_L4
    };
    let csum = L4_V6 + 2;
    let done = write(ctx, IP + V6_DST, e.addr)
        .and_then(|()| write(ctx, INNER + V6_SRC, e.addr))
        .and_then(|()| write(ctx, port_at, e.port.to_be_bytes()))
        .is_some()
        && l4_csum_v6(
            ctx,
            csum,
            0,
            u64::from(csum_diff16(outer_dst, &e.addr)),
            u64::from(BPF_F_PSEUDO_HDR),
        )
        .is_ok()
        && l4_csum_v6(ctx, csum, 0, u64::from(csum_diff16(&node, &e.addr)), 0).is_ok()
        && l4_csum_v6(ctx, csum, ne16(quoted.sport), ne16(e.port), 2).is_ok();
    if !done {
        count(Counter::Malformed);
        return DROP;
    }
    count(Counter::MasqIcmpErrorReversed);
    NEXT
}
