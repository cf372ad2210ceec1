//! How the API runs a CNI call against the shared agent: inline on the async
//! worker when the work is bounded, or in phases around the agent lock when
//! interfaces must be made or removed.
//!
//! It exists apart from ADD and DEL themselves because it is about locking
//! and where work runs, not about what an ADD or a DEL does.

use super::*;

pub(super) fn lock(slot: &Mutex<Option<Agent>>) -> std::sync::MutexGuard<'_, Option<Agent>> {
    slot.lock().unwrap_or_else(|p| p.into_inner())
}

pub(super) fn not_ready() -> AgentError {
    AgentError::NotReady {
        reason: "restoring allocations and maps".into(),
    }
}

/// What a CNI call's step on the API's async worker came to (see
/// [`endpoint_add_inline`] and [`endpoint_del_inline`]).
#[derive(Debug)]
pub enum Inline<T, R> {
    /// Served: store and map work only, done under the lock.
    Done(Result<T, AgentError>),
    /// Nothing was done: the request needs kernel work or an external
    /// plugin, and must run on the blocking pool.
    Blocking(R),
}

/// Whether serving this attachment, as the agent holds it right now, is
/// store and map work only: IPAM mode, addresses from the agent's own pools
/// (no external plugin to run), no interfaces to check or remove. Only ever
/// asked with the lock held by the caller that then does the work.
pub(super) fn inline_capable(agent: &Agent, key: &str, mode: Option<EndpointMode>) -> bool {
    mode.is_none_or(|m| m == EndpointMode::Ipam)
        && !agent.reaper.holds_key(key)
        && !agent.delegated_mode()
        && !agent.delegated.contains_key(key)
        && agent
            .endpoints
            .get(key)
            .is_none_or(|e| e.mode == EndpointMode::Ipam)
}

/// CNI ADD from the API's async worker. The attachment's state is judged
/// and the ADD served under one hold of the agent lock, so nothing can
/// change in between: an IPAM-only ADD (a commit and a few map writes, which
/// the lock serialises anyway) is served here, without the two thread
/// wake-ups a hop to the blocking pool costs (`cargo xtask bench cni`);
/// anything else is handed back untouched, for [`endpoint_add_concurrent`]
/// on the blocking pool.
pub fn endpoint_add_inline(
    slot: &Mutex<Option<Agent>>,
    req: EndpointRequest,
) -> Inline<EndpointReply, EndpointRequest> {
    let mut guard = lock(slot);
    let Some(agent) = guard.as_mut() else {
        return Inline::Done(Err(not_ready()));
    };
    let key = endpoint_key(&req.container_id, &req.ifname);
    if !inline_capable(agent, &key, Some(req.mode)) {
        return Inline::Blocking(req);
    }
    // With releases pending, an exhausted pool may only be waiting for
    // them: that wait is the blocking pool's (`endpoint_add_concurrent`).
    let again = agent.reaper.is_busy().then(|| req.clone());
    let begun = agent.endpoint_add_begin(req);
    if let (Err(e), Some(req)) = (&begun, again)
        && releasing(agent, e) > 0
    {
        return Inline::Blocking(req);
    }
    Inline::Done(match begun {
        Ok(AddBegin::Done(reply)) => Ok(*reply),
        // Never inline-capable: a plugin to run is for the blocking pool.
        Ok(AddBegin::Delegated(d)) => {
            let (next, undo) = agent.endpoint_add_delegated(d.run());
            if let Some(undo) = undo {
                undo.run();
            }
            next.and_then(|b| match b {
                AddBegin::Done(reply) => Ok(*reply),
                _ => Err(invalid("an IPAM-only ADD asked for interfaces")),
            })
        }
        // IPAM mode finishes in the first phase; were that ever to change,
        // the interfaces are not made here.
        Ok(AddBegin::Interfaces(p)) => {
            let failure = InterfaceFailure {
                error: invalid("an IPAM-only ADD asked for interfaces"),
                host_ifindex: None,
            };
            agent.endpoint_add_finish(*p, Err(failure))
        }
        Err(e) => Err(e),
    })
}

/// How long a full ADD waits for what blocks it: the release of its own
/// attachment's earlier interface, or addresses of an exhausted pool that
/// pending releases hold.
const ADD_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// How many addresses of the pool `e` found exhausted pending releases
/// hold (0: `e` is something else, or nothing is being released there).
fn releasing(agent: &Agent, e: &AgentError) -> usize {
    e.exhausted()
        .map_or(0, |(pool, family)| agent.reaper.holding_in(pool, family))
}

/// CNI DEL from the API's async worker: judged and committed under one hold
/// of the agent lock (as [`endpoint_add_inline`]). The kernel work a full
/// attachment leaves (detach, veth deletion) is never run here: it comes
/// back as a [`DelCleanup`] for the blocking pool ([`DelCleanup::is_empty`]
/// says whether there is any). A delegated attachment (an external plugin
/// to run) is handed back untouched.
pub fn endpoint_del_inline(
    slot: &Mutex<Option<Agent>>,
    req: DelRequest,
) -> Inline<DelCleanup, DelRequest> {
    let mut guard = lock(slot);
    let Some(agent) = guard.as_mut() else {
        return Inline::Done(Err(not_ready()));
    };
    let key = endpoint_key(&req.container_id, &req.ifname);
    if agent.delegated_mode() || agent.delegated.contains_key(&key) {
        return Inline::Blocking(req);
    }
    Inline::Done(agent.endpoint_del_begin(req))
}

/// CNI ADD with the agent lock held only to decide and to commit: the
/// interfaces and the program attach (each waiting on the kernel) run
/// unlocked, so concurrent ADDs overlap their waits.
///
/// # Errors
/// As [`Agent::endpoint_add`].
pub fn endpoint_add_concurrent(
    slot: &Mutex<Option<Agent>>,
    req: EndpointRequest,
) -> Result<EndpointReply, AgentError> {
    // The same attachment DEL'd a moment ago: its addresses come back only
    // once its old veth is gone.
    let key = endpoint_key(&req.container_id, &req.ifname);
    let (netns, ifname) = (req.netns.clone(), req.ifname.clone());
    let deadline = std::time::Instant::now() + ADD_WAIT;
    // A pool whose only free addresses are still being released (their
    // pods DEL'd, the interfaces not yet gone) is waited for, not answered
    // "exhausted": they come free within a reaper batch.
    let begun = loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let mut guard = crate::agent::reaper::lock_unblocked(slot, &key, &netns, &ifname, left);
        let agent = guard.as_mut().ok_or_else(not_ready)?;
        match agent.endpoint_add_begin(req.clone()) {
            Err(e) => match (releasing(agent, &e), e.exhausted()) {
                (0, _) | (_, None) => break Err(e),
                (pending, Some((pool, family))) => {
                    if std::time::Instant::now() >= deadline {
                        break Err(AgentError::AddressesReleasing {
                            pool: pool.to_string(),
                            family,
                            pending,
                        });
                    }
                    crate::agent::reaper::wait_for_progress(guard, deadline);
                }
            },
            ok => break ok,
        }
    };
    let mut begun = begun?;
    if let AddBegin::Delegated(d) = begun {
        // The plugin runs with the agent free: its timeout may be minutes.
        let ran = d.run();
        let mut guard = lock(slot);
        let Some(agent) = guard.as_mut() else {
            drop(guard);
            if let Some(undo) = ran.undo() {
                undo.run();
            }
            return Err(not_ready());
        };
        let (next, undo) = agent.endpoint_add_delegated(ran);
        drop(guard);
        if let Some(undo) = undo {
            undo.run();
        }
        begun = next?;
    }
    let prepared = match begun {
        AddBegin::Done(reply) => return Ok(*reply),
        AddBegin::Interfaces(p) => p,
        AddBegin::Delegated(_) => {
            return Err(invalid("the plugin's ADD was asked to run twice"));
        }
    };
    let made = build_interfaces(
        &prepared.req,
        &prepared.addresses(),
        prepared.attach.as_ref(),
    );
    let mut guard = lock(slot);
    match guard.as_mut() {
        Some(agent) => agent.endpoint_add_finish(*prepared, made),
        None => {
            let mut errors = vec![not_ready()];
            if let Ok(i) = made
                && let Err(e) = (DelCleanup {
                    host: Some((i.host_ifname, i.host_ifindex)),
                    attach: prepared.attach,
                    orphan: None,
                    orphan_guard: None,
                    gone: None,
                    plugin: None,
                })
                .run()
            {
                errors.push(e);
            }
            Err(AgentError::all(errors).expect_err("one error at least"))
        }
    }
}

/// CNI DEL with the kernel work (detach, veth deletion) outside the lock.
///
/// # Errors
/// As [`Agent::endpoint_del`].
pub fn endpoint_del_concurrent(
    slot: &Mutex<Option<Agent>>,
    req: DelRequest,
) -> Result<(), AgentError> {
    let mut cleanup = lock(slot)
        .as_mut()
        .ok_or_else(not_ready)?
        .endpoint_del_begin(req)?;
    if let Some(plugin) = cleanup.plugin.take() {
        // The plugin runs with the agent free; the commit comes after.
        let ran = plugin.run();
        cleanup = lock(slot)
            .as_mut()
            .ok_or_else(not_ready)?
            .endpoint_del_delegated(ran)?;
    }
    cleanup.run()
}
