//! The mirror's task: following etcd (#27 item 6). A full read in pages
//! at one revision, then a watch from the next; the watch resumed after a
//! break, and a full read again after a compaction, a drop of the
//! revision or another cluster ID. With a state directory, the task also
//! keeps the mirror's copy there ([`super::saved`]) and, at start,
//! resumes the watch from the copy's revision instead of reading
//! everything (#47 item 3).

use std::path::PathBuf;
use std::sync::Arc;

use etcd_client::EventType;

use super::saved;
use super::{Copy, Kv, Mirror, PAGE, RETRY_MAX, RETRY_MIN};
use crate::cluster::backoff::Backoff;
use crate::cluster::{ClusterStoreError, Door, DoorOptions};

impl Mirror {
    /// Follows etcd until `stop`: a full read, then the watch; a full read
    /// again after a compaction, a drop of the revision or another cluster
    /// ID; the watch resumed after a break. Keeps no copy.
    pub fn spawn(
        self: Arc<Self>,
        opts: DoorOptions,
        stop: tokio::sync::watch::Receiver<bool>,
    ) -> tokio::task::JoinHandle<()> {
        self.spawn_saving(opts, stop, None)
    }

    /// As [`Mirror::spawn`], keeping the mirror's copy in `state_dir`
    /// (when given): resumed from at start, written while following and
    /// once more at the stop.
    pub fn spawn_saving(
        self: Arc<Self>,
        opts: DoorOptions,
        mut stop: tokio::sync::watch::Receiver<bool>,
        state_dir: Option<PathBuf>,
    ) -> tokio::task::JoinHandle<()> {
        // The revision to watch from; `None`: read everything first.
        let mut from: Option<i64> = None;
        // The highest revision seen (a full read below it: a rollback).
        let mut seen: i64 = 0;
        let mut saver = Saver::new(state_dir);
        // The keys are a copy's: not live before the watch has caught up.
        let mut copied = false;
        // Taken before the task starts, so that no other task, starting
        // beside it, reads etcd whole while the copy is being loaded: its
        // reads wait for the watch from the copy's revision.
        if let Some(r) = saver.resume(&self.prefix) {
            tracing::info!(
                revision = r.revision,
                keys = r.kvs.len(),
                "cluster mirror: resuming the watch from the saved copy's revision"
            );
            from = Some(r.revision + 1);
            seen = r.revision;
            self.restore(r.kvs, r.revision, r.cluster_id);
            saver.saved = self.copy().at;
            copied = true;
        }
        tokio::spawn(async move {
            let mut door: Option<Door> = None;
            let mut backoff = Backoff::new(RETRY_MIN, RETRY_MAX);
            loop {
                let step = self.follow(
                    &opts,
                    &mut door,
                    (&mut from, &mut seen, &mut copied),
                    &mut saver,
                );
                let outcome = tokio::select! {
                    r = step => r,
                    _ = stop.wait_for(|s| *s) => break,
                };
                // A watch that stood: the next break retries soon again.
                if self.live() {
                    backoff.reset();
                }
                self.set_live(false);
                if let Err(e) = outcome {
                    let wait = backoff.next_delay();
                    tracing::warn!(error = %crate::error_chain(&e), retry_in = ?wait, "cluster mirror: watch broke (or etcd unreachable); reads go to etcd until it follows again");
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = stop.wait_for(|s| *s) => break,
                    }
                }
            }
            self.set_live(false);
            saver.flush(&self).await;
        })
    }

    /// Reads everything when `from` is `None`, then follows the watch
    /// until it breaks (`Err`) or asks for a full read (`Ok`, `from`
    /// reset).
    ///
    /// Keys from a saved copy (`copied`) are not etcd's now: the watch from
    /// their revision catches up, and the mirror turns live only once it
    /// stands where etcd stood when the watch was made
    /// ([`Door::caught_up_at`]), so no reader decides on an old copy.
    async fn follow(
        &self,
        opts: &DoorOptions,
        door: &mut Option<Door>,
        (from, seen, copied): (&mut Option<i64>, &mut i64, &mut bool),
        saver: &mut Saver,
    ) -> Result<(), ClusterStoreError> {
        if door.is_none() {
            *door = Some(Door::connect(opts.clone()).await?);
        }
        let d = door.as_mut().expect("connected above");
        let start = match *from {
            Some(r) => r,
            None => {
                let (kvs, mark) = d.read_everything(PAGE).await?;
                if mark.revision < *seen {
                    tracing::error!(
                        seen = *seen,
                        now = mark.revision,
                        "cluster mirror: etcd went back in time (restored from a backup?)"
                    );
                    for h in self
                        .rollbacks
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .iter()
                    {
                        h.etcd_went_back(*seen);
                    }
                }
                *seen = (*seen).max(mark.revision);
                self.replace(kvs, mark.revision, mark.cluster_id);
                *copied = false;
                *from = Some(mark.revision + 1);
                mark.revision + 1
            }
        };
        let mut stream = d.watch_raw(start).await?;
        let cluster_id = self.read_state().cluster_id;
        // A copy's catching up: etcd's revision when the watch was made,
        // and what the mirror has to reach to stand there.
        let mut catching: Option<(i64, i64, usize)> = None;
        loop {
            let msg = stream.message().await;
            let resp = match msg {
                Ok(Some(r)) => r,
                Ok(None) => {
                    return Err(broke(&self.prefix, "the stream ended"));
                }
                Err(e) => return Err(broke(&self.prefix, &e.to_string())),
            };
            let header = resp.header().map(|h| (h.revision(), h.cluster_id()));
            if let Some((rev, id)) = header {
                // Another cluster, or a revision below what the watch
                // already delivered: a restore, or a member behind.
                // The full read (linearizable) tells which.
                if (id != 0 && cluster_id != 0 && id != cluster_id) || (rev > 0 && rev < start - 1)
                {
                    tracing::warn!(
                        revision = rev,
                        expected = start - 1,
                        "cluster mirror: the watch answers from another history; reading everything again"
                    );
                    *from = None;
                    return Ok(());
                }
            }
            if resp.compact_revision() > 0 {
                tracing::info!(
                    compacted = resp.compact_revision(),
                    "cluster mirror: etcd compacted the watched history; reading everything again"
                );
                *from = None;
                return Ok(());
            }
            if resp.canceled() {
                return Err(broke(
                    &self.prefix,
                    &format!("cancelled: {}", resp.cancel_reason()),
                ));
            }
            if resp.created() {
                match header {
                    // A copy's keys: live once caught up.
                    Some((at, _)) if *copied => {
                        let (last, count) = d.caught_up_at(start - 1, at).await?;
                        catching = Some((at, last, count));
                    }
                    // The watch stands: the mirror is live from here on.
                    _ => self.set_live(true),
                }
            }
            let mut next = from.unwrap_or(start);
            {
                let mut s = self.write_state();
                // Every change of a revision comes in one answer (a
                // transaction's several keys, a lease's end deleting all
                // of its keys): all of them are applied, not only the
                // first (which raised the mirror's revision, and the
                // others looked like old news).
                let applied = s.revision;
                for event in resp.events() {
                    let Some(kv) = event.kv() else { continue };
                    let key = String::from_utf8_lossy(kv.key()).into_owned();
                    let area = self.area(&key);
                    let rev = kv.mod_revision();
                    // Changes at or below the revision the mirror had
                    // reached were in the full read or came before (a
                    // resumed watch starts one revision early).
                    if rev > applied {
                        let now = match event.event_type() {
                            EventType::Delete => None,
                            EventType::Put => Some(Kv::of(kv)),
                        };
                        s.apply(key, area, rev, now);
                    }
                    next = next.max(rev + 1);
                    s.revision = s.revision.max(rev);
                }
                if let Some((rev, _)) = header
                    && resp.events().is_empty()
                    && !resp.created()
                    && catching.is_none()
                {
                    // A progress notification: nothing under the prefix
                    // changed up to `rev`. Not taken while a copy catches
                    // up: etcd 3.4 may send one before the events it has
                    // still to send, and the mirror would skip them.
                    s.revision = s.revision.max(rev);
                    next = next.max(rev + 1);
                }
                *seen = (*seen).max(s.revision);
            }
            if let Some((at, last, count)) = catching
                && self.caught_up(at, last, count)
            {
                tracing::info!(
                    revision = at,
                    "cluster mirror: the saved copy caught up with etcd"
                );
                catching = None;
                *copied = false;
                next = next.max(at + 1);
                self.set_live(true);
            }
            *from = Some(next);
            self.ring();
            saver.keep(self);
        }
    }
}

/// Keeps the mirror's copy in the state directory (none without one).
struct Saver {
    state_dir: Option<PathBuf>,
    /// Where the last copy written (or resumed from) stood: the mirror's
    /// full read and revision. A new full read (a compaction, a restore
    /// of etcd) is copied whatever its revision.
    saved: (u64, i64),
    /// When the last copy was started.
    at: Option<std::time::Instant>,
    /// The copy being written.
    writing: Option<tokio::task::JoinHandle<()>>,
}

impl Saver {
    fn new(state_dir: Option<PathBuf>) -> Self {
        Saver {
            state_dir,
            saved: (0, 0),
            at: None,
            writing: None,
        }
    }

    /// The copy to resume from, if one reads (one that does not is said
    /// and left: the first copy written replaces it). Read once, at the
    /// start (a file of a few megabytes at most).
    fn resume(&self, prefix: &str) -> Option<saved::Resume> {
        let dir = self.state_dir.as_ref()?;
        match saved::load(dir, prefix) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %crate::error_chain(&e), "cluster mirror: the saved copy does not read; reading everything");
                None
            }
        }
    }

    /// Starts a copy when one is due: the mirror follows etcd, its
    /// revision moved since the last copy, the last is [`saved::SAVE_EVERY`]
    /// old and written.
    fn keep(&mut self, m: &Mirror) {
        let Some(dir) = self.state_dir.clone() else {
            return;
        };
        if !m.live()
            || self.at.is_some_and(|t| t.elapsed() < saved::SAVE_EVERY)
            || self.writing.as_ref().is_some_and(|w| !w.is_finished())
        {
            return;
        }
        let copy = m.copy();
        if copy.at == self.saved {
            return;
        }
        self.at = Some(std::time::Instant::now());
        self.saved = copy.at;
        let prefix = m.prefix.clone();
        self.writing = Some(tokio::task::spawn_blocking(move || {
            write(&dir, &prefix, &copy);
        }));
    }

    /// The last copy, at the stop: what the mirror holds is etcd's state
    /// at its revision, live or not.
    async fn flush(&mut self, m: &Mirror) {
        let Some(dir) = self.state_dir.clone() else {
            return;
        };
        if let Some(w) = self.writing.take() {
            let _ = w.await;
        }
        let copy = m.copy();
        // Nothing new, or nothing read yet.
        if copy.at == self.saved || copy.at.1 <= 0 {
            return;
        }
        let prefix = m.prefix.clone();
        let _ = tokio::task::spawn_blocking(move || write(&dir, &prefix, &copy)).await;
    }
}

/// Writes a copy, saying what went wrong (the next start then reads
/// everything, or resumes from an older copy).
fn write(dir: &std::path::Path, prefix: &str, copy: &Copy) {
    let revision = copy.at.1;
    match saved::save(dir, prefix, revision, copy.cluster_id, &copy.kvs) {
        Ok(true) => tracing::debug!(
            revision,
            keys = copy.kvs.len(),
            "cluster mirror: copy saved"
        ),
        Ok(false) => tracing::debug!("cluster mirror: a value is not text; no copy saved"),
        Err(e) => {
            tracing::warn!(error = %crate::error_chain(&e), "cluster mirror: the copy was not saved");
        }
    }
}

fn broke(prefix: &str, why: &str) -> ClusterStoreError {
    ClusterStoreError::Unavailable {
        endpoints: String::new(),
        what: format!("watch of {prefix}: {why}"),
        maybe_written: false,
    }
}
