//! Whether BIRD announces the node's LoadBalancer addresses while the
//! agent is silent (#48 item 3: an agent's death withdraws its LB routes
//! at its lease's expiry).
//!
//! BIRD runs as its own process and keeps announcing what it was last
//! told: an agent that died would leave its addresses announced, and
//! routers would keep sending traffic to a node nothing manages. So the
//! agent beats (a file it rewrites every second), and a keeper beside
//! BIRD, a process of its own, takes the announcing protocols down once
//! the beat has been silent for the lease, and up again when it comes
//! back. An agent restarted within the lease (an upgrade) changes
//! nothing on the wire.
//!
//! This module is the rule; the daemon's `bgp::keeper` reads the beat and
//! BIRD's protocols and carries the steps out.

use std::collections::BTreeMap;

/// BIRD's protocols that hold the LoadBalancer addresses (core
/// `render_bird` writes them). The pod blocks' protocols are not among
/// them: the node holds its blocks whether its agent runs or not.
pub const ANNOUNCING: [&str; 2] = super::LB_PROTOCOLS;

/// Whether the agent counts as alive: its beat last changed `silent_ms`
/// ago, and the lease is `lease_ms`.
#[must_use]
pub fn alive(silent_ms: u64, lease_ms: u64) -> bool {
    silent_ms <= lease_ms
}

/// BIRD's commands that bring the announcing protocols to `alive` (up
/// while the agent is, down once it is not), given `states`: each of
/// BIRD's protocols by name with its state (`up`, `down`, `start`...).
/// A protocol BIRD does not have is left alone (its configuration is the
/// agent's to write).
#[must_use]
pub fn steps(alive: bool, states: &BTreeMap<String, String>) -> Vec<String> {
    ANNOUNCING
        .iter()
        .filter_map(|name| {
            let state = states.get(*name)?;
            let down = state == "down";
            match (alive, down) {
                (true, true) => Some(format!("enable {name}")),
                (false, false) => Some(format!("disable {name}")),
                _ => None,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn states(v4: &str, v6: Option<&str>) -> BTreeMap<String, String> {
        let mut m: BTreeMap<String, String> = [
            ("lockstep_ipv4".to_string(), v4.to_string()),
            ("peer_tor".to_string(), "up".to_string()),
        ]
        .into();
        if let Some(v6) = v6 {
            m.insert("lockstep_ipv6".into(), v6.into());
        }
        m
    }

    #[test]
    fn the_lease_bounds_the_silence() {
        assert!(alive(0, 3_000));
        assert!(alive(3_000, 3_000));
        assert!(!alive(3_001, 3_000));
    }

    #[test]
    fn silent_takes_the_announcing_protocols_down_and_back_brings_them_up() {
        assert_eq!(
            steps(false, &states("up", Some("up"))),
            ["disable lockstep_ipv4", "disable lockstep_ipv6"]
        );
        // Done already, or BIRD without the protocol: nothing.
        assert!(steps(false, &states("down", Some("down"))).is_empty());
        assert_eq!(steps(false, &states("up", None)), ["disable lockstep_ipv4"]);
        assert_eq!(
            steps(true, &states("down", Some("up"))),
            ["enable lockstep_ipv4"]
        );
        assert!(steps(true, &states("up", Some("up"))).is_empty());
        // Never a peer's session.
        assert!(
            steps(false, &states("up", Some("up")))
                .iter()
                .all(|s| !s.contains("peer_"))
        );
    }
}
