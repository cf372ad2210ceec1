//! Typed access to a JSON object that names the field in every error.
//!
//! serde's derive would reject unknown fields or accept them silently, and its
//! messages name a line and column rather than the field. CNI configurations
//! carry other plugins' keys that must be tolerated, while lockstep's own keys
//! must have the right type; walking a `serde_json::Value` with these helpers
//! gives both, and errors such as "field `runtimeConfig.ips[1]` must be a
//! string, found a number".

use serde_json::{Map, Value};

use super::error::CniError;

/// The JSON type of `value`, as an article and noun for messages.
pub(crate) fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// `value` as compact JSON for messages, cut to a readable length.
pub(crate) fn show(value: &Value) -> String {
    const MAX: usize = 120;
    let mut text = value.to_string();
    if text.len() > MAX {
        let mut cut = MAX;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
        text.push('…');
    }
    text
}

/// An object reached at `path` (empty for the top level).
#[derive(Clone)]
pub(crate) struct Obj<'a> {
    map: &'a Map<String, Value>,
    path: String,
}

/// A value with the path it was found at.
pub(crate) struct Field<'a> {
    pub(crate) value: &'a Value,
    pub(crate) path: String,
}

impl<'a> Field<'a> {
    pub(crate) fn wrong_type(&self, expected: &'static str) -> CniError {
        CniError::WrongType {
            field: self.path.clone(),
            expected,
            found: type_name(self.value),
        }
    }

    pub(crate) fn invalid(&self, reason: impl Into<String>) -> CniError {
        CniError::InvalidField {
            field: self.path.clone(),
            value: show(self.value),
            reason: reason.into(),
        }
    }

    pub(crate) fn as_str(&self) -> Result<&'a str, CniError> {
        self.value
            .as_str()
            .ok_or_else(|| self.wrong_type("a string"))
    }

    pub(crate) fn as_obj(&self) -> Result<Obj<'a>, CniError> {
        match self.value {
            Value::Object(map) => Ok(Obj {
                map,
                path: self.path.clone(),
            }),
            _ => Err(self.wrong_type("an object")),
        }
    }

    /// The elements of an array, each with its `path[i]`.
    pub(crate) fn as_array(&self) -> Result<Vec<Field<'a>>, CniError> {
        match self.value {
            Value::Array(items) => Ok(items
                .iter()
                .enumerate()
                .map(|(i, value)| Field {
                    value,
                    path: format!("{}[{i}]", self.path),
                })
                .collect()),
            _ => Err(self.wrong_type("an array")),
        }
    }

    pub(crate) fn as_u32(&self) -> Result<u32, CniError> {
        self.value
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| self.wrong_type("an unsigned integer below 2^32"))
    }

    /// An array of strings.
    pub(crate) fn as_strings(&self) -> Result<Vec<String>, CniError> {
        self.as_array()?
            .iter()
            .map(|item| item.as_str().map(str::to_owned))
            .collect()
    }
}

impl<'a> Obj<'a> {
    /// The top-level object of a document.
    pub(crate) fn root(value: &'a Value) -> Result<Obj<'a>, CniError> {
        match value {
            Value::Object(map) => Ok(Obj {
                map,
                path: String::new(),
            }),
            other => Err(CniError::WrongType {
                field: "(top level)".to_owned(),
                expected: "an object",
                found: type_name(other),
            }),
        }
    }

    pub(crate) fn path_of(&self, key: &str) -> String {
        if self.path.is_empty() {
            key.to_owned()
        } else {
            format!("{}.{key}", self.path)
        }
    }

    /// The field `key`; JSON `null` counts as absent, as Go's decoder (which
    /// every other plugin uses) treats it.
    pub(crate) fn get(&self, key: &str) -> Option<Field<'a>> {
        match self.map.get(key) {
            None | Some(Value::Null) => None,
            Some(value) => Some(Field {
                value,
                path: self.path_of(key),
            }),
        }
    }

    pub(crate) fn require(&self, key: &str, context: &'static str) -> Result<Field<'a>, CniError> {
        self.get(key).ok_or_else(|| CniError::MissingField {
            field: self.path_of(key),
            context,
        })
    }

    pub(crate) fn opt_str(&self, key: &str) -> Result<Option<&'a str>, CniError> {
        self.get(key).map(|f| f.as_str()).transpose()
    }

    pub(crate) fn opt_u32(&self, key: &str) -> Result<Option<u32>, CniError> {
        self.get(key).map(|f| f.as_u32()).transpose()
    }
}
