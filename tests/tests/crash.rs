//! Crash consistency: eight clients allocate and release through the API
//! while the agent is killed with SIGKILL at random moments, fifty times.
//!
//! Clients record what was acknowledged (a 2xx reply). A request that got no
//! reply (reset, cut connection) may or may not have taken effect: its owner is
//! "uncertain" until the next check, which resolves it from what the restarted
//! agent reports. After every restart, with the clients paused, the agent must
//! hold every acknowledged allocation (same address, same generation), nothing
//! acknowledged-released, no address twice, no owner twice per pool and
//! family, and `lockstep verify` must pass.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use lockstep_tests::ledger::{self, Gate, Model, Pool, Rng, Shared, StopOnDrop, get, run_client};
use lockstep_tests::{AgentProc, Netns, privileged};

const POOL: Pool = Pool {
    name: "crash",
    v4_base: Ipv4Addr::new(10, 60, 0, 0),
    v4_prefix: 22,
    v6_base: Ipv6Addr::new(0xfd00, 0x60, 0, 0, 0, 0, 0, 0),
    v6_prefix: 118,
    owner_tag: "crash",
};

const KILLS: usize = 50;

#[test]
fn sigkill_at_random_moments_loses_no_acknowledged_change() -> anyhow::Result<()> {
    privileged!();
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos() as u64;
    eprintln!("crash test seed {seed:#x}");
    let node = Netns::new("crash")?;
    let mut agent = AgentProc::start(&node, &POOL.config())?;
    let socket = agent.socket();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let gate = Gate::default();
    let shared = Shared::default();
    let models: Vec<Model> = ledger::models();
    let mut rng = Rng(seed);
    let started = Instant::now();
    let mut max_ready = Duration::ZERO;
    let mut kills = 0;

    std::thread::scope(|s| -> anyhow::Result<()> {
        let _stop = StopOnDrop(&gate);
        for (id, model) in models.iter().enumerate() {
            let (socket, gate, shared) = (&socket, &gate, &shared);
            let seed = seed ^ ((id as u64 + 1) << 32);
            s.spawn(move || run_client(&POOL, id, socket, gate, model, shared, seed));
        }
        for round in 0..KILLS {
            gate.resume();
            std::thread::sleep(Duration::from_millis(20 + rng.below(281)));
            agent.kill9();
            kills += 1;
            gate.pause();
            let took = agent
                .restart()
                .with_context(|| format!("restart after kill {}", round + 1))?;
            max_ready = max_ready.max(took);
            ledger::check(&POOL, &rt, &agent, &models, &shared, round)?;
        }
        Ok(())
    })?;

    // A clean stop keeps everything too.
    let status = agent.stop()?.context("agent was running")?;
    ensure!(status.success(), "SIGTERM is a clean exit: {status}");
    max_ready = max_ready.max(agent.restart()?);
    ledger::check(&POOL, &rt, &agent, &models, &shared, KILLS)?;

    let c = &shared.counts;
    let held = ledger::held(&models);
    eprintln!(
        "crash test: {kills} kills in {:.1?}; {}; {held} held at the end; \
         max time to ready {max_ready:?}",
        started.elapsed(),
        ledger::summary(c),
    );
    assert_eq!(kills, KILLS);
    assert!(
        get(&c.acked_allocations) > 500,
        "too few acknowledged allocations"
    );
    assert!(
        get(&c.acked_releases) > 200,
        "too few acknowledged releases"
    );
    assert!(get(&c.idempotent) > 50, "too few idempotent repeats");
    assert!(get(&c.stale_refused) > 20, "too few stale releases");
    assert!(
        max_ready < Duration::from_secs(10),
        "restart took {max_ready:?}"
    );
    Ok(())
}
