//! Traffic for the benchmarks that compare datapaths side by side
//! (`masq_bench`, `tunnel_bench`): an iperf3 server and client, a TCP
//! request/reply server and a connection-rate client, and the median.

use std::io::{BufRead, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};

use crate::Netns;

/// An `iperf3 -s` bound to one address in a namespace, killed on drop.
#[derive(Debug)]
pub struct IperfServer(Child);

impl IperfServer {
    /// Starts it on `ip` inside `ns`; returns once it listens.
    ///
    /// # Errors
    /// It could not be started or exited before listening.
    pub fn start(ns: &Netns, ip: &str) -> anyhow::Result<Self> {
        let mut child = ns
            .command("iperf3")
            .args(["-s", "-B", ip, "--forceflush"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        let out = child.stdout.take().context("iperf3 stdout")?;
        let server = Self(child);
        let mut lines = std::io::BufReader::new(out).lines();
        loop {
            let line = lines
                .next()
                .context("iperf3 -s exited before listening")??;
            if line.contains("listening") {
                break;
            }
        }
        std::thread::spawn(move || lines.for_each(drop));
        Ok(server)
    }
}

impl Drop for IperfServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// TCP throughput in bits per second of a 3-second `iperf3 -c server` from
/// `client` (what the server received).
///
/// # Errors
/// iperf3 failed or printed no result.
pub fn throughput(client: &Netns, server: &str) -> anyhow::Result<f64> {
    let out = client
        .command("iperf3")
        .args(["-c", server, "-t", "3", "-J"])
        .output()?;
    ensure!(
        out.status.success(),
        "iperf3 -c {server} failed: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .context("iperf3 JSON without end.sum_received")
}

/// A request/reply server on `ip` in `ns` (`threads` threads that live as
/// long as the process): reads a 16-byte request, writes a 64-byte reply,
/// closes first.
///
/// # Errors
/// The bind failed.
pub fn request_reply_server(ns: &Netns, ip: &str, threads: usize) -> anyhow::Result<SocketAddr> {
    let ip: IpAddr = ip.parse()?;
    let listener = ns.run(|| Ok(TcpListener::bind(SocketAddr::new(ip, 0))?))?;
    let addr = listener.local_addr()?;
    for _ in 0..threads {
        let l = listener.try_clone()?;
        std::thread::spawn(move || {
            let mut req = [0u8; 16];
            while let Ok((mut s, _)) = l.accept() {
                let _ = s.set_nodelay(true);
                if s.read_exact(&mut req).is_ok() {
                    let _ = s.write_all(&[7u8; 64]);
                }
            }
        });
    }
    Ok(addr)
}

/// Connections per second from `client` to a [`request_reply_server`] at
/// `to` over `round` with `threads` clients (connect, request, reply, the
/// server's close), and the number of failed attempts.
pub fn connections(client: &Netns, to: SocketAddr, threads: usize, round: Duration) -> (f64, u64) {
    let done = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            let (done, failed) = (done.clone(), failed.clone());
            s.spawn(move || {
                client.run(|| {
                    let mut reply = [0u8; 64];
                    while started.elapsed() < round {
                        let ok = (|| -> std::io::Result<()> {
                            let mut c = TcpStream::connect_timeout(&to, Duration::from_secs(1))?;
                            c.set_nodelay(true)?;
                            c.set_read_timeout(Some(Duration::from_secs(1)))?;
                            c.write_all(&[1u8; 16])?;
                            c.read_exact(&mut reply)?;
                            // The server closes first: EOF.
                            let extra = c.read(&mut [0u8; 1])?;
                            if extra == 0 {
                                Ok(())
                            } else {
                                Err(std::io::ErrorKind::InvalidData.into())
                            }
                        })();
                        match ok {
                            Ok(()) => done.fetch_add(1, Ordering::Relaxed),
                            Err(_) => failed.fetch_add(1, Ordering::Relaxed),
                        };
                    }
                    Ok(())
                })
            });
        }
    });
    let secs = started.elapsed().as_secs_f64();
    (
        done.load(Ordering::Relaxed) as f64 / secs,
        failed.load(Ordering::Relaxed),
    )
}

/// The median (the upper one of an even count); sorts `v`.
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The median of the per-round ratios `a[r] / b[r]`: two sides measured
/// back to back in each round share that round's state of the machine, so
/// this ratio is steadier than the ratio of the two medians when the
/// rounds drift (call it before [`median`] sorts either).
#[must_use]
pub fn paired_ratio(a: &[f64], b: &[f64]) -> f64 {
    let mut r: Vec<f64> = a.iter().zip(b).map(|(x, y)| x / y).collect();
    if r.is_empty() {
        return f64::NAN;
    }
    median(&mut r)
}

/// Prints which of the goals a benchmark `missed` (none: "met") and fails
/// when any was.
///
/// # Errors
/// A goal was missed.
pub fn check_goals(missed: &[&str]) -> anyhow::Result<()> {
    if crate::bench::smoke() {
        println!("  goals: not judged (smoke run: small sizes, debug build)");
        return Ok(());
    }
    println!(
        "  goals: {}",
        if missed.is_empty() {
            "met".to_string()
        } else {
            format!("MISSED: {}", missed.join(", "))
        }
    );
    ensure!(missed.is_empty(), "goals missed: {}", missed.join(", "));
    Ok(())
}
