//! Cluster-mode test plumbing: etcd listens on the test's loopback, and
//! each node namespace reaches it through a forwarder the test runs (a
//! listener made inside the namespace on the member's port, relayed to the
//! member's real socket).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};

use anyhow::Context;

use crate::Netns;
use crate::etcd::EtcdCluster;

/// Relays every member's port inside `node` to the member itself, for as
/// long as the test runs (the threads end with the process).
///
/// # Errors
/// A listener cannot be made inside `node`.
pub fn forward(node: &Netns, cluster: &EtcdCluster) -> anyhow::Result<()> {
    for ep in cluster.endpoints() {
        let port: u16 = ep.rsplit(':').next().context("port")?.parse()?;
        let listener = node.run(move || {
            let _ = std::process::Command::new("ip")
                .args(["link", "set", "lo", "up"])
                .status();
            Ok(TcpListener::bind(("127.0.0.1", port))?)
        })?;
        std::thread::spawn(move || {
            for inner in listener.incoming().flatten() {
                let Ok(outer) = TcpStream::connect(("127.0.0.1", port)) else {
                    continue;
                };
                let (Ok(mut a), Ok(mut b)) = (inner.try_clone(), outer.try_clone()) else {
                    continue;
                };
                let (mut c, mut d) = (outer, inner);
                std::thread::spawn(move || pipe(&mut a, &mut b));
                std::thread::spawn(move || pipe(&mut c, &mut d));
            }
        });
    }
    Ok(())
}

fn pipe(from: &mut TcpStream, to: &mut TcpStream) {
    let mut buf = [0u8; 16384];
    while let Ok(n) = from.read(&mut buf) {
        if n == 0 || to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Both);
}

/// The `[cluster]` config of an agent named `node` under `prefix`, with
/// `node_ip_v4` as its underlay address.
pub fn cluster_config(eps: &[String], prefix: &str, node: &str, node_ip_v4: &str) -> String {
    format!(
        "pools = []\n[cluster]\netcd = [{}]\nprefix = \"{prefix}\"\nnode_name = \"{node}\"\nnode_ip_v4 = \"{node_ip_v4}\"\n",
        eps.iter()
            .map(|e| format!("\"{e}\""))
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// One call of the CNI plugin (`command` ADD, CHECK or DEL) against the
/// agent at `socket` for container `id` in `netns`, as a runtime makes it:
/// the time it took and its answer (stdout as JSON, `Null` when empty).
///
/// # Errors
/// The plugin did not run, or exited non-zero (the error carries its
/// answer).
pub fn cni(
    socket: &std::path::Path,
    command: &str,
    id: &str,
    netns: &std::path::Path,
) -> anyhow::Result<(std::time::Duration, serde_json::Value)> {
    let conf = serde_json::json!({
        "cniVersion": "1.1.0",
        "name": "cluster",
        "type": "lockstep",
        "agentSocket": socket.display().to_string(),
    });
    let started = std::time::Instant::now();
    let mut child = std::process::Command::new(crate::lockstep_bin())
        .env_clear()
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", id)
        .env("CNI_IFNAME", "eth0")
        .env("CNI_NETNS", netns)
        .env("CNI_PATH", "/opt/cni/bin")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    child
        .stdin
        .take()
        .context("stdin")?
        .write_all(conf.to_string().as_bytes())?;
    let out = child.wait_with_output()?;
    let took = started.elapsed();
    let text = String::from_utf8_lossy(&out.stdout);
    anyhow::ensure!(
        out.status.success(),
        "{command} {id}: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = if text.trim().is_empty() {
        serde_json::Value::Null
    } else {
        serde_json::from_str(&text).with_context(|| format!("plugin stdout {text:?}"))?
    };
    Ok((took, v))
}
