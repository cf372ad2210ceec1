//! Who holds an address, and which holding it is.
//!
//! Owners are typed rather than free-form strings so that the datapath plan
//! can derive an address's identity from its owner, so that a CNI `DEL` can
//! never release a LoadBalancer address by accident, and so that the store,
//! the API and the logs all print the same thing ([`Display`](fmt::Display)).
//!
//! A [`Generation`] tells two holdings of the same owner apart: a late `DEL`
//! or GC that carries the generation of a released allocation cannot free the
//! address the owner was given afterwards.

use std::fmt;

use serde::{Deserialize, Serialize};

mod attachment;

pub use attachment::{
    Attachment, ContainerId, IfName, MAX_CONTAINER_ID_LEN, MAX_IFNAME_LEN, MAX_NAME_LEN,
    OwnerError, attachment_key, legacy_attachment_key,
};

/// Addresses the agent holds for itself. Each role holds at most one address
/// per pool and family, stable across restarts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AgentRole {
    /// The ingress proxy's address.
    Ingress,
    /// The health-check responder's address.
    Health,
    /// The node's router (gateway) address for endpoints.
    Router,
}

impl AgentRole {
    /// Every role, in a fixed order (the order the daemon reserves them in).
    pub const ALL: [AgentRole; 3] = [AgentRole::Router, AgentRole::Health, AgentRole::Ingress];

    /// Stable lowercase name.
    pub const fn name(self) -> &'static str {
        match self {
            AgentRole::Ingress => "ingress",
            AgentRole::Health => "health",
            AgentRole::Router => "router",
        }
    }
}

impl fmt::Display for AgentRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The holder of an allocation.
///
/// Serialised with an internal `owner` tag (not `kind`, which
/// [`Owner::Resource`] uses as a field), e.g.
/// `{"owner":"endpoint","container_id":"abc","ifname":"eth0"}`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(tag = "owner", rename_all = "snake_case", deny_unknown_fields)]
pub enum Owner {
    /// A pod interface, from CNI ADD.
    Endpoint {
        /// The runtime's container ID.
        container_id: String,
        /// The interface name inside the container.
        ifname: String,
    },
    /// The agent itself.
    Agent {
        /// Which of the agent's addresses.
        role: AgentRole,
    },
    /// A LoadBalancer service.
    #[serde(rename = "loadbalancer")]
    LoadBalancer {
        /// `namespace/name`.
        service: String,
    },
    /// An interface whose address came from an external CNI IPAM plugin.
    Delegated {
        /// The container ID given to the external plugin.
        container_id: String,
        /// The interface name given to the external plugin.
        ifname: String,
    },
    /// Any other named resource (for consumers beyond the three above).
    Resource {
        /// What kind of resource, e.g. `node`.
        kind: String,
        /// Its name.
        name: String,
    },
}

impl Owner {
    /// An endpoint owner.
    pub fn endpoint(container_id: impl Into<String>, ifname: impl Into<String>) -> Owner {
        Owner::Endpoint {
            container_id: container_id.into(),
            ifname: ifname.into(),
        }
    }

    /// An agent owner.
    pub fn agent(role: AgentRole) -> Owner {
        Owner::Agent { role }
    }

    /// A LoadBalancer owner for `namespace/name`.
    pub fn load_balancer(service: impl Into<String>) -> Owner {
        Owner::LoadBalancer {
            service: service.into(),
        }
    }

    /// The container ID and interface of an endpoint's or a delegated
    /// attachment's owner (`None`: any other owner).
    pub fn attachment(&self) -> Option<(&str, &str)> {
        match self {
            Owner::Endpoint {
                container_id,
                ifname,
            }
            | Owner::Delegated {
                container_id,
                ifname,
            } => Some((container_id, ifname)),
            _ => None,
        }
    }

    /// Stable lowercase kind name, as in the serialised `owner` tag.
    pub fn kind(&self) -> &'static str {
        match self {
            Owner::Endpoint { .. } => "endpoint",
            Owner::Agent { .. } => "agent",
            Owner::LoadBalancer { .. } => "loadbalancer",
            Owner::Delegated { .. } => "delegated",
            Owner::Resource { .. } => "resource",
        }
    }
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = self.kind();
        match self {
            Owner::Endpoint {
                container_id,
                ifname,
            }
            | Owner::Delegated {
                container_id,
                ifname,
            } => write!(f, "{kind} {container_id}/{ifname}"),
            Owner::Agent { role } => write!(f, "{kind} {role}"),
            Owner::LoadBalancer { service } => write!(f, "{kind} {service}"),
            Owner::Resource { kind: k, name } => write!(f, "{kind} {k}/{name}"),
        }
    }
}

/// Which holding of an address this is. Handed out by the manager from a
/// counter that only grows (and is restored with the allocations), so no two
/// allocations ever share one.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Generation(pub u64);

impl Generation {
    /// The generation after this one.
    ///
    /// # Panics
    /// After 2^64 - 1 allocations, which cannot happen in practice.
    pub fn next(self) -> Generation {
        Generation(self.0.checked_add(1).expect("generation counter overflow"))
    }
}

impl fmt::Display for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_attachment_names_its_container_and_interface_and_nothing_else_has_one() {
        let delegated = Owner::Delegated {
            container_id: "c2".into(),
            ifname: "net1".into(),
        };
        assert_eq!(
            Owner::endpoint("c1", "eth0").attachment(),
            Some(("c1", "eth0"))
        );
        assert_eq!(delegated.attachment(), Some(("c2", "net1")));
        assert_eq!(Owner::load_balancer("ns/svc").attachment(), None);
    }

    #[test]
    fn display_is_readable() {
        assert_eq!(
            Owner::endpoint("abc", "eth0").to_string(),
            "endpoint abc/eth0"
        );
        assert_eq!(Owner::agent(AgentRole::Router).to_string(), "agent router");
        assert_eq!(
            Owner::load_balancer("default/web").to_string(),
            "loadbalancer default/web"
        );
        let res = Owner::Resource {
            kind: "node".into(),
            name: "n1".into(),
        };
        assert_eq!(res.to_string(), "resource node/n1");
    }

    #[test]
    fn serde_uses_a_kind_tag_and_refuses_unknown_fields() {
        let owners = [
            Owner::endpoint("abc", "eth0"),
            Owner::agent(AgentRole::Health),
            Owner::load_balancer("ns/svc"),
            Owner::Delegated {
                container_id: "lockstep-router".into(),
                ifname: "lsr0".into(),
            },
            Owner::Resource {
                kind: "node".into(),
                name: "n1".into(),
            },
        ];
        for o in owners {
            let json = serde_json::to_string(&o).unwrap();
            assert!(
                json.contains(&format!("\"owner\":\"{}\"", o.kind())),
                "{json}"
            );
            assert_eq!(serde_json::from_str::<Owner>(&json).unwrap(), o);
        }
        let bad = r#"{"owner":"agent","role":"router","extra":1}"#;
        assert!(serde_json::from_str::<Owner>(bad).is_err());
    }

    #[test]
    fn generations_only_grow() {
        assert!(Generation(1).next() > Generation(1));
        assert_eq!(serde_json::to_string(&Generation(7)).unwrap(), "7");
    }
}
