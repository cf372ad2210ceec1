//! CNI churn on the three nodes of a [`ClusterNodes`] with a ledger: one
//! worker per node ADDs and DELs endpoints through the plugin, recording
//! every acknowledged answer, while the test injects faults; afterwards
//! [`Ledger::check`] holds the cluster to what was acknowledged.
//!
//! The ledger's rules are a runtime's: an ADD counts once acknowledged; a
//! failed ADD is cleaned by a DEL (the agent may have done it before it
//! failed); a failed DEL leaves the endpoint marked unsure and is retried
//! until it succeeds.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{Context, ensure};

use crate::Netns;
use crate::cluster::{ClusterNodes, address_of, cni};

/// What the workers were told, per node.
#[derive(Default)]
struct Node {
    /// Container id → address of every endpoint whose last change was an
    /// acknowledged ADD (or a DEL of unknown outcome).
    acked: BTreeMap<String, IpAddr>,
    /// Endpoints whose last DEL failed: whether the agent did it is
    /// unknown.
    unsure: BTreeSet<String>,
}

/// The churn's ledger, shared with its workers.
pub struct Ledger {
    nodes: Vec<Arc<Mutex<Node>>>,
    stop: Arc<AtomicBool>,
    /// Per node, the pod namespaces its worker cycles through.
    pods: Vec<Vec<Netns>>,
}

fn lock(n: &Mutex<Node>) -> anyhow::Result<std::sync::MutexGuard<'_, Node>> {
    n.lock().map_err(|_| anyhow::anyhow!("poisoned"))
}

impl Ledger {
    /// A ledger with `per_node` pod namespaces on each of three nodes
    /// (named `<tag><node>p<k>`).
    ///
    /// # Errors
    /// A namespace could not be made.
    pub fn new(tag: &str, per_node: usize) -> anyhow::Result<Self> {
        let pods = (0..3)
            .map(|i| {
                (0..per_node)
                    .map(|p| Netns::new(&format!("{tag}{i}p{p}")))
                    .collect::<anyhow::Result<Vec<_>>>()
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(Self {
            nodes: (0..3).map(|_| Arc::default()).collect(),
            stop: Arc::new(AtomicBool::new(false)),
            pods,
        })
    }

    /// Runs one worker per node (each through its agent's socket, so the
    /// agents may be killed and restarted meanwhile) until `faults`
    /// returns, then stops them. Returns each worker's (ADDs, DELs)
    /// acknowledged.
    ///
    /// # Errors
    /// `faults` failed, a worker failed, or one made no progress.
    pub fn run(
        &self,
        n: &mut ClusterNodes,
        faults: impl FnOnce(&mut ClusterNodes) -> anyhow::Result<()>,
    ) -> anyhow::Result<Vec<(usize, usize)>> {
        let sockets: Vec<PathBuf> = n.agents.iter().map(crate::AgentProc::socket).collect();
        std::thread::scope(|s| {
            let mut workers = Vec::new();
            for (i, socket) in sockets.into_iter().enumerate() {
                let (node, stop, pods) = (self.nodes[i].clone(), self.stop.clone(), &self.pods[i]);
                workers.push(s.spawn(move || work(i, &socket, &node, &stop, pods)));
            }
            let result = faults(n);
            self.stop.store(true, Ordering::Relaxed);
            let mut progress = Vec::new();
            for w in workers {
                let (adds, dels) = w
                    .join()
                    .map_err(|_| anyhow::anyhow!("a worker panicked"))??;
                ensure!(
                    adds > 0 && dels > 0,
                    "a worker made no progress: {adds} ADDs, {dels} DELs"
                );
                progress.push((adds, dels));
            }
            result?;
            Ok(progress)
        })
    }

    /// After the churn: every DEL of unknown outcome is retried (it must
    /// succeed now), every endpoint whose last change was an acknowledged
    /// ADD is held by its node with its address, no address is held
    /// twice anywhere, and `verify` is clean on every node.
    ///
    /// # Errors
    /// Any of those does not hold (named).
    pub fn check(&self, n: &ClusterNodes) -> anyhow::Result<()> {
        for (i, node) in self.nodes.iter().enumerate() {
            let mut node = lock(node)?;
            eprintln!(
                "node-{i}: {} DELs of unknown outcome retried",
                node.unsure.len()
            );
            for id in std::mem::take(&mut node.unsure) {
                let slot: usize = id.rsplit('-').next().context("slot")?.parse()?;
                cni(
                    &n.agents[i].socket(),
                    "DEL",
                    &id,
                    &self.pods[i][slot].path(),
                )?;
                node.acked.remove(&id);
            }
        }
        for (i, (node, agent)) in self.nodes.iter().zip(&n.agents).enumerate() {
            let node = lock(node)?;
            let allocs = agent.json(["allocations", "-o", "json"])?;
            let have: BTreeMap<String, String> = allocs
                .as_array()
                .context("allocations")?
                .iter()
                .filter_map(|x| {
                    Some((
                        x["owner"]["container_id"].as_str()?.to_string(),
                        x["address"].as_str()?.to_string(),
                    ))
                })
                .collect();
            for (id, a) in &node.acked {
                ensure!(
                    have.get(id).map(String::as_str) == Some(a.to_string().as_str()),
                    "node-{i}: acknowledged {id} {a} is {:?} after the churn",
                    have.get(id)
                );
            }
        }
        for (addr, owners) in n.holders()? {
            ensure!(owners.len() == 1, "{addr} held twice: {owners:?}");
        }
        for (i, a) in n.agents.iter().enumerate() {
            let v = a.cli(["verify"])?;
            ensure!(
                v.status.success(),
                "node-{i} verify: {}",
                String::from_utf8_lossy(&v.stdout)
            );
        }
        Ok(())
    }
}

/// One node's worker: ADD or DEL the next slot, as a runtime would.
fn work(
    i: usize,
    socket: &std::path::Path,
    node: &Mutex<Node>,
    stop: &AtomicBool,
    pods: &[Netns],
) -> anyhow::Result<(usize, usize)> {
    let (mut adds, mut dels) = (0, 0);
    let mut k = 0usize;
    while !stop.load(Ordering::Relaxed) {
        let slot = k % pods.len();
        let id = format!("churn-{i}-{slot}");
        let ns = pods[slot].path();
        let held = lock(node)?.acked.contains_key(&id);
        if held {
            // A DEL counts once acknowledged; a failed one is unsure and
            // retried later.
            let mut node = lock(node)?;
            if cni(socket, "DEL", &id, &ns).is_ok() {
                node.acked.remove(&id);
                node.unsure.remove(&id);
                dels += 1;
            } else {
                node.unsure.insert(id);
            }
        } else if let Ok((_, answer)) = cni(socket, "ADD", &id, &ns) {
            let a = address_of(&answer)?;
            lock(node)?.acked.insert(id, a);
            adds += 1;
        } else {
            // An ADD that failed may still have been done by the agent
            // before it failed: the runtime's DEL cleans it.
            let _ = cni(socket, "DEL", &id, &ns);
        }
        k += 7;
    }
    Ok((adds, dels))
}
