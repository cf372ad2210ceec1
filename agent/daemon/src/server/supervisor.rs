//! Every long-running task of the agent, watched by name. A task that
//! panics is logged with its name and the panic's message, and then:
//! - a task started with [`Supervisor::keep`] (one that rebuilds what it
//!   needs when it starts: the reconciler, the metrics refresher, the
//!   Kubernetes watchers) is started again after a growing wait, counted in
//!   `lockstep_task_restarts_total`; one that keeps panicking (more than the
//!   core's [`RestartPolicy`] allows) stops the agent;
//! - any other ([`Supervisor::watch`]: the API, the claim loop, the LB
//!   agent, which hold state a restart would lose) stops the agent at once:
//!   it exits non-zero and its DaemonSet starts it again.
//!
//! A panic never vanishes while the rest runs on without the task. A task
//! that ends on its own before the stop (a set-up that finished) is logged
//! and let go.
//!
//! It exists so the server's start-up code hands each task over once and
//! the stop waits for all of them, in one place.

use std::sync::Arc;

use lockstep_core::restart::{RestartPolicy, Restarts, Verdict};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use crate::metrics::Metrics;

/// A task that panicked: its name and the panic's message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("task {task} panicked: {message}")]
pub struct Panicked {
    /// The name it was watched under.
    pub task: String,
    /// The panic's payload, when it is text.
    pub message: String,
}

/// How a watched task ended: `Err` with the panic's message.
type Ended = Result<(), String>;

/// The watched tasks.
pub struct Supervisor {
    tasks: JoinSet<(String, Ended)>,
    stop: watch::Receiver<bool>,
    metrics: Arc<Metrics>,
    policy: RestartPolicy,
}

/// How `handle` ended.
async fn ended<T>(handle: JoinHandle<T>) -> Ended {
    match handle.await {
        Err(e) if e.is_panic() => Err(panic_message(e.into_panic())),
        _ => Ok(()),
    }
}

impl Supervisor {
    /// No task yet; `stop` is the agent's stop signal (no restart after
    /// it), restarts are counted in `metrics`.
    pub fn new(stop: watch::Receiver<bool>, metrics: Arc<Metrics>) -> Self {
        Self {
            tasks: JoinSet::new(),
            stop,
            metrics,
            policy: RestartPolicy::default(),
        }
    }

    /// Watches `handle` under `name`: a panic stops the agent.
    pub fn watch<T: Send + 'static>(&mut self, name: impl Into<String>, handle: JoinHandle<T>) {
        let name = name.into();
        self.tasks.spawn(async move { (name, ended(handle).await) });
    }

    /// Starts a task with `start` and keeps it: after a panic it is
    /// started again, until it panics more often than the policy allows
    /// (then it stops the agent like a watched task).
    pub fn keep(
        &mut self,
        name: impl Into<String>,
        mut start: impl FnMut() -> JoinHandle<()> + Send + 'static,
    ) {
        let name = name.into();
        let mut stop = self.stop.clone();
        let metrics = self.metrics.clone();
        let mut restarts = Restarts::new(self.policy);
        let window_s = self.policy.window_ms / 1000;
        let epoch = tokio::time::Instant::now();
        self.tasks.spawn(async move {
            loop {
                let message = match ended(start()).await {
                    Ok(()) => return (name, Ok(())),
                    Err(message) => message,
                };
                if *stop.borrow() {
                    return (name, Err(message));
                }
                let now_ms = u64::try_from(epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
                match restarts.panicked(now_ms) {
                    Verdict::Restart { after_ms } => {
                        tracing::error!(task = %name, %message, after_ms, "a task panicked; starting it again");
                        metrics.task_restarted(&name);
                        tokio::select! {
                            () = tokio::time::sleep(std::time::Duration::from_millis(after_ms)) => {}
                            _ = stop.wait_for(|s| *s) => return (name, Ok(())),
                        }
                    }
                    Verdict::GiveUp { restarts } => {
                        let given_up = format!(
                            "{message} (panicked again after {restarts} restarts within {window_s} s)"
                        );
                        return (name, Err(given_up));
                    }
                }
            }
        });
    }

    /// Returns the first task that panicked for good; never while none does.
    pub async fn panicked(&mut self) -> Panicked {
        loop {
            match self.tasks.join_next().await {
                Some(Ok((task, Err(message)))) => return Panicked { task, message },
                Some(Ok((task, Ok(())))) => {
                    tracing::info!(task = %task, "task ended");
                }
                // The watcher itself cannot panic; it is aborted only with
                // the set.
                Some(Err(_)) => {}
                None => std::future::pending::<()>().await,
            }
        }
    }

    /// After the stop was signalled: waits for every task, and returns
    /// those that panicked (each logged).
    pub async fn stop(mut self) -> Vec<Panicked> {
        let mut panicked = Vec::new();
        while let Some(joined) = self.tasks.join_next().await {
            if let Ok((task, Err(message))) = joined {
                let p = Panicked { task, message };
                tracing::error!(error = %p, "a task panicked while stopping");
                panicked.push(p);
            }
        }
        panicked
    }
}

/// A panic payload as text.
fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-text payload".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panicking_task_is_named_and_one_that_ends_is_let_go() {
        let (_tx, rx) = watch::channel(false);
        let mut s = Supervisor::new(rx, Arc::new(Metrics::new()));
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        s.watch("ends", tokio::spawn(async {}));
        s.watch(
            "waits",
            tokio::spawn(async move {
                let _ = rx.await;
            }),
        );
        s.watch(
            "claim loop",
            tokio::spawn(async {
                tokio::task::yield_now().await;
                panic!("a block with no owner");
            }),
        );
        let p = s.panicked().await;
        assert_eq!(
            p,
            Panicked {
                task: "claim loop".into(),
                message: "a block with no owner".into(),
            }
        );
        let _ = tx.send(());
        assert!(s.stop().await.is_empty(), "the others ended cleanly");
    }

    #[tokio::test]
    async fn the_stop_waits_for_every_task_and_reports_a_late_panic() {
        let (tx, rx) = watch::channel(false);
        let mut s = Supervisor::new(rx.clone(), Arc::new(Metrics::new()));
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let seen = done.clone();
        let mut stop = rx.clone();
        s.watch(
            "reconciler",
            tokio::spawn(async move {
                let _ = stop.wait_for(|s| *s).await;
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                seen.store(true, std::sync::atomic::Ordering::SeqCst);
            }),
        );
        let mut stop = rx;
        s.watch(
            "lb agent",
            tokio::spawn(async move {
                let _ = stop.wait_for(|s| *s).await;
                panic!("{}", String::from("lease lost while stopping"));
            }),
        );
        let _ = tx.send(true);
        let panicked = s.stop().await;
        assert!(done.load(std::sync::atomic::Ordering::SeqCst));
        assert_eq!(panicked.len(), 1, "{panicked:?}");
        assert_eq!(panicked[0].message, "lease lost while stopping");
    }

    #[tokio::test(start_paused = true)]
    async fn a_kept_task_is_started_again_after_a_panic_and_counted() {
        let (tx, rx) = watch::channel(false);
        let metrics = Arc::new(Metrics::new());
        let mut s = Supervisor::new(rx.clone(), metrics.clone());
        let starts = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = starts.clone();
        s.keep("reconciler", move || {
            let n = counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let mut stop = rx.clone();
            tokio::spawn(async move {
                assert!(n >= 2, "a reconcile of a half-read map");
                let _ = stop.wait_for(|s| *s).await;
            })
        });
        // Two panics and their waits (100 ms, then 200 ms) pass: the third
        // start runs, and nothing stops the agent.
        tokio::select! {
            p = s.panicked() => panic!("the agent was stopped: {p}"),
            () = tokio::time::sleep(std::time::Duration::from_secs(5)) => {}
        }
        assert_eq!(starts.load(std::sync::atomic::Ordering::SeqCst), 3);
        let text = metrics.encode(None, None, false);
        assert!(
            text.contains("lockstep_task_restarts_total{task=\"reconciler\"} 2"),
            "{text}"
        );
        let _ = tx.send(true);
        assert!(s.stop().await.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_task_that_keeps_panicking_stops_the_agent_naming_its_restarts() {
        let (_tx, rx) = watch::channel(false);
        let mut s = Supervisor::new(rx, Arc::new(Metrics::new()));
        s.keep("pod leaks", || {
            tokio::spawn(async { panic!("an informer with no pods") })
        });
        let p = s.panicked().await;
        assert_eq!(p.task, "pod leaks");
        assert!(
            p.message.starts_with("an informer with no pods")
                && p.message.contains("after 5 restarts within 300 s"),
            "{}",
            p.message
        );
    }

    #[tokio::test(start_paused = true)]
    async fn no_restart_after_the_stop() {
        let (tx, rx) = watch::channel(false);
        let mut s = Supervisor::new(rx.clone(), Arc::new(Metrics::new()));
        let starts = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = starts.clone();
        s.keep("metrics refresher", move || {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let mut stop = rx.clone();
            tokio::spawn(async move {
                let _ = stop.wait_for(|s| *s).await;
                panic!("stopped mid-scrape");
            })
        });
        let _ = tx.send(true);
        let panicked = s.stop().await;
        assert_eq!(starts.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(panicked.len(), 1, "the panic while stopping is reported");
    }
}
