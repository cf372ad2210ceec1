//! The mirror's copy in the state directory (`cluster-mirror.json`, #47
//! item 3): every key under the prefix and the store revision they are
//! at, so a restarted agent resumes the watch from that revision instead
//! of reading the whole prefix again. At 5,000 nodes the prefix is
//! megabytes, and a rolling upgrade restarts every agent: each full read
//! is what etcd sends one agent, thousands of times.
//!
//! Resuming is exact: a watch from revision R + 1 delivers every change
//! after R, so the copy plus the watch is etcd's state. What the watch
//! cannot give, the mirror already handles as after any break: a history
//! compacted past R, another cluster ID, or a store whose revision is
//! below R (etcd restored from a backup) each make a full read. A copy
//! that does not read (torn, another prefix, another format) is ignored:
//! the agent reads everything, as it did before the copy existed.
//!
//! The copy is a cache: written whole (temporary file, fsync, rename) at
//! most every [`SAVE_EVERY`] while the mirror follows etcd and its
//! revision moved, and once more when the agent stops.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::Kv;
use crate::cluster::held::{HeldError, write_json};

/// The file's name in the state directory.
pub const FILE: &str = "cluster-mirror.json";

/// How often, at most, the copy is written while the watch follows.
pub const SAVE_EVERY: Duration = Duration::from_secs(30);

/// The format this build writes (another is ignored).
const FORMAT: u32 = 1;

/// The copy: what the mirror held at `revision`.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Saved {
    format: u32,
    prefix: String,
    revision: i64,
    cluster_id: u64,
    keys: Vec<SavedKv>,
}

/// One key of the copy. Values are the records lockstep writes (JSON
/// text); a mirror holding a value that is not UTF-8 is not copied.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SavedKv {
    key: String,
    value: String,
    mod_revision: i64,
    create_revision: i64,
    lease: i64,
}

/// What a copy gives back: the keys, the revision they are at and the
/// cluster they came from.
#[derive(Debug)]
pub struct Resume {
    /// Every key under the prefix at `revision`.
    pub kvs: Vec<Kv>,
    /// The store revision the keys are at.
    pub revision: i64,
    /// The etcd cluster they came from.
    pub cluster_id: u64,
}

/// Where the copy of an agent with state directory `state_dir` lives.
pub fn path(state_dir: &Path) -> PathBuf {
    state_dir.join(FILE)
}

/// Writes the copy of `kvs` (every key under `prefix`, at `revision`);
/// `Ok(false)` when a value is not UTF-8 (nothing written: the next start
/// reads everything).
///
/// # Errors
/// The file could not be written; the old copy is then unchanged.
pub fn save(
    state_dir: &Path,
    prefix: &str,
    revision: i64,
    cluster_id: u64,
    kvs: &[Arc<Kv>],
) -> Result<bool, HeldError> {
    let mut keys = Vec::with_capacity(kvs.len());
    for kv in kvs {
        let Ok(value) = std::str::from_utf8(&kv.value) else {
            return Ok(false);
        };
        keys.push(SavedKv {
            key: kv.key.clone(),
            value: value.to_owned(),
            mod_revision: kv.mod_revision,
            create_revision: kv.create_revision,
            lease: kv.lease,
        });
    }
    write_json(
        state_dir,
        FILE,
        &Saved {
            format: FORMAT,
            prefix: prefix.to_owned(),
            revision,
            cluster_id,
            keys,
        },
    )?;
    Ok(true)
}

/// The copy for `prefix` in `state_dir`, if there is one this build reads
/// (`Ok(None)`: none, or one of another prefix or format).
///
/// # Errors
/// The file exists but cannot be read or parsed.
pub fn load(state_dir: &Path, prefix: &str) -> Result<Option<Resume>, HeldError> {
    let path = path(state_dir);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(HeldError::Io { path, source }),
    };
    let saved: Saved = serde_json::from_slice(&bytes).map_err(|e| HeldError::Corrupt {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    if saved.format != FORMAT || saved.prefix != prefix || saved.revision <= 0 {
        return Ok(None);
    }
    if let Some(k) = saved.keys.iter().find(|k| !k.key.starts_with(prefix)) {
        return Err(HeldError::Corrupt {
            path,
            reason: format!("key {} is not under {prefix}", k.key),
        });
    }
    Ok(Some(Resume {
        kvs: saved
            .keys
            .into_iter()
            .map(|k| {
                Kv::new(
                    k.key,
                    k.value.into_bytes(),
                    k.mod_revision,
                    k.create_revision,
                    k.lease,
                )
            })
            .collect(),
        revision: saved.revision,
        cluster_id: saved.cluster_id,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(key: &str, value: &[u8], rev: i64) -> Arc<Kv> {
        Arc::new(Kv::new(key.into(), value.to_vec(), rev, rev, 0))
    }

    #[test]
    fn a_saved_copy_comes_back_whole_for_its_prefix_only() {
        let dir = tempfile::tempdir().expect("tempdir");
        let kvs = [
            kv("/p/nodes/a", b"{}", 5),
            kv("/p/blocks/x", b"{\"n\":1}", 7),
        ];
        assert!(save(dir.path(), "/p/", 9, 42, &kvs).expect("save"));
        let r = load(dir.path(), "/p/").expect("load").expect("a copy");
        assert_eq!((r.revision, r.cluster_id), (9, 42));
        assert_eq!(r.kvs, kvs.iter().map(|k| (**k).clone()).collect::<Vec<_>>());
        // Another prefix's agent reads everything.
        assert!(load(dir.path(), "/q/").expect("load").is_none());
    }

    #[test]
    fn no_copy_and_a_torn_copy_are_told_apart_and_neither_resumes() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert!(load(dir.path(), "/p/").expect("load").is_none());
        std::fs::write(path(dir.path()), b"{\"format\": 1, \"pre").expect("write");
        let e = load(dir.path(), "/p/").expect_err("torn");
        assert!(e.to_string().contains("cluster-mirror.json"), "{e}");
    }

    #[test]
    fn a_value_that_is_not_text_writes_no_copy_and_keeps_the_old() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert!(save(dir.path(), "/p/", 3, 1, &[kv("/p/a", b"{}", 3)]).expect("save"));
        assert!(!save(dir.path(), "/p/", 4, 1, &[kv("/p/a", &[0xff, 0xfe], 4)]).expect("save"));
        assert_eq!(
            load(dir.path(), "/p/")
                .expect("load")
                .expect("old")
                .revision,
            3
        );
    }
}
