//! The agent's side of the announcements ([`crate::announce`]): handing
//! them out, and the uplink they are sent on. Whether the uplink can answer
//! is asked here when only the agent can mend it: an uplink deleted and
//! created again has lost the programs, and the agent attaches them to the
//! new interface. Everything else of the announcements (the lease, the
//! maps behind their own lock, the kernel-only probe) is the leaf's, shared
//! with cluster mode and the Kubernetes announcer without naming the agent.

use std::net::IpAddr;

use crate::announce::{Announcements, UplinkHealth, UplinkProbe};
use crate::netlink::Netlink;

use super::Agent;

impl Agent {
    /// The announcements (their own lock): for the renewer and cluster
    /// mode's LB agent.
    #[must_use]
    pub fn announcements(&self) -> Announcements {
        self.announce.clone()
    }

    /// Whether the uplink can answer for an address: it exists, is
    /// administratively up, has carrier, and carries this agent's programs.
    /// Cluster mode stops refreshing its LB lease while it cannot, so its
    /// addresses move to a node that can answer: an uplink set down, one
    /// whose cable (or veth peer, or switch port) went down and one deleted
    /// are alike to the neighbours. An uplink deleted and created again
    /// under its name (a new interface index) has lost the programs with
    /// the old interface: they are attached to the new one here, and the
    /// old one's link pins removed.
    pub fn uplink_health(&mut self) -> UplinkHealth {
        let Some(up) = self.uplink.as_ref() else {
            return UplinkHealth::None;
        };
        let (name, index) = (up.name.clone(), up.index);
        if self.netlink.is_none() {
            self.netlink = Netlink::current().ok();
        }
        let Some(netlink) = self.netlink.as_ref() else {
            return UplinkHealth::Unknown;
        };
        let link = match netlink.link(&name) {
            Ok(Some(link)) => link,
            Ok(None) => return UplinkHealth::Silent(format!("uplink {name} is gone")),
            Err(_) => return UplinkHealth::Unknown,
        };
        if link.index != index {
            if let Err(e) = self.attach_uplink() {
                return UplinkHealth::Silent(format!(
                    "uplink {name} was created again (index {index} -> {}) and the programs could not be attached to it: {}",
                    link.index,
                    crate::error_chain(&e)
                ));
            }
            for (program, hook) in [
                (
                    lockstep_common::program_names::TO_NATIVE,
                    crate::datapath::Hook::Egress,
                ),
                (
                    lockstep_common::program_names::FROM_NATIVE,
                    crate::datapath::Hook::Ingress,
                ),
            ] {
                if let Err(e) = self.datapath.detach_index(program, index, hook) {
                    tracing::warn!(error = %crate::error_chain(&e), program, index, "the gone uplink's link pin is not removed");
                }
            }
            tracing::info!(uplink = %name, old = index, new = link.index, "uplink created again: programs attached to the new interface");
        }
        UplinkHealth::of_link(&name, link.up, link.carrier)
    }

    /// A probe of the uplink's health that asks the kernel, never the
    /// agent (`None`: no uplink).
    pub fn uplink_probe(&self) -> Option<UplinkProbe> {
        self.uplink
            .as_ref()
            .map(|up| UplinkProbe::new(up.name.clone(), self.announcements()))
    }

    /// Announces `addr` on the uplink (single-node LB): gratuitous ARP
    /// (IPv4) or unsolicited Neighbor Advertisement (IPv6), best effort.
    pub(super) fn send_announcement(&self, addr: IpAddr) {
        self.announce.send(addr);
    }
}
