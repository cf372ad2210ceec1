//! The BGP speaker's driver: a task that keeps BIRD's configuration what
//! this node should announce, and follows its sessions.
//!
//! Every [`TICK`] it looks at what this node announces ([`Source`]):
//! without Kubernetes, the agent's published view (never waiting for the
//! agent's owner), every address of the pools `[bgp.pools]` names (core
//! `bgp::announce::decide`); under Kubernetes, what `local_traffic`
//! decided from the Services, their endpoints and this Node. When that
//! changed it writes BIRD's whole configuration, and applies it when the
//! text differs from the one applied last. BIRD reconfigures route by route, so an address added or
//! withdrawn resets no session. When BIRD's file does not exist yet, the
//! task writes it first, so BIRD can start after the agent from what the
//! node announces. While BIRD cannot be reached (not started yet,
//! restarting) the task tries again every [`RETRY`], and says so once per
//! distinct error.
//!
//! Every [`BEAT_EVERY`] it rewrites the beat file `lockstep bird-keeper`
//! watches (`bgp::keeper`): while it beats, BIRD keeps announcing.
//!
//! Every [`SESSIONS_EVERY`] it reads the sessions back and logs each
//! change of state: up, or down with BIRD's reason. What it knows (the
//! prefixes BIRD took, why BIRD's configuration is behind, each session)
//! goes out on a watch channel: `lockstep status` and the metrics read it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lockstep_core::bgp::announce::{Decision, LbAddress, decide};
use lockstep_core::bgp::{RouteAttrs, render_bird};

use super::Bird;
use crate::agent::AgentHandle;
use crate::config::BgpConfig;
use crate::wire::{BgpSession, BgpStatus};

/// How often the published view is looked at.
pub const TICK: Duration = Duration::from_millis(200);
/// How long after a failed apply it is tried again.
pub const RETRY: Duration = Duration::from_secs(1);
/// How often the sessions are read back.
pub const SESSIONS_EVERY: Duration = Duration::from_secs(5);
/// How often the agent beats for `lockstep bird-keeper` (`bgp::keeper`).
pub const BEAT_EVERY: Duration = Duration::from_secs(1);

/// Where the speaker learns what this node announces.
#[derive(Clone)]
pub enum Source {
    /// Without Kubernetes: the agent's LoadBalancer addresses (its
    /// published view), every one of the pools `[bgp.pools]` names.
    Agent(AgentHandle),
    /// Under Kubernetes: what `kubernetes::local_traffic` decided.
    Decided(tokio::sync::watch::Receiver<Arc<Decision>>),
}

/// What the speaker last read of its [`Source`].
enum Seen {
    Nothing,
    Addresses(Arc<BTreeMap<std::net::IpAddr, String>>),
    Decided,
}

/// Starts the speaker's task for node `node`, reading `source`; what it
/// knows of BIRD goes out on `status` (the API's status and the metrics
/// read it).
pub fn spawn(
    config: BgpConfig,
    node: String,
    mut source: Source,
    status: tokio::sync::watch::Sender<BgpStatus>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        // Checked when the config was read, but for the router ID under
        // Kubernetes: the Node's InternalIP, if it has one.
        let (spec, attrs) = match (config.spec(), config.attrs()) {
            (Ok(s), Ok(a)) => (s, a),
            (Err((field, why)), _) | (_, Err((field, why))) => {
                tracing::error!(%field, %why, "the BGP speaker does not start: nothing is announced");
                status.send_modify(|s| s.problem = Some(format!("{field} {why}")));
                let _ = stop.wait_for(|s| *s).await;
                return;
            }
        };
        let bird = Bird::new(&config.bird_socket, &config.bird_config);
        let mut seen = Seen::Nothing;
        let mut wanted = String::new();
        // Prefixes in `wanted`, and in the text BIRD took last.
        let mut routes = 0;
        let mut withheld = BTreeMap::new();
        let mut announced = 0;
        let mut applied: Option<String> = None;
        let mut seeded = false;
        let mut failing: Option<String> = None;
        let mut retry_at = Instant::now();
        let mut sessions_at = Instant::now();
        let mut states: BTreeMap<String, String> = BTreeMap::new();
        let beat = config.beat_path();
        let mut beats: u64 = 0;
        let mut beat_at = Instant::now();
        let mut beat_failing = false;
        loop {
            match &mut source {
                Source::Agent(agent) => {
                    let view = agent.view();
                    if !matches!(&seen, Seen::Addresses(s) if Arc::ptr_eq(s, &view.lb_addresses)) {
                        let d = from_addresses(&attrs, &node, &view.lb_addresses);
                        (wanted, routes) = text(&spec, &d);
                        withheld.clone_from(&d.withheld);
                        seen = Seen::Addresses(view.lb_addresses.clone());
                    }
                }
                Source::Decided(rx) => {
                    if !matches!(seen, Seen::Decided) || rx.has_changed().unwrap_or(false) {
                        let d = rx.borrow_and_update().clone();
                        (wanted, routes) = text(&spec, &d);
                        withheld.clone_from(&d.withheld);
                        seen = Seen::Decided;
                    }
                }
            }
            if applied.is_none() && !seeded {
                // BIRD starts from this file: written before BIRD runs.
                match bird.seed(&wanted).await {
                    Ok(wrote) => {
                        if wrote {
                            tracing::info!(config = %bird.config_path().display(), "wrote the file BIRD starts from");
                        }
                        seeded = true;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "the file BIRD starts from is not written")
                    }
                }
            }
            if applied.as_deref() != Some(wanted.as_str()) && Instant::now() >= retry_at {
                match bird.apply(&wanted).await {
                    Ok(()) => {
                        tracing::info!(config = %bird.config_path().display(), "BIRD's configuration applied");
                        applied = Some(wanted.clone());
                        announced = routes;
                        failing = None;
                    }
                    Err(e) => {
                        let why = e.to_string();
                        if failing.as_deref() != Some(why.as_str()) {
                            tracing::warn!(error = %why, "BIRD's configuration is not applied; trying again");
                        }
                        failing = Some(why);
                        retry_at = Instant::now() + RETRY;
                    }
                }
            }
            // The keeper beside BIRD withdraws the LB routes once this
            // stops for `withdraw_after`. After the seed, which makes the
            // directory the beat shares with BIRD's file.
            if Instant::now() >= beat_at {
                beat_at = Instant::now() + BEAT_EVERY;
                beats += 1;
                let line = format!("{} {beats}\n", std::process::id());
                match tokio::fs::write(&beat, line).await {
                    Ok(()) => beat_failing = false,
                    Err(e) if !beat_failing => {
                        beat_failing = true;
                        tracing::warn!(file = %beat.display(), error = %e, "the agent's beat is not written: bird-keeper will withdraw this node's LoadBalancer addresses");
                    }
                    Err(_) => {}
                }
            }
            // `Err`: BIRD did not answer; its sessions are not known up.
            let mut sessions = None;
            if Instant::now() >= sessions_at {
                sessions_at = Instant::now() + SESSIONS_EVERY;
                sessions = Some(match bird.protocols().await {
                    Ok(protocols) => {
                        follow_sessions(&protocols, &mut states);
                        Ok(protocols
                            .iter()
                            .filter_map(|p| {
                                Some(BgpSession {
                                    peer: peer_name(&config, &p.name)?,
                                    up: p.established(),
                                    state: states.get(&p.name).cloned().unwrap_or_default(),
                                })
                            })
                            .collect())
                    }
                    Err(e) => Err(e.to_string()),
                });
            }
            status.send_if_modified(|s| {
                let before = s.clone();
                s.announced = announced;
                s.problem.clone_from(&failing);
                s.withheld.clone_from(&withheld);
                match sessions.take() {
                    Some(Ok(now)) => s.sessions = now,
                    Some(Err(why)) => {
                        for session in &mut s.sessions {
                            session.up = false;
                            session.state = format!("not known: {why}");
                        }
                    }
                    None => {}
                }
                *s != before
            });
            tokio::select! {
                () = tokio::time::sleep(TICK) => {}
                _ = stop.wait_for(|s| *s) => break,
            }
        }
    })
}

/// What `node` announces of `addresses` without Kubernetes: the
/// addresses of the pools `attrs` names.
fn from_addresses(
    attrs: &BTreeMap<String, RouteAttrs>,
    node: &str,
    addresses: &BTreeMap<std::net::IpAddr, String>,
) -> Decision {
    let lb: Vec<LbAddress<'_>> = addresses
        .iter()
        .filter(|(_, pool)| attrs.contains_key(*pool))
        .map(|(address, pool)| LbAddress {
            address: *address,
            pool,
            local: None,
            admitted: true,
        })
        .collect();
    decide(node, &Ok(()), &lb, &[], attrs)
}

/// BIRD's configuration announcing `decision`'s routes, and how many
/// prefixes that is.
fn text(spec: &lockstep_core::bgp::BgpSpec, decision: &Decision) -> (String, usize) {
    // The spec was checked at start and the routes are host routes or
    // blocks: it renders.
    let text = render_bird(spec, &decision.routes).unwrap_or_default();
    (text, decision.routes.len())
}

/// The `[bgp.peers]` name of BIRD's protocol `protocol`, if it is a peer.
fn peer_name(config: &BgpConfig, protocol: &str) -> Option<String> {
    config
        .peers
        .iter()
        .find(|p| lockstep_core::bgp::peer_protocol(&p.name) == protocol)
        .map(|p| p.name.clone())
}

/// Logs each BGP session whose state changed since `states` (`up`, or
/// BIRD's words for why not).
fn follow_sessions(protocols: &[super::Protocol], states: &mut BTreeMap<String, String>) {
    for p in protocols.iter().filter(|p| p.kind == "BGP") {
        let now = if p.established() {
            "up".to_string()
        } else {
            p.problem().unwrap_or_else(|| p.info.clone())
        };
        if states.get(&p.name) != Some(&now) {
            if p.established() {
                tracing::info!(session = %p.name, "BGP session up");
            } else {
                tracing::warn!(session = %p.name, state = %now, "BGP session not up");
            }
            states.insert(p.name.clone(), now);
        }
    }
}
