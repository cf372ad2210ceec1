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
//! Pod blocks are another matter: the node holds its blocks whether its
//! agent runs or not, so they stay announced through an agent's death.
//! In cluster mode, though, a node holds a block only as long as etcd
//! says so: once its lease has been gone for `reclaim_after`, a live node
//! frees its blocks and another node may claim them. The node must stop
//! announcing them first, or the routers would send a block's traffic to
//! two holders. So in cluster mode the agent puts in each beat how long
//! the node may still announce its blocks ([`block_hold`]: its lease's
//! last refresh plus `reclaim_after`), and the keeper withdraws them once
//! that has run out without a newer beat.
//!
//! This module is the rule; the daemon's `bgp::keeper` reads the beat and
//! BIRD's protocols and carries the steps out.

use std::collections::BTreeMap;

/// BIRD's protocols that hold the LoadBalancer addresses (core
/// `render_bird` writes them).
pub const ANNOUNCING: [&str; 2] = super::LB_PROTOCOLS;

/// BIRD's protocols that hold the pod blocks.
pub const BLOCKS: [&str; 2] = super::BLOCK_PROTOCOLS;

/// How long a node in cluster mode may still announce the blocks it
/// holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hold {
    /// No lease refresh is known yet (the agent is starting and etcd has
    /// not answered): what is announced is left as it is.
    Unknown,
    /// This many milliseconds more.
    For(u64),
    /// Over: the last refresh is this many milliseconds old, at least
    /// `reclaim_after`; another node may have the blocks.
    Over(u64),
}

/// How long the node may announce its blocks, its lease last refreshed
/// `refreshed_ms_ago` (`None`: not known), `reclaim_after_ms` being the
/// cluster's `reclaim_after`.
///
/// A node's blocks are freed no sooner than `reclaim_after` after its
/// lease was recorded gone, and the lease goes no sooner than its TTL
/// after its last refresh: counting `reclaim_after` from the refresh
/// leaves the lease's TTL as a margin (for the beat's way to the keeper,
/// and the clocks of the node that records the lease gone).
#[must_use]
pub fn block_hold(refreshed_ms_ago: Option<u64>, reclaim_after_ms: u64) -> Hold {
    match refreshed_ms_ago {
        None => Hold::Unknown,
        Some(ago) if ago < reclaim_after_ms => Hold::For(reclaim_after_ms - ago),
        Some(ago) => Hold::Over(ago),
    }
}

/// The beat's text: the agent's process, its count, and in cluster mode
/// how long the node may still announce its blocks (`hold_ms`; left out
/// while [`Hold::Unknown`], so the keeper keeps the deadline it had).
#[must_use]
pub fn beat_text(pid: u32, beats: u64, hold: Hold) -> String {
    match hold {
        Hold::Unknown => format!("{pid} {beats}\n"),
        Hold::For(ms) => format!("{pid} {beats} hold_ms={ms}\n"),
        Hold::Over(_) => format!("{pid} {beats} hold_ms=0\n"),
    }
}

/// The hold a beat's text carries (`None`: none, as without cluster mode
/// or before etcd answered).
#[must_use]
pub fn beat_hold_ms(text: &str) -> Option<u64> {
    text.split_whitespace()
        .find_map(|w| w.strip_prefix("hold_ms="))
        .and_then(|v| v.parse().ok())
}

/// Whether the agent counts as alive: its beat last changed `silent_ms`
/// ago, and the lease is `lease_ms`.
#[must_use]
pub fn alive(silent_ms: u64, lease_ms: u64) -> bool {
    silent_ms <= lease_ms
}

/// BIRD's commands that bring the LoadBalancer protocols to `alive` (up
/// while the agent is, down once it is not) and the blocks' protocols to
/// `blocks` (down once the node's hold on them ran out), given `states`:
/// each of BIRD's protocols by name with its state (`up`, `down`,
/// `start`...). A protocol BIRD does not have is left alone (its
/// configuration is the agent's to write).
#[must_use]
pub fn steps(alive: bool, blocks: bool, states: &BTreeMap<String, String>) -> Vec<String> {
    let lb = ANNOUNCING.iter().map(|name| (name, alive));
    let held = BLOCKS.iter().map(|name| (name, blocks));
    lb.chain(held)
        .filter_map(|(name, up)| {
            let state = states.get(*name)?;
            let down = state == "down";
            match (up, down) {
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
            steps(false, true, &states("up", Some("up"))),
            ["disable lockstep_ipv4", "disable lockstep_ipv6"]
        );
        // Done already, or BIRD without the protocol: nothing.
        assert!(steps(false, true, &states("down", Some("down"))).is_empty());
        assert_eq!(
            steps(false, true, &states("up", None)),
            ["disable lockstep_ipv4"]
        );
        assert_eq!(
            steps(true, true, &states("down", Some("up"))),
            ["enable lockstep_ipv4"]
        );
        assert!(steps(true, true, &states("up", Some("up"))).is_empty());
        // Never a peer's session.
        assert!(
            steps(false, false, &states("up", Some("up")))
                .iter()
                .all(|s| !s.contains("peer_"))
        );
    }

    #[test]
    fn the_blocks_go_down_only_when_their_hold_ran_out_whatever_the_agent() {
        let mut s = states("up", None);
        s.insert("lockstep_blocks_ipv4".into(), "up".into());
        // The agent silent, the blocks still held: only the LB routes go.
        assert_eq!(steps(false, true, &s), ["disable lockstep_ipv4"]);
        // The hold over while the agent beats (cut off from etcd).
        assert_eq!(steps(true, false, &s), ["disable lockstep_blocks_ipv4"]);
        s.insert("lockstep_blocks_ipv4".into(), "down".into());
        assert_eq!(steps(true, true, &s), ["enable lockstep_blocks_ipv4"]);
    }

    #[test]
    fn the_hold_counts_reclaim_after_from_the_last_refresh() {
        assert_eq!(block_hold(None, 60_000), Hold::Unknown);
        assert_eq!(block_hold(Some(0), 60_000), Hold::For(60_000));
        assert_eq!(block_hold(Some(59_999), 60_000), Hold::For(1));
        assert_eq!(block_hold(Some(60_000), 60_000), Hold::Over(60_000));
    }

    #[test]
    fn the_beat_carries_the_hold_and_is_read_back() {
        for (hold, read) in [
            (Hold::Unknown, None),
            (Hold::For(1_234), Some(1_234)),
            (Hold::Over(99), Some(0)),
        ] {
            let text = beat_text(42, 7, hold);
            assert!(text.starts_with("42 7"), "{text}");
            assert_eq!(beat_hold_ms(&text), read, "{text}");
        }
        // An older agent's beat: no hold.
        assert_eq!(beat_hold_ms("42 7\n"), None);
        assert_eq!(beat_hold_ms("42 7 hold_ms=x\n"), None);
    }
}
