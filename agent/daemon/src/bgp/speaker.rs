//! The BGP speaker's driver: a task that keeps BIRD's configuration what
//! this node should announce, and follows its sessions.
//!
//! Every [`TICK`] it looks at what this node announces ([`Source`]):
//! without Kubernetes, the agent's published view (never waiting for the
//! agent's owner), every address of the pools `[bgp.pools]` names (core
//! `bgp::announce::decide`); under Kubernetes, what `local_traffic` (in
//! cluster mode `bgp_services`) decided from the Services, their
//! endpoints and this Node; in cluster mode without Kubernetes, what
//! `bgp::stored` decided from the addresses stored in etcd. When that
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
//! In cluster mode the pod blocks of the cluster pools are the blocks
//! etcd gives this node (fenced ones left out), announced only while the
//! node's lease was refreshed within `reclaim_after` (core
//! `bgp::keeper::block_hold`): a node cut off from etcd longer withdraws
//! them before another node may claim them, and each beat tells the
//! keeper how long they may stay, should the agent die. Before etcd has
//! answered once in this agent's life, nothing is written: BIRD keeps
//! what the previous agent announced, and the keeper its deadline.
//!
//! Every [`SESSIONS_EVERY`] it reads the sessions back and logs each
//! change of state: up, or down with BIRD's reason. What it knows (the
//! prefixes BIRD took, why BIRD's configuration is behind, each session)
//! goes out on a watch channel: `lockstep status` and the metrics read it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::net::IpAddr;

use ipnet::IpNet;
use lockstep_core::bgp::announce::{Decision, LbAddress, PodBlock, decide};
use lockstep_core::bgp::keeper::{Hold, Stamp, beat_text, block_hold};
use lockstep_core::bgp::peers::{NodePeers, ROUTER_ID_ANNOTATION, apply};
use lockstep_core::bgp::session::{Session, observe};
use lockstep_core::bgp::{BgpSpec, RouteAttrs, render_bird};

use super::Bird;
use super::keeper::boot_id;
use crate::agent::AgentHandle;
use crate::announce::monotonic_ns;
use crate::cluster::ClusterHandle;
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
pub struct Source {
    /// The agent's published view: the pod blocks (its pools' CIDRs) and,
    /// without Kubernetes, its LoadBalancer addresses.
    pub agent: AgentHandle,
    /// What another task decided of the LoadBalancer addresses
    /// (`None` inside: not decided yet): under Kubernetes
    /// `kubernetes::local_traffic` or `kubernetes::bgp_services`, in
    /// cluster mode without it `bgp::stored`; `None` otherwise (the
    /// agent's view decides).
    pub decided: Option<tokio::sync::watch::Receiver<Option<Arc<Decision>>>>,
    /// Under Kubernetes, the `BGPPeer` objects that select this node and
    /// its Node's overrides (`kubernetes::bgp_peers`; `None` inside: not
    /// read yet); `None` without Kubernetes.
    pub peers: Option<crate::kubernetes::bgp_peers::Peers>,
    /// In cluster mode, the blocks etcd gives this node and its lease
    /// (`None` without cluster mode).
    pub cluster: Option<ClusterBlocks>,
}

/// In cluster mode: where the speaker learns the node's blocks, and how
/// long after the lease's last refresh it may announce them.
#[derive(Clone)]
pub struct ClusterBlocks {
    /// The claim loop's handle.
    pub handle: Arc<ClusterHandle>,
    /// `[cluster] reclaim_after`.
    pub reclaim_after: Duration,
}

impl ClusterBlocks {
    /// The cluster pools' blocks the node announces now (empty once its
    /// hold ran out), and the hold.
    fn read(&self) -> (Hold, Vec<(String, IpNet)>) {
        let holding = self.handle.holding();
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        let hold = block_hold(
            holding.refreshed.map(|at| ms(at.elapsed())),
            ms(self.reclaim_after),
        );
        match hold {
            Hold::For(_) => (hold, holding.blocks),
            Hold::Unknown | Hold::Over(_) => (hold, Vec::new()),
        }
    }

    /// The cluster pools' names.
    fn pools(&self) -> Vec<String> {
        self.handle.pools().into_iter().map(|p| p.name).collect()
    }
}

/// What the speaker last read of its [`Source`], to tell a change.
#[derive(Default)]
struct Seen {
    pools: Option<Arc<BTreeMap<String, Vec<IpNet>>>>,
    addresses: Option<Arc<BTreeMap<IpAddr, String>>>,
    decision: Option<Arc<Decision>>,
    /// In cluster mode, the cluster pools' blocks last announced.
    cluster_blocks: Option<Vec<(String, IpNet)>>,
    /// In cluster mode, the node's hold on its blocks as last read.
    hold: Option<Hold>,
}

impl Seen {
    /// Reads `source` again: `Some` with what this node announces when
    /// that changed; `None` when nothing changed or nothing is known yet
    /// (the agent is starting, or Kubernetes not read yet: an agent
    /// starting again must not withdraw what BIRD announces).
    fn read(
        &mut self,
        source: &mut Source,
        node: &str,
        attrs: &BTreeMap<String, RouteAttrs>,
    ) -> Option<Decision> {
        let view = source.agent.view();
        if !view.present {
            return None;
        }
        // Cluster mode: nothing is written before etcd answered once.
        let held = match &source.cluster {
            None => None,
            Some(c) => {
                let (hold, blocks) = c.read();
                self.hold = Some(hold);
                if hold == Hold::Unknown {
                    return None;
                }
                Some(blocks)
            }
        };
        let mut changed = !self
            .pools
            .as_ref()
            .is_some_and(|p| Arc::ptr_eq(p, &view.pool_cidrs));
        self.pools = Some(view.pool_cidrs.clone());
        match &mut source.decided {
            None => {
                changed |= !self
                    .addresses
                    .as_ref()
                    .is_some_and(|a| Arc::ptr_eq(a, &view.lb_addresses));
                self.addresses = Some(view.lb_addresses.clone());
            }
            Some(rx) => {
                if rx.has_changed().unwrap_or(false) || self.decision.is_none() {
                    let now = rx.borrow_and_update().clone();
                    changed |= now.is_some();
                    self.decision = now.or(self.decision.take());
                }
                self.decision.as_ref()?;
            }
        }
        if let Some(held) = &held {
            changed |= self.cluster_blocks.as_ref() != Some(held);
            self.cluster_blocks = Some(held.clone());
        }
        if !changed {
            return None;
        }
        let lb = match &self.decision {
            Some(d) if source.decided.is_some() => d.as_ref().clone(),
            _ => from_addresses(attrs, node, &view.lb_addresses),
        };
        // A cluster pool's local CIDRs are its blocks, fenced ones too:
        // taken from etcd's word (`held`) instead.
        let cluster_pools: Vec<String> = source
            .cluster
            .as_ref()
            .map_or_else(Vec::new, ClusterBlocks::pools);
        let blocks: Vec<PodBlock<'_>> = held
            .iter()
            .flatten()
            .map(|(pool, cidr)| PodBlock { cidr: *cidr, pool })
            .chain(
                view.pool_cidrs
                    .iter()
                    .filter(|(pool, _)| !cluster_pools.contains(pool))
                    .flat_map(|(pool, cidrs)| cidrs.iter().map(|&cidr| PodBlock { cidr, pool })),
            )
            .filter(|b| attrs.contains_key(b.pool))
            .collect();
        Some(Decision {
            blocks: decide(node, &Ok(()), &[], &blocks, attrs).blocks,
            ..lb
        })
    }
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
        // Checked when the config was read.
        let attrs = match config.attrs() {
            Ok(a) => a,
            Err((field, why)) => {
                tracing::error!(%field, %why, "the BGP speaker does not start: nothing is announced");
                status.send_modify(|s| s.problem = Some(format!("{field} {why}")));
                let _ = stop.wait_for(|s| *s).await;
                return;
            }
        };
        let bird = Bird::new(&config.bird_socket, &config.bird_config);
        let mut seen = Seen::default();
        let mut decision: Option<Decision> = None;
        // The node's spec: the config's, with what the API server says
        // of this node under Kubernetes (`None` until it was read).
        let mut node_peers: Option<Arc<NodePeers>> = None;
        let mut spec: Result<BgpSpec, String> = Err("not read yet".into());
        let mut first = true;
        // Nothing is written before the sources are known.
        let mut wanted: Option<String> = None;
        // Prefixes in `wanted`, and in the text BIRD took last.
        let mut routes = 0;
        let mut withheld = BTreeMap::new();
        let mut services: BTreeMap<String, Vec<IpAddr>> = BTreeMap::new();
        let mut blocks: Vec<IpNet> = Vec::new();
        let mut announced = 0;
        let mut applied: Option<String> = None;
        let mut seeded = false;
        let mut failing: Option<String> = None;
        let mut retry_at = Instant::now();
        let mut sessions_at = Instant::now();
        let mut states: BTreeMap<String, Session> = BTreeMap::new();
        let beat = config.beat_path();
        let reclaim_after = source
            .cluster
            .as_ref()
            .map(|c| c.reclaim_after)
            .unwrap_or_default();
        let mut beats: u64 = 0;
        // Each beat stamped with the boot and the monotonic clock.
        let boot = boot_id();
        let mut beat_at = Instant::now();
        let mut beat_failing = false;
        loop {
            let mut changed = false;
            if let Some(d) = seen.read(&mut source, &node, &attrs) {
                withheld.clone_from(&d.withheld);
                services.clear();
                for (address, svc) in &d.services {
                    services.entry(svc.clone()).or_default().push(*address);
                }
                blocks = d.blocks.keys().copied().collect();
                decision = Some(d);
                changed = true;
            }
            match &mut source.peers {
                None if first => {
                    spec = node_spec(&config, None);
                    changed = true;
                }
                None => {}
                Some(rx) if first || rx.has_changed().unwrap_or(false) => {
                    if let Some(now) = rx.borrow_and_update().clone() {
                        spec = node_spec(&config, Some(&now));
                        node_peers = Some(now);
                        changed = true;
                    }
                }
                Some(_) => {}
            }
            first = false;
            let known = source.peers.is_none() || node_peers.is_some();
            if changed
                && known
                && let (Some(d), Ok(spec)) = (&decision, &spec)
            {
                let (t, count) = text(spec, d);
                wanted = Some(t);
                routes = count;
            }
            // Why the node's spec does not write, once it is known.
            let spec_problem = spec.as_ref().err().filter(|_| known).cloned();
            if let Some(wanted) = &wanted
                && applied.is_none()
                && !seeded
            {
                // BIRD starts from this file: written before BIRD runs.
                match bird.seed(wanted).await {
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
            if let Some(wanted) = &wanted
                && applied.as_ref() != Some(wanted)
                && Instant::now() >= retry_at
            {
                match bird.apply(wanted).await {
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
                let stamp = boot.as_ref().map(|boot| Stamp {
                    boot: boot.clone(),
                    at_ns: monotonic_ns(),
                });
                let line = beat_text(
                    std::process::id(),
                    beats,
                    stamp.as_ref(),
                    seen.hold.unwrap_or(Hold::Unknown),
                );
                match write_beat(&beat, &line).await {
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
                                let seen = states.get(&p.name).cloned().unwrap_or_default();
                                Some(BgpSession {
                                    peer: peer_name(spec.as_ref().ok()?, &p.name)?,
                                    up: p.established(),
                                    state: seen.state,
                                    downs: seen.downs,
                                    last_down: seen.last_down,
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
                s.problem = spec_problem.clone().or_else(|| failing.clone());
                let refused = node_peers.as_ref().map(|p| &p.refused);
                if refused != Some(&s.refused) {
                    s.refused = refused.cloned().unwrap_or_default();
                }
                s.withheld.clone_from(&withheld);
                s.services.clone_from(&services);
                s.blocks.clone_from(&blocks);
                let withdrawn = withdrawn_why(seen.hold, reclaim_after);
                if s.blocks_withdrawn != withdrawn {
                    s.blocks_withdrawn = withdrawn;
                }
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

/// Why the node announces none of its cluster pools' blocks, under
/// `hold` (`None`: it does, or not in cluster mode).
fn withdrawn_why(hold: Option<Hold>, reclaim_after: Duration) -> Option<String> {
    match hold? {
        Hold::For(_) => None,
        Hold::Unknown => Some(
            "etcd has not answered since the agent started: BIRD keeps what it announced before"
                .into(),
        ),
        Hold::Over(ms) => Some(format!(
            "etcd last renewed this node's lease {:.1} s ago, past reclaim_after ({reclaim_after:?}): another node may hold them now",
            Duration::from_millis(ms).as_secs_f64()
        )),
    }
}

/// What `node` announces of `addresses` without Kubernetes: the
/// addresses of the pools `attrs` names.
/// Writes the beat whole: beside the file, then renamed over it, so the
/// keeper never reads half a beat (a torn stamp would date it wrong).
async fn write_beat(path: &std::path::Path, line: &str) -> std::io::Result<()> {
    let next = path.with_extension("beat.next");
    tokio::fs::write(&next, line).await?;
    tokio::fs::rename(&next, path).await
}

fn from_addresses(
    attrs: &BTreeMap<String, RouteAttrs>,
    node: &str,
    addresses: &BTreeMap<IpAddr, String>,
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

/// BIRD's configuration announcing `decision`'s routes and blocks, and
/// how many prefixes that is.
fn text(spec: &BgpSpec, decision: &Decision) -> (String, usize) {
    // The spec was checked at start and the routes are host routes or
    // pools' CIDRs: it renders.
    let text = render_bird(spec, &decision.routes, &decision.blocks).unwrap_or_default();
    (text, decision.routes.len() + decision.blocks.len())
}

/// The peer name of BIRD's protocol `protocol` in `spec`, if it is a
/// peer (the config's or a `BGPPeer`'s).
fn peer_name(spec: &BgpSpec, protocol: &str) -> Option<String> {
    spec.peers
        .iter()
        .find(|p| lockstep_core::bgp::peer_protocol(&p.name) == protocol)
        .map(|p| p.name.clone())
}

/// The node's spec: the config's, and under Kubernetes `peers`' (the
/// `BGPPeer` objects that select the node, its Node's overrides), else
/// why not, in the words of the setting at fault.
fn node_spec(config: &BgpConfig, peers: Option<&NodePeers>) -> Result<BgpSpec, String> {
    let router_id = peers
        .and_then(|p| p.router_id)
        .or(config.router_id)
        .ok_or_else(|| {
            format!(
                "bgp.router_id is not set, and neither the Node's IPv4 InternalIP nor its {ROUTER_ID_ANNOTATION} annotation stands in for it"
            )
        })?;
    let base = config
        .spec_with(router_id)
        .map_err(|(field, why)| format!("{field} {why}"))?;
    let Some(peers) = peers else {
        return Ok(base);
    };
    let spec = apply(&base, peers);
    lockstep_core::bgp::check(&spec).map_err(|e| e.to_string())?;
    Ok(spec)
}

/// Follows each BGP session in `protocols` (core `bgp::session`): logs
/// each change of state, and each down seen only by BIRD's `Since`
/// having moved (down and back between two reads).
fn follow_sessions(protocols: &[super::Protocol], states: &mut BTreeMap<String, Session>) {
    for p in protocols.iter().filter(|p| p.kind == "BGP") {
        let up = p.established();
        let why = p.problem().unwrap_or_else(|| p.info.clone());
        let before = states.get(&p.name);
        let now = observe(before, up, &why, &p.state, &p.since);
        match before {
            Some(b) if b.state == now.state && b.downs == now.downs => {}
            Some(b) if b.state == now.state => tracing::warn!(
                session = %p.name,
                downs = now.downs,
                "BGP session went down and came back between two reads"
            ),
            _ if up => tracing::info!(session = %p.name, downs = now.downs, "BGP session up"),
            _ => {
                tracing::warn!(session = %p.name, state = %now.state, downs = now.downs, "BGP session not up")
            }
        }
        states.insert(p.name.clone(), now);
    }
}
