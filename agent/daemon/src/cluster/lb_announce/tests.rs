use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr};

use lockstep_common::{L2RespValue, V4Addr};
use lockstep_core::lb::LabelSelector;
use lockstep_core::lb::announce::driver::{Driver, DriverConfig, Step};
use lockstep_core::lb::announce::{Holder, Observation};
use lockstep_core::lb::cluster::Candidate;

use super::*;
use crate::announce::monotonic_ns;

/// etcd's announcement keys in memory: address → (node, lease, create
/// revision).
#[derive(Default)]
struct KeysDouble {
    keys: BTreeMap<IpAddr, (String, i64, i64)>,
    revision: Cell<i64>,
    /// Takes are `&self` (sent together): their keys land here first.
    taken: RefCell<BTreeMap<IpAddr, (String, i64, i64)>>,
    withdrawals: usize,
}

impl KeysDouble {
    /// The keys, takes included.
    fn all(&mut self) -> &BTreeMap<IpAddr, (String, i64, i64)> {
        let taken = std::mem::take(&mut *self.taken.borrow_mut());
        for (a, k) in taken {
            self.keys.entry(a).or_insert(k);
        }
        &self.keys
    }
}

impl AnnounceKeys for KeysDouble {
    async fn take(
        &self,
        address: IpAddr,
        node: &str,
        lease: i64,
    ) -> Result<Option<i64>, ClusterStoreError> {
        self.revision.set(self.revision.get() + 1);
        let rev = self.revision.get();
        let mut taken = self.taken.borrow_mut();
        let held = match self.keys.get(&address) {
            Some(k) => k.clone(),
            None => taken
                .entry(address)
                .or_insert_with(|| (node.to_string(), lease, rev))
                .clone(),
        };
        Ok((held.0 == node && held.1 == lease).then_some(held.2))
    }

    async fn withdraw(
        &mut self,
        address: IpAddr,
        node: &str,
        key: KeyRef,
    ) -> Result<(), ClusterStoreError> {
        self.all();
        let named = self.keys.get(&address).is_some_and(|(n, l, rev)| {
            n == node
                && match key {
                    KeyRef::Created(r) => r == *rev,
                    KeyRef::Lease(x) => x == *l,
                }
        });
        if named {
            self.keys.remove(&address);
            self.withdrawals += 1;
        }
        Ok(())
    }

    async fn revoke(&mut self, lease: i64) -> Result<(), ClusterStoreError> {
        self.all();
        self.keys.retain(|_, (_, l, _)| *l != lease);
        Ok(())
    }
}

/// The announcement map in memory (L2_RESP_V4's entries): while
/// `refuse_insert` or `refuse_remove` is set, every insert or removal is
/// refused, and a write fails part-way; `hang` makes every write go
/// unanswered (a timeout).
#[derive(Default)]
struct DatapathDouble {
    l2: RefCell<BTreeMap<V4Addr, L2RespValue>>,
    refuse_insert: Cell<bool>,
    refuse_remove: Cell<bool>,
    /// Removals tried, refused ones too.
    removals: Cell<usize>,
    applied: Cell<u64>,
    hang: Cell<bool>,
    announced: RefCell<Vec<IpAddr>>,
}

fn v4(a: IpAddr) -> V4Addr {
    match a {
        IpAddr::V4(v) => v.octets(),
        IpAddr::V6(_) => unreachable!("the test uses IPv4"),
    }
}

impl AnnounceDatapath for DatapathDouble {
    async fn program(&self, seq: u64, addresses: BTreeSet<IpAddr>, valid_until: u64) -> Written {
        if self.hang.get() {
            return Written::Lost;
        }
        if seq <= self.applied.get() {
            return Written::Done;
        }
        self.applied.set(seq);
        let mut l2 = self.l2.borrow_mut();
        let want: BTreeSet<V4Addr> = addresses.iter().map(|a| v4(*a)).collect();
        let gone: Vec<V4Addr> = l2.keys().filter(|k| !want.contains(*k)).copied().collect();
        for k in gone {
            self.removals.set(self.removals.get() + 1);
            if self.refuse_remove.get() {
                return Written::Failed;
            }
            l2.remove(&k);
        }
        for k in want {
            let value = L2RespValue {
                ifindex: 2,
                expires_ns: valid_until,
                ..L2RespValue::default()
            };
            if self.refuse_insert.get() {
                return Written::Failed;
            }
            l2.insert(k, value);
        }
        Written::Done
    }

    fn announce(&self, address: IpAddr) {
        self.announced.borrow_mut().push(address);
    }
}

const A: IpAddr = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 7));

fn view(addresses: &[IpAddr], holders: &[(IpAddr, i64)]) -> Observation {
    Observation {
        addresses: addresses
            .iter()
            .map(|a| (*a, LabelSelector::default()))
            .collect(),
        members: [(
            Candidate {
                name: "node-0".into(),
                labels: BTreeMap::new(),
                answers: true,
            },
            7,
        )]
        .into_iter()
        .collect(),
        holders: holders
            .iter()
            .map(|(a, l)| {
                (
                    *a,
                    Holder {
                        node: "node-0".into(),
                        lease: *l,
                    },
                )
            })
            .collect(),
    }
}

/// One tick of a driver holding lease 7: its lease and reads answered
/// here (the read is `view`), its takes, withdrawals and writes carried
/// out on the doubles.
async fn tick(d: &mut Driver, view: &Observation, keys: &mut KeysDouble, dp: &DatapathDouble) {
    let mut counts = Counts::default();
    d.wake();
    loop {
        let now = monotonic_ns();
        let done = match d.step(now) {
            Step::Wait(_) => return,
            Step::Announce(a) => {
                dp.announce(a);
                continue;
            }
            Step::Io(Io::Grant) => Done::Granted {
                id: 7,
                ttl_ns: 3_000_000_000,
            },
            Step::Io(Io::Join { .. }) => Done::Joined,
            Step::Io(Io::Refresh(_)) => Done::Refreshed(true),
            Step::Io(Io::Read) => Done::Read(Some(view.clone())),
            Step::Io(io) => carry_out(io, keys, dp, "node-0", &mut counts).await.0,
        };
        d.done(done, monotonic_ns());
    }
}

fn driver() -> Driver {
    Driver::new("node-0", DriverConfig::for_lease(3_000_000_000))
}

#[tokio::test]
async fn a_failed_or_timed_out_unprogram_is_never_followed_by_the_withdrawal() {
    let mut d = driver();
    let (mut keys, dp) = (KeysDouble::default(), DatapathDouble::default());
    let wanted = view(&[A], &[]);
    tick(&mut d, &wanted, &mut keys, &dp).await;
    assert!(keys.all().contains_key(&A), "taken");
    assert!(dp.l2.borrow().contains_key(&v4(A)), "programmed");
    assert_eq!(*dp.announced.borrow(), vec![A], "announced once programmed");

    // The service is gone; removing the map entry fails.
    dp.refuse_remove.set(true);
    let gone = view(&[], &[(A, 7)]);
    for _ in 0..3 {
        tick(&mut d, &gone, &mut keys, &dp).await;
    }
    assert!(dp.removals.get() >= 3, "the write was tried (and retried)");
    assert!(dp.l2.borrow().contains_key(&v4(A)), "still answering");
    assert_eq!(
        keys.withdrawals, 0,
        "withdrawn while the datapath still answers"
    );

    // The write no longer fails but is not answered in time.
    dp.refuse_remove.set(false);
    dp.hang.set(true);
    for _ in 0..3 {
        tick(&mut d, &gone, &mut keys, &dp).await;
    }
    assert_eq!(keys.withdrawals, 0, "withdrawn on a write not answered");

    // Confirmed: now, and only now, the key goes.
    dp.hang.set(false);
    tick(&mut d, &gone, &mut keys, &dp).await;
    assert!(!dp.l2.borrow().contains_key(&v4(A)));
    assert_eq!(keys.withdrawals, 1);
    assert!(keys.all().is_empty());
}

#[tokio::test]
async fn a_take_is_programmed_only_after_etcd_said_yes_and_announced_only_after_the_write() {
    let mut d = driver();
    // Another node holds the key: nothing is programmed or announced.
    let mut keys = KeysDouble::default();
    keys.keys.insert(A, ("node-1".into(), 9, 1));
    let dp = DatapathDouble::default();
    let wanted = view(&[A], &[]);
    tick(&mut d, &wanted, &mut keys, &dp).await;
    assert!(dp.l2.borrow().is_empty());
    assert!(dp.announced.borrow().is_empty());
    // Free, but the datapath write fails: held, not announced.
    keys.keys.clear();
    dp.refuse_insert.set(true);
    tick(&mut d, &wanted, &mut keys, &dp).await;
    assert!(keys.all().contains_key(&A));
    assert!(
        dp.announced.borrow().is_empty(),
        "announced without an entry"
    );
    dp.refuse_insert.set(false);
    tick(&mut d, &wanted, &mut keys, &dp).await;
    assert_eq!(*dp.announced.borrow(), vec![A]);
}
