//! The pass on cluster pools in memory (the double of etcd's apply: the
//! core's `plan_apply` and default rule, as `Door::apply_pools_default`
//! runs them). The loop end to end, on etcd and the API double, is
//! `tests/tests/kubernetes_pools.rs`.

use std::sync::Mutex;

use ipnet::IpNet;
use lockstep_core::cluster::kube_pools::PodPool;
use lockstep_core::cluster::{ClusterPoolSpec, default_for_apply, plan_apply};

use super::*;

/// Pools, default and claimed blocks in memory; `writer` says whether this
/// agent writes; `applies` counts the applies.
#[derive(Default)]
struct MemoryPools {
    state: Mutex<PoolsState>,
    applies: Mutex<u32>,
}

impl PoolsBackend for MemoryPools {
    async fn is_writer(&self) -> Result<bool, KubeError> {
        Ok(self.state.lock().unwrap().writer)
    }

    async fn state(&self) -> Result<PoolsState, KubeError> {
        Ok(self.state.lock().unwrap().clone())
    }

    async fn apply(
        &self,
        pools: Vec<ClusterPoolSpec>,
        default: Option<String>,
    ) -> Result<(), KubeError> {
        let mut s = self.state.lock().unwrap();
        let refused = |e: lockstep_core::cluster::ClusterError| KubeError::Refused {
            reason: e.to_string(),
        };
        let recorded =
            default_for_apply(&pools, s.default.as_deref(), default.as_deref()).map_err(refused)?;
        let written = plan_apply(&s.pools, &pools, &s.claimed).map_err(refused)?;
        s.pools = written;
        s.default = recorded;
        *self.applies.lock().unwrap() += 1;
        Ok(())
    }
}

fn writer() -> MemoryPools {
    let m = MemoryPools::default();
    m.state.lock().unwrap().writer = true;
    m
}

fn obj(name: &str, v4: &[&str]) -> PodPool {
    PodPool {
        name: name.into(),
        ipv4: v4.iter().map(|s| (*s).to_string()).collect(),
        ..PodPool::default()
    }
}

fn accepted(o: &PassOutcome, name: &str) -> (String, String, String) {
    let c = &o.statuses[name].conditions[0];
    (c.status.clone(), c.reason.clone(), c.message.clone())
}

#[tokio::test]
async fn objects_are_stored_once_and_a_second_pass_writes_nothing() {
    let m = writer();
    let objects = [obj("pods", &["10.1.0.0/24"])];
    let o = pass(&m, &objects).await.unwrap().unwrap();
    assert!(o.applied);
    assert_eq!(accepted(&o, "pods").0, "True");
    assert_eq!(o.statuses["pods"].total.as_deref(), Some("256"));
    assert_eq!(m.state.lock().unwrap().default.as_deref(), Some("pods"));
    let o = pass(&m, &objects).await.unwrap().unwrap();
    assert!(!o.applied);
    assert_eq!(*m.applies.lock().unwrap(), 1);
}

#[tokio::test]
async fn a_non_writer_changes_nothing() {
    let m = MemoryPools::default();
    assert_eq!(
        pass(&m, &[obj("pods", &["10.1.0.0/24"])]).await.unwrap(),
        None
    );
    assert!(m.state.lock().unwrap().pools.is_empty());
}

#[tokio::test]
async fn a_bad_object_gets_a_false_condition_and_the_store_is_unchanged() {
    let m = writer();
    pass(&m, &[obj("pods", &["10.1.0.0/24"])]).await.unwrap();
    let before = m.state.lock().unwrap().clone();
    let o = pass(&m, &[obj("pods", &["10.1.0.0/24", "10.2.0.0/33"])])
        .await
        .unwrap()
        .unwrap();
    let (status, reason, message) = accepted(&o, "pods");
    assert_eq!((status.as_str(), reason.as_str()), ("False", "InvalidSpec"));
    assert!(message.contains("spec.ipv4[1]"), "{message}");
    assert_eq!(*m.state.lock().unwrap(), before);
}

#[tokio::test]
async fn a_cidr_in_use_is_refused_then_goes_once_free_and_a_removed_pool_drains() {
    let m = writer();
    let objects = [
        obj("a", &["10.1.0.0/24", "10.9.0.0/24"]),
        obj("b", &["10.2.0.0/24"]),
    ];
    pass(&m, &objects).await.unwrap();
    let block: IpNet = "10.9.0.0/26".parse().unwrap();
    let b_block: IpNet = "10.2.0.0/26".parse().unwrap();
    {
        let mut s = m.state.lock().unwrap();
        s.claimed.insert(block, ("a".into(), "n1".into()));
        s.claimed.insert(b_block, ("b".into(), "n2".into()));
    }
    // Take 10.9.0.0/24 out of a, and remove b.
    let now = [obj("a", &["10.1.0.0/24"])];
    let o = pass(&m, &now).await.unwrap().unwrap();
    let (status, _, message) = accepted(&o, "a");
    assert_eq!(status, "False");
    assert!(
        message.contains("10.9.0.0/26") && message.contains("n1"),
        "{message}"
    );
    let s = m.state.lock().unwrap().clone();
    let a = s.pools.iter().find(|p| p.name == "a").unwrap();
    assert_eq!(a.ipv4.len(), 2, "a kept as stored");
    assert!(s.pools.iter().any(|p| p.name == "b" && p.draining));
    // n1 gives its block back: the CIDR goes on the next pass.
    m.state.lock().unwrap().claimed.remove(&block);
    let o = pass(&m, &now).await.unwrap().unwrap();
    assert_eq!(accepted(&o, "a").0, "True");
    let s = m.state.lock().unwrap().clone();
    assert_eq!(
        s.pools.iter().find(|p| p.name == "a").unwrap().ipv4.len(),
        1
    );
    assert_eq!(o.statuses["a"].blocks, Some(0));
}

#[tokio::test]
async fn no_object_leaves_the_cli_pools_alone() {
    let m = writer();
    m.state
        .lock()
        .unwrap()
        .pools
        .push(ClusterPoolSpec::new("cli").with_cidr("10.5.0.0/24".parse().unwrap()));
    let o = pass(&m, &[]).await.unwrap().unwrap();
    assert!(!o.applied);
    assert_eq!(m.state.lock().unwrap().pools.len(), 1);
}

#[test]
fn the_status_patch_keeps_the_transition_time_while_the_status_stays() {
    let mut obj: PodIPPool = serde_json::from_value(serde_json::json!({
        "apiVersion": "lockstep.io/v1alpha1", "kind": "PodIPPool",
        "metadata": {"name": "pods", "resourceVersion": "7", "generation": 2},
        "spec": {"ipv4": ["10.1.0.0/24"]}
    }))
    .unwrap();
    let want = PodIPPoolStatus {
        conditions: vec![PoolCondition {
            type_: "Accepted".into(),
            status: "True".into(),
            reason: "Applied".into(),
            message: "stored".into(),
            last_transition_time: String::new(),
            observed_generation: None,
        }],
        total: Some("256".into()),
        blocks: Some(0),
        nodes: Some(0),
    };
    let patch = status_patch(&obj, &want, "T1").unwrap();
    assert_eq!(patch["metadata"]["resourceVersion"], "7");
    assert_eq!(patch["status"]["conditions"][0]["lastTransitionTime"], "T1");
    assert_eq!(patch["status"]["conditions"][0]["observedGeneration"], 2);
    obj.status = Some(serde_json::from_value(patch["status"].clone()).unwrap());
    assert_eq!(status_patch(&obj, &want, "T2"), None);
    let mut more = want.clone();
    more.blocks = Some(1);
    let p = status_patch(&obj, &more, "T3").unwrap();
    assert_eq!(p["status"]["conditions"][0]["lastTransitionTime"], "T1");
}

#[test]
fn the_committed_crd_is_the_one_the_types_derive() {
    crate::kubernetes::crd::assert_committed("podippools.lockstep.io.yaml", crd_yaml());
}
