//! Jittered exponential backoff for every etcd retry (#47 item 3).
//!
//! Why: a fixed retry period makes every node of a cluster ask etcd again
//! at the same moments: after a leader change or a partition heals,
//! thousands of watches, lease refreshes and requests arrive together, at
//! the moment etcd is weakest. Each retry loop here holds a [`Backoff`]:
//! the first retry after `min`, each next one twice as long up to `max`,
//! each delay stretched by a random fraction of itself (in `[d, 2d)`), so
//! nodes that failed together retry apart; a success resets it.
//!
//! The delays come from `backon`'s exponential builder; the loops keep
//! their own `select!` on stop and wake-ups, so only its delay iterator is
//! used.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};

/// The delays of one retry loop.
#[derive(Debug)]
pub struct Backoff {
    builder: ExponentialBuilder,
    delays: ExponentialBackoff,
    max: Duration,
}

impl Backoff {
    /// Delays from `min`, doubling up to `max`, each stretched by a random
    /// fraction of itself: a delay `d` is waited as `[d, 2d)`.
    #[must_use]
    pub fn new(min: Duration, max: Duration) -> Self {
        let builder = ExponentialBuilder::default()
            .with_min_delay(min)
            .with_max_delay(max.max(min))
            .with_factor(2.0)
            .with_jitter()
            .without_max_times();
        Self {
            delays: builder.build(),
            builder,
            max,
        }
    }

    /// The next delay.
    pub fn next_delay(&mut self) -> Duration {
        // Never ends (no limit on the number of retries); the bound is
        // only there for the type.
        self.delays.next().unwrap_or(self.max)
    }

    /// After a success: the next failure waits `min` again.
    pub fn reset(&mut self) {
        self.delays = self.builder.build();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn delays_double_up_to_the_maximum_each_stretched_under_twice_itself() {
        let mut b = Backoff::new(100 * MS, 800 * MS);
        let base = [100, 200, 400, 800, 800, 800, 800];
        for (i, d) in base.iter().enumerate() {
            let got = b.next_delay();
            assert!(
                got >= *d * MS && got < 2 * *d * MS,
                "retry {i}: {got:?} outside [{d} ms, {} ms)",
                2 * d
            );
        }
    }

    #[test]
    fn a_reset_starts_from_the_minimum_again() {
        let mut b = Backoff::new(50 * MS, 400 * MS);
        for _ in 0..6 {
            b.next_delay();
        }
        b.reset();
        let got = b.next_delay();
        assert!(got >= 50 * MS && got < 100 * MS, "{got:?}");
    }

    #[test]
    fn nodes_failing_together_retry_apart() {
        // 100 loops that failed at the same moment: their first retries
        // spread over the jitter's whole width, not onto one instant.
        let firsts: Vec<Duration> = (0..100)
            .map(|_| Backoff::new(100 * MS, 100 * MS).next_delay())
            .collect();
        let lo = firsts.iter().min().copied().unwrap_or_default();
        let hi = firsts.iter().max().copied().unwrap_or_default();
        assert!(lo >= 100 * MS && hi < 200 * MS, "{lo:?}..{hi:?}");
        assert!(hi - lo >= 50 * MS, "100 first retries within {:?}", hi - lo);
    }
}
