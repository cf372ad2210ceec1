//! The configuration reference (`docs/configuration.md`), generated from
//! the config types: their JSON schema (`schemars`, doc comments as
//! descriptions, defaults from the types' `Default`s and `serde`
//! defaults) rendered as one table per section. `cargo xtask
//! config-reference` writes it; a unit test fails while the committed file
//! differs, so the reference cannot drift from the code.

use std::borrow::Cow;
use std::fmt::Write as _;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde_json::{Map, Value};

use super::Config;

/// Where the reference is committed, relative to the repository root.
pub const PATH: &str = "docs/configuration.md";

/// The schema of a duration written as text (`10s`, `1m 30s`, `2h`), as
/// `humantime_serde` reads it.
pub(crate) struct HumanDuration;

impl JsonSchema for HumanDuration {
    fn inline_schema() -> bool {
        true
    }

    fn schema_name() -> Cow<'static, str> {
        "HumanDuration".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({"type": "string", "format": "duration"})
    }
}

/// The config's JSON schema.
pub fn schema() -> Value {
    schemars::schema_for!(Config).to_value()
}

/// The reference as markdown, as `docs/configuration.md` holds it.
pub fn markdown() -> String {
    let root = schema();
    let defs = root
        .get("$defs")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    let mut out = String::from(HEADER);
    let mut r = Renderer {
        defs,
        out: &mut out,
    };
    r.section("", &root, None);
    out
}

const HEADER: &str = "\
# Configuration reference

<!-- Generated from agent/daemon/src/config.rs and agent/daemon/src/config/
by `cargo xtask config-reference`; do not edit. A unit test fails while this
file differs from what the config types produce. -->

The agent reads one TOML file: `lockstep agent --config FILE`, by default
`/etc/lockstep/config.toml`. With no file at the default path the agent runs
on the defaults below (one local pool, `default`). A key the agent does not
know, or a value of the wrong type, is refused with the file, the key and the
line; a value that parses but is not acceptable is refused naming the key.
`lockstep config check /etc/lockstep/config.toml` names every such value
without starting anything (exit 1 if any). `deploy/config.example.toml` is a
commented example.

Durations are written as text: `500ms`, `10s`, `2m`, `1h 30m`. A key marked
*required* has no default: its section, when present, must set it. A
section whose default is \"absent\" turns a mode on by being written.

";

/// Walks the schema, one section at a time.
struct Renderer<'a> {
    defs: Map<String, Value>,
    out: &'a mut String,
}

impl Renderer<'_> {
    /// `schema` with a `$ref` replaced by its definition (the property's
    /// own description kept beside it).
    fn resolve(&self, schema: &Value) -> Value {
        let mut schema = schema.clone();
        // `Option<T>` of a referenced type: `anyOf: [T, null]`.
        if let Some(any) = schema.get("anyOf").and_then(Value::as_array) {
            let some: Vec<&Value> = any
                .iter()
                .filter(|s| s.get("type").and_then(Value::as_str) != Some("null"))
                .collect();
            if let [only] = some.as_slice() {
                let only = (*only).clone();
                if let Some(obj) = schema.as_object_mut() {
                    obj.remove("anyOf");
                    if let Some(o) = only.as_object() {
                        for (k, v) in o {
                            obj.entry(k.clone()).or_insert_with(|| v.clone());
                        }
                    }
                    obj.insert("nullable".into(), Value::Bool(true));
                }
            }
        }
        let Some(reference) = schema.get("$ref").and_then(Value::as_str) else {
            return schema;
        };
        let name = reference.rsplit('/').next().unwrap_or_default();
        let mut target = self.defs.get(name).cloned().unwrap_or(Value::Null);
        if let (Some(t), Some(s)) = (target.as_object_mut(), schema.as_object()) {
            for key in ["description", "default", "nullable"] {
                if let Some(v) = s.get(key) {
                    t.insert(key.into(), v.clone());
                }
            }
        }
        target
    }

    /// Whether `schema` (resolved) is a table of named keys: a section.
    fn is_section(schema: &Value) -> bool {
        schema.get("properties").is_some()
    }

    /// One section: its description, its table of keys, then its
    /// subsections. `name` is the dotted path ("" for the top level);
    /// `header` the TOML header to show (`[x]` or `[[x]]`).
    fn section(&mut self, name: &str, schema: &Value, header: Option<&str>) {
        let schema = self.resolve(schema);
        let Some(props) = schema.get("properties").and_then(Value::as_object) else {
            return;
        };
        let required: Vec<&str> = schema
            .get("required")
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        match header {
            None => {
                let _ = writeln!(self.out, "## Top level\n");
                let _ = writeln!(self.out, "Keys written before any `[section]` header.\n");
            }
            Some(h) => {
                let _ = writeln!(self.out, "## `{h}`\n");
                if let Some(d) = schema.get("description").and_then(Value::as_str) {
                    let _ = writeln!(self.out, "{}\n", paragraph(d));
                }
                if nullable(&schema) {
                    let _ = writeln!(self.out, "Default: absent (the section is optional).\n");
                }
                if let Some(d) = schema.get("default").filter(|d| d.is_array()) {
                    let _ = writeln!(
                        self.out,
                        "Default (no `{h}` in the file): `{}`.\n",
                        compact(d)
                    );
                }
            }
        }
        let mut subsections = Vec::new();
        let _ = writeln!(self.out, "| key | type | default | description |");
        let _ = writeln!(self.out, "| --- | --- | --- | --- |");
        for (key, prop) in props {
            let resolved = self.resolve(prop);
            let dotted = if name.is_empty() {
                key.clone()
            } else {
                format!("{name}.{key}")
            };
            if Self::is_section(&resolved) {
                subsections.push((dotted.clone(), prop.clone(), format!("[{dotted}]")));
                continue;
            }
            if let Some(items) = resolved.get("items") {
                let item = self.resolve(items);
                if Self::is_section(&item) {
                    let mut item = items.clone();
                    if let (Some(i), Some(d)) = (item.as_object_mut(), resolved.get("default")) {
                        i.insert("default".into(), d.clone());
                    }
                    // The array's own description wins over the item type's.
                    if let (Some(i), Some(d)) = (item.as_object_mut(), prop.get("description")) {
                        i.insert("description".into(), d.clone());
                    }
                    subsections.push((dotted.clone(), item, format!("[[{dotted}]]")));
                    continue;
                }
            }
            let default = if required.contains(&key.as_str()) {
                "*required*".to_string()
            } else {
                match resolved.get("default") {
                    Some(Value::Null) | None => empty_default(&resolved),
                    Some(v) => format!("`{}`", compact(v).replace('|', "\\|")),
                }
            };
            let description = resolved
                .get("description")
                .and_then(Value::as_str)
                .map(paragraph)
                .unwrap_or_default();
            let _ = writeln!(
                self.out,
                "| `{key}` | {} | {default} | {} |",
                self.type_of(&resolved),
                description.replace('|', "\\|")
            );
        }
        let _ = writeln!(self.out);
        for (dotted, prop, header) in subsections {
            self.section(&dotted, &prop, Some(&header));
        }
    }

    /// A key's type, as a reader writes it in TOML.
    fn type_of(&self, schema: &Value) -> String {
        let schema = self.resolve(schema);
        if let Some(options) = schema.get("oneOf").and_then(Value::as_array) {
            let names: Vec<String> = options
                .iter()
                .filter_map(|o| {
                    o.get("const")
                        .or_else(|| o.get("enum").and_then(|e| e.get(0)))
                })
                .map(|v| format!("`{}`", compact(v)))
                .collect();
            return format!("one of {}", names.join(", "));
        }
        if let Some(values) = schema.get("enum").and_then(Value::as_array) {
            let names: Vec<String> = values.iter().map(|v| format!("`{}`", compact(v))).collect();
            return format!("one of {}", names.join(", "));
        }
        let types: Vec<&str> = match schema.get("type") {
            Some(Value::String(t)) => vec![t.as_str()],
            Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
            _ => Vec::new(),
        };
        let t = types.into_iter().find(|t| *t != "null").unwrap_or("any");
        match t {
            "string" => match schema.get("format").and_then(Value::as_str) {
                Some("duration") => "duration".to_string(),
                Some(f) => format!("string ({f})"),
                None => "string".to_string(),
            },
            "integer" => match schema.get("minimum").and_then(Value::as_u64) {
                Some(0) => "integer ≥ 0".to_string(),
                _ => "integer".to_string(),
            },
            "number" => "number".to_string(),
            "boolean" => "boolean".to_string(),
            "array" => match schema.get("items") {
                Some(items) => format!("array of {}", self.type_of(items)),
                None => "array".to_string(),
            },
            "object" => match schema.get("additionalProperties") {
                Some(v) if v.is_object() => format!("table of {}", self.type_of(v)),
                _ => "table".to_string(),
            },
            other => other.to_string(),
        }
    }
}

/// Whether a value may be absent (an `Option`).
fn nullable(schema: &Value) -> bool {
    schema.get("nullable") == Some(&Value::Bool(true))
        || schema
            .get("type")
            .and_then(Value::as_array)
            .is_some_and(|ts| ts.iter().any(|t| t == "null"))
}

/// The default of a key whose schema names none: absent for an `Option`,
/// else its type's empty value (`serde(default)` fills it so; the value is
/// left out of the schema when it is skipped in serialising).
fn empty_default(schema: &Value) -> String {
    if nullable(schema) {
        return "absent".to_string();
    }
    let t = match schema.get("type") {
        Some(Value::String(t)) => t.as_str(),
        _ => "",
    };
    match t {
        "array" => "`[]`",
        "boolean" => "`false`",
        "object" => "`{}`",
        "integer" | "number" => "`0`",
        "string" => "`\"\"`",
        _ => "absent",
    }
    .to_string()
}

/// A doc comment as one line: its lines joined, blank lines kept as a
/// break.
fn paragraph(text: &str) -> String {
    text.split("\n\n")
        .map(|p| p.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect::<Vec<_>>()
        .join(" ")
}

/// A value as compact JSON (TOML reads strings, numbers, booleans and
/// arrays of them the same way).
fn compact(v: &Value) -> String {
    serde_json::to_string(v).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_committed_reference_is_the_one_the_types_produce() {
        let path = format!("{}/../../{PATH}", env!("CARGO_MANIFEST_DIR"));
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            committed == markdown(),
            "{path} is stale: run `cargo xtask config-reference`"
        );
    }

    #[test]
    fn every_key_of_the_default_config_is_in_the_reference() {
        let doc = markdown();
        let default = serde_json::to_value(Config::default()).expect("serialises");
        let mut missing = Vec::new();
        let mut stack = vec![(String::new(), default)];
        while let Some((prefix, value)) = stack.pop() {
            let Value::Object(map) = value else { continue };
            for (k, v) in map {
                if !doc.contains(&format!("| `{k}` |")) && !doc.contains(&format!("[{prefix}{k}]"))
                {
                    missing.push(format!("{prefix}{k}"));
                }
                if v.is_object() {
                    stack.push((format!("{prefix}{k}."), v));
                }
            }
        }
        assert!(missing.is_empty(), "not in the reference: {missing:?}");
    }
}
