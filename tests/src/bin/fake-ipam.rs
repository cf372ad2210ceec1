//! A fake CNI IPAM plugin for lockstep's delegated-mode tests, so error
//! paths are tested for real (a hung, failing or garbling plugin) and every
//! invocation can be checked afterwards.
//!
//! Its behaviour is chosen by the `ipam.fake` object of its network config:
//! `{"mode": "ok" | "hang" | "fail" | "garbage" | "fixed", "log": "<file>",
//! "gc": true|false, "subnet": "10.99.0.0/24"}`. Every invocation appends one
//! JSON line to `log` (command, container ID, interface, stdin). In `ok` mode
//! addresses are handed out from `subnet` and remembered in `<log>.state`;
//! `fixed` returns the subnet's first host address to everyone; `hang`,
//! `fail` and `garbage` affect ADD only (DEL always succeeds, as the spec
//! wants). With `gc = true`, or a binary name containing `-gc` (VERSION gets
//! no network config), VERSION lists 1.1.0 and GC is accepted. With
//! `"slow_ms": N, "slow_prefix": "p"`, an ADD or DEL of a container whose
//! ID starts with `p` sleeps N ms once logged (a slow plugin beside fast ones).
//! Like host-local, it holds an exclusive lock (`<log>.lock`) while it
//! reads and writes its state, so concurrent invocations never hand out
//! one address twice.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::Ipv4Addr;

use serde_json::{Value, json};

fn main() {
    let mut stdin = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut stdin);
    let conf: Value = serde_json::from_slice(&stdin).unwrap_or(Value::Null);
    let command = std::env::var("CNI_COMMAND").unwrap_or_default();
    let container = std::env::var("CNI_CONTAINERID").unwrap_or_default();
    let ifname = std::env::var("CNI_IFNAME").unwrap_or_default();
    let fake = &conf["ipam"]["fake"];
    let mode = fake["mode"].as_str().unwrap_or("ok");
    let version = conf["cniVersion"].as_str().unwrap_or("1.0.0").to_string();
    // VERSION gets no network config, so GC support is also told by the
    // binary's name (`...-gc-...`).
    let gc = fake["gc"].as_bool() == Some(true)
        || std::env::args()
            .next()
            .is_some_and(|a| a.rsplit('/').next().is_some_and(|n| n.contains("-gc")));
    if let Some(log) = fake["log"].as_str()
        && let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
    {
        let line = json!({
            "command": command,
            "containerID": container,
            "ifname": ifname,
            "netns": std::env::var("CNI_NETNS").unwrap_or_default(),
            "cniPath": std::env::var("CNI_PATH").unwrap_or_default(),
            "stdin": conf,
        });
        let _ = writeln!(f, "{line}");
    }
    if let (Some(ms), Some(prefix)) = (fake["slow_ms"].as_u64(), fake["slow_prefix"].as_str())
        && matches!(command.as_str(), "ADD" | "DEL")
        && container.starts_with(prefix)
    {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
    // Held until the process exits: the state's read, change and write
    // are one step against other invocations.
    let _lock = fake["log"].as_str().and_then(|l| {
        use std::os::fd::AsRawFd as _;
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(format!("{l}.lock"))
            .ok()?;
        // SAFETY: flock on a descriptor this process owns, kept open in
        // `_lock` for as long as the lock must hold.
        (unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } == 0).then_some(f)
    });
    let state_path = fake["log"].as_str().map(|l| format!("{l}.state"));
    let mut state: BTreeMap<String, String> = state_path
        .as_ref()
        .and_then(|p| std::fs::read(p).ok())
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    let save = |state: &BTreeMap<String, String>| {
        if let Some(p) = &state_path {
            let _ = std::fs::write(p, serde_json::to_vec(state).unwrap_or_default());
        }
    };
    let key = format!("{container}/{ifname}");
    let subnet = fake["subnet"].as_str().unwrap_or("10.99.0.0/24");
    let base: Ipv4Addr = subnet
        .split('/')
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or(Ipv4Addr::new(10, 99, 0, 0));
    let fail = |code: u32, msg: &str| -> ! {
        println!(
            "{}",
            json!({"cniVersion": version, "code": code, "msg": msg})
        );
        std::process::exit(1);
    };
    match command.as_str() {
        "VERSION" => {
            let mut versions = vec!["0.3.1", "0.4.0", "1.0.0"];
            if gc {
                versions.push("1.1.0");
            }
            println!(
                "{}",
                json!({"cniVersion": version, "supportedVersions": versions})
            );
        }
        "ADD" => {
            match mode {
                "hang" => std::thread::sleep(std::time::Duration::from_secs(3600)),
                "fail" => fail(11, "fake-ipam was told to fail"),
                "garbage" => {
                    println!("this is not JSON {{{{");
                    return;
                }
                _ => {}
            }
            let addr = if mode == "fixed" {
                Ipv4Addr::from(u32::from(base) + 1)
            } else if let Some(a) = state.get(&key) {
                a.parse().unwrap_or(base)
            } else {
                let used: Vec<&String> = state.values().collect();
                let a = (1..250)
                    .map(|i| Ipv4Addr::from(u32::from(base) + i).to_string())
                    .find(|a| !used.contains(&a))
                    .unwrap_or_else(|| fail(2, "no address left"));
                a.parse().unwrap_or(base)
            };
            state.insert(key, addr.to_string());
            save(&state);
            let mut ip = json!({
                "address": format!("{addr}/24"),
                "gateway": Ipv4Addr::from(u32::from(base) + 254).to_string(),
            });
            if version.starts_with("0.") {
                // 0.3.x and 0.4.0 results carry the address family.
                ip["version"] = json!("4");
            }
            println!("{}", json!({"cniVersion": version, "ips": [ip]}));
        }
        "DEL" => {
            state.remove(&key);
            save(&state);
        }
        "CHECK" => {
            if !state.contains_key(&key) {
                fail(2, "fake-ipam holds nothing for this attachment");
            }
        }
        "GC" => {
            if !gc {
                fail(4, "GC is not supported");
            }
        }
        other => fail(4, &format!("unknown command {other}")),
    }
}
