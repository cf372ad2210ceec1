//! The node's underlay addresses, which the other nodes route its blocks
//! to: configured, or found on the uplink.

use std::net::IpAddr;

use crate::config::{ClusterConfig, Config};

/// The node's addresses: configured, else the uplink's first global ones.
///
/// # Errors
/// Neither configured nor found on the uplink, naming the field.
pub(crate) fn node_ips(config: &Config, cluster: &ClusterConfig) -> Result<Vec<IpAddr>, String> {
    let mut ips: Vec<IpAddr> = Vec::new();
    ips.extend(cluster.node_ip_v4.map(IpAddr::V4));
    ips.extend(cluster.node_ip_v6.map(IpAddr::V6));
    if !ips.is_empty() {
        return Ok(ips);
    }
    let Some(uplink) = &config.datapath.uplink else {
        return Err("cluster.node_ip_v4: not set and no datapath.uplink to take it from".into());
    };
    let nl = crate::netlink::Netlink::current().map_err(|e| e.to_string())?;
    let link = nl
        .link(uplink)
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("cluster.node_ip_v4: uplink {uplink} does not exist"))?;
    for net in nl.addresses(link.index).map_err(|e| e.to_string())? {
        let a = net.addr();
        let global = match a {
            IpAddr::V4(v) => !v.is_loopback() && !v.is_link_local(),
            IpAddr::V6(v) => !v.is_loopback() && !v.is_unicast_link_local(),
        };
        if global && !ips.iter().any(|i| i.is_ipv4() == a.is_ipv4()) {
            ips.push(a);
        }
    }
    if ips.is_empty() {
        return Err(format!(
            "cluster.node_ip_v4: uplink {uplink} has no global address; set node_ip_v4 or node_ip_v6"
        ));
    }
    Ok(ips)
}
