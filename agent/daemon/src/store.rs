//! The durable store: every allocation the agent has acknowledged, and the
//! generation high-water mark, in an embedded crash-safe database (redb)
//! with a write-ahead log in front of it.
//!
//! Why redb: it is pure Rust, embedded (no server to run on a node), commits
//! with copy-on-write B-trees and a checksummed double-buffered header, and a
//! durable commit returns only after `fsync`. A `SIGKILL` at any instant
//! leaves either the old or the new state, never a torn one.
//!
//! Why a log in front of it ([`wal`]): a redb commit writes every page on the
//! changed paths and syncs them, six scattered pages for one CNI ADD; a
//! record in a preallocated log is one page and one `fdatasync`, half the
//! time on the project VM, on a path (a CNI call) whose whole budget is a
//! fraction of a millisecond. Every write method builds a list of operations
//! ([`Op`]), appends it to the log as one record and returns once the record
//! is on disk: that is the commit, and the agent's ordering (commit → program
//! maps → acknowledge) is unchanged. The operations are applied to redb
//! later, many records in one durable redb transaction (a *checkpoint*):
//! when the log is half full, before [`Store::load`], when the store is
//! dropped, and on open, after replaying what the log holds beyond redb's
//! last checkpoint (redb stores that sequence number in the same
//! transaction, so replay is exact). A record too large for the log (a huge
//! LoadBalancer snapshot) is written straight to redb after a checkpoint.
//! The commit that finds the log half full pays for the checkpoint: ~1.4 ms
//! for ~500 commits on the project VM, once per ~500 commits.
//!
//! Domain state stays in plain structs (the core's [`Allocation`]); this module
//! only persists it. The file holds a lock, so a second agent on the same state
//! directory is refused instead of corrupting it.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};

use lockstep_core::cidr::Family;
use lockstep_core::manager::Allocation;
use lockstep_core::owner::Generation;
use redb::{Database, ReadableTable, ReadableTableMetadata, TableDefinition};

const ALLOCATIONS: TableDefinition<&str, &[u8]> = TableDefinition::new("allocations");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const ENDPOINTS: TableDefinition<&str, &[u8]> = TableDefinition::new("endpoints");
const LB: TableDefinition<&str, &[u8]> = TableDefinition::new("lb");
/// Addresses held by an external CNI IPAM plugin (delegated mode), keyed like
/// endpoints: they are not the pool manager's, so they have their own table.
const DELEGATED: TableDefinition<&str, &[u8]> = TableDefinition::new("delegated");
const LB_STATE: &str = "state";
const GENERATION: &str = "generation";
/// Sequence number of the last log record applied to redb.
const LOG_SEQ: &str = "log_seq";
/// Identity of this database; the log carries it so that it is never
/// replayed into another one.
const STORE_ID: &str = "store_id";

/// File name of the database inside the state directory.
pub const DB_FILE: &str = "lockstep.redb";
/// File name of the write-ahead log inside the state directory.
pub const LOG_FILE: &str = "lockstep.wal";
/// Size of the log: 4 MiB, about a thousand single-page commits.
pub const LOG_PAGES: u64 = 1024;

mod wal;

/// Errors of the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The state directory could not be created.
    #[error("cannot create state directory {path}")]
    Dir {
        /// The directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The database could not be opened (held by another agent, corrupt, ...).
    #[error("cannot open the store {path} (is another agent running on this state directory?)")]
    Open {
        /// The database file.
        path: PathBuf,
        /// redb's error.
        #[source]
        source: Box<redb::DatabaseError>,
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

/// Decodes one stored JSON record, naming its key when it is corrupt.
fn decode<T: serde::de::DeserializeOwned>(key: &str, bytes: &[u8]) -> Result<T, StoreError> {
    serde_json::from_slice(bytes).map_err(|source| StoreError::Corrupt {
        key: key.to_string(),
        source,
    })
}

/// Every record of a JSON-valued table.
fn read_all<T: serde::de::DeserializeOwned>(
    txn: &redb::ReadTransaction,
    table: TableDefinition<&str, &[u8]>,
) -> Result<Vec<T>, StoreError> {
    let table = txn.open_table(table).map_err(db_err("open table"))?;
    let mut out = Vec::with_capacity(table.len().map_err(db_err("read"))? as usize);
    for item in table.iter().map_err(db_err("read"))? {
        let (k, v) = item.map_err(db_err("read"))?;
        out.push(decode(k.value(), v.value())?);
    }
    Ok(out)
}

fn db_err<E: Into<redb::Error>>(action: &'static str) -> impl FnOnce(E) -> StoreError {
    move |e| StoreError::Db {
        action,
        source: Box::new(e.into()),
    }
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
}

impl EndpointRecord {
    /// The record key.
    pub fn key(&self) -> String {
        endpoint_key(&self.container_id, &self.ifname)
    }
}

/// The record key of an endpoint.
pub fn endpoint_key(container_id: &str, ifname: &str) -> String {
    format!("{container_id}\u{1f}{ifname}")
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
    db: Database,
    path: PathBuf,
    log: Mutex<Log>,
}

/// The log and the operations it holds that redb does not have yet.
struct Log {
    wal: wal::Wal,
    pending: Vec<Op>,
    /// A commit that leaves fewer free pages than this checkpoints.
    checkpoint_below: u64,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("path", &self.path).finish()
    }
}

/// A table of JSON records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Table {
    Allocations = 1,
    Endpoints = 2,
    Lb = 3,
    Delegated = 4,
}

impl Table {
    fn from_byte(b: u8) -> Option<Self> {
        [
            Table::Allocations,
            Table::Endpoints,
            Table::Lb,
            Table::Delegated,
        ]
        .into_iter()
        .find(|t| *t as u8 == b)
    }
}

/// One change to the database, as the log records it.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Op {
    /// Insert or replace a record.
    Put {
        table: Table,
        key: String,
        value: Vec<u8>,
    },
    /// Remove a record; absent is fine.
    Remove { table: Table, key: String },
    /// Raise the generation high-water mark (it never goes down).
    Generation(u64),
}

const OP_PUT: u8 = 1;
const OP_REMOVE: u8 = 2;
const OP_GENERATION: u8 = 3;

/// Encodes operations as a log payload: per operation a tag byte, then the
/// table byte and length-prefixed (u32 LE) key and value, or the generation
/// (u64 LE).
fn encode(ops: &[Op]) -> Vec<u8> {
    let mut out = Vec::with_capacity(512);
    let bytes = |out: &mut Vec<u8>, b: &[u8]| {
        out.extend_from_slice(&(b.len() as u32).to_le_bytes());
        out.extend_from_slice(b);
    };
    for op in ops {
        match op {
            Op::Put { table, key, value } => {
                out.extend_from_slice(&[OP_PUT, *table as u8]);
                bytes(&mut out, key.as_bytes());
                bytes(&mut out, value);
            }
            Op::Remove { table, key } => {
                out.extend_from_slice(&[OP_REMOVE, *table as u8]);
                bytes(&mut out, key.as_bytes());
            }
            Op::Generation(g) => {
                out.push(OP_GENERATION);
                out.extend_from_slice(&g.to_le_bytes());
            }
        }
    }
    out
}

/// Decodes a log payload written by [`encode`].
fn decode_ops(seq: u64, mut data: &[u8]) -> Result<Vec<Op>, StoreError> {
    let bad = |reason| StoreError::LogRecord { seq, reason };
    fn take<'a>(data: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        let (head, rest) = data.split_at_checked(n)?;
        *data = rest;
        Some(head)
    }
    fn sized<'a>(data: &mut &'a [u8]) -> Option<&'a [u8]> {
        let len = u32::from_le_bytes(take(data, 4)?.try_into().ok()?);
        take(data, len as usize)
    }
    let mut ops = Vec::new();
    while let Some(tag) = take(&mut data, 1) {
        let op = match tag[0] {
            OP_GENERATION => {
                let g = take(&mut data, 8).ok_or_else(|| bad("truncated generation"))?;
                Op::Generation(u64::from_le_bytes(g.try_into().expect("8 bytes")))
            }
            t @ (OP_PUT | OP_REMOVE) => {
                let table = take(&mut data, 1)
                    .and_then(|b| Table::from_byte(b[0]))
                    .ok_or_else(|| bad("unknown table"))?;
                let key = sized(&mut data).ok_or_else(|| bad("truncated key"))?;
                let key = std::str::from_utf8(key)
                    .map_err(|_| bad("key is not UTF-8"))?
                    .to_string();
                if t == OP_PUT {
                    let value = sized(&mut data).ok_or_else(|| bad("truncated value"))?;
                    Op::Put {
                        table,
                        key,
                        value: value.to_vec(),
                    }
                } else {
                    Op::Remove { table, key }
                }
            }
            _ => return Err(bad("unknown operation")),
        };
        ops.push(op);
    }
    Ok(ops)
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

impl Store {
    /// Opens (or creates) the store in `dir`, replays its log into the
    /// database and checkpoints.
    ///
    /// # Errors
    /// The directory, database or log cannot be created or opened, or a log
    /// record does not decode.
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        Self::open_with(dir, LOG_PAGES, LOG_PAGES / 2)
    }

    fn open_with(dir: &Path, log_pages: u64, checkpoint_below: u64) -> Result<Self, StoreError> {
        std::fs::create_dir_all(dir).map_err(|source| StoreError::Dir {
            path: dir.to_path_buf(),
            source,
        })?;
        let path = dir.join(DB_FILE);
        let db = Database::create(&path).map_err(|source| StoreError::Open {
            path: path.clone(),
            source: Box::new(source),
        })?;
        // Make sure every table exists, so readers never see "no such
        // table", and that the database has its identity.
        let txn = db.begin_write().map_err(db_err("begin"))?;
        txn.open_table(ALLOCATIONS).map_err(db_err("open table"))?;
        txn.open_table(ENDPOINTS).map_err(db_err("open table"))?;
        txn.open_table(LB).map_err(db_err("open table"))?;
        txn.open_table(DELEGATED).map_err(db_err("open table"))?;
        let (store_id, log_seq) = {
            let mut meta = txn.open_table(META).map_err(db_err("open table"))?;
            let get = |k| -> Result<Option<u64>, StoreError> {
                Ok(meta.get(k).map_err(db_err("read"))?.map(|v| v.value()))
            };
            let (id, seq) = (get(STORE_ID)?, get(LOG_SEQ)?.unwrap_or(0));
            let id = match id {
                Some(id) => id,
                None => {
                    let id = getrandom::u64().map_err(StoreError::Random)?;
                    meta.insert(STORE_ID, id).map_err(db_err("insert"))?;
                    id
                }
            };
            (id, seq)
        };
        txn.commit().map_err(db_err("commit"))?;
        let (wal, records) = wal::Wal::open(&dir.join(LOG_FILE), store_id, log_pages, log_seq)?;
        let mut pending = Vec::new();
        for r in &records {
            pending.extend(decode_ops(r.seq, &r.payload)?);
        }
        if !records.is_empty() {
            tracing::info!(records = records.len(), "replaying the store log");
        }
        let store = Self {
            db,
            path,
            log: Mutex::new(Log {
                wal,
                pending,
                checkpoint_below,
            }),
        };
        store.checkpoint()?;
        Ok(store)
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn lock_log(&self) -> MutexGuard<'_, Log> {
        self.log.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Applies what the log holds beyond redb to redb, durably, and starts
    /// the log again.
    ///
    /// # Errors
    /// The redb transaction failed; the log keeps the records.
    pub fn checkpoint(&self) -> Result<(), StoreError> {
        let mut log = self.lock_log();
        self.checkpoint_with(&mut log, &[])
    }

    /// One durable redb transaction: the pending operations, then `extra`
    /// (a record too large for the log), and the log's last sequence number.
    fn checkpoint_with(&self, log: &mut Log, extra: &[Op]) -> Result<(), StoreError> {
        if log.pending.is_empty() && extra.is_empty() {
            return Ok(());
        }
        let txn = self.db.begin_write().map_err(db_err("begin"))?;
        {
            let open = |d| txn.open_table(d).map_err(db_err("open table"));
            let mut tables = [
                open(ALLOCATIONS)?,
                open(ENDPOINTS)?,
                open(LB)?,
                open(DELEGATED)?,
            ];
            let mut meta = txn.open_table(META).map_err(db_err("open table"))?;
            for op in log.pending.iter().chain(extra) {
                match op {
                    Op::Put { table, key, value } => {
                        tables[*table as usize - 1]
                            .insert(key.as_str(), value.as_slice())
                            .map_err(db_err("insert"))?;
                    }
                    Op::Remove { table, key } => {
                        tables[*table as usize - 1]
                            .remove(key.as_str())
                            .map_err(db_err("remove"))?;
                    }
                    Op::Generation(g) => {
                        let current = meta
                            .get(GENERATION)
                            .map_err(db_err("read"))?
                            .map(|v| v.value())
                            .unwrap_or(0);
                        if *g > current {
                            meta.insert(GENERATION, *g).map_err(db_err("insert"))?;
                        }
                    }
                }
            }
            meta.insert(LOG_SEQ, log.wal.covered_through())
                .map_err(db_err("insert"))?;
        }
        txn.commit().map_err(db_err("commit"))?;
        log.pending.clear();
        log.wal.restart();
        Ok(())
    }

    /// Commits `ops`: one log record, on disk when this returns.
    fn commit(&self, ops: Vec<Op>) -> Result<(), StoreError> {
        let mut log = self.lock_log();
        let payload = encode(&ops);
        match log.wal.append(&payload) {
            Ok(_) => {}
            Err(wal::WalError::Full) => {
                self.checkpoint_with(&mut log, &[])?;
                log.wal.append(&payload)?;
            }
            Err(wal::WalError::TooBig { .. }) => return self.checkpoint_with(&mut log, &ops),
            Err(e) => return Err(e.into()),
        }
        log.pending.extend(ops);
        if log.wal.free_pages() < log.checkpoint_below
            && let Err(e) = self.checkpoint_with(&mut log, &[])
        {
            // The commit itself is durable in the log; the checkpoint is
            // retried on the next commit and forced when the log is full.
            tracing::warn!(error = %e, log = %log.wal.path().display(), "store checkpoint failed");
        }
        Ok(())
    }

    /// Everything stored (after a checkpoint, so redb holds it all).
    ///
    /// # Errors
    /// The checkpoint or a read failed, or a record is corrupt.
    pub fn load(&self) -> Result<Stored, StoreError> {
        self.checkpoint()?;
        let txn = self.db.begin_read().map_err(db_err("begin read"))?;
        let meta = txn.open_table(META).map_err(db_err("open table"))?;
        let generation = meta
            .get(GENERATION)
            .map_err(db_err("read"))?
            .map(|g| g.value())
            .unwrap_or(0);
        let allocations: Vec<Allocation> = read_all(&txn, ALLOCATIONS)?;
        let endpoints: Vec<EndpointRecord> = read_all(&txn, ENDPOINTS)?;
        let delegated: Vec<DelegatedRecord> = read_all(&txn, DELEGATED)?;
        let table = txn.open_table(LB).map_err(db_err("open table"))?;
        let lb = match table.get(LB_STATE).map_err(db_err("read"))? {
            Some(v) => Some(decode(LB_STATE, v.value())?),
            None => None,
        };
        Ok(Stored {
            generation: Generation(generation),
            allocations,
            endpoints,
            lb,
            delegated,
        })
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
            tracing::warn!(error = %e, "store checkpoint at shutdown failed");
        }
    }
}

#[cfg(test)]
mod tests {
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
            self.lock_log().pending.clear();
        }

        fn log_seq(&self) -> u64 {
            let txn = self.db.begin_read().expect("read");
            let meta = txn.open_table(META).expect("meta");
            meta.get(LOG_SEQ).expect("get").map_or(0, |v| v.value())
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

    #[test]
    fn log_payloads_round_trip_and_garbage_is_refused() {
        let ops = vec![
            Op::Put {
                table: Table::Endpoints,
                key: "c1\u{1f}eth0".into(),
                value: b"{\"a\":1}".to_vec(),
            },
            Op::Remove {
                table: Table::Allocations,
                key: String::new(),
            },
            Op::Generation(u64::MAX),
            Op::Put {
                table: Table::Lb,
                key: "state".into(),
                value: Vec::new(),
            },
        ];
        assert_eq!(decode_ops(1, &encode(&ops)).expect("decode"), ops);
        let bytes = encode(&ops);
        for cut in 1..bytes.len() {
            // Every truncation inside an operation is refused, never misread.
            if let Ok(got) = decode_ops(1, &bytes[..cut]) {
                assert!(ops.starts_with(&got), "cut {cut}: {got:?}");
            }
        }
        for bad in [
            &[9u8][..],
            &[OP_PUT, 9],
            &[OP_REMOVE, 1, 2, 0, 0, 0, 0xff, 0xfe],
        ] {
            let err = decode_ops(7, bad).expect_err("garbage");
            assert!(err.to_string().contains("record 7"), "{err}");
        }
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
