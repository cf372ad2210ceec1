//! Map definitions: what every map of this build looks like (type, key and
//! value sizes, capacity), the check of an existing pin against it, and the
//! copy of entries into a migrated map.
//!
//! Kept apart from loading and attaching because it is the one piece of the
//! datapath that is plain data and testable without a kernel.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use aya::maps::{MapData, MapInfo, MapType};
use lockstep_common::{
    EndpointSlot, EndpointValue, IpcacheValue, L2RespSlot, L2RespSlotV6, L2RespValue,
    LPM_V4_KEY_SIZE, LPM_V6_KEY_SIZE, MasqConfig, MasqSkipValue, NatClock, NatEndpointKey,
    NatFragKeyV4, NatFragKeyV6, NatFragValue, NatKeyV4, NatKeyV6, NatValueV4, NatValueV6,
    map_names, max_entries,
};

use super::{DatapathError, sys};

/// The definition of a map, as checked against an existing pin.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MapDefinition {
    /// Kernel map type.
    pub map_type: MapType,
    /// Key size in bytes.
    pub key_size: u32,
    /// Value size in bytes.
    pub value_size: u32,
    /// Capacity.
    pub max_entries: u32,
}

impl fmt::Display for MapDefinition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} key {} B value {} B max_entries {}",
            self.map_type, self.key_size, self.value_size, self.max_entries
        )
    }
}

impl MapDefinition {
    pub(super) fn of_info(info: &MapInfo) -> Result<Self, aya::maps::MapError> {
        Ok(Self {
            map_type: info.map_type()?,
            key_size: info.key_size(),
            value_size: info.value_size(),
            max_entries: info.max_entries(),
        })
    }

    /// Whether entries can be copied byte for byte from a map of `other`'s
    /// definition into one of this definition.
    pub fn same_layout(&self, other: &MapDefinition) -> bool {
        self.map_type == other.map_type
            && self.key_size == other.key_size
            && self.value_size == other.value_size
    }
}

/// Capacities of the resizable maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapCapacities {
    /// Each IPCACHE map (tries and host hashes).
    pub ipcache: u32,
    /// MASQ_SKIP_V4 and MASQ_SKIP_V6.
    pub masq_skip: u32,
    /// ENDPOINTS.
    pub endpoints: u32,
    /// L2_RESP_V4.
    pub l2_resp: u32,
    /// Each of NAT_FWD_V4, NAT_FWD_V6, NAT_REV_V4 and NAT_REV_V6.
    pub nat: u32,
}

impl Default for MapCapacities {
    fn default() -> Self {
        Self {
            ipcache: max_entries::IPCACHE,
            masq_skip: max_entries::MASQ_SKIP,
            endpoints: max_entries::ENDPOINTS,
            l2_resp: max_entries::L2_RESP,
            nat: max_entries::NAT,
        }
    }
}

/// The definition of every map this build uses, by name.
pub fn expected_definitions(caps: &MapCapacities) -> BTreeMap<&'static str, MapDefinition> {
    let lpm = |key_size: usize, value_size: usize, max_entries: u32| MapDefinition {
        map_type: MapType::LpmTrie,
        key_size: key_size as u32,
        value_size: value_size as u32,
        max_entries,
    };
    let hash = |key_size: usize, value_size: usize, max_entries: u32| MapDefinition {
        map_type: MapType::Hash,
        key_size: key_size as u32,
        value_size: value_size as u32,
        max_entries,
    };
    let array = |value_size: usize, max_entries: u32| MapDefinition {
        map_type: MapType::Array,
        key_size: 4,
        value_size: value_size as u32,
        max_entries,
    };
    BTreeMap::from([
        (
            map_names::IPCACHE_V4,
            lpm(LPM_V4_KEY_SIZE, size_of::<IpcacheValue>(), caps.ipcache),
        ),
        (
            map_names::IPCACHE_V6,
            lpm(LPM_V6_KEY_SIZE, size_of::<IpcacheValue>(), caps.ipcache),
        ),
        (
            map_names::IPCACHE_HOST_V4,
            hash(4, size_of::<IpcacheValue>(), caps.ipcache),
        ),
        (
            map_names::IPCACHE_HOST_V6,
            hash(16, size_of::<IpcacheValue>(), caps.ipcache),
        ),
        (
            map_names::MASQ_SKIP_V4,
            lpm(LPM_V4_KEY_SIZE, size_of::<MasqSkipValue>(), caps.masq_skip),
        ),
        (
            map_names::MASQ_SKIP_V6,
            lpm(LPM_V6_KEY_SIZE, size_of::<MasqSkipValue>(), caps.masq_skip),
        ),
        (
            map_names::ENDPOINTS,
            hash(4, size_of::<EndpointValue>(), caps.endpoints),
        ),
        (
            map_names::L2_RESP_V4,
            hash(4, size_of::<L2RespValue>(), caps.l2_resp),
        ),
        (
            map_names::L2_RESP_V6,
            hash(16, size_of::<L2RespValue>(), caps.l2_resp),
        ),
        (
            map_names::ENDPOINT_SLOTS,
            array(size_of::<EndpointSlot>(), max_entries::ENDPOINT_SLOTS),
        ),
        (
            map_names::L2_RESP_SLOTS,
            array(size_of::<L2RespSlot>(), max_entries::L2_RESP_SLOTS),
        ),
        (
            map_names::L2_RESP6_SLOTS,
            array(size_of::<L2RespSlotV6>(), max_entries::L2_RESP6_SLOTS),
        ),
        (
            map_names::COUNTERS,
            MapDefinition {
                map_type: MapType::PerCpuArray,
                key_size: 4,
                value_size: 8,
                max_entries: max_entries::COUNTERS,
            },
        ),
        (map_names::DATAPATH_DEBUG, array(size_of::<u32>(), 1)),
        (
            map_names::NAT_FWD_V4,
            hash(size_of::<NatKeyV4>(), size_of::<NatValueV4>(), caps.nat),
        ),
        (
            map_names::NAT_FWD_V6,
            hash(size_of::<NatKeyV6>(), size_of::<NatValueV6>(), caps.nat),
        ),
        (
            map_names::NAT_REV_V4,
            hash(size_of::<NatKeyV4>(), size_of::<NatValueV4>(), caps.nat),
        ),
        (
            map_names::NAT_REV_V6,
            hash(size_of::<NatKeyV6>(), size_of::<NatValueV6>(), caps.nat),
        ),
        (map_names::MASQ_CONFIG, array(size_of::<MasqConfig>(), 1)),
        (
            map_names::TUNNEL_CONFIG,
            array(size_of::<lockstep_common::TunnelConfig>(), 1),
        ),
        (
            map_names::NAT_FRAG_V4,
            MapDefinition {
                map_type: MapType::LruHash,
                key_size: size_of::<NatFragKeyV4>() as u32,
                value_size: size_of::<NatFragValue>() as u32,
                max_entries: max_entries::NAT_FRAG,
            },
        ),
        (
            map_names::NAT_FRAG_V6,
            MapDefinition {
                map_type: MapType::LruHash,
                key_size: size_of::<NatFragKeyV6>() as u32,
                value_size: size_of::<NatFragValue>() as u32,
                max_entries: max_entries::NAT_FRAG,
            },
        ),
        (
            map_names::NAT_EP_OPENED,
            hash(size_of::<NatEndpointKey>(), 8, max_entries::NAT_EP),
        ),
        (
            map_names::NAT_EP_CLOSED,
            hash(size_of::<NatEndpointKey>(), 8, max_entries::NAT_EP),
        ),
        (
            map_names::NAT_CLOCK,
            MapDefinition {
                map_type: MapType::PerCpuArray,
                key_size: 4,
                value_size: size_of::<NatClock>() as u32,
                max_entries: 1,
            },
        ),
    ])
}

/// Checks an existing pin's definition against the expected one.
///
/// # Errors
/// [`DatapathError::PinIncompatible`] naming the pin and both definitions.
pub fn check_pin(
    pin: &Path,
    expected: &MapDefinition,
    found: &MapDefinition,
) -> Result<(), DatapathError> {
    if expected == found {
        Ok(())
    } else {
        Err(DatapathError::PinIncompatible {
            pin: pin.to_path_buf(),
            expected: *expected,
            found: *found,
        })
    }
}

/// Copies every entry of `old` into `new` (same layout, `def`); per-CPU
/// counters are not copied.
pub(super) fn copy_entries(
    name: &str,
    old: &MapData,
    new: &MapData,
    def: &MapDefinition,
) -> Result<(), DatapathError> {
    let migrate = |source| DatapathError::Migrate {
        map: name.to_string(),
        source,
    };
    if def.map_type == MapType::PerCpuArray {
        // Per-CPU counters restart from zero; they are rates, not state.
        return Ok(());
    }
    let entries =
        sys::dump_raw(old.fd(), def.key_size as usize, def.value_size as usize).map_err(migrate)?;
    for (k, v) in entries {
        sys::update_raw(new.fd(), &k, &v).map_err(migrate)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expected_definitions_follow_the_shared_types() {
        let defs = expected_definitions(&MapCapacities::default());
        assert_eq!(defs.len(), map_names::ALL.len());
        for name in map_names::ALL {
            assert!(defs.contains_key(name), "{name} has no definition");
        }
        let v4 = defs[map_names::IPCACHE_V4];
        assert_eq!(v4.map_type, MapType::LpmTrie);
        assert_eq!(v4.key_size, 8);
        assert_eq!(v4.value_size, 32);
        assert_eq!(defs[map_names::IPCACHE_V6].key_size, 20);
        assert_eq!(defs[map_names::ENDPOINTS].value_size, 48);
        assert_eq!(defs[map_names::L2_RESP_V4].value_size, 24);
        let v6 = defs[map_names::L2_RESP_V6];
        assert_eq!(
            (v6.map_type, v6.key_size, v6.value_size),
            (MapType::Hash, 16, 24)
        );
        assert_eq!(defs[map_names::COUNTERS].max_entries, max_entries::COUNTERS);
        let fwd = defs[map_names::NAT_FWD_V4];
        assert_eq!(fwd.map_type, MapType::Hash);
        assert_eq!((fwd.key_size, fwd.value_size), (16, 24));
        assert_eq!(fwd, defs[map_names::NAT_REV_V4]);
        let fwd6 = defs[map_names::NAT_FWD_V6];
        assert_eq!((fwd6.key_size, fwd6.value_size), (40, 40));
        assert_eq!(fwd6, defs[map_names::NAT_REV_V6]);
        assert_eq!(fwd6.max_entries, max_entries::NAT);
        let cfg = defs[map_names::MASQ_CONFIG];
        assert_eq!(
            (cfg.map_type, cfg.value_size, cfg.max_entries),
            (MapType::Array, 40, 1)
        );
    }

    #[test]
    fn capacities_change_only_max_entries() {
        let caps = MapCapacities {
            ipcache: 16,
            ..MapCapacities::default()
        };
        let small = expected_definitions(&caps);
        let default = expected_definitions(&MapCapacities::default());
        let (a, b) = (small[map_names::IPCACHE_V4], default[map_names::IPCACHE_V4]);
        assert_eq!(a.max_entries, 16);
        assert!(a.same_layout(&b));
        assert_ne!(a, b);
    }

    #[test]
    fn pin_check_accepts_equal_definitions() {
        let def = expected_definitions(&MapCapacities::default())[map_names::ENDPOINTS];
        assert!(check_pin(Path::new("/x"), &def, &def).is_ok());
    }

    #[test]
    fn pin_check_names_the_pin_and_both_definitions() {
        let want = expected_definitions(&MapCapacities::default())[map_names::IPCACHE_V4];
        for found in [
            MapDefinition {
                value_size: 16,
                ..want
            },
            MapDefinition {
                key_size: 20,
                ..want
            },
            MapDefinition {
                max_entries: 7,
                ..want
            },
            MapDefinition {
                map_type: MapType::Hash,
                ..want
            },
        ] {
            let err = check_pin(Path::new("/sys/fs/bpf/t/maps/IPCACHE_V4"), &want, &found)
                .expect_err("a differing definition must be refused");
            let text = err.to_string();
            assert!(text.contains("/sys/fs/bpf/t/maps/IPCACHE_V4"), "{text}");
            assert!(text.contains(&want.to_string()), "{text}");
            assert!(text.contains(&found.to_string()), "{text}");
        }
    }

    #[test]
    fn layout_sameness_ignores_capacity_only() {
        let want = expected_definitions(&MapCapacities::default())[map_names::ENDPOINTS];
        assert!(want.same_layout(&MapDefinition {
            max_entries: 1,
            ..want
        }));
        assert!(!want.same_layout(&MapDefinition {
            value_size: 56,
            ..want
        }));
    }
}
