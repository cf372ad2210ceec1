//! `[cluster]`: cluster mode's settings (issue #12, docs/cluster.md).
//!
//! Without the section the agent runs single-node, on its own pools. With
//! it, the agent registers itself in etcd and takes blocks of the cluster
//! pools there; [`ClusterConfig::validate`] checks what can be checked
//! without the system (the node addresses' default, the uplink's first
//! global address, is resolved at start).

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::PathBuf;
use std::time::Duration;

use lockstep_core::cluster::routing::{MAX_VNI, RoutingMode, TunnelProtocol};
use serde::{Deserialize, Serialize};

/// `[cluster.tls]`: PEM files for `https://` etcd endpoints.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ClusterTlsConfig {
    /// CA certificate trusted for etcd's serving certificates.
    pub ca: PathBuf,
    /// Client certificate, when etcd checks clients (with `key`).
    #[serde(default)]
    pub cert: Option<PathBuf>,
    /// The client certificate's private key (with `cert`).
    #[serde(default)]
    pub key: Option<PathBuf>,
}

/// `[cluster]`: pools and block ownership shared through etcd.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    /// Client URLs of the etcd members (required, at least one).
    pub etcd: Vec<String>,
    /// Key prefix, starting and ending with `/`.
    #[serde(default = "default_prefix")]
    pub prefix: String,
    /// This node's name in etcd (default: the top-level `node_name`, else
    /// `NODE_NAME`, else the host name lowercased).
    #[serde(default)]
    pub node_name: Option<String>,
    /// The IPv4 address other nodes route this node's blocks to (default:
    /// the uplink's first global IPv4 address).
    #[serde(default)]
    pub node_ip_v4: Option<Ipv4Addr>,
    /// The IPv6 address other nodes route this node's blocks to (default:
    /// the uplink's first global IPv6 address).
    #[serde(default)]
    pub node_ip_v6: Option<Ipv6Addr>,
    /// TTL of the node's lease (the node key dies this long after the
    /// agent stops renewing it).
    #[schemars(with = "crate::config::reference::HumanDuration")]
    #[serde(default = "default_lease_ttl", with = "humantime_serde")]
    pub lease_ttl: Duration,
    /// How long a node's lease must be gone before its blocks may be
    /// reclaimed.
    #[schemars(with = "crate::config::reference::HumanDuration")]
    #[serde(default = "default_reclaim_after", with = "humantime_serde")]
    pub reclaim_after: Duration,
    /// How long an empty block is kept before it is given back.
    #[schemars(with = "crate::config::reference::HumanDuration")]
    #[serde(default = "default_release_after", with = "humantime_serde")]
    pub release_after: Duration,
    /// The least time between two recomputations of the remote state
    /// (other nodes' blocks as IPCACHE entries and routes): a lone change
    /// is applied at once, a burst (a cluster starting, a zone coming
    /// back) at most once per this, so a node's CPU for it stays bounded
    /// at thousands of nodes.
    #[schemars(with = "crate::config::reference::HumanDuration")]
    #[serde(default = "default_remote_settle", with = "humantime_serde")]
    pub remote_settle: Duration,
    /// TLS to etcd.
    #[serde(default)]
    pub tls: Option<ClusterTlsConfig>,
    /// This node's labels, published with its LB membership: an LB pool's
    /// `node_selector` admits the nodes whose labels it matches as
    /// announcers of its addresses (`node_labels = { zone = "a" }`).
    /// Keys and values follow Kubernetes label syntax.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_labels: BTreeMap<String, String>,
    /// How other nodes' blocks are reached: `native` (routes via the node
    /// address; one L2 segment), `tunnel` (always encapsulated) or
    /// `cross-subnet` (native on this node's subnets, encapsulated beyond).
    #[serde(default)]
    pub routing: RoutingMode,
    /// The encapsulation of `tunnel` and `cross-subnet`: `vxlan` or `geneve`.
    #[serde(default)]
    pub tunnel_protocol: TunnelProtocol,
    /// The tunnel's UDP port (default: 8472 for VXLAN, 6081 for Geneve).
    #[serde(default)]
    pub tunnel_port: Option<u16>,
    /// The VNI sent and accepted (24 bits; every node must use the same).
    #[serde(default = "default_vni")]
    pub tunnel_vni: u32,
    /// The MTU of endpoint interfaces whose CNI configuration names none
    /// (default: the uplink's MTU, less the encapsulation overhead in the
    /// modes that may encapsulate: 50 bytes over IPv4, 70 when the node
    /// has an IPv6 underlay address).
    #[serde(default)]
    pub endpoint_mtu: Option<u32>,
    /// The fewest spare addresses the node keeps in its reservation window
    /// per pool and family, beyond those in use (docs/cluster.md,
    /// "Reservation windows"): what it may hand out while cut off from
    /// etcd before it answers "try again".
    #[serde(default = "default_window_min_spare")]
    pub window_min_spare: u64,
    /// The most: a burst of ADDs widens the window up to this, so a node
    /// refreshes it a few times a minute, not every few ADDs.
    #[serde(default = "default_window_max_spare")]
    pub window_max_spare: u64,
}

impl ClusterConfig {
    /// The tunnel's UDP port: configured, else the protocol's.
    pub fn tunnel_port(&self) -> u16 {
        self.tunnel_port
            .unwrap_or_else(|| self.tunnel_protocol.default_port())
    }
}

fn default_vni() -> u32 {
    1
}

fn default_window_min_spare() -> u64 {
    8
}

fn default_window_max_spare() -> u64 {
    256
}

/// Why `key` is not a Kubernetes label key: an optional DNS-subdomain
/// prefix and `/`, then a name of at most 63 characters.
fn label_key_problem(key: &str) -> Option<String> {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    if let Some(p) = prefix {
        let dns_ok = !p.is_empty()
            && p.len() <= 253
            && p.split('.').all(|l| {
                !l.is_empty()
                    && l.len() <= 63
                    && l.bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                    && !l.starts_with('-')
                    && !l.ends_with('-')
            });
        if !dns_ok {
            return Some(format!(
                "the prefix {p:?} is not a lower-case DNS subdomain"
            ));
        }
    }
    if name.is_empty() {
        return Some("the name part is empty".into());
    }
    label_value_problem(name)
}

/// Why `value` is not a Kubernetes label value: at most 63 characters of
/// `[A-Za-z0-9._-]`, beginning and ending alphanumeric (or empty).
fn label_value_problem(value: &str) -> Option<String> {
    if value.is_empty() {
        return None;
    }
    let alnum = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    if value.len() > 63
        || !value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        || !alnum(value.chars().next())
        || !alnum(value.chars().last())
    {
        return Some(format!(
            "{value:?} must be at most 63 characters of A-Z a-z 0-9 - _ ., \
             beginning and ending alphanumeric"
        ));
    }
    None
}

fn default_prefix() -> String {
    "/lockstep/v1/".into()
}

fn default_lease_ttl() -> Duration {
    Duration::from_secs(15)
}

fn default_reclaim_after() -> Duration {
    Duration::from_secs(3600)
}

fn default_release_after() -> Duration {
    Duration::from_secs(30)
}

fn default_remote_settle() -> Duration {
    Duration::from_millis(100)
}

impl ClusterConfig {
    /// Checks the section; `has_uplink`: `datapath.uplink` is set, so the
    /// node addresses have a default.
    ///
    /// # Errors
    /// `(field, reason)` naming the dotted field.
    pub fn validate(&self, has_uplink: bool) -> Result<(), (String, String)> {
        let bad = |f: &str, r: String| Err((format!("cluster.{f}"), r));
        if self.etcd.is_empty() {
            return bad("etcd", "list at least one etcd endpoint URL".into());
        }
        let scheme = if self.tls.is_some() {
            "https://"
        } else {
            "http://"
        };
        for (i, url) in self.etcd.iter().enumerate() {
            let rest = url.strip_prefix(scheme);
            if rest.is_none_or(|r| r.is_empty() || r.contains('/') && !r.ends_with('/')) {
                return bad(
                    &format!("etcd[{i}]"),
                    format!(
                        "{url:?} is not an endpoint URL starting with {scheme}{}",
                        if self.tls.is_some() {
                            " (cluster.tls is given)"
                        } else {
                            " (https:// needs cluster.tls)"
                        }
                    ),
                );
            }
        }
        if !(self.prefix.len() > 1 && self.prefix.starts_with('/') && self.prefix.ends_with('/')) {
            return bad(
                "prefix",
                format!(
                    "{:?} must start and end with / and name something",
                    self.prefix
                ),
            );
        }
        if let Some(name) = &self.node_name
            && let Some(why) = lockstep_core::cluster::key_name_problem(name)
        {
            return bad(
                "node_name",
                format!("{name:?} is not usable as an etcd key segment: {why}"),
            );
        }
        if !has_uplink && self.node_ip_v4.is_none() && self.node_ip_v6.is_none() {
            return bad(
                "node_ip_v4",
                "give node_ip_v4 or node_ip_v6 (the address other nodes route to), or set \
                 datapath.uplink so the uplink's first global address is used"
                    .into(),
            );
        }
        if let Some(ip) = self.node_ip_v4
            && (ip.is_unspecified() || ip.is_loopback() || ip.is_multicast() || ip.is_broadcast())
        {
            return bad("node_ip_v4", format!("{ip} is not a unicast node address"));
        }
        if let Some(ip) = self.node_ip_v6
            && (ip.is_unspecified() || ip.is_loopback() || ip.is_multicast())
        {
            return bad("node_ip_v6", format!("{ip} is not a unicast node address"));
        }
        if self.lease_ttl < Duration::from_secs(2) || self.lease_ttl > Duration::from_secs(600) {
            return bad("lease_ttl", "must be between 2s and 10m".into());
        }
        if self.reclaim_after < self.lease_ttl {
            return bad(
                "reclaim_after",
                format!("must be at least lease_ttl ({:?})", self.lease_ttl),
            );
        }
        if self.release_after > Duration::from_secs(24 * 3600) {
            return bad("release_after", "must be at most 24h".into());
        }
        if self.remote_settle > Duration::from_secs(60) {
            return bad("remote_settle", "must be at most 1m".into());
        }
        if self.window_min_spare == 0 || self.window_min_spare > 65_536 {
            return bad(
                "window_min_spare",
                "must be between 1 and 65536 (addresses)".into(),
            );
        }
        if self.window_max_spare < self.window_min_spare || self.window_max_spare > 65_536 {
            return bad(
                "window_max_spare",
                format!(
                    "must be between window_min_spare ({}) and 65536 (addresses)",
                    self.window_min_spare
                ),
            );
        }
        for (k, v) in &self.node_labels {
            if let Some(p) = label_key_problem(k) {
                return bad(&format!("node_labels.{k:?}"), format!("bad label key: {p}"));
            }
            if let Some(p) = label_value_problem(v) {
                return bad(
                    &format!("node_labels.{k:?}"),
                    format!("bad label value: {p}"),
                );
            }
        }
        if self.tunnel_vni > MAX_VNI {
            return bad(
                "tunnel_vni",
                format!(
                    "{} is more than 24 bits (at most {MAX_VNI})",
                    self.tunnel_vni
                ),
            );
        }
        if self.tunnel_port == Some(0) {
            return bad("tunnel_port", "0 is not a UDP port".into());
        }
        if let Some(mtu) = self.endpoint_mtu
            && !(1280..=65535).contains(&mtu)
        {
            return bad(
                "endpoint_mtu",
                format!("{mtu} is outside 1280..=65535 (IPv6 needs at least 1280)"),
            );
        }
        if let Some(tls) = &self.tls {
            for (f, p) in [
                ("tls.ca", Some(&tls.ca)),
                ("tls.cert", tls.cert.as_ref()),
                ("tls.key", tls.key.as_ref()),
            ] {
                if p.is_some_and(|p| !p.is_absolute()) {
                    return bad(f, "must be an absolute path".into());
                }
            }
            if tls.cert.is_some() != tls.key.is_some() {
                return bad(
                    if tls.cert.is_some() {
                        "tls.key"
                    } else {
                        "tls.cert"
                    },
                    "a client certificate needs its key, and a key its certificate".into(),
                );
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::config::{Config, ConfigError};

    fn field_of(text: &str) -> String {
        match Config::parse(Path::new("/etc/lockstep/c.toml"), text) {
            Err(ConfigError::Invalid { field, .. }) => field,
            other => panic!("expected an invalid field, got {other:?}"),
        }
    }

    const OK: &str = "[cluster]\netcd = [\"http://127.0.0.1:2379\"]\nnode_ip_v4 = \"192.0.2.1\"\n";

    #[test]
    fn a_minimal_section_takes_the_defaults() {
        let c = Config::parse(Path::new("/c.toml"), OK).expect("valid");
        let cl = c.cluster.expect("cluster");
        assert_eq!(cl.prefix, "/lockstep/v1/");
        assert_eq!(cl.lease_ttl, std::time::Duration::from_secs(15));
        assert_eq!(cl.reclaim_after, std::time::Duration::from_secs(3600));
        assert_eq!(cl.node_name, None);
        assert!(cl.node_labels.is_empty());
        assert_eq!(cl.routing, super::RoutingMode::Native);
        assert_eq!(cl.tunnel_port(), 8472);
        assert_eq!(cl.tunnel_vni, 1);
        let tunnel = format!(
            "{OK}routing = \"cross-subnet\"\ntunnel_protocol = \"geneve\"\nendpoint_mtu = 1400\n"
        );
        let cl = Config::parse(Path::new("/c.toml"), &tunnel)
            .expect("valid routing")
            .cluster
            .expect("cluster");
        assert_eq!(cl.routing, super::RoutingMode::CrossSubnet);
        assert_eq!(cl.tunnel_port(), 6081);
        assert_eq!(cl.endpoint_mtu, Some(1400));
        assert!(matches!(
            Config::parse(Path::new("/c.toml"), &format!("{OK}routing = \"overlay\"\n")),
            Err(ConfigError::Parse { message, .. }) if message.contains("routing") || message.contains("overlay")
        ));
        let labelled = format!(
            "{OK}node_labels = {{ zone = \"a\", \"topology.kubernetes.io/rack\" = \"r-1\", edge = \"\" }}\n"
        );
        let cl = Config::parse(Path::new("/c.toml"), &labelled)
            .expect("valid labels")
            .cluster
            .expect("cluster");
        assert_eq!(cl.node_labels["zone"], "a");
        assert_eq!(cl.node_labels["topology.kubernetes.io/rack"], "r-1");
        assert_eq!(cl.node_labels["edge"], "");
        assert_eq!(
            Config::parse(Path::new("/c.toml"), "")
                .expect("empty")
                .cluster,
            None
        );
    }

    #[test]
    fn the_uplink_stands_in_for_node_ips() {
        let text = "[datapath]\nuplink = \"eth0\"\n[cluster]\netcd = [\"http://e:2379\"]\n";
        assert!(Config::parse(Path::new("/c.toml"), text).is_ok());
        assert_eq!(
            field_of("[cluster]\netcd = [\"http://e:2379\"]\n"),
            "cluster.node_ip_v4"
        );
    }

    #[test]
    fn every_validation_error_names_its_field() {
        let cases = [
            (
                "[cluster]\netcd = []\nnode_ip_v4 = \"192.0.2.1\"\n",
                "cluster.etcd",
            ),
            (
                "[cluster]\netcd = [\"e:2379\"]\nnode_ip_v4 = \"192.0.2.1\"\n",
                "cluster.etcd[0]",
            ),
            (
                "[cluster]\netcd = [\"http://a:1\", \"https://b:2\"]\nnode_ip_v4 = \"192.0.2.1\"\n",
                "cluster.etcd[1]",
            ),
            (
                "[cluster]\netcd = [\"http://\"]\nnode_ip_v4 = \"192.0.2.1\"\n",
                "cluster.etcd[0]",
            ),
            (&format!("{OK}prefix = \"lockstep\"\n"), "cluster.prefix"),
            (&format!("{OK}prefix = \"/\"\n"), "cluster.prefix"),
            (&format!("{OK}node_name = \"a b\"\n"), "cluster.node_name"),
            (&format!("{OK}node_name = \"\"\n"), "cluster.node_name"),
            (&format!("{OK}node_name = \"a/b\"\n"), "cluster.node_name"),
            (
                &format!("{OK}node_name = \"a\\u0007b\"\n"),
                "cluster.node_name",
            ),
            (
                "[cluster]\netcd = [\"http://e:1\"]\nnode_ip_v4 = \"127.0.0.1\"\n",
                "cluster.node_ip_v4",
            ),
            (
                "[cluster]\netcd = [\"http://e:1\"]\nnode_ip_v6 = \"::1\"\n",
                "cluster.node_ip_v6",
            ),
            (&format!("{OK}lease_ttl = \"1s\"\n"), "cluster.lease_ttl"),
            (
                &format!("{OK}node_labels = {{ \"-zone\" = \"a\" }}\n"),
                "cluster.node_labels.\"-zone\"",
            ),
            (
                &format!("{OK}node_labels = {{ \"\" = \"a\" }}\n"),
                "cluster.node_labels.\"\"",
            ),
            (
                &format!("{OK}node_labels = {{ \"Ex.com/zone\" = \"a\" }}\n"),
                "cluster.node_labels.\"Ex.com/zone\"",
            ),
            (
                &format!("{OK}node_labels = {{ zone = \"a b\" }}\n"),
                "cluster.node_labels.\"zone\"",
            ),
            (&format!("{OK}lease_ttl = \"1h\"\n"), "cluster.lease_ttl"),
            (
                &format!("{OK}tunnel_vni = 16777216\n"),
                "cluster.tunnel_vni",
            ),
            (&format!("{OK}tunnel_port = 0\n"), "cluster.tunnel_port"),
            (
                &format!("{OK}endpoint_mtu = 1000\n"),
                "cluster.endpoint_mtu",
            ),
            (
                &format!("{OK}reclaim_after = \"5s\"\n"),
                "cluster.reclaim_after",
            ),
            (
                &format!("{OK}release_after = \"2d\"\n"),
                "cluster.release_after",
            ),
            (
                &format!("{OK}remote_settle = \"2m\"\n"),
                "cluster.remote_settle",
            ),
            (
                "[cluster]\netcd = [\"http://e:1\"]\nnode_ip_v4 = \"192.0.2.1\"\n[cluster.tls]\nca = \"/ca.pem\"\n",
                "cluster.etcd[0]",
            ),
            (
                "[cluster]\netcd = [\"https://e:1\"]\nnode_ip_v4 = \"192.0.2.1\"\n[cluster.tls]\nca = \"ca.pem\"\n",
                "cluster.tls.ca",
            ),
            (
                "[cluster]\netcd = [\"https://e:1\"]\nnode_ip_v4 = \"192.0.2.1\"\n[cluster.tls]\nca = \"/ca.pem\"\ncert = \"/c.pem\"\n",
                "cluster.tls.key",
            ),
        ];
        for (text, field) in cases {
            assert_eq!(field_of(text), field, "for {text}");
        }
    }

    #[test]
    fn tls_with_https_is_accepted_and_unknown_fields_are_refused() {
        let text = "[cluster]\netcd = [\"https://e:1\"]\nnode_ip_v4 = \"192.0.2.1\"\n[cluster.tls]\nca = \"/ca.pem\"\ncert = \"/c.pem\"\nkey = \"/k.pem\"\n";
        assert!(Config::parse(Path::new("/c.toml"), text).is_ok());
        let bad = format!("{OK}etcd_endpoints = []\n");
        assert!(matches!(
            Config::parse(Path::new("/c.toml"), &bad),
            Err(ConfigError::Parse { .. })
        ));
        // etcd is required.
        assert!(matches!(
            Config::parse(Path::new("/c.toml"), "[cluster]\nnode_ip_v4 = \"192.0.2.1\"\n"),
            Err(ConfigError::Parse { message, .. }) if message.contains("etcd")
        ));
    }
}
