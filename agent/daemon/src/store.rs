//! The durable store: every allocation the agent has acknowledged, and the
//! generation high-water mark, in an embedded crash-safe database (redb)
//! with a write-ahead log in front of it.
//!
//! Why redb: it is pure Rust, embedded (no server to run on a node), commits
//! with copy-on-write B-trees and a checksummed double-buffered header, and a
//! durable commit returns only after `fsync`. How it is committed so that a
//! crash during the recovery from a crash cannot roll a commit back is in
//! `db`.
//!
//! Why a log in front of it (`wal`): a redb commit writes every page on the
//! changed paths and syncs them, six scattered pages for one CNI ADD; a
//! record in a preallocated log is one page and one `fdatasync`, half the
//! time on the project VM, on a path (a CNI call) whose whole budget is a
//! fraction of a millisecond. Every write method builds a list of operations
//! (`codec::Op`), appends it to the log as one record and returns once the
//! record is on disk: that is the commit, and the agent's ordering (commit →
//! program maps → acknowledge) is unchanged. The operations are applied to
//! redb later, many records in one durable redb transaction (a
//! *checkpoint*): when the log is half full, before [`Store::load`], when
//! the store is dropped, and on open, after replaying what the log holds
//! beyond redb's last checkpoint (redb stores that sequence number in the
//! same transaction, so replay is exact). A record too large for the log (a
//! huge LoadBalancer snapshot) is written straight to redb after a
//! checkpoint. The commit that finds the log half full pays for the
//! checkpoint: ~1.4 ms for ~500 commits on the project VM, once per ~500
//! commits. `docs/store.md` gives the whole crash-safety argument: what is
//! durable at each step of a commit, a checkpoint and a start-up.
//!
//! Commits can share a record (a *commit group*, [`Store::open_group`]):
//! the agent's owner opens one around each batch of commands, so a batch
//! of CNI ADDs costs one write and one `fdatasync` in all, and answers its
//! callers only after [`Store::close_group`] returned. One record per group
//! keeps the log's rule that records are whole and consecutive: a cut
//! leaves the whole group or none of it. When the group's write or sync
//! fails, none of its commits is durable and every one is refused; the
//! owner then stops the agent (see `agent::handle`), since the commands
//! changed memory that only a start from the store can take back.
//!
//! A failed write or sync (a full disk, an I/O error) does not wedge the
//! store until a restart: it remembers the first cause, refuses commits
//! while it lasts ([`Store::health`] says why, so the agent reports
//! not-ready), and every later commit, load or [`Store::recover`] tries to
//! recover: re-open redb if it failed, checkpoint every acknowledged
//! operation together with the failed record's number, and resume the log
//! after that number. A record whose append failed was never acknowledged;
//! once recovered it is never replayed.
//!
//! Domain state stays in plain structs (the core's [`Allocation`]); this module
//! only persists it. The database file holds a lock, so a second agent on the
//! same state directory is refused instead of corrupting it.

use std::fs::DirBuilder;
use std::os::unix::fs::DirBuilderExt as _;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};

use lockstep_core::cidr::Family;
use lockstep_core::manager::Allocation;
use lockstep_core::owner::Generation;
use redb::{Database, ReadableDatabase as _};

use crate::error_chain as chain;
use codec::{Op, Table, decode_ops, encode};

const LB_STATE: &str = "state";

/// File name of the database inside the state directory.
pub const DB_FILE: &str = "lockstep.redb";
/// File name of the write-ahead log inside the state directory.
pub const LOG_FILE: &str = "lockstep.wal";
/// Size of the log: 4 MiB, about a thousand single-page commits.
pub const LOG_PAGES: u64 = 1024;

mod codec;
mod db;
mod records;
mod wal;

pub use records::{DelegatedRecord, EndpointMode, EndpointRecord, endpoint_key};

/// Errors of the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The state directory could not be created or synced.
    #[error("cannot create state directory {path}")]
    Dir {
        /// The directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Another process holds the database.
    #[error(
        "the store {path} is held by another process (is another agent running on this state directory?)"
    )]
    Locked {
        /// The database file.
        path: PathBuf,
    },
    /// A store file could not be opened or created (a symlink planted at
    /// its path is refused: `O_NOFOLLOW`).
    #[error("cannot open the store file {path}")]
    File {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The state directory is not one only root can change.
    #[error("refusing the state directory {path}: {reason}")]
    UnsafeDir {
        /// The directory.
        path: PathBuf,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// There is no database to act on.
    #[error("there is no store at {path}")]
    NoStore {
        /// The database file looked for.
        path: PathBuf,
    },
    /// The database could not be opened or repaired.
    #[error("cannot open the store {path}; it is left as it is (see docs/store.md, \"Recovery\")")]
    Open {
        /// The database file.
        path: PathBuf,
        /// redb's error.
        #[source]
        source: Box<redb::DatabaseError>,
    },
    /// The storage library panicked; the panic was caught.
    #[error(
        "the storage library panicked during {action} of {path}: {message}; the store is left as it is (see docs/store.md, \"Recovery\")"
    )]
    Panicked {
        /// The database file.
        path: PathBuf,
        /// What was being done.
        action: &'static str,
        /// The panic's message.
        message: String,
    },
    /// A transaction failed.
    #[error("store {action} failed")]
    Db {
        /// What was being done.
        action: &'static str,
        /// redb's error.
        #[source]
        source: Box<redb::Error>,
    },
    /// The write-ahead log failed.
    #[error(transparent)]
    Log(#[from] wal::WalError),
    /// A log record whose checksum matched does not decode: written by
    /// another version, or damaged in a way the checksum did not catch.
    #[error("store log record {seq} does not decode: {reason}")]
    LogRecord {
        /// Its sequence number.
        seq: u64,
        /// What is wrong.
        reason: &'static str,
    },
    /// The store failed earlier and recovering from it failed again.
    #[error("the store cannot commit since: {cause}; recovering failed")]
    Failing {
        /// The first failure.
        cause: String,
        /// Why recovering failed this time.
        #[source]
        source: Box<StoreError>,
    },
    /// A commit group's shared sync failed: every commit of the group is
    /// refused, and so is every commit until the group is closed (the
    /// agent then stops, and starts again from what is durable).
    #[error(
        "the store's shared sync failed ({cause}); this commit and every commit of its group are refused"
    )]
    GroupFailed {
        /// Why the group's record could not be written or synced.
        cause: String,
    },
    /// No random store identity could be drawn.
    #[error("cannot draw a store identity")]
    Random(#[source] getrandom::Error),
    /// A stored record does not decode.
    #[error("stored allocation {key} does not decode")]
    Corrupt {
        /// The record's key.
        key: String,
        /// The decode error.
        #[source]
        source: serde_json::Error,
    },
}

impl StoreError {
    /// Whether this error leaves the store unopenable until an operator
    /// acts (as opposed to a passing failure of one commit).
    pub fn needs_operator(&self) -> bool {
        matches!(
            self,
            StoreError::Open { .. }
                | StoreError::Panicked { .. }
                | StoreError::LogRecord { .. }
                | StoreError::Corrupt { .. }
                | StoreError::Log(
                    wal::WalError::Damaged { .. }
                        | wal::WalError::Header { .. }
                        | wal::WalError::Foreign { .. }
                        | wal::WalError::Missing { .. }
                        | wal::WalError::Behind { .. }
                )
        )
    }
}

/// Decodes one stored JSON record, naming its key when it is corrupt.
fn decode<T: serde::de::DeserializeOwned>(key: &str, bytes: &[u8]) -> Result<T, StoreError> {
    serde_json::from_slice(bytes).map_err(|source| StoreError::Corrupt {
        key: key.to_string(),
        source,
    })
}

/// What the store holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stored {
    /// Highest generation ever handed out.
    pub generation: Generation,
    /// Every live allocation.
    pub allocations: Vec<Allocation>,
    /// Every attached endpoint.
    pub endpoints: Vec<EndpointRecord>,
    /// The LoadBalancer IPAM state, if any was ever stored.
    pub lb: Option<lockstep_core::lb::LbSnapshot>,
    /// Attachments held by an external IPAM plugin (delegated mode).
    pub delegated: Vec<DelegatedRecord>,
}

/// The store.
pub struct Store {
    path: PathBuf,
    /// The database's random identity (also in the log's header).
    id: u64,
    inner: Mutex<Inner>,
}

/// What the store's lock guards: the database, the log, and the operations
/// the log holds that the database does not have yet.
struct Inner {
    /// `None` after the database failed, until it is opened again.
    db: Option<Database>,
    wal: wal::Wal,
    pending: Vec<Op>,
    /// A commit that leaves fewer free pages than this checkpoints.
    checkpoint_below: u64,
    /// Why the store cannot commit: the first failure, until a recovery
    /// succeeds.
    failure: Option<String>,
    /// The open commit group ([`Store::open_group`]), if any.
    group: Option<Group>,
    counts: StoreCounts,
}

/// What the store has done since it was opened, for the metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreCounts {
    /// Commits accepted (each write method's call).
    pub commits: u64,
    /// Log records written and synced: one `fdatasync` each, one per
    /// commit outside a group, one per group inside.
    pub log_syncs: u64,
}

/// Commits that share one log record and one sync: their operations are
/// held here, in order, until the group is closed (or must be written
/// early to make room).
#[derive(Default)]
struct Group {
    /// The group's record so far (the encodings of its commits, which
    /// concatenate).
    payload: Vec<u8>,
    /// The same operations, decoded, for `pending` once they are durable.
    ops: Vec<Op>,
    /// Commits that wait for the group's record.
    commits: u64,
    /// Why the group's record could not be written or synced: every
    /// commit of the group is refused.
    failed: Option<String>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("path", &self.path).finish()
    }
}

/// The database in `slot`, opened again if it failed (a free function so
/// the caller can borrow the other fields of [`Inner`] beside it).
fn reopened<'a>(slot: &'a mut Option<Database>, path: &Path) -> Result<&'a Database, StoreError> {
    if slot.is_none() {
        *slot = Some(db::open(path)?);
        tracing::info!(path = %path.display(), "store database re-opened");
    }
    Ok(slot.as_ref().expect("just opened"))
}

impl Inner {
    /// The database, opened again if it failed.
    fn db(&mut self, path: &Path) -> Result<&Database, StoreError> {
        reopened(&mut self.db, path)
    }

    /// Remembers the first cause of a failure and returns the error.
    fn failed(&mut self, e: StoreError) -> StoreError {
        if self.failure.is_none() {
            let cause = chain(&e);
            tracing::error!(error = %cause, "the store cannot commit; retrying on the next request");
            self.failure = Some(cause);
        }
        e
    }

    /// Whether a checkpoint must run although nothing is pending: after a
    /// failure, to record the failed record's number and resume the log.
    fn failing(&self) -> bool {
        self.failure.is_some() || self.wal.failed() || self.db.is_none()
    }

    /// One durable redb transaction: the pending operations, then `extra`
    /// (a record too large for the log), and the log's sequence number; then
    /// the log starts again (after a failed record's number, if one failed).
    /// On success a failure is over; on failure the database is dropped, to
    /// be opened again by the next attempt (redb refuses every transaction
    /// after an I/O error until it is).
    fn checkpoint(&mut self, path: &Path, extra: &[Op]) -> Result<(), StoreError> {
        if self.pending.is_empty() && extra.is_empty() && !self.failing() {
            return Ok(());
        }
        let covered = self.wal.covered_through();
        let applied = reopened(&mut self.db, path)
            .and_then(|db| db::apply(db, path, self.pending.iter().chain(extra), covered));
        if let Err(e) = applied {
            self.db = None;
            return Err(match self.failure.clone() {
                Some(cause) => StoreError::Failing {
                    cause,
                    source: Box::new(e),
                },
                None => self.failed(e),
            });
        }
        self.pending.clear();
        self.wal.recover();
        if let Some(cause) = self.failure.take() {
            tracing::info!(cause = %cause, "the store recovered");
        }
        Ok(())
    }

    /// Writes the open group's record and syncs it: its commits are durable
    /// when this returns `Ok`. When the write or sync fails, none of them
    /// is: their operations never reach `pending` (so no checkpoint applies
    /// them), the log covers the record's number at its recovery (so no
    /// replay brings it back), and the group is failed.
    fn flush_group(&mut self, path: &Path) -> Result<(), StoreError> {
        let Some(group) = self.group.as_mut() else {
            return Ok(());
        };
        if let Some(cause) = &group.failed {
            return Err(StoreError::GroupFailed {
                cause: cause.clone(),
            });
        }
        if group.commits == 0 {
            return Ok(());
        }
        let payload = std::mem::take(&mut group.payload);
        let ops = std::mem::take(&mut group.ops);
        group.commits = 0;
        if let Err(e) = self.wal.append(&payload) {
            let e = self.failed(StoreError::Log(e));
            if let Some(group) = self.group.as_mut() {
                group.failed = Some(chain(&e));
            }
            return Err(e);
        }
        self.pending.extend(ops);
        self.after_append(path);
        Ok(())
    }

    /// After a record reached the log: a checkpoint when the log is half
    /// full. A failed one is retried by the next commit, which refuses
    /// until it succeeds; the record itself is durable.
    fn after_append(&mut self, path: &Path) {
        self.counts.log_syncs += 1;
        if self.wal.free_pages() < self.checkpoint_below
            && let Err(e) = self.checkpoint(path, &[])
        {
            tracing::warn!(error = %chain(&e), "store checkpoint failed");
        }
    }

    /// Adds one commit to the open group. Refused (nothing held) while the
    /// store is failing and does not recover, when the group failed, or
    /// when making room fails; a record the log cannot hold at all goes
    /// straight to redb after the group's record, as outside a group.
    fn join_group(&mut self, path: &Path, ops: Vec<Op>) -> Result<(), StoreError> {
        if let Some(cause) = self.group.as_ref().and_then(|g| g.failed.clone()) {
            return Err(StoreError::GroupFailed { cause });
        }
        if self.failing() {
            self.flush_group(path)?;
            self.checkpoint(path, &[])?;
        }
        let payload = encode(&ops);
        let held = self.group.as_ref().map_or(0, |g| g.payload.len());
        if self.wal.room(held + payload.len()).is_err() {
            // What the group holds goes first, then this commit alone.
            self.flush_group(path)?;
            match self.wal.room(payload.len()) {
                Ok(_) => {}
                Err(wal::WalError::TooBig { .. }) => return self.checkpoint(path, &ops),
                Err(_) => self.checkpoint(path, &[])?,
            }
        }
        let group = self.group.get_or_insert_with(Group::default);
        group.payload.extend_from_slice(&payload);
        group.ops.extend(ops);
        group.commits += 1;
        Ok(())
    }

    /// One commit outside a group: its own record, synced.
    fn commit_one(&mut self, path: &Path, ops: Vec<Op>) -> Result<(), StoreError> {
        if self.failing() {
            self.checkpoint(path, &[])?;
        }
        let payload = encode(&ops);
        match self.wal.append(&payload) {
            Ok(_) => {}
            Err(wal::WalError::Full) => {
                self.checkpoint(path, &[])?;
                self.append(&payload)?;
            }
            Err(wal::WalError::TooBig { .. }) => return self.checkpoint(path, &ops),
            Err(e) => return Err(self.failed(StoreError::Log(e))),
        }
        self.pending.extend(ops);
        self.after_append(path);
        Ok(())
    }

    /// Appends one record, remembering a failure.
    fn append(&mut self, payload: &[u8]) -> Result<(), StoreError> {
        match self.wal.append(payload) {
            Ok(_) => Ok(()),
            Err(e) => Err(self.failed(StoreError::Log(e))),
        }
    }
}

fn to_json<T: serde::Serialize>(
    key: impl FnOnce() -> String,
    v: &T,
) -> Result<Vec<u8>, StoreError> {
    serde_json::to_vec(v).map_err(|source| StoreError::Corrupt { key: key(), source })
}

/// The record key of an allocation: one per (pool, family, owner), matching
/// the core's idempotency rule.
pub fn key_of(a: &Allocation) -> String {
    let family = match a.family() {
        Family::V4 => "4",
        Family::V6 => "6",
    };
    let owner = serde_json::to_string(&a.owner).unwrap_or_else(|_| a.owner.to_string());
    format!("{}\u{1f}{family}\u{1f}{owner}", a.pool)
}

/// The effective user the agent runs as.
fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Creates the state directory (mode 0700) if it is missing, and makes its
/// name durable by syncing its parent, so a power cut right after the first
/// commits cannot take the whole directory. An existing one must be a real
/// directory (not a symlink) that only its owner — this user — may write to:
/// the store's files name every pod on the node and decide which addresses
/// are free. The agent calls it before anything writes into the directory.
///
/// # Errors
/// The directory is unsafe ([`StoreError::UnsafeDir`]) or cannot be made.
pub fn prepare_state_dir(dir: &Path) -> Result<(), StoreError> {
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
    let err = |source| StoreError::Dir {
        path: dir.to_path_buf(),
        source,
    };
    let unsafe_dir = |reason| StoreError::UnsafeDir {
        path: dir.to_path_buf(),
        reason,
    };
    match std::fs::symlink_metadata(dir) {
        Ok(meta) if meta.file_type().is_symlink() => {
            return Err(unsafe_dir("it is a symbolic link (give the real path)"));
        }
        Ok(meta) if !meta.is_dir() => return Err(unsafe_dir("it is not a directory")),
        Ok(meta) if meta.permissions().mode() & 0o022 != 0 => {
            return Err(unsafe_dir(
                "group or others may write to it (chmod 0700 it)",
            ));
        }
        Ok(meta) if meta.uid() != effective_uid() => {
            return Err(unsafe_dir("another user owns it"));
        }
        Ok(_) => return Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(err(e)),
    }
    DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(err)?;
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::File::open(parent)
            .and_then(|f| f.sync_all())
            .map_err(err)?;
    }
    Ok(())
}

impl Store {
    /// Opens (or creates) the store in `dir`, replays its log into the
    /// database and checkpoints.
    ///
    /// # Errors
    /// The directory, database or log cannot be created or opened, the log
    /// is damaged or does not belong to the database, or a log record does
    /// not decode. Nothing is replaced or discarded in any of these cases:
    /// the files stay as they were for the operator (`docs/store.md`).
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        Self::open_with(dir, LOG_PAGES, LOG_PAGES / 2)
    }

    fn open_with(dir: &Path, log_pages: u64, checkpoint_below: u64) -> Result<Self, StoreError> {
        prepare_state_dir(dir)?;
        let path = dir.join(DB_FILE);
        let database = db::open(&path)?;
        let (store_id, log_seq) = db::identity(&database, &path)?;
        let (wal, records) = wal::Wal::open(&dir.join(LOG_FILE), store_id, log_pages, log_seq)?;
        let mut pending = Vec::new();
        for r in &records {
            pending.extend(decode_ops(r.seq, &r.payload)?);
        }
        if !records.is_empty() {
            tracing::info!(records = records.len(), "replaying the store log");
        }
        let store = Self {
            path,
            id: store_id,
            inner: Mutex::new(Inner {
                db: Some(database),
                wal,
                pending,
                checkpoint_below,
                failure: None,
                group: None,
                counts: StoreCounts::default(),
            }),
        };
        {
            let mut inner = store.lock();
            inner.checkpoint(&store.path, &[])?;
            // Only now, with every record in the database, may a log of
            // another size be replaced.
            inner.wal.resize()?;
        }
        Ok(store)
    }

    /// The operator's way out of a log the store refuses (damaged, of
    /// another store, or missing): with the agent stopped, moves the log at
    /// `dir` aside (kept, named `lockstep.wal.discarded-<unix seconds>`) and
    /// starts a new, empty one for the database. Whatever the old log held
    /// beyond the database's last checkpoint is not applied. Returns where
    /// the old log went (`None` when there was none) and the last record the
    /// database has.
    ///
    /// # Errors
    /// The database cannot be opened (held by a running agent, damaged), or
    /// the files cannot be moved or written.
    pub fn reset_log(dir: &Path) -> Result<(Option<PathBuf>, u64), StoreError> {
        let path = dir.join(DB_FILE);
        if !path.exists() {
            return Err(StoreError::NoStore { path });
        }
        let database = db::open(&path)?;
        let (store_id, log_seq) = db::identity(&database, &path)?;
        let log = dir.join(LOG_FILE);
        let moved = if log.exists() {
            let secs = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            let aside = dir.join(format!("{LOG_FILE}.discarded-{secs}"));
            std::fs::rename(&log, &aside).map_err(|source| StoreError::Dir {
                path: aside.clone(),
                source,
            })?;
            Some(aside)
        } else {
            None
        };
        wal::Wal::create(&log, store_id, LOG_PAGES)?;
        Ok((moved, log_seq))
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The store's identity: drawn at random when the database is created,
    /// kept for its life (a log reset keeps it), so it tells this store from
    /// any other, a copy's replacement included. The agent claims its pin
    /// root under it (`datapath::owner`).
    pub fn id(&self) -> u64 {
        self.id
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Why the store cannot commit now, if it cannot: the first failure's
    /// cause, until a recovery succeeds.
    pub fn health(&self) -> Option<String> {
        let inner = self.lock();
        inner.failure.clone().or_else(|| {
            inner
                .wal
                .failed()
                .then(|| "the store log failed".to_string())
        })
    }

    /// Applies what the log holds beyond redb to redb, durably, and starts
    /// the log again; after a failure this is the recovery.
    ///
    /// # Errors
    /// The redb transaction failed; the log keeps the records.
    pub fn checkpoint(&self) -> Result<(), StoreError> {
        self.lock().checkpoint(&self.path, &[])
    }

    /// Tries to recover from a failure (see the module docs); nothing to do
    /// when the store is healthy.
    ///
    /// # Errors
    /// It is still failing.
    pub fn recover(&self) -> Result<(), StoreError> {
        let mut inner = self.lock();
        if inner.failing() {
            inner.checkpoint(&self.path, &[])?;
        }
        Ok(())
    }

    /// Opens a commit group: until [`Store::close_group`], every commit
    /// joins one log record, written and synced once, when the group is
    /// closed (or earlier, when the log needs the room). A commit in a group
    /// is durable only once `close_group` returned `Ok`; its caller must
    /// not be answered before. Opening an open group does nothing.
    pub fn open_group(&self) {
        let mut inner = self.lock();
        if inner.group.is_none() {
            inner.group = Some(Group::default());
        }
    }

    /// Closes the open group: writes and syncs its record. `Ok` means every
    /// commit of the group is durable.
    ///
    /// # Errors
    /// The record could not be written or synced, now or when it was
    /// written early ([`StoreError::GroupFailed`] then): *none* of the
    /// group's commits is durable, and none will be applied or replayed,
    /// but what the callers changed in memory after their commits is
    /// still there. Nothing can take that back but starting again from the
    /// store, so the caller must stop serving (the agent's owner ends);
    /// [`Store::recover`] first makes sure no replay brings the group back.
    pub fn close_group(&self) -> Result<(), StoreError> {
        let mut inner = self.lock();
        let flushed = inner.flush_group(&self.path);
        inner.group = None;
        flushed
    }

    /// Commits `ops`: one log record, on disk when this returns; inside a
    /// group ([`Store::open_group`]), when the group is closed.
    fn commit(&self, ops: Vec<Op>) -> Result<(), StoreError> {
        let mut inner = self.lock();
        let committed = if inner.group.is_some() {
            inner.join_group(&self.path, ops)
        } else {
            inner.commit_one(&self.path, ops)
        };
        if committed.is_ok() {
            inner.counts.commits += 1;
        }
        committed
    }

    /// What the store has done since it was opened.
    pub fn counts(&self) -> StoreCounts {
        self.lock().counts
    }

    /// Everything stored (after a checkpoint, so redb holds it all).
    ///
    /// # Errors
    /// The store is failing and does not recover, the checkpoint or a read
    /// failed, or a record is corrupt.
    pub fn load(&self) -> Result<Stored, StoreError> {
        let mut inner = self.lock();
        inner.flush_group(&self.path)?;
        inner.checkpoint(&self.path, &[])?;
        let txn = inner
            .db(&self.path)?
            .begin_read()
            .map_err(db::db_err("begin read"))?;
        let (generation, lb) = db::read_meta(&txn)?;
        let stored = Stored {
            generation: Generation(generation),
            allocations: db::read_all(&txn, db::ALLOCATIONS)?,
            endpoints: db::read_all(&txn, db::ENDPOINTS)?,
            lb: lb.map(|v| decode(LB_STATE, &v)).transpose()?,
            delegated: db::read_all(&txn, db::DELEGATED)?,
        };
        drop(txn);
        drop(inner);
        let moves = codec::key_moves(&stored.endpoints, &stored.delegated)?;
        if !moves.is_empty() {
            self.commit(moves)?;
            tracing::info!("attachment records moved to unambiguous keys");
        }
        Ok(stored)
    }

    /// Durably records `a` and raises the generation high-water mark:
    /// durable when this returns, or, inside a commit group, once the group
    /// is closed (as every write method here).
    ///
    /// # Errors
    /// The commit failed; nothing was written.
    pub fn put(&self, a: &Allocation, high_water: Generation) -> Result<(), StoreError> {
        self.put_many(std::slice::from_ref(a), high_water)
    }

    /// Durably records several allocations in one commit.
    ///
    /// # Errors
    /// The commit failed; nothing was written.
    pub fn put_many(&self, all: &[Allocation], high_water: Generation) -> Result<(), StoreError> {
        self.put_endpoint(None, all, high_water)
    }

    /// Durably records an endpoint and its allocations in one commit.
    ///
    /// # Errors
    /// The commit failed; nothing was written.
    pub fn put_endpoint(
        &self,
        endpoint: Option<&EndpointRecord>,
        all: &[Allocation],
        high_water: Generation,
    ) -> Result<(), StoreError> {
        let mut ops = Vec::with_capacity(all.len() + 2);
        if let Some(e) = endpoint {
            ops.push(Op::Put {
                table: Table::Endpoints,
                key: e.key(),
                value: to_json(|| e.key(), e)?,
            });
        }
        for a in all {
            ops.push(Op::Put {
                table: Table::Allocations,
                key: key_of(a),
                value: to_json(|| key_of(a), a)?,
            });
        }
        ops.push(Op::Generation(high_water.0));
        self.commit(ops)
    }

    /// Durably records a delegated attachment (and, for an endpoint, its
    /// endpoint record) in one commit, raising the generation high-water
    /// mark to the record's.
    ///
    /// # Errors
    /// The commit failed; nothing was written.
    pub fn put_delegated(
        &self,
        record: &DelegatedRecord,
        endpoint: Option<&EndpointRecord>,
    ) -> Result<(), StoreError> {
        let mut ops = vec![Op::Put {
            table: Table::Delegated,
            key: record.key(),
            value: to_json(|| record.key(), record)?,
        }];
        if let Some(e) = endpoint {
            ops.push(Op::Put {
                table: Table::Endpoints,
                key: e.key(),
                value: to_json(|| e.key(), e)?,
            });
        }
        ops.push(Op::Generation(record.generation.0));
        self.commit(ops)
    }

    /// Durably removes a delegated attachment and the endpoint record under
    /// the same key (if any); what is not there is skipped.
    ///
    /// # Errors
    /// The commit failed; nothing was removed.
    pub fn remove_delegated(&self, key: &str) -> Result<(), StoreError> {
        self.commit(vec![
            Op::Remove {
                table: Table::Delegated,
                key: key.to_string(),
            },
            Op::Remove {
                table: Table::Endpoints,
                key: key.to_string(),
            },
        ])
    }

    /// Durably replaces the LoadBalancer IPAM state.
    ///
    /// # Errors
    /// The commit failed; the old state stays.
    pub fn put_lb(&self, state: &lockstep_core::lb::LbSnapshot) -> Result<(), StoreError> {
        self.commit(vec![Op::Put {
            table: Table::Lb,
            key: LB_STATE.into(),
            value: to_json(|| LB_STATE.into(), state)?,
        }])
    }

    /// Durably removes `a`; removing what is not there is not an error.
    ///
    /// # Errors
    /// The commit failed; nothing was removed.
    pub fn remove(&self, a: &Allocation) -> Result<(), StoreError> {
        self.remove_endpoint(None, std::slice::from_ref(a))
    }

    /// Durably removes an endpoint record (by key) and allocations in one
    /// commit; what is not there is skipped.
    ///
    /// # Errors
    /// The commit failed; nothing was removed.
    pub fn remove_endpoint(
        &self,
        endpoint_key: Option<&str>,
        all: &[Allocation],
    ) -> Result<(), StoreError> {
        let mut ops: Vec<Op> = all
            .iter()
            .map(|a| Op::Remove {
                table: Table::Allocations,
                key: key_of(a),
            })
            .collect();
        if let Some(k) = endpoint_key {
            ops.push(Op::Remove {
                table: Table::Endpoints,
                key: k.to_string(),
            });
        }
        if ops.is_empty() {
            return Ok(());
        }
        self.commit(ops)
    }
}

impl Drop for Store {
    /// A clean shutdown leaves redb complete (a restart then replays
    /// nothing); a failure here only means the next open replays the log.
    fn drop(&mut self) {
        if let Err(e) = self.close_group() {
            tracing::error!(error = %chain(&e), "the store's open commit group failed at shutdown");
        }
        if let Err(e) = self.checkpoint() {
            tracing::warn!(error = %chain(&e), "store checkpoint at shutdown failed");
        }
    }
}

#[cfg(test)]
mod tests;
