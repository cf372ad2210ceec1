//! Raw `bpf(2)` map commands that aya 0.14 does not expose: batch update and
//! delete (reconcile programs thousands of entries per syscall instead of one),
//! and byte-level iteration used to migrate a map whose definition changed.
//!
//! Everything here works on a map fd and plain byte buffers; typed access goes
//! through aya. This module and the rest of `datapath` are the only code that
//! talks to the kernel's BPF subsystem.
//!
//! The commands and the `union bpf_attr` members are the kernel bindings
//! aya-obj generates (`aya_obj::generated`, the version aya 0.14 itself
//! uses), not hand copies; only the syscall itself is made here, because aya
//! keeps its own `bpf_*` wrappers private.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};

use aya_obj::generated::bpf_cmd::{
    self, BPF_MAP_CREATE, BPF_MAP_DELETE_BATCH, BPF_MAP_FREEZE, BPF_MAP_GET_NEXT_KEY,
    BPF_MAP_LOOKUP_BATCH, BPF_MAP_LOOKUP_ELEM, BPF_MAP_UPDATE_BATCH, BPF_MAP_UPDATE_ELEM,
};
use aya_obj::generated::{
    bpf_attr, bpf_attr__bindgen_ty_1 as CreateAttr, bpf_attr__bindgen_ty_2 as ElemAttr,
    bpf_attr__bindgen_ty_2__bindgen_ty_1 as ElemValue, bpf_attr__bindgen_ty_3 as BatchAttr,
    bpf_map_type,
};

/// `BPF_F_RDONLY_PROG`: programs may read the map, never write it.
pub const BPF_F_RDONLY_PROG: u32 = aya_obj::generated::BPF_F_RDONLY_PROG;

/// `BPF_ANY`: create or update.
pub const BPF_ANY: u64 = aya_obj::generated::BPF_ANY as u64;

/// The kernel's `union bpf_attr` or one of its members, as aya-obj generates
/// them: every member starts at offset 0, so a pointer to one and its size is
/// a valid `bpf_attr` prefix for the commands that use it (whose last field
/// ends the member, so the kernel checks no padding of it).
///
/// # Safety
/// Implemented only for the generated `#[repr(C)]` members, which hold
/// integers (and unions of integers) only, so all-zero is a valid value.
unsafe trait AttrPart: Copy {
    /// The member with every field zero (the kernel's "unset").
    fn zero() -> Self {
        // SAFETY: see the trait: plain integers, all-zero is valid.
        unsafe { std::mem::zeroed() }
    }
}

// SAFETY: generated #[repr(C)] members of `bpf_attr` holding integers only.
unsafe impl AttrPart for CreateAttr {}
// SAFETY: as above.
unsafe impl AttrPart for ElemAttr {}
// SAFETY: as above.
unsafe impl AttrPart for BatchAttr {}
// SAFETY: the whole union of such members.
unsafe impl AttrPart for bpf_attr {}

/// Why a raw map command failed.
#[derive(Debug, thiserror::Error)]
pub enum SysError {
    /// The syscall returned an error.
    #[error("bpf({command}) failed after {done} of {requested} elements")]
    Syscall {
        /// The bpf command.
        command: &'static str,
        /// Elements the kernel reported as done before the error (batch only).
        done: usize,
        /// Elements requested.
        requested: usize,
        /// The errno.
        #[source]
        source: io::Error,
    },
    /// Key or value buffers do not hold whole, matching elements.
    #[error(
        "batch buffers do not match: {keys} key bytes / {key_size} and {values} value bytes / {value_size}"
    )]
    BufferShape {
        /// Bytes of keys given.
        keys: usize,
        /// Key size of the map.
        key_size: usize,
        /// Bytes of values given.
        values: usize,
        /// Value size of the map.
        value_size: usize,
    },
}

impl SysError {
    /// The map had no room for another element (`E2BIG`).
    pub fn is_map_full(&self) -> bool {
        matches!(self, SysError::Syscall { source, .. } if source.raw_os_error() == Some(libc::E2BIG))
    }
}

fn bpf<T: AttrPart>(cmd: bpf_cmd, attr: &mut T) -> io::Result<()> {
    bpf_ret(cmd, attr).map(drop)
}

fn bpf_ret<T: AttrPart>(cmd: bpf_cmd, attr: &mut T) -> io::Result<libc::c_long> {
    syscall(
        cmd,
        (attr as *mut T).cast::<libc::c_void>(),
        size_of::<T>() as u32,
    )
}

/// The one place a `bpf(2)` syscall is made, as aya's `sys::syscall`: unit
/// tests replace it on their thread ([`testing::with_syscall`]) to drive
/// every caller's error paths without root or a kernel map.
fn syscall(cmd: bpf_cmd, attr: *mut libc::c_void, size: u32) -> io::Result<libc::c_long> {
    #[cfg(test)]
    if let Some(r) = testing::call(cmd, attr, size) {
        return r;
    }
    // SAFETY: `attr` points to a valid, initialised member of `bpf_attr`
    // ([`AttrPart`], from `bpf_ret`) of `size` bytes that lives for the
    // duration of the call; the kernel reads at most `size` bytes and
    // zero-extends the rest.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd as libc::c_long,
            attr,
            size as libc::c_uint,
        )
    };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// A stand-in for the `bpf(2)` syscall in unit tests (test builds only).
#[cfg(test)]
pub(crate) mod testing {
    use std::cell::RefCell;
    use std::io;

    use super::bpf_cmd;

    /// What a fake syscall gets: the command, the attribute's address and
    /// size (a `bpf_attr` member; cast it to the one the command uses).
    pub(crate) type Fake =
        Box<dyn FnMut(bpf_cmd, *mut libc::c_void, u32) -> io::Result<libc::c_long>>;

    thread_local! {
        static FAKE: RefCell<Option<Fake>> = const { RefCell::new(None) };
    }

    /// Runs `body` with every `bpf(2)` call on this thread answered by
    /// `fake`, then puts the real syscall back.
    pub(crate) fn with_syscall<R>(fake: Fake, body: impl FnOnce() -> R) -> R {
        struct Restore;
        impl Drop for Restore {
            fn drop(&mut self) {
                FAKE.with(|f| *f.borrow_mut() = None);
            }
        }
        FAKE.with(|f| *f.borrow_mut() = Some(fake));
        let _restore = Restore;
        body()
    }

    pub(super) fn call(
        cmd: bpf_cmd,
        attr: *mut libc::c_void,
        size: u32,
    ) -> Option<io::Result<libc::c_long>> {
        FAKE.with(|f| f.borrow_mut().as_mut().map(|fake| fake(cmd, attr, size)))
    }
}

fn one(command: &'static str) -> impl FnOnce(io::Error) -> SysError {
    move |source| SysError::Syscall {
        command,
        done: 0,
        requested: 1,
        source,
    }
}

/// Creates an array map of `max_entries` values of `value_size` bytes
/// (`BPF_MAP_CREATE`), named `name` (at most 15 bytes are kept).
///
/// # Errors
/// The kernel refused the map.
pub fn create_array(
    name: &str,
    value_size: u32,
    max_entries: u32,
    flags: u32,
) -> Result<std::os::fd::OwnedFd, SysError> {
    use std::os::fd::FromRawFd as _;
    let mut attr = CreateAttr {
        map_type: bpf_map_type::BPF_MAP_TYPE_ARRAY as u32,
        key_size: 4,
        value_size,
        max_entries,
        map_flags: flags,
        ..AttrPart::zero()
    };
    for (to, from) in attr.map_name.iter_mut().zip(name.bytes().take(15)) {
        *to = from as std::ffi::c_char;
    }
    let fd = bpf_ret(BPF_MAP_CREATE, &mut attr).map_err(one("BPF_MAP_CREATE"))?;
    // SAFETY: a successful BPF_MAP_CREATE returns a new descriptor we own.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) })
}

/// Freezes a map: no syscall may change it any more (`BPF_MAP_FREEZE`).
///
/// # Errors
/// The syscall's error.
pub fn freeze(fd: impl AsFd) -> Result<(), SysError> {
    // The whole union, zeroed: the kernel refuses any non-zero byte after
    // `map_fd`, and a member's padding is not guaranteed to be zero.
    let mut attr = bpf_attr::zero();
    attr.__bindgen_anon_2.map_fd = raw(fd.as_fd());
    bpf(BPF_MAP_FREEZE, &mut attr).map_err(one("BPF_MAP_FREEZE"))
}

/// Reads one raw element into `value` (`BPF_MAP_LOOKUP_ELEM`); `value`
/// must be the map's value size.
///
/// # Errors
/// The syscall's error (`ENOENT`: no such key).
pub fn lookup_raw(fd: impl AsFd, key: &[u8], value: &mut [u8]) -> Result<(), SysError> {
    let mut attr = ElemAttr {
        map_fd: raw(fd.as_fd()),
        key: key.as_ptr() as u64,
        __bindgen_anon_1: ElemValue {
            value: value.as_mut_ptr() as u64,
        },
        ..AttrPart::zero()
    };
    bpf(BPF_MAP_LOOKUP_ELEM, &mut attr).map_err(one("BPF_MAP_LOOKUP_ELEM"))
}

fn raw(fd: BorrowedFd<'_>) -> u32 {
    fd.as_raw_fd() as u32
}

/// Updates `keys.len() / key_size` elements in as few syscalls as the kernel
/// allows (`BPF_MAP_UPDATE_BATCH`, Linux 5.6).
///
/// # Errors
/// The first failing syscall, with how many elements were written before it.
///
/// # Minimum kernel version
/// 5.6 (batch map operations).
pub fn update_batch(
    fd: impl AsFd,
    key_size: usize,
    value_size: usize,
    keys: &[u8],
    values: &[u8],
) -> Result<(), SysError> {
    let n = check_shape(key_size, value_size, keys, values)?;
    let mut done = 0usize;
    while done < n {
        let mut attr = BatchAttr {
            keys: keys[done * key_size..].as_ptr() as u64,
            values: values[done * value_size..].as_ptr() as u64,
            count: (n - done) as u32,
            map_fd: raw(fd.as_fd()),
            elem_flags: BPF_ANY,
            ..AttrPart::zero()
        };
        let result = bpf(BPF_MAP_UPDATE_BATCH, &mut attr);
        // The kernel writes back how many elements it processed, even on error.
        done += attr.count as usize;
        if let Err(source) = result {
            return Err(SysError::Syscall {
                command: "BPF_MAP_UPDATE_BATCH",
                done,
                requested: n,
                source,
            });
        }
    }
    Ok(())
}

/// Reads every element of a hash map in bulk (`BPF_MAP_LOOKUP_BATCH`):
/// returns concatenated keys and values. Thousands of elements per syscall
/// instead of two syscalls per element.
///
/// # Errors
/// A failing syscall other than the end of the map.
///
/// # Minimum kernel version
/// 5.6 (batch map operations).
pub fn lookup_batch(
    fd: impl AsFd,
    key_size: usize,
    value_size: usize,
) -> Result<(Vec<u8>, Vec<u8>), SysError> {
    const CHUNK: usize = 4096;
    let mut keys = Vec::new();
    let mut values = Vec::new();
    let mut key_buf = vec![0u8; CHUNK * key_size];
    let mut value_buf = vec![0u8; CHUNK * value_size];
    // The batch token is opaque (a bucket index for hash maps); 64 bytes is
    // more than any map type uses.
    let mut token_in = [0u8; 64];
    let mut token_out = [0u8; 64];
    let mut first = true;
    loop {
        let mut attr = BatchAttr {
            in_batch: if first { 0 } else { token_in.as_ptr() as u64 },
            out_batch: token_out.as_mut_ptr() as u64,
            keys: key_buf.as_mut_ptr() as u64,
            values: value_buf.as_mut_ptr() as u64,
            count: CHUNK as u32,
            map_fd: raw(fd.as_fd()),
            ..AttrPart::zero()
        };
        let result = bpf(BPF_MAP_LOOKUP_BATCH, &mut attr);
        let n = attr.count as usize;
        keys.extend_from_slice(&key_buf[..n * key_size]);
        values.extend_from_slice(&value_buf[..n * value_size]);
        match result {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => break,
            Err(source) => {
                return Err(SysError::Syscall {
                    command: "BPF_MAP_LOOKUP_BATCH",
                    done: keys.len() / key_size.max(1),
                    requested: keys.len() / key_size.max(1),
                    source,
                });
            }
        }
        token_in = token_out;
        first = false;
    }
    Ok((keys, values))
}

/// A map key read back from raw bytes.
pub trait RawKey: Copy + Ord {
    /// Size in bytes.
    const SIZE: usize;
    /// The key from exactly [`RawKey::SIZE`] bytes.
    fn from_bytes(b: &[u8]) -> Self;
}

impl<const N: usize> RawKey for [u8; N] {
    const SIZE: usize = N;
    fn from_bytes(b: &[u8]) -> Self {
        let mut k = [0u8; N];
        k.copy_from_slice(b);
        k
    }
}

impl RawKey for u32 {
    const SIZE: usize = 4;
    fn from_bytes(b: &[u8]) -> Self {
        u32::from_ne_bytes([b[0], b[1], b[2], b[3]])
    }
}

/// Every entry of a map ([`lookup_batch`]), typed and sorted by key.
///
/// # Errors
/// As [`lookup_batch`].
pub fn read_entries<K: RawKey, V: aya::Pod>(
    fd: impl AsFd,
    key_size: usize,
) -> Result<Vec<(K, V)>, SysError> {
    debug_assert_eq!(key_size, K::SIZE);
    let vsize = size_of::<V>();
    let (keys, values) = lookup_batch(fd, K::SIZE, vsize)?;
    let mut out: Vec<(K, V)> = keys
        .chunks_exact(K::SIZE)
        .zip(values.chunks_exact(vsize))
        .map(|(k, v)| {
            // SAFETY: `v` holds exactly one V's bytes (plain data, any bit
            // pattern valid); read unaligned.
            let value = unsafe { std::ptr::read_unaligned(v.as_ptr().cast::<V>()) };
            (K::from_bytes(k), value)
        })
        .collect();
    out.sort_unstable_by_key(|e| e.0);
    Ok(out)
}

/// The elements of an array map created with `BPF_F_MMAPABLE` that hold
/// something (not `V::default()`), read through a read-only shared mapping
/// of its values: one memory copy instead of a kernel copy per element (a
/// 16384-slot array: ~0.1 ms instead of ~2.5 ms). Falls back to
/// [`read_entries`] when the map cannot be mapped (an array pinned without
/// the flag).
///
/// Empty elements are skipped while reading, never collected: the result
/// is as big as what the array holds, not as the array. (Collecting all
/// 16384 slots, ~0.9 MiB, on every announcement renewal, once a second,
/// grew the agent's RSS by ~8 MiB over the footprint bench's 100k cycles:
/// a buffer that size raises glibc's mmap threshold when freed, and then
/// fragments the heap.)
///
/// # Errors
/// As [`read_entries`], if the fallback fails.
///
/// # Minimum kernel version
/// 5.5 (mmapable arrays).
pub fn read_array<V: aya::Pod + Default + PartialEq>(
    fd: impl AsFd,
    max_entries: u32,
) -> Result<Vec<(u32, V)>, SysError> {
    // Values of an array map are laid out every round_up(value_size, 8) bytes.
    let stride = size_of::<V>().next_multiple_of(8);
    let len = stride * max_entries as usize;
    // SAFETY: a fresh read-only shared mapping of the map's value area; the
    // kernel validates the fd, flags and length.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            fd.as_fd().as_raw_fd(),
            0,
        )
    };
    if base == libc::MAP_FAILED {
        let mut all: Vec<(u32, V)> = read_entries(fd, 4)?;
        all.retain(|(_, v)| *v != V::default());
        all.shrink_to_fit();
        return Ok(all);
    }
    const { assert!(align_of::<V>() <= 8, "array values are 8-aligned") };
    let empty = V::default();
    // Slot arrays are mostly empty and an empty slot is all zero bytes:
    // a slot whose 64-bit words are all zero is skipped without reading
    // and comparing the value field by field (three 16,384-slot arrays
    // cost a third of a 100k-entry reconcile's own instructions that way).
    // The words past the value, up to the stride, are zero too (the
    // kernel's array is zeroed and holds only value_size bytes per slot).
    // SAFETY: `empty` is plain data of `size_of::<V>()` bytes.
    let empty_bytes =
        unsafe { std::slice::from_raw_parts((&empty as *const V).cast::<u8>(), size_of::<V>()) };
    let zero_is_empty = empty_bytes.iter().all(|b| *b == 0);
    let words = stride / 8;
    let out = (0..max_entries)
        .filter(|&i| {
            !zero_is_empty
                || (0..words).any(|w| {
                    // SAFETY: inside the mapping (`i * stride + stride <=
                    // len`), 8-aligned (page-aligned base, stride a
                    // multiple of 8); volatile for the reason below.
                    unsafe {
                        std::ptr::read_volatile(
                            base.cast::<u8>()
                                .add(i as usize * stride + w * 8)
                                .cast::<u64>(),
                        ) != 0
                    }
                })
        })
        .filter_map(|i| {
            // SAFETY: `i * stride + size_of::<V>() <= len`, inside the
            // mapping, and aligned for V (a page-aligned base, a stride of
            // a multiple of 8, V aligned to at most 8). The kernel and
            // programs write this memory behind the compiler's back: a
            // volatile read makes the compiler read it as it is now, never
            // assume it unchanged. V is plain data, so any bytes are a
            // valid V (a slot being rewritten may read torn, which
            // reconcile then rewrites).
            let v = unsafe {
                std::ptr::read_volatile(base.cast::<u8>().add(i as usize * stride).cast::<V>())
            };
            (v != empty).then_some((i, v))
        })
        .collect();
    // SAFETY: `base` and `len` are exactly what mmap returned and took.
    unsafe { libc::munmap(base, len) };
    Ok(out)
}

/// Deletes `keys.len() / key_size` elements (`BPF_MAP_DELETE_BATCH`). A key
/// that is not present is an error (`ENOENT`), as with single deletes.
///
/// # Errors
/// The first failing syscall.
///
/// # Minimum kernel version
/// 5.6 (batch map operations).
pub fn delete_batch(fd: impl AsFd, key_size: usize, keys: &[u8]) -> Result<(), SysError> {
    let n = check_shape(key_size, 1, keys, &vec![0; keys.len() / key_size.max(1)])?;
    let mut done = 0usize;
    while done < n {
        let mut attr = BatchAttr {
            keys: keys[done * key_size..].as_ptr() as u64,
            count: (n - done) as u32,
            map_fd: raw(fd.as_fd()),
            ..AttrPart::zero()
        };
        let result = bpf(BPF_MAP_DELETE_BATCH, &mut attr);
        done += attr.count as usize;
        if let Err(source) = result {
            return Err(SysError::Syscall {
                command: "BPF_MAP_DELETE_BATCH",
                done,
                requested: n,
                source,
            });
        }
    }
    Ok(())
}

fn check_shape(
    key_size: usize,
    value_size: usize,
    keys: &[u8],
    values: &[u8],
) -> Result<usize, SysError> {
    let shape = SysError::BufferShape {
        keys: keys.len(),
        key_size,
        values: values.len(),
        value_size,
    };
    if key_size == 0 || value_size == 0 || !keys.len().is_multiple_of(key_size) {
        return Err(shape);
    }
    let n = keys.len() / key_size;
    if values.len() != n * value_size {
        return Err(shape);
    }
    Ok(n)
}

/// A map element as raw bytes: (key, value).
pub type RawEntry = (Vec<u8>, Vec<u8>);

/// Every (key, value) of a map as raw bytes, by `GET_NEXT_KEY` + `LOOKUP_ELEM`.
/// Used only for migration, where the map's Rust types are not known.
///
/// # Errors
/// A failing syscall other than the end of iteration.
pub fn dump_raw(
    fd: impl AsFd,
    key_size: usize,
    value_size: usize,
) -> Result<Vec<RawEntry>, SysError> {
    let fd = raw(fd.as_fd());
    let mut out = Vec::new();
    let mut key: Option<Vec<u8>> = None;
    loop {
        let mut next = vec![0u8; key_size];
        let mut attr = ElemAttr {
            map_fd: fd,
            key: key.as_ref().map_or(0, |k| k.as_ptr() as u64),
            __bindgen_anon_1: ElemValue {
                value: next.as_mut_ptr() as u64,
            },
            ..AttrPart::zero()
        };
        match bpf(BPF_MAP_GET_NEXT_KEY, &mut attr) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => break,
            Err(source) => {
                return Err(SysError::Syscall {
                    command: "BPF_MAP_GET_NEXT_KEY",
                    done: out.len(),
                    requested: out.len(),
                    source,
                });
            }
        }
        let mut value = vec![0u8; value_size];
        let mut attr = ElemAttr {
            map_fd: fd,
            key: next.as_ptr() as u64,
            __bindgen_anon_1: ElemValue {
                value: value.as_mut_ptr() as u64,
            },
            ..AttrPart::zero()
        };
        match bpf(BPF_MAP_LOOKUP_ELEM, &mut attr) {
            Ok(()) => out.push((next.clone(), value)),
            // Deleted between the two calls: skip it.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(source) => {
                return Err(SysError::Syscall {
                    command: "BPF_MAP_LOOKUP_ELEM",
                    done: out.len(),
                    requested: out.len(),
                    source,
                });
            }
        }
        key = Some(next);
    }
    Ok(out)
}

/// Writes one raw element (`BPF_MAP_UPDATE_ELEM`, `BPF_ANY`).
///
/// # Errors
/// The syscall's error.
pub fn update_raw(fd: impl AsFd, key: &[u8], value: &[u8]) -> Result<(), SysError> {
    let mut attr = ElemAttr {
        map_fd: raw(fd.as_fd()),
        key: key.as_ptr() as u64,
        __bindgen_anon_1: ElemValue {
            value: value.as_ptr() as u64,
        },
        flags: BPF_ANY,
    };
    bpf(BPF_MAP_UPDATE_ELEM, &mut attr).map_err(|source| SysError::Syscall {
        command: "BPF_MAP_UPDATE_ELEM",
        done: 0,
        requested: 1,
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_is_checked_before_any_syscall() {
        assert!(check_shape(8, 32, &[0; 16], &[0; 64]).is_ok());
        assert!(matches!(
            check_shape(8, 32, &[0; 15], &[0; 64]),
            Err(SysError::BufferShape { .. })
        ));
        assert!(matches!(
            check_shape(8, 32, &[0; 16], &[0; 32]),
            Err(SysError::BufferShape { .. })
        ));
        assert!(matches!(
            check_shape(0, 32, &[], &[]),
            Err(SysError::BufferShape { .. })
        ));
    }

    use std::cell::RefCell;
    use std::rc::Rc;

    /// Any descriptor: the fake syscall never uses it.
    fn some_fd() -> std::fs::File {
        std::fs::File::open("/dev/null").expect("/dev/null")
    }

    /// The batch attribute a fake syscall was given.
    ///
    /// # Safety
    /// `attr` must be the `BatchAttr` of a batch command.
    unsafe fn batch<'a>(attr: *mut libc::c_void) -> &'a mut BatchAttr {
        // SAFETY: the caller's promise; the attribute outlives the call.
        unsafe { &mut *attr.cast::<BatchAttr>() }
    }

    /// Keys of 4 bytes 0..n, values of 8 bytes.
    fn elements(n: u32) -> (Vec<u8>, Vec<u8>) {
        let keys = (0..n).flat_map(u32::to_ne_bytes).collect();
        let values = (0..n).flat_map(|i| u64::from(i).to_ne_bytes()).collect();
        (keys, values)
    }

    #[test]
    fn update_batch_continues_where_the_kernel_stopped() {
        // A kernel that takes at most two elements per call: every call
        // starts at the first element not yet written.
        let seen = Rc::new(RefCell::new(Vec::new()));
        let log = seen.clone();
        let fake: testing::Fake = Box::new(move |cmd, attr, _| {
            assert_eq!(cmd, BPF_MAP_UPDATE_BATCH);
            // SAFETY: an update batch gets a `BatchAttr`.
            let a = unsafe { batch(attr) };
            // SAFETY: `keys` points into the caller's key buffer, 4 bytes a key.
            let first = unsafe { *(a.keys as *const u32) };
            log.borrow_mut().push((first, a.count));
            a.count = a.count.min(2);
            Ok(0)
        });
        let (keys, values) = elements(5);
        testing::with_syscall(fake, || update_batch(some_fd(), 4, 8, &keys, &values))
            .expect("all written");
        assert_eq!(*seen.borrow(), vec![(0, 5), (2, 3), (4, 1)]);
    }

    #[test]
    fn a_full_map_mid_batch_says_how_many_went_in() {
        let fake: testing::Fake = Box::new(|_, attr, _| {
            // SAFETY: an update batch gets a `BatchAttr`.
            unsafe { batch(attr) }.count = 3;
            Err(io::Error::from_raw_os_error(libc::E2BIG))
        });
        let (keys, values) = elements(5);
        let e = testing::with_syscall(fake, || update_batch(some_fd(), 4, 8, &keys, &values))
            .expect_err("full");
        assert!(e.is_map_full(), "{e}");
        assert!(matches!(
            e,
            SysError::Syscall {
                command: "BPF_MAP_UPDATE_BATCH",
                done: 3,
                requested: 5,
                ..
            }
        ));
        assert_eq!(
            e.to_string(),
            "bpf(BPF_MAP_UPDATE_BATCH) failed after 3 of 5 elements"
        );
    }

    #[test]
    fn delete_batch_reports_the_refusal_and_what_was_deleted() {
        let calls = Rc::new(RefCell::new(0));
        let count = calls.clone();
        let fake: testing::Fake = Box::new(move |cmd, attr, _| {
            assert_eq!(cmd, BPF_MAP_DELETE_BATCH);
            *count.borrow_mut() += 1;
            // SAFETY: a delete batch gets a `BatchAttr`.
            unsafe { batch(attr) }.count = 1;
            Err(io::Error::from_raw_os_error(libc::EPERM))
        });
        let (keys, _) = elements(4);
        let e =
            testing::with_syscall(fake, || delete_batch(some_fd(), 4, &keys)).expect_err("refused");
        assert_eq!(*calls.borrow(), 1, "no retry after a refusal");
        assert!(!e.is_map_full());
        assert!(matches!(
            e,
            SysError::Syscall {
                done: 1,
                requested: 4,
                ..
            }
        ));
    }

    #[test]
    fn a_bad_shape_makes_no_syscall() {
        let fake: testing::Fake = Box::new(|_, _, _| panic!("no syscall expected"));
        let e = testing::with_syscall(fake, || update_batch(some_fd(), 4, 8, &[0; 7], &[0; 8]))
            .expect_err("shape");
        assert!(matches!(e, SysError::BufferShape { keys: 7, .. }));
    }

    #[test]
    fn read_array_collects_only_the_elements_that_hold_something() {
        // A file laid out like a 16384-slot array of 16-byte values stands
        // in for the map: the mapping is read the same way.
        const SLOTS: u32 = 16_384;
        let held = [
            (3u32, [7u64, 1]),
            (4_000, [0, 9]),
            (SLOTS - 1, [u64::MAX, 0]),
        ];
        let mut bytes = vec![0u8; SLOTS as usize * 16];
        for (slot, v) in held {
            let at = slot as usize * 16;
            bytes[at..at + 8].copy_from_slice(&v[0].to_ne_bytes());
            bytes[at + 8..at + 16].copy_from_slice(&v[1].to_ne_bytes());
        }
        let path = std::env::temp_dir().join(format!(
            "lockstep-read-array-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::write(&path, &bytes).expect("write the array file");
        let file = std::fs::File::open(&path).expect("open the array file");
        let _ = std::fs::remove_file(&path);
        let read: Vec<(u32, [u64; 2])> = read_array(&file, SLOTS).expect("read");
        assert_eq!(
            read.len(),
            held.len(),
            "only the elements that hold something"
        );
        assert_eq!(read, held.to_vec());
        // Never a Vec of the whole array (16384 elements) for three.
        assert!(read.capacity() < 64, "capacity {}", read.capacity());
    }

    #[test]
    fn the_real_syscall_is_back_after_a_fake() {
        let fake: testing::Fake = Box::new(|_, _, _| Ok(0));
        testing::with_syscall(fake, || freeze(some_fd())).expect("faked");
        // /dev/null is no map: the kernel (or a refused bpf()) says so.
        assert!(freeze(some_fd()).is_err());
    }
}
