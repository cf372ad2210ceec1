//! Agent-owned addresses (ingress, health, router): which to reserve and
//! which to release, given the configuration and what is held.
//!
//! The store remembers every role allocation, so a role that is disabled, or
//! moved to another pool or family, releases exactly what it held: nothing
//! leaks across configuration changes (a known failure of agents that derive
//! role addresses from config alone).

use std::collections::BTreeSet;

use crate::cidr::Family;
use crate::manager::Allocation;
use crate::owner::{AgentRole, Owner};

/// One role address the configuration asks for.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RoleWant {
    /// The role.
    pub role: AgentRole,
    /// The family.
    pub family: Family,
    /// The pool to take it from.
    pub pool: String,
}

/// What to do to make holdings match the configuration.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RolePlan {
    /// Role addresses to reserve (not held yet).
    pub reserve: Vec<RoleWant>,
    /// Role allocations no longer wanted (role disabled, or moved to another
    /// pool or family).
    pub release: Vec<Allocation>,
}

/// Compares wanted role addresses with held allocations (any owner kinds may
/// be passed; only agent roles are considered).
pub fn plan<'a>(
    wanted: impl IntoIterator<Item = RoleWant>,
    held: impl IntoIterator<Item = &'a Allocation>,
) -> RolePlan {
    let wanted: BTreeSet<RoleWant> = wanted.into_iter().collect();
    let mut kept = BTreeSet::new();
    let mut out = RolePlan::default();
    for a in held {
        let Owner::Agent { role } = a.owner else {
            continue;
        };
        let have = RoleWant {
            role,
            family: a.family(),
            pool: a.pool.clone(),
        };
        if wanted.contains(&have) {
            kept.insert(have);
        } else {
            out.release.push(a.clone());
        }
    }
    out.reserve = wanted.difference(&kept).cloned().collect();
    out.release.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::owner::Generation;

    fn want(role: AgentRole, family: Family, pool: &str) -> RoleWant {
        RoleWant {
            role,
            family,
            pool: pool.into(),
        }
    }

    fn held(role: AgentRole, addr: &str, pool: &str) -> Allocation {
        Allocation {
            pool: pool.into(),
            address: addr.parse().expect("literal"),
            owner: Owner::agent(role),
            generation: Generation(1),
        }
    }

    #[test]
    fn fresh_start_reserves_everything_wanted() {
        let p = plan(
            [
                want(AgentRole::Ingress, Family::V4, "a"),
                want(AgentRole::Health, Family::V6, "a"),
            ],
            [],
        );
        assert_eq!(p.reserve.len(), 2);
        assert!(p.release.is_empty());
    }

    #[test]
    fn restart_with_the_same_config_changes_nothing() {
        let h = [held(AgentRole::Ingress, "10.0.0.1", "a")];
        let p = plan([want(AgentRole::Ingress, Family::V4, "a")], &h);
        assert_eq!(p, RolePlan::default());
    }

    #[test]
    fn a_disabled_role_releases_what_it_held() {
        let h = [
            held(AgentRole::Ingress, "10.0.0.1", "a"),
            held(AgentRole::Router, "10.0.0.2", "a"),
        ];
        let p = plan([want(AgentRole::Router, Family::V4, "a")], &h);
        assert_eq!(p.release, vec![h[0].clone()]);
        assert!(p.reserve.is_empty());
    }

    #[test]
    fn moving_a_role_to_another_pool_or_family_swaps_the_address() {
        let h = [held(AgentRole::Health, "10.0.0.3", "a")];
        let p = plan(
            [
                want(AgentRole::Health, Family::V4, "b"),
                want(AgentRole::Health, Family::V6, "a"),
            ],
            &h,
        );
        assert_eq!(p.release, vec![h[0].clone()]);
        assert_eq!(p.reserve.len(), 2);
    }

    #[test]
    fn other_owners_are_never_touched() {
        let endpoint = Allocation {
            pool: "a".into(),
            address: "10.0.0.9".parse().expect("literal"),
            owner: Owner::endpoint("c", "eth0"),
            generation: Generation(3),
        };
        let lb = Allocation {
            owner: Owner::load_balancer("ns/s"),
            ..endpoint.clone()
        };
        let p = plan([], [&endpoint, &lb]);
        assert_eq!(p, RolePlan::default());
    }
}
