//! The blocks this node holds, kept durably in the state directory
//! (`cluster.json`) so a restart serves its blocks before etcd answers, and
//! knows which of them to check (fence) once it does.
//!
//! Written whole to a temporary file, synced and renamed over the old one:
//! a crash leaves the old or the new list, never a mix. A block is recorded
//! before it is added to the allocator and forgotten only after etcd took
//! it back, so the file never lists less than the node may hand out.
//!
//! Beside it, `cluster-etcd.json` keeps where the node last saw etcd (its
//! cluster ID and the highest store revision, the core's `StoreMark`), so a
//! node restarted across a restore of etcd from a backup still tells that
//! etcd went back in time. A file of its own: an older build, which
//! refuses unknown fields in `cluster.json`, still starts after a
//! downgrade.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use ipnet::IpNet;
use lockstep_core::cluster::{ClusterPoolSpec, StoreMark};
use serde::{Deserialize, Serialize};

/// The file's name in the state directory.
pub const FILE: &str = "cluster.json";

/// The name of the file keeping where the node last saw etcd.
pub const MARK_FILE: &str = "cluster-etcd.json";

/// The name of the file keeping the reservation window the allocator
/// serves (#43): never more than etcd holds. A file of its own, as the
/// mark's, so an older build still starts after a downgrade.
pub const WINDOW_FILE: &str = "cluster-window.json";

/// Errors of reading or writing the held-blocks file.
#[derive(Debug, thiserror::Error)]
pub enum HeldError {
    /// The file could not be read or written.
    #[error("cluster state {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The file does not hold what this build writes.
    #[error("cluster state {path} is unreadable: {reason}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

/// One block the node holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeldBlock {
    /// Its cluster pool.
    pub pool: String,
    /// The block.
    pub cidr: IpNet,
    /// The block key's mod revision when claimed (a give-back compares it).
    pub revision: i64,
    /// Why no new address may come from it, once etcd said it is not this
    /// node's (kept until the block is empty).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fenced: Option<String>,
    /// Its give-back was sent and etcd's answer never came: it may be
    /// gone already (another node may claim it), so it is out of the
    /// allocator, and neither served nor fenced, until the give-back is
    /// settled (made again, or a read finds it gone).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub releasing: bool,
}

impl HeldBlock {
    /// Whether new addresses may come from it: neither fenced nor being
    /// given back.
    pub fn serves(&self) -> bool {
        self.fenced.is_none() && !self.releasing
    }
}

/// A claim recorded before it is sent: until etcd's answer (or a read)
/// settles it, the block may be this node's in etcd. Kept durably so a
/// restart between the claim and its answer does not forget a block etcd
/// gives this node (it would be held in etcd and served by no one).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnsettledClaim {
    /// The pool claimed from.
    pub pool: String,
    /// The block claimed.
    pub cidr: IpNet,
}

/// `cluster-window.json`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
struct WindowFile {
    addresses: std::collections::BTreeSet<std::net::IpAddr>,
}

/// What the node knows of the cluster without etcd.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Held {
    /// The node name the blocks were claimed as.
    pub node: String,
    /// This agent's instance identity (#26 item 5), made at its first
    /// start in cluster mode and written into every record it puts in
    /// etcd. Empty in a record of an older build (one is made then).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub instance: String,
    /// The cluster pools as last read.
    pub pools: Vec<ClusterPoolSpec>,
    /// The default pool etcd recorded, as last read (`None`: none
    /// recorded; the only pool then is the default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_pool: Option<String>,
    /// The blocks.
    pub blocks: Vec<HeldBlock>,
    /// Claims sent (or about to be) whose outcome is not known yet.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unsettled: Vec<UnsettledClaim>,
    /// Addresses other nodes' pods may hold (reserved for a removed or
    /// reclaimed node), as last read: never handed out from a block of
    /// this node, with etcd down too.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reserved: Vec<std::net::IpAddr>,
}

impl Held {
    /// Reads `<state_dir>/cluster.json`; none yet is an empty list.
    ///
    /// # Errors
    /// The file exists but cannot be read or parsed.
    pub fn load(state_dir: &Path) -> Result<Self, HeldError> {
        let path = state_dir.join(FILE);
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| HeldError::Corrupt {
                path,
                reason: e.to_string(),
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Self::default()),
            Err(source) => Err(HeldError::Io { path, source }),
        }
    }

    /// Writes the list durably (temporary file, fsync, rename, fsync of
    /// the directory).
    ///
    /// # Errors
    /// Any step failed; the old file is then unchanged.
    pub fn save(&self, state_dir: &Path) -> Result<(), HeldError> {
        write_json(state_dir, FILE, self)
    }

    /// Where the node last saw etcd (`cluster-etcd.json`); `None` when it
    /// never recorded it.
    ///
    /// # Errors
    /// The file exists but cannot be read or parsed.
    pub fn load_mark(state_dir: &Path) -> Result<Option<StoreMark>, HeldError> {
        let path = state_dir.join(MARK_FILE);
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| HeldError::Corrupt {
                    path,
                    reason: e.to_string(),
                }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(HeldError::Io { path, source }),
        }
    }

    /// Records where the node last saw etcd, durably as [`Held::save`].
    ///
    /// # Errors
    /// Any step failed; the old file is then unchanged.
    pub fn save_mark(state_dir: &Path, mark: StoreMark) -> Result<(), HeldError> {
        write_json(state_dir, MARK_FILE, &mark)
    }

    /// The reservation window the allocator serves (`cluster-window.json`),
    /// or `None` before one was recorded (a record older than windows: no
    /// address of a cluster block is handed out until one is published).
    ///
    /// # Errors
    /// The file exists but cannot be read or parsed.
    pub fn load_window(
        state_dir: &Path,
    ) -> Result<Option<std::collections::BTreeSet<std::net::IpAddr>>, HeldError> {
        let path = state_dir.join(WINDOW_FILE);
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice::<WindowFile>(&bytes)
                .map(|w| Some(w.addresses))
                .map_err(|e| HeldError::Corrupt {
                    path,
                    reason: e.to_string(),
                }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(HeldError::Io { path, source }),
        }
    }

    /// Records the window the allocator serves, durably as [`Held::save`]:
    /// after etcd holds it when it grows, before etcd does when it shrinks.
    ///
    /// # Errors
    /// Any step failed; the old file is then unchanged.
    pub fn save_window(
        state_dir: &Path,
        addresses: &std::collections::BTreeSet<std::net::IpAddr>,
    ) -> Result<(), HeldError> {
        write_json(
            state_dir,
            WINDOW_FILE,
            &WindowFile {
                addresses: addresses.clone(),
            },
        )
    }

    /// The blocks new addresses may come from (neither fenced nor being
    /// given back).
    pub fn serving(&self) -> impl Iterator<Item = &HeldBlock> + '_ {
        self.blocks.iter().filter(|b| b.serves())
    }

    /// Records, before it is sent, that `cidr` of `pool` is being claimed.
    pub fn record_unsettled(&mut self, pool: &str, cidr: IpNet) {
        if !self.unsettled.iter().any(|u| u.cidr == cidr) {
            self.unsettled.push(UnsettledClaim {
                pool: pool.to_owned(),
                cidr,
            });
        }
    }

    /// Forgets the unsettled claim of `cidr` (etcd answered: not ours).
    pub fn settle_unsettled(&mut self, cidr: IpNet) {
        self.unsettled.retain(|u| u.cidr != cidr);
    }

    /// Records a block etcd just gave this node: a new entry, or the
    /// node's own fenced entry for it made whole again (claiming a fenced
    /// block back is the way back; a second entry left the block fenced,
    /// so never served, while the claim loop counted it as room). Gives
    /// the entry it replaced, for [`Held::unrecord_claim`].
    pub fn record_claim(&mut self, pool: &str, cidr: IpNet, revision: i64) -> Option<HeldBlock> {
        let new = HeldBlock {
            pool: pool.to_owned(),
            cidr,
            revision,
            fenced: None,
            releasing: false,
        };
        self.settle_unsettled(cidr);
        match self.blocks.iter_mut().find(|b| b.cidr == cidr) {
            Some(b) => Some(std::mem::replace(b, new)),
            None => {
                self.blocks.push(new);
                None
            }
        }
    }

    /// Undoes [`Held::record_claim`] of `cidr` of `pool` (it could not be
    /// saved): the entry it replaced comes back, or the block is dropped;
    /// the claim is unsettled again (etcd gives it this node: the next read
    /// records it).
    pub fn unrecord_claim(&mut self, pool: &str, cidr: IpNet, replaced: Option<HeldBlock>) {
        self.record_unsettled(pool, cidr);
        match replaced {
            Some(old) => {
                if let Some(b) = self.blocks.iter_mut().find(|b| b.cidr == cidr) {
                    *b = old;
                }
            }
            None => self.blocks.retain(|b| b.cidr != cidr),
        }
    }
}

/// Writes `value` as `<state_dir>/<file>` whole: a temporary file,
/// fsync, rename, fsync of the directory (the NodeIPAM record too).
///
/// # Errors
/// Any step failed; the old file is then unchanged.
pub(crate) fn write_json(
    state_dir: &Path,
    file: &str,
    value: &impl Serialize,
) -> Result<(), HeldError> {
    let path = state_dir.join(file);
    let tmp = state_dir.join(format!("{file}.tmp"));
    let io = |source| HeldError::Io {
        path: path.clone(),
        source,
    };
    let bytes = serde_json::to_vec_pretty(value).map_err(|e| HeldError::Corrupt {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    let mut f = std::fs::File::create(&tmp).map_err(io)?;
    f.write_all(&bytes).map_err(io)?;
    f.sync_all().map_err(io)?;
    std::fs::rename(&tmp, &path).map_err(io)?;
    std::fs::File::open(state_dir)
        .and_then(|d| d.sync_all())
        .map_err(io)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saved_blocks_come_back_and_a_missing_file_is_empty() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(Held::load(dir.path()).expect("none"), Held::default());
        let held = Held {
            node: "a".into(),
            instance: "0123".into(),
            pools: vec![ClusterPoolSpec::new("p").with_cidr("10.0.0.0/24".parse().expect("net"))],
            default_pool: Some("p".into()),
            blocks: vec![HeldBlock {
                pool: "p".into(),
                cidr: "10.0.0.64/26".parse().expect("net"),
                revision: 7,
                fenced: Some("held by b".into()),
                releasing: false,
            }],
            unsettled: Vec::new(),
            reserved: vec!["10.0.0.70".parse().expect("addr")],
        };
        held.save(dir.path()).expect("save");
        assert_eq!(Held::load(dir.path()).expect("load"), held);
        assert_eq!(held.serving().count(), 0);
        // Claimed back: one entry, serving, with the new revision; undone,
        // the fenced entry is back.
        let mut back = held.clone();
        let cidr: IpNet = "10.0.0.64/26".parse().expect("net");
        let replaced = back.record_claim("p", cidr, 9);
        assert_eq!(back.blocks.len(), 1);
        assert_eq!(back.serving().map(|b| b.revision).collect::<Vec<_>>(), [9]);
        back.unrecord_claim("p", cidr, replaced);
        back.settle_unsettled(cidr);
        assert_eq!(back, held);
        let other: IpNet = "10.0.0.128/26".parse().expect("net");
        let none = back.record_claim("p", other, 10);
        assert!(none.is_none() && back.blocks.len() == 2);
        back.unrecord_claim("p", other, none);
        assert_eq!(back.unsettled.len(), 1);
        back.settle_unsettled(other);
        assert_eq!(back, held);
        // Where etcd was last seen: none yet, then what was saved.
        assert_eq!(Held::load_mark(dir.path()).expect("none"), None);
        let mark = StoreMark {
            cluster_id: 0xfeed,
            revision: 42,
        };
        Held::save_mark(dir.path(), mark).expect("save mark");
        assert_eq!(Held::load_mark(dir.path()).expect("mark"), Some(mark));
        std::fs::write(dir.path().join(MARK_FILE), b"[").expect("write");
        assert!(matches!(
            Held::load_mark(dir.path()),
            Err(HeldError::Corrupt { .. })
        ));
        std::fs::write(dir.path().join(FILE), b"{").expect("write");
        assert!(matches!(
            Held::load(dir.path()),
            Err(HeldError::Corrupt { .. })
        ));
    }
}
