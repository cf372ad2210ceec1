//! Pods as kubelet makes them, for the tests of #29 (`kubernetes_pods`,
//! `kubernetes_pools`): namespaces and pods in the API double (with the
//! pool annotation), and the CNI ADD and DEL kubelet sends for a pod's
//! sandbox (`CNI_ARGS` naming the pod), through the real plugin.

use std::net::IpAddr;

use anyhow::{Context, ensure};
use serde_json::{Value, json};

use crate::cluster::{address_of, cni_with_args};
use crate::kube_lab::KubeLab;
use crate::{AgentProc, Netns, unique};

/// The pool annotation naming `pool`, or none.
fn annotations(pool: Option<&str>) -> Value {
    pool.map_or(json!({}), |p| json!({"lockstep.io/ip-pool": p}))
}

/// Creates namespace `name`, annotated for `pool` when given.
///
/// # Errors
/// The double refused it.
pub fn namespace(lab: &KubeLab, name: &str, pool: Option<&str>) -> anyhow::Result<()> {
    lab.api.create(
        "namespaces",
        "",
        &json!({"metadata": {"name": name, "annotations": annotations(pool)}}),
    )?;
    Ok(())
}

/// Creates pod `ns/name` bound to node `node` (`node-<node>`), annotated
/// for `pool` when given; returns its UID.
///
/// # Errors
/// The double refused it.
pub fn pod(
    lab: &KubeLab,
    ns: &str,
    name: &str,
    node: usize,
    pool: Option<&str>,
) -> anyhow::Result<String> {
    let v = lab.api.create(
        "pods",
        ns,
        &json!({
            "metadata": {"namespace": ns, "name": name, "annotations": annotations(pool)},
            "spec": {"nodeName": format!("node-{node}"), "containers": [{"name": "c", "image": "x"}]},
        }),
    )?;
    Ok(v["metadata"]["uid"].as_str().context("uid")?.to_string())
}

/// A pod sandbox: its network namespace and container ID.
pub struct Sandbox {
    /// The sandbox's network namespace (deleted when dropped).
    pub netns: Netns,
    /// The container ID its CNI calls name.
    pub id: String,
}

/// Kubelet's ADD of `ns/name` (UID `uid`) on `agent`: the sandbox, the
/// plugin's exit code and its answer.
///
/// # Errors
/// The namespace could not be made or the plugin not run.
pub fn add(
    agent: &AgentProc,
    ns: &str,
    name: &str,
    uid: Option<&str>,
) -> anyhow::Result<(Sandbox, i32, Value)> {
    let netns = Netns::new("kpod")?;
    let id = unique("pod");
    let mut args = format!("IgnoreUnknown=1;K8S_POD_NAMESPACE={ns};K8S_POD_NAME={name}");
    if let Some(uid) = uid {
        args.push_str(&format!(";K8S_POD_UID={uid}"));
    }
    let (code, v, _) = cni_with_args(
        &agent.socket(),
        "ADD",
        Some((&id, &netns.path())),
        Some(&args),
    )?;
    Ok((Sandbox { netns, id }, code, v))
}

/// [`add`] that must succeed: the sandbox and its address.
///
/// # Errors
/// The ADD failed (its answer in the error).
pub fn add_ok(
    agent: &AgentProc,
    ns: &str,
    name: &str,
    uid: Option<&str>,
) -> anyhow::Result<(Sandbox, IpAddr)> {
    let (sb, code, v) = add(agent, ns, name, uid)?;
    ensure!(code == 0, "ADD {ns}/{name}: {v}");
    Ok((sb, address_of(&v)?))
}

/// Kubelet's DEL of `sb` on `agent`, which must succeed.
///
/// # Errors
/// The DEL failed.
pub fn del(agent: &AgentProc, sb: &Sandbox) -> anyhow::Result<()> {
    let (code, v, _) = cni_with_args(
        &agent.socket(),
        "DEL",
        Some((&sb.id, &sb.netns.path())),
        None,
    )?;
    ensure!(code == 0, "DEL {}: {v}", sb.id);
    Ok(())
}
