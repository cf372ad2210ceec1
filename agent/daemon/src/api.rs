//! The agent API: HTTP/JSON over a unix socket (mode 0600, root only).
//!
//! Paths are versioned (`/v1/...`). Bodies are limited to [`MAX_BODY`]; every
//! error is a JSON body `{"error": {"code": ..., "message": ...}}` with a
//! stable code, including malformed JSON, unknown fields, wrong types,
//! oversized bodies, unknown paths and wrong methods. A request head the
//! server cannot take is refused before routing, in the same shape
//! (`server::head`): `bad_request` (400: a malformed request line or
//! header, a `Content-Length` that is not a length), `request_timeout`
//! (408), `too_large` (413: a declared body over the limit),
//! `uri_too_long` (414: over 8 KiB) and `headers_too_large` (431: over 100
//! fields or 32 KiB). One request is served per connection. Owners are
//! checked by the core's rules (`lockstep_core::owner`) before the agent
//! sees them: `invalid_request` naming the field. Handlers run the agent's
//! synchronous operations on the blocking pool, one at a time under its lock.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Serialize;

use crate::agent::endpoints::{
    DelRequest, EndpointRequest, GcRequest, Inline, endpoint_add_concurrent, endpoint_add_inline,
    endpoint_del_concurrent, endpoint_del_inline, endpoint_gc_concurrent,
};
use crate::agent::lb::{LbApply, LbDelete};
use crate::agent::{Agent, AgentError, AgentHandle, AllocateRequest, ReleaseRequest};
use crate::metrics::Metrics;

/// Largest request body accepted.
pub const MAX_BODY: usize = 64 * 1024;

/// Shared state of the handlers.
#[derive(Clone, Debug)]
pub struct AppState {
    /// The agent's owner; it holds no agent while the agent is starting.
    pub agent: AgentHandle,
    /// Why the agent could not start and waits for an operator (a store
    /// that cannot be opened); `None` while it is starting or running.
    pub held: Arc<Mutex<Option<String>>>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Cluster mode's state, once started (never set in single-node mode).
    pub cluster: Arc<std::sync::OnceLock<Arc<crate::cluster::ClusterHandle>>>,
    /// Cluster mode's LB agent, once started: `lockstep lb` reads and
    /// writes etcd through it.
    pub lb_cluster: Arc<std::sync::OnceLock<Arc<crate::cluster::LbHandle>>>,
    /// Kubernetes: the pods of this node, once watched (`[kubernetes]`):
    /// an ADD naming no pool gets the pool its pod's annotation picks.
    pub pod_pools: Arc<std::sync::OnceLock<PodPools>>,
    /// BGP: what the speaker knows of BIRD, once it runs (`[bgp]`).
    pub bgp: Arc<std::sync::OnceLock<tokio::sync::watch::Receiver<crate::wire::BgpStatus>>>,
    /// Kubernetes: the leaks the last check found, for `verify`.
    pub leaks: Arc<std::sync::OnceLock<Arc<crate::kubernetes::leaks::LeakReport>>>,
}

/// What an ADD needs to pick its pool by annotation.
#[derive(Clone)]
pub struct PodPools {
    /// The cache of this node's pods and every namespace.
    pub view: Arc<dyn crate::kubernetes::pods::PodView>,
    /// How long an ADD waits for its pod to reach the cache.
    pub wait: std::time::Duration,
}

impl std::fmt::Debug for PodPools {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodPools")
            .field("listed", &self.view.listed())
            .field("wait", &self.wait)
            .finish_non_exhaustive()
    }
}

/// An API error: HTTP status, stable code, message.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = crate::wire::ErrorReply {
            error: crate::wire::ErrorBody {
                code: self.code.to_string(),
                message: self.message,
            },
        };
        (self.status, Json(body)).into_response()
    }
}

impl From<AgentError> for ApiError {
    fn from(e: AgentError) -> Self {
        let status = match e.code() {
            "not_ready" | "etcd_unavailable" => StatusCode::SERVICE_UNAVAILABLE,
            "unknown_pool" | "not_found" => StatusCode::NOT_FOUND,
            "pool_exhausted" | "map_full" => StatusCode::INSUFFICIENT_STORAGE,
            "check_failed" | "busy" => StatusCode::CONFLICT,
            "address_taken" | "owner_holds_other" | "stale_generation" | "cidr_draining" => {
                StatusCode::CONFLICT
            }
            "invalid_request" | "address_outside_pool" | "address_unusable" => {
                StatusCode::BAD_REQUEST
            }
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        // The whole cause chain, so the client sees why.
        ApiError::new(status, e.code(), crate::error_chain(&e))
    }
}

impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> Self {
        let status = r.status();
        let code = match &r {
            JsonRejection::MissingJsonContentType(_) => "unsupported_media_type",
            JsonRejection::JsonSyntaxError(_) => "bad_json",
            JsonRejection::JsonDataError(_) => "bad_request",
            _ if status == StatusCode::PAYLOAD_TOO_LARGE => "too_large",
            _ => "bad_request",
        };
        ApiError::new(status, code, r.body_text())
    }
}

impl From<lockstep_core::owner::OwnerError> for ApiError {
    fn from(e: lockstep_core::owner::OwnerError) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", e.to_string())
    }
}

/// Checks an attachment named by a request, by the rules every door applies
/// (the plugin checks its environment by the same ones).
fn attachment(container_id: &str, ifname: &str) -> Result<(), ApiError> {
    lockstep_core::owner::Attachment::new(container_id, ifname)?;
    Ok(())
}

/// Runs an agent operation on the blocking pool.
/// Why the agent answers nothing yet: held for an operator, or restoring.
fn not_ready(held: &Mutex<Option<String>>) -> AgentError {
    AgentError::NotReady {
        reason: held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
            .unwrap_or_else(|| "restoring allocations and maps".into()),
    }
}

/// Runs `f` as a command on the agent's owner.
async fn with_agent<T: Send + 'static>(
    state: &AppState,
    f: impl FnOnce(&mut Agent) -> Result<T, AgentError> + Send + 'static,
) -> Result<T, ApiError> {
    let held = state.held.clone();
    state
        .agent
        .ask(move |slot| match slot.as_mut() {
            Some(agent) => f(agent).map_err(ApiError::from),
            None => Err(ApiError::from(not_ready(&held))),
        })
        .await?
}

/// The agent's status from the owner's published view: answered at once,
/// however busy the owner is (a long reconcile, a burst of CNI calls).
fn published_status(state: &AppState) -> Result<crate::agent::Status, ApiError> {
    state
        .agent
        .view()
        .status()
        .ok_or_else(|| ApiError::from(not_ready(&state.held)))
}

fn ok<T: Serialize>(v: T) -> Response {
    Json(v).into_response()
}

async fn status(State(s): State<AppState>) -> Result<Response, ApiError> {
    match published_status(&s) {
        Ok(st) if s.cluster.get().is_none() && s.bgp.get().is_none() => Ok(ok(st)),
        Ok(st) => {
            let mut v = serde_json::to_value(&st).map_err(|e| {
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string())
            })?;
            // Cluster mode adds what STATUS needs: whether etcd answers, and
            // which pools claim blocks on demand.
            if let Some(c) = s.cluster.get() {
                v["cluster"] = serde_json::json!(crate::wire::ClusterStatus {
                    etcd_unreachable: c.etcd_problem(),
                    pools: c.pools(),
                    fenced: c.fenced(),
                    configured_overlaps: c.overlaps(),
                });
            }
            // BGP: the sessions and what BIRD announces.
            if let Some(b) = s.bgp.get() {
                v["bgp"] = serde_json::json!(*b.borrow());
            }
            Ok(ok(v))
        }
        // Status is always answered, ready or not.
        Err(e) if e.code == "not_ready" => Ok(ok(crate::wire::Readiness {
            version: crate::version::version(),
            ready: false,
            reason: Some(e.message),
            default_pool: None,
            cluster: None,
        })),
        Err(e) => Err(e),
    }
}

/// Never waits for the agent's owner: its gauges are as the owner's last
/// batch left the agent (refreshed before that batch was answered), its
/// datapath counters at most [`crate::metrics::REFRESH_EVERY`] old.
async fn metrics(State(s): State<AppState>, headers: HeaderMap) -> Result<Response, ApiError> {
    s.metrics.observe_owner(&s.agent);
    if !s.metrics.refreshed() {
        return Err(ApiError::from(not_ready(&s.held)));
    }
    let openmetrics = crate::metrics::text::wants_openmetrics(
        headers
            .get(axum::http::header::ACCEPT)
            .and_then(|v| v.to_str().ok()),
    );
    let text = s.metrics.encode(
        s.cluster.get().map(Arc::as_ref),
        s.lb_cluster.get().map(Arc::as_ref),
        openmetrics,
    );
    let content_type = if openmetrics {
        crate::metrics::text::OPENMETRICS
    } else {
        crate::metrics::text::TEXT
    };
    Ok(([("content-type", content_type)], text).into_response())
}

/// Liveness (`/healthz`): 200 while every loop the agent runs made
/// progress within its bound, 503 naming the loops that did not (a hung
/// agent the kubelet should restart).
async fn healthz(State(s): State<AppState>) -> Response {
    let stale = s.metrics.heartbeats.stale();
    if stale.is_empty() {
        (StatusCode::OK, "ok\n").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not making progress: {}\n", stale.join("; ")),
        )
            .into_response()
    }
}

/// Readiness (`/readyz`): 200 once the store is open, the maps reconciled
/// and CNI calls served (what `lockstep status` calls ready), 503 with the
/// reason otherwise.
async fn readyz(State(s): State<AppState>) -> Response {
    match published_status(&s) {
        Ok(st) if st.ready => (StatusCode::OK, "ready\n").into_response(),
        Ok(st) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "not ready: {}\n",
                st.reason.unwrap_or_else(|| "unknown".into())
            ),
        )
            .into_response(),
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {}\n", e.message),
        )
            .into_response(),
    }
}

/// The metrics router (served on its own TCP listener): `/metrics` and
/// the health probes.
pub fn metrics_router(state: AppState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .fallback(not_found)
        .with_state(state)
}

async fn pools(State(s): State<AppState>) -> Result<Response, ApiError> {
    Ok(ok(with_agent(&s, |a| Ok(a.pools())).await?))
}

async fn release_draining(
    State(s): State<AppState>,
    body: Result<Json<crate::agent::draining::ReleaseDrainingRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(req) = body?;
    Ok(ok(with_agent(&s, move |a| a.release_draining(req)).await?))
}

async fn allocations(State(s): State<AppState>) -> Result<Response, ApiError> {
    Ok(ok(with_agent(&s, |a| Ok(a.allocations())).await?))
}

async fn allocate(
    State(s): State<AppState>,
    body: Result<Json<AllocateRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(req) = body?;
    req.owner.validate_requested()?;
    let started = Instant::now();
    let result = with_block(&s, || {
        let req = req.clone();
        with_agent(&s, move |a| a.allocate(req))
    })
    .await;
    s.metrics.observe_allocation(started.elapsed());
    Ok((StatusCode::OK, Json(result?)).into_response())
}

/// Runs `attempt`; in cluster mode, when it found a cluster pool with no
/// free address, waits for the room a claim or a grown reservation window
/// brings and runs it again, for at most 1.8 s in all, so an allocation on
/// a node whose blocks ran out (or that has none yet) is served as soon as
/// etcd gives room; etcd unreachable answers "try again later" (503,
/// `etcd_unavailable`) naming etcd.
async fn with_block<T, F, Fut>(s: &AppState, mut attempt: F) -> Result<T, ApiError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, ApiError>>,
{
    let Some(cluster) = s.cluster.get() else {
        return attempt().await;
    };
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_millis(1800);
    loop {
        // Taken before the attempt: room made between the attempt and the
        // wait is not waited for in vain.
        let seen = cluster.claims_seen();
        let e = match attempt().await {
            Err(e) => e,
            ok => return ok,
        };
        let Some(pool) = exhausted_cluster_pool(&e, cluster) else {
            return Err(e);
        };
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if let Err(why) = cluster.need_block(&pool, left, &seen).await {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "etcd_unavailable",
                format!(
                    "cluster pool {pool} has no free address on this node (its blocks, or the \
                     reservation window it published, used up) and etcd gave no more room: {why}"
                ),
            ));
        }
    }
}

async fn release(
    State(s): State<AppState>,
    body: Result<Json<ReleaseRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(req) = body?;
    req.owner.validate()?;
    Ok(ok(with_agent(&s, move |a| a.release(req)).await?))
}

async fn verify(State(s): State<AppState>) -> Result<Response, ApiError> {
    let mut report = with_agent(&s, |a| a.verify()).await?;
    // Cluster mode: etcd keys every read skips are not drift of this node,
    // but nobody may overlook them.
    if let Some(c) = s.cluster.get() {
        report.unreadable = c.unreadable();
        report.identity = c.identity().into_iter().collect();
        report.ok &= report.unreadable.is_empty() && report.identity.is_empty();
    }
    // Kubernetes: endpoint allocations whose pod is gone.
    if let Some(leaks) = s.leaks.get() {
        report.leaked = leaks.describe();
        report.ok &= report.leaked.is_empty();
    }
    Ok(ok(report))
}

async fn reconcile(State(s): State<AppState>) -> Result<Response, ApiError> {
    Ok(ok(with_agent(&s, |a| a.reconcile()).await?))
}

async fn cni_add(
    State(s): State<AppState>,
    body: Result<Json<EndpointRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(mut req) = body?;
    let pod = req.pod.as_ref().map(ToString::to_string);
    let (container, ifname) = (req.container_id.clone(), req.ifname.clone());
    let started = Instant::now();
    let result = async {
        attachment(&req.container_id, &req.ifname)?;
        let picked = pick_pool(&s, &mut req).await?;
        with_block(&s, || add_once(&s, req.clone()))
            .await
            .map_err(|e| match (&picked, e.code) {
                (Some(why), "unknown_pool") => ApiError {
                    message: format!("{} (the pool {why})", e.message),
                    ..e
                },
                (_, _) => e,
            })
    }
    .await;
    s.metrics.observe_allocation(started.elapsed());
    let result = result.inspect_err(|e| cni_failed("ADD", pod.as_deref(), &container, &ifname, e));
    Ok(ok(result?))
}

/// Logs a CNI call that failed, naming the pod (when the runtime said
/// which), the container, the interface and the error: the runtime shows
/// the error on the pod, and the node's operator finds it here.
fn cni_failed(command: &str, pod: Option<&str>, container: &str, ifname: &str, e: &ApiError) {
    tracing::warn!(
        command,
        pod = pod.unwrap_or("-"),
        container,
        ifname,
        code = e.code,
        error = %e.message,
        "CNI {command} failed"
    );
}

/// An ADD naming no pool, for a Kubernetes pod: the pool its annotation
/// (else its namespace's) picks (`kubernetes::pods`). Returns where the
/// pick came from, for errors.
async fn pick_pool(s: &AppState, req: &mut EndpointRequest) -> Result<Option<String>, ApiError> {
    let (None, Some(pod), Some(pools)) = (&req.pool, &req.pod, s.pod_pools.get()) else {
        return Ok(None);
    };
    let pick = crate::kubernetes::pods::pick(&*pools.view, pod, pools.wait)
        .await
        .map_err(|e| match e {
            lockstep_core::pods::PodsError::PodNotSeen { .. } => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "pod_not_seen",
                e.to_string(),
            ),
            lockstep_core::pods::PodsError::BadAnnotation { .. } => {
                ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", e.to_string())
            }
        })?;
    let why = match pick.by {
        lockstep_core::pods::PickedBy::Pod => format!(
            "pod {pod}'s annotation {} names",
            lockstep_core::pods::POOL_ANNOTATION
        ),
        lockstep_core::pods::PickedBy::Namespace => format!(
            "namespace {}'s annotation {} names",
            pod.namespace,
            lockstep_core::pods::POOL_ANNOTATION
        ),
        lockstep_core::pods::PickedBy::Default => return Ok(None),
    };
    req.pool = pick.pool;
    Ok(Some(why))
}

/// The cluster pool an ADD found without a free address, if that is why
/// it failed.
fn exhausted_cluster_pool(e: &ApiError, cluster: &crate::cluster::ClusterHandle) -> Option<String> {
    if e.code != "pool_exhausted" {
        return None;
    }
    cluster
        .pools()
        .into_iter()
        .map(|p| p.name)
        .find(|p| e.message.contains(&format!("pool {p} has no free")))
}

async fn add_once(
    s: &AppState,
    req: EndpointRequest,
) -> Result<crate::wire::EndpointReply, ApiError> {
    let handle = s.agent.clone();
    // IPAM-only ADDs are served as one command on the agent's owner (a
    // commit and a few map writes); whether one
    // is is judged in the same command. Anything else goes to the blocking
    // pool untouched, to run in phases.
    let inline = handle
        .ask(move |slot| endpoint_add_inline(slot, req))
        .await?;
    let result = match inline {
        Inline::Done(r) => r,
        Inline::Blocking(req) => {
            tokio::task::spawn_blocking(move || endpoint_add_concurrent(&handle, req))
                .await
                .map_err(joined)?
        }
    };
    Ok(result?)
}

async fn cni_del(
    State(s): State<AppState>,
    body: Result<Json<DelRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(req) = body?;
    let (container, ifname) = (req.container_id.clone(), req.ifname.clone());
    del_once(&s, req)
        .await
        .inspect_err(|e| cni_failed("DEL", None, &container, &ifname, e))?;
    Ok(ok(crate::wire::Empty {}))
}

async fn del_once(s: &AppState, req: DelRequest) -> Result<(), ApiError> {
    attachment(&req.container_id, &req.ifname)?;
    let handle = s.agent.clone();
    let inline = handle
        .ask(move |slot| endpoint_del_inline(slot, req))
        .await?;
    match inline {
        // Committed on the owner; kernel work (a full attachment's veth)
        // only ever runs on the blocking pool.
        Inline::Done(cleanup) => {
            let cleanup = cleanup?;
            if !cleanup.is_empty() {
                tokio::task::spawn_blocking(move || cleanup.run())
                    .await
                    .map_err(joined)??;
            }
        }
        Inline::Blocking(req) => {
            tokio::task::spawn_blocking(move || endpoint_del_concurrent(&handle, req))
                .await
                .map_err(joined)??;
        }
    }
    Ok(())
}

fn joined(e: tokio::task::JoinError) -> ApiError {
    ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string())
}

async fn cni_check(
    State(s): State<AppState>,
    body: Result<Json<EndpointRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(req) = body?;
    let pod = req.pod.as_ref().map(ToString::to_string);
    let (container, ifname) = (req.container_id.clone(), req.ifname.clone());
    async {
        attachment(&req.container_id, &req.ifname)?;
        with_agent(&s, move |a| a.endpoint_check(req)).await
    }
    .await
    .inspect_err(|e| cni_failed("CHECK", pod.as_deref(), &container, &ifname, e))?;
    Ok(ok(crate::wire::Empty {}))
}

async fn cni_gc(
    State(s): State<AppState>,
    body: Result<Json<GcRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(req) = body?;
    for (i, (container_id, ifname)) in req.valid.iter().enumerate() {
        attachment(container_id, ifname).map_err(|e| ApiError {
            message: format!("valid[{i}]: {}", e.message),
            ..e
        })?;
    }
    let handle = s.agent.clone();
    let report = tokio::task::spawn_blocking(move || endpoint_gc_concurrent(&handle, req))
        .await
        .map_err(joined)??;
    Ok(ok(report))
}

async fn endpoints(State(s): State<AppState>) -> Result<Response, ApiError> {
    Ok(ok(with_agent(&s, |a| Ok(a.endpoints())).await?))
}

/// How long `lb apply` and `lb delete` in cluster mode wait for the
/// assigner (and, for a delete, the announcers) to act before answering.
const LB_APPLY_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

impl From<crate::cluster::ClusterStoreError> for ApiError {
    fn from(e: crate::cluster::ClusterStoreError) -> Self {
        use crate::cluster::ClusterStoreError as E;
        let (status, code) = match &e {
            E::Unavailable { .. } => (StatusCode::SERVICE_UNAVAILABLE, "etcd_unavailable"),
            E::Conflict { .. } => (StatusCode::CONFLICT, "busy"),
            E::Invalid(_) | E::Refused(_) | E::Rejected { .. } => {
                (StatusCode::BAD_REQUEST, "invalid_request")
            }
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        };
        ApiError::new(status, code, crate::error_chain(&e))
    }
}

async fn lb_get(State(s): State<AppState>) -> Result<Response, ApiError> {
    if let Some(lb) = s.lb_cluster.get() {
        return Ok(ok(lb.view().await?));
    }
    Ok(ok(with_agent(&s, |a| Ok(a.lb_view())).await?))
}

async fn lb_apply(
    State(s): State<AppState>,
    body: Result<Json<LbApply>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(req) = body?;
    if let Some(lb) = s.lb_cluster.get() {
        let pools = req.pools.clone();
        with_agent(&s, move |a| a.lb_check_node_pools(&pools)).await?;
        return Ok(ok(lb.apply(req.pools, req.services, LB_APPLY_WAIT).await?));
    }
    Ok(ok(with_agent(&s, move |a| a.lb_apply(req)).await?))
}

async fn lb_delete(
    State(s): State<AppState>,
    body: Result<Json<LbDelete>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(req) = body?;
    if let Some(lb) = s.lb_cluster.get() {
        return Ok(ok(lb
            .delete(req.services, req.pools, LB_APPLY_WAIT)
            .await?));
    }
    Ok(ok(with_agent(&s, move |a| a.lb_delete(req)).await?))
}

async fn not_found() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "no_such_path",
        "no such API path; see /v1/status",
    )
}

async fn wrong_method() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "method not allowed on this path",
    )
}

/// The API router.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/status", get(status))
        .route("/v1/pools", get(pools))
        .route("/v1/pools/release-draining", post(release_draining))
        .route("/v1/allocations", get(allocations).post(allocate))
        .route("/v1/release", post(release))
        .route("/v1/verify", get(verify))
        .route("/v1/reconcile", post(reconcile))
        .route("/v1/endpoints", get(endpoints))
        .route("/v1/lb", get(lb_get))
        .route("/v1/lb/apply", post(lb_apply))
        .route("/v1/lb/delete", post(lb_delete))
        .route("/v1/cni/add", post(cni_add))
        .route("/v1/cni/del", post(cni_del))
        .route("/v1/cni/check", post(cni_check))
        .route("/v1/cni/gc", post(cni_gc))
        .fallback(not_found)
        .method_not_allowed_fallback(wrong_method)
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .layer(axum::middleware::from_fn(utf8_only))
        .with_state(state)
}

/// Refuses a body declared in another charset than UTF-8: JSON is UTF-8
/// (RFC 8259), and `application/json; charset=utf-16` was parsed as if it
/// were.
async fn utf8_only(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Result<Response, ApiError> {
    let charset = request
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.split(';').skip(1).find_map(|param| {
                let (name, value) = param.split_once('=')?;
                name.trim()
                    .eq_ignore_ascii_case("charset")
                    .then(|| value.trim().trim_matches('"').to_ascii_lowercase())
            })
        });
    if let Some(charset) = charset
        && charset != "utf-8"
        && charset != "utf8"
    {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            format!(
                "charset {charset} is not accepted: send UTF-8 JSON (Content-Type: application/json)"
            ),
        ));
    }
    Ok(next.run(request).await)
}
