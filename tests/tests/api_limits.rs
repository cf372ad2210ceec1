//! The API cannot be starved of connections or descriptors: connections
//! that never finish their headers, or sit idle, are closed after
//! `api_header_timeout`, and at most `api_max_connections` are served at
//! once, so an agent under a 1,024-descriptor limit keeps serving and
//! reconciling while 1,100 clients hold idle connections.

use std::io::{Read as _, Write as _};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use lockstep_tests::{AgentProc, Netns, privileged, wait_for};

const CONFIG: &str = r#"
reconcile_interval = "1s"
api_header_timeout = "2s"
[[pools]]
name = "limits"
ipv4 = ["10.66.0.0/24"]
"#;

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

#[test]
fn idle_and_unfinished_connections_cannot_starve_the_agent() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("limits")?;
    let mut agent = AgentProc::start(&node, CONFIG)?;
    // As on a node whose runtime gives the pod 1,024 descriptors.
    agent.kill9();
    agent.spawn_under(["sh", "-c", "ulimit -n 1024; exec \"$0\" \"$@\""])?;
    agent.wait_ready()?;
    let pid = agent.pid().context("agent pid")?;
    let socket = agent.socket();

    // A request whose headers never finish is closed after the timeout.
    let mut slow = UnixStream::connect(&socket)?;
    slow.write_all(b"GET /v1/status HTTP/1.1\r\nHost: x\r\n")?;
    slow.set_read_timeout(Some(Duration::from_secs(10)))?;
    let started = Instant::now();
    let mut buf = [0u8; 256];
    let n = slow.read(&mut buf).unwrap_or(0);
    let closed_after = started.elapsed();
    ensure!(
        closed_after < Duration::from_secs(8),
        "an unfinished request held its connection for {closed_after:?}"
    );
    eprintln!(
        "unfinished request closed after {closed_after:?} ({n} bytes answered: {:?})",
        String::from_utf8_lossy(&buf[..n])
    );

    // 1,100 idle connections (the test raises its own limit to hold them).
    let mut limit = libc::rlimit {
        rlim_cur: 4096,
        rlim_max: 4096,
    };
    // SAFETY: setrlimit reads the struct it is given.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) };
    // SAFETY: getrlimit writes the struct it is given.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
    ensure!(limit.rlim_cur >= 2048, "the test needs 2,048 descriptors");
    let idle: Vec<UnixStream> = (0..1100)
        .map(|_| UnixStream::connect(&socket))
        .collect::<Result<_, _>>()
        .context("connecting 1,100 idle clients")?;
    std::thread::sleep(Duration::from_millis(500));
    let fds = open_fds(pid);
    ensure!(
        fds < 1024 - 64,
        "the agent holds {fds} descriptors with 1,100 idle clients: no room left for its own work"
    );
    // The periodic reconcile (every second) keeps working meanwhile, and
    // once the idle connections time out the API answers again.
    let before = agent.log().matches("periodic reconcile failed").count();
    let answered = wait_for(
        "the API to answer past the idle clients",
        Duration::from_secs(30),
        || {
            agent
                .status_json()
                .filter(|s| s["ready"] == true)
                .map(|_| ())
        },
    );
    let after = agent.log().matches("periodic reconcile failed").count();
    drop(idle);
    answered?;
    ensure!(
        after == before,
        "the periodic reconcile failed while clients were idle:\n{}",
        agent.log()
    );
    eprintln!("agent held {fds} descriptors with 1,100 idle clients; the API answered again");
    let verify = agent.cli(["verify"])?;
    ensure!(verify.status.success(), "verify after the flood");
    agent.stop()?;
    Ok(())
}

/// One raw exchange: `request` written as is, the answer read to its end.
/// Returns the status and the body.
fn exchange(socket: &std::path::Path, request: &[u8]) -> anyhow::Result<(u16, String)> {
    let mut s = UnixStream::connect(socket)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    // The server may answer from the head alone and stop reading; what it
    // did not read does not matter.
    let _ = s.write_all(request);
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf).to_string();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .with_context(|| format!("no complete answer: {text:?}"))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .context("no status line")?
        .parse()?;
    Ok((status, body.to_string()))
}

/// Refusals hyper used to write itself (no body) answer the API's
/// documented JSON error shape, with the right status; the agent keeps
/// serving and nothing stored changes.
#[test]
fn refused_request_heads_answer_the_json_error_shape() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("heads")?;
    let mut agent = AgentProc::start(&node, CONFIG)?;
    let socket = agent.socket();
    let allocations = || exchange(&socket, b"GET /v1/allocations HTTP/1.1\r\nhost: x\r\n\r\n");
    let before = allocations()?;
    let many_headers: String = (0..120).map(|i| format!("x-h{i}: v\r\n")).collect();
    let cases: Vec<(&str, Vec<u8>, u16, &str, &str)> = vec![
        (
            "Content-Length that overflows",
            b"POST /v1/release HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 99999999999999999999999\r\n\r\n{}".to_vec(),
            400,
            "bad_request",
            "Content-Length",
        ),
        (
            "garbage request line",
            b"\x16\x03\x01\x02\x00 hello\r\n\r\n".to_vec(),
            400,
            "bad_request",
            "malformed HTTP request head",
        ),
        (
            "HTTP/2 preface",
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec(),
            400,
            "bad_request",
            "malformed HTTP request head",
        ),
        (
            "URI of 20,000 bytes (414)",
            format!("GET /v1/{} HTTP/1.1\r\nhost: x\r\n\r\n", "a".repeat(20_000)).into_bytes(),
            414,
            "uri_too_long",
            "request target is longer",
        ),
        (
            "120 header fields (431)",
            format!("GET /v1/status HTTP/1.1\r\n{many_headers}\r\n").into_bytes(),
            431,
            "headers_too_large",
            "header fields",
        ),
        (
            "a 40 KiB header (431)",
            format!("GET /v1/status HTTP/1.1\r\nx-big: {}\r\n\r\n", "y".repeat(40 * 1024))
                .into_bytes(),
            431,
            "headers_too_large",
            "request head is larger",
        ),
        (
            "a declared 1 GiB body (413)",
            b"POST /v1/allocations HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1073741824\r\n\r\n".to_vec(),
            413,
            "too_large",
            "length limit",
        ),
        (
            "Content-Length and Transfer-Encoding",
            b"POST /v1/release HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\ntransfer-encoding: chunked\r\n\r\n{}".to_vec(),
            400,
            "bad_request",
            "both Content-Length and Transfer-Encoding",
        ),
        (
            "a head cut short (408 after api_header_timeout)",
            b"GET /v1/status HTTP/1.1\r\nhost: x\r\n".to_vec(),
            408,
            "request_timeout",
            "did not arrive within",
        ),
    ];
    let mut failures = Vec::new();
    for (name, request, status, code, says) in &cases {
        let got = match exchange(&socket, request) {
            Ok(got) => got,
            Err(e) => {
                failures.push(format!("{name}: {e:#}"));
                continue;
            }
        };
        let json: serde_json::Value = match serde_json::from_str(&got.1) {
            Ok(v) => v,
            Err(_) => {
                failures.push(format!(
                    "{name}: status {}, body is not JSON: {:?}",
                    got.0, got.1
                ));
                continue;
            }
        };
        let message = json["error"]["message"].as_str().unwrap_or_default();
        if got.0 != *status || json["error"]["code"] != *code || !message.contains(says) {
            failures.push(format!(
                "{name}: got {} {}, expected {status} {code} saying {says:?}",
                got.0, got.1
            ));
        } else {
            eprintln!("{name}: {} {}", got.0, got.1);
        }
    }
    ensure!(failures.is_empty(), "{}", failures.join("\n"));

    // A good request is still served, one per connection: a second request
    // sent behind it on the same connection is not (it would bypass the
    // head check), and the connection closes.
    let (status, body) = exchange(
        &socket,
        b"GET /v1/status HTTP/1.1\r\nhost: x\r\n\r\nGET /v1/nope HTTP/1.1\r\nhost: x\r\n\r\n",
    )?;
    ensure!(status == 200, "status: {status} {body}");
    ensure!(
        !body.contains("HTTP/1.1"),
        "a second response on the connection: {body}"
    );
    ensure!(
        allocations()? == before,
        "refused requests changed what is stored"
    );
    let verify = agent.cli(["verify"])?;
    ensure!(verify.status.success(), "verify after the refusals");
    agent.stop()?;
    Ok(())
}
