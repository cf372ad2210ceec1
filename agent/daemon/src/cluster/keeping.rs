//! What the two lease keepers share (the node lease's, `node/keeper.rs`,
//! and the LB lease's, `lb_keeper.rs`): waiting for a refresh's time, a
//! new lease to keep or the stop, and a connection of their own to etcd,
//! made when needed. Each keeper decides what is due and what a refresh
//! tells; the waiting is the same.

use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::backoff::Backoff;
use super::{Door, DoorOptions};

/// How soon a refresh etcd did not answer is tried again while the lease
/// may still live: the first retry, and the longest base delay (jittered,
/// a retry comes within 500 ms).
const RETRY_MIN: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_millis(250);
/// The same once the lease's TTL has passed since its last answered
/// refresh.
const LATE_MIN: Duration = Duration::from_secs(1);
const LATE_MAX: Duration = Duration::from_secs(8);

/// The delays of a keeper's retries of a refresh (#47 item 3): quick while
/// the lease may still live, since a refresh lost must be tried again
/// before it runs out; slower once its TTL has passed since the last
/// answered refresh. etcd keeps a lease past its TTL only across a leader
/// change (which renews every lease), so asking a silent etcd four times
/// a second then saves nothing, and thousands of nodes asking so load it
/// the moment it answers again. Each phase is jittered and grows; an
/// answer resets both.
#[derive(Debug)]
pub(super) struct Retries {
    quick: Backoff,
    late: Backoff,
}

impl Retries {
    pub(super) fn new() -> Self {
        Self {
            quick: Backoff::new(RETRY_MIN, RETRY_MAX),
            late: Backoff::new(LATE_MIN, LATE_MAX),
        }
    }

    /// The delay before the next try; `past_ttl`: the lease's TTL has
    /// passed since its last answered refresh.
    pub(super) fn next_delay(&mut self, past_ttl: bool) -> Duration {
        if past_ttl {
            self.late.next_delay()
        } else {
            self.quick.next_delay()
        }
    }

    /// An answer came.
    pub(super) fn reset(&mut self) {
        self.quick.reset();
        self.late.reset();
    }
}

/// What a keeper's wait ended with.
pub(super) enum Waited {
    /// The refresh is due.
    Due,
    /// The lease to keep changed.
    Told,
    /// Stop (or nobody tells any more).
    Stop,
}

/// Waits until `due` (or `retry_at`, when later), a change of `told`, or
/// the stop.
pub(super) async fn until<T>(
    due: Instant,
    retry_at: Option<Instant>,
    told: &mut watch::Receiver<T>,
    stop: &mut watch::Receiver<bool>,
) -> Waited {
    let wake = retry_at.map_or(due, |r| r.max(due));
    tokio::select! {
        () = tokio::time::sleep_until(wake) => Waited::Due,
        r = told.changed() => if r.is_err() { Waited::Stop } else { Waited::Told },
        _ = stop.wait_for(|s| *s) => Waited::Stop,
    }
}

/// Waits for a change of `told`; false on the stop (or when nobody tells
/// any more).
pub(super) async fn told<T>(
    told: &mut watch::Receiver<T>,
    stop: &mut watch::Receiver<bool>,
) -> bool {
    tokio::select! {
        r = told.changed() => r.is_ok(),
        _ = stop.wait_for(|s| *s) => false,
    }
}

/// The keeper's connection, made if there is none; `None` while etcd
/// cannot be reached (the keeper tries again later).
pub(super) async fn connected<'a>(
    door: &'a mut Option<Door>,
    opts: &DoorOptions,
) -> Option<&'a mut Door> {
    if door.is_none() {
        *door = Door::connect(opts.clone()).await.ok();
    }
    door.as_mut()
}
