//! One seat's Lease kept by a task of its own (#46 item 3): a seat is the
//! election of one `externalTrafficPolicy: Local` Service, or of one pool
//! with a node selector (`local_traffic`).
//!
//! Why a task per seat: the elections are derived from every Service,
//! EndpointSlice and pool, again whenever one changes. If the Leases were
//! renewed in that same round, a burst of changes (or one Lease's API
//! request hanging until its deadline) would hold up every other Lease's
//! renewal, and a holder could lose its Lease while it still answers.
//! Here each Lease has a keeper that only reads and writes its own
//! record on its own clock; the deriving task only tells it whether this
//! node stands and for which addresses ([`Want`]), and reads until when it
//! holds ([`Held`]).
//!
//! Stepping aside stays as safe as the writer's: a keeper that stops
//! standing while it holds stops acting at once, and releases the Lease
//! early only once the announcer has written a version of
//! [`LocalAnswers`] that answers none of its addresses (otherwise after
//! its deadline).

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use lockstep_core::election::Elector;
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;

use super::election::{LeaseDoor, now_ms};
use super::local_answers::LocalAnswers;

/// What the deriving task asks of a seat's keeper.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Want {
    /// This node stands for the seat (it has a local endpoint, or its
    /// labels are admitted).
    pub here: bool,
    /// The addresses the seat answers.
    pub addrs: Vec<IpAddr>,
}

/// What a seat's keeper publishes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Held {
    /// Until when (local ms) this node may answer the seat's addresses.
    pub until_ms: Option<u64>,
    /// The keeper has ended: this node neither stands for nor holds the
    /// seat, and the Lease names another node or none.
    pub ended: bool,
}

/// The channels a keeper reads besides its own.
pub(super) struct Links {
    /// What this node answers, as the deriving task publishes it.
    pub answers: watch::Receiver<LocalAnswers>,
    /// The last [`LocalAnswers::version`] the announcer wrote into the
    /// datapath.
    pub applied: watch::Receiver<u64>,
    /// Woken whenever a keeper publishes.
    pub changed: Arc<Notify>,
    /// The agent is stopping: release and end.
    pub stop: watch::Receiver<bool>,
}

/// A running keeper, as the deriving task holds it.
pub(super) struct Seat {
    want: watch::Sender<Want>,
    held: watch::Receiver<Held>,
    task: JoinHandle<()>,
    lease: String,
}

impl Seat {
    /// Starts the keeper of `door`'s Lease for `elector`, rounds every
    /// `retry`, standing as `want` says.
    pub(super) fn start(
        door: LeaseDoor,
        elector: Elector,
        retry: Duration,
        want: Want,
        links: Links,
    ) -> Self {
        let lease = door.name().to_owned();
        let (want_tx, want_rx) = watch::channel(want);
        let (held_tx, held) = watch::channel(Held::default());
        let keeper = Keeper {
            door,
            elector,
            retry,
            want: want_rx,
            held: held_tx,
            links,
            stepping: false,
        };
        Self {
            want: want_tx,
            held,
            task: tokio::spawn(keeper.run()),
            lease,
        }
    }

    /// Asks the keeper to stand (or not) for `want`'s addresses.
    pub(super) fn ask(&self, want: Want) {
        self.want.send_if_modified(|cur| {
            let changed = *cur != want;
            *cur = want;
            changed
        });
    }

    /// What the keeper published last.
    pub(super) fn held(&self) -> Held {
        self.held.borrow().clone()
    }

    /// What the keeper was last asked.
    pub(super) fn wanted(&self) -> Want {
        self.want.borrow().clone()
    }

    /// Whether the keeper is gone: it ended, or it panicked (logged here,
    /// so the panic never vanishes; the deriving task starts a new one if
    /// this node still stands).
    pub(super) fn gone(&mut self) -> bool {
        if self.held.borrow().ended {
            return true;
        }
        match (&mut self.task).now_or_never() {
            None => false,
            Some(Ok(())) => true,
            Some(Err(e)) => {
                tracing::error!(lease = %self.lease, error = %e, "kubernetes: a Lease keeper panicked; it is started again if this node still stands");
                true
            }
        }
    }

    /// Waits for the keeper to end (after the agent's stop: it releases
    /// what it holds first).
    pub(super) async fn join(self) {
        if let Err(e) = self.task.await {
            tracing::error!(lease = %self.lease, error = %e, "kubernetes: a Lease keeper panicked while stopping");
        }
    }
}

/// The keeper task's state.
struct Keeper {
    door: LeaseDoor,
    elector: Elector,
    retry: Duration,
    want: watch::Receiver<Want>,
    held: watch::Sender<Held>,
    links: Links,
    /// It stepped aside while holding, and has not released early yet.
    stepping: bool,
}

impl Keeper {
    fn publish(&self, ended: bool) {
        let now = Held {
            until_ms: self.elector.holds(now_ms()),
            ended,
        };
        let changed = self.held.send_if_modified(|cur| {
            let changed = *cur != now;
            *cur = now;
            changed
        });
        if changed {
            self.links.changed.notify_one();
        }
    }

    /// Whether the datapath answers none of this seat's addresses any
    /// more, after stepping aside: what this node answers now (the
    /// deriving task leaves out a seat it no longer stands for, and this
    /// keeper acts no more) leaves them all out, and the announcer has
    /// written that version.
    fn dropped_by_datapath(&self) -> bool {
        if !self.stepping {
            return false;
        }
        let a = self.links.answers.borrow();
        let addrs = &self.want.borrow().addrs;
        addrs.iter().all(|x| !a.held.contains_key(x)) && *self.links.applied.borrow() >= a.version
    }

    async fn run(mut self) {
        let me = self.elector.me().to_owned();
        // A round is due at once, then every `retry`, on a change of what
        // is wanted, and when an early release becomes possible.
        let mut due = true;
        loop {
            let want = self.want.borrow_and_update().clone();
            let now = now_ms();
            let held = self.elector.holds(now).is_some();
            self.elector.set_candidate(want.here, now);
            if want.here {
                self.stepping = false;
            } else if held {
                self.stepping = true;
            }
            // Stepping aside shows before the round's requests.
            self.publish(false);
            if self.dropped_by_datapath() {
                self.elector.stopped();
                self.stepping = false;
                due = true;
            }
            if due {
                let holder = self.door.round(&mut self.elector).await;
                self.publish(false);
                // Neither standing nor holding, and the Lease names
                // another node or none (the release written, or never
                // held): this keeper's work is done.
                let done = !self.elector.is_candidate()
                    && self.elector.holds(now_ms()).is_none()
                    && holder.is_some_and(|h| h != me);
                if done && !self.want.borrow().here {
                    self.publish(true);
                    return;
                }
            }
            // Wake at the next round, or when holding lapses (to say so).
            let lapse = self.elector.holds(now_ms()).map_or(self.retry, |u| {
                Duration::from_millis(u.saturating_sub(now_ms()))
            });
            let stepping = self.stepping;
            let round = tokio::time::sleep(self.retry.min(lapse));
            due = tokio::select! {
                () = round => true,
                r = self.want.changed() => {
                    if r.is_err() {
                        // The deriving task is gone: stop as at the agent's stop.
                        break;
                    }
                    true
                }
                r = self.links.answers.changed(), if stepping => {
                    if r.is_err() {
                        self.links.answers = watch::channel(LocalAnswers::default()).1;
                    }
                    false
                }
                r = self.links.applied.changed(), if stepping => {
                    if r.is_err() {
                        self.links.applied = watch::channel(0).1;
                    }
                    false
                }
                _ = self.links.stop.wait_for(|s| *s) => break,
            };
        }
        // Acting stops now (published before the release waits); the
        // release is written once the deadline has passed, so no other
        // node answers before the datapath here stops.
        let until = self.elector.holds(now_ms());
        let release = self.elector.release();
        self.publish(false);
        self.door.release(until, release).await;
        self.publish(true);
    }
}

#[cfg(test)]
mod tests;
