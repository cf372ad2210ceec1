//! The LB definitions in etcd: pools (`lb/pools/<name>`) and services
//! (`lb/services/<ns>/<name>`) as `lockstep lb` and the Kubernetes door
//! store and delete them, each validated before anything is written. Split
//! from [`super`], which turns them into the assigned state.

use etcd_client::{Compare, CompareOp, Txn, TxnOp};
use lockstep_core::cluster::check_key_name;
use lockstep_core::lb::{LbPoolSpec, ServiceSpec};

use super::corrupt;
use crate::cluster::{ClusterStoreError, Door};

impl Door {
    /// Stores a pool (validated first: nothing is written for a bad one).
    ///
    /// # Errors
    /// An invalid pool, or etcd unavailable.
    pub async fn lb_put_pool(&mut self, spec: &LbPoolSpec) -> Result<(), ClusterStoreError> {
        spec.validate()
            .map_err(|e| ClusterStoreError::Invalid(e.to_string()))?;
        check_key_name("lb pool", &spec.name)?;
        let key = self.lb_key(&format!("pools/{}", spec.name));
        let value = serde_json::to_vec(spec).map_err(|e| corrupt(&key, e))?;
        let mut client = self.client();
        self.bounded("store an lb pool", true, client.put(key, value, None))
            .await?;
        Ok(())
    }

    /// Stores a service (validated first).
    ///
    /// # Errors
    /// An invalid service, or etcd unavailable.
    pub async fn lb_put_service(&mut self, spec: &ServiceSpec) -> Result<(), ClusterStoreError> {
        spec.validate()
            .map_err(|e| ClusterStoreError::Invalid(e.to_string()))?;
        check_key_name("service namespace", &spec.namespace)?;
        check_key_name("service", &spec.name)?;
        let key = self.lb_key(&format!("services/{}", spec.id()));
        let value = serde_json::to_vec(spec).map_err(|e| corrupt(&key, e))?;
        let mut client = self.client();
        self.bounded("store an lb service", true, client.put(key, value, None))
            .await?;
        Ok(())
    }

    /// Deletes a service (`namespace/name`); returns whether it existed.
    ///
    /// # Errors
    /// etcd unavailable.
    pub async fn lb_delete_service(&mut self, id: &str) -> Result<bool, ClusterStoreError> {
        let key = self.lb_key(&format!("services/{id}"));
        let mut client = self.client();
        Ok(self
            .bounded("delete an lb service", true, client.delete(key, None))
            .await?
            .deleted()
            > 0)
    }

    /// Stores `pools` and `services` in one transaction (at most 128 of
    /// them: etcd's default limit), only if no cluster pool was written
    /// after revision `cluster_pools_read_at` (the LB pools were checked
    /// against the cluster pools read then).
    ///
    /// # Errors
    /// Too many at once, a cluster pool changed since (nothing stored), or
    /// etcd unavailable.
    pub async fn lb_put(
        &mut self,
        pools: &[LbPoolSpec],
        services: &[ServiceSpec],
        cluster_pools_read_at: i64,
    ) -> Result<(), ClusterStoreError> {
        if pools.len() + services.len() > 128 {
            return Err(ClusterStoreError::Invalid(format!(
                "{} pools and services in one apply; at most 128",
                pools.len() + services.len()
            )));
        }
        for p in pools {
            check_key_name("lb pool", &p.name)?;
        }
        for s in services {
            check_key_name("service namespace", &s.namespace)?;
            check_key_name("service", &s.name)?;
        }
        let mut ops = Vec::new();
        for p in pools {
            let key = self.lb_key(&format!("pools/{}", p.name));
            let v = serde_json::to_vec(p).map_err(|e| corrupt(&key, e))?;
            ops.push(TxnOp::put(key, v, None));
        }
        for s in services {
            let key = self.lb_key(&format!("services/{}", s.id()));
            let v = serde_json::to_vec(s).map_err(|e| corrupt(&key, e))?;
            ops.push(TxnOp::put(key, v, None));
        }
        let unchanged = Compare::mod_revision(
            format!("{}pools/", self.options().prefix),
            CompareOp::Less,
            cluster_pools_read_at + 1,
        )
        .with_prefix();
        let mut client = self.client();
        let resp = self
            .bounded(
                "store lb pools and services",
                true,
                client.txn(Txn::new().when([unchanged]).and_then(ops)),
            )
            .await?;
        self.wrote_at(resp.header().map_or(0, |h| h.revision()));
        if !resp.succeeded() {
            return Err(ClusterStoreError::Conflict {
                what: "the cluster pools (changed while the lb pools were checked against them)"
                    .into(),
            });
        }
        Ok(())
    }

    /// Deletes services (`namespace/name`) and pools, all or none: a name
    /// that does not exist deletes nothing and is named.
    ///
    /// # Errors
    /// An unknown name, a concurrent delete, or etcd unavailable.
    pub async fn lb_delete(
        &mut self,
        services: &[String],
        pools: &[String],
    ) -> Result<(), ClusterStoreError> {
        let keys: Vec<(String, String)> = services
            .iter()
            .map(|s| {
                (
                    format!("service {s}"),
                    self.lb_key(&format!("services/{s}")),
                )
            })
            .chain(
                pools
                    .iter()
                    .map(|p| (format!("pool {p}"), self.lb_key(&format!("pools/{p}")))),
            )
            .collect();
        if keys.len() > 128 {
            return Err(ClusterStoreError::Invalid(format!(
                "{} deletions in one request; at most 128",
                keys.len()
            )));
        }
        let view = self.lb_read().await?;
        for (what, _) in &keys {
            let known = match what.split_once(' ') {
                Some(("service", id)) => view.services.contains_key(id),
                Some((_, name)) => view.pools.contains_key(name),
                None => false,
            };
            if !known {
                return Err(ClusterStoreError::Invalid(format!(
                    "no such {what} in etcd; nothing deleted"
                )));
            }
        }
        let when: Vec<Compare> = keys
            .iter()
            .map(|(_, k)| Compare::create_revision(k.clone(), CompareOp::Greater, 0))
            .collect();
        let ops: Vec<TxnOp> = keys
            .iter()
            .map(|(_, k)| TxnOp::delete(k.clone(), None))
            .collect();
        let mut client = self.client();
        let resp = self
            .bounded(
                "delete lb services and pools",
                true,
                client.txn(Txn::new().when(when).and_then(ops)),
            )
            .await?;
        self.wrote_at(resp.header().map_or(0, |h| h.revision()));
        let done = resp.succeeded();
        if !done {
            return Err(ClusterStoreError::Conflict {
                what: "an lb delete (a name was deleted meanwhile)".into(),
            });
        }
        Ok(())
    }
}
