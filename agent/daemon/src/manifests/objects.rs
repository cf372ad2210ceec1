//! The objects of an install, each with the comment that heads it in the
//! rendered YAML (why it is there, and for the DaemonSet, why each
//! privilege).

use kube::CustomResourceExt as _;
use serde_json::{Value, json};

use super::{ManifestsError, Mode, Options, rbac};
use crate::kubernetes::crd::LoadBalancerIPPool;
use crate::kubernetes::pod_pools::PodIPPool;

/// Where the etcd client's TLS files are mounted.
pub const ETCD_TLS_DIR: &str = "/etc/lockstep-etcd";

/// The label every object carries (and the DaemonSet selects on).
const APP: &str = "lockstep";

/// The capabilities the agent's container adds after dropping ALL, each
/// with why. The image test runs the image with exactly these.
pub const CAPABILITIES: &[(&str, &str)] = &[
    (
        "BPF",
        "load the programs, create, pin and update the maps (bpf(2))",
    ),
    (
        "NET_ADMIN",
        "netlink: endpoint veths, routes, neighbours, the tunnel device; TC/TCX attach",
    ),
    (
        "NET_RAW",
        "gratuitous ARP and unsolicited NA through AF_PACKET when an address moves here",
    ),
    (
        "SYS_ADMIN",
        "setns(2) into a pod's network namespace to configure its interface; the \
         runtime's default seccomp profile lets bpf(2) create maps only with it",
    ),
];

fn labels(mode: Mode) -> Value {
    json!({"app.kubernetes.io/name": APP, "app.kubernetes.io/component": "agent", "lockstep.io/mode": mode.name()})
}

fn meta(name: &str, o: &Options) -> Value {
    json!({"name": name, "namespace": o.namespace, "labels": labels(o.mode)})
}

/// Every object, in apply order, with its heading comment.
pub fn all(o: &Options, config: &str) -> Result<Vec<(String, Value)>, ManifestsError> {
    let mut out = Vec::new();
    if o.namespace != "kube-system" {
        out.push((
            "The agent's namespace. It runs pods with hostNetwork and hostPath volumes,\n\
             which Pod Security's baseline level forbids: the namespace enforces privileged."
                .to_string(),
            json!({
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {"name": o.namespace, "labels": {
                    "app.kubernetes.io/name": APP,
                    "pod-security.kubernetes.io/enforce": "privileged",
                }},
            }),
        ));
    }
    if o.mode.uses_api() {
        out.push((
            "LoadBalancer pools: `kubectl get lbpool` (docs/kubernetes.md).".to_string(),
            crd_value(LoadBalancerIPPool::crd())?,
        ));
    }
    if o.mode == Mode::Cluster {
        out.push((
            "Endpoint pools as objects, applied as cluster pools by the elected writer.".into(),
            crd_value(PodIPPool::crd())?,
        ));
    }
    if o.mode == Mode::MultiPool {
        out.push((
            "Endpoint pools as objects, handed out to the nodes by the elected writer.".into(),
            crd_value(PodIPPool::crd())?,
        ));
        out.push((
            "Each node's CIDRs (status, the writer's) and demand (spec, the node's).".into(),
            crd_value(crate::kubernetes::nodeipam::crd::NodeIPAM::crd())?,
        ));
    }
    if o.bgp.is_some() {
        out.push((
            "The routers nodes peer with over BGP: `kubectl get bgppeer` (docs/bgp.md).".into(),
            crd_value(crate::kubernetes::bgp_peers::BGPPeer::crd())?,
        ));
        out.push((
            "What each node's BGP speaker does: `kubectl get bgpstate` (docs/bgp.md).".into(),
            crd_value(crate::kubernetes::bgp_status::BGPNodeState::crd())?,
        ));
    }
    if o.mode.uses_api() {
        out.extend(service_account(o));
        out.extend(super::admission::objects(o));
    }
    let checksum = sha256_hex(config.as_bytes());
    out.push((
        "The agent's config. Its checksum is in the DaemonSet's pod template, so\n\
         applying a changed config rolls the pods one node at a time."
            .into(),
        json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": meta("lockstep-config", o),
            "data": {"config.toml": config},
        }),
    ));
    out.push((daemonset_comment(o), daemonset(o, &checksum)));
    if let Some(b) = &o.bgp {
        out.push((
            super::bgp::BgpInstall::comment(),
            b.daemonset(
                &o.namespace,
                &o.image,
                &sha256_hex(b.config_section().as_bytes()),
            ),
        ));
    }
    if !o.metrics_addr.ip().is_loopback() {
        out.push((
            "The agents' metrics and probes (docs/metrics.md), for Prometheus' pod or\n\
             endpoints discovery; headless, each endpoint is one node's agent."
                .into(),
            json!({
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {
                    "name": "lockstep-metrics",
                    "namespace": o.namespace,
                    "labels": labels(o.mode),
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": o.metrics_addr.port().to_string(),
                    },
                },
                "spec": {
                    "clusterIP": "None",
                    "selector": {"app.kubernetes.io/name": APP},
                    "ports": [{"name": "metrics", "port": o.metrics_addr.port(), "targetPort": "metrics", "protocol": "TCP"}],
                },
            }),
        ));
    }
    if o.service_monitor {
        out.push((
            "prometheus-operator: scrape every agent through the metrics Service.".into(),
            json!({
                "apiVersion": "monitoring.coreos.com/v1",
                "kind": "ServiceMonitor",
                "metadata": meta("lockstep", o),
                "spec": {
                    "selector": {"matchLabels": {"app.kubernetes.io/name": APP}},
                    "namespaceSelector": {"matchNames": [o.namespace]},
                    "endpoints": [{"port": "metrics", "path": "/metrics", "interval": "30s"}],
                },
            }),
        ));
    }
    Ok(out)
}

/// The cleanup of `lockstep uninstall`'s section in docs/kubernetes.md:
/// the ConfigMap (the agent's paths) and a DaemonSet `lockstep-cleanup`
/// whose pod runs `lockstep uninstall --wait` on every node, then stays
/// until deleted (so `kubectl rollout status` tells when every node is
/// clean). Applied after the agent's DaemonSet is deleted: on a node whose
/// agent still answers, the uninstall refuses and the pod retries.
pub fn cleanup(o: &Options, config: &str) -> Vec<(String, Value)> {
    let mut ds = daemonset(o, &sha256_hex(config.as_bytes()));
    ds["metadata"]["name"] = json!("lockstep-cleanup");
    ds["metadata"]["labels"]["app.kubernetes.io/component"] = json!("cleanup");
    let selector = json!({"app.kubernetes.io/name": APP, "app.kubernetes.io/component": "cleanup"});
    ds["spec"]["selector"]["matchLabels"] = selector.clone();
    ds["spec"]["template"]["metadata"]["labels"] = selector;
    let pod = &mut ds["spec"]["template"]["spec"];
    pod["automountServiceAccountToken"] = json!(false);
    if let Some(obj) = pod.as_object_mut() {
        obj.remove("serviceAccountName");
    }
    let container = &mut pod["containers"][0];
    container["name"] = json!("cleanup");
    container["args"] = json!([
        "uninstall",
        "--config",
        "/etc/lockstep/config.toml",
        "--wait"
    ]);
    if let Some(obj) = container.as_object_mut() {
        for p in ["startupProbe", "livenessProbe", "readinessProbe", "ports"] {
            obj.remove(p);
        }
    }
    vec![
        (
            "The agent's config, for the paths the cleanup removes.".to_string(),
            json!({
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": meta("lockstep-config", o),
                "data": {"config.toml": config},
            }),
        ),
        (
            "Removes what lockstep left on every node (`lockstep uninstall`), then waits\n\
             to be deleted. Apply after deleting the agent's DaemonSet; delete once\n\
             `kubectl rollout status` says every node's pod is running."
                .to_string(),
            ds,
        ),
    ]
}

/// The pool objects `--lb-pool` and `--pool` (cluster) ask for, named
/// `default`; applied after the install, once its CRDs are established.
pub fn pools(o: &Options) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    if !o.lb_pools.is_empty() {
        out.push((
            "LoadBalancer addresses for Services of the served class.".to_string(),
            json!({
                "apiVersion": "lockstep.io/v1alpha1",
                "kind": "LoadBalancerIPPool",
                "metadata": {"name": "default", "labels": {"app.kubernetes.io/name": APP}},
                "spec": {
                    "cidrs": o.lb_pools.iter().map(ToString::to_string).collect::<Vec<_>>(),
                    "announce": "l2",
                },
            }),
        ));
    }
    if o.mode.pod_ip_pools() && !o.pools.is_empty() {
        let (v4, v6): (Vec<&ipnet::IpNet>, Vec<&ipnet::IpNet>) = o
            .pools
            .iter()
            .partition(|c| matches!(c, ipnet::IpNet::V4(_)));
        out.push((
            if o.mode == Mode::Cluster {
                "The pods' pool; nodes claim blocks of it (docs/cluster.md).".to_string()
            } else {
                "The pods' pool; the elected writer offers nodes blocks of it (docs/kubernetes.md)."
                    .to_string()
            },
            json!({
                "apiVersion": "lockstep.io/v1alpha1",
                "kind": "PodIPPool",
                "metadata": {"name": super::POD_POOL, "labels": {"app.kubernetes.io/name": APP}},
                "spec": {
                    "ipv4": v4.iter().map(ToString::to_string).collect::<Vec<_>>(),
                    "ipv6": v6.iter().map(ToString::to_string).collect::<Vec<_>>(),
                    "skipMasquerade": true,
                },
            }),
        ));
    }
    out
}

fn crd_value<T: serde::Serialize>(crd: T) -> Result<Value, ManifestsError> {
    serde_json::to_value(crd).map_err(|e| ManifestsError::Yaml {
        kind: "CustomResourceDefinition".into(),
        message: e.to_string(),
    })
}

/// `rules` as a Role's rules, and the comment saying why each is there.
fn rules_and_why(rules: &[rbac::Rule]) -> (Vec<Value>, String) {
    let values = rules
        .iter()
        .map(|r| json!({"apiGroups": [r.group], "resources": r.resources, "verbs": r.verbs}))
        .collect();
    let why = rules
        .iter()
        .map(|r| {
            format!(
                "- {}: {} — {}",
                r.resources.join(", "),
                r.verbs.join(", "),
                r.why
            )
        })
        .collect::<Vec<_>>()
        .join("\n");
    (values, why)
}

fn service_account(o: &Options) -> Vec<(String, Value)> {
    let mut all = rbac::rules(o.mode);
    if o.bgp.is_some() {
        all.extend(rbac::bgp_rules(o.mode));
    }
    let (rules, why) = rules_and_why(&all);
    let namespaced = rbac::namespaced_rules(o.mode);
    let mut out = vec![
        (
            "The agent's identity in the API.".into(),
            json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta("lockstep", o)}),
        ),
        (
            format!("The least verbs this mode's agent sends, each rule with why:\n{why}"),
            json!({
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRole",
                "metadata": {"name": "lockstep", "labels": labels(o.mode)},
                "rules": rules,
            }),
        ),
        (
            String::new(),
            json!({
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": "lockstep", "labels": labels(o.mode)},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "lockstep"},
                "subjects": [{"kind": "ServiceAccount", "name": "lockstep", "namespace": o.namespace}],
            }),
        ),
    ];
    if !namespaced.is_empty() {
        let (rules, why) = rules_and_why(&namespaced);
        out.push((
            format!("In the agent's namespace only:\n{why}"),
            json!({
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "Role",
                "metadata": meta("lockstep", o),
                "rules": rules,
            }),
        ));
        out.push((
            String::new(),
            json!({
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": meta("lockstep", o),
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "lockstep"},
                "subjects": [{"kind": "ServiceAccount", "name": "lockstep", "namespace": o.namespace}],
            }),
        ));
    }
    out
}

fn daemonset_comment(o: &Options) -> String {
    let caps = CAPABILITIES
        .iter()
        .map(|(c, why)| format!("- {c}: {why}"))
        .collect::<Vec<_>>()
        .join("\n");
    let pods = if o.mode.serves_pods() {
        "\nThe CNI plugin runs on the node, not in this pod: the agent installs it and\n\
         its conflist into the node's CNI directories and serves it on the socket\n\
         under /run/lockstep, mounted at the same path on both sides."
    } else {
        "\nMode lb installs no CNI config: the node's pods keep their own CNI."
    };
    format!(
        "The agent, one per node, in the node's network namespace (hostNetwork).\n\
         Not privileged: every capability is dropped and only these are added:\n{caps}\n\
         The root filesystem is read-only (the image is static binaries); what the agent\n\
         writes lives in the hostPath volumes: its store (/var/lib/lockstep), its\n\
         socket (/run/lockstep) and pins (/sys/fs/bpf).{pods}\n\
         Removal from a node: `lockstep uninstall` (docs/kubernetes.md, \"Uninstall\")."
    )
}

fn daemonset(o: &Options, checksum: &str) -> Value {
    let port = o.metrics_addr.port();
    let mut mounts = vec![
        json!({"name": "config", "mountPath": "/etc/lockstep", "readOnly": true}),
        json!({"name": "state", "mountPath": "/var/lib/lockstep"}),
        json!({"name": "run", "mountPath": "/run/lockstep"}),
        json!({"name": "bpffs", "mountPath": "/sys/fs/bpf", "mountPropagation": "HostToContainer"}),
    ];
    let host = |name: &str, path: &str, kind: &str| json!({"name": name, "hostPath": {"path": path, "type": kind}});
    let mut volumes = vec![
        json!({"name": "config", "configMap": {"name": "lockstep-config"}}),
        host("state", "/var/lib/lockstep", "DirectoryOrCreate"),
        host("run", "/run/lockstep", "DirectoryOrCreate"),
        host("bpffs", "/sys/fs/bpf", "Directory"),
    ];
    if o.mode.serves_pods() {
        mounts.push(json!({"name": "cni-bin", "mountPath": "/opt/cni/bin"}));
        mounts.push(json!({"name": "cni-conf", "mountPath": "/etc/cni/net.d"}));
        mounts.push(json!({"name": "netns", "mountPath": "/run/netns", "mountPropagation": "HostToContainer"}));
        volumes.push(host("cni-bin", "/opt/cni/bin", "DirectoryOrCreate"));
        volumes.push(host("cni-conf", "/etc/cni/net.d", "DirectoryOrCreate"));
        volumes.push(host("netns", "/run/netns", "DirectoryOrCreate"));
    }
    if let Some(secret) = &o.etcd_tls_secret {
        mounts.push(json!({"name": "etcd-tls", "mountPath": ETCD_TLS_DIR, "readOnly": true}));
        volumes.push(json!({"name": "etcd-tls", "secret": {
            "secretName": secret,
            "defaultMode": 0o400,
            "items": [
                {"key": "ca.crt", "path": "ca.crt"},
                {"key": "tls.crt", "path": "tls.crt"},
                {"key": "tls.key", "path": "tls.key"},
            ],
        }}));
    }
    let probe = |path: &str, period: u32| json!({"httpGet": {"path": path, "port": "metrics"}, "periodSeconds": period, "timeoutSeconds": 5});
    let mut startup = probe("/healthz", 2);
    startup["failureThreshold"] = json!(30);
    let mut liveness = probe("/healthz", 10);
    liveness["failureThreshold"] = json!(3);
    let mut container = json!({
        "name": "agent",
        "image": o.image,
        "imagePullPolicy": "IfNotPresent",
        "args": ["agent", "--config", "/etc/lockstep/config.toml", "--log-json"],
        // The name the API server knows this node by: the agent's Node,
        // its pods' field selector, its claims (a host name may differ).
        "env": [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
        "securityContext": {
            "privileged": false,
            "allowPrivilegeEscalation": false,
            "readOnlyRootFilesystem": true,
            "runAsUser": 0,
            "capabilities": {
                "drop": ["ALL"],
                "add": CAPABILITIES.iter().map(|(c, _)| *c).collect::<Vec<_>>(),
            },
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "512Mi"}},
        "ports": [{"name": "metrics", "containerPort": port, "protocol": "TCP"}],
        "startupProbe": startup,
        "livenessProbe": liveness,
        "readinessProbe": probe("/readyz", 5),
        "volumeMounts": mounts,
    });
    if o.metrics_addr.ip().is_loopback() {
        // Probes reach the pod's IP, the node's with hostNetwork: a
        // loopback listener cannot answer them.
        let obj = container.as_object_mut().expect("an object");
        for p in ["startupProbe", "livenessProbe", "readinessProbe", "ports"] {
            obj.remove(p);
        }
    }
    let mut pod = json!({
        "hostNetwork": true,
        "dnsPolicy": "ClusterFirstWithHostNet",
        "priorityClassName": "system-node-critical",
        "tolerations": [{"operator": "Exists"}],
        "terminationGracePeriodSeconds": 30,
        "containers": [container],
        "volumes": volumes,
    });
    if o.mode.uses_api() {
        pod["serviceAccountName"] = json!("lockstep");
        pod["automountServiceAccountToken"] = json!(true);
    } else {
        pod["automountServiceAccountToken"] = json!(false);
    }
    json!({
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": meta("lockstep", o),
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/name": APP}},
            // One node at a time; never two agents on one node (the store
            // is locked), so no surge.
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}},
            "template": {
                "metadata": {
                    "labels": labels(o.mode),
                    "annotations": {"lockstep.io/config-sha256": checksum},
                },
                "spec": pod,
            },
        },
    })
}

/// The SHA-256 of `bytes`, in lower-case hex.
fn sha256_hex(bytes: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, bytes)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
