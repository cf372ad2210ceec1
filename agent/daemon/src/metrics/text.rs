//! The two exposition formats a scrape may ask for. prometheus-client
//! writes OpenMetrics, which Prometheus asks for by its `Accept` header;
//! everything else (promtool, older scrapers, `curl`) gets the Prometheus
//! text format 0.0.4, made from the same encoding: a counter family is
//! named with its `_total` samples, an info family with its `_info`
//! sample (a gauge there), and the lines 0.0.4 does not know (`# UNIT`,
//! `# EOF`, `_created` samples) are left out.

use std::collections::BTreeMap;

/// The content type of an OpenMetrics body.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The content type of a text format 0.0.4 body.
pub const TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Whether a request's `Accept` header asks for OpenMetrics.
pub fn wants_openmetrics(accept: Option<&str>) -> bool {
    accept.is_some_and(|a| {
        a.split(',').any(|part| {
            part.split(';').next().is_some_and(|t| {
                t.trim()
                    .eq_ignore_ascii_case("application/openmetrics-text")
            })
        })
    })
}

/// The text format 0.0.4 of an OpenMetrics body.
pub fn to_text(openmetrics: &str) -> String {
    // Each family's type, from its TYPE line (HELP comes before it).
    let types: BTreeMap<&str, &str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|rest| rest.split_once(' '))
        .collect();
    let renamed = |name: &str| -> (String, &str) {
        match types.get(name).copied() {
            Some("counter") => (format!("{name}_total"), "counter"),
            Some("info") => (format!("{name}_info"), "gauge"),
            Some(t) => (name.to_string(), t),
            None => (name.to_string(), "untyped"),
        }
    };
    let mut out = String::with_capacity(openmetrics.len());
    let mut counter = None::<&str>;
    for line in openmetrics.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            out.push_str(&format!("# HELP {} {help}\n", renamed(name).0));
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let name = rest.split_once(' ').map_or(rest, |(n, _)| n);
            let (new, t) = renamed(name);
            counter = (t == "counter").then_some(name);
            out.push_str(&format!("# TYPE {new} {t}\n"));
        } else if line.starts_with('#') {
            // `# UNIT`, `# EOF`: not in 0.0.4.
        } else if counter.is_some_and(|c| {
            line.strip_prefix(c)
                .is_some_and(|s| s.starts_with("_created"))
        }) {
            // A counter's creation time: OpenMetrics only.
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// A label value as both formats want it: backslash, double quote and line
/// feed escaped (prometheus-client writes values as given).
pub fn escape(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const OM: &str = "# HELP lockstep_errors Failed operations.\n\
                      # TYPE lockstep_errors counter\n\
                      lockstep_errors_total{code=\"x\"} 3\n\
                      lockstep_errors_created{code=\"x\"} 1.7e9\n\
                      # HELP lockstep_build Build.\n\
                      # TYPE lockstep_build info\n\
                      lockstep_build_info{version=\"0.1.0\"} 1\n\
                      # HELP lockstep_latency_seconds Latency.\n\
                      # TYPE lockstep_latency_seconds histogram\n\
                      # UNIT lockstep_latency_seconds seconds\n\
                      lockstep_latency_seconds_sum 0.5\n\
                      lockstep_latency_seconds_count 2\n\
                      lockstep_latency_seconds_bucket{le=\"+Inf\"} 2\n\
                      # HELP lockstep_free Free.\n\
                      # TYPE lockstep_free gauge\n\
                      lockstep_free{pool=\"a\"} 7\n\
                      # EOF\n";

    #[test]
    fn counters_and_infos_are_named_by_their_samples_and_openmetrics_lines_go() {
        assert_eq!(
            to_text(OM),
            "# HELP lockstep_errors_total Failed operations.\n\
             # TYPE lockstep_errors_total counter\n\
             lockstep_errors_total{code=\"x\"} 3\n\
             # HELP lockstep_build_info Build.\n\
             # TYPE lockstep_build_info gauge\n\
             lockstep_build_info{version=\"0.1.0\"} 1\n\
             # HELP lockstep_latency_seconds Latency.\n\
             # TYPE lockstep_latency_seconds histogram\n\
             lockstep_latency_seconds_sum 0.5\n\
             lockstep_latency_seconds_count 2\n\
             lockstep_latency_seconds_bucket{le=\"+Inf\"} 2\n\
             # HELP lockstep_free Free.\n\
             # TYPE lockstep_free gauge\n\
             lockstep_free{pool=\"a\"} 7\n"
        );
    }

    #[test]
    fn openmetrics_is_served_only_to_who_asks_for_it() {
        let prometheus = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert!(wants_openmetrics(Some(prometheus)));
        assert!(!wants_openmetrics(Some("text/plain")));
        assert!(!wants_openmetrics(Some("*/*")));
        assert!(!wants_openmetrics(None));
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
        assert_eq!(escape("10.0.0.0/24"), "10.0.0.0/24");
    }
}
