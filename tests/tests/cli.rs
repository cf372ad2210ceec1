//! The CLI's output formats and shell completion, as an operator uses them.
//!
//! - `-o yaml` prints the same document as `-o json` (pools and
//!   allocations of a running agent, the counters of its pins).
//! - `lockstep completion bash` prints a script bash reads, which
//!   completes `lockstep` subcommands and flags (run in bash with
//!   `COMP_WORDS` set, as bash-completion calls it); zsh and fish scripts
//!   are printed too.

use anyhow::ensure;
use lockstep_tests::{AgentProc, Netns, lockstep_bin, privileged};
use serde_json::Value;

fn yaml(text: &str) -> anyhow::Result<Value> {
    serde_saphyr::from_str(text).map_err(|e| anyhow::anyhow!("{e}: {text}"))
}

#[test]
fn yaml_output_is_the_json_document() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("cliyaml")?;
    let agent = AgentProc::start(
        &node,
        "[[pools]]\nname = \"pods\"\nipv4 = [\"10.61.0.0/24\"]\nipv6 = [\"fd61::/120\"]\n",
    )?;
    agent.json([
        "allocate", "--name", "web", "--family", "ipv4", "-o", "json",
    ])?;
    for args in [["pools"], ["allocations"], ["status"]] {
        let json = agent.json(args.iter().copied().chain(["-o", "json"]))?;
        let out = agent.cli(args.iter().copied().chain(["-o", "yaml"]))?;
        ensure!(out.status.success(), "{args:?} -o yaml failed");
        let text = String::from_utf8(out.stdout)?;
        let from_yaml = yaml(&text)?;
        // `status` carries uptimes and timings that move between calls:
        // the same keys, and the same values apart from those.
        if args == ["status"] {
            let keys = |v: &Value| {
                v.as_object()
                    .map(|o| o.keys().cloned().collect::<Vec<_>>())
                    .unwrap_or_default()
            };
            ensure!(
                keys(&json) == keys(&from_yaml),
                "status: {json} vs {from_yaml}"
            );
            ensure!(json["ready"] == from_yaml["ready"], "{json} vs {from_yaml}");
        } else {
            ensure!(json == from_yaml, "{args:?}: {json} vs {from_yaml}");
        }
    }
    let counters = std::process::Command::new(lockstep_bin())
        .args(["datapath", "counters", "-o", "yaml"])
        .args(agent.pins.arg())
        .output()?;
    ensure!(counters.status.success(), "datapath counters -o yaml");
    let c = yaml(&String::from_utf8(counters.stdout)?)?;
    ensure!(
        c.as_object().is_some_and(|o| !o.is_empty()),
        "counters: {c}"
    );
    Ok(())
}

#[test]
fn bash_completion_completes_subcommands_and_flags() -> anyhow::Result<()> {
    let script = std::process::Command::new(lockstep_bin())
        .args(["completion", "bash"])
        .output()?;
    ensure!(script.status.success(), "completion bash failed");
    let dir = lockstep_tests::TempDir::new("completion")?;
    let file = dir.path().join("lockstep.bash");
    std::fs::write(&file, &script.stdout)?;
    // Completing `lockstep man` and `lockstep manifests --mo` as
    // bash-completion does: the function the script registers, called with
    // the words typed so far.
    let complete = |words: &[&str]| -> anyhow::Result<Vec<String>> {
        let line = words.join(" ");
        let program = format!(
            "source {file}\nCOMP_WORDS=({line})\nCOMP_CWORD={cword}\nCOMP_LINE='{line}'\nCOMP_POINT=${{#COMP_LINE}}\n\
             f=$(complete -p lockstep | sed -E 's/.*-F ([^ ]+).*/\\1/')\n\"$f\" lockstep '{cur}' '{prev}'\nprintf '%s\\n' \"${{COMPREPLY[@]}}\"",
            file = file.display(),
            cword = words.len() - 1,
            cur = words[words.len() - 1],
            prev = words[words.len() - 2],
        );
        let out = std::process::Command::new("bash")
            .args(["--norc", "-c", &program])
            .output()?;
        ensure!(
            out.status.success(),
            "bash: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(String::from_utf8(out.stdout)?
            .lines()
            .map(str::to_string)
            .collect())
    };
    let subcommands = complete(&["lockstep", "man"])?;
    ensure!(
        subcommands == ["manifests"],
        "lockstep man<TAB>: {subcommands:?}"
    );
    let flags = complete(&["lockstep", "manifests", "--mo"])?;
    ensure!(
        flags == ["--mode"],
        "lockstep manifests --mo<TAB>: {flags:?}"
    );
    for shell in ["zsh", "fish"] {
        let out = std::process::Command::new(lockstep_bin())
            .args(["completion", shell])
            .output()?;
        ensure!(out.status.success(), "completion {shell}");
        let text = String::from_utf8(out.stdout)?;
        ensure!(
            text.contains("manifests") && text.contains("uninstall"),
            "{shell}'s script names no subcommand"
        );
    }
    let bad = std::process::Command::new(lockstep_bin())
        .args(["completion", "tcsh"])
        .output()?;
    let said = String::from_utf8_lossy(&bad.stderr);
    ensure!(
        !bad.status.success() && said.contains("tcsh"),
        "an unknown shell: {said}"
    );
    Ok(())
}
