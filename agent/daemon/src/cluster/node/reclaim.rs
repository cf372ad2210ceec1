//! The claim loop's part in taking blocks from nodes whose lease is gone
//! (#26 item 2): at every read it records since when another node's lease
//! is gone (the first live node to see it wins a guarded write), reclaims
//! the blocks of a node gone for `reclaim_after` (guarded: one reclaim of
//! several tries), keeps the addresses reserved for other nodes out of
//! its allocator, and releases the reservations of its own addresses its
//! pods no longer hold. The decisions are the core's
//! (`lockstep_core::cluster::reclaim`).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use lockstep_core::cluster::{
    GoneStep, gone_keeper, gone_step, reservations_to_keep, reserved_for,
};

use super::{ClusterNode, now_ms};
use crate::cluster::{ClusterStoreError, ReservedRecord};

impl ClusterNode {
    /// Marks other nodes gone, reclaims those gone for `reclaim_after`
    /// (each only by its keeper, [`gone_keeper`]), and reads the reservations: the others' into the record (kept out
    /// of the allocator), the node's own for [`ClusterNode::release_own`].
    ///
    /// # Errors
    /// etcd unavailable.
    pub(super) async fn watch_gone(&mut self) -> Result<(), ClusterStoreError> {
        let Some(door) = self.door.as_mut() else {
            return Ok(());
        };
        let alive: BTreeSet<String> = door
            .nodes()
            .await?
            .iter()
            .map(|n| n.record.name.clone())
            .collect();
        let routing = door.routing_keys().await?;
        self.alive.clone_from(&alive);
        self.gone = routing
            .iter()
            .filter(|(r, _)| r.name != self.name && !alive.contains(&r.name))
            .map(|(r, _)| r.name.clone())
            .collect();
        let now = now_ms();
        let after = u64::try_from(self.cluster.reclaim_after.as_millis()).unwrap_or(u64::MAX);
        let mut reclaimed = false;
        // A deadline to watch only for the gone nodes this node keeps.
        self.gone_pending = routing.iter().any(|(r, _)| {
            r.name != self.name
                && !alive.contains(&r.name)
                && gone_keeper(&alive, &r.name) == Some(self.name.as_str())
        });
        for (record, revision) in routing.iter() {
            if record.name == self.name {
                // Marked gone while alive (a refresh that came late): a
                // registration clears it before its deadline.
                if record.gone.is_some() && alive.contains(&self.name) {
                    tracing::warn!("this node was recorded gone; registering again");
                    self.published = None;
                }
                continue;
            }
            // Only this gone node's keeper writes for it (one live node
            // per gone node, not every live node: #27).
            let keeper = gone_keeper(&alive, &record.name) == Some(self.name.as_str());
            if !keeper && !alive.contains(&record.name) {
                continue;
            }
            match gone_step(alive.contains(&record.name), record.gone, now, after) {
                GoneStep::Wait => {}
                GoneStep::Mark(mark) => {
                    if door.mark_gone(record, *revision, mark).await? {
                        tracing::warn!(node = %record.name, reclaim_after = ?self.cluster.reclaim_after, "a node's lease is gone; its blocks are reclaimed if it stays gone for reclaim_after");
                    }
                }
                GoneStep::Reclaim => match door.reclaim_node(&record.name).await {
                    Ok(removed) => {
                        reclaimed = true;
                        tracing::warn!(node = %record.name, blocks = ?removed.freed.iter().map(|b| b.cidr).collect::<Vec<_>>(), reserved = ?removed.reserved, "RECLAIMED: a node gone for reclaim_after; its blocks are free, the addresses it last published stay reserved");
                    }
                    // Another node reclaimed it first, or it came back.
                    Err(ClusterStoreError::Conflict { .. }) => {}
                    Err(ClusterStoreError::Refused(e)) => {
                        tracing::debug!(node = %record.name, error = %e, "not reclaimed");
                    }
                    Err(e) => return Err(e),
                },
            }
        }
        if reclaimed {
            self.read_next = true;
        }
        let reservations = door.reservations().await?;
        self.reservations = reservations
            .iter()
            .map(|(r, _)| (r.name.clone(), r.addresses.clone()))
            .collect();
        self.own_reserved = reservations
            .iter()
            .find(|(r, _)| r.name == self.name)
            .cloned();
        self.keep_reserved();
        Ok(())
    }

    /// Keeps the addresses reserved for other nodes out of the record
    /// (and so of the allocator), from the reservations as last read or
    /// followed.
    pub(super) fn keep_reserved(&mut self) {
        let by_address: BTreeMap<IpAddr, String> = self
            .reservations
            .iter()
            .flat_map(|(name, addrs)| addrs.iter().map(|a| (*a, name.clone())))
            .collect();
        let reserved: Vec<IpAddr> = reserved_for(&self.name, &by_address).into_iter().collect();
        if reserved != self.held.reserved {
            self.held.reserved = reserved;
            if let Err(e) = self.held.save(&self.config.state_dir) {
                tracing::error!(error = %crate::error_chain(&e), "the reserved addresses are not recorded");
            }
        }
    }

    /// Releases the reservations of this node's addresses that its pods no
    /// longer hold (`held`: every address it holds now), or that are in a
    /// block it serves again.
    pub(super) async fn release_own(&mut self, held: &BTreeSet<IpAddr>) {
        let Some((ReservedRecord { addresses, .. }, revision)) = self.own_reserved.clone() else {
            return;
        };
        let mine: BTreeSet<IpAddr> = addresses.into_iter().collect();
        let serving = self.held.serving().map(|b| b.cidr).collect();
        let keep = reservations_to_keep(&mine, held, &serving);
        if keep == mine {
            return;
        }
        let Some(door) = self.door.as_mut() else {
            return;
        };
        match door.set_reservations(&self.name, revision, &keep).await {
            Ok(true) => {
                tracing::info!(released = ?mine.difference(&keep).collect::<Vec<_>>(), "addresses reserved for this node released");
                self.own_reserved = None;
            }
            Ok(false) => self.own_reserved = None,
            Err(e) => self.set_problem(Some(&e)),
        }
    }
}
