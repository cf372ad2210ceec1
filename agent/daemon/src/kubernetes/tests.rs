//! The door's single requests against kube-rs's mock service
//! (tower-test): what is sent, with which patch type and guard, and how
//! the answer is read. The loop end to end runs against the API double
//! in `tests/tests/kubernetes_e2e.rs`.

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::time::Duration;

use axum::http::{Request, Response};
use k8s_openapi::api::core::v1::Service;
use kube::Client;
use kube::client::Body;
use kube::runtime::reflector;
use kube::runtime::watcher;
use lockstep_core::lb::{LbIpam, LbPoolSpec, ServiceSpec};
use serde_json::{Value, json};

use super::crd::LoadBalancerIPPool;
use super::{Classes, KubeError, LbBackend, LbState, LbSync, node_facts};

pub(super) type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

fn classes() -> Classes {
    Classes {
        class: "lockstep.io/lb".into(),
        classless: true,
    }
}

pub(super) fn mock() -> (Client, Handle) {
    let (svc, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    (Client::new(svc, "default"), handle)
}

async fn next(
    handle: &mut Handle,
) -> (
    Request<Body>,
    Value,
    tower_test::mock::SendResponse<Response<Body>>,
) {
    let (req, send) = tokio::time::timeout(Duration::from_secs(5), handle.next_request())
        .await
        .expect("a request in time")
        .expect("a request");
    let (parts, body) = req.into_parts();
    let bytes = body.collect_bytes().await.expect("body");
    let v = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes).expect("json body")
    };
    (Request::from_parts(parts, Body::empty()), v, send)
}

pub(super) fn reply(send: tower_test::mock::SendResponse<Response<Body>>, code: u16, v: &Value) {
    send.send_response(
        Response::builder()
            .status(code)
            .body(Body::from(serde_json::to_vec(v).expect("json")))
            .expect("response"),
    );
}

#[tokio::test]
async fn the_node_is_read_once_by_name() {
    let (client, mut handle) = mock();
    let server = tokio::spawn(async move {
        let (req, _, send) = next(&mut handle).await;
        assert_eq!(req.method(), "GET");
        assert_eq!(req.uri().path(), "/api/v1/nodes/node-1");
        reply(
            send,
            200,
            &json!({"apiVersion": "v1", "kind": "Node",
                    "metadata": {"name": "node-1", "labels": {"zone": "a"}},
                    "status": {"addresses": [{"type": "Hostname", "address": "node-1"},
                                             {"type": "InternalIP", "address": "10.0.0.7"}]}}),
        );
    });
    let facts = node_facts(
        &client,
        "node-1",
        "the configuration",
        Duration::from_secs(1),
    )
    .await
    .unwrap();
    server.await.unwrap();
    assert_eq!(facts.labels["zone"], "a");
    assert_eq!(facts.internal_v4, Some("10.0.0.7".parse().unwrap()));
    assert_eq!(facts.internal_v6, None);
}

#[tokio::test]
async fn a_node_the_api_does_not_know_is_refused_naming_the_name() {
    let (client, mut handle) = mock();
    let server = tokio::spawn(async move {
        let (_, _, send) = next(&mut handle).await;
        reply(
            send,
            404,
            &json!({"apiVersion": "v1", "kind": "Status", "status": "Failure",
                    "reason": "NotFound", "code": 404, "message": "nodes \"Node-1\" not found"}),
        );
    });
    let e = node_facts(&client, "Node-1", "NODE_NAME", Duration::ZERO)
        .await
        .unwrap_err();
    server.await.unwrap();
    assert!(matches!(e, KubeError::NoNode { .. }), "{e:?}");
    let text = e.to_string();
    assert!(
        text.contains("\"Node-1\"") && text.contains("came from NODE_NAME"),
        "{text}"
    );
}

/// The LB state in memory, as the agent's would be.
struct MemoryLb(Mutex<LbIpam>);

impl LbBackend for MemoryLb {
    async fn state(&self) -> Result<LbState, KubeError> {
        let lb = self.0.lock().unwrap();
        Ok(LbState {
            writer: true,
            services: lb
                .services()
                .map(|(id, s)| (id.to_string(), s.clone()))
                .collect(),
            pending: BTreeSet::new(),
            pools: lb.pools().map(|p| (p.spec.name.clone(), p)).collect(),
        })
    }

    async fn apply(
        &self,
        pools: Vec<LbPoolSpec>,
        services: Vec<ServiceSpec>,
    ) -> Result<(), KubeError> {
        let mut lb = self.0.lock().unwrap();
        if !pools.is_empty() {
            lb.apply_pools(pools).map_err(|e| KubeError::Refused {
                reason: e.to_string(),
            })?;
        }
        for s in services {
            lb.apply_service(s).map_err(|e| KubeError::Refused {
                reason: e.to_string(),
            })?;
        }
        Ok(())
    }

    async fn delete(&self, services: Vec<String>, pools: Vec<String>) -> Result<(), KubeError> {
        let mut lb = self.0.lock().unwrap();
        for s in services {
            lb.delete_service(&s).map_err(|e| KubeError::Refused {
                reason: e.to_string(),
            })?;
        }
        for p in pools {
            lb.delete_pool(&p).map_err(|e| KubeError::Refused {
                reason: e.to_string(),
            })?;
        }
        Ok(())
    }

    fn assigns_on_apply(&self) -> bool {
        true
    }

    fn poll_every(&self, _pending: bool) -> Duration {
        Duration::from_secs(5)
    }
}

#[tokio::test]
async fn a_service_gets_its_status_by_a_guarded_merge_patch_and_an_event() {
    let (client, mut handle) = mock();
    let mut lb = LbIpam::new();
    lb.apply_pools(vec![LbPoolSpec::new("p").cidr("192.0.2.0/30")])
        .unwrap();
    let backend = MemoryLb(Mutex::new(lb));
    let mut sync = LbSync::new(client, classes(), "node-1".into(), backend);
    let (services, mut writer) = reflector::store::<Service>();
    let svc: Service = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"namespace": "a", "name": "web", "uid": "u1", "resourceVersion": "41", "generation": 1},
        "spec": {"type": "LoadBalancer", "ports": [{"port": 80, "protocol": "TCP"}]}
    }))
    .unwrap();
    writer.apply_watcher_event(&watcher::Event::Init);
    writer.apply_watcher_event(&watcher::Event::InitApply(svc.clone()));
    writer.apply_watcher_event(&watcher::Event::InitDone);
    let (pools, mut pool_writer) = reflector::store::<LoadBalancerIPPool>();
    pool_writer.apply_watcher_event(&watcher::Event::Init);
    pool_writer.apply_watcher_event(&watcher::Event::InitDone);
    let server = tokio::spawn(async move {
        let (req, body, send) = next(&mut handle).await;
        assert_eq!(req.method(), "PATCH");
        assert_eq!(req.uri().path(), "/api/v1/namespaces/a/services/web/status");
        assert_eq!(
            req.headers()["content-type"].to_str().unwrap(),
            "application/merge-patch+json"
        );
        // Guarded by the object's resourceVersion; addresses and the
        // condition written together.
        assert_eq!(body["metadata"]["resourceVersion"], "41");
        assert_eq!(
            body["status"]["loadBalancer"]["ingress"],
            json!([{"ip": "192.0.2.1"}])
        );
        let c = &body["status"]["conditions"][0];
        assert_eq!(c["type"], "lockstep.io/AddressAssigned");
        assert_eq!(
            (c["status"].as_str(), c["reason"].as_str()),
            (Some("True"), Some("Assigned"))
        );
        assert_eq!(c["observedGeneration"], 1);
        let mut patched = serde_json::to_value(&svc).unwrap();
        patched["status"] = body["status"].clone();
        reply(send, 200, &patched);
        // The Event that the condition changed.
        let (req, body, send) = next(&mut handle).await;
        assert_eq!(req.method(), "POST");
        assert_eq!(
            req.uri().path(),
            "/apis/events.k8s.io/v1/namespaces/a/events"
        );
        assert_eq!(body["reason"], "Assigned");
        assert_eq!(body["type"], "Normal");
        assert_eq!(body["regarding"]["name"], "web");
        assert_eq!(body["reportingController"], "lockstep");
        reply(send, 201, &body);
        handle
    });
    let pending = sync.pass(&services, &pools).await.unwrap();
    assert!(!pending);
    let mut handle = server.await.unwrap();
    // The same pass again: the reflector has not seen the write yet, and
    // nothing is sent twice.
    let again = tokio::spawn(async move {
        tokio::time::timeout(Duration::from_millis(300), handle.next_request())
            .await
            .is_err()
    });
    sync.pass(&services, &pools).await.unwrap();
    assert!(again.await.unwrap(), "a second patch was sent");
}

#[tokio::test]
async fn a_stale_status_write_is_left_for_the_next_pass() {
    let (client, mut handle) = mock();
    let mut lb = LbIpam::new();
    lb.apply_pools(vec![LbPoolSpec::new("p").cidr("192.0.2.0/30")])
        .unwrap();
    let mut sync = LbSync::new(client, classes(), "n".into(), MemoryLb(Mutex::new(lb)));
    let (services, mut writer) = reflector::store::<Service>();
    let svc: Service = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"namespace": "a", "name": "web", "uid": "u1", "resourceVersion": "41"},
        "spec": {"type": "LoadBalancer"}
    }))
    .unwrap();
    writer.apply_watcher_event(&watcher::Event::Init);
    writer.apply_watcher_event(&watcher::Event::InitApply(svc));
    writer.apply_watcher_event(&watcher::Event::InitDone);
    let (pools, mut pw) = reflector::store::<LoadBalancerIPPool>();
    pw.apply_watcher_event(&watcher::Event::Init);
    pw.apply_watcher_event(&watcher::Event::InitDone);
    let server = tokio::spawn(async move {
        for _ in 0..2 {
            let (req, _, send) = next(&mut handle).await;
            assert_eq!(req.method(), "PATCH");
            reply(
                send,
                409,
                &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                        "reason": "Conflict", "code": 409, "message": "modified"}),
            );
        }
    });
    // A conflict is not an error of the pass, and is tried again (no
    // Event for a write that did not land).
    sync.pass(&services, &pools).await.unwrap();
    sync.pass(&services, &pools).await.unwrap();
    server.await.unwrap();
}
