//! The one collect-metadata tunnel device of the routing modes `tunnel`
//! and `cross-subnet` (#30): VXLAN or Geneve in external mode (`ip link add
//! NAME type vxlan external dstport PORT`), so one device serves every
//! remote node; the programs set each packet's tunnel key.
//!
//! Like the pins, the device outlives the agent: a restart or an upgrade
//! finds it and adopts it as it is (no flap of running flows); only a
//! device of another kind, port or mode under the name (a configuration
//! change) is replaced.

use futures::TryStreamExt;
use lockstep_core::cluster::routing::TunnelProtocol;
use netlink_packet_route::link::{
    InfoData, InfoGeneve, InfoKind, InfoVxlan, LinkAttribute, LinkInfo, LinkMessage,
};
use rtnetlink::{LinkMessageBuilder, LinkUnspec};

use super::{Link, Netlink, NetlinkError, Step, link_of, req};

/// The tunnel device a node uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TunnelDevice {
    /// The interface name.
    pub name: String,
    /// VXLAN or Geneve.
    pub protocol: TunnelProtocol,
    /// The UDP port it listens and sends on.
    pub port: u16,
}

impl TunnelDevice {
    /// The name lockstep gives the device of `protocol`.
    pub fn name_of(protocol: TunnelProtocol) -> &'static str {
        match protocol {
            TunnelProtocol::Vxlan => "lockstep_vxlan",
            TunnelProtocol::Geneve => "lockstep_geneve",
        }
    }
}

/// What [`Netlink::ensure_tunnel`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TunnelAction {
    /// The device was there as wanted (up).
    Adopted,
    /// The device was there as wanted, down; it was set up.
    Raised,
    /// There was none; it was created.
    Created,
    /// Another device held the name (kind, port or mode); it was replaced.
    Replaced,
}

/// How a device found under the name differs from the one wanted, one
/// phrase (for `verify` and the log); `None` when it is the one wanted.
pub fn tunnel_mismatch(found: &LinkMessage, want: &TunnelDevice) -> Option<String> {
    let mut kind = None;
    let mut port = None;
    let mut external = false;
    for a in &found.attributes {
        let LinkAttribute::LinkInfo(infos) = a else {
            continue;
        };
        for i in infos {
            match i {
                LinkInfo::Kind(k) => kind = Some(k.clone()),
                LinkInfo::Data(InfoData::Vxlan(v)) => {
                    for x in v {
                        match x {
                            InfoVxlan::Port(p) => port = Some(*p),
                            InfoVxlan::CollectMetadata(c) => external = *c,
                            _ => {}
                        }
                    }
                }
                LinkInfo::Data(InfoData::Geneve(v)) => {
                    for x in v {
                        match x {
                            InfoGeneve::Port(p) => port = Some(*p),
                            InfoGeneve::CollectMetadata => external = true,
                            _ => {}
                        }
                    }
                }
                _ => {}
            }
        }
    }
    let want_kind = match want.protocol {
        TunnelProtocol::Vxlan => InfoKind::Vxlan,
        TunnelProtocol::Geneve => InfoKind::Geneve,
    };
    if kind.as_ref() != Some(&want_kind) {
        return Some(format!(
            "is a {} device, want {}",
            kind.map_or_else(|| "plain".to_string(), |k| k.to_string()),
            want.protocol.name()
        ));
    }
    if !external {
        return Some("is not in external (collect-metadata) mode".into());
    }
    if port != Some(want.port) {
        return Some(format!(
            "listens on UDP {}, want {}",
            port.map_or_else(|| "?".to_string(), |p| p.to_string()),
            want.port
        ));
    }
    None
}

impl Netlink {
    /// The device named `name` as the kernel describes it (kind and
    /// tunnel attributes included), if it exists.
    ///
    /// # Errors
    /// A request failed for another reason than "no such device".
    pub fn link_message(&self, name: &str) -> Result<Option<LinkMessage>, NetlinkError> {
        let request = self.handle.link().get().match_name(name.to_string());
        match self
            .rt
            .block_on(async move { request.execute().try_next().await })
        {
            Ok(m) => Ok(m),
            Err(rtnetlink::Error::NetlinkError(m))
                if m.code.map(|c| -c.get()) == Some(libc::ENODEV) =>
            {
                Ok(None)
            }
            Err(e) => Err(req(format!("get link {name}"))(e)),
        }
    }

    /// Makes `want` exist and be up: adopts the device under its name when
    /// it is the one wanted, creates it when absent, replaces a device of
    /// another kind, port or mode. Idempotent.
    ///
    /// # Errors
    /// The kernel refused (e.g. the port is taken by another device).
    pub fn ensure_tunnel(&self, want: &TunnelDevice) -> Result<(Link, TunnelAction), NetlinkError> {
        let mut action = TunnelAction::Created;
        if let Some(found) = self.link_message(&want.name)? {
            match tunnel_mismatch(&found, want) {
                None => {
                    let link = link_of(&found);
                    if link.up {
                        return Ok((link, TunnelAction::Adopted));
                    }
                    self.apply(&[Step::Up(link.index)])?;
                    return Ok((link, TunnelAction::Raised));
                }
                Some(why) => {
                    tracing::warn!(device = %want.name, %why, "replacing the tunnel device");
                    self.delete_link(found.header.index)?;
                    action = TunnelAction::Replaced;
                }
            }
        }
        let data = match want.protocol {
            TunnelProtocol::Vxlan => InfoData::Vxlan(vec![
                InfoVxlan::CollectMetadata(true),
                InfoVxlan::Port(want.port),
                InfoVxlan::Learning(false),
            ]),
            TunnelProtocol::Geneve => InfoData::Geneve(vec![
                InfoGeneve::CollectMetadata,
                InfoGeneve::Port(want.port),
            ]),
        };
        let kind = match want.protocol {
            TunnelProtocol::Vxlan => InfoKind::Vxlan,
            TunnelProtocol::Geneve => InfoKind::Geneve,
        };
        let msg = LinkMessageBuilder::<LinkUnspec>::new_with_info_kind(kind)
            .name(want.name.clone())
            .set_info_data(data)
            .up()
            .build();
        let handle = self.handle.clone();
        self.rt
            .block_on(async move { handle.link().add(msg).execute().await })
            .map_err(req(format!("create tunnel device {}", want.name)))?;
        let link = self
            .link(&want.name)?
            .ok_or_else(|| NetlinkError::Invalid {
                reason: format!(
                    "tunnel device {} is gone right after its creation",
                    want.name
                ),
            })?;
        Ok((link, action))
    }

    /// The MTU of interface `index`.
    ///
    /// # Errors
    /// The request failed or the interface does not exist.
    pub fn mtu(&self, index: u32) -> Result<u32, NetlinkError> {
        let request = self.handle.link().get().match_index(index);
        let msg = self
            .rt
            .block_on(async move { request.execute().try_next().await })
            .map_err(req(format!("get link {index}")))?
            .ok_or_else(|| NetlinkError::Invalid {
                reason: format!("interface {index} does not exist"),
            })?;
        msg.attributes
            .iter()
            .find_map(|a| match a {
                LinkAttribute::Mtu(m) => Some(*m),
                _ => None,
            })
            .ok_or_else(|| NetlinkError::Invalid {
                reason: format!("interface {index} reports no MTU"),
            })
    }
}
