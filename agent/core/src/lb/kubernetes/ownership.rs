//! Other controllers' Services (#44 item 2): which `type: LoadBalancer`
//! Services lockstep takes, which it leaves to another implementation,
//! which addresses it adopts, and what it may write on a status.
//!
//! A cluster often has more than one load-balancer implementation (a cloud
//! provider's, MetalLB, Cilium), and a migration moves Services from one to
//! another while they carry traffic. The rules, and why:
//! - **Class.** A Service of another `spec.loadBalancerClass` is never
//!   lockstep's. A class-less one is only when `[kubernetes]
//!   serve_classless` says so (the default, as with MetalLB and Cilium).
//! - **An address another controller set is left alone.** The ingress of a
//!   class-less Service that lockstep did not write (its condition is not
//!   `True`) and that names a host name or an address outside every
//!   lockstep pool belongs to another implementation: lockstep neither
//!   assigns nor writes anything on that Service.
//! - **Adoption.** When such an ingress lies wholly inside lockstep's
//!   pools, the Service is taken over with those addresses requested, so
//!   moving from MetalLB or Cilium keeps every address. Only until lockstep
//!   has written its own: its LB state keeps an assignment from then on.
//! - **Nothing before a pool.** Before any lockstep pool exists, a Service
//!   lockstep never wrote gets nothing: no condition, no Event.
//! - **No empty ingress over another's address.** Lockstep writes a
//!   non-empty ingress only with its condition `True`, so an ingress under
//!   any other condition was not lockstep's: when lockstep has no address
//!   to give, it writes its condition and leaves that ingress as it is.

use std::net::IpAddr;

use super::super::LbPoolSpec;
use super::{Condition, KubeService, Request, SERVICE_CONDITION, ServiceOutcome, lb_request};
use crate::cidr::Family;

/// What lockstep serves: the class, class-less Services or not, and the
/// pools whose addresses it may adopt.
#[derive(Clone, Copy, Debug)]
pub struct Serving<'a> {
    /// The `spec.loadBalancerClass` served.
    pub class: &'a str,
    /// Whether Services without a class are served.
    pub classless: bool,
    /// Lockstep's pools, as defined (valid ones, not being deleted).
    pub pools: &'a [LbPoolSpec],
}

impl Serving<'_> {
    fn in_pools(&self, addr: IpAddr) -> bool {
        self.pools.iter().any(|p| p.holds(addr))
    }
}

/// The addresses lockstep gave `svc` (its ingress, with lockstep's
/// condition `True`) when it is a LoadBalancer Service; `None` for any
/// other Service, or an ingress that is not all addresses.
#[must_use]
pub fn lockstep_ingress(svc: &KubeService) -> Option<Vec<IpAddr>> {
    if svc.type_.as_deref() != Some("LoadBalancer") || !ingress_is_ours(svc) {
        return None;
    }
    ingress_addrs(svc)
}

/// Whether lockstep wrote the Service's ingress: its condition is `True`
/// (it writes a non-empty ingress with nothing else).
pub(super) fn ingress_is_ours(svc: &KubeService) -> bool {
    svc.condition.as_ref().is_some_and(|c| c.status == "True")
}

/// The ingress entries as addresses; `None` when one is a host name (or
/// not an address at all).
pub(super) fn ingress_addrs(svc: &KubeService) -> Option<Vec<IpAddr>> {
    svc.ingress.iter().map(|e| e.parse().ok()).collect()
}

/// What `svc` asks of lockstep, given what it serves and what the status
/// already holds (see the module's rules).
pub fn request(svc: &KubeService, serving: &Serving<'_>) -> Request {
    if svc.load_balancer_class.is_none() && !serving.classless {
        return Request::NotOurs;
    }
    let foreign = !svc.ingress.is_empty() && !ingress_is_ours(svc);
    let adoptable = if foreign {
        ingress_addrs(svc).filter(|addrs| addrs.iter().all(|a| serving.in_pools(*a)))
    } else {
        None
    };
    if foreign && adoptable.is_none() && svc.load_balancer_class.is_none() {
        return Request::NotOurs;
    }
    let request = lb_request(svc, serving.class);
    let (Request::Wanted(spec), Some(addrs)) = (&request, adoptable) else {
        return request;
    };
    if !spec.load_balancer_ips.is_empty() {
        // Asked for by the user: that wins over what the status holds.
        return request;
    }
    let mut adopted = spec.clone();
    let families = spec.families();
    for a in addrs {
        let family = Family::of_addr(a);
        if families.contains(&family) && adopted.requested(family).is_none() {
            adopted.load_balancer_ips.push(a);
        }
    }
    // Listed families first, as the spec's own order.
    adopted
        .load_balancer_ips
        .sort_by_key(|a| families.iter().position(|f| *f == Family::of_addr(*a)));
    if adopted.validate().is_err() {
        return request;
    }
    Request::Wanted(adopted)
}

/// What an agent that is not the elected writer (#44 item 1) holds for
/// `svc`: the writer's decision, read back from the status it wrote — the
/// Service's request with exactly the addresses of its ingress, so the
/// follower's LB state holds what the writer's does and a takeover keeps
/// every address. `None`: the writer has not given it an address (or the
/// Service is not lockstep's), so the follower holds nothing for it.
pub fn follow(svc: &KubeService, serving: &Serving<'_>) -> Option<super::super::ServiceSpec> {
    if !ingress_is_ours(svc) || svc.ingress.is_empty() {
        return None;
    }
    let addrs = ingress_addrs(svc)?;
    let Request::Wanted(spec) = request(svc, serving) else {
        return None;
    };
    let families = spec.families();
    let mut held = spec.clone();
    held.load_balancer_ips = addrs
        .into_iter()
        .filter(|a| families.contains(&Family::of_addr(*a)) && serving.in_pools(*a))
        .collect();
    held.load_balancer_ips
        .sort_by_key(|a| families.iter().position(|f| *f == Family::of_addr(*a)));
    (!held.load_balancer_ips.is_empty() && held.validate().is_ok()).then_some(held)
}

/// A change to a Service's status: what lockstep writes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatusChange {
    /// The new `status.loadBalancer.ingress`; `None` leaves it as it is.
    pub ingress: Option<Vec<IpAddr>>,
    /// Lockstep's condition; `None` removes it.
    pub condition: Option<Condition>,
}

/// What lockstep writes on `svc`'s status to say `want` (`None`: the
/// Service is not, or no longer, lockstep's); nothing when the status
/// already says it. `pools_exist`: some lockstep pool is defined.
pub fn status_change(
    svc: &KubeService,
    want: Option<&ServiceOutcome>,
    pools_exist: bool,
) -> Option<StatusChange> {
    let ours = ingress_is_ours(svc);
    let Some(want) = want else {
        // Lockstep's condition comes off; the ingress with it only when
        // lockstep wrote it.
        svc.condition.as_ref()?;
        return Some(StatusChange {
            ingress: (ours && !svc.ingress.is_empty()).then(Vec::new),
            condition: None,
        });
    };
    if svc.condition.is_none() && !pools_exist {
        return None;
    }
    let ingress = if want.ingress.is_empty() && !svc.ingress.is_empty() && !ours {
        None
    } else {
        Some(want.ingress.clone())
    };
    let same_ingress = ingress
        .as_ref()
        .is_none_or(|i| ingress_addrs(svc).as_ref() == Some(i));
    if svc.condition.as_ref() == Some(&want.condition) && same_ingress {
        return None;
    }
    debug_assert_eq!(want.condition.type_, SERVICE_CONDITION);
    Some(StatusChange {
        ingress,
        condition: Some(want.condition.clone()),
    })
}

#[cfg(test)]
mod tests;
