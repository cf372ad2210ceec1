//! protoc for etcd-client's build script, from a crate rather than the machine.
//!
//! etcd-client compiles etcd's gRPC protocol in its build script
//! (tonic-prost-build), which runs `protoc` and needs protobuf's well-known
//! types (`google/protobuf/descriptor.proto`). Debian splits those across
//! `protobuf-compiler` and `libprotobuf-dev`, and only *recommends* the
//! second: a fresh machine set up with `--no-install-recommends` could not
//! build the agent, while every machine that once had the package by hand
//! could. The `protoc-bin-vendored` crate ships Google's protoc binaries and
//! the well-known types, so the etcd protocol compiles with one protoc,
//! pinned by Cargo.lock, everywhere. `cargo xtask` copies them under
//! `target/tools/protoc/` before every task, and `.cargo/config.toml` points
//! `PROTOC` and `PROTOC_INCLUDE` there (paths relative to the repository, so
//! a plain `cargo build` after any `cargo xtask` finds them too).

use std::path::{Path, PathBuf};

use anyhow::Context;

/// Where the copy lives, as `.cargo/config.toml` names it.
fn dir() -> PathBuf {
    crate::root().join("target/tools/protoc")
}

/// Copies protoc and the well-known types under `target/tools/protoc/`
/// unless the copy there is already this crate version's.
///
/// # Errors
/// The crate has no protoc for this machine's OS and architecture, or a copy
/// fails.
pub fn install() -> anyhow::Result<()> {
    let dir = dir();
    let stamp = dir.join("version");
    // The crate's own version identifies the protoc it ships.
    let version = concat!("protoc-bin-vendored ", "3.3.0");
    if std::fs::read_to_string(&stamp).is_ok_and(|s| s == version) {
        return Ok(());
    }
    let bin = protoc_bin_vendored::protoc_bin_path()
        .map_err(|e| anyhow::anyhow!("no vendored protoc for this machine: {e}"))?;
    let include = protoc_bin_vendored::include_path()
        .map_err(|e| anyhow::anyhow!("no vendored protobuf includes for this machine: {e}"))?;
    if dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    std::fs::create_dir_all(dir.join("bin"))
        .with_context(|| format!("creating {}", dir.display()))?;
    let target = dir.join("bin/protoc");
    std::fs::copy(&bin, &target)
        .with_context(|| format!("copying {} to {}", bin.display(), target.display()))?;
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o755))
            .with_context(|| format!("making {} executable", target.display()))?;
    }
    copy_tree(&include, &dir.join("include"))?;
    std::fs::write(&stamp, version).with_context(|| format!("writing {}", stamp.display()))?;
    println!("xtask: protoc from {version} in {}", dir.display());
    Ok(())
}

fn copy_tree(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(to).with_context(|| format!("creating {}", to.display()))?;
    for entry in std::fs::read_dir(from).with_context(|| format!("reading {}", from.display()))? {
        let entry = entry?;
        let dest = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_tree(&entry.path(), &dest)?;
        } else {
            std::fs::copy(entry.path(), &dest)
                .with_context(|| format!("copying {}", entry.path().display()))?;
        }
    }
    Ok(())
}
