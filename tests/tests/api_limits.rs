//! The API cannot be starved of connections or descriptors: connections
//! that never finish their headers, or sit idle, are closed after
//! `api_header_timeout`, and at most `api_max_connections` are served at
//! once, so an agent under a 1,024-descriptor limit keeps serving and
//! reconciling while 1,100 clients hold idle connections. The metrics port
//! is bounded the same way.

use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use lockstep_tests::{AgentProc, Netns, delay_fsyncs, metrics_addr, privileged, wait_for};

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
    raise_own_nofile()?;
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

/// Raises this test process's descriptor limit to hold 1,100 connections.
fn raise_own_nofile() -> anyhow::Result<()> {
    let mut limit = libc::rlimit {
        rlim_cur: 4096,
        rlim_max: 4096,
    };
    // SAFETY: setrlimit reads the struct it is given.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) };
    // SAFETY: getrlimit writes the struct it is given.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
    ensure!(limit.rlim_cur >= 2048, "the test needs 2,048 descriptors");
    Ok(())
}

/// The metrics port is bounded like the API socket (#27 item 9): before,
/// it was served by `axum::serve` with no connection or header limits, and
/// 1,100 idle connections to it took every descriptor of an agent with a
/// 1,024 limit (accept failing, the periodic reconcile failing, the API
/// answering nothing).
#[test]
fn idle_metrics_connections_cannot_starve_the_agent() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("mlimits")?;
    let mut agent = AgentProc::start(&node, CONFIG)?;
    agent.kill9();
    agent.spawn_under(["sh", "-c", "ulimit -n 1024; exec \"$0\" \"$@\""])?;
    agent.wait_ready()?;
    let pid = agent.pid().context("agent pid")?;
    let addr = metrics_addr(&node)?;
    raise_own_nofile()?;
    let idle: Vec<TcpStream> = node.run(|| {
        (0..1100)
            .map(|_| TcpStream::connect_timeout(&addr, Duration::from_secs(5)))
            .take_while(Result::is_ok)
            .map(|c| c.map_err(anyhow::Error::from))
            .collect()
    })?;
    eprintln!("{} idle connections to the metrics port {addr}", idle.len());
    std::thread::sleep(Duration::from_millis(500));
    let fds = open_fds(pid);
    ensure!(
        fds < 1024 - 64,
        "the agent holds {fds} descriptors with {} idle metrics clients: no room left for its own work",
        idle.len()
    );
    let before = agent.log().matches("periodic reconcile failed").count();
    // The API answers while the metrics clients sit idle.
    agent
        .status_json()
        .filter(|s| s["ready"] == true)
        .context("the API did not answer with idle metrics clients")?;
    std::thread::sleep(Duration::from_secs(3));
    let after = agent.log().matches("periodic reconcile failed").count();
    ensure!(
        after == before,
        "the periodic reconcile failed while metrics clients were idle:\n{}",
        agent.log()
    );
    drop(idle);
    // Once they are gone (or timed out) a scrape answers.
    let scraped = wait_for("a metrics scrape", Duration::from_secs(30), || {
        node.exec("curl", ["-s", "-m", "5", &format!("http://{addr}/metrics")])
            .ok()
            .filter(|t| t.contains("lockstep_"))
            .map(|_| ())
    });
    scraped?;
    eprintln!("agent held {fds} descriptors with idle metrics clients; scrapes answer again");
    let verify = agent.cli(["verify"])?;
    ensure!(verify.status.success(), "verify after the metrics flood");
    agent.stop()?;
    Ok(())
}

/// A scrape never waits for the agent's lock (#27 item 9), which CNI calls
/// and commits hold. strace delays every fdatasync of the agent by 3 s, so
/// an allocation (committed under the lock) holds the lock that long; a
/// scrape meanwhile answers at once, from gauges at most one refresh old.
/// Before, every scrape took the lock and waited out the commit.
#[test]
fn a_scrape_never_waits_for_the_agent_lock() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("mlock")?;
    let mut agent = AgentProc::start(&node, CONFIG)?;
    let pid = agent.pid().context("agent pid")?;
    let addr = metrics_addr(&node)?;
    let scrape = || -> anyhow::Result<(Duration, String)> {
        let started = Instant::now();
        let url = format!("http://{addr}/metrics");
        let text = node.exec("curl", ["-s", "-m", "20", url.as_str()])?;
        Ok((started.elapsed(), text))
    };
    let (_, text) = scrape()?;
    ensure!(
        text.contains("lockstep_pool_allocated"),
        "first scrape:\n{text}"
    );
    let mut strace = delay_fsyncs(pid, Duration::from_secs(3))?;
    std::thread::sleep(Duration::from_millis(800));
    let (allocated, during) = std::thread::scope(|s| {
        let alloc = s.spawn(|| {
            let started = Instant::now();
            let out = agent.cli([
                "allocate", "--kind", "endpoint", "--name", "slow", "--family", "ipv4",
            ]);
            (started.elapsed(), out)
        });
        std::thread::sleep(Duration::from_millis(500));
        let during = scrape();
        (alloc.join(), during)
    });
    // SAFETY: kill has no memory preconditions; SIGINT makes strace detach.
    unsafe { libc::kill(strace.id() as i32, libc::SIGINT) };
    let _ = strace.wait();
    let (took, out) = allocated.map_err(|_| anyhow::anyhow!("the allocating thread panicked"))?;
    ensure!(out?.status.success(), "the slow allocation failed");
    let (scraped_in, text) = during?;
    eprintln!("allocation held the agent {took:?}; a scrape meanwhile took {scraped_in:?}");
    ensure!(
        took >= Duration::from_millis(2500),
        "the allocation took {took:?}: its commit was not delayed, so this proves nothing"
    );
    ensure!(
        scraped_in < Duration::from_secs(1),
        "a scrape waited {scraped_in:?} for the agent's lock"
    );
    ensure!(
        text.contains("lockstep_pool_allocated"),
        "scrape during the commit:\n{text}"
    );
    // Within a refresh the gauges show the allocation.
    wait_for(
        "the gauges to show the allocation",
        Duration::from_secs(10),
        || {
            scrape()
                .ok()?
                .1
                .lines()
                .any(|l| {
                    l.starts_with("lockstep_pool_allocated{")
                        && l.contains("ipv4")
                        && l.ends_with(" 1")
                })
                .then_some(())
        },
    )?;
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
