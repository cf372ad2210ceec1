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
//! Each beat is stamped with the boot and the kernel's monotonic clock
//! ([`Stamp`]), the one clock agent and keeper share: the keeper counts
//! a beat from when it was written ([`Watch`]), so a keeper started
//! afresh beside a dead agent does not take an old beat for a new one,
//! and in cluster mode holds no block before a beat of this boot says so.
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

/// When a beat was written: the boot (the kernel's
/// `/proc/sys/kernel/random/boot_id`) and the kernel's monotonic clock
/// then (ns). Both processes read the same clock, so the keeper can tell
/// how old a beat is whenever it reads it, a keeper started afresh
/// included; a beat from another boot says nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stamp {
    /// The boot.
    pub boot: String,
    /// The monotonic clock (ns).
    pub at_ns: u64,
}

/// The beat's text: the agent's process, its count, when it was written
/// (`stamp`; `None` when the agent cannot read its boot), and in cluster
/// mode how long the node may still announce its blocks from then
/// (`hold_ms`; left out while [`Hold::Unknown`], so the keeper keeps the
/// deadline it had).
#[must_use]
pub fn beat_text(pid: u32, beats: u64, stamp: Option<&Stamp>, hold: Hold) -> String {
    let mut text = format!("{pid} {beats}");
    if let Some(s) = stamp {
        text += &format!(" boot={} at_ns={}", s.boot, s.at_ns);
    }
    match hold {
        Hold::Unknown => {}
        Hold::For(ms) => text += &format!(" hold_ms={ms}"),
        Hold::Over(_) => text += " hold_ms=0",
    }
    text + "\n"
}

/// A beat as the keeper reads it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Beat {
    /// When it was written (`None`: an older agent's beat, or the agent
    /// could not read its boot).
    pub stamp: Option<Stamp>,
    /// The hold it carries (`None`: none, as without cluster mode or
    /// before etcd answered).
    pub hold_ms: Option<u64>,
}

/// Reads a beat's text ([`beat_text`]).
#[must_use]
pub fn parse_beat(text: &str) -> Beat {
    let field = |name: &str| {
        text.split_whitespace()
            .find_map(|w| w.strip_prefix(name).and_then(|v| v.strip_prefix('=')))
    };
    let stamp = match (field("boot"), field("at_ns").and_then(|v| v.parse().ok())) {
        (Some(boot), Some(at_ns)) if !boot.is_empty() => Some(Stamp {
            boot: boot.to_string(),
            at_ns,
        }),
        _ => None,
    };
    Beat {
        stamp,
        hold_ms: field("hold_ms").and_then(|v| v.parse().ok()),
    }
}

/// What the keeper knows of the agent, on the kernel's monotonic clock
/// (ns): when it last beat, and until when the node may announce its
/// blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Watch {
    /// The last beat (the keeper's start until a stamped beat is read:
    /// an agent starting after the keeper has the lease to begin).
    pub last_beat_ns: u64,
    /// Until when the node may announce its blocks (`None`: no hold
    /// applies, as without cluster mode).
    pub hold_until_ns: Option<u64>,
}

impl Watch {
    /// A keeper starting at `now_ns`. In cluster mode (`cluster`) no hold
    /// is known yet, so the blocks are not held until a beat of this boot
    /// says so: a keeper started afresh (a node rebooted, a keeper
    /// restarted while the agent is dead or cut off) must not announce
    /// blocks another node may have claimed.
    #[must_use]
    pub fn start(now_ns: u64, cluster: bool) -> Self {
        Watch {
            last_beat_ns: now_ns,
            hold_until_ns: cluster.then_some(now_ns),
        }
    }

    /// A beat read at `now_ns` whose text changed since the last read
    /// (or the first read), in boot `boot` (`None`: the keeper cannot
    /// read it). A stamped beat of this boot counts from when it was
    /// written, however late it is read; one of another boot is
    /// ignored; an unstamped one counts from now.
    pub fn beat(&mut self, beat: &Beat, boot: Option<&str>, now_ns: u64) {
        let at = match (&beat.stamp, boot) {
            (Some(s), Some(b)) if s.boot == b => s.at_ns.min(now_ns),
            (Some(_), Some(_)) => return,
            _ => now_ns,
        };
        self.last_beat_ns = at;
        if let Some(ms) = beat.hold_ms {
            self.hold_until_ns = Some(at.saturating_add(ms.saturating_mul(1_000_000)));
        }
    }

    /// Whether the agent counts as alive at `now_ns`, the lease being
    /// `lease_ms`.
    #[must_use]
    pub fn alive(&self, now_ns: u64, lease_ms: u64) -> bool {
        alive(
            now_ns.saturating_sub(self.last_beat_ns) / 1_000_000,
            lease_ms,
        )
    }

    /// Whether the node may announce its blocks at `now_ns`.
    #[must_use]
    pub fn holding(&self, now_ns: u64) -> bool {
        self.hold_until_ns.is_none_or(|until| now_ns < until)
    }
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
    fn the_beat_carries_its_stamp_and_hold_and_is_read_back() {
        let stamp = Stamp {
            boot: "b-1".into(),
            at_ns: 5_000_000_000,
        };
        for (hold, read) in [
            (Hold::Unknown, None),
            (Hold::For(1_234), Some(1_234)),
            (Hold::Over(99), Some(0)),
        ] {
            for st in [None, Some(&stamp)] {
                let text = beat_text(42, 7, st, hold);
                assert!(text.starts_with("42 7"), "{text}");
                let beat = parse_beat(&text);
                assert_eq!(beat.hold_ms, read, "{text}");
                assert_eq!(beat.stamp.as_ref(), st, "{text}");
            }
        }
        // An older agent's beat: neither. A torn one: no stamp.
        assert_eq!(parse_beat("42 7\n"), Beat::default());
        assert_eq!(parse_beat("42 7 hold_ms=x\n").hold_ms, None);
        assert_eq!(parse_beat("42 7 boot=b-1 at_").stamp, None);
        assert_eq!(parse_beat("42 7 boot= at_ns=5").stamp, None);
    }

    const S: u64 = 1_000_000_000;

    fn stamped(boot: &str, at_ns: u64, hold_ms: Option<u64>) -> Beat {
        Beat {
            stamp: Some(Stamp {
                boot: boot.into(),
                at_ns,
            }),
            hold_ms,
        }
    }

    #[test]
    fn a_keeper_started_afresh_counts_a_beat_from_when_it_was_written() {
        // The agent died at 100 s with 8 s of hold; the keeper (re)starts
        // at 200 s and reads that beat: the blocks are not held, the
        // agent is not alive.
        let mut w = Watch::start(200 * S, true);
        w.beat(&stamped("b", 100 * S, Some(8_000)), Some("b"), 200 * S);
        assert!(!w.holding(200 * S));
        assert!(!w.alive(200 * S, 15_000));
        // A live agent's beat, read by a keeper just started: held on,
        // no gap.
        let mut w = Watch::start(200 * S, true);
        w.beat(&stamped("b", 199 * S, Some(8_000)), Some("b"), 200 * S);
        assert!(w.holding(200 * S) && w.holding(206 * S) && !w.holding(207 * S));
        assert!(w.alive(200 * S, 15_000));
    }

    #[test]
    fn in_cluster_mode_the_blocks_wait_for_a_hold_of_this_boot() {
        // Started, nothing read: the blocks are not held in cluster mode,
        // held without it; the agent has the lease to begin.
        assert!(!Watch::start(10 * S, true).holding(10 * S));
        assert!(Watch::start(10 * S, false).holding(10 * S));
        assert!(Watch::start(10 * S, true).alive(24 * S, 15_000));
        // A beat of another boot (a node rebooted, the file kept) says
        // nothing, its hold included.
        let mut w = Watch::start(10 * S, true);
        w.beat(&stamped("old", 9_000 * S, Some(8_000)), Some("new"), 10 * S);
        assert!(!w.holding(10 * S));
        assert_eq!(w.last_beat_ns, 10 * S);
        // A beat without a hold (etcd not answered yet) keeps the
        // deadline; one with a hold sets it from when it was written.
        w.beat(&stamped("new", 11 * S, None), Some("new"), 11 * S);
        assert!(!w.holding(11 * S));
        w.beat(&stamped("new", 12 * S, Some(3_000)), Some("new"), 13 * S);
        assert!(w.holding(14 * S) && !w.holding(15 * S));
        w.beat(&stamped("new", 16 * S, None), Some("new"), 16 * S);
        assert!(
            !w.holding(16 * S),
            "a beat without a hold kept the deadline"
        );
        assert!(w.alive(16 * S, 1_000));
        // An unstamped beat, or a keeper that cannot read its boot:
        // counted from when it was read, as an older agent's beat.
        let mut w = Watch::start(10 * S, true);
        w.beat(
            &Beat {
                stamp: None,
                hold_ms: Some(2_000),
            },
            Some("b"),
            20 * S,
        );
        assert!(w.holding(21 * S) && !w.holding(22 * S));
        let mut w = Watch::start(10 * S, true);
        w.beat(&stamped("b", S, Some(2_000)), None, 20 * S);
        assert!(w.holding(21 * S));
        // A stamp from the future (another clock) counts as now.
        let mut w = Watch::start(10 * S, false);
        w.beat(&stamped("b", 99 * S, None), Some("b"), 20 * S);
        assert_eq!(w.last_beat_ns, 20 * S);
    }
}
