//! The `lockstep` binary: agent, CLI and datapath tools in one executable.

use clap::Parser;

fn main() {
    let cli = lockstep::cli::Cli::parse();
    lockstep::cli::init_tracing(cli.log_json, cli.verbose);
    match lockstep::cli::run(cli) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            // The whole cause chain on one line, no backtrace: this is an
            // operator-facing message.
            eprintln!("error: {e:#}");
            std::process::exit(1);
        }
    }
}
