//! The pass on doubles: etcd's nodes in memory, with the removal rule
//! reduced to "due or not", and pods bound in memory.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use super::*;

#[derive(Default)]
struct Etcd {
    state: Mutex<NodesState>,
    /// Nodes the removal rule lets go (gone for reclaim_after).
    due: Mutex<BTreeSet<String>>,
    reserved: Mutex<BTreeMap<String, Vec<IpAddr>>>,
    writes: Mutex<Vec<String>>,
}

impl NodesBackend for Etcd {
    async fn is_writer(&self) -> Result<bool, KubeError> {
        Ok(self.state.lock().unwrap().writer)
    }
    async fn state(&self) -> Result<NodesState, KubeError> {
        let mut s = self.state.lock().unwrap().clone();
        s.reserved = self.reserved.lock().unwrap().keys().cloned().collect();
        Ok(s)
    }
    async fn remove(&self, node: &str) -> Result<Freed, KubeError> {
        if !self.due.lock().unwrap().contains(node) {
            return Err(KubeError::Refused {
                reason: format!("node {node} not gone for reclaim_after"),
            });
        }
        self.writes.lock().unwrap().push(format!("remove {node}"));
        self.state.lock().unwrap().holders.remove(node);
        let a: IpAddr = "10.0.0.5".parse().unwrap();
        self.reserved
            .lock()
            .unwrap()
            .insert(node.to_string(), vec![a]);
        Ok(Freed {
            blocks: vec!["10.0.0.0/28".parse().unwrap()],
            addresses: vec![a],
        })
    }
    async fn release(&self, node: &str) -> Result<Freed, KubeError> {
        self.writes.lock().unwrap().push(format!("release {node}"));
        let addresses = self
            .reserved
            .lock()
            .unwrap()
            .remove(node)
            .unwrap_or_default();
        Ok(Freed {
            blocks: vec![],
            addresses,
        })
    }
}

#[derive(Default)]
struct Pods {
    bound: Mutex<BTreeSet<String>>,
    down: Mutex<bool>,
}

impl BoundPods for Pods {
    async fn any_bound(&self, node: &str) -> Result<bool, KubeError> {
        if *self.down.lock().unwrap() {
            return Err(KubeError::Lb {
                reason: "api down".into(),
            });
        }
        Ok(self.bound.lock().unwrap().contains(node))
    }
}

fn names(v: &[&str]) -> BTreeSet<String> {
    v.iter().map(|s| (*s).to_string()).collect()
}

fn etcd(writer: bool, alive: &[&str], holders: &[&str]) -> Etcd {
    let e = Etcd::default();
    *e.state.lock().unwrap() = NodesState {
        writer,
        alive: names(alive),
        holders: names(holders),
        reserved: BTreeSet::new(),
    };
    e
}

#[tokio::test]
async fn only_the_writer_acts_and_a_live_node_keeps_its_blocks() {
    let e = etcd(false, &[], &["b"]);
    e.due.lock().unwrap().insert("b".into());
    let pods = Pods::default();
    assert_eq!(pass(&e, &pods, &names(&["b"])).await.unwrap(), None);
    assert!(e.writes.lock().unwrap().is_empty());
    // The writer, the node's agent still holding its lease.
    let e = etcd(true, &["b"], &["b"]);
    e.due.lock().unwrap().insert("b".into());
    let out = pass(&e, &pods, &names(&["b"])).await.unwrap().unwrap();
    assert_eq!(out, vec![("b".to_string(), Outcome::Kept)]);
    assert!(e.writes.lock().unwrap().is_empty());
}

#[tokio::test]
async fn removed_when_due_then_reserved_released_once_no_pod_is_bound() {
    let e = etcd(true, &["a"], &["a", "b"]);
    let pods = Pods::default();
    pods.bound.lock().unwrap().insert("b".into());
    let deleted = names(&["b"]);
    // Not gone for reclaim_after yet: refused, nothing written.
    let out = pass(&e, &pods, &deleted).await.unwrap().unwrap();
    assert!(matches!(&out[0].1, Outcome::NotDue(r) if r.contains("reclaim_after")));
    assert!(e.writes.lock().unwrap().is_empty());
    // Due: removed; its addresses reserved.
    e.due.lock().unwrap().insert("b".into());
    let out = pass(&e, &pods, &deleted).await.unwrap().unwrap();
    assert!(matches!(&out[0].1, Outcome::Removed(f) if f.addresses.len() == 1));
    // A pod still bound keeps them; an API that does not answer too.
    let out = pass(&e, &pods, &deleted).await.unwrap().unwrap();
    assert_eq!(out[0].1, Outcome::Kept);
    pods.bound.lock().unwrap().clear();
    *pods.down.lock().unwrap() = true;
    let out = pass(&e, &pods, &deleted).await.unwrap().unwrap();
    assert_eq!(out[0].1, Outcome::Kept);
    *pods.down.lock().unwrap() = false;
    let out = pass(&e, &pods, &deleted).await.unwrap().unwrap();
    assert!(
        matches!(&out[0].1, Outcome::Released(f) if f.addresses == vec!["10.0.0.5".parse::<IpAddr>().unwrap()])
    );
    let out = pass(&e, &pods, &deleted).await.unwrap().unwrap();
    assert_eq!(out[0].1, Outcome::Done);
    assert_eq!(
        *e.writes.lock().unwrap(),
        vec!["remove b".to_string(), "release b".to_string()]
    );
}
