//! The durable store: every allocation the agent has acknowledged, and the
//! generation high-water mark, in an embedded crash-safe database (redb)
//! with a write-ahead log in front of it.
//!
//! Why redb: it is pure Rust, embedded (no server to run on a node), commits
//! with copy-on-write B-trees and a checksummed double-buffered header, and a
//! durable commit returns only after `fsync`. How it is committed so that a
//! crash during the recovery from a crash cannot roll a commit back is in
//! [`db`].
//!
//! Why a log in front of it ([`wal`]): a redb commit writes every page on the
//! changed paths and syncs them, six scattered pages for one CNI ADD; a
//! record in a preallocated log is one page and one `fdatasync`, half the
//! time on the project VM, on a path (a CNI call) whose whole budget is a
//! fraction of a millisecond. Every write method builds a list of operations
//! ([`codec::Op`]), appends it to the log as one record and returns once the
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
mod wal;

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

/// How an endpoint was set up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EndpointMode {
    /// lockstep made the interfaces (plugin type `lockstep`).
    Full,
    /// Addresses only (`lockstep-ipam` under another plugin).
    Ipam,
}

/// An endpoint the CNI plugin attached: what DEL, CHECK, GC and reconcile
/// need to find its interfaces and program its map entries.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointRecord {
    /// `CNI_CONTAINERID`.
    pub container_id: String,
    /// `CNI_IFNAME`.
    pub ifname: String,
    /// `CNI_NETNS` at ADD.
    pub netns: PathBuf,
    /// Full or IPAM-only.
    pub mode: EndpointMode,
    /// The pool its addresses came from.
    pub pool: String,
    /// Its addresses.
    pub addresses: Vec<std::net::IpAddr>,
    /// Host-side interface (full mode).
    pub host_ifname: Option<String>,
    /// Host-side interface index (full mode).
    pub host_ifindex: u32,
    /// MAC of the host-side interface.
    pub host_mac: [u8; 6],
    /// MAC of the interface inside the container.
    pub mac: [u8; 6],
    /// DEL was acknowledged (map entries removed) but the host veth is not
    /// yet confirmed gone: the addresses stay held until it is, and a start
    /// finishes the release (`agent::reaper`). Written only when true, so
    /// other records read as before.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub releasing: bool,
}

impl EndpointRecord {
    /// The record key.
    pub fn key(&self) -> String {
        endpoint_key(&self.container_id, &self.ifname)
    }
}

/// The record key of an endpoint (or delegated attachment): the core's
/// [`attachment_key`](lockstep_core::owner::attachment_key), which no two
/// attachments share. Records stored under the ambiguous key of earlier
/// versions move on [`Store::load`].
pub fn endpoint_key(container_id: &str, ifname: &str) -> String {
    lockstep_core::owner::attachment_key(container_id, ifname)
}

/// An attachment whose addresses an external CNI IPAM plugin holds
/// (delegated mode): what CHECK, DEL and reconcile need, and the config it
/// was made under so a changed plugin config is noticed.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DelegatedRecord {
    /// Who holds it: an agent role or a delegated endpoint.
    pub owner: lockstep_core::owner::Owner,
    /// `CNI_CONTAINERID` given to the plugin.
    pub container_id: String,
    /// `CNI_IFNAME` given to the plugin.
    pub ifname: String,
    /// `CNI_NETNS` given to the plugin.
    pub netns: PathBuf,
    /// The plugin's `type`.
    pub plugin: String,
    /// Hash of the network config the plugin was run with.
    pub config_hash: String,
    /// The `cniVersion` it was run with.
    pub cni_version: String,
    /// The plugin's ADD result, as printed (the `prevResult` of CHECK/DEL).
    pub result: serde_json::Value,
    /// The addresses in that result.
    pub addresses: Vec<std::net::IpAddr>,
    /// Which holding this is (from the store's generation counter).
    pub generation: Generation,
}

impl DelegatedRecord {
    /// The record key.
    pub fn key(&self) -> String {
        endpoint_key(&self.container_id, &self.ifname)
    }
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

    /// Commits `ops`: one log record, on disk when this returns.
    fn commit(&self, ops: Vec<Op>) -> Result<(), StoreError> {
        let mut inner = self.lock();
        if inner.failing() {
            inner.checkpoint(&self.path, &[])?;
        }
        let payload = encode(&ops);
        match inner.wal.append(&payload) {
            Ok(_) => {}
            Err(wal::WalError::Full) => {
                inner.checkpoint(&self.path, &[])?;
                inner.append(&payload)?;
            }
            Err(wal::WalError::TooBig { .. }) => return inner.checkpoint(&self.path, &ops),
            Err(e) => return Err(inner.failed(StoreError::Log(e))),
        }
        inner.pending.extend(ops);
        if inner.wal.free_pages() < inner.checkpoint_below
            && let Err(e) = inner.checkpoint(&self.path, &[])
        {
            // The commit itself is durable in the log; the checkpoint is
            // retried by the next commit, which refuses until it succeeds.
            tracing::warn!(error = %chain(&e), "store checkpoint failed");
        }
        Ok(())
    }

    /// Everything stored (after a checkpoint, so redb holds it all).
    ///
    /// # Errors
    /// The store is failing and does not recover, the checkpoint or a read
    /// failed, or a record is corrupt.
    pub fn load(&self) -> Result<Stored, StoreError> {
        let mut inner = self.lock();
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

    /// Durably records `a` and raises the generation high-water mark; returns
    /// after fsync.
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
        if let Err(e) = self.checkpoint() {
            tracing::warn!(error = %chain(&e), "store checkpoint at shutdown failed");
        }
    }
}

#[cfg(test)]
mod tests {
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
            self.lock().pending.clear();
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
}
