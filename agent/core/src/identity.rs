//! The name this node goes by, everywhere it is a key: its Node object in
//! Kubernetes, its claims in etcd, the owner of its LoadBalancer
//! announcements.
//!
//! Why this order: a name in the config is the operator's word. Inside a
//! pod, the downward API's `spec.nodeName` (the `NODE_NAME` variable the
//! DaemonSet sets) is the name the API server knows the node by, whatever
//! the container's host name says. Last, the host name as kubelet
//! registers it: lowercased (Node names are lowercase RFC 1123 names, and
//! kubelet lowercases the host name it registers under).

use std::fmt;

/// Where a node name came from, for the log and for errors that name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NameSource {
    /// The configuration's `node_name`.
    Config,
    /// The `NODE_NAME` environment variable (the downward API).
    Downward,
    /// The host name, lowercased.
    HostName,
    /// Nothing gave one.
    Fallback,
}

impl fmt::Display for NameSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            NameSource::Config => "the configuration's node_name",
            NameSource::Downward => "NODE_NAME (the downward API's spec.nodeName)",
            NameSource::HostName => "the host name, lowercased",
            NameSource::Fallback => "nothing (no node_name, NODE_NAME or host name)",
        })
    }
}

/// The name used when nothing gives one.
pub const FALLBACK_NAME: &str = "node";

/// This node's name and where it came from: `configured`, else
/// `downward`, else `hostname` lowercased; blank values are skipped.
pub fn node_name(
    configured: Option<&str>,
    downward: Option<&str>,
    hostname: Option<&str>,
) -> (String, NameSource) {
    fn given(v: Option<&str>) -> Option<&str> {
        v.map(str::trim).filter(|v| !v.is_empty())
    }
    if let Some(v) = given(configured) {
        return (v.to_string(), NameSource::Config);
    }
    if let Some(v) = given(downward) {
        return (v.to_string(), NameSource::Downward);
    }
    if let Some(v) = given(hostname) {
        return (v.to_lowercase(), NameSource::HostName);
    }
    (FALLBACK_NAME.to_string(), NameSource::Fallback)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_wins_then_the_downward_api_then_the_host_name() {
        assert_eq!(
            node_name(Some("a"), Some("b"), Some("c")),
            ("a".into(), NameSource::Config)
        );
        assert_eq!(
            node_name(None, Some("b"), Some("c")),
            ("b".into(), NameSource::Downward)
        );
        assert_eq!(
            node_name(Some("  "), Some(""), Some("c")),
            ("c".into(), NameSource::HostName)
        );
        assert_eq!(
            node_name(None, None, None),
            (FALLBACK_NAME.into(), NameSource::Fallback)
        );
    }

    #[test]
    fn the_host_name_is_lowercased_as_kubelet_registers_it() {
        assert_eq!(
            node_name(None, None, Some("Worker-01\n")),
            ("worker-01".into(), NameSource::HostName)
        );
        // A name given explicitly is taken as written.
        assert_eq!(node_name(None, Some("Worker-01"), None).0, "Worker-01");
    }
}
