//! Liveness: whether each of the agent's loops made progress recently
//! enough. The daemon's `/healthz` answers from this, so a hung agent (a
//! loop stuck behind a lock, a blocked syscall) is restarted by the kubelet
//! while a busy one is not.

/// One loop's last sign of progress.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Beat {
    /// The loop's name, as `/healthz` reports it.
    pub name: &'static str,
    /// How often the loop runs, in milliseconds.
    pub period_ms: u64,
    /// When it last finished a pass (milliseconds on the daemon's monotonic
    /// clock), or `None` before its first.
    pub last_ms: Option<u64>,
    /// When it was started (same clock).
    pub started_ms: u64,
}

/// The slack on top of a loop's allowance: one slow pass (a reconcile of
/// 100k entries, a blocked fsync that returns) is not a hang.
pub const SLACK_MS: u64 = 30_000;

/// How long a loop may go without finishing a pass: three periods and
/// [`SLACK_MS`].
pub fn allowance_ms(period_ms: u64) -> u64 {
    period_ms.saturating_mul(3).saturating_add(SLACK_MS)
}

/// The loops that made no progress within their allowance at `now_ms`,
/// each with how long it has been silent; empty when the agent is live.
/// A loop that never finished a pass counts from its start.
pub fn stale(beats: &[Beat], now_ms: u64) -> Vec<String> {
    beats
        .iter()
        .filter_map(|b| {
            let since = b.last_ms.unwrap_or(b.started_ms);
            let silent = now_ms.saturating_sub(since);
            (silent > allowance_ms(b.period_ms)).then(|| {
                format!(
                    "{} silent for {:.1} s (runs every {:.1} s)",
                    b.name,
                    silent as f64 / 1e3,
                    b.period_ms as f64 / 1e3
                )
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn beat(last_ms: Option<u64>) -> Beat {
        Beat {
            name: "reconcile",
            period_ms: 10_000,
            last_ms,
            started_ms: 1_000,
        }
    }

    #[test]
    fn a_loop_within_three_periods_and_the_slack_is_live() {
        assert!(stale(&[beat(Some(5_000))], 5_000 + allowance_ms(10_000)).is_empty());
        assert_eq!(allowance_ms(10_000), 60_000);
    }

    #[test]
    fn a_loop_silent_past_its_allowance_is_named_with_its_silence() {
        let out = stale(&[beat(Some(5_000))], 5_000 + 60_001);
        assert_eq!(out, vec!["reconcile silent for 60.0 s (runs every 10.0 s)"]);
    }

    #[test]
    fn a_loop_that_never_finished_a_pass_counts_from_its_start() {
        assert!(stale(&[beat(None)], 1_000 + 60_000).is_empty());
        assert_eq!(stale(&[beat(None)], 1_000 + 60_001).len(), 1);
    }

    #[test]
    fn a_clock_read_before_the_beat_is_not_a_silence() {
        assert!(stale(&[beat(Some(9_000))], 8_000).is_empty());
    }
}
