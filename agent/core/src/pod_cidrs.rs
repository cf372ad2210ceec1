//! Pod IPAM from the Node's `spec.podCIDRs` (`[kubernetes] pod_cidr_pool`):
//! which CIDRs this node serves at start, from what the API said and what
//! the node recorded the last time.
//!
//! Why it is a decision of its own: the API may be away when the agent
//! starts (a control-plane upgrade), and the node's pods must keep their
//! addresses and new pods must get addresses from the same CIDRs. Kubernetes
//! never changes a Node's podCIDRs once set, so the record is as good as the
//! API's answer; but a Node deleted and made again under the same name can
//! come back with other CIDRs, and a single-stack Node can gain a second
//! family's CIDR: then the API wins, at start and while the agent runs
//! ([`follow`]). What the Node no longer lists drains: its holders keep
//! their addresses, nothing new comes from it.

use ipnet::IpNet;

use crate::pool::{PoolSpec, overlaps};

/// Where the served CIDRs came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// The Node, as the API gave it now.
    Node,
    /// The record of an earlier start (the API did not answer, or the
    /// Node has no podCIDRs yet).
    Record,
}

/// Why no CIDR can be served.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PodCidrError {
    /// Neither the Node nor a record gives a CIDR.
    #[error(
        "Node {node} has no spec.podCIDRs{api} and no earlier start recorded any: \
         the controller-manager assigns them with --allocate-node-cidrs (kubeadm, kind and \
         k3s do by default); or choose another pool source"
    )]
    Nothing {
        /// The Node's name.
        node: String,
        /// What the API said, for the message.
        api: &'static str,
    },
    /// A CIDR is not one a pool can hold.
    #[error("Node {node}'s podCIDR {cidr} is not a network address")]
    Bad {
        /// The Node's name.
        node: String,
        /// The CIDR.
        cidr: String,
    },
    /// A CIDR shares addresses with another pool of this node.
    #[error(
        "Node {node}'s podCIDR {cidr} overlaps {other} of pool {pool}: \
         one address, one pool; the Node's CIDRs are not served until one of them changes"
    )]
    Overlap {
        /// The Node's name.
        node: String,
        /// The Node's CIDR.
        cidr: IpNet,
        /// The other pool.
        pool: String,
        /// Its CIDR.
        other: IpNet,
    },
}

/// The CIDRs to serve: the Node's when the API gave any (`node`: `None`
/// when the API did not answer), else the record's.
///
/// # Errors
/// Neither gives a CIDR, or a CIDR of the Node is not a network address.
pub fn choose(
    name: &str,
    node: Option<&[String]>,
    record: &[IpNet],
) -> Result<(Vec<IpNet>, Source), PodCidrError> {
    let from_node = node.unwrap_or_default();
    if !from_node.is_empty() {
        let mut cidrs = Vec::new();
        for text in from_node {
            let cidr: IpNet = text.parse().map_err(|_| PodCidrError::Bad {
                node: name.to_string(),
                cidr: text.clone(),
            })?;
            if cidr.trunc() != cidr {
                return Err(PodCidrError::Bad {
                    node: name.to_string(),
                    cidr: text.clone(),
                });
            }
            cidrs.push(cidr);
        }
        return Ok((cidrs, Source::Node));
    }
    if !record.is_empty() {
        return Ok((record.to_vec(), Source::Record));
    }
    Err(PodCidrError::Nothing {
        node: name.to_string(),
        api: if node.is_some() {
            ""
        } else {
            " (the API did not answer)"
        },
    })
}

/// What a change of the Node means while the agent serves `serving`:
/// `Some` CIDRs to serve from now on (the Node's, in its order), `None`
/// when nothing changes. A Node that lists no CIDR (gone, or made again
/// and not yet given any) changes nothing: the node keeps serving what it
/// has until the API names others. `others` are the node's other pools:
/// a CIDR sharing addresses with one of them is refused, naming both.
///
/// # Errors
/// A CIDR of the Node is not a network address, or overlaps another pool.
pub fn follow(
    name: &str,
    node: &[String],
    serving: &[IpNet],
    others: &[PoolSpec],
) -> Result<Option<Vec<IpNet>>, PodCidrError> {
    if node.is_empty() {
        return Ok(None);
    }
    let (cidrs, _) = choose(name, Some(node), &[])?;
    for cidr in &cidrs {
        for other in others {
            let theirs = other
                .ipv4
                .iter()
                .map(|c| IpNet::V4(*c))
                .chain(other.ipv6.iter().map(|c| IpNet::V6(*c)));
            if let Some(o) = theirs.into_iter().find(|o| overlaps(*cidr, *o)) {
                return Err(PodCidrError::Overlap {
                    node: name.to_string(),
                    cidr: *cidr,
                    pool: other.name.clone(),
                    other: o,
                });
            }
        }
    }
    Ok((cidrs != serving).then_some(cidrs))
}

/// The endpoint pool `pool` made of `cidrs`; the pods' traffic within it
/// is not masqueraded.
pub fn pool(pool: &str, cidrs: &[IpNet]) -> PoolSpec {
    let mut spec = cidrs
        .iter()
        .fold(PoolSpec::new(pool), |spec, c| spec.with_cidr(*c));
    spec.skip_masquerade = true;
    spec
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nets(v: &[&str]) -> Vec<IpNet> {
        v.iter().map(|s| s.parse().unwrap()).collect()
    }

    #[test]
    fn the_nodes_cidrs_win_over_the_record() {
        let node = vec![
            "10.244.3.0/24".to_string(),
            "fd00:10:244:3::/64".to_string(),
        ];
        let (cidrs, from) = choose("n", Some(&node), &nets(&["10.244.9.0/24"])).unwrap();
        assert_eq!(cidrs, nets(&["10.244.3.0/24", "fd00:10:244:3::/64"]));
        assert_eq!(from, Source::Node);
        let p = pool("pods", &cidrs);
        assert_eq!(p.ipv4.len(), 1);
        assert_eq!(p.ipv6.len(), 1);
        assert!(p.skip_masquerade);
    }

    #[test]
    fn the_record_serves_while_the_api_is_away_or_the_node_has_none() {
        let record = nets(&["10.244.9.0/24"]);
        assert_eq!(
            choose("n", None, &record).unwrap(),
            (record.clone(), Source::Record)
        );
        assert_eq!(
            choose("n", Some(&[]), &record).unwrap(),
            (record, Source::Record)
        );
    }

    #[test]
    fn a_changed_node_is_followed_and_an_empty_one_changes_nothing() {
        let serving = nets(&["10.244.3.0/24"]);
        let same = vec!["10.244.3.0/24".to_string()];
        assert_eq!(follow("n", &same, &serving, &[]).unwrap(), None);
        assert_eq!(follow("n", &[], &serving, &[]).unwrap(), None);
        let remade = vec!["10.244.7.0/24".to_string()];
        assert_eq!(
            follow("n", &remade, &serving, &[]).unwrap(),
            Some(nets(&["10.244.7.0/24"]))
        );
        let dual = vec!["10.244.3.0/24".to_string(), "fd00:3::/64".to_string()];
        assert_eq!(
            follow("n", &dual, &serving, &[]).unwrap(),
            Some(nets(&["10.244.3.0/24", "fd00:3::/64"]))
        );
        let bad = vec!["10.244.7.1/24".to_string()];
        assert!(matches!(
            follow("n", &bad, &serving, &[]),
            Err(PodCidrError::Bad { .. })
        ));
    }

    #[test]
    fn a_cidr_another_pool_holds_is_refused_naming_both() {
        let other = PoolSpec::new("lb").with_cidr("10.244.0.0/16".parse().unwrap());
        let e = follow(
            "n",
            &["10.244.7.0/24".to_string()],
            &nets(&["10.9.0.0/24"]),
            &[other],
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("10.244.7.0/24") && e.contains("10.244.0.0/16") && e.contains("pool lb"),
            "{e}"
        );
    }

    #[test]
    fn nothing_to_serve_is_named_never_a_default() {
        let e = choose("node-a", None, &[]).unwrap_err().to_string();
        assert!(e.contains("node-a") && e.contains("did not answer"), "{e}");
        let e = choose("node-a", Some(&[]), &[]).unwrap_err().to_string();
        assert!(
            e.contains("--allocate-node-cidrs") && !e.contains("did not answer"),
            "{e}"
        );
        let bad = vec!["10.244.3.7/24".to_string()];
        let e = choose("node-a", Some(&bad), &[]).unwrap_err().to_string();
        assert!(e.contains("10.244.3.7/24"), "{e}");
    }
}
