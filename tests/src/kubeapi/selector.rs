//! Label selectors as the API's `labelSelector` query parameter writes
//! them: `k=v`, `k==v`, `k!=v`, `k`, `!k`, `k in (a,b)`, `k notin (a,b)`,
//! comma-separated, all of which must hold; and field selectors
//! (`fieldSelector`): `path=v`, `path==v`, `path!=v` on the fields the API
//! server indexes for the kinds served (`metadata.name`,
//! `metadata.namespace`, `spec.nodeName`, `status.phase`), anything else
//! refused as the API server refuses it.

use std::collections::BTreeMap;

/// One requirement.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Requirement {
    /// `k=v` / `k==v`.
    Equals(String, String),
    /// `k!=v`: absent or another value.
    NotEquals(String, String),
    /// `k`.
    Exists(String),
    /// `!k`.
    Absent(String),
    /// `k in (a,b)`.
    In(String, Vec<String>),
    /// `k notin (a,b)`: absent or none of them.
    NotIn(String, Vec<String>),
}

/// A parsed selector (empty: everything).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Selector(pub Vec<Requirement>);

/// Splits on commas outside parentheses.
fn split(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                out.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&text[start..]);
    out
}

fn set(text: &str) -> Result<Vec<String>, String> {
    let t = text.trim();
    let inner = t
        .strip_prefix('(')
        .and_then(|t| t.strip_suffix(')'))
        .ok_or_else(|| format!("expected (values) in {text:?}"))?;
    Ok(inner.split(',').map(|v| v.trim().to_string()).collect())
}

impl Selector {
    /// Parses `text`.
    ///
    /// # Errors
    /// A malformed requirement, quoted.
    pub fn parse(text: &str) -> Result<Selector, String> {
        let mut out = Vec::new();
        for part in split(text)
            .into_iter()
            .map(str::trim)
            .filter(|p| !p.is_empty())
        {
            let r = if let Some((k, v)) = part.split_once("!=") {
                Requirement::NotEquals(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = part.split_once("==") {
                Requirement::Equals(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = part.split_once('=') {
                Requirement::Equals(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = part.split_once(" notin ") {
                Requirement::NotIn(k.trim().into(), set(v)?)
            } else if let Some((k, v)) = part.split_once(" in ") {
                Requirement::In(k.trim().into(), set(v)?)
            } else if let Some(k) = part.strip_prefix('!') {
                Requirement::Absent(k.trim().into())
            } else if part
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
            {
                Requirement::Exists(part.into())
            } else {
                return Err(format!("unable to parse requirement {part:?}"));
            };
            out.push(r);
        }
        Ok(Selector(out))
    }

    /// Whether `labels` are selected.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.0.iter().all(|r| match r {
            Requirement::Equals(k, v) => labels.get(k) == Some(v),
            Requirement::NotEquals(k, v) => labels.get(k) != Some(v),
            Requirement::Exists(k) => labels.contains_key(k),
            Requirement::Absent(k) => !labels.contains_key(k),
            Requirement::In(k, vs) => labels.get(k).is_some_and(|v| vs.contains(v)),
            Requirement::NotIn(k, vs) => !labels.get(k).is_some_and(|v| vs.contains(v)),
        })
    }
}

/// The fields every kind may be selected on.
const COMMON_FIELDS: [&str; 2] = ["metadata.name", "metadata.namespace"];

/// The fields the API server selects `plural` on beyond the common ones,
/// of those the double models (string fields only).
fn kind_fields(plural: &str) -> &'static [&'static str] {
    match plural {
        "pods" => &["spec.nodeName", "status.phase"],
        "namespaces" => &["status.phase"],
        "services" => &["spec.type", "spec.clusterIP"],
        "events" => &["reason", "type"],
        _ => &[],
    }
}
/// A list's or watch's whole filter: labels and fields.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Filter {
    /// `labelSelector`.
    pub labels: Selector,
    /// `fieldSelector`: (path, equal?, value).
    pub fields: Vec<(String, bool, String)>,
}

impl Filter {
    /// Parses a `labelSelector` and a `fieldSelector` of a list or watch
    /// of `plural`.
    ///
    /// # Errors
    /// A malformed requirement, or a field the API does not select that
    /// kind on (`field label not supported`, as the API server says).
    pub fn parse(labels: &str, fields: &str, plural: &str) -> Result<Filter, String> {
        let mut out = Vec::new();
        for part in fields.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (path, equal, value) = if let Some((k, v)) = part.split_once("!=") {
                (k, false, v)
            } else if let Some((k, v)) = part.split_once("==") {
                (k, true, v)
            } else if let Some((k, v)) = part.split_once('=') {
                (k, true, v)
            } else {
                return Err(format!("invalid field selector {part:?}"));
            };
            let path = path.trim();
            if !COMMON_FIELDS.contains(&path) && !kind_fields(plural).contains(&path) {
                return Err(format!("field label not supported: {path}"));
            }
            out.push((path.to_string(), equal, value.trim().to_string()));
        }
        Ok(Filter {
            labels: Selector::parse(labels)?,
            fields: out,
        })
    }

    /// Whether `object` is selected.
    pub fn matches(&self, object: &serde_json::Value) -> bool {
        let labels: BTreeMap<String, String> = object["metadata"]["labels"]
            .as_object()
            .map(|m| {
                m.iter()
                    .filter_map(|(k, v)| v.as_str().map(|s| (k.clone(), s.to_string())))
                    .collect()
            })
            .unwrap_or_default();
        self.labels.matches(&labels)
            && self.fields.iter().all(|(path, equal, value)| {
                let got = path
                    .split('.')
                    .fold(object, |v, p| &v[p])
                    .as_str()
                    .unwrap_or_default();
                (got == value) == *equal
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_form_parses_and_matches() {
        let l: BTreeMap<String, String> = [
            ("app".to_string(), "web".to_string()),
            ("zone".into(), "a".into()),
        ]
        .into();
        for (text, want) in [
            ("", true),
            ("app=web", true),
            ("app==web,zone=a", true),
            ("app!=web", false),
            ("tier!=x", true),
            ("app", true),
            ("!app", false),
            ("!tier", true),
            ("zone in (a, b)", true),
            ("zone notin (a,b)", false),
            ("tier notin (a)", true),
            ("app=web,zone in (b)", false),
        ] {
            assert_eq!(Selector::parse(text).unwrap().matches(&l), want, "{text}");
        }
        assert!(Selector::parse("zone in a").is_err());
        assert!(Selector::parse("a b").is_err());
    }

    #[test]
    fn field_selectors_select_on_the_indexed_fields_only() {
        let pod = serde_json::json!({
            "metadata": {"name": "web", "namespace": "shop", "labels": {"app": "web"}},
            "spec": {"nodeName": "node-a"},
        });
        for (labels, fields, want) in [
            ("", "spec.nodeName=node-a", true),
            ("", "spec.nodeName=node-b", false),
            ("", "spec.nodeName!=node-b,metadata.namespace==shop", true),
            ("app=web", "metadata.name=web", true),
            ("app=db", "metadata.name=web", false),
            ("", "status.phase=Running", false),
        ] {
            assert_eq!(
                Filter::parse(labels, fields, "pods").unwrap().matches(&pod),
                want,
                "{labels} {fields}"
            );
        }
        let e = Filter::parse("", "spec.hostname=x", "pods").unwrap_err();
        assert!(e.contains("field label not supported"), "{e}");
        assert!(Filter::parse("", "spec.nodeName", "pods").is_err());
        // Per kind, as the API server: Pods by node, not Services or Leases.
        for plural in ["services", "leases", "endpointslices", "nodes"] {
            let e = Filter::parse("", "spec.nodeName=node-a", plural).unwrap_err();
            assert!(
                e.contains("field label not supported: spec.nodeName"),
                "{plural}: {e}"
            );
            assert!(
                Filter::parse("", "metadata.name=x", plural).is_ok(),
                "{plural}"
            );
        }
        assert!(Filter::parse("", "spec.type=LoadBalancer", "services").is_ok());
    }
}
