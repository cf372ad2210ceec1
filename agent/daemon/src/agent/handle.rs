//! The agent's one owner: a thread of its own holds the [`Agent`], and every
//! other task reaches it through an [`AgentHandle`].
//!
//! Why it exists: the agent's state (allocations, endpoints, the store,
//! the maps' contents) used to sit behind one mutex that a dozen tasks
//! took, on the async workers among others. A CNI ADD's fsync then ran on
//! a tokio worker, and two ADDs queued behind a reconcile stalled every
//! async task, lease renewals included. Here nothing outside this thread
//! ever holds the state:
//!
//! - **Commands.** A caller sends a closure over a bounded channel
//!   ([`QUEUE`]) and waits for its answer: [`AgentHandle::ask`] from async
//!   code (the worker is free while it waits), [`AgentHandle::call`] from a
//!   plain thread. The owner runs commands one at a time, in arrival order,
//!   so each sees the state the previous one left.
//! - **Batches and group commit.** The owner takes every command already
//!   queued (up to [`BATCH`]) as one batch, inside one commit group of the
//!   store ([`crate::store::Store::open_group`]): the batch's commits share
//!   one log record and one `fdatasync`, and no command of the batch is
//!   answered before that sync returned. The view is published once per
//!   batch.
//! - **A failed sync stops the agent.** When the group's write or sync
//!   fails, none of the batch's commits is durable, but the commands have
//!   already changed the state in memory (and programmed the maps), and
//!   nothing but a start from the store takes that back. So the batch's
//!   callers are refused (as if the agent had stopped), the store makes sure
//!   no replay brings the batch back ([`crate::store::Store::recover`]),
//!   and the owner ends with the cause, which stops the agent: it starts
//!   again from what is durable, and the start-up reconcile puts the maps
//!   back in line (as PostgreSQL does after a failed `fsync`).
//! - **A published view.** After each batch the owner publishes an
//!   [`AgentView`]; readers ([`AgentHandle::view`]) load it without waiting
//!   for any command: status and readiness, the cluster claim loop's block
//!   usage, the pod attachments leak detection judges.
//! - **An end that is seen.** A command that panics, or a failed group
//!   sync, ends the owner: its waiters and every later caller get
//!   [`AgentError::NotReady`], and [`AgentThread::ended`] reports why, which
//!   stops the agent (a state left half-changed is not served).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arc_swap::ArcSwap;
use ipnet::IpNet;
use lockstep_core::pods::PodRef;
use tokio::sync::{mpsc, oneshot};

use super::{Agent, AgentError, Status};
use crate::datapath::pins::PinProbe;

/// Commands that may wait for the owner: a caller past this waits to send
/// (backpressure), it is never refused.
pub const QUEUE: usize = 1024;

/// Most commands one batch takes (one published view).
pub const BATCH: usize = 64;

/// A batch followed by more queued work refreshes what
/// [`AgentHandle::spawn_with`]'s hook keeps (the metrics) only when the last
/// refresh is this old; a batch that leaves the queue empty always does.
pub const AFTER_BATCH_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

/// What the owner runs after a batch's sync, before answering it, to keep
/// readers' copies (the metrics' gauges) as the batch left the agent.
pub type AfterBatch = Box<dyn FnMut(&Agent) + Send>;

/// What the owner answers a command with, once its batch has run.
type Deliver = Box<dyn FnOnce() + Send>;
type Job = Box<dyn FnOnce(&mut Option<Agent>) -> Deliver + Send>;

enum Command {
    Run(Job),
    Stop,
}

/// What readers see without asking the owner: published after every batch.
#[derive(Debug, Default)]
pub struct AgentView {
    /// An agent is installed (start-up finished, not yet stopped).
    pub present: bool,
    /// The pod attachments leak detection judges
    /// ([`Agent::pod_endpoints`]).
    pub pod_endpoints: Vec<(String, PodRef)>,
    /// Batches the owner has run so far.
    pub batches: u64,
    /// Status as the last batch left the agent, before the pin root's
    /// check ([`AgentView::status`] adds it); `None` without an agent.
    pub unprobed: Option<Status>,
    /// The pin root's check, which readers run themselves.
    pub pins: Option<Arc<PinProbe>>,
    /// Every address allocated from the agent's pools, sorted. The one
    /// part of the view that grows with the node's allocations, so the
    /// owner rebuilds it only after a batch that committed something, and
    /// under load at most every [`AFTER_BATCH_EVERY`]: exact whenever the
    /// owner is idle, else at most that old.
    pub allocated: Arc<[IpAddr]>,
    /// Every LoadBalancer address assigned, with its pool (what the BGP
    /// speaker announces from): rebuilt with [`AgentView::allocated`].
    pub lb_addresses: Arc<BTreeMap<IpAddr, String>>,
    /// Every pool's CIDRs by name, draining ones included (the pod blocks
    /// the BGP speaker announces): the same `Arc` while they do not
    /// change.
    pub pool_cidrs: Arc<BTreeMap<String, Vec<IpNet>>>,
}

impl AgentView {
    /// The agent's status, the pin root checked now by the caller (a few
    /// syscalls, no wait for the owner); `None` without an agent.
    pub fn status(&self) -> Option<Status> {
        let mut st = self.unprobed.clone()?;
        if st.ready
            && let Some(problem) = self.pins.as_ref().and_then(|p| p.problem())
        {
            st.ready = false;
            st.reason = Some(problem);
        }
        Some(st)
    }

    /// How many allocated addresses fall in each of `blocks`, in order.
    pub fn block_usage(&self, blocks: &[IpNet]) -> Vec<u64> {
        blocks
            .iter()
            .map(|b| self.in_block(*b).len() as u64)
            .collect()
    }

    /// Every allocated address inside one of `blocks`, sorted.
    pub fn addresses_in(&self, blocks: &[IpNet]) -> Vec<IpAddr> {
        let mut out: Vec<IpAddr> = blocks
            .iter()
            .flat_map(|b| self.in_block(*b).iter().copied())
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// The allocated addresses of `block` (a range of the sorted list).
    fn in_block(&self, block: IpNet) -> &[IpAddr] {
        let from = self.allocated.partition_point(|a| *a < block.network());
        let to = self.allocated.partition_point(|a| *a <= block.broadcast());
        &self.allocated[from..to.max(from)]
    }
}

/// Counts of the owner's work, for the metrics.
#[derive(Debug, Default)]
pub struct OwnerStats {
    /// Commands run.
    pub commands: AtomicU64,
    /// Batches run.
    pub batches: AtomicU64,
    /// Commits the agent's store accepted (as of the last batch).
    pub store_commits: AtomicU64,
    /// Log records the store wrote and synced, one `fdatasync` each (as of
    /// the last batch): with group commit, about one per batch that
    /// changed something.
    pub log_syncs: AtomicU64,
}

/// A way to the agent's owner. Cheap to clone; every task holds its own.
#[derive(Clone)]
pub struct AgentHandle {
    tx: mpsc::Sender<Command>,
    view: Arc<ArcSwap<AgentView>>,
    stats: Arc<OwnerStats>,
}

impl std::fmt::Debug for AgentHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentHandle")
            .field("present", &self.view.load().present)
            .finish()
    }
}

/// One of the agent's own threads (its owner, the reaper), to learn of its
/// end: neither is a tokio task the supervisor could watch.
#[derive(Debug)]
pub struct AgentThread(pub(super) std::thread::JoinHandle<Result<(), String>>);

fn stopped() -> AgentError {
    AgentError::NotReady {
        reason: "the agent has stopped".into(),
    }
}

impl AgentHandle {
    /// Starts the owner thread, with no agent yet (every command sees
    /// `None` until one is installed with [`AgentHandle::install`]).
    ///
    /// # Errors
    /// The thread could not be started.
    pub fn spawn() -> Result<(Self, AgentThread), AgentError> {
        Self::spawn_with(None)
    }

    /// As [`AgentHandle::spawn`], with `after_batch` run on the owner after
    /// a batch's sync and before its answers: after every batch that leaves
    /// the queue empty, and at least every [`AFTER_BATCH_EVERY`] under
    /// load. So what it refreshes is exact whenever the owner is idle, and
    /// a caller that got its answer reads it as its own command left it.
    ///
    /// # Errors
    /// As [`AgentHandle::spawn`].
    pub fn spawn_with(after_batch: Option<AfterBatch>) -> Result<(Self, AgentThread), AgentError> {
        let (tx, rx) = mpsc::channel(QUEUE);
        let view = Arc::new(ArcSwap::from_pointee(AgentView::default()));
        let stats = Arc::new(OwnerStats::default());
        let (v, s) = (view.clone(), stats.clone());
        let thread = std::thread::Builder::new()
            .name("lockstep-agent".into())
            .spawn(move || run(rx, &v, &s, after_batch))
            .map_err(|e| AgentError::Invalid {
                reason: format!("starting the agent's owner thread: {e}"),
            })?;
        Ok((Self { tx, view, stats }, AgentThread(thread)))
    }

    /// The last published view; never waits.
    pub fn view(&self) -> Arc<AgentView> {
        self.view.load_full()
    }

    /// The owner's counts.
    pub fn stats(&self) -> &OwnerStats {
        &self.stats
    }

    /// Commands sent and not yet taken by the owner.
    pub fn queued(&self) -> usize {
        self.tx.max_capacity() - self.tx.capacity()
    }

    fn job<R: Send + 'static>(
        f: impl FnOnce(&mut Option<Agent>) -> R + Send + 'static,
    ) -> (Job, oneshot::Receiver<R>) {
        let (tx, rx) = oneshot::channel();
        let job: Job = Box::new(move |agent: &mut Option<Agent>| {
            let r = f(agent);
            Box::new(move || {
                let _ = tx.send(r);
            }) as Deliver
        });
        (job, rx)
    }

    /// Runs `f` on the owner thread and returns its answer. For async
    /// code: the worker is free while the command waits.
    ///
    /// # Errors
    /// [`AgentError::NotReady`]: the owner has stopped (or panicked).
    pub async fn ask<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Option<Agent>) -> R + Send + 'static,
    ) -> Result<R, AgentError> {
        let (job, rx) = Self::job(f);
        self.tx
            .send(Command::Run(job))
            .await
            .map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())
    }

    /// Runs `f` on the owner thread and waits for its answer, blocking this
    /// thread: for plain threads and the blocking pool, never an async
    /// worker (it panics there).
    ///
    /// # Errors
    /// As [`AgentHandle::ask`].
    pub fn call<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Option<Agent>) -> R + Send + 'static,
    ) -> Result<R, AgentError> {
        let (job, rx) = Self::job(f);
        self.tx
            .blocking_send(Command::Run(job))
            .map_err(|_| stopped())?;
        rx.blocking_recv().map_err(|_| stopped())
    }

    /// Puts `agent` in place (start-up's last step).
    ///
    /// # Errors
    /// As [`AgentHandle::ask`].
    pub async fn install(&self, agent: Agent) -> Result<(), AgentError> {
        self.ask(move |slot| *slot = Some(agent)).await
    }

    /// Stops the owner: commands already queued run first, then the agent
    /// is dropped on the owner thread (the store closed, pins kept). Later
    /// commands get [`AgentError::NotReady`].
    pub async fn stop(&self) {
        let _ = self.tx.send(Command::Stop).await;
    }
}

impl AgentThread {
    /// Waits (blocking) for the thread to end; `Err` with the panic's
    /// message when it panicked, or the reason it ended early.
    ///
    /// # Errors
    /// The thread panicked or ended with an error.
    pub fn join(self) -> Result<(), String> {
        self.0.join().map_err(|p| {
            p.downcast_ref::<&str>()
                .map(|s| (*s).to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a non-text payload".into())
        })?
    }

    /// Waits for the thread to end, on the blocking pool; `Err` with the
    /// panic's message when it panicked, or the reason it ended early.
    ///
    /// # Errors
    /// The thread panicked or ended with an error.
    pub async fn ended(self) -> Result<(), String> {
        tokio::task::spawn_blocking(move || self.join())
            .await
            .map_err(|e| e.to_string())?
    }
}

fn run(
    mut rx: mpsc::Receiver<Command>,
    view: &ArcSwap<AgentView>,
    stats: &OwnerStats,
    mut after_batch: Option<AfterBatch>,
) -> Result<(), String> {
    let mut agent: Option<Agent> = None;
    let mut last_after: Option<std::time::Instant> = None;
    // The address list last published, the store's commit count it was
    // built at, and when.
    let mut allocated: Arc<[IpAddr]> = Arc::from([]);
    let mut lb_addresses: Arc<BTreeMap<IpAddr, String>> = Arc::default();
    let mut pool_cidrs: Arc<BTreeMap<String, Vec<IpNet>>> = Arc::default();
    let mut allocated_at: Option<(u64, std::time::Instant)> = None;
    let mut answers: Vec<Deliver> = Vec::with_capacity(BATCH);
    let mut batches = 0u64;
    while let Some(first) = rx.blocking_recv() {
        if let Some(a) = agent.as_ref() {
            a.store.open_group();
        }
        let mut next = Some(first);
        let mut stop = false;
        while let Some(cmd) = next.take() {
            let Command::Run(job) = cmd else {
                stop = true;
                break;
            };
            answers.push(job(&mut agent));
            stats.commands.fetch_add(1, Ordering::Relaxed);
            if answers.len() < BATCH {
                next = rx.try_recv().ok();
            }
        }
        batches += 1;
        stats.batches.fetch_add(1, Ordering::Relaxed);
        if let Some(a) = agent.as_ref() {
            if let Err(e) = a.store.close_group() {
                return Err(refuse_batch(&e, &mut answers, agent, view, batches));
            }
            let counts = a.store.counts();
            stats.store_commits.store(counts.commits, Ordering::Relaxed);
            stats.log_syncs.store(counts.log_syncs, Ordering::Relaxed);
            if allocated_at.is_none_or(|(commits, at)| {
                commits != counts.commits && (rx.is_empty() || at.elapsed() >= AFTER_BATCH_EVERY)
            }) {
                allocated = a.allocated().into();
                lb_addresses = Arc::new(a.lb_addresses());
                allocated_at = Some((counts.commits, std::time::Instant::now()));
            }
            // Compared in place after every batch (no allocation),
            // published anew only when they changed.
            if !a.pool_cidrs_are(&pool_cidrs) {
                pool_cidrs = Arc::new(a.pool_cidrs());
            }
            if let Some(hook) = after_batch.as_mut()
                && (rx.is_empty() || last_after.is_none_or(|t| t.elapsed() >= AFTER_BATCH_EVERY))
            {
                hook(a);
                last_after = Some(std::time::Instant::now());
            }
        }
        view.store(Arc::new(match agent.as_ref() {
            Some(a) => AgentView {
                present: true,
                pod_endpoints: a.pod_endpoints(),
                batches,
                unprobed: Some(a.status_unprobed()),
                pins: Some(a.pin_probe()),
                allocated: allocated.clone(),
                lb_addresses: lb_addresses.clone(),
                pool_cidrs: pool_cidrs.clone(),
            },
            None => AgentView {
                batches,
                ..AgentView::default()
            },
        }));
        for answer in answers.drain(..) {
            answer();
        }
        if stop {
            break;
        }
    }
    view.store(Arc::new(AgentView {
        batches,
        ..AgentView::default()
    }));
    drop(agent);
    Ok(())
}

/// A batch whose group sync failed: its callers are refused (their answers
/// dropped: [`AgentError::NotReady`]), the store covers the batch's record
/// so no replay brings it back, and the agent is dropped without being
/// served again. Returns why the owner ends.
fn refuse_batch(
    e: &crate::store::StoreError,
    answers: &mut Vec<Deliver>,
    agent: Option<Agent>,
    view: &ArcSwap<AgentView>,
    batches: u64,
) -> String {
    let refused = answers.len();
    answers.clear();
    view.store(Arc::new(AgentView {
        batches,
        ..AgentView::default()
    }));
    let cause = crate::error_chain(e);
    tracing::error!(
        error = %cause,
        refused,
        "the store's shared sync failed: the batch's commands are refused and the agent stops, to start again from what is durable"
    );
    if let Some(a) = agent.as_ref()
        && let Err(e) = a.store.recover()
    {
        tracing::error!(
            error = %crate::error_chain(&e),
            "the store did not recover; the next start replays its log"
        );
    }
    drop(agent);
    format!("the store's shared sync failed, {refused} commands were refused: {cause}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn commands_run_in_order_and_the_view_follows() {
        let (h, thread) = AgentHandle::spawn().unwrap();
        assert!(!h.view().present);
        let seen = h.ask(|a| a.is_some()).await.unwrap();
        assert!(!seen, "no agent before install");
        assert!(h.view().batches >= 1);
        h.stop().await;
        thread.ended().await.unwrap();
        let e = h.ask(|_| ()).await.unwrap_err();
        assert!(e.to_string().contains("stopped"), "{e}");
    }

    #[tokio::test]
    async fn a_panicking_command_ends_the_owner_and_is_reported() {
        let (h, thread) = AgentHandle::spawn().unwrap();
        let e = h
            .ask(|_| -> () { panic!("a half-made endpoint") })
            .await
            .unwrap_err();
        assert!(e.to_string().contains("stopped"), "{e}");
        let p = thread.ended().await.unwrap_err();
        assert_eq!(p, "a half-made endpoint");
        assert!(h.ask(|_| ()).await.is_err(), "nobody is served after");
    }

    #[test]
    fn the_view_counts_addresses_per_block_from_its_sorted_list() {
        let mut allocated: Vec<IpAddr> = [
            "10.0.0.1", "10.0.0.7", "10.0.0.8", "10.0.1.0", "fd00::1", "fd00::ff",
        ]
        .iter()
        .map(|a| a.parse().unwrap())
        .collect();
        allocated.sort_unstable();
        let v = AgentView {
            allocated: allocated.into(),
            ..AgentView::default()
        };
        let blocks: Vec<IpNet> = ["10.0.0.0/29", "10.0.0.8/29", "10.0.2.0/24", "fd00::/120"]
            .iter()
            .map(|b| b.parse().unwrap())
            .collect();
        assert_eq!(v.block_usage(&blocks), [2, 1, 0, 2]);
        let got: Vec<String> = v
            .addresses_in(&blocks[1..])
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(got, ["10.0.0.8", "fd00::1", "fd00::ff"]);
        assert!(v.status().is_none(), "no agent, no status");
    }

    #[test]
    fn a_plain_thread_calls_and_many_callers_share_batches() {
        let (h, thread) = AgentHandle::spawn().unwrap();
        let callers: Vec<_> = (0..8)
            .map(|i| {
                let h = h.clone();
                std::thread::spawn(move || h.call(move |_| i * 2).unwrap())
            })
            .collect();
        let mut got: Vec<i32> = callers.into_iter().map(|c| c.join().unwrap()).collect();
        got.sort_unstable();
        assert_eq!(got, (0..8).map(|i| i * 2).collect::<Vec<_>>());
        assert_eq!(h.stats().commands.load(Ordering::Relaxed), 8);
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(h.stop());
        thread.join().unwrap();
    }
}
