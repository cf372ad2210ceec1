//! `lockstep maps dump`: every pinned map decoded into JSON or text.
//!
//! Kept apart because the decoding (flag names, slot arrays, counters) is
//! the one place that knows how each map's entries read to a person, and it
//! works on the pins directly, without the agent.

use std::net::{Ipv4Addr, Ipv6Addr};

use clap::Subcommand;
use lockstep_common::{
    EndpointSlot, IpcacheValue, L2RespSlot, L2RespSlotV6, endpoint_flags, ipcache_flags,
    masq_flags, nat_state, slots,
};
use serde_json::json;

use super::datapath::fmt_mac;
use super::{Output, PinArgs};
use crate::datapath::PinnedMaps;

/// `lockstep maps ...`.
#[derive(Debug, Subcommand)]
pub enum MapsCommand {
    /// Decode and print every pinned map; works while the agent is down.
    Dump {
        /// Shared options.
        #[command(flatten)]
        pins: PinArgs,
        /// Output format.
        #[arg(long, short, value_enum, default_value_t)]
        output: Output,
    },
}

fn nat_state_names(state: u8) -> Vec<&'static str> {
    [
        (nat_state::FIN_OUT, "fin_out"),
        (nat_state::FIN_IN, "fin_in"),
        (nat_state::RST, "rst"),
        (nat_state::REPLIED, "replied"),
        (nat_state::ACKED, "acked"),
    ]
    .into_iter()
    .filter(|(bit, _)| state & bit != 0)
    .map(|(_, name)| name)
    .collect()
}

/// One NAT map entry as JSON: the key's tuple, the value's address and port.
fn nat_entry(
    (src, dst, sport, dport, proto): (String, String, u16, u16, u8),
    (addr, port, last_seen_ns, state): (String, u16, u64, u8),
) -> serde_json::Value {
    json!({
        "proto": proto,
        "src": src,
        "dst": dst,
        "src_port": sport,
        "dst_port": dport,
        "to_addr": addr,
        "to_port": port,
        "last_seen_ns": last_seen_ns,
        "state": nat_state_names(state),
    })
}

/// NAT_FWD_*, NAT_REV_* and MASQ_CONFIG decoded.
fn dump_nat(maps: &PinnedMaps) -> anyhow::Result<Vec<(&'static str, serde_json::Value)>> {
    let v4 =
        |map: &aya::maps::HashMap<_, lockstep_common::NatKeyV4, lockstep_common::NatValueV4>| {
            map.iter()
                .map(|item| {
                    let (k, v) = item?;
                    Ok(nat_entry(
                        (
                            Ipv4Addr::from(k.src_addr).to_string(),
                            Ipv4Addr::from(k.dst_addr).to_string(),
                            k.src_port,
                            k.dst_port,
                            k.proto,
                        ),
                        (
                            Ipv4Addr::from(v.addr).to_string(),
                            v.port,
                            v.last_seen_ns,
                            v.state,
                        ),
                    ))
                })
                .collect::<anyhow::Result<Vec<_>>>()
        };
    let v6 =
        |map: &aya::maps::HashMap<_, lockstep_common::NatKeyV6, lockstep_common::NatValueV6>| {
            map.iter()
                .map(|item| {
                    let (k, v) = item?;
                    Ok(nat_entry(
                        (
                            Ipv6Addr::from(k.src_addr).to_string(),
                            Ipv6Addr::from(k.dst_addr).to_string(),
                            k.src_port,
                            k.dst_port,
                            k.proto,
                        ),
                        (
                            Ipv6Addr::from(v.addr).to_string(),
                            v.port,
                            v.last_seen_ns,
                            v.state,
                        ),
                    ))
                })
                .collect::<anyhow::Result<Vec<_>>>()
        };
    let cfg = maps.masq_config().get(&0, 0)?;
    let families: Vec<&str> = [
        (masq_flags::ENABLED_V4, "ipv4"),
        (masq_flags::ENABLED_V6, "ipv6"),
    ]
    .into_iter()
    .filter(|(bit, _)| cfg.flags & bit != 0)
    .map(|(_, name)| name)
    .collect();
    Ok(vec![
        ("NAT_FWD_V4", json!(v4(maps.nat_fwd_v4())?)),
        ("NAT_FWD_V6", json!(v6(maps.nat_fwd_v6())?)),
        ("NAT_REV_V4", json!(v4(maps.nat_rev_v4())?)),
        ("NAT_REV_V6", json!(v6(maps.nat_rev_v6())?)),
        (
            "MASQ_CONFIG",
            json!({
                "enabled": families,
                "node_v4": Ipv4Addr::from(cfg.node_v4).to_string(),
                "node_v6": Ipv6Addr::from(cfg.node_v6).to_string(),
                "port_min": cfg.port_min,
                "port_max": cfg.port_max,
                "reply_ports": format!("{}-{}", cfg.reply_ports().0, cfg.reply_ports().1),
            }),
        ),
    ])
}

fn flag_names(flags: u32) -> Vec<&'static str> {
    [
        (ipcache_flags::ENDPOINT, "endpoint"),
        (ipcache_flags::INGRESS, "ingress"),
        (ipcache_flags::HEALTH, "health"),
        (ipcache_flags::ROUTER, "router"),
        (ipcache_flags::LOADBALANCER, "loadbalancer"),
        (ipcache_flags::HOST, "host"),
        (ipcache_flags::REMOTE, "remote"),
    ]
    .into_iter()
    .filter(|(bit, _)| flags & bit != 0)
    .map(|(_, name)| name)
    .collect()
}

/// Decodes every map into JSON.
///
/// # Errors
/// A map could not be read.
pub fn dump_maps(maps: &PinnedMaps) -> anyhow::Result<serde_json::Value> {
    let ipcache = |prefix: String, v: &IpcacheValue| {
        json!({
            "prefix": prefix,
            "identity": v.identity,
            "flags": flag_names(v.flags),
            "ifindex": v.ifindex,
        })
    };
    let mut ipcache_v4 = Vec::new();
    let mut ipcache_v6 = Vec::new();
    for (prefix, v) in maps.ipcache_entries()? {
        let entry = ipcache(prefix.to_string(), &v);
        match prefix {
            ipnet::IpNet::V4(_) => ipcache_v4.push(entry),
            ipnet::IpNet::V6(_) => ipcache_v6.push(entry),
        }
    }
    let mut masq = Vec::new();
    for item in maps.masq_skip_v4().iter() {
        let (k, v) = item?;
        masq.push(json!({"cidr": format!("{}/{}", Ipv4Addr::from(k.data()), k.prefix_len()), "reason": v.reason, "pool_id": v.pool_id}));
    }
    for item in maps.masq_skip_v6().iter() {
        let (k, v) = item?;
        masq.push(json!({"cidr": format!("{}/{}", Ipv6Addr::from(k.data()), k.prefix_len()), "reason": v.reason, "pool_id": v.pool_id}));
    }
    let mut endpoints = Vec::new();
    for item in maps.endpoints().iter() {
        let (ifindex, v) = item?;
        endpoints.push(json!({
            "ifindex": ifindex,
            "ipv4": (v.flags & endpoint_flags::HAS_V4 != 0).then(|| Ipv4Addr::from(v.ipv4).to_string()),
            "ipv6": (v.flags & endpoint_flags::HAS_V6 != 0).then(|| Ipv6Addr::from(v.ipv6).to_string()),
            "mac": fmt_mac(&v.mac),
            "generation": v.generation,
            "sealed": v.is_sealed(ifindex),
        }));
    }
    let mut l2 = Vec::new();
    for item in maps.l2_resp_v4().iter() {
        let (addr, v) = item?;
        l2.push(json!({"address": Ipv4Addr::from(addr).to_string(), "ifindex": v.ifindex, "mac": fmt_mac(&v.mac), "expires_ns": v.expires_ns, "sealed": v.is_sealed(addr)}));
    }
    let mut l2_v6 = Vec::new();
    for item in maps.l2_resp_v6().iter() {
        let (addr, v) = item?;
        l2_v6.push(json!({"address": Ipv6Addr::from(addr).to_string(), "ifindex": v.ifindex, "mac": fmt_mac(&v.mac), "expires_ns": v.expires_ns, "sealed": v.is_sealed_v6(addr)}));
    }
    // Slot arrays: only the slots that hold something.
    let mut endpoint_slots = Vec::new();
    for item in maps.endpoint_slots().iter() {
        let s = item?;
        if s != EndpointSlot::default() {
            endpoint_slots.push(json!({"slot": slots::endpoint(s.ifindex), "ifindex": s.ifindex, "ipv4": Ipv4Addr::from(s.ipv4).to_string(), "ipv6": Ipv6Addr::from(s.ipv6).to_string(), "flags": s.flags}));
        }
    }
    let mut l2_slots = Vec::new();
    for item in maps.l2_resp_slots().iter() {
        let s = item?;
        if s != L2RespSlot::default() {
            l2_slots.push(json!({"slot": slots::l2_resp(s.addr), "address": Ipv4Addr::from(s.addr).to_string(), "ifindex": s.ifindex, "mac": fmt_mac(&s.mac)}));
        }
    }
    let mut l2_v6_slots = Vec::new();
    for item in maps.l2_resp6_slots().iter() {
        let s = item?;
        if s != L2RespSlotV6::default() {
            l2_v6_slots.push(json!({"slot": slots::l2_resp_v6(s.addr), "address": Ipv6Addr::from(s.addr).to_string(), "ifindex": s.ifindex, "mac": fmt_mac(&s.mac)}));
        }
    }
    let counters: serde_json::Map<String, serde_json::Value> = maps
        .counters()?
        .into_iter()
        .map(|(c, v)| (c.name().to_string(), json!(v)))
        .collect();
    let mut out = json!({
        "IPCACHE_V4": ipcache_v4,
        "IPCACHE_V6": ipcache_v6,
        "MASQ_SKIP": masq,
        "ENDPOINTS": endpoints,
        "L2_RESP_V4": l2,
        "L2_RESP_V6": l2_v6,
        "ENDPOINT_SLOTS": endpoint_slots,
        "L2_RESP_SLOTS": l2_slots,
        "L2_RESP6_SLOTS": l2_v6_slots,
        "COUNTERS": counters,
    });
    if let Some(obj) = out.as_object_mut() {
        for (name, value) in dump_nat(maps)? {
            obj.insert(name.to_string(), value);
        }
    }
    Ok(out)
}

/// Prints a [`dump_maps`] result as text.
pub(super) fn print_dump_text(dump: &serde_json::Value) {
    if let Some(obj) = dump.as_object() {
        for (name, value) in obj {
            println!("{name}:");
            match value {
                serde_json::Value::Array(items) if items.is_empty() => println!("  (empty)"),
                serde_json::Value::Array(items) => {
                    for item in items {
                        println!("  {item}");
                    }
                }
                other => println!("  {other}"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_decode_by_name() {
        assert_eq!(
            flag_names(ipcache_flags::ENDPOINT | ipcache_flags::LOADBALANCER),
            vec!["endpoint", "loadbalancer"]
        );
        assert!(flag_names(0).is_empty());
    }
}
