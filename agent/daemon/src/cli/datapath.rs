//! `lockstep datapath ...`: low-level tooling on the pinned maps and links
//! (install, program an endpoint, announce, counters, uninstall), and the
//! interface MAC helpers it needs.
//!
//! Kept apart from the dispatcher because these commands do not talk to the
//! agent: they open the pins themselves and work whether or not it runs.

use std::net::{Ipv4Addr, Ipv6Addr};

use anyhow::Context;
use clap::{Args, Subcommand, ValueEnum};
use lockstep_common::{
    EndpointValue, IpcacheValue, L2RespValue, MasqSkipValue, endpoint_flags, identity,
    ipcache_flags, masq_reason, program_names,
};
use serde_json::json;

use super::{Output, PinArgs};
use crate::datapath::maps::{v4_key, v6_key};
use crate::datapath::{
    AttachMode, Datapath, DatapathOptions, Hook, MapCapacities, PinnedMaps, ifindex_of,
};

/// How to attach.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum AttachModeArg {
    /// TCX, netlink if the kernel lacks TCX.
    #[default]
    Auto,
    /// TCX only.
    Tcx,
    /// Netlink (clsact) only.
    Netlink,
}

/// Options of commands that load the object.
#[derive(Debug, Args)]
pub struct LoadArgs {
    /// Shared options.
    #[command(flatten)]
    pins: PinArgs,
    /// Replace pinned maps whose definition differs from this build's.
    #[arg(long)]
    migrate: bool,
    /// How to attach programs.
    #[arg(long, value_enum, default_value_t)]
    attach_mode: AttachModeArg,
    /// Capacity of IPCACHE_V4 and IPCACHE_V6.
    #[arg(long)]
    ipcache_max_entries: Option<u32>,
}

impl LoadArgs {
    fn open(&self) -> anyhow::Result<Datapath> {
        let mut opts = DatapathOptions::new(&self.pins.pin_root);
        opts.migrate = self.migrate;
        opts.attach_mode = match self.attach_mode {
            AttachModeArg::Auto => AttachMode::Auto,
            AttachModeArg::Tcx => AttachMode::Tcx,
            AttachModeArg::Netlink => AttachMode::Netlink,
        };
        if let Some(n) = self.ipcache_max_entries {
            opts.capacities = MapCapacities {
                ipcache: n,
                ..opts.capacities
            };
        }
        let dp = Datapath::open(opts)?;
        for name in dp.migrated() {
            eprintln!("migrated pinned map {name}");
        }
        Ok(dp)
    }
}

/// `lockstep datapath ...`.
#[derive(Debug, Subcommand)]
pub enum DatapathCommand {
    /// Load the programs, pin the maps, attach to_native and from_native to
    /// the uplink. Re-running replaces the programs in place.
    Install {
        /// Shared options.
        #[command(flatten)]
        load: LoadArgs,
        /// The node's uplink interface.
        #[arg(long)]
        uplink: Option<String>,
    },
    /// Program an endpoint (ENDPOINTS + IPCACHE) and attach from_endpoint to its
    /// host-side interface.
    Endpoint {
        /// Shared options.
        #[command(flatten)]
        load: LoadArgs,
        /// Host-side interface of the endpoint.
        #[arg(long)]
        iface: String,
        /// The endpoint's IPv4 address.
        #[arg(long)]
        ipv4: Option<Ipv4Addr>,
        /// The endpoint's IPv6 address.
        #[arg(long)]
        ipv6: Option<Ipv6Addr>,
        /// Generation of the allocation.
        #[arg(long, default_value_t = 1)]
        generation: u64,
        /// MAC of the endpoint's interface inside its namespace, the only
        /// Ethernet source its IPv4 and IPv6 frames may carry
        /// (`aa:bb:cc:dd:ee:ff`; without it the MAC is not checked).
        #[arg(long, value_parser = mac_arg)]
        mac: Option<[u8; 6]>,
    },
    /// Remove an endpoint's ENDPOINTS entry (and its slot); the program stays
    /// attached and now drops everything from the interface.
    EndpointDel {
        /// Shared options.
        #[command(flatten)]
        pins: PinArgs,
        /// Host-side interface of the endpoint.
        #[arg(long)]
        iface: String,
    },
    /// Switch rare datapath events (spoofed packets dropped, ARP requests
    /// answered) in the running agent's log on or off, or show the switch.
    Debug {
        /// Shared options.
        #[command(flatten)]
        pins: PinArgs,
        /// `on`, `off` or `status`.
        #[arg(value_parser = ["on", "off", "status"])]
        state: String,
    },
    /// Announce an IPv4 address on an interface (L2_RESP_V4).
    L2Add {
        /// Shared options.
        #[command(flatten)]
        pins: PinArgs,
        /// The address.
        #[arg(long)]
        ip: Ipv4Addr,
        /// The announcing interface (its MAC answers).
        #[arg(long)]
        iface: String,
    },
    /// Stop announcing an IPv4 address.
    L2Del {
        /// Shared options.
        #[command(flatten)]
        pins: PinArgs,
        /// The address.
        #[arg(long)]
        ip: Ipv4Addr,
    },
    /// Add an IPCACHE entry (host entries go to the host hash, prefixes to the
    /// trie).
    IpcacheAdd {
        /// Shared options.
        #[command(flatten)]
        pins: PinArgs,
        /// The prefix.
        #[arg(long)]
        prefix: ipnet::IpNet,
        /// Security identity.
        #[arg(long, default_value_t = identity::WORLD)]
        identity: u32,
        /// Mark the prefix as living on another node.
        #[arg(long)]
        remote: bool,
    },
    /// Skip masquerading towards a CIDR (MASQ_SKIP_V4 / MASQ_SKIP_V6, reason
    /// "configured").
    MasqSkipAdd {
        /// Shared options.
        #[command(flatten)]
        pins: PinArgs,
        /// The CIDR.
        #[arg(long)]
        cidr: ipnet::IpNet,
    },
    /// Print the per-program counters, summed over CPUs.
    Counters {
        /// Shared options.
        #[command(flatten)]
        pins: PinArgs,
        /// Output format.
        #[arg(long, short, value_enum, default_value_t)]
        output: Output,
    },
    /// Detach everything and remove every pin.
    Uninstall {
        /// Shared options.
        #[command(flatten)]
        pins: PinArgs,
        /// Interfaces with netlink (non-pinned) attachments to clean.
        #[arg(long)]
        iface: Vec<String>,
    },
}

/// [`parse_mac`] for clap.
fn mac_arg(text: &str) -> Result<[u8; 6], String> {
    parse_mac(text)
        .ok_or_else(|| format!("{text:?} is not a MAC address (expected aa:bb:cc:dd:ee:ff)"))
}

/// Runs a `lockstep datapath` command.
pub(super) fn run(cmd: DatapathCommand) -> anyhow::Result<i32> {
    match cmd {
        DatapathCommand::Install { load, uplink } => {
            let mut dp = load.open()?;
            if let Some(uplink) = uplink {
                let a = dp.attach(program_names::TO_NATIVE, &uplink, Hook::Egress)?;
                let b = dp.attach(program_names::FROM_NATIVE, &uplink, Hook::Ingress)?;
                println!(
                    "to_native on {uplink} egress: {a:?}; from_native on {uplink} ingress: {b:?}"
                );
            }
            Ok(0)
        }
        DatapathCommand::Endpoint {
            load,
            iface,
            ipv4,
            ipv6,
            generation,
            mac,
        } => {
            let mut dp = load.open()?;
            let ifindex = ifindex_of(&iface)?;
            let mut maps = dp.maps()?;
            let mut value = EndpointValue {
                generation,
                mac: mac.unwrap_or_default(),
                ..Default::default()
            };
            let ipcache = IpcacheValue {
                identity: identity::ENDPOINT,
                flags: ipcache_flags::ENDPOINT,
                ifindex,
                ..Default::default()
            };
            if let Some(v4) = ipv4 {
                value.ipv4 = v4.octets();
                value.flags |= endpoint_flags::HAS_V4;
                maps.ipcache_insert(std::net::IpAddr::V4(v4).into(), ipcache)?;
            }
            if let Some(v6) = ipv6 {
                value.ipv6 = v6.octets();
                value.flags |= endpoint_flags::HAS_V6;
                maps.ipcache_insert(std::net::IpAddr::V6(v6).into(), ipcache)?;
            }
            maps.endpoint_insert(ifindex, &value)?;
            let how = dp.attach(program_names::FROM_ENDPOINT, &iface, Hook::Ingress)?;
            println!("from_endpoint on {iface} ingress: {how:?}");
            Ok(0)
        }
        DatapathCommand::Debug { pins, state } => {
            use crate::datapath::events;
            if state != "status" {
                events::set_events(&pins.pin_root, state == "on")?;
            }
            let on = events::events_on(&pins.pin_root)?;
            println!("datapath events: {}", if on { "on" } else { "off" });
            Ok(0)
        }
        DatapathCommand::EndpointDel { pins, iface } => {
            let mut maps = PinnedMaps::open(&pins.pin_root)?;
            maps.endpoint_remove(ifindex_of(&iface)?)?;
            Ok(0)
        }
        DatapathCommand::L2Add { pins, ip, iface } => {
            let mut maps = PinnedMaps::open(&pins.pin_root)?;
            let value = L2RespValue {
                ifindex: ifindex_of(&iface)?,
                mac: mac_of(&iface).with_context(|| format!("reading the MAC of {iface}"))?,
                ..Default::default()
            };
            maps.l2_insert(ip.octets(), &value)?;
            Ok(0)
        }
        DatapathCommand::L2Del { pins, ip } => {
            let mut maps = PinnedMaps::open(&pins.pin_root)?;
            maps.l2_remove(ip.octets())?;
            Ok(0)
        }
        DatapathCommand::IpcacheAdd {
            pins,
            prefix,
            identity,
            remote,
        } => {
            let mut maps = PinnedMaps::open(&pins.pin_root)?;
            let value = IpcacheValue {
                identity,
                flags: if remote { ipcache_flags::REMOTE } else { 0 },
                ..Default::default()
            };
            maps.ipcache_insert(prefix, value)?;
            Ok(0)
        }
        DatapathCommand::MasqSkipAdd { pins, cidr } => {
            let mut maps = PinnedMaps::open(&pins.pin_root)?;
            let value = MasqSkipValue {
                reason: masq_reason::CONFIG,
                pool_id: 0,
            };
            match cidr.trunc() {
                ipnet::IpNet::V4(n) => maps.masq_skip_v4_mut().insert(
                    &v4_key(n.network(), n.prefix_len()),
                    value,
                    0,
                )?,
                ipnet::IpNet::V6(n) => maps.masq_skip_v6_mut().insert(
                    &v6_key(n.network(), n.prefix_len()),
                    value,
                    0,
                )?,
            }
            Ok(0)
        }
        DatapathCommand::Counters { pins, output } => {
            let maps = PinnedMaps::open(&pins.pin_root)?;
            let counters = maps.counters()?;
            match output {
                Output::Json | Output::Yaml => {
                    let obj: serde_json::Map<String, serde_json::Value> = counters
                        .iter()
                        .map(|(c, v)| (c.name().to_string(), json!(v)))
                        .collect();
                    super::print(&serde_json::Value::Object(obj), output, |_| String::new());
                }
                Output::Text => {
                    for (c, v) in counters {
                        println!("{:<22} {v}", c.name());
                    }
                }
            }
            Ok(0)
        }
        DatapathCommand::Uninstall { pins, iface } => {
            let removed = Datapath::uninstall(&pins.pin_root, &iface)?;
            println!("removed {removed} pins under {}", pins.pin_root.display());
            Ok(0)
        }
    }
}

/// The hardware address of `iface` in the current network namespace.
///
/// # Errors
/// The interface does not exist or has no Ethernet address.
pub fn mac_of(iface: &str) -> std::io::Result<[u8; 6]> {
    if iface.len() >= libc::IFNAMSIZ {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("interface name {iface} is too long"),
        ));
    }
    // SAFETY: plain socket call.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and is owned here.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    // SAFETY: `ifreq` is plain data.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(iface.bytes()) {
        *dst = src as libc::c_char;
    }
    // SAFETY: SIOCGIFHWADDR fills `req.ifr_ifru` for a valid name.
    let rc = unsafe {
        libc::ioctl(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            // The request type differs between libcs (glibc: c_ulong, musl: c_int).
            libc::SIOCGIFHWADDR as libc::Ioctl,
            &mut req,
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel filled the hwaddr member.
    let data = unsafe { req.ifr_ifru.ifru_hwaddr.sa_data };
    Ok(std::array::from_fn(|i| data[i] as u8))
}

/// Parses `aa:bb:cc:dd:ee:ff`.
pub fn parse_mac(text: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = text.split(':');
    for byte in &mut mac {
        *byte = u8::from_str_radix(parts.next()?, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}

pub(super) fn fmt_mac(mac: &[u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mac_round_trip() {
        let mac = parse_mac("02:ab:cd:00:11:ff").expect("valid");
        assert_eq!(mac, [0x02, 0xab, 0xcd, 0x00, 0x11, 0xff]);
        assert_eq!(fmt_mac(&mac), "02:ab:cd:00:11:ff");
        assert_eq!(parse_mac("02:ab:cd:00:11"), None);
        assert_eq!(parse_mac("02:ab:cd:00:11:ff:00"), None);
        assert_eq!(parse_mac("zz:ab:cd:00:11:ff"), None);
    }
}
