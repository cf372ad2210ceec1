//! The timing and wake-ups the cluster-mode LB loops share: the announcer's
//! tick (`lb_agent`), the assigner's rounds (`lb_assigner`) and the handle's
//! waits (`lb_handle`).
//!
//! It exists so those three depend on one leaf rather than on each other:
//! each loop's pace is set here, in one place, and none of them imports
//! another to learn it.

use std::time::{Duration, Instant};

use super::lb::LbWake;
use super::{Door, DoorOptions, Stamp};

/// How often the agent looks at its lease, the plan and etcd.
pub const TICK: Duration = Duration::from_millis(200);
/// How often an assigner round runs when nothing was stored last time
/// and no service is pending.
pub const ROUND_EVERY: Duration = Duration::from_millis(500);
/// How often a round runs when nothing under `lb/` changed in the
/// mirror (it reads nothing from etcd then).
pub const IDLE_ROUND: Duration = Duration::from_secs(5);
/// The first delay before etcd is asked again after it left a request of
/// the announcer or the assigner unanswered (each next one doubled up to
/// [`RETRY_MAX`], stretched by a random fraction of itself: #47 item 3):
/// a lost reply costs a tick or two.
pub const RETRY_MIN: Duration = TICK;
/// The longest base delay of those retries: a silent etcd is not asked
/// by every node at every tick, and one that answers again is asked
/// within 4 s.
pub const RETRY_MAX: Duration = Duration::from_secs(2);
/// The shortest LB lease etcd grants with its default timing (it raises
/// shorter ones to this).
pub const MIN_LEASE: Duration = Duration::from_secs(2);
/// The next message of the wake-up watch: whether one came (`false`: the
/// stream broke or ended). Never ready without a watch.
pub(super) async fn changed(wake: &mut Option<LbWake>) -> bool {
    match wake {
        Some(w) => w.changed().await,
        None => std::future::pending().await,
    }
}

/// An LB loop's wake-up when anything under `lb/` changes: opened once
/// connected, and again after it broke.
#[derive(Default)]
pub(super) struct Wake {
    wake: Option<LbWake>,
    /// When opening it was last tried (at most once a second, so an etcd
    /// that does not answer slows no loop).
    tried: Option<Instant>,
}

impl Wake {
    /// Opens the wake-up through `door` if there is none (bounded by a
    /// tick: a slow etcd never delays the loop for a wake-up).
    pub(super) async fn open(&mut self, door: Option<&mut Door>) {
        if self.wake.is_some()
            || self
                .tried
                .is_some_and(|t| t.elapsed() < Duration::from_secs(1))
        {
            return;
        }
        let Some(door) = door else { return };
        self.tried = Some(Instant::now());
        self.wake = tokio::time::timeout(TICK, door.lb_watch())
            .await
            .ok()
            .and_then(Result::ok);
    }

    /// Returns when something under `lb/` changed, or the wake-up broke
    /// (opened again by [`Wake::open`]); never without one.
    pub(super) async fn changed(&mut self) {
        if !changed(&mut self.wake).await {
            self.wake = None;
        }
    }
}

/// Where `lb/` stands in the mirror of `opts`'s link while it is live
/// (`None`: no mirror, or one not live: then everything is read).
pub(super) fn mirror_stamp(opts: &DoorOptions) -> Option<Stamp> {
    opts.link
        .as_ref()
        .map(|l| l.mirror().stamp(&["lb/"]))
        .filter(|s| s.live)
}
