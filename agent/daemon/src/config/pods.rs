//! `[kubernetes.pods]`: how the agent uses the pods the API shows on its
//! node (#29): the pool picked by annotation, and leaked endpoint
//! allocations (docs/kubernetes.md, "Pod pools" and "Leaks").

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// `[kubernetes.pods]`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct PodsConfig {
    /// How long an ADD waits for its pod to reach the agent's cache before
    /// it fails with "try again" (CNI code 11), naming the pod; kubelet
    /// retries. Never a guessed pool.
    #[schemars(with = "crate::config::reference::HumanDuration")]
    #[serde(with = "humantime_serde")]
    pub pool_wait: Duration,
    /// How long a pod must have been gone before its endpoint allocation
    /// counts as leaked (Calico's default, 15 minutes).
    #[schemars(with = "crate::config::reference::HumanDuration")]
    #[serde(with = "humantime_serde")]
    pub leak_grace: Duration,
    /// How often allocations are compared with the pods.
    #[schemars(with = "crate::config::reference::HumanDuration")]
    #[serde(with = "humantime_serde")]
    pub leak_check_every: Duration,
    /// Release leaked allocations (after the API confirmed the pod is gone);
    /// `false`: report them only (metric, log, `verify`).
    pub release_leaks: bool,
}

impl Default for PodsConfig {
    fn default() -> Self {
        Self {
            pool_wait: Duration::from_secs(2),
            leak_grace: Duration::from_secs(15 * 60),
            leak_check_every: Duration::from_secs(60),
            release_leaks: false,
        }
    }
}

impl PodsConfig {
    /// Checks the section: (field, reason) of the first bad value.
    ///
    /// # Errors
    /// A pool wait beyond 30 s (an ADD holds the runtime), a leak check
    /// period of zero or beyond an hour.
    pub fn validate(&self) -> Result<(), (String, String)> {
        if self.pool_wait > Duration::from_secs(30) {
            return Err((
                "kubernetes.pods.pool_wait".into(),
                "must be at most 30s (the runtime waits for the ADD)".into(),
            ));
        }
        if self.leak_check_every.is_zero() || self.leak_check_every > Duration::from_secs(3600) {
            return Err((
                "kubernetes.pods.leak_check_every".into(),
                "must be more than 0 and at most 1h".into(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_report_leaks_after_15_minutes_and_never_release() {
        let c: PodsConfig = toml::from_str("").unwrap();
        assert_eq!(c.leak_grace, Duration::from_secs(900));
        assert!(!c.release_leaks);
        assert!(c.validate().is_ok());
        let e = toml::from_str::<PodsConfig>("pool_wait = \"1m\"")
            .unwrap()
            .validate()
            .unwrap_err();
        assert_eq!(e.0, "kubernetes.pods.pool_wait");
        let e = toml::from_str::<PodsConfig>("leak_check_every = \"0s\"")
            .unwrap()
            .validate()
            .unwrap_err();
        assert_eq!(e.0, "kubernetes.pods.leak_check_every");
        assert!(toml::from_str::<PodsConfig>("release = true").is_err());
    }
}
