//! Typed access to lockstep's pinned maps.
//!
//! The CLI opens the maps from their pins ([`PinnedMaps::open`]), so it can
//! read them while the agent is down. The agent opens them through the
//! descriptors it loaded its programs with ([`PinnedMaps::open_held`]), so it
//! reads and writes exactly what the programs see even when a pin is removed
//! or replaced (see [`super::pins`]). ENDPOINTS and L2_RESP_V4 are written only together with
//! their slot arrays (`endpoint_insert`, `l2_insert` and their removals), in
//! the order and with the clear-first rule that `lockstep_common::slots`
//! explains, so no caller can leave a slot behind its hash.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};

use aya::maps::lpm_trie::Key;
use aya::maps::{Array, HashMap, LpmTrie, Map, MapData, PerCpuArray};
use lockstep_common::{
    Counter, EndpointSlot, EndpointValue, IpcacheValue, L2RespSlot, L2RespSlotV6, L2RespValue,
    MasqConfig, MasqSkipValue, NatEndpointKey, NatKeyV4, NatKeyV6, NatValueV4, NatValueV6, V4Addr,
    V6Addr, map_names, slots,
};
use lockstep_core::plan::slot_holder;

use super::{DatapathError, sys};

/// Every pinned map, typed.
pub struct PinnedMaps {
    /// IPCACHE_V4.
    ipcache_v4: LpmTrie<MapData, V4Addr, IpcacheValue>,
    /// IPCACHE_V6.
    ipcache_v6: LpmTrie<MapData, V6Addr, IpcacheValue>,
    /// IPCACHE_HOST_V4.
    ipcache_host_v4: HashMap<MapData, V4Addr, IpcacheValue>,
    /// IPCACHE_HOST_V6.
    ipcache_host_v6: HashMap<MapData, V6Addr, IpcacheValue>,
    /// MASQ_SKIP_V4.
    masq_skip_v4: LpmTrie<MapData, V4Addr, MasqSkipValue>,
    /// MASQ_SKIP_V6.
    masq_skip_v6: LpmTrie<MapData, V6Addr, MasqSkipValue>,
    /// ENDPOINTS.
    endpoints: HashMap<MapData, u32, EndpointValue>,
    /// L2_RESP_V4.
    l2_resp_v4: HashMap<MapData, V4Addr, L2RespValue>,
    /// L2_RESP_V6.
    l2_resp_v6: HashMap<MapData, V6Addr, L2RespValue>,
    /// COUNTERS.
    counters: PerCpuArray<MapData, u64>,
    /// ENDPOINT_SLOTS. Written through [`PinnedMaps::endpoint_insert`] and
    /// [`PinnedMaps::endpoint_remove`] (or a reconcile), never alone.
    endpoint_slots: Array<MapData, EndpointSlot>,
    /// L2_RESP_SLOTS. Written through [`PinnedMaps::l2_insert`] and
    /// [`PinnedMaps::l2_remove`] (or a reconcile), never alone.
    l2_resp_slots: Array<MapData, L2RespSlot>,
    /// L2_RESP6_SLOTS. Written through [`PinnedMaps::l2_insert_v6`] and
    /// [`PinnedMaps::l2_remove_v6`] (or a reconcile), never alone.
    l2_resp6_slots: Array<MapData, L2RespSlotV6>,
    /// NAT_FWD_V4.
    nat_fwd_v4: HashMap<MapData, NatKeyV4, NatValueV4>,
    /// NAT_FWD_V6.
    nat_fwd_v6: HashMap<MapData, NatKeyV6, NatValueV6>,
    /// NAT_REV_V4.
    nat_rev_v4: HashMap<MapData, NatKeyV4, NatValueV4>,
    /// NAT_REV_V6.
    nat_rev_v6: HashMap<MapData, NatKeyV6, NatValueV6>,
    /// MASQ_CONFIG.
    masq_config: Array<MapData, MasqConfig>,
    /// TUNNEL_CONFIG.
    tunnel_config: Array<MapData, lockstep_common::TunnelConfig>,
    nat_ep_opened: HashMap<MapData, NatEndpointKey, u64>,
    nat_ep_closed: HashMap<MapData, NatEndpointKey, u64>,
    /// Where untyped handles come from.
    source: Source,
}

/// Where a [`PinnedMaps`] opens its maps.
enum Source {
    /// The pins in `<pin_root>/maps`.
    Pins(PathBuf),
    /// The maps the agent's programs use, by descriptor.
    Held(std::collections::BTreeMap<&'static str, MapData>),
}

impl Source {
    fn open(&self, name: &str) -> Result<MapData, DatapathError> {
        match self {
            Source::Pins(dir) => {
                let pin: PathBuf = dir.join(name);
                MapData::from_pin(&pin).map_err(|source| DatapathError::OpenPin {
                    pin,
                    source: Box::new(source),
                })
            }
            Source::Held(maps) => {
                use std::os::fd::AsFd as _;
                let (map, data) =
                    maps.get_key_value(name)
                        .ok_or_else(|| DatapathError::MapAccess {
                            action: "open",
                            map: "(unknown map)",
                            source: format!("no map named {name}").into(),
                        })?;
                let access =
                    |source: Box<dyn std::error::Error + Send + Sync>| DatapathError::MapAccess {
                        action: "open",
                        map,
                        source,
                    };
                let fd = data
                    .fd()
                    .as_fd()
                    .try_clone_to_owned()
                    .map_err(|e| access(Box::new(e)))?;
                MapData::from_fd(fd).map_err(|e| access(Box::new(e)))
            }
        }
    }
}

impl std::fmt::Debug for PinnedMaps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedMaps").finish_non_exhaustive()
    }
}

fn open_map(source: &Source, name: &str) -> Result<Map, DatapathError> {
    let open_err = |e| DatapathError::OpenPin {
        pin: PathBuf::from(name),
        source: Box::new(e),
    };
    Map::from_map_data(source.open(name)?).map_err(open_err)
}

macro_rules! typed {
    ($source:expr, $name:expr) => {{
        let map = open_map($source, $name)?;
        map.try_into().map_err(|source| DatapathError::OpenPin {
            pin: PathBuf::from($name),
            source: Box::new(source),
        })?
    }};
}

/// Read access to every map, write access to the maps a caller may change
/// alone. ENDPOINTS, L2_RESP_V4 and their slot arrays are written through
/// [`PinnedMaps::endpoint_insert`] and [`PinnedMaps::l2_insert`] (see the
/// module doc); their writable accessors exist for the tests and benchmarks
/// that break that rule on purpose (a torn-read stress, an emptied slot).
macro_rules! accessors {
    ($($(#[$doc:meta])* $field:ident $(/ $field_mut:ident)?: $ty:ty;)*) => {
        impl PinnedMaps {
            $(
                $(#[$doc])*
                pub fn $field(&self) -> &$ty {
                    &self.$field
                }
                $(
                    /// The same map, writable.
                    pub fn $field_mut(&mut self) -> &mut $ty {
                        &mut self.$field
                    }
                )?
            )*
        }
    };
}

accessors! {
    /// IPCACHE_V4.
    ipcache_v4 / ipcache_v4_mut: LpmTrie<MapData, V4Addr, IpcacheValue>;
    /// IPCACHE_V6.
    ipcache_v6 / ipcache_v6_mut: LpmTrie<MapData, V6Addr, IpcacheValue>;
    /// IPCACHE_HOST_V4.
    ipcache_host_v4 / ipcache_host_v4_mut: HashMap<MapData, V4Addr, IpcacheValue>;
    /// IPCACHE_HOST_V6.
    ipcache_host_v6 / ipcache_host_v6_mut: HashMap<MapData, V6Addr, IpcacheValue>;
    /// MASQ_SKIP_V4.
    masq_skip_v4 / masq_skip_v4_mut: LpmTrie<MapData, V4Addr, MasqSkipValue>;
    /// MASQ_SKIP_V6.
    masq_skip_v6 / masq_skip_v6_mut: LpmTrie<MapData, V6Addr, MasqSkipValue>;
    /// ENDPOINTS (written through [`PinnedMaps::endpoint_insert`]).
    endpoints / endpoints_mut: HashMap<MapData, u32, EndpointValue>;
    /// L2_RESP_V4 (written through [`PinnedMaps::l2_insert`]).
    l2_resp_v4 / l2_resp_v4_mut: HashMap<MapData, V4Addr, L2RespValue>;
    /// L2_RESP_V6 (written through [`PinnedMaps::l2_insert_v6`]).
    l2_resp_v6 / l2_resp_v6_mut: HashMap<MapData, V6Addr, L2RespValue>;
    /// ENDPOINT_SLOTS (written through [`PinnedMaps::endpoint_insert`]).
    endpoint_slots / endpoint_slots_mut: Array<MapData, EndpointSlot>;
    /// L2_RESP_SLOTS (written through [`PinnedMaps::l2_insert`]).
    l2_resp_slots / l2_resp_slots_mut: Array<MapData, L2RespSlot>;
    /// L2_RESP6_SLOTS (written through [`PinnedMaps::l2_insert_v6`]).
    l2_resp6_slots / l2_resp6_slots_mut: Array<MapData, L2RespSlotV6>;
    /// NAT_FWD_V4 (see `lockstep_common::nat`).
    nat_fwd_v4 / nat_fwd_v4_mut: HashMap<MapData, NatKeyV4, NatValueV4>;
    /// NAT_FWD_V6.
    nat_fwd_v6 / nat_fwd_v6_mut: HashMap<MapData, NatKeyV6, NatValueV6>;
    /// NAT_REV_V4.
    nat_rev_v4 / nat_rev_v4_mut: HashMap<MapData, NatKeyV4, NatValueV4>;
    /// NAT_REV_V6.
    nat_rev_v6 / nat_rev_v6_mut: HashMap<MapData, NatKeyV6, NatValueV6>;
    /// MASQ_CONFIG (one entry, key 0).
    masq_config / masq_config_mut: Array<MapData, MasqConfig>;
    /// TUNNEL_CONFIG (one entry, key 0; see [`PinnedMaps::set_tunnel_config`]).
    tunnel_config / tunnel_config_mut: Array<MapData, lockstep_common::TunnelConfig>;
    /// NAT_EP_OPENED (the programs' count; read only here).
    nat_ep_opened / nat_ep_opened_mut: HashMap<MapData, NatEndpointKey, u64>;
    /// NAT_EP_CLOSED (the collector's count).
    nat_ep_closed / nat_ep_closed_mut: HashMap<MapData, NatEndpointKey, u64>;
}

impl PinnedMaps {
    /// COUNTERS, per CPU ([`PinnedMaps::counters`] sums them).
    pub fn counters_map(&self) -> &PerCpuArray<MapData, u64> {
        &self.counters
    }

    /// Opens the maps pinned under `<pin_root>/maps`.
    ///
    /// # Errors
    /// A pin is missing or its type or sizes do not match.
    pub fn open(pin_root: &Path) -> Result<Self, DatapathError> {
        Self::from_source(Source::Pins(pin_root.join("maps")))
    }

    /// Opens the maps the agent's programs use, through the descriptors it
    /// holds (duplicated), whatever their pins say.
    ///
    /// # Errors
    /// A descriptor cannot be duplicated or a map's type does not match.
    pub fn open_held(held: &super::pins::HeldMaps) -> Result<Self, DatapathError> {
        let mut maps = std::collections::BTreeMap::new();
        for name in map_names::ALL {
            maps.insert(name, held.open(name)?);
        }
        Self::from_source(Source::Held(maps))
    }

    fn from_source(source: Source) -> Result<Self, DatapathError> {
        let s = &source;
        Ok(Self {
            ipcache_v4: typed!(s, map_names::IPCACHE_V4),
            ipcache_v6: typed!(s, map_names::IPCACHE_V6),
            ipcache_host_v4: typed!(s, map_names::IPCACHE_HOST_V4),
            ipcache_host_v6: typed!(s, map_names::IPCACHE_HOST_V6),
            masq_skip_v4: typed!(s, map_names::MASQ_SKIP_V4),
            masq_skip_v6: typed!(s, map_names::MASQ_SKIP_V6),
            endpoints: typed!(s, map_names::ENDPOINTS),
            l2_resp_v4: typed!(s, map_names::L2_RESP_V4),
            l2_resp_v6: typed!(s, map_names::L2_RESP_V6),
            counters: typed!(s, map_names::COUNTERS),
            endpoint_slots: typed!(s, map_names::ENDPOINT_SLOTS),
            l2_resp_slots: typed!(s, map_names::L2_RESP_SLOTS),
            l2_resp6_slots: typed!(s, map_names::L2_RESP6_SLOTS),
            nat_fwd_v4: typed!(s, map_names::NAT_FWD_V4),
            nat_fwd_v6: typed!(s, map_names::NAT_FWD_V6),
            nat_rev_v4: typed!(s, map_names::NAT_REV_V4),
            nat_rev_v6: typed!(s, map_names::NAT_REV_V6),
            masq_config: typed!(s, map_names::MASQ_CONFIG),
            tunnel_config: typed!(s, map_names::TUNNEL_CONFIG),
            nat_ep_opened: typed!(s, map_names::NAT_EP_OPENED),
            nat_ep_closed: typed!(s, map_names::NAT_EP_CLOSED),
            source,
        })
    }

    /// A new handle on the map `name` (pinned or held, as this was opened).
    pub(super) fn open_source(&self, name: &'static str) -> Result<MapData, DatapathError> {
        self.source.open(name)
    }

    /// Every entry of a pinned hash in one batch syscall.
    fn entries<K: sys::RawKey, V: aya::Pod>(
        &self,
        map: &'static str,
    ) -> Result<Vec<(K, V)>, DatapathError> {
        let access = |source: Box<dyn std::error::Error + Send + Sync>| DatapathError::MapAccess {
            action: "read",
            map,
            source,
        };
        let raw = self.source.open(map).map_err(|e| access(Box::new(e)))?;
        sys::read_entries(raw.fd(), K::SIZE).map_err(|e| access(Box::new(e)))
    }

    /// Inserts (or replaces) the ENDPOINTS entry of `ifindex`, sealed (see
    /// `lockstep_common::seal`), then brings its ENDPOINT_SLOTS slot up to
    /// date: the hash first, so a slot never holds what the hash does not.
    ///
    /// # Errors
    /// A map could not be read or written (the hash may be full).
    pub fn endpoint_insert(
        &mut self,
        ifindex: u32,
        value: &EndpointValue,
    ) -> Result<(), DatapathError> {
        self.endpoints
            .insert(ifindex, value.sealed(ifindex), 0)
            .map_err(|e| write_err(map_names::ENDPOINTS, e))?;
        self.sync_endpoint_slot(slots::endpoint(ifindex), None)
    }

    /// Removes the ENDPOINTS entry of `ifindex`, its slot first (handing
    /// the slot to the next endpoint that maps to it). Returns whether the
    /// entry existed.
    ///
    /// # Errors
    /// A map could not be read or written.
    pub fn endpoint_remove(&mut self, ifindex: u32) -> Result<bool, DatapathError> {
        self.sync_endpoint_slot(slots::endpoint(ifindex), Some(ifindex))?;
        match self.endpoints.remove(&ifindex) {
            Ok(()) => Ok(true),
            Err(aya::maps::MapError::KeyNotFound) => Ok(false),
            Err(e) => Err(write_err(map_names::ENDPOINTS, e)),
        }
    }

    /// Inserts (or replaces) the L2_RESP_V4 entry of `addr`, sealed, then its
    /// slot.
    ///
    /// # Errors
    /// A map could not be read or written (the hash may be full).
    pub fn l2_insert(&mut self, addr: V4Addr, value: &L2RespValue) -> Result<(), DatapathError> {
        self.l2_resp_v4
            .insert(addr, value.sealed(addr), 0)
            .map_err(|e| write_err(map_names::L2_RESP_V4, e))?;
        self.sync_l2_slot(slots::l2_resp(addr), None)
    }

    /// Removes the L2_RESP_V4 entry of `addr`, its slot first. Returns
    /// whether the entry existed.
    ///
    /// # Errors
    /// A map could not be read or written.
    pub fn l2_remove(&mut self, addr: V4Addr) -> Result<bool, DatapathError> {
        self.sync_l2_slot(slots::l2_resp(addr), Some(addr))?;
        match self.l2_resp_v4.remove(&addr) {
            Ok(()) => Ok(true),
            Err(aya::maps::MapError::KeyNotFound) => Ok(false),
            Err(e) => Err(write_err(map_names::L2_RESP_V4, e)),
        }
    }

    /// Inserts (or replaces) the L2_RESP_V6 entry of `addr`, sealed, then
    /// its slot.
    ///
    /// # Errors
    /// A map could not be read or written (the hash may be full).
    pub fn l2_insert_v6(&mut self, addr: V6Addr, value: &L2RespValue) -> Result<(), DatapathError> {
        self.l2_resp_v6
            .insert(addr, value.sealed_v6(addr), 0)
            .map_err(|e| write_err(map_names::L2_RESP_V6, e))?;
        self.sync_l2_v6_slot(slots::l2_resp_v6(addr), None)
    }

    /// Removes the L2_RESP_V6 entry of `addr`, its slot first. Returns
    /// whether the entry existed.
    ///
    /// # Errors
    /// A map could not be read or written.
    pub fn l2_remove_v6(&mut self, addr: V6Addr) -> Result<bool, DatapathError> {
        self.sync_l2_v6_slot(slots::l2_resp_v6(addr), Some(addr))?;
        match self.l2_resp_v6.remove(&addr) {
            Ok(()) => Ok(true),
            Err(aya::maps::MapError::KeyNotFound) => Ok(false),
            Err(e) => Err(write_err(map_names::L2_RESP_V6, e)),
        }
    }

    /// Makes `slot` hold what [`slot_holder`] picks from the hash as it is
    /// now, leaving out `without` (about to be removed).
    fn sync_endpoint_slot(&mut self, slot: u32, without: Option<u32>) -> Result<(), DatapathError> {
        let entries: Vec<(u32, EndpointValue)> = self.entries(map_names::ENDPOINTS)?;
        let want = slot_holder(
            entries.into_iter().filter(|(k, _)| Some(*k) != without),
            slot,
            |k: &u32| slots::endpoint(*k),
        )
        .map(|(k, v)| EndpointSlot::new(k, &v));
        write_slot(
            &mut self.endpoint_slots,
            map_names::ENDPOINT_SLOTS,
            slot,
            want,
        )
    }

    /// [`Self::sync_endpoint_slot`] for L2_RESP_SLOTS.
    fn sync_l2_slot(&mut self, slot: u32, without: Option<V4Addr>) -> Result<(), DatapathError> {
        let entries: Vec<(V4Addr, L2RespValue)> = self.entries(map_names::L2_RESP_V4)?;
        let want = slot_holder(
            entries.into_iter().filter(|(k, _)| Some(*k) != without),
            slot,
            |k: &V4Addr| slots::l2_resp(*k),
        )
        .map(|(k, v)| L2RespSlot::new(k, &v));
        write_slot(
            &mut self.l2_resp_slots,
            map_names::L2_RESP_SLOTS,
            slot,
            want,
        )
    }

    /// [`Self::sync_endpoint_slot`] for L2_RESP6_SLOTS.
    fn sync_l2_v6_slot(&mut self, slot: u32, without: Option<V6Addr>) -> Result<(), DatapathError> {
        let entries: Vec<(V6Addr, L2RespValue)> = self.entries(map_names::L2_RESP_V6)?;
        let want = slot_holder(
            entries.into_iter().filter(|(k, _)| Some(*k) != without),
            slot,
            |k: &V6Addr| slots::l2_resp_v6(*k),
        )
        .map(|(k, v)| L2RespSlotV6::new(k, &v));
        write_slot(
            &mut self.l2_resp6_slots,
            map_names::L2_RESP6_SLOTS,
            slot,
            want,
        )
    }

    /// Opens one of these maps untyped, for raw (batch) operations: by its
    /// pin or by the descriptor held, as these maps were opened.
    ///
    /// # Errors
    /// The pin is missing, or the descriptor cannot be duplicated.
    pub fn raw(&self, name: &str) -> Result<MapData, DatapathError> {
        self.source.open(name)
    }

    /// Writes an IPCACHE entry into the map that holds its prefix length: the
    /// host hash for /32 and /128, the trie otherwise.
    ///
    /// # Errors
    /// [`DatapathError::MapFull`] when the map is full, or another refused
    /// write.
    pub fn ipcache_insert(
        &mut self,
        prefix: ipnet::IpNet,
        value: IpcacheValue,
    ) -> Result<(), DatapathError> {
        let map = ipcache_map(prefix);
        match prefix.trunc() {
            ipnet::IpNet::V4(n) if n.prefix_len() == 32 => {
                self.ipcache_host_v4.insert(n.addr().octets(), value, 0)
            }
            ipnet::IpNet::V4(n) => {
                self.ipcache_v4
                    .insert(&v4_key(n.network(), n.prefix_len()), value, 0)
            }
            ipnet::IpNet::V6(n) if n.prefix_len() == 128 => {
                self.ipcache_host_v6.insert(n.addr().octets(), value, 0)
            }
            ipnet::IpNet::V6(n) => {
                self.ipcache_v6
                    .insert(&v6_key(n.network(), n.prefix_len()), value, 0)
            }
        }
        .map_err(|e| write_err(map, e))
    }

    /// Removes the IPCACHE entry of `prefix`; returns whether it existed.
    ///
    /// # Errors
    /// A refused delete.
    pub fn ipcache_remove(&mut self, prefix: ipnet::IpNet) -> Result<bool, DatapathError> {
        let map = ipcache_map(prefix);
        let r = match prefix.trunc() {
            ipnet::IpNet::V4(n) if n.prefix_len() == 32 => {
                self.ipcache_host_v4.remove(&n.addr().octets())
            }
            ipnet::IpNet::V4(n) => self.ipcache_v4.remove(&v4_key(n.network(), n.prefix_len())),
            ipnet::IpNet::V6(n) if n.prefix_len() == 128 => {
                self.ipcache_host_v6.remove(&n.addr().octets())
            }
            ipnet::IpNet::V6(n) => self.ipcache_v6.remove(&v6_key(n.network(), n.prefix_len())),
        };
        match r {
            Ok(()) => Ok(true),
            Err(aya::maps::MapError::KeyNotFound) => Ok(false),
            Err(e) => Err(write_err(map, e)),
        }
    }

    /// Every IPCACHE entry of both families, host entries and prefixes, as
    /// (prefix, value).
    ///
    /// # Errors
    /// A map could not be read.
    pub fn ipcache_entries(
        &self,
    ) -> Result<Vec<(ipnet::IpNet, IpcacheValue)>, aya::maps::MapError> {
        let mut out = Vec::new();
        for item in self.ipcache_host_v4.iter() {
            let (k, v) = item?;
            out.push((
                ipnet::IpNet::from(std::net::IpAddr::V4(Ipv4Addr::from(k))),
                v,
            ));
        }
        for item in self.ipcache_v4.iter() {
            let (k, v) = item?;
            let net = ipnet::Ipv4Net::new(Ipv4Addr::from(k.data()), k.prefix_len() as u8)
                .map_err(|_| aya::maps::MapError::KeyNotFound)?;
            out.push((net.into(), v));
        }
        for item in self.ipcache_host_v6.iter() {
            let (k, v) = item?;
            out.push((
                ipnet::IpNet::from(std::net::IpAddr::V6(Ipv6Addr::from(k))),
                v,
            ));
        }
        for item in self.ipcache_v6.iter() {
            let (k, v) = item?;
            let net = ipnet::Ipv6Net::new(Ipv6Addr::from(k.data()), k.prefix_len() as u8)
                .map_err(|_| aya::maps::MapError::KeyNotFound)?;
            out.push((net.into(), v));
        }
        Ok(out)
    }

    /// Each counter summed over all CPUs.
    ///
    /// # Errors
    /// A lookup failed.
    pub fn counters(&self) -> Result<Vec<(Counter, u64)>, DatapathError> {
        Counter::ALL
            .iter()
            .map(|c| {
                let values = self.counters.get(&(*c as u32), 0).map_err(|source| {
                    DatapathError::OpenPin {
                        pin: PathBuf::from(map_names::COUNTERS),
                        source: Box::new(source),
                    }
                })?;
                Ok((*c, values.iter().sum()))
            })
            .collect()
    }
}

/// The IPCACHE map that holds `prefix`: a host hash for /32 and /128, a
/// trie otherwise.
pub fn ipcache_map(prefix: ipnet::IpNet) -> &'static str {
    match prefix {
        ipnet::IpNet::V4(n) if n.prefix_len() == 32 => map_names::IPCACHE_HOST_V4,
        ipnet::IpNet::V4(_) => map_names::IPCACHE_V4,
        ipnet::IpNet::V6(n) if n.prefix_len() == 128 => map_names::IPCACHE_HOST_V6,
        ipnet::IpNet::V6(_) => map_names::IPCACHE_V6,
    }
}

/// A failed write to `map` as a datapath error: a full map (`E2BIG`) is
/// [`DatapathError::MapFull`], anything else [`DatapathError::MapAccess`].
/// Callers match the variant, never aya's or libc's codes.
pub fn write_err(map: &'static str, e: aya::maps::MapError) -> DatapathError {
    match &e {
        aya::maps::MapError::SyscallError(s) if s.io_error.raw_os_error() == Some(libc::E2BIG) => {
            DatapathError::MapFull { map }
        }
        _ => DatapathError::MapAccess {
            action: "write",
            map,
            source: Box::new(e),
        },
    }
}

/// Rewrites one slot the way `lockstep_common::slots` requires: a slot that
/// holds something is cleared (all zero) before anything else is written
/// into it, so a program reading it meanwhile sees old, zero or new bytes and
/// never a mix of two entries. Writes nothing when the slot is already right.
///
/// # Errors
/// The array could not be read or written.
pub fn write_slot<T: aya::Pod + Default + PartialEq>(
    array: &mut Array<MapData, T>,
    map: &'static str,
    slot: u32,
    want: Option<T>,
) -> Result<(), DatapathError> {
    let have = array.get(&slot, 0).map_err(|e| DatapathError::MapAccess {
        action: "read",
        map,
        source: Box::new(e),
    })?;
    let want = want.unwrap_or_default();
    if have == want {
        return Ok(());
    }
    if have != T::default() {
        array
            .set(slot, T::default(), 0)
            .map_err(|e| write_err(map, e))?;
    }
    if want != T::default() {
        array.set(slot, want, 0).map_err(|e| write_err(map, e))?;
    }
    Ok(())
}

/// An IPv4 LPM key with host bits past `prefix_len` cleared, as the kernel
/// stores keys as given and deletes by exact match.
pub fn v4_key(addr: Ipv4Addr, prefix_len: u8) -> Key<V4Addr> {
    let bits = u32::from(addr);
    let mask = if prefix_len == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(prefix_len.min(32)))
    };
    Key::new(u32::from(prefix_len.min(32)), (bits & mask).to_be_bytes())
}

/// An IPv6 LPM key with host bits past `prefix_len` cleared.
pub fn v6_key(addr: Ipv6Addr, prefix_len: u8) -> Key<V6Addr> {
    let bits = u128::from(addr);
    let mask = if prefix_len == 0 {
        0
    } else {
        u128::MAX << (128 - u32::from(prefix_len.min(128)))
    };
    Key::new(u32::from(prefix_len.min(128)), (bits & mask).to_be_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_canonical() {
        let k = v4_key(Ipv4Addr::new(10, 1, 2, 3), 24);
        assert_eq!({ k.prefix_len() }, 24);
        assert_eq!(k.data(), [10, 1, 2, 0]);
        assert_eq!(v4_key(Ipv4Addr::new(10, 1, 2, 3), 0).data(), [0; 4]);
        assert_eq!(v4_key(Ipv4Addr::new(10, 1, 2, 3), 32).data(), [10, 1, 2, 3]);
        let k6 = v6_key("fd00::1:2".parse().expect("literal"), 64);
        assert_eq!(k6.data()[..8], [0xfd, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(k6.data()[8..], [0; 8]);
    }

    fn syscall_error(errno: i32) -> aya::maps::MapError {
        aya::maps::MapError::SyscallError(aya::sys::SyscallError {
            call: "bpf_map_update_elem",
            io_error: std::io::Error::from_raw_os_error(errno),
        })
    }

    #[test]
    fn host_prefixes_go_to_the_host_hashes_and_others_to_the_tries() {
        let map = |p: &str| ipcache_map(p.parse().expect("cidr"));
        assert_eq!(map("10.0.0.1/32"), map_names::IPCACHE_HOST_V4);
        assert_eq!(map("10.0.0.0/24"), map_names::IPCACHE_V4);
        assert_eq!(map("fd00::1/128"), map_names::IPCACHE_HOST_V6);
        assert_eq!(map("fd00::/64"), map_names::IPCACHE_V6);
        assert_eq!(map("0.0.0.0/0"), map_names::IPCACHE_V4);
    }

    #[test]
    fn a_full_map_is_a_datapath_map_full() {
        let e = write_err(map_names::ENDPOINTS, syscall_error(libc::E2BIG));
        assert!(matches!(e, DatapathError::MapFull { map } if map == map_names::ENDPOINTS));
        assert_eq!(
            e.to_string(),
            format!("map {} is full", map_names::ENDPOINTS)
        );
    }

    #[test]
    fn other_write_failures_keep_their_cause() {
        let e = write_err(map_names::L2_RESP_V4, syscall_error(libc::EPERM));
        assert!(matches!(
            e,
            DatapathError::MapAccess {
                action: "write",
                ..
            }
        ));
        let chain = crate::error_chain(&e);
        assert!(chain.starts_with("cannot write L2_RESP_V4"), "{chain}");
        assert!(chain.contains("Operation not permitted"), "{chain}");
    }
}
