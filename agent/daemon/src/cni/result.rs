//! ADD results, in every supported version's shape, and conversion between
//! them.
//!
//! The types here are version-neutral; the version only matters when a result
//! is written ([`CniResult::to_json`]) or read ([`CniResult::from_json`]). That
//! is how conversion works: a `prevResult` cached by the runtime under 0.4.0 is
//! read into these types and written back as 1.1.0, or the reverse. The
//! differences between versions:
//!
//! | field | 0.3.1 / 0.4.0 | 1.0.0 | 1.1.0 |
//! | --- | --- | --- | --- |
//! | `ips[].version` ("4"/"6") | written | — | — |
//! | `interfaces[].mtu`, `socketPath`, `pciID` | — | — | written |
//! | `routes[].mtu`, `advmss`, `priority`, `table`, `scope` | — | — | written |
//!
//! Fields a version does not have are dropped when writing it, and tolerated
//! when reading any version (a runtime may hand a newer `prevResult` to an
//! older configuration). IPAM plugins return [`IpamResult`], which has no
//! interfaces and no `ips[].interface` (spec section 5, "Delegated plugins").

use std::net::IpAddr;

use ipnet::IpNet;
use serde_json::{Map, Value, json};

use super::error::CniError;
use super::json::{Field, Obj};
use super::version::{CniVersion, VersionParseError};

/// An interface created by the attachment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Interface {
    /// The interface name.
    pub name: String,
    /// Its MAC address, if it has one.
    pub mac: Option<String>,
    /// Its MTU (written from 1.1.0).
    pub mtu: Option<u32>,
    /// The netns path for interfaces in the container; `None` on the host.
    pub sandbox: Option<String>,
    /// A socket path for the interface (written from 1.1.0).
    pub socket_path: Option<String>,
    /// The PCI ID of its device (written from 1.1.0).
    pub pci_id: Option<String>,
}

/// An address assigned by the attachment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IpConfig {
    /// The address with its subnet's prefix length (host bits kept:
    /// `10.1.0.5/16`).
    pub address: IpNet,
    /// The subnet's gateway, if any.
    pub gateway: Option<IpAddr>,
    /// Index into the result's interfaces of the interface carrying the
    /// address.
    pub interface: Option<u32>,
}

/// A route created by the attachment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    /// The destination.
    pub dst: IpNet,
    /// The next hop; if unset, a gateway from `ips` may be used.
    pub gw: Option<IpAddr>,
    /// Path MTU (written from 1.1.0).
    pub mtu: Option<u32>,
    /// Advertised MSS (written from 1.1.0).
    pub advmss: Option<u32>,
    /// Route priority, lower wins (written from 1.1.0).
    pub priority: Option<u32>,
    /// Routing table (written from 1.1.0).
    pub table: Option<u32>,
    /// Route scope: 0 global, 253 link, 254 host (written from 1.1.0).
    pub scope: Option<u8>,
}

impl Route {
    /// A route to `dst`, via `gw` if given, with no other attributes.
    pub fn new(dst: IpNet, gw: Option<IpAddr>) -> Route {
        Route {
            dst,
            gw,
            mtu: None,
            advmss: None,
            priority: None,
            table: None,
            scope: None,
        }
    }
}

/// DNS settings; omitted from results when empty.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Dns {
    /// Name servers, in priority order.
    pub nameservers: Vec<String>,
    /// The local domain.
    pub domain: Option<String>,
    /// Search domains, in priority order.
    pub search: Vec<String>,
    /// Resolver options.
    pub options: Vec<String>,
}

impl Dns {
    /// Whether nothing is set.
    pub fn is_empty(&self) -> bool {
        self.nameservers.is_empty()
            && self.domain.is_none()
            && self.search.is_empty()
            && self.options.is_empty()
    }

    fn to_json(&self) -> Value {
        let mut out = Map::new();
        if !self.nameservers.is_empty() {
            out.insert("nameservers".into(), json!(self.nameservers));
        }
        if let Some(domain) = &self.domain {
            out.insert("domain".into(), json!(domain));
        }
        if !self.search.is_empty() {
            out.insert("search".into(), json!(self.search));
        }
        if !self.options.is_empty() {
            out.insert("options".into(), json!(self.options));
        }
        Value::Object(out)
    }

    pub(crate) fn from_field(field: &Field<'_>) -> Result<Dns, CniError> {
        let obj = field.as_obj()?;
        let list = |key: &str| -> Result<Vec<String>, CniError> {
            obj.get(key)
                .map(|f| f.as_strings())
                .transpose()
                .map(Option::unwrap_or_default)
        };
        Ok(Dns {
            nameservers: list("nameservers")?,
            domain: obj.opt_str("domain")?.map(str::to_owned),
            search: list("search")?,
            options: list("options")?,
        })
    }
}

/// The ADD result of an interface plugin (spec section 5, "ADD Success").
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CniResult {
    /// Interfaces created, host side included.
    pub interfaces: Vec<Interface>,
    /// Addresses assigned.
    pub ips: Vec<IpConfig>,
    /// Routes created.
    pub routes: Vec<Route>,
    /// DNS settings.
    pub dns: Dns,
}

/// An address from an IPAM plugin: no interface index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IpamAddress {
    /// The address with its subnet's prefix length.
    pub address: IpNet,
    /// The subnet's gateway, if any.
    pub gateway: Option<IpAddr>,
}

/// The abbreviated result of an IPAM plugin such as `lockstep-ipam`: no
/// `interfaces`, and no `interface` in `ips`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IpamResult {
    /// Addresses allocated.
    pub ips: Vec<IpamAddress>,
    /// Routes the interface plugin should install.
    pub routes: Vec<Route>,
    /// DNS settings.
    pub dns: Dns,
}

fn ip_version(address: &IpNet) -> &'static str {
    match address {
        IpNet::V4(_) => "4",
        IpNet::V6(_) => "6",
    }
}

fn ip_to_json(
    version: CniVersion,
    address: &IpNet,
    gateway: Option<IpAddr>,
    interface: Option<u32>,
) -> Value {
    let mut out = Map::new();
    if version.has_ip_version_field() {
        out.insert("version".into(), json!(ip_version(address)));
    }
    out.insert("address".into(), json!(address.to_string()));
    if let Some(gw) = gateway {
        out.insert("gateway".into(), json!(gw.to_string()));
    }
    if let Some(i) = interface {
        out.insert("interface".into(), json!(i));
    }
    Value::Object(out)
}

fn route_to_json(version: CniVersion, route: &Route) -> Value {
    let mut out = Map::new();
    out.insert("dst".into(), json!(route.dst.to_string()));
    if let Some(gw) = route.gw {
        out.insert("gw".into(), json!(gw.to_string()));
    }
    if version >= CniVersion::V1_1_0 {
        let extras = [
            ("mtu", route.mtu),
            ("advmss", route.advmss),
            ("priority", route.priority),
            ("table", route.table),
            ("scope", route.scope.map(u32::from)),
        ];
        for (key, value) in extras {
            if let Some(v) = value {
                out.insert(key.into(), json!(v));
            }
        }
    }
    Value::Object(out)
}

fn interface_to_json(version: CniVersion, iface: &Interface) -> Value {
    let mut out = Map::new();
    out.insert("name".into(), json!(iface.name));
    if let Some(mac) = &iface.mac {
        out.insert("mac".into(), json!(mac));
    }
    if let Some(sandbox) = &iface.sandbox {
        out.insert("sandbox".into(), json!(sandbox));
    }
    if version >= CniVersion::V1_1_0 {
        if let Some(mtu) = iface.mtu {
            out.insert("mtu".into(), json!(mtu));
        }
        if let Some(path) = &iface.socket_path {
            out.insert("socketPath".into(), json!(path));
        }
        if let Some(pci) = &iface.pci_id {
            out.insert("pciID".into(), json!(pci));
        }
    }
    Value::Object(out)
}

/// Writes the parts common to both result kinds; empty lists and an empty
/// `dns` are omitted, as the reference implementation omits them.
fn common_to_json(
    version: CniVersion,
    out: &mut Map<String, Value>,
    ips: Vec<Value>,
    routes: &[Route],
    dns: &Dns,
) {
    if !ips.is_empty() {
        out.insert("ips".into(), Value::Array(ips));
    }
    if !routes.is_empty() {
        out.insert(
            "routes".into(),
            Value::Array(routes.iter().map(|r| route_to_json(version, r)).collect()),
        );
    }
    if !dns.is_empty() {
        out.insert("dns".into(), dns.to_json());
    }
}

impl CniResult {
    /// The result in `version`'s shape.
    pub fn to_json(&self, version: CniVersion) -> Value {
        let mut out = Map::new();
        out.insert("cniVersion".into(), json!(version.as_str()));
        if !self.interfaces.is_empty() {
            out.insert(
                "interfaces".into(),
                Value::Array(
                    self.interfaces
                        .iter()
                        .map(|i| interface_to_json(version, i))
                        .collect(),
                ),
            );
        }
        let ips = self
            .ips
            .iter()
            .map(|ip| ip_to_json(version, &ip.address, ip.gateway, ip.interface))
            .collect();
        common_to_json(version, &mut out, ips, &self.routes, &self.dns);
        Value::Object(out)
    }

    /// Combines an IPAM result with the interfaces the plugin created, putting
    /// every address on interface `interface` (the container side).
    pub fn from_ipam(ipam: IpamResult, interfaces: Vec<Interface>, interface: u32) -> CniResult {
        CniResult {
            interfaces,
            ips: ipam
                .ips
                .into_iter()
                .map(|ip| IpConfig {
                    address: ip.address,
                    gateway: ip.gateway,
                    interface: Some(interface),
                })
                .collect(),
            routes: ipam.routes,
            dns: ipam.dns,
        }
    }

    /// Reads a result (typically `prevResult`) expected in `version`. A
    /// `cniVersion` inside the result, if present, takes precedence: it says
    /// which shape the result was written in.
    ///
    /// # Errors
    /// Code 6 for wrong JSON types, 1 for an unsupported inner `cniVersion`,
    /// 7 for invalid addresses, an `ips[].version` that contradicts its
    /// address, or an `interface` index out of range; every message names the
    /// field from `path` down.
    pub fn from_json(
        value: &Value,
        path: &str,
        version: CniVersion,
    ) -> Result<CniResult, CniError> {
        let field = Field {
            value,
            path: path.to_owned(),
        };
        let obj = field.as_obj()?;
        let _version = inner_version(&obj, version)?;
        let interfaces = match obj.get("interfaces") {
            None => Vec::new(),
            Some(list) => list
                .as_array()?
                .iter()
                .map(parse_interface)
                .collect::<Result<_, _>>()?,
        };
        let mut ips = Vec::new();
        for item in obj
            .get("ips")
            .map(|f| f.as_array())
            .transpose()?
            .unwrap_or_default()
        {
            let ip_obj = item.as_obj()?;
            let (address, gateway) = parse_ip(&ip_obj)?;
            let interface = match ip_obj.get("interface") {
                None => None,
                Some(index) => {
                    let i = index.as_u32()?;
                    if usize::try_from(i).map_or(true, |i| i >= interfaces.len()) {
                        return Err(index.invalid(format!(
                            "no interface with index {i}: the result lists {} interfaces",
                            interfaces.len()
                        )));
                    }
                    Some(i)
                }
            };
            ips.push(IpConfig {
                address,
                gateway,
                interface,
            });
        }
        let (routes, dns) = parse_routes_dns(&obj)?;
        Ok(CniResult {
            interfaces,
            ips,
            routes,
            dns,
        })
    }
}

impl IpamResult {
    /// The result in `version`'s shape.
    pub fn to_json(&self, version: CniVersion) -> Value {
        let mut out = Map::new();
        out.insert("cniVersion".into(), json!(version.as_str()));
        let ips = self
            .ips
            .iter()
            .map(|ip| ip_to_json(version, &ip.address, ip.gateway, None))
            .collect();
        common_to_json(version, &mut out, ips, &self.routes, &self.dns);
        Value::Object(out)
    }

    /// Reads an IPAM plugin's result (e.g. from host-local in delegated mode).
    /// `interfaces` and `ips[].interface`, which IPAM plugins should not
    /// write, are ignored if present.
    ///
    /// # Errors
    /// As [`CniResult::from_json`].
    pub fn from_json(
        value: &Value,
        path: &str,
        version: CniVersion,
    ) -> Result<IpamResult, CniError> {
        let field = Field {
            value,
            path: path.to_owned(),
        };
        let obj = field.as_obj()?;
        let _version = inner_version(&obj, version)?;
        let mut ips = Vec::new();
        for item in obj
            .get("ips")
            .map(|f| f.as_array())
            .transpose()?
            .unwrap_or_default()
        {
            let (address, gateway) = parse_ip(&item.as_obj()?)?;
            ips.push(IpamAddress { address, gateway });
        }
        let (routes, dns) = parse_routes_dns(&obj)?;
        Ok(IpamResult { ips, routes, dns })
    }
}

/// The version a result was written in: its own `cniVersion` if present,
/// else the enclosing configuration's (as libcni does for `prevResult`).
fn inner_version(obj: &Obj<'_>, outer: CniVersion) -> Result<CniVersion, CniError> {
    let Some(field) = obj.get("cniVersion") else {
        return Ok(outer);
    };
    let text = field.as_str()?;
    text.parse().map_err(|e| match e {
        VersionParseError::Malformed => CniError::InvalidVersionString {
            field: field.path.clone(),
            value: text.to_owned(),
        },
        VersionParseError::Unsupported => CniError::UnsupportedVersion {
            field: field.path.clone(),
            version: text.to_owned(),
        },
    })
}

fn parse_interface(item: &Field<'_>) -> Result<Interface, CniError> {
    let obj = item.as_obj()?;
    let owned = |key: &str| obj.opt_str(key).map(|v| v.map(str::to_owned));
    Ok(Interface {
        name: obj.require("name", "")?.as_str()?.to_owned(),
        mac: owned("mac")?,
        mtu: obj.opt_u32("mtu")?,
        sandbox: owned("sandbox")?,
        socket_path: owned("socketPath")?,
        pci_id: owned("pciID")?,
    })
}

/// Parses `address` (CIDR with host bits) and `gateway`, and checks a
/// pre-1.0.0 `version` field against the address family.
fn parse_ip(obj: &Obj<'_>) -> Result<(IpNet, Option<IpAddr>), CniError> {
    let address_field = obj.require("address", "")?;
    let address = parse_ipnet(&address_field)?;
    let gateway = obj.get("gateway").map(|f| parse_ip_addr(&f)).transpose()?;
    if let Some(version) = obj.get("version") {
        let v = version.as_str()?;
        if v != "4" && v != "6" {
            return Err(version.invalid("must be \"4\" or \"6\""));
        }
        if v != ip_version(&address) {
            return Err(version.invalid(format!("contradicts address {address}")));
        }
    }
    if let Some(gw) = gateway.filter(|gw| gw.is_ipv4() != address.addr().is_ipv4()) {
        return Err(CniError::InvalidField {
            field: obj.path_of("gateway"),
            value: format!("\"{gw}\""),
            reason: format!("gateway family differs from address {address}"),
        });
    }
    Ok((address, gateway))
}

fn parse_routes_dns(obj: &Obj<'_>) -> Result<(Vec<Route>, Dns), CniError> {
    let mut routes = Vec::new();
    for item in obj
        .get("routes")
        .map(|f| f.as_array())
        .transpose()?
        .unwrap_or_default()
    {
        routes.push(parse_route(&item)?);
    }
    let dns = obj
        .get("dns")
        .map(|f| Dns::from_field(&f))
        .transpose()?
        .unwrap_or_default();
    Ok((routes, dns))
}

/// Parses a route object (`dst`, `gw`, and the 1.1.0 attributes).
pub(crate) fn parse_route(item: &Field<'_>) -> Result<Route, CniError> {
    let obj = item.as_obj()?;
    let dst = parse_ipnet(&obj.require("dst", "")?)?;
    let gw = obj.get("gw").map(|f| parse_ip_addr(&f)).transpose()?;
    if let Some(gw) = gw.filter(|gw| gw.is_ipv4() != dst.addr().is_ipv4()) {
        return Err(CniError::InvalidField {
            field: obj.path_of("gw"),
            value: format!("\"{gw}\""),
            reason: format!("next hop family differs from destination {dst}"),
        });
    }
    let scope = match obj.get("scope") {
        None => None,
        Some(f) => {
            let n = f.as_u32()?;
            Some(u8::try_from(n).map_err(|_| f.invalid("a route scope is 0 to 255"))?)
        }
    };
    Ok(Route {
        dst,
        gw,
        mtu: obj.opt_u32("mtu")?,
        advmss: obj.opt_u32("advmss")?,
        priority: obj.opt_u32("priority")?,
        table: obj.opt_u32("table")?,
        scope,
    })
}

/// An address in CIDR notation (`10.1.0.5/16`); host bits are allowed.
pub(crate) fn parse_ipnet(field: &Field<'_>) -> Result<IpNet, CniError> {
    let text = field.as_str()?;
    text.parse::<IpNet>().map_err(|_| {
        field.invalid("expected an address in CIDR notation, like 10.1.0.5/16 or fd00::5/64")
    })
}

/// A bare IP address.
pub(crate) fn parse_ip_addr(field: &Field<'_>) -> Result<IpAddr, CniError> {
    let text = field.as_str()?;
    text.parse::<IpAddr>()
        .map_err(|_| field.invalid("expected an IP address"))
}
