//! Address intervals: the common currency of LB pools.
//!
//! A pool is written as CIDR blocks and start–stop ranges, but the conflict
//! index compares plain inclusive `u128` intervals, and the
//! [`PoolManager`](crate::manager::PoolManager) only knows CIDRs. This module
//! converts between the three: an address to its integer, a CIDR to its
//! interval, and an interval to the minimal list of CIDRs covering exactly it
//! ([`range_to_cidrs`]).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use crate::cidr::Family;

/// An address as an integer (IPv4 in the low 32 bits).
pub(crate) fn addr_bits(addr: IpAddr) -> u128 {
    match addr {
        IpAddr::V4(a) => u128::from(u32::from(a)),
        IpAddr::V6(a) => u128::from(a),
    }
}

/// The address of `family` whose integer is `bits` (truncated for IPv4).
pub(crate) fn addr_of(family: Family, bits: u128) -> IpAddr {
    match family {
        Family::V4 => IpAddr::V4(Ipv4Addr::from(
            u32::try_from(bits & u128::from(u32::MAX)).expect("masked to 32 bits"),
        )),
        Family::V6 => IpAddr::V6(Ipv6Addr::from(bits)),
    }
}

/// Address width of a family in bits.
fn width(family: Family) -> u32 {
    match family {
        Family::V4 => 32,
        Family::V6 => 128,
    }
}

/// First and last address of a CIDR as integers.
pub(crate) fn cidr_interval(cidr: IpNet) -> (u128, u128) {
    let start = addr_bits(cidr.network());
    let host_bits = u32::from(cidr.max_prefix_len() - cidr.prefix_len());
    let span = if host_bits == 0 {
        0
    } else {
        u128::MAX >> (128 - host_bits)
    };
    (start, start | span)
}

/// The addresses of a CIDR block that an LB pool hands out, as one or two
/// inclusive intervals. Without `allow_first_last` the same addresses are
/// left out as everywhere else in lockstep (see [`crate::cidr`]): the IPv4
/// network and broadcast addresses of blocks larger than /31, the IPv6
/// subnet-router anycast address of blocks larger than /127.
pub(crate) fn usable_interval(cidr: IpNet, allow_first_last: bool) -> Option<(u128, u128)> {
    let (start, end) = cidr_interval(cidr);
    let host_bits = cidr.max_prefix_len() - cidr.prefix_len();
    if allow_first_last || host_bits < 2 {
        return Some((start, end));
    }
    match cidr {
        IpNet::V4(_) => Some((start + 1, end - 1)),
        IpNet::V6(_) => Some((start + 1, end)),
    }
}

/// The addresses of a block that are *not* handed out (the complement of
/// [`usable_interval`] within the block).
pub(crate) fn excluded_addresses(cidr: IpNet, allow_first_last: bool) -> Vec<IpAddr> {
    let (start, end) = cidr_interval(cidr);
    let Some((us, ue)) = usable_interval(cidr, allow_first_last) else {
        return Vec::new();
    };
    let family = Family::of_net(cidr);
    let mut out = Vec::new();
    if us > start {
        out.push(addr_of(family, start));
    }
    if ue < end {
        out.push(addr_of(family, end));
    }
    out
}

/// The minimal list of CIDRs covering exactly `start..=stop`, ascending.
///
/// Greedy from the left: each step takes the largest block that starts at
/// the current address (limited by its alignment) and does not pass `stop`.
/// That is optimal, because any cover must contain a block starting at the
/// current address and a larger one is never worse. At most `2 × width`
/// blocks come out (e.g. 62 for the worst IPv4 range).
///
/// Returns an empty list when the families differ or `start > stop`
/// (validation reports those with the field name first).
pub fn range_to_cidrs(start: IpAddr, stop: IpAddr) -> Vec<IpNet> {
    let family = Family::of_addr(start);
    if family != Family::of_addr(stop) {
        return Vec::new();
    }
    interval_to_cidrs(family, addr_bits(start), addr_bits(stop))
}

/// [`range_to_cidrs`] on integers of one family.
pub(crate) fn interval_to_cidrs(family: Family, mut start: u128, stop: u128) -> Vec<IpNet> {
    let w = width(family);
    let mut out = Vec::new();
    if start > stop {
        return out;
    }
    loop {
        let align = if start == 0 {
            w
        } else {
            start.trailing_zeros().min(w)
        };
        let span = stop - start; // block size minus one
        // floor(log2(span + 1)), with span + 1 = 2^128 for the whole space.
        let fit = match span.checked_add(1) {
            Some(n) => 127 - n.leading_zeros(),
            None => 128,
        };
        let k = align.min(fit);
        let prefix = u8::try_from(w - k).expect("prefix fits in u8");
        out.push(net_of(family, start, prefix));
        let last = if k == 128 {
            u128::MAX
        } else {
            start + ((1u128 << k) - 1)
        };
        if last >= stop {
            return out;
        }
        start = last + 1;
    }
}

fn net_of(family: Family, bits: u128, prefix: u8) -> IpNet {
    match addr_of(family, bits) {
        IpAddr::V4(a) => IpNet::V4(Ipv4Net::new(a, prefix).expect("prefix <= 32")),
        IpAddr::V6(a) => IpNet::V6(Ipv6Net::new(a, prefix).expect("prefix <= 128")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn nets(list: &[&str]) -> Vec<IpNet> {
        list.iter().map(|s| s.parse().unwrap()).collect()
    }

    #[test]
    fn known_ranges() {
        assert_eq!(
            range_to_cidrs(ip("10.0.0.5"), ip("10.0.0.20")),
            nets(&[
                "10.0.0.5/32",
                "10.0.0.6/31",
                "10.0.0.8/29",
                "10.0.0.16/30",
                "10.0.0.20/32"
            ])
        );
        assert_eq!(
            range_to_cidrs(ip("10.0.0.0"), ip("10.0.0.255")),
            nets(&["10.0.0.0/24"])
        );
        assert_eq!(
            range_to_cidrs(ip("0.0.0.0"), ip("255.255.255.255")),
            nets(&["0.0.0.0/0"])
        );
        assert_eq!(
            range_to_cidrs(ip("::"), ip("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff")),
            nets(&["::/0"])
        );
        assert_eq!(
            range_to_cidrs(ip("fd00::1"), ip("fd00::1")),
            nets(&["fd00::1/128"])
        );
        assert_eq!(
            range_to_cidrs(ip("255.255.255.255"), ip("255.255.255.255")),
            nets(&["255.255.255.255/32"])
        );
        assert!(range_to_cidrs(ip("10.0.0.2"), ip("10.0.0.1")).is_empty());
        assert!(range_to_cidrs(ip("10.0.0.1"), ip("fd00::1")).is_empty());
    }

    #[test]
    fn first_and_last_follow_the_core_rule() {
        let n = |s: &str| s.parse::<IpNet>().unwrap();
        assert_eq!(
            excluded_addresses(n("10.0.0.0/24"), false),
            vec![ip("10.0.0.0"), ip("10.0.0.255")]
        );
        assert!(excluded_addresses(n("10.0.0.0/24"), true).is_empty());
        assert!(excluded_addresses(n("10.0.0.0/31"), false).is_empty());
        assert_eq!(
            excluded_addresses(n("fd00::/120"), false),
            vec![ip("fd00::")]
        );
    }

    fn check_cover(family: Family, start: u128, stop: u128) -> Result<(), TestCaseError> {
        let cidrs = interval_to_cidrs(family, start, stop);
        prop_assert!(!cidrs.is_empty());
        prop_assert!(cidrs.len() <= 2 * width(family) as usize);
        let mut next = start;
        for (i, c) in cidrs.iter().enumerate() {
            prop_assert_eq!(c.trunc(), *c, "canonical");
            let (s, e) = cidr_interval(*c);
            prop_assert_eq!(s, next, "contiguous and ascending");
            if i + 1 == cidrs.len() {
                prop_assert_eq!(e, stop, "ends at stop");
            } else {
                next = e + 1;
            }
            // Minimal: no two neighbours form one aligned block.
            if let Some(d) = cidrs.get(i + 1) {
                let mergeable = c.prefix_len() == d.prefix_len()
                    && c.prefix_len() > 0
                    && c.supernet().is_some_and(|p| p.network() == c.network());
                prop_assert!(!mergeable, "{} and {} merge", c, d);
            }
        }
        Ok(())
    }

    /// Smallest cover by brute force (dynamic programming over offsets).
    fn brute_force_min(start: u32, stop: u32) -> usize {
        let n = (stop - start + 1) as usize;
        let mut best = vec![usize::MAX; n + 1];
        best[0] = 0;
        for i in 0..n {
            if best[i] == usize::MAX {
                continue;
            }
            let a = start + i as u32;
            for k in 0..=16u32 {
                let size = 1u32 << k;
                if !a.is_multiple_of(size) || i + size as usize > n {
                    continue;
                }
                best[i + size as usize] = best[i + size as usize].min(best[i] + 1);
            }
        }
        best[n]
    }

    proptest! {
        #[test]
        fn v4_cover_is_exact_and_minimal(a: u32, b: u32) {
            let (s, e) = (a.min(b), a.max(b));
            check_cover(Family::V4, u128::from(s), u128::from(e))?;
        }

        #[test]
        fn v6_cover_is_exact_and_minimal(a: u128, b: u128) {
            check_cover(Family::V6, a.min(b), a.max(b))?;
        }

        #[test]
        fn small_ranges_match_brute_force(base in 0u32..1024, len in 0u32..600) {
            let got = interval_to_cidrs(Family::V4, u128::from(base), u128::from(base + len));
            prop_assert_eq!(got.len(), brute_force_min(base, base + len));
        }
    }
}
