//! The glue between the core's announcer driver
//! (`lockstep_core::lb::announce::driver`, #27 items 1, 2 and 5) and the
//! two systems it orders steps across: etcd's announcement keys
//! ([`AnnounceKeys`], the cluster door) and the datapath's announcement
//! maps ([`AnnounceDatapath`], [`Announcements`]). It carries out one
//! request at a time and reports each outcome exactly as it happened: a
//! map write that failed is reported failed (or, read back, as what the
//! maps hold), and one not answered in time is reported lost (it may
//! still land), so the announcer never withdraws a key on a write it has
//! no confirmation of.
//!
//! The two traits exist so this order is unit-tested with the doors'
//! doubles (a map write failing or hanging) without etcd or root.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Duration;

use etcd_client::{Compare, CompareOp, Txn, TxnOp};
use lockstep_core::lb::announce::driver::{Done, Io};
use lockstep_core::lb::announce::{Holder, KeyRef, Observation, Took, Withdrew, Written};

use super::lb::selectors;
use super::{ClusterStoreError, Door, LbView};
use crate::announce::Announcements;

/// How long a datapath write is waited for before it is reported lost
/// (it may still land; a newer write is never overtaken by it).
pub const WRITE_TIMEOUT: Duration = Duration::from_millis(500);

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
                tracing::error!(error = %crate::error_chain(&e.error), seq, held = ?e.held, "cluster announcements not programmed");
                match e.held {
                    Some(held) => Written::Partly(held),
                    None => Written::Failed,
                }
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
        members: view.members.clone(),
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

/// Carries out one of the driver's requests on the announcement keys or
/// the datapath (a take, a withdrawal, a write), counting and logging it;
/// its outcome, and the etcd error if one made it lost. Takes in one
/// request go to etcd together (each its own transaction): a node taking
/// many addresses at once (a failover) waits one round trip, not one per
/// address.
pub(crate) async fn carry_out<K: AnnounceKeys, D: AnnounceDatapath>(
    io: Io,
    keys: &mut K,
    dp: &D,
    node: &str,
    counts: &mut Counts,
) -> (Done, Option<ClusterStoreError>) {
    let mut problem = None;
    let done = match io {
        Io::Program {
            seq,
            addresses,
            valid_until,
        } => Done::Programmed(dp.program(seq, addresses, valid_until).await),
        Io::Take { lease, addresses } => {
            let asked = addresses.iter().map(|a| keys.take(*a, node, lease));
            let answers = futures::future::join_all(asked)
                .await
                .into_iter()
                .zip(&addresses)
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
                .collect();
            Done::Took(answers)
        }
        Io::Withdraw(a, key) => match keys.withdraw(a, node, key).await {
            Ok(()) => {
                tracing::info!(address = %a, "lb announcement withdrawn");
                counts.withdrew += 1;
                Done::Withdrew(Withdrew::Done)
            }
            Err(e) => {
                problem.get_or_insert(e);
                Done::Withdrew(Withdrew::Lost)
            }
        },
        Io::Revoke(lease) => match keys.revoke(lease).await {
            Ok(()) => Done::Revoked,
            Err(e) => {
                problem.get_or_insert(e);
                Done::Lost
            }
        },
        // The lease and the reads are the LB agent's own (`lb_agent`).
        Io::Grant | Io::Join { .. } | Io::Refresh(_) | Io::Read => Done::Lost,
    };
    (done, problem)
}

#[cfg(test)]
mod tests;
