//! LoadBalancer IPAM in etcd (#13): pools and services stored by `lockstep
//! lb` in cluster mode, one assigner elected under a lease, and its state
//! written in transactions fenced by that election, with every newly
//! assigned address's key created only if absent. The decisions are the
//! core's (`lockstep_core::lb::cluster`); this module reads, elects and
//! writes.
//!
//! Keys under the prefix:
//!
//! ```text
//! lb/pools/<name>             → LbPoolSpec (JSON)
//! lb/services/<ns>/<name>     → ServiceSpec (JSON)
//! lb/assigned/meta            → LbMeta (JSON): the assigner's state but its
//!                               services (pools, sequence numbers, cursors)
//! lb/assigned/services/<ns>/<name>
//!                             → StoredService (JSON): one service's record
//!                               and the allocations it owns
//! lb/state                    → before #27: the whole LbSnapshot; since, a
//!                               JSON string saying where the state moved
//!                               (older agents cannot read it, and stop)
//! lb/addresses/<ip>           → the services holding it (JSON list)
//! lb/assigner                 → the elected node's name, bound to its lease
//! lb/announce/<ip>            → the announcing node's name, bound to its lease
//! lb/members/<node>           → {"name", "labels", "answers"} (JSON; an
//!                               older agent's plain name reads as no labels,
//!                               and a value without "answers" as one that
//!                               answers), bound to its LB lease: the
//!                               candidates for announcing (`lb_agent`), those
//!                               that answer (have an uplink) matched against
//!                               each pool's `node_selector`
//! ```
//!
//! Uniqueness by construction: an address key is created in the same
//! transaction that stores the state assigning it, compared absent; the
//! transaction also compares the assigner key's create revision (the
//! fencing token of this election) and the meta key's revision read (the
//! meta key is written with every change of the state). A
//! deposed assigner, or two that both believe they lead, cannot store a
//! state, and no transaction can create an address key twice.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp, WatchOptions, WatchStream};
use lockstep_core::lb::ServiceSpec;
use lockstep_core::lb::cluster::{LbChange, StoredState, reconcile};

use super::{ClusterStoreError, Door, Kv};

mod members;
mod specs;
mod view;

pub use members::selectors;
pub use view::LbView;

/// At most this many services join the state per transaction: etcd refuses
/// a transaction with more than 128 operations of a kind by default, and
/// each new service writes its state key and its address's key (and
/// compares that the address key is absent).
pub const NEW_SERVICES_PER_ROUND: usize = 50;

/// At most this many writes (or compares) in one state transaction: under
/// etcd's default `--max-txn-ops` (128). A round taking more services in
/// or out than fit takes fewer.
const MAX_TXN_OPS: usize = 120;

/// What `lb/state` holds once the state moved to `lb/assigned/`: a JSON
/// string an older agent fails to read as its state, naming why.
const MOVED: &str = "the lb state moved to lb/assigned/ (lockstep #27): this agent is older than the cluster's assigner; upgrade it";

/// What wakes the LB loop when something under `lb/` changed.
pub enum LbWake {
    /// The agent's mirror: its bell, and where `lb/` stood when last told.
    Mirror {
        /// The mirror.
        mirror: Arc<super::Mirror>,
        /// Rung at every change of the mirror.
        bell: tokio::sync::watch::Receiver<u64>,
        /// `lb/` when last told.
        seen: super::Stamp,
    },
    /// A watch of `lb/` of its own.
    Watch(WatchStream),
}

impl std::fmt::Debug for LbWake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LbWake::Mirror { seen, .. } => f.debug_struct("Mirror").field("seen", seen).finish(),
            LbWake::Watch(_) => f.write_str("Watch"),
        }
    }
}

impl LbWake {
    /// Waits until something under `lb/` changed: `true`, or `false` when
    /// the wake-up broke (open another).
    pub async fn changed(&mut self) -> bool {
        match self {
            LbWake::Mirror { mirror, bell, seen } => loop {
                if bell.changed().await.is_err() {
                    return false;
                }
                let now = mirror.stamp(&["lb/"]);
                if now != *seen {
                    *seen = now;
                    return true;
                }
            },
            LbWake::Watch(stream) => matches!(stream.message().await, Ok(Some(_))),
        }
    }
}

/// What one assigner round did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Round {
    /// Another node is the assigner.
    Follower {
        /// It.
        assigner: String,
    },
    /// This node leads; nothing to change.
    Idle,
    /// This node stored a new state.
    Stored {
        /// Addresses assigned.
        added: usize,
        /// Addresses freed.
        removed: usize,
    },
    /// The fenced write lost (a new election, or a concurrent state
    /// write): read again next round.
    Lost,
}

/// `kv`'s value as JSON, parsed once while the key does not change
/// ([`Kv::parse_once`]): at thousands of members, a change of one key
/// under `lb/` parses one key, not all of them.
fn json_once<T>(kv: &Kv, parser: &'static str) -> Result<T, ClusterStoreError>
where
    T: serde::de::DeserializeOwned + Clone + Send + Sync + 'static,
{
    kv.parse_once(parser, |kv| {
        serde_json::from_slice::<T>(&kv.value).map_err(|e| e.to_string())
    })
    .map_err(|e| corrupt(&kv.key, e))
}

pub(super) fn corrupt(key: &str, e: impl std::fmt::Display) -> ClusterStoreError {
    ClusterStoreError::Corrupt {
        key: key.to_string(),
        reason: e.to_string(),
    }
}

impl Door {
    pub(super) fn lb_key(&self, rest: &str) -> String {
        format!("{}lb/{rest}", self.options().prefix)
    }

    /// A wake-up for the LB loop when anything under `lb/` changes: the
    /// mirror's bell when the door has a link (no request to etcd), else
    /// a watch of `lb/` from now on. A wake-up only says that something
    /// changed (the loop reads everything again), so what a broken watch
    /// misses does not matter; the loop's tick stays the fallback.
    ///
    /// # Errors
    /// etcd unavailable.
    pub async fn lb_watch(&mut self) -> Result<LbWake, ClusterStoreError> {
        if let Some(link) = &self.options().link {
            let mirror = link.mirror().clone();
            let bell = mirror.subscribe();
            let seen = mirror.stamp(&["lb/"]);
            return Ok(LbWake::Mirror { mirror, bell, seen });
        }
        let key = self.lb_key("");
        let stream = self
            .retrying("watch lb", false, |mut c| {
                let key = key.clone();
                async move { c.watch(key, Some(WatchOptions::new().with_prefix())).await }
            })
            .await?;
        Ok(LbWake::Watch(stream))
    }

    /// Runs for assigner under `lease`: creates the assigner key if absent.
    /// Returns the election's fencing revision when this node holds it
    /// (now or already), `None` when another does.
    ///
    /// # Errors
    /// etcd unavailable.
    pub async fn lb_campaign(
        &mut self,
        node: &str,
        lease: i64,
    ) -> Result<Option<i64>, ClusterStoreError> {
        let key = self.lb_key("assigner");
        self.hold_under_lease(key, node, lease, "campaign for lb assigner")
            .await
    }

    /// Creates `key` = `node` under `lease` if absent. Returns the key's
    /// create revision when `node` holds it under `lease` (made now, or
    /// already), `None` when another holder has it. The write's revision
    /// is recorded, so the next read of `lb/` through the mirror has it.
    pub(super) async fn hold_under_lease(
        &self,
        key: String,
        node: &str,
        lease: i64,
        what: &str,
    ) -> Result<Option<i64>, ClusterStoreError> {
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                key.clone(),
                node.as_bytes().to_vec(),
                Some(PutOptions::new().with_lease(lease)),
            )])
            .or_else([TxnOp::get(key, None)]);
        let mut client = self.client();
        let resp = self.bounded(what, true, client.txn(txn)).await?;
        self.wrote_at(resp.header().map_or(0, |h| h.revision()));
        if resp.succeeded() {
            return Ok(Some(resp.header().map_or(0, |h| h.revision())));
        }
        Ok(resp.op_responses().into_iter().find_map(|r| match r {
            etcd_client::TxnOpResponse::Get(g) => g
                .kvs()
                .first()
                .filter(|kv| kv.value() == node.as_bytes() && kv.lease() == lease)
                .map(|kv| kv.create_revision()),
            _ => None,
        }))
    }

    /// Grants a lease of `ttl` for the assigner key.
    ///
    /// # Errors
    /// etcd unavailable.
    pub async fn lb_lease(&mut self, ttl: Duration) -> Result<i64, ClusterStoreError> {
        let secs = i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX);
        let mut client = self.client();
        Ok(self
            .bounded(
                "grant the assigner lease",
                true,
                client.lease_grant(secs, None),
            )
            .await?
            .id())
    }

    /// Stores `change` if this node still holds the election of `fence`,
    /// the state is still what `view` read (its meta key's revision, or
    /// before the move to the per-service layout, `lb/state`'s) and no
    /// added address has a key yet. Writes only the service keys that
    /// changed, and the meta key. Returns whether it was stored.
    ///
    /// The first write in the per-service layout replaces `lb/state` by a
    /// marker in the same transaction, comparing its revision. When that
    /// write would pass etcd's limit on operations (a large state moving
    /// from the one-key layout), the service keys are written ahead in
    /// parts, fenced the same way but invisible until the meta key stands
    /// (readers take the per-service keys only with it): `Ok(false)`,
    /// and the next round goes on.
    ///
    /// # Errors
    /// etcd unavailable, or the new state does not split (an allocation of
    /// no service: a core bug, named).
    pub async fn lb_commit(
        &mut self,
        fence: i64,
        view: &LbView,
        change: &LbChange,
    ) -> Result<bool, ClusterStoreError> {
        let parts = lockstep_core::lb::cluster::split(&change.state)
            .map_err(|e| ClusterStoreError::Invalid(e.to_string()))?;
        let old = StoredState {
            meta: parts.meta.clone(),
            services: view.stored.clone(),
        };
        let d = lockstep_core::lb::cluster::diff(Some(&old), &parts);
        let meta_key = self.lb_key("assigned/meta");
        let state_rev = view.meta.as_ref().map_or(0, |(_, r)| *r);
        let mut when = vec![
            Compare::create_revision(self.lb_key("assigner"), CompareOp::Equal, fence),
            Compare::mod_revision(meta_key.clone(), CompareOp::Equal, state_rev),
        ];
        let moving = view.meta.is_none();
        if moving {
            when.push(Compare::mod_revision(
                self.lb_key("state"),
                CompareOp::Equal,
                view.legacy,
            ));
        }
        let mut keys = Vec::new();
        for (id, stored) in &d.put {
            let key = self.lb_key(&format!("assigned/services/{id}"));
            let v = serde_json::to_vec(stored).map_err(|e| corrupt(&key, e))?;
            keys.push(TxnOp::put(key, v, None));
        }
        for id in &d.delete {
            keys.push(TxnOp::delete(
                self.lb_key(&format!("assigned/services/{id}")),
                None,
            ));
        }
        let addresses = change.added.len() + change.updated.len() + change.removed.len();
        let total = keys.len() + addresses + 2;
        if moving && (total > MAX_TXN_OPS || when.len() + change.added.len() > MAX_TXN_OPS) {
            // Written ahead, in parts: nobody reads them before the meta
            // key stands.
            let part: Vec<TxnOp> = keys.into_iter().take(MAX_TXN_OPS).collect();
            let txn = Txn::new().when(when).and_then(part);
            self.txn_write("store the lb state ahead of its move", &txn)
                .await?;
            return Ok(false);
        }
        let value = serde_json::to_vec(&parts.meta).map_err(|e| corrupt(&meta_key, e))?;
        let mut ops = vec![TxnOp::put(meta_key, value, None)];
        ops.extend(keys);
        if moving {
            let marker = serde_json::to_vec(MOVED).map_err(|e| corrupt("lb/state", e))?;
            ops.push(TxnOp::put(self.lb_key("state"), marker, None));
        }
        for (a, users) in &change.added {
            let key = self.lb_key(&format!("addresses/{a}"));
            when.push(Compare::create_revision(key.clone(), CompareOp::Equal, 0));
            let v = serde_json::to_vec(users).map_err(|e| corrupt(&key, e))?;
            ops.push(TxnOp::put(key, v, None));
        }
        for (a, users) in &change.updated {
            let key = self.lb_key(&format!("addresses/{a}"));
            let v = serde_json::to_vec(users).map_err(|e| corrupt(&key, e))?;
            ops.push(TxnOp::put(key, v, None));
        }
        for a in &change.removed {
            ops.push(TxnOp::delete(self.lb_key(&format!("addresses/{a}")), None));
        }
        let txn = Txn::new().when(when).and_then(ops);
        Ok(self
            .txn_write("store the lb state", &txn)
            .await?
            .succeeded())
    }

    /// One assigner round for `node` holding `lease`: campaign when no
    /// node leads (the mirror says who does: no request while it is
    /// known, #27 item 6), and if this node leads, bring the stored state
    /// to the stored pools and services (at most [`NEW_SERVICES_PER_ROUND`]
    /// new services at a time, and no more taken in or out than one
    /// transaction holds) and store it fenced.
    ///
    /// # Errors
    /// etcd unavailable, a stored value unreadable, or the core refusing
    /// the stored definitions (a bad pool or service: named).
    pub async fn lb_round(&mut self, node: &str, lease: i64) -> Result<Round, ClusterStoreError> {
        let view = self.lb_read().await?;
        let fence = match &view.assigner {
            Some((n, rev)) if n == node && view.assigner_lease == lease => *rev,
            Some((n, _)) => {
                return Ok(Round::Follower {
                    assigner: n.clone(),
                });
            }
            None => match self.lb_campaign(node, lease).await? {
                Some(rev) => rev,
                None => {
                    let view = self.lb_read().await?;
                    return Ok(Round::Follower {
                        assigner: view.assigner.clone().map(|a| a.0).unwrap_or_default(),
                    });
                }
            },
        };
        // Read after the campaign: the mirror has seen this node's
        // election (the door waits for its own writes).
        let view = self.lb_read().await?;
        let state = view.state.as_ref().map(|(s, _)| s);
        let in_state: BTreeSet<String> = state
            .map(|s| s.services.iter().map(|r| r.spec.id()).collect())
            .unwrap_or_default();
        // Services taken in and out this round; halved until the
        // transaction fits.
        let mut limit = NEW_SERVICES_PER_ROUND;
        let change = loop {
            let mut services: Vec<ServiceSpec> = Vec::new();
            let mut new = 0;
            for (id, spec) in &view.services {
                if in_state.contains(id) {
                    services.push(spec.clone());
                } else if new < limit {
                    services.push(spec.clone());
                    new += 1;
                }
            }
            // Services no longer stored leave `limit` at a time: the others
            // stay this round, as the state has them.
            let mut leaving = 0;
            for r in state.iter().flat_map(|s| s.services.iter()) {
                if !view.services.contains_key(&r.spec.id()) {
                    leaving += 1;
                    if leaving > limit {
                        services.push(r.spec.clone());
                    }
                }
            }
            let change = reconcile(state, view.pools.values().cloned().collect(), services)
                .map_err(|e| ClusterStoreError::Invalid(e.to_string()))?;
            let writes = change.added.len() * 2 + change.updated.len() + change.removed.len() * 2;
            if writes + 2 <= MAX_TXN_OPS || limit == 1 {
                break change;
            }
            limit = (limit / 2).max(1);
        };
        // A state still in the one-key layout moves even when nothing in
        // it changes.
        let moving = view.meta.is_none() && view.state.is_some();
        if !change.changed && !moving {
            return Ok(Round::Idle);
        }
        if self.lb_commit(fence, &view, &change).await? {
            Ok(Round::Stored {
                added: change.added.len(),
                removed: change.removed.len(),
            })
        } else {
            Ok(Round::Lost)
        }
    }
}
