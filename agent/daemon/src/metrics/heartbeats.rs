//! The agent's loops' signs of progress, for `/healthz`: each loop beats
//! after every pass, and [`Heartbeats::stale`] asks the core
//! (`lockstep_core::health`) which went silent for too long.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lockstep_core::health::{Beat, stale};

/// One registered loop.
#[derive(Debug)]
struct Entry {
    name: &'static str,
    period_ms: u64,
    started_ms: u64,
    /// Milliseconds since the origin of the last pass, plus one (0: none).
    last: Arc<AtomicU64>,
}

/// Every loop's heartbeat, on one monotonic clock.
#[derive(Debug)]
pub struct Heartbeats {
    origin: Instant,
    loops: Mutex<Vec<Entry>>,
}

impl Default for Heartbeats {
    fn default() -> Self {
        Self {
            origin: Instant::now(),
            loops: Mutex::new(Vec::new()),
        }
    }
}

/// What a loop holds to beat.
#[derive(Clone, Debug)]
pub struct Heartbeat {
    origin: Instant,
    last: Arc<AtomicU64>,
}

impl Heartbeat {
    /// The loop finished a pass.
    pub fn beat(&self) {
        let ms = self.origin.elapsed().as_millis() as u64;
        self.last.store(ms + 1, Ordering::Release);
    }
}

impl Heartbeats {
    fn now_ms(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64
    }

    /// Registers a loop that runs every `period`; it counts from now.
    pub fn register(&self, name: &'static str, period: Duration) -> Heartbeat {
        let last = Arc::new(AtomicU64::new(0));
        self.loops
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(Entry {
                name,
                period_ms: period.as_millis() as u64,
                started_ms: self.now_ms(),
                last: last.clone(),
            });
        Heartbeat {
            origin: self.origin,
            last,
        }
    }

    /// The loops silent past their allowance, each named with its silence.
    pub fn stale(&self) -> Vec<String> {
        let beats: Vec<Beat> = self
            .loops
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .map(|e| Beat {
                name: e.name,
                period_ms: e.period_ms,
                last_ms: match e.last.load(Ordering::Acquire) {
                    0 => None,
                    n => Some(n - 1),
                },
                started_ms: e.started_ms,
            })
            .collect();
        stale(&beats, self.now_ms())
    }
}
