//! The LB state as the API shows it (`lockstep lb get`, and the answer to
//! `lb apply` and `lb delete`): pools with their conflicts and usage, and
//! service statuses. The agent shows its own LB state in this shape, and
//! cluster mode the state stored in etcd, both made from the core's
//! [`LbIpam`] by [`LbView::of`], so the two answer alike. It is a leaf so
//! the cluster sources use it without importing the agent.

use std::collections::BTreeMap;

use lockstep_core::lb::{LbIpam, PoolStatus, ServiceStatus};
use serde::Serialize;

/// The LB state as the API shows it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LbView {
    /// Pools, with conflicts and usage.
    pub pools: Vec<PoolStatus>,
    /// Service statuses by `namespace/name`.
    pub services: BTreeMap<String, ServiceStatus>,
}

impl LbView {
    /// How `lb` shows.
    #[must_use]
    pub fn of(lb: &LbIpam) -> Self {
        LbView {
            pools: lb.pools().collect(),
            services: lb
                .services()
                .map(|(id, st)| (id.to_string(), st.clone()))
                .collect(),
        }
    }
}
