//! The maps the programs use, held by the agent, and their pins checked
//! against them.
//!
//! The programs this agent loaded reference the maps [`super::Datapath::open`]
//! created or reused, by descriptor; a pin is only a name for a map. Someone
//! can remove a pin (`rm`) or put another map of the same definition at its
//! path (`bpftool map create ... pinned ...`), and the programs keep using
//! the map they were loaded with. So the agent reads and writes its maps
//! only through the descriptors it holds ([`HeldMaps`]), never by path, and
//! [`super::Datapath::pin_faults`] compares each pin's map id with the id of
//! the map the programs use. A fault is repaired by pinning the agent's own
//! map at the path again ([`super::Datapath::repair_pins`]): at a temporary
//! name first, then renamed over whatever is there, so the path never shows
//! a missing or half-made pin to readers (`lockstep maps dump`, bpftool,
//! the next agent to start).

use std::collections::BTreeMap;
use std::fmt;
use std::os::fd::AsFd as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use aya::maps::MapData;
use serde::{Deserialize, Serialize};

use super::DatapathError;
use super::owner::OwnerGuard;

/// The maps the loaded programs use, by name, held open by descriptor.
#[derive(Debug)]
pub struct HeldMaps {
    maps: BTreeMap<&'static str, (MapData, u32)>,
}

impl HeldMaps {
    /// Holds `maps` (name → the loaded map).
    ///
    /// # Errors
    /// A map's id cannot be read.
    pub fn new(maps: BTreeMap<&'static str, MapData>) -> Result<Self, DatapathError> {
        let mut held = BTreeMap::new();
        for (name, map) in maps {
            let id = map
                .info()
                .map_err(|source| DatapathError::MapAccess {
                    action: "inspect",
                    map: name,
                    source: Box::new(source),
                })?
                .id();
            held.insert(name, (map, id));
        }
        Ok(Self { maps: held })
    }

    /// The id of each held map.
    pub fn ids(&self) -> BTreeMap<&'static str, u32> {
        self.maps.iter().map(|(n, (_, id))| (*n, *id)).collect()
    }

    /// A new handle (a duplicated descriptor) on the held map `name`.
    ///
    /// # Errors
    /// No such map, or the descriptor cannot be duplicated.
    pub fn open(&self, name: &str) -> Result<MapData, DatapathError> {
        let access = |map: &'static str, source: Box<dyn std::error::Error + Send + Sync>| {
            DatapathError::MapAccess {
                action: "open",
                map,
                source,
            }
        };
        let (map_name, (map, _)) = self
            .maps
            .get_key_value(name)
            .ok_or_else(|| access("(unknown map)", format!("no map named {name}").into()))?;
        let fd = map
            .fd()
            .as_fd()
            .try_clone_to_owned()
            .map_err(|e| access(map_name, Box::new(e)))?;
        MapData::from_fd(fd).map_err(|e| access(map_name, Box::new(e)))
    }

    fn get(&self, name: &str) -> Option<&(MapData, u32)> {
        self.maps.get(name)
    }
}

/// What is wrong with one map's pin.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PinFault {
    /// The map.
    pub map: String,
    /// The pin's path.
    pub pin: PathBuf,
    /// The id of the map the programs use.
    pub program_map_id: u32,
    /// The id of the map at the pin, when there is one.
    pub pinned_map_id: Option<u32>,
    /// `removed`, `replaced` or `unreadable`.
    pub kind: String,
}

impl fmt::Display for PinFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.pinned_map_id {
            Some(id) => write!(
                f,
                "pin {} of map {} is {}: it holds map id {id}, the programs use map id {}",
                self.pin.display(),
                self.map,
                self.kind,
                self.program_map_id
            ),
            None => write!(
                f,
                "pin {} of map {} is {}: the programs use map id {}",
                self.pin.display(),
                self.map,
                self.kind,
                self.program_map_id
            ),
        }
    }
}

/// The fault of the pin of `name` at `pin`, if any.
fn fault(name: &str, pin: &Path, program_map_id: u32) -> Option<PinFault> {
    let make = |pinned_map_id, kind: &str| {
        Some(PinFault {
            map: name.to_string(),
            pin: pin.to_path_buf(),
            program_map_id,
            pinned_map_id,
            kind: kind.to_string(),
        })
    };
    match std::fs::symlink_metadata(pin) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return make(None, "removed"),
        Err(_) => return make(None, "unreadable"),
        Ok(m) if !m.file_type().is_file() => return make(None, "replaced"),
        Ok(_) => {}
    }
    match MapData::from_pin(pin).and_then(|m| m.info()) {
        Ok(info) if info.id() == program_map_id => None,
        Ok(info) => make(Some(info.id()), "replaced"),
        Err(_) if !pin.exists() => make(None, "removed"),
        // Something that is not a map (a pinned program or link).
        Err(_) => make(None, "replaced"),
    }
}

/// The pin root's check, runnable from any thread: whether the agent still
/// owns it, and whether each map pin names the map the programs use. Status
/// runs it without waiting for the agent's owner (`agent::handle`); the
/// agent runs the same check before it writes maps.
#[derive(Debug)]
pub struct PinProbe {
    owner: Option<Arc<OwnerGuard>>,
    maps: BTreeMap<&'static str, u32>,
    maps_dir: PathBuf,
}

impl PinProbe {
    /// The check of `owner`'s claim and of the pins under `maps_dir` of the
    /// maps of `maps` (name → the programs' map id).
    pub fn new(
        owner: Option<Arc<OwnerGuard>>,
        maps: BTreeMap<&'static str, u32>,
        maps_dir: PathBuf,
    ) -> Self {
        Self {
            owner,
            maps,
            maps_dir,
        }
    }

    /// Why the agent must not write maps: another store took its pin root
    /// over (for good), or its owner record cannot be read.
    pub fn ownership(&self) -> Option<String> {
        self.owner.as_ref().and_then(|o| o.check().err())
    }

    /// Every pin that does not name the programs' map.
    pub fn faults(&self) -> Vec<PinFault> {
        self.maps
            .iter()
            .filter_map(|(name, id)| fault(name, &self.maps_dir.join(name), *id))
            .collect()
    }

    /// Why status is not ready because of the pin root, if it is not:
    /// ownership first, then every map pin that is wrong.
    pub fn problem(&self) -> Option<String> {
        if let Some(lost) = self.ownership() {
            return Some(lost);
        }
        let faults = self.faults();
        (!faults.is_empty()).then(|| {
            let list: Vec<String> = faults.iter().map(ToString::to_string).collect();
            format!(
                "{}; the next reconcile pins the programs' maps again",
                list.join("; ")
            )
        })
    }
}

/// Pins the held map of each fault at its path again, replacing what is
/// there. Returns the maps repaired.
pub(super) fn repair(
    held: &HeldMaps,
    maps_dir: &Path,
    faults: &[PinFault],
) -> Result<Vec<String>, DatapathError> {
    let mut repaired = Vec::new();
    for f in faults {
        let Some((map, id)) = held.get(&f.map) else {
            continue;
        };
        // Checked again: it may have been put right since.
        let pin = maps_dir.join(&f.map);
        if fault(&f.map, &pin, *id).is_none() {
            continue;
        }
        let nonce = getrandom::u64().map_err(|e| DatapathError::Fs {
            action: "name a temporary pin in",
            path: maps_dir.to_path_buf(),
            source: std::io::Error::other(e),
        })?;
        // bpffs refuses names with a dot.
        let temp = maps_dir.join(format!("{}-repair-{nonce:016x}", f.map));
        map.pin(&temp).map_err(|e| DatapathError::LinkPin {
            action: "pin map at",
            path: temp.clone(),
            source: Box::new(e),
        })?;
        if let Err(source) = std::fs::rename(&temp, &pin) {
            let _ = std::fs::remove_file(&temp);
            return Err(DatapathError::Fs {
                action: "rename a repaired pin to",
                path: pin,
                source,
            });
        }
        tracing::warn!(fault = %f, "pin repaired: it names the programs' map again");
        repaired.push(f.map.clone());
    }
    Ok(repaired)
}

/// The map data inside a loaded map of one of lockstep's types.
pub(super) fn map_data(name: &'static str, map: aya::maps::Map) -> Result<MapData, DatapathError> {
    use aya::maps::Map;
    match map {
        Map::HashMap(d)
        | Map::LruHashMap(d)
        | Map::Array(d)
        | Map::LpmTrie(d)
        | Map::PerCpuArray(d) => Ok(d),
        _ => Err(DatapathError::MapAccess {
            action: "hold",
            map: name,
            source: "the loaded map is of a type lockstep does not use".into(),
        }),
    }
}

/// Removes temporary pins a repair killed half-way left in `maps_dir`.
pub(super) fn sweep_repair_temps(maps_dir: &Path) -> Result<(), DatapathError> {
    let read = |source| DatapathError::Fs {
        action: "read",
        path: maps_dir.to_path_buf(),
        source,
    };
    for entry in std::fs::read_dir(maps_dir).map_err(read)? {
        let entry = entry.map_err(read)?;
        let name = entry.file_name();
        if name.to_str().is_some_and(|n| n.contains("-repair-")) {
            let p = entry.path();
            if let Err(source) = std::fs::remove_file(&p)
                && source.kind() != std::io::ErrorKind::NotFound
            {
                return Err(DatapathError::Fs {
                    action: "remove",
                    path: p,
                    source,
                });
            }
        }
    }
    Ok(())
}
