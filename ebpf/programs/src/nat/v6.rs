//! IPv6: `to_native` source translation, `from_native` reverse
//! translation of replies, their fragments and ICMPv6 errors.

use core::ptr::addr_of_mut;

use aya_ebpf::{
    bindings::{BPF_F_PSEUDO_HDR, BPF_NOEXIST},
    btf_maps::lpm_trie::Key,
    programs::TcContext,
};
use aya_log_ebpf::info;
use lockstep_common::{
    Counter, MasqConfig, NatFragKeyV6, NatFragValue, NatKeyV6, NatValueV6, PORT_TRIES, V6Addr,
    endpoint_key_v6, masq_flags, nat_state,
};

use super::{
    ADMITTED, BPF_F_IPV6, CLAIMED, COUNT_ONLY, EEXIST, FIRST_FRAGMENT, FRAGMENT, Flow, ICMP_ERROR,
    ICMPV6, IP, IPV6_FRAGMENT, L4_V6, LATER_FRAGMENT, NEW_FLOW, RST_SEEN, SYN_SEEN, TCP, TCP_RST,
    UNTRANSLATABLE, V6_DST, V6_SRC, candidates, config, csum_add, csum_diff16, endpoint_held,
    endpoint_opened, is_cluster, is_local_endpoint, l4_csum, ne16, now_ns, out_bits, parse_l4,
    parse_quoted, rewrite_v6, rst_acceptable, tcp_start, touch, track_out, write,
};
use crate::{
    DROP, IPCACHE_HOST_V6, MASQ_SKIP_V6, NAT_FRAG_V6, NAT_FWD_V6, NAT_REV_V6, NEXT, count,
    events_on, ipcache_v6, read,
};

/// The fragment offset in a fragment header's offset word (host order),
/// and its "more fragments" flag.
const OFFSET: u16 = 0xfff8;
const MF: u16 = 0x0001;

/// See [`outgoing_v4`](super::v4). A fragment header (and only one) may
/// come before the L4 header. The packets it does not translate come back
/// as [`COUNT_ONLY`], [`UNTRANSLATABLE`] or [`LATER_FRAGMENT`], for
/// [`aside_v6`] in `to_native`'s own frame (the established path's frame
/// has no room left for another call).
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
    if cfg.flags & masq_flags::ENABLED_V6 == 0 {
        return Err(COUNT_ONLY);
    }
    let (l4, proto) = if next == IPV6_FRAGMENT {
        // One 8-byte load, kept in a register.
        let Some(f) = read::<u64>(ctx, L4_V6).map(u64::to_ne_bytes) else {
            return Err(UNTRANSLATABLE);
        };
        if u16::from_be_bytes([f[2], f[3]]) & OFFSET != 0 {
            return Err(LATER_FRAGMENT);
        }
        (L4_V6 + 8, f[0])
    } else {
        (L4_V6, next)
    };
    let Some(flow) = parse_l4(ctx, l4, proto, 128, false) else {
        return Err(UNTRANSLATABLE);
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
// `restarted`: a SYN's state was restarted already (or the flow is new),
// translate it; else a SYN comes back as [`SYN_SEEN`].
// `L4`: where this copy expects the L4 header; a packet whose header is
// elsewhere comes back as [`FRAGMENT`].
#[inline(never)]
pub(crate) fn egress_v6<const L4: usize>(ctx: &TcContext, restarted: bool) -> i32 {
    let cfg = config();
    let (key, flow) = match outgoing_v6(ctx, cfg) {
        Ok(found) => found,
        Err(verdict) => return verdict,
    };
    if flow.l4 != L4 {
        return FRAGMENT;
    }
    let flow = Flow { l4: L4, ..flow };
    let Some(v) = NAT_FWD_V6.get_ptr_mut(key) else {
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
    let rewritten = rewrite_v6(
        ctx,
        &flow,
        IP + V6_SRC,
        (&key.src_addr, &addr),
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

/// See `syn_out_v4`: the SYN `egress_v6` saw on a translated tuple.
// Not inlined: SYNs are rare on an established tuple.
#[inline(never)]
pub(crate) fn syn_out_v6(ctx: &TcContext) {
    let Ok((key, flow)) = outgoing_v6(ctx, config()) else {
        return;
    };
    let Some(v) = NAT_FWD_V6.get_ptr_mut(key) else {
        return;
    };
    // SAFETY: `v` points at the map value for this run.
    let (addr, port, state) = unsafe { ((*v).addr, (*v).port, (*v).state) };
    let rkey = NatKeyV6 {
        src_addr: key.dst_addr,
        dst_addr: addr,
        src_port: key.dst_port,
        dst_port: port,
        proto: key.proto,
        _pad: [0; 3],
    };
    let mut closing = state & nat_state::CLOSING;
    if let Some(r) = NAT_REV_V6.get_ptr_mut(rkey) {
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

/// See `to_translate_v4`.
#[inline(always)]
fn to_translate_v6(src: &V6Addr, dst: &V6Addr) -> bool {
    // SAFETY: copied out at once.
    if !is_local_endpoint(unsafe { IPCACHE_HOST_V6.get(src) }) {
        count(Counter::MasqNotEndpoint);
        return false;
    }
    if MASQ_SKIP_V6.get(&Key::new(128, *dst)).is_some() || is_cluster(ipcache_v6(*dst)) {
        count(Counter::MasqSkipped);
        return false;
    }
    true
}

/// See `untranslatable_v4`: extension headers other than one fragment
/// header, protocols without ports, the endpoint's own ICMPv6 errors.
#[inline(always)]
fn untranslatable_v6(src: &V6Addr, dst: &V6Addr) -> i32 {
    if !to_translate_v6(src, dst) {
        return NEXT;
    }
    count(Counter::MasqUntranslatable);
    DROP
}

/// See `later_fragment_out_v4` (IPv6 has no header checksum).
#[inline(always)]
fn later_fragment_out_v6(ctx: &TcContext, src: &V6Addr, dst: &V6Addr) -> i32 {
    if !to_translate_v6(src, dst) {
        return NEXT;
    }
    if write(ctx, IP + V6_SRC, config().node_v6).is_none() {
        count(Counter::Malformed);
        return DROP;
    }
    count(Counter::MasqFragTranslated);
    NEXT
}

/// `to_native`'s IPv6 packets that [`outgoing_v6`] set aside: counted
/// (masquerade off for IPv6), dropped (a local endpoint's untranslatable
/// packet) or, a later fragment, translated by its address alone.
// Not inlined: rare paths, with their own frame.
#[inline(never)]
pub(crate) fn aside_v6(ctx: &TcContext, code: i32) -> i32 {
    let (Some(src), Some(dst)) = (
        read::<V6Addr>(ctx, IP + V6_SRC),
        read::<V6Addr>(ctx, IP + V6_DST),
    ) else {
        count(Counter::Malformed);
        return NEXT;
    };
    match code {
        COUNT_ONLY => count_only_v6(&src, &dst),
        UNTRANSLATABLE => untranslatable_v6(&src, &dst),
        _ => later_fragment_out_v6(ctx, &src, &dst),
    }
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
    let (key, _) = match outgoing_v6(ctx, cfg) {
        Ok(found) => found,
        Err(verdict) => return verdict,
    };
    if !to_translate_v6(&key.src_addr, &key.dst_addr) {
        return NEXT;
    }
    if cfg.endpoint_max != 0
        && endpoint_held(&endpoint_key_v6(key.src_addr)) >= u64::from(cfg.endpoint_max)
    {
        count(Counter::MasqEndpointLimit);
        return DROP;
    }
    ADMITTED
}

/// The TCP tracking a new IPv6 flow starts with ([`tcp_start`]), packed
/// into one register for `claim_v6`: ack (bits 0–31), window (32–47),
/// window scale (48–55), state bits (56–63).
// Not inlined: its frame (and the options' reading) stays out of
// claim_v6's.
#[inline(never)]
pub(crate) fn tcp_start_v6(ctx: &TcContext) -> u64 {
    let Ok((_, flow)) = outgoing_v6(ctx, config()) else {
        return 0;
    };
    let (ack, win, wscale, bits) = tcp_start(ctx, &flow);
    u64::from(ack) | u64::from(win) << 32 | u64::from(wscale) << 48 | u64::from(bits) << 56
}

/// The second half of [`new_flow_v4`] for IPv6: claims a port and records
/// the flow with its TCP tracking `tcp` (from [`tcp_start_v6`]);
/// [`CLAIMED`] or the verdict.
// Not inlined: a rare path, with its own stack frame.
#[inline(never)]
pub(crate) fn claim_v6(ctx: &TcContext, tcp: u64) -> i32 {
    let cfg = config();
    let (key, flow) = match outgoing_v6(ctx, cfg) {
        Ok(found) => found,
        Err(verdict) => return verdict,
    };
    let (ack, win, wscale, bits) = (
        tcp as u32,
        (tcp >> 32) as u16,
        (tcp >> 48) as u8,
        (tcp >> 56) as u8,
    );
    let state = flow.state_bits(nat_state::FIN_OUT) | bits;
    let (start, range, tries) = candidates(cfg);
    let now = now_ns();
    let back = NatValueV6 {
        last_seen_ns: now,
        addr: key.src_addr,
        port: key.src_port,
        ..NatValueV6::default()
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
            wscale,
            ack,
            win,
            _pad: 0,
            _pad2: 0,
        };
        return match NAT_FWD_V6.insert(key, fwd, u64::from(BPF_NOEXIST)) {
            Ok(()) => {
                endpoint_opened(&endpoint_key_v6(key.src_addr));
                CLAIMED
            }
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

/// The reply tuple of an IPv6 packet arriving for the node address, its
/// flow and whether it is a datagram's first fragment; or the verdict.
#[inline(always)]
fn incoming_v6(ctx: &TcContext, cfg: &MasqConfig) -> Result<(NatKeyV6, Flow, bool), i32> {
    let (Some(next), Some(src), Some(dst)) = (
        read::<u8>(ctx, IP + 6),
        read::<V6Addr>(ctx, IP + V6_SRC),
        read::<V6Addr>(ctx, IP + V6_DST),
    ) else {
        return Err(NEXT);
    };
    if dst != cfg.node_v6 {
        return Err(NEXT);
    }
    let mut first = false;
    let (l4, proto) = if next == IPV6_FRAGMENT {
        let Some(f) = read::<u64>(ctx, L4_V6).map(u64::to_ne_bytes) else {
            return Err(NEXT);
        };
        let word = u16::from_be_bytes([f[2], f[3]]);
        if word & OFFSET != 0 {
            return Err(LATER_FRAGMENT);
        }
        first = word & MF != 0;
        (L4_V6 + 8, f[0])
    } else {
        (L4_V6, next)
    };
    let Some(flow) = parse_l4(ctx, l4, proto, 129, true) else {
        if next == ICMPV6 {
            return Err(ICMP_ERROR);
        }
        return Err(NEXT);
    };
    // The replies of every live translation, an earlier range's included.
    let (lo, hi) = cfg.reply_ports();
    if flow.dport < lo || flow.dport > hi {
        return Err(NEXT);
    }
    let key = NatKeyV6 {
        src_addr: src,
        dst_addr: dst,
        src_port: flow.sport,
        dst_port: flow.dport,
        proto: flow.proto,
        _pad: [0; 3],
    };
    Ok((key, flow, first))
}

/// `from_native` for IPv6; see [`ingress_v4`]. Comes back, for
/// `from_native_v6` to call what its frame has no room for, as
/// [`ICMP_ERROR`] (an ICMPv6 packet that is no echo reply),
/// [`LATER_FRAGMENT`], [`RST_SEEN`] (`rst` is [`rst::ASK`] and the packet
/// a RST) or [`FIRST_FRAGMENT`] (translated).
// Not inlined: from_native calls it and icmp_error_v6 side by side, so
// only the larger of their frames adds to its own.
#[inline(never)]
pub(crate) fn ingress_v6(ctx: &TcContext, rst: u8) -> i32 {
    let cfg = config();
    if cfg.flags & masq_flags::ENABLED_V6 == 0 {
        return NEXT;
    }
    let (key, flow, first) = match incoming_v6(ctx, cfg) {
        Ok(found) => found,
        Err(verdict) => return verdict,
    };
    let Some(v) = NAT_REV_V6.get_ptr_mut(key) else {
        return NEXT;
    };
    let is_rst = flow.proto == TCP && flow.tcp_flags & TCP_RST != 0;
    if is_rst && rst == super::rst::ASK {
        return RST_SEEN;
    }
    let mut bits = flow.state_bits(nat_state::FIN_IN) | nat_state::REPLIED;
    if is_rst && rst == super::rst::IGNORED {
        bits &= !nat_state::RST;
    }
    // SAFETY: `v` points at the map value for this run.
    let (addr, port) = unsafe {
        touch(
            addr_of_mut!((*v).last_seen_ns),
            addr_of_mut!((*v).state),
            bits,
        );
        ((*v).addr, (*v).port)
    };
    let fixed = rewrite_v6(
        ctx,
        &flow,
        IP + V6_DST,
        (&key.dst_addr, &addr),
        flow.port_at(true),
        (flow.dport, port),
    )
    .is_some();
    if !fixed {
        count(Counter::Malformed);
        return DROP;
    }
    count(Counter::MasqReversed);
    if first { FIRST_FRAGMENT } else { NEXT }
}

/// See `rst_in_window_v4`: the RST `ingress_v6` saw.
// Not inlined: RSTs are rare.
#[inline(never)]
pub(crate) fn rst_in_window_v6(ctx: &TcContext) -> bool {
    let Ok((key, flow, _)) = incoming_v6(ctx, config()) else {
        return true;
    };
    // SAFETY: copied out at once.
    let Some(&r) = (unsafe { NAT_REV_V6.get(key) }) else {
        return true;
    };
    let fkey = NatKeyV6 {
        src_addr: r.addr,
        dst_addr: key.src_addr,
        src_port: r.port,
        dst_port: key.src_port,
        proto: key.proto,
        _pad: [0; 3],
    };
    // SAFETY: copied out at once.
    let Some(&f) = (unsafe { NAT_FWD_V6.get(fkey) }) else {
        return true;
    };
    if rst_acceptable(ctx, &flow, (f.ack, f.win, f.wscale, f.state)) {
        return true;
    }
    count(Counter::MasqRstIgnored);
    false
}

/// The fragment header's identification and next header of a packet
/// whose first extension header is one (`None` otherwise).
#[inline(always)]
fn fragment_of(ctx: &TcContext) -> Option<(u32, u8)> {
    if read::<u8>(ctx, IP + 6)? != IPV6_FRAGMENT {
        return None;
    }
    let f = read::<u64>(ctx, L4_V6)?.to_ne_bytes();
    Some((u32::from_ne_bytes([f[4], f[5], f[6], f[7]]), f[0]))
}

/// See `first_fragment_in_v4`: the first fragment was translated (its
/// destination is the endpoint's address now); the later ones follow.
// Not inlined: a rare path, with its own stack frame.
#[inline(never)]
pub(crate) fn first_fragment_in_v6(ctx: &TcContext) {
    let (Some((id, proto)), Some(src), Some(addr)) = (
        fragment_of(ctx),
        read::<V6Addr>(ctx, IP + V6_SRC),
        read::<V6Addr>(ctx, IP + V6_DST),
    ) else {
        return;
    };
    let key = NatFragKeyV6 {
        src_addr: src,
        dst_addr: config().node_v6,
        id,
        proto,
        _pad: [0; 3],
    };
    let _ = NAT_FRAG_V6.insert(key, NatFragValue { addr }, 0);
}

/// See `later_fragment_in_v4`.
// Not inlined: a rare path, with its own stack frame.
#[inline(never)]
pub(crate) fn later_fragment_in_v6(ctx: &TcContext) -> i32 {
    let (Some((id, proto)), Some(src), Some(dst)) = (
        fragment_of(ctx),
        read::<V6Addr>(ctx, IP + V6_SRC),
        read::<V6Addr>(ctx, IP + V6_DST),
    ) else {
        return NEXT;
    };
    let key = NatFragKeyV6 {
        src_addr: src,
        dst_addr: dst,
        id,
        proto,
        _pad: [0; 3],
    };
    // SAFETY: copied out at once.
    let Some(&e) = (unsafe { NAT_FRAG_V6.get(key) }) else {
        count(Counter::MasqFragUnknown);
        return NEXT;
    };
    if write(ctx, IP + V6_DST, e.addr).is_none() {
        count(Counter::Malformed);
        return DROP;
    }
    count(Counter::MasqFragTranslated);
    NEXT
}

/// See [`icmp_error_v4`]: destination unreachable (1), packet too big (2)
/// and time exceeded (3), quoting at least the ports. The ICMPv6 checksum covers the pseudo-header, so
/// the outer destination's change enters it too.
// Not inlined: a rare path, with its own stack frame.
#[inline(never)]
pub(crate) fn icmp_error_v6(ctx: &TcContext) -> i32 {
    const INNER: usize = L4_V6 + 8;
    const INNER_L4: usize = INNER + 40;
    let cfg = config();
    // The outer destination and the quoted source are both the node
    // address. Read one by one: a tuple of reads let the compiler merge
    // their failure paths in a way the verifier cannot follow.
    let Some(icmp) = read::<u8>(ctx, L4_V6) else {
        return NEXT;
    };
    if !(1..=3).contains(&icmp) {
        return NEXT;
    }
    let Some(outer_dst) = read::<V6Addr>(ctx, IP + V6_DST) else {
        return NEXT;
    };
    if outer_dst != cfg.node_v6 {
        return NEXT;
    }
    let Some(node) = read::<V6Addr>(ctx, INNER + V6_SRC) else {
        return NEXT;
    };
    if node != cfg.node_v6 {
        return NEXT;
    }
    let Some(next) = read::<u8>(ctx, INNER + 6) else {
        return NEXT;
    };
    let Some(remote) = read::<V6Addr>(ctx, INNER + V6_DST) else {
        return NEXT;
    };
    let Some(quoted) = parse_quoted(ctx, INNER_L4, next, 128) else {
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
