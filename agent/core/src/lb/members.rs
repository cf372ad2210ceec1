//! The LB agents' memberships as one read of etcd holds them, kept in a
//! persistent map (#47 item 2). A read of thousands of members is handed
//! from the store's view to the announcer without a copy, the next read
//! is the last one with the changed memberships written in, and what
//! changed between two reads is found by visiting only the parts of the
//! map they do not share: a membership rewritten at 5,000 members costs
//! what it costs at 10.

use std::collections::{BTreeMap, BTreeSet};

use imbl::OrdMap;
use imbl::ordmap::DiffItem;

use super::cluster::Candidate;

/// The members (candidate announcers), each under its membership's lease:
/// a new lease is a new membership, so one node may show under two leases
/// while one replaces the other. Ordered by node name, then lease.
///
/// A clone costs O(1) and shares everything with the original; a change
/// copies only the path to the changed entry.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Members(OrdMap<(String, i64), Candidate>);

/// What a membership's change did to the set of memberships that answer
/// ([`Members::answering_changes`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answering {
    /// The membership (node, lease) answers now and did not before (new,
    /// or it answers again).
    Came(String, i64),
    /// The membership answered before and does not now (gone, or it stops
    /// answering).
    Went(String, i64),
}

impl Members {
    /// No members.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets `candidate`'s membership under `lease` (replacing what it held
    /// under that lease).
    pub fn insert(&mut self, candidate: Candidate, lease: i64) {
        self.0.insert((candidate.name.clone(), lease), candidate);
    }

    /// Removes every membership of `node`.
    pub fn remove_node(&mut self, node: &str) {
        let leases: Vec<i64> = self.of(node).map(|(_, l)| l).collect();
        for l in leases {
            self.0.remove(&(node.to_string(), l));
        }
    }

    /// Whether `node` is a member under `lease`.
    #[must_use]
    pub fn contains(&self, node: &str, lease: i64) -> bool {
        self.0.contains_key(&(node.to_string(), lease))
    }

    /// Whether `node` is a member under any lease.
    #[must_use]
    pub fn has_node(&self, node: &str) -> bool {
        self.of(node).next().is_some()
    }

    /// Every membership, with its lease, by node name then lease.
    pub fn iter(&self) -> impl Iterator<Item = (&Candidate, i64)> + Clone {
        self.0.iter().map(|((_, l), c)| (c, *l))
    }

    /// `node`'s memberships (O(log n), not a scan).
    pub fn of<'a>(&'a self, node: &str) -> impl Iterator<Item = (&'a Candidate, i64)> + 'a {
        let from = (node.to_string(), i64::MIN);
        let to = (node.to_string(), i64::MAX);
        self.0.range(from..=to).map(|((_, l), c)| (c, *l))
    }

    /// The member nodes' names, each once, in order.
    pub fn nodes(&self) -> impl Iterator<Item = &str> {
        let mut last: Option<&str> = None;
        self.0.keys().filter_map(move |(n, _)| {
            let new = last != Some(n.as_str());
            last = Some(n.as_str());
            new.then_some(n.as_str())
        })
    }

    /// The number of memberships.
    #[must_use]
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are none.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The labels of each member node that has any (a node under two
    /// leases: those of its last).
    #[must_use]
    pub fn labels(&self) -> BTreeMap<String, BTreeMap<String, String>> {
        self.iter()
            .filter(|(c, _)| !c.labels.is_empty())
            .map(|(c, _)| (c.name.clone(), c.labels.clone()))
            .collect()
    }

    /// The nodes whose memberships differ from `self` to `newer` (one
    /// come, gone, or rewritten: labels, whether it answers), each once.
    /// Visits only the parts of the two maps they do not share.
    #[must_use]
    pub fn changed_nodes<'a>(&'a self, newer: &'a Members) -> BTreeSet<&'a str> {
        self.0
            .diff(&newer.0)
            .map(|d| match d {
                DiffItem::Add((node, _), _) | DiffItem::Remove((node, _), _) => node.as_str(),
                DiffItem::Update {
                    new: ((node, _), _),
                    ..
                } => node.as_str(),
            })
            .collect()
    }

    /// How the memberships that answer differ from `self` to `newer`.
    /// Visits only the parts of the two maps they do not share: for a
    /// `newer` made from `self` by a few changes, O(changes × log n).
    #[must_use]
    pub fn answering_changes(&self, newer: &Members) -> Vec<Answering> {
        let mut out = Vec::new();
        for d in self.0.diff(&newer.0) {
            let (before, after, (node, lease)) = match d {
                DiffItem::Add(k, c) => (false, c.answers, k),
                DiffItem::Remove(k, c) => (c.answers, false, k),
                DiffItem::Update {
                    old: (k, old),
                    new: (_, new),
                } => (old.answers, new.answers, k),
            };
            match (before, after) {
                (false, true) => out.push(Answering::Came(node.clone(), *lease)),
                (true, false) => out.push(Answering::Went(node.clone(), *lease)),
                _ => {}
            }
        }
        out
    }
}

impl FromIterator<(Candidate, i64)> for Members {
    fn from_iter<I: IntoIterator<Item = (Candidate, i64)>>(iter: I) -> Self {
        let mut m = Members::new();
        for (c, l) in iter {
            m.insert(c, l);
        }
        m
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;

    fn candidate(name: &str, answers: bool, label: u8) -> Candidate {
        Candidate {
            name: name.to_string(),
            labels: BTreeMap::from([("l".to_string(), label.to_string())]),
            answers,
        }
    }

    fn answering(m: &Members) -> BTreeSet<(String, i64)> {
        m.iter()
            .filter(|(c, _)| c.answers)
            .map(|(c, l)| (c.name.clone(), l))
            .collect()
    }

    #[test]
    fn a_node_is_found_under_each_of_its_leases_and_removed_whole() {
        let mut m: Members = [
            (candidate("a", true, 0), 1),
            (candidate("b", true, 0), 7),
            (candidate("b", false, 1), 9),
            (candidate("c", true, 0), 2),
        ]
        .into_iter()
        .collect();
        assert_eq!(m.of("b").map(|(_, l)| l).collect::<Vec<_>>(), [7, 9]);
        assert_eq!(m.nodes().collect::<Vec<_>>(), ["a", "b", "c"]);
        assert!(m.contains("b", 9) && !m.contains("b", 8) && m.has_node("c"));
        m.remove_node("b");
        assert_eq!(m.nodes().collect::<Vec<_>>(), ["a", "c"]);
        assert_eq!(m.len(), 2);
        assert!(!m.has_node("b"));
    }

    /// A change of the members, drawn by the property test below.
    #[derive(Clone, Debug)]
    enum Op {
        Set(u8, i64, bool, u8),
        Remove(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..40, 0i64..3, any::<bool>(), 0u8..2).prop_map(|(n, l, a, x)| Op::Set(n, l, a, x)),
            (0u8..40).prop_map(Op::Remove),
        ]
    }

    proptest! {
        #![proptest_config(crate::testing::cases(256))]

        /// The changes found between two reads are exactly the difference
        /// of the sets of memberships that answer, computed whole.
        #[test]
        fn answering_changes_are_the_difference_of_the_whole_sets(
            start in proptest::collection::vec(op(), 0..60),
            change in proptest::collection::vec(op(), 0..8),
        ) {
            let mut old = Members::new();
            let apply = |m: &mut Members, o: &Op| match o {
                Op::Set(n, l, a, x) => m.insert(candidate(&format!("n{n}"), *a, *x), *l),
                Op::Remove(n) => m.remove_node(&format!("n{n}")),
            };
            for o in &start {
                apply(&mut old, o);
            }
            let mut new = old.clone();
            for o in &change {
                apply(&mut new, o);
            }
            let (was, now) = (answering(&old), answering(&new));
            let mut came: BTreeSet<_> = now.difference(&was).cloned().collect();
            let mut went: BTreeSet<_> = was.difference(&now).cloned().collect();
            for c in old.answering_changes(&new) {
                match c {
                    Answering::Came(n, l) => prop_assert!(came.remove(&(n, l))),
                    Answering::Went(n, l) => prop_assert!(went.remove(&(n, l))),
                }
            }
            prop_assert!(came.is_empty() && went.is_empty(), "missed: came {came:?}, went {went:?}");
        }
    }
}
