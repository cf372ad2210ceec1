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
    /// A pool name that cannot be used as a key everywhere it goes (API,
    /// metrics, store, logs).
    #[error("pool name {pool:?} is not usable: {reason}")]
    InvalidName {
        /// The name as given.
        pool: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// Two pool names that differ only by case (confusable everywhere a
    /// human reads or types them).
    #[error("pool {pool} differs from pool {other} only by case")]
    CaseClash {
        /// The later name.
        pool: String,
        /// The earlier name.
        other: String,
    },
    /// A CIDR inside a special-purpose range no pool may hand out from
    /// (unspecified, loopback, multicast, reserved, IPv4 addresses seen
    /// through IPv6, and link-local unless the pool allows it).
    #[error("cidr {cidr} of pool {pool} overlaps {range}, {what}{hint}")]
    SpecialRange {
        /// The pool.
        pool: String,
        /// The refused CIDR.
        cidr: IpNet,
        /// The special-purpose range it overlaps.
        range: IpNet,
        /// What that range is.
        what: &'static str,
        /// How to allow it, where that is possible.
        hint: &'static str,
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
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct PoolSpec {
    /// Unique name among the pools of one manager.
    pub name: String,
    /// IPv4 CIDRs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[cfg_attr(feature = "schema", schemars(with = "Vec<String>"))]
    pub ipv4: Vec<Ipv4Net>,
    /// IPv6 CIDRs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[cfg_attr(feature = "schema", schemars(with = "Vec<String>"))]
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
    /// Allow CIDRs inside the link-local ranges (169.254.0.0/16, fe80::/10),
    /// which are refused otherwise.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_link_local: bool,
    /// Families the pool serves even while it holds no CIDR of them (a
    /// cluster pool before its first block arrives): an endpoint asks for
    /// an address of each and is told the pool is exhausted, never given
    /// fewer addresses than the pool serves. Set by pool sources, not
    /// written in config.
    #[serde(skip)]
    pub families: Vec<Family>,
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
            allow_link_local: false,
            families: Vec::new(),
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

    /// Sets `allow_link_local` (builder style).
    pub fn allow_link_local(mut self, yes: bool) -> PoolSpec {
        self.allow_link_local = yes;
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
    let mut seen: BTreeMap<String, &str> = BTreeMap::new();
    let mut placed: Vec<(&str, IpNet)> = Vec::new();
    for spec in specs {
        check_name(&spec.name)?;
        if let Some(other) = seen.insert(spec.name.to_lowercase(), &spec.name) {
            return Err(if other == spec.name {
                PoolError::DuplicatePool {
                    pool: spec.name.clone(),
                }
            } else {
                PoolError::CaseClash {
                    pool: spec.name.clone(),
                    other: other.to_owned(),
                }
            });
        }
        for cidr in spec.cidrs() {
            check_cidr(&spec.name, cidr, spec.allow_link_local)?;
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

/// Longest pool name, in bytes.
pub const MAX_NAME_LEN: usize = 128;

/// Checks a pool name: it must be present, at most [`MAX_NAME_LEN`] bytes, and free of
/// control characters and white space.
///
/// # Errors
/// [`PoolError::EmptyName`] or [`PoolError::InvalidName`] saying why.
pub fn check_name(name: &str) -> Result<(), PoolError> {
    let invalid = |reason| PoolError::InvalidName {
        pool: name.to_owned(),
        reason,
    };
    if name.is_empty() {
        return Err(PoolError::EmptyName);
    }
    if name.len() > MAX_NAME_LEN {
        return Err(invalid("longer than 128 bytes"));
    }
    if name.chars().any(char::is_control) {
        return Err(invalid("it contains a control character"));
    }
    if name.chars().any(char::is_whitespace) {
        return Err(invalid("it contains white space"));
    }
    Ok(())
}

/// Ranges no pool hands out from, and what they are. IPv6 ranges that embed
/// IPv4 addresses (mapped, translated, compatible) would let one IPv4
/// address have two owners, one per family.
fn special_ranges() -> &'static [(IpNet, &'static str, bool)] {
    use std::sync::OnceLock;
    static RANGES: OnceLock<Vec<(IpNet, &'static str, bool)>> = OnceLock::new();
    RANGES.get_or_init(|| {
        [
            (
                "0.0.0.0/8",
                "\"this network\" (the unspecified address)",
                false,
            ),
            ("127.0.0.0/8", "loopback", false),
            ("169.254.0.0/16", "link-local", true),
            ("224.0.0.0/4", "multicast", false),
            (
                "240.0.0.0/4",
                "reserved (and the limited broadcast address)",
                false,
            ),
            ("::/128", "the unspecified address", false),
            ("::1/128", "loopback", false),
            (
                "::ffff:0:0/96",
                "IPv4-mapped: it aliases IPv4 addresses",
                false,
            ),
            (
                "::ffff:0:0:0/96",
                "IPv4-translated: it aliases IPv4 addresses",
                false,
            ),
            ("::/96", "IPv4-compatible: it aliases IPv4 addresses", false),
            ("fe80::/10", "link-local", true),
            ("ff00::/8", "multicast", false),
        ]
        .into_iter()
        .map(|(net, what, link_local)| (net.parse().expect("literal"), what, link_local))
        .collect()
    })
}

/// The special-purpose range (and what it is) that the addresses from
/// `first` to `last` (one family) overlap, if any; link-local ranges count
/// only when `allow_link_local` is false. Shared with LoadBalancer pools.
pub fn special_range(
    first: IpAddr,
    last: IpAddr,
    allow_link_local: bool,
) -> Option<(IpNet, &'static str, bool)> {
    special_ranges()
        .iter()
        .filter(|(_, _, link_local)| !(allow_link_local && *link_local))
        .find(|(range, _, _)| {
            range.network().is_ipv4() == first.is_ipv4()
                && range.network() <= last
                && first <= range.broadcast()
        })
        .copied()
}

/// A CIDR a pool may use: canonical (no host bits), and clear of every
/// special-purpose range (link-local only when `allow_link_local`).
pub(crate) fn check_cidr(pool: &str, cidr: IpNet, allow_link_local: bool) -> Result<(), PoolError> {
    validate_cidr(cidr).map_err(|source| PoolError::InvalidCidr {
        pool: pool.to_owned(),
        cidr,
        source,
    })?;
    match special_range(cidr.network(), cidr.broadcast(), allow_link_local) {
        Some((range, what, link_local)) => Err(PoolError::SpecialRange {
            pool: pool.to_owned(),
            cidr,
            range,
            what,
            hint: if link_local {
                " (set allow_link_local on the pool to use it)"
            } else {
                "; no pool may hand out such addresses"
            },
        }),
        None => Ok(()),
    }
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
    /// Addresses it can still hand out: the free ones, inside its
    /// reservation window when it has one (cluster mode, #43).
    pub available: u128,
}

/// Running state of a pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pool {
    pub(crate) name: String,
    pub(crate) allow_first_last: bool,
    pub(crate) allow_link_local: bool,
    pub(crate) skip_masquerade: bool,
    pub(crate) reserved: Vec<IpAddr>,
    /// Families served with or without a CIDR ([`PoolSpec::families`]).
    pub(crate) declared: Vec<Family>,
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
            allow_link_local: spec.allow_link_local,
            skip_masquerade: spec.skip_masquerade,
            reserved: spec.reserved.clone(),
            declared: spec.families.clone(),
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
            available: slot.alloc.available(),
        })
    }

    /// The families an endpoint of this pool gets an address of: those of
    /// its CIDRs (draining ones too) and those it declares
    /// ([`PoolSpec::families`]).
    pub fn families(&self) -> std::collections::BTreeSet<Family> {
        self.cidrs
            .iter()
            .map(|s| s.alloc.family())
            .chain(self.declared.iter().copied())
            .collect()
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

    /// What an IPAM-mode CNI reply gives for `addr` of this pool: the
    /// address with its CIDR's prefix length, and as gateway the first
    /// reserved address inside that CIDR (what a bridge plugin expects), if
    /// any. `None` when no CIDR of the pool holds `addr`.
    pub fn ipam_address(&self, addr: IpAddr) -> Option<(IpNet, Option<IpAddr>)> {
        let cidr = self
            .cidrs
            .iter()
            .map(|s| s.alloc.cidr())
            .find(|c| c.contains(&addr))?;
        let gateway = self.reserved.iter().copied().find(|r| cidr.contains(r));
        Some((IpNet::new(addr, cidr.prefix_len()).ok()?, gateway))
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

    #[test]
    fn special_ranges_are_refused_and_link_local_only_when_allowed() {
        for (cidr, what) in [
            ("0.0.0.0/24", "unspecified"),
            ("127.0.0.0/24", "loopback"),
            ("224.0.0.0/24", "multicast"),
            ("255.255.255.0/24", "reserved"),
            ("0.0.0.0/0", "unspecified"),
            ("::/120", "unspecified"),
            ("::1/128", "loopback"),
            ("::ffff:10.98.0.0/120", "IPv4-mapped"),
            ("::ffff:0:10.98.0.0/120", "IPv4-translated"),
            ("::10.98.0.0/120", "IPv4-compatible"),
            ("ff02::/120", "multicast"),
            ("::/0", "unspecified"),
        ] {
            let err = PoolSpec::new("p")
                .with_cidr(net(cidr))
                .validate()
                .expect_err(cidr);
            assert!(
                matches!(err, PoolError::SpecialRange { .. }) && err.to_string().contains(what),
                "{cidr}: {err}"
            );
        }
        for cidr in ["169.254.1.0/24", "fe80::/64"] {
            let err = PoolSpec::new("p")
                .with_cidr(net(cidr))
                .validate()
                .expect_err(cidr);
            assert!(err.to_string().contains("allow_link_local"), "{err}");
            PoolSpec::new("p")
                .with_cidr(net(cidr))
                .allow_link_local(true)
                .validate()
                .expect("allowed explicitly");
        }
        for cidr in [
            "10.98.0.0/24",
            "fd00::/64",
            "2001:db8::/64",
            "64:ff9b::/96",
            "100.64.0.0/10",
        ] {
            PoolSpec::new("p")
                .with_cidr(net(cidr))
                .validate()
                .expect(cidr);
        }
    }

    #[test]
    fn names_are_checked_and_case_twins_refused() {
        for (name, why) in [
            ("a\u{1f}b", "control"),
            ("a\nb", "control"),
            ("a b", "white space"),
            (&"x".repeat(129), "longer"),
        ] {
            let err = PoolSpec::new(name).validate().expect_err(name);
            assert!(err.to_string().contains(why), "{name:?}: {err}");
        }
        let err = validate_specs(&[PoolSpec::new("Default"), PoolSpec::new("default")])
            .expect_err("case twins");
        assert_eq!(
            err.to_string(),
            "pool default differs from pool Default only by case"
        );
        PoolSpec::new("pods-v4.zone_a")
            .validate()
            .expect("ordinary name");
    }

    /// A CIDR generator that lands in and around the special ranges often.
    fn any_cidr() -> impl proptest::strategy::Strategy<Value = IpNet> {
        use proptest::prelude::*;
        let v4 = (
            prop_oneof![
                Just(0u32),
                Just(0x7f00_0000),
                Just(0xa9fe_0000),
                Just(0xe000_0000),
                Just(0xf000_0000),
                Just(0xffff_ff00),
                Just(0x0a00_0000),
                any::<u32>()
            ],
            any::<u32>(),
            0u8..=32,
        )
            .prop_map(|(base, noise, len)| {
                let addr = base ^ (noise >> 8);
                IpNet::V4(Ipv4Net::new(addr.into(), len).expect("len").trunc())
            });
        let v6 = (
            prop_oneof![
                Just(0u128),
                Just(1u128),
                Just(0xffff_0000_0000u128),
                Just(0xffff_0000_0000_0000u128),
                Just(0xfe80u128 << 112),
                Just(0xff02u128 << 112),
                Just(0xfd00u128 << 112),
                any::<u128>()
            ],
            any::<u64>(),
            0u8..=128,
        )
            .prop_map(|(base, noise, len)| {
                let addr = base ^ u128::from(noise >> 16);
                IpNet::V6(Ipv6Net::new(addr.into(), len).expect("len").trunc())
            });
        prop_oneof![v4, v6]
    }

    /// Special by the standard library's own classification: an oracle
    /// independent of the range table.
    fn std_special(addr: IpAddr) -> bool {
        match addr {
            IpAddr::V4(a) => {
                a.is_unspecified()
                    || a.is_loopback()
                    || a.is_multicast()
                    || a.is_broadcast()
                    || a.is_link_local()
                    || a.octets()[0] == 0
                    || a.octets()[0] >= 240
            }
            IpAddr::V6(a) => {
                a.is_unspecified()
                    || a.is_loopback()
                    || a.is_multicast()
                    || a.is_unicast_link_local()
                    || a.to_ipv4_mapped().is_some()
                    || a.to_ipv4().is_some()
            }
        }
    }

    #[test]
    fn ipam_addresses_carry_their_cidr_prefix_and_first_reserved_gateway() {
        use crate::manager::{ManagerConfig, PoolManager, StaticPools};
        let spec = PoolSpec::new("p")
            .with_cidr("10.0.0.0/24".parse().unwrap())
            .with_cidr("10.0.1.0/25".parse().unwrap())
            .with_reserved("10.0.1.9".parse().unwrap())
            .with_reserved("10.0.1.1".parse().unwrap());
        let mut m = PoolManager::new(StaticPools(vec![spec]), ManagerConfig::default()).unwrap();
        m.sync().into_result().unwrap();
        let pool = m.pool("p").unwrap();
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(
            pool.ipam_address(ip("10.0.1.7")),
            Some(("10.0.1.7/25".parse().unwrap(), Some(ip("10.0.1.9"))))
        );
        assert_eq!(
            pool.ipam_address(ip("10.0.0.7")),
            Some(("10.0.0.7/24".parse().unwrap(), None))
        );
        assert_eq!(pool.ipam_address(ip("10.0.2.7")), None);
    }

    proptest::proptest! {
        /// An accepted pool holds no address the standard library calls
        /// special, at its first, last and a middle address; a CIDR whose
        /// first or last address is special is refused.
        #[test]
        fn accepted_pools_hold_no_special_address(cidr in any_cidr()) {
            let accepted = PoolSpec::new("p").with_cidr(cidr).validate().is_ok();
            let (first, last) = (cidr.network(), cidr.broadcast());
            let middle = match cidr {
                IpNet::V4(n) => IpAddr::V4((u32::from(n.network()) / 2 + u32::from(n.broadcast()) / 2).into()),
                IpNet::V6(n) => IpAddr::V6((u128::from(n.network()) / 2 + u128::from(n.broadcast()) / 2).into()),
            };
            if accepted {
                for a in [first, middle, last] {
                    proptest::prop_assert!(!std_special(a), "{cidr} accepted but holds {a}");
                }
            }
            if std_special(first) || std_special(last) {
                proptest::prop_assert!(!accepted, "{cidr} holds a special address but was accepted");
            }
        }
    }
}
