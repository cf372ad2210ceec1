//! Unit tests of the configuration: parsing, defaults and every refusal.

use super::*;

fn parse(text: &str) -> Result<Config, ConfigError> {
    Config::parse(Path::new("/etc/lockstep/test.toml"), text)
}

#[test]
fn empty_file_is_the_default() {
    assert_eq!(parse("").expect("empty is valid"), Config::default());
}

#[test]
fn a_full_config_parses() {
    let c = parse(
        r#"
        node_name = "n1"
        state_dir = "/tmp/x"
        socket = "/tmp/x/s.sock"
        metrics_addr = "127.0.0.1:9000"
        reconcile_interval = "2s"
        non_masquerade_cidrs = ["10.0.0.0/8"]
        [datapath]
        pin_root = "/sys/fs/bpf/t"
        ipcache_max_entries = 64
        [[pools]]
        name = "a"
        ipv4 = ["10.1.0.0/24"]
        skip_masquerade = true
        "#,
    )
    .expect("valid");
    assert_eq!(c.reconcile_interval, Duration::from_secs(2));
    assert_eq!(c.pools.len(), 1);
    assert_eq!(c.datapath.ipcache_max_entries, 64);
}

#[test]
fn the_shipped_example_is_valid() {
    let text = include_str!("../../../../deploy/config.example.toml");
    let c = parse(text).expect("deploy/config.example.toml must stay valid");
    assert_eq!(c.pools.len(), 2);
    assert!(c.roles.ingress.announce);
    assert!(c.cni.install);
}

#[test]
fn the_conflist_chains_portmap_and_bandwidth_unless_told_otherwise() {
    use crate::config::ChainedPlugin;
    let c = parse("").expect("empty config");
    assert_eq!(
        c.cni.chain,
        [ChainedPlugin::Portmap, ChainedPlugin::Bandwidth]
    );
    let c = parse("[cni]\nchain = []").expect("no chain");
    assert!(c.cni.chain.is_empty());
    let c = parse("[cni]\nchain = [\"bandwidth\"]").expect("bandwidth only");
    assert_eq!(c.cni.chain, [ChainedPlugin::Bandwidth]);
}

#[test]
fn errors_name_the_file_and_field() {
    let cases: &[(&str, &str)] = &[
        ("bogus = 1", "bogus"),
        ("reconcile_interval = 5", "reconcile_interval"),
        ("reconcile_interval = \"1ms\"", "reconcile_interval"),
        (
            "reconcile_interval = \"100000000000y\"",
            "reconcile_interval",
        ),
        ("reconcile_interval = \"25h\"", "reconcile_interval"),
        ("[ipam]\ntimeout = \"1d\"", "ipam.timeout"),
        (
            "[cni]\nteardown_batch_window = \"21s\"",
            "cni.teardown_batch_window",
        ),
        ("[cni]\nchain = [\"portmap\", \"portmap\"]", "cni.chain"),
        ("[cni]\nchain = [\"firewall\"]", "firewall"),
        ("[[pools]]\nname = \"empty\"", "pools[0] (empty)"),
        (
            "[[pools]]\nname = \"lo\"\nipv4 = [\"127.0.0.0/24\"]",
            "pools[0] (lo)",
        ),
        (
            "[[pools]]\nname = \"m\"\nipv6 = [\"::ffff:10.98.0.0/120\"]",
            "IPv4-mapped",
        ),
        (
            "[[pools]]\nname = \"A\"\nipv4 = [\"10.0.0.0/24\"]\n[[pools]]\nname = \"a\"\nipv4 = [\"10.1.0.0/24\"]",
            "only by case",
        ),
        (
            "[datapath]\nipcache_max_entries = 0",
            "datapath.ipcache_max_entries",
        ),
        (
            "[masquerade]\nendpoint_share = 0.0",
            "masquerade.endpoint_share",
        ),
        (
            "[masquerade]\nendpoint_share = 1.5",
            "masquerade.endpoint_share",
        ),
        (
            "[masquerade]\nunreplied_timeout = \"10ms\"",
            "masquerade.unreplied_timeout",
        ),
        (
            "[datapath]\nipcache_max_entries = -1",
            "ipcache_max_entries",
        ),
        ("[datapath]\npin_root = \"relative\"", "datapath.pin_root"),
        ("[datapath]\ncolour = \"red\"", "colour"),
        ("state_dir = \"rel\"", "state_dir"),
        (
            "non_masquerade_cidrs = [\"10.0.0.1/8\"]",
            "non_masquerade_cidrs[0]",
        ),
        ("[masquerade]\nports = \"80-90\"", "masquerade.ports"),
        ("[masquerade]\nports = \"61000\"", "masquerade.ports"),
        (
            "[masquerade]\nudp_timeout = \"1ms\"",
            "masquerade.udp_timeout",
        ),
        ("[masquerade]\nbogus = 1", "bogus"),
        (
            "non_masquerade_cidrs = [\"10.0.0.0/33\"]",
            "non_masquerade_cidrs",
        ),
        (
            "[[pools]]\nname = \"a\"\nipv4 = [\"10.0.0.0/24\"]\n[[pools]]\nname = \"a\"\nipv4 = [\"10.1.0.0/24\"]",
            "pools[1].name",
        ),
        (
            "[[pools]]\nname = \"a\"\nipv4 = [\"10.0.0.0/24\"]\n[[pools]]\nname = \"b\"\nipv4 = [\"10.0.0.128/25\"]",
            "pools",
        ),
        (
            "[[pools]]\nname = \"a\"\nipv4 = [\"10.0.0.1/24\"]",
            "pools[0]",
        ),
        ("[[pools]]\nname = \"a\"\nipv4 = \"10.0.0.0/24\"", "ipv4"),
        ("[[pools]]\nname = \"a\"\nsize = 3", "size"),
        ("metrics_addr = \"localhost\"", "metrics_addr"),
        ("[ipam]\nmode = \"remote\"", "mode"),
        (
            "[ipam]\nmode = \"delegated\"\nconflist = \"rel.conflist\"",
            "ipam.conflist",
        ),
        ("[ipam]\ntimeout = \"1ms\"", "ipam.timeout"),
    ];
    for (text, field) in cases {
        let err = parse(text).expect_err(text).to_string();
        assert!(err.contains("/etc/lockstep/test.toml"), "{text}: {err}");
        assert!(err.contains(field), "{text}: expected {field} in: {err}");
    }
}

#[test]
fn kubernetes_without_a_source_of_pod_addresses_refuses_the_embedded_default() {
    let e = parse("[kubernetes]\n").expect_err("the embedded default under [kubernetes]");
    let ConfigError::Invalid { field, reason, .. } = e else {
        panic!("not a refusal: {e}");
    };
    assert_eq!(field, "pools");
    for choice in [
        "pod_cidr_pool",
        "[kubernetes.nodeipam]",
        "[cluster]",
        "pools = []",
    ] {
        assert!(reason.contains(choice), "{reason} names {choice}");
    }
    // Each choice is accepted.
    assert!(parse("pools = []\n[kubernetes]\n").is_ok());
    assert!(parse("[kubernetes]\npod_cidr_pool = \"pods\"\n").is_ok());
    assert!(parse("[[pools]]\nname = \"mine\"\nipv4 = [\"10.80.0.0/24\"]\n[kubernetes]\n").is_ok());
    // Without [kubernetes] the default stays (a single node of its own).
    assert!(parse("").is_ok());
}

#[test]
fn bgp_is_taken_alone_with_kubernetes_and_with_cluster() {
    let bgp = "[bgp]\nasn = 64512\nrouter_id = \"192.0.2.1\"\n";
    let c = parse(bgp).expect("[bgp] alone is valid");
    assert_eq!(c.bgp.map(|b| b.asn), Some(64512));
    let c = parse(&format!("pools = []\n{bgp}[kubernetes]\n"))
        .expect("[bgp] with [kubernetes] is valid");
    assert!(c.bgp.is_some() && c.kubernetes.is_some());
    let cluster = "[cluster]\netcd = [\"http://127.0.0.1:2379\"]\nnode_ip_v4 = \"192.0.2.1\"\n";
    let c = parse(&format!("{bgp}{cluster}")).expect("[bgp] with [cluster] is valid");
    assert!(c.bgp.is_some() && c.cluster.is_some());
    // Without Kubernetes, cluster mode has no Node to take the router ID
    // from.
    let e = parse(&format!("[bgp]\nasn = 64512\n{cluster}")).expect_err("no router ID");
    let ConfigError::Invalid { field, .. } = e else {
        panic!("not an Invalid: {e}");
    };
    assert_eq!(field, "bgp.router_id");
    // The router ID: required alone, the Node's InternalIP under
    // [kubernetes].
    let e = parse("[bgp]\nasn = 64512\n").expect_err("no router ID");
    let ConfigError::Invalid { field, .. } = e else {
        panic!("not an Invalid: {e}");
    };
    assert_eq!(field, "bgp.router_id");
    let c = parse("pools = []\n[bgp]\nasn = 64512\n[kubernetes]\n")
        .expect("the Node's InternalIP stands in under [kubernetes]");
    assert_eq!(c.bgp.as_ref().and_then(|b| b.router_id), None);
    let e = parse("[bgp]\nasn = 0\nrouter_id = \"192.0.2.1\"\n").expect_err("asn 0");
    assert!(e.to_string().contains("bgp.asn"), "{e}");
}
