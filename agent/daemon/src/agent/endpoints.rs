//! Endpoints: what the CNI plugin asks the agent to do.
//!
//! ADD, in lockstep order: allocate in the core → make the interfaces (veth,
//! addresses, routes, neighbours) → commit the allocations and the endpoint
//! record together (fsync) → program ENDPOINTS and IPCACHE and attach
//! `from_endpoint` → acknowledge. Any failure undoes the earlier steps in
//! reverse. DEL runs the other way (unprogram → commit → delete the veth) and
//! succeeds when things are already gone. The routing scheme is the one
//! production CNIs use: each endpoint gets a /32 (/128), a default route to a
//! link-local gateway (169.254.1.1, fe80::1) that resolves statically to the
//! host-side veth, and the node a host route per address.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;
use lockstep_common::{EndpointValue, endpoint_flags, program_names};
use lockstep_core::cidr::Family;
use lockstep_core::manager::Allocation;
use lockstep_core::owner::Owner;

use std::sync::Mutex;

use super::doors::LinkDoor;
use super::endpoint_effects::EndpointEffects;
use super::{Agent, AgentError};
use crate::datapath::Hook;
use crate::datapath::ProgramPin;
use crate::netlink::{CreatedVeth, Netlink, Step, open_netns};
use crate::store::{EndpointMode, EndpointRecord, endpoint_key};

/// The link-local IPv4 gateway every endpoint routes through.
pub const GATEWAY_V4: Ipv4Addr = Ipv4Addr::new(169, 254, 1, 1);
/// The link-local IPv6 gateway every endpoint routes through.
pub const GATEWAY_V6: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);

pub use crate::wire::{
    DelRequest, EndpointAddress, EndpointReply, EndpointRequest, GcReport, GcRequest,
};

/// A stable, short host-side interface name for an attachment (`lxc` + 12
/// hex digits of an FNV-1a hash), so a retried ADD finds a half-made veth.
pub fn host_ifname(container_id: &str, ifname: &str) -> String {
    format!("lxc{:012x}", fnv1a(container_id, ifname) & 0xffff_ffff_ffff)
}

fn temp_ifname(container_id: &str, ifname: &str) -> String {
    format!("tmp{:012x}", fnv1a(container_id, ifname) & 0xffff_ffff_ffff)
}

fn fnv1a(a: &str, b: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in a.bytes().chain([0u8]).chain(b.bytes()) {
        h ^= u64::from(byte);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The endpoint's ENDPOINTS value.
pub(super) fn endpoint_value(record: &EndpointRecord, generation: u64) -> EndpointValue {
    let mut v = EndpointValue {
        generation,
        mac: record.mac,
        ..Default::default()
    };
    for a in &record.addresses {
        match a {
            IpAddr::V4(v4) => {
                v.ipv4 = v4.octets();
                v.flags |= endpoint_flags::HAS_V4;
            }
            IpAddr::V6(v6) => {
                v.ipv6 = v6.octets();
                v.flags |= endpoint_flags::HAS_V6;
            }
        }
    }
    v
}

fn invalid(reason: impl Into<String>) -> AgentError {
    AgentError::Invalid {
        reason: reason.into(),
    }
}

/// The interfaces ADD made (full mode).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Interfaces {
    /// Host-side veth.
    pub host_ifname: String,
    /// Its index.
    pub host_ifindex: u32,
    /// Its MAC.
    pub host_mac: [u8; 6],
    /// MAC of the container side.
    pub mac: [u8; 6],
}

/// Why making the interfaces failed, and what to undo.
#[derive(Debug)]
pub struct InterfaceFailure {
    /// The error.
    pub error: AgentError,
    /// The host-side veth, if it was created.
    pub host_ifindex: Option<u32>,
}

/// An ADD between its locked phases: addresses held (uncommitted), the
/// attachment marked pending so no other request touches it.
#[derive(Debug)]
pub struct PreparedAdd {
    req: EndpointRequest,
    key: String,
    pool: String,
    allocated: Vec<Allocation>,
    delegated: Option<crate::store::DelegatedRecord>,
    attach: Option<ProgramPin>,
}

/// The first phase's outcome.
#[derive(Debug)]
pub enum AddBegin {
    /// Finished already (repeated ADD, or IPAM mode).
    Done(Box<EndpointReply>),
    /// Interfaces to make outside the lock, then [`Agent::endpoint_add_finish`].
    Interfaces(Box<PreparedAdd>),
}

/// The host interfaces through the kernel: an ADD's undo detaches the
/// endpoint program and deletes the veth ([`DelCleanup::run`]).
struct KernelLinks {
    attach: Option<ProgramPin>,
}

impl LinkDoor for KernelLinks {
    fn remove_host(&mut self, name: &str, ifindex: u32) -> Result<(), AgentError> {
        DelCleanup {
            host: Some((name.to_string(), ifindex)),
            attach: self.attach.clone(),
            orphan: None,
            orphan_guard: None,
        }
        .run()
    }
}

/// Kernel work left after DEL committed: detach the program, delete the veth.
#[derive(Debug, Default)]
pub struct DelCleanup {
    host: Option<(String, u32)>,
    attach: Option<ProgramPin>,
    /// A DEL that found no record: what a half-done ADD of this attachment
    /// (container id, ifname) may have made, found by its names.
    orphan: Option<(String, String)>,
    /// Keeps an ADD of that attachment waiting until the removal is done.
    orphan_guard: Option<super::reaper::OrphanGuard>,
}

impl DelCleanup {
    /// Whether there is no kernel work to do.
    pub fn is_empty(&self) -> bool {
        self.host.is_none() && self.orphan.is_none()
    }

    /// Runs it (outside the agent lock; both steps wait on the kernel).
    /// Already gone is fine. Both steps are tried whatever the other did.
    ///
    /// # Errors
    /// Every step that failed. The allocation is released already; a DEL
    /// the runtime retries finds no record and removes the veth and link by
    /// their names (see [`Agent::endpoint_del_begin`]).
    pub fn run(self) -> Result<(), AgentError> {
        if let Some((container_id, ifname)) = &self.orphan {
            let removed = remove_leftovers(
                &[
                    host_ifname(container_id, ifname),
                    temp_ifname(container_id, ifname),
                ],
                self.attach.as_ref(),
            );
            // Done: an ADD of the attachment may go on.
            drop(self.orphan_guard);
            return removed;
        }
        let Some((name, index)) = self.host else {
            return Ok(());
        };
        let mut errors = Vec::new();
        if let Some(pin) = &self.attach
            && let Err(e) = pin.detach_index(index, Hook::Ingress)
        {
            tracing::warn!(error = %e, iface = %name, "detaching from_endpoint failed");
            errors.push(e.into());
        }
        if let Err(e) = Netlink::current().and_then(|h| match h.link(&name)? {
            Some(l) if l.index == index => h.delete_link(index),
            _ => Ok(()),
        }) {
            tracing::warn!(error = %e, iface = %name, "deleting the veth failed");
            errors.push(e.into());
        }
        AgentError::all(errors)
    }
}

/// Detaches `from_endpoint` from, and deletes, the host interfaces named
/// `names` that exist: what a half-done ADD leaves (the veth and the
/// program's pinned link are made before the commit). Every name is tried.
///
/// # Errors
/// Every step that failed.
fn remove_leftovers(names: &[String], attach: Option<&ProgramPin>) -> Result<(), AgentError> {
    let host = Netlink::current()?;
    let mut errors = Vec::new();
    for name in names {
        match host.link(name) {
            Ok(Some(l)) => {
                tracing::info!(iface = %name, "removing what a half-done ADD left");
                if let Some(pin) = attach
                    && let Err(e) = pin.detach_index(l.index, Hook::Ingress)
                {
                    errors.push(e.into());
                }
                if let Err(e) = host.delete_link(l.index) {
                    errors.push(e.into());
                }
            }
            Ok(None) => {}
            Err(e) => errors.push(e.into()),
        }
    }
    AgentError::all(errors)
}

/// Whether `name` is a host-side interface name this agent makes
/// ([`host_ifname`], or the temporary name): a prefix and 12 lowercase hex
/// digits.
fn is_agent_ifname(name: &str) -> bool {
    ["lxc", "tmp"].iter().any(|p| {
        name.strip_prefix(p).is_some_and(|hex| {
            hex.len() == 12
                && hex
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        })
    })
}

/// Makes the veth pair (the peer created directly in the container's
/// namespace), addresses, routes and gateway neighbours, and attaches
/// `from_endpoint`. Runs without the agent lock: every step is a kernel call
/// on interfaces no one else knows about yet.
///
/// The container side runs on a thread of its own that enters the
/// container's namespace and waits for the peer's index, while this thread
/// creates the pair, then adds the host routes and attaches: the two sides'
/// kernel work overlaps, and each side's changes go out as one batch.
///
/// # Errors
/// The first failing step, with the host veth to delete if it was made.
pub fn build_interfaces(
    req: &EndpointRequest,
    addresses: &[IpAddr],
    attach: Option<&ProgramPin>,
) -> Result<Interfaces, InterfaceFailure> {
    let mut made: Option<u32> = None;
    let result = open_netns(&req.netns)
        .map_err(AgentError::from)
        .and_then(|netns_fd| {
            std::thread::scope(|s| {
                let (tx, rx) = std::sync::mpsc::channel::<Vec<Step>>();
                let fd = &netns_fd;
                let inside = s.spawn(move || -> Result<(), AgentError> {
                    let netlink = Netlink::enter(fd, &req.netns)?;
                    // No steps: the host side failed before sending any.
                    match rx.recv() {
                        Ok(steps) => Ok(netlink.apply(&steps)?),
                        Err(_) => Ok(()),
                    }
                });
                let host = (|| {
                    let host_name = host_ifname(&req.container_id, &req.ifname);
                    let host = Netlink::current()?;
                    let peer_mac = random_mac()?;
                    let veth = make_veth(&host, req, &host_name, fd, peer_mac)?;
                    made = Some(veth.host.index);
                    let (inside_steps, host_steps) = endpoint_steps(addresses, &veth, peer_mac);
                    // A send fails only if the thread is gone; its join says why.
                    let _ = tx.send(inside_steps);
                    host.apply(&host_steps)?;
                    if let Some(pin) = attach {
                        pin.attach(&host_name, Hook::Ingress)?;
                    }
                    Ok(Interfaces {
                        host_ifname: host_name,
                        host_ifindex: veth.host.index,
                        host_mac: veth.host.mac,
                        mac: peer_mac,
                    })
                })();
                drop(tx);
                let inside = inside
                    .join()
                    .unwrap_or_else(|_| Err(invalid("the container namespace thread panicked")));
                // The host side's error first: it is the cause when both failed.
                host.and_then(|i| inside.map(|()| i))
            })
        });
    result.map_err(|error| InterfaceFailure {
        error,
        host_ifindex: made,
    })
}

/// Creates the pair, host end up. A name already taken is either the
/// container's interface (refused) or the leftovers of an ADD that crashed
/// half-way (deleted, and the pair made again): looked up only then, so a
/// normal ADD pays no lookup.
fn make_veth(
    host: &Netlink,
    req: &EndpointRequest,
    host_name: &str,
    netns_fd: &std::os::fd::OwnedFd,
    peer_mac: [u8; 6],
) -> Result<CreatedVeth, AgentError> {
    match host.create_veth_into(host_name, &req.ifname, netns_fd, req.mtu, peer_mac) {
        Err(e) if e.errno() == Some(libc::EEXIST) => {
            if Netlink::in_netns(&req.netns)?.link(&req.ifname)?.is_some() {
                return Err(invalid(format!(
                    "interface {} already exists in {}",
                    req.ifname,
                    req.netns.display()
                )));
            }
            for stale in [host_name, &temp_ifname(&req.container_id, &req.ifname)] {
                if let Some(l) = host.link(stale)? {
                    host.delete_link(l.index)?;
                }
            }
            Ok(host.create_veth_into(host_name, &req.ifname, netns_fd, req.mtu, peer_mac)?)
        }
        r => Ok(r?),
    }
}

/// The container side's changes (peer and `lo` up, each address with its
/// gateway neighbour and default route) and the host side's (a route and a
/// neighbour per address). The gateway resolves to the host side
/// statically: no ARP/NDP round trip before the first packet, and nothing
/// to spoof.
fn endpoint_steps(
    addresses: &[IpAddr],
    veth: &CreatedVeth,
    peer_mac: [u8; 6],
) -> (Vec<Step>, Vec<Step>) {
    let peer = veth.peer_index;
    // `lo` is interface 1 in every namespace (LOOPBACK_IFINDEX).
    let mut inside = vec![Step::Up(peer), Step::Up(1)];
    let mut host = Vec::new();
    for addr in addresses {
        let (prefix_len, gw, any): (u8, IpAddr, IpNet) = match addr {
            IpAddr::V4(_) => (32, GATEWAY_V4.into(), IpNet::V4(Default::default())),
            IpAddr::V6(_) => (128, GATEWAY_V6.into(), IpNet::V6(Default::default())),
        };
        inside.push(Step::Address {
            index: peer,
            address: *addr,
            prefix_len,
        });
        inside.push(Step::Neighbour {
            index: peer,
            ip: gw,
            mac: veth.host.mac,
        });
        if addr.is_ipv4() {
            inside.push(Step::Route {
                dst: IpNet::from(gw),
                gateway: None,
                oif: peer,
            });
        }
        inside.push(Step::Route {
            dst: any,
            gateway: Some(gw),
            oif: peer,
        });
        host.push(Step::Route {
            dst: IpNet::from(*addr),
            gateway: None,
            oif: veth.host.index,
        });
        host.push(Step::Neighbour {
            index: veth.host.index,
            ip: *addr,
            mac: peer_mac,
        });
    }
    (inside, host)
}

/// A random, locally administered, unicast hardware address for the
/// container end, chosen before the pair exists so the host side's
/// neighbour entry needs no lookup.
fn random_mac() -> Result<[u8; 6], AgentError> {
    let mut mac = [0u8; 6];
    // SAFETY: writes at most `mac.len()` bytes into `mac`.
    let n = unsafe { libc::getrandom(mac.as_mut_ptr().cast(), mac.len(), 0) };
    if usize::try_from(n).ok() != Some(mac.len()) {
        return Err(invalid(format!(
            "no random bytes for a MAC address: {}",
            std::io::Error::last_os_error()
        )));
    }
    mac[0] = (mac[0] & 0xfe) | 0x02;
    Ok(mac)
}

fn lock(slot: &Mutex<Option<Agent>>) -> std::sync::MutexGuard<'_, Option<Agent>> {
    slot.lock().unwrap_or_else(|p| p.into_inner())
}

fn not_ready() -> AgentError {
    AgentError::NotReady {
        reason: "restoring allocations and maps".into(),
    }
}

/// What a CNI call's step on the API's async worker came to (see
/// [`endpoint_add_inline`] and [`endpoint_del_inline`]).
#[derive(Debug)]
pub enum Inline<T, R> {
    /// Served: store and map work only, done under the lock.
    Done(Result<T, AgentError>),
    /// Nothing was done: the request needs kernel work or an external
    /// plugin, and must run on the blocking pool.
    Blocking(R),
}

/// Whether serving this attachment, as the agent holds it right now, is
/// store and map work only: IPAM mode, addresses from the agent's own pools
/// (no external plugin to run), no interfaces to check or remove. Only ever
/// asked with the lock held by the caller that then does the work.
fn inline_capable(agent: &Agent, key: &str, mode: Option<EndpointMode>) -> bool {
    mode.is_none_or(|m| m == EndpointMode::Ipam)
        && !agent.reaper.holds_key(key)
        && !agent.delegated_mode()
        && !agent.delegated.contains_key(key)
        && agent
            .endpoints
            .get(key)
            .is_none_or(|e| e.mode == EndpointMode::Ipam)
}

/// CNI ADD from the API's async worker. The attachment's state is judged
/// and the ADD served under one hold of the agent lock, so nothing can
/// change in between: an IPAM-only ADD (a commit and a few map writes, which
/// the lock serialises anyway) is served here, without the two thread
/// wake-ups a hop to the blocking pool costs (`cargo xtask bench cni`);
/// anything else is handed back untouched, for [`endpoint_add_concurrent`]
/// on the blocking pool.
pub fn endpoint_add_inline(
    slot: &Mutex<Option<Agent>>,
    req: EndpointRequest,
) -> Inline<EndpointReply, EndpointRequest> {
    let mut guard = lock(slot);
    let Some(agent) = guard.as_mut() else {
        return Inline::Done(Err(not_ready()));
    };
    let key = endpoint_key(&req.container_id, &req.ifname);
    if !inline_capable(agent, &key, Some(req.mode)) {
        return Inline::Blocking(req);
    }
    Inline::Done(match agent.endpoint_add_begin(req) {
        Ok(AddBegin::Done(reply)) => Ok(*reply),
        // IPAM mode finishes in the first phase; were that ever to change,
        // the interfaces are not made here.
        Ok(AddBegin::Interfaces(p)) => {
            let failure = InterfaceFailure {
                error: invalid("an IPAM-only ADD asked for interfaces"),
                host_ifindex: None,
            };
            agent.endpoint_add_finish(*p, Err(failure))
        }
        Err(e) => Err(e),
    })
}

/// CNI DEL from the API's async worker: judged and committed under one hold
/// of the agent lock (as [`endpoint_add_inline`]). The kernel work a full
/// attachment leaves (detach, veth deletion) is never run here: it comes
/// back as a [`DelCleanup`] for the blocking pool ([`DelCleanup::is_empty`]
/// says whether there is any). A delegated attachment (an external plugin
/// to run) is handed back untouched.
pub fn endpoint_del_inline(
    slot: &Mutex<Option<Agent>>,
    req: DelRequest,
) -> Inline<DelCleanup, DelRequest> {
    let mut guard = lock(slot);
    let Some(agent) = guard.as_mut() else {
        return Inline::Done(Err(not_ready()));
    };
    let key = endpoint_key(&req.container_id, &req.ifname);
    if agent.delegated_mode() || agent.delegated.contains_key(&key) {
        return Inline::Blocking(req);
    }
    Inline::Done(agent.endpoint_del_begin(req))
}

/// CNI ADD with the agent lock held only to decide and to commit: the
/// interfaces and the program attach (each waiting on the kernel) run
/// unlocked, so concurrent ADDs overlap their waits.
///
/// # Errors
/// As [`Agent::endpoint_add`].
pub fn endpoint_add_concurrent(
    slot: &Mutex<Option<Agent>>,
    req: EndpointRequest,
) -> Result<EndpointReply, AgentError> {
    // The same attachment DEL'd a moment ago: its addresses come back only
    // once its old veth is gone.
    let key = endpoint_key(&req.container_id, &req.ifname);
    let (netns, ifname) = (req.netns.clone(), req.ifname.clone());
    let begun = super::reaper::lock_unblocked(
        slot,
        &key,
        &netns,
        &ifname,
        std::time::Duration::from_secs(10),
    )
    .as_mut()
    .ok_or_else(not_ready)?
    .endpoint_add_begin(req);
    let prepared = match begun? {
        AddBegin::Done(reply) => return Ok(*reply),
        AddBegin::Interfaces(p) => p,
    };
    let made = build_interfaces(
        &prepared.req,
        &prepared.addresses(),
        prepared.attach.as_ref(),
    );
    let mut guard = lock(slot);
    match guard.as_mut() {
        Some(agent) => agent.endpoint_add_finish(*prepared, made),
        None => {
            let mut errors = vec![not_ready()];
            if let Ok(i) = made
                && let Err(e) = (DelCleanup {
                    host: Some((i.host_ifname, i.host_ifindex)),
                    attach: prepared.attach,
                    orphan: None,
                    orphan_guard: None,
                })
                .run()
            {
                errors.push(e);
            }
            Err(AgentError::all(errors).expect_err("one error at least"))
        }
    }
}

/// CNI DEL with the kernel work (detach, veth deletion) outside the lock.
///
/// # Errors
/// As [`Agent::endpoint_del`].
pub fn endpoint_del_concurrent(
    slot: &Mutex<Option<Agent>>,
    req: DelRequest,
) -> Result<(), AgentError> {
    let cleanup = lock(slot)
        .as_mut()
        .ok_or_else(not_ready)?
        .endpoint_del_begin(req)?;
    cleanup.run()
}

impl PreparedAdd {
    fn addresses(&self) -> Vec<IpAddr> {
        self.allocated.iter().map(|a| a.address).collect()
    }
}

impl Agent {
    fn host_netlink(&mut self) -> Result<&Netlink, AgentError> {
        if self.netlink.is_none() {
            self.netlink = Some(Netlink::current()?);
        }
        Ok(self.netlink.as_ref().expect("just set"))
    }

    pub(super) fn default_pool(&self) -> Result<String, AgentError> {
        self.config
            .default_pool
            .clone()
            .or_else(|| self.config.pools.first().map(|p| p.name.clone()))
            .ok_or_else(|| invalid("no pool is configured"))
    }

    /// The endpoint records.
    pub fn endpoints(&self) -> Vec<EndpointRecord> {
        self.endpoints.values().cloned().collect()
    }

    /// CNI ADD, entirely under the caller's `&mut` (tests, tools). The API
    /// uses [`endpoint_add_concurrent`]. Idempotent: repeating it for the
    /// same attachment returns the same addresses and interfaces.
    ///
    /// # Errors
    /// Allocation, interface or datapath failure; everything done so far is
    /// undone.
    pub fn endpoint_add(&mut self, req: EndpointRequest) -> Result<EndpointReply, AgentError> {
        match self.endpoint_add_begin(req)? {
            AddBegin::Done(reply) => Ok(*reply),
            AddBegin::Interfaces(p) => {
                let made = build_interfaces(&p.req, &p.addresses(), p.attach.as_ref());
                self.endpoint_add_finish(*p, made)
            }
        }
    }

    /// ADD's first phase: idempotency, addresses. IPAM-only ADDs finish here;
    /// full ones leave the attachment pending for [`build_interfaces`].
    ///
    /// # Errors
    /// Not ready, the attachment is busy, or the addresses cannot be had.
    pub fn endpoint_add_begin(&mut self, req: EndpointRequest) -> Result<AddBegin, AgentError> {
        let r = self.endpoint_add_begin_inner(req);
        if let Err(e) = &r {
            self.note_error(e);
        }
        r
    }

    fn endpoint_add_begin_inner(&mut self, req: EndpointRequest) -> Result<AddBegin, AgentError> {
        self.check_ready()?;
        let key = endpoint_key(&req.container_id, &req.ifname);
        self.settle();
        if let Some(e) = self.parked_error(&key) {
            return Err(e);
        }
        if self.pending.contains(&key) || self.reaper.holds_key(&key) {
            return Err(AgentError::Busy {
                attachment: key.replace('\u{1f}', "/"),
            });
        }
        if let Some(existing) = self.endpoints.get(&key).cloned() {
            let intact = match (existing.mode, existing.host_ifname.as_deref()) {
                (EndpointMode::Ipam, _) => true,
                (EndpointMode::Full, Some(name)) => self
                    .host_netlink()?
                    .link(name)?
                    .is_some_and(|l| l.index == existing.host_ifindex),
                (EndpointMode::Full, None) => false,
            };
            if intact && existing.mode == req.mode {
                return Ok(AddBegin::Done(Box::new(self.reply(existing))));
            }
            // Half-gone (the runtime deleted the netns, or a crash): start over.
            self.endpoint_del_inner(&req.container_id, &req.ifname)?;
        }
        let (pool, allocated, delegated) = if self.delegated_mode() {
            let (allocated, delegated) = self.delegated_endpoint_allocate(&req)?;
            (delegated.plugin.clone(), allocated, Some(delegated))
        } else {
            let pool = match &req.pool {
                Some(p) => p.clone(),
                None => self.default_pool()?,
            };
            let allocated = self.allocate_endpoint(&req, &pool)?;
            (pool, allocated, None)
        };
        let prepared = PreparedAdd {
            attach: self.from_endpoint.clone(),
            req,
            key,
            pool,
            allocated,
            delegated,
        };
        if prepared.req.mode == EndpointMode::Ipam {
            return self
                .endpoint_add_finish(
                    prepared,
                    Err(InterfaceFailure {
                        error: invalid("unused"),
                        host_ifindex: None,
                    }),
                )
                .map(|r| AddBegin::Done(Box::new(r)));
        }
        self.pending.insert(prepared.key.clone());
        Ok(AddBegin::Interfaces(Box::new(prepared)))
    }

    fn allocate_endpoint(
        &mut self,
        req: &EndpointRequest,
        pool_name: &str,
    ) -> Result<Vec<Allocation>, AgentError> {
        let pool = self.manager.pool(pool_name).ok_or_else(|| {
            AgentError::from(lockstep_core::manager::ManagerError::UnknownPool {
                pool: pool_name.to_string(),
            })
        })?;
        let mut families: BTreeSet<Family> = pool.cidrs().map(|c| Family::of_net(c.cidr)).collect();
        let owner = Owner::endpoint(&req.container_id, &req.ifname);
        let mut allocated: Vec<Allocation> = Vec::new();
        let result = (|| -> Result<(), AgentError> {
            for addr in &req.requested {
                let a = self.manager.allocate(pool_name, *addr, owner.clone())?;
                families.remove(&a.family());
                allocated.push(a);
            }
            for family in families {
                allocated.push(
                    self.manager
                        .allocate_next(pool_name, family, owner.clone())?,
                );
            }
            Ok(())
        })();
        match result {
            Ok(()) => Ok(allocated),
            Err(e) => {
                let more = self.release_core(&allocated);
                Err(AgentError::with_more(e, more))
            }
        }
    }

    /// ADD's last phase: commit the record with its addresses (fsync), program
    /// ENDPOINTS and IPCACHE, acknowledge. A failure here or before undoes
    /// everything.
    ///
    /// # Errors
    /// The interfaces failed, or the commit or programming did.
    pub fn endpoint_add_finish(
        &mut self,
        prepared: PreparedAdd,
        made: Result<Interfaces, InterfaceFailure>,
    ) -> Result<EndpointReply, AgentError> {
        let PreparedAdd {
            req,
            key,
            pool,
            allocated,
            delegated,
            attach,
        } = prepared;
        self.pending.remove(&key);
        let mut record = EndpointRecord {
            container_id: req.container_id.clone(),
            ifname: req.ifname.clone(),
            netns: req.netns.clone(),
            mode: req.mode,
            pool,
            addresses: allocated.iter().map(|a| a.address).collect(),
            host_ifname: None,
            host_ifindex: 0,
            host_mac: [0; 6],
            mac: [0; 6],
            releasing: false,
        };
        // Local IPAM: [`EndpointEffects::finish_add`]. What follows is the
        // delegated plugin's attachment.
        let Some(d) = delegated else {
            return self.finish_add_local(req, key, record, allocated, attach, made);
        };
        let undo_interfaces = |host: Option<(String, u32)>| DelCleanup {
            host,
            attach: attach.clone(),
            orphan: None,
            orphan_guard: None,
        };
        if req.mode == EndpointMode::Full {
            match made {
                Ok(i) => {
                    record.host_ifname = Some(i.host_ifname);
                    record.host_ifindex = i.host_ifindex;
                    record.host_mac = i.host_mac;
                    record.mac = i.mac;
                }
                Err(f) => {
                    let host = f
                        .host_ifindex
                        .map(|i| (host_ifname(&req.container_id, &req.ifname), i));
                    let mut more: Vec<AgentError> =
                        undo_interfaces(host).run().err().into_iter().collect();
                    // Nothing was committed: the core alone held them.
                    more.extend(self.undo_allocated(&allocated, Some(&d)));
                    let e = AgentError::with_more(f.error, more);
                    self.note_error(&e);
                    return Err(e);
                }
            }
        }
        let made_host = record.host_ifname.clone().map(|n| (n, record.host_ifindex));
        if let Err(e) = self.store.put_delegated(&d, Some(&record)) {
            let mut more: Vec<AgentError> =
                undo_interfaces(made_host).run().err().into_iter().collect();
            more.extend(self.undo_allocated(&allocated, Some(&d)));
            let e = AgentError::with_more(e.into(), more);
            self.note_error(&e);
            return Err(e);
        }
        self.endpoints.insert(key.clone(), record.clone());
        self.delegated.insert(key.clone(), d.clone());
        if let Err(e) = self.program_endpoint(&record, &allocated) {
            // Every undo step is tried; each failure is reported with the
            // cause.
            let mut more = self.unprogram_endpoint(&record, &allocated);
            self.endpoints.remove(&key);
            if let Err(c) = undo_interfaces(made_host).run() {
                more.push(c);
            }
            match self.store.remove_delegated(&key) {
                Ok(()) => {
                    self.delegated.remove(&key);
                    self.delegated_undo(&d);
                }
                // Stored, and the plugin keeps the address: the DEL a
                // runtime sends after a failed ADD releases both.
                Err(s) => more.push(s.into()),
            }
            let e = AgentError::with_more(e, more);
            self.note_error(&e);
            return Err(e);
        }
        Ok(self.reply(record))
    }

    /// [`Agent::endpoint_add_finish`] of a local-IPAM attachment: commit →
    /// program, every undo step tried and reported
    /// ([`EndpointEffects::finish_add`]).
    fn finish_add_local(
        &mut self,
        req: EndpointRequest,
        key: String,
        mut record: EndpointRecord,
        allocated: Vec<Allocation>,
        attach: Option<ProgramPin>,
        made: Result<Interfaces, InterfaceFailure>,
    ) -> Result<EndpointReply, AgentError> {
        let interfaces = match made {
            _ if req.mode != EndpointMode::Full => Ok(()),
            Ok(i) => {
                record.host_ifname = Some(i.host_ifname);
                record.host_ifindex = i.host_ifindex;
                record.host_mac = i.host_mac;
                record.mac = i.mac;
                Ok(())
            }
            Err(f) => Err((
                f.error,
                f.host_ifindex
                    .map(|i| (host_ifname(&req.container_id, &req.ifname), i)),
            )),
        };
        let mut links = KernelLinks { attach };
        let capacity = self.config.datapath.ipcache_max_entries;
        let done = EndpointEffects {
            core: &mut self.manager,
            store: &self.store,
            maps: &mut self.maps,
            links: &mut links,
            parked: &mut self.parked,
            capacity,
        }
        .finish_add(&record, &allocated, interfaces);
        if let Err(e) = done {
            self.note_error(&e);
            return Err(e);
        }
        self.endpoints.insert(key, record.clone());
        Ok(self.reply(record))
    }

    /// Gives back what an ADD allocated but never committed; the errors of
    /// the steps that failed.
    fn undo_allocated(
        &mut self,
        allocated: &[Allocation],
        delegated: Option<&crate::store::DelegatedRecord>,
    ) -> Vec<AgentError> {
        match delegated {
            Some(d) => {
                self.delegated_undo(d);
                Vec::new()
            }
            None => self.release_core(allocated),
        }
    }

    /// Releases `allocated` in the core, every one tried; the failures (the
    /// core did not hold what it was asked to release) are returned.
    fn release_core(&mut self, allocated: &[Allocation]) -> Vec<AgentError> {
        super::endpoint_effects::release_core(&mut self.manager, allocated)
    }

    fn reply(&self, record: EndpointRecord) -> EndpointReply {
        if record.mode == EndpointMode::Ipam
            && let Some(reply) = self.delegated_reply(&record)
        {
            return reply;
        }
        let mut addresses = Vec::new();
        let mut routes = Vec::new();
        for addr in &record.addresses {
            match record.mode {
                EndpointMode::Full => {
                    let (gw, default): (IpAddr, IpNet) = match addr {
                        IpAddr::V4(_) => (GATEWAY_V4.into(), "0.0.0.0/0".parse().expect("literal")),
                        IpAddr::V6(_) => (GATEWAY_V6.into(), "::/0".parse().expect("literal")),
                    };
                    addresses.push(EndpointAddress {
                        address: IpNet::from(*addr),
                        gateway: Some(gw),
                    });
                    routes.push((default, Some(gw)));
                }
                EndpointMode::Ipam => {
                    // The core decides (`Pool::ipam_address`); an address no
                    // CIDR of the pool holds any more goes out as a host.
                    let (address, gateway) = self
                        .manager
                        .pool(&record.pool)
                        .and_then(|p| p.ipam_address(*addr))
                        .unwrap_or_else(|| (IpNet::from(*addr), None));
                    addresses.push(EndpointAddress { address, gateway });
                }
            }
        }
        EndpointReply {
            record,
            addresses,
            routes,
        }
    }

    fn program_endpoint(
        &mut self,
        record: &EndpointRecord,
        allocated: &[Allocation],
    ) -> Result<(), AgentError> {
        super::endpoint_effects::program(
            &mut self.maps,
            self.config.datapath.ipcache_max_entries,
            record,
            allocated,
        )
    }

    /// Removes an endpoint's map entries (the program's link and the veth go
    /// with [`DelCleanup`]). Every entry is tried; returns what failed.
    fn unprogram_endpoint(
        &mut self,
        record: &EndpointRecord,
        allocated: &[Allocation],
    ) -> Vec<AgentError> {
        super::endpoint_effects::unprogram(&mut self.maps, record, allocated)
    }

    /// CNI DEL: idempotent; already gone is success.
    ///
    /// # Errors
    /// The store could not record the release (the endpoint then stays).
    pub fn endpoint_del(&mut self, req: DelRequest) -> Result<(), AgentError> {
        self.endpoint_del_begin(req)?.run()
    }

    /// DEL's locked phase: unprogram, commit, release; returns the kernel
    /// work left (see [`endpoint_del_concurrent`]).
    ///
    /// # Errors
    /// Not ready, the attachment is busy, or the store failed.
    pub fn endpoint_del_begin(&mut self, req: DelRequest) -> Result<DelCleanup, AgentError> {
        self.check_ready()?;
        let key = endpoint_key(&req.container_id, &req.ifname);
        if self.pending.contains(&key) {
            return Err(AgentError::Busy {
                attachment: format!("{}/{}", req.container_id, req.ifname),
            });
        }
        self.settle();
        if let Some(e) = self.parked_error(&key) {
            self.note_error(&e);
            return Err(e);
        }
        let r = self.endpoint_del_commit(&req.container_id, &req.ifname);
        if let Err(e) = &r {
            self.note_error(e);
        }
        r
    }

    fn endpoint_del_inner(&mut self, container_id: &str, ifname: &str) -> Result<(), AgentError> {
        self.endpoint_del_commit(container_id, ifname)?.run()
    }

    fn endpoint_del_commit(
        &mut self,
        container_id: &str,
        ifname: &str,
    ) -> Result<DelCleanup, AgentError> {
        let key = endpoint_key(container_id, ifname);
        if self.reaper.holds_key(&key) {
            // DEL'd already; its veth is being deleted (`reaper`).
            return Ok(DelCleanup::default());
        }
        let owner = Owner::endpoint(container_id, ifname);
        let delegated = self.delegated.get(&key).cloned();
        let allocated: Vec<Allocation> = match &delegated {
            Some(d) => Self::allocations_of(d),
            None => self.manager.owned_by(&owner).cloned().collect(),
        };
        let record = self.endpoints.get(&key).cloned();
        let reaped = record
            .as_ref()
            .is_some_and(|r| r.mode == EndpointMode::Full && r.host_ifname.is_some());
        if delegated.is_none() && !reaped {
            // Unprogram (every entry tried; nothing committed if one
            // stays) → commit → release ([`EndpointEffects::del`]).
            let capacity = self.config.datapath.ipcache_max_entries;
            let faults = EndpointEffects {
                core: &mut self.manager,
                store: &self.store,
                maps: &mut self.maps,
                links: &mut KernelLinks { attach: None },
                parked: &mut self.parked,
                capacity,
            }
            .del(&key, record.as_ref(), &allocated)?;
            if let Err(e) = AgentError::all(faults) {
                tracing::error!(error = %crate::error_chain(&e), "the core did not hold what DEL released");
                self.note_error(&e);
            }
            return Ok(self.del_cleanup(&key, container_id, ifname, record, None));
        }
        // Every entry is tried; if any could not be removed nothing is
        // committed (no map entry may outlive its allocation): the DEL
        // fails with every error and reconcile puts back what went.
        let unprogrammed = match &record {
            Some(r) => self.unprogram_endpoint(r, &allocated),
            None => allocated
                .iter()
                .filter_map(|a| self.unprogram(a).err())
                .collect(),
        };
        AgentError::all(unprogrammed)?;
        if let Some(d) = &delegated {
            // Unprogrammed → the plugin releases → commit. A failed DEL keeps
            // the record (reconcile puts the entries back; DEL is retried).
            self.delegated_endpoint_del(d)?;
            self.store.remove_delegated(&key)?;
            self.delegated.remove(&key);
        } else if let Some(r) = record
            .as_ref()
            .filter(|r| r.mode == EndpointMode::Full && r.host_ifname.is_some())
        {
            // Unprogrammed; the addresses stay held until the reaper has
            // the veth deleted (the container's interface holds them until
            // then), and the DEL is acknowledged now.
            self.begin_release(r, allocated)?;
            return Ok(DelCleanup::default());
        }
        Ok(self.del_cleanup(&key, container_id, ifname, record, delegated))
    }

    /// After DEL committed: forgets the record and returns the kernel work
    /// left.
    fn del_cleanup(
        &mut self,
        key: &str,
        container_id: &str,
        ifname: &str,
        record: Option<EndpointRecord>,
        delegated: Option<crate::store::DelegatedRecord>,
    ) -> DelCleanup {
        self.endpoints.remove(key);
        // No record (nor a delegated one): an ADD may have died between
        // making the interfaces and its commit; what it made is found by
        // its names and removed (outside the lock).
        let orphan = (record.is_none() && delegated.is_none())
            .then(|| (container_id.to_string(), ifname.to_string()));
        let orphan_guard = orphan.as_ref().map(|_| self.reaper.orphan_guard(key));
        let host = record
            .filter(|r| r.mode == EndpointMode::Full)
            .and_then(|r| r.host_ifname.map(|n| (n, r.host_ifindex)));
        DelCleanup {
            host,
            attach: self.from_endpoint.clone(),
            orphan,
            orphan_guard,
        }
    }

    /// CNI CHECK: the interfaces, addresses, routes and map entries of the
    /// attachment are as ADD made them.
    ///
    /// # Errors
    /// [`AgentError::CheckFailed`] listing every problem.
    pub fn endpoint_check(&mut self, req: EndpointRequest) -> Result<(), AgentError> {
        self.check_ready()?;
        let key = endpoint_key(&req.container_id, &req.ifname);
        let Some(record) = self.endpoints.get(&key).cloned() else {
            return Err(AgentError::CheckFailed {
                problems: vec![format!(
                    "no attachment {}/{} is known",
                    req.container_id, req.ifname
                )],
            });
        };
        let mut problems = Vec::new();
        let owner = Owner::endpoint(&req.container_id, &req.ifname);
        let held: BTreeSet<IpAddr> = self
            .manager
            .owned_by(&owner)
            .map(|a| a.address)
            .chain(self.delegated_addresses(&key))
            .collect();
        for a in &record.addresses {
            if !held.contains(a) {
                problems.push(format!("address {a} is no longer allocated"));
            }
        }
        if record.mode == EndpointMode::Full {
            let name = record.host_ifname.clone().unwrap_or_default();
            match self.host_netlink()?.link(&name)? {
                Some(l) if l.index == record.host_ifindex => {}
                Some(l) => problems.push(format!(
                    "host interface {name} has index {} instead of {}",
                    l.index, record.host_ifindex
                )),
                None => problems.push(format!("host interface {name} is missing")),
            }
            match Netlink::in_netns(&req.netns) {
                Err(e) => problems.push(format!("cannot enter {}: {e}", req.netns.display())),
                Ok(inside) => match inside.link(&req.ifname)? {
                    None => problems.push(format!(
                        "interface {} is missing in the container",
                        req.ifname
                    )),
                    Some(l) => {
                        let have: BTreeSet<IpNet> =
                            inside.addresses(l.index)?.into_iter().collect();
                        for a in &record.addresses {
                            if !have.contains(&IpNet::from(*a)) {
                                problems.push(format!("address {a} is missing on {}", req.ifname));
                            }
                        }
                        let routes = inside.routes(l.index)?;
                        for a in &record.addresses {
                            let default: IpNet = if a.is_ipv4() {
                                "0.0.0.0/0".parse().expect("literal")
                            } else {
                                "::/0".parse().expect("literal")
                            };
                            if !routes.contains(&default) {
                                problems.push(format!(
                                    "default route {default} is missing on {}",
                                    req.ifname
                                ));
                            }
                        }
                    }
                },
            }
            match self.maps.endpoints().get(&record.host_ifindex, 0) {
                Ok(v) if v.mac == record.mac && v.is_sealed(record.host_ifindex) => {}
                Ok(_) => problems.push("ENDPOINTS entry differs".into()),
                Err(_) => problems.push("ENDPOINTS entry is missing".into()),
            }
        }
        for a in &record.addresses {
            let present = match a {
                IpAddr::V4(v4) => self.maps.ipcache_host_v4().get(&v4.octets(), 0).is_ok(),
                IpAddr::V6(v6) => self.maps.ipcache_host_v6().get(&v6.octets(), 0).is_ok(),
            };
            if !present {
                problems.push(format!("IPCACHE entry for {a} is missing"));
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(AgentError::CheckFailed { problems })
        }
    }

    /// CNI GC: releases endpoint attachments not in `valid`. Agent-role,
    /// LoadBalancer and other owners are never touched.
    ///
    /// # Errors
    /// A release could not be recorded.
    pub fn endpoint_gc(&mut self, req: GcRequest) -> Result<GcReport, AgentError> {
        self.check_ready()?;
        self.settle();
        let valid: BTreeSet<(String, String)> = req.valid.into_iter().collect();
        let mut stale: BTreeSet<(String, String)> = self
            .endpoints
            .values()
            .map(|r| (r.container_id.clone(), r.ifname.clone()))
            .collect();
        for a in self.manager.allocations() {
            if let Owner::Endpoint {
                container_id,
                ifname,
            } = &a.owner
            {
                stale.insert((container_id.clone(), ifname.clone()));
            }
        }
        // Carries on past a failed attachment: every one is tried, every
        // failure reported (the released ones stay released).
        let mut report = GcReport::default();
        let mut errors = Vec::new();
        for (c, i) in stale {
            if valid.contains(&(c.clone(), i.clone())) {
                continue;
            }
            match self.endpoint_del_inner(&c, &i) {
                Ok(()) => report.released.push((c, i)),
                Err(e) => errors.push(e),
            }
        }
        if self.delegated_mode()
            && let Err(e) = self.delegated_gc(&valid)
        {
            errors.push(e);
        }
        if !errors.is_empty() {
            tracing::warn!(
                released = report.released.len(),
                failed = errors.len(),
                "GC released what it could"
            );
        }
        AgentError::all(errors)?;
        Ok(report)
    }

    /// At start-up (nothing is pending yet): removes host interfaces with
    /// this agent's names that no record owns, and `from_endpoint` link pins
    /// whose interface index no full record has. Both are what an ADD that
    /// died between making its interfaces and its commit leaves; its DEL
    /// may never come (the runtime may have seen the ADD fail), and pins are
    /// otherwise never swept. Failures are logged; the next start retries.
    pub(super) fn sweep_leftovers(&mut self) {
        let owned: BTreeSet<(String, u32)> = self
            .endpoints
            .values()
            .filter(|e| e.mode == EndpointMode::Full)
            .filter_map(|e| e.host_ifname.clone().map(|n| (n, e.host_ifindex)))
            .collect();
        let owned_index: BTreeSet<u32> = owned.iter().map(|(_, i)| *i).collect();
        let links = match self.host_netlink().and_then(|h| Ok(h.links()?)) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "listing interfaces for the start-up sweep failed");
                return;
            }
        };
        let strays: Vec<String> = links
            .iter()
            .filter(|l| is_agent_ifname(&l.name) && !owned.contains(&(l.name.clone(), l.index)))
            .map(|l| l.name.clone())
            .collect();
        if let Err(e) = remove_leftovers(&strays, self.from_endpoint.as_ref()) {
            tracing::error!(error = %e, "removing interfaces no record owns failed");
        }
        if let Some(pin) = &self.from_endpoint {
            match pin.linked_indexes(Hook::Ingress) {
                Ok(indexes) => {
                    for index in indexes.into_iter().filter(|i| !owned_index.contains(i)) {
                        tracing::info!(
                            ifindex = index,
                            "removing a from_endpoint link pin no record owns"
                        );
                        if let Err(e) = pin.detach_index(index, Hook::Ingress) {
                            tracing::error!(error = %e, ifindex = index, "removing a stray link pin failed");
                        }
                    }
                }
                Err(e) => tracing::error!(error = %e, "listing link pins failed"),
            }
        }
    }

    /// Re-attaches `from_endpoint` to every full endpoint whose interface
    /// exists (in place: pinned links are updated, not recreated).
    pub(super) fn reattach_endpoints(&mut self) {
        let records: Vec<EndpointRecord> = self.endpoints.values().cloned().collect();
        for r in records {
            if r.mode != EndpointMode::Full {
                continue;
            }
            let Some(name) = r.host_ifname.clone() else {
                continue;
            };
            let exists = self
                .host_netlink()
                .and_then(|h| Ok(h.link(&name)?))
                .map(|l| l.is_some_and(|l| l.index == r.host_ifindex))
                .unwrap_or(false);
            if !exists {
                tracing::warn!(container = %r.container_id, iface = %name, "endpoint interface is gone; waiting for DEL or GC");
                continue;
            }
            let attached = match &self.from_endpoint {
                Some(pin) => pin.attach(&name, Hook::Ingress),
                None => self
                    .datapath
                    .attach(program_names::FROM_ENDPOINT, &name, Hook::Ingress),
            };
            if let Err(e) = attached {
                tracing::error!(error = %e, iface = %name, "re-attaching from_endpoint failed");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_names_are_stable_short_and_distinct() {
        let a = host_ifname("abc", "eth0");
        assert_eq!(a, host_ifname("abc", "eth0"));
        assert!(a.len() <= 15, "{a}");
        assert_ne!(a, host_ifname("abc", "eth1"));
        assert_ne!(a, host_ifname("abd", "eth0"));
        assert!(is_agent_ifname(&a) && is_agent_ifname(&temp_ifname("abc", "eth0")));
        assert!(!is_agent_ifname("lxc0123456789ab0") && !is_agent_ifname("lxcABCDEF012345"));
        assert!(!is_agent_ifname("eth0") && !is_agent_ifname("lxc"));
        // The separator keeps ("ab","ceth0") and ("abc","eth0") apart.
        assert_ne!(host_ifname("ab", "ceth0"), host_ifname("abc", "eth0"));
        assert_ne!(a, temp_ifname("abc", "eth0"));
    }

    #[test]
    fn endpoint_steps_route_each_family_through_the_static_gateway() {
        let veth = CreatedVeth {
            host: crate::netlink::Link {
                index: 7,
                name: "lxc".into(),
                mac: [2, 0, 0, 0, 0, 7],
                up: true,
            },
            peer_index: 3,
        };
        let peer_mac = [2, 0, 0, 0, 0, 3];
        let v4: IpAddr = "10.0.0.2".parse().expect("v4");
        let v6: IpAddr = "fd00::2".parse().expect("v6");
        let (inside, host) = endpoint_steps(&[v4, v6], &veth, peer_mac);
        let route = |dst: &str, gateway: Option<IpAddr>, oif| Step::Route {
            dst: dst.parse().expect("net"),
            gateway,
            oif,
        };
        let gw4 = IpAddr::from(GATEWAY_V4);
        let gw6 = IpAddr::from(GATEWAY_V6);
        assert_eq!(
            inside,
            vec![
                Step::Up(3),
                Step::Up(1),
                Step::Address {
                    index: 3,
                    address: v4,
                    prefix_len: 32
                },
                Step::Neighbour {
                    index: 3,
                    ip: gw4,
                    mac: veth.host.mac
                },
                route("169.254.1.1/32", None, 3),
                route("0.0.0.0/0", Some(gw4), 3),
                Step::Address {
                    index: 3,
                    address: v6,
                    prefix_len: 128
                },
                Step::Neighbour {
                    index: 3,
                    ip: gw6,
                    mac: veth.host.mac
                },
                route("::/0", Some(gw6), 3),
            ]
        );
        assert_eq!(
            host,
            vec![
                route("10.0.0.2/32", None, 7),
                Step::Neighbour {
                    index: 7,
                    ip: v4,
                    mac: peer_mac
                },
                route("fd00::2/128", None, 7),
                Step::Neighbour {
                    index: 7,
                    ip: v6,
                    mac: peer_mac
                },
            ]
        );
    }

    #[test]
    fn random_macs_are_unicast_local_and_differ() {
        let (a, b) = (random_mac().expect("mac"), random_mac().expect("mac"));
        assert_ne!(a, b);
        for m in [a, b] {
            assert_eq!(m[0] & 0x03, 0x02, "{m:?}");
        }
    }

    #[test]
    fn endpoint_value_carries_both_families() {
        let r = EndpointRecord {
            container_id: "c".into(),
            ifname: "eth0".into(),
            netns: "/x".into(),
            mode: EndpointMode::Full,
            pool: "p".into(),
            addresses: vec![
                "10.0.0.2".parse().expect("v4"),
                "fd00::2".parse().expect("v6"),
            ],
            host_ifname: Some("lxc".into()),
            host_ifindex: 7,
            host_mac: [0; 6],
            mac: [2, 0, 0, 0, 0, 1],
            releasing: false,
        };
        let v = endpoint_value(&r, 9);
        assert_eq!(v.flags, endpoint_flags::HAS_V4 | endpoint_flags::HAS_V6);
        assert_eq!(v.ipv4, [10, 0, 0, 2]);
        assert_eq!(v.generation, 9);
        assert_eq!(v.mac, [2, 0, 0, 0, 0, 1]);
    }
}
