//! The double checked with kube-rs's own client, watcher and reflector:
//! what lockstep's door relies on behaves as the API server's.

use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Service;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use kube::runtime::watcher;
use lockstep::kubernetes::crd::LoadBalancerIPPool;
use serde_json::json;

use super::ApiDouble;

fn client(d: &ApiDouble) -> kube::Client {
    let config = kube::Config::new(format!("http://{}", d.addr()).parse().unwrap());
    kube::Client::try_from(config).unwrap()
}

fn svc(ns: &str, name: &str, labels: serde_json::Value) -> serde_json::Value {
    json!({"metadata": {"namespace": ns, "name": name, "labels": labels},
           "spec": {"type": "LoadBalancer", "ports": [{"port": 80}]}})
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn lists_watches_and_selects_by_label() {
    let d = ApiDouble::start_with(Duration::from_millis(100)).unwrap();
    d.create("services", "a", &svc("a", "x", json!({"app": "web"})))
        .unwrap();
    d.create("services", "b", &svc("b", "y", json!({"app": "db"})))
        .unwrap();
    rt().block_on(async {
        let all: Api<Service> = Api::all(client(&d));
        let l = all.list(&ListParams::default()).await.unwrap();
        assert_eq!(l.items.len(), 2);
        // Defaulted as a dual-stack API server does.
        let spec = l.items[0].spec.clone().unwrap();
        assert_eq!(spec.ip_families.unwrap(), vec!["IPv4"]);
        assert_eq!(spec.ports.unwrap()[0].protocol.as_deref(), Some("TCP"));
        let web = all
            .list(&ListParams::default().labels("app=web"))
            .await
            .unwrap();
        assert_eq!(web.items.len(), 1);
        let ns: Api<Service> = Api::namespaced(client(&d), "b");
        assert_eq!(
            ns.list(&ListParams::default()).await.unwrap().items.len(),
            1
        );
        // Watch from the list: later writes, then a bookmark with the
        // latest resourceVersion.
        let rv = l.metadata.resource_version.unwrap();
        let mut w = all
            .watch(
                &WatchParams {
                    bookmarks: true,
                    ..WatchParams::default()
                },
                &rv,
            )
            .await
            .unwrap()
            .boxed();
        d.create("services", "a", &svc("a", "z", json!({})))
            .unwrap();
        let mut added = false;
        let mut bookmark = None;
        while bookmark.is_none() {
            match w.try_next().await.unwrap().unwrap() {
                WatchEvent::Added(s) => {
                    assert_eq!(s.metadata.name.as_deref(), Some("z"));
                    added = true;
                }
                WatchEvent::Bookmark(b) => bookmark = Some(b.metadata.resource_version),
                other => panic!("unexpected {other:?}"),
            }
        }
        assert!(added);
        assert_eq!(bookmark.unwrap(), d.resource_version().to_string());
    });
}

#[test]
fn a_too_old_resource_version_is_gone_and_the_watcher_relists() {
    let d = ApiDouble::start().unwrap();
    d.create("services", "a", &svc("a", "x", json!({})))
        .unwrap();
    let old = d.resource_version();
    d.expire();
    d.create("services", "a", &svc("a", "y", json!({})))
        .unwrap();
    rt().block_on(async {
        let all: Api<Service> = Api::all(client(&d));
        let mut w = all
            .watch(&WatchParams::default(), &old.to_string())
            .await
            .unwrap()
            .boxed();
        match w.try_next().await.unwrap().unwrap() {
            WatchEvent::Error(e) => assert_eq!(e.code, 410),
            other => panic!("expected 410, got {other:?}"),
        }
        // kube-runtime's watcher: a 410 mid-stream makes it list again.
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let events = watcher(all, watcher::Config::default());
        tokio::spawn(async move {
            let mut events = std::pin::pin!(events);
            while let Some(e) = events.next().await {
                if tx.send(e).is_err() {
                    return;
                }
            }
        });
        let mut inits = 0;
        let mut seen = std::collections::BTreeSet::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while inits < 2 {
            let e = tokio::time::timeout_at(deadline, rx.recv())
                .await
                .expect("in time");
            match e.unwrap() {
                Ok(watcher::Event::Init) => inits += 1,
                Ok(watcher::Event::InitApply(s)) => {
                    seen.insert(s.metadata.name.unwrap());
                }
                Ok(watcher::Event::InitDone) if inits == 1 => {
                    // Expired while its watch is open.
                    while d.open_watches() == 0 {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    d.expire();
                }
                _ => {}
            }
        }
        assert_eq!(seen.len(), 2);
    });
}

#[test]
fn stale_writes_conflict_and_the_status_subresource_is_separate() {
    let d = ApiDouble::start().unwrap();
    let v = d
        .create("services", "a", &svc("a", "x", json!({})))
        .unwrap();
    let rv = v["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_string();
    rt().block_on(async {
        let api: Api<Service> = Api::namespaced(client(&d), "a");
        let st = json!({"metadata": {"resourceVersion": rv},
                        "status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.1"}]}},
                        "spec": {"type": "ClusterIP"}});
        let s = api.patch_status("x", &PatchParams::default(), &Patch::Merge(&st)).await.unwrap();
        // The status changed, the spec did not.
        assert_eq!(s.spec.unwrap().type_.as_deref(), Some("LoadBalancer"));
        assert_eq!(
            s.status.unwrap().load_balancer.unwrap().ingress.unwrap()[0].ip.as_deref(),
            Some("192.0.2.1")
        );
        // The same resourceVersion again: someone wrote since.
        let e = api.patch_status("x", &PatchParams::default(), &Patch::Merge(&st)).await.unwrap_err();
        assert!(matches!(&e, kube::Error::Api(s) if s.code == 409), "{e:?}");
        // A main write never changes the status.
        let m = json!({"status": {"loadBalancer": {"ingress": []}}, "metadata": {"labels": {"a": "b"}}});
        let s = api.patch("x", &PatchParams::default(), &Patch::Merge(&m)).await.unwrap();
        assert_eq!(s.status.unwrap().load_balancer.unwrap().ingress.unwrap().len(), 1);
        // Patch types the door does not send are refused.
        let e = api
            .patch("x", &PatchParams::apply("t"), &Patch::Apply(json!({"apiVersion": "v1", "kind": "Service"})))
            .await
            .unwrap_err();
        assert!(matches!(&e, kube::Error::Api(s) if s.code == 415), "{e:?}");
    });
}

#[test]
fn objects_that_do_not_decode_into_their_type_are_refused() {
    let d = ApiDouble::start().unwrap();
    rt().block_on(async {
        let pools: Api<LoadBalancerIPPool> = Api::all(client(&d));
        let good: LoadBalancerIPPool = serde_json::from_value(json!({
            "apiVersion": "lockstep.io/v1alpha1", "kind": "LoadBalancerIPPool",
            "metadata": {"name": "p"}, "spec": {"cidrs": ["192.0.2.0/24"]}
        }))
        .unwrap();
        pools.create(&PostParams::default(), &good).await.unwrap();
        let bad = json!({"metadata": {"name": "q"}, "spec": {"cidr": ["192.0.2.0/24"]}});
        let e = d.create("loadbalancerippools", "", &bad).unwrap_err();
        assert!(e.to_string().contains("422"), "{e}");
        let bad_status = json!({"status": {"total": "1", "colour": "red"}});
        let e = d
            .patch("loadbalancerippools", "", "p", &bad_status, true)
            .unwrap_err();
        assert!(e.to_string().contains("colour"), "{e}");
        let services: Api<Service> = Api::namespaced(client(&d), "a");
        let e = services
            .patch_status(
                "nope",
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {}})),
            )
            .await
            .unwrap_err();
        assert!(matches!(&e, kube::Error::Api(s) if s.code == 404));
        let e = d
            .create(
                "services",
                "a",
                &json!({"metadata": {"name": "s"}, "spec": {"typo": 1}}),
            )
            .unwrap_err();
        assert!(e.to_string().contains("spec.typo"), "{e}");
        assert_eq!(d.refusals().len(), 3);
    });
}

#[test]
fn finalizers_hold_a_deleted_object_until_removed() {
    let d = ApiDouble::start().unwrap();
    d.create(
        "loadbalancerippools",
        "",
        &json!({"metadata": {"name": "p", "finalizers": ["lockstep.io/lb-pool"]}, "spec": {}}),
    )
    .unwrap();
    let v = d.delete("loadbalancerippools", "", "p").unwrap();
    assert!(v["metadata"]["deletionTimestamp"].is_string());
    assert!(d.get("loadbalancerippools", "", "p").is_ok());
    d.patch(
        "loadbalancerippools",
        "",
        "p",
        &json!({"metadata": {"finalizers": null}}),
        false,
    )
    .unwrap();
    assert!(d.get("loadbalancerippools", "", "p").is_err());
}

#[test]
fn an_object_starting_or_stopping_to_match_a_selector_is_added_or_deleted() {
    let d = ApiDouble::start_with(Duration::from_secs(3600)).unwrap();
    d.create("services", "a", &svc("a", "x", json!({"app": "db"})))
        .unwrap();
    rt().block_on(async {
        let all: Api<Service> = Api::all(client(&d));
        let rv = d.resource_version().to_string();
        let mut w = all
            .watch(&WatchParams::default().labels("app=web"), &rv)
            .await
            .unwrap()
            .boxed();
        let relabel = |app: &str| {
            d.patch(
                "services",
                "a",
                "x",
                &json!({"metadata": {"labels": {"app": app}}}),
                false,
            )
            .unwrap();
        };
        relabel("web");
        match w.try_next().await.unwrap().unwrap() {
            WatchEvent::Added(s) => assert_eq!(s.metadata.name.as_deref(), Some("x")),
            other => panic!("starting to match is ADDED, got {other:?}"),
        }
        relabel("db");
        match w.try_next().await.unwrap().unwrap() {
            WatchEvent::Deleted(s) => {
                // Its new state, which no longer matches.
                assert_eq!(s.metadata.labels.unwrap()["app"], "db");
            }
            other => panic!("stopping to match is DELETED, got {other:?}"),
        }
        // A change to an object that matches neither before nor after is
        // not sent: the next event is the one after it.
        d.patch(
            "services",
            "a",
            "x",
            &json!({"metadata": {"annotations": {"n": "1"}}}),
            false,
        )
        .unwrap();
        relabel("web");
        match w.try_next().await.unwrap().unwrap() {
            WatchEvent::Added(s) => assert_eq!(s.metadata.name.as_deref(), Some("x")),
            other => panic!("expected ADDED, got {other:?}"),
        }
    });
}

#[test]
fn continued_lists_are_snapshots_and_expire_with_410() {
    let d = ApiDouble::start().unwrap();
    for n in ["a", "b", "c"] {
        d.create("services", "s", &svc("s", n, json!({}))).unwrap();
    }
    rt().block_on(async {
        let all: Api<Service> = Api::all(client(&d));
        let first = all.list(&ListParams::default().limit(2)).await.unwrap();
        assert_eq!(first.items.len(), 2);
        let token = first.metadata.continue_.clone().unwrap();
        let rv = first.metadata.resource_version.clone();
        // Written after the first page: not in the continued list, which
        // keeps the first page's resourceVersion.
        d.create("services", "s", &svc("s", "d", json!({})))
            .unwrap();
        d.delete("services", "s", "c").unwrap();
        let rest = all
            .list(&ListParams::default().limit(2).continue_token(&token))
            .await
            .unwrap();
        let names: Vec<String> = rest
            .items
            .iter()
            .filter_map(|s| s.metadata.name.clone())
            .collect();
        assert_eq!(names, vec!["c".to_string()]);
        assert_eq!(rest.metadata.resource_version, rv);
        assert!(rest.metadata.continue_.as_deref().unwrap_or("").is_empty());
        // The history expired: the token is too old.
        d.expire();
        match all
            .list(&ListParams::default().limit(2).continue_token(&token))
            .await
        {
            Err(kube::Error::Api(s)) => {
                assert_eq!(s.code, 410, "{s:?}");
                assert_eq!(s.reason, "Expired");
            }
            other => panic!("a continue after expiry: {other:?}"),
        }
        // Field selectors per kind, as the API server: no spec.nodeName on
        // Services.
        match all
            .list(&ListParams::default().fields("spec.nodeName=node-a"))
            .await
        {
            Err(kube::Error::Api(s)) => {
                assert_eq!(s.code, 400);
                assert!(s.message.contains("field label not supported"), "{s:?}");
            }
            other => panic!("a Service selected by node: {other:?}"),
        }
    });
}

#[test]
fn custom_resources_are_checked_against_the_crd_schema() {
    let d = ApiDouble::start().unwrap();
    let pool = |cidr: &str| {
        json!({"apiVersion": "lockstep.io/v1alpha1", "kind": "LoadBalancerIPPool",
               "metadata": {"name": "p"}, "spec": {"cidrs": [cidr]}})
    };
    // A mistyped CIDR is refused by the CRD before any agent reads it.
    let e = d
        .create("loadbalancerippools", "", &pool("10.0.0/24"))
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("422") && e.contains("spec.cidrs[0]") && e.contains("should match"),
        "{e}"
    );
    // A good one is stored with the schema's defaults.
    let v = d
        .create("loadbalancerippools", "", &pool("10.0.0.0/24"))
        .unwrap();
    assert_eq!(v["spec"]["allowFirstLastIPs"], false);
    let e = d
        .create(
            "podippools",
            "",
            &json!({"apiVersion": "lockstep.io/v1alpha1", "kind": "PodIPPool",
                    "metadata": {"name": "q"}, "spec": {"ipv4": ["10.1.0.0/16/8"]}}),
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("spec.ipv4[0]"), "{e}");
}
