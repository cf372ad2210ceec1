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
use std::time::Duration;

use lockstep_core::manager::Allocation;
use lockstep_core::owner::{AgentRole, Generation, Owner};

use super::{Agent, AgentError};
use crate::config::IpamMode;
use crate::delegate::{AddOutcome, DelegateError, Runner, Target};
use crate::store::{DelegatedRecord, EndpointRecord};
use crate::wire::{EndpointAddress, EndpointReply, EndpointRequest};

mod setup;

pub use setup::{Held, OnAgent, poll_setup};

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

    /// Tries delegated set-up once, on this agent held by the caller (its
    /// start); the server retries it through the owner's handle
    /// ([`poll_setup`]). Returns whether the agent is ready.
    ///
    /// # Errors
    /// As [`poll_setup`].
    pub fn poll_setup(&mut self) -> Result<bool, AgentError> {
        poll_setup(&Held(std::cell::RefCell::new(self)))
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

    fn next_generation(&self) -> Generation {
        let mine = self.delegated.values().map(|d| d.generation).max();
        mine.unwrap_or_default()
            .max(self.manager.generation())
            .next()
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
/// run off it (`Agent::delegated_gc_plan`).
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
