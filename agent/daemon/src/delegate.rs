//! Running an external CNI IPAM plugin (delegated mode).
//!
//! Some clusters want every address to come from an IPAM plugin the platform
//! provides (host-local, a cloud's plugin). The agent then runs that plugin
//! itself, as a parent plugin such as `bridge` would: the network config it
//! passes is the conflist's network (`cniVersion`, `name`) with the `ipam`
//! object, the `CNI_*` variables name a container, an interface and a network
//! namespace, and the result comes back on stdout.
//!
//! Why this module is careful: a plugin is foreign code run with root. It can
//! hang (it is killed after a timeout, with its process group), print garbage
//! (a clear error naming the plugin and the command), or fail (its CNI error
//! `code`/`msg`/`details` are passed on). Everything the agent learns from the
//! conflist is resolved once ([`PluginConf::load`]) and hashed, so a changed
//! plugin config is noticed on restart. The plugin's own state must be the
//! node's, not a copy private to the agent's container: see
//! [`check_state_dir`].

use std::io::{Read, Write};
use std::net::IpAddr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::cni::{CniResult, CniVersion};

/// Where host-local keeps its state when `ipam.dataDir` is not set.
pub const HOST_LOCAL_DATA_DIR: &str = "/var/lib/cni/networks";

/// Errors of loading the plugin's config and running it.
#[derive(Debug, thiserror::Error)]
pub enum DelegateError {
    /// The conflist does not exist (yet).
    #[error("waiting for the CNI conflist {path} (ipam.mode = \"delegated\")")]
    ConflistMissing {
        /// The conflist.
        path: PathBuf,
    },
    /// The conflist could not be read.
    #[error("cannot read the CNI conflist {path}")]
    ConflistRead {
        /// The conflist.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The conflist is not usable.
    #[error("CNI conflist {path}: {reason}")]
    ConflistInvalid {
        /// The conflist.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// No plugin binary of that type in the plugin directories.
    #[error("IPAM plugin {plugin} not found in {dirs:?} (ipam.plugin_dirs)")]
    BinaryMissing {
        /// The plugin type.
        plugin: String,
        /// Where it was looked for.
        dirs: Vec<PathBuf>,
    },
    /// The plugin could not be started.
    #[error("cannot run IPAM plugin {binary}")]
    Spawn {
        /// The binary.
        binary: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The plugin did not finish in time and was killed.
    #[error(
        "IPAM plugin {plugin} {command} did not finish within {timeout:?} and was killed (ipam.timeout)"
    )]
    Timeout {
        /// The plugin type.
        plugin: String,
        /// The CNI command.
        command: &'static str,
        /// The limit.
        timeout: Duration,
    },
    /// The plugin reported a CNI error.
    #[error(
        "IPAM plugin {plugin} {command} failed with CNI error {code}: {msg}{}",
        details_suffix(details)
    )]
    Plugin {
        /// The plugin type.
        plugin: String,
        /// The CNI command.
        command: &'static str,
        /// The CNI error code.
        code: u64,
        /// Its message.
        msg: String,
        /// Its details.
        details: String,
    },
    /// The plugin printed something that is not a valid CNI result or error.
    #[error(
        "IPAM plugin {plugin} {command} printed an invalid {what} (exit status {status}): {output:?}"
    )]
    Garbage {
        /// The plugin type.
        plugin: String,
        /// The CNI command.
        command: &'static str,
        /// Result or error.
        what: &'static str,
        /// Exit status.
        status: i32,
        /// The start of what it printed.
        output: String,
    },
    /// The plugin's state directory does not exist or is not writable.
    #[error("the IPAM plugin's state directory {path} is not usable: {reason}")]
    StateDir {
        /// The directory.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The agent's and the node's view of the plugin's state differ.
    #[error(
        "refusing delegated IPAM: the plugin's state directory {path} the agent sees (device {agent_dev}, inode {agent_ino}) \
         is not the node's (device {node_dev}, inode {node_ino}, seen through {node_view}); two views of the plugin's \
         state lead to double allocation (mount the node's directory into the agent with a hostPath volume)"
    )]
    StateDirMismatch {
        /// The directory.
        path: PathBuf,
        /// The path through the node's root.
        node_view: PathBuf,
        /// Device in the agent's view.
        agent_dev: u64,
        /// Inode in the agent's view.
        agent_ino: u64,
        /// Device in the node's view.
        node_dev: u64,
        /// Inode in the node's view.
        node_ino: u64,
    },
    /// The agent's own namespace for plugin calls could not be made.
    #[error("cannot create the network namespace {path} for IPAM plugin calls (ipam.netns)")]
    Netns {
        /// The namespace file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The node's view could not be read.
    #[error(
        "cannot see the node's view {node_view} of the plugin's state directory (ipam.node_root; the agent needs the host PID namespace)"
    )]
    NodeView {
        /// The path through the node's root.
        node_view: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

fn details_suffix(details: &str) -> String {
    if details.is_empty() {
        String::new()
    } else {
        format!(" ({details})")
    }
}

impl DelegateError {
    /// Whether delegated mode must be refused rather than retried.
    pub fn is_fatal(&self) -> bool {
        matches!(self, DelegateError::StateDirMismatch { .. })
    }
}

/// The IPAM plugin named in the node's conflist, resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct PluginConf {
    /// The conflist it came from.
    pub conflist: PathBuf,
    /// The plugin's `type`.
    pub plugin: String,
    /// Its binary.
    pub binary: PathBuf,
    /// The network's `cniVersion`.
    pub cni_version: CniVersion,
    /// The network config passed on stdin (`cniVersion`, `name`, `ipam`).
    pub net_conf: Value,
    /// A stable hash of `net_conf` and the plugin type.
    pub hash: String,
    /// The plugin's state directory, for plugins known to keep one
    /// (host-local: `ipam.dataDir`).
    pub state_dir: Option<PathBuf>,
}

/// FNV-1a over bytes, printed in hex: stable across builds and platforms.
fn hash_hex(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

impl PluginConf {
    /// Reads the conflist (or a single-plugin `.conf`), finds the first
    /// plugin with an `ipam` object, and the IPAM plugin's binary in `dirs`.
    ///
    /// # Errors
    /// The file is missing, unreadable or unusable, or the binary is not
    /// found.
    pub fn load(conflist: &Path, dirs: &[PathBuf]) -> Result<PluginConf, DelegateError> {
        let text = match std::fs::read(conflist) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(DelegateError::ConflistMissing {
                    path: conflist.to_path_buf(),
                });
            }
            Err(source) => {
                return Err(DelegateError::ConflistRead {
                    path: conflist.to_path_buf(),
                    source,
                });
            }
        };
        let invalid = |reason: String| DelegateError::ConflistInvalid {
            path: conflist.to_path_buf(),
            reason,
        };
        let v: Value = serde_json::from_slice(&text).map_err(|e| invalid(e.to_string()))?;
        let version_text = v["cniVersion"].as_str().unwrap_or("0.3.1");
        let cni_version: CniVersion = version_text.parse().map_err(|_| {
            invalid(format!(
                "cniVersion {version_text} is not one lockstep supports"
            ))
        })?;
        let name = v["name"]
            .as_str()
            .ok_or_else(|| invalid("no network `name`".into()))?;
        let ipam = match v["plugins"].as_array() {
            Some(plugins) => plugins
                .iter()
                .find(|p| p["ipam"].is_object())
                .map(|p| p["ipam"].clone()),
            None => v["ipam"].is_object().then(|| v["ipam"].clone()),
        }
        .ok_or_else(|| invalid("no plugin has an `ipam` object".into()))?;
        let plugin = ipam["type"]
            .as_str()
            .filter(|t| !t.is_empty() && !t.contains('/'))
            .ok_or_else(|| invalid("`ipam.type` is missing or not a plain name".into()))?
            .to_string();
        let binary = dirs
            .iter()
            .map(|d| d.join(&plugin))
            .find(|p| p.is_file())
            .ok_or_else(|| DelegateError::BinaryMissing {
                plugin: plugin.clone(),
                dirs: dirs.to_vec(),
            })?;
        let state_dir = (plugin == "host-local").then(|| {
            PathBuf::from(
                ipam["dataDir"]
                    .as_str()
                    .unwrap_or(HOST_LOCAL_DATA_DIR)
                    .to_string(),
            )
        });
        let net_conf = json!({
            "cniVersion": cni_version.as_str(),
            "name": name,
            "ipam": ipam,
        });
        let hash = hash_hex(format!("{plugin}\u{1f}{net_conf}").as_bytes());
        Ok(PluginConf {
            conflist: conflist.to_path_buf(),
            plugin,
            binary,
            cni_version,
            net_conf,
            hash,
            state_dir,
        })
    }

    /// The network name.
    pub fn network(&self) -> &str {
        self.net_conf["name"].as_str().unwrap_or_default()
    }
}

/// Checks that the plugin's state directory exists, is writable, and is the
/// node's own (same device and inode through `node_root`): a directory
/// private to the agent's container would let the agent and the runtime's
/// plugin calls hand out the same address twice.
///
/// # Errors
/// [`DelegateError::StateDir`], [`DelegateError::NodeView`] or
/// [`DelegateError::StateDirMismatch`].
pub fn check_state_dir(dir: &Path, node_root: &Path) -> Result<(), DelegateError> {
    use std::os::unix::fs::MetadataExt;
    let state = |reason: String| DelegateError::StateDir {
        path: dir.to_path_buf(),
        reason,
    };
    let mine = std::fs::metadata(dir).map_err(|e| state(e.to_string()))?;
    if !mine.is_dir() {
        return Err(state("not a directory".into()));
    }
    let cpath = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())
        .map_err(|_| state("the path contains a NUL byte".into()))?;
    // SAFETY: access(2) on a valid C string.
    if unsafe { libc::access(cpath.as_ptr(), libc::W_OK) } != 0 {
        return Err(state(format!(
            "not writable: {}",
            std::io::Error::last_os_error()
        )));
    }
    let node_view = node_root.join(dir.strip_prefix("/").unwrap_or(dir));
    let node = std::fs::metadata(&node_view).map_err(|source| DelegateError::NodeView {
        node_view: node_view.clone(),
        source,
    })?;
    if (mine.dev(), mine.ino()) != (node.dev(), node.ino()) {
        return Err(DelegateError::StateDirMismatch {
            path: dir.to_path_buf(),
            node_view,
            agent_dev: mine.dev(),
            agent_ino: mine.ino(),
            node_dev: node.dev(),
            node_ino: node.ino(),
        });
    }
    Ok(())
}

/// Which attachment a plugin call is about.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target<'a> {
    /// `CNI_CONTAINERID`.
    pub container_id: &'a str,
    /// `CNI_IFNAME`.
    pub ifname: &'a str,
    /// `CNI_NETNS`.
    pub netns: &'a Path,
}

/// What an ADD returned.
#[derive(Clone, Debug, PartialEq)]
pub struct AddOutcome {
    /// The result as printed (kept as the `prevResult` of CHECK and DEL).
    pub raw: Value,
    /// The addresses in it.
    pub addresses: Vec<IpAddr>,
}

/// Runs one resolved plugin with a timeout.
#[derive(Clone, Debug)]
pub struct Runner {
    /// The plugin.
    pub conf: PluginConf,
    /// `CNI_PATH`.
    pub cni_path: Vec<PathBuf>,
    /// Per-invocation limit.
    pub timeout: Duration,
}

/// The most of a plugin's output quoted in an error.
const QUOTE: usize = 200;

impl Runner {
    /// Runs `command` with `stdin`; returns the exit code and stdout.
    fn exec(
        &self,
        command: &'static str,
        target: Option<&Target<'_>>,
        stdin: &Value,
    ) -> Result<(i32, Vec<u8>), DelegateError> {
        let cni_path = std::env::join_paths(&self.cni_path)
            .unwrap_or_default()
            .into_string()
            .unwrap_or_default();
        let mut cmd = Command::new(&self.conf.binary);
        cmd.env_clear()
            .env(
                "PATH",
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            )
            .env("CNI_COMMAND", command)
            .env("CNI_PATH", cni_path)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Its own process group: a timeout kills helpers it forked too.
            .process_group(0);
        if let Some(t) = target {
            cmd.env("CNI_CONTAINERID", t.container_id)
                .env("CNI_IFNAME", t.ifname)
                .env("CNI_NETNS", t.netns);
        }
        let mut child = cmd.spawn().map_err(|source| DelegateError::Spawn {
            binary: self.conf.binary.clone(),
            source,
        })?;
        let input = stdin.to_string().into_bytes();
        let mut pipe_in = child.stdin.take();
        let writer = std::thread::spawn(move || {
            if let Some(p) = pipe_in.as_mut() {
                let _ = p.write_all(&input);
            }
        });
        let mut pipe_out = child.stdout.take();
        let reader = std::thread::spawn(move || {
            let mut out = Vec::new();
            if let Some(p) = pipe_out.as_mut() {
                let _ = p.take(4 << 20).read_to_end(&mut out);
            }
            out
        });
        let mut pipe_err = child.stderr.take();
        let err_reader = std::thread::spawn(move || {
            let mut out = Vec::new();
            if let Some(p) = pipe_err.as_mut() {
                let _ = p.take(64 << 10).read_to_end(&mut out);
            }
            out
        });
        let started = Instant::now();
        let status = loop {
            match child.try_wait() {
                Ok(Some(s)) => break s,
                Ok(None) if started.elapsed() >= self.timeout => {
                    // SAFETY: kill(2) on the child's process group.
                    unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
                    let _ = child.kill();
                    let _ = child.wait();
                    let _ = writer.join();
                    tracing::error!(plugin = %self.conf.plugin, command, timeout = ?self.timeout, "IPAM plugin hung; killed");
                    return Err(DelegateError::Timeout {
                        plugin: self.conf.plugin.clone(),
                        command,
                        timeout: self.timeout,
                    });
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(5)),
                Err(source) => {
                    return Err(DelegateError::Spawn {
                        binary: self.conf.binary.clone(),
                        source,
                    });
                }
            }
        };
        let _ = writer.join();
        let out = reader.join().unwrap_or_default();
        let err = err_reader.join().unwrap_or_default();
        if !err.is_empty() {
            tracing::debug!(plugin = %self.conf.plugin, command, stderr = %String::from_utf8_lossy(&err), "IPAM plugin stderr");
        }
        Ok((status.code().unwrap_or(-1), out))
    }

    fn garbage(
        &self,
        command: &'static str,
        what: &'static str,
        code: i32,
        out: &[u8],
    ) -> DelegateError {
        let text = String::from_utf8_lossy(out);
        DelegateError::Garbage {
            plugin: self.conf.plugin.clone(),
            command,
            what,
            status: code,
            output: text.chars().take(QUOTE).collect(),
        }
    }

    /// Turns a non-zero exit into the plugin's CNI error, or a garbage error.
    fn failure(&self, command: &'static str, code: i32, out: &[u8]) -> DelegateError {
        match serde_json::from_slice::<Value>(out) {
            Ok(v) if v["code"].is_u64() => DelegateError::Plugin {
                plugin: self.conf.plugin.clone(),
                command,
                code: v["code"].as_u64().unwrap_or_default(),
                msg: v["msg"].as_str().unwrap_or_default().to_string(),
                details: v["details"].as_str().unwrap_or_default().to_string(),
            },
            _ => self.garbage(command, "error", code, out),
        }
    }

    fn conf_with(&self, extra: &[(&str, Value)]) -> Value {
        let mut v = self.conf.net_conf.clone();
        if let Some(obj) = v.as_object_mut() {
            for (k, x) in extra {
                obj.insert((*k).to_string(), x.clone());
            }
        }
        v
    }

    /// CNI ADD.
    ///
    /// # Errors
    /// The plugin failed, hung or printed no valid result.
    pub fn add(&self, target: &Target<'_>) -> Result<AddOutcome, DelegateError> {
        let (code, out) = self.exec("ADD", Some(target), &self.conf.net_conf)?;
        if code != 0 {
            return Err(self.failure("ADD", code, &out));
        }
        let raw: Value =
            serde_json::from_slice(&out).map_err(|_| self.garbage("ADD", "result", code, &out))?;
        let result = CniResult::from_json(&raw, "result", self.conf.cni_version)
            .map_err(|_| self.garbage("ADD", "result", code, &out))?;
        let addresses: Vec<IpAddr> = result.ips.iter().map(|ip| ip.address.addr()).collect();
        if addresses.is_empty() {
            return Err(self.garbage("ADD", "result (no address)", code, &out));
        }
        Ok(AddOutcome { raw, addresses })
    }

    /// CNI DEL, with the ADD result as `prevResult` where the version has
    /// one. "Already gone" is the plugin's success.
    ///
    /// # Errors
    /// The plugin failed or hung.
    pub fn del(&self, target: &Target<'_>, prev: Option<&Value>) -> Result<(), DelegateError> {
        let stdin = match prev {
            Some(p) if self.conf.cni_version.has_prev_result_on_del() => {
                self.conf_with(&[("prevResult", p.clone())])
            }
            _ => self.conf.net_conf.clone(),
        };
        let (code, out) = self.exec("DEL", Some(target), &stdin)?;
        if code != 0 {
            return Err(self.failure("DEL", code, &out));
        }
        Ok(())
    }

    /// Whether the plugin's version has CHECK (0.4.0 and later).
    pub fn has_check(&self) -> bool {
        self.conf.cni_version >= CniVersion::V0_4_0
    }

    /// CNI CHECK with the ADD result as `prevResult`.
    ///
    /// # Errors
    /// The plugin says the attachment is not as ADD made it, or failed.
    pub fn check(&self, target: &Target<'_>, prev: &Value) -> Result<(), DelegateError> {
        let stdin = self.conf_with(&[("prevResult", prev.clone())]);
        let (code, out) = self.exec("CHECK", Some(target), &stdin)?;
        if code != 0 {
            return Err(self.failure("CHECK", code, &out));
        }
        Ok(())
    }

    /// CNI VERSION: the versions the plugin supports.
    ///
    /// # Errors
    /// The plugin failed, hung or printed garbage.
    pub fn versions(&self) -> Result<Vec<String>, DelegateError> {
        let (code, out) = self.exec(
            "VERSION",
            None,
            &json!({"cniVersion": self.conf.cni_version.as_str()}),
        )?;
        if code != 0 {
            return Err(self.failure("VERSION", code, &out));
        }
        let v: Value = serde_json::from_slice(&out)
            .map_err(|_| self.garbage("VERSION", "version info", code, &out))?;
        Ok(v["supportedVersions"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s.as_str().map(str::to_string))
            .collect())
    }

    /// CNI GC (spec 1.1.0) with `cni.dev/valid-attachments`.
    ///
    /// # Errors
    /// The plugin failed or hung.
    pub fn gc(&self, valid: &[(String, String)]) -> Result<(), DelegateError> {
        let attachments: Vec<Value> = valid
            .iter()
            .map(|(c, i)| json!({"containerID": c, "ifname": i}))
            .collect();
        let stdin = self.conf_with(&[
            ("cniVersion", json!("1.1.0")),
            (crate::cni::VALID_ATTACHMENTS_KEY, json!(attachments)),
        ]);
        let (code, out) = self.exec("GC", None, &stdin)?;
        if code != 0 {
            return Err(self.failure("GC", code, &out));
        }
        Ok(())
    }
}

/// Makes sure `path` is a network namespace the agent owns: an existing
/// namespace bind mount is reused (across restarts), otherwise a new
/// namespace is created and bind-mounted there.
///
/// # Errors
/// The namespace could not be created or mounted.
pub fn ensure_netns(path: &Path) -> Result<(), DelegateError> {
    make_netns(path).map_err(|source| DelegateError::Netns {
        path: path.to_path_buf(),
        source,
    })
}

fn make_netns(path: &Path) -> Result<(), std::io::Error> {
    const NSFS_MAGIC: i64 = 0x6e73_6673;
    if let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) {
        // SAFETY: statfs(2) into a zeroed struct.
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: valid C string and out-pointer.
        if unsafe { libc::statfs(c.as_ptr(), &mut st) } == 0 && st.f_type as i64 == NSFS_MAGIC {
            return Ok(());
        }
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)?;
    let target = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // A thread of its own enters the new namespace; it ends right after, the
    // bind mount keeps the namespace alive.
    std::thread::spawn(move || -> Result<(), std::io::Error> {
        // SAFETY: unshare(2) affects only this thread.
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let src = c"/proc/thread-self/ns/net";
        // SAFETY: mount(2) with valid C strings and null fs type/data.
        let rc = unsafe {
            libc::mount(
                src.as_ptr(),
                target.as_ptr(),
                std::ptr::null(),
                libc::MS_BIND,
                std::ptr::null(),
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    })
    .join()
    .map_err(|_| std::io::Error::other("the namespace thread panicked"))?
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        std::fs::create_dir_all(dir).expect("dir");
        let p = dir.join(name);
        std::fs::write(&p, text).expect("write");
        p
    }

    fn temp(tag: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("lockstep-delegate-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn the_ipam_object_and_binary_are_found() {
        let d = temp("load");
        write(&d.join("bin"), "host-local", "");
        let conflist = write(
            &d,
            "10.conflist",
            r#"{"cniVersion":"1.0.0","name":"net","plugins":[
                {"type":"bridge","ipam":{"type":"host-local","dataDir":"/x","ranges":[[{"subnet":"10.1.0.0/24"}]]}},
                {"type":"portmap"}]}"#,
        );
        let c = PluginConf::load(&conflist, &[d.join("none"), d.join("bin")]).expect("load");
        assert_eq!(c.plugin, "host-local");
        assert_eq!(c.binary, d.join("bin/host-local"));
        assert_eq!(c.state_dir, Some(PathBuf::from("/x")));
        assert_eq!(c.net_conf["name"], "net");
        assert_eq!(c.net_conf["cniVersion"], "1.0.0");
        assert_eq!(c.net_conf["ipam"]["type"], "host-local");
        assert!(c.net_conf.get("plugins").is_none());
        let again = PluginConf::load(&conflist, &[d.join("bin")]).expect("load");
        assert_eq!(c.hash, again.hash, "the hash is stable");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn load_errors_say_what_is_wrong() {
        let d = temp("errors");
        let missing = PluginConf::load(&d.join("nope.conflist"), &[]).expect_err("missing");
        assert!(matches!(missing, DelegateError::ConflistMissing { .. }));
        assert!(missing.to_string().contains("nope.conflist"), "{missing}");
        let p = write(
            &d,
            "a.conflist",
            r#"{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"x"}]}"#,
        );
        let e = PluginConf::load(&p, &[]).expect_err("no ipam").to_string();
        assert!(e.contains("ipam"), "{e}");
        let p = write(
            &d,
            "b.conflist",
            r#"{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"x","ipam":{"type":"nowhere"}}]}"#,
        );
        let e = PluginConf::load(&p, std::slice::from_ref(&d))
            .expect_err("no binary")
            .to_string();
        assert!(e.contains("nowhere") && e.contains("plugin_dirs"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }
}
