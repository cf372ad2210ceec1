//! A ping whose replies are counted as they arrive.
//!
//! Tests that claim "no packet lost while X happened" used to start a ping of
//! a fixed count and hope X fitted inside its window. [`SeqPing`] instead
//! reads every reply line (`seq=N`) as it arrives, so a test can wait for
//! replies — *before* X, to know the path works, and *after* X, to know
//! packets flow again — and then count what is missing: every sequence number
//! from 0 to the last one answered that got no reply. Timing decides nothing.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// What the reader thread has seen so far.
#[derive(Default)]
struct Seen {
    /// Sequence numbers answered.
    seqs: BTreeSet<u64>,
    /// Every line, for error messages.
    text: String,
    /// The output ended (the ping exited).
    ended: bool,
    /// The first sequence number the ping sends: 0 for busybox (`seq=`),
    /// 1 for iputils (`icmp_seq=`).
    first: u64,
}

/// A running ping (busybox or iputils output) whose replies are counted.
pub struct SeqPing {
    child: Child,
    seen: Arc<(Mutex<Seen>, Condvar)>,
    reader: Option<JoinHandle<()>>,
    what: String,
}

/// The replies of a stopped [`SeqPing`].
#[derive(Debug, Clone)]
pub struct PingTally {
    /// Replies received.
    pub received: usize,
    /// The highest sequence number answered.
    pub last: u64,
    /// Sequence numbers from the first the ping sends (0 for busybox, 1 for
    /// iputils) up to `last` that got no reply.
    pub missing: Vec<u64>,
}

/// The sequence number of a reply line (`... seq=12 ...` or `icmp_seq=12`).
fn reply_seq(line: &str) -> Option<u64> {
    if !line.contains(" bytes from ") {
        return None;
    }
    let at = line.find("seq=")? + "seq=".len();
    let digits: String = line[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

impl SeqPing {
    /// Spawns `cmd` (a ping without a count, bounded by its own deadline
    /// option) with its output read line by line; `what` names it in errors.
    ///
    /// # Errors
    /// The command cannot be spawned.
    pub fn spawn(mut cmd: Command, what: impl Into<String>) -> anyhow::Result<Self> {
        let what = what.into();
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("spawning ping {what}"))?;
        let stdout = child.stdout.take().context("ping stdout")?;
        let seen: Arc<(Mutex<Seen>, Condvar)> = Arc::default();
        let shared = Arc::clone(&seen);
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let (lock, cv) = &*shared;
                let mut s = lock
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                if let Some(seq) = reply_seq(&line) {
                    s.seqs.insert(seq);
                    if line.contains("icmp_seq=") {
                        s.first = 1;
                    }
                }
                s.text.push_str(&line);
                s.text.push('\n');
                cv.notify_all();
            }
            let (lock, cv) = &*shared;
            lock.lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .ended = true;
            cv.notify_all();
        });
        Ok(Self {
            child,
            seen,
            reader: Some(reader),
            what,
        })
    }

    /// Replies received so far.
    #[must_use]
    pub fn received(&self) -> usize {
        self.seen
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .seqs
            .len()
    }

    /// Waits until `more` replies beyond those already received arrived.
    ///
    /// # Errors
    /// The ping ended, or `limit` passed first.
    pub fn wait_replies(&self, more: usize, limit: Duration) -> anyhow::Result<()> {
        let (lock, cv) = &*self.seen;
        let mut s = lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let want = s.seqs.len() + more;
        let deadline = Instant::now() + limit;
        while s.seqs.len() < want {
            if s.ended {
                bail!(
                    "ping {} ended after {} replies, waiting for {want}:\n{}",
                    self.what,
                    s.seqs.len(),
                    s.text
                );
            }
            let now = Instant::now();
            if now >= deadline {
                bail!(
                    "ping {}: {} replies after {limit:?}, waiting for {want}:\n{}",
                    self.what,
                    s.seqs.len(),
                    s.text
                );
            }
            s = cv
                .wait_timeout(s, deadline - now)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
        Ok(())
    }

    /// Stops the ping (SIGINT, then SIGKILL) and counts its replies.
    ///
    /// # Errors
    /// No reply was ever received.
    pub fn stop(mut self) -> anyhow::Result<PingTally> {
        if let Ok(pid) = i32::try_from(self.child.id()) {
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(pid, libc::SIGINT) };
        }
        let deadline = Instant::now() + Duration::from_secs(3);
        while self.child.try_wait()?.is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        let s = self
            .seen
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let last = *s
            .seqs
            .last()
            .with_context(|| format!("ping {}: no reply at all:\n{}", self.what, s.text))?;
        let missing = (s.first..=last).filter(|n| !s.seqs.contains(n)).collect();
        Ok(PingTally {
            received: s.seqs.len(),
            last,
            missing,
        })
    }
}

impl Drop for SeqPing {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::reply_seq;

    #[test]
    fn reply_lines_of_busybox_and_iputils_give_their_sequence() {
        assert_eq!(
            reply_seq("64 bytes from 10.0.0.1: seq=17 ttl=64 time=0.1 ms"),
            Some(17)
        );
        assert_eq!(
            reply_seq("64 bytes from 10.0.0.1: icmp_seq=3 ttl=64 time=0.1 ms"),
            Some(3)
        );
        assert_eq!(reply_seq("PING 10.0.0.1 (10.0.0.1): 56 data bytes"), None);
        assert_eq!(reply_seq("3 packets transmitted, 3 packets received"), None);
    }
}
