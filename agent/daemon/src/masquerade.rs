//! Masquerade, the agent's part: which address and ports translated flows
//! leave with (MASQ_CONFIG), and the collector that ends idle translations.
//!
//! Why a module of its own, beside the agent rather than inside it: the
//! programs translate on their own; the agent only configures them once and
//! collects ended flows on a timer. That needs none of the agent's state or
//! lock, so it runs on its own thread with its own map handles, and the
//! agent's ADD path never waits for it. The decisions (a valid range, a
//! range clear of the node's ephemeral ports, when a flow is over) are the
//! core's (`lockstep_core::masquerade`). docs/masquerade.md has the design
//! and the timeouts.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use lockstep_common::{Counter, MasqConfig, masq_flags};
use lockstep_core::masquerade::{
    MasqError, PortRange, Timeouts, check_disjoint, endpoint_max, evictable, expired, reply_range,
    under_pressure,
};

use crate::config::Config;
use crate::datapath::{DatapathError, PinnedMaps};
use crate::netlink::{Netlink, NetlinkError};

/// Where the node's ephemeral range is read.
const EPHEMERAL: &str = "/proc/sys/net/ipv4/ip_local_port_range";

/// Errors of masquerade set-up.
#[derive(Debug, thiserror::Error)]
pub enum MasqueradeError {
    /// The settings break a rule (range, overlap).
    #[error(transparent)]
    Settings(#[from] MasqError),
    /// The node's ephemeral range could not be read.
    #[error("cannot read {path}")]
    Sysctl {
        /// The sysctl file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The uplink or its addresses could not be read.
    #[error("masquerade: uplink {uplink}: {source}")]
    Uplink {
        /// The uplink's name.
        uplink: String,
        /// Why.
        #[source]
        source: NetlinkError,
    },
    /// The uplink is gone.
    #[error("masquerade: uplink {0} (datapath.uplink) does not exist")]
    NoUplink(String),
    /// MASQ_CONFIG could not be written or the maps opened.
    #[error(transparent)]
    Datapath(#[from] DatapathError),
}

/// Validated settings, before any address is known.
#[derive(Debug, Clone)]
pub struct Settings {
    uplink: String,
    ports: PortRange,
    timeouts: Timeouts,
    gc_interval: Duration,
    endpoint_share: f64,
    address_v4: Option<Ipv4Addr>,
    address_v6: Option<Ipv6Addr>,
}

fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Settings {
    /// The settings of `config`, or `None` when masquerade is off or there
    /// is no uplink. The port range is checked against the node's
    /// ephemeral range, read here.
    ///
    /// # Errors
    /// A bad or overlapping range, or the sysctl unreadable.
    pub fn resolve(config: &Config) -> Result<Option<Settings>, MasqueradeError> {
        let m = &config.masquerade;
        let Some(uplink) = config.datapath.uplink.clone() else {
            return Ok(None);
        };
        if !m.enabled {
            return Ok(None);
        }
        let ports: PortRange = m.ports.parse()?;
        let text =
            std::fs::read_to_string(EPHEMERAL).map_err(|source| MasqueradeError::Sysctl {
                path: PathBuf::from(EPHEMERAL),
                source,
            })?;
        let ephemeral = PortRange::from_sysctl(&text).ok_or_else(|| MasqueradeError::Sysctl {
            path: PathBuf::from(EPHEMERAL),
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, text.trim().to_string()),
        })?;
        check_disjoint(ports, ephemeral)?;
        Ok(Some(Settings {
            uplink,
            ports,
            timeouts: Timeouts {
                tcp_ns: ns(m.tcp_timeout),
                tcp_closing_ns: ns(m.tcp_closing_timeout),
                udp_ns: ns(m.udp_timeout),
                icmp_ns: ns(m.icmp_timeout),
                unreplied_ns: ns(m.unreplied_timeout),
            },
            gc_interval: m.gc_interval,
            endpoint_share: m.endpoint_share,
            address_v4: m.address_v4,
            address_v6: m.address_v6,
        }))
    }
}

/// What the collector has seen, for the metrics.
#[derive(Debug, Default)]
pub struct Stats {
    /// Translations (forward entries), IPv4, at the last collection.
    pub entries_v4: AtomicU64,
    /// Translations, IPv6.
    pub entries_v6: AtomicU64,
    /// Entries the collector deleted since start.
    pub gc_deleted: AtomicU64,
    /// Packets translated (COUNTERS, summed over CPUs).
    pub translated: AtomicU64,
    /// New flows dropped for want of a free port (COUNTERS).
    pub exhausted: AtomicU64,
    /// New flows dropped for want of room in a NAT map (COUNTERS).
    pub table_full: AtomicU64,
    /// New flows dropped: their endpoint held its share (COUNTERS).
    pub endpoint_limit: AtomicU64,
    /// Endpoint packets dropped as untranslatable (COUNTERS).
    pub untranslatable: AtomicU64,
    /// Translations the collector ended early under pressure.
    pub evicted: AtomicU64,
}

/// The running collector; dropping it stops the thread.
#[derive(Debug)]
pub struct Masquerade {
    /// Counters for the metrics.
    pub stats: Arc<Stats>,
    /// The addresses translated to.
    pub addresses: (Option<Ipv4Addr>, Option<Ipv6Addr>),
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Masquerade {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The uplink's first global address of each family.
fn uplink_addresses(uplink: &str) -> Result<(Option<Ipv4Addr>, Option<Ipv6Addr>), MasqueradeError> {
    let nl = |source| MasqueradeError::Uplink {
        uplink: uplink.to_string(),
        source,
    };
    let netlink = Netlink::current().map_err(nl)?;
    let link = netlink
        .link(uplink)
        .map_err(nl)?
        .ok_or_else(|| MasqueradeError::NoUplink(uplink.to_string()))?;
    let mut v4 = None;
    let mut v6 = None;
    for net in netlink.addresses(link.index).map_err(nl)? {
        match net.addr() {
            IpAddr::V4(a) if v4.is_none() && !a.is_loopback() && !a.is_link_local() => {
                v4 = Some(a);
            }
            IpAddr::V6(a) if v6.is_none() && !a.is_loopback() && !a.is_unicast_link_local() => {
                v6 = Some(a);
            }
            _ => {}
        }
    }
    Ok((v4, v6))
}

fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write; CLOCK_MONOTONIC is the
    // clock bpf_ktime_get_ns reads.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap_or(0)
}

/// Writes MASQ_CONFIG for `settings` and starts the collector.
///
/// # Errors
/// The uplink or its addresses unreadable, or the maps refused.
pub fn start(settings: Settings, pin_root: &Path) -> Result<Masquerade, MasqueradeError> {
    let (up4, up6) = uplink_addresses(&settings.uplink)?;
    let v4 = settings.address_v4.or(up4);
    let v6 = settings.address_v6.or(up6);
    let mut flags = 0;
    if v4.is_some() {
        flags |= masq_flags::ENABLED_V4;
    }
    if v6.is_some() {
        flags |= masq_flags::ENABLED_V6;
    }
    for (family, a) in [
        ("IPv4", v4.map(IpAddr::from)),
        ("IPv6", v6.map(IpAddr::from)),
    ] {
        match a {
            Some(a) => {
                tracing::info!(family, address = %a, ports = %settings.ports, "masquerading endpoint traffic")
            }
            None => {
                tracing::warn!(family, uplink = %settings.uplink, "no address to masquerade to: not translated")
            }
        }
    }
    let mut maps = PinnedMaps::open(pin_root)?;
    // Translations a previous run left (pinned maps outlive the agent) may
    // hold ports of an earlier range: their replies are still looked up
    // until they end (the collector narrows the reply range then).
    let live = maps.collect_nat(|_, _, _| false)?.reply_ports;
    let reply = reply_range(settings.ports, live);
    let capacity = maps.nat_capacity();
    let per_endpoint = endpoint_max(capacity, settings.endpoint_share);
    tracing::info!(
        capacity,
        per_endpoint,
        "masquerade: each endpoint address may hold this many translations per family"
    );
    if reply != settings.ports {
        tracing::info!(
            ports = %settings.ports,
            replies = %reply,
            "established translations hold ports outside the range: their replies are still reverse-translated until they end"
        );
    }
    let config = MasqConfig {
        node_v4: v4.map_or([0; 4], |a| a.octets()),
        node_v6: v6.map_or([0; 16], |a| a.octets()),
        port_min: settings.ports.low,
        port_max: settings.ports.high,
        flags,
        reply_min: reply.low,
        reply_max: reply.high,
        endpoint_max: per_endpoint,
        _pad: 0,
    };
    maps.set_masq_config(config)?;
    let stats = Arc::new(Stats::default());
    let stop = Arc::new(AtomicBool::new(false));
    let thread = {
        let (stats, stop) = (stats.clone(), stop.clone());
        std::thread::Builder::new()
            .name("masq-gc".into())
            .spawn(move || collect_loop(&mut maps, config, capacity, &settings, &stats, &stop))
            .map_err(|e| MasqueradeError::Sysctl {
                path: PathBuf::from("masq-gc thread"),
                source: e,
            })?
    };
    Ok(Masquerade {
        stats,
        addresses: (v4, v6),
        stop,
        thread: Some(thread),
    })
}

/// Turns translation off when the configuration leaves masquerade off
/// (`enabled = false`, or no `datapath.uplink`): MASQ_CONFIG is pinned and
/// outlives the agent, so a configuration that only stops writing it would
/// leave the programs translating with the last one — and with no collector
/// to end the flows. MASQ_CONFIG gets no enabled family (the programs then
/// neither translate nor reverse-translate, established flows included),
/// and every translation left in the NAT maps is deleted: nothing would
/// ever end it, and a later `enabled = true` must not find ports claimed by
/// flows that are long gone. Returns how many entries were deleted.
///
/// # Errors
/// The maps could not be opened or written.
pub fn turn_off(pin_root: &Path) -> Result<u64, MasqueradeError> {
    let mut maps = PinnedMaps::open(pin_root)?;
    maps.set_masq_config(MasqConfig::default())?;
    let sweep = maps.collect_nat(|_, _, _| true)?;
    maps.clear_endpoint_counts()?;
    if sweep.deleted > 0 {
        tracing::info!(
            deleted = sweep.deleted,
            "masquerade is off: translation stopped, translations deleted"
        );
    }
    Ok(sweep.deleted)
}

/// Rewrites MASQ_CONFIG's reply range when the live translations no
/// longer need what it holds (an earlier range's flows have ended). A
/// program reading the value mid-write sees fields of the old and the new
/// value; both reply ranges hold the configured one and every live port, so
/// any mix of them does too.
fn narrow_replies(
    maps: &mut PinnedMaps,
    config: &mut MasqConfig,
    ports: PortRange,
    live: Option<(u16, u16)>,
) {
    let reply = reply_range(ports, live);
    if (reply.low, reply.high) == (config.reply_min, config.reply_max) {
        return;
    }
    let next = MasqConfig {
        reply_min: reply.low,
        reply_max: reply.high,
        ..*config
    };
    match maps.set_masq_config(next) {
        Ok(()) => {
            tracing::info!(replies = %reply, "masquerade reply range follows the live translations");
            *config = next;
        }
        Err(e) => tracing::error!(error = %e, "cannot narrow the masquerade reply range"),
    }
}

/// How often the collector checks the table's fill between collections.
const PRESSURE_CHECK: Duration = Duration::from_millis(250);

/// Whether either family's table is nearly full, judged from the
/// endpoint counts (no walk of the NAT maps).
fn pressed(maps: &PinnedMaps, capacity: u32) -> bool {
    let (mut v4, mut v6) = (0, 0);
    for (addr, n) in maps.endpoint_translations() {
        if addr.is_ipv4() {
            v4 += n;
        } else {
            v6 += n;
        }
    }
    under_pressure(v4, capacity) || under_pressure(v6, capacity)
}

fn collect_loop(
    maps: &mut PinnedMaps,
    mut config: MasqConfig,
    capacity: u32,
    s: &Settings,
    stats: &Stats,
    stop: &AtomicBool,
) {
    let step = Duration::from_millis(50).min(s.gc_interval);
    let mut waited = Duration::ZERO;
    let mut since_check = Duration::ZERO;
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(step);
        waited += step;
        since_check += step;
        // Under pressure a collection runs at once, and ends flows nobody
        // answered and closing ones early, before new flows are refused.
        let pressure = if since_check >= PRESSURE_CHECK {
            since_check = Duration::ZERO;
            pressed(maps, capacity)
        } else {
            false
        };
        if waited < s.gc_interval && !pressure {
            continue;
        }
        waited = Duration::ZERO;
        let now = now_ns();
        let evicted = std::cell::Cell::new(0u64);
        let ended = |proto, state, seen| {
            if expired(proto, state, seen, now, &s.timeouts) {
                return true;
            }
            let early = pressure && evictable(proto, state, seen, now);
            if early {
                evicted.set(evicted.get() + 1);
            }
            early
        };
        match maps.collect_nat(ended) {
            Ok(sweep) => {
                stats.entries_v4.store(sweep.v4, Ordering::Relaxed);
                stats.entries_v6.store(sweep.v6, Ordering::Relaxed);
                stats.gc_deleted.fetch_add(sweep.deleted, Ordering::Relaxed);
                stats.evicted.fetch_add(evicted.get(), Ordering::Relaxed);
                if evicted.get() > 0 {
                    tracing::warn!(
                        evicted = evicted.get(),
                        "masquerade table nearly full: unanswered and closing translations ended early"
                    );
                }
                narrow_replies(maps, &mut config, s.ports, sweep.reply_ports);
            }
            Err(e) => tracing::error!(error = %e, "masquerade collection failed"),
        }
        if let Ok(counters) = maps.counters() {
            for (c, n) in counters {
                let stat = match c {
                    Counter::MasqTranslated => &stats.translated,
                    Counter::MasqExhausted => &stats.exhausted,
                    Counter::MasqTableFull => &stats.table_full,
                    Counter::MasqEndpointLimit => &stats.endpoint_limit,
                    Counter::MasqUntranslatable => &stats.untranslatable,
                    _ => continue,
                };
                stat.store(n, Ordering::Relaxed);
            }
        }
    }
}
