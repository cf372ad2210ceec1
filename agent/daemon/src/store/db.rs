//! The store's database side: opening redb, checkpointing into it, reading
//! it back. The only code that calls redb.
//!
//! Why every write transaction is a two-phase commit with quick repair:
//! redb's default one-phase commit writes the header and the new pages
//! together and relies, after a crash, on verifying the primary slot's
//! checksums and falling back to the secondary slot; redb's own changelog
//! lists bugs in exactly that fallback (4.2: a crash during the repair that
//! follows a crash could silently roll back or corrupt durably committed
//! transactions — "it did not affect transactions committed with two-phase
//! commit"; 4.6: repair could fall back to a slot that failed its checksum
//! and open a damaged database as an empty one). Both showed up here as lost
//! acknowledged commits under kills aimed at start-up (`tests/startup_kill`).
//! A two-phase commit syncs the pages before it writes the header that points
//! at them, so the primary slot is always whole and nothing falls back; quick
//! repair saves the allocator state in the same commit, so a start after a
//! crash loads it instead of rebuilding it with a full repair. The extra
//! sync is paid once per checkpoint (about every 500 commits), not per
//! commit: commits go to the log.
//!
//! A panic inside redb (its repair code has had several) is caught and
//! returned as [`StoreError::Panicked`], so the agent reports it instead of
//! dying mid-start.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;

use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};

use redb::backends::FileBackend;
use redb::{
    Builder, Database, DatabaseError, ReadableDatabase as _, ReadableTable, ReadableTableMetadata,
    TableDefinition,
};

use super::StoreError;
use super::codec::{Op, Table};

pub(super) const ALLOCATIONS: TableDefinition<&str, &[u8]> = TableDefinition::new("allocations");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
pub(super) const ENDPOINTS: TableDefinition<&str, &[u8]> = TableDefinition::new("endpoints");
pub(super) const LB: TableDefinition<&str, &[u8]> = TableDefinition::new("lb");
/// Addresses held by an external CNI IPAM plugin (delegated mode), keyed like
/// endpoints: they are not the pool manager's, so they have their own table.
pub(super) const DELEGATED: TableDefinition<&str, &[u8]> = TableDefinition::new("delegated");
const GENERATION: &str = "generation";
/// Sequence number of the last log record applied to redb.
const LOG_SEQ: &str = "log_seq";
/// Identity of this database; the log carries it so that it is never
/// replayed into another one.
const STORE_ID: &str = "store_id";

/// The tables in the order of [`Table`]'s values (1-based).
const TABLES: [TableDefinition<&str, &[u8]>; 4] = [ALLOCATIONS, ENDPOINTS, LB, DELEGATED];

pub(super) fn db_err<E: Into<redb::Error>>(action: &'static str) -> impl FnOnce(E) -> StoreError {
    move |e| StoreError::Db {
        action,
        source: Box::new(e.into()),
    }
}

/// Runs `f`, turning a panic inside it into [`StoreError::Panicked`].
fn guarded<T>(
    path: &Path,
    action: &'static str,
    f: impl FnOnce() -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let message = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_string()))
            .unwrap_or_else(|| "no message".to_string());
        Err(StoreError::Panicked {
            path: path.to_path_buf(),
            action,
            message,
        })
    })
}

/// Opens (or creates) the database at `path`.
///
/// # Errors
/// Another process holds it ([`StoreError::Locked`]), it cannot be opened or
/// repaired ([`StoreError::Open`]), or redb panicked.
pub(super) fn open(path: &Path) -> Result<Database, StoreError> {
    // Opened here, not by redb: never through a symlink planted at the
    // path, and readable by root only (it names every pod's container).
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .and_then(|file| {
            // A store made by an older version may be 0644.
            file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
            Ok(file)
        })
        .map_err(|source| StoreError::File {
            path: path.to_path_buf(),
            source,
        })?;
    guarded(path, "open", || {
        let backend = FileBackend::new(file).map_err(|source| StoreError::Open {
            path: path.to_path_buf(),
            source: Box::new(source),
        })?;
        Builder::new()
            .create_with_backend(backend)
            .map_err(|source| match source {
                DatabaseError::DatabaseAlreadyOpen => StoreError::Locked {
                    path: path.to_path_buf(),
                },
                source => StoreError::Open {
                    path: path.to_path_buf(),
                    source: Box::new(source),
                },
            })
    })
}

/// A write transaction committed the safe way (see the module docs).
fn begin_write(db: &Database) -> Result<redb::WriteTransaction, StoreError> {
    let mut txn = db.begin_write().map_err(db_err("begin"))?;
    txn.set_two_phase_commit(true);
    txn.set_quick_repair(true);
    Ok(txn)
}

/// The database's identity and the last log record it applied; a new
/// database gets its tables and a random identity first (one commit, only
/// then).
///
/// # Errors
/// A transaction failed, or no identity could be drawn.
pub(super) fn identity(db: &Database, path: &Path) -> Result<(u64, u64), StoreError> {
    guarded(path, "read identity", || {
        let read = |db: &Database| -> Result<Option<(u64, u64)>, StoreError> {
            let txn = db.begin_read().map_err(db_err("begin read"))?;
            let meta = match txn.open_table(META) {
                Ok(meta) => meta,
                Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
                Err(e) => return Err(db_err("open table")(e)),
            };
            let get = |k| -> Result<Option<u64>, StoreError> {
                Ok(meta.get(k).map_err(db_err("read"))?.map(|v| v.value()))
            };
            let Some(id) = get(STORE_ID)? else {
                return Ok(None);
            };
            Ok(Some((id, get(LOG_SEQ)?.unwrap_or(0))))
        };
        if let Some(found) = read(db)? {
            return Ok(found);
        }
        let txn = begin_write(db)?;
        for table in TABLES {
            txn.open_table(table).map_err(db_err("open table"))?;
        }
        let id = {
            let mut meta = txn.open_table(META).map_err(db_err("open table"))?;
            let id = getrandom::u64().map_err(StoreError::Random)?;
            meta.insert(STORE_ID, id).map_err(db_err("insert"))?;
            id
        };
        txn.commit().map_err(db_err("commit"))?;
        Ok((id, 0))
    })
}

/// One durable transaction: `ops` in order, and the log's sequence number
/// they bring the database to.
///
/// # Errors
/// The transaction failed (nothing of it is applied) or redb panicked.
pub(super) fn apply<'a>(
    db: &Database,
    path: &Path,
    ops: impl Iterator<Item = &'a Op>,
    log_seq: u64,
) -> Result<(), StoreError> {
    guarded(path, "checkpoint", || {
        let txn = begin_write(db)?;
        {
            let open = |d| txn.open_table(d).map_err(db_err("open table"));
            let mut tables = [
                open(TABLES[0])?,
                open(TABLES[1])?,
                open(TABLES[2])?,
                open(TABLES[3])?,
            ];
            let mut meta = txn.open_table(META).map_err(db_err("open table"))?;
            let slot = |t: &Table| *t as usize - 1;
            for op in ops {
                match op {
                    Op::Put { table, key, value } => {
                        tables[slot(table)]
                            .insert(key.as_str(), value.as_slice())
                            .map_err(db_err("insert"))?;
                    }
                    Op::Remove { table, key } => {
                        tables[slot(table)]
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
            meta.insert(LOG_SEQ, log_seq).map_err(db_err("insert"))?;
        }
        txn.commit().map_err(db_err("commit"))
    })
}

/// Every record of a JSON-valued table, decoded.
pub(super) fn read_all<T: serde::de::DeserializeOwned>(
    txn: &redb::ReadTransaction,
    table: TableDefinition<&str, &[u8]>,
) -> Result<Vec<T>, StoreError> {
    let table = txn.open_table(table).map_err(db_err("open table"))?;
    let mut out = Vec::with_capacity(table.len().map_err(db_err("read"))? as usize);
    for item in table.iter().map_err(db_err("read"))? {
        let (k, v) = item.map_err(db_err("read"))?;
        out.push(super::decode(k.value(), v.value())?);
    }
    Ok(out)
}

/// The generation high-water mark and the LoadBalancer state record.
pub(super) fn read_meta(txn: &redb::ReadTransaction) -> Result<(u64, Option<Vec<u8>>), StoreError> {
    let meta = txn.open_table(META).map_err(db_err("open table"))?;
    let generation = meta
        .get(GENERATION)
        .map_err(db_err("read"))?
        .map(|g| g.value())
        .unwrap_or(0);
    let lb = txn.open_table(LB).map_err(db_err("open table"))?;
    let state = lb
        .get(super::LB_STATE)
        .map_err(db_err("read"))?
        .map(|v| v.value().to_vec());
    Ok((generation, state))
}

/// The last log record applied (for tests).
#[cfg(test)]
pub(super) fn log_seq(db: &Database) -> u64 {
    let txn = db.begin_read().expect("read");
    let meta = txn.open_table(META).expect("meta");
    meta.get(LOG_SEQ).expect("get").map_or(0, |v| v.value())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_inside_the_storage_library_is_returned_not_raised() {
        let path = Path::new("/nowhere/lockstep.redb");
        let err = guarded::<()>(path, "open", || panic!("entered unreachable code"))
            .expect_err("a caught panic is an error");
        assert!(
            matches!(
                &err,
                StoreError::Panicked { action: "open", message, .. }
                    if message == "entered unreachable code"
            ),
            "{err}"
        );
        assert!(err.needs_operator());
        assert!(err.to_string().contains("docs/store.md"), "{err}");
        let fmt = guarded::<()>(path, "checkpoint", || panic!("index {} out of range", 7))
            .expect_err("formatted panic");
        assert!(fmt.to_string().contains("index 7 out of range"), "{fmt}");
    }
}
