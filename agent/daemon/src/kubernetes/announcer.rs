//! The elected writer's announcer (#44 item 1): the LB addresses are
//! answered (ARP, NDP) by the writer alone, and never past its Lease's
//! deadline; those of `externalTrafficPolicy: Local` Services (#44 item
//! 3) by the node holding the Service's own Lease instead, never past
//! that Lease's deadline (`local_traffic`).
//!
//! Why a task of its own: it hands the announcements (their own lock, the
//! one cluster mode's LB agent writes through) the LB state's addresses
//! with the deadline as the entries' cap, so the kernel stops answering
//! at the deadline even if this task, the keeper or the whole agent
//! stalls; and it announces (gratuitous ARP, unsolicited NA) each address
//! it starts answering, so neighbours move to this node at once after a
//! takeover. It reads the agent's LB addresses only when they change (the
//! LB backend's `changed`) or this agent became the writer, never on a
//! renewal.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

use super::backend::{Slot, on_agent};
use super::election::Leadership;
use super::local_traffic::LocalAnswers;
use crate::announce::{Announcements, monotonic_ns};

/// The cap given while this agent is not the writer: none (it announces
/// none of the LB addresses then).
const NO_CAP: u64 = u64::MAX / 2;

/// What to answer and until when: the writer's part (while it acts, and
/// once the `Local` Services are known) of `lb` without their addresses, and the `Local` ones this
/// node holds, all capped at the earliest deadline among them (each
/// entry stops at or before its own Lease's).
fn wanted(
    l: Leadership,
    local: &LocalAnswers,
    lb: &BTreeSet<IpAddr>,
    now_ns: u64,
) -> (BTreeSet<IpAddr>, u64) {
    let mut want = BTreeSet::new();
    let mut cap = NO_CAP;
    if l.acting(now_ns) && local.listed {
        want.extend(lb.difference(&local.seated).copied());
        if !want.is_empty() {
            cap = l.until_ns;
        }
    }
    for (a, until) in &local.held {
        if *until > now_ns && lb.contains(a) {
            want.insert(*a);
            cap = cap.min(*until);
        }
    }
    (want, cap)
}

/// Runs until `stop`: the LB addresses of the agent in `slot` announced
/// while `leadership` says this agent acts, and those `local` says it
/// holds; `changed` is notified when the LB state changed. `applied` gets
/// each [`LocalAnswers::version`] once the datapath holds it.
pub async fn run(
    mut leadership: tokio::sync::watch::Receiver<Leadership>,
    mut local: tokio::sync::watch::Receiver<LocalAnswers>,
    applied: tokio::sync::watch::Sender<u64>,
    changed: Arc<Notify>,
    slot: Slot,
    announcements: Announcements,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut seq = 0u64;
    let mut addrs: Option<BTreeSet<IpAddr>> = None;
    let mut answered: BTreeSet<IpAddr> = BTreeSet::new();
    let mut dirty = true;
    loop {
        let l = *leadership.borrow_and_update();
        let here = local.borrow_and_update().clone();
        let now = monotonic_ns();
        let any = l.acting(now) || here.held.values().any(|u| *u > now);
        if !any {
            addrs = None;
        } else if addrs.is_none() || dirty {
            match on_agent(&slot, |a| a.lb_announced()).await {
                Ok(Some(a)) => addrs = Some(a),
                Ok(None) => {}
                Err(e) => tracing::warn!(error = %e, "kubernetes: reading the LB addresses failed"),
            }
        }
        dirty = false;
        let none = BTreeSet::new();
        let (want, cap) = wanted(l, &here, addrs.as_ref().unwrap_or(&none), now);
        seq += 1;
        let announcements_ = announcements.clone();
        let want_ = want.clone();
        let set =
            tokio::task::spawn_blocking(move || announcements_.set_cluster(seq, want_, cap)).await;
        match set {
            Ok(Ok(_)) => {
                applied.send_if_modified(|v| {
                    let newer = here.version > *v;
                    if newer {
                        *v = here.version;
                    }
                    newer
                });
                let fresh: Vec<IpAddr> = want.difference(&answered).copied().collect();
                answered = want;
                if !fresh.is_empty() {
                    let a = announcements.clone();
                    let _ = tokio::task::spawn_blocking(move || {
                        for addr in fresh {
                            a.announce(addr);
                        }
                    })
                    .await;
                }
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %crate::error_chain(&*e.error), "kubernetes: writing the writer's announcements failed");
                answered = e.held.unwrap_or_default();
            }
            Err(e) => tracing::warn!(error = %e, "kubernetes: the announcements task failed"),
        }
        // The next change, or the cap (to stop answering what lapsed).
        let lapse = if cap < NO_CAP {
            Duration::from_nanos(cap.saturating_sub(monotonic_ns()))
        } else {
            Duration::from_secs(3600)
        };
        tokio::select! {
            r = leadership.changed() => if r.is_err() { break },
            r = local.changed() => if r.is_err() {
                local = tokio::sync::watch::channel(LocalAnswers::default()).1;
            },
            () = changed.notified() => dirty = true,
            () = tokio::time::sleep(lapse) => {}
            _ = stop.wait_for(|s| *s) => break,
        }
    }
    // Stopped: nothing of the writer's is answered any more.
    let _ = tokio::task::spawn_blocking(move || {
        announcements.set_cluster(seq + 1, BTreeSet::new(), NO_CAP)
    })
    .await;
}
