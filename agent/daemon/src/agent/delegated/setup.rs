//! Delegated mode's set-up in phases (#46 item 2): the plugin's CHECK, ADD
//! and DEL of the agent's role attachments, and the CHECK of every
//! remembered endpoint, run with the agent free; only deciding and
//! committing are steps on it.
//!
//! Why: a plugin call may take up to its timeout (minutes), and set-up
//! makes several. Run inside one step on the agent's owner, every other
//! command (metrics, reconciles, the cluster tasks' changes) waited for
//! all of them. The order of a lockstep change is unchanged: ADD → commit →
//! program (a compensating DEL when a step after the ADD fails); unprogram
//! → DEL → commit. Between a release's steps its attachment is pending, so
//! no reconcile puts its entries back.
//!
//! The same phases run through the owner's handle (the server's set-up
//! loop) or on an agent held by the caller (its start), through
//! [`OnAgent`].

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Instant;

use lockstep_core::owner::{AgentRole, Owner};

use super::{COMPENSATING_DEL, RETRY, send_compensating_del};
use crate::agent::{Agent, AgentError, AgentHandle};
use crate::config::IpamConfig;
use crate::delegate::{DelegateError, PluginConf, Runner, Target, check_state_dir, ensure_netns};
use crate::error_chain as chain;
use crate::store::DelegatedRecord;

/// Where set-up's steps on the agent run.
pub trait OnAgent {
    /// Runs `f` on the agent and returns what it returned.
    ///
    /// # Errors
    /// The agent is gone (its owner stopped).
    fn on<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Agent) -> R + Send + 'static,
    ) -> Result<R, AgentError>;
}

impl OnAgent for AgentHandle {
    fn on<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Agent) -> R + Send + 'static,
    ) -> Result<R, AgentError> {
        self.call(move |slot| slot.as_mut().map(f))?
            .ok_or_else(|| AgentError::NotReady {
                reason: "the agent's owner holds no agent".into(),
            })
    }
}

/// An agent the caller holds (its start, before any owner runs it).
pub struct Held<'a>(pub RefCell<&'a mut Agent>);

impl OnAgent for Held<'_> {
    fn on<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Agent) -> R + Send + 'static,
    ) -> Result<R, AgentError> {
        Ok(f(&mut self.0.borrow_mut()))
    }
}

/// What set-up needs of the agent, taken in its first step.
struct Plan {
    ipam: IpamConfig,
    netns: PathBuf,
    /// The roles the configuration enables, each with its attachment
    /// (container ID, interface name).
    wanted: BTreeMap<AgentRole, (String, String)>,
    /// The role attachments remembered.
    roles: Vec<DelegatedRecord>,
    /// The endpoint attachments remembered.
    endpoints: Vec<DelegatedRecord>,
}

/// Where set-up stands, as its first step finds it.
enum Start {
    /// Ready already (or not in delegated mode: now ready).
    Ready,
    /// A failed attempt is waiting out [`RETRY`].
    Later,
    /// To be tried now.
    Try(Box<Plan>),
}

fn target(d: &DelegatedRecord) -> Target<'_> {
    Target {
        container_id: &d.container_id,
        ifname: &d.ifname,
        netns: &d.netns,
    }
}

/// Tries delegated set-up once (retried by the server until it succeeds).
/// Returns whether the agent is ready.
///
/// # Errors
/// Only what must refuse delegated mode (the plugin's state is not the
/// node's), or the agent gone; everything else is reported through status
/// and retried.
pub fn poll_setup(on: &impl OnAgent) -> Result<bool, AgentError> {
    let plan = match on.on(Agent::setup_start)? {
        Start::Ready => return Ok(true),
        Start::Later => return Ok(false),
        Start::Try(plan) => plan,
    };
    let mut counts = Vec::new();
    let r = setup(on, *plan, &mut counts);
    on.on(move |a| {
        for c in counts {
            a.count(c);
        }
        a.setup_finished(r)
    })?
}

/// One attempt, off the agent but for its steps; `counts`: the plugin
/// commands sent, for the agent's counts.
fn setup(on: &impl OnAgent, plan: Plan, counts: &mut Vec<&'static str>) -> Result<(), AgentError> {
    let cfg = &plan.ipam;
    let conf = PluginConf::load(&cfg.conflist, &cfg.plugin_dirs)?;
    if let Some(dir) = &conf.state_dir {
        check_state_dir(dir, &cfg.node_root)?;
    }
    ensure_netns(&plan.netns)?;
    tracing::info!(plugin = %conf.plugin, binary = %conf.binary.display(), netns = %plan.netns.display(), "delegated IPAM plugin found");
    let runner = Runner {
        conf,
        cni_path: cfg.plugin_dirs.clone(),
        timeout: cfg.timeout,
    };
    let set = runner.clone();
    on.on(move |a| a.delegate = Some(set))?;
    sync_roles(on, &runner, &plan, counts)?;
    check_endpoints(&runner, &plan.endpoints, counts);
    on.on(|a| a.reconcile_inner().map(|_| ()))?
}

/// Makes the role attachments match the configuration: CHECK what is
/// remembered (0.4.0+; DEL and ADD again when CHECK fails, or always for
/// older plugins and a changed plugin config), DEL what is disabled, ADD
/// what is missing.
fn sync_roles(
    on: &impl OnAgent,
    runner: &Runner,
    plan: &Plan,
    counts: &mut Vec<&'static str>,
) -> Result<(), AgentError> {
    let mut kept = BTreeSet::new();
    for d in &plan.roles {
        let Owner::Agent { role } = d.owner else {
            continue;
        };
        if !plan.wanted.contains_key(&role) {
            tracing::info!(%role, addresses = ?d.addresses, "role disabled; releasing its delegated address");
            release(on, runner, d)?;
            continue;
        }
        let same_config = d.config_hash == runner.conf.hash && d.plugin == runner.conf.plugin;
        if same_config && checkable(runner, d) {
            counts.push("CHECK");
            match runner.check(&target(d), &d.result) {
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
        release(on, runner, d)?;
    }
    for (role, (container_id, ifname)) in &plan.wanted {
        if !kept.contains(role) {
            let target = Target {
                container_id,
                ifname,
                netns: &plan.netns,
            };
            add_role(on, runner, *role, &target)?;
        }
    }
    Ok(())
}

/// Whether the plugin can CHECK `d` (it has CHECK, and `d` was made at
/// 0.4.0 or later).
fn checkable(runner: &Runner, d: &DelegatedRecord) -> bool {
    runner.has_check()
        && d.cni_version
            .parse::<crate::cni::CniVersion>()
            .is_ok_and(|v| v >= crate::cni::CniVersion::V0_4_0)
}

/// CHECKs every remembered endpoint attachment (0.4.0+ plugins, same
/// plugin config). Unlike a role, an endpoint whose CHECK fails is not
/// re-ADDed behind its pod's back (that would change a running pod's
/// address): the failure is logged and counted, and the runtime's own
/// CHECK/DEL/ADD cycle repairs it.
fn check_endpoints(runner: &Runner, endpoints: &[DelegatedRecord], counts: &mut Vec<&'static str>) {
    for d in endpoints {
        if d.config_hash != runner.conf.hash || !checkable(runner, d) {
            continue;
        }
        counts.push("CHECK");
        if let Err(e) = runner.check(&target(d), &d.result) {
            counts.push("CHECK_FAILED");
            tracing::error!(container = %d.container_id, ifname = %d.ifname, error = %e, "delegated CHECK of an endpoint failed");
        }
    }
}

/// Releases a role attachment: unprogram (a step; the attachment pending
/// from there) → the plugin's DEL → commit (a step). A failed DEL puts the
/// entries back and keeps the record (retried with set-up).
fn release(on: &impl OnAgent, runner: &Runner, d: &DelegatedRecord) -> Result<(), AgentError> {
    let held = d.clone();
    on.on(move |a| {
        for x in &Agent::allocations_of(&held) {
            a.unprogram(x)?;
        }
        a.count("DEL");
        a.pending.insert(held.key());
        Ok::<_, AgentError>(())
    })??;
    let outcome = runner.del(&target(d), Some(&d.result));
    let held = d.clone();
    on.on(move |a| {
        let key = held.key();
        a.pending.remove(&key);
        if let Err(e) = outcome {
            // The plugin still holds the addresses: put the entries back,
            // and report any that cannot be (verify shows them missing).
            let more: Vec<AgentError> = Agent::allocations_of(&held)
                .iter()
                .filter_map(|x| a.program(x).err())
                .collect();
            return Err(AgentError::with_more(e.into(), more));
        }
        a.store.remove_delegated(&key)?;
        a.delegated.remove(&key);
        Ok(())
    })?
}

/// Reserves a role's address: the plugin's ADD, then commit and program
/// (a step); a failure after a successful ADD sends a compensating DEL.
fn add_role(
    on: &impl OnAgent,
    runner: &Runner,
    role: AgentRole,
    target: &Target<'_>,
) -> Result<(), AgentError> {
    let added = runner.add(target);
    let compensated = matches!(&added, Err(e) if !matches!(e, DelegateError::Plugin { .. }));
    if compensated {
        // A hung or garbled ADD may have allocated: DEL is idempotent.
        send_compensating_del(runner, target, None);
    }
    let conf = runner.conf.clone();
    let (container_id, ifname, netns) = (
        target.container_id.to_owned(),
        target.ifname.to_owned(),
        target.netns.to_path_buf(),
    );
    let (done, undo) = on.on(move |a| {
        a.count("ADD");
        if compensated {
            a.count("DEL");
            a.count(COMPENSATING_DEL);
        }
        let outcome = match added {
            Ok(o) => o,
            Err(e) => return (Err(e.into()), None),
        };
        let record = DelegatedRecord {
            owner: Owner::agent(role),
            container_id,
            ifname,
            netns,
            plugin: conf.plugin.clone(),
            config_hash: conf.hash.clone(),
            cni_version: conf.cni_version.as_str().to_string(),
            result: outcome.raw,
            addresses: outcome.addresses,
            generation: a.next_generation(),
        };
        match a.commit_role(&record) {
            Ok(()) => (Ok(()), None),
            Err((e, undo)) => {
                if undo {
                    a.count("DEL");
                    a.count(COMPENSATING_DEL);
                }
                (Err(e), undo.then_some(record.result))
            }
        }
    })?;
    if let Some(prev) = undo {
        send_compensating_del(runner, target, Some(&prev));
    }
    if done.is_ok() {
        tracing::info!(%role, "reserved a delegated role address");
    }
    done
}

impl Agent {
    /// Set-up's first step: where it stands, and what it needs.
    fn setup_start(&mut self) -> Start {
        if self.ready {
            return Start::Ready;
        }
        if !self.delegated_mode() {
            self.ready = true;
            return Start::Ready;
        }
        if self.retry_at.is_some_and(|at| Instant::now() < at) {
            return Start::Later;
        }
        let r = &self.config.roles;
        let wanted = [
            (AgentRole::Router, &r.router),
            (AgentRole::Health, &r.health),
            (AgentRole::Ingress, &r.ingress),
        ]
        .into_iter()
        .filter(|(_, c)| c.ipv4 || c.ipv6)
        .map(|(role, _)| (role, self.role_attachment(role)))
        .collect();
        let (roles, endpoints) = self
            .delegated
            .values()
            .cloned()
            .partition(|d| matches!(d.owner, Owner::Agent { .. }));
        Start::Try(Box::new(Plan {
            ipam: self.config.ipam.clone(),
            netns: self.ipam_netns(),
            wanted,
            roles,
            endpoints: endpoints
                .into_iter()
                .filter(|d: &DelegatedRecord| matches!(d.owner, Owner::Delegated { .. }))
                .collect(),
        }))
    }

    /// A role's record after its ADD: checked (no address anyone else
    /// holds), committed and programmed. On a failure, whether the plugin
    /// must be given the address back (a compensating DEL, off the owner):
    /// not when the store kept the record (store, memory and plugin then
    /// agree the role holds it, and reconcile programs it).
    fn commit_role(&mut self, record: &DelegatedRecord) -> Result<(), (AgentError, bool)> {
        self.check_unique(record).map_err(|e| (e, true))?;
        self.store
            .put_delegated(record, None)
            .map_err(|e| (e.into(), true))?;
        let key = record.key();
        self.delegated.insert(key.clone(), record.clone());
        let allocs = Self::allocations_of(record);
        for x in &allocs {
            if let Err(e) = self.program(x) {
                // Every undo step is tried and every failure reported.
                let mut more: Vec<AgentError> = allocs
                    .iter()
                    .filter_map(|b| self.unprogram(b).err())
                    .collect();
                return match self.store.remove_delegated(&key) {
                    Ok(()) => {
                        self.delegated.remove(&key);
                        Err((AgentError::with_more(e, more), true))
                    }
                    Err(s) => {
                        more.push(s.into());
                        Err((AgentError::with_more(e, more), false))
                    }
                };
            }
        }
        Ok(())
    }

    /// Set-up's last step: ready, or not ready with the reason and retried
    /// later (a failing plugin is not hammered; a missing file is polled at
    /// the server's pace).
    fn setup_finished(&mut self, r: Result<(), AgentError>) -> Result<bool, AgentError> {
        match r {
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
                self.retry_at = (!waiting).then(|| Instant::now() + RETRY);
                Ok(false)
            }
        }
    }
}
