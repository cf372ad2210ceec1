//! The server's own loops on the agent: the periodic reconcile and, in
//! delegated mode, the set-up retried until it succeeds. Each is a task
//! that sends commands to the agent's owner (`agent::handle`) and holds no
//! state of its own, so the supervisor can start it again.

use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::agent::delegated::poll_setup;
use crate::agent::{AgentError, AgentHandle};
use crate::metrics::Heartbeat;

/// How often a pending set-up is tried again.
const SETUP_EVERY: Duration = Duration::from_millis(200);

/// Delegated mode waits for its conflist and plugin without exiting:
/// status says why; set-up is tried every [`SETUP_EVERY`] until it
/// succeeds, or it refuses for good (sent on `fatal`: the agent stops with
/// that error).
pub(super) fn setup(
    slot: AgentHandle,
    fatal: mpsc::Sender<AgentError>,
    mut stop: watch::Receiver<bool>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = tokio::time::sleep(SETUP_EVERY) => {}
                _ = stop.wait_for(|s| *s) => break,
            }
            // The plugin runs on the blocking pool, the agent free between
            // set-up's steps (`agent::delegated::setup`).
            let handle = slot.clone();
            let attempt = tokio::task::spawn_blocking(move || poll_setup(&handle));
            let r = tokio::select! {
                r = attempt => r,
                // Not waited for: its next step on the stopped owner fails.
                _ = stop.wait_for(|s| *s) => break,
            };
            match r {
                Ok(Ok(true)) => break,
                Ok(Ok(false)) => {}
                Ok(Err(AgentError::Delegate(e))) if e.is_fatal() => {
                    let _ = fatal.send(AgentError::Delegate(e)).await;
                    break;
                }
                // The owner stopped (or holds no agent): its end is
                // reported where it is watched.
                Ok(Err(_)) => break,
                Err(e) => {
                    tracing::error!(error = %e, "delegated set-up panicked");
                    break;
                }
            }
        }
    })
}

/// Reconciles the agent every `interval` until `stop`, beating `heartbeat`
/// after each pass.
pub(super) fn reconciler(
    slot: AgentHandle,
    interval: Duration,
    heartbeat: Heartbeat,
    mut stop: watch::Receiver<bool>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval);
        tick.tick().await;
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.wait_for(|s| *s) => break,
            }
            let _ = slot
                .ask(|a| {
                    if let Some(agent) = a.as_mut()
                        && let Err(e) = agent.reconcile()
                    {
                        tracing::error!(error = %e, "periodic reconcile failed");
                    }
                })
                .await;
            heartbeat.beat();
        }
    })
}
