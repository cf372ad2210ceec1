//! Prometheus metrics, served on a loopback address by default.
//!
//! Gauges (pool usage, map entries) are refreshed from the agent; counters
//! (repairs, errors) come from the agent's own tallies. A scrape never waits
//! for the agent's lock, which CNI calls and commits hold (#27 item 9): it
//! refreshes the gauges itself when the lock is free at that instant (so
//! they agree with the state an API call just returned), and serves what it
//! has otherwise. [`spawn_refresher`] refreshes them every [`REFRESH_EVERY`]
//! off the scrape path, so they are never older than that plus one lock
//! wait. Scrapes take the lock only when nobody holds it, for the time of a
//! refresh, and at most as many at once as the metrics listener's
//! connection limit.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, TryLockError};
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::agent::Agent;

type Labels = Vec<(String, String)>;

/// The background refresh period ([`spawn_refresher`]).
pub const REFRESH_EVERY: Duration = Duration::from_secs(2);

/// The agent's metrics.
pub struct Metrics {
    registry: Mutex<Registry>,
    /// The masquerade collector's counts, once it runs.
    masq: Mutex<Option<Arc<crate::masquerade::Stats>>>,
    masq_entries: Family<Labels, Gauge<i64>>,
    masq_deleted: prometheus_client::metrics::counter::Counter,
    masq_translated: prometheus_client::metrics::counter::Counter,
    masq_exhausted: prometheus_client::metrics::counter::Counter,
    masq_table_full: prometheus_client::metrics::counter::Counter,
    masq_endpoint_limit: prometheus_client::metrics::counter::Counter,
    masq_untranslatable: prometheus_client::metrics::counter::Counter,
    masq_evicted: prometheus_client::metrics::counter::Counter,
    allocated: Family<Labels, Gauge<i64>>,
    free: Family<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    map_entries: Family<Labels, Gauge<i64>>,
    repairs: Family<Labels, Gauge<i64>>,
    pin_repairs: Family<Labels, Gauge<i64>>,
    errors: Family<Labels, Gauge<i64>>,
    lb_pool: Family<Labels, Gauge<i64>>,
    lb_pending: Family<Labels, Gauge<i64>>,
    latency: Histogram,
    draining: Family<Labels, Gauge<i64>>,
    tunnel_packets: Family<Labels, Gauge<i64>>,
    tunnel_drops: Family<Labels, Gauge<i64>>,
    /// Kubernetes leak detection's report, once it runs.
    leaks: Mutex<Option<Arc<crate::kubernetes::leaks::LeakReport>>>,
    endpoint_leaks: Gauge<i64>,
    endpoint_leaks_released: prometheus_client::metrics::counter::Counter,
    /// Whether the gauges were ever refreshed from a running agent.
    refreshed: AtomicBool,
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
        let repairs = Family::<Labels, Gauge<i64>>::default();
        let pin_repairs = Family::<Labels, Gauge<i64>>::default();
        let errors = Family::<Labels, Gauge<i64>>::default();
        let lb_pool = Family::<Labels, Gauge<i64>>::default();
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
            "reconcile_repairs",
            "Map entries repaired by periodic reconciles since start",
            repairs.clone(),
        );
        registry.register(
            "pin_repairs_total",
            "Map pins put back since start (removed, or replaced by another map), by map",
            pin_repairs.clone(),
        );
        registry.register(
            "errors",
            "Failed operations since start, by error code",
            errors.clone(),
        );
        registry.register(
            "lb_pool",
            "LoadBalancer pools: used and free addresses, conflicting (1/0)",
            lb_pool.clone(),
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
        let masq_entries = Family::<Labels, Gauge<i64>>::default();
        registry.register(
            "masq_entries",
            "Masquerade translations (NAT_FWD entries) at the last collection, by family",
            masq_entries.clone(),
        );
        let masq_deleted = prometheus_client::metrics::counter::Counter::default();
        registry.register(
            "masq_gc_deleted",
            "NAT entries the collector deleted (forward and reverse)",
            masq_deleted.clone(),
        );
        let masq_translated = prometheus_client::metrics::counter::Counter::default();
        registry.register(
            "masq_translations",
            "Packets to_native translated (COUNTERS)",
            masq_translated.clone(),
        );
        let masq_exhausted = prometheus_client::metrics::counter::Counter::default();
        registry.register(
            "masq_exhausted",
            "New flows dropped for want of a free translated port (COUNTERS)",
            masq_exhausted.clone(),
        );
        let tunnel_packets = Family::<Labels, Gauge<i64>>::default();
        registry.register(
            "tunnel_packets",
            "Packets through the tunnel (COUNTERS): encapsulated (encap), delivered after decapsulation (decap), answered as too big for the path (pmtu_answered)",
            tunnel_packets.clone(),
        );
        let tunnel_drops = Family::<Labels, Gauge<i64>>::default();
        registry.register(
            "tunnel_drops",
            "Tunnel packets dropped (COUNTERS), by reason: forged_source, not_local, malformed, no_device",
            tunnel_drops.clone(),
        );
        let masq_counter = |registry: &mut Registry, name: &str, help: &str| {
            let c = prometheus_client::metrics::counter::Counter::default();
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
        Self {
            registry: Mutex::new(registry),
            leaks: Mutex::new(None),
            endpoint_leaks,
            endpoint_leaks_released,
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
            repairs,
            pin_repairs,
            errors,
            lb_pool,
            lb_pending,
            latency,
            draining,
            tunnel_packets,
            tunnel_drops,
            refreshed: AtomicBool::new(false),
        }
    }

    /// Reports the masquerade collector's counts from now on.
    pub fn set_masquerade(&self, stats: Arc<crate::masquerade::Stats>) {
        *self.masq.lock().unwrap_or_else(|p| p.into_inner()) = Some(stats);
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
        let released = r.released();
        self.endpoint_leaks_released
            .inc_by(released.saturating_sub(self.endpoint_leaks_released.get()));
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
            let now = source.load(Relaxed);
            counter.inc_by(now.saturating_sub(counter.get()));
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

    /// A scrape's refresh: from the agent in `slot` only if its lock is free
    /// now; never waits for the lock.
    pub fn refresh_if_free(&self, slot: &Mutex<Option<Agent>>) {
        let guard = match slot.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return,
        };
        if let Some(agent) = guard.as_ref() {
            self.refresh(agent);
        }
    }

    /// Refreshes the gauges from the agent (its lock held by the caller).
    pub fn refresh(&self, agent: &Agent) {
        for p in agent.pools() {
            for (family, (used, free)) in [("ipv4", p.v4), ("ipv6", p.v6)] {
                let labels = vec![
                    ("pool".to_string(), p.name.clone()),
                    ("family".to_string(), family.to_string()),
                ];
                self.allocated.get_or_create(&labels).set(used as i64);
                self.free.get_or_create(&labels).set(free as f64);
            }
        }
        for (map, n) in &agent.stats.entries {
            self.map_entries
                .get_or_create(&vec![("map".to_string(), map.to_string())])
                .set(*n as i64);
        }
        for (map, n) in &agent.stats.repairs {
            self.repairs
                .get_or_create(&vec![("map".to_string(), map.clone())])
                .set(*n as i64);
        }
        for (map, n) in &agent.stats.pin_repairs {
            self.pin_repairs
                .get_or_create(&vec![("map".to_string(), map.clone())])
                .set(*n as i64);
        }
        for (code, n) in &agent.stats.errors {
            self.errors
                .get_or_create(&vec![("code".to_string(), code.to_string())])
                .set(*n as i64);
        }
        let lb = agent.lb_metrics();
        for (pool, m) in &lb.pools {
            for (what, n) in [
                ("used", m.used as i64),
                ("free", m.free as i64),
                ("conflicting", i64::from(m.conflicting)),
            ] {
                self.lb_pool
                    .get_or_create(&vec![
                        ("pool".to_string(), pool.clone()),
                        ("state".to_string(), what.to_string()),
                    ])
                    .set(n);
            }
        }
        for (reason, n) in &lb.pending_by_reason {
            self.lb_pending
                .get_or_create(&vec![("reason".to_string(), reason.clone())])
                .set(*n as i64);
        }
        // Gone ranges disappear rather than read 0 forever.
        self.draining.clear();
        for r in agent.draining() {
            self.draining
                .get_or_create(&vec![
                    ("pool".to_string(), r.pool.clone()),
                    ("cidr".to_string(), r.cidr.to_string()),
                ])
                .set(r.holders.len() as i64);
        }
        for (c, n) in agent.tunnel_counters() {
            let name = c.name().trim_start_matches("tunnel_");
            let (family, label, value) = match name.strip_prefix("drop_") {
                Some(reason) => (&self.tunnel_drops, "reason", reason),
                None => (&self.tunnel_packets, "what", name),
            };
            family
                .get_or_create(&vec![(label.to_string(), value.to_string())])
                .set(n as i64);
        }
        self.refreshed.store(true, Ordering::Release);
    }

    /// Renders the text format from what the metrics hold (the agent's
    /// lock is not needed).
    pub fn encode(&self) -> String {
        self.render_masquerade();
        self.render_leaks();
        let mut out = String::new();
        if let Ok(registry) = self.registry.lock() {
            let _ = encode(&mut out, &registry);
        }
        out
    }
}

/// Refreshes the gauges from the agent every [`REFRESH_EVERY`], waiting for
/// its lock on the blocking pool (never on a scrape's path), until `stop`
/// turns true.
pub fn spawn_refresher(
    metrics: Arc<Metrics>,
    slot: Arc<Mutex<Option<Agent>>>,
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
            let (m, slot) = (metrics.clone(), slot.clone());
            let _ = tokio::task::spawn_blocking(move || {
                let guard = slot
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                if let Some(agent) = guard.as_ref() {
                    m.refresh(agent);
                }
            })
            .await;
        }
    })
}
