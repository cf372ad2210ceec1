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
//! deadline the keeper had. A keeper started afresh holds no block until
//! a beat of this boot says so.
//!
//! The keeper trusts no wall clock: each beat is stamped with the boot
//! and the kernel's monotonic clock, which agent and keeper share, and
//! counts from then (core `bgp::keeper::Watch`); a beat from another
//! boot says nothing. An unstamped beat (an older agent) counts from when
//! its content changed, on the keeper's monotonic clock.

use std::collections::BTreeMap;
use std::time::Duration;

use lockstep_core::bgp::keeper::{Watch, parse_beat, steps};

use super::Bird;
use crate::announce::monotonic_ns;
use crate::config::BgpConfig;

/// How often the beat and BIRD's protocols are looked at.
pub const TICK: Duration = Duration::from_millis(200);

/// Where the kernel says which boot this is.
const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

/// This boot's id (`None`: unreadable), which stamps the agent's beats.
pub fn boot_id() -> Option<String> {
    std::fs::read_to_string(BOOT_ID)
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

/// Runs the keeper for `config` until `stop`; `cluster`: the agent runs
/// in cluster mode (its blocks are held only while a beat says so).
pub async fn run(config: BgpConfig, cluster: bool, mut stop: tokio::sync::watch::Receiver<bool>) {
    let bird = Bird::new(&config.bird_socket, &config.bird_config);
    let beat = config.beat_path();
    let lease_ms = u64::try_from(config.withdraw_after.as_millis()).unwrap_or(u64::MAX);
    tracing::info!(
        beat = %beat.display(),
        socket = %config.bird_socket.display(),
        withdraw_after = ?config.withdraw_after,
        "bird-keeper: watching the agent's beat"
    );
    let boot = boot_id();
    if boot.is_none() {
        tracing::warn!(
            file = BOOT_ID,
            "bird-keeper: this boot's id cannot be read; beats count from when they are read"
        );
    }
    // The keeper's start counts as a beat: an agent starting after it has
    // the lease to begin.
    let mut watch = Watch::start(monotonic_ns(), cluster);
    let mut last: Option<Vec<u8>> = None;
    let mut was_alive: Option<bool> = None;
    let mut was_holding = true;
    let mut failing: Option<String> = None;
    loop {
        if let Ok(content) = tokio::fs::read(&beat).await
            && last.as_ref() != Some(&content)
        {
            let text = String::from_utf8_lossy(&content);
            watch.beat(&parse_beat(&text), boot.as_deref(), monotonic_ns());
            last = Some(content);
        }
        let now = monotonic_ns();
        let now_alive = watch.alive(now, lease_ms);
        let holding = watch.holding(now);
        let silent = now.saturating_sub(watch.last_beat_ns) / 1_000_000;
        if holding != was_holding {
            if holding {
                tracing::info!("bird-keeper: the node holds its blocks again; BIRD announces them");
            } else {
                tracing::warn!(
                    "bird-keeper: the node's hold on its pod blocks ran out (etcd not reached for reclaim_after), or no beat of this boot gave one yet; withdrawing them"
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
