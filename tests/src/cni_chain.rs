//! A conflist run as libcni runs it, for tests that need what podman does
//! not pass (the `bandwidth` capability) or commands podman never sends
//! (CHECK).
//!
//! What libcni does with a conflist, and this does too: each plugin gets its
//! own object with the list's `name` and `cniVersion` added; the
//! `runtimeConfig` holds only the capability arguments the plugin declares
//! in `capabilities`; ADD runs the plugins in order, each with the previous
//! one's result as `prevResult`; CHECK runs them in order and DEL in
//! reverse, each with the ADD's final result as `prevResult`. Plugins are
//! found in one directory (`CNI_PATH`) and run inside the given namespace
//! (`nsenter --net`), as a runtime on that node would run them.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{Context, bail};
use serde_json::{Map, Value};

use crate::Netns;

/// One attachment of a conflist: the container's namespace, its ID, the
/// capability arguments a runtime would pass.
pub struct Chain {
    /// The conflist (as the agent wrote it).
    pub conflist: Value,
    /// Where the plugins are (`CNI_PATH`).
    pub bin_dir: PathBuf,
    /// `CNI_CONTAINERID`.
    pub container_id: String,
    /// `CNI_NETNS`.
    pub container_netns: PathBuf,
    /// Capability arguments (`portMappings`, `bandwidth`, ...).
    pub capability_args: Value,
}

impl Chain {
    /// Reads the conflist at `path`.
    ///
    /// # Errors
    /// It cannot be read or is not JSON.
    pub fn from_file(
        path: &Path,
        bin_dir: &Path,
        container_id: &str,
        container_netns: &Path,
        capability_args: Value,
    ) -> anyhow::Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        Ok(Self {
            conflist: serde_json::from_str(&text)?,
            bin_dir: bin_dir.to_path_buf(),
            container_id: container_id.to_string(),
            container_netns: container_netns.to_path_buf(),
            capability_args,
        })
    }

    fn plugins(&self) -> anyhow::Result<Vec<Value>> {
        self.conflist["plugins"]
            .as_array()
            .cloned()
            .context("the conflist has no plugins")
    }

    /// The configuration one plugin reads on stdin.
    fn plugin_config(&self, plugin: &Value, prev: Option<&Value>) -> anyhow::Result<Value> {
        let mut conf = plugin
            .as_object()
            .cloned()
            .context("a plugin is no object")?;
        conf.insert("name".into(), self.conflist["name"].clone());
        conf.insert("cniVersion".into(), self.conflist["cniVersion"].clone());
        let mut runtime = Map::new();
        if let Some(caps) = plugin["capabilities"].as_object() {
            for (cap, on) in caps {
                if on.as_bool() == Some(true)
                    && let Some(arg) = self.capability_args.get(cap)
                {
                    runtime.insert(cap.clone(), arg.clone());
                }
            }
        }
        if !runtime.is_empty() {
            conf.insert("runtimeConfig".into(), Value::Object(runtime));
        }
        if let Some(prev) = prev {
            conf.insert("prevResult".into(), prev.clone());
        }
        Ok(Value::Object(conf))
    }

    /// Runs one plugin inside `node`; its stdout on success.
    fn exec(&self, node: &Netns, command: &str, config: &Value) -> anyhow::Result<String> {
        let kind = config["type"].as_str().context("a plugin has no type")?;
        let mut child = node
            .command(self.bin_dir.join(kind))
            .env("CNI_COMMAND", command)
            .env("CNI_CONTAINERID", &self.container_id)
            .env("CNI_NETNS", &self.container_netns)
            .env("CNI_IFNAME", "eth0")
            .env("CNI_PATH", &self.bin_dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {kind}"))?;
        child
            .stdin
            .take()
            .context("stdin")?
            .write_all(config.to_string().as_bytes())?;
        let out = child.wait_with_output()?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if !out.status.success() {
            bail!(
                "{kind} {command} failed ({}): {stdout}{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(stdout)
    }

    /// ADD through the whole list; the final result.
    ///
    /// # Errors
    /// A plugin failed (named, with its error), or printed no result.
    pub fn add(&self, node: &Netns) -> anyhow::Result<Value> {
        let mut prev: Option<Value> = None;
        for plugin in self.plugins()? {
            let config = self.plugin_config(&plugin, prev.as_ref())?;
            let out = self.exec(node, "ADD", &config)?;
            prev = Some(
                serde_json::from_str(&out)
                    .with_context(|| format!("{} ADD printed no result: {out}", plugin["type"]))?,
            );
        }
        prev.context("an empty conflist")
    }

    /// CHECK of every plugin of the list, in order, with `result` as
    /// `prevResult`: each plugin's type and outcome (libcni stops at the
    /// first failure; this runs them all, so a test can tell which failed).
    ///
    /// # Errors
    /// The conflist has no plugin list.
    pub fn check(
        &self,
        node: &Netns,
        result: &Value,
    ) -> anyhow::Result<Vec<(String, anyhow::Result<String>)>> {
        let mut outcomes = Vec::new();
        for plugin in self.plugins()? {
            let kind = plugin["type"].as_str().unwrap_or_default().to_string();
            let outcome = self
                .plugin_config(&plugin, Some(result))
                .and_then(|config| self.exec(node, "CHECK", &config));
            outcomes.push((kind, outcome));
        }
        Ok(outcomes)
    }

    /// DEL through the list in reverse, with `result` as `prevResult`
    /// (`None`: the runtime has none, after a failed ADD).
    ///
    /// # Errors
    /// A plugin failed.
    pub fn del(&self, node: &Netns, result: Option<&Value>) -> anyhow::Result<()> {
        for plugin in self.plugins()?.iter().rev() {
            self.exec(node, "DEL", &self.plugin_config(plugin, result)?)?;
        }
        Ok(())
    }
}
