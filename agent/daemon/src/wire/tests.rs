//! Round trips of the wire types, and the compatibility rules.

use super::*;

fn round_trip<T: Serialize + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug>(v: &T) {
    let text = serde_json::to_string(v).expect("serialize");
    let back: T = serde_json::from_str(&text).expect("deserialize");
    assert_eq!(&back, v, "{text}");
}

fn record() -> EndpointRecord {
    EndpointRecord {
        container_id: "c1".into(),
        ifname: "eth0".into(),
        netns: "/run/netns/x".into(),
        mode: EndpointMode::Full,
        pool: "default".into(),
        addresses: vec!["10.0.0.2".parse().unwrap(), "fd00::2".parse().unwrap()],
        host_ifname: Some("lxc0123".into()),
        host_ifindex: 7,
        host_mac: [2, 0, 0, 0, 0, 1],
        mac: [2, 0, 0, 0, 0, 2],
        releasing: false,
        pod: None,
    }
}

fn add_request() -> EndpointRequest {
    EndpointRequest {
        container_id: "c1".into(),
        ifname: "eth0".into(),
        netns: "/run/netns/x".into(),
        mode: EndpointMode::Ipam,
        pool: Some("blue".into()),
        requested: vec!["10.0.0.9".parse().unwrap()],
        mtu: Some(1400),
        pod: Some(lockstep_core::pods::PodRef {
            namespace: "shop".into(),
            name: "web-0".into(),
            uid: Some("u-1".into()),
        }),
    }
}

fn add_reply() -> EndpointReply {
    EndpointReply {
        record: record(),
        addresses: vec![EndpointAddress {
            address: "10.0.0.2/32".parse().unwrap(),
            gateway: Some("169.254.1.1".parse().unwrap()),
        }],
        routes: vec![
            (
                "0.0.0.0/0".parse().unwrap(),
                Some("169.254.1.1".parse().unwrap()),
            ),
            ("::/0".parse().unwrap(), None),
        ],
    }
}

#[test]
fn requests_round_trip() {
    round_trip(&add_request());
    round_trip(&EndpointRequest {
        pool: None,
        requested: vec![],
        mtu: None,
        ..add_request()
    });
    round_trip(&DelRequest {
        container_id: "c1".into(),
        ifname: "eth0".into(),
    });
    round_trip(&GcRequest {
        valid: vec![("c1".into(), "eth0".into()), ("c2".into(), "net1".into())],
    });
}

#[test]
fn replies_round_trip() {
    round_trip(&add_reply());
    round_trip(&GcReport {
        released: vec![("c3".into(), "eth0".into())],
    });
    round_trip(&ErrorReply {
        error: ErrorBody {
            code: "pool_exhausted".into(),
            message: "pool blue: no free address".into(),
        },
    });
    round_trip(&Empty {});
    round_trip(&Readiness {
        version: "0.1.0".into(),
        ready: false,
        reason: Some("restoring".into()),
        default_pool: None,
        cluster: None,
    });
}

#[test]
fn requests_refuse_unknown_fields() {
    let mut v = serde_json::to_value(add_request()).unwrap();
    v["colour"] = "red".into();
    let e = serde_json::from_value::<EndpointRequest>(v).unwrap_err();
    assert!(e.to_string().contains("colour"), "{e}");
    let e = serde_json::from_str::<DelRequest>(r#"{"container_id":"c","ifname":"i","x":1}"#)
        .unwrap_err();
    assert!(e.to_string().contains("unknown field `x`"), "{e}");
    let e = serde_json::from_str::<GcRequest>(r#"{"valid":[],"y":1}"#).unwrap_err();
    assert!(e.to_string().contains("unknown field `y`"), "{e}");
}

#[test]
fn replies_tolerate_new_top_level_fields_but_not_a_wrong_shape() {
    let mut v = serde_json::to_value(add_reply()).unwrap();
    v["from_a_newer_agent"] = 1.into();
    let back: EndpointReply = serde_json::from_value(v).expect("extra fields are ignored");
    assert_eq!(back, add_reply());
    // A malformed address, a missing record, a record of the wrong shape.
    for bad in [
        r#"{"record":null,"addresses":[],"routes":[]}"#,
        r#"{"addresses":[{"address":"10.0.0.300/32","gateway":null}],"routes":[]}"#,
    ] {
        assert!(serde_json::from_str::<EndpointReply>(bad).is_err(), "{bad}");
    }
    let mut v = serde_json::to_value(add_reply()).unwrap();
    v["record"]["host_mac"] = serde_json::json!([1, 2, 3, 4, 5, 256]);
    assert!(serde_json::from_value::<EndpointReply>(v).is_err());
}

#[test]
fn a_ready_status_reads_as_readiness() {
    // What the API serializes for a ready agent is the full status.
    let status = crate::agent::Status {
        version: "0.1.0".into(),
        ready: true,
        reason: None,
        node: "n1".into(),
        default_pool: Some("blue".into()),
        allocations: 3,
        roles: Default::default(),
        generation: lockstep_core::owner::Generation(9),
        restored: Default::default(),
        repairs: 0,
        pin_repairs: 0,
        ipam_commands: Default::default(),
    };
    let text = serde_json::to_string(&status).expect("serialize");
    let r: Readiness = serde_json::from_str(&text).expect("readiness");
    assert!(r.ready);
    assert_eq!(r.default_pool.as_deref(), Some("blue"));
    // The not-ready answer has no default pool and writes none.
    let not_ready = Readiness {
        version: "0.1.0".into(),
        ready: false,
        reason: Some("restoring".into()),
        default_pool: None,
        cluster: None,
    };
    assert_eq!(
        serde_json::to_value(&not_ready).unwrap(),
        serde_json::json!({"version": "0.1.0", "ready": false, "reason": "restoring"})
    );
}
