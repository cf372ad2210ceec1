//! c. Full plugins side by side: `lockstep` (veth, addresses, routes, map
//!    entries, `from_endpoint` attached) against `ptp` + `host-local`, both
//!    started inside the node namespace (ptp makes its host veth where it
//!    runs; lockstep's agent runs there), in alternating blocks. Each ADD
//!    goes into a namespace of a ring that is not reused before the
//!    previous DEL's veth is surely gone, as a runtime gives every pod a new
//!    namespace.

use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use serde_json::{Value, json};

use super::{World, median, ms, percentile, plugin};

const PTP: &str = "/usr/lib/cni/ptp";
const PAIRS: usize = 200;
const BLOCK: usize = 25;
const WARMUP: usize = 10;
const RING: usize = 40;

/// Runs `program` as a runtime would, inside the namespace `netns` (entered
/// between fork and exec, so nothing else is timed); returns the time from
/// spawn to exit and its output.
fn invoke_in(
    netns: &std::fs::File,
    program: &str,
    env: &[(&str, &str)],
    stdin: &[u8],
) -> anyhow::Result<(Duration, Value)> {
    let fd = netns.as_raw_fd();
    let mut cmd = Command::new(program);
    cmd.env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: setns is async-signal-safe; the closure touches nothing else.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let started = Instant::now();
    let mut child = cmd.spawn().with_context(|| format!("starting {program}"))?;
    child.stdin.take().context("stdin")?.write_all(stdin)?;
    let out = child.wait_with_output()?;
    let took = started.elapsed();
    let text = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "{program} {env:?} failed ({}): {text} {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let value = if text.trim().is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text)?
    };
    Ok((took, value))
}

struct Full {
    name: &'static str,
    program: String,
    config: Vec<u8>,
    cni_path: &'static str,
    add: Vec<f64>,
    del: Vec<f64>,
}

impl Full {
    fn pair(
        &mut self,
        node: &std::fs::File,
        id: &str,
        netns: &Path,
        record: bool,
    ) -> anyhow::Result<()> {
        let netns = netns.to_str().context("utf-8")?;
        let env = |cmd| {
            [
                ("CNI_COMMAND", cmd),
                ("CNI_CONTAINERID", id),
                ("CNI_NETNS", netns),
                ("CNI_IFNAME", "eth0"),
                ("CNI_PATH", self.cni_path),
            ]
        };
        let (add, result) = invoke_in(node, &self.program, &env("ADD"), &self.config)?;
        ensure!(
            result["ips"][0]["address"].as_str().is_some(),
            "{}: unexpected ADD result {result}",
            self.name
        );
        let (del, _) = invoke_in(node, &self.program, &env("DEL"), &self.config)?;
        if record {
            self.add.push(ms(add));
            self.del.push(ms(del));
        }
        Ok(())
    }
}

/// Part c; pushes the summary rows.
pub fn side_by_side(world: &mut World, node: &Path, rows: &mut Vec<String>) -> anyhow::Result<()> {
    ensure!(
        Path::new(PTP).exists(),
        "{PTP} is missing (apt-get install containernetworking-plugins)"
    );
    let node_fd = std::fs::File::open(node).with_context(|| format!("{}", node.display()))?;
    let ring: Vec<PathBuf> = (0..RING)
        .map(|i| world.netns(&format!("full{i}")))
        .collect::<anyhow::Result<_>>()?;
    let mut lockstep = Full {
        name: "lockstep",
        program: plugin().to_string(),
        config: json!({"cniVersion": "1.0.0", "name": "bench", "type": "lockstep",
                       "agentSocket": world.socket()})
        .to_string()
        .into_bytes(),
        cni_path: "/opt/cni/bin",
        add: Vec::new(),
        del: Vec::new(),
    };
    let mut ptp = Full {
        name: "ptp + host-local",
        program: PTP.to_string(),
        config: json!({"cniVersion": "1.0.0", "name": "bench-ptp", "type": "ptp",
                       "ipam": {"type": "host-local",
                                "dataDir": world.dir.join("host-local-full"),
                                "ranges": [[{"subnet": "10.72.0.0/22"}]]}})
        .to_string()
        .into_bytes(),
        cni_path: "/usr/lib/cni",
        add: Vec::new(),
        del: Vec::new(),
    };
    let mut slot = 0usize;
    let mut next = || {
        slot += 1;
        ring[slot % RING].clone()
    };
    for i in 0..WARMUP {
        lockstep.pair(&node_fd, &format!("fwarm-{i}"), &next(), false)?;
        ptp.pair(&node_fd, &format!("fwarm-{i}"), &next(), false)?;
    }
    let started = Instant::now();
    let mut n = 0;
    while n < PAIRS {
        let order: [&mut Full; 2] = if (n / BLOCK).is_multiple_of(2) {
            [&mut lockstep, &mut ptp]
        } else {
            [&mut ptp, &mut lockstep]
        };
        for p in order {
            for i in n..n + BLOCK {
                p.pair(&node_fd, &format!("full-{i}"), &next(), true)?;
            }
        }
        n += BLOCK;
    }
    let took = started.elapsed();
    println!(
        "\nc. {PAIRS} sequential full ADD+DEL pairs each, both run inside the node netns ({:.1} s, blocks of {BLOCK}, alternating; {RING} container netns in a ring):",
        took.as_secs_f64()
    );
    println!(
        "   {:<22} {:>10} {:>10} {:>10} {:>10}",
        "per call (ms)", "ADD p50", "ADD p99", "DEL p50", "DEL p99"
    );
    for p in [&lockstep, &ptp] {
        println!(
            "   {:<22} {:>10.3} {:>10.3} {:>10.3} {:>10.3}",
            p.name,
            median(&p.add),
            percentile(&p.add, 0.99),
            median(&p.del),
            percentile(&p.del, 0.99)
        );
    }
    let (la, ld) = (median(&lockstep.add), median(&lockstep.del));
    let (pa, pd) = (median(&ptp.add), median(&ptp.del));
    let (ra, rd) = (pa / la, pd / ld);
    // Reported beside the reference plugins, not judged (since issue 42):
    // both ADDs are mostly the kernel's work of making the veth pair and
    // routing it, and both DELs wait for the kernel to delete the veth
    // (lockstep's is answered once the container's interface is gone,
    // #27 item 8), so these ratios sit where the kernel puts them (the
    // agent's own share is judged against the exec floor in part a).
    rows.push(format!(
        "{:<44} {:>16} {:>12} (report)",
        "full ADD median: ptp+host-local / lockstep",
        format!("{ra:.2}x ({la:.2} vs {pa:.2} ms)"),
        ""
    ));
    rows.push(format!(
        "{:<44} {:>16} {:>12} (report)",
        "full DEL median: ptp+host-local / lockstep",
        format!("{rd:.2}x ({ld:.2} vs {pd:.2} ms)"),
        ""
    ));
    Ok(())
}
