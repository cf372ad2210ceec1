//! The durable store: every allocation the agent has acknowledged, and the
//! generation high-water mark, in an embedded crash-safe database (redb).
//!
//! Why redb: it is pure Rust, embedded (no server to run on a node), commits
//! with copy-on-write B-trees and a checksummed double-buffered header, and a
//! commit returns only after `fsync` (durability `Immediate`, the default). A
//! `SIGKILL` at any instant leaves either the old or the new state, never a
//! torn one, which is exactly the property lockstep's ordering needs:
//! commit → program maps → acknowledge.
//!
//! Domain state stays in plain structs (the core's [`Allocation`]); this module
//! only persists it. The file holds a lock, so a second agent on the same state
//! directory is refused instead of corrupting it.

use std::path::{Path, PathBuf};

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

/// File name of the database inside the state directory.
pub const DB_FILE: &str = "lockstep.redb";

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
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("path", &self.path).finish()
    }
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
    /// Opens (or creates) the store in `dir`.
    ///
    /// # Errors
    /// The directory or database cannot be created or opened.
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        std::fs::create_dir_all(dir).map_err(|source| StoreError::Dir {
            path: dir.to_path_buf(),
            source,
        })?;
        let path = dir.join(DB_FILE);
        let db = Database::create(&path).map_err(|source| StoreError::Open {
            path: path.clone(),
            source: Box::new(source),
        })?;
        let store = Self { db, path };
        // Make sure both tables exist, so readers never see "no such table".
        let txn = store.db.begin_write().map_err(db_err("begin"))?;
        txn.open_table(ALLOCATIONS).map_err(db_err("open table"))?;
        txn.open_table(META).map_err(db_err("open table"))?;
        txn.open_table(ENDPOINTS).map_err(db_err("open table"))?;
        txn.open_table(LB).map_err(db_err("open table"))?;
        txn.open_table(DELEGATED).map_err(db_err("open table"))?;
        txn.commit().map_err(db_err("commit"))?;
        Ok(store)
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Everything stored.
    ///
    /// # Errors
    /// A read failed or a record is corrupt.
    pub fn load(&self) -> Result<Stored, StoreError> {
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
    /// The transaction failed; nothing was written.
    pub fn put(&self, a: &Allocation, high_water: Generation) -> Result<(), StoreError> {
        self.put_many(std::slice::from_ref(a), high_water)
    }

    /// Durably records several allocations in one transaction.
    ///
    /// # Errors
    /// The transaction failed; nothing was written.
    pub fn put_many(&self, all: &[Allocation], high_water: Generation) -> Result<(), StoreError> {
        self.put_endpoint(None, all, high_water)
    }

    /// Durably records an endpoint and its allocations in one transaction.
    ///
    /// # Errors
    /// The transaction failed; nothing was written.
    pub fn put_endpoint(
        &self,
        endpoint: Option<&EndpointRecord>,
        all: &[Allocation],
        high_water: Generation,
    ) -> Result<(), StoreError> {
        let txn = self.db.begin_write().map_err(db_err("begin"))?;
        if let Some(e) = endpoint {
            let mut table = txn.open_table(ENDPOINTS).map_err(db_err("open table"))?;
            let value = serde_json::to_vec(e).map_err(|source| StoreError::Corrupt {
                key: e.key(),
                source,
            })?;
            table
                .insert(e.key().as_str(), value.as_slice())
                .map_err(db_err("insert"))?;
        }
        {
            let mut table = txn.open_table(ALLOCATIONS).map_err(db_err("open table"))?;
            for a in all {
                let value = serde_json::to_vec(a).map_err(|source| StoreError::Corrupt {
                    key: key_of(a),
                    source,
                })?;
                table
                    .insert(key_of(a).as_str(), value.as_slice())
                    .map_err(db_err("insert"))?;
            }
            let mut meta = txn.open_table(META).map_err(db_err("open table"))?;
            let current = meta
                .get(GENERATION)
                .map_err(db_err("read"))?
                .map(|g| g.value())
                .unwrap_or(0);
            meta.insert(GENERATION, current.max(high_water.0))
                .map_err(db_err("insert"))?;
        }
        txn.commit().map_err(db_err("commit"))
    }

    /// Durably records a delegated attachment (and, for an endpoint, its
    /// endpoint record) in one transaction, raising the generation
    /// high-water mark to the record's.
    ///
    /// # Errors
    /// The transaction failed; nothing was written.
    pub fn put_delegated(
        &self,
        record: &DelegatedRecord,
        endpoint: Option<&EndpointRecord>,
    ) -> Result<(), StoreError> {
        let value = serde_json::to_vec(record).map_err(|source| StoreError::Corrupt {
            key: record.key(),
            source,
        })?;
        let txn = self.db.begin_write().map_err(db_err("begin"))?;
        {
            let mut table = txn.open_table(DELEGATED).map_err(db_err("open table"))?;
            table
                .insert(record.key().as_str(), value.as_slice())
                .map_err(db_err("insert"))?;
            if let Some(e) = endpoint {
                let mut eps = txn.open_table(ENDPOINTS).map_err(db_err("open table"))?;
                let value = serde_json::to_vec(e).map_err(|source| StoreError::Corrupt {
                    key: e.key(),
                    source,
                })?;
                eps.insert(e.key().as_str(), value.as_slice())
                    .map_err(db_err("insert"))?;
            }
            let mut meta = txn.open_table(META).map_err(db_err("open table"))?;
            let current = meta
                .get(GENERATION)
                .map_err(db_err("read"))?
                .map(|g| g.value())
                .unwrap_or(0);
            meta.insert(GENERATION, current.max(record.generation.0))
                .map_err(db_err("insert"))?;
        }
        txn.commit().map_err(db_err("commit"))
    }

    /// Durably removes a delegated attachment and the endpoint record under
    /// the same key (if any); what is not there is skipped.
    ///
    /// # Errors
    /// The transaction failed; nothing was removed.
    pub fn remove_delegated(&self, key: &str) -> Result<(), StoreError> {
        let txn = self.db.begin_write().map_err(db_err("begin"))?;
        {
            let mut table = txn.open_table(DELEGATED).map_err(db_err("open table"))?;
            table.remove(key).map_err(db_err("remove"))?;
            let mut eps = txn.open_table(ENDPOINTS).map_err(db_err("open table"))?;
            eps.remove(key).map_err(db_err("remove"))?;
        }
        txn.commit().map_err(db_err("commit"))
    }

    /// Durably replaces the LoadBalancer IPAM state.
    ///
    /// # Errors
    /// The transaction failed; the old state stays.
    pub fn put_lb(&self, state: &lockstep_core::lb::LbSnapshot) -> Result<(), StoreError> {
        let value = serde_json::to_vec(state).map_err(|source| StoreError::Corrupt {
            key: LB_STATE.into(),
            source,
        })?;
        let txn = self.db.begin_write().map_err(db_err("begin"))?;
        {
            let mut table = txn.open_table(LB).map_err(db_err("open table"))?;
            table
                .insert(LB_STATE, value.as_slice())
                .map_err(db_err("insert"))?;
        }
        txn.commit().map_err(db_err("commit"))
    }

    /// Durably removes `a`; removing what is not there is not an error.
    ///
    /// # Errors
    /// The transaction failed; nothing was removed.
    pub fn remove(&self, a: &Allocation) -> Result<(), StoreError> {
        self.remove_endpoint(None, std::slice::from_ref(a))
    }

    /// Durably removes an endpoint record (by key) and allocations in one
    /// transaction; what is not there is skipped.
    ///
    /// # Errors
    /// The transaction failed; nothing was removed.
    pub fn remove_endpoint(
        &self,
        endpoint_key: Option<&str>,
        all: &[Allocation],
    ) -> Result<(), StoreError> {
        let txn = self.db.begin_write().map_err(db_err("begin"))?;
        {
            let mut table = txn.open_table(ALLOCATIONS).map_err(db_err("open table"))?;
            for a in all {
                table.remove(key_of(a).as_str()).map_err(db_err("remove"))?;
            }
            if let Some(k) = endpoint_key {
                let mut eps = txn.open_table(ENDPOINTS).map_err(db_err("open table"))?;
                eps.remove(k).map_err(db_err("remove"))?;
            }
        }
        txn.commit().map_err(db_err("commit"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockstep_core::owner::Owner;

    fn temp_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "lockstep-store-{tag}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        dir
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
        let dir = temp_dir("rt");
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
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_second_opener_is_refused() {
        let dir = temp_dir("lock");
        let _first = Store::open(&dir).expect("open");
        let err = Store::open(&dir).expect_err("second open must fail");
        assert!(err.to_string().contains("another agent"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
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
