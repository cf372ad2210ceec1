//! lockstep's eBPF programs.
//!
//! All programs live in one object so they share one set of maps; the agent
//! loads the object, pins the maps and attaches each program with TCX.
//!
//! - `from_endpoint` (TC ingress on an endpoint's host-side veth): passes
//!   only untagged IPv4, IPv6 and ARP whose source is the endpoint's
//!   allocated address and MAC (drops VLAN-tagged frames and every other
//!   ethertype), classifies the destination through IPCACHE, counts.
//! - `to_native` (TC egress on the node's uplink): masquerades local
//!   endpoints' traffic to destinations outside the cluster and MASQ_SKIP
//!   (module [`nat`]); counts only while MASQ_CONFIG leaves it off.
//! - `from_native` (TC ingress on the node's uplink): reverse-translates
//!   replies (and ICMP errors) of masqueraded flows; answers ARP requests for
//!   addresses in L2_RESP_V4 and Neighbor Solicitations for addresses in
//!   L2_RESP_V6 (module [`ndp`]) with the announcing interface's MAC, until
//!   the entry's `expires_ns` has passed.
//! - `from_tunnel` (TC ingress on the tunnel device): decapsulated packets
//!   checked against the outer source and delivered to local endpoints;
//!   `from_endpoint` sends remote blocks flagged `ENCAP` to the tunnel
//!   (module [`tunnel`]).
//! - `noop`: returns "next"; the baseline of the datapath benchmark.
//!
//! Map layouts come from `lockstep-common`; nothing here redefines them.
#![no_std]
#![no_main]
// `ndp` loads and stores misaligned packet words with `asm!` (see there).
#![feature(asm_experimental_arch)]

mod nat;
mod ndp;
mod pkt;
mod tunnel;

use core::mem::size_of;

use aya_ebpf::{
    bindings::{TC_ACT_REDIRECT, TC_ACT_SHOT, TC_ACT_UNSPEC},
    btf_maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, lpm_trie::Key},
    helpers::bpf_redirect,
    macros::{btf_map, classifier},
    programs::TcContext,
};
use aya_log_ebpf::info;
use lockstep_common::{
    Counter, EndpointSlot, EndpointValue, IpcacheValue, L2Resp, L2RespSlot, L2RespSlotV6,
    L2RespValue, MasqConfig, MasqSkipValue, NatClock, NatEndpointKey, NatFragKeyV4, NatFragKeyV6,
    NatFragValue, NatKeyV4, NatKeyV6, NatValueV4, NatValueV6, TunnelConfig, V4Addr, V6Addr,
    endpoint_flags, ipcache_flags, max_entries, slots,
};

#[btf_map]
static IPCACHE_V4: LpmTrie<V4Addr, IpcacheValue, { max_entries::IPCACHE as usize }> =
    LpmTrie::new();
#[btf_map]
static IPCACHE_V6: LpmTrie<V6Addr, IpcacheValue, { max_entries::IPCACHE as usize }> =
    LpmTrie::new();
/// `BPF_F_NO_PREALLOC`: the host tables only cost memory for what they hold.
const NO_PREALLOC: usize = 1;
#[btf_map]
static IPCACHE_HOST_V4: HashMap<
    V4Addr,
    IpcacheValue,
    { max_entries::IPCACHE as usize },
    NO_PREALLOC,
> = HashMap::new();
#[btf_map]
static IPCACHE_HOST_V6: HashMap<
    V6Addr,
    IpcacheValue,
    { max_entries::IPCACHE as usize },
    NO_PREALLOC,
> = HashMap::new();
#[btf_map]
static MASQ_SKIP_V4: LpmTrie<V4Addr, MasqSkipValue, { max_entries::MASQ_SKIP as usize }> =
    LpmTrie::new();
#[btf_map]
static MASQ_SKIP_V6: LpmTrie<V6Addr, MasqSkipValue, { max_entries::MASQ_SKIP as usize }> =
    LpmTrie::new();
#[btf_map]
static ENDPOINTS: HashMap<u32, EndpointValue, { max_entries::ENDPOINTS as usize }> = HashMap::new();
#[btf_map]
static L2_RESP_V4: HashMap<V4Addr, L2RespValue, { max_entries::L2_RESP as usize }> = HashMap::new();
#[btf_map]
static L2_RESP_V6: HashMap<V6Addr, L2RespValue, { max_entries::L2_RESP as usize }> = HashMap::new();
/// `BPF_F_MMAPABLE`: the agent reads the slot arrays through a mapping
/// when it reconciles, instead of one kernel copy per slot.
const MMAPABLE: usize = 1 << 10;
#[btf_map]
static ENDPOINT_SLOTS: Array<EndpointSlot, { max_entries::ENDPOINT_SLOTS as usize }, MMAPABLE> =
    Array::new();
#[btf_map]
static L2_RESP_SLOTS: Array<L2RespSlot, { max_entries::L2_RESP_SLOTS as usize }, MMAPABLE> =
    Array::new();
#[btf_map]
static L2_RESP6_SLOTS: Array<L2RespSlotV6, { max_entries::L2_RESP6_SLOTS as usize }, MMAPABLE> =
    Array::new();
#[btf_map]
static COUNTERS: PerCpuArray<u64, { max_entries::COUNTERS as usize }> = PerCpuArray::new();
#[btf_map]
static DATAPATH_DEBUG: Array<u32, 1> = Array::new();
#[btf_map]
static NAT_FWD_V4: HashMap<NatKeyV4, NatValueV4, { max_entries::NAT as usize }> = HashMap::new();
#[btf_map]
static NAT_FWD_V6: HashMap<NatKeyV6, NatValueV6, { max_entries::NAT as usize }> = HashMap::new();
#[btf_map]
static NAT_REV_V4: HashMap<NatKeyV4, NatValueV4, { max_entries::NAT as usize }> = HashMap::new();
#[btf_map]
static NAT_REV_V6: HashMap<NatKeyV6, NatValueV6, { max_entries::NAT as usize }> = HashMap::new();
#[btf_map]
static MASQ_CONFIG: Array<MasqConfig, 1> = Array::new();
#[btf_map]
static NAT_CLOCK: PerCpuArray<NatClock, 1> = PerCpuArray::new();
#[btf_map]
static TUNNEL_CONFIG: Array<TunnelConfig, 1> = Array::new();
#[btf_map]
static NAT_FRAG_V4: LruHashMap<NatFragKeyV4, NatFragValue, { max_entries::NAT_FRAG as usize }> =
    LruHashMap::new();
#[btf_map]
static NAT_FRAG_V6: LruHashMap<NatFragKeyV6, NatFragValue, { max_entries::NAT_FRAG as usize }> =
    LruHashMap::new();
#[btf_map]
static NAT_EP_OPENED: HashMap<NatEndpointKey, u64, { max_entries::NAT_EP as usize }, NO_PREALLOC> =
    HashMap::new();
#[btf_map]
static NAT_EP_CLOSED: HashMap<NatEndpointKey, u64, { max_entries::NAT_EP as usize }, NO_PREALLOC> =
    HashMap::new();

/// Whether rare events are reported (see `lockstep_common::debug`): one
/// inlined array read, done only on the paths that report.
#[inline(always)]
fn events_on() -> bool {
    DATAPATH_DEBUG
        .get(0)
        .is_some_and(|v| *v != lockstep_common::debug::OFF)
}

/// "Continue": the next TCX program (or the stack) decides.
const NEXT: i32 = TC_ACT_UNSPEC;
const DROP: i32 = TC_ACT_SHOT;

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86DD;
const ETH_P_ARP: u16 = 0x0806;
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88A8;
/// Offsets from the start of the frame.
const IP4_SRC: usize = ETH_HLEN + 12;
const IP4_DST: usize = ETH_HLEN + 16;
const IP6_SRC: usize = ETH_HLEN + 8;
const IP6_DST: usize = ETH_HLEN + 24;
/// Ethernet + ARP for IPv4 over Ethernet.
const ARP_FRAME_LEN: usize = ETH_HLEN + 28;

#[inline(always)]
fn count(counter: Counter) {
    if let Some(slot) = COUNTERS.get_ptr_mut(counter as u32) {
        // SAFETY: per-CPU slot, only this CPU writes it while the program runs.
        unsafe { *slot += 1 };
    }
}

/// Reads a `T` at `offset` by direct packet access, pulling non-linear data in
/// first when the headers are not in the linear part.
#[inline(always)]
fn read<T: Copy>(ctx: &TcContext, offset: usize) -> Option<T> {
    let end = offset + size_of::<T>();
    if ctx.data() + end > ctx.data_end() {
        ctx.pull_data(end as u32).ok()?;
        if ctx.data() + end > ctx.data_end() {
            return None;
        }
    }
    // SAFETY: bounds checked against data_end just above.
    Some(unsafe { ((ctx.data() + offset) as *const T).read_unaligned() })
}

#[inline(always)]
fn ethertype(ctx: &TcContext) -> Option<u16> {
    read::<[u8; 2]>(ctx, 12).map(u16::from_be_bytes)
}

#[inline(always)]
fn ifindex(ctx: &TcContext) -> u32 {
    // SAFETY: the context pointer is valid for the program's run.
    unsafe { (*ctx.skb.skb).ifindex }
}

/// The endpoint behind `ifindex`: its slot when the slot holds it intact (an
/// inlined array lookup), else the ENDPOINTS hash. See `lockstep_common::slots`
/// for why a half-written slot can never check out.
/// IPv4 and ARP packets (`v6` false) read and check only the slot's leading
/// words; the IPv6 address comes back zero then.
#[inline(always)]
fn endpoint(ifindex: u32, v6: bool) -> Option<lockstep_common::EndpointAddrs> {
    if let Some(p) = ENDPOINT_SLOTS.get_ptr(slots::endpoint(ifindex)) {
        if !v6 {
            let p = p.cast::<[u32; EndpointSlot::V4_WORDS]>();
            // SAFETY: as below.
            let (copy, again) = unsafe {
                let copy = core::ptr::read_volatile(p);
                (copy, core::ptr::read_volatile(p.cast::<u32>()))
            };
            if again == ifindex
                && let Some((flags, v4, mac)) = EndpointSlot::check_v4(&copy, ifindex)
            {
                return Some((flags, v4, [0; 16], mac));
            }
            return endpoint_hash(ifindex);
        }
        let p = p.cast::<[u32; EndpointSlot::WORDS]>();
        // SAFETY: `p` points into the array's value area (4-aligned) for this
        // run; the volatile reads keep the copy before the key's re-read.
        let (copy, again) = unsafe {
            let copy = core::ptr::read_volatile(p);
            (copy, core::ptr::read_volatile(p.cast::<u32>()))
        };
        if again == ifindex
            && let Some(found) = EndpointSlot::check(&copy, ifindex)
        {
            return Some(found);
        }
    }
    endpoint_hash(ifindex)
}

/// How often a hash value whose copy fails its seal is looked up again.
const SEAL_TRIES: usize = 3;

/// The ENDPOINTS entry of `ifindex`, copied word by word and accepted only
/// when its seal holds (see `lockstep_common::seal`: the kernel may reuse the
/// element for a rewrite while it is copied). A copy that fails is looked up
/// again; an entry that never checks out reads as absent.
#[inline(always)]
fn endpoint_hash(ifindex: u32) -> Option<lockstep_common::EndpointAddrs> {
    for _ in 0..SEAL_TRIES {
        let p = ENDPOINTS
            .get_ptr(ifindex)?
            .cast::<[u32; EndpointValue::WORDS]>();
        // SAFETY: `p` points at a value of the map (8-aligned) for this run;
        // the volatile read copies it once, and the seal judges the copy.
        let copy = unsafe { core::ptr::read_volatile(p) };
        if let Some(found) = EndpointValue::open(&copy, ifindex) {
            return Some(found);
        }
        count(Counter::SealRetried);
    }
    None
}

/// The L2_RESP_V4 entry for `addr`, through its slot first (see [`endpoint`]).
#[inline(always)]
fn l2_resp(addr: V4Addr) -> Option<L2Resp> {
    if let Some(p) = L2_RESP_SLOTS.get_ptr(slots::l2_resp(addr)) {
        let p = p.cast::<[u32; L2RespSlot::WORDS]>();
        // SAFETY: as in `endpoint`.
        let (copy, again) = unsafe {
            let copy = core::ptr::read_volatile(p);
            (copy, core::ptr::read_volatile(p.cast::<u32>()))
        };
        if again == u32::from_ne_bytes(addr)
            && let Some(found) = L2RespSlot::check(&copy, addr)
        {
            return Some(found);
        }
    }
    for _ in 0..SEAL_TRIES {
        let p = L2_RESP_V4
            .get_ptr(addr)?
            .cast::<[u32; L2RespValue::WORDS]>();
        // SAFETY: as in `endpoint_hash`.
        let copy = unsafe { core::ptr::read_volatile(p) };
        if let Some(found) = L2RespValue::open(&copy, addr) {
            return Some(found);
        }
        count(Counter::SealRetried);
    }
    None
}

/// Longest-prefix match over the IPCACHE: the host entry if there is one (it
/// is always the longest match), else the trie.
#[inline(always)]
fn ipcache_v4(addr: V4Addr) -> Option<IpcacheValue> {
    // SAFETY: copied out at once.
    match unsafe { IPCACHE_HOST_V4.get(addr) } {
        Some(v) => Some(*v),
        None => IPCACHE_V4.get(&Key::new(32, addr)).copied(),
    }
}

/// See [`ipcache_v4`].
#[inline(always)]
fn ipcache_v6(addr: V6Addr) -> Option<IpcacheValue> {
    // SAFETY: copied out at once.
    match unsafe { IPCACHE_HOST_V6.get(addr) } {
        Some(v) => Some(*v),
        None => IPCACHE_V6.get(&Key::new(128, addr)).copied(),
    }
}

#[inline(always)]
fn classify(entry: Option<IpcacheValue>) {
    let counter = match entry {
        None => Counter::DstWorld,
        Some(v) if v.flags & ipcache_flags::ENDPOINT != 0 => Counter::DstEndpoint,
        Some(v)
            if v.flags
                & (ipcache_flags::INGRESS
                    | ipcache_flags::HEALTH
                    | ipcache_flags::ROUTER
                    | ipcache_flags::LOADBALANCER)
                != 0 =>
        {
            Counter::DstService
        }
        Some(_) => Counter::DstCluster,
    };
    count(counter);
}

#[inline(always)]
fn is_link_local_or_unspecified(addr: &V6Addr) -> bool {
    (addr[0] == 0xfe && addr[1] & 0xc0 == 0x80) || *addr == [0u8; 16]
}

/// Whether the frame carries a VLAN tag: in the skb's metadata (on receive
/// the kernel moves the outer 802.1Q/802.1ad tag there before TC runs, and
/// the bytes at offset 12 are then the *next* ethertype, possibly another
/// tag or the inner IPv4), or still in the frame.
#[inline(always)]
fn vlan_tagged(ctx: &TcContext, proto: u16) -> bool {
    // SAFETY: the context pointer is valid for the program's run.
    let in_metadata = unsafe { (*ctx.skb.skb).vlan_present } != 0;
    in_metadata || matches!(proto, ETH_P_8021Q | ETH_P_8021AD | 0x9100 | 0x9200 | 0x9300)
}

/// Anti-spoofing and destination classification for traffic leaving an
/// endpoint. Fails closed: only untagged IPv4, IPv6 and ARP frames from the
/// endpoint's own addresses (and, IPv4 and IPv6, its own MAC) pass; any VLAN tag (ID 0 included, which the
/// stack strips after TC and then routes the inner packet unchecked), any
/// other ethertype, and an interface without an ENDPOINTS entry drop, each
/// counted.
#[classifier]
pub fn from_endpoint(ctx: TcContext) -> i32 {
    let Some(proto) = ethertype(&ctx) else {
        count(Counter::Malformed);
        return DROP;
    };
    if vlan_tagged(&ctx, proto) {
        count(Counter::VlanDropped);
        if events_on() {
            info!(
                &ctx,
                "from_endpoint: dropped a VLAN-tagged frame (ethertype {:x}) on ifindex {}",
                proto,
                ifindex(&ctx)
            );
        }
        return DROP;
    }
    // The stack dispatches on skb->protocol, not on the bytes: both must be
    // one of the three families this program checks.
    if !matches!(proto, ETH_P_IP | ETH_P_IPV6 | ETH_P_ARP)
        || ctx.skb.protocol() != u32::from(proto.to_be())
    {
        count(Counter::EthertypeDropped);
        if events_on() {
            info!(
                &ctx,
                "from_endpoint: dropped a frame of ethertype {:x} on ifindex {}",
                proto,
                ifindex(&ctx)
            );
        }
        return DROP;
    }
    let Some((ep_flags, ep_v4, ep_v6, ep_mac)) = endpoint(ifindex(&ctx), proto == ETH_P_IPV6)
    else {
        count(Counter::UnknownEndpoint);
        return DROP;
    };
    // IPv4 and IPv6 leave with the endpoint's own MAC (ARP's sender is
    // checked against the frame's source below). A MAC of zeros was never
    // recorded (an entry written by hand): not checked.
    if proto != ETH_P_ARP && ep_mac != [0; 6] {
        let Some(src_mac) = read::<[u8; 6]>(&ctx, 6) else {
            count(Counter::Malformed);
            return DROP;
        };
        if src_mac != ep_mac {
            count(Counter::SpoofDroppedMac);
            if events_on() {
                info!(
                    &ctx,
                    "from_endpoint: dropped a frame from {:mac}, not the endpoint's MAC, on ifindex {}",
                    src_mac,
                    ifindex(&ctx)
                );
            }
            return DROP;
        }
    }
    match proto {
        ETH_P_IP => {
            let (Some(src), Some(dst)) =
                (read::<V4Addr>(&ctx, IP4_SRC), read::<V4Addr>(&ctx, IP4_DST))
            else {
                count(Counter::Malformed);
                return DROP;
            };
            if ep_flags & endpoint_flags::HAS_V4 == 0 || src != ep_v4 {
                count(Counter::SpoofDroppedV4);
                if events_on() {
                    info!(
                        &ctx,
                        "from_endpoint: dropped a spoofed IPv4 packet from {:i} on ifindex {}",
                        src,
                        ifindex(&ctx)
                    );
                }
                return DROP;
            }
            let entry = ipcache_v4(dst);
            classify(entry);
            if let Some(e) = entry.filter(|e| e.flags & ipcache_flags::ENCAP != 0) {
                count(Counter::FromEndpointPassed);
                return tunnel::encap(&ctx, &e, false);
            }
        }
        ETH_P_IPV6 => {
            let (Some(src), Some(dst)) =
                (read::<V6Addr>(&ctx, IP6_SRC), read::<V6Addr>(&ctx, IP6_DST))
            else {
                count(Counter::Malformed);
                return DROP;
            };
            // Neighbour discovery uses link-local (and, for DAD, unspecified)
            // sources; they cannot be routed off the link, so they pass.
            if !is_link_local_or_unspecified(&src)
                && (ep_flags & endpoint_flags::HAS_V6 == 0 || src != ep_v6)
            {
                count(Counter::SpoofDroppedV6);
                if events_on() {
                    info!(
                        &ctx,
                        "from_endpoint: dropped a spoofed IPv6 packet from {:i} on ifindex {}",
                        src,
                        ifindex(&ctx)
                    );
                }
                return DROP;
            }
            let entry = ipcache_v6(dst);
            classify(entry);
            if let Some(e) = entry.filter(|e| e.flags & ipcache_flags::ENCAP != 0) {
                count(Counter::FromEndpointPassed);
                return tunnel::encap(&ctx, &e, true);
            }
        }
        _ => {
            // ARP: Ethernet/IPv4 only (what the kernel's ARP accepts on a
            // veth); the sender hardware address must be the frame's source.
            let Some(frame) = read::<[u8; ARP_FRAME_LEN]>(&ctx, 0) else {
                count(Counter::Malformed);
                return DROP;
            };
            let arp = &frame[ETH_HLEN..];
            if arp[0..6] != [0, 1, 0x08, 0x00, 6, 4] {
                count(Counter::Malformed);
                return DROP;
            }
            let spa: V4Addr = [arp[14], arp[15], arp[16], arp[17]];
            // 0.0.0.0 is an ARP probe (RFC 5227); anything else must be ours.
            if arp[8..14] != frame[6..12]
                || (spa != [0; 4] && (ep_flags & endpoint_flags::HAS_V4 == 0 || spa != ep_v4))
            {
                count(Counter::SpoofDroppedArp);
                if events_on() {
                    info!(
                        &ctx,
                        "from_endpoint: dropped a spoofed ARP packet from {:i} on ifindex {}",
                        spa,
                        ifindex(&ctx)
                    );
                }
                return DROP;
            }
        }
    }
    count(Counter::FromEndpointPassed);
    NEXT
}

/// Masquerade for traffic leaving the node (see [`nat`]).
#[classifier]
pub fn to_native(ctx: TcContext) -> i32 {
    match ethertype(&ctx) {
        Some(ETH_P_IP) => nat::to_native_v4(&ctx),
        Some(ETH_P_IPV6) => nat::to_native_v6(&ctx),
        _ => NEXT,
    }
}

/// Traffic arriving at the node: reverse masquerade (see [`nat`]) and the
/// ARP responder.
#[classifier]
pub fn from_native(ctx: TcContext) -> i32 {
    match ethertype(&ctx) {
        Some(ETH_P_ARP) => arp_reply(&ctx),
        Some(ETH_P_IP) => nat::ingress_v4(&ctx),
        Some(ETH_P_IPV6) if ndp::is_solicitation(&ctx) => match ndp::ndp_reply(&ctx) {
            NEXT => nat::from_native_v6(&ctx),
            verdict => verdict,
        },
        Some(ETH_P_IPV6) => nat::from_native_v6(&ctx),
        _ => NEXT,
    }
}

/// ARP responder for announced addresses.
#[inline(always)]
fn arp_reply(ctx: &TcContext) -> i32 {
    let Some(frame) = read::<[u8; ARP_FRAME_LEN]>(ctx, 0) else {
        count(Counter::Malformed);
        return NEXT;
    };
    let arp = &frame[ETH_HLEN..];
    // Ethernet (1) / IPv4 (0x0800), hlen 6, plen 4, operation request (1).
    if arp[0..8] != [0, 1, 0x08, 0x00, 6, 4, 0, 1] {
        return NEXT;
    }
    let sha: [u8; 6] = [arp[8], arp[9], arp[10], arp[11], arp[12], arp[13]];
    let spa: V4Addr = [arp[14], arp[15], arp[16], arp[17]];
    let tpa: V4Addr = [arp[24], arp[25], arp[26], arp[27]];
    // A gratuitous announcement from a neighbour asks nothing of us.
    if spa == tpa {
        return NEXT;
    }
    let here = ifindex(ctx);
    let mac = match l2_resp(tpa) {
        Some((ifindex, mac, expires)) if ifindex == here => {
            // The clock is read only for entries that can expire.
            if expires != 0 && L2RespValue::expired(expires, nat::now_ns()) {
                count(Counter::AnnounceExpired);
                count(Counter::ArpIgnored);
                return NEXT;
            }
            mac
        }
        _ => {
            count(Counter::ArpIgnored);
            return NEXT;
        }
    };
    // Turn the request into the reply in place. `read` above made the first
    // ARP_FRAME_LEN bytes linear; the bounds check is repeated for the verifier.
    if ctx.data() + ARP_FRAME_LEN > ctx.data_end() {
        count(Counter::Malformed);
        return NEXT;
    }
    // SAFETY: bounds checked just above; TC programs may write packet data (the
    // verifier's prologue unclones the skb first).
    let out = unsafe { &mut *(ctx.data() as *mut [u8; ARP_FRAME_LEN]) };
    out[0..6].copy_from_slice(&sha);
    out[6..12].copy_from_slice(&mac);
    out[21] = 2; // operation: reply
    out[22..28].copy_from_slice(&mac);
    out[28..32].copy_from_slice(&tpa);
    out[32..38].copy_from_slice(&sha);
    out[38..42].copy_from_slice(&spa);
    count(Counter::ArpReplied);
    if events_on() {
        info!(
            ctx,
            "from_native: answered ARP for {:i} to {:i} ({:mac}) on ifindex {}",
            tpa,
            spa,
            sha,
            here
        );
    }
    // SAFETY: plain helper call; egress of the interface the request came in on.
    unsafe { bpf_redirect(here, 0) as i32 }
}

/// Decapsulated traffic from other nodes (see [`tunnel`]).
#[classifier]
pub fn from_tunnel(ctx: TcContext) -> i32 {
    tunnel::decap(&ctx)
}

/// Returns "next" and nothing else: the benchmark's baseline.
#[classifier]
pub fn noop(_ctx: TcContext) -> i32 {
    NEXT
}

/// The lookup an established IPv4 flow's translation cannot do without —
/// the tuple parsed, NAT_FWD_V4 looked up — and nothing else: the datapath
/// bench's reference for the translation's cost (never attached).
#[classifier]
pub fn nat_lookup(ctx: TcContext) -> i32 {
    nat::lookup_only_v4(&ctx)
}

/// A collect-metadata encapsulation's unavoidable part — the tunnel key
/// set, the redirect to the device — and nothing else: the datapath
/// bench's floor for the encapsulation rows (never attached).
#[classifier]
pub fn encap_floor(ctx: TcContext) -> i32 {
    tunnel::floor(&ctx)
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";

const _: () = assert!(TC_ACT_REDIRECT == 7);
