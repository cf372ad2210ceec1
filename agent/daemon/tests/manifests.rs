//! The config each DaemonSet manifest ships in its ConfigMap is one the agent
//! accepts: `Config::parse` (which refuses unknown keys and tables) on the
//! `config.toml` block of `deploy/daemonset*.yaml`. The manifests' schema is
//! checked by `cargo xtask validate-manifests`; this checks their content.

use std::path::Path;

use lockstep::config::Config;

/// The `config.toml: |` block scalar of a manifest, de-indented.
fn config_block(manifest: &str) -> Option<String> {
    let mut lines = manifest
        .lines()
        .skip_while(|l| l.trim() != "config.toml: |");
    let header = lines.next()?;
    let key_indent = header.len() - header.trim_start().len();
    let mut body = Vec::new();
    let mut indent = None;
    for line in lines {
        if line.trim().is_empty() {
            body.push(String::new());
            continue;
        }
        let this = line.len() - line.trim_start().len();
        if this <= key_indent {
            break;
        }
        let indent = *indent.get_or_insert(this);
        body.push(line.get(indent..).unwrap_or_default().to_string());
    }
    Some(body.join("\n"))
}

fn check(name: &str) -> Config {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../deploy")
        .join(name);
    let text = std::fs::read_to_string(&path).expect("manifest");
    let config = config_block(&text).expect("a config.toml block");
    Config::parse(&path, &config).unwrap_or_else(|e| panic!("{name}: {e}"))
}

#[test]
fn single_node_manifest_config_is_accepted() {
    let c = check("daemonset.yaml");
    assert!(c.cni.install, "the DaemonSet installs its plugin");
    assert_eq!(c.socket, Path::new("/run/lockstep/lockstep.sock"));
    assert_eq!(c.pools.len(), 1);
}

#[test]
fn cluster_manifest_config_is_accepted_in_cluster_mode() {
    let c = check("daemonset-cluster.yaml");
    let cluster = c.cluster.expect("the cluster manifest runs cluster mode");
    assert_eq!(cluster.etcd.len(), 3);
    assert!(
        cluster
            .tls
            .is_some_and(|t| t.cert.is_some() && t.key.is_some())
    );
    assert!(c.pools.is_empty(), "pools come from etcd");
    assert_eq!(c.datapath.uplink.as_deref(), Some("eth0"));
}
