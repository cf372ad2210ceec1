//! IPv4: `to_native` source translation, `from_native` reverse
//! translation of replies, their fragments and ICMP errors.

use core::ptr::addr_of_mut;

use aya_ebpf::{bindings::BPF_NOEXIST, btf_maps::lpm_trie::Key, programs::TcContext};
use aya_log_ebpf::info;
use lockstep_common::{
    Counter, MasqConfig, NatFragKeyV4, NatFragValue, NatKeyV4, NatValueV4, PORT_TRIES, V4Addr,
    endpoint_key_v4, masq_flags, nat_state,
};

use super::{
    CLAIMED, EEXIST, Flow, ICMP, IP, L4_V4, NEW_FLOW, SYN_SEEN, TCP, TCP_RST, V4_CSUM, V4_DST,
    V4_SRC, candidates, config, csum_replace4, endpoint_held, endpoint_opened, is_cluster,
    is_local_endpoint, ne16, ne32, now_ns, out_bits, parse_l4, parse_quoted, rewrite_v4,
    rst_acceptable, tcp_start, touch, track_out, write,
};
use crate::{
    DROP, IPCACHE_HOST_V4, MASQ_SKIP_V4, NAT_FRAG_V4, NAT_FWD_V4, NAT_REV_V4, NEXT, count,
    events_on, ipcache_v4, read,
};

/// IPv4 "more fragments" flag and fragment offset, in the header's flags
/// and offset field (host order).
const MF: u16 = 0x2000;
const OFFSET: u16 = 0x1fff;

/// The flow of an IPv4 packet leaving the node, with its IP header
/// checksum, when masquerade is on for IPv4 and the packet is of a kind it
/// translates; otherwise the verdict: counted as before masquerade existed,
/// a later fragment translated by address alone, or a local endpoint's
/// untranslatable packet dropped.
#[inline(always)]
fn outgoing_v4(ctx: &TcContext, cfg: &MasqConfig) -> Result<(NatKeyV4, Flow, u16), i32> {
    let Some(ip) = read::<[u8; 20]>(ctx, IP) else {
        count(Counter::Malformed);
        return Err(NEXT);
    };
    let src: V4Addr = [ip[12], ip[13], ip[14], ip[15]];
    let dst: V4Addr = [ip[16], ip[17], ip[18], ip[19]];
    if cfg.flags & masq_flags::ENABLED_V4 == 0 {
        return Err(count_only_v4(src, dst));
    }
    let frag = u16::from_be_bytes([ip[6], ip[7]]);
    if ip[0] == 0x45 && frag & OFFSET != 0 {
        return Err(later_fragment_out_v4(ctx, cfg));
    }
    let flow = if ip[0] == 0x45 {
        parse_l4(ctx, L4_V4, ip[9], 8, false)
    } else {
        None
    };
    let Some(flow) = flow else {
        return Err(untranslatable_v4(src, dst));
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

/// The `nat_lookup` program: [`egress_v4`]'s parsing and lookup alone
/// (the bench's reference). Returns "drop" on a hit, "next" otherwise, so
/// the bench can tell that it measured the hit.
#[inline(always)]
pub(crate) fn lookup_only_v4(ctx: &TcContext) -> i32 {
    let Some(ip) = read::<[u8; 20]>(ctx, IP) else {
        return NEXT;
    };
    let Some(flow) = parse_l4(ctx, L4_V4, ip[9], 8, false) else {
        return NEXT;
    };
    let key = NatKeyV4 {
        src_addr: [ip[12], ip[13], ip[14], ip[15]],
        dst_addr: [ip[16], ip[17], ip[18], ip[19]],
        src_port: flow.sport,
        dst_port: flow.dport,
        proto: flow.proto,
        _pad: [0; 3],
    };
    if NAT_FWD_V4.get_ptr(key).is_some() {
        DROP
    } else {
        NEXT
    }
}

/// `to_native` for IPv4. `restarted`: a SYN's state was restarted already
/// (or the flow is new), translate it; else a SYN on a translated tuple
/// comes back as [`SYN_SEEN`].
#[inline(always)]
pub(crate) fn egress_v4(ctx: &TcContext, restarted: bool) -> i32 {
    let cfg = config();
    let (key, flow, ip_check) = match outgoing_v4(ctx, cfg) {
        Ok(found) => found,
        Err(verdict) => return verdict,
    };
    let Some(v) = NAT_FWD_V4.get_ptr_mut(key) else {
        return NEW_FLOW;
    };
    if flow.is_syn() && !restarted {
        return SYN_SEEN;
    }
    // SAFETY: `v` points at the map value for this run.
    let (addr, port) = unsafe {
        track_out(ctx, addr_of_mut!((*v).ack), addr_of_mut!((*v).win), &flow);
        touch(
            addr_of_mut!((*v).last_seen_ns),
            addr_of_mut!((*v).state),
            out_bits(&flow),
        );
        ((*v).addr, (*v).port)
    };
    let rewritten = rewrite_v4(
        ctx,
        &flow,
        ip_check,
        IP + V4_SRC,
        (key.src_addr, addr),
        flow.port_at(false),
        (flow.sport, port),
    );
    if rewritten.is_none() {
        count(Counter::Malformed);
        return DROP;
    }
    count(Counter::MasqTranslated);
    NEXT
}

/// A SYN going out on a translated tuple: a new connection (or the same
/// one's SYN again). Its state starts afresh in both entries — a tuple
/// whose previous connection closed must not hand "closed" on — and its
/// TCP tracking restarts from this SYN.
// Not inlined: SYNs are rare on an established tuple.
#[inline(never)]
pub(crate) fn syn_out_v4(ctx: &TcContext) {
    let Ok((key, flow, _)) = outgoing_v4(ctx, config()) else {
        return;
    };
    let Some(v) = NAT_FWD_V4.get_ptr_mut(key) else {
        return;
    };
    // SAFETY: `v` points at the map value for this run.
    let (addr, port, state) = unsafe { ((*v).addr, (*v).port, (*v).state) };
    let rkey = NatKeyV4 {
        src_addr: key.dst_addr,
        dst_addr: addr,
        src_port: key.dst_port,
        dst_port: port,
        proto: key.proto,
        _pad: [0; 3],
    };
    let mut closing = state & nat_state::CLOSING;
    if let Some(r) = NAT_REV_V4.get_ptr_mut(rkey) {
        // SAFETY: as above, the reverse entry's value.
        unsafe {
            closing |= (*r).state & nat_state::CLOSING;
            if (*r).state != 0 {
                (*r).state = 0;
            }
        }
    }
    if closing != 0 {
        count(Counter::MasqTcpRestarted);
    }
    let (ack, win, wscale, bits) = tcp_start(ctx, &flow);
    // SAFETY: as above.
    unsafe {
        (*v).state = bits;
        (*v).ack = ack;
        (*v).win = win;
        (*v).wscale = wscale;
    }
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

/// Whether an endpoint's packet from `src` to `dst` is one the masquerade
/// translates: a local endpoint's, to a destination neither in MASQ_SKIP
/// nor inside the cluster. Counts the packets it is not.
#[inline(always)]
fn to_translate_v4(src: V4Addr, dst: V4Addr) -> bool {
    // SAFETY: copied out at once.
    if !is_local_endpoint(unsafe { IPCACHE_HOST_V4.get(src) }) {
        count(Counter::MasqNotEndpoint);
        return false;
    }
    if MASQ_SKIP_V4.get(&Key::new(32, dst)).is_some() || is_cluster(ipcache_v4(dst)) {
        count(Counter::MasqSkipped);
        return false;
    }
    true
}

/// A packet masquerade cannot translate (options, a protocol without
/// ports, an ICMP error of the endpoint's own): passed when it is not a
/// local endpoint's or goes to a destination that keeps endpoint
/// addresses, dropped otherwise — it would leave with the endpoint's
/// address.
// Not inlined: a rare path, with its own stack frame.
#[inline(never)]
fn untranslatable_v4(src: V4Addr, dst: V4Addr) -> i32 {
    if !to_translate_v4(src, dst) {
        return NEXT;
    }
    count(Counter::MasqUntranslatable);
    DROP
}

/// A later fragment (offset ≠ 0: no ports) going out: a local endpoint's
/// to a translated destination leaves with the node address, like its
/// first fragment (the port is in that one only).
// Not inlined: a rare path, with its own stack frame.
#[inline(never)]
fn later_fragment_out_v4(ctx: &TcContext, cfg: &MasqConfig) -> i32 {
    let Some(ip) = read::<[u8; 20]>(ctx, IP) else {
        return NEXT;
    };
    let src: V4Addr = [ip[12], ip[13], ip[14], ip[15]];
    let dst: V4Addr = [ip[16], ip[17], ip[18], ip[19]];
    if !to_translate_v4(src, dst) {
        return NEXT;
    }
    let check = csum_replace4(
        u16::from_ne_bytes([ip[10], ip[11]]),
        u32::from_ne_bytes(src),
        u32::from_ne_bytes(cfg.node_v4),
    );
    if write(ctx, IP + V4_SRC, cfg.node_v4)
        .and_then(|()| write(ctx, IP + V4_CSUM, check.to_ne_bytes()))
        .is_none()
    {
        count(Counter::Malformed);
        return DROP;
    }
    count(Counter::MasqFragTranslated);
    NEXT
}

/// A flow without a forward entry: translated only when its source is a
/// local endpoint and its destination neither in MASQ_SKIP nor inside the
/// cluster, and the endpoint holds fewer than `endpoint_max` translations;
/// then claims a translated port (the reverse entry, inserted
/// with `BPF_NOEXIST`) and records the forward entry. Returns
/// [`CLAIMED`] (the forward entry exists now) or the verdict of a packet
/// not to translate or to drop.
// Not inlined: a rare path, with its own stack frame.
#[inline(never)]
pub(crate) fn new_flow_v4(ctx: &TcContext) -> i32 {
    let cfg = config();
    let (key, flow) = match outgoing_v4(ctx, cfg) {
        Ok(found) => (found.0, found.1),
        Err(verdict) => return verdict,
    };
    if !to_translate_v4(key.src_addr, key.dst_addr) {
        return NEXT;
    }
    let ep = endpoint_key_v4(key.src_addr);
    if cfg.endpoint_max != 0 && endpoint_held(&ep) >= u64::from(cfg.endpoint_max) {
        count(Counter::MasqEndpointLimit);
        return DROP;
    }
    let (ack, win, wscale, bits) = tcp_start(ctx, &flow);
    let state = flow.state_bits(nat_state::FIN_OUT) | bits;
    let (start, range, tries) = candidates(cfg);
    let now = now_ns();
    let back = NatValueV4 {
        last_seen_ns: now,
        addr: key.src_addr,
        port: key.src_port,
        ..NatValueV4::default()
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
            wscale,
            ack,
            win,
            _pad: 0,
        };
        return match NAT_FWD_V4.insert(key, fwd, u64::from(BPF_NOEXIST)) {
            Ok(()) => {
                endpoint_opened(&ep);
                CLAIMED
            }
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

/// `from_native` for IPv4: reverse-translates replies, their later
/// fragments and ICMP errors of translated flows; everything else passes
/// untouched.
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
    if dst != cfg.node_v4 || ip[0] != 0x45 {
        return NEXT;
    }
    let frag = u16::from_be_bytes([ip[6], ip[7]]);
    if frag & OFFSET != 0 {
        return later_fragment_in_v4(ctx, &ip);
    }
    let Some(flow) = parse_l4(ctx, L4_V4, ip[9], 0, true) else {
        if ip[9] == ICMP {
            return icmp_error_v4(ctx, &ip, cfg);
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
    let (addr, port) = unsafe { ((*v).addr, (*v).port) };
    let mut bits = flow.state_bits(nat_state::FIN_IN) | nat_state::REPLIED;
    if flow.proto == TCP
        && flow.tcp_flags & TCP_RST != 0
        && !rst_in_window_v4(ctx, &key, addr, port, &flow)
    {
        bits &= !nat_state::RST;
    }
    // SAFETY: as above.
    unsafe {
        touch(
            addr_of_mut!((*v).last_seen_ns),
            addr_of_mut!((*v).state),
            bits,
        );
    }
    let fixed = rewrite_v4(
        ctx,
        &flow,
        u16::from_ne_bytes([ip[10], ip[11]]),
        IP + V4_DST,
        (dst, addr),
        flow.port_at(true),
        (flow.dport, port),
    )
    .is_some();
    if !fixed {
        count(Counter::Malformed);
        return DROP;
    }
    if frag & MF != 0 {
        first_fragment_in_v4(&ip, addr);
    }
    count(Counter::MasqReversed);
    NEXT
}

/// Whether a RST from the remote (reverse key `key`, translated back to
/// `addr`:`port`) lies in the endpoint's window (see
/// [`rst_acceptable`]); counted when it does not. A flow whose forward
/// entry is gone cannot be judged: accepted.
// Not inlined: RSTs are rare.
#[inline(never)]
fn rst_in_window_v4(ctx: &TcContext, key: &NatKeyV4, addr: V4Addr, port: u16, flow: &Flow) -> bool {
    let fkey = NatKeyV4 {
        src_addr: addr,
        dst_addr: key.src_addr,
        src_port: port,
        dst_port: key.src_port,
        proto: key.proto,
        _pad: [0; 3],
    };
    // SAFETY: copied out at once.
    let Some(&f) = (unsafe { NAT_FWD_V4.get(fkey) }) else {
        return true;
    };
    if rst_acceptable(ctx, flow, (f.ack, f.win, f.wscale, f.state)) {
        return true;
    }
    count(Counter::MasqRstIgnored);
    false
}

/// The first fragment of a datagram was translated back to `addr`: its
/// later fragments (same source, identification, protocol) follow.
// Not inlined: a rare path, with its own stack frame.
#[inline(never)]
fn first_fragment_in_v4(ip: &[u8; 20], addr: V4Addr) {
    let key = NatFragKeyV4 {
        src_addr: [ip[12], ip[13], ip[14], ip[15]],
        dst_addr: [ip[16], ip[17], ip[18], ip[19]],
        id: u16::from_ne_bytes([ip[4], ip[5]]),
        proto: ip[9],
        _pad: 0,
    };
    let mut value = NatFragValue::default();
    value.addr[..4].copy_from_slice(&addr);
    let _ = NAT_FRAG_V4.insert(key, value, 0);
}

/// A later fragment to the node address: translated to where its first
/// fragment went, or left as it is (counted) when that was not seen.
// Not inlined: a rare path, with its own stack frame.
#[inline(never)]
fn later_fragment_in_v4(ctx: &TcContext, ip: &[u8; 20]) -> i32 {
    let key = NatFragKeyV4 {
        src_addr: [ip[12], ip[13], ip[14], ip[15]],
        dst_addr: [ip[16], ip[17], ip[18], ip[19]],
        id: u16::from_ne_bytes([ip[4], ip[5]]),
        proto: ip[9],
        _pad: 0,
    };
    // SAFETY: copied out at once.
    let Some(&e) = (unsafe { NAT_FRAG_V4.get(key) }) else {
        count(Counter::MasqFragUnknown);
        return NEXT;
    };
    let addr: V4Addr = [e.addr[0], e.addr[1], e.addr[2], e.addr[3]];
    let check = csum_replace4(
        u16::from_ne_bytes([ip[10], ip[11]]),
        u32::from_ne_bytes(key.dst_addr),
        u32::from_ne_bytes(addr),
    );
    if write(ctx, IP + V4_DST, addr)
        .and_then(|()| write(ctx, IP + V4_CSUM, check.to_ne_bytes()))
        .is_none()
    {
        count(Counter::Malformed);
        return DROP;
    }
    count(Counter::MasqFragTranslated);
    NEXT
}

/// An ICMP error (destination unreachable, time exceeded) to the node
/// address that quotes a translated packet — at least its ports, the 8
/// bytes RFC 792 requires: the outer destination, the quoted source
/// address and port, the quoted IP checksum and the ICMP checksum are
/// rewritten for the endpoint. The quoted L4 checksum is left as it is
/// (often not quoted at all; no stack checks it).
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
    let Some(quoted) = parse_quoted(ctx, INNER_L4, inner[9], 8) else {
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
