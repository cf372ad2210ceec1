//! Nodes in etcd: registered under a lease, kept alive, listed. Their
//! removal is [`super::reclaim`]'s.

use std::net::IpAddr;

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};

use super::super::{ClusterStoreError, Node, NodeAddrRecord, NodeRecord};
use super::parse::*;
use super::*;

impl Door {
    /// Registers `record` under a new lease of `ttl` (whole seconds, at
    /// least 1) and returns the lease; [`Door::keep_alive`] keeps it. In
    /// the same transaction the node's routing key (`node_addrs/<name>`,
    /// its name and IPs, no lease) is written: the others keep routing
    /// its blocks there after the lease ends), with `in_use`, the
    /// addresses its pods hold (reserved in the next holder's allocator
    /// should its blocks be taken), and without a gone mark: a node back
    /// clears the one another node wrote.
    ///
    /// When `record` names its instance, the write holds only if the node
    /// key is absent or still what was read, and what was read is not
    /// another instance's (#26 item 5): two hosts under one name cannot
    /// both register, and the second is told who holds the name.
    ///
    /// # Errors
    /// [`ClusterStoreError::NameTaken`] (a live key of the name holds
    /// another instance), [`ClusterStoreError::Conflict`] (the key changed
    /// between the read and the write), or etcd unavailable.
    pub async fn register_node(
        &mut self,
        record: &NodeRecord,
        in_use: &[IpAddr],
        ttl: Duration,
    ) -> Result<i64, ClusterStoreError> {
        let secs = i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX);
        let lease = self
            // A lease granted twice: the unused one expires by itself.
            .retrying_idempotent("grant the node lease", |mut c| async move {
                c.lease_grant(secs, None).await
            })
            .await?
            .id();
        self.publish_node(record, in_use, lease).await?;
        Ok(lease)
    }

    /// Writes `record` (and the routing key, as [`Door::register_node`])
    /// under `lease`, already granted and kept alive: what a node does
    /// when what it publishes changes (its blocks, its counts), so the
    /// lease is never granted anew for that (#27 item 6). Guarded as a
    /// registration is.
    ///
    /// # Errors
    /// As [`Door::register_node`]; a lease etcd no longer knows is
    /// [`ClusterStoreError::Rejected`] (register again).
    pub async fn publish_node(
        &mut self,
        record: &NodeRecord,
        in_use: &[IpAddr],
        lease: i64,
    ) -> Result<(), ClusterStoreError> {
        let key = self.key(&format!("nodes/{}", record.name));
        let value = serde_json::to_vec(record).map_err(|e| ClusterStoreError::Corrupt {
            key: key.clone(),
            reason: e.to_string(),
        })?;
        let addr_key = self.key(&format!("{NODE_ADDRS}{}", record.name));
        let addr = NodeAddrRecord {
            name: record.name.clone(),
            ips: record.ips.clone(),
            in_use: in_use.to_vec(),
            gone: None,
        };
        let addr_value = serde_json::to_vec(&addr).map_err(|e| ClusterStoreError::Corrupt {
            key: addr_key.clone(),
            reason: e.to_string(),
        })?;
        let mut txn = Txn::new();
        if let Some(ours) = &record.instance {
            let guard = match self.live_node(&key).await? {
                None => Compare::create_revision(key.clone(), CompareOp::Equal, 0),
                Some((found, revision)) => {
                    if let Some(theirs) = found.and_then(|r| r.instance)
                        && theirs != *ours
                    {
                        return Err(ClusterStoreError::NameTaken {
                            name: record.name.clone(),
                            theirs,
                            ours: ours.clone(),
                        });
                    }
                    Compare::mod_revision(key.clone(), CompareOp::Equal, revision)
                }
            };
            txn = txn.when([guard]);
        }
        let txn = txn.and_then([
            TxnOp::put(addr_key, addr_value, None),
            TxnOp::put(
                key.clone(),
                value,
                Some(PutOptions::new().with_lease(lease)),
            ),
        ]);
        // Two puts of the same values: run twice, the same keys result
        // (the guard of the second run fails on the first run's write:
        // the key then holds this lease).
        let resp = self.txn_idempotent("register the node", &txn).await?;
        if !resp.succeeded() {
            let now = self
                .retrying("read the node key back", false, |mut c| {
                    let key = key.clone();
                    async move { c.get(key, None).await }
                })
                .await?;
            if now.kvs().first().is_none_or(|kv| kv.lease() != lease) {
                return Err(ClusterStoreError::Conflict {
                    what: format!("register node {}", record.name),
                });
            }
        }
        Ok(())
    }

    /// The node key `key` as it stands: `None` when absent, else its record
    /// (`None` when unreadable) and mod revision.
    async fn live_node(
        &self,
        key: &str,
    ) -> Result<Option<(Option<NodeRecord>, i64)>, ClusterStoreError> {
        let resp = self
            .retrying("read the node key", false, |mut c| {
                let key = key.to_string();
                async move { c.get(key, None).await }
            })
            .await?;
        Ok(resp.kvs().first().map(|kv| {
            (
                serde_json::from_slice::<NodeRecord>(kv.value()).ok(),
                kv.mod_revision(),
            )
        }))
    }

    /// The instance holding the live node key of `name`, if another than
    /// `ours` (an older build's record names none: `None`).
    ///
    /// # Errors
    /// etcd unavailable.
    pub async fn name_holder(
        &self,
        name: &str,
        ours: &str,
    ) -> Result<Option<String>, ClusterStoreError> {
        let key = self.key(&format!("nodes/{name}"));
        Ok(self
            .live_node(&key)
            .await?
            .and_then(|(r, _)| r)
            .and_then(|r| r.instance)
            .filter(|theirs| theirs != ours))
    }

    /// Refreshes `lease` once, on a keep-alive stream kept open between
    /// refreshes (#27 item 6): one message each time, where opening a
    /// stream per refresh cost etcd a whole call. A lease etcd no longer
    /// knows (expired while the node was cut off) answers `Ok(false)`:
    /// register again. A stream that fails is opened anew once within the
    /// bound (the client picks an endpoint again).
    ///
    /// # Errors
    /// etcd unavailable.
    pub async fn keep_alive(&mut self, lease: i64) -> Result<bool, ClusterStoreError> {
        let timeout = self.opts.timeout;
        let deadline = tokio::time::Instant::now() + timeout;
        let mut last = String::new();
        for _ in 0..2 {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match tokio::time::timeout(left, self.refresh_once(lease)).await {
                Ok(Ok(alive)) => return Ok(alive),
                Ok(Err(e)) => last = e.to_string(),
                Err(_) => last = "timed out".into(),
            }
            // The stream is suspect: the next try opens a new one.
            self.keepers.remove(&lease);
        }
        Err(unavailable(&self.opts, "refresh a lease", &last, true))
    }

    /// One refresh of `lease` on its stream (opened if none): whether
    /// etcd still knows the lease.
    async fn refresh_once(&mut self, lease: i64) -> Result<bool, etcd_client::Error> {
        if let Some((keeper, stream)) = self.keepers.get_mut(&lease) {
            keeper.keep_alive().await?;
            return match stream.message().await? {
                Some(r) => Ok(r.ttl() > 0),
                None => Err(etcd_client::Error::LeaseKeepAliveError(
                    "the keep-alive stream ended".into(),
                )),
            };
        }
        // Opening the stream sends one refresh and reads its answer; a
        // lease etcd no longer knows answers with a TTL of 0, which the
        // client reports as "lease not found".
        match self.client().lease_keep_alive(lease).await {
            Ok(pair) => {
                // One stream per lease this door keeps: a lease dropped
                // by its holder closes with the next one's.
                self.keepers.retain(|l, _| *l == lease);
                self.keepers.insert(lease, pair);
                Ok(true)
            }
            Err(etcd_client::Error::LeaseKeepAliveError(m)) if m.contains("lease not found") => {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Every registered (live) node. A key whose name or record this
    /// build cannot read is skipped and kept in [`Door::unreadable`].
    /// Shared, not copied, while no node key changes.
    ///
    /// # Errors
    /// etcd unavailable.
    pub async fn nodes(&mut self) -> Result<Arc<Vec<Node>>, ClusterStoreError> {
        self.read_area("read nodes", "nodes/", parse_node, |record, _, lease| {
            Node { record, lease }
        })
        .await
    }

    /// Every node's routing key (`node_addrs/<name>`: where its blocks
    /// are routed, whether or not its lease lives), each with its key's
    /// mod revision (a gone mark or a reclaim compares it). A key whose
    /// name or record this build cannot read (a name that is not the
    /// record's, no address, an address no route can go via) is skipped
    /// and kept in [`Door::unreadable`]. Shared, not copied, while no
    /// routing key changes.
    ///
    /// # Errors
    /// etcd unavailable.
    pub async fn routing_keys(
        &mut self,
    ) -> Result<Arc<Vec<(NodeAddrRecord, i64)>>, ClusterStoreError> {
        self.read_area(
            "read node addresses",
            NODE_ADDRS,
            parse_node_addr,
            |record, revision, _| (record, revision),
        )
        .await
    }
}
