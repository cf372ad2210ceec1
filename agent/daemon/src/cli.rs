//! Command-line interface.
//!
//! The binary is thin: it parses arguments with clap and calls the library.
//! Low-level `datapath` commands operate directly on the pinned maps and links
//! (they are what the demo and operators use to inspect and repair a node);
//! they work whether or not an agent is running.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};
use hyper::Method;
use lockstep_common::{
    EndpointSlot, EndpointValue, IpcacheValue, L2RespSlot, L2RespValue, MasqSkipValue,
    endpoint_flags, identity, ipcache_flags, masq_reason, program_names, slots,
};
use serde_json::json;

mod pools;

use crate::datapath::maps::{v4_key, v6_key};
use crate::datapath::{
    AttachMode, Datapath, DatapathOptions, Hook, MapCapacities, PinnedMaps, ifindex_of,
};

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
    /// Operator tools for the store (with the agent stopped).
    #[command(subcommand)]
    Store(StoreCommand),
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
}

/// Where the pins are.
#[derive(Debug, Args)]
pub struct PinArgs {
    /// Root of lockstep's pins on a bpf filesystem.
    #[arg(long, default_value = DEFAULT_PIN_ROOT)]
    pub pin_root: PathBuf,
}

/// How to attach.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum AttachModeArg {
    /// TCX, netlink if the kernel lacks TCX.
    #[default]
    Auto,
    /// TCX only.
    Tcx,
    /// Netlink (clsact) only.
    Netlink,
}

/// Options of commands that load the object.
#[derive(Debug, Args)]
pub struct LoadArgs {
    /// Shared options.
    #[command(flatten)]
    pins: PinArgs,
    /// Replace pinned maps whose definition differs from this build's.
    #[arg(long)]
    migrate: bool,
    /// How to attach programs.
    #[arg(long, value_enum, default_value_t)]
    attach_mode: AttachModeArg,
    /// Capacity of IPCACHE_V4 and IPCACHE_V6.
    #[arg(long)]
    ipcache_max_entries: Option<u32>,
}

impl LoadArgs {
    fn open(&self) -> anyhow::Result<Datapath> {
        let mut opts = DatapathOptions::new(&self.pins.pin_root);
        opts.migrate = self.migrate;
        opts.attach_mode = match self.attach_mode {
            AttachModeArg::Auto => AttachMode::Auto,
            AttachModeArg::Tcx => AttachMode::Tcx,
            AttachModeArg::Netlink => AttachMode::Netlink,
        };
        if let Some(n) = self.ipcache_max_entries {
            opts.capacities = MapCapacities {
                ipcache: n,
                ..opts.capacities
            };
        }
        let dp = Datapath::open(opts)?;
        for name in dp.migrated() {
            eprintln!("migrated pinned map {name}");
        }
        Ok(dp)
    }
}

/// `lockstep datapath ...`.
#[derive(Debug, Subcommand)]
pub enum DatapathCommand {
    /// Load the programs, pin the maps, attach to_native and from_native to
    /// the uplink. Re-running replaces the programs in place.
    Install {
        /// Shared options.
        #[command(flatten)]
        load: LoadArgs,
        /// The node's uplink interface.
        #[arg(long)]
        uplink: Option<String>,
    },
    /// Program an endpoint (ENDPOINTS + IPCACHE) and attach from_endpoint to its
    /// host-side interface.
    Endpoint {
        /// Shared options.
        #[command(flatten)]
        load: LoadArgs,
        /// Host-side interface of the endpoint.
        #[arg(long)]
        iface: String,
        /// The endpoint's IPv4 address.
        #[arg(long)]
        ipv4: Option<Ipv4Addr>,
        /// The endpoint's IPv6 address.
        #[arg(long)]
        ipv6: Option<Ipv6Addr>,
        /// Generation of the allocation.
        #[arg(long, default_value_t = 1)]
        generation: u64,
    },
    /// Remove an endpoint's ENDPOINTS entry (and its slot); the program stays
    /// attached and now drops everything from the interface.
    EndpointDel {
        /// Shared options.
        #[command(flatten)]
        pins: PinArgs,
        /// Host-side interface of the endpoint.
        #[arg(long)]
        iface: String,
    },
    /// Switch rare datapath events (spoofed packets dropped, ARP requests
    /// answered) in the running agent's log on or off, or show the switch.
    Debug {
        /// Shared options.
        #[command(flatten)]
        pins: PinArgs,
        /// `on`, `off` or `status`.
        #[arg(value_parser = ["on", "off", "status"])]
        state: String,
    },
    /// Announce an IPv4 address on an interface (L2_RESP_V4).
    L2Add {
        /// Shared options.
        #[command(flatten)]
        pins: PinArgs,
        /// The address.
        #[arg(long)]
        ip: Ipv4Addr,
        /// The announcing interface (its MAC answers).
        #[arg(long)]
        iface: String,
    },
    /// Stop announcing an IPv4 address.
    L2Del {
        /// Shared options.
        #[command(flatten)]
        pins: PinArgs,
        /// The address.
        #[arg(long)]
        ip: Ipv4Addr,
    },
    /// Add an IPCACHE entry (host entries go to the host hash, prefixes to the
    /// trie).
    IpcacheAdd {
        /// Shared options.
        #[command(flatten)]
        pins: PinArgs,
        /// The prefix.
        #[arg(long)]
        prefix: ipnet::IpNet,
        /// Security identity.
        #[arg(long, default_value_t = identity::WORLD)]
        identity: u32,
        /// Mark the prefix as living on another node.
        #[arg(long)]
        remote: bool,
    },
    /// Skip masquerading towards a CIDR (MASQ_SKIP_V4 / MASQ_SKIP_V6, reason
    /// "configured").
    MasqSkipAdd {
        /// Shared options.
        #[command(flatten)]
        pins: PinArgs,
        /// The CIDR.
        #[arg(long)]
        cidr: ipnet::IpNet,
    },
    /// Print the per-program counters, summed over CPUs.
    Counters {
        /// Shared options.
        #[command(flatten)]
        pins: PinArgs,
        /// Output format.
        #[arg(long, short, value_enum, default_value_t)]
        output: Output,
    },
    /// Detach everything and remove every pin.
    Uninstall {
        /// Shared options.
        #[command(flatten)]
        pins: PinArgs,
        /// Interfaces with netlink (non-pinned) attachments to clean.
        #[arg(long)]
        iface: Vec<String>,
    },
}

/// `lockstep lb ...`.
#[derive(Debug, Subcommand)]
pub enum LbCommand {
    /// Create or replace pools and services from a JSON or TOML file with
    /// `pools` and `services` lists (Kubernetes field names accepted).
    Apply {
        /// The file (`-` for stdin).
        #[arg(long, short)]
        file: PathBuf,
        /// Output format.
        #[arg(long, short, value_enum, default_value_t)]
        output: Output,
    },
    /// Pools (with conflicts and usage) and service statuses.
    Get {
        /// Output format.
        #[arg(long, short, value_enum, default_value_t)]
        output: Output,
    },
    /// Delete services (`namespace/name`) and pools.
    Delete {
        /// Services to delete.
        #[arg(long)]
        service: Vec<String>,
        /// Pools to delete.
        #[arg(long)]
        pool: Vec<String>,
    },
}

/// Reads an `lb apply` file: JSON, or TOML when the name ends in `.toml`.
///
/// # Errors
/// Unreadable, or not valid JSON/TOML (the message names the line).
pub fn read_lb_file(path: &std::path::Path) -> anyhow::Result<serde_json::Value> {
    let text = if path == std::path::Path::new("-") {
        std::io::read_to_string(std::io::stdin())?
    } else {
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?
    };
    if path.extension().is_some_and(|e| e == "toml") {
        let v: toml::Value = toml::from_str(&text)
            .with_context(|| format!("{} is not valid TOML", path.display()))?;
        Ok(serde_json::to_value(v)?)
    } else {
        serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))
    }
}

fn print_lb(v: &serde_json::Value, output: Output) {
    print(v, output, |v| {
        let mut out = String::from("pools:\n");
        for p in v["pools"].as_array().into_iter().flatten() {
            out.push_str(&format!(
                "  {:<16} used {} free {}{}\n",
                p["spec"]["name"].as_str().unwrap_or("?"),
                p["metrics"]["used"],
                p["metrics"]["free"],
                if p["conflict"].is_null() {
                    String::new()
                } else {
                    format!("  CONFLICTING: {}", p["conflict"])
                }
            ));
        }
        out.push_str("services:\n");
        for (id, st) in v["services"].as_object().into_iter().flatten() {
            let a = &st["assignment"];
            out.push_str(&format!("  {id:<24} {a}\n"));
        }
        out.trim_end().to_string()
    });
}

/// `lockstep maps ...`.
#[derive(Debug, Subcommand)]
pub enum MapsCommand {
    /// Decode and print every pinned map; works while the agent is down.
    Dump {
        /// Shared options.
        #[command(flatten)]
        pins: PinArgs,
        /// Output format.
        #[arg(long, short, value_enum, default_value_t)]
        output: Output,
    },
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
        Output::Text => println!("{}", text(v)),
    }
}

/// Sets up tracing on stderr.
pub fn init_tracing(json: bool, verbose: u8) {
    let default = match verbose {
        0 => "info",
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
        builder.json().init();
    } else {
        builder.init();
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
        Command::Status { output } => {
            let v = api(&socket, Method::GET, "/v1/status", None)?;
            print(&v, output, |v| {
                let ready = v["ready"].as_bool().unwrap_or(false);
                if ready {
                    format!(
                        "ready: lockstep {} on node {} holds {} allocations (generation {}), {} repairs",
                        v["version"].as_str().unwrap_or("?"),
                        v["node"].as_str().unwrap_or("?"),
                        v["allocations"],
                        v["generation"],
                        v["repairs"]
                    )
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
            print_lb(&v, output);
            Ok(0)
        }
        Command::Lb(LbCommand::Get { output }) => {
            let v = api(&socket, Method::GET, "/v1/lb", None)?;
            print_lb(&v, output);
            Ok(0)
        }
        Command::Lb(LbCommand::Delete { service, pool }) => {
            let v = api(
                &socket,
                Method::POST,
                "/v1/lb/delete",
                Some(json!({"services": service, "pools": pool})),
            )?;
            print_lb(&v, Output::Text);
            Ok(0)
        }
        Command::Reconcile => {
            let v = api(&socket, Method::POST, "/v1/reconcile", None)?;
            println!("{v}");
            Ok(0)
        }
        Command::Datapath(cmd) => datapath(cmd),
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
                Output::Text => print_dump_text(&dump),
            }
            Ok(0)
        }
    }
}

fn datapath(cmd: DatapathCommand) -> anyhow::Result<i32> {
    match cmd {
        DatapathCommand::Install { load, uplink } => {
            let mut dp = load.open()?;
            if let Some(uplink) = uplink {
                let a = dp.attach(program_names::TO_NATIVE, &uplink, Hook::Egress)?;
                let b = dp.attach(program_names::FROM_NATIVE, &uplink, Hook::Ingress)?;
                println!(
                    "to_native on {uplink} egress: {a:?}; from_native on {uplink} ingress: {b:?}"
                );
            }
            Ok(0)
        }
        DatapathCommand::Endpoint {
            load,
            iface,
            ipv4,
            ipv6,
            generation,
        } => {
            let mut dp = load.open()?;
            let ifindex = ifindex_of(&iface)?;
            let mut maps = dp.maps()?;
            let mut value = EndpointValue {
                generation,
                ..Default::default()
            };
            let ipcache = IpcacheValue {
                identity: identity::ENDPOINT,
                flags: ipcache_flags::ENDPOINT,
                ifindex,
                ..Default::default()
            };
            if let Some(v4) = ipv4 {
                value.ipv4 = v4.octets();
                value.flags |= endpoint_flags::HAS_V4;
                maps.ipcache_insert(std::net::IpAddr::V4(v4).into(), ipcache)?;
            }
            if let Some(v6) = ipv6 {
                value.ipv6 = v6.octets();
                value.flags |= endpoint_flags::HAS_V6;
                maps.ipcache_insert(std::net::IpAddr::V6(v6).into(), ipcache)?;
            }
            maps.endpoint_insert(ifindex, &value)?;
            let how = dp.attach(program_names::FROM_ENDPOINT, &iface, Hook::Ingress)?;
            println!("from_endpoint on {iface} ingress: {how:?}");
            Ok(0)
        }
        DatapathCommand::Debug { pins, state } => {
            use crate::datapath::events;
            if state != "status" {
                events::set_events(&pins.pin_root, state == "on")?;
            }
            let on = events::events_on(&pins.pin_root)?;
            println!("datapath events: {}", if on { "on" } else { "off" });
            Ok(0)
        }
        DatapathCommand::EndpointDel { pins, iface } => {
            let mut maps = PinnedMaps::open(&pins.pin_root)?;
            maps.endpoint_remove(ifindex_of(&iface)?)?;
            Ok(0)
        }
        DatapathCommand::L2Add { pins, ip, iface } => {
            let mut maps = PinnedMaps::open(&pins.pin_root)?;
            let value = L2RespValue {
                ifindex: ifindex_of(&iface)?,
                mac: mac_of(&iface).with_context(|| format!("reading the MAC of {iface}"))?,
                ..Default::default()
            };
            maps.l2_insert(ip.octets(), &value)?;
            Ok(0)
        }
        DatapathCommand::L2Del { pins, ip } => {
            let mut maps = PinnedMaps::open(&pins.pin_root)?;
            maps.l2_remove(ip.octets())?;
            Ok(0)
        }
        DatapathCommand::IpcacheAdd {
            pins,
            prefix,
            identity,
            remote,
        } => {
            let mut maps = PinnedMaps::open(&pins.pin_root)?;
            let value = IpcacheValue {
                identity,
                flags: if remote { ipcache_flags::REMOTE } else { 0 },
                ..Default::default()
            };
            maps.ipcache_insert(prefix, value)?;
            Ok(0)
        }
        DatapathCommand::MasqSkipAdd { pins, cidr } => {
            let mut maps = PinnedMaps::open(&pins.pin_root)?;
            let value = MasqSkipValue {
                reason: masq_reason::CONFIG,
                pool_id: 0,
            };
            match cidr.trunc() {
                ipnet::IpNet::V4(n) => maps.masq_skip_v4_mut().insert(
                    &v4_key(n.network(), n.prefix_len()),
                    value,
                    0,
                )?,
                ipnet::IpNet::V6(n) => maps.masq_skip_v6_mut().insert(
                    &v6_key(n.network(), n.prefix_len()),
                    value,
                    0,
                )?,
            }
            Ok(0)
        }
        DatapathCommand::Counters { pins, output } => {
            let maps = PinnedMaps::open(&pins.pin_root)?;
            let counters = maps.counters()?;
            match output {
                Output::Json => {
                    let obj: serde_json::Map<String, serde_json::Value> = counters
                        .iter()
                        .map(|(c, v)| (c.name().to_string(), json!(v)))
                        .collect();
                    println!("{}", serde_json::Value::Object(obj));
                }
                Output::Text => {
                    for (c, v) in counters {
                        println!("{:<22} {v}", c.name());
                    }
                }
            }
            Ok(0)
        }
        DatapathCommand::Uninstall { pins, iface } => {
            let removed = Datapath::uninstall(&pins.pin_root, &iface)?;
            println!("removed {removed} pins under {}", pins.pin_root.display());
            Ok(0)
        }
    }
}

/// The hardware address of `iface` in the current network namespace.
///
/// # Errors
/// The interface does not exist or has no Ethernet address.
pub fn mac_of(iface: &str) -> std::io::Result<[u8; 6]> {
    if iface.len() >= libc::IFNAMSIZ {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("interface name {iface} is too long"),
        ));
    }
    // SAFETY: plain socket call.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and is owned here.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    // SAFETY: `ifreq` is plain data.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(iface.bytes()) {
        *dst = src as libc::c_char;
    }
    // SAFETY: SIOCGIFHWADDR fills `req.ifr_ifru` for a valid name.
    let rc = unsafe {
        libc::ioctl(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            // The request type differs between libcs (glibc: c_ulong, musl: c_int).
            libc::SIOCGIFHWADDR as libc::Ioctl,
            &mut req,
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel filled the hwaddr member.
    let data = unsafe { req.ifr_ifru.ifru_hwaddr.sa_data };
    Ok(std::array::from_fn(|i| data[i] as u8))
}

/// Parses `aa:bb:cc:dd:ee:ff`.
pub fn parse_mac(text: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = text.split(':');
    for byte in &mut mac {
        *byte = u8::from_str_radix(parts.next()?, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}

fn fmt_mac(mac: &[u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

fn flag_names(flags: u32) -> Vec<&'static str> {
    [
        (ipcache_flags::ENDPOINT, "endpoint"),
        (ipcache_flags::INGRESS, "ingress"),
        (ipcache_flags::HEALTH, "health"),
        (ipcache_flags::ROUTER, "router"),
        (ipcache_flags::LOADBALANCER, "loadbalancer"),
        (ipcache_flags::HOST, "host"),
        (ipcache_flags::REMOTE, "remote"),
    ]
    .into_iter()
    .filter(|(bit, _)| flags & bit != 0)
    .map(|(_, name)| name)
    .collect()
}

/// Decodes every map into JSON.
///
/// # Errors
/// A map could not be read.
pub fn dump_maps(maps: &PinnedMaps) -> anyhow::Result<serde_json::Value> {
    let ipcache = |prefix: String, v: &IpcacheValue| {
        json!({
            "prefix": prefix,
            "identity": v.identity,
            "flags": flag_names(v.flags),
            "ifindex": v.ifindex,
        })
    };
    let mut ipcache_v4 = Vec::new();
    let mut ipcache_v6 = Vec::new();
    for (prefix, v) in maps.ipcache_entries()? {
        let entry = ipcache(prefix.to_string(), &v);
        match prefix {
            ipnet::IpNet::V4(_) => ipcache_v4.push(entry),
            ipnet::IpNet::V6(_) => ipcache_v6.push(entry),
        }
    }
    let mut masq = Vec::new();
    for item in maps.masq_skip_v4().iter() {
        let (k, v) = item?;
        masq.push(json!({"cidr": format!("{}/{}", Ipv4Addr::from(k.data()), k.prefix_len()), "reason": v.reason, "pool_id": v.pool_id}));
    }
    for item in maps.masq_skip_v6().iter() {
        let (k, v) = item?;
        masq.push(json!({"cidr": format!("{}/{}", Ipv6Addr::from(k.data()), k.prefix_len()), "reason": v.reason, "pool_id": v.pool_id}));
    }
    let mut endpoints = Vec::new();
    for item in maps.endpoints().iter() {
        let (ifindex, v) = item?;
        endpoints.push(json!({
            "ifindex": ifindex,
            "ipv4": (v.flags & endpoint_flags::HAS_V4 != 0).then(|| Ipv4Addr::from(v.ipv4).to_string()),
            "ipv6": (v.flags & endpoint_flags::HAS_V6 != 0).then(|| Ipv6Addr::from(v.ipv6).to_string()),
            "mac": fmt_mac(&v.mac),
            "generation": v.generation,
            "sealed": v.is_sealed(ifindex),
        }));
    }
    let mut l2 = Vec::new();
    for item in maps.l2_resp_v4().iter() {
        let (addr, v) = item?;
        l2.push(json!({"address": Ipv4Addr::from(addr).to_string(), "ifindex": v.ifindex, "mac": fmt_mac(&v.mac), "sealed": v.is_sealed(addr)}));
    }
    // Slot arrays: only the slots that hold something.
    let mut endpoint_slots = Vec::new();
    for item in maps.endpoint_slots().iter() {
        let s = item?;
        if s != EndpointSlot::default() {
            endpoint_slots.push(json!({"slot": slots::endpoint(s.ifindex), "ifindex": s.ifindex, "ipv4": Ipv4Addr::from(s.ipv4).to_string(), "ipv6": Ipv6Addr::from(s.ipv6).to_string(), "flags": s.flags}));
        }
    }
    let mut l2_slots = Vec::new();
    for item in maps.l2_resp_slots().iter() {
        let s = item?;
        if s != L2RespSlot::default() {
            l2_slots.push(json!({"slot": slots::l2_resp(s.addr), "address": Ipv4Addr::from(s.addr).to_string(), "ifindex": s.ifindex, "mac": fmt_mac(&s.mac)}));
        }
    }
    let counters: serde_json::Map<String, serde_json::Value> = maps
        .counters()?
        .into_iter()
        .map(|(c, v)| (c.name().to_string(), json!(v)))
        .collect();
    Ok(json!({
        "IPCACHE_V4": ipcache_v4,
        "IPCACHE_V6": ipcache_v6,
        "MASQ_SKIP": masq,
        "ENDPOINTS": endpoints,
        "L2_RESP_V4": l2,
        "ENDPOINT_SLOTS": endpoint_slots,
        "L2_RESP_SLOTS": l2_slots,
        "COUNTERS": counters,
    }))
}

fn print_dump_text(dump: &serde_json::Value) {
    if let Some(obj) = dump.as_object() {
        for (name, value) in obj {
            println!("{name}:");
            match value {
                serde_json::Value::Array(items) if items.is_empty() => println!("  (empty)"),
                serde_json::Value::Array(items) => {
                    for item in items {
                        println!("  {item}");
                    }
                }
                other => println!("  {other}"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mac_round_trip() {
        let mac = parse_mac("02:ab:cd:00:11:ff").expect("valid");
        assert_eq!(mac, [0x02, 0xab, 0xcd, 0x00, 0x11, 0xff]);
        assert_eq!(fmt_mac(&mac), "02:ab:cd:00:11:ff");
        assert_eq!(parse_mac("02:ab:cd:00:11"), None);
        assert_eq!(parse_mac("02:ab:cd:00:11:ff:00"), None);
        assert_eq!(parse_mac("zz:ab:cd:00:11:ff"), None);
    }

    #[test]
    fn flags_decode_by_name() {
        assert_eq!(
            flag_names(ipcache_flags::ENDPOINT | ipcache_flags::LOADBALANCER),
            vec!["endpoint", "loadbalancer"]
        );
        assert!(flag_names(0).is_empty());
    }
}
