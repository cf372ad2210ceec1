//! Which Nodes may answer for LoadBalancer addresses (#44 item 4): the
//! rules the Kubernetes service controller keeps for cloud load balancers,
//! applied to the node that would announce.
//!
//! A node may not when:
//! - it carries the label `node.kubernetes.io/exclude-from-external-load-balancers`
//!   (any value), the operator's way to keep a node out of load balancing;
//! - it is cordoned (`spec.unschedulable`), as before a drain;
//! - its `Ready` condition is `False` or `Unknown`: its kubelet is not
//!   running its pods, or not heard from;
//! - it is being deleted.
//!
//! A Node with no `Ready` condition at all (one no kubelet has reported on
//! yet) is not refused for that.

use std::collections::BTreeMap;

/// The label that keeps a node out of load balancing.
pub const EXCLUDE_LABEL: &str = "node.kubernetes.io/exclude-from-external-load-balancers";

/// What of a Node decides whether it may answer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeState {
    /// `metadata.labels`.
    pub labels: BTreeMap<String, String>,
    /// `spec.unschedulable`.
    pub unschedulable: bool,
    /// The `Ready` condition's status (`True`, `False`, `Unknown`), if any.
    pub ready: Option<String>,
    /// `metadata.deletionTimestamp` is set.
    pub deleting: bool,
}

/// `Ok` when the node may answer for LoadBalancer addresses; otherwise why
/// not, as the agent logs it.
///
/// # Errors
/// The first rule that keeps it out.
pub fn may_answer(node: &NodeState) -> Result<(), String> {
    if node.labels.contains_key(EXCLUDE_LABEL) {
        return Err(format!("the Node is labelled {EXCLUDE_LABEL}"));
    }
    if node.unschedulable {
        return Err("the Node is cordoned (spec.unschedulable)".into());
    }
    if let Some(r) = node.ready.as_deref().filter(|r| *r != "True") {
        return Err(format!("the Node's Ready condition is {r}"));
    }
    if node.deleting {
        return Err("the Node is being deleted".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rule_keeps_a_node_out_and_names_itself() {
        let ok = NodeState {
            ready: Some("True".into()),
            ..NodeState::default()
        };
        assert_eq!(may_answer(&ok), Ok(()));
        assert_eq!(may_answer(&NodeState::default()), Ok(()), "never reported");
        let mut excluded = ok.clone();
        excluded.labels.insert(EXCLUDE_LABEL.into(), String::new());
        assert!(may_answer(&excluded).unwrap_err().contains(EXCLUDE_LABEL));
        let cordoned = NodeState {
            unschedulable: true,
            ..ok.clone()
        };
        assert!(may_answer(&cordoned).unwrap_err().contains("cordoned"));
        for r in ["False", "Unknown"] {
            let down = NodeState {
                ready: Some(r.into()),
                ..ok.clone()
            };
            assert!(may_answer(&down).unwrap_err().contains(r));
        }
        let going = NodeState {
            deleting: true,
            ..ok
        };
        assert!(may_answer(&going).unwrap_err().contains("deleted"));
    }
}
