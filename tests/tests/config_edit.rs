//! A config edit that drops a CIDR of a pool and a whole pool, applied by a
//! restart while endpoints in them run: they keep their addresses, their map
//! entries and their traffic; the dropped ranges drain (nothing new comes
//! from them, `pools`, `verify` and metrics show them with their holders) and
//! go only when their holders are released, by their own DEL or by the
//! operator's `pools release-draining`, which names what it removes.

use std::collections::BTreeSet;
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, ensure};
use lockstep_tests::seqping::SeqPing;
use lockstep_tests::{AgentProc, Netns, lockstep_bin, privileged, unique};
use serde_json::{Value, json};

const BEFORE: &str = r#"
reconcile_interval = "300ms"
default_pool = "a"
[[pools]]
name = "a"
ipv4 = ["10.77.0.0/24", "10.77.1.0/29"]
[[pools]]
name = "b"
ipv4 = ["10.78.0.0/24"]
"#;

/// The edit: pool a loses 10.77.1.0/29, pool b is gone.
const AFTER: &str = r#"
reconcile_interval = "300ms"
default_pool = "a"
[[pools]]
name = "a"
ipv4 = ["10.77.0.0/24"]
"#;

/// One full-plugin call, as a runtime makes it; `Ok` with the result only
/// when the plugin succeeded.
fn cni(
    agent: &AgentProc,
    command: &str,
    id: &str,
    ns: &Netns,
    runtime: Value,
) -> anyhow::Result<Result<Value, Value>> {
    let conf = json!({
        "cniVersion": "1.0.0",
        "name": "lockstep-test",
        "type": "lockstep",
        "agentSocket": agent.socket().display().to_string(),
        "runtimeConfig": runtime,
    });
    let mut child = Command::new(lockstep_bin())
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", id)
        .env("CNI_IFNAME", "eth0")
        .env("CNI_NETNS", ns.path())
        .env("CNI_PATH", "/opt/cni/bin")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    child
        .stdin
        .take()
        .context("stdin")?
        .write_all(conf.to_string().as_bytes())?;
    let out = child.wait_with_output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let v: Value = if text.trim().is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text).with_context(|| format!("plugin said {text:?}"))?
    };
    Ok(if out.status.success() { Ok(v) } else { Err(v) })
}

fn add(agent: &AgentProc, id: &str, ns: &Netns, runtime: Value) -> anyhow::Result<String> {
    let result =
        cni(agent, "ADD", id, ns, runtime)?.map_err(|e| anyhow::anyhow!("ADD {id} failed: {e}"))?;
    let addr = result["ips"][0]["address"].as_str().context("no address")?;
    Ok(addr.split('/').next().unwrap_or_default().to_string())
}

/// Allocations as (address, owner, generation): what must not change.
fn allocations(agent: &AgentProc) -> anyhow::Result<BTreeSet<String>> {
    Ok(agent
        .json(["allocations", "-o", "json"])?
        .as_array()
        .into_iter()
        .flatten()
        .map(|a| format!("{} {} {}", a["address"], a["owner"], a["generation"]))
        .collect())
}

/// The draining ranges of a pool as (cidr, holder addresses).
fn draining(agent: &AgentProc, pool: &str) -> anyhow::Result<Vec<(String, BTreeSet<String>)>> {
    let pools = agent.json(["pools", "-o", "json"])?;
    let Some(p) = pools
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == pool)
    else {
        return Ok(Vec::new());
    };
    Ok(p["draining_ranges"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| {
            let holders = r["holders"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|a| a["address"].as_str().map(str::to_string))
                .collect();
            (r["cidr"].as_str().unwrap_or("?").to_string(), holders)
        })
        .collect())
}

fn holders(ranges: &[(String, BTreeSet<String>)]) -> BTreeSet<String> {
    ranges.iter().flat_map(|(_, h)| h.iter().cloned()).collect()
}

fn verify_ok(agent: &AgentProc) -> anyhow::Result<Value> {
    let v = agent.json(["verify", "-o", "json"])?;
    ensure!(v["ok"] == true, "verify found drift: {v}");
    Ok(v)
}

fn metrics(node: &Netns) -> anyhow::Result<String> {
    node.exec(
        "sh",
        [
            "-c",
            "curl -s http://$(ss -ltnH | awk '{print $4}' | head -1)/metrics",
        ],
    )
}

/// Host entries (/32) of the pinned IPCACHE, and the pinned ENDPOINTS,
/// read from the pins directly.
fn programmed(agent: &AgentProc) -> anyhow::Result<(BTreeSet<String>, Value)> {
    let dump = agent.maps_dump()?;
    let hosts = dump["IPCACHE_V4"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| {
            e["prefix"]
                .as_str()?
                .strip_suffix("/32")
                .map(str::to_string)
        })
        .collect();
    Ok((hosts, dump["ENDPOINTS"].clone()))
}

#[test]
fn a_config_edit_never_takes_an_address_from_a_running_endpoint() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("node")?;
    node.sysctl("net.ipv4.ip_forward", "1")?;
    let mut agent = AgentProc::start(&node, BEFORE)?;
    let tag = unique("ce");
    let ns: Vec<Netns> = (0..5)
        .map(|i| Netns::new(&format!("c{i}")))
        .collect::<anyhow::Result<_>>()?;
    let ids: Vec<String> = (0..5).map(|i| format!("{tag}-{i}")).collect();
    // c0, c1 in a's CIDR that goes; c2 in pool b; c3 in a's CIDR that stays.
    let c0 = add(
        &agent,
        &ids[0],
        &ns[0],
        json!({"pool": "a", "ips": ["10.77.1.2"]}),
    )?;
    let c1 = add(
        &agent,
        &ids[1],
        &ns[1],
        json!({"pool": "a", "ips": ["10.77.1.3"]}),
    )?;
    let c2 = add(&agent, &ids[2], &ns[2], json!({"pool": "b"}))?;
    let c3 = add(&agent, &ids[3], &ns[3], json!({}))?;
    ensure!(c3.starts_with("10.77.0."), "{c3}");
    verify_ok(&agent)?;
    let before = allocations(&agent)?;
    let (hosts_before, endpoints_before) = programmed(&agent)?;
    for a in [&c0, &c1, &c2, &c3] {
        ensure!(
            hosts_before.contains(a),
            "{a} not programmed: {hosts_before:?}"
        );
    }

    // Traffic from the endpoint that stays to the ones whose ranges go,
    // after a warm-up (neighbour entries) outside the measurement.
    for to in [&c0, &c2] {
        ns[3].exec("ping", ["-c", "3", "-i", "0.2", "-W", "2", to.as_str()])?;
    }
    let mut cmd = ns[3].command("ping");
    cmd.args(["-i", "0.05", "-W", "2", "-w", "300", &c0]);
    let to_c0 = SeqPing::spawn(cmd, format!("{c3} -> {c0}"))?;
    let mut cmd = ns[3].command("ping");
    cmd.args(["-i", "0.05", "-W", "2", "-w", "300", &c2]);
    let to_c2 = SeqPing::spawn(cmd, format!("{c3} -> {c2}"))?;
    to_c0.wait_replies(10, Duration::from_secs(30))?;
    to_c2.wait_replies(10, Duration::from_secs(30))?;

    // The edit, applied by a restart.
    agent.rewrite_config(|text| text.replace(BEFORE, AFTER))?;
    let took = agent.restart()?;
    to_c0.wait_replies(20, Duration::from_secs(30))?;
    to_c2.wait_replies(20, Duration::from_secs(30))?;
    let t0 = to_c0.stop()?;
    let t2 = to_c2.stop()?;
    eprintln!(
        "restart with the edit took {took:?}; ping -> {c0}: {} replies, missing {:?}; \
         ping -> {c2}: {} replies, missing {:?}",
        t0.received, t0.missing, t2.received, t2.missing
    );
    ensure!(
        t0.received > 40 && t0.missing.is_empty() && t2.missing.is_empty(),
        "packets lost"
    );

    // Every allocation stored as it was, and programmed: the restart's
    // reconcile found nothing to change, verify agrees, the pinned map has
    // every entry.
    ensure!(allocations(&agent)? == before, "allocations changed");
    let status = agent.json(["status", "-o", "json"])?;
    ensure!(
        status["restored"]["added"] == 0 && status["restored"]["removed"] == 0,
        "start-up reconcile changed the maps: {status}"
    );
    ensure!(
        programmed(&agent)? == (hosts_before.clone(), endpoints_before),
        "map entries changed"
    );
    let v = verify_ok(&agent)?;
    ensure!(
        v["draining"].as_array().map_or(0, Vec::len) == 2,
        "verify names the draining ranges: {v}"
    );
    let text = String::from_utf8_lossy(&agent.cli(["verify"])?.stdout).into_owned();
    ensure!(
        text.contains("agree") && text.contains("draining"),
        "{text}"
    );

    // `pools` shows both as draining with their holders.
    let a = draining(&agent, "a")?;
    let b = draining(&agent, "b")?;
    ensure!(
        holders(&a) == BTreeSet::from([c0.clone(), c1.clone()]),
        "pool a: {a:?}"
    );
    ensure!(holders(&b) == BTreeSet::from([c2.clone()]), "pool b: {b:?}");
    let pools = agent.json(["pools", "-o", "json"])?;
    ensure!(
        pools
            .as_array()
            .into_iter()
            .flatten()
            .any(|p| p["name"] == "b" && p["retired"] == true),
        "{pools}"
    );
    let m = metrics(&node)?;
    let a_range = &a[0].0;
    ensure!(
        m.contains(&format!(
            "lockstep_pool_draining{{pool=\"a\",cidr=\"{a_range}\"}} 2"
        )),
        "{m}"
    );

    // Nothing new from the dropped ranges.
    let c4 = add(&agent, &ids[4], &ns[4], json!({}))?;
    ensure!(c4.starts_with("10.77.0."), "new address {c4}");
    let refused = cni(
        &agent,
        "ADD",
        &format!("{tag}-x"),
        &ns[4],
        json!({"pool": "a", "ips": ["10.77.1.4"]}),
    )?;
    ensure!(
        refused.is_err(),
        "an address of the dropped CIDR was handed out: {refused:?}"
    );
    let refused = cni(
        &agent,
        "ADD",
        &format!("{tag}-y"),
        &ns[4],
        json!({"pool": "b"}),
    )?;
    ensure!(refused.is_err(), "the dropped pool handed out: {refused:?}");

    // A holder's own DEL: the range still drains for the other.
    cni(&agent, "DEL", &ids[1], &ns[1], json!({}))?.map_err(|e| anyhow::anyhow!("DEL: {e}"))?;
    // (A full DEL releases once its host veth is gone: a moment later.)
    lockstep_tests::wait_for("the DEL's release", Duration::from_secs(10), || {
        let left = draining(&agent, "a").ok()?;
        (holders(&left) == BTreeSet::from([c0.clone()])).then_some(())
    })?;

    // The operator's release: a dry run names exactly what goes and
    // changes nothing; --yes releases exactly that.
    let dry = agent.json(["pools", "release-draining", "--pool", "a", "-o", "json"])?;
    ensure!(dry["dry_run"] == true, "{dry}");
    let named: Vec<&str> = dry["released"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|a| a["address"].as_str())
        .collect();
    ensure!(named == [c0.as_str()], "{dry}");
    ensure!(dry["attachments"] == json!([[ids[0], "eth0"]]), "{dry}");
    ensure!(holders(&draining(&agent, "a")?) == BTreeSet::from([c0.clone()]));
    let text = String::from_utf8_lossy(
        &agent
            .cli([
                "pools",
                "release-draining",
                "--pool",
                "a",
                "--cidr",
                "10.77.1.0/29",
            ])?
            .stdout,
    )
    .into_owned();
    ensure!(
        text.contains(&c0) && text.contains(&ids[0]) && text.contains("--yes"),
        "{text}"
    );
    let done = agent.json([
        "pools",
        "release-draining",
        "--pool",
        "a",
        "--yes",
        "-o",
        "json",
    ])?;
    ensure!(
        done["dry_run"] == false && done["released"][0]["address"] == c0.as_str(),
        "{done}"
    );
    // Unprogrammed at once; released once the reaper has the veth gone.
    lockstep_tests::wait_for("pool a's range to go", Duration::from_secs(10), || {
        draining(&agent, "a").ok()?.is_empty().then_some(())
    })?;
    lockstep_tests::wait_for(
        "the released endpoint's interface to go with its address",
        Duration::from_secs(10),
        || ns[0].ip(["link", "show", "eth0"]).is_err().then_some(()),
    )?;
    let refused = agent.cli([
        "pools",
        "release-draining",
        "--pool",
        "a",
        "--cidr",
        "10.77.0.0/24",
        "--yes",
    ])?;
    ensure!(
        !refused.status.success(),
        "an active CIDR is never released"
    );
    let done = agent.json([
        "pools",
        "release-draining",
        "--pool",
        "b",
        "--yes",
        "-o",
        "json",
    ])?;
    ensure!(done["released"][0]["address"] == c2.as_str(), "{done}");
    lockstep_tests::wait_for(
        "pool b to go with its last holder",
        Duration::from_secs(10),
        || {
            let pools = agent.json(["pools", "-o", "json"]).ok()?;
            (!pools.as_array()?.iter().any(|p| p["name"] == "b")).then_some(())
        },
    )?;
    let (hosts, _) = programmed(&agent)?;
    ensure!(
        !hosts.contains(&c0) && !hosts.contains(&c2) && hosts.contains(&c3),
        "{hosts:?}"
    );
    let v = verify_ok(&agent)?;
    ensure!(v["draining"].as_array().is_none_or(Vec::is_empty), "{v}");
    // The gauges refresh when a scrape finds the agent lock free (a reaper
    // batch may hold it at that moment).
    lockstep_tests::wait_for(
        "the draining gauge to go with the range",
        Duration::from_secs(5),
        || (!metrics(&node).ok()?.contains("lockstep_pool_draining{")).then_some(()),
    )?;

    for (id, n) in ids.iter().zip(&ns) {
        cni(&agent, "DEL", id, n, json!({}))?.map_err(|e| anyhow::anyhow!("DEL {id}: {e}"))?;
    }
    lockstep_tests::wait_for("every DEL's release", Duration::from_secs(10), || {
        let all = agent.json(["allocations", "-o", "json"]).ok()?;
        all.as_array()?.is_empty().then_some(())
    })?;
    Ok(())
}

/// A CIDR moved to another pool while held would give one address to two
/// pools: the agent refuses to start, names the holder, both pools and the
/// fix, and changes nothing; the previous config starts as before.
#[test]
fn a_held_cidr_moved_to_another_pool_is_refused_and_nothing_changes() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("node")?;
    let mut agent = AgentProc::start(&node, BEFORE)?;
    let held = agent.json([
        "allocate",
        "--pool",
        "a",
        "--address",
        "10.77.1.2",
        "--name",
        "x",
        "-o",
        "json",
    ])?;
    let addr = held["address"].as_str().context("address")?.to_string();
    let before = allocations(&agent)?;
    let moved = AFTER.to_string() + "[[pools]]\nname = \"b\"\nipv4 = [\"10.77.1.0/29\"]\n";
    agent.rewrite_config(|text| text.replace(BEFORE, &moved))?;
    // Started by hand, bounded: an agent that accepts the edit keeps
    // running, and is stopped here.
    agent.kill9();
    let mut child = Command::new("nsenter")
        .arg(format!("--net={}", node.path().display()))
        .arg("--")
        .arg(lockstep_bin())
        .args(["agent", "--config"])
        .arg(&agent.config)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let started = std::time::Instant::now();
    while child.try_wait()?.is_none() && started.elapsed() < Duration::from_secs(15) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let still_running = child.try_wait()?.is_none();
    if still_running {
        let _ = child.kill();
    }
    let out = child.wait_with_output()?;
    ensure!(
        !still_running,
        "the agent started with a held CIDR moved to another pool"
    );
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    ensure!(!out.status.success(), "started: {err}");
    ensure!(
        err.contains(&addr) && err.contains("10.77.1.0/29 of pool b") && err.contains("pool a"),
        "{err}"
    );
    agent.rewrite_config(|text| text.replace(&moved, BEFORE))?;
    agent.restart()?;
    ensure!(allocations(&agent)? == before, "allocations changed");
    verify_ok(&agent)?;
    Ok(())
}
