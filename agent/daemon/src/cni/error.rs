//! The module's one error type and its mapping onto the CNI error object.
//!
//! The runtime reads a plugin's failure as JSON on stdout
//! (`{"cniVersion", "code", "msg", "details"}`) and decides what to do from the
//! code alone: 11 means "retry", 3 means "nothing to clean up", 50/51 feed
//! STATUS. So every variant maps to exactly one well-known code, the message
//! names the field or variable at fault, and the details say what would fix it.

use std::fmt;
use std::io;
use std::sync::Arc;

use serde_json::{Value, json};

use super::version::{CniVersion, Command};

/// The CNI spec's well-known error codes (0–99 are reserved by the spec).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum ErrorCode {
    /// 1: incompatible CNI version.
    IncompatibleVersion = 1,
    /// 2: unsupported field in the network configuration; the message names
    /// the key and its value.
    UnsupportedField = 2,
    /// 3: container unknown or does not exist; the runtime need not clean up.
    UnknownContainer = 3,
    /// 4: invalid necessary environment variables; the message names them.
    InvalidEnvironment = 4,
    /// 5: I/O failure, e.g. reading the configuration from stdin.
    IoFailure = 5,
    /// 6: failed to decode content (JSON syntax, wrong JSON types, version
    /// strings).
    DecodingFailure = 6,
    /// 7: the network configuration does not validate.
    InvalidNetworkConfig = 7,
    /// 11: a transient condition; the runtime should retry later.
    TryAgainLater = 11,
    /// 50: the plugin cannot service ADD requests (STATUS).
    PluginNotAvailable = 50,
    /// 51: the plugin cannot service ADD requests and existing containers may
    /// have limited connectivity (STATUS).
    LimitedConnectivity = 51,
}

impl ErrorCode {
    /// The numeric code written into the error object.
    pub fn as_u32(self) -> u32 {
        self as u32
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.as_u32())
    }
}

/// Everything that can go wrong in the CNI layer, each mapped to a spec code
/// by [`CniError::code`].
///
/// `Clone` (causes are shared through `Arc`) so that requests holding an
/// error, like a DEL's unreadable `prevResult`, stay `Clone`.
#[derive(Clone, Debug, thiserror::Error)]
pub enum CniError {
    /// `cniVersion` names a version lockstep does not speak.
    #[error("incompatible CNI version: {field} is {version:?}, which lockstep does not support")]
    UnsupportedVersion {
        /// The field holding the version (`cniVersion`, `prevResult.cniVersion`).
        field: String,
        /// The version given.
        version: String,
    },
    /// The configuration has no `cniVersion`, which means spec 0.1.0.
    #[error("incompatible CNI version: field `cniVersion` is missing (which means spec 0.1.0)")]
    MissingVersion,
    /// The command does not exist in the configuration's spec version.
    #[error(
        "incompatible CNI version: {command} needs cniVersion {since} or later, the configuration has {version}"
    )]
    CommandNotInVersion {
        /// The command requested.
        command: Command,
        /// The configuration's version.
        version: CniVersion,
        /// The first version that has the command.
        since: CniVersion,
    },
    /// The configuration carries a field lockstep cannot honour.
    #[error("unsupported field `{field}` (value {value}): {reason}")]
    UnsupportedField {
        /// The field, as a path from the top of the configuration.
        field: String,
        /// Its value, as JSON.
        value: String,
        /// Why it is not supported and what to do instead.
        reason: &'static str,
    },
    /// The container or attachment is not known.
    #[error("container {container_id:?} is unknown or does not exist")]
    UnknownContainer {
        /// The container ID asked about.
        container_id: String,
    },
    /// Required environment variables are missing (or empty).
    #[error("missing environment variables {} required by {command}", names.join(", "))]
    MissingEnv {
        /// The command whose requirements were checked.
        command: Command,
        /// The variables missing, in the spec's order.
        names: Vec<&'static str>,
    },
    /// `CNI_COMMAND` is missing or empty.
    #[error("missing environment variable CNI_COMMAND")]
    MissingCommand,
    /// An environment variable is present but invalid.
    #[error("invalid environment variable {name}={value:?}: {reason}")]
    InvalidEnv {
        /// The variable.
        name: &'static str,
        /// Its value (lossily decoded if it was not UTF-8).
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Reading stdin failed.
    #[error("cannot read the network configuration from stdin")]
    ReadStdin {
        /// The I/O error.
        #[source]
        source: Arc<io::Error>,
    },
    /// Stdin is larger than [`MAX_STDIN_BYTES`](super::MAX_STDIN_BYTES).
    #[error("the network configuration on stdin is larger than {limit} bytes")]
    StdinTooLarge {
        /// The limit in bytes.
        limit: usize,
    },
    /// Stdin is not valid JSON.
    #[error("the network configuration on stdin is not valid JSON")]
    InvalidJson {
        /// The parser's error, with line and column.
        #[source]
        source: Arc<serde_json::Error>,
    },
    /// A known field has the wrong JSON type.
    #[error("field `{field}` must be {expected}, found {found}")]
    WrongType {
        /// The field, as a path from the top of the configuration.
        field: String,
        /// The JSON type expected.
        expected: &'static str,
        /// The JSON type found.
        found: &'static str,
    },
    /// A version string is not of the form `MAJOR.MINOR.PATCH`.
    #[error("field `{field}` is {value:?}, which is not a version of the form MAJOR.MINOR.PATCH")]
    InvalidVersionString {
        /// The field holding the version.
        field: String,
        /// The value given.
        value: String,
    },
    /// A required field is absent.
    #[error("field `{field}` is required{context}")]
    MissingField {
        /// The field, as a path from the top of the configuration.
        field: String,
        /// Extra context such as " for CHECK" (empty if none).
        context: &'static str,
    },
    /// A field has the right type but an invalid value.
    #[error("field `{field}` is invalid ({value}): {reason}")]
    InvalidField {
        /// The field, as a path from the top of the configuration.
        field: String,
        /// Its value, as JSON.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The configuration is not meant for lockstep.
    #[error(
        "configuration is for neither `lockstep` nor `lockstep-ipam`: type {plugin_type:?}, ipam.type {ipam_type:?}"
    )]
    NotForLockstep {
        /// The top-level `type`.
        plugin_type: String,
        /// `ipam.type`, if present.
        ipam_type: Option<String>,
    },
    /// The agent's socket cannot be used, and retrying will not change
    /// that: the path is not a socket, or the plugin may not open it.
    #[error("the lockstep agent socket {socket} cannot be used: {reason}")]
    AgentSocket {
        /// The socket path (`agentSocket`).
        socket: String,
        /// What is wrong, and what to fix.
        reason: String,
        /// Whether it is the configuration (a path that is not a socket)
        /// rather than the plugin's privileges.
        config: bool,
    },
    /// A transient condition; the runtime should retry.
    #[error("try again later: {reason}")]
    TryAgainLater {
        /// What is transient (e.g. "the agent is restoring its state").
        reason: String,
    },
    /// STATUS: the plugin cannot serve ADD.
    #[error("lockstep is not available: {reason}")]
    PluginNotAvailable {
        /// Why (e.g. the agent socket does not answer).
        reason: String,
    },
    /// STATUS: the plugin cannot serve ADD and existing containers may have
    /// limited connectivity.
    #[error(
        "lockstep is not available and existing containers may have limited connectivity: {reason}"
    )]
    LimitedConnectivity {
        /// Why (e.g. the datapath is not attached).
        reason: String,
    },
}

impl CniError {
    /// The spec's error code for this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            CniError::UnsupportedVersion { .. }
            | CniError::MissingVersion
            | CniError::CommandNotInVersion { .. } => ErrorCode::IncompatibleVersion,
            CniError::UnsupportedField { .. } => ErrorCode::UnsupportedField,
            CniError::UnknownContainer { .. } => ErrorCode::UnknownContainer,
            CniError::MissingEnv { .. }
            | CniError::MissingCommand
            | CniError::InvalidEnv { .. } => ErrorCode::InvalidEnvironment,
            CniError::ReadStdin { .. } | CniError::StdinTooLarge { .. } => ErrorCode::IoFailure,
            CniError::InvalidJson { .. }
            | CniError::WrongType { .. }
            | CniError::InvalidVersionString { .. } => ErrorCode::DecodingFailure,
            CniError::MissingField { .. }
            | CniError::InvalidField { .. }
            | CniError::NotForLockstep { .. } => ErrorCode::InvalidNetworkConfig,
            CniError::AgentSocket { config: true, .. } => ErrorCode::InvalidNetworkConfig,
            CniError::AgentSocket { config: false, .. } => ErrorCode::IoFailure,
            CniError::TryAgainLater { .. } => ErrorCode::TryAgainLater,
            CniError::PluginNotAvailable { .. } => ErrorCode::PluginNotAvailable,
            CniError::LimitedConnectivity { .. } => ErrorCode::LimitedConnectivity,
        }
    }

    /// The longer explanation for the `details` field: what would fix the
    /// error, followed by the chain of underlying causes.
    pub fn details(&self) -> String {
        let supported = CniVersion::SUPPORTED.map(CniVersion::as_str).join(", ");
        let hint = match self {
            CniError::UnsupportedVersion { .. } | CniError::MissingVersion => {
                format!("lockstep supports CNI versions {supported}")
            }
            CniError::CommandNotInVersion { .. } => {
                "raise cniVersion in the network configuration, or do not call this command"
                    .to_owned()
            }
            CniError::UnsupportedField { .. } => {
                "remove the field from the configuration".to_owned()
            }
            CniError::UnknownContainer { .. } => {
                "the runtime need not clean up this container".to_owned()
            }
            CniError::MissingEnv { .. } | CniError::MissingCommand => {
                "the runtime must set these CNI_* variables; see the CNI spec, section 2".to_owned()
            }
            CniError::InvalidEnv { .. } => {
                "the runtime passed a value the CNI spec does not allow".to_owned()
            }
            CniError::ReadStdin { .. } => String::new(),
            CniError::StdinTooLarge { .. } => {
                "a CNI network configuration is a few kilobytes; check what the runtime sends"
                    .to_owned()
            }
            CniError::InvalidJson { .. }
            | CniError::WrongType { .. }
            | CniError::InvalidVersionString { .. } => {
                "the network configuration could not be decoded".to_owned()
            }
            CniError::MissingField { .. } | CniError::InvalidField { .. } => {
                "fix the network configuration (conflist) for this network".to_owned()
            }
            CniError::NotForLockstep { .. } => {
                "use type \"lockstep\", or an ipam section with type \"lockstep-ipam\"".to_owned()
            }
            CniError::AgentSocket { .. } => {
                "retrying will not help: fix agentSocket or run the plugin as root".to_owned()
            }
            CniError::TryAgainLater { .. } => "the condition is transient; retry".to_owned(),
            CniError::PluginNotAvailable { .. } | CniError::LimitedConnectivity { .. } => {
                "check that the lockstep agent is running on this node".to_owned()
            }
        };
        let mut details = hint;
        let mut source = std::error::Error::source(self);
        while let Some(cause) = source {
            if !details.is_empty() {
                details.push_str(": ");
            }
            details.push_str(&cause.to_string());
            source = cause.source();
        }
        details
    }

    /// The spec's error object, `{"cniVersion", "code", "msg", "details"}`,
    /// for the version in use (see [`super::error_version`] when the
    /// configuration could not be read).
    pub fn to_json(&self, cni_version: &str) -> Value {
        json!({
            "cniVersion": cni_version,
            "code": self.code().as_u32(),
            "msg": self.to_string(),
            "details": self.details(),
        })
    }
}
