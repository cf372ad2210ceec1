//! The NodeIPAM operator on the elected LB writer (#44 item 5,
//! `[kubernetes.nodeipam] operator = true`): every node's NodeIPAM object
//! is offered CIDRs of the `PodIPPool` of each pool's name, as far as the
//! node's `requested` asks, and a CIDR a node released goes back to the
//! pool. Multi-pool pod IPAM with only the API server: no external
//! operator, no etcd.
//!
//! Why on the writer: one writer of every offer, elected by the Lease the
//! LB writer already keeps; it acts only while its Lease's deadline has
//! not passed, so two agents never hand out at once.
//!
//! The decisions are the core's (`lockstep_core::nodeipam::operator`:
//! one CIDR one node, demand met block by block, excess withdrawn, a held
//! CIDR never offered elsewhere). This module carries them: it plans from
//! its reflectors' cache, and when the cache says something should change
//! it lists every NodeIPAM object again from the API (a consistent read,
//! which sees its own and a previous writer's latest offers, whatever the
//! watch has delivered), plans from that, and writes each changed offer as
//! a merge patch of the status subresource guarded by the object's
//! `resourceVersion` (a `409` waits for the next pass).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use ipnet::IpNet;
use kube::Client;
use kube::api::{Api, ListParams, Patch};
use lockstep_core::nodeipam::operator::{NodeState, SourcePool, plan};
use serde_json::json;
use tokio::sync::Notify;

use super::crd::NodeIPAM;
use crate::kubernetes::KubeError;
use crate::kubernetes::election::Leadership;
use crate::kubernetes::pod_pools::PodIPPool;
use crate::kubernetes::reflectors::drive;

/// How often the plan is checked with nothing changing (repair).
const REPAIR: Duration = Duration::from_secs(5);

/// The default block prefix lengths, as a PodIPPool documents them.
const BLOCK_V4: u8 = 26;
const BLOCK_V6: u8 = 122;

/// The PodIPPools as the core plans with them (a bad CIDR is left out: the
/// schema refuses it before it is stored).
fn sources(pools: &[Arc<PodIPPool>]) -> Vec<SourcePool> {
    pools
        .iter()
        .filter_map(|p| {
            let name = p.metadata.name.clone()?;
            let cidrs = p
                .spec
                .ipv4
                .iter()
                .chain(&p.spec.ipv6)
                .filter_map(|c| c.trim().parse::<IpNet>().ok())
                .map(|c| c.trunc())
                .collect();
            Some(SourcePool {
                name,
                cidrs,
                block_v4: p.spec.block_v4.unwrap_or(BLOCK_V4),
                block_v6: p.spec.block_v6.unwrap_or(BLOCK_V6),
            })
        })
        .collect()
}

/// A NodeIPAM object as the core plans with it.
fn node_state(o: &NodeIPAM) -> Option<NodeState> {
    let node = o.metadata.name.clone()?;
    let parse = |v: &[String]| -> BTreeSet<IpNet> {
        v.iter().filter_map(|c| c.trim().parse().ok()).collect()
    };
    Some(NodeState {
        node,
        requested: o
            .spec
            .pools
            .iter()
            .map(|p| (p.name.clone(), p.requested))
            .collect(),
        held: o
            .spec
            .pools
            .iter()
            .map(|p| (p.name.clone(), parse(&p.cidrs)))
            .collect(),
        offered: o
            .status
            .as_ref()
            .and_then(|s| s.pools.as_ref())
            .map(|pools| {
                pools
                    .iter()
                    .map(|p| {
                        let all: Vec<String> = p.ipv4.iter().chain(&p.ipv6).cloned().collect();
                        (p.name.clone(), parse(&all))
                    })
                    .collect()
            }),
    })
}

/// The status patch offering `offer`, guarded by `resource_version`.
fn offer_patch(
    offer: &BTreeMap<String, BTreeSet<IpNet>>,
    resource_version: &str,
) -> serde_json::Value {
    let pools: Vec<serde_json::Value> = offer
        .iter()
        .map(|(name, cidrs)| {
            let of = |v4: bool| -> Vec<String> {
                cidrs
                    .iter()
                    .filter(|c| matches!(c, IpNet::V4(_)) == v4)
                    .map(ToString::to_string)
                    .collect()
            };
            json!({"name": name, "ipv4": of(true), "ipv6": of(false)})
        })
        .collect();
    json!({"metadata": {"resourceVersion": resource_version}, "status": {"pools": pools}})
}

/// Runs until `stop`, acting while `leadership` says this agent is the
/// writer.
pub async fn run(
    client: Client,
    mut leadership: tokio::sync::watch::Receiver<Leadership>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let wake = Arc::new(Notify::new());
    let (pools, pool_task) = drive(Api::<PodIPPool>::all(client.clone()), wake.clone());
    let (objects, object_task) = drive(Api::<NodeIPAM>::all(client.clone()), wake.clone());
    let api: Api<NodeIPAM> = Api::all(client);
    let ready = async {
        let _ = pools.wait_until_ready().await;
        let _ = objects.wait_until_ready().await;
    };
    let stopped = tokio::select! {
        () = ready => false,
        _ = stop.wait_for(|s| *s) => true,
    };
    if !stopped {
        tracing::info!(
            "nodeipam operator: PodIPPools and NodeIPAM objects listed; offering CIDRs while this agent is the writer"
        );
        loop {
            if leadership.borrow_and_update().acting_now() {
                let cached: Vec<NodeState> = objects
                    .state()
                    .iter()
                    .filter_map(|o| node_state(o))
                    .collect();
                let src = sources(&pools.state());
                if !plan(&src, &cached).is_empty()
                    && let Err(e) = pass(&api, &src, &leadership).await
                {
                    tracing::warn!(error = %crate::error_chain(&e), "nodeipam operator: offers not written; retrying");
                }
            }
            tokio::select! {
                () = wake.notified() => {}
                r = leadership.changed() => if r.is_err() { break },
                () = tokio::time::sleep(REPAIR) => {}
                _ = stop.wait_for(|s| *s) => break,
            }
        }
    }
    pool_task.abort();
    object_task.abort();
}

/// One pass from a fresh list: every changed offer written. Returns how
/// many were written.
async fn pass(
    api: &Api<NodeIPAM>,
    src: &[SourcePool],
    leadership: &tokio::sync::watch::Receiver<Leadership>,
) -> Result<usize, KubeError> {
    let list = api
        .list(&ListParams::default())
        .await
        .map_err(|source| KubeError::Api {
            what: "list nodeipams".into(),
            source: Box::new(source),
        })?;
    let nodes: Vec<NodeState> = list.items.iter().filter_map(node_state).collect();
    let mut written = 0;
    for (node, offer) in plan(src, &nodes) {
        // Not past the Lease's deadline, checked before each write.
        if !leadership.borrow().acting_now() {
            break;
        }
        let Some(rv) = list
            .items
            .iter()
            .find(|o| o.metadata.name.as_deref() == Some(node.as_str()))
            .and_then(|o| o.metadata.resource_version.clone())
        else {
            continue;
        };
        match api
            .patch_status(
                &node,
                &crate::kubernetes::patch_params(),
                &Patch::Merge(offer_patch(&offer, &rv)),
            )
            .await
        {
            Ok(_) => {
                written += 1;
                tracing::info!(%node, offer = ?offer, "nodeipam operator: offer written");
            }
            // Changed meanwhile: the next pass, from a fresh list.
            Err(kube::Error::Api(s)) if s.code == 409 => return Ok(written),
            Err(source) => {
                return Err(KubeError::Api {
                    what: format!("patch nodeipam {node} status"),
                    source: Box::new(source),
                });
            }
        }
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objects_read_into_the_plan_and_an_offer_writes_back_in_the_objects_shape() {
        let o: NodeIPAM = serde_json::from_value(json!({
            "metadata": {"name": "node-1", "resourceVersion": "7"},
            "spec": {"pools": [{"name": "eni", "requested": 18, "demand": "linear",
                                "preAllocate": 2, "cidrs": ["10.9.0.0/28"]}]},
            "status": {"pools": [{"name": "eni", "ipv4": ["10.9.0.0/28"], "ipv6": ["fd09::/124"]}]}
        }))
        .unwrap();
        let n = node_state(&o).unwrap();
        assert_eq!(n.requested["eni"], 18);
        assert_eq!(n.held["eni"].len(), 1);
        assert_eq!(n.offered.as_ref().unwrap()["eni"].len(), 2);
        let p = offer_patch(&n.offered.unwrap(), "7");
        assert_eq!(p["metadata"]["resourceVersion"], "7");
        assert_eq!(p["status"]["pools"][0]["ipv4"], json!(["10.9.0.0/28"]));
        assert_eq!(p["status"]["pools"][0]["ipv6"], json!(["fd09::/124"]));
        let back: super::super::crd::NodeIPAMStatus =
            serde_json::from_value(p["status"].clone()).unwrap();
        assert_eq!(back.pools.unwrap()[0].name, "eni");
    }
}
