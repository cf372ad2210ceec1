//! Kills aimed at start-up, the moment random kills while serving miss.
//!
//! Each round makes 20–510 acknowledged changes (allocations and releases,
//! every one answered 2xx), SIGKILLs the idle agent, starts it again under
//! `strace`, which SIGKILLs it at its k-th write to `lockstep.redb` (k =
//! 1..=10 in CI, up to 40 in the long form): inside redb's recovery, the
//! store's replay checkpoint, or the first commits after. Then it starts the agent
//! normally and compares what it holds with the ledger of acknowledgements:
//! the agent was idle at both kills, so it must hold exactly the ledger —
//! nothing lost, nothing released coming back — and `lockstep verify` must
//! agree with the maps. A store that no longer opens fails the round.
//!
//! Bounded for CI (`LOCKSTEP_STARTUP_KILLS`, default 40 rounds, k ≤ 10); the
//! long form (`cargo xtask crash-startup 1000 40`: rounds and largest k) and
//! its figures are in `docs/store.md`. A k beyond the writes a start-up makes
//! lets the start finish; the test says how many kills landed during
//! start-up and fails if too few did.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use hyper::Method;
use lockstep::client::call;
use lockstep_tests::ledger::Rng;
use lockstep_tests::{AgentProc, Netns, privileged};
use serde_json::{Value, json};

const POOL: &str = "boot";
const CONFIG: &str = r#"
reconcile_interval = "1h"
[[pools]]
name = "boot"
ipv4 = ["10.61.0.0/20"]
ipv6 = ["fd00:61::/116"]
"#;

/// The write syscalls: the kill lands on the k-th write to the database
/// file (strace counts each syscall on its own; redb writes with `pwrite64`,
/// and under SIGKILL the page cache survives, so a kill before a sync is the
/// same as one before the next write).
const WRITES: &str = "pwrite64,pwritev,pwritev2,write,writev";
/// Above this many held allocations, rounds release more than they allocate,
/// so the long form stays inside the pool.
const HELD_TARGET: usize = 1500;

fn env_usize(name: &str, default: usize) -> anyhow::Result<usize> {
    match std::env::var(name) {
        Ok(v) => v.parse().with_context(|| format!("{name}={v}")),
        Err(_) => Ok(default),
    }
}

/// One acknowledged allocation: (family, address, generation).
type Held = (&'static str, IpAddr, u64);

fn owner(id: &str) -> Value {
    json!({"owner": "resource", "kind": "boot-test", "name": id})
}

/// Makes `n` acknowledged changes; any refusal or lost answer fails (the
/// agent is healthy and nothing else runs).
fn churn(
    rt: &tokio::runtime::Runtime,
    agent: &AgentProc,
    ledger: &mut BTreeMap<String, Held>,
    rng: &mut Rng,
    round: usize,
    n: usize,
) -> anyhow::Result<()> {
    let socket = agent.socket();
    for j in 0..n {
        let release_odds = if ledger.len() > HELD_TARGET { 2 } else { 4 };
        if !ledger.is_empty() && rng.below(release_odds) == 0 {
            let pick = rng.below(ledger.len() as u64) as usize;
            let id = ledger.keys().nth(pick).cloned().context("picked")?;
            let (family, address, generation) = ledger[&id];
            let body = json!({"pool": POOL, "family": family, "owner": owner(&id), "generation": generation});
            let v = rt
                .block_on(call(&socket, Method::POST, "/v1/release", Some(body)))
                .with_context(|| format!("round {round}: release of {id}"))?;
            ensure!(
                v["address"].as_str() == Some(&address.to_string()),
                "round {round}: release of {id} answered {v}"
            );
            ledger.remove(&id);
        } else {
            let id = format!("boot-{round}-{j}");
            let family = if rng.below(2) == 0 { "ipv4" } else { "ipv6" };
            let body = json!({"pool": POOL, "family": family, "owner": owner(&id)});
            let v = rt
                .block_on(call(&socket, Method::POST, "/v1/allocations", Some(body)))
                .with_context(|| format!("round {round}: allocation of {id}"))?;
            let address: IpAddr = v["address"]
                .as_str()
                .context("no address")?
                .parse()
                .context("address")?;
            let generation = v["generation"].as_u64().context("no generation")?;
            ledger.insert(id, (family, address, generation));
        }
    }
    Ok(())
}

/// What the agent holds, by owner name, checked against the ledger exactly.
fn compare(
    rt: &tokio::runtime::Runtime,
    agent: &AgentProc,
    ledger: &BTreeMap<String, Held>,
    round: usize,
    k: u64,
) -> anyhow::Result<()> {
    let all = rt
        .block_on(call(&agent.socket(), Method::GET, "/v1/allocations", None))
        .context("GET /v1/allocations")?;
    let mut held: BTreeMap<String, (IpAddr, u64)> = BTreeMap::new();
    for a in all.as_array().context("allocations is not a list")? {
        let name = a["owner"]["name"]
            .as_str()
            .context("owner name")?
            .to_string();
        let address: IpAddr = a["address"].as_str().context("address")?.parse()?;
        let generation = a["generation"].as_u64().context("generation")?;
        if let Some(other) = held.insert(name.clone(), (address, generation)) {
            bail!("round {round} (k={k}): {name} holds {address} and {other:?}");
        }
    }
    let lost: Vec<&String> = ledger.keys().filter(|id| !held.contains_key(*id)).collect();
    let extra: Vec<&String> = held.keys().filter(|id| !ledger.contains_key(*id)).collect();
    let changed: Vec<&String> = ledger
        .iter()
        .filter(|(id, (_, a, g))| held.get(*id).is_some_and(|h| *h != (*a, *g)))
        .map(|(id, _)| id)
        .collect();
    ensure!(
        lost.is_empty() && extra.is_empty() && changed.is_empty(),
        "round {round} (killed at write {k}): {} acknowledged allocations lost (e.g. {:?}), \
         {} acknowledged releases undone (e.g. {:?}), {} changed (e.g. {:?});\nagent log:\n{}",
        lost.len(),
        lost.iter().take(3).collect::<Vec<_>>(),
        extra.len(),
        extra.iter().take(3).collect::<Vec<_>>(),
        changed.len(),
        changed.iter().take(3).collect::<Vec<_>>(),
        tail(&agent.log(), 40),
    );
    let out = agent.cli(["verify"])?;
    ensure!(
        out.status.success(),
        "round {round} (k={k}): verify failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Processes whose command line names this agent's config: none may be
/// left once it was killed (a killed strace leaves its tracee running).
fn strays(agent: &AgentProc) -> Vec<String> {
    let config = agent.config.to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|e| {
            let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            cmd.contains(&config)
                .then(|| format!("{}: {cmd}", e.file_name().to_string_lossy()))
        })
        .collect()
}

/// Starts the agent under strace, which kills it at its `k`-th write to the
/// database; returns whether the kill landed before the agent was ready.
/// Either way nothing of it runs afterwards.
fn start_killed_at_write(agent: &mut AgentProc, k: u64) -> anyhow::Result<bool> {
    let landed = run_killed_at_write(agent, k);
    agent.kill9();
    // A SIGKILLed process takes a moment to finish exiting (its threads,
    // its memory); only one that outlives that was left running.
    let gone = Instant::now();
    let mut left = strays(agent);
    while !left.is_empty() && gone.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(10));
        left = strays(agent);
    }
    ensure!(left.is_empty(), "processes left after the kill: {left:?}");
    landed
}

fn run_killed_at_write(agent: &mut AgentProc, k: u64) -> anyhow::Result<bool> {
    let db = agent.dir.path().join("state").join("lockstep.redb");
    let inject = format!("inject={WRITES}:signal=KILL:when={k}");
    agent.spawn_under([
        "strace".as_ref(),
        "-f".as_ref(),
        "-qq".as_ref(),
        "-o".as_ref(),
        "/dev/null".as_ref(),
        "-P".as_ref(),
        db.as_os_str(),
        "-e".as_ref(),
        format!("trace={WRITES}").as_ref(),
        "-e".as_ref(),
        inject.as_ref(),
    ] as [&std::ffi::OsStr; 11])?;
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(30) {
        if agent.exited()?.is_some() {
            return Ok(true);
        }
        if agent
            .status_json()
            .is_some_and(|s| s["ready"].as_bool() == Some(true))
        {
            return Ok(false);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    bail!(
        "agent under strace neither died nor became ready:\n{}",
        agent.log()
    )
}

#[test]
fn kills_during_start_up_lose_no_acknowledged_commit() -> anyhow::Result<()> {
    privileged!();
    let rounds = env_usize("LOCKSTEP_STARTUP_KILLS", 40)?;
    let max_k = env_usize("LOCKSTEP_STARTUP_KILL_MAX_K", 10)? as u64;
    let seed = match std::env::var("LOCKSTEP_STARTUP_KILL_SEED") {
        Ok(s) => s.parse().context("LOCKSTEP_STARTUP_KILL_SEED")?,
        Err(_) => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_nanos() as u64,
    };
    eprintln!("start-up kill test: {rounds} rounds, k ≤ {max_k}, seed {seed}");
    let node = Netns::new("boot")?;
    let mut agent = AgentProc::start(&node, CONFIG)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut rng = Rng(seed);
    let mut ledger = BTreeMap::new();
    let started = Instant::now();
    let (mut killed, mut ready_first, mut changes) = (0usize, 0usize, 0usize);
    let mut killed_at = BTreeMap::<u64, usize>::new();
    let mut slowest = Duration::ZERO;
    for round in 0..rounds {
        let n = 20 + rng.below(491) as usize;
        churn(&rt, &agent, &mut ledger, &mut rng, round, n)?;
        changes += n;
        agent.kill9();
        let k = 1 + rng.below(max_k);
        if start_killed_at_write(&mut agent, k)? {
            killed += 1;
            *killed_at.entry(k).or_default() += 1;
        } else {
            ready_first += 1;
        }
        // A start is slow only when the disk is (a sync under heavy
        // writeback from parallel builds took 24 s once): wait long, report
        // the slowest.
        agent.kill9();
        agent.spawn_under::<[&str; 0], &str>([])?;
        let took = agent
            .wait_ready_within(Duration::from_secs(120))
            .with_context(|| format!("round {round}: start after a kill at write {k}"))?;
        slowest = slowest.max(took);
        compare(&rt, &agent, &ledger, round, k)?;
    }
    eprintln!(
        "start-up kill test: {rounds} rounds in {:.1?}: {changes} acknowledged changes, \
         {killed} kills during start-up (by k: {killed_at:?}), {ready_first} starts that \
         finished before their k-th write; {} allocations held at the end; slowest start \
         after a kill {slowest:?}; 0 lost, 0 unopenable",
        started.elapsed(),
        ledger.len(),
    );
    ensure!(
        killed * 3 >= rounds,
        "only {killed} of {rounds} kills landed during start-up: the test aims wrong"
    );
    Ok(())
}
