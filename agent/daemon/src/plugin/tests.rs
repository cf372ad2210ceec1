//! The plugin against fake agents: transport failures, and replies that
//! do or do not match the wire types.

use super::*;

#[test]
fn an_unreachable_agent_is_try_again_later() {
    let stdin = br#"{"cniVersion":"1.0.0","name":"n","type":"lockstep","agentSocket":"/nonexistent/lockstep.sock"}"#;
    let env = [
        ("CNI_COMMAND", "ADD"),
        ("CNI_CONTAINERID", "abc"),
        ("CNI_NETNS", "/proc/self/ns/net"),
        ("CNI_IFNAME", "eth0"),
        ("CNI_PATH", "/opt/cni/bin"),
    ];
    let (out, code) = invoke(env, stdin);
    assert_eq!(code, 1);
    let out = out.expect("an error object");
    assert_eq!(out["code"], 11, "{out}");
    assert!(
        out["msg"]
            .as_str()
            .unwrap_or_default()
            .contains("/nonexistent/lockstep.sock"),
        "{out}"
    );
    assert!(
        out["msg"]
            .as_str()
            .unwrap_or_default()
            .contains("is it running"),
        "{out}"
    );
}

#[test]
fn status_with_no_agent_is_not_available() {
    let stdin = br#"{"cniVersion":"1.1.0","name":"n","type":"lockstep","agentSocket":"/nonexistent/lockstep.sock"}"#;
    let (out, code) = invoke([("CNI_COMMAND", "STATUS")], stdin);
    assert_eq!(code, 1);
    assert_eq!(out.expect("error")["code"], 50);
}

/// A fake agent on a unix socket in a fresh directory: `serve` runs on
/// every accepted connection, in its own thread.
fn fake_agent(
    serve: impl Fn(std::os::unix::net::UnixStream) + Send + Sync + 'static,
) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("agent.sock");
    let listener = std::os::unix::net::UnixListener::bind(&socket).expect("bind");
    let serve = std::sync::Arc::new(serve);
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let serve = serve.clone();
            std::thread::spawn(move || serve(stream));
        }
    });
    (dir, socket)
}

fn add_env() -> [(&'static str, &'static str); 5] {
    [
        ("CNI_COMMAND", "ADD"),
        ("CNI_CONTAINERID", "abc"),
        ("CNI_NETNS", "/proc/self/ns/net"),
        ("CNI_IFNAME", "eth0"),
        ("CNI_PATH", "/opt/cni/bin"),
    ]
}

#[test]
fn an_agent_that_accepts_and_never_answers_is_try_again_later_by_the_deadline() {
    let (_dir, socket) = fake_agent(|stream| {
        // Hold the connection open, answer nothing.
        std::thread::sleep(std::time::Duration::from_secs(30));
        drop(stream);
    });
    let stdin = format!(
        r#"{{"cniVersion":"1.0.0","name":"n","type":"lockstep","agentSocket":"{}","agentTimeout":1}}"#,
        socket.display()
    );
    let started = std::time::Instant::now();
    let (out, code) = invoke(add_env(), stdin.as_bytes());
    let took = started.elapsed();
    assert!(took < std::time::Duration::from_secs(5), "took {took:?}");
    assert_eq!(code, 1);
    let out = out.expect("an error object");
    assert_eq!(out["code"], 11, "{out}");
    assert!(
        out["msg"]
            .as_str()
            .unwrap_or_default()
            .contains("did not answer within"),
        "{out}"
    );
}

#[test]
fn an_oversized_reply_is_an_error_not_a_result() {
    let (_dir, socket) = fake_agent(|mut stream| {
        use std::io::Read as _;
        let mut buf = [0u8; 4096];
        let _ = stream.read(&mut buf);
        let _ = stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n[");
        let filler = vec![b' '; 64 * 1024];
        // 200 MiB unless the plugin hangs up first.
        for _ in 0..3200 {
            if stream.write_all(&filler).is_err() {
                return;
            }
        }
    });
    let stdin = format!(
        r#"{{"cniVersion":"1.0.0","name":"n","type":"lockstep","agentSocket":"{}"}}"#,
        socket.display()
    );
    let (out, code) = invoke(add_env(), stdin.as_bytes());
    assert_eq!(code, 1);
    let out = out.expect("an error object");
    assert_eq!(out["code"], 11, "{out}");
    assert!(
        out["msg"]
            .as_str()
            .unwrap_or_default()
            .contains("larger than"),
        "{out}"
    );
}

/// A fake agent that answers every request with `body` (status 200),
/// and counts the DELs it gets.
fn answering(
    body: &'static str,
) -> (
    tempfile::TempDir,
    std::path::PathBuf,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    let dels = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = dels.clone();
    let (dir, socket) = fake_agent(move |mut stream| {
        use std::io::Read as _;
        let mut buf = [0u8; 4096];
        let n = stream.read(&mut buf).unwrap_or(0);
        if buf[..n].starts_with(b"POST /v1/cni/del") {
            seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        let _ = write!(
            stream,
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
    });
    (dir, socket, dels)
}

#[test]
fn an_add_reply_without_usable_addresses_is_an_error_and_is_given_back() {
    for (mode, body) in [
        ("lockstep-ipam", r#"{"unexpected":true}"#),
        ("lockstep-ipam", r#"{"addresses":"10.0.0.2/24"}"#),
        ("lockstep-ipam", r#"{"addresses":[],"routes":[]}"#),
        // One good address beside one that does not parse: the whole
        // answer is refused, never a result with the good one alone.
        (
            "lockstep-ipam",
            r#"{"addresses":[{"address":"10.0.0.2/24","gateway":null},{"address":"10.0.0.300/24","gateway":null}],"routes":[]}"#,
        ),
        (
            "lockstep-ipam",
            r#"{"addresses":[{"address":"10.0.0.2/24","gateway":null},{"address":"fd00::2","gateway":null}],"routes":[]}"#,
        ),
        (
            "lockstep-ipam",
            r#"{"addresses":[{"address":"10.0.0.2/24","gateway":"10.0.0.x"}],"routes":[]}"#,
        ),
        (
            "lockstep-ipam",
            r#"{"addresses":[{"address":"10.0.0.2/24","gateway":null}],"routes":[["0.0.0.0/0",null],["bogus",null]]}"#,
        ),
        (
            "lockstep",
            r#"{"addresses":[{"address":"10.0.0.2/32","gateway":null}],"routes":[],"record":{"host_ifname":"ls1","host_mac":[1,2,3,4,5,256],"mac":[1,2,3,4,5,6]}}"#,
        ),
        (
            "lockstep",
            r#"{"addresses":[{"address":"10.0.0.2/32","gateway":null}],"routes":[],"record":{}}"#,
        ),
    ] {
        let (_dir, socket, dels) = answering(body);
        let stdin = if mode == "lockstep" {
            format!(
                r#"{{"cniVersion":"1.0.0","name":"n","type":"lockstep","agentSocket":"{}"}}"#,
                socket.display()
            )
        } else {
            format!(
                r#"{{"cniVersion":"1.0.0","name":"n","type":"bridge","ipam":{{"type":"lockstep-ipam","agentSocket":"{}"}}}}"#,
                socket.display()
            )
        };
        let (out, code) = invoke(add_env(), stdin.as_bytes());
        let out = out.expect("an error object");
        assert_eq!(code, 1, "{body}: {out}");
        assert_eq!(out["code"], BAD_AGENT_REPLY, "{body}: {out}");
        assert_eq!(
            dels.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "{body}: the allocation is given back"
        );
    }
}

#[test]
fn a_well_formed_add_reply_is_a_result() {
    let (_dir, socket, dels) = answering(
        r#"{"addresses":[{"address":"10.0.0.2/24","gateway":"10.0.0.1"}],"routes":[],"record":{"container_id":"abc","ifname":"eth0","netns":"/proc/self/ns/net","mode":"ipam","pool":"default","addresses":["10.0.0.2"],"host_ifname":null,"host_ifindex":0,"host_mac":[0,0,0,0,0,0],"mac":[0,0,0,0,0,0]},"new_field":1}"#,
    );
    let stdin = format!(
        r#"{{"cniVersion":"1.0.0","name":"n","type":"bridge","ipam":{{"type":"lockstep-ipam","agentSocket":"{}"}}}}"#,
        socket.display()
    );
    let (out, code) = invoke(add_env(), stdin.as_bytes());
    let out = out.expect("a result");
    assert_eq!(code, 0, "{out}");
    assert_eq!(out["ips"][0]["address"], "10.0.0.2/24", "{out}");
    assert_eq!(dels.load(std::sync::atomic::Ordering::SeqCst), 0);
}

#[test]
fn agent_timeout_is_checked() {
    for bad in ["0", "601", "\"30s\""] {
        let stdin = format!(
            r#"{{"cniVersion":"1.0.0","name":"n","type":"lockstep","agentTimeout":{bad}}}"#
        );
        let (out, code) = invoke(add_env(), stdin.as_bytes());
        assert_eq!(code, 1, "{bad}");
        let out = out.expect("an error object");
        assert!(
            out["msg"]
                .as_str()
                .unwrap_or_default()
                .contains("agentTimeout")
                || out["details"]
                    .as_str()
                    .unwrap_or_default()
                    .contains("agentTimeout"),
            "{bad}: {out}"
        );
    }
}

#[test]
fn chunked_bodies_are_decoded() {
    assert_eq!(
        dechunk(b"4\r\nWiki\r\n5\r\npedia\r\n0\r\n\r\n").as_deref(),
        Some(&b"Wikipedia"[..])
    );
    assert_eq!(dechunk(b"zz\r\n"), None);
    assert_eq!(dechunk(b"5\r\nab"), None);
}

#[test]
fn version_needs_no_agent() {
    let (out, code) = invoke([("CNI_COMMAND", "VERSION")], br#"{"cniVersion":"0.4.0"}"#);
    assert_eq!(code, 0);
    let out = out.expect("version info");
    assert!(
        out["supportedVersions"]
            .as_array()
            .is_some_and(|v| v.len() == 4),
        "{out}"
    );
}

#[test]
fn requests_are_the_wire_types_and_keep_their_json() {
    let stdin = br#"{"cniVersion":"1.0.0","name":"n","type":"lockstep","agentSocket":"/nonexistent/s","mtu":1400}"#;
    let Ok(Invocation::Add(req)) = cni::parse_invocation(add_env(), stdin) else {
        panic!("an ADD");
    };
    // The JSON the plugin built with `json!` before the types were shared.
    let before = json!({
        "container_id": "abc",
        "ifname": "eth0",
        "netns": "/proc/self/ns/net",
        "mode": "full",
        "pool": null,
        "requested": [],
        "mtu": 1400,
    });
    let sent: Value =
        serde_json::from_str(&erased::Body::to_json(&endpoint_request(&req))).expect("json");
    assert_eq!(sent, before);
    // And the API's own type reads it back (it refuses unknown fields).
    let back: EndpointRequest = serde_json::from_value(sent).expect("the API reads it");
    assert_eq!(back, endpoint_request(&req));
    let del: Value =
        serde_json::from_str(&erased::Body::to_json(&del_request(&req))).expect("json");
    assert_eq!(del, json!({"container_id": "abc", "ifname": "eth0"}));
}

#[test]
fn a_status_reply_of_the_wrong_shape_is_not_available() {
    for body in [r#"{"ready":"yes"}"#, r#"[1,2]"#] {
        let (_dir, socket, _) = answering(body);
        let stdin = format!(
            r#"{{"cniVersion":"1.1.0","name":"n","type":"lockstep","agentSocket":"{}"}}"#,
            socket.display()
        );
        let (out, code) = invoke([("CNI_COMMAND", "STATUS")], stdin.as_bytes());
        let out = out.expect("an error object");
        assert_eq!(code, 1, "{body}: {out}");
        assert_eq!(out["code"], 50, "{body}: {out}");
        assert!(
            out["msg"]
                .as_str()
                .unwrap_or_default()
                .contains("status cannot be read"),
            "{body}: {out}"
        );
    }
}
