//! lockstep: a node agent that allocates IP addresses for endpoints, for
//! itself and for LoadBalancer services, and programs every allocation into BPF
//! maps in lockstep with its allocation state.
//!
//! This crate is the glue around `lockstep-core` (which decides): it turns the
//! world (config, kernel, CNI calls, API requests) into core calls, and core
//! results into effects. [`datapath`] is the only module that uses aya.

pub mod agent;
pub mod api;
pub mod arp;
pub mod cli;
pub mod client;
pub mod cni;
pub mod config;
pub mod datapath;
pub mod delegate;
pub mod install;
pub mod metrics;
pub mod netlink;
pub mod plugin;
pub mod server;
pub mod store;
