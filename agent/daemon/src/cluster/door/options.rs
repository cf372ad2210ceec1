//! How the door reaches etcd: endpoints, prefix, time bound and TLS files.

use std::path::{Path, PathBuf};
use std::time::Duration;

use etcd_client::{Certificate, Identity, TlsOptions};

use super::super::ClusterStoreError;

/// How the door reaches etcd.
#[derive(Clone, Debug)]
pub struct DoorOptions {
    /// Client URLs of the etcd members (`http://127.0.0.1:2379`).
    pub endpoints: Vec<String>,
    /// Key prefix, ending in `/` (default `/lockstep/v1/`).
    pub prefix: String,
    /// Bound on every request, connection included.
    pub timeout: Duration,
    /// TLS to etcd (`https://` endpoints), or `None` for plain `http://`.
    pub tls: Option<TlsFiles>,
    /// The agent instance the door writes block records as, and tells
    /// its own claims by (#26 item 5); `None` (operators' tools): block
    /// records name the node only.
    pub instance: Option<String>,
    /// The connection and watch-fed mirror the agent's tasks share
    /// (#27 item 6): a door made with it uses the shared connection and
    /// answers its listings from the mirror while it is live. `None`
    /// (operators' tools, tests of one door): a connection of its own,
    /// every listing read from etcd.
    pub link: Option<super::super::mirror::Link>,
}

/// The PEM files of TLS to etcd: the CA that signed etcd's serving
/// certificates and, when etcd checks clients (`--client-cert-auth`), the
/// agent's own certificate and key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// CA certificate(s) trusted for etcd's server certificates.
    pub ca: PathBuf,
    /// Client certificate; given with `key` or not at all.
    pub cert: Option<PathBuf>,
    /// The client certificate's private key.
    pub key: Option<PathBuf>,
}

impl TlsFiles {
    /// Reads and checks the files: each must exist and hold the PEM block
    /// it should, and a certificate comes with its key.
    ///
    /// # Errors
    /// [`ClusterStoreError::Invalid`] naming the option and the file.
    pub fn load(&self) -> Result<TlsOptions, ClusterStoreError> {
        let ca = read_pem("cluster.tls.ca", &self.ca, "CERTIFICATE")?;
        let mut tls = TlsOptions::new().ca_certificate(Certificate::from_pem(ca));
        match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => {
                let cert = read_pem("cluster.tls.cert", cert, "CERTIFICATE")?;
                let key = read_pem("cluster.tls.key", key, "PRIVATE KEY")?;
                tls = tls.identity(Identity::from_pem(cert, key));
            }
            (None, None) => {}
            (Some(_), None) => {
                return Err(ClusterStoreError::Invalid(
                    "cluster.tls.cert is given without cluster.tls.key".into(),
                ));
            }
            (None, Some(_)) => {
                return Err(ClusterStoreError::Invalid(
                    "cluster.tls.key is given without cluster.tls.cert".into(),
                ));
            }
        }
        Ok(tls)
    }
}

/// The bytes of a PEM file that must hold a `-----BEGIN ...{kind}-----`
/// block.
fn read_pem(option: &str, path: &Path, kind: &str) -> Result<Vec<u8>, ClusterStoreError> {
    let bytes = std::fs::read(path)
        .map_err(|e| ClusterStoreError::Invalid(format!("{option} {}: {e}", path.display())))?;
    let text = String::from_utf8_lossy(&bytes);
    let found = text
        .lines()
        .any(|l| l.starts_with("-----BEGIN ") && l.ends_with(&format!("{kind}-----")));
    if !found {
        return Err(ClusterStoreError::Invalid(format!(
            "{option} {}: no PEM {kind} in it",
            path.display()
        )));
    }
    Ok(bytes)
}

impl DoorOptions {
    /// Options with the default prefix and a 2 s bound.
    pub fn new(endpoints: Vec<String>) -> Self {
        DoorOptions {
            endpoints,
            prefix: "/lockstep/v1/".to_string(),
            timeout: Duration::from_secs(2),
            tls: None,
            instance: None,
            link: None,
        }
    }

    /// Options from the `[cluster]` section (endpoints, prefix, TLS
    /// files), each request bounded by `timeout`: the agent's tasks (node,
    /// remote routes, LB) share it, each with its own bound.
    pub fn from_cluster_config(cluster: &crate::config::ClusterConfig, timeout: Duration) -> Self {
        DoorOptions {
            endpoints: cluster.etcd.clone(),
            prefix: cluster.prefix.clone(),
            timeout,
            tls: cluster.tls.as_ref().map(|t| TlsFiles {
                ca: t.ca.clone(),
                cert: t.cert.clone(),
                key: t.key.clone(),
            }),
            instance: None,
            link: None,
        }
    }
}
