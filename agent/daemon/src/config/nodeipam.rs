//! `[kubernetes.nodeipam]`: this node's NodeIPAM pools (docs/kubernetes.md,
//! "NodeIPAM"). The operator writes CIDRs into the NodeIPAM object's
//! status; what the node does with them (first and last address usable,
//! masquerade, how demand is computed) is defined here, in the node's
//! config, not in the object: the agent needs it before the API answers
//! (a restart restores its endpoints into these pools from its own record)
//! and the object's spec is the agent's to write.

use std::time::Duration;

use lockstep_core::demand::DemandMode;
use lockstep_core::nodeipam::NodePool;
use serde::{Deserialize, Serialize};

/// How a pool's `requested` is computed.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum DemandKind {
    /// `in_use + pre_allocate`: the operator recovers usage exactly.
    #[default]
    Linear,
    /// That rounded up to whole blocks of `block_size` addresses.
    Ceil,
}

/// One `[[kubernetes.nodeipam.pools]]`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NodeIpamPoolConfig {
    /// The pool's name (in the object and in CNI requests).
    pub name: String,
    /// Hand out the first and last address of each CIDR (default true:
    /// cloud prefixes are fully usable).
    #[serde(default = "yes")]
    pub allow_first_last: bool,
    /// Traffic from the pool to its own CIDRs is not masqueraded.
    #[serde(default)]
    pub skip_masquerade: bool,
    /// `linear` (default) or `ceil`.
    #[serde(default)]
    pub demand: DemandKind,
    /// Addresses per block in `ceil` mode (default 16, a /28 with first
    /// and last usable).
    #[serde(default = "sixteen")]
    pub block_size: u64,
    /// Free addresses to ask for beyond those in use.
    #[serde(default)]
    pub pre_allocate: u64,
}

fn yes() -> bool {
    true
}

fn sixteen() -> u64 {
    16
}

impl NodeIpamPoolConfig {
    /// The pool as the core takes it.
    pub fn to_core(&self) -> NodePool {
        NodePool {
            name: self.name.clone(),
            allow_first_last: self.allow_first_last,
            skip_masquerade: self.skip_masquerade,
            mode: match self.demand {
                DemandKind::Linear => DemandMode::Linear,
                DemandKind::Ceil => DemandMode::Ceil {
                    block_size: self.block_size,
                },
            },
            pre_allocate: self.pre_allocate,
        }
    }
}

/// `[kubernetes.nodeipam]`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NodeIpamConfig {
    /// How often demand is evaluated and written when it changed (pods
    /// coming and going change no object the agent watches).
    #[schemars(with = "crate::config::reference::HumanDuration")]
    #[serde(default = "second", with = "humantime_serde")]
    pub interval: Duration,
    /// The pools.
    #[serde(default)]
    pub pools: Vec<NodeIpamPoolConfig>,
    /// The elected LB writer (`[kubernetes.election]`, no `[cluster]`) is
    /// the operator: it offers every node CIDRs of the `PodIPPool` of each
    /// pool's name, as far as the node's demand asks, and takes back what
    /// a node released. Off: an external operator fills the objects.
    #[serde(default)]
    pub operator: bool,
}

fn second() -> Duration {
    Duration::from_secs(1)
}

impl NodeIpamConfig {
    /// The pools as the core takes them.
    pub fn core_pools(&self) -> Vec<NodePool> {
        self.pools.iter().map(NodeIpamPoolConfig::to_core).collect()
    }

    /// Checks the section against the node's configured pools: (field,
    /// reason) of the first bad value.
    ///
    /// # Errors
    /// No pool, an empty or repeated name, a name a configured pool has, a
    /// ceil block of 0, an interval outside 10ms..=1m.
    pub fn validate(&self, configured: &[String]) -> Result<(), (String, String)> {
        let field = |i: usize, f: &str| format!("kubernetes.nodeipam.pools[{i}].{f}");
        if self.pools.is_empty() {
            return Err((
                "kubernetes.nodeipam.pools".into(),
                "name at least one pool".into(),
            ));
        }
        if self.interval < Duration::from_millis(10) || self.interval > Duration::from_secs(60) {
            return Err((
                "kubernetes.nodeipam.interval".into(),
                "must be between 10ms and 1m".into(),
            ));
        }
        for (i, p) in self.pools.iter().enumerate() {
            if p.name.is_empty() || p.name.chars().any(|c| c.is_whitespace() || c.is_control()) {
                return Err((
                    field(i, "name"),
                    "must be a non-empty name without spaces".into(),
                ));
            }
            if self.pools[..i].iter().any(|q| q.name == p.name) {
                return Err((
                    field(i, "name"),
                    format!("pool {} is defined twice", p.name),
                ));
            }
            if configured.contains(&p.name) {
                return Err((
                    field(i, "name"),
                    format!("a configured pool is named {} too", p.name),
                ));
            }
            if lockstep_core::nodeipam::check_pool(&p.to_core()).is_err() {
                return Err((field(i, "block_size"), "must be at least 1".into()));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pools_read_with_their_defaults_and_bad_ones_are_named() {
        let c: NodeIpamConfig = toml::from_str(
            "interval = \"200ms\"\n[[pools]]\nname = \"eni\"\npre_allocate = 4\n[[pools]]\nname = \"burst\"\ndemand = \"ceil\"\n",
        )
        .unwrap();
        assert_eq!(c.interval, Duration::from_millis(200));
        let p = c.core_pools();
        assert!(p[0].allow_first_last);
        assert_eq!(p[0].mode, DemandMode::Linear);
        assert_eq!(p[1].mode, DemandMode::Ceil { block_size: 16 });
        assert!(c.validate(&[]).is_ok());
        assert_eq!(
            c.validate(&["eni".into()]).unwrap_err(),
            (
                "kubernetes.nodeipam.pools[0].name".into(),
                "a configured pool is named eni too".into()
            )
        );
        let mut zero = c.clone();
        zero.pools[1].block_size = 0;
        assert_eq!(
            zero.validate(&[]).unwrap_err().0,
            "kubernetes.nodeipam.pools[1].block_size"
        );
        assert!(
            toml::from_str::<NodeIpamConfig>("[[pools]]\nname = \"x\"\nmode = \"ceil\"\n").is_err()
        );
    }

    #[test]
    fn the_whole_config_refuses_cluster_mode_and_a_clashing_name() {
        let path = std::path::Path::new("/c.toml");
        let nodeipam =
            "[kubernetes]\n[kubernetes.nodeipam]\n[[kubernetes.nodeipam.pools]]\nname = \"eni\"\n";
        let c = crate::config::Config::parse(path, nodeipam).expect("valid");
        assert_eq!(c.nodeipam_pools()[0].name, "eni");
        let both = format!(
            "[cluster]\netcd = [\"http://127.0.0.1:2379\"]\nnode_ip_v4 = \"192.0.2.1\"\n{nodeipam}"
        );
        let e = crate::config::Config::parse(path, &both)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("kubernetes.nodeipam") && e.contains("[cluster]"),
            "{e}"
        );
        let clash = format!("[[pools]]\nname = \"eni\"\nipv4 = [\"10.1.0.0/24\"]\n{nodeipam}");
        let e = crate::config::Config::parse(path, &clash)
            .unwrap_err()
            .to_string();
        assert!(e.contains("kubernetes.nodeipam.pools[0].name"), "{e}");
        // The default pool may be a NodeIPAM pool.
        let default = format!("default_pool = \"eni\"\n{nodeipam}");
        assert!(crate::config::Config::parse(path, &default).is_ok());
    }
}
