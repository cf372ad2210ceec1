//! Who owns a pin root: exactly one agent's store.
//!
//! Two agents on one pin root (each with its own state directory) delete
//! each other's map entries on every reconcile, and each hands out
//! addresses the other holds. So an agent claims its pin root before
//! anything under it is opened, created or migrated: `<pin_root>/owner` is
//! an *owner record* naming the claiming store's identity
//! ([`crate::store::Store::id`]) and its state directory. A pin root owned
//! by another store is refused with an error naming both; it changes hands
//! only by an explicit take-over ([`claim`] with `take_over`:
//! `lockstep agent --take-over-pin-root`). The agent that lost it notices at
//! its next check ([`OwnerGuard::check`]: every request that writes maps and
//! every reconcile) and stops writing maps.
//!
//! bpffs holds no regular files, so the record is a BPF object: a one-entry
//! array map, written whole, frozen (no syscall can change it afterwards)
//! and read-only to programs, then pinned. It appears at its path at once or
//! not at all: it is pinned at a temporary name (`owner-tmp-<nonce>`) and then
//! linked to `owner` when there is no record (`link` fails if one appeared
//! meanwhile, so two agents starting together cannot both win) or renamed
//! over the old record on a take-over. A pin is created mode 0600. A symbolic
//! link or any other object at the path is refused, never followed.
//! Temporary names a killed claim left behind are removed by the next claim.
//!
//! A restart of the same agent (same store) keeps its record, whatever
//! `migrate` says, so an image upgrade (same state directory) takes over
//! its own pins as before. A record whose store is gone (its state
//! directory holds no store any more) is still refused without the
//! take-over option: the error says so.

use std::fmt;
use std::io;
use std::os::fd::AsFd as _;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};

use aya::maps::{MapData, MapType};

use super::sys;

/// Name of the owner record under the pin root.
pub const OWNER_PIN: &str = "owner";
/// Kernel name of the record's map (as `bpftool map show` prints it).
pub const OWNER_MAP_NAME: &str = "lockstep_owner";
/// Prefix of the temporary names a claim pins its record at first.
/// (bpffs refuses names with a dot.)
const TEMP_PREFIX: &str = "owner-tmp-";
/// First bytes of a record: a format tag.
const MAGIC: &[u8; 8] = b"LSOWNER1";
/// Value size of the record's map.
const RECORD_SIZE: usize = 4096;
/// Magic, store id, claim time (unix seconds), state directory length.
const HEADER: usize = 8 + 8 + 8 + 4;

/// Errors of the owner record.
#[derive(Debug, thiserror::Error)]
pub enum OwnerError {
    /// Another store owns the pin root.
    #[error(
        "pin root {pin_root} belongs to another agent: {owner}{stale}; this agent is {claimant}. \
         Two agents on one pin root delete each other's map entries: give this agent its own \
         datapath.pin_root, or take the pin root over with `lockstep agent --take-over-pin-root` \
         (datapath.take_over_pin_root = true), after which the other agent stops writing maps"
    )]
    OwnedByAnother {
        /// The pin root.
        pin_root: PathBuf,
        /// Who owns it.
        owner: PinOwner,
        /// Who asked.
        claimant: PinOwner,
        /// " (stale: ...)" when the owner's state directory holds no store.
        stale: String,
    },
    /// Something at the record's path is not an owner record.
    #[error("{path} is not a lockstep owner record ({reason}); remove it if nothing uses it")]
    NotARecord {
        /// The path.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The state directory's path does not fit in a record.
    #[error("state directory {path} is too long for the pin root's owner record")]
    PathTooLong {
        /// The state directory.
        path: PathBuf,
    },
    /// A filesystem operation on the pin root failed.
    #[error("cannot {action} {path}")]
    Fs {
        /// What was being done.
        action: &'static str,
        /// The path.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// A BPF operation on the record failed.
    #[error("cannot {action} the owner record {path}")]
    Bpf {
        /// What was being done.
        action: &'static str,
        /// The record's path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// An owner of a pin root: a store, by identity, and where it lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PinOwner {
    /// The store's identity.
    pub store_id: u64,
    /// Its state directory.
    pub state_dir: PathBuf,
}

impl fmt::Display for PinOwner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "store {:016x} (state directory {})",
            self.store_id,
            self.state_dir.display()
        )
    }
}

impl PinOwner {
    fn encode(&self) -> Result<Vec<u8>, OwnerError> {
        let dir = self.state_dir.as_os_str().as_encoded_bytes();
        if dir.len() > RECORD_SIZE - HEADER {
            return Err(OwnerError::PathTooLong {
                path: self.state_dir.clone(),
            });
        }
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let mut v = vec![0u8; RECORD_SIZE];
        v[..8].copy_from_slice(MAGIC);
        v[8..16].copy_from_slice(&self.store_id.to_le_bytes());
        v[16..24].copy_from_slice(&secs.to_le_bytes());
        v[24..28].copy_from_slice(&(dir.len() as u32).to_le_bytes());
        v[HEADER..HEADER + dir.len()].copy_from_slice(dir);
        Ok(v)
    }

    /// The owner a record's bytes name, or why they name none.
    fn decode(v: &[u8]) -> Result<Self, String> {
        if v.len() != RECORD_SIZE || &v[..8] != MAGIC {
            return Err("it does not start with lockstep's record tag".into());
        }
        let store_id = u64::from_le_bytes(v[8..16].try_into().expect("8 bytes"));
        let len = u32::from_le_bytes(v[24..28].try_into().expect("4 bytes")) as usize;
        let dir = v
            .get(HEADER..HEADER + len)
            .ok_or_else(|| format!("its state directory length {len} overruns the record"))?;
        let dir =
            std::str::from_utf8(dir).map_err(|_| "its state directory is not UTF-8".to_string())?;
        Ok(Self {
            store_id,
            state_dir: PathBuf::from(dir),
        })
    }

    /// Whether this owner's state directory still holds a store.
    fn store_exists(&self) -> bool {
        self.state_dir.join(crate::store::DB_FILE).exists()
    }
}

fn fs_err(action: &'static str, path: &Path) -> impl FnOnce(io::Error) -> OwnerError {
    let path = path.to_path_buf();
    move |source| OwnerError::Fs {
        action,
        path,
        source,
    }
}

fn bpf_err<E: std::error::Error + Send + Sync + 'static>(
    action: &'static str,
    path: &Path,
) -> impl FnOnce(E) -> OwnerError {
    let path = path.to_path_buf();
    move |source| OwnerError::Bpf {
        action,
        path,
        source: Box::new(source),
    }
}

/// The path of the owner record of `pin_root`.
pub fn record_path(pin_root: &Path) -> PathBuf {
    pin_root.join(OWNER_PIN)
}

/// Reads the owner record of `pin_root`: its owner and the record map's id,
/// or `None` when there is no record.
///
/// # Errors
/// Something that is not an owner record is at its path, or it cannot be
/// read.
pub fn read(pin_root: &Path) -> Result<Option<(PinOwner, u32)>, OwnerError> {
    let path = record_path(pin_root);
    let not_record = |reason: &str| OwnerError::NotARecord {
        path: path.clone(),
        reason: reason.to_string(),
    };
    // Never followed: a pin is a regular file on bpffs; anything else at
    // the path (a symbolic link planted there) is refused.
    match std::fs::symlink_metadata(&path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(fs_err("inspect", &path)(e)),
        Ok(m) if !m.file_type().is_file() => {
            return Err(not_record("it is not a pinned object (a symbolic link?)"));
        }
        Ok(_) => {}
    }
    let map = match MapData::from_pin(&path) {
        Ok(m) => m,
        // Removed between the two looks.
        Err(_) if !path.exists() => return Ok(None),
        Err(_) => return Err(not_record("it is not a pinned map")),
    };
    let info = map.info().map_err(bpf_err("inspect", &path))?;
    let shaped = matches!(info.map_type(), Ok(MapType::Array))
        && info.key_size() == 4
        && info.value_size() as usize == RECORD_SIZE
        && info.max_entries() == 1;
    if !shaped {
        return Err(not_record("its map is not shaped as an owner record"));
    }
    let mut value = vec![0u8; RECORD_SIZE];
    sys::lookup_raw(map.fd().as_fd(), &0u32.to_ne_bytes(), &mut value)
        .map_err(bpf_err("read", &path))?;
    let owner = PinOwner::decode(&value).map_err(|r| not_record(&r))?;
    Ok(Some((owner, info.id())))
}

/// How a record goes to its path.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Place {
    /// Only if there is none (`link`).
    New,
    /// Over whatever is there (`rename`).
    Replace,
}

/// Writes `owner`'s record whole, freezes it and puts it at the record path
/// by `place`. Returns the record's map and id, or `None` (with `New`) when a
/// record appeared meanwhile.
fn write(
    pin_root: &Path,
    owner: &PinOwner,
    place: Place,
) -> Result<Option<(MapData, u32)>, OwnerError> {
    let path = record_path(pin_root);
    let value = owner.encode()?;
    let fd = sys::create_array(
        OWNER_MAP_NAME,
        RECORD_SIZE as u32,
        1,
        sys::BPF_F_RDONLY_PROG,
    )
    .map_err(bpf_err("create", &path))?;
    sys::update_raw(fd.as_fd(), &0u32.to_ne_bytes(), &value).map_err(bpf_err("write", &path))?;
    sys::freeze(fd.as_fd()).map_err(bpf_err("freeze", &path))?;
    let map = MapData::from_fd(fd).map_err(bpf_err("open", &path))?;
    let id = map.info().map_err(bpf_err("inspect", &path))?.id();
    pin_in_place(pin_root, &map, place).map(|placed| placed.then_some((map, id)))
}

/// Pins `map` at a temporary name and moves it to the record path by
/// `place`; returns whether it got there.
fn pin_in_place(pin_root: &Path, map: &MapData, place: Place) -> Result<bool, OwnerError> {
    let path = record_path(pin_root);
    let nonce = getrandom::u64()
        .map_err(|e| fs_err("name a temporary pin in", pin_root)(io::Error::other(e)))?;
    let temp = pin_root.join(format!("{TEMP_PREFIX}{nonce:016x}"));
    map.pin(&temp).map_err(bpf_err("pin", &temp))?;
    let moved = match place {
        Place::New => match std::fs::hard_link(&temp, &path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
            Err(e) => Err(fs_err("link", &path)(e)),
        },
        Place::Replace => std::fs::rename(&temp, &path)
            .map(|()| true)
            .map_err(fs_err("rename", &path)),
    };
    if place == Place::New || moved.is_err() {
        let _ = std::fs::remove_file(&temp);
    }
    moved
}

/// Removes temporary records a killed claim left under `pin_root`.
fn sweep_temps(pin_root: &Path) -> Result<(), OwnerError> {
    for entry in std::fs::read_dir(pin_root).map_err(fs_err("read", pin_root))? {
        let entry = entry.map_err(fs_err("read", pin_root))?;
        if entry
            .file_name()
            .to_str()
            .is_some_and(|n| n.starts_with(TEMP_PREFIX))
        {
            let p = entry.path();
            match std::fs::remove_file(&p) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => {
                    return Err(fs_err("remove", &p)(e));
                }
                _ => {}
            }
        }
    }
    Ok(())
}

/// Claims `pin_root` (an existing directory) for `me`: accepted when it has
/// no owner record (one is written) or when the record names `me` (a
/// restart); with `take_over`, a record of another store is replaced.
///
/// # Errors
/// [`OwnerError::OwnedByAnother`] naming both stores (and whether the other
/// one is stale); something else at the record path; a failed syscall.
pub fn claim(pin_root: &Path, me: &PinOwner, take_over: bool) -> Result<OwnerGuard, OwnerError> {
    sweep_temps(pin_root)?;
    for _ in 0..3 {
        let (map, id) = match read(pin_root)? {
            Some((owner, id)) if owner == *me => {
                let map = MapData::from_pin(record_path(pin_root))
                    .map_err(bpf_err("open", &record_path(pin_root)))?;
                (map, id)
            }
            Some((owner, _)) if take_over => {
                tracing::warn!(pin_root = %pin_root.display(), previous = %owner, new = %me, "taking the pin root over from another store");
                write(pin_root, me, Place::Replace)?.expect("a rename always places")
            }
            Some((owner, _)) => {
                let stale = if owner.store_exists() {
                    String::new()
                } else {
                    format!(
                        " (stale: {} holds no store any more; still refused without the take-over option)",
                        owner.state_dir.display()
                    )
                };
                return Err(OwnerError::OwnedByAnother {
                    pin_root: pin_root.to_path_buf(),
                    owner,
                    claimant: me.clone(),
                    stale,
                });
            }
            None => match write(pin_root, me, Place::New)? {
                Some(placed) => {
                    tracing::info!(pin_root = %pin_root.display(), owner = %me, "claimed the pin root");
                    placed
                }
                // Another claim won the race: judge its record.
                None => continue,
            },
        };
        return Ok(OwnerGuard {
            pin_root: pin_root.to_path_buf(),
            me: me.clone(),
            record: map,
            id: AtomicU32::new(id),
            lost: OnceLock::new(),
        });
    }
    Err(OwnerError::NotARecord {
        path: record_path(pin_root),
        reason: "it keeps changing while this agent claims the pin root".into(),
    })
}

/// A claimed pin root.
#[derive(Debug)]
pub struct OwnerGuard {
    pin_root: PathBuf,
    me: PinOwner,
    /// Our record's map, kept open to put it back if its pin is removed.
    record: MapData,
    /// The id of the record map at the path when last checked.
    id: AtomicU32,
    /// Why this agent does not own the pin root any more (for good).
    lost: OnceLock<String>,
}

impl OwnerGuard {
    /// The owner this guard claimed for.
    pub fn owner(&self) -> &PinOwner {
        &self.me
    }

    /// Whether the pin root is still this agent's: `Err` with the reason
    /// once another store took it over (from then on for good). A removed
    /// record is put back. About three syscalls when nothing changed.
    ///
    /// # Errors
    /// The reason this agent must not write maps any more.
    pub fn check(&self) -> Result<(), String> {
        if let Some(lost) = self.lost.get() {
            return Err(lost.clone());
        }
        let path = record_path(&self.pin_root);
        let now = MapData::from_pin(&path)
            .ok()
            .and_then(|m| m.info().ok())
            .map(|i| i.id());
        if now == Some(self.id.load(Ordering::Relaxed)) {
            return Ok(());
        }
        match read(&self.pin_root) {
            Ok(None) => {
                tracing::warn!(path = %path.display(), "the pin root's owner record was removed; putting it back");
                match pin_in_place(&self.pin_root, &self.record, Place::New) {
                    Ok(true) => Ok(()),
                    // Someone else's record appeared: judge it next time.
                    Ok(false) => Ok(()),
                    Err(e) => {
                        tracing::error!(error = %crate::error_chain(&e), "cannot put the owner record back");
                        Ok(())
                    }
                }
            }
            Ok(Some((owner, id))) if owner == self.me => {
                self.id.store(id, Ordering::Relaxed);
                Ok(())
            }
            Ok(Some((owner, _))) => {
                let reason = format!(
                    "this agent lost pin root {} to {owner}, which took it over; it no longer \
                     writes maps: stop it, or restart it with its own datapath.pin_root",
                    self.pin_root.display()
                );
                tracing::error!(%reason, "pin root taken over");
                Err(self.lost.get_or_init(|| reason).clone())
            }
            Err(e) => {
                // Unreadable now (an object planted at the path): not
                // proof of a take-over; said until it is readable again.
                Err(format!(
                    "the owner record of pin root {} cannot be read: {}",
                    self.pin_root.display(),
                    crate::error_chain(&e)
                ))
            }
        }
    }
}

/// Removes the owner record of `pin_root` and any temporary records; a
/// missing one is not an error. Returns how many pins went.
///
/// # Errors
/// A pin exists but cannot be removed.
pub fn remove(pin_root: &Path) -> Result<usize, OwnerError> {
    if !pin_root.exists() {
        return Ok(0);
    }
    sweep_temps(pin_root)?;
    let path = record_path(pin_root);
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(1),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(0),
        Err(e) => Err(fs_err("remove", &path)(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_decodes_to_what_was_encoded() {
        let owner = PinOwner {
            store_id: 0x0123_4567_89ab_cdef,
            state_dir: PathBuf::from("/var/lib/lockstep"),
        };
        let bytes = owner.encode().expect("short path");
        assert_eq!(bytes.len(), RECORD_SIZE);
        assert_eq!(PinOwner::decode(&bytes), Ok(owner));
    }

    #[test]
    fn foreign_or_damaged_bytes_are_no_record() {
        assert!(PinOwner::decode(&[0u8; RECORD_SIZE]).is_err());
        let mut bytes = PinOwner {
            store_id: 1,
            state_dir: PathBuf::from("/s"),
        }
        .encode()
        .expect("short path");
        bytes[24..28].copy_from_slice(&(RECORD_SIZE as u32).to_le_bytes());
        assert!(PinOwner::decode(&bytes).is_err());
    }

    #[test]
    fn a_too_long_state_directory_is_refused() {
        let owner = PinOwner {
            store_id: 1,
            state_dir: PathBuf::from("/".repeat(RECORD_SIZE)),
        };
        assert!(matches!(
            owner.encode(),
            Err(OwnerError::PathTooLong { .. })
        ));
    }

    #[test]
    fn the_refusal_names_both_stores_and_the_way_out() {
        let err = OwnerError::OwnedByAnother {
            pin_root: PathBuf::from("/sys/fs/bpf/lockstep"),
            owner: PinOwner {
                store_id: 0xaa,
                state_dir: PathBuf::from("/a"),
            },
            claimant: PinOwner {
                store_id: 0xbb,
                state_dir: PathBuf::from("/b"),
            },
            stale: String::new(),
        };
        let text = err.to_string();
        for want in [
            "/sys/fs/bpf/lockstep",
            "00000000000000aa",
            "/a",
            "00000000000000bb",
            "/b",
            "--take-over-pin-root",
        ] {
            assert!(text.contains(want), "{want} missing from: {text}");
        }
    }
}
