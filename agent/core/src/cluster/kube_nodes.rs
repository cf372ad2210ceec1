//! Nodes deleted from the Kubernetes API (#29 item 4): what the Kubernetes
//! door's one elected writer does about a cluster node whose `Node` object
//! it saw and then saw deleted.
//!
//! Why here: the step is a decision, and a dangerous one (it frees
//! addresses another node may then hand out). The rule is the operator's
//! `lockstep cluster node remove` without `--force`:
//! - a node whose agent still holds its lease keeps everything: a Node
//!   deleted while its agent runs is an operator's mistake or a Node being
//!   re-registered, and the agent's own pods still use its blocks;
//! - a node still holding blocks (or its routing key) is removed through
//!   the same guarded removal as the CLI's, which refuses until the lease
//!   has been recorded gone for `reclaim_after`
//!   ([`check_node_removal`](super::check_node_removal));
//! - what only a deleted Node adds: the addresses the node last published
//!   as in use stay reserved after its blocks are freed (so no other node
//!   hands them out while its pods may still run). Nothing else ever
//!   releases them once the node is gone for good, so they are released
//!   when its Node is deleted **and** the API binds no pod to it any more
//!   (the pod garbage collector deletes the pods of a deleted Node); a
//!   pod still bound keeps them all.
//!
//! Only Nodes this writer saw and then saw go are judged: a node name the
//! API never showed (a node outside Kubernetes, a Node name that differs
//! from the etcd name) is never touched.

use std::collections::BTreeSet;

/// What the writer knows of one cluster node whose Node was deleted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeletedNode {
    /// Its agent holds a lease in etcd.
    pub alive: bool,
    /// It still holds blocks or its routing key.
    pub holds: bool,
    /// Addresses are reserved for it (`reserved/<node>`).
    pub reserved: bool,
    /// Pods the API still binds to it (`spec.nodeName`); `None`: not
    /// known (the API did not answer).
    pub pods_bound: Option<usize>,
}

/// The step for one deleted Node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeStep {
    /// Nothing now: alive, or pods still bound, or not known.
    Keep,
    /// Remove it as `cluster node remove` does (refused until due).
    Remove,
    /// Release the addresses reserved for it.
    ReleaseReserved,
    /// Nothing of it is left in etcd: forget it.
    Done,
}

/// The step for `node`.
pub fn deleted_node_step(node: DeletedNode) -> NodeStep {
    if node.alive {
        return NodeStep::Keep;
    }
    if node.holds {
        return NodeStep::Remove;
    }
    match (node.reserved, node.pods_bound) {
        (false, _) => NodeStep::Done,
        (true, Some(0)) => NodeStep::ReleaseReserved,
        (true, _) => NodeStep::Keep,
    }
}

/// The Nodes to judge: names `seen` in the API earlier and absent from
/// `now`; `seen` grows by `now` (so a Node created again is no longer
/// deleted, and one never seen is never judged).
pub fn deleted_nodes(seen: &mut BTreeSet<String>, now: &BTreeSet<String>) -> BTreeSet<String> {
    seen.extend(now.iter().cloned());
    seen.difference(now).cloned().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn an_alive_node_keeps_everything_and_a_holder_is_removed_by_the_cli_rule() {
        let alive = DeletedNode {
            alive: true,
            holds: true,
            reserved: true,
            pods_bound: Some(0),
        };
        assert_eq!(deleted_node_step(alive), NodeStep::Keep);
        let gone = DeletedNode {
            alive: false,
            ..alive
        };
        assert_eq!(deleted_node_step(gone), NodeStep::Remove);
        let freed = DeletedNode {
            holds: false,
            ..gone
        };
        assert_eq!(deleted_node_step(freed), NodeStep::ReleaseReserved);
        for bound in [Some(1), None] {
            let kept = DeletedNode {
                pods_bound: bound,
                ..freed
            };
            assert_eq!(deleted_node_step(kept), NodeStep::Keep);
        }
        let empty = DeletedNode {
            reserved: false,
            ..freed
        };
        assert_eq!(deleted_node_step(empty), NodeStep::Done);
    }

    #[test]
    fn only_nodes_seen_and_gone_are_deleted() {
        let set = |v: &[&str]| v.iter().map(|s| (*s).to_string()).collect::<BTreeSet<_>>();
        let mut seen = BTreeSet::new();
        assert!(deleted_nodes(&mut seen, &set(&["a", "b"])).is_empty());
        assert_eq!(deleted_nodes(&mut seen, &set(&["a"])), set(&["b"]));
        // Created again: no longer deleted.
        assert!(deleted_nodes(&mut seen, &set(&["a", "b"])).is_empty());
        // Never seen: never judged.
        assert_eq!(deleted_nodes(&mut seen, &set(&["c"])), set(&["a", "b"]));
    }

    proptest! {
        /// Nothing is taken from a live node, and reserved addresses are
        /// released only when the API binds no pod to the node and it
        /// holds no block.
        #[test]
        fn never_takes_from_the_living_or_releases_under_bound_pods(
            alive: bool, holds: bool, reserved: bool, bound in proptest::option::of(0usize..3),
        ) {
            let n = DeletedNode { alive, holds, reserved, pods_bound: bound };
            let step = deleted_node_step(n);
            if alive {
                prop_assert_eq!(step, NodeStep::Keep);
            }
            if step == NodeStep::ReleaseReserved {
                prop_assert!(!alive && !holds && reserved && bound == Some(0));
            }
            if step == NodeStep::Done {
                prop_assert!(!alive && !holds && !reserved);
            }
        }
    }
}
