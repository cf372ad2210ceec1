//! Every long-running task of the agent, watched by name: a task that
//! panics is logged with its name and the panic's message and stops the
//! agent (it exits non-zero and its DaemonSet starts it again), rather than
//! vanishing while the rest runs on without it. A task that ends on its
//! own before the stop (a set-up that finished) is logged and let go.
//!
//! It exists so the server's start-up code hands each task over once and
//! the stop waits for all of them, in one place.

use tokio::task::{JoinHandle, JoinSet};

/// A task that panicked: its name and the panic's message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("task {task} panicked: {message}")]
pub struct Panicked {
    /// The name it was watched under.
    pub task: String,
    /// The panic's payload, when it is text.
    pub message: String,
}

/// The watched tasks.
#[derive(Default)]
pub struct Supervisor {
    tasks: JoinSet<(String, Result<(), tokio::task::JoinError>)>,
}

impl Supervisor {
    /// Watches `handle` under `name`.
    pub fn watch<T: Send + 'static>(&mut self, name: impl Into<String>, handle: JoinHandle<T>) {
        let name = name.into();
        self.tasks
            .spawn(async move { (name, handle.await.map(drop)) });
    }

    /// Returns the first task that panics; never while none does.
    pub async fn panicked(&mut self) -> Panicked {
        loop {
            match self.tasks.join_next().await {
                Some(Ok((task, Err(e)))) if e.is_panic() => {
                    return Panicked {
                        task,
                        message: panic_message(e.into_panic()),
                    };
                }
                Some(Ok((task, _))) => {
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
            if let Ok((task, Err(e))) = joined
                && e.is_panic()
            {
                let p = Panicked {
                    task,
                    message: panic_message(e.into_panic()),
                };
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
        let mut s = Supervisor::default();
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
        let mut s = Supervisor::default();
        let (tx, rx) = tokio::sync::watch::channel(false);
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
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
}
