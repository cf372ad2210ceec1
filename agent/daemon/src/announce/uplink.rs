//! The uplink's health: whether this node can answer ARP and NDP for an
//! address now. Cluster mode's LB agent stops refreshing its lease while it
//! cannot, so its addresses move to a node that can; it asks the kernel
//! through an [`UplinkProbe`] every tick, never the agent, so a CNI call or
//! a reconcile holding the agent never hides a lost carrier from it.

use crate::netlink::Netlink;

use super::Announcements;

/// Whether this node's uplink can answer ARP and NDP for an address
/// (the agent's `uplink_health`, [`UplinkProbe::check`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UplinkHealth {
    /// No uplink configured: this node never answers for an address.
    None,
    /// Up, with carrier, the programs attached.
    Answering,
    /// It cannot answer now (down, without carrier, gone, or created again
    /// and not attached): why.
    Silent(String),
    /// Netlink could not tell.
    Unknown,
}

impl UplinkHealth {
    /// What an uplink's flags say of it: answering when it is up with
    /// carrier, silent (and why) otherwise.
    #[must_use]
    pub fn of_link(name: &str, up: bool, carrier: bool) -> Self {
        match (up, carrier) {
            (true, true) => UplinkHealth::Answering,
            (false, _) => UplinkHealth::Silent(format!("uplink {name} is down")),
            (true, false) => UplinkHealth::Silent(format!("uplink {name} has no carrier")),
        }
    }
}

/// The uplink's health as the kernel tells it, read without the agent: the
/// LB agent asks it every tick, and a CNI call or a reconcile holding the
/// agent never hides a lost carrier from it.
#[derive(Debug)]
pub struct UplinkProbe {
    name: String,
    /// Which interface index the programs are attached to.
    announcements: Announcements,
    /// Its own handle (made on the first check).
    netlink: Option<Netlink>,
}

impl UplinkProbe {
    /// A probe of uplink `name`, whose programs are attached to the
    /// interface index `announcements` name.
    #[must_use]
    pub fn new(name: String, announcements: Announcements) -> Self {
        Self {
            name,
            announcements,
            netlink: None,
        }
    }

    /// The uplink's health now. Blocking (a netlink request). `None`: the
    /// uplink was created again under its name, and only the agent can
    /// attach the programs to it (the agent's `uplink_health`).
    pub fn check(&mut self) -> Option<UplinkHealth> {
        if self.netlink.is_none() {
            self.netlink = Netlink::current().ok();
        }
        let Some(netlink) = self.netlink.as_ref() else {
            return Some(UplinkHealth::Unknown);
        };
        let name = &self.name;
        let link = match netlink.link(name) {
            Ok(Some(link)) => link,
            Ok(None) => return Some(UplinkHealth::Silent(format!("uplink {name} is gone"))),
            Err(_) => return Some(UplinkHealth::Unknown),
        };
        if self.announcements.uplink_index() != Some(link.index) {
            return None;
        }
        Some(UplinkHealth::of_link(name, link.up, link.carrier))
    }
}
