//! 4. The agent's footprint under churn: resident memory and open
//!    descriptors of the agent process after a warm-up, then after 100k
//!    (10k in a smoke run) allocate/release cycles through the API (16 clients), read from
//!    `/proc/<pid>`. Goal: RSS flat within 5 MiB, no descriptor growth.

use std::path::Path;
use std::time::Instant;

use hyper::Method;
use lockstep::client::call;
use serde_json::json;

use super::{Scratch, smoke, spawn, wait_ready};

const CLIENTS: u64 = 16;

/// Resident set (KiB) and open descriptors of process `pid`.
fn measure(pid: u32) -> (u64, usize) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS");
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("fd dir")
        .count();
    (rss, fds)
}

async fn cycles(socket: &Path, total: u64, tag: &str) {
    let mut tasks = Vec::new();
    for c in 0..CLIENTS {
        let socket = socket.to_path_buf();
        let tag = tag.to_string();
        tasks.push(tokio::spawn(async move {
            for n in 0..total / CLIENTS {
                let owner = json!({"owner": "resource", "kind": "bench", "name": format!("{tag}-{c}-{n}")});
                let a = call(&socket, Method::POST, "/v1/allocations",
                    Some(json!({"pool": "default", "family": "ipv4", "owner": owner}))).await.expect("allocate");
                call(&socket, Method::POST, "/v1/release", Some(json!({
                    "pool": "default", "family": "ipv4", "owner": owner, "generation": a["generation"],
                }))).await.expect("release");
            }
        }));
    }
    for t in tasks {
        t.await.expect("client");
    }
}

/// Runs part 4 and prints its rows; returns whether both goals held.
pub fn footprint(rt: &tokio::runtime::Runtime) -> bool {
    // A smoke run (`shared/smoke.rs`) makes a tenth of the cycles.
    let (warmup, cycles_n) = smoke::size((10_000, 100_000), (1_000, 10_000));
    let scratch = Scratch::new("footprint");
    let config = scratch.config("[[pools]]\nname = \"default\"\nipv4 = [\"10.62.0.0/16\"]\n");
    let mut agent = spawn(&config);
    let pid = agent.id();
    rt.block_on(wait_ready(&scratch.socket()));
    let start = measure(pid);
    rt.block_on(cycles(&scratch.socket(), warmup, "warm"));
    let before = measure(pid);
    let started = Instant::now();
    rt.block_on(cycles(&scratch.socket(), cycles_n, "run"));
    let took = started.elapsed();
    let after = measure(pid);
    let _ = agent.kill();
    let _ = agent.wait();
    let grew_kib = after.0.saturating_sub(before.0);
    let rss_ok = grew_kib <= 5 * 1024;
    let fds_ok = after.1 <= before.1;
    println!(
        "footprint over {cycles_n} allocate/release cycles ({CLIENTS} clients, {:.1} s; warm-up {warmup}):",
        took.as_secs_f64()
    );
    println!(
        "  RSS: at ready {:.1} MiB, after warm-up {:.1} MiB, after {cycles_n} cycles {:.1} MiB: grew {:.2} MiB (goal <= 5 MiB) {}",
        start.0 as f64 / 1024.0,
        before.0 as f64 / 1024.0,
        after.0 as f64 / 1024.0,
        grew_kib as f64 / 1024.0,
        if rss_ok { "PASS" } else { "FAIL" }
    );
    println!(
        "  open descriptors: at ready {}, after warm-up {}, after {cycles_n} cycles {} (goal: no growth) {}",
        start.1,
        before.1,
        after.1,
        if fds_ok { "PASS" } else { "FAIL" }
    );
    rss_ok && fds_ok
}
