//! The claim loop's way through most cluster changes without a read
//! (#47 item 2). A read takes every block, node, routing key and
//! reservation again and decides owners, fences, overlaps and gone
//! nodes from all of them: at 5,000 nodes that is milliseconds, for each
//! of the changes every node sees all the time. These kinds decide
//! nothing a read would decide differently, and are followed per key
//! instead:
//! - a live node's keys rewritten (its counts published, this node's own
//!   included), none marked gone: nothing to do;
//! - another node's block claimed or given back, away from every block
//!   this node holds or has a claim in doubt for: the set of claimed
//!   blocks and the other nodes' blocks change in place. No fence can
//!   follow (a fence concerns this node's blocks only), no claim waits
//!   on it, and without configured pools no overlap can come or go;
//! - this node's own claim coming back from etcd as it was made (held,
//!   serving, at the revision the claim's answer gave), and its own
//!   give-back (the block forgotten once etcd deleted it): a read would
//!   change nothing. With the view kept current this way, the next claim
//!   picks from it without a read (`ClusterNode::view_is_current`): a
//!   node claiming and giving back blocks as its pods come and go does
//!   not read the cluster whole for each;
//! - other nodes come (node key written) and gone (node key deleted):
//!   they join or leave the live set, and the gone ones the set of gone
//!   nodes. Which live node keeps each gone node (`gone_keeper`, the
//!   next live name round the ring) moves with the live set; the change
//!   is followed unless this node now keeps a gone node it did not keep
//!   before: then it reads, to mark and later reclaim it. At a cluster's
//!   bring-up every node sees every other come (a read for each made
//!   that quadratic per node), and in a large cluster nodes come while
//!   others are gone all the time;
//! - a gone node's routing key written (its gone mark) or deleted (its
//!   reclaim), when this node does not keep it: nothing to do but forget
//!   a reclaimed node;
//! - another node's reservations (`reserved/<node>`, written when its
//!   blocks are reclaimed): the kept reservations change, and the
//!   addresses kept out of the allocator with them.
//!
//! Without the last three, a node's death made every node of the cluster
//! read it whole three times (gone, marked, reclaimed); only its keeper
//! reads now, as it writes.
//!
//! Anything else is left to the read: a pool (an operator's apply), this
//! node's own reservations (written when it was reclaimed), a gone node
//! this node comes to keep, a value this build cannot read, a block of
//! this node's that is not as it claimed it (fenced, being given back,
//! unsettled, rewritten, or claimed by another).

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use lockstep_core::cluster::{gone_keeper, gone_keeper_after};

use super::{AREAS, ClusterNode, Stamp};
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
    /// Another node gone: it leaves the live set.
    Gone(String),
    /// Another node's reservations now (`None`: none).
    Reserved(String, Option<Vec<IpAddr>>),
}

impl ClusterNode {
    /// Follows every key changed since the cursor when each is one the
    /// loop can follow in place (the kinds the module names): applied, and
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
        // first: they are live for the whole batch), and the live ones
        // gone (their key deleted, not unreadable).
        let mut came: BTreeSet<&str> = BTreeSet::new();
        let mut went: BTreeSet<&str> = BTreeSet::new();
        // The gone nodes whose routing key was deleted (reclaimed): no
        // longer gone nodes to keep.
        let mut forgotten: BTreeSet<&str> = BTreeSet::new();
        for (c, value) in &changed {
            match c {
                ChangedKey::Node { name, now: Some(_) }
                    if value.is_some() && *name != self.name && !self.alive.contains(name) =>
                {
                    came.insert(name);
                }
                ChangedKey::Node { name, now: None }
                    if value.is_none() && *name != self.name && self.alive.contains(name) =>
                {
                    went.insert(name);
                }
                ChangedKey::Routing { name, now: None } if value.is_none() => {
                    forgotten.insert(name);
                }
                _ => {}
            }
        }
        // Which gone node each live node keeps changes only when the
        // live set does. A gone node this node did not keep and keeps
        // now (newly gone, or its keeper gone) is read: this node marks
        // and reclaims it.
        let mut pending = self.gone_pending;
        if !came.is_empty() || !went.is_empty() {
            pending = false;
            for g in self
                .gone
                .iter()
                .map(String::as_str)
                .chain(went.iter().copied())
            {
                if came.contains(g) || forgotten.contains(g) {
                    continue;
                }
                let mine = gone_keeper_after(&self.alive, g, &came, &went) == Some(&self.name);
                let was_mine =
                    self.gone.contains(g) && gone_keeper(&self.alive, g) == Some(&self.name);
                if mine && !was_mine {
                    return Err(Some(at));
                }
                pending |= mine;
            }
        }
        let mut followed = Vec::with_capacity(changed.len());
        for (c, value) in &changed {
            match self.followed(c, value, blocks_followed, &came, &went) {
                Some(f) => followed.push(f),
                None => return Err(Some(at)),
            }
        }
        // The gone nodes from now on.
        for g in &went {
            self.gone.insert((*g).to_string());
        }
        for g in came.iter().chain(&forgotten) {
            self.gone.remove(*g);
        }
        self.gone_pending = pending;
        let mut reserved = false;
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
                Followed::Gone(name) => {
                    self.alive.remove(&name);
                }
                Followed::Reserved(name, Some(addrs)) => {
                    self.reservations.insert(name, addrs);
                    reserved = true;
                }
                Followed::Reserved(name, None) => {
                    reserved |= self.reservations.remove(&name).is_some();
                }
            }
        }
        if reserved {
            self.keep_reserved();
        }
        Ok(at)
    }

    /// How the loop follows one changed key in place (`None`: it cannot,
    /// a read is due). `value`: the key's value as the mirror has it;
    /// `came` and `went`: the nodes come and gone in this batch.
    fn followed(
        &self,
        changed: &ChangedKey,
        value: &Option<Arc<Kv>>,
        blocks_followed: bool,
        came: &BTreeSet<&str>,
        went: &BTreeSet<&str>,
    ) -> Option<Followed> {
        let alive =
            |name: &str| (self.alive.contains(name) && !went.contains(name)) || came.contains(name);
        // A value that does not read is the read's to report.
        let readable = value.is_some() == changed.has_record();
        match changed {
            ChangedKey::Node { name, now: Some(_) } if came.contains(name.as_str()) => {
                Some(Followed::Came(name.clone()))
            }
            ChangedKey::Node { name, now: None } if went.contains(name.as_str()) => {
                Some(Followed::Gone(name.clone()))
            }
            // A node key: whether the node is alive is what the read takes
            // from it.
            ChangedKey::Node { name, now } => {
                (now.is_some() == self.alive.contains(name)).then_some(Followed::Nothing)
            }
            // A routing key of this node or another live one, not marked
            // gone (this node's is rewritten with its node key at each
            // claim): the gone-node scan waits on it whatever it holds
            // (its in-use list is read by a reclaim itself).
            ChangedKey::Routing { name, now } if *name == self.name || alive(name) => now
                .as_ref()
                .is_some_and(|r| r.gone.is_none())
                .then_some(Followed::Nothing),
            // A gone node's routing key (its mark written, or the key
            // deleted), kept by another node: a read would do nothing
            // for it here.
            ChangedKey::Routing { name, .. } => (readable
                && (self.gone.contains(name) || went.contains(name.as_str()))
                && gone_keeper_after(&self.alive, name, came, went) != Some(self.name.as_str()))
            .then_some(Followed::Nothing),
            ChangedKey::Reserved { name, now } => (*name != self.name && readable).then(|| {
                Followed::Reserved(name.clone(), now.as_ref().map(|r| r.addresses.clone()))
            }),
            // This node's own claim, as it made it: the claimed set has it
            // since the claim's answer, the fence finds it this node's,
            // and its revision is the one recorded. A read would change
            // nothing.
            ChangedKey::Block {
                at: (_, cidr),
                now: Some(b),
            } if b.held_by(&self.name, &self.instance) => (blocks_followed
                && readable
                && self.claimed.contains(cidr)
                && !self.others.contains_key(cidr)
                && self.held.unsettled.iter().all(|u| u.cidr != *cidr)
                && self
                    .held
                    .blocks
                    .iter()
                    .any(|h| h.cidr == *cidr && h.revision == b.revision && h.serves()))
            .then_some(Followed::Nothing),
            ChangedKey::Block { at: (_, cidr), now } => {
                let cidr = *cidr;
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

    /// Whether the loop's view is what a read would make of the mirror
    /// now, so claims may pick from it without one: the mirror is live
    /// and every change it holds was read or followed in place
    /// ([`ClusterNode::follow`]); etcd answered the loop's last requests;
    /// and nothing of this node's waits on a read to settle it (a claim
    /// or give-back whose answer was lost). A claim from it is as safe as
    /// one from a read: etcd creates a block's key only if absent, and a
    /// lost race reads the blocks again.
    pub(super) fn view_is_current(&self, stamp: Option<Stamp>) -> bool {
        stamp.is_some_and(|s| s.live && self.synced == Some(s))
            && self.cursor.is_some()
            && self.last_read.is_some()
            && self.handle.etcd_problem().is_none()
            && self.held.unsettled.is_empty()
            && self.held.blocks.iter().all(|b| !b.releasing)
    }

    /// Whether `cidr` overlaps a block this node holds (serving, fenced
    /// or being given back) or a claim of its whose answer never came.
    fn near_own(&self, cidr: IpNet) -> bool {
        let overlaps = |b: &IpNet| b.contains(&cidr.network()) || cidr.contains(&b.network());
        self.held.blocks.iter().any(|h| overlaps(&h.cidr))
            || self.held.unsettled.iter().any(|u| overlaps(&u.cidr))
    }
}
