//! Agent configuration: a TOML file, validated before anything acts on it.
//!
//! Two phases, as in ripgrep: [`Config::parse`] turns text into a typed config
//! and checks it (pure: every error names the file and the field), then the
//! agent resolves it against the system. With no file at all the agent runs on
//! [`Config::default`]: one local pool and the default paths.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ipnet::IpNet;
use lockstep_core::pool::{PoolSpec, validate_specs};

/// The longest reconcile interval accepted.
pub const MAX_RECONCILE_INTERVAL: Duration = Duration::from_secs(24 * 3600);
/// The longest delegated-IPAM plugin timeout accepted.
pub const MAX_IPAM_TIMEOUT: Duration = Duration::from_secs(600);
use serde::{Deserialize, Serialize};

mod cluster;
pub use cluster::{ClusterConfig, ClusterTlsConfig};
mod election;
pub use election::ElectionConfig;
mod kubernetes;
pub use kubernetes::KubernetesConfig;
mod bgp;
mod lb;
mod nodeipam;
pub use bgp::{BgpConfig, BgpPeerConfig, BgpPoolConfig};
pub use lb::{LbConfig, MIN_ANNOUNCE_LEASE};
mod pods;
pub mod reference;
pub use nodeipam::{DemandKind, NodeIpamConfig, NodeIpamPoolConfig};
pub use pods::PodsConfig;

/// Default config file.
pub const DEFAULT_CONFIG: &str = "/etc/lockstep/config.toml";

/// Errors of loading a config.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The TOML is malformed, a field is unknown or has the wrong type. The
    /// message names the field and the line.
    #[error("config {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// toml's description (field, line and column).
        message: String,
    },
    /// A value is well-formed but not acceptable.
    #[error("config {path}: field `{field}`: {reason}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// Dotted path of the field.
        field: String,
        /// What is wrong.
        reason: String,
    },
}

/// How programs are attached (config spelling).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum AttachModeConfig {
    /// TCX, netlink where the kernel lacks TCX.
    #[default]
    Auto,
    /// TCX only.
    Tcx,
    /// Netlink only.
    Netlink,
}

/// `[datapath]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct DatapathConfig {
    /// Root of the pins on bpffs.
    pub pin_root: PathBuf,
    /// Replace pinned maps whose definition changed.
    pub migrate: bool,
    /// Take the pin root over when another store's agent owns it (its
    /// owner record names another store); see `docs/datapath.md`.
    pub take_over_pin_root: bool,
    /// How to attach programs to the uplink (TCX: pinned links).
    pub attach_mode: AttachModeConfig,
    /// How to attach `from_endpoint` to endpoint veths. Netlink (clsact) by
    /// default: each TCX attach and detach waits for an RCU grace period
    /// and they serialise, so under pod churn netlink attaches several
    /// times faster (`cargo xtask bench cni`). Netlink filters also outlive
    /// the agent and are replaced in place on upgrade.
    pub endpoint_attach_mode: AttachModeConfig,
    /// Capacity of each IPCACHE map.
    pub ipcache_max_entries: u32,
    /// Capacity of ENDPOINTS.
    pub endpoints_max_entries: u32,
    /// The node's uplink interface, for to_native/from_native (optional).
    pub uplink: Option<String>,
}

impl Default for DatapathConfig {
    fn default() -> Self {
        Self {
            pin_root: PathBuf::from("/sys/fs/bpf/lockstep"),
            migrate: false,
            take_over_pin_root: false,
            attach_mode: AttachModeConfig::Auto,
            endpoint_attach_mode: AttachModeConfig::Netlink,
            ipcache_max_entries: lockstep_common::max_entries::IPCACHE,
            endpoints_max_entries: lockstep_common::max_entries::ENDPOINTS,
            uplink: None,
        }
    }
}

/// `[masquerade]`: source NAT of endpoint traffic leaving through the
/// uplink, in BPF (docs/masquerade.md). Acts only with `datapath.uplink`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct MasqueradeConfig {
    /// Translate at all (default on; without an uplink nothing is).
    pub enabled: bool,
    /// The IPv4 address flows leave with (default: the uplink's first
    /// global IPv4 address; none: IPv4 is not translated).
    pub address_v4: Option<std::net::Ipv4Addr>,
    /// The IPv6 address flows leave with (default: the uplink's first
    /// global IPv6 address).
    pub address_v6: Option<std::net::Ipv6Addr>,
    /// Translated source ports (and ICMP identifiers), `LOW-HIGH`; must not
    /// meet the node's `net.ipv4.ip_local_port_range`.
    pub ports: String,
    /// Idle time after which an open TCP translation ends.
    #[schemars(with = "crate::config::reference::HumanDuration")]
    #[serde(with = "humantime_serde")]
    pub tcp_timeout: Duration,
    /// Idle time after which a TCP translation closed by FIN both ways, or
    /// reset, ends.
    #[schemars(with = "crate::config::reference::HumanDuration")]
    #[serde(with = "humantime_serde")]
    pub tcp_closing_timeout: Duration,
    /// Idle time after which a UDP translation ends.
    #[schemars(with = "crate::config::reference::HumanDuration")]
    #[serde(with = "humantime_serde")]
    pub udp_timeout: Duration,
    /// Idle time after which an ICMP echo translation ends.
    #[schemars(with = "crate::config::reference::HumanDuration")]
    #[serde(with = "humantime_serde")]
    pub icmp_timeout: Duration,
    /// Idle time after which a translation nothing has answered yet (a
    /// TCP SYN, a UDP datagram, an echo request without reply) ends.
    #[schemars(with = "crate::config::reference::HumanDuration")]
    #[serde(with = "humantime_serde")]
    pub unreplied_timeout: Duration,
    /// The share of each family's translation table (0 < share ≤ 1) one
    /// endpoint address may hold; a new flow beyond it is dropped.
    pub endpoint_share: f64,
    /// How often the agent collects ended translations.
    #[schemars(with = "crate::config::reference::HumanDuration")]
    #[serde(with = "humantime_serde")]
    pub gc_interval: Duration,
}

impl Default for MasqueradeConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            address_v4: None,
            address_v6: None,
            ports: "61000-65535".into(),
            tcp_timeout: Duration::from_secs(7200),
            tcp_closing_timeout: Duration::from_secs(10),
            udp_timeout: Duration::from_secs(60),
            icmp_timeout: Duration::from_secs(30),
            unreplied_timeout: Duration::from_secs(10),
            endpoint_share: 0.25,
            gc_interval: Duration::from_secs(5),
        }
    }
}

/// `[cni]`: installing the plugin and conflist (the DaemonSet pattern).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct CniConfig {
    /// Install on start (and remove what was installed when turned off).
    pub install: bool,
    /// Where the plugin binaries go.
    pub bin_dir: PathBuf,
    /// Where the conflist goes.
    pub conf_dir: PathBuf,
    /// The conflist's file name.
    pub conflist_name: String,
    /// The network name in the conflist.
    pub network_name: String,
    /// The conflist's `cniVersion`.
    pub cni_version: String,
    /// How long the reaper gathers full DELs' host veths before deleting
    /// them in one batch (one kernel grace period for all). A DEL is
    /// answered once its veth is gone, so the window adds to every full
    /// DEL; the addresses stay held until then. 0 (the default): a batch is
    /// what queued while the previous one ran. At most 20s, so a DEL (the
    /// window and at most 5 s more) is answered within the plugin's default
    /// `agentTimeout` of 30 s.
    #[schemars(with = "crate::config::reference::HumanDuration")]
    #[serde(with = "humantime_serde")]
    pub teardown_batch_window: Duration,
    /// The reference plugins the conflist chains after lockstep's, in
    /// order: `portmap` (hostPorts, the `portMappings` capability, with
    /// SNAT so localhost traffic is answered) and `bandwidth` (the
    /// `bandwidth` capability: a tbf qdisc on the pod's host veth; egress
    /// limits fail beside the netlink endpoint attach, docs/cni.md).
    /// Both by default, as Calico's default conflist chains them, so
    /// a pod's `hostPort` works. A plugin whose binary is not in
    /// `bin_dir` when the agent installs is left out of the conflist with
    /// a warning (a conflist naming a missing plugin fails every ADD).
    pub chain: Vec<ChainedPlugin>,
}

/// A reference CNI plugin the conflist can chain after lockstep's
/// (`[cni] chain`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ChainedPlugin {
    /// `portmap`: hostPort forwarding through iptables, `snat: true`.
    Portmap,
    /// `bandwidth`: ingress and egress shaping of the pod's host veth.
    Bandwidth,
}

impl ChainedPlugin {
    /// The plugin's binary name (its conflist `type`).
    pub fn binary(self) -> &'static str {
        match self {
            ChainedPlugin::Portmap => "portmap",
            ChainedPlugin::Bandwidth => "bandwidth",
        }
    }
}

/// The longest `cni.teardown_batch_window`.
pub const MAX_TEARDOWN_BATCH_WINDOW: Duration = Duration::from_secs(20);

impl Default for CniConfig {
    fn default() -> Self {
        Self {
            install: false,
            bin_dir: PathBuf::from("/opt/cni/bin"),
            conf_dir: PathBuf::from("/etc/cni/net.d"),
            conflist_name: "05-lockstep.conflist".into(),
            network_name: "lockstep".into(),
            // 1.0.0, not 1.1.0: runtimes still shipping older libcni (podman
            // 4.3) refuse 1.1.0 results. The plugin speaks both.
            cni_version: "1.0.0".into(),
            teardown_batch_window: Duration::ZERO,
            chain: vec![ChainedPlugin::Portmap, ChainedPlugin::Bandwidth],
        }
    }
}

/// One agent role: which families it holds an address in.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct RoleConfig {
    /// Hold an IPv4 address.
    pub ipv4: bool,
    /// Hold an IPv6 address.
    pub ipv6: bool,
    /// Announce the IPv4 address on the uplink (ARP responder); ingress only.
    pub announce: bool,
}

/// `[roles]`: the agent's own addresses.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct RolesConfig {
    /// Pool the role addresses come from (default: the default pool).
    pub pool: Option<String>,
    /// The ingress proxy's address.
    pub ingress: RoleConfig,
    /// The health responder's address.
    pub health: RoleConfig,
    /// The router (gateway) address.
    pub router: RoleConfig,
}

/// Where addresses come from (`[ipam] mode`).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum IpamMode {
    /// The agent's own pools.
    #[default]
    Local,
    /// An external CNI IPAM plugin named in the node's conflist.
    Delegated,
}

/// `[ipam]`: local pools or an external CNI IPAM plugin (see
/// [`crate::delegate`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct IpamConfig {
    /// Local or delegated.
    pub mode: IpamMode,
    /// The node's CNI conflist naming the IPAM plugin (delegated mode).
    pub conflist: PathBuf,
    /// Where CNI plugin binaries are looked up (`CNI_PATH`).
    pub plugin_dirs: Vec<PathBuf>,
    /// How long one plugin invocation may take before it is killed.
    #[schemars(with = "crate::config::reference::HumanDuration")]
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// The network namespace the agent runs the plugin in for its own
    /// attachments (default: `<state_dir>/ipam-netns`, created on start).
    pub netns: Option<PathBuf>,
    /// The node's root as the agent sees it, to compare the plugin's state
    /// directory with the node's (`/proc/1/root` with the host PID
    /// namespace).
    pub node_root: PathBuf,
}

impl Default for IpamConfig {
    fn default() -> Self {
        Self {
            mode: IpamMode::Local,
            conflist: PathBuf::from("/etc/cni/net.d/10-delegated.conflist"),
            plugin_dirs: vec![PathBuf::from("/opt/cni/bin")],
            timeout: Duration::from_secs(10),
            netns: None,
            node_root: PathBuf::from("/proc/1/root"),
        }
    }
}

/// The whole configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// This node's name (default: `NODE_NAME`, which the DaemonSet sets
    /// from the downward API's `spec.nodeName`, else the host name
    /// lowercased).
    pub node_name: Option<String>,
    /// Directory of the store.
    pub state_dir: PathBuf,
    /// The API's unix socket.
    pub socket: PathBuf,
    /// Prometheus metrics listen address (loopback by default).
    pub metrics_addr: Option<SocketAddr>,
    /// How often the maps are compared with the store and repaired.
    #[schemars(with = "crate::config::reference::HumanDuration")]
    #[serde(with = "humantime_serde")]
    pub reconcile_interval: Duration,
    /// How long an API connection may take to send a request's headers, and
    /// stay idle between requests, before the agent closes it.
    #[schemars(with = "crate::config::reference::HumanDuration")]
    #[serde(with = "humantime_serde")]
    pub api_header_timeout: Duration,
    /// The most API connections served at once (0: a quarter of the open
    /// file limit, at most 512); more wait in the socket's backlog, so
    /// descriptors always remain for the agent's own work.
    pub api_max_connections: usize,
    /// CIDRs that endpoint traffic reaches without masquerading.
    #[schemars(with = "Vec<String>")]
    pub non_masquerade_cidrs: Vec<IpNet>,
    /// Masquerade (source NAT) settings.
    pub masquerade: MasqueradeConfig,
    /// Datapath settings.
    pub datapath: DatapathConfig,
    /// CNI plugin installation.
    pub cni: CniConfig,
    /// Agent-owned addresses.
    pub roles: RolesConfig,
    /// The pool endpoints get when the CNI call names none (default: the
    /// first pool).
    pub default_pool: Option<String>,
    /// The node's local pools.
    pub pools: Vec<PoolSpec>,
    /// Local or delegated IPAM.
    pub ipam: IpamConfig,
    /// LoadBalancer announcements.
    pub lb: LbConfig,
    /// Cluster mode (absent: single-node mode).
    pub cluster: Option<ClusterConfig>,
    /// The Kubernetes API as a source of LoadBalancer Services, pools and
    /// Node facts (absent: the API is never called).
    pub kubernetes: Option<KubernetesConfig>,
    /// LoadBalancer addresses announced to routers over BGP, through
    /// BIRD (absent: no BGP).
    pub bgp: Option<BgpConfig>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            node_name: None,
            state_dir: PathBuf::from("/var/lib/lockstep"),
            socket: PathBuf::from("/run/lockstep/lockstep.sock"),
            metrics_addr: Some(SocketAddr::from(([127, 0, 0, 1], 9476))),
            reconcile_interval: Duration::from_secs(10),
            api_header_timeout: Duration::from_secs(10),
            api_max_connections: 0,
            non_masquerade_cidrs: Vec::new(),
            masquerade: MasqueradeConfig::default(),
            datapath: DatapathConfig::default(),
            cni: CniConfig::default(),
            roles: RolesConfig::default(),
            default_pool: None,
            pools: vec![
                PoolSpec::new("default")
                    .with_cidr("10.244.0.0/16".parse().expect("literal"))
                    .with_cidr("fd00:10:244::/112".parse().expect("literal")),
            ],
            ipam: IpamConfig::default(),
            lb: LbConfig::default(),
            cluster: None,
            kubernetes: None,
            bgp: None,
        }
    }
}

impl Config {
    /// Loads `path`; a missing file at the default location yields the
    /// embedded default, a missing file named explicitly is an error.
    ///
    /// # Errors
    /// The file cannot be read, parsed or validated.
    pub fn load(path: Option<&Path>) -> Result<Self, ConfigError> {
        let (path, explicit) = match path {
            Some(p) => (p.to_path_buf(), true),
            None => (PathBuf::from(DEFAULT_CONFIG), false),
        };
        match std::fs::read_to_string(&path) {
            Ok(text) => Self::parse(&path, &text),
            Err(e) if !explicit && e.kind() == std::io::ErrorKind::NotFound => {
                tracing::info!(path = %path.display(), "no config file; using the embedded default");
                Ok(Self::default())
            }
            Err(source) => Err(ConfigError::Read { path, source }),
        }
    }

    /// Parses and validates config text (`path` is only used in errors).
    ///
    /// # Errors
    /// [`ConfigError::Parse`] or [`ConfigError::Invalid`].
    pub fn parse(path: &Path, text: &str) -> Result<Self, ConfigError> {
        let config: Config = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string().trim().replace('\n', " "),
        })?;
        config.validate(path)?;
        Ok(config)
    }

    /// Checks values that parse but are not acceptable.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the field (the first of
    /// [`Config::problems`]).
    pub fn validate(&self, path: &Path) -> Result<(), ConfigError> {
        match self.problems().into_iter().next() {
            Some((field, reason)) => Err(ConfigError::Invalid {
                path: path.to_path_buf(),
                field,
                reason,
            }),
            None => Ok(()),
        }
    }

    /// Every value that parses but is not acceptable, as (dotted field,
    /// what is wrong), in the file's order of sections; empty when the
    /// config is valid. `lockstep config check` prints them all. A
    /// section checked by its own type (`[lb]`, `[cluster]`,
    /// `[kubernetes]`, each pool) names its first problem.
    pub fn problems(&self) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = Vec::new();
        // An interval beyond a day turns drift repair (and a failed store's
        // recovery) off in all but name.
        if self.cni.teardown_batch_window > MAX_TEARDOWN_BATCH_WINDOW {
            out.push((
                "cni.teardown_batch_window".into(),
                "must be at most 20s (a full DEL is answered after it, and the plugin gives the agent 30 s by default)".into(),
            ));
        }
        if self.reconcile_interval < Duration::from_millis(100)
            || self.reconcile_interval > MAX_RECONCILE_INTERVAL
        {
            out.push((
                "reconcile_interval".into(),
                "must be at least 100ms and at most 24h".into(),
            ));
        }
        if self.api_header_timeout < Duration::from_millis(100)
            || self.api_header_timeout > Duration::from_secs(300)
        {
            out.push((
                "api_header_timeout".into(),
                "must be between 100ms and 5m".into(),
            ));
        }
        if self.datapath.ipcache_max_entries == 0 {
            out.push((
                "datapath.ipcache_max_entries".into(),
                "must be greater than zero".into(),
            ));
        }
        if self.datapath.endpoints_max_entries == 0 {
            out.push((
                "datapath.endpoints_max_entries".into(),
                "must be greater than zero".into(),
            ));
        }
        for (field, p) in [
            ("cni.bin_dir", &self.cni.bin_dir),
            ("cni.conf_dir", &self.cni.conf_dir),
        ] {
            if !p.is_absolute() {
                out.push((field.into(), "must be an absolute path".into()));
            }
        }
        if !["0.3.1", "0.4.0", "1.0.0", "1.1.0"].contains(&self.cni.cni_version.as_str()) {
            out.push((
                "cni.cni_version".into(),
                format!(
                    "{} is not one of 0.3.1, 0.4.0, 1.0.0, 1.1.0",
                    self.cni.cni_version
                ),
            ));
        }
        let mut chained = BTreeSet::new();
        if let Some(twice) = self.cni.chain.iter().find(|p| !chained.insert(p.binary())) {
            out.push((
                "cni.chain".into(),
                format!("names {} twice", twice.binary()),
            ));
        }
        if self.cni.conflist_name.contains('/') || !self.cni.conflist_name.ends_with(".conflist") {
            out.push((
                "cni.conflist_name".into(),
                "must be a file name ending in .conflist".into(),
            ));
        }
        if !self.datapath.pin_root.is_absolute() {
            out.push((
                "datapath.pin_root".into(),
                "must be an absolute path".into(),
            ));
        }
        for (field, p) in [("state_dir", &self.state_dir), ("socket", &self.socket)] {
            if !p.is_absolute() {
                out.push((field.into(), "must be an absolute path".into()));
            }
        }
        if let Err(e) = self
            .masquerade
            .ports
            .parse::<lockstep_core::masquerade::PortRange>()
        {
            out.push(("masquerade.ports".into(), e.to_string()));
        }
        for (key, d) in [
            ("masquerade.tcp_timeout", self.masquerade.tcp_timeout),
            (
                "masquerade.tcp_closing_timeout",
                self.masquerade.tcp_closing_timeout,
            ),
            ("masquerade.udp_timeout", self.masquerade.udp_timeout),
            ("masquerade.icmp_timeout", self.masquerade.icmp_timeout),
            (
                "masquerade.unreplied_timeout",
                self.masquerade.unreplied_timeout,
            ),
            ("masquerade.gc_interval", self.masquerade.gc_interval),
        ] {
            if d < Duration::from_millis(100) || d > Duration::from_secs(7 * 24 * 3600) {
                out.push((key.into(), "must be between 100ms and 7 days".into()));
            }
        }
        let share = self.masquerade.endpoint_share;
        if !(share > 0.0 && share <= 1.0) {
            out.push((
                "masquerade.endpoint_share".into(),
                format!("{share} is not a share of the table: it must be above 0 and at most 1"),
            ));
        }
        for (i, cidr) in self.non_masquerade_cidrs.iter().enumerate() {
            if cidr.trunc() != *cidr {
                out.push((
                    format!("non_masquerade_cidrs[{i}]"),
                    format!("{cidr} has host bits set (did you mean {}?)", cidr.trunc()),
                ));
            }
        }
        let mut names = BTreeSet::new();
        let mut duplicate = false;
        for (i, pool) in self.pools.iter().enumerate() {
            if !names.insert(pool.name.as_str()) {
                duplicate = true;
                out.push((
                    format!("pools[{i}].name"),
                    format!("pool {} is defined twice", pool.name),
                ));
            }
            if let Err(e) = pool.validate() {
                out.push((format!("pools[{i}] ({})", pool.name), e.to_string()));
            }
            if pool.cidrs().next().is_none() {
                out.push((
                    format!("pools[{i}] ({})", pool.name),
                    "has no CIDR: give it ipv4 or ipv6 CIDRs".into(),
                ));
            }
        }
        // The pools as a set (overlaps); a name defined twice is named above.
        if !duplicate && let Err(e) = validate_specs(&self.pools) {
            out.push(("pools".into(), e.to_string()));
        }
        if let Some(r) = &self.roles.pool
            && !self.pools.iter().any(|p| &p.name == r)
        {
            out.push(("roles.pool".into(), format!("no pool is named {r}")));
        }
        for (name, role) in [
            ("health", &self.roles.health),
            ("router", &self.roles.router),
        ] {
            if role.announce {
                out.push((
                    format!("roles.{name}.announce"),
                    "only the ingress address can be announced".into(),
                ));
            }
        }
        if self.ipam.mode == IpamMode::Delegated {
            if !self.ipam.conflist.is_absolute() {
                out.push(("ipam.conflist".into(), "must be an absolute path".into()));
            }
            if self.ipam.plugin_dirs.is_empty() {
                out.push((
                    "ipam.plugin_dirs".into(),
                    "name at least one directory".into(),
                ));
            }
            for (i, d) in self.ipam.plugin_dirs.iter().enumerate() {
                if !d.is_absolute() {
                    out.push((
                        format!("ipam.plugin_dirs[{i}]"),
                        "must be an absolute path".into(),
                    ));
                }
            }
            if self.ipam.netns.as_ref().is_some_and(|p| !p.is_absolute()) {
                out.push(("ipam.netns".into(), "must be an absolute path".into()));
            }
        }
        if self.ipam.timeout < Duration::from_millis(100) || self.ipam.timeout > MAX_IPAM_TIMEOUT {
            out.push((
                "ipam.timeout".into(),
                "must be between 100ms and 10m".into(),
            ));
        }
        if let Err(problem) = self.lb.validate() {
            out.push(problem);
        }
        if let Some(b) = &self.bgp {
            if let Err(problem) = b.validate() {
                out.push(problem);
            }
            if b.router_id.is_none() && self.kubernetes.is_none() {
                out.push((
                    "bgp.router_id".into(),
                    "is required without [kubernetes] (with it, the Node's IPv4 InternalIP \
                     stands in)"
                        .into(),
                ));
            }
        }
        if let Some(c) = &self.cluster
            && let Err(problem) = c.validate(self.datapath.uplink.is_some())
        {
            out.push(problem);
        }
        if let Some(k) = &self.kubernetes {
            if let Err(problem) = k.validate() {
                out.push(problem);
            }
            // PodIPPools become etcd's cluster pools: no etcd, no pools.
            if k.pod_pools && self.cluster.is_none() {
                out.push((
                    "kubernetes.pod_pools".into(),
                    "needs [cluster]: PodIPPools are applied as the cluster's pools in etcd".into(),
                ));
            }
            if let Some(name) = &k.pod_cidr_pool {
                if self.cluster.is_some() {
                    out.push((
                        "kubernetes.pod_cidr_pool".into(),
                        "cannot be used with [cluster]: the Node's podCIDRs and etcd's blocks are \
                         two sources of this node's CIDRs; choose one"
                            .into(),
                    ));
                }
                if self.pools.iter().any(|p| &p.name == name) {
                    out.push((
                        "kubernetes.pod_cidr_pool".into(),
                        format!("a configured pool is named {name} too"),
                    ));
                }
            }
            // Every node of a cluster would serve the same embedded
            // 10.244.0.0/16: pod addresses repeating across nodes (#44
            // item 5). A node's pods need a source of their own.
            if self.cluster.is_none()
                && k.nodeipam.is_none()
                && k.pod_cidr_pool.is_none()
                && self.pools == Config::default().pools
            {
                out.push((
                    "pools".into(),
                    "with [kubernetes], the embedded default pool (10.244.0.0/16) would be the same \
                     on every node; choose where this node's pod addresses come from: \
                     [kubernetes] pod_cidr_pool (the Node's spec.podCIDRs), [kubernetes.nodeipam], \
                     [cluster], [[pools]] of this node's own, or pools = [] (no pods)"
                        .into(),
                ));
            }
            if let Some(n) = &k.nodeipam {
                // NodeIPAM is the alternative to etcd's blocks: both would
                // say which CIDRs this node holds (docs/kubernetes.md).
                if self.cluster.is_some() {
                    out.push((
                        "kubernetes.nodeipam".into(),
                        "cannot be used with [cluster]: NodeIPAM and etcd's blocks are two \
                         sources of this node's CIDRs; choose one"
                            .into(),
                    ));
                }
                let names: Vec<String> = self.pools.iter().map(|p| p.name.clone()).collect();
                if let Err(problem) = n.validate(&names) {
                    out.push(problem);
                }
            }
        }
        // In cluster mode the default pool may be a cluster pool, known
        // only once etcd answers.
        if let Some(d) = &self.default_pool
            && self.cluster.is_none()
            && !self.pools.iter().any(|p| &p.name == d)
            && !self.nodeipam_pools().iter().any(|p| &p.name == d)
            && self
                .kubernetes
                .as_ref()
                .and_then(|k| k.pod_cidr_pool.as_ref())
                != Some(d)
        {
            out.push(("default_pool".into(), format!("no pool is named {d}")));
        }
        out
    }

    /// The NodeIPAM pools (`[kubernetes.nodeipam]`), none without it.
    pub fn nodeipam_pools(&self) -> Vec<lockstep_core::nodeipam::NodePool> {
        self.kubernetes
            .as_ref()
            .and_then(|k| k.nodeipam.as_ref())
            .map(NodeIpamConfig::core_pools)
            .unwrap_or_default()
    }

    /// This node's Node object in Kubernetes: `[kubernetes] node_name`, else
    /// `[cluster] node_name`, else [`Config::node_name`].
    pub fn kubernetes_node_name(&self) -> String {
        self.kubernetes_node_name_and_source().0
    }

    /// [`Config::kubernetes_node_name`] and where it came from.
    pub fn kubernetes_node_name_and_source(&self) -> (String, lockstep_core::identity::NameSource) {
        self.kubernetes
            .as_ref()
            .and_then(|k| k.node_name.clone())
            .or_else(|| self.cluster.as_ref().and_then(|c| c.node_name.clone()))
            .map_or_else(
                || self.node_name_and_source(),
                |n| (n, lockstep_core::identity::NameSource::Config),
            )
    }

    /// This node's name: configured, else `NODE_NAME` (the downward API's
    /// `spec.nodeName`), else the host name lowercased
    /// (`lockstep_core::identity`).
    pub fn node_name(&self) -> String {
        self.node_name_and_source().0
    }

    /// [`Config::node_name`] and where it came from.
    pub fn node_name_and_source(&self) -> (String, lockstep_core::identity::NameSource) {
        let downward = std::env::var("NODE_NAME").ok();
        let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname").ok();
        lockstep_core::identity::node_name(
            self.node_name.as_deref(),
            downward.as_deref(),
            hostname.as_deref(),
        )
    }
}

#[cfg(test)]
mod tests;
