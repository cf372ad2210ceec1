//! Pools: named groups of CIDRs with shared flags.
//!
//! [`PoolSpec`] is what a user or a pool source writes (the daemon's TOML
//! config and API reuse it, hence `deny_unknown_fields`); [`Pool`] is the
//! running state the manager keeps for it: one [`CidrAllocator`] per CIDR, each
//! of which may be draining. Validation is pure and separate from applying
//! (two-phase configuration), so a config file can be checked before anything
//! changes.

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use serde::{Deserialize, Serialize};

use crate::cidr::{CidrAllocator, CidrError, CidrOptions, Family, validate_cidr};

/// Errors in pool definitions and pool topology changes.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// A pool without a name.
    #[error("pool name is empty")]
    EmptyName,
    /// Two pools of one source share a name.
    #[error("pool {pool} is defined more than once")]
    DuplicatePool {
        /// The repeated name.
        pool: String,
    },
    /// No pool of that name.
    #[error("unknown pool {pool}")]
    UnknownPool {
        /// The name asked for.
        pool: String,
    },
    /// A CIDR that is not canonical.
    #[error("invalid cidr {cidr} in pool {pool}")]
    InvalidCidr {
        /// The pool.
        pool: String,
        /// The CIDR as given.
        cidr: IpNet,
        /// What is wrong with it.
        #[source]
        source: CidrError,
    },
    /// A CIDR that overlaps one already in use (in this or another pool).
    #[error("cidr {cidr} of pool {pool} overlaps cidr {other_cidr} of pool {other_pool}")]
    OverlappingCidr {
        /// The pool the CIDR was added to.
        pool: String,
        /// The refused CIDR.
        cidr: IpNet,
        /// The pool already holding the overlapping CIDR.
        other_pool: String,
        /// The CIDR it overlaps.
        other_cidr: IpNet,
    },
    /// Removing a CIDR the pool does not have.
    #[error("pool {pool} has no cidr {cidr}")]
    UnknownCidr {
        /// The pool.
        pool: String,
        /// The CIDR asked for.
        cidr: IpNet,
    },
}

/// Definition of a pool, as written in config or produced by a pool source.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolSpec {
    /// Unique name among the pools of one manager.
    pub name: String,
    /// IPv4 CIDRs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ipv4: Vec<Ipv4Net>,
    /// IPv6 CIDRs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ipv6: Vec<Ipv6Net>,
    /// Addresses never handed out (gateways). Addresses outside every CIDR
    /// are kept and apply if a matching CIDR is added later.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reserved: Vec<IpAddr>,
    /// Hand out the first and last address of each CIDR too (cloud prefixes
    /// are fully usable).
    #[serde(default)]
    pub allow_first_last: bool,
    /// Traffic from this pool's addresses to this pool's CIDRs is not
    /// masqueraded.
    #[serde(default)]
    pub skip_masquerade: bool,
}

impl PoolSpec {
    /// A pool with no CIDRs and default flags.
    pub fn new(name: impl Into<String>) -> PoolSpec {
        PoolSpec {
            name: name.into(),
            ipv4: Vec::new(),
            ipv6: Vec::new(),
            reserved: Vec::new(),
            allow_first_last: false,
            skip_masquerade: false,
        }
    }

    /// Adds a CIDR of either family (builder style).
    pub fn with_cidr(mut self, cidr: IpNet) -> PoolSpec {
        match cidr {
            IpNet::V4(n) => self.ipv4.push(n),
            IpNet::V6(n) => self.ipv6.push(n),
        }
        self
    }

    /// Adds a reserved address (builder style).
    pub fn with_reserved(mut self, addr: IpAddr) -> PoolSpec {
        self.reserved.push(addr);
        self
    }

    /// Sets `allow_first_last` (builder style).
    pub fn allow_first_last(mut self, yes: bool) -> PoolSpec {
        self.allow_first_last = yes;
        self
    }

    /// Sets `skip_masquerade` (builder style).
    pub fn skip_masquerade(mut self, yes: bool) -> PoolSpec {
        self.skip_masquerade = yes;
        self
    }

    /// Every CIDR, IPv4 first.
    pub fn cidrs(&self) -> impl Iterator<Item = IpNet> + '_ {
        let v4 = self.ipv4.iter().copied().map(IpNet::V4);
        v4.chain(self.ipv6.iter().copied().map(IpNet::V6))
    }

    /// Checks the pool on its own: a name, canonical CIDRs, no overlaps
    /// among its own CIDRs. Overlaps with other pools are checked by
    /// [`validate_specs`].
    ///
    /// # Errors
    /// The first problem found.
    pub fn validate(&self) -> Result<(), PoolError> {
        validate_specs(std::slice::from_ref(self))
    }
}

/// Checks a whole set of pool definitions (phase one of configuration): names
/// present and unique, CIDRs canonical, no two CIDRs overlapping anywhere.
///
/// # Errors
/// Every problem found, in definition order.
pub fn validate_specs(specs: &[PoolSpec]) -> Result<(), PoolError> {
    let mut seen: BTreeMap<&str, ()> = BTreeMap::new();
    let mut placed: Vec<(&str, IpNet)> = Vec::new();
    for spec in specs {
        if spec.name.is_empty() {
            return Err(PoolError::EmptyName);
        }
        if seen.insert(&spec.name, ()).is_some() {
            return Err(PoolError::DuplicatePool {
                pool: spec.name.clone(),
            });
        }
        for cidr in spec.cidrs() {
            check_canonical(&spec.name, cidr)?;
            if let Some(&(other_pool, other_cidr)) =
                placed.iter().find(|(_, other)| overlaps(cidr, *other))
            {
                return Err(PoolError::OverlappingCidr {
                    pool: spec.name.clone(),
                    cidr,
                    other_pool: other_pool.to_owned(),
                    other_cidr,
                });
            }
            placed.push((&spec.name, cidr));
        }
    }
    Ok(())
}

/// A stable 32-bit id for a pool name (FNV-1a), used as `pool_id` in
/// MASQ_SKIP values. Derived from the name, so it survives restarts and
/// config reordering without being stored anywhere.
pub fn pool_id(name: &str) -> u32 {
    name.bytes().fold(0x811c_9dc5_u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    })
}

/// Whether two CIDRs share any address.
pub fn overlaps(a: IpNet, b: IpNet) -> bool {
    a.contains(&b.network()) || b.contains(&a.network())
}

pub(crate) fn check_canonical(pool: &str, cidr: IpNet) -> Result<(), PoolError> {
    validate_cidr(cidr).map_err(|source| PoolError::InvalidCidr {
        pool: pool.to_owned(),
        cidr,
        source,
    })
}

/// One CIDR of a running pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct CidrSlot {
    pub(crate) alloc: CidrAllocator,
    /// No new allocations; removed once empty.
    pub(crate) draining: bool,
}

/// Read-only view of one CIDR of a pool, for status output and demand.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct CidrStatus {
    /// The CIDR.
    pub cidr: IpNet,
    /// Whether it is draining (no new allocations; removed when empty).
    pub draining: bool,
    /// Allocatable addresses.
    pub capacity: u128,
    /// Allocated addresses.
    pub used: u128,
}

/// Running state of a pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pool {
    pub(crate) name: String,
    pub(crate) allow_first_last: bool,
    pub(crate) skip_masquerade: bool,
    pub(crate) reserved: Vec<IpAddr>,
    /// The source no longer lists the pool: every CIDR drains and the pool
    /// goes away with its last CIDR.
    pub(crate) retired: bool,
    pub(crate) cidrs: Vec<CidrSlot>,
}

impl Pool {
    pub(crate) fn from_spec(spec: &PoolSpec) -> Pool {
        Pool {
            name: spec.name.clone(),
            allow_first_last: spec.allow_first_last,
            skip_masquerade: spec.skip_masquerade,
            reserved: spec.reserved.clone(),
            retired: false,
            cidrs: Vec::new(),
        }
    }

    /// The pool's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether first and last addresses are handed out.
    pub fn allows_first_last(&self) -> bool {
        self.allow_first_last
    }

    /// Whether the pool asks for its CIDRs to skip masquerading.
    pub fn skips_masquerade(&self) -> bool {
        self.skip_masquerade
    }

    /// Whether the pool source dropped the pool (it lives on while draining).
    pub fn is_retired(&self) -> bool {
        self.retired
    }

    /// Every CIDR, active and draining, in the order they were added.
    pub fn cidrs(&self) -> impl Iterator<Item = CidrStatus> + '_ {
        self.cidrs.iter().map(|slot| CidrStatus {
            cidr: slot.alloc.cidr(),
            draining: slot.draining,
            capacity: slot.alloc.capacity(),
            used: slot.alloc.used(),
        })
    }

    /// Capacity of the active (non-draining) CIDRs of a family.
    pub fn capacity(&self, family: Family) -> u128 {
        self.active(family).map(|s| s.alloc.capacity()).sum()
    }

    /// Addresses allocated in a family, draining CIDRs included.
    pub fn used(&self, family: Family) -> u128 {
        self.cidrs
            .iter()
            .filter(|s| s.alloc.family() == family)
            .map(|s| s.alloc.used())
            .sum()
    }

    pub(crate) fn active(&self, family: Family) -> impl Iterator<Item = &CidrSlot> + '_ {
        self.cidrs
            .iter()
            .filter(move |s| !s.draining && s.alloc.family() == family)
    }

    /// Index of the CIDR containing `addr`.
    pub(crate) fn slot_of(&self, addr: IpAddr) -> Option<usize> {
        self.cidrs
            .iter()
            .position(|s| s.alloc.cidr().contains(&addr))
    }

    pub(crate) fn new_slot(&self, cidr: IpNet, dense_limit: u128) -> Result<CidrSlot, PoolError> {
        let options = CidrOptions {
            allow_first_last: self.allow_first_last,
            dense_limit,
        };
        let alloc =
            CidrAllocator::new(cidr, options, self.reserved.iter().copied()).map_err(|source| {
                PoolError::InvalidCidr {
                    pool: self.name.clone(),
                    cidr,
                    source,
                }
            })?;
        Ok(CidrSlot {
            alloc,
            draining: false,
        })
    }

    /// Drops draining CIDRs that hold nothing any more.
    pub(crate) fn reap(&mut self) {
        self.cidrs.retain(|s| !(s.draining && s.alloc.used() == 0));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    #[test]
    fn toml_like_config_deserialises_and_refuses_unknown_fields() {
        let json = r#"{"name":"default","ipv4":["10.0.0.0/24"],"ipv6":["fd00::/64"],
                       "reserved":["10.0.0.1"],"skip_masquerade":true}"#;
        let spec: PoolSpec = serde_json::from_str(json).unwrap();
        assert_eq!(
            spec,
            PoolSpec::new("default")
                .with_cidr(net("10.0.0.0/24"))
                .with_cidr(net("fd00::/64"))
                .with_reserved("10.0.0.1".parse().unwrap())
                .skip_masquerade(true)
        );
        let typo = r#"{"name":"default","ipv4":[],"skip_masquerde":true}"#;
        let err = serde_json::from_str::<PoolSpec>(typo).unwrap_err();
        assert!(err.to_string().contains("skip_masquerde"), "{err}");
    }

    #[test]
    fn validation_names_what_is_wrong() {
        let host_bits = PoolSpec::new("a").with_cidr(net("10.0.0.1/24"));
        assert_eq!(
            host_bits.validate().unwrap_err().to_string(),
            "invalid cidr 10.0.0.1/24 in pool a"
        );
        assert_eq!(
            PoolSpec::new("").validate().unwrap_err(),
            PoolError::EmptyName
        );
        let specs = [
            PoolSpec::new("a").with_cidr(net("10.0.0.0/16")),
            PoolSpec::new("b").with_cidr(net("10.0.3.0/24")),
        ];
        assert_eq!(
            validate_specs(&specs).unwrap_err().to_string(),
            "cidr 10.0.3.0/24 of pool b overlaps cidr 10.0.0.0/16 of pool a"
        );
        let same_pool = PoolSpec::new("a")
            .with_cidr(net("fd00::/64"))
            .with_cidr(net("fd00::/96"));
        assert!(matches!(
            same_pool.validate(),
            Err(PoolError::OverlappingCidr { .. })
        ));
        let dup = [PoolSpec::new("a"), PoolSpec::new("a")];
        assert_eq!(
            validate_specs(&dup).unwrap_err().to_string(),
            "pool a is defined more than once"
        );
    }

    #[test]
    fn pool_ids_are_stable() {
        assert_eq!(pool_id(""), 0x811c_9dc5);
        assert_eq!(pool_id("a"), 0xe40c_292c);
        assert_ne!(pool_id("default"), pool_id("lb"));
    }
}
