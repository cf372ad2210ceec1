//! Benchmarks as a smoke test: `cargo xtask bench <suite> --smoke` (which
//! `cargo xtask test` runs for every suite) sets `LOCKSTEP_BENCH_SMOKE=1`,
//! and each benchmark then runs its whole path at a small size on the
//! debug build, judging no goal: a benchmark command that no longer runs
//! is caught by CI, not by the next person who wants a figure.

/// Whether this run is a smoke test.
pub fn smoke() -> bool {
    std::env::var_os("LOCKSTEP_BENCH_SMOKE").is_some_and(|v| v == "1")
}

/// `full`, or `small` in a smoke test.
pub fn size<T>(full: T, small: T) -> T {
    if smoke() { small } else { full }
}
