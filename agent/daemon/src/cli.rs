//! Command-line interface.
//!
//! The binary is thin: it parses arguments with clap and calls the library.
//! Low-level `datapath` commands operate directly on the pinned maps and links
//! (they are what the demo and operators use to inspect and repair a node);
//! they work whether or not an agent is running.
//!
//! This file is the dispatcher: the top-level arguments and `run`. Each
//! command family with arguments or output of its own has a child module:
//! `datapath` (low-level datapath tooling), `maps` (the maps dump), `lb`
//! (LoadBalancer IPAM), `pools` (pools and draining) and `cluster` (the
//! cluster's pools, blocks and nodes in etcd).

use std::path::PathBuf;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand, ValueEnum};
use hyper::Method;
use serde_json::json;

mod cluster;
mod datapath;
mod lb;
mod manifests;
mod maps;
mod pools;
mod uninstall;

pub use cluster::{ClusterCommand, EtcdArgs};
pub use datapath::{AttachModeArg, DatapathCommand, LoadArgs, mac_of, parse_mac};
pub use lb::{LbCommand, read_lb_file};
pub use manifests::ManifestsArgs;
pub use maps::{MapsCommand, dump_maps};
pub use uninstall::UninstallArgs;

use crate::datapath::PinnedMaps;

/// Default root of lockstep's pins.
pub const DEFAULT_PIN_ROOT: &str = "/sys/fs/bpf/lockstep";

/// lockstep: IPAM and BPF datapath node agent.
#[derive(Debug, Parser)]
#[command(name = "lockstep", version, about)]
pub struct Cli {
    /// Log as JSON lines instead of human-readable text.
    #[arg(long, global = true)]
    pub log_json: bool,
    /// More logging (-v debug, -vv trace).
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
    /// The agent API's unix socket.
    #[arg(long, global = true, default_value = "/run/lockstep/lockstep.sock")]
    pub socket: PathBuf,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// `lockstep config ...`.
#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Check a config file as the agent would read it, without starting
    /// it: every value it refuses is named (field and why), and the exit
    /// status is 1 when there is one. A syntax error or an unknown key
    /// stops the check at that line.
    Check {
        /// The file.
        file: PathBuf,
    },
}

/// Top-level commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the node agent.
    Agent {
        /// Config file (default /etc/lockstep/config.toml; absent → embedded default).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Replace pinned maps whose definition changed (after an upgrade),
        /// as `[datapath] migrate = true` does; reconcile refills them.
        #[arg(long)]
        migrate: bool,
        /// Take the pin root over from another store's agent, as
        /// `[datapath] take_over_pin_root = true` does: its owner record is
        /// replaced and that agent stops writing maps (docs/datapath.md).
        #[arg(long)]
        take_over_pin_root: bool,
    },
    /// Agent status: readiness and why not.
    Status {
        /// Output format.
        #[arg(long, short, value_enum, default_value_t)]
        output: Output,
    },
    /// Pools and their usage, draining ranges with their holders.
    Pools {
        /// Output format.
        #[arg(long, short, value_enum, default_value_t)]
        output: Output,
        /// What to do (show when absent).
        #[command(subcommand)]
        command: Option<pools::PoolsCommand>,
    },
    /// Every allocation.
    Allocations {
        /// Output format.
        #[arg(long, short, value_enum, default_value_t)]
        output: Output,
    },
    /// Allocate an address for a generic resource owner.
    Allocate {
        /// The pool (default: the agent's `default_pool`).
        #[arg(long)]
        pool: Option<String>,
        /// Family (ipv4 or ipv6) when no address is given.
        #[arg(long)]
        family: Option<String>,
        /// A specific address.
        #[arg(long)]
        address: Option<std::net::IpAddr>,
        /// Owner kind (resource or endpoint).
        #[arg(long, default_value = "resource")]
        kind: String,
        /// Owner name (for endpoints: container id).
        #[arg(long)]
        name: String,
        /// Output format.
        #[arg(long, short, value_enum, default_value_t)]
        output: Output,
    },
    /// Release an address.
    Release {
        /// The pool (default: the agent's `default_pool`).
        #[arg(long)]
        pool: Option<String>,
        /// Family (ipv4 or ipv6).
        #[arg(long)]
        family: String,
        /// Owner kind (resource or endpoint).
        #[arg(long, default_value = "resource")]
        kind: String,
        /// Owner name.
        #[arg(long)]
        name: String,
        /// The generation given at allocation (a stale one frees nothing).
        #[arg(long)]
        generation: Option<u64>,
    },
    /// Compare store, core and maps; exit 1 on any drift.
    Verify {
        /// Output format.
        #[arg(long, short, value_enum, default_value_t)]
        output: Output,
    },
    /// Reconcile the maps now (the agent also does it periodically).
    Reconcile,
    /// LoadBalancer IPAM: pools and services.
    #[command(subcommand)]
    Lb(LbCommand),
    /// Low-level datapath operations on pinned maps and links.
    #[command(subcommand)]
    Datapath(DatapathCommand),
    /// Read the pinned maps.
    #[command(subcommand)]
    Maps(MapsCommand),
    /// The agent's configuration.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Cluster mode: pools, blocks and nodes in etcd (no agent needed).
    Cluster {
        /// Where etcd is.
        #[command(flatten)]
        etcd: EtcdArgs,
        /// What to do.
        #[command(subcommand)]
        command: ClusterCommand,
    },
    /// Operator tools for the store (with the agent stopped).
    #[command(subcommand)]
    Store(StoreCommand),
    /// Run beside BIRD: withdraw this node's LoadBalancer routes when the
    /// agent is silent for `[bgp] withdraw_after`, and let them back when
    /// it beats again (docs/bgp.md).
    BirdKeeper {
        /// The agent's config file (default /etc/lockstep/config.toml):
        /// its `[bgp]` section names BIRD's socket and the beat.
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Print the Kubernetes manifests of an install (namespace, CRDs,
    /// RBAC, ConfigMap, DaemonSet, metrics Service) for `kubectl apply -f`.
    Manifests(ManifestsArgs),
    /// Remove what the agent left on this node (CNI config and plugin,
    /// pins, routes of its protocol, the tunnel device), with the agent
    /// stopped; the node's next CNI config then serves its pods.
    Uninstall(UninstallArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish,
    /// powershell).
    Completion {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

/// `lockstep store ...`.
#[derive(Debug, Subcommand)]
pub enum StoreCommand {
    /// Move a log the agent refuses aside and start an empty one; commits
    /// after the database's last checkpoint are given up (docs/store.md,
    /// "Recovery"). The agent must be stopped.
    ResetLog {
        /// The agent's state directory.
        #[arg(long, default_value = "/var/lib/lockstep")]
        state_dir: PathBuf,
    },
}

/// Output format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// Human-readable text.
    #[default]
    Text,
    /// JSON.
    Json,
    /// YAML.
    Yaml,
}

/// Where the pins are.
#[derive(Debug, Args)]
pub struct PinArgs {
    /// Root of lockstep's pins on a bpf filesystem.
    #[arg(long, default_value = DEFAULT_PIN_ROOT)]
    pub pin_root: PathBuf,
}

fn owner_json(kind: &str, name: &str) -> serde_json::Value {
    match kind {
        "endpoint" => json!({"owner": "endpoint", "container_id": name, "ifname": "eth0"}),
        other => json!({"owner": "resource", "kind": other, "name": name}),
    }
}

fn api(
    socket: &std::path::Path,
    method: Method,
    path: &str,
    body: Option<serde_json::Value>,
) -> anyhow::Result<serde_json::Value> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    Ok(rt.block_on(crate::client::call(socket, method, path, body))?)
}

fn print(v: &serde_json::Value, output: Output, text: impl Fn(&serde_json::Value) -> String) {
    match output {
        Output::Json => println!("{v}"),
        Output::Yaml => print_yaml(v),
        Output::Text => println!("{}", text(v)),
    }
}

/// `v` as a YAML document on stdout.
fn print_yaml(v: &impl serde::Serialize) {
    match serde_saphyr::to_string(v) {
        Ok(yaml) => print!("{yaml}"),
        // Every value printed is JSON-shaped, which YAML always holds.
        Err(e) => eprintln!("error: cannot write YAML: {e}"),
    }
}

/// Sets up tracing on stderr.
pub fn init_tracing(json: bool, verbose: u8) {
    // netlink-packet-route warns on every link dump that a newer kernel's
    // attribute carries more than it knows (IFLA_INET6_CONF and the like):
    // harmless, and thousands of lines on a busy node, so only with -v.
    let default = match verbose {
        0 => "info,netlink_packet_route=error",
        1 => "debug",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    if json {
        // Fields beside the message, not nested under `fields`: what log
        // pipelines (Loki, Elasticsearch) index without a parser.
        builder.json().flatten_event(true).init();
    } else {
        builder.init();
    }
}

/// `lockstep config check FILE`: every problem printed, 1 when there is
/// one.
fn config_check(file: &std::path::Path) -> anyhow::Result<i32> {
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("cannot read config {}", file.display()))?;
    let config: crate::config::Config = match toml::from_str(&text) {
        Ok(c) => c,
        Err(e) => {
            println!(
                "{}: {}",
                file.display(),
                e.to_string().trim().replace('\n', " ")
            );
            return Ok(1);
        }
    };
    let problems = config.problems();
    for (field, reason) in &problems {
        println!("{}: field `{field}`: {reason}", file.display());
    }
    if problems.is_empty() {
        println!("{}: valid", file.display());
        Ok(0)
    } else {
        println!("{}: {} problems", file.display(), problems.len());
        Ok(1)
    }
}

/// Runs a parsed command; returns the process exit code.
///
/// # Errors
/// Whatever the command failed with, for `main` to print.
pub fn run(cli: Cli) -> anyhow::Result<i32> {
    let socket = cli.socket.clone();
    match cli.command {
        Command::Agent {
            config,
            migrate,
            take_over_pin_root,
        } => {
            let mut config = crate::config::Config::load(config.as_deref())?;
            config.datapath.migrate |= migrate;
            config.datapath.take_over_pin_root |= take_over_pin_root;
            let rt = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?;
            rt.block_on(crate::server::run(config))?;
            Ok(0)
        }
        Command::BirdKeeper { config } => {
            let config = crate::config::Config::load(config.as_deref())?;
            let cluster = config.cluster.is_some();
            let bgp = config
                .bgp
                .context("the config has no [bgp] section: nothing to keep")?;
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(async move {
                use tokio::signal::unix::{SignalKind, signal};
                let mut term = signal(SignalKind::terminate())?;
                let mut int = signal(SignalKind::interrupt())?;
                let (tx, rx) = tokio::sync::watch::channel(false);
                let keeper = tokio::spawn(crate::bgp::keeper::run(bgp, cluster, rx));
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
                let _ = tx.send(true);
                keeper.await?;
                anyhow::Ok(())
            })?;
            Ok(0)
        }
        Command::Status { output } => {
            let v = api(&socket, Method::GET, "/v1/status", None)?;
            print(&v, output, |v| {
                let ready = v["ready"].as_bool().unwrap_or(false);
                if ready {
                    let mut out = format!(
                        "ready: lockstep {} on node {} holds {} allocations (generation {}), {} repairs",
                        v["version"].as_str().unwrap_or("?"),
                        v["node"].as_str().unwrap_or("?"),
                        v["allocations"],
                        v["generation"],
                        v["repairs"]
                    );
                    // `[bgp]`: a line for what BIRD announces, one per session.
                    let bgp = &v["bgp"];
                    if bgp.is_object() {
                        out.push_str(&format!("\nbgp: {} prefixes announced", bgp["announced"]));
                        if let Some(p) = bgp["problem"].as_str() {
                            out.push_str(&format!("; BIRD's configuration is behind: {p}"));
                        }
                        let blocks: Vec<&str> = bgp["blocks"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .filter_map(|b| b.as_str())
                            .collect();
                        if !blocks.is_empty() {
                            out.push_str(&format!("\nbgp pod blocks: {}", blocks.join(" ")));
                        }
                        if let Some(why) = bgp["blocks_withdrawn"].as_str() {
                            out.push_str(&format!("\nbgp pod blocks withdrawn: {why}"));
                        }
                        for (what, why) in bgp["refused"].as_object().into_iter().flatten() {
                            out.push_str(&format!(
                                "\nbgp refused {what}: {}",
                                why.as_str().unwrap_or("?")
                            ));
                        }
                        for (addr, why) in bgp["withheld"].as_object().into_iter().flatten() {
                            out.push_str(&format!(
                                "\nbgp not announced {addr}: {}",
                                why.as_str().unwrap_or("?")
                            ));
                        }
                        for s in bgp["sessions"].as_array().into_iter().flatten() {
                            out.push_str(&format!(
                                "\nbgp peer {}: {}",
                                s["peer"].as_str().unwrap_or("?"),
                                s["state"].as_str().unwrap_or("?")
                            ));
                            let downs = s["downs"].as_u64().unwrap_or(0);
                            if downs > 0 {
                                out.push_str(&format!(" (down {downs} times since start"));
                                if let Some(last) = s["last_down"].as_str() {
                                    out.push_str(&format!(", last: {last}"));
                                }
                                out.push(')');
                            }
                        }
                    }
                    out
                } else {
                    format!(
                        "not ready (lockstep {}): {}",
                        v["version"].as_str().unwrap_or("?"),
                        v["reason"].as_str().unwrap_or("unknown")
                    )
                }
            });
            Ok(if v["ready"].as_bool() == Some(true) {
                0
            } else {
                3
            })
        }
        Command::Pools { output, command } => pools::run(&socket, output, command),
        Command::Allocations { output } => {
            let v = api(&socket, Method::GET, "/v1/allocations", None)?;
            print(&v, output, |v| {
                let mut out = String::new();
                for a in v.as_array().into_iter().flatten() {
                    out.push_str(&format!(
                        "{:<40} {:<12} gen {:<6} {}\n",
                        a["address"].as_str().unwrap_or("?"),
                        a["pool"].as_str().unwrap_or("?"),
                        a["generation"],
                        a["owner"]
                    ));
                }
                out.trim_end().to_string()
            });
            Ok(0)
        }
        Command::Allocate {
            pool,
            family,
            address,
            kind,
            name,
            output,
        } => {
            let body = json!({
                "pool": pool,
                "family": family,
                "address": address,
                "owner": owner_json(&kind, &name),
            });
            let v = api(&socket, Method::POST, "/v1/allocations", Some(body))?;
            print(&v, output, |v| {
                format!(
                    "{} (generation {})",
                    v["address"].as_str().unwrap_or("?"),
                    v["generation"]
                )
            });
            Ok(0)
        }
        Command::Release {
            pool,
            family,
            kind,
            name,
            generation,
        } => {
            let body = json!({
                "pool": pool,
                "family": family,
                "owner": owner_json(&kind, &name),
                "generation": generation,
            });
            let v = api(&socket, Method::POST, "/v1/release", Some(body))?;
            println!("released {}", v["address"].as_str().unwrap_or("?"));
            Ok(0)
        }
        Command::Verify { output } => {
            let v = api(&socket, Method::GET, "/v1/verify", None)?;
            let ok = v["ok"].as_bool() == Some(true);
            print(&v, output, |v| {
                // Draining ranges are informational: held on purpose.
                let draining = pools::draining_text(&v["draining"], "  ");
                if ok {
                    return format!("verify: store, core and maps agree\n{draining}")
                        .trim_end()
                        .to_string();
                }
                let mut out = format!("verify: DRIFT\n{draining}");
                for s in v["store"].as_array().into_iter().flatten() {
                    out.push_str(&format!("  store: {}\n", s.as_str().unwrap_or("?")));
                }
                for s in v["pins"].as_array().into_iter().flatten() {
                    out.push_str(&format!("  pins: {}\n", s.as_str().unwrap_or("?")));
                }
                for s in v["fenced"].as_array().into_iter().flatten() {
                    out.push_str(&format!("  cluster: {}\n", s.as_str().unwrap_or("?")));
                }
                for s in v["covered"].as_array().into_iter().flatten() {
                    out.push_str(&format!("  cluster: {}\n", s.as_str().unwrap_or("?")));
                }
                for s in v["routes"].as_array().into_iter().flatten() {
                    out.push_str(&format!("  routes: {}\n", s.as_str().unwrap_or("?")));
                }
                for s in v["unreadable"].as_array().into_iter().flatten() {
                    out.push_str(&format!("  cluster: {}\n", s.as_str().unwrap_or("?")));
                }
                for s in v["identity"].as_array().into_iter().flatten() {
                    out.push_str(&format!("  cluster: {}\n", s.as_str().unwrap_or("?")));
                }
                for s in v["leaked"].as_array().into_iter().flatten() {
                    out.push_str(&format!("  kubernetes: {}\n", s.as_str().unwrap_or("?")));
                }
                for d in v["maps"].as_array().into_iter().flatten() {
                    out.push_str(&format!(
                        "  {} {} {}\n",
                        d["map"].as_str().unwrap_or("?"),
                        d["key"].as_str().unwrap_or("?"),
                        d["kind"].as_str().unwrap_or("?")
                    ));
                }
                out.trim_end().to_string()
            });
            Ok(if ok { 0 } else { 1 })
        }
        Command::Lb(LbCommand::Apply { file, output }) => {
            let body = read_lb_file(&file)?;
            let v = api(&socket, Method::POST, "/v1/lb/apply", Some(body))?;
            lb::print_lb(&v, output);
            Ok(0)
        }
        Command::Lb(LbCommand::Get { output }) => {
            let v = api(&socket, Method::GET, "/v1/lb", None)?;
            lb::print_lb(&v, output);
            Ok(0)
        }
        Command::Lb(LbCommand::Delete { service, pool }) => {
            let v = api(
                &socket,
                Method::POST,
                "/v1/lb/delete",
                Some(json!({"services": service, "pools": pool})),
            )?;
            lb::print_lb(&v, Output::Text);
            Ok(0)
        }
        Command::Reconcile => {
            let v = api(&socket, Method::POST, "/v1/reconcile", None)?;
            println!("{v}");
            Ok(0)
        }
        Command::Datapath(cmd) => datapath::run(cmd),
        Command::Config(ConfigCommand::Check { file }) => config_check(&file),
        Command::Manifests(args) => manifests::run(args),
        Command::Uninstall(args) => uninstall::run(args),
        Command::Completion { shell } => {
            let mut cmd = <Cli as clap::CommandFactory>::command();
            clap_complete::generate(shell, &mut cmd, "lockstep", &mut std::io::stdout());
            Ok(0)
        }
        Command::Cluster { etcd, command } => cluster::run(etcd, command),
        Command::Store(StoreCommand::ResetLog { state_dir }) => {
            let (moved, applied) = crate::store::Store::reset_log(&state_dir)?;
            match moved {
                Some(old) => println!(
                    "moved the store log to {}; a new one is in place; the database holds every record up to {applied}, later records of the old log are not applied",
                    old.display()
                ),
                None => println!(
                    "there was no store log; a new one is in place; the database holds every record up to {applied}"
                ),
            }
            Ok(0)
        }
        Command::Maps(MapsCommand::Dump { pins, output }) => {
            let maps = PinnedMaps::open(&pins.pin_root)?;
            let dump = dump_maps(&maps)?;
            match output {
                Output::Json => println!("{}", serde_json::to_string_pretty(&dump)?),
                Output::Yaml => print_yaml(&dump),
                Output::Text => maps::print_dump_text(&dump),
            }
            Ok(0)
        }
    }
}
