//! Every key under the prefix, kept by one etcd watch (#27 item 6): what
//! an agent's cluster tasks read instead of asking etcd again and again.
//!
//! Why: every node used to read all of `blocks/` (and since #26 the
//! nodes, routing keys and reservations) every 5 s, and all of `lb/`
//! every 200 ms. Each read carries the whole cluster, and every node makes
//! it, so etcd's load grew with the square of the cluster. The mirror
//! reads everything once (in pages, at one revision), then follows a watch
//! from one past that revision: in steady state etcd sends each change
//! once to each node, and nothing else.
//!
//! What stays exactly as safe as the reads it replaces:
//! - A full read again after a compaction (the watch's history is gone),
//!   after the store's revision went below one already seen, and when the
//!   answer comes from another etcd cluster (another cluster ID): both are
//!   what a restore from a backup looks like. The full read is
//!   linearizable, so a watch answered by a member still catching up is
//!   not taken for a rollback: only a full read below the highest revision
//!   seen is, and then every handle told of rollbacks hears it
//!   ([`super::ClusterHandle::etcd_went_back`]).
//! - While the watch is broken (etcd unreachable, a member without a
//!   leader cancels it) the mirror is not *live*: readers fall back to
//!   reading etcd, which fails as it always did, so nothing is decided on
//!   a view etcd no longer vouches for.
//! - A reader that wrote at revision `R` reads only once the mirror has
//!   seen `R` ([`Mirror::read`]), so it sees its own writes.
//! - Every reply carries the store's revision and cluster ID: readers
//!   compare them with what they recorded (the claim loop's restore
//!   detection) as they compared a read's.

use std::any::Any;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::future::Future;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use lockstep_core::cluster::StoreMark;

use super::{ClusterHandle, ClusterStoreError};

mod reads;
pub mod saved;
mod watching;

/// Keys per page of a full read: well under gRPC's 4 MiB answer limit
/// with the largest values this build writes.
const PAGE: i64 = 1_000;
/// How long after a watch broke its readers serve the last state (then
/// they read etcd until it follows again).
pub const RESUMING: Duration = Duration::from_secs(5);
/// How long to wait before reading or watching again after etcd failed:
/// the first retry, and the longest (jittered: `cluster::backoff`).
const RETRY_MIN: Duration = Duration::from_millis(250);
const RETRY_MAX: Duration = Duration::from_secs(4);
/// How many changed keys the mirror remembers for [`Mirror::changes`]: a
/// follower further behind reads its areas whole.
const LOG_KEYS: usize = 16_384;

/// One key as the mirror holds it. The mirror shares each key (an
/// `Arc<Kv>`) with every reader, and a key's parsed record is kept with
/// it ([`Kv::parse_once`]): a change of one key makes one parse, however
/// many keys its area holds and however many readers read it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kv {
    /// The whole key.
    pub key: String,
    /// Its value.
    pub value: Vec<u8>,
    /// The revision of its last change.
    pub mod_revision: i64,
    /// The revision that created it.
    pub create_revision: i64,
    /// The lease it is bound to (0: none).
    pub lease: i64,
    /// What the first reader parsed from this value.
    parsed: ParsedOnce,
}

impl Kv {
    pub(super) fn of(kv: &etcd_client::KeyValue) -> Kv {
        Kv {
            key: String::from_utf8_lossy(kv.key()).into_owned(),
            value: kv.value().to_vec(),
            mod_revision: kv.mod_revision(),
            create_revision: kv.create_revision(),
            lease: kv.lease(),
            parsed: ParsedOnce::default(),
        }
    }

    /// A key as a copy of the mirror kept it (`saved`).
    pub(super) fn new(
        key: String,
        value: Vec<u8>,
        mod_revision: i64,
        create_revision: i64,
        lease: i64,
    ) -> Kv {
        Kv {
            key,
            value,
            mod_revision,
            create_revision,
            lease,
            parsed: ParsedOnce::default(),
        }
    }

    /// What `parse` (named `parser`) makes of this key: parsed by the
    /// first reader, then kept with the key until it changes (a change
    /// is a new `Kv`). Another parser of the same key parses it itself.
    pub fn parse_once<R: Clone + Send + Sync + 'static>(
        &self,
        parser: &'static str,
        parse: impl Fn(&Kv) -> R,
    ) -> R {
        let kept = self
            .parsed
            .0
            .get_or_init(|| (parser, Arc::new(parse(self)) as Arc<dyn Any + Send + Sync>));
        match (kept.0 == parser)
            .then(|| kept.1.downcast_ref::<R>())
            .flatten()
        {
            Some(r) => r.clone(),
            None => parse(self),
        }
    }
}

/// A key's parsed record, made once ([`Kv::parse_once`]). It is a cache
/// of the value: a copy starts empty, and it takes no part in equality.
#[derive(Default)]
struct ParsedOnce(std::sync::OnceLock<(&'static str, Arc<dyn Any + Send + Sync>)>);

impl Clone for ParsedOnce {
    fn clone(&self) -> Self {
        ParsedOnce::default()
    }
}

impl PartialEq for ParsedOnce {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for ParsedOnce {}

impl std::fmt::Debug for ParsedOnce {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.0.get() {
            Some((parser, _)) => parser,
            None => "unparsed",
        })
    }
}

#[derive(Debug, Default)]
struct State {
    /// Whether the watch follows etcd now.
    live: bool,
    /// Since when the watch, once live, has not followed (`None`: live,
    /// or never live yet).
    down_since: Option<std::time::Instant>,
    /// When the keys were taken from a saved copy (`None`: they come
    /// from a full read).
    restored: Option<std::time::Instant>,
    kvs: BTreeMap<String, Arc<Kv>>,
    /// The store revision the keys are at.
    revision: i64,
    cluster_id: u64,
    /// Full reads so far (a reader seeing it change re-reads everything).
    generation: u64,
    /// Per area (the key's first segment under the prefix, `blocks/`,
    /// `lb/`, `default_pool`): the revision of its last change.
    changed: BTreeMap<String, i64>,
    /// The keys changed since the last full read, oldest first, with the
    /// revision of each change (at most [`LOG_KEYS`]).
    log: VecDeque<(i64, String)>,
    /// Every change above this revision is in `log`.
    log_floor: i64,
}

impl State {
    /// Applies one change, at revision `rev`, of `key` (in `area`) to
    /// `now` (`None`: deleted), and logs it for [`Mirror::changes`].
    fn apply(&mut self, key: String, area: String, rev: i64, now: Option<Kv>) {
        match now {
            None => self.kvs.remove(&key),
            Some(kv) => self.kvs.insert(key.clone(), Arc::new(kv)),
        };
        self.changed.insert(area, rev);
        self.log.push_back((rev, key));
        if self.log.len() > LOG_KEYS
            && let Some((gone, _)) = self.log.pop_front()
        {
            self.log_floor = gone;
        }
    }
}

/// What the mirror holds, for its copy in the state directory.
struct Copy {
    kvs: Vec<Arc<Kv>>,
    /// The full read the keys descend from, and their revision.
    at: (u64, i64),
    cluster_id: u64,
}

/// Where a follower of [`Mirror::changes`] stands: the full read and the
/// revision it has seen everything up to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cursor {
    generation: u64,
    revision: i64,
}

impl Cursor {
    /// The revision the follower has seen everything up to.
    pub fn revision(&self) -> i64 {
        self.revision
    }
}

/// What changed under a follower's areas since its [`Cursor`].
#[derive(Debug)]
pub enum Changes {
    /// Read the areas whole: the first read, a full read of the mirror
    /// since (a compaction, a restore), or changes older than the mirror
    /// remembers.
    Everything,
    /// The keys that changed, each once, with its value now (`None`:
    /// deleted). Applying a key twice is harmless: it carries the value,
    /// not the change.
    Keys(Vec<(String, Option<Arc<Kv>>)>),
}

/// Where a reader stands: the full read's generation and the revision of
/// the last change of the areas it reads. Equal stamps: nothing it reads
/// changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stamp {
    /// Full reads so far.
    pub generation: u64,
    /// The last change's revision.
    pub revision: i64,
    /// Whether the mirror is live.
    pub live: bool,
}

/// A value made from an area of the mirror, and where the area stood.
type Made = (Stamp, Arc<dyn Any + Send + Sync>);

/// Every key under the prefix, followed by one watch. Shared by an
/// agent's cluster tasks (through [`Link`]).
#[derive(Debug)]
pub struct Mirror {
    prefix: String,
    state: RwLock<State>,
    /// Bumped at every change (keys, liveness): readers wait on it.
    bell: tokio::sync::watch::Sender<u64>,
    /// Told when a full read finds etcd gone back in time.
    rollbacks: Mutex<Vec<Arc<ClusterHandle>>>,
    /// Values made from an area, kept while the area does not change:
    /// readers sharing the mirror parse it once per change.
    made: Mutex<BTreeMap<&'static str, Made>>,
}

impl Mirror {
    /// An empty mirror of `prefix` (not live until [`Mirror::spawn`]'s
    /// first full read).
    pub fn new(prefix: &str) -> Self {
        Mirror {
            prefix: prefix.to_string(),
            state: RwLock::new(State::default()),
            bell: tokio::sync::watch::Sender::new(0),
            rollbacks: Mutex::new(Vec::new()),
            made: Mutex::new(BTreeMap::new()),
        }
    }

    /// The value last made from `area` while it has not changed since
    /// (`None`: make it, and [`Mirror::keep`] it).
    pub fn made<T: Any + Send + Sync>(&self, area: &'static str) -> Option<Arc<T>> {
        let now = self.stamp(&[area]);
        let made = self
            .made
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (at, v) = made.get(area)?;
        if *at != now || !now.live {
            return None;
        }
        v.clone().downcast::<T>().ok()
    }

    /// The value last kept for `area`, however the area changed since:
    /// what a follower makes the next value from.
    pub fn last_made<T: Any + Send + Sync>(&self, area: &'static str) -> Option<Arc<T>> {
        let made = self
            .made
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        made.get(area)?.1.clone().downcast::<T>().ok()
    }

    /// Keeps `value`, made from `area` as it stood at `at`.
    pub fn keep<T: Any + Send + Sync>(&self, area: &'static str, at: Stamp, value: Arc<T>) {
        self.made
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(area, (at, value));
    }

    fn read_state(&self) -> std::sync::RwLockReadGuard<'_, State> {
        self.state
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn write_state(&self) -> std::sync::RwLockWriteGuard<'_, State> {
        self.state
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn ring(&self) {
        self.bell.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// A receiver that changes whenever the mirror does.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.bell.subscribe()
    }

    /// Tells `handle` (a claim loop's) whenever a full read finds etcd
    /// gone back in time (#26 item 3).
    pub fn tell_rollbacks_to(&self, handle: Arc<ClusterHandle>) {
        self.rollbacks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(handle);
    }

    /// Whether the watch follows etcd now.
    pub fn live(&self) -> bool {
        self.read_state().live
    }

    /// How long the watch, once live, has not followed etcd (`None`:
    /// live, or never live yet). Until it broke, the mirror was etcd's
    /// state: a reader may serve what it made from it for a while
    /// rather than read etcd while the watch resumes.
    pub fn down_for(&self) -> Option<Duration> {
        self.read_state().down_since.map(|t| t.elapsed())
    }

    /// Whether the watch broke less than `RESUMING` (5 s) ago: its readers
    /// serve what they made from the mirror rather than read etcd.
    pub fn resuming(&self) -> bool {
        self.down_for().is_some_and(|d| d < RESUMING)
    }

    /// Where the areas under `areas` (segments under the prefix: `"lb/"`,
    /// `"blocks/"`) stand.
    pub fn stamp(&self, areas: &[&str]) -> Stamp {
        let s = self.read_state();
        Stamp {
            generation: s.generation,
            revision: areas
                .iter()
                .filter_map(|a| s.changed.get(*a))
                .copied()
                .max()
                .unwrap_or(0),
            live: s.live,
        }
    }

    /// The keys under `key` (a prefix), shared and not copied, once the
    /// mirror is live and has seen revision `at_least` (waiting at most
    /// `within`), with the store mark they are at; `None` when it is not
    /// live or does not get there in time (the caller reads etcd).
    pub async fn read(
        &self,
        key: &str,
        at_least: i64,
        within: Duration,
    ) -> Option<(Vec<Arc<Kv>>, StoreMark)> {
        let mut bell = self.subscribe();
        let ready = |s: &State| s.live && s.revision >= at_least;
        // Keys just taken from a saved copy: the watch from its revision
        // is being made, and is worth the wait (the alternative is to read
        // etcd whole, which the copy is there to spare).
        let copy_pending =
            |s: &State| !s.live && s.restored.is_some_and(|t| t.elapsed() < RESUMING);
        // Not live: the caller reads etcd at once (waiting would only
        // delay the answer of an etcd that does not answer).
        if !self.live() && !copy_pending(&self.read_state()) {
            return None;
        }
        if !ready(&self.read_state()) {
            // Waits for the revision, or for the mirror to stop following
            // (its watch broke meanwhile: the revision will not come from
            // it, and the caller reads etcd at once, as above).
            let settled =
                |s: &State| (!s.live && !copy_pending(s)) || (s.live && s.revision >= at_least);
            let wait = async {
                loop {
                    if bell.changed().await.is_err() {
                        return;
                    }
                    if settled(&self.read_state()) {
                        return;
                    }
                }
            };
            let _ = tokio::time::timeout(within, wait).await;
        }
        let s = self.read_state();
        if !ready(&s) {
            return None;
        }
        let kvs = s
            .kvs
            .range(key.to_string()..)
            .take_while(|(k, _)| k.starts_with(key))
            .map(|(_, v)| v.clone())
            .collect();
        Some((
            kvs,
            StoreMark {
                cluster_id: s.cluster_id,
                revision: s.revision,
            },
        ))
    }

    /// What changed under `areas` (segments under the prefix, as
    /// [`Mirror::stamp`]'s) since `since` (`None`: nothing read yet), and
    /// the cursor to ask from next; `None` while the mirror is not live.
    /// A follower that reads `Changes::Everything` reads the areas after
    /// this call: what changes meanwhile comes again in its next call.
    pub fn changes(&self, areas: &[&str], since: Option<Cursor>) -> Option<(Changes, Cursor)> {
        let s = self.read_state();
        if !s.live {
            return None;
        }
        let now = Cursor {
            generation: s.generation,
            revision: s.revision,
        };
        let Some(since) =
            since.filter(|c| c.generation == s.generation && c.revision >= s.log_floor)
        else {
            return Some((Changes::Everything, now));
        };
        let mut keys = BTreeSet::new();
        for (rev, key) in s.log.iter().rev() {
            if *rev <= since.revision {
                break;
            }
            let rest = key.strip_prefix(&self.prefix).unwrap_or(key);
            if areas.iter().any(|a| rest.starts_with(a)) {
                keys.insert(key.as_str());
            }
        }
        let keys = keys
            .into_iter()
            .map(|k| (k.to_string(), s.kvs.get(k).cloned()))
            .collect();
        Some((Changes::Keys(keys), now))
    }

    fn area(&self, key: &str) -> String {
        let rest = key.strip_prefix(&self.prefix).unwrap_or(key);
        match rest.find('/') {
            Some(i) => rest[..=i].to_string(),
            None => rest.to_string(),
        }
    }

    /// Replaces everything by a full read at `revision`.
    fn replace(&self, kvs: Vec<Kv>, revision: i64, cluster_id: u64) {
        self.set_keys(kvs, revision, cluster_id, true);
    }

    /// The mirror's keys, all of them, at `revision`; `live`: the watch
    /// follows from there (a full read), or not yet (a copy).
    fn set_keys(&self, kvs: Vec<Kv>, revision: i64, cluster_id: u64, live: bool) {
        {
            let mut s = self.write_state();
            s.kvs = kvs
                .into_iter()
                .map(|kv| (kv.key.clone(), Arc::new(kv)))
                .collect();
            s.revision = revision;
            s.cluster_id = cluster_id;
            s.generation += 1;
            s.changed.clear();
            s.log.clear();
            s.log_floor = revision;
            s.live = live;
            s.down_since = None;
            s.restored = (!live).then(std::time::Instant::now);
        }
        self.ring();
    }

    /// Takes a copy's keys at `revision` (`saved`): etcd's state then,
    /// not now, so the mirror is not live until the watch from the next
    /// revision stands.
    fn restore(&self, kvs: Vec<Kv>, revision: i64, cluster_id: u64) {
        self.set_keys(kvs, revision, cluster_id, false);
    }

    /// Whether the mirror, at a revision no later than `at`, is etcd's
    /// state at `at` (`Door::caught_up_at`'s `last` and `count`): no
    /// change existing at `at` is still to come (the last one is in), and
    /// no deletion either (the counts agree; a put still to come would be
    /// a later last change). Then the mirror stands at `at`.
    fn caught_up(&self, at: i64, last: i64, count: usize) -> bool {
        let mut s = self.write_state();
        let done = s.revision > at || (s.revision >= last && s.kvs.len() == count);
        if done {
            s.revision = s.revision.max(at);
        }
        done
    }

    /// What the mirror holds, for a copy.
    fn copy(&self) -> Copy {
        let s = self.read_state();
        Copy {
            kvs: s.kvs.values().cloned().collect(),
            at: (s.generation, s.revision),
            cluster_id: s.cluster_id,
        }
    }

    fn set_live(&self, live: bool) {
        let was = {
            let mut s = self.write_state();
            let was = std::mem::replace(&mut s.live, live);
            if live {
                s.down_since = None;
            } else if was {
                s.down_since = Some(std::time::Instant::now());
            }
            was
        };
        if was != live {
            self.ring();
        }
    }
}

/// What an agent's cluster tasks share: one connection to etcd (each
/// task's requests multiplexed on it) and one [`Mirror`].
#[derive(Clone)]
pub struct Link {
    client: Arc<tokio::sync::OnceCell<etcd_client::Client>>,
    mirror: Arc<Mirror>,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("connected", &self.client.initialized())
            .field("mirror", &self.mirror.prefix)
            .finish()
    }
}

impl Link {
    /// A link whose mirror follows `prefix`; the connection is made by the
    /// first door that needs it.
    pub fn new(prefix: &str) -> Self {
        Link {
            client: Arc::new(tokio::sync::OnceCell::new()),
            mirror: Arc::new(Mirror::new(prefix)),
        }
    }

    /// The shared mirror.
    pub fn mirror(&self) -> &Arc<Mirror> {
        &self.mirror
    }

    /// The shared connection, made by `connect` if there is none yet.
    pub(super) async fn client<F, Fut>(
        &self,
        connect: F,
    ) -> Result<etcd_client::Client, ClusterStoreError>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<etcd_client::Client, ClusterStoreError>>,
    {
        self.client.get_or_try_init(connect).await.cloned()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    fn kv(key: &str, value: &str, revision: i64) -> Kv {
        Kv {
            key: key.to_string(),
            value: value.as_bytes().to_vec(),
            mod_revision: revision,
            create_revision: revision,
            lease: 0,
            parsed: ParsedOnce::default(),
        }
    }

    /// Reads the area `/p/blocks/` as a claim loop does: every key parsed
    /// (counted in `parses`), the records collected.
    async fn read_blocks(m: &Mirror, parses: &AtomicUsize) -> Vec<String> {
        let (kvs, _) = m.read("/p/blocks/", 0, Duration::ZERO).await.expect("live");
        kvs.iter()
            .map(|kv| {
                kv.parse_once("blocks/", |kv| {
                    parses.fetch_add(1, Ordering::Relaxed);
                    String::from_utf8_lossy(&kv.value).into_owned()
                })
            })
            .collect()
    }

    /// A change of one key among a thousand costs one parse, however
    /// often and by however many readers the area is read; the keys
    /// themselves are shared with every reader, not copied.
    #[tokio::test]
    async fn a_change_of_one_key_is_one_parse_and_reads_copy_no_key() {
        let m = Mirror::new("/p/");
        let kvs = (0..1000)
            .map(|i| kv(&format!("/p/blocks/b{i:04}"), &format!("node{i}"), 10))
            .collect();
        m.replace(kvs, 10, 1);
        let parses = AtomicUsize::new(0);
        let first = read_blocks(&m, &parses).await;
        assert_eq!(first.len(), 1000);
        assert_eq!(parses.load(Ordering::Relaxed), 1000);
        // Read again, by this reader or another: nothing parsed again.
        for _ in 0..3 {
            assert_eq!(read_blocks(&m, &parses).await, first);
        }
        assert_eq!(parses.load(Ordering::Relaxed), 1000);
        let (a, _) = m.read("/p/blocks/", 0, Duration::ZERO).await.unwrap();
        let (b, _) = m.read("/p/blocks/", 0, Duration::ZERO).await.unwrap();
        assert!(a.iter().zip(&b).all(|(x, y)| Arc::ptr_eq(x, y)));
        // One key changes (as a watch event replaces it): one parse.
        {
            let mut s = m.write_state();
            let changed = kv("/p/blocks/b0500", "elsewhere", 11);
            s.kvs.insert(changed.key.clone(), Arc::new(changed));
            s.revision = 11;
        }
        let after = read_blocks(&m, &parses).await;
        assert_eq!(after[500], "elsewhere");
        assert_eq!(parses.load(Ordering::Relaxed), 1001);
        // Another parser of the same key parses it itself, and the kept
        // record stays the first parser's.
        let other = after.len();
        let (kvs, _) = m.read("/p/blocks/", 0, Duration::ZERO).await.unwrap();
        assert_eq!(kvs[0].parse_once("other", |kv| kv.value.len()), 5);
        assert_eq!(read_blocks(&m, &parses).await.len(), other);
        assert_eq!(parses.load(Ordering::Relaxed), 1001);
    }

    /// A reader waiting for its last write to reach the mirror is let go
    /// as soon as the watch breaks, not at the end of its wait: the
    /// revision cannot come, and etcd answers at once (a member stopping
    /// under the watch once held a claim loop 2 s, past an ADD's wait).
    #[tokio::test(start_paused = true)]
    async fn a_reader_waiting_for_a_revision_is_let_go_when_the_watch_breaks() {
        let m = Arc::new(Mirror::new("/p/"));
        m.replace(vec![kv("/p/blocks/b", "node0", 10)], 10, 1);
        let reader = {
            let m = m.clone();
            tokio::spawn(async move {
                let started = tokio::time::Instant::now();
                let r = m.read("/p/blocks/", 11, Duration::from_secs(2)).await;
                (r.is_some(), started.elapsed())
            })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        m.set_live(false);
        let (answered, waited) = reader.await.unwrap();
        assert!(!answered, "a mirror not following answered");
        assert_eq!(waited, Duration::from_millis(100));
        // Following and caught up: answered from the mirror.
        m.replace(vec![kv("/p/blocks/b", "node1", 11)], 11, 1);
        assert!(
            m.read("/p/blocks/", 11, Duration::from_secs(2))
                .await
                .is_some()
        );
    }

    /// How long the watch has been down is known once it was live: not
    /// before the first read, not while it follows.
    #[test]
    fn down_for_counts_from_the_break_of_a_watch_that_was_live() {
        let m = Mirror::new("/p/");
        assert_eq!(m.down_for(), None, "never live");
        m.set_live(false);
        assert_eq!(m.down_for(), None, "never live, still");
        m.replace(vec![kv("/p/blocks/b", "node0", 10)], 10, 1);
        assert_eq!(m.down_for(), None, "live");
        m.set_live(false);
        let first = m.down_for().expect("down since the break");
        // A second report of the same break does not move its start.
        std::thread::sleep(Duration::from_millis(5));
        m.set_live(false);
        assert!(m.down_for().expect("still down") >= first + Duration::from_millis(5));
        m.set_live(true);
        assert_eq!(m.down_for(), None, "following again");
    }

    /// The keys a change touched, as [`Mirror::changes`] lists them.
    fn keys_of(c: Changes) -> Vec<(String, Option<String>)> {
        match c {
            Changes::Everything => panic!("everything, not keys"),
            Changes::Keys(k) => k
                .into_iter()
                .map(|(k, v)| (k, v.map(|v| String::from_utf8_lossy(&v.value).into_owned())))
                .collect(),
        }
    }

    /// A follower gets the keys changed in its areas since its cursor,
    /// each once with its value now; everything when it has read nothing,
    /// after a full read of the mirror, or when it is further behind
    /// than the log reaches.
    #[test]
    fn changes_are_the_keys_of_the_areas_changed_since_the_cursor() {
        let m = Mirror::new("/p/");
        let areas = ["blocks/", "nodes/"];
        assert!(m.changes(&areas, None).is_none(), "not live yet");
        m.replace(vec![kv("/p/blocks/a", "1", 5)], 5, 1);
        let (c, first) = m.changes(&areas, None).expect("live");
        assert!(matches!(c, Changes::Everything));
        let change = |key: &str, value: Option<&str>, rev: i64| {
            let now = value.map(|v| kv(key, v, rev));
            let area = m.area(key);
            m.write_state().apply(key.to_string(), area, rev, now);
            m.write_state().revision = rev;
        };
        change("/p/blocks/a", Some("2"), 6);
        change("/p/lb/x", Some("not followed"), 7);
        change("/p/nodes/n", Some("3"), 8);
        change("/p/blocks/a", Some("4"), 9);
        change("/p/blocks/b", Some("5"), 10);
        change("/p/blocks/b", None, 11);
        let (c, second) = m.changes(&areas, Some(first)).expect("live");
        assert_eq!(
            keys_of(c),
            vec![
                ("/p/blocks/a".into(), Some("4".into())),
                ("/p/blocks/b".into(), None),
                ("/p/nodes/n".into(), Some("3".into())),
            ]
        );
        let (c, third) = m.changes(&areas, Some(second)).expect("live");
        assert!(keys_of(c).is_empty(), "nothing since");
        assert_eq!(third, second);
        // More changes than the log keeps: the follower reads everything.
        for i in 0..=LOG_KEYS as i64 {
            change("/p/nodes/n", Some("x"), 12 + i);
        }
        assert!(matches!(
            m.changes(&areas, Some(third)),
            Some((Changes::Everything, _))
        ));
        let (_, fourth) = m.changes(&areas, None).expect("live");
        assert!(
            matches!(m.changes(&areas, Some(fourth)), Some((Changes::Keys(k), _)) if k.is_empty())
        );
        // A full read (a compaction, a restore): everything again.
        m.replace(vec![kv("/p/blocks/a", "1", 3)], 3, 1);
        assert!(matches!(
            m.changes(&areas, Some(fourth)),
            Some((Changes::Everything, _))
        ));
    }

    #[test]
    fn areas_are_the_first_segment_under_the_prefix() {
        let m = Mirror::new("/p/");
        assert_eq!(m.area("/p/blocks/pods/10.0.0.0-26"), "blocks/");
        assert_eq!(m.area("/p/lb/members/n"), "lb/");
        assert_eq!(m.area("/p/default_pool"), "default_pool");
    }
}
