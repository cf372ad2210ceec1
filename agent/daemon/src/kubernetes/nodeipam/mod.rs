//! The NodeIPAM door (#29 item 5, the seed's ENI model): this node's
//! `NodeIPAM` object (`crd`) is watched; the CIDRs the operator offers in
//! its status become local pools; the node's demand per pool and the
//! CIDRs it still holds are written back into its spec.
//!
//! Why a door of its own: the object is both an input (status, the
//! operator's) and an output (spec and conditions, the agent's), and the
//! allocator must keep serving from what it holds while the API is away.
//! The decisions are the core's (`lockstep_core::nodeipam`: accept, step,
//! local pools, demand); this module carries them:
//! - the pools go to the allocator through the same manager sync as
//!   cluster mode's blocks (the agent's cluster pools, through
//!   [`Allocator`]): a CIDR added disturbs nothing, a CIDR dropped drains until empty;
//! - what the node holds is recorded durably (`<state_dir>/nodeipam.json`)
//!   before the allocator may hand out from it, so a restart serves (and
//!   restores its endpoints into) those CIDRs before the API answers
//!   ([`start_specs`]); a CIDR leaves the record only once released;
//! - one pass (on a change of the object, and every `interval`, since pods
//!   coming and going change no object) runs the core's step as one
//!   command on the agent's owner, then writes the spec (merge patch, the agent is its only
//!   writer) and the conditions (merge patch on the status subresource,
//!   guarded by the `resourceVersion` the offer was read at: a condition
//!   never lands on an offer it does not describe; a `409` waits for the
//!   next pass, which the watch brings).
//!
//! Both sides are traits ([`NodeIpamApi`], [`AgentSlot`]), so the pass is
//! unit-tested on an in-memory object and an in-memory allocator.
//!
//! NodeIPAM runs without cluster mode (the config refuses both): it is the
//! alternative to etcd's blocks as the source of this node's CIDRs.

pub mod crd;
pub mod operator;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures::TryStreamExt;
use ipnet::IpNet;
use kube::api::{Api, Patch};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use lockstep_core::demand::DemandMode;
use lockstep_core::nodeipam::{
    Held, NodePool, Offer, Step, accept, local_specs, reported_pools, requested, step,
};
use lockstep_core::pool::PoolSpec;
use serde_json::{Value, json};
use tokio::sync::Notify;

use self::crd::{NodeIPAM, NodeIPAMSpec, PoolDemand};
use super::KubeError;
use super::crd::PoolCondition;

/// The record's name in the state directory.
pub const RECORD: &str = "nodeipam.json";

/// Errors of the durable record.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// The record could not be read.
    #[error("nodeipam record {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The record does not hold what this build writes.
    #[error("nodeipam record {path} is unreadable")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// The parser's error.
        #[source]
        source: serde_json::Error,
    },
    /// The record could not be written; the old one is unchanged.
    #[error("nodeipam record not written")]
    Write(#[source] crate::cluster::HeldError),
}

/// What the node holds, as last recorded; none yet is nothing held.
///
/// # Errors
/// The record exists but cannot be read or parsed.
pub fn load_record(state_dir: &Path) -> Result<Held, RecordError> {
    let path = state_dir.join(RECORD);
    match std::fs::read(&path) {
        Ok(bytes) => {
            serde_json::from_slice(&bytes).map_err(|source| RecordError::Corrupt { path, source })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Held::default()),
        Err(source) => Err(RecordError::Read { path, source }),
    }
}

/// Records what the node holds, durably (temporary file, fsync, rename).
///
/// # Errors
/// Any step failed; the old record is unchanged.
pub fn save_record(state_dir: &Path, held: &Held) -> Result<(), RecordError> {
    crate::cluster::write_json(state_dir, RECORD, held).map_err(RecordError::Write)
}

/// The allocator's NodeIPAM pools at start, from the record (before the
/// API answers): stored allocations in them restore into them; those in a
/// draining CIDR are kept as draining ranges.
///
/// # Errors
/// The record is unreadable, or a CIDR in it overlaps a configured pool
/// (the config changed under it): serving then could give one address
/// twice. Nothing is changed.
pub fn start_specs(
    state_dir: &Path,
    pools: &[NodePool],
    configured: &[PoolSpec],
) -> Result<Vec<PoolSpec>, String> {
    let held = load_record(state_dir).map_err(|e| crate::error_chain(&e))?;
    let clashes = lockstep_core::nodeipam::held_overlaps(configured, &held);
    if !clashes.is_empty() {
        return Err(format!(
            "the NodeIPAM record {} overlaps the configured pools: {}",
            state_dir.join(RECORD).display(),
            clashes
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; ")
        ));
    }
    Ok(local_specs(pools, &held))
}

/// The allocator as a pass uses it (in one command on the agent's owner).
pub trait Allocator {
    /// Addresses held in each of `cidrs` (every holder).
    fn usage(&self, cidrs: &[IpNet]) -> Vec<u64>;
    /// The configured pools (an offer must not overlap them).
    fn configured(&self) -> Vec<PoolSpec>;
    /// Makes `specs` the NodeIPAM pools: new CIDRs serve, dropped ones
    /// drain.
    ///
    /// # Errors
    /// The manager refused a CIDR (the rest is applied).
    fn set_pools(&mut self, specs: Vec<PoolSpec>) -> Result<(), String>;
}

/// Runs a job on the allocator (on the agent: one command on its owner).
pub trait AgentSlot: Send + Sync + 'static {
    /// Runs `f`.
    fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut dyn Allocator) -> T + Send + 'static,
    ) -> impl Future<Output = Result<T, KubeError>> + Send;
}

/// This node's NodeIPAM object, as the pass uses it.
pub trait NodeIpamApi: Send + Sync + 'static {
    /// Waits until the object has been listed once.
    fn ready(&self) -> impl Future<Output = ()> + Send;
    /// Changes whenever the object may have changed.
    fn changed(&self) -> impl Future<Output = ()> + Send;
    /// The object as last seen (`None`: there is none).
    fn current(&self) -> Option<NodeIPAM>;
    /// Creates it with `spec`.
    fn create(&self, spec: NodeIPAMSpec) -> impl Future<Output = Result<(), KubeError>> + Send;
    /// Merge-patches it (the main resource: the spec); the object as the
    /// write left it.
    fn patch_spec(&self, patch: Value) -> impl Future<Output = Result<NodeIPAM, KubeError>> + Send;
    /// Merge-patches its status subresource.
    fn patch_status(&self, patch: Value) -> impl Future<Output = Result<(), KubeError>> + Send;
}

/// The real API: a reflector of this node's NodeIPAM object (a
/// `metadata.name` field selector).
pub struct KubeNodeIpam {
    api: Api<NodeIPAM>,
    name: String,
    store: Store<NodeIPAM>,
    wake: Arc<Notify>,
    task: tokio::task::JoinHandle<()>,
}

impl KubeNodeIpam {
    /// Watches this node's NodeIPAM object (`name`) through `client`.
    pub fn start(client: kube::Client, name: String) -> Self {
        let api: Api<NodeIPAM> = Api::all(client);
        let (store, writer) = reflector::store();
        let wake = Arc::new(Notify::new());
        // Only this node's object: every agent watching every node's
        // would make each object's change O(nodes) events.
        let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
        let stream = reflector::reflector(writer, watcher(api.clone(), config))
            .default_backoff()
            .touched_objects();
        let w = wake.clone();
        let task = tokio::spawn(async move {
            let mut stream = std::pin::pin!(stream);
            loop {
                match stream.try_next().await {
                    Ok(Some(_)) => w.notify_one(),
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!(error = %crate::error_chain(&e), "nodeipam watch failed; retrying with backoff");
                    }
                }
            }
        });
        Self {
            api,
            name,
            store,
            wake,
            task,
        }
    }
}

impl Drop for KubeNodeIpam {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn api_err(what: String) -> impl FnOnce(kube::Error) -> KubeError {
    move |source| KubeError::Api {
        what,
        source: Box::new(source),
    }
}

impl NodeIpamApi for KubeNodeIpam {
    async fn ready(&self) {
        let _ = self.store.wait_until_ready().await;
    }

    async fn changed(&self) {
        self.wake.notified().await;
    }

    fn current(&self) -> Option<NodeIPAM> {
        self.store
            .get(&ObjectRef::new(&self.name))
            .map(|o| (*o).clone())
    }

    async fn create(&self, spec: NodeIPAMSpec) -> Result<(), KubeError> {
        let obj = NodeIPAM::new(&self.name, spec);
        match self
            .api
            .create(&crate::kubernetes::post_params(), &obj)
            .await
        {
            Ok(_) => Ok(()),
            // Made meanwhile (another agent run): the watch brings it.
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
            Err(e) => Err(api_err(format!("create nodeipam {}", self.name))(e)),
        }
    }

    async fn patch_spec(&self, patch: Value) -> Result<NodeIPAM, KubeError> {
        self.api
            .patch(
                &self.name,
                &crate::kubernetes::patch_params(),
                &Patch::Merge(&patch),
            )
            .await
            .map_err(api_err(format!("patch nodeipam {}", self.name)))
    }

    async fn patch_status(&self, patch: Value) -> Result<(), KubeError> {
        self.api
            .patch_status(
                &self.name,
                &crate::kubernetes::patch_params(),
                &Patch::Merge(&patch),
            )
            .await
            .map(drop)
            .map_err(api_err(format!("patch nodeipam {} status", self.name)))
    }
}

/// What one step (one command on the agent's owner) found and did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// What the node holds after it.
    pub held: Held,
    /// The core's step (`None`: the record could not be written, nothing
    /// changed).
    pub step: Option<Step>,
    /// Why the offer was refused (every problem), empty when used.
    pub refused: Vec<String>,
    /// Each pool's spec entry.
    pub demand: Vec<PoolDemand>,
    /// Draining CIDRs with the addresses still held in each.
    pub draining: Vec<(String, IpNet, u64)>,
    /// A failure to record or to hand the pools over.
    pub failed: Option<String>,
}

/// One step: the offer checked (`None`: keep serving what is held), what
/// is held decided, recorded (before the allocator may use a new CIDR),
/// handed to the allocator, and the demand measured — all in one
/// command on the agent's owner, so no allocation lands between the usage read and the
/// pools' change.
pub fn run_step(
    alloc: &mut dyn Allocator,
    pools: &[NodePool],
    state_dir: &Path,
    held: &Held,
    offers: Option<&[Offer]>,
    first: bool,
) -> Outcome {
    let used = |c: IpNet| alloc.usage(&[c]).first().copied().unwrap_or(0);
    let configured = alloc.configured();
    let mut out = Outcome {
        held: held.clone(),
        ..Outcome::default()
    };
    let offered = match offers.map(|o| accept(pools, &configured, held, o, used)) {
        Some(Ok(offered)) => offered,
        Some(Err(errs)) => {
            out.refused = errs.iter().map(ToString::to_string).collect();
            held.serving.clone()
        }
        None => held.serving.clone(),
    };
    let s = step(held, &offered, used);
    if s.held != *held
        && let Err(e) = save_record(state_dir, &s.held)
    {
        out.failed = Some(crate::error_chain(&e));
        return finish(alloc, pools, out);
    }
    if (first || s.held != *held)
        && let Err(e) = alloc.set_pools(local_specs(pools, &s.held))
    {
        out.failed = Some(e);
    }
    out.held = s.held.clone();
    out.step = Some(s);
    finish(alloc, pools, out)
}

fn finish(alloc: &dyn Allocator, pools: &[NodePool], mut out: Outcome) -> Outcome {
    for p in &reported_pools(pools, &out.held) {
        let cidrs = out.held.of(&p.name);
        let usage = alloc.usage(&cidrs);
        let in_use: u64 = usage.iter().sum();
        for (c, n) in cidrs.iter().zip(&usage) {
            if out
                .held
                .draining
                .get(&p.name)
                .is_some_and(|d| d.contains(c))
            {
                out.draining.push((p.name.clone(), *c, *n));
            }
        }
        out.demand.push(PoolDemand {
            name: p.name.clone(),
            requested: requested(p, in_use),
            demand: match p.mode {
                DemandMode::Linear => "linear".into(),
                DemandMode::Ceil { .. } => "ceil".into(),
            },
            block_size: match p.mode {
                DemandMode::Linear => None,
                DemandMode::Ceil { block_size } => Some(block_size),
            },
            pre_allocate: p.pre_allocate,
            cidrs: cidrs.iter().map(ToString::to_string).collect(),
        });
    }
    out
}

/// The offer in an object's status (`None`: the operator wrote none).
pub fn offers_of(obj: Option<&NodeIPAM>) -> Option<Vec<Offer>> {
    let pools = obj?.status.as_ref()?.pools.as_ref()?;
    Some(
        pools
            .iter()
            .map(|p| Offer {
                pool: p.name.clone(),
                ipv4: p.ipv4.clone(),
                ipv6: p.ipv6.clone(),
            })
            .collect(),
    )
}

/// The conditions an outcome says (times from `old` when unchanged).
pub fn conditions(out: &Outcome, old: &[PoolCondition], now: &str) -> Vec<PoolCondition> {
    let accepted = if out.refused.is_empty() {
        let n: usize = out.held.serving.values().map(|s| s.len()).sum();
        ("True", "Accepted", format!("{n} CIDR(s) served"))
    } else {
        (
            "False",
            "Refused",
            format!(
                "nothing of this status is used (the node keeps what it held): {}",
                out.refused.join("; ")
            ),
        )
    };
    let draining = if out.draining.is_empty() {
        (
            "False",
            "NoneDraining",
            "no withdrawn CIDR holds an address".to_string(),
        )
    } else {
        (
            "True",
            "Withdrawn",
            out.draining
                .iter()
                .map(|(p, c, n)| {
                    format!(
                        "{c} of pool {p}: {n} address(es) still in use, nothing new comes from it"
                    )
                })
                .collect::<Vec<_>>()
                .join("; "),
        )
    };
    [("Accepted", accepted), ("Draining", draining)]
        .into_iter()
        .map(|(type_, (status, reason, message))| {
            let since = old
                .iter()
                .find(|c| c.type_ == type_ && c.status == status)
                .map_or_else(|| now.to_string(), |c| c.last_transition_time.clone());
            PoolCondition {
                type_: type_.into(),
                status: status.into(),
                reason: reason.into(),
                message,
                last_transition_time: since,
                observed_generation: None,
            }
        })
        .collect()
}

/// The loop's state.
pub struct NodeIpamSync<A: NodeIpamApi, S: AgentSlot> {
    api: A,
    slot: S,
    pools: Vec<NodePool>,
    state_dir: PathBuf,
    held: Held,
    interval: Duration,
    first: bool,
    refused: Vec<String>,
}

impl<A: NodeIpamApi, S: AgentSlot> NodeIpamSync<A, S> {
    /// A loop over `api` and `slot` for `pools`, recording in `state_dir`.
    ///
    /// # Errors
    /// The record is unreadable.
    pub fn new(
        api: A,
        slot: S,
        pools: Vec<NodePool>,
        state_dir: PathBuf,
        interval: Duration,
    ) -> Result<Self, RecordError> {
        let held = load_record(&state_dir)?;
        Ok(Self {
            api,
            slot,
            pools,
            state_dir,
            held,
            interval,
            first: true,
            refused: Vec::new(),
        })
    }

    /// What the node holds, as the last pass left it.
    pub fn held(&self) -> &Held {
        &self.held
    }

    /// Runs until `stop`.
    pub async fn run(mut self, mut stop: tokio::sync::watch::Receiver<bool>) {
        tokio::select! {
            () = self.api.ready() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        tracing::info!("kubernetes: nodeipam listed; serving its CIDRs");
        loop {
            if let Err(e) = self.pass().await {
                tracing::warn!(error = %crate::error_chain(&e), "nodeipam: pass failed; trying again");
            }
            tokio::select! {
                () = self.api.changed() => {}
                () = tokio::time::sleep(self.interval) => {}
                _ = stop.wait_for(|s| *s) => break,
            }
        }
    }

    /// One pass: the step in one command on the agent's owner, then the spec and the
    /// conditions written where they differ.
    ///
    /// # Errors
    /// The agent is not there, or the API refused a write (the next pass
    /// tries again).
    pub async fn pass(&mut self) -> Result<(), KubeError> {
        let obj = self.api.current();
        let offers = offers_of(obj.as_ref());
        let read = offers.clone();
        let (pools, dir, held, first) = (
            self.pools.clone(),
            self.state_dir.clone(),
            self.held.clone(),
            self.first,
        );
        let out = self
            .slot
            .run(move |a| run_step(a, &pools, &dir, &held, offers.as_deref(), first))
            .await?;
        self.report(&out);
        if out.failed.is_none() {
            self.first = false;
        }
        self.held = out.held.clone();
        let spec = NodeIPAMSpec {
            pools: out.demand.clone(),
        };
        let Some(mut obj) = obj else {
            return self.api.create(spec).await;
        };
        if obj.spec != spec {
            obj = self
                .api
                .patch_spec(json!({"spec": serde_json::to_value(&spec).unwrap_or(Value::Null)}))
                .await?;
            // The operator wrote meanwhile: these conditions describe an
            // older offer; the watch brings the next pass.
            if offers_of(Some(&obj)) != read {
                return Ok(());
            }
        }
        let old = obj
            .status
            .as_ref()
            .map(|s| s.conditions.clone())
            .unwrap_or_default();
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        let want = conditions(&out, &old, &now);
        if want != old {
            let patch = json!({
                "metadata": {"resourceVersion": obj.metadata.resource_version},
                "status": {"conditions": want},
            });
            match self.api.patch_status(patch).await {
                Err(KubeError::Api { source, .. }) if is_conflict(&source) => {}
                r => r?,
            }
        }
        Ok(())
    }

    fn report(&mut self, out: &Outcome) {
        if let Some(s) = &out.step {
            for (pool, cidr) in &s.added {
                tracing::info!(%pool, %cidr, "nodeipam: serving a CIDR the operator offered");
            }
            for (pool, cidr, n) in &s.drained {
                tracing::warn!(%pool, %cidr, in_use = n, "nodeipam: a CIDR withdrawn while in use drains: its endpoints keep their addresses, nothing new comes from it");
            }
            for (pool, cidr) in &s.released {
                tracing::info!(%pool, %cidr, "nodeipam: released a CIDR (gone from the spec)");
            }
        }
        if out.refused != self.refused && !out.refused.is_empty() {
            tracing::error!(problems = %out.refused.join("; "), "nodeipam: the status is refused; the node keeps serving what it held");
        }
        self.refused.clone_from(&out.refused);
        if let Some(f) = &out.failed {
            tracing::error!(error = %f, "nodeipam: the step was not applied");
        }
    }
}

fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

#[cfg(test)]
mod tests;
