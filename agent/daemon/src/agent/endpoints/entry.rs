//! How the API runs a CNI call against the agent's owner
//! ([`AgentHandle`]): as one command when the work is store and maps only,
//! or in phases around commands when
//! interfaces must be made or removed or a plugin run.
//!
//! It exists apart from ADD and DEL themselves because it is about where
//! work runs, not about what an ADD or a DEL does.

use super::*;
use crate::agent::AgentHandle;

pub(super) fn not_ready() -> AgentError {
    AgentError::NotReady {
        reason: "restoring allocations and maps".into(),
    }
}

/// What a CNI call's one command on the owner came to (see
/// [`endpoint_add_inline`] and [`endpoint_del_inline`]).
#[derive(Debug)]
pub enum Inline<T, R> {
    /// Served: store and map work only, done in the command.
    Done(Result<T, AgentError>),
    /// Nothing was done: the request needs kernel work or an external
    /// plugin, and must run on the blocking pool.
    Blocking(R),
}

/// Whether serving this attachment, as the agent holds it right now, is
/// store and map work only: IPAM mode, addresses from the agent's own pools
/// (no external plugin to run), no interfaces to check or remove. Only ever
/// asked in the command that then does the work.
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

/// CNI ADD as one command on the owner ([`AgentHandle::ask`]). The
/// attachment's state is judged and the ADD served in the same command, so
/// nothing can change in between: an IPAM-only ADD (a commit and a few map
/// writes) is served here; anything else is handed back
/// untouched, for [`endpoint_add_concurrent`] on the blocking pool.
pub fn endpoint_add_inline(
    slot: &mut Option<Agent>,
    req: EndpointRequest,
) -> Inline<EndpointReply, EndpointRequest> {
    let Some(agent) = slot.as_mut() else {
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
        // Never inline-capable (an IPAM attachment is never half-gone);
        // were that ever to change, the DEL's work is not left undone.
        Ok(AddBegin::StartOver(c)) => agent
            .del_held(*c)
            .and_then(|()| Err(invalid("an IPAM-only ADD had to start over; retry it"))),
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

/// CNI DEL as one command on the owner: judged and committed in it (as
/// [`endpoint_add_inline`]). The kernel work a full
/// attachment leaves (detach, veth deletion) is never run here: it comes
/// back as a [`DelCleanup`] for the blocking pool ([`DelCleanup::is_empty`]
/// says whether there is any). A delegated attachment (an external plugin
/// to run) is handed back untouched.
pub fn endpoint_del_inline(
    slot: &mut Option<Agent>,
    req: DelRequest,
) -> Inline<DelCleanup, DelRequest> {
    let Some(agent) = slot.as_mut() else {
        return Inline::Done(Err(not_ready()));
    };
    let key = endpoint_key(&req.container_id, &req.ifname);
    if agent.delegated_mode() || agent.delegated.contains_key(&key) {
        return Inline::Blocking(req);
    }
    Inline::Done(agent.endpoint_del_begin(req))
}

/// What one look at an ADD's attachment came to, on the owner.
enum Begun {
    Started(Result<AddBegin, AgentError>),
    /// Blocked by a pending release or an exhausted pool whose addresses
    /// are being released: wait for the reaper, then look again.
    Wait(crate::agent::reaper::Progress),
}

/// CNI ADD in phases, from the blocking pool: commands decide and commit;
/// the plugin, the interfaces and the program attach (each waiting on the
/// kernel or a process) run between them, so concurrent ADDs overlap their
/// waits and nothing waits for them.
///
/// # Errors
/// As [`Agent::endpoint_add`].
pub fn endpoint_add_concurrent(
    handle: &AgentHandle,
    req: EndpointRequest,
) -> Result<EndpointReply, AgentError> {
    let key = endpoint_key(&req.container_id, &req.ifname);
    let deadline = std::time::Instant::now() + ADD_WAIT;
    // The same attachment DEL'd a moment ago: its addresses come back only
    // once its old veth is gone. A pool whose only free addresses are still
    // being released (their pods DEL'd, the interfaces not yet gone) is
    // waited for, not answered "exhausted": they come free within a
    // reaper batch.
    let begun = loop {
        let (req, key) = (req.clone(), key.clone());
        let look = handle.call(move |slot| {
            let Some(agent) = slot.as_mut() else {
                return Begun::Started(Err(not_ready()));
            };
            let now = std::time::Instant::now();
            if now < deadline && agent.reaper.blocks(&key, &req.netns, &req.ifname) {
                return Begun::Wait(agent.reaper_progress());
            }
            match agent.endpoint_add_begin(req) {
                Err(e) => match (releasing(agent, &e), e.exhausted()) {
                    (0, _) | (_, None) => Begun::Started(Err(e)),
                    (pending, Some((pool, family))) => {
                        if now >= deadline {
                            Begun::Started(Err(AgentError::AddressesReleasing {
                                pool: pool.to_string(),
                                family,
                                pending,
                            }))
                        } else {
                            Begun::Wait(agent.reaper_progress())
                        }
                    }
                },
                ok => Begun::Started(ok),
            }
        })?;
        match look {
            // Half-gone: the DEL's plugin and kernel work run here, off
            // the owner, then the ADD looks again.
            Begun::Started(Ok(AddBegin::StartOver(cleanup))) => del_off_owner(handle, *cleanup)?,
            Begun::Started(r) => break r,
            Begun::Wait(progress) => progress.wait(deadline),
        }
    };
    let mut begun = begun?;
    if let AddBegin::Delegated(d) = begun {
        // The plugin runs with the agent free: its timeout may be minutes.
        let ran = d.run();
        let undo_if_gone = ran.undo();
        let next =
            handle.call(move |slot| slot.as_mut().map(|agent| agent.endpoint_add_delegated(ran)));
        let (next, undo) = match next {
            Ok(Some(r)) => r,
            Ok(None) | Err(_) => {
                if let Some(undo) = undo_if_gone {
                    undo.run();
                }
                return Err(not_ready());
            }
        };
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
        AddBegin::StartOver(_) => return Err(invalid("the ADD started over after its plugin ran")),
    };
    let made = build_interfaces(
        &prepared.req,
        &prepared.addresses(),
        prepared.attach.as_ref(),
    );
    let finished = handle.call(move |slot| match slot.as_mut() {
        Some(agent) => Ok(agent.endpoint_add_finish(*prepared, made)),
        None => Err(Box::new((prepared, made))),
    });
    match finished {
        Ok(Ok(r)) => r,
        Ok(Err(left)) => {
            let (prepared, made) = *left;
            Err(undo_interfaces(*prepared, made))
        }
        // The owner ended with the interfaces made: nobody will record
        // them, so they go (the next start's GC would find them anyway).
        Err(e) => Err(e),
    }
}

/// The agent went away between an ADD's phases: the interfaces it made are
/// removed, and the ADD fails.
fn undo_interfaces(
    prepared: PreparedAdd,
    made: Result<Interfaces, InterfaceFailure>,
) -> AgentError {
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
    AgentError::all(errors).expect_err("one error at least")
}

/// CNI DEL in phases, from the blocking pool: the plugin and the kernel
/// work (detach, veth deletion) run between commands.
///
/// # Errors
/// As [`Agent::endpoint_del`].
pub fn endpoint_del_concurrent(handle: &AgentHandle, req: DelRequest) -> Result<(), AgentError> {
    let cleanup = handle.call(move |slot| {
        slot.as_mut()
            .ok_or_else(not_ready)
            .and_then(|a| a.endpoint_del_begin(req))
    })??;
    del_off_owner(handle, cleanup)
}

/// What a DEL committed on the owner leaves, run off it: the plugin's DEL
/// (then its commit, a command), then the kernel work.
fn del_off_owner(handle: &AgentHandle, mut cleanup: DelCleanup) -> Result<(), AgentError> {
    if let Some(plugin) = cleanup.plugin.take() {
        // The plugin runs with the agent free; the commit comes after.
        let ran = plugin.run();
        cleanup = handle.call(move |slot| {
            slot.as_mut()
                .ok_or_else(not_ready)
                .and_then(|a| a.endpoint_del_delegated(ran))
        })??;
    }
    cleanup.run()
}

/// What CNI GC's first command committed (`Agent::endpoint_gc_begin`).
#[derive(Debug, Default)]
pub struct GcBegun {
    /// Each attachment released, with what its DEL left to a plugin or
    /// the kernel.
    pub(super) released: Vec<((String, String), DelCleanup)>,
    /// Releases that could not be recorded.
    pub(super) errors: Vec<AgentError>,
    /// Delegated mode: the GC to pass on to the plugin.
    pub(super) plugin: Option<crate::agent::delegated::DelegatedGc>,
}

/// CNI GC: one command releases every endpoint attachment not in `valid`
/// (`Agent::endpoint_gc_begin`); the delegated plugin's DELs and GC, and
/// the kernel work, run here, off the owner, each plugin DEL's commit a
/// command of its own. Every attachment is tried, every failure reported
/// (the released ones stay released).
///
/// # Errors
/// Every release, plugin call or kernel step that failed.
pub fn endpoint_gc_concurrent(
    handle: &AgentHandle,
    req: GcRequest,
) -> Result<GcReport, AgentError> {
    let begun = handle.call(move |slot| {
        slot.as_mut()
            .ok_or_else(not_ready)
            .and_then(|a| a.endpoint_gc_begin(req))
    })??;
    let mut report = GcReport::default();
    let mut errors = begun.errors;
    for (attachment, cleanup) in begun.released {
        // Not waited for: the reaper deletes the veth, and an ADD of the
        // same attachment waits for it.
        match del_off_owner(handle, without_gone_wait(cleanup)) {
            Ok(()) => report.released.push(attachment),
            Err(e) => errors.push(e),
        }
    }
    if let Some(gc) = begun.plugin {
        let (sent, r) = gc.run();
        handle.call(move |slot| {
            if let Some(a) = slot.as_mut() {
                for c in sent {
                    a.count(c);
                }
            }
        })?;
        if let Err(e) = r {
            errors.push(e);
        }
    }
    if !errors.is_empty() {
        tracing::warn!(
            released = report.released.len(),
            failed = errors.len(),
            "GC released what it could"
        );
    }
    AgentError::all(errors)?;
    Ok(report)
}
