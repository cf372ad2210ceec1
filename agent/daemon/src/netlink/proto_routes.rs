//! Routes tagged with one route protocol number: the remote-state routes
//! (`block via node_ip`) carry lockstep's own protocol
//! ([`LOCKSTEP_ROUTE_PROTOCOL`]) so that listing, replacing and deleting
//! them never touches a route another program (or the operator) made.

use std::collections::BTreeMap;
use std::net::IpAddr;

use futures::TryStreamExt;
use ipnet::IpNet;
use netlink_packet_route::route::{RouteAttribute, RouteProtocol};
use rtnetlink::RouteMessageBuilder;

use super::{Netlink, NetlinkError, invalid, req, route_addr};

/// lockstep's route protocol number (`ip route ... proto 213`): unused by
/// iproute2's `rt_protos` and the well-known routing daemons.
pub const LOCKSTEP_ROUTE_PROTOCOL: u8 = 213;

impl Netlink {
    /// The main-table routes with protocol `proto` that have a gateway:
    /// destination → gateway.
    ///
    /// # Errors
    /// The request failed.
    pub fn routes_of_protocol(&self, proto: u8) -> Result<BTreeMap<IpNet, IpAddr>, NetlinkError> {
        let mut out = BTreeMap::new();
        for v6 in [false, true] {
            let msg = if v6 {
                RouteMessageBuilder::<std::net::Ipv6Addr>::new().build()
            } else {
                RouteMessageBuilder::<std::net::Ipv4Addr>::new().build()
            };
            let handle = self.handle.clone();
            let msgs: Vec<_> = self
                .rt
                .block_on(async move {
                    handle
                        .route()
                        .get(msg)
                        .execute()
                        .try_collect::<Vec<_>>()
                        .await
                })
                .map_err(req("list routes"))?;
            for m in msgs {
                if m.header.protocol != RouteProtocol::from(proto) {
                    continue;
                }
                let dst = m.attributes.iter().find_map(|a| match a {
                    RouteAttribute::Destination(d) => route_addr(d),
                    _ => None,
                });
                let gw = m.attributes.iter().find_map(|a| match a {
                    RouteAttribute::Gateway(g) => route_addr(g),
                    _ => None,
                });
                let zero: IpAddr = if v6 {
                    std::net::Ipv6Addr::UNSPECIFIED.into()
                } else {
                    std::net::Ipv4Addr::UNSPECIFIED.into()
                };
                if let (Some(gw), Ok(net)) = (
                    gw,
                    IpNet::new(dst.unwrap_or(zero), m.header.destination_prefix_length),
                ) {
                    out.insert(net, gw);
                }
            }
        }
        Ok(out)
    }

    /// Adds the route `dst via gw` with protocol `proto`; with `replace`,
    /// replaces the route to `dst` (for a route of this protocol whose next
    /// hop changed). Without it a route to `dst` of any protocol makes the
    /// add fail (EEXIST), so another program's route is never replaced.
    ///
    /// # Errors
    /// The kernel refused (a route to `dst` exists, the gateway is not
    /// reachable on a link), or a family mismatch.
    pub fn add_route_via(
        &self,
        dst: IpNet,
        gw: IpAddr,
        proto: u8,
        replace: bool,
    ) -> Result<(), NetlinkError> {
        let msg = Self::route_via(dst, gw, proto)?;
        let handle = self.handle.clone();
        self.rt
            .block_on(async move {
                let add = handle.route().add(msg);
                if replace {
                    add.replace().execute().await
                } else {
                    add.execute().await
                }
            })
            .map_err(req(format!("add route {dst} via {gw} proto {proto}")))
    }

    /// Deletes the route `dst via gw` with protocol `proto`; a route that
    /// is already gone is not an error.
    ///
    /// # Errors
    /// The kernel refused for another reason.
    pub fn delete_route_via(&self, dst: IpNet, gw: IpAddr, proto: u8) -> Result<(), NetlinkError> {
        let msg = Self::route_via(dst, gw, proto)?;
        let handle = self.handle.clone();
        let r = self
            .rt
            .block_on(async move { handle.route().del(msg).execute().await })
            .map_err(req(format!("delete route {dst} via {gw} proto {proto}")));
        match r {
            Err(e) if e.errno() == Some(libc::ESRCH) => Ok(()),
            r => r,
        }
    }

    fn route_via(
        dst: IpNet,
        gw: IpAddr,
        proto: u8,
    ) -> Result<netlink_packet_route::route::RouteMessage, NetlinkError> {
        Ok(RouteMessageBuilder::<IpAddr>::new()
            .destination_prefix(dst.addr(), dst.prefix_len())
            .map_err(invalid)?
            .gateway(gw)
            .map_err(invalid)?
            .protocol(RouteProtocol::from(proto))
            .build())
    }
}
