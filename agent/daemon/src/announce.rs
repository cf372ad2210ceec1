//! The LB announcements' timing and the uplink's health, in a leaf that
//! the agent, cluster mode's LB agent and the Kubernetes announcer share:
//! the clock ([`monotonic_ns`]), the announcements' lease, the announcement
//! maps behind their own lock, the uplink's health and a probe of it. It
//! imports none of them, so neither the cluster nor the Kubernetes sources
//! import the agent to announce. The maps are read and written through the
//! map table ([`crate::map_table`]), the entries the agent's reconcile
//! walks; what only the agent can do (attach the programs to an uplink
//! created again) stays with the agent.
//!
//! Announcement leases: every L2_RESP_V4 and L2_RESP_V6 entry carries an
//! expiry (`expires_ns`, kernel `CLOCK_MONOTONIC`) past which `from_native`
//! stops answering ARP and NDP for it. The agent's renewer
//! ([`spawn_renewer`]) renews all of them every third of
//! `[lb] announce_lease`; an agent that dies or hangs stops renewing, so
//! its node stops answering within one lease though the pinned programs
//! and maps live on (docs/datapath.md, "Announcement leases").
//!
//! One expiry serves all of a node's entries: the desired plan takes it from
//! here ([`Lease::expires_ns`]), so verify and reconcile compare it like any
//! other field, and a renewal is a reconcile of the announcement maps alone.
//!
//! Cluster mode (`cluster::lb_agent`) adds the addresses this node holds the
//! lease-bound etcd key of, and caps the expiry at what that etcd lease
//! guarantees ([`Announcements::set_cluster`]): the entries stop being
//! answered before etcd can give the address to another node, whatever
//! this agent does meanwhile. Without `[cluster]` under Kubernetes, the
//! elected writer's announcer (`kubernetes::announcer`) does the same with
//! the LB state's addresses and its Lease's deadline.
//!
//! The announcement maps are written under their own lock
//! ([`Announcements`]), never under the agent's: a CNI call or anything
//! else keeping the agent's owner busy cannot delay a renewal or a cluster write
//! past its expiry (#27 item 5). The agent's reconcile takes this lock
//! (after its own) to write the same maps, so every writer of them takes
//! turns here, and a cluster write older than one already applied is
//! dropped, never written over a newer one.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use lockstep_common::map_names;
use lockstep_core::plan::desired::{Uplink as AnnounceUplink, announcements};

use crate::datapath::PinnedMaps;
use crate::map_table::{MAPS, MapContents, MapTableError, ReconcileReport};

mod uplink;

pub use uplink::{UplinkHealth, UplinkProbe};

/// The kernel's `CLOCK_MONOTONIC` in nanoseconds: the clock
/// `bpf_ktime_get_ns` reads.
#[must_use]
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid pointer for the call; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The earliest expiry ever written: 1 ns after boot, long past. 0 is the
/// datapath's "never expires" ([`lockstep_common::L2RespValue::expired`]),
/// which no announcement of this agent may carry.
const EXPIRED_NS: u64 = 1;

/// The announcements' lease.
#[derive(Clone, Debug)]
pub struct Lease {
    /// How long an entry is answered without a renewal.
    lease: Duration,
    /// The expiry the entries carry (and the plan writes).
    expires_ns: u64,
    /// Whether the entries may have lapsed since they were last renewed
    /// (true at start): the next renewal announces every address again.
    lapsed: bool,
    /// Cluster mode: no expiry is written past this (kernel monotonic ns),
    /// the time up to which etcd keeps this node's announcement keys.
    cap_ns: Option<u64>,
    /// Cluster mode: the addresses this node announces (holds the keys of).
    cluster: BTreeSet<IpAddr>,
}

impl Lease {
    /// A lease of `lease`, starting now.
    #[must_use]
    pub fn new(lease: Duration) -> Self {
        Self {
            lease,
            expires_ns: monotonic_ns() + lease.as_nanos() as u64,
            lapsed: true,
            cap_ns: None,
            cluster: BTreeSet::new(),
        }
    }

    /// The expiry the announcement entries carry.
    #[must_use]
    pub fn expires_ns(&self) -> u64 {
        self.expires_ns
    }

    /// Moves the expiry to one lease from `now_ns`; returns whether the
    /// previous one had passed (or the entries were never renewed).
    fn renew(&mut self, now_ns: u64) -> bool {
        let lapsed = self.lapsed || now_ns >= self.expires_ns;
        let ahead = now_ns + self.lease.as_nanos() as u64;
        // The datapath reads an expiry of 0 as "never expires": a cap of 0
        // (cluster mode after SIGTERM or a lost etcd lease) must be written
        // as long past, never as forever.
        self.expires_ns = self
            .cap_ns
            .map_or(ahead, |cap| ahead.min(cap))
            .max(EXPIRED_NS);
        // Entries already past their cap are not answered: not renewed.
        self.lapsed = self.expires_ns <= now_ns;
        lapsed
    }
}

/// Whether `name` is one of the maps a renewal rewrites.
pub(crate) fn announcement_map(name: &str) -> bool {
    [
        map_names::L2_RESP_V4,
        map_names::L2_RESP_SLOTS,
        map_names::L2_RESP_V6,
        map_names::L2_RESP6_SLOTS,
    ]
    .contains(&name)
}

/// `into` with its announcement maps' parts taken from `from`.
pub(crate) fn with_announced(into: MapContents, from: MapContents) -> MapContents {
    MapContents {
        l2: from.l2,
        l2_v6: from.l2_v6,
        l2_slots: from.l2_slots,
        l2_v6_slots: from.l2_v6_slots,
        ..into
    }
}

/// A cluster write that failed ([`Announcements::set_cluster`]).
#[derive(Debug)]
pub struct ClusterWriteError {
    /// Why.
    pub error: Box<MapTableError>,
    /// Which of the write's (and the previous write's) addresses the maps
    /// answer for now, read back; `None`: the read back failed too.
    pub held: Option<BTreeSet<IpAddr>>,
}

/// The announcement maps and what they should hold, behind their own lock:
/// shared by the agent (reconcile, single-node LB), the renewer, cluster
/// mode's LB agent and the Kubernetes announcer. Cloning shares it.
#[derive(Clone)]
pub struct Announcements(Arc<Mutex<AnnounceState>>);

impl std::fmt::Debug for Announcements {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Announcements").finish_non_exhaustive()
    }
}

struct AnnounceState {
    lease: Lease,
    /// The sequence number of the last cluster write applied.
    cluster_seq: u64,
    /// The agent's own announced addresses (single-node LB, ingress).
    local_v4: Vec<Ipv4Addr>,
    local_v6: Vec<Ipv6Addr>,
    /// The uplink's index and MAC.
    uplink: Option<(u32, [u8; 6])>,
    /// A handle of the maps of its own.
    maps: PinnedMaps,
}

impl AnnounceState {
    /// What the announcement maps should hold now.
    fn contents(&self) -> MapContents {
        let v4: Vec<Ipv4Addr> = self
            .local_v4
            .iter()
            .copied()
            .chain(self.lease.cluster.iter().filter_map(|a| match a {
                IpAddr::V4(v) => Some(*v),
                IpAddr::V6(_) => None,
            }))
            .collect();
        let v6: Vec<Ipv6Addr> = self
            .local_v6
            .iter()
            .copied()
            .chain(self.lease.cluster.iter().filter_map(|a| match a {
                IpAddr::V6(v) => Some(*v),
                IpAddr::V4(_) => None,
            }))
            .collect();
        let uplink = self.uplink.map(|(ifindex, mac)| AnnounceUplink {
            ifindex,
            mac,
            expires_ns: self.lease.expires_ns(),
        });
        announcements(&v4, &v6, uplink)
    }

    /// Brings the announcement maps to [`AnnounceState::contents`], in the
    /// order reconcile uses (slots cleared first, filled last), counting
    /// the changes in `report`. Returns what was written.
    fn write(&self, report: &mut ReconcileReport) -> Result<MapContents, MapTableError> {
        let want = self.contents();
        let root = &self.maps;
        let mut have = MapContents::default();
        let specs: Vec<_> = MAPS.iter().filter(|m| announcement_map(m.name())).collect();
        for m in &specs {
            m.observe(root, &mut have)?;
        }
        for m in &specs {
            m.clear(root, &want, &have)?;
        }
        for m in &specs {
            m.apply(root, &want, &have, report)?;
        }
        for m in &specs {
            m.fill(root, &want, &have, report)?;
        }
        Ok(want)
    }

    /// Which of `addrs` the announcement maps answer for now: an entry in
    /// the hash or in a slot (either may answer) that has not expired. An
    /// expired one answers nobody, and is not to be renewed back to life.
    fn present(&self, addrs: &BTreeSet<IpAddr>) -> Result<BTreeSet<IpAddr>, MapTableError> {
        let mut have = MapContents::default();
        for m in MAPS.iter().filter(|m| announcement_map(m.name())) {
            m.observe(&self.maps, &mut have)?;
        }
        let now = monotonic_ns();
        let ok = |expires: u64| !lockstep_common::L2RespValue::expired(expires, now);
        let live: BTreeSet<IpAddr> = (have.l2.iter())
            .filter(|(_, v)| ok(v.expires_ns))
            .map(|(a, _)| IpAddr::from(*a))
            .chain(
                (have.l2_slots.iter())
                    .filter(|(_, v)| ok(v.expires_ns))
                    .map(|(_, v)| IpAddr::from(v.addr)),
            )
            .chain(
                (have.l2_v6.iter())
                    .filter(|(_, v)| ok(v.expires_ns))
                    .map(|(a, _)| IpAddr::from(*a)),
            )
            .chain(
                (have.l2_v6_slots.iter())
                    .filter(|(_, v)| ok(v.expires_ns))
                    .map(|(_, v)| IpAddr::from(v.addr)),
            )
            .collect();
        Ok(addrs.intersection(&live).copied().collect())
    }

    /// Announces `addr` only while the entries are answered: checked just
    /// before each frame, so an agent stopped (SIGSTOP) past its expiry,
    /// whose address another node may announce by now, does not send a
    /// stale gratuitous ARP / NA when it resumes in the middle of a list.
    fn send_live(&self, addr: IpAddr) {
        if monotonic_ns() < self.lease.expires_ns() {
            self.send(addr);
        }
    }

    /// Announces `addr` on the uplink: gratuitous ARP (IPv4) or unsolicited
    /// Neighbor Advertisement (IPv6), best effort.
    fn send(&self, addr: IpAddr) {
        let Some((index, mac)) = self.uplink else {
            return;
        };
        let sent = match addr {
            IpAddr::V4(a) => crate::arp::announce(index, mac, a),
            IpAddr::V6(a) => crate::ndp::announce(index, mac, a),
        };
        if let Err(e) = sent {
            tracing::warn!(error = %e, %addr, "announcement (gratuitous ARP / unsolicited NA) failed");
        }
    }
}

impl Announcements {
    /// Announcements of `lease` written through `maps`.
    pub(crate) fn new(lease: Duration, maps: PinnedMaps) -> Self {
        Self(Arc::new(Mutex::new(AnnounceState {
            lease: Lease::new(lease),
            cluster_seq: 0,
            local_v4: Vec::new(),
            local_v6: Vec::new(),
            uplink: None,
            maps,
        })))
    }

    fn lock(&self) -> MutexGuard<'_, AnnounceState> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The announcement maps' desired contents.
    pub(crate) fn contents(&self) -> MapContents {
        self.lock().contents()
    }

    /// What the announcement maps should hold and what they hold, both
    /// taken under the announcements' lock: the renewer rewrites every
    /// expiry every third of a lease, so the two read apart would differ
    /// whenever a renewal fell between them, and `verify` would report
    /// drift that is not there.
    ///
    /// # Errors
    /// A map could not be read.
    pub(crate) fn snapshot(&self) -> Result<(MapContents, MapContents), MapTableError> {
        let s = self.lock();
        let mut have = MapContents::default();
        for m in MAPS.iter().filter(|m| announcement_map(m.name())) {
            m.observe(&s.maps, &mut have)?;
        }
        Ok((s.contents(), have))
    }

    /// The uplink the entries name (`None`: nothing is announced).
    pub(crate) fn set_uplink(&self, uplink: Option<(u32, [u8; 6])>) {
        self.lock().uplink = uplink;
    }

    /// The interface index the programs are attached to on the uplink.
    fn uplink_index(&self) -> Option<u32> {
        self.lock().uplink.map(|(index, _)| index)
    }

    /// Reconcile's part: the agent's own addresses are `v4` and `v6`; the
    /// maps are brought to what they should hold, the changes counted in
    /// `report`.
    ///
    /// # Errors
    /// A map could not be read or written.
    pub(crate) fn reconcile(
        &self,
        v4: Vec<Ipv4Addr>,
        v6: Vec<Ipv6Addr>,
        report: &mut ReconcileReport,
    ) -> Result<(), MapTableError> {
        let mut s = self.lock();
        s.local_v4 = v4;
        s.local_v6 = v6;
        s.write(report).map(drop)
    }

    /// Renews every announcement: a new expiry, written into L2_RESP_V4,
    /// L2_RESP_V6 and their slots. When the previous expiry had passed (a
    /// hung agent resumed, or a start), every announced address is
    /// announced again (gratuitous ARP, unsolicited NA). Returns the
    /// entries written. Takes only the announcements' lock.
    ///
    /// # Errors
    /// A map could not be read or written; the next renewal tries again.
    pub fn renew(&self) -> Result<usize, MapTableError> {
        let mut s = self.lock();
        let now = monotonic_ns();
        let lapsed = s.lease.renew(now);
        // Past the cap (cluster mode, etcd lease not renewed): nothing is
        // answered, so nothing is announced either.
        let lapsed = lapsed && s.lease.expires_ns() > now;
        let want = s.write(&mut ReconcileReport::default())?;
        if lapsed {
            let addrs = want
                .l2
                .iter()
                .map(|(a, _)| IpAddr::from(*a))
                .chain(want.l2_v6.iter().map(|(a, _)| IpAddr::from(*a)));
            for addr in addrs {
                s.send_live(addr);
            }
        }
        Ok(want.l2.len() + want.l2_v6.len())
    }

    /// Cluster mode's write number `seq`: announces exactly `addrs` (this
    /// node holds their lease-bound etcd keys) with no entry answered past
    /// `valid_until_ns` (kernel monotonic ns; the etcd lease's guaranteed
    /// life). A write older than one already applied is dropped (returns
    /// false): the newer one stands, and a late write never brings back an
    /// address a newer one removed. Removals are out of the maps when this
    /// returns `Ok`. Nothing is announced here: the caller announces once
    /// it knows the entries are in (`Announcements::announce`).
    ///
    /// # Errors
    /// A map could not be read or written (a full map refuses an insert):
    /// the maps hold some mix of this write and the one before. They are
    /// read back: the error carries which of the two writes' addresses
    /// they answer for now, and only those are renewed from then on, so
    /// nothing adds an address the announcer was told is not answered
    /// ([`ClusterWriteError::held`]; `None` when the read back failed
    /// too, and the set is kept, so the next renewal writes it again).
    pub fn set_cluster(
        &self,
        seq: u64,
        addrs: BTreeSet<IpAddr>,
        valid_until_ns: u64,
    ) -> Result<bool, ClusterWriteError> {
        let mut s = self.lock();
        if seq <= s.cluster_seq {
            return Ok(false);
        }
        s.cluster_seq = seq;
        let mut either = addrs.clone();
        either.extend(s.lease.cluster.iter().copied());
        s.lease.cluster = addrs;
        s.lease.cap_ns = Some(valid_until_ns);
        s.lease.renew(monotonic_ns());
        match s.write(&mut ReconcileReport::default()) {
            Ok(_) => Ok(true),
            Err(error) => {
                let held = s.present(&either).ok();
                if let Some(h) = &held {
                    s.lease.cluster = h.clone();
                }
                Err(ClusterWriteError {
                    error: Box::new(error),
                    held,
                })
            }
        }
    }

    /// Sends a gratuitous ARP / unsolicited NA for `addr` if the entries
    /// are answered now.
    pub fn announce(&self, addr: IpAddr) {
        self.lock().send_live(addr);
    }

    /// Sends a gratuitous ARP / unsolicited NA for `addr` whether or not
    /// the entries are answered now: the agent's own (single-node LB)
    /// announcement of an address it has just programmed.
    pub(crate) fn send(&self, addr: IpAddr) {
        self.lock().send(addr);
    }

    /// The renewal period (a third of the lease).
    #[must_use]
    pub fn renew_every(&self) -> Duration {
        self.lock().lease.lease / 3
    }
}

/// Runs [`Announcements::renew`] every third of the lease, on the blocking
/// pool, until `stop` turns true. It never waits for the agent's owner, so a CNI
/// call or a metrics scrape cannot delay it (#27 item 5). Renewals that are
/// late (the process stopped) do not pile up: the next runs one period
/// after the late one.
pub fn spawn_renewer(
    announcements: Announcements,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    let every = announcements.renew_every();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.wait_for(|s| *s) => break,
            }
            let a = announcements.clone();
            let _ = tokio::task::spawn_blocking(move || {
                if let Err(e) = a.renew() {
                    tracing::error!(error = %crate::error_chain(&e), "renewing the announcements failed");
                }
            })
            .await;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_renewal_moves_the_expiry_one_lease_ahead_and_tells_if_it_had_lapsed() {
        let mut l = Lease::new(Duration::from_secs(3));
        assert!(l.expires_ns() > monotonic_ns(), "starts one lease ahead");
        assert!(l.renew(1_000), "the first renewal announces");
        assert_eq!(l.expires_ns(), 3_000_001_000);
        assert!(!l.renew(2_000_000_000), "renewed in time");
        assert_eq!(l.expires_ns(), 5_000_000_000);
        assert!(l.renew(5_000_000_000), "renewed after the expiry");
    }

    #[test]
    fn a_cap_bounds_every_renewal_and_a_passed_cap_stays_lapsed() {
        let mut l = Lease::new(Duration::from_secs(3));
        l.cap_ns = Some(2_000_000_000);
        l.renew(1_000_000_000);
        assert_eq!(l.expires_ns(), 2_000_000_000, "capped, not one lease ahead");
        assert!(!l.renew(1_500_000_000));
        assert_eq!(l.expires_ns(), 2_000_000_000);
        // Past the cap: the entries are dead, and stay so until a new cap.
        assert!(l.renew(2_500_000_000));
        assert_eq!(l.expires_ns(), 2_000_000_000, "never moved past the cap");
        assert!(
            l.renew(2_600_000_000),
            "still lapsed: announced again once live"
        );
        l.cap_ns = Some(9_000_000_000);
        assert!(l.renew(3_000_000_000), "the first live renewal announces");
        assert_eq!(l.expires_ns(), 6_000_000_000);
        assert!(!l.renew(4_000_000_000));
    }

    #[test]
    fn a_cap_of_zero_is_written_as_expired_never_as_forever() {
        // SIGTERM and a lost etcd lease set the cap to 0 (#27 item 3): the
        // entries written then must stop being answered, not answer for
        // ever once the agent is gone.
        let mut l = Lease::new(Duration::from_secs(3));
        l.cap_ns = Some(0);
        assert!(l.renew(5_000_000_000));
        assert_ne!(l.expires_ns(), 0, "0 is the datapath's 'never expires'");
        assert!(lockstep_common::L2RespValue::expired(
            l.expires_ns(),
            5_000_000_000
        ));
        assert!(l.renew(6_000_000_000), "lapsed: nothing is answered");
        assert_eq!(l.expires_ns(), EXPIRED_NS, "stays expired");
    }

    #[test]
    fn the_clock_is_the_kernels_monotonic_one() {
        let a = monotonic_ns();
        std::thread::sleep(Duration::from_millis(5));
        let b = monotonic_ns();
        assert!(b >= a + 5_000_000 && b < a + 5_000_000_000);
    }
}
