//! BGP, decided: what lockstep asks its routing daemon to announce, to
//! which peers and how, written as the daemon's whole configuration.
//!
//! lockstep speaks BGP through BIRD 2 (#48): no BGP speaker on crates.io
//! is fit for production, and BIRD is what operators already run beside
//! Calico. The agent decides; BIRD speaks. This module turns a
//! [`BgpSpec`] (the local AS, the peers) and the prefixes to announce
//! into BIRD's configuration text ([`render_bird`]), which the agent
//! applies with BIRD's own `configure`:
//!
//! - **Announcements are static routes** of two static protocols (one
//!   per family), exported to every peer of that family through one
//!   filter. Pod blocks are static routes of two protocols of their own
//!   ([`BLOCK_PROTOCOLS`]): `lockstep bird-keeper` takes the
//!   LoadBalancer protocols down when the agent dies and leaves the
//!   blocks announced, since the node still holds them and its pods
//!   still run. BIRD reconfigures a static protocol route by route, and a
//!   BGP protocol whose text did not change is left running: a change of
//!   announcements never resets a session, and a change to one peer
//!   resets that peer only (the text of each block depends only on its
//!   own settings: [`render_bird`] keeps it so).
//! - **Nothing is imported and nothing reaches the kernel**: peers'
//!   routes are refused (`import none`) and there is no kernel protocol.
//!   The BPF datapath stays the only forwarder; an announced route is a
//!   blackhole in BIRD's own table.
//! - **BFD** to every peer that asks for it (single hop, the intervals
//!   of [`BfdSpec`]): a dead link or node is withdrawn at the peer in
//!   interval × multiplier, not at the hold timer.
//! - **Graceful restart** on every session, so a planned restart of the
//!   daemon keeps the peer's routes for the restart time.
//! - **Back again soon, damped when flapping**: a session that failed is
//!   tried again after a second, then ever later (to a minute) while it
//!   keeps failing.
//!
//! Every input is checked before any text is made: a spec that BIRD
//! would refuse, or that would announce something else than asked, is an
//! error naming the field.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr};

use ipnet::IpNet;

pub mod announce;
pub mod keeper;
pub mod peers;
pub mod session;

/// Why a BGP spec cannot be written.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BgpError {
    /// A field of the spec is out of range or malformed.
    #[error("bgp.{field}: {reason}")]
    Invalid {
        /// The field, as the config names it.
        field: String,
        /// What is wrong with it.
        reason: String,
    },
}

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> BgpError {
    BgpError::Invalid {
        field: field.into(),
        reason: reason.into(),
    }
}

/// Bidirectional forwarding detection, for every peer that enables it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BfdSpec {
    /// The interval at which control packets are sent and expected, in
    /// milliseconds (10 to 10,000).
    pub interval_ms: u32,
    /// How many missed packets make the session down (1 to 255).
    pub multiplier: u8,
}

impl Default for BfdSpec {
    /// 100 ms × 3: a dead peer is seen within 300 ms.
    fn default() -> Self {
        Self {
            interval_ms: 100,
            multiplier: 3,
        }
    }
}

/// One BGP peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerSpec {
    /// Its name: letters, digits, `-` and `_`, starting with a letter, at
    /// most 48 (the daemon's protocol is `peer_<name>`, `-` as `_`).
    pub name: String,
    /// Its address: the session's family, and the family of what is
    /// announced to it.
    pub address: IpAddr,
    /// Its AS number (the local one: an internal session).
    pub asn: u32,
    /// The local address of the session (`None`: the daemon picks).
    pub source: Option<IpAddr>,
    /// Whether BFD watches the session.
    pub bfd: bool,
    /// The hold time in seconds (0: none; else 3 to 65,535).
    pub hold_time_s: u16,
}

/// The node's BGP speaker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BgpSpec {
    /// The local AS number.
    pub asn: u32,
    /// The router ID (an IPv4 address, not 0.0.0.0).
    pub router_id: Ipv4Addr,
    /// The peers, in any order.
    pub peers: Vec<PeerSpec>,
    /// BFD's timing, for the peers that enable it.
    pub bfd: BfdSpec,
    /// How long a peer keeps this node's routes while its daemon
    /// restarts, in seconds (1 to 4,095: BGP's field is 12 bits).
    pub graceful_restart_s: u16,
}

/// What goes with one announced prefix.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct RouteAttrs {
    /// Standard communities (RFC 1997), as (AS, value).
    pub communities: BTreeSet<(u16, u16)>,
    /// Large communities (RFC 8092), as (global, local 1, local 2).
    pub large_communities: BTreeSet<(u32, u32, u32)>,
    /// The local preference (sent on internal sessions only).
    pub local_pref: Option<u32>,
}

/// The prefixes to announce, each with its attributes.
pub type Announcements = BTreeMap<IpNet, RouteAttrs>;

/// BIRD's static protocols holding the LoadBalancer addresses, IPv4 then
/// IPv6 (what `lockstep bird-keeper` takes down when the agent dies).
pub const LB_PROTOCOLS: [&str; 2] = ["lockstep_ipv4", "lockstep_ipv6"];

/// BIRD's static protocols holding the pod blocks, IPv4 then IPv6 (left
/// up when the agent dies: the node still holds its blocks; in cluster
/// mode, taken down once its hold on them ran out: `keeper::block_hold`).
pub const BLOCK_PROTOCOLS: [&str; 2] = ["lockstep_blocks_ipv4", "lockstep_blocks_ipv6"];

/// The daemon's protocol for a peer named `name`.
pub fn peer_protocol(name: &str) -> String {
    format!("peer_{}", name.replace('-', "_"))
}

/// Checks `spec` whole: every error names its field.
///
/// # Errors
/// The first field found wrong.
pub fn check(spec: &BgpSpec) -> Result<(), BgpError> {
    if spec.asn == 0 {
        return Err(invalid("asn", "0 is reserved; use the node's AS number"));
    }
    if spec.router_id.is_unspecified() {
        return Err(invalid("router_id", "0.0.0.0 is not a router ID"));
    }
    if !(10..=10_000).contains(&spec.bfd.interval_ms) {
        return Err(invalid(
            "bfd.interval_ms",
            format!("{} is outside 10 to 10000", spec.bfd.interval_ms),
        ));
    }
    if spec.bfd.multiplier == 0 {
        return Err(invalid("bfd.multiplier", "must be at least 1"));
    }
    if !(1..=4095).contains(&spec.graceful_restart_s) {
        return Err(invalid(
            "graceful_restart_s",
            format!("{} is outside 1 to 4095", spec.graceful_restart_s),
        ));
    }
    let mut names = BTreeSet::new();
    let mut addresses = BTreeSet::new();
    for (i, p) in spec.peers.iter().enumerate() {
        let field = |f: &str| format!("peers[{i}].{f}");
        let good = p.name.len() <= 48
            && p.name.starts_with(|c: char| c.is_ascii_alphabetic())
            && p.name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        if !good {
            return Err(invalid(
                field("name"),
                format!(
                    "{:?}: letters, digits, '-' and '_', starting with a letter, at most 48",
                    p.name
                ),
            ));
        }
        if !names.insert(peer_protocol(&p.name)) {
            return Err(invalid(
                field("name"),
                format!(
                    "{:?} names another peer too ('-' and '_' are the same)",
                    p.name
                ),
            ));
        }
        if p.address.is_unspecified() || p.address.is_multicast() {
            return Err(invalid(
                field("address"),
                format!("{} is not a peer address", p.address),
            ));
        }
        if !addresses.insert(p.address) {
            return Err(invalid(
                field("address"),
                format!("{} is another peer's address too", p.address),
            ));
        }
        if p.asn == 0 {
            return Err(invalid(field("asn"), "0 is reserved"));
        }
        if let Some(s) = p.source
            && s.is_ipv4() != p.address.is_ipv4()
        {
            return Err(invalid(
                field("source"),
                format!(
                    "{s} is not of the family of the peer's address {}",
                    p.address
                ),
            ));
        }
        if (1..3).contains(&p.hold_time_s) {
            return Err(invalid(
                field("hold_time_s"),
                format!("{} is neither 0 (none) nor 3 to 65535", p.hold_time_s),
            ));
        }
    }
    Ok(())
}

/// Checks the announcements: each a network address (no host bits set).
///
/// # Errors
/// The first prefix found wrong, named.
pub fn check_announcements(routes: &Announcements) -> Result<(), BgpError> {
    for net in routes.keys() {
        if net.trunc() != *net {
            return Err(invalid(
                "announce",
                format!("{net} has host bits set (the network is {})", net.trunc()),
            ));
        }
    }
    Ok(())
}

/// BIRD 2's whole configuration for `spec` announcing the LoadBalancer
/// addresses `routes` and the pod blocks `blocks`: the same inputs make
/// the same text, and each peer's block depends only on that
/// peer and the session-wide settings (so a configure resets only the
/// peers whose settings changed; see the module).
///
/// # Errors
/// `spec`, `routes` or `blocks` fail [`check`] or
/// [`check_announcements`].
pub fn render_bird(
    spec: &BgpSpec,
    routes: &Announcements,
    blocks: &Announcements,
) -> Result<String, BgpError> {
    check(spec)?;
    check_announcements(routes)?;
    check_announcements(blocks)?;
    let mut t = String::new();
    let w = &mut t;
    // Writing to a String cannot fail.
    let _ = writeln!(
        w,
        "# Written by lockstep and applied with `birdc configure`: change\n\
         # lockstep's BGP settings, not this file.\n\
         router id {};\n\
         log stderr {{ info, remote, warning, error, auth, fatal, bug }};\n\
         timeformat protocol \"%s\";\n\
         \n\
         protocol device lockstep_device {{\n  scan time 10;\n}}\n",
        spec.router_id
    );
    if spec.peers.iter().any(|p| p.bfd) {
        let b = spec.bfd;
        let _ = writeln!(
            w,
            "protocol bfd lockstep_bfd {{\n  interface \"*\" {{\n    min rx interval {i} ms;\n    min tx interval {i} ms;\n    idle tx interval 1000 ms;\n    multiplier {m};\n  }};\n}}\n",
            i = b.interval_ms,
            m = b.multiplier
        );
    }
    for (protocols, announced) in [(LB_PROTOCOLS, routes), (BLOCK_PROTOCOLS, blocks)] {
        for (protocol, v4) in protocols.iter().zip([true, false]) {
            static_protocol(w, protocol, v4, announced);
        }
    }
    let names: Vec<String> = LB_PROTOCOLS
        .iter()
        .chain(&BLOCK_PROTOCOLS)
        .map(|p| format!("proto = \"{p}\""))
        .collect();
    let _ = writeln!(
        w,
        "filter lockstep_export {{\n  if {} then accept;\n  reject;\n}}\n",
        names.join(" || ")
    );
    let mut peers: Vec<&PeerSpec> = spec.peers.iter().collect();
    peers.sort_by(|a, b| a.name.cmp(&b.name));
    for p in peers {
        let family = if p.address.is_ipv4() { "ipv4" } else { "ipv6" };
        let _ = writeln!(w, "protocol bgp {} {{", peer_protocol(&p.name));
        match p.source {
            Some(s) => {
                let _ = writeln!(w, "  local {s} as {};", spec.asn);
            }
            None => {
                let _ = writeln!(w, "  local as {};", spec.asn);
            }
        }
        let _ = writeln!(w, "  neighbor {} as {};", p.address, p.asn);
        if p.hold_time_s > 0 {
            let _ = writeln!(
                w,
                "  hold time {};\n  keepalive time {};",
                p.hold_time_s,
                (p.hold_time_s / 3).max(1)
            );
        }
        if p.bfd {
            let _ = writeln!(w, "  bfd on;");
        }
        // After a failure the session is tried again within a second,
        // and ever later (to a minute) while it keeps failing: a healed
        // link is used again at once, a flapping one is damped.
        let _ = writeln!(w, "  connect retry time 5;\n  error wait time 1, 60;");
        let _ = writeln!(
            w,
            "  graceful restart on;\n  graceful restart time {};\n  {family} {{\n    import none;\n    export filter lockstep_export;\n    next hop self;\n  }};\n}}\n",
            spec.graceful_restart_s
        );
    }
    Ok(t)
}

/// Writes the static protocol `protocol` of one family (`v4`) with the
/// prefixes of `announced` of that family, each a blackhole carrying its
/// attributes.
fn static_protocol(w: &mut String, protocol: &str, v4: bool, announced: &Announcements) {
    let family = if v4 { "ipv4" } else { "ipv6" };
    let _ = writeln!(w, "protocol static {protocol} {{\n  {family};");
    for (net, attrs) in announced.iter().filter(|(n, _)| n.addr().is_ipv4() == v4) {
        let _ = write!(w, "  route {net} blackhole");
        let mut set = Vec::new();
        for (a, v) in &attrs.communities {
            set.push(format!("bgp_community.add(({a}, {v}));"));
        }
        for (g, l1, l2) in &attrs.large_communities {
            set.push(format!("bgp_large_community.add(({g}, {l1}, {l2}));"));
        }
        if let Some(p) = attrs.local_pref {
            set.push(format!("bgp_local_pref = {p};"));
        }
        if set.is_empty() {
            let _ = writeln!(w, ";");
        } else {
            let _ = writeln!(w, " {{ {} }};", set.join(" "));
        }
    }
    let _ = writeln!(w, "}}\n");
}

#[cfg(test)]
mod tests;
