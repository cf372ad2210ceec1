//! The host and container interfaces of an endpoint: stable names, making
//! the veth pair with its addresses, routes and neighbours (outside the agent
//! lock), and removing them on DEL or after a half-done ADD.
//!
//! It exists apart from ADD and DEL so that the kernel-facing interface work
//! (netlink, namespaces) is in one place and the lockstep order in the parent.

use super::*;

/// A stable, short host-side interface name for an attachment (`lxc` + 12
/// hex digits of an FNV-1a hash), so a retried ADD finds a half-made veth.
pub fn host_ifname(container_id: &str, ifname: &str) -> String {
    format!("lxc{:012x}", fnv1a(container_id, ifname) & 0xffff_ffff_ffff)
}

pub(super) fn temp_ifname(container_id: &str, ifname: &str) -> String {
    format!("tmp{:012x}", fnv1a(container_id, ifname) & 0xffff_ffff_ffff)
}

pub(super) fn fnv1a(a: &str, b: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in a.bytes().chain([0u8]).chain(b.bytes()) {
        h ^= u64::from(byte);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The interfaces ADD made (full mode).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Interfaces {
    /// Host-side veth.
    pub host_ifname: String,
    /// Its index.
    pub host_ifindex: u32,
    /// Its MAC.
    pub host_mac: [u8; 6],
    /// MAC of the container side.
    pub mac: [u8; 6],
}

/// Why making the interfaces failed, and what to undo.
#[derive(Debug)]
pub struct InterfaceFailure {
    /// The error.
    pub error: AgentError,
    /// The host-side veth, if it was created.
    pub host_ifindex: Option<u32>,
}

/// The host interfaces through the kernel: an ADD's undo detaches the
/// endpoint program and deletes the veth ([`DelCleanup::run`]).
pub(super) struct KernelLinks {
    pub(super) attach: Option<ProgramPin>,
}

impl LinkDoor for KernelLinks {
    fn remove_host(&mut self, name: &str, ifindex: u32) -> Result<(), AgentError> {
        DelCleanup {
            host: Some((name.to_string(), ifindex)),
            attach: self.attach.clone(),
            orphan: None,
            orphan_guard: None,
            gone: None,
            plugin: None,
        }
        .run()
    }
}

/// Kernel work left after DEL committed: detach the program, delete the veth.
#[derive(Debug, Default)]
pub struct DelCleanup {
    pub(super) host: Option<(String, u32)>,
    pub(super) attach: Option<ProgramPin>,
    /// A DEL that found no record: what a half-done ADD of this attachment
    /// (container id, ifname) may have made, found by its names.
    pub(super) orphan: Option<(String, String)>,
    /// Keeps an ADD of that attachment waiting until the removal is done.
    pub(super) orphan_guard: Option<crate::agent::reaper::OrphanGuard>,
    /// A full attachment whose veth the reaper deletes: the DEL is answered
    /// once it is gone (the container no longer sees its interface).
    pub(super) gone: Option<crate::agent::reaper::GoneWait>,
    /// Delegated mode: the plugin's DEL, to run with the agent free, then
    /// [`Agent::endpoint_del_delegated`]; nothing is committed before.
    pub plugin: Option<crate::agent::delegated::DelegatedDel>,
}

impl DelCleanup {
    /// Whether there is no kernel work to do.
    pub fn is_empty(&self) -> bool {
        self.host.is_none() && self.orphan.is_none() && self.gone.is_none() && self.plugin.is_none()
    }

    /// Runs it (off the agent's owner; both steps wait on the kernel).
    /// Already gone is fine. Both steps are tried whatever the other did.
    ///
    /// # Errors
    /// Every step that failed. The allocation is released already; a DEL
    /// the runtime retries finds no record and removes the veth and link by
    /// their names (see [`Agent::endpoint_del_begin`]).
    pub fn run(self) -> Result<(), AgentError> {
        if let Some(plugin) = &self.plugin {
            // Its caller runs the plugin and commits first
            // ([`Agent::endpoint_del_delegated`]).
            return Err(AgentError::Invalid {
                reason: format!(
                    "the plugin's DEL of {plugin:?} was not run before the kernel work"
                ),
            });
        }
        if let Some(gone) = &self.gone {
            return gone.wait();
        }
        if let Some((container_id, ifname)) = &self.orphan {
            let removed = remove_leftovers(
                &[
                    host_ifname(container_id, ifname),
                    temp_ifname(container_id, ifname),
                ],
                self.attach.as_ref(),
            );
            // Done: an ADD of the attachment may go on.
            drop(self.orphan_guard);
            return removed;
        }
        let Some((name, index)) = self.host else {
            return Ok(());
        };
        let mut errors = Vec::new();
        if let Some(pin) = &self.attach
            && let Err(e) = pin.detach_index(index, Hook::Ingress)
        {
            tracing::warn!(error = %e, iface = %name, "detaching from_endpoint failed");
            errors.push(e.into());
        }
        if let Err(e) = Netlink::current().and_then(|h| match h.link(&name)? {
            Some(l) if l.index == index => h.delete_link(index),
            _ => Ok(()),
        }) {
            tracing::warn!(error = %e, iface = %name, "deleting the veth failed");
            errors.push(e.into());
        }
        AgentError::all(errors)
    }
}

/// Detaches `from_endpoint` from, and deletes, the host interfaces named
/// `names` that exist: what a half-done ADD leaves (the veth and the
/// program's pinned link are made before the commit). Every name is tried.
///
/// # Errors
/// Every step that failed.
pub(super) fn remove_leftovers(
    names: &[String],
    attach: Option<&ProgramPin>,
) -> Result<(), AgentError> {
    let host = Netlink::current()?;
    let mut errors = Vec::new();
    for name in names {
        match host.link(name) {
            Ok(Some(l)) => {
                tracing::info!(iface = %name, "removing what a half-done ADD left");
                if let Some(pin) = attach
                    && let Err(e) = pin.detach_index(l.index, Hook::Ingress)
                {
                    errors.push(e.into());
                }
                if let Err(e) = host.delete_link(l.index) {
                    errors.push(e.into());
                }
            }
            Ok(None) => {}
            Err(e) => errors.push(e.into()),
        }
    }
    AgentError::all(errors)
}

/// Whether `name` is a host-side interface name this agent makes
/// ([`host_ifname`], or the temporary name): a prefix and 12 lowercase hex
/// digits.
pub(super) fn is_agent_ifname(name: &str) -> bool {
    ["lxc", "tmp"].iter().any(|p| {
        name.strip_prefix(p).is_some_and(|hex| {
            hex.len() == 12
                && hex
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        })
    })
}

/// Makes the veth pair (the peer created directly in the container's
/// namespace), addresses, routes and gateway neighbours, and attaches
/// `from_endpoint`. Runs off the agent's owner: every step is a kernel call
/// on interfaces no one else knows about yet.
///
/// The container side runs on a thread of its own that enters the
/// container's namespace and waits for the peer's index, while this thread
/// creates the pair, then adds the host routes and attaches: the two sides'
/// kernel work overlaps, and each side's changes go out as one batch.
///
/// # Errors
/// The first failing step, with the host veth to delete if it was made.
pub fn build_interfaces(
    req: &EndpointRequest,
    addresses: &[IpAddr],
    attach: Option<&ProgramPin>,
) -> Result<Interfaces, InterfaceFailure> {
    let mut made: Option<u32> = None;
    let result = open_netns(&req.netns)
        .map_err(AgentError::from)
        .and_then(|netns_fd| {
            std::thread::scope(|s| {
                let (tx, rx) = std::sync::mpsc::channel::<Vec<Step>>();
                let fd = &netns_fd;
                let inside = s.spawn(move || -> Result<(), AgentError> {
                    let netlink = Netlink::enter(fd, &req.netns)?;
                    // No steps: the host side failed before sending any.
                    match rx.recv() {
                        Ok(steps) => Ok(netlink.apply(&steps)?),
                        Err(_) => Ok(()),
                    }
                });
                let host = (|| {
                    let host_name = host_ifname(&req.container_id, &req.ifname);
                    let host = Netlink::current()?;
                    let peer_mac = random_mac()?;
                    let veth = make_veth(&host, req, &host_name, fd, peer_mac)?;
                    made = Some(veth.host.index);
                    let (inside_steps, host_steps) = endpoint_steps(addresses, &veth, peer_mac);
                    // A send fails only if the thread is gone; its join says why.
                    let _ = tx.send(inside_steps);
                    host.apply(&host_steps)?;
                    if let Some(pin) = attach {
                        pin.attach(&host_name, Hook::Ingress)?;
                    }
                    Ok(Interfaces {
                        host_ifname: host_name,
                        host_ifindex: veth.host.index,
                        host_mac: veth.host.mac,
                        mac: peer_mac,
                    })
                })();
                drop(tx);
                let inside = inside
                    .join()
                    .unwrap_or_else(|_| Err(invalid("the container namespace thread panicked")));
                // The host side's error first: it is the cause when both failed.
                host.and_then(|i| inside.map(|()| i))
            })
        });
    result.map_err(|error| InterfaceFailure {
        error,
        host_ifindex: made,
    })
}

/// Creates the pair, host end up. A name already taken is either the
/// container's interface (refused) or the leftovers of an ADD that crashed
/// half-way (deleted, and the pair made again): looked up only then, so a
/// normal ADD pays no lookup.
pub(super) fn make_veth(
    host: &Netlink,
    req: &EndpointRequest,
    host_name: &str,
    netns_fd: &std::os::fd::OwnedFd,
    peer_mac: [u8; 6],
) -> Result<CreatedVeth, AgentError> {
    match host.create_veth_into(host_name, &req.ifname, netns_fd, req.mtu, peer_mac) {
        Err(e) if e.errno() == Some(libc::EEXIST) => {
            if Netlink::in_netns(&req.netns)?.link(&req.ifname)?.is_some() {
                return Err(invalid(format!(
                    "interface {} already exists in {}",
                    req.ifname,
                    req.netns.display()
                )));
            }
            for stale in [host_name, &temp_ifname(&req.container_id, &req.ifname)] {
                if let Some(l) = host.link(stale)? {
                    host.delete_link(l.index)?;
                }
            }
            Ok(host.create_veth_into(host_name, &req.ifname, netns_fd, req.mtu, peer_mac)?)
        }
        r => Ok(r?),
    }
}

/// The container side's changes (peer and `lo` up, each address with its
/// gateway neighbour and default route) and the host side's (a route and a
/// neighbour per address). The gateway resolves to the host side
/// statically: no ARP/NDP round trip before the first packet, and nothing
/// to spoof.
pub(super) fn endpoint_steps(
    addresses: &[IpAddr],
    veth: &CreatedVeth,
    peer_mac: [u8; 6],
) -> (Vec<Step>, Vec<Step>) {
    let peer = veth.peer_index;
    // `lo` is interface 1 in every namespace (LOOPBACK_IFINDEX).
    let mut inside = vec![Step::Up(peer), Step::Up(1)];
    // The host side only forwards: no link-local address, then up.
    let mut host = vec![
        Step::NoLinkLocal(veth.host.index),
        Step::Up(veth.host.index),
    ];
    for addr in addresses {
        let (prefix_len, gw, any): (u8, IpAddr, IpNet) = match addr {
            IpAddr::V4(_) => (32, GATEWAY_V4.into(), IpNet::V4(Default::default())),
            IpAddr::V6(_) => (128, GATEWAY_V6.into(), IpNet::V6(Default::default())),
        };
        inside.push(Step::Address {
            index: peer,
            address: *addr,
            prefix_len,
        });
        inside.push(Step::Neighbour {
            index: peer,
            ip: gw,
            mac: veth.host.mac,
        });
        if addr.is_ipv4() {
            inside.push(Step::Route {
                dst: IpNet::from(gw),
                gateway: None,
                oif: peer,
            });
        }
        inside.push(Step::Route {
            dst: any,
            gateway: Some(gw),
            oif: peer,
        });
        host.push(Step::Route {
            dst: IpNet::from(*addr),
            gateway: None,
            oif: veth.host.index,
        });
        host.push(Step::Neighbour {
            index: veth.host.index,
            ip: *addr,
            mac: peer_mac,
        });
    }
    (inside, host)
}

/// A random, locally administered, unicast hardware address for the
/// container end, chosen before the pair exists so the host side's
/// neighbour entry needs no lookup.
pub(super) fn random_mac() -> Result<[u8; 6], AgentError> {
    let mut mac = [0u8; 6];
    // SAFETY: writes at most `mac.len()` bytes into `mac`.
    let n = unsafe { libc::getrandom(mac.as_mut_ptr().cast(), mac.len(), 0) };
    if usize::try_from(n).ok() != Some(mac.len()) {
        return Err(invalid(format!(
            "no random bytes for a MAC address: {}",
            std::io::Error::last_os_error()
        )));
    }
    mac[0] = (mac[0] & 0xfe) | 0x02;
    Ok(mac)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::endpoint_effects::endpoint_value;

    #[test]
    fn host_names_are_stable_short_and_distinct() {
        let a = host_ifname("abc", "eth0");
        assert_eq!(a, host_ifname("abc", "eth0"));
        assert!(a.len() <= 15, "{a}");
        assert_ne!(a, host_ifname("abc", "eth1"));
        assert_ne!(a, host_ifname("abd", "eth0"));
        assert!(is_agent_ifname(&a) && is_agent_ifname(&temp_ifname("abc", "eth0")));
        assert!(!is_agent_ifname("lxc0123456789ab0") && !is_agent_ifname("lxcABCDEF012345"));
        assert!(!is_agent_ifname("eth0") && !is_agent_ifname("lxc"));
        // The separator keeps ("ab","ceth0") and ("abc","eth0") apart.
        assert_ne!(host_ifname("ab", "ceth0"), host_ifname("abc", "eth0"));
        assert_ne!(a, temp_ifname("abc", "eth0"));
    }

    #[test]
    fn endpoint_steps_route_each_family_through_the_static_gateway() {
        let veth = CreatedVeth {
            host: crate::netlink::Link {
                index: 7,
                name: "lxc".into(),
                mac: [2, 0, 0, 0, 0, 7],
                up: true,
                carrier: true,
            },
            peer_index: 3,
        };
        let peer_mac = [2, 0, 0, 0, 0, 3];
        let v4: IpAddr = "10.0.0.2".parse().expect("v4");
        let v6: IpAddr = "fd00::2".parse().expect("v6");
        let (inside, host) = endpoint_steps(&[v4, v6], &veth, peer_mac);
        let route = |dst: &str, gateway: Option<IpAddr>, oif| Step::Route {
            dst: dst.parse().expect("net"),
            gateway,
            oif,
        };
        let gw4 = IpAddr::from(GATEWAY_V4);
        let gw6 = IpAddr::from(GATEWAY_V6);
        assert_eq!(
            inside,
            vec![
                Step::Up(3),
                Step::Up(1),
                Step::Address {
                    index: 3,
                    address: v4,
                    prefix_len: 32
                },
                Step::Neighbour {
                    index: 3,
                    ip: gw4,
                    mac: veth.host.mac
                },
                route("169.254.1.1/32", None, 3),
                route("0.0.0.0/0", Some(gw4), 3),
                Step::Address {
                    index: 3,
                    address: v6,
                    prefix_len: 128
                },
                Step::Neighbour {
                    index: 3,
                    ip: gw6,
                    mac: veth.host.mac
                },
                route("::/0", Some(gw6), 3),
            ]
        );
        assert_eq!(
            host,
            vec![
                Step::NoLinkLocal(7),
                Step::Up(7),
                route("10.0.0.2/32", None, 7),
                Step::Neighbour {
                    index: 7,
                    ip: v4,
                    mac: peer_mac
                },
                route("fd00::2/128", None, 7),
                Step::Neighbour {
                    index: 7,
                    ip: v6,
                    mac: peer_mac
                },
            ]
        );
    }

    #[test]
    fn random_macs_are_unicast_local_and_differ() {
        let (a, b) = (random_mac().expect("mac"), random_mac().expect("mac"));
        assert_ne!(a, b);
        for m in [a, b] {
            assert_eq!(m[0] & 0x03, 0x02, "{m:?}");
        }
    }

    #[test]
    fn endpoint_value_carries_both_families() {
        let r = EndpointRecord {
            container_id: "c".into(),
            ifname: "eth0".into(),
            netns: "/x".into(),
            mode: EndpointMode::Full,
            pool: "p".into(),
            addresses: vec![
                "10.0.0.2".parse().expect("v4"),
                "fd00::2".parse().expect("v6"),
            ],
            host_ifname: Some("lxc".into()),
            host_ifindex: 7,
            host_mac: [0; 6],
            mac: [2, 0, 0, 0, 0, 1],
            releasing: false,
            pod: None,
        };
        let v = endpoint_value(&r, 9);
        assert_eq!(
            v.flags,
            lockstep_common::endpoint_flags::HAS_V4 | lockstep_common::endpoint_flags::HAS_V6
        );
        assert_eq!(v.ipv4, [10, 0, 0, 2]);
        assert_eq!(v.generation, 9);
        assert_eq!(v.mac, [2, 0, 0, 0, 0, 1]);
    }
}
