//! What the core's property tests share: their configuration.
//!
//! Why: CI must say the same thing on every run, so the cases a property
//! test draws are fixed by a seed (`PROPTEST_RNG_SEED`, set for every
//! `cargo` run in `.cargo/config.toml`), and the counterexamples found
//! before are replayed first from the committed `proptest-regressions/`
//! files. Long random exploration is a separate command, `cargo xtask
//! explore`, which sets another seed and more cases (`PROPTEST_CASES`).

use proptest::test_runner::Config;

/// A property test's configuration: `cases` cases, unless
/// `PROPTEST_CASES` asks for another count (as `cargo xtask explore`
/// does); the seed and the regressions file as proptest reads them.
pub(crate) fn cases(cases: u32) -> Config {
    let explore = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse::<u32>().ok());
    Config {
        cases: explore.unwrap_or(cases),
        ..Config::default()
    }
}
