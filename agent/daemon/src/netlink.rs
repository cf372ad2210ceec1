//! Interfaces, addresses, routes and neighbours: the only module that uses
//! rtnetlink.
//!
//! A [`Netlink`] is bound to one network namespace for its whole life: its
//! socket is created on a thread that entered that namespace, and a netlink
//! socket keeps the namespace it was created in. Each handle drives its own
//! current-thread runtime, so the synchronous agent can call it from any
//! thread without sharing an async context.

use std::net::IpAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use futures::{StreamExt, TryStreamExt};
use ipnet::IpNet;
use netlink_packet_route::address::AddressAttribute;
use netlink_packet_route::link::{LinkAttribute, LinkMessage};
use netlink_packet_route::neighbour::NeighbourState;
use netlink_packet_route::route::{RouteAttribute, RouteScope};
use rtnetlink::{Handle, LinkUnspec, LinkVeth, RouteMessageBuilder};

mod proto_routes;
mod tunnel;
pub use proto_routes::LOCKSTEP_ROUTE_PROTOCOL;
pub use tunnel::{TunnelAction, TunnelDevice, tunnel_mismatch};

/// Errors of netlink operations.
#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    /// The namespace file could not be opened or entered.
    #[error("cannot enter network namespace {path}")]
    Namespace {
        /// The namespace file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The socket or runtime could not be created.
    #[error("cannot open a netlink socket")]
    Socket(#[source] std::io::Error),
    /// A request failed.
    #[error("netlink {op} failed")]
    Request {
        /// What was asked.
        op: String,
        /// rtnetlink's error (carries the kernel's errno).
        #[source]
        source: rtnetlink::Error,
    },
    /// A message could not be built (e.g. a family mismatch).
    #[error("invalid netlink request: {reason}")]
    Invalid {
        /// What is wrong.
        reason: String,
    },
}

impl NetlinkError {
    /// The kernel's errno, when the kernel refused.
    pub fn errno(&self) -> Option<i32> {
        match self {
            NetlinkError::Request {
                source: rtnetlink::Error::NetlinkError(m),
                ..
            } => m.code.map(|c| -c.get()),
            _ => None,
        }
    }
}

/// One interface as seen by netlink.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Link {
    /// Interface index.
    pub index: u32,
    /// Name.
    pub name: String,
    /// Hardware address.
    pub mac: [u8; 6],
    /// Administratively up.
    pub up: bool,
    /// Has carrier (`IFF_LOWER_UP`): a veth whose peer is down, or a NIC
    /// with its cable out, is up but has none.
    pub carrier: bool,
}

/// What [`Netlink::create_veth_into`] made, as the kernel echoed it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CreatedVeth {
    /// The host-side end.
    pub host: Link,
    /// The index of the peer, in its namespace.
    pub peer_index: u32,
}

/// One change [`Netlink::apply`] makes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Sets interface `index` up.
    Up(u32),
    /// Gives interface `index` no IPv6 link-local address
    /// (`addr_gen_mode` none): before it goes up, this spares the kernel
    /// making the address and starting duplicate address detection,
    /// multicast joins and router solicitation on it. For interfaces that
    /// only forward (an endpoint's host side); IPv6 still flows through.
    NoLinkLocal(u32),
    /// Adds `address/prefix_len` to interface `index`; IPv6 addresses skip
    /// duplicate address detection (the address is ours by allocation).
    Address {
        /// Interface index.
        index: u32,
        /// The address.
        address: IpAddr,
        /// Its prefix length.
        prefix_len: u8,
    },
    /// Adds (or replaces) a permanent neighbour entry `ip` → `mac`.
    Neighbour {
        /// Interface index.
        index: u32,
        /// The neighbour's address.
        ip: IpAddr,
        /// Its hardware address.
        mac: [u8; 6],
    },
    /// Adds (or replaces) a route to `dst` out of `oif`, via `gateway` or on-link.
    Route {
        /// Destination.
        dst: IpNet,
        /// Next hop; `None` for an on-link route.
        gateway: Option<IpAddr>,
        /// Output interface index.
        oif: u32,
    },
}

type StepFuture = std::pin::Pin<Box<dyn Future<Output = Result<(), NetlinkError>>>>;

/// A netlink handle bound to one network namespace.
pub struct Netlink {
    rt: tokio::runtime::Runtime,
    handle: Handle,
    netns: Option<PathBuf>,
}

impl std::fmt::Debug for Netlink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Netlink")
            .field("netns", &self.netns)
            .finish()
    }
}

fn req(op: impl Into<String>) -> impl FnOnce(rtnetlink::Error) -> NetlinkError {
    let op = op.into();
    move |source| NetlinkError::Request { op, source }
}

pub(crate) fn link_of(msg: &LinkMessage) -> Link {
    let mut name = String::new();
    let mut mac = [0u8; 6];
    for attr in &msg.attributes {
        match attr {
            LinkAttribute::IfName(n) => name = n.clone(),
            LinkAttribute::Address(a) if a.len() == 6 => mac.copy_from_slice(a),
            _ => {}
        }
    }
    Link {
        index: msg.header.index,
        name,
        mac,
        up: msg
            .header
            .flags
            .contains(netlink_packet_route::link::LinkFlags::Up),
        carrier: msg
            .header
            .flags
            .contains(netlink_packet_route::link::LinkFlags::LowerUp),
    }
}

/// Opens a namespace file.
///
/// # Errors
/// [`NetlinkError::Namespace`].
pub fn open_netns(path: &Path) -> Result<OwnedFd, NetlinkError> {
    std::fs::File::open(path)
        .map(OwnedFd::from)
        .map_err(|source| NetlinkError::Namespace {
            path: path.to_path_buf(),
            source,
        })
}

impl Netlink {
    /// A handle in the caller's network namespace.
    ///
    /// # Errors
    /// The socket or runtime could not be created.
    pub fn current() -> Result<Self, NetlinkError> {
        let rt = Self::runtime()?;
        let (conn, handle) = {
            // The socket registers with the reactor of the runtime entered
            // here, which is the one that will drive it.
            let _entered = rt.enter();
            let (conn, handle, _) = rtnetlink::new_connection().map_err(NetlinkError::Socket)?;
            (conn, handle)
        };
        rt.spawn(conn);
        Ok(Self {
            rt,
            handle,
            netns: None,
        })
    }

    /// A handle in the namespace at `path` (e.g. a container's `CNI_NETNS`).
    ///
    /// # Errors
    /// The namespace cannot be entered, or the socket created.
    pub fn in_netns(path: &Path) -> Result<Self, NetlinkError> {
        let fd = open_netns(path)?;
        let rt = Self::runtime()?;
        let path_buf = path.to_path_buf();
        let (conn, handle) = std::thread::scope(|s| {
            s.spawn(|| {
                // SAFETY: `fd` is a valid namespace fd; setns affects only
                // this short-lived thread.
                if unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                    return Err(NetlinkError::Namespace {
                        path: path_buf.clone(),
                        source: std::io::Error::last_os_error(),
                    });
                }
                let _entered = rt.enter();
                let (conn, handle, _) =
                    rtnetlink::new_connection().map_err(NetlinkError::Socket)?;
                Ok((conn, handle))
            })
            .join()
            .unwrap_or_else(|_| {
                Err(NetlinkError::Invalid {
                    reason: "namespace thread panicked".into(),
                })
            })
        })?;
        rt.spawn(conn);
        Ok(Self {
            rt,
            handle,
            netns: Some(path.to_path_buf()),
        })
    }

    /// Moves the calling thread into the namespace `fd` (the file at
    /// `path`) for good and returns a handle there: for a thread spawned to
    /// work in that namespace and end, so its requests run beside the
    /// caller's instead of one round trip after another.
    ///
    /// # Errors
    /// The namespace cannot be entered, or the socket created.
    pub fn enter(fd: &OwnedFd, path: &Path) -> Result<Self, NetlinkError> {
        // SAFETY: `fd` is a valid namespace fd; only this thread moves.
        if unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(NetlinkError::Namespace {
                path: path.to_path_buf(),
                source: std::io::Error::last_os_error(),
            });
        }
        let mut handle = Self::current()?;
        handle.netns = Some(path.to_path_buf());
        Ok(handle)
    }

    fn runtime() -> Result<tokio::runtime::Runtime, NetlinkError> {
        tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .map_err(NetlinkError::Socket)
    }

    /// The interface named `name`, if it exists.
    ///
    /// # Errors
    /// A request failed for another reason than "no such device".
    pub fn link(&self, name: &str) -> Result<Option<Link>, NetlinkError> {
        self.get_link(|r| r.match_name(name.to_string()), name)
    }

    /// Every interface in this namespace.
    ///
    /// # Errors
    /// The request failed.
    pub fn links(&self) -> Result<Vec<Link>, NetlinkError> {
        let handle = self.handle.clone();
        let msgs: Vec<LinkMessage> = self
            .rt
            .block_on(async move { handle.link().get().execute().try_collect().await })
            .map_err(req("list links"))?;
        Ok(msgs.iter().map(link_of).collect())
    }

    /// The interface with index `index`, if it exists.
    ///
    /// # Errors
    /// A request failed for another reason than "no such device".
    pub fn link_by_index(&self, index: u32) -> Result<Option<Link>, NetlinkError> {
        self.get_link(|r| r.match_index(index), &index.to_string())
    }

    fn get_link(
        &self,
        filter: impl FnOnce(rtnetlink::LinkGetRequest) -> rtnetlink::LinkGetRequest,
        what: &str,
    ) -> Result<Option<Link>, NetlinkError> {
        let request = filter(self.handle.link().get());
        match self
            .rt
            .block_on(async move { request.execute().try_next().await })
        {
            Ok(msg) => Ok(msg.as_ref().map(link_of)),
            Err(rtnetlink::Error::NetlinkError(m))
                if m.code.map(|c| -c.get()) == Some(libc::ENODEV) =>
            {
                Ok(None)
            }
            Err(e) => Err(req(format!("get link {what}"))(e)),
        }
    }

    /// Creates a veth pair `host` ↔ `peer` in this namespace.
    ///
    /// # Errors
    /// The kernel refused (e.g. a name exists).
    pub fn create_veth(
        &self,
        host: &str,
        peer: &str,
        mtu: Option<u32>,
    ) -> Result<(), NetlinkError> {
        let mut msg = LinkVeth::new(host, peer);
        if let Some(mtu) = mtu {
            msg = msg.mtu(mtu);
        }
        let handle = self.handle.clone();
        self.rt
            .block_on(async move { handle.link().add(msg.build()).execute().await })
            .map_err(req(format!("create veth {host}")))
    }

    /// Creates a veth pair `host` (here, down: the caller configures it
    /// before raising it) ↔ `peer`, the peer made
    /// directly inside the namespace `peer_netns` under its final name with
    /// the hardware address `peer_mac`. Moving an existing interface between
    /// namespaces waits for an RCU grace period (~25 ms measured here);
    /// creating it in place does not. The kernel echoes the new host-side
    /// link (`NLM_F_ECHO`), which carries its index, its address and the
    /// peer's index, so no lookup follows. The peer cannot be set up here:
    /// a veth end opens only once its pair is complete.
    ///
    /// # Errors
    /// The kernel refused (e.g. `EEXIST`: a name exists on either side).
    pub fn create_veth_into(
        &self,
        host: &str,
        peer: &str,
        peer_netns: &OwnedFd,
        mtu: Option<u32>,
        peer_mac: [u8; 6],
    ) -> Result<CreatedVeth, NetlinkError> {
        use netlink_packet_route::RouteNetlinkMessage;
        use netlink_packet_route::link::{InfoData, InfoKind, InfoVeth};
        use rtnetlink::LinkMessageBuilder;
        use rtnetlink::packet_core::{
            NLM_F_ACK, NLM_F_CREATE, NLM_F_ECHO, NLM_F_EXCL, NLM_F_REQUEST, NetlinkMessage,
            NetlinkPayload,
        };
        let mut peer_msg = LinkMessageBuilder::<LinkUnspec>::new()
            .name(peer.to_string())
            .address(peer_mac.to_vec())
            .setns_by_fd(peer_netns.as_raw_fd());
        let mut msg = LinkMessageBuilder::<LinkVeth>::new_with_info_kind(InfoKind::Veth)
            .name(host.to_string());
        if let Some(mtu) = mtu {
            peer_msg = peer_msg.mtu(mtu);
            msg = msg.mtu(mtu);
        }
        let msg = msg.set_info_data(InfoData::Veth(InfoVeth::Peer(peer_msg.build())));
        let mut request = NetlinkMessage::from(RouteNetlinkMessage::NewLink(msg.build()));
        request.header.flags = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL | NLM_F_ECHO;
        let op = || format!("create veth {host} with peer {peer} in a namespace");
        let mut handle = self.handle.clone();
        let echoed = self.rt.block_on(async move {
            let mut answers = handle.request(request).map_err(req(op()))?;
            let mut echoed = None;
            while let Some(m) = answers.next().await {
                match m.payload {
                    NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(l)) => {
                        echoed = Some(l);
                    }
                    NetlinkPayload::Error(e) if e.code.is_some() => {
                        return Err(req(op())(rtnetlink::Error::NetlinkError(e)));
                    }
                    _ => {}
                }
            }
            Ok(echoed)
        })?;
        let echoed = echoed.ok_or_else(|| NetlinkError::Invalid {
            reason: format!("the kernel did not echo the new veth {host}"),
        })?;
        let peer_index = echoed
            .attributes
            .iter()
            .find_map(|a| match a {
                LinkAttribute::Link(i) => Some(*i),
                _ => None,
            })
            .ok_or_else(|| NetlinkError::Invalid {
                reason: format!("the echo of veth {host} names no peer"),
            })?;
        Ok(CreatedVeth {
            host: link_of(&echoed),
            peer_index,
        })
    }

    /// Moves interface `index` into the namespace `netns`.
    ///
    /// # Errors
    /// The kernel refused.
    pub fn move_to_netns(&self, index: u32, netns: &OwnedFd) -> Result<(), NetlinkError> {
        let msg = LinkUnspec::new_with_index(index)
            .setns_by_fd(netns.as_raw_fd())
            .build();
        let handle = self.handle.clone();
        self.rt
            .block_on(async move { handle.link().set(msg).execute().await })
            .map_err(req(format!("move link {index} to a namespace")))
    }

    /// Renames interface `index` (it must be down) and sets the MTU.
    ///
    /// # Errors
    /// The kernel refused.
    pub fn rename(&self, index: u32, name: &str) -> Result<(), NetlinkError> {
        let msg = LinkUnspec::new_with_index(index)
            .name(name.to_string())
            .build();
        let handle = self.handle.clone();
        self.rt
            .block_on(async move { handle.link().set(msg).execute().await })
            .map_err(req(format!("rename link {index} to {name}")))
    }

    /// Deletes interface `index` (a veth takes its peer with it). Already
    /// gone is success.
    ///
    /// # Errors
    /// The kernel refused for another reason.
    pub fn delete_link(&self, index: u32) -> Result<(), NetlinkError> {
        let handle = self.handle.clone();
        match self
            .rt
            .block_on(async move { handle.link().del(index).execute().await })
        {
            Ok(()) => Ok(()),
            Err(rtnetlink::Error::NetlinkError(m))
                if m.code.map(|c| -c.get()) == Some(libc::ENODEV) =>
            {
                Ok(())
            }
            Err(e) => Err(req(format!("delete link {index}"))(e)),
        }
    }

    /// Puts interface `index` in interface group `group` (no grace period:
    /// a field write under RTNL), for [`Netlink::delete_group`].
    ///
    /// # Errors
    /// The kernel refused (`ENODEV`: the interface is gone).
    pub fn set_group(&self, index: u32, group: u32) -> Result<(), NetlinkError> {
        let mut msg = LinkUnspec::new_with_index(index).build();
        msg.attributes.push(LinkAttribute::Group(group));
        let handle = self.handle.clone();
        self.rt
            .block_on(async move { handle.link().set(msg).execute().await })
            .map_err(req(format!("set link {index} group {group}")))
    }

    /// Deletes every interface of group `group` in one request: the kernel
    /// unregisters them as one batch (`unregister_netdevice_many`), so they
    /// share its RCU grace periods instead of paying one each (a veth takes
    /// its peer with it). No interface in the group is success.
    ///
    /// # Errors
    /// The kernel refused (`EOPNOTSUPP`: an interface in the group cannot be
    /// deleted).
    pub fn delete_group(&self, group: u32) -> Result<(), NetlinkError> {
        let handle = self.handle.clone();
        let mut del = handle.link().del(0);
        del.message_mut()
            .attributes
            .push(LinkAttribute::Group(group));
        match self.rt.block_on(async move { del.execute().await }) {
            Ok(()) => Ok(()),
            Err(rtnetlink::Error::NetlinkError(m))
                if m.code.map(|c| -c.get()) == Some(libc::ENODEV) =>
            {
                Ok(())
            }
            Err(e) => Err(req(format!("delete link group {group}"))(e)),
        }
    }

    /// Addresses of interface `index`.
    ///
    /// # Errors
    /// The request failed.
    pub fn addresses(&self, index: u32) -> Result<Vec<IpNet>, NetlinkError> {
        let handle = self.handle.clone();
        let msgs: Vec<_> = self
            .rt
            .block_on(async move {
                handle
                    .address()
                    .get()
                    .set_link_index_filter(index)
                    .execute()
                    .try_collect::<Vec<_>>()
                    .await
            })
            .map_err(req(format!("list addresses of link {index}")))?;
        Ok(msgs
            .iter()
            .filter_map(|m| {
                m.attributes.iter().find_map(|a| match a {
                    AddressAttribute::Address(ip) => IpNet::new(*ip, m.header.prefix_len).ok(),
                    _ => None,
                })
            })
            .collect())
    }

    /// Destinations of the routes out of interface `oif` (main table).
    ///
    /// # Errors
    /// The request failed.
    pub fn routes(&self, oif: u32) -> Result<Vec<IpNet>, NetlinkError> {
        let mut out = Vec::new();
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
                let on_oif = m
                    .attributes
                    .iter()
                    .any(|a| matches!(a, RouteAttribute::Oif(i) if *i == oif));
                if !on_oif {
                    continue;
                }
                let dst = m.attributes.iter().find_map(|a| match a {
                    RouteAttribute::Destination(d) => route_addr(d),
                    _ => None,
                });
                let zero: IpAddr = if v6 {
                    std::net::Ipv6Addr::UNSPECIFIED.into()
                } else {
                    std::net::Ipv4Addr::UNSPECIFIED.into()
                };
                if let Ok(net) = IpNet::new(dst.unwrap_or(zero), m.header.destination_prefix_length)
                {
                    out.push(net);
                }
            }
        }
        Ok(out)
    }

    /// Makes every change of `steps`: all requests are sent before the
    /// first answer is awaited (the kernel handles one socket's requests in
    /// order), so a dozen changes cost one wait instead of a dozen. Every
    /// answer is collected; the first failure in `steps` order is returned.
    ///
    /// # Errors
    /// The kernel refused a step, or a step is malformed (family mismatch).
    pub fn apply(&self, steps: &[Step]) -> Result<(), NetlinkError> {
        let requests = steps
            .iter()
            .map(|step| self.request(step))
            .collect::<Result<Vec<_>, _>>()?;
        self.rt
            .block_on(futures::future::join_all(requests))
            .into_iter()
            .collect()
    }

    fn request(&self, step: &Step) -> Result<StepFuture, NetlinkError> {
        let handle = self.handle.clone();
        Ok(match *step {
            Step::NoLinkLocal(index) => {
                use netlink_packet_route::link::{AfSpecInet6, AfSpecUnspec};
                /// `IN6_ADDR_GEN_MODE_NONE`.
                const ADDR_GEN_MODE_NONE: u8 = 1;
                let msg = LinkUnspec::new_with_index(index)
                    .append_extra_attribute(LinkAttribute::AfSpecUnspec(vec![AfSpecUnspec::Inet6(
                        vec![AfSpecInet6::AddrGenMode(ADDR_GEN_MODE_NONE)],
                    )]))
                    .build();
                Box::pin(async move {
                    handle
                        .link()
                        .set(msg)
                        .execute()
                        .await
                        .map_err(req(format!("set link {index} addr_gen_mode none")))
                })
            }
            Step::Up(index) => {
                let msg = LinkUnspec::new_with_index(index).up().build();
                Box::pin(async move {
                    handle
                        .link()
                        .set(msg)
                        .execute()
                        .await
                        .map_err(req(format!("set link {index} up")))
                })
            }
            Step::Address {
                index,
                address,
                prefix_len,
            } => Box::pin(async move {
                let mut add = handle.address().add(index, address, prefix_len).replace();
                if address.is_ipv6() {
                    add.message_mut().attributes.push(AddressAttribute::Flags(
                        netlink_packet_route::address::AddressFlags::Nodad,
                    ));
                }
                add.execute().await.map_err(req(format!(
                    "add address {address}/{prefix_len} to link {index}"
                )))
            }),
            Step::Neighbour { index, ip, mac } => Box::pin(async move {
                handle
                    .neighbours()
                    .add(index, ip)
                    .link_local_address(&mac)
                    .state(NeighbourState::Permanent)
                    .replace()
                    .execute()
                    .await
                    .map_err(req(format!("add neighbour {ip} on link {index}")))
            }),
            Step::Route { dst, gateway, oif } => {
                let mut b = RouteMessageBuilder::<IpAddr>::new()
                    .destination_prefix(dst.addr(), dst.prefix_len())
                    .map_err(invalid)?
                    .output_interface(oif);
                b = match gateway {
                    Some(gw) => b.gateway(gw).map_err(invalid)?,
                    None => b.scope(RouteScope::Link),
                };
                let msg = b.build();
                Box::pin(async move {
                    handle
                        .route()
                        .add(msg)
                        .replace()
                        .execute()
                        .await
                        .map_err(req(format!("add route {dst} via {gateway:?} dev {oif}")))
                })
            }
        })
    }
}

/// rtnetlink does not export its route-builder error type; keep its text.
fn invalid<E: std::fmt::Debug>(e: E) -> NetlinkError {
    NetlinkError::Invalid {
        reason: format!("{e:?}"),
    }
}

fn route_addr(a: &netlink_packet_route::route::RouteAddress) -> Option<IpAddr> {
    match a {
        netlink_packet_route::route::RouteAddress::Inet(v4) => Some((*v4).into()),
        netlink_packet_route::route::RouteAddress::Inet6(v6) => Some((*v6).into()),
        _ => None,
    }
}
