//! Cluster mode's families: registered once cluster mode (or its LB agent)
//! runs, so a single-node agent shows none of them rather than zeros that
//! read as "etcd unreachable", and set from the handles' figures at each
//! scrape.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::{Labels, follow, labels};
use crate::cluster::ClusterFigures;
use crate::cluster::lb_handle::LbFigures;

/// Cluster mode's block and etcd families.
#[derive(Debug)]
pub(super) struct ClusterFamilies {
    fenced_blocks: Gauge<i64>,
    etcd_reachable: Gauge<i64>,
    block_claims: Counter,
    unreadable_keys: Gauge<i64>,
    configured_pool_overlaps: Gauge<i64>,
    window_addresses: Gauge<i64>,
    window_publications: Counter,
    lease_renewals: Counter,
    lease_late_max: Gauge<f64, std::sync::atomic::AtomicU64>,
    whole_reads: Counter,
    changes_followed: Counter,
}

fn gauge(registry: &mut Registry, name: &str, help: &str) -> Gauge<i64> {
    let g = Gauge::<i64>::default();
    registry.register(name, help, g.clone());
    g
}

fn counter(registry: &mut Registry, name: &str, help: &str) -> Counter {
    let c = Counter::default();
    registry.register(name, help, c.clone());
    c
}

fn count(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl ClusterFamilies {
    pub(super) fn register(r: &mut Registry) -> Self {
        Self {
            fenced_blocks: gauge(
                r,
                "cluster_fenced_blocks",
                "Blocks in the local record that etcd no longer gives this node: nothing new is allocated from them",
            ),
            etcd_reachable: gauge(
                r,
                "cluster_etcd_reachable",
                "1 when the last etcd request succeeded, 0 when it failed",
            ),
            block_claims: counter(r, "cluster_block_claims", "Blocks claimed since start"),
            unreadable_keys: gauge(
                r,
                "cluster_unreadable_keys",
                "etcd keys under pools/, blocks/ or nodes/ this build cannot read (skipped; `lockstep cluster unreadable`)",
            ),
            configured_pool_overlaps: gauge(
                r,
                "cluster_configured_pool_overlaps",
                "Overlaps of a configured pool's cidr with a cluster pool or block: the cidr is withheld from the allocator",
            ),
            window_addresses: gauge(
                r,
                "cluster_window_addresses",
                "Addresses in this node's reservation window (in use, and those it may hand out without asking etcd)",
            ),
            window_publications: counter(
                r,
                "cluster_window_publications",
                "Reservation windows published to etcd since start",
            ),
            lease_renewals: counter(
                r,
                "cluster_node_lease_renewals",
                "Node lease refreshes the lease keeper sent and etcd answered since start",
            ),
            whole_reads: counter(
                r,
                "cluster_whole_reads",
                "Times the claim loop read the cluster whole again (from its mirror while live, no etcd request; else from etcd) since start",
            ),
            changes_followed: counter(
                r,
                "cluster_changes_followed",
                "Batches of cluster changes the claim loop followed in place, without a whole read, since start",
            ),
            lease_late_max: {
                let g = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
                r.register(
                    "cluster_node_lease_renewal_late_max_seconds",
                    "The latest a node lease refresh was sent against its schedule (a third of the TTL after the last) since start",
                    g.clone(),
                );
                g
            },
        }
    }

    pub(super) fn set(&self, f: &ClusterFigures) {
        self.fenced_blocks.set(count(f.fenced_blocks));
        self.etcd_reachable.set(i64::from(f.etcd_reachable));
        follow(&self.block_claims, f.block_claims);
        self.unreadable_keys.set(count(f.unreadable_keys));
        self.configured_pool_overlaps
            .set(count(f.configured_pool_overlaps));
        self.window_addresses.set(count(f.window_addresses));
        follow(&self.window_publications, f.window_publications);
        follow(&self.lease_renewals, f.lease_renewals);
        self.lease_late_max.set(f.lease_late_max.as_secs_f64());
        follow(&self.whole_reads, f.whole_reads);
        follow(&self.changes_followed, f.changes_followed);
    }
}

/// The cluster LB agent's families.
#[derive(Debug)]
pub(super) struct LbFamilies {
    announcing: Family<Labels, Gauge<i64>>,
    lease_remaining: Gauge<f64, std::sync::atomic::AtomicU64>,
    handovers: Counter,
    withdrawals: Counter,
    assigner: Gauge<i64>,
    uplink_down: Gauge<i64>,
    unannounced: Family<Labels, Gauge<i64>>,
    cannot_answer: Family<Labels, Gauge<i64>>,
    lease_renewals: Counter,
    lease_late_max: Gauge<f64, std::sync::atomic::AtomicU64>,
}

impl LbFamilies {
    pub(super) fn register(r: &mut Registry) -> Self {
        let announcing = Family::<Labels, Gauge<i64>>::default();
        r.register(
            "lb_announcing",
            "Addresses this node announces (holds the etcd key of), one series per address",
            announcing.clone(),
        );
        let lease_remaining = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        r.register(
            "lb_announce_lease_remaining_seconds",
            "How long this node's announcements are answered without another etcd lease refresh",
            lease_remaining.clone(),
        );
        let unannounced = Family::<Labels, Gauge<i64>>::default();
        r.register(
            "lb_unannounced",
            "Addresses to announce that no live node's labels admit (their pool's node_selector matches none): nobody answers for them",
            unannounced.clone(),
        );
        let cannot_answer = Family::<Labels, Gauge<i64>>::default();
        r.register(
            "lb_cannot_answer",
            "Addresses this node gave up because it could not answer them within a rank step (its announcement map refused them, or its writes keep failing)",
            cannot_answer.clone(),
        );
        Self {
            announcing,
            lease_remaining,
            handovers: counter(
                r,
                "lb_handovers",
                "Announcements this node took (key created, then programmed)",
            ),
            withdrawals: counter(
                r,
                "lb_withdrawals",
                "Announcements this node gave up (unprogrammed, then key deleted)",
            ),
            assigner: gauge(
                r,
                "lb_assigner",
                "1 when this node is the elected LB assigner",
            ),
            uplink_down: gauge(
                r,
                "lb_uplink_down",
                "1 when the uplink is down or without carrier: this node stopped refreshing its LB lease, so its announcements move to other nodes",
            ),
            unannounced,
            cannot_answer,
            lease_renewals: counter(
                r,
                "lb_lease_renewals",
                "LB lease refreshes sent and answered since start",
            ),
            lease_late_max: {
                let g = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
                r.register(
                    "lb_lease_renewal_late_max_seconds",
                    "The latest an LB lease refresh was sent against its schedule (a third of the TTL after the last) since start",
                    g.clone(),
                );
                g
            },
        }
    }

    pub(super) fn set(&self, f: &LbFigures) {
        // Addresses gone disappear rather than read 0 forever.
        self.announcing.clear();
        for a in &f.announcing {
            self.announcing
                .get_or_create(&labels(&[("address", &a.to_string())]))
                .set(1);
        }
        self.lease_remaining.set(f.lease_remaining_seconds);
        follow(&self.handovers, f.handovers);
        follow(&self.withdrawals, f.withdrawals);
        self.assigner.set(i64::from(f.assigner));
        self.uplink_down.set(i64::from(f.uplink_down));
        follow(&self.lease_renewals, f.lease_renewals);
        self.lease_late_max.set(f.lease_late_max.as_secs_f64());
        self.unannounced.clear();
        for (a, pool) in &f.unannounced {
            self.unannounced
                .get_or_create(&labels(&[("address", &a.to_string()), ("pool", pool)]))
                .set(1);
        }
        self.cannot_answer.clear();
        for a in &f.cannot_answer {
            self.cannot_answer
                .get_or_create(&labels(&[("address", &a.to_string())]))
                .set(1);
        }
    }
}
