//! `[lb]`: LoadBalancer announcement settings (docs/datapath.md,
//! "Announcement leases").

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The shortest announcement lease accepted: renewal runs every third of it.
pub const MIN_ANNOUNCE_LEASE: Duration = Duration::from_millis(300);
/// The longest announcement lease accepted.
pub const MAX_ANNOUNCE_LEASE: Duration = Duration::from_secs(3600);

/// `[lb]`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct LbConfig {
    /// How long an announcement (an L2_RESP_V4 or L2_RESP_V6 entry) is
    /// answered without the agent renewing it; the agent renews every third
    /// of it. A node whose agent died or hangs stops answering ARP and NDP
    /// for its addresses within one lease, though its programs live on.
    #[schemars(with = "crate::config::reference::HumanDuration")]
    #[serde(with = "humantime_serde")]
    pub announce_lease: Duration,
}

impl Default for LbConfig {
    fn default() -> Self {
        Self {
            announce_lease: Duration::from_secs(3),
        }
    }
}

impl LbConfig {
    /// Checks the section: (field, reason) of the first bad value.
    ///
    /// # Errors
    /// `lb.announce_lease` out of range.
    pub fn validate(&self) -> Result<(), (String, String)> {
        if self.announce_lease < MIN_ANNOUNCE_LEASE || self.announce_lease > MAX_ANNOUNCE_LEASE {
            return Err((
                "lb.announce_lease".into(),
                format!(
                    "must be between {} and {}",
                    humantime_serde::re::humantime::format_duration(MIN_ANNOUNCE_LEASE),
                    humantime_serde::re::humantime::format_duration(MAX_ANNOUNCE_LEASE)
                ),
            ));
        }
        Ok(())
    }

    /// How often the agent renews its announcements: a third of the lease.
    #[must_use]
    pub fn renew_every(&self) -> Duration {
        self.announce_lease / 3
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_defaults_to_three_seconds_renewed_every_second() {
        let c = LbConfig::default();
        assert_eq!(c.announce_lease, Duration::from_secs(3));
        assert_eq!(c.renew_every(), Duration::from_secs(1));
        assert!(c.validate().is_ok());
    }

    #[test]
    fn a_lease_out_of_range_is_refused_by_name() {
        for d in [Duration::from_millis(10), Duration::from_secs(7200)] {
            let (field, reason) = LbConfig { announce_lease: d }.validate().unwrap_err();
            assert_eq!(field, "lb.announce_lease");
            assert!(
                reason.contains("300ms") && reason.contains("1h"),
                "{reason}"
            );
        }
    }
}
