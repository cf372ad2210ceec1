//! `lockstep manifests`: everything one `kubectl apply` needs to run lockstep
//! on a cluster, rendered for a chosen mode from flags.
//!
//! Why a generator in the shipped binary rather than YAML files to edit: the
//! config the DaemonSet carries is checked by the same parser the agent runs
//! (a manifest the agent would refuse is never rendered), the ConfigMap's
//! checksum lands in the pod template (a config change rolls the pods), and
//! the RBAC rules, capabilities and volumes follow the mode instead of being
//! the union of every mode. No Helm binary can be installed where lockstep
//! is built and tested, so a chart could not be rendered or tested; this is
//! the generator kube-vip and cilium-cli users know.
//!
//! The modes:
//! - [`Mode::Lb`]: LoadBalancer IPAM only. No CNI config is installed and
//!   no endpoint pool exists; the node's pod network is another CNI's.
//! - [`Mode::Local`]: pod IPAM from pools named in the ConfigMap, the same
//!   on every node it runs on (one node, or one DaemonSet per node group).
//! - [`Mode::PodCidr`]: pod IPAM from each Node's `spec.podCIDRs`, with only
//!   the API server (`[kubernetes] pod_cidr_pool`), and LoadBalancer IPAM.
//! - [`Mode::Cluster`]: pod IPAM from cluster pools in etcd (blocks per
//!   node), LoadBalancer IPAM through etcd's elected assigner.
//! - [`Mode::MultiPool`]: pod IPAM from PodIPPool objects with only the API
//!   server: the elected writer is the NodeIPAM operator, each node's
//!   CIDRs are in its NodeIPAM object; and LoadBalancer IPAM.
//!
//! The objects themselves are in `objects`; the ClusterRole's rules per
//! mode in `rbac`.

pub mod admission;
pub mod bgp;
mod objects;
mod rbac;

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::Path;

use ipnet::IpNet;
use serde_json::Value;

use crate::config::{Config, ConfigError};

pub use rbac::{Rule, namespaced_rules, rules};

/// Errors of rendering.
#[derive(Debug, thiserror::Error)]
pub enum ManifestsError {
    /// A flag is missing or does not fit the mode.
    #[error("{flag}: {reason}")]
    Flag {
        /// The flag, as the user types it.
        flag: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// The agent would refuse the config the flags make.
    #[error("the rendered config is one the agent refuses")]
    Config(#[source] ConfigError),
    /// An object did not serialise as YAML (never with these objects).
    #[error("cannot write {kind} as YAML: {message}")]
    Yaml {
        /// The object's kind.
        kind: String,
        /// The serialiser's message.
        message: String,
    },
}

/// What the install is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// LoadBalancer IPAM only: no CNI config, no endpoint pools.
    Lb,
    /// Pod IPAM from pools in the ConfigMap (`--pool`), the same on every
    /// node the DaemonSet runs on.
    Local,
    /// Pod IPAM from each Node's `spec.podCIDRs` (no etcd), and
    /// LoadBalancer IPAM.
    PodCidr,
    /// Pod IPAM from cluster pools in etcd, LoadBalancer IPAM through
    /// etcd's elected assigner.
    Cluster,
    /// Pod IPAM from PodIPPool objects through each node's NodeIPAM object,
    /// filled by the elected writer (no etcd), and LoadBalancer IPAM.
    MultiPool,
}

impl Mode {
    /// The name a user types, and the label value of the objects.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Lb => "lb",
            Mode::Local => "local",
            Mode::PodCidr => "pod-cidr",
            Mode::Cluster => "cluster",
            Mode::MultiPool => "multi-pool",
        }
    }

    /// Whether the agent serves pods (installs its CNI config).
    pub fn serves_pods(self) -> bool {
        !matches!(self, Mode::Lb)
    }

    /// Whether the agent talks to the Kubernetes API.
    pub fn uses_api(self) -> bool {
        !matches!(self, Mode::Local)
    }

    /// Whether the agents elect their writer on a Lease (no etcd).
    pub fn elects_on_a_lease(self) -> bool {
        matches!(self, Mode::Lb | Mode::PodCidr | Mode::MultiPool)
    }

    /// Whether PodIPPool objects are the pods' pools.
    pub fn pod_ip_pools(self) -> bool {
        matches!(self, Mode::Cluster | Mode::MultiPool)
    }
}

/// The endpoint pool's name in modes whose pods' pool is an object
/// (`cluster`, `multi-pool`): the PodIPPool `--pool` renders.
pub const POD_POOL: &str = "default";

/// What the flags chose.
#[derive(Clone, Debug)]
pub struct Options {
    /// The mode.
    pub mode: Mode,
    /// The namespace of the DaemonSet, ConfigMap, ServiceAccount and
    /// metrics Service; one other than `kube-system` is rendered too.
    pub namespace: String,
    /// The agent's image.
    pub image: String,
    /// The node's uplink interface (LoadBalancer addresses are answered
    /// there; masquerade and routes use it).
    pub uplink: String,
    /// Where the metrics and probe listener binds (host network).
    pub metrics_addr: SocketAddr,
    /// Endpoint pool CIDRs (`local`: the pool in the ConfigMap; `cluster`
    /// and `multi-pool`: a PodIPPool object named `default`).
    pub pools: Vec<IpNet>,
    /// LoadBalancer pool CIDRs: a LoadBalancerIPPool object named
    /// `default`.
    pub lb_pools: Vec<IpNet>,
    /// Destinations pods reach without masquerade (the cluster's Service
    /// and pod CIDRs, say).
    pub non_masquerade: Vec<IpNet>,
    /// etcd endpoints (`cluster`).
    pub etcd: Vec<String>,
    /// The Secret holding the etcd client's `ca.crt`, `tls.crt` and
    /// `tls.key`; none: plain connections.
    pub etcd_tls_secret: Option<String>,
    /// The `loadBalancerClass` served.
    pub lb_class: String,
    /// Services without a class are served too.
    pub serve_classless: bool,
    /// The conflist's file name (it must sort before the node's other CNI
    /// configs for pods to use lockstep).
    pub conflist_name: String,
    /// Render a ServiceMonitor (prometheus-operator) for the metrics.
    pub service_monitor: bool,
    /// BGP (`--bgp-asn`): the agent's `[bgp]` and the `lockstep-bgp`
    /// DaemonSet.
    pub bgp: Option<bgp::BgpInstall>,
}

/// The version whose image `--image` names by default.
pub fn default_image() -> String {
    format!("localhost/lockstep:{}", crate::version::version())
}

impl Options {
    /// Checks what the flags leave to the mode.
    fn check(&self) -> Result<(), ManifestsError> {
        let flag = |flag, reason: &str| {
            Err(ManifestsError::Flag {
                flag,
                reason: reason.into(),
            })
        };
        match self.mode {
            Mode::Lb if !self.pools.is_empty() => {
                return flag("--pool", "mode lb serves no pods; use --lb-pool");
            }
            Mode::PodCidr if !self.pools.is_empty() => {
                return flag(
                    "--pool",
                    "mode pod-cidr takes each node's pool from its Node's spec.podCIDRs",
                );
            }
            Mode::Local if self.pools.is_empty() => {
                return flag("--pool", "mode local needs the pods' CIDRs");
            }
            Mode::Cluster if self.etcd.is_empty() => {
                return flag("--etcd", "mode cluster needs the etcd endpoints");
            }
            Mode::Local if !self.lb_pools.is_empty() => {
                return flag(
                    "--lb-pool",
                    "mode local does not talk to the Kubernetes API, so it serves no Services",
                );
            }
            _ => {}
        }
        if self.mode != Mode::Cluster && !self.etcd.is_empty() {
            return flag("--etcd", "only mode cluster uses etcd");
        }
        if self.mode != Mode::Cluster && self.etcd_tls_secret.is_some() {
            return flag("--etcd-tls-secret", "only mode cluster uses etcd");
        }
        if self.service_monitor && self.metrics_addr.ip().is_loopback() {
            return flag(
                "--metrics-addr",
                "a loopback address cannot be scraped by Prometheus",
            );
        }
        if let Some(b) = &self.bgp {
            if b.pools.is_empty() {
                return flag(
                    "--bgp-pool",
                    "--bgp-asn needs the pools to announce (LoadBalancerIPPools, pod pools)",
                );
            }
            if b.bird_image.is_empty() || b.bird_image.contains(char::is_whitespace) {
                return flag(
                    "--bird-image",
                    "--bgp-asn needs the image BIRD runs from (one with bird 2 and sh)",
                );
            }
        }
        if !is_dns_label(&self.namespace) {
            return flag(
                "--namespace",
                "must be a DNS label (lower-case letters, digits, '-', at most 63)",
            );
        }
        if self.image.is_empty() || self.image.contains(char::is_whitespace) {
            return flag("--image", "must be an image reference");
        }
        Ok(())
    }

    /// The agent's config file as the ConfigMap carries it.
    pub fn config_toml(&self) -> String {
        let mut t = String::new();
        let q = |s: &str| format!("{s:?}");
        let list = |v: &[IpNet]| {
            v.iter()
                .map(|c| q(&c.to_string()))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let _ = writeln!(
            t,
            "# Rendered by `lockstep manifests --mode {}`; every key: docs/configuration.md.",
            self.mode.name()
        );
        t.push_str("state_dir = \"/var/lib/lockstep\"\nsocket = \"/run/lockstep/lockstep.sock\"\n");
        let _ = writeln!(t, "metrics_addr = {}", q(&self.metrics_addr.to_string()));
        t.push_str("reconcile_interval = \"10s\"\n");
        if self.mode != Mode::Local {
            t.push_str("# Endpoint pools come from ");
            t.push_str(match self.mode {
                Mode::Lb => "nowhere: this node serves no pods.\n",
                Mode::PodCidr => "the Node's spec.podCIDRs ([kubernetes] pod_cidr_pool).\n",
                Mode::MultiPool => "this Node's NodeIPAM object ([kubernetes.nodeipam]).\n",
                _ => "etcd (cluster pools).\n",
            });
            t.push_str("pools = []\n");
        }
        if !self.non_masquerade.is_empty() {
            let _ = writeln!(t, "non_masquerade_cidrs = [{}]", list(&self.non_masquerade));
        }
        let _ = write!(
            t,
            "\n[datapath]\npin_root = \"/sys/fs/bpf/lockstep\"\nuplink = {}\nendpoint_attach_mode = \"netlink\"\n",
            q(&self.uplink)
        );
        let _ = write!(
            t,
            "\n[cni]\ninstall = {}\nbin_dir = \"/opt/cni/bin\"\nconf_dir = \"/etc/cni/net.d\"\nconflist_name = {}\nnetwork_name = \"lockstep\"\ncni_version = \"1.0.0\"\n",
            self.mode.serves_pods(),
            q(&self.conflist_name)
        );
        if self.mode == Mode::Local {
            let (v4, v6): (Vec<IpNet>, Vec<IpNet>) =
                self.pools.iter().partition(|c| matches!(c, IpNet::V4(_)));
            let _ = write!(
                t,
                "\n[[pools]]\nname = \"pods\"\nipv4 = [{}]\nipv6 = [{}]\nskip_masquerade = true\n",
                list(&v4),
                list(&v6)
            );
        }
        if self.mode == Mode::Cluster {
            let etcd = self
                .etcd
                .iter()
                .map(|e| q(e))
                .collect::<Vec<_>>()
                .join(", ");
            let _ = write!(t, "\n[cluster]\netcd = [{etcd}]\n");
            if let Some(secret) = &self.etcd_tls_secret {
                let _ = write!(
                    t,
                    "[cluster.tls]                              # from Secret {secret}\nca = \"{d}/ca.crt\"\ncert = \"{d}/tls.crt\"\nkey = \"{d}/tls.key\"\n",
                    d = objects::ETCD_TLS_DIR
                );
            }
        }
        if self.mode.uses_api() {
            let _ = write!(
                t,
                "\n[kubernetes]                               # the pod's service account\nlb_class = {}\nserve_classless = {}                     # {}\n",
                q(&self.lb_class),
                self.serve_classless,
                if self.serve_classless {
                    "Services without a class too"
                } else {
                    "only Services of lb_class"
                }
            );
            if self.mode == Mode::PodCidr {
                t.push_str(
                    "pod_cidr_pool = \"pods\"                      # the Node's spec.podCIDRs\n",
                );
            }
            if self.mode == Mode::Cluster && !self.pools.is_empty() {
                t.push_str("pod_pools = true                           # PodIPPool objects\n");
            }
            if self.mode.elects_on_a_lease() {
                let _ = write!(
                    t,
                    "\n[kubernetes.election]                      # one LB writer, on a Lease\nnamespace = {}\n",
                    q(&self.namespace)
                );
            }
            if self.mode == Mode::MultiPool {
                let _ = write!(
                    t,
                    "\n[kubernetes.nodeipam]                      # CIDRs from PodIPPool objects\n\
                     operator = true                            # the LB writer offers them\n\
                     [[kubernetes.nodeipam.pools]]\nname = {}\nskip_masquerade = true\npre_allocate = 8\n",
                    q(POD_POOL)
                );
            }
        }
        if let Some(b) = &self.bgp {
            t.push_str(&b.config_section());
        }
        t
    }
}

/// Whether `s` is an RFC 1123 label, as a namespace's name must be.
fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// Renders every object of the install as one multi-document YAML stream,
/// in the order `kubectl apply` needs them (namespace and CRDs first).
///
/// # Errors
/// A flag that does not fit the mode, or a config the agent would refuse
/// (each named).
pub fn render(options: &Options) -> Result<String, ManifestsError> {
    options.check()?;
    let config = options.config_toml();
    Config::parse(Path::new("config.toml"), &config).map_err(ManifestsError::Config)?;
    let header = format!(
        "# lockstep {version}, mode {mode}: rendered by `lockstep manifests`; apply with\n\
         # `kubectl apply -f` (docs/kubernetes.md). Do not edit: render again.\n",
        version = crate::version::version(),
        mode = options.mode.name()
    );
    write_docs(header, objects::all(options, &config)?)
}

/// Renders the cleanup DaemonSet that runs `lockstep uninstall` on every
/// node (with the ConfigMap it reads), for after the install is deleted.
///
/// # Errors
/// As [`render`].
pub fn render_cleanup(options: &Options) -> Result<String, ManifestsError> {
    options.check()?;
    let config = options.config_toml();
    Config::parse(Path::new("config.toml"), &config).map_err(ManifestsError::Config)?;
    let header = format!(
        "# lockstep {version} cleanup, mode {mode}: apply after deleting the install\n\
         # (docs/kubernetes.md, \"Uninstall\").\n",
        version = crate::version::version(),
        mode = options.mode.name()
    );
    write_docs(header, objects::cleanup(options, &config))
}

/// Renders the pool objects `--lb-pool` and (mode cluster) `--pool` ask
/// for, to apply once the install's CRDs are established.
///
/// # Errors
/// No pool flag, or one that does not fit the mode.
pub fn render_pools(options: &Options) -> Result<String, ManifestsError> {
    options.check()?;
    let pools = objects::pools(options);
    if pools.is_empty() {
        return Err(ManifestsError::Flag {
            flag: "--lb-pool",
            reason: match options.mode {
                Mode::Cluster | Mode::MultiPool => "--pools-only needs --lb-pool or --pool".into(),
                _ => "--pools-only needs --lb-pool".into(),
            },
        });
    }
    let header = format!(
        "# lockstep pools, mode {}: apply after the install (its CRDs established).\n",
        options.mode.name()
    );
    write_docs(header, pools)
}

/// `objects` as YAML documents, each headed by its comment.
fn write_docs(mut out: String, objects: Vec<(String, Value)>) -> Result<String, ManifestsError> {
    for (comment, object) in objects {
        let kind = object["kind"].as_str().unwrap_or("object").to_string();
        let yaml = serde_saphyr::to_string(&object).map_err(|e| ManifestsError::Yaml {
            kind,
            message: e.to_string(),
        })?;
        out.push_str("---\n");
        for line in comment.lines() {
            out.push_str(if line.is_empty() { "#" } else { "# " });
            out.push_str(line);
            out.push('\n');
        }
        out.push_str(&yaml);
        if !yaml.ends_with('\n') {
            out.push('\n');
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
