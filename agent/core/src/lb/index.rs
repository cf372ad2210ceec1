//! Which pool claimed which addresses first.
//!
//! Overlapping LB pools are not refused (pools arrive one by one from the
//! API, so refusing would depend on arrival order in a way nobody could see);
//! instead the later pool is marked conflicting. The claims of accepted pools
//! are pairwise disjoint, so they fit in one ordered map from start to end per
//! family, and "does this block overlap any claim" is one `O(log n)` lookup:
//! only the claim with the greatest start at or below the block's end can
//! reach back into the block. Applying 1k pools is 1k lookups, not the half
//! million comparisons a pairwise check would need.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::spec::Block;
use crate::cidr::Family;

/// Why a pool is not used: one of its blocks overlaps a block of a pool
/// applied earlier.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Conflict {
    /// The conflicting pool's own block, as written.
    pub block: String,
    /// The earlier pool.
    pub pool: String,
    /// The earlier pool's block it overlaps, as written.
    pub other_block: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Claim {
    end: u128,
    pool: String,
    block: String,
}

/// Disjoint claims of accepted pools; see the module documentation.
#[derive(Clone, Debug, Default)]
pub(crate) struct ConflictIndex {
    claims: BTreeMap<(Family, u128), Claim>,
}

impl ConflictIndex {
    /// The first of `blocks` that overlaps a claim, as a [`Conflict`].
    pub(crate) fn check(&self, blocks: &[Block]) -> Option<Conflict> {
        blocks.iter().find_map(|b| {
            let ((family, _), claim) = self.claims.range(..=(b.family, b.end)).next_back()?;
            (*family == b.family && claim.end >= b.start).then(|| Conflict {
                block: b.text.clone(),
                pool: claim.pool.clone(),
                other_block: claim.block.clone(),
            })
        })
    }

    /// Claims `blocks` for `pool`; they must not overlap any claim.
    pub(crate) fn insert(&mut self, pool: &str, blocks: &[Block]) {
        for b in blocks {
            debug_assert!(self.check(std::slice::from_ref(b)).is_none());
            self.claims.insert(
                (b.family, b.start),
                Claim {
                    end: b.end,
                    pool: pool.to_owned(),
                    block: b.text.clone(),
                },
            );
        }
    }

    /// The pool whose claim contains the address integer `bits`.
    pub(crate) fn owner_of(&self, family: Family, bits: u128) -> Option<&str> {
        let ((f, _), claim) = self.claims.range(..=(family, bits)).next_back()?;
        (*f == family && claim.end >= bits).then_some(claim.pool.as_str())
    }

    /// Forgets every claim.
    pub(crate) fn clear(&mut self) {
        self.claims.clear();
    }
}
