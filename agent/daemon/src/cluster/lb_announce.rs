//! The glue between the core's announcer ([`Announcer`], #27 items 1, 2
//! and 5) and the two systems it orders steps across: etcd's announcement
//! keys ([`AnnounceKeys`], the cluster door) and the datapath's
//! announcement maps ([`AnnounceDatapath`], [`Announcements`]). It carries
//! out the announcer's actions one at a time and reports each outcome back
//! exactly as it happened: a map write that failed is reported failed and
//! one not answered in time is reported lost (it may still land), so the
//! announcer never withdraws a key on a write it has no confirmation of.
//! An action not carried out (the tick's time is up) is reported lost
//! too, which is always safe: lost means "may or may not have happened".
//!
//! The two traits exist so this order is unit-tested with the doors'
//! doubles (a map write failing or hanging) without etcd or root.

use std::collections::{BTreeSet, VecDeque};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use etcd_client::{Compare, CompareOp, Txn, TxnOp};
use lockstep_core::lb::announce::{
    Action, Announcer, Holder, KeyRef, Observation, Took, Withdrew, Written,
};

use super::lb::selectors;
use super::{ClusterStoreError, Door, LbView};
use crate::agent::Announcements;
use crate::agent::announce::monotonic_ns;

/// How long a datapath write is waited for before it is reported lost
/// (it may still land; a newer write is never overtaken by it).
pub const WRITE_TIMEOUT: Duration = Duration::from_millis(500);

/// At most this many polls of the announcer per call (take → program →
/// announce is three; each batch of takes adds one).
const MAX_POLLS: usize = 64;
/// At most this many takes are sent to etcd together.
const TAKE_BATCH: usize = 32;

/// etcd's announcement keys, as the announcer uses them.
pub(crate) trait AnnounceKeys {
    /// Creates `address`'s key for `node` under `lease` if absent. Returns
    /// the key's create revision if `node` holds it under `lease` now
    /// (created now, or already), `None` if another holder has it.
    async fn take(
        &self,
        address: IpAddr,
        node: &str,
        lease: i64,
    ) -> Result<Option<i64>, ClusterStoreError>;
    /// Deletes `address`'s key if it is `node`'s and the one `key` names
    /// (never a later key of `node`'s for the address).
    async fn withdraw(
        &mut self,
        address: IpAddr,
        node: &str,
        key: KeyRef,
    ) -> Result<(), ClusterStoreError>;
    /// Revokes `lease` (every key bound to it goes).
    async fn revoke(&mut self, lease: i64) -> Result<(), ClusterStoreError>;
}

/// `lb/announce/<ip>` under the door's prefix (the key `cluster::lb`
/// documents).
fn announce_key(door: &Door, address: IpAddr) -> String {
    format!("{}lb/announce/{address}", door.options().prefix)
}

impl AnnounceKeys for Door {
    async fn take(
        &self,
        address: IpAddr,
        node: &str,
        lease: i64,
    ) -> Result<Option<i64>, ClusterStoreError> {
        // The next read of `lb/` (from the mirror) has this answer in it:
        // a read older than a take must not tell the announcer the key is
        // free or someone else's.
        self.hold_under_lease(
            announce_key(self, address),
            node,
            lease,
            "take an lb announcement",
        )
        .await
    }

    async fn withdraw(
        &mut self,
        address: IpAddr,
        node: &str,
        key: KeyRef,
    ) -> Result<(), ClusterStoreError> {
        let k = announce_key(self, address);
        let named = match key {
            KeyRef::Created(rev) => Compare::create_revision(k.clone(), CompareOp::Equal, rev),
            KeyRef::Lease(lease) => Compare::lease(k.clone(), CompareOp::Equal, lease),
        };
        let txn = Txn::new()
            .when([
                Compare::value(k.clone(), CompareOp::Equal, node.as_bytes().to_vec()),
                named,
            ])
            .and_then([TxnOp::delete(k, None)]);
        let mut client = self.client();
        let resp = self
            .bounded("withdraw an lb announcement", true, client.txn(txn))
            .await?;
        // The next read of `lb/` (from the mirror) has the key gone: a read
        // older than the withdrawal would show the key as this node's
        // still, and the announcer would take it back.
        self.wrote_at(resp.header().map_or(0, |h| h.revision()));
        Ok(())
    }

    async fn revoke(&mut self, lease: i64) -> Result<(), ClusterStoreError> {
        self.lb_revoke(lease).await
    }
}

/// The datapath's announcement maps, as the announcer uses them.
pub(crate) trait AnnounceDatapath {
    /// Write number `seq`: answer for exactly `addresses` until
    /// `valid_until` (kernel monotonic ns). An older write than one
    /// applied is dropped (and reported done).
    async fn program(&self, seq: u64, addresses: BTreeSet<IpAddr>, valid_until: u64) -> Written;
    /// A gratuitous ARP / unsolicited NA for `address`, if answered now.
    fn announce(&self, address: IpAddr);
}

impl AnnounceDatapath for Announcements {
    async fn program(&self, seq: u64, addresses: BTreeSet<IpAddr>, valid_until: u64) -> Written {
        let me = self.clone();
        let write =
            tokio::task::spawn_blocking(move || me.set_cluster(seq, addresses, valid_until));
        match tokio::time::timeout(WRITE_TIMEOUT, write).await {
            Ok(Ok(Ok(_))) => Written::Done,
            Ok(Ok(Err(e))) => {
                tracing::error!(error = %crate::error_chain(&e), seq, "cluster announcements not programmed");
                Written::Failed
            }
            Ok(Err(e)) => {
                tracing::error!(error = %e, seq, "cluster announcement write failed");
                Written::Failed
            }
            Err(_) => {
                tracing::warn!(seq, timeout = ?WRITE_TIMEOUT, "cluster announcement write not answered in time; its key is kept");
                Written::Lost
            }
        }
    }

    fn announce(&self, address: IpAddr) {
        Announcements::announce(self, address);
    }
}

/// What [`run`] did, for the metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Counts {
    /// Keys taken.
    pub took: u64,
    /// Keys withdrawn.
    pub withdrew: u64,
}

/// The read of etcd as the announcer takes it.
///
/// # Errors
/// The stored state does not restore.
pub(crate) fn observation(view: &LbView) -> Result<Observation, ClusterStoreError> {
    Ok(Observation {
        addresses: selectors(&view.to_announce()?),
        members: view
            .members
            .iter()
            .map(|(n, lease)| (view.candidate(n), *lease))
            .collect(),
        holders: view
            .announcements
            .iter()
            .map(|(a, (node, lease))| {
                (
                    *a,
                    Holder {
                        node: node.clone(),
                        lease: *lease,
                    },
                )
            })
            .collect(),
    })
}

/// Carries out what `machine` says until it says nothing more or
/// `deadline` passes, reporting every outcome; what is left when the
/// deadline passes is reported lost (asked again next time). Takes in a
/// row go to etcd together, and what they won is programmed before
/// anything else.
/// Returns the first etcd error seen (every failed request was reported
/// lost to the machine).
pub(crate) async fn run<K: AnnounceKeys, D: AnnounceDatapath>(
    machine: &mut Announcer,
    keys: &mut K,
    dp: &D,
    node: &str,
    deadline: Instant,
    counts: &mut Counts,
) -> Option<ClusterStoreError> {
    let mut problem = None;
    let mut queue: VecDeque<Action> = VecDeque::new();
    let mut polls = 0;
    loop {
        let late = Instant::now() >= deadline || polls >= MAX_POLLS;
        if queue.is_empty() {
            if late {
                break;
            }
            queue.extend(machine.poll(monotonic_ns()));
            polls += 1;
            if queue.is_empty() {
                break;
            }
        }
        let Some(action) = queue.pop_front() else {
            break;
        };
        match action {
            Action::Program {
                seq,
                addresses,
                valid_until,
            } => {
                let written = if late {
                    Written::Lost
                } else {
                    dp.program(seq, addresses, valid_until).await
                };
                for a in machine.programmed(seq, written, monotonic_ns()) {
                    if let Action::Announce(a) = a {
                        dp.announce(a);
                    }
                }
            }
            Action::Take(first) => {
                // The takes at the front go to etcd together (each its own
                // transaction): a node taking many addresses at once (a
                // failover) waits one round trip, not one per address.
                let mut batch = vec![first];
                while batch.len() < TAKE_BATCH
                    && let Some(Action::Take(a)) = queue.front()
                {
                    batch.push(*a);
                    queue.pop_front();
                }
                let answers: Vec<Took> = match (late, machine.lease()) {
                    (false, Some(lease)) => {
                        let asked = batch.iter().map(|a| keys.take(*a, node, lease));
                        futures::future::join_all(asked)
                            .await
                            .into_iter()
                            .zip(&batch)
                            .map(|(r, a)| match r {
                                Ok(Some(rev)) => {
                                    tracing::info!(address = %a, "lb announcement taken");
                                    counts.took += 1;
                                    Took::Mine(rev)
                                }
                                Ok(None) => Took::Other,
                                Err(e) => {
                                    problem.get_or_insert(e);
                                    Took::Lost
                                }
                            })
                            .collect()
                    }
                    _ => vec![Took::Lost; batch.len()],
                };
                let mine = answers.iter().any(|t| matches!(t, Took::Mine(_)));
                for (a, answer) in batch.into_iter().zip(answers) {
                    machine.took(a, answer);
                }
                // Programs what is held before anything else queued.
                if !late && mine {
                    let now = machine.poll(monotonic_ns());
                    polls += 1;
                    for x in now.into_iter().rev() {
                        queue.push_front(x);
                    }
                }
            }
            Action::Withdraw(a, key) => {
                let answer = if late {
                    Withdrew::Lost
                } else {
                    match keys.withdraw(a, node, key).await {
                        Ok(()) => {
                            tracing::info!(address = %a, "lb announcement withdrawn");
                            counts.withdrew += 1;
                            Withdrew::Done
                        }
                        Err(e) => {
                            problem.get_or_insert(e);
                            Withdrew::Lost
                        }
                    }
                };
                machine.withdrew(a, answer, monotonic_ns());
            }
            Action::Announce(a) => dp.announce(a),
            // Best effort: a lease not revoked runs out.
            Action::Revoke(lease) => {
                if let Err(e) = keys.revoke(lease).await {
                    tracing::warn!(error = %crate::error_chain(&e), "lb lease not revoked; it runs out");
                }
            }
        }
    }
    problem
}

#[cfg(test)]
mod tests;
