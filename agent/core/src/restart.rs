//! Whether a task of the agent that panicked is started again, and after
//! how long. The daemon's supervisor asks this for every task it may
//! restart; the decision lives here so it is property-tested: a task that
//! keeps panicking is not restarted forever (the agent stops instead, and
//! its DaemonSet starts it afresh), and one that panicked once long ago
//! gets its full budget back.

use std::collections::VecDeque;

/// How many restarts a task is allowed, within what time, and how long
/// each waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RestartPolicy {
    /// Restarts allowed within [`RestartPolicy::window_ms`]; one more panic
    /// within that time gives up.
    pub max: usize,
    /// The window the restarts are counted in.
    pub window_ms: u64,
    /// The wait before the first restart in a window; each further one
    /// waits twice as long.
    pub first_delay_ms: u64,
    /// The longest wait.
    pub max_delay_ms: u64,
}

impl Default for RestartPolicy {
    /// Five restarts in five minutes, waiting 100 ms, 200 ms, … up to 10 s.
    fn default() -> Self {
        Self {
            max: 5,
            window_ms: 300_000,
            first_delay_ms: 100,
            max_delay_ms: 10_000,
        }
    }
}

/// What to do with a task that just panicked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Start it again after this wait.
    Restart {
        /// Milliseconds to wait first.
        after_ms: u64,
    },
    /// It panicked more than the policy allows: stop the agent.
    GiveUp {
        /// The restarts it had within the window.
        restarts: usize,
    },
}

/// One task's restarts so far.
#[derive(Clone, Debug)]
pub struct Restarts {
    policy: RestartPolicy,
    /// When each restart within the window was granted.
    at_ms: VecDeque<u64>,
}

impl Restarts {
    /// No restart yet.
    pub fn new(policy: RestartPolicy) -> Self {
        Self {
            policy,
            at_ms: VecDeque::new(),
        }
    }

    /// The task panicked at `now_ms` (a monotonic clock): restart it, or
    /// give up.
    pub fn panicked(&mut self, now_ms: u64) -> Verdict {
        while self
            .at_ms
            .front()
            .is_some_and(|t| now_ms.saturating_sub(*t) >= self.policy.window_ms)
        {
            self.at_ms.pop_front();
        }
        let recent = self.at_ms.len();
        if recent >= self.policy.max {
            return Verdict::GiveUp { restarts: recent };
        }
        self.at_ms.push_back(now_ms);
        let factor = 1u64.checked_shl(u32::try_from(recent).unwrap_or(u32::MAX));
        let after_ms = factor
            .and_then(|f| self.policy.first_delay_ms.checked_mul(f))
            .map_or(self.policy.max_delay_ms, |d| {
                d.min(self.policy.max_delay_ms)
            });
        Verdict::Restart { after_ms }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn five_restarts_waiting_longer_each_then_it_gives_up() {
        let mut r = Restarts::new(RestartPolicy::default());
        let waits: Vec<Verdict> = (0..6).map(|i| r.panicked(i * 1_000)).collect();
        assert_eq!(
            waits,
            [100, 200, 400, 800, 1_600]
                .map(|after_ms| Verdict::Restart { after_ms })
                .into_iter()
                .chain([Verdict::GiveUp { restarts: 5 }])
                .collect::<Vec<_>>()
        );
        // Five minutes after the first, one restart is back.
        assert_eq!(
            r.panicked(300_000),
            Verdict::Restart { after_ms: 1_600 },
            "four restarts are still in the window"
        );
    }

    proptest! {
        /// Whatever the panics' times: never more than `max` restarts
        /// within any window, each wait within the policy's bounds, and a
        /// panic after a quiet window always restarts at the first wait.
        #[test]
        fn restarts_stay_within_the_budget(
            gaps in proptest::collection::vec(0u64..120_000, 1..60),
            max in 1usize..8,
        ) {
            let policy = RestartPolicy { max, ..RestartPolicy::default() };
            let mut r = Restarts::new(policy);
            let mut now = 0u64;
            let mut granted: Vec<u64> = Vec::new();
            for gap in gaps {
                now += gap;
                let quiet = granted.last().is_none_or(|t| now - t >= policy.window_ms);
                match r.panicked(now) {
                    Verdict::Restart { after_ms } => {
                        prop_assert!(after_ms >= policy.first_delay_ms);
                        prop_assert!(after_ms <= policy.max_delay_ms);
                        if quiet {
                            prop_assert_eq!(after_ms, policy.first_delay_ms);
                        }
                        granted.push(now);
                    }
                    Verdict::GiveUp { restarts } => {
                        prop_assert!(!quiet, "gave up after a quiet window");
                        let in_window = granted
                            .iter()
                            .filter(|t| now - **t < policy.window_ms)
                            .count();
                        prop_assert_eq!(restarts, in_window);
                        prop_assert_eq!(in_window, max);
                    }
                }
                let in_window = granted.iter().filter(|t| now - **t < policy.window_ms).count();
                prop_assert!(in_window <= max);
            }
        }
    }
}
