//! The etcd requests of cluster mode, each bounded in time and guarded.
//!
//! One door to etcd: every request cluster mode makes goes through
//! [`Door`], which bounds it in time, retries only what may be retried,
//! and tells a refusal from an unknown outcome. Split by what is asked:
//! pools ([`pools`]), blocks ([`blocks`]), nodes ([`nodes`]), taking a
//! node's blocks and the addresses reserved for it ([`reclaim`]); keys and
//! values are read by [`parse`], failures classified by [`failure`].

mod blocks;
mod changed;
mod failure;
mod nodes;
mod options;
mod parse;
mod pools;
mod pools_source;
mod reclaim;
#[cfg(test)]
mod tests;
mod windows;

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use etcd_client::{Client, ConnectOptions, GetOptions, Txn, TxnResponse};
use ipnet::IpNet;
use lockstep_core::cluster::StoreMark;

use super::backoff::Backoff;
use super::mirror::Kv;
use super::{ClusterStoreError, Unreadable, escape};
pub use changed::ChangedKey;
use failure::{never_sent, refusal, transient, unavailable};
pub use options::{DoorOptions, TlsFiles};
pub(super) use parse::parse_node_addr;
pub use pools_source::POOLS_SOURCE_KUBERNETES;

/// The key (under the prefix) recording the default cluster pool: outside
/// `pools/`, so agents that predate it never read it.
const DEFAULT_KEY: &str = "default_pool";
/// Between a request's tries on the next endpoint: the first wait and the
/// longest base wait (jittered, [`Backoff`]).
const ATTEMPT_MIN: Duration = Duration::from_millis(20);
const ATTEMPT_MAX: Duration = Duration::from_millis(40);

/// The area (under the prefix) of the nodes' routing keys, bound to no
/// lease. Outside `nodes/`: every version lists `nodes/` whole, and would
/// read `nodes/<name>/addr` as a node named `<name>/addr` (this build
/// skips and reports such a key; builds before #26 item 8 failed the
/// whole read, and with it their remote state).
pub(super) const NODE_ADDRS: &str = "node_addrs/";

/// A new connection to `opts.endpoints`. HTTP/2 pings every 10 s find a
/// connection that stopped answering (a cut network) even while nothing
/// is asked: the watches on it break, and the mirror stops being live.
/// The answer may take 20 s: a process starved of CPU (3 s once closed
/// every connection of a benchmark's 1,000 simulated nodes, and with them
/// their watches and lease streams) is not a dead network.
async fn dial(opts: &DoorOptions) -> Result<Client, ClusterStoreError> {
    let mut options = ConnectOptions::new()
        .with_connect_timeout(opts.timeout)
        .with_timeout(opts.timeout)
        .with_keep_alive(Duration::from_secs(10), Duration::from_secs(20))
        .with_keep_alive_while_idle(true)
        .with_require_leader(true);
    if let Some(tls) = &opts.tls {
        options = options.with_tls(tls.load()?);
    }
    tokio::time::timeout(
        opts.timeout,
        Client::connect(opts.endpoints.clone(), Some(options)),
    )
    .await
    .map_err(|_| unavailable(opts, "connect", "timed out", false))?
    .map_err(|e| unavailable(opts, "connect", &e.to_string(), false))
}

/// An area of the mirror as a listing parsed it (shared by the doors on
/// one mirror).
struct Parsed<T> {
    value: Arc<T>,
    bad: Vec<Unreadable>,
    mark: StoreMark,
}

/// A connection to etcd and the key layout under the prefix.
pub struct Door {
    client: Client,
    opts: DoorOptions,
    /// Keys the last read of each area skipped, by key.
    unreadable: BTreeMap<String, Unreadable>,
    /// The cluster ID and store revision of the last listing's answer.
    mark: Option<StoreMark>,
    /// The highest store revision a write of this door was answered at
    /// (or one of another door of this node it was told of,
    /// [`Door::follow`]): a listing from the mirror waits until the
    /// mirror saw it. Shared with its siblings ([`Door::sibling`]).
    written: Arc<AtomicI64>,
    /// Open keep-alive streams, by lease.
    keepers: BTreeMap<i64, (etcd_client::LeaseKeeper, etcd_client::LeaseKeepAliveStream)>,
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
        let client = match &opts.link {
            Some(link) => link.client(|| dial(&opts)).await?,
            None => dial(&opts).await?,
        };
        Ok(Door {
            client,
            opts,
            unreadable: BTreeMap::new(),
            mark: None,
            written: Arc::new(AtomicI64::new(0)),
            keepers: BTreeMap::new(),
        })
    }

    /// Another door on the same connection, for one request of its own:
    /// requests on siblings run side by side, and each sees what any of
    /// them wrote (a listing from the mirror waits for their writes).
    pub(super) fn sibling(&self) -> Door {
        Door {
            client: self.client.clone(),
            opts: self.opts.clone(),
            unreadable: BTreeMap::new(),
            mark: None,
            written: self.written.clone(),
            keepers: BTreeMap::new(),
        }
    }

    /// The highest store revision a write of this door was answered at.
    pub(super) fn written(&self) -> i64 {
        self.written.load(Ordering::Relaxed)
    }

    /// Notes that a write of this door was answered at `revision`.
    pub(super) fn wrote_at(&self, revision: i64) {
        self.written.fetch_max(revision, Ordering::Relaxed);
    }

    /// Notes that a write of another door of this node (the LB agent's
    /// round) was answered at `revision`: this door's reads see it too,
    /// as they see its own writes.
    pub(super) fn follow(&self, revision: i64) {
        self.wrote_at(revision);
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

    /// Runs `txn` as [`Door::retrying_idempotent`] runs a request: for a
    /// transaction whose second run does what one does (its compare fails
    /// on the first run's write, and the caller reads that as settled).
    pub(super) async fn txn_idempotent(
        &self,
        what: &str,
        txn: &Txn,
    ) -> Result<TxnResponse, ClusterStoreError> {
        let resp = self
            .retrying_idempotent(what, |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await?;
        self.wrote_at(resp.header().map_or(0, |h| h.revision()));
        Ok(resp)
    }

    /// Runs `txn` as [`Door::retrying`] runs a write: made again only when
    /// it was never sent.
    pub(super) async fn txn_write(
        &self,
        what: &str,
        txn: &Txn,
    ) -> Result<TxnResponse, ClusterStoreError> {
        let resp = self
            .retrying(what, true, |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await?;
        self.wrote_at(resp.header().map_or(0, |h| h.revision()));
        Ok(resp)
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
        let mut backoff = Backoff::new(ATTEMPT_MIN, ATTEMPT_MAX);
        let mut result = request(self.client.clone()).await;
        for _ in 1..attempts {
            match &result {
                Err(e) if again(e) => {
                    tokio::time::sleep(backoff.next_delay()).await;
                    result = request(self.client.clone()).await;
                }
                _ => break,
            }
        }
        result
    }

    /// Which etcd cluster answered the last listing (pools, blocks,
    /// nodes) and at what store revision: a node compares it with what it
    /// saw before to tell that etcd went back in time
    /// (`lockstep_core::cluster::rolled_back`).
    pub fn mark(&self) -> Option<StoreMark> {
        self.mark
    }

    /// Every record under `rest` (one read) that `parse` reads, as
    /// `shape` makes it of the record, its key's mod revision and lease; a
    /// key it cannot read is skipped and kept in [`Door::unreadable`].
    /// Each key is parsed once while it does not change
    /// ([`Kv::parse_once`]), and the list is shared, not copied, while
    /// nothing under `rest` changes.
    pub(super) async fn read_area<T, U>(
        &mut self,
        what: &str,
        rest: &'static str,
        parse: fn(&str, &str, &[u8]) -> Result<T, String>,
        shape: fn(T, i64, i64) -> U,
    ) -> Result<Arc<Vec<U>>, ClusterStoreError>
    where
        T: Clone + Send + Sync + 'static,
        U: Send + Sync + 'static,
    {
        let (out, _) = self
            .parsed(what, rest, move |area, kvs| {
                let mut out = Vec::with_capacity(kvs.len());
                let mut bad = Vec::new();
                for kv in kvs {
                    match kv.parse_once(rest, |kv| parse(area, &kv.key, &kv.value)) {
                        Ok(record) => out.push(shape(record, kv.mod_revision, kv.lease)),
                        Err(reason) => bad.push(Unreadable {
                            key: kv.key.clone(),
                            reason,
                            block: None,
                        }),
                    }
                }
                (out, bad)
            })
            .await?;
        Ok(out)
    }

    /// The keys under `rest` as `make` reads them (with the keys it could
    /// not read, kept in [`Door::unreadable`]), and the store revision of
    /// the listing. From a live mirror, `make` runs once per change of
    /// the area for every door sharing the mirror (an agent's tasks, or a
    /// benchmark's thousands of simulated nodes), and what it made is
    /// shared, not copied, until the area changes.
    pub(super) async fn parsed<T: Send + Sync + 'static>(
        &mut self,
        what: &str,
        rest: &'static str,
        make: impl FnOnce(&str, Vec<Arc<Kv>>) -> (T, Vec<Unreadable>),
    ) -> Result<(Arc<T>, i64), ClusterStoreError> {
        let area = self.key(rest);
        let link = self.opts.link.clone();
        if let Some(link) = &link {
            let at_least = self.at_least();
            if let Some(p) = link.mirror().made::<Parsed<T>>(rest)
                && p.mark.revision >= at_least
            {
                self.mark = Some(p.mark);
                self.note_unreadable(&area, p.bad.clone());
                return Ok((p.value.clone(), p.mark.revision));
            }
        }
        let at = link.as_ref().map(|l| l.mirror().stamp(&[rest]));
        let (kvs, revision) = self.list(what, rest).await?;
        let (value, bad) = make(&area, kvs);
        let value = Arc::new(value);
        if let (Some(link), Some(at), Some(mark)) = (&link, at, self.mark)
            && at.live
        {
            link.mirror().keep(
                rest,
                at,
                Arc::new(Parsed {
                    value: value.clone(),
                    bad: bad.clone(),
                    mark,
                }),
            );
        }
        self.note_unreadable(&area, bad);
        Ok((value, revision))
    }

    /// The revision a listing must be at: never behind what this door
    /// wrote or read before (a mark going backwards would read as etcd
    /// going back in time).
    fn at_least(&self) -> i64 {
        self.written
            .load(Ordering::Relaxed)
            .max(self.mark.map_or(0, |m| m.revision))
    }

    /// Every key under `prefix/` (one read), and the store revision of it:
    /// from the shared mirror while it is live and has seen this door's
    /// last write (waiting for that at most the door's timeout), else
    /// from etcd.
    pub(super) async fn list(
        &mut self,
        what: &str,
        rest: &str,
    ) -> Result<(Vec<Arc<Kv>>, i64), ClusterStoreError> {
        let key = self.key(rest);
        if let Some(link) = &self.opts.link {
            let at_least = self.at_least();
            // This door's writes come through the watch: worth a wait. A
            // revision known only from a read of etcd itself (the mirror
            // was not following) may be a write outside the prefix, a
            // reservation window, which the watch never brings: etcd is
            // read at once instead, until the mirror passes it.
            let within = if at_least > self.written() {
                Duration::ZERO
            } else {
                self.opts.timeout
            };
            if let Some((kvs, mark)) = link.mirror().read(&key, at_least, within).await {
                self.mark = Some(mark);
                return Ok((kvs, mark.revision));
            }
        }
        let resp = self
            .retrying(what, false, |mut c| {
                let key = key.clone();
                async move { c.get(key, Some(GetOptions::new().with_prefix())).await }
            })
            .await?;
        let revision = resp.header().map_or(0, |h| h.revision());
        if let Some(h) = resp.header() {
            self.mark = Some(StoreMark {
                cluster_id: h.cluster_id(),
                revision: h.revision(),
            });
        }
        Ok((
            resp.kvs().iter().map(|kv| Arc::new(Kv::of(kv))).collect(),
            revision,
        ))
    }
}
