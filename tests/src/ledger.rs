//! A ledger of acknowledged changes, for tests that crash the agent under
//! load (SIGKILL in `crash.rs`, power cuts in `power_loss.rs`).
//!
//! Client threads allocate and release through the API and record what was
//! acknowledged (a 2xx reply). A request that got no reply (reset, cut
//! connection) may or may not have taken effect: its owner is "uncertain"
//! until the next [`check`], which resolves it from what the restarted agent
//! reports. After every restart, with the clients paused, the agent must hold
//! every acknowledged allocation (same address, same generation), nothing
//! acknowledged-released, no address twice, no owner twice per pool and
//! family, and `lockstep verify` must pass.
//!
//! The machinery lives here, not in one test, so that every crash test holds
//! the agent to the same contract with the same code.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use hyper::Method;
use lockstep::client::{ClientError, call};
use serde_json::{Value, json};

use crate::AgentProc;

/// Client threads of a ledger test.
pub const CLIENTS: usize = 8;
/// Owners per client (each in both families): 8 × 48 × 2 = 768 slots, well
/// below the 1022 usable addresses of each family of a [`Pool`] of /22 and
/// /118.
pub const OWNERS: usize = 48;

/// The one pool a ledger test allocates from, as its config declares it.
#[derive(Clone, Copy, Debug)]
pub struct Pool {
    /// The pool's name.
    pub name: &'static str,
    /// The IPv4 range's base address.
    pub v4_base: Ipv4Addr,
    /// The IPv4 range's prefix length.
    pub v4_prefix: u32,
    /// The IPv6 range's base address.
    pub v6_base: Ipv6Addr,
    /// The IPv6 range's prefix length.
    pub v6_prefix: u32,
    /// Owners are named `<owner_tag>-<client>-<i>`.
    pub owner_tag: &'static str,
}

impl Pool {
    /// The agent config for this pool (a one-second reconcile).
    pub fn config(&self) -> String {
        format!(
            "reconcile_interval = \"1s\"\n[[pools]]\nname = \"{}\"\nipv4 = [\"{}/{}\"]\nipv6 = [\"{}/{}\"]\n",
            self.name, self.v4_base, self.v4_prefix, self.v6_base, self.v6_prefix
        )
    }

    /// Whether `a` is inside the pool.
    pub fn contains(&self, a: IpAddr) -> bool {
        match a {
            IpAddr::V4(v4) => {
                u32::from(v4) >> (32 - self.v4_prefix)
                    == u32::from(self.v4_base) >> (32 - self.v4_prefix)
            }
            IpAddr::V6(v6) => {
                u128::from(v6) >> (128 - self.v6_prefix)
                    == u128::from(self.v6_base) >> (128 - self.v6_prefix)
            }
        }
    }

    /// A random address of the pool in family `f` (0: IPv4, 1: IPv6).
    pub fn random_addr(&self, f: usize, rng: &mut Rng) -> IpAddr {
        if f == 0 {
            let host = rng.below(1 << (32 - self.v4_prefix)) as u32;
            IpAddr::V4(Ipv4Addr::from(u32::from(self.v4_base) | host))
        } else {
            let host = u128::from(rng.below(1 << (128 - self.v6_prefix)));
            IpAddr::V6(Ipv6Addr::from(u128::from(self.v6_base) | host))
        }
    }

    /// The owner of client `client`'s `i`-th slot.
    pub fn owner(&self, client: usize, i: usize) -> Value {
        json!({"owner": "endpoint", "container_id": format!("{}-{client}-{i}", self.owner_tag), "ifname": "eth0"})
    }
}

/// splitmix64: small, seedable, good enough to pick owners and delays.
#[derive(Debug)]
pub struct Rng(pub u64);

impl Rng {
    /// The next value.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A value in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// A seed from the clock, for tests that print it so a failure can be
/// replayed.
pub fn clock_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0x5eed)
}

/// Locks `m`, also when a panicking thread poisoned it.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Lets the main thread pause the clients (and wait until none is inside a
/// request) while it restarts and checks the agent.
#[derive(Debug, Default)]
pub struct Gate {
    state: Mutex<GateState>,
    cv: Condvar,
}

#[derive(Debug, Default)]
struct GateState {
    running: bool,
    stop: bool,
    active: usize,
}

impl Gate {
    /// Waits until clients may run; `false` once the test is over.
    pub fn enter(&self) -> bool {
        let mut s = lock(&self.state);
        while !s.running && !s.stop {
            s = self.cv.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
        if s.stop {
            return false;
        }
        s.active += 1;
        true
    }

    fn leave(&self) {
        let mut s = lock(&self.state);
        s.active -= 1;
        self.cv.notify_all();
    }

    /// Stops new requests and waits for the ones in flight.
    pub fn pause(&self) {
        let mut s = lock(&self.state);
        s.running = false;
        while s.active > 0 {
            s = self.cv.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Stops new requests without waiting for the ones in flight: before a
    /// crash, so that clients whose request it cuts short do not spin on a
    /// socket nobody listens on ([`Gate::pause`] then waits for them).
    pub fn hold(&self) {
        lock(&self.state).running = false;
    }

    /// Lets the clients run.
    pub fn resume(&self) {
        lock(&self.state).running = true;
        self.cv.notify_all();
    }

    /// Ends the test: every client leaves its loop.
    pub fn stop(&self) {
        lock(&self.state).stop = true;
        self.cv.notify_all();
    }
}

/// A client inside a request; leaves the gate on drop.
struct Active<'a>(&'a Gate);

impl Drop for Active<'_> {
    fn drop(&mut self) {
        self.0.leave();
    }
}

/// Releases the clients for good when the main thread leaves, also on error,
/// so the thread scope can join them.
#[derive(Debug)]
pub struct StopOnDrop<'a>(pub &'a Gate);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.stop();
    }
}

/// What a client knows about one (owner, family).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Slot {
    /// Never allocated, or released with an acknowledgement.
    Absent,
    /// Allocated with an acknowledgement.
    Held {
        /// The acknowledged address.
        address: IpAddr,
        /// The acknowledged generation.
        generation: u64,
    },
    /// An unacknowledged allocate (`from: None`, optionally of `address`) or
    /// release (of `from`): either outcome is allowed.
    Uncertain {
        /// What was held before a release, `None` for an allocate.
        from: Option<(IpAddr, u64)>,
        /// The specific address an allocate asked for.
        address: Option<IpAddr>,
    },
}

/// Counters shared by everyone.
#[derive(Debug, Default)]
pub struct Counts {
    /// Allocations answered 2xx.
    pub acked_allocations: AtomicU64,
    /// Releases answered 2xx.
    pub acked_releases: AtomicU64,
    /// Repeated allocations answered with the same address and generation.
    pub idempotent: AtomicU64,
    /// Releases with a stale generation, refused as they must be.
    pub stale_refused: AtomicU64,
    /// Specific addresses refused as taken or unusable.
    pub specific_refused: AtomicU64,
    /// Requests whose connection was refused (the agent was down).
    pub not_reached: AtomicU64,
    /// Requests the agent refused as unavailable (`503 not_ready`), which
    /// must have changed nothing: a store that cannot make a change durable
    /// refuses it, or stops the agent and refuses its whole batch.
    pub unavailable: AtomicU64,
    /// Requests without an answer.
    pub uncertain: AtomicU64,
    /// Uncertain requests that turned out to have taken effect.
    pub uncertain_took_effect: AtomicU64,
    /// The highest generation acknowledged.
    pub max_generation: AtomicU64,
}

/// Adds one to a counter.
pub fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// A counter's value.
pub fn get(c: &AtomicU64) -> u64 {
    c.load(Ordering::Relaxed)
}

/// What the clients and the main thread share.
#[derive(Debug, Default)]
pub struct Shared {
    /// The counters.
    pub counts: Counts,
    /// Contract violations seen by clients; the main thread fails on them.
    pub errors: Mutex<Vec<String>>,
}

impl Shared {
    fn error(&self, e: String) {
        lock(&self.errors).push(e);
    }
}

/// The outcome of one request, as a client can know it.
enum Outcome {
    Acked(Value),
    Refused {
        status: u16,
        code: String,
        message: String,
    },
    /// The socket refused the connection: the request never reached the agent.
    NotReached,
    /// `503 not_ready`: the agent refused it, nothing changed.
    Unavailable,
    /// No answer: it may or may not have taken effect.
    Uncertain,
}

fn request(
    shared: &Shared,
    rt: &tokio::runtime::Runtime,
    socket: &Path,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> Outcome {
    // The timer must be made inside the runtime.
    let fut = async {
        tokio::time::timeout(Duration::from_secs(10), call(socket, method, path, body)).await
    };
    match rt.block_on(fut) {
        Err(_) => {
            shared.error(format!("{path}: no answer within 10 s (the agent hangs)"));
            Outcome::Uncertain
        }
        Ok(Ok(v)) => Outcome::Acked(v),
        Ok(Err(ClientError::Api {
            status: 503, code, ..
        })) if code == "not_ready" => Outcome::Unavailable,
        Ok(Err(ClientError::Api {
            status,
            code,
            message,
        })) => Outcome::Refused {
            status,
            code,
            message,
        },
        Ok(Err(ClientError::Connect { .. })) => Outcome::NotReached,
        Ok(Err(_)) => Outcome::Uncertain,
    }
}

fn family_name(f: usize) -> &'static str {
    if f == 0 { "ipv4" } else { "ipv6" }
}

/// An allocation as the API returns it.
fn parse_allocation(v: &Value) -> anyhow::Result<(String, IpAddr, Value, u64)> {
    Ok((
        v["pool"].as_str().context("no pool")?.to_string(),
        v["address"]
            .as_str()
            .context("no address")?
            .parse()
            .context("address")?,
        v["owner"].clone(),
        v["generation"].as_u64().context("no generation")?,
    ))
}

/// One client's slots: `[ipv4, ipv6]` per owner.
pub type Model = Mutex<Vec<[Slot; 2]>>;

/// [`CLIENTS`] empty models of [`OWNERS`] owners each.
pub fn models() -> Vec<Model> {
    (0..CLIENTS)
        .map(|_| Mutex::new(vec![[Slot::Absent, Slot::Absent]; OWNERS]))
        .collect()
}

/// Allocations held in the models (after a [`check`], all certain).
pub fn held(models: &[Model]) -> usize {
    models
        .iter()
        .map(|m| {
            lock(m)
                .iter()
                .flatten()
                .filter(|s| matches!(s, Slot::Held { .. }))
                .count()
        })
        .sum()
}

/// Starts one client thread per model in `scope` ([`run_client`]), each
/// with its own seed drawn from `seed`.
pub fn spawn_clients<'scope>(
    scope: &'scope std::thread::Scope<'scope, '_>,
    pool: &'scope Pool,
    socket: &'scope Path,
    gate: &'scope Gate,
    models: &'scope [Model],
    shared: &'scope Shared,
    seed: u64,
) {
    for (id, model) in models.iter().enumerate() {
        let seed = seed ^ ((id as u64 + 1) << 32);
        scope.spawn(move || run_client(pool, id, socket, gate, model, shared, seed));
    }
}

/// A client thread's loop: one request at a time while the gate lets it,
/// recording every contract violation in `shared`.
pub fn run_client(
    pool: &Pool,
    id: usize,
    socket: &Path,
    gate: &Gate,
    model: &Model,
    shared: &Shared,
    seed: u64,
) {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            shared.error(format!("client {id}: no runtime: {e}"));
            return;
        }
    };
    let mut rng = Rng(seed);
    while gate.enter() {
        // Leave the gate also when a step panics, or the pause would wait
        // for this client forever.
        let _active = Active(gate);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            step(pool, id, socket, &rt, model, shared, &mut rng)
        }));
        let err = match result {
            Ok(Ok(())) => continue,
            Ok(Err(e)) => format!("{e:#}"),
            Err(panic) => format!(
                "panicked: {}",
                panic
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| panic.downcast_ref::<&str>().copied())
                    .unwrap_or("?")
            ),
        };
        shared.error(format!("client {id}: {err}"));
        // Do not spin while the main thread notices and fails.
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// One request: allocate an absent slot, or release / re-allocate / release
/// with a stale generation a held one. Uncertain slots wait for the check.
fn step(
    pool: &Pool,
    id: usize,
    socket: &Path,
    rt: &tokio::runtime::Runtime,
    model: &Model,
    shared: &Shared,
    rng: &mut Rng,
) -> anyhow::Result<()> {
    let c = &shared.counts;
    let i = rng.below(OWNERS as u64) as usize;
    let f = rng.below(2) as usize;
    let slot = lock(model)[i][f].clone();
    let who = pool.owner(id, i);
    let set = |s: Slot| lock(model)[i][f] = s;
    match slot {
        Slot::Uncertain { .. } => Ok(()),
        Slot::Absent => {
            let specific = (rng.below(5) == 0).then(|| pool.random_addr(f, rng));
            let mut body = json!({"pool": pool.name, "family": family_name(f), "owner": who});
            if let Some(a) = specific {
                body["address"] = json!(a.to_string());
            }
            match request(
                shared,
                rt,
                socket,
                Method::POST,
                "/v1/allocations",
                Some(body),
            ) {
                Outcome::Acked(v) => {
                    let (got_pool, address, got_owner, generation) = parse_allocation(&v)?;
                    ensure!(
                        got_pool == pool.name && got_owner == who,
                        "wrong allocation {v}"
                    );
                    ensure!(
                        (f == 0) == address.is_ipv4() && pool.contains(address),
                        "address of the wrong family or outside the pool: {v}"
                    );
                    if let Some(want) = specific {
                        ensure!(address == want, "asked for {want}, got {v}");
                    }
                    set(Slot::Held {
                        address,
                        generation,
                    });
                    bump(&c.acked_allocations);
                    c.max_generation.fetch_max(generation, Ordering::Relaxed);
                    Ok(())
                }
                Outcome::Refused { code, .. }
                    if specific.is_some()
                        && (code == "address_taken" || code == "address_unusable") =>
                {
                    bump(&c.specific_refused);
                    Ok(())
                }
                Outcome::Refused {
                    status,
                    code,
                    message,
                } => bail!("allocate for {who} refused: {status} {code}: {message}"),
                Outcome::NotReached => {
                    bump(&c.not_reached);
                    std::thread::sleep(Duration::from_millis(1));
                    Ok(())
                }
                Outcome::Unavailable => {
                    bump(&c.unavailable);
                    std::thread::sleep(Duration::from_millis(1));
                    Ok(())
                }
                Outcome::Uncertain => {
                    bump(&c.uncertain);
                    set(Slot::Uncertain {
                        from: None,
                        address: specific,
                    });
                    Ok(())
                }
            }
        }
        Slot::Held {
            address,
            generation,
        } => {
            let roll = rng.below(100);
            if roll < 65 {
                let body = json!({"pool": pool.name, "family": family_name(f), "owner": who, "generation": generation});
                match request(shared, rt, socket, Method::POST, "/v1/release", Some(body)) {
                    Outcome::Acked(v) => {
                        let (_, a, _, g) = parse_allocation(&v)?;
                        ensure!(
                            a == address && g == generation,
                            "release of {who} ({address}, {generation}) answered {v}"
                        );
                        set(Slot::Absent);
                        bump(&c.acked_releases);
                    }
                    Outcome::Refused {
                        status,
                        code,
                        message,
                    } => bail!("release of {who} refused: {status} {code}: {message}"),
                    Outcome::NotReached => bump(&c.not_reached),
                    Outcome::Unavailable => bump(&c.unavailable),
                    Outcome::Uncertain => {
                        bump(&c.uncertain);
                        set(Slot::Uncertain {
                            from: Some((address, generation)),
                            address: None,
                        });
                    }
                }
            } else if roll < 85 {
                // Asking again is idempotent: same address, same generation.
                let body = json!({"pool": pool.name, "family": family_name(f), "owner": who});
                match request(
                    shared,
                    rt,
                    socket,
                    Method::POST,
                    "/v1/allocations",
                    Some(body),
                ) {
                    Outcome::Acked(v) => {
                        let (_, a, _, g) = parse_allocation(&v)?;
                        ensure!(
                            a == address && g == generation,
                            "repeated allocate of {who} ({address}, {generation}) answered {v}"
                        );
                        bump(&c.idempotent);
                    }
                    Outcome::Refused {
                        status,
                        code,
                        message,
                    } => bail!("repeated allocate of {who} refused: {status} {code}: {message}"),
                    Outcome::NotReached => bump(&c.not_reached),
                    Outcome::Unavailable => bump(&c.unavailable),
                    // Either way the slot stays as it is.
                    Outcome::Uncertain => bump(&c.uncertain),
                }
            } else {
                // A stale generation frees nothing, acknowledged or not.
                let stale = if generation > 0 {
                    generation - 1
                } else {
                    generation + 1
                };
                let body = json!({"pool": pool.name, "family": family_name(f), "owner": who, "generation": stale});
                match request(shared, rt, socket, Method::POST, "/v1/release", Some(body)) {
                    Outcome::Refused {
                        status: 409, code, ..
                    } if code == "stale_generation" => {
                        bump(&c.stale_refused);
                    }
                    Outcome::Acked(v) => bail!("stale release of {who} freed {v}"),
                    Outcome::Refused {
                        status,
                        code,
                        message,
                    } => bail!("stale release of {who}: {status} {code}: {message}"),
                    Outcome::NotReached => bump(&c.not_reached),
                    Outcome::Unavailable => bump(&c.unavailable),
                    Outcome::Uncertain => bump(&c.uncertain),
                }
            }
            Ok(())
        }
    }
}

/// With the clients paused and the agent freshly restarted: compares what it
/// holds with what the clients know, resolves uncertain slots, and runs verify.
///
/// # Errors
/// A client saw a contract violation, the agent lost or resurrected an
/// acknowledged change, holds something no client may hold, or verify failed.
pub fn check(
    pool: &Pool,
    rt: &tokio::runtime::Runtime,
    agent: &AgentProc,
    models: &[Model],
    shared: &Shared,
    round: usize,
) -> anyhow::Result<()> {
    let errors = lock(&shared.errors).clone();
    ensure!(errors.is_empty(), "round {round}: clients saw: {errors:#?}");
    let socket = agent.socket();
    let all = rt
        .block_on(call(&socket, Method::GET, "/v1/allocations", None))
        .context("GET /v1/allocations")?;
    let all = all.as_array().context("allocations is not a list")?;
    let mut by_key: BTreeMap<(String, bool, String), (IpAddr, u64)> = BTreeMap::new();
    let mut by_addr: BTreeMap<IpAddr, String> = BTreeMap::new();
    let (mut v4, mut v6) = (0u64, 0u64);
    for a in all {
        let (got_pool, address, who, generation) = parse_allocation(a)?;
        ensure!(
            got_pool == pool.name && pool.contains(address),
            "round {round}: {a} is not of pool {}",
            pool.name
        );
        if let Some(other) = by_addr.insert(address, who.to_string()) {
            bail!("round {round}: {address} has two owners: {other} and {who}");
        }
        let key = (got_pool, address.is_ipv4(), who.to_string());
        if let Some(other) = by_key.insert(key, (address, generation)) {
            bail!(
                "round {round}: {who} holds two addresses in {}: {} and {address}",
                pool.name,
                other.0
            );
        }
        if address.is_ipv4() {
            v4 += 1;
        } else {
            v6 += 1;
        }
    }
    let pools = rt
        .block_on(call(&socket, Method::GET, "/v1/pools", None))
        .context("GET /v1/pools")?;
    ensure!(
        pools[0]["name"] == pool.name && pools[0]["v4"][0] == v4 && pools[0]["v6"][0] == v6,
        "round {round}: pool usage {pools} disagrees with {v4} v4 and {v6} v6 allocations"
    );

    for (id, model) in models.iter().enumerate() {
        let mut slots = lock(model);
        for (i, pair) in slots.iter_mut().enumerate() {
            for (f, slot) in pair.iter_mut().enumerate() {
                let who = pool.owner(id, i);
                let key = (pool.name.to_string(), f == 0, who.to_string());
                let actual = by_key.remove(&key);
                match slot {
                    Slot::Absent => ensure!(
                        actual.is_none(),
                        "round {round}: {who} ({}) was released (or never allocated) but holds {actual:?}",
                        family_name(f)
                    ),
                    Slot::Held {
                        address,
                        generation,
                    } => ensure!(
                        actual == Some((*address, *generation)),
                        "round {round}: acknowledged allocation of {who}: {address} generation {generation}; the agent has {actual:?}",
                    ),
                    Slot::Uncertain { from, address } => {
                        let allowed = match (actual, *from) {
                            (None, _) => true,
                            (Some(now), Some(before)) => now == before,
                            (Some((a, _)), None) => address.is_none_or(|want| want == a),
                        };
                        ensure!(
                            allowed,
                            "round {round}: {who} after an unacknowledged request: was {from:?} (asked {address:?}), now {actual:?}"
                        );
                        if actual != *from {
                            bump(&shared.counts.uncertain_took_effect);
                        }
                    }
                }
                *slot = match actual {
                    Some((address, generation)) => Slot::Held {
                        address,
                        generation,
                    },
                    None => Slot::Absent,
                };
            }
        }
    }
    ensure!(
        by_key.is_empty(),
        "round {round}: allocations no client holds or may hold: {by_key:?}"
    );

    let out = agent.cli(["verify"])?;
    ensure!(
        out.status.success(),
        "round {round}: verify failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let status = rt
        .block_on(call(&socket, Method::GET, "/v1/status", None))
        .context("GET /v1/status")?;
    let max = get(&shared.counts.max_generation);
    ensure!(
        status["generation"].as_u64().unwrap_or(0) >= max,
        "round {round}: generation went back to {} after a crash; {max} was handed out",
        status["generation"]
    );
    Ok(())
}

/// One line of the counters, for a test's summary.
pub fn summary(c: &Counts) -> String {
    format!(
        "acknowledged: {} allocations, {} releases, {} idempotent repeats, \
         {} stale releases refused, {} specific addresses refused; \
         {} requests not reached, {} refused as unavailable, {} uncertain ({} took effect)",
        get(&c.acked_allocations),
        get(&c.acked_releases),
        get(&c.idempotent),
        get(&c.stale_refused),
        get(&c.specific_refused),
        get(&c.not_reached),
        get(&c.unavailable),
        get(&c.uncertain),
        get(&c.uncertain_took_effect),
    )
}
