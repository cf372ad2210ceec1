//! The DaemonSet pattern: on start the agent installs its CNI plugin binary
//! (as `lockstep` and `lockstep-ipam`) and its conflist into the node's
//! directories, and records what it wrote. Removal takes away only files whose
//! content is still exactly what the agent wrote: a conflist an operator
//! edited, or a binary another version replaced, stays.
//!
//! These directories are shared with the runtime and other plugins, so the
//! agent trusts nothing it finds there: a new file is written under a fresh,
//! unpredictable name created exclusively (a symlink planted at a temporary
//! name is never followed), then renamed into place; and removal touches only
//! the names the agent installs, in the directories its configuration names
//! now, and never through a symlink — whatever the manifest says.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::{ChainedPlugin, CniConfig};

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
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let dir = path.parent().unwrap_or(Path::new("/"));
    std::fs::create_dir_all(dir).map_err(io("create", dir))?;
    let nonce =
        getrandom::u64().map_err(|e| io("draw a name for", dir)(std::io::Error::other(e)))?;
    let tmp = dir.join(format!(
        ".{}.lockstep-{nonce:016x}",
        path.file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default()
    ));
    // O_CREAT|O_EXCL never follows a symlink: a name planted in between
    // fails the write instead of redirecting it.
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)
        .and_then(|mut file| {
            file.write_all(content)?;
            file.set_permissions(std::fs::Permissions::from_mode(mode))?;
            file.sync_all()
        });
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(io("write", &tmp)(e));
    }
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io("rename into", path)(e)
    })
}

/// The files [`install`] writes for `cni`: the only paths [`uninstall`] may
/// remove.
fn owned_paths(cni: &CniConfig) -> [PathBuf; 3] {
    [
        cni.bin_dir.join("lockstep"),
        cni.bin_dir.join("lockstep-ipam"),
        cni.conf_dir.join(&cni.conflist_name),
    ]
}

/// The conflist the agent writes: lockstep's plugin first (it makes the
/// interfaces and the result), then `chain` in order. The runtime hands each
/// chained plugin the result so far as `prevResult` and the capability
/// arguments it declares (`portMappings`, `bandwidth`) as `runtimeConfig`;
/// DEL runs the list in reverse, so their rules and qdiscs go before
/// lockstep's veth does.
pub fn conflist(cni: &CniConfig, socket: &Path, chain: &[ChainedPlugin]) -> String {
    let mut plugins = vec![serde_json::json!({
        "type": "lockstep",
        "agentSocket": socket.display().to_string(),
    })];
    plugins.extend(chain.iter().map(|plugin| match plugin {
        ChainedPlugin::Portmap => serde_json::json!({
            "type": plugin.binary(),
            "capabilities": {"portMappings": true},
            "snat": true,
        }),
        ChainedPlugin::Bandwidth => serde_json::json!({
            "type": plugin.binary(),
            "capabilities": {"bandwidth": true},
        }),
    }));
    let doc = serde_json::json!({
        "cniVersion": cni.cni_version,
        "name": cni.network_name,
        "plugins": plugins,
    });
    serde_json::to_string_pretty(&doc).unwrap_or_default() + "\n"
}

/// `cni.chain` split into the plugins whose executable is in `bin_dir` and
/// those that are not. The runtime fails every ADD of a conflist naming a
/// plugin it cannot find, so a missing one is left out (and the agent warns)
/// rather than taking every pod's network down with it.
pub fn available_chain(cni: &CniConfig) -> (Vec<ChainedPlugin>, Vec<ChainedPlugin>) {
    use std::os::unix::fs::PermissionsExt as _;
    cni.chain.iter().partition(|plugin| {
        std::fs::metadata(cni.bin_dir.join(plugin.binary()))
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    })
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
    let (chain, missing) = available_chain(cni);
    for plugin in &missing {
        tracing::warn!(
            plugin = plugin.binary(),
            bin_dir = %cni.bin_dir.display(),
            "cni.chain names a plugin that is not in the CNI bin directory; left out of the \
             conflist (install the reference plugins, e.g. containernetworking-plugins, and \
             restart the agent, or remove it from cni.chain)"
        );
    }
    let text = conflist(cni, socket, &chain);
    let [full, ipam, conf] = owned_paths(cni);
    let mut written = Vec::new();
    for (path, content, mode) in [
        (full, binary.as_slice(), 0o755),
        (ipam, binary.as_slice(), 0o755),
        (conf, text.as_bytes(), 0o644),
    ] {
        write_atomic(&path, content, mode)?;
        written.push(describe(&path, content));
    }
    let manifest = state_dir.join(MANIFEST);
    let json = serde_json::to_vec_pretty(&written).unwrap_or_default();
    write_atomic(&manifest, &json, 0o600)?;
    tracing::info!(
        files = written.len(),
        chain = ?chain.iter().map(|p| p.binary()).collect::<Vec<_>>(),
        "installed the CNI plugin and conflist"
    );
    Ok(written)
}

/// Removes what [`install`] wrote, file by file, only where the content is
/// unchanged, and only the names `install` writes for `cni` (a manifest that
/// lists anything else — edited, or from another configuration — removes
/// nothing else; a symlink is never read through nor removed). Returns
/// (removed, left in place).
///
/// # Errors
/// The manifest is corrupt, or a file could not be removed.
pub fn uninstall(
    cni: &CniConfig,
    state_dir: &Path,
) -> Result<(Vec<PathBuf>, Vec<PathBuf>), InstallError> {
    let owned = owned_paths(cni);
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
        if !owned.contains(&f.path) {
            tracing::warn!(path = %f.path.display(), "the install manifest lists a file this agent does not install; left in place");
            kept.push(f.path);
            continue;
        }
        if std::fs::symlink_metadata(&f.path).is_ok_and(|m| !m.file_type().is_file()) {
            tracing::warn!(path = %f.path.display(), "not a regular file any more; left in place");
            kept.push(f.path);
            continue;
        }
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
        let (removed, kept) = uninstall(&cfg, &dir).expect("uninstall");
        assert_eq!(removed.len(), 2, "both binaries: {removed:?}");
        assert_eq!(kept, vec![conf.clone()]);
        assert!(conf.exists());
        assert!(cfg.bin_dir.join("host-local").exists());
        assert!(!cfg.bin_dir.join("lockstep").exists());
        // Nothing recorded any more: a second uninstall does nothing.
        assert_eq!(uninstall(&cfg, &dir).expect("again"), (vec![], vec![]));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_conflist_chains_only_the_plugins_present_in_bin_dir() {
        use std::os::unix::fs::PermissionsExt as _;
        let tmp = tempfile::tempdir().expect("tempdir");
        let cfg = cni(tmp.path());
        std::fs::create_dir_all(&cfg.bin_dir).expect("mkdir");
        let plugins = |cfg: &CniConfig| -> Vec<serde_json::Value> {
            install(cfg, Path::new("/run/x.sock"), tmp.path()).expect("install");
            let text =
                std::fs::read_to_string(cfg.conf_dir.join(&cfg.conflist_name)).expect("read");
            let doc: serde_json::Value = serde_json::from_str(&text).expect("json");
            doc["plugins"].as_array().expect("plugins").clone()
        };
        // Neither binary there: lockstep's plugin alone.
        let got = plugins(&cfg);
        assert_eq!(got.len(), 1, "{got:?}");
        // portmap present but not executable, bandwidth present.
        let portmap = cfg.bin_dir.join("portmap");
        std::fs::write(&portmap, b"#!/bin/sh\n").expect("write");
        std::fs::set_permissions(&portmap, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        std::fs::write(cfg.bin_dir.join("bandwidth"), b"#!/bin/sh\n").expect("write");
        std::fs::set_permissions(
            cfg.bin_dir.join("bandwidth"),
            std::fs::Permissions::from_mode(0o755),
        )
        .expect("chmod");
        let got = plugins(&cfg);
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(got[1]["type"], "bandwidth");
        assert_eq!(got[1]["capabilities"]["bandwidth"], true);
        // Both: lockstep, portmap (portMappings, snat), bandwidth.
        std::fs::set_permissions(&portmap, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let got = plugins(&cfg);
        let types: Vec<_> = got.iter().map(|p| p["type"].as_str()).collect();
        assert_eq!(
            types,
            [Some("lockstep"), Some("portmap"), Some("bandwidth")]
        );
        assert_eq!(got[1]["capabilities"]["portMappings"], true);
        assert_eq!(got[1]["snat"], true);
        // An empty chain: lockstep's plugin alone, whatever is installed.
        let alone = CniConfig {
            chain: Vec::new(),
            ..cfg.clone()
        };
        assert_eq!(plugins(&alone).len(), 1);
    }

    #[test]
    fn uninstall_removes_only_its_own_names_and_never_through_a_symlink() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path();
        let cfg = cni(dir);
        install(&cfg, Path::new("/run/x.sock"), dir).expect("install");
        // An unrelated file with the same content as an installed one, listed
        // in a tampered manifest, and a binary replaced by a symlink to it.
        let victim = dir.join("victim");
        std::fs::copy(cfg.bin_dir.join("lockstep"), &victim).expect("copy");
        let manifest = dir.join(MANIFEST);
        let mut listed: Vec<Installed> =
            serde_json::from_slice(&std::fs::read(&manifest).expect("read")).expect("json");
        let mut forged = listed[0].clone();
        forged.path = victim.clone();
        listed.push(forged);
        std::fs::write(&manifest, serde_json::to_vec(&listed).expect("json")).expect("write");
        std::fs::remove_file(cfg.bin_dir.join("lockstep-ipam")).expect("rm");
        std::os::unix::fs::symlink(&victim, cfg.bin_dir.join("lockstep-ipam")).expect("symlink");
        let (removed, kept) = uninstall(&cfg, dir).expect("uninstall");
        assert!(victim.exists(), "a file outside the agent's names stays");
        assert!(kept.contains(&victim) && kept.contains(&cfg.bin_dir.join("lockstep-ipam")));
        assert!(
            cfg.bin_dir.join("lockstep-ipam").exists(),
            "the symlink is left"
        );
        assert_eq!(removed.len(), 2, "{removed:?}");
    }

    #[test]
    fn a_symlink_planted_at_a_temporary_name_is_not_followed() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path();
        let cfg = cni(dir);
        std::fs::create_dir_all(&cfg.bin_dir).expect("mkdir");
        let victim = dir.join("victim");
        std::fs::write(&victim, b"precious").expect("write");
        // The name older versions used, and a glob of the new ones.
        std::os::unix::fs::symlink(&victim, cfg.bin_dir.join(".lockstep.lockstep-tmp"))
            .expect("symlink");
        install(&cfg, Path::new("/run/x.sock"), dir).expect("install");
        assert_eq!(std::fs::read(&victim).expect("read"), b"precious");
        let leftovers: Vec<_> = std::fs::read_dir(&cfg.bin_dir)
            .expect("ls")
            .filter_map(Result::ok)
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(".lockstep") && n != ".lockstep.lockstep-tmp")
            .collect();
        assert!(
            leftovers.is_empty(),
            "no temporary file left: {leftovers:?}"
        );
    }
}
