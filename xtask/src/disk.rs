//! Free-space checks before the tasks that write gigabytes.
//!
//! A build that runs out of disk fails in the linker with `signal 7 [Bus
//! error]` (it maps its output file), which says nothing about the cause.
//! `cargo xtask test` asks first and names what it needs and where.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, bail};

const GIB: u64 = 1 << 30;

/// Bytes free for an unprivileged writer on the filesystem holding `path`
/// (its nearest existing ancestor), as `df` reports them.
fn free_bytes(path: &Path) -> anyhow::Result<u64> {
    let existing = path
        .ancestors()
        .find(|p| p.exists())
        .context("no existing ancestor")?;
    let out = Command::new("df")
        .args(["--output=avail", "-B1"])
        .arg(existing)
        .output()
        .context("running df")?;
    if !out.status.success() {
        bail!(
            "df {}: {}",
            existing.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let text = String::from_utf8(out.stdout)?;
    text.lines()
        .nth(1)
        .and_then(|l| l.trim().parse().ok())
        .with_context(|| format!("df printed no free-space figure: {text:?}"))
}

/// Fails, naming the figures, unless `need_gib` GiB are free under `path`
/// for `what`.
pub(crate) fn ensure_free(path: &Path, need_gib: u64, what: &str) -> anyhow::Result<()> {
    let free = free_bytes(path)?;
    if free < need_gib * GIB {
        bail!(
            "{what} needs about {need_gib} GiB free under {}, but {:.1} GiB are free; \
             free some space (`cargo clean` removes this clone's builds) and run it again",
            path.display(),
            free as f64 / GIB as f64
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_free_space_of_a_missing_path_is_its_parents() -> anyhow::Result<()> {
        let here = free_bytes(Path::new("/tmp"))?;
        let below = free_bytes(Path::new("/tmp/lockstep-no-such-dir/below"))?;
        assert!(here > 0);
        // Both name one filesystem; other writers may move it a little.
        assert!(here.abs_diff(below) < GIB, "{here} vs {below}");
        Ok(())
    }

    #[test]
    fn asking_for_more_than_the_disk_names_the_figures() {
        let err = ensure_free(Path::new("/tmp"), u64::MAX / GIB, "this check")
            .expect_err("no disk is that large")
            .to_string();
        assert!(err.contains("this check needs about"), "{err}");
        assert!(err.contains("/tmp"), "{err}");
    }
}
