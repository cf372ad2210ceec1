//! `lockstep manifests`: the flags of the install generator
//! (`crate::manifests`).

use std::net::SocketAddr;

use clap::Args;
use ipnet::IpNet;

use crate::manifests::{Mode, Options, render, render_cleanup, render_pools};

/// `lockstep manifests`.
#[derive(Debug, Args)]
pub struct ManifestsArgs {
    /// What the install is for: `lb` (LoadBalancer IPAM only, no CNI
    /// config), `local` (pod IPAM from `--pool`, the same on every node),
    /// `cluster` (pod pools and LoadBalancer IPAM through etcd).
    #[arg(long, value_enum)]
    mode: Mode,
    /// The namespace; one other than kube-system is rendered too.
    #[arg(long, default_value = "kube-system")]
    namespace: String,
    /// The agent's image (default: `localhost/lockstep:VERSION` (this binary's version), what
    /// `cargo xtask image` builds).
    #[arg(long)]
    image: Option<String>,
    /// The nodes' uplink interface.
    #[arg(long, default_value = "eth0")]
    uplink: String,
    /// Where the metrics and probe listener binds on each node.
    #[arg(long, default_value = "0.0.0.0:9476")]
    metrics_addr: SocketAddr,
    /// A pods' CIDR (repeat for more; IPv4 and IPv6): mode local's pool,
    /// or mode cluster's PodIPPool `default` (with --pools-only).
    #[arg(long = "pool")]
    pools: Vec<IpNet>,
    /// A LoadBalancer CIDR (repeat for more): the LoadBalancerIPPool
    /// `default` (with --pools-only).
    #[arg(long = "lb-pool")]
    lb_pools: Vec<IpNet>,
    /// A destination pods reach without masquerade (repeat for more), e.g.
    /// the Service CIDR.
    #[arg(long = "non-masquerade")]
    non_masquerade: Vec<IpNet>,
    /// An etcd endpoint (mode cluster; repeat for more).
    #[arg(long)]
    etcd: Vec<String>,
    /// The Secret with the etcd client's ca.crt, tls.crt and tls.key (mode
    /// cluster); absent: plain connections.
    #[arg(long)]
    etcd_tls_secret: Option<String>,
    /// The spec.loadBalancerClass served (Services without a class too,
    /// unless --no-classless).
    #[arg(long, default_value = lockstep_core::lb::kubernetes::DEFAULT_CLASS)]
    lb_class: String,
    /// Leave Services without a spec.loadBalancerClass to another
    /// implementation (a cloud provider's): serve only --lb-class.
    #[arg(long)]
    no_classless: bool,
    /// The conflist's file name; it must sort before the node's other CNI
    /// configs for pods to use lockstep.
    #[arg(long, default_value = "05-lockstep.conflist")]
    conflist_name: String,
    /// Also render a ServiceMonitor (needs prometheus-operator's CRDs).
    #[arg(long)]
    service_monitor: bool,
    /// Announce LoadBalancer addresses over BGP from this AS number
    /// (docs/bgp.md): the agent's [bgp] section and a DaemonSet
    /// `lockstep-bgp` running BIRD and `lockstep bird-keeper`.
    #[arg(long)]
    bgp_asn: Option<u32>,
    /// A router every node peers with: NAME,ADDRESS,ASN (repeat for more;
    /// routers only some nodes peer with are BGPPeer objects).
    #[arg(long = "bgp-peer")]
    bgp_peers: Vec<crate::manifests::bgp::PeerFlag>,
    /// A pool announced over BGP (repeat for more): a LoadBalancerIPPool
    /// (its addresses) or a pod pool (its blocks; in mode cluster, pod
    /// blocks only).
    #[arg(long = "bgp-pool")]
    bgp_pools: Vec<String>,
    /// The image BIRD runs from: one with `bird` (BIRD 2) and `sh`.
    #[arg(long)]
    bird_image: Option<String>,
    /// Render only the pool objects of --lb-pool and --pool, to apply once
    /// the install's CRDs are established.
    #[arg(long, conflicts_with = "cleanup")]
    pools_only: bool,
    /// Render only the cleanup DaemonSet, which runs `lockstep uninstall`
    /// on every node once the install is deleted.
    #[arg(long)]
    cleanup: bool,
}

/// Prints the manifests the flags ask for.
///
/// # Errors
/// A flag that does not fit the mode, or a config the agent would refuse.
pub fn run(args: ManifestsArgs) -> anyhow::Result<i32> {
    let options = Options {
        mode: args.mode,
        namespace: args.namespace,
        image: args.image.unwrap_or_else(crate::manifests::default_image),
        uplink: args.uplink,
        metrics_addr: args.metrics_addr,
        pools: args.pools,
        lb_pools: args.lb_pools,
        non_masquerade: args.non_masquerade,
        etcd: args.etcd,
        etcd_tls_secret: args.etcd_tls_secret,
        lb_class: args.lb_class,
        serve_classless: !args.no_classless,
        conflist_name: args.conflist_name,
        service_monitor: args.service_monitor,
        bgp: match args.bgp_asn {
            Some(asn) => Some(crate::manifests::bgp::BgpInstall {
                asn,
                peers: args.bgp_peers,
                pools: args.bgp_pools,
                bird_image: args.bird_image.unwrap_or_default(),
            }),
            None if !args.bgp_peers.is_empty()
                || !args.bgp_pools.is_empty()
                || args.bird_image.is_some() =>
            {
                anyhow::bail!("--bgp-peer, --bgp-pool and --bird-image need --bgp-asn");
            }
            None => None,
        },
    };
    let text = if args.pools_only {
        render_pools(&options)?
    } else if args.cleanup {
        render_cleanup(&options)?
    } else {
        render(&options)?
    };
    print!("{text}");
    Ok(0)
}
