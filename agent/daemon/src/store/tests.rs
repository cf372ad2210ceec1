//! Unit tests of the store: commits, reopen, the log, recovery.

use super::wal::tests::flip;
use super::*;
use lockstep_core::owner::Owner;

/// A fresh directory, removed when the returned guard drops (also when
/// the test panics).
fn temp_dir(tag: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("lockstep-store-{tag}-"))
        .tempdir()
        .expect("temp dir")
}

fn alloc(addr: &str, id: &str, generation: u64) -> Allocation {
    Allocation {
        pool: "default".into(),
        address: addr.parse().expect("literal"),
        owner: Owner::endpoint(id, "eth0"),
        generation: Generation(generation),
    }
}

#[test]
fn put_load_remove_round_trip() {
    let tmp = temp_dir("rt");
    let dir = tmp.path().join("state");
    let store = Store::open(&dir).expect("open");
    let a = alloc("10.0.0.1", "c1", 1);
    let b = alloc("fd00::1", "c1", 2);
    store.put(&a, Generation(1)).expect("put");
    store.put(&b, Generation(2)).expect("put");
    let stored = store.load().expect("load");
    assert_eq!(stored.generation, Generation(2));
    assert_eq!(stored.allocations.len(), 2);
    store.remove(&a).expect("remove");
    store.remove(&a).expect("removing twice is fine");
    let stored = store.load().expect("load");
    assert_eq!(stored.allocations, vec![b]);
    // The high-water mark never goes down.
    store
        .put(&alloc("10.0.0.9", "c9", 1), Generation(1))
        .expect("put");
    assert_eq!(store.load().expect("load").generation, Generation(2));
    drop(store);
    let reopened = Store::open(&dir).expect("reopen");
    assert_eq!(reopened.load().expect("load").allocations.len(), 2);
}

impl Store {
    /// A crash as far as the store can tell: redb keeps only its last
    /// checkpoint, the log keeps its records (the drop checkpoints
    /// nothing, as a killed process would not).
    fn crash(self) {
        let mut inner = self.lock();
        inner.pending.clear();
        inner.group = None;
    }

    fn log_seq(&self) -> u64 {
        db::log_seq(self.lock().db.as_ref().expect("open"))
    }
}

#[test]
fn commits_survive_a_crash_through_the_log() {
    let tmp = temp_dir("crash");
    let dir = tmp.path().join("state");
    let store = Store::open(&dir).expect("open");
    let (a, b, c) = (
        alloc("10.0.0.1", "c1", 1),
        alloc("10.0.0.2", "c2", 5),
        alloc("10.0.0.3", "c3", 3),
    );
    store.put(&a, Generation(1)).expect("put");
    store
        .put_many(&[b.clone(), c.clone()], Generation(5))
        .expect("put");
    store.remove(&a).expect("remove");
    let seq_before = store.log_seq();
    store.crash();
    let reopened = Store::open(&dir).expect("reopen");
    assert!(
        reopened.log_seq() > seq_before,
        "replay checkpointed the log"
    );
    let stored = reopened.load().expect("load");
    assert_eq!(stored.allocations, vec![b.clone(), c.clone()]);
    assert_eq!(stored.generation, Generation(5));
    // A second crash right after the replay's checkpoint replays nothing
    // twice: the same state.
    reopened.crash();
    let again = Store::open(&dir).expect("reopen");
    assert_eq!(again.load().expect("load").allocations, vec![b, c]);
}

#[test]
fn a_small_log_wraps_through_checkpoints_without_losing_a_commit() {
    // Three record pages and no checkpoint before the log is full: every
    // third commit finds it full, checkpoints and starts it again, with
    // crashes in between.
    let tmp = temp_dir("wrap");
    let dir = tmp.path().join("state");
    let mut store = Store::open_with(&dir, 4, 0).expect("open");
    let mut live = std::collections::BTreeMap::new();
    for i in 0..60u64 {
        let a = alloc(&format!("10.0.1.{}", i % 20), &format!("c{}", i % 20), i);
        if i % 3 == 2 {
            store.remove(&a).expect("remove");
            live.remove(&key_of(&a));
        } else {
            store.put(&a, Generation(i)).expect("put");
            live.insert(key_of(&a), a);
        }
        if i % 7 == 6 {
            store.crash();
            store = Store::open_with(&dir, 4, 0).expect("reopen");
            let mut got = store.load().expect("load").allocations;
            got.sort_by_key(key_of);
            assert_eq!(got, live.values().cloned().collect::<Vec<_>>(), "after {i}");
        }
    }
    drop(store);
}

#[test]
fn a_commit_too_big_for_the_log_goes_straight_to_redb() {
    let tmp = temp_dir("big");
    let dir = tmp.path().join("state");
    let store = Store::open_with(&dir, 4, 2).expect("open");
    let first = alloc("10.0.2.1", "first", 1);
    store.put(&first, Generation(1)).expect("put");
    // ~100 allocations of ~150 bytes: more than the three record pages.
    let many: Vec<Allocation> = (0..100)
        .map(|i| alloc(&format!("10.0.3.{i}"), &format!("many-{i}"), 2))
        .collect();
    store.put_many(&many, Generation(2)).expect("put many");
    store.crash();
    let reopened = Store::open_with(&dir, 4, 2).expect("reopen");
    assert_eq!(reopened.load().expect("load").allocations.len(), 101);
}

/// Three commits left in the log only (a crash before any checkpoint).
fn three_in_the_log(dir: &Path) -> Vec<Allocation> {
    let store = Store::open(dir).expect("open");
    let all: Vec<Allocation> = (1..=3)
        .map(|i| alloc(&format!("10.0.5.{i}"), &format!("h{i}"), i))
        .collect();
    for a in &all {
        store.put(a, a.generation).expect("put");
    }
    store.crash();
    all
}

#[test]
fn a_damaged_log_header_refuses_the_open_and_keeps_every_commit() {
    let tmp = temp_dir("header");
    let dir = tmp.path().join("state");
    let all = three_in_the_log(&dir);
    let log = dir.join(LOG_FILE);
    let before = std::fs::read(&log).expect("read");
    flip(&log, 20);
    let err = Store::open(&dir).expect_err("a damaged header must not be replaced");
    assert!(err.needs_operator(), "{err}");
    assert!(chain(&err).contains("damaged header"), "{}", chain(&err));
    flip(&log, 20);
    assert_eq!(std::fs::read(&log).expect("read"), before, "left as it was");
    let store = Store::open(&dir).expect("mended");
    let mut got = store.load().expect("load").allocations;
    got.sort_by_key(key_of);
    assert_eq!(got, all);
}

#[test]
fn a_log_of_another_size_is_replayed_then_resized() {
    let tmp = temp_dir("resize");
    let dir = tmp.path().join("state");
    let all = three_in_the_log(&dir);
    let store = Store::open_with(&dir, LOG_PAGES * 2, LOG_PAGES).expect("open larger");
    assert_eq!(
        std::fs::metadata(dir.join(LOG_FILE)).expect("stat").len(),
        LOG_PAGES * 2 * wal::PAGE,
        "resized after the replay's checkpoint"
    );
    let mut got = store.load().expect("load").allocations;
    got.sort_by_key(key_of);
    assert_eq!(got, all);
    // And back, with commits in the larger log.
    let more = alloc("10.0.5.9", "h9", 9);
    store.put(&more, Generation(9)).expect("put");
    store.crash();
    let store = Store::open(&dir).expect("open at the default size");
    assert_eq!(store.load().expect("load").allocations.len(), 4);
    assert_eq!(
        std::fs::metadata(dir.join(LOG_FILE)).expect("stat").len(),
        LOG_PAGES * wal::PAGE
    );
}

#[test]
fn reset_log_moves_a_refused_log_aside_and_keeps_the_checkpointed_state() {
    let tmp = temp_dir("reset");
    let dir = tmp.path().join("state");
    let store = Store::open(&dir).expect("open");
    let kept = alloc("10.0.9.1", "k1", 1);
    store.put(&kept, Generation(1)).expect("put");
    store.checkpoint().expect("checkpoint");
    store
        .put(&alloc("10.0.9.2", "k2", 2), Generation(2))
        .expect("put");
    store.crash();
    flip(&dir.join(LOG_FILE), 20);
    assert!(Store::open(&dir).is_err(), "refused");
    let (moved, applied) = Store::reset_log(&dir).expect("reset");
    let moved = moved.expect("there was a log");
    assert!(moved.exists(), "the old log is kept for inspection");
    assert!(applied > 0);
    let store = Store::open(&dir).expect("opens after the reset");
    assert_eq!(store.load().expect("load").allocations, vec![kept]);
    drop(store);
    let err = Store::reset_log(&tmp.path().join("nothing")).expect_err("no store");
    assert!(matches!(err, StoreError::NoStore { .. }), "{err}");
}

#[test]
fn a_missing_log_is_refused_once_the_database_has_checkpointed() {
    let tmp = temp_dir("missing");
    let dir = tmp.path().join("state");
    let store = Store::open(&dir).expect("open");
    store
        .put(&alloc("10.0.6.1", "m1", 1), Generation(1))
        .expect("put");
    drop(store); // checkpoints
    std::fs::remove_file(dir.join(LOG_FILE)).expect("remove");
    let err = Store::open(&dir).expect_err("missing log");
    assert!(
        err.needs_operator() && chain(&err).contains("missing"),
        "{err}"
    );
}

#[test]
fn after_a_failed_append_the_store_is_unhealthy_then_recovers() {
    let tmp = temp_dir("recover");
    let dir = tmp.path().join("state");
    let store = Store::open(&dir).expect("open");
    let a = alloc("10.0.7.1", "r1", 1);
    store.put(&a, Generation(1)).expect("put");
    {
        let mut inner = store.lock();
        inner.wal.fail_for_test();
        inner.failure = Some("store log: sync failed: No space left on device".into());
    }
    assert!(
        store.health().is_some_and(|h| h.contains("No space left")),
        "the cause is reported"
    );
    // The next commit recovers first: a checkpoint through the failed
    // record's number, then the log resumes after it.
    let b = alloc("10.0.7.2", "r2", 2);
    store.put(&b, Generation(2)).expect("put after recovery");
    assert!(store.health().is_none());
    store.crash();
    let store = Store::open(&dir).expect("reopen");
    let mut got = store.load().expect("load").allocations;
    got.sort_by_key(key_of);
    assert_eq!(got, vec![a, b]);
}

#[test]
fn a_failed_database_is_opened_again_by_the_next_commit() {
    let tmp = temp_dir("reopen");
    let dir = tmp.path().join("state");
    let store = Store::open(&dir).expect("open");
    let a = alloc("10.0.8.1", "d1", 1);
    store.put(&a, Generation(1)).expect("put");
    {
        let mut inner = store.lock();
        inner.db = None;
        inner.failure = Some("store commit failed: I/O error".into());
    }
    let b = alloc("10.0.8.2", "d2", 2);
    store
        .put(&b, Generation(2))
        .expect("put re-opens the database");
    assert!(store.health().is_none());
    let mut got = store.load().expect("load").allocations;
    got.sort_by_key(key_of);
    assert_eq!(got, vec![a, b]);
}

#[test]
fn store_files_are_private_and_symlinks_are_refused() {
    use std::os::unix::fs::PermissionsExt as _;
    let tmp = temp_dir("files");
    let dir = tmp.path().join("state");
    drop(Store::open(&dir).expect("open"));
    let mode = |p: &Path| std::fs::metadata(p).expect("stat").permissions().mode() & 0o777;
    assert_eq!(mode(&dir), 0o700);
    assert_eq!(mode(&dir.join(DB_FILE)), 0o600);
    assert_eq!(mode(&dir.join(LOG_FILE)), 0o600);

    // A symlinked state directory, one others may write to, and a
    // symlink planted at the database's path are all refused.
    let link = tmp.path().join("link");
    std::os::unix::fs::symlink(&dir, &link).expect("symlink");
    let err = Store::open(&link).expect_err("symlinked state dir");
    assert!(err.to_string().contains("symbolic link"), "{err}");
    let open_dir = tmp.path().join("open");
    std::fs::create_dir(&open_dir).expect("mkdir");
    std::fs::set_permissions(&open_dir, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let err = Store::open(&open_dir).expect_err("world-writable state dir");
    assert!(err.to_string().contains("may write"), "{err}");
    let planted = tmp.path().join("planted");
    std::fs::create_dir(&planted).expect("mkdir");
    let victim = tmp.path().join("victim");
    std::fs::write(&victim, b"precious").expect("write");
    std::os::unix::fs::symlink(&victim, planted.join(DB_FILE)).expect("symlink");
    let err = Store::open(&planted).expect_err("symlinked database");
    assert!(matches!(err, StoreError::File { .. }), "{err}");
    std::fs::remove_file(planted.join(DB_FILE)).expect("rm");
    std::os::unix::fs::symlink(&victim, planted.join(LOG_FILE)).expect("symlink");
    let err = Store::open(&planted).expect_err("symlinked log");
    assert!(chain(&err).contains("store log"), "{}", chain(&err));
    assert_eq!(
        std::fs::read(&victim).expect("read"),
        b"precious",
        "never written through"
    );
}

#[test]
fn a_second_opener_is_refused() {
    let tmp = temp_dir("lock");
    let dir = tmp.path().join("state");
    let _first = Store::open(&dir).expect("open");
    let err = Store::open(&dir).expect_err("second open must fail");
    assert!(err.to_string().contains("another agent"), "{err}");
}

#[test]
fn keys_separate_pool_family_and_owner() {
    let a = alloc("10.0.0.1", "c1", 1);
    let mut b = a.clone();
    b.address = "fd00::1".parse().expect("literal");
    assert_ne!(key_of(&a), key_of(&b));
    let mut c = a.clone();
    c.generation = Generation(7);
    assert_eq!(key_of(&a), key_of(&c), "generation is not part of the key");
}

#[test]
fn a_commit_group_is_one_record_and_durable_once_closed() {
    let tmp = temp_dir("group");
    let dir = tmp.path().join("state");
    let store = Store::open(&dir).expect("open");
    let (a, b, c) = (
        alloc("10.0.9.1", "g1", 1),
        alloc("10.0.9.2", "g2", 2),
        alloc("10.0.9.3", "g3", 3),
    );
    let before = store.lock().wal.covered_through();
    store.open_group();
    store.put(&a, Generation(1)).expect("put");
    store.put(&b, Generation(2)).expect("put");
    store.remove(&a).expect("remove");
    store.put(&c, Generation(3)).expect("put");
    assert_eq!(
        store.lock().wal.covered_through(),
        before,
        "nothing is written before the group closes"
    );
    store.close_group().expect("close");
    assert_eq!(
        store.lock().wal.covered_through(),
        before + 1,
        "four commits, one record"
    );
    store.crash();
    let store = Store::open(&dir).expect("reopen");
    let stored = store.load().expect("load");
    let mut got = stored.allocations;
    got.sort_by_key(key_of);
    assert_eq!(got, vec![b, c]);
    assert_eq!(stored.generation, Generation(3));
}

#[test]
fn a_failed_group_refuses_every_commit_and_no_replay_brings_it_back() {
    let tmp = temp_dir("group-fail");
    let dir = tmp.path().join("state");
    let store = Store::open(&dir).expect("open");
    let kept = alloc("10.0.10.1", "kept", 1);
    store
        .put(&kept, Generation(1))
        .expect("put outside a group");

    // The sync fails when the group closes.
    store.open_group();
    store
        .put(&alloc("10.0.10.2", "lost-1", 2), Generation(2))
        .expect("joins");
    store
        .put(&alloc("10.0.10.3", "lost-2", 3), Generation(3))
        .expect("joins");
    store.lock().wal.fail_for_test();
    assert!(store.close_group().is_err(), "the group is refused");
    assert!(store.health().is_some(), "and the store says it failed");
    store.recover().expect("recovers");
    assert!(store.health().is_none());

    // The record is written early (a failing store flushes before it
    // recovers) and fails: that commit and every later one of the group
    // are refused.
    store.open_group();
    store
        .put(&alloc("10.0.10.4", "lost-3", 4), Generation(4))
        .expect("joins");
    store.lock().wal.fail_for_test();
    assert!(
        store
            .put(&alloc("10.0.10.5", "lost-4", 5), Generation(5))
            .is_err()
    );
    let later = store.put(&alloc("10.0.10.6", "lost-5", 6), Generation(6));
    assert!(
        matches!(later, Err(StoreError::GroupFailed { .. })),
        "{later:?}"
    );
    assert!(store.close_group().is_err());
    store.recover().expect("recovers");

    store.crash();
    let store = Store::open(&dir).expect("reopen");
    let stored = store.load().expect("load");
    assert_eq!(stored.allocations, vec![kept.clone()]);
    assert_eq!(stored.generation, Generation(1), "no refused generation");
    // Commits go on after the refused numbers.
    let next = alloc("10.0.10.7", "next", 7);
    store.put(&next, Generation(7)).expect("put");
    store.crash();
    let mut got = Store::open(&dir)
        .expect("reopen")
        .load()
        .expect("load")
        .allocations;
    got.sort_by_key(key_of);
    assert_eq!(got, vec![kept, next]);
}

#[test]
fn a_group_larger_than_the_log_is_written_early_and_loses_nothing() {
    // Three record pages: a group of 100 commits (~20 KiB) cannot wait for
    // its close.
    let tmp = temp_dir("group-big");
    let dir = tmp.path().join("state");
    let store = Store::open_with(&dir, 4, 0).expect("open");
    let all: Vec<Allocation> = (0..100)
        .map(|i| alloc(&format!("10.0.11.{i}"), &format!("big-{i}"), i + 1))
        .collect();
    store.open_group();
    for a in &all {
        store.put(a, a.generation).expect("put");
    }
    // A commit too big for the log at all goes straight to redb.
    let many: Vec<Allocation> = (0..100)
        .map(|i| alloc(&format!("10.0.12.{i}"), &format!("many-{i}"), 200))
        .collect();
    store.put_many(&many, Generation(200)).expect("put many");
    store.close_group().expect("close");
    store.crash();
    let stored = Store::open_with(&dir, 4, 0)
        .expect("reopen")
        .load()
        .expect("load");
    assert_eq!(stored.allocations.len(), 200);
    assert_eq!(stored.generation, Generation(200));
}
