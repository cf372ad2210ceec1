//! `[kubernetes.election]`: the Lease that elects the one agent that
//! writes LoadBalancer state when there is no `[cluster]` (no etcd): it
//! assigns addresses, writes Service status and Events, and answers ARP
//! and NDP for every address; the other agents follow (docs/kubernetes.md,
//! "One writer").

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// `[kubernetes.election]`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ElectionConfig {
    /// The namespace of the `coordination.k8s.io/v1` Lease (the one the
    /// agents run in).
    pub namespace: String,
    /// The Lease's name.
    pub name: String,
    /// How long the Lease holds without a renewal (whole seconds): after
    /// this another agent takes over when the writer stops renewing.
    #[schemars(with = "crate::config::reference::HumanDuration")]
    #[serde(with = "humantime_serde")]
    pub lease_duration: Duration,
    /// How long after sending its last successful renewal the writer keeps
    /// acting (writing, answering ARP and NDP); shorter than
    /// `lease_duration`, so it has stopped before anyone may take over.
    #[schemars(with = "crate::config::reference::HumanDuration")]
    #[serde(with = "humantime_serde")]
    pub renew_deadline: Duration,
    /// How often every agent reads the Lease, and the writer renews it.
    #[schemars(with = "crate::config::reference::HumanDuration")]
    #[serde(with = "humantime_serde")]
    pub retry_period: Duration,
}

impl Default for ElectionConfig {
    fn default() -> Self {
        Self {
            namespace: "kube-system".into(),
            name: "lockstep-lb-writer".into(),
            lease_duration: Duration::from_secs(1),
            renew_deadline: Duration::from_millis(750),
            retry_period: Duration::from_millis(250),
        }
    }
}

impl ElectionConfig {
    /// Checks the section: (field, reason) of the first bad value.
    ///
    /// # Errors
    /// An empty name, a duration not in whole seconds, a deadline not
    /// shorter than the duration, a retry not shorter than the deadline.
    pub fn validate(&self) -> Result<(), (String, String)> {
        let field = |f: &str| format!("kubernetes.election.{f}");
        if self.namespace.is_empty() {
            return Err((field("namespace"), "is empty".into()));
        }
        if self.name.is_empty() {
            return Err((field("name"), "is empty".into()));
        }
        let d = self.lease_duration;
        if d.subsec_nanos() != 0 || d.is_zero() || d > Duration::from_secs(3600) {
            return Err((
                field("lease_duration"),
                "must be whole seconds, from 1s to 1h (the Lease stores seconds)".into(),
            ));
        }
        if self.renew_deadline.is_zero() || self.renew_deadline >= d {
            return Err((
                field("renew_deadline"),
                format!("must be above zero and shorter than lease_duration ({d:?})"),
            ));
        }
        if self.retry_period.is_zero() || self.retry_period >= self.renew_deadline {
            return Err((
                field("retry_period"),
                format!(
                    "must be above zero and shorter than renew_deadline ({:?})",
                    self.renew_deadline
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_bad_values_are_named() {
        assert!(ElectionConfig::default().validate().is_ok());
        let bad = |s: &str| {
            toml::from_str::<ElectionConfig>(s)
                .expect("parses")
                .validate()
                .expect_err("refused")
        };
        assert_eq!(
            bad("lease_duration = \"1500ms\"").0,
            "kubernetes.election.lease_duration"
        );
        let e = bad("renew_deadline = \"1s\"");
        assert_eq!(e.0, "kubernetes.election.renew_deadline");
        assert!(e.1.contains("shorter than lease_duration"), "{}", e.1);
        assert_eq!(
            bad("retry_period = \"750ms\"").0,
            "kubernetes.election.retry_period"
        );
        assert_eq!(bad("name = \"\"").0, "kubernetes.election.name");
        assert!(toml::from_str::<ElectionConfig>("lease = \"1s\"").is_err());
    }
}
