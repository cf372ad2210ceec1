//! What this node answers for the `Local` Services and selector pools
//! (`local_traffic`), on a watch channel to the announcer, the writer and
//! each seat's keeper (`seat`). A leaf of its own, so the deriving task and
//! the keepers it starts both name it without naming each other.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

/// What the `Local` Services ask of this node's announcer and of the
/// writer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LocalAnswers {
    /// The Services, EndpointSlices and pools were listed: until then the
    /// writer answers nothing, as it cannot tell which addresses are
    /// seated.
    pub listed: bool,
    /// Every address answered by a seat of its own (a lockstep `Local`
    /// Service's, a pool with a node selector): the writer never answers
    /// these for its part.
    pub seated: BTreeSet<IpAddr>,
    /// The addresses this node answers for, each until when (kernel
    /// monotonic ns): it holds their Service's Lease.
    pub held: BTreeMap<IpAddr, u64>,
    /// `Local` Services (`namespace/name`) with no serving endpoint on
    /// any node: not answered anywhere.
    pub unserved: BTreeSet<String>,
    /// Grows with every change published: the announcer reports the
    /// version it has written into the datapath (`applied`).
    pub version: u64,
}
