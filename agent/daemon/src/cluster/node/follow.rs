//! The claim loop's way through most cluster changes without a read
//! (#47 item 2). A read takes every block, node, routing key and
//! reservation again and decides owners, fences, overlaps and gone
//! nodes from all of them: at 5,000 nodes that is milliseconds, for each
//! of the changes every node sees all the time. These kinds decide
//! nothing a read would decide differently, and are followed per key
//! instead:
//! - a live node's keys rewritten (its counts published), with no node
//!   come or gone and none marked gone: nothing to do;
//! - another node's block claimed or given back, away from every block
//!   this node holds or has a claim in doubt for: the set of claimed
//!   blocks and the other nodes' blocks change in place. No fence can
//!   follow (a fence concerns this node's blocks only), no claim waits
//!   on it, and without configured pools no overlap can come or go;
//! - another node come (its node key written, the name not yet alive),
//!   while the last read found no gone node: it joins the live set.
//!   With no gone node, which live node keeps a gone one
//!   (`gone_keeper`) decides nothing, and a coming node changes no
//!   block, pool or reservation. At a cluster's bring-up every node sees
//!   every other come: a read for each made that quadratic per node.
//!
//! - another node gone (its node key deleted) while no other gone node
//!   is known, when this node is not the one to keep it (`gone_keeper`
//!   over the live set without it): it leaves the live set, and a gone
//!   node is known from then on. Its keeper reads, to mark it gone.
//! - a gone node's routing key written (its gone mark) or deleted, when
//!   this node does not keep it: nothing to do, as a read would do
//!   nothing for it.
//! - another node's reservations (`reserved/<node>`, written when its
//!   blocks are reclaimed): the kept reservations change, and the
//!   addresses kept out of the allocator with them.
//!
//! Without these three, a node's death made every node of the cluster
//! read it whole three times (gone, marked, reclaimed).
//!
//! Anything else (a pool, this node's own reservations, two nodes gone at
//! once or one while another is known, a node come while a gone node is
//! known, the death of a node this node keeps, a value this build cannot
//! read, this node's own keys or blocks) is left to the read.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use lockstep_core::cluster::gone_keeper_without;

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
        // The live nodes gone in this batch (their key deleted, not
        // unreadable): one, while no other gone node is known and none
        // came, is followed unless this node keeps it.
        let went: Vec<&str> = changed
            .iter()
            .filter_map(|(c, value)| match c {
                ChangedKey::Node { name, now: None }
                    if value.is_none() && *name != self.name && self.alive.contains(name) =>
                {
                    Some(name.as_str())
                }
                _ => None,
            })
            .collect();
        let went = match went[..] {
            [] => None,
            [one]
                if !self.gone_known
                    && came.is_empty()
                    && gone_keeper_without(&self.alive, one, Some(one)) != Some(&self.name) =>
            {
                Some(one)
            }
            _ => return Err(Some(at)),
        };
        let mut followed = Vec::with_capacity(changed.len());
        for (c, value) in &changed {
            match self.followed(c, value, blocks_followed, &came, went) {
                Some(f) => followed.push(f),
                None => return Err(Some(at)),
            }
        }
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
                    self.gone_known = true;
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
    /// `came` and `went`: the nodes come and gone in this batch that are
    /// followed.
    fn followed(
        &self,
        changed: &ChangedKey,
        value: &Option<Arc<Kv>>,
        blocks_followed: bool,
        came: &BTreeSet<&str>,
        went: Option<&str>,
    ) -> Option<Followed> {
        let alive =
            |name: &str| (self.alive.contains(name) && went != Some(name)) || came.contains(name);
        // A value that does not read is the read's to report.
        let readable = value.is_some() == changed.has_record();
        match changed {
            ChangedKey::Node { name, now: Some(_) } if came.contains(name.as_str()) => {
                Some(Followed::Came(name.clone()))
            }
            ChangedKey::Node { name, now: None } if went == Some(name.as_str()) => {
                Some(Followed::Gone(name.clone()))
            }
            // A node key: whether the node is alive is what the read takes
            // from it.
            ChangedKey::Node { name, now } => {
                (now.is_some() == self.alive.contains(name)).then_some(Followed::Nothing)
            }
            // A routing key of another live node, not marked gone: the
            // gone-node scan waits on it whatever it holds (its in-use
            // list is read by a reclaim itself).
            ChangedKey::Routing { name, now } if *name != self.name && alive(name) => now
                .as_ref()
                .is_some_and(|r| r.gone.is_none())
                .then_some(Followed::Nothing),
            // A gone node's routing key (its mark written, or the key
            // deleted), known gone, kept by another node: a read would do
            // nothing for it here.
            ChangedKey::Routing { name, .. } => (*name != self.name
                && readable
                && (self.gone_known || went == Some(name.as_str()))
                && gone_keeper_without(&self.alive, name, went) != Some(self.name.as_str()))
            .then_some(Followed::Nothing),
            ChangedKey::Reserved { name, now } => (*name != self.name && readable).then(|| {
                Followed::Reserved(name.clone(), now.as_ref().map(|r| r.addresses.clone()))
            }),
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

    /// Whether `cidr` overlaps a block this node holds (serving, fenced
    /// or being given back) or a claim of its whose answer never came.
    fn near_own(&self, cidr: IpNet) -> bool {
        let overlaps = |b: &IpNet| b.contains(&cidr.network()) || cidr.contains(&b.network());
        self.held.blocks.iter().any(|h| overlaps(&h.cidr))
            || self.held.unsettled.iter().any(|u| overlaps(&u.cidr))
    }
}
