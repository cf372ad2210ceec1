//! CNI CHECK and GC, and the endpoints' start-up upkeep (sweeping what no
//! record owns, re-attaching programs).
//!
//! It exists apart from ADD and DEL because these compare or repair state
//! after the fact rather than change it in lockstep order.

use super::*;

impl Agent {
    /// CNI CHECK: the interfaces, addresses, routes and map entries of the
    /// attachment are as ADD made them.
    ///
    /// # Errors
    /// [`AgentError::CheckFailed`] listing every problem.
    pub fn endpoint_check(&mut self, req: EndpointRequest) -> Result<(), AgentError> {
        self.check_ready()?;
        let key = endpoint_key(&req.container_id, &req.ifname);
        let Some(record) = self.endpoints.get(&key).cloned() else {
            return Err(AgentError::CheckFailed {
                problems: vec![format!(
                    "no attachment {}/{} is known",
                    req.container_id, req.ifname
                )],
            });
        };
        let mut problems = Vec::new();
        let owner = Owner::endpoint(&req.container_id, &req.ifname);
        let held: BTreeSet<IpAddr> = self
            .manager
            .owned_by(&owner)
            .map(|a| a.address)
            .chain(self.delegated_addresses(&key))
            .collect();
        for a in &record.addresses {
            if !held.contains(a) {
                problems.push(format!("address {a} is no longer allocated"));
            }
        }
        if record.mode == EndpointMode::Full {
            let name = record.host_ifname.clone().unwrap_or_default();
            match self.host_netlink()?.link(&name)? {
                Some(l) if l.index == record.host_ifindex => {}
                Some(l) => problems.push(format!(
                    "host interface {name} has index {} instead of {}",
                    l.index, record.host_ifindex
                )),
                None => problems.push(format!("host interface {name} is missing")),
            }
            match Netlink::in_netns(&req.netns) {
                Err(e) => problems.push(format!("cannot enter {}: {e}", req.netns.display())),
                Ok(inside) => match inside.link(&req.ifname)? {
                    None => problems.push(format!(
                        "interface {} is missing in the container",
                        req.ifname
                    )),
                    Some(l) => {
                        let have: BTreeSet<IpNet> =
                            inside.addresses(l.index)?.into_iter().collect();
                        for a in &record.addresses {
                            if !have.contains(&IpNet::from(*a)) {
                                problems.push(format!("address {a} is missing on {}", req.ifname));
                            }
                        }
                        let routes = inside.routes(l.index)?;
                        for a in &record.addresses {
                            let default: IpNet = if a.is_ipv4() {
                                "0.0.0.0/0".parse().expect("literal")
                            } else {
                                "::/0".parse().expect("literal")
                            };
                            if !routes.contains(&default) {
                                problems.push(format!(
                                    "default route {default} is missing on {}",
                                    req.ifname
                                ));
                            }
                        }
                    }
                },
            }
            match self.maps.endpoints().get(&record.host_ifindex, 0) {
                Ok(v) if v.mac == record.mac && v.is_sealed(record.host_ifindex) => {}
                Ok(_) => problems.push("ENDPOINTS entry differs".into()),
                Err(_) => problems.push("ENDPOINTS entry is missing".into()),
            }
        }
        for a in &record.addresses {
            let present = match a {
                IpAddr::V4(v4) => self.maps.ipcache_host_v4().get(&v4.octets(), 0).is_ok(),
                IpAddr::V6(v6) => self.maps.ipcache_host_v6().get(&v6.octets(), 0).is_ok(),
            };
            if !present {
                problems.push(format!("IPCACHE entry for {a} is missing"));
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(AgentError::CheckFailed { problems })
        }
    }

    /// CNI GC's first phase, one command on the owner: every endpoint
    /// attachment not in `valid` is released (committed, or for a
    /// delegated one left pending for its plugin's DEL); agent-role,
    /// LoadBalancer and other owners are never touched. What is left to a
    /// plugin or the kernel comes back for [`endpoint_gc_concurrent`] to
    /// run off the owner.
    ///
    /// # Errors
    /// The agent is not ready. A release that could not be recorded is
    /// carried in the result: every attachment is tried.
    pub(super) fn endpoint_gc_begin(&mut self, req: GcRequest) -> Result<GcBegun, AgentError> {
        self.check_ready()?;
        self.settle();
        let valid: BTreeSet<(String, String)> = req.valid.into_iter().collect();
        let mut stale: BTreeSet<(String, String)> = self
            .endpoints
            .values()
            .map(|r| (r.container_id.clone(), r.ifname.clone()))
            .collect();
        for a in self.manager.allocations() {
            if let Owner::Endpoint {
                container_id,
                ifname,
            } = &a.owner
            {
                stale.insert((container_id.clone(), ifname.clone()));
            }
        }
        let mut begun = GcBegun::default();
        for (c, i) in stale {
            if valid.contains(&(c.clone(), i.clone())) {
                continue;
            }
            match self.endpoint_del_commit(&c, &i) {
                Ok(cleanup) => begun.released.push(((c, i), cleanup)),
                Err(e) => begun.errors.push(e),
            }
        }
        if self.delegated_mode() {
            match self.delegated_gc_plan(&valid) {
                Ok(plan) => begun.plugin = Some(plan),
                Err(e) => begun.errors.push(e),
            }
        }
        Ok(begun)
    }

    /// At start-up (nothing is pending yet): removes host interfaces with
    /// this agent's names that no record owns, and `from_endpoint` link pins
    /// whose interface index no full record has. Both are what an ADD that
    /// died between making its interfaces and its commit leaves; its DEL
    /// may never come (the runtime may have seen the ADD fail), and pins are
    /// otherwise never swept. Failures are logged; the next start retries.
    pub(in crate::agent) fn sweep_leftovers(&mut self) {
        let owned: BTreeSet<(String, u32)> = self
            .endpoints
            .values()
            .filter(|e| e.mode == EndpointMode::Full)
            .filter_map(|e| e.host_ifname.clone().map(|n| (n, e.host_ifindex)))
            .collect();
        let owned_index: BTreeSet<u32> = owned.iter().map(|(_, i)| *i).collect();
        let links = match self.host_netlink().and_then(|h| Ok(h.links()?)) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "listing interfaces for the start-up sweep failed");
                return;
            }
        };
        let strays: Vec<String> = links
            .iter()
            .filter(|l| is_agent_ifname(&l.name) && !owned.contains(&(l.name.clone(), l.index)))
            .map(|l| l.name.clone())
            .collect();
        if let Err(e) = remove_leftovers(&strays, self.from_endpoint.as_ref()) {
            tracing::error!(error = %e, "removing interfaces no record owns failed");
        }
        if let Some(pin) = &self.from_endpoint {
            match pin.linked_indexes(Hook::Ingress) {
                Ok(indexes) => {
                    for index in indexes.into_iter().filter(|i| !owned_index.contains(i)) {
                        tracing::info!(
                            ifindex = index,
                            "removing a from_endpoint link pin no record owns"
                        );
                        if let Err(e) = pin.detach_index(index, Hook::Ingress) {
                            tracing::error!(error = %e, ifindex = index, "removing a stray link pin failed");
                        }
                    }
                }
                Err(e) => tracing::error!(error = %e, "listing link pins failed"),
            }
        }
    }

    /// Re-attaches `from_endpoint` to every full endpoint whose interface
    /// exists (in place: pinned links are updated, not recreated).
    pub(in crate::agent) fn reattach_endpoints(&mut self) {
        let records: Vec<EndpointRecord> = self.endpoints.values().cloned().collect();
        for r in records {
            if r.mode != EndpointMode::Full {
                continue;
            }
            let Some(name) = r.host_ifname.clone() else {
                continue;
            };
            let exists = self
                .host_netlink()
                .and_then(|h| Ok(h.link(&name)?))
                .map(|l| l.is_some_and(|l| l.index == r.host_ifindex))
                .unwrap_or(false);
            if !exists {
                tracing::warn!(container = %r.container_id, iface = %name, "endpoint interface is gone; waiting for DEL or GC");
                continue;
            }
            let attached = match &self.from_endpoint {
                Some(pin) => pin.attach(&name, Hook::Ingress),
                None => self
                    .datapath
                    .attach(program_names::FROM_ENDPOINT, &name, Hook::Ingress),
            };
            if let Err(e) = attached {
                tracing::error!(error = %e, iface = %name, "re-attaching from_endpoint failed");
            }
        }
    }
}
