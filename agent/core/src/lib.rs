//! lockstep's decisions, with no I/O.
//!
//! This crate decides which address an owner gets, which CIDRs a node holds
//! and wants, and what the BPF maps should contain. It never performs any of
//! it: no syscalls, no files, no clock (time is passed in as milliseconds), no
//! async runtime. The daemon turns the world into calls on this crate and its
//! results into effects, which keeps every decision unit- and property-testable
//! and lets the same code run in the agent, the CLI and tests.
//!
//! Layers, bottom up:
//! - [`cidr`]: one allocator per CIDR (dense bitmap or sparse runs, next-fit).
//! - [`pool`]: pool definitions ([`pool::PoolSpec`], serde, validated) and
//!   their running state.
//! - [`owner`]: typed owners and generations.
//! - [`manager`]: [`manager::PoolManager`], generic over where its pools come
//!   from; allocation, release, drain, snapshot and restore.
//! - [`demand`]: how many addresses the node should hold, with hysteresis.
//! - [`nodeipam`]: NodeIPAM: CIDRs an operator offers the node, what it
//!   holds, drains and releases, and the demand it writes back.
//! - [`lb`]: LoadBalancer IPAM (pools, conflicts, sticky and shared addresses).
//! - [`pods`]: the pool a Kubernetes pod asks for, and leaked endpoints.
//! - [`restart`]: whether a task that panicked is started again.
//! - [`roles`]: which agent-owned addresses to reserve and release.
//! - [`plan`]: desired IPCACHE / MASQ_SKIP contents and the minimal diff
//!   against what the kernel holds.
//!
//! A typical start-up in the daemon:
//!
//! ```
//! use lockstep_core::cidr::Family;
//! use lockstep_core::manager::{ManagerConfig, PoolManager, StaticPools};
//! use lockstep_core::owner::{Generation, Owner};
//! use lockstep_core::plan::{DatapathPlan, EntryExtra, diff};
//! use lockstep_core::pool::PoolSpec;
//! use std::collections::BTreeMap;
//!
//! let specs = vec![PoolSpec::new("default").with_cidr("10.0.0.0/24".parse().unwrap())];
//! let mut pods = PoolManager::new(StaticPools(specs), ManagerConfig::default())?;
//! pods.sync().into_result()?;
//! // Allocations and the generation high-water mark come from the store.
//! let outcome = pods.restore(Generation(0), Vec::new());
//! assert!(outcome.rejected.is_empty());
//! pods.finish_restore();
//!
//! let a = pods.allocate_next("default", Family::V4, Owner::endpoint("c1", "eth0"))?;
//! let plan = DatapathPlan::from_manager(&pods, [], |_| EntryExtra { ifindex: 7, ..Default::default() })?;
//! let observed = BTreeMap::new(); // read from the pinned IPCACHE_V4
//! let changes = diff(&plan.ipcache_v4, &observed);
//! assert_eq!(changes.add.len(), 1);
//! pods.release("default", Family::V4, &a.owner, a.generation)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod bgp;
pub mod cidr;
pub mod cluster;
pub mod demand;
pub mod election;
pub mod health;
pub mod identity;
pub mod lb;
pub mod manager;
pub mod masquerade;
pub mod nodeipam;
pub mod owner;
pub mod plan;
pub mod pod_cidrs;
pub mod pods;
pub mod pool;
pub mod restart;
pub mod roles;

#[cfg(test)]
pub(crate) mod testing;
