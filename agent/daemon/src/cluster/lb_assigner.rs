//! The LB assigner of cluster mode (#13): every node's LB agent runs one
//! beside its announcer (`lb_agent`), under the same LB lease. It campaigns
//! when no node leads and, while this node leads, brings the stored state
//! to the stored pools and services ([`Door::lb_round`], every write fenced
//! by the election and created-if-absent for each new address: one writer,
//! no address twice, assignments kept).
//!
//! Why a loop of its own rather than a step after the announcer's in each
//! tick: the announcer's takes of newly assigned addresses (an etcd
//! transaction and a datapath write each) took 130-270 ms a tick in a
//! burst of Kubernetes Services (#28's bench, load ~4), and a round waited
//! them out, so every new service waited a tick of takes of the previous
//! ones before it was assigned. A round and a take are transactions fenced
//! on keys of their own; nothing needs one after the other.
//!
//! A round runs at once when anything under `lb/` changes (the mirror's
//! bell, or a watch of its own without a mirror) while this node is the
//! assigner and services are pending, and at once again while it stores;
//! otherwise at most every [`ROUND_EVERY`], skipped while `lb/` stands
//! where it stood when a round left nothing to do (#27 item 6; one every
//! [`IDLE_ROUND`] all the same): a follower campaigns only when the
//! assigner key is gone, and the assigner stores only what changed, both
//! under `lb/`. A round that failed (etcd unavailable, or cut short) is
//! tried again after a jittered, growing delay (#47 item 3), not at every
//! period.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::backoff::Backoff;
use super::lb_handle::LbHandle;
use super::lb_timing::{IDLE_ROUND, RETRY_MAX, ROUND_EVERY, Wake, mirror_stamp};
use super::{ClusterStoreError, Door, LbView, Round, Stamp};

/// The assigner of one node.
pub(super) struct Assigner {
    name: String,
    /// A round is cut short at a quarter of the LB lease's TTL.
    ttl: Duration,
    door: Option<Door>,
    /// When the last round ended (`None`: one is due at once).
    last_round: Option<Instant>,
    /// The last round refused the stored definitions: rounds keep their
    /// pace even with services pending.
    refused: bool,
    /// Where `lb/` stood in the mirror when the last round that left
    /// nothing to do began, and when (#27 item 6: a round over an
    /// unchanged mirror is skipped, so an idle agent costs etcd nothing).
    acted: Option<(Stamp, Instant)>,
    wake: Wake,
    /// Whether the last round failed (etcd unavailable, a lease gone
    /// meanwhile): logged when that begins and ends, not every round.
    failing: bool,
    /// The delays of the retries while rounds fail.
    retries: Backoff,
    handle: Arc<LbHandle>,
}

/// Whether services are stored that the state does not have, or the
/// state has services no longer stored.
fn has_pending(view: &LbView) -> bool {
    let in_state: BTreeSet<String> = view
        .state
        .as_ref()
        .map(|(s, _)| s.services.iter().map(|r| r.spec.id()).collect())
        .unwrap_or_default();
    in_state.len() != view.services.len() || view.services.keys().any(|id| !in_state.contains(id))
}

impl Assigner {
    /// The assigner of node `name`, whose LB lease has `ttl`; it shows
    /// what it finds through `handle`.
    pub(super) fn new(name: String, ttl: Duration, handle: Arc<LbHandle>) -> Self {
        Assigner {
            name,
            ttl,
            door: None,
            last_round: None,
            refused: false,
            acted: None,
            wake: Wake::default(),
            failing: false,
            retries: Backoff::new(ROUND_EVERY, RETRY_MAX),
            handle,
        }
    }

    /// Runs rounds under the lease `lease` holds (none while it holds
    /// none) until `stop`, or until the announcer that publishes `lease`
    /// is gone.
    pub(super) async fn run(
        mut self,
        mut lease: watch::Receiver<Option<i64>>,
        mut stop: watch::Receiver<bool>,
    ) {
        loop {
            let held = *lease.borrow_and_update();
            if let Some(held) = held
                && self.step(held).await
            {
                continue;
            }
            self.wake.open(self.door.as_mut()).await;
            // A round is due again after ROUND_EVERY, or after the next
            // retry's delay while rounds fail; a change under `lb/` or a
            // new lease is looked at at once.
            let pause = if self.failing {
                self.retries.next_delay()
            } else {
                self.retries.reset();
                ROUND_EVERY
            };
            tokio::select! {
                () = tokio::time::sleep(pause) => {}
                () = self.wake.changed() => {}
                gone = lease.changed() => if gone.is_err() { break },
                _ = stop.wait_for(|s| *s) => break,
            }
        }
    }

    /// A round if one is due; whether another should follow at once.
    async fn step(&mut self, lease: i64) -> bool {
        if self.door.is_none() {
            match Door::connect(self.handle.options().clone()).await {
                Ok(d) => self.door = Some(d),
                Err(e) => {
                    self.report(Some(&e));
                    return false;
                }
            }
        }
        let stamp = mirror_stamp(self.handle.options());
        match self.round(lease, stamp).await {
            Ok(again) => {
                self.report(None);
                again
            }
            Err(e) => {
                self.report(Some(&e));
                false
            }
        }
    }

    fn report(&mut self, e: Option<&ClusterStoreError>) {
        match e {
            Some(e) if !self.failing => {
                tracing::warn!(error = %crate::error_chain(e), "lb assigner: round failed; trying again");
            }
            None if self.failing => tracing::info!("lb assigner: rounds succeed again"),
            _ => {}
        }
        self.failing = e.is_some();
    }

    /// Whether this node is the assigner and services are pending for it
    /// (read from the mirror while it is live).
    async fn pending(&mut self) -> Result<bool, ClusterStoreError> {
        if self.refused || !self.handle.is_assigner() {
            return Ok(false);
        }
        let door = self.door.as_mut().expect("connected");
        Ok(has_pending(&*door.lb_read().await?))
    }

    /// The assigner round when due (at once while services are pending);
    /// returns whether another should follow at once.
    async fn round(&mut self, lease: i64, stamp: Option<Stamp>) -> Result<bool, ClusterStoreError> {
        let due = self.last_round.is_none_or(|t| t.elapsed() >= ROUND_EVERY);
        let unchanged = matches!(
            (stamp, self.acted),
            (Some(now), Some((then, at))) if now == then && at.elapsed() < IDLE_ROUND
        );
        if (unchanged || !due) && !self.pending().await? {
            return Ok(false);
        }
        self.acted = None;
        let door = self.door.as_mut().expect("connected");
        // Bounded, so a slow etcd (or a mirror catching up) never holds a
        // new lease or a stop back: every step of a round is a fenced
        // transaction read back by the next, so one cut short is finished
        // by the next round.
        let bound = self.ttl / 4;
        let Ok(round) = tokio::time::timeout(bound, door.lb_round(&self.name, lease)).await else {
            return Err(ClusterStoreError::Unavailable {
                endpoints: self.handle.options().endpoints.join(","),
                what: format!("an lb round: cut short after {bound:?}"),
                maybe_written: true,
            });
        };
        let at = door.written();
        self.last_round = Some(Instant::now());
        self.refused = matches!(round, Err(ClusterStoreError::Invalid(_)));
        let idle = stamp.map(|s| (s, Instant::now()));
        match round {
            Ok(Round::Stored { added, removed }) => {
                tracing::info!(added, removed, "lb state stored");
                self.handle.set_assigner(true);
                self.handle.note_stored(at);
                self.last_round = None;
                Ok(true)
            }
            Ok(Round::Idle) => {
                self.handle.set_assigner(true);
                self.acted = idle;
                Ok(false)
            }
            Ok(Round::Lost) => {
                self.last_round = None;
                Ok(false)
            }
            Ok(Round::Follower { .. }) => {
                self.handle.set_assigner(false);
                self.acted = idle;
                Ok(false)
            }
            // A refused definition is named; announcing goes on.
            Err(ClusterStoreError::Invalid(why)) => {
                tracing::error!(reason = %why, "lb assigner: the stored pools and services are refused");
                self.acted = idle;
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }
}
