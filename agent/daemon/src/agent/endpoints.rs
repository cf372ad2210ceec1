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
use lockstep_common::program_names;
use lockstep_core::cidr::Family;
use lockstep_core::manager::Allocation;
use lockstep_core::owner::Owner;

use super::delegated::{DelegatedDelRan, DelegatedRan, PluginUndo};
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

mod check;
mod entry;
mod interfaces;

pub use entry::*;
pub use interfaces::*;

fn invalid(reason: impl Into<String>) -> AgentError {
    AgentError::Invalid {
        reason: reason.into(),
    }
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
    /// Interfaces to make off the agent's owner, then [`Agent::endpoint_add_finish`].
    Interfaces(Box<PreparedAdd>),
    /// Delegated mode: the plugin to run off the agent's owner, then
    /// [`Agent::endpoint_add_delegated`].
    Delegated(Box<super::delegated::DelegatedAdd>),
    /// The attachment was half-gone (its netns deleted, a crash): its old
    /// allocation is released and what that DEL leaves to a plugin or the
    /// kernel is to run off the agent's owner; then the ADD begins again.
    StartOver(Box<DelCleanup>),
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

    /// The pool of a request that names none: the configuration's
    /// `default_pool`, else `[kubernetes] pod_cidr_pool` (the pool made for
    /// this node's pods), else its first pool, else (cluster mode) the
    /// default etcd records — never the first cluster pool read, whose
    /// order is etcd's key order (adding pool `aaa` moved every such
    /// request to it).
    pub(super) fn default_pool(&self) -> Result<String, AgentError> {
        if let Some(d) = &self.config.default_pool {
            return Ok(d.clone());
        }
        if let Some(p) = self
            .config
            .kubernetes
            .as_ref()
            .and_then(|k| k.pod_cidr_pool.as_ref())
        {
            return Ok(p.clone());
        }
        if let Some(p) = self.config.pools.first() {
            return Ok(p.name.clone());
        }
        match self.cluster_default() {
            Some(Ok(Some(name))) => Ok(name),
            Some(Ok(None)) => Err(invalid(
                "no pool is configured and etcd holds no cluster pool",
            )),
            Some(Err(reason)) => Err(AgentError::Invalid { reason }),
            None => self
                .manager
                .source()
                .0
                .first()
                .map(|p| p.name.clone())
                .ok_or_else(|| invalid("no pool is configured")),
        }
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
        let mut begun = self.endpoint_add_begin(req.clone())?;
        if let AddBegin::StartOver(cleanup) = begun {
            self.del_held(*cleanup)?;
            begun = self.endpoint_add_begin(req)?;
        }
        if let AddBegin::Delegated(d) = begun {
            let ran = d.run();
            let (next, undo) = self.endpoint_add_delegated(ran);
            if let Some(undo) = undo {
                undo.run();
            }
            begun = next?;
        }
        match begun {
            AddBegin::Done(reply) => Ok(*reply),
            AddBegin::Delegated(_) => Err(invalid("the plugin's ADD was asked to run twice")),
            AddBegin::StartOver(_) => Err(invalid("the ADD started over twice")),
            AddBegin::Interfaces(p) => {
                let made = build_interfaces(&p.req, &p.addresses(), p.attach.as_ref());
                self.endpoint_add_finish(*p, made)
            }
        }
    }

    /// Endpoint ADD in delegated mode, second step: the plugin's result
    /// checked (no address anyone else holds) and carried on as any ADD
    /// ([`AddBegin`]: done in IPAM mode, interfaces to make in full mode).
    /// On an error, the plugin's addresses are to be given back with the
    /// returned [`PluginUndo`] (run it with the agent free).
    pub fn endpoint_add_delegated(
        &mut self,
        ran: DelegatedRan,
    ) -> (Result<AddBegin, AgentError>, Option<PluginUndo>) {
        let c = match self.delegated_checked(ran) {
            (Ok(c), _) => c,
            (Err(e), undo) => return (Err(e), undo),
        };
        let plugin = c.record.plugin.clone();
        let begun = self.prepare_add(c.req, c.key, plugin, c.allocated, Some(c.record));
        if let Err(e) = &begun {
            self.note_error(e);
        }
        (begun, None)
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
            // Half-gone (the runtime deleted the netns, or a crash): start
            // over. The release is committed here; a plugin's DEL or the
            // kernel's work it leaves runs off the owner, then the ADD
            // begins again.
            let cleanup = self.endpoint_del_commit(&req.container_id, &req.ifname)?;
            if !cleanup.is_empty() {
                return Ok(AddBegin::StartOver(Box::new(cleanup)));
            }
        }
        if self.delegated_mode() {
            // The plugin runs with the agent free (`endpoint_add_delegated`).
            return self
                .delegated_endpoint_begin(req, key)
                .map(|d| AddBegin::Delegated(Box::new(d)));
        }
        let pool = match &req.pool {
            Some(p) => p.clone(),
            None => self.default_pool()?,
        };
        let allocated = self.allocate_endpoint(&req, &pool)?;
        self.prepare_add(req, key, pool, allocated, None)
    }

    /// ADD's first phase once the addresses are held: IPAM-only ADDs
    /// finish here; full ones leave the attachment pending.
    pub(super) fn prepare_add(
        &mut self,
        req: EndpointRequest,
        key: String,
        pool: String,
        allocated: Vec<Allocation>,
        delegated: Option<crate::store::DelegatedRecord>,
    ) -> Result<AddBegin, AgentError> {
        let mut req = req;
        if req.mtu.is_none() {
            // Room for the encapsulation in the tunnel modes (`tunnel`).
            req.mtu = self.endpoint_mtu();
        }
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
        let mut families: BTreeSet<Family> = pool.families();
        if families.is_empty() && req.requested.is_empty() {
            // Never acknowledge an endpoint with no address.
            return Err(AgentError::Invalid {
                reason: format!("pool {pool_name} has no CIDR: there is no address to give"),
            });
        }
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
            pod: req.pod.clone(),
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
            gone: None,
            plugin: None,
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

    /// CNI DEL in one command on the agent's owner (the operator's draining release):
    /// idempotent; already gone is success. Unlike a DEL from the plugin it
    /// does not wait for a reaped veth to be gone (`without_gone_wait`).
    ///
    /// # Errors
    /// The store could not record the release (the endpoint then stays).
    pub fn endpoint_del(&mut self, req: DelRequest) -> Result<(), AgentError> {
        let cleanup = self.endpoint_del_begin(req)?;
        self.del_held(cleanup)
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

    /// A DEL made in one command on the agent's owner (leak release, CHECK's repair): see
    /// [`without_gone_wait`].
    pub(super) fn endpoint_del_inner(
        &mut self,
        container_id: &str,
        ifname: &str,
    ) -> Result<(), AgentError> {
        let cleanup = self.endpoint_del_commit(container_id, ifname)?;
        self.del_held(cleanup)
    }

    /// The rest of a DEL run while the agent is held (tools, leak
    /// release, CHECK's repair): a delegated attachment's plugin runs
    /// here, the veth's removal is not waited for ([`without_gone_wait`]).
    /// The API's GC and ADDs run it off the owner instead
    /// ([`endpoint_gc_concurrent`], [`endpoint_add_concurrent`]).
    fn del_held(&mut self, cleanup: DelCleanup) -> Result<(), AgentError> {
        let mut cleanup = without_gone_wait(cleanup);
        if let Some(plugin) = cleanup.plugin.take() {
            let ran = plugin.run();
            cleanup = without_gone_wait(self.endpoint_del_delegated(ran)?);
        }
        cleanup.run()
    }

    /// A delegated endpoint DEL's second hold, after the plugin ran: a DEL
    /// it failed keeps the record (reconcile puts the entries back; the
    /// runtime retries the DEL); one it answered is committed. While the
    /// plugin ran, the attachment was pending: no reconcile put its entries
    /// back.
    ///
    /// # Errors
    /// The plugin's DEL failed, or the store did.
    pub fn endpoint_del_delegated(
        &mut self,
        ran: DelegatedDelRan,
    ) -> Result<DelCleanup, AgentError> {
        let (d, outcome) = ran.into_parts();
        let key = d.key();
        self.pending.remove(&key);
        self.count("DEL");
        outcome.map_err(AgentError::from)?;
        let record = self.endpoints.get(&key).cloned();
        self.store.remove_delegated(&key)?;
        self.delegated.remove(&key);
        let (container_id, ifname) = (d.container_id.clone(), d.ifname.clone());
        Ok(self.del_cleanup(&key, &container_id, &ifname, record, Some(d)))
    }

    fn endpoint_del_commit(
        &mut self,
        container_id: &str,
        ifname: &str,
    ) -> Result<DelCleanup, AgentError> {
        let key = endpoint_key(container_id, ifname);
        if self.reaper.holds_key(&key) {
            // DEL'd already; its veth is being deleted (`reaper`): answered
            // once it is gone, like the first DEL.
            return Ok(DelCleanup {
                gone: self.reaper.gone_wait(&key),
                ..DelCleanup::default()
            });
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
        if let Some(d) = delegated {
            // Unprogrammed → the plugin releases (with the agent free:
            // `endpoint_del_delegated`) → commit. The attachment stays
            // pending meanwhile.
            let plugin = self.delegated_endpoint_del_begin(d)?;
            self.pending.insert(key);
            return Ok(DelCleanup {
                plugin: Some(plugin),
                ..DelCleanup::default()
            });
        } else if let Some(r) = record
            .as_ref()
            .filter(|r| r.mode == EndpointMode::Full && r.host_ifname.is_some())
        {
            // Unprogrammed; the addresses stay held until the reaper has
            // the veth deleted (the container's interface holds them until
            // then), and the DEL is answered once it is (off the agent's owner).
            self.begin_release(r, allocated)?;
            return Ok(DelCleanup {
                gone: self.reaper.gone_wait(&key),
                ..DelCleanup::default()
            });
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
        // its names and removed (off the agent's owner).
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
            gone: None,
            plugin: None,
        }
    }
}

/// A DEL's kernel work without the wait for its veth to be gone, for DELs
/// run in a command on the agent's owner: the reaper asks the owner to confirm
/// an interface gone, so such a wait could only time out. The release stays
/// pending and its addresses held until the reaper has the veth deleted;
/// only a plugin's DEL, which waits off the agent's owner, is answered after.
fn without_gone_wait(mut cleanup: DelCleanup) -> DelCleanup {
    cleanup.gone = None;
    cleanup
}
