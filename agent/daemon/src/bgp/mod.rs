//! BGP (#48): the node's LoadBalancer addresses announced to routers
//! through BIRD, the routing daemon that runs beside the agent.
//!
//! Three parts: `bird` ([`Bird`]), the only door to BIRD (its control socket, and a
//! configuration applied without ever losing the running one); and
//! [`speaker`], the task that decides what this node announces (core
//! `bgp::announce`) from the agent's published view, writes BIRD's
//! configuration (core `bgp::render_bird`) and applies it when it
//! changes, and follows the sessions. And [`keeper`], `lockstep
//! bird-keeper`: run beside BIRD, it withdraws the node's LoadBalancer
//! routes when the agent goes silent. And [`stored`]: in cluster mode
//! without Kubernetes, what the node announces of the LoadBalancer
//! addresses stored in etcd.

mod bird;
pub mod keeper;
pub mod speaker;
pub mod stored;

pub use bird::{Bird, BirdError, Protocol, ReplyLine};
