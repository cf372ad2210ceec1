//! The LB lease's keeper: a task of its own that refreshes the LB lease
//! every third of its TTL, whatever the LB agent's tick is doing.
//!
//! It exists because the tick carries out one request at a time: a refresh
//! falling due while a take, a read or a withdrawal waits for etcd (up to
//! the request bound, 500 ms) went out only after it. The driver
//! (`lockstep_core::lb::announce::driver`) names the lease to keep
//! ([`Driver::kept_lease`](lockstep_core::lb::announce::driver::Driver::kept_lease));
//! the keeper refreshes it on its own connection's request and hands back
//! each refresh etcd answered, with the moment it was *sent*, which is all
//! the announcer's cap may count from. The driver refreshes itself only
//! when the keeper fell behind (a sixth of the TTL late), and only the
//! driver's own refresh acts on a lease etcd says is gone, in its order.
//!
//! How late each refresh was sent against its schedule is counted (the
//! metric `lockstep_lb_lease_renewal_late_max_seconds`): nothing in this
//! task waits for the tick or the agent, so lateness here is the
//! runtime's alone.

use std::sync::Arc;
use std::time::Duration;

use lockstep_core::lb::announce::Nanos;
use lockstep_core::lb::announce::driver::KeptLease;
use tokio::sync::watch;

use super::keeping::{self, Waited};
use super::lb_handle::LbHandle;
use super::{Door, DoorOptions};
use crate::announce::monotonic_ns;

/// A refresh the keeper had answered: the lease, and when it was sent
/// (the agent's monotonic clock).
pub(super) type Kept = Option<(i64, Nanos)>;

/// The LB agent's side of the keeper.
#[derive(Debug)]
pub(super) struct KeeperLink {
    told: watch::Sender<Option<KeptLease>>,
    kept: watch::Receiver<Kept>,
    /// The refresh last taken ([`KeeperLink::changed`] marks the channel
    /// seen, so what was taken is remembered here).
    taken: Kept,
}

/// The keeper's side, for [`keep`].
#[derive(Debug)]
pub(super) struct KeeperEnds {
    told: watch::Receiver<Option<KeptLease>>,
    kept: watch::Sender<Kept>,
}

/// A link and the ends its keeper runs with.
pub(super) fn link() -> (KeeperLink, KeeperEnds) {
    let (told, told_rx) = watch::channel(None);
    let (kept_tx, kept) = watch::channel(None);
    (
        KeeperLink {
            told,
            kept,
            taken: None,
        },
        KeeperEnds {
            told: told_rx,
            kept: kept_tx,
        },
    )
}

impl KeeperLink {
    /// Tells the keeper the lease to keep now (`None`: none).
    pub(super) fn tell(&self, lease: Option<KeptLease>) {
        self.told.send_if_modified(|v| {
            let changed = *v != lease;
            *v = lease;
            changed
        });
    }

    /// The keeper's latest answered refresh, once: `None` when there is
    /// none new since the last call.
    pub(super) fn take(&mut self) -> Kept {
        let now = *self.kept.borrow_and_update();
        if now == self.taken {
            return None;
        }
        self.taken = now;
        now
    }

    /// Resolves when the keeper has a new answered refresh.
    pub(super) async fn changed(&mut self) {
        if self.kept.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// When `lease` is next due: a third of its TTL after the later of its
/// last refresh the driver knows and the keeper's own.
fn due(lease: KeptLease, kept: Kept) -> Nanos {
    let last = match kept {
        Some((id, sent)) if id == lease.id => sent.max(lease.sent),
        _ => lease.sent,
    };
    last.saturating_add(lease.ttl_ns / 3)
}

/// The tokio instant of `at` on the agent's monotonic clock.
fn instant(at: Nanos) -> tokio::time::Instant {
    tokio::time::Instant::now() + Duration::from_nanos(at.saturating_sub(monotonic_ns()))
}

/// Keeps the lease the LB agent names alive until `stop`, reaching etcd
/// with `opts` (its own requests on the agent's connection).
pub(super) async fn keep(
    ends: KeeperEnds,
    opts: DoorOptions,
    handle: Arc<LbHandle>,
    mut stop: watch::Receiver<bool>,
) {
    let KeeperEnds { mut told, kept } = ends;
    let mut door: Option<Door> = None;
    let mut retry_at: Option<tokio::time::Instant> = None;
    let mut backoff = keeping::Retries::new();
    loop {
        let Some(lease) = *told.borrow_and_update() else {
            if !keeping::told(&mut told, &mut stop).await {
                return;
            }
            continue;
        };
        let due_ns = due(lease, *kept.borrow());
        match keeping::until(instant(due_ns), retry_at, &mut told, &mut stop).await {
            Waited::Due => {}
            Waited::Told => continue,
            Waited::Stop => return,
        }
        // The last answered refresh was a third of the TTL before due.
        let past_ttl = monotonic_ns() >= due_ns.saturating_add(lease.ttl_ns * 2 / 3);
        let Some(d) = keeping::connected(&mut door, &opts).await else {
            retry_at = Some(tokio::time::Instant::now() + backoff.next_delay(past_ttl));
            continue;
        };
        let sent = monotonic_ns();
        let late = Duration::from_nanos(sent.saturating_sub(due_ns));
        match d.keep_alive(lease.id).await {
            Ok(true) => {
                retry_at = None;
                backoff.reset();
                kept.send_replace(Some((lease.id, sent)));
                let mut s = handle.lock();
                s.lease_renewals += 1;
                s.lease_late_max = s.lease_late_max.max(late);
            }
            // Gone: the driver's own refresh finds out and grants another.
            Ok(false) => {
                retry_at = Some(tokio::time::Instant::now() + backoff.next_delay(past_ttl));
            }
            Err(e) => {
                tracing::debug!(error = %e, lease = lease.id, "lb lease refresh failed; trying again");
                retry_at = Some(tokio::time::Instant::now() + backoff.next_delay(past_ttl));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Nanos = 1_000_000_000;

    #[test]
    fn due_a_third_of_the_ttl_after_the_later_refresh_of_the_same_lease() {
        let lease = KeptLease {
            id: 7,
            ttl_ns: 3 * S,
            sent: S,
        };
        assert_eq!(due(lease, None), 2 * S);
        assert_eq!(due(lease, Some((7, 2 * S))), 3 * S);
        assert_eq!(due(lease, Some((7, S / 2))), 2 * S, "an older one");
        assert_eq!(due(lease, Some((8, 5 * S))), 2 * S, "another lease's");
    }

    #[test]
    fn the_agent_takes_each_answered_refresh_once_and_tells_only_changes() {
        let (mut link, mut ends) = link();
        let lease = KeptLease {
            id: 7,
            ttl_ns: 3 * S,
            sent: 0,
        };
        link.tell(Some(lease));
        assert!(ends.told.has_changed().unwrap_or(false));
        let _ = ends.told.borrow_and_update();
        link.tell(Some(lease));
        assert!(!ends.told.has_changed().unwrap_or(true));
        assert_eq!(link.take(), None);
        ends.kept.send_replace(Some((7, S)));
        assert_eq!(link.take(), Some((7, S)));
        assert_eq!(link.take(), None, "taken once");
        // Woken by the change first (which marks it seen): still taken.
        ends.kept.send_replace(Some((7, 2 * S)));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(link.changed());
        assert_eq!(link.take(), Some((7, 2 * S)));
    }
}
