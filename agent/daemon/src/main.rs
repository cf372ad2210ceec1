//! The `lockstep` binary: agent, CLI and datapath tools in one executable.

use clap::{CommandFactory, FromArgMatches};

/// dlmalloc when the agent is built static on musl (the image, see
/// `cargo xtask build`): musl's allocator maps and unmaps pages for many
/// small allocations, a system call and page faults the agent's request
/// path would pay on every CNI call (the plugin measured it, see
/// `lockstep-cni`). glibc builds keep glibc's.
#[cfg(target_env = "musl")]
#[global_allocator]
static ALLOCATOR: dlmalloc::GlobalDlmalloc = dlmalloc::GlobalDlmalloc;

fn main() {
    // Run by a container runtime as a CNI plugin (`lockstep` or
    // `lockstep-ipam`): the protocol is environment + stdin, not arguments.
    // Any CNI_* variable with no arguments is a runtime calling: a missing
    // CNI_COMMAND then gets the spec's error (code 4), not CLI usage.
    let called_by_runtime =
        std::env::vars_os().any(|(k, _)| k.to_string_lossy().starts_with("CNI_"));
    if called_by_runtime && std::env::args_os().len() == 1 {
        std::process::exit(lockstep::plugin::run());
    }
    // `--version` reports what `status` does: the version stamped into
    // this binary (an image's), not the crate's.
    let version: &'static str = Box::leak(lockstep::version::version().into_boxed_str());
    let matches = lockstep::cli::Cli::command().version(version).get_matches();
    let cli = lockstep::cli::Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
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
