//! Word-sized loads and stores of packet bytes at any alignment.
//!
//! Why this module exists: the headers the NDP responder reads and rewrites put
//! their fields at offsets that are not multiples of their size (the IPv6
//! addresses of a Neighbor Solicitation at 22, 38 and 62), and Rust's
//! unaligned reads and writes compile for BPF into a byte load, shift and
//! or per byte — sixteen of each per IPv6 address, and stack frames the
//! verifier's 512-byte budget could not hold. The verifier allows
//! misaligned packet access, so these write one `ldx`/`stx` per field, its
//! offset an immediate, in `asm!`.
//!
//! Every function is `unsafe`: the caller has checked against `data_end`
//! that the bytes it touches are inside the linear packet data.

/// A 32-bit load from the frame at `data + OFF`, at any alignment.
///
/// Why assembly: the IPv6 addresses sit at frame offsets 22, 38 and 62, not
/// 4-aligned, and Rust's unaligned reads compile for BPF into a byte load,
/// shift and or per byte (sixteen of each per address, and a stack frame
/// the verifier's 512-byte budget could not hold). The verifier allows
/// misaligned packet access, so one `ldxw` per word, its offset an
/// immediate, is what we write.
///
/// # Safety
/// `OFF + 4` bytes from `data` must be inside the linear packet data.
#[inline(always)]
pub(crate) unsafe fn ld32<const OFF: usize>(data: usize) -> u32 {
    let v: u64;
    // SAFETY: the caller's bounds; a plain load, no other effect.
    unsafe {
        core::arch::asm!(
            "{v} = *(u32 *)({p} + {off})",
            v = lateout(reg) v,
            p = in(reg) data,
            off = const OFF,
            options(pure, readonly, nostack, preserves_flags)
        );
    }
    v as u32
}

/// A 16-bit load, as [`ld32`].
///
/// # Safety
/// As [`ld32`], for 2 bytes.
#[inline(always)]
pub(crate) unsafe fn ld16<const OFF: usize>(data: usize) -> u16 {
    let v: u64;
    // SAFETY: as in `ld32`.
    unsafe {
        core::arch::asm!(
            "{v} = *(u16 *)({p} + {off})",
            v = lateout(reg) v,
            p = in(reg) data,
            off = const OFF,
            options(pure, readonly, nostack, preserves_flags)
        );
    }
    v as u16
}

/// A 32-bit store into the frame, as [`ld32`].
///
/// # Safety
/// As [`ld32`]; TC programs may write packet data.
#[inline(always)]
pub(crate) unsafe fn st32<const OFF: usize>(data: usize, v: u32) {
    // SAFETY: the caller's bounds.
    unsafe {
        core::arch::asm!(
            "*(u32 *)({p} + {off}) = {v}",
            p = in(reg) data,
            v = in(reg) u64::from(v),
            off = const OFF,
            options(nostack, preserves_flags)
        );
    }
}

/// A 16-bit store, as [`st32`].
///
/// # Safety
/// As [`st32`], for 2 bytes.
#[inline(always)]
pub(crate) unsafe fn st16<const OFF: usize>(data: usize, v: u16) {
    // SAFETY: the caller's bounds.
    unsafe {
        core::arch::asm!(
            "*(u16 *)({p} + {off}) = {v}",
            p = in(reg) data,
            v = in(reg) u64::from(v),
            off = const OFF,
            options(nostack, preserves_flags)
        );
    }
}

/// The four native words of the IPv6 address at `OFF`.
///
/// # Safety
/// As [`ld32`], for 16 bytes.
#[inline(always)]
pub(crate) unsafe fn ld_addr<const OFF: usize>(data: usize) -> [u32; 4] {
    let (a, b, c, d): (u64, u64, u64, u64);
    // SAFETY: the caller's bounds; plain loads.
    unsafe {
        core::arch::asm!(
            "{a} = *(u32 *)({p} + {o0})",
            "{b} = *(u32 *)({p} + {o1})",
            "{c} = *(u32 *)({p} + {o2})",
            "{d} = *(u32 *)({p} + {o3})",
            a = lateout(reg) a,
            b = lateout(reg) b,
            c = lateout(reg) c,
            d = lateout(reg) d,
            p = in(reg) data,
            o0 = const OFF,
            o1 = const OFF + 4,
            o2 = const OFF + 8,
            o3 = const OFF + 12,
            options(pure, readonly, nostack, preserves_flags)
        );
    }
    [a as u32, b as u32, c as u32, d as u32]
}

/// The two native 64-bit halves of the IPv6 address at `OFF`.
///
/// # Safety
/// As [`ld32`], for 16 bytes.
#[inline(always)]
pub(crate) unsafe fn ld_addr64<const OFF: usize>(data: usize) -> [u64; 2] {
    let (a, b): (u64, u64);
    // SAFETY: the caller's bounds; plain loads.
    unsafe {
        core::arch::asm!(
            "{a} = *(u64 *)({p} + {o0})",
            "{b} = *(u64 *)({p} + {o1})",
            a = lateout(reg) a,
            b = lateout(reg) b,
            p = in(reg) data,
            o0 = const OFF,
            o1 = const OFF + 8,
            options(pure, readonly, nostack, preserves_flags)
        );
    }
    [a, b]
}

/// Stores an address's four native words at `OFF`.
///
/// # Safety
/// As [`st32`], for 16 bytes.
#[inline(always)]
pub(crate) unsafe fn st_addr<const OFF: usize>(data: usize, w: [u32; 4]) {
    // SAFETY: the caller's bounds.
    unsafe {
        core::arch::asm!(
            "*(u32 *)({p} + {o0}) = {a}",
            "*(u32 *)({p} + {o1}) = {b}",
            "*(u32 *)({p} + {o2}) = {c}",
            "*(u32 *)({p} + {o3}) = {d}",
            p = in(reg) data,
            a = in(reg) u64::from(w[0]),
            b = in(reg) u64::from(w[1]),
            c = in(reg) u64::from(w[2]),
            d = in(reg) u64::from(w[3]),
            o0 = const OFF,
            o1 = const OFF + 4,
            o2 = const OFF + 8,
            o3 = const OFF + 12,
            options(nostack, preserves_flags)
        );
    }
}

/// A MAC as the native word and half-word that hold its bytes in order.
#[inline(always)]
pub(crate) fn mac_words(m: [u8; 6]) -> (u32, u16) {
    (
        u32::from_ne_bytes([m[0], m[1], m[2], m[3]]),
        u16::from_ne_bytes([m[4], m[5]]),
    )
}
