//! In-memory doubles of the agent's doors, for unit tests: maps held in
//! `BTreeMap`s, a real store in a temporary directory, and a [`Faults`]
//! plan on each that makes the n-th call of an operation fail.

use std::cell::RefCell;
use std::collections::BTreeMap;

use ipnet::IpNet;
use lockstep_common::{EndpointValue, IpcacheValue, L2RespValue, V4Addr, map_names};
use lockstep_core::lb::LbSnapshot;
use lockstep_core::manager::Allocation;
use lockstep_core::owner::Generation;

use super::{MapDoor, StoreDoor, ipcache_map};
use crate::agent::release::ReleaseStore;
use crate::datapath::DatapathError;
use crate::store::{EndpointRecord, Store, StoreError, Stored};

/// Which calls of which operation fail. Operations are named as the door's
/// methods (`"ipcache_insert"`, `"put_lb"`...); calls count from 1.
#[derive(Debug, Default)]
pub(crate) struct Faults {
    calls: RefCell<BTreeMap<&'static str, usize>>,
    /// op → (first failing call, last failing call; `usize::MAX`: on).
    plan: RefCell<BTreeMap<&'static str, Vec<(usize, usize)>>>,
}

impl Faults {
    /// The `nth` call of `op` (from now on, counting every call made so
    /// far) fails.
    pub(crate) fn fail_at(&self, op: &'static str, nth: usize) {
        self.plan
            .borrow_mut()
            .entry(op)
            .or_default()
            .push((nth, nth));
    }

    /// Every call of `op` from the `nth` on fails.
    pub(crate) fn fail_from(&self, op: &'static str, nth: usize) {
        self.plan
            .borrow_mut()
            .entry(op)
            .or_default()
            .push((nth, usize::MAX));
    }

    /// The next call of `op` fails, and only that one.
    pub(crate) fn fail_next(&self, op: &'static str) {
        let next = self.calls(op) + 1;
        self.fail_at(op, next);
    }

    /// Every later call of `op` fails.
    pub(crate) fn fail_always(&self, op: &'static str) {
        let next = self.calls(op) + 1;
        self.fail_from(op, next);
    }

    /// No call fails any more.
    pub(crate) fn heal(&self) {
        self.plan.borrow_mut().clear();
    }

    /// How many calls of `op` were made.
    pub(crate) fn calls(&self, op: &'static str) -> usize {
        self.calls.borrow().get(op).copied().unwrap_or(0)
    }

    /// Counts a call of `op`; whether it fails.
    pub(crate) fn hit(&self, op: &'static str) -> bool {
        let n = {
            let mut calls = self.calls.borrow_mut();
            let c = calls.entry(op).or_default();
            *c += 1;
            *c
        };
        self.plan
            .borrow()
            .get(op)
            .is_some_and(|ranges| ranges.iter().any(|(a, b)| (*a..=*b).contains(&n)))
    }
}

/// The error an injected map failure gives: a refused write.
pub(crate) fn refused(map: &'static str) -> DatapathError {
    DatapathError::MapAccess {
        action: "write",
        map,
        source: Box::new(std::io::Error::from_raw_os_error(libc::EPERM)),
    }
}

/// The maps in memory, each holding at most `capacity` entries (beyond it a
/// write is [`DatapathError::MapFull`], as the kernel's `E2BIG`).
#[derive(Debug)]
pub(crate) struct MapDouble {
    /// IPCACHE, host entries and prefixes together.
    pub(crate) ipcache: BTreeMap<IpNet, IpcacheValue>,
    /// ENDPOINTS.
    pub(crate) endpoints: BTreeMap<u32, EndpointValue>,
    /// L2_RESP_V4.
    pub(crate) l2: BTreeMap<V4Addr, L2RespValue>,
    /// NAT entries (forward and reverse) per endpoint address.
    pub(crate) nat: BTreeMap<std::net::IpAddr, u64>,
    /// Entries per map.
    pub(crate) capacity: usize,
    /// Which calls fail.
    pub(crate) faults: Faults,
}

impl Default for MapDouble {
    fn default() -> Self {
        MapDouble {
            ipcache: BTreeMap::new(),
            endpoints: BTreeMap::new(),
            l2: BTreeMap::new(),
            nat: BTreeMap::new(),
            capacity: usize::MAX,
            faults: Faults::default(),
        }
    }
}

/// Inserts into an in-memory map as a preallocated kernel hash does: a new
/// key beyond `capacity` is refused as full, a replacement always fits.
fn insert<K: Ord, V>(
    m: &mut BTreeMap<K, V>,
    capacity: usize,
    map: &'static str,
    k: K,
    v: V,
) -> Result<(), DatapathError> {
    if !m.contains_key(&k) && m.len() >= capacity {
        return Err(DatapathError::MapFull { map });
    }
    m.insert(k, v);
    Ok(())
}

impl MapDoor for MapDouble {
    fn ipcache_insert(&mut self, prefix: IpNet, value: IpcacheValue) -> Result<(), DatapathError> {
        let map = ipcache_map(prefix);
        if self.faults.hit("ipcache_insert") {
            return Err(refused(map));
        }
        insert(&mut self.ipcache, self.capacity, map, prefix.trunc(), value)
    }

    fn ipcache_remove(&mut self, prefix: IpNet) -> Result<bool, DatapathError> {
        if self.faults.hit("ipcache_remove") {
            return Err(refused(ipcache_map(prefix)));
        }
        Ok(self.ipcache.remove(&prefix.trunc()).is_some())
    }

    fn endpoint_insert(
        &mut self,
        ifindex: u32,
        value: &EndpointValue,
    ) -> Result<(), DatapathError> {
        if self.faults.hit("endpoint_insert") {
            return Err(refused(map_names::ENDPOINTS));
        }
        let capacity = self.capacity;
        insert(
            &mut self.endpoints,
            capacity,
            map_names::ENDPOINTS,
            ifindex,
            *value,
        )
    }

    fn endpoint_remove(&mut self, ifindex: u32) -> Result<bool, DatapathError> {
        if self.faults.hit("endpoint_remove") {
            return Err(refused(map_names::ENDPOINTS));
        }
        Ok(self.endpoints.remove(&ifindex).is_some())
    }

    fn l2_insert(&mut self, addr: V4Addr, value: &L2RespValue) -> Result<(), DatapathError> {
        if self.faults.hit("l2_insert") {
            return Err(refused(map_names::L2_RESP_V4));
        }
        let capacity = self.capacity;
        insert(&mut self.l2, capacity, map_names::L2_RESP_V4, addr, *value)
    }

    fn l2_remove(&mut self, addr: V4Addr) -> Result<bool, DatapathError> {
        if self.faults.hit("l2_remove") {
            return Err(refused(map_names::L2_RESP_V4));
        }
        Ok(self.l2.remove(&addr).is_some())
    }

    fn nat_remove(&mut self, addr: std::net::IpAddr) -> Result<u64, DatapathError> {
        if self.faults.hit("nat_remove") {
            return Err(refused(if addr.is_ipv4() {
                map_names::NAT_FWD_V4
            } else {
                map_names::NAT_FWD_V6
            }));
        }
        Ok(self.nat.remove(&addr).unwrap_or(0))
    }
}

/// Host interfaces in memory: the veths an ADD made, by name.
#[derive(Debug, Default)]
pub(crate) struct LinkDouble {
    /// Host veths that exist: name → index.
    pub(crate) hosts: BTreeMap<String, u32>,
    /// Which calls fail (`"remove_host"`).
    pub(crate) faults: Faults,
}

impl super::LinkDoor for LinkDouble {
    fn remove_host(&mut self, name: &str, ifindex: u32) -> Result<(), crate::agent::AgentError> {
        if self.faults.hit("remove_host") {
            return Err(crate::agent::AgentError::Datapath(DatapathError::LinkPin {
                action: "remove",
                path: format!("/sys/fs/bpf/lockstep/links/{ifindex}").into(),
                source: Box::new(std::io::Error::from_raw_os_error(libc::EBUSY)),
            }));
        }
        self.hosts.remove(name);
        Ok(())
    }
}

/// The real store in a temporary directory (removed on drop), whose commits
/// can be made to fail: a refused commit writes nothing, as the real
/// store's failed fsync.
pub(crate) struct FlakyStore {
    /// The store.
    pub(crate) store: Store,
    /// Which calls fail (`"put"`, `"put_endpoint"`, `"put_lb"`,
    /// `"remove_endpoint"`).
    pub(crate) faults: Faults,
    _dir: tempfile::TempDir,
}

impl FlakyStore {
    /// An empty store.
    pub(crate) fn new() -> Self {
        let dir = tempfile::Builder::new()
            .prefix("lockstep-doors-")
            .tempdir()
            .expect("temp dir");
        let store = Store::open(&dir.path().join("state")).expect("store opens");
        FlakyStore {
            store,
            faults: Faults::default(),
            _dir: dir,
        }
    }

    /// What the store holds now.
    pub(crate) fn load(&self) -> Stored {
        self.store.load().expect("store loads")
    }

    fn check(&self, op: &'static str) -> Result<(), StoreError> {
        if self.faults.hit(op) {
            return Err(store_refusal());
        }
        Ok(())
    }
}

/// The error a refused commit gives: a full disk.
pub(crate) fn store_refusal() -> StoreError {
    StoreError::Dir {
        path: "/injected/state".into(),
        source: std::io::Error::from_raw_os_error(libc::ENOSPC),
    }
}

impl ReleaseStore for FlakyStore {
    fn remove_endpoint(
        &self,
        record: Option<&str>,
        allocations: &[Allocation],
    ) -> Result<(), StoreError> {
        self.check("remove_endpoint")?;
        self.store.remove_endpoint(record, allocations)
    }
}

impl StoreDoor for FlakyStore {
    fn put(&self, a: &Allocation, high_water: Generation) -> Result<(), StoreError> {
        self.check("put")?;
        self.store.put(a, high_water)
    }

    fn put_endpoint(
        &self,
        endpoint: Option<&EndpointRecord>,
        all: &[Allocation],
        high_water: Generation,
    ) -> Result<(), StoreError> {
        self.check("put_endpoint")?;
        self.store.put_endpoint(endpoint, all, high_water)
    }

    fn put_lb(&self, state: &LbSnapshot) -> Result<(), StoreError> {
        self.check("put_lb")?;
        self.store.put_lb(state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_fail_exactly_the_calls_planned() {
        let f = Faults::default();
        f.fail_at("op", 2);
        f.fail_from("op", 4);
        let seen: Vec<bool> = (0..5).map(|_| f.hit("op")).collect();
        assert_eq!(seen, [false, true, false, true, true]);
        assert_eq!(f.calls("op"), 5);
        assert!(!f.hit("other"), "other operations are not touched");
        f.heal();
        assert!(!f.hit("op"));
    }

    #[test]
    fn the_map_double_refuses_a_new_key_when_full_but_not_a_replacement() {
        let mut m = MapDouble {
            capacity: 1,
            ..MapDouble::default()
        };
        let a: IpNet = "10.0.0.1/32".parse().expect("cidr");
        let b: IpNet = "10.0.0.2/32".parse().expect("cidr");
        m.ipcache_insert(a, IpcacheValue::default()).expect("room");
        let v = IpcacheValue {
            identity: 7,
            ..Default::default()
        };
        m.ipcache_insert(a, v).expect("a replacement fits");
        let e = m.ipcache_insert(b, v).expect_err("full");
        assert!(matches!(e, DatapathError::MapFull { map } if map == map_names::IPCACHE_HOST_V4));
        assert_eq!(m.ipcache, BTreeMap::from([(a, v)]));
    }

    #[test]
    fn a_refused_store_commit_writes_nothing() {
        let s = FlakyStore::new();
        let a = Allocation {
            pool: "p".into(),
            address: "10.0.0.1".parse().expect("addr"),
            owner: lockstep_core::owner::Owner::endpoint("c", "eth0"),
            generation: Generation(1),
        };
        s.faults.fail_next("put");
        let e = StoreDoor::put(&s, &a, Generation(1)).expect_err("refused");
        assert!(crate::error_chain(&e).contains("No space left"), "{e}");
        assert!(s.load().allocations.is_empty());
        StoreDoor::put(&s, &a, Generation(1)).expect("the next call goes in");
        assert_eq!(s.load().allocations, vec![a]);
    }
}
