//! Following one BGP session from BIRD's `show protocols` reads (#48 item
//! 5: a flapping link named in errors and metrics): whether it is up,
//! BIRD's words for why not, and how many times it went down.
//!
//! The agent reads BIRD's sessions every few seconds, and a session may
//! go down and come back between two reads. BIRD's `Since` column (when
//! the protocol last changed state: `up`, `start`, `down`) tells: a
//! session up at both reads with a different `Since` went down and came
//! back in between; one not up at both reads, in the same protocol state
//! since another moment, came up and went down again. So a down is
//! counted when a session that was up is seen down or up since another
//! moment, or one that was not up is seen in the same state since
//! another moment.

/// What is known of one session after a read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Session {
    /// Up (established) at the last read.
    pub up: bool,
    /// `up`, or BIRD's words for why not, at the last read.
    pub state: String,
    /// BIRD's protocol state (`up`, `start`, `down`) and `Since` at the
    /// last read.
    pub since: (String, String),
    /// Times it went down since the agent started (seen down after up,
    /// or up and down between two reads).
    pub downs: u64,
    /// BIRD's words when it was last seen down (`None`: never seen down,
    /// or only between reads).
    pub last_down: Option<String>,
}

/// The session after a read that found it `up` (else `why`), in BIRD's
/// protocol state `proto` since `since`, `before` being what the last
/// read left (`None`: the first read).
#[must_use]
pub fn observe(before: Option<&Session>, up: bool, why: &str, proto: &str, since: &str) -> Session {
    let (downs, last_down) = before.map_or((0, None), |b| (b.downs, b.last_down.clone()));
    let now = (proto.to_string(), since.to_string());
    let went_down = before.is_some_and(|b| match (b.up, up) {
        (true, false) => true,
        (true, true) => b.since != now,
        // Not up at either read: up and down again in between only if
        // the protocol is in the state it was, since another moment.
        (false, false) => b.since.0 == now.0 && b.since.1 != now.1,
        (false, true) => false,
    });
    Session {
        up,
        state: if up {
            "up".to_string()
        } else {
            why.to_string()
        },
        since: now,
        downs: downs + u64::from(went_down),
        last_down: if up { last_down } else { Some(why.to_string()) },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_down_is_counted_once_whether_seen_or_only_between_reads() {
        // First read: up, nothing counted.
        let s = observe(None, true, "", "up", "100");
        assert_eq!((s.downs, s.state.as_str()), (0, "up"));
        // The same moment at the next read: nothing happened.
        let s = observe(Some(&s), true, "", "up", "100");
        assert_eq!(s.downs, 0);
        // Seen down: one, with BIRD's words.
        let s = observe(Some(&s), false, "BFD session down", "start", "105");
        assert_eq!(s.downs, 1);
        assert_eq!(s.state, "BFD session down");
        // Still down, another reason, the same moment: not counted again.
        let s = observe(Some(&s), false, "Connection refused", "start", "105");
        assert_eq!(s.downs, 1);
        // Disabled, then started (other protocol states): not a flap.
        let s = observe(Some(&s), false, "", "down", "106");
        let s = observe(Some(&s), false, "", "start", "107");
        assert_eq!(s.downs, 1);
        // Up again: the last reason kept.
        let s = observe(Some(&s), true, "", "up", "110");
        assert_eq!(s.downs, 1);
        assert_eq!(s.last_down.as_deref(), Some(""));
        // Down and up between two reads: BIRD's Since moved.
        let s = observe(Some(&s), true, "", "up", "118");
        assert_eq!(s.downs, 2);
        // Down, then up and down again between two reads.
        let s = observe(Some(&s), false, "BFD session down", "start", "120");
        let s = observe(Some(&s), false, "BFD session down", "start", "126");
        assert_eq!(s.downs, 4);
        assert_eq!(s.last_down.as_deref(), Some("BFD session down"));
        // Never up: down from the start is not a flap.
        let s = observe(None, false, "Connection refused", "start", "1");
        let s = observe(Some(&s), false, "Connection refused", "start", "1");
        assert_eq!(s.downs, 0);
    }
}
