//! Names that become one segment of an etcd key (`pools/<name>`,
//! `blocks/<pool>/<cidr>`, `nodes/<node>`).
//!
//! Why a rule of its own: a `/` in a pool name turns `blocks/<pool>/<cidr>`
//! into a key no reader can split back (`blocks/team/a/10.0.0.0-26`), and a
//! control character makes a key that logs and terminals mangle. Such a name
//! must be refused at every door that writes one (pools apply, the node's
//! name, `node remove`), and a key holding one that is already stored (by
//! hand, an older version, a bug) is skipped and reported by its readers
//! rather than stopping them.

use super::ClusterError;

/// Longest name, in bytes (the single-node pool name limit).
pub const MAX_KEY_NAME_LEN: usize = crate::pool::MAX_NAME_LEN;

/// Why `name` cannot be one segment of a key, or `None` when it can: not
/// empty, at most [`MAX_KEY_NAME_LEN`] bytes, no `/`, no control character,
/// no white space.
pub fn key_name_problem(name: &str) -> Option<&'static str> {
    if name.is_empty() {
        Some("it is empty")
    } else if name.len() > MAX_KEY_NAME_LEN {
        Some("longer than 128 bytes")
    } else if name.contains('/') {
        Some("it contains '/', which separates etcd key segments")
    } else if name.chars().any(char::is_control) {
        Some("it contains a control character")
    } else if name.chars().any(char::is_whitespace) {
        Some("it contains white space")
    } else {
        None
    }
}

/// Checks that `name`, the `what` of a key (`cluster pool`, `node`), can
/// be one segment of an etcd key.
///
/// # Errors
/// [`ClusterError::BadName`] naming what, the name and why.
pub fn check_key_name(what: &'static str, name: &str) -> Result<(), ClusterError> {
    match key_name_problem(name) {
        None => Ok(()),
        Some(reason) => Err(ClusterError::BadName {
            what,
            name: name.to_owned(),
            reason,
        }),
    }
}
