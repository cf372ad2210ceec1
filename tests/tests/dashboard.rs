//! #45 item 3: the Grafana dashboard (`deploy/grafana-dashboard.json`) and
//! the alerts (`deploy/prometheus-rules.yaml`) query only families the
//! agent exports (those docs/metrics.md lists; the live scrapes in
//! `metrics.rs` and `cluster_lb_e2e.rs` check that list against the
//! agent), and every dashboard query is PromQL Prometheus accepts: each is
//! checked by `promtool check rules` as a recording rule.

use std::collections::BTreeSet;
use std::path::Path;

use anyhow::{Context, ensure};

fn root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// The `lockstep_*` names a query uses, a histogram's series
/// (`_bucket`, `_sum`, `_count`) named by their family.
fn families_in(query: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = query;
    while let Some(at) = rest.find("lockstep_") {
        let name: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        rest = &rest[at + name.len()..];
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(&name)
            .to_string();
        out.insert(family);
    }
    out
}

#[test]
fn dashboard_and_alerts_query_documented_families_in_valid_promql() -> anyhow::Result<()> {
    let doc = std::fs::read_to_string(root().join("docs/metrics.md"))?;
    let dashboard: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(
        root().join("deploy/grafana-dashboard.json"),
    )?)?;
    let queries: Vec<String> = dashboard["panels"]
        .as_array()
        .context("panels")?
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .filter_map(|t| t["expr"].as_str().map(str::to_string))
        .collect();
    ensure!(queries.len() >= 10, "{} dashboard queries", queries.len());
    let rules = std::fs::read_to_string(root().join("deploy/prometheus-rules.yaml"))?;
    let alert_queries: Vec<&str> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("expr:"))
        .collect();
    let mut used = BTreeSet::new();
    for q in queries.iter().map(String::as_str).chain(alert_queries) {
        used.extend(families_in(q));
    }
    // The multi-line alert expression's names are on its next lines.
    used.extend(families_in(&rules));
    let undocumented: Vec<&String> = used
        .iter()
        .filter(|f| !doc.contains(&format!("`{f}`")))
        .collect();
    ensure!(
        undocumented.is_empty(),
        "queried but not exported (not in docs/metrics.md): {undocumented:?}"
    );

    // Each dashboard query as a recording rule, for promtool's parser.
    let dir = lockstep_tests::TempDir::new("dashboard")?;
    let file = dir.path().join("dashboard-rules.yaml");
    let mut text = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, q) in queries.iter().enumerate() {
        text.push_str(&format!(
            "      - record: lockstep:dashboard_{i}\n        expr: {}\n",
            serde_json::to_string(q)?
        ));
    }
    std::fs::write(&file, text)?;
    let out = std::process::Command::new("promtool")
        .args(["check", "rules"])
        .arg(&file)
        .output()
        .context("promtool (the prometheus package, installed by setup)")?;
    let said =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    ensure!(
        out.status.success(),
        "promtool on the dashboard's queries:\n{said}"
    );
    eprintln!(
        "{} dashboard queries valid; {} families queried, all exported",
        queries.len(),
        used.len()
    );
    Ok(())
}
