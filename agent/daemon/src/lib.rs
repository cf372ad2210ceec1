//! lockstep: a node agent that allocates IP addresses for endpoints, for
//! itself and for LoadBalancer services, and programs every allocation into BPF
//! maps in lockstep with its allocation state.
//!
//! This crate is the glue around `lockstep-core` (which decides): it turns the
//! world (config, kernel, CNI calls, API requests) into core calls, and core
//! results into effects. [`datapath`] is the only module that uses aya.

pub mod agent;
pub mod announce;
pub mod api;
pub mod arp;
pub mod bgp;
pub mod cli;
pub mod client;
pub mod cluster;
pub mod cni;
pub mod config;
pub mod datapath;
pub mod delegate;
pub mod install;
pub mod kubernetes;
pub mod lb_view;
pub mod manifests;
pub mod map_table;
pub mod masquerade;
pub mod metrics;
pub mod ndp;
pub mod netlink;
pub mod plugin;
pub mod server;
pub mod store;
pub mod uninstall;
pub mod version;
pub mod wire;

/// An error and its causes on one line, `outer: cause: root cause`: what the
/// API, status reasons and logs show, so the root cause (a full disk, a
/// refused syscall) is never hidden behind a summary.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
