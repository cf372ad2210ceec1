//! `cargo xtask setup`: installs what the build and the tests need.
//!
//! Every step first checks whether its work is already done, so a second run
//! changes nothing and takes a few seconds. Installing needs root (apt, mount).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

/// Debian packages: LLVM for bpf-linker, bpftool, network tools, and the real
/// peers of the integration tests (CNI plugins, podman, etcd, busybox for a
/// local container image).
pub const PACKAGES: &[&str] = &[
    "llvm-22-dev",
    "libpolly-22-dev",
    "bpftool",
    "iproute2",
    "iputils-ping",
    "iputils-arping",
    "tcpdump",
    // The start-up kill test stops the agent at its k-th write with strace.
    "strace",
    // fusermount3, through which the power-loss tests' FUSE file system
    // (lossyfs) mounts and is unmounted even if it dies.
    "fuse3",
    "util-linux",
    "containernetworking-plugins",
    "podman",
    "runc",
    "etcd-server",
    "etcd-client",
    // musl-gcc: ring (rustls' crypto, TLS to etcd) compiles C for the
    // static musl target the agent ships as; openssl makes the cluster
    // tests' certificates.
    "musl-tools",
    "openssl",
    "busybox-static",
    // The masquerade bench (#14): iperf3 for TCP throughput, nft for the
    // kernel's own masquerade it is measured against.
    "iperf3",
    "nftables",
    // The masquerade test with checksum offload switched off on every veth.
    "ethtool",
    // `cargo xtask fresh-root` (run by `cargo xtask test`): a throwaway
    // Debian root in which setup, the build and the unit tests must pass.
    "debootstrap",
    // promtool (Prometheus's own linter): the metrics test checks a live
    // agent's scrape with `promtool check metrics`, and the alert rules
    // with `promtool check rules`.
    "prometheus",
    // The aarch64 agent and plugin (#45 item 8; xtask/src/arch.rs): the
    // cross compiler and linker (ring's C, the link), musl's arm64 C library
    // and start files, LLVM's arm64 unwinder (the std that nightly builds
    // from source links `-lunwind`), all through dpkg's arm64 architecture
    // (`multiarch` below).
    "gcc-aarch64-linux-gnu",
    "musl-dev:arm64",
    "libunwind-16-dev:arm64",
    // The arm64 image's bpftool links these (bpftool:arm64 itself cannot be
    // installed beside the amd64 one: `bpftool_arm64` unpacks it).
    "libelf1:arm64",
    "zlib1g:arm64",
    "libcap2:arm64",
    // tests/tests/arm64.rs runs the arm64 agent under qemu-user.
    "qemu-user-static",
    // BGP (#48): BIRD is the speaker lockstep drives; FRR (bgpd, bfdd,
    // zebra) is the peer router the BGP tests read routes from.
    "bird2",
    "frr",
];

/// The foreign dpkg architecture the arm64 packages above come from.
const FOREIGN_ARCH: &str = "arm64";

const BPF_LINKER_VERSION: &str = "0.13.0";

/// The offline Kubernetes schema validator (PyPI; it ships the API schemas of
/// every Kubernetes release in the package, so validation needs no network).
const KUBERNETES_VALIDATE_VERSION: &str = "1.37.0";

/// The manifests `cargo xtask test` validates.
const MANIFESTS: &[&str] = &[
    "deploy/daemonset.yaml",
    "deploy/daemonset-cluster.yaml",
    "deploy/rbac.yaml",
    "deploy/crds/loadbalancerippools.lockstep.io.yaml",
    "deploy/crds/nodeipams.lockstep.io.yaml",
    "deploy/crds/podippools.lockstep.io.yaml",
    "deploy/examples/lb-service.yaml",
];

/// The installs `lockstep manifests` renders, one per mode, each validated
/// like the files above: (name under target/manifests/, arguments).
const RENDERED: &[(&str, &[&str])] = &[
    ("lb", &["--mode", "lb", "--service-monitor"]),
    (
        "lb-pools",
        &["--mode", "lb", "--lb-pool", "192.0.2.0/26", "--pools-only"],
    ),
    (
        "local",
        &[
            "--mode",
            "local",
            "--pool",
            "10.244.0.0/24",
            "--pool",
            "fd00:244::/112",
            "--namespace",
            "lockstep",
        ],
    ),
    (
        "lb-bgp",
        &[
            "--mode",
            "lb",
            "--bgp-asn",
            "64512",
            "--bgp-peer",
            "tor-a,192.0.2.1,64513",
            "--bgp-pool",
            "default",
            "--bird-image",
            "registry.example/bird:2.0",
        ],
    ),
    ("cleanup", &["--mode", "pod-cidr", "--cleanup"]),
    (
        "pod-cidr",
        &["--mode", "pod-cidr", "--non-masquerade", "10.96.0.0/12"],
    ),
    (
        "cluster",
        &[
            "--mode",
            "cluster",
            "--etcd",
            "https://10.0.0.10:2379",
            "--etcd-tls-secret",
            "lockstep-etcd-tls",
            "--service-monitor",
        ],
    ),
    (
        "multi-pool",
        &["--mode", "multi-pool", "--non-masquerade", "10.96.0.0/12"],
    ),
    (
        "cluster-bgp",
        &[
            "--mode",
            "cluster",
            "--etcd",
            "http://10.0.0.10:2379",
            "--bgp-asn",
            "64512",
            "--bgp-peer",
            "tor-a,192.0.2.1,64513",
            "--bgp-pool",
            "default",
            "--bird-image",
            "registry.example/bird:2.0",
        ],
    ),
    (
        "multi-pool-pools",
        &[
            "--mode",
            "multi-pool",
            "--pool",
            "10.244.0.0/16",
            "--pools-only",
        ],
    ),
    (
        "cluster-pools",
        &[
            "--mode",
            "cluster",
            "--etcd",
            "https://10.0.0.10:2379",
            "--pool",
            "10.244.0.0/16",
            "--lb-pool",
            "192.0.2.0/26",
            "--pools-only",
        ],
    ),
];

/// The rendered objects of a kind no Kubernetes schema holds, and the
/// CRD they are checked against.
const RENDERED_CUSTOM: &[(&str, &str)] = &[
    (
        "lb",
        "xtask/schemas/servicemonitors.monitoring.coreos.com.yaml",
    ),
    (
        "cluster",
        "xtask/schemas/servicemonitors.monitoring.coreos.com.yaml",
    ),
    (
        "lb-pools",
        "deploy/crds/loadbalancerippools.lockstep.io.yaml",
    ),
    (
        "cluster-pools",
        "deploy/crds/loadbalancerippools.lockstep.io.yaml",
    ),
    ("cluster-pools", "deploy/crds/podippools.lockstep.io.yaml"),
];

/// The alerts on lockstep's metrics (a PrometheusRule).
const RULES: &str = "deploy/prometheus-rules.yaml";

/// Custom objects and the CRD whose schema they are checked against.
const CUSTOM_OBJECTS: &[(&str, &str)] = &[
    (
        "deploy/examples/lb-pool.yaml",
        "deploy/crds/loadbalancerippools.lockstep.io.yaml",
    ),
    (
        "deploy/examples/nodeipam.yaml",
        "deploy/crds/nodeipams.lockstep.io.yaml",
    ),
    (
        "deploy/examples/pod-pool.yaml",
        "deploy/crds/podippools.lockstep.io.yaml",
    ),
];

/// Checks each object of a custom kind against its CRD's
/// openAPIV3Schema (jsonschema from kubernetes-validate's virtualenv),
/// strictly: an object with a field its schema does not name is refused,
/// as `kubectl apply --validate=strict` refuses it.
const VALIDATE_CUSTOM: &str = r#"
import sys, yaml, jsonschema
crd = yaml.safe_load(open(sys.argv[2]))
kind = crd["spec"]["names"]["kind"]
def closed(s):
    if isinstance(s, dict):
        if s.get("type") == "object" and "properties" in s and "additionalProperties" not in s:
            s["additionalProperties"] = False
        for v in s.values():
            closed(v)
    elif isinstance(s, list):
        for v in s:
            closed(v)
n = 0
for v in crd["spec"]["versions"]:
    schema = v["schema"]["openAPIV3Schema"]
    closed(schema)
    for doc in yaml.safe_load_all(open(sys.argv[1])):
        if doc and doc.get("kind") == kind and doc.get("apiVersion", "").endswith("/" + v["name"]):
            # apiVersion, kind and metadata are the API server's own.
            body = {k: v for k, v in doc.items() if k not in ("apiVersion", "kind", "metadata")}
            jsonschema.validate(body, schema)
            n += 1
if n == 0:
    sys.exit(sys.argv[1] + ": no " + kind + " checked")
print(sys.argv[1] + ": " + str(n) + " " + kind + " object(s) valid against " + sys.argv[2])
"#;

/// The virtualenv holding kubernetes-validate (under target/: build output,
/// re-created by setup when missing).
fn kubernetes_validate_venv() -> PathBuf {
    crate::root().join("target/tools/kubernetes-validate")
}

fn kubernetes_validate() -> anyhow::Result<()> {
    let venv = kubernetes_validate_venv();
    let bin = venv.join("bin/kubernetes-validate");
    if let Ok(out) = Command::new(&bin).arg("--version").output()
        && String::from_utf8_lossy(&out.stdout).contains(KUBERNETES_VALIDATE_VERSION)
    {
        println!("setup: kubernetes-validate {KUBERNETES_VALIDATE_VERSION} present");
        return Ok(());
    }
    run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
    run(Command::new(venv.join("bin/pip")).args([
        "install",
        "--quiet",
        &format!("kubernetes-validate=={KUBERNETES_VALIDATE_VERSION}"),
    ]))
}

/// Validates the manifests in deploy/ against the Kubernetes API schemas,
/// strictly (an unknown field is an error), offline.
///
/// # Errors
/// The validator is missing (run setup) or a manifest is refused.
pub fn validate_manifests() -> anyhow::Result<()> {
    let bin = kubernetes_validate_venv().join("bin/kubernetes-validate");
    if !bin.exists() {
        kubernetes_validate()?;
    }
    let rendered = render_manifests()?;
    run(Command::new(bin)
        .arg("--strict")
        .args(MANIFESTS)
        .args(&rendered)
        .current_dir(crate::root()))?;
    let python = kubernetes_validate_venv().join("bin/python");
    let dir = rendered_dir();
    let rendered_custom = RENDERED_CUSTOM
        .iter()
        .map(|(name, crd)| (dir.join(format!("{name}.yaml")), *crd));
    let custom = CUSTOM_OBJECTS
        .iter()
        .map(|(objects, crd)| (crate::root().join(objects), *crd));
    for (objects, crd) in custom.chain(rendered_custom) {
        run(Command::new(&python)
            .args(["-c", VALIDATE_CUSTOM])
            .arg(&objects)
            .arg(crd)
            .current_dir(crate::root()))?;
    }
    check_rules(&python)
}

fn rendered_dir() -> PathBuf {
    crate::root().join("target/manifests")
}

/// Renders every install of [`RENDERED`] with `lockstep manifests` (the
/// binary as `cargo run` builds it) into target/manifests/.
fn render_manifests() -> anyhow::Result<Vec<PathBuf>> {
    let dir = rendered_dir();
    std::fs::create_dir_all(&dir)?;
    let mut out = Vec::new();
    for (name, args) in RENDERED {
        let path = dir.join(format!("{name}.yaml"));
        let output = Command::new("cargo")
            .args([
                "run",
                "-q",
                "-p",
                "lockstep",
                "--bin",
                "lockstep",
                "--",
                "manifests",
            ])
            .args(*args)
            .current_dir(crate::root())
            .output()?;
        if !output.status.success() {
            bail!(
                "lockstep manifests {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&output.stderr)
            );
        }
        std::fs::write(&path, &output.stdout)?;
        eprintln!(
            "rendered {}: lockstep manifests {}",
            path.display(),
            args.join(" ")
        );
        out.push(path);
    }
    Ok(out)
}

/// The PrometheusRule's alerts checked by `promtool check rules`: its
/// `spec` is a rules file as Prometheus reads it.
fn check_rules(python: &Path) -> anyhow::Result<()> {
    let rules = crate::root().join("target/tools/lockstep-rules.yaml");
    run(Command::new(python)
        .args([
            "-c",
            "import sys, yaml\n\
             rule = yaml.safe_load(open(sys.argv[1]))\n\
             assert rule['kind'] == 'PrometheusRule', rule['kind']\n\
             yaml.safe_dump(rule['spec'], open(sys.argv[2], 'w'))",
            RULES,
        ])
        .arg(&rules)
        .current_dir(crate::root()))?;
    run(Command::new("promtool")
        .args(["check", "rules"])
        .arg(&rules))
}

fn quiet(cmd: &mut Command) -> bool {
    cmd.output().map(|o| o.status.success()).unwrap_or(false)
}

fn run(cmd: &mut Command) -> anyhow::Result<()> {
    eprintln!("+ {cmd:?}");
    let status = cmd.status().with_context(|| format!("{cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

fn installed(pkg: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", pkg])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
        .unwrap_or(false)
}

fn apt(missing: &[&str]) -> anyhow::Result<()> {
    if missing.is_empty() {
        println!("setup: all {} Debian packages present", PACKAGES.len());
        return Ok(());
    }
    run(Command::new("apt-get").arg("update").arg("-q"))?;
    run(Command::new("apt-get")
        .args(["install", "-y", "-q", "--no-install-recommends"])
        .args(missing)
        .env("DEBIAN_FRONTEND", "noninteractive"))
}

/// Adds dpkg's arm64 architecture (the next `apt-get update` fetches its
/// package lists; `apt` runs one, since the arm64 packages are missing).
fn multiarch() -> anyhow::Result<()> {
    let out = Command::new("dpkg")
        .arg("--print-foreign-architectures")
        .output()
        .context("dpkg --print-foreign-architectures")?;
    if String::from_utf8_lossy(&out.stdout)
        .lines()
        .any(|l| l.trim() == FOREIGN_ARCH)
    {
        println!("setup: dpkg architecture {FOREIGN_ARCH} present");
        return Ok(());
    }
    run(Command::new("dpkg").args(["--add-architecture", FOREIGN_ARCH]))
}

/// Debian's arm64 bpftool, for the arm64 image, unpacked under
/// `target/tools/bpftool-arm64/` (the package cannot be installed beside
/// the machine's own bpftool); the version is the amd64 one's, so both
/// images carry the same bpftool.
pub fn bpftool_arm64() -> anyhow::Result<()> {
    let version = Command::new("dpkg-query")
        .args(["-W", "-f=${Version}", "bpftool"])
        .output()
        .context("dpkg-query bpftool")?;
    let version = String::from_utf8_lossy(&version.stdout).trim().to_string();
    let dir = crate::root().join("target/tools/bpftool-arm64");
    let stamp = dir.join("version");
    if crate::image::bpftool_arm64().exists()
        && std::fs::read_to_string(&stamp).is_ok_and(|v| v == version)
    {
        println!("setup: bpftool {version} for arm64 present");
        return Ok(());
    }
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    let download = crate::root().join("target/tools/bpftool-arm64.download");
    if download.exists() {
        std::fs::remove_dir_all(&download)?;
    }
    std::fs::create_dir_all(&download)?;
    run(Command::new("apt-get")
        .args(["download", "-q"])
        .arg(format!("bpftool:{FOREIGN_ARCH}={version}"))
        .current_dir(&download))?;
    let deb = std::fs::read_dir(&download)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "deb"))
        .context("apt-get download left no .deb")?;
    run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&dir))?;
    std::fs::remove_dir_all(&download)?;
    std::fs::write(&stamp, &version)?;
    Ok(())
}

fn rust_src() -> anyhow::Result<()> {
    if !quiet(Command::new("rustc").args(["+nightly", "--version"])) {
        run(Command::new("rustup").args([
            "toolchain",
            "install",
            "nightly",
            "--profile",
            "minimal",
        ]))?;
    }
    let sysroot = Command::new("rustc")
        .args(["+nightly", "--print", "sysroot"])
        .output()?;
    let sysroot = String::from_utf8_lossy(&sysroot.stdout).trim().to_string();
    if Path::new(&sysroot)
        .join("lib/rustlib/src/rust/library/core/Cargo.toml")
        .exists()
    {
        println!("setup: nightly rust-src present");
    } else {
        run(Command::new("rustup").args([
            "component",
            "add",
            "rust-src",
            "--toolchain",
            "nightly",
        ]))?;
    }
    // `cargo xtask test` lints the eBPF programs with nightly's own tools.
    for (component, probe) in [("clippy", "clippy-driver"), ("rustfmt", "rustfmt")] {
        if quiet(Command::new("rustup").args(["which", "--toolchain", "nightly", probe])) {
            println!("setup: nightly {component} present");
            continue;
        }
        run(Command::new("rustup").args([
            "component",
            "add",
            component,
            "--toolchain",
            "nightly",
        ]))?;
    }
    Ok(())
}

/// The musl target the CNI plugin ships as, for this machine's architecture
/// (see `build_plugin` in xtask: glibc's start-up alone costs more than the
/// rest of a plugin call on the project VM).
pub fn plugin_target() -> String {
    format!("{}-unknown-linux-musl", std::env::consts::ARCH)
}

fn musl_target() -> anyhow::Result<()> {
    let target = plugin_target();
    let out = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .current_dir(crate::root())
        .output()
        .context("rustup target list")?;
    if String::from_utf8_lossy(&out.stdout)
        .lines()
        .any(|l| l.trim() == target)
    {
        println!("setup: Rust target {target} present");
        return Ok(());
    }
    run(Command::new("rustup")
        .args(["target", "add", &target])
        .current_dir(crate::root()))
}

fn bpf_linker() -> anyhow::Result<()> {
    let version = Command::new("bpf-linker").arg("--version").output();
    if let Ok(out) = version
        && String::from_utf8_lossy(&out.stdout).contains(BPF_LINKER_VERSION)
    {
        println!("setup: bpf-linker {BPF_LINKER_VERSION} present");
        return Ok(());
    }
    let path = format!(
        "/usr/lib/llvm-22/bin:{}",
        std::env::var("PATH").unwrap_or_default()
    );
    run(Command::new("cargo")
        .args([
            "install",
            "bpf-linker",
            "--locked",
            "--version",
            BPF_LINKER_VERSION,
            "--no-default-features",
            "--features",
            "llvm-22",
        ])
        .env("LLVM_PREFIX", "/usr/lib/llvm-22")
        .env("PATH", path))
}

fn bpffs() -> anyhow::Result<()> {
    let out = Command::new("stat")
        .args(["-f", "-c", "%T", "/sys/fs/bpf"])
        .output()?;
    if String::from_utf8_lossy(&out.stdout).trim() == "bpf_fs" {
        println!("setup: bpffs mounted at /sys/fs/bpf");
        return Ok(());
    }
    run(Command::new("mount").args(["-t", "bpf", "bpf", "/sys/fs/bpf"]))
}

/// Runs every setup step.
pub fn setup() -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    multiarch()?;
    let missing: Vec<&str> = PACKAGES.iter().copied().filter(|p| !installed(p)).collect();
    apt(&missing)?;
    bpftool_arm64()?;
    rust_src()?;
    musl_target()?;
    bpf_linker()?;
    bpffs()?;
    kubernetes_validate()?;
    lockstep_ebpf_build::check_prerequisites()?;
    println!("setup: done in {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}
