//! Table-driven scenarios and property tests of LB IPAM.
//!
//! Each scenario is a list of [`Step`]s: pool and service changes, restarts
//! (snapshot → JSON → restore) and expectations. Invariants are checked after
//! every change, so every scenario also checks that holdings, sharing and the
//! manager agree.

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;
use proptest::prelude::*;

use super::*;
use crate::cidr::Family;
use lockstep_common::{identity, ipcache_flags};

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn pool(name: &str) -> LbPoolSpec {
    LbPoolSpec::new(name)
}

fn svc(name: &str) -> ServiceSpec {
    ServiceSpec::new("ns", name)
}

/// Test-only builders for pools.
trait PoolExt {
    fn sel(self, k: &str, v: &str) -> Self;
    fn expr(self, k: &str, op: SelectorOperator, values: &[&str]) -> Self;
    fn first_last(self) -> Self;
    fn disabled(self) -> Self;
    fn l2(self) -> Self;
}

impl PoolExt for LbPoolSpec {
    fn sel(mut self, k: &str, v: &str) -> Self {
        self.service_selector
            .match_labels
            .insert(k.into(), v.into());
        self
    }
    fn expr(mut self, k: &str, operator: SelectorOperator, values: &[&str]) -> Self {
        self.service_selector
            .match_expressions
            .push(LabelRequirement {
                key: k.into(),
                operator,
                values: values.iter().map(|v| (*v).into()).collect(),
            });
        self
    }
    fn first_last(mut self) -> Self {
        self.allow_first_last = true;
        self
    }
    fn disabled(mut self) -> Self {
        self.disabled = true;
        self
    }
    fn l2(mut self) -> Self {
        self.announce = Some(Announce::L2);
        self
    }
}

/// Test-only builders for services.
trait SvcExt {
    fn label(self, k: &str, v: &str) -> Self;
    fn key(self, k: &str) -> Self;
    fn tcp(self, port: u16) -> Self;
    fn udp(self, port: u16) -> Self;
    fn want(self, addr: &str) -> Self;
    fn policy(self, p: IpFamilyPolicy, families: &[IpFamily]) -> Self;
}

impl SvcExt for ServiceSpec {
    fn label(mut self, k: &str, v: &str) -> Self {
        self.labels.insert(k.into(), v.into());
        self
    }
    fn key(mut self, k: &str) -> Self {
        self.sharing_key = Some(k.into());
        self
    }
    fn tcp(mut self, port: u16) -> Self {
        self.ports.push(ServicePort {
            protocol: Protocol::TCP,
            port,
        });
        self
    }
    fn udp(mut self, port: u16) -> Self {
        self.ports.push(ServicePort {
            protocol: Protocol::UDP,
            port,
        });
        self
    }
    fn want(mut self, addr: &str) -> Self {
        self.load_balancer_ips.push(ip(addr));
        self
    }
    fn policy(mut self, p: IpFamilyPolicy, families: &[IpFamily]) -> Self {
        self.ip_family_policy = p;
        self.ip_families = families.to_vec();
        self
    }
}

/// One step of a scenario. Service names are in namespace `ns`.
enum Step {
    /// Apply a pool.
    P(LbPoolSpec),
    /// Delete a pool.
    DelP(&'static str),
    /// Apply a service.
    S(ServiceSpec),
    /// Delete a service.
    DelS(&'static str),
    /// Snapshot, serialise to JSON and back, restore.
    Restart,
    /// The service holds exactly these addresses.
    Addrs(&'static str, &'static [&'static str]),
    /// The service is pending with this reason kind.
    Pending(&'static str, &'static str),
    /// The exact pending reason.
    Reason(&'static str, PendingReason),
    /// PreferDualStack: the missing family's reason kind.
    Missing(&'static str, &'static str),
    /// The last change's cause.
    Changed(&'static str, ChangeCause),
    /// The pool conflicts with this earlier pool (or is usable).
    Conflict(&'static str, Option<&'static str>),
    /// Addresses in use in a pool.
    Used(&'static str, u128),
    /// The services using an address.
    Users(&'static str, &'static [&'static str]),
    /// The last change reported these services as changed.
    Reported(&'static [&'static str]),
}

use IpFamily::{IPv4, IPv6};
use IpFamilyPolicy::{PreferDualStack, RequireDualStack, SingleStack};
use SelectorOperator::{DoesNotExist, Exists, In, NotIn};
use Step::*;

fn id(name: &str) -> String {
    format!("ns/{name}")
}

fn run(name: &str, steps: Vec<Step>) {
    let mut lb = LbIpam::new();
    let mut last = std::collections::BTreeSet::new();
    for (i, step) in steps.into_iter().enumerate() {
        let at = format!("case {name:?}, step {i}");
        match step {
            P(spec) => last = lb.apply_pool(spec).expect(&at),
            DelP(p) => last = lb.delete_pool(p).expect(&at),
            S(spec) => last = lb.apply_service(spec).expect(&at),
            DelS(s) => last = lb.delete_service(&id(s)).expect(&at),
            Restart => {
                let snap = lb.snapshot();
                let json = serde_json::to_string(&snap).expect(&at);
                let back: LbSnapshot = serde_json::from_str(&json).expect(&at);
                assert_eq!(back, snap, "{at}: json round trip");
                lb = LbIpam::restore(&back).expect(&at);
                assert_eq!(lb.snapshot(), snap, "{at}: restore is exact");
            }
            Addrs(s, want) => {
                let st = lb.service_status(&id(s)).expect(&at);
                let want: Vec<IpAddr> = want.iter().map(|a| ip(a)).collect();
                assert_eq!(st.addresses(), want.as_slice(), "{at}: {st:?}");
            }
            Pending(s, kind) => {
                let st = lb.service_status(&id(s)).expect(&at);
                let got = st.pending().map(PendingReason::kind);
                assert_eq!(got, Some(kind), "{at}: {st:?}");
                assert!(
                    lb.holdings(&id(s)).is_empty(),
                    "{at}: pending holds nothing"
                );
            }
            Reason(s, want) => {
                let st = lb.service_status(&id(s)).expect(&at);
                assert_eq!(st.pending(), Some(&want), "{at}");
            }
            Missing(s, kind) => {
                let st = lb.service_status(&id(s)).expect(&at);
                let got = st.missing_family.as_ref().map(PendingReason::kind);
                assert_eq!(got, Some(kind), "{at}: {st:?}");
            }
            Changed(s, cause) => {
                let st = lb.service_status(&id(s)).expect(&at);
                let got = st.last_change_reason.as_ref().map(|r| r.cause);
                assert_eq!(got, Some(cause), "{at}: {st:?}");
            }
            Conflict(p, with) => {
                let st = lb.pool_status(p).expect(&at);
                assert_eq!(st.conflict.as_ref().map(|c| c.pool.as_str()), with, "{at}");
                assert_eq!(st.metrics.conflicting, with.is_some(), "{at}");
            }
            Used(p, n) => {
                assert_eq!(lb.pool_status(p).expect(&at).metrics.used, n, "{at}");
            }
            Users(a, want) => {
                let got: Vec<&str> = lb.users_of(ip(a)).collect();
                let want: Vec<String> = want.iter().map(|s| id(s)).collect();
                assert_eq!(got, want, "{at}");
            }
            Reported(want) => {
                let want: std::collections::BTreeSet<String> = want.iter().map(|s| id(s)).collect();
                assert_eq!(last, want, "{at}");
            }
        }
        lb.check_invariants();
    }
}

fn cases() -> Vec<(&'static str, Vec<Step>)> {
    vec![
        // ---- selectors ----
        (
            "empty selector selects every service",
            vec![
                P(pool("p").cidr("10.0.0.0/30")),
                S(svc("a").label("any", "thing")),
                S(svc("b")),
                Addrs("a", &["10.0.0.1"]),
                Addrs("b", &["10.0.0.2"]),
            ],
        ),
        (
            "match_labels selects, others find no pool",
            vec![
                P(pool("web").cidr("10.0.0.0/24").sel("tier", "web")),
                S(svc("a").label("tier", "web")),
                S(svc("b").label("tier", "db")),
                Addrs("a", &["10.0.0.1"]),
                Reason("b", PendingReason::NoPoolSelects { family: Family::V4 }),
            ],
        ),
        (
            "In operator",
            vec![
                P(pool("p")
                    .cidr("10.0.0.0/24")
                    .expr("env", In, &["prod", "staging"])),
                S(svc("a").label("env", "staging")),
                S(svc("b").label("env", "dev")),
                S(svc("c")),
                Addrs("a", &["10.0.0.1"]),
                Pending("b", "no_pool_selects"),
                Pending("c", "no_pool_selects"),
            ],
        ),
        (
            "NotIn operator matches a missing label too",
            vec![
                P(pool("p").cidr("10.0.0.0/24").expr("env", NotIn, &["prod"])),
                S(svc("a").label("env", "dev")),
                S(svc("b")),
                S(svc("c").label("env", "prod")),
                Addrs("a", &["10.0.0.1"]),
                Addrs("b", &["10.0.0.2"]),
                Pending("c", "no_pool_selects"),
            ],
        ),
        (
            "Exists operator",
            vec![
                P(pool("p").cidr("10.0.0.0/24").expr("team", Exists, &[])),
                S(svc("a").label("team", "")),
                S(svc("b")),
                Addrs("a", &["10.0.0.1"]),
                Pending("b", "no_pool_selects"),
            ],
        ),
        (
            "DoesNotExist operator",
            vec![
                P(pool("p")
                    .cidr("10.0.0.0/24")
                    .expr("legacy", DoesNotExist, &[])),
                S(svc("a")),
                S(svc("b").label("legacy", "yes")),
                Addrs("a", &["10.0.0.1"]),
                Pending("b", "no_pool_selects"),
            ],
        ),
        (
            "first selecting pool in apply order wins",
            vec![
                P(pool("z-first").cidr("10.1.0.0/24").sel("tier", "web")),
                P(pool("a-second").cidr("10.2.0.0/24")),
                S(svc("web").label("tier", "web")),
                S(svc("db").label("tier", "db")),
                Addrs("web", &["10.1.0.1"]),
                Addrs("db", &["10.2.0.1"]),
            ],
        ),
        // ---- sharing ----
        (
            "same key and distinct ports share the address",
            vec![
                P(pool("p").cidr("10.0.0.0/24")),
                S(svc("a").key("k").tcp(80)),
                S(svc("b").key("k").tcp(443).udp(80)),
                Addrs("a", &["10.0.0.1"]),
                Addrs("b", &["10.0.0.1"]),
                Users("10.0.0.1", &["a", "b"]),
                Used("p", 1),
            ],
        ),
        (
            "same key with a port clash: later one pending",
            vec![
                P(pool("p").cidr("10.0.0.0/24")),
                S(svc("a").key("k").tcp(80)),
                S(svc("b").key("k").tcp(80)),
                Addrs("a", &["10.0.0.1"]),
                Reason(
                    "b",
                    PendingReason::SharingPortClash {
                        address: ip("10.0.0.1"),
                        with: id("a"),
                        port: ServicePort {
                            protocol: Protocol::TCP,
                            port: 80,
                        },
                    },
                ),
                // The clash goes away with the other service.
                DelS("a"),
                Addrs("b", &["10.0.0.2"]),
                Reported(&["b"]),
            ],
        ),
        (
            "different keys cannot share a requested address",
            vec![
                P(pool("p").cidr("10.0.0.0/24")),
                S(svc("a").key("k1").tcp(80).want("10.0.0.7")),
                S(svc("b").key("k2").tcp(443).want("10.0.0.7")),
                Addrs("a", &["10.0.0.7"]),
                Reason(
                    "b",
                    PendingReason::AddressTaken {
                        address: ip("10.0.0.7"),
                        by: id("a"),
                    },
                ),
            ],
        ),
        (
            "requested address held by an unshared service is taken",
            vec![
                P(pool("p").cidr("10.0.0.0/24")),
                S(svc("a")),
                S(svc("b").key("k").want("10.0.0.1")),
                Pending("b", "address_taken"),
                // Freed when the holder goes.
                DelS("a"),
                Addrs("b", &["10.0.0.1"]),
            ],
        ),
        (
            "shared address stays while a sharer remains, owner moves",
            vec![
                P(pool("p").cidr("10.0.0.0/24")),
                S(svc("a").key("k").tcp(80)),
                S(svc("b").key("k").tcp(81)),
                DelS("a"),
                Addrs("b", &["10.0.0.1"]),
                Users("10.0.0.1", &["b"]),
                Used("p", 1),
                Restart,
                DelS("b"),
                Used("p", 0),
            ],
        ),
        (
            "a sharer whose ports start to clash leaves",
            vec![
                P(pool("p").cidr("10.0.0.0/24")),
                S(svc("a").key("k").tcp(80)),
                S(svc("b").key("k").tcp(81)),
                S(svc("b").key("k").tcp(81).tcp(80)),
                Addrs("a", &["10.0.0.1"]),
                Pending("b", "sharing_port_clash"),
                Changed("b", ChangeCause::SharingPortClash),
            ],
        ),
        // ---- requested addresses ----
        (
            "requested address inside a pool",
            vec![
                P(pool("p").cidr("10.0.0.0/24")),
                S(svc("a").want("10.0.0.200")),
                S(svc("b")),
                Addrs("a", &["10.0.0.200"]),
                Addrs("b", &["10.0.0.1"]),
            ],
        ),
        (
            "requested address outside every pool",
            vec![
                P(pool("p").cidr("10.0.0.0/24")),
                S(svc("a").want("192.168.1.1")),
                Reason(
                    "a",
                    PendingReason::RequestedOutsidePools {
                        address: ip("192.168.1.1"),
                    },
                ),
                // A pool containing it arrives: served.
                P(pool("q").cidr("192.168.1.0/24")),
                Addrs("a", &["192.168.1.1"]),
                Reported(&["a"]),
            ],
        ),
        (
            "requested address in a pool that does not select the service",
            vec![
                P(pool("p").cidr("10.0.0.0/24").sel("tier", "web")),
                S(svc("a").want("10.0.0.9")),
                Pending("a", "requested_not_selected"),
            ],
        ),
        (
            "requested first address needs allow_first_last",
            vec![
                P(pool("p").cidr("10.0.0.0/24")),
                S(svc("a").want("10.0.0.0")),
                Pending("a", "address_unusable"),
                P(pool("p").cidr("10.0.0.0/24").first_last()),
                Addrs("a", &["10.0.0.0"]),
            ],
        ),
        // ---- conflicts ----
        (
            "later overlapping pool is conflicting and unused",
            vec![
                P(pool("a").cidr("10.0.0.0/24")),
                P(pool("b").cidr("10.0.1.0/24").cidr("10.0.0.128/25")),
                Conflict("a", None),
                Conflict("b", Some("a")),
                S(svc("s").label("x", "y")),
                Addrs("s", &["10.0.0.1"]),
            ],
        ),
        (
            "deleting the earlier pool un-conflicts the later one",
            vec![
                P(pool("a").cidr("10.0.0.0/24").sel("tier", "other")),
                P(pool("b").cidr("10.0.0.0/25").sel("tier", "web")),
                S(svc("s").label("tier", "web")),
                Pending("s", "pool_conflicting"),
                DelP("a"),
                Conflict("b", None),
                Addrs("s", &["10.0.0.1"]),
                Reported(&["s"]),
            ],
        ),
        (
            "editing the earlier pool away from the overlap un-conflicts",
            vec![
                P(pool("a").cidr("10.0.0.0/24")),
                P(pool("b").range("10.0.0.250", "10.0.1.5")),
                Conflict("b", Some("a")),
                P(pool("a").cidr("10.0.0.0/25")),
                Conflict("b", None),
            ],
        ),
        (
            "a conflicting pool claims nothing; its removal re-resolves the chain",
            vec![
                P(pool("a").cidr("10.0.0.0/25").sel("tier", "a")),
                P(pool("b").cidr("10.0.0.0/24").sel("tier", "b")),
                P(pool("c").cidr("10.0.0.128/25").sel("tier", "c")),
                Conflict("b", Some("a")),
                Conflict("c", None),
                S(svc("s").label("tier", "c")),
                Addrs("s", &["10.0.0.129"]),
                // Without a, b is accepted and c (overlapping b) conflicts:
                // s loses its address.
                DelP("a"),
                Conflict("b", None),
                Conflict("c", Some("b")),
                Changed("s", ChangeCause::PoolConflicting),
                Pending("s", "pool_conflicting"),
            ],
        ),
        (
            "ipv6 ranges conflict too",
            vec![
                P(pool("a").cidr("fd00::/120")),
                P(pool("b").range("fd00::ff", "fd00::1ff")),
                P(pool("c").range("fd00::100", "fd00::1ff")),
                Conflict("b", Some("a")),
                Conflict("c", None),
            ],
        ),
        // ---- exhaustion ----
        (
            "exhaustion names the pool and family",
            vec![
                P(pool("p").cidr("10.0.0.0/30")),
                S(svc("a")),
                S(svc("b")),
                S(svc("c")),
                Reason(
                    "c",
                    PendingReason::Exhausted {
                        family: Family::V4,
                        pools: vec!["p".into()],
                    },
                ),
                DelS("a"),
                Addrs("c", &["10.0.0.1"]),
                Reported(&["c"]),
            ],
        ),
        (
            "exhaustion falls through to the next pool",
            vec![
                P(pool("small").cidr("10.0.0.0/31")),
                P(pool("big").cidr("10.1.0.0/24")),
                S(svc("a")),
                S(svc("b")),
                S(svc("c")),
                Addrs("a", &["10.0.0.0"]),
                Addrs("b", &["10.0.0.1"]),
                Addrs("c", &["10.1.0.1"]),
            ],
        ),
        // ---- dual stack ----
        (
            "RequireDualStack gets both families in its order",
            vec![
                P(pool("p").cidr("10.0.0.0/24").cidr("fd00::/120")),
                S(svc("a").policy(RequireDualStack, &[IPv6, IPv4])),
                Addrs("a", &["fd00::1", "10.0.0.1"]),
            ],
        ),
        (
            "RequireDualStack without ipv6 holds nothing",
            vec![
                P(pool("p").cidr("10.0.0.0/24")),
                S(svc("a").policy(RequireDualStack, &[])),
                Reason("a", PendingReason::NoPoolSelects { family: Family::V6 }),
                Used("p", 0),
            ],
        ),
        (
            "PreferDualStack takes what it can",
            vec![
                P(pool("p").cidr("10.0.0.0/24")),
                S(svc("a").policy(PreferDualStack, &[])),
                Addrs("a", &["10.0.0.1"]),
                Missing("a", "no_pool_selects"),
                // The missing family arrives later.
                P(pool("v6").cidr("fd00::/120")),
                Addrs("a", &["10.0.0.1", "fd00::1"]),
            ],
        ),
        (
            "SingleStack ipv6 and ipv4",
            vec![
                P(pool("p").cidr("10.0.0.0/24").cidr("fd00::/120")),
                S(svc("six").policy(SingleStack, &[IPv6])),
                S(svc("four").policy(SingleStack, &[IPv4])),
                Addrs("six", &["fd00::1"]),
                Addrs("four", &["10.0.0.1"]),
            ],
        ),
        (
            "RequireDualStack losing one family releases the other",
            vec![
                P(pool("v4").cidr("10.0.0.0/24")),
                P(pool("v6").cidr("fd00::/120")),
                S(svc("a").policy(RequireDualStack, &[])),
                Addrs("a", &["10.0.0.1", "fd00::1"]),
                DelP("v6"),
                Pending("a", "no_pool_selects"),
                Changed("a", ChangeCause::DualStackIncomplete),
                Used("v4", 0),
            ],
        ),
        // ---- disabled pools ----
        (
            "a disabled pool serves nobody",
            vec![
                P(pool("p").cidr("10.0.0.0/24").disabled()),
                S(svc("a")),
                Pending("a", "pool_disabled"),
                P(pool("p").cidr("10.0.0.0/24")),
                Addrs("a", &["10.0.0.1"]),
            ],
        ),
        (
            "disabling a pool moves its services to the next one",
            vec![
                P(pool("p").cidr("10.0.0.0/24")),
                P(pool("q").cidr("10.1.0.0/24")),
                S(svc("a")),
                Addrs("a", &["10.0.0.1"]),
                P(pool("p").cidr("10.0.0.0/24").disabled()),
                Addrs("a", &["10.1.0.1"]),
                Changed("a", ChangeCause::PoolDisabled),
                Reported(&["a"]),
            ],
        ),
        (
            "a disabled pool keeps its claim",
            vec![
                P(pool("p").cidr("10.0.0.0/24").disabled()),
                P(pool("q").cidr("10.0.0.0/24")),
                Conflict("q", Some("p")),
            ],
        ),
        // ---- ranges and allow_first_last ----
        (
            "a range is fully usable",
            vec![
                P(pool("p").range("10.0.1.0", "10.0.1.2")),
                S(svc("a")),
                S(svc("b")),
                S(svc("c")),
                S(svc("d")),
                Addrs("a", &["10.0.1.0"]),
                Addrs("b", &["10.0.1.1"]),
                Addrs("c", &["10.0.1.2"]),
                Pending("d", "exhausted"),
            ],
        ),
        (
            "allow_first_last hands out network and broadcast",
            vec![
                P(pool("p").cidr("10.0.0.0/30").first_last()),
                S(svc("a")),
                S(svc("b")),
                S(svc("c")),
                S(svc("d")),
                Addrs("a", &["10.0.0.0"]),
                Addrs("d", &["10.0.0.3"]),
            ],
        ),
        (
            "turning allow_first_last off moves the holder of the first address",
            vec![
                P(pool("p").cidr("10.0.0.0/29").first_last()),
                S(svc("a")),
                S(svc("b")),
                Addrs("a", &["10.0.0.0"]),
                P(pool("p").cidr("10.0.0.0/29")),
                Addrs("a", &["10.0.0.2"]),
                Addrs("b", &["10.0.0.1"]),
                Changed("a", ChangeCause::OutsidePool),
                Reported(&["a"]),
                S(svc("c")),
                S(svc("d")),
                S(svc("e")),
                S(svc("f")),
                S(svc("g")),
                Addrs("f", &["10.0.0.6"]),
                Pending("g", "exhausted"),
            ],
        ),
        // ---- stickiness ----
        (
            "restart keeps addresses even after other pools change",
            vec![
                P(pool("a")
                    .cidr("10.0.0.0/24")
                    .expr("tier", DoesNotExist, &[])),
                P(pool("b").cidr("10.1.0.0/24").sel("tier", "b")),
                S(svc("x").want("10.0.0.50")),
                S(svc("y")),
                S(svc("z").label("tier", "b")),
                Restart,
                // The daemon re-applies what it sees, with edits made while
                // it was down: a new earlier-listed pool, b grown.
                P(pool("new").cidr("10.9.0.0/24")),
                P(pool("b")
                    .cidr("10.1.0.0/24")
                    .cidr("10.2.0.0/24")
                    .sel("tier", "b")),
                S(svc("x").want("10.0.0.50")),
                S(svc("y")),
                S(svc("z").label("tier", "b")),
                Addrs("x", &["10.0.0.50"]),
                Addrs("y", &["10.0.0.1"]),
                Addrs("z", &["10.1.0.1"]),
                Reported(&[]),
            ],
        ),
        (
            "own pool shrinking reassigns with a recorded reason",
            vec![
                P(pool("p").cidr("10.0.0.0/24")),
                S(svc("a").want("10.0.0.200")),
                S(svc("b")),
                P(pool("p").cidr("10.0.0.0/25")),
                Addrs("b", &["10.0.0.1"]),
                Pending("a", "requested_outside_pools"),
                Changed("a", ChangeCause::OutsidePool),
                Restart,
                Changed("a", ChangeCause::OutsidePool),
            ],
        ),
        (
            "own pool shrinking moves an unrequested address within the pool",
            vec![
                P(pool("p").range("10.0.0.10", "10.0.0.20")),
                S(svc("a")),
                S(svc("b")),
                P(pool("p").range("10.0.0.11", "10.0.0.20")),
                Addrs("a", &["10.0.0.12"]),
                Addrs("b", &["10.0.0.11"]),
                Changed("a", ChangeCause::OutsidePool),
            ],
        ),
        (
            "pool stops selecting: moved to the next pool",
            vec![
                P(pool("p").cidr("10.0.0.0/24")),
                P(pool("q").cidr("10.1.0.0/24")),
                S(svc("a").label("tier", "web")),
                P(pool("p").cidr("10.0.0.0/24").sel("tier", "db")),
                Addrs("a", &["10.1.0.1"]),
                Changed("a", ChangeCause::NotSelected),
            ],
        ),
        (
            "changing the requested address moves the service",
            vec![
                P(pool("p").cidr("10.0.0.0/24")),
                S(svc("a").want("10.0.0.5")),
                S(svc("a").want("10.0.0.6")),
                Addrs("a", &["10.0.0.6"]),
                Changed("a", ChangeCause::RequestChanged),
                Used("p", 1),
            ],
        ),
        (
            "deleting the own pool reassigns elsewhere",
            vec![
                P(pool("p").cidr("10.0.0.0/24")),
                P(pool("q").cidr("10.1.0.0/24")),
                S(svc("a")),
                DelP("p"),
                Addrs("a", &["10.1.0.1"]),
                Changed("a", ChangeCause::PoolDeleted),
            ],
        ),
    ]
}

#[test]
fn scenarios() {
    let cases = cases();
    assert!(cases.len() >= 30, "{} cases", cases.len());
    for (name, steps) in cases {
        run(name, steps);
    }
}

/// An allocator change that fails where the holdings say it cannot is
/// reported in every build. It was a `debug_assert!`: a release build
/// went on with holdings and allocator apart.
#[test]
fn an_allocator_at_odds_with_the_holdings_is_reported_not_skipped() {
    let mut lb = LbIpam::new();
    lb.apply_pool(pool("p").cidr("10.0.0.0/24")).unwrap();
    lb.apply_service(svc("a").key("k").tcp(80)).unwrap();
    lb.apply_service(svc("b").key("k").tcp(81)).unwrap();
    assert!(lb.take_faults().is_empty());
    let shared = lb.service_status("ns/a").unwrap().addresses();
    assert_eq!(shared, lb.service_status("ns/b").unwrap().addresses());
    // Behind LbIpam's back, the next user already holds another address,
    // so the shared one cannot move to it when its owner goes.
    lb.manager_mut()
        .allocate_next("p", Family::V4, crate::owner::Owner::load_balancer("ns/b"))
        .unwrap();
    lb.delete_service("ns/a").unwrap();
    let faults = lb.take_faults();
    assert!(
        faults.iter().any(|f| f.contains("next user ns/b")),
        "{faults:?}"
    );
    assert!(lb.take_faults().is_empty(), "taken once");
}

#[test]
fn plan_has_ipcache_and_l2_entries() {
    let mut lb = LbIpam::new();
    lb.apply_pool(pool("l2").cidr("10.0.0.0/24").cidr("fd00::/120").l2())
        .unwrap();
    lb.apply_pool(pool("routed").cidr("10.1.0.0/24")).unwrap();
    lb.apply_service(svc("a").policy(RequireDualStack, &[]))
        .unwrap();
    lb.apply_service(svc("b").want("10.1.0.9")).unwrap();
    let plan = lb.plan();
    assert_eq!(plan.ipcache_v4.len(), 2);
    assert_eq!(plan.ipcache_v6.len(), 1);
    let v = plan.ipcache_v4[&"10.0.0.1/32".parse().unwrap()];
    assert_eq!(
        (v.identity, v.flags),
        (identity::LOADBALANCER, ipcache_flags::LOADBALANCER)
    );
    assert_eq!(
        plan.l2_announce_v4,
        BTreeMap::from([("10.0.0.1".parse().unwrap(), "l2".to_owned())])
    );
    // The IPv6 address of an l2 pool is announced too (NDP).
    let v6: Vec<_> = plan.ipcache_v6.keys().map(|n| n.addr()).collect();
    assert_eq!(
        plan.l2_announce_v6,
        BTreeMap::from([(v6[0], "l2".to_owned())])
    );
    // Diffable against the kernel's view.
    let d = crate::plan::diff(&plan.ipcache_v4, &BTreeMap::new());
    assert_eq!(d.add.len(), 2);
}

#[test]
fn metrics_count_usage_conflicts_and_pending() {
    let mut lb = LbIpam::new();
    lb.apply_pools([pool("a").cidr("10.0.0.0/30"), pool("b").cidr("10.0.0.0/24")])
        .unwrap();
    for s in ["s1", "s2", "s3"] {
        lb.apply_service(svc(s)).unwrap();
    }
    lb.apply_service(svc("x").want("1.2.3.4")).unwrap();
    let m = lb.metrics();
    assert_eq!(
        m.pools["a"],
        PoolMetrics {
            capacity: 2,
            used: 2,
            free: 0,
            conflicting: false,
            disabled: false
        }
    );
    assert!(m.pools["b"].conflicting);
    assert_eq!(m.pools["b"].free, 0);
    assert_eq!(m.assigned, 2);
    assert_eq!(
        m.pending_by_reason,
        BTreeMap::from([
            ("exhausted".to_owned(), 1),
            ("requested_outside_pools".to_owned(), 1)
        ])
    );
}

#[test]
fn validation_names_the_field() {
    let cases: Vec<(LbPoolSpec, &str)> = vec![
        (pool(""), "lb pool name is empty"),
        (
            pool("p").cidr("10.0.0.1/24"),
            "lb pool p: cidrs[0]: invalid cidr 10.0.0.1/24",
        ),
        (
            pool("p").range("10.0.0.9", "10.0.0.1"),
            "lb pool p: ranges[0]: range 10.0.0.9-10.0.0.1 starts after it stops",
        ),
        (
            pool("p").range("10.0.0.1", "fd00::1"),
            "lb pool p: ranges[0]: range 10.0.0.1-fd00::1 mixes ipv4 and ipv6",
        ),
        (
            pool("p").cidr("10.0.0.0/24").range("10.0.0.5", "10.0.1.5"),
            "lb pool p: ranges[0] overlaps cidrs[0]",
        ),
        (
            pool("p").expr("env", In, &[]),
            "lb pool p: service_selector.match_expressions[0]: In: operator needs at least one value",
        ),
        (
            pool("p").expr("env", Exists, &["x"]),
            "lb pool p: service_selector.match_expressions[0]: Exists: operator takes no values",
        ),
        (
            pool("p").expr("", DoesNotExist, &[]),
            "lb pool p: service_selector.match_expressions[0]: DoesNotExist: key is empty",
        ),
    ];
    let mut lb = LbIpam::new();
    for (spec, msg) in cases {
        assert_eq!(lb.apply_pool(spec).unwrap_err().to_string(), msg);
    }
    assert_eq!(
        lb.apply_pools([pool("p"), pool("p")]).unwrap_err(),
        LbError::DuplicatePool { pool: "p".into() }
    );
    let svc_cases = vec![
        (
            svc("a")
                .want("10.0.0.1")
                .want("10.0.0.2")
                .policy(PreferDualStack, &[]),
            "service ns/a: load_balancer_ips[1]: more than one address of a family",
        ),
        (
            svc("a").want("fd00::1"),
            "service ns/a: load_balancer_ips[0]: address family is not one of the service's families",
        ),
        (
            svc("a").policy(SingleStack, &[IPv4, IPv6]),
            "service ns/a: ip_families: single stack takes one family",
        ),
        (
            ServiceSpec::new("", "a"),
            "service /a: namespace: must be non-empty without '/'",
        ),
        (
            ServiceSpec::new("ns", "a\u{0}b"),
            "service ns/a\u{0}b: name: must not contain control characters",
        ),
    ];
    for (spec, msg) in svc_cases {
        assert_eq!(lb.apply_service(spec).unwrap_err().to_string(), msg);
    }
    let long = ServiceSpec::new("ns", "a".repeat(254));
    assert!(
        lb.apply_service(long)
            .unwrap_err()
            .to_string()
            .ends_with("name: must be at most 253 bytes")
    );
    assert_eq!(
        lb.delete_pool("nope").unwrap_err().to_string(),
        "unknown lb pool nope"
    );
}

#[test]
fn specs_read_kubernetes_shapes_and_refuse_unknown_fields() {
    let p: LbPoolSpec = serde_json::from_str(
        r#"{"name":"p","cidrs":["10.0.0.0/24","fd00::/120"],
            "ranges":[{"start":"10.1.0.1","stop":"10.1.0.9"}],"announce":"l2",
            "serviceSelector":{"matchLabels":{"a":"b"},
              "matchExpressions":[{"key":"k","operator":"NotIn","values":["v"]}]}}"#,
    )
    .unwrap();
    assert_eq!(p.announce, Some(Announce::L2));
    assert_eq!(p.service_selector.match_expressions[0].operator, NotIn);
    p.validate().unwrap();
    let typo = r#"{"name":"p","cidr":["10.0.0.0/24"]}"#;
    let err = serde_json::from_str::<LbPoolSpec>(typo).unwrap_err();
    assert!(err.to_string().contains("cidr"), "{err}");
    let s: ServiceSpec = serde_json::from_str(
        r#"{"namespace":"ns","name":"a","ipFamilyPolicy":"RequireDualStack",
            "ipFamilies":["IPv6","IPv4"],"loadBalancerIPs":["fd00::5"],
            "sharing_key":"k","ports":[{"protocol":"UDP","port":53},{"port":80}]}"#,
    )
    .unwrap();
    assert_eq!(s.families(), vec![Family::V6, Family::V4]);
    assert_eq!(s.ports[1].protocol, Protocol::TCP);
    s.validate().unwrap();
}

#[test]
fn restore_refuses_inconsistent_snapshots() {
    let mut lb = LbIpam::new();
    lb.apply_pool(pool("p").cidr("10.0.0.0/24")).unwrap();
    lb.apply_service(svc("a")).unwrap();
    let mut snap = lb.snapshot();
    snap.services[0].held[0].address = ip("10.0.0.77");
    assert!(matches!(
        LbIpam::restore(&snap),
        Err(LbError::InconsistentSnapshot { .. })
    ));
    let mut snap = lb.snapshot();
    snap.services.clear();
    assert!(matches!(
        LbIpam::restore(&snap),
        Err(LbError::InconsistentSnapshot { .. })
    ));
}

// ---- property tests ----

#[derive(Clone, Debug)]
enum Op {
    Pool(LbPoolSpec),
    DelPool(usize),
    Svc(ServiceSpec),
    DelSvc(usize),
}

const POOL_NAMES: [&str; 4] = ["p0", "p1", "p2", "p3"];
const SVC_NAMES: [&str; 6] = ["s0", "s1", "s2", "s3", "s4", "s5"];

fn arb_pool() -> impl Strategy<Value = LbPoolSpec> {
    // Small blocks in one /26 (v4) and one /122 (v6), so pools overlap and
    // run out often.
    let v4 = (0u8..64, 28u8..=32).prop_map(|(off, len)| {
        let net: ipnet::Ipv4Net = format!("10.0.0.{off}/{len}").parse().unwrap();
        IpNet::V4(net.trunc())
    });
    let v6 = (0u8..64, 124u8..=128).prop_map(|(off, len)| {
        let net: ipnet::Ipv6Net = format!("fd00::{off:x}/{len}").parse().unwrap();
        IpNet::V6(net.trunc())
    });
    let range = (0u8..64, 0u8..6).prop_map(|(s, n)| AddrRange {
        start: ip(&format!("10.0.0.{s}")),
        stop: ip(&format!("10.0.0.{}", s.saturating_add(n).min(63))),
    });
    (
        0..POOL_NAMES.len(),
        prop::option::of(v4),
        prop::option::of(v6),
        prop::option::of(range),
        any::<bool>(),
        prop::bool::weighted(0.15),
        prop::option::of(0u8..3),
    )
        .prop_map(|(n, v4, v6, range, first_last, disabled, sel)| {
            let mut p = pool(POOL_NAMES[n]);
            p.cidrs.extend(v4);
            p.cidrs.extend(v6);
            if let Some(r) = range {
                let overlaps_own = p.blocks().iter().any(|b| {
                    let rb = &LbPoolSpec {
                        ranges: vec![r],
                        ..pool("x")
                    }
                    .blocks()[0];
                    b.family == rb.family && b.start <= rb.end && rb.start <= b.end
                });
                if !overlaps_own {
                    p.ranges.push(r);
                }
            }
            p.allow_first_last = first_last;
            p.disabled = disabled;
            if let Some(v) = sel {
                p = p.sel("tier", &v.to_string());
            }
            p
        })
}

fn arb_service() -> impl Strategy<Value = ServiceSpec> {
    (
        0..SVC_NAMES.len(),
        prop::option::of(0u8..3),
        0u8..4,
        prop::option::of(0u8..2),
        prop::collection::vec(80u16..83, 0..2),
        prop::option::of(0u8..64),
    )
        .prop_map(|(n, tier, policy, key, ports, want)| {
            let mut s = svc(SVC_NAMES[n]);
            if let Some(t) = tier {
                s = s.label("tier", &t.to_string());
            }
            s = match policy {
                0 => s,
                1 => s.policy(SingleStack, &[IPv6]),
                2 => s.policy(PreferDualStack, &[]),
                _ => s.policy(RequireDualStack, &[IPv6, IPv4]),
            };
            if let Some(k) = key {
                s = s.key(&format!("k{k}"));
            }
            for p in ports {
                s = s.tcp(p);
            }
            if let Some(w) = want {
                let fam = s.families()[0];
                s = s.want(&match fam {
                    Family::V4 => format!("10.0.0.{w}"),
                    Family::V6 => format!("fd00::{w:x}"),
                });
            }
            s
        })
}

fn arb_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => arb_pool().prop_map(Op::Pool),
        1 => (0..POOL_NAMES.len()).prop_map(Op::DelPool),
        4 => arb_service().prop_map(Op::Svc),
        1 => (0..SVC_NAMES.len()).prop_map(Op::DelSvc),
    ]
}

fn apply(lb: &mut LbIpam, op: &Op) {
    let _ = match op {
        Op::Pool(p) => lb.apply_pool(p.clone()),
        Op::DelPool(i) => lb.delete_pool(POOL_NAMES[*i]),
        Op::Svc(s) => lb.apply_service(s.clone()),
        Op::DelSvc(i) => lb.delete_service(&id(SVC_NAMES[*i])),
    };
}

/// Checks the externally visible rules from the statuses alone.
fn check_rules(lb: &LbIpam) -> Result<(), TestCaseError> {
    let specs: BTreeMap<String, ServiceSpec> = lb
        .snapshot()
        .services
        .into_iter()
        .map(|r| (r.spec.id(), r.spec))
        .collect();
    let mut by_addr: BTreeMap<IpAddr, Vec<&str>> = BTreeMap::new();
    for (sid, st) in lb.services() {
        let spec = &specs[sid];
        for h in lb.holdings(sid) {
            by_addr.entry(h.address).or_default().push(sid);
            // In a usable pool that selects the service.
            let ps = lb.pool_status(&h.pool).expect("pool exists");
            prop_assert!(ps.conflict.is_none() && !ps.spec.disabled, "{sid}: {h:?}");
            prop_assert!(ps.spec.service_selector.matches(&spec.labels));
            let in_pool = ps.spec.cidrs.iter().any(|c| c.contains(&h.address))
                || ps
                    .spec
                    .ranges
                    .iter()
                    .any(|r| r.start <= h.address && h.address <= r.stop);
            prop_assert!(in_pool, "{sid}: {h:?} outside {:?}", ps.spec);
            prop_assert!(st.addresses().contains(&h.address));
        }
        if spec.ip_family_policy == RequireDualStack {
            prop_assert!(matches!(lb.holdings(sid).len(), 0 | 2), "{sid}");
        }
    }
    for (addr, users) in by_addr {
        if users.len() > 1 {
            // Shared: one key, no common port.
            let key = &specs[users[0]].sharing_key;
            prop_assert!(key.is_some(), "{addr} given to unshared {users:?}");
            for (i, a) in users.iter().enumerate() {
                prop_assert_eq!(&specs[*a].sharing_key, key);
                for b in &users[i + 1..] {
                    prop_assert!(clash_free(&specs[*a], &specs[*b]), "{addr}: {a} {b}");
                }
            }
        }
    }
    Ok(())
}

fn clash_free(a: &ServiceSpec, b: &ServiceSpec) -> bool {
    !a.ports.iter().any(|p| b.ports.contains(p))
}

proptest! {
    #![proptest_config(crate::testing::cases(256))]

    #[test]
    fn random_sequences_keep_the_rules(ops in prop::collection::vec(arb_op(), 1..40)) {
        let mut lb = LbIpam::new();
        for op in &ops {
            apply(&mut lb, op);
            lb.check_invariants();
            check_rules(&lb)?;
        }
    }

    #[test]
    fn snapshot_restore_is_exact(ops in prop::collection::vec(arb_op(), 1..40)) {
        let mut lb = LbIpam::new();
        for op in &ops {
            apply(&mut lb, op);
        }
        let snap = lb.snapshot();
        let json = serde_json::to_string(&snap).unwrap();
        let back: LbSnapshot = serde_json::from_str(&json).unwrap();
        prop_assert_eq!(&back, &snap);
        let mut restored = LbIpam::restore(&back).unwrap();
        restored.check_invariants();
        prop_assert_eq!(restored.snapshot(), snap.clone());
        prop_assert_eq!(restored.plan(), lb.plan());
        prop_assert_eq!(restored.metrics(), lb.metrics());
        // Both continue identically.
        for op in &ops {
            apply(&mut lb, op);
            apply(&mut restored, op);
        }
        prop_assert_eq!(restored.snapshot(), lb.snapshot());
    }

    #[test]
    fn conflicts_match_a_pairwise_oracle(ops in prop::collection::vec(arb_op(), 1..40)) {
        let mut lb = LbIpam::new();
        for op in &ops {
            apply(&mut lb, op);
        }
        // Greedy over pools in apply order, pairwise: what the index must say.
        let pools: Vec<PoolStatus> = lb.pools().collect();
        let mut accepted: Vec<&PoolStatus> = Vec::new();
        for p in &pools {
            let overlaps = accepted.iter().any(|q| {
                p.spec.blocks().iter().any(|a| q.spec.blocks().iter().any(|b| {
                    a.family == b.family && a.start <= b.end && b.start <= a.end
                }))
            });
            prop_assert_eq!(p.conflict.is_some(), overlaps, "{}", p.spec.name);
            if !overlaps {
                accepted.push(p);
            }
        }
    }
}

#[test]
fn lb_pools_in_special_ranges_are_refused() {
    for (cidr, range, what) in [
        (Some("127.0.0.0/30"), None, "loopback"),
        (Some("::ffff:10.0.0.0/126"), None, "IPv4-mapped"),
        (None, Some(("ff02::1", "ff02::5")), "multicast"),
        (None, Some(("169.254.0.1", "169.254.0.9")), "link-local"),
        (None, Some(("0.0.0.1", "0.0.0.3")), "unspecified"),
    ] {
        let mut p = pool("special");
        if let Some(c) = cidr {
            p = p.cidr(c);
        }
        if let Some((a, b)) = range {
            p = p.range(a, b);
        }
        let err = p.validate().expect_err(what);
        assert!(
            matches!(err, LbError::SpecialRange { .. }) && err.to_string().contains(what),
            "{what}: {err}"
        );
    }
    pool("fine")
        .cidr("192.0.2.0/28")
        .range("2001:db8::10", "2001:db8::20")
        .validate()
        .expect("ordinary ranges");
}
