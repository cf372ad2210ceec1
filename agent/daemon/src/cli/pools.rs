//! `lockstep pools`: usage, draining ranges and their holders, and the
//! operator's release of draining addresses.

use clap::Subcommand;
use hyper::Method;
use serde_json::{Value, json};

use super::{Output, api, print};

/// `lockstep pools` subcommands.
#[derive(Debug, Subcommand)]
pub enum PoolsCommand {
    /// Release addresses a pool still holds in ranges the configuration
    /// dropped (draining). Lists exactly what it would release; releases it
    /// only with `--yes`. An endpoint holding one is torn down as its CNI
    /// DEL would (all of its addresses go): use it for holders whose pods
    /// are gone or are being moved.
    ReleaseDraining {
        /// The pool.
        #[arg(long)]
        pool: String,
        /// Only the draining addresses inside this CIDR (all of the pool's
        /// draining addresses without it).
        #[arg(long)]
        cidr: Option<ipnet::IpNet>,
        /// Release them (without it: a dry run that lists them).
        #[arg(long)]
        yes: bool,
        /// Output format.
        #[arg(long, short, value_enum, default_value_t)]
        output: Output,
    },
}

fn holder_line(a: &Value) -> String {
    let owner = &a["owner"];
    let who = match owner["owner"].as_str() {
        Some("endpoint") => format!(
            "endpoint {}/{}",
            owner["container_id"].as_str().unwrap_or("?"),
            owner["ifname"].as_str().unwrap_or("?")
        ),
        _ => owner.to_string(),
    };
    format!(
        "{} {} (pool {}, generation {})",
        a["address"].as_str().unwrap_or("?"),
        who,
        a["pool"].as_str().unwrap_or("?"),
        a["generation"]
    )
}

/// Text lines for draining ranges (`pools` and `verify`).
pub(super) fn draining_text(ranges: &Value, indent: &str) -> String {
    let mut out = String::new();
    for r in ranges.as_array().into_iter().flatten() {
        let holders = r["holders"].as_array().map_or(0, Vec::len);
        out.push_str(&format!(
            "{indent}draining {} of pool {}{}: {holders} holder(s)\n",
            r["cidr"].as_str().unwrap_or("?"),
            r["pool"].as_str().unwrap_or("?"),
            if r["pool_retired"].as_bool() == Some(true) {
                " (pool no longer configured)"
            } else {
                ""
            }
        ));
        for a in r["holders"].as_array().into_iter().flatten() {
            out.push_str(&format!("{indent}  {}\n", holder_line(a)));
        }
    }
    out
}

/// Runs `lockstep pools [SUBCOMMAND]`.
///
/// # Errors
/// The API call failed.
pub fn run(
    socket: &std::path::Path,
    output: Output,
    command: Option<PoolsCommand>,
) -> anyhow::Result<i32> {
    let Some(PoolsCommand::ReleaseDraining {
        pool,
        cidr,
        yes,
        output,
    }) = command
    else {
        let v = api(socket, Method::GET, "/v1/pools", None)?;
        print(&v, output, |v| {
            let mut out = String::new();
            for p in v.as_array().into_iter().flatten() {
                out.push_str(&format!(
                    "{:<16} v4 used/free {}/{}  v6 used/free {}/{}  cidrs {}{}\n",
                    p["name"].as_str().unwrap_or("?"),
                    p["v4"][0],
                    p["v4"][1],
                    p["v6"][0],
                    p["v6"][1],
                    p["cidrs"],
                    if p["retired"].as_bool() == Some(true) {
                        "  (no longer configured: draining)"
                    } else {
                        ""
                    }
                ));
                out.push_str(&draining_text(&p["draining_ranges"], "  "));
            }
            out.trim_end().to_string()
        });
        return Ok(0);
    };
    let body = json!({"pool": pool, "cidr": cidr, "confirm": yes});
    let v = api(
        socket,
        Method::POST,
        "/v1/pools/release-draining",
        Some(body),
    )?;
    let failed = v["failed"].as_array().is_some_and(|f| !f.is_empty());
    print(&v, output, |v| {
        let dry = v["dry_run"].as_bool() == Some(true);
        let mut out = String::from(if dry {
            "would release (run again with --yes to release):\n"
        } else {
            "released:\n"
        });
        for at in v["attachments"].as_array().into_iter().flatten() {
            out.push_str(&format!(
                "  attachment {}/{}: torn down as its CNI DEL would (interfaces, map entries, \
                 every address it holds)\n",
                at[0].as_str().unwrap_or("?"),
                at[1].as_str().unwrap_or("?")
            ));
        }
        for a in v["released"].as_array().into_iter().flatten() {
            out.push_str(&format!("  {}\n", holder_line(a)));
        }
        for f in v["failed"].as_array().into_iter().flatten() {
            out.push_str(&format!(
                "  FAILED {}: {}\n",
                holder_line(&f[0]),
                f[1].as_str().unwrap_or("?")
            ));
        }
        out.trim_end().to_string()
    });
    Ok(if failed { 1 } else { 0 })
}
