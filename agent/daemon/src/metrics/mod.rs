//! Prometheus metrics, served on the metrics listener (`metrics_addr`)
//! beside the health probes (`/healthz`, `/readyz`).
//!
//! Every family goes through prometheus-client's registry: gauges (pool
//! usage, map entries and capacities) are refreshed from the agent,
//! counters (repairs, errors, datapath packets and drops) follow the
//! agent's own monotonic tallies, and cluster mode's families are
//! registered once it runs. A scrape gets OpenMetrics when it asks for it
//! (Prometheus does) and the text format 0.0.4 otherwise ([`text`]).
//!
//! A scrape never waits for the agent's owner, which CNI calls and
//! reconciles keep busy: the owner refreshes the gauges itself after a
//! batch of commands, before it answers them (`AgentHandle::spawn_with`),
//! so they agree with the state an API call just returned; under load at
//! least every 100 ms, and exactly once the owner is idle.
//! [`spawn_refresher`] refreshes them every [`REFRESH_EVERY`] as well, for
//! what changes without a command (the datapath's packet counters).

mod cluster;
mod heartbeats;
pub mod text;

pub use heartbeats::{Heartbeat, Heartbeats};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

use crate::agent::Agent;
use crate::cluster::{ClusterHandle, LbHandle};

type Labels = Vec<(String, String)>;

/// A label set, its values escaped ([`text::escape`]).
fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_string(), text::escape(v)))
        .collect()
}

/// Moves a counter up to a monotonic source's value (a source that went
/// back, a map recreated, leaves it where it is).
fn follow(counter: &Counter, now: u64) {
    counter.inc_by(now.saturating_sub(counter.get()));
}

/// The background refresh period ([`spawn_refresher`]).
pub const REFRESH_EVERY: Duration = Duration::from_secs(2);

/// The agent's metrics.
pub struct Metrics {
    registry: Mutex<Registry>,
    /// The masquerade collector's counts, once it runs.
    masq: Mutex<Option<Arc<crate::masquerade::Stats>>>,
    masq_entries: Family<Labels, Gauge<i64>>,
    masq_deleted: Counter,
    masq_translated: Counter,
    masq_exhausted: Counter,
    masq_table_full: Counter,
    masq_endpoint_limit: Counter,
    masq_untranslatable: Counter,
    masq_evicted: Counter,
    allocated: Family<Labels, Gauge<i64>>,
    free: Family<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    map_entries: Family<Labels, Gauge<i64>>,
    map_capacity: Family<Labels, Gauge<i64>>,
    repairs: Family<Labels, Counter>,
    pin_repairs: Family<Labels, Counter>,
    errors: Family<Labels, Counter>,
    lb_pool_addresses: Family<Labels, Gauge<i64>>,
    lb_pool_conflicting: Family<Labels, Gauge<i64>>,
    lb_pending: Family<Labels, Gauge<i64>>,
    latency: Histogram,
    draining: Family<Labels, Gauge<i64>>,
    tunnel_packets: Family<Labels, Counter>,
    tunnel_drops: Family<Labels, Counter>,
    datapath_packets: Family<Labels, Counter>,
    datapath_drops: Family<Labels, Counter>,
    /// Cluster mode's families, once it runs.
    cluster: OnceLock<cluster::ClusterFamilies>,
    /// The cluster LB agent's families, once it runs.
    lb: OnceLock<cluster::LbFamilies>,
    /// The BGP speaker's status, once it runs.
    bgp: Mutex<Option<tokio::sync::watch::Receiver<crate::wire::BgpStatus>>>,
    bgp_session_up: Family<Labels, Gauge<i64>>,
    bgp_session_downs: Family<Labels, Counter>,
    bgp_announced: Gauge<i64>,
    bgp_behind: Gauge<i64>,
    /// Kubernetes leak detection's report, once it runs.
    leaks: Mutex<Option<Arc<crate::kubernetes::leaks::LeakReport>>>,
    endpoint_leaks: Gauge<i64>,
    endpoint_leaks_released: Counter,
    owner_commands: Counter,
    owner_batches: Counter,
    store_commits: Counter,
    store_log_syncs: Counter,
    owner_queued: Gauge<i64>,
    task_restarts: Family<Labels, Counter>,
    /// Whether the gauges were ever refreshed from a running agent.
    refreshed: AtomicBool,
    /// The loops' signs of progress, for `/healthz`.
    pub heartbeats: Heartbeats,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers every metric.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("lockstep");
        let allocated = Family::<Labels, Gauge<i64>>::default();
        let free = Family::<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
        let map_entries = Family::<Labels, Gauge<i64>>::default();
        let map_capacity = Family::<Labels, Gauge<i64>>::default();
        let repairs = Family::<Labels, Counter>::default();
        let pin_repairs = Family::<Labels, Counter>::default();
        let errors = Family::<Labels, Counter>::default();
        let lb_pool_addresses = Family::<Labels, Gauge<i64>>::default();
        let lb_pool_conflicting = Family::<Labels, Gauge<i64>>::default();
        let lb_pending = Family::<Labels, Gauge<i64>>::default();
        let latency = Histogram::new([
            0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5,
        ]);
        registry.register(
            "pool_allocated",
            "Allocated addresses per pool and family",
            allocated.clone(),
        );
        registry.register(
            "pool_free",
            "Free addresses per pool and family",
            free.clone(),
        );
        registry.register(
            "map_entries",
            "Entries the agent keeps in each map",
            map_entries.clone(),
        );
        registry.register(
            "map_capacity",
            "Capacity (max_entries) of each map the agent keeps entries in: its fill is map_entries over this",
            map_capacity.clone(),
        );
        registry.register(
            "reconcile_repairs",
            "Map entries repaired by periodic reconciles since start",
            repairs.clone(),
        );
        registry.register(
            "pin_repairs",
            "Map pins put back since start (removed, or replaced by another map), by map",
            pin_repairs.clone(),
        );
        registry.register(
            "errors",
            "Failed operations since start, by error code",
            errors.clone(),
        );
        registry.register(
            "lb_pool_addresses",
            "LoadBalancer pools' addresses, by pool and state (used, free)",
            lb_pool_addresses.clone(),
        );
        registry.register(
            "lb_pool_conflicting",
            "1 when a LoadBalancer pool overlaps another and is left out, 0 otherwise",
            lb_pool_conflicting.clone(),
        );
        let draining = Family::<Labels, Gauge<i64>>::default();
        registry.register(
            "pool_draining",
            "Holders left in each range the configuration dropped (draining), by pool and range",
            draining.clone(),
        );
        registry.register(
            "lb_pending_services",
            "LoadBalancer services without an address, by reason",
            lb_pending.clone(),
        );
        registry.register(
            "allocation_duration_seconds",
            "Time to allocate through the API (commit, program, acknowledge)",
            latency.clone(),
        );
        let bgp_session_up = Family::<Labels, Gauge<i64>>::default();
        registry.register(
            "bgp_session_up",
            "Whether each BGP session (by peer, as [bgp.peers] names it) is established: 1, else 0",
            bgp_session_up.clone(),
        );
        let bgp_session_downs = Family::<Labels, Counter>::default();
        registry.register(
            "bgp_session_downs",
            "Times each BGP session (by peer) went down since the agent started: a flapping link counts up",
            bgp_session_downs.clone(),
        );
        let bgp_announced = Gauge::<i64>::default();
        registry.register(
            "bgp_announced_prefixes",
            "Prefixes in the configuration BIRD took last",
            bgp_announced.clone(),
        );
        let bgp_behind = Gauge::<i64>::default();
        registry.register(
            "bgp_config_behind",
            "1 while BIRD's configuration is not the one this node should announce (BIRD unreachable or refusing it)",
            bgp_behind.clone(),
        );
        let masq_entries = Family::<Labels, Gauge<i64>>::default();
        registry.register(
            "masq_entries",
            "Masquerade translations (NAT_FWD entries) at the last collection, by family",
            masq_entries.clone(),
        );
        let masq_deleted = Counter::default();
        registry.register(
            "masq_gc_deleted",
            "NAT entries the collector deleted (forward and reverse)",
            masq_deleted.clone(),
        );
        let masq_translated = Counter::default();
        registry.register(
            "masq_translations",
            "Packets to_native translated (COUNTERS)",
            masq_translated.clone(),
        );
        let masq_exhausted = Counter::default();
        registry.register(
            "masq_exhausted",
            "New flows dropped for want of a free translated port (COUNTERS)",
            masq_exhausted.clone(),
        );
        let tunnel_packets = Family::<Labels, Counter>::default();
        registry.register(
            "tunnel_packets",
            "Packets through the tunnel (COUNTERS): encapsulated (encap), delivered after decapsulation (decap), answered as too big for the path (pmtu_answered)",
            tunnel_packets.clone(),
        );
        let tunnel_drops = Family::<Labels, Counter>::default();
        registry.register(
            "tunnel_drops",
            "Tunnel packets dropped (COUNTERS), by reason: forged_source, not_local, malformed, no_device",
            tunnel_drops.clone(),
        );
        let datapath_packets = Family::<Labels, Counter>::default();
        registry.register(
            "datapath_packets",
            "Packets the BPF programs counted (COUNTERS), by counter (the names of `lockstep datapath counters`)",
            datapath_packets.clone(),
        );
        let datapath_drops = Family::<Labels, Counter>::default();
        registry.register(
            "datapath_drops",
            "Packets the BPF programs dropped, by reason",
            datapath_drops.clone(),
        );
        registry.register(
            "build",
            "The agent's version",
            Info::new(labels(&[("version", &crate::version::version())])),
        );
        let masq_counter = |registry: &mut Registry, name: &str, help: &str| {
            let c = Counter::default();
            registry.register(name, help, c.clone());
            c
        };
        let masq_table_full = masq_counter(
            &mut registry,
            "masq_table_full",
            "New flows dropped because a NAT map had no room (COUNTERS)",
        );
        let masq_endpoint_limit = masq_counter(
            &mut registry,
            "masq_endpoint_limit",
            "New flows dropped because their endpoint held its share of the NAT table (COUNTERS)",
        );
        let masq_untranslatable = masq_counter(
            &mut registry,
            "masq_untranslatable",
            "Endpoint packets to translated destinations dropped as untranslatable (COUNTERS)",
        );
        let masq_evicted = masq_counter(
            &mut registry,
            "masq_evicted",
            "Unanswered or closing translations the collector ended early, the table being nearly full",
        );
        let endpoint_leaks = Gauge::<i64>::default();
        registry.register(
            "endpoint_leaks",
            "Endpoint allocations whose Kubernetes pod has been gone longer than the grace period, not released",
            endpoint_leaks.clone(),
        );
        let endpoint_leaks_released = masq_counter(
            &mut registry,
            "endpoint_leaks_released",
            "Leaked endpoint allocations released (`[kubernetes.pods] release_leaks`)",
        );
        let owner_commands = masq_counter(
            &mut registry,
            "agent_commands",
            "Commands the agent's owner thread ran (CNI calls, API calls, the loops' steps)",
        );
        let owner_batches = masq_counter(
            &mut registry,
            "agent_batches",
            "Batches of commands the agent's owner ran together (taken from its queue at once)",
        );
        let store_commits = masq_counter(
            &mut registry,
            "store_commits",
            "Changes the agent's store accepted",
        );
        let store_log_syncs = masq_counter(
            &mut registry,
            "store_log_syncs",
            "Store log records written and synced (one fdatasync each; a batch of commands shares one)",
        );
        let owner_queued = Gauge::<i64>::default();
        registry.register(
            "agent_commands_queued",
            "Commands waiting for the agent's owner thread at the scrape",
            owner_queued.clone(),
        );
        let task_restarts = Family::<Labels, Counter>::default();
        registry.register(
            "task_restarts",
            "Tasks of the agent started again after a panic, per task",
            task_restarts.clone(),
        );
        Self {
            registry: Mutex::new(registry),
            task_restarts,
            leaks: Mutex::new(None),
            endpoint_leaks,
            endpoint_leaks_released,
            owner_commands,
            owner_batches,
            store_commits,
            store_log_syncs,
            owner_queued,
            masq: Mutex::new(None),
            masq_entries,
            masq_deleted,
            masq_translated,
            masq_exhausted,
            masq_table_full,
            masq_endpoint_limit,
            masq_untranslatable,
            masq_evicted,
            allocated,
            free,
            map_entries,
            map_capacity,
            repairs,
            pin_repairs,
            errors,
            lb_pool_addresses,
            lb_pool_conflicting,
            lb_pending,
            latency,
            draining,
            tunnel_packets,
            tunnel_drops,
            datapath_packets,
            datapath_drops,
            cluster: OnceLock::new(),
            lb: OnceLock::new(),
            bgp: Mutex::new(None),
            bgp_session_up,
            bgp_session_downs,
            bgp_announced,
            bgp_behind,
            refreshed: AtomicBool::new(false),
            heartbeats: Heartbeats::default(),
        }
    }

    /// Reports the masquerade collector's counts from now on.
    pub fn set_masquerade(&self, stats: Arc<crate::masquerade::Stats>) {
        *self.masq.lock().unwrap_or_else(|p| p.into_inner()) = Some(stats);
    }

    /// Reports the BGP speaker's status from now on.
    pub fn set_bgp(&self, status: tokio::sync::watch::Receiver<crate::wire::BgpStatus>) {
        *self.bgp.lock().unwrap_or_else(|p| p.into_inner()) = Some(status);
    }

    fn render_bgp(&self) {
        let Some(rx) = self.bgp.lock().unwrap_or_else(|p| p.into_inner()).clone() else {
            return;
        };
        let st = rx.borrow().clone();
        // A peer gone from the config leaves no series behind.
        self.bgp_session_up.clear();
        for s in &st.sessions {
            self.bgp_session_up
                .get_or_create(&labels(&[("peer", &s.peer)]))
                .set(i64::from(s.up));
            follow(
                &self
                    .bgp_session_downs
                    .get_or_create(&labels(&[("peer", &s.peer)])),
                s.downs,
            );
        }
        self.bgp_announced
            .set(i64::try_from(st.announced).unwrap_or(i64::MAX));
        self.bgp_behind.set(i64::from(st.problem.is_some()));
    }

    /// Counts a restart of `task` after a panic (`server::supervisor`).
    pub fn task_restarted(&self, task: &str) {
        self.task_restarts
            .get_or_create(&labels(&[("task", task)]))
            .inc();
    }

    /// Reports leak detection's findings from now on.
    pub fn set_leaks(&self, report: Arc<crate::kubernetes::leaks::LeakReport>) {
        *self.leaks.lock().unwrap_or_else(|p| p.into_inner()) = Some(report);
    }

    fn render_leaks(&self) {
        let Some(r) = self.leaks.lock().unwrap_or_else(|p| p.into_inner()).clone() else {
            return;
        };
        self.endpoint_leaks
            .set(i64::try_from(r.count()).unwrap_or(i64::MAX));
        follow(&self.endpoint_leaks_released, r.released());
    }

    fn render_masquerade(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        let Some(m) = self.masq.lock().unwrap_or_else(|p| p.into_inner()).clone() else {
            return;
        };
        for (family, n) in [("ipv4", &m.entries_v4), ("ipv6", &m.entries_v6)] {
            self.masq_entries
                .get_or_create(&vec![("family".to_string(), family.to_string())])
                .set(i64::try_from(n.load(Relaxed)).unwrap_or(i64::MAX));
        }
        // Counters follow monotonic sources: add what is new.
        for (counter, source) in [
            (&self.masq_deleted, &m.gc_deleted),
            (&self.masq_translated, &m.translated),
            (&self.masq_exhausted, &m.exhausted),
            (&self.masq_table_full, &m.table_full),
            (&self.masq_endpoint_limit, &m.endpoint_limit),
            (&self.masq_untranslatable, &m.untranslatable),
            (&self.masq_evicted, &m.evicted),
        ] {
            follow(counter, source.load(Relaxed));
        }
    }

    /// Records one allocation's latency.
    pub fn observe_allocation(&self, d: Duration) {
        self.latency.observe(d.as_secs_f64());
    }

    /// Whether the gauges were ever refreshed from a running agent.
    pub fn refreshed(&self) -> bool {
        self.refreshed.load(Ordering::Acquire)
    }

    /// The agent's owner's counts, read without asking it.
    pub fn observe_owner(&self, agent: &crate::agent::AgentHandle) {
        let st = agent.stats();
        follow(&self.owner_commands, st.commands.load(Ordering::Relaxed));
        follow(&self.owner_batches, st.batches.load(Ordering::Relaxed));
        follow(
            &self.store_commits,
            st.store_commits.load(Ordering::Relaxed),
        );
        follow(&self.store_log_syncs, st.log_syncs.load(Ordering::Relaxed));
        self.owner_queued
            .set(i64::try_from(agent.queued()).unwrap_or(i64::MAX));
    }

    /// Refreshes everything from the agent (on its owner): its state's
    /// gauges and the datapath's counters.
    pub fn refresh(&self, agent: &Agent) {
        self.refresh_state(agent);
        self.refresh_datapath(agent);
    }

    /// Refreshes what only the agent's commands change (pools, maps, LB,
    /// errors): cheap, run on the owner after each batch.
    pub fn refresh_state(&self, agent: &Agent) {
        for p in agent.pools() {
            for (family, (used, free)) in [("ipv4", p.v4), ("ipv6", p.v6)] {
                let l = labels(&[("pool", &p.name), ("family", family)]);
                self.allocated.get_or_create(&l).set(used as i64);
                self.free.get_or_create(&l).set(free as f64);
            }
        }
        let capacities = agent.map_capacities();
        for (map, n) in &agent.stats.entries {
            let l = labels(&[("map", map)]);
            self.map_entries.get_or_create(&l).set(*n as i64);
            if let Some(cap) = capacities.get(map) {
                self.map_capacity.get_or_create(&l).set(i64::from(*cap));
            }
        }
        for (map, n) in &agent.stats.repairs {
            follow(&self.repairs.get_or_create(&labels(&[("map", map)])), *n);
        }
        for (map, n) in &agent.stats.pin_repairs {
            follow(
                &self.pin_repairs.get_or_create(&labels(&[("map", map)])),
                *n,
            );
        }
        for (code, n) in &agent.stats.errors {
            follow(&self.errors.get_or_create(&labels(&[("code", code)])), *n);
        }
        let lb = agent.lb_metrics();
        for (pool, m) in &lb.pools {
            for (state, n) in [("used", m.used), ("free", m.free)] {
                self.lb_pool_addresses
                    .get_or_create(&labels(&[("pool", pool), ("state", state)]))
                    .set(n as i64);
            }
            self.lb_pool_conflicting
                .get_or_create(&labels(&[("pool", pool)]))
                .set(i64::from(m.conflicting));
        }
        for (reason, n) in &lb.pending_by_reason {
            self.lb_pending
                .get_or_create(&labels(&[("reason", reason)]))
                .set(*n as i64);
        }
        // Gone ranges disappear rather than read 0 forever.
        self.draining.clear();
        for r in agent.draining() {
            self.draining
                .get_or_create(&labels(&[("pool", &r.pool), ("cidr", &r.cidr.to_string())]))
                .set(r.holders.len() as i64);
        }
        self.refreshed.store(true, Ordering::Release);
    }

    /// Reads the datapath's packet and drop counters, which change without
    /// a command (a syscall per counter): by the refresher, every
    /// [`REFRESH_EVERY`].
    pub fn refresh_datapath(&self, agent: &Agent) {
        for (c, n) in agent.datapath_counters() {
            follow(
                &self
                    .datapath_packets
                    .get_or_create(&labels(&[("counter", c.name())])),
                n,
            );
            if let Some(reason) = c.drop_reason() {
                follow(
                    &self
                        .datapath_drops
                        .get_or_create(&labels(&[("reason", reason)])),
                    n,
                );
            }
            let Some(name) = c.name().strip_prefix("tunnel_") else {
                continue;
            };
            let (family, label, value) = match name.strip_prefix("drop_") {
                Some(reason) => (&self.tunnel_drops, "reason", reason),
                None => (&self.tunnel_packets, "what", name),
            };
            follow(&family.get_or_create(&labels(&[(label, value)])), n);
        }
    }

    /// Renders what the metrics hold (the agent's owner is not needed),
    /// cluster mode's and its LB agent's families included once they run:
    /// OpenMetrics, or the text format 0.0.4 ([`text`]).
    pub fn encode(
        &self,
        cluster: Option<&ClusterHandle>,
        lb: Option<&LbHandle>,
        openmetrics: bool,
    ) -> String {
        self.render_masquerade();
        self.render_leaks();
        self.render_bgp();
        let mut out = String::new();
        let Ok(mut registry) = self.registry.lock() else {
            return out;
        };
        if let Some(c) = cluster {
            self.cluster
                .get_or_init(|| cluster::ClusterFamilies::register(&mut registry))
                .set(&c.figures());
        }
        if let Some(l) = lb {
            self.lb
                .get_or_init(|| cluster::LbFamilies::register(&mut registry))
                .set(&l.figures());
        }
        let _ = encode(&mut out, &registry);
        drop(registry);
        if openmetrics {
            out
        } else {
            text::to_text(&out)
        }
    }
}

/// Refreshes the gauges as a command on the agent's owner.
async fn refresh_on_owner(metrics: &Arc<Metrics>, agent: &crate::agent::AgentHandle) {
    let m = metrics.clone();
    let _ = agent
        .ask(move |a| {
            if let Some(a) = a.as_ref() {
                m.refresh(a);
            }
        })
        .await;
}

/// The refresher's heartbeat, registered once for all its starts.
pub fn refresher_heartbeat(metrics: &Metrics) -> Heartbeat {
    metrics
        .heartbeats
        .register("metrics refresh", REFRESH_EVERY)
}

/// Refreshes the gauges from the agent every [`REFRESH_EVERY`], as a
/// command on its owner, until `stop` turns true; beats `heartbeat` (from
/// [`refresher_heartbeat`]) after each.
pub fn spawn_refresher(
    metrics: Arc<Metrics>,
    agent: crate::agent::AgentHandle,
    heartbeat: Heartbeat,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(REFRESH_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.wait_for(|s| *s) => break,
            }
            refresh_on_owner(&metrics, &agent).await;
            heartbeat.beat();
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn help_texts_need_no_escape_in_either_format() {
        // OpenMetrics escapes `"` in HELP and 0.0.4 does not: a HELP text
        // with a quote or a backslash would be wrong in one of them.
        let om = Metrics::new().encode(None, None, true);
        for line in om.lines().filter(|l| l.starts_with("# HELP ")) {
            assert!(!line.contains(['"', '\\']), "{line}");
        }
    }

    #[test]
    fn every_counter_is_total_and_the_build_is_an_info() {
        let text = Metrics::new().encode(None, None, false);
        for line in text.lines().filter_map(|l| l.strip_prefix("# TYPE ")) {
            let (name, kind) = line.split_once(' ').expect("TYPE line");
            assert_eq!(kind == "counter", name.ends_with("_total"), "{line}");
        }
        assert!(text.contains("# TYPE lockstep_build_info gauge"), "{text}");
        assert!(text.contains("lockstep_build_info{version=\""), "{text}");
    }

    #[test]
    fn a_counter_follows_its_source_and_never_goes_back() {
        let c = Counter::default();
        follow(&c, 5);
        follow(&c, 7);
        assert_eq!(c.get(), 7);
        follow(&c, 3);
        assert_eq!(c.get(), 7);
    }

    #[test]
    fn label_values_are_escaped_in_the_scrape() {
        let m = Metrics::new();
        m.lb_pending
            .get_or_create(&labels(&[("reason", "a \"quoted\" \\ reason")]))
            .set(1);
        let text = m.encode(None, None, false);
        assert!(
            text.contains(r#"lockstep_lb_pending_services{reason="a \"quoted\" \\ reason"} 1"#),
            "{text}"
        );
    }
}
