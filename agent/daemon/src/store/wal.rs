//! The store's write-ahead log: what makes one commit a single page write
//! and one `fdatasync`.
//!
//! Why it exists: a redb commit rewrites every B-tree page on the changed
//! paths, the table tree, the allocator state and the header, then syncs;
//! for one CNI ADD that is six scattered pages, measured at ~0.19 ms on the
//! project VM against ~0.085 ms for one page overwritten in place (`cargo
//! xtask bench cni` prints the floor). A CNI call is a new process whose
//! whole budget is well under a millisecond, so the commit is a third of it.
//! The log makes a commit durable with one sequential write into a file that
//! is already allocated and written (no metadata for the file system to
//! journal), and the store applies the logged operations to redb in batches
//! (a *checkpoint*, one durable redb commit for many log records).
//!
//! Layout: a fixed-size file of 4 KiB pages. Page 0 is a header written once
//! at creation (magic, format version, page count and the store's identity,
//! so a log is never replayed into a database it was not written for). Every
//! record starts on a page boundary:
//!
//! ```text
//! offset 0  magic "LSWR" (u32 LE)
//!        4  payload length (u32 LE)
//!        8  sequence number (u64 LE), consecutive across the log's life
//!       16  CRC-32 of bytes 4..16 and the payload (u32 LE)
//!       20  zero (u32)
//!       24  payload, then zeros to the page boundary
//! ```
//!
//! Replay reads records from page 1 while each has the magic, the next
//! sequence number and a matching checksum; the first that does not ends the
//! log. That covers a torn last record (never acknowledged: the caller
//! acknowledges only after [`Wal::append`] returned, i.e. after the sync) and
//! the older records a previous cycle left behind (their sequence numbers are
//! lower). After a checkpoint the store calls [`Wal::restart`]: the next
//! record goes to page 1 again, with the next sequence number, and redb holds
//! the last checkpointed sequence number, so replay skips what it already
//! has. A failed write or sync leaves the log in an unknown state (the page
//! cache may be marked clean without the data reaching the disk), so the log
//! refuses every later append until the process restarts and replays.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};

/// Size of a log page.
pub const PAGE: u64 = 4096;
const HEADER_MAGIC: &[u8; 8] = b"LSWALv01";
const RECORD_MAGIC: u32 = u32::from_le_bytes(*b"LSWR");
const RECORD_HEADER: usize = 24;

/// Errors of the log.
#[derive(Debug, thiserror::Error)]
pub enum WalError {
    /// The log file could not be created, read, written or synced.
    #[error("store log {path}: {action} failed")]
    Io {
        /// The log file.
        path: PathBuf,
        /// What was being done.
        action: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The record does not fit in the log even when it is empty.
    #[error("a {len}-byte record does not fit in the store log ({pages} pages)")]
    TooBig {
        /// Payload length.
        len: usize,
        /// The log's size in pages.
        pages: u64,
    },
    /// The record does not fit in what is left; checkpoint and restart.
    #[error("the store log is full")]
    Full,
    /// A record in the middle of the log is unreadable while later ones are
    /// intact: not a torn last write but damage. Replaying up to it would
    /// drop acknowledged commits, so the store refuses to open.
    #[error(
        "store log {path} is damaged: record {seq} on page {page} is unreadable but record {later} follows; refusing to drop acknowledged commits (inspect or move the file aside)"
    )]
    Damaged {
        /// The log file.
        path: PathBuf,
        /// The page where the record should start.
        page: u64,
        /// The sequence number expected there.
        seq: u64,
        /// A later record found intact.
        later: u64,
    },
    /// An earlier write or sync failed; nothing more is written.
    #[error("the store log failed earlier; restart the agent to recover from it")]
    Failed,
}

/// One replayed record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// Its sequence number.
    pub seq: u64,
    /// What the store wrote.
    pub payload: Vec<u8>,
}

/// The open log.
#[derive(Debug)]
pub struct Wal {
    file: File,
    path: PathBuf,
    pages: u64,
    /// Page the next record starts on.
    next_page: u64,
    /// Sequence number of the next record.
    next_seq: u64,
    failed: bool,
}

fn pages_for(len: usize) -> u64 {
    (RECORD_HEADER + len).div_ceil(PAGE as usize) as u64
}

fn checksum(len: u32, seq: u64, payload: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&len.to_le_bytes());
    h.update(&seq.to_le_bytes());
    h.update(payload);
    h.finalize()
}

fn header(store_id: u64, pages: u64) -> Vec<u8> {
    let mut page = vec![0u8; PAGE as usize];
    page[..8].copy_from_slice(HEADER_MAGIC);
    page[8..16].copy_from_slice(&pages.to_le_bytes());
    page[16..24].copy_from_slice(&store_id.to_le_bytes());
    let crc = crc32fast::hash(&page[..24]);
    page[24..28].copy_from_slice(&crc.to_le_bytes());
    page
}

impl Wal {
    /// Opens the log at `path` for the store `store_id`, creating it (or
    /// recreating it, when it is missing, of another size or of another
    /// store) with `pages` pages, and returns it with the records whose
    /// sequence numbers follow `after`, in order. The next append follows
    /// the last record returned.
    ///
    /// # Errors
    /// The file cannot be read, created or synced.
    pub fn open(
        path: &Path,
        store_id: u64,
        pages: u64,
        after: u64,
    ) -> Result<(Self, Vec<Record>), WalError> {
        let io = |action| {
            let path = path.to_path_buf();
            move |source| WalError::Io {
                path,
                action,
                source,
            }
        };
        assert!(pages >= 2, "a log needs a header page and a record page");
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(io("open"))?;
        let mut wal = Self {
            file,
            path: path.to_path_buf(),
            pages,
            next_page: 1,
            next_seq: after + 1,
            failed: false,
        };
        let expected = header(store_id, pages);
        let mut found = vec![0u8; PAGE as usize];
        let size = wal.file.metadata().map_err(io("stat"))?.len();
        let ours = size == pages * PAGE
            && wal.file.read_exact_at(&mut found, 0).is_ok()
            && found == expected;
        if !ours {
            if size > 0 {
                tracing::warn!(
                    log = %path.display(),
                    "the store log belongs to another store or another size; starting a new one"
                );
            }
            wal.create(&expected).map_err(io("create"))?;
            return Ok((wal, Vec::new()));
        }
        let records = wal.scan()?;
        if let Some(last) = records.last() {
            wal.next_seq = last.seq + 1;
            wal.next_page = 1 + records
                .iter()
                .map(|r| pages_for(r.payload.len()))
                .sum::<u64>();
        }
        Ok((wal, records))
    }

    /// Writes the header and zeros over the whole file, then syncs it and
    /// its directory: later records overwrite allocated, written blocks, so
    /// syncing them changes no file system metadata.
    fn create(&mut self, header: &[u8]) -> std::io::Result<()> {
        self.file.set_len(0)?;
        self.file.write_all_at(header, 0)?;
        let zeros = vec![0u8; 256 * PAGE as usize];
        let mut at = PAGE;
        while at < self.pages * PAGE {
            let n = zeros.len().min((self.pages * PAGE - at) as usize);
            self.file.write_all_at(&zeros[..n], at)?;
            at += n as u64;
        }
        self.file.sync_all()?;
        if let Some(dir) = self.path.parent() {
            File::open(dir)?.sync_all()?;
        }
        Ok(())
    }

    /// The records of this cycle: consecutive sequence numbers from page 1.
    /// Where they end, only a torn last record or an older cycle may follow;
    /// a valid record with a later sequence number further on means a record
    /// in the middle is damaged, and dropping it and its successors would
    /// lose acknowledged commits, so that is an error.
    fn scan(&self) -> Result<Vec<Record>, WalError> {
        let mut image = vec![0u8; (self.pages * PAGE) as usize];
        self.file
            .read_exact_at(&mut image, 0)
            .map_err(|source| WalError::Io {
                path: self.path.clone(),
                action: "read",
                source,
            })?;
        let record_at = |page: u64| -> Option<Record> {
            let at = (page * PAGE) as usize;
            let head = image.get(at..at + RECORD_HEADER)?;
            let word = |i: usize| u32::from_le_bytes(head[i..i + 4].try_into().expect("4"));
            let len = word(4);
            let seq = u64::from_le_bytes(head[8..16].try_into().expect("8"));
            if word(0) != RECORD_MAGIC || page + pages_for(len as usize) > self.pages {
                return None;
            }
            let payload = &image[at + RECORD_HEADER..at + RECORD_HEADER + len as usize];
            (checksum(len, seq, payload) == word(16)).then(|| Record {
                seq,
                payload: payload.to_vec(),
            })
        };
        let mut records = Vec::new();
        let mut page = 1;
        let mut seq = self.next_seq;
        while page < self.pages {
            match record_at(page) {
                Some(r) if r.seq == seq => {
                    page += pages_for(r.payload.len());
                    records.push(r);
                    seq += 1;
                }
                _ => break,
            }
        }
        if let Some(later) =
            (page + 1..self.pages).find_map(|p| record_at(p).filter(|r| r.seq >= seq))
        {
            return Err(WalError::Damaged {
                path: self.path.clone(),
                page,
                seq,
                later: later.seq,
            });
        }
        Ok(records)
    }

    /// Appends one record and returns its sequence number once it is on
    /// disk (`fdatasync` returned).
    ///
    /// # Errors
    /// [`WalError::Full`] when it does not fit in what is left (nothing was
    /// written), [`WalError::TooBig`] when it never fits, [`WalError::Failed`]
    /// after an earlier failure, or the write or sync failing (the log then
    /// fails every later append).
    pub fn append(&mut self, payload: &[u8]) -> Result<u64, WalError> {
        if self.failed {
            return Err(WalError::Failed);
        }
        let pages = pages_for(payload.len());
        if pages > self.pages - 1 || u32::try_from(payload.len()).is_err() {
            return Err(WalError::TooBig {
                len: payload.len(),
                pages: self.pages,
            });
        }
        if self.next_page + pages > self.pages {
            return Err(WalError::Full);
        }
        let len = payload.len() as u32;
        let mut buf = vec![0u8; (pages * PAGE) as usize];
        buf[0..4].copy_from_slice(&RECORD_MAGIC.to_le_bytes());
        buf[4..8].copy_from_slice(&len.to_le_bytes());
        buf[8..16].copy_from_slice(&self.next_seq.to_le_bytes());
        buf[16..20].copy_from_slice(&checksum(len, self.next_seq, payload).to_le_bytes());
        buf[RECORD_HEADER..RECORD_HEADER + payload.len()].copy_from_slice(payload);
        let written = self
            .file
            .write_all_at(&buf, self.next_page * PAGE)
            .map_err(|source| (source, "write"))
            .and_then(|()| self.file.sync_data().map_err(|source| (source, "sync")));
        if let Err((source, action)) = written {
            self.failed = true;
            return Err(WalError::Io {
                path: self.path.clone(),
                action,
                source,
            });
        }
        let seq = self.next_seq;
        self.next_page += pages;
        self.next_seq += 1;
        Ok(seq)
    }

    /// After a checkpoint made every record so far durable elsewhere: the
    /// next record goes to the first page again (its sequence number goes
    /// on, so what is left of this cycle is never replayed).
    pub fn restart(&mut self) {
        self.next_page = 1;
    }

    /// The sequence number a checkpoint covers the log through: the last
    /// record, or after a failed append that record's number too. A failed
    /// record may have reached the disk, but it was never acknowledged nor
    /// applied, and the checkpoint's state does not include it, so a replay
    /// after that checkpoint must not bring it back.
    pub fn covered_through(&self) -> u64 {
        if self.failed {
            self.next_seq
        } else {
            self.next_seq - 1
        }
    }

    /// Pages not yet used in this cycle.
    pub fn free_pages(&self) -> u64 {
        self.pages - self.next_page
    }

    /// The log's file (for messages).
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
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

    fn flip(path: &Path, at: u64) {
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
        wal.restart();
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

    #[test]
    fn a_log_of_another_store_or_size_is_replaced() {
        let tmp = temp("other");
        let dir = tmp.path().to_path_buf();
        let path = dir.join("log");
        let (mut wal, _) = Wal::open(&path, 7, 8, 0).expect("open");
        wal.append(&payload(10, 1)).expect("append");
        drop(wal);
        let (_, got) = Wal::open(&path, 8, 8, 0).expect("other store");
        assert!(got.is_empty(), "records of store 7 must not reach store 8");
        let (mut wal, _) = Wal::open(&path, 8, 8, 0).expect("reopen");
        wal.append(&payload(10, 1)).expect("append");
        drop(wal);
        let (_, got) = Wal::open(&path, 8, 16, 0).expect("other size");
        assert!(got.is_empty());
        assert_eq!(
            std::fs::metadata(&path).expect("stat").len(),
            16 * PAGE,
            "recreated at the new size"
        );
    }
}
