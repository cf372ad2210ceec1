//! `lockstep lb ...`: the LoadBalancer IPAM commands' arguments, reading an
//! apply file (JSON or TOML) and printing the agent's answer.
//!
//! Kept apart so the dispatcher only routes: file parsing and the text layout
//! of pools and services live here.

use std::path::PathBuf;

use anyhow::Context;
use clap::Subcommand;

use super::{Output, print};

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
    /// Pools (with conflicts and usage) and service statuses; in cluster
    /// mode as etcd holds them, with the assigner and which node announces
    /// each address (and its lease left).
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

/// Prints an `lb` answer.
pub(super) fn print_lb(v: &serde_json::Value, output: Output) {
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
        // Cluster mode: the assigner and who announces what.
        let c = &v["cluster"];
        if c.is_object() {
            out.push_str(&format!(
                "cluster:\n  assigner {}\n  announcers {}\n",
                c["assigner"].as_str().unwrap_or("(none)"),
                c["members"]
                    .as_array()
                    .map(|m| m
                        .iter()
                        .filter_map(|n| n.as_str())
                        .collect::<Vec<_>>()
                        .join(","))
                    .unwrap_or_default()
            ));
            if let Some(p) = c["pending"].as_array().filter(|p| !p.is_empty()) {
                out.push_str(&format!("  pending {}\n", p.len()));
            }
            out.push_str("announcements:\n");
            for (addr, a) in c["announcements"].as_object().into_iter().flatten() {
                out.push_str(&format!(
                    "  {addr:<24} {} lease {}s\n",
                    a["node"].as_str().unwrap_or("?"),
                    a["lease_left_s"]
                ));
            }
        }
        out.trim_end().to_string()
    });
}
