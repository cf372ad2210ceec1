//! How many addresses the node should hold.
//!
//! A node gets its CIDRs from somewhere else (an operator, a cloud API, a
//! cluster store) and has to say how many addresses it wants. This module turns
//! "in use", "requests waiting" and the configured buffer into that number,
//! and decides when holding too many is stable enough to give some back.
//!
//! Two modes, because consumers want different things:
//! - [`DemandMode::Ceil`]: `max(in_use + pending + pre_allocate, min_allocate)`
//!   rounded up to whole blocks, for sources that hand out fixed-size CIDRs.
//! - [`DemandMode::Linear`]: exactly `in_use + pre_allocate`, for cloud prefix
//!   sources that size the node's prefixes themselves; because the figure is
//!   exact, whoever reads it can recover the node's usage
//!   (`target - pre_allocate`). Pending requests and `min_allocate` are not
//!   added in this mode for the same reason.
//!
//! Giving addresses back is guarded twice. Nothing is released before the
//! caller says restore has finished (until then "in use" is not known, and a
//! node that just restarted would hand back CIDRs its endpoints still use).
//! And a surplus must persist for a number of evaluations *and* a duration
//! (hysteresis), and only the smallest surplus seen during that window is
//! released, so a short dip in usage does not make demand flap.
//!
//! Time is passed in as milliseconds since an arbitrary epoch: the module never
//! reads a clock.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::owner::Owner;

/// Errors in demand configuration.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DemandError {
    /// A ceil block of zero addresses.
    #[error("demand block size must be at least 1 address")]
    ZeroBlockSize,
}

/// How the target is computed; see the module documentation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum DemandMode {
    /// Round up to whole blocks of `block_size` addresses.
    Ceil {
        /// Addresses per CIDR block the source hands out (256 for a /24).
        block_size: u64,
    },
    /// Exactly `in_use + pre_allocate`.
    Linear,
}

/// Demand settings of one manager.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DemandConfig {
    /// Target computation: `"linear"` or `{"ceil": {"block_size": 256}}`.
    pub mode: DemandMode,
    /// Free addresses to keep ready for new requests.
    #[serde(default)]
    pub pre_allocate: u64,
    /// Least number of addresses to hold (ceil mode only).
    #[serde(default)]
    pub min_allocate: u64,
    /// Surplus tolerated above the target before anything is released.
    #[serde(default)]
    pub max_above_watermark: u64,
    /// A pending request not completed within this time no longer counts.
    pub pending_timeout_ms: u64,
    /// A surplus must be seen in this many consecutive evaluations...
    pub release_after_evaluations: u32,
    /// ...and for at least this long before it is released.
    pub release_after_ms: u64,
}

impl Default for DemandConfig {
    fn default() -> Self {
        DemandConfig {
            mode: DemandMode::Linear,
            pre_allocate: 0,
            min_allocate: 0,
            max_above_watermark: 0,
            pending_timeout_ms: 60_000,
            release_after_evaluations: 3,
            release_after_ms: 120_000,
        }
    }
}

/// Usage figures the caller (usually the manager) measures.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Addresses allocated.
    pub in_use: u64,
    /// Addresses the node holds (capacity of its active CIDRs).
    pub available: u64,
}

/// The outcome of one evaluation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Demand {
    /// Addresses the node should hold.
    pub target: u64,
    /// Unexpired pending requests counted.
    pub pending: u64,
    /// Addresses to obtain now: `target - available` when positive.
    pub request: u64,
    /// [`Demand::request`] in whole blocks (ceil mode), else 0.
    pub request_blocks: u64,
    /// Addresses that may be given back now: 0 until restore has finished and
    /// the hysteresis window has passed.
    pub release: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Streak {
    since_ms: u64,
    evaluations: u32,
    min_surplus: u64,
}

/// Demand state of one address family of one manager.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DemandTracker {
    config: DemandConfig,
    /// Owner → expiry time.
    pending: BTreeMap<Owner, u64>,
    restore_finished: bool,
    streak: Option<Streak>,
}

impl DemandTracker {
    /// A tracker with nothing pending and restore not yet finished.
    ///
    /// # Errors
    /// [`DemandError::ZeroBlockSize`].
    pub fn new(config: DemandConfig) -> Result<Self, DemandError> {
        if config.mode == (DemandMode::Ceil { block_size: 0 }) {
            return Err(DemandError::ZeroBlockSize);
        }
        Ok(DemandTracker {
            config,
            pending: BTreeMap::new(),
            restore_finished: false,
            streak: None,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &DemandConfig {
        &self.config
    }

    /// Records a request that could not be served yet (or refreshes its
    /// expiry).
    pub fn add_pending(&mut self, owner: Owner, now_ms: u64) {
        let expires = now_ms.saturating_add(self.config.pending_timeout_ms);
        self.pending.insert(owner, expires);
    }

    /// Drops a pending request (it was served or withdrawn). Returns whether
    /// it was pending.
    pub fn complete_pending(&mut self, owner: &Owner) -> bool {
        self.pending.remove(owner).is_some()
    }

    /// Unexpired pending requests at `now_ms`.
    pub fn pending(&self, now_ms: u64) -> u64 {
        self.pending.values().filter(|&&exp| exp > now_ms).count() as u64
    }

    /// Allows releases from now on; call once the allocations are restored.
    pub fn finish_restore(&mut self) {
        self.restore_finished = true;
    }

    /// Whether [`DemandTracker::finish_restore`] was called.
    pub fn restore_finished(&self) -> bool {
        self.restore_finished
    }

    /// The target alone, without side effects.
    pub fn target(&self, in_use: u64, pending: u64) -> u64 {
        let c = &self.config;
        match c.mode {
            DemandMode::Linear => in_use.saturating_add(c.pre_allocate),
            DemandMode::Ceil { block_size } => {
                let raw = in_use
                    .saturating_add(pending)
                    .saturating_add(c.pre_allocate)
                    .max(c.min_allocate);
                raw.div_ceil(block_size).saturating_mul(block_size)
            }
        }
    }

    /// Evaluates demand at `now_ms`: expires pending requests, computes the
    /// target, and advances the hysteresis. When [`Demand::release`] is
    /// non-zero the caller is expected to give that many addresses back (or
    /// fewer, in whole CIDRs); the hysteresis window starts over.
    pub fn evaluate(&mut self, now_ms: u64, usage: Usage) -> Demand {
        self.pending.retain(|_, exp| *exp > now_ms);
        let pending = self.pending.len() as u64;
        let target = self.target(usage.in_use, pending);
        let request = target.saturating_sub(usage.available);
        let block = match self.config.mode {
            DemandMode::Ceil { block_size } => block_size,
            DemandMode::Linear => 1,
        };
        let request_blocks = match self.config.mode {
            DemandMode::Ceil { block_size } => request.div_ceil(block_size),
            DemandMode::Linear => 0,
        };
        let over = usage
            .available
            .saturating_sub(target.saturating_add(self.config.max_above_watermark));
        let surplus = over / block * block;
        let release = self.advance_streak(now_ms, surplus);
        Demand {
            target,
            pending,
            request,
            request_blocks,
            release,
        }
    }

    /// Hysteresis: returns the surplus to release now, if the window passed.
    fn advance_streak(&mut self, now_ms: u64, surplus: u64) -> u64 {
        if surplus == 0 || !self.restore_finished {
            self.streak = None;
            return 0;
        }
        let streak = self.streak.get_or_insert(Streak {
            since_ms: now_ms,
            evaluations: 0,
            min_surplus: surplus,
        });
        streak.evaluations += 1;
        streak.min_surplus = streak.min_surplus.min(surplus);
        let held = now_ms.saturating_sub(streak.since_ms);
        if streak.evaluations >= self.config.release_after_evaluations
            && held >= self.config.release_after_ms
        {
            let release = streak.min_surplus;
            self.streak = None;
            release
        } else {
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tracker(mode: DemandMode) -> DemandTracker {
        DemandTracker::new(DemandConfig {
            mode,
            pre_allocate: 8,
            min_allocate: 0,
            max_above_watermark: 0,
            pending_timeout_ms: 1_000,
            release_after_evaluations: 3,
            release_after_ms: 10_000,
        })
        .unwrap()
    }

    fn usage(in_use: u64, available: u64) -> Usage {
        Usage { in_use, available }
    }

    #[test]
    fn zero_block_size_is_refused() {
        let cfg = DemandConfig {
            mode: DemandMode::Ceil { block_size: 0 },
            ..DemandConfig::default()
        };
        let err = DemandTracker::new(cfg).unwrap_err();
        assert_eq!(
            err.to_string(),
            "demand block size must be at least 1 address"
        );
    }

    #[test]
    fn ceil_rounds_up_to_whole_blocks() {
        let mut t = tracker(DemandMode::Ceil { block_size: 256 });
        t.add_pending(Owner::endpoint("a", "eth0"), 0);
        let d = t.evaluate(0, usage(250, 256));
        // 250 + 1 pending + 8 = 259 → two /24s.
        assert_eq!(d.target, 512);
        assert_eq!(d.pending, 1);
        assert_eq!(d.request, 256);
        assert_eq!(d.request_blocks, 1);
    }

    #[test]
    fn ceil_honours_min_allocate() {
        let mut t = tracker(DemandMode::Ceil { block_size: 16 });
        t.config.min_allocate = 40;
        assert_eq!(t.evaluate(0, usage(0, 0)).target, 48);
    }

    #[test]
    fn linear_is_exactly_in_use_plus_pre_allocate() {
        let mut t = tracker(DemandMode::Linear);
        t.config.min_allocate = 1_000;
        t.add_pending(Owner::endpoint("a", "eth0"), 0);
        let d = t.evaluate(0, usage(21, 16));
        assert_eq!(d.target, 29);
        assert_eq!(d.request, 13);
        assert_eq!(d.request_blocks, 0);
        // Usage is recoverable from the figure alone.
        assert_eq!(d.target - t.config().pre_allocate, 21);
    }

    #[test]
    fn cloud_28_prefixes_cover_linear_demand_in_sixteens() {
        // Each /28 with first and last usable is 16 addresses (see the manager
        // tests for the allocator side). 20 in use + 8 → 28 → two prefixes.
        let mut t = tracker(DemandMode::Linear);
        let d = t.evaluate(0, usage(20, 16));
        assert_eq!(d.request, 12);
        assert_eq!(d.request.div_ceil(16), 1);
        assert_eq!(t.evaluate(0, usage(20, 32)).request, 0);
    }

    #[test]
    fn pending_requests_expire() {
        let mut t = tracker(DemandMode::Ceil { block_size: 1 });
        t.add_pending(Owner::endpoint("a", "eth0"), 0);
        t.add_pending(Owner::endpoint("b", "eth0"), 500);
        assert_eq!(t.pending(999), 2);
        assert_eq!(t.evaluate(999, usage(0, 0)).pending, 2);
        assert_eq!(t.evaluate(1_000, usage(0, 0)).pending, 1);
        assert_eq!(t.evaluate(1_500, usage(0, 0)).pending, 0);
        t.add_pending(Owner::endpoint("c", "eth0"), 2_000);
        assert!(t.complete_pending(&Owner::endpoint("c", "eth0")));
        assert_eq!(t.evaluate(2_000, usage(0, 0)).pending, 0);
    }

    #[test]
    fn nothing_is_released_before_restore_finishes() {
        let mut t = tracker(DemandMode::Linear);
        for now in (0..100_000).step_by(5_000) {
            assert_eq!(t.evaluate(now, usage(0, 64)).release, 0);
        }
        t.finish_restore();
        // The hysteresis window starts only now.
        assert_eq!(t.evaluate(100_000, usage(0, 64)).release, 0);
        assert_eq!(t.evaluate(105_000, usage(0, 64)).release, 0);
        assert_eq!(t.evaluate(110_000, usage(0, 64)).release, 56);
    }

    #[test]
    fn hysteresis_needs_evaluations_and_time_and_releases_the_minimum() {
        let mut t = tracker(DemandMode::Ceil { block_size: 16 });
        t.finish_restore();
        // target = ceil(8 + in_use) to 16.
        assert_eq!(t.evaluate(0, usage(0, 64)).release, 0); // surplus 48
        assert_eq!(t.evaluate(20_000, usage(10, 64)).release, 0); // surplus 32
        // Third evaluation, 30 s in: releases the smallest surplus seen.
        assert_eq!(t.evaluate(30_000, usage(0, 64)).release, 32);
        // Window restarts after a release.
        assert_eq!(t.evaluate(31_000, usage(0, 64)).release, 0);
    }

    #[test]
    fn a_dip_in_surplus_resets_the_window() {
        let mut t = tracker(DemandMode::Linear);
        t.finish_restore();
        t.evaluate(0, usage(0, 32));
        t.evaluate(5_000, usage(0, 32));
        // Usage comes back: no surplus, the streak is gone.
        assert_eq!(t.evaluate(6_000, usage(24, 32)).release, 0);
        assert_eq!(t.evaluate(20_000, usage(0, 32)).release, 0);
        assert_eq!(t.evaluate(25_000, usage(0, 32)).release, 0);
        assert_eq!(t.evaluate(29_000, usage(0, 32)).release, 0); // only 9 s
        assert_eq!(t.evaluate(30_000, usage(0, 32)).release, 24);
    }

    #[test]
    fn watermark_tolerates_some_surplus() {
        let mut t = tracker(DemandMode::Linear);
        t.config.max_above_watermark = 16;
        t.config.release_after_evaluations = 1;
        t.config.release_after_ms = 0;
        t.finish_restore();
        assert_eq!(t.evaluate(0, usage(0, 24)).release, 0);
        assert_eq!(t.evaluate(0, usage(0, 40)).release, 16);
    }

    #[test]
    fn config_deserialises() {
        let json = r#"{"mode":{"ceil":{"block_size":256}},"pre_allocate":8,
                       "pending_timeout_ms":1000,"release_after_evaluations":3,
                       "release_after_ms":60000}"#;
        let cfg: DemandConfig = serde_json::from_str(json).unwrap();
        assert_eq!(cfg.mode, DemandMode::Ceil { block_size: 256 });
        assert_eq!(cfg.pre_allocate, 8);
        let linear = r#"{"mode":"linear","pending_timeout_ms":1,"release_after_evaluations":1,
                         "release_after_ms":1}"#;
        let cfg: DemandConfig = serde_json::from_str(linear).unwrap();
        assert_eq!(cfg.mode, DemandMode::Linear);
        assert!(
            serde_json::from_str::<DemandConfig>(&linear.replace("\"mode\"", "\"mdoe\"")).is_err()
        );
    }
}
