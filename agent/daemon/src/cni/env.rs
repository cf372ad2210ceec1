//! The `CNI_*` environment variables, validated per command.
//!
//! The environment is taken as an iterator of pairs (pass
//! `std::env::vars_os()` in the binary, a literal array in tests) so that this
//! layer stays pure. Which variables are required follows the spec's per-command
//! lists: ADD and CHECK need a container ID, netns and ifname; DEL needs no
//! netns (the namespace may already be gone and DEL must still release the
//! address); GC needs only `CNI_PATH`; STATUS and VERSION need nothing but the
//! command. Empty values count as missing, as in the reference implementation.

use std::ffi::OsStr;
use std::path::PathBuf;

use super::error::CniError;
use super::version::Command;

// The container ID and interface name rules are the core's, shared with
// every other door that takes an owner (the API, the CLI).
pub use lockstep_core::owner::{ContainerId, IfName, MAX_IFNAME_LEN};

/// `CNI_ARGS`: `K=V` pairs separated by `;`, in order.
///
/// Unknown keys are kept, not refused: kubelet passes `K8S_POD_NAMESPACE`,
/// `K8S_POD_NAME` and others to every plugin whether it uses them or not.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CniArgs(Vec<(String, String)>);

impl CniArgs {
    /// Parses the variable's value. An empty string means no arguments.
    ///
    /// # Errors
    /// [`CniError::InvalidEnv`] if a pair is not `K=V` with a non-empty key
    /// and exactly one `=`, or a key repeats.
    pub fn parse(value: &str) -> Result<CniArgs, CniError> {
        let invalid = |reason: String| CniError::InvalidEnv {
            name: "CNI_ARGS",
            value: value.to_owned(),
            reason,
        };
        let mut pairs: Vec<(String, String)> = Vec::new();
        if value.is_empty() {
            return Ok(CniArgs(pairs));
        }
        for (i, pair) in value.split(';').enumerate() {
            let n = i + 1;
            let Some((key, val)) = pair.split_once('=') else {
                return Err(invalid(format!("pair {n} ({pair:?}) is not KEY=VALUE")));
            };
            if val.contains('=') {
                return Err(invalid(format!(
                    "pair {n} ({pair:?}) has more than one '='"
                )));
            }
            if key.is_empty() || key.chars().any(|c| c.is_whitespace() || c.is_control()) {
                return Err(invalid(format!(
                    "pair {n} ({pair:?}) has an empty key or whitespace in its key"
                )));
            }
            if pairs.iter().any(|(k, _)| k == key) {
                return Err(invalid(format!("key {key:?} appears more than once")));
            }
            pairs.push((key.to_owned(), val.to_owned()));
        }
        Ok(CniArgs(pairs))
    }

    /// The value of `key`, if given.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// The Kubernetes pod kubelet named (`K8S_POD_NAMESPACE`,
    /// `K8S_POD_NAME`, `K8S_POD_UID` when given); `None` unless both the
    /// namespace and the name are there and not empty.
    pub fn pod(&self) -> Option<lockstep_core::pods::PodRef> {
        let given = |k| self.get(k).filter(|v| !v.is_empty());
        Some(lockstep_core::pods::PodRef {
            namespace: given("K8S_POD_NAMESPACE")?.to_owned(),
            name: given("K8S_POD_NAME")?.to_owned(),
            uid: given("K8S_POD_UID").map(str::to_owned),
        })
    }

    /// All pairs, in the order given.
    pub fn pairs(&self) -> &[(String, String)] {
        &self.0
    }

    /// Whether there are no arguments.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// The validated `CNI_*` variables for one invocation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Environment {
    /// `CNI_COMMAND`.
    pub command: Command,
    /// `CNI_CONTAINERID`: present for ADD, DEL and CHECK.
    pub container_id: Option<ContainerId>,
    /// `CNI_NETNS`: present for ADD and CHECK, optional for DEL; an absolute
    /// path.
    pub netns: Option<PathBuf>,
    /// `CNI_IFNAME`: present for ADD, DEL and CHECK.
    pub ifname: Option<IfName>,
    /// `CNI_ARGS`.
    pub args: CniArgs,
    /// `CNI_PATH`, split on `:`, empty entries dropped; required for GC.
    pub cni_path: Vec<PathBuf>,
}

/// Which variables a command requires, in the spec's order.
fn required(command: Command) -> &'static [&'static str] {
    match command {
        Command::Add | Command::Check => &["CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME"],
        Command::Del => &["CNI_CONTAINERID", "CNI_IFNAME"],
        Command::Gc => &["CNI_PATH"],
        Command::Status | Command::Version => &[],
    }
}

/// The variables the attachment commands read.
const ATTACHMENT_VARS: [&str; 4] = ["CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_ARGS"];

impl Environment {
    /// Reads and validates the `CNI_*` variables from `vars`; other variables
    /// are ignored, and a later pair overrides an earlier one.
    ///
    /// Variables a command does not use are not validated (a runtime may leave
    /// a stale `CNI_IFNAME` around for STATUS; it is none of STATUS's
    /// business).
    ///
    /// # Errors
    /// [`CniError::MissingCommand`], [`CniError::MissingEnv`] (listing every
    /// missing variable at once) or [`CniError::InvalidEnv`] naming the
    /// variable; all map to code 4.
    pub fn from_vars<I, K, V>(vars: I) -> Result<Environment, CniError>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<OsStr>,
        V: AsRef<OsStr>,
    {
        let names = [
            "CNI_COMMAND",
            "CNI_CONTAINERID",
            "CNI_NETNS",
            "CNI_IFNAME",
            "CNI_ARGS",
            "CNI_PATH",
        ];
        let mut values: [Option<Result<String, String>>; 6] = Default::default();
        for (key, value) in vars {
            if let Some(slot) = names.iter().position(|n| OsStr::new(n) == key.as_ref()) {
                let value = value.as_ref();
                values[slot] = Some(
                    value
                        .to_str()
                        .map(str::to_owned)
                        .ok_or_else(|| value.to_string_lossy().into_owned()),
                );
            }
        }
        // Returns the variable's value: None if unset or empty.
        let take = |slot: usize| -> Result<Option<String>, CniError> {
            match &values[slot] {
                None => Ok(None),
                Some(Ok(v)) if v.is_empty() => Ok(None),
                Some(Ok(v)) => Ok(Some(v.clone())),
                Some(Err(lossy)) => Err(CniError::InvalidEnv {
                    name: names[slot],
                    value: lossy.clone(),
                    reason: "not valid UTF-8".to_owned(),
                }),
            }
        };

        let command_text = take(0)?.ok_or(CniError::MissingCommand)?;
        let command = Command::parse(&command_text).ok_or_else(|| CniError::InvalidEnv {
            name: "CNI_COMMAND",
            value: command_text.clone(),
            reason: "expected one of ADD, DEL, CHECK, GC, STATUS, VERSION".to_owned(),
        })?;

        let uses = |name: &str| -> bool {
            match command {
                Command::Add | Command::Del | Command::Check => {
                    ATTACHMENT_VARS.contains(&name) || name == "CNI_PATH"
                }
                Command::Gc | Command::Status => name == "CNI_PATH",
                Command::Version => false,
            }
        };
        let mut present: [Option<String>; 6] = Default::default();
        let mut missing = Vec::new();
        for (slot, name) in names.iter().enumerate().skip(1) {
            if !uses(name) {
                continue;
            }
            present[slot] = take(slot)?;
            if present[slot].is_none() && required(command).contains(name) {
                missing.push(*name);
            }
        }
        if !missing.is_empty() {
            return Err(CniError::MissingEnv {
                command,
                names: missing,
            });
        }
        let [_, container_id, netns, ifname, args, path] = present;

        let container_id = container_id
            .map(|id| {
                ContainerId::new(&id).map_err(|reason| CniError::InvalidEnv {
                    name: "CNI_CONTAINERID",
                    value: id.clone(),
                    reason: reason.to_owned(),
                })
            })
            .transpose()?;
        let netns = netns
            .map(|ns| {
                if ns.starts_with('/') {
                    Ok(PathBuf::from(ns))
                } else {
                    Err(CniError::InvalidEnv {
                        name: "CNI_NETNS",
                        value: ns,
                        reason: "must be an absolute path to a network namespace".to_owned(),
                    })
                }
            })
            .transpose()?;
        let ifname = ifname
            .map(|name| {
                IfName::new(&name).map_err(|reason| CniError::InvalidEnv {
                    name: "CNI_IFNAME",
                    value: name.clone(),
                    reason: reason.to_owned(),
                })
            })
            .transpose()?;
        let args = match args {
            Some(a) => CniArgs::parse(&a)?,
            None => CniArgs::default(),
        };
        let cni_path = path
            .map(|p| {
                p.split(':')
                    .filter(|s| !s.is_empty())
                    .map(PathBuf::from)
                    .collect()
            })
            .unwrap_or_default();
        Ok(Environment {
            command,
            container_id,
            netns,
            ifname,
            args,
            cni_path,
        })
    }
}
