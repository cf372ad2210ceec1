//! `cargo xtask explore`: long random runs of the core's property tests.
//!
//! Why apart from `cargo xtask test`: CI must say the same thing every run,
//! so there the property tests draw a fixed set of cases (the seed in
//! `.cargo/config.toml`) after replaying the committed counterexamples.
//! Finding new counterexamples needs many cases from fresh seeds: this
//! command. A change to a safety state machine (the announcer, the claim
//! round) is not done before a run of it with 0 failures. A failure's
//! counterexample lands in `agent/core/proptest-regressions/` (commit it
//! with the fix) and the run prints the seed that drew it.
//!
//! The cases are split over `--jobs` test processes, each with a seed of
//! its own (the base seed plus its number), optimised, so a 100,000-case
//! run of the announcer's property takes minutes, not hours.

use std::process::Child;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};

/// What to explore.
pub struct Explore {
    /// Cases per property test, over all jobs.
    pub cases: u64,
    /// The base seed (random when absent; printed either way).
    pub seed: Option<u64>,
    /// Parallel test processes.
    pub jobs: usize,
    /// Only the tests whose name contains this.
    pub filter: Option<String>,
}

/// The cases when neither `--cases` nor `LOCKSTEP_EXPLORE_CASES` says.
pub const DEFAULT_CASES: u64 = 10_000;

/// `--cases`, else `LOCKSTEP_EXPLORE_CASES`, else [`DEFAULT_CASES`].
///
/// # Errors
/// The variable is not a number.
pub fn cases_from(flag: Option<u64>) -> anyhow::Result<u64> {
    if let Some(n) = flag {
        return Ok(n);
    }
    match std::env::var("LOCKSTEP_EXPLORE_CASES") {
        Ok(v) => v
            .trim()
            .parse()
            .with_context(|| format!("LOCKSTEP_EXPLORE_CASES={v:?} is not a number of cases")),
        Err(_) => Ok(DEFAULT_CASES),
    }
}

/// Runs the exploration.
///
/// # Errors
/// A test failed (its counterexample is persisted), or the build failed.
pub fn run(e: &Explore) -> anyhow::Result<()> {
    if e.cases == 0 || e.jobs == 0 {
        bail!("--cases and --jobs must be at least 1");
    }
    let seed = e.seed.unwrap_or_else(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    crate::run(crate::cargo().args([
        "test",
        "--release",
        "-p",
        "lockstep-core",
        "--lib",
        "--no-run",
    ]))?;
    let jobs = e.jobs.min(e.cases as usize).max(1);
    let per_job = e.cases.div_ceil(jobs as u64);
    println!(
        "explore: {} cases per property test in {jobs} jobs of {per_job}, seeds {seed}..{}{}",
        per_job * jobs as u64,
        seed + jobs as u64 - 1,
        e.filter
            .as_deref()
            .map(|f| format!(", tests matching {f:?}"))
            .unwrap_or_default()
    );
    let started = Instant::now();
    let mut children: Vec<(u64, Child)> = Vec::new();
    for j in 0..jobs as u64 {
        let mut cmd = crate::cargo();
        cmd.args([
            "test",
            "--release",
            "-p",
            "lockstep-core",
            "--lib",
            "--quiet",
        ])
        .env("PROPTEST_RNG_SEED", (seed + j).to_string())
        .env("PROPTEST_CASES", per_job.to_string())
        // Counterexamples are shrunk for at most a minute each.
        .env("PROPTEST_MAX_SHRINK_TIME", "60000")
        .arg("--")
        .arg("--test-threads=1");
        if let Some(f) = &e.filter {
            cmd.arg(f);
        }
        children.push((seed + j, cmd.spawn().context("starting cargo test")?));
    }
    let mut failed = Vec::new();
    for (s, mut child) in children {
        let status = child.wait()?;
        if !status.success() {
            failed.push(s);
        }
    }
    let took = started.elapsed();
    if failed.is_empty() {
        println!(
            "explore: {} cases per property test, 0 failures, in {:.0} s (seed {seed}, {jobs} jobs)",
            per_job * jobs as u64,
            took.as_secs_f64()
        );
        Ok(())
    } else {
        bail!(
            "explore: a property failed with seed(s) {failed:?} after {:.0} s; its counterexample is in agent/core/proptest-regressions/ (replay: PROPTEST_RNG_SEED=<seed> PROPTEST_CASES={per_job} cargo test --release -p lockstep-core --lib)",
            took.as_secs_f64()
        )
    }
}
