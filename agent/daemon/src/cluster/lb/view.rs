//! Everything under `lb/` as one read: the view every LB task works from.
//! Split from [`super`] because of how it is made (#47 item 2): once per
//! change of `lb/` for every reader of the mirror, and from the last view
//! with only the keys changed since written in. At thousands of members,
//! a membership rewritten changes one entry of a persistent map shared
//! with the last view, instead of parsing and copying every key again.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::{Arc, OnceLock};

use lockstep_core::lb::cluster::{
    Candidate, LbMeta, StoredService, StoredState, ToAnnounce, to_announce,
};
use lockstep_core::lb::members::Members;
use lockstep_core::lb::{LbIpam, LbPoolSpec, LbSnapshot, ServiceSpec};

use super::members::read_member;
use super::{corrupt, json_once};
use crate::cluster::mirror::{Changes, Cursor};
use crate::cluster::{ClusterStoreError, Door, Kv};

/// Everything under `lb/`, read at one revision.
#[derive(Clone, Debug, Default)]
pub struct LbView {
    /// Pools by name.
    pub pools: BTreeMap<String, LbPoolSpec>,
    /// Services by `namespace/name`.
    pub services: BTreeMap<String, ServiceSpec>,
    /// The stored state and the mod revision of the key fencing it (the
    /// meta key; `lb/state` while the state is still in the one-key layout
    /// of older agents).
    pub state: Option<(LbSnapshot, i64)>,
    /// The per-service keys of the state (`lb/assigned/services/`), also
    /// those written ahead of a move from the one-key layout.
    pub stored: BTreeMap<String, StoredService>,
    /// The meta key and its mod revision (`None`: the state is not in the
    /// per-service layout yet).
    pub meta: Option<(LbMeta, i64)>,
    /// `lb/state`'s mod revision (0: absent), which the first write in
    /// the per-service layout compares and replaces by a marker.
    pub legacy: i64,
    /// Address keys: address → services.
    pub addresses: BTreeMap<IpAddr, BTreeSet<String>>,
    /// The elected assigner and its key's create revision.
    pub assigner: Option<(String, i64)>,
    /// The lease the assigner key is bound to.
    pub assigner_lease: i64,
    /// Announcement keys: address → (node, lease).
    pub announcements: BTreeMap<IpAddr, (String, i64)>,
    /// Nodes running the LB agent (`lb/members/<node>`), each under its
    /// membership's lease, with the labels it publishes (`[cluster]
    /// node_labels`, for pools' node selectors) and whether it can answer
    /// for an address (a member without an uplink may be the assigner but
    /// never announces). Shared with the views made from this one.
    pub members: Members,
    /// The store revision of the read.
    pub revision: i64,
    /// The one-key state of older agents (`lb/state`), while no meta key
    /// stands.
    legacy_state: Option<(LbSnapshot, i64)>,
    /// Where the mirror stood when this view was made: the next view is
    /// this one with the keys changed since (`None`: made from etcd, or
    /// not from a live mirror; the next is read whole).
    cursor: Option<Cursor>,
    /// [`LbView::to_announce`], once made (kept by the next view while
    /// the state does not change).
    announced: OnceLock<BTreeMap<IpAddr, ToAnnounce>>,
}

impl LbView {
    /// The live members as announcer candidates: with their labels and
    /// whether they answer.
    pub fn candidates(&self) -> impl Iterator<Item = &Candidate> + Clone {
        self.members.iter().map(|(c, _)| c)
    }

    /// `node` as an announcer candidate: its membership's labels and
    /// whether it answers (a node without membership answers: only the
    /// membership says otherwise).
    pub fn candidate(&self, node: &str) -> Candidate {
        self.members
            .of(node)
            .last()
            .map(|(c, _)| c.clone())
            .unwrap_or_else(|| Candidate {
                name: node.to_string(),
                labels: BTreeMap::new(),
                answers: true,
            })
    }

    /// The stored state's announced addresses, each with its pool and
    /// that pool's node selector.
    ///
    /// # Errors
    /// The stored state does not restore.
    pub fn to_announce(&self) -> Result<BTreeMap<IpAddr, ToAnnounce>, ClusterStoreError> {
        // Made once per view: every LB agent reading the same mirror
        // shares it (restoring thousands of services is not free).
        if let Some(made) = self.announced.get() {
            return Ok(made.clone());
        }
        let made = match &self.state {
            Some((state, _)) => {
                let lb = LbIpam::restore(state).map_err(|e| corrupt("lb/state", e))?;
                to_announce(&lb)
            }
            None => BTreeMap::new(),
        };
        Ok(self.announced.get_or_init(|| made).clone())
    }

    /// Writes in key `key` (`rest`: its name under `lb/`) as it is now
    /// (`None`: deleted). Returns whether it is one of the stored state's
    /// keys (then [`LbView::join_state`] is due).
    fn apply(&mut self, key: &str, rest: &str, kv: Option<&Kv>) -> Result<bool, ClusterStoreError> {
        if let Some(name) = rest.strip_prefix("pools/") {
            let spec = kv.map(|kv| json_once(kv, "lb/pools/")).transpose()?;
            put(&mut self.pools, name.to_string(), spec);
        } else if let Some(id) = rest.strip_prefix("services/") {
            let spec = kv.map(|kv| json_once(kv, "lb/services/")).transpose()?;
            put(&mut self.services, id.to_string(), spec);
        } else if rest == "state" {
            self.legacy = kv.map_or(0, |kv| kv.mod_revision);
            // The marker left by the move to `lb/assigned/` is a JSON
            // string; anything else is the old one-key state.
            self.legacy_state = match kv {
                Some(kv) if serde_json::from_slice::<String>(&kv.value).is_err() => {
                    let state: LbSnapshot =
                        serde_json::from_slice(&kv.value).map_err(|e| corrupt(key, e))?;
                    Some((state, kv.mod_revision))
                }
                _ => None,
            };
            return Ok(true);
        } else if rest == "assigned/meta" {
            self.meta = match kv {
                Some(kv) => {
                    let meta: LbMeta =
                        serde_json::from_slice(&kv.value).map_err(|e| corrupt(key, e))?;
                    Some((meta, kv.mod_revision))
                }
                None => None,
            };
            return Ok(true);
        } else if let Some(id) = rest.strip_prefix("assigned/services/") {
            let stored = kv
                .map(|kv| json_once(kv, "lb/assigned/services/"))
                .transpose()?;
            put(&mut self.stored, id.to_string(), stored);
            return Ok(true);
        } else if let Some(addr) = rest.strip_prefix("addresses/") {
            let a: IpAddr = addr.parse().map_err(|e| corrupt(key, e))?;
            let users = kv
                .map(|kv| serde_json::from_slice(&kv.value).map_err(|e| corrupt(key, e)))
                .transpose()?;
            put(&mut self.addresses, a, users);
        } else if let Some(addr) = rest.strip_prefix("announce/") {
            let a: IpAddr = addr.parse().map_err(|e| corrupt(key, e))?;
            let holder = kv.map(|kv| (String::from_utf8_lossy(&kv.value).into_owned(), kv.lease));
            put(&mut self.announcements, a, holder);
        } else if let Some(node) = rest.strip_prefix("members/") {
            self.members.remove_node(node);
            if let Some(kv) = kv {
                let (labels, answers) = kv
                    .parse_once("lb/members/", |kv| read_member(&kv.value))
                    .map_err(|e| corrupt(key, e))?;
                let candidate = Candidate {
                    name: node.to_string(),
                    labels,
                    answers,
                };
                self.members.insert(candidate, kv.lease);
            }
        } else if rest == "assigner" {
            match kv {
                Some(kv) => {
                    self.assigner = Some((
                        String::from_utf8_lossy(&kv.value).into_owned(),
                        kv.create_revision,
                    ));
                    self.assigner_lease = kv.lease;
                }
                None => {
                    self.assigner = None;
                    self.assigner_lease = 0;
                }
            }
        }
        Ok(false)
    }

    /// Makes the stored state from its keys again: the per-service layout
    /// once its meta key stands; before, the one-key state of older agents
    /// (per-service keys written ahead of the move are not the state yet).
    fn join_state(&mut self) {
        self.state = match &self.meta {
            Some((meta, rev)) => Some((
                lockstep_core::lb::cluster::join(&StoredState {
                    meta: meta.clone(),
                    services: self.stored.clone(),
                }),
                *rev,
            )),
            None => self.legacy_state.clone(),
        };
        self.announced = OnceLock::new();
    }
}

/// Sets `key` in `map` to `value` (`None`: removes it).
fn put<K: Ord, V>(map: &mut BTreeMap<K, V>, key: K, value: Option<V>) {
    match value {
        Some(v) => {
            map.insert(key, v);
        }
        None => {
            map.remove(&key);
        }
    }
}

impl Door {
    /// Reads everything under `lb/` at one revision.
    ///
    /// # Errors
    /// etcd unavailable, or a stored value unreadable.
    pub async fn lb_read(&mut self) -> Result<Arc<LbView>, ClusterStoreError> {
        let Some(link) = self.options().link.clone() else {
            return Ok(Arc::new(self.lb_parse().await?));
        };
        let mirror = link.mirror();
        // Made once per change of `lb/` for every reader of the mirror.
        if let Some(view) = mirror.made::<LbView>("lb/")
            && view.revision >= self.written()
        {
            return Ok(view);
        }
        // The watch broke a moment ago (a member stopped, say): the last
        // view was etcd's state until then, and serves while the watch
        // resumes, rather than every reader reading `lb/` every tick at
        // the moment etcd is weakest. Not past this node's own writes,
        // nor for longer than `mirror::RESUMING`.
        if mirror.resuming()
            && let Some(last) = mirror.last_made::<LbView>("lb/")
            && last.revision >= self.written()
        {
            return Ok(last);
        }
        let at = mirror.stamp(&["lb/"]);
        let followed = mirror
            .last_made::<LbView>("lb/")
            .map(|last| self.lb_follow(&last))
            .transpose()?
            .flatten();
        let view = match followed {
            Some(v) => v,
            None => {
                // Where the mirror stands before the read: what changes
                // after comes again with the next view's keys (applying a
                // key twice is harmless). Kept only when the read is not
                // ahead of the mirror (it came from the mirror, or from
                // etcd at a revision the mirror has seen), so a key the
                // mirror has not seen yet is never written back older.
                let before = self.changes(&["lb/"], None).map(|(_, c)| c);
                let mut v = self.lb_parse().await?;
                let after = self.changes(&["lb/"], None).map(|(_, c)| c);
                v.cursor = before.filter(|_| after.is_some_and(|c| c.revision() >= v.revision));
                v
            }
        };
        let view = Arc::new(view);
        if at.live {
            mirror.keep("lb/", at, view.clone());
        }
        Ok(view)
    }

    /// `last` with the keys of `lb/` changed since it was made written in;
    /// `None` when it must be read whole (no cursor, the mirror read whole
    /// since or further ahead than it remembers, or not yet at this door's
    /// last write).
    fn lb_follow(&self, last: &LbView) -> Result<Option<LbView>, ClusterStoreError> {
        let Some(since) = last.cursor else {
            return Ok(None);
        };
        let Some((Changes::Keys(keys), now)) = self.changes(&["lb/"], Some(since)) else {
            return Ok(None);
        };
        if now.revision() < self.written() {
            return Ok(None);
        }
        let base = self.lb_key("");
        let mut view = last.clone();
        let mut state = false;
        for (key, kv) in &keys {
            let Some(rest) = key.strip_prefix(&base) else {
                continue;
            };
            state |= view.apply(key, rest, kv.as_deref())?;
        }
        if state {
            view.join_state();
        }
        view.revision = now.revision();
        view.cursor = Some(now);
        Ok(Some(view))
    }

    /// Reads everything under `lb/` whole (from the mirror while it is
    /// live: the LB agent reads this every tick).
    pub(super) async fn lb_parse(&mut self) -> Result<LbView, ClusterStoreError> {
        let base = self.lb_key("");
        let (kvs, revision) = self.list("read lb state", "lb/").await?;
        let mut view = LbView {
            revision,
            ..LbView::default()
        };
        for kv in &kvs {
            let rest = &kv.key[base.len()..];
            view.apply(&kv.key, rest, Some(kv))?;
        }
        view.join_state();
        Ok(view)
    }
}
