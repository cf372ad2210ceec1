//! `PodIPPool` (`lockstep.io/v1alpha1`, cluster-scoped, #29 item 1): the
//! cluster's endpoint pools as Kubernetes objects, and the loop that
//! applies them.
//!
//! Why through etcd's existing apply: the objects feed the same checks and
//! the same records as `lockstep cluster pools apply` ([`Door::apply_pools_default`](crate::cluster::Door::apply_pools_default)),
//! so a pool removed drains, and a CIDR with claimed blocks is refused, the
//! way the CLI does it. What a set of objects becomes, and what each
//! object's condition says, is the core's
//! (`lockstep_core::cluster::kube_pools`).
//!
//! One writer: only the agent that is the elected LB assigner applies and
//! writes statuses, the election #28's LB sync uses (no second election:
//! an apply is one guarded transaction, so a writer changing mid-pass can
//! only make a stale apply fail its compare, never write a mix).
//!
//! With `[kubernetes] pod_pools = true` the PodIPPools are the source of
//! record: the writer records that in etcd (`pools_source`), and
//! `lockstep cluster pools apply` refuses, naming why.
//!
//! [`PoolsBackend`] is the seam: the pass's unit tests run it on pools in
//! memory.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use ipnet::IpNet;
use kube::api::{Api, Patch};
use kube::runtime::reflector::Store;
use kube::{Client, CustomResource, ResourceExt};
use lockstep_core::cluster::ClusterPoolSpec;
use lockstep_core::cluster::kube_pools::{
    PodPool, accepted_condition, plan_is_stored, plan_pod_pools, pod_pool_counts,
};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::KubeError;
use super::crd::PoolCondition;
use super::passes::{Pass, passes};
use super::writer::ClusterWriter;

/// A pool of pod (endpoint) addresses, shared by the cluster's nodes.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "lockstep.io",
    version = "v1alpha1",
    kind = "PodIPPool",
    plural = "podippools",
    shortname = "podpool",
    status = "PodIPPoolStatus",
    printcolumn = r#"{"name":"Accepted","type":"string","jsonPath":".status.conditions[?(@.type==\"Accepted\")].status"}"#,
    printcolumn = r#"{"name":"Total","type":"string","jsonPath":".status.total"}"#,
    printcolumn = r#"{"name":"Blocks","type":"integer","jsonPath":".status.blocks"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct PodIPPoolSpec {
    /// IPv4 CIDRs (`10.1.0.0/16`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "crate::kubernetes::crd::cidr_list")]
    pub ipv4: Vec<String>,
    /// IPv6 CIDRs (`fd00:1::/64`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "crate::kubernetes::crd::cidr_list")]
    pub ipv6: Vec<String>,
    /// IPv4 block prefix length nodes claim (default 26).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_v4: Option<u8>,
    /// IPv6 block prefix length nodes claim (default 122).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_v6: Option<u8>,
    /// Hand out the first and last address of each CIDR too.
    #[serde(default, rename = "allowFirstLastIPs")]
    pub allow_first_last_ips: bool,
    /// Traffic from the pool's pods leaves unmasqueraded.
    #[serde(default)]
    pub skip_masquerade: bool,
    /// The pool serves pods that name none (at most one PodIPPool).
    #[serde(default)]
    pub default: bool,
    /// Fields this version does not know (a newer CRD added them): kept
    /// out of the decision and logged once (`super::unknown`), never
    /// written back.
    #[serde(flatten, skip_serializing)]
    #[schemars(skip)]
    pub unknown: BTreeMap<String, Value>,
}

/// What lockstep reports on a PodIPPool.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodIPPoolStatus {
    /// `Accepted`: stored as a cluster pool (`True`), or why not (`False`,
    /// the stored pool unchanged).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<PoolCondition>,
    /// Addresses in its CIDRs, as stored (decimal).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total: Option<String>,
    /// Blocks nodes have claimed from it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocks: Option<u64>,
    /// Nodes holding blocks of it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<u64>,
}

impl PodIPPool {
    /// The object as the core reads it.
    pub fn to_core(&self) -> PodPool {
        let s = &self.spec;
        PodPool {
            name: self.name_any(),
            ipv4: s.ipv4.clone(),
            ipv6: s.ipv6.clone(),
            block_v4: s.block_v4,
            block_v6: s.block_v6,
            allow_first_last: s.allow_first_last_ips,
            skip_masquerade: s.skip_masquerade,
            default: s.default,
        }
    }
}

/// The CRD as YAML, as `deploy/crds/` holds it.
///
/// # Errors
/// The CRD does not serialise (never with these types).
pub fn crd_yaml() -> Result<String, String> {
    super::crd::crd_yaml_of::<PodIPPool>("agent/daemon/src/kubernetes/pod_pools.rs")
}

/// The cluster pools as the loop needs them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PoolsState {
    /// Whether this agent applies and writes statuses now.
    pub writer: bool,
    /// The stored pools.
    pub pools: Vec<ClusterPoolSpec>,
    /// The recorded default.
    pub default: Option<String>,
    /// Claimed blocks: block → `(pool, node)`.
    pub claimed: BTreeMap<IpNet, (String, String)>,
}

/// The cluster pools' door, as the loop uses it.
pub trait PoolsBackend: Send + Sync + 'static {
    /// The state now.
    fn state(&self) -> impl Future<Output = Result<PoolsState, KubeError>> + Send;
    /// Whether this agent is the writer now (without reading the rest).
    fn is_writer(&self) -> impl Future<Output = Result<bool, KubeError>> + Send;
    /// Replaces the pools, as `cluster pools apply` does.
    fn apply(
        &self,
        pools: Vec<ClusterPoolSpec>,
        default: Option<String>,
    ) -> impl Future<Output = Result<(), KubeError>> + Send;
}

/// Cluster mode: etcd, writing only while this node is the LB assigner.
#[derive(Debug)]
pub struct ClusterPools(pub ClusterWriter);

impl PoolsBackend for ClusterPools {
    async fn is_writer(&self) -> Result<bool, KubeError> {
        self.0.is_writer().await
    }

    async fn state(&self) -> Result<PoolsState, KubeError> {
        // Every node runs the loop; only the writer reads etcd (the
        // election is read from the mirror), so etcd's load does not grow
        // with the nodes.
        if !self.0.is_writer().await? {
            return Ok(PoolsState::default());
        }
        let writer = true;
        self.0
            .with_door(async |d| {
                let (pools, _, _) = d.pools().await?;
                let (default, _) = d.stored_default().await?;
                let (blocks, _) = d.blocks().await?;
                Ok(PoolsState {
                    writer,
                    pools,
                    default,
                    claimed: blocks
                        .iter()
                        .map(|b| (b.cidr, (b.pool.clone(), b.node.clone())))
                        .collect(),
                })
            })
            .await
    }

    async fn apply(
        &self,
        pools: Vec<ClusterPoolSpec>,
        default: Option<String>,
    ) -> Result<(), KubeError> {
        self.0
            .with_door(async |d| {
                d.mark_pools_source(crate::cluster::POOLS_SOURCE_KUBERNETES)
                    .await?;
                d.apply_pools_default(&pools, default.as_deref()).await?;
                Ok(())
            })
            .await
    }
}

/// What one pass decided: whether it applied, and each object's status
/// (by name) as it should read.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PassOutcome {
    /// An apply was sent (and succeeded).
    pub applied: bool,
    /// Each object's wanted status (conditions without their times).
    pub statuses: BTreeMap<String, PodIPPoolStatus>,
}

/// One pass over `objects`, on `backend`: applies what differs from the
/// stored pools, reads the result, and says each object's status. `None`:
/// not the writer (nothing done).
///
/// # Errors
/// The store unreadable or the apply failed for a reason other than a
/// refusal (a refusal is reported on the objects).
pub async fn pass<B: PoolsBackend>(
    backend: &B,
    objects: &[PodPool],
) -> Result<Option<PassOutcome>, KubeError> {
    let mut state = backend.state().await?;
    if !state.writer {
        return Ok(None);
    }
    let Some(mut plan) = plan_pod_pools(
        objects,
        &state.pools,
        state.default.as_deref(),
        &state.claimed,
    ) else {
        return Ok(Some(PassOutcome::default()));
    };
    let mut applied = false;
    if !plan_is_stored(
        &plan,
        &state.pools,
        state.default.as_deref(),
        &state.claimed,
    ) {
        match backend
            .apply(plan.pools.clone(), plan.default.clone())
            .await
        {
            Ok(()) => applied = true,
            // The store changed between the read and the write (a block
            // claimed in a CIDR the plan drops): the next pass plans again.
            Err(KubeError::Refused { reason }) => {
                tracing::warn!(%reason, "kubernetes: pod pools apply refused; planning again");
            }
            Err(e) => return Err(e),
        }
        state = backend.state().await?;
        // What the objects are refused for, against what is stored now.
        if let Some(p) = plan_pod_pools(
            objects,
            &state.pools,
            state.default.as_deref(),
            &state.claimed,
        ) {
            plan = p;
        }
    }
    let statuses = objects
        .iter()
        .map(|o| {
            let counts = pod_pool_counts(&o.name, &state.pools, &state.claimed);
            let refusal = plan.refused.get(&o.name);
            let (status, reason, message) = accepted_condition(refusal, counts.as_ref());
            let st = PodIPPoolStatus {
                conditions: vec![PoolCondition {
                    type_: "Accepted".into(),
                    status: status.into(),
                    reason: reason.into(),
                    message,
                    last_transition_time: String::new(),
                    observed_generation: None,
                }],
                total: counts.as_ref().map(|c| c.total.clone()),
                blocks: counts.as_ref().map(|c| c.blocks),
                nodes: counts.as_ref().map(|c| c.nodes),
            };
            (o.name.clone(), st)
        })
        .collect();
    Ok(Some(PassOutcome { applied, statuses }))
}

/// The merge patch bringing `obj`'s status to `want`, or `None` when it
/// already says so. The condition keeps its transition time while its
/// status stays; the patch carries the `resourceVersion` (a 409 rather
/// than an overwrite of a status written meanwhile).
pub fn status_patch(obj: &PodIPPool, want: &PodIPPoolStatus, now: &str) -> Option<Value> {
    let had = obj.status.clone().unwrap_or_default();
    let mut want = want.clone();
    for c in &mut want.conditions {
        c.observed_generation = obj.metadata.generation;
        c.last_transition_time = had
            .conditions
            .iter()
            .find(|h| h.type_ == c.type_ && h.status == c.status)
            .map_or_else(|| now.to_string(), |h| h.last_transition_time.clone());
    }
    if had == want {
        return None;
    }
    Some(json!({
        "metadata": {"resourceVersion": obj.resource_version()},
        "status": serde_json::to_value(&want).unwrap_or(Value::Null),
    }))
}

/// The loop: a reflector keeps the PodIPPools in memory; every change, and
/// a poll (elections, blocks claimed), wakes one pass.
pub struct PodPoolSync<B: PoolsBackend> {
    client: Client,
    backend: B,
    /// Patches that landed, by uid, with the `resourceVersion` they were
    /// made from.
    written: HashMap<String, (Option<String>, Value)>,
    /// Whether the last pass found this agent the writer.
    was_writer: bool,
    /// Unknown fields already logged (`super::note_unknown`).
    unknown_seen: std::collections::BTreeSet<String>,
}

impl<B: PoolsBackend> Pass<PodIPPool> for PodPoolSync<B> {
    async fn pass(&mut self, store: &Store<PodIPPool>) {
        for p in store.state() {
            super::note_unknown(
                &mut self.unknown_seen,
                "PodIPPool",
                &p.name_any(),
                &p.spec.unknown,
            );
        }
        match self.once(store).await {
            Ok(writer) => {
                if writer != self.was_writer {
                    tracing::info!(writer, "kubernetes: pod pools writer");
                    self.written.clear();
                }
                self.was_writer = writer;
            }
            Err(e) => {
                tracing::warn!(error = %crate::error_chain(&e), "kubernetes: pod pools pass failed; trying again");
            }
        }
    }

    async fn writer(&mut self) -> Option<bool> {
        self.backend.is_writer().await.ok()
    }
}

/// How often a pass runs without a PodIPPool change (status counts follow
/// claims; a new writer takes over within it).
pub const POLL: Duration = Duration::from_secs(2);

impl<B: PoolsBackend> PodPoolSync<B> {
    /// A loop writing through `backend`.
    pub fn new(client: Client, backend: B) -> Self {
        Self {
            client,
            backend,
            written: HashMap::new(),
            was_writer: false,
            unknown_seen: std::collections::BTreeSet::new(),
        }
    }

    /// Runs until `stop`.
    pub async fn run(mut self, stop: tokio::sync::watch::Receiver<bool>) {
        let api = Api::<PodIPPool>::all(self.client.clone());
        passes(api, POLL, stop, &mut self).await;
    }

    /// One pass and its status patches; whether this agent is the writer.
    async fn once(&mut self, store: &Store<PodIPPool>) -> Result<bool, KubeError> {
        let objects: Vec<Arc<PodIPPool>> = store
            .state()
            .into_iter()
            .filter(|o| o.metadata.deletion_timestamp.is_none())
            .collect();
        let core: Vec<PodPool> = objects.iter().map(|o| o.to_core()).collect();
        let Some(outcome) = pass(&self.backend, &core).await? else {
            return Ok(false);
        };
        if outcome.applied {
            tracing::info!(pools = core.len(), "kubernetes: pod pools applied");
        }
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        let api: Api<PodIPPool> = Api::all(self.client.clone());
        for o in &objects {
            let Some(want) = outcome.statuses.get(&o.name_any()) else {
                continue;
            };
            let Some(patch) = status_patch(o, want, &now) else {
                continue;
            };
            let uid = o.uid().unwrap_or_default();
            let from = o.resource_version();
            let mut key = patch.clone();
            key["status"]["conditions"][0]["lastTransitionTime"] = Value::Null;
            if self.written.get(&uid) == Some(&(from.clone(), key.clone())) {
                continue;
            }
            match api
                .patch_status(&o.name_any(), &super::patch_params(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => {
                    self.written.insert(uid, (from, key));
                }
                Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => {}
                Err(e) => {
                    tracing::warn!(pool = %o.name_any(), error = %crate::error_chain(&e), "kubernetes: pod pool status not written");
                }
            }
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests;
