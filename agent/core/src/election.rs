//! One writer among the agents, elected on a shared lease record (#44 item
//! 1): without cluster mode, the Kubernetes `coordination.k8s.io` Lease
//! that decides which agent assigns LoadBalancer addresses, writes Service
//! status and answers ARP and NDP for them.
//!
//! Why a machine of its own, with no clock: the one safety property — two
//! agents never both act as the writer at the same moment — rests on a few
//! timing rules that are easy to break in glue code, so they live here and
//! are property-tested against a model of the API server
//! (`election/tests.rs`). The daemon reads the record, calls
//! [`Elector::observe`] with the local monotonic time, performs the write
//! it is told (a create or a replace guarded by the record's version) and
//! reports how that went.
//!
//! The rules, as client-go's leader election keeps them:
//! - **Expiry is measured on the reader's own clock.** A record is expired
//!   when it has not changed (its version) for its `duration`, measured
//!   from when this agent first saw that version. Wall clocks of different
//!   nodes are never compared.
//! - **The holder acts for less than a duration.** A successful write that
//!   was *sent* at `t` lets the holder act until `t + deadline`, with
//!   `deadline < duration`. Any other agent first saw that version after it
//!   was written, so after `t`, and waits a whole `duration` from then:
//!   the holder has stopped before anyone else may take the record.
//! - **Every write is guarded.** A takeover or renewal names the version it
//!   read; the API server refuses it (409) when another write came first,
//!   so of two agents that both judged the record expired, one wins.
//! - **Release.** A holder that stops writes the record with no holder,
//!   once it has stopped acting, so another agent takes over at once
//!   instead of after a duration.

/// The lease record as read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observed {
    /// `spec.holderIdentity`; `None` or empty: released.
    pub holder: Option<String>,
    /// `metadata.resourceVersion`: changes with every write.
    pub version: String,
    /// `spec.leaseDurationSeconds`, in milliseconds.
    pub duration_ms: u64,
    /// `spec.leaseTransitions`.
    pub transitions: i32,
}

/// The record this agent is to write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Write {
    /// The holder written (`None`: a release).
    pub holder: Option<String>,
    /// The version the write is guarded by (`None`: a create).
    pub version: Option<String>,
    /// Whether this write takes the record from another holder (or from
    /// none): `acquireTime` is set then.
    pub acquire: bool,
    /// `spec.leaseTransitions` to write.
    pub transitions: i32,
}

/// What to do after a read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Write this record (then report [`Elector::written`] or
    /// [`Elector::failed`]).
    Write(Write),
    /// Nothing to write: read again later.
    Follow {
        /// Who holds the record (empty: nobody).
        holder: String,
    },
}

/// The election as one agent sees it.
#[derive(Clone, Debug)]
pub struct Elector {
    me: String,
    duration_ms: u64,
    deadline_ms: u64,
    /// Whether this agent may hold the record ([`Elector::set_candidate`]).
    candidate: bool,
    /// Stepped down while holding: the record is released once this
    /// deadline (local ms) has passed.
    release_after: Option<u64>,
    /// The last version read and when (local ms) it was first seen.
    seen: Option<(Observed, u64)>,
    /// Local ms up to which this agent may act as the writer.
    until_ms: Option<u64>,
    /// The write in flight, sent at (local ms).
    sent: Option<(Write, u64)>,
}

/// An election configured against itself.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ElectionError {
    /// The deadline must be shorter than the duration, or a holder could
    /// act past the moment another takes over.
    #[error(
        "the writer's renew deadline ({deadline_ms} ms) must be shorter than the lease duration ({duration_ms} ms)"
    )]
    DeadlineNotShorter {
        /// The deadline.
        deadline_ms: u64,
        /// The duration.
        duration_ms: u64,
    },
}

impl Elector {
    /// Agent `me`, writing records of `duration_ms`, acting until
    /// `deadline_ms` after a successful write was sent.
    ///
    /// # Errors
    /// [`ElectionError::DeadlineNotShorter`].
    pub fn new(me: &str, duration_ms: u64, deadline_ms: u64) -> Result<Self, ElectionError> {
        if deadline_ms == 0 || deadline_ms >= duration_ms {
            return Err(ElectionError::DeadlineNotShorter {
                deadline_ms,
                duration_ms,
            });
        }
        Ok(Self {
            me: me.to_owned(),
            duration_ms,
            deadline_ms,
            seen: None,
            until_ms: None,
            sent: None,
            candidate: true,
            release_after: None,
        })
    }

    /// Whether this agent may hold the record (a node excluded from load
    /// balancers, cordoned, not Ready or being deleted may not). One that
    /// holds it and may no longer stops acting at once, and releases the
    /// record once its deadline has passed (its datapath stops answering
    /// then), so no other agent acts before it stopped.
    pub fn set_candidate(&mut self, candidate: bool, now_ms: u64) {
        if self.candidate && !candidate {
            if let Some(until) = self.holds(now_ms) {
                self.release_after = Some(until);
            }
            self.until_ms = None;
        }
        if candidate {
            self.release_after = None;
        }
        self.candidate = candidate;
    }

    /// Not a candidate any more, and the caller has confirmed that nothing
    /// it did as the holder is in effect (its datapath answers none of the
    /// addresses any more): the release is written on the next round
    /// instead of after the deadline, so another agent takes over sooner.
    /// Does nothing while a candidate.
    pub fn stopped(&mut self) {
        if !self.candidate {
            self.release_after = None;
        }
    }

    /// Whether this agent stands for the record ([`Elector::set_candidate`]).
    #[must_use]
    pub fn is_candidate(&self) -> bool {
        self.candidate
    }

    /// This agent's identity.
    #[must_use]
    pub fn me(&self) -> &str {
        &self.me
    }

    /// Until when (local ms) this agent may act as the writer, if it may
    /// at `now_ms`.
    #[must_use]
    pub fn holds(&self, now_ms: u64) -> Option<u64> {
        self.until_ms.filter(|u| now_ms < *u)
    }

    /// The record as read at `now_ms` (`None`: there is none); what to
    /// write, if anything. The write is to be sent at `now_ms` or later.
    pub fn observe(&mut self, lease: Option<Observed>, now_ms: u64) -> Step {
        let Some(lease) = lease else {
            self.seen = None;
            if !self.candidate {
                self.until_ms = None;
                return Step::Follow {
                    holder: String::new(),
                };
            }
            return self.send(
                Write {
                    holder: Some(self.me.clone()),
                    version: None,
                    acquire: true,
                    transitions: 0,
                },
                now_ms,
            );
        };
        let first_seen = match &self.seen {
            Some((o, at)) if o.version == lease.version => *at,
            _ => now_ms,
        };
        self.seen = Some((lease.clone(), first_seen));
        let holder = lease.holder.clone().filter(|h| !h.is_empty());
        if !self.candidate {
            return self.step_aside(&lease, holder, now_ms);
        }
        match holder {
            Some(h) if h == self.me => self.send(
                Write {
                    holder: Some(self.me.clone()),
                    version: Some(lease.version),
                    acquire: false,
                    transitions: lease.transitions,
                },
                now_ms,
            ),
            Some(h) if now_ms < first_seen.saturating_add(lease.duration_ms) => {
                // Someone else holds it: whatever this agent held is gone.
                self.until_ms = None;
                Step::Follow { holder: h }
            }
            _ => self.send(
                Write {
                    holder: Some(self.me.clone()),
                    version: Some(lease.version),
                    acquire: true,
                    transitions: lease.transitions.saturating_add(1),
                },
                now_ms,
            ),
        }
    }

    /// Not a candidate: never takes the record; releases it when it
    /// still names this agent and the deadline has passed.
    fn step_aside(&mut self, lease: &Observed, holder: Option<String>, now_ms: u64) -> Step {
        self.until_ms = None;
        match holder {
            Some(h) if h == self.me => {
                if self.release_after.is_some_and(|t| now_ms < t) {
                    return Step::Follow { holder: h };
                }
                self.sent = None;
                Step::Write(Write {
                    holder: None,
                    version: Some(lease.version.clone()),
                    acquire: false,
                    transitions: lease.transitions,
                })
            }
            Some(h) => Step::Follow { holder: h },
            None => Step::Follow {
                holder: String::new(),
            },
        }
    }

    fn send(&mut self, w: Write, now_ms: u64) -> Step {
        self.sent = Some((w.clone(), now_ms));
        Step::Write(w)
    }

    /// The write last asked for succeeded, and the record is now at
    /// `version` (what the API answered).
    pub fn written(&mut self, version: &str) {
        if let Some((w, at)) = self.sent.take() {
            // A renewal that lands after stepping aside makes no writer.
            self.until_ms = w
                .holder
                .as_ref()
                .filter(|h| **h == self.me && self.candidate)
                .map(|_| at.saturating_add(self.deadline_ms));
            let record = Observed {
                holder: w.holder,
                version: version.to_owned(),
                duration_ms: self.duration_ms,
                transitions: w.transitions,
            };
            self.seen = Some((record, at));
        }
    }

    /// The write last asked for failed (refused, or no answer). What this
    /// agent held still stands until its deadline: a renewal that got no
    /// answer may have landed, and the deadline is what keeps it safe.
    pub fn failed(&mut self) {
        self.sent = None;
    }

    /// The release to write when this agent stops, once it no longer acts
    /// as the writer: `None` when it does not hold the record as last read.
    /// Acting stops here, whatever the write's outcome.
    pub fn release(&mut self) -> Option<Write> {
        self.until_ms = None;
        let (lease, _) = self.seen.as_ref()?;
        if lease.holder.as_deref() != Some(self.me.as_str()) {
            return None;
        }
        let w = Write {
            holder: None,
            version: Some(lease.version.clone()),
            acquire: false,
            transitions: lease.transitions,
        };
        // A release never makes this agent the holder again.
        self.sent = None;
        Some(w)
    }
}

#[cfg(test)]
mod tests;
