//! `lockstep uninstall`: the flags of `crate::uninstall`, and its report.

use std::path::PathBuf;

use clap::Args;

use super::{Output, print};

/// `lockstep uninstall`.
#[derive(Debug, Args)]
pub struct UninstallArgs {
    /// The agent's config, for its paths (default
    /// /etc/lockstep/config.toml; absent → the embedded default's).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Also remove the state directory (the store): a reinstall then starts
    /// empty instead of resuming every allocation.
    #[arg(long)]
    purge_state: bool,
    /// Once done, wait for SIGTERM or SIGINT instead of exiting: the
    /// cleanup DaemonSet's pod stays running, so `kubectl rollout status`
    /// tells when every node is clean.
    #[arg(long)]
    wait: bool,
    /// Output format.
    #[arg(long, short, value_enum, default_value_t)]
    output: Output,
}

/// Runs the removal and prints what went.
///
/// # Errors
/// The config does not load, the agent is running, or a step failed.
pub fn run(args: UninstallArgs) -> anyhow::Result<i32> {
    let config = crate::config::Config::load(args.config.as_deref())?;
    let removed = crate::uninstall::uninstall(&config, args.purge_state)?;
    print(&serde_json::to_value(&removed)?, args.output, |_| {
        let mut lines = Vec::new();
        for f in &removed.cni_files {
            lines.push(format!("removed {}", f.display()));
        }
        for f in &removed.cni_kept {
            lines.push(format!(
                "kept {} (changed since lockstep wrote it)",
                f.display()
            ));
        }
        lines.push(format!(
            "removed {} pins under {}",
            removed.pins,
            config.datapath.pin_root.display()
        ));
        lines.push(format!("removed {} routes of protocol 213", removed.routes));
        for d in &removed.devices {
            lines.push(format!("removed device {d}"));
        }
        if removed.state_removed {
            lines.push(format!("removed {}", config.state_dir.display()));
        }
        lines.join("\n")
    });
    if args.wait {
        wait_for_stop()?;
    }
    Ok(0)
}

/// Blocks until SIGTERM or SIGINT.
fn wait_for_stop() -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        Ok::<(), std::io::Error>(())
    })?;
    Ok(())
}
