//! Performance and memory budget of lockstep-core's allocators.
//!
//! Run with `cargo bench -p lockstep-core --bench core` (or
//! `cargo xtask bench core`). Every figure is the median of [`runs`] runs.
//! Memory is measured with a counting global allocator: bytes live after
//! building the structure minus bytes live before. Prints a table with each
//! goal and PASS/FAIL, and exits non-zero if any goal fails.

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use ipnet::IpNet;
use lockstep_core::cidr::{CidrAllocator, CidrOptions, Family};
use lockstep_core::manager::{Allocation, ManagerConfig, PoolManager, StaticPools};
use lockstep_core::owner::{Generation, Owner};
use lockstep_core::pool::PoolSpec;

#[path = "../../daemon/benches/shared/smoke.rs"]
mod smoke;

/// Runs per figure, the median reported (1 in a smoke run: `smoke.rs`).
fn runs() -> usize {
    smoke::size(7, 1)
}

/// Counts live heap bytes.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every method forwards to `System` with the caller's arguments
// unchanged and only adds bookkeeping on an atomic counter, so `System`'s
// guarantees carry over.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is; the caller upholds `alloc`'s contract.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is; the caller upholds `alloc_zeroed`'s contract.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as is; `ptr` came from this allocator with `layout`.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded as is; the caller upholds `realloc`'s contract.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
            LIVE.fetch_add(new_size, Ordering::Relaxed);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn live() -> usize {
    LIVE.load(Ordering::Relaxed)
}

/// Heap bytes retained by the value `build` returns.
fn retained<T>(build: impl FnOnce() -> T) -> (usize, T) {
    let before = live();
    let value = black_box(build());
    (live().saturating_sub(before), value)
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// A small deterministic PRNG (xorshift64*), so runs are comparable.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

fn net(s: &str) -> IpNet {
    s.parse().expect("valid CIDR literal")
}

/// allocate_next + release pairs per second on `alloc`.
fn pairs_per_sec(alloc: &mut CidrAllocator, pairs: u32) -> f64 {
    let start = Instant::now();
    for _ in 0..pairs {
        let a = alloc.allocate_next().expect("a free address");
        alloc.release(black_box(a)).expect("just allocated");
    }
    f64::from(pairs) / start.elapsed().as_secs_f64()
}

fn slash16() -> CidrAllocator {
    CidrAllocator::new(net("10.0.0.0/16"), CidrOptions::default(), []).expect("valid")
}

/// A /16 with every address taken except 1% spread at random.
fn slash16_one_percent_free() -> CidrAllocator {
    let mut a = slash16();
    while a.allocate_next().is_ok() {}
    let mut rng = Rng(0x5eed);
    let target = a.capacity() / 100;
    while a.free() < target {
        let host = 1 + (rng.next() % 65_534) as u32;
        let addr = IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + host));
        let _ = a.release(addr);
    }
    a
}

struct Line {
    name: &'static str,
    measured: String,
    goal: String,
    pass: Option<bool>,
}

fn main() -> ExitCode {
    let mut lines = Vec::new();
    let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
    let size = |b: usize| {
        if b < 1024 * 1024 {
            format!("{:.1} KiB", b as f64 / 1024.0)
        } else {
            format!("{:.3} MiB", mib(b))
        }
    };

    // 1. Pairs on an empty /16.
    let rate = median(
        (0..runs())
            .map(|_| pairs_per_sec(&mut slash16(), 2_000_000))
            .collect(),
    );
    lines.push(Line {
        name: "allocate+release pairs, /16",
        measured: format!("{:.1} M/s", rate / 1e6),
        goal: ">= 10 M/s".into(),
        pass: Some(rate >= 10e6),
    });

    // 2. Pairs on a /16 with 1% free.
    let rate = median(
        (0..runs())
            .map(|_| pairs_per_sec(&mut slash16_one_percent_free(), 2_000_000))
            .collect(),
    );
    lines.push(Line {
        name: "allocate+release pairs, /16 1% free",
        measured: format!("{:.1} M/s", rate / 1e6),
        goal: ">= 1 M/s".into(),
        pass: Some(rate >= 1e6),
    });

    // 3. Memory of a /8 pool, through the manager (what the daemon holds).
    let bytes = median(
        (0..runs())
            .map(|_| {
                let (b, m) = retained(|| {
                    let spec = PoolSpec::new("big").with_cidr(net("10.0.0.0/8"));
                    let mut m = PoolManager::new(StaticPools(vec![spec]), ManagerConfig::default())
                        .expect("valid config");
                    m.sync().into_result().expect("valid pool");
                    m
                });
                drop(m);
                b as f64
            })
            .collect(),
    ) as usize;
    lines.push(Line {
        name: "memory, /8 pool (manager)",
        measured: size(bytes),
        goal: "<= 2.5 MiB".into(),
        pass: Some(mib(bytes) <= 2.5),
    });

    // 4. Memory of an IPv6 /64 holding 100k allocations. Next-fit allocations
    // are contiguous (one run); the goal is checked on the worst case, 100k
    // scattered addresses (one run each).
    let v6 = |scattered: bool| {
        median(
            (0..runs())
                .map(|_| {
                    let (b, a) = retained(|| {
                        let mut a =
                            CidrAllocator::new(net("fd00::/64"), CidrOptions::default(), [])
                                .expect("valid");
                        let mut rng = Rng(42);
                        for _ in 0..100_000 {
                            if scattered {
                                // Odd offsets: never the subnet-router anycast address.
                                let off = u128::from(rng.next() | 1);
                                let addr = 0xfd00_u128 << 112 | off;
                                let _ = a.allocate(IpAddr::V6(Ipv6Addr::from(addr)));
                            } else {
                                a.allocate_next().expect("a /64 has room");
                            }
                        }
                        a
                    });
                    assert!(a.used() >= 99_990);
                    drop(a);
                    b as f64
                })
                .collect(),
        ) as usize
    };
    let contiguous = v6(false);
    lines.push(Line {
        name: "memory, /64 with 100k (next-fit)",
        measured: size(contiguous),
        goal: "<= 16 MiB".into(),
        pass: Some(mib(contiguous) <= 16.0),
    });
    let scattered = v6(true);
    lines.push(Line {
        name: "memory, /64 with 100k (scattered)",
        measured: size(scattered),
        goal: "<= 16 MiB".into(),
        pass: Some(mib(scattered) <= 16.0),
    });

    // 5. Restore of 10k persisted allocations into a manager (our own goal:
    // start-up must not wait on IPAM).
    let allocations: Vec<Allocation> = (0..10_000u32)
        .map(|i| Allocation {
            pool: "default".into(),
            address: IpAddr::V4(Ipv4Addr::from(0x0a00_0001 + i)),
            owner: Owner::endpoint(format!("{i:064x}"), "eth0"),
            generation: Generation(u64::from(i) + 1),
        })
        .collect();
    let mut manager_bytes = Vec::new();
    let ms = median(
        (0..runs())
            .map(|_| {
                let spec = PoolSpec::new("default")
                    .with_cidr(net("10.0.0.0/16"))
                    .with_cidr(net("fd00::/64"));
                let mut m = PoolManager::new(StaticPools(vec![spec]), ManagerConfig::default())
                    .expect("valid config");
                m.sync().into_result().expect("valid pool");
                let input = allocations.clone();
                let before = live();
                let start = Instant::now();
                let outcome = m.restore(Generation(10_000), input);
                let elapsed = start.elapsed().as_secs_f64() * 1e3;
                manager_bytes.push(live().saturating_sub(before) as f64);
                assert_eq!(outcome.restored, 10_000);
                assert_eq!(m.usage(Family::V4).in_use, 10_000);
                elapsed
            })
            .collect(),
    );
    lines.push(Line {
        name: "restore 10k allocations",
        measured: format!("{ms:.2} ms"),
        goal: "<= 50 ms".into(),
        pass: Some(ms <= 50.0),
    });
    let per_alloc = median(manager_bytes) / 10_000.0;
    lines.push(Line {
        name: "manager index bytes per allocation",
        measured: format!("{per_alloc:.0} B"),
        goal: "(info)".into(),
        pass: None,
    });

    println!("lockstep-core bench: median of {} runs", runs());
    println!("{:<38} {:>14}  {:<12} result", "metric", "measured", "goal");
    let mut ok = true;
    for l in &lines {
        let result = match l.pass {
            Some(true) => "PASS",
            Some(false) => {
                ok = false;
                "FAIL"
            }
            None => "-",
        };
        println!("{:<38} {:>14}  {:<12} {result}", l.name, l.measured, l.goal);
    }
    // A smoke run judges no goal (small sizes, the debug build).
    if ok || smoke::smoke() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
