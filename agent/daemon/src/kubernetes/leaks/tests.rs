//! The leak loop and the pool pick on in-memory doubles: the cache, the
//! API and the agent's endpoints.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};

use lockstep_core::pods::{POOL_ANNOTATION, PickedBy, PodFacts, PodsError};

use super::*;
use crate::kubernetes::pods::pick;

#[derive(Default)]
struct View {
    listed: AtomicBool,
    pods: Mutex<BTreeMap<(String, String), PodFacts>>,
    namespaces: Mutex<BTreeMap<String, BTreeMap<String, String>>>,
}

impl PodView for View {
    fn listed(&self) -> bool {
        self.listed.load(Ordering::Acquire)
    }
    fn pod(&self, pod: &PodRef) -> Option<PodFacts> {
        let key = (pod.namespace.clone(), pod.name.clone());
        self.pods.lock().unwrap().get(&key).cloned()
    }
    fn namespace(&self, name: &str) -> Option<BTreeMap<String, String>> {
        self.namespaces.lock().unwrap().get(name).cloned()
    }
}

impl View {
    fn put(&self, ns: &str, name: &str, annotations: BTreeMap<String, String>) {
        self.pods.lock().unwrap().insert(
            (ns.into(), name.into()),
            PodFacts {
                uid: None,
                annotations,
                finished: false,
            },
        );
    }
    fn remove(&self, ns: &str, name: &str) {
        self.pods.lock().unwrap().remove(&(ns.into(), name.into()));
    }
}

/// The API: the pods it says run (by `ns/name`), and whether it answers.
#[derive(Clone, Default)]
struct Api {
    running: Arc<Mutex<BTreeSet<String>>>,
    down: Arc<AtomicBool>,
    asked: Arc<Mutex<Vec<String>>>,
}

impl PodApi for Api {
    async fn alive(&self, pod: &PodRef) -> Result<bool, KubeError> {
        self.asked.lock().unwrap().push(pod.to_string());
        if self.down.load(Ordering::Acquire) {
            return Err(KubeError::Task {
                reason: "the API does not answer".into(),
            });
        }
        Ok(self.running.lock().unwrap().contains(&pod.to_string()))
    }
}

#[derive(Clone, Default)]
struct Endpoints {
    held: Arc<Mutex<BTreeMap<String, PodRef>>>,
    released: Arc<Mutex<Vec<String>>>,
}

impl NodeEndpoints for Endpoints {
    async fn list(&self) -> Result<Option<Vec<(String, PodRef)>>, KubeError> {
        Ok(Some(
            self.held
                .lock()
                .unwrap()
                .iter()
                .map(|(k, p)| (k.clone(), p.clone()))
                .collect(),
        ))
    }
    async fn release(&self, key: String, pod: PodRef) -> Result<bool, KubeError> {
        let mut held = self.held.lock().unwrap();
        if held.get(&key) != Some(&pod) {
            return Ok(false);
        }
        held.remove(&key);
        self.released.lock().unwrap().push(key);
        Ok(true)
    }
}

fn pod(ns: &str, name: &str) -> PodRef {
    PodRef {
        namespace: ns.into(),
        name: name.into(),
        uid: None,
    }
}

fn config(release: bool) -> PodsConfig {
    PodsConfig {
        leak_grace: Duration::from_secs(60),
        release_leaks: release,
        ..PodsConfig::default()
    }
}

struct Lab {
    view: Arc<View>,
    api: Api,
    endpoints: Endpoints,
    report: Arc<LeakReport>,
}

fn lab(release: bool) -> (Lab, LeakLoop<View, Api, Endpoints>) {
    let view = Arc::new(View::default());
    view.listed.store(true, Ordering::Release);
    let (api, endpoints) = (Api::default(), Endpoints::default());
    let report = Arc::new(LeakReport::default());
    for (key, ns, name) in [("k-web", "shop", "web"), ("k-db", "shop", "db")] {
        endpoints
            .held
            .lock()
            .unwrap()
            .insert(key.into(), pod(ns, name));
        view.put(ns, name, BTreeMap::new());
        api.running.lock().unwrap().insert(format!("{ns}/{name}"));
    }
    let l = LeakLoop::new(
        view.clone(),
        api.clone(),
        endpoints.clone(),
        config(release),
        report.clone(),
    );
    (
        Lab {
            view,
            api,
            endpoints,
            report,
        },
        l,
    )
}

impl Lab {
    /// The pod goes: from the cache and from the API.
    fn delete(&self, ns: &str, name: &str) {
        self.view.remove(ns, name);
        self.api
            .running
            .lock()
            .unwrap()
            .remove(&format!("{ns}/{name}"));
    }
}

#[tokio::test(start_paused = true)]
async fn a_gone_pod_is_reported_after_the_grace_and_kept_without_release() {
    let (lab, mut l) = lab(false);
    l.round().await;
    assert_eq!(lab.report.count(), 0, "every pod runs");
    lab.delete("shop", "web");
    l.round().await;
    tokio::time::advance(Duration::from_secs(59)).await;
    l.round().await;
    assert_eq!(lab.report.count(), 0, "inside the grace");
    tokio::time::advance(Duration::from_secs(1)).await;
    l.round().await;
    let said = lab.report.describe();
    assert_eq!(said.len(), 1, "{said:?}");
    assert!(
        said[0].contains("shop/web") && said[0].contains("k-web"),
        "{said:?}"
    );
    assert!(
        lab.endpoints.released.lock().unwrap().is_empty(),
        "reported only"
    );
    assert!(lab.endpoints.held.lock().unwrap().contains_key("k-web"));
    assert_eq!(lab.report.released(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_confirmed_leak_is_released_when_configured_and_no_live_pod_ever() {
    let (lab, mut l) = lab(true);
    lab.delete("shop", "web");
    l.round().await;
    tokio::time::advance(Duration::from_secs(61)).await;
    l.round().await;
    assert_eq!(
        *lab.endpoints.released.lock().unwrap(),
        vec!["k-web".to_string()]
    );
    assert_eq!(lab.report.released(), 1);
    assert_eq!(lab.report.count(), 0, "released, so no longer reported");
    assert!(lab.endpoints.held.lock().unwrap().contains_key("k-db"));
}

#[tokio::test(start_paused = true)]
async fn a_cache_behind_the_api_never_makes_a_live_pod_a_leak() {
    let (lab, mut l) = lab(true);
    // The cache lost the pod (a relist behind), the API still has it.
    lab.view.remove("shop", "web");
    l.round().await;
    tokio::time::advance(Duration::from_secs(120)).await;
    l.round().await;
    assert_eq!(
        *lab.api.asked.lock().unwrap(),
        vec!["shop/web".to_string()],
        "asked the API"
    );
    assert!(lab.endpoints.released.lock().unwrap().is_empty());
    assert_eq!(lab.report.count(), 0);
    // The API down: nothing is released or newly reported on the cache's word.
    lab.api.down.store(true, Ordering::Release);
    lab.delete("shop", "db");
    l.round().await;
    tokio::time::advance(Duration::from_secs(120)).await;
    l.round().await;
    assert!(lab.endpoints.released.lock().unwrap().is_empty());
    assert_eq!(lab.report.count(), 0);
}

#[tokio::test(start_paused = true)]
async fn nothing_is_judged_before_the_cache_has_listed() {
    let (lab, mut l) = lab(true);
    lab.view.listed.store(false, Ordering::Release);
    lab.delete("shop", "web");
    l.round().await;
    tokio::time::advance(Duration::from_secs(120)).await;
    l.round().await;
    assert!(lab.api.asked.lock().unwrap().is_empty());
    assert!(lab.endpoints.released.lock().unwrap().is_empty());
    // Listed: the grace starts now, not at start-up.
    lab.view.listed.store(true, Ordering::Release);
    l.round().await;
    assert!(lab.endpoints.released.lock().unwrap().is_empty());
    tokio::time::advance(Duration::from_secs(60)).await;
    l.round().await;
    assert_eq!(lab.endpoints.released.lock().unwrap().len(), 1);
}

fn annotated(pool: &str) -> BTreeMap<String, String> {
    BTreeMap::from([(POOL_ANNOTATION.to_string(), pool.to_string())])
}

#[tokio::test(start_paused = true)]
async fn a_pick_waits_for_a_pod_the_cache_has_not_shown_then_falls_back() {
    let view = Arc::new(View::default());
    view.namespaces
        .lock()
        .unwrap()
        .insert("shop".into(), annotated("green"));
    // Arrives during the wait: its own annotation.
    let v = view.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        v.put("shop", "late", annotated("blue"));
    });
    let got = pick(&*view, &pod("shop", "late"), Duration::from_secs(2))
        .await
        .expect("valid");
    assert_eq!((got.pool.as_deref(), got.by), (Some("blue"), PickedBy::Pod));
    // Never arrives: refused after the wait, never the namespace's pool.
    let started = tokio::time::Instant::now();
    let e = pick(&*view, &pod("shop", "never"), Duration::from_secs(2))
        .await
        .expect_err("not seen");
    assert!(
        matches!(&e, PodsError::PodNotSeen { pod } if pod == "shop/never"),
        "{e}"
    );
    assert!(started.elapsed() >= Duration::from_secs(2));
    // Seen, with no annotation and none on its namespace: the default.
    view.put("other", "x", BTreeMap::new());
    let got = pick(&*view, &pod("other", "x"), Duration::ZERO)
        .await
        .expect("valid");
    assert_eq!((got.pool, got.by), (None, PickedBy::Default));
}
