//! The DaemonSet pattern: on start the agent installs its CNI plugin binary
//! (as `lockstep` and `lockstep-ipam`) and its conflist into the node's
//! directories, and records what it wrote. Removal takes away only files whose
//! content is still exactly what the agent wrote: a conflist an operator
//! edited, or a binary another version replaced, stays.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::CniConfig;

/// The record of what was installed, kept in the state directory.
pub const MANIFEST: &str = "cni-installed.json";

/// Errors of installing.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    /// A file operation failed.
    #[error("cannot {action} {path}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The path.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The manifest does not decode.
    #[error("install manifest {path} is corrupt")]
    Manifest {
        /// The manifest.
        path: PathBuf,
        /// The decode error.
        #[source]
        source: serde_json::Error,
    },
}

fn io(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> InstallError {
    let path = path.to_path_buf();
    move |source| InstallError::Io {
        action,
        path,
        source,
    }
}

/// One file the agent wrote.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Installed {
    /// Where.
    pub path: PathBuf,
    /// Its length.
    pub len: u64,
    /// FNV-1a 64 of its content (stable across builds, unlike std's hasher).
    pub fnv64: u64,
}

fn fnv64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn describe(path: &Path, content: &[u8]) -> Installed {
    Installed {
        path: path.to_path_buf(),
        len: content.len() as u64,
        fnv64: fnv64(content),
    }
}

/// Writes `content` to `path` atomically (temp file + rename), with `mode`;
/// a file that already holds exactly `content` is left alone (a restart
/// should not rewrite a large binary, nor disturb a runtime reading it).
fn write_atomic(path: &Path, content: &[u8], mode: u32) -> Result<(), InstallError> {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::metadata(path)
        && meta.len() == content.len() as u64
        && meta.permissions().mode() & 0o777 == mode
        && std::fs::read(path).is_ok_and(|existing| existing == content)
    {
        return Ok(());
    }
    let dir = path.parent().unwrap_or(Path::new("/"));
    std::fs::create_dir_all(dir).map_err(io("create", dir))?;
    let tmp = dir.join(format!(
        ".{}.lockstep-tmp",
        path.file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default()
    ));
    std::fs::write(&tmp, content).map_err(io("write", &tmp))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))
        .map_err(io("chmod", &tmp))?;
    std::fs::rename(&tmp, path).map_err(io("rename into", path))
}

/// The conflist the agent writes.
pub fn conflist(cni: &CniConfig, socket: &Path) -> String {
    let doc = serde_json::json!({
        "cniVersion": cni.cni_version,
        "name": cni.network_name,
        "plugins": [{
            "type": "lockstep",
            "agentSocket": socket.display().to_string(),
        }],
    });
    serde_json::to_string_pretty(&doc).unwrap_or_default() + "\n"
}

/// Installs the plugin binaries and the conflist; returns what was written.
///
/// # Errors
/// A file could not be read or written.
pub fn install(
    cni: &CniConfig,
    socket: &Path,
    state_dir: &Path,
) -> Result<Vec<Installed>, InstallError> {
    let agent = std::env::current_exe().map_err(io("find", Path::new("/proc/self/exe")))?;
    // The small plugin binary beside the agent; the agent binary itself
    // speaks CNI too, for installs that ship only one file.
    let exe = agent
        .parent()
        .map(|d| d.join("lockstep-cni"))
        .filter(|p| p.exists())
        .unwrap_or(agent);
    let binary = std::fs::read(&exe).map_err(io("read", &exe))?;
    let mut written = Vec::new();
    for name in ["lockstep", "lockstep-ipam"] {
        let path = cni.bin_dir.join(name);
        write_atomic(&path, &binary, 0o755)?;
        written.push(describe(&path, &binary));
    }
    let text = conflist(cni, socket);
    let path = cni.conf_dir.join(&cni.conflist_name);
    write_atomic(&path, text.as_bytes(), 0o644)?;
    written.push(describe(&path, text.as_bytes()));
    let manifest = state_dir.join(MANIFEST);
    let json = serde_json::to_vec_pretty(&written).unwrap_or_default();
    write_atomic(&manifest, &json, 0o600)?;
    tracing::info!(
        files = written.len(),
        "installed the CNI plugin and conflist"
    );
    Ok(written)
}

/// Removes what [`install`] wrote, file by file, only where the content is
/// unchanged. Returns (removed, left because changed).
///
/// # Errors
/// The manifest is corrupt, or a file could not be removed.
pub fn uninstall(state_dir: &Path) -> Result<(Vec<PathBuf>, Vec<PathBuf>), InstallError> {
    let manifest = state_dir.join(MANIFEST);
    let text = match std::fs::read(&manifest) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), Vec::new())),
        Err(e) => return Err(io("read", &manifest)(e)),
    };
    let written: Vec<Installed> =
        serde_json::from_slice(&text).map_err(|source| InstallError::Manifest {
            path: manifest.clone(),
            source,
        })?;
    let (mut removed, mut kept) = (Vec::new(), Vec::new());
    for f in written {
        match std::fs::read(&f.path) {
            Ok(content) if describe(&f.path, &content) == f => {
                std::fs::remove_file(&f.path).map_err(io("remove", &f.path))?;
                removed.push(f.path);
            }
            Ok(_) => {
                tracing::warn!(path = %f.path.display(), "changed since lockstep wrote it; left in place");
                kept.push(f.path);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io("read", &f.path)(e)),
        }
    }
    std::fs::remove_file(&manifest).map_err(io("remove", &manifest))?;
    Ok((removed, kept))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cni(dir: &Path) -> CniConfig {
        CniConfig {
            install: true,
            bin_dir: dir.join("bin"),
            conf_dir: dir.join("net.d"),
            ..CniConfig::default()
        }
    }

    #[test]
    fn install_then_uninstall_removes_only_unchanged_files() {
        let dir = std::env::temp_dir().join(format!("lockstep-install-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cfg = cni(&dir);
        let written = install(&cfg, Path::new("/run/x.sock"), &dir).expect("install");
        assert_eq!(written.len(), 3);
        let conf = cfg.conf_dir.join(&cfg.conflist_name);
        let text = std::fs::read_to_string(&conf).expect("conflist");
        assert!(text.contains("\"agentSocket\": \"/run/x.sock\""), "{text}");
        // An operator edits the conflist; someone else's file sits beside ours.
        std::fs::write(&conf, text.replace("lockstep", "lockstep ")).expect("edit");
        std::fs::write(cfg.bin_dir.join("host-local"), b"theirs").expect("theirs");
        let (removed, kept) = uninstall(&dir).expect("uninstall");
        assert_eq!(removed.len(), 2, "both binaries: {removed:?}");
        assert_eq!(kept, vec![conf.clone()]);
        assert!(conf.exists());
        assert!(cfg.bin_dir.join("host-local").exists());
        assert!(!cfg.bin_dir.join("lockstep").exists());
        // Nothing recorded any more: a second uninstall does nothing.
        assert_eq!(uninstall(&dir).expect("again"), (vec![], vec![]));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
