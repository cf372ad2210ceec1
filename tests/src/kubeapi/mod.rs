//! A Kubernetes API test double (#28): an HTTP server on loopback that
//! stores objects and serves what kube-rs's clients, watchers and
//! reflectors rely on, so lockstep's Kubernetes door is tested end to end
//! on machines where no API server can be installed. Shared with the next
//! Kubernetes issue: add kinds to [`kinds`].
//!
//! What it serves, as the API server does:
//! - **list** (`GET` on a collection, all namespaces or one) with the
//!   list's `resourceVersion`, `labelSelector`, `fieldSelector` (per kind,
//!   as the API server: `metadata.name` and `metadata.namespace` on every
//!   kind, and of the kind-specific fields the string ones lockstep could
//!   use: Pods' `spec.nodeName` and `status.phase`, Namespaces'
//!   `status.phase`, Services' `spec.type` and `spec.clusterIP`, Events'
//!   `reason` and `type`; any other field is `400 field label not
//!   supported`), and `limit`/`continue` pages. A continued list is served
//!   from the first page's snapshot (its resourceVersion and items), as
//!   the API server serves it from that revision; once the history is
//!   expired ([`ApiDouble::expire`]) a continue token is `410 Expired`;
//! - **watch** (`?watch=true&resourceVersion=N`): every change after `N`
//!   from a bounded history, then live; `resourceVersion`s are one counter
//!   over every kind and only grow; a watch from before the history is
//!   answered with an `ERROR` event carrying a `410 Gone`/`Expired`
//!   `Status` (kube-runtime then relists); `allowWatchBookmarks=true`
//!   sends a `BOOKMARK` every minute ([`BOOKMARK_EVERY`], the API server's
//!   pace; [`ApiDouble::start_with`] sets another) with the
//!   latest resourceVersion the stream has passed; `timeoutSeconds` ends the
//!   stream; a watch with a selector sees an object that starts matching
//!   as `ADDED` and one that stops matching as `DELETED` (its new state),
//!   as the API server sends them (lockstep's Node candidacy and selectors
//!   depend on it);
//! - **Leases** (`coordination.k8s.io/v1`) like any object: the agents'
//!   election relies on a create answering 409 when the Lease exists and
//!   a replace guarded by its resourceVersion (409 when stale);
//! - **EndpointSlices** (`discovery.k8s.io/v1`) like any object, listed
//!   and watched across namespaces; tests write them as the
//!   EndpointSlice controller would (no controller runs here);
//! - **get, create (`generateName` too), replace, delete**; a deletion of
//!   an object with finalizers only sets `deletionTimestamp`, and the
//!   object goes when a write leaves its finalizers empty;
//! - **the status subresource** (`.../status`): a status write changes the
//!   status only, a main write never changes the status;
//! - **optimistic concurrency**: a write whose `metadata.resourceVersion`
//!   is not the object's current one is `409 Conflict`;
//! - **merge patches** (`application/merge-patch+json`, RFC 7386), the
//!   only patch type lockstep's door (and kube-runtime's event recorder)
//!   sends;
//! - **strict objects**: every built-in object written must decode into
//!   its `k8s-openapi` type, and every custom resource must pass its CRD's
//!   OpenAPI schema as `deploy/crds/` ships it (types, required fields,
//!   enums, patterns; defaults filled in: [`schema`]), not lockstep's Rust
//!   types; a field the type or schema does not have is refused (`422
//!   Invalid`, naming the field), as a strict API server refuses it.
//!   Refusals are kept for tests ([`ApiDouble::refusals`]);
//! - **field managers**: each request is recorded with the field manager
//!   the API server would record its write under: the `fieldManager`
//!   parameter, else the `User-Agent` up to its first `/` (tests check
//!   that every write of the agents is lockstep's);
//! - **Service defaulting** on create, as a dual-stack cluster does:
//!   `type: ClusterIP`, `ipFamilyPolicy: SingleStack`, `ipFamilies` from
//!   the policy, port protocol TCP; `metadata.generation` grows when
//!   anything but metadata and status changes.
//!
//! Tests count the watches open, of every object of a kind or of one
//! named object ([`ApiDouble::open_watches_of_all`]); a watch counts until
//! its stream ends or its client goes.
//!
//! Tests break watches ([`ApiDouble::break_watches`]: streams end, clients
//! watch again from their last resourceVersion) or expire them
//! ([`ApiDouble::expire`]: the history is forgotten and every open stream
//! gets a 410 before it ends, so clients relist).
//!
//! Limits — what it does NOT do, so a test passing here says nothing about
//! these on a real API server:
//! - no authentication or authorization: RBAC is not checked (the
//!   ClusterRole in `deploy/` is checked by reading the door's requests
//!   against it in `kubernetes_e2e`, not by an authorizer);
//! - built-in kinds are checked by decoding into `k8s-openapi`'s types
//!   only: no built-in validation of names, labels or immutable fields
//!   (clusterIP is never allocated); custom resources are checked
//!   against their CRD's schema, CEL rules included ([`schema`] says
//!   what of a schema is modelled);
//! - no server-side apply, JSON patch or strategic merge patch (`415`),
//!   no streaming lists (`sendInitialEvents`), no discovery, no protobuf,
//!   no admission, no garbage collection by owner references; namespaces are objects to read (their annotations), but
//!   any namespace exists for namespaced writes;
//! - a first page is always served from the latest state
//!   (`resourceVersion=0` and `resourceVersionMatch` are accepted and
//!   ignored); snapshots of paged lists are kept until the history is
//!   expired, not for a fixed time;
//! - one process, in memory, no HA: a watch never moves to another
//!   apiserver replica.

pub mod http;
pub mod schema;
pub mod selector;
pub mod store;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::Context;
use serde_json::Value;

use self::http::Seen;
use self::store::{ApiError, Change, Kind, Store, check_as};

/// Checks a custom resource against the schema of the CRD `yaml` gives,
/// parsed once into `cell`.
fn check_crd(
    cell: &'static std::sync::OnceLock<Value>,
    yaml: fn() -> Result<String, String>,
    v: &Value,
) -> Result<Value, String> {
    let s = cell.get_or_init(|| schema::schema_of(&yaml().expect("the generated CRD")));
    schema::check(s, v)
}

fn check_lbpool(v: &Value) -> Result<Value, String> {
    static S: std::sync::OnceLock<Value> = std::sync::OnceLock::new();
    check_crd(&S, lockstep::kubernetes::crd::crd_yaml, v)
}

fn check_nodeipam(v: &Value) -> Result<Value, String> {
    static S: std::sync::OnceLock<Value> = std::sync::OnceLock::new();
    check_crd(&S, lockstep::kubernetes::nodeipam::crd::crd_yaml, v)
}

fn check_podippool(v: &Value) -> Result<Value, String> {
    static S: std::sync::OnceLock<Value> = std::sync::OnceLock::new();
    check_crd(&S, lockstep::kubernetes::pod_pools::crd_yaml, v)
}

fn check_bgppeer(v: &Value) -> Result<Value, String> {
    static S: std::sync::OnceLock<Value> = std::sync::OnceLock::new();
    check_crd(&S, lockstep::kubernetes::bgp_peers::crd_yaml, v)
}

fn check_bgpnodestate(v: &Value) -> Result<Value, String> {
    static S: std::sync::OnceLock<Value> = std::sync::OnceLock::new();
    check_crd(&S, lockstep::kubernetes::bgp_status::crd_yaml, v)
}

/// The kinds the double serves.
pub fn kinds() -> Vec<Kind> {
    use k8s_openapi::api::coordination::v1::Lease;
    use k8s_openapi::api::core::v1::{Event as CoreEvent, Namespace, Node, Pod, Service};
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    use k8s_openapi::api::events::v1::Event;
    vec![
        Kind {
            group: "",
            version: "v1",
            plural: "services",
            kind: "Service",
            namespaced: true,
            status: true,
            check: check_as::<Service>,
        },
        Kind {
            group: "",
            version: "v1",
            plural: "pods",
            kind: "Pod",
            namespaced: true,
            status: true,
            check: check_as::<Pod>,
        },
        Kind {
            group: "",
            version: "v1",
            plural: "namespaces",
            kind: "Namespace",
            namespaced: false,
            status: true,
            check: check_as::<Namespace>,
        },
        Kind {
            group: "",
            version: "v1",
            plural: "nodes",
            kind: "Node",
            namespaced: false,
            status: true,
            check: check_as::<Node>,
        },
        Kind {
            group: "",
            version: "v1",
            plural: "events",
            kind: "Event",
            namespaced: true,
            status: false,
            check: check_as::<CoreEvent>,
        },
        Kind {
            group: "coordination.k8s.io",
            version: "v1",
            plural: "leases",
            kind: "Lease",
            namespaced: true,
            status: false,
            check: check_as::<Lease>,
        },
        Kind {
            group: "discovery.k8s.io",
            version: "v1",
            plural: "endpointslices",
            kind: "EndpointSlice",
            namespaced: true,
            status: false,
            check: check_as::<EndpointSlice>,
        },
        Kind {
            group: "events.k8s.io",
            version: "v1",
            plural: "events",
            kind: "Event",
            namespaced: true,
            status: false,
            check: check_as::<Event>,
        },
        Kind {
            group: "lockstep.io",
            version: "v1alpha1",
            plural: "loadbalancerippools",
            kind: "LoadBalancerIPPool",
            namespaced: false,
            status: true,
            check: check_lbpool,
        },
        Kind {
            group: "lockstep.io",
            version: "v1alpha1",
            plural: "nodeipams",
            kind: "NodeIPAM",
            namespaced: false,
            status: true,
            check: check_nodeipam,
        },
        Kind {
            group: "lockstep.io",
            version: "v1alpha1",
            plural: "podippools",
            kind: "PodIPPool",
            namespaced: false,
            status: true,
            check: check_podippool,
        },
        Kind {
            group: "lockstep.io",
            version: "v1alpha1",
            plural: "bgppeers",
            kind: "BGPPeer",
            namespaced: false,
            status: false,
            check: check_bgppeer,
        },
        Kind {
            group: "lockstep.io",
            version: "v1alpha1",
            plural: "bgpnodestates",
            kind: "BGPNodeState",
            namespaced: false,
            status: true,
            check: check_bgpnodestate,
        },
    ]
}

/// How often the API server sends a watch a bookmark: about once a minute.
pub const BOOKMARK_EVERY: Duration = Duration::from_secs(60);

/// What ends open watches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    /// Nothing yet.
    None,
    /// Streams end; clients watch again from where they were.
    Break,
    /// Streams get `410 Gone` and end; clients relist.
    Expire,
}

/// Paged lists' snapshots: the last id given, and by id (resourceVersion,
/// items).
type Snapshots = (u64, std::collections::HashMap<u64, (u64, Vec<Value>)>);

/// The state the server and the test share.
pub struct Shared {
    kinds: Vec<Kind>,
    store: Mutex<Store>,
    tx: tokio::sync::broadcast::Sender<Change>,
    cut: tokio::sync::watch::Sender<Cut>,
    bookmark_every: Duration,
    seen: Mutex<Vec<Seen>>,
    refused: Mutex<Vec<ApiError>>,
    /// Open watches by what they watch ([`WatchOf`]).
    watches: Mutex<BTreeMap<WatchOf, usize>>,
    /// Every change, with when it was stored (for benchmarks).
    log: Mutex<Vec<(std::time::Instant, Change)>>,
    /// Paged lists' snapshots by continue-token id: (resourceVersion,
    /// every item), until the history is expired.
    snapshots: Mutex<Snapshots>,
}

/// What a watch watches: a kind (its plural), and whether all of its
/// objects (across namespaces or in one, any label selector) or one named
/// object (a `metadata.name` field selector).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct WatchOf {
    /// The kind's plural.
    pub plural: &'static str,
    /// Whether a field selector names one object.
    pub one: bool,
}

/// Counts an open watch while it lives.
pub struct WatchCount(Arc<Shared>, WatchOf);

impl Drop for WatchCount {
    fn drop(&mut self) {
        let mut w = self.0.watches.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = w.get_mut(&self.1) {
            *n -= 1;
        }
    }
}

impl Shared {
    fn store(&self) -> MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn seen(&self, s: Seen) {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).push(s);
    }

    fn open_watch(self: &Arc<Self>, of: WatchOf) -> WatchCount {
        *self
            .watches
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(of.clone())
            .or_default() += 1;
        WatchCount(self.clone(), of)
    }

    /// Runs a write and publishes its change under the store's lock (so a
    /// watch subscribing under it misses nothing and sees nothing twice).
    fn write(
        &self,
        f: impl FnOnce(&mut Store) -> Result<(Value, Option<Change>), ApiError>,
    ) -> Result<Value, ApiError> {
        let mut store = self.store();
        match f(&mut store) {
            Ok((v, c)) => {
                if let Some(c) = c {
                    self.log
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push((std::time::Instant::now(), c.clone()));
                    let _ = self.tx.send(c);
                }
                Ok(v)
            }
            Err(e) => {
                if e.code == 422 || e.code == 400 {
                    self.refused
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(e.clone());
                }
                Err(e)
            }
        }
    }

    /// Keeps a paged list's items; the id its continue tokens carry.
    fn keep_snapshot(&self, rv: u64, items: Vec<Value>) -> u64 {
        let mut s = self.snapshots.lock().unwrap_or_else(|p| p.into_inner());
        s.0 += 1;
        let id = s.0;
        s.1.insert(id, (rv, items));
        id
    }

    /// A paged list's snapshot, unless expired.
    fn snapshot(&self, id: u64) -> Option<(u64, Vec<Value>)> {
        self.snapshots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .1
            .get(&id)
            .cloned()
    }

    fn kind(&self, plural: &str) -> anyhow::Result<Kind> {
        self.kinds
            .iter()
            .find(|k| k.plural == plural && (plural != "events" || k.group == "events.k8s.io"))
            .copied()
            .with_context(|| format!("the double has no kind {plural}"))
    }
}

/// The running double; stops when dropped.
pub struct ApiDouble {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

fn api(e: ApiError) -> anyhow::Error {
    anyhow::anyhow!("{} {}: {}", e.code, e.reason, e.message)
}

impl ApiDouble {
    /// Starts on a free loopback port, bookmarks every minute (as often
    /// as the API server sends them).
    ///
    /// # Errors
    /// The listener or the runtime cannot be made.
    pub fn start() -> anyhow::Result<Self> {
        Self::start_with(BOOKMARK_EVERY)
    }

    /// Starts with bookmarks every `bookmark_every`.
    ///
    /// # Errors
    /// As [`ApiDouble::start`].
    pub fn start_with(bookmark_every: Duration) -> anyhow::Result<Self> {
        Self::start_at("127.0.0.1:0".parse()?, bookmark_every)
    }

    /// Starts listening on `addr`, bookmarks every `bookmark_every`.
    ///
    /// # Errors
    /// As [`ApiDouble::start`].
    pub fn start_at(addr: SocketAddr, bookmark_every: Duration) -> anyhow::Result<Self> {
        let listener = std::net::TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let (tx, _) = tokio::sync::broadcast::channel(65_536);
        let (cut, _) = tokio::sync::watch::channel(Cut::None);
        let shared = Arc::new(Shared {
            kinds: kinds(),
            store: Mutex::new(Store::new(10_000)),
            tx,
            cut,
            bookmark_every,
            seen: Mutex::new(Vec::new()),
            refused: Mutex::new(Vec::new()),
            watches: Mutex::new(BTreeMap::new()),
            log: Mutex::new(Vec::new()),
            snapshots: Mutex::new((0, std::collections::HashMap::new())),
        });
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let s = shared.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
                let app = axum::Router::new().fallback(move |method, uri, headers, body| {
                    http::serve(s.clone(), method, uri, headers, body)
                });
                let _ = axum::serve(listener, app)
                    .with_graceful_shutdown(async {
                        let _ = stop_rx.await;
                    })
                    .await;
            });
            // Open watch streams are not waited for.
            rt.shutdown_timeout(Duration::from_millis(100));
        });
        Ok(Self {
            addr,
            shared,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }

    /// Its address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A kubeconfig reaching it at `server` (e.g. through a forwarder).
    pub fn kubeconfig(server: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: double\n  cluster:\n    server: {server}\nusers:\n- name: lockstep\n  user:\n    token: double\ncontexts:\n- name: double\n  context:\n    cluster: double\n    user: lockstep\ncurrent-context: double\n"
        )
    }

    /// Writes a kubeconfig for this double at `path`.
    ///
    /// # Errors
    /// The file cannot be written.
    pub fn write_kubeconfig(&self, path: &Path) -> anyhow::Result<()> {
        std::fs::write(path, Self::kubeconfig(&format!("http://{}", self.addr)))?;
        Ok(())
    }

    /// Creates an object of `plural` in `ns` (`""` for cluster-scoped).
    ///
    /// # Errors
    /// The API's refusal.
    pub fn create(&self, plural: &str, ns: &str, obj: &Value) -> anyhow::Result<Value> {
        let k = self.shared.kind(plural)?;
        self.shared
            .write(|s| s.create(&k, ns, obj).map(|(v, c)| (v, Some(c))))
            .map_err(api)
    }

    /// Merge-patches an object (`status`: its status subresource).
    ///
    /// # Errors
    /// The API's refusal.
    pub fn patch(
        &self,
        plural: &str,
        ns: &str,
        name: &str,
        patch: &Value,
        status: bool,
    ) -> anyhow::Result<Value> {
        let k = self.shared.kind(plural)?;
        self.shared
            .write(|s| s.patch(&k, ns, name, patch, status))
            .map_err(api)
    }

    /// Deletes an object.
    ///
    /// # Errors
    /// The API's refusal.
    pub fn delete(&self, plural: &str, ns: &str, name: &str) -> anyhow::Result<Value> {
        let k = self.shared.kind(plural)?;
        self.shared
            .write(|s| s.delete(&k, ns, name).map(|(v, c)| (v, Some(c))))
            .map_err(api)
    }

    /// One object.
    ///
    /// # Errors
    /// 404.
    pub fn get(&self, plural: &str, ns: &str, name: &str) -> anyhow::Result<Value> {
        let k = self.shared.kind(plural)?;
        self.shared.store().get(&k, ns, name).map_err(api)
    }

    /// Every object of `plural`, all namespaces.
    pub fn list(&self, plural: &str) -> Vec<Value> {
        let Ok(k) = self.shared.kind(plural) else {
            return Vec::new();
        };
        self.shared
            .store()
            .list(&k, None, &selector::Filter::default())
            .1
    }

    /// The current resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.shared.store().rv()
    }

    /// Ends every open watch; clients watch again from their last
    /// resourceVersion.
    pub fn break_watches(&self) {
        self.shared.cut.send_replace(Cut::Break);
    }

    /// Forgets the history and ends every open watch with a `410 Gone`:
    /// clients must relist.
    pub fn expire(&self) {
        self.shared.store().expire();
        self.shared
            .snapshots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .1
            .clear();
        self.shared.cut.send_replace(Cut::Expire);
    }

    /// Watches open now.
    pub fn open_watches(&self) -> usize {
        self.shared
            .watches
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .sum()
    }

    /// Watches open now of every object of kind `plural` (not of one
    /// named object): what grows with the cluster when every agent holds
    /// one.
    pub fn open_watches_of_all(&self, plural: &str) -> usize {
        self.shared
            .watches
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(of, _)| of.plural == plural && !of.one)
            .map(|(_, n)| n)
            .sum()
    }

    /// Every request served so far.
    pub fn requests(&self) -> Vec<Seen> {
        self.shared
            .seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Every change stored so far, with when it was stored.
    pub fn changes(&self) -> Vec<(std::time::Instant, Change)> {
        self.shared
            .log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Every write refused as not an object of its kind (or malformed).
    pub fn refusals(&self) -> Vec<ApiError> {
        self.shared
            .refused
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl Drop for ApiDouble {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        self.shared.cut.send_replace(Cut::Break);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests;
