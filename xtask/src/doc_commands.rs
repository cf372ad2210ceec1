//! Every command the README and docs/ tell a user to run is run by a test
//! (`cargo xtask test` checks it, before anything slow).
//!
//! Why: a command no test runs breaks unseen. The README's first command
//! did, while CI stayed green. This check reads every shell block and every
//! inline command of the README, docs/ and docs/design/, and finds for each
//! what runs it: a stage of `cargo xtask test` (the demos, the fresh root, the unit and
//! integration tests), a test that runs the same `lockstep` subcommand, or
//! the bounded form of a test CI runs. A command that cannot run on these
//! machines (a Kubernetes cluster, a registry) must sit in a section of its
//! doc that says it was "not run here" and why. A benchmark command must name
//! a suite that exists; `cargo xtask test` smoke-runs every suite (small
//! sizes, goals not judged), and `cargo xtask bench` judges them. A command
//! none of these covers fails the check, naming its doc and line.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

/// A command as a doc shows it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Documented {
    /// The doc, relative to the root.
    pub doc: String,
    /// Its line (1-based).
    pub line: usize,
    /// The command.
    pub command: String,
}

/// Programs whose inline mentions are commands (a shell block's every
/// line is one).
const PROGRAMS: &[&str] = &[
    "lockstep ",
    "cargo ",
    "kubectl ",
    "podman ",
    "kind ",
    "k3d ",
    "ctr ",
    "etcdctl ",
    "fuzz/run.sh",
    "bpftool ",
    "bird ",
    "birdc ",
];

/// The commands of one markdown text.
fn extract(doc: &str, text: &str) -> Vec<Documented> {
    let mut out = Vec::new();
    let mut block: Option<String> = None;
    for (i, line) in text.lines().enumerate() {
        let push = |out: &mut Vec<Documented>, command: &str| {
            let command = command.trim();
            if !command.is_empty() {
                out.push(Documented {
                    doc: doc.to_string(),
                    line: i + 1,
                    command: command.to_string(),
                });
            }
        };
        if let Some(rest) = line.trim_start().strip_prefix("```") {
            block = match block {
                Some(_) => None,
                None => Some(rest.trim().to_string()),
            };
            continue;
        }
        if let Some(lang) = &block {
            if ["sh", "bash", "console"].contains(&lang.as_str()) {
                let command = line.split(" #").next().unwrap_or_default();
                if !command.trim_start().starts_with('#') {
                    push(&mut out, command);
                }
            }
            continue;
        }
        let mut rest = line;
        while let Some(start) = rest.find('`') {
            let after = &rest[start + 1..];
            let Some(end) = after.find('`') else { break };
            let span = &after[..end];
            if is_command(span) {
                push(&mut out, span);
            }
            rest = &after[end + 1..];
        }
    }
    out
}

/// Whether an inline code span is a command (not a name: `lockstep-cni`,
/// `lockstep.io/lb`, `lockstep_lb_announcing`).
fn is_command(span: &str) -> bool {
    if let Some(var) = span.strip_prefix("LOCKSTEP_") {
        return var.contains('=');
    }
    let words = span.split_whitespace().count();
    // `cargo build`, `cargo xtask`, `cargo fuzz`: the tools named; an
    // elided command (`cargo test … masq_bench`) is a reference.
    let named = span.starts_with("cargo ") && words < 3;
    PROGRAMS.iter().any(|p| span.starts_with(p)) && words >= 2 && !named && !span.contains('…')
}

/// How a documented command is run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Covered {
    /// By a stage of `cargo xtask test` (named).
    Stage(String),
    /// By the tests that run this `lockstep` subcommand (one file named).
    Test(PathBuf),
    /// It is the long form of a bounded test CI runs (named).
    LongForm(String),
    /// A benchmark suite: run by CI as a smoke test (small sizes, goals
    /// not judged), judged by hand.
    Bench(String),
    /// It cannot run here; its doc says so.
    NotHere,
}

/// The `lockstep` subcommand words of a command: the leading words that
/// are neither flags nor placeholders.
fn subcommand(command: &str) -> Vec<&str> {
    command
        .split_whitespace()
        .skip(1)
        .take_while(|w| {
            w.chars().all(|c| c.is_ascii_lowercase() || c == '-') && !w.starts_with('-')
        })
        .collect()
}

/// The sources a test runs commands from: the integration tests and their
/// helpers, and the demos.
fn corpus(root: &Path) -> anyhow::Result<BTreeMap<PathBuf, String>> {
    let mut files = BTreeMap::new();
    let mut dirs = vec![root.join("tests"), root.join("deploy")];
    while let Some(dir) = dirs.pop() {
        for entry in
            std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))?
        {
            let path = entry?.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs" || e == "sh") {
                let text = std::fs::read_to_string(&path)?;
                files.insert(
                    path.strip_prefix(root).unwrap_or(&path).to_path_buf(),
                    code_only(&text),
                );
            }
        }
    }
    Ok(files)
}

/// `text` without its comments (`//` to the end of a line in Rust, `#`
/// lines in shell): a command a comment names is not a command run. An
/// argument passed as `"word".as_ref()` reads as `"word"`.
fn code_only(text: &str) -> String {
    let text = text.replace(".as_ref()", "");
    text.lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .map(|l| match l.find("//") {
            Some(i) if !l[..i].ends_with(':') => &l[..i],
            _ => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Whether `text` runs the subcommand `words`: the words in order, apart
/// only by blanks, quotes, commas or brackets (a shell line, or a Rust
/// argument list such as `["cluster", "node", "remove"`).
fn runs(text: &str, words: &[&str]) -> bool {
    let Some(first) = words.first() else {
        return false;
    };
    let mut from = 0;
    while let Some(at) = text[from..].find(first) {
        let mut pos = from + at + first.len();
        let before = text[..from + at].chars().next_back();
        let boundary = before.is_none_or(|c| !c.is_ascii_alphanumeric() && c != '_' && c != '-');
        let mut all = boundary;
        for w in &words[1..] {
            if !all {
                break;
            }
            let rest = &text[pos..];
            let skipped = rest.len()
                - rest
                    .trim_start_matches(|c: char| c.is_whitespace() || "\"',[]".contains(c))
                    .len();
            if skipped == 0 || !rest[skipped..].starts_with(w) {
                all = false;
            }
            pos += skipped + w.len();
        }
        if all {
            let after = text[pos..].chars().next();
            if after.is_none_or(|c| !c.is_ascii_alphanumeric() && c != '_' && c != '-') {
                return true;
            }
        }
        from += at + first.len();
    }
    false
}

/// What covers one command, or why nothing does.
fn cover(
    root: &Path,
    d: &Documented,
    docs: &BTreeMap<String, String>,
    corpus: &BTreeMap<PathBuf, String>,
) -> Result<Covered, String> {
    let c = d.command.as_str();
    let words: Vec<&str> = c.split_whitespace().collect();
    let stage = |s: &str| Ok(Covered::Stage(s.to_string()));
    // Commands that need what these machines cannot have: the doc says so.
    if ["kubectl ", "kind ", "k3d ", "ctr ", "podman save "]
        .iter()
        .any(|p| c.starts_with(p))
    {
        let doc = &docs[&d.doc];
        let section = section_of(doc, d.line);
        return if section.contains("not been run here") || section.contains("cannot run here") {
            Ok(Covered::NotHere)
        } else {
            Err("needs a Kubernetes cluster or a registry; its section must say it was not run here, and why".into())
        };
    }
    match words.as_slice() {
        ["cargo", "xtask", "test", ..] => {
            if let Some(name) = words.iter().skip(3).find(|w| !w.starts_with('-')) {
                return integration(root, name);
            }
            stage("cargo xtask test itself (.ci/run)")
        }
        ["cargo", "xtask", "setup"] => stage("setup, the first stage of cargo xtask test"),
        ["cargo", "xtask", "doc-commands"] => stage("this check, a stage of cargo xtask test"),
        ["cargo", "xtask", "check-core" | "validate-manifests"] => {
            stage("a lint stage of cargo xtask test")
        }
        ["cargo", "xtask", "config-reference"] => stage(
            "the unit stage (config::reference's test fails while docs/configuration.md differs from what it writes)",
        ),
        ["cargo", "xtask", "fresh-root"] => stage("fresh-root, the last stage of cargo xtask test"),
        ["cargo", "xtask", "build-ebpf" | "build"] => {
            stage("the fresh root's build steps (cargo xtask fresh-root)")
        }
        ["cargo", "xtask", "build", "--arch", "aarch64" | "arm64"] => stage(
            "the integration stage of cargo xtask test, which cross-builds for tests/tests/arm64.rs",
        ),
        ["cargo", "xtask", "demo", ..] => stage("the demos stage of cargo xtask test"),
        ["cargo", "xtask", "image", ..] => {
            stage("tests/tests/image.rs builds the image from the context cargo xtask image stages")
        }
        ["cargo", "xtask", "crash", suite, ..] => match *suite {
            "startup" => Ok(Covered::LongForm("tests/tests/startup_kill.rs".into())),
            "power" => Ok(Covered::LongForm("tests/tests/power_loss.rs".into())),
            other => Err(format!("no crash suite {other}")),
        },
        ["cargo", "xtask", "explore", ..] => Ok(Covered::LongForm(
            "the core's property tests (unit stage)".into(),
        )),
        ["cargo", "xtask", "bench", suite, ..] => {
            // `<suite>` stands for each suite, all of which CI smoke-runs.
            if crate::bench::BENCH_SUITES.contains(suite) || *suite == "<suite>" {
                Ok(Covered::Bench((*suite).to_string()))
            } else {
                Err(format!("no bench suite {suite}"))
            }
        }
        ["cargo", "test", "-p", "lockstep-tests", "--test", name, ..] => integration(root, name),
        ["cargo", "test", "-p", "lockstep-tests", "--lib", ..] => stage(
            "the integration stage of cargo xtask test (cargo test -p lockstep-tests runs the crate's own unit tests too)",
        ),
        [
            "cargo",
            "test",
            "-p",
            "lockstep" | "lockstep-core",
            "--lib",
            ..,
        ] => stage("the unit stage of cargo xtask test (cargo test --workspace)"),
        ["cargo", "run", "-p", "lockstep", "--example", "crdgen"] => {
            stage("the unit stage (the CRDs' staleness test runs the generator's code)")
        }
        ["fuzz/run.sh", ..] | ["cargo", "+nightly", "fuzz", ..] => Ok(Covered::LongForm(
            "the fuzz targets' seed corpus (docs/fuzzing.md)".into(),
        )),
        ["lockstep", ..] => {
            let sub = subcommand(c);
            if sub.is_empty() {
                return Err("no subcommand".into());
            }
            // The cluster tests run `lockstep cluster --etcd ... <args>`
            // through one helper (`cluster_cli`, `ClusterNodes::cli`): the
            // words after `cluster` at its call sites.
            let through_helper = |text: &str| {
                sub.first() == Some(&"cluster")
                    && (text.contains("ClusterNodes") || text.contains("cluster_cli("))
                    && runs(text, &sub[1..])
            };
            corpus
                .iter()
                .find(|(_, text)| runs(text, &sub) || through_helper(text))
                .map(|(path, _)| Covered::Test(path.clone()))
                .ok_or_else(|| format!("no test runs `lockstep {}`", sub.join(" ")))
        }
        ["bpftool", ..] | ["etcdctl", ..] | ["podman", ..] => {
            // The tools' subcommands: tests call them with their program
            // apart (`Command::new("bpftool").args(["map", "show", ...`).
            let sub: Vec<&str> = words
                .iter()
                .skip(1)
                .take_while(|w| {
                    w.chars()
                        .all(|ch| ch.is_ascii_lowercase() || ch == '-' || ch == '/')
                        && !w.starts_with('-')
                })
                .copied()
                .collect();
            corpus
                .iter()
                .find(|(_, text)| runs(text, &sub))
                .map(|(path, _)| Covered::Test(path.clone()))
                .ok_or_else(|| format!("no test runs `{} {}`", words[0], sub.join(" ")))
        }
        ["bird" | "birdc", ..] => {
            // The BGP tests start BIRD and call birdc with their own paths
            // between the words (`.command("bird").arg("-f").arg("-c")`):
            // the program named, each flag, and the words that are
            // neither flags nor paths, in order.
            let flags: Vec<String> = words[1..]
                .iter()
                .filter(|w| w.starts_with('-'))
                .map(|w| format!("\"{w}\""))
                .collect();
            let sub: Vec<&str> = words[1..]
                .iter()
                .filter(|w| !w.starts_with('-') && !w.starts_with('/'))
                .copied()
                .collect();
            let program = format!("\"{}\"", words[0]);
            corpus
                .iter()
                .find(|(_, text)| {
                    text.contains(&program)
                        && flags.iter().all(|f| text.contains(f.as_str()))
                        && (sub.is_empty() || runs(text, &sub))
                })
                .map(|(path, _)| Covered::Test(path.clone()))
                .ok_or_else(|| format!("no test runs `{}` with {flags:?} {sub:?}", words[0]))
        }
        _ => Err("not a command this check knows how to place".into()),
    }
}

/// An integration test's file must exist: `cargo xtask test` runs them all.
fn integration(root: &Path, name: &str) -> Result<Covered, String> {
    let file = root.join("tests/tests").join(format!("{name}.rs"));
    if file.exists() {
        Ok(Covered::Stage(format!(
            "the integration stage (tests/tests/{name}.rs)"
        )))
    } else {
        Err(format!("no integration test {name}"))
    }
}

/// The section (from its heading to the next) holding line `line`.
fn section_of(doc: &str, line: usize) -> String {
    let lines: Vec<&str> = doc.lines().collect();
    let idx = line.saturating_sub(1).min(lines.len().saturating_sub(1));
    let start = (0..=idx)
        .rev()
        .find(|i| lines[*i].starts_with('#'))
        .unwrap_or(0);
    let end = (idx + 1..lines.len())
        .find(|i| lines[*i].starts_with('#'))
        .unwrap_or(lines.len());
    lines[start..end].join("\n")
}

/// Variables a doc tells a user to set, and where the code reads them.
fn variable(root: &Path, d: &Documented) -> Option<Result<Covered, String>> {
    let var = d.command.split('=').next()?;
    if !var.starts_with("LOCKSTEP_") || var.contains(' ') {
        return None;
    }
    let mut dirs = vec![root.join("xtask"), root.join("tests"), root.join("agent")];
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs")
                && std::fs::read_to_string(&path).is_ok_and(|t| t.contains(&format!("\"{var}\"")))
            {
                return Some(Ok(Covered::Stage(format!(
                    "{var} is read by {}",
                    path.strip_prefix(root).unwrap_or(&path).display()
                ))));
            }
        }
    }
    Some(Err(format!("{var} is read nowhere")))
}

/// Checks every documented command; prints what covers each kind.
///
/// # Errors
/// A command nothing covers (each named with its doc and line).
pub fn check(root: &Path) -> anyhow::Result<()> {
    let mut docs = BTreeMap::new();
    docs.insert(
        "README.md".to_string(),
        std::fs::read_to_string(root.join("README.md"))?,
    );
    // docs/ and its design notes (docs/design/): a command a design note
    // shows is run by a test too.
    let mut paths = Vec::new();
    for dir in ["docs", "docs/design"] {
        for entry in std::fs::read_dir(root.join(dir))? {
            paths.push(entry?.path());
        }
    }
    for path in paths {
        if path.extension().is_some_and(|e| e == "md") {
            let name = path
                .strip_prefix(root)
                .unwrap_or(&path)
                .display()
                .to_string();
            docs.insert(name, std::fs::read_to_string(&path)?);
        }
    }
    let corpus = corpus(root)?;
    let mut problems = Vec::new();
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    let mut total = 0;
    for (name, text) in &docs {
        for d in extract(name, text) {
            total += 1;
            let covered = variable(root, &d).unwrap_or_else(|| cover(root, &d, &docs, &corpus));
            match covered {
                Ok(c) => {
                    let kind = match c {
                        Covered::Stage(_) => "a stage of cargo xtask test",
                        Covered::Test(_) => "a test running the same command",
                        Covered::LongForm(_) => "the long form of a bounded test",
                        Covered::Bench(_) => "a benchmark (smoke run by cargo xtask test)",
                        Covered::NotHere => "not runnable here (the doc says so)",
                    };
                    *counts.entry(kind).or_default() += 1;
                }
                Err(why) => problems.push(format!("{}:{}: `{}`: {why}", d.doc, d.line, d.command)),
            }
        }
    }
    if !problems.is_empty() {
        bail!(
            "documented commands that no test runs ({}):\n  {}",
            problems.len(),
            problems.join("\n  ")
        );
    }
    let summary: Vec<String> = counts.iter().map(|(k, n)| format!("{n} by {k}")).collect();
    println!(
        "documented commands: {total} in README.md and docs/, {}",
        summary.join(", ")
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_subcommand_is_found_in_a_shell_line_or_a_rust_argument_list() {
        assert!(runs("cli verify\n", &["verify"]));
        assert!(runs(
            r#"agent.cli(["cluster", "node", "remove", &n])"#,
            &["cluster", "node", "remove"]
        ));
        assert!(runs("\"$BIN\" maps dump --pin-root", &["maps", "dump"]));
        assert!(!runs("verifying", &["verify"]));
        assert!(!runs("maps_dump", &["maps", "dump"]));
    }

    #[test]
    fn shell_blocks_and_inline_commands_are_read_names_are_not() {
        let text = "Run `lockstep status` or `lockstep-cni`.\n```sh\nlockstep maps dump   # note\n# comment\n```\n`lockstep_lb_assigner` `LOCKSTEP_SKIP_PRIVILEGED=1`\n";
        let got: Vec<String> = extract("x.md", text)
            .into_iter()
            .map(|d| d.command)
            .collect();
        assert_eq!(
            got,
            [
                "lockstep status",
                "lockstep maps dump",
                "LOCKSTEP_SKIP_PRIVILEGED=1"
            ]
        );
    }

    #[test]
    fn subcommand_words_stop_at_flags_and_placeholders() {
        assert_eq!(
            subcommand("lockstep cluster node remove NAME"),
            ["cluster", "node", "remove"]
        );
        assert_eq!(
            subcommand("lockstep store reset-log --state-dir DIR"),
            ["store", "reset-log"]
        );
    }
}
