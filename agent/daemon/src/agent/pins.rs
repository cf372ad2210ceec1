//! The agent's side of its pin root: whether it still owns it, and whether
//! each map pin names the map its programs use (`crate::datapath::owner`,
//! `crate::datapath::pins`).
//!
//! - Ownership is checked before every change that writes maps and on every
//!   reconcile: once another store has taken the pin root over, the agent
//!   refuses them ("not ready", with who took it) and writes no map again.
//! - A removed or replaced map pin makes status not ready with the fault,
//!   is named by `verify` (which changes nothing), and is repaired by the
//!   next reconcile (the periodic tick, or `POST /v1/reconcile`): the
//!   agent's own map is pinned at the path again and refilled from the
//!   store by the same reconcile; each repair is counted per map
//!   (`lockstep_pin_repairs_total`). Requests keep being served meanwhile:
//!   the agent writes the maps the programs use, through its descriptors.

use super::{Agent, AgentError};

impl Agent {
    /// Why this agent must not write maps: another store took its pin root
    /// over (for good), or its owner record cannot be read.
    pub(super) fn ownership_problem(&self) -> Option<String> {
        self.datapath.pin_probe().ownership()
    }

    /// What `verify` reports about the pin root: the lost ownership, and
    /// each map pin that does not name the programs' map.
    pub(super) fn verify_pins(&self) -> Vec<String> {
        let mut out: Vec<String> = self.ownership_problem().into_iter().collect();
        out.extend(self.datapath.pin_faults().iter().map(ToString::to_string));
        out
    }

    /// Before a reconcile writes: refuses when the pin root is not this
    /// agent's any more, and pins the programs' maps again where a pin is
    /// removed or replaced (counted per map). The reconcile that follows
    /// refills them from the store.
    ///
    /// # Errors
    /// [`AgentError::NotReady`] when ownership is lost; a pin could not be
    /// repaired.
    pub(super) fn guard_pins(&mut self) -> Result<(), AgentError> {
        if let Some(reason) = self.ownership_problem() {
            return Err(AgentError::NotReady { reason });
        }
        let faults = self.datapath.pin_faults();
        if faults.is_empty() {
            return Ok(());
        }
        for map in self.datapath.repair_pins(&faults)? {
            *self.stats.pin_repairs.entry(map).or_default() += 1;
        }
        Ok(())
    }
}
