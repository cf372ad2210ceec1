//! Masquerade decisions: the translated port range and when a translation
//! has ended.
//!
//! Why in the core: the datapath translates and the agent's collector
//! deletes, but what a valid port range is, which ranges may not meet, and
//! whether a flow is over are plain arithmetic on numbers read from the
//! maps and sysctls; kept here they are tested without a kernel.

use std::fmt;
use std::str::FromStr;

use lockstep_common::nat_state;

/// Errors of masquerade settings.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MasqError {
    /// A port range is not `LOW-HIGH` with 1024 ≤ LOW ≤ HIGH ≤ 65535.
    #[error("masquerade.ports {text:?}: {reason}")]
    Ports {
        /// The text given.
        text: String,
        /// What is wrong.
        reason: String,
    },
    /// The translated range meets the node's own ephemeral ports: a
    /// translation could take a port a local socket uses.
    #[error(
        "masquerade.ports {ports} overlaps the node's ephemeral ports {ephemeral} (net.ipv4.ip_local_port_range); choose a range outside it"
    )]
    Overlap {
        /// The masquerade range.
        ports: PortRange,
        /// The node's range.
        ephemeral: PortRange,
    },
}

/// An inclusive port range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortRange {
    /// Lowest port.
    pub low: u16,
    /// Highest port.
    pub high: u16,
}

impl PortRange {
    /// Whether the two ranges share a port.
    pub fn overlaps(&self, other: &PortRange) -> bool {
        self.low <= other.high && other.low <= self.high
    }

    /// How many ports the range holds.
    pub fn len(&self) -> u32 {
        u32::from(self.high) - u32::from(self.low) + 1
    }

    /// Never: a range holds at least one port.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Parses the kernel's `ip_local_port_range` ("32768\t60999").
    pub fn from_sysctl(text: &str) -> Option<PortRange> {
        let mut it = text.split_whitespace().map(str::parse::<u16>);
        let (Some(Ok(low)), Some(Ok(high)), None) = (it.next(), it.next(), it.next()) else {
            return None;
        };
        (low <= high).then_some(PortRange { low, high })
    }
}

/// The ports whose replies the programs must look up: the configured
/// range, widened to every port a live translation holds (`live`, the
/// lowest and highest translated port in NAT_REV, `None` when it is
/// empty). A changed range thus keeps the established flows of the old one
/// working until they end, and shrinks back to `configured` once they have.
pub fn reply_range(configured: PortRange, live: Option<(u16, u16)>) -> PortRange {
    match live {
        None => configured,
        Some((low, high)) => PortRange {
            low: configured.low.min(low),
            high: configured.high.max(high),
        },
    }
}

impl fmt::Display for PortRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.low, self.high)
    }
}

impl FromStr for PortRange {
    type Err = MasqError;

    fn from_str(text: &str) -> Result<Self, MasqError> {
        let bad = |reason: &str| MasqError::Ports {
            text: text.to_string(),
            reason: reason.to_string(),
        };
        let (low, high) = text
            .split_once('-')
            .ok_or_else(|| bad("expected LOW-HIGH, e.g. 61000-65535"))?;
        let port = |s: &str| {
            s.trim()
                .parse::<u16>()
                .map_err(|_| bad(&format!("{s:?} is not a port number")))
        };
        let (low, high) = (port(low)?, port(high)?);
        if low < 1024 {
            return Err(bad("ports below 1024 are privileged service ports"));
        }
        if low > high {
            return Err(bad("the low port is above the high one"));
        }
        Ok(PortRange { low, high })
    }
}

/// Refuses a masquerade range that meets the node's ephemeral range.
///
/// # Errors
/// [`MasqError::Overlap`] naming both ranges.
pub fn check_disjoint(ports: PortRange, ephemeral: PortRange) -> Result<(), MasqError> {
    if ports.overlaps(&ephemeral) {
        return Err(MasqError::Overlap { ports, ephemeral });
    }
    Ok(())
}

/// How long a translation may stay idle, in nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// An open TCP connection.
    pub tcp_ns: u64,
    /// A TCP connection closed both ways by FIN, or reset.
    pub tcp_closing_ns: u64,
    /// UDP.
    pub udp_ns: u64,
    /// ICMP and ICMPv6 echo.
    pub icmp_ns: u64,
    /// Any flow nothing has answered yet (a SYN, a datagram, an echo
    /// request): no reply has set [`nat_state::REPLIED`]. Never longer
    /// than its protocol's own timeout.
    pub unreplied_ns: u64,
}

/// The most translations one endpoint address may hold: `share` of a
/// table of `capacity` entries, at least 1 (`MasqConfig::endpoint_max`).
pub fn endpoint_max(capacity: u32, share: f64) -> u32 {
    let n = (f64::from(capacity) * share.clamp(0.0, 1.0)).floor();
    (n as u32).clamp(1, capacity.max(1))
}

/// Whether the table is under pressure: `live` of `capacity` entries is at
/// or above seven eighths. The collector then ends flows early
/// ([`evictable`]) rather than let new flows be refused.
pub fn under_pressure(live: u64, capacity: u32) -> bool {
    live * 8 >= u64::from(capacity) * 7
}

/// Under pressure, whether a live flow may be ended early: one nothing
/// has answered, idle for at least a second, or a closing TCP connection
/// (FIN both ways, or reset). Established flows are never evicted.
pub fn evictable(proto: u8, state: u8, last_seen_ns: u64, now_ns: u64) -> bool {
    let idle = now_ns.saturating_sub(last_seen_ns);
    let unreplied = state & nat_state::REPLIED == 0;
    (unreplied && idle >= 1_000_000_000) || (proto == 6 && closing(state))
}

fn closing(state: u8) -> bool {
    state & nat_state::RST != 0
        || state & (nat_state::FIN_IN | nat_state::FIN_OUT)
            == nat_state::FIN_IN | nat_state::FIN_OUT
}

/// Whether a translation is over: idle (`now_ns - last_seen_ns`, both on
/// the monotonic clock the programs read) past the timeout of its protocol
/// and state; a flow never answered (no [`nat_state::REPLIED`]) gets the
/// shorter unreplied timeout. `state` is the union of both directions' [`nat_state`] bits;
/// `last_seen_ns` the later of both directions' times.
pub fn expired(proto: u8, state: u8, last_seen_ns: u64, now_ns: u64, t: &Timeouts) -> bool {
    let idle = now_ns.saturating_sub(last_seen_ns);
    let limit = match proto {
        6 if closing(state) => t.tcp_closing_ns,
        6 => t.tcp_ns,
        17 => t.udp_ns,
        _ => t.icmp_ns,
    };
    let limit = if state & nat_state::REPLIED == 0 {
        limit.min(t.unreplied_ns)
    } else {
        limit
    };
    idle >= limit
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const T: Timeouts = Timeouts {
        tcp_ns: 7_200_000_000_000,
        tcp_closing_ns: 10_000_000_000,
        udp_ns: 60_000_000_000,
        icmp_ns: 30_000_000_000,
        unreplied_ns: 5_000_000_000,
    };
    const R: u8 = nat_state::REPLIED;

    proptest! {
        /// The reply range holds the configured range and every live port,
        /// and nothing outside their hull.
        #[test]
        fn the_reply_range_covers_the_range_and_every_live_port(
            a in 1024u16..=65535, b in 1024u16..=65535,
            live in proptest::collection::vec(1u16..=65535, 0..20),
        ) {
            let configured = PortRange { low: a.min(b), high: a.max(b) };
            let hull = live.iter().fold(None, |h: Option<(u16, u16)>, &p| {
                Some(h.map_or((p, p), |(l, hi)| (l.min(p), hi.max(p))))
            });
            let r = reply_range(configured, hull);
            prop_assert!(r.low <= configured.low && r.high >= configured.high);
            for p in &live {
                prop_assert!(r.low <= *p && *p <= r.high);
            }
            let lowest = live.iter().copied().chain([configured.low]).min();
            let highest = live.iter().copied().chain([configured.high]).max();
            prop_assert_eq!(Some(r.low), lowest);
            prop_assert_eq!(Some(r.high), highest);
        }
    }

    #[test]
    fn port_ranges_parse_or_say_what_is_wrong() {
        assert_eq!(
            "61000-65535".parse::<PortRange>(),
            Ok(PortRange {
                low: 61000,
                high: 65535
            })
        );
        for (text, says) in [
            ("61000", "LOW-HIGH"),
            ("x-65535", "not a port"),
            ("61000-70000", "not a port"),
            ("80-90", "below 1024"),
            ("65000-61000", "above"),
        ] {
            let e = text.parse::<PortRange>().unwrap_err().to_string();
            assert!(e.contains(says) && e.contains(text), "{text}: {e}");
        }
    }

    #[test]
    fn the_range_may_not_meet_the_ephemeral_ports() {
        let eph = PortRange::from_sysctl("32768\t60999\n").expect("sysctl");
        assert!(check_disjoint("61000-65535".parse().unwrap(), eph).is_ok());
        let e = check_disjoint("60000-65535".parse().unwrap(), eph)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("60000-65535") && e.contains("32768-60999"),
            "{e}"
        );
        assert_eq!(PortRange::from_sysctl("1 2 3"), None);
        assert_eq!(PortRange::from_sysctl("9 2"), None);
    }

    #[test]
    fn closed_tcp_ends_sooner_than_open_tcp() {
        let s = 1_000_000_000;
        let both = nat_state::FIN_IN | nat_state::FIN_OUT | R;
        assert!(!expired(6, R, 0, 11 * s, &T));
        assert!(expired(6, both, 0, 11 * s, &T));
        assert!(expired(6, nat_state::RST | R, 0, 11 * s, &T));
        // Half-closed stays open.
        assert!(!expired(6, nat_state::FIN_OUT | R, 0, 11 * s, &T));
        assert!(expired(17, R, 0, 60 * s, &T) && !expired(17, R, 0, 59 * s, &T));
        assert!(expired(1, R, 0, 30 * s, &T) && !expired(58, R, 0, 29 * s, &T));
        // A clock read before the packet's time is not idle.
        assert!(!expired(17, R, 100 * s, 50 * s, &T));
    }

    #[test]
    fn flows_nobody_answered_end_after_the_unreplied_timeout() {
        let s = 1_000_000_000;
        // A SYN without reply: 5 s, not the 2 h of an open connection.
        assert!(expired(6, 0, 0, 5 * s, &T) && !expired(6, 0, 0, 4 * s, &T));
        assert!(!expired(6, R, 0, 5 * s, &T));
        // A datagram without reply, an echo request without reply.
        assert!(expired(17, 0, 0, 5 * s, &T) && !expired(17, R, 0, 5 * s, &T));
        assert!(expired(1, 0, 0, 5 * s, &T));
        // Never longer than the protocol's own timeout.
        let long = Timeouts {
            unreplied_ns: 100 * s,
            ..T
        };
        assert!(expired(17, 0, 0, 60 * s, &long));
        // A closing connection nobody answered: the shorter of the two.
        assert!(expired(6, nat_state::RST, 0, 5 * s, &T));
    }

    #[test]
    fn the_endpoint_bound_is_a_share_of_the_table() {
        assert_eq!(endpoint_max(65_536, 0.25), 16_384);
        assert_eq!(endpoint_max(65_536, 1.0), 65_536);
        assert_eq!(endpoint_max(100, 0.001), 1);
        assert_eq!(endpoint_max(100, 7.0), 100);
    }

    #[test]
    fn pressure_evicts_unanswered_and_closing_flows_only() {
        let s = 1_000_000_000;
        assert!(!under_pressure(57_343, 65_536) && under_pressure(57_344, 65_536));
        assert!(evictable(6, 0, 0, s) && !evictable(6, 0, 0, s / 2));
        assert!(evictable(17, 0, 0, 2 * s));
        assert!(!evictable(6, R, 0, 100 * s) && !evictable(17, R, 0, 100 * s));
        assert!(evictable(6, R | nat_state::RST, 10 * s, 10 * s));
        assert!(!evictable(17, R | nat_state::RST, 0, 100 * s));
    }

    proptest! {
        #[test]
        fn later_activity_never_expires_sooner(
            proto in prop::sample::select(vec![1u8, 6, 17, 58]),
            state in 0u8..32,
            seen in 0u64..1u64 << 50,
            later in 0u64..1u64 << 40,
            now in 0u64..1u64 << 51,
        ) {
            // If a flow seen later has expired, the same flow seen earlier has too.
            if expired(proto, state, seen + later, now, &T) {
                prop_assert!(expired(proto, state, seen, now, &T));
            }
        }

        #[test]
        fn overlap_is_symmetric_and_matches_membership(a in 1024u16.., b in 1024u16.., c in 1024u16.., d in 1024u16..) {
            let r1 = PortRange { low: a.min(b), high: a.max(b) };
            let r2 = PortRange { low: c.min(d), high: c.max(d) };
            prop_assert_eq!(r1.overlaps(&r2), r2.overlaps(&r1));
            let shared = (r1.low.max(r2.low)..=r1.high.min(r2.high)).next().is_some();
            prop_assert_eq!(r1.overlaps(&r2), shared);
        }
    }
}
