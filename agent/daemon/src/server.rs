//! `lockstep agent`: the long-running process.
//!
//! Binds the API socket (mode 0600) and the metrics listener first, so status
//! is answered ("not ready: restoring") while the agent loads the store and
//! reconciles the maps; then serves, reconciles periodically, and shuts down
//! cleanly on SIGTERM or SIGINT. Maps and links stay pinned across the exit.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, UnixListener};
use tokio::signal::unix::{SignalKind, signal};

use crate::agent::{Agent, AgentError, AgentHandle};
use crate::api::{AppState, metrics_router, router};
use crate::config::Config;
use crate::metrics::Metrics;

mod bgp;
mod cluster_door;
mod head;
mod kube;
mod kube_door;
mod loops;
mod start;
mod supervisor;

/// Errors that stop the agent.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// A listener could not be set up.
    #[error("cannot listen on {what}")]
    Listen {
        /// The socket or address.
        what: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Start-up failed.
    #[error("agent start-up failed")]
    Start(#[source] AgentError),
    /// The state directory is unsafe or cannot be made.
    #[error("the state directory cannot be used")]
    State(#[source] crate::store::StoreError),
    /// Installing the CNI plugin failed.
    #[error("installing the CNI plugin failed")]
    Install(#[source] crate::install::InstallError),
    /// The start-up task died.
    #[error("agent start-up task failed")]
    Join(#[source] tokio::task::JoinError),
    /// Masquerade settings refused, or its set-up failed.
    #[error("masquerade cannot start")]
    Masquerade(#[source] crate::masquerade::MasqueradeError),
    /// `[kubernetes]` names a kubeconfig or service account that cannot
    /// be used.
    #[error("the kubernetes client cannot be set up")]
    Kubernetes(#[source] crate::kubernetes::KubeError),
    /// A task of the running agent panicked: the agent stops rather than
    /// run on without it.
    #[error("the agent stopped")]
    Panicked(#[source] supervisor::Panicked),
}

fn listen_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ServerError {
    let what = what.into();
    move |source| ServerError::Listen { what, source }
}

/// The API socket's file, removed when the server ends, by whatever path
/// (a failed start too) — only while it is still the socket this agent
/// bound, never a file someone put there since.
struct SocketFile {
    path: PathBuf,
    ino: u64,
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        use std::os::unix::fs::MetadataExt as _;
        if std::fs::symlink_metadata(&self.path).is_ok_and(|m| m.ino() == self.ino) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Binds the API socket at `path` (mode 0600). The socket is bound inside a
/// fresh 0700 directory and renamed into place, so it never appears at its
/// path with the mode the process umask gave it. A stale socket of a killed
/// agent is replaced; a live one, a symlink or any other file at the path is
/// refused with a message that says which.
fn bind_socket(path: &Path) -> Result<(UnixListener, SocketFile), ServerError> {
    use std::os::unix::fs::{DirBuilderExt as _, FileTypeExt as _, MetadataExt as _};
    let refuse = |why: &str| ServerError::Listen {
        what: path.display().to_string(),
        source: std::io::Error::new(std::io::ErrorKind::AlreadyExists, why.to_string()),
    };
    let dir = path.parent().unwrap_or(Path::new("/"));
    std::fs::create_dir_all(dir).map_err(listen_err(dir.display().to_string()))?;
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            // Two agents cannot both get here with one store (its lock),
            // but binding comes first so status answers during restore.
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(refuse("another agent is serving on this socket"));
            }
            std::fs::remove_file(path).map_err(listen_err(path.display().to_string()))?;
        }
        Ok(meta) if meta.file_type().is_symlink() => {
            return Err(refuse(
                "the socket path is a symbolic link; refusing to use it (remove it)",
            ));
        }
        Ok(_) => {
            return Err(refuse(
                "the socket path exists and is not a socket; refusing to replace it",
            ));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(listen_err(path.display().to_string())(e)),
    }
    let nonce = getrandom::u64()
        .map_err(|e| listen_err(dir.display().to_string())(std::io::Error::other(e)))?;
    let private = dir.join(format!(".lockstep-bind-{nonce:016x}"));
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&private)
        .map_err(listen_err(private.display().to_string()))?;
    let bound = (|| {
        let temp = private.join("api.sock");
        let listener = UnixListener::bind(&temp)?;
        std::fs::set_permissions(&temp, std::fs::Permissions::from_mode(0o600))?;
        std::fs::rename(&temp, path)?;
        let ino = std::fs::symlink_metadata(path)?.ino();
        Ok((listener, ino))
    })();
    let _ = std::fs::remove_dir_all(&private);
    let (listener, ino) = bound.map_err(listen_err(path.display().to_string()))?;
    Ok((
        listener,
        SocketFile {
            path: path.to_path_buf(),
            ino,
        },
    ))
}

/// How the API serves connections.
#[derive(Clone, Copy, Debug)]
struct Limits {
    /// Connections served at once.
    max_connections: usize,
    /// Time allowed for a request's headers, and idle between requests.
    header_timeout: std::time::Duration,
}

impl Limits {
    fn new(config: &Config) -> Self {
        let max_connections = match config.api_max_connections {
            0 => {
                let mut limit = libc::rlimit {
                    rlim_cur: 0,
                    rlim_max: 0,
                };
                // SAFETY: getrlimit writes the struct it is given.
                let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0 {
                    limit.rlim_cur
                } else {
                    1024
                };
                usize::try_from(soft / 4).unwrap_or(512).clamp(16, 512)
            }
            n => n,
        };
        Self {
            max_connections,
            header_timeout: config.api_header_timeout,
        }
    }
}

/// Serves `app` on `listener` until `stop`: at most `limits.max_connections`
/// connections at once (the rest wait in the kernel's backlog, holding none
/// of the agent's descriptors), each closed when it takes longer than
/// `limits.header_timeout` to send a request's headers or stays idle that
/// long between requests (hyper re-arms the header timer for every
/// request), with request heads of at most 32 KiB, checked before hyper
/// sees them (`head`), and one request per connection. `axum::serve` has none
/// of these: 1,100 idle connections once took every descriptor of an agent
/// with a 1,024 limit, and its periodic reconcile failed.
async fn serve_limited<L>(
    mut listener: L,
    app: axum::Router,
    limits: Limits,
    mut stop: tokio::sync::watch::Receiver<bool>,
) where
    L: axum::serve::Listener,
{
    let permits = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    let mut conns = tokio::task::JoinSet::new();
    loop {
        let permit = tokio::select! {
            p = permits.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
            _ = stop.wait_for(|s| *s) => break,
        };
        let io = tokio::select! {
            (io, _) = listener.accept() => io,
            _ = stop.wait_for(|s| *s) => break,
        };
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let mut stop = stop.clone();
        conns.spawn(async move {
            let _permit = permit;
            // Our own look at the head first, so every refusal has the
            // API's JSON shape (hyper's own have no body).
            let Some(io) = head::admit(io, limits.header_timeout, crate::api::MAX_BODY).await
            else {
                return;
            };
            // One request per connection (the plugin and the CLI make one
            // each), so no later head escapes the check above.
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(limits.header_timeout)
                .keep_alive(false)
                .max_buf_size(64 * 1024)
                .serve_connection(hyper_util::rt::TokioIo::new(io), service);
            let mut conn = std::pin::pin!(conn);
            let stopping = tokio::select! {
                _ = conn.as_mut() => false,
                _ = stop.wait_for(|s| *s) => true,
            };
            if stopping {
                // Let the request in flight finish, then close.
                conn.as_mut().graceful_shutdown();
                let _ = tokio::time::timeout(std::time::Duration::from_secs(5), conn).await;
            }
        });
        while conns.try_join_next().is_some() {}
    }
    while conns.join_next().await.is_some() {}
}

/// Runs the agent until SIGTERM/SIGINT.
///
/// # Errors
/// A listener could not be bound or start-up failed.
pub async fn run(config: Config) -> Result<(), ServerError> {
    let socket = config.socket.clone();
    // Before anything writes into the state directory (the CNI install's
    // manifest): made 0700, or refused when unsafe.
    crate::store::prepare_state_dir(&config.state_dir).map_err(ServerError::State)?;
    // Refused before anything starts: a port range that meets the node's
    // own ephemeral ports would hand a local socket's port to a flow.
    let masquerade =
        crate::masquerade::Settings::resolve(&config).map_err(ServerError::Masquerade)?;
    let pin_root = config.datapath.pin_root.clone();
    let (api_listener, _socket_file) = bind_socket(&socket)?;
    // The agent's one owner (`agent::handle`): every task below reaches
    // the agent through a clone of this handle, none holds it.
    let metrics = Arc::new(Metrics::new());
    // The gauges are refreshed on the owner as each batch leaves the agent:
    // a scrape never waits for it.
    let refresh = {
        let m = metrics.clone();
        Box::new(move |a: &Agent| m.refresh_state(a)) as crate::agent::AfterBatch
    };
    let (slot, owner) = AgentHandle::spawn_with(Some(refresh)).map_err(ServerError::Start)?;
    let state = AppState {
        agent: slot.clone(),
        held: Arc::new(Mutex::new(None)),
        metrics,
        cluster: Arc::new(std::sync::OnceLock::new()),
        lb_cluster: Arc::new(std::sync::OnceLock::new()),
        pod_pools: Arc::new(std::sync::OnceLock::new()),
        bgp: Arc::new(std::sync::OnceLock::new()),
        leaks: Arc::new(std::sync::OnceLock::new()),
    };
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let limits = Limits::new(&config);
    tracing::info!(
        max_connections = limits.max_connections,
        header_timeout = ?limits.header_timeout,
        "API connection limits"
    );
    let api = tokio::spawn(serve_limited(
        api_listener,
        router(state.clone()),
        limits,
        stop_rx.clone(),
    ));
    let metrics_task = match config.metrics_addr {
        Some(addr) => {
            let listener = TcpListener::bind(addr)
                .await
                .map_err(listen_err(addr.to_string()))?;
            tracing::info!(%addr, "metrics listening");
            // Bounded like the API socket, with a budget of its own, so a
            // scraper (or anyone who can reach the port) holding idle
            // connections can take neither the agent's descriptors nor
            // the API's connections (#27 item 9).
            Some(tokio::spawn(serve_limited(
                listener,
                metrics_router(state.clone()),
                limits,
                stop_rx.clone(),
            )))
        }
        None => None,
    };
    tracing::info!(socket = %socket.display(), "API listening; restoring");

    let interval = config.reconcile_interval;
    // The plugin goes in only after the API socket exists, so the first ADD
    // a runtime sends finds the agent (answering "try again" while restoring).
    if config.cni.install {
        crate::install::install(&config.cni, &config.socket, &config.state_dir)
            .map_err(ServerError::Install)?;
    } else {
        let (removed, _) = crate::install::uninstall(&config.cni, &config.state_dir)
            .map_err(ServerError::Install)?;
        for path in removed {
            tracing::info!(path = %path.display(), "removed a CNI file this agent had installed");
        }
    }
    let mut cluster_config = config.clone();
    // What the API said of this Node's podCIDRs (`None`: it did not answer).
    let mut node_pod_cidrs: Option<Vec<String>> = None;
    // Kubernetes: a client, and this node's Node (labels for pools' node
    // selectors, InternalIPs as cluster node addresses) before cluster mode
    // starts. An API that does not answer delays the start by at most
    // `node_wait`; the config's values are used then.
    let kube = match &config.kubernetes {
        Some(k) => match crate::kubernetes::client(k).await {
            Ok(client) => {
                let (node, source) = config.kubernetes_node_name_and_source();
                match crate::kubernetes::node_facts(
                    &client,
                    &node,
                    &source.to_string(),
                    k.node_wait,
                )
                .await
                {
                    Ok(facts) => {
                        tracing::info!(node = %node, %source, labels = facts.labels.len(), "kubernetes: node read");
                        crate::kubernetes::apply_node_facts(&mut cluster_config, &facts);
                        node_pod_cidrs = Some(facts.pod_cidrs);
                    }
                    // The API answers that there is no such Node: the
                    // name is wrong, and everything keyed by it would be
                    // another node's (#44 item 6).
                    Err(e @ crate::kubernetes::KubeError::NoNode { .. }) => {
                        return Err(ServerError::Kubernetes(e));
                    }
                    Err(e) => {
                        tracing::warn!(node = %node, %source, error = %crate::error_chain(&e), "kubernetes: node not read; using the config's labels and addresses");
                    }
                }
                // The pods of this node and every namespace, watched from
                // now on, so the cache has listed by the time ADDs come.
                let informer = Arc::new(crate::kubernetes::pods::Informer::start(&client, &node));
                let _ = state.pod_pools.set(crate::api::PodPools {
                    view: informer.clone(),
                    wait: k.pods.pool_wait,
                });
                Some(kube::KubeStart {
                    client,
                    classes: crate::kubernetes::Classes {
                        class: k.lb_class.clone(),
                        classless: k.serve_classless,
                    },
                    node,
                    informer,
                    pods: k.pods.clone(),
                    pod_pools: k.pod_pools,
                    remove_deleted_nodes: k.remove_deleted_nodes,
                })
            }
            Err(e) => return Err(ServerError::Kubernetes(e)),
        },
        None => None,
    };
    // `[kubernetes] pod_cidr_pool`: the Node's podCIDRs (or the record of
    // an earlier start) as an endpoint pool, before the store restores
    // into it. Nothing to serve stops the start, naming why: never a
    // default pool that would repeat on every node.
    if let Some(name) = config
        .kubernetes
        .as_ref()
        .and_then(|k| k.pod_cidr_pool.clone())
    {
        // Recorded here; the allocator starts from the record and the
        // follower keeps it (`kubernetes::pod_cidrs`).
        crate::kubernetes::pod_cidrs::start_pool(
            &config.state_dir,
            &config.kubernetes_node_name(),
            &name,
            node_pod_cidrs.as_deref(),
        )
        .map_err(|e| {
            ServerError::Start(AgentError::Invalid {
                reason: crate::error_chain(&e),
            })
        })?;
    }
    let started = tokio::task::spawn_blocking(move || {
        let inputs = start::inputs(&config)?;
        Agent::start(config, inputs)
    })
    .await
    .map_err(ServerError::Join)?;
    let agent = match started {
        Ok(agent) => agent,
        // A store that cannot be opened will not open on the next try
        // either: stay up, not ready, saying why, instead of a crash loop.
        // The pinned datapath keeps serving running endpoints meanwhile.
        Err(AgentError::Store(e)) if e.needs_operator() => {
            let e = AgentError::Store(e);
            let reason = crate::error_chain(&e);
            tracing::error!(error = %reason, "the store cannot be opened; not ready until an operator acts (docs/store.md, \"Recovery\"); the maps are left as they are");
            *state.held.lock().unwrap_or_else(|p| p.into_inner()) = Some(reason);
            let mut term = signal(SignalKind::terminate()).map_err(listen_err("SIGTERM"))?;
            let mut int = signal(SignalKind::interrupt()).map_err(listen_err("SIGINT"))?;
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            let _ = stop_tx.send(true);
            let _ = api.await;
            if let Some(m) = metrics_task {
                let _ = m.await;
            }
            return Err(ServerError::Start(e));
        }
        Err(e) => return Err(ServerError::Start(e)),
    };
    let mut agent = agent;
    let events = match agent.event_log() {
        Ok(log) => Some(tokio::spawn(drain_events(log, stop_rx.clone()))),
        Err(e) => {
            tracing::warn!(error = %crate::error_chain(&e), "datapath events will not be logged");
            None
        }
    };
    let pending = !agent.status().ready;
    // Every task from here on is watched: a panic in any of them is named
    // and restarts it or stops the agent (`supervisor`).
    let mut tasks = supervisor::Supervisor::new(stop_rx.clone(), state.metrics.clone());
    // Cluster mode: one connection to etcd and one watch-fed mirror of
    // everything under the prefix, shared by the claim loop, the remote
    // state and the LB agent (#27 item 6: steady state follows a watch,
    // no periodic reads).
    let link = cluster_config
        .cluster
        .as_ref()
        .map(|c| crate::cluster::Link::new(&c.prefix));
    let mirror_task = match (&link, &cluster_config.cluster) {
        (Some(l), Some(c)) => {
            let mut opts = crate::cluster::DoorOptions::from_cluster_config(
                c,
                std::time::Duration::from_millis(600),
            );
            opts.link = Some(l.clone());
            // Its copy in the state directory: a restart resumes the
            // watch from it instead of reading the whole prefix (#47).
            Some(l.mirror().clone().spawn_saving(
                opts,
                stop_rx.clone(),
                Some(cluster_config.state_dir.clone()),
            ))
        }
        _ => None,
    };
    // Cluster mode: blocks etcd no longer gives this node are fenced before
    // the agent serves (or once etcd answers, when it is down now).
    let cluster = match &cluster_config.cluster {
        Some(_) => {
            match crate::cluster::ClusterNode::start(&cluster_config, &mut agent, link.clone())
                .await
            {
                Ok(node) => Some(node),
                Err(reason) => {
                    // The agent owns a runtime (netlink): dropped here, on an
                    // async worker, it panicked and the reason was never
                    // printed.
                    let _ = tokio::task::spawn_blocking(move || drop(agent)).await;
                    return Err(ServerError::Start(AgentError::Invalid { reason }));
                }
            }
        }
        None => None,
    };
    if let Some(node) = &cluster {
        let _ = state.cluster.set(node.handle());
        // A full read of the mirror finding etcd gone back in time tells
        // the claim loop (#26 item 3).
        if let Some(l) = &link {
            l.mirror().tell_rollbacks_to(node.handle());
        }
    }
    // Cluster mode: LoadBalancer pools and services in etcd, the elected
    // assigner and this node's announcements (`cluster::lb_agent`).
    let lb_agent = crate::cluster::LbAgent::from_config(&cluster_config, link.clone());
    if let Some(lb) = &lb_agent {
        let _ = state.lb_cluster.set(lb.handle());
    }
    // Cluster mode: the other nodes' blocks (routes, IPCACHE) and the
    // skip-masquerade cluster CIDRs, followed from etcd (`cluster::remote`).
    // Its watch tells the claim loop when etcd went back in time.
    let remote = crate::cluster::RemoteTask::from_config(&cluster_config, interval, link.clone());
    let remote = remote.map(|r| r.with_routing(agent.routing()));
    if let Some(r) = &remote {
        agent.set_remote_view(Arc::new(r.view()));
    }
    // Full DELs hand their veths to the reaper (`agent::reaper`): its
    // queue is in place before any request can reach the agent, so a DEL
    // never deletes a veth inline on an async worker.
    let reaper = crate::agent::reaper::prepare(&mut agent);
    // The announcement maps have a lock of their own: the renewer and the
    // LB agent write them without waiting for the agent's.
    let announcements = agent.announcements();
    let lb_agent = lb_agent.map(|lb| lb.with_uplink(agent.uplink_probe()));
    slot.install(agent).await.map_err(ServerError::Start)?;
    let cluster_task = cluster.map(|node| node.spawn(cluster_door::slot(&slot), stop_rx.clone()));
    let lb_task = lb_agent.map(|lb| {
        lb.spawn(
            cluster_door::slot(&slot),
            Some(announcements.clone()),
            stop_rx.clone(),
        )
    });
    let remote_task = remote.map(|r| r.spawn(cluster_door::slot(&slot), stop_rx.clone()));
    // Kubernetes: Services and pools into the LB state, statuses back
    // (`kubernetes`), through etcd's assigner in cluster mode.
    // NodeIPAM (#29 item 5): this node's CIDRs from its NodeIPAM object,
    // its demand written back (`kubernetes::nodeipam`).
    let nodeipam_task = match (
        &kube,
        cluster_config
            .kubernetes
            .as_ref()
            .and_then(|k| k.nodeipam.as_ref()),
    ) {
        (Some(kube::KubeStart { client, node, .. }), Some(n)) => {
            let api =
                crate::kubernetes::nodeipam::KubeNodeIpam::start(client.clone(), node.clone());
            match crate::kubernetes::nodeipam::NodeIpamSync::new(
                api,
                slot.clone(),
                n.core_pools(),
                cluster_config.state_dir.clone(),
                n.interval,
            ) {
                Ok(sync) => Some(tokio::spawn(sync.run(stop_rx.clone()))),
                Err(e) => {
                    return Err(ServerError::Start(AgentError::Invalid {
                        reason: crate::error_chain(&e),
                    }));
                }
            }
        }
        _ => None,
    };
    // `[kubernetes] pod_cidr_pool`: the Node's podCIDRs followed live.
    let pod_cidrs_task = match (
        &kube,
        cluster_config
            .kubernetes
            .as_ref()
            .and_then(|k| k.pod_cidr_pool.clone()),
    ) {
        (Some(kube::KubeStart { client, node, .. }), Some(pool)) => {
            let follower = crate::kubernetes::pod_cidrs::Follower::new(
                slot.clone(),
                cluster_config.state_dir.clone(),
                node.clone(),
                pool,
            )
            .map_err(|e| {
                ServerError::Start(AgentError::Invalid {
                    reason: crate::error_chain(&e),
                })
            })?;
            Some(tokio::spawn(follower.run(client.clone(), stop_rx.clone())))
        }
        _ => None,
    };
    // `[bgp]` under Kubernetes: the BGPPeer objects and this Node's
    // overrides.
    let (bgp_kube, bgp_peers_task) = bgp::follow_peers(kube.as_ref(), &cluster_config, &stop_rx);
    let (kube_task, bgp_decided) = kube.map_or((None, None), |k| {
        let (task, decided) = kube::start(
            k,
            &state,
            &cluster_config,
            &slot,
            &announcements,
            &mut tasks,
            stop_rx.clone(),
        );
        (Some(task), decided)
    });
    // The maps exist now; the collector runs beside the agent, not in it.
    let _masquerade = match masquerade {
        Some(settings) => {
            // Netlink blocks on a runtime of its own: not on this one.
            let m =
                tokio::task::spawn_blocking(move || crate::masquerade::start(settings, &pin_root))
                    .await
                    .map_err(ServerError::Join)?
                    .map_err(ServerError::Masquerade)?;
            state.metrics.set_masquerade(m.stats.clone());
            Some(m)
        }
        // Off now, but a previous run may have left MASQ_CONFIG on.
        None => {
            tokio::task::spawn_blocking(move || crate::masquerade::turn_off(&pin_root))
                .await
                .map_err(ServerError::Join)?
                .map_err(ServerError::Masquerade)?;
            None
        }
    };
    let reaper = crate::agent::reaper::start(reaper, &slot).map_err(ServerError::Start)?;
    // Delegated mode waits for its conflist and plugin without exiting:
    // status says why; set-up is retried every 200 ms until it succeeds, or
    // it refuses for good (then the agent stops with that error).
    let (fatal_tx, mut fatal_rx) = tokio::sync::mpsc::channel::<AgentError>(1);
    let setup = pending.then(|| loops::setup(slot.clone(), fatal_tx, stop_rx.clone()));
    // Kept: a restarted reconciler beats the same heartbeat. `/healthz`
    // fails when passes stop finishing (the agent's owner stuck in a
    // command, a syscall that does not return).
    let beat = state.metrics.heartbeats.register("reconcile", interval);
    let (s, stop) = (slot.clone(), stop_rx.clone());
    tasks.keep("reconciler", move || {
        loops::reconciler(s.clone(), interval, beat.clone(), stop.clone())
    });
    // BGP: what this node announces, kept in BIRD's configuration.
    bgp::start(
        &cluster_config,
        &state,
        &slot,
        bgp_decided,
        bgp_kube,
        &mut tasks,
        &stop_rx,
    );
    let stop = stop_rx.clone();
    tasks.keep("announcement renewer", move || {
        crate::announce::spawn_renewer(announcements.clone(), stop.clone())
    });
    let beat = crate::metrics::refresher_heartbeat(&state.metrics);
    let (m, s, stop) = (state.metrics.clone(), slot.clone(), stop_rx.clone());
    tasks.keep("metrics refresher", move || {
        crate::metrics::spawn_refresher(m.clone(), s.clone(), beat.clone(), stop.clone())
    });

    tasks.watch("api", api);
    let optional = [
        ("metrics server", metrics_task),
        ("remote state", remote_task),
        ("bgp peers", bgp_peers_task),
        ("cluster node", cluster_task),
        ("lb agent", lb_task),
        ("kubernetes", kube_task),
        ("nodeipam", nodeipam_task),
        ("pod cidrs", pod_cidrs_task),
        ("etcd mirror", mirror_task),
        ("datapath events", events),
        ("set-up", setup),
    ];
    for (name, task) in optional {
        if let Some(t) = task {
            tasks.watch(name, t);
        }
    }
    let mut term = signal(SignalKind::terminate()).map_err(listen_err("SIGTERM"))?;
    let mut int = signal(SignalKind::interrupt()).map_err(listen_err("SIGINT"))?;
    let mut fatal = None;
    let mut panicked = None;
    let owner_ended = owner.ended();
    tokio::pin!(owner_ended);
    let mut owner_done = None;
    // The reaper ends only with the agent: before, it panicked, and DELs
    // would wait for veths nobody deletes.
    let reaper_ended = reaper.ended();
    tokio::pin!(reaper_ended);
    let mut reaper_done = None;
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = int.recv() => tracing::info!("SIGINT: shutting down"),
        Some(e) = fatal_rx.recv() => fatal = Some(e),
        p = tasks.panicked() => {
            tracing::error!(error = %p, "a task panicked; stopping the agent");
            panicked = Some(p);
        }
        // Only a panicking command ends the owner before the stop.
        ended = &mut owner_ended => {
            panicked = Some(thread_ended("agent owner", ended));
            owner_done = Some(());
        }
        ended = &mut reaper_ended => {
            panicked = Some(thread_ended("reaper", ended));
            reaper_done = Some(());
        }
    }
    let _ = stop_tx.send(true);
    let late = tasks.stop().await;
    let panicked = panicked.or_else(|| late.into_iter().next());
    // Every task is stopped: the owner runs what is queued, then drops the
    // agent on its own thread (the store closed cleanly; pins stay).
    slot.stop().await;
    if owner_done.is_none()
        && let Err(message) = owner_ended.await
    {
        tracing::error!(%message, "the agent's owner panicked while stopping");
    }
    // The agent dropped, the reaper stops.
    if reaper_done.is_none()
        && let Err(message) = reaper_ended.await
    {
        tracing::error!(%message, "the reaper panicked while stopping");
    }
    if let Some(e) = fatal {
        return Err(ServerError::Start(e));
    }
    if let Some(p) = panicked {
        return Err(ServerError::Panicked(p));
    }
    tracing::info!("stopped; maps and programs stay pinned");
    Ok(())
}

/// One of the agent's threads ended before the stop: logged, and reported
/// as the panic that stops the agent.
fn thread_ended(task: &str, ended: Result<(), String>) -> supervisor::Panicked {
    let p = supervisor::Panicked {
        task: task.into(),
        message: ended.err().unwrap_or_else(|| "ended".into()),
    };
    tracing::error!(error = %p, "an agent thread ended; stopping the agent");
    p
}

/// Writes the datapath's events to the log as they arrive, until stopped.
async fn drain_events(
    log: crate::datapath::events::EventLog,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    // SAFETY: the descriptor is the ring map's, owned by `log`, which the
    // AsyncFd owns until it is dropped; it stays open and the same for that
    // whole time.
    let registered = unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(log, tokio::io::Interest::READABLE)
    };
    let mut ring = match registered {
        Ok(ring) => ring,
        Err(e) => {
            tracing::warn!(error = %e, "datapath events will not be logged");
            return;
        }
    };
    loop {
        tokio::select! {
            ready = ring.readable_mut() => match ready {
                Ok(mut guard) => {
                    guard.get_inner_mut().drain();
                    guard.clear_ready();
                }
                Err(e) => {
                    tracing::warn!(error = %e, "datapath events: the ring failed; no more events");
                    return;
                }
            },
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}
