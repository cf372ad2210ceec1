//! The double's objects: what the API server's storage and its REST
//! strategies do that lockstep depends on. Every write gets the next
//! `resourceVersion` (one counter for all kinds, as etcd's revision), goes
//! into a bounded history the watches are served from, and is checked
//! against the Rust type of its kind (`k8s-openapi`'s, or lockstep's CRD
//! type): a field that type does not have is refused, as a strict API
//! server refuses it.

use std::collections::{BTreeMap, VecDeque};

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value, json};

use super::selector::Filter;

/// A kind the double serves.
#[derive(Clone, Copy, Debug)]
pub struct Kind {
    /// API group (`""`: the core group, under `/api`).
    pub group: &'static str,
    /// Version.
    pub version: &'static str,
    /// Plural resource name, as in URLs.
    pub plural: &'static str,
    /// `kind`.
    pub kind: &'static str,
    /// Objects live in namespaces.
    pub namespaced: bool,
    /// Has a `status` subresource: main writes keep the status, status
    /// writes keep everything else.
    pub status: bool,
    /// Checks an object (against its Rust type, or its CRD's schema); the
    /// normalised object.
    pub check: fn(&Value) -> Result<Value, String>,
}

impl Kind {
    /// `apiVersion`.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_string()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }
}

/// Paths of `input` that the round trip through the type lost: fields the
/// type does not have (empty values are not counted: a type may leave an
/// empty list or map out).
fn lost(input: &Value, typed: &Value, path: &str, out: &mut Vec<String>) {
    match (input, typed) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in a {
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                match b.get(k) {
                    Some(w) => lost(v, w, &p, out),
                    None if is_empty(v) => {}
                    None => out.push(p),
                }
            }
        }
        (Value::Array(a), Value::Array(b)) => {
            for (i, (v, w)) in a.iter().zip(b).enumerate() {
                lost(v, w, &format!("{path}[{i}]"), out);
            }
        }
        _ => {}
    }
}

fn is_empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        Value::String(s) => s.is_empty(),
        Value::Bool(b) => !b,
        Value::Number(_) => false,
    }
}

/// Strict decoding into `T`: the normalised object, or which fields `T`
/// does not know or which values do not fit it.
pub fn check_as<T: DeserializeOwned + Serialize>(v: &Value) -> Result<Value, String> {
    let t: T = serde_json::from_value(v.clone()).map_err(|e| format!("decoding: {e}"))?;
    let typed = serde_json::to_value(&t).map_err(|e| format!("encoding: {e}"))?;
    let mut unknown = Vec::new();
    lost(v, &typed, "", &mut unknown);
    if unknown.is_empty() {
        Ok(typed)
    } else {
        Err(format!(
            "strict decoding error: unknown field(s) {}",
            unknown.join(", ")
        ))
    }
}

/// An object's identity.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Key {
    /// Plural resource name.
    pub plural: String,
    /// Namespace (`""` for cluster-scoped kinds).
    pub namespace: String,
    /// Name.
    pub name: String,
}

/// A watch event's type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChangeType {
    /// Created.
    Added,
    /// Changed.
    Modified,
    /// Gone.
    Deleted,
}

impl ChangeType {
    /// As in a watch event.
    pub fn as_str(self) -> &'static str {
        match self {
            ChangeType::Added => "ADDED",
            ChangeType::Modified => "MODIFIED",
            ChangeType::Deleted => "DELETED",
        }
    }
}

/// One write, as watches see it.
#[derive(Clone, Debug)]
pub struct Change {
    /// Its resourceVersion.
    pub rv: u64,
    /// What happened.
    pub kind: ChangeType,
    /// To which object.
    pub key: Key,
    /// The object after it (before, with the new resourceVersion, for a
    /// deletion).
    pub object: Value,
    /// The object before a modification (a watch with a selector sees an
    /// object start or stop matching as ADDED or DELETED).
    pub before: Option<Value>,
}

/// An API error, answered as a `Status`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP code.
    pub code: u16,
    /// `reason`.
    pub reason: &'static str,
    /// `message`.
    pub message: String,
}

impl ApiError {
    fn new(code: u16, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            reason,
            message: message.into(),
        }
    }

    /// The `Status` object.
    pub fn status(&self) -> Value {
        json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {},
            "status": "Failure", "message": self.message, "reason": self.reason, "code": self.code,
        })
    }
}

/// Objects, history and the counter.
#[derive(Debug)]
pub struct Store {
    rv: u64,
    uid: u64,
    objects: BTreeMap<Key, Value>,
    history: VecDeque<Change>,
    /// Watches from below this resourceVersion are `410 Gone`.
    oldest: u64,
    /// Most changes kept for watches.
    keep: usize,
}

/// RFC 7386 JSON merge patch.
pub fn merge(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(p) => {
            if !target.is_object() {
                *target = Value::Object(Map::new());
            }
            let t = target.as_object_mut().expect("object");
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        other => *target = other.clone(),
    }
}

fn now() -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    // RFC 3339, UTC, seconds: what metav1.Time holds.
    let (days, secs) = (t / 86_400, t % 86_400);
    let (y, m, d) = civil(days as i64);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

/// Days since 1970-01-01 to (year, month, day) (Howard Hinnant's algorithm).
fn civil(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// What a Service's REST strategy defaults on create, on a dual-stack
/// cluster: `type` ClusterIP, the families from the policy, TCP ports.
fn default_service(v: &mut Value) {
    let spec = &mut v["spec"];
    if spec["type"].is_null() {
        spec["type"] = json!("ClusterIP");
    }
    if spec["ipFamilyPolicy"].is_null() {
        spec["ipFamilyPolicy"] = json!("SingleStack");
    }
    if spec["ipFamilies"].is_null() {
        spec["ipFamilies"] = match spec["ipFamilyPolicy"].as_str() {
            Some("SingleStack") => json!(["IPv4"]),
            _ => json!(["IPv4", "IPv6"]),
        };
    }
    if let Some(ports) = spec["ports"].as_array_mut() {
        for p in ports {
            if p["protocol"].is_null() {
                p["protocol"] = json!("TCP");
            }
        }
    }
}

impl Store {
    /// An empty store keeping `keep` changes of history.
    pub fn new(keep: usize) -> Self {
        Self {
            rv: 1,
            uid: 0,
            objects: BTreeMap::new(),
            history: VecDeque::new(),
            oldest: 1,
            keep,
        }
    }

    /// The current resourceVersion.
    pub fn rv(&self) -> u64 {
        self.rv
    }

    /// Forgets the history up to now: a watch from an older
    /// resourceVersion is `410 Gone` (as after etcd's compaction, or the
    /// watch cache's window passing it).
    pub fn expire(&mut self) {
        // Resuming from any resourceVersion handed out so far needs the
        // forgotten history: all of them are gone.
        self.rv += 1;
        self.oldest = self.rv + 1;
        self.history.clear();
    }

    fn record(
        &mut self,
        kind: ChangeType,
        key: Key,
        before: Option<Value>,
        object: Value,
    ) -> Change {
        let c = Change {
            rv: self.rv,
            kind,
            key,
            object,
            before,
        };
        self.history.push_back(c.clone());
        while self.history.len() > self.keep {
            let gone = self.history.pop_front().expect("non-empty");
            self.oldest = gone.rv + 1;
        }
        c
    }

    fn bump(&mut self, v: &mut Value) {
        self.rv += 1;
        v["metadata"]["resourceVersion"] = json!(self.rv.to_string());
    }

    /// One object.
    ///
    /// # Errors
    /// 404.
    pub fn get(&self, kind: &Kind, ns: &str, name: &str) -> Result<Value, ApiError> {
        self.objects
            .get(&key(kind, ns, name))
            .cloned()
            .ok_or_else(|| not_found(kind, name))
    }

    /// Objects of `kind` (in `ns`, or all namespaces) that `selector`
    /// selects, and the resourceVersion they are as of.
    pub fn list(&self, kind: &Kind, ns: Option<&str>, selector: &Filter) -> (u64, Vec<Value>) {
        let items = self
            .objects
            .iter()
            .filter(|(k, _)| k.plural == kind.plural && ns.is_none_or(|n| k.namespace == n))
            .filter(|(_, v)| selector.matches(v))
            .map(|(_, v)| v.clone())
            .collect();
        (self.rv, items)
    }

    /// The changes after `from` that a watch of `kind` in `ns` with
    /// `selector` sees.
    ///
    /// # Errors
    /// `410 Gone` when the history no longer reaches back to `from`.
    pub fn since(
        &self,
        kind: &Kind,
        ns: Option<&str>,
        selector: &Filter,
        from: u64,
    ) -> Result<Vec<Change>, ApiError> {
        if from + 1 < self.oldest {
            return Err(ApiError::new(
                410,
                "Expired",
                format!("too old resource version: {from} ({})", self.oldest - 1),
            ));
        }
        Ok(self
            .history
            .iter()
            .filter(|c| c.rv > from)
            .filter_map(|c| {
                seen_as(kind, ns, selector, c).map(|t| Change {
                    kind: t,
                    ..c.clone()
                })
            })
            .collect())
    }

    /// Creates an object.
    ///
    /// # Errors
    /// 409 when it exists, 400/422 when it is not an object of its kind.
    pub fn create(
        &mut self,
        kind: &Kind,
        ns: &str,
        body: &Value,
    ) -> Result<(Value, Change), ApiError> {
        let mut v = body.clone();
        if !v.is_object() {
            return Err(ApiError::new(400, "BadRequest", "body is not an object"));
        }
        v["apiVersion"] = json!(kind.api_version());
        v["kind"] = json!(kind.kind);
        let name = match (
            v["metadata"]["name"].as_str(),
            v["metadata"]["generateName"].as_str(),
        ) {
            (Some(n), _) if !n.is_empty() => n.to_string(),
            (_, Some(g)) => {
                self.uid += 1;
                format!("{g}{:05x}", self.uid)
            }
            _ => {
                return Err(ApiError::new(
                    422,
                    "Invalid",
                    "metadata.name: Required value",
                ));
            }
        };
        if kind.namespaced {
            match v["metadata"]["namespace"].as_str() {
                Some(n) if n != ns => {
                    return Err(ApiError::new(
                        400,
                        "BadRequest",
                        "the namespace of the provided object does not match the namespace sent on the request",
                    ));
                }
                _ => v["metadata"]["namespace"] = json!(ns),
            }
        }
        let k = key(kind, ns, &name);
        if self.objects.contains_key(&k) {
            return Err(ApiError::new(
                409,
                "AlreadyExists",
                format!("{} {name:?} already exists", kind.plural),
            ));
        }
        self.uid += 1;
        let m = &mut v["metadata"];
        m["name"] = json!(name);
        m["uid"] = json!(format!("00000000-0000-4000-8000-{:012x}", self.uid));
        m["creationTimestamp"] = json!(now());
        m["generation"] = json!(1);
        if let Some(o) = m.as_object_mut() {
            o.remove("deletionTimestamp");
            o.remove("resourceVersion");
            o.remove("generateName");
        }
        if kind.status
            && let Some(o) = v.as_object_mut()
        {
            o.remove("status");
        }
        if kind.plural == "services" {
            default_service(&mut v);
        }
        let mut v = (kind.check)(&v).map_err(|e| invalid(kind, &name, &e))?;
        self.bump(&mut v);
        self.objects.insert(k.clone(), v.clone());
        let c = self.record(ChangeType::Added, k, None, v.clone());
        Ok((v, c))
    }

    /// Applies a JSON merge patch to the object (`status`: to its status
    /// subresource).
    ///
    /// # Errors
    /// 404, 409 when the patch names another resourceVersion, 422 when the
    /// result is not an object of its kind.
    pub fn patch(
        &mut self,
        kind: &Kind,
        ns: &str,
        name: &str,
        patch: &Value,
        status: bool,
    ) -> Result<(Value, Option<Change>), ApiError> {
        let current = self.get(kind, ns, name)?;
        let mut merged = current.clone();
        merge(&mut merged, patch);
        self.write(kind, ns, name, current, merged, status)
    }

    /// Replaces the object (PUT); its resourceVersion, when given, must be
    /// the current one.
    ///
    /// # Errors
    /// As [`Store::patch`].
    pub fn replace(
        &mut self,
        kind: &Kind,
        ns: &str,
        name: &str,
        body: &Value,
        status: bool,
    ) -> Result<(Value, Option<Change>), ApiError> {
        let current = self.get(kind, ns, name)?;
        let mut new = body.clone();
        if new["metadata"]["resourceVersion"].is_null() {
            new["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"].clone();
        }
        self.write(kind, ns, name, current, new, status)
    }

    fn write(
        &mut self,
        kind: &Kind,
        ns: &str,
        name: &str,
        current: Value,
        mut new: Value,
        status: bool,
    ) -> Result<(Value, Option<Change>), ApiError> {
        if new["metadata"]["resourceVersion"] != current["metadata"]["resourceVersion"] {
            return Err(ApiError::new(
                409,
                "Conflict",
                format!(
                    "Operation cannot be fulfilled on {} {name:?}: the object has been modified; please apply your changes to the latest version and try again",
                    kind.plural
                ),
            ));
        }
        if status {
            // The status subresource changes the status only.
            let s = new.get("status").cloned();
            new = current.clone();
            match s {
                Some(s) => new["status"] = s,
                None => {
                    if let Some(o) = new.as_object_mut() {
                        o.remove("status");
                    }
                }
            }
        } else if kind.status {
            match current.get("status") {
                Some(s) => new["status"] = s.clone(),
                None => {
                    if let Some(o) = new.as_object_mut() {
                        o.remove("status");
                    }
                }
            }
        }
        // What no write changes.
        for f in [
            "uid",
            "creationTimestamp",
            "namespace",
            "name",
            "deletionTimestamp",
            "generation",
        ] {
            match current["metadata"].get(f) {
                Some(v) => new["metadata"][f] = v.clone(),
                None => {
                    if let Some(o) = new["metadata"].as_object_mut() {
                        o.remove(f);
                    }
                }
            }
        }
        new["apiVersion"] = json!(kind.api_version());
        new["kind"] = json!(kind.kind);
        let mut new = (kind.check)(&new).map_err(|e| invalid(kind, name, &e))?;
        if new == current {
            return Ok((current, None));
        }
        let body = |v: &Value| {
            let mut v = v.clone();
            if let Some(o) = v.as_object_mut() {
                o.remove("metadata");
                o.remove("status");
            }
            v
        };
        if body(&new) != body(&current) {
            let g = current["metadata"]["generation"].as_i64().unwrap_or(1);
            new["metadata"]["generation"] = json!(g + 1);
        }
        let k = key(kind, ns, name);
        let finalizers_gone = new["metadata"]["finalizers"]
            .as_array()
            .is_none_or(Vec::is_empty);
        if !new["metadata"]["deletionTimestamp"].is_null() && finalizers_gone {
            self.bump(&mut new);
            self.objects.remove(&k);
            let c = self.record(ChangeType::Deleted, k, Some(current), new.clone());
            return Ok((new, Some(c)));
        }
        self.bump(&mut new);
        self.objects.insert(k.clone(), new.clone());
        let c = self.record(ChangeType::Modified, k, Some(current), new.clone());
        Ok((new, Some(c)))
    }

    /// Deletes the object; one with finalizers is only marked
    /// (`deletionTimestamp`) until they are removed.
    ///
    /// # Errors
    /// 404.
    pub fn delete(
        &mut self,
        kind: &Kind,
        ns: &str,
        name: &str,
    ) -> Result<(Value, Change), ApiError> {
        let k = key(kind, ns, name);
        let mut v = self.get(kind, ns, name)?;
        let has_finalizers = v["metadata"]["finalizers"]
            .as_array()
            .is_some_and(|f| !f.is_empty());
        if has_finalizers {
            if v["metadata"]["deletionTimestamp"].is_null() {
                let before = v.clone();
                v["metadata"]["deletionTimestamp"] = json!(now());
                self.bump(&mut v);
                self.objects.insert(k.clone(), v.clone());
                let c = self.record(ChangeType::Modified, k, Some(before), v.clone());
                return Ok((v, c));
            }
            let c = Change {
                rv: self.rv,
                kind: ChangeType::Modified,
                key: k,
                object: v.clone(),
                before: Some(v.clone()),
            };
            return Ok((v, c));
        }
        self.bump(&mut v);
        self.objects.remove(&k);
        let c = self.record(ChangeType::Deleted, k, None, v.clone());
        Ok((v, c))
    }
}

/// What a watch of `kind` in `ns` with `selector` sees of `c`, as the API
/// server sends it: an object that starts matching the selector is ADDED,
/// one that stops matching is DELETED (with its new state), one that
/// matched neither before nor after is not sent.
pub fn seen_as(kind: &Kind, ns: Option<&str>, selector: &Filter, c: &Change) -> Option<ChangeType> {
    if c.key.plural != kind.plural || ns.is_some_and(|n| c.key.namespace != n) {
        return None;
    }
    let now = selector.matches(&c.object);
    let was = c.before.as_ref().is_some_and(|b| selector.matches(b));
    match c.kind {
        ChangeType::Added => now.then_some(ChangeType::Added),
        ChangeType::Deleted => (now || was).then_some(ChangeType::Deleted),
        ChangeType::Modified => match (was, now) {
            (true, true) => Some(ChangeType::Modified),
            (false, true) => Some(ChangeType::Added),
            (true, false) => Some(ChangeType::Deleted),
            (false, false) => None,
        },
    }
}

fn key(kind: &Kind, ns: &str, name: &str) -> Key {
    Key {
        plural: kind.plural.to_string(),
        namespace: if kind.namespaced {
            ns.to_string()
        } else {
            String::new()
        },
        name: name.to_string(),
    }
}

fn not_found(kind: &Kind, name: &str) -> ApiError {
    ApiError::new(
        404,
        "NotFound",
        format!("{} {name:?} not found", kind.plural),
    )
}

fn invalid(kind: &Kind, name: &str, why: &str) -> ApiError {
    ApiError::new(
        422,
        "Invalid",
        format!("{} {name:?} is invalid: {why}", kind.kind),
    )
}
