//! Pools and CIDRs the configuration dropped while addresses were held.
//!
//! At start-up [`PoolManager::restore_keeping`] keeps every stored allocation
//! whose CIDR or pool the configuration no longer lists in a draining range
//! (see `lockstep_core::manager::DrainingRange`): stored, programmed, handing
//! out nothing. This module refuses a start whose configuration would take a
//! held address (a CIDR moved to another pool, a held address newly
//! reserved), reports draining ranges to `pools`, metrics and `verify`, and
//! carries out the operator's release, which names exactly what it removes.
//!
//! [`PoolManager::restore_keeping`]: lockstep_core::manager::PoolManager::restore_keeping

use std::collections::BTreeSet;

use ipnet::IpNet;
use lockstep_core::manager::{Allocation, DrainingRange, KeptReport, ManagerError, RestoreOutcome};
use lockstep_core::owner::Owner;
use serde::{Deserialize, Serialize};

use super::endpoints::DelRequest;
use super::{Agent, AgentError, ReleaseRequest};

/// An operator's release of a pool's draining addresses.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReleaseDrainingRequest {
    /// The pool.
    pub pool: String,
    /// Only the draining addresses inside this range; all of the pool's
    /// draining addresses when absent.
    #[serde(default)]
    pub cidr: Option<IpNet>,
    /// Release them; without it, only list what would be released.
    #[serde(default)]
    pub confirm: bool,
}

/// What a release of draining addresses removed (or would remove).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleaseDrainingReply {
    /// Nothing was released: `released` and `attachments` are what a
    /// confirmed request would remove now.
    pub dry_run: bool,
    /// The allocations released (or to be released), by address. An
    /// endpoint attachment's other addresses are among them: see
    /// `attachments`.
    pub released: Vec<Allocation>,
    /// Endpoint attachments (container id, ifname) torn down as a CNI DEL
    /// would: map entries at once, then the interfaces, and every address
    /// they hold once the host veth is gone (as for a DEL, moments later).
    /// An interface never keeps an address its allocation no longer backs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attachments: Vec<(String, String)>,
    /// Allocations whose release failed, with the reason (they stay stored
    /// and programmed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failed: Vec<(Allocation, String)>,
}

/// Refuses a start whose configuration takes an address from its holder:
/// a dropped CIDR now configured in another pool, or a held address the
/// configuration now reserves (or excludes as a first or last address).
/// Every such allocation is named; nothing has been changed yet.
///
/// # Errors
/// [`AgentError::Invalid`] listing each conflict.
pub(super) fn refuse_taking(outcome: &RestoreOutcome) -> Result<(), AgentError> {
    let taken: Vec<String> = outcome
        .rejected
        .iter()
        .filter_map(|(a, e)| match e {
            ManagerError::Drain(_) => Some(e.to_string()),
            ManagerError::AddressUnusable { .. } => Some(format!(
                "{} is held by {} in pool {}, but the configuration no longer lets the pool use \
                 it ({e}): take it out of `reserved` (or set allow_first_last) until its holder \
                 releases it",
                a.address, a.owner, a.pool
            )),
            _ => None,
        })
        .collect();
    if taken.is_empty() {
        return Ok(());
    }
    Err(AgentError::Invalid {
        reason: format!(
            "the pool configuration would take addresses from their holders; nothing was \
             changed: {}",
            taken.join("; ")
        ),
    })
}

/// Logs what start-up kept draining.
pub(super) fn log_kept(kept: &KeptReport) {
    for (pool, range) in &kept.ranges {
        tracing::warn!(%pool, %range, "the configuration no longer lists this range; its holders keep their addresses and it drains");
    }
    for pool in &kept.retired_pools {
        tracing::warn!(%pool, "the configuration no longer lists this pool; it drains until its last holder is released");
    }
}

impl Agent {
    /// Every draining range with its holders.
    pub fn draining(&self) -> Vec<DrainingRange> {
        self.manager.draining()
    }

    /// Lists (without `confirm`) or releases (with it) the draining
    /// addresses of a pool: an endpoint attachment holding one is torn down
    /// as its CNI DEL would (all of its addresses go), any other holder's
    /// address goes through the ordinary release (unprogram → commit).
    /// Addresses of active CIDRs go only with such an attachment, and are
    /// listed.
    ///
    /// # Errors
    /// Not ready, or nothing draining matches the request.
    pub fn release_draining(
        &mut self,
        req: ReleaseDrainingRequest,
    ) -> Result<ReleaseDrainingReply, AgentError> {
        self.check_ready()?;
        self.settle();
        let selected = self
            .manager
            .draining_holders(&req.pool, req.cidr)
            .map_err(|e| AgentError::Invalid {
                reason: e.to_string(),
            })?;
        // A draining holder that is an endpoint with interfaces goes whole,
        // as its DEL would take it; any other holder loses just the address.
        let mut attachments: BTreeSet<(String, String)> = BTreeSet::new();
        let mut single = Vec::new();
        for a in selected {
            match &a.owner {
                Owner::Endpoint {
                    container_id,
                    ifname,
                } if self
                    .endpoints
                    .values()
                    .any(|e| &e.container_id == container_id && &e.ifname == ifname) =>
                {
                    attachments.insert((container_id.clone(), ifname.clone()));
                }
                _ => single.push(a),
            }
        }
        let held_by = |agent: &Agent, (c, i): &(String, String)| -> Vec<Allocation> {
            agent
                .manager
                .owned_by(&Owner::endpoint(c, i))
                .cloned()
                .collect()
        };
        if !req.confirm {
            let mut released = single;
            for at in &attachments {
                released.extend(held_by(self, at));
            }
            released.sort_by_key(|a| a.address);
            return Ok(ReleaseDrainingReply {
                dry_run: true,
                released,
                attachments: attachments.into_iter().collect(),
                failed: Vec::new(),
            });
        }
        let mut reply = ReleaseDrainingReply::default();
        for at in attachments {
            let held = held_by(self, &at);
            let del = DelRequest {
                container_id: at.0.clone(),
                ifname: at.1.clone(),
            };
            match self.endpoint_del(del) {
                Ok(()) => {
                    tracing::warn!(container_id = %at.0, ifname = %at.1, addresses = ?held.iter().map(|a| a.address).collect::<Vec<_>>(), "operator tore down an attachment holding draining addresses");
                    reply.released.extend(held);
                    reply.attachments.push(at);
                }
                Err(e) => {
                    let why = crate::error_chain(&e);
                    reply
                        .failed
                        .extend(held.into_iter().map(|a| (a, why.clone())));
                }
            }
        }
        for a in single {
            let req = ReleaseRequest {
                pool: Some(a.pool.clone()),
                family: a.family(),
                owner: a.owner.clone(),
                generation: Some(a.generation),
            };
            match self.release(req) {
                Ok(released) => {
                    tracing::warn!(address = %released.address, owner = %released.owner, pool = %released.pool, "operator released a draining address");
                    reply.released.push(released);
                }
                Err(e) => reply.failed.push((a, crate::error_chain(&e))),
            }
        }
        reply.released.sort_by_key(|a| a.address);
        Ok(reply)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockstep_core::cidr::Family;
    use lockstep_core::manager::{ManagerConfig, PoolManager, StaticPools};
    use lockstep_core::pool::PoolSpec;

    fn restart(before: PoolSpec, after: PoolSpec) -> RestoreOutcome {
        let mut m = PoolManager::new(StaticPools(vec![before]), ManagerConfig::default()).unwrap();
        m.sync().into_result().unwrap();
        m.allocate_next("p", Family::V4, Owner::endpoint("c", "eth0"))
            .unwrap();
        let mut n = PoolManager::new(StaticPools(vec![after]), ManagerConfig::default()).unwrap();
        n.sync().into_result().unwrap();
        n.restore_keeping(m.generation(), m.allocations().cloned().collect::<Vec<_>>())
            .0
    }

    #[test]
    fn a_held_address_newly_reserved_refuses_the_start_naming_it() {
        let net = "10.9.0.0/29".parse().unwrap();
        let outcome = restart(
            PoolSpec::new("p").with_cidr(net),
            PoolSpec::new("p")
                .with_cidr(net)
                .with_reserved("10.9.0.1".parse().unwrap()),
        );
        let err = refuse_taking(&outcome).unwrap_err().to_string();
        assert!(
            err.contains("10.9.0.1 is held by") && err.contains("reserved"),
            "{err}"
        );
    }

    #[test]
    fn a_dropped_cidr_alone_starts() {
        let outcome = restart(
            PoolSpec::new("p").with_cidr("10.9.0.0/29".parse().unwrap()),
            PoolSpec::new("p").with_cidr("10.9.1.0/29".parse().unwrap()),
        );
        assert!(outcome.rejected.is_empty());
        refuse_taking(&outcome).unwrap();
    }
}
