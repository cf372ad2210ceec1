//! Changes under the prefix as they happen: what every agent follows to
//! learn where the other nodes' blocks live and who is alive.

use etcd_client::{EventType, WatchStream};
use ipnet::IpNet;
use lockstep_core::cluster::{ClusterPoolSpec, key_name_problem};

use super::door::Door;
use super::door::{NODE_ADDRS, parse_node_addr};
use super::{BlockRecord, ClusterStoreError, NodeAddrRecord, NodeRecord, unescape};

/// One change under the prefix. `None` means the key was deleted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// A pool written or removed.
    Pool {
        /// Its name.
        name: String,
        /// The new spec.
        spec: Option<ClusterPoolSpec>,
    },
    /// A block claimed or given back.
    Block {
        /// Its pool.
        pool: String,
        /// Its prefix.
        cidr: IpNet,
        /// Its new holder.
        node: Option<String>,
        /// The revision of the change.
        revision: i64,
    },
    /// A node registered, updated, or gone (its lease expired or revoked).
    Node {
        /// Its name.
        name: String,
        /// What it published.
        record: Option<NodeRecord>,
    },
    /// A node's routing key written (at its registration) or deleted (by
    /// `cluster node remove`): where its blocks are routed, lease or not.
    NodeAddr {
        /// Its name.
        name: String,
        /// Its addresses.
        record: Option<NodeAddrRecord>,
    },
}

/// A watch of everything under the door's prefix.
pub struct Watch {
    stream: WatchStream,
    prefix: String,
    next: i64,
}

impl std::fmt::Debug for Watch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watch")
            .field("prefix", &self.prefix)
            .field("next", &self.next)
            .finish()
    }
}

impl Door {
    /// Watches every key under the prefix from revision `from` (inclusive):
    /// `from` is one past the revision of the read the caller's state came
    /// from, so nothing between the read and the watch is missed.
    ///
    /// The watch starts one revision earlier, at `from - 1`, whose changes
    /// the caller has seen (they come again; every change states a key's
    /// whole value, so a repeat changes nothing). That is how a compaction
    /// at exactly `from` shows: etcd accepts a watch from the compaction
    /// revision but has dropped the deletions made at it, so a watch from
    /// `from` would miss a block or node deleted then; from `from - 1` it
    /// is refused as compacted, and the caller reads everything again.
    ///
    /// # Errors
    /// etcd unavailable.
    pub async fn watch(&mut self, from: i64) -> Result<Watch, ClusterStoreError> {
        let prefix = self.options().prefix.clone();
        let stream = self.watch_raw(from).await?;
        Ok(Watch {
            stream,
            prefix,
            next: from,
        })
    }
}

impl Watch {
    /// The revision to resume from after the changes returned so far.
    pub fn resume_from(&self) -> i64 {
        self.next
    }

    /// Waits for the next batch of changes (possibly empty: a progress
    /// notification).
    ///
    /// # Errors
    /// [`ClusterStoreError::Compacted`] when the history asked for is gone
    /// (resync), [`ClusterStoreError::RolledBack`] when etcd's revision is
    /// below one already seen (a restore: resync), or [`ClusterStoreError::Unavailable`] when the stream broke
    /// (watch again from [`Watch::resume_from`]). A change this build
    /// cannot read is skipped (logged).
    pub async fn next(&mut self) -> Result<Vec<Change>, ClusterStoreError> {
        let broke = |why: String| ClusterStoreError::Unavailable {
            endpoints: String::new(),
            what: format!("watch of {}: {why}", self.prefix),
            maybe_written: false,
        };
        let resp = loop {
            let msg = self.stream.message().await;
            // Every answer carries the store's revision: below one already
            // seen, etcd went back in time (a restore), and this watch,
            // resumed past it, would miss everything written below the
            // revision it waits for.
            if let Ok(Some(r)) = &msg
                && let Some(now) = r.header().map(|h| h.revision())
                && now > 0
                && now < self.next - 1
            {
                return Err(ClusterStoreError::RolledBack {
                    seen: self.next - 1,
                    now,
                });
            }
            match msg {
                // The watch's creation is acknowledged with no events; a
                // refusal (compaction) follows it.
                Ok(Some(r)) if r.created() && !r.canceled() && r.events().is_empty() => {}
                Ok(Some(r)) => break r,
                Ok(None) => return Err(broke("the stream ended".into())),
                Err(e) => return Err(broke(e.to_string())),
            }
        };
        if resp.compact_revision() > 0 {
            return Err(ClusterStoreError::Compacted {
                compacted: resp.compact_revision(),
            });
        }
        if resp.canceled() {
            return Err(broke(format!("cancelled: {}", resp.cancel_reason())));
        }
        let mut out = Vec::new();
        for event in resp.events() {
            let Some(kv) = event.kv() else { continue };
            let key = String::from_utf8_lossy(kv.key()).into_owned();
            let deleted = matches!(event.event_type(), EventType::Delete);
            self.next = self.next.max(kv.mod_revision() + 1);
            // A key this build cannot read is skipped, as the reads skip
            // it (`Door::unreadable`): failing here made every follower
            // re-read and watch again, forever.
            match parse(&self.prefix, &key, kv.value(), deleted, kv.mod_revision()) {
                Ok(Some(change)) => out.push(change),
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "watch: an unreadable change is skipped");
                }
            }
        }
        if let Some(h) = resp.header() {
            self.next = self.next.max(h.revision() + 1);
        }
        Ok(out)
    }
}

fn parse(
    prefix: &str,
    key: &str,
    value: &[u8],
    deleted: bool,
    revision: i64,
) -> Result<Option<Change>, ClusterStoreError> {
    let corrupt = |reason: String| ClusterStoreError::Corrupt {
        key: key.to_string(),
        reason,
    };
    let rest = key.strip_prefix(prefix).unwrap_or(key);
    let json = |what: &str| -> Result<serde_json::Value, ClusterStoreError> {
        serde_json::from_slice(value).map_err(|e| corrupt(format!("{what}: {e}")))
    };
    let named = |what: &str, name: &str| match key_name_problem(name) {
        Some(why) => Err(corrupt(format!("{what} name {name:?}: {why}"))),
        None => Ok(()),
    };
    Ok(if let Some(name) = rest.strip_prefix("pools/") {
        named("pool", name)?;
        Some(Change::Pool {
            name: name.to_string(),
            spec: if deleted {
                None
            } else {
                Some(serde_json::from_value(json("pool")?).map_err(|e| corrupt(e.to_string()))?)
            },
        })
    } else if let Some(block) = rest.strip_prefix("blocks/") {
        let (pool, cidr) = block
            .split_once('/')
            .ok_or_else(|| corrupt("not blocks/<pool>/<cidr>".into()))?;
        named("pool", pool)?;
        let cidr = unescape(cidr).ok_or_else(|| corrupt(format!("{cidr:?} is not a CIDR")))?;
        let node = if deleted {
            None
        } else {
            let rec: BlockRecord =
                serde_json::from_value(json("block")?).map_err(|e| corrupt(e.to_string()))?;
            Some(rec.node)
        };
        Some(Change::Block {
            pool: pool.to_string(),
            cidr,
            node,
            revision,
        })
    } else if let Some(name) = rest.strip_prefix("nodes/") {
        named("node", name)?;
        Some(Change::Node {
            name: name.to_string(),
            record: if deleted {
                None
            } else {
                Some(serde_json::from_value(json("node")?).map_err(|e| corrupt(e.to_string()))?)
            },
        })
    } else if let Some(name) = rest.strip_prefix(NODE_ADDRS) {
        named("node", name)?;
        Some(Change::NodeAddr {
            name: name.to_string(),
            record: if deleted {
                None
            } else {
                let area = format!("{prefix}{NODE_ADDRS}");
                Some(parse_node_addr(&area, key, value).map_err(corrupt)?)
            },
        })
    } else {
        // Not a key of this layout (another version's, or an operator's).
        None
    })
}
