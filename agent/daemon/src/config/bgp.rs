//! `[bgp]`: announce this node's LoadBalancer addresses to routers over
//! BGP, through the BIRD that runs beside the agent (docs/bgp.md).
//!
//! The section is turned into the core's [`BgpSpec`] and the pools'
//! route attributes ([`BgpConfig::spec`], [`BgpConfig::attrs`]); every
//! check the core makes is named here by the config's own field names.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::time::Duration;

use lockstep_core::bgp::{BfdSpec, BgpError, BgpSpec, PeerSpec, RouteAttrs};
use serde::{Deserialize, Serialize};

/// One router this node peers with.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BgpPeerConfig {
    /// A name for the session (letters, digits, `-`, `_`; in status,
    /// metrics and BIRD's protocol `peer_<name>`).
    pub name: String,
    /// The router's address: addresses of its family are announced to it.
    pub address: IpAddr,
    /// The router's AS number.
    pub asn: u32,
    /// The local address of the session (default: BIRD picks one).
    #[serde(default)]
    pub source: Option<IpAddr>,
    /// Whether BFD watches the session (`[bgp] bfd_interval`,
    /// `bfd_multiplier`): a dead link is withdrawn in interval ×
    /// multiplier instead of the hold time.
    #[serde(default = "default_true")]
    pub bfd: bool,
    /// The BGP hold time (0s: none; else 3s to 65535s).
    #[serde(default = "default_hold_time", with = "humantime_serde")]
    #[schemars(with = "crate::config::reference::HumanDuration")]
    pub hold_time: Duration,
}

/// What a pool's routes carry.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BgpPoolConfig {
    /// Standard communities, `AS:value` (each 0 to 65535).
    #[serde(default)]
    pub communities: Vec<String>,
    /// Large communities, `global:local1:local2` (each 0 to 4294967295).
    #[serde(default)]
    pub large_communities: Vec<String>,
    /// The local preference (sent to internal peers only).
    #[serde(default)]
    pub local_pref: Option<u32>,
}

/// `[bgp]`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BgpConfig {
    /// This node's AS number (required).
    pub asn: u32,
    /// The BGP router ID, an IPv4 address unique among the routers'
    /// peers. Required without `[kubernetes]`; with it, the Node's IPv4
    /// InternalIP when unset, so one config serves every node.
    #[serde(default)]
    pub router_id: Option<Ipv4Addr>,
    /// BIRD's control socket, shared with the agent.
    #[serde(default = "default_socket")]
    pub bird_socket: PathBuf,
    /// The configuration file BIRD starts from: the agent writes it (and
    /// `<name>.next` beside it while BIRD reads a new one).
    #[serde(default = "default_bird_config")]
    pub bird_config: PathBuf,
    /// BFD's packet interval (10ms to 10s).
    #[serde(default = "default_bfd_interval", with = "humantime_serde")]
    #[schemars(with = "crate::config::reference::HumanDuration")]
    pub bfd_interval: Duration,
    /// Missed BFD packets before a session is down (1 to 255).
    #[serde(default = "default_bfd_multiplier")]
    pub bfd_multiplier: u8,
    /// How long routers keep this node's routes while BIRD restarts
    /// (graceful restart; 1s to 4095s).
    #[serde(default = "default_graceful_restart", with = "humantime_serde")]
    #[schemars(with = "crate::config::reference::HumanDuration")]
    pub graceful_restart: Duration,
    /// How long the agent may be silent before `lockstep bird-keeper`
    /// (run beside BIRD) withdraws this node's LoadBalancer addresses
    /// (2s to 1h). The agent beats every second, into
    /// `lockstep.beat` beside `bird_config`; a restart within this time
    /// (an upgrade) changes nothing on the wire.
    #[serde(default = "default_withdraw_after", with = "humantime_serde")]
    #[schemars(with = "crate::config::reference::HumanDuration")]
    pub withdraw_after: Duration,
    /// The routers.
    #[serde(default)]
    pub peers: Vec<BgpPeerConfig>,
    /// The pools announced, by name, each a table `[bgp.pools.<name>]` of
    /// its routes' attributes: `communities` (`["AS:value"]`),
    /// `large_communities` (`["global:local1:local2"]`) and `local_pref`;
    /// `{}` for none. A LoadBalancer pool's addresses are announced as
    /// host routes, an endpoint pool's CIDRs as the node's pod blocks.
    /// Pools not named here are not announced over BGP.
    #[serde(default)]
    pub pools: BTreeMap<String, BgpPoolConfig>,
}

fn default_true() -> bool {
    true
}

fn default_hold_time() -> Duration {
    Duration::from_secs(90)
}

fn default_socket() -> PathBuf {
    PathBuf::from("/run/lockstep/bird/bird.ctl")
}

fn default_bird_config() -> PathBuf {
    PathBuf::from("/run/lockstep/bird/bird.conf")
}

fn default_bfd_interval() -> Duration {
    Duration::from_millis(100)
}

fn default_bfd_multiplier() -> u8 {
    3
}

fn default_withdraw_after() -> Duration {
    Duration::from_secs(15)
}

fn default_graceful_restart() -> Duration {
    Duration::from_secs(120)
}

/// A duration in whole seconds for a 16-bit field, or the field and why.
fn seconds(field: &str, d: Duration) -> Result<u16, (String, String)> {
    if d.subsec_nanos() != 0 {
        return Err((field.into(), "must be whole seconds".into()));
    }
    u16::try_from(d.as_secs()).map_err(|_| (field.into(), "must be at most 65535s".into()))
}

/// Parses `a:b` (two 16-bit numbers) or `a:b:c` (three 32-bit numbers).
fn numbers<T: std::str::FromStr>(text: &str, count: usize) -> Option<Vec<T>> {
    let parts: Vec<&str> = text.split(':').collect();
    if parts.len() != count {
        return None;
    }
    parts.iter().map(|p| p.parse().ok()).collect()
}

impl BgpConfig {
    /// The core's spec of this section.
    ///
    /// # Errors
    /// (field, reason) of the first bad value, as the config names it.
    pub fn spec(&self) -> Result<BgpSpec, (String, String)> {
        let router_id = self.router_id.ok_or_else(|| {
            (
                "bgp.router_id".to_string(),
                "is not set, and no Node's IPv4 InternalIP stands in for it".to_string(),
            )
        })?;
        self.spec_with(router_id)
    }

    /// The spec with `router_id` (for checks made before the Node is
    /// read, and under Kubernetes a Node's annotation).
    ///
    /// # Errors
    /// As [`BgpConfig::spec`].
    pub fn spec_with(&self, router_id: Ipv4Addr) -> Result<BgpSpec, (String, String)> {
        let interval_ms = u32::try_from(self.bfd_interval.as_millis())
            .map_err(|_| ("bgp.bfd_interval".to_string(), "is too long".to_string()))?;
        let mut peers = Vec::new();
        for (i, p) in self.peers.iter().enumerate() {
            peers.push(PeerSpec {
                name: p.name.clone(),
                address: p.address,
                asn: p.asn,
                source: p.source,
                bfd: p.bfd,
                hold_time_s: seconds(&format!("bgp.peers[{i}].hold_time"), p.hold_time)?,
            });
        }
        let spec = BgpSpec {
            asn: self.asn,
            router_id,
            peers,
            bfd: BfdSpec {
                interval_ms,
                multiplier: self.bfd_multiplier,
            },
            graceful_restart_s: seconds("bgp.graceful_restart", self.graceful_restart)?,
        };
        lockstep_core::bgp::check(&spec).map_err(|BgpError::Invalid { field, reason }| {
            // The core's names, in this section's words.
            let field = field
                .replace("bfd.interval_ms", "bfd_interval")
                .replace("bfd.multiplier", "bfd_multiplier")
                .replace("graceful_restart_s", "graceful_restart")
                .replace("hold_time_s", "hold_time");
            (format!("bgp.{field}"), reason)
        })?;
        Ok(spec)
    }

    /// Each pool's route attributes.
    ///
    /// # Errors
    /// (field, reason) of the first community that does not read.
    pub fn attrs(&self) -> Result<BTreeMap<String, RouteAttrs>, (String, String)> {
        let mut out = BTreeMap::new();
        for (name, p) in &self.pools {
            let mut a = RouteAttrs {
                local_pref: p.local_pref,
                ..RouteAttrs::default()
            };
            for c in &p.communities {
                let n: Vec<u16> = numbers(c, 2).ok_or_else(|| {
                    (
                        format!("bgp.pools.{name}.communities"),
                        format!("{c:?} is not AS:value (each 0 to 65535)"),
                    )
                })?;
                a.communities.insert((n[0], n[1]));
            }
            for c in &p.large_communities {
                let n: Vec<u32> = numbers(c, 3).ok_or_else(|| {
                    (
                        format!("bgp.pools.{name}.large_communities"),
                        format!("{c:?} is not global:local1:local2 (each 0 to 4294967295)"),
                    )
                })?;
                a.large_communities.insert((n[0], n[1], n[2]));
            }
            out.insert(name.clone(), a);
        }
        Ok(out)
    }

    /// Checks the section: (field, reason) of the first bad value.
    ///
    /// # Errors
    /// As [`BgpConfig::spec`] and [`BgpConfig::attrs`].
    pub fn validate(&self) -> Result<(), (String, String)> {
        // Without a router ID (Kubernetes reads it from the Node at
        // start; `Config::problems` refuses its absence elsewhere), every
        // other field is checked with a stand-in.
        self.spec_with(self.router_id.unwrap_or(Ipv4Addr::new(192, 0, 2, 1)))?;
        self.attrs()?;
        if !(Duration::from_secs(2)..=Duration::from_secs(3600)).contains(&self.withdraw_after) {
            return Err((
                "bgp.withdraw_after".into(),
                "must be between 2s and 1h (the agent beats every second)".into(),
            ));
        }
        Ok(())
    }

    /// The file the agent beats into and `lockstep bird-keeper` watches:
    /// `lockstep.beat` beside `bird_config` (the directory both share).
    #[must_use]
    pub fn beat_path(&self) -> PathBuf {
        self.bird_config.with_file_name("lockstep.beat")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> BgpConfig {
        toml::from_str(text).unwrap()
    }

    #[test]
    fn a_small_section_takes_the_defaults() {
        let c = parse(
            "asn = 64512\nrouter_id = \"192.0.2.1\"\n[[peers]]\nname = \"tor\"\naddress = \"192.0.2.254\"\nasn = 64513\n",
        );
        let s = c.spec().unwrap();
        assert_eq!(s.bfd, BfdSpec::default());
        assert_eq!(s.graceful_restart_s, 120);
        assert!(s.peers[0].bfd);
        assert_eq!(s.peers[0].hold_time_s, 90);
        assert_eq!(c.bird_socket, PathBuf::from("/run/lockstep/bird/bird.ctl"));
    }

    #[test]
    fn every_bad_value_is_named_in_the_sections_words() {
        let base = "asn = 64512\nrouter_id = \"192.0.2.1\"\n";
        for (extra, field) in [
            ("bfd_interval = \"5ms\"\n", "bgp.bfd_interval"),
            ("bfd_multiplier = 0\n", "bgp.bfd_multiplier"),
            ("graceful_restart = \"1500ms\"\n", "bgp.graceful_restart"),
            ("graceful_restart = \"2h\"\n", "bgp.graceful_restart"),
            (
                "[[peers]]\nname = \"tor\"\naddress = \"192.0.2.254\"\nasn = 64513\nhold_time = \"2s\"\n",
                "bgp.peers[0].hold_time",
            ),
            (
                "[[peers]]\nname = \"9\"\naddress = \"192.0.2.254\"\nasn = 64513\n",
                "bgp.peers[0].name",
            ),
            (
                "[pools.public]\ncommunities = [\"64512\"]\n",
                "bgp.pools.public.communities",
            ),
            (
                "[pools.public]\nlarge_communities = [\"1:2\"]\n",
                "bgp.pools.public.large_communities",
            ),
        ] {
            let (got, reason) = parse(&format!("{base}{extra}")).validate().unwrap_err();
            assert_eq!(got, field, "{extra}: {reason}");
        }
        let (got, _) = parse("asn = 0\nrouter_id = \"192.0.2.1\"\n")
            .validate()
            .unwrap_err();
        assert_eq!(got, "bgp.asn");
    }

    #[test]
    fn pool_attributes_read() {
        let c = parse(
            "asn = 64512\nrouter_id = \"192.0.2.1\"\n[pools.public]\ncommunities = [\"64512:100\"]\nlarge_communities = [\"64512:1:2\"]\nlocal_pref = 200\n",
        );
        let a = &c.attrs().unwrap()["public"];
        assert_eq!(a.communities, [(64512, 100)].into());
        assert_eq!(a.large_communities, [(64512, 1, 2)].into());
        assert_eq!(a.local_pref, Some(200));
    }
}
