//! The log's own tests: replay order, torn and damaged records, cycles,
//! sizes, foreign and truncated logs, recovery after a failed append.

use super::*;

/// A fresh directory, removed when the returned guard drops (also when
/// the test panics).
fn temp(tag: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("lockstep-wal-{tag}-"))
        .tempdir()
        .expect("temp dir")
}

fn payload(n: usize, fill: u8) -> Vec<u8> {
    (0..n).map(|i| fill ^ (i as u8)).collect()
}

#[test]
fn records_replay_in_order_after_reopen() {
    let tmp = temp("order");
    let dir = tmp.path().to_path_buf();
    let path = dir.join("log");
    let (mut wal, none) = Wal::open(&path, 7, 16, 0).expect("open");
    assert!(none.is_empty());
    let a = payload(10, 1);
    let b = payload(5000, 2); // two pages
    let c = payload(0, 3);
    assert_eq!(wal.append(&a).expect("a"), 1);
    assert_eq!(wal.append(&b).expect("b"), 2);
    assert_eq!(wal.append(&c).expect("c"), 3);
    assert_eq!(wal.free_pages(), 16 - 1 - 4);
    drop(wal);
    let (wal, got) = Wal::open(&path, 7, 16, 0).expect("reopen");
    let want: Vec<Record> = [(1, a), (2, b.clone()), (3, c)]
        .into_iter()
        .map(|(seq, payload)| Record { seq, payload })
        .collect();
    assert_eq!(got, want);
    assert_eq!(wal.covered_through(), 3);
}

/// Flips bits of one byte of a file in place (damage for tests).
pub(in crate::store) fn flip(path: &Path, at: u64) {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .expect("open");
    let mut byte = [0u8; 1];
    file.read_exact_at(&mut byte, at).expect("read");
    byte[0] ^= 0x40;
    file.write_all_at(&byte, at).expect("write");
}

/// A 16-page log holding records 1 to 4, one page each.
fn log_of_four(tag: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = temp(tag);
    let path = tmp.path().join("log");
    let (mut wal, _) = Wal::open(&path, 7, 16, 0).expect("open");
    for i in 0..4u8 {
        wal.append(&payload(100, i)).expect("append");
    }
    (tmp, path)
}

#[test]
fn a_torn_last_record_ends_the_log_and_is_overwritten() {
    let (_tmp, path) = log_of_four("torn");
    // Record 4 (page 4) half written: records 1 to 3 stay.
    flip(&path, 4 * PAGE + 50);
    let (mut wal, got) = Wal::open(&path, 7, 16, 0).expect("reopen");
    assert_eq!(got.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![1, 2, 3]);
    // The next record takes its place and number.
    assert_eq!(wal.append(&payload(10, 9)).expect("append"), 4);
    let (_, got) = Wal::open(&path, 7, 16, 0).expect("reopen");
    assert_eq!(
        got.iter().map(|r| r.seq).collect::<Vec<_>>(),
        vec![1, 2, 3, 4]
    );
    assert_eq!(got[3].payload, payload(10, 9));
}

#[test]
fn a_damaged_record_before_intact_ones_is_refused() {
    let (_tmp, path) = log_of_four("damaged");
    flip(&path, 2 * PAGE + 50);
    let err = Wal::open(&path, 7, 16, 0).expect_err("damage must not be skipped");
    assert!(
        matches!(
            err,
            WalError::Damaged {
                seq: 2,
                later: 3,
                ..
            }
        ),
        "{err}"
    );
    // The file is left as it was for inspection.
    flip(&path, 2 * PAGE + 50);
    let (_, got) = Wal::open(&path, 7, 16, 0).expect("repaired");
    assert_eq!(got.len(), 4);
}

#[test]
fn a_new_cycle_never_replays_the_old_one() {
    let tmp = temp("cycle");
    let dir = tmp.path().to_path_buf();
    let path = dir.join("log");
    let (mut wal, _) = Wal::open(&path, 7, 8, 0).expect("open");
    for i in 0..5u8 {
        wal.append(&payload(10, i)).expect("append");
    }
    // Checkpointed through 5: the next record starts the log again.
    wal.recover();
    assert_eq!(wal.append(&payload(10, 0xaa)).expect("append"), 6);
    drop(wal);
    let (wal, got) = Wal::open(&path, 7, 8, 5).expect("reopen");
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].seq, 6);
    assert_eq!(got[0].payload, payload(10, 0xaa));
    assert_eq!(wal.covered_through(), 6);
    // A checkpoint through 6 and a crash before any new record: nothing.
    let (wal, got) = Wal::open(&path, 7, 8, 6).expect("reopen");
    assert!(got.is_empty());
    assert_eq!(wal.covered_through(), 6);
}

#[test]
fn full_and_too_big_are_refused_without_writing() {
    let tmp = temp("full");
    let dir = tmp.path().to_path_buf();
    let path = dir.join("log");
    let (mut wal, _) = Wal::open(&path, 7, 4, 0).expect("open");
    assert!(matches!(
        wal.append(&payload(4 * PAGE as usize, 0)),
        Err(WalError::TooBig { .. })
    ));
    wal.append(&payload(5000, 1)).expect("two pages");
    assert!(matches!(wal.append(&payload(5000, 2)), Err(WalError::Full)));
    wal.append(&payload(10, 3)).expect("the last page");
    assert_eq!(wal.free_pages(), 0);
    let (_, got) = Wal::open(&path, 7, 4, 0).expect("reopen");
    assert_eq!(got.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![1, 2]);
}

/// The log file's bytes, to check that a refused open changed nothing.
fn image(path: &Path) -> Vec<u8> {
    std::fs::read(path).expect("read log")
}

#[test]
fn a_damaged_header_is_refused_and_the_file_left_alone() {
    for (at, what) in [
        (3, "magic"),
        (9, "page count"),
        (17, "store id"),
        (25, "crc"),
    ] {
        let (_tmp, path) = log_of_four(&format!("header-{what}"));
        flip(&path, at);
        let before = image(&path);
        let err = Wal::open(&path, 7, 16, 0).expect_err(what);
        assert!(matches!(err, WalError::Header { .. }), "{what}: {err}");
        assert!(err.to_string().contains("damaged header"), "{err}");
        assert_eq!(
            image(&path),
            before,
            "{what}: a refused open writes nothing"
        );
        // Mended, it opens with every record.
        flip(&path, at);
        let (_, got) = Wal::open(&path, 7, 16, 0).expect("mended");
        assert_eq!(got.len(), 4, "{what}");
    }
}

#[test]
fn a_log_of_another_store_is_refused() {
    let (_tmp, path) = log_of_four("foreign");
    let before = image(&path);
    let err = Wal::open(&path, 8, 16, 0).expect_err("another store's log");
    assert!(
        matches!(
            err,
            WalError::Foreign {
                found: 7,
                expected: 8,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(image(&path), before);
}

#[test]
fn a_truncated_or_missing_log_is_refused_once_the_database_used_it() {
    let (_tmp, path) = log_of_four("short");
    let file = OpenOptions::new().write(true).open(&path).expect("open");
    file.set_len(15 * PAGE).expect("truncate");
    drop(file);
    let err = Wal::open(&path, 7, 16, 0).expect_err("short log");
    assert!(matches!(err, WalError::Header { .. }), "{err}");
    std::fs::remove_file(&path).expect("remove");
    let err = Wal::open(&path, 7, 16, 3).expect_err("missing log");
    assert!(matches!(err, WalError::Missing { after: 3, .. }), "{err}");
    assert!(!path.exists(), "a refused open creates nothing");
    // A database that never applied a record starts a new log.
    let (_, got) = Wal::open(&path, 7, 16, 0).expect("new log");
    assert!(got.is_empty());
    assert_eq!(std::fs::metadata(&path).expect("stat").len(), 16 * PAGE);
    assert!(!temp_path(&path).exists(), "the temporary name is gone");
}

#[test]
fn a_first_record_newer_than_the_database_expects_is_refused() {
    // Records 1..=4 were checkpointed (the database says 4), the log was
    // restarted and record 5 written; then the database lost that
    // checkpoint and says 2.
    let tmp = temp("behind");
    let path = tmp.path().join("log");
    let (mut wal, _) = Wal::open(&path, 7, 16, 0).expect("open");
    for i in 0..4u8 {
        wal.append(&payload(100, i)).expect("append");
    }
    wal.recover();
    assert_eq!(wal.append(&payload(100, 9)).expect("append"), 5);
    drop(wal);
    let err = Wal::open(&path, 7, 16, 2).expect_err("database behind the log");
    assert!(
        matches!(
            err,
            WalError::Behind {
                found: 5,
                after: 2,
                ..
            }
        ),
        "{err}"
    );
    // The database at 4 replays record 5 only.
    let (_, got) = Wal::open(&path, 7, 16, 4).expect("consistent");
    assert_eq!(got.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![5]);
}

#[test]
fn a_log_of_another_size_replays_then_resizes() {
    let (_tmp, path) = log_of_four("resize");
    // Asked for 32 pages: the 16-page log still replays whole.
    let (mut wal, got) = Wal::open(&path, 7, 32, 0).expect("open at its own size");
    assert_eq!(got.len(), 4);
    assert_eq!(std::fs::metadata(&path).expect("stat").len(), 16 * PAGE);
    // After the store's checkpoint through 4, the log takes the new size.
    wal.resize().expect("resize");
    assert_eq!(std::fs::metadata(&path).expect("stat").len(), 32 * PAGE);
    assert_eq!(wal.free_pages(), 31);
    assert_eq!(wal.append(&payload(10, 1)).expect("append"), 5);
    drop(wal);
    let (_, got) = Wal::open(&path, 7, 32, 4).expect("reopen");
    assert_eq!(got.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![5]);
}

#[test]
fn after_a_failed_append_recovery_skips_the_failed_number() {
    let (_tmp, path) = log_of_four("recover");
    let (mut wal, _) = Wal::open(&path, 7, 16, 0).expect("open");
    // Stand in for a failed write or sync of record 5.
    wal.failed = true;
    assert!(matches!(wal.append(&payload(10, 1)), Err(WalError::Failed)));
    assert_eq!(
        wal.covered_through(),
        5,
        "a checkpoint covers the failed one"
    );
    wal.recover();
    assert!(!wal.failed());
    assert_eq!(wal.append(&payload(10, 2)).expect("append"), 6);
    drop(wal);
    let (_, got) = Wal::open(&path, 7, 16, 5).expect("reopen");
    assert_eq!(got.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![6]);
}
