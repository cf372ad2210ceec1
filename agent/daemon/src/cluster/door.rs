//! The etcd requests of cluster mode, each bounded in time and guarded.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use std::path::{Path, PathBuf};

use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, GetOptions, GetResponse, Identity,
    PutOptions, TlsOptions, Txn, TxnOp, TxnOpResponse,
};
use ipnet::IpNet;
use lockstep_core::cluster::{ClusterPoolSpec, check_apply};

use super::{Block, BlockRecord, Claim, ClusterStoreError, Node, NodeRecord, escape, unescape};

/// How the door reaches etcd.
#[derive(Clone, Debug)]
pub struct DoorOptions {
    /// Client URLs of the etcd members (`http://127.0.0.1:2379`).
    pub endpoints: Vec<String>,
    /// Key prefix, ending in `/` (default `/lockstep/v1/`).
    pub prefix: String,
    /// Bound on every request, connection included.
    pub timeout: Duration,
    /// TLS to etcd (`https://` endpoints), or `None` for plain `http://`.
    pub tls: Option<TlsFiles>,
}

/// The PEM files of TLS to etcd: the CA that signed etcd's serving
/// certificates and, when etcd checks clients (`--client-cert-auth`), the
/// agent's own certificate and key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// CA certificate(s) trusted for etcd's server certificates.
    pub ca: PathBuf,
    /// Client certificate; given with `key` or not at all.
    pub cert: Option<PathBuf>,
    /// The client certificate's private key.
    pub key: Option<PathBuf>,
}

impl TlsFiles {
    /// Reads and checks the files: each must exist and hold the PEM block
    /// it should, and a certificate comes with its key.
    ///
    /// # Errors
    /// [`ClusterStoreError::Invalid`] naming the option and the file.
    pub fn load(&self) -> Result<TlsOptions, ClusterStoreError> {
        let ca = read_pem("cluster.tls.ca", &self.ca, "CERTIFICATE")?;
        let mut tls = TlsOptions::new().ca_certificate(Certificate::from_pem(ca));
        match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => {
                let cert = read_pem("cluster.tls.cert", cert, "CERTIFICATE")?;
                let key = read_pem("cluster.tls.key", key, "PRIVATE KEY")?;
                tls = tls.identity(Identity::from_pem(cert, key));
            }
            (None, None) => {}
            (Some(_), None) => {
                return Err(ClusterStoreError::Invalid(
                    "cluster.tls.cert is given without cluster.tls.key".into(),
                ));
            }
            (None, Some(_)) => {
                return Err(ClusterStoreError::Invalid(
                    "cluster.tls.key is given without cluster.tls.cert".into(),
                ));
            }
        }
        Ok(tls)
    }
}

/// The bytes of a PEM file that must hold a `-----BEGIN ...{kind}-----`
/// block.
fn read_pem(option: &str, path: &Path, kind: &str) -> Result<Vec<u8>, ClusterStoreError> {
    let bytes = std::fs::read(path)
        .map_err(|e| ClusterStoreError::Invalid(format!("{option} {}: {e}", path.display())))?;
    let text = String::from_utf8_lossy(&bytes);
    let found = text
        .lines()
        .any(|l| l.starts_with("-----BEGIN ") && l.ends_with(&format!("{kind}-----")));
    if !found {
        return Err(ClusterStoreError::Invalid(format!(
            "{option} {}: no PEM {kind} in it",
            path.display()
        )));
    }
    Ok(bytes)
}

impl DoorOptions {
    /// Options with the default prefix and a 2 s bound.
    pub fn new(endpoints: Vec<String>) -> Self {
        DoorOptions {
            endpoints,
            prefix: "/lockstep/v1/".to_string(),
            timeout: Duration::from_secs(2),
            tls: None,
        }
    }

    /// Options from the `[cluster]` section (endpoints, prefix, TLS
    /// files), each request bounded by `timeout`: the agent's tasks (node,
    /// remote routes, LB) share it, each with its own bound.
    pub fn from_cluster_config(cluster: &crate::config::ClusterConfig, timeout: Duration) -> Self {
        DoorOptions {
            endpoints: cluster.etcd.clone(),
            prefix: cluster.prefix.clone(),
            timeout,
            tls: cluster.tls.as_ref().map(|t| TlsFiles {
                ca: t.ca.clone(),
                cert: t.cert.clone(),
                key: t.key.clone(),
            }),
        }
    }
}

/// A connection to etcd and the key layout under the prefix.
pub struct Door {
    client: Client,
    opts: DoorOptions,
}

impl std::fmt::Debug for Door {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Door").field("opts", &self.opts).finish()
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Door {
    /// Connects (lazily: the first request dials) to `opts.endpoints`.
    ///
    /// # Errors
    /// No endpoint, a prefix that does not start and end with `/`, or an
    /// unusable endpoint URL.
    pub async fn connect(opts: DoorOptions) -> Result<Self, ClusterStoreError> {
        if opts.endpoints.is_empty() {
            return Err(ClusterStoreError::Invalid(
                "cluster.etcd lists no endpoint".into(),
            ));
        }
        if !(opts.prefix.starts_with('/') && opts.prefix.ends_with('/')) {
            return Err(ClusterStoreError::Invalid(format!(
                "cluster.prefix {:?} must start and end with /",
                opts.prefix
            )));
        }
        // The scheme and the TLS files agree: a plain endpoint with TLS
        // configured (or the reverse) is a mistake, not a fallback.
        let want = if opts.tls.is_some() {
            "https://"
        } else {
            "http://"
        };
        if let Some(bad) = opts.endpoints.iter().find(|e| !e.starts_with(want)) {
            return Err(ClusterStoreError::Invalid(format!(
                "cluster.etcd endpoint {bad:?} must start with {want}{}",
                if opts.tls.is_some() {
                    " (cluster.tls is given)"
                } else {
                    " (https needs cluster.tls.ca)"
                }
            )));
        }
        let mut options = ConnectOptions::new()
            .with_connect_timeout(opts.timeout)
            .with_timeout(opts.timeout)
            .with_require_leader(true);
        if let Some(tls) = &opts.tls {
            options = options.with_tls(tls.load()?);
        }
        let client = tokio::time::timeout(
            opts.timeout,
            Client::connect(opts.endpoints.clone(), Some(options)),
        )
        .await
        .map_err(|_| unavailable(&opts, "connect", "timed out", false))?
        .map_err(|e| unavailable(&opts, "connect", &e.to_string(), false))?;
        Ok(Door { client, opts })
    }

    /// The options the door was made with.
    pub fn options(&self) -> &DoorOptions {
        &self.opts
    }

    /// A handle on the connection (cheap: shares the channel).
    pub(super) fn client(&self) -> Client {
        self.client.clone()
    }

    fn key(&self, rest: &str) -> String {
        format!("{}{rest}", self.opts.prefix)
    }

    fn block_key(&self, pool: &str, cidr: IpNet) -> String {
        self.key(&format!("blocks/{pool}/{}", escape(cidr)))
    }

    /// Runs one request within the door's timeout.
    pub(super) async fn bounded<T>(
        &self,
        what: &str,
        write: bool,
        request: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, ClusterStoreError> {
        match tokio::time::timeout(self.opts.timeout, request).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(unavailable(&self.opts, what, &e.to_string(), write)),
            Err(_) => Err(unavailable(&self.opts, what, "timed out", write)),
        }
    }

    /// Runs one request within the door's timeout, made again (the client
    /// picks an endpoint anew) when it failed without effect: for reads
    /// (`write` false) on any transient failure, for writes only when no
    /// connection could be made to the member it was routed to (such a
    /// request never left the node). Without this, every request the
    /// client's balancer routed to a stopped member failed: one member down
    /// out of three failed a third of them.
    pub(super) async fn retrying<T, F, Fut>(
        &self,
        what: &str,
        write: bool,
        request: F,
    ) -> Result<T, ClusterStoreError>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let again = if write { never_sent } else { transient };
        self.bounded(what, write, self.attempts(again, request))
            .await
    }

    /// As [`Door::retrying`], for a write whose repetition does what one
    /// does (a lease refresh, a put of the same value, a transaction whose
    /// compare makes a second run a no-op the caller recognises): made
    /// again on any transient failure.
    pub(super) async fn retrying_idempotent<T, F, Fut>(
        &self,
        what: &str,
        request: F,
    ) -> Result<T, ClusterStoreError>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        self.bounded(what, true, self.attempts(transient, request))
            .await
    }

    /// Up to two tries per endpoint and one more, while `again` says the
    /// failure may be tried again.
    async fn attempts<T, F, Fut>(
        &self,
        again: fn(&etcd_client::Error) -> bool,
        mut request: F,
    ) -> Result<T, etcd_client::Error>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let attempts = self.opts.endpoints.len() * 2 + 1;
        let mut result = request(self.client.clone()).await;
        for _ in 1..attempts {
            match &result {
                Err(e) if again(e) => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    result = request(self.client.clone()).await;
                }
                _ => break,
            }
        }
        result
    }

    /// Every key under `prefix/` (one read), and the store revision of it.
    async fn list(&self, what: &str, rest: &str) -> Result<(GetResponse, i64), ClusterStoreError> {
        let key = self.key(rest);
        let resp = self
            .retrying(what, false, |mut c| {
                let key = key.clone();
                async move { c.get(key, Some(GetOptions::new().with_prefix())).await }
            })
            .await?;
        let revision = resp.header().map_or(0, |h| h.revision());
        Ok((resp, revision))
    }

    /// Every cluster pool, with each key's mod revision, and the store
    /// revision of the read.
    ///
    /// # Errors
    /// etcd unavailable, or a stored pool unreadable.
    pub async fn pools(
        &mut self,
    ) -> Result<(Vec<ClusterPoolSpec>, BTreeMap<String, i64>, i64), ClusterStoreError> {
        let (resp, revision) = self.list("read pools", "pools/").await?;
        let mut specs = Vec::new();
        let mut revisions = BTreeMap::new();
        for kv in resp.kvs() {
            let key = String::from_utf8_lossy(kv.key()).into_owned();
            let spec: ClusterPoolSpec =
                serde_json::from_slice(kv.value()).map_err(|e| ClusterStoreError::Corrupt {
                    key: key.clone(),
                    reason: e.to_string(),
                })?;
            revisions.insert(spec.name.clone(), kv.mod_revision());
            specs.push(spec);
        }
        Ok((specs, revisions, revision))
    }

    /// Replaces the cluster pools by `new`: validated and checked against
    /// the claimed blocks by the core ([`check_apply`]) and against the LB
    /// pools, then written in
    /// one transaction that holds only if no pool and no block changed since
    /// they were read. Returns the new store revision.
    ///
    /// # Errors
    /// [`ClusterStoreError::Refused`] (invalid pools, overlap, a CIDR with
    /// claimed blocks removed or re-cut: named with its blocks and nodes),
    /// [`ClusterStoreError::Invalid`] (a pool overlapping an LB pool, both
    /// named),
    /// [`ClusterStoreError::Conflict`] (a concurrent change: nothing
    /// written), or etcd unavailable.
    pub async fn apply_pools(&mut self, new: &[ClusterPoolSpec]) -> Result<i64, ClusterStoreError> {
        let (old, revisions, read_at) = self.pools().await?;
        let (blocks, blocks_at) = self.blocks().await?;
        let claimed: BTreeMap<IpNet, (String, String)> = blocks
            .iter()
            .map(|b| (b.cidr, (b.pool.clone(), b.node.clone())))
            .collect();
        check_apply(&old, new, &claimed)?;
        // No endpoint pool may share an address with an LB pool.
        let (lb_pools, lb_pools_at) = self.list("read lb pools", "lb/pools/").await?;
        for kv in lb_pools.kvs() {
            let lb: lockstep_core::lb::LbPoolSpec =
                serde_json::from_slice(kv.value()).map_err(|e| ClusterStoreError::Corrupt {
                    key: String::from_utf8_lossy(kv.key()).into_owned(),
                    reason: e.to_string(),
                })?;
            lockstep_core::lb::check_against_cluster_pools(&lb, new)
                .map_err(|e| ClusterStoreError::Invalid(e.to_string()))?;
        }
        let mut guards = Vec::new();
        let mut ops = Vec::new();
        for spec in new {
            let key = self.key(&format!("pools/{}", spec.name));
            guards.push(match revisions.get(&spec.name) {
                Some(&rev) => Compare::mod_revision(key.clone(), CompareOp::Equal, rev),
                None => Compare::create_revision(key.clone(), CompareOp::Equal, 0),
            });
            let value = serde_json::to_vec(spec).map_err(|e| ClusterStoreError::Corrupt {
                key: key.clone(),
                reason: e.to_string(),
            })?;
            ops.push(TxnOp::put(key, value, None));
        }
        for (name, &rev) in &revisions {
            if !new.iter().any(|p| &p.name == name) {
                let key = self.key(&format!("pools/{name}"));
                guards.push(Compare::mod_revision(key.clone(), CompareOp::Equal, rev));
                ops.push(TxnOp::delete(key, None));
            }
        }
        // No pool written since the read (a pool this apply does not name
        // but another apply created meanwhile would otherwise survive it),
        // no LB pool since they were checked, and no block claimed or
        // changed since the blocks were read.
        guards.push(
            Compare::mod_revision(self.key("pools/"), CompareOp::Less, read_at + 1).with_prefix(),
        );
        guards.push(
            Compare::mod_revision(self.key("lb/pools/"), CompareOp::Less, lb_pools_at + 1)
                .with_prefix(),
        );
        guards.push(
            Compare::mod_revision(
                self.key("blocks/"),
                CompareOp::Less,
                blocks_at.max(read_at) + 1,
            )
            .with_prefix(),
        );
        let txn = Txn::new().when(guards).and_then(ops);
        let resp = self
            .retrying("apply pools", true, |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await?;
        if !resp.succeeded() {
            return Err(ClusterStoreError::Conflict {
                what: "the cluster pools".into(),
            });
        }
        Ok(resp.header().map_or(0, |h| h.revision()))
    }

    /// Every claimed block, and the store revision of the read.
    ///
    /// # Errors
    /// etcd unavailable, or a block key or value unreadable.
    pub async fn blocks(&mut self) -> Result<(Vec<Block>, i64), ClusterStoreError> {
        let prefix = self.key("blocks/");
        let (resp, revision) = self.list("read blocks", "blocks/").await?;
        let mut out = Vec::new();
        for kv in resp.kvs() {
            let key = String::from_utf8_lossy(kv.key()).into_owned();
            out.push(parse_block(&prefix, &key, kv.value(), kv.mod_revision())?);
        }
        Ok((out, revision))
    }

    /// Claims `cidr` of `pool` for `node`: created only if no one holds it.
    /// An answer that does not come in time is read back: the claim may
    /// have been logged and committed (or may commit once quorum returns).
    ///
    /// # Errors
    /// etcd unavailable (with `maybe_written` when even the read-back
    /// failed: the caller must count the block as possibly its own), or a
    /// stored value unreadable.
    pub async fn claim_block(
        &mut self,
        pool: &str,
        cidr: IpNet,
        node: &str,
    ) -> Result<Claim, ClusterStoreError> {
        let key = self.block_key(pool, cidr);
        let record = BlockRecord {
            node: node.to_string(),
            claimed_at_ms: now_ms(),
        };
        let value = serde_json::to_vec(&record).map_err(|e| ClusterStoreError::Corrupt {
            key: key.clone(),
            reason: e.to_string(),
        })?;
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key.clone(), value, None)])
            .or_else([TxnOp::get(key.clone(), None)]);
        let what = format!("claim block {cidr} of pool {pool}");
        // Run twice, the create-if-absent finds the key ours: claimed.
        let sent = self.retrying_idempotent(&what, |mut c| {
            let txn = txn.clone();
            async move { c.txn(txn).await }
        });
        match sent.await {
            Ok(resp) if resp.succeeded() => Ok(Claim::Claimed {
                revision: resp.header().map_or(0, |h| h.revision()),
            }),
            Ok(resp) => {
                let holder = resp.op_responses().into_iter().find_map(|r| match r {
                    TxnOpResponse::Get(g) => g
                        .kvs()
                        .first()
                        .map(|kv| (kv.value().to_vec(), kv.mod_revision())),
                    _ => None,
                });
                match holder {
                    // Ours already (a restart re-claiming): claimed at its revision.
                    Some((v, rev)) => self.claim_of(&key, &v, node, rev),
                    // Given back between the compare and the get: try again.
                    None => Err(ClusterStoreError::Conflict { what }),
                }
            }
            Err(ClusterStoreError::Unavailable { .. }) => self.read_back_claim(&key, node).await,
            Err(e) => Err(e),
        }
    }

    async fn read_back_claim(&mut self, key: &str, node: &str) -> Result<Claim, ClusterStoreError> {
        let what = format!("read back the claim {key}");
        let resp = self
            .retrying(&what, false, |mut c| {
                let key = key.to_string();
                async move { c.get(key, None).await }
            })
            .await
            .map_err(|e| match e {
                ClusterStoreError::Unavailable {
                    endpoints, what, ..
                } => ClusterStoreError::Unavailable {
                    endpoints,
                    what,
                    maybe_written: true,
                },
                other => other,
            })?;
        match resp.kvs().first() {
            Some(kv) => self.claim_of(key, kv.value(), node, kv.mod_revision()),
            None => Err(unavailable(
                &self.opts,
                &format!("claim {key}"),
                "the claim timed out and is not stored (yet); it may still commit",
                true,
            )),
        }
    }

    fn claim_of(
        &self,
        key: &str,
        value: &[u8],
        node: &str,
        revision: i64,
    ) -> Result<Claim, ClusterStoreError> {
        let rec: BlockRecord =
            serde_json::from_slice(value).map_err(|e| ClusterStoreError::Corrupt {
                key: key.to_string(),
                reason: e.to_string(),
            })?;
        Ok(if rec.node == node {
            Claim::Claimed { revision }
        } else {
            Claim::Taken { by: rec.node }
        })
    }

    /// Gives `block` back: deleted only if its key is still at the revision
    /// the caller holds (an operator's reclaim and another node's claim
    /// meanwhile change it). Returns whether it was deleted.
    ///
    /// # Errors
    /// etcd unavailable.
    pub async fn release_block(&mut self, block: &Block) -> Result<bool, ClusterStoreError> {
        let key = self.block_key(&block.pool, block.cidr);
        let txn = Txn::new()
            .when([Compare::mod_revision(
                key.clone(),
                CompareOp::Equal,
                block.revision,
            )])
            .and_then([TxnOp::delete(key, None)]);
        let what = format!("give back block {} of pool {}", block.cidr, block.pool);
        // Run twice, the revision compare fails on the deleted key: the
        // caller forgets the block either way.
        Ok(self
            .retrying_idempotent(&what, |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await?
            .succeeded())
    }

    /// Registers `record` under a new lease of `ttl` (whole seconds, at
    /// least 1) and returns the lease; [`Door::keep_alive`] keeps it.
    ///
    /// # Errors
    /// etcd unavailable.
    pub async fn register_node(
        &mut self,
        record: &NodeRecord,
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
        let key = self.key(&format!("nodes/{}", record.name));
        let value = serde_json::to_vec(record).map_err(|e| ClusterStoreError::Corrupt {
            key: key.clone(),
            reason: e.to_string(),
        })?;
        self.retrying_idempotent("register the node", |mut c| {
            let (key, value) = (key.clone(), value.clone());
            async move {
                c.put(key, value, Some(PutOptions::new().with_lease(lease)))
                    .await
            }
        })
        .await?;
        Ok(lease)
    }

    /// Refreshes `lease` once. A lease etcd no longer knows (expired while
    /// the node was cut off) answers `Ok(false)`: register again.
    ///
    /// # Errors
    /// etcd unavailable.
    pub async fn keep_alive(&mut self, lease: i64) -> Result<bool, ClusterStoreError> {
        // Opening the keep-alive stream sends one refresh and reads its
        // answer; a lease etcd no longer knows answers with a TTL of 0,
        // which the client reports as "lease not found".
        match self
            .retrying_idempotent("refresh the node lease", |mut c| async move {
                c.lease_keep_alive(lease).await
            })
            .await
        {
            Ok(_) => Ok(true),
            Err(ClusterStoreError::Unavailable { what, .. })
                if what.ends_with("lease not found") =>
            {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Every registered (live) node.
    ///
    /// # Errors
    /// etcd unavailable, or a node record unreadable.
    pub async fn nodes(&mut self) -> Result<Vec<Node>, ClusterStoreError> {
        let (resp, _) = self.list("read nodes", "nodes/").await?;
        resp.kvs()
            .iter()
            .map(|kv| {
                let record: NodeRecord =
                    serde_json::from_slice(kv.value()).map_err(|e| ClusterStoreError::Corrupt {
                        key: String::from_utf8_lossy(kv.key()).into_owned(),
                        reason: e.to_string(),
                    })?;
                Ok(Node {
                    record,
                    lease: kv.lease(),
                })
            })
            .collect()
    }
}

impl Door {
    /// An operator's removal of node `name`: its blocks are deleted (each
    /// compared on the revision read, in one transaction) so other nodes can
    /// claim them, and with `force` its node key too. Refused while the
    /// node's key (its lease) is alive, unless `force` (the core's
    /// [`check_node_removal`](lockstep_core::cluster::check_node_removal)).
    /// Returns the blocks freed.
    ///
    /// # Errors
    /// [`ClusterStoreError::Refused`] (alive, no force),
    /// [`ClusterStoreError::Conflict`] (a block changed meanwhile: nothing
    /// deleted), or etcd unavailable.
    pub async fn remove_node(
        &mut self,
        name: &str,
        force: bool,
    ) -> Result<Vec<Block>, ClusterStoreError> {
        use lockstep_core::cluster::{NodeLease, check_node_removal};
        let alive = self.nodes().await?.iter().any(|n| n.record.name == name);
        let lease = if alive {
            NodeLease::Alive
        } else {
            NodeLease::GoneSince(0)
        };
        check_node_removal(name, lease, force)?;
        let (blocks, _) = self.blocks().await?;
        let freed: Vec<Block> = blocks.into_iter().filter(|b| b.node == name).collect();
        let mut guards = Vec::new();
        let mut ops = Vec::new();
        for b in &freed {
            let key = self.block_key(&b.pool, b.cidr);
            guards.push(Compare::mod_revision(
                key.clone(),
                CompareOp::Equal,
                b.revision,
            ));
            ops.push(TxnOp::delete(key, None));
        }
        if force {
            ops.push(TxnOp::delete(self.key(&format!("nodes/{name}")), None));
        }
        if ops.is_empty() {
            return Ok(freed);
        }
        let what = format!("remove node {name}");
        let txn = Txn::new().when(guards).and_then(ops);
        let resp = self
            .retrying(&what, true, |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await?;
        if !resp.succeeded() {
            return Err(ClusterStoreError::Conflict { what });
        }
        Ok(freed)
    }
}

fn parse_block(
    prefix: &str,
    key: &str,
    value: &[u8],
    revision: i64,
) -> Result<Block, ClusterStoreError> {
    let corrupt = |reason: String| ClusterStoreError::Corrupt {
        key: key.to_string(),
        reason,
    };
    let rest = key.strip_prefix(prefix).unwrap_or(key);
    let (pool, cidr) = rest
        .split_once('/')
        .ok_or_else(|| corrupt("not blocks/<pool>/<cidr>".into()))?;
    let cidr = unescape(cidr).ok_or_else(|| corrupt(format!("{cidr:?} is not a CIDR")))?;
    let rec: BlockRecord = serde_json::from_slice(value).map_err(|e| corrupt(e.to_string()))?;
    Ok(Block {
        pool: pool.to_string(),
        cidr,
        node: rec.node,
        revision,
    })
}

/// Whether `e` says the request was never sent: the connection to the
/// member could not be made (hyper's "tcp connect error", surfaced by tonic
/// as an Unavailable status or a transport error).
fn never_sent(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(s) => s.message().contains("tcp connect error"),
        etcd_client::Error::TransportError(t) => t.to_string().contains("tcp connect error"),
        _ => false,
    }
}

/// Whether `e` may pass by itself: the connection failed or broke (a member
/// stopped under the request), or etcd answered Unavailable (no leader for
/// a moment). gRPC codes: 1 cancelled, 14 unavailable.
fn transient(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(s) => matches!(i32::from(s.code()), 1 | 14),
        etcd_client::Error::TransportError(_) => true,
        _ => false,
    }
}

fn unavailable(opts: &DoorOptions, what: &str, why: &str, write: bool) -> ClusterStoreError {
    ClusterStoreError::Unavailable {
        endpoints: opts.endpoints.join(","),
        what: format!("{what}: {why}"),
        maybe_written: write,
    }
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use super::*;

    #[test]
    fn options_from_the_cluster_section_carry_endpoints_prefix_tls_and_the_bound() {
        let text = "[cluster]\netcd = [\"https://e:1\", \"https://f:2\"]\nprefix = \"/x/\"\nnode_ip_v4 = \"192.0.2.1\"\n[cluster.tls]\nca = \"/ca.pem\"\ncert = \"/c.pem\"\nkey = \"/k.pem\"\n";
        let config = crate::config::Config::parse(Path::new("/c.toml"), text).expect("valid");
        let o = DoorOptions::from_cluster_config(
            config.cluster.as_ref().expect("cluster"),
            Duration::from_millis(600),
        );
        assert_eq!(o.endpoints, ["https://e:1", "https://f:2"]);
        assert_eq!(o.prefix, "/x/");
        assert_eq!(o.timeout, Duration::from_millis(600));
        assert_eq!(
            o.tls,
            Some(TlsFiles {
                ca: PathBuf::from("/ca.pem"),
                cert: Some(PathBuf::from("/c.pem")),
                key: Some(PathBuf::from("/k.pem")),
            })
        );
    }
}
