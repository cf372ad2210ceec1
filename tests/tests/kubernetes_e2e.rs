//! Kubernetes LoadBalancer Services end to end (#28), with the Kubernetes
//! API double (`lockstep_tests::kubeapi`; its limits are documented beside
//! it), a real 3-member etcd, three node namespaces on a bridge and a
//! neighbour on it (`kube_lab`). Every agent runs `[kubernetes]` in cluster
//! mode; the elected LB assigner writes statuses.
//!
//! - `a_fifty_services_get_distinct_addresses_answered_once`: 50 Services
//!   created at once get distinct addresses in `status.loadBalancer`, and
//!   an ARP probe per address from the neighbour is answered by exactly
//!   one node, the one `lb get` names; the pool's status counts them.
//! - `b_requests_sharing_exhaustion_classes_and_release`: a requested
//!   address, a sharing key (and a port clash on it), an exhausted pool
//!   (condition and Event, assigned once the pool grows), a class lockstep
//!   does not own (untouched), deletion and a type change releasing; every
//!   request the agents sent is one `deploy/rbac.yaml` allows.
//! - `c_assigner_killed_while_services_are_created`: the assigning agent
//!   SIGKILLed while Services are created: no address twice, none left
//!   pending once another agent took over.
//! - `d_watches_broken_and_expired_converge_without_moving_addresses`:
//!   watches broken, then expired (410) mid-stream: the agents watch again
//!   and relist, new Services are served, no address changes.
//! - `e_a_shrunk_pool_keeps_the_addresses_still_in_it`.
//! - `f_node_selector_matches_node_labels`: a pool whose nodeSelector
//!   matches only node-0's Node labels is answered by node-0 alone.
//! - `service_status_bench` (ignored; `cargo xtask bench lb`): Service
//!   created → status written, p50/p99 over 200 Services, goal p99 ≤ 1 s.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use lockstep_tests::etcd::EtcdCluster;
use lockstep_tests::kube_lab::{KubeLab, condition_of, lb_service, pool_spec};
use lockstep_tests::lb_lab::probe_once;
use lockstep_tests::{pct, privileged, wait_for};
use serde_json::{Value, json};

fn lab(prefix: &str, labels: [Value; 3]) -> anyhow::Result<(EtcdCluster, KubeLab)> {
    let cluster = EtcdCluster::start(3)?;
    let prefix = format!("/{}/", lockstep_tests::unique(prefix));
    let lab = KubeLab::build(&cluster, &prefix, labels)?;
    Ok((cluster, lab))
}

fn unlabelled() -> [Value; 3] {
    [json!({}), json!({}), json!({})]
}

fn ids(ns: &str, names: impl IntoIterator<Item = String>) -> BTreeSet<String> {
    names.into_iter().map(|n| format!("{ns}/{n}")).collect()
}

/// Every address answered once, by the node `lb get` names.
fn answered_once(k: &KubeLab, addrs: &[IpAddr]) -> anyhow::Result<()> {
    let announcers = wait_for("every address announced", Duration::from_secs(30), || {
        let a = k.lab.announcers(0).ok()?;
        addrs.iter().all(|x| a.contains_key(x)).then_some(a)
    })?;
    let answers = probe_once(&k.lab, addrs, Duration::from_millis(1500))?;
    for a in addrs {
        let node = announcers[a];
        let got = answers.get(a).cloned().unwrap_or_default();
        ensure!(
            got.len() == 1 && got[0] == k.lab.macs[node],
            "{a}: answers from {:?}, announcer node-{node}",
            got.iter().map(|m| k.lab.node_of(*m)).collect::<Vec<_>>()
        );
    }
    Ok(())
}

fn distinct(m: &BTreeMap<String, Vec<IpAddr>>) -> anyhow::Result<Vec<IpAddr>> {
    let all: Vec<IpAddr> = m.values().flatten().copied().collect();
    let set: BTreeSet<IpAddr> = all.iter().copied().collect();
    ensure!(all.len() == set.len(), "an address twice: {m:?}");
    Ok(all)
}

#[test]
fn a_fifty_services_get_distinct_addresses_answered_once() -> anyhow::Result<()> {
    privileged!();
    let (_cluster, k) = lab("k8sa", unlabelled())?;
    k.pool("pub", pool_spec())?;
    let started = Instant::now();
    let names: Vec<String> = (0..50).map(|i| format!("s{i:02}")).collect();
    std::thread::scope(|s| {
        for chunk in names.chunks(10) {
            let k = &k;
            s.spawn(move || {
                for n in chunk {
                    k.api
                        .create(
                            "services",
                            "shop",
                            &lb_service("shop", n, 80, json!({}), json!({})),
                        )
                        .expect("create");
                }
            });
        }
    });
    let got = k.wait_assigned(&ids("shop", names.clone()), 1, Duration::from_secs(60))?;
    eprintln!(
        "50 services created at once had their addresses in status after {:?}",
        started.elapsed()
    );
    let addrs = distinct(&got)?;
    for a in &addrs {
        ensure!(
            "10.251.0.128/25".parse::<ipnet::IpNet>()?.contains(a),
            "{a} outside the pool"
        );
    }
    // Every condition says why (assigned).
    for n in &names {
        let c = k.condition("shop", n).context("condition")?;
        ensure!(c.0 == "True" && c.1 == "Assigned", "{n}: {c:?}");
    }
    answered_once(&k, &addrs)?;
    // The pool's status counts them: 126 IPv4 + 255 IPv6 usable.
    let p = wait_for(
        "pool status counts 50 used",
        Duration::from_secs(20),
        || {
            let p = k.api.get("loadbalancerippools", "", "pub").ok()?;
            (p["status"]["used"] == "50").then_some(p)
        },
    )?;
    ensure!(
        p["status"]["total"] == "381" && p["status"]["available"] == "331",
        "{}",
        p["status"]
    );
    ensure!(
        p["metadata"]["finalizers"] == json!(["lockstep.io/lb-pool"]),
        "{}",
        p["metadata"]
    );
    ensure!(
        k.api.refusals().is_empty(),
        "the double refused: {:?}",
        k.api.refusals()
    );
    Ok(())
}

#[test]
fn b_requests_sharing_exhaustion_classes_and_release() -> anyhow::Result<()> {
    privileged!();
    let (_cluster, k) = lab("k8sb", unlabelled())?;
    k.pool(
        "pub",
        json!({"cidrs": ["10.251.0.128/26"], "announce": "l2",
               "serviceSelector": {"matchExpressions": [{"key": "pool", "operator": "DoesNotExist"}]}}),
    )?;
    k.pool(
        "small",
        json!({"ranges": [{"start": "10.251.0.200", "stop": "10.251.0.201"}], "announce": "l2",
               "serviceSelector": {"matchLabels": {"pool": "small"}}}),
    )?;
    let none = json!({});
    // A requested address (the annotation), and the legacy field.
    k.api.create(
        "services",
        "a",
        &lb_service(
            "a",
            "req",
            80,
            none.clone(),
            json!({"lockstep.io/ips": "10.251.0.150"}),
        ),
    )?;
    let mut legacy = lb_service("a", "legacy", 80, none.clone(), none.clone());
    legacy["spec"]["loadBalancerIP"] = json!("10.251.0.151");
    k.api.create("services", "a", &legacy)?;
    // A sharing key: two ports share one address; a third on a port
    // already used there cannot.
    let key = json!({"lockstep.io/sharing-key": "web"});
    k.api.create(
        "services",
        "a",
        &lb_service("a", "web-http", 80, none.clone(), key.clone()),
    )?;
    k.api.create(
        "services",
        "a",
        &lb_service("a", "web-https", 443, none.clone(), key.clone()),
    )?;
    // The same key in another namespace without the opt-in: its own address.
    k.api.create(
        "services",
        "b",
        &lb_service("b", "web-other", 8080, none.clone(), key.clone()),
    )?;
    // Another class: lockstep's to leave alone.
    let mut other = lb_service("a", "theirs", 80, none.clone(), none.clone());
    other["spec"]["loadBalancerClass"] = json!("example.com/other-lb");
    k.api.create("services", "a", &other)?;
    // Three services for a two-address pool.
    let small = json!({"pool": "small"});
    for n in ["x1", "x2", "x3"] {
        k.api.create(
            "services",
            "a",
            &lb_service("a", n, 80, small.clone(), none.clone()),
        )?;
    }
    let got = k.wait_assigned(
        &ids(
            "a",
            ["req", "legacy", "web-http", "web-https", "x1", "x2"].map(String::from),
        ),
        1,
        Duration::from_secs(60),
    )?;
    ensure!(
        got["a/req"] == vec!["10.251.0.150".parse::<IpAddr>()?],
        "{got:?}"
    );
    ensure!(
        got["a/legacy"] == vec!["10.251.0.151".parse::<IpAddr>()?],
        "{got:?}"
    );
    ensure!(
        got["a/web-http"] == got["a/web-https"],
        "not shared: {got:?}"
    );
    let other_ns = k.wait_assigned(
        &ids("b", ["web-other".to_string()]),
        1,
        Duration::from_secs(20),
    )?;
    ensure!(
        other_ns["b/web-other"] != got["a/web-http"],
        "shared across namespaces without opt-in"
    );
    // Exhausted: condition and Event name the pool.
    let c = wait_for("x3 pending with a reason", Duration::from_secs(20), || {
        k.condition("a", "x3").filter(|c| c.0 == "False")
    })?;
    ensure!(c.1 == "PoolExhausted" && c.2.contains("small"), "{c:?}");
    wait_for("an Event for x3", Duration::from_secs(20), || {
        (!k.events("a", "x3", "PoolExhausted").is_empty()).then_some(())
    })?;
    let ev = &k.events("a", "x3", "PoolExhausted")[0];
    ensure!(
        ev["type"] == "Warning" && ev["reportingController"] == "lockstep",
        "{ev}"
    );
    // The pool grows: x3 is served, x1 and x2 keep theirs.
    k.api.patch(
        "loadbalancerippools",
        "",
        "small",
        &json!({"spec": {"ranges": [{"start": "10.251.0.200", "stop": "10.251.0.202"}]}}),
        false,
    )?;
    let x3 = k.wait_assigned(&ids("a", ["x3".to_string()]), 1, Duration::from_secs(30))?;
    ensure!(
        x3["a/x3"] == vec!["10.251.0.202".parse::<IpAddr>()?],
        "{x3:?}"
    );
    let now = k.ingress();
    ensure!(
        now["a/x1"] == got["a/x1"] && now["a/x2"] == got["a/x2"],
        "moved: {now:?}"
    );
    // A port clash on the shared address.
    k.api.create(
        "services",
        "a",
        &lb_service("a", "web-clash", 443, none.clone(), key.clone()),
    )?;
    let c = wait_for("web-clash refused", Duration::from_secs(20), || {
        k.condition("a", "web-clash").filter(|c| c.0 == "False")
    })?;
    ensure!(c.1 == "SharingKeyConflict", "{c:?}");
    // Another class: nothing written, not even a condition.
    let theirs = k.api.get("services", "a", "theirs")?;
    ensure!(
        theirs
            .get("status")
            .is_none_or(|s| s["conditions"].is_null() && s["loadBalancer"]["ingress"].is_null()),
        "{theirs}"
    );
    let all = k.ingress();
    distinct(
        &all.iter()
            .filter(|(id, _)| !id.starts_with("a/web-h"))
            .map(|(a, b)| (a.clone(), b.clone()))
            .collect(),
    )?;
    // A requested address and a malformed request.
    k.api.create(
        "services",
        "a",
        &lb_service(
            "a",
            "wants-req",
            80,
            none.clone(),
            json!({"lockstep.io/ips": "10.251.0.150"}),
        ),
    )?;
    k.api.create(
        "services",
        "a",
        &lb_service(
            "a",
            "bad",
            80,
            none.clone(),
            json!({"lockstep.io/ips": "ten"}),
        ),
    )?;
    let c = wait_for("the taken request", Duration::from_secs(20), || {
        k.condition("a", "wants-req").filter(|c| c.0 == "False")
    })?;
    ensure!(c.1 == "RequestedTaken" && c.2.contains("a/req"), "{c:?}");
    let c = wait_for("the malformed request", Duration::from_secs(20), || {
        k.condition("a", "bad").filter(|c| c.0 == "False")
    })?;
    ensure!(
        c.1 == "InvalidRequest" && c.2.contains("lockstep.io/ips"),
        "{c:?}"
    );
    // Deletion releases: the address is answered no more, and the waiting
    // request gets it.
    let gone = got["a/req"].clone();
    answered_once(&k, &gone)?;
    k.api.delete("services", "a", "req")?;
    let w = k.wait_assigned(
        &ids("a", ["wants-req".to_string()]),
        1,
        Duration::from_secs(30),
    )?;
    ensure!(w["a/wants-req"] == gone, "{w:?}");
    // A type change releases too, and lockstep's status goes.
    let legacy_addr = got["a/legacy"].clone();
    k.api.patch(
        "services",
        "a",
        "legacy",
        &json!({"spec": {"type": "ClusterIP", "loadBalancerIP": null}}),
        false,
    )?;
    wait_for(
        "legacy's status cleared and its address released",
        Duration::from_secs(30),
        || {
            let s = k.api.get("services", "a", "legacy").ok()?;
            let v = k.lab.get(0).ok()?;
            (condition_of(&s).is_none() && v["services"].get("a/legacy").is_none()).then_some(())
        },
    )?;
    wait_for(
        "no answer for legacy's address",
        Duration::from_secs(10),
        || {
            probe_once(&k.lab, &legacy_addr, Duration::from_millis(500))
                .ok()?
                .is_empty()
                .then_some(())
        },
    )?;
    ensure!(
        k.api.refusals().is_empty(),
        "the double refused: {:?}",
        k.api.refusals()
    );
    // Every request the door sent is one deploy/rbac.yaml allows, and
    // Events were among them.
    let outside = k.outside_rbac()?;
    ensure!(
        outside.is_empty(),
        "requests outside the ClusterRole: {outside:?}"
    );
    ensure!(
        k.api
            .requests()
            .iter()
            .any(|r| r.method == "POST" && r.path.contains("/events")),
        "no Event created"
    );
    Ok(())
}

#[test]
fn c_assigner_killed_while_services_are_created() -> anyhow::Result<()> {
    privileged!();
    let (_cluster, mut k) = lab("k8sc", unlabelled())?;
    k.pool("pub", pool_spec())?;
    k.api.create(
        "services",
        "shop",
        &lb_service("shop", "first", 80, json!({}), json!({})),
    )?;
    k.wait_assigned(
        &ids("shop", ["first".to_string()]),
        1,
        Duration::from_secs(60),
    )?;
    let assigner = k.lab.get(0)?["cluster"]["assigner"]
        .as_str()
        .context("assigner")?
        .trim_start_matches("node-")
        .parse::<usize>()?;
    // #47 item 4: the other two agents hold no watch of every Service,
    // pool or Node.
    let settled = k.wait_writer_only_watches(Duration::from_secs(20))?;
    eprintln!("one watch of each kind (the assigner's) after {settled:?}");
    let names: Vec<String> = (0..30).map(|i| format!("k{i:02}")).collect();
    for (i, n) in names.iter().enumerate() {
        if i == 10 {
            k.lab.agents[assigner].kill9();
            eprintln!("node-{assigner} (the assigner) SIGKILLed after 10 creations");
        }
        k.api.create(
            "services",
            "shop",
            &lb_service("shop", n, 80, json!({}), json!({})),
        )?;
        std::thread::sleep(Duration::from_millis(30));
    }
    let mut all = ids("shop", names);
    all.insert("shop/first".into());
    let t = Instant::now();
    let got = k.wait_assigned(&all, 1, Duration::from_secs(90))?;
    distinct(&got)?;
    let other = (assigner + 1) % 3;
    let v = k.lab.get(other)?;
    let new = v["cluster"]["assigner"].as_str().unwrap_or("");
    ensure!(new != format!("node-{assigner}"), "still assigner: {new}");
    eprintln!(
        "all 31 served {:?} after the last creation; assigner now {new}",
        t.elapsed()
    );
    // The new assigner watches (it wrote the statuses above); the killed
    // one's watches closed with its connections; the third still none.
    let settled = k.wait_writer_only_watches(Duration::from_secs(20))?;
    eprintln!("one watch of each kind (the new assigner's) after {settled:?}");
    // The statuses are the etcd state's.
    let state = lockstep_tests::lb_lab::addresses(&v)?;
    for (id, a) in &got {
        ensure!(
            state.get(id) == Some(a),
            "{id}: status {a:?}, etcd {:?}",
            state.get(id)
        );
    }
    Ok(())
}

#[test]
fn d_watches_broken_and_expired_converge_without_moving_addresses() -> anyhow::Result<()> {
    privileged!();
    let (_cluster, k) = lab("k8sd", unlabelled())?;
    k.pool("pub", pool_spec())?;
    let create = |names: &[String]| -> anyhow::Result<()> {
        for n in names {
            k.api.create(
                "services",
                "shop",
                &lb_service("shop", n, 80, json!({}), json!({})),
            )?;
        }
        Ok(())
    };
    let first: Vec<String> = (0..20).map(|i| format!("d{i:02}")).collect();
    create(&first)?;
    let before = k.wait_assigned(&ids("shop", first.clone()), 1, Duration::from_secs(60))?;
    let lists = |k: &KubeLab| {
        k.api
            .requests()
            .iter()
            .filter(|r| {
                r.method == "GET" && r.path == "/api/v1/services" && !r.query.contains("watch=true")
            })
            .count()
    };
    let lists_before = lists(&k);
    // Broken: clients watch again from where they were (no relist).
    // Only the writer watches every Service (#47 item 4).
    k.wait_writer_only_watches(Duration::from_secs(10))?;
    k.api.break_watches();
    let second: Vec<String> = (20..25).map(|i| format!("d{i:02}")).collect();
    create(&second)?;
    k.wait_assigned(&ids("shop", second.clone()), 1, Duration::from_secs(30))?;
    // Expired mid-stream (410): clients relist.
    k.wait_writer_only_watches(Duration::from_secs(10))?;
    k.api.expire();
    let third: Vec<String> = (25..30).map(|i| format!("d{i:02}")).collect();
    create(&third)?;
    k.api.delete("services", "shop", "d00")?;
    let mut all = ids("shop", second.into_iter().chain(third));
    all.extend(ids("shop", first[1..].to_vec()));
    let after = k.wait_assigned(&all, 1, Duration::from_secs(30))?;
    wait_for("d00 released", Duration::from_secs(20), || {
        k.lab.get(0).ok()?["services"]
            .get("shop/d00")
            .is_none()
            .then_some(())
    })?;
    // The writer relists (kube-runtime backs off after an error), and
    // the other agents hold no watch of Services to relist.
    let relisted = wait_for("the writer relisting", Duration::from_secs(30), || {
        (lists(&k) > lists_before).then_some(())
    });
    let relists = lists(&k) - lists_before;
    ensure!(
        relisted.is_ok(),
        "{relists} service lists after the expiry; the writer relists"
    );
    k.wait_writer_only_watches(Duration::from_secs(10))?;
    for (id, a) in &before {
        if id != "shop/d00" {
            ensure!(after[id] == *a, "{id} moved: {a:?} → {:?}", after[id]);
        }
    }
    distinct(&after)?;
    eprintln!("after a break and an expiry: {relists} relists, 29 services, none moved");
    Ok(())
}

#[test]
fn e_a_shrunk_pool_keeps_the_addresses_still_in_it() -> anyhow::Result<()> {
    privileged!();
    let (_cluster, k) = lab("k8se", unlabelled())?;
    k.pool(
        "pub",
        json!({"ranges": [{"start": "10.251.0.130", "stop": "10.251.0.180"}], "announce": "l2"}),
    )?;
    let names: Vec<String> = (0..10).map(|i| format!("e{i:02}")).collect();
    for n in &names {
        k.api.create(
            "services",
            "shop",
            &lb_service("shop", n, 80, json!({}), json!({})),
        )?;
    }
    let before = k.wait_assigned(&ids("shop", names.clone()), 1, Duration::from_secs(60))?;
    // Shrunk from below: the lowest addresses leave the pool.
    let cut: IpAddr = "10.251.0.135".parse()?;
    k.api.patch(
        "loadbalancerippools",
        "",
        "pub",
        &json!({"spec": {"ranges": [{"start": "10.251.0.135", "stop": "10.251.0.170"}]}}),
        false,
    )?;
    let moved: BTreeSet<&String> = before
        .iter()
        .filter(|(_, a)| a[0] < cut)
        .map(|(id, _)| id)
        .collect();
    ensure!(
        !moved.is_empty() && moved.len() < before.len(),
        "{before:?}"
    );
    let after = wait_for(
        "the services outside the shrunk pool moved",
        Duration::from_secs(30),
        || {
            let now = k.ingress();
            moved
                .iter()
                .all(|id| now.get(*id).is_some_and(|a| a.len() == 1 && a[0] >= cut))
                .then_some(now)
        },
    )?;
    for (id, a) in &before {
        if !moved.contains(id) {
            ensure!(
                after[id] == *a,
                "{id} kept in the pool but moved: {a:?} → {:?}",
                after[id]
            );
        }
    }
    distinct(
        &after
            .into_iter()
            .filter(|(id, _)| before.contains_key(id))
            .collect(),
    )?;
    eprintln!(
        "{} of 10 services left the shrunk pool and moved; the others kept theirs",
        moved.len()
    );
    Ok(())
}

#[test]
fn f_node_selector_matches_node_labels() -> anyhow::Result<()> {
    privileged!();
    let (_cluster, k) = lab(
        "k8sf",
        [
            json!({"zone": "a"}),
            json!({"zone": "b"}),
            json!({"zone": "b"}),
        ],
    )?;
    k.pool(
        "zone-a",
        json!({"cidrs": ["10.251.0.128/27"], "announce": "l2",
               "nodeSelector": {"matchLabels": {"zone": "a"}}}),
    )?;
    let names: Vec<String> = (0..8).map(|i| format!("f{i:02}")).collect();
    for n in &names {
        k.api.create(
            "services",
            "shop",
            &lb_service("shop", n, 80, json!({}), json!({})),
        )?;
    }
    let got = k.wait_assigned(&ids("shop", names), 1, Duration::from_secs(60))?;
    let addrs = distinct(&got)?;
    let announcers = wait_for("all announced", Duration::from_secs(30), || {
        let a = k.lab.announcers(0).ok()?;
        addrs.iter().all(|x| a.contains_key(x)).then_some(a)
    })?;
    for a in &addrs {
        ensure!(
            announcers[a] == 0,
            "{a} announced by node-{}",
            announcers[a]
        );
    }
    answered_once(&k, &addrs)?;
    let labels = &k.lab.get(0)?["cluster"]["member_labels"];
    ensure!(
        labels["node-0"]["zone"] == "a" && labels["node-1"]["zone"] == "b",
        "{labels}"
    );
    Ok(())
}

/// "Service created → status written": 200 Services created one every
/// 10 ms (so a burst is in flight, as a `kubectl apply` of many would
/// make), each timed from its creation to the first stored write of its
/// status with an address, as the double records them. Goal: p99 ≤ 1 s
/// (#28); a miss fails the run.
#[test]
#[ignore = "a benchmark: cargo xtask bench lb"]
fn service_status_bench() -> anyhow::Result<()> {
    privileged!();
    let n_services = lockstep_tests::bench::size(200, 5);
    const GOAL: Duration = Duration::from_secs(1);
    let (_cluster, k) = lab("k8sbench", unlabelled())?;
    k.pool(
        "bench",
        json!({"cidrs": ["10.251.4.0/23"], "announce": "l2"}),
    )?;
    // One Service first: the writer is elected and its reflectors listed.
    k.api.create(
        "services",
        "warm",
        &lb_service("warm", "up", 80, json!({}), json!({})),
    )?;
    k.wait_assigned(&ids("warm", ["up".to_string()]), 1, Duration::from_secs(60))?;
    let mut created = BTreeMap::new();
    let names: Vec<String> = (0..n_services).map(|i| format!("b{i:03}")).collect();
    let started = Instant::now();
    for n in &names {
        created.insert(format!("bench/{n}"), Instant::now());
        k.api.create(
            "services",
            "bench",
            &lb_service("bench", n, 80, json!({}), json!({})),
        )?;
        std::thread::sleep(Duration::from_millis(10));
    }
    let got = k.wait_assigned(&ids("bench", names), 1, Duration::from_secs(120))?;
    let total = started.elapsed();
    distinct(&got)?;
    let lat = k.status_latencies(&created)?;
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let (p50, p99) = (pct(&lat, 0.5), pct(&lat, 0.99));
    println!(
        "| Kubernetes LoadBalancer ({n_services} Services, one every 10 ms, cluster mode) | value |"
    );
    println!("|---|---|");
    println!(
        "| Service created -> status written: p50 / p99 / max | {:.0} / {:.0} / {:.0} ms (goal p99 <= {:.0} ms) |",
        ms(p50),
        ms(p99),
        ms(*lat.last().context("none")?),
        ms(GOAL)
    );
    println!(
        "all {n_services} written {:.1} s after the first creation",
        total.as_secs_f64()
    );
    // The writer's passes, when its log has them (RUST_LOG with
    // lockstep::kubernetes=debug): where the time went.
    for a in &k.lab.agents {
        let log = a.log();
        let passes: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("kubernetes: pass"))
            .collect();
        for l in passes.iter().take(40) {
            eprintln!("{l}");
        }
    }
    ensure!(
        p99 <= GOAL || lockstep_tests::bench::smoke(),
        "Service created -> status written p99 {:.0} ms misses the goal of {:.0} ms",
        ms(p99),
        ms(GOAL)
    );
    Ok(())
}
