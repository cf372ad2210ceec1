//! Keys the mirror says changed, read one by one as their area's full
//! read reads them: what lets a task follow the cluster per changed key
//! (#47 item 2) instead of reading whole areas on every change.

use ipnet::IpNet;

use super::super::mirror::{Changes, Cursor};
use super::super::{Block, NodeAddrRecord, NodeRecord, ReservedRecord};
use super::parse::{block_key_name, parse_block, parse_node, parse_node_addr, parse_reserved};
use super::reclaim::RESERVED;
use super::*;

/// One changed key, read. A value this build cannot read counts as no
/// value, as a full read skips it (and reports it: [`Door::unreadable`]).
#[derive(Debug)]
pub enum ChangedKey {
    /// A block key: the block now (`None`: given back, or unreadable).
    Block {
        /// The block's pool and prefix, from the key.
        at: (String, IpNet),
        /// The block.
        now: Option<Block>,
    },
    /// A node key (`nodes/<name>`).
    Node {
        /// The node.
        name: String,
        /// Its record now.
        now: Option<NodeRecord>,
    },
    /// A routing key (`node_addrs/<name>`).
    Routing {
        /// The node.
        name: String,
        /// Its record now.
        now: Option<NodeAddrRecord>,
    },
    /// A reservation key (`reserved/<name>`): the addresses a node's
    /// pods may still hold outside its blocks.
    Reserved {
        /// The node.
        name: String,
        /// Its record now.
        now: Option<ReservedRecord>,
    },
    /// A key under `pools/` (read the pools whole: they are few).
    Pool,
    /// Any other key, or one whose name this build cannot read.
    Other,
}

impl ChangedKey {
    /// Whether the key's record was read (`false`: deleted, or its value
    /// unreadable): against the mirror's value, tells an unreadable one.
    #[must_use]
    pub fn has_record(&self) -> bool {
        match self {
            ChangedKey::Block { now, .. } => now.is_some(),
            ChangedKey::Node { now, .. } => now.is_some(),
            ChangedKey::Routing { now, .. } => now.is_some(),
            ChangedKey::Reserved { now, .. } => now.is_some(),
            ChangedKey::Pool | ChangedKey::Other => true,
        }
    }
}

impl Door {
    /// What changed under `areas` since `since`, from the agent's mirror
    /// ([`super::super::Mirror::changes`]); `None` without a live mirror.
    pub fn changes(&self, areas: &[&str], since: Option<Cursor>) -> Option<(Changes, Cursor)> {
        self.opts.link.as_ref()?.mirror().changes(areas, since)
    }

    /// Reads `key`, which the mirror says is now `now` (`None`: deleted).
    /// The parsed record is the one a full read of its area keeps with
    /// the key, so neither parses it twice.
    pub fn read_changed(&self, key: &str, now: Option<&Kv>) -> ChangedKey {
        let area = |rest: &str| {
            let prefix = self.key(rest);
            let name = key.strip_prefix(&prefix).map(str::to_string);
            (prefix, name)
        };
        if let (prefix, Some(_)) = area("blocks/") {
            let Ok(at) = block_key_name(&prefix, key) else {
                return ChangedKey::Other;
            };
            let now = now.and_then(|kv| {
                kv.parse_once("blocks/", |kv| {
                    parse_block(&prefix, &kv.key, &kv.value, kv.mod_revision)
                })
                .ok()
            });
            return ChangedKey::Block { at, now };
        }
        if let (prefix, Some(name)) = area("nodes/") {
            let now = now.and_then(|kv| {
                kv.parse_once("nodes/", |kv| parse_node(&prefix, &kv.key, &kv.value))
                    .ok()
            });
            return ChangedKey::Node { name, now };
        }
        if let (prefix, Some(name)) = area(NODE_ADDRS) {
            let now = now.and_then(|kv| {
                kv.parse_once(NODE_ADDRS, |kv| {
                    parse_node_addr(&prefix, &kv.key, &kv.value)
                })
                .ok()
            });
            return ChangedKey::Routing { name, now };
        }
        if let (prefix, Some(name)) = area(RESERVED) {
            let now = now.and_then(|kv| {
                kv.parse_once(RESERVED, |kv| parse_reserved(&prefix, &kv.key, &kv.value))
                    .ok()
            });
            return ChangedKey::Reserved { name, now };
        }
        if let (_, Some(_)) = area("pools/") {
            return ChangedKey::Pool;
        }
        ChangedKey::Other
    }
}
