//! Keys and values read back from etcd, or why they cannot be read.

use ipnet::IpNet;
use lockstep_core::cluster::ClusterPoolSpec;
use lockstep_core::cluster::{key_name_problem, node_addresses_problem};

use super::super::{
    Block, BlockRecord, NodeAddrRecord, NodeRecord, ReservedRecord, Unreadable, unescape,
};

/// A block key and value, or why they cannot be read (with the block
/// when the key names one).
pub(super) fn parse_block(
    prefix: &str,
    key: &str,
    value: &[u8],
    revision: i64,
) -> Result<Block, Unreadable> {
    let unreadable = |reason: String, block: Option<IpNet>| Unreadable {
        key: key.to_string(),
        reason,
        block,
    };
    let (pool, cidr) = block_key_name(prefix, key).map_err(|why| unreadable(why, None))?;
    let rec: BlockRecord =
        serde_json::from_slice(value).map_err(|e| unreadable(format!("value: {e}"), Some(cidr)))?;
    Ok(Block {
        pool,
        cidr,
        node: rec.node,
        instance: rec.instance,
        revision,
    })
}

/// The pool and prefix a block key names, or why it names none.
pub(super) fn block_key_name(prefix: &str, key: &str) -> Result<(String, IpNet), String> {
    let rest = key.strip_prefix(prefix).unwrap_or(key);
    let Some((pool, cidr)) = rest.split_once('/') else {
        return Err("not blocks/<pool>/<cidr>".into());
    };
    if let Some(why) = key_name_problem(pool) {
        return Err(format!("pool name {pool:?}: {why}"));
    }
    let Some(cidr) = unescape(cidr) else {
        return Err(format!(
            "{cidr:?} is not a block (<address>-<prefix length>, canonical)"
        ));
    };
    Ok((pool.to_string(), cidr))
}

/// A key whose last segment is a name, and its JSON value, which must
/// carry that same name (`name_of`): the value, or why it cannot be read.
/// `what` names the kind ("pool", "node"); `holds` says what the value
/// holds when the names differ.
pub(super) fn parse_named<T: serde::de::DeserializeOwned>(
    (what, holds): (&str, &str),
    prefix: &str,
    key: &str,
    value: &[u8],
    name_of: fn(&T) -> &str,
) -> Result<T, String> {
    let name = key.strip_prefix(prefix).unwrap_or(key);
    if let Some(why) = key_name_problem(name) {
        return Err(format!("{what} name {name:?}: {why}"));
    }
    let v: T = serde_json::from_slice(value).map_err(|e| format!("value: {e}"))?;
    if name_of(&v) != name {
        return Err(format!(
            "holds {holds} {:?} under the key of {what} {name:?}",
            name_of(&v)
        ));
    }
    Ok(v)
}

/// A pool key and value, or why they cannot be read: the key's name must
/// be a usable name and the value a pool of that name.
pub(super) fn parse_pool(prefix: &str, key: &str, value: &[u8]) -> Result<ClusterPoolSpec, String> {
    parse_named(
        ("pool", "pool"),
        prefix,
        key,
        value,
        |p: &ClusterPoolSpec| p.name.as_str(),
    )
}

/// The default pool key's value (a JSON string naming a usable pool
/// name), or why it cannot be read.
pub(super) fn parse_default(value: &[u8]) -> Result<String, String> {
    let name: String = serde_json::from_slice(value).map_err(|e| format!("value: {e}"))?;
    match key_name_problem(&name) {
        Some(why) => Err(format!("pool name {name:?}: {why}")),
        None => Ok(name),
    }
}

/// A node key and record, or why they cannot be read.
pub(super) fn parse_node(prefix: &str, key: &str, value: &[u8]) -> Result<NodeRecord, String> {
    parse_named(("node", "node"), prefix, key, value, |r: &NodeRecord| {
        r.name.as_str()
    })
}

/// A routing key and record, or why they cannot be read: the key's name
/// must be a usable name and the record's, its addresses ones a route can
/// go via.
pub(in crate::cluster) fn parse_node_addr(
    prefix: &str,
    key: &str,
    value: &[u8],
) -> Result<NodeAddrRecord, String> {
    let record = parse_named(
        ("node", "the addresses of node"),
        prefix,
        key,
        value,
        |r: &NodeAddrRecord| r.name.as_str(),
    )?;
    if let Some(why) = node_addresses_problem(&record.ips) {
        return Err(format!("ips: {why}"));
    }
    Ok(record)
}

/// A reservation key (`reserved/<node>`) and record, or why they cannot be
/// read.
pub(super) fn parse_reserved(
    prefix: &str,
    key: &str,
    value: &[u8],
) -> Result<ReservedRecord, String> {
    parse_named(
        ("node", "the reserved addresses of node"),
        prefix,
        key,
        value,
        |r: &ReservedRecord| r.name.as_str(),
    )
}
