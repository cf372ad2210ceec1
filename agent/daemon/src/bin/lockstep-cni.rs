//! `lockstep-cni`: the CNI plugins `lockstep` and `lockstep-ipam` as a small
//! binary of their own. A runtime starts a new plugin process for every CNI
//! call, so start-up time is on every pod's path; this binary carries only
//! the CNI layer and a std client, not the agent (aya, tokio, the store).
//! The agent installs it under both plugin names.

fn main() {
    std::process::exit(lockstep::plugin::run());
}
