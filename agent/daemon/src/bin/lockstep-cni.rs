//! `lockstep-cni`: the CNI plugins `lockstep` and `lockstep-ipam` as a small
//! binary of their own. A runtime starts a new plugin process for every CNI
//! call, so start-up time is on every pod's path; this binary carries only
//! the CNI layer and a std client, not the agent (aya, tokio, the store).
//! The agent installs it under both plugin names.

/// dlmalloc instead of the C library's allocator: the plugin ships on musl
/// (see `build_plugin` in xtask), whose allocator maps and unmaps a page for
/// many small allocations; a process that lives for one call pays a system
/// call and a page fault for each. dlmalloc takes memory in 64 KiB segments
/// and keeps it.
#[global_allocator]
static ALLOCATOR: dlmalloc::GlobalDlmalloc = dlmalloc::GlobalDlmalloc;

fn main() {
    std::process::exit(lockstep::plugin::run());
}
