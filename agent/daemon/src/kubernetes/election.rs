//! The one-writer election's door (#44 item 1): keeps the
//! `coordination.k8s.io/v1` Lease of `[kubernetes.election]` and tells the
//! rest of the agent whether it is the writer, and until when.
//!
//! Why: without `[cluster]` every agent runs the LoadBalancer loop, and
//! without an election each would assign, write Service status and answer
//! ARP for every address (three nodes answering for one address, status
//! PATCHes racing to 409). The elected agent does all of that; the others
//! mirror its decisions from the Services' status, so a takeover keeps
//! every address (`sync::follow`).
//!
//! The decisions are the core's [`Elector`]; this module reads and writes
//! the Lease with the kernel's monotonic clock, and publishes
//! [`Leadership`] on a watch channel. The keeper is its own task and takes
//! no lock, so nothing in the agent delays a renewal. The datapath never
//! answers for the writer's addresses past [`Leadership::until_ns`]
//! (`announcer`), whatever this task does meanwhile.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::Client;
use kube::api::Api;
use lockstep_core::election::{Elector, Observed, Step, Write};

use super::KubeError;
use crate::announce::monotonic_ns;
use crate::config::ElectionConfig;

/// Whether this agent is the writer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Leadership {
    /// It holds the Lease.
    pub writer: bool,
    /// Kernel monotonic ns up to which it may act (0 when not the writer).
    pub until_ns: u64,
}

impl Leadership {
    /// Whether it may act as the writer at `now_ns` (kernel monotonic).
    #[must_use]
    pub fn acting(&self, now_ns: u64) -> bool {
        self.writer && now_ns < self.until_ns
    }

    /// Whether it may act now.
    #[must_use]
    pub fn acting_now(&self) -> bool {
        self.acting(monotonic_ns())
    }
}

/// The keeper's outputs: its state, and a counter that moves when the
/// agent becomes or stops being the writer.
#[derive(Clone, Debug)]
pub struct Election {
    /// The latest state (each renewal publishes a new deadline).
    pub leadership: tokio::sync::watch::Receiver<Leadership>,
    /// Changes of `writer`, counted.
    pub terms: tokio::sync::watch::Receiver<i64>,
}

/// One Lease's reads and writes for an [`Elector`]: the writer's Lease
/// (the [`Keeper`]) and each `externalTrafficPolicy: Local` Service's
/// (`local_traffic`).
pub(super) struct LeaseDoor {
    api: Api<Lease>,
    name: String,
    duration_s: i32,
    deadline: Duration,
}

/// The core's elector for node `node` under `config`'s timing.
///
/// # Errors
/// The configuration does not make a safe election.
pub(super) fn elector(config: &ElectionConfig, node: &str) -> Result<Elector, KubeError> {
    let duration_ms = u64::try_from(config.lease_duration.as_millis()).unwrap_or(u64::MAX);
    let deadline_ms = u64::try_from(config.renew_deadline.as_millis()).unwrap_or(u64::MAX);
    Elector::new(node, duration_ms, deadline_ms).map_err(|e| KubeError::Refused {
        reason: e.to_string(),
    })
}

impl LeaseDoor {
    /// The Lease `name` in `config`'s namespace, written with its timing.
    pub(super) fn new(client: Client, config: &ElectionConfig, name: &str) -> Self {
        Self {
            api: Api::namespaced(client, &config.namespace),
            name: name.to_owned(),
            duration_s: i32::try_from(config.lease_duration.as_secs()).unwrap_or(i32::MAX),
            deadline: config.renew_deadline,
        }
    }

    /// The Lease's name.
    pub(super) fn name(&self) -> &str {
        &self.name
    }

    /// The Lease to write for `w`, from `read` (what was read, if any).
    fn record(&self, w: &Write, read: Option<Lease>) -> Lease {
        let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
        let mut l = read.unwrap_or_else(|| Lease {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                ..ObjectMeta::default()
            },
            spec: None,
        });
        l.metadata.resource_version.clone_from(&w.version);
        let spec = l.spec.get_or_insert_with(LeaseSpec::default);
        spec.holder_identity.clone_from(&w.holder);
        spec.lease_duration_seconds = Some(self.duration_s);
        spec.lease_transitions = Some(w.transitions);
        if w.holder.is_some() {
            spec.renew_time = Some(now.clone());
        }
        if w.acquire {
            spec.acquire_time = Some(now);
        }
        l
    }

    /// Sends `w`; the record's new version if the API took it. Bounded by
    /// the renew deadline: an answer later than that is of no use to the
    /// holder.
    pub(super) async fn send(&self, w: &Write, read: Option<Lease>) -> Option<String> {
        let record = self.record(w, read);
        let pp = super::post_params();
        let sent = async {
            if w.version.is_none() {
                self.api.create(&pp, &record).await
            } else {
                self.api.replace(&self.name, &pp, &record).await
            }
        };
        match tokio::time::timeout(self.deadline, sent).await {
            Ok(Ok(l)) => Some(l.metadata.resource_version.unwrap_or_default()),
            // Another agent wrote first: it holds, or will.
            Ok(Err(kube::Error::Api(s))) if s.code == 409 => None,
            Ok(Err(e)) => {
                tracing::warn!(lease = %self.name, error = %crate::error_chain(&e), "kubernetes: writing a Lease failed");
                None
            }
            Err(_) => {
                tracing::warn!(lease = %self.name, "kubernetes: writing a Lease took past the renew deadline");
                None
            }
        }
    }

    /// One round for `elector`: read, decide, write. Returns the holder
    /// the record names afterwards (`""`: none), `None` when unknown.
    pub(super) async fn round(&self, elector: &mut Elector) -> Option<String> {
        let read = tokio::time::timeout(self.deadline, self.api.get_opt(&self.name)).await;
        let lease = match read {
            Ok(Ok(l)) => l,
            Ok(Err(e)) => {
                tracing::warn!(lease = %self.name, error = %crate::error_chain(&e), "kubernetes: reading a Lease failed");
                return None;
            }
            Err(_) => {
                tracing::warn!(lease = %self.name, "kubernetes: reading a Lease timed out");
                return None;
            }
        };
        // The answer's arrival: later than the record's write, so expiry
        // counted from here is never early; and no earlier than the write
        // below is sent, so the holder's deadline is never late.
        match elector.observe(lease.as_ref().map(observed), now_ms()) {
            Step::Write(w) => match self.send(&w, lease).await {
                Some(version) => {
                    elector.written(&version);
                    Some(w.holder.unwrap_or_default())
                }
                None => {
                    elector.failed();
                    None
                }
            },
            Step::Follow { holder } => Some(holder),
        }
    }

    /// Sends the release `w` (the elector's, taken when it stopped acting
    /// while it held until `until`, local ms) once that deadline has
    /// passed (the datapath stops answering then), so another agent takes
    /// over at once and never answers before then.
    pub(super) async fn release(&self, until: Option<u64>, w: Option<Write>) {
        let Some(w) = w else {
            return;
        };
        if let Some(u) = until {
            tokio::time::sleep(Duration::from_millis(u.saturating_sub(now_ms()))).await;
        }
        if self.send(&w, None).await.is_some() {
            tracing::info!(lease = %self.name, "kubernetes: Lease released");
        }
    }
}

/// Keeps the Lease.
pub struct Keeper {
    door: LeaseDoor,
    elector: Elector,
    retry: Duration,
    leadership: tokio::sync::watch::Sender<Leadership>,
    terms: tokio::sync::watch::Sender<i64>,
}

pub(super) fn now_ms() -> u64 {
    monotonic_ns() / 1_000_000
}

fn observed(l: &Lease) -> Observed {
    Observed {
        holder: l.spec.as_ref().and_then(|s| s.holder_identity.clone()),
        version: l.metadata.resource_version.clone().unwrap_or_default(),
        duration_ms: l
            .spec
            .as_ref()
            .and_then(|s| s.lease_duration_seconds)
            .map_or(0, |s| u64::try_from(s).unwrap_or(0) * 1000),
        transitions: l
            .spec
            .as_ref()
            .and_then(|s| s.lease_transitions)
            .unwrap_or(0),
    }
}

impl Keeper {
    /// Node `node`'s keeper of the Lease `config` names.
    ///
    /// # Errors
    /// The configuration does not make a safe election.
    pub fn new(
        client: Client,
        config: &ElectionConfig,
        node: &str,
    ) -> Result<(Self, Election), KubeError> {
        let elector = elector(config, node)?;
        let (leadership, rx) = tokio::sync::watch::channel(Leadership::default());
        let (terms, terms_rx) = tokio::sync::watch::channel(0);
        Ok((
            Self {
                door: LeaseDoor::new(client, config, &config.name),
                elector,
                retry: config.retry_period,
                leadership,
                terms,
            },
            Election {
                leadership: rx,
                terms: terms_rx,
            },
        ))
    }

    fn publish(&self) {
        let until = self.elector.holds(now_ms());
        let now = Leadership {
            writer: until.is_some(),
            until_ns: until.map_or(0, |u| u.saturating_mul(1_000_000)),
        };
        let was = *self.leadership.borrow();
        if was.writer != now.writer {
            let lease = self.door.name();
            if now.writer {
                tracing::info!(%lease, "kubernetes: this agent is now the LB writer");
            } else {
                tracing::info!(%lease, "kubernetes: this agent is no longer the LB writer");
            }
            self.terms.send_modify(|t| *t += 1);
        }
        self.leadership.send_replace(now);
    }

    /// Runs until `stop`, then releases the Lease if held (after this
    /// agent stopped acting), so another agent takes over at once. While
    /// `candidacy` says no (why), this agent never takes the Lease, and
    /// steps aside if it holds it (`candidacy`).
    pub async fn run(
        mut self,
        mut candidacy: tokio::sync::watch::Receiver<Result<(), String>>,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) {
        loop {
            let may = candidacy.borrow_and_update().is_ok();
            let was = self.elector.holds(now_ms()).is_some();
            self.elector.set_candidate(may, now_ms());
            // Stepping aside shows at once, before the round's requests.
            if was && self.elector.holds(now_ms()).is_none() {
                self.publish();
            }
            self.door.round(&mut self.elector).await;
            self.publish();
            // Wake at the next round, or when holding lapses (to say so).
            let lapse = self.elector.holds(now_ms()).map_or(self.retry, |u| {
                Duration::from_millis(u.saturating_sub(now_ms()))
            });
            let wait = self.retry.min(lapse);
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                r = candidacy.changed() => if r.is_err() {
                    // Its sender gone: candidacy stays as last said.
                    candidacy = tokio::sync::watch::channel(Ok(())).1;
                },
                _ = stop.wait_for(|s| *s) => break,
            }
        }
        // Acting stops now (published before the release waits); the
        // datapath stops answering for the writer's addresses at the last
        // deadline whatever the announcer does, so the release waits for
        // it: no other agent answers before then.
        let until = self.elector.holds(now_ms());
        let release = self.elector.release();
        self.publish();
        self.door.release(until, release).await;
    }
}
