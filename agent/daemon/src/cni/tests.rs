//! Table-driven tests of `parse_invocation` on malformed input (each must give
//! the spec's code and a message naming what is wrong), positive parses of
//! every command, and the result shapes of every version, with expected JSON
//! derived from the spec's text and examples.

use std::ffi::OsStr;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;

use serde_json::{Value, json};

use super::*;

/// An environment: (name, raw value) pairs.
type Env = Vec<(&'static str, Vec<u8>)>;

/// The variables a well-behaved runtime sets for `command`.
fn env(command: &str) -> Env {
    let mut vars: Env = vec![("CNI_COMMAND", command.into())];
    if matches!(command, "ADD" | "DEL" | "CHECK") {
        vars.push(("CNI_CONTAINERID", b"0123abcd-container".to_vec()));
        vars.push(("CNI_IFNAME", b"eth0".to_vec()));
        vars.push(("CNI_NETNS", b"/var/run/netns/test".to_vec()));
    }
    vars.push(("CNI_PATH", b"/opt/cni/bin:/usr/lib/cni".to_vec()));
    vars.push(("PATH", b"/usr/bin".to_vec()));
    vars
}

/// `env(command)` with `name` set to `value` (or removed if `None`).
fn env_with(command: &str, name: &'static str, value: Option<&[u8]>) -> Env {
    let mut vars: Env = env(command)
        .into_iter()
        .filter(|(n, _)| *n != name)
        .collect();
    if let Some(v) = value {
        vars.push((name, v.to_vec()));
    }
    vars
}

fn env_without(command: &str, names: &[&str]) -> Env {
    env(command)
        .into_iter()
        .filter(|(n, _)| !names.contains(n))
        .collect()
}

fn os(vars: &Env) -> Vec<(&OsStr, &OsStr)> {
    vars.iter()
        .map(|(n, v)| (OsStr::new(*n), OsStr::from_bytes(v)))
        .collect()
}

/// A full-plugin configuration in `version`, with `extra` merged on top.
fn full(version: &str, extra: Value) -> Vec<u8> {
    let mut config = json!({
        "cniVersion": version,
        "name": "podnet",
        "type": "lockstep",
    });
    merge(&mut config, extra);
    serde_json::to_vec(&config).expect("serialises")
}

/// A bridge configuration with lockstep-ipam, with `extra` merged on top.
fn ipam(version: &str, extra: Value) -> Vec<u8> {
    let mut config = json!({
        "cniVersion": version,
        "name": "bridgenet",
        "type": "bridge",
        "bridge": "cni0",
        "isGateway": true,
        "ipam": {"type": "lockstep-ipam", "pool": "pods"},
    });
    merge(&mut config, extra);
    serde_json::to_vec(&config).expect("serialises")
}

fn merge(base: &mut Value, extra: Value) {
    if let (Value::Object(b), Value::Object(e)) = (base, extra) {
        for (k, v) in e {
            match (b.get_mut(&k), v) {
                (Some(slot @ Value::Object(_)), v @ Value::Object(_)) => merge(slot, v),
                (_, v) => {
                    b.insert(k, v);
                }
            }
        }
    }
}

/// A valid 0.4.0 prevResult, with `extra` merged on top.
fn prev(extra: Value) -> Value {
    let mut result = json!({
        "cniVersion": "0.4.0",
        "interfaces": [
            {"name": "lxc12ab", "mac": "aa:bb:cc:00:00:01"},
            {"name": "eth0", "mac": "aa:bb:cc:00:00:02", "sandbox": "/var/run/netns/test"}
        ],
        "ips": [{"version": "4", "address": "10.1.0.5/16", "gateway": "10.1.0.1", "interface": 1}],
        "routes": [{"dst": "0.0.0.0/0"}]
    });
    merge(&mut result, extra);
    result
}

struct Case {
    name: &'static str,
    env: Env,
    stdin: Vec<u8>,
    code: u32,
    /// Every string must appear in the message.
    msg: &'static [&'static str],
}

macro_rules! cases {
    ($($name:literal: $env:expr, $stdin:expr => $code:literal, [$($msg:literal),* $(,)?];)*) => {
        vec![$(Case { name: $name, env: $env, stdin: $stdin, code: $code, msg: &[$($msg),*] }),*]
    };
}

fn malformed_cases() -> Vec<Case> {
    let ok_add = || full("1.1.0", json!({}));
    let long_socket = format!("/{}", "s".repeat(107));
    cases! {
        // --- environment: code 4, naming the variable ---
        "no CNI_COMMAND": env_without("ADD", &["CNI_COMMAND"]), ok_add() => 4, ["CNI_COMMAND"];
        "lowercase command": env_with("ADD", "CNI_COMMAND", Some(b"add")), ok_add() => 4, ["CNI_COMMAND", "\"add\""];
        "unknown command": env_with("ADD", "CNI_COMMAND", Some(b"INIT")), ok_add() => 4, ["CNI_COMMAND", "INIT"];
        "ADD without container id": env_without("ADD", &["CNI_CONTAINERID"]), ok_add() => 4, ["CNI_CONTAINERID", "ADD"];
        "ADD without netns": env_without("ADD", &["CNI_NETNS"]), ok_add() => 4, ["CNI_NETNS", "ADD"];
        "ADD without ifname": env_without("ADD", &["CNI_IFNAME"]), ok_add() => 4, ["CNI_IFNAME"];
        "ADD without all three": env_without("ADD", &["CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME"]), ok_add()
            => 4, ["CNI_CONTAINERID, CNI_NETNS, CNI_IFNAME"];
        "CHECK without netns": env_without("CHECK", &["CNI_NETNS"]), ok_add() => 4, ["CNI_NETNS", "CHECK"];
        "DEL without container id": env_without("DEL", &["CNI_CONTAINERID"]), ok_add() => 4, ["CNI_CONTAINERID", "DEL"];
        "DEL without ifname": env_without("DEL", &["CNI_IFNAME"]), ok_add() => 4, ["CNI_IFNAME", "DEL"];
        "GC without CNI_PATH": env_without("GC", &["CNI_PATH"]), ok_add() => 4, ["CNI_PATH", "GC"];
        "empty ifname counts as missing": env_with("ADD", "CNI_IFNAME", Some(b"")), ok_add() => 4, ["CNI_IFNAME"];
        "ifname of 16 bytes": env_with("ADD", "CNI_IFNAME", Some(b"eth0123456789abc")), ok_add() => 4, ["CNI_IFNAME", "at most 15"];
        "ifname with slash": env_with("ADD", "CNI_IFNAME", Some(b"eth/0")), ok_add() => 4, ["CNI_IFNAME", "'/'"];
        "ifname with colon": env_with("DEL", "CNI_IFNAME", Some(b"eth0:1")), ok_add() => 4, ["CNI_IFNAME", "':'"];
        "ifname with space": env_with("ADD", "CNI_IFNAME", Some(b"eth 0")), ok_add() => 4, ["CNI_IFNAME", "whitespace"];
        "ifname dot-dot": env_with("ADD", "CNI_IFNAME", Some(b"..")), ok_add() => 4, ["CNI_IFNAME", "'..'"];
        "ifname not UTF-8": env_with("ADD", "CNI_IFNAME", Some(b"eth\xff")), ok_add() => 4, ["CNI_IFNAME", "UTF-8"];
        "container id starting with dash": env_with("ADD", "CNI_CONTAINERID", Some(b"-abc")), ok_add() => 4, ["CNI_CONTAINERID", "start"];
        "container id with slash": env_with("DEL", "CNI_CONTAINERID", Some(b"abc/../x")), ok_add() => 4, ["CNI_CONTAINERID", "may only contain"];
        "relative netns": env_with("ADD", "CNI_NETNS", Some(b"netns/test")), ok_add() => 4, ["CNI_NETNS", "absolute"];
        "CNI_ARGS pair without =": env_with("ADD", "CNI_ARGS", Some(b"FOO")), ok_add() => 4, ["CNI_ARGS", "pair 1"];
        "CNI_ARGS empty pair": env_with("ADD", "CNI_ARGS", Some(b"A=1;;B=2")), ok_add() => 4, ["CNI_ARGS", "pair 2"];
        "CNI_ARGS two =": env_with("ADD", "CNI_ARGS", Some(b"A=1=2")), ok_add() => 4, ["CNI_ARGS", "more than one '='"];
        "CNI_ARGS empty key": env_with("ADD", "CNI_ARGS", Some(b"=1")), ok_add() => 4, ["CNI_ARGS", "empty key"];
        "CNI_ARGS repeated key": env_with("ADD", "CNI_ARGS", Some(b"A=1;A=2")), ok_add() => 4, ["CNI_ARGS", "\"A\" appears more than once"];
        "CNI_ARGS bad IP": env_with("ADD", "CNI_ARGS", Some(b"IgnoreUnknown=1;IP=10.0.0.300")), ok_add() => 4, ["CNI_ARGS", "IP=10.0.0.300", "not an IP address"];

        // --- stdin: codes 5 and 6 ---
        "oversized stdin": env("ADD"), vec![b' '; MAX_STDIN_BYTES + 1] => 5, ["larger than 1048576 bytes"];
        "empty stdin": env("ADD"), Vec::new() => 6, ["not valid JSON"];
        "truncated JSON": env("ADD"), b"{\"cniVersion\": \"1.0.0\", \"name\"".to_vec() => 6, ["not valid JSON"];
        "top level is an array": env("ADD"), b"[1, 2]".to_vec() => 6, ["(top level)", "an object", "an array"];
        "stdin not UTF-8": env("ADD"), b"{\"name\": \"\xff\"}".to_vec() => 6, ["not valid JSON"];

        // --- versions: codes 1 and 6 ---
        "version 0.2.0": env("ADD"), full("0.2.0", json!({})) => 1, ["cniVersion", "\"0.2.0\"", "incompatible CNI version"];
        "version 2.0.0": env("DEL"), full("2.0.0", json!({})) => 1, ["\"2.0.0\""];
        "version missing": env("ADD"), br#"{"name": "podnet", "type": "lockstep"}"#.to_vec() => 1, ["cniVersion", "missing"];
        "version is a number": env("ADD"), br#"{"cniVersion": 1, "name": "n", "type": "lockstep"}"#.to_vec() => 6, ["cniVersion", "a string", "a number"];
        "version not semver": env("ADD"), full("1.0", json!({})) => 6, ["cniVersion", "\"1.0\"", "MAJOR.MINOR.PATCH"];
        "CHECK in 0.3.1": env("CHECK"), full("0.3.1", json!({"prevResult": prev(json!({}))})) => 1, ["CHECK needs cniVersion 0.4.0", "0.3.1"];
        "GC in 1.0.0": env("GC"), full("1.0.0", json!({"cni.dev/valid-attachments": []})) => 1, ["GC needs cniVersion 1.1.0", "1.0.0"];
        "STATUS in 0.4.0": env("STATUS"), full("0.4.0", json!({})) => 1, ["STATUS needs cniVersion 1.1.0"];
        "prevResult version 0.2.0": env("CHECK"), full("1.0.0", json!({"prevResult": prev(json!({"cniVersion": "0.2.0"}))})) => 1, ["prevResult.cniVersion", "\"0.2.0\""];
        "VERSION with malformed version": env("VERSION"), br#"{"cniVersion": "one"}"#.to_vec() => 6, ["cniVersion", "\"one\""];
        "VERSION with bad JSON": env("VERSION"), b"{".to_vec() => 6, ["not valid JSON"];

        // --- configuration: codes 2, 6 and 7, naming the field ---
        "name missing": env("ADD"), br#"{"cniVersion": "1.0.0", "type": "lockstep"}"#.to_vec() => 7, ["`name` is required"];
        "name is a number": env("ADD"), full("1.0.0", json!({"name": 5})) => 6, ["`name`", "a string", "a number"];
        "name starts with dash": env("ADD"), full("1.0.0", json!({"name": "-net"})) => 7, ["`name`", "network name"];
        "type missing": env("ADD"), br#"{"cniVersion": "1.0.0", "name": "n"}"#.to_vec() => 7, ["`type` is required"];
        "type is an object": env("ADD"), full("1.0.0", json!({"type": {}})) => 6, ["`type`", "an object"];
        "not for lockstep": env("ADD"), ipam("1.0.0", json!({"ipam": {"type": "host-local"}})) => 7, ["\"bridge\"", "\"host-local\""];
        "ipam section on the full plugin": env("ADD"), full("1.0.0", json!({"ipam": {"type": "host-local"}})) => 2, ["`ipam`", "host-local"];
        "host-local subnet under lockstep-ipam": env("ADD"), ipam("0.4.0", json!({"ipam": {"subnet": "10.1.0.0/16"}})) => 2, ["`ipam.subnet`", "\"10.1.0.0/16\""];
        "host-local ranges under lockstep-ipam": env("ADD"), ipam("1.0.0", json!({"ipam": {"ranges": [[{"subnet": "10.1.0.0/16"}]]}})) => 2, ["`ipam.ranges`"];
        "ipam is a string": env("ADD"), ipam("1.0.0", json!({"ipam": "lockstep-ipam"})) => 6, ["`ipam`", "an object"];
        "mtu is a string": env("ADD"), full("1.0.0", json!({"mtu": "1500"})) => 6, ["`mtu`", "unsigned integer", "a string"];
        "mtu negative": env("ADD"), full("1.0.0", json!({"mtu": -1})) => 6, ["`mtu`", "unsigned integer"];
        "mtu too small": env("ADD"), full("1.0.0", json!({"mtu": 40})) => 7, ["`mtu`", "68 to 65535"];
        "agentSocket relative": env("ADD"), full("1.0.0", json!({"agentSocket": "run/l.sock"})) => 7, ["`agentSocket`", "absolute"];
        "agentSocket too long": env("ADD"), full("1.0.0", json!({"agentSocket": long_socket})) => 7, ["`agentSocket`", "107 bytes"];
        "agentSocket is a bool": env("ADD"), full("1.0.0", json!({"agentSocket": true})) => 6, ["`agentSocket`", "a boolean"];
        "pool with space": env("ADD"), full("1.0.0", json!({"pool": "my pool"})) => 7, ["`pool`", "pool name"];
        "ipam.pool is a number": env("ADD"), ipam("1.0.0", json!({"ipam": {"pool": 3}})) => 6, ["`ipam.pool`"];
        "runtimeConfig.ips not an array": env("ADD"), full("1.0.0", json!({"runtimeConfig": {"ips": "10.1.0.5"}})) => 6, ["`runtimeConfig.ips`", "an array"];
        "runtimeConfig.ips element a number": env("ADD"), full("1.0.0", json!({"runtimeConfig": {"ips": ["10.1.0.5", 7]}})) => 6, ["`runtimeConfig.ips[1]`"];
        "runtimeConfig.ips bad address": env("ADD"), full("1.0.0", json!({"runtimeConfig": {"ips": ["10.1.0.300/24"]}})) => 7, ["`runtimeConfig.ips[0]`", "not an IP address"];
        "args.cni.ips prefix 33": env("ADD"), full("1.0.0", json!({"args": {"cni": {"ips": ["10.1.0.5/33"]}}})) => 7, ["`args.cni.ips[0]`", "0 to 32"];
        "args.cni.ips v6 prefix 129": env("ADD"), full("1.0.0", json!({"args": {"cni": {"ips": ["fd00::5/129"]}}})) => 7, ["`args.cni.ips[0]`", "0 to 128"];
        "args.cni.ips empty prefix": env("ADD"), full("1.0.0", json!({"args": {"cni": {"ips": ["10.1.0.5/"]}}})) => 7, ["`args.cni.ips[0]`"];
        "conflicting requested prefixes": env("ADD"), full("1.0.0", json!({"runtimeConfig": {"ips": ["10.1.0.5/24"]}, "args": {"cni": {"ips": ["10.1.0.5/16"]}}}))
            => 7, ["`args.cni.ips[0]`", "conflicts with 10.1.0.5/24"];
        "runtimeConfig is a list": env("ADD"), full("1.0.0", json!({"runtimeConfig": []})) => 6, ["`runtimeConfig`", "an object"];
        "args.cni is a string": env("ADD"), full("1.0.0", json!({"args": {"cni": "ips"}})) => 6, ["`args.cni`", "an object"];
        "runtimeConfig.pool bad": env("ADD"), full("1.0.0", json!({"runtimeConfig": {"pool": ""}})) => 7, ["`runtimeConfig.pool`"];
        "dns.nameservers a string": env("ADD"), full("1.0.0", json!({"dns": {"nameservers": "10.0.0.10"}})) => 6, ["`dns.nameservers`", "an array"];
        "ipam.routes bad dst": env("ADD"), ipam("1.0.0", json!({"ipam": {"routes": [{"dst": "default"}]}})) => 7, ["`ipam.routes[0].dst`", "CIDR"];
        "ipam.routes gw family": env("ADD"), ipam("1.0.0", json!({"ipam": {"routes": [{"dst": "0.0.0.0/0", "gw": "fd00::1"}]}})) => 7, ["`ipam.routes[0].gw`", "family"];

        // --- prevResult ---
        "CHECK without prevResult": env("CHECK"), full("1.0.0", json!({})) => 7, ["`prevResult` is required for CHECK"];
        "CHECK with empty prevResult": env("CHECK"), full("1.0.0", json!({"prevResult": {}})) => 7, ["`prevResult` is required for CHECK"];
        "prevResult address without prefix": env("CHECK"), full("0.4.0", json!({"prevResult": prev(json!({"ips": [{"address": "10.1.0.5"}]}))})) => 7, ["`prevResult.ips[0].address`", "CIDR"];
        "prevResult ip version 5": env("CHECK"), full("0.4.0", json!({"prevResult": prev(json!({"ips": [{"version": "5", "address": "10.1.0.5/16"}]}))})) => 7, ["`prevResult.ips[0].version`", "\"4\" or \"6\""];
        "prevResult ip version contradicts": env("CHECK"), full("0.4.0", json!({"prevResult": prev(json!({"ips": [{"version": "6", "address": "10.1.0.5/16"}]}))})) => 7, ["`prevResult.ips[0].version`", "contradicts"];
        "prevResult interface out of range": env("CHECK"), full("1.0.0", json!({"prevResult": prev(json!({"cniVersion": "1.0.0", "ips": [{"address": "10.1.0.5/16", "interface": 2}]}))})) => 7, ["`prevResult.ips[0].interface`", "2 interfaces"];
        "prevResult interface without name": env("CHECK"), full("1.0.0", json!({"prevResult": {"interfaces": [{"mac": "aa:bb:cc:dd:ee:ff"}]}})) => 7, ["`prevResult.interfaces[0].name` is required"];
        "prevResult is a string": env("CHECK"), full("1.0.0", json!({"prevResult": "ok"})) => 6, ["`prevResult`", "an object"];
        "prevResult gateway family": env("CHECK"), full("1.1.0", json!({"prevResult": {"ips": [{"address": "10.1.0.5/16", "gateway": "fd00::1"}]}})) => 7, ["`prevResult.ips[0].gateway`"];
        "prevResult route scope 300": env("CHECK"), full("1.1.0", json!({"prevResult": {"routes": [{"dst": "0.0.0.0/0", "scope": 300}]}})) => 7, ["`prevResult.routes[0].scope`", "0 to 255"];
        "ADD with bad prevResult": env("ADD"), full("1.0.0", json!({"prevResult": {"ips": [{"address": "nope"}]}})) => 7, ["`prevResult.ips[0].address`"];

        // --- GC ---
        "GC without valid-attachments": env("GC"), full("1.1.0", json!({})) => 7, ["`cni.dev/valid-attachments` is required for GC"];
        "GC valid-attachments an object": env("GC"), full("1.1.0", json!({"cni.dev/valid-attachments": {"containerID": "a", "ifname": "eth0"}})) => 6, ["`cni.dev/valid-attachments`", "an array"];
        "GC entry a string": env("GC"), full("1.1.0", json!({"cni.dev/valid-attachments": ["abc/eth0"]})) => 6, ["`cni.dev/valid-attachments[0]`", "an object"];
        "GC entry without ifname": env("GC"), full("1.1.0", json!({"cni.dev/valid-attachments": [{"containerID": "abc"}]})) => 7, ["`cni.dev/valid-attachments[0].ifname` is required"];
        "GC entry bad container id": env("GC"), full("1.1.0", json!({"cni.dev/valid-attachments": [{"containerID": "a", "ifname": "eth0"}, {"containerID": "_x", "ifname": "eth0"}]})) => 7, ["`cni.dev/valid-attachments[1].containerID`"];
        "GC entry ifname too long": env("GC"), full("1.1.0", json!({"cni.dev/valid-attachments": [{"containerID": "abc", "ifname": "a-very-long-ifname"}]})) => 7, ["`cni.dev/valid-attachments[0].ifname`", "at most 15"];
        "GC entry containerID a number": env("GC"), full("1.1.0", json!({"cni.dev/valid-attachments": [{"containerID": 12, "ifname": "eth0"}]})) => 6, ["`cni.dev/valid-attachments[0].containerID`", "a string"];
    }
}

#[test]
fn malformed_inputs_give_the_spec_code_and_name_the_culprit() {
    let cases = malformed_cases();
    assert!(cases.len() >= 40, "only {} cases", cases.len());
    let mut failures = Vec::new();
    for case in &cases {
        match parse_invocation(os(&case.env), &case.stdin) {
            Ok(invocation) => failures.push(format!(
                "{}: accepted as {:?}",
                case.name,
                invocation.command()
            )),
            Err(e) => {
                let msg = e.to_string();
                if e.code().as_u32() != case.code {
                    failures.push(format!(
                        "{}: code {} (want {}): {msg}",
                        case.name,
                        e.code(),
                        case.code
                    ));
                }
                for want in case.msg {
                    if !msg.contains(want) {
                        failures.push(format!("{}: message {msg:?} lacks {want:?}", case.name));
                    }
                }
                let object = e.to_json("1.0.0");
                assert_eq!(object["code"], case.code, "{}", case.name);
                assert_eq!(object["msg"], msg.as_str(), "{}", case.name);
                assert!(
                    !object["details"].as_str().unwrap_or_default().is_empty(),
                    "{}: no details",
                    case.name
                );
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn case_names_are_unique() {
    let cases = malformed_cases();
    let mut names: Vec<_> = cases.iter().map(|c| c.name).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), cases.len());
}

fn parse_ok(vars: &Env, stdin: &[u8]) -> Invocation {
    match parse_invocation(os(vars), stdin) {
        Ok(invocation) => invocation,
        Err(e) => panic!(
            "rejected (code {}): {e}; details: {}",
            e.code(),
            e.details()
        ),
    }
}

fn request(invocation: Invocation) -> AttachmentRequest {
    match invocation {
        Invocation::Add(r) | Invocation::Del(r) | Invocation::Check(r) => r,
        other => panic!("not an attachment command: {other:?}"),
    }
}

#[test]
fn full_add_reads_everything() {
    let vars = env_with(
        "ADD",
        "CNI_ARGS",
        Some(b"IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;IP=10.1.0.99"),
    );
    let stdin = full(
        "1.1.0",
        json!({
            "cniVersions": ["0.4.0", "1.1.0"],
            "capabilities": {"ips": true},
            "someOtherPluginKey": {"anything": [1, 2, 3]},
            "agentSocket": "/run/lockstep/test.sock",
            "pool": "default",
            "mtu": 1450,
            "dns": {"nameservers": ["10.96.0.10"], "search": ["svc.cluster.local"]},
            "runtimeConfig": {"ips": ["10.1.0.5/24", "fd00::5"], "portMappings": []},
            "args": {"cni": {"ips": ["fd00::5", "10.1.0.6"], "pool": "blue", "labels": []}},
        }),
    );
    let r = request(parse_ok(&vars, &stdin));
    assert_eq!(r.attachment.container_id.as_str(), "0123abcd-container");
    assert_eq!(r.attachment.ifname.as_str(), "eth0");
    assert_eq!(
        r.netns.as_deref(),
        Some(std::path::Path::new("/var/run/netns/test"))
    );
    assert_eq!(r.cni_path.len(), 2);
    assert_eq!(r.args.get("K8S_POD_NAME"), Some("web-0"));
    let pod = r.args.pod().expect("kubelet named the pod");
    assert_eq!(
        (pod.namespace.as_str(), pod.name.as_str()),
        ("default", "web-0")
    );
    assert_eq!(pod.uid, None, "no K8S_POD_UID given");
    let c = &r.config;
    assert_eq!(c.cni_version, CniVersion::V1_1_0);
    assert_eq!(c.name, "podnet");
    assert_eq!(c.mode, PluginMode::Full);
    assert_eq!(
        c.options.agent_socket,
        std::path::Path::new("/run/lockstep/test.sock")
    );
    assert_eq!(c.options.mtu, Some(1450));
    assert_eq!(c.options.pool.as_deref(), Some("default"));
    // args.cni.pool applies when runtimeConfig has none; runtimeConfig has none here.
    assert_eq!(c.pool(), Some("blue"));
    // runtimeConfig first, duplicates dropped; CNI_ARGS IP ignored because args.cni.ips is set.
    let ips: Vec<String> = c.requested_ips.iter().map(ToString::to_string).collect();
    assert_eq!(ips, ["10.1.0.5/24", "fd00::5", "10.1.0.6"]);
    assert_eq!(
        c.dns.as_ref().map(|d| d.nameservers.clone()),
        Some(vec!["10.96.0.10".to_owned()])
    );
    assert_eq!(r.prev_result, None);
}

#[test]
fn defaults_and_precedence() {
    let vars = env_with("ADD", "CNI_ARGS", Some(b"IP=10.1.0.99/24"));
    let stdin = full(
        "0.3.1",
        json!({"runtimeConfig": {"pool": "red"}, "args": {"cni": {"pool": "blue"}}, "mtu": null}),
    );
    let c = request(parse_ok(&vars, &stdin)).config;
    assert_eq!(
        c.options.agent_socket,
        std::path::Path::new(DEFAULT_AGENT_SOCKET)
    );
    assert_eq!(c.options.mtu, None, "null counts as absent");
    assert_eq!(
        c.pool(),
        Some("red"),
        "runtimeConfig.pool wins over args.cni.pool"
    );
    // Without args.cni.ips the deprecated CNI_ARGS IP is honoured.
    assert_eq!(
        c.requested_ips,
        [RequestedIp {
            address: "10.1.0.99".parse().unwrap(),
            prefix_len: Some(24)
        }]
    );
}

#[test]
fn ipam_mode_reads_options_from_the_ipam_section() {
    let stdin = ipam(
        "0.4.0",
        json!({"mtu": "parent's business", "ipam": {"agentSocket": "/tmp/a.sock", "routes": [{"dst": "0.0.0.0/0", "gw": "10.1.0.1"}]}}),
    );
    let c = request(parse_ok(&env("ADD"), &stdin)).config;
    assert_eq!(c.mode, PluginMode::Ipam);
    assert_eq!(c.plugin_type, "bridge");
    assert_eq!(c.options.pool.as_deref(), Some("pods"));
    assert_eq!(c.options.agent_socket, std::path::Path::new("/tmp/a.sock"));
    assert_eq!(c.options.mtu, None, "a parent plugin's mtu is not ours");
    assert_eq!(
        c.options.routes,
        [Route::new(
            "0.0.0.0/0".parse().unwrap(),
            Some("10.1.0.1".parse().unwrap())
        )]
    );
}

#[test]
fn del_is_lenient() {
    // No netns: the namespace may be gone, DEL must still release.
    let vars = env_without("DEL", &["CNI_NETNS", "CNI_PATH"]);
    let r = request(parse_ok(&vars, &full("1.0.0", json!({}))));
    assert_eq!(r.netns, None);
    assert!(r.cni_path.is_empty());

    // 0.3.1 has no prevResult on DEL: whatever is there is ignored.
    let r = request(parse_ok(
        &env("DEL"),
        &full("0.3.1", json!({"prevResult": "garbage"})),
    ));
    assert_eq!((r.prev_result, r.prev_result_error), (None, None));

    // 0.4.0+: a bad prevResult is set aside with its error, not fatal.
    let r = request(parse_ok(
        &env("DEL"),
        &full("0.4.0", json!({"prevResult": {"ips": [{"address": "x"}]}})),
    ));
    assert_eq!(r.prev_result, None);
    let e = r.prev_result_error.expect("error kept for logging");
    assert_eq!(e.code(), ErrorCode::InvalidNetworkConfig);

    // An empty prevResult counts as absent.
    let r = request(parse_ok(
        &env("DEL"),
        &full("1.1.0", json!({"prevResult": {}})),
    ));
    assert_eq!((r.prev_result, r.prev_result_error), (None, None));

    // A good one is read.
    let r = request(parse_ok(
        &env("DEL"),
        &full("0.4.0", json!({"prevResult": prev(json!({}))})),
    ));
    assert_eq!(
        r.prev_result.expect("read").ips[0].address.to_string(),
        "10.1.0.5/16"
    );
}

#[test]
fn check_reads_prev_result_of_another_version() {
    // A 1.0.0 configuration whose cached prevResult was written under 0.4.0.
    let r = request(parse_ok(
        &env("CHECK"),
        &full("1.0.0", json!({"prevResult": prev(json!({}))})),
    ));
    let prev = r.prev_result.expect("CHECK has a prevResult");
    assert_eq!(prev.interfaces.len(), 2);
    assert_eq!(prev.ips[0].interface, Some(1));
    assert_eq!(prev.ips[0].gateway, Some("10.1.0.1".parse().unwrap()));
    // Written back in the configuration's version: no `version` field.
    assert_eq!(
        prev.to_json(CniVersion::V1_0_0)["ips"][0],
        json!({"address": "10.1.0.5/16", "gateway": "10.1.0.1", "interface": 1})
    );
}

#[test]
fn gc_status_and_version_need_no_attachment() {
    let vars = vec![
        ("CNI_COMMAND", b"GC".to_vec()),
        ("CNI_PATH", b"/opt/cni/bin".to_vec()),
        ("CNI_IFNAME", b"not/checked".to_vec()),
    ];
    let stdin = full(
        "1.1.0",
        json!({"cni.dev/valid-attachments": [{"containerID": "abc", "ifname": "eth0"}, {"containerID": "def", "ifname": "net1"}]}),
    );
    let Invocation::Gc(gc) = parse_ok(&vars, &stdin) else {
        panic!("not GC")
    };
    let kept: Vec<String> = gc
        .valid_attachments
        .iter()
        .map(|a| format!("{}/{}", a.container_id, a.ifname))
        .collect();
    assert_eq!(kept, ["abc/eth0", "def/net1"]);

    let gc_empty = full("1.1.0", json!({"cni.dev/valid-attachments": []}));
    let Invocation::Gc(gc) = parse_ok(&vars, &gc_empty) else {
        panic!("not GC")
    };
    assert!(
        gc.valid_attachments.is_empty(),
        "an explicit empty list is valid"
    );

    let vars = vec![("CNI_COMMAND", b"STATUS".to_vec())];
    let Invocation::Status(status) = parse_ok(&vars, &full("1.1.0", json!({}))) else {
        panic!("not STATUS")
    };
    assert_eq!(status.config.name, "podnet");

    let vars = vec![("CNI_COMMAND", b"VERSION".to_vec())];
    for (stdin, echoed) in [
        (&b""[..], "1.1.0"),
        (b"  \n", "1.1.0"),
        (b"{}", "1.1.0"),
        (br#"{"cniVersion": "0.4.0"}"#, "0.4.0"),
        // A runtime probing with a version we lack still gets our list.
        (br#"{"cniVersion": "0.2.0", "name": "x"}"#, "0.2.0"),
    ] {
        let Invocation::Version(v) = parse_ok(&vars, stdin) else {
            panic!("not VERSION")
        };
        assert_eq!(
            v.response().to_json(),
            json!({"cniVersion": echoed, "supportedVersions": ["0.3.1", "0.4.0", "1.0.0", "1.1.0"]})
        );
    }
}

#[test]
fn every_supported_version_parses_for_add_and_del() {
    for version in CniVersion::SUPPORTED {
        for command in ["ADD", "DEL"] {
            let inv = parse_ok(&env(command), &full(version.as_str(), json!({})));
            assert_eq!(inv.cni_version(), version);
            assert_eq!(inv.command().as_str(), command);
        }
    }
}

/// A result with every field set, so each version's omissions show.
fn rich_result() -> CniResult {
    CniResult {
        interfaces: vec![
            Interface {
                name: "lxc12ab".into(),
                mac: Some("aa:bb:cc:00:00:01".into()),
                mtu: Some(1450),
                ..Default::default()
            },
            Interface {
                name: "eth0".into(),
                mac: Some("aa:bb:cc:00:00:02".into()),
                mtu: Some(1450),
                sandbox: Some("/var/run/netns/test".into()),
                socket_path: Some("/run/sock".into()),
                pci_id: Some("0000:00:01.0".into()),
            },
        ],
        ips: vec![
            IpConfig {
                address: "10.1.0.5/16".parse().unwrap(),
                gateway: Some("10.1.0.1".parse().unwrap()),
                interface: Some(1),
            },
            IpConfig {
                address: "fd00::5/64".parse().unwrap(),
                gateway: None,
                interface: Some(1),
            },
        ],
        routes: vec![
            Route::new(
                "0.0.0.0/0".parse().unwrap(),
                Some("10.1.0.1".parse().unwrap()),
            ),
            Route {
                mtu: Some(1400),
                advmss: Some(1360),
                priority: Some(10),
                table: Some(100),
                scope: Some(0),
                ..Route::new("::/0".parse().unwrap(), None)
            },
        ],
        dns: Dns {
            nameservers: vec!["10.96.0.10".into()],
            domain: Some("cluster.local".into()),
            search: vec!["svc.cluster.local".into()],
            options: vec!["ndots:5".into()],
        },
    }
}

fn dns_json() -> Value {
    json!({"nameservers": ["10.96.0.10"], "domain": "cluster.local", "search": ["svc.cluster.local"], "options": ["ndots:5"]})
}

#[test]
fn result_shape_0_3_1_and_0_4_0() {
    // SPEC 0.4.0 "Result": ips carry "version"; interfaces name/mac/sandbox;
    // routes dst/gw.
    for version in [CniVersion::V0_3_1, CniVersion::V0_4_0] {
        let expected = json!({
            "cniVersion": version.as_str(),
            "interfaces": [
                {"name": "lxc12ab", "mac": "aa:bb:cc:00:00:01"},
                {"name": "eth0", "mac": "aa:bb:cc:00:00:02", "sandbox": "/var/run/netns/test"}
            ],
            "ips": [
                {"version": "4", "address": "10.1.0.5/16", "gateway": "10.1.0.1", "interface": 1},
                {"version": "6", "address": "fd00::5/64", "interface": 1}
            ],
            "routes": [{"dst": "0.0.0.0/0", "gw": "10.1.0.1"}, {"dst": "::/0"}],
            "dns": dns_json(),
        });
        assert_eq!(rich_result().to_json(version), expected, "{version}");
    }
}

#[test]
fn result_shape_1_0_0() {
    // SPEC 1.0.0: no `version` in ips; interface and route fields as 0.4.0.
    let expected = json!({
        "cniVersion": "1.0.0",
        "interfaces": [
            {"name": "lxc12ab", "mac": "aa:bb:cc:00:00:01"},
            {"name": "eth0", "mac": "aa:bb:cc:00:00:02", "sandbox": "/var/run/netns/test"}
        ],
        "ips": [
            {"address": "10.1.0.5/16", "gateway": "10.1.0.1", "interface": 1},
            {"address": "fd00::5/64", "interface": 1}
        ],
        "routes": [{"dst": "0.0.0.0/0", "gw": "10.1.0.1"}, {"dst": "::/0"}],
        "dns": dns_json(),
    });
    assert_eq!(rich_result().to_json(CniVersion::V1_0_0), expected);
}

#[test]
fn result_shape_1_1_0() {
    // SPEC 1.1.0: interfaces gain mtu/socketPath/pciID, routes gain
    // mtu/advmss/priority/table/scope.
    let expected = json!({
        "cniVersion": "1.1.0",
        "interfaces": [
            {"name": "lxc12ab", "mac": "aa:bb:cc:00:00:01", "mtu": 1450},
            {"name": "eth0", "mac": "aa:bb:cc:00:00:02", "mtu": 1450, "sandbox": "/var/run/netns/test",
             "socketPath": "/run/sock", "pciID": "0000:00:01.0"}
        ],
        "ips": [
            {"address": "10.1.0.5/16", "gateway": "10.1.0.1", "interface": 1},
            {"address": "fd00::5/64", "interface": 1}
        ],
        "routes": [
            {"dst": "0.0.0.0/0", "gw": "10.1.0.1"},
            {"dst": "::/0", "mtu": 1400, "advmss": 1360, "priority": 10, "table": 100, "scope": 0}
        ],
        "dns": dns_json(),
    });
    assert_eq!(rich_result().to_json(CniVersion::V1_1_0), expected);
}

#[test]
fn empty_parts_are_omitted() {
    assert_eq!(
        CniResult::default().to_json(CniVersion::V1_0_0),
        json!({"cniVersion": "1.0.0"})
    );
}

#[test]
fn ipam_result_shape() {
    // SPEC section 5 "Delegated plugins (IPAM)" and the host-local example:
    // no interfaces, no `interface` in ips.
    let ipam = IpamResult {
        ips: vec![IpamAddress {
            address: "10.1.0.5/16".parse().unwrap(),
            gateway: Some("10.1.0.1".parse().unwrap()),
        }],
        routes: vec![Route::new("0.0.0.0/0".parse().unwrap(), None)],
        dns: Dns {
            nameservers: vec!["10.1.0.1".into()],
            ..Dns::default()
        },
    };
    assert_eq!(
        ipam.to_json(CniVersion::V1_1_0),
        json!({
            "cniVersion": "1.1.0",
            "ips": [{"address": "10.1.0.5/16", "gateway": "10.1.0.1"}],
            "routes": [{"dst": "0.0.0.0/0"}],
            "dns": {"nameservers": ["10.1.0.1"]}
        })
    );
    assert_eq!(
        ipam.to_json(CniVersion::V0_3_1),
        json!({
            "cniVersion": "0.3.1",
            "ips": [{"version": "4", "address": "10.1.0.5/16", "gateway": "10.1.0.1"}],
            "routes": [{"dst": "0.0.0.0/0"}],
            "dns": {"nameservers": ["10.1.0.1"]}
        })
    );

    // Reading host-local's 0.4.0 output (delegated mode) and placing it on
    // the container interface gives the spec example's bridge result.
    let host_local = json!({
        "cniVersion": "0.4.0",
        "ips": [{"version": "4", "address": "10.1.0.5/16", "gateway": "10.1.0.1"}],
        "routes": [{"dst": "0.0.0.0/0"}],
        "dns": {"nameservers": ["10.1.0.1"]}
    });
    let read = IpamResult::from_json(&host_local, "result", CniVersion::V0_4_0).expect("reads");
    assert_eq!(read, ipam);
    let interfaces = vec![
        Interface {
            name: "cni0".into(),
            mac: Some("00:11:22:33:44:55".into()),
            ..Default::default()
        },
        Interface {
            name: "veth3243".into(),
            mac: Some("55:44:33:22:11:11".into()),
            ..Default::default()
        },
        Interface {
            name: "eth0".into(),
            mac: Some("99:88:77:66:55:44".into()),
            sandbox: Some("/var/run/netns/blue".into()),
            ..Default::default()
        },
    ];
    assert_eq!(
        CniResult::from_ipam(read, interfaces, 2).to_json(CniVersion::V1_1_0),
        json!({
            "cniVersion": "1.1.0",
            "ips": [{"address": "10.1.0.5/16", "gateway": "10.1.0.1", "interface": 2}],
            "routes": [{"dst": "0.0.0.0/0"}],
            "interfaces": [
                {"name": "cni0", "mac": "00:11:22:33:44:55"},
                {"name": "veth3243", "mac": "55:44:33:22:11:11"},
                {"name": "eth0", "mac": "99:88:77:66:55:44", "sandbox": "/var/run/netns/blue"}
            ],
            "dns": {"nameservers": ["10.1.0.1"]}
        })
    );
}

#[test]
fn conversion_between_versions() {
    // Up: 1.1.0 → read → 0.3.1 gains `version`, loses the 1.1.0-only fields.
    let v110 = rich_result().to_json(CniVersion::V1_1_0);
    let read = CniResult::from_json(&v110, "prevResult", CniVersion::V1_1_0).expect("reads");
    assert_eq!(read, rich_result(), "1.1.0 round trip is lossless");
    assert_eq!(
        read.to_json(CniVersion::V0_3_1),
        rich_result().to_json(CniVersion::V0_3_1)
    );
    // Down: 0.4.0 → read → 1.1.0 drops `version`.
    let v040 = rich_result().to_json(CniVersion::V0_4_0);
    let read = CniResult::from_json(&v040, "prevResult", CniVersion::V1_1_0).expect("reads");
    let up = read.to_json(CniVersion::V1_1_0);
    assert_eq!(
        up["ips"][1],
        json!({"address": "fd00::5/64", "interface": 1})
    );
    assert_eq!(up["cniVersion"], "1.1.0");
    // A 1.0.0 result without cniVersion inside is read as the config's version.
    let bare = json!({"ips": [{"address": "10.1.0.5/16"}]});
    let read = CniResult::from_json(&bare, "prevResult", CniVersion::V0_4_0).expect("reads");
    assert_eq!(read.to_json(CniVersion::V0_4_0)["ips"][0]["version"], "4");
}

#[test]
fn error_object_shape() {
    let e = parse_invocation(
        os(&env_with("ADD", "CNI_IFNAME", Some(b"eth/0"))),
        &full("1.0.0", json!({})),
    )
    .unwrap_err();
    let object = e.to_json("1.0.0");
    let keys: Vec<&String> = object.as_object().unwrap().keys().collect();
    assert_eq!(keys.len(), 4);
    assert_eq!(object["cniVersion"], "1.0.0");
    assert_eq!(object["code"], 4);
    assert!(
        object["msg"]
            .as_str()
            .unwrap()
            .starts_with("invalid environment variable CNI_IFNAME=\"eth/0\"")
    );

    // Causes go into details, not msg.
    let e = parse_invocation(os(&env("ADD")), b"{oops").unwrap_err();
    assert_eq!(
        e.to_string(),
        "the network configuration on stdin is not valid JSON"
    );
    assert!(e.details().contains("line 1 column 2"), "{}", e.details());

    // Codes the parser never produces still map as the spec says.
    let codes = [
        (
            CniError::UnknownContainer {
                container_id: "x".into(),
            },
            3,
        ),
        (
            CniError::TryAgainLater {
                reason: "agent restoring".into(),
            },
            11,
        ),
        (
            CniError::PluginNotAvailable {
                reason: "no agent".into(),
            },
            50,
        ),
        (
            CniError::LimitedConnectivity {
                reason: "datapath detached".into(),
            },
            51,
        ),
    ];
    for (e, code) in codes {
        assert_eq!(e.code().as_u32(), code, "{e}");
    }
}

#[test]
fn stdin_limit_and_error_version() {
    let exact = vec![b' '; MAX_STDIN_BYTES];
    assert_eq!(
        read_stdin(&exact[..]).expect("at the limit").len(),
        MAX_STDIN_BYTES
    );
    let over = vec![b' '; MAX_STDIN_BYTES + 1];
    let e = read_stdin(&over[..]).unwrap_err();
    assert_eq!(e.code(), ErrorCode::IoFailure);

    struct Broken;
    impl Read for Broken {
        fn read(&mut self, _: &mut [u8]) -> std::io::Result<usize> {
            Err(std::io::Error::other("pipe closed"))
        }
    }
    let e = read_stdin(Broken).unwrap_err();
    assert_eq!(e.code(), ErrorCode::IoFailure);
    assert!(e.details().contains("pipe closed"));

    assert_eq!(
        error_version(br#"{"cniVersion": "0.4.0"}"#),
        CniVersion::V0_4_0
    );
    assert_eq!(
        error_version(br#"{"cniVersion": "0.2.0"}"#),
        CniVersion::LATEST
    );
    assert_eq!(error_version(b"not json"), CniVersion::LATEST);
}

#[test]
fn the_pod_is_named_only_by_a_namespace_and_a_name() {
    let args = |text: &[u8]| {
        let vars = env_with("ADD", "CNI_ARGS", Some(text));
        request(parse_ok(&vars, &full("1.1.0", json!({})))).args
    };
    let full = args(b"K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web-1;K8S_POD_UID=u-1").pod();
    let full = full.expect("all three");
    assert_eq!(full.to_string(), "shop/web-1");
    assert_eq!(full.uid.as_deref(), Some("u-1"));
    assert_eq!(args(b"K8S_POD_NAME=web-1").pod(), None, "no namespace");
    assert_eq!(
        args(b"K8S_POD_NAMESPACE=shop;K8S_POD_NAME=").pod(),
        None,
        "empty name"
    );
    assert_eq!(args(b"IgnoreUnknown=1").pod(), None);
}
