//! #45 items 3 and 4: metrics Prometheus can use, and the health probes,
//! on a live agent in a node namespace.
//!
//! - A scrape is clean for `promtool check metrics` (Prometheus's own
//!   linter, the `prometheus` package setup installs); OpenMetrics is served
//!   to who asks for it (Prometheus does), with its content type, and the
//!   text format 0.0.4 otherwise. Counters are `_total`, the build, each
//!   map's capacity and the datapath's drops by reason are exported, and
//!   every family is in docs/metrics.md.
//! - `/healthz` and `/readyz` answer on the metrics listener; an agent whose
//!   lock is held past the reconcile loop's allowance (strace delays its
//!   commit's fdatasync 40 s) fails `/healthz`, naming the loop, and passes
//!   again once the commit returns.
//! - A scrape right after an answer shows that answer's change (the owner
//!   refreshes the gauges before answering a batch; the scrape never asks
//!   it).

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{Context, ensure};
use lockstep_tests::{
    AgentProc, Netns, delay_fsyncs, metrics_addr, privileged, promtool_check_metrics,
    undocumented_families, until,
};

const CONFIG: &str = r#"
reconcile_interval = "1s"
[[pools]]
name = "default"
ipv4 = ["10.67.0.0/24"]
ipv6 = ["fd00:67::/120"]
"#;

/// GET `path` on the metrics listener with `curl -i` (extra arguments
/// before the URL): the status, the headers and the body.
fn get(
    node: &Netns,
    addr: &str,
    path: &str,
    extra: &[&str],
) -> anyhow::Result<(u16, String, String)> {
    let url = format!("http://{addr}{path}");
    let mut args = vec!["-s", "-i", "-m", "10"];
    args.extend_from_slice(extra);
    args.push(&url);
    let out = node.exec("curl", args)?;
    let (head, body) = out
        .split_once("\r\n\r\n")
        .with_context(|| format!("no complete answer: {out:?}"))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .context("no status line")?
        .parse()?;
    Ok((status, head.to_lowercase(), body.to_string()))
}

/// The families of a text-format scrape (its TYPE lines).
fn families(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

#[test]
fn a_live_scrape_is_clean_for_promtool_in_both_formats_and_documented() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("metrics")?;
    let mut agent = AgentProc::start(&node, CONFIG)?;
    let addr = metrics_addr(&node)?.to_string();
    // An allocation, and an error (a pool that does not exist), so the
    // families have samples.
    let out = agent.cli([
        "allocate", "--kind", "endpoint", "--name", "m1", "--family", "ipv4",
    ])?;
    ensure!(out.status.success(), "allocate: {out:?}");
    let out = agent.cli([
        "allocate", "--kind", "endpoint", "--name", "m2", "--family", "ipv4", "--pool", "nope",
    ])?;
    ensure!(
        !out.status.success(),
        "an allocation from an unknown pool succeeded"
    );

    // Within a refresh the counters show the error.
    let mut text = String::new();
    until(Duration::from_secs(10), "the error counted", || {
        let (status, head, body) = get(&node, &addr, "/metrics", &[])?;
        ensure!(status == 200, "scrape answered {status}: {body}");
        ensure!(
            head.contains("content-type: text/plain; version=0.0.4"),
            "plain scrape's headers: {head}"
        );
        text = body;
        let counted = text
            .lines()
            .any(|l| l.starts_with("lockstep_errors_total{code="));
        Ok((!counted).then(|| text.clone()))
    })?;
    promtool_check_metrics(&text)?;
    ensure!(!text.contains("# EOF"), "the text format has no EOF line");
    let version = agent.status_json().context("status")?["version"]
        .as_str()
        .context("status version")?
        .to_string();
    for want in [
        format!("lockstep_build_info{{version=\"{version}\"}} 1"),
        "lockstep_map_capacity{map=\"IPCACHE_HOST_V4\"}".to_string(),
        "lockstep_map_entries{map=\"IPCACHE_HOST_V4\"}".to_string(),
        "lockstep_datapath_packets_total{counter=\"from_endpoint_passed\"}".to_string(),
        "# TYPE lockstep_datapath_drops_total counter".to_string(),
        "# TYPE lockstep_reconcile_repairs_total counter".to_string(),
        "lockstep_pool_allocated{pool=\"default\",family=\"ipv4\"} 1".to_string(),
    ] {
        ensure!(text.contains(&want), "no {want:?} in the scrape:\n{text}");
    }
    // No family mixes a 0/1 flag with counts, and counters are `_total`.
    for line in text.lines().filter_map(|l| l.strip_prefix("# TYPE ")) {
        let (name, kind) = line.split_once(' ').context("TYPE line")?;
        ensure!(
            (kind == "counter") == name.ends_with("_total"),
            "family {name} of type {kind}"
        );
    }

    // OpenMetrics to who asks for it, as Prometheus does.
    let prometheus_accept = "Accept: application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
    let (status, head, om) = get(&node, &addr, "/metrics", &["-H", prometheus_accept])?;
    ensure!(status == 200, "OpenMetrics scrape answered {status}");
    ensure!(
        head.contains("content-type: application/openmetrics-text; version=1.0.0"),
        "OpenMetrics scrape's headers: {head}"
    );
    ensure!(
        om.ends_with("# EOF\n"),
        "OpenMetrics ends with # EOF:\n{om}"
    );
    ensure!(
        om.contains("# TYPE lockstep_errors counter") && om.contains("lockstep_errors_total{code="),
        "OpenMetrics counters:\n{om}"
    );

    // Every family is in the metrics reference.
    let missing = undocumented_families(&text)?;
    ensure!(
        missing.is_empty(),
        "families not in docs/metrics.md: {missing:?}"
    );
    eprintln!(
        "promtool: clean on {} lines, {} families, all documented",
        text.lines().count(),
        families(&text).len()
    );
    agent.stop()?;
    Ok(())
}

#[test]
fn healthz_fails_while_the_agent_is_stuck_and_readyz_answers_ready() -> anyhow::Result<()> {
    privileged!();
    let node = Netns::new("health")?;
    let mut agent = AgentProc::start(&node, CONFIG)?;
    let addr = metrics_addr(&node)?.to_string();
    let (status, _, body) = get(&node, &addr, "/readyz", &[])?;
    ensure!(
        status == 200 && body == "ready\n",
        "readyz: {status} {body:?}"
    );
    let (status, _, body) = get(&node, &addr, "/healthz", &[])?;
    ensure!(
        status == 200 && body == "ok\n",
        "healthz: {status} {body:?}"
    );

    // An allocation whose commit's fdatasync takes 40 s holds the agent's
    // lock that long: the reconcile loop cannot finish a pass (allowance:
    // three 1 s periods and 30 s).
    let pid = agent.pid().context("agent pid")?;
    let mut strace = delay_fsyncs(pid, Duration::from_secs(40))?;
    std::thread::sleep(Duration::from_millis(800));
    let outcome = std::thread::scope(|s| -> anyhow::Result<()> {
        let alloc = s.spawn(|| {
            agent.cli([
                "allocate", "--kind", "endpoint", "--name", "stuck", "--family", "ipv4",
            ])
        });
        let took = until(Duration::from_secs(50), "healthz to fail", || {
            let (status, _, body) = get(&node, &addr, "/healthz", &[])?;
            Ok((status != 503).then(|| format!("{status} {body:?}")))
        })?;
        let (_, _, body) = get(&node, &addr, "/healthz", &[])?;
        eprintln!(
            "healthz failed {:.1} s into the stall: {body:?}",
            took.as_secs_f64()
        );
        ensure!(
            body.contains("reconcile silent for"),
            "healthz names the loop: {body:?}"
        );
        // SAFETY: kill has no memory preconditions; SIGINT makes strace
        // detach, and the delayed call returns.
        unsafe { libc::kill(strace.id() as i32, libc::SIGINT) };
        let out = alloc
            .join()
            .map_err(|_| anyhow::anyhow!("the allocating thread panicked"))??;
        ensure!(
            out.status.success(),
            "the stalled allocation failed: {out:?}"
        );
        Ok(())
    });
    // SAFETY: as above; a second SIGINT to a gone strace is harmless.
    unsafe { libc::kill(strace.id() as i32, libc::SIGINT) };
    let _ = strace.wait();
    outcome?;
    let back = until(Duration::from_secs(10), "healthz to pass again", || {
        let (status, _, body) = get(&node, &addr, "/healthz", &[])?;
        Ok((status != 200).then(|| format!("{status} {body:?}")))
    })?;
    eprintln!(
        "healthz passed again {:.1} s after the stall ended",
        back.as_secs_f64()
    );
    agent.stop()?;
    Ok(())
}

/// The gauges are refreshed by the agent's owner before it answers a
/// batch, so a scrape right after an answer shows that change, without
/// the scrape asking the owner (it never waits for it) and long before
/// the 2 s background refresh.
#[test]
fn a_scrape_right_after_an_answer_shows_its_change() -> anyhow::Result<()> {
    privileged!();
    use lockstep_tests::cluster::sample;
    let node = Netns::new("metrics-fresh")?;
    let mut agent = AgentProc::start(&node, CONFIG)?;
    let addr = metrics_addr(&node)?.to_string();
    let allocated = "lockstep_pool_allocated{pool=\"default\",family=\"ipv4\"}";
    let scrape = || -> anyhow::Result<String> {
        let (status, _, body) = get(&node, &addr, "/metrics", &[])?;
        ensure!(status == 200, "scrape answered {status}: {body}");
        Ok(body)
    };
    let first = scrape()?;
    let commits = sample(&first, "lockstep_store_commits_total").context("no commit count")?;
    for n in 1..=5u32 {
        let name = format!("fresh-{n}");
        let out = agent.cli([
            "allocate", "--kind", "endpoint", "--name", &name, "--family", "ipv4",
        ])?;
        ensure!(out.status.success(), "allocate {name}: {out:?}");
        let text = scrape()?;
        ensure!(
            sample(&text, allocated) == Some(f64::from(n)),
            "right after allocation {n} the scrape shows {:?}",
            sample(&text, allocated)
        );
        ensure!(
            sample(&text, "lockstep_store_commits_total") >= Some(commits + f64::from(n)),
            "the store's commits did not follow allocation {n}"
        );
    }
    let out = agent.cli([
        "release", "--kind", "endpoint", "--name", "fresh-1", "--family", "ipv4",
    ])?;
    ensure!(out.status.success(), "release: {out:?}");
    let text = scrape()?;
    ensure!(
        sample(&text, allocated) == Some(4.0),
        "right after the release the scrape shows {:?}",
        sample(&text, allocated)
    );
    agent.stop()?;
    Ok(())
}
