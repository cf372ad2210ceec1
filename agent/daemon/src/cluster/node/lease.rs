//! The node's registration in etcd: its record and addresses published
//! under one lease, granted once and kept alive (#27 item 6), registered
//! again only when the lease ended, and a name another live agent holds
//! reported rather than taken. Split from [`super`], whose round calls
//! [`ClusterNode::lease`] once per round; the keeper (`keeper`) refreshes
//! the lease between rounds.

use std::net::IpAddr;
use std::time::Instant;

use super::ClusterNode;
use crate::cluster::{ClusterStoreError, NodeRecord};

impl ClusterNode {
    /// Registers the node, or keeps its lease alive; publishes what it
    /// holds under the same lease when that changed (#27 item 6: the
    /// lease is granted once and kept alive, never granted anew because
    /// a count moved). Registers again only when the lease is gone.
    pub(super) async fn lease(&mut self, record: NodeRecord, addrs: Vec<IpAddr>) {
        // The keeper's refreshes count as the round's (`keeper`) while
        // there is nothing to publish; a change of counts still goes out
        // within a third of the TTL of the round's own last write.
        if self.published.as_ref() == Some(&record) && self.published_addrs == addrs {
            self.lease = self.keeper.fold(self.lease);
        }
        self.lease_round(record, addrs).await;
        self.keeper.tell(self.lease);
    }

    async fn lease_round(&mut self, record: NodeRecord, addrs: Vec<IpAddr>) {
        let problem = self.handle.etcd_problem().is_some();
        let Some(door) = self.door.as_mut() else {
            return;
        };
        let ttl = self.cluster.lease_ttl;
        let refresh = ttl / 3;
        let same = self.published.as_ref() == Some(&record) && self.published_addrs == addrs;
        // The counts change with every ADD: published with the next
        // refresh; a change of blocks or addresses at once (the addresses
        // in use are what stays reserved if the node's blocks are taken).
        let urgent = !self
            .published
            .as_ref()
            .is_some_and(|p| p.blocks == record.blocks && p.ips == record.ips)
            || self.published_addrs != addrs;
        let result = match self.lease {
            // Nothing to publish now, the lease fresh: no request. While
            // etcd failed, a refresh each round tells when it answers.
            Some((_, at)) if !urgent && at.elapsed() < refresh && !problem => return,
            Some((lease, _)) if same => match door.keep_alive(lease).await {
                Ok(true) => {
                    self.lease = Some((lease, Instant::now()));
                    self.set_problem(None);
                    return;
                }
                Ok(false) => door.register_node(&record, &addrs, ttl).await,
                Err(e) => Err(e),
            },
            // What the node publishes changed: written under the lease
            // it holds. Refreshed first when due, so the write never
            // lands on a lease about to end.
            Some((lease, at)) => {
                let alive = if at.elapsed() >= refresh || problem {
                    door.keep_alive(lease).await
                } else {
                    Ok(true)
                };
                match alive {
                    Ok(true) => {
                        let now = Instant::now();
                        match door.publish_node(&record, &addrs, lease).await {
                            Ok(()) => Ok(lease),
                            // The lease ended between the refresh and the
                            // write: a new registration.
                            Err(ClusterStoreError::Rejected { .. }) => {
                                door.register_node(&record, &addrs, ttl).await
                            }
                            Err(e) => Err(e),
                        }
                        .inspect(|_| {
                            if at.elapsed() >= refresh || problem {
                                self.lease = Some((lease, now));
                            }
                        })
                    }
                    Ok(false) => door.register_node(&record, &addrs, ttl).await,
                    Err(e) => Err(e),
                }
            }
            None => door.register_node(&record, &addrs, ttl).await,
        };
        match result {
            Ok(lease) => {
                if self.name_taken.take().is_some() {
                    tracing::info!("the node name is this agent's again");
                    self.handle.lock().identity = None;
                }
                match self.lease {
                    Some((old, _)) if old == lease => {}
                    Some((old, _)) => {
                        tracing::info!(
                            old,
                            lease,
                            "node registered again under a new lease (the old one ended)"
                        );
                        self.lease = Some((lease, Instant::now()));
                    }
                    None => self.lease = Some((lease, Instant::now())),
                }
                self.set_problem(None);
                self.published = Some(record);
                self.published_addrs = addrs;
            }
            Err(e @ ClusterStoreError::NameTaken { .. }) => {
                let why = e.to_string();
                if self.name_taken.as_deref() != Some(why.as_str()) {
                    tracing::error!(error = %why, "NAME TAKEN: another agent runs under this node's name; this one claims nothing");
                }
                self.handle.lock().identity = Some(why.clone());
                self.name_taken = Some(why);
            }
            Err(e) => self.set_problem(Some(&e)),
        }
    }
}
