//! Real routing daemons for the BGP tests (#48): BIRD as the node's
//! speaker, and FRR (zebra, bgpd, bfdd) as the peer router whose own
//! routing table the tests read. Each runs in a namespace the test made,
//! in the foreground as a child of the test, and is killed on drop with
//! its files.

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::{AgentProc, Netns, TempDir, sh};

/// `addresses` (prefixes) announced with no attributes.
///
/// # Panics
/// One is not a prefix (a test's own constant).
pub fn announce(addresses: &[&str]) -> lockstep_core::bgp::Announcements {
    addresses
        .iter()
        .map(|a| {
            (
                a.parse().expect("a prefix"),
                lockstep_core::bgp::RouteAttrs::default(),
            )
        })
        .collect()
}

/// Waits until `path` exists, at most `within`.
fn wait_for(path: &Path, within: Duration, what: &str) -> anyhow::Result<()> {
    let started = Instant::now();
    while !path.exists() {
        if started.elapsed() > within {
            bail!("{what}: {} never appeared", path.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// Kills and reaps `children`.
fn kill_all(children: &mut Vec<Child>) {
    for c in children.iter_mut() {
        let _ = c.kill();
        let _ = c.wait();
    }
    children.clear();
}

/// BIRD in a namespace, reached through lockstep's door.
pub struct BirdProc {
    dir: TempDir,
    child: Vec<Child>,
}

impl BirdProc {
    /// Starts BIRD in `ns` with `config` as its file.
    ///
    /// # Errors
    /// BIRD refused the config or never opened its control socket.
    pub fn start(ns: &Netns, config: &str) -> anyhow::Result<Self> {
        let dir = TempDir::new("bird")?;
        std::fs::write(dir.path().join("bird.conf"), config)?;
        Self::start_in(ns, dir)
    }

    /// Starts BIRD in `ns` from `dir`'s `bird.conf` (written by someone
    /// else: the agent), its socket `dir`'s `bird.ctl`: the command
    /// docs/bgp.md gives, `bird -f -c <file> -s <socket>`.
    ///
    /// # Errors
    /// BIRD refused the config or never opened its control socket.
    pub fn start_in(ns: &Netns, dir: TempDir) -> anyhow::Result<Self> {
        let conf = dir.path().join("bird.conf");
        let log = std::fs::File::create(dir.path().join("bird.log"))?;
        let child = ns
            .command("bird")
            .arg("-f")
            .arg("-c")
            .arg(&conf)
            .arg("-s")
            .arg(dir.path().join("bird.ctl"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting bird")?;
        let mut me = Self {
            dir,
            child: vec![child],
        };
        if let Err(e) = wait_for(&me.socket(), Duration::from_secs(10), "bird") {
            kill_all(&mut me.child);
            bail!("{e}\nbird's log:\n{}", me.log());
        }
        Ok(me)
    }

    /// A planned restart as docs/bgp.md gives it: `birdc graceful
    /// restart` (BIRD stops, its sessions left for the routers' graceful
    /// restart), then BIRD started again in `ns` from the same file with
    /// `-R` (graceful restart recovery).
    ///
    /// # Errors
    /// birdc failed, BIRD did not stop within 10 s, or did not start again.
    pub fn graceful_restart(&mut self, ns: &Netns) -> anyhow::Result<()> {
        let socket = self.socket().display().to_string();
        ns.exec("birdc", ["-s", socket.as_str(), "graceful", "restart"])?;
        let started = Instant::now();
        for c in &mut self.child {
            while c.try_wait()?.is_none() {
                if started.elapsed() > Duration::from_secs(10) {
                    bail!("BIRD did not stop on `graceful restart`:\n{}", self.log());
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        self.child.clear();
        let _ = std::fs::remove_file(self.socket());
        let log = std::fs::OpenOptions::new()
            .append(true)
            .open(self.dir.path().join("bird.log"))?;
        let child = ns
            .command("bird")
            .arg("-R")
            .arg("-f")
            .arg("-c")
            .arg(self.config_path())
            .arg("-s")
            .arg(self.socket())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting bird again")?;
        self.child.push(child);
        wait_for(&self.socket(), Duration::from_secs(10), "bird")
    }

    /// The control socket.
    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("bird.ctl")
    }

    /// The configuration file it started from.
    pub fn config_path(&self) -> PathBuf {
        self.dir.path().join("bird.conf")
    }

    /// lockstep's door to it.
    pub fn door(&self) -> lockstep::bgp::Bird {
        lockstep::bgp::Bird::new(self.socket(), self.dir.path().join("bird.conf"))
    }

    /// What BIRD logged.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("bird.log")).unwrap_or_default()
    }
}

impl Drop for BirdProc {
    fn drop(&mut self) {
        kill_all(&mut self.child);
    }
}

/// FRR's zebra, bgpd and bfdd in a namespace: the peer router.
pub struct Frr {
    ns_name: String,
    dir: TempDir,
    children: Vec<Child>,
}

impl Frr {
    /// Starts the three daemons in `ns` and loads `config` (FRR's
    /// integrated syntax) through vtysh.
    ///
    /// # Errors
    /// A daemon did not start, or vtysh refused the config.
    pub fn start(ns: &Netns, config: &str) -> anyhow::Result<Self> {
        let dir = TempDir::new("frr")?;
        // The daemons drop to the frr user and make their sockets here.
        sh("chown", ["frr:frr", &dir.path().display().to_string()])?;
        let d = dir.path().to_path_buf();
        let mut me = Self {
            ns_name: ns.name().to_string(),
            dir,
            children: Vec::new(),
        };
        for daemon in ["zebra", "bgpd", "bfdd"] {
            let log = std::fs::File::create(d.join(format!("{daemon}.log")))?;
            let mut cmd = ns.command(format!("/usr/lib/frr/{daemon}"));
            cmd.arg("-f")
                .arg("/dev/null")
                .arg("-i")
                .arg(d.join(format!("{daemon}.pid")))
                .arg("--vty_socket")
                .arg(&d)
                .arg("-z")
                .arg(d.join("zserv.api"))
                .arg("-P")
                .arg("0");
            if daemon == "bfdd" {
                cmd.arg("--bfdctl").arg(d.join("bfdd.sock"));
            }
            let child = cmd
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .with_context(|| format!("starting {daemon}"))?;
            me.children.push(child);
            wait_for(
                &d.join(format!("{daemon}.vty")),
                Duration::from_secs(10),
                daemon,
            )?;
        }
        let file = d.join("frr.conf");
        std::fs::write(&file, config)?;
        me.vtysh_args(&["-f", &file.display().to_string()])?;
        Ok(me)
    }

    fn vtysh_args(&self, args: &[&str]) -> anyhow::Result<String> {
        let net = format!("--net=/run/netns/{}", self.ns_name);
        let socket = self.dir.path().display().to_string();
        let head = [net.as_str(), "--", "vtysh", "--vty_socket", socket.as_str()];
        sh("nsenter", head.iter().chain(args))
    }

    /// One vtysh command's output.
    ///
    /// # Errors
    /// vtysh failed.
    pub fn vtysh(&self, command: &str) -> anyhow::Result<String> {
        self.vtysh_args(&["-c", command])
    }

    /// `show bgp neighbors <addr> json`, for that neighbour.
    ///
    /// # Errors
    /// vtysh failed or answered no JSON for it.
    pub fn neighbor(&self, address: &str) -> anyhow::Result<serde_json::Value> {
        let out = self.vtysh(&format!("show bgp neighbors {address} json"))?;
        let v: serde_json::Value =
            serde_json::from_str(&out).with_context(|| format!("vtysh said {out}"))?;
        v.get(address)
            .cloned()
            .with_context(|| format!("no neighbour {address} in {out}"))
    }
}

impl Drop for Frr {
    fn drop(&mut self) {
        kill_all(&mut self.children);
    }
}

/// The routes the kernel of `ns` holds from BGP (`proto bgp`): prefix →
/// next hops.
///
/// # Errors
/// `ip route` failed.
pub fn bgp_routes(ns: &Netns) -> anyhow::Result<std::collections::BTreeMap<String, Vec<String>>> {
    bgp_routes_in(ns.name())
}

/// [`bgp_routes`] of the namespace named `name` (from a thread that does
/// not own it).
///
/// # Errors
/// `ip route` failed.
pub fn bgp_routes_in(
    name: &str,
) -> anyhow::Result<std::collections::BTreeMap<String, Vec<String>>> {
    let mut out = std::collections::BTreeMap::new();
    for family in ["-4", "-6"] {
        let text = sh("ip", ["-n", name, family, "route", "show", "proto", "bgp"])?;
        let mut current: Option<String> = None;
        for line in text.lines() {
            let words: Vec<&str> = line.split_whitespace().collect();
            if !line.starts_with(char::is_whitespace) {
                let prefix = words.first().copied().unwrap_or_default().to_string();
                let hops: Vec<String> = words
                    .windows(2)
                    .filter(|w| w[0] == "via")
                    .map(|w| w[1].to_string())
                    .collect();
                out.insert(prefix.clone(), hops);
                current = Some(prefix);
            } else if let Some(p) = &current
                && let Some(i) = words.iter().position(|w| *w == "via")
                && let Some(hop) = words.get(i + 1)
            {
                // A multipath route: one `nexthop via` line per hop.
                out.entry(p.clone()).or_default().push((*hop).to_string());
            }
        }
    }
    Ok(out)
}

/// One peer router linked to the node: FRR in its own namespace.
pub struct Router {
    /// FRR (stopped before its namespace goes: fields drop in order).
    pub frr: Frr,
    /// Its namespace.
    pub ns: Netns,
    /// The node's address on the link.
    pub node_addr: String,
    /// The router's address on the link.
    pub addr: String,
}

impl Router {
    /// Cuts the link at the router without a TCP close: every packet
    /// from and to the node dropped (nftables table `lockstep_cut`),
    /// until [`Router::uncut`].
    ///
    /// # Errors
    /// nft refused the rules.
    pub fn cut(&self) -> anyhow::Result<()> {
        let node = &self.node_addr;
        let rules = format!(
            "table inet lockstep_cut {{\n chain in {{ type filter hook input priority 0; ip saddr {node} drop; }}\n \
             chain out {{ type filter hook output priority 0; ip daddr {node} drop; }}\n}}\n"
        );
        let dir = TempDir::new("bgpcut")?;
        let file = dir.path().join("cut.nft");
        std::fs::write(&file, rules)?;
        self.ns.exec("nft", ["-f", &file.display().to_string()])?;
        Ok(())
    }

    /// Ends [`Router::cut`].
    ///
    /// # Errors
    /// nft refused (the link was not cut).
    pub fn uncut(&self) -> anyhow::Result<()> {
        self.ns
            .exec("nft", ["delete", "table", "inet", "lockstep_cut"])?;
        Ok(())
    }
}

/// A node namespace running BIRD, linked to routers running FRR.
pub struct Lab {
    /// The routers, in order.
    pub routers: Vec<Router>,
    /// The node's BIRD.
    pub bird: BirdProc,
    /// The node's namespace.
    pub node: Netns,
}

impl Lab {
    /// The node linked to `count` routers: the i-th link is
    /// 10.251.i.0/30, the node .1 and the router .2; router i runs FRR as
    /// AS `router_asn`, peering with the node as AS 64512 with BFD
    /// (100 ms × 3) and a 9 s hold time. BIRD then starts with the text
    /// `bird_config` makes of the links (node address, router address).
    ///
    /// # Errors
    /// A namespace, link or daemon failed.
    pub fn new(
        count: u8,
        router_asn: u32,
        bird_config: impl FnOnce(&[(String, String)]) -> anyhow::Result<String>,
    ) -> anyhow::Result<Lab> {
        Self::new_with(count, router_asn, "", bird_config)
    }

    /// As [`Lab::new`], the routers' BGP blocks carrying `router_extra`
    /// ([`Lab::link_with`]).
    ///
    /// # Errors
    /// A namespace, link or daemon failed.
    pub fn new_with(
        count: u8,
        router_asn: u32,
        router_extra: &str,
        bird_config: impl FnOnce(&[(String, String)]) -> anyhow::Result<String>,
    ) -> anyhow::Result<Lab> {
        let (node, routers) = Self::link_with(count, router_asn, router_extra)?;
        let links: Vec<(String, String)> = routers
            .iter()
            .map(|r| (r.node_addr.clone(), r.addr.clone()))
            .collect();
        let bird = BirdProc::start(&node, &bird_config(&links)?)?;
        Ok(Lab {
            routers,
            bird,
            node,
        })
    }

    /// The node namespace linked to `count` routers running FRR, as
    /// [`Lab::new`] makes them, without BIRD.
    ///
    /// # Errors
    /// A namespace, link or daemon failed.
    pub fn link(count: u8, router_asn: u32) -> anyhow::Result<(Netns, Vec<Router>)> {
        Self::link_with(count, router_asn, "")
    }

    /// As [`Lab::link`], each router's BGP block carrying `router_extra`
    /// too, in which `{node}` stands for the node's address on its link
    /// (e.g. graceful restart and its BFD interplay).
    ///
    /// # Errors
    /// A namespace, link or daemon failed.
    pub fn link_with(
        count: u8,
        router_asn: u32,
        router_extra: &str,
    ) -> anyhow::Result<(Netns, Vec<Router>)> {
        let node = Netns::new("bgpn")?;
        let mut routers = Vec::new();
        for i in 0..count {
            let ns = Netns::new("bgpr")?;
            let (up, down) = (format!("up{i}"), format!("down{i}"));
            crate::veth(&node, &up, &ns, &down)?;
            let node_addr = format!("10.251.{i}.1");
            let addr = format!("10.251.{i}.2");
            node.ip(["addr", "add", &format!("{node_addr}/30"), "dev", &up])?;
            ns.ip(["addr", "add", &format!("{addr}/30"), "dev", &down])?;
            let extra = router_extra.replace("{node}", &node_addr);
            let config = format!(
                "frr defaults datacenter\n!\nrouter bgp {router_asn}\n bgp router-id {addr}\n \
                 no bgp ebgp-requires-policy\n neighbor {node_addr} remote-as 64512\n \
                 neighbor {node_addr} bfd\n neighbor {node_addr} timers 3 9\n \
                 neighbor {node_addr} timers connect 1\n{extra}!\nbfd\n peer {node_addr}\n  \
                 receive-interval 100\n  transmit-interval 100\n  detect-multiplier 3\n exit\nexit\n"
            );
            let frr = Frr::start(&ns, &config)?;
            routers.push(Router {
                frr,
                ns,
                node_addr,
                addr,
            });
        }
        Ok((node, routers))
    }

    /// Waits until router `r`'s kernel table holds exactly `want` from
    /// BGP (host routes written without their /32), each via the node, at
    /// most `within`; how long it took.
    ///
    /// # Errors
    /// It did not within `within`.
    pub fn routes_become(
        &self,
        r: usize,
        want: &[&str],
        within: Duration,
    ) -> anyhow::Result<Duration> {
        let router = &self.routers[r];
        let want: std::collections::BTreeMap<String, Vec<String>> = want
            .iter()
            .map(|p| {
                let p = p.trim_end_matches("/32").to_string();
                (p, vec![router.node_addr.clone()])
            })
            .collect();
        let started = Instant::now();
        loop {
            let got = bgp_routes(&router.ns)?;
            if got == want {
                return Ok(started.elapsed());
            }
            if started.elapsed() > within {
                bail!(
                    "router {r}'s BGP routes are {got:?}, not {want:?}, after {within:?}\nbird: {}",
                    self.bird.log()
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Waits until router `r`'s BFD session to the node is up (it comes
    /// up after the BGP session that asks for it: until then a cut is
    /// seen at the hold time only).
    ///
    /// # Errors
    /// It did not within `within`.
    pub fn bfd_up(&self, r: usize, within: Duration) -> anyhow::Result<()> {
        let router = &self.routers[r];
        let started = Instant::now();
        loop {
            let out = router
                .frr
                .vtysh(&format!("show bfd peer {} json", router.node_addr))?;
            let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
            if v.get("status").and_then(serde_json::Value::as_str) == Some("up") {
                return Ok(());
            }
            if started.elapsed() > within {
                bail!("router {r}'s BFD to the node never came up: {out}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// How many times router `r`'s session came up, once it has settled:
    /// BFD up, and the count the same 3 s later. At start a session may
    /// come up twice: FRR resets it once with "BFD down received" in the
    /// first seconds in most runs (docs/design/bgp.md); resets are
    /// counted from a settled session on.
    ///
    /// # Errors
    /// It did not settle within 30 s.
    pub fn settled(&self, r: usize) -> anyhow::Result<u64> {
        let started = Instant::now();
        loop {
            self.bfd_up(r, Duration::from_secs(30))?;
            let count = self.established_count(r)?;
            std::thread::sleep(Duration::from_secs(3));
            if self.established_count(r)? == count && self.bfd_up(r, Duration::ZERO).is_ok() {
                return Ok(count);
            }
            if started.elapsed() > Duration::from_secs(30) {
                bail!("router {r}'s session never settled");
            }
        }
    }

    /// How many times router `r`'s session to the node came up.
    ///
    /// # Errors
    /// vtysh failed or did not say.
    pub fn established_count(&self, r: usize) -> anyhow::Result<u64> {
        let router = &self.routers[r];
        let n = router.frr.neighbor(&router.node_addr)?;
        let count = n
            .get("connectionsEstablished")
            .and_then(serde_json::Value::as_u64)
            .with_context(|| format!("no connectionsEstablished in {n}"))?;
        if count > 1 {
            eprintln!(
                "router {r}: session came up {count} times; last reset: {} ({})",
                n.get("lastResetDueTo").unwrap_or(&serde_json::Value::Null),
                n.get("lastNotificationReason")
                    .unwrap_or(&serde_json::Value::Null)
            );
        }
        Ok(count)
    }
}

/// The `[bgp]` section for a lab's one link (the node's and the router's
/// addresses), BIRD's files at `socket` and `config`: pool `public`
/// announced with community 64512:100, the LB routes withdrawn after 5 s
/// of the agent's silence (by `lockstep bird-keeper`, where a test runs
/// it).
pub fn section(node: &str, router: &str, socket: &Path, config: &Path) -> String {
    format!(
        "[bgp]\nasn = 64512\nrouter_id = \"{node}\"\nbird_socket = \"{}\"\nbird_config = \"{}\"\nwithdraw_after = \"5s\"\n\
         [[bgp.peers]]\nname = \"tor-0\"\naddress = \"{router}\"\nasn = 64513\nsource = \"{node}\"\nhold_time = \"9s\"\n\
         [bgp.pools.public]\ncommunities = [\"64512:100\"]\n",
        socket.display(),
        config.display()
    )
}

/// A LoadBalancer Service for `lb apply`, selecting pool `pool`.
pub fn service(namespace: &str, name: &str, pool: &str) -> serde_json::Value {
    serde_json::json!({
        "namespace": namespace, "name": name, "labels": {"pool": pool},
        "ports": [{"protocol": "TCP", "port": 443}]
    })
}

/// The agent with `[bgp]` beside BIRD, linked to one FRR router.
pub struct AgentLab {
    /// The agent (single-node LB IPAM, a pod pool, `[bgp]`).
    pub agent: AgentProc,
    /// The node, its BIRD and the router.
    pub lab: Lab,
    /// BIRD's control socket.
    pub socket: PathBuf,
}

impl AgentLab {
    /// Starts the agent first, which writes the file BIRD starts from,
    /// then BIRD from it as docs/bgp.md says; the router's session
    /// settled is not waited for.
    ///
    /// # Errors
    /// A namespace, daemon or the agent did not start, or the agent never
    /// wrote BIRD's file.
    pub fn start() -> anyhow::Result<Self> {
        Self::start_with("")
    }

    /// [`AgentLab::start`], `bgp_extra` appended to the `[bgp]` section
    /// (say `[bgp.pools.pods]`, to announce the pod pool 10.80.0.0/24).
    ///
    /// # Errors
    /// As [`AgentLab::start`].
    pub fn start_with(bgp_extra: &str) -> anyhow::Result<Self> {
        Self::start_routers(1, bgp_extra)
    }

    /// [`AgentLab::start_with`], the node linked to `count` routers, the
    /// i-th its peer `tor-i` (as [`Lab::new`] links them).
    ///
    /// # Errors
    /// As [`AgentLab::start`].
    pub fn start_routers(count: u8, bgp_extra: &str) -> anyhow::Result<Self> {
        let (node, routers) = Lab::link(count, 64513)?;
        let bird_dir = TempDir::new("bird")?;
        let socket = bird_dir.path().join("bird.ctl");
        let bird_config = bird_dir.path().join("bird.conf");
        let more: String = routers
            .iter()
            .enumerate()
            .skip(1)
            .map(|(i, r)| {
                format!(
                    "[[bgp.peers]]\nname = \"tor-{i}\"\naddress = \"{}\"\nasn = 64513\nsource = \"{}\"\nhold_time = \"9s\"\n",
                    r.addr, r.node_addr
                )
            })
            .collect();
        let extra = format!(
            "[[pools]]\nname = \"pods\"\nipv4 = [\"10.80.0.0/24\"]\n{}{more}{bgp_extra}",
            section(
                &routers[0].node_addr,
                &routers[0].addr,
                &socket,
                &bird_config
            )
        );
        let agent = AgentProc::start(&node, &extra)?;
        let started = Instant::now();
        while !bird_config.exists() {
            if started.elapsed() > Duration::from_secs(10) {
                bail!(
                    "the agent never wrote {}:\n{}",
                    bird_config.display(),
                    agent.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let bird = BirdProc::start_in(&node, bird_dir)?;
        Ok(Self {
            agent,
            lab: Lab {
                routers,
                bird,
                node,
            },
            socket,
        })
    }
}

/// Makes a `KubeLab` whose node `i`'s config ends with the text given.
type LabBuilder<'a> =
    &'a dyn Fn(&dyn Fn(usize) -> String) -> anyhow::Result<crate::kube_lab::KubeLab>;

/// Three agents under `[kubernetes]` on the API double (`KubeLab`), BIRD
/// beside each, and FRR in the neighbour: the Kubernetes BGP tests' lab.
/// Fields drop in order, so each daemon stops before its namespace goes.
pub struct KubeBirds {
    /// The router.
    pub frr: Frr,
    /// Node `i`'s BIRD.
    pub birds: Vec<BirdProc>,
    /// The double and the three nodes.
    pub k: crate::kube_lab::KubeLab,
}

impl KubeBirds {
    /// The nodes labelled `labels`, node `i`'s config ending with
    /// `section(dir)` (its `[kubernetes]` keys and `[bgp]`, BIRD's files
    /// in `dir`); each BIRD started from the file its agent wrote, then
    /// FRR from `frr_config` (its integrated syntax).
    ///
    /// # Errors
    /// A namespace, daemon or agent did not start, or an agent never
    /// wrote BIRD's file.
    pub fn start(
        labels: [serde_json::Value; 3],
        section: &dyn Fn(&Path) -> String,
        frr_config: &str,
    ) -> anyhow::Result<Self> {
        Self::start_on(section, frr_config, &|extra| {
            crate::kube_lab::KubeLab::build_local(labels.clone(), extra)
        })
    }

    /// As [`KubeBirds::start`], the agents in cluster mode on `cluster`
    /// (under `prefix`).
    ///
    /// # Errors
    /// As [`KubeBirds::start`].
    pub fn start_cluster(
        cluster: &crate::etcd::EtcdCluster,
        prefix: &str,
        labels: [serde_json::Value; 3],
        section: &dyn Fn(&Path) -> String,
        frr_config: &str,
    ) -> anyhow::Result<Self> {
        Self::start_on(section, frr_config, &|extra| {
            crate::kube_lab::KubeLab::build_with(cluster, prefix, labels.clone(), extra)
        })
    }

    /// The lab `build` makes with each node's config ending with
    /// `section`, BIRD and FRR started as [`KubeBirds::start`] says.
    fn start_on(
        section: &dyn Fn(&Path) -> String,
        frr_config: &str,
        build: LabBuilder<'_>,
    ) -> anyhow::Result<Self> {
        let dirs: Vec<TempDir> = (0..3)
            .map(|_| TempDir::new("bird"))
            .collect::<anyhow::Result<_>>()?;
        let paths: Vec<PathBuf> = dirs.iter().map(|d| d.path().to_path_buf()).collect();
        let k = build(&|i| section(&paths[i]))?;
        // Each agent writes the file its BIRD starts from.
        let mut birds = Vec::new();
        for (i, dir) in dirs.into_iter().enumerate() {
            let file = paths[i].join("bird.conf");
            crate::wait_for("the agent's BIRD file", Duration::from_secs(20), || {
                file.exists().then_some(())
            })
            .with_context(|| k.lab.agents[i].log())?;
            birds.push(BirdProc::start_in(&k.lab.ns[i], dir)?);
        }
        let frr = Frr::start(&k.lab.nb, frr_config)?;
        Ok(Self { frr, birds, k })
    }

    /// Every agent's and BIRD's log, to print when a test fails.
    pub fn logs(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (i, a) in self.k.lab.agents.iter().enumerate() {
            out.push(format!("--- node-{i} agent ---\n{}", a.log()));
            out.push(format!("--- node-{i} bird ---\n{}", self.birds[i].log()));
        }
        out
    }
}

/// `lockstep bird-keeper` in a node's namespace, reading `agent`'s
/// config (its `[bgp]`), killed on drop.
pub struct Keeper {
    child: Child,
    log: PathBuf,
}

impl Keeper {
    /// Starts the keeper beside `agent`'s BIRD in `ns`; its log goes to
    /// the agent's directory.
    ///
    /// # Errors
    /// The log or the process could not be made.
    pub fn start(ns: &Netns, agent: &AgentProc) -> anyhow::Result<Self> {
        let log = agent.dir.path().join("keeper.log");
        let child = ns
            .command(crate::lockstep_bin())
            .arg("bird-keeper")
            .arg("--config")
            .arg(&agent.config)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()
            .context("starting lockstep bird-keeper")?;
        Ok(Self { child, log })
    }

    /// What it logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Keeper {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// FRR's configuration for a router `router_id` in AS 64513 peering
/// with each of `nodes` (AS 64512) with BFD (100 ms × 3), ECMP over all
/// of them.
pub fn ecmp_router(router_id: &str, nodes: &[String]) -> String {
    let mut c = format!(
        "frr defaults datacenter\n!\nrouter bgp 64513\n bgp router-id {router_id}\n \
         no bgp ebgp-requires-policy\n"
    );
    for n in nodes {
        c += &format!(
            " neighbor {n} remote-as 64512\n neighbor {n} bfd\n neighbor {n} timers 3 9\n \
             neighbor {n} timers connect 1\n"
        );
    }
    c += " address-family ipv4 unicast\n  maximum-paths 8\n exit-address-family\n!\nbfd\n";
    for n in nodes {
        c += &format!(
            " peer {n}\n  receive-interval 100\n  transmit-interval 100\n  detect-multiplier 3\n exit\n"
        );
    }
    c + "exit\n"
}
