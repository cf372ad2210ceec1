//! What tests that write synthetic clusters to etcd share: a fixed
//! sequence of numbers to draw changes from (the same on every run, so a
//! failure names a step that fails again), and the record of a node that
//! exists only as keys.

use std::net::IpAddr;

use lockstep::cluster::NodeRecord;

/// A fixed sequence of numbers (a linear congruential generator seeded
/// by the test): the same draws on every run.
#[derive(Debug)]
pub struct Draw(pub u64);

impl Draw {
    /// The next number, below `n` (`n` > 0).
    pub fn below(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        usize::try_from((self.0 >> 33) % n as u64).unwrap_or(0)
    }
}

/// The record of synthetic node `name` at underlay address `ip` (never
/// used: no traffic goes anywhere) with `in_use` addresses in use.
pub fn node_record(name: String, ip: IpAddr, in_use: u64, version: &str) -> NodeRecord {
    NodeRecord {
        name,
        ips: vec![ip],
        version: version.into(),
        blocks: vec![],
        in_use,
        wanted: 64,
        instance: None,
    }
}

/// The `i`th /26 of 10.64.0.0/10: the block synthetic node `i` (or the
/// `i`th synthetic claim) holds in the tests' pools.
///
/// # Errors
/// `i` past the /10.
pub fn block(i: usize) -> anyhow::Result<ipnet::IpNet> {
    let base = u32::from(std::net::Ipv4Addr::new(10, 64, 0, 0)) + u32::try_from(i)? * 64;
    Ok(ipnet::IpNet::new(
        IpAddr::V4(std::net::Ipv4Addr::from(base)),
        26,
    )?)
}

/// A door's options for `prefix` on `eps`, each request bounded by
/// `timeout`.
pub fn door_options(
    eps: &[String],
    prefix: &str,
    timeout: std::time::Duration,
) -> lockstep::cluster::DoorOptions {
    let mut o = lockstep::cluster::DoorOptions::new(eps.to_vec());
    o.prefix = prefix.to_string();
    o.timeout = timeout;
    o
}
