//! `lockstep bird-keeper`: withdraws the node's LoadBalancer routes from
//! BIRD when the agent goes silent, and lets them back when it beats
//! again (#48 item 3; the rule is core `bgp::keeper`).
//!
//! Why a process of its own: BIRD keeps announcing what it was last told,
//! so an agent that died (SIGKILL, OOM, a crash loop) would leave its
//! addresses announced, and routers would keep sending traffic to a node
//! nothing manages. The keeper runs beside BIRD (its own container in
//! the generated install), not in the agent: it outlives the agent, and
//! it dies with nothing the agent needs. It reads the beat file the
//! speaker rewrites every second (`BgpConfig::beat_path`); once the file
//! has not changed for `[bgp] withdraw_after`, it disables BIRD's
//! announcing protocols (their routes are withdrawn, the sessions stay
//! up); when the beat comes back it enables them. An agent restarted
//! within the lease changes nothing on the wire. It checks every
//! [`TICK`], so a BIRD restarted while the agent is silent is taken
//! down again within a tick.
//!
//! In cluster mode the beat also says how long the node may still
//! announce its pod blocks (core `bgp::keeper::block_hold`): once that
//! has run out without a newer beat, the keeper disables the blocks'
//! protocols too, before another node may claim the blocks. A beat
//! without a hold (an agent starting, etcd not answered yet) keeps the
//! deadline the keeper had.
//!
//! The keeper trusts only its own clock: the beat counts as fresh when
//! its content changed, measured on the keeper's monotonic clock, never
//! by comparing the file's time with the wall clock.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use lockstep_core::bgp::keeper::{alive, beat_hold_ms, steps};

use super::Bird;
use crate::config::BgpConfig;

/// How often the beat and BIRD's protocols are looked at.
pub const TICK: Duration = Duration::from_millis(200);

/// Runs the keeper for `config` until `stop`.
pub async fn run(config: BgpConfig, mut stop: tokio::sync::watch::Receiver<bool>) {
    let bird = Bird::new(&config.bird_socket, &config.bird_config);
    let beat = config.beat_path();
    let lease_ms = u64::try_from(config.withdraw_after.as_millis()).unwrap_or(u64::MAX);
    tracing::info!(
        beat = %beat.display(),
        socket = %config.bird_socket.display(),
        withdraw_after = ?config.withdraw_after,
        "bird-keeper: watching the agent's beat"
    );
    // The keeper's start counts as a beat: an agent starting after it has
    // the lease to begin.
    let mut last: Option<Vec<u8>> = None;
    let mut changed_at = Instant::now();
    let mut was_alive: Option<bool> = None;
    // Until when the node may announce its blocks (cluster mode); `None`:
    // no beat said, they stay.
    let mut hold_until: Option<Instant> = None;
    let mut was_holding = true;
    let mut failing: Option<String> = None;
    loop {
        if let Ok(content) = tokio::fs::read(&beat).await
            && last.as_ref() != Some(&content)
        {
            changed_at = Instant::now();
            if let Some(ms) = beat_hold_ms(&String::from_utf8_lossy(&content)) {
                hold_until = Some(changed_at + Duration::from_millis(ms));
            }
            last = Some(content);
        }
        let silent = u64::try_from(changed_at.elapsed().as_millis()).unwrap_or(u64::MAX);
        let now_alive = alive(silent, lease_ms);
        let holding = hold_until.is_none_or(|until| Instant::now() < until);
        if holding != was_holding {
            if holding {
                tracing::info!("bird-keeper: the node holds its blocks again; BIRD announces them");
            } else {
                tracing::warn!(
                    "bird-keeper: the node's hold on its pod blocks ran out (etcd not reached for reclaim_after); withdrawing them"
                );
            }
            was_holding = holding;
        }
        if was_alive != Some(now_alive) {
            if now_alive {
                tracing::info!(
                    "bird-keeper: the agent beats; BIRD announces this node's LoadBalancer addresses"
                );
            } else {
                tracing::warn!(
                    silent_ms = silent,
                    "bird-keeper: the agent is silent past withdraw_after; withdrawing this node's LoadBalancer addresses"
                );
            }
            was_alive = Some(now_alive);
        }
        match apply(&bird, now_alive, holding).await {
            Ok(()) => failing = None,
            Err(why) => {
                if failing.as_deref() != Some(why.as_str()) {
                    tracing::warn!(error = %why, "bird-keeper: BIRD not brought in line; trying again");
                }
                failing = Some(why);
            }
        }
        tokio::select! {
            () = tokio::time::sleep(TICK) => {}
            _ = stop.wait_for(|s| *s) => break,
        }
    }
}

/// Reads BIRD's protocols and carries out the steps that bring the
/// LoadBalancer ones to `alive` and the blocks' to `holding`; BIRD's
/// words when it cannot.
async fn apply(bird: &Bird, alive: bool, holding: bool) -> Result<(), String> {
    let protocols = bird.protocols().await.map_err(|e| e.to_string())?;
    let states: BTreeMap<String, String> =
        protocols.into_iter().map(|p| (p.name, p.state)).collect();
    for step in steps(alive, holding, &states) {
        bird.command(&step).await.map_err(|e| e.to_string())?;
        tracing::info!(command = %step, "bird-keeper: done");
    }
    Ok(())
}
