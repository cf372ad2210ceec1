//! Malformed input, table-driven: API requests (raw bytes) and configs.
//!
//! Every malformed request must be refused with a 4xx (never a 5xx) and a JSON
//! error whose stable code and message say what is wrong, and must change
//! nothing stored: allocations and pool usage are compared after every case,
//! and again after a restart. Every malformed config must stop the agent with
//! a non-zero exit and a message naming the file and the field, without
//! touching the store or the pinned maps.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

use anyhow::Context;
use hyper::Method;
use lockstep::client::{call, raw};
use lockstep_tests::{AgentProc, Netns, lockstep_bin, privileged, sh};
use serde_json::{Value, json};

const POOLS: &str = r#"
reconcile_interval = "1s"
[[pools]]
name = "bad"
ipv4 = ["10.61.0.0/24"]
ipv6 = ["fd00:61::/120"]
"#;

fn rt() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

/// Everything the API says is stored: allocations and pool usage.
fn snapshot(rt: &tokio::runtime::Runtime, socket: &Path) -> anyhow::Result<(Value, Value)> {
    let allocations = rt
        .block_on(call(socket, Method::GET, "/v1/allocations", None))
        .context("GET /v1/allocations")?;
    let pools = rt
        .block_on(call(socket, Method::GET, "/v1/pools", None))
        .context("GET /v1/pools")?;
    Ok((allocations, pools))
}

/// How a case is sent.
enum Send {
    /// Through `lockstep::client::raw` (JSON content type when there is a body).
    Raw(Option<Vec<u8>>),
    /// As a hand-written HTTP/1.1 request with this content type.
    ContentType(&'static str, Vec<u8>),
}

struct ApiCase {
    name: &'static str,
    method: Method,
    path: &'static str,
    send: Send,
    status: u16,
    code: &'static str,
    /// A substring of the message that names what is wrong.
    says: String,
}

fn case(
    name: &'static str,
    method: Method,
    path: &'static str,
    body: Option<&[u8]>,
    status: u16,
    code: &'static str,
    says: &str,
) -> ApiCase {
    ApiCase {
        name,
        method,
        path,
        send: Send::Raw(body.map(<[u8]>::to_vec)),
        status,
        code,
        says: says.to_string(),
    }
}

fn alloc(name: &'static str, body: Value, status: u16, code: &'static str, says: &str) -> ApiCase {
    let text = body.to_string();
    case(
        name,
        Method::POST,
        "/v1/allocations",
        Some(text.as_bytes()),
        status,
        code,
        says,
    )
}

fn release(
    name: &'static str,
    body: Value,
    status: u16,
    code: &'static str,
    says: &str,
) -> ApiCase {
    let text = body.to_string();
    case(
        name,
        Method::POST,
        "/v1/release",
        Some(text.as_bytes()),
        status,
        code,
        says,
    )
}

/// One HTTP/1.1 exchange over the socket with a chosen content type (the
/// client library always sends JSON).
fn send_with_content_type(
    socket: &Path,
    method: &Method,
    path: &str,
    content_type: &str,
    body: &[u8],
) -> anyhow::Result<(u16, Vec<u8>)> {
    let mut s = std::os::unix::net::UnixStream::connect(socket)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    let head = format!(
        "{method} {path} HTTP/1.1\r\nhost: lockstep\r\ncontent-type: {content_type}\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    // One write: the server may answer (415) from the headers alone and
    // close; a body written after that would fail with EPIPE.
    let mut request = head.into_bytes();
    request.extend_from_slice(body);
    s.write_all(&request)?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf)?;
    let end = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("no end of headers in the response")?;
    let head = String::from_utf8_lossy(&buf[..end]).to_string();
    let status = head
        .split_whitespace()
        .nth(1)
        .context("no status line")?
        .parse()?;
    let mut body = buf[end + 4..].to_vec();
    if let Some(len) = head.lines().find_map(|l| {
        l.to_ascii_lowercase()
            .strip_prefix("content-length:")
            .and_then(|v| v.trim().parse::<usize>().ok())
    }) {
        body.truncate(len);
    }
    Ok((status, body))
}

fn api_cases(seed_a: &Value, seed_a_generation: u64) -> Vec<ApiCase> {
    let ep = json!({"owner": "endpoint", "container_id": "new-1", "ifname": "eth0"});
    let ok_body = json!({"pool": "bad", "family": "ipv4", "owner": ep});
    let with = |k: &str, v: Value| {
        let mut b = ok_body.clone();
        b[k] = v;
        b
    };
    let without = |k: &str| {
        let mut b = ok_body.clone();
        b.as_object_mut().map(|o| o.remove(k));
        b
    };
    let mut huge = ok_body.clone();
    huge["padding"] = json!("x".repeat(70 * 1024));
    let huge = huge.to_string().into_bytes();
    let stale = seed_a_generation.saturating_sub(1);
    let rel =
        json!({"pool": "bad", "family": "ipv4", "owner": seed_a, "generation": seed_a_generation});
    let rel_with = |k: &str, v: Value| {
        let mut b = rel.clone();
        b[k] = v;
        b
    };
    let mut rel_without_family = rel.clone();
    rel_without_family
        .as_object_mut()
        .map(|o| o.remove("family"));
    // Inside the owner, which serde buffers before it reads the tag, so the
    // parser really descends (a typed field would refuse the first `[`).
    let deep = format!(
        r#"{{"pool":"bad","family":"ipv4","owner":{{"container_id":{}}}}}"#,
        "[".repeat(10_000)
    );
    let good = ok_body.to_string();
    let owner =
        |id: &str, ifname: &str| json!({"owner": "endpoint", "container_id": id, "ifname": ifname});
    let long_id = "a".repeat(60 * 1024);
    let cni = |v: &Value| v.to_string().into_bytes();
    let post = Method::POST;
    let get = Method::GET;

    vec![
        // Not JSON, or not JSON that parses.
        case("not JSON", post.clone(), "/v1/allocations", Some(b"hello"), 400, "bad_json", "expected value"),
        case("truncated JSON", post.clone(), "/v1/allocations", Some(br#"{"pool":"bad","family":"ipv4","owner":{"owner":"endp"#), 400, "bad_json", "EOF"),
        case("empty body", post.clone(), "/v1/allocations", Some(b""), 400, "bad_json", "EOF"),
        case("trailing garbage", post.clone(), "/v1/allocations", Some(format!("{good} xyz").as_bytes()), 400, "bad_json", "trailing characters"),
        case("invalid UTF-8", post.clone(), "/v1/allocations", Some(b"{\"pool\":\"\xff\xfe\",\"family\":\"ipv4\"}"), 400, "bad_json", "unicode"),
        case("nesting deeper than the recursion limit", post.clone(), "/v1/allocations", Some(deep.as_bytes()), 400, "bad_json", "recursion limit"),
        // JSON of the wrong shape.
        case("a list, not an object", post.clone(), "/v1/allocations", Some(b"[]"), 422, "bad_request", "expected struct AllocateRequest"),
        case("null", post.clone(), "/v1/allocations", Some(b"null"), 422, "bad_request", "invalid type: null"),
        alloc("unknown field", with("colour", json!("red")), 422, "bad_request", "unknown field `colour`"),
        alloc("pool as a number", with("pool", json!(7)), 422, "bad_request", "invalid type: integer `7`, expected a string"),
        alloc("family ipv5", with("family", json!("ipv5")), 422, "bad_request", "unknown variant `ipv5`"),
        alloc("address 10.0.0.300", with("address", json!("10.0.0.300")), 422, "bad_request", "invalid IP address syntax"),
        alloc("address as a number", with("address", json!(167772161)), 422, "bad_request", "invalid type: integer"),
        alloc("owner without its tag", with("owner", json!({"container_id": "x", "ifname": "eth0"})), 422, "bad_request", "missing field `owner`"),
        alloc("owner of an unknown kind", with("owner", json!({"owner": "pod", "name": "x"})), 422, "bad_request", "unknown variant `pod`"),
        alloc("owner with an unknown field", with("owner", json!({"owner": "endpoint", "container_id": "x", "ifname": "eth0", "extra": 1})), 422, "bad_request", "unknown field `extra`"),
        alloc("owner missing ifname", with("owner", json!({"owner": "endpoint", "container_id": "x"})), 422, "bad_request", "missing field `ifname`"),
        alloc("owner container_id as a number", with("owner", json!({"owner": "endpoint", "container_id": 5, "ifname": "eth0"})), 422, "bad_request", "invalid type: integer `5`"),
        alloc("agent owner of an unknown role", with("owner", json!({"owner": "agent", "role": "boss"})), 422, "bad_request", "unknown variant `boss`"),
        // A missing pool is not malformed: it means the default pool
        // (tests/tests/defaults.rs).
        alloc("pool of the wrong type", with("pool", json!(7)), 422, "bad_request", "invalid type: integer `7`"),
        alloc("missing owner", without("owner"), 422, "bad_request", "missing field `owner`"),
        case("duplicate field", post.clone(), "/v1/allocations", Some(br#"{"pool":"bad","pool":"bad","family":"ipv4","owner":{"owner":"endpoint","container_id":"x","ifname":"eth0"}}"#), 422, "bad_request", "duplicate field `pool`"),
        // Transport-level problems.
        case("oversized body (> 64 KiB)", post.clone(), "/v1/allocations", Some(&huge), 413, "too_large", "length limit"),
        case("oversized release body", post.clone(), "/v1/release", Some(&huge), 413, "too_large", "length limit"),
        case("no body and no content type", post.clone(), "/v1/allocations", None, 415, "unsupported_media_type", "Content-Type: application/json"),
        ApiCase { name: "text/plain content type", method: post.clone(), path: "/v1/allocations", send: Send::ContentType("text/plain", good.clone().into_bytes()), status: 415, code: "unsupported_media_type", says: "Content-Type: application/json".into() },
        ApiCase { name: "JSON declared as UTF-16", method: post.clone(), path: "/v1/allocations", send: Send::ContentType("application/json; charset=utf-16", good.clone().into_bytes()), status: 415, code: "unsupported_media_type", says: "charset utf-16 is not accepted".into() },
        ApiCase { name: "JSON declared as latin-1 (quoted)", method: post.clone(), path: "/v1/release", send: Send::ContentType("application/json; charset=\"ISO-8859-1\"", b"{}".to_vec()), status: 415, code: "unsupported_media_type", says: "charset iso-8859-1".into() },
        ApiCase { name: "form content type", method: post.clone(), path: "/v1/release", send: Send::ContentType("application/x-www-form-urlencoded", b"pool=bad".to_vec()), status: 415, code: "unsupported_media_type", says: "Content-Type: application/json".into() },
        // Well-formed, but not acceptable.
        alloc("unknown pool", with("pool", json!("nope")), 404, "unknown_pool", "unknown pool nope"),
        alloc("v4 address outside the pool", with("address", json!("10.99.0.5")), 400, "address_outside_pool", "address 10.99.0.5 is outside pool bad"),
        alloc("v6 address outside the pool", json!({"pool": "bad", "address": "fd00:99::5", "owner": ep}), 400, "address_outside_pool", "address fd00:99::5 is outside pool bad"),
        alloc("family and address disagree", json!({"pool": "bad", "family": "ipv6", "address": "10.61.0.7", "owner": ep}), 400, "invalid_request", "address 10.61.0.7 is not of family ipv6"),
        alloc("neither family nor address", without("family"), 400, "invalid_request", "give a family or an address"),
        alloc("owner of kind agent (reserved)", with("owner", json!({"owner": "agent", "role": "router"})), 400, "invalid_request", "reserved by the agent"),
        alloc("address taken by another owner", with("address", json!("10.61.0.10")), 409, "address_taken", "10.61.0.10 of pool bad is taken by resource node/n1"),
        alloc("network address", with("address", json!("10.61.0.0")), 400, "address_unusable", "10.61.0.0 of pool bad cannot be allocated"),
        alloc("broadcast address", with("address", json!("10.61.0.255")), 400, "address_unusable", "10.61.0.255 of pool bad cannot be allocated"),
        alloc("owner already holds another address", json!({"pool": "bad", "address": "10.61.0.20", "owner": seed_a}), 409, "owner_holds_other", "already holds"),
        // Owners the plugin would refuse are refused at every door, by the
        // one set of rules (lockstep_core::owner), naming the field.
        alloc("NUL in a container ID", with("owner", owner("a\0b", "eth0")), 400, "invalid_request", "container_id \"a\\0b\": a container ID may only contain"),
        alloc("the old key separator in a container ID", with("owner", owner("a\u{1f}b", "c")), 400, "invalid_request", "container_id"),
        alloc("empty container ID", with("owner", owner("", "eth0")), 400, "invalid_request", "container_id \"\": a container ID must not be empty"),
        alloc("empty ifname", with("owner", owner("x", "")), 400, "invalid_request", "ifname \"\": an interface name must not be empty"),
        alloc("control character in an ifname", with("owner", owner("x", "e\u{7}th0")), 400, "invalid_request", "ifname"),
        alloc("16-byte ifname", with("owner", owner("x", "0123456789abcdef")), 400, "invalid_request", "at most 15 bytes"),
        alloc("60 KiB container ID", with("owner", owner(&long_id, "eth0")), 400, "invalid_request", "at most 256 bytes"),
        alloc("owner of kind delegated (reserved)", with("owner", json!({"owner": "delegated", "container_id": "x", "ifname": "eth0"})), 400, "invalid_request", "reserved by the agent"),
        alloc("service owner without a namespace", with("owner", json!({"owner": "loadbalancer", "service": "web"})), 400, "invalid_request", "service \"web\": must be namespace/name"),
        alloc("resource with an empty name", with("owner", json!({"owner": "resource", "kind": "node", "name": ""})), 400, "invalid_request", "name \"\": must not be empty"),
        release("release for a NUL container ID", rel_with("owner", owner("a\0b", "eth0")), 400, "invalid_request", "container_id"),
        case("CNI ADD with a NUL container ID", post.clone(), "/v1/cni/add", Some(&cni(&json!({"container_id": "a\0b", "ifname": "eth0", "netns": "/run/netns/x", "mode": "ipam"}))), 400, "invalid_request", "container_id"),
        case("CNI ADD with the reviewer's colliding pair", post.clone(), "/v1/cni/add", Some(&cni(&json!({"container_id": "a", "ifname": "b\u{1f}c", "netns": "/run/netns/x", "mode": "ipam"}))), 400, "invalid_request", "ifname"),
        case("CNI CHECK with an empty ifname", post.clone(), "/v1/cni/check", Some(&cni(&json!({"container_id": "a", "ifname": "", "netns": "/run/netns/x", "mode": "ipam"}))), 400, "invalid_request", "ifname"),
        case("CNI DEL with an empty container ID", post.clone(), "/v1/cni/del", Some(&cni(&json!({"container_id": "", "ifname": "eth0"}))), 400, "invalid_request", "container_id"),
        case("CNI GC with a control character in a valid attachment", post.clone(), "/v1/cni/gc", Some(&cni(&json!({"valid": [["ok", "eth0"], ["a\u{1b}", "eth0"]]}))), 400, "invalid_request", "valid[1]: container_id"),
        case("LB service with a control character", post.clone(), "/v1/lb/apply", Some(&cni(&json!({"services": [{"namespace": "ns", "name": "w\u{0}"}]}))), 400, "invalid_request", "name: must not contain control characters"),
        // Releases.
        release("release of an unknown owner", rel_with("owner", ep.clone()), 404, "not_found", "no allocation in pool bad (ipv4) for endpoint new-1/eth0"),
        release("release in an unknown pool", rel_with("pool", json!("nope")), 404, "not_found", "no allocation in pool nope"),
        release("release in the family the owner does not hold", rel_with("family", json!("ipv6")), 404, "not_found", "no allocation in pool bad (ipv6)"),
        release("release with a stale generation", rel_with("generation", json!(stale)), 409, "stale_generation", &format!("stale generation {stale} for endpoint seed-a/eth0: current is {seed_a_generation}")),
        release("release without family", rel_without_family, 422, "bad_request", "missing field `family`"),
        release("release of family ipv5", rel_with("family", json!("ipv5")), 422, "bad_request", "unknown variant `ipv5`"),
        release("release with generation as a string", rel_with("generation", json!("3")), 422, "bad_request", "invalid type: string \"3\""),
        release("release with a negative generation", rel_with("generation", json!(-1)), 422, "bad_request", "invalid value: integer `-1`"),
        release("release with an address field", rel_with("address", json!("10.61.0.10")), 422, "bad_request", "unknown field `address`"),
        case("release with an empty body", post.clone(), "/v1/release", Some(b""), 400, "bad_json", "EOF"),
        // Paths and methods.
        case("unknown path", get.clone(), "/v1/nope", None, 404, "no_such_path", "no such API path"),
        case("unversioned path", get.clone(), "/allocations", None, 404, "no_such_path", "no such API path"),
        case("future version", post.clone(), "/v2/allocations", Some(good.as_bytes()), 404, "no_such_path", "no such API path"),
        case("DELETE allocations", Method::DELETE, "/v1/allocations", None, 405, "method_not_allowed", "method not allowed"),
        case("GET release", get.clone(), "/v1/release", None, 405, "method_not_allowed", "method not allowed"),
        case("PUT pools", Method::PUT, "/v1/pools", Some(b"{}"), 405, "method_not_allowed", "method not allowed"),
        case("POST status", post.clone(), "/v1/status", Some(b"{}"), 405, "method_not_allowed", "method not allowed"),
        case("GET reconcile", get.clone(), "/v1/reconcile", None, 405, "method_not_allowed", "method not allowed"),
    ]
}

/// Checks one answer; returns what is wrong with it, if anything.
fn judge(c: &ApiCase, status: u16, body: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(body);
    if !(400..500).contains(&status) {
        return Some(format!("status {status} is not 4xx: {text}"));
    }
    if status != c.status {
        return Some(format!("status {status}, expected {}: {text}", c.status));
    }
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return Some(format!("body is not JSON: {text}"));
    };
    let code = v["error"]["code"].as_str().unwrap_or_default();
    let message = v["error"]["message"].as_str().unwrap_or_default();
    if code != c.code {
        return Some(format!("code {code:?}, expected {:?}: {text}", c.code));
    }
    if message.is_empty() || !message.contains(&c.says) {
        return Some(format!("message does not say {:?}: {text}", c.says));
    }
    None
}

#[test]
fn malformed_requests_get_a_4xx_json_error_and_change_nothing() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("badapi")?;
    let mut agent = AgentProc::start(&node, POOLS)?;
    let socket = agent.socket();
    let rt = rt()?;
    // Something to collide with: a v4 endpoint, a v6 endpoint, and a resource
    // at a chosen address.
    let seed_a = json!({"owner": "endpoint", "container_id": "seed-a", "ifname": "eth0"});
    let a = rt.block_on(call(
        &socket,
        Method::POST,
        "/v1/allocations",
        Some(json!({"pool": "bad", "family": "ipv4", "owner": seed_a})),
    ))?;
    let a_generation = a["generation"].as_u64().context("generation")?;
    rt.block_on(call(
        &socket,
        Method::POST,
        "/v1/allocations",
        Some(json!({"pool": "bad", "family": "ipv6", "owner": {"owner": "endpoint", "container_id": "seed-b", "ifname": "eth0"}})),
    ))?;
    rt.block_on(call(
        &socket,
        Method::POST,
        "/v1/allocations",
        Some(json!({"pool": "bad", "address": "10.61.0.10", "owner": {"owner": "resource", "kind": "node", "name": "n1"}})),
    ))?;
    let before = snapshot(&rt, &socket)?;
    assert_eq!(before.0.as_array().map(Vec::len), Some(3), "{}", before.0);

    let cases = api_cases(&seed_a, a_generation);
    let mut failures = Vec::new();
    for c in &cases {
        let (status, body) = match &c.send {
            Send::Raw(body) => {
                let (s, b) = rt
                    .block_on(raw(&socket, c.method.clone(), c.path, body.clone()))
                    .with_context(|| c.name)?;
                (s.as_u16(), b.to_vec())
            }
            Send::ContentType(ct, body) => {
                send_with_content_type(&socket, &c.method, c.path, ct, body)
                    .with_context(|| c.name)?
            }
        };
        if let Some(why) = judge(c, status, &body) {
            failures.push(format!("{} ({} {}): {why}", c.name, c.method, c.path));
        }
        let now = snapshot(&rt, &socket).with_context(|| format!("after {}", c.name))?;
        if now != before {
            failures.push(format!(
                "{}: the stored state changed:\nbefore {before:?}\nafter  {now:?}",
                c.name
            ));
        }
    }
    assert!(cases.len() >= 30, "only {} cases", cases.len());
    eprintln!("{} malformed API requests", cases.len());
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );

    // Nothing changed durably either.
    agent.restart()?;
    assert_eq!(snapshot(&rt, &socket)?, before, "after a restart");
    let out = agent.cli(["verify"])?;
    assert!(
        out.status.success(),
        "verify: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    Ok(())
}

/// Runs `lockstep agent --config <path>` in `node`; the output, or an error if
/// it is still running after 10 s (it accepted the config).
fn run_agent(node: &Netns, path: &Path) -> anyhow::Result<Output> {
    let mut child = node
        .command(lockstep_bin())
        .args(["agent", "--config"])
        .arg(path)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(10) {
        if child.try_wait()?.is_some() {
            return Ok(child.wait_with_output()?);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let out = child.wait_with_output()?;
    anyhow::bail!(
        "still running after 10 s: the config was accepted\n{}",
        String::from_utf8_lossy(&out.stderr)
    )
}

struct Paths {
    state: PathBuf,
    socket: PathBuf,
    pins: PathBuf,
}

/// A config from its three parts; `top` goes after the paths.
fn config(p: &Paths, top: &str, pools: &str, datapath: &str) -> String {
    format!(
        "state_dir = \"{}\"\nsocket = \"{}\"\nmetrics_addr = \"127.0.0.1:0\"\n{top}\n{pools}\n[datapath]\npin_root = \"{}\"\n{datapath}\n",
        p.state.display(),
        p.socket.display(),
        p.pins.display()
    )
}

const GOOD_POOL: &str =
    "[[pools]]\nname = \"cfg\"\nipv4 = [\"10.63.0.0/24\"]\nipv6 = [\"fd00:63::/120\"]\n";

/// (name, config text, substrings the error must contain besides the file).
fn config_cases(p: &Paths) -> Vec<(&'static str, String, Vec<&'static str>)> {
    let top = "reconcile_interval = \"1s\"";
    let pool = |extra: &str| format!("{GOOD_POOL}{extra}\n");
    let cidr = |v4: &str| format!("[[pools]]\nname = \"cfg\"\nipv4 = [{v4}]\n");
    let state = p.state.display().to_string();
    let with_state =
        |s: &str| config(p, top, GOOD_POOL, "").replacen(&format!("state_dir = \"{state}\""), s, 1);
    let socket = p.socket.display().to_string();
    let pins = p.pins.display().to_string();
    vec![
        (
            "unknown top-level field",
            config(
                p,
                "reconcile_interval = \"1s\"\ncolour = \"red\"",
                GOOD_POOL,
                "",
            ),
            vec!["unknown field `colour`"],
        ),
        (
            "unknown datapath field",
            config(p, top, GOOD_POOL, "colour = \"red\""),
            vec!["unknown field `colour`"],
        ),
        (
            "unknown pool field",
            config(p, top, &pool("size = 3"), ""),
            vec!["unknown field `size`"],
        ),
        (
            "interval of the wrong type",
            config(p, "reconcile_interval = 5", GOOD_POOL, ""),
            vec!["reconcile_interval"],
        ),
        (
            "interval that does not parse",
            config(p, "reconcile_interval = \"soon\"", GOOD_POOL, ""),
            vec!["reconcile_interval"],
        ),
        (
            "ipv4 as a string, not a list",
            config(
                p,
                top,
                "[[pools]]\nname = \"cfg\"\nipv4 = \"10.63.0.0/24\"\n",
                "",
            ),
            vec!["ipv4"],
        ),
        (
            "ipcache_max_entries of the wrong type",
            config(p, top, GOOD_POOL, "ipcache_max_entries = \"many\""),
            vec!["ipcache_max_entries"],
        ),
        (
            "attach_mode unknown",
            config(p, top, GOOD_POOL, "attach_mode = \"magic\""),
            vec!["attach_mode", "magic"],
        ),
        (
            "CIDR with host bits",
            config(p, top, &cidr("\"10.63.0.1/24\""), ""),
            vec!["pools[0]", "10.63.0.1/24"],
        ),
        (
            "CIDR /33",
            config(p, top, &cidr("\"10.63.0.0/33\""), ""),
            vec!["ipv4", "10.63.0.0/33"],
        ),
        (
            "IPv6 CIDR in the ipv4 list",
            config(p, top, &cidr("\"fd00:63::/120\""), ""),
            vec!["ipv4", "fd00:63::/120"],
        ),
        (
            "reserved address that does not parse",
            config(p, top, &pool("reserved = [\"10.63.0.300\"]"), ""),
            vec!["reserved", "10.63.0.300"],
        ),
        (
            "overlapping pools",
            config(
                p,
                top,
                &format!("{GOOD_POOL}[[pools]]\nname = \"b\"\nipv4 = [\"10.63.0.128/25\"]\n"),
                "",
            ),
            vec!["field `pools`", "overlaps"],
        ),
        (
            "duplicate pool names",
            config(
                p,
                top,
                &format!("{GOOD_POOL}[[pools]]\nname = \"cfg\"\nipv4 = [\"10.64.0.0/24\"]\n"),
                "",
            ),
            vec!["pools[1].name", "defined twice"],
        ),
        (
            "empty pool name",
            config(
                p,
                top,
                "[[pools]]\nname = \"\"\nipv4 = [\"10.63.0.0/24\"]\n",
                "",
            ),
            vec!["pools[0]", "empty"],
        ),
        (
            "relative state_dir",
            with_state("state_dir = \"state\""),
            vec!["field `state_dir`", "absolute"],
        ),
        (
            "relative socket",
            config(p, top, GOOD_POOL, "").replacen(
                &format!("socket = \"{socket}\""),
                "socket = \"api.sock\"",
                1,
            ),
            vec!["field `socket`", "absolute"],
        ),
        (
            "relative pin_root",
            config(p, top, GOOD_POOL, "").replacen(
                &format!("pin_root = \"{pins}\""),
                "pin_root = \"pins\"",
                1,
            ),
            vec!["datapath.pin_root", "absolute"],
        ),
        (
            "zero reconcile interval",
            config(p, "reconcile_interval = \"0s\"", GOOD_POOL, ""),
            vec!["reconcile_interval", "at least 100ms"],
        ),
        (
            "too small reconcile interval",
            config(p, "reconcile_interval = \"10ms\"", GOOD_POOL, ""),
            vec!["reconcile_interval", "at least 100ms"],
        ),
        (
            "zero ipcache_max_entries",
            config(p, top, GOOD_POOL, "ipcache_max_entries = 0"),
            vec!["datapath.ipcache_max_entries"],
        ),
        (
            "non-masquerade CIDR with host bits",
            config(
                p,
                "reconcile_interval = \"1s\"\nnon_masquerade_cidrs = [\"10.0.0.1/8\"]",
                GOOD_POOL,
                "",
            ),
            vec!["non_masquerade_cidrs[0]", "host bits"],
        ),
        (
            "metrics_addr not an address",
            config(p, "reconcile_interval = \"1s\"", GOOD_POOL, "").replacen(
                "metrics_addr = \"127.0.0.1:0\"",
                "metrics_addr = \"localhost\"",
                1,
            ),
            vec!["metrics_addr"],
        ),
        (
            "metrics_addr a number",
            config(p, "reconcile_interval = \"1s\"", GOOD_POOL, "").replacen(
                "metrics_addr = \"127.0.0.1:0\"",
                "metrics_addr = 9962",
                1,
            ),
            vec!["metrics_addr"],
        ),
        (
            "duplicate key",
            config(
                p,
                "reconcile_interval = \"1s\"\nreconcile_interval = \"2s\"",
                GOOD_POOL,
                "",
            ),
            vec!["reconcile_interval", "duplicate key"],
        ),
        (
            "unparsable TOML: unclosed table header",
            config(p, top, "[[pools]\nname = \"cfg\"\n", ""),
            vec!["line", "[[pools]"],
        ),
        (
            "unparsable TOML: value missing",
            config(p, "reconcile_interval =", GOOD_POOL, ""),
            vec!["line", "reconcile_interval"],
        ),
    ]
}

fn maps_dump(pins: &Path) -> anyhow::Result<String> {
    sh(
        lockstep_bin().to_str().context("utf-8 path")?,
        [
            "maps",
            "dump",
            "-o",
            "json",
            "--pin-root",
            pins.to_str().context("utf-8 path")?,
        ],
    )
}

#[test]
fn malformed_configs_stop_the_agent_naming_file_and_field_and_change_nothing() -> anyhow::Result<()>
{
    privileged!();
    let node = Netns::new("badcfg")?;
    let mut agent = AgentProc::start(&node, &format!("reconcile_interval = \"1s\"\n{GOOD_POOL}"))?;
    let socket = agent.socket();
    let rt = rt()?;
    for (i, fam) in ["ipv4", "ipv6", "ipv4"].iter().enumerate() {
        rt.block_on(call(
            &socket,
            Method::POST,
            "/v1/allocations",
            Some(json!({"pool": "cfg", "family": fam, "owner": {"owner": "endpoint", "container_id": format!("cfg-{i}"), "ifname": "eth0"}})),
        ))?;
    }
    let before = snapshot(&rt, &socket)?;
    agent.kill9();
    let paths = Paths {
        state: agent.dir.path().join("state"),
        socket: agent.socket(),
        pins: agent.pins.path().to_path_buf(),
    };
    let db = paths.state.join(lockstep::store::DB_FILE);
    let db_before = std::fs::read(&db).context("reading the store")?;
    let maps_before = maps_dump(&paths.pins)?;
    let file = agent.dir.path().join("bad.toml");
    let file_name = file.display().to_string();

    let cases = config_cases(&paths);
    let mut failures = Vec::new();
    for (name, text, says) in &cases {
        std::fs::write(&file, text)?;
        match run_agent(&node, &file) {
            Err(e) => failures.push(format!("{name}: {e:#}")),
            Ok(out) => {
                let err = String::from_utf8_lossy(&out.stderr);
                if out.status.success() {
                    failures.push(format!("{name}: exited 0: {err}"));
                } else if !err.contains(&file_name) {
                    failures.push(format!(
                        "{name}: the message does not name {file_name}: {err}"
                    ));
                } else if let Some(missing) = says.iter().find(|s| !err.contains(*s)) {
                    failures.push(format!(
                        "{name}: the message does not say {missing:?}: {err}"
                    ));
                }
            }
        }
        if std::fs::read(&db)? != db_before {
            failures.push(format!("{name}: the store file changed"));
        }
        if maps_dump(&paths.pins)? != maps_before {
            failures.push(format!("{name}: the pinned maps changed"));
        }
    }
    assert!(cases.len() >= 10, "only {} cases", cases.len());
    eprintln!("{} malformed configs", cases.len());
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );

    // The good config still starts on the same, untouched state.
    agent.restart()?;
    assert_eq!(snapshot(&rt, &socket)?, before, "after the bad configs");
    let out = agent.cli(["verify"])?;
    assert!(
        out.status.success(),
        "verify: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    Ok(())
}
