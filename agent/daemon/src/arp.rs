//! Gratuitous ARP: announces an address's owner MAC on a link, so neighbours
//! update their caches at once when a LoadBalancer address is assigned (or
//! moves) instead of waiting for their entries to expire.
//!
//! A raw `AF_PACKET` socket bound to the announcing interface; one frame per
//! call. (Answering ARP requests is the BPF program's job, not this one's.)

use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

const ETH_P_ARP: u16 = 0x0806;

/// The 42-byte gratuitous ARP request for `addr` from `mac`.
pub fn frame(mac: [u8; 6], addr: Ipv4Addr) -> [u8; 42] {
    let mut f = [0u8; 42];
    f[0..6].copy_from_slice(&[0xff; 6]);
    f[6..12].copy_from_slice(&mac);
    f[12..14].copy_from_slice(&ETH_P_ARP.to_be_bytes());
    // Ethernet / IPv4, hlen 6, plen 4, request.
    f[14..22].copy_from_slice(&[0, 1, 0x08, 0x00, 6, 4, 0, 1]);
    f[22..28].copy_from_slice(&mac);
    f[28..32].copy_from_slice(&addr.octets());
    // Target hardware address stays zero; target protocol address = sender.
    f[38..42].copy_from_slice(&addr.octets());
    f
}

/// Sends one gratuitous ARP for `addr` out of interface `ifindex`.
///
/// # Errors
/// The socket could not be opened or the frame not sent.
pub fn announce(ifindex: u32, mac: [u8; 6], addr: Ipv4Addr) -> io::Result<()> {
    send_frame(ifindex, ETH_P_ARP, [0xff; 6], &frame(mac, addr))
}

/// Sends one whole Ethernet frame of `protocol` to `dst` out of interface
/// `ifindex`, through a raw `AF_PACKET` socket opened for the call.
///
/// # Errors
/// The socket could not be opened or the frame not sent.
pub fn send_frame(ifindex: u32, protocol: u16, dst: [u8; 6], f: &[u8]) -> io::Result<()> {
    // SAFETY: plain socket(2).
    let raw = unsafe {
        libc::socket(
            libc::AF_PACKET,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            i32::from(protocol.to_be()),
        )
    };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: just opened, owned here.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: sockaddr_ll is plain data.
    let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sll.sll_family = libc::AF_PACKET as u16;
    sll.sll_protocol = protocol.to_be();
    sll.sll_ifindex = ifindex as i32;
    sll.sll_halen = 6;
    sll.sll_addr[..6].copy_from_slice(&dst);
    // SAFETY: valid fd, buffer and address for the call's duration.
    let sent = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            f.as_ptr().cast(),
            f.len(),
            0,
            (&sll as *const libc::sockaddr_ll).cast(),
            size_of::<libc::sockaddr_ll>() as u32,
        )
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_is_a_gratuitous_request() {
        let f = frame([2, 0, 0, 0, 0, 1], Ipv4Addr::new(10, 0, 0, 9));
        assert_eq!(&f[0..6], &[0xff; 6]);
        assert_eq!(&f[12..14], &[0x08, 0x06]);
        assert_eq!(&f[20..22], &[0, 1], "request");
        assert_eq!(&f[28..32], &f[38..42], "sender = target address");
        assert_eq!(&f[32..38], &[0; 6]);
    }
}
