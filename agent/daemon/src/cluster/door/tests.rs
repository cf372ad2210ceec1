//! Unit tests of the door that need no etcd.

use std::path::{Path, PathBuf};

use super::failure::refused_code;
use super::parse::{parse_block, parse_node, parse_pool};
use super::*;

#[test]
fn a_connection_broken_under_a_request_may_be_tried_again() {
    // What tonic reported when a member stopped under a request in
    // flight (CI, cluster_failures): code Unknown, "transport error",
    // the I/O error two sources down.
    #[derive(Debug)]
    struct Transport(std::io::Error);
    impl std::fmt::Display for Transport {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("transport error")
        }
    }
    impl std::error::Error for Transport {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }
    let broken = std::io::Error::new(
        std::io::ErrorKind::BrokenPipe,
        "stream closed because of a broken pipe",
    );
    let status = tonic::Status::from_error(Box::new(Transport(broken)));
    assert_eq!(status.code(), tonic::Code::Unknown);
    let e = etcd_client::Error::GRpcStatus(status);
    assert!(transient(&e), "{e}");
    // Not a write that never left the node: it may have been sent.
    assert!(!never_sent(&e), "{e}");
    // Unknown from etcd itself, without a broken connection, is an
    // answer and is not tried again.
    let answered = etcd_client::Error::GRpcStatus(tonic::Status::unknown("boom"));
    assert!(!transient(&answered));
    let unavailable = etcd_client::Error::GRpcStatus(tonic::Status::unavailable("no leader"));
    assert!(transient(&unavailable));
}

#[test]
fn a_refusal_is_told_from_an_unknown_outcome() {
    // Refused outright: invalid argument (too many operations in a
    // txn, request too large), not found, already exists, permission
    // denied, resource exhausted (space quota), failed precondition,
    // out of range, unauthenticated.
    for code in [3, 5, 6, 7, 8, 9, 11, 16] {
        assert!(refused_code(code), "{code}");
    }
    // Outcome unknown: cancelled, unknown, deadline, aborted,
    // unimplemented, internal, unavailable, data loss.
    for code in [1, 2, 4, 10, 12, 13, 14, 15] {
        assert!(!refused_code(code), "{code}");
    }
    // The client's own errors (a lease etcd no longer knows) are not
    // refusals: keep_alive reads them as before.
    assert!(
        refusal(&etcd_client::Error::LeaseKeepAliveError(
            "lease not found".into()
        ))
        .is_none()
    );
}

#[test]
fn unreadable_keys_are_named_and_keep_the_block_they_name() {
    let p = "/x/blocks/";
    let ok = br#"{"node":"n1","claimed_at_ms":1}"#;
    let b = parse_block(p, "/x/blocks/pods/10.0.0.16-28", ok, 7).expect("readable");
    assert_eq!(
        (b.pool.as_str(), b.node.as_str(), b.revision),
        ("pods", "n1", 7)
    );
    // A pool name with a '/' (an older version's `team/a`): no block.
    let u = parse_block(p, "/x/blocks/team/a/10.0.0.0-28", ok, 1).unwrap_err();
    assert_eq!(u.block, None);
    assert!(u.reason.contains("is not a block"), "{}", u.reason);
    // A key that names a block, with a value this build cannot read:
    // the block is kept so no claim picks it.
    let u = parse_block(p, "/x/blocks/pods/10.0.0.16-28", b"garbage", 1).unwrap_err();
    assert_eq!(u.block, Some("10.0.0.16/28".parse().expect("net")));
    assert!(parse_block(p, "/x/blocks/pods/10.0.0.17-28", ok, 1).is_err());
    assert!(parse_block(p, "/x/blocks/a\u{7}b/10.0.0.16-28", ok, 1).is_err());
    // Pools and nodes: the key's name is checked and must be the
    // value's.
    let spec = br#"{"name":"pods","ipv4":["10.0.0.0/24"]}"#;
    assert!(parse_pool("/x/pools/", "/x/pools/pods", spec).is_ok());
    let e = parse_pool("/x/pools/", "/x/pools/other", spec).unwrap_err();
    assert!(e.contains("under the key of pool \"other\""), "{e}");
    let e = parse_pool(
        "/x/pools/",
        "/x/pools/team/a",
        br#"{"name":"team/a","ipv4":["10.0.0.0/24"]}"#,
    )
    .unwrap_err();
    assert!(e.contains("'/'"), "{e}");
    assert!(parse_node("/x/nodes/", "/x/nodes/n1", b"{}").is_err());
    // Routing keys: name, record and usable addresses; a field a
    // later version adds is ignored.
    let a = "/x/node_addrs/";
    let r = parse_node_addr(
        a,
        "/x/node_addrs/n1",
        br#"{"name":"n1","ips":["10.0.0.1","fd00::1"],"later":1}"#,
    )
    .expect("readable");
    assert_eq!(r.ips.len(), 2);
    let e = parse_node_addr(
        a,
        "/x/node_addrs/n2",
        br#"{"name":"n1","ips":["10.0.0.1"]}"#,
    )
    .unwrap_err();
    assert!(e.contains("under the key of node \"n2\""), "{e}");
    let e = parse_node_addr(a, "/x/node_addrs/n1", br#"{"name":"n1","ips":[]}"#).unwrap_err();
    assert!(e.contains("no address"), "{e}");
    let e =
        parse_node_addr(a, "/x/node_addrs/n1", br#"{"name":"n1","ips":["0.0.0.0"]}"#).unwrap_err();
    assert!(e.contains("0.0.0.0 is not a unicast address"), "{e}");
    assert!(parse_node_addr(a, "/x/node_addrs/n1", b"garbage").is_err());
    assert!(
        parse_node_addr(
            a,
            "/x/node_addrs/a/b",
            br#"{"name":"a/b","ips":["10.0.0.1"]}"#
        )
        .is_err()
    );
}

#[test]
fn options_from_the_cluster_section_carry_endpoints_prefix_tls_and_the_bound() {
    let text = "[cluster]\netcd = [\"https://e:1\", \"https://f:2\"]\nprefix = \"/x/\"\nnode_ip_v4 = \"192.0.2.1\"\n[cluster.tls]\nca = \"/ca.pem\"\ncert = \"/c.pem\"\nkey = \"/k.pem\"\n";
    let config = crate::config::Config::parse(Path::new("/c.toml"), text).expect("valid");
    let o = DoorOptions::from_cluster_config(
        config.cluster.as_ref().expect("cluster"),
        Duration::from_millis(600),
    );
    assert_eq!(o.endpoints, ["https://e:1", "https://f:2"]);
    assert_eq!(o.prefix, "/x/");
    assert_eq!(o.timeout, Duration::from_millis(600));
    assert_eq!(
        o.tls,
        Some(TlsFiles {
            ca: PathBuf::from("/ca.pem"),
            cert: Some(PathBuf::from("/c.pem")),
            key: Some(PathBuf::from("/k.pem")),
        })
    );
}
