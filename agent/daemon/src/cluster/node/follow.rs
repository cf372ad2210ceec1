//! The claim loop's way through most cluster changes without a read
//! (#47 item 2). A read takes every block, node, routing key and
//! reservation again and decides owners, fences, overlaps and gone
//! nodes from all of them: at 5,000 nodes that is milliseconds, for each
//! of the changes every node sees all the time. Two kinds decide nothing
//! a read would decide differently, and are followed per key instead:
//! - a live node's keys rewritten (its counts published), with no node
//!   come or gone and none marked gone: nothing to do;
//! - another node's block claimed or given back, away from every block
//!   this node holds or has a claim in doubt for: the set of claimed
//!   blocks and the other nodes' blocks change in place. No fence can
//!   follow (a fence concerns this node's blocks only), no claim waits
//!   on it, and without configured pools no overlap can come or go.
//!
//! - another node come (its node key written, the name not yet alive),
//!   while the last read found no gone node: it joins the live set.
//!   With no gone node, which live node keeps a gone one
//!   (`gone_keeper`) decides nothing, and a coming node changes no
//!   block, pool or reservation. At a cluster's bring-up every node sees
//!   every other come: a read for each made that quadratic per node.
//!
//! Anything else (a pool, a reservation, a node gone, a node come while
//! a gone node is known, a value this build cannot read, this node's own
//! keys or blocks) is left to the read.

use std::collections::BTreeSet;
use std::sync::Arc;

use ipnet::IpNet;

use super::{AREAS, ClusterNode};
use crate::cluster::door::ChangedKey;
use crate::cluster::mirror::{Changes, Cursor};
use crate::cluster::{Block, Kv};

/// One changed key the claim loop follows in place.
enum Followed {
    /// A rewrite of a live node's keys: nothing changes.
    Nothing,
    /// Another node come: it is alive.
    Came(String),
    /// Another node's block now (`None`: given back).
    Block(IpNet, Option<Block>),
}

impl ClusterNode {
    /// Follows every key changed since the cursor when each is one the
    /// loop can follow in place (the module's two kinds): applied, and
    /// the cursor past them (`Ok`). Otherwise nothing is applied, and the
    /// cursor a read made now starts from (`Err`; `None`: the mirror
    /// cannot say).
    pub(super) fn follow(&mut self) -> Result<Cursor, Option<Cursor>> {
        let (Some(link), Some(door)) = (self.link.as_ref(), self.door.as_ref()) else {
            return Err(None);
        };
        let Some((changes, at)) = link.mirror().changes(&AREAS, self.cursor) else {
            return Err(None);
        };
        let Changes::Keys(keys) = changes else {
            return Err(Some(at));
        };
        if self.cursor.is_none() {
            return Err(Some(at));
        }
        // Blocks are followed only while no configured pool can overlap
        // them and the last read found every key readable.
        let blocks_followed =
            self.config.pools.is_empty() && self.handle.lock().unreadable.is_empty();
        let changed: Vec<(ChangedKey, &Option<Arc<Kv>>)> = keys
            .iter()
            .map(|(key, now)| (door.read_changed(key, now.as_deref()), now))
            .collect();
        // The nodes come in this batch (their routing keys may come
        // first: they are live for the whole batch).
        let came: BTreeSet<&str> = if self.gone_known {
            BTreeSet::new()
        } else {
            changed
                .iter()
                .filter_map(|(c, value)| match c {
                    ChangedKey::Node { name, now: Some(_) }
                        if value.is_some() && *name != self.name && !self.alive.contains(name) =>
                    {
                        Some(name.as_str())
                    }
                    _ => None,
                })
                .collect()
        };
        let mut followed = Vec::with_capacity(changed.len());
        for (c, value) in &changed {
            match self.followed(c, value, blocks_followed, &came) {
                Some(f) => followed.push(f),
                None => return Err(Some(at)),
            }
        }
        for f in followed {
            match f {
                Followed::Nothing => {}
                Followed::Came(name) => {
                    self.alive.insert(name);
                }
                Followed::Block(cidr, Some(b)) => {
                    self.claimed.insert(cidr);
                    self.others.insert(cidr, b.node);
                }
                Followed::Block(cidr, None) => {
                    self.claimed.remove(&cidr);
                    self.others.remove(&cidr);
                }
            }
        }
        Ok(at)
    }

    /// How the loop follows one changed key in place (`None`: it cannot,
    /// a read is due). `value`: the key's value as the mirror has it;
    /// `came`: the nodes come in this batch that are followed.
    fn followed(
        &self,
        changed: &ChangedKey,
        value: &Option<Arc<Kv>>,
        blocks_followed: bool,
        came: &BTreeSet<&str>,
    ) -> Option<Followed> {
        let alive = |name: &str| self.alive.contains(name) || came.contains(name);
        match changed {
            ChangedKey::Node { name, now: Some(_) } if came.contains(name.as_str()) => {
                Some(Followed::Came(name.clone()))
            }
            // A node key: whether the node is alive is what the read takes
            // from it.
            ChangedKey::Node { name, now } => {
                (now.is_some() == self.alive.contains(name)).then_some(Followed::Nothing)
            }
            // A routing key of another live node, not marked gone: the
            // gone-node scan waits on it whatever it holds (its in-use
            // list is read by a reclaim itself).
            ChangedKey::Routing { name, now } => (*name != self.name
                && alive(name)
                && now.as_ref().is_some_and(|r| r.gone.is_none()))
            .then_some(Followed::Nothing),
            ChangedKey::Block { at: (_, cidr), now } => {
                let cidr = *cidr;
                // A value that does not read is the read's to report.
                let readable = value.is_some() == now.is_some();
                let foreign = now.as_ref().is_none_or(|b| b.node != self.name)
                    && !self.near_own(cidr)
                    && self
                        .others
                        .get(&cidr)
                        .is_none_or(|n| !n.starts_with(self.name.as_str()));
                (blocks_followed && readable && foreign).then(|| Followed::Block(cidr, now.clone()))
            }
            ChangedKey::Pool | ChangedKey::Other => None,
        }
    }

    /// Whether `cidr` overlaps a block this node holds (serving, fenced
    /// or being given back) or a claim of its whose answer never came.
    fn near_own(&self, cidr: IpNet) -> bool {
        let overlaps = |b: &IpNet| b.contains(&cidr.network()) || cidr.contains(&b.network());
        self.held.blocks.iter().any(|h| overlaps(&h.cidr))
            || self.held.unsettled.iter().any(|u| overlaps(&u.cidr))
    }
}
