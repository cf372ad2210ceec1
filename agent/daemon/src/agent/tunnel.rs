//! Cluster routing modes on this node (#30, docs/cluster.md "Routing
//! modes"): the routing the remote-state task decides with (the mode and
//! this node's own underlay prefixes), the one collect-metadata tunnel
//! device with `from_tunnel` on its ingress, TUNNEL_CONFIG (the device and
//! VNI the programs use), and the MTU endpoints get in modes that may
//! encapsulate.
//!
//! The device and TUNNEL_CONFIG follow the lockstep rules: made at start
//! (adopted as found when they are what is wanted, so a restart or an
//! upgrade does not disturb running flows), compared and repaired on every
//! reconcile, and `verify` names what differs.

use std::net::IpAddr;

use ipnet::IpNet;
use lockstep_common::{Counter, TunnelConfig, program_names};
use lockstep_core::cluster::routing::Routing;

use super::{Agent, AgentError};
use crate::datapath::Hook;
use crate::netlink::{Netlink, TunnelAction, TunnelDevice, tunnel_mismatch};

/// What this node's routing mode asks for.
#[derive(Clone, Debug, Default)]
pub(super) struct RoutingState {
    /// The mode and this node's underlay prefixes.
    routing: Routing,
    /// The tunnel device and TUNNEL_CONFIG, in modes that may encapsulate.
    tunnel: Option<(TunnelDevice, TunnelConfig)>,
    /// The interface index `from_tunnel` was last attached to.
    attached: Option<u32>,
    /// The MTU of endpoint interfaces whose CNI configuration names none.
    endpoint_mtu: Option<u32>,
}

/// This node's underlay prefixes: each node address with the prefix length
/// of the interface address it is; a configured address no interface holds
/// counts as a host prefix.
fn own_prefixes(nl: &Netlink, ips: &[IpAddr]) -> Result<Vec<IpNet>, AgentError> {
    let mut held = Vec::new();
    for l in nl.links()? {
        held.extend(nl.addresses(l.index)?);
    }
    Ok(ips
        .iter()
        .map(|ip| {
            held.iter()
                .find(|n| n.addr() == *ip)
                .copied()
                .unwrap_or_else(|| IpNet::from(*ip))
        })
        .collect())
}

/// The MTU of the interface holding `ip`, if one does.
fn mtu_of_holder(nl: &Netlink, ip: IpAddr) -> Result<Option<u32>, AgentError> {
    for l in nl.links()? {
        if nl.addresses(l.index)?.iter().any(|n| n.addr() == ip) {
            return Ok(Some(nl.mtu(l.index)?));
        }
    }
    Ok(None)
}

impl Agent {
    /// Decides the routing at start (cluster mode only, `ips` the node's
    /// addresses) and sets the
    /// tunnel up when the mode may encapsulate. Before the first reconcile.
    ///
    /// # Errors
    /// The node addresses cannot be found; the device or its program
    /// cannot be set up.
    pub(super) fn start_routing(&mut self, ips: Vec<IpAddr>) -> Result<(), AgentError> {
        let Some(cluster) = self.config.cluster.clone() else {
            return Ok(());
        };
        let nl = Netlink::current()?;
        let routing = Routing {
            mode: cluster.routing,
            own: own_prefixes(&nl, &ips)?,
        };
        let mut state = RoutingState {
            routing,
            ..RoutingState::default()
        };
        if cluster.routing.may_encapsulate() {
            let underlay = match ips.first() {
                Some(ip) => mtu_of_holder(&nl, *ip)?,
                None => None,
            };
            state.endpoint_mtu = Some(cluster.endpoint_mtu.unwrap_or_else(|| {
                state
                    .routing
                    .endpoint_mtu(cluster.tunnel_protocol, underlay.unwrap_or(1500))
            }));
            let mut config = TunnelConfig {
                vni: cluster.tunnel_vni,
                ..TunnelConfig::default()
            };
            for ip in &ips {
                match ip {
                    IpAddr::V4(a) if config.local_v4 == [0; 4] => config.local_v4 = a.octets(),
                    IpAddr::V6(a) if config.local_v6 == [0; 16] => config.local_v6 = a.octets(),
                    _ => {}
                }
            }
            let device = TunnelDevice {
                name: TunnelDevice::name_of(cluster.tunnel_protocol).to_string(),
                protocol: cluster.tunnel_protocol,
                port: cluster.tunnel_port(),
            };
            state.tunnel = Some((device, config));
        } else {
            state.endpoint_mtu = cluster.endpoint_mtu;
        }
        self.routing = state;
        // At start the program is attached whatever was found: an upgrade
        // replaces the running one in place.
        self.sync_tunnel(true)?;
        Ok(())
    }

    /// The routing the remote-state task decides with.
    pub fn routing(&self) -> Routing {
        self.routing.routing.clone()
    }

    /// The MTU an endpoint gets when its CNI configuration names none.
    pub(super) fn endpoint_mtu(&self) -> Option<u32> {
        self.routing.endpoint_mtu
    }

    /// Makes the tunnel device, its program and TUNNEL_CONFIG what the mode
    /// asks for; outside the tunnel modes TUNNEL_CONFIG is emptied (packets
    /// to `ENCAP` entries then drop, counted). `attach`: attach
    /// `from_tunnel` even to a device that was found as it was. Returns
    /// how many things were repaired.
    ///
    /// # Errors
    /// netlink, the attach or the map write failed.
    pub(super) fn sync_tunnel(&mut self, attach: bool) -> Result<u64, AgentError> {
        let mut repaired = 0;
        let want = match self.routing.tunnel.clone() {
            Some((device, mut config)) => {
                let (link, action) = Netlink::current()?.ensure_tunnel(&device)?;
                if action != TunnelAction::Adopted {
                    tracing::info!(device = %device.name, ?action, port = device.port, "tunnel device");
                    repaired += 1;
                }
                let tcx =
                    self.config.datapath.attach_mode != crate::config::AttachModeConfig::Netlink;
                let pin_gone = tcx
                    && !self
                        .datapath
                        .link_pin(program_names::FROM_TUNNEL, Hook::Ingress, link.index)
                        .exists();
                if attach || pin_gone || self.routing.attached != Some(link.index) {
                    if !attach {
                        repaired += 1;
                    }
                    self.datapath.attach(
                        program_names::FROM_TUNNEL,
                        &device.name,
                        Hook::Ingress,
                    )?;
                    self.routing.attached = Some(link.index);
                }
                config.ifindex = link.index;
                config
            }
            None => TunnelConfig::default(),
        };
        if self.maps.read_tunnel_config()? != want {
            self.maps.set_tunnel_config(want)?;
            repaired += 1;
        }
        Ok(repaired)
    }

    /// The datapath's tunnel counters (summed over CPUs), for metrics; none
    /// when COUNTERS cannot be read.
    pub fn tunnel_counters(&self) -> Vec<(Counter, u64)> {
        self.datapath_counters()
            .into_iter()
            .filter(|(c, _)| c.name().starts_with("tunnel_"))
            .collect()
    }

    /// What `verify` reports about the tunnel: the device missing, of
    /// another kind or down, `from_tunnel` not attached (TCX), and
    /// TUNNEL_CONFIG not naming the device and VNI.
    pub(super) fn tunnel_drift(&self) -> Vec<String> {
        let mut out = Vec::new();
        let wanted_config = match &self.routing.tunnel {
            None => TunnelConfig::default(),
            Some((device, config)) => {
                let found = Netlink::current().and_then(|nl| nl.link_message(&device.name));
                match found {
                    Err(e) => {
                        out.push(format!(
                            "tunnel device {} not read: {}",
                            device.name,
                            crate::error_chain(&e)
                        ));
                        return out;
                    }
                    Ok(None) => {
                        out.push(format!("tunnel device {} is missing", device.name));
                        return out;
                    }
                    Ok(Some(m)) => {
                        if let Some(why) = tunnel_mismatch(&m, device) {
                            out.push(format!("tunnel device {} {why}", device.name));
                        }
                        let link = crate::netlink::link_of(&m);
                        if !link.up {
                            out.push(format!("tunnel device {} is down", device.name));
                        }
                        let pin = self.datapath.link_pin(
                            program_names::FROM_TUNNEL,
                            Hook::Ingress,
                            link.index,
                        );
                        let tcx = self.config.datapath.attach_mode
                            != crate::config::AttachModeConfig::Netlink;
                        if tcx && self.routing.attached == Some(link.index) && !pin.exists() {
                            out.push(format!(
                                "from_tunnel is not attached to {} (no link pin {})",
                                device.name,
                                pin.display()
                            ));
                        }
                        TunnelConfig {
                            ifindex: link.index,
                            ..*config
                        }
                    }
                }
            }
        };
        match self.maps.read_tunnel_config() {
            Ok(c) if c == wanted_config => {}
            Ok(c) => out.push(format!("TUNNEL_CONFIG holds {c:?}, want {wanted_config:?}")),
            Err(e) => out.push(format!(
                "TUNNEL_CONFIG not read: {}",
                crate::error_chain(&e)
            )),
        }
        out
    }
}
