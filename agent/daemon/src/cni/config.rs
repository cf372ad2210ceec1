//! The network configuration the runtime writes on stdin.
//!
//! lockstep is configured two ways, and the configuration says which:
//! - `"type": "lockstep"`: the full plugin. Its options (`agentSocket`,
//!   `agentTimeout`, `pool`, `mtu`) sit at the top level, and an `ipam` section is refused:
//!   addresses come from the agent, and silently ignoring an IPAM plugin the
//!   administrator named would hand out addresses they did not expect.
//! - any interface plugin (`bridge`, `ptp`, …) whose `ipam.type` is
//!   `"lockstep-ipam"`: the IPAM-only plugin, a drop-in for `host-local`. The
//!   runtime ran the parent plugin, which hands us its whole configuration;
//!   our options sit inside `ipam`. host-local's range keys (`subnet`,
//!   `ranges`, …) are refused with code 2: pools live in the agent, and an
//!   address outside the subnet the administrator wrote would be a surprise.
//!
//! Unknown keys anywhere are tolerated (they belong to other plugins in the
//! chain); known keys with the wrong JSON type are errors (code 6), and known
//! keys with invalid values are errors (code 7) naming the field.
//!
//! Requested addresses come from three places, as in host-local:
//! `runtimeConfig.ips` (the `ips` capability), `args.cni.ips`, and the
//! deprecated `IP=` in `CNI_ARGS`, which the conventions say to ignore when
//! `args.cni.ips` is given. A pool may be requested per attachment through
//! `runtimeConfig.pool` or `args.cni.pool`, which override the configured
//! `pool`.

use std::fmt;
use std::net::IpAddr;
use std::path::PathBuf;

use serde_json::Value;

use super::env::{CniArgs, ContainerId, IfName};
use super::error::CniError;
use super::json::{Field, Obj};
use super::result::{Dns, Route, parse_route};
use super::version::{CniVersion, VersionParseError};

/// The agent's API socket when the configuration names none.
pub const DEFAULT_AGENT_SOCKET: &str = "/run/lockstep/lockstep.sock";
/// How long one plugin call to the agent may take by default.
pub const DEFAULT_AGENT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// The `type` of the full plugin.
pub const PLUGIN_TYPE: &str = "lockstep";

/// The `ipam.type` of the IPAM-only plugin.
pub const IPAM_PLUGIN_TYPE: &str = "lockstep-ipam";

/// Longest path that fits `sockaddr_un.sun_path` with its terminating NUL.
const MAX_SOCKET_PATH: usize = 107;

/// host-local keys that make no sense for lockstep-ipam.
const HOST_LOCAL_ONLY: [&str; 7] = [
    "subnet",
    "ranges",
    "rangeStart",
    "rangeEnd",
    "gateway",
    "dataDir",
    "resolvConf",
];

/// Which of lockstep's two plugins the configuration is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PluginMode {
    /// `type: lockstep`: creates the interfaces and asks the agent for
    /// addresses.
    Full,
    /// `ipam.type: lockstep-ipam` under another interface plugin: only
    /// allocates, and returns an [`IpamResult`](super::IpamResult).
    Ipam,
}

/// lockstep's own options.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LockstepOptions {
    /// `agentSocket`: the agent's API socket (absolute, at most 107 bytes).
    pub agent_socket: PathBuf,
    /// `agentTimeout` (seconds, 1–600; default 30): how long one call to
    /// the agent may take before the plugin answers "try again later"
    /// (code 11) — a hung or stopped agent must not block pod creation.
    pub agent_timeout: std::time::Duration,
    /// `pool`: the pool to allocate from; `None` means the agent's default.
    pub pool: Option<String>,
    /// `mtu` (full plugin only): the MTU of the veth pair, 68–65535.
    pub mtu: Option<u32>,
    /// `ipam.routes` (IPAM plugin only): routes returned to the parent plugin.
    pub routes: Vec<Route>,
}

/// An address requested by the runtime: `<ip>[/<prefix>]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RequestedIp {
    /// The address.
    pub address: IpAddr,
    /// The prefix length, if given.
    pub prefix_len: Option<u8>,
}

impl fmt::Display for RequestedIp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.prefix_len {
            Some(len) => write!(f, "{}/{len}", self.address),
            None => write!(f, "{}", self.address),
        }
    }
}

impl RequestedIp {
    /// Parses `<ip>[/<prefix>]`; the error is a reason for a message.
    ///
    /// # Errors
    /// If the address does not parse or the prefix is too long for its family.
    pub fn parse(text: &str) -> Result<RequestedIp, String> {
        let (addr, prefix) = match text.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (text, None),
        };
        let address: IpAddr = addr
            .parse()
            .map_err(|_| format!("{addr:?} is not an IP address"))?;
        let max = if address.is_ipv4() { 32 } else { 128 };
        let prefix_len = match prefix {
            None => None,
            Some(p) => match p.parse::<u8>() {
                Ok(len) if len <= max && p.bytes().all(|b| b.is_ascii_digit()) => Some(len),
                _ => return Err(format!("prefix length {p:?} is not 0 to {max}")),
            },
        };
        Ok(RequestedIp {
            address,
            prefix_len,
        })
    }
}

/// A validated network configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetworkConfig {
    /// `cniVersion`: the protocol version in use for this invocation.
    pub cni_version: CniVersion,
    /// `name`: the network name.
    pub name: String,
    /// The top-level `type` (`lockstep`, or the parent plugin in IPAM mode).
    pub plugin_type: String,
    /// Full plugin or IPAM-only.
    pub mode: PluginMode,
    /// lockstep's options.
    pub options: LockstepOptions,
    /// The well-known top-level `dns` section, if any.
    pub dns: Option<Dns>,
    /// Addresses requested for this attachment, in order, duplicates removed.
    pub requested_ips: Vec<RequestedIp>,
    /// A pool requested for this attachment (`runtimeConfig.pool`, else
    /// `args.cni.pool`).
    pub requested_pool: Option<String>,
}

impl NetworkConfig {
    /// The pool to allocate from: the attachment's request, else the
    /// configured `pool`; `None` means the agent's default pool.
    pub fn pool(&self) -> Option<&str> {
        self.requested_pool
            .as_deref()
            .or(self.options.pool.as_deref())
    }
}

/// Validates `name` against the spec's rule for network names (the same as
/// for container IDs).
fn check_name(field: &Field<'_>, what: &str) -> Result<String, CniError> {
    let name = field.as_str()?;
    ContainerId::new(name).map_err(|_| {
        field.invalid(format!(
            "a {what} must start with an ASCII letter or digit, followed by letters, digits, '_', '.' or '-'"
        ))
    })?;
    Ok(name.to_owned())
}

/// Parses `cniVersion` of a configuration.
pub(crate) fn parse_version(root: &Obj<'_>) -> Result<CniVersion, CniError> {
    let Some(field) = root.get("cniVersion") else {
        return Err(CniError::MissingVersion);
    };
    let text = field.as_str()?;
    text.parse().map_err(|e| match e {
        VersionParseError::Malformed => CniError::InvalidVersionString {
            field: field.path.clone(),
            value: text.to_owned(),
        },
        VersionParseError::Unsupported => CniError::UnsupportedVersion {
            field: field.path.clone(),
            version: text.to_owned(),
        },
    })
}

fn parse_options(obj: &Obj<'_>, mode: PluginMode) -> Result<LockstepOptions, CniError> {
    let agent_socket = match obj.get("agentSocket") {
        None => PathBuf::from(DEFAULT_AGENT_SOCKET),
        Some(field) => {
            let path = field.as_str()?;
            if !path.starts_with('/') {
                return Err(field.invalid("must be an absolute path"));
            }
            if path.len() > MAX_SOCKET_PATH || path.contains('\0') {
                return Err(
                    field.invalid("a unix socket path must be at most 107 bytes, without NUL")
                );
            }
            PathBuf::from(path)
        }
    };
    let agent_timeout = match obj.get("agentTimeout") {
        None => DEFAULT_AGENT_TIMEOUT,
        Some(field) => {
            let secs = field.as_u32()?;
            if !(1..=600).contains(&secs) {
                return Err(field.invalid("a timeout is 1 to 600 seconds"));
            }
            std::time::Duration::from_secs(u64::from(secs))
        }
    };
    let pool = obj
        .get("pool")
        .map(|f| check_name(&f, "pool name"))
        .transpose()?;
    let mtu = match (mode, obj.get("mtu")) {
        (PluginMode::Full, Some(field)) => {
            let mtu = field.as_u32()?;
            if !(68..=65535).contains(&mtu) {
                return Err(field.invalid("an MTU is 68 to 65535"));
            }
            Some(mtu)
        }
        _ => None,
    };
    let routes = match (mode, obj.get("routes")) {
        (PluginMode::Ipam, Some(list)) => list
            .as_array()?
            .iter()
            .map(parse_route)
            .collect::<Result<_, _>>()?,
        _ => Vec::new(),
    };
    Ok(LockstepOptions {
        agent_socket,
        agent_timeout,
        pool,
        mtu,
        routes,
    })
}

/// Appends the addresses in `field` (an array of `<ip>[/<prefix>]`) to `out`,
/// skipping exact duplicates and refusing the same address with two prefixes.
fn collect_ips(field: &Field<'_>, out: &mut Vec<RequestedIp>) -> Result<(), CniError> {
    for item in field.as_array()? {
        let text = item.as_str()?;
        let ip = RequestedIp::parse(text).map_err(|reason| item.invalid(reason))?;
        push_ip(ip, out).map_err(|reason| item.invalid(reason))?;
    }
    Ok(())
}

fn push_ip(ip: RequestedIp, out: &mut Vec<RequestedIp>) -> Result<(), String> {
    match out.iter().find(|known| known.address == ip.address) {
        Some(known) if *known == ip => Ok(()),
        Some(known) => Err(format!("{ip} conflicts with {known}, requested earlier")),
        None => {
            out.push(ip);
            Ok(())
        }
    }
}

/// Parses and validates the configuration (everything but `prevResult` and
/// GC's attachment list, which depend on the command).
pub(crate) fn parse_config(
    root: &Obj<'_>,
    cni_version: CniVersion,
    cni_args: &CniArgs,
) -> Result<NetworkConfig, CniError> {
    let name = check_name(&root.require("name", "")?, "network name")?;
    let plugin_type = root.require("type", "")?.as_str()?.to_owned();
    let ipam = root.get("ipam");
    let ipam_obj = ipam.as_ref().map(|f| f.as_obj()).transpose()?;
    let ipam_type = ipam_obj
        .as_ref()
        .map(|o| o.opt_str("type"))
        .transpose()?
        .flatten();

    let mode = if plugin_type == PLUGIN_TYPE {
        PluginMode::Full
    } else if ipam_type == Some(IPAM_PLUGIN_TYPE) {
        PluginMode::Ipam
    } else {
        return Err(CniError::NotForLockstep {
            plugin_type,
            ipam_type: ipam_type.map(str::to_owned),
        });
    };

    let options = match mode {
        PluginMode::Full => {
            if let Some(field) = &ipam {
                return Err(CniError::UnsupportedField {
                    field: field.path.clone(),
                    value: super::json::show(field.value),
                    reason: "the lockstep plugin allocates through the agent; to use lockstep \
                             as IPAM for another plugin, use that plugin with ipam type \
                             lockstep-ipam",
                });
            }
            parse_options(root, mode)?
        }
        PluginMode::Ipam => {
            let ipam = ipam_obj.as_ref().expect("IPAM mode implies an ipam object");
            for key in HOST_LOCAL_ONLY {
                if let Some(field) = ipam.get(key) {
                    return Err(CniError::UnsupportedField {
                        field: field.path.clone(),
                        value: super::json::show(field.value),
                        reason: "lockstep-ipam allocates from the agent's pools; configure \
                                 the range there and name it with ipam.pool",
                    });
                }
            }
            parse_options(ipam, mode)?
        }
    };

    let dns = root.get("dns").map(|f| Dns::from_field(&f)).transpose()?;

    let mut requested_ips = Vec::new();
    let mut requested_pool = None;
    if let Some(runtime) = root.get("runtimeConfig") {
        let runtime = runtime.as_obj()?;
        if let Some(ips) = runtime.get("ips") {
            collect_ips(&ips, &mut requested_ips)?;
        }
        if let Some(pool) = runtime.get("pool") {
            requested_pool = Some(check_name(&pool, "pool name")?);
        }
    }
    let mut args_have_ips = false;
    if let Some(args) = root.get("args") {
        let args = args.as_obj()?;
        if let Some(cni) = args.get("cni") {
            let cni = cni.as_obj()?;
            if let Some(ips) = cni.get("ips") {
                args_have_ips = true;
                collect_ips(&ips, &mut requested_ips)?;
            }
            if let Some(pool) = cni.get("pool") {
                let pool = check_name(&pool, "pool name")?;
                requested_pool.get_or_insert(pool);
            }
        }
    }
    if let Some(ip) = cni_args.get("IP").filter(|_| !args_have_ips) {
        let invalid = |reason: String| CniError::InvalidEnv {
            name: "CNI_ARGS",
            value: format!("IP={ip}"),
            reason,
        };
        let parsed = RequestedIp::parse(ip).map_err(invalid)?;
        push_ip(parsed, &mut requested_ips).map_err(invalid)?;
    }

    Ok(NetworkConfig {
        cni_version,
        name,
        plugin_type,
        mode,
        options,
        dns,
        requested_ips,
        requested_pool,
    })
}

/// A still-valid attachment from GC's `cni.dev/valid-attachments`, or the
/// attachment an ADD/DEL/CHECK is about.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Attachment {
    /// `CNI_CONTAINERID` of the attachment.
    pub container_id: ContainerId,
    /// `CNI_IFNAME` of the attachment.
    pub ifname: IfName,
}

/// The key GC's list of still-valid attachments is passed under.
pub const VALID_ATTACHMENTS_KEY: &str = "cni.dev/valid-attachments";

/// Parses GC's `cni.dev/valid-attachments`. The list is required: treating a
/// missing list as empty would release every address on the network.
pub(crate) fn parse_valid_attachments(root: &Obj<'_>) -> Result<Vec<Attachment>, CniError> {
    let list = root.require(VALID_ATTACHMENTS_KEY, " for GC")?;
    let mut out = Vec::new();
    for item in list.as_array()? {
        let obj = item.as_obj()?;
        let id_field = obj.require("containerID", "")?;
        let id = id_field.as_str()?;
        let container_id = ContainerId::new(id).map_err(|reason| id_field.invalid(reason))?;
        let if_field = obj.require("ifname", "")?;
        let ifname = IfName::new(if_field.as_str()?).map_err(|reason| if_field.invalid(reason))?;
        out.push(Attachment {
            container_id,
            ifname,
        });
    }
    Ok(out)
}

/// Whether a JSON value is an empty object (an "empty" `prevResult`).
pub(crate) fn is_empty_object(value: &Value) -> bool {
    value.as_object().is_some_and(serde_json::Map::is_empty)
}
