//! Spec versions and commands, and which commands exist in which version.
//!
//! lockstep speaks the four spec versions that real runtimes still send
//! (0.3.1 from older kubelets and podman's CNI backend, 0.4.0, 1.0.0 and 1.1.0).
//! The version decides three things: whether a command may be called at all
//! (CHECK from 0.4.0, GC and STATUS from 1.1.0), whether DEL carries a
//! `prevResult` (0.4.0 on), and the shape of results (see [`super::result`]).

use std::fmt;
use std::str::FromStr;

use serde_json::{Value, json};

/// A CNI specification version lockstep supports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CniVersion {
    /// 0.3.1: rich results with `ips[].version`.
    V0_3_1,
    /// 0.4.0: adds CHECK and `prevResult` on DEL.
    V0_4_0,
    /// 1.0.0: drops `ips[].version`.
    V1_0_0,
    /// 1.1.0: adds GC, STATUS and more interface and route fields.
    V1_1_0,
}

impl CniVersion {
    /// All supported versions, oldest first (the VERSION command's list).
    pub const SUPPORTED: [CniVersion; 4] = [
        CniVersion::V0_3_1,
        CniVersion::V0_4_0,
        CniVersion::V1_0_0,
        CniVersion::V1_1_0,
    ];

    /// The newest supported version.
    pub const LATEST: CniVersion = CniVersion::V1_1_0;

    /// The version as written in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            CniVersion::V0_3_1 => "0.3.1",
            CniVersion::V0_4_0 => "0.4.0",
            CniVersion::V1_0_0 => "1.0.0",
            CniVersion::V1_1_0 => "1.1.0",
        }
    }

    /// Whether `command` exists in this version.
    pub fn supports(self, command: Command) -> bool {
        self >= command.since()
    }

    /// Whether the runtime passes `prevResult` to DEL (0.4.0 and later).
    pub fn has_prev_result_on_del(self) -> bool {
        self >= CniVersion::V0_4_0
    }

    /// Whether `ips[]` entries carry a `version` field ("4"/"6"): only before
    /// 1.0.0.
    pub fn has_ip_version_field(self) -> bool {
        self < CniVersion::V1_0_0
    }
}

impl fmt::Display for CniVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a version string was not accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VersionParseError {
    /// Not of the form `MAJOR.MINOR.PATCH` (digits only).
    Malformed,
    /// Well-formed, but not a version lockstep supports.
    Unsupported,
}

impl FromStr for CniVersion {
    type Err = VersionParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if !is_semver_triple(s) {
            return Err(VersionParseError::Malformed);
        }
        CniVersion::SUPPORTED
            .into_iter()
            .find(|v| v.as_str() == s)
            .ok_or(VersionParseError::Unsupported)
    }
}

/// `MAJOR.MINOR.PATCH`, each a non-empty run of ASCII digits (no pre-release
/// or build suffix: no CNI version has one).
pub(crate) fn is_semver_triple(s: &str) -> bool {
    let mut parts = 0;
    for part in s.split('.') {
        parts += 1;
        if part.is_empty() || part.len() > 9 || !part.bytes().all(|b| b.is_ascii_digit()) {
            return false;
        }
    }
    parts == 3
}

/// A CNI command (`CNI_COMMAND`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Command {
    /// Attach a container to the network.
    Add,
    /// Detach a container; best effort and idempotent.
    Del,
    /// Verify an attachment against its `prevResult`.
    Check,
    /// Release everything not in a list of still-valid attachments.
    Gc,
    /// Report whether the plugin can serve ADD.
    Status,
    /// Report supported versions.
    Version,
}

impl Command {
    /// Every command, in the spec's order.
    pub const ALL: [Command; 6] = [
        Command::Add,
        Command::Del,
        Command::Check,
        Command::Gc,
        Command::Status,
        Command::Version,
    ];

    /// The value of `CNI_COMMAND`.
    pub fn as_str(self) -> &'static str {
        match self {
            Command::Add => "ADD",
            Command::Del => "DEL",
            Command::Check => "CHECK",
            Command::Gc => "GC",
            Command::Status => "STATUS",
            Command::Version => "VERSION",
        }
    }

    /// The first supported spec version that has this command.
    pub fn since(self) -> CniVersion {
        match self {
            Command::Add | Command::Del | Command::Version => CniVersion::V0_3_1,
            Command::Check => CniVersion::V0_4_0,
            Command::Gc | Command::Status => CniVersion::V1_1_0,
        }
    }

    /// Parses a `CNI_COMMAND` value (case-sensitive, as in the spec).
    pub fn parse(s: &str) -> Option<Command> {
        Command::ALL.into_iter().find(|c| c.as_str() == s)
    }
}

impl fmt::Display for Command {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The answer to VERSION: the version the runtime asked with, and ours.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VersionInfo {
    /// The `cniVersion` from the request, echoed back as the spec asks.
    pub cni_version: String,
}

impl VersionInfo {
    /// `{"cniVersion": ..., "supportedVersions": [...]}`.
    pub fn to_json(&self) -> Value {
        json!({
            "cniVersion": self.cni_version,
            "supportedVersions": CniVersion::SUPPORTED.map(CniVersion::as_str),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_matrix_follows_the_spec() {
        use CniVersion::*;
        let expect = [
            (Command::Add, [true, true, true, true]),
            (Command::Del, [true, true, true, true]),
            (Command::Version, [true, true, true, true]),
            (Command::Check, [false, true, true, true]),
            (Command::Gc, [false, false, false, true]),
            (Command::Status, [false, false, false, true]),
        ];
        for (command, row) in expect {
            for (version, want) in [V0_3_1, V0_4_0, V1_0_0, V1_1_0].into_iter().zip(row) {
                assert_eq!(version.supports(command), want, "{command} in {version}");
            }
        }
    }

    #[test]
    fn version_strings() {
        assert_eq!("1.0.0".parse(), Ok(CniVersion::V1_0_0));
        assert_eq!(
            "0.2.0".parse::<CniVersion>(),
            Err(VersionParseError::Unsupported)
        );
        assert_eq!(
            "1.0".parse::<CniVersion>(),
            Err(VersionParseError::Malformed)
        );
        assert_eq!(
            "1.0.0-rc1".parse::<CniVersion>(),
            Err(VersionParseError::Malformed)
        );
        assert_eq!("".parse::<CniVersion>(), Err(VersionParseError::Malformed));
        assert_eq!(
            " 1.0.0".parse::<CniVersion>(),
            Err(VersionParseError::Malformed)
        );
    }

    #[test]
    fn version_answer_lists_supported_versions() {
        let info = VersionInfo {
            cni_version: "1.0.0".to_owned(),
        };
        assert_eq!(
            info.to_json(),
            json!({"cniVersion": "1.0.0", "supportedVersions": ["0.3.1", "0.4.0", "1.0.0", "1.1.0"]})
        );
    }
}
