//! Rare datapath events in the agent's log.
//!
//! Why it exists: a spoofed packet dropped or an ARP request answered is
//! invisible except as a counter, which says how often but not which
//! address or interface. The programs report such events through aya-log
//! when the pinned `DATAPATH_DEBUG` switch is on (`lockstep datapath debug
//! on`, or any `bpftool map update`), and the agent writes them to its log
//! (target `lockstep::datapath::events`). When the switch is off the
//! programs pay one inlined array read on those rare paths only, and
//! nothing reaches the ring.
//!
//! Each load of the programs has its own aya-log ring (not pinned); the
//! switch is pinned, so it survives agent restarts and upgrades.

use std::os::fd::{AsFd, BorrowedFd};
use std::path::Path;

use aya::maps::{Array, Map, MapData};
use lockstep_common::{debug, map_names};

use super::Datapath;

/// What can fail with datapath events.
#[derive(Debug, thiserror::Error)]
pub enum EventsError {
    /// The loaded object has no aya-log ring, or it could not be opened.
    #[error("cannot read the datapath's event ring")]
    Ring(#[source] aya_log::Error),
    /// The DATAPATH_DEBUG pin could not be opened, read or written.
    #[error("cannot {action} the DATAPATH_DEBUG switch at {pin}")]
    Switch {
        /// What was attempted.
        action: &'static str,
        /// The pin.
        pin: std::path::PathBuf,
        /// The cause.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// Passes aya-log records on to `tracing`.
struct ToTracing;

impl log::Log for ToTracing {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }

    fn log(&self, record: &log::Record<'_>) {
        tracing::info!(target: "lockstep::datapath::events", "{}", record.args());
    }

    fn flush(&self) {}
}

/// The programs' event ring; readable when events are waiting.
pub struct EventLog {
    logger: aya_log::EbpfLogger<ToTracing>,
}

impl EventLog {
    /// Writes every waiting event to the log.
    pub fn drain(&mut self) {
        self.logger.flush();
    }
}

impl AsFd for EventLog {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.logger.as_fd()
    }
}

impl std::os::fd::AsRawFd for EventLog {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        std::os::fd::AsRawFd::as_raw_fd(&self.logger)
    }
}

impl Datapath {
    /// Takes the event ring of the loaded programs (once).
    ///
    /// # Errors
    /// [`EventsError::Ring`]: taken already, or the object has none.
    pub fn event_log(&mut self) -> Result<EventLog, EventsError> {
        let logger = aya_log::EbpfLogger::init_with_logger(&mut self.ebpf, ToTracing)
            .map_err(EventsError::Ring)?;
        Ok(EventLog { logger })
    }
}

fn switch(pin_root: &Path, action: &'static str) -> Result<Array<MapData, u32>, EventsError> {
    let pin = pin_root.join("maps").join(map_names::DATAPATH_DEBUG);
    let fail = |source: Box<dyn std::error::Error + Send + Sync>| EventsError::Switch {
        action,
        pin: pin.clone(),
        source,
    };
    let data = MapData::from_pin(&pin).map_err(|e| fail(Box::new(e)))?;
    Array::try_from(Map::Array(data)).map_err(|e| fail(Box::new(e)))
}

/// Switches event reporting on or off for the programs under `pin_root`.
///
/// # Errors
/// [`EventsError::Switch`].
pub fn set_events(pin_root: &Path, on: bool) -> Result<(), EventsError> {
    let mut map = switch(pin_root, "write")?;
    let value = if on { debug::EVENTS } else { debug::OFF };
    map.set(0, value, 0).map_err(|e| EventsError::Switch {
        action: "write",
        pin: pin_root.join("maps").join(map_names::DATAPATH_DEBUG),
        source: Box::new(e),
    })
}

/// Whether event reporting is on for the programs under `pin_root`.
///
/// # Errors
/// [`EventsError::Switch`].
pub fn events_on(pin_root: &Path) -> Result<bool, EventsError> {
    let map = switch(pin_root, "read")?;
    let value = map.get(&0, 0).map_err(|e| EventsError::Switch {
        action: "read",
        pin: pin_root.join("maps").join(map_names::DATAPATH_DEBUG),
        source: Box::new(e),
    })?;
    Ok(value != debug::OFF)
}
