//! Map I/O for the table's entries: reading each map kind from its pin
//! into [`MapContents`](super::MapContents), applying a diff to it, and
//! describing a diff as drift.
//!
//! It exists so that the table's walkers (verify, reconcile, the
//! announcements) deal in whole map contents and the byte-level reading and
//! writing of each map kind stays in one place.

use lockstep_core::plan::MapDiff;

use super::{Drift, MapTableError, ReconcileReport};
use crate::datapath::{PinnedMaps, sys};

/// Raw bytes of a plain-data map value.
pub(super) fn pod_bytes<T: aya::Pod>(v: &T) -> &[u8] {
    // SAFETY: `Pod` types are plain data with no padding bytes.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), size_of::<T>()) }
}

/// Appends an LPM trie key (prefix length, then the address) to `out`.
pub(super) fn lpm_key_bytes(prefix_len: u8, addr: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&u32::from(prefix_len).to_ne_bytes());
    out.extend_from_slice(addr);
}

/// Reads a map in bulk and returns it sorted by key.
pub(super) fn read_hash<K: sys::RawKey, V: aya::Pod>(
    maps: &PinnedMaps,
    map: &'static str,
) -> Result<Vec<(K, V)>, MapTableError> {
    let raw = maps.raw(map)?;
    sys::read_entries(raw.fd(), K::SIZE).map_err(|source| MapTableError::Reconcile { map, source })
}

/// The slots of a slot array that hold something, sorted by slot.
pub(super) fn read_slots<V: aya::Pod + Default + PartialEq>(
    maps: &PinnedMaps,
    map: &'static str,
    slots: u32,
) -> Result<Vec<(u32, V)>, MapTableError> {
    let raw = maps.raw(map)?;
    sys::read_array(raw.fd(), slots).map_err(|source| MapTableError::Reconcile { map, source })
}

/// Applies one map's diff with batch syscalls: deletes first (frees room),
/// then adds and updates.
pub(super) fn apply<K: Ord + Clone, V: aya::Pod + Clone>(
    maps: &PinnedMaps,
    map: &'static str,
    d: &MapDiff<K, V>,
    key_bytes: impl Fn(&K, &mut Vec<u8>),
    report: &mut ReconcileReport,
) -> Result<(), MapTableError> {
    if d.is_empty() {
        return Ok(());
    }
    let raw = maps.raw(map)?;
    // The keys of one map share one size.
    let key_size = |keys: &[u8], n: usize| keys.len() / n.max(1);
    if !d.delete.is_empty() {
        let mut keys = Vec::new();
        for k in &d.delete {
            key_bytes(k, &mut keys);
        }
        sys::delete_batch(raw.fd(), key_size(&keys, d.delete.len()), &keys)
            .map_err(|source| MapTableError::Reconcile { map, source })?;
    }
    let n = d.add.len() + d.update.len();
    if n > 0 {
        let mut keys = Vec::with_capacity(n * 16);
        let mut values = Vec::with_capacity(n * size_of::<V>());
        for (k, v) in d.add.iter().chain(d.update.iter()) {
            key_bytes(k, &mut keys);
            values.extend_from_slice(pod_bytes(v));
        }
        sys::update_batch(raw.fd(), key_size(&keys, n), size_of::<V>(), &keys, &values)
            .map_err(|source| MapTableError::Reconcile { map, source })?;
    }
    report.added += d.add.len();
    report.updated += d.update.len();
    report.removed += d.delete.len();
    *report.per_map.entry(map.to_string()).or_default() += d.len();
    Ok(())
}

/// First half of a slot array's diff: every slot that must lose what it
/// holds (to nothing or to another entry) is zeroed.
pub(super) fn clear_slots<V: aya::Pod + Default>(
    maps: &PinnedMaps,
    map: &'static str,
    d: &MapDiff<u32, V>,
) -> Result<(), MapTableError> {
    let slots: Vec<u32> = d
        .delete
        .iter()
        .copied()
        .chain(d.update.iter().map(|(k, _)| *k))
        .collect();
    if slots.is_empty() {
        return Ok(());
    }
    let raw = maps.raw(map)?;
    let keys: Vec<u8> = slots.iter().flat_map(|k| k.to_ne_bytes()).collect();
    let zero = V::default();
    let values: Vec<u8> = slots
        .iter()
        .flat_map(|_| pod_bytes(&zero).to_vec())
        .collect();
    sys::update_batch(raw.fd(), 4, size_of::<V>(), &keys, &values)
        .map_err(|source| MapTableError::Reconcile { map, source })
}

/// Second half: the slots that must hold an entry get it (all of them empty
/// by now), and the whole diff is counted.
pub(super) fn fill_slots<V: aya::Pod + Default + Clone>(
    maps: &PinnedMaps,
    map: &'static str,
    d: &MapDiff<u32, V>,
    report: &mut ReconcileReport,
) -> Result<(), MapTableError> {
    let writes = MapDiff {
        add: d.add.iter().chain(&d.update).cloned().collect(),
        update: Vec::new(),
        delete: Vec::new(),
    };
    apply(
        maps,
        map,
        &writes,
        |k, out| out.extend_from_slice(&k.to_ne_bytes()),
        &mut ReconcileReport::default(),
    )?;
    report.added += d.add.len();
    report.updated += d.update.len();
    report.removed += d.delete.len();
    if !d.is_empty() {
        *report.per_map.entry(map.to_string()).or_default() += d.len();
    }
    Ok(())
}

pub(super) fn drift<K, V>(
    map: &str,
    d: &MapDiff<K, V>,
    show: impl Fn(&K) -> String,
    out: &mut Vec<Drift>,
) {
    let mut push = |k: &K, kind: &str| {
        out.push(Drift {
            map: map.to_string(),
            key: show(k),
            kind: kind.to_string(),
        })
    };
    for (k, _) in &d.add {
        push(k, "missing");
    }
    for (k, _) in &d.update {
        push(k, "different");
    }
    for k in &d.delete {
        push(k, "unexpected");
    }
}
