//! `lockstep cluster ...`: the cluster's pools, blocks and nodes, read and
//! changed in etcd through the cluster door (no agent needed).
//!
//! Kept apart so the dispatcher only routes: the etcd connection, the apply
//! file and the text layout live here.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand};
use lockstep_core::cluster::ClusterPoolSpec;
use serde::Deserialize;
use serde_json::json;

use super::{Output, print};
use crate::cluster::{Door, DoorOptions, TlsFiles};

/// Where etcd is: `--etcd` (and the flags beside it), or else the agent's
/// own config's `[cluster]` section, so the CLI inside the agent's pod
/// needs no flags.
#[derive(Debug, Args)]
pub struct EtcdArgs {
    /// etcd client URLs (repeat, or comma-separated). Without it, the
    /// endpoints, prefix and TLS files of `--config`'s `[cluster]` section.
    #[arg(long, value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// The agent's config, read when `--etcd` is not given.
    #[arg(long, value_name = "FILE", default_value = crate::config::DEFAULT_CONFIG)]
    pub config: PathBuf,
    /// Key prefix (default: the config's, else `/lockstep/v1/`).
    #[arg(long)]
    pub prefix: Option<String>,
    /// Bound on each etcd request.
    #[arg(long, default_value = "2s", value_parser = humantime_serde::re::humantime::parse_duration)]
    pub timeout: Duration,
    /// CA certificate (PEM) for `https://` endpoints.
    #[arg(long, value_name = "FILE")]
    pub cacert: Option<PathBuf>,
    /// Client certificate (PEM), when etcd checks clients; with `--key`.
    #[arg(long, value_name = "FILE", requires = "cacert")]
    pub cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(long, value_name = "FILE", requires = "cacert")]
    pub key: Option<PathBuf>,
}

impl EtcdArgs {
    /// The door's options: from the flags, or from the config's
    /// `[cluster]` section when `--etcd` is not given (a flag given beside
    /// it still wins).
    fn door_options(self) -> anyhow::Result<DoorOptions> {
        let mut opts = if self.etcd.is_empty() {
            let config = crate::config::Config::load(Some(&self.config)).with_context(|| {
                format!(
                    "no --etcd given, so the endpoints come from the agent's config {}",
                    self.config.display()
                )
            })?;
            let cluster = config.cluster.with_context(|| {
                format!(
                    "no --etcd given, and {} has no [cluster] section to take the endpoints from",
                    self.config.display()
                )
            })?;
            DoorOptions::from_cluster_config(&cluster, self.timeout)
        } else {
            DoorOptions::new(self.etcd)
        };
        if let Some(prefix) = self.prefix {
            opts.prefix = prefix;
        }
        opts.timeout = self.timeout;
        if let Some(ca) = self.cacert {
            opts.tls = Some(TlsFiles {
                ca,
                cert: self.cert,
                key: self.key,
            });
        }
        Ok(opts)
    }
}

/// `lockstep cluster ...`.
#[derive(Debug, Subcommand)]
pub enum ClusterCommand {
    /// Cluster pools.
    #[command(subcommand)]
    Pools(PoolsCommand),
    /// Claimed blocks and their nodes.
    Blocks {
        /// Output format.
        #[arg(long, short, value_enum, default_value_t)]
        output: Output,
    },
    /// Live (registered) nodes.
    Nodes {
        /// Output format.
        #[arg(long, short, value_enum, default_value_t)]
        output: Output,
    },
    /// One node.
    #[command(subcommand)]
    Node(NodeCommand),
    /// Addresses reserved for removed nodes (their pods may still hold
    /// them: no node hands them out); `addresses release ADDR...` frees
    /// them once those pods are gone.
    Addresses {
        /// What to do (default: list them).
        #[command(subcommand)]
        action: Option<AddressesCommand>,
        /// Output format.
        #[arg(long, short, value_enum, default_value_t)]
        output: Output,
    },
    /// Keys under pools/, blocks/, nodes/, node_addrs/ or reserved/ this version cannot read (every
    /// reader skips them); `unreadable delete KEY` removes one.
    Unreadable {
        /// What to do (default: list them).
        #[command(subcommand)]
        action: Option<UnreadableCommand>,
        /// Output format.
        #[arg(long, short, value_enum, default_value_t)]
        output: Output,
    },
}

/// `lockstep cluster addresses ...`.
#[derive(Debug, Subcommand)]
pub enum AddressesCommand {
    /// Release reserved addresses (their pods are gone): other nodes may
    /// hand them out again. Each must be reserved.
    Release {
        /// The addresses.
        #[arg(required = true)]
        addresses: Vec<std::net::IpAddr>,
    },
}

/// `lockstep cluster unreadable ...`.
#[derive(Debug, Subcommand)]
pub enum UnreadableCommand {
    /// Delete one unreadable key (refused for a key that reads fine, and
    /// compared on the revision read).
    Delete {
        /// The whole key, prefix included, as listed.
        key: String,
    },
}

/// `lockstep cluster pools ...`.
#[derive(Debug, Subcommand)]
pub enum PoolsCommand {
    /// Replace the cluster pools by the file's `pools` list (JSON, or TOML
    /// when the name ends in `.toml`): validated, refused if it overlaps or
    /// takes a CIDR with claimed blocks away, written in one guarded
    /// transaction.
    Apply {
        /// The file (`-` for stdin).
        #[arg(long, short)]
        file: PathBuf,
        /// Drain (or remove, when no block is held) the stored pools the
        /// file leaves out. Without it, an apply that leaves one out is
        /// refused, naming them, and changes nothing.
        #[arg(long)]
        prune: bool,
        /// Output format.
        #[arg(long, short, value_enum, default_value_t)]
        output: Output,
    },
    /// The cluster pools.
    Get {
        /// Output format.
        #[arg(long, short, value_enum, default_value_t)]
        output: Output,
    },
}

/// `lockstep cluster node ...`.
#[derive(Debug, Subcommand)]
pub enum NodeCommand {
    /// Free a node's blocks for others to claim; refused until its lease
    /// has been recorded gone for `reclaim_after` unless `--force`. The
    /// addresses of its reservation window (in use or about to be) stay
    /// reserved.
    Remove {
        /// The node's name.
        name: String,
        /// Remove it now, alive or not yet gone for `reclaim_after` (and
        /// its node key with it): it may still serve its blocks.
        #[arg(long)]
        force: bool,
    },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PoolsFile {
    /// The pool serving requests that name none; without it the recorded
    /// default stays (the first apply of a single pool records that one).
    #[serde(default)]
    default_pool: Option<String>,
    pools: Vec<ClusterPoolSpec>,
}

fn read_pools(path: &std::path::Path) -> anyhow::Result<PoolsFile> {
    let text = if path == std::path::Path::new("-") {
        std::io::read_to_string(std::io::stdin())?
    } else {
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?
    };
    let file: PoolsFile = if path.extension().is_some_and(|e| e == "toml") {
        toml::from_str(&text).with_context(|| format!("{} is not a pools file", path.display()))?
    } else {
        serde_json::from_str(&text)
            .with_context(|| format!("{} is not a pools file", path.display()))?
    };
    Ok(file)
}

/// Runs a `cluster` command; returns the exit code.
///
/// # Errors
/// etcd unavailable, a refused change, an unreadable file.
pub fn run(etcd: EtcdArgs, cmd: ClusterCommand) -> anyhow::Result<i32> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let mut door = Door::connect(etcd.door_options()?).await?;
        match cmd {
            ClusterCommand::Pools(PoolsCommand::Apply {
                file,
                prune,
                output,
            }) => {
                let file = read_pools(&file)?;
                // PodIPPools own the pools: the writer would apply its
                // objects again on its next pass; refuse rather than fight.
                if door.pools_source().await?.as_deref()
                    == Some(crate::cluster::POOLS_SOURCE_KUBERNETES)
                {
                    anyhow::bail!(
                        "the cluster pools are PodIPPool objects ([kubernetes] pod_pools = true): change them with kubectl (`kubectl get podippools`), not `cluster pools apply`"
                    );
                }
                // Dropping pools drains them: only when asked for, and
                // after the file's own errors (a default it drops), which
                // --prune would not fix.
                let (stored_default, _) = door.stored_default().await?;
                lockstep_core::cluster::default_for_apply(
                    &file.pools,
                    stored_default.as_deref(),
                    file.default_pool.as_deref(),
                )?;
                let (stored, _, _) = door.pools().await?;
                let dropped = lockstep_core::cluster::prune::left_out(&stored, &file.pools);
                if !dropped.is_empty() && !prune {
                    anyhow::bail!(
                        "the file leaves out the stored pools {}: applying it drains them (nothing new comes from them; each is removed once its blocks are given back); nothing was changed. Add them to the file, or pass --prune to drain them",
                        dropped.join(", ")
                    );
                }
                let revision = door
                    .apply_pools_default(&file.pools, file.default_pool.as_deref())
                    .await?;
                let (default, _) = door.stored_default().await?;
                let names: Vec<&str> = file.pools.iter().map(|p| p.name.as_str()).collect();
                // Pools left out while nodes hold blocks of them drain:
                // named with the blocks still held, and by whom.
                let (stored, _, _) = door.pools().await?;
                let (blocks, _) = door.blocks().await?;
                let draining: Vec<serde_json::Value> = stored
                    .iter()
                    .filter(|p| p.draining)
                    .map(|p| {
                        let held: Vec<String> = blocks
                            .iter()
                            .filter(|b| b.pool == p.name)
                            .map(|b| format!("{} ({})", b.cidr, b.node))
                            .collect();
                        json!({"pool": p.name, "blocks": held})
                    })
                    .collect();
                print(
                    &json!({"applied": names, "revision": revision, "default_pool": default, "draining": draining}),
                    output,
                    |v| {
                        let mut text = format!(
                            "applied {} at revision {}; default pool {}",
                            v["applied"], v["revision"], v["default_pool"]
                        );
                        for d in v["draining"].as_array().into_iter().flatten() {
                            text.push_str(&format!(
                                "\npool {} is draining: nothing new comes from it; it is removed once its blocks are given back (held: {})",
                                d["pool"].as_str().unwrap_or_default(),
                                d["blocks"]
                                    .as_array()
                                    .into_iter()
                                    .flatten()
                                    .filter_map(|b| b.as_str())
                                    .collect::<Vec<_>>()
                                    .join(", ")
                            ));
                        }
                        text
                    },
                );
            }
            ClusterCommand::Pools(PoolsCommand::Get { output }) => {
                let (pools, _, _) = door.pools().await?;
                let (stored, _) = door.stored_default().await?;
                let default = lockstep_core::cluster::default_pool(&pools, stored.as_deref())
                    .unwrap_or_else(|e| {
                        eprintln!("warning: {e}");
                        None
                    });
                print(&serde_json::to_value(&pools)?, output, |_| {
                    pools
                        .iter()
                        .map(|p| {
                            let cidrs: Vec<String> = p.cidrs().map(|c| c.to_string()).collect();
                            format!(
                                "{}\t{}\tblocks /{} /{}{}{}",
                                p.name,
                                cidrs.join(","),
                                p.block_v4,
                                p.block_v6,
                                if default.as_deref() == Some(p.name.as_str()) {
                                    "\tdefault"
                                } else {
                                    ""
                                },
                                if p.draining { "\tdraining" } else { "" }
                            )
                        })
                        .collect::<Vec<_>>()
                        .join("\n")
                });
            }
            ClusterCommand::Blocks { output } => {
                let (blocks, _) = door.blocks().await?;
                // Skipped keys are named on stderr, so the list stays a
                // list of blocks.
                for u in door.unreadable() {
                    eprintln!(
                        "warning: etcd key {} is unreadable ({}); skipped (`lockstep cluster unreadable delete KEY` removes it)",
                        u.key, u.reason
                    );
                }
                let v: Vec<_> = blocks
                    .iter()
                    .map(|b| json!({"pool": b.pool, "cidr": b.cidr, "node": b.node, "revision": b.revision}))
                    .collect();
                print(&json!(v), output, |_| {
                    blocks
                        .iter()
                        .map(|b| format!("{}\t{}\t{}", b.pool, b.cidr, b.node))
                        .collect::<Vec<_>>()
                        .join("\n")
                });
            }
            ClusterCommand::Nodes { output } => {
                let nodes = door.nodes().await?;
                let v: Vec<_> = nodes
                    .iter()
                    .map(|n| json!({"node": n.record, "lease": n.lease}))
                    .collect();
                print(&json!(v), output, |_| {
                    nodes
                        .iter()
                        .map(|n| {
                            let ips: Vec<String> =
                                n.record.ips.iter().map(ToString::to_string).collect();
                            format!(
                                "{}\t{}\t{} blocks\t{} in use",
                                n.record.name,
                                ips.join(","),
                                n.record.blocks.len(),
                                n.record.in_use
                            )
                        })
                        .collect::<Vec<_>>()
                        .join("\n")
                });
            }
            ClusterCommand::Unreadable {
                action: None,
                output,
            } => {
                let keys = door.read_unreadable().await?;
                print(&serde_json::to_value(&keys)?, output, |_| {
                    keys.iter()
                        .map(|u| format!("{}\t{}", u.key, u.reason))
                        .collect::<Vec<_>>()
                        .join("\n")
                });
            }
            ClusterCommand::Unreadable {
                action: Some(UnreadableCommand::Delete { key }),
                ..
            } => {
                door.delete_unreadable(&key).await?;
                println!("deleted {key}");
            }
            ClusterCommand::Node(NodeCommand::Remove { name, force }) => {
                lockstep_core::cluster::check_key_name("node", &name)?;
                let removed = door.remove_node(&name, force).await?;
                let reserved: Vec<String> =
                    removed.reserved.iter().map(ToString::to_string).collect();
                if removed.removal == lockstep_core::cluster::Removal::Forced {
                    println!(
                        "warning: --force: node {name} may still be serving its blocks (cut off from etcd, its pods running); another node may take them. Addresses of its reservation window (those in use and those it may hand out while cut off), reserved until released: {}",
                        if reserved.is_empty() {
                            "none".to_string()
                        } else {
                            reserved.join(", ")
                        }
                    );
                }
                for b in &removed.freed {
                    println!("freed {} ({}) of {name}", b.cidr, b.pool);
                }
                println!(
                    "node {name} removed: {} block(s) freed; {} address(es) reserved{}",
                    removed.freed.len(),
                    reserved.len(),
                    if reserved.is_empty() {
                        String::new()
                    } else {
                        format!(
                            " ({}; `lockstep cluster addresses release ADDR...` once their pods are gone)",
                            reserved.join(", ")
                        )
                    }
                );
            }
            ClusterCommand::Addresses {
                action: None,
                output,
            } => {
                let all = door.reservations().await?;
                let v: Vec<_> = all
                    .iter()
                    .flat_map(|(r, _)| {
                        r.addresses
                            .iter()
                            .map(|a| json!({"address": a, "node": r.name}))
                    })
                    .collect();
                print(&json!(v), output, |_| {
                    all.iter()
                        .flat_map(|(r, _)| r.addresses.iter().map(|a| format!("{a}\t{}", r.name)))
                        .collect::<Vec<_>>()
                        .join("\n")
                });
            }
            ClusterCommand::Addresses {
                action: Some(AddressesCommand::Release { addresses }),
                ..
            } => {
                for (a, node) in door.release_reserved(&addresses).await? {
                    println!("released {a} (reserved for node {node})");
                }
            }
        }
        Ok(0)
    })
}
