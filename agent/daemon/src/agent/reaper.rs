//! Pod teardown off the DEL's path: the reaper.
//!
//! Deleting a host veth waits for the kernel's RCU grace periods (~15–20 ms
//! on the project's VM, `docs/design/benchmark-history.md`), and deletions one by one
//! serialise under RTNL. A full DEL therefore does only the quick part before
//! it is acknowledged: it removes the endpoint's map entries (no map entry
//! outlives its allocation) and durably marks the endpoint record
//! `releasing`. Its addresses stay held in the core and in the store, left
//! out of the maps, so no address is handed out again while the container's
//! interface may still hold it.
//!
//! The reaper thread takes every queued endpoint at once, puts their host
//! veths in one interface group and deletes the group in one request: the
//! kernel unregisters them as one batch sharing its grace periods. Once the
//! kernel confirms an interface gone (its index no longer names it), the
//! reaper asks the agent's owner to complete the release: store removal of
//! the record and allocations in one commit, then the core lets go (through
//! [`super::release::ParkedReleases`], so a store that refuses keeps them
//! held). A start finishes every release a crash or a stop left marked,
//! before anything is programmed or served.
//!
//! The DEL itself is answered only once the kernel has deleted its veth
//! (#27 item 8: a runtime must not find the container's interface still
//! there after DEL): it waits off the agent's owner ([`GoneWait`]) for the
//! batch that takes its veth, so DELs that arrive together share one
//! deletion and its grace periods. A repeated DEL of a pending release
//! waits for the same batch.
//!
//! An ADD of an attachment whose release is pending waits for it, outside
//! the owner ([`Progress`]).

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use lockstep_core::cidr::Family;
use lockstep_core::manager::Allocation;
use lockstep_core::owner::Owner;

use crate::datapath::{Hook, ProgramPin};
use crate::netlink::Netlink;
use crate::store::{EndpointRecord, endpoint_key};

use super::{Agent, AgentError, AgentHandle, AgentThread};

/// The interface group the reaper's batches use, with the process id in
/// its low bits so agents in one namespace do not share one.
fn batch_group() -> u32 {
    0x4c53_0000 | (std::process::id() & 0xffff)
}

/// How long a failed deletion waits before the next try.
const RETRY: Duration = Duration::from_secs(1);

/// One host veth to delete.
#[derive(Debug, Clone)]
struct Job {
    key: String,
    name: String,
    index: u32,
    attach: Option<ProgramPin>,
    not_before: Option<Instant>,
}

#[derive(Debug, Default)]
struct Queue {
    jobs: Vec<Job>,
    stop: bool,
    /// Bumped after every completed batch or orphan removal, for
    /// [`lock_unblocked`].
    finished: u64,
    /// DELs without a record removing what a half-done ADD of that
    /// attachment left, by key: an ADD of it waits for them.
    orphans: BTreeMap<String, usize>,
    /// DELs waiting for their attachment's interface to be gone, by key
    /// ([`GoneWait`]).
    waiting: BTreeMap<String, Waiting>,
}

/// The DELs waiting on one attachment's interface, and whether the kernel
/// confirmed it gone.
#[derive(Debug, Default)]
struct Waiting {
    count: usize,
    gone: bool,
}

#[derive(Debug, Default)]
struct Shared {
    queue: Mutex<Queue>,
    wake: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A pending release: the allocations it holds and where its container
/// interface is.
#[derive(Debug)]
struct Held {
    allocations: Vec<Allocation>,
    netns: std::path::PathBuf,
    ifname: String,
}

/// The agent's side: releases pending by endpoint key, and the queue the
/// thread drains.
#[derive(Debug, Default)]
pub struct Reaper {
    shared: Arc<Shared>,
    held: BTreeMap<String, Held>,
    /// Whether a thread drains the queue ([`spawn`]); without one (an agent
    /// driven directly, as in unit tests) releases are finished inline.
    attached: bool,
    /// `cni.teardown_batch_window`.
    window: Duration,
}

impl Reaper {
    /// Whether the release of attachment `key` is pending.
    pub fn holds_key(&self, key: &str) -> bool {
        self.held.contains_key(key)
    }

    /// Whether an ADD of attachment `key` (interface `ifname` in `netns`)
    /// must wait for a pending release: its own, or one whose container
    /// interface has that name in that namespace (the runtime reuses the
    /// namespace; the old interface goes with its veth).
    pub fn blocks(&self, key: &str, netns: &std::path::Path, ifname: &str) -> bool {
        self.held.contains_key(key)
            || self.shared.lock().orphans.contains_key(key)
            || self
                .held
                .values()
                .any(|h| h.ifname == ifname && h.netns == netns)
    }

    /// Whether any release is pending.
    pub fn is_busy(&self) -> bool {
        !self.held.is_empty()
    }

    /// How many addresses of `pool` in `family` pending releases hold:
    /// they come free once their pods' interfaces are gone.
    pub fn holding_in(&self, pool: &str, family: Family) -> usize {
        self.held
            .values()
            .flat_map(|h| &h.allocations)
            .filter(|a| a.pool == pool && a.family() == family)
            .count()
    }

    /// Whether `a` belongs to a pending release (held, left out of the maps).
    pub fn holds(&self, a: &Allocation) -> bool {
        if self.held.is_empty() {
            return false;
        }
        match &a.owner {
            Owner::Endpoint {
                container_id,
                ifname,
            } => self.held.contains_key(&endpoint_key(container_id, ifname)),
            _ => false,
        }
    }
}

/// Held while a DEL without a record removes what a half-done ADD of its
/// attachment left (off the agent's owner), so that an ADD of the same
/// attachment does not make its interfaces in the meantime.
#[derive(Debug)]
pub struct OrphanGuard {
    shared: Arc<Shared>,
    key: String,
}

impl Reaper {
    /// Registers an orphan removal of attachment `key` until the guard drops.
    pub fn orphan_guard(&self, key: &str) -> OrphanGuard {
        *self
            .shared
            .lock()
            .orphans
            .entry(key.to_string())
            .or_default() += 1;
        OrphanGuard {
            shared: self.shared.clone(),
            key: key.to_string(),
        }
    }
}

impl Drop for OrphanGuard {
    fn drop(&mut self) {
        let mut q = self.shared.lock();
        if let Some(n) = q.orphans.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                q.orphans.remove(&self.key);
            }
        }
        q.finished += 1;
        drop(q);
        self.shared.wake.notify_all();
    }
}

/// Held by a DEL whose attachment's veth the reaper deletes: [`GoneWait::wait`]
/// returns once the kernel has confirmed it gone (and with it the
/// container's interface). Made in one command on the agent's owner while the release is
/// pending, and marked gone by the reaper under the same lock, so no
/// confirmation can fall between the two.
#[derive(Debug)]
pub struct GoneWait {
    shared: Arc<Shared>,
    key: String,
    timeout: Duration,
}

/// How long a DEL waits for its interface beyond the batch window: a batch
/// takes tens of milliseconds; a veth the kernel will not delete is retried
/// every [`RETRY`] meanwhile. With the longest window
/// ([`crate::config::MAX_TEARDOWN_BATCH_WINDOW`]) a DEL is still answered
/// within the plugin's default `agentTimeout` (30 s).
const DEL_WAIT: Duration = Duration::from_secs(5);

impl GoneWait {
    /// Waits until the attachment's interface is gone, the reaper stops
    /// (the agent is shutting down), or the batch window and 5 s more
    /// have passed.
    ///
    /// # Errors
    /// [`AgentError::InterfaceLingering`] when the interface is still there
    /// at the end of the wait (the release stays pending; a repeated DEL
    /// waits again), or the agent stopped first.
    pub fn wait(&self) -> Result<(), AgentError> {
        let timeout = self.timeout;
        let q = self.shared.lock();
        let (q, _) = self
            .shared
            .wake
            .wait_timeout_while(q, timeout, |q| {
                !q.stop && !q.waiting.get(&self.key).is_some_and(|w| w.gone)
            })
            .unwrap_or_else(PoisonError::into_inner);
        if q.waiting.get(&self.key).is_some_and(|w| w.gone) {
            return Ok(());
        }
        Err(AgentError::InterfaceLingering {
            attachment: self.key.clone(),
            waited: timeout,
        })
    }
}

impl Drop for GoneWait {
    fn drop(&mut self) {
        let mut q = self.shared.lock();
        if let Some(w) = q.waiting.get_mut(&self.key) {
            w.count -= 1;
            if w.count == 0 {
                q.waiting.remove(&self.key);
            }
        }
    }
}

impl Reaper {
    /// A wait for the interface of attachment `key`, whose release is
    /// pending; `None` when nothing is pending for it or no reaper thread
    /// runs (without one a release is finished inline, interface first).
    /// Call on the agent's owner.
    pub(crate) fn gone_wait(&self, key: &str) -> Option<GoneWait> {
        if !self.attached || !self.held.contains_key(key) {
            return None;
        }
        self.shared
            .lock()
            .waiting
            .entry(key.to_string())
            .or_default()
            .count += 1;
        Some(GoneWait {
            shared: self.shared.clone(),
            key: key.to_string(),
            timeout: self.window + DEL_WAIT,
        })
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.wake.notify_all();
    }
}

/// The reaper's queue, handed out before the agent serves: from then on a
/// DEL only queues its veth (`Agent::queue_release` never deletes it
/// inline), so no DEL on an async worker can reach netlink, whatever the
/// moment; [`start`] then runs the thread that empties the queue (jobs
/// queued meanwhile wait for it).
pub struct Prepared(Arc<Shared>);

/// Switches `agent` to the reaper's queue. Call before the agent is put
/// where requests reach it.
pub fn prepare(agent: &mut Agent) -> Prepared {
    agent.reaper.attached = true;
    agent.reaper.window = agent.config.cni.teardown_batch_window;
    Prepared(agent.reaper.shared.clone())
}

/// Starts the reaper thread for the agent behind `agent`. The thread ends
/// when the agent is dropped; one that ends before (a panic) is the
/// caller's to notice, through the returned [`AgentThread`].
///
/// # Errors
/// The thread could not be started.
pub fn start(prepared: Prepared, agent: &AgentHandle) -> Result<AgentThread, AgentError> {
    let shared = prepared.0;
    let agent = agent.clone();
    std::thread::Builder::new()
        .name("lockstep-reaper".into())
        .spawn(move || {
            run(&shared, &agent);
            Ok(())
        })
        .map(AgentThread)
        .map_err(|e| AgentError::Invalid {
            reason: format!("starting the reaper thread: {e}"),
        })
}

fn run(shared: &Arc<Shared>, agent: &AgentHandle) {
    let mut netlink: Option<Netlink> = None;
    loop {
        let jobs = {
            let mut q = shared.lock();
            loop {
                if q.stop {
                    return;
                }
                let now = Instant::now();
                if q.jobs.iter().any(|j| j.not_before.is_none_or(|t| t <= now)) {
                    break;
                }
                let wait = q
                    .jobs
                    .iter()
                    .filter_map(|j| j.not_before)
                    .min()
                    .map_or(Duration::from_secs(3600), |t| t - now);
                q = shared
                    .wake
                    .wait_timeout(q, wait)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            }
            // One is due: the batch takes every queued veth (those still
            // in their window or retry wait too: more share the grace period).
            std::mem::take(&mut q.jobs)
        };
        let h = match netlink.take().map_or_else(Netlink::current, Ok) {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(error = %e, "the reaper cannot open netlink; retrying");
                requeue(shared, jobs);
                continue;
            }
        };
        let (gone, failed) = delete_batch(&h, jobs);
        netlink = Some(h);
        requeue(shared, failed);
        let marked = shared.clone();
        let finished = agent.call(move |agent| {
            if let Some(agent) = agent.as_mut() {
                agent.finish_releases(&gone);
            }
            // Marked by the owner, which runs an ADD's look at what blocks
            // it as one command: a look made before this sees the mark,
            // one made after finds the release finished and does not wait.
            let mut q = marked.lock();
            for key in &gone {
                if let Some(w) = q.waiting.get_mut(key) {
                    w.gone = true;
                }
            }
            q.finished += 1;
            drop(q);
            marked.wake.notify_all();
        });
        if finished.is_err() {
            // The owner is gone: so is the agent.
            return;
        }
    }
}

fn requeue(shared: &Shared, mut failed: Vec<Job>) {
    if failed.is_empty() {
        return;
    }
    let at = Instant::now() + RETRY;
    for j in &mut failed {
        j.not_before = Some(at);
    }
    shared.lock().jobs.extend(failed);
}

/// Detaches and deletes the jobs' veths in one batch; returns the keys
/// whose interface is confirmed gone, and the jobs to try again.
fn delete_batch(h: &Netlink, jobs: Vec<Job>) -> (Vec<String>, Vec<Job>) {
    let group = batch_group();
    let mut marked = Vec::new();
    let mut gone = Vec::new();
    let mut failed = Vec::new();
    for j in jobs {
        if let Some(pin) = &j.attach
            && let Err(e) = pin.detach_index(j.index, Hook::Ingress)
        {
            tracing::warn!(error = %e, iface = %j.name, "detaching from_endpoint failed");
        }
        match still_there(h, &j) {
            Ok(false) => gone.push(j.key),
            Ok(true) => match h.set_group(j.index, group) {
                Ok(()) => marked.push(j),
                // Gone in between (its namespace died): confirmed below.
                Err(_) => marked.push(j),
            },
            Err(e) => {
                tracing::warn!(error = %e, iface = %j.name, "looking up a veth to delete failed");
                failed.push(j);
            }
        }
    }
    if !marked.is_empty()
        && let Err(e) = h.delete_group(group)
    {
        // Something else in the group the kernel will not delete: one by one.
        tracing::warn!(error = %e, "batch deletion refused; deleting one by one");
        for j in &marked {
            if let Err(e) = h.delete_link(j.index) {
                tracing::warn!(error = %e, iface = %j.name, "deleting the veth failed");
            }
        }
    }
    for j in marked {
        match still_there(h, &j) {
            Ok(false) => gone.push(j.key),
            Ok(true) | Err(_) => {
                tracing::warn!(iface = %j.name, "a veth survived its deletion; retrying");
                failed.push(j);
            }
        }
    }
    (gone, failed)
}

/// Whether the job's interface still exists (its index still names it).
fn still_there(h: &Netlink, j: &Job) -> Result<bool, crate::netlink::NetlinkError> {
    Ok(h.link_by_index(j.index)?.is_some_and(|l| l.name == j.name))
}

/// Where a waiting ADD stands with the reaper: how many batches it had
/// finished when the ADD looked ([`Agent::reaper_progress`]).
#[derive(Debug, Clone)]
pub struct Progress {
    shared: Arc<Shared>,
    seen: u64,
}

impl Progress {
    /// Waits until the reaper finishes something after this was taken (a
    /// batch, an orphan removal), stops, or `deadline` passes; at most
    /// 50 ms, so the caller looks again at least that often.
    pub fn wait(&self, deadline: Instant) {
        let q = self.shared.lock();
        let left = deadline.saturating_duration_since(Instant::now());
        let _ = self
            .shared
            .wake
            .wait_timeout_while(q, left.min(Duration::from_millis(50)), |q| {
                q.finished == self.seen && !q.stop
            });
    }
}

impl Agent {
    /// The reaper's progress as of now, for an ADD that finds itself
    /// blocked ([`Reaper::blocks`]) and waits outside the owner.
    pub fn reaper_progress(&self) -> Progress {
        let shared = self.reaper.shared.clone();
        let seen = shared.lock().finished;
        Progress { shared, seen }
    }

    /// DEL's hand-over of a full endpoint whose map entries are removed:
    /// marks its record `releasing` in the store (one commit), keeps its
    /// allocations held and queues its veth. Without a reaper thread the
    /// veth is deleted and the release finished here.
    ///
    /// # Errors
    /// The store refused the mark (nothing changed but the map entries,
    /// which reconcile puts back; the DEL fails and is retried).
    pub(super) fn begin_release(
        &mut self,
        record: &EndpointRecord,
        allocated: Vec<Allocation>,
    ) -> Result<(), AgentError> {
        let key = record.key();
        let mut marked = record.clone();
        marked.releasing = true;
        self.store
            .put_endpoint(Some(&marked), &[], self.manager.generation())?;
        self.endpoints.remove(&key);
        self.queue_release(&marked, allocated);
        Ok(())
    }

    fn queue_release(&mut self, record: &EndpointRecord, allocated: Vec<Allocation>) {
        let key = record.key();
        self.reaper.held.insert(
            key.clone(),
            Held {
                allocations: allocated,
                netns: record.netns.clone(),
                ifname: record.ifname.clone(),
            },
        );
        let job = Job {
            key,
            name: record.host_ifname.clone().unwrap_or_default(),
            index: record.host_ifindex,
            attach: self.from_endpoint.clone(),
            not_before: (!self.reaper.window.is_zero())
                .then(|| Instant::now() + self.reaper.window),
        };
        if self.reaper.attached {
            self.reaper.shared.lock().jobs.push(job);
            self.reaper.shared.wake.notify_all();
            return;
        }
        let gone = match Netlink::current() {
            Ok(h) => delete_batch(&h, vec![job]).0,
            Err(e) => {
                tracing::warn!(error = %e, "cannot open netlink to delete a veth");
                Vec::new()
            }
        };
        self.finish_releases(&gone);
    }

    /// Completes the releases of `keys`, whose interfaces are gone: the
    /// store drops record and allocations in one commit, then the core lets
    /// go (a store refusal parks them, still held).
    pub(super) fn finish_releases(&mut self, keys: &[String]) {
        for key in keys {
            let Some(held) = self.reaper.held.remove(key) else {
                continue;
            };
            if let Err(e) = self.parked.release(
                key.clone(),
                Some(key.clone()),
                held.allocations,
                &self.store,
                &mut self.manager,
            ) {
                tracing::warn!(%key, error = %crate::error_chain(&e), "completing a release is parked");
            }
        }
    }

    /// At start, before anything is programmed or served: finishes every
    /// release a crash or stop left marked (their veths are deleted in one
    /// batch, then the releases complete). A veth that will not go keeps
    /// its release pending, for the reaper thread.
    pub(super) fn finish_stored_releases(&mut self) {
        let marked: Vec<EndpointRecord> = self
            .endpoints
            .values()
            .filter(|e| e.releasing)
            .cloned()
            .collect();
        if marked.is_empty() {
            return;
        }
        let mut jobs = Vec::new();
        for record in &marked {
            let key = record.key();
            self.endpoints.remove(&key);
            let owner = Owner::endpoint(&record.container_id, &record.ifname);
            let allocated: Vec<Allocation> = self.manager.owned_by(&owner).cloned().collect();
            self.reaper.held.insert(
                key.clone(),
                Held {
                    allocations: allocated,
                    netns: record.netns.clone(),
                    ifname: record.ifname.clone(),
                },
            );
            jobs.push(Job {
                key,
                name: record.host_ifname.clone().unwrap_or_default(),
                index: record.host_ifindex,
                attach: self.from_endpoint.clone(),
                not_before: None,
            });
        }
        let (gone, failed) = match Netlink::current() {
            Ok(h) => delete_batch(&h, jobs),
            Err(e) => {
                tracing::warn!(error = %e, "cannot open netlink to finish releases");
                (Vec::new(), jobs)
            }
        };
        tracing::info!(
            finished = gone.len(),
            pending = failed.len(),
            "finishing releases a previous run left pending"
        );
        self.finish_releases(&gone);
        self.reaper.shared.lock().jobs.extend(failed);
    }
}
