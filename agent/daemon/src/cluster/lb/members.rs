//! An LB member's side in etcd: its membership (`lb/members/<node>`,
//! labels and whether it answers), the lease its LB keys are bound to, and
//! the announcement keys (`lb/announce/<ip>`) through which exactly one
//! node answers for each address. Split from [`super`], which keeps the
//! assigner's side (the view, the state and its fenced transactions).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use etcd_client::{Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp};
use lockstep_core::lb::cluster::{AnnouncePlan, Candidate, ToAnnounce, announce_plan, assigned};
use lockstep_core::lb::{LabelSelector, LbIpam};

use super::corrupt;
use crate::cluster::{ClusterStoreError, Door};

/// The value of `lb/members/<node>`.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Member {
    name: String,
    #[serde(default)]
    labels: BTreeMap<String, String>,
    /// Whether the node can answer for an address (it has an uplink). An
    /// agent before this field joined only with an uplink configured or
    /// not at all: absent reads as true.
    #[serde(default = "answers_by_default")]
    answers: bool,
}

fn answers_by_default() -> bool {
    true
}

/// A `lb/members/<node>` value read: its labels and whether it answers.
/// An agent before node labels stored its plain name: no labels, answers.
/// A broken value is an error (the caller names the key).
pub(super) fn read_member(value: &[u8]) -> Result<(BTreeMap<String, String>, bool), String> {
    if value.starts_with(b"{") {
        let m = serde_json::from_slice::<Member>(value).map_err(|e| e.to_string())?;
        Ok((m.labels, m.answers))
    } else {
        Ok((BTreeMap::new(), true))
    }
}

/// Each address's node selector, as [`announce_plan`] takes them.
pub fn selectors(to: &BTreeMap<IpAddr, ToAnnounce>) -> BTreeMap<IpAddr, LabelSelector> {
    to.iter()
        .map(|(a, t)| (*a, t.node_selector.clone()))
        .collect()
}

impl Door {
    /// Every announcement key: address → (node, lease).
    ///
    /// # Errors
    /// etcd unavailable, or a key unreadable.
    pub async fn lb_announcements(
        &mut self,
    ) -> Result<BTreeMap<IpAddr, (String, i64)>, ClusterStoreError> {
        let base = self.lb_key("announce/");
        let mut client = self.client();
        let resp = self
            .bounded(
                "read lb announcements",
                false,
                client.get(base.clone(), Some(GetOptions::new().with_prefix())),
            )
            .await?;
        let mut out = BTreeMap::new();
        for kv in resp.kvs() {
            let key = String::from_utf8_lossy(kv.key()).into_owned();
            let a: IpAddr = key[base.len()..].parse().map_err(|e| corrupt(&key, e))?;
            out.insert(
                a,
                (String::from_utf8_lossy(kv.value()).into_owned(), kv.lease()),
            );
        }
        Ok(out)
    }

    /// Takes the announcement of `address` for `node` under `lease`, only
    /// if no node holds it; returns whether this node holds it now.
    ///
    /// # Errors
    /// etcd unavailable.
    pub async fn lb_announce(
        &mut self,
        address: IpAddr,
        node: &str,
        lease: i64,
    ) -> Result<bool, ClusterStoreError> {
        let key = self.lb_key(&format!("announce/{address}"));
        Ok(self
            .hold_under_lease(key, node, lease, "take an lb announcement")
            .await?
            .is_some())
    }

    /// Withdraws `node`'s announcement of `address` (only if it is still
    /// `node`'s); call after the responder stopped answering. Returns
    /// whether a key was deleted.
    ///
    /// # Errors
    /// etcd unavailable.
    pub async fn lb_withdraw(
        &mut self,
        address: IpAddr,
        node: &str,
    ) -> Result<bool, ClusterStoreError> {
        let key = self.lb_key(&format!("announce/{address}"));
        let txn = Txn::new()
            .when([Compare::value(
                key.clone(),
                CompareOp::Equal,
                node.as_bytes().to_vec(),
            )])
            .and_then([TxnOp::delete(key, None)]);
        let mut client = self.client();
        let resp = self
            .bounded("withdraw an lb announcement", true, client.txn(txn))
            .await?;
        self.wrote_at(resp.header().map_or(0, |h| h.revision()));
        Ok(resp.succeeded())
    }

    /// Grants a lease of `ttl` (whole seconds, at least 1) for this node's
    /// LB keys; returns its id and the TTL etcd granted (etcd may raise a
    /// short one to its minimum: the datapath's expiry is computed from
    /// what was granted).
    ///
    /// # Errors
    /// etcd unavailable.
    pub async fn lb_grant(&mut self, ttl: Duration) -> Result<(i64, Duration), ClusterStoreError> {
        let secs = i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX);
        let mut client = self.client();
        let resp = self
            .bounded("grant the lb lease", true, client.lease_grant(secs, None))
            .await?;
        let granted = u64::try_from(resp.ttl()).unwrap_or(0).max(1);
        Ok((resp.id(), Duration::from_secs(granted)))
    }

    /// Revokes `lease`: every key bound to it (announcements, membership,
    /// the assigner key) is deleted at once.
    ///
    /// # Errors
    /// etcd unavailable.
    pub async fn lb_revoke(&mut self, lease: i64) -> Result<(), ClusterStoreError> {
        let mut client = self.client();
        let resp = self
            .bounded("revoke the lb lease", true, client.lease_revoke(lease))
            .await?;
        // A read of `lb/` after it (from the mirror) has the lease's keys
        // gone.
        self.wrote_at(resp.header().map_or(0, |h| h.revision()));
        Ok(())
    }

    /// Seconds left on `lease` as etcd counts them (`None`: gone).
    ///
    /// # Errors
    /// etcd unavailable.
    pub async fn lb_lease_left(&mut self, lease: i64) -> Result<Option<i64>, ClusterStoreError> {
        let mut client = self.client();
        let ttl = self
            .bounded(
                "read an lb lease",
                false,
                client.lease_time_to_live(lease, None),
            )
            .await?
            .ttl();
        Ok((ttl > 0).then_some(ttl))
    }

    /// Makes `node`, with its `labels`, a member for as long as `lease`
    /// lives: a candidate announcer if it `answers` (has an uplink), a
    /// candidate assigner either way.
    ///
    /// # Errors
    /// etcd unavailable.
    pub async fn lb_join(
        &mut self,
        node: &str,
        labels: &BTreeMap<String, String>,
        answers: bool,
        lease: i64,
    ) -> Result<(), ClusterStoreError> {
        let key = self.lb_key(&format!("members/{node}"));
        let value = serde_json::to_vec(&Member {
            name: node.to_string(),
            labels: labels.clone(),
            answers,
        })
        .map_err(|e| ClusterStoreError::Invalid(e.to_string()))?;
        let mut client = self.client();
        let resp = self
            .bounded(
                "join the lb announcers",
                true,
                client.put(key, value, Some(PutOptions::new().with_lease(lease))),
            )
            .await?;
        self.wrote_at(resp.header().map_or(0, |h| h.revision()));
        Ok(())
    }

    /// What `me` should do about announcements now: the addresses of the
    /// stored state, the live nodes (their lease-bound node keys) and the
    /// announcement keys, through the core's [`announce_plan`]. The caller
    /// acts on it: stops answering before [`Door::lb_withdraw`], answers
    /// only after [`Door::lb_announce`] succeeded.
    ///
    /// # Errors
    /// etcd unavailable, or stored values unreadable.
    pub async fn lb_announce_plan(&mut self, me: &str) -> Result<AnnouncePlan, ClusterStoreError> {
        let view = self.lb_read().await?;
        // Every assigned address, each with its pool's node selector when
        // the pool announces (none otherwise); the registered nodes, with
        // the labels their LB membership publishes.
        let selectors = selectors(&view.to_announce()?);
        let addresses: BTreeMap<IpAddr, LabelSelector> = match &view.state {
            Some((state, _)) => {
                let lb = LbIpam::restore(state).map_err(|e| corrupt("lb/state", e))?;
                assigned(&lb)
                    .into_keys()
                    .map(|a| (a, selectors.get(&a).cloned().unwrap_or_default()))
                    .collect()
            }
            None => BTreeMap::new(),
        };
        let nodes: Vec<Candidate> = self
            .nodes()
            .await?
            .iter()
            .map(|n| view.candidate(&n.record.name))
            .collect();
        let held = view
            .announcements
            .iter()
            .map(|(a, (n, _))| (*a, n.clone()))
            .collect();
        Ok(announce_plan(&addresses, &nodes, me, &held))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_member_value_with_labels_and_an_older_plain_one_both_read() {
        let labels = BTreeMap::from([("zone".to_string(), "b".to_string())]);
        for answers in [true, false] {
            let v = serde_json::to_vec(&Member {
                name: "node-1".into(),
                labels: labels.clone(),
                answers,
            })
            .unwrap();
            assert_eq!(read_member(&v).unwrap(), (labels.clone(), answers));
        }
        // Written by an agent before node labels: the plain name; before
        // "answers": a node that answers.
        assert_eq!(read_member(b"node-1").unwrap(), (BTreeMap::new(), true));
        assert_eq!(
            read_member(br#"{"name": "n"}"#).unwrap(),
            (BTreeMap::new(), true)
        );
        // A broken value is named, not taken as "no labels".
        let e = read_member(b"{\"name\": 1}").unwrap_err();
        assert!(e.contains("invalid type"), "{e}");
        let e = read_member(br#"{"name": "n", "answers": "yes"}"#).unwrap_err();
        assert!(e.contains("invalid type"), "{e}");
    }
}
