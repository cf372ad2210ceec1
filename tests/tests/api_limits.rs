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
