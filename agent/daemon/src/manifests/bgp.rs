//! The BGP part of an install (`--bgp-asn`, #48): the agent's `[bgp]`
//! section, and a DaemonSet of its own, `lockstep-bgp`, running BIRD and
//! `lockstep bird-keeper` on every node.
//!
//! Why apart from the agent's DaemonSet: a DaemonSet rollout replaces the
//! whole pod. With BIRD in the agent's pod, every agent upgrade would
//! restart BIRD and reset every session; in a DaemonSet of its own, BIRD
//! and its sessions outlive the agent's upgrades, and the keeper (in
//! BIRD's pod, not the agent's) withdraws the node's LoadBalancer
//! addresses when the agent stays silent. The two pods share the host
//! directory `/run/lockstep/bird`: BIRD's configuration (the agent writes
//! it), its control socket, and the agent's beat.

use std::net::IpAddr;
use std::str::FromStr;

use serde_json::{Value, json};

/// Where BIRD's files live on the node (the `[bgp]` defaults).
pub const BIRD_DIR: &str = "/run/lockstep/bird";

/// BIRD's capabilities, each with why; everything else is dropped.
pub const BIRD_CAPABILITIES: &[(&str, &str)] = &[
    ("NET_BIND_SERVICE", "listen on BGP's port, 179"),
    (
        "NET_RAW",
        "bind BFD's sockets to their interface (SO_BINDTODEVICE)",
    ),
    (
        "NET_ADMIN",
        "mark BGP and BFD packets as network control (socket priority 7)",
    ),
];

/// One `--bgp-peer NAME,ADDRESS,ASN`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerFlag {
    /// The session's name.
    pub name: String,
    /// The router's address.
    pub address: IpAddr,
    /// The router's AS number.
    pub asn: u32,
}

impl FromStr for PeerFlag {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let parts: Vec<&str> = s.split(',').map(str::trim).collect();
        let [name, address, asn] = parts[..] else {
            return Err(format!("{s:?} is not NAME,ADDRESS,ASN"));
        };
        Ok(Self {
            name: name.to_string(),
            address: address
                .parse()
                .map_err(|_| format!("{address:?} in {s:?} is not an IP address"))?,
            asn: asn
                .parse()
                .map_err(|_| format!("{asn:?} in {s:?} is not an AS number"))?,
        })
    }
}

/// What the BGP flags chose.
#[derive(Clone, Debug)]
pub struct BgpInstall {
    /// The nodes' AS number.
    pub asn: u32,
    /// The routers every node peers with.
    pub peers: Vec<PeerFlag>,
    /// The LoadBalancerIPPools announced.
    pub pools: Vec<String>,
    /// An image with BIRD 2 (`bird`) and a shell.
    pub bird_image: String,
}

impl BgpInstall {
    /// The agent's `[bgp]` section: no router ID (each node's Node's
    /// InternalIP), no source address (BIRD picks the link's).
    pub fn config_section(&self) -> String {
        let mut t = format!(
            "\n[bgp]                                      # docs/bgp.md; router_id: the Node's InternalIP\nasn = {}\n",
            self.asn
        );
        for p in &self.peers {
            t += &format!(
                "\n[[bgp.peers]]\nname = {:?}\naddress = \"{}\"\nasn = {}\n",
                p.name, p.address, p.asn
            );
        }
        for pool in &self.pools {
            t += &format!("\n[bgp.pools.{pool:?}]\n");
        }
        t
    }

    /// The `lockstep-bgp` DaemonSet in `namespace`, the keeper running
    /// `image` (the agent's) with the ConfigMap whose `[bgp]` part hashes to
    /// `checksum`.
    pub fn daemonset(&self, namespace: &str, image: &str, checksum: &str) -> Value {
        let labels =
            json!({"app.kubernetes.io/name": "lockstep-bgp", "app.kubernetes.io/component": "bgp"});
        let dir = json!({"name": "bird", "mountPath": BIRD_DIR});
        let locked = |caps: Vec<&str>| {
            json!({
                "privileged": false,
                "allowPrivilegeEscalation": false,
                "readOnlyRootFilesystem": true,
                "runAsUser": 0,
                "capabilities": {"drop": ["ALL"], "add": caps},
                "seccompProfile": {"type": "RuntimeDefault"},
            })
        };
        // BIRD starts from the file the agent writes: it waits for it.
        // Stopped for a rollout with `graceful restart` (preStop) and
        // started in recovery (`-R`), the routers keep the node's routes
        // meanwhile (docs/bgp.md, "Restart BIRD without losing routes").
        let start = format!(
            "until [ -e {BIRD_DIR}/bird.conf ]; do sleep 1; done; \
             exec bird -R -f -c {BIRD_DIR}/bird.conf -s {BIRD_DIR}/bird.ctl"
        );
        let graceful = json!({"exec": {"command": [
            "birdc", "-s", format!("{BIRD_DIR}/bird.ctl"), "graceful", "restart",
        ]}});
        let bird = json!({
            "name": "bird",
            "image": self.bird_image,
            "imagePullPolicy": "IfNotPresent",
            "command": ["sh", "-c", start],
            "lifecycle": {"preStop": graceful},
            "securityContext": locked(BIRD_CAPABILITIES.iter().map(|(c, _)| *c).collect()),
            "resources": {"requests": {"cpu": "20m", "memory": "32Mi"}, "limits": {"memory": "256Mi"}},
            "volumeMounts": [dir],
        });
        let keeper = json!({
            "name": "bird-keeper",
            "image": image,
            "imagePullPolicy": "IfNotPresent",
            "args": ["bird-keeper", "--config", "/etc/lockstep/config.toml", "--log-json"],
            "securityContext": locked(Vec::new()),
            "resources": {"requests": {"cpu": "5m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}},
            "volumeMounts": [
                {"name": "config", "mountPath": "/etc/lockstep", "readOnly": true},
                dir,
            ],
        });
        json!({
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": {"name": "lockstep-bgp", "namespace": namespace, "labels": labels},
            "spec": {
                "selector": {"matchLabels": {"app.kubernetes.io/name": "lockstep-bgp"}},
                "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}},
                "template": {
                    "metadata": {
                        "labels": labels,
                        "annotations": {"lockstep.io/bgp-config-sha256": checksum},
                    },
                    "spec": {
                        "hostNetwork": true,
                        "dnsPolicy": "ClusterFirstWithHostNet",
                        "priorityClassName": "system-node-critical",
                        "tolerations": [{"operator": "Exists"}],
                        "automountServiceAccountToken": false,
                        // BIRD's graceful restart keeps the routers'
                        // routes while it stops: let it close cleanly.
                        "terminationGracePeriodSeconds": 30,
                        "containers": [bird, keeper],
                        "volumes": [
                            {"name": "config", "configMap": {"name": "lockstep-config"}},
                            {"name": "bird", "hostPath": {"path": BIRD_DIR, "type": "DirectoryOrCreate"}},
                        ],
                    },
                },
            },
        })
    }

    /// The DaemonSet's comment in the rendered stream.
    pub fn comment() -> String {
        let caps = BIRD_CAPABILITIES
            .iter()
            .map(|(c, why)| format!("- {c}: {why}"))
            .collect::<Vec<_>>()
            .join("\n");
        format!(
            "BGP (docs/bgp.md): BIRD and lockstep bird-keeper on every node, apart from the\n\
             agent so an agent upgrade leaves BIRD's sessions up. They share {BIRD_DIR}\n\
             with the agent: BIRD's configuration (the agent writes it), its socket, the\n\
             agent's beat. The keeper withdraws the node's LoadBalancer addresses when the\n\
             agent is silent for [bgp] withdraw_after. BIRD's capabilities:\n{caps}\n\
             The keeper has none and no API access."
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_flag_reads_name_address_and_as_and_names_what_is_wrong() {
        assert_eq!(
            "tor-a, 192.0.2.1, 64513".parse::<PeerFlag>(),
            Ok(PeerFlag {
                name: "tor-a".into(),
                address: "192.0.2.1".parse().unwrap(),
                asn: 64513
            })
        );
        let v6: PeerFlag = "tor-b,2001:db8::1,64513".parse().unwrap();
        assert_eq!(v6.address, "2001:db8::1".parse::<IpAddr>().unwrap());
        for (bad, says) in [
            ("tor-a,192.0.2.1", "NAME,ADDRESS,ASN"),
            ("tor-a,router,64513", "\"router\""),
            ("tor-a,192.0.2.1,AS64513", "\"AS64513\""),
        ] {
            let e = bad.parse::<PeerFlag>().unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
