//! Custom resources checked against their CRD's OpenAPI v3 schema (#44
//! item 9), as the API server checks them, instead of decoded into
//! lockstep's Rust types: a double that decoded writes into the agent's
//! own types would accept whatever the agent accepts, and could never
//! show that the CRD itself refuses a bad object.
//!
//! What it checks, as the API server does for a structural schema:
//! `type` (object, array, string, integer, number, boolean), `nullable`,
//! `properties` and `required`, `additionalProperties` (maps), `items`,
//! `enum`, `pattern` and `minimum`/`maximum`; a missing property with a
//! `default` gets it. A field the schema does not have is refused, as with
//! `fieldValidation=Strict` (kubectl's default; the API server's own
//! default prunes it with a warning instead). `apiVersion`, `kind` and
//! `metadata` are the API machinery's, not the schema's.
//!
//! Also `maxLength` and `maxItems`, and CEL rules
//! (`x-kubernetes-validations`, each with `self` the value it is on),
//! evaluated by the `cel` interpreter with the functions of Kubernetes'
//! IP and CIDR library that lockstep's CRDs use: `isIP(s)`, `isCIDR(s)`,
//! `cidr(s)` and `.masked()`. A CIDR value is modelled as its canonical
//! text, so `cidr(a) == cidr(b)` compares the networks and prefix lengths
//! as the library's equality does; IPv4-mapped IPv6 addresses and zones,
//! which the library refuses, are not modelled.
//!
//! Not modelled: `format`, `oneOf`/`anyOf`, list types, `oldSelf`
//! (transition rules); the CRDs lockstep ships use none of them.

use std::sync::OnceLock;

use serde_json::Value;

/// The `openAPIV3Schema` of the CRD in `yaml` (its first version).
///
/// # Panics
/// `yaml` is not a CRD (the CRDs are generated and unit-tested).
#[must_use]
pub fn schema_of(yaml: &str) -> Value {
    let crd: Value = serde_saphyr::from_str(yaml).expect("a CRD");
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"].clone()
}

/// `v` checked against `schema`, defaults filled in; or every violation.
///
/// # Errors
/// The violations, each as `path: what`.
pub fn check(schema: &Value, v: &Value) -> Result<Value, String> {
    let mut out = v.clone();
    let mut errors = Vec::new();
    if let (Some(obj), Some(props)) = (out.as_object_mut(), schema["properties"].as_object()) {
        for (k, val) in obj.iter_mut() {
            if matches!(k.as_str(), "apiVersion" | "kind" | "metadata") {
                continue;
            }
            match props.get(k) {
                Some(sub) => walk(sub, val, k, &mut errors),
                None => errors.push(format!("{k}: unknown field")),
            }
        }
    }
    if errors.is_empty() {
        Ok(out)
    } else {
        Err(errors.join("; "))
    }
}

fn pattern(p: &str) -> Option<regex::Regex> {
    static CACHE: OnceLock<std::sync::Mutex<Vec<(String, regex::Regex)>>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| std::sync::Mutex::new(Vec::new()));
    let mut c = cache.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, r)) = c.iter().find(|(s, _)| s == p) {
        return Some(r.clone());
    }
    let r = regex::Regex::new(p).ok()?;
    c.push((p.to_owned(), r.clone()));
    Some(r)
}

/// `rules` (a schema's `x-kubernetes-validations`) on `v`: each failing
/// rule's message, as the API server words it.
fn rules(rules: &[Value], v: &Value, path: &str, errors: &mut Vec<String>) {
    use std::sync::Arc;

    use cel::extractors::This;
    use cel::{Context, ExecutionError, Program};

    /// A CIDR value: its canonical text (`masked`: of its network).
    fn cidr(s: &str, masked: bool) -> Result<cel::Value, ExecutionError> {
        let n: ipnet::IpNet = s
            .parse()
            .map_err(|_| ExecutionError::function_error("cidr", format!("{s:?} is not a CIDR")))?;
        let n = if masked { n.trunc() } else { n };
        Ok(cel::Value::String(Arc::new(n.to_string())))
    }
    for rule in rules {
        let text = rule["rule"].as_str().unwrap_or_default();
        let message = rule["message"].as_str().unwrap_or("failed rule");
        let Ok(program) = Program::compile(text) else {
            errors.push(format!(
                "{path}: the schema's rule {text:?} does not compile"
            ));
            continue;
        };
        let mut ctx = Context::default();
        let declared = ctx.add_variable("self", v.clone()).is_ok()
            && ctx
                .add_function("isIP", |s: Arc<String>| {
                    s.parse::<std::net::IpAddr>().is_ok()
                })
                .is_ok()
            && ctx
                .add_function("isCIDR", |s: Arc<String>| s.parse::<ipnet::IpNet>().is_ok())
                .is_ok()
            && ctx
                .add_function("cidr", |s: Arc<String>| cidr(&s, false))
                .is_ok()
            && ctx
                .add_function("masked", |This(s): This<Arc<String>>| cidr(&s, true))
                .is_ok();
        if !declared {
            errors.push(format!("{path}: the rule {text:?} could not be set up"));
            continue;
        }
        match program.execute(&ctx) {
            Ok(cel::Value::Bool(true)) => {}
            Ok(_) => errors.push(format!("{path}: Invalid value: {v}: {message}")),
            Err(e) => errors.push(format!("{path}: Invalid value: {v}: {message} ({e})")),
        }
    }
}

fn walk(schema: &Value, v: &mut Value, path: &str, errors: &mut Vec<String>) {
    if v.is_null() {
        if schema["nullable"] != Value::Bool(true) && schema.get("type").is_some() {
            errors.push(format!("{path}: Invalid value: null"));
        }
        return;
    }
    let ty = schema["type"].as_str().unwrap_or("");
    let fits = match ty {
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        "integer" => v.is_i64() || v.is_u64(),
        "number" => v.is_number(),
        "boolean" => v.is_boolean(),
        _ => true,
    };
    if !fits {
        errors.push(format!("{path}: Invalid value: {v}: must be of type {ty}"));
        return;
    }
    if let Some(allowed) = schema["enum"].as_array()
        && !allowed.contains(v)
    {
        errors.push(format!(
            "{path}: Unsupported value: {v}: supported values: {}",
            allowed
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    if let Some(r) = schema["x-kubernetes-validations"].as_array() {
        rules(r, v, path, errors);
    }
    match v {
        Value::Object(obj) => {
            let props = schema["properties"].as_object();
            if let Some(props) = props {
                for (k, sub) in props {
                    if !obj.contains_key(k)
                        && let Some(d) = sub.get("default")
                    {
                        obj.insert(k.clone(), d.clone());
                    }
                }
            }
            for r in schema["required"].as_array().into_iter().flatten() {
                if let Some(r) = r.as_str()
                    && !obj.contains_key(r)
                {
                    errors.push(format!("{path}.{r}: Required value"));
                }
            }
            let extra = schema.get("additionalProperties").filter(|a| a.is_object());
            let preserve = schema["x-kubernetes-preserve-unknown-fields"] == Value::Bool(true);
            for (k, val) in obj.iter_mut() {
                let at = format!("{path}.{k}");
                match (props.and_then(|p| p.get(k)), extra) {
                    (Some(sub), _) | (None, Some(sub)) => walk(sub, val, &at, errors),
                    (None, None) if preserve => {}
                    (None, None) => errors.push(format!("{at}: unknown field")),
                }
            }
        }
        Value::Array(items) => {
            if let Some(max) = schema["maxItems"].as_u64()
                && items.len() as u64 > max
            {
                errors.push(format!(
                    "{path}: Too many: {}: must have at most {max} items",
                    items.len()
                ));
            }
            if let Some(sub) = schema.get("items") {
                for (i, item) in items.iter_mut().enumerate() {
                    walk(sub, item, &format!("{path}[{i}]"), errors);
                }
            }
        }
        Value::String(s) => {
            if let Some(max) = schema["maxLength"].as_u64()
                && s.chars().count() as u64 > max
            {
                errors.push(format!(
                    "{path}: Too long: may not be more than {max} bytes"
                ));
            }
            if let Some(p) = schema["pattern"].as_str() {
                match pattern(p) {
                    Some(r) if r.is_match(s) => {}
                    Some(_) => errors.push(format!(
                        "{path}: Invalid value: {s:?}: {path} in body should match '{p}'"
                    )),
                    None => {
                        errors.push(format!("{path}: the schema's pattern {p:?} is not a regex"))
                    }
                }
            }
        }
        Value::Number(n) => {
            let x = n.as_f64().unwrap_or(0.0);
            if schema["minimum"].as_f64().is_some_and(|m| x < m) {
                errors.push(format!(
                    "{path}: Invalid value: {n}: should be greater than or equal to {}",
                    schema["minimum"]
                ));
            }
            if schema["maximum"].as_f64().is_some_and(|m| x > m) {
                errors.push(format!(
                    "{path}: Invalid value: {n}: should be less than or equal to {}",
                    schema["maximum"]
                ));
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn lbpool() -> Value {
        schema_of(&lockstep::kubernetes::crd::crd_yaml().expect("crd"))
    }

    #[test]
    fn a_good_pool_passes_with_its_defaults_filled_in() {
        let v = json!({"apiVersion": "lockstep.io/v1alpha1", "kind": "LoadBalancerIPPool",
                       "metadata": {"name": "p"},
                       "spec": {"cidrs": ["192.0.2.0/24", "2001:db8::/120", "2001:db8:0::100/120"],
                                "ranges": [{"start": "198.51.100.1", "stop": "198.51.100.9"}],
                                "announce": "l2"}});
        let out = check(&lbpool(), &v).expect("valid");
        assert_eq!(out["spec"]["allowFirstLastIPs"], false);
        assert_eq!(out["spec"]["disabled"], false);
    }

    #[test]
    fn bad_cidrs_addresses_enums_types_and_unknown_fields_are_named() {
        for (spec, want) in [
            (
                json!({"cidrs": ["192.0.2.0"]}),
                "spec.cidrs[0]: Invalid value",
            ),
            (json!({"cidrs": ["web"]}), "should match"),
            (
                json!({"ranges": [{"start": "a.b.c.d", "stop": "192.0.2.9"}]}),
                "spec.ranges[0].start",
            ),
            (
                json!({"ranges": [{"start": "192.0.2.1"}]}),
                "spec.ranges[0].stop: Required value",
            ),
            (
                json!({"announce": "bgp"}),
                "spec.announce: Unsupported value",
            ),
            (json!({"disabled": "yes"}), "must be of type boolean"),
            (
                json!({"avoidBuggyIPs": true}),
                "spec.avoidBuggyIPs: unknown field",
            ),
            // The shape fits; the CEL rules refuse them (#44 item 7).
            (
                json!({"cidrs": ["192.0.2.300/24"]}),
                "spec.cidrs[0]: Invalid value: \"192.0.2.300/24\": must be a CIDR",
            ),
            (json!({"cidrs": ["192.0.2.1/24"]}), "no host bits set"),
            (json!({"cidrs": ["2001:db8::1/64"]}), "no host bits set"),
            (
                json!({"ranges": [{"start": "999.0.2.1", "stop": "192.0.2.9"}]}),
                "spec.ranges[0].start: Invalid value: \"999.0.2.1\": must be an IPv4 or IPv6",
            ),
            (
                json!({"cidrs": vec!["192.0.2.0/24"; 1025]}),
                "spec.cidrs: Too many",
            ),
        ] {
            let e = check(&lbpool(), &json!({"spec": spec})).unwrap_err();
            assert!(e.contains(want), "{spec}: {e}");
        }
    }
}
