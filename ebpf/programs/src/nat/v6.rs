//! IPv6: `to_native` source translation, `from_native` reverse
//! translation of replies and ICMPv6 errors.

use core::ptr::addr_of_mut;

use aya_ebpf::{
    bindings::{BPF_F_PSEUDO_HDR, BPF_NOEXIST},
    btf_maps::lpm_trie::Key,
    programs::TcContext,
};
use aya_log_ebpf::info;
use lockstep_common::{
    Counter, MasqConfig, NatKeyV6, NatValueV6, PORT_TRIES, V6Addr, masq_flags, nat_state,
};

use super::{
    ADMITTED, BPF_F_IPV6, CLAIMED, EEXIST, Flow, ICMP_ERROR, ICMPV6, IP, L4_V6, NEW_FLOW, V6_DST,
    V6_SRC, candidates, config, csum_add, csum_diff16, is_cluster, is_local_endpoint, l4_csum,
    ne16, now_ns, parse_l4, rewrite_v6, touch, write,
};
use crate::{
    DROP, IPCACHE_HOST_V6, MASQ_SKIP_V6, NAT_FWD_V6, NAT_REV_V6, NEXT, count, events_on,
    ipcache_v6, read,
};

/// See [`outgoing_v4`](super::v4).
#[inline(always)]
fn outgoing_v6(ctx: &TcContext, cfg: &MasqConfig) -> Result<(NatKeyV6, Flow), i32> {
    let (Some(next), Some(src), Some(dst)) = (
        read::<u8>(ctx, IP + 6),
        read::<V6Addr>(ctx, IP + V6_SRC),
        read::<V6Addr>(ctx, IP + V6_DST),
    ) else {
        count(Counter::Malformed);
        return Err(NEXT);
    };
    let flow = if cfg.flags & masq_flags::ENABLED_V6 == 0 {
        None
    } else {
        parse_l4(ctx, L4_V6, next, 128, false)
    };
    let Some(flow) = flow else {
        return Err(count_only_v6(&src, &dst));
    };
    let key = NatKeyV6 {
        src_addr: src,
        dst_addr: dst,
        src_port: flow.sport,
        dst_port: flow.dport,
        proto: flow.proto,
        _pad: [0; 3],
    };
    Ok((key, flow))
}

/// `to_native` for IPv6.
// Not inlined: to_native calls it and new_flow_v6 side by side, so only
// the larger of their frames adds to its own.
#[inline(never)]
pub(crate) fn egress_v6(ctx: &TcContext) -> i32 {
    let cfg = config();
    let (key, flow) = match outgoing_v6(ctx, &cfg) {
        Ok(found) => found,
        Err(verdict) => return verdict,
    };
    let Some(v) = NAT_FWD_V6.get_ptr_mut(key) else {
        return NEW_FLOW;
    };
    // SAFETY: `v` points at the map value for this run.
    let (addr, port) = unsafe {
        touch(
            addr_of_mut!((*v).last_seen_ns),
            addr_of_mut!((*v).state),
            flow.state_bits(nat_state::FIN_OUT),
        );
        ((*v).addr, (*v).port)
    };
    let port_at = if flow.proto == ICMPV6 {
        L4_V6 + 4
    } else {
        L4_V6
    };
    let rewritten = rewrite_v6(
        ctx,
        &flow,
        IP + V6_SRC,
        (&key.src_addr, &addr),
        port_at,
        (flow.sport, port),
    );
    if rewritten.is_none() {
        count(Counter::Malformed);
        return DROP;
    }
    count(Counter::MasqTranslated);
    NEXT
}

/// See [`count_only_v4`].
#[inline(always)]
fn count_only_v6(src: &V6Addr, dst: &V6Addr) -> i32 {
    // SAFETY: copied out at once.
    if !is_local_endpoint(unsafe { IPCACHE_HOST_V6.get(src) }) {
        count(Counter::MasqNotEndpoint);
    } else if MASQ_SKIP_V6.get(&Key::new(128, *dst)).is_some() {
        count(Counter::MasqSkipped);
    } else {
        count(Counter::MasqWouldTranslate);
    }
    NEXT
}

/// The first half of [`new_flow_v4`] for IPv6: whether the flow is to be
/// translated ([`ADMITTED`]) or passes as it is. IPv6's larger keys make
/// the two halves too large for one frame.
// Not inlined: a rare path, with its own stack frame.
#[inline(never)]
pub(crate) fn admit_v6(ctx: &TcContext) -> i32 {
    let cfg = config();
    let (key, _) = match outgoing_v6(ctx, &cfg) {
        Ok(found) => found,
        Err(verdict) => return verdict,
    };
    // SAFETY: copied out at once.
    if !is_local_endpoint(unsafe { IPCACHE_HOST_V6.get(key.src_addr) }) {
        count(Counter::MasqNotEndpoint);
        return NEXT;
    }
    if MASQ_SKIP_V6.get(&Key::new(128, key.dst_addr)).is_some()
        || is_cluster(ipcache_v6(key.dst_addr))
    {
        count(Counter::MasqSkipped);
        return NEXT;
    }
    ADMITTED
}

/// The second half of [`new_flow_v4`] for IPv6: claims a port and records
/// the flow; [`CLAIMED`] or the verdict.
// Not inlined: a rare path, with its own stack frame.
#[inline(never)]
pub(crate) fn claim_v6(ctx: &TcContext) -> i32 {
    let cfg = config();
    let (key, flow) = match outgoing_v6(ctx, &cfg) {
        Ok(found) => found,
        Err(verdict) => return verdict,
    };
    let state = flow.state_bits(nat_state::FIN_OUT);
    let (start, range, tries) = candidates(&cfg);
    let now = now_ns();
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
                return DROP;
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
            Ok(()) => CLAIMED,
            // Another CPU translated the same new flow first: its entry
            // serves, this port goes back.
            Err(e) if e == -EEXIST => {
                let _ = NAT_REV_V6.remove(rkey);
                CLAIMED
            }
            Err(_) => {
                let _ = NAT_REV_V6.remove(rkey);
                count(Counter::MasqTableFull);
                DROP
            }
        };
    }
    count(Counter::MasqExhausted);
    if events_on() {
        exhausted_event(ctx, &key);
    }
    DROP
}

/// `from_native` for IPv6; see [`ingress_v4`]. An ICMPv6 packet that is
/// no echo reply comes back as [`ICMP_ERROR`], for `icmp_error_v6`.
// Not inlined: from_native calls it and icmp_error_v6 side by side, so
// only the larger of their frames adds to its own.
#[inline(never)]
pub(crate) fn ingress_v6(ctx: &TcContext) -> i32 {
    let cfg = config();
    if cfg.flags & masq_flags::ENABLED_V6 == 0 {
        return NEXT;
    }
    let (Some(next), Some(src), Some(dst)) = (
        read::<u8>(ctx, IP + 6),
        read::<V6Addr>(ctx, IP + V6_SRC),
        read::<V6Addr>(ctx, IP + V6_DST),
    ) else {
        return NEXT;
    };
    if dst != cfg.node_v6 {
        return NEXT;
    }
    let Some(flow) = parse_l4(ctx, L4_V6, next, 129, true) else {
        if next == ICMPV6 {
            return ICMP_ERROR;
        }
        return NEXT;
    };
    // The replies of every live translation, an earlier range's included.
    let (lo, hi) = cfg.reply_ports();
    if flow.dport < lo || flow.dport > hi {
        return NEXT;
    }
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
    let fixed = rewrite_v6(
        ctx,
        &flow,
        IP + V6_DST,
        (&dst, &addr),
        port_at,
        (flow.dport, port),
    )
    .is_some();
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
// Not inlined: a rare path, with its own stack frame.
#[inline(never)]
pub(crate) fn icmp_error_v6(ctx: &TcContext) -> i32 {
    const INNER: usize = L4_V6 + 8;
    const INNER_L4: usize = INNER + 40;
    let cfg = config();
    // The outer destination and the quoted source are both the node address.
    let (Some(outer_dst), Some(icmp), Some(next), Some(node), Some(remote)) = (
        read::<V6Addr>(ctx, IP + V6_DST),
        read::<u8>(ctx, L4_V6),
        read::<u8>(ctx, INNER + 6),
        read::<V6Addr>(ctx, INNER + V6_SRC),
        read::<V6Addr>(ctx, INNER + V6_DST),
    ) else {
        return NEXT;
    };
    if outer_dst != cfg.node_v6 || node != cfg.node_v6 || !(1..=3).contains(&icmp) {
        return NEXT;
    }
    let Some(quoted) = parse_l4(ctx, INNER_L4, next, 128, false) else {
        return NEXT;
    };
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
    let diff = csum_diff16(&cfg.node_v6, &e.addr);
    let done = write(ctx, IP + V6_DST, e.addr)
        .and_then(|()| write(ctx, INNER + V6_SRC, e.addr))
        .and_then(|()| write(ctx, port_at, e.port.to_be_bytes()))
        .is_some()
        // The outer destination: in the pseudo-header.
        && l4_csum(
            ctx,
            csum,
            0,
            u64::from(diff),
            u64::from(BPF_F_PSEUDO_HDR) | BPF_F_IPV6,
        )
        .is_ok()
        // The quoted source and port: in the ICMPv6 payload.
        && l4_csum(
            ctx,
            csum,
            0,
            u64::from(csum_add(
                diff,
                u32::from(!ne16(quoted.sport)) + u32::from(ne16(e.port)),
            )),
            BPF_F_IPV6,
        )
        .is_ok();
    if !done {
        count(Counter::Malformed);
        return DROP;
    }
    count(Counter::MasqIcmpErrorReversed);
    NEXT
}

/// The aya-log event of a new flow dropped for want of a port; a function
/// of its own so its stack stays out of the packet path's frame.
#[inline(never)]
fn exhausted_event(ctx: &TcContext, key: &NatKeyV6) {
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
