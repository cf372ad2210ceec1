//! A real multi-member etcd cluster on loopback for cluster-mode tests: the
//! distribution's `/usr/bin/etcd`, free ports, a private data directory per
//! member. Dropping it kills every member and removes every directory.

use anyhow::{Context, Result, bail};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

static NEXT: AtomicU32 = AtomicU32::new(0);

/// One member: its URLs and, while running, its process.
struct Member {
    name: String,
    client: String,
    peer: String,
    dir: PathBuf,
    child: Option<Child>,
}

/// A running etcd cluster; members can be stopped and started again.
pub struct EtcdCluster {
    root: PathBuf,
    token: String,
    members: Vec<Member>,
    tls: Option<Pki>,
}

/// Certificates made with `openssl` for a TLS cluster: a CA, etcd's
/// serving certificate (for 127.0.0.1), a client certificate the CA
/// signed, and a second CA that signed nothing etcd knows.
#[derive(Clone, Debug)]
pub struct Pki {
    /// The CA etcd and its clients trust.
    pub ca: PathBuf,
    /// etcd's serving certificate and key.
    pub server_cert: PathBuf,
    /// Its key.
    pub server_key: PathBuf,
    /// A client certificate signed by `ca`.
    pub client_cert: PathBuf,
    /// Its key.
    pub client_key: PathBuf,
    /// A CA that signed none of the above.
    pub other_ca: PathBuf,
}

fn openssl(dir: &Path, args: &[&str]) -> Result<()> {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .context("running openssl")?;
    if !out.status.success() {
        bail!(
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

impl Pki {
    /// Makes every certificate under `dir`.
    ///
    /// # Errors
    /// openssl fails.
    pub fn make(dir: &Path) -> Result<Pki> {
        std::fs::create_dir_all(dir)?;
        for ca in ["ca", "other-ca"] {
            openssl(
                dir,
                &[
                    "req",
                    "-x509",
                    "-newkey",
                    "ec",
                    "-pkeyopt",
                    "ec_paramgen_curve:P-256",
                    "-nodes",
                    "-days",
                    "2",
                    "-subj",
                    &format!("/CN=lockstep test {ca}"),
                    "-keyout",
                    &format!("{ca}.key"),
                    "-out",
                    &format!("{ca}.pem"),
                ],
            )?;
        }
        std::fs::write(
            dir.join("server.ext"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n",
        )?;
        std::fs::write(dir.join("client.ext"), "extendedKeyUsage=clientAuth\n")?;
        for who in ["server", "client"] {
            openssl(
                dir,
                &[
                    "req",
                    "-newkey",
                    "ec",
                    "-pkeyopt",
                    "ec_paramgen_curve:P-256",
                    "-nodes",
                    "-subj",
                    &format!("/CN=lockstep test {who}"),
                    "-keyout",
                    &format!("{who}.key"),
                    "-out",
                    &format!("{who}.csr"),
                ],
            )?;
            openssl(
                dir,
                &[
                    "x509",
                    "-req",
                    "-in",
                    &format!("{who}.csr"),
                    "-CA",
                    "ca.pem",
                    "-CAkey",
                    "ca.key",
                    "-CAcreateserial",
                    "-days",
                    "2",
                    "-extfile",
                    &format!("{who}.ext"),
                    "-out",
                    &format!("{who}.pem"),
                ],
            )?;
        }
        Ok(Pki {
            ca: dir.join("ca.pem"),
            server_cert: dir.join("server.pem"),
            server_key: dir.join("server.key"),
            client_cert: dir.join("client.pem"),
            client_key: dir.join("client.key"),
            other_ca: dir.join("other-ca.pem"),
        })
    }
}

/// Ports for members are taken below the kernel's ephemeral range
/// (`net.ipv4.ip_local_port_range`, 32768 and up by default): a port the
/// kernel handed out for `bind(0)` and released could be given to any
/// outgoing connection (an agent's, a forwarder's) before etcd binds it,
/// and etcd then exits with "address already in use" (CI saw it once).
/// Each process walks the range from its own offset.
static NEXT_PORT: AtomicU32 = AtomicU32::new(0);
const PORTS: std::ops::Range<u32> = 20_000..32_000;

fn free_port() -> Result<u16> {
    let span = PORTS.end - PORTS.start;
    let offset = std::process::id().wrapping_mul(7919) % span;
    for _ in 0..span {
        let k = NEXT_PORT.fetch_add(1, Ordering::Relaxed);
        let port = PORTS.start + (offset + k) % span;
        let port = u16::try_from(port)?;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    bail!("no free port in {PORTS:?}")
}

impl EtcdCluster {
    /// Starts `n` members and waits until every one answers healthy.
    ///
    /// # Errors
    /// A member that fails to start or to become healthy within 30 s.
    pub fn start(n: usize) -> Result<EtcdCluster> {
        Self::start_with(n, false)
    }

    /// Starts `n` members serving clients over TLS only, checking client
    /// certificates (`--client-cert-auth`); [`EtcdCluster::pki`] has the
    /// files.
    ///
    /// # Errors
    /// As [`EtcdCluster::start`], or the certificates cannot be made.
    pub fn start_tls(n: usize) -> Result<EtcdCluster> {
        Self::start_with(n, true)
    }

    /// The certificates of a TLS cluster.
    pub fn pki(&self) -> Option<&Pki> {
        self.tls.as_ref()
    }

    fn start_with(n: usize, tls: bool) -> Result<EtcdCluster> {
        let token = format!(
            "lockstep-test-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let root = std::env::temp_dir().join(&token);
        std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
        let tls = if tls {
            Some(Pki::make(&root.join("pki"))?)
        } else {
            None
        };
        let scheme = if tls.is_some() { "https" } else { "http" };
        let mut cluster = EtcdCluster {
            root,
            token,
            members: Vec::new(),
            tls,
        };
        for i in 0..n {
            let dir = cluster.root.join(format!("m{i}"));
            cluster.members.push(Member {
                name: format!("m{i}"),
                client: format!("{scheme}://127.0.0.1:{}", free_port()?),
                peer: format!("http://127.0.0.1:{}", free_port()?),
                dir,
                child: None,
            });
        }
        for i in 0..n {
            cluster.start_member(i)?;
        }
        for i in 0..n {
            cluster.wait_healthy(i, Duration::from_secs(30))?;
        }
        Ok(cluster)
    }

    /// Client URLs of every member, comma-separated order kept.
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(|m| m.client.clone()).collect()
    }

    /// The client URL of member `i`.
    pub fn endpoint(&self, i: usize) -> &str {
        &self.members[i].client
    }

    /// Starts member `i` (again); its data directory is kept across stops.
    ///
    /// # Errors
    /// When `etcd` cannot be spawned.
    pub fn start_member(&mut self, i: usize) -> Result<()> {
        let initial: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("{}={}", m.name, m.peer))
            .collect();
        let m = &mut self.members[i];
        if m.child.is_some() {
            return Ok(());
        }
        let log = std::fs::File::create(self.root.join(format!("{}.log", m.name)))?;
        let mut etcd = Command::new("/usr/bin/etcd");
        if let Some(pki) = &self.tls {
            etcd.arg("--cert-file")
                .arg(&pki.server_cert)
                .arg("--key-file")
                .arg(&pki.server_key)
                .arg("--trusted-ca-file")
                .arg(&pki.ca)
                .arg("--client-cert-auth");
        }
        let child = etcd
            .arg("--name")
            .arg(&m.name)
            .arg("--data-dir")
            .arg(&m.dir)
            .arg("--listen-client-urls")
            .arg(&m.client)
            .arg("--advertise-client-urls")
            .arg(&m.client)
            .arg("--listen-peer-urls")
            .arg(&m.peer)
            .arg("--initial-advertise-peer-urls")
            .arg(&m.peer)
            .arg("--initial-cluster")
            .arg(initial.join(","))
            .arg("--initial-cluster-token")
            .arg(&self.token)
            .arg("--initial-cluster-state")
            .arg("new")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("spawning /usr/bin/etcd")?;
        m.child = Some(child);
        Ok(())
    }

    /// Stops member `i` (SIGKILL) and waits for it.
    pub fn stop_member(&mut self, i: usize) {
        if let Some(mut child) = self.members[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Runs `etcdctl` against the given endpoints; its stdout on success.
    ///
    /// # Errors
    /// A non-zero exit, with etcdctl's stderr.
    pub fn etcdctl(endpoints: &[&str], args: &[&str]) -> Result<String> {
        let out = Command::new("/usr/bin/etcdctl")
            .env("ETCDCTL_API", "3")
            .arg(format!("--endpoints={}", endpoints.join(",")))
            .arg("--command-timeout=2s")
            .args(args)
            .output()
            .context("running etcdctl")?;
        if !out.status.success() {
            bail!(
                "etcdctl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Runs `etcdctl` with this cluster's client certificate, if it has TLS.
    ///
    /// # Errors
    /// As [`EtcdCluster::etcdctl`].
    pub fn ctl(&self, endpoints: &[&str], args: &[&str]) -> Result<String> {
        let Some(pki) = &self.tls else {
            return Self::etcdctl(endpoints, args);
        };
        let (ca, cert, key) = (
            format!("--cacert={}", pki.ca.display()),
            format!("--cert={}", pki.client_cert.display()),
            format!("--key={}", pki.client_key.display()),
        );
        let mut all: Vec<&str> = vec![&ca, &cert, &key];
        all.extend_from_slice(args);
        Self::etcdctl(endpoints, &all)
    }

    /// Waits until member `i` reports healthy (it has a leader and serves a
    /// quorum read).
    ///
    /// # Errors
    /// Not healthy within `timeout`; the error carries the member's log tail.
    pub fn wait_healthy(&self, i: usize, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        loop {
            if self
                .ctl(&[self.endpoint(i)], &["endpoint", "health"])
                .is_ok()
            {
                return Ok(());
            }
            if start.elapsed() > timeout {
                let log = std::fs::read_to_string(self.root.join(format!("m{i}.log")))
                    .unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(20).collect();
                bail!(
                    "etcd member m{i} not healthy after {timeout:?}; log tail:\n{}",
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Saves a snapshot of member `i`'s store to `path` (`etcdctl snapshot
    /// save`): the backup an operator takes.
    ///
    /// # Errors
    /// etcdctl failed.
    pub fn snapshot(&self, i: usize, path: &Path) -> Result<()> {
        let p = path.to_str().context("snapshot path")?;
        self.ctl(&[self.endpoint(i)], &["snapshot", "save", p])?;
        Ok(())
    }

    /// Restores every member from the snapshot at `path`, as the
    /// disaster-recovery procedure does: all members stopped, each data
    /// directory replaced by `etcdctl snapshot restore` (same names, peer
    /// URLs and cluster token), all started again; waits until healthy.
    /// Everything written after the snapshot is gone and the store's
    /// revision goes back to the snapshot's.
    ///
    /// # Errors
    /// A restore or a member that does not come back healthy in 30 s.
    pub fn restore_all(&mut self, path: &Path) -> Result<()> {
        self.restore_members(path)
    }

    /// As [`EtcdCluster::restore_all`], with a new cluster token, as the
    /// disaster-recovery procedure of docs/cluster.md asks: the restored
    /// cluster gets new member IDs and a new cluster ID, which every
    /// answer's header carries, so every agent tells the restore from its
    /// first answer whatever the revision.
    ///
    /// # Errors
    /// As [`EtcdCluster::restore_all`].
    pub fn restore_all_as_new_cluster(&mut self, path: &Path) -> Result<()> {
        self.token = format!(
            "{}-restored-{}",
            self.token,
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        self.restore_members(path)
    }

    fn restore_members(&mut self, path: &Path) -> Result<()> {
        for i in 0..self.members.len() {
            self.stop_member(i);
        }
        let initial: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("{}={}", m.name, m.peer))
            .collect();
        for m in &self.members {
            std::fs::remove_dir_all(&m.dir)
                .with_context(|| format!("removing {}", m.dir.display()))?;
            let out = Command::new("/usr/bin/etcdctl")
                .env("ETCDCTL_API", "3")
                .arg("snapshot")
                .arg("restore")
                .arg(path)
                .arg("--name")
                .arg(&m.name)
                .arg("--data-dir")
                .arg(&m.dir)
                .arg("--initial-cluster")
                .arg(initial.join(","))
                .arg("--initial-cluster-token")
                .arg(&self.token)
                .arg("--initial-advertise-peer-urls")
                .arg(&m.peer)
                .output()
                .context("running etcdctl snapshot restore")?;
            if !out.status.success() {
                bail!(
                    "etcdctl snapshot restore for {}: {}",
                    m.name,
                    String::from_utf8_lossy(&out.stderr).trim()
                );
            }
        }
        for i in 0..self.members.len() {
            self.start_member(i)?;
        }
        for i in 0..self.members.len() {
            self.wait_healthy(i, Duration::from_secs(30))?;
        }
        Ok(())
    }

    /// The directory holding every member's data and log.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Member `i`'s Prometheus counters (its `/metrics` on the client URL,
    /// plain HTTP), each line's name with labels → value.
    ///
    /// # Errors
    /// The member did not answer, or serves TLS only.
    pub fn metrics(&self, i: usize) -> Result<Vec<(String, f64)>> {
        use std::io::{Read, Write};
        let addr = self.members[i]
            .client
            .strip_prefix("http://")
            .context("metrics are read over plain http")?
            .to_string();
        let mut s = std::net::TcpStream::connect(&addr)?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(s, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
        let mut body = String::new();
        s.read_to_string(&mut body)?;
        Ok(body
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| {
                let (name, v) = l.rsplit_once(' ')?;
                Some((name.to_string(), v.parse().ok()?))
            })
            .collect())
    }

    /// The sum over every running member of the counters whose name and
    /// labels start with `metric` and contain each of `labels`
    /// (`grpc_method="Range"`).
    ///
    /// # Errors
    /// As [`EtcdCluster::metrics`].
    pub fn counter(&self, metric: &str, labels: &[&str]) -> Result<f64> {
        let mut sum = 0.0;
        for i in (0..self.members.len()).filter(|i| self.is_running(*i)) {
            sum += self
                .metrics(i)?
                .iter()
                .filter(|(n, _)| n.starts_with(metric) && labels.iter().all(|l| n.contains(l)))
                .map(|(_, v)| v)
                .sum::<f64>();
        }
        Ok(sum)
    }

    /// What the members have served so far, summed over the running
    /// ones ([`Traffic`]).
    ///
    /// # Errors
    /// As [`EtcdCluster::metrics`].
    pub fn traffic(&self) -> Result<Traffic> {
        Ok(Traffic {
            unary: self.counter("grpc_server_handled_total{", &["grpc_type=\"unary\""])?,
            streams: self.counter("grpc_server_started_total{", &["_stream\""])?,
            stream_msgs: self.counter("grpc_server_msg_received_total{", &["_stream\""])?,
            sent_bytes: self.counter("etcd_network_client_grpc_sent_bytes_total", &[])?,
        })
    }

    /// Whether member `i`'s process is running.
    pub fn is_running(&self, i: usize) -> bool {
        self.members[i].child.is_some()
    }

    /// The pid of member `i`, while it runs.
    pub fn pid(&self, i: usize) -> Option<u32> {
        self.members[i].child.as_ref().map(Child::id)
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.stop_member(i);
        }
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// etcd's own counters of what its clients cost it
/// ([`EtcdCluster::traffic`]): a benchmark reads them before and after a
/// window and divides the difference.
#[derive(Clone, Copy, Debug, Default)]
pub struct Traffic {
    /// Unary RPCs handled (`grpc_server_handled_total`, unary).
    pub unary: f64,
    /// Streams opened: watches, lease keep-alive streams
    /// (`grpc_server_started_total`).
    pub streams: f64,
    /// Messages received on streams: watch requests, lease refreshes
    /// (`grpc_server_msg_received_total`).
    pub stream_msgs: f64,
    /// Bytes sent to clients (`etcd_network_client_grpc_sent_bytes_total`).
    pub sent_bytes: f64,
}

impl std::ops::Sub for Traffic {
    type Output = Traffic;
    fn sub(self, o: Traffic) -> Traffic {
        Traffic {
            unary: self.unary - o.unary,
            streams: self.streams - o.streams,
            stream_msgs: self.stream_msgs - o.stream_msgs,
            sent_bytes: self.sent_bytes - o.sent_bytes,
        }
    }
}
