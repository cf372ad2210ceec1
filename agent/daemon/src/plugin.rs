//! The CNI plugins `lockstep` and `lockstep-ipam`: the same binary, run by a
//! container runtime with `CNI_COMMAND` set.
//!
//! The plugin is thin on purpose: it validates the invocation (the [`cni`]
//! spec layer), asks the agent over its socket, and prints the result or the
//! error in the version the runtime asked for. The agent does the allocation,
//! the interfaces and the datapath, so rollback and crash safety live in one
//! place. An unreachable agent is "try again later" (code 11); a refusal by
//! the agent (an exhausted pool, a taken address) is code 100 with the agent's
//! stable error code in `details`.

use std::io::Write as _;
use std::path::Path;

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use crate::wire::{DelRequest, EndpointReply, EndpointRequest, ErrorReply, GcRequest, Readiness};

use crate::cni::{
    self, AttachmentRequest, CniError, CniResult, CniVersion, Interface, Invocation, IpConfig,
    IpamAddress, IpamResult, LockstepOptions, PluginMode, Route,
};

/// Code of errors the agent reports (plugin-specific codes start at 100).
pub const AGENT_REFUSED: u32 = 100;
/// Code of an agent answer to ADD the plugin cannot turn into a result.
pub const BAD_AGENT_REPLY: u32 = 101;

/// Why an invocation failed.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    /// The invocation itself is wrong, or a spec-level condition.
    #[error(transparent)]
    Cni(#[from] CniError),
    /// The agent answered with an error.
    #[error("the lockstep agent refused: {message}")]
    Refused {
        /// The agent's stable error code.
        code: String,
        /// The agent's message.
        message: String,
    },
    /// The agent's answer to ADD cannot be turned into a result (it does
    /// not parse, or it holds no address). No result is printed, and what
    /// the agent allocated is given back with a DEL.
    #[error("the lockstep agent's answer to ADD cannot be used: {reason}")]
    BadReply {
        /// What is wrong with it.
        reason: &'static str,
        /// The parse error, if it did not parse.
        #[source]
        source: Option<serde_json::Error>,
    },
}

impl PluginError {
    fn to_json(&self, version: CniVersion) -> Value {
        match self {
            PluginError::Cni(e) => e.to_json(version.as_str()),
            PluginError::Refused { code, message } => json!({
                "cniVersion": version.as_str(),
                "code": AGENT_REFUSED,
                "msg": format!("the lockstep agent refused: {message}"),
                "details": format!("agent error code {code}"),
            }),
            PluginError::BadReply { .. } => json!({
                "cniVersion": version.as_str(),
                "code": BAD_AGENT_REPLY,
                "msg": self.to_string(),
                "details": crate::error_chain(self),
            }),
        }
    }
}

/// One request to the agent: `body` is serialized from its wire type; a
/// success answers with the raw reply (checked to be JSON), which the
/// caller parses into its wire type ([`reply`]); an error reply is parsed
/// as [`ErrorReply`].
fn agent(
    options: &LockstepOptions,
    method: &str,
    path: &str,
    body: Option<&dyn erased::Body>,
) -> Result<Vec<u8>, PluginError> {
    let socket = options.agent_socket.as_path();
    let unreachable = |e: std::io::Error| -> PluginError {
        use std::os::unix::fs::FileTypeExt as _;
        let at = socket.display().to_string();
        // Not running (no socket, or a stale one) is transient; a path that
        // is no socket at all, or a socket the plugin may not open, is not.
        if matches!(e.kind(), std::io::ErrorKind::PermissionDenied) {
            return CniError::AgentSocket {
                socket: at,
                reason: format!("{e}; the plugin must run as root, as the runtime runs it"),
                config: false,
            }
            .into();
        }
        if let Ok(meta) = std::fs::metadata(socket)
            && !meta.file_type().is_socket()
        {
            let what = if meta.is_dir() {
                "a directory"
            } else {
                "not a socket"
            };
            return CniError::AgentSocket {
                socket: at,
                reason: format!("it is {what}; agentSocket must name the agent's API socket"),
                config: true,
            }
            .into();
        }
        CniError::TryAgainLater {
            reason: format!("the lockstep agent is not reachable at {at} ({e}); is it running?"),
        }
        .into()
    };
    let deadline = options.agent_timeout;
    let body = body.map(erased::Body::to_json).unwrap_or_default();
    let (status, payload) =
        exchange(socket, deadline, method, path, &body).map_err(|e| match e {
            Exchange::Connect(e) => unreachable(e),
            Exchange::Timeout => CniError::TryAgainLater {
                reason: format!(
                    "the lockstep agent at {} did not answer within {deadline:?} (agentTimeout)",
                    socket.display()
                ),
            }
            .into(),
            Exchange::TooLarge => CniError::TryAgainLater {
                reason: format!("the lockstep agent's answer is larger than {MAX_REPLY} bytes"),
            }
            .into(),
            Exchange::Io(e) => CniError::TryAgainLater {
                reason: format!("talking to the lockstep agent failed: {e}"),
            }
            .into(),
            Exchange::Malformed(what) => CniError::TryAgainLater {
                reason: format!("the lockstep agent's answer is malformed: {what}"),
            }
            .into(),
        })?;
    if (200..300).contains(&status) {
        return Ok(payload);
    }
    let (code, message) = match reply::<ErrorReply>(&payload) {
        Ok(ErrorReply { error }) => (error.code, error.message),
        Err(_) => ("unknown".to_string(), String::new()),
    };
    Err(match code.as_str() {
        "not_ready" => CniError::TryAgainLater {
            reason: "the lockstep agent is restoring its state".into(),
        }
        .into(),
        "busy" | "etcd_unavailable" | "pod_not_seen" => {
            CniError::TryAgainLater { reason: message }.into()
        }
        _ => PluginError::Refused { code, message },
    })
}

/// How one request to the agent failed.
enum Exchange {
    Connect(std::io::Error),
    Io(std::io::Error),
    Malformed(String),
    /// No complete answer before the deadline.
    Timeout,
    /// An answer longer than [`MAX_REPLY`].
    TooLarge,
}

/// The longest answer the plugin reads from the agent: a CNI reply is a few
/// kilobytes; anything near this is not one.
const MAX_REPLY: u64 = 1 << 20;

/// One HTTP/1.1 request over the agent's unix socket, blocking, std only.
///
/// The plugin is a new process per CNI call, so its start-up is on every
/// pod's critical path: an async runtime and a general HTTP client cost more
/// than the whole exchange (measured by the cni bench). This is the one
/// request the plugin makes, to a server that is ours (`Connection: close`,
/// a JSON body with `Content-Length`); the agent and the CLI use hyper.
fn exchange(
    socket: &Path,
    deadline: std::time::Duration,
    method: &str,
    path: &str,
    body: &str,
) -> Result<(u16, Vec<u8>), Exchange> {
    use std::io::Read;
    let started = std::time::Instant::now();
    let mut stream = std::os::unix::net::UnixStream::connect(socket).map_err(Exchange::Connect)?;
    let request = format!(
        "{method} {path} HTTP/1.1\r\nhost: lockstep\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let timed_out = |e: &std::io::Error| {
        matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        )
    };
    let left = || {
        deadline
            .checked_sub(started.elapsed())
            .filter(|d| !d.is_zero())
            .ok_or(Exchange::Timeout)
    };
    stream
        .set_write_timeout(Some(left()?))
        .map_err(Exchange::Io)?;
    stream.write_all(request.as_bytes()).map_err(|e| {
        if timed_out(&e) {
            Exchange::Timeout
        } else {
            Exchange::Io(e)
        }
    })?;
    // Read until the agent closes, within what is left of the deadline,
    // and never more than MAX_REPLY.
    let mut raw = Vec::with_capacity(4096);
    let mut chunk = [0u8; 16 * 1024];
    loop {
        stream
            .set_read_timeout(Some(left()?))
            .map_err(Exchange::Io)?;
        match stream.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => {
                raw.extend_from_slice(&chunk[..n]);
                if raw.len() as u64 > MAX_REPLY {
                    return Err(Exchange::TooLarge);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if timed_out(&e) => return Err(Exchange::Timeout),
            Err(e) => return Err(Exchange::Io(e)),
        }
    }
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| Exchange::Malformed("no end of headers".into()))?;
    let head = std::str::from_utf8(&raw[..split])
        .map_err(|_| Exchange::Malformed("headers are not UTF-8".into()))?;
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| Exchange::Malformed("no status line".into()))?;
    let chunked = lines.any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    let mut payload = raw[split + 4..].to_vec();
    if chunked {
        payload =
            dechunk(&payload).ok_or_else(|| Exchange::Malformed("bad chunked body".into()))?;
    }
    // Not JSON at all is a broken exchange (try again later); JSON of the
    // wrong shape is judged by the caller against its wire type.
    if !payload.is_empty() {
        serde_json::from_slice::<serde::de::IgnoredAny>(&payload)
            .map_err(|e| Exchange::Malformed(e.to_string()))?;
    }
    Ok((status, payload))
}

/// Parses a reply into its wire type (an empty body reads as `null`).
fn reply<R: DeserializeOwned>(payload: &[u8]) -> Result<R, serde_json::Error> {
    if payload.is_empty() {
        serde_json::from_str("null")
    } else {
        serde_json::from_slice(payload)
    }
}

/// Request bodies as trait objects, so GETs pass none.
mod erased {
    /// A request body: a wire type.
    pub(super) trait Body {
        /// Its JSON text.
        fn to_json(&self) -> String;
    }

    impl<T: super::Serialize> Body for T {
        fn to_json(&self) -> String {
            // Wire types are plain structs of strings, addresses and
            // numbers: serializing them cannot fail.
            serde_json::to_string(self).unwrap_or_default()
        }
    }
}

fn dechunk(mut data: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let eol = data.windows(2).position(|w| w == b"\r\n")?;
        let size_text = std::str::from_utf8(&data[..eol]).ok()?;
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        data = &data[eol + 2..];
        if size == 0 {
            return Some(out);
        }
        out.extend_from_slice(data.get(..size)?);
        data = data.get(size + 2..)?;
    }
}

/// The ADD (or CHECK) request for an invocation.
fn endpoint_request(req: &AttachmentRequest) -> EndpointRequest {
    EndpointRequest {
        container_id: req.attachment.container_id.as_str().to_string(),
        ifname: req.attachment.ifname.as_str().to_string(),
        // No CNI_NETNS (IPAM-only ADDs may lack one) is sent as "".
        netns: req.netns.clone().unwrap_or_default(),
        mode: match req.config.mode {
            PluginMode::Full => crate::store::EndpointMode::Full,
            PluginMode::Ipam => crate::store::EndpointMode::Ipam,
        },
        pool: req.config.pool().map(str::to_owned),
        requested: req.config.requested_ips.iter().map(|r| r.address).collect(),
        mtu: req.config.options.mtu,
        pod: req.args.pod(),
    }
}

/// The DEL request for an attachment.
fn del_request(req: &AttachmentRequest) -> DelRequest {
    DelRequest {
        container_id: req.attachment.container_id.as_str().to_string(),
        ifname: req.attachment.ifname.as_str().to_string(),
    }
}

fn fmt_mac(bytes: [u8; 6]) -> String {
    bytes
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// Turns the agent's answer into what a result needs; an answer that does
/// not parse, holds no address, or (full mode) names no host interface is
/// refused: a successful ADD with no address is worse than a failed one.
fn parse_add_reply(req: &AttachmentRequest, payload: &[u8]) -> Result<EndpointReply, PluginError> {
    let parsed: EndpointReply = reply(payload).map_err(|e| PluginError::BadReply {
        reason: "it does not parse",
        source: Some(e),
    })?;
    if parsed.addresses.is_empty() {
        return Err(PluginError::BadReply {
            reason: "it holds no address",
            source: None,
        });
    }
    if req.config.mode == PluginMode::Full
        && parsed
            .record
            .host_ifname
            .as_deref()
            .is_none_or(str::is_empty)
    {
        return Err(PluginError::BadReply {
            reason: "it names no host interface",
            source: None,
        });
    }
    Ok(parsed)
}

/// After an ADD the plugin cannot report, gives back what the agent
/// allocated (a DEL; a runtime sends one too after a failed ADD, and DEL
/// is idempotent). Returns `error`.
fn give_back(req: &AttachmentRequest, error: PluginError) -> PluginError {
    if let Err(e) = agent(
        &req.config.options,
        "POST",
        "/v1/cni/del",
        Some(&del_request(req)),
    ) {
        // The runtime's DEL after this failed ADD tries again.
        let _ = writeln!(
            std::io::stderr(),
            "lockstep: giving back the unusable ADD failed: {e}"
        );
    }
    error
}

fn add(req: &AttachmentRequest) -> Result<Value, PluginError> {
    // The full plugin makes interfaces inside CNI_NETNS: a namespace that is
    // gone means the container is gone (code 3), and the agent is not asked
    // for an address it would only have to take back.
    if req.config.mode == PluginMode::Full
        && let Some(netns) = &req.netns
        && std::fs::symlink_metadata(netns).is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound)
    {
        return Err(CniError::UnknownContainer {
            container_id: format!(
                "{} (its network namespace {} does not exist)",
                req.attachment.container_id,
                netns.display()
            ),
        }
        .into());
    }
    let reply = agent(
        &req.config.options,
        "POST",
        "/v1/cni/add",
        Some(&endpoint_request(req)),
    )?;
    let reply = parse_add_reply(req, &reply).map_err(|e| give_back(req, e))?;
    let version = req.config.cni_version;
    let dns = req.config.dns.clone().unwrap_or_default();
    let addresses = reply.addresses;
    match req.config.mode {
        PluginMode::Ipam => {
            let result = IpamResult {
                ips: addresses
                    .into_iter()
                    .map(|a| IpamAddress {
                        address: a.address,
                        gateway: a.gateway,
                    })
                    .collect(),
                routes: req.config.options.routes.clone(),
                dns,
            };
            Ok(result.to_json(version))
        }
        PluginMode::Full => {
            let record = reply.record;
            let host = Interface {
                name: record.host_ifname.unwrap_or_default(),
                mac: Some(fmt_mac(record.host_mac)),
                mtu: req.config.options.mtu,
                sandbox: None,
                socket_path: None,
                pci_id: None,
            };
            let container = Interface {
                name: req.attachment.ifname.as_str().to_string(),
                mac: Some(fmt_mac(record.mac)),
                mtu: req.config.options.mtu,
                sandbox: req.netns.as_ref().map(|p| p.display().to_string()),
                socket_path: None,
                pci_id: None,
            };
            let ips = addresses
                .into_iter()
                .map(|a| IpConfig {
                    address: a.address,
                    gateway: a.gateway,
                    interface: Some(1),
                })
                .collect();
            let routes = reply
                .routes
                .into_iter()
                .map(|(dst, gw)| Route::new(dst, gw))
                .collect();
            let result = CniResult {
                interfaces: vec![host, container],
                ips,
                routes,
                dns,
            };
            Ok(result.to_json(version))
        }
    }
}

/// Runs one invocation; returns what to print and the exit code.
pub fn invoke<I, K, V>(env: I, stdin: &[u8]) -> (Option<Value>, i32)
where
    I: IntoIterator<Item = (K, V)>,
    K: AsRef<std::ffi::OsStr>,
    V: AsRef<std::ffi::OsStr>,
{
    let version = cni::error_version(stdin);
    let invocation = match cni::parse_invocation(env, stdin) {
        Ok(i) => i,
        Err(e) => return (Some(e.to_json(version.as_str())), 1),
    };
    let version = invocation.cni_version();
    let outcome: Result<Option<Value>, PluginError> = match &invocation {
        Invocation::Version(v) => Ok(Some(v.response().to_json())),
        Invocation::Add(req) => add(req).map(Some),
        Invocation::Del(req) => agent(
            &req.config.options,
            "POST",
            "/v1/cni/del",
            Some(&del_request(req)),
        )
        .map(|_| None),
        Invocation::Check(req) => agent(
            &req.config.options,
            "POST",
            "/v1/cni/check",
            Some(&endpoint_request(req)),
        )
        .map(|_| None),
        Invocation::Gc(req) => {
            let valid: Vec<(String, String)> = req
                .valid_attachments
                .iter()
                .map(|a| {
                    (
                        a.container_id.as_str().to_string(),
                        a.ifname.as_str().to_string(),
                    )
                })
                .collect();
            agent(
                &req.config.options,
                "POST",
                "/v1/cni/gc",
                Some(&GcRequest { valid }),
            )
            .map(|_| None)
        }
        Invocation::Status(req) => status(&req.config.options, req.config.pool()).map(|_| None),
    };
    match outcome {
        Ok(out) => (out, 0),
        Err(e) => (Some(e.to_json(version)), 1),
    }
}

fn status(options: &LockstepOptions, pool: Option<&str>) -> Result<(), PluginError> {
    let unreadable = |what: &str, e: serde_json::Error| -> PluginError {
        CniError::PluginNotAvailable {
            reason: format!("the lockstep agent's {what} cannot be read: {e}"),
        }
        .into()
    };
    let st = agent(options, "GET", "/v1/status", None).map_err(|e| match e {
        PluginError::Cni(CniError::TryAgainLater { reason }) => {
            CniError::PluginNotAvailable { reason }.into()
        }
        other => other,
    })?;
    let st: Readiness = reply(&st).map_err(|e| unreadable("status", e))?;
    if !st.ready {
        return Err(CniError::PluginNotAvailable {
            reason: st.reason.unwrap_or_else(|| "not ready".into()),
        }
        .into());
    }
    // The pool an ADD would use: the one configured, else the agent's
    // default (summing every pool hid an exhausted default behind others).
    let pool = pool.map(str::to_owned).or(st.default_pool);
    let pools = agent(options, "GET", "/v1/pools", None)?;
    let pools: Vec<crate::agent::PoolStatus> =
        reply(&pools).map_err(|e| unreadable("pool list", e))?;
    let chosen = pools
        .iter()
        .find(|p| pool.as_deref().is_none_or(|name| p.name == name));
    let Some(chosen) = chosen else {
        return Err(CniError::PluginNotAvailable {
            reason: format!(
                "the agent has no pool {}",
                pool.as_deref().unwrap_or("at all")
            ),
        }
        .into());
    };
    // An ADD takes an address of every family the pool has: one family
    // with none free means no ADD can be served. In cluster mode a cluster
    // pool with no free address claims a block on demand while etcd
    // answers; etcd unreachable is 51 (existing endpoints keep working).
    let cluster = st.cluster.as_ref();
    let claims = cluster.and_then(|c| c.pools.iter().find(|p| p.name == chosen.name));
    let unreachable = cluster.is_some_and(|c| c.etcd_unreachable.is_some());
    for (family, (used, free)) in [("v4", chosen.v4), ("v6", chosen.v6)] {
        let exhausted = if let Some(p) = claims {
            let has = if family == "v4" { p.ipv4 } else { p.ipv6 };
            has && free == 0 && unreachable
        } else {
            used.saturating_add(free) > 0 && free == 0
        };
        if exhausted {
            return Err(CniError::PluginNotAvailable {
                reason: format!("pool {} has no free IP{family} address", chosen.name),
            }
            .into());
        }
    }
    if let Some(why) = cluster.and_then(|c| c.etcd_unreachable.clone()) {
        return Err(CniError::LimitedConnectivity {
            reason: format!("etcd is unreachable (new blocks cannot be claimed): {why}"),
        }
        .into());
    }
    Ok(())
}

/// Entry point when run by a container runtime: reads stdin, writes the
/// result (or error) to stdout, returns the exit code.
pub fn run() -> i32 {
    let stdin = match cni::read_stdin(std::io::stdin()) {
        Ok(b) => b,
        Err(e) => {
            println!("{}", e.to_json(CniVersion::LATEST.as_str()));
            return 1;
        }
    };
    let (out, code) = invoke(std::env::vars_os(), &stdin);
    if let Some(v) = out {
        let mut stdout = std::io::stdout().lock();
        let _ = writeln!(stdout, "{v}");
    }
    code
}

#[cfg(test)]
mod tests;
