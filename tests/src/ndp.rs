//! A small NDP prober for the tests: sends a Neighbor Solicitation from a
//! raw `AF_PACKET` socket in a namespace and collects the Neighbor
//! Advertisements that come back, with an ICMPv6 checksum check computed
//! here, independently of the agent and the BPF program.

use std::net::Ipv6Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

const ETH_P_IPV6: u16 = 0x86DD;

/// One's-complement sum of big-endian 16-bit words (odd tail padded).
fn sum(b: &[u8]) -> u32 {
    b.chunks(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], *w.get(1).unwrap_or(&0)])))
        .sum()
}

fn fold(mut s: u32) -> u16 {
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    s as u16
}

/// The ICMPv6 checksum field value for `msg` (checksum bytes zero) from
/// `src` to `dst`.
pub fn checksum(src: &[u8; 16], dst: &[u8; 16], msg: &[u8]) -> u16 {
    !fold(sum(src) + sum(dst) + msg.len() as u32 + 58 + sum(msg))
}

/// Whether the ICMPv6 checksum of an Ethernet + IPv6 + ICMPv6 frame holds.
pub fn checksum_ok(frame: &[u8]) -> bool {
    if frame.len() < 54 {
        return false;
    }
    let len = usize::from(u16::from_be_bytes([frame[18], frame[19]]));
    let Some(msg) = frame.get(54..54 + len) else {
        return false;
    };
    let src: [u8; 16] = frame[22..38].try_into().expect("16 bytes");
    let dst: [u8; 16] = frame[38..54].try_into().expect("16 bytes");
    fold(sum(&src) + sum(&dst) + len as u32 + 58 + sum(msg)) == 0xffff
}

/// The solicited-node multicast address of `target` and its MAC.
fn solicited_node(target: &Ipv6Addr) -> ([u8; 16], [u8; 6]) {
    let t = target.octets();
    let mut a = [0u8; 16];
    a[0] = 0xff;
    a[1] = 0x02;
    a[11] = 1;
    a[12] = 0xff;
    a[13..16].copy_from_slice(&t[13..16]);
    (a, [0x33, 0x33, 0xff, t[13], t[14], t[15]])
}

/// A Neighbor Solicitation frame for `target` from `src` at `mac`, with a
/// source link-layer option; `hop_limit` and `code` may be made invalid.
pub fn solicitation(
    mac: [u8; 6],
    src: Ipv6Addr,
    target: Ipv6Addr,
    hop_limit: u8,
    code: u8,
) -> Vec<u8> {
    let (dst, dst_mac) = solicited_node(&target);
    let mut f = vec![0u8; 86];
    f[0..6].copy_from_slice(&dst_mac);
    f[6..12].copy_from_slice(&mac);
    f[12..14].copy_from_slice(&ETH_P_IPV6.to_be_bytes());
    f[14..22].copy_from_slice(&[0x60, 0, 0, 0, 0, 32, 58, hop_limit]);
    f[22..38].copy_from_slice(&src.octets());
    f[38..54].copy_from_slice(&dst);
    f[54] = 135;
    f[55] = code;
    f[62..78].copy_from_slice(&target.octets());
    f[78..80].copy_from_slice(&[1, 1]);
    f[80..86].copy_from_slice(&mac);
    let c = checksum(&src.octets(), &dst, &f[54..]);
    f[56..58].copy_from_slice(&c.to_be_bytes());
    f
}

/// `ns` (from [`solicitation`]) without its source link-layer option
/// (`options` 0) or with a nonce option after it (`options` 2): other sizes
/// the responder must trim or grow to its 86-byte advertisement.
pub fn with_options(mut ns: Vec<u8>, options: usize) -> Vec<u8> {
    match options {
        0 => ns.truncate(78),
        _ => ns.extend_from_slice(&[14, 1, 1, 2, 3, 4, 5, 6]),
    }
    let payload = (ns.len() - 54) as u16;
    ns[18..20].copy_from_slice(&payload.to_be_bytes());
    ns[56..58].copy_from_slice(&[0, 0]);
    let src: [u8; 16] = ns[22..38].try_into().expect("16 bytes");
    let dst: [u8; 16] = ns[38..54].try_into().expect("16 bytes");
    let c = checksum(&src, &dst, &ns[54..]);
    ns[56..58].copy_from_slice(&c.to_be_bytes());
    ns
}

/// Sends `frame` as is on interface `ifindex` through the AF_PACKET socket
/// `fd`, addressed to the frame's own destination MAC, with `protocol` as
/// the link-layer protocol (0: none given).
///
/// # Errors
/// `sendto` failed.
pub fn send_frame(fd: &OwnedFd, ifindex: u32, protocol: u16, frame: &[u8]) -> anyhow::Result<()> {
    anyhow::ensure!(
        frame.len() >= 14,
        "a frame of {} bytes has no Ethernet header",
        frame.len()
    );
    // SAFETY: sockaddr_ll is plain data.
    let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sll.sll_family = libc::AF_PACKET as u16;
    sll.sll_protocol = protocol.to_be();
    sll.sll_ifindex = ifindex as i32;
    sll.sll_halen = 6;
    sll.sll_addr[..6].copy_from_slice(&frame[0..6]);
    // SAFETY: valid fd, buffer and address.
    let sent = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            frame.as_ptr().cast(),
            frame.len(),
            0,
            (&sll as *const libc::sockaddr_ll).cast(),
            size_of::<libc::sockaddr_ll>() as u32,
        )
    };
    if sent < 0 {
        return Err(std::io::Error::last_os_error()).context("sendto");
    }
    Ok(())
}

/// A raw IPv6 socket on one interface (call from inside its namespace).
pub struct Prober {
    fd: OwnedFd,
    ifindex: u32,
}

impl Prober {
    /// Opens the socket on `ifname`.
    ///
    /// # Errors
    /// No such interface, or the socket could not be made.
    pub fn open(ifname: &str) -> anyhow::Result<Self> {
        let name = std::ffi::CString::new(ifname)?;
        // SAFETY: valid C string.
        let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
        if ifindex == 0 {
            bail!("no interface {ifname}");
        }
        // SAFETY: plain socket(2).
        let raw = unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                i32::from(ETH_P_IPV6.to_be()),
            )
        };
        if raw < 0 {
            return Err(std::io::Error::last_os_error()).context("AF_PACKET socket");
        }
        // SAFETY: just opened, owned here.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: sockaddr_ll is plain data.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = ETH_P_IPV6.to_be();
        sll.sll_ifindex = ifindex as i32;
        // SAFETY: valid fd and address.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&sll as *const libc::sockaddr_ll).cast(),
                size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error()).context("bind");
        }
        Ok(Self { fd, ifindex })
    }

    /// Sends one frame.
    ///
    /// # Errors
    /// `sendto` failed.
    pub fn send(&self, frame: &[u8]) -> anyhow::Result<()> {
        send_frame(&self.fd, self.ifindex, ETH_P_IPV6, frame)
    }

    /// Incoming Neighbor Advertisements for `target` received within `wait`
    /// (whole frames).
    ///
    /// # Errors
    /// `recvfrom` failed.
    pub fn advertisements(&self, target: Ipv6Addr, wait: Duration) -> anyhow::Result<Vec<Vec<u8>>> {
        let end = Instant::now() + wait;
        let mut out = Vec::new();
        loop {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(out);
            }
            let mut pfd = libc::pollfd {
                fd: self.fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            let n = unsafe { libc::poll(&mut pfd, 1, left.as_millis().max(1) as i32) };
            if n <= 0 {
                continue;
            }
            let mut buf = [0u8; 2048];
            // SAFETY: sockaddr_ll is plain data.
            let mut from: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
            let mut from_len = size_of::<libc::sockaddr_ll>() as u32;
            // SAFETY: valid fd, buffer and address storage.
            let got = unsafe {
                libc::recvfrom(
                    self.fd.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    0,
                    (&mut from as *mut libc::sockaddr_ll).cast(),
                    &mut from_len,
                )
            };
            if got < 0 {
                return Err(std::io::Error::last_os_error()).context("recvfrom");
            }
            let f = &buf[..got as usize];
            let incoming = from.sll_pkttype != libc::PACKET_OUTGOING;
            if incoming
                && f.len() >= 78
                && f[20] == 58
                && f[54] == 136
                && f[62..78] == target.octets()
            {
                out.push(f.to_vec());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_solicitation_carries_a_valid_checksum_and_a_bad_one_fails() {
        let mut f = solicitation(
            [2, 0, 0, 0, 0, 2],
            "fd00:90::2".parse().unwrap(),
            "fd00:90::11".parse().unwrap(),
            255,
            0,
        );
        assert!(checksum_ok(&f));
        assert_eq!(
            &f[38..54],
            &"ff02::1:ff00:11".parse::<Ipv6Addr>().unwrap().octets()
        );
        for n in [0, 2] {
            let g = with_options(f.clone(), n);
            assert_eq!(g.len(), [78, 86, 94][n]);
            assert!(checksum_ok(&g), "{n} options");
        }
        f[70] ^= 1;
        assert!(!checksum_ok(&f));
    }
}
