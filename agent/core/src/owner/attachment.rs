//! Who may hold an address: the one set of rules every door checks owners
//! against (the API, the CLI, the CNI plugin's environment and its config),
//! and the record key of an attachment.
//!
//! An attachment (container ID, interface name) is keyed by
//! [`attachment_key`], which is injective over *any* two strings: a key once
//! built by joining the two with a `\u{1f}` separator made `"a\u{1f}b"/"c"`
//! and `"a"/"b\u{1f}c"` one record, so the second ADD got the first one's
//! addresses and its DEL removed the first one's record.

use std::fmt;

use super::Owner;

/// Longest interface name Linux accepts (`IFNAMSIZ` − 1).
pub const MAX_IFNAME_LEN: usize = 15;

/// Longest container ID accepted. The spec sets no limit; runtimes use 64
/// hex digits, and a bound keeps a 60 KiB ID out of every record and log line.
pub const MAX_CONTAINER_ID_LEN: usize = 256;

/// Longest service namespace, service name, resource kind or resource name
/// (a DNS subdomain's limit).
pub const MAX_NAME_LEN: usize = 253;

/// An owner that no door accepts: which field, and what is wrong with it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field} {shown}: {problem}")]
pub struct OwnerError {
    /// The field, as the API names it (`container_id`, `ifname`, `owner`, ...).
    pub field: &'static str,
    /// The value as given, quoted and cut to 64 characters.
    pub shown: String,
    /// What is wrong with it.
    pub problem: &'static str,
}

impl OwnerError {
    fn new(field: &'static str, value: &str, problem: &'static str) -> OwnerError {
        let mut shown: String = value.chars().take(64).collect();
        if shown.len() < value.len() {
            shown.push_str("...");
        }
        OwnerError {
            field,
            shown: format!("{shown:?}"),
            problem,
        }
    }
}

/// A validated container ID: 1 to [`MAX_CONTAINER_ID_LEN`] bytes, starting
/// with an ASCII letter or digit, then ASCII letters, digits, `_`, `.` or
/// `-` (the CNI spec's rule).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ContainerId(String);

impl ContainerId {
    /// Validates `id`; the error is a reason suitable for a message.
    ///
    /// # Errors
    /// If `id` is empty, too long, or has a character the spec does not allow.
    pub fn new(id: &str) -> Result<ContainerId, &'static str> {
        let mut bytes = id.bytes();
        match bytes.next() {
            None => return Err("a container ID must not be empty"),
            Some(b) if !b.is_ascii_alphanumeric() => {
                return Err("a container ID must start with an ASCII letter or digit");
            }
            Some(_) => {}
        }
        if !bytes.all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-')) {
            return Err("a container ID may only contain ASCII letters, digits, '_', '.' and '-'");
        }
        if id.len() > MAX_CONTAINER_ID_LEN {
            return Err("a container ID must be at most 256 bytes");
        }
        Ok(ContainerId(id.to_owned()))
    }

    /// The ID.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ContainerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A validated Linux interface name: 1–15 bytes, not `.` or `..`, no `/`,
/// `:`, whitespace or control characters (the kernel's `dev_valid_name`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IfName(String);

impl IfName {
    /// Validates `name`; the error is a reason suitable for a message.
    ///
    /// # Errors
    /// If the kernel would refuse the name.
    pub fn new(name: &str) -> Result<IfName, &'static str> {
        if name.is_empty() {
            return Err("an interface name must not be empty");
        }
        if name.len() > MAX_IFNAME_LEN {
            return Err("an interface name must be at most 15 bytes");
        }
        if name == "." || name == ".." {
            return Err("an interface name must not be '.' or '..'");
        }
        if name
            .chars()
            .any(|c| c == '/' || c == ':' || c.is_whitespace() || c.is_control())
        {
            return Err(
                "an interface name must not contain '/', ':', whitespace or control characters",
            );
        }
        Ok(IfName(name.to_owned()))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for IfName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// One attachment: a validated container ID and interface name.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Attachment {
    /// `CNI_CONTAINERID`.
    pub container_id: ContainerId,
    /// `CNI_IFNAME`.
    pub ifname: IfName,
}

impl Attachment {
    /// Validates both parts; the error names the field.
    ///
    /// # Errors
    /// Either part breaks its rule ([`ContainerId::new`], [`IfName::new`]).
    pub fn new(container_id: &str, ifname: &str) -> Result<Attachment, OwnerError> {
        Ok(Attachment {
            container_id: ContainerId::new(container_id)
                .map_err(|p| OwnerError::new("container_id", container_id, p))?,
            ifname: IfName::new(ifname).map_err(|p| OwnerError::new("ifname", ifname, p))?,
        })
    }

    /// Its record key ([`attachment_key`]).
    pub fn key(&self) -> String {
        attachment_key(self.container_id.as_str(), self.ifname.as_str())
    }
}

/// Marks a key in the length-prefixed form (see [`attachment_key`]).
const PREFIXED: char = '\u{1e}';

/// The record key of the attachment (`container_id`, `ifname`), for any two
/// strings (records stored before owners were validated included); distinct
/// pairs never share a key.
///
/// Two forms, told apart by their first character:
/// - neither part has a control character (every valid attachment): the
///   parts joined by `\u{1f}`, the form keys always had, so stored records
///   keep their keys. Unambiguous: the only control character in the key
///   is the one separator.
/// - otherwise: `\u{1e}`, the container ID's length in bytes in decimal,
///   `:`, the container ID, the interface name. A plain key never starts
///   with `\u{1e}` (a control character), and the length says where the ID
///   ends.
pub fn attachment_key(container_id: &str, ifname: &str) -> String {
    let plain = |s: &str| !s.chars().any(char::is_control);
    if plain(container_id) && plain(ifname) {
        format!("{container_id}\u{1f}{ifname}")
    } else {
        format!("{PREFIXED}{}:{container_id}{ifname}", container_id.len())
    }
}

/// The key an attachment was stored under before [`attachment_key`]: the
/// two joined by `\u{1f}`, ambiguous when a part holds one. Only for
/// finding such records to move them.
pub fn legacy_attachment_key(container_id: &str, ifname: &str) -> String {
    format!("{container_id}\u{1f}{ifname}")
}

/// Checks a name (service namespace or name, resource kind or name).
fn check_name(field: &'static str, value: &str, slash_ok: bool) -> Result<(), OwnerError> {
    let bad = |problem| Err(OwnerError::new(field, value, problem));
    if value.is_empty() {
        return bad("must not be empty");
    }
    if value.len() > MAX_NAME_LEN {
        return bad("must be at most 253 bytes");
    }
    if value.chars().any(char::is_control) {
        return bad("must not contain control characters");
    }
    if !slash_ok && value.contains('/') {
        return bad("must not contain '/'");
    }
    Ok(())
}

impl Owner {
    /// Checks the owner's fields by the rules every door applies: an
    /// endpoint's or delegated attachment's parts as [`Attachment::new`],
    /// a LoadBalancer's `namespace/name` and a resource's kind and name
    /// non-empty, at most [`MAX_NAME_LEN`] bytes, without control
    /// characters (and a namespace, name or kind without `/`).
    ///
    /// # Errors
    /// The first field that breaks its rule.
    pub fn validate(&self) -> Result<(), OwnerError> {
        match self {
            Owner::Endpoint {
                container_id,
                ifname,
            }
            | Owner::Delegated {
                container_id,
                ifname,
            } => Attachment::new(container_id, ifname).map(|_| ()),
            Owner::Agent { .. } => Ok(()),
            Owner::LoadBalancer { service } => match service.split_once('/') {
                Some((namespace, name)) => {
                    check_name("namespace", namespace, false)?;
                    check_name("name", name, false)
                }
                None => Err(OwnerError::new(
                    "service",
                    service,
                    "must be namespace/name",
                )),
            },
            Owner::Resource { kind, name } => {
                check_name("kind", kind, false)?;
                check_name("name", name, true)
            }
        }
    }

    /// [`validate`](Owner::validate), and refuses the kinds only the agent
    /// itself makes: `agent` (its roles) and `delegated` (attachments an
    /// external IPAM plugin holds). For owners a caller names when asking
    /// for an address.
    ///
    /// # Errors
    /// A reserved kind, or [`validate`](Owner::validate)'s errors.
    pub fn validate_requested(&self) -> Result<(), OwnerError> {
        if matches!(self, Owner::Agent { .. } | Owner::Delegated { .. }) {
            return Err(OwnerError::new(
                "owner",
                self.kind(),
                "is reserved by the agent itself",
            ));
        }
        self.validate()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_reviewers_pair_no_longer_shares_a_key() {
        assert_ne!(
            attachment_key("a\u{1f}b", "c"),
            attachment_key("a", "b\u{1f}c")
        );
        // Valid attachments keep the key they were always stored under.
        assert_eq!(attachment_key("c1", "eth0"), "c1\u{1f}eth0");
        assert_eq!(
            Attachment::new("c1", "eth0").unwrap().key(),
            legacy_attachment_key("c1", "eth0")
        );
    }

    #[test]
    fn errors_name_the_field() {
        for (id, ifname, field) in [
            ("", "eth0", "container_id"),
            ("a\0b", "eth0", "container_id"),
            ("a\u{1f}b", "eth0", "container_id"),
            ("-a", "eth0", "container_id"),
            ("a", "", "ifname"),
            ("a", "eth0\n", "ifname"),
            ("a", "a/b", "ifname"),
            ("a", "..", "ifname"),
            ("a", "0123456789abcdef", "ifname"),
        ] {
            let e = Attachment::new(id, ifname).expect_err(id);
            assert_eq!(e.field, field, "{id:?}/{ifname:?}: {e}");
            assert!(e.to_string().starts_with(field), "{e}");
        }
        let long = "a".repeat(60 * 1024);
        let e = Attachment::new(&long, "eth0").expect_err("60 KiB");
        assert!(e.to_string().len() < 200, "the value is cut: {e}");
        assert!(Attachment::new(&"a".repeat(256), "eth0").is_ok());
        assert!(Attachment::new(&"a".repeat(257), "eth0").is_err());
    }

    #[test]
    fn owners_are_checked_by_kind() {
        assert!(Owner::endpoint("abc", "eth0").validate_requested().is_ok());
        assert!(Owner::load_balancer("ns/web").validate_requested().is_ok());
        for bad in [
            Owner::endpoint("a\0", "eth0"),
            Owner::endpoint("", "eth0"),
            Owner::endpoint("abc", ""),
            Owner::load_balancer("web"),
            Owner::load_balancer("ns/"),
            Owner::load_balancer("ns/a/b"),
            Owner::load_balancer("ns/w\u{7}"),
            Owner::Resource {
                kind: "node".into(),
                name: String::new(),
            },
            Owner::Resource {
                kind: "no/de".into(),
                name: "n".into(),
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
        let reserved = Owner::Delegated {
            container_id: "abc".into(),
            ifname: "eth0".into(),
        };
        assert!(reserved.validate().is_ok());
        let e = reserved.validate_requested().expect_err("reserved");
        assert!(e.to_string().contains("reserved"), "{e}");
        assert!(
            Owner::agent(crate::owner::AgentRole::Router)
                .validate_requested()
                .is_err()
        );
    }

    proptest! {
        /// Distinct pairs of any strings never share a key.
        #[test]
        fn distinct_pairs_never_share_a_key(
            a in "[a\u{1f}\u{1e}:0-9b]{0,6}", b in "[a\u{1f}\u{1e}:0-9b]{0,6}",
            c in "[a\u{1f}\u{1e}:0-9b]{0,6}", d in "[a\u{1f}\u{1e}:0-9b]{0,6}",
        ) {
            if (a.as_str(), b.as_str()) != (c.as_str(), d.as_str()) {
                prop_assert_ne!(attachment_key(&a, &b), attachment_key(&c, &d));
            }
        }

        /// A key reads back as the pair it was built from.
        #[test]
        fn keys_round_trip(a in "\\PC{0,8}|[\u{0}-\u{1f}a:]{0,8}", b in "\\PC{0,8}|[\u{0}-\u{1f}b:]{0,8}") {
            prop_assert_eq!(split_key(&attachment_key(&a, &b)), Some((a, b)));
        }

        /// Valid attachments keep the plain key form.
        #[test]
        fn valid_attachments_keep_the_plain_form(
            id in "[a-zA-Z0-9][a-zA-Z0-9_.-]{0,70}", ifname in "[a-z0-9]{1,15}",
        ) {
            let a = Attachment::new(&id, &ifname).expect("valid");
            prop_assert_eq!(a.key(), legacy_attachment_key(&id, &ifname));
        }
    }

    /// The inverse of [`attachment_key`] (only the tests need it).
    fn split_key(key: &str) -> Option<(String, String)> {
        if let Some(rest) = key.strip_prefix(PREFIXED) {
            let (len, rest) = rest.split_once(':')?;
            let len: usize = len.parse().ok()?;
            let (id, ifname) = rest.split_at_checked(len)?;
            return Some((id.into(), ifname.into()));
        }
        let (id, ifname) = key.split_once('\u{1f}')?;
        (!ifname.contains('\u{1f}')).then(|| (id.into(), ifname.into()))
    }
}
