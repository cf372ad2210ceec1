//! The `lockstep` binary: agent, CLI and datapath tools in one executable.

use clap::Parser;

fn main() -> anyhow::Result<()> {
    let cli = lockstep::cli::Cli::parse();
    lockstep::cli::init_tracing(cli.log_json, cli.verbose);
    std::process::exit(lockstep::cli::run(cli)?);
}
