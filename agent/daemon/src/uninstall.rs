//! `lockstep uninstall`: what an agent left on a node, taken away, so the
//! node's next CNI config serves its pods and no program, pin, route or
//! device of lockstep's stays behind.
//!
//! Why a command of its own: deleting the DaemonSet stops the agents but
//! leaves the node as they shaped it. A conflist that sorts first and names
//! a plugin whose agent is gone fails every new pod's ADD; the pinned
//! programs keep filtering on the uplink; routes of lockstep's protocol
//! keep pointing at blocks no one serves. The agent cannot do this on its
//! own SIGTERM, which an upgrade sends too (docs/kubernetes.md,
//! "Uninstall", says how the cleanup DaemonSet runs this on every node).
//!
//! What is removed, in this order (each step goes on after a failed one and
//! the errors are reported together, so one stuck piece does not keep the
//! rest in place):
//! 1. the CNI files the agent installed (`install::uninstall`: only files
//!    still exactly as it wrote them);
//! 2. the pinned programs, links and maps under the pin root, and the
//!    programs attached through netlink to any interface of the node;
//! 3. routes of lockstep's protocol (213);
//! 4. the tunnel devices (`lockstep_vxlan`, `lockstep_geneve`);
//! 5. with `purge_state`, the state directory (the store): without it a
//!    reinstall resumes every allocation.
//!
//! etcd is not touched: `lockstep cluster node remove` takes a node out of
//! the cluster's state, from anywhere.

use std::path::{Path, PathBuf};

use lockstep_core::cluster::routing::TunnelProtocol;

use crate::config::Config;
use crate::datapath::Datapath;
use crate::netlink::{LOCKSTEP_ROUTE_PROTOCOL, Netlink, TunnelDevice};

/// Errors of uninstalling.
#[derive(Debug, thiserror::Error)]
pub enum UninstallError {
    /// The agent answers on its socket: removing its state under it would
    /// break the pods it serves.
    #[error("the agent is running (its socket {0} answers): stop it first (delete the DaemonSet)")]
    AgentRunning(PathBuf),
    /// Some steps failed; the others ran.
    #[error("{} step(s) failed: {}", .0.len(), .0.join("; "))]
    Steps(Vec<String>),
}

/// What was removed.
#[derive(Debug, Default, serde::Serialize)]
pub struct Removed {
    /// CNI files removed.
    pub cni_files: Vec<PathBuf>,
    /// CNI files left in place (changed since the agent wrote them).
    pub cni_kept: Vec<PathBuf>,
    /// Pins removed.
    pub pins: usize,
    /// Routes of lockstep's protocol removed.
    pub routes: usize,
    /// Devices removed.
    pub devices: Vec<String>,
    /// Whether the state directory was removed.
    pub state_removed: bool,
}

/// Removes what the agent of `config` left in the current network
/// namespace and on its paths.
///
/// # Errors
/// The agent is running, or some step failed (every failure named; the
/// other steps ran).
pub fn uninstall(config: &Config, purge_state: bool) -> Result<Removed, UninstallError> {
    if std::os::unix::net::UnixStream::connect(&config.socket).is_ok() {
        return Err(UninstallError::AgentRunning(config.socket.clone()));
    }
    let mut removed = Removed::default();
    let mut failed = Vec::new();
    match crate::install::uninstall(&config.cni, &config.state_dir) {
        Ok((files, kept)) => {
            removed.cni_files = files;
            removed.cni_kept = kept;
        }
        Err(e) => failed.push(format!("CNI files: {}", crate::error_chain(&e))),
    }
    let netlink = match Netlink::current() {
        Ok(n) => Some(n),
        Err(e) => {
            failed.push(format!("netlink: {}", crate::error_chain(&e)));
            None
        }
    };
    // Programs attached through netlink are not pinned: every interface
    // of the node is asked to let go of lockstep's programs by name.
    let ifaces: Vec<String> = netlink
        .as_ref()
        .and_then(|n| n.links().ok())
        .map(|links| links.into_iter().map(|l| l.name).collect())
        .unwrap_or_default();
    match Datapath::uninstall(&config.datapath.pin_root, &ifaces) {
        Ok(n) => removed.pins = n,
        Err(e) => failed.push(format!("pins: {}", crate::error_chain(&e))),
    }
    if let Some(n) = &netlink {
        routes(n, &mut removed, &mut failed);
        for protocol in [TunnelProtocol::Vxlan, TunnelProtocol::Geneve] {
            let name = TunnelDevice::name_of(protocol);
            match n.link(name) {
                Ok(Some(link)) => match n.delete_link(link.index) {
                    Ok(()) => removed.devices.push(name.to_string()),
                    Err(e) => failed.push(format!("device {name}: {}", crate::error_chain(&e))),
                },
                Ok(None) => {}
                Err(e) => failed.push(format!("device {name}: {}", crate::error_chain(&e))),
            }
        }
    }
    if purge_state {
        match remove_dir(&config.state_dir) {
            Ok(gone) => removed.state_removed = gone,
            Err(e) => failed.push(format!("state {}: {e}", config.state_dir.display())),
        }
    }
    if failed.is_empty() {
        Ok(removed)
    } else {
        Err(UninstallError::Steps(failed))
    }
}

/// Removes the routes of lockstep's protocol.
fn routes(n: &Netlink, removed: &mut Removed, failed: &mut Vec<String>) {
    match n.routes_of_protocol(LOCKSTEP_ROUTE_PROTOCOL) {
        Ok(routes) => {
            for (dst, gw) in routes {
                match n.delete_route_via(dst, gw, LOCKSTEP_ROUTE_PROTOCOL) {
                    Ok(()) => removed.routes += 1,
                    Err(e) => {
                        failed.push(format!("route {dst} via {gw}: {}", crate::error_chain(&e)))
                    }
                }
            }
        }
        Err(e) => failed.push(format!("routes: {}", crate::error_chain(&e))),
    }
}

/// Removes `dir` and what it holds; false when it was not there.
fn remove_dir(dir: &Path) -> std::io::Result<bool> {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}
