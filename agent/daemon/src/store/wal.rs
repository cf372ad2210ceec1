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
//! so a log is never replayed into a database it was not written for). A log
//! is created whole under a temporary name and renamed into place, so the
//! file at the log's path is always complete: a header that does not check
//! out, or names another store, is damage or a mix-up, and the log refuses
//! to open rather than start a new one over commits it may hold. A log of
//! another size than asked is opened at its own size, replayed, and only
//! replaced by one of the new size ([`Wal::resize`]) after the store has
//! checkpointed what it held. Every record starts on a page boundary:
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
//! lower). After a checkpoint the store calls [`Wal::recover`]: the next
//! record goes to page 1 again, with the next sequence number, and redb holds
//! the last checkpointed sequence number, so replay skips what it already
//! has. A valid record on the first page with a *later* number than the
//! database expects means the database lost a checkpoint the log relied on;
//! that is refused too. A failed write or sync leaves the log in an unknown
//! state (the page cache may be marked clean without the data reaching the
//! disk), so the log refuses every later append until the store has
//! checkpointed everything acknowledged *and* the failed record's number
//! ([`Wal::covered_through`]) and calls [`Wal::recover`]: the failed record
//! is then never replayed, whatever reached the disk of it.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt as _, OpenOptionsExt as _, PermissionsExt as _};
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
    /// An earlier write or sync failed; nothing more is written until the
    /// store recovers ([`Wal::recover`]).
    #[error("the store log failed earlier and has not recovered yet")]
    Failed,
    /// The header page does not check out: damage, or not a lockstep log.
    #[error(
        "store log {path} has a damaged header ({reason}); refusing to open it, since it may hold acknowledged commits (see docs/store.md, \"Recovery\")"
    )]
    Header {
        /// The log file.
        path: PathBuf,
        /// What is wrong.
        reason: &'static str,
    },
    /// The log was written for another database.
    #[error(
        "store log {path} belongs to store {found:#018x}, not to this database ({expected:#018x}); refusing to replay or overwrite it (see docs/store.md, \"Recovery\")"
    )]
    Foreign {
        /// The log file.
        path: PathBuf,
        /// The identity in the log's header.
        found: u64,
        /// The database's identity.
        expected: u64,
    },
    /// The log is missing although the database has checkpointed from one.
    #[error(
        "store log {path} is missing, but the database has applied records from it up to {after}; commits after that may be lost with it (see docs/store.md, \"Recovery\")"
    )]
    Missing {
        /// The log file.
        path: PathBuf,
        /// The database's last applied record.
        after: u64,
    },
    /// The first record of the log is newer than the database expects: the
    /// database lost a checkpoint the log was restarted after.
    #[error(
        "store log {path} starts at record {found}, but the database has applied records only up to {after}: the database lost a checkpoint; refusing to drop the records in between (see docs/store.md, \"Recovery\")"
    )]
    Behind {
        /// The log file.
        path: PathBuf,
        /// The first record found.
        found: u64,
        /// The database's last applied record.
        after: u64,
    },
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
    store_id: u64,
    pages: u64,
    /// The size asked for, when the log on disk has another one.
    wanted_pages: u64,
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

/// What a header page says: (store identity, pages).
fn parse_header(page: &[u8]) -> Result<(u64, u64), &'static str> {
    if page.len() < 28 || &page[..8] != HEADER_MAGIC {
        return Err("no lockstep log magic");
    }
    let crc = u32::from_le_bytes(page[24..28].try_into().expect("4 bytes"));
    if crc32fast::hash(&page[..24]) != crc {
        return Err("checksum mismatch");
    }
    let pages = u64::from_le_bytes(page[8..16].try_into().expect("8 bytes"));
    let store_id = u64::from_le_bytes(page[16..24].try_into().expect("8 bytes"));
    if pages < 2 {
        return Err("fewer than two pages");
    }
    Ok((store_id, pages))
}

/// The temporary name a new log is written under before it is renamed
/// into place.
fn temp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".new");
    path.with_file_name(name)
}

/// Syncs the directory holding `path`, so a rename or creation in it is
/// durable.
fn sync_parent(path: &Path) -> std::io::Result<()> {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => File::open(dir)?.sync_all(),
        _ => File::open(".")?.sync_all(),
    }
}

/// Writes a complete log (header, zeros) under a temporary name, syncs it,
/// renames it to `path` and syncs the directory: the file at `path` is
/// never a partly written log. Later records overwrite allocated, written
/// blocks, so syncing them changes no file system metadata.
fn create_file(path: &Path, store_id: u64, pages: u64) -> std::io::Result<File> {
    let temp = temp_path(path);
    match std::fs::remove_file(&temp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&temp)?;
    file.write_all_at(&header(store_id, pages), 0)?;
    let zeros = vec![0u8; 256 * PAGE as usize];
    let mut at = PAGE;
    while at < pages * PAGE {
        let n = zeros.len().min((pages * PAGE - at) as usize);
        file.write_all_at(&zeros[..n], at)?;
        at += n as u64;
    }
    file.sync_all()?;
    std::fs::rename(&temp, path)?;
    sync_parent(path)?;
    Ok(file)
}

impl Wal {
    /// Opens the log at `path` for the store `store_id` and returns it with
    /// the records whose sequence numbers follow `after` (the database's
    /// last applied record), in order. The next append follows the last
    /// record returned. A missing log is created with `pages` pages when the
    /// database has never applied a record (`after == 0`); a log of another
    /// size is opened at its own size, and [`Wal::resize`] makes it `pages`
    /// once the store has checkpointed.
    ///
    /// # Errors
    /// The file cannot be read, created or synced; its header is damaged or
    /// names another store ([`WalError::Header`], [`WalError::Foreign`]); it
    /// is missing although `after > 0` ([`WalError::Missing`]); or its
    /// records are damaged or newer than `after` allows
    /// ([`WalError::Damaged`], [`WalError::Behind`]). Nothing is changed on
    /// disk in any of these cases.
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
        let existing = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path);
        let file = match existing {
            Ok(file) => {
                // A log made by an older version may be 0644.
                file.set_permissions(std::fs::Permissions::from_mode(0o600))
                    .map_err(io("chmod"))?;
                file
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if after > 0 {
                    return Err(WalError::Missing {
                        path: path.to_path_buf(),
                        after,
                    });
                }
                let file = create_file(path, store_id, pages).map_err(io("create"))?;
                let wal = Self {
                    file,
                    path: path.to_path_buf(),
                    store_id,
                    pages,
                    wanted_pages: pages,
                    next_page: 1,
                    next_seq: after + 1,
                    failed: false,
                };
                return Ok((wal, Vec::new()));
            }
            Err(e) => return Err(io("open")(e)),
        };
        let header_error = |reason| WalError::Header {
            path: path.to_path_buf(),
            reason,
        };
        let size = file.metadata().map_err(io("stat"))?.len();
        let mut page = vec![0u8; PAGE as usize];
        if size < PAGE {
            return Err(header_error("shorter than its header page"));
        }
        file.read_exact_at(&mut page, 0).map_err(io("read"))?;
        let (found_id, found_pages) = parse_header(&page).map_err(header_error)?;
        if found_id != store_id {
            return Err(WalError::Foreign {
                path: path.to_path_buf(),
                found: found_id,
                expected: store_id,
            });
        }
        if size != found_pages * PAGE {
            return Err(header_error(
                "file size differs from the size in its header",
            ));
        }
        let mut wal = Self {
            file,
            path: path.to_path_buf(),
            store_id,
            pages: found_pages,
            wanted_pages: pages,
            next_page: 1,
            next_seq: after + 1,
            failed: false,
        };
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
        if records.is_empty()
            && let Some(first) = record_at(1).filter(|r| r.seq > seq)
        {
            return Err(WalError::Behind {
                path: self.path.clone(),
                found: first.seq,
                after: seq - 1,
            });
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
        let pages = self.room(payload.len())?;
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

    /// Whether a record of `len` payload bytes can be appended now: the
    /// pages it takes, or why not, as [`Wal::append`] would refuse it
    /// (nothing is written).
    ///
    /// # Errors
    /// [`WalError::Failed`], [`WalError::TooBig`] or [`WalError::Full`].
    pub fn room(&self, len: usize) -> Result<u64, WalError> {
        if self.failed {
            return Err(WalError::Failed);
        }
        let pages = pages_for(len);
        if pages > self.pages - 1 || u32::try_from(len).is_err() {
            return Err(WalError::TooBig {
                len,
                pages: self.pages,
            });
        }
        if self.next_page + pages > self.pages {
            return Err(WalError::Full);
        }
        Ok(pages)
    }

    /// Makes the log behave as after a failed write or sync (for tests of
    /// the store's recovery).
    #[cfg(test)]
    pub fn fail_for_test(&mut self) {
        self.failed = true;
    }

    /// Writes a new, empty log at `path` (over whatever is there, which the
    /// caller has moved aside).
    ///
    /// # Errors
    /// It could not be written, synced or renamed into place.
    pub fn create(path: &Path, store_id: u64, pages: u64) -> Result<(), WalError> {
        create_file(path, store_id, pages)
            .map(drop)
            .map_err(|source| WalError::Io {
                path: path.to_path_buf(),
                action: "create",
                source,
            })
    }

    /// Whether an append failed since the last [`Wal::recover`].
    pub fn failed(&self) -> bool {
        self.failed
    }

    /// After a checkpoint covered the log through [`Wal::covered_through`]:
    /// the next record goes to the first page again, its sequence number
    /// going on, so what is left of this cycle is never replayed. After a
    /// failed append that number includes the failed record's, and appends
    /// resume after it: whatever of the failed record reached the disk is
    /// never replayed either.
    pub fn recover(&mut self) {
        if self.failed {
            self.next_seq += 1;
            self.failed = false;
        }
        self.next_page = 1;
    }

    /// Replaces a log of another size than asked with a new, empty one of
    /// the asked size, atomically. Only call it right after a checkpoint
    /// covered every record (the records it drops are all in the database).
    ///
    /// # Errors
    /// The new file could not be written, synced or renamed into place; the
    /// old log then stays as it was.
    pub fn resize(&mut self) -> Result<(), WalError> {
        if self.wanted_pages == self.pages {
            return Ok(());
        }
        let file = create_file(&self.path, self.store_id, self.wanted_pages).map_err(|source| {
            WalError::Io {
                path: self.path.clone(),
                action: "resize",
                source,
            }
        })?;
        tracing::info!(
            log = %self.path.display(),
            from = self.pages,
            to = self.wanted_pages,
            "store log resized after a checkpoint"
        );
        self.file = file;
        self.pages = self.wanted_pages;
        self.next_page = 1;
        Ok(())
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
}

#[cfg(test)]
pub(super) mod tests;
