//! The node lease's keeper: a task of its own that refreshes the node's
//! etcd lease every third of its TTL, whatever the claim round is doing.
//!
//! It exists because the round (reads, claims, the allocator's pools under
//! the agent) may take seconds when etcd is slow or the agent is busy, and
//! a node key that lapses over that is every other node's change to read
//! and a gone mark. The round still registers the node and publishes its
//! record under the lease; it hands the keeper the lease it holds and the
//! moment it last refreshed it, and takes back the keeper's refreshes, so
//! it refreshes itself only when the keeper fell behind.
//!
//! How late each refresh was sent against its schedule is counted (the
//! metric `cluster_node_lease_renewal_late_max_seconds`): nothing in this
//! task waits for the agent or the round, so lateness here is the
//! runtime's alone.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::super::handle::ClusterHandle;
use super::super::keeping::{self, Waited};
use super::super::{Door, DoorOptions};

/// A lease and the moment it was last refreshed (or granted).
pub(super) type Refreshed = Option<(i64, Instant)>;

/// The round's side of the keeper.
#[derive(Debug)]
pub(super) struct KeeperLink {
    told: watch::Sender<Refreshed>,
    kept: watch::Receiver<Refreshed>,
}

/// The keeper's side, for [`keep`].
#[derive(Debug)]
pub(super) struct KeeperEnds {
    told: watch::Receiver<Refreshed>,
    kept: watch::Sender<Refreshed>,
}

/// A link and the ends its keeper runs with.
pub(super) fn link() -> (KeeperLink, KeeperEnds) {
    let (told, told_rx) = watch::channel(None);
    let (kept_tx, kept) = watch::channel(None);
    (
        KeeperLink { told, kept },
        KeeperEnds {
            told: told_rx,
            kept: kept_tx,
        },
    )
}

impl KeeperLink {
    /// The round's lease with the keeper's later refreshes of it folded in.
    pub(super) fn fold(&self, lease: Refreshed) -> Refreshed {
        fold(lease, *self.kept.borrow())
    }

    /// Tells the keeper the lease the round holds now.
    pub(super) fn tell(&self, lease: Refreshed) {
        self.told.send_if_modified(|v| {
            let changed = *v != lease;
            *v = lease;
            changed
        });
    }
}

/// `lease`, refreshed at the later of its own time and `kept`'s when both
/// name the same lease.
fn fold(lease: Refreshed, kept: Refreshed) -> Refreshed {
    match (lease, kept) {
        (Some((l, at)), Some((k, kat))) if l == k && kat > at => Some((l, kat)),
        (x, _) => x,
    }
}

/// Keeps the lease the round tells alive until `stop`.
pub(super) async fn keep(
    ends: KeeperEnds,
    opts: DoorOptions,
    ttl: Duration,
    handle: Arc<ClusterHandle>,
    mut stop: watch::Receiver<bool>,
) {
    let KeeperEnds { mut told, kept } = ends;
    let every = ttl / 3;
    let mut door: Option<Door> = None;
    let mut retry_at: Option<tokio::time::Instant> = None;
    let mut backoff = keeping::Retries::new();
    loop {
        let Some((lease, at)) = fold(*told.borrow_and_update(), *kept.borrow()) else {
            if !keeping::told(&mut told, &mut stop).await {
                return;
            }
            continue;
        };
        let due = tokio::time::Instant::from_std(at + every);
        match keeping::until(due, retry_at, &mut told, &mut stop).await {
            Waited::Due => {}
            Waited::Told => continue,
            Waited::Stop => return,
        }
        let past_ttl = at.elapsed() >= ttl;
        let Some(d) = keeping::connected(&mut door, &opts).await else {
            retry_at = Some(tokio::time::Instant::now() + backoff.next_delay(past_ttl));
            continue;
        };
        let sent = Instant::now();
        let late = sent.saturating_duration_since(due.into_std());
        match d.keep_alive(lease).await {
            Ok(true) => {
                retry_at = None;
                backoff.reset();
                kept.send_replace(Some((lease, sent)));
                handle.lock().lease_renewed(sent, late);
            }
            // Gone: the round registers again and tells the new lease.
            Ok(false) => {
                retry_at = None;
                tokio::select! {
                    r = told.changed() => if r.is_err() { return },
                    _ = stop.wait_for(|s| *s) => return,
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, lease, "node lease refresh failed; trying again");
                retry_at = Some(tokio::time::Instant::now() + backoff.next_delay(past_ttl));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_later_refresh_of_the_same_lease_is_taken_and_another_leases_is_not() {
        let t = Instant::now();
        let later = t + Duration::from_secs(1);
        assert_eq!(fold(Some((7, t)), Some((7, later))), Some((7, later)));
        assert_eq!(fold(Some((7, later)), Some((7, t))), Some((7, later)));
        assert_eq!(fold(Some((8, t)), Some((7, later))), Some((8, t)));
        assert_eq!(fold(None, Some((7, later))), None);
    }

    #[test]
    fn the_round_tells_the_keeper_only_what_changed() {
        let (link, mut ends) = link();
        let t = Instant::now();
        link.tell(Some((7, t)));
        assert!(ends.told.has_changed().unwrap_or(false));
        let _ = ends.told.borrow_and_update();
        link.tell(Some((7, t)));
        assert!(!ends.told.has_changed().unwrap_or(true));
        ends.kept
            .send_replace(Some((7, t + Duration::from_secs(2))));
        assert_eq!(
            link.fold(Some((7, t))),
            Some((7, t + Duration::from_secs(2)))
        );
    }
}
