//! Delegated IPAM: the agent's role addresses and endpoint addresses come
//! from an external CNI IPAM plugin named in the node's conflist.
//!
//! Why the agent runs the plugin itself, in lockstep order: ADD → commit the
//! result (fsync) → program the maps → acknowledge; a failure after a
//! successful ADD sends a compensating DEL, so the plugin never holds an
//! address the agent forgot. A release goes the other way: unprogram → DEL →
//! commit. Role attachments use a stable container ID
//! (`lockstep-<node>-<role>`) and an interface name per role, in a network
//! namespace the agent owns (never the node's: the spec requires a namespace
//! for ADD, and a misbehaving or interface-creating plugin must not touch the
//! node's own interfaces).
//!
//! Set-up waits without crash-looping: an absent conflist, a missing binary
//! or a failing plugin leave the agent running and not ready, with the reason
//! in its status, and set-up is retried ([`Agent::poll_setup`]). Only a
//! plugin state directory that is not the node's refuses delegated mode
//! outright, because retrying cannot fix a wrong mount.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use lockstep_core::manager::Allocation;
use lockstep_core::owner::{AgentRole, Generation, Owner};

use super::{Agent, AgentError};
use crate::config::IpamMode;
use crate::delegate::{
    AddOutcome, DelegateError, PluginConf, Runner, Target, check_state_dir, ensure_netns,
};
use crate::error_chain as chain;
use crate::store::{DelegatedRecord, EndpointRecord};
use crate::wire::{EndpointAddress, EndpointReply, EndpointRequest};

/// How long a failed set-up waits before it is tried again.
pub const RETRY: Duration = Duration::from_secs(1);

/// The CNI command names counted in status.
pub const COMPENSATING_DEL: &str = "compensating_del";

/// A delegated endpoint ADD between its two holds of the agent: the
/// attachment is marked pending (no other request touches it), and the
/// plugin, which may take up to its timeout, runs with the agent free
/// ([`DelegatedAdd::run`]); [`Agent::endpoint_add_delegated`] takes the
/// result back.
#[derive(Debug)]
pub struct DelegatedAdd {
    req: EndpointRequest,
    key: String,
    runner: Runner,
}

/// A delegated ADD whose plugin result was checked: what the ADD carries on
/// with.
#[derive(Debug)]
pub struct CheckedAdd {
    /// The ADD.
    pub req: EndpointRequest,
    /// Its attachment's key.
    pub key: String,
    /// The plugin's addresses, as the agent's allocations.
    pub allocated: Vec<Allocation>,
    /// The record to store.
    pub record: DelegatedRecord,
}

/// What the plugin's ADD came to, for [`Agent::endpoint_add_delegated`].
#[derive(Debug)]
pub struct DelegatedRan {
    add: DelegatedAdd,
    outcome: Result<AddOutcome, DelegateError>,
    /// A compensating DEL was sent (a hung or garbled ADD may have
    /// allocated).
    compensated: bool,
}

/// A compensating DEL to send with the agent free: an ADD the plugin
/// answered that the agent then refused or could not keep.
#[derive(Debug)]
pub struct PluginUndo {
    runner: Runner,
    container_id: String,
    ifname: String,
    netns: PathBuf,
    prev: Option<serde_json::Value>,
}

impl PluginUndo {
    /// Sends the DEL (blocking: the plugin runs); a failure is logged.
    pub fn run(self) {
        let target = Target {
            container_id: &self.container_id,
            ifname: &self.ifname,
            netns: &self.netns,
        };
        send_compensating_del(&self.runner, &target, self.prev.as_ref());
    }
}

/// A delegated endpoint DEL between its two holds of the agent: its
/// entries unprogrammed, the attachment pending, the plugin's DEL to run.
#[derive(Debug)]
pub struct DelegatedDel {
    record: DelegatedRecord,
    runner: Runner,
}

/// What the plugin's DEL came to, for [`Agent::endpoint_del_delegated`].
#[derive(Debug)]
pub struct DelegatedDelRan {
    record: DelegatedRecord,
    outcome: Result<(), DelegateError>,
}

impl DelegatedDel {
    /// Runs the plugin's DEL (blocking, never with the agent held).
    pub fn run(self) -> DelegatedDelRan {
        let target = Target {
            container_id: &self.record.container_id,
            ifname: &self.record.ifname,
            netns: &self.record.netns,
        };
        let outcome = self.runner.del(&target, Some(&self.record.result));
        DelegatedDelRan {
            record: self.record,
            outcome,
        }
    }
}

impl DelegatedDelRan {
    pub(super) fn into_parts(self) -> (DelegatedRecord, Result<(), DelegateError>) {
        (self.record, self.outcome)
    }
}

impl DelegatedAdd {
    /// Runs the plugin's ADD (blocking, never with the agent held). A hung
    /// or garbled ADD may have allocated: its compensating DEL is sent
    /// here too.
    pub fn run(self) -> DelegatedRan {
        let target = Target {
            container_id: &self.req.container_id,
            ifname: &self.req.ifname,
            netns: &self.req.netns,
        };
        let outcome = self.runner.add(&target);
        let compensated = match &outcome {
            Err(e) if !matches!(e, DelegateError::Plugin { .. }) => {
                send_compensating_del(&self.runner, &target, None);
                true
            }
            _ => false,
        };
        DelegatedRan {
            add: self,
            outcome,
            compensated,
        }
    }
}

impl DelegatedRan {
    /// The DEL that takes back what the plugin gave (nothing to take back
    /// when its ADD failed).
    pub fn undo(&self) -> Option<PluginUndo> {
        let raw = &self.outcome.as_ref().ok()?.raw;
        Some(undo_of(&self.add.runner, &self.add.req, raw))
    }
}

fn undo_of(runner: &Runner, req: &EndpointRequest, raw: &serde_json::Value) -> PluginUndo {
    PluginUndo {
        runner: runner.clone(),
        container_id: req.container_id.clone(),
        ifname: req.ifname.clone(),
        netns: req.netns.clone(),
        prev: Some(raw.clone()),
    }
}

/// Sends a compensating DEL and logs what came of it.
fn send_compensating_del(runner: &Runner, target: &Target<'_>, prev: Option<&serde_json::Value>) {
    match runner.del(target, prev) {
        Ok(()) => tracing::info!(
            container = target.container_id,
            ifname = target.ifname,
            "compensating DEL sent"
        ),
        Err(e) => {
            tracing::error!(error = %e, container = target.container_id, "compensating DEL failed; the plugin may hold a leaked address")
        }
    }
}

impl Agent {
    /// Whether addresses come from an external plugin.
    pub fn delegated_mode(&self) -> bool {
        self.config.ipam.mode == IpamMode::Delegated
    }

    /// Counts a CNI command sent to the plugin.
    pub(super) fn count(&mut self, command: &'static str) {
        *self.stats.ipam_commands.entry(command).or_default() += 1;
    }

    /// The namespace the agent runs the plugin in for its own attachments.
    pub fn ipam_netns(&self) -> PathBuf {
        self.config
            .ipam
            .netns
            .clone()
            .unwrap_or_else(|| self.config.state_dir.join("ipam-netns"))
    }

    /// The stable container ID and interface name of a role's attachment.
    pub fn role_attachment(&self, role: AgentRole) -> (String, String) {
        (
            format!("lockstep-{}-{}", self.node, role.name()),
            format!("ls-{}", role.name()),
        )
    }

    /// The allocations of the delegated records, as the planner sees them.
    pub(super) fn delegated_allocations(&self) -> Vec<Allocation> {
        self.delegated
            .values()
            .flat_map(|d| {
                d.addresses.iter().map(|a| Allocation {
                    pool: d.plugin.clone(),
                    address: *a,
                    owner: d.owner.clone(),
                    generation: d.generation,
                })
            })
            .collect()
    }

    pub(super) fn allocations_of(d: &DelegatedRecord) -> Vec<Allocation> {
        d.addresses
            .iter()
            .map(|a| Allocation {
                pool: d.plugin.clone(),
                address: *a,
                owner: d.owner.clone(),
                generation: d.generation,
            })
            .collect()
    }

    fn runner(&self) -> Result<&Runner, AgentError> {
        self.delegate.as_ref().ok_or_else(|| AgentError::NotReady {
            reason: self
                .not_ready
                .clone()
                .unwrap_or_else(|| "delegated IPAM is not set up".into()),
        })
    }

    /// Tries delegated set-up (once per call, retried by the server until it
    /// succeeds). Returns whether the agent is ready.
    ///
    /// # Errors
    /// Only what must refuse delegated mode (the plugin's state is not the
    /// node's); everything else is reported through status and retried.
    pub fn poll_setup(&mut self) -> Result<bool, AgentError> {
        if self.ready {
            return Ok(true);
        }
        if !self.delegated_mode() {
            self.ready = true;
            return Ok(true);
        }
        if self.retry_at.is_some_and(|at| Instant::now() < at) {
            return Ok(false);
        }
        match self.delegated_setup() {
            Ok(()) => {
                self.ready = true;
                self.not_ready = None;
                self.retry_at = None;
                tracing::info!(roles = ?self.roles(), "delegated IPAM set up; ready");
                Ok(true)
            }
            Err(AgentError::Delegate(e)) if e.is_fatal() => Err(AgentError::Delegate(e)),
            Err(e) => {
                let waiting = matches!(
                    &e,
                    AgentError::Delegate(d) if matches!(**d, DelegateError::ConflistMissing { .. })
                );
                let reason = chain(&e);
                if self.not_ready.as_deref() != Some(reason.as_str()) {
                    if waiting {
                        tracing::info!(%reason, "not ready");
                    } else {
                        tracing::error!(%reason, "delegated IPAM set-up failed; retrying");
                    }
                }
                self.not_ready = Some(reason);
                // A missing file is polled at the server's pace; a failing
                // plugin is not hammered.
                self.retry_at = (!waiting).then(|| Instant::now() + RETRY);
                Ok(false)
            }
        }
    }

    fn delegated_setup(&mut self) -> Result<(), AgentError> {
        let cfg = self.config.ipam.clone();
        let conf = PluginConf::load(&cfg.conflist, &cfg.plugin_dirs)?;
        if let Some(dir) = &conf.state_dir {
            check_state_dir(dir, &cfg.node_root)?;
        }
        let netns = self.ipam_netns();
        ensure_netns(&netns)?;
        tracing::info!(plugin = %conf.plugin, binary = %conf.binary.display(), netns = %netns.display(), "delegated IPAM plugin found");
        self.delegate = Some(Runner {
            conf,
            cni_path: cfg.plugin_dirs.clone(),
            timeout: cfg.timeout,
        });
        self.sync_delegated_roles()?;
        self.check_delegated_endpoints();
        self.reconcile_inner()?;
        Ok(())
    }

    /// CHECKs every remembered endpoint attachment (0.4.0+ plugins, same
    /// plugin config). Unlike a role, an endpoint whose CHECK fails is not
    /// re-ADDed behind its pod's back (that would change a running pod's
    /// address): the failure is logged and counted, and the runtime's own
    /// CHECK/DEL/ADD cycle repairs it.
    fn check_delegated_endpoints(&mut self) {
        let Ok(runner) = self.runner().cloned() else {
            return;
        };
        let endpoints: Vec<DelegatedRecord> = self
            .delegated
            .values()
            .filter(|d| matches!(d.owner, Owner::Delegated { .. }))
            .cloned()
            .collect();
        for d in endpoints {
            let checkable = runner.has_check()
                && d.config_hash == runner.conf.hash
                && d.cni_version
                    .parse::<crate::cni::CniVersion>()
                    .is_ok_and(|v| v >= crate::cni::CniVersion::V0_4_0);
            if !checkable {
                continue;
            }
            self.count("CHECK");
            let target = Target {
                container_id: &d.container_id,
                ifname: &d.ifname,
                netns: &d.netns,
            };
            if let Err(e) = runner.check(&target, &d.result) {
                self.count("CHECK_FAILED");
                tracing::error!(container = %d.container_id, ifname = %d.ifname, error = %e, "delegated CHECK of an endpoint failed");
            }
        }
    }

    /// Roles the configuration enables (either family).
    fn wanted_delegated_roles(&self) -> BTreeSet<AgentRole> {
        let r = &self.config.roles;
        [
            (AgentRole::Router, &r.router),
            (AgentRole::Health, &r.health),
            (AgentRole::Ingress, &r.ingress),
        ]
        .into_iter()
        .filter(|(_, c)| c.ipv4 || c.ipv6)
        .map(|(role, _)| role)
        .collect()
    }

    /// Makes the role attachments match the configuration: CHECK what is
    /// remembered (0.4.0+; DEL and ADD again when CHECK fails, or always for
    /// older plugins and a changed plugin config), DEL what is disabled, ADD
    /// what is missing.
    fn sync_delegated_roles(&mut self) -> Result<(), AgentError> {
        let wanted = self.wanted_delegated_roles();
        let held: Vec<DelegatedRecord> = self
            .delegated
            .values()
            .filter(|d| matches!(d.owner, Owner::Agent { .. }))
            .cloned()
            .collect();
        let mut kept = BTreeSet::new();
        for d in held {
            let Owner::Agent { role } = d.owner else {
                continue;
            };
            if !wanted.contains(&role) {
                tracing::info!(%role, addresses = ?d.addresses, "role disabled; releasing its delegated address");
                self.delegated_release(&d)?;
                continue;
            }
            let runner = self.runner()?.clone();
            let same_config = d.config_hash == runner.conf.hash && d.plugin == runner.conf.plugin;
            let checkable = runner.has_check()
                && d.cni_version
                    .parse::<crate::cni::CniVersion>()
                    .is_ok_and(|v| v >= crate::cni::CniVersion::V0_4_0);
            if same_config && checkable {
                self.count("CHECK");
                let target = Target {
                    container_id: &d.container_id,
                    ifname: &d.ifname,
                    netns: &d.netns,
                };
                match runner.check(&target, &d.result) {
                    Ok(()) => {
                        kept.insert(role);
                        continue;
                    }
                    Err(e) => {
                        tracing::warn!(%role, error = %e, "CHECK failed; DEL and ADD again");
                    }
                }
            } else if !same_config {
                tracing::info!(%role, "the plugin config changed; DEL and ADD again");
            } else {
                tracing::info!(%role, "the plugin predates CHECK; DEL and ADD again");
            }
            self.delegated_release(&d)?;
        }
        for role in wanted.difference(&kept).copied().collect::<Vec<_>>() {
            self.delegated_add_role(role)?;
        }
        Ok(())
    }

    fn next_generation(&self) -> Generation {
        let mine = self.delegated.values().map(|d| d.generation).max();
        mine.unwrap_or_default()
            .max(self.manager.generation())
            .next()
    }

    /// Runs ADD and validates the result; on any failure after a successful
    /// ADD sends a compensating DEL.
    fn delegated_add(
        &mut self,
        owner: Owner,
        target: &Target<'_>,
    ) -> Result<DelegatedRecord, AgentError> {
        let runner = self.runner()?.clone();
        self.count("ADD");
        let outcome = match runner.add(target) {
            Ok(o) => o,
            Err(e) => {
                // A hung or garbled ADD may have allocated: DEL is idempotent.
                if !matches!(e, DelegateError::Plugin { .. }) {
                    self.compensate(&runner, target, None);
                }
                return Err(e.into());
            }
        };
        let record = DelegatedRecord {
            owner,
            container_id: target.container_id.to_string(),
            ifname: target.ifname.to_string(),
            netns: target.netns.to_path_buf(),
            plugin: runner.conf.plugin.clone(),
            config_hash: runner.conf.hash.clone(),
            cni_version: runner.conf.cni_version.as_str().to_string(),
            result: outcome.raw,
            addresses: outcome.addresses,
            generation: self.next_generation(),
        };
        if let Err(e) = self.check_unique(&record) {
            self.compensate(&runner, target, Some(&record.result));
            return Err(e);
        }
        Ok(record)
    }

    /// Refuses a result that names an address someone else holds.
    fn check_unique(&self, record: &DelegatedRecord) -> Result<(), AgentError> {
        for a in &record.addresses {
            let other = self
                .manager
                .allocations()
                .find(|x| x.address == *a)
                .map(|x| x.owner.clone())
                .or_else(|| {
                    self.delegated
                        .values()
                        .find(|d| d.key() != record.key() && d.addresses.contains(a))
                        .map(|d| d.owner.clone())
                });
            if let Some(other) = other {
                return Err(AgentError::Invalid {
                    reason: format!(
                        "IPAM plugin {} returned {a} for {}, which {other} already holds",
                        record.plugin, record.owner
                    ),
                });
            }
        }
        Ok(())
    }

    /// The compensating DEL after a failed step.
    fn compensate(
        &mut self,
        runner: &Runner,
        target: &Target<'_>,
        prev: Option<&serde_json::Value>,
    ) {
        self.count("DEL");
        self.count(COMPENSATING_DEL);
        send_compensating_del(runner, target, prev);
    }

    fn delegated_add_role(&mut self, role: AgentRole) -> Result<(), AgentError> {
        let (container_id, ifname) = self.role_attachment(role);
        let netns = self.ipam_netns();
        let target = Target {
            container_id: &container_id,
            ifname: &ifname,
            netns: &netns,
        };
        let record = self.delegated_add(Owner::agent(role), &target)?;
        let runner = self.runner()?.clone();
        if let Err(e) = self.store.put_delegated(&record, None) {
            self.compensate(&runner, &target, Some(&record.result));
            return Err(e.into());
        }
        let key = record.key();
        self.delegated.insert(key.clone(), record.clone());
        let allocs = Self::allocations_of(&record);
        for a in &allocs {
            if let Err(e) = self.program(a) {
                // Every undo step is tried and every failure reported. The
                // record goes from memory and the plugin only once the store
                // has let it go: if the store refuses, store, memory and
                // plugin keep agreeing that the role holds the address, and
                // reconcile programs it.
                let mut more: Vec<AgentError> = allocs
                    .iter()
                    .filter_map(|b| self.unprogram(b).err())
                    .collect();
                match self.store.remove_delegated(&key) {
                    Ok(()) => {
                        self.delegated.remove(&key);
                        self.compensate(&runner, &target, Some(&record.result));
                    }
                    Err(s) => more.push(s.into()),
                }
                return Err(AgentError::with_more(e, more));
            }
        }
        tracing::info!(%role, addresses = ?record.addresses, "reserved a delegated role address");
        Ok(())
    }

    /// Releases a delegated attachment: unprogram → DEL → commit. A failed
    /// DEL puts the entries back and keeps the record (retried later).
    fn delegated_release(&mut self, d: &DelegatedRecord) -> Result<(), AgentError> {
        let runner = self.runner()?.clone();
        let allocs = Self::allocations_of(d);
        for a in &allocs {
            self.unprogram(a)?;
        }
        self.count("DEL");
        let target = Target {
            container_id: &d.container_id,
            ifname: &d.ifname,
            netns: &d.netns,
        };
        if let Err(e) = runner.del(&target, Some(&d.result)) {
            // The plugin still holds the addresses: put the entries back,
            // and report any that cannot be (verify shows them missing).
            let more: Vec<AgentError> = allocs
                .iter()
                .filter_map(|a| self.program(a).err())
                .collect();
            return Err(AgentError::with_more(e.into(), more));
        }
        self.store.remove_delegated(&d.key())?;
        self.delegated.remove(&d.key());
        Ok(())
    }

    /// Endpoint ADD in delegated mode, first hold: the attachment marked
    /// pending and the plugin to run ([`DelegatedAdd::run`]) with the agent
    /// free.
    pub(super) fn delegated_endpoint_begin(
        &mut self,
        req: EndpointRequest,
        key: String,
    ) -> Result<DelegatedAdd, AgentError> {
        let runner = self.runner()?.clone();
        self.pending.insert(key.clone());
        Ok(DelegatedAdd { req, key, runner })
    }

    /// Endpoint ADD in delegated mode, second step: the plugin's result
    /// checked (no address anyone else holds) and made a record, to carry
    /// on as any ADD (`Agent::endpoint_add_delegated`). On an error, the
    /// plugin's addresses are to be given back with the returned
    /// [`PluginUndo`] (run it with the agent free).
    pub(super) fn delegated_checked(
        &mut self,
        ran: DelegatedRan,
    ) -> (Result<CheckedAdd, AgentError>, Option<PluginUndo>) {
        let DelegatedRan {
            add,
            outcome,
            compensated,
        } = ran;
        self.pending.remove(&add.key);
        self.count("ADD");
        if compensated {
            self.count("DEL");
            self.count(COMPENSATING_DEL);
        }
        let outcome = match outcome {
            Ok(o) => o,
            Err(e) => {
                let e = AgentError::from(e);
                self.note_error(&e);
                return (Err(e), None);
            }
        };
        let undo = undo_of(&add.runner, &add.req, &outcome.raw);
        let record = DelegatedRecord {
            owner: Owner::Delegated {
                container_id: add.req.container_id.clone(),
                ifname: add.req.ifname.clone(),
            },
            container_id: add.req.container_id.clone(),
            ifname: add.req.ifname.clone(),
            netns: add.req.netns.clone(),
            plugin: add.runner.conf.plugin.clone(),
            config_hash: add.runner.conf.hash.clone(),
            cni_version: add.runner.conf.cni_version.as_str().to_string(),
            result: outcome.raw,
            addresses: outcome.addresses,
            generation: self.next_generation(),
        };
        let checked = self.check_ready().and_then(|()| self.check_unique(&record));
        if let Err(e) = checked {
            self.count("DEL");
            self.count(COMPENSATING_DEL);
            self.note_error(&e);
            return (Err(e), Some(undo));
        }
        let allocated = Self::allocations_of(&record);
        let checked = CheckedAdd {
            req: add.req,
            key: add.key,
            allocated,
            record,
        };
        (Ok(checked), None)
    }

    /// Undoes a delegated endpoint ADD whose later step failed.
    pub(super) fn delegated_undo(&mut self, record: &DelegatedRecord) {
        let Ok(runner) = self.runner().cloned() else {
            return;
        };
        let target = Target {
            container_id: &record.container_id,
            ifname: &record.ifname,
            netns: &record.netns,
        };
        self.compensate(&runner, &target, Some(&record.result));
    }

    /// Endpoint DEL in delegated mode, first hold: the plugin's DEL to run
    /// with the agent free ([`DelegatedDel::run`]), then
    /// [`Agent::endpoint_del_delegated`].
    pub(super) fn delegated_endpoint_del_begin(
        &mut self,
        record: DelegatedRecord,
    ) -> Result<DelegatedDel, AgentError> {
        let runner = self.runner()?.clone();
        Ok(DelegatedDel { record, runner })
    }

    /// The IPAM-mode reply of a delegated endpoint: the plugin's addresses
    /// with its prefixes and gateways.
    pub(super) fn delegated_reply(&self, record: &EndpointRecord) -> Option<EndpointReply> {
        let d = self.delegated.get(&record.key())?;
        let version = d.cni_version.parse().ok()?;
        let result = crate::cni::CniResult::from_json(&d.result, "result", version).ok()?;
        Some(EndpointReply {
            record: record.clone(),
            addresses: result
                .ips
                .iter()
                .map(|ip| EndpointAddress {
                    address: ip.address,
                    gateway: ip.gateway,
                })
                .collect(),
            routes: result.routes.iter().map(|r| (r.dst, r.gw)).collect(),
        })
    }

    /// The addresses of a delegated attachment, if it is one.
    pub(super) fn delegated_addresses(&self, key: &str) -> Vec<IpAddr> {
        self.delegated
            .get(key)
            .map(|d| d.addresses.clone())
            .unwrap_or_default()
    }

    /// Delegated mode's part of a CNI GC, decided on the owner: the plugin
    /// and every attachment it must keep (`valid` and the agent's role
    /// attachments). The plugin runs off the owner ([`DelegatedGc::run`]).
    ///
    /// # Errors
    /// Delegated IPAM is not set up.
    pub(super) fn delegated_gc_plan(
        &self,
        valid: &BTreeSet<(String, String)>,
    ) -> Result<DelegatedGc, AgentError> {
        let runner = self.runner()?.clone();
        let mut all: BTreeSet<(String, String)> = valid.clone();
        for d in self.delegated.values() {
            if matches!(d.owner, Owner::Agent { .. }) {
                all.insert((d.container_id.clone(), d.ifname.clone()));
            }
        }
        Ok(DelegatedGc {
            runner,
            keep: all.into_iter().collect(),
        })
    }
}

/// A CNI GC to pass on to the delegated plugin, decided on the owner and
/// run off it ([`Agent::delegated_gc_plan`]).
#[derive(Debug)]
pub struct DelegatedGc {
    runner: Runner,
    keep: Vec<(String, String)>,
}

impl DelegatedGc {
    /// Asks the plugin its versions, and passes the GC on if it speaks
    /// 1.1.0. Returns the plugin commands sent (for the agent's counts).
    ///
    /// # Errors
    /// The plugin failed.
    pub fn run(&self) -> (Vec<&'static str>, Result<(), AgentError>) {
        let mut sent = vec!["VERSION"];
        let versions = match self.runner.versions() {
            Ok(v) => v,
            Err(e) => return (sent, Err(e.into())),
        };
        if !versions.iter().any(|v| v == "1.1.0") {
            tracing::debug!(plugin = %self.runner.conf.plugin, "the plugin does not support GC; not passed on");
            return (sent, Ok(()));
        }
        sent.push("GC");
        (sent, self.runner.gc(&self.keep).map_err(AgentError::from))
    }
}
