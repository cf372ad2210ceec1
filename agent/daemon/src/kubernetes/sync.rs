//! The Kubernetes door's loop: reflectors keep Services and
//! `LoadBalancerIPPool`s in memory (kube-runtime's watchers: list, then
//! watch from the list's `resourceVersion`, relist on `410 Gone`), and
//! every change wakes one pass that brings the LB state to them and writes
//! the result back.
//!
//! Why one level-triggered pass over everything rather than a reconcile
//! per object: LB IPAM is a function of the whole set (a deleted service
//! frees the address a pending one waits for, a pool that grows serves
//! services of other namespaces), and one pass batches a burst of Services
//! into few LB applies (one commit or one etcd transaction per batch).
//!
//! A pass, only while this agent is the writer ([`LbState::writer`]):
//! 1. pools: each valid pool object is applied when it differs from what
//!    was applied (a finalizer first, so a pool deleted later is taken out
//!    of the LB state before the object goes); a deleted one is deleted,
//!    then its finalizer removed;
//! 2. services: lockstep's are applied in batches when their request
//!    changed; stored services no Service asks for any more (deleted,
//!    another type or class, an unusable request) are deleted;
//! 3. statuses: each Service's and pool's status is patched when it
//!    differs from what the LB state says, with an Event when lockstep's
//!    condition changes reason.
//!
//! In cluster mode the assigner assigns after the apply, on its own
//! loop: a pass writes the statuses the state it read already has while
//! it stores the new services (step 2 beside step 3, not before it), and
//! the assigner's next stored state wakes the loop at once
//! ([`LbBackend::changes`]), so a Service waits for one store and one
//! round, not for polls (#28: Service created → status written, p99 ≤
//! 1 s for 200 Services one every 10 ms).
//!
//! Without `[cluster]`, an agent that is not the elected writer (#44 item
//! 1, `election`) runs `follow` instead: its LB state mirrors the
//! writer's decisions from the Services' status, and it writes nothing.
//! In cluster mode an agent that is not the assigner keeps no reflector
//! at all (#47 item 4): the Services and pools are watched by one agent of
//! the cluster, not by each, and a new writer lists them when elected.
//!
//! What was applied is remembered only while this agent stays the writer:
//! a new writer (a restart, an assigner handover) applies everything once
//! (unchanged definitions change nothing in the LB state, so addresses
//! stay), and every [`FULL_RESYNC`] too.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Service;
use kube::api::{Api, Patch};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::Store;
use kube::{Client, Resource, ResourceExt};
use lockstep_core::lb::kubernetes::ownership::{self, Serving};
use lockstep_core::lb::kubernetes::{
    Invalid, Request, event_for, pool_outcome, pool_spec, service_outcome,
};
use lockstep_core::lb::{LbPoolSpec, ServiceSpec};
use serde_json::{Value, json};

use super::reflectors::{AbortOnDrop, drive};
pub use super::reflectors::{ServiceCache, Services};

use super::KubeError;
use super::backend::{LbBackend, LbState};
use super::crd::{LoadBalancerIPPool, POOL_FINALIZER};
use super::local_traffic::LocalAnswers;
use super::objects::{
    pool_conditions, pool_status_patch, service, service_condition, service_status_patch,
};

/// Services per LB apply or delete: under etcd's 128 operations per
/// transaction, which `lb apply` in cluster mode also keeps to.
pub const BATCH: usize = 100;
/// How often the pass forgets what it applied and applies everything again
/// (repairs a definition changed behind its back, e.g. by `lb apply`).
pub const FULL_RESYNC: Duration = Duration::from_secs(300);
/// Status patches in flight at once.
const PATCHES_IN_FLIGHT: usize = 64;
/// How often an agent that is not the LB writer (and does not follow it)
/// asks whether it became the writer, besides each state the assigner
/// stores.
pub const WRITER_POLL: Duration = Duration::from_secs(2);

/// How [`LbSync::serve`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Served {
    /// Told to stop.
    Stopped,
    /// Another agent is the writer.
    NotWriter,
}

/// A status patch to send, with the Event to publish once it landed
/// (warning, reason, note).
type StatusWrite = (Arc<Service>, Value, Option<(bool, String, String)>);

/// Which Services the loop serves (`[kubernetes] lb_class` and
/// `serve_classless`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Classes {
    /// The `spec.loadBalancerClass` served.
    pub class: String,
    /// Whether Services without a class are served too.
    pub classless: bool,
}

/// The loop's state.
pub struct LbSync<B: LbBackend> {
    client: Client,
    classes: Classes,
    backend: B,
    recorder: Recorder,
    applied_pools: BTreeMap<String, LbPoolSpec>,
    applied_services: BTreeMap<String, ServiceSpec>,
    /// Definitions the LB state refused, with why (kept until they change).
    refused_pools: BTreeMap<String, (Option<LbPoolSpec>, String)>,
    refused_services: BTreeMap<String, (ServiceSpec, String)>,
    /// Patches sent (without their times), by object uid, with the
    /// `resourceVersion` they were made from: not sent again until the
    /// reflector has seen them.
    written: HashMap<String, (Option<String>, Value)>,
    was_writer: bool,
    /// Mirroring the elected writer's decisions (`follow`).
    following: bool,
    /// Unknown fields already logged (`super::note_unknown`).
    unknown_seen: BTreeSet<String>,
    last_full: tokio::time::Instant,
    /// The Services' reflector, when given ([`LbSync::with_services`]).
    cache: Option<ServiceCache>,
    /// The `Local` Services' elections, when they run.
    local: Option<tokio::sync::watch::Receiver<LocalAnswers>>,
}

mod follow;

/// The next change of the `Local` Services without endpoints (never
/// without the elections).
async fn unserved_changed(local: &mut Option<tokio::sync::watch::Receiver<LocalAnswers>>) {
    if let Some(rx) = local {
        let was = rx.borrow().unserved.clone();
        if rx.wait_for(|l| l.unserved != was).await.is_ok() {
            return;
        }
    }
    std::future::pending().await
}

/// The next change of the backend's state (never without one).
async fn changed(changes: &mut Option<tokio::sync::watch::Receiver<i64>>) {
    if let Some(rx) = changes
        && rx.changed().await.is_ok()
    {
        return;
    }
    // None, or gone with its sender: the polls remain.
    std::future::pending().await
}

fn api_err(what: impl Into<String>) -> impl FnOnce(kube::Error) -> KubeError {
    let what = what.into();
    move |source| KubeError::Api {
        what,
        source: Box::new(source),
    }
}

/// Whether an API error only means "read again and retry" (the object
/// changed or went meanwhile).
fn is_stale(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409 || s.code == 404)
}

impl<B: LbBackend> LbSync<B> {
    /// A loop serving `classes`, reporting as `node`.
    pub fn new(client: Client, classes: Classes, node: String, backend: B) -> Self {
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: "lockstep".into(),
                instance: Some(node),
            },
        );
        Self {
            client,
            classes,
            backend,
            recorder,
            applied_pools: BTreeMap::new(),
            applied_services: BTreeMap::new(),
            refused_pools: BTreeMap::new(),
            refused_services: BTreeMap::new(),
            written: HashMap::new(),
            was_writer: false,
            following: false,
            unknown_seen: BTreeSet::new(),
            last_full: tokio::time::Instant::now(),
            cache: None,
            local: None,
        }
    }

    /// Reads Services from `cache` (shared) rather than its own reflector.
    #[must_use]
    pub fn with_services(mut self, cache: ServiceCache) -> Self {
        self.cache = Some(cache);
        self
    }

    /// Writes on each `Local` Service whether any node answers for it, as
    /// `local` says.
    #[must_use]
    pub fn with_local(mut self, local: tokio::sync::watch::Receiver<LocalAnswers>) -> Self {
        self.local = Some(local);
        self
    }

    /// Runs until `stop`. An agent that mirrors the writer
    /// ([`LbBackend::follows`]) keeps the Services and pools in memory all
    /// along; one that does not (cluster mode) only while it is the writer
    /// (#47 item 4): a non-writer asks again on each state the assigner
    /// stores and every [`WRITER_POLL`], reading the mirror, not etcd.
    pub async fn run(mut self, mut stop: tokio::sync::watch::Receiver<bool>) {
        if self.backend.follows() {
            self.serve(&mut stop).await;
            return;
        }
        let mut assigned = self.backend.changes();
        loop {
            while !matches!(self.backend.state().await, Ok(s) if s.writer) {
                tokio::select! {
                    () = changed(&mut assigned) => {}
                    () = tokio::time::sleep(WRITER_POLL) => {}
                    _ = stop.wait_for(|s| *s) => return,
                }
            }
            tracing::info!("kubernetes: the LB writer; watching Services and lb pools");
            if self.serve(&mut stop).await == Served::Stopped {
                return;
            }
            tracing::info!(
                "kubernetes: no longer the LB writer; Services and lb pools no longer watched"
            );
        }
    }

    /// Serves from the Services cache (the one given, else its own) and a
    /// reflector of the pools until `stop`, or, for an agent that does not
    /// follow the writer, until it is not the writer; the reflectors end
    /// with it.
    async fn serve(&mut self, stop: &mut tokio::sync::watch::Receiver<bool>) -> Served {
        let cache = self
            .cache
            .take()
            .unwrap_or_else(|| ServiceCache::start(&self.client));
        let (mut listed, wake) = (cache.services, cache.wake);
        let _svc_task = AbortOnDrop(cache.task);
        let services = listed.store.clone();
        let (pools, pool_task) = drive(
            Api::<LoadBalancerIPPool>::all(self.client.clone()),
            wake.clone(),
        );
        let _pool_task = AbortOnDrop(pool_task);
        let ready = async {
            listed.listed().await;
            let _ = pools.wait_until_ready().await;
        };
        tokio::select! {
            () = ready => {}
            _ = stop.wait_for(|s| *s) => return Served::Stopped,
        }
        tracing::info!("kubernetes: services and lb pools listed; serving LoadBalancer services");
        let mut poll = Duration::ZERO;
        let mut assigned = self.backend.changes();
        let mut local = self.local.clone();
        loop {
            let woke = tokio::select! {
                () = wake.notified() => Some(true),
                () = unserved_changed(&mut local) => Some(false),
                // New addresses to write: no burst to wait for.
                () = changed(&mut assigned) => Some(false),
                () = tokio::time::sleep(poll) => Some(false),
                _ = stop.wait_for(|s| *s) => None,
            };
            match woke {
                None => return Served::Stopped,
                // A burst of changes lands in one pass.
                Some(true) => tokio::time::sleep(Duration::from_millis(10)).await,
                Some(false) => {}
            }
            poll = match self.pass(&services, &pools).await {
                Ok(_) if !self.was_writer && !self.backend.follows() => return Served::NotWriter,
                Ok(pending) => self.backend.poll_every(pending),
                Err(e) => {
                    tracing::warn!(error = %crate::error_chain(&e), "kubernetes: pass failed; trying again");
                    Duration::from_secs(1)
                }
            };
        }
    }

    fn forget(&mut self) {
        self.applied_pools.clear();
        self.applied_services.clear();
        self.refused_pools.clear();
        self.refused_services.clear();
        self.written.clear();
        self.last_full = tokio::time::Instant::now();
    }

    /// One pass; whether services are still waiting for the LB state.
    ///
    /// # Errors
    /// The LB state unreadable or not written (the pass is tried again).
    pub async fn pass(
        &mut self,
        services: &Store<Service>,
        pools: &Store<LoadBalancerIPPool>,
    ) -> Result<bool, KubeError> {
        let begun = tokio::time::Instant::now();
        let mut state = self.backend.state().await?;
        let state_read = begun.elapsed();
        if !state.writer {
            if self.was_writer {
                tracing::info!("kubernetes: no longer the LB writer");
            }
            self.was_writer = false;
            if !self.backend.follows() {
                return Ok(false);
            }
            if !self.following || self.last_full.elapsed() >= FULL_RESYNC {
                self.forget();
                self.following = true;
            }
            self.follow(services, pools, &state).await?;
            return Ok(false);
        }
        self.following = false;
        if !self.was_writer || self.last_full.elapsed() >= FULL_RESYNC {
            self.forget();
            self.was_writer = true;
        }
        let started = tokio::time::Instant::now();
        let pools = pools.state();
        for p in &pools {
            super::note_unknown(
                &mut self.unknown_seen,
                "LoadBalancerIPPool",
                &p.name_any(),
                &p.spec.unknown,
            );
        }
        let svcs = services.state();
        // The pools as defined (an address in one may be adopted); some
        // defined or still in the state: lockstep may write on Services.
        let defined: Vec<LbPoolSpec> = pools
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter_map(|p| pool_spec(&p.to_core()).ok())
            .collect();
        let pools_exist = !defined.is_empty() || !state.pools.is_empty();
        let serving = Serving {
            class: &self.classes.class,
            classless: self.classes.classless,
            pools: &defined,
        };
        let requests: Vec<(Arc<Service>, Request)> = svcs
            .iter()
            .map(|s| (s.clone(), ownership::request(&service(s), &serving)))
            .collect();
        // The assigner assigns after the apply (cluster mode): what the
        // state as read has assigned is written while new services are
        // stored, not after (#28: a burst of Services would otherwise
        // wait a store longer for each status).
        let early = if self.backend.assigns_on_apply() {
            Vec::new()
        } else {
            self.plan_services(&requests, &state, pools_exist).1
        };
        let early_sent = early.len();
        let send = send_statuses(self.client.clone(), self.recorder.clone(), early);
        let sync = async {
            let pools_changed = self.sync_pools(&pools, &state).await?;
            let (applied, deleted) = self.sync_services(&requests, &state).await?;
            Ok::<_, KubeError>((pools_changed, applied, deleted))
        };
        let (synced, sent) = futures::join!(sync, send);
        self.wrote(sent);
        let (pools_changed, applied, deleted) = synced?;
        let added = applied > 0;
        let synced = started.elapsed();
        let changed = pools_changed || added || deleted;
        // Only new services stored, and the assigner assigns later: the
        // state as read says all there is; the assigner's next stored
        // state wakes the loop (`LbBackend::changes`).
        if pools_changed || deleted || (added && self.backend.assigns_on_apply()) {
            state = self.backend.state().await?;
        }
        let read = started.elapsed();
        // Everything not written yet: what the re-read state says, and
        // services refused in this pass.
        let (pending, patches) = self.plan_services(&requests, &state, pools_exist);
        let patched = early_sent + patches.len();
        let sent = send_statuses(self.client.clone(), self.recorder.clone(), patches).await;
        self.wrote(sent);
        self.write_pools(&pools, &state).await;
        tracing::debug!(
            services = requests.len(),
            changed,
            applied,
            patched,
            pending,
            state_ms = state_read.as_millis(),
            synced_ms = synced.as_millis(),
            read_ms = read.as_millis(),
            total_ms = started.elapsed().as_millis(),
            "kubernetes: pass"
        );
        Ok(pending || !state.pending.is_empty())
    }

    async fn sync_pools(
        &mut self,
        pools: &[Arc<LoadBalancerIPPool>],
        state: &LbState,
    ) -> Result<bool, KubeError> {
        let api: Api<LoadBalancerIPPool> = Api::all(self.client.clone());
        let mut apply = Vec::new();
        let mut gone = Vec::new();
        let mut finalize = Vec::new();
        for p in pools {
            let name = p.name_any();
            let has_finalizer = p.finalizers().iter().any(|f| f == POOL_FINALIZER);
            if p.metadata.deletion_timestamp.is_some() {
                if has_finalizer {
                    if state.pools.contains_key(&name) {
                        gone.push(name);
                    }
                    finalize.push(p.clone());
                }
                continue;
            }
            let spec = match pool_spec(&p.to_core()) {
                Ok(spec) => spec,
                Err(i) => {
                    self.refused_pools.insert(name, (None, i.to_string()));
                    continue;
                }
            };
            if let Some((None, _)) = self.refused_pools.get(&name) {
                self.refused_pools.remove(&name);
            }
            let refused_same =
                matches!(self.refused_pools.get(&name), Some((Some(s), _)) if *s == spec);
            if self.applied_pools.get(&name) == Some(&spec) || refused_same {
                continue;
            }
            if !has_finalizer {
                let mut list = p.finalizers().to_vec();
                list.push(POOL_FINALIZER.into());
                let patch = json!({"metadata": {"resourceVersion": p.resource_version(), "finalizers": list}});
                match api
                    .patch(&name, &super::patch_params(), &Patch::Merge(&patch))
                    .await
                {
                    Ok(_) => {}
                    Err(e) if is_stale(&e) => continue,
                    Err(e) => return Err(api_err(format!("finalizer on pool {name}"))(e)),
                }
            }
            apply.push(spec);
        }
        let mut changed = false;
        for spec in apply {
            let name = spec.name.clone();
            match self.backend.apply(vec![spec.clone()], Vec::new()).await {
                Ok(()) => {
                    self.refused_pools.remove(&name);
                    self.applied_pools.insert(name, spec);
                    changed = true;
                }
                Err(KubeError::Refused { reason }) => {
                    tracing::warn!(pool = %name, %reason, "kubernetes: lb pool refused");
                    self.refused_pools.insert(name, (Some(spec), reason));
                }
                Err(e) => return Err(e),
            }
        }
        if !gone.is_empty() {
            self.backend.delete(Vec::new(), gone.clone()).await?;
            for name in &gone {
                self.applied_pools.remove(name);
            }
            changed = true;
        }
        for p in finalize {
            let name = p.name_any();
            let list: Vec<&String> = p
                .finalizers()
                .iter()
                .filter(|f| *f != POOL_FINALIZER)
                .collect();
            let patch =
                json!({"metadata": {"resourceVersion": p.resource_version(), "finalizers": list}});
            match api
                .patch(&name, &super::patch_params(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => {}
                Err(e) if is_stale(&e) => {}
                Err(e) => return Err(api_err(format!("finalizer off pool {name}"))(e)),
            }
            self.refused_pools.remove(&name);
        }
        Ok(changed)
    }

    async fn sync_services(
        &mut self,
        requests: &[(Arc<Service>, Request)],
        state: &LbState,
    ) -> Result<(usize, bool), KubeError> {
        let wanted: BTreeMap<String, &ServiceSpec> = requests
            .iter()
            .filter_map(|(_, r)| match r {
                Request::Wanted(spec) => Some((spec.id(), spec)),
                _ => None,
            })
            .collect();
        let apply: Vec<ServiceSpec> = wanted
            .iter()
            .filter(|(id, spec)| {
                self.applied_services.get(*id) != Some(**spec)
                    && self.refused_services.get(*id).map(|(s, _)| s) != Some(**spec)
            })
            .map(|(_, s)| (*s).clone())
            .collect();
        let mut added = 0;
        for chunk in apply.chunks(BATCH) {
            match self.backend.apply(Vec::new(), chunk.to_vec()).await {
                Ok(()) => {
                    for s in chunk {
                        self.refused_services.remove(&s.id());
                        self.applied_services.insert(s.id(), s.clone());
                    }
                    added += chunk.len();
                }
                // One refused service must not hold the others back.
                Err(KubeError::Refused { .. }) => {
                    for s in chunk {
                        match self.backend.apply(Vec::new(), vec![s.clone()]).await {
                            Ok(()) => {
                                self.refused_services.remove(&s.id());
                                self.applied_services.insert(s.id(), s.clone());
                                added += 1;
                            }
                            Err(KubeError::Refused { reason }) => {
                                self.refused_services.insert(s.id(), (s.clone(), reason));
                            }
                            Err(e) => return Err(e),
                        }
                    }
                }
                Err(e) => return Err(e),
            }
        }
        let gone: Vec<String> = state
            .stored_services()
            .into_iter()
            .filter(|id| !wanted.contains_key(id))
            .collect();
        let deleted = !gone.is_empty();
        for chunk in gone.chunks(BATCH) {
            self.backend.delete(chunk.to_vec(), Vec::new()).await?;
        }
        let keep: BTreeSet<&String> = wanted.keys().collect();
        self.applied_services.retain(|id, _| keep.contains(id));
        self.refused_services.retain(|id, _| keep.contains(id));
        Ok((added, deleted))
    }

    /// The status patches of Services whose status differs from what was
    /// written; whether some service of lockstep's is not in the LB state
    /// yet.
    fn plan_services(
        &self,
        requests: &[(Arc<Service>, Request)],
        state: &LbState,
        pools_exist: bool,
    ) -> (bool, Vec<StatusWrite>) {
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        let unserved = self
            .local
            .as_ref()
            .map(|l| l.borrow().unserved.clone())
            .unwrap_or_default();
        let mut pending = false;
        let mut patches: Vec<StatusWrite> = Vec::new();
        for (svc, req) in requests {
            let outcome = match req {
                Request::NotOurs => None,
                Request::Invalid(i) => service_outcome(None, Some(i)),
                Request::Wanted(spec) => {
                    let id = spec.id();
                    let o = match self.refused_services.get(&id) {
                        Some((_, reason)) => service_outcome(
                            None,
                            Some(&Invalid {
                                field: "spec".into(),
                                problem: reason.clone(),
                            }),
                        ),
                        None => service_outcome(state.services.get(&id), None),
                    };
                    if o.is_none() {
                        pending = true;
                        continue;
                    }
                    o
                }
            };
            let key = format!("{}/{}", svc.namespace().unwrap_or_default(), svc.name_any());
            let Some(patch) = service_status_patch(
                svc,
                outcome.as_ref(),
                pools_exist,
                unserved.contains(&key),
                &now,
            ) else {
                continue;
            };
            let uid = svc.uid().unwrap_or_default();
            let from = svc.resource_version();
            if self.written.get(&uid) == Some(&(from.clone(), timeless(&patch))) {
                continue;
            }
            let event = outcome
                .as_ref()
                .and_then(|o| event_for(service_condition(svc).as_ref(), &o.condition));
            patches.push((svc.clone(), patch, event));
        }
        (pending, patches)
    }

    /// Remembers the patches that landed.
    fn wrote(&mut self, sent: Vec<Sent>) {
        for (uid, rv, patch) in sent {
            self.written.insert(uid, (rv, patch));
        }
    }

    async fn write_pools(&mut self, pools: &[Arc<LoadBalancerIPPool>], state: &LbState) {
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        let api: Api<LoadBalancerIPPool> = Api::all(self.client.clone());
        for p in pools {
            if p.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let name = p.name_any();
            let refused = self.refused_pools.get(&name).map(|(_, r)| r.as_str());
            let want = pool_outcome(state.pools.get(&name), refused);
            let Some(patch) = pool_status_patch(p, &want, &now) else {
                continue;
            };
            let uid = p.uid().unwrap_or_default();
            let from = p.resource_version();
            let key = timeless(&patch);
            if self.written.get(&uid) == Some(&(from.clone(), key.clone())) {
                continue;
            }
            let before = pool_conditions(p);
            match api
                .patch_status(&name, &super::patch_params(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => {}
                Err(e) if is_stale(&e) => continue,
                Err(e) => {
                    tracing::warn!(pool = %name, error = %crate::error_chain(&e), "kubernetes: pool status not written");
                    continue;
                }
            }
            for c in &want.conditions {
                let had = before.iter().find(|b| b.type_ == c.type_);
                if c.is_failure()
                    && let Some((warning, reason, note)) = event_for(had, c)
                {
                    publish(&self.recorder, &p.object_ref(&()), warning, reason, note).await;
                }
            }
            self.written.insert(uid, (from, key));
        }
    }
}

/// A status patch that landed: the object's uid, the `resourceVersion` it
/// was made from, and the patch without its times.
type Sent = (String, Option<String>, Value);

/// Sends status patches, [`PATCHES_IN_FLIGHT`] at once, each Event once
/// its patch landed; returns those that landed. Owns what it uses, so it
/// runs beside the pass's LB apply.
async fn send_statuses(client: Client, recorder: Recorder, patches: Vec<StatusWrite>) -> Vec<Sent> {
    let recorder = &recorder;
    let done: Vec<Option<Sent>> = futures::stream::iter(patches)
        .map(|(svc, patch, event)| {
            let client = client.clone();
            async move {
                let ns = svc.namespace().unwrap_or_default();
                let api: Api<Service> = Api::namespaced(client, &ns);
                match api
                    .patch_status(&svc.name_any(), &super::patch_params(), &Patch::Merge(&patch))
                    .await
                {
                    Ok(_) => {}
                    Err(e) if is_stale(&e) => return None,
                    Err(e) => {
                        tracing::warn!(service = %format!("{ns}/{}", svc.name_any()), error = %crate::error_chain(&e), "kubernetes: service status not written");
                        return None;
                    }
                }
                // Off the status path: an Event is best effort and
                // must not delay the next Service's status.
                if let Some((warning, reason, note)) = event {
                    let recorder = recorder.clone();
                    let reference = svc.object_ref(&());
                    tokio::spawn(async move {
                        publish(&recorder, &reference, warning, reason, note).await;
                    });
                }
                Some((svc.uid().unwrap_or_default(), svc.resource_version(), timeless(&patch)))
            }
        })
        .buffer_unordered(PATCHES_IN_FLIGHT)
        .collect()
        .await;
    done.into_iter().flatten().collect()
}

/// What a patch says, without the times it carries: two passes that want
/// the same status make the same key though the clock moved.
fn timeless(patch: &Value) -> Value {
    let mut v = patch.clone();
    if let Some(cs) = v["status"]["conditions"].as_array_mut() {
        for c in cs {
            if let Some(o) = c.as_object_mut() {
                o.remove("lastTransitionTime");
            }
        }
    }
    v
}

/// Publishes an Event about `reference`; a failure is logged only (Events
/// are best effort everywhere in Kubernetes).
async fn publish(
    recorder: &Recorder,
    reference: &k8s_openapi::api::core::v1::ObjectReference,
    warning: bool,
    reason: String,
    note: String,
) {
    let ev = Event {
        type_: if warning {
            EventType::Warning
        } else {
            EventType::Normal
        },
        reason,
        note: Some(note),
        action: "AssignAddress".into(),
        secondary: None,
    };
    if let Err(e) = recorder.publish(&ev, reference).await {
        tracing::debug!(error = %crate::error_chain(&e), "kubernetes: event not published");
    }
}
