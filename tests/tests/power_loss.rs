//! Power loss: the agent's state directory is on `lossyfs`, which keeps in
//! memory every write no `fsync`/`fdatasync` made durable (and every
//! directory change no directory `fsync` did) and throws them away when the
//! power is cut. Eight clients allocate and release through the API, with the
//! ledger of `crash.rs` (`lockstep_tests::ledger`): after every cut and
//! restart, with the clients paused, every acknowledged allocation is there
//! with its address and generation, no acknowledged release is undone, no
//! address or owner is held twice, the generation never goes back, and
//! `lockstep verify` passes.
//!
//! - `power_cuts_under_load`: the clients run 20–300 ms, the agent is
//!   SIGKILLed and then the power cut (a dead process writes nothing more, so
//!   that is what a cut looks like to the store), alternately dropping every
//!   unsynced write or keeping random 4 KiB pieces of them (torn).
//! - `power_cuts_in_the_middle_of_checkpoints`: the cut is aimed at the
//!   database: lossyfs kills the agent at its k-th write to `lockstep.redb`
//!   (k in 1..=40) and cuts right there, in the middle of a checkpoint — one
//!   under load (the log half full), one at start-up (replaying and
//!   checkpointing what a crash left in the log), one at a clean shutdown,
//!   in turn. A round whose armed kill does not fire ends with a plain cut.
//!
//! - `a_failed_log_sync_refuses_its_whole_batch_and_no_restart_brings_it_back`:
//!   lossyfs fails one of the log's syncs (`EIO`), the moment a batch of
//!   commands shares: all of them refused, the agent stopped, and none
//!   held after the restart, with the failed record still readable or not.
//!
//! The first test's state directory is one the agent creates on the mount
//! (its name must survive the cuts as well), the second's is the mount
//! itself, as a node's hostPath.
//!
//! Every round is one power cut. Bounded for CI (`LOCKSTEP_POWER_CUTS`,
//! default 20 each); the long form is `cargo xtask crash power N`, its
//! figures in `docs/power-loss.md`. Each test prints its seed
//! (`LOCKSTEP_POWER_SEED` replays one) and a summary line.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail, ensure};
use lockstep_tests::ledger::{self, Gate, Model, Pool, Rng, Shared, StopOnDrop, clock_seed, get};
use lockstep_tests::lossyfs::{Cut, LossyFs};
use lockstep_tests::{AgentOptions, AgentProc, Netns, privileged};

const POOL: Pool = Pool {
    name: "power",
    v4_base: Ipv4Addr::new(10, 62, 0, 0),
    v4_prefix: 22,
    v6_base: Ipv6Addr::new(0xfd00, 0x62, 0, 0, 0, 0, 0, 0),
    v6_prefix: 118,
    owner_tag: "power",
};
/// The database file (store::DB_FILE): the armed kills watch its writes.
const DB: &str = "lockstep.redb";
/// The log file (store::LOG_FILE): the armed sync failures watch its syncs.
const LOG: &str = "lockstep.wal";
/// Rounds of the sync-failure test (bounded form; the long form runs as
/// many as `LOCKSTEP_POWER_CUTS`).
const SYNC_FAILURES: usize = 6;
/// Bounded form: cuts per test.
const DEFAULT_CUTS: usize = 20;
/// The armed kill lands on one of the first this many writes.
const MAX_K: u64 = 40;
/// How long the clients run waiting for a checkpoint to be cut.
const LOAD_LIMIT: Duration = Duration::from_secs(10);

fn cuts() -> anyhow::Result<usize> {
    match std::env::var("LOCKSTEP_POWER_CUTS") {
        Ok(v) => v
            .parse()
            .with_context(|| format!("LOCKSTEP_POWER_CUTS={v}")),
        Err(_) => Ok(DEFAULT_CUTS),
    }
}

fn seed(test: &str) -> anyhow::Result<u64> {
    let seed = match std::env::var("LOCKSTEP_POWER_SEED") {
        Ok(s) => s.parse().context("LOCKSTEP_POWER_SEED")?,
        Err(_) => clock_seed(),
    };
    eprintln!("{test}: seed {seed} (LOCKSTEP_POWER_SEED={seed} replays it)");
    Ok(seed)
}

/// The agent on a lossyfs mount in its own node namespace; torn down in
/// this order (agent, mount, namespace) also when a test fails.
struct World {
    agent: AgentProc,
    fs: LossyFs,
    _node: Netns,
}

impl World {
    /// `sub`: the state directory is a subdirectory of the mount that the
    /// agent creates (its name must survive the cuts too), else the mount
    /// itself, which exists before the agent as a node's hostPath does.
    fn start(tag: &str, sub: Option<&str>) -> anyhow::Result<Self> {
        let node = Netns::new(tag)?;
        let fs = LossyFs::mount(Path::new(env!("CARGO_BIN_EXE_lossyfs")))?;
        let state = match sub {
            Some(sub) => fs.path().join(sub),
            None => fs.path().to_path_buf(),
        };
        let agent = AgentProc::launch(
            &node,
            &AgentOptions {
                extra: POOL.config(),
                state_dir: Some(state),
                unready: false,
                bin: None,
            },
        )?;
        Ok(Self {
            agent,
            fs,
            _node: node,
        })
    }

    /// Starts the agent again after a cut, with the end of its log in the
    /// error if it does not come up.
    fn restart(&mut self, after: &str) -> anyhow::Result<Duration> {
        self.agent.restart().map_err(|e| {
            let first = e.to_string().lines().next().unwrap_or_default().to_string();
            anyhow!(
                "restart after {after} failed: {first}\nlast lines of the agent's log:\n{}",
                tail(&self.agent.log(), 40)
            )
        })
    }

    fn check(
        &self,
        rt: &tokio::runtime::Runtime,
        models: &[Model],
        shared: &Shared,
        round: usize,
        after: &str,
    ) -> anyhow::Result<()> {
        ledger::check(&POOL, rt, &self.agent, models, shared, round)
            .with_context(|| format!("after {after}"))
    }
}

/// What every test here drives its clients with: a runtime for the
/// checks, the gate, the shared counts, the clients' models and the test's
/// own random choices.
struct Clients {
    rt: tokio::runtime::Runtime,
    gate: Gate,
    shared: Shared,
    models: Vec<Model>,
    rng: Rng,
}

impl Clients {
    fn new(seed: u64) -> anyhow::Result<Self> {
        Ok(Self {
            rt: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?,
            gate: Gate::default(),
            shared: Shared::default(),
            models: ledger::models(),
            rng: Rng(seed),
        })
    }
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

fn cut_for(round: usize, rng: &mut Rng) -> Cut {
    if round.is_multiple_of(2) {
        Cut::Drop
    } else {
        Cut::Torn(rng.next_u64())
    }
}

#[test]
fn power_cuts_under_load_lose_no_acknowledged_change() -> anyhow::Result<()> {
    privileged!();
    let cuts = cuts()?;
    let seed = seed("power_cuts_under_load")?;
    let mut world = World::start("power", Some("state"))?;
    let socket = world.agent.socket();
    let Clients {
        rt,
        gate,
        shared,
        models,
        mut rng,
    } = Clients::new(seed)?;
    let started = Instant::now();
    let mut max_ready = Duration::ZERO;
    let (mut dropped, mut kept) = (0u64, 0u64);

    std::thread::scope(|s| -> anyhow::Result<()> {
        let _stop = StopOnDrop(&gate);
        ledger::spawn_clients(s, &POOL, &socket, &gate, &models, &shared, seed);
        for round in 0..cuts {
            gate.resume();
            std::thread::sleep(Duration::from_millis(20 + rng.below(281)));
            gate.hold();
            world.agent.kill9();
            let how = cut_for(round, &mut rng);
            let (d, k) = world.fs.cut(how)?;
            dropped += d;
            kept += k;
            gate.pause();
            let after = format!("power cut {} ({how})", round + 1);
            max_ready = max_ready.max(world.restart(&after)?);
            world.check(&rt, &models, &shared, round, &after)?;
        }
        Ok(())
    })?;

    // A clean stop checkpoints; a cut right after must lose nothing either.
    let status = world.agent.stop()?.context("agent was running")?;
    ensure!(status.success(), "SIGTERM is a clean exit: {status}");
    world.fs.cut(Cut::Drop)?;
    max_ready = max_ready.max(world.restart("a clean stop and a power cut")?);
    world.check(&rt, &models, &shared, cuts, "a clean stop and a power cut")?;

    let c = &shared.counts;
    let stats = world.fs.stats()?;
    eprintln!(
        "power_cuts_under_load: {cuts} cuts (+1 after a clean stop) in {:.1?}; {}; {} held at the end; \
         lossyfs: {} writes, {} fsyncs, {} directory fsyncs, {} unsynced bytes dropped, {} kept by torn cuts; \
         max time to ready {max_ready:?}",
        started.elapsed(),
        ledger::summary(c),
        ledger::held(&models),
        stats.writes,
        stats.fsyncs,
        stats.fsyncdirs,
        dropped,
        kept,
    );
    ensure!(
        stats.cuts == cuts as u64 + 1,
        "lossyfs counted {} cuts",
        stats.cuts
    );
    ensure!(
        get(&c.acked_allocations) >= 20 * cuts as u64,
        "too few acknowledged allocations"
    );
    ensure!(
        get(&c.acked_releases) >= 8 * cuts as u64,
        "too few acknowledged releases"
    );
    // A batch shares one sync; each client has one request out at a time,
    // so a batch holds at most one of each client's.
    ensure!(
        stats.fsyncs >= get(&c.acked_allocations) / models.len() as u64,
        "the agent synced less than once per batch of acknowledged allocations: is the state directory on lossyfs?"
    );
    ensure!(
        max_ready < Duration::from_secs(10),
        "restart took {max_ready:?}"
    );
    Ok(())
}

/// The dangerous moment of group commit: a batch's one log sync fails after
/// its commands changed the agent's memory and maps. Every command of the
/// batch must be refused (`503`, which the ledger takes as "nothing
/// changed"), the agent must stop by itself, and no start may bring the
/// batch back: in even rounds the restart reads the log with the failed
/// record still in it (the page cache keeps what the failed sync did not
/// write), in odd rounds after a power cut.
#[test]
fn a_failed_log_sync_refuses_its_whole_batch_and_no_restart_brings_it_back() -> anyhow::Result<()> {
    privileged!();
    let seed = seed("a_failed_log_sync")?;
    let failures = if std::env::var_os("LOCKSTEP_POWER_CUTS").is_some() {
        cuts()?
    } else {
        SYNC_FAILURES
    };
    let mut world = World::start("syncfail", None)?;
    let socket = world.agent.socket();
    let Clients {
        rt,
        gate,
        shared,
        models,
        mut rng,
    } = Clients::new(seed)?;

    std::thread::scope(|s| -> anyhow::Result<()> {
        let _stop = StopOnDrop(&gate);
        ledger::spawn_clients(s, &POOL, &socket, &gate, &models, &shared, seed);
        for round in 0..failures {
            gate.resume();
            std::thread::sleep(Duration::from_millis(20 + rng.below(181)));
            let before = get(&shared.counts.unavailable);
            world.fs.fail_sync(LOG, 1 + rng.below(3))?;
            let limit = Instant::now() + Duration::from_secs(10);
            let status = loop {
                if let Some(status) = world.agent.exited()? {
                    break status;
                }
                ensure!(
                    Instant::now() < limit,
                    "round {round}: the agent still runs 10 s after its log sync failed"
                );
                std::thread::sleep(Duration::from_millis(5));
            };
            gate.hold();
            gate.pause();
            ensure!(
                !status.success(),
                "round {round}: the agent exited with success after a failed sync"
            );
            let log = world.agent.log();
            ensure!(
                log.contains("the store's shared sync failed"),
                "round {round}: the agent's log does not name the failed sync:\n{}",
                tail(&log, 20)
            );
            ensure!(
                get(&shared.counts.unavailable) > before,
                "round {round}: no request was refused, so the failed batch's callers were not told"
            );
            let after = if round % 2 == 0 {
                format!("failed sync {} (log still readable)", round + 1)
            } else {
                world.fs.cut(Cut::Drop)?;
                format!("failed sync {} and a power cut", round + 1)
            };
            world.restart(&after)?;
            world.check(&rt, &models, &shared, round, &after)?;
        }
        Ok(())
    })?;

    let c = &shared.counts;
    let stats = world.fs.stats()?;
    eprintln!(
        "a_failed_log_sync: {failures} failed syncs; {}; {} held at the end",
        ledger::summary(c),
        ledger::held(&models),
    );
    ensure!(
        stats.failed_syncs == failures as u64,
        "lossyfs failed {} syncs",
        stats.failed_syncs
    );
    ensure!(
        get(&c.acked_allocations) >= 5 * failures as u64,
        "too few acknowledged allocations"
    );
    Ok(())
}

/// How a round of the checkpoint test aimed its cut.
#[derive(Clone, Copy, Debug)]
enum Aim {
    /// Armed while the clients run: a checkpoint when the log is half full.
    Load,
    /// Armed before a start after a crash: the replay's checkpoint.
    Startup,
    /// Armed before a SIGTERM: the shutdown checkpoint.
    Shutdown,
}

/// Counts of the checkpoint test.
#[derive(Debug, Default)]
struct Aimed {
    fired: [u64; 3],
    plain: [u64; 3],
}

/// Respawns the agent with a kill armed; returns whether it fired before the
/// agent was ready (then the power is already cut; the agent is dead).
fn start_armed(world: &mut World, k: u64, how: Cut) -> anyhow::Result<bool> {
    world.fs.arm_kill(DB, k, Some(how))?;
    world.agent.respawn()?;
    let started = Instant::now();
    loop {
        if world.fs.wait_trigger(Duration::from_millis(20))?.is_some() {
            return Ok(true);
        }
        if let Some(status) = world.agent.exited()? {
            if world.fs.disarm()?.is_some() {
                return Ok(true);
            }
            bail!(
                "the agent exited with {status} during start-up, not by the armed kill; \
                 last lines of its log:\n{}",
                tail(&world.agent.log(), 40)
            );
        }
        if world.agent.cli(["status", "-o", "json"])?.status.success() {
            return Ok(world.fs.disarm()?.is_some());
        }
        if started.elapsed() > Duration::from_secs(20) {
            bail!(
                "the agent was not ready within 20 s of a start with a kill armed at its write {k}; \
                 last lines of its log:\n{}",
                tail(&world.agent.log(), 40)
            );
        }
    }
}

#[test]
fn power_cuts_in_the_middle_of_checkpoints_lose_no_acknowledged_change() -> anyhow::Result<()> {
    privileged!();
    let cuts = cuts()?;
    let seed = seed("power_cuts_in_checkpoints")?;
    let mut world = World::start("ckpt", None)?;
    let socket = world.agent.socket();
    let Clients {
        rt,
        gate,
        shared,
        models,
        mut rng,
    } = Clients::new(seed)?;
    let started = Instant::now();
    let mut aimed = Aimed::default();
    let mut max_ready = Duration::ZERO;

    std::thread::scope(|s| -> anyhow::Result<()> {
        let _stop = StopOnDrop(&gate);
        ledger::spawn_clients(s, &POOL, &socket, &gate, &models, &shared, seed);
        for round in 0..cuts {
            let aim = [Aim::Load, Aim::Startup, Aim::Shutdown][round % 3];
            let k = 1 + rng.below(MAX_K);
            let how = cut_for(round, &mut rng);
            let after = format!("power cut {} ({how}, {aim:?}, k = {k})", round + 1);
            let fired = match aim {
                Aim::Load => {
                    world.fs.arm_kill(DB, k, Some(how))?;
                    gate.resume();
                    let fired = world.fs.wait_trigger(LOAD_LIMIT)?.is_some();
                    gate.hold();
                    let fired = fired || world.fs.disarm()?.is_some();
                    if !fired {
                        world.agent.kill9();
                        world.fs.cut(how)?;
                    }
                    gate.pause();
                    fired
                }
                Aim::Startup => {
                    // A crash under load leaves records in the log: the
                    // start-up replays and checkpoints them.
                    gate.resume();
                    std::thread::sleep(Duration::from_millis(20 + rng.below(281)));
                    gate.hold();
                    world.agent.kill9();
                    gate.pause();
                    let fired =
                        start_armed(&mut world, k, how).with_context(|| format!("at {after}"))?;
                    if !fired {
                        world.agent.kill9();
                        world.fs.cut(how)?;
                    }
                    fired
                }
                Aim::Shutdown => {
                    gate.resume();
                    std::thread::sleep(Duration::from_millis(20 + rng.below(281)));
                    gate.pause();
                    world.fs.arm_kill(DB, k, Some(how))?;
                    let status = world.agent.stop()?.context("agent was running")?;
                    let fired = world.fs.disarm()?.is_some();
                    if !fired {
                        ensure!(status.success(), "SIGTERM is a clean exit: {status}");
                        world.fs.cut(how)?;
                    }
                    fired
                }
            };
            let slot = aim as usize;
            if fired {
                aimed.fired[slot] += 1;
            } else {
                aimed.plain[slot] += 1;
            }
            max_ready = max_ready.max(world.restart(&after)?);
            world.check(&rt, &models, &shared, round, &after)?;
        }
        Ok(())
    })?;

    let c = &shared.counts;
    let stats = world.fs.stats()?;
    let fired: u64 = aimed.fired.iter().sum();
    eprintln!(
        "power_cuts_in_checkpoints: {cuts} cuts in {:.1?}; mid-checkpoint (fired/plain cut): \
         under load {}/{}, at start-up {}/{}, at shutdown {}/{}; {}; {} held at the end; \
         lossyfs: {} writes, {} fsyncs, {} unsynced bytes dropped, {} kept by torn cuts; \
         max time to ready {max_ready:?}",
        started.elapsed(),
        aimed.fired[0],
        aimed.plain[0],
        aimed.fired[1],
        aimed.plain[1],
        aimed.fired[2],
        aimed.plain[2],
        ledger::summary(c),
        ledger::held(&models),
        stats.writes,
        stats.fsyncs,
        stats.dropped_bytes,
        stats.kept_bytes,
    );
    ensure!(
        stats.cuts == cuts as u64,
        "lossyfs counted {} cuts",
        stats.cuts
    );
    ensure!(stats.kills == fired, "lossyfs fired {} times", stats.kills);
    // A batch shares one sync; each client has one request out at a time,
    // so a batch holds at most one of each client's.
    ensure!(
        stats.fsyncs >= get(&c.acked_allocations) / models.len() as u64,
        "the agent synced less than once per batch of acknowledged allocations: is the state directory on lossyfs?"
    );
    ensure!(
        fired * 2 >= cuts as u64,
        "only {fired} of {cuts} cuts landed inside a checkpoint"
    );
    if cuts >= 6 {
        ensure!(
            aimed.fired.iter().all(|f| *f > 0),
            "some kind of checkpoint was never cut: {aimed:?}"
        );
    }
    ensure!(
        stats.dropped_bytes > 0,
        "no cut dropped an unsynced write: the checkpoints were never cut in the middle"
    );
    ensure!(
        get(&c.acked_allocations) >= 20 * cuts as u64,
        "too few acknowledged allocations"
    );
    ensure!(
        get(&c.acked_releases) >= 8 * cuts as u64,
        "too few acknowledged releases"
    );
    ensure!(
        max_ready < Duration::from_secs(10),
        "restart took {max_ready:?}"
    );
    Ok(())
}
