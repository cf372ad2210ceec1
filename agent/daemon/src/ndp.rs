//! Unsolicited Neighbor Advertisements (RFC 4861 §7.2.6): the IPv6
//! counterpart of [`crate::arp`]'s gratuitous ARP. Sent to all nodes when an
//! IPv6 LoadBalancer address is newly announced (or announced again after
//! its lease lapsed), so neighbours update their caches at once.
//! (Answering Neighbor Solicitations is the BPF program's job.)

use std::io;
use std::net::Ipv6Addr;

const ETH_P_IPV6: u16 = 0x86DD;
/// The all-nodes address ff02::1 and its Ethernet multicast address.
const ALL_NODES: Ipv6Addr = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1);
const ALL_NODES_MAC: [u8; 6] = [0x33, 0x33, 0, 0, 0, 1];
/// Ethernet + IPv6 + NA (24) + target link-layer address option (8).
pub const FRAME_LEN: usize = 14 + 40 + 32;
/// The Override flag (not Solicited: nobody asked).
const OVERRIDE: u8 = 0x20;

/// One's-complement sum of `b` as big-endian 16-bit words (even length).
fn sum(b: &[u8]) -> u32 {
    b.chunks_exact(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
        .sum()
}

/// The ICMPv6 checksum of `msg` from `src` to `dst` (RFC 4443 §2.3).
#[must_use]
pub fn icmpv6_checksum(src: &Ipv6Addr, dst: &Ipv6Addr, msg: &[u8]) -> u16 {
    let mut s = sum(&src.octets()) + sum(&dst.octets()) + msg.len() as u32 + 58 + sum(msg);
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    !(s as u16)
}

/// The unsolicited advertisement of `addr` at `mac`, to all nodes.
#[must_use]
pub fn frame(mac: [u8; 6], addr: Ipv6Addr) -> [u8; FRAME_LEN] {
    let mut f = [0u8; FRAME_LEN];
    f[0..6].copy_from_slice(&ALL_NODES_MAC);
    f[6..12].copy_from_slice(&mac);
    f[12..14].copy_from_slice(&ETH_P_IPV6.to_be_bytes());
    f[14..22].copy_from_slice(&[0x60, 0, 0, 0, 0, 32, 58, 255]);
    f[22..38].copy_from_slice(&addr.octets());
    f[38..54].copy_from_slice(&ALL_NODES.octets());
    f[54] = 136;
    f[58] = OVERRIDE;
    f[62..78].copy_from_slice(&addr.octets());
    f[78..80].copy_from_slice(&[2, 1]);
    f[80..86].copy_from_slice(&mac);
    let c = icmpv6_checksum(&addr, &ALL_NODES, &f[54..]);
    f[56..58].copy_from_slice(&c.to_be_bytes());
    f
}

/// Sends one unsolicited Neighbor Advertisement for `addr` out of interface
/// `ifindex`.
///
/// # Errors
/// The socket could not be opened or the frame not sent.
pub fn announce(ifindex: u32, mac: [u8; 6], addr: Ipv6Addr) -> io::Result<()> {
    crate::arp::send_frame(ifindex, ETH_P_IPV6, ALL_NODES_MAC, &frame(mac, addr))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_is_an_unsolicited_override_advertisement_with_a_valid_checksum() {
        let addr: Ipv6Addr = "fd00:5::10".parse().unwrap();
        let f = frame([2, 0, 0, 0, 0, 1], addr);
        assert_eq!(&f[12..14], &[0x86, 0xdd]);
        assert_eq!((f[20], f[21]), (58, 255), "ICMPv6, hop limit 255");
        assert_eq!((f[54], f[55]), (136, 0), "NA, code 0");
        assert_eq!(f[58], 0x20, "override, not solicited");
        assert_eq!(&f[62..78], &addr.octets());
        assert_eq!(&f[78..86], &[2, 1, 2, 0, 0, 0, 0, 1]);
        // Summing everything, checksum included, gives 0xffff.
        let mut s = sum(&f[22..54]) + 32 + 58 + sum(&f[54..]);
        while s > 0xffff {
            s = (s & 0xffff) + (s >> 16);
        }
        assert_eq!(s, 0xffff);
    }
}
