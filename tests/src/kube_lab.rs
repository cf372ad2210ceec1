//! The Kubernetes LoadBalancer lab (#28): the LB lab of `lb_lab` (three
//! node namespaces on a bridge, a neighbour, a real 3-member etcd, agents
//! in cluster mode) with the Kubernetes API double on the test's loopback,
//! forwarded into each node namespace, a Node object per node and
//! `[kubernetes]` in every agent's config. Shared by `kubernetes_e2e` and
//! the `lb` bench.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::Duration;

use anyhow::Context;
use serde_json::{Value, json};

use crate::cluster::{forward_ports, node_ip};
use crate::etcd::EtcdCluster;
use crate::kubeapi::ApiDouble;
use crate::lb_lab::Lab;

/// The lab's L2 pool, as a `LoadBalancerIPPool` spec.
pub fn pool_spec() -> Value {
    json!({"cidrs": ["10.251.0.128/25", "fd00:251::100/120"], "announce": "l2"})
}

/// Node `i`'s podCIDR: `10.244.<i>.0/24`.
pub fn pod_cidr(i: usize) -> String {
    format!("10.244.{i}.0/24")
}

/// What a lab asks of each node's config: node `i`'s text, given its
/// namespace.
type NodeConfig<'a> = dyn Fn(usize, &crate::Netns) -> anyhow::Result<String> + 'a;

/// The double, the lab, and the kubeconfig's directory.
pub struct KubeLab {
    /// The LB lab (agents stop first: declared first).
    pub lab: Lab,
    /// The API double.
    pub api: ApiDouble,
    _dir: crate::TempDir,
}

/// A `type: LoadBalancer` Service `ns/name` with one TCP port, labels and
/// annotations.
pub fn lb_service(ns: &str, name: &str, port: u16, labels: Value, annotations: Value) -> Value {
    json!({
        "metadata": {"namespace": ns, "name": name, "labels": labels, "annotations": annotations},
        "spec": {"type": "LoadBalancer", "ports": [{"port": port, "protocol": "TCP"}]},
    })
}

/// One endpoint of an EndpointSlice: (node index, ready, serving,
/// terminating).
pub type Ep = (usize, bool, bool, bool);

/// `eps` as an EndpointSlice's `endpoints`, each on `node-<i>`.
pub fn endpoints(eps: &[Ep]) -> Value {
    json!(
        eps.iter()
            .enumerate()
            .map(|(i, (node, ready, serving, terminating))| json!({
                "addresses": [format!("10.244.{node}.{}", 10 + i)],
                "nodeName": format!("node-{node}"),
                "conditions": {"ready": ready, "serving": serving, "terminating": terminating},
            }))
            .collect::<Vec<_>>()
    )
}

impl KubeLab {
    /// Creates LoadBalancer Service `ns/name` with `externalTrafficPolicy`
    /// `policy`; its address once assigned (30 s at most).
    ///
    /// # Errors
    /// The API refused it, or no address came.
    pub fn create_service(&self, ns: &str, name: &str, policy: &str) -> anyhow::Result<IpAddr> {
        let mut svc = lb_service(ns, name, 80, json!({}), json!({}));
        svc["spec"]["externalTrafficPolicy"] = json!(policy);
        self.api.create("services", ns, &svc)?;
        let ids = BTreeSet::from([format!("{ns}/{name}")]);
        let got = self.wait_assigned(&ids, 1, Duration::from_secs(30))?;
        got.values().flatten().next().copied().context("an address")
    }

    /// Sets Service `ns/svc`'s one EndpointSlice to `eps`, created the
    /// first time, as the EndpointSlice controller would.
    ///
    /// # Errors
    /// The API refused it.
    pub fn set_slice(&self, ns: &str, svc: &str, eps: &[Ep]) -> anyhow::Result<()> {
        let name = format!("{svc}-abcde");
        if self.api.get("endpointslices", ns, &name).is_ok() {
            self.api.patch(
                "endpointslices",
                ns,
                &name,
                &json!({"endpoints": endpoints(eps)}),
                false,
            )?;
        } else {
            self.api.create(
                "endpointslices",
                ns,
                &json!({
                    "metadata": {"namespace": ns, "name": name,
                                 "labels": {"kubernetes.io/service-name": svc}},
                    "addressType": "IPv4",
                    "endpoints": endpoints(eps),
                    "ports": [{"port": 8080, "protocol": "TCP"}],
                }),
            )?;
        }
        Ok(())
    }

    /// Three nodes whose Node objects carry `node_labels[i]` (and the
    /// node's underlay address as InternalIP); no labels in the configs.
    pub fn build(
        cluster: &EtcdCluster,
        prefix: &str,
        node_labels: [Value; 3],
    ) -> anyhow::Result<Self> {
        Self::build_with(cluster, prefix, node_labels, &|_| String::new())
    }

    /// As [`KubeLab::build`], node `i`'s config ending with `extra(i)`
    /// after its `[kubernetes]` section (e.g. `[kubernetes.pods]`).
    pub fn build_with(
        cluster: &EtcdCluster,
        prefix: &str,
        node_labels: [Value; 3],
        extra: &dyn Fn(usize) -> String,
    ) -> anyhow::Result<Self> {
        Self::build_keys(cluster, prefix, node_labels, "", extra)
    }

    /// Three nodes without `[cluster]` (no etcd): the agents elect their
    /// LB writer on a Lease (#44 item 1); node `i`'s `[kubernetes]`
    /// section ending with `extra(i)`.
    pub fn build_local(
        node_labels: [Value; 3],
        extra: &dyn Fn(usize) -> String,
    ) -> anyhow::Result<Self> {
        Self::with_api(node_labels, extra, &|config| Lab::build_local(config))
    }

    /// The double with the Nodes, a kubeconfig for it, and the lab `build`
    /// makes, each node's config ending with `[kubernetes]` (the double
    /// forwarded into its namespace) and `extra(i)`.
    fn with_api(
        node_labels: [Value; 3],
        extra: &dyn Fn(usize) -> String,
        build: &dyn Fn(&NodeConfig<'_>) -> anyhow::Result<Lab>,
    ) -> anyhow::Result<Self> {
        let api = ApiDouble::start()?;
        Self::nodes(&api, &node_labels)?;
        let dir = crate::TempDir::new("kube")?;
        let kubeconfig = dir.path().join("kubeconfig");
        api.write_kubeconfig(&kubeconfig)?;
        let port = api.addr().port();
        let path = kubeconfig.display().to_string();
        let lab = build(&|i, ns| {
            forward_ports(ns, &[port])?;
            Ok(format!(
                "[kubernetes]\nkubeconfig = \"{path}\"\n{}",
                extra(i)
            ))
        })?;
        Ok(Self {
            lab,
            api,
            _dir: dir,
        })
    }

    /// The Node objects `node-0`..`node-2` with `node_labels[i]`, the
    /// node's underlay address as InternalIP and [`pod_cidr`]`(i)` as
    /// podCIDR (as kube-controller-manager's `--allocate-node-cidrs`
    /// gives).
    fn nodes(api: &ApiDouble, node_labels: &[Value; 3]) -> anyhow::Result<()> {
        for (i, labels) in node_labels.iter().enumerate() {
            api.create(
                "nodes",
                "",
                &json!({
                    "metadata": {"name": format!("node-{i}"), "labels": labels},
                    "spec": {"podCIDR": pod_cidr(i), "podCIDRs": [pod_cidr(i)]},
                    "status": {"addresses": [{"type": "InternalIP", "address": node_ip(i)}]},
                }),
            )?;
            // Status is the kubelet's to write, through the subresource.
            api.patch(
                "nodes",
                "",
                &format!("node-{i}"),
                &json!({"status": {"addresses": [
                    {"type": "InternalIP", "address": node_ip(i)},
                    {"type": "Hostname", "address": format!("node-{i}")},
                ]}}),
                true,
            )?;
        }
        Ok(())
    }

    /// As [`KubeLab::build_with`], every node's `[cluster]` section ending
    /// with `cluster_keys` (e.g. a short `lease_ttl` and `reclaim_after`).
    pub fn build_keys(
        cluster: &EtcdCluster,
        prefix: &str,
        node_labels: [Value; 3],
        cluster_keys: &str,
        extra: &dyn Fn(usize) -> String,
    ) -> anyhow::Result<Self> {
        Self::with_api(node_labels, extra, &|config| {
            Lab::build_extra(
                cluster,
                prefix,
                None,
                ["", "", ""],
                [true; 3],
                cluster_keys,
                config,
            )
        })
    }

    /// Creates pool `name` with `spec`.
    pub fn pool(&self, name: &str, spec: Value) -> anyhow::Result<Value> {
        self.api.create(
            "loadbalancerippools",
            "",
            &json!({"metadata": {"name": name}, "spec": spec}),
        )
    }

    /// Every Service's `status.loadBalancer.ingress` addresses, by
    /// `namespace/name` (those without: empty).
    pub fn ingress(&self) -> BTreeMap<String, Vec<IpAddr>> {
        self.api
            .list("services")
            .iter()
            .map(|s| (id(s), ingress_of(s)))
            .collect()
    }

    /// Lockstep's condition on `ns/name`: (status, reason, message).
    pub fn condition(&self, ns: &str, name: &str) -> Option<(String, String, String)> {
        let s = self.api.get("services", ns, name).ok()?;
        condition_of(&s)
    }

    /// Waits until every Service of `ids` has `per` addresses in its
    /// status; returns them all.
    pub fn wait_assigned(
        &self,
        ids: &BTreeSet<String>,
        per: usize,
        within: Duration,
    ) -> anyhow::Result<BTreeMap<String, Vec<IpAddr>>> {
        crate::wait_for(
            &format!("{} services with addresses", ids.len()),
            within,
            || {
                let all = self.ingress();
                ids.iter()
                    .all(|id| all.get(id).is_some_and(|a| a.len() == per))
                    .then(|| all.into_iter().filter(|(id, _)| ids.contains(id)).collect())
            },
        )
        .with_context(|| format!("statuses: {:?}", self.ingress()))
    }

    /// For each Service of `created` (`namespace/name` → when it was
    /// created), the time from its creation to the first stored write of
    /// its status with an address, as the double recorded them; sorted.
    ///
    /// # Errors
    /// A Service whose status was never written with an address.
    pub fn status_latencies(
        &self,
        created: &BTreeMap<String, std::time::Instant>,
    ) -> anyhow::Result<Vec<Duration>> {
        let mut written: BTreeMap<String, std::time::Instant> = BTreeMap::new();
        for (at, c) in self.api.changes() {
            if c.key.plural != "services" {
                continue;
            }
            let id = format!("{}/{}", c.key.namespace, c.key.name);
            if created.contains_key(&id) && !ingress_of(&c.object).is_empty() {
                written.entry(id).or_insert(at);
            }
        }
        let mut lat: Vec<Duration> = created
            .iter()
            .map(|(id, t0)| {
                written
                    .get(id)
                    .map(|t| t.saturating_duration_since(*t0))
                    .with_context(|| format!("{id}: no status with an address"))
            })
            .collect::<anyhow::Result<_>>()?;
        lat.sort();
        Ok(lat)
    }

    /// Events about `ns/name` with `reason`.
    pub fn events(&self, ns: &str, name: &str, reason: &str) -> Vec<Value> {
        self.api
            .list("events")
            .into_iter()
            .filter(|e| {
                e["regarding"]["namespace"] == ns
                    && e["regarding"]["name"] == name
                    && e["reason"] == reason
            })
            .collect()
    }
}

/// `namespace/name` of an object.
pub fn id(v: &Value) -> String {
    format!(
        "{}/{}",
        v["metadata"]["namespace"].as_str().unwrap_or(""),
        v["metadata"]["name"].as_str().unwrap_or("")
    )
}

/// A Service's ingress addresses.
pub fn ingress_of(s: &Value) -> Vec<IpAddr> {
    s["status"]["loadBalancer"]["ingress"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|i| i["ip"].as_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Lockstep's condition on a Service: (status, reason, message).
pub fn condition_of(s: &Value) -> Option<(String, String, String)> {
    s["status"]["conditions"].as_array()?.iter().find_map(|c| {
        (c["type"] == "lockstep.io/AddressAssigned").then(|| {
            (
                c["status"].as_str().unwrap_or("").to_string(),
                c["reason"].as_str().unwrap_or("").to_string(),
                c["message"].as_str().unwrap_or("").to_string(),
            )
        })
    })
}

impl KubeLab {
    /// The requests the agents sent that `deploy/rbac.yaml`'s ClusterRole
    /// does not allow ([`outside_rbac`]).
    ///
    /// # Errors
    /// The manifest cannot be read.
    pub fn outside_rbac(&self) -> anyhow::Result<Vec<String>> {
        outside_rbac(&self.api)
    }

    /// The node (`node-<i>`) the Lease `name` in `kube-system` names, if
    /// any.
    pub fn lease_holder(&self, name: &str) -> Option<usize> {
        let l = self.api.get("leases", "kube-system", name).ok()?;
        l["spec"]["holderIdentity"]
            .as_str()
            .and_then(|h| h.strip_prefix("node-"))
            .and_then(|i| i.parse().ok())
    }

    /// The nodes that answered `addr` in one ARP/NDP probe.
    ///
    /// # Errors
    /// The probe could not run.
    pub fn answering(&self, addr: IpAddr) -> anyhow::Result<BTreeSet<usize>> {
        let answers = crate::lb_lab::probe_once(&self.lab, &[addr], Duration::from_millis(800))?;
        Ok(answers
            .get(&addr)
            .into_iter()
            .flatten()
            .filter_map(|m| self.lab.macs.iter().position(|x| x == m))
            .collect())
    }

    /// Waits (10 s at most) until `addr` is answered by exactly `nodes`.
    ///
    /// # Errors
    /// It was not, naming who answered last.
    pub fn wait_answering(&self, addr: IpAddr, nodes: &[usize]) -> anyhow::Result<()> {
        let want: BTreeSet<usize> = nodes.iter().copied().collect();
        let mut last = BTreeSet::new();
        crate::wait_for(
            &format!("{addr} answered by nodes {want:?}"),
            Duration::from_secs(10),
            || {
                last = self.answering(addr).ok()?;
                (last == want).then_some(())
            },
        )
        .with_context(|| format!("last answered by {last:?}"))
    }

    /// Ends `cap` (probes of `addr`, started before its answers moved away
    /// from node `from`) and checks the move: no probe round answered by
    /// two nodes, every handover to node `to`, announced (a gratuitous ARP
    /// or unsolicited NA) when `announced`. Prints the handovers as `what`.
    ///
    /// # Errors
    /// The capture failed, or the move was not clean (named).
    pub fn ensure_moved(
        &self,
        cap: crate::lb_lab::Capture,
        addr: IpAddr,
        (from, to): (usize, usize),
        announced: bool,
        what: &str,
    ) -> anyhow::Result<()> {
        let (seen, rounds) = cap.finish()?;
        let (overlaps, handovers, problems) =
            crate::lb_lab::judge(&self.lab, &seen, &rounds, &[addr], self.lab.macs[from]);
        eprintln!("{what}: {handovers:?}");
        anyhow::ensure!(overlaps == 0, "answered by two nodes: {problems:?}");
        anyhow::ensure!(
            handovers
                .iter()
                .all(|h| h.to == format!("node-{to}") && (h.announced || !announced)),
            "moved to node-{to}{}: {handovers:?}",
            if announced { ", announced" } else { "" }
        );
        Ok(())
    }

    /// Waits (at most `within`) until the API double has exactly one open
    /// watch of all Services, all LoadBalancerIPPools and all Nodes: in
    /// cluster mode only the elected writer keeps them (#47 item 4), not
    /// every agent. Returns how long it took.
    ///
    /// # Errors
    /// Other counts at the deadline, named.
    pub fn wait_writer_only_watches(&self, within: Duration) -> anyhow::Result<Duration> {
        let t = std::time::Instant::now();
        let kinds = ["services", "loadbalancerippools", "nodes"];
        loop {
            let counts: Vec<(&str, usize)> = kinds
                .iter()
                .map(|k| (*k, self.api.open_watches_of_all(k)))
                .collect();
            if counts.iter().all(|(_, n)| *n == 1) {
                return Ok(t.elapsed());
            }
            anyhow::ensure!(
                t.elapsed() < within,
                "open watches of every object of a kind, after {within:?}: {counts:?} (want 1 each: the writer's)"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Fails naming every request [`outside_rbac`] finds.
    ///
    /// # Errors
    /// Some request was outside `deploy/rbac.yaml` or not lockstep's.
    pub fn ensure_requests_allowed(&self) -> anyhow::Result<()> {
        let outside = self.outside_rbac()?;
        anyhow::ensure!(
            outside.is_empty(),
            "requests outside deploy/rbac.yaml: {outside:?}"
        );
        Ok(())
    }
}

/// The requests sent to `api` that `deploy/rbac.yaml`'s ClusterRole does
/// not allow, as `verb group/resource path` (the double serves only the
/// agents over HTTP: tests write through its store); and every write not
/// recorded under lockstep's field manager (#44 item 7), as `verb
/// group/resource path: field manager <name>`.
///
/// # Errors
/// The manifest cannot be read.
pub fn outside_rbac(api: &ApiDouble) -> anyhow::Result<Vec<String>> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/rbac.yaml");
    let text = std::fs::read_to_string(&path)?;
    let docs: Vec<Value> =
        serde_saphyr::from_multiple(&text).map_err(|e| anyhow::anyhow!("{e}"))?;
    let role = docs
        .iter()
        .find(|d| d["kind"] == "ClusterRole")
        .context("no ClusterRole in deploy/rbac.yaml")?;
    let allowed = granted(role)?;
    // The Role: in its own namespace only.
    let (ns_allowed, role_ns) = match docs.iter().find(|d| d["kind"] == "Role") {
        Some(r) => (
            granted(r)?,
            r["metadata"]["namespace"].as_str().unwrap_or("").to_owned(),
        ),
        None => (BTreeSet::new(), String::new()),
    };
    let mut out = Vec::new();
    for r in api.requests() {
        let segs: Vec<&str> = r.path.trim_matches('/').split('/').collect();
        let (group, rest) = match segs.as_slice() {
            ["api", _, rest @ ..] => ("", rest),
            ["apis", g, _, rest @ ..] => (*g, rest),
            _ => ("?", &segs[..]),
        };
        let (ns, rest) = match rest {
            ["namespaces", ns, rest @ ..] => (*ns, rest),
            rest => ("", rest),
        };
        let (resource, named) = match rest {
            [p] => ((*p).to_string(), false),
            [p, _] => ((*p).to_string(), true),
            [p, _, sub] => (format!("{p}/{sub}"), true),
            _ => (r.path.clone(), false),
        };
        let verb = match (r.method.as_str(), named) {
            ("GET", true) => "get",
            ("GET", false) if r.query.contains("watch=true") => "watch",
            ("GET", false) => "list",
            ("POST", _) => "create",
            ("PUT", _) => "update",
            ("PATCH", _) => "patch",
            ("DELETE", _) => "delete",
            _ => "?",
        };
        let key = (group.to_string(), resource.clone(), verb.to_string());
        let by_role = ns == role_ns && ns_allowed.contains(&key);
        if !allowed.contains(&key) && !by_role {
            out.push(format!("{verb} {group}/{resource} {}", r.path));
        }
        if r.method != "GET" && r.field_manager.as_deref() != Some("lockstep") {
            out.push(format!(
                "{verb} {group}/{resource} {}: field manager {:?}",
                r.path, r.field_manager
            ));
        }
    }
    out.sort();
    out.dedup();
    Ok(out)
}

/// The (group, resource, verb) triples a Role or ClusterRole grants.
fn granted(role: &Value) -> anyhow::Result<BTreeSet<(String, String, String)>> {
    let mut allowed = BTreeSet::new();
    for rule in role["rules"].as_array().context("rules")? {
        for g in rule["apiGroups"].as_array().into_iter().flatten() {
            for r in rule["resources"].as_array().into_iter().flatten() {
                for v in rule["verbs"].as_array().into_iter().flatten() {
                    allowed.insert((
                        g.as_str().unwrap_or("").into(),
                        r.as_str().unwrap_or("").into(),
                        v.as_str().unwrap_or("").into(),
                    ));
                }
            }
        }
    }
    Ok(allowed)
}
