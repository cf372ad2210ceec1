//! Which stored pools an apply of the cluster pools leaves out. Each is
//! drained (nothing new from it, removed once its blocks are given back)
//! or removed at once: an apply of an empty or partial list must not do
//! that by accident, so `lockstep cluster pools apply` refuses it, naming
//! the pools, unless told `--prune`.

use super::spec::ClusterPoolSpec;

/// The names of the pools in `stored` that `new` leaves out, in stored
/// order. A pool already draining is not named: an earlier apply dropped
/// it, and this one changes nothing for it.
pub fn left_out(stored: &[ClusterPoolSpec], new: &[ClusterPoolSpec]) -> Vec<String> {
    stored
        .iter()
        .filter(|s| !s.draining && !new.iter().any(|n| n.name == s.name))
        .map(|s| s.name.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(name: &str) -> ClusterPoolSpec {
        ClusterPoolSpec::new(name)
    }

    #[test]
    fn an_empty_list_leaves_out_every_stored_pool() {
        let stored = [pool("pods"), pool("db")];
        assert_eq!(left_out(&stored, &[]), vec!["pods", "db"]);
    }

    #[test]
    fn a_list_naming_every_stored_pool_leaves_none_out() {
        let stored = [pool("pods"), pool("db")];
        assert!(left_out(&stored, &[pool("db"), pool("pods"), pool("new")]).is_empty());
        assert!(left_out(&[], &[pool("new")]).is_empty());
    }

    #[test]
    fn a_pool_already_draining_is_not_named_again() {
        let mut old = pool("old");
        old.draining = true;
        assert!(left_out(&[old, pool("pods")], &[pool("pods")]).is_empty());
    }

    #[test]
    fn a_partial_list_names_only_the_pools_it_drops() {
        let stored = [pool("pods"), pool("db"), pool("edge")];
        assert_eq!(left_out(&stored, &[pool("db")]), vec!["pods", "edge"]);
    }
}
