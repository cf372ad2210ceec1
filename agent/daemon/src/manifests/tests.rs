use std::collections::BTreeSet;

use serde_json::Value;

use super::*;

fn options(mode: Mode) -> Options {
    Options {
        mode,
        namespace: "kube-system".into(),
        image: "localhost/lockstep:test".into(),
        uplink: "eth0".into(),
        metrics_addr: "0.0.0.0:9476".parse().unwrap(),
        pools: match mode {
            Mode::Lb | Mode::PodCidr => vec![],
            _ => vec![
                "10.244.0.0/16".parse().unwrap(),
                "fd00:244::/64".parse().unwrap(),
            ],
        },
        lb_pools: vec![],
        non_masquerade: vec!["10.96.0.0/12".parse().unwrap()],
        etcd: match mode {
            Mode::Cluster => vec!["https://10.0.0.10:2379".into()],
            _ => vec![],
        },
        etcd_tls_secret: (mode == Mode::Cluster).then(|| "lockstep-etcd-tls".into()),
        lb_class: "lockstep.io/lb".into(),
        serve_classless: true,
        conflist_name: "05-lockstep.conflist".into(),
        service_monitor: false,
        bgp: None,
    }
}

/// Every mode (as `--mode` lists them, so a new one is never missed).
fn all() -> &'static [Mode] {
    <Mode as clap::ValueEnum>::value_variants()
}

fn docs(yaml: &str) -> Vec<Value> {
    serde_saphyr::from_multiple(yaml).expect("the rendered YAML reads back")
}

fn kind<'a>(docs: &'a [Value], kind: &str) -> Option<&'a Value> {
    docs.iter().find(|d| d["kind"] == kind)
}

#[test]
fn every_mode_renders_a_config_the_agent_accepts() {
    for &mode in all() {
        let d = docs(&render(&options(mode)).unwrap());
        let config = kind(&d, "ConfigMap").unwrap()["data"]["config.toml"]
            .as_str()
            .unwrap();
        let c = Config::parse(Path::new("c"), config).unwrap();
        assert_eq!(c.cni.install, mode.serves_pods(), "{mode:?}");
        assert_eq!(c.kubernetes.is_some(), mode.uses_api(), "{mode:?}");
        assert_eq!(c.cluster.is_some(), mode == Mode::Cluster, "{mode:?}");
        assert_eq!(c.pools.is_empty(), mode != Mode::Local, "{mode:?}");
        assert_eq!(
            c.kubernetes.as_ref().and_then(|k| k.pod_cidr_pool.clone()),
            (mode == Mode::PodCidr).then(|| "pods".to_string()),
            "{mode:?}"
        );
        // Multi-pool: the writer is the NodeIPAM operator, and the node's
        // pool is the PodIPPool `--pool` renders.
        let nodeipam = c.kubernetes.and_then(|k| k.nodeipam);
        assert_eq!(nodeipam.is_some(), mode == Mode::MultiPool, "{mode:?}");
        if let Some(n) = nodeipam {
            assert!(n.operator);
            assert_eq!(n.pools[0].name, POD_POOL);
        }
    }
}

#[test]
fn multi_pool_renders_its_crds_its_pool_and_the_nodeipam_policy() {
    let d = docs(&render(&options(Mode::MultiPool)).unwrap());
    let crds: BTreeSet<String> = d
        .iter()
        .filter(|o| o["kind"] == "CustomResourceDefinition")
        .map(|o| o["metadata"]["name"].as_str().unwrap().to_string())
        .collect();
    assert!(crds.contains("podippools.lockstep.io") && crds.contains("nodeipams.lockstep.io"));
    let policies: BTreeSet<String> = d
        .iter()
        .filter(|o| o["kind"] == "ValidatingAdmissionPolicyBinding")
        .map(|o| o["metadata"]["name"].as_str().unwrap().to_string())
        .collect();
    assert!(
        policies.contains(admission::NODEIPAM_POLICY),
        "{policies:?}"
    );
    let pools = docs(&render_pools(&options(Mode::MultiPool)).unwrap());
    let pool = kind(&pools, "PodIPPool").expect("the pods' pool");
    assert_eq!(pool["metadata"]["name"], POD_POOL);
}

#[test]
fn the_agent_is_told_its_node_name_by_the_downward_api() {
    for &mode in all() {
        let d = docs(&render(&options(mode)).unwrap());
        let ds = kind(&d, "DaemonSet").unwrap();
        let env = &ds["spec"]["template"]["spec"]["containers"][0]["env"];
        assert_eq!(env[0]["name"], "NODE_NAME", "{mode:?}");
        assert_eq!(
            env[0]["valueFrom"]["fieldRef"]["fieldPath"], "spec.nodeName",
            "{mode:?}"
        );
    }
}

#[test]
fn no_classless_leaves_services_without_a_class_to_others() {
    for classless in [true, false] {
        let mut o = options(Mode::Lb);
        o.serve_classless = classless;
        let d = docs(&render(&o).unwrap());
        let config = kind(&d, "ConfigMap").unwrap()["data"]["config.toml"]
            .as_str()
            .unwrap();
        let c = Config::parse(Path::new("c"), config).unwrap();
        assert_eq!(c.kubernetes.unwrap().serve_classless, classless);
    }
}

#[test]
fn mode_lb_installs_no_cni_config_and_mounts_no_cni_directory() {
    let d = docs(&render(&options(Mode::Lb)).unwrap());
    let ds = kind(&d, "DaemonSet").unwrap();
    let volumes = ds["spec"]["template"]["spec"]["volumes"].to_string();
    assert!(!volumes.contains("/etc/cni/net.d"), "{volumes}");
    assert!(!volumes.contains("/opt/cni/bin"), "{volumes}");
    assert!(kind(&d, "CustomResourceDefinition").is_some());
    assert!(kind(&d, "ClusterRole").is_some());
}

#[test]
fn no_mode_is_privileged_and_every_capability_is_named() {
    for &mode in all() {
        let d = docs(&render(&options(mode)).unwrap());
        let ds = kind(&d, "DaemonSet").unwrap();
        let sc = &ds["spec"]["template"]["spec"]["containers"][0]["securityContext"];
        assert_eq!(sc["privileged"], false);
        assert_eq!(sc["allowPrivilegeEscalation"], false);
        assert_eq!(sc["capabilities"]["drop"], serde_json::json!(["ALL"]));
        let added: Vec<&str> = sc["capabilities"]["add"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_str().unwrap())
            .collect();
        let named: Vec<&str> = objects::CAPABILITIES.iter().map(|(c, _)| *c).collect();
        assert_eq!(added, named);
    }
}

#[test]
fn a_config_change_changes_the_pod_templates_checksum_and_nothing_else_does() {
    let checksum = |o: &Options| {
        let d = docs(&render(o).unwrap());
        kind(&d, "DaemonSet").unwrap()["spec"]["template"]["metadata"]["annotations"]
            ["lockstep.io/config-sha256"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let a = options(Mode::Local);
    let mut image = a.clone();
    image.image = "localhost/lockstep:other".into();
    let mut uplink = a.clone();
    uplink.uplink = "bond0".into();
    assert_eq!(checksum(&a).len(), 64);
    assert_eq!(checksum(&a), checksum(&image));
    assert_ne!(checksum(&a), checksum(&uplink));
}

#[test]
fn flags_that_do_not_fit_the_mode_are_named() {
    let err = |o: Options| render(&o).unwrap_err().to_string();
    let mut o = options(Mode::Cluster);
    o.etcd.clear();
    assert!(err(o).starts_with("--etcd:"));
    let mut o = options(Mode::Local);
    o.pools.clear();
    assert!(err(o).starts_with("--pool:"));
    let mut o = options(Mode::Lb);
    o.pools = vec!["10.0.0.0/8".parse().unwrap()];
    assert!(err(o).starts_with("--pool:"));
    let mut o = options(Mode::PodCidr);
    o.pools = vec!["10.0.0.0/8".parse().unwrap()];
    assert!(err(o).starts_with("--pool:"));
    let mut o = options(Mode::Local);
    o.etcd = vec!["http://e:2379".into()];
    assert!(err(o).starts_with("--etcd:"));
    let mut o = options(Mode::Lb);
    o.namespace = "Kube_System".into();
    assert!(err(o).starts_with("--namespace:"));
    let mut o = options(Mode::Lb);
    o.metrics_addr = "127.0.0.1:9476".parse().unwrap();
    o.service_monitor = true;
    assert!(err(o).starts_with("--metrics-addr:"));
    // A value only the agent's parser refuses is refused as the agent would.
    let mut o = options(Mode::Lb);
    o.lb_class = String::new();
    let e = render(&o).unwrap_err();
    assert!(matches!(e, ManifestsError::Config(_)), "{e}");
    assert!(
        crate::error_chain(&e).contains("kubernetes.lb_class"),
        "{}",
        crate::error_chain(&e)
    );
}

#[test]
fn a_namespace_of_its_own_is_rendered_and_enforces_privileged() {
    let mut o = options(Mode::Lb);
    o.namespace = "lockstep".into();
    let d = docs(&render(&o).unwrap());
    let ns = kind(&d, "Namespace").unwrap();
    assert_eq!(ns["metadata"]["name"], "lockstep");
    assert_eq!(
        ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"],
        "privileged"
    );
    let binding = kind(&d, "ClusterRoleBinding").unwrap();
    assert_eq!(binding["subjects"][0]["namespace"], "lockstep");
    assert!(kind(&docs(&render(&options(Mode::Lb)).unwrap()), "Namespace").is_none());
}

/// What a Role's or ClusterRole's rules grant, as `group/resource:verb`.
fn granted(role: &Value) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for rule in role["rules"].as_array().unwrap() {
        for g in rule["apiGroups"].as_array().unwrap() {
            for r in rule["resources"].as_array().unwrap() {
                for v in rule["verbs"].as_array().unwrap() {
                    out.insert(format!(
                        "{}/{}:{}",
                        g.as_str().unwrap(),
                        r.as_str().unwrap(),
                        v.as_str().unwrap()
                    ));
                }
            }
        }
    }
    out
}

#[test]
fn every_modes_rules_are_within_the_role_the_end_to_end_tests_check() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/rbac.yaml");
    let d = docs(&std::fs::read_to_string(path).unwrap());
    let allowed = granted(kind(&d, "ClusterRole").unwrap());
    for mode in [Mode::Lb, Mode::PodCidr, Mode::Cluster, Mode::MultiPool] {
        for rule in rules(mode).iter().chain(&rbac::bgp_rules(mode)) {
            for r in rule.resources {
                for v in rule.verbs {
                    let want = format!("{}/{r}:{v}", rule.group);
                    assert!(allowed.contains(&want), "{mode:?}: {want}");
                }
            }
        }
    }
    assert!(rules(Mode::Local).is_empty());
    // The election's Lease: the Role in the agent's namespace.
    let namespaced = granted(kind(&d, "Role").unwrap());
    for mode in [Mode::Lb, Mode::PodCidr, Mode::MultiPool] {
        assert!(
            !namespaced_rules(mode).is_empty(),
            "{mode:?} elects on a Lease"
        );
        for rule in namespaced_rules(mode) {
            for r in rule.resources {
                for v in rule.verbs {
                    let want = format!("{}/{r}:{v}", rule.group);
                    assert!(namespaced.contains(&want), "{mode:?}: {want}");
                }
            }
        }
    }
    assert!(namespaced_rules(Mode::Cluster).is_empty());
}

#[test]
fn modes_without_etcd_elect_in_the_agents_namespace() {
    let mut o = options(Mode::Lb);
    o.namespace = "lockstep".into();
    let d = docs(&render(&o).unwrap());
    let role = kind(&d, "Role").expect("a Role for the Lease");
    assert_eq!(role["metadata"]["namespace"], "lockstep");
    assert_eq!(role["rules"][0]["resources"][0], "leases");
    let binding = kind(&d, "RoleBinding").expect("bound");
    assert_eq!(binding["subjects"][0]["namespace"], "lockstep");
    let config = o.config_toml();
    let parsed = Config::parse(Path::new("c.toml"), &config).unwrap();
    let k = parsed.kubernetes.expect("[kubernetes]");
    assert_eq!(k.election.namespace, "lockstep");
    assert!(kind(&docs(&render(&options(Mode::Cluster)).unwrap()), "Role").is_none());
}

#[test]
fn pool_flags_render_pool_objects_apart_from_the_install() {
    let mut o = options(Mode::Cluster);
    o.lb_pools = vec!["192.0.2.0/26".parse().unwrap()];
    let install = docs(&render(&o).unwrap());
    assert!(kind(&install, "LoadBalancerIPPool").is_none());
    let d = docs(&render_pools(&o).unwrap());
    let lb = kind(&d, "LoadBalancerIPPool").unwrap();
    assert_eq!(lb["spec"]["cidrs"], serde_json::json!(["192.0.2.0/26"]));
    let pod = kind(&d, "PodIPPool").unwrap();
    assert_eq!(pod["spec"]["ipv4"], serde_json::json!(["10.244.0.0/16"]));
    assert_eq!(pod["spec"]["ipv6"], serde_json::json!(["fd00:244::/64"]));
    let err = render_pools(&options(Mode::Lb)).unwrap_err().to_string();
    assert!(err.starts_with("--lb-pool:"), "{err}");
}

/// The DaemonSets in deploy/ are renders of the generator, committed so
/// they can be read without running it: they must be what it renders now.
#[test]
fn the_committed_daemonsets_are_what_the_generator_renders() {
    let committed = |file: &str| {
        std::fs::read_to_string(format!(
            "{}/../../deploy/{file}",
            env!("CARGO_MANIFEST_DIR")
        ))
        .unwrap()
    };
    let mut local = options(Mode::Local);
    local.image = default_image();
    local.pools = vec![
        "10.244.1.0/24".parse().unwrap(),
        "fd00:10:244:1::/112".parse().unwrap(),
    ];
    assert!(
        committed("daemonset.yaml") == render(&local).unwrap(),
        "deploy/daemonset.yaml is stale: run `lockstep manifests --mode local --pool 10.244.1.0/24 \
         --pool fd00:10:244:1::/112 --non-masquerade 10.96.0.0/12 > deploy/daemonset.yaml`"
    );
    let mut cluster = options(Mode::Cluster);
    cluster.image = default_image();
    cluster.pools.clear();
    cluster.etcd = (10..13)
        .map(|i| format!("https://10.0.0.{i}:2379"))
        .collect();
    assert!(
        committed("daemonset-cluster.yaml") == render(&cluster).unwrap(),
        "deploy/daemonset-cluster.yaml is stale: run `lockstep manifests --mode cluster \
         --etcd https://10.0.0.10:2379 --etcd https://10.0.0.11:2379 --etcd https://10.0.0.12:2379 \
         --etcd-tls-secret lockstep-etcd-tls --non-masquerade 10.96.0.0/12 > deploy/daemonset-cluster.yaml`"
    );
}

#[test]
fn the_cleanup_runs_uninstall_on_every_node_with_the_agents_paths() {
    for &mode in all() {
        let d = docs(&render_cleanup(&options(mode)).unwrap());
        assert_eq!(d.len(), 2, "{mode:?}");
        let install = docs(&render(&options(mode)).unwrap());
        assert_eq!(kind(&d, "ConfigMap"), kind(&install, "ConfigMap"));
        let ds = kind(&d, "DaemonSet").unwrap();
        assert_eq!(ds["metadata"]["name"], "lockstep-cleanup");
        let agent = kind(&install, "DaemonSet").unwrap();
        let (pod, agent_pod) = (
            &ds["spec"]["template"]["spec"],
            &agent["spec"]["template"]["spec"],
        );
        assert_eq!(pod["volumes"], agent_pod["volumes"], "{mode:?}");
        let c = &pod["containers"][0];
        assert_eq!(c["args"][0], "uninstall");
        assert_eq!(
            c["volumeMounts"],
            agent_pod["containers"][0]["volumeMounts"]
        );
        assert_eq!(
            c["securityContext"],
            agent_pod["containers"][0]["securityContext"]
        );
        assert_eq!(pod["automountServiceAccountToken"], false);
        // Its pods are not the agent's: the metrics Service and the agent's
        // DaemonSet select neither.
        assert_ne!(
            ds["spec"]["selector"]["matchLabels"],
            agent["spec"]["selector"]["matchLabels"]
        );
    }
}

#[test]
fn modes_with_the_lease_admit_lb_writes_only_from_its_holder() {
    let mut o = options(Mode::Lb);
    o.namespace = "lockstep".into();
    let d = docs(&render(&o).unwrap());
    let policy = kind(&d, "ValidatingAdmissionPolicy").expect("the policy");
    assert_eq!(policy["spec"]["paramKind"]["kind"], "Lease");
    let rules = policy["spec"]["matchConstraints"]["resourceRules"].to_string();
    for r in [
        "services/status",
        "loadbalancerippools",
        "loadbalancerippools/status",
    ] {
        assert!(rules.contains(r), "{r} in {rules}");
    }
    // Only the agent's own requests are judged.
    assert_eq!(
        policy["spec"]["matchConditions"][0]["expression"],
        "request.userInfo.username == 'system:serviceaccount:lockstep:lockstep'"
    );
    let check = policy["spec"]["validations"][0]["expression"]
        .as_str()
        .unwrap();
    assert!(
        check.contains("params.spec.holderIdentity == request.userInfo.extra['authentication.kubernetes.io/node-name'][0]"),
        "{check}"
    );
    let binding = kind(&d, "ValidatingAdmissionPolicyBinding").expect("bound");
    assert_eq!(binding["spec"]["paramRef"]["name"], "lockstep-lb-writer");
    assert_eq!(binding["spec"]["paramRef"]["namespace"], "lockstep");
    assert_eq!(
        binding["spec"]["paramRef"]["parameterNotFoundAction"],
        "Deny"
    );
    assert_eq!(binding["spec"]["validationActions"][0], "Deny");
    // The Lease the policy reads is the one the rendered config elects on.
    let parsed = Config::parse(Path::new("c.toml"), &o.config_toml()).unwrap();
    let election = parsed.kubernetes.unwrap().election;
    assert_eq!(binding["spec"]["paramRef"]["name"], election.name.as_str());
    assert_eq!(election.namespace, "lockstep");
    assert!(
        kind(
            &docs(&render(&options(Mode::PodCidr)).unwrap()),
            "ValidatingAdmissionPolicy"
        )
        .is_some()
    );
    assert!(
        kind(
            &docs(&render(&options(Mode::Cluster)).unwrap()),
            "ValidatingAdmissionPolicy"
        )
        .is_none()
    );
}

fn with_bgp(mode: Mode) -> Options {
    let mut o = options(mode);
    o.bgp = Some(bgp::BgpInstall {
        asn: 64512,
        peers: vec!["tor-a,192.0.2.1,64513".parse().unwrap()],
        pools: vec!["default".into()],
        bird_image: "registry.example/bird:2".into(),
    });
    o
}

#[test]
fn bgp_renders_a_config_the_agent_accepts_and_bird_apart_from_the_agent() {
    let yaml = render(&with_bgp(Mode::Lb)).expect("renders");
    let docs = docs(&yaml);
    // The agent's config: [bgp] without a router ID, accepted under
    // [kubernetes] (the Node's InternalIP stands in).
    let map = kind(&docs, "ConfigMap").expect("a ConfigMap");
    let text = map["data"]["config.toml"].as_str().unwrap();
    let config = Config::parse(Path::new("config.toml"), text).expect("the agent accepts it");
    let b = config.bgp.expect("[bgp]");
    assert_eq!((b.asn, b.router_id, b.peers.len()), (64512, None, 1));
    assert!(b.pools.contains_key("default"), "{text}");
    // BIRD and the keeper in a DaemonSet of their own: an agent rollout
    // leaves them running.
    let sets: Vec<&Value> = docs.iter().filter(|d| d["kind"] == "DaemonSet").collect();
    assert_eq!(sets.len(), 2);
    let agent = sets
        .iter()
        .find(|d| d["metadata"]["name"] == "lockstep")
        .unwrap();
    let bgp = sets
        .iter()
        .find(|d| d["metadata"]["name"] == "lockstep-bgp")
        .unwrap();
    let names = |d: &Value| -> Vec<String> {
        d["spec"]["template"]["spec"]["containers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["name"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(names(agent), ["agent"]);
    assert_eq!(names(bgp), ["bird", "bird-keeper"]);
    assert_ne!(
        agent["spec"]["selector"], bgp["spec"]["selector"],
        "the two DaemonSets select apart"
    );
    let pod = &bgp["spec"]["template"]["spec"];
    assert_eq!(pod["hostNetwork"], true);
    assert_eq!(pod["automountServiceAccountToken"], false);
    for c in pod["containers"].as_array().unwrap() {
        let sc = &c["securityContext"];
        assert_eq!(sc["privileged"], false, "{c}");
        assert_eq!(
            sc["capabilities"]["drop"],
            serde_json::json!(["ALL"]),
            "{c}"
        );
        assert!(
            c["volumeMounts"]
                .as_array()
                .unwrap()
                .iter()
                .any(|m| m["mountPath"] == bgp::BIRD_DIR),
            "{c}"
        );
    }
    assert_eq!(
        pod["containers"][1]["securityContext"]["capabilities"]["add"],
        serde_json::json!([])
    );
    // The agent writes BIRD's files where BIRD's pod reads them.
    assert!(
        pod["containers"][0]["command"][2]
            .as_str()
            .unwrap()
            .contains(&format!("{}/bird.conf", bgp::BIRD_DIR))
    );
    assert!(b.bird_config.starts_with(bgp::BIRD_DIR));
}

#[test]
fn bgp_in_mode_cluster_renders_a_config_the_agent_accepts() {
    // Pod blocks from their holder in etcd, LoadBalancer addresses from
    // every node that may serve them: [bgp] beside [cluster].
    let d = docs(&render(&with_bgp(Mode::Cluster)).expect("renders"));
    let map = kind(&d, "ConfigMap").expect("a ConfigMap");
    let text = map["data"]["config.toml"].as_str().unwrap();
    let config = Config::parse(Path::new("config.toml"), text).expect("the agent accepts it");
    assert!(
        config.cluster.is_some() && config.kubernetes.is_some(),
        "{text}"
    );
    assert_eq!(config.bgp.map(|b| b.asn), Some(64512));
    assert!(
        d.iter()
            .any(|v| v["kind"] == "DaemonSet" && v["metadata"]["name"] == "lockstep-bgp")
    );
    let allowed = granted(kind(&d, "ClusterRole").unwrap());
    // The BGPPeer objects; and the endpoints, to announce an
    // externalTrafficPolicy: Local Service only from nodes with one.
    for want in [
        "lockstep.io/bgppeers:watch",
        "discovery.k8s.io/endpointslices:watch",
    ] {
        assert!(allowed.iter().any(|a| a == want), "{want}: {allowed:?}");
    }
}

#[test]
fn bgp_installs_its_crds_and_their_rules_with_or_without_a_peer_flag() {
    for clear in [false, true] {
        let mut o = with_bgp(Mode::Lb);
        if clear {
            o.bgp.as_mut().unwrap().peers.clear();
        }
        let d = docs(&render(&o).unwrap());
        let crds: Vec<&Value> = d
            .iter()
            .filter(|v| v["kind"] == "CustomResourceDefinition")
            .collect();
        assert!(
            crds.iter()
                .any(|c| c["metadata"]["name"] == "bgppeers.lockstep.io"),
            "{crds:?}"
        );
        let allowed = granted(kind(&d, "ClusterRole").unwrap());
        for v in ["list", "watch"] {
            assert!(
                allowed.contains(&format!("lockstep.io/bgppeers:{v}")),
                "{allowed:?}"
            );
        }
    }
    // Without BGP, no such CRD nor rule.
    let d = docs(&render(&options(Mode::Lb)).unwrap());
    assert!(
        !d.iter()
            .any(|v| v["metadata"]["name"] == "bgppeers.lockstep.io")
    );
    let allowed = granted(kind(&d, "ClusterRole").unwrap());
    assert!(
        !allowed.iter().any(|a| a.contains("bgppeers")),
        "{allowed:?}"
    );
}

#[test]
fn bgp_flags_that_do_not_fit_are_named() {
    for (change, flag) in [
        (
            (|b: &mut bgp::BgpInstall| b.pools.clear()) as fn(&mut bgp::BgpInstall),
            "--bgp-pool",
        ),
        (
            |b: &mut bgp::BgpInstall| b.bird_image.clear(),
            "--bird-image",
        ),
    ] {
        let mut o = with_bgp(Mode::Lb);
        change(o.bgp.as_mut().unwrap());
        let e = render(&o).unwrap_err();
        assert!(e.to_string().starts_with(&format!("{flag}:")), "{e}");
    }
}
