//! IPv4: `to_native` source translation, `from_native` reverse
//! translation of replies and ICMP errors.

use core::ptr::addr_of_mut;

use aya_ebpf::{bindings::BPF_NOEXIST, btf_maps::lpm_trie::Key, programs::TcContext};
use aya_log_ebpf::info;
use lockstep_common::{
    Counter, MasqConfig, NatKeyV4, NatValueV4, PORT_TRIES, V4Addr, masq_flags, nat_state,
};

use super::{
    CLAIMED, EEXIST, Flow, ICMP, IP, L4_V4, NEW_FLOW, V4_CSUM, V4_DST, V4_SRC, candidates, config,
    csum_replace4, is_cluster, is_local_endpoint, ne16, ne32, now_ns, parse_l4, rewrite_v4, touch,
    write,
};
use crate::{
    DROP, IPCACHE_HOST_V4, MASQ_SKIP_V4, NAT_FWD_V4, NAT_REV_V4, NEXT, count, events_on,
    ipcache_v4, read,
};

/// The flow of an IPv4 packet leaving the node, with its IP header
/// checksum, when masquerade is on for IPv4 and the packet is of a kind it
/// translates; otherwise the verdict, counted as before masquerade existed.
#[inline(always)]
fn outgoing_v4(ctx: &TcContext, cfg: &MasqConfig) -> Result<(NatKeyV4, Flow, u16), i32> {
    let Some(ip) = read::<[u8; 20]>(ctx, IP) else {
        count(Counter::Malformed);
        return Err(NEXT);
    };
    let src: V4Addr = [ip[12], ip[13], ip[14], ip[15]];
    let dst: V4Addr = [ip[16], ip[17], ip[18], ip[19]];
    let frag = u16::from_be_bytes([ip[6], ip[7]]) & 0x3fff != 0;
    let flow = if cfg.flags & masq_flags::ENABLED_V4 == 0 || ip[0] != 0x45 || frag {
        None
    } else {
        parse_l4(ctx, L4_V4, ip[9], 8, false)
    };
    let Some(flow) = flow else {
        return Err(count_only_v4(src, dst));
    };
    let key = NatKeyV4 {
        src_addr: src,
        dst_addr: dst,
        src_port: flow.sport,
        dst_port: flow.dport,
        proto: flow.proto,
        _pad: [0; 3],
    };
    Ok((key, flow, u16::from_ne_bytes([ip[10], ip[11]])))
}

/// `to_native` for IPv4.
#[inline(always)]
pub(crate) fn egress_v4(ctx: &TcContext) -> i32 {
    let cfg = config();
    let (key, flow, ip_check) = match outgoing_v4(ctx, &cfg) {
        Ok(found) => found,
        Err(verdict) => return verdict,
    };
    let Some(v) = NAT_FWD_V4.get_ptr_mut(key) else {
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
    let port_at = if flow.proto == ICMP { L4_V4 + 4 } else { L4_V4 };
    let rewritten = rewrite_v4(
        ctx,
        &flow,
        ip_check,
        IP + V4_SRC,
        (key.src_addr, addr),
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

/// What `to_native` did before masquerade existed, and still does for a
/// family the agent has not enabled: count.
#[inline(always)]
fn count_only_v4(src: V4Addr, dst: V4Addr) -> i32 {
    // Local endpoints are always host entries: the hash alone decides.
    // SAFETY: copied out at once.
    if !is_local_endpoint(unsafe { IPCACHE_HOST_V4.get(src) }) {
        count(Counter::MasqNotEndpoint);
    } else if MASQ_SKIP_V4.get(&Key::new(32, dst)).is_some() {
        count(Counter::MasqSkipped);
    } else {
        count(Counter::MasqWouldTranslate);
    }
    NEXT
}

/// A flow without a forward entry: translated only when its source is a
/// local endpoint and its destination neither in MASQ_SKIP nor inside the
/// cluster; then claims a translated port (the reverse entry, inserted
/// with `BPF_NOEXIST`) and records the forward entry. Returns
/// [`CLAIMED`] (the forward entry exists now) or the verdict of a packet
/// not to translate or to drop.
// Not inlined: a rare path, with its own stack frame.
#[inline(never)]
pub(crate) fn new_flow_v4(ctx: &TcContext) -> i32 {
    let cfg = config();
    let (key, flow) = match outgoing_v4(ctx, &cfg) {
        Ok(found) => (found.0, found.1),
        Err(verdict) => return verdict,
    };
    let state = flow.state_bits(nat_state::FIN_OUT);
    // SAFETY: copied out at once.
    if !is_local_endpoint(unsafe { IPCACHE_HOST_V4.get(key.src_addr) }) {
        count(Counter::MasqNotEndpoint);
        return NEXT;
    }
    if MASQ_SKIP_V4.get(&Key::new(32, key.dst_addr)).is_some()
        || is_cluster(ipcache_v4(key.dst_addr))
    {
        count(Counter::MasqSkipped);
        return NEXT;
    }
    let (start, range, tries) = candidates(&cfg);
    let now = now_ns();
    let back = NatValueV4 {
        last_seen_ns: now,
        addr: key.src_addr,
        port: key.src_port,
        state: 0,
        _pad: 0,
    };
    for i in 0..PORT_TRIES {
        if i >= tries {
            break;
        }
        let Some(offset) = (start + i).checked_rem(range) else {
            break;
        };
        let port = cfg.port_min + offset as u16;
        let rkey = NatKeyV4 {
            src_addr: key.dst_addr,
            dst_addr: cfg.node_v4,
            src_port: key.dst_port,
            dst_port: port,
            proto: key.proto,
            _pad: [0; 3],
        };
        match NAT_REV_V4.insert(rkey, back, u64::from(BPF_NOEXIST)) {
            Ok(()) => {}
            Err(e) if e == -EEXIST => continue,
            Err(_) => {
                count(Counter::MasqTableFull);
                return DROP;
            }
        }
        let fwd = NatValueV4 {
            last_seen_ns: now,
            addr: cfg.node_v4,
            port,
            state,
            _pad: 0,
        };
        return match NAT_FWD_V4.insert(key, fwd, u64::from(BPF_NOEXIST)) {
            Ok(()) => CLAIMED,
            // Another CPU translated the same new flow first: its entry
            // serves, this port goes back.
            Err(e) if e == -EEXIST => {
                let _ = NAT_REV_V4.remove(rkey);
                CLAIMED
            }
            Err(_) => {
                let _ = NAT_REV_V4.remove(rkey);
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

/// `from_native` for IPv4: reverse-translates replies and ICMP errors of
/// translated flows; everything else passes untouched.
#[inline(always)]
pub(crate) fn ingress_v4(ctx: &TcContext) -> i32 {
    let cfg = config();
    if cfg.flags & masq_flags::ENABLED_V4 == 0 {
        return NEXT;
    }
    let Some(ip) = read::<[u8; 20]>(ctx, IP) else {
        return NEXT;
    };
    let dst: V4Addr = [ip[16], ip[17], ip[18], ip[19]];
    if dst != cfg.node_v4 || ip[0] != 0x45 || u16::from_be_bytes([ip[6], ip[7]]) & 0x3fff != 0 {
        return NEXT;
    }
    let Some(flow) = parse_l4(ctx, L4_V4, ip[9], 0, true) else {
        if ip[9] == ICMP {
            return icmp_error_v4(ctx, &ip, &cfg);
        }
        return NEXT;
    };
    // The replies of every live translation, an earlier range's included.
    let (lo, hi) = cfg.reply_ports();
    if flow.dport < lo || flow.dport > hi {
        return NEXT;
    }
    let key = NatKeyV4 {
        src_addr: [ip[12], ip[13], ip[14], ip[15]],
        dst_addr: dst,
        src_port: flow.sport,
        dst_port: flow.dport,
        proto: flow.proto,
        _pad: [0; 3],
    };
    let Some(v) = NAT_REV_V4.get_ptr_mut(key) else {
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
    let port_at = if flow.proto == ICMP {
        L4_V4 + 4
    } else {
        L4_V4 + 2
    };
    let fixed = rewrite_v4(
        ctx,
        &flow,
        u16::from_ne_bytes([ip[10], ip[11]]),
        IP + V4_DST,
        (dst, addr),
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

/// An ICMP error (destination unreachable, time exceeded) to the node
/// address that quotes a translated packet: the outer destination, the
/// quoted source address and port, the quoted IP checksum and the ICMP
/// checksum are rewritten for the endpoint. The quoted L4 checksum is left
/// as it is (often not quoted at all; no stack checks it).
// Not inlined: a rare path, with its own stack frame.
#[inline(never)]
fn icmp_error_v4(ctx: &TcContext, ip: &[u8; 20], cfg: &MasqConfig) -> i32 {
    const INNER: usize = L4_V4 + 8;
    const INNER_L4: usize = INNER + 20;
    let Some(icmp) = read::<[u8; 2]>(ctx, L4_V4) else {
        return NEXT;
    };
    // 3: destination unreachable (incl. fragmentation needed), 11: time exceeded.
    if icmp[0] != 3 && icmp[0] != 11 {
        return NEXT;
    }
    let Some(inner) = read::<[u8; 20]>(ctx, INNER) else {
        return NEXT;
    };
    let node: V4Addr = [inner[12], inner[13], inner[14], inner[15]];
    if inner[0] != 0x45 || node != cfg.node_v4 {
        return NEXT;
    }
    let Some(quoted) = parse_l4(ctx, INNER_L4, inner[9], 8, false) else {
        return NEXT;
    };
    // The quoted packet went out: its source port is the translated one.
    let key = NatKeyV4 {
        src_addr: [inner[16], inner[17], inner[18], inner[19]],
        dst_addr: node,
        src_port: quoted.dport,
        dst_port: quoted.sport,
        proto: quoted.proto,
        _pad: [0; 3],
    };
    // SAFETY: copied out at once.
    let Some(&e) = (unsafe { NAT_REV_V4.get(key) }) else {
        return NEXT;
    };
    let outer_dst: V4Addr = [ip[16], ip[17], ip[18], ip[19]];
    let outer_check = csum_replace4(
        u16::from_ne_bytes([ip[10], ip[11]]),
        u32::from_ne_bytes(outer_dst),
        u32::from_ne_bytes(e.addr),
    );
    let inner_old = u16::from_ne_bytes([inner[10], inner[11]]);
    let inner_check = csum_replace4(
        inner_old,
        u32::from_ne_bytes(node),
        u32::from_ne_bytes(e.addr),
    );
    let port_at = if quoted.proto == ICMP {
        INNER_L4 + 4
    } else {
        INNER_L4
    };
    let csum = L4_V4 + 2;
    let done = write(ctx, IP + V4_DST, e.addr)
        .and_then(|()| write(ctx, IP + V4_CSUM, outer_check.to_ne_bytes()))
        .and_then(|()| write(ctx, INNER + V4_SRC, e.addr))
        .and_then(|()| write(ctx, INNER + V4_CSUM, inner_check.to_ne_bytes()))
        .and_then(|()| write(ctx, port_at, e.port.to_be_bytes()))
        .is_some()
        && ctx
            .l4_csum_replace(csum, ne32(node), ne32(e.addr), 4)
            .is_ok()
        && ctx
            .l4_csum_replace(csum, u64::from(inner_old), u64::from(inner_check), 2)
            .is_ok()
        && ctx
            .l4_csum_replace(
                csum,
                u64::from(ne16(quoted.sport)),
                u64::from(ne16(e.port)),
                2,
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
fn exhausted_event(ctx: &TcContext, key: &NatKeyV4) {
    info!(
        ctx,
        "to_native: no free masquerade port for {:i}:{} to {:i}:{} (protocol {}), dropped",
        key.src_addr,
        key.src_port,
        key.dst_addr,
        key.dst_port,
        key.proto
    );
}
