//! Builds lockstep's eBPF programs into one object with BTF.
//!
//! The programs are a separate cargo workspace (`ebpf/programs`) built with the
//! nightly toolchain for `bpfel-unknown-none` with `-Z build-std=core`, linked by
//! `bpf-linker`. Cargo only applies that workspace's `.cargo/config.toml` when it
//! runs inside its folder, and an object built without it silently lacks BTF, so
//! this crate is the one place that knows how to run that build: `cargo xtask
//! build-ebpf` calls it, and so does the agent's build script, which embeds the
//! result.
//!
//! Missing prerequisites are detected before cargo runs, so the error names the
//! setup command instead of ending in a linker trace.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The command that installs every prerequisite.
pub const SETUP_COMMAND: &str = "cargo xtask setup";

/// File name of the built object inside the programs' target directory.
pub const OBJECT_NAME: &str = "lockstep-programs";

/// Why the eBPF object could not be built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// `bpf-linker` is not on PATH.
    #[error("bpf-linker was not found on PATH; run `{SETUP_COMMAND}` to install it")]
    LinkerMissing,
    /// The nightly toolchain lacks rust-src.
    #[error(
        "the nightly toolchain has no rust-src (looked in {path}); run `{SETUP_COMMAND}` to install it"
    )]
    RustSrcMissing {
        /// Where the library sources were expected.
        path: PathBuf,
    },
    /// The nightly toolchain itself is missing.
    #[error("the nightly toolchain is not installed; run `{SETUP_COMMAND}`")]
    NightlyMissing,
    /// A tool could not be started.
    #[error("could not run {program}")]
    Spawn {
        /// The program that failed to start.
        program: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// `cargo build` of the programs failed; its output went to stderr.
    #[error("building the eBPF programs in {dir} failed ({status})")]
    CargoFailed {
        /// The programs' workspace.
        dir: PathBuf,
        /// Cargo's exit status.
        status: std::process::ExitStatus,
    },
    /// `cargo fmt --check` or `cargo clippy` of the programs failed (their
    /// output went to stderr).
    #[error("`cargo {step}` of the eBPF programs in {dir} failed ({status})")]
    LintFailed {
        /// `fmt --check` or `clippy`.
        step: String,
        /// The programs' workspace.
        dir: PathBuf,
        /// Cargo's exit status.
        status: std::process::ExitStatus,
    },
    /// The nightly toolchain has no clippy or rustfmt to lint the programs.
    #[error("the nightly toolchain has no {component}; run `{SETUP_COMMAND}` to install it")]
    LintToolMissing {
        /// `clippy` or `rustfmt`.
        component: String,
    },
    /// The object was built but carries no BTF, which aya cannot load.
    #[error("{path} has no .BTF section; the build did not use ebpf/programs/.cargo/config.toml")]
    NoBtf {
        /// The object.
        path: PathBuf,
    },
    /// The object could not be read.
    #[error("could not read {path}")]
    Read {
        /// The object.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// Where the programs' workspace lives, given the repository root.
pub fn programs_dir(repo_root: &Path) -> PathBuf {
    repo_root.join("ebpf").join("programs")
}

/// Directories whose contents decide the object (for rerun-if-changed).
pub fn source_dirs(repo_root: &Path) -> Vec<PathBuf> {
    vec![
        programs_dir(repo_root).join("src"),
        programs_dir(repo_root).join("Cargo.toml"),
        programs_dir(repo_root).join(".cargo"),
        programs_dir(repo_root).join("rust-toolchain.toml"),
        repo_root.join("ebpf").join("common").join("src"),
        repo_root.join("ebpf").join("common").join("Cargo.toml"),
    ]
}

/// Checks that bpf-linker and the nightly rust-src are installed.
///
/// # Errors
/// [`BuildError::LinkerMissing`], [`BuildError::NightlyMissing`] or
/// [`BuildError::RustSrcMissing`], each naming the setup command.
pub fn check_prerequisites() -> Result<(), BuildError> {
    check_with("bpf-linker")
}

fn check_with(linker_program: &str) -> Result<(), BuildError> {
    let linker = Command::new(linker_program).arg("--version").output();
    match linker {
        Ok(out) if out.status.success() => {}
        _ => return Err(BuildError::LinkerMissing),
    }
    let sysroot = clean_command("rustc")
        .args(["+nightly", "--print", "sysroot"])
        .output()
        .map_err(|source| BuildError::Spawn {
            program: "rustc +nightly".into(),
            source,
        })?;
    if !sysroot.status.success() {
        return Err(BuildError::NightlyMissing);
    }
    let root = PathBuf::from(String::from_utf8_lossy(&sysroot.stdout).trim());
    let core = root.join("lib/rustlib/src/rust/library/core/Cargo.toml");
    if !core.exists() {
        return Err(BuildError::RustSrcMissing { path: core });
    }
    Ok(())
}

/// Builds the programs (release) and returns the path of the object.
///
/// # Errors
/// A missing prerequisite, a failed cargo run, or an object without BTF.
pub fn build(repo_root: &Path) -> Result<PathBuf, BuildError> {
    check_prerequisites()?;
    let dir = programs_dir(repo_root);
    let status = cargo_in(&dir, &["build", "--release"])?;
    if !status.success() {
        return Err(BuildError::CargoFailed { dir, status });
    }
    let object = dir
        .join("target/bpfel-unknown-none/release")
        .join(OBJECT_NAME);
    let bytes = std::fs::read(&object).map_err(|source| BuildError::Read {
        path: object.clone(),
        source,
    })?;
    if !contains(&bytes, b".BTF\0") {
        return Err(BuildError::NoBtf { path: object });
    }
    Ok(object)
}

/// Checks the programs' formatting and runs clippy on them (warnings are
/// errors), as the workspace's own crates are checked: they are a workspace
/// of their own (nightly, the BPF target), so `cargo fmt --all` and
/// `cargo clippy --workspace` never see them.
///
/// # Errors
/// A missing tool, or a lint or formatting failure.
pub fn lint(repo_root: &Path) -> Result<(), BuildError> {
    check_prerequisites()?;
    let dir = programs_dir(repo_root);
    for (component, probe) in [("rustfmt", "fmt"), ("clippy", "clippy")] {
        let found = clean_command("cargo")
            .args([probe, "--version"])
            .current_dir(&dir)
            .output()
            .is_ok_and(|o| o.status.success());
        if !found {
            return Err(BuildError::LintToolMissing {
                component: component.into(),
            });
        }
    }
    for args in [
        &["fmt", "--check"][..],
        &["clippy", "--release", "--", "-D", "warnings"][..],
    ] {
        let status = cargo_in(&dir, args)?;
        if !status.success() {
            return Err(BuildError::LintFailed {
                step: args[..2.min(args.len())].join(" "),
                dir,
                status,
            });
        }
    }
    Ok(())
}

/// Runs `cargo args` in `dir` (the programs' workspace) through
/// [`clean_command`]; its output goes to the terminal.
fn cargo_in(dir: &Path, args: &[&str]) -> Result<std::process::ExitStatus, BuildError> {
    clean_command("cargo")
        .args(args)
        .current_dir(dir)
        .status()
        .map_err(|source| BuildError::Spawn {
            program: "cargo".into(),
            source,
        })
}

/// A command through the rustup proxy with every variable removed that a parent
/// cargo (or build script) sets and that would leak into the nested build: the
/// toolchain choice, rustc wrappers, rustflags and target settings.
fn clean_command(program: &str) -> Command {
    let mut cmd = Command::new(program);
    let keep = |name: &str| name == "CARGO_HOME" || name == "CARGO_TERM_COLOR";
    let vars: Vec<OsString> = std::env::vars_os().map(|(k, _)| k).collect();
    for key in vars {
        let Some(name) = key.to_str() else { continue };
        let leaks = (name.starts_with("CARGO_") && !keep(name))
            || name.starts_with("RUSTC")
            || name.starts_with("DEP_")
            || matches!(
                name,
                "RUSTUP_TOOLCHAIN"
                    | "RUSTFLAGS"
                    | "RUSTDOCFLAGS"
                    | "TARGET"
                    | "HOST"
                    | "OUT_DIR"
                    | "PROFILE"
                    | "OPT_LEVEL"
                    | "DEBUG"
                    | "NUM_JOBS"
            );
        if leaks {
            cmd.env_remove(&key);
        }
    }
    cmd
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_linker_names_the_setup_command() {
        let err = check_with("bpf-linker-that-is-not-installed").expect_err("no such linker");
        assert!(matches!(err, BuildError::LinkerMissing));
        assert!(err.to_string().contains("cargo xtask setup"), "{err}");
    }

    #[test]
    fn a_missing_rust_src_names_the_setup_command() {
        let err = BuildError::RustSrcMissing {
            path: PathBuf::from("/nowhere/core/Cargo.toml"),
        };
        let text = err.to_string();
        assert!(
            text.contains("cargo xtask setup") && text.contains("/nowhere"),
            "{text}"
        );
    }

    #[test]
    fn finds_btf_marker() {
        assert!(contains(b"xx.BTF\0yy", b".BTF\0"));
        assert!(!contains(b"xx.BTF.ext", b".BTF\0"));
    }

    #[test]
    fn nested_build_does_not_inherit_toolchain_choice() {
        // SAFETY: this test is the only code in this process touching the
        // environment.
        unsafe { std::env::set_var("RUSTUP_TOOLCHAIN", "stable") };
        let cmd = clean_command("cargo");
        let removed = cmd
            .get_envs()
            .any(|(k, v)| k == "RUSTUP_TOOLCHAIN" && v.is_none());
        assert!(removed);
    }
}
