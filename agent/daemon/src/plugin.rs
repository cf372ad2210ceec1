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

use serde_json::{Value, json};

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

fn agent(
    options: &LockstepOptions,
    method: &str,
    path: &str,
    body: Option<Value>,
) -> Result<Value, PluginError> {
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
    let (status, value) =
        exchange(socket, deadline, method, path, body.as_ref()).map_err(|e| match e {
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
        return Ok(value);
    }
    let code = value["error"]["code"]
        .as_str()
        .unwrap_or("unknown")
        .to_string();
    let message = value["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    Err(match code.as_str() {
        "not_ready" => CniError::TryAgainLater {
            reason: "the lockstep agent is restoring its state".into(),
        }
        .into(),
        "busy" => CniError::TryAgainLater { reason: message }.into(),
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
    body: Option<&Value>,
) -> Result<(u16, Value), Exchange> {
    use std::io::Read;
    let started = std::time::Instant::now();
    let mut stream = std::os::unix::net::UnixStream::connect(socket).map_err(Exchange::Connect)?;
    let body = body.map(Value::to_string).unwrap_or_default();
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
    let value = if payload.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&payload).map_err(|e| Exchange::Malformed(e.to_string()))?
    };
    Ok((status, value))
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

fn mode(req: &AttachmentRequest) -> &'static str {
    match req.config.mode {
        PluginMode::Full => "full",
        PluginMode::Ipam => "ipam",
    }
}

fn endpoint_body(req: &AttachmentRequest) -> Value {
    json!({
        "container_id": req.attachment.container_id.as_str(),
        "ifname": req.attachment.ifname.as_str(),
        "netns": req.netns.as_ref().map(|p| p.display().to_string()).unwrap_or_default(),
        "mode": mode(req),
        "pool": req.config.pool(),
        "requested": req.config.requested_ips.iter().map(|r| r.address).collect::<Vec<_>>(),
        "mtu": req.config.options.mtu,
    })
}

fn fmt_mac(v: &Value) -> Option<String> {
    let bytes: Vec<u64> = v.as_array()?.iter().filter_map(Value::as_u64).collect();
    (bytes.len() == 6).then(|| {
        bytes
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<Vec<_>>()
            .join(":")
    })
}

/// The agent's answer to ADD, as far as the plugin uses it (unknown fields
/// are ignored, so an agent newer than the plugin still works).
#[derive(Debug, serde::Deserialize)]
struct AddReply {
    addresses: Vec<crate::agent::endpoints::EndpointAddress>,
    #[serde(default)]
    routes: Vec<(ipnet::IpNet, Option<std::net::IpAddr>)>,
    #[serde(default)]
    record: Option<AddRecord>,
}

/// The interface part of a full ADD's answer.
#[derive(Debug, Default, serde::Deserialize)]
struct AddRecord {
    #[serde(default)]
    host_ifname: Option<String>,
    #[serde(default)]
    host_mac: Option<[u8; 6]>,
    #[serde(default)]
    mac: Option<[u8; 6]>,
}

/// Turns the agent's answer into what a result needs; an answer that does
/// not parse, holds no address, or (full mode) names no host interface is
/// refused: a successful ADD with no address is worse than a failed one.
fn parse_add_reply(req: &AttachmentRequest, reply: Value) -> Result<AddReply, PluginError> {
    let parsed: AddReply = serde_json::from_value(reply).map_err(|e| PluginError::BadReply {
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
            .as_ref()
            .and_then(|r| r.host_ifname.as_deref())
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
        Some(json!({
            "container_id": req.attachment.container_id.as_str(),
            "ifname": req.attachment.ifname.as_str(),
        })),
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
        Some(endpoint_body(req)),
    )?;
    let reply = parse_add_reply(req, reply).map_err(|e| give_back(req, e))?;
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
            let record = reply.record.unwrap_or_default();
            let host = Interface {
                name: record.host_ifname.unwrap_or_default(),
                mac: record
                    .host_mac
                    .map(|m| fmt_mac(&json!(m)))
                    .unwrap_or_default(),
                mtu: req.config.options.mtu,
                sandbox: None,
                socket_path: None,
                pci_id: None,
            };
            let container = Interface {
                name: req.attachment.ifname.as_str().to_string(),
                mac: record.mac.map(|m| fmt_mac(&json!(m))).unwrap_or_default(),
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
            Some(json!({
                "container_id": req.attachment.container_id.as_str(),
                "ifname": req.attachment.ifname.as_str(),
            })),
        )
        .map(|_| None),
        Invocation::Check(req) => agent(
            &req.config.options,
            "POST",
            "/v1/cni/check",
            Some(endpoint_body(req)),
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
                Some(json!({ "valid": valid })),
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
    let st = agent(options, "GET", "/v1/status", None).map_err(|e| match e {
        PluginError::Cni(CniError::TryAgainLater { reason }) => {
            CniError::PluginNotAvailable { reason }.into()
        }
        other => other,
    })?;
    if st["ready"] != true {
        return Err(CniError::PluginNotAvailable {
            reason: st["reason"].as_str().unwrap_or("not ready").to_string(),
        }
        .into());
    }
    // The pool an ADD would use: the one configured, else the agent's
    // default (summing every pool hid an exhausted default behind others).
    let pool = pool
        .map(str::to_owned)
        .or_else(|| st["default_pool"].as_str().map(str::to_owned));
    let pools = agent(options, "GET", "/v1/pools", None)?;
    let chosen = pools
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| pool.as_deref().is_none_or(|name| p["name"] == name));
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
    // with none free means no ADD can be served.
    for family in ["v4", "v6"] {
        let (used, free) = (
            chosen[family][0].as_u64().unwrap_or(0),
            chosen[family][1].as_u64().unwrap_or(0),
        );
        if used + free > 0 && free == 0 {
            return Err(CniError::PluginNotAvailable {
                reason: format!(
                    "pool {} has no free IP{family} address",
                    chosen["name"].as_str().unwrap_or("?")
                ),
            }
            .into());
        }
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
mod tests {
    use super::*;

    #[test]
    fn an_unreachable_agent_is_try_again_later() {
        let stdin = br#"{"cniVersion":"1.0.0","name":"n","type":"lockstep","agentSocket":"/nonexistent/lockstep.sock"}"#;
        let env = [
            ("CNI_COMMAND", "ADD"),
            ("CNI_CONTAINERID", "abc"),
            ("CNI_NETNS", "/proc/self/ns/net"),
            ("CNI_IFNAME", "eth0"),
            ("CNI_PATH", "/opt/cni/bin"),
        ];
        let (out, code) = invoke(env, stdin);
        assert_eq!(code, 1);
        let out = out.expect("an error object");
        assert_eq!(out["code"], 11, "{out}");
        assert!(
            out["msg"]
                .as_str()
                .unwrap_or_default()
                .contains("/nonexistent/lockstep.sock"),
            "{out}"
        );
        assert!(
            out["msg"]
                .as_str()
                .unwrap_or_default()
                .contains("is it running"),
            "{out}"
        );
    }

    #[test]
    fn status_with_no_agent_is_not_available() {
        let stdin = br#"{"cniVersion":"1.1.0","name":"n","type":"lockstep","agentSocket":"/nonexistent/lockstep.sock"}"#;
        let (out, code) = invoke([("CNI_COMMAND", "STATUS")], stdin);
        assert_eq!(code, 1);
        assert_eq!(out.expect("error")["code"], 50);
    }

    /// A fake agent on a unix socket in a fresh directory: `serve` runs on
    /// every accepted connection, in its own thread.
    fn fake_agent(
        serve: impl Fn(std::os::unix::net::UnixStream) + Send + Sync + 'static,
    ) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("agent.sock");
        let listener = std::os::unix::net::UnixListener::bind(&socket).expect("bind");
        let serve = std::sync::Arc::new(serve);
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let serve = serve.clone();
                std::thread::spawn(move || serve(stream));
            }
        });
        (dir, socket)
    }

    fn add_env() -> [(&'static str, &'static str); 5] {
        [
            ("CNI_COMMAND", "ADD"),
            ("CNI_CONTAINERID", "abc"),
            ("CNI_NETNS", "/proc/self/ns/net"),
            ("CNI_IFNAME", "eth0"),
            ("CNI_PATH", "/opt/cni/bin"),
        ]
    }

    #[test]
    fn an_agent_that_accepts_and_never_answers_is_try_again_later_by_the_deadline() {
        let (_dir, socket) = fake_agent(|stream| {
            // Hold the connection open, answer nothing.
            std::thread::sleep(std::time::Duration::from_secs(30));
            drop(stream);
        });
        let stdin = format!(
            r#"{{"cniVersion":"1.0.0","name":"n","type":"lockstep","agentSocket":"{}","agentTimeout":1}}"#,
            socket.display()
        );
        let started = std::time::Instant::now();
        let (out, code) = invoke(add_env(), stdin.as_bytes());
        let took = started.elapsed();
        assert!(took < std::time::Duration::from_secs(5), "took {took:?}");
        assert_eq!(code, 1);
        let out = out.expect("an error object");
        assert_eq!(out["code"], 11, "{out}");
        assert!(
            out["msg"]
                .as_str()
                .unwrap_or_default()
                .contains("did not answer within"),
            "{out}"
        );
    }

    #[test]
    fn an_oversized_reply_is_an_error_not_a_result() {
        let (_dir, socket) = fake_agent(|mut stream| {
            use std::io::Read as _;
            let mut buf = [0u8; 4096];
            let _ = stream.read(&mut buf);
            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n[");
            let filler = vec![b' '; 64 * 1024];
            // 200 MiB unless the plugin hangs up first.
            for _ in 0..3200 {
                if stream.write_all(&filler).is_err() {
                    return;
                }
            }
        });
        let stdin = format!(
            r#"{{"cniVersion":"1.0.0","name":"n","type":"lockstep","agentSocket":"{}"}}"#,
            socket.display()
        );
        let (out, code) = invoke(add_env(), stdin.as_bytes());
        assert_eq!(code, 1);
        let out = out.expect("an error object");
        assert_eq!(out["code"], 11, "{out}");
        assert!(
            out["msg"]
                .as_str()
                .unwrap_or_default()
                .contains("larger than"),
            "{out}"
        );
    }

    /// A fake agent that answers every request with `body` (status 200),
    /// and counts the DELs it gets.
    fn answering(
        body: &'static str,
    ) -> (
        tempfile::TempDir,
        std::path::PathBuf,
        std::sync::Arc<std::sync::atomic::AtomicUsize>,
    ) {
        let dels = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let seen = dels.clone();
        let (dir, socket) = fake_agent(move |mut stream| {
            use std::io::Read as _;
            let mut buf = [0u8; 4096];
            let n = stream.read(&mut buf).unwrap_or(0);
            if buf[..n].starts_with(b"POST /v1/cni/del") {
                seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
        });
        (dir, socket, dels)
    }

    #[test]
    fn an_add_reply_without_usable_addresses_is_an_error_and_is_given_back() {
        for (mode, body) in [
            ("lockstep-ipam", r#"{"unexpected":true}"#),
            ("lockstep-ipam", r#"{"addresses":"10.0.0.2/24"}"#),
            ("lockstep-ipam", r#"{"addresses":[],"routes":[]}"#),
            // One good address beside one that does not parse: the whole
            // answer is refused, never a result with the good one alone.
            (
                "lockstep-ipam",
                r#"{"addresses":[{"address":"10.0.0.2/24","gateway":null},{"address":"10.0.0.300/24","gateway":null}],"routes":[]}"#,
            ),
            (
                "lockstep-ipam",
                r#"{"addresses":[{"address":"10.0.0.2/24","gateway":null},{"address":"fd00::2","gateway":null}],"routes":[]}"#,
            ),
            (
                "lockstep-ipam",
                r#"{"addresses":[{"address":"10.0.0.2/24","gateway":"10.0.0.x"}],"routes":[]}"#,
            ),
            (
                "lockstep-ipam",
                r#"{"addresses":[{"address":"10.0.0.2/24","gateway":null}],"routes":[["0.0.0.0/0",null],["bogus",null]]}"#,
            ),
            (
                "lockstep",
                r#"{"addresses":[{"address":"10.0.0.2/32","gateway":null}],"routes":[],"record":{"host_ifname":"ls1","host_mac":[1,2,3,4,5,256],"mac":[1,2,3,4,5,6]}}"#,
            ),
            (
                "lockstep",
                r#"{"addresses":[{"address":"10.0.0.2/32","gateway":null}],"routes":[],"record":{}}"#,
            ),
        ] {
            let (_dir, socket, dels) = answering(body);
            let stdin = if mode == "lockstep" {
                format!(
                    r#"{{"cniVersion":"1.0.0","name":"n","type":"lockstep","agentSocket":"{}"}}"#,
                    socket.display()
                )
            } else {
                format!(
                    r#"{{"cniVersion":"1.0.0","name":"n","type":"bridge","ipam":{{"type":"lockstep-ipam","agentSocket":"{}"}}}}"#,
                    socket.display()
                )
            };
            let (out, code) = invoke(add_env(), stdin.as_bytes());
            let out = out.expect("an error object");
            assert_eq!(code, 1, "{body}: {out}");
            assert_eq!(out["code"], BAD_AGENT_REPLY, "{body}: {out}");
            assert_eq!(
                dels.load(std::sync::atomic::Ordering::SeqCst),
                1,
                "{body}: the allocation is given back"
            );
        }
    }

    #[test]
    fn a_well_formed_add_reply_is_a_result() {
        let (_dir, socket, dels) = answering(
            r#"{"addresses":[{"address":"10.0.0.2/24","gateway":"10.0.0.1"}],"routes":[],"record":{"new_field":1}}"#,
        );
        let stdin = format!(
            r#"{{"cniVersion":"1.0.0","name":"n","type":"bridge","ipam":{{"type":"lockstep-ipam","agentSocket":"{}"}}}}"#,
            socket.display()
        );
        let (out, code) = invoke(add_env(), stdin.as_bytes());
        let out = out.expect("a result");
        assert_eq!(code, 0, "{out}");
        assert_eq!(out["ips"][0]["address"], "10.0.0.2/24", "{out}");
        assert_eq!(dels.load(std::sync::atomic::Ordering::SeqCst), 0);
    }

    #[test]
    fn agent_timeout_is_checked() {
        for bad in ["0", "601", "\"30s\""] {
            let stdin = format!(
                r#"{{"cniVersion":"1.0.0","name":"n","type":"lockstep","agentTimeout":{bad}}}"#
            );
            let (out, code) = invoke(add_env(), stdin.as_bytes());
            assert_eq!(code, 1, "{bad}");
            let out = out.expect("an error object");
            assert!(
                out["msg"]
                    .as_str()
                    .unwrap_or_default()
                    .contains("agentTimeout")
                    || out["details"]
                        .as_str()
                        .unwrap_or_default()
                        .contains("agentTimeout"),
                "{bad}: {out}"
            );
        }
    }

    #[test]
    fn chunked_bodies_are_decoded() {
        assert_eq!(
            dechunk(b"4\r\nWiki\r\n5\r\npedia\r\n0\r\n\r\n").as_deref(),
            Some(&b"Wikipedia"[..])
        );
        assert_eq!(dechunk(b"zz\r\n"), None);
        assert_eq!(dechunk(b"5\r\nab"), None);
    }

    #[test]
    fn version_needs_no_agent() {
        let (out, code) = invoke([("CNI_COMMAND", "VERSION")], br#"{"cniVersion":"0.4.0"}"#);
        assert_eq!(code, 0);
        let out = out.expect("version info");
        assert!(
            out["supportedVersions"]
                .as_array()
                .is_some_and(|v| v.len() == 4),
            "{out}"
        );
    }
}
