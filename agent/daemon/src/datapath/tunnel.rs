//! The agent's side of TUNNEL_CONFIG: which tunnel device and VNI the
//! programs encapsulate with and accept (docs/cluster.md, "Routing
//! modes"). The device itself is the netlink door's
//! (`Netlink::ensure_tunnel`).

use lockstep_common::{TunnelConfig, map_names};

use super::DatapathError;
use super::maps::PinnedMaps;

fn err(action: &'static str) -> impl Fn(aya::maps::MapError) -> DatapathError {
    move |e| DatapathError::MapAccess {
        action,
        map: map_names::TUNNEL_CONFIG,
        source: Box::new(e),
    }
}

impl PinnedMaps {
    /// Writes TUNNEL_CONFIG (key 0), read by the programs per packet; all
    /// zero turns encapsulation off (packets to `ENCAP` blocks drop,
    /// counted).
    ///
    /// # Errors
    /// The write was refused.
    pub fn set_tunnel_config(&mut self, config: TunnelConfig) -> Result<(), DatapathError> {
        self.tunnel_config_mut()
            .set(0, config, 0)
            .map_err(err("write"))
    }

    /// Reads TUNNEL_CONFIG (key 0).
    ///
    /// # Errors
    /// The read was refused.
    pub fn read_tunnel_config(&self) -> Result<TunnelConfig, DatapathError> {
        self.tunnel_config().get(&0, 0).map_err(err("read"))
    }
}
