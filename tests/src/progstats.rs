//! What lockstep's programs cost in the benches' real traffic, not only in
//! `BPF_PROG_TEST_RUN`: the kernel's own per-program run time and run
//! count (`BPF_ENABLE_STATS`, on only during [`measure`]'s work, so the
//! rounds that are compared run without its clock reads), beside the
//! machine's busy CPU time over the same span (`/proc/stat`).
//!
//! Why: a bench side's programs are loaded by the `lockstep` CLI in
//! another process, so they are found by the IDs that appeared while that
//! side was built ([`loaded_ids`] before and after).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::Context;
use aya::programs::loaded_programs;
use aya::sys::{Stats, enable_stats};

/// The IDs of every BPF program loaded now.
pub fn loaded_ids() -> anyhow::Result<BTreeSet<u32>> {
    loaded_programs()
        .map(|p| p.map(|p| p.id()).context("reading a loaded program's info"))
        .collect()
}

/// A program's accumulated run time and run count.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Runs {
    /// Time spent running it.
    pub time: Duration,
    /// Times it ran.
    pub count: u64,
}

impl Runs {
    /// Nanoseconds per run (0 when it never ran).
    pub fn ns_per_run(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.time.as_nanos() as f64 / self.count as f64
        }
    }
}

/// Run time and count of the programs in `ids`, by program name (the
/// runs of programs sharing a name are added up).
fn runs(ids: &BTreeSet<u32>) -> anyhow::Result<BTreeMap<String, Runs>> {
    let mut out: BTreeMap<String, Runs> = BTreeMap::new();
    for p in loaded_programs() {
        let p = p.context("reading a loaded program's info")?;
        if !ids.contains(&p.id()) {
            continue;
        }
        let name = p.name_as_str().unwrap_or("?").to_string();
        let r = out.entry(name).or_default();
        r.time += p.run_time();
        r.count += p.run_count();
    }
    Ok(out)
}

/// The machine's busy CPU time so far, all CPUs (`/proc/stat`: everything
/// but idle and iowait).
fn busy_cpu() -> anyhow::Result<Duration> {
    let stat = std::fs::read_to_string("/proc/stat").context("reading /proc/stat")?;
    let line = stat.lines().next().context("/proc/stat is empty")?;
    let ticks: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|t| t.parse().context("a /proc/stat field"))
        .collect::<anyhow::Result<_>>()?;
    anyhow::ensure!(ticks.len() >= 8, "/proc/stat's cpu line is short: {line}");
    let busy: u64 = ticks.iter().take(8).sum::<u64>() - ticks[3] - ticks[4];
    // USER_HZ is 100 on every Linux this runs on.
    Ok(Duration::from_millis(busy * 10))
}

/// The programs' runs and the machine's busy time over `work`, with the
/// statistics on only meanwhile: per program name, the runs added during
/// `work`, and the busy CPU time it took.
pub fn measure<T>(
    ids: &BTreeSet<u32>,
    work: impl FnOnce() -> T,
) -> anyhow::Result<(T, BTreeMap<String, Runs>, Duration)> {
    // On while the descriptor is open.
    let stats = enable_stats(Stats::RunTime).context("BPF_ENABLE_STATS")?;
    let (before, busy_before) = (runs(ids)?, busy_cpu()?);
    let out = work();
    let (after, busy_after) = (runs(ids)?, busy_cpu()?);
    drop(stats);
    let delta = after
        .into_iter()
        .map(|(name, a)| {
            let b = before.get(&name).copied().unwrap_or_default();
            (
                name,
                Runs {
                    time: a.time.saturating_sub(b.time),
                    count: a.count.saturating_sub(b.count),
                },
            )
        })
        .collect();
    Ok((out, delta, busy_after.saturating_sub(busy_before)))
}
