//! Block layout: a CIDR cut into equal blocks, numbered from its first
//! address. Block `i` of `10.0.0.0/24` with /26 blocks is `10.0.0.(64*i)/26`.

use ipnet::IpNet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

fn bits(net: &IpNet) -> u8 {
    match net {
        IpNet::V4(_) => 32,
        IpNet::V6(_) => 128,
    }
}

fn to_u128(addr: IpAddr) -> u128 {
    match addr {
        IpAddr::V4(a) => u128::from(u32::from(a)),
        IpAddr::V6(a) => u128::from(a),
    }
}

/// How many blocks of prefix length `block` the CIDR holds; 0 when `block`
/// is shorter than the CIDR's prefix or longer than the family allows.
pub fn block_count(cidr: IpNet, block: u8) -> u128 {
    if block < cidr.prefix_len() || block > bits(&cidr) {
        return 0;
    }
    let shift = u32::from(block - cidr.prefix_len());
    1u128.checked_shl(shift).unwrap_or(0)
}

/// Block `index` of the CIDR, or `None` past the last one.
pub fn block_at(cidr: IpNet, block: u8, index: u128) -> Option<IpNet> {
    if index >= block_count(cidr, block) {
        return None;
    }
    let host_bits = u32::from(bits(&cidr) - block);
    let offset = index.checked_shl(host_bits)?;
    let base = to_u128(cidr.network()) + offset;
    let addr = match cidr {
        IpNet::V4(_) => IpAddr::V4(Ipv4Addr::from(u32::try_from(base).ok()?)),
        IpNet::V6(_) => IpAddr::V6(Ipv6Addr::from(base)),
    };
    IpNet::new(addr, block).ok()
}

/// The index of `net` among the CIDR's blocks of prefix length `block`, or
/// `None` when `net` is not exactly one of them.
pub fn block_index(cidr: IpNet, block: u8, net: IpNet) -> Option<u128> {
    if net.prefix_len() != block
        || block_count(cidr, block) == 0
        || !cidr.contains(&net.network())
        || net.network() != net.addr()
    {
        return None;
    }
    let host_bits = u32::from(bits(&cidr) - block);
    let offset = to_u128(net.network()) - to_u128(cidr.network());
    Some(offset.checked_shr(host_bits).unwrap_or(0))
}

/// Addresses in one block of prefix length `block` of the family of `cidr`.
pub fn block_addresses(cidr: IpNet, block: u8) -> u128 {
    let host_bits = u32::from(bits(&cidr).saturating_sub(block));
    1u128.checked_shl(host_bits).unwrap_or(u128::MAX)
}
