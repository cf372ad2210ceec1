//! Leaked endpoint allocations (#29 item 3): this node's endpoint
//! attachments compared with the pods the API says run here, every
//! `[kubernetes.pods] leak_check_every`.
//!
//! An attachment whose pod has been gone for `leak_grace` (the core's
//! [`LeakTracker`]) is asked about once more, straight from the API (a GET
//! of the pod): a cache that is behind (a watch broken, a relist slow) never
//! makes a live pod's address a leak. Confirmed leaks are reported (the
//! `lockstep_endpoint_leaks` metric, a warning per new leak, `verify`) and
//! released only with `release_leaks = true`, through
//! [`NodeEndpoints::release`] (the Kubernetes door's
//! [`NodeAgent::release_leaked`](super::backend::NodeAgent::release_leaked)),
//! which touches only an attachment still recorded for that pod. Agent-role,
//! LoadBalancer and delegated addresses are never judged.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::Api;
use lockstep_core::pods::{Leak, LeakTracker, PodRef, pod_alive};

use super::KubeError;
use super::pods::{PodView, pod_facts};
use crate::config::PodsConfig;

/// Confirmed leaks per round at most (each costs one GET).
const CONFIRM_PER_ROUND: usize = 100;

/// The API's word on one pod.
pub trait PodApi: Send + Sync + 'static {
    /// Whether the API shows `pod` running now (not from a cache).
    fn alive(&self, pod: &PodRef) -> impl Future<Output = Result<bool, KubeError>> + Send;
}

/// [`PodApi`] on the API server.
pub struct ApiPods(pub Client);

impl PodApi for ApiPods {
    async fn alive(&self, pod: &PodRef) -> Result<bool, KubeError> {
        let api: Api<Pod> = Api::namespaced(self.0.clone(), &pod.namespace);
        let got = api.get_opt(&pod.name).await.map_err(|e| KubeError::Api {
            what: format!("get pod {pod}"),
            source: Box::new(e),
        })?;
        Ok(pod_alive(pod, got.as_ref().map(pod_facts).as_ref()))
    }
}

/// The agent, as the leak loop uses it.
pub trait NodeEndpoints: Send + Sync + 'static {
    /// Endpoint attachments made for a pod (record key, pod); `None`
    /// while the agent is not there.
    fn list(&self)
    -> impl Future<Output = Result<Option<Vec<(String, PodRef)>>, KubeError>> + Send;
    /// Releases `key` as leaked by `pod` (its record and addresses), if
    /// it is still that pod's: whether it was released.
    fn release(
        &self,
        key: String,
        pod: PodRef,
    ) -> impl Future<Output = Result<bool, KubeError>> + Send;
}

/// What the last round found, for `verify` and the metrics.
#[derive(Debug, Default)]
pub struct LeakReport {
    leaks: Mutex<Vec<Leak>>,
    released: std::sync::atomic::AtomicU64,
}

impl LeakReport {
    /// The leaks found and not released, as `verify` names them.
    pub fn describe(&self) -> Vec<String> {
        self.leaks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .map(|l| {
                format!(
                    "endpoint {} holds addresses of pod {}, which is gone (leaked)",
                    l.key, l.pod
                )
            })
            .collect()
    }

    /// How many leaks are reported now.
    pub fn count(&self) -> usize {
        self.leaks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len()
    }

    /// How many leaked attachments were released since start.
    pub fn released(&self) -> u64 {
        self.released.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// The loop's state.
pub struct LeakLoop<V: PodView, A: PodApi, E: NodeEndpoints> {
    view: Arc<V>,
    api: A,
    endpoints: E,
    config: PodsConfig,
    tracker: LeakTracker,
    report: Arc<LeakReport>,
    epoch: tokio::time::Instant,
}

impl<V: PodView, A: PodApi, E: NodeEndpoints> LeakLoop<V, A, E> {
    /// A loop over `view`, confirming with `api`, judging `endpoints`.
    pub fn new(
        view: Arc<V>,
        api: A,
        endpoints: E,
        config: PodsConfig,
        report: Arc<LeakReport>,
    ) -> Self {
        Self {
            view,
            api,
            endpoints,
            config,
            tracker: LeakTracker::default(),
            report,
            epoch: tokio::time::Instant::now(),
        }
    }

    /// One comparison. Nothing is judged before the cache has listed or
    /// while the agent is not there.
    pub async fn round(&mut self) {
        if !self.view.listed() {
            return;
        }
        let endpoints = match self.endpoints.list().await {
            Ok(Some(e)) => e,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(error = %crate::error_chain(&e), "leak check: the agent's endpoints could not be read");
                return;
            }
        };
        let now_ms = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        let grace_ms = u64::try_from(self.config.leak_grace.as_millis()).unwrap_or(u64::MAX);
        let view = self.view.clone();
        let candidates = self.tracker.check(
            now_ms,
            grace_ms,
            endpoints.iter().map(|(k, p)| (k.as_str(), p)),
            |p| pod_alive(p, view.pod(p).as_ref()),
        );
        let before: BTreeSet<String> = self
            .report
            .leaks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .map(|l| l.key.clone())
            .collect();
        let mut confirmed = Vec::new();
        for leak in candidates.into_iter().take(CONFIRM_PER_ROUND) {
            match self.api.alive(&leak.pod).await {
                Ok(false) => confirmed.push(leak),
                // The cache was behind: the pod runs.
                Ok(true) => {}
                Err(e) => {
                    tracing::warn!(pod = %leak.pod, error = %crate::error_chain(&e), "leak check: the API did not confirm; judged again next round");
                    // Still reported if it was: one failed GET does not
                    // clear a leak.
                    if before.contains(&leak.key) {
                        confirmed.push(leak);
                    }
                }
            }
        }
        let mut kept = Vec::new();
        for leak in confirmed {
            if !before.contains(&leak.key) {
                tracing::warn!(
                    pod = %leak.pod,
                    endpoint = %leak.key,
                    gone_for = ?Duration::from_millis(now_ms.saturating_sub(leak.gone_since_ms)),
                    release = self.config.release_leaks,
                    "leaked endpoint allocation: its pod is gone"
                );
            }
            if self.config.release_leaks {
                match self
                    .endpoints
                    .release(leak.key.clone(), leak.pod.clone())
                    .await
                {
                    Ok(true) => {
                        self.report
                            .released
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        continue;
                    }
                    Ok(false) => continue,
                    Err(e) => {
                        tracing::warn!(pod = %leak.pod, error = %crate::error_chain(&e), "releasing a leaked allocation failed; tried again next round");
                    }
                }
            }
            kept.push(leak);
        }
        *self
            .report
            .leaks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = kept;
    }

    /// Runs rounds until `stop`.
    pub async fn run(mut self, mut stop: tokio::sync::watch::Receiver<bool>) {
        let mut tick = tokio::time::interval(self.config.leak_check_every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => self.round().await,
                _ = stop.changed() => return,
            }
            if *stop.borrow() {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests;
