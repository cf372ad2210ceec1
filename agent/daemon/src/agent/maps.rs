//! Map I/O for verify and reconcile: the agent's view of the contents of the
//! maps it owns ([`MapContents`]), reading them from the pins, applying a
//! diff to them, and describing a diff as drift.
//!
//! It exists so that the reconcile logic deals in whole map contents and the
//! byte-level reading and writing of each map kind stays in one place.

use super::*;

/// Raw bytes of a plain-data map value.
pub(super) fn pod_bytes<T: aya::Pod>(v: &T) -> &[u8] {
    // SAFETY: `Pod` types are plain data with no padding bytes.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), size_of::<T>()) }
}

pub(super) fn lpm_key_bytes(prefix_len: u8, addr: &[u8]) -> Vec<u8> {
    let mut k = u32::from(prefix_len).to_ne_bytes().to_vec();
    k.extend_from_slice(addr);
    k
}

/// The desired contents of every map the agent owns, split the way the
/// datapath stores them (host entries in hashes, prefixes in tries).
#[derive(Debug, Default, PartialEq)]
pub(super) struct MapContents {
    /// L2_RESP_V4, sorted by address.
    pub(super) l2: Vec<(V4Addr, L2RespValue)>,
    /// ENDPOINTS, sorted by ifindex.
    pub(super) endpoints: Vec<(u32, EndpointValue)>,
    /// ENDPOINT_SLOTS that hold something, sorted by slot.
    pub(super) endpoint_slots: Vec<(u32, EndpointSlot)>,
    /// L2_RESP_SLOTS that hold something, sorted by slot.
    pub(super) l2_slots: Vec<(u32, L2RespSlot)>,
    /// Sorted by address, unique.
    pub(super) host_v4: Vec<(V4Addr, IpcacheValue)>,
    /// Sorted by address, unique.
    pub(super) host_v6: Vec<(V6Addr, IpcacheValue)>,
    pub(super) prefix_v4: BTreeMap<Ipv4Net, IpcacheValue>,
    pub(super) prefix_v6: BTreeMap<Ipv6Net, IpcacheValue>,
    pub(super) masq_v4: BTreeMap<Ipv4Net, MasqSkipValue>,
    pub(super) masq_v6: BTreeMap<Ipv6Net, MasqSkipValue>,
}

impl MapContents {
    pub(super) fn observe(maps: &PinnedMaps) -> Result<Self, AgentError> {
        let mut c = MapContents {
            l2: read_hash(maps, map_names::L2_RESP_V4)?,
            endpoints: read_hash(maps, map_names::ENDPOINTS)?,
            endpoint_slots: read_slots(
                maps,
                map_names::ENDPOINT_SLOTS,
                max_entries::ENDPOINT_SLOTS,
            )?,
            l2_slots: read_slots(maps, map_names::L2_RESP_SLOTS, max_entries::L2_RESP_SLOTS)?,
            host_v4: read_hash(maps, map_names::IPCACHE_HOST_V4)?,
            host_v6: read_hash(maps, map_names::IPCACHE_HOST_V6)?,
            ..MapContents::default()
        };
        let map_err = |e| AgentError::Program {
            map: "IPCACHE",
            source: Box::new(e),
        };
        Self::observe_tries(maps, &mut c).map_err(map_err)?;
        Ok(c)
    }

    pub(super) fn observe_tries(
        maps: &PinnedMaps,
        c: &mut MapContents,
    ) -> Result<(), aya::maps::MapError> {
        for item in maps.ipcache_v4().iter() {
            let (k, v) = item?;
            if let Ok(n) = Ipv4Net::new(k.data().into(), k.prefix_len() as u8) {
                c.prefix_v4.insert(n, v);
            }
        }
        for item in maps.ipcache_v6().iter() {
            let (k, v) = item?;
            if let Ok(n) = Ipv6Net::new(k.data().into(), k.prefix_len() as u8) {
                c.prefix_v6.insert(n, v);
            }
        }
        for item in maps.masq_skip_v4().iter() {
            let (k, v) = item?;
            if let Ok(n) = Ipv4Net::new(k.data().into(), k.prefix_len() as u8) {
                c.masq_v4.insert(n, v);
            }
        }
        for item in maps.masq_skip_v6().iter() {
            let (k, v) = item?;
            if let Ok(n) = Ipv6Net::new(k.data().into(), k.prefix_len() as u8) {
                c.masq_v6.insert(n, v);
            }
        }
        Ok(())
    }
}

/// A map key readable from raw bytes.
/// Reads a map in bulk and returns it sorted by key.
pub(super) fn read_hash<K: sys::RawKey, V: aya::Pod>(
    maps: &PinnedMaps,
    map: &'static str,
) -> Result<Vec<(K, V)>, AgentError> {
    let raw = maps.raw(map)?;
    sys::read_entries(raw.fd(), K::SIZE).map_err(|source| AgentError::Reconcile { map, source })
}

/// The slots of a slot array that hold something, sorted by slot.
pub(super) fn read_slots<V: aya::Pod + Default + PartialEq>(
    maps: &PinnedMaps,
    map: &'static str,
    slots: u32,
) -> Result<Vec<(u32, V)>, AgentError> {
    let raw = maps.raw(map)?;
    let mut all: Vec<(u32, V)> =
        sys::read_array(raw.fd(), slots).map_err(|source| AgentError::Reconcile { map, source })?;
    all.retain(|(_, v)| *v != V::default());
    Ok(all)
}

/// Applies one map's diff with batch syscalls: deletes first (frees room),
/// then adds and updates.
pub(super) fn apply<K: Ord + Clone, V: aya::Pod + Clone>(
    maps: &PinnedMaps,
    map: &'static str,
    d: &MapDiff<K, V>,
    key_bytes: impl Fn(&K) -> Vec<u8>,
    report: &mut ReconcileReport,
) -> Result<(), AgentError> {
    if d.is_empty() {
        return Ok(());
    }
    let raw = maps.raw(map)?;
    let mut key_size = 0;
    if !d.delete.is_empty() {
        let mut keys = Vec::new();
        for k in &d.delete {
            let b = key_bytes(k);
            key_size = b.len();
            keys.extend_from_slice(&b);
        }
        sys::delete_batch(raw.fd(), key_size, &keys)
            .map_err(|source| AgentError::Reconcile { map, source })?;
    }
    let writes: Vec<&(K, V)> = d.add.iter().chain(d.update.iter()).collect();
    if !writes.is_empty() {
        let mut keys = Vec::new();
        let mut values = Vec::with_capacity(writes.len() * size_of::<V>());
        for (k, v) in writes {
            let b = key_bytes(k);
            key_size = b.len();
            keys.extend_from_slice(&b);
            values.extend_from_slice(pod_bytes(v));
        }
        sys::update_batch(raw.fd(), key_size, size_of::<V>(), &keys, &values)
            .map_err(|source| AgentError::Reconcile { map, source })?;
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
) -> Result<(), AgentError> {
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
        .map_err(|source| AgentError::Reconcile { map, source })
}

/// Second half: the slots that must hold an entry get it (all of them empty
/// by now), and the whole diff is counted.
pub(super) fn fill_slots<V: aya::Pod + Default + Clone>(
    maps: &PinnedMaps,
    map: &'static str,
    d: &MapDiff<u32, V>,
    report: &mut ReconcileReport,
) -> Result<(), AgentError> {
    let writes = MapDiff {
        add: d.add.iter().chain(&d.update).cloned().collect(),
        update: Vec::new(),
        delete: Vec::new(),
    };
    apply(
        maps,
        map,
        &writes,
        |k| k.to_ne_bytes().to_vec(),
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
