//! The CNI specification layer of lockstep's CNI plugins: what the runtime
//! sends, validated, and what the plugin answers, in the runtime's version.
//!
//! Why a separate layer: a CNI plugin is a short-lived binary whose whole input
//! is a few environment variables and a JSON document on stdin, and whose whole
//! output is JSON on stdout. Everything the spec says about that exchange
//! (required variables per command, which commands exist in which version, the
//! result shapes of 0.3.1 to 1.1.0, the error object and its codes) is pure
//! data handling, so it lives here with no side effects: no netlink, no
//! sockets, no reading of the process environment. The plugin binaries stay
//! thin: they call [`read_stdin`] and [`parse_invocation`], do the interface
//! work and agent calls for the [`Invocation`] they get, and print either a
//! result or [`CniError::to_json`].
//!
//! ```text
//! env + stdin ──parse_invocation──▶ Invocation ──(plugin: veth, agent)──▶ CniResult / IpamResult
//!      │                                                                       │
//!      └──────────────── CniError { code 1..51 } ◀──────────────────────────── to_json(version)
//! ```
//!
//! Validation order follows the reference implementation (libcni's `skel`), so
//! that a broken invocation reports the same code as other plugins would:
//! environment (code 4), stdin size (5), JSON syntax (6), `cniVersion` (6 if
//! malformed, 1 if unsupported or too old for the command), then the rest of
//! the configuration (2, 6, 7).

mod config;
mod env;
mod error;
mod json;
mod result;
mod version;

#[cfg(test)]
mod tests;

use std::io::Read;
use std::path::PathBuf;
use std::sync::Arc;

use serde_json::Value;

pub use config::{
    Attachment, DEFAULT_AGENT_SOCKET, IPAM_PLUGIN_TYPE, LockstepOptions, NetworkConfig,
    PLUGIN_TYPE, PluginMode, RequestedIp, VALID_ATTACHMENTS_KEY,
};
pub use env::{CniArgs, ContainerId, Environment, IfName, MAX_IFNAME_LEN};
pub use error::{CniError, ErrorCode};
pub use result::{CniResult, Dns, Interface, IpConfig, IpamAddress, IpamResult, Route};
pub use version::{CniVersion, Command, VersionInfo, VersionParseError};

use json::Obj;

/// The most stdin a plugin accepts. Real configurations are a few kilobytes;
/// a `prevResult` for a pod with many addresses stays far below this. The
/// limit keeps a runaway writer from making the plugin buffer without bound.
pub const MAX_STDIN_BYTES: usize = 1 << 20;

/// One validated invocation of the plugin.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Invocation {
    /// ADD: create the interface (full plugin) or allocate (IPAM plugin).
    Add(AttachmentRequest),
    /// DEL: release; best effort and idempotent.
    Del(AttachmentRequest),
    /// CHECK: verify the attachment against `prev_result` (always present).
    Check(AttachmentRequest),
    /// GC: release everything not in `valid_attachments`.
    Gc(GcRequest),
    /// STATUS: report whether ADD can be served.
    Status(StatusRequest),
    /// VERSION: answer with [`VersionRequest::response`].
    Version(VersionRequest),
}

impl Invocation {
    /// The command invoked.
    pub fn command(&self) -> Command {
        match self {
            Invocation::Add(_) => Command::Add,
            Invocation::Del(_) => Command::Del,
            Invocation::Check(_) => Command::Check,
            Invocation::Gc(_) => Command::Gc,
            Invocation::Status(_) => Command::Status,
            Invocation::Version(_) => Command::Version,
        }
    }

    /// The network configuration (absent for VERSION).
    pub fn config(&self) -> Option<&NetworkConfig> {
        match self {
            Invocation::Add(r) | Invocation::Del(r) | Invocation::Check(r) => Some(&r.config),
            Invocation::Gc(r) => Some(&r.config),
            Invocation::Status(r) => Some(&r.config),
            Invocation::Version(_) => None,
        }
    }

    /// The version to write results and errors in: the configuration's, or
    /// for VERSION the newest we speak.
    pub fn cni_version(&self) -> CniVersion {
        self.config().map_or(CniVersion::LATEST, |c| c.cni_version)
    }
}

/// ADD, DEL or CHECK of one attachment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttachmentRequest {
    /// The attachment: container ID and interface name.
    pub attachment: Attachment,
    /// `CNI_NETNS`: always present for ADD and CHECK; for DEL, absent when
    /// the runtime no longer has the namespace.
    pub netns: Option<PathBuf>,
    /// `CNI_ARGS`.
    pub args: CniArgs,
    /// `CNI_PATH`.
    pub cni_path: Vec<PathBuf>,
    /// The network configuration.
    pub config: NetworkConfig,
    /// `prevResult`: always present for CHECK; for ADD, present when chained
    /// after another plugin; for DEL (0.4.0 and later) the result of ADD, if
    /// the runtime had one. An empty object counts as absent.
    pub prev_result: Option<CniResult>,
    /// DEL only: why a `prevResult` that was present could not be read. DEL
    /// must succeed as far as it can, and releasing needs only the
    /// attachment, so a bad `prevResult` is set aside (for the plugin to log)
    /// rather than failing the DEL.
    pub prev_result_error: Option<Box<CniError>>,
}

/// GC of a network.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GcRequest {
    /// The network configuration.
    pub config: NetworkConfig,
    /// `CNI_PATH` (required for GC so that delegated plugins can be called).
    pub cni_path: Vec<PathBuf>,
    /// `cni.dev/valid-attachments`: attachments to keep; everything else of
    /// this network may be released.
    pub valid_attachments: Vec<Attachment>,
}

/// STATUS of the plugin for a network.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatusRequest {
    /// The network configuration.
    pub config: NetworkConfig,
    /// `CNI_PATH`, if given.
    pub cni_path: Vec<PathBuf>,
}

/// VERSION.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VersionRequest {
    /// The `cniVersion` the runtime asked with (any well-formed version, even
    /// one we do not support: the runtime is asking exactly that), or the
    /// newest supported version if stdin was empty or had none.
    pub cni_version: String,
}

impl VersionRequest {
    /// The answer to print.
    pub fn response(&self) -> VersionInfo {
        VersionInfo {
            cni_version: self.cni_version.clone(),
        }
    }
}

// `CniError` holds `io::Error` and `serde_json::Error`, which are not `Eq`;
// requests compare their `prev_result_error` by code and message.
impl PartialEq for CniError {
    fn eq(&self, other: &Self) -> bool {
        self.code() == other.code() && self.to_string() == other.to_string()
    }
}

impl Eq for CniError {}

/// Reads stdin (or any reader) up to [`MAX_STDIN_BYTES`].
///
/// # Errors
/// [`CniError::ReadStdin`] if reading fails, [`CniError::StdinTooLarge`] if
/// there is more than the limit; both code 5.
pub fn read_stdin(reader: impl Read) -> Result<Vec<u8>, CniError> {
    let mut buf = Vec::new();
    let limit = u64::try_from(MAX_STDIN_BYTES)
        .unwrap_or(u64::MAX)
        .saturating_add(1);
    reader
        .take(limit)
        .read_to_end(&mut buf)
        .map_err(|source| CniError::ReadStdin {
            source: Arc::new(source),
        })?;
    if buf.len() > MAX_STDIN_BYTES {
        return Err(CniError::StdinTooLarge {
            limit: MAX_STDIN_BYTES,
        });
    }
    Ok(buf)
}

/// The version to write an error in when [`parse_invocation`] failed: the
/// configuration's `cniVersion` if it is one we support, else the newest.
pub fn error_version(stdin: &[u8]) -> CniVersion {
    if stdin.len() > MAX_STDIN_BYTES {
        return CniVersion::LATEST;
    }
    serde_json::from_slice::<Value>(stdin)
        .ok()
        .and_then(|v| {
            v.get("cniVersion")
                .and_then(Value::as_str)
                .and_then(|s| s.parse().ok())
        })
        .unwrap_or(CniVersion::LATEST)
}

/// Validates everything the runtime passed: the `CNI_*` variables in `env`
/// (other variables are ignored) and the configuration in `stdin`.
///
/// `env` is any iterator of name/value pairs: `std::env::vars_os()` in the
/// binary, a literal array in tests.
///
/// # Errors
/// A [`CniError`] whose [`code`](CniError::code) is the spec's: 4 for the
/// environment, 5 for oversized stdin, 6 for undecodable JSON or wrong JSON
/// types, 1 for unsupported versions or commands too new for the version,
/// 2 for fields lockstep refuses, 7 for invalid values. The message names the
/// variable or field.
pub fn parse_invocation<I, K, V>(env: I, stdin: &[u8]) -> Result<Invocation, CniError>
where
    I: IntoIterator<Item = (K, V)>,
    K: AsRef<std::ffi::OsStr>,
    V: AsRef<std::ffi::OsStr>,
{
    let env = Environment::from_vars(env)?;
    if stdin.len() > MAX_STDIN_BYTES {
        return Err(CniError::StdinTooLarge {
            limit: MAX_STDIN_BYTES,
        });
    }
    if env.command == Command::Version {
        return parse_version_request(stdin).map(Invocation::Version);
    }

    let document: Value =
        serde_json::from_slice(stdin).map_err(|source| CniError::InvalidJson {
            source: Arc::new(source),
        })?;
    let root = Obj::root(&document)?;
    let cni_version = config::parse_version(&root)?;
    if !cni_version.supports(env.command) {
        return Err(CniError::CommandNotInVersion {
            command: env.command,
            version: cni_version,
            since: env.command.since(),
        });
    }
    let config = config::parse_config(&root, cni_version, &env.args)?;

    match env.command {
        Command::Add | Command::Del | Command::Check => {
            let attachment = Attachment {
                container_id: env.container_id.expect("required for this command"),
                ifname: env.ifname.expect("required for this command"),
            };
            let (prev_result, prev_result_error) =
                parse_prev_result(&root, env.command, cni_version)?;
            let request = AttachmentRequest {
                attachment,
                netns: env.netns,
                args: env.args,
                cni_path: env.cni_path,
                config,
                prev_result,
                prev_result_error,
            };
            Ok(match env.command {
                Command::Add => Invocation::Add(request),
                Command::Del => Invocation::Del(request),
                _ => Invocation::Check(request),
            })
        }
        Command::Gc => {
            let valid_attachments = config::parse_valid_attachments(&root)?;
            Ok(Invocation::Gc(GcRequest {
                config,
                cni_path: env.cni_path,
                valid_attachments,
            }))
        }
        Command::Status => Ok(Invocation::Status(StatusRequest {
            config,
            cni_path: env.cni_path,
        })),
        Command::Version => unreachable!("handled before the configuration is read"),
    }
}

type PrevResult = (Option<CniResult>, Option<Box<CniError>>);

/// `prevResult` per command: required for CHECK, read for ADD, read for DEL
/// from 0.4.0 (where a bad one is set aside, not fatal), and ignored for DEL
/// in 0.3.1, which has no `prevResult` on DEL.
fn parse_prev_result(
    root: &Obj<'_>,
    command: Command,
    version: CniVersion,
) -> Result<PrevResult, CniError> {
    if command == Command::Del && !version.has_prev_result_on_del() {
        return Ok((None, None));
    }
    let field = match root.get("prevResult") {
        Some(f) if !config::is_empty_object(f.value) => f,
        _ if command == Command::Check => {
            return Err(CniError::MissingField {
                field: "prevResult".to_owned(),
                context: " for CHECK",
            });
        }
        _ => return Ok((None, None)),
    };
    match CniResult::from_json(field.value, &field.path, version) {
        Ok(result) => Ok((Some(result), None)),
        Err(e) if command == Command::Del => Ok((None, Some(Box::new(e)))),
        Err(e) => Err(e),
    }
}

/// VERSION's stdin: `{"cniVersion": "..."}`; empty stdin is accepted too
/// (some runtimes send nothing).
fn parse_version_request(stdin: &[u8]) -> Result<VersionRequest, CniError> {
    let latest = || VersionRequest {
        cni_version: CniVersion::LATEST.as_str().to_owned(),
    };
    if stdin.iter().all(u8::is_ascii_whitespace) {
        return Ok(latest());
    }
    let document: Value =
        serde_json::from_slice(stdin).map_err(|source| CniError::InvalidJson {
            source: Arc::new(source),
        })?;
    let root = Obj::root(&document)?;
    let Some(field) = root.get("cniVersion") else {
        return Ok(latest());
    };
    let text = field.as_str()?;
    if !version::is_semver_triple(text) {
        return Err(CniError::InvalidVersionString {
            field: field.path.clone(),
            value: text.to_owned(),
        });
    }
    Ok(VersionRequest {
        cni_version: text.to_owned(),
    })
}
