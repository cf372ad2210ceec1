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

use super::{
    Block, BlockRecord, Claim, ClusterStoreError, Node, NodeAddrRecord, NodeRecord, Unreadable,
    escape, unescape,
};
use lockstep_core::cluster::{default_for_apply, key_name_problem, node_addresses_problem};

/// The key (under the prefix) recording the default cluster pool: outside
/// `pools/`, so agents that predate it never read it.
const DEFAULT_KEY: &str = "default_pool";

/// The area (under the prefix) of the nodes' routing keys, bound to no
/// lease. Outside `nodes/`: every version lists `nodes/` whole, and would
/// read `nodes/<name>/addr` as a node named `<name>/addr` (this build
/// skips and reports such a key; builds before #26 item 8 failed the
/// whole read, and with it their remote state).
pub(super) const NODE_ADDRS: &str = "node_addrs/";

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
    /// Keys the last read of each area skipped, by key.
    unreadable: BTreeMap<String, Unreadable>,
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
        Ok(Door {
            client,
            opts,
            unreadable: BTreeMap::new(),
        })
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
            Ok(Err(e)) => Err(match refusal(&e) {
                Some(reason) => ClusterStoreError::Rejected {
                    what: what.to_string(),
                    reason,
                },
                None => unavailable(&self.opts, what, &e.to_string(), write),
            }),
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
    /// revision of the read. A key whose name or value this build cannot
    /// read is skipped and kept in [`Door::unreadable`].
    ///
    /// # Errors
    /// etcd unavailable.
    pub async fn pools(
        &mut self,
    ) -> Result<(Vec<ClusterPoolSpec>, BTreeMap<String, i64>, i64), ClusterStoreError> {
        let (resp, revision) = self.list("read pools", "pools/").await?;
        let area = self.key("pools/");
        let mut specs = Vec::new();
        let mut revisions = BTreeMap::new();
        let mut bad = Vec::new();
        for kv in resp.kvs() {
            let key = String::from_utf8_lossy(kv.key()).into_owned();
            match parse_pool(&area, &key, kv.value()) {
                Ok(spec) => {
                    revisions.insert(spec.name.clone(), kv.mod_revision());
                    specs.push(spec);
                }
                Err(reason) => bad.push(Unreadable {
                    key,
                    reason,
                    block: None,
                }),
            }
        }
        self.note_unreadable(&area, bad);
        Ok((specs, revisions, revision))
    }

    /// The default pool etcd records (`default_pool`, a JSON string), and
    /// the key's mod revision (0: absent). An unreadable value counts as
    /// absent and is kept in [`Door::unreadable`].
    ///
    /// # Errors
    /// etcd unavailable.
    pub async fn stored_default(&mut self) -> Result<(Option<String>, i64), ClusterStoreError> {
        let key = self.key(DEFAULT_KEY);
        let resp = self
            .retrying("read the default pool", false, |mut c| {
                let key = key.clone();
                async move { c.get(key, None).await }
            })
            .await?;
        let Some(kv) = resp.kvs().first() else {
            self.note_unreadable(&key, Vec::new());
            return Ok((None, 0));
        };
        match parse_default(kv.value()) {
            Ok(name) => {
                self.note_unreadable(&key, Vec::new());
                Ok((Some(name), kv.mod_revision()))
            }
            Err(reason) => {
                let u = Unreadable {
                    key: key.clone(),
                    reason,
                    block: None,
                };
                self.note_unreadable(&key, vec![u]);
                Ok((None, kv.mod_revision()))
            }
        }
    }

    /// The keys the last reads skipped (pools, blocks and nodes read by
    /// this door), each with why.
    pub fn unreadable(&self) -> Vec<Unreadable> {
        self.unreadable.values().cloned().collect()
    }

    /// Replaces what is known unreadable under `area` by `found`; logs the
    /// keys not seen before.
    fn note_unreadable(&mut self, area: &str, found: Vec<Unreadable>) {
        let before: BTreeMap<String, Unreadable> = self
            .unreadable
            .extract_if(.., |k, _| k.starts_with(area))
            .collect();
        for u in found {
            if !before.contains_key(&u.key) {
                tracing::warn!(key = %u.key, reason = %u.reason, "etcd key unreadable; skipped (remove it with `lockstep cluster unreadable delete KEY`)");
            }
            self.unreadable.insert(u.key.clone(), u);
        }
    }

    /// Every key under `pools/`, `blocks/`, `nodes/` and `node_addrs/`,
    /// and `default_pool`, this build cannot read (five reads).
    ///
    /// # Errors
    /// etcd unavailable.
    pub async fn read_unreadable(&mut self) -> Result<Vec<Unreadable>, ClusterStoreError> {
        self.pools().await?;
        self.blocks().await?;
        self.nodes().await?;
        self.node_addrs().await?;
        self.stored_default().await?;
        Ok(self.unreadable())
    }

    /// Deletes `key`, one this build cannot read (`pools/`, `blocks/`,
    /// `nodes/` or `node_addrs/` under the prefix, or `default_pool`), compared on the revision it was read
    /// at: the operator's way out of a key an older version or a hand
    /// wrote. A key that reads fine is refused (pools, blocks and nodes
    /// have commands of their own, which keep their rules).
    ///
    /// # Errors
    /// [`ClusterStoreError::Invalid`] (not such a key, absent, or
    /// readable), [`ClusterStoreError::Conflict`] (changed meanwhile), or
    /// etcd unavailable.
    pub async fn delete_unreadable(&mut self, key: &str) -> Result<(), ClusterStoreError> {
        let resp = self
            .retrying("read the key to delete", false, |mut c| {
                let key = key.to_string();
                async move { c.get(key, None).await }
            })
            .await?;
        let Some(kv) = resp.kvs().first() else {
            return Err(ClusterStoreError::Invalid(format!(
                "etcd key {key:?} does not exist"
            )));
        };
        let problem = if key.starts_with(&self.key("pools/")) {
            parse_pool(&self.key("pools/"), key, kv.value()).err()
        } else if key.starts_with(&self.key("blocks/")) {
            parse_block(&self.key("blocks/"), key, kv.value(), 0)
                .err()
                .map(|u| u.reason)
        } else if key.starts_with(&self.key("nodes/")) {
            parse_node(&self.key("nodes/"), key, kv.value()).err()
        } else if key.starts_with(&self.key(NODE_ADDRS)) {
            parse_node_addr(&self.key(NODE_ADDRS), key, kv.value()).err()
        } else if key == self.key(DEFAULT_KEY) {
            parse_default(kv.value()).err()
        } else {
            return Err(ClusterStoreError::Invalid(format!(
                "etcd key {key:?} is not under {0}pools/, {0}blocks/, {0}nodes/ or {0}{NODE_ADDRS}, nor {0}{DEFAULT_KEY}",
                self.opts.prefix
            )));
        };
        let Some(reason) = problem else {
            return Err(ClusterStoreError::Invalid(format!(
                "etcd key {key:?} is readable; change it with the command that owns it"
            )));
        };
        let txn = Txn::new()
            .when([Compare::mod_revision(
                key,
                CompareOp::Equal,
                kv.mod_revision(),
            )])
            .and_then([TxnOp::delete(key, None)]);
        let what = format!("delete the unreadable key {key}");
        let resp = self
            .retrying_idempotent(&what, |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await?;
        if !resp.succeeded() {
            return Err(ClusterStoreError::Conflict { what });
        }
        tracing::info!(%key, %reason, "deleted an unreadable key");
        self.unreadable.remove(key);
        Ok(())
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
    /// [`ClusterStoreError::Conflict`] (a concurrent change at each of
    /// [`APPLY_ATTEMPTS`] tries: nothing written), or etcd unavailable.
    pub async fn apply_pools(&mut self, new: &[ClusterPoolSpec]) -> Result<i64, ClusterStoreError> {
        self.apply_pools_default(new, None).await
    }

    /// As [`Door::apply_pools`], naming the default pool (`default`) or
    /// keeping the one recorded (the core's [`default_for_apply`]: the
    /// first apply of a single pool records it; adding pools never moves
    /// it). The default key is written in the same transaction, compared
    /// on its revision.
    ///
    /// # Errors
    /// As [`Door::apply_pools`]; [`ClusterStoreError::Refused`] for a
    /// default that is not among `new`, an apply that drops the default
    /// without naming another, or several pools with none named or
    /// recorded.
    pub async fn apply_pools_default(
        &mut self,
        new: &[ClusterPoolSpec],
        default: Option<&str>,
    ) -> Result<i64, ClusterStoreError> {
        // A block claimed between the read and the write (nodes claim all
        // the time) fails the guard with nothing written: read, check and
        // try again, a few times, before telling the caller.
        let mut attempt = 1;
        loop {
            match self.apply_pools_once(new, default).await {
                Err(ClusterStoreError::Conflict { .. }) if attempt < APPLY_ATTEMPTS => {
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(20 * attempt)).await;
                }
                r => return r,
            }
        }
    }

    /// One read, check and guarded write of [`Door::apply_pools_default`].
    async fn apply_pools_once(
        &mut self,
        new: &[ClusterPoolSpec],
        default: Option<&str>,
    ) -> Result<i64, ClusterStoreError> {
        let (stored_default, default_rev) = self.stored_default().await?;
        let (old, revisions, read_at) = self.pools().await?;
        // A pool whose key holds something unreadable: the guard
        // (create-if-absent) would fail as a conflict for ever; name it.
        for spec in new {
            let key = self.key(&format!("pools/{}", spec.name));
            if let Some(u) = self.unreadable.get(&key) {
                return Err(ClusterStoreError::Invalid(format!(
                    "etcd key {key} of pool {} is unreadable ({}); remove it first with `lockstep cluster unreadable delete {key}`",
                    spec.name, u.reason
                )));
            }
        }
        let (blocks, blocks_at) = self.blocks().await?;
        let claimed: BTreeMap<IpNet, (String, String)> = blocks
            .iter()
            .map(|b| (b.cidr, (b.pool.clone(), b.node.clone())))
            .collect();
        // The default first: an apply dropping it is refused for that,
        // whatever else it would take away.
        let recorded = default_for_apply(new, stored_default.as_deref(), default)?;
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
        // The default, compared on the revision read (a concurrent apply
        // naming another fails this one).
        let default_key = self.key(DEFAULT_KEY);
        guards.push(if default_rev == 0 {
            Compare::create_revision(default_key.clone(), CompareOp::Equal, 0)
        } else {
            Compare::mod_revision(default_key.clone(), CompareOp::Equal, default_rev)
        });
        if recorded != stored_default || (default_rev != 0 && stored_default.is_none()) {
            match &recorded {
                Some(name) => {
                    let value =
                        serde_json::to_vec(name).map_err(|e| ClusterStoreError::Corrupt {
                            key: default_key.clone(),
                            reason: e.to_string(),
                        })?;
                    ops.push(TxnOp::put(default_key, value, None));
                }
                None => ops.push(TxnOp::delete(default_key, None)),
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
        let what = format!(
            "apply pools ({} pools: {} writes and deletes, {} compares in one transaction)",
            new.len(),
            ops.len(),
            guards.len()
        );
        let txn = Txn::new().when(guards).and_then(ops);
        let resp = self
            .retrying(&what, true, |mut c| {
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

    /// Every claimed block, and the store revision of the read. A key
    /// whose name or value this build cannot read is skipped and kept in
    /// [`Door::unreadable`] (with its block when the key names one: no
    /// claim may pick it).
    ///
    /// # Errors
    /// etcd unavailable.
    pub async fn blocks(&mut self) -> Result<(Vec<Block>, i64), ClusterStoreError> {
        let prefix = self.key("blocks/");
        let (resp, revision) = self.list("read blocks", "blocks/").await?;
        let mut out = Vec::new();
        let mut bad = Vec::new();
        for kv in resp.kvs() {
            let key = String::from_utf8_lossy(kv.key()).into_owned();
            match parse_block(&prefix, &key, kv.value(), kv.mod_revision()) {
                Ok(b) => out.push(b),
                Err(u) => bad.push(u),
            }
        }
        self.note_unreadable(&prefix, bad);
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
        let rec: BlockRecord = match serde_json::from_slice(value) {
            Ok(rec) => rec,
            Err(e) => {
                tracing::warn!(%key, reason = %e, "a claim found an unreadable block key; picking another block");
                return Ok(Claim::Unreadable {
                    reason: e.to_string(),
                });
            }
        };
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
    /// least 1) and returns the lease; [`Door::keep_alive`] keeps it. In
    /// the same transaction the node's routing key (`node_addrs/<name>`,
    /// its name and IPs, no lease) is written: the others keep routing
    /// its blocks there after the lease ends.
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
        let addr_key = self.key(&format!("{NODE_ADDRS}{}", record.name));
        let addr = NodeAddrRecord {
            name: record.name.clone(),
            ips: record.ips.clone(),
        };
        let addr_value = serde_json::to_vec(&addr).map_err(|e| ClusterStoreError::Corrupt {
            key: addr_key.clone(),
            reason: e.to_string(),
        })?;
        let txn = Txn::new().and_then([
            TxnOp::put(addr_key, addr_value, None),
            TxnOp::put(key, value, Some(PutOptions::new().with_lease(lease))),
        ]);
        // Two puts of the same values: run twice, the same keys result.
        self.retrying_idempotent("register the node", |mut c| {
            let txn = txn.clone();
            async move { c.txn(txn).await }
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

    /// Every registered (live) node. A key whose name or record this
    /// build cannot read is skipped and kept in [`Door::unreadable`].
    ///
    /// # Errors
    /// etcd unavailable.
    pub async fn nodes(&mut self) -> Result<Vec<Node>, ClusterStoreError> {
        let (resp, _) = self.list("read nodes", "nodes/").await?;
        let area = self.key("nodes/");
        let mut out = Vec::new();
        let mut bad = Vec::new();
        for kv in resp.kvs() {
            let key = String::from_utf8_lossy(kv.key()).into_owned();
            match parse_node(&area, &key, kv.value()) {
                Ok(record) => out.push(Node {
                    record,
                    lease: kv.lease(),
                }),
                Err(reason) => bad.push(Unreadable {
                    key,
                    reason,
                    block: None,
                }),
            }
        }
        self.note_unreadable(&area, bad);
        Ok(out)
    }

    /// Every node's routing key (`node_addrs/<name>`: where its blocks
    /// are routed, whether or not its lease lives). A key whose name or
    /// record this build cannot read (a name that is not the record's,
    /// no address, an address no route can go via) is skipped and kept
    /// in [`Door::unreadable`].
    ///
    /// # Errors
    /// etcd unavailable.
    pub async fn node_addrs(&mut self) -> Result<Vec<NodeAddrRecord>, ClusterStoreError> {
        let (resp, _) = self.list("read node addresses", NODE_ADDRS).await?;
        let area = self.key(NODE_ADDRS);
        let mut out = Vec::new();
        let mut bad = Vec::new();
        for kv in resp.kvs() {
            let key = String::from_utf8_lossy(kv.key()).into_owned();
            match parse_node_addr(&area, &key, kv.value()) {
                Ok(record) => out.push(record),
                Err(reason) => bad.push(Unreadable {
                    key,
                    reason,
                    block: None,
                }),
            }
        }
        self.note_unreadable(&area, bad);
        Ok(out)
    }
}

impl Door {
    /// An operator's removal of node `name`: its blocks are deleted (each
    /// compared on the revision read, in one transaction) so other nodes can
    /// claim them, with its routing key (`node_addrs/<name>`: the others
    /// drop its routes with its blocks), and with `force` its node key too. Refused while the
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
        let (blocks, _) = self.blocks().await?;
        let freed: Vec<Block> = blocks.into_iter().filter(|b| b.node == name).collect();
        let routed = self.node_addrs().await?.iter().any(|r| r.name == name);
        let lease = if alive {
            NodeLease::Alive
        } else if freed.is_empty() && !routed {
            NodeLease::Unknown
        } else {
            NodeLease::GoneSince(0)
        };
        check_node_removal(name, lease, force)?;
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
        ops.push(TxnOp::delete(
            self.key(&format!("{NODE_ADDRS}{name}")),
            None,
        ));
        if force {
            ops.push(TxnOp::delete(self.key(&format!("nodes/{name}")), None));
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

/// A block key and value, or why they cannot be read (with the block
/// when the key names one).
fn parse_block(prefix: &str, key: &str, value: &[u8], revision: i64) -> Result<Block, Unreadable> {
    let rest = key.strip_prefix(prefix).unwrap_or(key);
    let unreadable = |reason: String, block: Option<IpNet>| Unreadable {
        key: key.to_string(),
        reason,
        block,
    };
    let Some((pool, cidr)) = rest.split_once('/') else {
        return Err(unreadable("not blocks/<pool>/<cidr>".into(), None));
    };
    if let Some(why) = key_name_problem(pool) {
        return Err(unreadable(format!("pool name {pool:?}: {why}"), None));
    }
    let Some(cidr) = unescape(cidr) else {
        return Err(unreadable(
            format!("{cidr:?} is not a block (<address>-<prefix length>, canonical)"),
            None,
        ));
    };
    let rec: BlockRecord =
        serde_json::from_slice(value).map_err(|e| unreadable(format!("value: {e}"), Some(cidr)))?;
    Ok(Block {
        pool: pool.to_string(),
        cidr,
        node: rec.node,
        revision,
    })
}

/// How many times a pools apply is read, checked and written before a
/// concurrent change (a block claimed meanwhile) is reported.
const APPLY_ATTEMPTS: u64 = 5;

/// A key whose last segment is a name, and its JSON value, which must
/// carry that same name (`name_of`): the value, or why it cannot be read.
/// `what` names the kind ("pool", "node"); `holds` says what the value
/// holds when the names differ.
fn parse_named<T: serde::de::DeserializeOwned>(
    (what, holds): (&str, &str),
    prefix: &str,
    key: &str,
    value: &[u8],
    name_of: fn(&T) -> &str,
) -> Result<T, String> {
    let name = key.strip_prefix(prefix).unwrap_or(key);
    if let Some(why) = key_name_problem(name) {
        return Err(format!("{what} name {name:?}: {why}"));
    }
    let v: T = serde_json::from_slice(value).map_err(|e| format!("value: {e}"))?;
    if name_of(&v) != name {
        return Err(format!(
            "holds {holds} {:?} under the key of {what} {name:?}",
            name_of(&v)
        ));
    }
    Ok(v)
}

/// A pool key and value, or why they cannot be read: the key's name must
/// be a usable name and the value a pool of that name.
fn parse_pool(prefix: &str, key: &str, value: &[u8]) -> Result<ClusterPoolSpec, String> {
    parse_named(
        ("pool", "pool"),
        prefix,
        key,
        value,
        |p: &ClusterPoolSpec| p.name.as_str(),
    )
}

/// The default pool key's value (a JSON string naming a usable pool
/// name), or why it cannot be read.
fn parse_default(value: &[u8]) -> Result<String, String> {
    let name: String = serde_json::from_slice(value).map_err(|e| format!("value: {e}"))?;
    match key_name_problem(&name) {
        Some(why) => Err(format!("pool name {name:?}: {why}")),
        None => Ok(name),
    }
}

/// A node key and record, or why they cannot be read.
fn parse_node(prefix: &str, key: &str, value: &[u8]) -> Result<NodeRecord, String> {
    parse_named(("node", "node"), prefix, key, value, |r: &NodeRecord| {
        r.name.as_str()
    })
}

/// A routing key and record, or why they cannot be read: the key's name
/// must be a usable name and the record's, its addresses ones a route can
/// go via.
pub(super) fn parse_node_addr(
    prefix: &str,
    key: &str,
    value: &[u8],
) -> Result<NodeAddrRecord, String> {
    let record = parse_named(
        ("node", "the addresses of node"),
        prefix,
        key,
        value,
        |r: &NodeAddrRecord| r.name.as_str(),
    )?;
    if let Some(why) = node_addresses_problem(&record.ips) {
        return Err(format!("ips: {why}"));
    }
    Ok(record)
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

/// What etcd answered when it refused the request outright — checked it
/// and said no before proposing anything, so nothing was written and
/// asking again will be refused again: an invalid request (too many
/// operations in a transaction, a request too large, a key or range
/// etcd does not accept), no permission, the space quota exceeded, a
/// precondition or range it will not serve. gRPC codes: 3 invalid
/// argument, 5 not found, 6 already exists, 7 permission denied, 8
/// resource exhausted, 9 failed precondition, 11 out of range, 16
/// unauthenticated. `None` for anything whose outcome is unknown
/// (unavailable, deadline, cancelled, internal, a transport failure).
fn refusal(e: &etcd_client::Error) -> Option<String> {
    match e {
        etcd_client::Error::GRpcStatus(s) if refused_code(i32::from(s.code())) => {
            Some(s.message().to_string())
        }
        _ => None,
    }
}

/// Whether a gRPC status code from etcd is a definite refusal
/// ([`refusal`]).
fn refused_code(code: i32) -> bool {
    matches!(code, 3 | 5..=9 | 11 | 16)
}

/// Whether `e` may pass by itself: the connection failed or broke (a member
/// stopped under the request), or etcd answered Unavailable (no leader for
/// a moment). gRPC codes: 1 cancelled, 14 unavailable. tonic reports a
/// connection that broke under a request in flight (a broken pipe, a reset
/// from a member just stopped) as code 2, Unknown, with the I/O error in
/// its source chain: that is a broken connection too, not an answer.
fn transient(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(s) => {
            matches!(i32::from(s.code()), 1 | 14)
                || (i32::from(s.code()) == 2 && broken_connection(s))
        }
        etcd_client::Error::TransportError(_) => true,
        _ => false,
    }
}

/// Whether an I/O error lies in `e`'s source chain: the request's
/// connection failed, rather than etcd answering.
fn broken_connection(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = e.source();
    while let Some(c) = cause {
        if c.downcast_ref::<std::io::Error>().is_some() {
            return true;
        }
        cause = c.source();
    }
    false
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
    fn a_connection_broken_under_a_request_may_be_tried_again() {
        // What tonic reported when a member stopped under a request in
        // flight (CI, cluster_failures): code Unknown, "transport error",
        // the I/O error two sources down.
        #[derive(Debug)]
        struct Transport(std::io::Error);
        impl std::fmt::Display for Transport {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("transport error")
            }
        }
        impl std::error::Error for Transport {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let broken = std::io::Error::new(
            std::io::ErrorKind::BrokenPipe,
            "stream closed because of a broken pipe",
        );
        let status = tonic::Status::from_error(Box::new(Transport(broken)));
        assert_eq!(status.code(), tonic::Code::Unknown);
        let e = etcd_client::Error::GRpcStatus(status);
        assert!(transient(&e), "{e}");
        // Not a write that never left the node: it may have been sent.
        assert!(!never_sent(&e), "{e}");
        // Unknown from etcd itself, without a broken connection, is an
        // answer and is not tried again.
        let answered = etcd_client::Error::GRpcStatus(tonic::Status::unknown("boom"));
        assert!(!transient(&answered));
        let unavailable = etcd_client::Error::GRpcStatus(tonic::Status::unavailable("no leader"));
        assert!(transient(&unavailable));
    }

    #[test]
    fn a_refusal_is_told_from_an_unknown_outcome() {
        // Refused outright: invalid argument (too many operations in a
        // txn, request too large), not found, already exists, permission
        // denied, resource exhausted (space quota), failed precondition,
        // out of range, unauthenticated.
        for code in [3, 5, 6, 7, 8, 9, 11, 16] {
            assert!(refused_code(code), "{code}");
        }
        // Outcome unknown: cancelled, unknown, deadline, aborted,
        // unimplemented, internal, unavailable, data loss.
        for code in [1, 2, 4, 10, 12, 13, 14, 15] {
            assert!(!refused_code(code), "{code}");
        }
        // The client's own errors (a lease etcd no longer knows) are not
        // refusals: keep_alive reads them as before.
        assert!(
            refusal(&etcd_client::Error::LeaseKeepAliveError(
                "lease not found".into()
            ))
            .is_none()
        );
    }

    #[test]
    fn unreadable_keys_are_named_and_keep_the_block_they_name() {
        let p = "/x/blocks/";
        let ok = br#"{"node":"n1","claimed_at_ms":1}"#;
        let b = parse_block(p, "/x/blocks/pods/10.0.0.16-28", ok, 7).expect("readable");
        assert_eq!(
            (b.pool.as_str(), b.node.as_str(), b.revision),
            ("pods", "n1", 7)
        );
        // A pool name with a '/' (an older version's `team/a`): no block.
        let u = parse_block(p, "/x/blocks/team/a/10.0.0.0-28", ok, 1).unwrap_err();
        assert_eq!(u.block, None);
        assert!(u.reason.contains("is not a block"), "{}", u.reason);
        // A key that names a block, with a value this build cannot read:
        // the block is kept so no claim picks it.
        let u = parse_block(p, "/x/blocks/pods/10.0.0.16-28", b"garbage", 1).unwrap_err();
        assert_eq!(u.block, Some("10.0.0.16/28".parse().expect("net")));
        assert!(parse_block(p, "/x/blocks/pods/10.0.0.17-28", ok, 1).is_err());
        assert!(parse_block(p, "/x/blocks/a\u{7}b/10.0.0.16-28", ok, 1).is_err());
        // Pools and nodes: the key's name is checked and must be the
        // value's.
        let spec = br#"{"name":"pods","ipv4":["10.0.0.0/24"]}"#;
        assert!(parse_pool("/x/pools/", "/x/pools/pods", spec).is_ok());
        let e = parse_pool("/x/pools/", "/x/pools/other", spec).unwrap_err();
        assert!(e.contains("under the key of pool \"other\""), "{e}");
        let e = parse_pool(
            "/x/pools/",
            "/x/pools/team/a",
            br#"{"name":"team/a","ipv4":["10.0.0.0/24"]}"#,
        )
        .unwrap_err();
        assert!(e.contains("'/'"), "{e}");
        assert!(parse_node("/x/nodes/", "/x/nodes/n1", b"{}").is_err());
        // Routing keys: name, record and usable addresses; a field a
        // later version adds is ignored.
        let a = "/x/node_addrs/";
        let r = parse_node_addr(
            a,
            "/x/node_addrs/n1",
            br#"{"name":"n1","ips":["10.0.0.1","fd00::1"],"later":1}"#,
        )
        .expect("readable");
        assert_eq!(r.ips.len(), 2);
        let e = parse_node_addr(
            a,
            "/x/node_addrs/n2",
            br#"{"name":"n1","ips":["10.0.0.1"]}"#,
        )
        .unwrap_err();
        assert!(e.contains("under the key of node \"n2\""), "{e}");
        let e = parse_node_addr(a, "/x/node_addrs/n1", br#"{"name":"n1","ips":[]}"#).unwrap_err();
        assert!(e.contains("no address"), "{e}");
        let e = parse_node_addr(a, "/x/node_addrs/n1", br#"{"name":"n1","ips":["0.0.0.0"]}"#)
            .unwrap_err();
        assert!(e.contains("0.0.0.0 is not a unicast address"), "{e}");
        assert!(parse_node_addr(a, "/x/node_addrs/n1", b"garbage").is_err());
        assert!(
            parse_node_addr(
                a,
                "/x/node_addrs/a/b",
                br#"{"name":"a/b","ips":["10.0.0.1"]}"#
            )
            .is_err()
        );
    }

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
