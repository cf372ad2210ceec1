//! How the store's operations are written into a log record, and read back.
//!
//! Why its own format and not JSON: a record is written on every commit (a
//! CNI ADD's path), so it is a flat byte layout with length prefixes, and
//! decoding refuses anything that does not parse whole instead of guessing.

use super::StoreError;

/// A table of JSON records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Table {
    Allocations = 1,
    Endpoints = 2,
    Lb = 3,
    Delegated = 4,
}

impl Table {
    fn from_byte(b: u8) -> Option<Self> {
        [
            Table::Allocations,
            Table::Endpoints,
            Table::Lb,
            Table::Delegated,
        ]
        .into_iter()
        .find(|t| *t as u8 == b)
    }
}

/// One change to the database, as the log records it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Op {
    /// Insert or replace a record.
    Put {
        table: Table,
        key: String,
        value: Vec<u8>,
    },
    /// Remove a record; absent is fine.
    Remove { table: Table, key: String },
    /// Raise the generation high-water mark (it never goes down).
    Generation(u64),
}

const OP_PUT: u8 = 1;
const OP_REMOVE: u8 = 2;
const OP_GENERATION: u8 = 3;

/// Encodes operations as a log payload: per operation a tag byte, then the
/// table byte and length-prefixed (u32 LE) key and value, or the generation
/// (u64 LE).
pub(super) fn encode(ops: &[Op]) -> Vec<u8> {
    let mut out = Vec::with_capacity(512);
    let bytes = |out: &mut Vec<u8>, b: &[u8]| {
        out.extend_from_slice(&(b.len() as u32).to_le_bytes());
        out.extend_from_slice(b);
    };
    for op in ops {
        match op {
            Op::Put { table, key, value } => {
                out.extend_from_slice(&[OP_PUT, *table as u8]);
                bytes(&mut out, key.as_bytes());
                bytes(&mut out, value);
            }
            Op::Remove { table, key } => {
                out.extend_from_slice(&[OP_REMOVE, *table as u8]);
                bytes(&mut out, key.as_bytes());
            }
            Op::Generation(g) => {
                out.push(OP_GENERATION);
                out.extend_from_slice(&g.to_le_bytes());
            }
        }
    }
    out
}

/// Decodes a log payload written by [`encode`].
pub(super) fn decode_ops(seq: u64, mut data: &[u8]) -> Result<Vec<Op>, StoreError> {
    let bad = |reason| StoreError::LogRecord { seq, reason };
    fn take<'a>(data: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        let (head, rest) = data.split_at_checked(n)?;
        *data = rest;
        Some(head)
    }
    fn sized<'a>(data: &mut &'a [u8]) -> Option<&'a [u8]> {
        let len = u32::from_le_bytes(take(data, 4)?.try_into().ok()?);
        take(data, len as usize)
    }
    let mut ops = Vec::new();
    while let Some(tag) = take(&mut data, 1) {
        let op = match tag[0] {
            OP_GENERATION => {
                let g = take(&mut data, 8).ok_or_else(|| bad("truncated generation"))?;
                Op::Generation(u64::from_le_bytes(g.try_into().expect("8 bytes")))
            }
            t @ (OP_PUT | OP_REMOVE) => {
                let table = take(&mut data, 1)
                    .and_then(|b| Table::from_byte(b[0]))
                    .ok_or_else(|| bad("unknown table"))?;
                let key = sized(&mut data).ok_or_else(|| bad("truncated key"))?;
                let key = std::str::from_utf8(key)
                    .map_err(|_| bad("key is not UTF-8"))?
                    .to_string();
                if t == OP_PUT {
                    let value = sized(&mut data).ok_or_else(|| bad("truncated value"))?;
                    Op::Put {
                        table,
                        key,
                        value: value.to_vec(),
                    }
                } else {
                    Op::Remove { table, key }
                }
            }
            _ => return Err(bad("unknown operation")),
        };
        ops.push(op);
    }
    Ok(ops)
}

/// The operations that move attachment records (endpoints, delegated) from
/// the key earlier versions stored them under — the container ID and
/// interface name joined by `\u{1f}`, ambiguous when either holds a control
/// character — to [`endpoint_key`](super::endpoint_key). Records of valid
/// attachments have the same key in both and do not move; after one commit
/// of these, nothing does.
///
/// # Errors
/// A record does not encode (cannot happen for records just decoded).
pub(super) fn key_moves(
    endpoints: &[super::EndpointRecord],
    delegated: &[super::DelegatedRecord],
) -> Result<Vec<Op>, StoreError> {
    use lockstep_core::owner::legacy_attachment_key;
    let mut removes = Vec::new();
    let mut puts = Vec::new();
    let mut one = |table, id: &str, ifname: &str, key: String, value: Vec<u8>| {
        let legacy = legacy_attachment_key(id, ifname);
        if legacy != key {
            removes.push(Op::Remove { table, key: legacy });
            puts.push(Op::Put { table, key, value });
        }
    };
    for e in endpoints {
        let value = super::to_json(|| e.key(), e)?;
        one(Table::Endpoints, &e.container_id, &e.ifname, e.key(), value);
    }
    for d in delegated {
        let value = super::to_json(|| d.key(), d)?;
        one(Table::Delegated, &d.container_id, &d.ifname, d.key(), value);
    }
    // Every old key goes before any record is put under its new key (which
    // may be another moved record's old one).
    removes.extend(puts);
    Ok(removes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_payloads_round_trip_and_garbage_is_refused() {
        let ops = vec![
            Op::Put {
                table: Table::Endpoints,
                key: "c1\u{1f}eth0".into(),
                value: b"{\"a\":1}".to_vec(),
            },
            Op::Remove {
                table: Table::Allocations,
                key: String::new(),
            },
            Op::Generation(u64::MAX),
            Op::Put {
                table: Table::Lb,
                key: "state".into(),
                value: Vec::new(),
            },
        ];
        assert_eq!(decode_ops(1, &encode(&ops)).expect("decode"), ops);
        let bytes = encode(&ops);
        for cut in 1..bytes.len() {
            // Every truncation inside an operation is refused, never misread.
            if let Ok(got) = decode_ops(1, &bytes[..cut]) {
                assert!(ops.starts_with(&got), "cut {cut}: {got:?}");
            }
        }
        for bad in [
            &[9u8][..],
            &[OP_PUT, 9],
            &[OP_REMOVE, 1, 2, 0, 0, 0, 0xff, 0xfe],
        ] {
            let err = decode_ops(7, bad).expect_err("garbage");
            assert!(err.to_string().contains("record 7"), "{err}");
        }
    }

    fn endpoint(id: &str, ifname: &str, last: u8) -> super::super::EndpointRecord {
        serde_json::from_value(serde_json::json!({
            "container_id": id,
            "ifname": ifname,
            "netns": "/run/netns/x",
            "mode": "ipam",
            "pool": "default",
            "addresses": [format!("10.0.0.{last}")],
            "host_ifname": null,
            "host_ifindex": 0,
            "host_mac": [0, 0, 0, 0, 0, 0],
            "mac": [0, 0, 0, 0, 0, 0],
        }))
        .expect("an endpoint record")
    }

    /// A store written by an earlier version (records under the joined key)
    /// is read whole, its ambiguous keys move once, and a record found by
    /// its new key is removed by it.
    #[test]
    fn records_under_the_old_joined_key_move_on_load() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let store = super::super::Store::open(&tmp.path().join("state")).expect("open");
        let legacy = [
            endpoint("c1", "eth0", 1),
            endpoint("a\u{1f}b", "c", 2),
            endpoint("\u{1e}1:", "x", 3),
            endpoint("\u{1f}", "x", 4),
        ];
        let ops = legacy
            .iter()
            .map(|e| Op::Put {
                table: Table::Endpoints,
                key: lockstep_core::owner::legacy_attachment_key(&e.container_id, &e.ifname),
                value: serde_json::to_vec(e).expect("json"),
            })
            .collect();
        store.commit(ops).expect("old-format commit");
        let sorted = |mut v: Vec<super::super::EndpointRecord>| {
            v.sort_by_key(|e| e.addresses.clone());
            v
        };
        assert_eq!(
            sorted(store.load().expect("load").endpoints),
            legacy.to_vec()
        );
        for e in &legacy {
            store.remove_endpoint(Some(&e.key()), &[]).expect("remove");
        }
        assert!(
            store.load().expect("load").endpoints.is_empty(),
            "every record removed by its key"
        );
    }

    /// The reviewer's pair: two attachments whose parts joined by the old
    /// separator read the same are two records.
    #[test]
    fn attachments_that_joined_alike_are_two_records() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let store = super::super::Store::open(&tmp.path().join("state")).expect("open");
        let first = endpoint("a\u{1f}b", "c", 1);
        let second = endpoint("a", "b\u{1f}c", 2);
        for e in [&first, &second] {
            let high = lockstep_core::owner::Generation(0);
            store.put_endpoint(Some(e), &[], high).expect("put");
        }
        let mut got = store.load().expect("load").endpoints;
        got.sort_by_key(|e| e.addresses.clone());
        assert_eq!(got, vec![first.clone(), second.clone()]);
        store
            .remove_endpoint(Some(&second.key()), &[])
            .expect("remove");
        assert_eq!(store.load().expect("load").endpoints, vec![first]);
    }
}
