//! The agent's side of the masquerade maps: writing MASQ_CONFIG and
//! collecting translations that have ended.
//!
//! Why here: the datapath module is the agent's only aya user; the
//! decision of what has ended is the core's (`lockstep_core::masquerade`),
//! handed in as a closure over plain numbers.

use std::collections::BTreeMap;

use aya::maps::{HashMap, MapData};
use lockstep_common::{
    MasqConfig, NatEndpointKey, NatKeyV4, NatKeyV6, NatValueV4, NatValueV6, endpoint_key_v4,
    endpoint_key_v6,
};

use super::{DatapathError, PinnedMaps};

/// What one collection found and did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NatSweep {
    /// Translations (forward entries) left, IPv4.
    pub v4: u64,
    /// Translations left, IPv6.
    pub v6: u64,
    /// Entries deleted (forward and reverse counted apart).
    pub deleted: u64,
    /// The lowest and highest translated port among the reverse entries
    /// left (both families), `None` when there are none.
    pub reply_ports: Option<(u16, u16)>,
}

/// One family's sweep: translations left, entries deleted, the hull of the
/// translated ports of the reverse entries left.
type Swept = (u64, u64, Option<(u16, u16)>);

fn widen(hull: Option<(u16, u16)>, port: u16) -> Option<(u16, u16)> {
    Some(hull.map_or((port, port), |(l, h)| (l.min(port), h.max(port))))
}

/// A NAT key and value of either family, as the collector needs them.
trait Tuple: Copy + aya::Pod {
    type Value: Copy + aya::Pod;
    /// The reverse key of a forward entry (the reply's tuple), and the
    /// forward key of a reverse entry: the same swap both ways.
    fn reverse(&self, v: &Self::Value) -> Self;
    fn proto(&self) -> u8;
    fn seen(v: &Self::Value) -> (u64, u8);
    /// A forward key's source: the endpoint's address.
    fn src(&self) -> std::net::IpAddr;
    /// A reverse value's address: the endpoint's.
    fn endpoint(v: &Self::Value) -> std::net::IpAddr;
    /// A reverse key's destination port: the translated port.
    fn dst_port(&self) -> u16;
    /// A forward key's source as a NAT_EP_* key.
    fn endpoint_key(&self) -> NatEndpointKey;
}

macro_rules! tuple {
    ($key:ty, $value:ty, $ep:path) => {
        impl Tuple for $key {
            type Value = $value;
            fn reverse(&self, v: &$value) -> Self {
                Self {
                    src_addr: self.dst_addr,
                    dst_addr: v.addr,
                    src_port: self.dst_port,
                    dst_port: v.port,
                    proto: self.proto,
                    _pad: [0; 3],
                }
            }
            fn proto(&self) -> u8 {
                self.proto
            }
            fn seen(v: &$value) -> (u64, u8) {
                (v.last_seen_ns, v.state)
            }
            fn src(&self) -> std::net::IpAddr {
                self.src_addr.into()
            }
            fn endpoint(v: &$value) -> std::net::IpAddr {
                v.addr.into()
            }
            fn dst_port(&self) -> u16 {
                self.dst_port
            }
            fn endpoint_key(&self) -> NatEndpointKey {
                $ep(self.src_addr)
            }
        }
    };
}
tuple!(NatKeyV4, NatValueV4, endpoint_key_v4);
tuple!(NatKeyV6, NatValueV6, endpoint_key_v6);

fn err(map: &'static str) -> impl Fn(aya::maps::MapError) -> DatapathError {
    move |source| DatapathError::OpenPin {
        pin: std::path::PathBuf::from(map),
        source: Box::new(source),
    }
}

/// One family's collection: a flow's activity is the later of its two
/// entries' times, its state the union of their bits. An ended flow loses
/// its forward entry first, then its reverse one: the translated port is
/// free (the reverse entry is what claims it) only once nothing translates
/// to it. A reverse entry whose forward one is gone (a new flow's claim
/// that lost its second insert) is collected by its own time.
type Pick<K> = fn(&mut PinnedMaps) -> &mut HashMap<MapData, K, <K as Tuple>::Value>;

fn remove<K: Tuple>(
    maps: &mut PinnedMaps,
    pick: Pick<K>,
    name: &'static str,
    key: &K,
) -> Result<u64, DatapathError> {
    match pick(maps).remove(key) {
        Ok(()) => Ok(1),
        Err(aya::maps::MapError::KeyNotFound) => Ok(0),
        Err(aya::maps::MapError::SyscallError(e))
            if e.io_error.raw_os_error() == Some(libc::ENOENT) =>
        {
            Ok(0)
        }
        Err(e) => Err(err(name)(e)),
    }
}

fn sweep<K: Tuple>(
    maps: &mut PinnedMaps,
    fwd: Pick<K>,
    rev: Pick<K>,
    names: (&'static str, &'static str),
    ended: &impl Fn(u8, u8, u64) -> bool,
    closed: &mut BTreeMap<NatEndpointKey, u64>,
) -> Result<Swept, DatapathError> {
    let mut left = 0;
    let mut deleted = 0;
    let forward: Vec<(K, K::Value)> = fwd(maps).iter().filter_map(Result::ok).collect();
    for (k, v) in forward {
        let rk = k.reverse(&v);
        let (mut seen, mut state) = K::seen(&v);
        if let Ok(rv) = rev(maps).get(&rk, 0) {
            let (rs, rst) = K::seen(&rv);
            seen = seen.max(rs);
            state |= rst;
        }
        if !ended(k.proto(), state, seen) {
            left += 1;
            continue;
        }
        // A packet since the walk read the entry (a new SYN on the tuple
        // starts it afresh): judged again at the next collection.
        match fwd(maps).get(&k, 0) {
            Ok(now) if K::seen(&now) != K::seen(&v) => {
                left += 1;
                continue;
            }
            _ => {}
        }
        let gone = remove(maps, fwd, names.0, &k)?;
        if gone > 0 {
            *closed.entry(k.endpoint_key()).or_default() += 1;
        }
        deleted += gone;
        deleted += remove(maps, rev, names.1, &rk)?;
    }
    let reverse: Vec<(K, K::Value)> = rev(maps).iter().filter_map(Result::ok).collect();
    let mut ports = None;
    for (rk, rv) in reverse {
        let (seen, state) = K::seen(&rv);
        let orphan = fwd(maps).get(&rk.reverse(&rv), 0).is_err();
        if orphan && ended(rk.proto(), state, seen) {
            deleted += remove(maps, rev, names.1, &rk)?;
        } else {
            ports = widen(ports, rk.dst_port());
        }
    }
    Ok((left, deleted, ports))
}

/// One family's translations of the endpoint `addr`: forward entries whose
/// source it is first (nothing is translated for it any more), then reverse
/// entries that lead back to it (the ports are free, and a reply can no
/// longer reach whoever holds the address next).
fn remove_endpoint<K: Tuple>(
    maps: &mut PinnedMaps,
    fwd: Pick<K>,
    rev: Pick<K>,
    names: (&'static str, &'static str),
    addr: std::net::IpAddr,
) -> Result<u64, DatapathError> {
    let mut deleted = 0;
    let forward: Vec<K> = fwd(maps)
        .iter()
        .filter_map(Result::ok)
        .filter(|(k, _)| k.src() == addr)
        .map(|(k, _)| k)
        .collect();
    for k in forward {
        deleted += remove(maps, fwd, names.0, &k)?;
    }
    let reverse: Vec<K> = rev(maps)
        .iter()
        .filter_map(Result::ok)
        .filter(|(_, v)| K::endpoint(v) == addr)
        .map(|(k, _)| k)
        .collect();
    for k in reverse {
        deleted += remove(maps, rev, names.1, &k)?;
    }
    Ok(deleted)
}

impl PinnedMaps {
    /// Writes MASQ_CONFIG (key 0). The programs read it per packet; a new
    /// value applies to new flows at once.
    ///
    /// # Errors
    /// The write was refused.
    pub fn set_masq_config(&mut self, config: MasqConfig) -> Result<(), DatapathError> {
        self.masq_config_mut()
            .set(0, config, 0)
            .map_err(err(lockstep_common::map_names::MASQ_CONFIG))
    }

    /// Deletes every translation `ended(proto, state, last_seen_ns)` says
    /// is over, in both families.
    ///
    /// # Errors
    /// A delete was refused for another reason than "already gone".
    pub fn collect_nat(
        &mut self,
        ended: impl Fn(u8, u8, u64) -> bool,
    ) -> Result<NatSweep, DatapathError> {
        use lockstep_common::map_names as n;
        let mut closed = BTreeMap::new();
        let swept4 = sweep::<NatKeyV4>(
            self,
            PinnedMaps::nat_fwd_v4_mut,
            PinnedMaps::nat_rev_v4_mut,
            (n::NAT_FWD_V4, n::NAT_REV_V4),
            &ended,
            &mut closed,
        );
        let swept6 = swept4.and_then(|s4| {
            sweep::<NatKeyV6>(
                self,
                PinnedMaps::nat_fwd_v6_mut,
                PinnedMaps::nat_rev_v6_mut,
                (n::NAT_FWD_V6, n::NAT_REV_V6),
                &ended,
                &mut closed,
            )
            .map(|s6| (s4, s6))
        });
        // What ended is counted even when a later delete failed: those
        // translations are gone.
        self.count_closed(&closed)?;
        let ((v4, d4, p4), (v6, d6, p6)) = swept6?;
        let reply_ports = match (p4, p6) {
            (Some((l, h)), other) | (other, Some((l, h))) => widen(widen(other, l), h),
            (None, None) => None,
        };
        Ok(NatSweep {
            v4,
            v6,
            deleted: d4 + d6,
            reply_ports,
        })
    }

    /// Adds `ended` (endpoint address → translations that ended) to
    /// NAT_EP_CLOSED, which only the agent writes.
    ///
    /// # Errors
    /// A write was refused.
    fn count_closed(&mut self, ended: &BTreeMap<NatEndpointKey, u64>) -> Result<(), DatapathError> {
        use lockstep_common::map_names as n;
        for (k, more) in ended {
            let before = self.nat_ep_closed().get(k, 0).unwrap_or(0);
            self.nat_ep_closed_mut()
                .insert(k, before + more, 0)
                .map_err(err(n::NAT_EP_CLOSED))?;
        }
        Ok(())
    }

    /// Translations the endpoint addresses hold (NAT_EP_OPENED less
    /// NAT_EP_CLOSED), IPv4 and IPv6: what the programs bound each
    /// endpoint by, and the table's fill without walking it.
    pub fn endpoint_translations(&self) -> BTreeMap<std::net::IpAddr, u64> {
        let mut held = BTreeMap::new();
        for (k, opened) in self.nat_ep_opened().iter().filter_map(Result::ok) {
            let closed = self.nat_ep_closed().get(&k, 0).unwrap_or(0);
            let addr = std::net::Ipv6Addr::from(k);
            let addr = match addr.to_ipv4_mapped() {
                Some(v4) => std::net::IpAddr::V4(v4),
                None => std::net::IpAddr::V6(addr),
            };
            held.insert(addr, opened.saturating_sub(closed));
        }
        held
    }

    /// Capacity of the NAT maps (NAT_FWD_V4's `max_entries`; all four are
    /// made alike).
    pub fn nat_capacity(&self) -> u32 {
        self.open_source(lockstep_common::map_names::NAT_FWD_V4)
            .ok()
            .and_then(|m| m.info().ok())
            .map_or(lockstep_common::max_entries::NAT, |i| i.max_entries())
    }

    /// Deletes every translation of the endpoint address `addr` (a DEL):
    /// its forward entries, then the reverse entries that lead to it, then
    /// its NAT_EP_* counts (the next holder of the address starts at 0).
    /// Returns how many NAT entries went. Walks the family's two NAT maps.
    ///
    /// # Errors
    /// A delete was refused for another reason than "already gone".
    pub fn remove_nat_of(&mut self, addr: std::net::IpAddr) -> Result<u64, DatapathError> {
        use lockstep_common::map_names as n;
        let deleted = match addr {
            std::net::IpAddr::V4(_) => remove_endpoint::<NatKeyV4>(
                self,
                PinnedMaps::nat_fwd_v4_mut,
                PinnedMaps::nat_rev_v4_mut,
                (n::NAT_FWD_V4, n::NAT_REV_V4),
                addr,
            ),
            std::net::IpAddr::V6(_) => remove_endpoint::<NatKeyV6>(
                self,
                PinnedMaps::nat_fwd_v6_mut,
                PinnedMaps::nat_rev_v6_mut,
                (n::NAT_FWD_V6, n::NAT_REV_V6),
                addr,
            ),
        }?;
        let key = match addr {
            std::net::IpAddr::V4(a) => endpoint_key_v4(a.octets()),
            std::net::IpAddr::V6(a) => endpoint_key_v6(a.octets()),
        };
        for name in [n::NAT_EP_OPENED, n::NAT_EP_CLOSED] {
            let map = if name == n::NAT_EP_OPENED {
                self.nat_ep_opened_mut()
            } else {
                self.nat_ep_closed_mut()
            };
            match map.remove(&key) {
                Ok(()) | Err(aya::maps::MapError::KeyNotFound) => {}
                Err(aya::maps::MapError::SyscallError(e))
                    if e.io_error.raw_os_error() == Some(libc::ENOENT) => {}
                Err(e) => return Err(err(name)(e)),
            }
        }
        Ok(deleted)
    }

    /// Clears NAT_EP_OPENED and NAT_EP_CLOSED (masquerade turned off, every
    /// translation deleted).
    ///
    /// # Errors
    /// A delete was refused.
    pub fn clear_endpoint_counts(&mut self) -> Result<(), DatapathError> {
        use lockstep_common::map_names as n;
        let keys: Vec<NatEndpointKey> =
            self.nat_ep_opened().keys().filter_map(Result::ok).collect();
        for k in &keys {
            let _ = self.nat_ep_opened_mut().remove(k);
        }
        let keys: Vec<NatEndpointKey> =
            self.nat_ep_closed().keys().filter_map(Result::ok).collect();
        for k in &keys {
            self.nat_ep_closed_mut()
                .remove(k)
                .map_err(err(n::NAT_EP_CLOSED))?;
        }
        Ok(())
    }
}
