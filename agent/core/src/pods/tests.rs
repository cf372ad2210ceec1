use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;

fn pod(ns: &str, name: &str, uid: Option<&str>) -> PodRef {
    PodRef {
        namespace: ns.into(),
        name: name.into(),
        uid: uid.map(Into::into),
    }
}

fn annotated(pool: &str) -> BTreeMap<String, String> {
    BTreeMap::from([(POOL_ANNOTATION.to_string(), pool.to_string())])
}

#[test]
fn the_pod_annotation_wins_then_the_namespace_then_the_default() {
    let p = pod("shop", "web-0", None);
    let other = BTreeMap::from([("team".to_string(), "blue".to_string())]);
    let cases = [
        (
            Some(annotated("blue")),
            Some(annotated("green")),
            Some("blue"),
            PickedBy::Pod,
        ),
        (
            Some(other.clone()),
            Some(annotated("green")),
            Some("green"),
            PickedBy::Namespace,
        ),
        (
            Some(BTreeMap::new()),
            Some(annotated("green")),
            Some("green"),
            PickedBy::Namespace,
        ),
        (Some(other), None, None, PickedBy::Default),
        (Some(BTreeMap::new()), None, None, PickedBy::Default),
    ];
    for (pa, na, pool, by) in cases {
        let got = pick_pool(&p, pa.as_ref(), na.as_ref()).expect("valid");
        assert_eq!(got.pool.as_deref(), pool, "{pa:?} {na:?}");
        assert_eq!(got.by, by, "{pa:?} {na:?}");
    }
}

#[test]
fn an_annotation_that_cannot_name_a_pool_is_refused_naming_the_object() {
    let p = pod("shop", "web-0", None);
    let e = pick_pool(&p, Some(&annotated("")), None).expect_err("empty");
    let text = e.to_string();
    assert!(text.contains("pod shop/web-0"), "{text}");
    assert!(text.contains(POOL_ANNOTATION), "{text}");
    let e = pick_pool(&p, Some(&BTreeMap::new()), Some(&annotated("two words")))
        .expect_err("white space");
    assert!(e.to_string().contains("namespace shop"), "{e}");
    assert!(e.to_string().contains("white space"), "{e}");
    // The pod's valid annotation decides; the namespace's bad one is not read.
    assert!(pick_pool(&p, Some(&annotated("blue")), Some(&annotated(""))).is_ok());
}

#[test]
fn a_pod_not_seen_gets_no_pool_whatever_its_namespace_says() {
    let p = pod("shop", "web-0", None);
    for ns in [None, Some(annotated("green")), Some(BTreeMap::new())] {
        let e = pick_pool(&p, None, ns.as_ref()).expect_err("not seen");
        assert_eq!(
            e,
            PodsError::PodNotSeen {
                pod: "shop/web-0".into()
            }
        );
        assert!(e.to_string().contains("pod shop/web-0"), "{e}");
        assert!(e.to_string().contains("try again"), "{e}");
    }
}

#[test]
fn a_pod_is_alive_only_as_the_same_running_pod() {
    let want = pod("a", "b", Some("u1"));
    let facts = |uid: Option<&str>, finished| PodFacts {
        uid: uid.map(Into::into),
        annotations: BTreeMap::new(),
        finished,
    };
    assert!(pod_alive(&want, Some(&facts(Some("u1"), false))));
    assert!(!pod_alive(&want, None), "absent");
    assert!(
        !pod_alive(&want, Some(&facts(Some("u2"), false))),
        "another pod of the name"
    );
    assert!(
        !pod_alive(&want, Some(&facts(Some("u1"), true))),
        "finished"
    );
    // Without a UID on either side the name decides.
    assert!(pod_alive(
        &pod("a", "b", None),
        Some(&facts(Some("u2"), false))
    ));
    assert!(pod_alive(&want, Some(&facts(None, false))));
}

#[test]
fn a_static_pod_is_alive_through_its_mirror_pod() {
    // kubelet passes the static pod's UID (its config hash); the API shows
    // the mirror pod under another UID, with the hash in an annotation.
    let want = pod("kube-system", "etcd-node-a", Some("3f1c0e"));
    let mut mirror = PodFacts {
        uid: Some("9b2d-api-uid".into()),
        annotations: BTreeMap::from([(MIRROR_ANNOTATION.to_string(), "3f1c0e".to_string())]),
        finished: false,
    };
    assert!(pod_alive(&want, Some(&mirror)), "the mirror pod shows it");
    mirror
        .annotations
        .insert(MIRROR_ANNOTATION.into(), "another-hash".into());
    assert!(
        !pod_alive(&want, Some(&mirror)),
        "a mirror of another static pod (the file changed): gone"
    );
}

#[test]
fn a_leak_is_reported_after_the_grace_and_forgotten_when_the_pod_returns() {
    let mut t = LeakTracker::default();
    let p = pod("a", "b", None);
    let eps = [("k1", &p)];
    assert!(
        t.check(1_000, 500, eps, |_| false).is_empty(),
        "first seen gone"
    );
    assert!(
        t.check(1_400, 500, eps, |_| false).is_empty(),
        "inside the grace"
    );
    let leaks = t.check(1_500, 500, eps, |_| false);
    assert_eq!(leaks.len(), 1);
    assert_eq!(leaks[0].gone_since_ms, 1_000);
    assert_eq!(leaks[0].key, "k1");
    // Back: the clock starts again.
    assert!(t.check(1_600, 500, eps, |_| true).is_empty());
    assert!(t.check(1_700, 500, eps, |_| false).is_empty());
    assert!(t.check(2_100, 500, eps, |_| false).is_empty());
    assert_eq!(t.check(2_200, 500, eps, |_| false).len(), 1);
    // An endpoint gone from the node is forgotten.
    assert!(t.check(2_300, 500, [], |_| false).is_empty());
    assert!(t.check(2_400, 500, eps, |_| false).is_empty());
}

proptest! {
    /// Against a model: an endpoint is reported exactly when its pod has
    /// been seen gone at every check since a check at least `grace` ago.
    #[test]
    fn leaks_match_the_model(
        grace in 0u64..50,
        steps in proptest::collection::vec(
            (1u64..20, proptest::collection::vec((any::<bool>(), any::<bool>()), 4)),
            1..40,
        ),
    ) {
        let pods: Vec<PodRef> = (0..4).map(|i| pod("ns", &format!("p{i}"), None)).collect();
        let keys: Vec<String> = (0..4).map(|i| format!("k{i}")).collect();
        let mut t = LeakTracker::default();
        // Model: since when each present endpoint has been gone.
        let mut since: BTreeMap<usize, u64> = BTreeMap::new();
        let mut now = 0;
        for (dt, states) in steps {
            now += dt;
            let present: Vec<usize> = (0..4).filter(|i| states[*i].0).collect();
            let alive: BTreeMap<&PodRef, bool> =
                (0..4).map(|i| (&pods[i], states[i].1)).collect();
            since.retain(|i, _| present.contains(i));
            let mut want = Vec::new();
            for &i in &present {
                if alive[&pods[i]] {
                    since.remove(&i);
                } else {
                    let s = *since.entry(i).or_insert(now);
                    if now - s >= grace {
                        want.push(keys[i].clone());
                    }
                }
            }
            let got = t.check(
                now,
                grace,
                present.iter().map(|&i| (keys[i].as_str(), &pods[i])),
                |p| alive[p],
            );
            let got: Vec<String> = got.into_iter().map(|l| l.key).collect();
            prop_assert_eq!(got, want);
        }
    }
}
